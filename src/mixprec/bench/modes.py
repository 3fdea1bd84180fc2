"""The benchmark's mode vocabulary and how each mode reaches `mixprec.convert_to_amp`.

A bench mode is a name in BENCH_MODES; `amp_args(mode, dtype)` gives the (mode, amp_config)
pair convert_to_amp takes, so every mode runs through mixprec's own Colossal-AI face.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, get_args

import torch

from mixprec.amp_type import AMP_TYPE
from mixprec.core.policy import Policy, did_you_mean, to_low_dtype, to_policy

BenchMode = Literal["fp32", "fp16", "bf16", "fp16_naive", "O1", "O2", "O3", "fp8"]
BENCH_MODES: tuple[str, ...] = get_args(BenchMode)
"""Every mode `mixprec bench` knows, in table order; fp32 is the baseline."""
BASELINE = "fp32"

ALIASES: dict[str, str] = {
    "torch": "fp16",
    "naive": "fp16_naive",
    "apex": "O1",
    "fp16_apex": "O1",
}
"""Colossal-AI's AMP_TYPE values (and mixprec's 'fp16_apex', Apex's default O1) -> bench mode."""

AMP_CALLS: dict[str, tuple[AMP_TYPE | str, dict[str, Any]]] = {
    "fp32": ("fp32", {}),
    "fp16": (AMP_TYPE.TORCH, {}),
    "bf16": ("bf16", {}),
    "fp16_naive": (AMP_TYPE.NAIVE, {}),
    "O1": (AMP_TYPE.APEX, {"opt_level": "O1"}),
    "O2": (AMP_TYPE.APEX, {"opt_level": "O2"}),
    "O3": (AMP_TYPE.APEX, {"opt_level": "O3"}),
    "fp8": ("fp8", {}),
}
"""bench mode -> convert_to_amp's (mode, amp_config) before any --dtype."""

DTYPE_KEYS: dict[str, str] = {
    "fp16": "dtype",
    "fp16_naive": "dtype",
    "O2": "cast_model_type",
    "O3": "cast_model_type",
}
"""The modes --dtype applies to, and the amp_config key that carries it. The others have a
fixed dtype: fp32 none, bf16 bfloat16, fp8 float8 GEMMs over bf16, and Apex's O1 patches
functions to fp16 (it refuses cast_model_type)."""


def parse_modes(text: str | Iterable[str]) -> tuple[str, ...]:
    """'fp32,bf16' (or a list) -> canonical bench modes, in BENCH_MODES order; 'all' = every one."""
    items = text.split(",") if isinstance(text, str) else list(text)
    names = [str(item).strip() for item in items if str(item).strip()]
    if not names:
        raise ValueError(f"No mode given in {text!r}." + did_you_mean("", BENCH_MODES))
    if names == ["all"]:
        return BENCH_MODES
    chosen = set()
    for name in names:
        mode = ALIASES.get(name, name)
        if mode not in BENCH_MODES:
            raise ValueError(
                f"Unknown bench mode {name!r}."
                + did_you_mean(name, [*BENCH_MODES, *ALIASES, "all"])
            )
        chosen.add(mode)
    return tuple(m for m in BENCH_MODES if m in chosen)


def dtype_name(dtype: str | torch.dtype | None) -> str | None:
    """'bf16', torch.bfloat16, ... -> 'bfloat16' / 'float16' (None stays None)."""
    return None if dtype is None else str(to_low_dtype(dtype)).removeprefix("torch.")


def amp_args(mode: str, dtype: str | None = None) -> tuple[AMP_TYPE | str, dict[str, Any]]:
    """convert_to_amp's (mode, amp_config) for a bench mode; dtype only where DTYPE_KEYS has it."""
    if mode not in AMP_CALLS:
        raise ValueError(f"Unknown bench mode {mode!r}." + did_you_mean(mode, BENCH_MODES))
    amp_mode, config = AMP_CALLS[mode]
    config = dict(config)
    key = DTYPE_KEYS.get(mode)
    if dtype is not None and key is not None:
        low = to_low_dtype(dtype)
        config[key] = low if key == "cast_model_type" else dtype_name(low)
    return amp_mode, config


def amp_call_text(mode: str, dtype: str | None = None) -> str:
    """How the mode's convert_to_amp call reads, for tables: "AMP_TYPE.APEX {'opt_level': 'O2'}"."""
    amp_mode, config = amp_args(mode, dtype)
    head = f"AMP_TYPE.{amp_mode.name}" if isinstance(amp_mode, AMP_TYPE) else repr(amp_mode)
    shown = {k: dtype_name(v) if isinstance(v, torch.dtype) else v for k, v in config.items()}
    return f"{head} {shown}" if shown else head


def mode_policy(mode: str, dtype: str | None = None) -> Policy:
    """The Policy convert_to_amp will apply for this bench mode."""
    return to_policy(*amp_args(mode, dtype))
