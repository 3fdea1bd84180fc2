"""Colossal's loss-scaler keywords are honoured or refused whatever their value (issue 39, fault 3).

`HybridParallelPlugin(precision='fp16_naive', initial_scale=2**16)` once started at 2**32: a
keyword equal to the signature's default was taken as "not given" and the mode's own default
won, silently. Here every scaler keyword of every plugin and mixed-precision class is passed at
exactly its signature default, under every precision the class takes: the value must reach the
scaler the class builds, or the call must raise naming the keyword.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from mixprec.amp_type import ScalerKeywords
from mixprec.booster.plugin import HybridParallelPlugin, LowLevelZeroPlugin
from mixprec.core.keywords import Default
from mixprec.core.policy import ScalerConfig, to_policy
from mixprec.mixed_precision import FP16NaiveMixedPrecision, FP16TorchMixedPrecision
from mixprec.zero import LowLevelZeroOptimizer

CORE_NAME = {"initial_scale": "init_scale"}  # Colossal's name -> the core's ScalerConfig field


def _default(cls: Any, name: str) -> Any:
    default = inspect.signature(cls).parameters[name].default
    assert isinstance(default, Default), f"{cls.__name__}({name}=) has no Default sentinel"
    return default.value


def _hybrid_scaler(**kwargs: Any) -> ScalerConfig:
    plugin = HybridParallelPlugin(pp_size=1, **kwargs)
    assert plugin.precision is not None
    return plugin.precision.policy.loss_scale


HYBRID_PRECISIONS: dict[str, Any] = {
    # precision -> whether the scaler keywords set its scaler (else they are refused)
    "fp16": True,
    "fp16_naive": True,  # Colossal's NAIVE mode: the same (Megatron) scaler rule
    "bf16": False,
    "fp32": False,
    "fp16_apex": False,  # Apex's own loss_scale vocabulary
    "None": False,  # the Booster's mixed_precision
    "FP16NaiveMixedPrecision()": False,  # an object carries its own scaler settings
}


def _hybrid_precision(spec: str) -> Any:
    return {"None": None, "FP16NaiveMixedPrecision()": FP16NaiveMixedPrecision()}.get(spec, spec)


@pytest.mark.parametrize("precision", list(HYBRID_PRECISIONS))
@pytest.mark.parametrize("name", ScalerKeywords.NAMES)
def test_hybrid_parallel_plugin(precision: str, name: str) -> None:
    value = _default(HybridParallelPlugin, name)
    kwargs = {"precision": _hybrid_precision(precision), name: value}
    if HYBRID_PRECISIONS[precision]:
        got = getattr(_hybrid_scaler(**kwargs), CORE_NAME.get(name, name))
        assert got == value, f"precision={precision!r}: {name}={value!r} became {got!r}"
    else:
        with pytest.raises(ValueError, match=rf"HybridParallelPlugin\({name}="):
            HybridParallelPlugin(pp_size=1, **kwargs)


@pytest.mark.parametrize("name", ScalerKeywords.NAMES)
def test_hybrid_zero_hands_its_scaler_to_zero(name: str) -> None:
    """zero_stage with pp = tp = 1 is LowLevelZeroPlugin, whose defaults differ (2**32): the
    hybrid plugin's resolved scaler reaches it whole."""
    value = _default(HybridParallelPlugin, name)
    plugin = HybridParallelPlugin(pp_size=1, zero_stage=1, **{name: value})
    assert plugin._zero is not None
    got = getattr(plugin._zero.policy.loss_scale, CORE_NAME.get(name, name))
    assert got == value
    untouched = HybridParallelPlugin(pp_size=1, zero_stage=1)._zero
    assert untouched is not None and untouched.policy.loss_scale == _hybrid_scaler()


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32", "policy"])
@pytest.mark.parametrize("name", ScalerKeywords.NAMES)
def test_low_level_zero_plugin(precision: str, name: str) -> None:
    value = _default(LowLevelZeroPlugin, name)
    if precision == "fp16":
        got = getattr(
            LowLevelZeroPlugin(**{name: value}).policy.loss_scale, CORE_NAME.get(name, name)
        )
        assert got == value
    elif precision == "policy":  # policy= sets the scaler: a keyword beside it is refused
        with pytest.raises(ValueError, match=rf"LowLevelZeroPlugin\({name}="):
            LowLevelZeroPlugin(policy=to_policy("fp16_naive"), **{name: value})
    else:
        with pytest.raises(ValueError, match=rf"LowLevelZeroPlugin\({name}="):
            LowLevelZeroPlugin(precision=precision, **{name: value})


@pytest.mark.parametrize("name", ScalerKeywords.NAMES)
def test_low_level_zero_optimizer(name: str) -> None:
    """fp16 params: the keyword reaches the scaler (bf16 / fp32 params scale nothing, as in
    Colossal, where the params' dtype is the precision)."""
    value = _default(LowLevelZeroOptimizer, name)
    model = torch.nn.Linear(4, 4).half()
    opt = LowLevelZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **{name: value})
    assert getattr(opt.scaler.cfg, CORE_NAME.get(name, name)) == value


NAIVE_KEYWORDS = [n for n in ScalerKeywords.NAMES if n != "growth_interval"]  # Colossal's list
TORCH_KEYWORDS = ["init_scale", "growth_factor", "backoff_factor", "growth_interval"]


@pytest.mark.parametrize(
    ("cls", "name"),
    [(FP16NaiveMixedPrecision, n) for n in NAIVE_KEYWORDS]
    + [(FP16TorchMixedPrecision, n) for n in TORCH_KEYWORDS],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_mixed_precision_classes(cls: type, name: str) -> None:
    value = _default(cls, name)
    got = getattr(cls(**{name: value}).policy.loss_scale, CORE_NAME.get(name, name))
    assert got == value


def test_an_unset_keyword_takes_the_modes_own_default() -> None:
    """Not passing differs from passing the plugin's default: the mode's preset scaler."""
    assert _hybrid_scaler(precision="fp16_naive") == to_policy("fp16_naive").loss_scale
    assert _hybrid_scaler(precision="fp16_naive").init_scale != _default(
        HybridParallelPlugin, "initial_scale"
    )


def test_a_bad_value_is_refused_by_its_colossal_name() -> None:
    with pytest.raises(ValueError, match="initial_scale"):
        HybridParallelPlugin(pp_size=1, initial_scale=-1.0)
    with pytest.raises(ValueError, match="max_scale"):
        LowLevelZeroPlugin(max_scale=0.5, min_scale=1.0)
