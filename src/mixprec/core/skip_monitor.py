"""Skipped steps made visible: one summary after a run that starts by skipping (the loss scale's
warm-up), a warning when skips exceed a rate later, and the counts for a user's own logging.

Fed only host values every step already has (the skip flag and the scale read in the step's one
host sync), so watching adds no synchronisation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mixprec.core.validate import check_int

DEFAULT_WINDOW = 100
"""Steps per window over which the later skip rate is measured."""
DEFAULT_WARN_RATE = 0.05
"""A healthy dynamic scale skips ~1-2 steps per growth interval (1000-2000 steps); 5 in 100 is not."""


def scale_text(scale: float) -> str:
    """2**15 for a power of two (how scales are set and read), else the number."""
    if scale > 0 and math.isfinite(scale):
        exponent = math.log2(scale)
        if exponent == int(exponent):
            return f"2**{int(exponent)}"
    return f"{scale:g}"


@dataclass(frozen=True, kw_only=True)
class SkipStats:
    """Step counts of one optimizer, for logging (reading them costs no host sync)."""

    steps: int
    """Optimizer steps taken, skipped ones included (no-op steps not)."""
    noop_steps: int = 0
    """step() calls that found no gradient on this rank: nothing was stepped or skipped."""
    skipped_steps: int
    """Steps skipped because some rank's gradients held inf/nan."""
    consecutive_skips: int
    """Skipped steps in a row, up to the last one."""
    warmup_skips: int
    """Steps skipped before the first applied one (the scale's warm-up from its initial value)."""
    last_scale: float | None
    """The loss scale the last step ran under (None before the first)."""


class SkipMonitor:
    """Watches each step's (skipped, scale) and returns the one-line message to log, if any.

    Args:
        window: steps per window for the later skip rate (after the first applied step).
        warn_rate: warn when more than this fraction of a window's steps were skipped.
    """

    def __init__(self, *, window: int = DEFAULT_WINDOW, warn_rate: float = DEFAULT_WARN_RATE):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"SkipMonitor window={window!r} must be an int >= 1.")
        if isinstance(warn_rate, bool) or not isinstance(warn_rate, (int, float)):
            raise TypeError(f"SkipMonitor warn_rate={warn_rate!r} must be a number in [0, 1).")
        if not 0 <= warn_rate < 1:
            raise ValueError(f"SkipMonitor warn_rate={warn_rate!r} must be in [0, 1).")
        self.window = window
        self.warn_rate = float(warn_rate)
        self.warmup_skips = 0
        self.warming_up = True  # until the first applied step
        self._first_scale: float | None = None
        self._window_steps = 0
        self._window_skips = 0

    def resume(self, steps: int) -> None:
        """After loading a checkpoint of a run that had stepped: its warm-up is behind it."""
        self.warming_up = steps == 0
        self._window_steps = self._window_skips = 0

    def record(self, skipped: bool, scale: float) -> str | None:
        """Count one step; the message to log now, or None."""
        if self.warming_up:
            if self._first_scale is None:
                self._first_scale = scale
            if skipped:
                self.warmup_skips += 1
                return None
            self.warming_up = False
            if self.warmup_skips == 0:
                return None
            if scale >= self._first_scale:  # no scale fell: these skips were not a warm-up
                return (
                    f"mixprec: the first {self.warmup_skips} step(s) were skipped for inf/nan "
                    f"gradients at a loss scale of {scale_text(scale)} that did not fall: not a "
                    "scale warm-up; look at the data and the loss."
                )
            return (
                f"mixprec: the first {self.warmup_skips} step(s) were skipped (inf/nan gradients) "
                f"while the loss scale fell from {scale_text(self._first_scale)} to "
                f"{scale_text(scale)}: normal warm-up for this initial scale; a lower initial "
                "scale skips fewer. Later skips are warned about when they exceed "
                f"{self.warn_rate:.0%} of {self.window} steps."
            )
        self._window_steps += 1
        self._window_skips += skipped
        if self._window_steps < self.window:
            return None
        skips, steps = self._window_skips, self._window_steps
        self._window_steps = self._window_skips = 0
        if skips <= self.warn_rate * steps:
            return None
        return (
            f"mixprec: {skips} of the last {steps} steps were skipped for inf/nan gradients "
            f"(last loss scale {scale_text(scale)}), more than the {self.warn_rate:.0%} a healthy "
            "dynamic loss scale skips: the loss or some gradients overflow at any scale "
            "(mixprec.debugging.NonFiniteLocator names the first module), or try bf16."
        )


class ScaleCollapseError(RuntimeError):
    """Too many consecutive steps were skipped: the run cannot make progress."""


UNNAMED = "no .grad on this rank (another rank's, or a step that keeps none: compile_step)"
"""Where a collapse's non-finite gradients are when no parameter's .grad holds one here."""


class StepCounter:
    """One optimizer's step counts, its skip monitor and its guard against a collapsing scale.

    Args:
        max_consecutive_skips: check_collapse raises ScaleCollapseError after this many skipped
            steps in a row (None: never).
    """

    def __init__(self, max_consecutive_skips: int | None) -> None:
        check_int("max_consecutive_skips", max_consecutive_skips, optional=True)
        if max_consecutive_skips is not None and max_consecutive_skips < 1:
            raise ValueError(
                f"max_consecutive_skips={max_consecutive_skips!r} must be >= 1 or None."
            )
        self.steps = 0
        """Optimizer steps taken, skipped ones included (counted by the step itself)."""
        self.noop_steps = 0
        """step() calls that found no gradient (not counted in steps)."""
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.last_result: Any = None
        """The last counted step's StepResult (None before the first)."""
        self.max_consecutive_skips = max_consecutive_skips
        self.monitor = SkipMonitor()
        self.watchers: list[Callable[[bool], None]] = []
        """Told each counted step's skipped flag, in step order (see watch)."""

    def watch(self, watcher: Callable[[bool], None]) -> None:
        """Call watcher(skipped) for every step counted from now on, in step order, when it is
        counted: in the step itself where it reads its flag on the host, at the device record's
        read (up to check_every steps later) where it does not. No host read of its own."""
        self.watchers.append(watcher)

    def record(self, result: Any) -> str | None:
        """Count one step's result (a StepResult: .skipped, .scale); the skip monitor's message
        to log now, or None."""
        skipped = result.skipped
        self.skipped_steps += skipped
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        self.last_result = result
        for watcher in self.watchers:
            watcher(skipped)
        return self.monitor.record(skipped, result.scale)

    def check_collapse(self, scaler: Any, nonfinite_params: Callable[[], list[str]]) -> None:
        """Raise ScaleCollapseError once max_consecutive_skips steps in a row were skipped,
        naming the scaler's scale and floor and the params with non-finite grads (read only
        then: a host sync per param)."""
        limit = self.max_consecutive_skips
        if limit is None or self.consecutive_skips < limit:
            return
        bad = nonfinite_params()
        raise ScaleCollapseError(
            f"{self.consecutive_skips} steps in a row were skipped for non-finite gradients "
            f"(loss scale now {scaler.scale:g}, floor {scaler.cfg.min_scale:g}). "
            f"Non-finite gradients this step in: {bad[:10] or UNNAMED}"
            f"{' ...' if len(bad) > 10 else ''}. The run overflows at any scale: look for a "
            "nan/inf in the data or loss (mixprec.debugging.NonFiniteLocator names the first "
            "module), lower the learning rate, or train in bf16, which has fp32's range."
        )

    def stats(self) -> SkipStats:
        """The counts as SkipStats (host values: no sync)."""
        last = self.last_result
        return SkipStats(
            steps=self.steps,
            noop_steps=self.noop_steps,
            skipped_steps=self.skipped_steps,
            consecutive_skips=self.consecutive_skips,
            warmup_skips=self.monitor.warmup_skips,
            last_scale=None if last is None else last.scale,
        )
