"""Booster plugins: where the boosted model runs and how its checkpoints are written.

Every plugin is imported here eagerly: the FSDP and pipeline modules add tens of milliseconds
to `import mixprec.booster` (python -X importtime), next to the seconds torch itself takes.
"""

from mixprec.booster.plugin.hybrid_parallel import HybridParallelPlugin
from mixprec.booster.plugin.low_level_zero import LowLevelZeroPlugin
from mixprec.booster.plugin.plugin_base import Plugin
from mixprec.booster.plugin.torch_ddp import TorchDDPPlugin
from mixprec.booster.plugin.torch_fsdp import TorchFSDPPlugin

__all__ = [
    "HybridParallelPlugin",
    "LowLevelZeroPlugin",
    "Plugin",
    "TorchDDPPlugin",
    "TorchFSDPPlugin",
]
