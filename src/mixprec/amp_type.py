"""Colossal-AI's AMP vocabulary: `AMP_TYPE` and its modes' config keys, parsed into core Policies.

Colossal-AI keeps AMP_TYPE in `colossalai.amp.amp_type`; here it is the face's module that hands
the core its words as data (aliases and key parsers, registered below), so the core carries no
Colossal vocabulary. `mixprec.amp.AMP_TYPE` and `mixprec.AMP_TYPE` are this enum.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

from mixprec.core.grad_scaler import SCALING_KEYWORDS
from mixprec.core.keywords import Default
from mixprec.core.policy import (
    APEX_SCALER,
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


UNSET: Any = Default(None)
"""A keyword not passed, where no signature default stands for it."""


@dataclass(frozen=True, kw_only=True)
class ScalerKeywords:
    """Colossal-AI's seven loss-scaler keywords as one call passed them (parsed once).

    Each plugin (HybridParallelPlugin, LowLevelZeroPlugin), LowLevelZeroOptimizer and
    FP16NaiveMixedPrecision takes them under these names; a field holding a Default was not
    passed and takes the scaler's own value, a passed one replaces it or is refused by name.
    """

    initial_scale: Any = UNSET
    """The first loss scale (the core's init_scale)."""
    min_scale: Any = UNSET
    """The floor a backoff never goes below."""
    growth_factor: Any = UNSET
    """The factor the scale grows by after growth_interval clean steps."""
    backoff_factor: Any = UNSET
    """The factor the scale shrinks by once hysteresis overflows are spent."""
    growth_interval: Any = UNSET
    """Clean steps between two growths."""
    hysteresis: Any = UNSET
    """Overflows tolerated before a backoff (Megatron's rule)."""
    max_scale: Any = UNSET
    """The ceiling a growth never goes above."""

    NAMES: ClassVar[tuple[str, ...]]
    CORE_NAME: ClassVar[dict[str, str]] = {"initial_scale": "init_scale"}
    """A keyword -> the core's ScalerConfig field, where the two names differ."""

    def __post_init__(self) -> None:
        core = self.to_core()  # a bad value fails at construction, under the keyword's name
        check_scaler_values(core, {v: k for k, v in self.CORE_NAME.items()})

    @classmethod
    def of(cls, given: Mapping[str, Any]) -> ScalerKeywords:
        """The scaler keywords among a call's arguments (a locals() dict, or some of them)."""
        return cls(**{name: given[name] for name in cls.NAMES if name in given})

    @classmethod
    def defaults(cls, scaler: ScalerConfig) -> ScalerKeywords:
        """Every keyword as a Default standing for scaler's value (signature defaults)."""
        return cls(**{n: Default(getattr(scaler, cls.CORE_NAME.get(n, n))) for n in cls.NAMES})

    @classmethod
    def of_scaler(cls, scaler: ScalerConfig) -> ScalerKeywords:
        """Every keyword passed, with scaler's values (to hand a resolved scaler on)."""
        return cls(**{n: getattr(scaler, cls.CORE_NAME.get(n, n)) for n in cls.NAMES})

    def passed(self) -> dict[str, Any]:
        """The keywords the caller passed, under their Colossal names."""
        out = {n: getattr(self, n) for n in self.NAMES}
        return {n: v for n, v in out.items() if not isinstance(v, Default)}

    def to_core(self) -> dict[str, Any]:
        """The passed keywords under the core's ScalerConfig field names."""
        return {self.CORE_NAME.get(n, n): v for n, v in self.passed().items()}

    def scaler(self, base: ScalerConfig) -> ScalerConfig:
        """base with every passed keyword's value (a dynamic scaler: these set its rule)."""
        core = self.to_core()
        check_scaler_values({**_scaler_values(base), **core}, {"init_scale": "initial_scale"})
        return replace(base, **core) if core else base

    def refuse(self, call: str, why: str) -> None:
        """Raise naming the passed keywords when the precision has no scaler they could set."""
        passed = self.passed()
        if passed:
            shown = ", ".join(f"{n}={v!r}" for n, v in passed.items())
            raise ValueError(f"{call}({shown}): {why}; leave the scaler keywords unset.")


ScalerKeywords.NAMES = tuple(f.name for f in fields(ScalerKeywords))


# Keys each Colossal-AI mode accepts in its amp_config / fp16=dict(...) (seed 000), plus
# mixprec's additions (dtype, hysteresis, min_scale, max_scale on TORCH).
TORCH_KEYS = (*SCALING_KEYWORDS, "dtype")
NAIVE_KEYS = (
    "log_num_zeros_in_grad",
    *ScalerKeywords.NAMES,
    "verbose",
    "dtype",
    "keep_norm_fp32",
    "clip_grad_norm",
    "dynamic_grad_scale",
)
NAIVE_DYNAMIC_KEYS = tuple(key for key in ScalerKeywords.NAMES if key != "initial_scale")
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


def _scaler_values(scaler: ScalerConfig) -> dict[str, Any]:
    return {"min_scale": scaler.min_scale, "max_scale": scaler.max_scale}


LOW_LEVEL_ZERO_SCALER = replace(NAIVE_SCALER, max_scale=2.0**32)
"""LowLevelZeroPlugin's scaler defaults (Colossal's signature): Megatron's rule from 2**32,
capped at 2**32."""
HYBRID_SCALER = replace(LOW_LEVEL_ZERO_SCALER, init_scale=APEX_SCALER.init_scale)
"""HybridParallelPlugin's (Colossal's signature): LowLevelZeroPlugin's, starting at 2**16."""
ZERO_OPTIMIZER_SCALER = replace(APEX_SCALER, hysteresis=2)
"""LowLevelZeroOptimizer's (Colossal's signature): Apex's 2**16 .. 2**24, hysteresis 2."""


# The core's to_policy / preset take AMP_TYPE (a str enum) and its values ("torch", ...) through
# these aliases, and parse the TORCH / NAIVE keys with these parsers.
for _amp_type, _mode in AMP_TYPE_TO_MODE.items():
    register_mode_alias(_amp_type.value, _mode)
register_mode_parser("fp16", torch_amp_policy)
register_mode_parser("fp16_naive", naive_amp_policy)
