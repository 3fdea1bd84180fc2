"""One LR-on-skip rule for the Booster and the Engine that keeps the sync-free step sync-free.

Both hold an owned LR schedule on a skipped step by SkipAwareLRScheduler's rule, which reads
host counts only. The sync-free step (forced on CPU, `_sync_free = True`, the default on CUDA)
keeps its skip flags on a device record: the schedule then advances at once and is put back
where the applied steps place it when the record is read. Checked against the same run with the
flag read on the host each step (`_sync_free = False`), whose hold is immediate:

- a clean step (backward, optimizer.step(), the schedule's step) makes no host read;
- once the record is read (its own cadence: every check_every steps, inside a step; or a skip
  counter read), the schedule's position and LR equal the syncing run's exactly (skipped steps
  did not advance it), for a per-step StepLR, a chainable ExponentialLR and a per-epoch
  schedule; between reads the position is ahead by exactly the unread skips, and equal where
  the window since the last read held none.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from conftest import CountHostSyncs, tiny_mlp

from mixprec.booster import Booster
from mixprec.core.lr_schedule import SkipAwareLRScheduler
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


COUNTER_READS = {5, 13, 40}
"""Steps after which the test reads a skip counter (the record's read outside its cadence)."""


def _trajectory(owner: str, schedule: str, sync_free: bool, bad: list[bool]) -> list[tuple]:
    """Per step: (schedule position, lr, unread steps, skips still unread) after the step and
    its schedule step; after the COUNTER_READS steps a skip counter is read first."""
    step, opt, inner, _ = _boosted(owner, schedule, sync_free)
    out = []
    for i, is_bad in enumerate(bad):
        step(*_batch(i, is_bad))
        if i in COUNTER_READS:
            assert opt.skip_stats.skipped_steps == sum(bad[: i + 1])  # reads the record
        unread = opt.unread_steps
        unread_skips = sum(bad[i + 1 - unread : i + 1]) if unread else 0
        lr = inner.optimizer.param_groups[0]["lr"]
        out.append((inner.last_epoch, lr, unread, unread_skips))
    return out


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("owner", ["booster", "engine"])
def test_the_schedule_equals_the_syncing_runs_at_every_record_read(
    owner: str, schedule: str
) -> None:
    """Three counter reads and one read at the record's cadence, skips between them: at every read
    the position and LR are the syncing run's bit for bit; between reads the position is ahead
    by the unread skips exactly (the lag the rule documents), and equal where there is none."""
    last_read = max(COUNTER_READS)
    cadence_read = last_read + DEFAULT_CHECK_EVERY  # the record is full again inside this step
    steps = cadence_read + 3
    bad = [PATTERN[(i * 3) % len(PATTERN)] for i in range(steps)]
    syncing = _trajectory(owner, schedule, False, bad)
    free = _trajectory(owner, schedule, True, bad)
    reads = []
    for i, ((epoch, lr, _, _), (f_epoch, f_lr, unread, unread_skips)) in enumerate(
        zip(syncing, free, strict=True)
    ):
        assert f_epoch - epoch == unread_skips, f"{owner}/{schedule} step {i}: lag"
        if unread_skips == 0:  # a read just now, or no skip since the last one
            assert (f_epoch, f_lr) == (epoch, lr), f"{owner}/{schedule} step {i}"
        if unread == 0:
            reads.append(i)
    assert reads == [*sorted(COUNTER_READS), cadence_read]  # the reads the test compares at
    assert sum(bad[last_read + 1 : cadence_read + 1]) > 0  # skips inside the cadence window
    assert syncing[-1][0] == steps - sum(bad)


def _per_epoch_run(sync_free: bool, bad: list[bool], every: int) -> list[tuple[int, float, int]]:
    """A Booster-owned StepLR stepped once per `every` optimizer steps (an epoch); per epoch:
    (position, lr, the optimizer's unread steps) after its schedule step."""
    torch.manual_seed(0)
    model = tiny_mlp(norm=False)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    booster = Booster(mixed_precision=FP16NaiveMixedPrecision(initial_scale=2.0**8, hysteresis=1))
    model, opt, criterion, _, sched = booster.boost(
        model,
        sgd,
        torch.nn.CrossEntropyLoss(),
        lr_scheduler=torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5),
    )
    opt._sync_free = sync_free
    out = []
    for i, is_bad in enumerate(bad):
        opt.zero_grad()
        x, y = _batch(i, is_bad)
        booster.backward(criterion(model(x), y), opt)
        opt.step()
        if (i + 1) % every == 0:
            sched.step()
            out.append((sched.last_epoch, sgd.param_groups[0]["lr"], opt.unread_steps))
    return out


def test_a_per_epoch_schedule_equals_the_syncing_runs_at_every_record_read() -> None:
    """Epochs of 5 steps against records of 32: a read falls inside an epoch, not at a
    schedule step. An epoch whose steps were all skipped holds; one with a skip among applied
    steps advances; at each epoch boundary with nothing unread the schedule is the syncing
    run's, and epochs whose flags are unread are ahead by the all-skipped ones among them."""
    every, epochs = 5, 14
    bad = [False] * (every * epochs)
    bad[12] = True  # epoch 2: one skip, still advances
    for i in range(35, 40):  # epoch 7: every step skipped, holds (its steps read at step 64)
        bad[i] = True
    syncing = _per_epoch_run(False, bad, every)
    free = _per_epoch_run(True, bad, every)
    assert [e for e, _, _ in syncing] == [*range(1, 8), *range(7, 14)]  # epoch 7 held
    for k, ((epoch, lr, _), (f_epoch, f_lr, unread)) in enumerate(zip(syncing, free, strict=True)):
        end = (k + 1) * every
        all_skipped_unread = sum(
            all(bad[e * every : (e + 1) * every])
            for e in range(epochs)
            if (e + 1) * every <= end and (e + 1) * every > end - unread
        )
        assert f_epoch - epoch == all_skipped_unread, f"epoch {k}: lag"
        if all_skipped_unread == 0:
            assert (f_epoch, f_lr) == (epoch, lr), f"epoch {k}"
    assert free[-1] == (syncing[-1][0], syncing[-1][1], len(bad) - 2 * DEFAULT_CHECK_EVERY)


def _resumed_run(sync_free: bool) -> tuple[int, float, int]:
    """Ten steps (skips at 2 and 7) with a checkpoint of optimizer and schedule taken after
    step 5, the run continued to step 9, then resumed from the checkpoint and run to 9 again;
    (position, lr, skipped steps) once the record is read."""
    from mixprec.core.optim import MixedPrecisionOptimizer

    torch.manual_seed(0)
    model = tiny_mlp(norm=False)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt._sync_free = sync_free
    inner = torch.optim.lr_scheduler.StepLR(opt.optim, step_size=1, gamma=0.5)
    sched = SkipAwareLRScheduler(inner, opt)
    bad = [i in (2, 7) for i in range(10)]

    def run(steps: range) -> None:
        for i in steps:
            opt.zero_grad()
            x, y = _batch(i, bad[i])
            opt.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()
            sched.step()

    run(range(6))
    saved = (opt.state_dict(), sched.state_dict(), copy.deepcopy(model.state_dict()))
    run(range(6, 10))
    assert not sync_free or opt.unread_steps  # the checkpoint is loaded mid-window
    opt.load_state_dict(saved[0])
    sched.load_state_dict(saved[1])
    model.load_state_dict(saved[2])
    run(range(6, 10))
    skipped = opt.skipped_steps  # reads the record
    return inner.last_epoch, opt.optim.param_groups[0]["lr"], skipped


def test_a_schedule_loaded_mid_window_follows_the_loaded_run() -> None:
    """Loading the optimizer and the schedule while flags are unread starts the rule over from
    the loaded counts: the resumed run's schedule is the syncing run's at the read."""
    syncing, free = _resumed_run(False), _resumed_run(True)
    assert syncing == free
    assert syncing[0] == 10 - 2  # the two skips held it
