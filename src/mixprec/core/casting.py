"""Casting modules, inputs and outputs between fp32 and a low-precision dtype."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

NORM_TYPES: tuple[type[nn.Module], ...] = tuple(
    t
    for t in (
        nn.modules.batchnorm._BatchNorm,
        nn.modules.instancenorm._InstanceNorm,
        nn.LayerNorm,
        nn.GroupNorm,
        getattr(nn, "RMSNorm", None),
        nn.SyncBatchNorm,
    )
    if t is not None
)
"""Normalisation layers whose statistics lose accuracy in fp16: kept fp32 when asked."""


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor inside obj (tensors, tuples, lists, dicts, dataclasses) to dtype.

    Integer, bool and complex tensors, and non-tensors, pass through unchanged.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(cast_floating(v, dtype) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(cast_floating(v, dtype) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((k, cast_floating(v, dtype)) for k, v in obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: cast_floating(getattr(obj, f.name), dtype)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **changes)
    return obj


def cast_call_args(
    args: tuple, kwargs: dict[str, Any], dtype: torch.dtype
) -> tuple[tuple, dict[str, Any]]:
    """cast_floating((args, kwargs), dtype) for a call's arguments (every step, in the faces'
    forward and loss): plain tensors and no kwargs skip the generic walk (~4 us a call on CPU)."""
    if kwargs or any(type(a) is not torch.Tensor for a in args):
        return cast_floating((args, kwargs), dtype)
    cast = tuple(a.to(dtype) if a.is_floating_point() and a.dtype != dtype else a for a in args)
    return cast, kwargs


MIXED_CPU_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
)
"""Norms whose CPU kernels take fp16/bf16 input with fp32 params: they accumulate in fp32 and
round the output once, as up-casting would, but save the lp input for backward, not an fp32 copy
(for a ViT, ~10% of fp32's activation memory). CUDA's LayerNorm has no such kernel."""


def _upcast_inputs_hook(module: nn.Module, args: tuple) -> tuple:
    if isinstance(module, MIXED_CPU_NORM_TYPES) and all(
        not isinstance(a, torch.Tensor) or a.device.type == "cpu" for a in args
    ):
        return args
    return cast_floating(args, torch.float32)


def _recast_output_hook(module: nn.Module, args: tuple, output: Any) -> Any:
    # The layer computed in fp32; hand the next layer the model's low dtype again.
    return cast_floating(output, module._mixprec_io_dtype)


def keep_module_fp32(module: nn.Module, io_dtype: torch.dtype) -> None:
    """Make an fp32 module inside a low-precision model: inputs cast up, outputs back to io_dtype."""
    if getattr(module, "_mixprec_kept_fp32", False):
        return
    module._mixprec_io_dtype = io_dtype
    module._mixprec_kept_fp32 = True
    module.register_forward_pre_hook(_upcast_inputs_hook)
    module.register_forward_hook(_recast_output_hook)


def cast_module(
    model: nn.Module,
    dtype: torch.dtype,
    *,
    keep_norm_fp32: bool = True,
    keep_fp32: Callable[[str, nn.Module], bool] | None = None,
) -> nn.Module:
    """Cast model's floating parameters and buffers to dtype in place, except kept-fp32 modules.

    Kept modules are norm layers (when keep_norm_fp32), modules marked @mixprec.fp32, and any
    for which keep_fp32(name, module) is true; they compute in fp32 on up-cast inputs and return dtype outputs.
    """
    from mixprec.core.autocast import is_fp32_module  # modules the user marked @mixprec.fp32

    if not isinstance(model, nn.Module):
        raise TypeError(f"cast_module needs an nn.Module, got {model!r} ({type(model).__name__}).")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"cast_module dtype={dtype!r} must be a floating torch.dtype "
            "(torch.float16, torch.bfloat16, torch.float32)."
        )
    kept: list[nn.Module] = []
    for name, module in model.named_modules():
        if (
            (keep_norm_fp32 and isinstance(module, NORM_TYPES))
            or is_fp32_module(module)
            or (keep_fp32 is not None and keep_fp32(name, module))
        ):
            kept.append(module)
    kept_ids = {id(p) for m in kept for p in [*m.parameters(), *m.buffers()]}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and param.is_floating_point() and id(param) not in kept_ids:
                param.data = param.data.to(dtype)
        for key, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point() and id(buf) not in kept_ids:
                module._buffers[key] = buf.to(dtype)
    for module in kept:
        keep_module_fp32(module, dtype)
    return model
