"""The LR schedule holds on a skipped step: one rule for every owner of a schedule (the Booster,
the Engine), on host counts only, so it keeps the sync-free step free of host reads.

A skipped step leaves the weights as they were, so the schedule must not move either. The rule
learns each step's skip flag where the optimizer counts it (StepCounter.watch): in the step
itself on the syncing path, at the device record's read on the sync-free one (every
check_every steps, mixprec.core.step_record, or when a skip counter is read). It never reads
a flag itself.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from mixprec.core.optim import MixedPrecisionOptimizer


@dataclass
class _Call:
    """One call of the rule's step(): the optimizer steps since the previous call, and whether
    it advanced the schedule."""

    end: int
    """The optimizer's step count at the call: its steps are (previous call's end, end]."""
    applied: bool
    """Some step of the call's counted so far was applied."""
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    advanced: bool = True
    """Whether the schedule stands advanced by this call (provisionally, until its flags are
    counted; then for good or, for a call whose steps were all skipped, taken back)."""


class SkipAwareLRScheduler:
    """An LR scheduler whose position follows the optimizer steps that took effect.

    Each step() advances the wrapped schedule when some optimizer step since the previous call
    was applied and holds it when all were skipped (or none was taken, once the optimizer has
    stepped): a per-step schedule (step() after every optimizer.step()) holds on a skipped
    step, a per-epoch one advances if any step of the epoch went through.

    Where the step flags are read on the host every step (the syncing step), each call is
    decided at once. Where they wait on the sync-free step's device record (on CUDA by default,
    or forced), a call whose steps are not counted yet advances the schedule as if they were
    applied, and the moment the record is read (inside the optimizer.step() that fills it,
    every check_every steps, or when a skip counter is read) every call it completes is
    decided by its own steps' flags and the schedule is rebuilt where the syncing path has it
    (its state before the first undecided call, stepped once per call that advances, with that
    call's arguments). The lag that remains: between a skip and the next read the LR is ahead
    of the syncing path's by the number of calls whose steps were all skipped since the last
    read, so the steps in that window (at most check_every - 1 of them) run at that LR. A run
    without a skip in a window has the syncing path's LR at every step. Clean steps cost no
    host read.

    Every other attribute (get_last_lr, last_epoch, ...) is the wrapped scheduler's.
    """

    def __init__(self, scheduler: Any, optimizer: MixedPrecisionOptimizer) -> None:
        self.scheduler = scheduler
        self.optimizer = optimizer
        self.held_steps = 0
        """Calls to step() that did not advance the schedule (no optimizer step took effect)."""
        self._resync()
        optimizer.counts.watch(self._step_counted)

    def _resync(self) -> None:
        """Start from the optimizer's counts as they are (construction, or after a load)."""
        counts = self.optimizer.counts
        self._end = counts.steps  # the optimizer's step count at the last call
        self._counted = counts.steps - self.optimizer.unread_steps  # steps whose flag we saw
        self._open_applied = False  # some counted step after the last call was applied
        self._window: list[_Call] = []  # the calls since _saved, in order
        self._undecided: deque[_Call] = deque()  # those whose steps are not all counted yet
        self._saved: tuple[dict[str, Any], list[Any]] | None = None  # schedule before _window

    def step(self, *args: Any, **kwargs: Any) -> None:
        steps = self.optimizer.counts.steps
        if steps < self._end:  # the optimizer's counters were loaded back: start from them
            self._resync()
        empty = steps == self._end
        call = _Call(steps, self._open_applied or (empty and steps == 0), args, kwargs)
        self._end, self._open_applied = steps, False
        decided = empty or self._counted >= steps
        call.advanced = call.applied or not decided
        if decided and not self._window:
            self._advance(call)
            return
        if not self._window:
            groups = self.scheduler.optimizer.param_groups
            self._saved = (copy.deepcopy(self.scheduler.state_dict()), [g["lr"] for g in groups])
        self._window.append(call)
        if not decided:
            self._undecided.append(call)
        self._advance(call)

    def _advance(self, call: _Call) -> None:
        if call.advanced:
            self.scheduler.step(*call.args, **call.kwargs)
        else:
            self.held_steps += 1  # the weights did not move, so the schedule must not either

    def _step_counted(self, skipped: bool) -> None:
        """The optimizer counted its next step (StepCounter.watch): the call it belongs to is
        decided once its last step is counted, and the schedule rebuilt if that call holds."""
        self._counted += 1
        if not self._undecided:
            self._open_applied |= not skipped
            return
        call = self._undecided[0]
        call.applied |= not skipped
        if self._counted < call.end:
            return
        self._undecided.popleft()
        if not call.applied:
            call.advanced = False
            self.held_steps += 1
            self._rebuild()
        if not self._undecided:  # every call since _saved is decided: the schedule is exact
            self._window, self._saved = [], None

    def _rebuild(self) -> None:
        """The schedule from its state before the window, stepped by each call that advances."""
        assert self._saved is not None
        state, lrs = self._saved
        self.scheduler.load_state_dict(copy.deepcopy(state))
        for group, lr in zip(self.scheduler.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr  # chainable schedules (ExponentialLR, ...) step from the group's lr
        for call in self._window:
            if call.advanced:
                self.scheduler.step(*call.args, **call.kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped scheduler's state; the rule starts over from the optimizer's
        counts (load the optimizer first, as Booster.load_optimizer does)."""
        self.scheduler.load_state_dict(state_dict)
        self._resync()

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # not set yet (e.g. during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"SkipAwareLRScheduler({self.scheduler!r})"
