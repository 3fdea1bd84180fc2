"""Apex's user cast registry: register_{half,float,promote}_function and the decorators.

    amp.register_float_function(torch, "sigmoid")   # before amp.initialize, as in Apex
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")

    @amp.half_function
    def fused_gelu(x): ...

A registered function (or decorated one) casts its floating tensor arguments when it runs in
an O1 autocast region: "half" to the region's low dtype (float16, or bfloat16 when asked),
"float" to float32, "promote" to the widest floating dtype among them. It then runs with
autocast off, so the registered cast decides the dtype, not autocast's op lists. Outside such
a region it runs untouched.

Patching: `amp.initialize` with patch_torch_functions (O1's default) replaces each registered
`module.name` with its casting wrapper; an initialize without it (O0, O2, O3, enabled=False)
puts the originals back. Registering while a patching amp is live patches at once.

Difference from Apex: Apex's O1 patched every torch function globally, so casts applied
anywhere after initialize; mixprec's O1 is torch.autocast around the model's forward, so both
autocast and these registered casts apply inside the forward of a model amp.initialize
returned (or any autocast region), and `torch.matmul` called outside returns float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import torch

from mixprec.core.casting import cast_floating

CastKind = Literal["half", "float", "promote"]
CAST_KINDS: tuple[str, ...] = ("half", "float", "promote")


def _autocast_device(args: Any) -> str | None:
    """The device type of an active autocast region the call runs in (None: none active)."""
    types = {t.device.type for t in _floating_tensors(args)} or {"cpu"}
    for device_type in sorted(types):
        if torch.is_autocast_enabled(device_type):
            return device_type
    return None


def _floating_tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.is_floating_point():
                found.append(x)
        elif isinstance(x, list | tuple):
            for item in x:
                visit(item)
        elif isinstance(x, dict):
            for item in x.values():
                visit(item)

    visit(tree)
    return found


def _target_dtype(kind: CastKind, device_type: str, args: Any) -> torch.dtype | None:
    if kind == "half":
        return torch.get_autocast_dtype(device_type)
    if kind == "float":
        return torch.float32
    dtypes = {t.dtype for t in _floating_tensors(args)}
    if not dtypes:
        return None
    return functools.reduce(torch.promote_types, dtypes)  # the widest floating dtype


def casting(fn: Callable[..., Any], kind: CastKind) -> Callable[..., Any]:
    """fn wrapped to cast its floating tensor arguments per `kind` inside autocast regions."""
    if kind not in CAST_KINDS:
        raise ValueError(f"kind={kind!r}; valid: {', '.join(repr(k) for k in CAST_KINDS)}.")
    if not callable(fn):
        raise TypeError(f"{fn!r} is not callable; amp.{kind}_function wraps functions.")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        device_type = _autocast_device((args, kwargs))
        if device_type is None:
            return fn(*args, **kwargs)
        dtype = _target_dtype(kind, device_type, (args, kwargs))
        if dtype is not None:
            args, kwargs = cast_floating((args, kwargs), dtype)
        with torch.autocast(device_type, enabled=False):  # the registered cast decides
            return fn(*args, **kwargs)

    wrapper._mixprec_amp_cast = kind  # type: ignore[attr-defined]
    wrapper._mixprec_amp_original = fn  # type: ignore[attr-defined]
    return wrapper


def half_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: fn runs on low-precision (the autocast dtype) inputs in O1 regions."""
    return casting(fn, "half")


def float_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: fn runs on float32 inputs in O1 regions."""
    return casting(fn, "float")


def promote_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: fn runs on inputs cast to the widest floating dtype among them in O1 regions."""
    return casting(fn, "promote")


# ----- the registry of module functions, patched by amp.initialize -----
_registry: dict[tuple[int, str], tuple[Any, str, CastKind]] = {}
"""(id(module), name) -> (module, name, kind), in registration order."""
_patched: dict[tuple[int, str], Callable[..., Any]] = {}
"""(id(module), name) -> the original function, for every patch in place now."""
_patching = False
"""Whether the live amp.initialize patches (O1 with patch_torch_functions)."""


def _register(module: Any, name: str, kind: CastKind) -> None:
    if not isinstance(name, str):
        raise TypeError(f"function name must be a str, got {name!r}.")
    if not hasattr(module, name):
        raise ValueError(f"No function named {name!r} in module {module!r}.")
    if not callable(getattr(module, name)):
        raise TypeError(f"{module!r}.{name} is {getattr(module, name)!r}, not a function.")
    key = (id(module), name)
    if key in _registry and _registry[key][2] != kind:
        raise ValueError(
            f"{name!r} of {module!r} is already registered as a {_registry[key][2]} function; "
            f"it cannot also be a {kind} function."
        )
    _registry[key] = (module, name, kind)
    if _patching and key not in _patched:
        _patch(module, name, kind)


def _patch(module: Any, name: str, kind: CastKind) -> None:
    original = getattr(module, name)
    _patched[(id(module), name)] = original
    setattr(module, name, casting(original, kind))


def register_half_function(module: Any, function_name: str) -> None:
    """Apex's: `module.function_name` runs on low-precision inputs under O1."""
    _register(module, function_name, "half")


def register_float_function(module: Any, function_name: str) -> None:
    """Apex's: `module.function_name` runs on float32 inputs under O1."""
    _register(module, function_name, "float")


def register_promote_function(module: Any, function_name: str) -> None:
    """Apex's: `module.function_name` runs on inputs promoted to their widest dtype under O1."""
    _register(module, function_name, "promote")


def restore_functions() -> None:
    """Put every patched function back (amp.initialize without patching calls this)."""
    global _patching
    for key, original in reversed(list(_patched.items())):
        module = _registry[key][0]
        setattr(module, key[1], original)
    _patched.clear()
    _patching = False


def patch_functions() -> None:
    """Patch every registered function (amp.initialize with patch_torch_functions)."""
    global _patching
    restore_functions()
    for module, name, kind in _registry.values():
        _patch(module, name, kind)
    _patching = True


def is_patching() -> bool:
    """Whether the registered functions are patched now (by amp.initialize's O1 or amp.init)."""
    return _patching


def apply_to(patch: bool) -> None:
    """What amp.initialize calls: patch when its policy patches torch functions, else restore."""
    if patch:
        patch_functions()
    else:
        restore_functions()


__all__ = [
    "float_function",
    "half_function",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
]
