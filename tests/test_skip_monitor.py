"""Skipped steps are visible: a one-time warm-up summary, a rate warning later, counts to log."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import mixprec
from mixprec.core.skip_monitor import SkipMonitor, scale_text

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")


def test_warmup_summary_once_with_the_scales_it_fell_through() -> None:
    monitor = SkipMonitor()
    for scale in (2.0**32, 2.0**31, 2.0**30):
        assert monitor.record(True, scale) is None  # nothing while it is still warming up
    message = monitor.record(False, 2.0**29)
    assert message is not None
    assert "the first 3 step(s) were skipped" in message
    assert "fell from 2**32 to 2**29: normal warm-up for this initial scale" in message
    assert monitor.warmup_skips == 3 and not monitor.warming_up
    assert all(monitor.record(False, 2.0**29) is None for _ in range(500))  # said once


def test_a_run_that_starts_clean_says_nothing_and_skips_at_a_fixed_scale_are_not_warm_up() -> None:
    clean = SkipMonitor()
    assert clean.record(False, 65536.0) is None and clean.warmup_skips == 0
    fixed = SkipMonitor()
    assert fixed.record(True, 1.0) is None
    message = fixed.record(False, 1.0)
    assert "did not fall: not a scale warm-up" in message and "2**0" in message


def test_later_skips_warn_only_above_the_rate_once_per_window() -> None:
    monitor = SkipMonitor(window=10, warn_rate=0.1)
    monitor.record(False, 1024.0)  # warm-up over, no skips
    steps = [True] + [False] * 9  # 1 of 10: at the rate, not above it
    assert [m for s in steps if (m := monitor.record(s, 1024.0))] == []
    steps = [True, True] + [False] * 8  # 2 of 10 > 10%
    messages = [m for s in steps if (m := monitor.record(s, 512.0))]
    assert len(messages) == 1
    assert "2 of the last 10 steps were skipped" in messages[0] and "2**9" in messages[0]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"window": 0}, ValueError, r"window=0 must be an int >= 1"),
        ({"window": 2.5}, ValueError, r"window=2.5 must be an int >= 1"),
        ({"warn_rate": "5%"}, TypeError, r"warn_rate='5%' must be a number in \[0, 1\)"),
        ({"warn_rate": 1.0}, ValueError, r"warn_rate=1.0 must be in \[0, 1\)"),
    ],
)
def test_bad_monitor_settings_name_the_value(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        SkipMonitor(**kwargs)


def test_scale_text() -> None:
    assert [scale_text(s) for s in (2.0**32, 1.0, 0.5, 3.0)] == ["2**32", "2**0", "2**-1", "3"]


def tiny_fp16_naive_run(steps: int, caplog) -> mixprec.MixedPrecisionOptimizer:
    # fp16 params at Colossal's default initial scale 2**32: the first backwards overflow fp16
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, criterion = mixprec.convert_to_amp(
        model, optimizer, nn.MSELoss(), mixprec.AMP_TYPE.NAIVE
    )
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        for _ in range(steps):
            optimizer.zero_grad()
            optimizer.backward(criterion(model(x), y))
            optimizer.step()
    return optimizer


def test_fp16_naive_default_scale_warm_up_is_reported_once_with_the_real_counts(caplog) -> None:
    optimizer = tiny_fp16_naive_run(25, caplog)
    stats = optimizer.skip_stats
    assert stats.steps == 25 and 0 < stats.warmup_skips == stats.skipped_steps < 25
    warm = [r.getMessage() for r in caplog.records if "normal warm-up" in r.getMessage()]
    assert len(warm) == 1 and warm[0].startswith(f"mixprec: the first {stats.warmup_skips} step")
    assert "fell from 2**32 to " in warm[0]
    assert stats.last_scale == optimizer.loss_scale  # no skip since: the scale has not moved
    state = optimizer.state_dict()
    optimizer.load_state_dict(state)  # a resumed run is past its warm-up
    assert not optimizer.skip_monitor.warming_up


def test_engine_and_booster_expose_the_same_counts(device: str) -> None:
    model = nn.Linear(4, 1)
    engine, *_ = mixprec.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), config={}, verbose=False
    )
    engine.zero_grad()
    engine.backward(engine.criterion(engine(torch.randn(2, 4)), torch.zeros(2, 1)))
    engine.step()
    assert engine.skip_stats == engine.optimizer.skip_stats
    assert (engine.skip_stats.steps, engine.skip_stats.skipped_steps) == (1, 0)
    booster = mixprec.Booster(device=device, mixed_precision="bf16")
    model = nn.Linear(4, 1)
    _, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert booster.skip_stats(optimizer) == optimizer.skip_stats
    assert booster.skip_stats(optimizer).steps == 0
