"""Plan the modes a device can run, run each in a fresh worker process, collect a BenchReport."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

import torch

import mixprec
from mixprec.bench.models import ModelSpec
from mixprec.bench.modes import BASELINE, BENCH_MODES, dtype_name, mode_policy
from mixprec.bench.progress import progress_bar
from mixprec.bench.worker import PROGRESS_LINE, ModeResult, WorkerJob
from mixprec.policy import did_you_mean

CPU_FP16_STEPS = 2
"""Timed steps for fp16 modes on a CPU without fp16 kernels, unless the user names them."""
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
    """Timed steps per mode."""
    warmup: int = 2
    """Untimed steps per mode before the timed ones."""
    dtype: str | None = None
    """Low dtype for the modes that take one (modes.DTYPE_KEYS); None keeps each mode's own."""
    device: str = "auto"
    """'auto' (CUDA when available, else CPU), 'cpu', 'cuda' or 'cuda:i'."""
    seed: int = 0
    """Seeds the data and the initial weights, identically in every mode."""
    timeout_s: float = 600.0
    """Seconds one mode's worker may run before it is stopped and reported as failed."""

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in BENCH_MODES]
        if unknown:
            raise ValueError(
                f"Unknown bench mode {unknown[0]!r}." + did_you_mean(unknown[0], BENCH_MODES)
            )
        for name, low in (("steps", 1), ("warmup", 0)):
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
    """Timed steps."""
    warmup: int
    """Untimed warm-up steps."""
    skip_reason: str = ""
    """Non-empty: the mode is not run, for this reason."""
    note: str = ""
    """A remark carried into the table (e.g. fewer steps, and why)."""


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
    from mixprec.debugging.hardware import ARM_FP16_FLAGS, X86_FP16_FLAGS, read_cpu_flags

    flags = read_cpu_flags() or frozenset()
    return any(f in flags for f in (*X86_FP16_FLAGS, *ARM_FP16_FLAGS))


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
    """Why this mode will be very slow on `device` (fp16 on a CPU without fp16 kernels)."""
    if device.type != "cpu" or mode_policy(mode, dtype).low_dtype != torch.float16:
        return None
    if cpu_has_fast_fp16():
        return None
    return "fp16 matmul has no fast kernel on this CPU (no avx512_fp16/amx_fp16)"


def plan_modes(config: BenchConfig, device: torch.device) -> list[ModePlan]:
    """The plan per mode: fp32 first as the baseline, skips and reduced fp16 steps explained."""
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
                    f"{slow}: timed {steps} of {config.steps} steps; "
                    "name the mode in --modes to time all of them"
                )
        elif slow:
            note = slow
        plans.append(ModePlan(mode=mode, steps=steps, warmup=warmup, note=note))
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


def run_worker(
    plan: ModePlan, config: BenchConfig, device: torch.device, workdir: Path, bar: Any
) -> ModeResult:
    """Run one mode in a fresh `python -m mixprec.bench.worker` process and read its result."""
    job = WorkerJob(
        model=asdict(config.model),
        mode=plan.mode,
        dtype=config.dtype,
        steps=plan.steps,
        warmup=plan.warmup,
        seed=config.seed,
        device=str(device),
    )
    job_path, result_path = workdir / f"{plan.mode}.job.json", workdir / f"{plan.mode}.out.json"
    err_path = workdir / f"{plan.mode}.stderr"
    job_path.write_text(json.dumps(asdict(job)))
    total = plan.warmup + plan.steps
    seen = [0]

    def follow(stream: TextIO) -> None:
        for line in stream:
            if line.strip() == PROGRESS_LINE and seen[0] < total:
                seen[0] += 1
                bar.update(1)

    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mixprec.bench.worker", str(job_path), str(result_path)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=_worker_env(),
        )
        reader = threading.Thread(target=follow, args=(proc.stdout,), daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=config.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
    bar.update(total - seen[0])  # a skip or crash ends the mode early: keep the bar's total
    if result_path.exists():
        result = ModeResult.from_json(json.loads(result_path.read_text()))
    else:
        tail = err_path.read_text(errors="replace").strip().splitlines()[-3:]
        if timed_out:
            why = f"stopped after {config.timeout_s:g} s (--timeout)"
        elif proc.returncode < 0:  # SIGKILL from outside is most often the out-of-memory killer
            why = f"worker killed by signal {-proc.returncode}"
        else:
            why = f"worker exited with status {proc.returncode}"
        result = ModeResult(mode=plan.mode, status="failed", reason=" | ".join([why, *tail]))
    result.note = "; ".join(n for n in (plan.note, result.note) if n)
    return result


def run_bench(
    config: BenchConfig, *, progress: bool = True, command: str | None = None
) -> BenchReport:
    """Run every planned mode, each in its own process, and collect the report."""
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
    total = sum(p.warmup + p.steps for p in plans if not p.skip_reason)
    with (
        tempfile.TemporaryDirectory(prefix="mixprec-bench-") as tmp,
        progress_bar(total=total, enabled=progress) as bar,
    ):
        for plan in plans:
            if plan.skip_reason:
                report.results.append(
                    ModeResult(mode=plan.mode, status="skipped", reason=plan.skip_reason)
                )
                continue
            bar.set_postfix_str(plan.mode)
            report.results.append(run_worker(plan, config, device, Path(tmp), bar))
    report.wall_s = time.perf_counter() - start
    report.load_end = _load_average()
    return report
