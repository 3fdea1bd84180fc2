"""Apex's `apex.amp.frontend` path: `from mixprec.apex.amp.frontend import _amp_state`.

Scripts reach amp's state and Properties through this module too; every name is the same
object as in `mixprec.apex.amp`.
"""

from mixprec.apex.amp import initialize
from mixprec.apex.amp._amp_state import _amp_state
from mixprec.apex.amp_state import Properties

__all__ = ["Properties", "_amp_state", "initialize"]
