"""Colossal-AI's `colossalai.zero`: the low-level ZeRO optimizer a script builds directly.

The ZeRO machinery itself (ZeroOptimizer, partition_params, ...) lives in mixprec.parallel.zero.
"""

from mixprec.zero.low_level import LowLevelZeroOptimizer

__all__ = ["LowLevelZeroOptimizer"]
