"""Colossal-AI's Booster face: `Booster(mixed_precision=..., plugin=...).boost(...)`."""

from mixprec.booster.booster import Booster, SkipAwareLRScheduler
from mixprec.booster.plugin import (
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    Plugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)

__all__ = [
    "Booster",
    "HybridParallelPlugin",
    "LowLevelZeroPlugin",
    "Plugin",
    "SkipAwareLRScheduler",
    "TorchDDPPlugin",
    "TorchFSDPPlugin",
]
