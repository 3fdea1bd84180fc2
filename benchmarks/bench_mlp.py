"""Seed 002's experiment on this machine: 9 x Linear(4096), batch 1024, SGD, MSE.

Runs, in one process and one sitting, fp32 and four low-precision loops — two written in raw
torch, two through mixprec — and prints speedups vs fp32 and each mixprec mode vs its raw twin:

    mixprec bf16            vs  raw torch.autocast(bfloat16) loop
    mixprec NAIVE (bf16)    vs  raw pure-bf16 loop (bf16 params, no masters)

Then times the master-weight optimizer step against a plain fp32 optimizer step of the same
size (SGD and AdamW). Writes runs/bench_mlp-<UTC time>/mlp_<device>.{md,json,png}.

    python benchmarks/bench_mlp.py                      # the seed's size
    python benchmarks/bench_mlp.py --width 1024 --steps 5
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

import mixprec
from mixprec import AMP_TYPE, convert_to_amp
from mixprec.bench.command import fresh_out_dir
from mixprec.bench.runner import machine_name
from mixprec.bench.timing import time_call

DEVICE = torch.device("cpu")  # set by --device


def simple_net(width: int, depth: int) -> nn.Module:
    """Seed 002's SimpleNet: `depth` Linear(width, width) layers in a row."""
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def median_step_seconds(step: Callable[[], None], warmup: int, steps: int, bar: tqdm) -> float:
    for _ in range(warmup):
        step()
        bar.update()
    times = []
    for _ in range(steps):
        times.append(time_call(step, DEVICE))  # CUDA events on a GPU
        bar.update()
    return statistics.median(times)


def make_loops(width: int, depth: int, batch: int, lr: float):
    """name -> builder returning a no-argument training step (built lazily: one model in memory)."""
    gen = torch.Generator(DEVICE).manual_seed(100)
    x = torch.rand(batch, width, generator=gen)
    y = torch.rand(batch, width, generator=gen)
    mse = nn.MSELoss()

    def fresh() -> nn.Module:
        torch.manual_seed(100)
        return simple_net(width, depth)

    def fp32():
        model = fresh()
        opt = torch.optim.SGD(model.parameters(), lr=lr)

        def step():
            mse(model(x), y).backward()
            opt.step()
            opt.zero_grad()

        return step

    def raw_autocast_bf16():
        model = fresh()
        opt = torch.optim.SGD(model.parameters(), lr=lr)

        def step():
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                out = model(x)
            mse(out.float(), y).backward()
            opt.step()
            opt.zero_grad()

        return step

    def raw_pure_bf16():
        model = fresh().bfloat16()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        x_lp = x.bfloat16()

        def step():
            mse(model(x_lp).float(), y).backward()
            opt.step()
            opt.zero_grad()

        return step

    def mixprec_loop(mode, config=None):
        def build():
            model = fresh()
            model, opt, crit = convert_to_amp(
                model, torch.optim.SGD(model.parameters(), lr=lr), mse, mode, config
            )

            def step():
                opt.backward(crit(model(x), y))
                opt.step()
                opt.zero_grad()

            return step

        return build

    return {
        "fp32": fp32,
        "raw autocast bf16": raw_autocast_bf16,
        "mixprec bf16": mixprec_loop("bf16"),
        "raw pure bf16": raw_pure_bf16,
        "mixprec NAIVE bf16": mixprec_loop(AMP_TYPE.NAIVE, {"dtype": "bfloat16"}),
    }


TWINS = {"mixprec bf16": "raw autocast bf16", "mixprec NAIVE bf16": "raw pure bf16"}


def time_optimizer_step(opt_cls, width: int, depth: int, steps: int, bar: tqdm) -> dict:
    """Master-weight step (bf16 params, fp32 masters), unfused and fused, vs a plain fp32 step
    over the same parameter count. Each step's grads are set anew (a pointer swap)."""
    fp32_params = [nn.Parameter(torch.randn(width, width)) for _ in range(depth)]
    fp32_grads = [torch.randn_like(p) for p in fp32_params]
    lp_grads = [g.bfloat16() for g in fp32_grads]
    plain = opt_cls(fp32_params, lr=1e-4)

    def plain_step():
        for p, g in zip(fp32_params, fp32_grads, strict=True):
            p.grad = g
        plain.step()

    times = {"fp32_step_s": median_step_seconds(plain_step, 1, steps, bar)}
    for key, fused_step in (("master_step_s", False), ("fused_master_step_s", True)):
        lp_params = [nn.Parameter(p.detach().bfloat16()) for p in fp32_params]
        wrapped = mixprec.MixedPrecisionOptimizer(
            opt_cls(lp_params, lr=1e-4), fused_step=fused_step
        )

        def master_step(lp_params=lp_params, wrapped=wrapped):
            for p, g in zip(lp_params, lp_grads, strict=True):
                p.grad = g  # the wrapper consumes the lp grads and drops them
            wrapped.step()

        # Two warm-up steps: the first compiles the fused kernels, the second allocates state.
        times[key] = median_step_seconds(master_step, 2, steps, bar)
        del wrapped, lp_params
        gc.collect()
    times["ratio"] = times["master_step_s"] / times["fp32_step_s"]
    times["fused_ratio"] = times["fused_master_step_s"] / times["fp32_step_s"]
    return times


OPTIMIZERS = {"SGD": torch.optim.SGD, "AdamW": torch.optim.AdamW}


def render(args, loops: dict[str, float], opt_steps: dict[str, dict], where: str) -> str:
    base = loops["fp32"]
    lines = [
        f"# 9xLinear MLP (seed 002) on {where}",
        "",
        f"width {args.width}, depth {args.depth}, batch {args.batch}, SGD, MSE; "
        f"median of {args.steps} steps after {args.warmup} warm-up.",
        "",
        "| loop | s/step | speedup vs fp32 | vs raw twin |",
        "|---|---:|---:|---:|",
    ]
    for name, secs in loops.items():
        twin = TWINS.get(name)
        vs_twin = f"{loops[twin] / secs:.3f}x ({twin})" if twin else ""
        lines.append(f"| {name} | {secs:.3f} | {base / secs:.2f}x | {vs_twin} |")
    lines += [
        "",
        "Master-weight optimizer step (bf16 params, fp32 masters, overflow check) vs a plain fp32",
        "step over the same parameters:",
        "",
        "| optimizer | fp32 step s | master step s (unfused) | ratio | fused step s | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in opt_steps.items():
        lines.append(
            f"| {name} | {r['fp32_step_s']:.4f} | {r['master_step_s']:.4f} | {r['ratio']:.2f}x "
            f"| {r['fused_master_step_s']:.4f} | {r['fused_ratio']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def chart(loops: dict[str, float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = loops["fp32"]
    names = list(loops)
    speedups = [base / loops[n] for n in names]
    colors = [
        "#888888" if n == "fp32" else "#d62728" if n.startswith("mixprec") else "#1f77b4"
        for n in names
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    bars = ax.bar(names, speedups, color=colors)
    ax.bar_label(bars, labels=[f"{s:.2f}x" for s in speedups])
    ax.set_ylabel("speedup vs fp32 (higher is better)")
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=9)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per loop (median)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--opt-steps", type=int, default=5, help="timed optimizer-only steps")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for md/json/png (default: a new runs/bench_mlp-<UTC time>/; benchmarks/results/ holds the references, rewritten only when named here)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tag", default=None, help="file name suffix (default: the device)")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    args.tag = args.tag or DEVICE.type
    if DEVICE.type == "cuda":
        torch.set_default_device(DEVICE)  # every model and tensor a loop builds lives there
    for name in ("width", "depth", "batch", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")

    builders = make_loops(args.width, args.depth, args.batch, lr=1e-4)
    total = len(builders) * (args.warmup + args.steps) + len(OPTIMIZERS) * (
        1 + 2 * 2 + 3 * args.opt_steps
    )
    loops: dict[str, float] = {}
    with tqdm(total=total, desc="bench_mlp", unit="step", file=sys.stderr) as bar:
        for name, build in builders.items():
            bar.set_postfix_str(name)
            step = build()
            loops[name] = median_step_seconds(step, args.warmup, args.steps, bar)
            del step
            gc.collect()
        bar.set_postfix_str("optimizer steps")
        opt_steps = {
            name: time_optimizer_step(cls, args.width, args.depth, args.opt_steps, bar)
            for name, cls in OPTIMIZERS.items()
        }

    where = machine_name(DEVICE)
    table = render(args, loops, opt_steps, where)
    print(table)
    args.out = args.out or fresh_out_dir("bench_mlp")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"mlp_{args.tag}"
    stem.with_suffix(".md").write_text(table)
    record = {
        "machine": where,
        "args": {k: str(v) for k, v in vars(args).items()},
        "loops_s": loops,
    }
    record["optimizer_steps"] = opt_steps
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    chart(loops, stem.with_suffix(".png"), f"9xLinear({args.width}) batch {args.batch}: {where}")
    print(f"wrote {stem}.md, .json, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
