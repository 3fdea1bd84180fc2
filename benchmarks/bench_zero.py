"""ZeRO-1/2 (LowLevelZeroPlugin) vs DDP with the same precision, on 2 and 4 gloo ranks (CPU),
with and without overlap_communication and fp8_communication.

A model whose optimizer state dominates (depth x Linear(width), AdamW, a small batch). For
each world size and precision, every rank builds the runs below from the same weights and
steps them in turns (one step of each, then the next round), so load from other processes
falls on all of them alike:

    ddp, ddp_fp8                TorchDDPPlugin over the same Policy; fp8: its fp8 comm hook
    ddp_fp8_sync                that hook's collectives done before it returns (as it was
                                until it returned a future chain): what the overlap gains
    zero1, zero2                LowLevelZeroPlugin, gradients reduced at step()
    zero2_overlap               buckets reduced during backward (overlap_communication)
    zero2_fp8, zero2_overlap_fp8  gradients moved in fp8 (fp8_communication)

ZeRO's buckets hold --bucket-m million elements (default 0.25: one Linear(512) per bucket, so
backward has several buckets to overlap), and DDP's as many fp32 bytes (bucket_cap_mb =
4 x --bucket-m: at DDP's default 25 MB the whole model is one bucket, reduced after backward,
which leaves its fp8 hook nothing to overlap). Measured in that one run:

    bytes   fp32 masters + optimizer state each rank holds, summed from the optimizers' own
            state after the steps (the largest rank is reported); ratio = ZeRO / DDP
            (target: <= 1/world + 5 %); and the gradient bytes held after step()
    sent    bytes each rank writes to its sockets per step (/proc/self/io wchar: gloo's
            sends, counted, not modelled), the largest rank's mean over the timed steps
    time    each rank's median step (forward, backward, step) and its spread (the 10th-90th
            percentile range), the slowest rank's; speed = DDP median / the run's median

Writes runs/bench_zero-<UTC time>/zero_cpu.{md,json,png}.

    python benchmarks/bench_zero.py                       # default run (~5 min on 2 loaded cores)
    python benchmarks/bench_zero.py --worlds 2 --width 1024 --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from mixprec.bench.command import fresh_out_dir
from mixprec.bench.report import write_record
from mixprec.bench.runner import machine_name

PRECISIONS = ("fp16", "bf16", "fp32")
# name -> (ZeRO stage or 0 for DDP, overlap_communication, fp8_communication)
RUN_SPECS = {
    "ddp": (0, False, False),
    "ddp_fp8": (0, False, True),
    "ddp_fp8_sync": (0, False, True),
    "zero1": (1, False, False),
    "zero2": (2, False, False),
    "zero2_overlap": (2, True, False),
    "zero2_fp8": (2, False, True),
    "zero2_overlap_fp8": (2, True, True),
}
RUNS = tuple(RUN_SPECS)
WIO = Path("/proc/self/io")


def bytes_sent() -> int:
    """Bytes this process has written (write/writev: gloo's socket sends included)."""
    return int(dict(line.split(": ") for line in WIO.read_text().splitlines())["wchar"])


def state_dominated_net(width: int, depth: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def held_bytes(optimizer: Any) -> int:
    """fp32 masters + optimizer state this rank holds, read from the optimizer's own state."""
    state = sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )
    return state + sum(m.numel() * m.element_size() for m in optimizer.hp_masters)


def held_grad_bytes(model: nn.Module, optimizer: Any) -> int:
    """Gradient bytes a rank holds after step(): the params' grads and the fp32 masters'."""
    tensors = [p.grad for p in model.parameters()] + [m.grad for m in optimizer.hp_masters]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def synchronous_fp8_hook(group, bucket):  # noqa: ANN001, ANN201 - DDP checks annotations
    """The fp8 hook with its collectives waited for inside (the before of the async hook)."""
    from mixprec.parallel.comm import DEFAULT_FP8_COMM_FORMAT, FP8_COMM_FORMATS, fp8_all_reduce

    fp8 = FP8_COMM_FORMATS[DEFAULT_FP8_COMM_FORMAT]
    future = torch.futures.Future()
    future.set_result(fp8_all_reduce(bucket.buffer(), group, fp8).div_(dist.get_world_size(group)))
    return future


def build_runs(precision: str, args: argparse.Namespace) -> dict[str, tuple]:
    from mixprec.booster import Booster
    from mixprec.booster.plugin import LowLevelZeroPlugin, TorchDDPPlugin
    from mixprec.mixed_precision import MixedPrecision

    runs = {}
    for name, (stage, overlap, fp8) in RUN_SPECS.items():
        torch.manual_seed(0)
        model = state_dominated_net(args.width, args.depth)
        # 2**8: the default first fp16 scale (2**32) skips a few steps before one lands.
        zero = LowLevelZeroPlugin(
            stage=stage or 1,
            precision=precision,
            initial_scale=2**8,
            reduce_bucket_size_in_m=args.bucket_m,
            overlap_communication=overlap,
            fp8_communication=fp8,
        )
        sync = name == "ddp_fp8_sync"
        if not stage:  # the very same Policy, DDP instead of ZeRO
            ddp = TorchDDPPlugin(
                bucket_cap_mb=4 * args.bucket_m, fp8_communication=fp8 and not sync
            )
            booster = Booster(mixed_precision=MixedPrecision(zero.policy), plugin=ddp)
        else:
            booster = Booster(plugin=zero)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt, criterion, *_ = booster.boost(model, opt, nn.MSELoss())
        if sync:
            model.register_comm_hook(None, synchronous_fp8_hook)
        runs[name] = (booster, model, opt, criterion)
    return runs


def worker(rank: int, world: int, rendezvous: str, out: str, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    torch.set_num_threads(args.threads)
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        total = len(args.precisions) * len(RUNS) * (args.warmup + args.steps)
        bar = tqdm(total=total, desc=f"bench_zero {world} ranks", unit="step", file=sys.stderr)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, args.width, generator=gen)
    rows = []
    try:
        for precision in args.precisions:
            runs = build_runs(precision, args)
            times: dict[str, list[float]] = {name: [] for name in RUNS}
            sent: dict[str, list[int]] = {name: [] for name in RUNS}
            grad_bytes: dict[str, int] = {}
            for i in range(args.warmup + args.steps):
                for name, (booster, model, opt, criterion) in runs.items():
                    dist.barrier()  # every rank starts the step together
                    wchar = bytes_sent()
                    t0 = time.perf_counter()
                    booster.backward(criterion(model(x), y), opt)
                    opt.step()
                    elapsed = time.perf_counter() - t0
                    wchar = bytes_sent() - wchar
                    grad_bytes[name] = held_grad_bytes(model, opt)  # what outlives the step
                    opt.zero_grad()
                    if i >= args.warmup:
                        times[name].append(elapsed)
                        sent[name].append(wchar)
                    if bar is not None:
                        bar.update()
            stats = torch.tensor(
                [
                    [
                        *torch.tensor(times[n]).quantile(torch.tensor([0.5, 0.1, 0.9])).tolist(),
                        held_bytes(runs[n][2]),
                        grad_bytes[n],
                        sum(sent[n]) / len(sent[n]),
                    ]
                    for n in RUNS
                ],
                dtype=torch.float64,
            )
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest / fullest rank
            skipped = {n: runs[n][2].skipped_steps for n in RUNS}
            rows.append(
                {
                    "world": world,
                    "precision": precision,
                    "seconds": {n: float(stats[k, 0]) for k, n in enumerate(RUNS)},
                    "spread": {
                        n: [float(stats[k, 1]), float(stats[k, 2])] for k, n in enumerate(RUNS)
                    },
                    "bytes": {n: int(stats[k, 3]) for k, n in enumerate(RUNS)},
                    "grad_bytes": {n: int(stats[k, 4]) for k, n in enumerate(RUNS)},
                    "sent_per_step": {n: int(stats[k, 5]) for k, n in enumerate(RUNS)},
                    "skipped_steps": skipped,
                }
            )
            del runs
    finally:
        if bar is not None:
            bar.close()
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def run_world(world: int, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        rendezvous = os.path.join(tmp, "rendezvous")
        mp.spawn(worker, args=(world, rendezvous, out, args), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def markdown(rows: list[dict], args: argparse.Namespace, machine: str, argv: list[str]) -> str:
    params = args.depth * (args.width * args.width + args.width)
    lines = [
        "# ZeRO-1/2 vs DDP, same precision; overlap and fp8 communication (gloo, CPU)",
        "",
        f"Machine: {machine}; {args.threads} thread(s) per rank; "
        f"load average at start {args.load_start:.1f}, at end {args.load_end:.1f}.",
        f"Command: `{' '.join(['python benchmarks/bench_zero.py', *argv])}`",
        f"Model: {args.depth} x Linear({args.width}) = {params / 1e6:.2f} M params, AdamW, "
        f"batch {args.batch} per rank; {args.warmup} warm-up + {args.steps} timed steps per run, "
        f"runs taking turns; ZeRO buckets of {args.bucket_m} M elements, DDP's of "
        f"{4 * args.bucket_m:g} MB.",
        "time = the slowest rank's median step, [10th-90th percentile]; speed = DDP's median "
        "/ the run's; sent = bytes a rank writes to its sockets per step (counted: "
        "/proc/self/io), the largest rank's mean.",
        "",
        "| ranks | precision | run | ms median [p10-p90] | speed vs DDP | KiB sent / step "
        "| sent / DDP's |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        s, sent = r["seconds"], r["sent_per_step"]
        for n in RUNS:
            lo, hi = r["spread"][n]
            lines.append(
                f"| {r['world']} | {r['precision']} | {n} | {s[n] * 1e3:.1f} "
                f"[{lo * 1e3:.1f}-{hi * 1e3:.1f}] | {s['ddp'] / s[n]:.2f}x | "
                f"{sent[n] / 2**10:.0f} | {sent[n] / sent['ddp']:.3f} |"
            )
    lines += [
        "",
        "fp32 masters + optimizer state on the fullest rank, from the optimizers' own state:",
        "",
        "| ranks | precision | DDP MiB | ZeRO-1 MiB | ZeRO-1 / DDP | ZeRO-2 MiB | ZeRO-2 / DDP "
        "| 1/world + 5 % |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        b = r["bytes"]
        mib = {n: b[n] / 2**20 for n in RUNS}
        lines.append(
            f"| {r['world']} | {r['precision']} | {mib['ddp']:.1f} | {mib['zero1']:.1f} | "
            f"{b['zero1'] / b['ddp']:.3f} | {mib['zero2']:.1f} | {b['zero2'] / b['ddp']:.3f} | "
            f"{1 / r['world'] + 0.05:.3f} |"
        )
    lines += [
        "",
        "Gradient bytes a rank holds after step() (lp grads + fp32 master grads; the masters' "
        "stay allocated between steps on CPU), fullest rank:",
        "",
        "| ranks | precision | DDP MiB | ZeRO-1 MiB | ZeRO-2 MiB | ZeRO-2 / DDP |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        g = r["grad_bytes"]
        lines.append(
            f"| {r['world']} | {r['precision']} | {g['ddp'] / 2**20:.1f} | "
            f"{g['zero1'] / 2**20:.1f} | {g['zero2'] / 2**20:.1f} | {g['zero2'] / g['ddp']:.3f} |"
        )
    skipped = {f"{r['world']}/{r['precision']}": r["skipped_steps"] for r in rows}
    lines += ["", f"Skipped (overflow) steps per run: {skipped}."]
    return "\n".join(lines) + "\n"


def chart(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a build machine
    import matplotlib.pyplot as plt

    labels = [f"{r['world']}r {r['precision']}" for r in rows]
    shown = RUNS[1:]
    width = 0.8 / len(shown)
    fig, (speed, sent) = plt.subplots(1, 2, figsize=(12, 4))
    for k, name in enumerate(shown):
        pos = [i + (k - (len(shown) - 1) / 2) * width for i in range(len(rows))]
        speed.bar(pos, [r["seconds"]["ddp"] / r["seconds"][name] for r in rows], width, label=name)
        sent.bar(pos, [r["sent_per_step"][name] / r["sent_per_step"]["ddp"] for r in rows], width)
    speed.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    speed.set_ylabel("DDP median step time / run's")
    sent.set_ylabel("bytes sent per step / DDP's (counted)")
    for ax in (speed, sent):
        ax.set_xticks(range(len(rows)), labels, rotation=30, fontsize=8)
    speed.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="rows per rank per step")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run (fastest)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument(
        "--bucket-m", type=float, default=0.25, help="ZeRO reduce_bucket_size_in_m (millions)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for md/json/png (default: a new runs/bench_zero-<UTC time>/; benchmarks/results/ holds the references, rewritten only when named here)",
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.bucket_m <= 0:
        parser.error(f"--bucket-m must be > 0, got {args.bucket_m}")
    for name in ("width", "depth", "batch", "steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if any(w < 2 for w in args.worlds):
        parser.error(f"--worlds {args.worlds}: ZeRO needs at least 2 ranks to shard anything")
    args.load_start = os.getloadavg()[0]
    start = time.perf_counter()
    rows = [row for world in args.worlds for row in run_world(world, args)]
    args.load_end = os.getloadavg()[0]
    machine = machine_name(torch.device("cpu"))
    table = markdown(rows, args, machine, argv)
    print(table)
    args.out = args.out or fresh_out_dir("bench_zero")
    record = {
        "machine": machine,
        "args": {k: str(v) for k, v in vars(args).items()},
        "total_seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    paths = write_record(
        args.out,
        "zero_cpu",
        table,
        record,
        lambda png: chart(rows, png, f"ZeRO vs DDP, {machine}"),
    )
    print("wrote " + ", ".join(map(str, paths.values())), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
