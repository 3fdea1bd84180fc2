"""Every face's fp8 switch, parsed once: Colossal's `use_fp8`, a config's `fp8` section and the
'fp8' mode's keys (FP8MixedPrecision, Lightning's MixprecPrecision) become one Float8Config on
the Policy (Policy.fp8_config), which the core hands to convert_to_fp8 in prepare_model.
mixprec.fp8 registers fp8_mode_policy as the core's parser of the 'fp8' mode."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mixprec.core.policy import Policy, check_keys, did_you_mean, preset
from mixprec.fp8.config import RECIPES, Float8Config

FLOAT8_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Float8Config))
"""Float8Config's fields: the keys of a config's fp8 section and of the 'fp8' mode's config."""
FP8_SPELLINGS = (
    f"True (Float8Config(): {Float8Config().recipe!r}), False, a recipe name "
    f"({', '.join(repr(r) for r in RECIPES)}), a Float8Config, or a dict of Float8Config's fields"
)
"""What every face's fp8 switch takes (use_fp8, the config's fp8 section), for messages."""


def to_float8_config(spec: Any, where: str) -> Float8Config | None:
    """Every face's fp8 switch -> the Float8Config it means, or None for False (fp8 off).

    True is Colossal's use_fp8 (the default config: recipe 'tensorwise'); a recipe name, a
    Float8Config or a dict of its fields are mixprec's extension. `where` names the keyword
    in messages; anything else raises naming the value and the valid spellings.
    """
    if spec is False:
        return None
    if spec is True:
        return Float8Config()
    if isinstance(spec, Float8Config):
        return spec
    if isinstance(spec, str):
        if spec not in RECIPES:
            raise ValueError(
                f"{where}={spec!r} is not a float8 recipe." + did_you_mean(spec, RECIPES)
            )
        return Float8Config(recipe=spec)
    if isinstance(spec, Mapping):
        check_keys(f"{where} (Float8Config field)", spec, FLOAT8_FIELDS)
        return Float8Config(**spec)
    raise TypeError(f"{where}={spec!r}; valid: {FP8_SPELLINGS}.")


def with_fp8(policy: Policy, spec: Any, where: str) -> Policy:
    """policy with float8 Linear layers as the fp8 switch `spec` says (to_float8_config);
    False leaves it as it is. A policy that already names a float8 config is refused: the
    config is set in one place."""
    config = to_float8_config(spec, where)
    if config is None:
        return policy
    if policy.fp8_config is not None:
        raise ValueError(
            f"{where}={spec!r} with mode {policy.name!r}, which already sets its float8 config "
            f"({policy.fp8_config!r}); set it in one place."
        )
    return dataclasses.replace(policy, fp8=True, fp8_config=config)


def fp8_mode_policy(config: Mapping[str, Any]) -> Policy:
    """The 'fp8' mode's config keys: dtype (the autocast dtype around the float8 GEMMs),
    config (a Float8Config) and Float8Config's fields (each replaces config's; recipe='rowwise'
    alone is Float8Config(recipe='rowwise')). No float8 key: fp8_config None, which
    convert_to_fp8 reads as the default Float8Config."""
    check_keys("'fp8' mode config", config, ("dtype", "config", *FLOAT8_FIELDS))
    policy = preset("fp8", dtype=config.get("dtype"))
    fields = {k: v for k, v in config.items() if k in FLOAT8_FIELDS}
    base = config.get("config")
    if base is None and not fields:
        return policy
    if base is None:
        base = Float8Config()
    elif not isinstance(base, Float8Config):
        raise TypeError(f"'fp8' mode: config must be a Float8Config or None, got {base!r}.")
    fp8_config = dataclasses.replace(base, **fields)  # Float8Config checks each field
    return dataclasses.replace(policy, fp8_config=fp8_config)
