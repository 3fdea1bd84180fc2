"""One LR-on-skip rule for the Booster and the Engine that keeps the sync-free step sync-free.

Both hold an owned LR schedule on a skipped step by SkipAwareLRScheduler's rule, which reads
host counts only. The sync-free step (forced on CPU, `_sync_free = True`, the default on CUDA)
keeps its skip flags on a device record: the schedule then advances at once and is put back
where the applied steps place it when the record is read. Checked against the same run with the
flag read on the host each step (`_sync_free = False`), whose hold is immediate:

- a clean step (backward, optimizer.step(), the schedule's step) makes no host read;
- once the record is read (its own cadence: every check_every steps, inside a step), the
  schedule's position and LR equal the syncing run's exactly (skipped steps did not advance
  it), for a per-step StepLR and a chainable ExponentialLR.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import CountHostSyncs, tiny_mlp

from mixprec.booster import Booster
from mixprec.core.step_record import DEFAULT_CHECK_EVERY
from mixprec.engine import Engine
from mixprec.mixed_precision import FP16NaiveMixedPrecision

pytestmark = pytest.mark.usefixtures("device")

PATTERN = [False, True, False, False, True, True, False, False]
"""clean, bad, clean x2, bad x2, clean x2: skips between and in a row."""
SCHEDULES = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    "exponential": lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9),
}


def _boosted(owner: str, schedule: str, sync_free: bool) -> tuple[Any, Any, Any, Any]:
    """(step(x, y), the boosted optimizer, the scheduler that is stepped, its inner scheduler)."""
    torch.manual_seed(0)
    model = tiny_mlp(norm=False)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    inner = SCHEDULES[schedule](sgd)
    booster = Booster(mixed_precision=FP16NaiveMixedPrecision(initial_scale=2.0**8, hysteresis=1))
    criterion = torch.nn.CrossEntropyLoss()
    if owner == "booster":
        model, opt, criterion, _, sched = booster.boost(model, sgd, criterion, lr_scheduler=inner)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            booster.backward(criterion(model(x), y), opt)
            opt.step()
            sched.step()

    else:
        model, opt, criterion, _, _ = booster.boost(model, sgd, criterion)
        engine = Engine(model, opt, criterion, lr_scheduler=inner)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            engine.zero_grad()
            engine.backward(criterion(engine(x), y))
            engine.step()

    opt._sync_free = sync_free
    return step, opt, inner, model


def _batch(i: int, bad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    if bad:
        x[0, 0] = float("inf")
    return x, y


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("owner", ["booster", "engine"])
def test_sync_free_step_with_an_owned_schedule(monkeypatch, owner: str, schedule: str) -> None:
    if torch.get_default_device().type != "cpu":
        pytest.skip("the CPU count of host reads (on CUDA the sync-free step is the default)")
    steps = DEFAULT_CHECK_EVERY  # the record's own read comes inside the last step
    bad = [PATTERN[i % len(PATTERN)] for i in range(steps)]
    runs = {}
    for sync_free in (False, True):
        step, opt, inner, _ = _boosted(owner, schedule, sync_free)
        for i in range(steps):
            if sync_free and not bad[i]:
                syncs = CountHostSyncs(monkeypatch)
                step(*_batch(i, bad[i]))
                monkeypatch.undo()
                # a clean step and its schedule step read nothing, but the record's own read
                expected = ["tolist"] if i == steps - 1 else []
                assert syncs.calls == expected, f"{owner}: host reads on clean step {i}"
            else:
                step(*_batch(i, bad[i]))
            if sync_free and i < steps - 1:
                assert opt.unread_steps == i + 1  # every flag so far is still on the device
        assert opt.unread_steps == 0
        runs[sync_free] = (inner.last_epoch, [g["lr"] for g in inner.optimizer.param_groups])
        assert opt.skipped_steps == sum(bad)
    assert runs[False][0] == steps - sum(bad), "the syncing run did not hold on its skips"
    assert runs[True] == runs[False], f"{owner}: the schedule after the record's read"


def test_the_engine_steps_the_schedule_it_was_given() -> None:
    """Engine.lr_scheduler is the user's scheduler; the rule wraps it, not replaces it."""
    _, opt, inner, model = _boosted("engine", "step", False)
    engine = Engine(model, opt, lr_scheduler=inner)
    assert engine.lr_scheduler is inner
    assert Engine(model, opt).lr_scheduler is None
