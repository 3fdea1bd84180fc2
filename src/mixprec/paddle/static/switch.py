"""enable_static / disable_static: Paddle's mode switch (program recording + Optimizer.minimize).

Apart from program.py so the program records without knowing amp.py, which builds on it.
"""

from __future__ import annotations

from mixprec.paddle.static.amp import install_minimize, remove_minimize
from mixprec.paddle.static.program import _MODE


def enable_static() -> None:
    """Switch to static mode: data() records programs; torch optimizers gain `minimize`."""
    _MODE.static = True
    install_minimize()


def disable_static() -> None:
    """Back to dynamic mode (torch's eager execution); removes Optimizer.minimize again."""
    _MODE.static = False
    remove_minimize()
