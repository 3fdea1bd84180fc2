"""One bench mode in its own process, run in rounds: `python -m mixprec.bench.worker JOB.json`.

A process per mode makes peak memory that mode's alone (the CPU's peak RSS never goes down).
The process stays alive for the whole run so the parent can interleave the modes: it builds
the model once, says READY_LINE + a ModeResult (RESULT_LINE when it cannot run the mode),
then for each `run WARMUP STEPS` line on stdin trains that many steps, printing PROGRESS_LINE
after each, and answers ROUND_LINE + a RoundResult as JSON. EOF on stdin ends it. It ignores
SIGINT: a Ctrl-C belongs to the parent, which stops its workers and writes what they measured.
"""

from __future__ import annotations

import json
import re
import resource
import signal
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
READY_LINE = "@ready "
"""Prefix of the mode's ModeResult (JSON: how it runs, its memory baseline) once the model is
built and converted: the worker then waits for its first round."""
ROUND_LINE = "@round "
"""Prefix of a finished round's RoundResult (JSON)."""
RESULT_LINE = "@result "
"""Prefix of a ModeResult (JSON) for a worker that cannot run its mode (skipped or failed)."""

Status = Literal["ok", "skipped", "failed", "interrupted"]


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
    """'ok', 'skipped' (the device or mixprec cannot run it), 'failed' (it crashed) or
    'interrupted' (the run was stopped before this mode's first round)."""
    reason: str = ""
    """Why it was skipped or failed."""
    note: str = ""
    """A remark on how it ran (e.g. fewer steps for fp16 on a CPU without fp16 kernels)."""
    expect_slower: bool = False
    """This device is known to run the mode slower than fp32 (runner.ModePlan.expect_slower)."""
    amp_call: str = ""
    """The convert_to_amp mode and config it ran with."""
    low_dtype: str = ""
    """The reduced-precision dtype the mode used ('' for fp32)."""
    steps: int = 0
    """Timed steps per round."""
    warmup: int = 0
    """Untimed warm-up steps, before the first round."""
    round_step_s: list[float | None] = field(default_factory=list)
    """Median seconds per timed step in each round (None: the mode did not run that round,
    the run was interrupted first). The ratios vs fp32 pair these round by round."""
    step_s: list[float] = field(default_factory=list)
    """Seconds of every timed step, round after round."""
    step_s_median: float | None = None
    """Median seconds per timed step over every round (robust to a busy machine's outliers)."""
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

    def add_round(self, index: int, step: RoundResult, batch: int) -> None:
        """Fold round `index`'s measurements in (rounds a mode missed stay None)."""
        self.round_step_s += [None] * (index + 1 - len(self.round_step_s))
        self.round_step_s[index] = statistics.median(step.times)
        self.losses += step.losses
        self.loss_scales += step.loss_scales
        self.skipped_steps = step.skipped_steps
        self.step_s += step.times
        self.step_s_median = statistics.median(self.step_s)
        self.it_s = 1.0 / self.step_s_median
        self.samples_s = batch / self.step_s_median
        self.peak_bytes = step.peak_bytes
        if self.baseline_bytes is not None:
            self.peak_delta_bytes = step.peak_bytes - self.baseline_bytes


@dataclass(kw_only=True)
class RoundResult:
    """What one round of one mode measured (the worker's answer to `run WARMUP STEPS`)."""

    times: list[float]
    """Seconds of each timed step."""
    losses: list[float]
    """Loss of every step of the round, warm-up first."""
    loss_scales: list[float]
    """Loss scale each of those steps ran with."""
    skipped_steps: int
    """Steps the optimizer skipped so far (cumulative)."""
    peak_bytes: int
    """Peak memory so far (cumulative)."""


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


class ModeSession:
    """One mode's data, model and optimizer, built once and trained round after round."""

    def __init__(self, job: WorkerJob) -> None:
        """Build data, model and optimizer and convert them through convert_to_amp.

        Afterwards `self.result` holds the mode's description and memory baseline; its status
        is 'skipped' (and nothing else runs) when convert_to_amp refuses the mode.
        """
        from mixprec import convert_to_amp
        from mixprec.bench.models import (
            ModelSpec,
            build_model,
            count_params,
            make_batch,
            make_criterion,
        )
        from mixprec.bench.modes import amp_args, amp_call_text, mode_policy

        self.spec = spec = ModelSpec(**job.model)
        self.device = device = torch.device(job.device)
        self.result = result = ModeResult(
            mode=job.mode,
            status="ok",
            amp_call=amp_call_text(job.mode, job.dtype),
            steps=job.steps,
            warmup=job.warmup,
        )
        low = mode_policy(job.mode, job.dtype).low_dtype
        result.low_dtype = "" if low is None else str(low).removeprefix("torch.")
        self.x, self.y = make_batch(spec, seed=job.seed, device=device)
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
            self.model, self.optimizer, self.criterion = convert_to_amp(
                model, optimizer, make_criterion(spec), amp_mode, amp_config
            )
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
            result.status = "skipped"
            result.reason = f"convert_to_amp refused it: {type(err).__name__}: {err}"

    def run_round(self, warmup: int, steps: int) -> RoundResult:
        """Train `warmup` untimed then `steps` timed steps; one PROGRESS_LINE per step."""
        from mixprec.bench.timing import time_call

        device, optimizer = self.device, self.optimizer
        times: list[float] = []
        losses: list[torch.Tensor] = []
        scales: list[float] = []
        for i in range(warmup + steps):
            out: dict[str, Any] = {}

            def train_step(out: dict[str, Any] = out) -> None:
                out["loss"] = self.criterion(self.model(self.x), self.y)
                optimizer.backward(out["loss"])
                out["step"] = optimizer.step()  # one host sync inside: the skip decision
                optimizer.zero_grad()

            seconds = time_call(train_step, device)  # CUDA events on a GPU, wall clock on CPU
            if i >= warmup:
                times.append(seconds)
            losses.append(out["loss"].detach())
            scales.append(out["step"].scale)
            print(PROGRESS_LINE, flush=True)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        else:
            peak = rss_peak_bytes()
        return RoundResult(
            times=times,
            losses=[float(v) for v in torch.stack(losses).float().cpu()] if losses else [],
            loss_scales=scales,
            skipped_steps=optimizer.skipped_steps,
            peak_bytes=peak,
        )


def _answer(prefix: str, data: dict[str, Any]) -> None:
    print(prefix + json.dumps(data), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Serve one mode: READY_LINE, then a ROUND_LINE per `run WARMUP STEPS` until EOF."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m mixprec.bench.worker JOB.json", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the run, and then us
    start = time.perf_counter()
    job = WorkerJob(**json.loads(Path(args[0]).read_text()))
    try:
        session = ModeSession(job)
        if session.result.status != "ok":
            session.result.wall_s = time.perf_counter() - start
            _answer(RESULT_LINE, session.result.to_json())
            return 0
        _answer(READY_LINE, session.result.to_json())
        for line in sys.stdin:
            command, *counts = line.split()
            if command != "run" or len(counts) != 2:
                raise ValueError(f"unknown worker command {line.strip()!r}")
            warmup, steps = (int(c) for c in counts)
            _answer(ROUND_LINE, asdict(session.run_round(warmup, steps)))
    except Exception as err:  # report any crash as this mode's result, not a lost row
        traceback.print_exc()
        failed = ModeResult(mode=job.mode, status="failed", reason=f"{type(err).__name__}: {err}")
        failed.wall_s = time.perf_counter() - start
        _answer(RESULT_LINE, failed.to_json())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
