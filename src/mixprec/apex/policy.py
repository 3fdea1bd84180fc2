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
- min_loss_scale / max_loss_scale passed beside a static loss_scale the caller passed are
  refused (Apex ignored them); beside a level's own static scale (O0, O3) they stay ignored, as
  Apex documents, so one call can serve every opt level.

cast_model_type=False is Apex's "don't cast": the model keeps its dtypes (a model that already
holds fp16 params needs `amp._amp_state.allow_incoming_model_not_fp32 = True`), and a level
with masters (O2) gives fp32 masters to whichever params are fp16/bf16.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from mixprec.core.keywords import Default, passed, value_of
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


@dataclass(frozen=True, kw_only=True)
class ApexOptions:
    """amp.initialize's keywords as one call passed them, checked and parsed once.

    `ApexOptions.parse(**keywords)` takes Apex's names and defaults; `given` names the keywords
    the caller passed (Apex's None means "the opt level's own value" for the overrides, as in
    Apex). The Policy, Apex's opt_properties and the optimizer's master_weights all derive
    from this one object.
    """

    enabled: bool
    """False: every amp call is a no-op (Apex's enabled); the other keywords are not applied."""
    opt_level: str
    """'O0'..'O3' (Apex's table; see the module docstring)."""
    cast_model_type: torch.dtype | bool | None
    """The model's param dtype; None: the level's; False: leave the model's dtypes as they are."""
    patch_torch_functions: bool | None
    """Run the forward under autocast (O1's patched functions); None: the level's."""
    keep_batchnorm_fp32: bool | None
    """Keep normalisation layers fp32 in a cast model; None: the level's."""
    master_weights: bool | None
    """fp32 master copies of a cast model's params; None: the level's."""
    loss_scale: float | str | None
    """'dynamic' or a static scale; None: the level's."""
    cast_model_outputs: torch.dtype | None
    """The dtype a patched forward returns; None: fp32 for a cast model, as produced otherwise."""
    num_losses: int
    """Loss scalers, one per loss_id."""
    verbosity: int
    """0 silences amp's messages."""
    min_loss_scale: float | None
    """The dynamic scale's floor (None: none but positivity)."""
    max_loss_scale: float
    """The dynamic scale's ceiling, which also caps its first value."""
    given: frozenset[str]
    """The keywords the caller passed (each honoured or refused, whatever its value)."""
    policy: Policy
    """What these options mean to the core."""

    @classmethod
    def parse(cls, **keywords: Any) -> ApexOptions:
        """Check Apex's keywords (Default values: not passed) and parse them once.

        Unknown keywords raise naming the closest valid one; conflicts Apex refused raise naming
        the conflict; min/max_loss_scale passed beside a static loss_scale are refused (Apex
        ignored them).
        """
        check_keys("Apex amp", passed(keywords), APEX_KEYS)
        given = frozenset(passed(keywords))
        values = {key: value_of(keywords.get(key, default)) for key, default in DEFAULTS.items()}
        opt_level, num_losses, verbosity = (
            values["opt_level"], values["num_losses"], values["verbosity"]
        )  # fmt: skip
        if opt_level not in OPT_LEVELS:
            raise ValueError(
                f"Unknown opt_level {opt_level!r}." + did_you_mean(opt_level, OPT_LEVELS)
            )
        if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
            raise ValueError(f"num_losses={num_losses!r} must be an int >= 1.")
        if isinstance(verbosity, bool) or not isinstance(verbosity, int):
            raise TypeError(
                f"verbosity={verbosity!r} must be an int (0 silences mixprec's messages)."
            )
        for name in ("enabled", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights"):
            values[name] = _as_bool(name, values[name])
        values["given"] = given
        values["policy"] = _policy(values)
        return cls(**values)

    @classmethod
    def of(cls, arguments: Mapping[str, Any], **unknown: Any) -> ApexOptions:
        """parse() over Apex's keywords among a call's arguments (a locals() dict, as
        ScalerKeywords.of takes), plus the unknown keywords the call collected (refused)."""
        return cls.parse(
            **{key: arguments[key] for key in APEX_KEYS if key in arguments}, **unknown
        )

    def properties(self) -> dict[str, Any]:
        """Apex's opt_properties: the level's defaults, then each override that is not None,
        normalised as Apex's setters did."""
        if not self.enabled:
            return dict(DISABLED_PROPERTIES)
        props = {"enabled": True, "opt_level": self.opt_level, **LEVEL_PROPERTIES[self.opt_level]}
        overrides = {
            "cast_model_type": self.cast_model_type,
            "patch_torch_functions": self.patch_torch_functions,
            "keep_batchnorm_fp32": self.keep_batchnorm_fp32,
            "master_weights": self.master_weights,
            "loss_scale": self.loss_scale,
        }
        props.update({k: v for k, v in overrides.items() if v is not None})
        if props["loss_scale"] != "dynamic":
            props["loss_scale"] = float(props["loss_scale"])
        return props

    def optimizer_master_weights(self) -> bool | None:
        """The optimizer's master_weights: the Policy's; under cast_model_type=False, None
        (masters for whatever params arrive in fp16/bf16) when the level or the override asks
        for masters, else False."""
        if self.cast_model_type is not False:
            return self.policy.master_weights
        asked = self.master_weights
        if asked is None:
            asked = preset(self.opt_level).master_weights
        return None if asked else False


DEFAULTS: dict[str, Default] = {
    "enabled": Default(True),
    "opt_level": Default("O1"),
    "cast_model_type": Default(None),
    "patch_torch_functions": Default(None),
    "keep_batchnorm_fp32": Default(None),
    "master_weights": Default(None),
    "loss_scale": Default(None),
    "cast_model_outputs": Default(None),
    "num_losses": Default(1),
    "verbosity": Default(1),
    "min_loss_scale": Default(None),
    "max_loss_scale": Default(APEX_SCALER.max_scale),
}
"""Apex's amp.initialize defaults, as the signatures that take its keywords write them."""
APEX_KEYS = tuple(DEFAULTS)


def _policy(values: dict[str, Any]) -> Policy:
    """Checked, parsed options (ApexOptions.parse) -> Policy."""
    if not values["enabled"]:
        return replace(preset("O0"), name="O0 (amp disabled)")
    opt_level = values["opt_level"]
    cast_model_type = values["cast_model_type"]
    no_cast = cast_model_type is False  # Apex: leave the model's dtypes as they are
    if no_cast:
        cast_model_type = torch.float32
    patch, keep_bn, masters = (
        values["patch_torch_functions"], values["keep_batchnorm_fp32"], values["master_weights"]
    )  # fmt: skip
    _check_level_conflicts(
        opt_level,
        {
            "cast_model_type": cast_model_type,
            "patch_torch_functions": patch,
            "keep_batchnorm_fp32": keep_bn,
            "master_weights": masters,
        },
    )
    cast_model_outputs = values["cast_model_outputs"]
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
        masters = False  # the Policy's masters follow a cast; see optimizer_master_weights
    if masters and param_dtype == torch.float32:
        raise ValueError(
            f"opt_level={opt_level!r} with master_weights=True but fp32 model weights: "
            "masters only make sense for a cast model (cast_model_type=torch.float16)."
        )
    loss_scale = values["loss_scale"]
    if loss_scale is None:
        loss_scale = "dynamic" if base.loss_scale.dynamic else base.loss_scale.init_scale
    bounds = [k for k in ("min_loss_scale", "max_loss_scale") if k in values["given"]]
    if bounds and "loss_scale" in values["given"] and loss_scale != "dynamic":
        # the caller's own keywords disagree (a level's static scale keeps Apex's rule: the
        # bounds apply to dynamic scaling only, so one call serves every opt level)
        raise ValueError(
            f"{' and '.join(bounds)} bound a dynamic loss scale, but loss_scale={loss_scale!r} "
            f"is static: drop {', '.join(bounds)}, or pass loss_scale='dynamic'."
        )
    if cast_model_outputs is None and param_dtype != torch.float32:
        cast_model_outputs = torch.float32  # Apex's patched forward hands back fp32 by default
    return Policy(
        name=opt_level,
        param_dtype=param_dtype,
        compute_dtype=low if patch else None,
        master_weights=masters,
        keep_norm_fp32=base.keep_norm_fp32 if keep_bn is None else keep_bn,
        cast_outputs_to=cast_model_outputs,
        loss_scale=_scaler_config(loss_scale, values["min_loss_scale"], values["max_loss_scale"]),
        num_losses=values["num_losses"],
        verbosity=min(max(values["verbosity"], 0), 1),  # Apex's verbosity: messages on/off
    )


def apex_policy(
    *,
    enabled: bool = DEFAULTS["enabled"],
    opt_level: str = DEFAULTS["opt_level"],
    cast_model_type: torch.dtype | None = DEFAULTS["cast_model_type"],
    patch_torch_functions: bool | None = DEFAULTS["patch_torch_functions"],
    keep_batchnorm_fp32: bool | str | None = DEFAULTS["keep_batchnorm_fp32"],
    master_weights: bool | None = DEFAULTS["master_weights"],
    loss_scale: float | str | None = DEFAULTS["loss_scale"],
    cast_model_outputs: torch.dtype | None = DEFAULTS["cast_model_outputs"],
    num_losses: int = DEFAULTS["num_losses"],
    verbosity: int = DEFAULTS["verbosity"],
    min_loss_scale: float | None = DEFAULTS["min_loss_scale"],
    max_loss_scale: float = DEFAULTS["max_loss_scale"],
    **unknown: Any,
) -> Policy:
    """Apex's `amp.initialize` keywords -> Policy (num_losses and verbosity travel in it):
    `ApexOptions.parse(...).policy`.

    Like Apex, a cast model (O2/O3 or cast_model_type) returns fp32 outputs unless
    cast_model_outputs says otherwise. Unknown keywords raise, naming the closest valid one.
    """
    return ApexOptions.of(locals(), **unknown).policy


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


# the core's to_policy('fp16_apex', {...}) parses Apex's keys here: the face hands it the rules
register_mode_parser("fp16_apex", lambda config: apex_policy(**config))
