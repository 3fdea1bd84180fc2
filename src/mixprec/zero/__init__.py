"""Colossal-AI's `colossalai.zero`: the low-level ZeRO optimizer a script builds directly.

Before the core/parallel layout this path was the ZeRO module itself (now
mixprec.parallel.zero); its names still import from here (`from mixprec.zero import
ZeroOptimizer`), read from that one module, never copied.
"""

from typing import Any

from mixprec.zero.low_level import LowLevelZeroOptimizer

__all__ = ["LowLevelZeroOptimizer"]


def __getattr__(name: str) -> Any:
    import mixprec.parallel.zero as moved  # the module this path named before the layout

    try:
        return getattr(moved, name)
    except AttributeError:
        raise AttributeError(f"module 'mixprec.zero' has no attribute {name!r}") from None
