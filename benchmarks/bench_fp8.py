"""fp8 vs bf16: forward+backward time of one Linear(w, w) and of 9 x Linear(w, w) (seed 002's net).

Every case runs under bf16 autocast with fp32 parameters (the library's 'bf16' and 'fp8' modes):

    bf16          nn.Linear: the GEMMs in bf16
    fp8           Float8Linear over torch._scaled_mm (e4m3 forward, e5m2 gradients)
    fp8-emulated  Float8Linear(emulate=True): the same casts, GEMMs in fp32

All in one process, one sitting, so the ratios to bf16 compare like with like. A step is one
forward and one backward (all three GEMMs per layer: the input requires grad too).
Writes runs/bench_fp8-<UTC time>/fp8_<device>.{md,json,png} (--out DIR to choose).

The recipe axis (--recipes, instead of the mode sweep): for each Float8Config recipe, the
quantization error of its GEMM operands (SQNR, from mixprec.fp8.telemetry.operand_stats, on
N(0, 1) operands of the benchmarked shapes) and the step time of one Linear(w, w) with that
recipe (every recipe emulated: quantize, dequantize, fp32 GEMM; tensorwise too, so that the
times compare) against bf16, written as fp8_recipes_<device>.{md,json,png}.

The training axis (--train): the stdlib-text GPT (mixprec.bench.gpt) trained for the same
steps on the same batches from the same init in fp32, bf16 and every recipe (bf16 autocast, fp32
masters, each block's Linear layers converted, the output head kept in bf16 as torchao and
Megatron do), AdamW with a cosine schedule; fp32 and bf16 over several seeds for the
seed-to-seed spread. Each run's final validation loss, its gap to bf16 on the same seed, and
whether it lies inside fp32's seed spread (else by how much it misses), with validation-loss
curves, written as fp8_train_<device>.{md,json,png}.

    python benchmarks/bench_fp8.py                              # the default sweep (< 3 min)
    python benchmarks/bench_fp8.py --widths 1024 2048 --steps 5
    python benchmarks/bench_fp8.py --recipes all --widths 1024   # the recipe axis
    python benchmarks/bench_fp8.py --train                       # the training axis (~25 min)
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.bench.command import fresh_out_dir
from mixprec.bench.gpt import GPT, gpt_val_loss, stdlib_text, train_gpt
from mixprec.bench.progress import progress_bar
from mixprec.bench.report import write_record
from mixprec.bench.runner import cpu_model
from mixprec.bench.timing import time_call
from mixprec.core.policy import to_policy
from mixprec.core.prepare import prepare_model, prepare_optimizer
from mixprec.fp8 import (
    RECIPE_OPERANDS,
    RECIPES,
    Float8Config,
    convert_to_fp8,
    fp8_kernel_problem,
    fp8_summary,
    operand_stats,
    per_module_recipes,
)
from mixprec.fp8.recipes import OPERAND_ROLES, operand_lp_dtype

MODES = ("bf16", "fp8", "fp8-emulated")
MLP_DEPTH = 9


def machine_description(device: torch.device) -> dict[str, str]:
    """What ran this: CPU model, cores, torch and its threads, load."""
    info = {
        "cpu": f"{cpu_model()} ({platform.machine()})",
        "cores": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    if hasattr(os, "getloadavg"):  # other processes share the cores: recorded, not hidden
        info["load_avg_1min_at_start"] = f"{os.getloadavg()[0]:.2f}"
    return info


def utc_date() -> str:
    """Now, as the records state it: 'YYYY-MM-DD HH:MM' in UTC."""
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime())


def run_record(
    machine: dict[str, str], args: argparse.Namespace, start: float, **fields: Any
) -> dict[str, Any]:
    """A finished run's record: the machine (its load average at the end added, before any
    table shows it), the options but argv, the run's seconds since `start`, then `fields`."""
    if hasattr(os, "getloadavg"):
        machine["load_avg_1min_at_end"] = f"{os.getloadavg()[0]:.2f}"
    return {
        "machine": machine,
        "args": {k: v for k, v in vars(args).items() if k != "argv"},
        "total_seconds": round(time.perf_counter() - start, 1),
        **fields,
    }


def publish(
    args: argparse.Namespace,
    stem: str,
    table: str,
    record: dict[str, Any],
    chart: Callable[[Path], None],
) -> int:
    """Print the table; unless --no-write, write <stem>.md/.json/.png under --out (default: a
    new runs/bench_fp8-<UTC time>/) and name the files written. Returns the exit status, 0."""
    print(table)
    if not args.no_write:
        paths = write_record(args.out or fresh_out_dir("bench_fp8"), stem, table, record, chart)
        print("wrote " + ", ".join(map(str, paths.values())), file=sys.stderr)
    return 0


def scaled_mm_ops(device: torch.device) -> list[str]:
    """The aten ops torch._scaled_mm calls on this device (profiled once on a 256^2 GEMM).

    A fused float8 kernel calls none; a reference kernel shows its upcasts and matmul.
    """
    from torch.profiler import profile

    lp = torch.randn(256, 256, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    with profile() as prof:
        torch._scaled_mm(lp, lp.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    children = [
        c.name for e in prof.events() if e.name == "aten::_scaled_mm" for c in e.cpu_children
    ]
    return list(dict.fromkeys(children))


FAST_ACCUM = True  # set by --fast-accum: the real kernel's forward GEMM (Float8Config)


def recipe_config(recipe: str, emulate_tensorwise: bool) -> Float8Config:
    """The recipe's Float8Config; emulate_tensorwise: tensorwise emulated too (quantize,
    dequantize, fp32 GEMM, as every other recipe on CPU), not run on a _scaled_mm kernel."""
    return Float8Config(
        recipe=recipe, emulate=True if emulate_tensorwise and recipe == "tensorwise" else None
    )


def build(width: int, depth: int, mode: str, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).to(device)
    if mode.startswith("recipe:"):  # the recipe axis: every recipe emulated
        recipe = mode.removeprefix("recipe:")
        model = convert_to_fp8(model, config=recipe_config(recipe, emulate_tensorwise=True))
        summary = fp8_summary(model)
        assert len(summary.converted) == depth, summary
    elif mode != "bf16":
        config = Float8Config(emulate=mode == "fp8-emulated", use_fast_accum_forward=FAST_ACCUM)
        model = convert_to_fp8(model, config=config)
        summary = fp8_summary(model)
        assert len(summary.converted) == depth, summary  # widths are multiples of 16
    return model


def make_step(
    width: int, depth: int, mode: str, tokens: int, device: torch.device
) -> Callable[[], None]:
    """One forward+backward of a fresh model in `mode` (same weights and data in every mode)."""
    model = build(width, depth, mode, device)
    gen = torch.Generator().manual_seed(1)  # CPU numbers, moved: the same data on every device
    x = torch.randn(tokens, width, generator=gen).to(device).requires_grad_()
    grad = torch.randn(tokens, width, generator=gen).to(device, torch.bfloat16)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(x)
        out.backward(grad)

    return step


def time_case(
    width: int,
    depth: int,
    modes: list[str],
    tokens: int,
    warmup: int,
    steps: int,
    device: torch.device,
) -> dict[str, list[float]]:
    """Seconds per step for each mode, the modes taking turns step by step.

    Taking turns spreads any load from other processes over all modes alike, so the ratios
    stay fair even when the absolute times drift.
    """
    step_fns = {mode: make_step(width, depth, mode, tokens, device) for mode in modes}

    for fn in step_fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(steps):
        for mode, fn in step_fns.items():
            times[mode].append(time_call(fn, device))  # CUDA events on a GPU
    return times


def markdown(results: list[dict], machine: dict[str, str], args: argparse.Namespace) -> str:
    lines = [
        f"# fp8 vs bf16, forward+backward ({machine['device']})",
        "",
        "Machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()),
        "",
        f"Command: `{' '.join(['python benchmarks/bench_fp8.py', *args.argv])}`",
        f"tokens per step={args.tokens}, warmup={args.warmup}, timed steps={args.steps} per mode, "
        "modes taking turns; each time is the fastest step (other processes share the cores).",
        "All modes under bf16 autocast with fp32 parameters; ratio = mode time / bf16 time "
        "(below 1 is faster than bf16). "
        f"fp8 forward GEMM use_fast_accum={args.fast_accum == 'on'} (backward: off).",
        "",
        "| model | width | bf16 ms | fp8 ms | fp8 / bf16 | fp8-emulated ms | emulated / bf16 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results:
        ms = {m: row["seconds"].get(m) for m in MODES}
        cells = [f"{ms[m] * 1e3:.1f}" if ms[m] is not None else "n/a" for m in MODES]
        ratios = [f"{ms[m] / ms['bf16']:.2f}" if ms[m] is not None else "n/a" for m in MODES]
        lines.append(
            f"| {row['model']} | {row['width']} | {cells[0]} | {cells[1]} | {ratios[1]} | "
            f"{cells[2]} | {ratios[2]} |"
        )
    if args.scaled_mm_ops is not None:
        ops = ", ".join(args.scaled_mm_ops) or "no aten ops (a fused kernel)"
        lines += ["", f"torch._scaled_mm on this device calls: {ops}."]
        if "aten::matmul" in args.scaled_mm_ops:
            lines.append(
                "That is a reference kernel (upcast, scale, matmul in high precision), so float8 "
                "cannot beat bf16 here: the table measures what the casts and that kernel cost."
            )
    if args.skipped:
        lines += ["", "Not run: " + "; ".join(args.skipped)]
    return "\n".join(lines) + "\n"


def chart(results: list[dict], machine: dict[str, str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a build machine
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in results}, key=lambda m: m != "Linear")
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = [r for r in results if r["model"] == model]
        widths = [str(r["width"]) for r in rows]
        for i, mode in enumerate(("fp8", "fp8-emulated")):
            ratios = [
                r["seconds"][mode] / r["seconds"]["bf16"] if r["seconds"].get(mode) else 0.0
                for r in rows
            ]
            pos = [j + (i - 0.5) * 0.38 for j in range(len(rows))]
            ax.bar(pos, ratios, width=0.38, label=mode)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="bf16 (= 1)")
        ax.set_xticks(range(len(rows)), widths)
        ax.set_xlabel("width")
        ax.set_ylabel("step time / bf16 step time")
        ax.set_title(model)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels))
    fig.suptitle(
        f"fp8 vs bf16 fwd+bwd on {machine.get('gpu', machine['cpu'])}, torch {machine['torch']}",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))  # room for the shared legend below
    fig.savefig(path, dpi=110)
    plt.close(fig)


def recipe_sqnr(recipe: str, tokens: int, width: int) -> dict[str, float]:
    """SQNR (dB) of each quantized operand of the recipe's three GEMMs on N(0, 1) tensors:
    input (tokens, width), weight (width, width) / sqrt(width), grad (tokens, width)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, width, generator=gen)
    w = torch.randn(width, width, generator=gen) / width**0.5
    dy = torch.randn(tokens, width, generator=gen)
    operands = {
        "forward": (x, w),
        "grad_input": (dy, w.t()),
        "grad_weight": (dy.t(), x.t()),
    }
    config = Float8Config(recipe=recipe)
    out = {}
    for gemm, kinds in RECIPE_OPERANDS[recipe].items():
        for name, t, kind, role in zip(
            "AB", operands[gemm], kinds, OPERAND_ROLES[gemm], strict=True
        ):
            if kind != "hp":
                lp = operand_lp_dtype(role, config)
                out[f"{gemm}.{name}"] = operand_stats(t, kind, lp, config)["sqnr_db"]
    return out


def recipe_markdown(rows: list[dict], machine: dict[str, str], args: argparse.Namespace) -> str:
    lines = [
        f"# fp8 recipes: quantization error and emulated cost ({machine['device']})",
        "",
        "Machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()),
        "",
        f"Date (UTC): {args.date}. Command: "
        f"`{' '.join(['python benchmarks/bench_fp8.py', *args.argv])}`",
        f"tokens={args.tokens}, warmup={args.warmup}, timed steps={args.steps} per case, cases "
        "taking turns; each time is the fastest step. SQNR: N(0,1) operands, the worst and "
        "best operand of the recipe's quantized GEMM operands (stochastically rounded ones "
        "measured rounded to nearest, as telemetry does). Every recipe emulated "
        "(quantize, dequantize, fp32 GEMM), tensorwise included: this measures the "
        "quantization's cost on this device, not a float8 kernel.",
        "",
        "| recipe | width | min SQNR dB | max SQNR dB | step ms | / bf16 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        sq = list(row["sqnr_db"].values())
        lines.append(
            f"| {row['recipe']} | {row['width']} | {min(sq):.2f} | {max(sq):.2f} | "
            f"{row['seconds'] * 1e3:.1f} | {row['seconds'] / row['bf16_seconds']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def recipe_chart(rows: list[dict], machine: dict[str, str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = sorted({r["width"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    for i, width in enumerate(widths):
        sub = {r["recipe"]: r for r in rows if r["width"] == width}
        pos = [j + (i - (len(widths) - 1) / 2) * 0.8 / len(widths) for j in range(len(recipes))]
        axes[0].bar(
            pos,
            [min(sub[r]["sqnr_db"].values()) for r in recipes],
            width=0.8 / len(widths),
            label=f"w={width}",
        )
        axes[1].bar(
            pos,
            [sub[r]["seconds"] / sub[r]["bf16_seconds"] for r in recipes],
            width=0.8 / len(widths),
            label=f"w={width}",
        )
    for ax, label in zip(
        axes, ("worst operand SQNR (dB)", "emulated step / bf16 step"), strict=True
    ):
        ax.set_xticks(range(len(recipes)), recipes, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"fp8 recipes on {machine.get('gpu', machine['cpu'])}, torch {machine['torch']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_recipes(args: argparse.Namespace, device: torch.device) -> int:
    """The recipe axis: SQNR and emulated step time per recipe (see the module docstring)."""
    recipes = list(RECIPES) if args.recipes == ["all"] else args.recipes
    machine = machine_description(device)
    args.date = utc_date()
    rows = []
    start = time.perf_counter()
    for width in args.widths:
        modes = ["bf16", *(f"recipe:{r}" for r in recipes)]
        times = time_case(width, 1, modes, args.tokens, args.warmup, args.steps, device)
        for recipe in recipes:
            rows.append(
                {
                    "recipe": recipe,
                    "width": width,
                    "sqnr_db": recipe_sqnr(recipe, args.tokens, width),
                    "seconds": min(times[f"recipe:{recipe}"]),
                    "bf16_seconds": min(times["bf16"]),
                    "all_seconds": times[f"recipe:{recipe}"],
                }
            )
        print(f"w={width} (elapsed {time.perf_counter() - start:.0f} s)", file=sys.stderr)
    record = run_record(machine, args, start, results=rows)
    table = recipe_markdown(rows, machine, args)
    chart_of = functools.partial(recipe_chart, rows, machine)
    return publish(args, f"fp8_recipes_{device.type}", table, record, chart_of)


# ----- the training axis: the stdlib-text GPT per recipe vs bf16 vs fp32 -----
TRAIN_BASELINES = ("fp32", "bf16")
"""The modes trained over several seeds (the seed-to-seed spread); recipes train seed 0."""
KEEP_HEAD = {"head": "keep"}
"""per_module_recipes rule of the training axis: the output head stays in bf16 (torchao's
recipes skip it; Megatron keeps the last layer in bf16); every block's Linear converts."""


def build_gpt(mode: str, seed: int, args: argparse.Namespace, device: torch.device) -> tuple:
    """The GPT of the training axis in `mode` ('fp32', 'bf16' or a recipe name), prepared by
    the core (prepare_model / prepare_optimizer: bf16 autocast and fp32 masters but in fp32),
    from the init of torch.manual_seed(seed): the same weights in every mode."""
    torch.manual_seed(seed)
    model = GPT(args.train_width, args.train_depth, args.train_heads, args.train_context)
    model = model.to(device)
    if mode in TRAIN_BASELINES:
        policy = to_policy(mode)
        prepared = prepare_model(model, policy)
    else:
        policy = to_policy("fp8")
        config = recipe_config(mode, emulate_tensorwise=device.type == "cpu")
        keep_head = per_module_recipes(model, KEEP_HEAD, config=config, keep_first_last=False)
        prepared = prepare_model(model, policy, fp8_filter=keep_head, fp8_config=config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.train_lr, weight_decay=0.1)
    return prepared, prepare_optimizer(opt, policy)


def train_run(
    mode: str, seed: int, args: argparse.Namespace, text: tuple, device: torch.device, bar: Any
) -> dict[str, Any]:
    """One training run: its per-step training loss, validation loss every --eval-every steps
    (the fixed windows of gpt_val_loss; no gradient, so nvfp4 draws nothing) and at the end."""
    train, val = (t.to(device) for t in text)
    model, opt = build_gpt(mode, seed, args, device)
    losses: list[float] = []
    curve: list[tuple[int, float]] = []

    def on_step(step: int, loss: float) -> None:
        losses.append(round(loss, 5))
        if (step + 1) % args.eval_every == 0 and step + 1 < args.train_steps:
            curve.append((step + 1, gpt_val_loss(model, val, args.train_context)))
        bar.update(1)

    start = time.perf_counter()
    train_gpt(
        model,
        opt,
        train,
        steps=args.train_steps,
        batch=args.train_batch,
        context=args.train_context,
        lr=args.train_lr,
        seed=seed,
        on_step=on_step,
    )
    val_loss = gpt_val_loss(model, val, args.train_context)
    curve.append((args.train_steps, val_loss))
    return {
        "mode": mode,
        "seed": seed,
        "val_loss": val_loss,
        "val_curve": curve,
        "train_loss": losses,
        "skipped_steps": opt.skipped_steps,
        "converted": list(fp8_summary(model.module).converted)
        if mode not in TRAIN_BASELINES
        else [],
        "seconds": round(time.perf_counter() - start, 1),
    }


def spread(runs: list[dict]) -> tuple[float, float]:
    vals = [r["val_loss"] for r in runs]
    return min(vals), max(vals)


def train_verdicts(record: dict) -> list[dict[str, Any]]:
    """Per mode and seed: val loss, gap to bf16 on the same seed (same init and batches), and
    where it lies against fp32's seed spread ('inside', or the distance above or below it)."""
    runs = record["runs"]
    lo, hi = spread([r for r in runs if r["mode"] == "fp32"])
    bf16 = {r["seed"]: r["val_loss"] for r in runs if r["mode"] == "bf16"}
    rows = []
    for r in runs:
        v = r["val_loss"]
        gap = v - bf16[r["seed"]] if r["seed"] in bf16 and r["mode"] != "bf16" else None
        where = (
            "inside"
            if lo <= v <= hi
            else f"{v - hi:+.4f} above"
            if v > hi
            else f"{v - lo:+.4f} below"
        )
        rows.append(
            {
                **{k: r[k] for k in ("mode", "seed", "val_loss")},
                "gap_to_bf16": gap,
                "vs_fp32_spread": where,
            }
        )
    return rows


def train_markdown(record: dict) -> str:
    a, machine = record["args"], record["machine"]
    runs = record["runs"]
    lo, hi = spread([r for r in runs if r["mode"] == "fp32"])
    blo, bhi = spread([r for r in runs if r["mode"] == "bf16"])
    n_params = record["params"]
    lines = [
        f"# fp8 recipes: training the stdlib-text GPT ({machine['device']})",
        "",
        "Machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()),
        "",
        f"Date (UTC): {record['date']}. Command: "
        f"`{' '.join(['python benchmarks/bench_fp8.py', *record['argv']])}` "
        f"({record['total_seconds']:.0f} s).",
        "",
        f"Byte-level GPT (mixprec.bench.gpt): width {a['train_width']}, depth {a['train_depth']}, "
        f"{a['train_heads']} heads, context {a['train_context']}, {n_params / 1e6:.2f}M parameters; "
        f"{a['train_steps']} AdamW steps (weight decay 0.1, lr {a['train_lr']}, 20 warmup steps "
        f"then cosine to 0) of {a['train_batch']} x {a['train_context']} bytes of the Python "
        "standard library's source; validation loss over 8 x 32 fixed windows of the held-out "
        "last 10 %. fp32 and bf16 over seeds "
        f"{', '.join(map(str, range(a['seeds'])))} (a seed sets the init and the batch order); "
        "each recipe on seed 0: the same init and batches as fp32 and bf16 seed 0. Recipes run "
        "under bf16 autocast with fp32 masters (mode 'fp8'), every block's Linear layers "
        f"converted ({record['converted']} layers), the output head kept in bf16"
        + (
            ", every recipe emulated on CPU (quantize, dequantize, fp32 GEMM)."
            if machine["device"] == "cpu"
            else "."
        )
        + " Gap to bf16: the run minus bf16 on the same seed (the change the recipe's "
        "quantization makes). fp32 spread: fp32's lowest to highest validation loss over its "
        "seeds; 'inside' when a run lies within it, else its distance past the nearer end.",
        "",
        f"fp32 seed spread: {lo:.4f} - {hi:.4f} (width {hi - lo:.4f}); bf16 seed spread: "
        f"{blo:.4f} - {bhi:.4f} (width {bhi - blo:.4f}).",
        "",
        "| mode | seed | val loss | gap to bf16 (same seed) | vs fp32 seed spread |",
        "|---|---:|---:|---:|---|",
    ]
    for row in train_verdicts(record):
        gap = "" if row["gap_to_bf16"] is None else f"{row['gap_to_bf16']:+.4f}"
        lines.append(
            f"| {row['mode']} | {row['seed']} | {row['val_loss']:.4f} | {gap} | {row['vs_fp32_spread']} |"
        )
    return "\n".join(lines) + "\n"


def train_chart(record: dict, path: Path) -> None:
    """Validation-loss curves per run (fp32 and bf16 seeds thin, recipes on seed 0), the
    final validation loss per mode over the fp32 and bf16 seed spreads, and each recipe's
    training loss minus bf16's on the same batches (a 25-step moving mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = record["runs"]
    fig, (ax_c, ax_d, ax_f) = plt.subplots(1, 3, figsize=(16, 4.6))
    recipes = [r["mode"] for r in runs if r["mode"] not in TRAIN_BASELINES]
    colors = {m: f"C{i}" for i, m in enumerate(recipes)}
    for r in runs:
        steps, vals = zip(*r["val_curve"], strict=True)
        if r["mode"] in TRAIN_BASELINES:
            style = {"color": "grey" if r["mode"] == "fp32" else "black", "linewidth": 0.8}
            label = r["mode"] if r["seed"] == 0 else None
        else:
            style, label = {"color": colors[r["mode"]], "linewidth": 1.2}, r["mode"]
        ax_c.plot(steps, vals, label=label, **style)
    ax_c.set_xlabel("step")
    ax_c.set_ylabel("validation loss")
    ax_c.set_ylim(top=min(r["val_curve"][0][1] for r in runs) * 1.05)
    ax_c.legend(fontsize=7)
    ax_c.set_title(
        "validation loss (recipes and seed 0 of fp32 / bf16 share init and batches)", fontsize=8
    )

    bf16 = next(r for r in runs if r["mode"] == "bf16" and r["seed"] == 0)["train_loss"]
    window = 25
    for r in runs:
        if r["mode"] in TRAIN_BASELINES and not (r["mode"] == "fp32" and r["seed"] == 0):
            continue
        diff = torch.tensor(r["train_loss"]) - torch.tensor(bf16)
        smooth = diff.unfold(0, window, 1).mean(1) if len(diff) >= window else diff
        color = "grey" if r["mode"] == "fp32" else colors[r["mode"]]
        ax_d.plot(
            range(len(diff) - len(smooth), len(diff)),
            smooth.tolist(),
            color=color,
            label=r["mode"],
            linewidth=1,
        )
    ax_d.axhline(0, color="black", linewidth=0.8)
    ax_d.set_xlabel("step")
    ax_d.set_ylabel(f"training loss - bf16's ({window}-step mean)")
    ax_d.legend(fontsize=7)
    ax_d.set_title("training loss vs bf16, seed 0 (same batches)", fontsize=8)

    modes = list(dict.fromkeys(r["mode"] for r in runs))
    for mode, color, alpha in (("fp32", "grey", 0.3), ("bf16", "black", 0.12)):
        lo, hi = spread([r for r in runs if r["mode"] == mode])
        ax_f.axhspan(lo, hi, color=color, alpha=alpha, label=f"{mode} seed spread")
    for i, mode in enumerate(modes):
        vals = [r["val_loss"] for r in runs if r["mode"] == mode]
        ax_f.scatter([i] * len(vals), vals, zorder=3, color=colors.get(mode, "black"), s=14)
    ax_f.set_xticks(range(len(modes)), modes, rotation=30, ha="right", fontsize=8)
    ax_f.set_ylabel("final validation loss")
    ax_f.legend(fontsize=7)
    m = record["machine"]
    fig.suptitle(
        f"fp8 recipes training the stdlib-text GPT, {m.get('gpu', m['cpu'])}, torch {m['torch']}, "
        f"{record['date']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_train(args: argparse.Namespace, device: torch.device) -> int:
    """The training axis (see the module docstring)."""
    recipes = list(RECIPES) if args.recipes in (None, ["all"]) else args.recipes
    plan = [(m, s) for m in TRAIN_BASELINES for s in range(args.seeds)] + [(r, 0) for r in recipes]
    machine = machine_description(device)
    date = utc_date()
    text = stdlib_text(args.text_bytes)
    start = time.perf_counter()
    runs = []
    with progress_bar(
        total=len(plan) * args.train_steps, enabled=not args.no_progress, desc="bench_fp8 --train"
    ) as bar:
        for mode, seed in plan:
            bar.set_postfix_str(f"{mode} seed {seed}")
            runs.append(train_run(mode, seed, args, text, device, bar))
    gpt = GPT(args.train_width, args.train_depth, args.train_heads, args.train_context)
    record = run_record(
        machine,
        args,
        start,
        date=date,
        argv=args.argv,
        params=sum(p.numel() for p in gpt.parameters()),
        converted=max((len(r["converted"]) for r in runs), default=0),
        runs=runs,
    )
    record["verdicts"] = train_verdicts(record)
    table = train_markdown(record)
    chart_of = functools.partial(train_chart, record)
    return publish(args, f"fp8_train_{device.type}", table, record, chart_of)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument(
        "--mlp-max-width",
        type=int,
        default=4096,
        help="largest width for the 9-layer net (default 4096: at 8192 one fp8 step takes "
        "~20 s on a 2-core CPU; pass 8192 to include it)",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per case (median)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128, help="rows of the input per step")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (default: torch's). On cores shared with other processes, "
        "1 avoids OpenMP threads waiting on each other at every op's barrier",
    )
    parser.add_argument(
        "--fast-accum",
        choices=("on", "off"),
        default="on",
        help="the fp8 forward GEMM's use_fast_accum (default on, torchao's); 'off' writes "
        "fp8_exact_accum_<device>.*",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for md/json/png (default: a new runs/bench_fp8-<UTC time>/; "
        "benchmarks/results/ holds the references, rewritten only when named here)",
    )
    parser.add_argument(
        "--recipes",
        nargs="+",
        default=None,
        choices=[*RECIPES, "all"],
        help="the recipe axis instead of the mode sweep: SQNR and emulated step time per "
        "Float8Config recipe ('all': every recipe)",
    )
    train = parser.add_argument_group("the training axis (--train)")
    train.add_argument(
        "--train",
        action="store_true",
        help="train the stdlib-text GPT in fp32, bf16 and each recipe (--recipes, default all): "
        "final validation loss vs bf16 and the fp32 seed spread",
    )
    train.add_argument("--train-width", type=int, default=128)
    train.add_argument("--train-depth", type=int, default=2)
    train.add_argument("--train-heads", type=int, default=4)
    train.add_argument("--train-context", type=int, default=64)
    train.add_argument("--train-batch", type=int, default=16, help="windows per step")
    train.add_argument("--train-steps", type=int, default=500)
    train.add_argument("--train-lr", type=float, default=2e-3, help="peak learning rate")
    train.add_argument("--seeds", type=int, default=4, help="fp32 and bf16 seeds (the spread)")
    train.add_argument("--eval-every", type=int, default=50, help="steps between validations")
    train.add_argument(
        "--text-bytes", type=int, default=1_200_000, help="bytes of stdlib source (90 %% train)"
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    args.argv, args.skipped = argv, []
    bad = [w for w in args.widths if w % 16]
    if bad:
        parser.error(f"--widths {bad} are not multiples of 16 (float8 GEMM alignment).")
    if "bf16" not in args.modes:
        parser.error("--modes must include bf16: every ratio is to bf16.")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    global FAST_ACCUM
    FAST_ACCUM = args.fast_accum == "on"
    device = torch.device(args.device)
    sweep_only = ("widths", "mlp_max_width", "steps", "warmup", "tokens", "modes", "fast_accum")
    train_only = (
        "train_width", "train_depth", "train_heads", "train_context", "train_batch",
        "train_steps", "train_lr", "seeds", "eval_every", "text_bytes", "no_progress",
    )  # fmt: skip

    def changed(dests: Iterable[str]) -> list[str]:
        return [
            f"--{d.replace('_', '-')}" for d in dests if getattr(args, d) != parser.get_default(d)
        ]

    if args.train:
        if changed(sweep_only):
            parser.error(
                f"{changed(sweep_only)} time the Linear sweeps; --train does not read them."
            )
        sizes = {k: getattr(args, k) for k in train_only if k not in ("no_progress",)}
        bad = {k: v for k, v in sizes.items() if v <= 0}
        if bad or args.seeds < 2:
            parser.error(
                f"--train needs positive sizes and --seeds >= 2 (a spread), got {bad or {'seeds': args.seeds}}."
            )
        return run_train(args, device)
    if changed(train_only):
        parser.error(f"{changed(train_only)} set the training axis: add --train.")
    if args.recipes is not None:
        return run_recipes(args, device)
    modes = list(args.modes)
    problem = fp8_kernel_problem(device)
    args.scaled_mm_ops = None if problem else scaled_mm_ops(device)
    if problem and "fp8" in modes:
        modes.remove("fp8")
        args.skipped.append(f"fp8 ({problem})")
    machine = machine_description(device)
    cases = [("Linear", w, 1) for w in args.widths]
    cases += [
        (f"{MLP_DEPTH}x Linear", w, MLP_DEPTH) for w in args.widths if w <= args.mlp_max_width
    ]
    args.skipped += [
        f"{MLP_DEPTH}x Linear at width {w} (--mlp-max-width {args.mlp_max_width})"
        for w in args.widths
        if w > args.mlp_max_width
    ]
    results = []
    start = time.perf_counter()
    for model, width, depth in cases:
        times = time_case(width, depth, modes, args.tokens, args.warmup, args.steps, device)
        # The minimum: on shared cores it is the step least disturbed by other processes.
        seconds = {mode: min(ts) for mode, ts in times.items()}
        print(
            f"{model:>11} w={width:<5} "
            + "  ".join(f"{mode} {sec * 1e3:.1f} ms" for mode, sec in seconds.items())
            + f"  (elapsed {time.perf_counter() - start:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        results.append(
            {
                "model": model,
                "width": width,
                "depth": depth,
                "seconds": seconds,
                "all_seconds": times,
            }
        )
    record = run_record(machine, args, start, results=results)
    table = markdown(results, machine, args)
    stem = f"fp8{'' if FAST_ACCUM else '_exact_accum'}_{device.type}"
    return publish(args, stem, table, record, functools.partial(chart, results, machine))


if __name__ == "__main__":
    raise SystemExit(main())
