"""The bench's progress bar: tqdm when installed (the `[bench]` extra), otherwise none and a note.

The base install (`pip install mixprec`) has no tqdm; the bench must still run there.
"""

from __future__ import annotations

import sys
from typing import Any

NO_TQDM_NOTE = (
    "mixprec bench: no progress bar (tqdm is not installed; `pip install 'mixprec[bench]'` adds it)"
)


class NoBar:
    """tqdm's few methods the runner calls, doing nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def __enter__(self) -> NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress_bar(*, total: int, enabled: bool, desc: str = "mixprec bench") -> Any:
    """A tqdm bar on stderr, or a NoBar when disabled or when tqdm is missing (said once, here)."""
    if not enabled:
        return NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        print(NO_TQDM_NOTE, file=sys.stderr)
        return NoBar()
    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr)
