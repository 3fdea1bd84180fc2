"""`mixprec doctor`: the hardware report, or a model's precision report (the CLI mounts these)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.core.hardware import (
    Finding,
    cpu_findings,
    cuda_findings,
    fp8_finding,
    read_cpu_flags,
)
from mixprec.core.policy import LOW_DTYPES, PRESETS, preset
from mixprec.debugging._markdown import markdown_table
from mixprec.debugging.gemm_speed import default_gemm_device, measure_gemm_speed
from mixprec.debugging.model_report import model_report
from mixprec.fp8 import RECIPES, fp8_kernel_problem  # probes the CPU kernel once, when called


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    """Add doctor's options to `parser` (a `mixprec doctor` subparser)."""
    parser.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        default=None,
        help="import FACTORY from MODULE, call it with no arguments and report on the model",
    )
    parser.add_argument(
        "--mode",
        default="bf16",
        choices=list(PRESETS),
        help="precision mode whose Policy the model report applies (default: bf16)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=sorted(LOW_DTYPES),
        help="low-precision dtype of the mode (default: the mode's own)",
    )
    parser.add_argument(
        "--input-shape",
        metavar="D0,D1,...",
        default=None,
        help="run one forward on a random float32 input of this shape and report real dtypes",
    )
    parser.add_argument(
        "--fp8-report",
        action="store_true",
        help="train a small built-in model a few steps under each fp8 recipe with "
        "Float8Telemetry attached; print each recipe's operands ranked worst SQNR first and "
        "write them as a markdown table and a PNG (needs matplotlib) into --out",
    )
    parser.add_argument(
        "--recipes",
        metavar="R1,R2,...",
        default=None,
        help=f"the fp8 report's recipes (default: all: {','.join(RECIPES)})",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="the fp8 report's training steps (default: 3)"
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="the fp8 report's folder: must be new or empty (default: a fresh "
        "mixprec-fp8-report-* folder in the working directory)",
    )


def load_factory(spec: str) -> Callable[[], Any]:
    """'pkg.module:factory' (or 'pkg.module:Class.method') -> that callable; imports only it."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"--model {spec!r} must look like 'package.module:factory'.")
    # A console script does not put the working directory on sys.path; `python -m` does.
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--model {spec!r}: cannot import {module_name!r} ({err}).") from err
    finally:
        if added:
            sys.path.remove(os.getcwd())
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_"))
            raise ValueError(f"--model {spec!r}: {obj!r} has no {part!r}. It has: {public}.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"--model {spec!r} names {obj!r}, which is not callable.")
    return obj


def parse_shape(text: str) -> tuple[int, ...]:
    """'8,30' -> (8, 30)."""
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"--input-shape {text!r} must be positive integers joined by commas.")
    return shape


def run_doctor(args: argparse.Namespace) -> int:
    """Print the hardware report (no --model) or the model report; 0 on success, 2 on bad input.

    Errors in the options print one line and return 2; errors raised by the user's factory or
    model propagate with their traceback.
    """
    report_only = {"--recipes": args.recipes, "--steps": args.steps, "--out": args.out}
    given = [name for name, value in report_only.items() if value is not None]
    clash = [
        name
        for name, value in (("--model", args.model), ("--input-shape", args.input_shape))
        if value is not None
    ]
    if (given and not args.fp8_report) or (args.fp8_report and clash):
        names = ", ".join(clash if args.fp8_report else given)
        print(
            f"mixprec doctor: error: {names} "
            + (
                "do(es) not apply to --fp8-report (it trains its built-in model)."
                if args.fp8_report
                else "apply only with --fp8-report."
            ),
            file=sys.stderr,
        )
        return 2
    if args.fp8_report:
        return run_fp8_report(args)
    if args.model is None:
        print(findings_table(hardware_report()))
        print(measure_gemm_speed(default_gemm_device()).line())  # flags alone do not tell
        return 0
    try:
        policy = preset(args.mode, dtype=args.dtype)
        factory = load_factory(args.model)
        shape = None if args.input_shape is None else parse_shape(args.input_shape)
    except (ValueError, TypeError) as err:
        print(f"mixprec doctor: error: {err}", file=sys.stderr)
        return 2
    model = factory()
    if not isinstance(model, nn.Module):
        print(
            f"mixprec doctor: error: --model {args.model!r} returned {type(model).__name__}, "
            "not a torch.nn.Module.",
            file=sys.stderr,
        )
        return 2
    example = None if shape is None else torch.randn(shape)
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    print(model_report(model, policy, example, gpu_capability=capability).table())
    return 0


def run_fp8_report(args: argparse.Namespace) -> int:
    """`mixprec doctor --fp8-report`: recipe_telemetry's tables printed, then written."""
    from mixprec.debugging.fp8_report import recipe_telemetry, report_markdown, write_report

    text = ",".join(RECIPES) if args.recipes is None else args.recipes
    steps = 3 if args.steps is None else args.steps
    recipes = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in recipes if r not in RECIPES]
    if bad or not recipes or steps < 1:
        what = f"--recipes {text!r}" if bad or not recipes else f"--steps {steps}"
        print(
            f"mixprec doctor: error: {what}: recipes are a comma-separated subset of "
            f"{', '.join(RECIPES)}; steps a positive int.",
            file=sys.stderr,
        )
        return 2
    sections = recipe_telemetry(recipes, steps=steps)
    for recipe, telemetry in sections:
        print(f"## {recipe}\n\n{report_markdown(telemetry)}\n")
    try:
        folder = write_report(sections, args.out)
    except (ImportError, FileExistsError) as err:
        print(f"mixprec doctor: error: {err}", file=sys.stderr)
        return 2
    print(f"written: {folder / 'fp8_telemetry.md'}, {folder / 'fp8_sqnr.png'}")
    return 0


def findings_table(findings: Sequence[Finding]) -> str:
    """The findings as a markdown table."""
    rows = [[f.device, f.dtype or "-", f.level, f.message] for f in findings]
    return markdown_table(["device", "dtype", "level", "finding"], rows)


def hardware_report() -> list[Finding]:
    """Findings for this machine: every visible CUDA device, then the CPU; fp8 for each."""
    findings: list[Finding] = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            device = f"cuda:{index}"
            name = torch.cuda.get_device_name(index)
            if torch.version.hip is not None:  # ROCm numbers its archs differently (gfx9xx)
                message = f"{name}: ROCm device; NVIDIA capability checks skipped."
                findings.append(Finding(device=device, dtype="", level="info", message=message))
                continue
            capability = torch.cuda.get_device_capability(index)
            findings.extend(cuda_findings(name, capability, device=device))
            findings.append(fp8_finding(device, fp8_kernel_problem(device)))
    else:
        message = "No CUDA device visible: training runs on the CPU."
        findings.append(Finding(device="cuda", dtype="", level="info", message=message))
    mkldnn_bf16 = None
    if torch.backends.mkldnn.is_available():
        mkldnn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    findings.extend(
        cpu_findings(
            read_cpu_flags(),
            cpu_capability=torch.backends.cpu.get_cpu_capability(),
            mkldnn_bf16=mkldnn_bf16,
        )
    )
    findings.append(fp8_finding("cpu", fp8_kernel_problem("cpu")))
    return findings
