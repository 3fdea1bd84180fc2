"""The scale-update rule against a pure-Python reference, exactly; scaler state round trips."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec.core.policy import NAIVE_SCALER, ScalerConfig
from mixprec.core.scaling import LossScaler, unscale_and_check_

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")


def reference_trajectory(cfg: ScalerConfig, overflows: list[bool]) -> list[tuple[float, int, int]]:
    """Megatron's DynamicGradScaler written plainly in Python floats (powers of two: exact)."""
    scale, growth, hyst = cfg.init_scale, 0, cfg.hysteresis
    out = []
    for overflow in overflows:
        if overflow:
            growth = 0
            hyst = max(hyst - 1, 0)
            if hyst <= 0:
                scale = max(scale * cfg.backoff_factor, cfg.min_scale)
        else:
            growth += 1
            if cfg.consecutive_hysteresis:
                hyst = cfg.hysteresis
            if growth == cfg.growth_interval:
                growth = 0
                hyst = cfg.hysteresis
                grown = min(scale * cfg.growth_factor, cfg.max_scale)
                scale = grown if math.isfinite(grown) else scale
        out.append((scale, growth, hyst))
    return out


def run_scaler(cfg: ScalerConfig, overflows: list[bool]) -> list[tuple[float, int, int]]:
    scaler = LossScaler(cfg)
    out = []
    for overflow in overflows:
        scaler.update(torch.tensor([1.0 if overflow else 0.0]))
        state = scaler.state_dict()
        out.append((scaler.scale, int(state["growth_tracker"]), int(state["hysteresis_tracker"])))
    return out


scaler_configs = st.builds(
    ScalerConfig,
    init_scale=st.sampled_from([2.0**k for k in (0, 4, 16, 32)]),
    growth_interval=st.integers(1, 5),
    hysteresis=st.integers(1, 4),
    min_scale=st.sampled_from([1.0, 2.0**-4, 2.0**8]),
    max_scale=st.sampled_from([math.inf, 2.0**24, 2.0**33]),
    consecutive_hysteresis=st.booleans(),
).filter(lambda c: c.max_scale >= c.min_scale)


@settings(max_examples=150, deadline=None)
@given(cfg=scaler_configs, overflows=st.lists(st.booleans(), min_size=1, max_size=60))
def test_dynamic_scale_matches_reference_exactly(cfg: ScalerConfig, overflows: list[bool]) -> None:
    # Powers of two times 2 or 0.5 are exact in fp32: the trajectories must agree bit for bit.
    assert run_scaler(cfg, overflows) == reference_trajectory(cfg, overflows)


@settings(max_examples=60, deadline=None)
@given(cfg=scaler_configs, overflows=st.lists(st.booleans(), min_size=1, max_size=40))
def test_clean_step_shortcut_equals_the_full_update(cfg: ScalerConfig, overflows: list) -> None:
    # The optimizer hands update() the growth count it read in the step's one sync; the states
    # must stay bitwise those of the device-side rule.
    full, short = LossScaler(cfg), LossScaler(cfg)
    for overflow in overflows:
        flag = torch.tensor([1.0 if overflow else 0.0])
        growth = None if overflow else float(short.growth_tracker.item())
        full.update(flag)
        short.update(flag, clean_growth=growth)
        for key, value in full.state_dict().items():
            got = short.state_dict()[key]
            assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value


def test_hysteresis_delays_backoff_and_growth_refills_it() -> None:
    cfg = ScalerConfig(init_scale=1024.0, growth_interval=2, hysteresis=2)
    scales = [s for s, _, _ in run_scaler(cfg, [True, True, True, False, False, True, True])]
    # 1st overflow spends hysteresis; 2nd and 3rd back off; 2 clean steps grow and refill; the
    # next overflow is absorbed, the one after backs off.
    assert scales == [1024.0, 512.0, 256.0, 256.0, 512.0, 512.0, 256.0]


def test_scale_never_collapses_below_floor() -> None:
    cfg = ScalerConfig(init_scale=8.0, min_scale=1.0)
    assert run_scaler(cfg, [True] * 50)[-1][0] == 1.0


def test_static_scaler_never_changes() -> None:
    cfg = ScalerConfig(dynamic=False, init_scale=128.0)
    assert {s for s, _, _ in run_scaler(cfg, [True, False, True] * 5)} == {128.0}


def test_naive_defaults_are_colossal_megatron_defaults() -> None:
    assert (NAIVE_SCALER.init_scale, NAIVE_SCALER.growth_interval, NAIVE_SCALER.hysteresis) == (
        2.0**32,
        1000,
        2,
    )
    assert NAIVE_SCALER.min_scale == 1.0


def test_state_dict_round_trips_every_counter() -> None:
    cfg = ScalerConfig(init_scale=2.0**10, growth_interval=3, hysteresis=3)
    a = LossScaler(cfg)
    for flag in [True, False, False, True]:
        a.update(torch.tensor([float(flag)]))
    b = LossScaler(cfg)
    b.load_state_dict(a.state_dict())
    for flag in [False, True, False, False, False, True]:
        a.update(torch.tensor([float(flag)]))
        b.update(torch.tensor([float(flag)]))
        assert a.state_dict().keys() == b.state_dict().keys()
        for key in ("scale", "growth_tracker", "hysteresis_tracker"):
            assert torch.equal(a.state_dict()[key], b.state_dict()[key])


def test_inv_scale_is_cached_until_the_scale_changes(device: str) -> None:
    scaler = LossScaler(ScalerConfig(dynamic=False, init_scale=8.0))
    inv = scaler.inv_scale()
    assert scaler.inv_scale() is inv and inv.item() == 0.125  # static: computed once
    state = scaler.state_dict()
    state["scale"] = torch.tensor([4.0])
    scaler.load_state_dict(state)  # writes the scale tensor in place
    assert scaler.inv_scale().item() == 0.25
    scaler.to(device)
    scaler._scale = torch.tensor([2.0])  # a replaced tensor (e.g. moved to another device)
    assert scaler.inv_scale().item() == 0.5
    dynamic = LossScaler(ScalerConfig(init_scale=2.0**16, growth_interval=1))
    before = dynamic.inv_scale().item()
    dynamic.update(torch.zeros(1))  # grows the scale in place
    assert dynamic.inv_scale().item() == before / 2


def test_is_unit_only_while_the_scale_is_a_static_one_never_written() -> None:
    assert LossScaler(ScalerConfig(dynamic=False, init_scale=1.0)).is_unit
    assert not LossScaler(ScalerConfig(dynamic=False, init_scale=2.0)).is_unit
    assert not LossScaler(ScalerConfig(init_scale=1.0)).is_unit  # dynamic: it may grow
    loaded = LossScaler(ScalerConfig(dynamic=False, init_scale=1.0))
    state = loaded.state_dict()
    state["scale"] = torch.tensor([4.0])
    loaded.load_state_dict(state)
    assert not loaded.is_unit and loaded.scale == 4.0


def test_unit_scale_backward_gives_the_scaled_paths_grads_bitwise() -> None:
    from mixprec.core.optim import MixedPrecisionOptimizer

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8).bfloat16()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1))
    assert opt.scaler.is_unit
    x = torch.randn(
        4, 8, generator=torch.Generator(torch.get_default_device()).manual_seed(1)
    ).bfloat16()
    grads = []
    for backward in (opt.backward, lambda loss: opt.scale_loss(loss).backward()):
        opt.zero_grad()
        backward(lin(x).square().mean())  # the fast path (no x 1.0), then the multiply
        grads.append([lp.grad.clone() for lp in opt.lp_params])
    for fast, scaled in zip(*grads, strict=True):
        assert torch.equal(fast, scaled)


def test_load_state_dict_names_missing_keys() -> None:
    with pytest.raises(KeyError, match="hysteresis_tracker"):
        LossScaler().load_state_dict({"scale": 1.0, "growth_tracker": 0})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"init_scale": 0.0}, "init_scale=0.0 must be > 0"),
        ({"growth_factor": 1.0}, "growth_factor=1.0 must be > 1"),
        ({"backoff_factor": 1.5}, r"backoff_factor=1.5 must be in \(0, 1\)"),
        ({"hysteresis": 0}, "hysteresis=0 must be >= 1"),
        ({"min_scale": 4.0, "max_scale": 2.0}, "max_scale=2.0 must be >= min_scale"),
    ],
)
def test_bad_scaler_config_names_value(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ScalerConfig(**kwargs)


def test_unscale_and_check_one_pass_mixed_dtypes() -> None:
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([8.0], dtype=torch.bfloat16)]
    found = torch.zeros(1)
    unscale_and_check_(grads, torch.tensor([0.5]), found)
    assert found.item() == 0.0
    assert grads[0].tolist() == [1.0, 2.0] and grads[1].item() == 4.0
    unscale_and_check_([torch.tensor([1.0, float("nan")])], torch.tensor([1.0]), found)
    assert found.item() == 1.0
