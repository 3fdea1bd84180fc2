"""One bench mode in a fresh process: `python -m mixprec.bench.worker JOB.json RESULT.json`.

A process per mode makes peak memory that mode's alone (the CPU's peak RSS never goes down).
The job file holds a WorkerJob as JSON; the result file gets a ModeResult as JSON. Each
training step prints one PROGRESS_LINE to stdout so the parent can move its progress bar.
"""

from __future__ import annotations

import json
import re
import resource
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

PROGRESS_LINE = "@step"
"""What the worker prints to stdout after every step (warm-up included)."""

Status = Literal["ok", "skipped", "failed"]


@dataclass(frozen=True, kw_only=True)
class WorkerJob:
    """What one worker runs: a model spec, a mode, the step counts, where."""

    model: dict[str, Any]
    """ModelSpec fields (models.ModelSpec(**model))."""
    mode: str
    """A bench mode (modes.BENCH_MODES)."""
    dtype: str | None
    """--dtype for the modes that take one, or None."""
    steps: int
    """Timed steps."""
    warmup: int
    """Untimed steps before them (allocator, autocast cache and kernel selection warm up)."""
    seed: int
    """Seeds the data and the model's initial weights (the same in every mode)."""
    device: str
    """'cpu' or 'cuda[:i]'."""


@dataclass(kw_only=True)
class ModeResult:
    """What one mode measured (or why it did not run)."""

    mode: str
    """The bench mode."""
    status: Status
    """'ok', 'skipped' (the device or mixprec cannot run it) or 'failed' (it crashed)."""
    reason: str = ""
    """Why it was skipped or failed."""
    note: str = ""
    """A remark on how it ran (e.g. fewer steps for fp16 on a CPU without fp16 kernels)."""
    amp_call: str = ""
    """The convert_to_amp mode and config it ran with."""
    low_dtype: str = ""
    """The reduced-precision dtype the mode used ('' for fp32)."""
    steps: int = 0
    """Timed steps."""
    warmup: int = 0
    """Untimed warm-up steps."""
    step_s_median: float | None = None
    """Median seconds per timed step (robust to a busy machine's outliers)."""
    it_s: float | None = None
    """Iterations per second, 1 / step_s_median."""
    samples_s: float | None = None
    """Samples per second, batch / step_s_median."""
    memory_kind: str = ""
    """How memory was measured (CUDA allocator peak or the process's peak RSS)."""
    baseline_bytes: int | None = None
    """Memory after imports and data creation, before the model exists."""
    peak_bytes: int | None = None
    """Peak memory of the whole process (CPU: ru_maxrss) or of the allocator (CUDA)."""
    peak_delta_bytes: int | None = None
    """peak_bytes - baseline_bytes: the model, its optimizer state, activations, masters."""
    losses: list[float] = field(default_factory=list)
    """Loss of every step, warm-up first."""
    loss_scales: list[float] = field(default_factory=list)
    """Loss scale each step's gradients were computed with."""
    skipped_steps: int = 0
    """Steps the optimizer skipped for non-finite gradients."""
    params: int = 0
    """Parameter count of the model."""
    wall_s: float = 0.0
    """Seconds the worker spent from its start to its result."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModeResult:
        return cls(**data)


STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS mark to its current RSS (Linux clear_refs '5'); False if
    unsupported. Without it, import-time transients hide a small model's memory."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def rss_peak_bytes() -> int:
    """This process's peak resident set size.

    Linux: VmHWM of /proc/self/status, the peak of this process's own memory map. ru_maxrss is
    the fallback: after fork+exec it also counts the parent's RSS at the fork, so a worker
    started from a big parent would report the parent's size. (ru_maxrss: KiB; macOS: bytes.)
    """
    try:
        match = re.search(r"^VmHWM:\s+(\d+) kB", STATUS.read_text(), re.MULTILINE)
    except OSError:
        match = None
    if match:
        return int(match[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def run_job(job: WorkerJob) -> ModeResult:
    """Build data, model and optimizer, convert through convert_to_amp, train, measure."""
    from mixprec import convert_to_amp
    from mixprec.bench.models import (
        ModelSpec,
        build_model,
        count_params,
        make_batch,
        make_criterion,
    )
    from mixprec.bench.modes import amp_args, amp_call_text, mode_policy
    from mixprec.bench.timing import time_call

    spec = ModelSpec(**job.model)
    device = torch.device(job.device)
    result = ModeResult(
        mode=job.mode,
        status="ok",
        amp_call=amp_call_text(job.mode, job.dtype),
        steps=job.steps,
        warmup=job.warmup,
    )
    low = mode_policy(job.mode, job.dtype).low_dtype
    result.low_dtype = "" if low is None else str(low).removeprefix("torch.")
    x, y = make_batch(spec, seed=job.seed, device=device)
    if device.type == "cuda":
        result.memory_kind = "torch.cuda.max_memory_allocated"
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        result.baseline_bytes = torch.cuda.memory_allocated(device)
    else:
        reset = reset_peak_rss()
        result.memory_kind = (
            "peak RSS (VmHWM, reset at the baseline)" if reset else "peak RSS (ru_maxrss)"
        )
        result.baseline_bytes = rss_peak_bytes()

    torch.manual_seed(job.seed)
    model = build_model(spec).to(device)
    result.params = count_params(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr)
    amp_mode, amp_config = amp_args(job.mode, job.dtype)
    try:
        model, optimizer, criterion = convert_to_amp(
            model, optimizer, make_criterion(spec), amp_mode, amp_config
        )
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
        result.status = "skipped"
        result.reason = f"convert_to_amp refused it: {type(err).__name__}: {err}"
        return result

    times: list[float] = []
    lp_losses: list[torch.Tensor] = []
    for i in range(job.warmup + job.steps):
        out: dict[str, Any] = {}

        def train_step(out: dict[str, Any] = out) -> None:
            out["loss"] = criterion(model(x), y)
            optimizer.backward(out["loss"])
            out["step"] = optimizer.step()  # one host sync inside: the skip decision
            optimizer.zero_grad()

        seconds = time_call(train_step, device)  # CUDA events on a GPU
        if i >= job.warmup:
            times.append(seconds)
        lp_losses.append(out["loss"].detach())
        result.loss_scales.append(out["step"].scale)
        print(PROGRESS_LINE, flush=True)

    result.losses = [float(v) for v in torch.stack(lp_losses).float().cpu()]
    result.skipped_steps = optimizer.skipped_steps
    result.step_s_median = statistics.median(times)
    result.it_s = 1.0 / result.step_s_median
    result.samples_s = spec.batch / result.step_s_median
    if device.type == "cuda":
        result.peak_bytes = torch.cuda.max_memory_allocated(device)
    else:
        result.peak_bytes = rss_peak_bytes()
    result.peak_delta_bytes = result.peak_bytes - result.baseline_bytes
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m mixprec.bench.worker JOB.json RESULT.json", file=sys.stderr)
        return 2
    start = time.perf_counter()
    job = WorkerJob(**json.loads(Path(args[0]).read_text()))
    try:
        result = run_job(job)
    except Exception as err:  # report any crash as this mode's result, not a lost row
        traceback.print_exc()
        result = ModeResult(mode=job.mode, status="failed", reason=f"{type(err).__name__}: {err}")
    result.wall_s = time.perf_counter() - start
    Path(args[1]).write_text(json.dumps(result.to_json(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
