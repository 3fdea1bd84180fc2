"""What fp8 gradient communication costs in accuracy and saves in bytes (ZeRO-2, 2 gloo ranks).

The digits classifier (sklearn) and a byte-level GPT on the standard library's sources
(bench_lean.py's tasks and models), trained with LowLevelZeroPlugin(precision='bf16', stage=2)
on 2 ranks, each rank its own half of every batch, with the gradients moved in:

    fp32     communication_dtype=torch.float32 (the exact sum of the bf16 grads)
    bf16     communication_dtype=torch.bfloat16
    fp8      fp8_communication='e5m2' (True's format) and 'e4m3'

Same seeds, data order and initial weights for every variant. Measured: validation accuracy /
loss at the end, and the bytes each rank writes to its sockets per step (/proc/self/io wchar:
gloo's sends, counted), which include the owners' bf16 params sent back after the step.

Writes runs/bench_fp8_comm-<UTC time>/fp8_comm_cpu.{md,json}.

    python benchmarks/bench_fp8_comm.py                  # ~5 min on 2 loaded cores
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
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_lean import (  # noqa: E402 - the sibling benchmark's tasks, not a package
    digits_data,
    digits_net,
)
from bench_zero import bytes_sent  # noqa: E402

from mixprec.bench.command import fresh_out_dir  # noqa: E402
from mixprec.bench.gpt import GPT, cosine, gpt_batch, gpt_loss, stdlib_bytes  # noqa: E402
from mixprec.bench.report import write_record  # noqa: E402
from mixprec.bench.runner import machine_name  # noqa: E402

VARIANTS = {
    "fp32": {"communication_dtype": torch.float32},
    "bf16": {"communication_dtype": torch.bfloat16},
    "fp8 e5m2": {"fp8_communication": "e5m2"},
    "fp8 e4m3": {"fp8_communication": "e4m3"},
}


def boosted(make: Any, lr: float, wd: float, variant: str) -> tuple:
    from mixprec.booster import Booster
    from mixprec.booster.plugin import LowLevelZeroPlugin

    torch.manual_seed(0)
    model = make()
    plugin = LowLevelZeroPlugin(stage=2, precision="bf16", **VARIANTS[variant])
    booster = Booster(plugin=plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    model, opt, *_ = booster.boost(model, opt)
    return booster, model, opt


def train(booster: Any, model: Any, opt: Any, steps: int, lr: float, batch: Any) -> list[int]:
    """steps of AdamW under a cosine schedule; bytes sent per step."""
    sent = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine(step, steps, lr, 20)
        loss = batch(step)
        dist.barrier()
        before = bytes_sent()
        booster.backward(loss, opt)
        opt.step()
        sent.append(bytes_sent() - before)
        opt.zero_grad()
    return sent


def worker(rank: int, world: int, rendezvous: str, out: str, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    x, y, xv, yv = digits_data()
    text = stdlib_bytes(1_200_000)
    split = int(len(text) * 0.9)
    rows = {}
    try:
        for variant in VARIANTS:
            booster, model, opt = boosted(digits_net, args.digits_lr, 0.01, variant)
            g = torch.Generator().manual_seed(100 + rank)  # each rank its own half-batch

            def digits_batch(step: int, model: Any = model, g: torch.Generator = g) -> Any:
                idx = torch.randint(0, len(x), (args.digits_batch // world,), generator=g)
                return F.cross_entropy(model(x[idx]).float(), y[idx])

            d_sent = train(booster, model, opt, args.digits_steps, args.digits_lr, digits_batch)
            with torch.no_grad():
                logits = model(xv).float()
            acc = (logits.argmax(1) == yv).float().mean().item() * 100
            booster, model, opt = boosted(
                lambda: GPT(args.gpt_width, args.gpt_depth, 4, args.context),
                args.gpt_lr,
                0.1,
                variant,
            )
            g = torch.Generator().manual_seed(200 + rank)

            def gpt_step(step: int, model: Any = model, g: torch.Generator = g) -> Any:
                return gpt_loss(
                    model, *gpt_batch(text[:split], args.gpt_batch // world, args.context, g)
                )

            g_sent = train(booster, model, opt, args.gpt_steps, args.gpt_lr, gpt_step)
            gv = torch.Generator().manual_seed(12345)  # the same windows for every variant
            with torch.no_grad():
                val = [
                    gpt_loss(model, *gpt_batch(text[split:], 32, args.context, gv)).item()
                    for _ in range(8)
                ]
            rows[variant] = {
                "digits_val_acc": acc,
                "digits_val_loss": F.cross_entropy(logits, yv).item(),
                "digits_sent_per_step": sum(d_sent) / len(d_sent),
                "gpt_val_loss": sum(val) / len(val),
                "gpt_sent_per_step": sum(g_sent) / len(g_sent),
            }
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def markdown(rows: dict, args: argparse.Namespace, machine: str, argv: list[str]) -> str:
    ref = rows["fp32"]
    lines = [
        "# fp8 gradient communication: accuracy and bytes (ZeRO-2 bf16, 2 gloo ranks, CPU)",
        "",
        f"Machine: {machine}; load average at start {args.load_start:.1f}, at end "
        f"{args.load_end:.1f}. Command: `{' '.join(['python benchmarks/bench_fp8_comm.py', *argv])}`",
        f"digits: {args.digits_steps} steps, batch {args.digits_batch} (half per rank); GPT "
        f"width {args.gpt_width} x {args.gpt_depth} blocks, context {args.context}, "
        f"{args.gpt_steps} steps, batch {args.gpt_batch}; one seed (bf16 compute's own noise "
        "shows as the fp32-vs-bf16 communication gap).",
        "sent = bytes a rank writes to its sockets per step (counted), the owners' bf16 params "
        "sent back after the step included.",
        "",
        "| gradients moved in | digits val acc % | digits val loss | digits KiB sent / step "
        "| GPT val loss | GPT KiB sent / step | GPT sent / fp32's |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['digits_val_acc']:.2f} | {r['digits_val_loss']:.4f} | "
            f"{r['digits_sent_per_step'] / 2**10:.0f} | {r['gpt_val_loss']:.4f} | "
            f"{r['gpt_sent_per_step'] / 2**10:.0f} | "
            f"{r['gpt_sent_per_step'] / ref['gpt_sent_per_step']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--digits-steps", type=int, default=300)
    parser.add_argument("--digits-batch", type=int, default=64)
    parser.add_argument("--digits-lr", type=float, default=1e-3)
    parser.add_argument("--gpt-steps", type=int, default=200)
    parser.add_argument("--gpt-batch", type=int, default=16)
    parser.add_argument("--gpt-width", type=int, default=64)
    parser.add_argument("--gpt-depth", type=int, default=2)
    parser.add_argument("--gpt-lr", type=float, default=2e-3)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="default: runs/bench_fp8_comm-<UTC>")
    args = parser.parse_args(argv)
    for name in ("digits_steps", "digits_batch", "gpt_steps", "gpt_batch"):
        if getattr(args, name) < 2:
            parser.error(f"--{name.replace('_', '-')} must be >= 2")
    args.load_start = os.getloadavg()[0]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(worker, args=(2, os.path.join(tmp, "rdv"), out, args), nprocs=2, join=True)
        rows = json.loads(Path(out).read_text())
    args.load_end = os.getloadavg()[0]
    machine = machine_name(torch.device("cpu"))
    table = markdown(rows, args, machine, argv)
    print(table)
    args.out = args.out or fresh_out_dir("bench_fp8_comm")
    record = {
        "machine": machine,
        "args": {k: str(v) for k, v in vars(args).items()},
        "total_seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    paths = write_record(args.out, "fp8_comm_cpu", table, record)
    print("wrote " + ", ".join(map(str, paths.values())), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
