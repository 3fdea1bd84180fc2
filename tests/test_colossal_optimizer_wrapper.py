"""Colossal-AI's OptimizerWrapper methods on every optimizer a Colossal face returns.

Reference: a plain fp32 model and torch's clip_grad_norm_ / clip_grad_value_ on the unscaled
gradients. Clipping must act on unscaled gradients (a scaled norm would be off by the scale,
2**8 here, far outside any tolerance below) and span every ZeRO shard, pipeline stage and
FSDP (DTensor) shard.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_mlp
from torch import nn

from mixprec.amp import convert_to_amp
from mixprec.booster import Booster
from mixprec.mixed_precision import FP16NaiveMixedPrecision, OptimizerWrapperAPI

WIDTH = 8
LR = 0.1
MAX_NORM = 0.05  # below these gradients' norm: every clip scales
SCALE = 2.0**8
# fp16 params against the fp32 reference: forward/backward in fp16 moves the norm by ~1e-3
# relative (fp16's 2**-11 unit roundoff over a few layers); a scaled norm would be 256x off.
FP16_VS_FP32 = {"rtol": 2e-2, "atol": 1e-4}
# The same fp32 math summed in another order (per shard / stage, then over ranks).
FP32_REORDER = {"rtol": 1e-5, "atol": 1e-6}


def _data(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, 4, generator=g)


def _reference(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: str, norm_type: float = 2.0
) -> tuple:
    """fp32 grads of the full batch, clipped as torch clips them; (norm, grads, stepped model)."""
    ref = copy.deepcopy(model).float()
    nn.functional.mse_loss(ref(x), y).backward()
    if clip == "norm":
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, norm_type=norm_type)
    else:
        norm = None
        torch.nn.utils.clip_grad_value_(ref.parameters(), 1e-3)
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    with torch.no_grad():
        for p in ref.parameters():
            p -= LR * p.grad
    return norm, grads, ref


def _boosted(mode: object, model: nn.Module) -> tuple:
    booster = Booster(mixed_precision=mode)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt, criterion, _, _ = booster.boost(model, opt, nn.MSELoss())
    return model, opt, criterion


MODES = {
    "fp32": ("fp32", {"rtol": 0, "atol": 1e-7}),
    "bf16": ("bf16", {"rtol": 2e-2, "atol": 1e-3}),  # bf16 autocast: 2**-8 unit roundoff
    "fp16": ("fp16", FP16_VS_FP32),
    "fp16_naive": (FP16NaiveMixedPrecision(initial_scale=SCALE), FP16_VS_FP32),
}


@pytest.mark.parametrize("name", MODES)
def test_clip_grad_by_norm_clips_unscaled_grads(name: str) -> None:
    mode, tol = MODES[name]
    x, y = _data()
    model = tiny_mlp(WIDTH)
    ref_norm, ref_grads, ref = _reference(model, x, y, "norm")
    model, opt, criterion = _boosted(mode, model)
    assert isinstance(opt, OptimizerWrapperAPI)
    assert opt.get_grad_norm() is None  # no norm computed yet
    opt.backward(criterion(model(x), y))
    norm = opt.clip_grad_by_norm(MAX_NORM)
    torch.testing.assert_close(norm.float(), ref_norm, **tol)
    assert opt.get_grad_norm() == float(norm)
    held = {id(p): p for g in opt.param_groups for p in g["params"]}
    assert len(held) == len(ref_grads)
    for (pname, ref_grad), p in zip(ref_grads.items(), opt.parameters, strict=True):
        torch.testing.assert_close(p.grad, ref_grad, **tol, msg=pname)
    assert not opt.step().skipped  # the unscaled grads are not unscaled again
    for (pname, w), p in zip(ref.named_parameters(), opt.parameters, strict=True):
        torch.testing.assert_close(p.detach().float(), w.detach(), **tol, msg=pname)


def test_clip_grad_by_value_clamps_unscaled_grads() -> None:
    x, y = _data()
    model = tiny_mlp(WIDTH)
    _, ref_grads, _ = _reference(model, x, y, "value")
    model, opt, criterion = _boosted(FP16NaiveMixedPrecision(initial_scale=SCALE), model)
    opt.backward(criterion(model(x), y))
    opt.clip_grad_by_value(1e-3)
    for (pname, ref_grad), p in zip(ref_grads.items(), opt.parameters, strict=True):
        assert p.grad.abs().max() <= 1e-3
        torch.testing.assert_close(p.grad, ref_grad, **FP16_VS_FP32, msg=pname)


def test_scale_loss_unscale_grad_unwrap_and_backward_by_grad() -> None:
    x, y = _data()
    model = tiny_mlp(WIDTH)
    twin = copy.deepcopy(model)
    model, opt, criterion = _boosted(FP16NaiveMixedPrecision(initial_scale=SCALE), model)
    twin, twin_opt, _ = _boosted(FP16NaiveMixedPrecision(initial_scale=SCALE), twin)
    loss = criterion(model(x), y)
    assert opt.scale_loss(loss).item() == loss.item() * SCALE  # a power of two: exact
    assert opt.unwrap() is opt.optim and isinstance(opt.unwrap(), torch.optim.SGD)
    # backward_by_grad(out, d loss/d out already times the scale) == backward(loss): bitwise
    out = twin(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    opt.backward((model(x).float() * w).sum())
    twin_opt.backward_by_grad(out, (w * SCALE).to(out.dtype))
    opt.unscale_grad()
    twin_opt.unscale_grad()
    for a, b in zip(opt.parameters, twin_opt.parameters, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="after the gradients were unscaled"):
        twin_opt.backward_by_grad(out, torch.ones_like(out))
    before = [p.detach().clone() for p in opt.parameters]
    grads = [p.grad.clone() for p in opt.parameters]
    assert not opt.step().skipped  # unscale_grad() then step(): unscaled once, not twice
    for p, b, g in zip(opt.parameters, before, grads, strict=True):
        torch.testing.assert_close(p.detach(), b - LR * g, rtol=0, atol=1e-7)


def test_error_if_nonfinite_and_extra_arguments() -> None:
    x, y = _data()
    model, opt, criterion = _boosted("fp32", tiny_mlp(WIDTH))
    opt.backward(criterion(model(x), y) * float("inf"))
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.clip_grad_by_norm(1.0, error_if_nonfinite=True)
    assert opt.step().skipped  # the overflowed step is still skipped
    with pytest.raises(TypeError, match="foreach"):
        opt.clip_grad_by_norm(1.0, foreach=True)
    with pytest.raises(ValueError, match="norm_type"):
        opt.get_grad_norm(norm_type=1.0)


def test_convert_to_amp_optimizer_has_the_api() -> None:
    x, y = _data()
    model = tiny_mlp(WIDTH)
    ref_norm, _, _ = _reference(model, x, y, "norm")
    model, opt, criterion = convert_to_amp(
        model, torch.optim.SGD(model.parameters(), lr=LR), nn.MSELoss(), "fp32"
    )
    opt.backward(criterion(model(x), y))
    torch.testing.assert_close(opt.clip_grad_by_norm(MAX_NORM), ref_norm, rtol=0, atol=1e-7)
    assert opt.get_grad_norm() == pytest.approx(float(ref_norm))


# ----- across ranks: ZeRO shards, DDP, FSDP2 (DTensor) and pipeline stages -----
PLUGIN_CLASS = {
    "zero": "ColossalZeroOptimizer",
    "zero_fp16": "ColossalZeroOptimizer",
    "ddp": "ColossalMixedPrecisionOptimizer",
    "fsdp": "ColossalMixedPrecisionOptimizer",
    "pipeline": "ColossalPipelineOptimizer",
}


def _plugin_case(rank: int, world: int, name: str, norm_type: float = 2.0) -> None:
    from mixprec.booster.plugin import (
        HybridParallelPlugin,
        LowLevelZeroPlugin,
        TorchDDPPlugin,
        TorchFSDPPlugin,
    )

    torch.manual_seed(0)
    model = tiny_mlp(WIDTH)
    x, y = _data()
    ref_norm, _, ref = _reference(model, x, y, "norm", norm_type)
    tol = FP32_REORDER
    mixed_precision = None
    if name == "zero_fp16":
        plugin = LowLevelZeroPlugin(stage=2, precision="fp16", initial_scale=SCALE)
        tol = FP16_VS_FP32
    elif name == "zero":
        plugin = LowLevelZeroPlugin(stage=1, precision="fp32")
    elif name == "ddp":
        plugin, mixed_precision = TorchDDPPlugin(), FP16NaiveMixedPrecision(initial_scale=SCALE)
        tol = FP16_VS_FP32
    elif name == "fsdp":
        plugin = TorchFSDPPlugin()
    else:
        plugin = HybridParallelPlugin(pp_size=2, num_microbatches=2, precision="fp32")
    booster = Booster(plugin=plugin, mixed_precision=mixed_precision)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    boosted, opt, criterion, _, _ = booster.boost(model, opt, nn.MSELoss())
    assert type(opt).__name__ == PLUGIN_CLASS[name]  # the plugin's class, declared by the face
    if name == "pipeline":  # both ranks are one replica's two stages: the whole batch
        booster.execute_pipeline(iter([(x, y)]), boosted, criterion, opt)
    else:  # data parallel: each rank its half; the mean of the halves' means is the batch's
        half = slice(rank * 4, rank * 4 + 4)
        opt.backward(criterion(boosted(x[half]), y[half]))
    norm = opt.clip_grad_by_norm(MAX_NORM, norm_type)
    torch.testing.assert_close(norm.reshape(()).float(), ref_norm, **tol, msg=name)
    assert opt.get_grad_norm(norm_type) == float(norm)
    assert not opt.step().skipped
    ref_weights = dict(ref.named_parameters())
    if name == "pipeline":
        got = {n: p for stage in boosted.stages for n, p in stage.module.named_parameters()}
        master_of = dict(zip(map(id, opt.lp_params), opt.hp_masters, strict=True))
        got = {n: master_of.get(id(p), p) for n, p in got.items()}
    else:
        got = dict(boosted.module.named_parameters() if name != "ddp" else [])
        if name == "ddp":
            got = {n.removeprefix("module."): p for n, p in boosted.named_parameters()}
    assert got, f"{name}: rank {rank} holds no params"
    for pname, p in got.items():
        w = p.full_tensor() if hasattr(p, "full_tensor") else p
        key = pname.removeprefix("module.")
        torch.testing.assert_close(w.detach().float(), ref_weights[key].detach(), **tol, msg=key)
    dist.barrier()


def _plugins_worker(rank: int, world: int) -> None:
    for name in ("zero", "zero_fp16", "ddp", "fsdp", "pipeline"):
        _plugin_case(rank, world, name)
    # Every norm torch's clip_grad_norm_ takes, over ZeRO's shards, FSDP2's DTensors and the
    # pipeline's stages (the max over ranks for inf, the sum of p-th powers otherwise).
    for name in ("zero", "fsdp", "pipeline"):
        for norm_type in (float("inf"), 1.0):
            _plugin_case(rank, world, name, norm_type)


def test_clip_grad_by_norm_spans_shards_and_stages() -> None:
    from dist_utils import spawn

    spawn(_plugins_worker, 2)


def test_wrapped_optimizer_pickles_as_its_api_class() -> None:
    import pickle

    model, opt, _ = _boosted("fp32", tiny_mlp(WIDTH))
    again = pickle.loads(pickle.dumps(opt))
    assert type(again).__name__ == "ColossalMixedPrecisionOptimizer"
    assert isinstance(again, OptimizerWrapperAPI) and again.get_grad_norm() is None


def test_get_grad_norm_after_a_step_that_clipped_by_max_norm() -> None:
    from mixprec.booster.plugin import LowLevelZeroPlugin

    x, y = _data()
    model = tiny_mlp(WIDTH)
    ref_norm, _, _ = _reference(model, x, y, "norm")
    booster = Booster(plugin=LowLevelZeroPlugin(precision="fp32", max_norm=MAX_NORM))
    model, opt, criterion, *_ = booster.boost(
        model, torch.optim.SGD(model.parameters(), lr=LR), nn.MSELoss()
    )
    booster.backward(criterion(model(x), y), opt)
    assert opt.get_grad_norm() is None
    result = opt.step()
    assert opt.get_grad_norm() == result.grad_norm
    torch.testing.assert_close(torch.tensor(opt.get_grad_norm()), ref_norm, **FP32_REORDER)


def test_colossal_optimizer_classes_are_declared_not_made_at_run_time() -> None:
    """Each optimizer class a Colossal face returns has its OptimizerWrapper subclass declared
    in mixprec.mixed_precision (no module __getattr__, no class written into its globals)."""
    import mixprec.mixed_precision as face
    from mixprec.core.multi_loss import MultiLossOptimizer
    from mixprec.core.optim import MixedPrecisionOptimizer
    from mixprec.parallel.pipeline.optim import PipelineOptimizer, PipelineZeroOptimizer
    from mixprec.parallel.zero import ZeroOptimizer

    assert not hasattr(face, "__getattr__")
    names = set(vars(face))
    declared = {
        face.ColossalMixedPrecisionOptimizer: MixedPrecisionOptimizer,
        face.ColossalMultiLossOptimizer: MultiLossOptimizer,
        face.ColossalZeroOptimizer: ZeroOptimizer,
        face.ColossalPipelineOptimizer: PipelineOptimizer,
        face.ColossalPipelineZeroOptimizer: PipelineZeroOptimizer,
    }
    for api, base in declared.items():
        assert issubclass(api, base) and issubclass(api, OptimizerWrapperAPI)
        assert api.__module__ == face.__name__ and getattr(face, api.__name__) is api
    _boosted("fp32", tiny_mlp(WIDTH))
    assert set(vars(face)) == names  # boosting wrote nothing into the module


def test_no_optimizer_class_is_assigned_at_run_time() -> None:
    """The faces build their optimizer classes; no class is set on an instance after it is
    built (an instance's class is what its constructor made it)."""
    import re
    from pathlib import Path

    import mixprec

    src = Path(mixprec.__file__).parent
    found = {
        f"mixprec/{path.relative_to(src).as_posix()}"
        for path in src.rglob("*.py")
        if re.search(r"\.__class__\s*=(?!=)", path.read_text())
    }
    assert not found, found


AMP_TYPES = {"fp32": None, "fp16_naive": "NAIVE", "fp16_apex": "APEX"}


def _face_optimizer(face: str, mode: str) -> object:
    from mixprec.amp_type import AMP_TYPE
    from mixprec.engine import initialize

    model = tiny_mlp(WIDTH)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    amp_type = AMP_TYPES[mode] and AMP_TYPE[AMP_TYPES[mode]]
    if face == "booster":
        return Booster(mixed_precision=mode).boost(model, sgd)[1]
    if face == "initialize":
        config = {} if amp_type is None else {"fp16": {"mode": amp_type}}
        return initialize(model, sgd, nn.MSELoss(), config=config)[0].optimizer
    return convert_to_amp(model, sgd, None, amp_type or "fp32")[1]


@pytest.mark.parametrize("mode", list(AMP_TYPES))
@pytest.mark.parametrize("face", ["booster", "initialize", "convert_to_amp"])
def test_each_face_builds_its_colossal_class(monkeypatch, face: str, mode: str) -> None:
    """The optimizer is of the face's Colossal class while its __init__ runs (built as that
    class), not given it afterwards."""
    from mixprec.amp import AMPOptimizer
    from mixprec.core.optim import MixedPrecisionOptimizer
    from mixprec.mixed_precision import ColossalMixedPrecisionOptimizer, ColossalMultiLossOptimizer

    one_loss = AMPOptimizer if face == "convert_to_amp" else ColossalMixedPrecisionOptimizer
    expected = ColossalMultiLossOptimizer if mode == "fp16_apex" else one_loss
    built: list[type] = []
    init = MixedPrecisionOptimizer.__init__

    def spy(self: MixedPrecisionOptimizer, *args: object, **kwargs: object) -> None:
        built.append(type(self))
        init(self, *args, **kwargs)

    monkeypatch.setattr(MixedPrecisionOptimizer, "__init__", spy)
    opt = _face_optimizer(face, mode)
    assert type(opt) is expected and built == [expected]


def test_engine_refuses_an_optimizer_without_colossal_methods() -> None:
    """Colossal's Engine steps an OptimizerWrapper (backward_by_grad, clip_grad_by_norm): a
    MixedPrecisionOptimizer built elsewhere is refused, naming what to pass."""
    from mixprec.core.optim import MixedPrecisionOptimizer
    from mixprec.core.policy import preset
    from mixprec.core.prepare import prepare_model
    from mixprec.engine import Engine

    model = prepare_model(tiny_mlp(WIDTH), preset("fp32"))
    plain = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    with pytest.raises(TypeError, match=r"got a MixedPrecisionOptimizer.*initialize, Booster"):
        Engine(model, plain)
    assert not isinstance(plain, OptimizerWrapperAPI)  # refused as it was, not converted


def test_booster_refuses_a_plugin_optimizer_without_colossal_methods() -> None:
    from mixprec.booster.plugin.plugin_base import Plugin
    from mixprec.core.optim import MixedPrecisionOptimizer

    class BarePlugin(Plugin):
        def configure(self, model, optimizer, mixed_precision, device):  # noqa: ANN001, ANN202
            boosted = mixed_precision.convert_module(model.to(device))
            return boosted, MixedPrecisionOptimizer(optimizer)

    model = tiny_mlp(WIDTH)
    with pytest.raises(TypeError, match="BarePlugin.configure returned a MixedPrecisionOptimizer"):
        Booster(plugin=BarePlugin()).boost(model, torch.optim.SGD(model.parameters(), lr=LR))
