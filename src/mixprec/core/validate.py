"""Argument checks every face shares: each message names the argument, the value and what is valid.

Python's own errors for a wrong type ("'>' not supported between 'str' and 'int'") name
neither the argument nor the fix; these do, before the value reaches any arithmetic.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

from torch import nn


def _type_name(value: object) -> str:
    return type(value).__name__


def check_bool(name: str, value: Any, *, optional: bool = False) -> None:
    """`value` is True or False (or None when optional): a truthy string like 'no' is refused."""
    if isinstance(value, bool) or (optional and value is None):
        return
    valid = "True, False or None" if optional else "True or False"
    raise TypeError(f"{name}={value!r} must be {valid}, got a {_type_name(value)}.")


def check_real(name: str, value: Any) -> None:
    """`value` is an int or float (not a bool, not a numeric string)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(
            f"{name}={value!r} must be a real number (int or float), got a {_type_name(value)}."
        )


def check_int(name: str, value: Any, *, optional: bool = False) -> None:
    """`value` is an int (not a bool), or None when optional."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        valid = "an int or None" if optional else "an int"
        raise TypeError(f"{name}={value!r} must be {valid}, got a {_type_name(value)}.")


def check_module_has_parameters(name: str, module: Any) -> None:
    """`module` is an nn.Module with at least one parameter: mixed precision has nothing to do
    (no weights to cast, no gradients to scale) in a module without any."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{name} must be an nn.Module, got {module!r} ({_type_name(module)}).")
    if next(module.parameters(), None) is None:
        raise ValueError(
            f"{name}={type(module).__name__} has no parameters: there is nothing to train in "
            "mixed precision. Pass the model that owns the weights."
        )


def check_callable(name: str, value: Any, *, what: str, optional: bool = False) -> None:
    """`value` can be called, or is None when optional; `what` says what it should be."""
    if callable(value) or (optional and value is None):
        return
    valid = what + (" or None" if optional else "")
    raise TypeError(f"{name}={value!r} must be {valid}, got a {_type_name(value)}.")


MAX_NORM_RULE = "must be a real number, finite and >= 0 (0 turns clipping off)"
"""What every face says of a bad max_norm (clip_grad_norm, clip_grad_by_norm, max_norm=...)."""

NORM_TYPE_RULE = "must be a real number > 0 or inf (the p of the gradients' p-norm: 2.0, 1.0, inf)"
"""What every face says of a bad norm_type."""


def check_max_norm(name: str, value: Any) -> float:
    """A clipping norm: a finite real number >= 0 (0: off). nan would clip every gradient to
    nan; inf, which torch takes, never clips and is more likely a mistake than a wish. Returns it
    as a float."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name}={value!r} {MAX_NORM_RULE}, got a {_type_name(value)}.")
    if not 0 <= value < math.inf:  # also refuses nan, for which every comparison is False
        raise ValueError(f"{name}={value!r} {MAX_NORM_RULE}.")
    return float(value)


def check_norm_type(name: str, value: Any) -> float:
    """The p of a gradient norm: a real number > 0, or inf (also torch's spelling 'inf').
    Returns it as a float."""
    if isinstance(value, str) and value.strip().lower() == "inf":
        return math.inf
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name}={value!r} {NORM_TYPE_RULE}, got a {_type_name(value)}.")
    if not value > 0:
        raise ValueError(f"{name}={value!r} {NORM_TYPE_RULE}.")
    return float(value)


_SCALER_RULES: dict[str, tuple[str, Any]] = {
    "init_scale": ("> 0 and finite", lambda v: 0 < v < math.inf),
    "growth_factor": ("> 1 and finite", lambda v: 1 < v < math.inf),
    "backoff_factor": ("in (0, 1)", lambda v: 0 < v < 1),
    "growth_interval": (">= 1", lambda v: v >= 1),
    "hysteresis": (">= 1", lambda v: v >= 1),
    "min_scale": ("> 0 and finite", lambda v: 0 < v < math.inf),
    "max_scale": ("> 0 (inf: no ceiling)", lambda v: v > 0),
}
"""A loss scaler's settings (mixprec.ScalerConfig's fields) and the rule each obeys."""

SCALER_FIELDS = tuple(_SCALER_RULES)
SCALER_INTS = ("growth_interval", "hysteresis")


def check_scaler_value(field: str, value: Any, *, name: str | None = None) -> None:
    """One loss-scaler setting (a ScalerConfig field) against its rule; `name` is the argument
    as the face spells it (Paddle's incr_ratio for growth_factor, Colossal's initial_scale for
    init_scale), so the message names what the user wrote."""
    rule, ok = _SCALER_RULES[field]
    name = name or field
    if field in SCALER_INTS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}.")
    else:
        check_real(name, value)
    if not ok(value):  # nan fails every rule: each compares
        raise ValueError(f"{name}={value!r} must be {rule}.")


def check_scaler_values(values: dict[str, Any], spelled: dict[str, str] | None = None) -> None:
    """check_scaler_value for each given field (spelled: field -> the face's name for it), and
    max_scale >= min_scale when both are given."""
    spelled = spelled or {}
    for field, value in values.items():
        check_scaler_value(field, value, name=spelled.get(field, field))
    low, high = values.get("min_scale"), values.get("max_scale")
    if low is not None and high is not None and high < low:
        raise ValueError(
            f"{spelled.get('max_scale', 'max_scale')}={high!r} must be >= min_scale "
            f"({spelled.get('min_scale', 'min_scale')}={low!r})."
        )
