"""`mixprec bench`: its options and its run function (mounted by mixprec.cli's COMMANDS)."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from mixprec.bench.models import MODEL_NAMES, PRESETS
from mixprec.bench.modes import ALIASES, BENCH_MODES, DTYPE_KEYS, dtype_name, parse_modes
from mixprec.bench.runner import DEVICES, BenchConfig

OUT_PREFIX = "mixprec-bench-"
"""Default --out: a fresh ./mixprec-bench-<UTC time> directory, so no run overwrites earlier
results or the repository's committed reference results (benchmarks/results/)."""
NO_MATPLOTLIB_NOTE = (
    "(no PNG chart: matplotlib is not installed; `pip install 'mixprec[bench]'` adds it)"
)


def fresh_out_dir(parent: Path | str = ".") -> Path:
    """A directory name under `parent` that does not exist yet: mixprec-bench-<UTC time>[-N]."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = Path(parent) / f"{OUT_PREFIX}{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = Path(parent) / f"{OUT_PREFIX}{stamp}-{n}"
    return path


def _modes(text: str) -> tuple[str, ...]:
    try:
        return parse_modes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _dtype(text: str) -> str:
    try:
        return dtype_name(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be an int >= 1.")
    return int(text)


def _non_negative(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} must be an int >= 0.")
    return int(text)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """`mixprec bench`'s options."""
    presets = "; ".join(
        f"{name}: width {p.width}, depth {p.depth}, batch {p.batch}" for name, p in PRESETS.items()
    )
    parser.add_argument(
        "--model",
        choices=MODEL_NAMES,
        default="mlp",
        help=f"seed 002's 9xLinear MLP, a ViT-B/16-shaped transformer or a ResNet-shaped CNN "
        f"(defaults: {presets})",
    )
    parser.add_argument("--width", type=_positive, help="mlp features / vit dim / resnet channels")
    parser.add_argument("--depth", type=_positive, help="mlp layers / vit blocks / resnet blocks")
    parser.add_argument("--batch", type=_positive, help="samples per step")
    parser.add_argument(
        "--image-size", type=_positive, help="vit/resnet: side of the synthetic images (32)"
    )
    parser.add_argument("--patch-size", type=_positive, help="vit: side of a patch (4)")
    parser.add_argument("--heads", type=_positive, help="vit: attention heads")
    parser.add_argument("--lr", type=float, help="SGD learning rate (default: the preset's)")
    parser.add_argument("--steps", type=_positive, default=10, help="timed steps (default: 10)")
    parser.add_argument(
        "--warmup", type=_non_negative, default=2, help="untimed steps first (default: 2)"
    )
    parser.add_argument(
        "--modes",
        type=_modes,
        default=None,
        help=f"comma-separated subset of {', '.join(BENCH_MODES)} (aliases: "
        f"{', '.join(ALIASES)}), or 'all'. fp32 always runs as the baseline. Named modes run "
        "all their steps, and one the device cannot run is an error (default: every mode the "
        "device runs; fp16 on a CPU without fp16 kernels gets fewer steps)",
    )
    parser.add_argument(
        "--dtype",
        type=_dtype,
        default=None,
        help=f"low dtype (float16/bfloat16) of the modes that take one: {', '.join(DTYPE_KEYS)}",
    )
    parser.add_argument("--device", choices=DEVICES, default="auto", help="default: auto")
    parser.add_argument("--seed", type=_non_negative, default=0, help="data and init seed")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per mode before it is stopped"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"directory for bench_<model>_<device>.md/.json/.png (default: a new "
        f"./{OUT_PREFIX}<UTC time> directory; the PNG needs matplotlib)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Parsed options -> BenchConfig (the preset, with the sizes given overriding it)."""
    keys = ("width", "depth", "batch", "lr", "image_size", "patch_size", "heads")
    sizes = {k: getattr(args, k) for k in keys}
    model = replace(PRESETS[args.model], **{k: v for k, v in sizes.items() if v is not None})
    return BenchConfig(
        model=model,
        modes=args.modes or BENCH_MODES,
        forced=args.modes is not None,
        steps=args.steps,
        warmup=args.warmup,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        timeout_s=args.timeout,
    )


def bench_command(args: argparse.Namespace) -> int:
    """Run the bench, print the table, write md/json/png; 1 if a mode failed, 2 on bad input."""
    from mixprec.bench.report import render_table, write_report
    from mixprec.bench.runner import resolve_device, run_bench
    from mixprec.debugging.gemm_speed import measure_gemm_speed

    try:
        config = config_from_args(args)
        # ~1 s before the workers start: what a bf16/fp16 GEMM is worth here, vs fp32
        gemm_speed = measure_gemm_speed(resolve_device(config.device)).line()
        report = run_bench(config, progress=not args.no_progress)
    except ValueError as err:
        print(f"mixprec bench: error: {err}", file=sys.stderr)
        return 2
    report.gemm_speed = gemm_speed
    print(gemm_speed)
    print(render_table(report))
    if report.busy:
        print(f"(busy machine: load average {report.load_start:.1f} on {report.cpus} cores)")
    paths = write_report(report, args.out if args.out is not None else fresh_out_dir())
    print(f"wrote {', '.join(str(p) for p in paths.values())} ({report.wall_s:.0f} s)")
    if "png" not in paths:
        print(NO_MATPLOTLIB_NOTE)
    return 1 if any(r.status == "failed" for r in report.results) else 0
