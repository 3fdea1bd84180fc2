"""Plan the modes a device can run, run them interleaved in rounds, collect a BenchReport.

Each mode lives in its own worker process (so its peak memory is its own) for the whole run;
the parent asks them in turn for one round of steps, rotating the order every round, so a
change in the machine's load lands on every mode alike instead of on whichever ran then. A
SIGINT (or a SIGTERM turned into KeyboardInterrupt by the CLI) stops the workers and returns
the rounds measured so far, marked as interrupted.
"""

from __future__ import annotations

import json
import os
import platform
import queue
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

import mixprec
from mixprec.bench.models import ModelSpec
from mixprec.bench.modes import BASELINE, BENCH_MODES, dtype_name, mode_policy
from mixprec.bench.progress import progress_bar
from mixprec.bench.worker import (
    PROGRESS_LINE,
    READY_LINE,
    RESULT_LINE,
    ROUND_LINE,
    ModeResult,
    RoundResult,
    WorkerJob,
)
from mixprec.core.policy import did_you_mean

CPU_FP16_STEPS = 1
"""Timed steps per round for fp16 (bf16) modes on a CPU without fp16 (bf16) kernels, unless the
user names them (one such step took ~25x an fp32 step on the 2-core AMD EPYC)."""
CPU_FP16_WARMUP = 1
"""Warm-up steps for those modes (one step is enough to fill the allocator)."""
BUSY_LOAD_PER_CORE = 0.5
"""A 1-minute load average above this per core before the run marks its timings 'busy'."""
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One `mixprec bench` run: the model, the modes and how long to time each."""

    model: ModelSpec
    """The model and synthetic data every mode trains."""
    modes: tuple[str, ...] = BENCH_MODES
    """Bench modes to run; fp32 is added as the baseline when missing."""
    forced: bool = False
    """The user named the modes: time them all in full and fail if the device cannot run one."""
    steps: int = 10
    """Timed steps per mode in each round."""
    rounds: int = 7
    """Rounds: each runs every mode's timed steps once, in a rotated order."""
    warmup: int = 2
    """Untimed steps per mode before its first round."""
    dtype: str | None = None
    """Low dtype for the modes that take one (modes.DTYPE_KEYS); None keeps each mode's own."""
    device: str = "auto"
    """'auto' (CUDA when available, else CPU), 'cpu', 'cuda' or 'cuda:i'."""
    seed: int = 0
    """Seeds the data and the initial weights, identically in every mode."""
    timeout_s: float = 600.0
    """Seconds one mode's worker may take to start or to run one round before it is stopped
    and reported as failed."""

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in BENCH_MODES]
        if unknown:
            raise ValueError(
                f"Unknown bench mode {unknown[0]!r}." + did_you_mean(unknown[0], BENCH_MODES)
            )
        for name, low in (("steps", 1), ("rounds", 1), ("warmup", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"BenchConfig.{name}={value!r} must be an int >= {low}.")
        if not self.timeout_s > 0:
            raise ValueError(f"BenchConfig.timeout_s={self.timeout_s!r} must be > 0.")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", dtype_name(self.dtype))  # normalise 'bf16' etc.
        resolve_device(self.device)  # a bad device string fails here, before any work


@dataclass(frozen=True, kw_only=True)
class ModePlan:
    """How one mode will run, or why it will not."""

    mode: str
    """The bench mode."""
    steps: int
    """Timed steps per round."""
    warmup: int
    """Untimed warm-up steps, before the first round."""
    skip_reason: str = ""
    """Non-empty: the mode is not run, for this reason."""
    note: str = ""
    """A remark carried into the table (e.g. fewer steps, and why)."""
    expect_slower: bool = False
    """The device is known to run this mode slower than fp32 (fp16 on a CPU without fp16
    kernels): a measured speedup above 1 contradicts the note and is not printed."""


@dataclass(kw_only=True)
class BenchReport:
    """Everything a bench run measured, plus where and how (the JSON file holds exactly this)."""

    config: dict[str, Any]
    """BenchConfig as plain JSON values."""
    device: str
    """The torch device the workers ran on."""
    machine: str
    """CPU model or GPU name, thread count and torch version."""
    command: str
    """A command line that repeats this run."""
    results: list[ModeResult] = field(default_factory=list)
    """One entry per mode, in BENCH_MODES order, run or skipped."""
    cpus: int = 1
    """os.cpu_count() of the machine."""
    load_start: float | None = None
    """1-minute load average before the first worker started (None where unknown)."""
    load_end: float | None = None
    """1-minute load average after the last worker finished."""
    wall_s: float = 0.0
    """Seconds the whole run took, worker start-up included."""
    gemm_speed: str = ""
    """The device's bf16/fp16 GEMM speed vs fp32, measured just before (GemmSpeed.line())."""
    rounds_done: int = 0
    """Rounds every live mode finished."""
    interrupted: str = ""
    """Non-empty when the run was stopped early: what stopped it, and when."""

    @property
    def busy(self) -> bool:
        """Other work was competing for the cores when the run began."""
        return self.load_start is not None and self.load_start > BUSY_LOAD_PER_CORE * self.cpus

    def result(self, mode: str) -> ModeResult | None:
        return next((r for r in self.results if r.mode == mode), None)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["results"] = [r.to_json() for r in self.results]
        data["busy"] = self.busy
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BenchReport:
        data = dict(data)
        data.pop("busy", None)
        data["results"] = [ModeResult.from_json(r) for r in data["results"]]
        return cls(**data)


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda if available else cpu; a CUDA device that is not there is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"Unknown device {device!r}." + did_you_mean(device, DEVICES)) from None
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: mixprec bench runs on 'cpu' or 'cuda'.")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}, but no CUDA device is visible; use 'cpu'.")
    return resolved


def cpu_has_fast_fp16() -> bool:
    """Whether this CPU has native fp16 arithmetic (x86 avx512_fp16/amx_fp16, arm asimdhp)."""
    from mixprec.core.hardware import ARM_FP16_FLAGS, X86_FP16_FLAGS, read_cpu_flags

    flags = read_cpu_flags() or frozenset()
    return any(f in flags for f in (*X86_FP16_FLAGS, *ARM_FP16_FLAGS))


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU has native bf16 math (x86 avx512_bf16/amx_bf16, arm bf16)."""
    from mixprec.core.hardware import ARM_BF16_FLAGS, X86_BF16_FLAGS, read_cpu_flags

    flags = read_cpu_flags() or frozenset()
    return any(f in flags for f in (*X86_BF16_FLAGS, *ARM_BF16_FLAGS))


def device_problem(mode: str, dtype: str | None, device: torch.device) -> str | None:
    """Why `device` cannot run this mode, or None if it can."""
    policy = mode_policy(mode, dtype)
    if policy.fp8:
        from mixprec.fp8 import fp8_kernel_problem

        problem = fp8_kernel_problem(device)
        if problem is not None:
            return (
                f"{problem}; convert_to_amp's 'fp8' mode needs the float8 kernel "
                "(emulation would round like fp8 but time nothing real)"
            )
    if (
        policy.low_dtype == torch.bfloat16
        and device.type == "cuda"
        and not torch.cuda.is_bf16_supported()
    ):
        return f"{torch.cuda.get_device_name(device)} has no bfloat16 support"
    return None


def slow_reason(mode: str, dtype: str | None, device: torch.device) -> str | None:
    """Why this mode will be very slow on `device`: fp16 or bf16 on a CPU without native kernels
    for it converts to fp32 per op, many times slower than fp32."""
    policy = mode_policy(mode, dtype)
    low = policy.low_dtype
    if device.type != "cpu" or low is None:
        return None
    if low == torch.float16 and not cpu_has_fast_fp16():
        return "fp16 matmul has no fast kernel on this CPU (no avx512_fp16/amx_fp16)"
    # fp8's GEMMs are emulated in fp32 on CPU: only its few non-GEMM ops run bf16 there
    if low == torch.bfloat16 and not policy.fp8 and not cpu_has_fast_bf16():
        return "bf16 matmul has no fast kernel on this CPU (no avx512_bf16/amx_bf16)"
    return None


def plan_modes(config: BenchConfig, device: torch.device) -> list[ModePlan]:
    """The plan per mode: fp32 first as the baseline, skips and reduced slow-mode steps explained."""
    modes = [m for m in BENCH_MODES if m in config.modes or m == BASELINE]
    plans = []
    for mode in modes:
        problem = device_problem(mode, config.dtype, device)
        if problem is not None:
            if config.forced and mode in config.modes:
                raise ValueError(f"Mode {mode!r} cannot run on {device}: {problem}.")
            plans.append(ModePlan(mode=mode, steps=0, warmup=0, skip_reason=problem))
            continue
        steps, warmup, note = config.steps, config.warmup, ""
        slow = slow_reason(mode, config.dtype, device)
        if slow and not config.forced:
            steps, warmup = min(steps, CPU_FP16_STEPS), min(warmup, CPU_FP16_WARMUP)
            if steps < config.steps:
                note = (
                    f"{slow}: timed {steps} of {config.steps} steps a round; "
                    "name the mode in --modes to time all of them"
                )
        elif slow:
            note = slow
        plan = ModePlan(mode=mode, steps=steps, warmup=warmup, note=note, expect_slower=bool(slow))
        plans.append(plan)
    return plans


def cpu_model() -> str:
    """The CPU's model name (platform.processor() is often empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_name(device: torch.device) -> str:
    """'GPU name' or 'CPU model, N threads', plus the torch version."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def config_to_command(config: BenchConfig) -> str:
    """The `mixprec bench` command line that repeats a config."""
    argv = ["mixprec", "bench", "--model", config.model.name]
    argv += ["--width", str(config.model.width), "--depth", str(config.model.depth)]
    argv += ["--batch", str(config.model.batch), "--steps", str(config.steps)]
    argv += ["--rounds", str(config.rounds)]
    defaults = {f.name: f.default for f in fields(ModelSpec)}
    for key in ("image_size", "patch_size", "heads"):
        value = getattr(config.model, key)
        if value != defaults[key]:
            argv += ["--" + key.replace("_", "-"), str(value)]
    argv += ["--warmup", str(config.warmup), "--device", config.device]
    if config.forced:
        argv += ["--modes", ",".join(config.modes)]
    if config.dtype:
        argv += ["--dtype", config.dtype]
    if config.seed:
        argv += ["--seed", str(config.seed)]
    return shlex.join(argv)


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):  # not on every platform
        return None


def _worker_env() -> dict[str, str]:
    """This environment, with mixprec's source directory importable (it may be uninstalled)."""
    env = dict(os.environ)
    src = str(Path(mixprec.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


class ModeWorker:
    """One mode's worker process, and the ModeResult its rounds build up."""

    def __init__(self, plan: ModePlan, config: BenchConfig, device: torch.device, workdir: Path):
        self.plan, self.config = plan, config
        self.result = ModeResult(mode=plan.mode, status="ok", steps=plan.steps, warmup=plan.warmup)
        self.messages: queue.Queue[str | None] = queue.Queue()
        job = WorkerJob(
            model=asdict(config.model),
            mode=plan.mode,
            dtype=config.dtype,
            steps=plan.steps,
            warmup=plan.warmup,
            seed=config.seed,
            device=str(device),
        )
        job_path = workdir / f"{plan.mode}.job.json"
        self.err_path = workdir / f"{plan.mode}.stderr"
        job_path.write_text(json.dumps(asdict(job)))
        self.start = time.perf_counter()
        with self.err_path.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mixprec.bench.worker", str(job_path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=_worker_env(),
            )
        threading.Thread(target=self._read, daemon=True).start()
        self.rounds_run = 0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.messages.put(line.rstrip("\n"))
        self.messages.put(None)  # EOF: the worker exited

    @property
    def live(self) -> bool:
        return self.result.status == "ok"

    def _next(self, bar: Any) -> str:
        """The worker's next answer (progress lines move the bar); a crash or timeout fails it."""
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            try:
                line = self.messages.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                self.kill()
                why = f"stopped after {self.config.timeout_s:g} s (--timeout)"
                raise _WorkerFailed(why) from None
            if line is None:
                self.proc.wait()
                code = self.proc.returncode
                # SIGKILL from outside is most often the out-of-memory killer
                raise _WorkerFailed(
                    f"worker killed by signal {-code}"
                    if code < 0
                    else f"worker exited with status {code}"
                )
            if line == PROGRESS_LINE:
                bar.update(1)
            elif line.startswith((READY_LINE, ROUND_LINE, RESULT_LINE)):
                return line

    def _fail(self, why: str) -> None:
        tail = self.err_path.read_text(errors="replace").strip().splitlines()[-3:]
        self.result.status = "failed"
        self.result.reason = " | ".join([why, *tail])

    def wait_ready(self, bar: Any) -> None:
        """Wait for the model to be built; a mode convert_to_amp refuses ends here, skipped."""
        try:
            line = self._next(bar)
        except _WorkerFailed as err:
            self._fail(str(err))
            return
        # READY_LINE carries the mode's description and memory baseline; RESULT_LINE a skip
        self.result = ModeResult.from_json(json.loads(line.split(" ", 1)[1]))
        if line.startswith(RESULT_LINE):
            self.stop()

    def run_round(self, index: int, bar: Any) -> None:
        """Run round `index` (the first adds the warm-up) and fold its numbers in."""
        warmup = self.plan.warmup if self.rounds_run == 0 else 0
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"run {warmup} {self.plan.steps}\n")
            self.proc.stdin.flush()
            line = self._next(bar)
        except (BrokenPipeError, _WorkerFailed) as err:
            self._fail(str(err) if isinstance(err, _WorkerFailed) else "worker exited early")
            self.stop()
            return
        if line.startswith(RESULT_LINE):  # the worker crashed mid-round and said why
            failed = ModeResult.from_json(json.loads(line.removeprefix(RESULT_LINE)))
            self._fail(failed.reason)
            self.stop()
            return
        data = json.loads(line.removeprefix(ROUND_LINE))
        self.result.add_round(index, RoundResult(**data), self.config.model.batch)
        self.rounds_run += 1

    def stop(self) -> None:
        """End the worker: EOF first (it exits between rounds), then kill if it is mid-step."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.result.wall_s = time.perf_counter() - self.start

    def kill(self) -> None:
        """Interrupted: kill the worker now, whatever it is doing."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.result.wall_s = time.perf_counter() - self.start


class BenchInterrupted(KeyboardInterrupt):
    """Raised (by the CLI's SIGTERM handler) to stop a run like Ctrl-C; args[0]: the signal."""


class _WorkerFailed(Exception):
    """A worker crashed, was killed or ran past --timeout."""


def _finish(worker: ModeWorker) -> ModeResult:
    result = worker.result
    result.note = "; ".join(n for n in (worker.plan.note, result.note) if n)
    result.expect_slower = worker.plan.expect_slower
    return result


def run_bench(
    config: BenchConfig, *, progress: bool = True, command: str | None = None
) -> BenchReport:
    """Run every planned mode in its own worker, interleaved round by round; collect the report.

    A KeyboardInterrupt (Ctrl-C, or SIGTERM through the CLI's handler) kills the workers and
    returns what the finished rounds measured, with `report.interrupted` saying so.
    """
    device = resolve_device(config.device)
    plans = plan_modes(config, device)
    report = BenchReport(
        config={**asdict(config), "model": asdict(config.model)},
        device=str(device),
        machine=machine_name(device),
        command=command or config_to_command(config),
        cpus=os.cpu_count() or 1,
        load_start=_load_average(),
    )
    start = time.perf_counter()
    runnable = [p for p in plans if not p.skip_reason]
    total = sum(p.warmup + p.steps * config.rounds for p in runnable)
    workers: list[ModeWorker] = []
    round_index = 0
    with (
        tempfile.TemporaryDirectory(prefix="mixprec-bench-") as tmp,
        progress_bar(total=total, enabled=progress) as bar,
    ):
        try:
            # all start at once: start-up is untimed, and 8 imports of torch overlap
            for plan in runnable:  # appended one by one: an interrupt here still stops each
                workers.append(ModeWorker(plan, config, device, Path(tmp)))
            bar.set_postfix_str("starting workers")
            for worker in workers:
                worker.wait_ready(bar)
            for round_index in range(config.rounds):
                live = [w for w in workers if w.live]
                shift = round_index % max(len(live), 1)
                for worker in live[shift:] + live[:shift]:  # rotate who goes first
                    bar.set_postfix_str(
                        f"round {round_index + 1}/{config.rounds} {worker.plan.mode}"
                    )
                    worker.run_round(round_index, bar)
                report.rounds_done = round_index + 1
                if not progress:
                    print(
                        f"mixprec bench: round {round_index + 1}/{config.rounds} done "
                        f"({time.perf_counter() - start:.0f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
        except KeyboardInterrupt as err:
            name = err.args[0] if isinstance(err, BenchInterrupted) else "SIGINT"
            report.interrupted = (
                f"{name} during round {round_index + 1} of {config.rounds}: "
                f"{report.rounds_done} full round(s) measured"
            )
            for worker in workers:
                worker.kill()
                if worker.live and not worker.result.step_s:
                    worker.result.status = "interrupted"
                    worker.result.reason = f"{name} came before this mode's first timed round"
        finally:
            for worker in workers:
                worker.stop()
    results = {w.plan.mode: _finish(w) for w in workers}
    for plan in plans:
        if plan.skip_reason:
            report.results.append(
                ModeResult(mode=plan.mode, status="skipped", reason=plan.skip_reason)
            )
        else:
            report.results.append(results.get(plan.mode) or _never_started(plan, report))
    report.wall_s = time.perf_counter() - start
    report.load_end = _load_average()
    return report


def _never_started(plan: ModePlan, report: BenchReport) -> ModeResult:
    return ModeResult(
        mode=plan.mode, status="interrupted", reason=f"{report.interrupted or 'stopped'} first"
    )
