"""The eager step's masked update (mixprec.core.sync_free) against the syncing step, on CPU.

Forces the sync-free path (`_sync_free = True`, off by default on CPU) and times whole training
steps (backward + step) of an fp16 MLP with fp32 masters, interleaved with the syncing path
(`_sync_free = False`) so that both see the same machine load; reports the median ratio and
the bytes the masked update copies per step (the stepped params + their optimizer state).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_sync_free.py [--width 1024] [--out DIR]

Writes sync_free_cpu.md/.json/.png to DIR (default: a fresh runs/sync_free-<UTC>/).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import textwrap
import time
from pathlib import Path

import torch

from mixprec.bench.command import fresh_out_dir
from mixprec.bench.progress import progress_bar
from mixprec.bench.report import write_record
from mixprec.bench.runner import machine_name
from mixprec.core.casting import cast_module
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import ScalerConfig

OPTIMIZERS = {
    "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
    "AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-4),
}


def build(make, width: int, sync_free: bool):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(4)]
    model = cast_module(torch.nn.Sequential(*layers), torch.float16)
    opt = MixedPrecisionOptimizer(make(model.parameters()), loss_scale=ScalerConfig())
    opt._sync_free = sync_free
    return model, opt


def one_step(model, opt, x) -> None:
    opt.zero_grad()
    opt.backward(model(x).float().square().mean())
    opt.step()


def copied_bytes(opt) -> int:
    """What the masked update snapshots per step: the stepped params and their state tensors."""
    total = 0
    for group in opt.optim.param_groups:
        for p in group["params"]:
            total += p.numel() * p.element_size()
            for value in opt.optim.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
    return total


def chart(rows: list[dict], title: str):
    """masked / syncing per optimizer: the median with the rounds' min-max."""

    def draw(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3))
        names = [r["optimizer"] for r in rows]
        med = [r["ratio_median"] for r in rows]
        err = [
            [m - r["ratio_min"] for m, r in zip(med, rows, strict=True)],
            [r["ratio_max"] - m for m, r in zip(med, rows, strict=True)],
        ]
        ax.barh(names, med, xerr=err, color="tab:blue", capsize=4)
        ax.axvline(1.0, color="gray", lw=1, ls="--")
        ax.set_xlabel("masked-update step time / syncing step time (lower is better)")
        ax.set_title(textwrap.fill(title, 70), fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    return draw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None, help="default: runs/sync_free-<UTC>")
    args = parser.parse_args(argv)
    for name in ("width", "steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    load_start = os.getloadavg()[0]
    x = torch.randn(64, args.width, dtype=torch.float16)
    setting = (
        f"4 x Linear({args.width}) fp16 + fp32 masters, batch 64, "
        f"{torch.get_num_threads()} thread(s), {args.rounds} interleaved rounds of {args.steps} steps"
    )
    rows = []
    with progress_bar(total=len(OPTIMIZERS), enabled=True, desc="bench_sync_free") as bar:
        for name, make in OPTIMIZERS.items():
            bar.set_postfix_str(name)
            runs = {flag: build(make, args.width, flag) for flag in (False, True)}
            for model, opt in runs.values():
                for _ in range(3):  # state created, allocator warm
                    one_step(model, opt, x)
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.rounds):
                for flag, (model, opt) in runs.items():
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        one_step(model, opt, x)
                    opt.skipped_steps  # noqa: B018 - the record's read, inside the timed round
                    times[flag].append((time.perf_counter() - start) / args.steps * 1e3)
            ratios = [m / s for m, s in zip(times[True], times[False], strict=True)]  # per round
            rows.append(
                {
                    "optimizer": name,
                    "syncing_ms": statistics.median(times[False]),
                    "masked_ms": statistics.median(times[True]),
                    "ratio_median": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                    "copied_mib": copied_bytes(runs[True][1]) / 2**20,
                }
            )
            bar.update()
    load = f"load average {load_start:.1f} -> {os.getloadavg()[0]:.1f}"
    lines = [
        f"# Masked-update (sync-free) eager step vs the syncing step, CPU ({machine_name(torch.device('cpu'))})",
        "",
        f"{setting}; {load}. Ratio: per round, masked / syncing, median (min-max).",
        "",
        "| optimizer | syncing ms/step | masked ms/step | masked / syncing | copied per step |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['optimizer']} | {r['syncing_ms']:.3f} | {r['masked_ms']:.3f} | "
            f"{r['ratio_median']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) | "
            f"{r['copied_mib']:.1f} MiB |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    out = args.out or fresh_out_dir("sync_free")
    record = {"setting": setting, "load": load, "args": vars(args), "rows": rows}
    paths = write_record(out, "sync_free_cpu", table, record, chart(rows, setting))
    print("wrote " + ", ".join(map(str, paths.values())), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
