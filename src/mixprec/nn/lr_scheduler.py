"""Colossal-AI's LR schedulers, by step count: `CosineAnnealingLR(optimizer, total_steps)`,
`LinearWarmupLR(optimizer, total_steps, warmup_steps)`.

Both are torch LRScheduler subclasses (state_dict, get_last_lr, chaining work as usual). A
"step" is one call to `scheduler.step()`: seed 000 calls it once per epoch, so there
total_steps is NUM_EPOCHS.
"""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LRScheduler
from typing_extensions import override


def _check_steps(total_steps: int, warmup_steps: int = 0) -> None:
    for name, value in (("total_steps", total_steps), ("warmup_steps", warmup_steps)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}={value!r} must be an int.")
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps!r} must be >= 1.")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps!r} must be >= 0.")


class CosineAnnealingLR(torch.optim.lr_scheduler.CosineAnnealingLR):
    """Cosine decay from the base LR to eta_min over total_steps (torch's, T_max=total_steps)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        eta_min: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        _check_steps(total_steps)
        self.total_steps = total_steps
        super().__init__(optimizer, T_max=total_steps, eta_min=eta_min, last_epoch=last_epoch)


class LinearWarmupLR(LRScheduler):
    """Linear warmup to the base LR over warmup_steps, then linear decay to 0 at total_steps.

    Step t < warmup_steps: lr * (t + 1) / (warmup_steps + 1); after: lr * (total_steps - t) /
    (total_steps - warmup_steps), held at 0 past total_steps (Colossal-AI went negative, or
    divided by zero when warmup_steps == total_steps).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        warmup_steps: int = 0,
        last_epoch: int = -1,
    ) -> None:
        _check_steps(total_steps, warmup_steps)
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, last_epoch=last_epoch)

    def lr_factor(self, step: int) -> float:
        """The multiplier of the base LR at this step."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        # warmup_steps >= total_steps (seed 003: 50 warmup steps, total NUM_EPOCHS): 0 after
        decay = (self.total_steps - step) / max(1, self.total_steps - self.warmup_steps)
        return max(0.0, decay)  # a negative LR would climb the loss

    @override
    def get_lr(self) -> list[float]:  # type: ignore[override]
        factor = self.lr_factor(self.last_epoch)
        return [base_lr * factor for base_lr in self.base_lrs]


__all__ = ["CosineAnnealingLR", "LinearWarmupLR"]
