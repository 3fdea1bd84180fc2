"""Every face reaches every float8 recipe, and lands in the same Float8Linear.

The faces: the Booster with FP8MixedPrecision(recipe=...), Colossal's use_fp8 on
HybridParallelPlugin(precision='bf16', pp_size=1, tp_size=1) and LowLevelZeroPlugin, the config
file's fp8 section (initialize), Lightning's MixprecPrecision('fp8', recipe=...), and
convert_to_fp8(model, Float8Config(recipe=...)). For each recipe, every converted layer carries
that recipe, and one training step through the face equals, bit for bit, the same step through
convert_to_fp8 followed by the plain core path (prepare_model / prepare_optimizer) of the face's
own precision without fp8: the same float8 GEMMs around the same precision, so the same math.
One process throughout: without a pipeline, tensor parallelism or a process group the plugins
and initialize run on a world of one. Bad fp8 spellings are refused with the message checked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from dist_utils import spawn
from torch import nn

from mixprec.booster import Booster
from mixprec.booster.plugin import HybridParallelPlugin, LowLevelZeroPlugin
from mixprec.config import parse_config
from mixprec.core.policy import Policy, to_policy
from mixprec.core.prepare import FP32Criterion, prepare_model, prepare_optimizer
from mixprec.engine import initialize
from mixprec.fp8 import RECIPES, Float8Config, Float8Linear, convert_to_fp8
from mixprec.mixed_precision import FP8MixedPrecision

LR = 0.1
Faced = tuple[nn.Module, Policy, torch.Tensor]
"""What a face's step returns: the model after one step (the boosted one where a face wraps or
cuts it), the face's Policy, the loss."""


def _model() -> nn.Module:
    torch.manual_seed(0)  # every face and its reference start from the same weights
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)


def _booster_step(model: nn.Module, booster: Booster) -> tuple[nn.Module, torch.Tensor]:
    """(the boosted model after one step, its loss)."""
    x, y = _batch()
    boosted, opt, crit, *_ = booster.boost(
        model, torch.optim.SGD(model.parameters(), lr=LR), nn.MSELoss()
    )
    loss = crit(boosted(x), y)
    booster.backward(loss, opt)
    opt.step()
    return boosted, loss.detach()


def booster_face(model: nn.Module, recipe: str) -> Faced:
    precision = FP8MixedPrecision(recipe=recipe)
    boosted, loss = _booster_step(model, Booster(mixed_precision=precision))
    return boosted, precision.policy, loss


def hybrid_face(model: nn.Module, recipe: str) -> Faced:
    plugin = HybridParallelPlugin(pp_size=1, tp_size=1, precision="bf16", use_fp8=recipe)
    boosted, loss = _booster_step(model, Booster(plugin=plugin))
    return boosted, plugin.precision.policy, loss


def low_level_zero_face(model: nn.Module, recipe: str) -> Faced:
    plugin = LowLevelZeroPlugin(precision="bf16", use_fp8=recipe)
    boosted, loss = _booster_step(model, Booster(plugin=plugin))
    return boosted, plugin.policy, loss


def config_face(model: nn.Module, recipe: str) -> Faced:
    config = {"fp16": {"mode": "bf16"}, "fp8": {"recipe": recipe}}
    x, y = _batch()
    engine, *_ = initialize(
        model, torch.optim.SGD(model.parameters(), lr=LR), nn.MSELoss(), config=config
    )
    engine.zero_grad()
    loss = engine.criterion(engine(x), y)
    engine.backward(loss)
    engine.step()
    return model, parse_config(config).policy, loss.detach()


def lightning_face(model: nn.Module, recipe: str) -> Faced:
    L = pytest.importorskip("lightning")
    from mixprec.integrations.lightning import MixprecPrecision

    plugin = MixprecPrecision("fp8", recipe=recipe)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=plugin)
    wrapped, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    x, y = _batch()
    opt.zero_grad()
    loss = nn.functional.mse_loss(wrapped(x).float(), y)
    fabric.backward(loss)
    opt.step()
    return model, plugin.policy, loss.detach()


def convert_face(model: nn.Module, recipe: str) -> Faced:
    """convert_to_fp8 itself, then the 'bf16' mode: what FP8MixedPrecision's mode means."""
    config = Float8Config(recipe=recipe)
    convert_to_fp8(model, None, config)
    policy = replace(to_policy("bf16"), fp8=True, fp8_config=config)  # for the checks below
    return model, policy, _core_step(model, replace(policy, fp8=False, fp8_config=None))


FACES: dict[str, Callable[[nn.Module, str], Faced]] = {
    "booster": booster_face,
    "low_level_zero": low_level_zero_face,
    "config_file": config_face,
    "lightning": lightning_face,
    "convert_to_fp8": convert_face,
}


def _core_step(model: nn.Module, policy: Policy) -> torch.Tensor:
    """One SGD step through the plain core path: prepare_model, prepare_optimizer."""
    x, y = _batch()
    prepared = prepare_model(model, policy)
    opt = prepare_optimizer(torch.optim.SGD(model.parameters(), lr=LR), policy)
    loss = FP32Criterion(nn.MSELoss())(prepared(x), y)
    opt.backward(loss)
    opt.step()
    return loss.detach()


def _float8_layers(model: nn.Module) -> list[Float8Linear]:
    return [m for m in model.modules() if isinstance(m, Float8Linear)]


def _check_face(face: str, recipe: str) -> None:
    model, policy, loss = (hybrid_face if face == "hybrid_parallel" else FACES[face])(
        _model(), recipe
    )
    layers = _float8_layers(model)
    assert len(layers) == 2, f"{face}: {[type(m).__name__ for m in model.modules()]}"
    assert {layer.config.recipe for layer in layers} == {recipe}
    assert all(layer.config == Float8Config(recipe=recipe) for layer in layers)
    assert policy.fp8 and policy.fp8_config == Float8Config(recipe=recipe)

    reference = _model()  # the same weights, converted by hand, stepped without fp8 policy
    convert_to_fp8(reference, None, Float8Config(recipe=recipe))
    ref_loss = _core_step(reference, replace(policy, fp8=False, fp8_config=None))
    assert torch.equal(loss.float(), ref_loss.float()), (face, loss, ref_loss)
    params = [p for m in layers for p in m.parameters()]  # the boosted model's own modules
    for (name, p), ref in zip(
        [(n, p) for n, p in model.named_parameters() if any(p is q for q in params)],
        reference.parameters(),
        strict=True,
    ):
        assert p.dtype == ref.dtype, (face, name)
        assert torch.equal(p, ref), (face, recipe, name)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("face", list(FACES))
def test_each_face_lands_the_recipe_and_steps_as_convert_to_fp8(face: str, recipe: str) -> None:
    _check_face(face, recipe)


def _hybrid_worker(rank: int, world: int) -> None:
    for recipe in RECIPES:  # each replica steps the same batch: (g + g) / 2 == g exactly
        _check_face("hybrid_parallel", recipe)


def test_hybrid_parallel_use_fp8_lands_every_recipe_on_two_gloo_ranks() -> None:
    """HybridParallelPlugin(pp_size=1, tp_size=1) needs a process group: 2 data-parallel
    ranks, each checked against the one-process reference."""
    spawn(_hybrid_worker, 2)


def test_colossal_bool_keeps_its_meaning() -> None:
    """use_fp8=True is Colossal's switch: the default Float8Config (recipe 'tensorwise')."""
    for policy in (
        HybridParallelPlugin(pp_size=1, tp_size=1, precision="bf16", use_fp8=True).precision.policy,
        LowLevelZeroPlugin(precision="bf16", use_fp8=True).policy,
        parse_config({"fp16": {"mode": "bf16"}, "fp8": True}).policy,
    ):
        assert policy.fp8 and policy.fp8_config == Float8Config()
        assert policy.fp8_config.recipe == "tensorwise"
    for policy in (
        HybridParallelPlugin(pp_size=1, tp_size=1, precision="bf16").precision.policy,
        LowLevelZeroPlugin(precision="bf16").policy,
        parse_config({"fp16": {"mode": "bf16"}, "fp8": False}).policy,
    ):
        assert not policy.fp8 and policy.fp8_config is None


def test_every_spelling_means_the_same_config() -> None:
    config = Float8Config(recipe="blockwise", power_of_two_scale=True)
    as_dict = {"recipe": "blockwise", "power_of_two_scale": True}
    for spec in (config, as_dict):
        assert LowLevelZeroPlugin(precision="bf16", use_fp8=spec).policy.fp8_config == config
        plugin = HybridParallelPlugin(pp_size=1, tp_size=1, precision="bf16", use_fp8=spec)
        assert plugin.precision.policy.fp8_config == config
        assert parse_config({"fp8": spec}).policy.fp8_config == config
    assert FP8MixedPrecision(config=config).policy.fp8_config == config
    rowwise = replace(config, recipe="rowwise")  # recipe= replaces config's recipe only
    assert FP8MixedPrecision(recipe="blockwise", config=rowwise).policy.fp8_config == config
    assert to_policy("fp8", {"recipe": "blockwise", "power_of_two_scale": True}).fp8_config == (
        config
    )
    assert to_policy("fp8").fp8_config is None  # the mode alone: the converter's default
    assert parse_config({"fp16": {"mode": "fp8", "recipe": "mxfp8"}}).policy.fp8_config == (
        Float8Config(recipe="mxfp8")
    )


def test_use_fp8_with_zero_stage_reaches_the_zero_plugin() -> None:
    plugin = HybridParallelPlugin(
        pp_size=1, tp_size=1, precision="bf16", zero_stage=1, use_fp8="rowwise"
    )
    assert plugin._zero.policy.fp8_config == Float8Config(recipe="rowwise")


BAD_SPECS: list[tuple[Any, type[Exception], str]] = [
    ("rowise", ValueError, r"'rowise' is not a float8 recipe. Did you mean 'rowwise'"),
    (1, TypeError, r"=1; valid: True .*'nvfp4'.*a Float8Config, or a dict"),
    (None, TypeError, r"=None; valid: True"),
    ({"recipee": "rowwise"}, ValueError, r"key 'recipee'. Did you mean 'recipe'"),
    ({"recipe": "mxfp8", "margin": 2}, ValueError, r"cannot take margin=2"),
]


@pytest.mark.parametrize(("spec", "error", "message"), BAD_SPECS, ids=repr)
def test_bad_fp8_spellings_are_refused_by_every_face(
    spec: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        LowLevelZeroPlugin(precision="bf16", use_fp8=spec)
    with pytest.raises(error, match=message):
        HybridParallelPlugin(pp_size=1, tp_size=1, precision="bf16", use_fp8=spec)
    if spec is not None:  # the config's fp8=None means no section
        with pytest.raises(error, match=message):
            parse_config({"fp16": {"mode": "bf16"}, "fp8": spec})


def test_fp8_set_in_two_places_is_refused() -> None:
    with pytest.raises(ValueError, match=r"fp8='rowwise' with mode 'fp8', which already sets"):
        parse_config({"fp16": {"mode": "fp8", "recipe": "nvfp4"}, "fp8": "rowwise"})
    with pytest.raises(ValueError, match=r"use_fp8='rowwise' goes with precision 'fp16', 'bf16'"):
        HybridParallelPlugin(pp_size=1, tp_size=1, precision="fp16_naive", use_fp8="rowwise")
    with pytest.raises(ValueError, match=r"fp8_config=.* disagree; set the float8 config in one"):
        prepare_model(
            _model(),
            to_policy("fp8", {"recipe": "rowwise"}),
            fp8_config=Float8Config(recipe="mxfp8"),
        )
    with pytest.raises(ValueError, match=r"needs fp8=True"):
        replace(to_policy("bf16"), fp8_config=Float8Config())
    with pytest.raises(ValueError, match=r"Unknown 'fp8' mode config key 'recipee'"):
        to_policy("fp8", {"recipee": "rowwise"})


@pytest.mark.parametrize("mode", ["fp32", "torch", "naive", "apex", "bf16", "fp8", "bf16_sr"])
def test_config_fp8_section_rides_on_every_mode(mode: str) -> None:
    """The fp8 section adds float8 Linear layers to whatever the fp16 section says (every mode
    runs them: their params and autocast stay the mode's); one step runs and is finite."""
    plain = parse_config({"fp16": {"mode": mode}}).policy
    policy = parse_config({"fp16": {"mode": mode}, "fp8": {"recipe": "rowwise"}}).policy
    assert policy == replace(plain, fp8=True, fp8_config=Float8Config(recipe="rowwise"))
    model = _model()
    loss = _core_step(model, policy)
    assert {m.config.recipe for m in _float8_layers(model)} == {"rowwise"}
    assert torch.isfinite(loss) and all(torch.isfinite(p).all() for p in model.parameters())
