"""`mixprec doctor`: the hardware report, or a model's precision report (the CLI mounts these)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.debugging.gemm_speed import default_gemm_device, measure_gemm_speed
from mixprec.debugging.hardware import findings_table, hardware_report
from mixprec.debugging.model_report import model_report
from mixprec.policy import LOW_DTYPES, PRESETS, preset


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
