"""Colossal-AI's `colossalai.zero.low_level`."""

from mixprec.zero.low_level.low_level_optim import LowLevelZeroOptimizer

__all__ = ["LowLevelZeroOptimizer"]
