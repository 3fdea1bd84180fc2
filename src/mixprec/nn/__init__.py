"""Colossal-AI's `colossalai.nn` names that training scripts import (LR schedulers)."""

from mixprec.nn import lr_scheduler

__all__ = ["lr_scheduler"]
