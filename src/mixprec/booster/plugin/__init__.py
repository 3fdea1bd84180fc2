"""Booster plugins: where the boosted model runs and how its checkpoints are written."""

from typing import Any

from mixprec.booster.plugin.low_level_zero import LowLevelZeroPlugin
from mixprec.booster.plugin.plugin_base import Plugin
from mixprec.booster.plugin.torch_ddp import TorchDDPPlugin

__all__ = [
    "HybridParallelPlugin",
    "LowLevelZeroPlugin",
    "Plugin",
    "TorchDDPPlugin",
    "TorchFSDPPlugin",
]


def __getattr__(name: str) -> Any:
    # torch.distributed.fsdp costs ~0.5 s to import: load it when FSDP is asked for.
    if name == "TorchFSDPPlugin":
        from mixprec.booster.plugin.torch_fsdp import TorchFSDPPlugin

        return TorchFSDPPlugin
    if name == "HybridParallelPlugin":  # torch.distributed.pipelining loads on first use
        from mixprec.booster.plugin.hybrid_parallel import HybridParallelPlugin

        return HybridParallelPlugin
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
