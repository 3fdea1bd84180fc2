"""Colossal-AI's `get_dist_logger`: a logger that can speak on chosen ranks only.

    from mixprec.logging import get_dist_logger

    logger = get_dist_logger()
    logger.info(f"Epoch {epoch} - train loss: {loss:.5}", ranks=[0])

It is the standard `logging` logger of that name ("mixprec" by default, where the library's
own messages go) with one handler writing INFO and above to stdout, as Colossal-AI's did.
`ranks=None` logs on every rank; `ranks=[0]` on rank 0 only (rank 0 outside torch.distributed).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from mixprec.core.logs import log_info_to_stdout
from mixprec.core.scaling import rank_and_world

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _check_level(level: str) -> int:
    if not isinstance(level, str) or level.upper() not in LEVELS:
        raise ValueError(f"level={level!r}; valid: {', '.join(repr(v) for v in LEVELS)}.")
    return getattr(logging, level.upper())


class DistributedLogger:
    """A named logger whose calls take `ranks`: the ranks that write the message."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.logger = log_info_to_stdout(logging.getLogger(name))

    def _log(self, level: int, message: str, ranks: Sequence[int] | None) -> None:
        if ranks is not None:
            if (
                not isinstance(ranks, Sequence)
                or isinstance(ranks, str | bytes)
                or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks)
            ):
                raise TypeError(f"ranks={ranks!r} must be None or a list of int ranks.")
            if rank_and_world()[0] not in ranks:
                return
        self.logger.log(level, message, stacklevel=3)  # the caller's line, not this one

    def debug(self, message: str, ranks: Sequence[int] | None = None) -> None:
        self._log(logging.DEBUG, message, ranks)

    def info(self, message: str, ranks: Sequence[int] | None = None) -> None:
        self._log(logging.INFO, message, ranks)

    def warning(self, message: str, ranks: Sequence[int] | None = None) -> None:
        self._log(logging.WARNING, message, ranks)

    def error(self, message: str, ranks: Sequence[int] | None = None) -> None:
        self._log(logging.ERROR, message, ranks)

    def set_level(self, level: str) -> None:
        """'DEBUG', 'INFO', 'WARNING', 'ERROR' or 'CRITICAL'."""
        self.logger.setLevel(_check_level(level))

    def log_to_file(
        self, path: str | Path, mode: str = "a", level: str = "INFO", suffix: str | None = None
    ) -> None:
        """Also write to `path/rank_<rank>[_<suffix>].log` (path: a folder, created if absent)."""
        if mode not in ("a", "w"):
            raise ValueError(f"mode={mode!r}; valid: 'a' (append), 'w' (overwrite).")
        folder = Path(path)
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"path={str(path)!r} is a file; log_to_file takes a folder.")
        folder.mkdir(parents=True, exist_ok=True)
        name = f"rank_{rank_and_world()[0]}" + (f"_{suffix}" if suffix else "") + ".log"
        handler = logging.FileHandler(folder / name, mode=mode)
        handler.setLevel(_check_level(level))
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        self.logger.addHandler(handler)

    def __repr__(self) -> str:
        return f"DistributedLogger({self.name!r})"


_loggers: dict[str, DistributedLogger] = {}


def get_dist_logger(name: str = "mixprec") -> DistributedLogger:
    """The DistributedLogger of that name (one per name, as in Colossal-AI)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name={name!r} must be a non-empty str.")
    if name not in _loggers:
        _loggers[name] = DistributedLogger(name)
    return _loggers[name]


__all__ = ["DistributedLogger", "get_dist_logger"]
