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

    python benchmarks/bench_fp8.py                              # the default sweep (< 3 min)
    python benchmarks/bench_fp8.py --widths 1024 2048 --steps 5
    python benchmarks/bench_fp8.py --recipes all --widths 1024   # the recipe axis
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from mixprec.bench.command import fresh_out_dir
from mixprec.bench.report import write_record
from mixprec.bench.runner import cpu_model
from mixprec.bench.timing import time_call
from mixprec.fp8 import (
    RECIPE_OPERANDS,
    RECIPES,
    Float8Config,
    convert_to_fp8,
    fp8_kernel_problem,
    fp8_summary,
    operand_stats,
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


def build(width: int, depth: int, mode: str, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).to(device)
    if mode.startswith("recipe:"):  # the recipe axis: every recipe emulated
        recipe = mode.removeprefix("recipe:")
        config = Float8Config(recipe=recipe, emulate=True if recipe == "tensorwise" else None)
        model = convert_to_fp8(model, config=config)
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
        f"Command: `{' '.join(['python benchmarks/bench_fp8.py', *args.argv])}`",
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
    table = recipe_markdown(rows, machine, args)
    print(table)
    if not args.no_write:
        payload = {
            "machine": machine,
            "args": {k: v for k, v in vars(args).items() if k not in ("argv",)},
            "total_seconds": round(time.perf_counter() - start, 1),
            "results": rows,
        }
        paths = write_record(
            args.out or fresh_out_dir("bench_fp8"),
            f"fp8_recipes_{device.type}",
            table,
            payload,
            lambda png: recipe_chart(rows, machine, png),
        )
        print("wrote " + ", ".join(map(str, paths.values())), file=sys.stderr)
    return 0


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
    if hasattr(os, "getloadavg"):
        machine["load_avg_1min_at_end"] = f"{os.getloadavg()[0]:.2f}"
    table = markdown(results, machine, args)
    print(table)
    if not args.no_write:
        payload = {
            "machine": machine,
            "args": {k: v for k, v in vars(args).items() if k not in ("argv",)},
            "total_seconds": round(time.perf_counter() - start, 1),
            "results": results,
        }
        paths = write_record(
            args.out or fresh_out_dir("bench_fp8"),
            f"fp8{'' if FAST_ACCUM else '_exact_accum'}_{device.type}",
            table,
            payload,
            lambda png: chart(results, machine, png),
        )
        print("wrote " + ", ".join(map(str, paths.values())), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
