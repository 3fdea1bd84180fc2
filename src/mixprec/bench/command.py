"""`mixprec bench`: its options and its run function (mounted by mixprec.cli's COMMANDS)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from mixprec.bench.models import MODEL_NAMES, PRESETS
from mixprec.bench.modes import ALIASES, BENCH_MODES, DTYPE_KEYS, dtype_name, parse_modes
from mixprec.bench.runner import DEVICES, BenchConfig

RUNS_DIR = Path("runs")
"""Where every benchmark and example writes by default (git-ignored): a fresh
runs/<name>-<UTC time>/ per run, so no run overwrites an earlier one or the repository's
committed reference results (benchmarks/results/, written only when --out names it)."""
OUT_PREFIX = "bench-"
"""`mixprec bench`'s default --out: runs/bench-<UTC time>/."""
NO_MATPLOTLIB_NOTE = (
    "(no PNG chart: matplotlib is not installed; `pip install 'mixprec[bench]'` adds it)"
)


def fresh_out_dir(name: str = "bench", parent: Path | str = RUNS_DIR) -> Path:
    """A directory under `parent` that does not exist yet: <name>-<UTC time>[-N] (not created)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = Path(parent) / f"{name}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = Path(parent) / f"{name}-{stamp}-{n}"
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
    parser.add_argument(
        "--steps", type=_positive, default=10, help="timed steps per mode per round (default: 10)"
    )
    parser.add_argument(
        "--rounds",
        type=_positive,
        default=7,
        help="rounds; each runs every mode's timed steps in turn, so all modes share the "
        "machine's load; speedups are the median over rounds, with their min-max (default: 7)",
    )
    parser.add_argument(
        "--warmup",
        type=_non_negative,
        default=2,
        help="untimed steps before a mode's first round (default: 2)",
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
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a mode may take to start or to run one round before it is stopped",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"directory for bench_<model>_<device>.md/.json/.png (default: a new "
        f"./{RUNS_DIR}/{OUT_PREFIX}<UTC time> directory; the PNG needs matplotlib)",
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
        rounds=args.rounds,
        warmup=args.warmup,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        timeout_s=args.timeout,
    )


def _stop_on_sigterm(signum: int, frame: object) -> None:
    from mixprec.bench.runner import BenchInterrupted

    raise BenchInterrupted("SIGTERM")


def bench_command(args: argparse.Namespace) -> int:
    """Run the bench, print the table, write md/json/png; 1 if a mode failed, 2 on bad input.

    Ctrl-C (SIGINT) or SIGTERM stops the workers and still writes the rounds measured so far;
    the exit status is then 128 + the signal's number.
    """
    # Python ignores SIGINT when it starts with SIGINT ignored (a background job of a
    # non-interactive shell): take both signals back, so either one stops the run.
    old = {sig: signal.signal(sig, handler) for sig, handler in HANDLERS.items()}
    try:
        return _bench(args)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


HANDLERS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: _stop_on_sigterm}
"""The handlers `mixprec bench` runs under (the caller's come back afterwards)."""


def _bench(args: argparse.Namespace) -> int:
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
    except KeyboardInterrupt:  # before the first worker started: nothing measured to write
        print("mixprec bench: interrupted before any mode ran", file=sys.stderr)
        return 128 + signal.SIGINT
    report.gemm_speed = gemm_speed
    print(gemm_speed)
    print(render_table(report))
    if report.busy:
        print(f"(busy machine: load average {report.load_start:.1f} on {report.cpus} cores)")
    paths = write_report(report, args.out if args.out is not None else fresh_out_dir())
    print(f"wrote {', '.join(str(p) for p in paths.values())} ({report.wall_s:.0f} s)")
    if "png" not in paths:
        print(NO_MATPLOTLIB_NOTE)
    if report.interrupted:
        print(f"mixprec bench: {report.interrupted}; partial results written", file=sys.stderr)
        sig = signal.SIGTERM if report.interrupted.startswith("SIGTERM") else signal.SIGINT
        return 128 + sig
    return 1 if any(r.status == "failed" for r in report.results) else 0
