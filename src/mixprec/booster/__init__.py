"""Colossal-AI's Booster face: `Booster(mixed_precision=..., plugin=...).boost(...)`."""

from mixprec.booster.booster import Booster, SkipAwareLRScheduler
from mixprec.booster.plugin import Plugin, TorchDDPPlugin, TorchFSDPPlugin

__all__ = ["Booster", "Plugin", "SkipAwareLRScheduler", "TorchDDPPlugin", "TorchFSDPPlugin"]
