"""paddle.amp.debugging.compare_accuracy: pair two runs' tensor-checker dumps op by op.

Run the same steps twice with the tensor checker writing to a directory (CHECK_ALL writes a
line per checked op output; the other modes only the bad ones):

    config = debugging.TensorCheckerConfig(True, debugging.DebugMode.CHECK_ALL, output_dir="fp32")
    debugging.enable_tensor_checker(config); step(); debugging.disable_tensor_checker()
    ... the same with auto_cast(dtype='bfloat16') and output_dir="bf16" ...
    debugging.compare_accuracy("fp32", "bf16", "compare.csv", loss_scale=1024)

Each directory holds one file per device, worker_<device>, of lines in Paddle's format
(tests/data/paddle_331_dump holds Paddle 3.3.1's own):

    [PRECISION] in [device=cpu, op=addmm, tensor=out0, dtype=fp32], numel=8, num_zero=0,
    max=1.2e+00, min=-3.0e-01, mean=4.1e-01, shape=2x4, step=0

with `[ERROR]` and num_nan / num_inf when the output holds one. Lines pair by op and tensor name
and their count (the k-th `addmm/out0` of one run with the k-th of the other), as Paddle's: an
op only one run has (autocast's casts) is a row of its own and shifts no other pair. Backward
lines (tensor name `<autograd node>.out<i>@GRAD`; Paddle's `*GRAD*` names and `*_grad` ops)
of the second run are divided by loss_scale before they are compared, unless they agree with
the first run as they are (a backward op on a saved forward tensor: relu's mask, a transposed
weight, runs unscaled; Paddle's sheet likewise accepts a ratio of 1 or of loss_scale).

Paddle writes an xlsx workbook through xlsxwriter; mixprec does the same when xlsxwriter is
importable (it is no dependency of mixprec's), else a CSV file, with a `worker` column in place
of the workbook's sheet per file.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

log = logging.getLogger("mixprec")

_DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
}
"""Paddle's dtype spellings in its dump lines."""

PADDLE_ALLCLOSE = {"rtol": 1e-2, "atol": 1e-2}
"""When two runs' max / min / mean agree: Paddle's accuracy_compare.is_allclose figures. They
pass bf16's rounding (2**-8 relative per op) through a few layers and catch any real mismatch
(a factor, a wrong op) whose values are not below 1e-2 in magnitude."""


def worker_file_name(device: str) -> str:
    """The dump file of a device: worker_cpu (Paddle 3.3.1's name on CPU), worker_cuda0."""
    return "worker_" + device.replace(":", "")


@dataclass(frozen=True)
class DumpLine:
    """One line of a tensor-checker dump: an op output's statistics."""

    device: str
    op: str
    tensor: str
    dtype: str | torch.dtype
    num_zero: int
    max: float
    min: float
    mean: float
    numel: int | None = None
    num_nan: int = 0
    num_inf: int = 0
    shape: tuple[int, ...] | None = None
    step: int | None = None

    @property
    def key(self) -> str:
        """What pairs two runs' lines (with the count of earlier lines of the same key)."""
        # Paddle's static graph names a cast variable x.cast_fp16 (or .cast_fp32)
        return f"{self.op}/{self.tensor}".replace(".cast_fp16", "").replace(".cast_fp32", "")

    @property
    def backward(self) -> bool:
        return "GRAD" in self.tensor or self.op.endswith("_grad")

    @property
    def size(self) -> int | None:
        if self.numel is not None:
            return self.numel
        return math.prod(self.shape) if self.shape is not None else None

    def format(self) -> str:
        dtype = self.dtype
        if isinstance(dtype, torch.dtype):
            dtype = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
        error = "[ERROR] " if self.num_nan or self.num_inf else ""
        counts = f", num_nan={self.num_nan}, num_inf={self.num_inf}" if error else ""
        extra = ""
        if self.shape is not None:
            extra += f", shape={'x'.join(map(str, self.shape)) or 'scalar'}"
        if self.step is not None:
            extra += f", step={self.step}"
        return (
            f"[PRECISION] {error}in [device={self.device}, op={self.op}, tensor={self.tensor}, "
            f"dtype={dtype}], numel={self.size}{counts}, num_zero={self.num_zero}, "
            f"max={self.max:e}, min={self.min:e}, mean={self.mean:e}{extra}"
        )

    @classmethod
    def parse(cls, line: str) -> DumpLine:
        fields = dict(_FIELD.findall(line.split("[PRECISION]", 1)[1]))
        try:
            shape = fields.get("shape")
            return cls(
                device=fields["device"],
                op=fields["op"],
                tensor=fields.get("tensor", ""),
                dtype=fields["dtype"],
                numel=int(fields["numel"]),
                num_nan=int(fields.get("num_nan", 0)),
                num_inf=int(fields.get("num_inf", 0)),
                num_zero=int(fields["num_zero"]),
                max=float(fields["max"]),
                min=float(fields["min"]),
                mean=float(fields["mean"]),
                shape=None
                if shape is None
                else ()
                if shape == "scalar"
                else tuple(int(s) for s in shape.split("x")),
                step=int(fields["step"]) if "step" in fields else None,
            )
        except (KeyError, ValueError) as e:
            raise ValueError(f"Not a tensor-checker dump line ({e!r}): {line.strip()!r}") from e


_FIELD = re.compile(r"(\w+)=([^,\]\s]*)")


def read_dump(path: str) -> list[DumpLine]:
    """The [PRECISION] lines of one worker_* file, in the order they were written."""
    with open(path) as f:
        return [DumpLine.parse(line) for line in f if "[PRECISION]" in line]


@dataclass(frozen=True)
class ComparedTensor:
    """One row of the comparison: the same op output in both runs (or in one)."""

    worker: str
    op: str
    tensor: str
    count: int
    """How many earlier lines of the same op and tensor name (the pairing's index)."""
    first: DumpLine | None
    """dump_path's line (the fp32 run)."""
    second: DumpLine | None
    """another_dump_path's line (the low-precision run); a backward one divided by loss_scale
    (unless it agrees undivided)."""
    divisor: float
    """What the second run's statistics were divided by: loss_scale or 1."""
    why: str
    """'' when the two agree; else what does not: 'nan/inf', 'max, mean differ', ..."""

    @property
    def infinite(self) -> bool:
        """Paddle's column: the row is not normal (a non-finite value or a mismatch)."""
        return bool(self.why)


def _divide(line: DumpLine, loss_scale: float) -> DumpLine:
    return replace(
        line,
        max=line.max / loss_scale,
        min=line.min / loss_scale,
        mean=line.mean / loss_scale,
    )


def _judge(first: DumpLine | None, second: DumpLine | None) -> str:
    reasons = []
    if any(line is not None and (line.num_nan or line.num_inf) for line in (first, second)):
        reasons.append("nan/inf")
    if first is not None and second is not None:
        if first.size != second.size:
            reasons.append("numel differs")
        differ = [
            name
            for name in ("max", "min", "mean")
            if not math.isclose(
                getattr(second, name),
                getattr(first, name),
                rel_tol=PADDLE_ALLCLOSE["rtol"],
                abs_tol=PADDLE_ALLCLOSE["atol"],
            )
        ]
        if differ and "nan/inf" not in reasons:
            reasons.append(", ".join(differ) + " differ")
    return "; ".join(reasons)


def pair_dumps(
    worker: str, first: Sequence[DumpLine], second: Sequence[DumpLine], loss_scale: float
) -> list[ComparedTensor]:
    """Pair two runs' lines of one worker file: the second run's order, then the first run's
    lines that found no partner."""
    by_key: dict[tuple[str, int], DumpLine] = {}
    seen: dict[str, int] = {}
    for line in first:
        count = seen.get(line.key, 0)
        seen[line.key] = count + 1
        by_key[(line.key, count)] = line
    rows = []
    taken: dict[str, int] = {}
    for line in second:
        count = taken.get(line.key, 0)
        taken[line.key] = count + 1
        partner = by_key.pop((line.key, count), None)
        why, divisor = _judge(partner, line), 1.0
        if line.backward and loss_scale != 1:
            # a backward op on a gradient ran scaled; one on a saved forward tensor (relu's
            # mask, a transposed weight) did not: divide unless the raw values already agree
            divided = _divide(line, loss_scale)
            divided_why = _judge(partner, divided)
            if not divided_why or why:
                line, why, divisor = divided, divided_why, loss_scale
        rows.append(
            ComparedTensor(worker, line.op, line.tensor, count, partner, line, divisor, why)
        )
    for (_, count), line in by_key.items():
        rows.append(
            ComparedTensor(worker, line.op, line.tensor, count, line, None, 1.0, _judge(line, None))
        )
    return rows


_SIDE = ("dtype", "max_value", "min_value", "mean_value", "num_zero", "num_inf", "num_nan")
HEADER = (
    ["worker", "op_type", "tensor_name", "numel", "infinite", "why"]
    + [f"fp32_{c}" for c in _SIDE]
    + [f"lp_{c}" for c in _SIDE]
    + ["lp_divided_by"]
    + ["lp/fp32_max_value", "lp/fp32_min_value", "lp/fp32_mean_value"]
)
"""The comparison's columns: fp32_* from dump_path, lp_* from another_dump_path (the low-precision
run, backward divided by loss_scale), what lp_* was divided by (loss_scale or 1), then their ratios (1 where fp32's is 0, as Paddle's)."""


def _row(row: ComparedTensor) -> list[object]:
    def side(line: DumpLine | None) -> list[object]:
        if line is None:
            return ["--"] * len(_SIDE)
        return [
            line.dtype,
            line.max,
            line.min,
            line.mean,
            line.num_zero,
            line.num_inf,
            line.num_nan,
        ]

    def ratio(name: str) -> object:
        if row.first is None or row.second is None:
            return "--"
        below = getattr(row.first, name)
        return getattr(row.second, name) / below if below != 0 else 1.0

    line = row.second or row.first
    assert line is not None
    tensor = f"{row.tensor}#{row.count}"
    return (
        [row.worker, row.op, tensor, line.size, int(row.infinite), row.why]
        + side(row.first)
        + side(row.second)
        + [row.divisor]
        + [ratio("max"), ratio("min"), ratio("mean")]
    )


def _write_csv(path: str, rows: list[ComparedTensor]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(HEADER)
        writer.writerows(_row(row) for row in rows)


def _write_xlsx(xlsxwriter, path: str, sheets: dict[str, list[ComparedTensor]]) -> None:  # noqa: ANN001
    workbook = xlsxwriter.Workbook(path)
    title = workbook.add_format({"bold": True, "bg_color": "#6495ED"})
    red = workbook.add_format({"bold": True, "bg_color": "red"})
    for worker, rows in sheets.items():
        sheet = workbook.add_worksheet(worker[:31])  # Excel's sheet-name limit
        sheet.write_row(0, 0, HEADER[1:], title)
        for r, row in enumerate(rows, start=1):
            values = _row(row)[1:]
            sheet.write_row(r, 0, values)
            if row.infinite:
                sheet.write(r, 3, 1, red)
    workbook.close()


def compare_accuracy(
    dump_path: str,
    another_dump_path: str,
    output_filename: str,
    loss_scale: float = 1,
    dump_all_tensors: bool = False,
) -> str:
    """Compare two runs' dumps (dump_path: the fp32 run; another_dump_path: the low-precision
    one) op by op and write the table to output_filename: xlsx when xlsxwriter is importable
    (Paddle's writer), else CSV (an .xlsx/.xls name then becomes .csv, with a WARNING). Returns
    the path written (Paddle: None). Backward lines of the second run are divided by
    loss_scale, the scale its backward ran with. dump_all_tensors=True is refused, as Paddle's.
    """
    if dump_all_tensors is not False:
        raise ValueError(
            f"compare_accuracy(dump_all_tensors={dump_all_tensors!r}): not supported (as "
            "Paddle 3.3.1); leave it False."
        )
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)):
        raise TypeError(f"loss_scale={loss_scale!r} must be a number.")
    if not (math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"loss_scale={loss_scale!r} must be finite and > 0.")
    for path in (dump_path, another_dump_path):
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"{path!r} is no directory: pass the output_dir a TensorCheckerConfig dumped to."
            )
    workers = sorted(
        name
        for name in set(os.listdir(dump_path)) | set(os.listdir(another_dump_path))
        if name.startswith("worker_")
    )
    if not workers:
        raise FileNotFoundError(
            f"No worker_* dump files in {dump_path!r} or {another_dump_path!r}: run the steps "
            "under enable_tensor_checker(TensorCheckerConfig(True, DebugMode.CHECK_ALL, "
            "output_dir=...)) first."
        )
    sheets = {}
    for worker in workers:
        runs = []
        for path in (dump_path, another_dump_path):
            file = os.path.join(path, worker)
            if not os.path.exists(file):
                log.warning(
                    "compare_accuracy: %s has no %s; its rows list the other run only.",
                    path,
                    worker,
                )
            runs.append(read_dump(file) if os.path.exists(file) else [])
        sheets[worker] = pair_dumps(worker, runs[0], runs[1], float(loss_scale))
        bad = sorted({row.op for row in sheets[worker] if row.infinite})
        print(f"-- {worker}: op types whose outputs differ or are not finite: {bad}")
    try:
        import xlsxwriter  # Paddle's writer; not a mixprec dependency
    except ImportError:
        xlsxwriter = None
    if xlsxwriter is not None:
        _write_xlsx(xlsxwriter, output_filename, sheets)
    else:
        root, ext = os.path.splitext(output_filename)
        if ext.lower() in (".xlsx", ".xls"):
            log.warning(
                "compare_accuracy: xlsxwriter is not installed, so %s is written as CSV to "
                "%s (pip install xlsxwriter for Paddle's workbook).",
                output_filename,
                root + ".csv",
            )
            output_filename = root + ".csv"
        _write_csv(output_filename, [row for rows in sheets.values() for row in rows])
    print(f"-- Write to {output_filename}")
    return output_filename


__all__ = ["ComparedTensor", "DumpLine", "compare_accuracy", "pair_dumps", "read_dump"]
