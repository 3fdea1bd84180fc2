"""Argument checks every face shares: each message names the argument, the value and what is valid.

Python's own errors for a wrong type ("'>' not supported between 'str' and 'int'") name
neither the argument nor the fix; these do, before the value reaches any arithmetic.
"""

from __future__ import annotations

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
