"""compile_step against each face's own eager step; skips bitwise; no host sync; no graph break.

Most tests run the step with compile=False: the same functional program, executed eagerly
(seconds cheaper than compiling). A few compile it: with backend="eager" (dynamo only: what
counts graph breaks) and one with inductor, the default, marked slow (~25 s a compile here).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
from conftest import CountHostSyncs
from dist_utils import assert_same_on_every_rank, spawn
from tolerances import fp32_rounding
from torch import nn

import mixprec
import mixprec.paddle as paddle_amp
from mixprec.apex import amp as apex_amp
from mixprec.bench.models import ModelSpec, build_model, make_batch, make_criterion
from mixprec.core import compiled_step
from mixprec.core.compiled_step import (
    CPU_FUSION_OPTIONS,
    CPU_INDUCTOR_OPTIONS,
    CompileStepError,
    _with_cpu_options,
    compile_step,
)

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

# fp16 params written from fp32 masters: a 1-ulp master difference moves the fp16 rounding
# by at most one fp16 ulp (2**-10 relative) where it sits on a rounding boundary.
FP16_PARAM_ROUNDING = {"rtol": 2**-10, "atol": 2**-14}
# O3 steps fp16 params without masters: torch's optimizer rounds each intermediate of the
# update (unscale, decay, momentum, step) to fp16, the fused update rounds once at the end:
# a few fp16 ulps (2**-11 at |x| < 1) apart after 3 steps.
PURE_FP16 = {"rtol": 0, "atol": 2**-10}
# Inductor fuses the forward: bf16/fp16 intermediates an eager op would round stay fp32 in
# registers, so activations differ by up to one low-precision ulp (bf16: 2**-8) and the
# update by lr times that: 3 SGD steps at lr 0.1 of grads < 1 stay within 2e-3.
COMPILED_LOW_PRECISION = {"rtol": 2e-3, "atol": 2e-3}


def make_model(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width, 2 * width), nn.LayerNorm(2 * width), nn.ReLU(), nn.Linear(2 * width, 4)
    )


def batch(step: int, width: int = 8, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(torch.get_default_device()).manual_seed(step)
    x = torch.randn(16, width, generator=gen)
    return x.to(dtype), torch.randn(16, 4, generator=gen)


def face_batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Paddle's pure-fp16 model takes fp16 inputs (decorate casts no inputs, as Paddle)."""
    return batch(step, dtype=torch.float16 if name.startswith("paddle") else torch.float32)


SGD = {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
ADAMW = {"lr": 0.01, "weight_decay": 0.1}

# face -> build(optimizer class, kwargs) -> (model, optimizer, criterion, eager_step, scaler)
FACES = {}


def face(name):
    def register(fn):
        FACES[name] = fn
        return fn

    return register


def _core_eager(model, opt, crit):
    def step(x, y):
        opt.zero_grad()
        opt.backward(crit(model(x), y))
        opt.step()

    return step


def _convert(mode, config=None):
    def build(opt_cls, kwargs):
        model = make_model()
        opt = opt_cls(model.parameters(), **kwargs)
        model, opt, crit = mixprec.convert_to_amp(model, opt, nn.MSELoss(), mode, config)
        return model, opt, crit, _core_eager(model, opt, crit), None

    return build


FACES["fp32"] = _convert("fp32")
FACES["bf16"] = _convert("bf16")
FACES["fp16"] = _convert("fp16", {"init_scale": 2.0**10, "growth_interval": 2})
FACES["fp16_naive"] = _convert(mixprec.AMP_TYPE.NAIVE, {"initial_scale": 2.0**10})
FACES["apex_O3"] = _convert(mixprec.AMP_TYPE.APEX, {"opt_level": "O3"})


@face("booster_bf16")
def _booster(opt_cls, kwargs):
    model = make_model()
    opt = opt_cls(model.parameters(), **kwargs)
    booster = mixprec.Booster(mixed_precision="bf16")
    model, opt, crit, _, _ = booster.boost(model, opt, nn.MSELoss())
    return model, opt, crit, _core_eager(model, opt, crit), None


@face("engine_naive_clip")
def _engine(opt_cls, kwargs):
    model = make_model()
    opt = opt_cls(model.parameters(), **kwargs)
    config = {
        "fp16": {"mode": mixprec.AMP_TYPE.NAIVE, "initial_scale": 2.0**10},
        "clip_grad_norm": 0.05,  # below the grad norm: every step clips
    }
    engine, *_ = mixprec.initialize(model, opt, nn.MSELoss(), config=config, verbose=False)

    def step(x, y):
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()

    return engine.model, engine.optimizer, engine.criterion, step, None


@face("apex_O2")
def _apex(opt_cls, kwargs):
    model = make_model()
    opt = opt_cls(model.parameters(), **kwargs)
    model, opt = apex_amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)
    crit = nn.MSELoss()

    def step(x, y):
        loss = crit(model(x).float(), y)
        with apex_amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()

    return model, opt, lambda out, y: crit(out.float(), y), step, None


@face("paddle_O2")
def _paddle(opt_cls, kwargs):
    model = make_model()
    opt = opt_cls(model.parameters(), **kwargs)
    model, opt = paddle_amp.decorate(models=model, optimizers=opt, level="O2")
    scaler = paddle_amp.GradScaler(
        device=torch.get_default_device().type, init_loss_scaling=1024, incr_every_n_steps=2
    )
    crit = nn.MSELoss()

    def loss_of(out, y):
        return crit(out.float(), y)

    def step(x, y):
        scaled = scaler.scale(loss_of(model(x), y))
        scaled.backward()
        scaler.minimize(opt, scaled)
        opt.clear_grad()

    return model, opt, loss_of, step, scaler


def state_of(model, opt, scaler=None) -> list[torch.Tensor]:
    """Every tensor a step may write: params, buffers, masters, optimizer state, scale."""
    out = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
    out += [m.detach().clone() for m in getattr(opt, "hp_masters", [])]
    for state in opt.state.values():
        out += [v.clone() for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    own = getattr(opt, "scaler", None)
    if own is not None:
        out += [own._scale.clone(), own._growth_tracker.clone(), own._hysteresis_tracker.clone()]
    if scaler is not None:
        out += [scaler._scale.clone(), scaler._growth_tracker.clone()]
    return out


def assert_states_close(a, b, **tol) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.dtype == y.dtype, i
        torch.testing.assert_close(x.float(), y.float(), msg=f"state tensor {i}", **tol)


def fp16_face(name: str) -> bool:
    return name in ("fp16_naive", "apex_O3", "apex_O2", "paddle_O2", "engine_naive_clip")


@pytest.mark.parametrize("name", sorted(FACES))
def test_functional_step_equals_the_face_eager_step(name):
    opt_cls, kwargs = (torch.optim.AdamW, ADAMW) if "O3" not in name else (torch.optim.SGD, SGD)
    model, opt, _, eager, scaler = FACES[name](opt_cls, kwargs)
    for i in range(3):
        eager(*face_batch(name, i))
    reference = state_of(model, opt, scaler)
    model, opt, crit, _, scaler = FACES[name](opt_cls, kwargs)
    step = compile_step(model, opt, crit, scaler=scaler, compile=False)
    for i in range(3):
        loss = step(*face_batch(name, i))
    assert loss.dim() == 0
    tol = FP16_PARAM_ROUNDING if fp16_face(name) else fp32_rounding()
    tol = PURE_FP16 if name == "apex_O3" else tol
    assert_states_close(state_of(model, opt, scaler), reference, **tol)


@pytest.mark.parametrize("name", ["fp16_naive", "apex_O2", "paddle_O2", "fp16"])
def test_a_skipped_step_changes_nothing_bit_for_bit(name):
    model, opt, crit, _, scaler = FACES[name](torch.optim.AdamW, ADAMW)
    step = compile_step(model, opt, crit, scaler=scaler, compile=False)
    step(*face_batch(name, 0))  # optimizer state exists and is non-zero
    n_scaler = 3 if scaler is None else 2  # the scale and trackers move by the scaler's rule
    before = state_of(model, opt, scaler)[:-n_scaler]
    x, y = face_batch(name, 1)
    x[0, 0] = float("inf")  # inf input: inf/nan grads
    step(x, y)
    after = state_of(model, opt, scaler)[:-n_scaler]
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"state tensor {i} changed")
    assert int(step.sync_counters()) == 1


def test_scale_follows_update_scale_with_hysteresis():
    """fp16_naive's hysteresis 2: the first overflow spends it, the second halves the scale."""
    model, opt, crit, _, _ = FACES["fp16_naive"](torch.optim.SGD, SGD)
    step = compile_step(model, opt, crit, compile=False)
    x, y = batch(0)
    x[0, 0] = float("nan")
    step(x, y)
    assert opt.scaler.scale == 2.0**10
    assert int(opt.scaler._hysteresis_tracker) == 1
    step(x, y)
    assert opt.scaler.scale == 2.0**9


def test_switching_between_compiled_and_eager_steps_continues_one_run():
    model, opt, crit, eager, _ = FACES["fp16_naive"](torch.optim.Adam, {"lr": 0.01})
    for i in range(4):
        eager(*batch(i))
    reference = state_of(model, opt)
    model, opt, crit, eager, _ = FACES["fp16_naive"](torch.optim.Adam, {"lr": 0.01})
    step = compile_step(model, opt, crit, compile=False)
    eager(*batch(0))
    step(*batch(1))
    eager(*batch(2))
    step(*batch(3))
    assert_states_close(state_of(model, opt), reference, **FP16_PARAM_ROUNDING)
    assert opt.state_dict()["state"][0]["step"] == 4


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "fp16_naive", "apex_O2", "paddle_O2"])
def test_the_step_reads_nothing_on_the_host(monkeypatch, name):
    model, opt, crit, _, scaler = FACES[name](torch.optim.AdamW, ADAMW)
    step = compile_step(model, opt, crit, scaler=scaler, compile=False)
    step(*face_batch(name, 0))  # first call: lazy state creation may read shapes, never values
    syncs = CountHostSyncs(monkeypatch)
    x, y = face_batch(name, 1)
    x[0, 0] = float("inf")  # a skipped step too: still no host branch
    step(x, y)
    step(*face_batch(name, 2))
    assert syncs.calls == []


def _graph_breaks(model, opt, crit, x, y, scaler=None) -> int:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = compile_step(model, opt, crit, scaler=scaler, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to eager would warn: fail instead
        step(x, y)
        step(x, y)
    assert step.compiled
    return sum(torch._dynamo.utils.counters["graph_break"].values())


@pytest.mark.parametrize("name", ["fp16_naive", "apex_O2", "paddle_O2"])
def test_no_graph_break_mlp(name):
    """paddle_O2 keeps make_model's LayerNorm fp32 in an fp32_region: traced, no break."""
    model, opt, crit, _, scaler = FACES[name](torch.optim.AdamW, ADAMW)
    assert _graph_breaks(model, opt, crit, *face_batch(name, 0), scaler=scaler) == 0


@pytest.mark.parametrize("model_name", ["vit", "resnet"])
def test_no_graph_break_bench_models(model_name):
    spec = {
        "vit": ModelSpec(name="vit", width=16, depth=1, batch=4, heads=2, image_size=8),
        "resnet": ModelSpec(name="resnet", width=4, depth=1, batch=4, image_size=8),
    }[model_name]
    torch.manual_seed(0)
    model = build_model(spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, opt, crit = mixprec.convert_to_amp(model, opt, make_criterion(spec), "bf16")
    assert _graph_breaks(model, opt, crit, *make_batch(spec, seed=0)) == 0


@pytest.mark.slow
def test_inductor_step_equals_the_eager_step():
    """The default backend (one compile: ~25 s here) on the master-weight path: fp16 forward,
    fp32 masters, hysteresis; bf16 autocast's compiled numerics are in bench_static.py."""
    for name, tol in [("fp16_naive", COMPILED_LOW_PRECISION)]:
        model, opt, _, eager, _ = FACES[name](torch.optim.SGD, SGD)
        for i in range(3):
            eager(*batch(i))
        reference = state_of(model, opt)
        model, opt, crit, _, _ = FACES[name](torch.optim.SGD, SGD)
        step = compile_step(model, opt, crit)
        assert step.compile_options["options"]["cpp_wrapper"] is True  # the C++ wrapper
        for i in range(3):
            step(*batch(i))
        assert step.compiled
        assert_states_close(state_of(model, opt), reference, **tol)
        x, y = batch(3)
        x[0, 0] = float("inf")
        before = state_of(model, opt)
        step(x, y)  # skipped: masters, params and momentum bitwise unchanged
        after = state_of(model, opt)
        n_model = len(list(model.parameters())) + len(list(model.buffers()))
        for a, b in zip(before[:n_model], after[:n_model], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cpu_options_join_only_an_inductor_compile_without_mode():
    plain = {"fullgraph": True}
    both = {**CPU_FUSION_OPTIONS, **CPU_INDUCTOR_OPTIONS}
    assert _with_cpu_options(plain, "cpu", True) == {**plain, "options": both}
    assert _with_cpu_options(plain, "cpu", False) == {**plain, "options": CPU_FUSION_OPTIONS}
    mine = {"options": {"cpp_wrapper": False, "max_fusion_buffer_group_pairwise_attempts": 64}}
    assert _with_cpu_options(mine, "cpu", True)["options"] == mine["options"]  # the caller's win
    for options, device in [
        (plain, "cuda"),
        ({"backend": "eager"}, "cpu"),
        ({"backend": "aot_eager"}, "cpu"),
        ({"mode": "max-autotune-no-cudagraphs"}, "cpu"),  # torch.compile: mode or options
    ]:
        assert _with_cpu_options(options, device, True) is options


@pytest.mark.slow
def test_a_cpu_options_build_failure_compiles_again_without_them(monkeypatch, caplog):
    """No eager fallback (nor its warning) while inductor's Python wrapper still compiles."""
    model, opt, crit, _, _ = FACES["bf16"](torch.optim.SGD, SGD)
    broken = {**CPU_INDUCTOR_OPTIONS, "cpp.cxx": (None, "/nonexistent/c++")}
    monkeypatch.setattr(compiled_step, "CPU_INDUCTOR_OPTIONS", broken)
    torch._dynamo.reset()
    step = compile_step(model, opt, crit)
    assert step.compile_options["options"] == {**CPU_FUSION_OPTIONS, **broken}
    with warnings.catch_warnings(), caplog.at_level("INFO", logger="mixprec"):
        warnings.simplefilter("error", RuntimeWarning)
        step(*batch(0))
    assert step.compiled and "options" not in step.compile_options
    assert "compiling without them" in caplog.text


def test_compile_failure_falls_back_to_eager_with_one_warning():
    model, opt, crit, _, _ = FACES["bf16"](torch.optim.SGD, SGD)

    def broken_backend(gm, example_inputs):
        raise RuntimeError("no C++ compiler here")

    torch._dynamo.reset()
    step = compile_step(model, opt, crit, backend=broken_backend)
    with pytest.warns(RuntimeWarning, match="did not compile.*eagerly"):
        step(*batch(0))
    assert not step.compiled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(*batch(1))  # warned once


def test_bad_input(device: str):
    model, opt, crit, _, _ = FACES["bf16"](torch.optim.SGD, SGD)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        compile_step(lambda x: x, opt, crit)
    with pytest.raises(TypeError, match="optimizer must be"):
        compile_step(model, object(), crit)
    with pytest.raises(ValueError, match="max_norm=-1"):
        compile_step(model, opt, crit, max_norm=-1)
    with pytest.raises(TypeError, match="scaler=.*mixprec.GradScaler"):
        compile_step(model, opt, crit, scaler=torch.amp.GradScaler(device))
    model = make_model()
    rms = torch.optim.RMSprop(model.parameters())
    with pytest.raises(CompileStepError, match="RMSprop.*Supported: SGD"):
        compile_step(model, rms, nn.MSELoss())
    damp = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    with pytest.raises(CompileStepError, match="dampening=0.5"):
        compile_step(model, damp, nn.MSELoss())
    other = torch.optim.SGD(make_model().parameters(), lr=0.1)
    with pytest.raises(CompileStepError, match="not in model.named_parameters"):
        compile_step(model, other, nn.MSELoss())
    step = compile_step(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss())
    with pytest.raises(TypeError, match="got 1 positional"):
        step(torch.ones(2, 8))


def _two_ranks(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, crit = mixprec.convert_to_amp(
        model, opt, nn.MSELoss(), mixprec.AMP_TYPE.NAIVE, {"initial_scale": 2.0**10}
    )
    ddp = nn.parallel.DistributedDataParallel(model)
    step = compile_step(ddp, opt, crit, backend="eager")  # dynamo: would break at a sync
    x, y = batch(rank)  # different data per rank: grads differ until averaged
    step(x, y)
    if rank == 1:
        x = x.clone()
        x[0, 0] = float("inf")  # only rank 1 overflows: both must skip
    before = [p.detach().clone() for p in model.parameters()] + [m.clone() for m in opt.hp_masters]
    step(x, y)
    after = [p.detach().clone() for p in model.parameters()] + [m.clone() for m in opt.hp_masters]
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert step.compiled
    assert int(step.sync_counters()) == 1
    assert_same_on_every_rank(after + [opt.scaler.scale_tensor], "params after a skip")


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_agree_on_overflow_on_device():
    spawn(_two_ranks, 2)


def _engine_with(config, **kwargs):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine, *_ = mixprec.initialize(
        model, opt, nn.MSELoss(), config=config, verbose=False, **kwargs
    )
    return engine


def test_engine_train_step_equals_its_eager_loop_and_compile_key_switches_compiling():
    naive = {"mode": mixprec.AMP_TYPE.NAIVE, "initial_scale": 2.0**10}
    eager = _engine_with({"fp16": naive})
    for i in range(3):
        eager.zero_grad()
        eager.backward(eager.criterion(eager(batch(i)[0]), batch(i)[1]))
        eager.step()
    functional = _engine_with({"fp16": naive, "compile": False})
    for i in range(3):
        x, y = batch(i)
        loss = functional.train_step(x, target=y)
    assert loss.dim() == 0 and not functional._train_step.compiled
    assert_states_close(
        state_of(functional.model, functional.optimizer),
        state_of(eager.model, eager.optimizer),
        **FP16_PARAM_ROUNDING,
    )
    compiled = _engine_with({"fp16": naive, "compile": True})
    assert compiled.compile_step  # the step compiles on its first train_step call


def test_engine_compile_key_bad_input():
    with pytest.raises(TypeError, match="compile='yes' must be True or False"):
        _engine_with({"compile": "yes"})
    with pytest.raises(ValueError, match="gradient_accumulation=2"):
        _engine_with({"compile": True, "gradient_accumulation": 2})
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(ValueError, match="lr_scheduler"):
        mixprec.initialize(model, opt, nn.MSELoss(), lr_scheduler=sched, config={"compile": True})


def test_booster_train_step_equals_its_eager_loop():
    reference = _booster(torch.optim.AdamW, ADAMW)
    for i in range(3):
        reference[3](*batch(i))
    booster = mixprec.Booster(mixed_precision="bf16", compile_step=False)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    model, opt, crit, _, _ = booster.boost(model, opt, nn.MSELoss())
    for i in range(3):
        x, y = batch(i)
        booster.train_step(model, opt, crit, x, target=y)
    assert_states_close(
        state_of(model, opt), state_of(reference[0], reference[1]), **fp32_rounding()
    )
    with pytest.raises(TypeError, match="compile_step=1 must be a bool"):
        mixprec.Booster(compile_step=1)
    assert mixprec.Booster(compile_step=True).compile_step


def test_refuses_optimizers_whose_step_does_collective_work():
    # ZeRO's step reduces grads and gathers owners' params: a compiled step that skipped that
    # would silently train each rank on its own gradients.
    from mixprec.parallel.zero import ZeroOptimizer

    class ShardedStepOptimizer(mixprec.MixedPrecisionOptimizer):
        traits = ZeroOptimizer.traits

    model = nn.Linear(4, 4)
    opt = ShardedStepOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(CompileStepError, match="ZeRO reduces gradients"):
        mixprec.compile_step(model, opt, nn.MSELoss())
