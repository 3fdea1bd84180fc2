"""Colossal-AI's Booster face: `Booster(mixed_precision=..., plugin=...).boost(...)`."""

from typing import Any

from mixprec.booster.booster import Booster, SkipAwareLRScheduler
from mixprec.booster.plugin import Plugin, TorchDDPPlugin

__all__ = ["Booster", "Plugin", "SkipAwareLRScheduler", "TorchDDPPlugin", "TorchFSDPPlugin"]


def __getattr__(name: str) -> Any:
    if name == "TorchFSDPPlugin":  # imported on demand: see mixprec.booster.plugin
        from mixprec.booster.plugin import TorchFSDPPlugin

        return TorchFSDPPlugin
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
