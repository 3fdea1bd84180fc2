"""Where mixprec's own messages go: the "mixprec" logger, and a handler that writes to stdout.

Colossal-AI's `get_dist_logger` (mixprec.logging) and the core's debug verbosity both make
sure the logger writes INFO and above to stdout, through the one handler here.
"""

from __future__ import annotations

import logging
import sys


class StdoutHandler(logging.StreamHandler):
    """Writes to whatever sys.stdout is at emit time (pytest and notebooks swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stdout

    @stream.setter
    def stream(self, value: object) -> None:  # StreamHandler.__init__ assigns it: ignored
        pass


def log_info_to_stdout(logger: logging.Logger) -> logging.Logger:
    """Give `logger` one StdoutHandler (once) and let INFO through; returns it."""
    if not any(isinstance(h, StdoutHandler) for h in logger.handlers):
        handler = StdoutHandler()
        handler.setFormatter(logging.Formatter("%(name)s - %(levelname)s: %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    return logger
