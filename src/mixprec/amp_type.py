"""Colossal-AI's AMP vocabulary: `AMP_TYPE` and its modes' config keys, parsed into core Policies.

Colossal-AI keeps AMP_TYPE in `colossalai.amp.amp_type`; here it is the face's module that hands
the core its words as data (aliases and key parsers, registered below), so the core carries no
Colossal vocabulary. `mixprec.amp.AMP_TYPE` and `mixprec.AMP_TYPE` are this enum.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from mixprec.core.policy import (
    NAIVE_SCALER,
    TORCH_SCALER,
    UNIT_SCALE,
    Policy,
    ScalerConfig,
    check_keys,
    preset,
    register_mode_alias,
    register_mode_parser,
)
from mixprec.core.validate import SCALER_FIELDS, check_bool, check_max_norm, check_scaler_values


class AMP_TYPE(str, enum.Enum):  # noqa: N801 - the name Colossal-AI users already write
    """Colossal-AI's three AMP switches; each maps onto a mixprec mode."""

    TORCH = "torch"
    APEX = "apex"
    NAIVE = "naive"


AMP_TYPE_TO_MODE: dict[AMP_TYPE, str] = {
    AMP_TYPE.TORCH: "fp16",
    AMP_TYPE.APEX: "fp16_apex",
    AMP_TYPE.NAIVE: "fp16_naive",
}


# Keys each Colossal-AI mode accepts in its amp_config / fp16=dict(...) (seed 000), plus
# mixprec's additions (dtype, hysteresis, min_scale, max_scale on TORCH).
TORCH_KEYS = (
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "enabled",
    "hysteresis",
    "min_scale",
    "max_scale",
    "dtype",
)
NAIVE_KEYS = (
    "log_num_zeros_in_grad",
    "initial_scale",
    "min_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "max_scale",
    "verbose",
    "dtype",
    "keep_norm_fp32",
    "clip_grad_norm",
    "dynamic_grad_scale",
)
NAIVE_DYNAMIC_KEYS = (
    "min_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "max_scale",
)
"""Colossal's DynamicGradScaler keys: with dynamic_grad_scale=False (its ConstantGradScaler,
which takes initial_scale only) they are refused."""


def torch_amp_policy(config: Mapping[str, Any] | None = None) -> Policy:
    """AMP_TYPE.TORCH / 'fp16' from its seed-000 keys (GradScaler arguments, enabled)."""
    config = dict(config or {})
    check_keys("AMP_TYPE.TORCH config", config, TORCH_KEYS)
    policy = preset("fp16", dtype=config.pop("dtype", None))
    enabled = config.pop("enabled", True)
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}.")
    if not enabled:
        return replace(policy, loss_scale=UNIT_SCALE)
    check_scaler_values({k: v for k, v in config.items() if k in SCALER_FIELDS})
    if config:  # explicit scaler keys keep scaling on, even over bfloat16
        return replace(policy, loss_scale=replace(TORCH_SCALER, **config))
    return policy


def naive_amp_policy(config: Mapping[str, Any] | None = None) -> Policy:
    """AMP_TYPE.NAIVE / 'fp16_naive' from its seed-000 keys (Megatron-style scaler)."""
    config = dict(config or {})
    check_keys("AMP_TYPE.NAIVE config", config, NAIVE_KEYS)
    verbose = config.pop("verbose", None)
    if verbose not in (None, True, False):
        raise TypeError(f"verbose={verbose!r} must be True, False or None.")
    policy = preset("fp16_naive", dtype=config.pop("dtype", None))
    extra: dict[str, Any] = {"verbosity": 2} if verbose else {}  # seed 000: prints debug info
    for key in ("log_num_zeros_in_grad", "keep_norm_fp32"):
        if key in config:
            check_bool(key, config[key])  # bool('no') would be True
            extra[key] = config.pop(key)
    if "clip_grad_norm" in config:  # Colossal: clip the fp32 master grads in step(); 0: off
        extra["max_norm"] = check_max_norm("clip_grad_norm", config.pop("clip_grad_norm"))
    dynamic = config.pop("dynamic_grad_scale", True)
    check_bool("dynamic_grad_scale", dynamic)
    scaler_keys = {k: config[k] for k in NAIVE_DYNAMIC_KEYS if k in config}
    if "initial_scale" in config:
        scaler_keys["init_scale"] = config["initial_scale"]
        config["init_scale"] = config.pop("initial_scale")
    check_scaler_values(scaler_keys, {"init_scale": "initial_scale"})  # named as written
    if not dynamic:  # Colossal's ConstantGradScaler: a fixed scale (overflowing steps still skip)
        dynamic_keys = sorted(k for k in config if k in NAIVE_DYNAMIC_KEYS)
        if dynamic_keys:
            raise ValueError(
                f"dynamic_grad_scale=False with {dynamic_keys}: those set a dynamic scaler's "
                "rule; a constant scale takes initial_scale only."
            )
        if "init_scale" not in config:
            raise ValueError(
                "dynamic_grad_scale=False needs initial_scale=... (the constant loss scale), "
                "as Colossal-AI's ConstantGradScaler does."
            )
        extra["loss_scale"] = ScalerConfig(dynamic=False, init_scale=config.pop("init_scale"))
    elif config:
        extra["loss_scale"] = replace(NAIVE_SCALER, **config)
    return replace(policy, **extra)


# The core's to_policy / preset take AMP_TYPE (a str enum) and its values ("torch", ...) through
# these aliases, and parse the TORCH / NAIVE keys with these parsers.
for _amp_type, _mode in AMP_TYPE_TO_MODE.items():
    register_mode_alias(_amp_type.value, _mode)
register_mode_parser("fp16", torch_amp_policy)
register_mode_parser("fp16_naive", naive_amp_policy)
