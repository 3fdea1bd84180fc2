"""Colossal-AI's Booster face: `Booster(mixed_precision=..., plugin=...).boost(...)`."""

from mixprec.booster.booster import Booster
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
    "TorchDDPPlugin",
    "TorchFSDPPlugin",
]
