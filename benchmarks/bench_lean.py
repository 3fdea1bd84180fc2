"""Lean precision (bf16 without masters + stochastic rounding, low-bit state) vs fp32 and NAIVE.

Measured in one run, each mode through the core's own prepare_model / prepare_optimizer:

    bytes   weights + grads + fp32 masters + optimizer state per parameter, summed exactly from
            the tensors a transformer holds at its step (AdamW), and the fp32 master grads
            NAIVE keeps as well; peak RSS of that transformer's step, one fresh process per
            mode (`--mem-width/--mem-depth`: 768/12 is ~100M params), vs fp32 and vs NAIVE
    quality the digits classifier (sklearn) and a byte-level GPT on the Python standard
            library's own source, fixed steps, AdamW with a cosine schedule: final validation
            loss / accuracy per mode; fp32 masters over several seeds give the seed-to-seed
            spread each lean mode must land in; bf16 without masters and round-to-nearest is
            the baseline that stalls
    time    one GPT training step per mode, modes interleaved in a shuffled order each round
            (load from other processes falls on all alike); speed = NAIVE time / mode time

Writes a fresh folder (default ./runs/bench_lean-<UTC time>/; --out to choose) with lean.md, lean.json
and lean.png.

    python benchmarks/bench_lean.py                                 # ~15 min on 2 busy cores
    python benchmarks/bench_lean.py --mem-width 768 --mem-depth 12  # the ~100M-param step
    python benchmarks/bench_lean.py --size 100m   # only memory: bytes and RSS per phase, 99.7M
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from mixprec.bench.command import fresh_out_dir
from mixprec.bench.gpt import (
    GPT,
    cosine,
    gpt_batch,
    gpt_loss,
    gpt_val_loss,
    set_lr,
    stdlib_text,
    train_gpt,
)
from mixprec.bench.progress import progress_bar
from mixprec.bench.report import write_record
from mixprec.bench.runner import machine_name
from mixprec.core.lean import state_bytes
from mixprec.core.policy import Policy, preset, to_policy, with_optimizer_state
from mixprec.core.prepare import prepare_model, prepare_optimizer


def policies() -> dict[str, Policy]:
    """The modes compared, by the names the table uses."""
    sr = preset("bf16_sr")
    return {
        "fp32": to_policy("fp32"),
        "NAIVE (bf16)": to_policy("fp16_naive", {"dtype": "bfloat16"}),
        "bf16 nearest": dataclasses.replace(sr, name="bf16_nearest", update_rounding="nearest"),
        "bf16_sr": sr,
        "bf16_sr+bf16": with_optimizer_state(sr, "bf16"),
        "bf16_sr+int8": with_optimizer_state(sr, "int8"),
        "bf16_sr+int4": with_optimizer_state(sr, "int4"),
        "bf16_sr+int8/int4": with_optimizer_state(sr, "int8/int4"),
        "bf16_sr+fp8": with_optimizer_state(sr, "fp8"),
    }


QUALITY_MODES = (
    "fp32",
    "NAIVE (bf16)",
    "bf16 nearest",
    "bf16_sr",
    "bf16_sr+int8",
    "bf16_sr+int4",
    "bf16_sr+int8/int4",  # first moment int8, second int4
)
TIME_MODES = (*QUALITY_MODES, "bf16_sr+bf16", "bf16_sr+fp8")


# ----- models and data -----
def digits_data() -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[perm[:1400]], y[perm[:1400]], x[perm[1400:]], y[perm[1400:]]


def digits_net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 256), nn.GELU(),
        nn.Linear(256, 10),
    )  # fmt: skip


def build(policy: Policy, make: Any, seed: int, lr: float, wd: float) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    model = make()
    pm = prepare_model(model, policy)
    opt = prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd), policy)
    return pm, opt


# ----- quality -----
def run_digits(policy: Policy, seed: int, args: argparse.Namespace, bar: Any) -> dict:
    x, y, xv, yv = digits_data()
    model, opt = build(policy, digits_net, seed, args.digits_lr, 0.01)
    g = torch.Generator().manual_seed(seed)
    for step in range(args.digits_steps):
        set_lr(opt, cosine(step, args.digits_steps, args.digits_lr, 20))
        idx = torch.randint(0, len(x), (64,), generator=g)
        opt.backward(F.cross_entropy(model(x[idx]).float(), y[idx]))
        opt.step()
        opt.zero_grad()
        bar.update(1)
    with torch.no_grad():
        out = model(xv).float()
    return {
        "val_loss": F.cross_entropy(out, yv).item(),
        "val_acc": (out.argmax(1) == yv).float().mean().item() * 100,
    }


def gpt_make(args: argparse.Namespace) -> Any:
    return lambda: GPT(args.gpt_width, args.gpt_depth, 4, args.context)


def run_gpt(policy: Policy, seed: int, args: argparse.Namespace, text: tuple, bar: Any) -> dict:
    train, val = text
    model, opt = build(policy, gpt_make(args), seed, args.gpt_lr, 0.1)
    train_gpt(
        model,
        opt,
        train,
        steps=args.gpt_steps,
        batch=args.batch,
        context=args.context,
        lr=args.gpt_lr,
        seed=seed,
        on_step=lambda step, loss: bar.update(1),
    )
    return {"val_loss": gpt_val_loss(model, val, args.context)}


# ----- time: modes interleaved -----
def time_steps(args: argparse.Namespace, text: tuple, bar: Any) -> dict[str, list[float]]:
    """Each mode's step times (seconds), one per round after two warm-up rounds."""
    names = list(TIME_MODES)
    runs = {n: build(policies()[n], gpt_make(args), 0, 1e-3, 0.1) for n in names}
    g = torch.Generator().manual_seed(0)
    batch = gpt_batch(text[0], args.batch, args.context, g)
    times: dict[str, list[float]] = {n: [] for n in names}
    order = random.Random(0)
    for r in range(args.time_rounds + 2):
        order.shuffle(names)
        for n in names:
            model, opt = runs[n]
            start = time.perf_counter()
            opt.backward(gpt_loss(model, *batch))
            opt.step()
            opt.zero_grad()
            if r >= 2:  # two warm-up rounds
                times[n].append(time.perf_counter() - start)
        bar.update(1)
    return {n: times[n] for n in TIME_MODES}


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def time_markdown(record: dict) -> str:
    """The step-time table of a --time-only run: per-mode median and quartiles, and the speed
    vs NAIVE as the median (and range) of the per-round ratios (a round's modes ran back to
    back, so load from other processes falls on both sides of a ratio alike)."""
    args, samples = record["args"], record["time_samples"]
    naive = samples["NAIVE (bf16)"]
    lines = [
        f"# Lean step time, {record['machine']}",
        "",
        f"`python benchmarks/bench_lean.py {' '.join(record['argv'])}` ({record['seconds']:.0f} s"
        f", load average {record['load'][0]:.1f} -> {record['load'][1]:.1f} on "
        f"{os.cpu_count()} cores). GPT width {args['gpt_width']}, depth {args['gpt_depth']}, "
        f"{args['batch']} x {args['context']} bytes, AdamW; {args['time_rounds']} rounds, modes "
        "in a shuffled order each round. Speed = NAIVE / mode per round (goal >= 0.95).",
        "",
        "| mode | median ms | p25-p75 ms | speed vs NAIVE (median) | per-round range |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, t in samples.items():
        q = sorted(t)
        ratios = sorted(a / b for a, b in zip(naive, t, strict=True))
        lines.append(
            f"| {name} | {median(t) * 1e3:.1f} | {q[len(q) // 4] * 1e3:.1f}-"
            f"{q[(3 * len(q)) // 4] * 1e3:.1f} | {median(ratios):.2f} | "
            f"{ratios[0]:.2f}-{ratios[-1]:.2f} |"
        )
    return "\n".join(lines) + "\n"


def time_chart(record: dict, path: Path) -> None:
    """The --time-only run's picture: each mode's speed vs NAIVE, the median of the per-round
    ratios with their range, and the 0.95 goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = record["time_samples"]
    naive = samples["NAIVE (bf16)"]
    names = [n for n in samples if n != "fp32"]  # fp32 (no bf16 emulation) is off the scale
    ratios = [sorted(a / b for a, b in zip(naive, samples[n], strict=True)) for n in names]
    mid = [median(r) for r in ratios]
    err = [[m - r[0] for m, r in zip(mid, ratios, strict=True)]]
    err.append([r[-1] - m for m, r in zip(mid, ratios, strict=True)])
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(names, mid, yerr=err, capsize=3, color="tab:blue")
    ax.axhline(0.95, color="black", linestyle="--", linewidth=0.8, label="goal: 0.95x NAIVE")
    ax.set_ylabel("step speed vs NAIVE (median, per-round range)")
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    ax.legend(fontsize=8)
    fig.suptitle(f"Lean step time, {record['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----- bytes and peak memory: one fresh process per mode -----
def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_worker(mode: str, width: int, depth: int, batch: int, context: int) -> dict:
    """Build the mode's transformer, run two steps, count bytes exactly, and report the peak RSS
    of the second step (its state exists, imports are done) over the RSS before the build."""
    torch.set_num_threads(1)
    policy = policies()[mode]
    before = _rss_kib("VmRSS")
    model, opt = build(
        policy, lambda: GPT(width, depth, max(1, width // 64), context), 0, 1e-4, 0.1
    )
    g = torch.Generator().manual_seed(0)
    counts: dict[str, int] = {}
    data = torch.randint(0, 256, (batch, context + 1), generator=g)
    for step in range(2):
        if step == 1:  # the peak (VmHWM) restarts from now: the second, steady-state step's
            Path("/proc/self/clear_refs").write_text("5")
        opt.backward(gpt_loss(model, data[:, :-1], data[:, 1:]))
        params = list(model.parameters())
        counts = {
            "params": sum(p.numel() for p in params),
            "weights": sum(p.numel() * p.element_size() for p in params),
            "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        }  # fmt: skip
        opt.step()
        counts["masters"] = sum(m.numel() * m.element_size() for m in opt.hp_masters)
        counts["master_grads"] = sum(
            m.grad.numel() * m.grad.element_size() for m in opt.hp_masters if m.grad is not None
        )
        counts["state"] = sum(
            state_bytes(t) for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
        )
        opt.zero_grad()
    counts["peak_rss_mib"] = (_rss_kib("VmHWM") - before) / 1024
    return counts


def run_memory(mode: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--memory-worker", mode]
    cmd += [str(v) for v in (args.mem_width, args.mem_depth, args.mem_batch, args.context)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"memory worker for {mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----- --size: one model size, its bytes per parameter and where its peak RSS comes from -----
SIZES: dict[str, dict[str, int]] = {
    "100m": {"width": 768, "depth": 14, "heads": 12, "context": 64, "batch": 1},
    "10m": {"width": 320, "depth": 8, "heads": 5, "context": 64, "batch": 2},
}
"""--size presets: GPT shapes (nanoGPT's layout; 100m: 99.7M parameters, 12 heads of 64)."""
PHASES = ("build", "forward", "backward", "step", "zero_grad")
"""Where a training process can peak: the model's fp32 init and cast, the forward's
activations, the backward's grads, the optimizer's temporaries, freeing the grads."""


def size_policies() -> dict[str, Policy]:
    """The modes of the --size run: the issue's list (NAIVE with fp16 params, as Colossal's)."""
    sr, naive = preset("bf16_sr"), to_policy("fp16_naive")
    return {
        "fp32": to_policy("fp32"),
        # Starting at 2**16, not Colossal's 2**32, spares ~30 overflow skips (hysteresis 2) of
        # a 100M model: those skipped steps would form no state to count; bytes do not depend
        # on the scale.
        "NAIVE (fp16)": dataclasses.replace(
            naive, loss_scale=dataclasses.replace(naive.loss_scale, init_scale=2.0**16)
        ),
        "bf16_sr": sr,
        "bf16_sr+int8": with_optimizer_state(sr, "int8"),
        "bf16_sr+int4": with_optimizer_state(sr, "int4"),
        "bf16_sr+int8/int4": with_optimizer_state(sr, "int8/int4"),
        "bf16_sr+fp8": with_optimizer_state(sr, "fp8"),
    }


def held_bytes(model: nn.Module, opt: Any) -> dict[str, int]:
    """Bytes the step holds, counted from the tensors: weights, their grads, fp32 masters and
    master grads, optimizer state (low-bit: codes + scales). Call it between backward and step
    for the grads (NAIVE frees its lp grads once its masters have them), after for the rest."""
    params = list(model.parameters())
    masters = list(getattr(opt, "hp_masters", []))

    def nbytes(ts: list) -> int:
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    return {
        "params": sum(p.numel() for p in params),
        "weights": nbytes(params),
        "grads": nbytes([p.grad for p in params]),
        "masters": nbytes(masters),
        "master_grads": nbytes([m.grad for m in masters]),
        "state": sum(
            state_bytes(t) for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
        ),
    }


class RssTrace:
    """Resident memory of this process: the exact peak of each phase (the kernel's VmHWM, reset
    at the phase's start through /proc/self/clear_refs) and a sampled trace for the chart (a
    thread reading /proc/self/statm every ms; torch's kernels release the GIL, so it runs
    while they do)."""

    def __init__(self) -> None:
        import threading

        self.page_kib = os.sysconf("SC_PAGE_SIZE") // 1024
        self.samples: list[tuple[float, int]] = []  # (seconds, KiB)
        self.phases: list[tuple[str, float, int, int]] = []  # (name, start s, start KiB, peak)
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def rss_kib(self) -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * self.page_kib

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self.t0, self.rss_kib()))
            time.sleep(0.001)

    def phase(self, name: str, fn: Any) -> Any:
        """fn() as phase `name`, its peak RSS recorded."""
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
        start, rss = time.perf_counter() - self.t0, self.rss_kib()
        out = fn()
        self.phases.append((name, start, rss, _rss_kib("VmHWM")))
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def size_worker(mode: str, size: str, steps: int) -> dict:
    """Build the mode's GPT of --size, run `steps` steps, count its bytes with grads alive
    (after the last step, before zero_grad) and trace its RSS per phase, in KiB above the RSS
    before the build (every library imported: torchao's import is no part of a mode)."""
    import torchao.optim  # noqa: F401 - the low-bit modes import it; every mode pays it first

    torch.set_num_threads(1)
    shape = SIZES[size]
    width, depth, heads, context = (shape[k] for k in ("width", "depth", "heads", "context"))
    policy = size_policies()[mode]
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (shape["batch"], context + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    trace = RssTrace()
    base = trace.rss_kib()
    model, opt = trace.phase(
        "build",
        lambda: build(policy, lambda: GPT(width, depth, heads, context), 0, 1e-4, 0.1),
    )
    counts: dict[str, int] = {}
    step_s, skipped = [], 0
    for step in range(steps):
        t = time.perf_counter()
        loss = trace.phase("forward", lambda: gpt_loss(model, x, y))
        trace.phase("backward", functools.partial(opt.backward, loss))
        del loss  # the graph's activations go now, not at the next forward
        grads = held_bytes(model, opt)["grads"]
        skipped += bool(trace.phase("step", opt.step).skipped)
        if step == steps - 1:
            counts = held_bytes(model, opt) | {"grads": grads}
        trace.phase("zero_grad", opt.zero_grad)
        step_s.append(time.perf_counter() - t)
    trace.stop()
    if skipped == steps:
        raise RuntimeError(f"{mode}: every step was skipped; its optimizer state never formed.")
    peaks = {
        name: max(p - base for n, _, _, p in trace.phases if n == name) / 1024 for name in PHASES
    }
    final = [(n, s, r) for n, s, r, _ in trace.phases if n == "forward"][-1]  # last step start
    return counts | {
        "machine": machine_name(torch.device("cpu")),  # the worker's threads, not the parent's
        "skipped_steps": skipped,
        "step_s": step_s,
        "peak_mib": peaks,
        "peak_rss_mib": max(peaks.values()),
        "steady_rss_mib": (final[2] - base) / 1024,
        "trace": [  # at most ~600 points for the chart
            (round(t, 3), round((k - base) / 1024, 1))
            for t, k in trace.samples[:: max(1, len(trace.samples) // 600)]
        ],
        "phases": [(n, round(s, 3)) for n, s, _, _ in trace.phases],
    }


MMAP_THRESHOLD = 128 * 1024
"""glibc's default mmap threshold (128 KiB) made fixed: blocks above it are mmap'd and go back
to the system when freed. By default glibc raises the threshold to the largest block freed so
far (up to 32 MiB), so after a model's first big tensors are freed every later tensor of that
size comes from the heap, which keeps freed memory resident."""
ALLOCATORS = {"glibc default": {}, "fixed mmap threshold": {"MALLOC_MMAP_THRESHOLD_": "131072"}}
"""The worker's environment per allocator setting the --size run measures RSS under."""


def run_size(args: argparse.Namespace) -> int:
    """The --size run: each mode in a fresh process (nothing of one mode's memory in another's)."""
    out = args.out or fresh_out_dir(f"bench_lean_{args.size}")
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"--out {out} exists and is not empty: name a new folder")
    start, load0 = time.perf_counter(), os.getloadavg()[0]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    memory: dict[str, dict] = {}
    for mode in size_policies():
        for allocator in args.allocators:
            extra = ALLOCATORS[allocator]
            print(f"{args.size}: {mode}, {allocator} ...", file=sys.stderr, flush=True)
            cmd = [sys.executable, __file__, "--size-worker", mode, args.size]
            done = subprocess.run(
                [*cmd, str(args.size_steps)],
                capture_output=True, text=True, env=env | extra, check=False,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"size worker for {mode} failed:\n{done.stderr[-3000:]}")
            memory.setdefault(mode, {})[allocator] = json.loads(
                done.stdout.strip().splitlines()[-1]
            )
    record = {
        "argv": sys.argv[1:],
        "size": args.size,
        "shape": SIZES[args.size],
        "steps": args.size_steps,
        "machine": memory["fp32"][args.allocators[0]]["machine"],
        "seconds": time.perf_counter() - start,
        "load": [load0, os.getloadavg()[0]],
        "memory": memory,
    }
    return publish(out, "lean_memory", size_markdown(record), record, size_chart)


def render_size(folder: Path) -> None:
    """lean_memory.md and .png of a --size run again from its lean_memory.json."""
    record = json.loads((folder / "lean_memory.json").read_text())
    publish(folder, "lean_memory", size_markdown(record), record, size_chart)


def size_markdown(record: dict) -> str:
    mem, shape = record["memory"], record["shape"]
    allocators = list(mem["fp32"])
    first = allocators[0]
    n = mem["fp32"][first]["params"]
    lines = [
        f"# Lean precision at {n / 1e6:.1f}M parameters, {record['machine']}",
        "",
        f"`python benchmarks/bench_lean.py {' '.join(record['argv'])}` ({record['seconds']:.0f} s"
        f", load average {record['load'][0]:.1f} -> {record['load'][1]:.1f} on "
        f"{os.cpu_count()} cores). GPT width {shape['width']}, depth {shape['depth']}, "
        f"{shape['heads']} heads, batch {shape['batch']} x {shape['context']} tokens, AdamW, "
        f"{record['steps']} steps per mode, each mode and allocator setting in a fresh process.",
        "",
        "Bytes per parameter, counted from the tensors (grads after backward, the rest after "
        "the last step). Tensors under 4096 elements (biases, norms) keep fp32 state and "
        "LayerNorm weights stay fp32, as the modes define; NAIVE's fp32 master grads are a "
        "transient of its step (its lp grads are freed once the masters have them).",
        "",
        "| mode | weights | grads | fp32 masters | state | **total** | + master grads |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in mem.items():
        m = runs[first]
        parts = [m[k] / m["params"] for k in ("weights", "grads", "masters", "state")]
        lines.append(
            f"| {name} | " + " | ".join(f"{v:.2f}" for v in parts) + f" | **{sum(parts):.2f}** | "
            f"{m['master_grads'] / m['params']:.2f} |"
        )
    lines += [
        "",
        "Resident memory, MiB above the process before the build (imports done): the exact "
        "peak of each phase (the kernel's high-water mark, reset at each phase's start), the "
        "largest over the steps; 'held' is the RSS entering the last step. The peak's phase is "
        "in bold. 'glibc default' is how a Python process runs; 'fixed mmap threshold' sets "
        "MALLOC_MMAP_THRESHOLD_=131072 (glibc's own default, no longer raised as big blocks "
        "are freed), so freed tensors leave the RSS: it shows the live memory.",
        "",
        "| mode | allocator | " + " | ".join(PHASES) + " | held | peak | / fp32 | / NAIVE |",
        "|---|---|" + "---:|" * (len(PHASES) + 4),
    ]
    for allocator in allocators:
        fp32_peak = mem["fp32"][allocator]["peak_rss_mib"]
        naive_peak = mem["NAIVE (fp16)"][allocator]["peak_rss_mib"]
        for name, runs in mem.items():
            m = runs[allocator]
            peak = m["peak_rss_mib"]
            cells = [
                f"**{m['peak_mib'][p]:.0f}**"
                if m["peak_mib"][p] == peak
                else f"{m['peak_mib'][p]:.0f}"
                for p in PHASES
            ]
            lines.append(
                f"| {name} | {allocator} | " + " | ".join(cells) + f" | {m['steady_rss_mib']:.0f}"
                f" | {peak:.0f} | {peak / fp32_peak:.2f} | {peak / naive_peak:.2f} |"
            )
    if record["steps"] > 1:
        lines += size_time_lines(mem, allocators)
    return "\n".join(lines) + "\n"


def size_time_lines(mem: dict, allocators: list[str]) -> list[str]:
    """The --size run's step times: each mode's first step (compiling its kernels) and the
    median of the later ones, and NAIVE's later median over the mode's (same allocator)."""
    lines = [
        "",
        "Step time, seconds (forward, backward, step, zero_grad), from the same workers: one "
        "process per mode and allocator, one after the other (not interleaved, so load that "
        "changes between them falls on one mode). The first step compiles the lean kernels "
        "(one per tensor size). 'vs NAIVE': NAIVE's later median over the mode's, same "
        "allocator; NAIVE's params are fp16 here, the lean modes' bf16.",
        "",
        "| mode | allocator | first step | later steps (median) | vs NAIVE |",
        "|---|---|---:|---:|---:|",
    ]
    for allocator in allocators:
        naive = median(mem["NAIVE (fp16)"][allocator]["step_s"][1:])
        for name, runs in mem.items():
            steps = runs[allocator]["step_s"]
            later = median(steps[1:])
            lines.append(
                f"| {name} | {allocator} | {steps[0]:.2f} | {later:.2f} | {naive / later:.2f} |"
            )
    return lines


def size_chart(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mem = record["memory"]
    allocators = list(mem["fp32"])
    first = allocators[0]
    fig, axes = plt.subplots(1, 1 + len(allocators), figsize=(6 + 5.5 * len(allocators), 4.8))
    ax_b = axes[0]
    names = list(mem)
    bottom = [0.0] * len(names)
    for part in ("weights", "grads", "masters", "state"):
        vals = [mem[n][first][part] / mem[n][first]["params"] for n in names]
        ax_b.bar(names, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax_b.axhline(6, color="black", linestyle="--", linewidth=0.8, label="goal: 6 bytes")
    ax_b.set_ylabel("bytes per parameter (AdamW)")
    ax_b.tick_params(axis="x", rotation=30, labelsize=8)
    ax_b.legend(fontsize=8)
    for ax, allocator in zip(axes[1:], allocators, strict=True):
        for name in names:
            t, mib = zip(*mem[name][allocator]["trace"], strict=True)
            ax.plot(t, mib, label=name, linewidth=1)
        ax.set_title(f"RSS, {allocator}", fontsize=9)
        ax.set_xlabel("seconds since the build began")
        ax.set_ylabel("MiB above the start")
        ax.legend(fontsize=7)
    n = mem["fp32"][first]["params"]
    fig.suptitle(f"Lean precision, {n / 1e6:.1f}M-parameter GPT, {record['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----- report -----
def spread(values: list[float]) -> tuple[float, float]:
    return min(values), max(values)


def markdown(record: dict) -> str:
    args, mem = record["args"], record["memory"]
    fp32_peak, naive_peak = mem["fp32"]["peak_rss_mib"], mem["NAIVE (bf16)"]["peak_rss_mib"]
    lines = [
        f"# Lean precision, {record['machine']}",
        "",
        f"`python benchmarks/bench_lean.py {' '.join(record['argv'])}` ({record['seconds']:.0f} s"
        f", load average {record['load'][0]:.1f} -> {record['load'][1]:.1f} on "
        f"{os.cpu_count()} cores)",
        "",
        f"Bytes per parameter (AdamW) of a {mem['fp32']['params'] / 1e6:.1f}M-parameter "
        f"transformer (width {args['mem_width']}, depth {args['mem_depth']}), counted from the "
        "tensors it holds at its step; small tensors (< 4096 elements: biases, norms) keep fp32 "
        "state and LayerNorm weights stay fp32, as the modes define. Peak RSS: the growth of a "
        f"fresh process over the step (batch {args['mem_batch']} x {args['context']} tokens).",
        "",
        "| mode | weights | grads | fp32 masters | state | total | + master grads | "
        "peak RSS MiB | / fp32 | / NAIVE |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in mem.items():
        n = m["params"]
        parts = [m[k] / n for k in ("weights", "grads", "masters", "state")]
        lines.append(
            f"| {name} | " + " | ".join(f"{v:.2f}" for v in parts) + f" | **{sum(parts):.2f}** | "
            f"{m['master_grads'] / n:.2f} | {m['peak_rss_mib']:.0f} | "
            f"{m['peak_rss_mib'] / fp32_peak:.2f} | {m['peak_rss_mib'] / naive_peak:.2f} |"
        )
    return "\n".join(lines + quality_lines(record)) + "\n"


def quality_lines(record: dict) -> list[str]:
    """The quality table (and step time, when the record has it) of a run."""
    args, q, t = record["args"], record["quality"], record.get("time")
    d_lo, d_hi = spread([r["val_acc"] for r in q["digits"]["fp32"]])
    dl_lo, dl_hi = spread([r["val_loss"] for r in q["digits"]["fp32"]])
    g_lo, g_hi = spread([r["val_loss"] for r in q["gpt"]["fp32"]])
    lines = [
        "",
        f"Quality after fixed steps (AdamW, cosine schedule). Digits: {args['digits_steps']} "
        f"steps, lr {args['digits_lr']}, seeds {args['seeds']}; GPT: width {args['gpt_width']}, "
        f"depth {args['gpt_depth']}, {args['gpt_steps']} steps of {args['batch']} x "
        f"{args['context']} bytes of the standard library's source, lr {args['gpt_lr']}, seeds "
        f"{args['gpt_seeds']} (fp32: {args['fp32_seeds']} seeds for the spread). In: the mode's "
        "mean loss is no worse than fp32's worst seed (<= the largest fp32 loss; fp32's own "
        "mean always is)."
        + (
            f" Step time: the median GPT step over {args['time_rounds']} interleaved rounds; "
            "speed = NAIVE / mode (goal >= 0.95)."
            if t
            else " Step time: not measured in this run (--quality-only)."
        ),
        "",
        f"fp32 spread: digits accuracy {d_lo:.2f}-{d_hi:.2f} %, digits loss {dl_lo:.4f}-"
        f"{dl_hi:.4f}, GPT val loss {g_lo:.4f}-{g_hi:.4f}.",
        "",
        "| mode | digits acc % | digits loss | in | GPT val loss | in |"
        + (" step ms | speed vs NAIVE |" if t else ""),
        "|---|---|---|:-:|---|:-:|" + ("---:|---:|" if t else ""),
    ]
    for name in [n for n in QUALITY_MODES if n in q["digits"]]:
        d = q["digits"][name]
        acc = ", ".join(f"{r['val_acc']:.2f}" for r in d)
        dloss = ", ".join(f"{r['val_loss']:.4f}" for r in d)
        d_in = sum(r["val_loss"] for r in d) / len(d) <= dl_hi
        gl = [r["val_loss"] for r in q["gpt"][name]]
        g_in = sum(gl) / len(gl) <= g_hi
        row = (
            f"| {name} | {acc} | {dloss} | {'yes' if d_in else 'no'} | "
            f"{', '.join(f'{v:.4f}' for v in gl)} | {'yes' if g_in else 'no'} |"
        )
        if t:
            row += f" {t[name] * 1e3:.1f} | {t['NAIVE (bf16)'] / t[name]:.2f} |"
        lines.append(row)
    return lines


def chart(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mem, q = record["memory"], record["quality"]
    fig, (ax_b, ax_g) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = list(mem)
    bottom = [0.0] * len(names)
    for part in ("weights", "grads", "masters", "state"):
        vals = [mem[n][part] / mem[n]["params"] for n in names]
        ax_b.bar(names, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax_b.axhline(6, color="black", linestyle="--", linewidth=0.8, label="goal: 6 bytes")
    ax_b.set_ylabel("bytes per parameter (AdamW)")
    ax_b.tick_params(axis="x", rotation=30, labelsize=8)
    ax_b.legend(fontsize=8)
    _loss_panel(ax_g, q, "gpt", "GPT validation loss (stdlib bytes)")
    fig.suptitle(f"Lean precision, {record['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _loss_panel(ax: Any, q: dict, task: str, label: str) -> None:
    """Each quality mode's seeds on one task's validation loss, over fp32's seed spread."""
    lo, hi = spread([r["val_loss"] for r in q[task]["fp32"]])
    ax.axhspan(lo, hi, color="grey", alpha=0.3, label="fp32 seed spread")
    names = [n for n in QUALITY_MODES if n in q[task]]
    for i, name in enumerate(names):
        vals = [r["val_loss"] for r in q[task][name]]
        ax.scatter([i] * len(vals), vals, zorder=3)
    ax.set_xticks(range(len(names)), names, rotation=30, fontsize=8)
    ax.set_ylabel(label)
    ax.legend(fontsize=8)


def quality_chart(record: dict, path: Path) -> None:
    """The --quality-only run's picture: digits and GPT validation loss per mode and seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_d, ax_g) = plt.subplots(1, 2, figsize=(12, 4.2))
    _loss_panel(ax_d, record["quality"], "digits", "digits validation loss")
    _loss_panel(ax_g, record["quality"], "gpt", "GPT validation loss (stdlib bytes)")
    fig.suptitle(f"Lean quality, {record['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--memory-worker":
        mode, *nums = argv[1:]
        print(json.dumps(memory_worker(mode, *map(int, nums))))
        return 0
    if argv and argv[0] == "--size-worker":
        mode, size, steps = argv[1:]
        print(json.dumps(size_worker(mode, size, int(steps))))
        return 0
    if argv and argv[0] == "--render-size":  # md and png again from a --size run's json
        render_size(Path(argv[1]))
        return 0
    if argv and argv[0] == "--render":  # md and png again from a run's lean.json
        folder = Path(argv[1])
        record = json.loads((folder / "lean.json").read_text())
        return publish(folder, "lean", markdown(record), record, chart)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default: a new runs/bench_lean-<UTC time>/; benchmarks/results/ holds the references, written only when named here)",
    )
    parser.add_argument("--mem-width", type=int, default=384, help="768 with depth 12: ~100M")
    parser.add_argument("--mem-depth", type=int, default=4)
    parser.add_argument("--mem-batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--digits-steps", type=int, default=300)
    parser.add_argument("--digits-lr", type=float, default=1e-3)
    parser.add_argument("--seeds", type=int, default=3, help="digits seeds per mode")
    parser.add_argument("--gpt-width", type=int, default=64)
    parser.add_argument("--gpt-depth", type=int, default=2)
    parser.add_argument("--gpt-steps", type=int, default=200)
    parser.add_argument("--gpt-lr", type=float, default=2e-3)
    parser.add_argument("--gpt-seeds", type=int, default=1, help="GPT seeds per lean mode")
    parser.add_argument("--fp32-seeds", type=int, default=3, help="GPT seeds of fp32 (spread)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--time-rounds",
        type=int,
        default=60,
        help="interleaved rounds of every mode's step (~0.4 s a round for the default GPT); "
        "fewer leave the ratios noisy on a shared machine",
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default=None,
        help="only the memory run at this model size: bytes per parameter and peak RSS per "
        "phase of each mode (100m: the issue's ~100M-parameter transformer)",
    )
    parser.add_argument("--size-steps", type=int, default=2, help="steps per mode of --size")
    parser.add_argument(
        "--allocators",
        type=lambda text: [a.strip() for a in text.split(",")],
        default=list(ALLOCATORS),
        help=f"comma-separated, of: {', '.join(ALLOCATORS)} (default: both)",
    )
    parser.add_argument(
        "--time-only", action="store_true", help="only the interleaved step times (time.md)"
    )
    parser.add_argument(
        "--modes",
        type=lambda text: [m.strip() for m in text.split(",")],
        default=None,
        help="with --quality-only: comma-separated quality modes to run (fp32 always runs, for "
        f"the spread; default: all of {', '.join(QUALITY_MODES)})",
    )
    parser.add_argument(
        "--quality-only",
        action="store_true",
        help="only the digits and GPT quality runs (quality.md): no memory workers, no timing",
    )
    args = parser.parse_args(argv)
    bad_modes = [m for m in args.modes or () if m not in QUALITY_MODES]
    if bad_modes:
        parser.error(f"--modes {bad_modes}: valid: {', '.join(QUALITY_MODES)}")
    if args.modes and not args.quality_only:
        parser.error("--modes selects the quality runs' modes: use it with --quality-only")
    unknown = [a for a in args.allocators if a not in ALLOCATORS]
    if unknown:
        parser.error(f"--allocators {unknown}: valid: {', '.join(ALLOCATORS)}")
    if args.size is not None:
        return run_size(args)
    out = args.out or fresh_out_dir("bench_lean")
    if out.exists() and any(out.iterdir()):
        parser.error(f"--out {out} exists and is not empty: name a new folder")
    torch.set_num_threads(1)
    start, load0 = time.perf_counter(), os.getloadavg()[0]
    text = stdlib_text(1_200_000)
    if args.time_only:
        return time_only(args, argv, out, text, start, load0)
    if args.quality_only:
        return quality_only(args, argv, out, text, start, load0)
    mem_modes = list(policies())
    gpt_runs = args.fp32_seeds + (len(QUALITY_MODES) - 1) * args.gpt_seeds
    total = (
        len(mem_modes)
        + len(QUALITY_MODES) * args.seeds * args.digits_steps
        + gpt_runs * args.gpt_steps
        + args.time_rounds
        + 2
    )
    with progress_bar(total=total, enabled=not args.no_progress, desc="bench_lean") as bar:
        memory = {}
        for mode in mem_modes:
            bar.set_postfix_str(f"memory {mode}")
            memory[mode] = run_memory(mode, args)
            bar.update(1)
        quality = run_quality(args, text, bar)
        bar.set_postfix_str("step time")
        samples = time_steps(args, text, bar)
    timing = {n: median(t) for n, t in samples.items()}
    record = run_record(args, argv, out, start, load0)
    record |= {"memory": memory, "quality": quality, "time": timing, "time_samples": samples}
    return publish(out, "lean", markdown(record), record, chart)


def quality_modes(args: argparse.Namespace) -> list[str]:
    """The quality modes of this run: --modes (fp32 always, for the spread), else all."""
    if not args.modes:
        return list(QUALITY_MODES)
    return ["fp32", *[m for m in QUALITY_MODES if m in args.modes and m != "fp32"]]


def run_quality(args: argparse.Namespace, text: tuple, bar: Any) -> dict[str, dict[str, list]]:
    """Each quality mode's digits and GPT runs, seed by seed."""
    quality: dict[str, dict[str, list]] = {"digits": {}, "gpt": {}}
    modes = quality_modes(args)
    for name in modes:
        bar.set_postfix_str(f"digits {name}")
        policy = policies()[name]
        quality["digits"][name] = [run_digits(policy, s, args, bar) for s in range(args.seeds)]
    for name in modes:
        bar.set_postfix_str(f"gpt {name}")
        seeds = args.fp32_seeds if name == "fp32" else args.gpt_seeds
        policy = policies()[name]
        quality["gpt"][name] = [run_gpt(policy, s, args, text, bar) for s in range(seeds)]
    return quality


def run_record(
    args: argparse.Namespace, argv: list[str], out: Path, start: float, load0: float
) -> dict[str, Any]:
    """What every record of a run starts with: the command, its options (with the folder it
    writes), machine and torch, UTC date, seconds since `start`, load average then and now."""
    options = vars(args) | {"out": out}
    return {
        "argv": argv,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in options.items()},
        "machine": machine_name(torch.device("cpu")),
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "seconds": time.perf_counter() - start,
        "load": [load0, os.getloadavg()[0]],
    }


def publish(
    out: Path, stem: str, table: str, record: dict, draw: Callable[[dict, Path], None]
) -> int:
    """Print the table and write <stem>.md, .json and .png (draw(record, path)) into out."""
    print(table)
    paths = write_record(out, stem, table, record, functools.partial(draw, record))
    print("wrote " + ", ".join(map(str, paths.values())), file=sys.stderr)
    return 0


def quality_only(args, argv, out: Path, text: tuple, start: float, load0: float) -> int:
    modes = quality_modes(args)
    runs = args.fp32_seeds + (len(modes) - 1) * args.gpt_seeds
    total = len(modes) * args.seeds * args.digits_steps + runs * args.gpt_steps
    with progress_bar(total=total, enabled=not args.no_progress, desc="bench_lean quality") as bar:
        quality = run_quality(args, text, bar)
    record = run_record(args, argv, out, start, load0) | {"quality": quality}
    head = [
        f"# Lean quality, {record['machine']}",
        "",
        f"`python benchmarks/bench_lean.py {' '.join(argv)}` ({record['seconds']:.0f} s, load "
        f"average {record['load'][0]:.1f} -> {record['load'][1]:.1f} on {os.cpu_count()} cores)",
    ]
    table = "\n".join(head + quality_lines(record)) + "\n"
    return publish(out, "quality", table, record, quality_chart)


def time_only(args, argv, out: Path, text: tuple, start: float, load0: float) -> int:
    with progress_bar(
        total=args.time_rounds + 2, enabled=not args.no_progress, desc="bench_lean time"
    ) as bar:
        samples = time_steps(args, text, bar)
    record = run_record(args, argv, out, start, load0)
    record |= {"time": {n: median(t) for n, t in samples.items()}, "time_samples": samples}
    return publish(out, "time", time_markdown(record), record, time_chart)


if __name__ == "__main__":
    raise SystemExit(main())
