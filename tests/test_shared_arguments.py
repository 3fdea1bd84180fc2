"""Shared arguments are checked by one function (mixprec.core.validate), alike on every face.

A clipping norm reaches mixprec through a dozen doors (the core optimizer, its clip methods,
Colossal's convert_to_amp / OptimizerWrapper / plugins / fp16 section / config Engine, Apex's
FP16_Optimizer, compile_step); each must refuse the same bad values with the same words.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import tiny_mlp
from torch import nn

import mixprec
from mixprec.core.validate import MAX_NORM_RULE, NORM_TYPE_RULE, check_max_norm, check_norm_type


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _backward_done(opt: Any, model: nn.Module) -> Any:
    x = torch.randn(2, 8)
    loss = model(x).float().square().mean()
    opt.backward(loss) if hasattr(opt, "backward") else loss.backward()
    return opt


def _core_init(v: Any) -> None:
    mixprec.MixedPrecisionOptimizer(_sgd(tiny_mlp(8)), max_norm=v)


def _core_clip(v: Any) -> None:
    model = tiny_mlp(8)
    opt = mixprec.MixedPrecisionOptimizer(_sgd(model))
    model(torch.randn(2, 8)).square().mean().backward()
    opt.clip_grad_norm(v)


def _colossal_convert_to_amp(v: Any) -> None:
    from mixprec.amp import AMP_TYPE, convert_to_amp

    model = tiny_mlp(8)
    model, opt, _ = convert_to_amp(model, _sgd(model), None, AMP_TYPE.TORCH)
    _backward_done(opt, model).clip_grad_norm(model, v)


def _colossal_clip_grad_by_norm(v: Any) -> None:
    from mixprec.booster import Booster

    model = tiny_mlp(8)
    model, opt, *_ = Booster(mixed_precision="fp16").boost(model, _sgd(model))
    _backward_done(opt, model).clip_grad_by_norm(v)


def _colossal_zero_plugin(v: Any) -> None:
    from mixprec.booster.plugin import LowLevelZeroPlugin

    LowLevelZeroPlugin(max_norm=v)


def _colossal_hybrid_plugin(v: Any) -> None:
    from mixprec.booster.plugin import HybridParallelPlugin

    HybridParallelPlugin(pp_size=2, num_microbatches=2, max_norm=v)


def _colossal_naive_fp16_section(v: Any) -> None:
    from mixprec.amp import AMP_TYPE

    mixprec.config.load_config({"fp16": {"mode": AMP_TYPE.NAIVE, "clip_grad_norm": v}})


def _colossal_config_engine(v: Any) -> None:
    model = tiny_mlp(8)
    mixprec.engine.initialize(model, _sgd(model), config={"clip_grad_norm": v}, verbose=False)


def _apex_fp16_optimizer(v: Any) -> None:
    from mixprec.apex.fp16_utils import FP16_Optimizer

    model = tiny_mlp(8)
    opt = FP16_Optimizer(_sgd(model), verbose=False)
    _backward_done(opt, model).clip_master_grads(v)


def _compile_step(v: Any) -> None:
    model = tiny_mlp(8)
    mixprec.compile_step(model, _sgd(model), nn.MSELoss(), max_norm=v)


# (the face's door, the name it gives the argument)
FACES: dict[str, tuple[Callable[[Any], None], str]] = {
    "core MixedPrecisionOptimizer(max_norm)": (_core_init, "max_norm"),
    "core clip_grad_norm": (_core_clip, "max_norm"),
    "colossal convert_to_amp clip_grad_norm(model, max_norm)": (
        _colossal_convert_to_amp,
        "max_norm",
    ),
    "colossal clip_grad_by_norm": (_colossal_clip_grad_by_norm, "max_norm"),
    "colossal LowLevelZeroPlugin": (_colossal_zero_plugin, "max_norm"),
    "colossal HybridParallelPlugin": (_colossal_hybrid_plugin, "max_norm"),
    "colossal fp16=dict(mode=NAIVE, clip_grad_norm)": (
        _colossal_naive_fp16_section,
        "clip_grad_norm",
    ),
    "colossal config Engine clip_grad_norm": (_colossal_config_engine, "clip_grad_norm"),
    "apex FP16_Optimizer.clip_master_grads": (_apex_fp16_optimizer, "max_norm"),
    "compile_step(max_norm)": (_compile_step, "max_norm"),
}

BAD_MAX_NORMS = [(-1.0, ValueError), (math.nan, ValueError), (math.inf, ValueError)]
BAD_MAX_NORMS += [("1.0", TypeError), (True, TypeError)]


@pytest.mark.parametrize("value, error", BAD_MAX_NORMS, ids=repr)
@pytest.mark.parametrize("face", FACES)
def test_every_face_refuses_a_bad_max_norm_with_the_same_words(
    face: str, value: Any, error: type[Exception]
) -> None:
    door, name = FACES[face]
    with pytest.raises(error, match=re.escape(f"{name}={value!r} {MAX_NORM_RULE}")):
        door(value)


@pytest.mark.parametrize("value", [0, 0.0, 1, 2.5])
def test_good_max_norms_pass_as_floats(value: float) -> None:
    assert check_max_norm("max_norm", value) == float(value)
    assert type(check_max_norm("max_norm", value)) is float


@pytest.mark.parametrize(
    "value, error",
    [(0, ValueError), (-2.0, ValueError), (math.nan, ValueError), ("2", TypeError)],
    ids=repr,
)
def test_norm_type_is_refused_alike_by_the_clips(value: Any, error: type[Exception]) -> None:
    """The core clip, Colossal's clip_grad_by_norm and ZeRO's plugin check norm_type alike."""
    from mixprec.booster import Booster
    from mixprec.booster.plugin import LowLevelZeroPlugin

    message = re.escape(f"norm_type={value!r} {NORM_TYPE_RULE}")
    with pytest.raises(error, match=message):
        LowLevelZeroPlugin(max_norm=1.0, norm_type=value)
    model = tiny_mlp(8)
    model, opt, *_ = Booster(mixed_precision="fp16").boost(model, _sgd(model))
    _backward_done(opt, model)
    with pytest.raises(error, match=message):
        opt.clip_grad_by_norm(1.0, norm_type=value)
    with pytest.raises(error, match=message):
        opt.clip_grad_norm(1.0, norm_type=value)


def test_norm_type_takes_torchs_inf_spelling() -> None:
    assert check_norm_type("norm_type", "inf") == math.inf
    assert check_norm_type("norm_type", math.inf) == math.inf
    assert check_norm_type("norm_type", 1) == 1.0


# ----- loss-scaler settings: one rule per setting, each face naming its own spelling -----
def _paddle_scaler(**kw: Any) -> None:
    from mixprec.paddle import GradScaler

    GradScaler(**kw)


def _colossal_zero_scaler(**kw: Any) -> None:
    from mixprec.booster.plugin import LowLevelZeroPlugin

    LowLevelZeroPlugin(**kw)


def _apex_dynamic_loss_args(**kw: Any) -> None:
    from mixprec.apex.fp16_utils import FP16_Optimizer

    model = tiny_mlp(8)
    FP16_Optimizer(_sgd(model), dynamic_loss_scale=True, dynamic_loss_args=kw, verbose=False)


SCALER_CASES = [
    # (door, keyword as the face spells it, bad value, error, message)
    (mixprec.GradScaler, "growth_factor", 0.5, ValueError, "growth_factor=0.5 must be > 1"),
    (_paddle_scaler, "incr_ratio", 0.5, ValueError, "incr_ratio=0.5 must be > 1"),
    (_paddle_scaler, "growth_factor", 0.5, ValueError, "growth_factor=0.5 must be > 1"),
    (_paddle_scaler, "decr_ratio", 2.0, ValueError, "decr_ratio=2.0 must be in (0, 1)"),
    (_paddle_scaler, "incr_every_n_steps", 0, ValueError, "incr_every_n_steps=0 must be >= 1"),
    (
        _paddle_scaler,
        "init_loss_scaling",
        math.inf,
        ValueError,
        "init_loss_scaling=inf must be > 0 and finite",
    ),
    (
        mixprec.FP16NaiveMixedPrecision,
        "initial_scale",
        math.nan,
        ValueError,
        "initial_scale=nan must be > 0 and finite",
    ),
    (_colossal_zero_scaler, "initial_scale", 0, ValueError, "initial_scale=0 must be > 0"),
    (mixprec.GradScaler, "growth_interval", 1.5, TypeError, "growth_interval must be an int"),
    (
        _apex_dynamic_loss_args,
        "scale_factor",
        "2",
        TypeError,
        "dynamic_loss_args scale_factor='2' must be a real number",
    ),
    (
        _apex_dynamic_loss_args,
        "scale_factor",
        1.0,
        ValueError,
        "dynamic_loss_args scale_factor=1.0 must be > 1",
    ),
    (mixprec.GradScaler, "init_scale", "1", TypeError, "init_scale='1' must be a real number"),
]


@pytest.mark.parametrize(
    "door, keyword, value, error, message",
    SCALER_CASES,
    ids=[f"{case[0].__name__}-{case[1]}={case[2]!r}" for case in SCALER_CASES],
)
def test_scaler_settings_are_refused_naming_the_faces_own_keyword(
    door: Callable[..., Any], keyword: str, value: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        door(**{keyword: value})
