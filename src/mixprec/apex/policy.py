"""Apex's opt levels and property overrides, translated into a mixprec Policy.

Apex's table: O0 fp32; O1 patched functions (autocast) over fp32 weights, dynamic scale;
O2 fp16 model with fp32 batchnorm and fp32 masters, dynamic scale; O3 pure fp16, scale 1.
Overrides adjust the chosen level; the combinations Apex rejected (its `warn_or_err`, an error
unless `hard_override`) are rejected here too, with the conflict named:

- O1 with a cast_model_type other than torch.float32 (O1 casts around functions, not weights);
- O1 with keep_batchnorm_fp32 or master_weights set (O1's weights are fp32 already);
- patch_torch_functions=True with any level but O1.

Differences from Apex, each deliberate:

- keep_batchnorm_fp32 keeps every normalisation layer fp32 (Batch/Layer/Group/Instance/RMS
  norm), as the core Policy's keep_norm_fp32 does; Apex kept BatchNorm only.
- master_weights=True over fp32 model weights is an error (Apex made no masters, silently).
- min_loss_scale=None means no floor but positivity: the scale stops at fp32's smallest normal.

cast_model_type=False is Apex's "don't cast": the model keeps its dtypes (a model that already
holds fp16 params needs `amp._amp_state.allow_incoming_model_not_fp32 = True`), and a level
with masters (O2) gives fp32 masters to whichever params are fp16/bf16.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from mixprec.core.policy import (
    APEX_SCALER,
    OPT_LEVELS,
    Policy,
    ScalerConfig,
    check_keys,
    did_you_mean,
    preset,
    register_mode_parser,
)

APEX_KEYS = (
    "enabled",
    "opt_level",
    "cast_model_type",
    "patch_torch_functions",
    "keep_batchnorm_fp32",
    "master_weights",
    "loss_scale",
    "cast_model_outputs",
    "num_losses",
    "verbosity",
    "min_loss_scale",
    "max_loss_scale",
)
CAST_TYPES = (torch.float16, torch.bfloat16, torch.float32)
NO_FLOOR = float(torch.finfo(torch.float32).tiny)
"""Apex's min_loss_scale=None: no floor, but a scale must stay > 0 (2**-126)."""


def _as_bool(name: str, value: Any) -> bool | None:
    # Apex accepts the strings "True"/"False" (from command lines) as well as bools.
    if value is None or isinstance(value, bool):
        return value
    if value in ("True", "False"):
        return value == "True"
    raise TypeError(f"{name}={value!r} must be True, False, 'True', 'False' or None.")


def _check_level_conflicts(opt_level: str, overrides: dict[str, Any]) -> None:
    """Raise on the overrides Apex refused for this opt level, naming the conflict."""
    patch = overrides["patch_torch_functions"]
    if opt_level != "O1" and patch:
        raise ValueError(
            f"opt_level={opt_level!r} with patch_torch_functions=True: patching torch functions "
            "(autocast over fp32 weights) is what opt_level='O1' means; select 'O1' instead."
        )
    if opt_level != "O1":
        return
    cast = overrides["cast_model_type"]
    if cast is not None and cast != torch.float32:
        raise ValueError(
            f"opt_level='O1' with cast_model_type={cast!r}: O1 casts around torch functions, so "
            "the model weights stay fp32; to cast the model use opt_level='O2' or 'O3'."
        )
    reasons = {
        "keep_batchnorm_fp32": "O1 already runs batchnorm in fp32, so keep_batchnorm_fp32 must "
        "be None",
        "master_weights": "O1's model weights are fp32 already, so master_weights must be None",
    }
    for key, why in reasons.items():
        if overrides[key] is not None:
            raise ValueError(f"opt_level='O1' with {key}={overrides[key]!r}: {why}.")


def _scaler_config(
    loss_scale: float | str, min_loss_scale: float | None, max_loss_scale: float
) -> ScalerConfig:
    """Apex's loss_scale ('dynamic' or a number, also as a string) -> ScalerConfig."""
    if loss_scale == "dynamic":
        if not max_loss_scale > 0:
            raise ValueError(f"max_loss_scale={max_loss_scale!r} must be > 0.")
        if min_loss_scale is not None and not 0 < min_loss_scale <= max_loss_scale:
            raise ValueError(
                f"min_loss_scale={min_loss_scale!r} must be in (0, max_loss_scale="
                f"{max_loss_scale!r}] (None: no floor)."
            )
        floor = NO_FLOOR if min_loss_scale is None else float(min_loss_scale)
        return replace(
            APEX_SCALER,
            # Apex starts at min(2**16, max_loss_scale): the ceiling also caps the first scale.
            init_scale=min(APEX_SCALER.init_scale, float(max_loss_scale)),
            min_scale=min(floor, float(max_loss_scale)),
            max_scale=float(max_loss_scale),
        )
    try:  # Apex takes float(loss_scale): numbers and numeric strings ("128.0") are static scales
        static = float(loss_scale) if not isinstance(loss_scale, bool) else None
    except (TypeError, ValueError):
        static = None
    if static is None or not static > 0 or static == float("inf"):
        raise ValueError(
            f"loss_scale={loss_scale!r} must be 'dynamic' or a number (a static scale > 0)."
        )
    return ScalerConfig(dynamic=False, init_scale=static)


def apex_policy(
    *,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: torch.dtype | None = None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | None = None,
    loss_scale: float | str | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = APEX_SCALER.max_scale,
    **unknown: Any,
) -> Policy:
    """Apex's `amp.initialize` keywords -> Policy (num_losses and verbosity travel in it).

    Like Apex, a cast model (O2/O3 or cast_model_type) returns fp32 outputs unless
    cast_model_outputs says otherwise. Unknown keywords raise, naming the closest valid one.
    """
    check_keys("Apex amp", unknown, APEX_KEYS)
    no_cast = cast_model_type is False  # Apex: leave the model's dtypes as they are
    if no_cast:
        cast_model_type = torch.float32
    if opt_level not in OPT_LEVELS:
        raise ValueError(f"Unknown opt_level {opt_level!r}." + did_you_mean(opt_level, OPT_LEVELS))
    if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"num_losses={num_losses!r} must be an int >= 1.")
    if isinstance(verbosity, bool) or not isinstance(verbosity, int):
        raise TypeError(f"verbosity={verbosity!r} must be an int (0 silences mixprec's messages).")
    enabled = _as_bool("enabled", enabled)
    if not enabled:
        return replace(preset("O0"), name="O0 (amp disabled)")
    patch = _as_bool("patch_torch_functions", patch_torch_functions)
    keep_bn = _as_bool("keep_batchnorm_fp32", keep_batchnorm_fp32)
    masters = _as_bool("master_weights", master_weights)
    _check_level_conflicts(
        opt_level,
        {
            "cast_model_type": cast_model_type,
            "patch_torch_functions": patch,
            "keep_batchnorm_fp32": keep_bn,
            "master_weights": masters,
        },
    )
    for name, dt in (
        ("cast_model_type", cast_model_type),
        ("cast_model_outputs", cast_model_outputs),
    ):
        if dt is not None and dt not in CAST_TYPES:
            raise ValueError(f"{name}={dt!r}; valid: torch.float16, torch.bfloat16, torch.float32.")
    base = preset(opt_level)
    param_dtype = base.param_dtype if cast_model_type is None else cast_model_type
    low = param_dtype if param_dtype != torch.float32 else torch.float16
    if patch is None:
        patch = base.compute_dtype is not None
    if masters is None:
        masters = base.master_weights and param_dtype != torch.float32
    if no_cast:
        masters = False  # the Policy's masters follow a cast; see uncast_master_weights
    if masters and param_dtype == torch.float32:
        raise ValueError(
            f"opt_level={opt_level!r} with master_weights=True but fp32 model weights: "
            "masters only make sense for a cast model (cast_model_type=torch.float16)."
        )
    if loss_scale is None:
        loss_scale = "dynamic" if base.loss_scale.dynamic else base.loss_scale.init_scale
    if cast_model_outputs is None and param_dtype != torch.float32:
        cast_model_outputs = torch.float32  # Apex's patched forward hands back fp32 by default
    return Policy(
        name=opt_level,
        param_dtype=param_dtype,
        compute_dtype=low if patch else None,
        master_weights=masters,
        keep_norm_fp32=base.keep_norm_fp32 if keep_bn is None else keep_bn,
        cast_outputs_to=cast_model_outputs,
        loss_scale=_scaler_config(loss_scale, min_loss_scale, max_loss_scale),
        num_losses=num_losses,
        verbosity=min(max(verbosity, 0), 1),  # Apex's verbosity only switches messages on/off
    )


# Apex's Properties as each opt level reports them before overrides (amp._amp_state.opt_properties)
LEVEL_PROPERTIES: dict[str, dict[str, Any]] = {
    "O0": {"cast_model_type": torch.float32, "patch_torch_functions": False,
           "keep_batchnorm_fp32": None, "master_weights": False, "loss_scale": 1.0},
    "O1": {"cast_model_type": None, "patch_torch_functions": True,
           "keep_batchnorm_fp32": None, "master_weights": None, "loss_scale": "dynamic"},
    "O2": {"cast_model_type": torch.float16, "patch_torch_functions": False,
           "keep_batchnorm_fp32": True, "master_weights": True, "loss_scale": "dynamic"},
    "O3": {"cast_model_type": torch.float16, "patch_torch_functions": False,
           "keep_batchnorm_fp32": False, "master_weights": False, "loss_scale": 1.0},
}  # fmt: skip
DISABLED_PROPERTIES: dict[str, Any] = {
    "enabled": False, "opt_level": None, "cast_model_type": None, "patch_torch_functions": False,
    "keep_batchnorm_fp32": None, "master_weights": None, "loss_scale": 1.0,
}  # fmt: skip


def apex_properties(
    *,
    enabled: bool | str = True,
    opt_level: str = "O1",
    cast_model_type: torch.dtype | bool | None = None,
    patch_torch_functions: bool | str | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | str | None = None,
    loss_scale: float | str | None = None,
) -> dict[str, Any]:
    """Apex's opt_properties for (already validated) initialize arguments: the level's
    defaults, then each override that is not None, normalised as Apex's setters did."""
    if not _as_bool("enabled", enabled):
        return dict(DISABLED_PROPERTIES)
    props: dict[str, Any] = {"enabled": True, "opt_level": opt_level, **LEVEL_PROPERTIES[opt_level]}
    overrides = {
        "cast_model_type": cast_model_type,
        "patch_torch_functions": _as_bool("patch_torch_functions", patch_torch_functions),
        "keep_batchnorm_fp32": _as_bool("keep_batchnorm_fp32", keep_batchnorm_fp32),
        "master_weights": _as_bool("master_weights", master_weights),
        "loss_scale": loss_scale,
    }
    props.update({k: v for k, v in overrides.items() if v is not None})
    if props["loss_scale"] != "dynamic":
        props["loss_scale"] = float(props["loss_scale"])
    return props


def uncast_master_weights(opt_level: str, master_weights: bool | str | None) -> bool | None:
    """The optimizer's master_weights under cast_model_type=False: None (masters for whatever
    params arrive in fp16/bf16) when the level or the override asks for masters, else False."""
    asked = _as_bool("master_weights", master_weights)
    if asked is None:
        asked = preset(opt_level).master_weights
    return None if asked else False


# the core's to_policy('fp16_apex', {...}) parses Apex's keys here: the face hands it the rules
register_mode_parser("fp16_apex", lambda config: apex_policy(**config))
