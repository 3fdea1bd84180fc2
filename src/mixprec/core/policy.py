"""What a precision mode means, as data: one frozen Policy per mode, parsed from every face.

Every face (convert_to_amp, Booster, initialize, Apex's amp, Paddle's names) translates its
own vocabulary into a Policy here and hands it to the core; no face decides dtypes itself.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

import torch

from mixprec.core.validate import (
    SCALER_FIELDS,
    check_bool,
    check_max_norm,
    check_scaler_values,
)

Mode = Literal["fp32", "fp16", "bf16", "fp16_naive", "fp16_apex", "fp8", "bf16_sr"]
MODES: tuple[str, ...] = get_args(Mode)
OptLevel = Literal["O0", "O1", "O2", "O3"]
OPT_LEVELS: tuple[str, ...] = get_args(OptLevel)
StateFormat = Literal["fp32", "bf16", "int8", "int4", "fp8"]
OPTIMIZER_STATES: tuple[str, ...] = get_args(StateFormat)
OptimizerState = str
"""A StateFormat for every moment, or two joined by '/': the first moment's (Adam's exp_avg,
SGD's momentum_buffer) / the second moment's (exp_avg_sq), e.g. 'int8/int4'; see state_formats."""
Rounding = Literal["nearest", "stochastic"]
ROUNDINGS: tuple[str, ...] = get_args(Rounding)
MASTER_WEIGHTS = {"fp32": True, "none": False}
"""master_weights spelled as a precision: 'fp32' masters, or 'none' (step the params)."""
LOW_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


MODE_ALIASES: dict[str, str] = {}
"""A face's own names for modes (lower case) -> mode; the face registers them (the Colossal
face: 'torch', 'apex', 'naive'). The core knows no face's words."""


def did_you_mean(value: object, valid: list[str] | tuple[str, ...]) -> str:
    """Message tail naming the closest valid choices to a bad string, then all of them."""
    close = difflib.get_close_matches(str(value), [str(v) for v in valid], n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"{hint} Valid: {', '.join(repr(v) for v in valid)}."


def state_formats(state: Any, name: str = "optimizer_state") -> tuple[str, str]:
    """(the first moment's format, the second moment's) that an optimizer_state names: one
    format for every moment ('int8'), or two joined by '/' ('int8/int4': Adam's exp_avg and
    SGD's momentum_buffer in int8, exp_avg_sq in int4). The one check of every face's value."""
    parts = state.split("/") if isinstance(state, str) else None
    if parts is None or len(parts) > 2 or any(p not in OPTIMIZER_STATES for p in parts):
        bad = next((p for p in parts or () if p not in OPTIMIZER_STATES), state)
        raise ValueError(
            f"{name}={state!r}: one format for every moment, or two joined by '/' (the first "
            "moment's / the second's, e.g. 'int8/int4')." + did_you_mean(bad, OPTIMIZER_STATES)
        )
    return parts[0], parts[-1]


def check_keys(what: str, given: Mapping[str, Any], valid: list[str] | tuple[str, ...]) -> None:
    """Raise on the first key of `given` that is not in `valid`, naming it and the valid ones."""
    for key in given:
        if key not in valid:
            raise ValueError(f"Unknown {what} key {key!r}." + did_you_mean(key, sorted(valid)))


def to_low_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float16'/'bfloat16' (or the torch dtype) -> torch dtype; anything else is an error."""
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float16, torch.bfloat16):
            return dtype
    elif isinstance(dtype, str) and dtype.lower() in LOW_DTYPES:
        return LOW_DTYPES[dtype.lower()]
    raise ValueError(
        f"dtype={dtype!r} is not a low-precision dtype. Valid: 'float16', 'bfloat16' "
        "(or torch.float16, torch.bfloat16)."
    )


@dataclass(frozen=True, kw_only=True)
class ScalerConfig:
    """Loss-scaler settings. Dynamic follows Megatron's hysteresis rule; static keeps init_scale."""

    dynamic: bool = True
    """True: back off on overflow and grow after clean steps. False: the scale never changes."""
    init_scale: float = 2.0**16
    """Scale of the first step (the static scale when dynamic is False)."""
    growth_factor: float = 2.0
    """Multiplier applied after `growth_interval` consecutive clean steps; > 1."""
    backoff_factor: float = 0.5
    """Multiplier applied on an overflow once hysteresis is spent; in (0, 1)."""
    growth_interval: int = 2000
    """Clean steps in a row before the scale grows."""
    hysteresis: int = 1
    """Overflows tolerated before the scale backs off (1: back off on every overflow)."""
    min_scale: float = 1.0
    """Floor of the scale: it never falls below this (never to 0)."""
    max_scale: float = float("inf")
    """Ceiling of the scale."""
    consecutive_hysteresis: bool = False
    """DeepSpeed's variant: every clean step refills the hysteresis (not only growth)."""

    def __post_init__(self) -> None:
        check_bool("ScalerConfig.dynamic", self.dynamic)
        fields = [f.name for f in dataclasses.fields(self) if f.name in SCALER_FIELDS]
        check_scaler_values(
            {f: getattr(self, f) for f in fields}, {f: f"ScalerConfig.{f}" for f in fields}
        )


TORCH_SCALER = ScalerConfig()
"""torch.amp.GradScaler's defaults: 2**16, x2 every 2000 clean steps, x0.5 on overflow."""
NAIVE_SCALER = ScalerConfig(init_scale=2.0**32, growth_interval=1000, hysteresis=2)
"""Colossal-AI's naive AMP defaults (Megatron's): 2**32, interval 1000, hysteresis 2, floor 1."""
APEX_SCALER = replace(TORCH_SCALER, max_scale=2.0**24)
"""Apex's dynamic defaults: 2**16, interval 2000, ceiling 2**24."""
UNIT_SCALE = ScalerConfig(dynamic=False, init_scale=1.0)
"""A static scale of 1: no scaling, but non-finite gradients still skip the step."""


@dataclass(frozen=True, kw_only=True)
class Policy:
    """Which dtype everything has in one precision mode; faces build it, the core obeys it."""

    name: str
    """The mode's name, as users wrote it (for messages and checkpoints)."""
    param_dtype: torch.dtype = torch.float32
    """dtype of the model's floating parameters and buffers during forward."""
    compute_dtype: torch.dtype | None = None
    """dtype autocast computes in; None runs no autocast."""
    master_weights: bool = False
    """Keep fp32 master copies in the optimizer (only meaningful when param_dtype is low).
    Also spelled 'fp32' (True) or 'none' (False); stored as the bool."""
    update_rounding: Rounding = "nearest"
    """How an update is written back to low-precision params without masters: 'nearest'
    (a cast) or 'stochastic' (bf16 params only; unbiased, see mixprec.core.lean)."""
    optimizer_state: OptimizerState | None = None
    """Format of the optimizer's moments: 'fp32', 'bf16', 'int8', 'int4', 'fp8', or the first
    moment's / the second's ('int8/int4'; see state_formats) (mixprec.core.lean steps
    SGD/Adam/AdamW itself); None: the optimizer's own (torch's: the held params' dtype)."""
    keep_norm_fp32: bool = True
    """Leave Batch/Layer/Group/InstanceNorm parameters (and their math) in fp32."""
    cast_outputs_to: torch.dtype | None = None
    """Cast the model's floating outputs to this dtype (None leaves them as computed)."""
    cast_inputs: bool = True
    """Cast floating call arguments to param_dtype when params are low precision (False: the
    model gets its inputs as given, e.g. Colossal's LowLevelZeroPlugin(cast_inputs=False))."""
    loss_scale: ScalerConfig = UNIT_SCALE
    """Loss-scaler settings; UNIT_SCALE means none (the non-finite check still runs)."""
    custom_white_list: frozenset[str] = field(default_factory=frozenset)
    """Ops forced to run in the low dtype under autocast."""
    custom_black_list: frozenset[str] = field(default_factory=frozenset)
    """Ops forced to run in fp32 under autocast."""
    fp8: bool = False
    """Swap eligible nn.Linear layers for float8 linears (e4m3 forward, e5m2 backward)."""
    fp8_config: Any = None
    """How the float8 layers scale (a mixprec.fp8.Float8Config: recipe, scaling, ...), opaque
    to the core: prepare_model hands it to the registered fp8 converter. None: the converter's
    default. Set only with fp8=True. Every face's fp8 spelling arrives here."""
    log_num_zeros_in_grad: bool = False
    """Count zero gradient entries at each step (a host sync; off by default)."""
    num_losses: int = 1
    """Loss scalers, one per loss_id (Apex's num_losses); > 1 unscales after each backward."""
    verbosity: int = 1
    """0: no skip/overflow messages; 1: skipped steps; 2: also every scale change (a sync)."""
    max_norm: float = 0.0
    """Clip the unscaled gradients to this global L2 norm at every step; 0: off (Colossal
    NAIVE's clip_grad_norm; an optimizer built with its own max_norm must agree)."""

    def __post_init__(self) -> None:
        if isinstance(self.master_weights, str):
            if self.master_weights not in MASTER_WEIGHTS:
                raise ValueError(
                    f"Policy.master_weights={self.master_weights!r}; valid: True, False, "
                    f"{', '.join(repr(k) for k in MASTER_WEIGHTS)}."
                )
            object.__setattr__(self, "master_weights", MASTER_WEIGHTS[self.master_weights])
        check_bool("Policy.master_weights", self.master_weights)
        if self.fp8_config is not None and not self.fp8:
            raise ValueError(
                f"Policy {self.name!r}: fp8_config={self.fp8_config!r} needs fp8=True (the "
                "config says how float8 layers scale; with fp8=False there are none)."
            )
        self._check_lean()
        for name in ("param_dtype",):
            dt = getattr(self, name)
            if dt not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"Policy.{name}={dt!r}; valid: float32, float16, bfloat16.")
        if self.compute_dtype not in (None, torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(
                f"Policy.compute_dtype={self.compute_dtype!r}; valid: None, float16, bfloat16."
            )
        if self.master_weights and self.param_dtype == torch.float32:
            raise ValueError(
                f"Policy {self.name!r}: master_weights=True needs low-precision params "
                "(param_dtype float16/bfloat16); fp32 params are their own masters."
            )
        for name, least in (("num_losses", 1), ("verbosity", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"Policy.{name}={value!r} must be an int >= {least}.")
        check_max_norm("Policy.max_norm", self.max_norm)
        overlap = self.custom_white_list & self.custom_black_list
        if overlap:
            raise ValueError(f"Ops {sorted(overlap)} are in both the white and the black list.")

    def _check_lean(self) -> None:
        if self.update_rounding not in ROUNDINGS:
            raise ValueError(
                f"Policy.update_rounding={self.update_rounding!r}."
                + did_you_mean(self.update_rounding, ROUNDINGS)
            )
        if self.optimizer_state is not None:
            state_formats(self.optimizer_state, "Policy.optimizer_state")
        if self.update_rounding == "stochastic":
            if self.param_dtype == torch.float16:
                raise ValueError(
                    f"Policy {self.name!r}: update_rounding='stochastic' needs bfloat16 params; "
                    "fp16 params have 5 exponent bits, so tiny updates underflow before any "
                    "rounding. Use dtype='bfloat16', or fp32 masters (master_weights='fp32')."
                )
            if self.param_dtype != torch.bfloat16 or self.master_weights:
                raise ValueError(
                    f"Policy {self.name!r}: update_rounding='stochastic' rounds the update into "
                    "bf16 params stepped without masters; this policy has "
                    f"param_dtype={self.param_dtype}, master_weights={self.master_weights}. "
                    "Use param_dtype=torch.bfloat16 with master_weights='none' (mode 'bf16_sr')."
                )

    @property
    def low_dtype(self) -> torch.dtype | None:
        """The reduced-precision dtype this mode uses anywhere (None for fp32)."""
        if self.param_dtype != torch.float32:
            return self.param_dtype
        if self.compute_dtype not in (None, torch.float32):
            return self.compute_dtype
        return None

    @property
    def casts_params(self) -> bool:
        return self.param_dtype != torch.float32

    def with_dtype(self, dtype: str | torch.dtype) -> Policy:
        """The same mode over another low dtype. bf16 has fp32's range: loss scaling is dropped."""
        low = to_low_dtype(dtype)
        if self.low_dtype is None:
            raise ValueError(f"Mode {self.name!r} has no low-precision dtype to set to {low}.")
        return replace(
            self,
            param_dtype=low if self.casts_params else torch.float32,
            compute_dtype=low if self.compute_dtype not in (None, torch.float32) else None,
            loss_scale=UNIT_SCALE if low == torch.bfloat16 else self.loss_scale,
        )


PRESETS: dict[str, Policy] = {
    "fp32": Policy(name="fp32"),
    "fp16": Policy(name="fp16", compute_dtype=torch.float16, loss_scale=TORCH_SCALER),
    "bf16": Policy(name="bf16", compute_dtype=torch.bfloat16),
    "fp16_naive": Policy(
        name="fp16_naive",
        param_dtype=torch.float16,
        master_weights=True,
        cast_outputs_to=torch.float32,
        loss_scale=NAIVE_SCALER,
    ),
    "fp8": Policy(name="fp8", compute_dtype=torch.bfloat16, fp8=True),
    # Lean: bf16 params without masters, updates stochastically rounded (mixprec.core.lean).
    "bf16_sr": Policy(
        name="bf16_sr",
        param_dtype=torch.bfloat16,
        cast_outputs_to=torch.float32,
        update_rounding="stochastic",
        optimizer_state="fp32",
    ),
    # Apex's opt levels; 'fp16_apex' alone means Apex's default, O1.
    "O0": Policy(name="O0"),
    "O1": Policy(name="O1", compute_dtype=torch.float16, loss_scale=APEX_SCALER),
    "O2": Policy(name="O2", param_dtype=torch.float16, master_weights=True, loss_scale=APEX_SCALER),
    "O3": Policy(name="O3", param_dtype=torch.float16, keep_norm_fp32=False),
}
PRESETS["fp16_apex"] = replace(PRESETS["O1"], name="fp16_apex")


def preset(mode: str, *, dtype: str | torch.dtype | None = None) -> Policy:
    """The Policy preset for a mode name ('fp16', 'bf16', ..., 'O0'..'O3') or a face's alias."""
    mode = resolve_mode(mode)  # type: ignore[assignment]
    if not isinstance(mode, str) or mode not in PRESETS:
        raise ValueError(
            f"Unknown mixed-precision mode {mode!r}." + did_you_mean(mode, list(PRESETS))
        )
    policy = PRESETS[mode]
    return policy if dtype is None else policy.with_dtype(dtype)


def clip_norm_for(policy: Policy, max_norm: float) -> float:
    """The clipping norm an optimizer for policy uses: its own max_norm or the policy's.

    Both set and different is an error (Colossal clips once, in the NAIVE optimizer's step).
    """
    if max_norm and policy.max_norm and float(max_norm) != policy.max_norm:
        raise ValueError(
            f"Two clipping norms: max_norm={max_norm!r} (clip_grad_norm of the config or the "
            f"caller) and the {policy.name!r} mode's clip_grad_norm={policy.max_norm!r}; set "
            "one of them, or the same value in both."
        )
    return float(max_norm or policy.max_norm)


MODE_PARSERS: dict[str, Callable[[Mapping[str, Any]], Policy]] = {}
"""Mode -> parser of its config keys; a face that owns a mode's keys registers it here (the
Colossal face: 'fp16', 'fp16_naive'; the Apex face: 'fp16_apex')."""


def register_mode_parser(mode: str, parser: Callable[[Mapping[str, Any]], Policy]) -> None:
    """A face hands the core its mode's config parser (the Apex face: 'fp16_apex').

    The core imports no face: mixprec/__init__ imports the faces, so they register first.
    """
    if mode not in MODES:
        raise ValueError(
            f"register_mode_parser: unknown mode {mode!r}." + did_you_mean(mode, MODES)
        )
    MODE_PARSERS[mode] = parser


def register_mode_alias(alias: str, mode: str) -> None:
    """A face hands the core its own name for a mode (matched in lower case)."""
    if mode not in MODES:
        raise ValueError(f"register_mode_alias: unknown mode {mode!r}." + did_you_mean(mode, MODES))
    if alias.lower() in MODES:
        raise ValueError(f"register_mode_alias: {alias!r} is a mode name already.")
    MODE_ALIASES[alias.lower()] = mode


def resolve_mode(mode: object) -> object:
    """A face's alias (any str, a str enum too) -> its mode; anything else as it came."""
    if isinstance(mode, str):
        return MODE_ALIASES.get(mode.lower(), mode)
    return mode


def to_policy(
    spec: str | Mapping[str, Any] | Policy | None,
    config: Mapping[str, Any] | None = None,
) -> Policy:
    """Any face's way of naming a mode -> Policy.

    spec: a mode name or a face's alias of one (MODE_ALIASES), a Policy, None (fp32), or a
    dict `dict(mode=..., **mode_keys)`. config: that mode's keys when spec is a name.
    """
    if isinstance(spec, Policy):
        if config:
            raise ValueError(f"A Policy takes no extra config; got {dict(config)!r}.")
        return spec
    if isinstance(spec, Mapping):
        if config:
            raise ValueError("Pass the mode's keys inside the dict, not as a second config.")
        config = dict(spec)
        if "mode" not in config:
            raise ValueError(
                f"A mode config dict needs a 'mode' key (one of {list(MODES)} or "
                f"{sorted(MODE_ALIASES)}); got keys {sorted(config)}."
            )
        spec = config.pop("mode")
    if spec is None:
        spec = "fp32"
    spec = resolve_mode(spec)  # type: ignore[assignment]
    if not isinstance(spec, str):
        raise TypeError(
            f"A mixed-precision mode must be a str (a mode name or a face's alias of one), a "
            f"dict or a Policy, got {spec!r}."
        )
    config = dict(config or {})
    state = config.pop("optimizer_state", None)  # accepted next to every mode's own keys
    parser = MODE_PARSERS.get(spec)
    if parser is not None:
        policy = parser(config)
    else:
        check_keys(f"{spec!r} mode config", config, ("dtype", "optimizer_state"))
        policy = preset(spec, dtype=config.get("dtype"))
    return policy if state is None else with_optimizer_state(policy, state)


def with_optimizer_state(policy: Policy, state: str) -> Policy:
    """policy with its optimizer state in `state` (see state_formats)."""
    state_formats(state)
    return replace(policy, optimizer_state=state)


def describe(policy: Policy) -> dict[str, str]:
    """A flat, printable view of a policy (for reports and checkpoint metadata)."""
    return {f.name: str(getattr(policy, f.name)) for f in dataclasses.fields(policy)}
