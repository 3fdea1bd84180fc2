"""Operator statistics: how many calls each aten op made, by output dtype (Paddle's op stats).

The counter is a TorchDispatchMode, so it sits below autocast and autograd in the dispatcher:
it sees the op autocast really dispatched (`addmm` in bfloat16, not `linear` in float32) and
every op the autograd engine runs for the backward pass.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any, Literal, get_args

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from typing_extensions import override

from mixprec.core.policy import did_you_mean
from mixprec.debugging._markdown import markdown_table

DtypeColumn = Literal["float32", "float16", "bfloat16", "other"]
DTYPE_COLUMNS: tuple[str, ...] = get_args(DtypeColumn)
Phase = Literal["all", "forward", "backward"]
PHASES: tuple[str, ...] = get_args(Phase)

_COLUMN_OF: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


def dtype_to_column(dtype: torch.dtype | None) -> str:
    """float32/float16/bfloat16 name their own column; float64, ints, bool, fp8, None: 'other'."""
    return _COLUMN_OF.get(dtype, "other") if dtype is not None else "other"


def op_to_name(func: torch._ops.OpOverload) -> str:
    """aten::addmm.default -> 'addmm'; ops of other namespaces keep theirs ('mylib::op')."""
    return func._schema.name.removeprefix("aten::")


def _output_dtype(out: Any, args: tuple, kwargs: dict) -> torch.dtype | None:
    # The first tensor output is the op's result (native_layer_norm's mean/rstd come after);
    # in-place foreach ops return nothing, so their first tensor argument is what they wrote.
    for leaves in (tree_leaves(out), tree_leaves((args, kwargs))):
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                return leaf.dtype
    return None


def _in_backward() -> bool:
    # The autograd engine sets a graph-task id while it runs backward nodes; -1 outside.
    return torch._C._current_graph_task_id() != -1


class OperatorStats:
    """Per-op call counts by output dtype, kept apart for the forward and the backward pass."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], Counter[str]] = {}

    def record(self, op: str, dtype: torch.dtype | None, *, backward: bool) -> None:
        """Count one call of `op` whose output had `dtype`."""
        phase = "backward" if backward else "forward"
        self._counts.setdefault((phase, op), Counter())[dtype_to_column(dtype)] += 1

    def as_dict(self, phase: Phase = "all") -> dict[str, dict[str, int]]:
        """{op: {'float32': n, 'float16': n, 'bfloat16': n, 'other': n}}, ops sorted by name."""
        _check_phase(phase)
        merged: dict[str, Counter[str]] = {}
        for (op_phase, op), counts in self._counts.items():
            if phase in ("all", op_phase):
                merged.setdefault(op, Counter()).update(counts)
        return {op: {c: merged[op][c] for c in DTYPE_COLUMNS} for op in sorted(merged)}

    def total_by_dtype(self, phase: Phase = "all") -> dict[str, int]:
        """Calls summed over ops: {'float32': n, 'float16': n, 'bfloat16': n, 'other': n}."""
        totals = Counter({c: 0 for c in DTYPE_COLUMNS})
        for counts in self.as_dict(phase).values():
            totals.update(counts)
        return {c: totals[c] for c in DTYPE_COLUMNS}

    def calls(self, op: str, dtype: str | torch.dtype, phase: Phase = "all") -> int:
        """How many calls of `op` produced `dtype` ('bfloat16' or torch.bfloat16; 'other')."""
        column = dtype_to_column(dtype) if isinstance(dtype, torch.dtype) else dtype
        if column not in DTYPE_COLUMNS:
            raise ValueError(
                f"Unknown dtype column {dtype!r}." + did_you_mean(dtype, DTYPE_COLUMNS)
            )
        return self.as_dict(phase).get(op, {}).get(column, 0)

    def table(self, phase: Phase = "all") -> str:
        """A markdown table, one row per op sorted by name, then a total row."""
        data = self.as_dict(phase)
        rows = [[op, *counts.values(), sum(counts.values())] for op, counts in data.items()]
        totals = self.total_by_dtype(phase)
        rows.append(["**total**", *totals.values(), sum(totals.values())])
        return markdown_table(["op", *DTYPE_COLUMNS, "calls"], rows)

    def __len__(self) -> int:
        """Number of distinct ops seen (forward and backward together)."""
        return len({op for _, op in self._counts})


def _check_phase(phase: str) -> None:
    if phase not in PHASES:
        raise ValueError(f"Unknown phase {phase!r}." + did_you_mean(phase, PHASES))


class _CountingMode(TorchDispatchMode):
    def __init__(self, stats: OperatorStats) -> None:
        super().__init__()
        self.stats = stats

    @override
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.stats.record(
            op_to_name(func), _output_dtype(out, args, kwargs), backward=_in_backward()
        )
        return out


@contextlib.contextmanager
def collect_operator_stats(
    stats: OperatorStats | None = None, *, print_on_exit: bool = False
) -> Iterator[OperatorStats]:
    """Count every aten op run inside the block by output dtype; yields the OperatorStats.

    Nest it inside or outside torch.autocast: either way it counts what autocast dispatched.
    Pass `stats` to keep adding to an earlier collection; `print_on_exit` prints the table
    when the block ends (what Paddle's collect_operator_stats does).
    Cost: one Python call per aten op, so a step runs several times slower while counting.
    """
    stats = OperatorStats() if stats is None else stats
    try:
        with _CountingMode(stats):
            yield stats
    finally:
        if print_on_exit:
            print(stats.table())
