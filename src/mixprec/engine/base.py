"""What every Engine shares: train/eval, the step that holds the LR schedule on skips, counters.

Engine (one model, gradient accumulation) and PipelineEngine (stages under a 1F1B schedule)
differ in how a batch runs and when a step is due, not in what a step does afterwards.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from mixprec.core.commit import StepResult
from mixprec.core.lr_schedule import SkipAwareLRScheduler
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.skip_monitor import SkipStats


class EngineBase:
    """The model's mode switches and the optimizer's step and counters, seen from an Engine."""

    model: nn.Module
    optimizer: MixedPrecisionOptimizer
    _lr_rule: SkipAwareLRScheduler | None = None

    @property
    def lr_scheduler(self) -> Any:
        """The LR scheduler the engine steps (None: the engine owns none)."""
        return None if self._lr_rule is None else self._lr_rule.scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        # set after the optimizer: the one LR-on-skip rule (the Booster's too), over it
        self._lr_rule = (
            None if scheduler is None else SkipAwareLRScheduler(scheduler, self.optimizer)
        )

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    @property
    def training(self) -> bool:
        return self.model.training

    def _optimizer_step(self) -> StepResult:
        """Unscale, check, clip, step or skip; the LR schedule (if owned) holds on a skipped
        step by SkipAwareLRScheduler's rule (no host read of this step's flag)."""
        result = self.optimizer.step()
        if self._lr_rule is not None:
            self._lr_rule.step()
        return result

    @property
    def loss_scale(self) -> float:
        """The current loss scale (a host sync)."""
        return self.optimizer.loss_scale

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because some rank's gradients were not finite."""
        return self.optimizer.skipped_steps

    @property
    def skip_stats(self) -> SkipStats:
        """The optimizer's step and skip counts, for logging (no host sync)."""
        return self.optimizer.skip_stats

    @property
    def last_result(self) -> StepResult | None:
        """What the last real optimizer step did (None before the first)."""
        return self.optimizer.last_result
