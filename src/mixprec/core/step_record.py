"""The device-side record of steps that did not read their overflow flag on the host.

A step with no host sync (compile_step's graph, the eager optimizer's sync-free step) still owes
its counters (steps skipped, in a row, the skip monitor's warm-up summary and rate warning,
ScaleCollapseError): each step writes its row (skipped flag, the scale it ran under, its grad
norm) into a small device buffer at a device cursor, and the host reads all pending rows in one
sync every `check_every` steps, or when a counter is read. Both steps use this one record; what a
row means to the counters is the caller's `count` (one call per row, in step order).

Everything `write` does is device tensor math (no host read, no data-dependent host branch), so
it runs inside a compiled graph as it runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DEFAULT_CHECK_EVERY = 32
"""Steps between the host's reads of the record (one sync each): a skip is logged, and a
collapse raised, up to check_every - 1 steps late."""

Count = Callable[[bool, float, "float | None"], None]
"""count(skipped, scale, grad_norm): what one recorded step does to the caller's counters."""


def check_every_value(check_every: int) -> int:
    """check_every validated: an int >= 1."""
    if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
        raise ValueError(f"check_every={check_every!r} must be an int >= 1.")
    return check_every


class StepRecord:
    """Rows (skipped, scale, grad norm) written on the device, counted on the host in batches.

    Args:
        check_every: rows held before `step_done` reads them (one host sync per read).
        device: where the rows live (None: the first `write`'s device; a compiled graph needs
            them before it is traced).
    """

    def __init__(
        self, check_every: int = DEFAULT_CHECK_EVERY, device: torch.device | None = None
    ) -> None:
        self.check_every = check_every_value(check_every)
        self._rows: torch.Tensor | None = None
        self._cursor: torch.Tensor | None = None  # the next row, on the device: no guard, no sync
        self.pending = 0
        """Rows written since the last read (a host count: no sync)."""
        self._has_norm: list[bool] = []  # per pending row: whether its step computed a norm
        if device is not None:
            self._allocate(torch.device(device))

    def _allocate(self, device: torch.device) -> None:
        self._rows = torch.zeros(self.check_every, 3, device=device)
        self._cursor = torch.zeros(1, dtype=torch.int64, device=device)

    def write(
        self, found_inf: torch.Tensor, scale: torch.Tensor, norm: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Write one step's row at the device cursor (device ops only: traceable, no sync) and
        return it (a (1, 3) fp32 tensor of its own). Follow it with step_done() on the host."""
        if self._rows is None:
            self._allocate(found_inf.device)
        flag = (found_inf.reshape(1) > 0).float()
        parts = [flag, scale.reshape(1).to(flag)]
        parts.append(
            torch.full_like(flag, float("nan")) if norm is None else norm.reshape(1).to(flag)
        )
        row = torch.cat(parts).reshape(1, 3)
        self._rows.index_copy_(0, self._cursor, row)
        self._cursor.add_(1)
        return row

    def step_done(self, count: Count, *, has_norm: bool = False) -> None:
        """The host side of one write: count it, and read the record once it holds check_every
        rows (the one host sync per check_every steps)."""
        self._has_norm.append(has_norm)
        self.pending += 1
        if self.pending >= self.check_every:
            self.read(count)

    def read(self, count: Count) -> int:
        """count() every pending row, oldest first (one host sync for all); returns the skips read.
        A count that raises (ScaleCollapseError) drops the rows after it: they were counted into
        the error's run, which stops."""
        if not self.pending:
            return 0
        rows = self._rows[: self.pending].tolist()  # the host sync, once per record
        has_norm, self._has_norm = self._has_norm, []
        self.pending = 0
        self._cursor.zero_()
        skips = 0
        for (flag, scale, norm), with_norm in zip(rows, has_norm, strict=True):
            skips += flag > 0
            count(flag > 0, scale, norm if with_norm else None)
        return skips
