"""Booster plugins: where the boosted model runs and how its checkpoints are written."""

from mixprec.booster.plugin.plugin_base import Plugin
from mixprec.booster.plugin.torch_ddp import TorchDDPPlugin
from mixprec.booster.plugin.torch_fsdp import TorchFSDPPlugin

__all__ = ["Plugin", "TorchDDPPlugin", "TorchFSDPPlugin"]
