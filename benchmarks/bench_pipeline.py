"""Pipeline parallelism on 2 gloo ranks vs one process: throughput, memory per stage, bubble.

A deep MLP (depth x Linear(width) + ReLU) trains under HybridParallelPlugin(pp_size=2) in each
mode and schedule, and in one process (the same Booster, no plugin, the whole batch at once).
All runs share one pair of processes (spawning costs seconds here); before each, freed memory
goes back to the OS and the peak-RSS mark is reset, so each peak is that run's own. Per run:

- samples/s: batch / median wall time of execute_pipeline + optimizer.step;
- peak memory: the rise of each process's peak RSS over its RSS before the model was built
  (per stage for the pipeline), and its ratio to the single process's;
- bubble: 1 - (time inside the stage's forward/backward of micro-batches) / (wall time of the
  schedule), per rank, next to the textbook (p-1)/(m+p-1) ((p-1)/(v*m+p-1) interleaved, v
  stages per rank). On a CPU shared by both ranks gloo's copies and the OS add to the idle.

    python benchmarks/bench_pipeline.py                       # small default (< 2 min)
    python benchmarks/bench_pipeline.py --width 1024 --depth 16 --batch 64 --steps 5

Writes runs/bench_pipeline-<UTC time>/pipeline_<tag>.{md,json,png}. On a machine with one GPU the
pipeline still runs on CPU ranks (gloo): pipelines need >= 2 devices to place stages apart.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from importlib import import_module
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from tqdm import tqdm

from mixprec.bench.command import fresh_out_dir

MODES = ("fp32", "bf16", "fp16_naive")
SCHEDULES = ("1f1b", "gpipe", "interleaved")
PP = 2


def deep_mlp(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def precision(mode: str) -> Any:
    from mixprec.mixed_precision import FP16NaiveMixedPrecision

    # fp16_naive's 2**32 first scale skips ~20 warm-up steps; 2**8 trains from the first step.
    return FP16NaiveMixedPrecision(initial_scale=2.0**8) if mode == "fp16_naive" else mode


def timed_chunks(stage: Any, busy: list[float]) -> None:
    """Add the seconds of each forward/backward of a micro-batch on this stage to busy[0]."""
    for name in ("forward_one_chunk", "backward_one_chunk"):
        inner = getattr(stage, name)

        def timed(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - t0

        setattr(stage, name, timed)


def release_freed_memory() -> None:
    """Hand freed heap back to the OS (glibc malloc_trim), so the next run's RSS rise is its own."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure(rank: int, run: dict[str, Any], solo: Any) -> dict[str, Any] | None:
    """One run on this rank: median step time, RSS rise, bubble (None: not this rank's run)."""
    from mixprec.bench.worker import reset_peak_rss, rss_peak_bytes
    from mixprec.booster import Booster
    from mixprec.booster.plugin import HybridParallelPlugin
    from mixprec.core.prepare import FP32Criterion, prepare_model, prepare_optimizer

    single = run["schedule"] is None
    if single and rank != 0:
        return None
    release_freed_memory()
    reset_peak_rss()
    base = rss_peak_bytes()
    model = deep_mlp(run["width"], run["depth"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(run["batch"], run["width"], generator=g)
    y = torch.randn(run["batch"], run["width"], generator=g)
    busy = [0.0]
    mixed = precision(run["mode"])
    if single:  # the same core as the Booster's, overflow agreed over this process alone
        policy = Booster(mixed_precision=mixed).mixed_precision.policy
        model = prepare_model(model, policy)
        opt = prepare_optimizer(opt, policy, process_group=solo)
        crit = FP32Criterion(nn.MSELoss())

        def schedule() -> None:
            opt.backward(crit(model(x), y))
    else:
        plugin = HybridParallelPlugin(  # precision=None: the Booster's mixed_precision
            pp_size=PP, num_microbatches=run["m"], pp_schedule=run["schedule"], precision=None
        )
        booster = Booster(mixed_precision=mixed, plugin=plugin)
        model, opt, crit, _, _ = booster.boost(model, opt, nn.MSELoss())
        for stage in model.pipeline_stages:
            timed_chunks(stage, busy)

        def schedule() -> None:
            booster.execute_pipeline(iter([(x, y)]), model, crit, opt)

    step_s, bubbles = [], []
    for i in range(run["warmup"] + run["steps"]):
        busy[0] = 0.0
        if not single:
            dist.barrier()  # both ranks start each step together
        t0 = time.perf_counter()
        schedule()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        if i >= run["warmup"]:
            step_s.append(t2 - t0)
            bubbles.append(1 - busy[0] / (t1 - t0))
    return {
        "rank": rank,
        "step_s": statistics.median(step_s),
        "peak_delta_bytes": rss_peak_bytes() - base,
        "bubble": None if single else statistics.median(bubbles),
        "skipped": opt.skipped_steps,
    }


def worker(rank: int, world: int, runs: list[dict[str, Any]], rendezvous: str, out: str) -> None:
    torch.set_num_threads(1)  # two ranks share the 2-core machine: one core each
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        import_module("torch.distributed.pipelining")  # loaded before any baseline
        warm = nn.Linear(8, 8)  # first matmul/backward set up BLAS and autograd state: not ours
        warm(torch.randn(2, 8)).sum().backward()
        solo = dist.new_group([0])  # every rank must call new_group; only rank 0 is in it
        # Unmeasured first runs: one-time costs (thread pools, first allocations, schedule
        # set-up) otherwise land on whichever run comes first.
        first_single = next(r for r in runs if r["schedule"] is None)
        first_pipeline = next((r for r in runs if r["schedule"] is not None), None)
        for run in (first_single, first_pipeline):
            if run is not None:
                measure(rank, run, solo)
            dist.barrier()
        results = []
        for i, run in enumerate(runs):
            results.append(measure(rank, run, solo))
            dist.barrier()  # rank 1 waits out rank 0's single-process runs
            if rank == 0:
                Path(out, "progress").write_text(str(i + 1))
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def launch(runs: list[dict[str, Any]], bar: tqdm) -> list[list[dict[str, Any] | None]]:
    """Every run on one pair of processes; per run, each rank's record (None: not its run)."""
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")
        ctx = mp.spawn(worker, args=(PP, runs, rendezvous, tmp), nprocs=PP, join=False)
        progress = Path(tmp, "progress")
        while not ctx.join(timeout=0.5):
            if progress.exists() and progress.read_text():
                bar.n = int(progress.read_text())
                bar.refresh()
        bar.n = len(runs)
        bar.refresh()
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(PP)]
    return [list(records) for records in zip(*per_rank, strict=True)]


def textbook_bubble(schedule: str, m: int) -> float:
    v = 2 if schedule == "interleaved" else 1
    return (PP - 1) / (v * m + PP - 1)


def render(
    args: argparse.Namespace, rows: list[dict[str, Any]], where: str, load: list[float]
) -> str:
    lines = [
        f"# Pipeline (pp={PP}, gloo) vs one process on {where}",
        "",
        f"{args.depth} x (Linear({args.width}) + ReLU), batch {args.batch}, "
        f"{args.microbatches} micro-batches, SGD, MSE; median of {args.steps} steps after "
        f"{args.warmup} warm-up; one thread per rank. Memory: rise of peak RSS per process. "
        f"1-minute load average before / after: {load[0]:.1f} / {load[1]:.1f} (other jobs on "
        "the same cores make throughput noisy; memory and the bubble's trend are steadier).",
        "",
        "| mode | schedule | samples/s | vs 1 process | peak MiB stage 0 / 1 | mem vs 1 process "
        "(max stage) | bubble measured (rank 0 / 1) | bubble (p-1)/(m+p-1) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mem = " / ".join(f"{b / 2**20:.1f}" for b in r["peak_bytes"])
        if r["schedule"] is None:
            lines.append(
                f"| {r['mode']} | 1 process | {r['samples_s']:.0f} | 1.00x | {mem} | 1.00x | | |"
            )
            continue
        bubble = " / ".join(f"{b:.2f}" for b in r["bubbles"])
        lines.append(
            f"| {r['mode']} | {r['schedule']} | {r['samples_s']:.0f} | {r['speed_ratio']:.2f}x | "
            f"{mem} | {r['mem_ratio']:.2f}x | {bubble} | {r['textbook_bubble']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def chart(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    piped = [r for r in rows if r["schedule"] is not None]
    names = [f"{r['mode']}\n{r['schedule']}" for r in piped]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    bars = ax1.bar(names, [r["speed_ratio"] for r in piped], color="#1f77b4")
    ax1.bar_label(bars, labels=[f"{r['speed_ratio']:.2f}x" for r in piped], fontsize=7)
    ax1.set_ylabel("samples/s vs one process")
    bars = ax2.bar(names, [r["mem_ratio"] for r in piped], color="#d62728")
    ax2.bar_label(bars, labels=[f"{r['mem_ratio']:.2f}x" for r in piped], fontsize=7)
    ax2.set_ylabel("peak memory of the larger stage vs one process")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run (median)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for md/json/png (default: a new runs/bench_pipeline-<UTC time>/; benchmarks/results/ holds the references, rewritten only when named here)",
    )
    parser.add_argument("--tag", default="cpu", help="file name suffix, e.g. the device")
    args = parser.parse_args(argv)
    modes, schedules = args.modes.split(","), args.schedules.split(",")
    for name, values, valid in (("modes", modes, MODES), ("schedules", schedules, SCHEDULES)):
        bad = [v for v in values if v not in valid]
        if bad:
            parser.error(f"--{name}: unknown {bad}; valid: {', '.join(valid)}")
    for name in ("width", "depth", "batch", "microbatches", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.batch % args.microbatches:
        parser.error(f"--batch {args.batch} must be a multiple of --microbatches")

    common = {k: getattr(args, k) for k in ("width", "depth", "batch", "steps", "warmup")}
    runs = [
        {**common, "mode": mode, "schedule": schedule, "m": args.microbatches}
        for mode in modes
        for schedule in (None, *schedules)
    ]
    load = [os.getloadavg()[0]]
    rows: list[dict[str, Any]] = []
    single: dict[str, dict[str, Any]] = {}
    with tqdm(total=len(runs), desc="bench_pipeline", unit="run", file=sys.stderr) as bar:
        results = launch(runs, bar)
    for run, records in zip(runs, results, strict=True):
        ranks = [r for r in records if r is not None]
        step_s = max(r["step_s"] for r in ranks)  # the pipeline is as slow as its slowest rank
        row = {
            "mode": run["mode"],
            "schedule": run["schedule"],
            "step_s": step_s,
            "samples_s": args.batch / step_s,
            "peak_bytes": [r["peak_delta_bytes"] for r in ranks],
            "bubbles": [r["bubble"] for r in ranks],
            "skipped_steps": max(r["skipped"] for r in ranks),
        }
        if run["schedule"] is None:
            single[run["mode"]] = row
        else:
            ref = single[run["mode"]]
            row["speed_ratio"] = row["samples_s"] / ref["samples_s"]
            row["mem_ratio"] = max(row["peak_bytes"]) / ref["peak_bytes"][0]
            row["textbook_bubble"] = textbook_bubble(run["schedule"], args.microbatches)
        rows.append(row)

    from mixprec.bench.runner import machine_name

    load.append(os.getloadavg()[0])
    where = machine_name(torch.device("cpu"))
    table = render(args, rows, where, load)
    print(table)
    args.out = args.out or fresh_out_dir("bench_pipeline")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"pipeline_{args.tag}"
    stem.with_suffix(".md").write_text(table)
    record = {
        "machine": where,
        "load_average_before_after": load,
        "args": {k: str(v) for k, v in vars(args).items()},
        "runs": rows,
    }
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    chart(rows, stem.with_suffix(".png"), f"pp={PP} on {where}")
    print(f"wrote {stem}.md, .json, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
