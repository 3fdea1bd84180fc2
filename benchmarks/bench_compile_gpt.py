"""compile_step on a real task: the stdlib-text GPT against the raw bf16 autocast loop.

Two identical GPTs (mixprec.bench.gpt: byte-level, pre-norm blocks, learned positions) train on
the same windows of the standard library's source with AdamW under a warmup + cosine schedule:

    raw autocast   torch.autocast (bf16) + foreach AdamW, eager (the loop users write today)
    compile_step   convert_to_amp(..., "bf16") + mixprec.compile_step: forward, backward, check,
                   update and the schedule's lr (an input, no recompile) in one compiled step

The first step of each is timed apart (compile_step's includes its compile, from a cold inductor
cache: a fresh TORCHINDUCTOR_CACHE_DIR). The other steps
run in blocks of --block steps, the two loops alternating which goes first, each block timed by
the process's CPU time; the record gives the median step of each and the median, least and
largest per-block ratio (raw / compile_step), then both models' validation loss on the same
held-out windows.

    python benchmarks/bench_compile_gpt.py                       # -> runs/
    python benchmarks/bench_compile_gpt.py --out benchmarks/results --name compile_gpt_cpu
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="windows per step")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--block", type=int, default=20, help="steps per timed block")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20, help="lr warmup steps")
    parser.add_argument("--text", type=int, default=400_000, help="bytes of stdlib source")
    parser.add_argument("--out", type=Path, help="folder (default: a fresh runs/ folder)")
    parser.add_argument("--name", default="compile_gpt_cpu", help="file stem of the results")
    args = parser.parse_args(argv)
    for name in ("width", "depth", "heads", "context", "batch", "steps", "block", "text"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: must be >= 1")
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: needs the first step and at least one more")
    return args


def ratios(raw: list[float], compiled: list[float]) -> dict[str, float]:
    """Median step times (s) and the per-block raw / compile_step ratios' median, min, max."""
    per_block = [r / c for r, c in zip(raw, compiled, strict=True)]
    return {
        "raw_ms": 1e3 * statistics.median(raw),
        "compile_step_ms": 1e3 * statistics.median(compiled),
        "ratio_median": statistics.median(per_block),
        "ratio_min": min(per_block),
        "ratio_max": max(per_block),
    }


def run(args: argparse.Namespace) -> dict:
    import torch
    from torch import nn

    import mixprec
    from mixprec.bench.gpt import GPT, VOCAB, cosine, gpt_batch, gpt_loss, set_lr, stdlib_text

    torch.set_num_threads(1)
    train, val = stdlib_text(args.text)

    def make():
        torch.manual_seed(0)
        model = GPT(args.width, args.depth, args.heads, args.context)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, foreach=True)
        return model, opt

    def criterion(logits, y):
        return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))

    raw_model, raw_opt = make()
    model, opt = make()
    model, opt, _ = mixprec.convert_to_amp(model, opt, nn.CrossEntropyLoss(), "bf16")
    step = mixprec.compile_step(model, opt, criterion)
    batches = {"raw": torch.Generator().manual_seed(1), "compile_step": torch.Generator()}
    batches["compile_step"].manual_seed(1)  # the same windows, in the same order

    def raw_step(i: int) -> None:
        set_lr(raw_opt, cosine(i, args.steps, args.lr, args.warmup))
        x, y = gpt_batch(train, args.batch, args.context, batches["raw"])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = gpt_loss(raw_model, x, y)
        loss.backward()
        raw_opt.step()
        raw_opt.zero_grad()

    def compiled_step(i: int) -> None:
        set_lr(opt, cosine(i, args.steps, args.lr, args.warmup))
        step(*gpt_batch(train, args.batch, args.context, batches["compile_step"]))

    first = {}
    for name, fn in (("compile_step", compiled_step), ("raw", raw_step)):
        t0 = time.perf_counter()
        fn(0)
        first[name] = time.perf_counter() - t0
        print(f"first step, {name}: {first[name]:.1f} s", flush=True)
    times: dict[str, list[float]] = {"raw": [], "compile_step": []}
    loops = [("raw", raw_step), ("compile_step", compiled_step)]
    starts = list(range(1, args.steps, args.block))
    for k, start in enumerate(starts):
        end = min(start + args.block, args.steps)
        for name, fn in loops if k % 2 == 0 else loops[::-1]:
            t0 = time.process_time()
            for i in range(start, end):
                fn(i)
            times[name].append((time.process_time() - t0) / (end - start))
        print(f"[{k + 1}/{len(starts)}] steps {start}-{end - 1}", flush=True)
    g = torch.Generator().manual_seed(7)
    held_out = [gpt_batch(val, 64, args.context, g) for _ in range(4)]
    losses = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for name, m in (("raw", raw_model), ("compile_step", model)):
            losses[name] = sum(gpt_loss(m, x, y).item() for x, y in held_out) / len(held_out)
    return {
        "first_step_s": first,
        **ratios(times["raw"], times["compile_step"]),
        "blocks": len(starts),
        "val_loss": losses,
        "compiled": step.compiled,
    }


def render(args: argparse.Namespace, result: dict, where: str) -> str:
    lines = [
        "# compile_step on the stdlib-text GPT against the raw bf16 autocast loop",
        "",
        f"Machine: {where}. Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC. "
        f"Load (1 min) at start {result['load_1min'][0]:.2f}, at end {result['load_1min'][1]:.2f}.",
        f"GPT width {args.width}, depth {args.depth}, {args.heads} heads, context {args.context}, "
        f"batch {args.batch}; AdamW, lr {args.lr} (warmup {args.warmup}, cosine), {args.steps} "
        f"steps; after the first, {result['blocks']} blocks of {args.block} steps, the loops "
        "alternating which goes first, process CPU time.",
        "",
        "| loop | first step (s) | median step (ms) | validation loss |",
        "|---|---:|---:|---:|",
    ]
    for name, key in (("raw autocast", "raw"), ("compile_step", "compile_step")):
        lines.append(
            f"| {name} | {result['first_step_s'][key]:.1f} | {result[f'{key}_ms']:.2f} | "
            f"{result['val_loss'][key]:.4f} |"
        )
    lines += [
        "",
        f"raw autocast / compile_step per block: median {result['ratio_median']:.2f}x, "
        f"least {result['ratio_min']:.2f}x, largest {result['ratio_max']:.2f}x.",
    ]
    return "\n".join(lines) + "\n"


def chart(result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    names = ["raw autocast", "compile_step"]
    values = [result["raw_ms"], result["compile_step_ms"]]
    ax.bar(names, values, color=["#999999", "#1f77b4"])
    ax.set_ylabel("median step (ms, CPU time)")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cache = tempfile.mkdtemp(prefix="inductor-cold-")  # read when inductor first compiles
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    try:
        return _main(args)
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
        shutil.rmtree(cache, ignore_errors=True)


def _main(args: argparse.Namespace) -> int:
    import torch

    from mixprec.bench.command import fresh_out_dir
    from mixprec.bench.report import write_record
    from mixprec.bench.runner import cpu_model

    out = args.out or fresh_out_dir("bench_compile_gpt")
    where = f"{cpu_model()}, {os.cpu_count()} cores, 1 torch thread, torch {torch.__version__}"
    load_before = os.getloadavg()[0]
    result = run(args)
    result["load_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    text = render(args, result, where)
    meta = {"machine": where, "args": {k: str(v) for k, v in vars(args).items()}}
    title = f"stdlib GPT, bf16 ({where})"
    paths = write_record(
        out, args.name, text, {"meta": meta, **result}, lambda png: chart(result, png, title)
    )
    print(text)
    print("written:", ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
