"""Which layer runs in which dtype under a Policy, and which GEMM dims miss tensor cores."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from mixprec.core.casting import NORM_TYPES, cast_floating, cast_module
from mixprec.core.policy import Policy
from mixprec.debugging._markdown import markdown_table
from mixprec.debugging.conv_layout import ConvNote, conv_notes, gemm_multiple
from mixprec.fp8.config import GEMM_ALIGN, LP_FORWARD_DTYPE
from mixprec.fp8.convert import default_fp8_filter

TENSOR_CORE_MULTIPLE = 8
"""fp16/bf16 GEMM and conv dims that are multiples of 8 run on tensor cores (seed 002, 3.1)."""
FP8_MULTIPLE = GEMM_ALIGN
"""float8 GEMMs (torch._scaled_mm) need K and N divisible by 16."""

GEMM_TYPES: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Bilinear,
    nn.modules.conv._ConvNd,
    nn.RNNBase,
    nn.MultiheadAttention,
)
"""Layers whose main op (matmul, conv, RNN cell) autocast runs in the low dtype."""

ALIGNED_DIMS: tuple[tuple[type[nn.Module], tuple[str, ...]], ...] = (
    (nn.Linear, ("in_features", "out_features")),
    (nn.Bilinear, ("in1_features", "in2_features", "out_features")),
    (nn.modules.conv._ConvNd, ("in_channels", "out_channels")),
    (nn.MultiheadAttention, ("embed_dim",)),
)
"""The GEMM dimensions of each layer type that tensor cores want aligned."""


@dataclass(frozen=True, kw_only=True)
class LayerPrecision:
    """The dtypes of one layer under a policy."""

    name: str
    """Qualified module name."""
    kind: str
    """Module class name."""
    param_dtype: str
    """dtype of its floating parameters under the policy ('-': it has none)."""
    compute: str
    """dtype it computes in by the policy's rules ('as input': the op follows its input)."""
    observed: str | None
    """Output dtype(s) seen in a forward on the example input (None: static view)."""


@dataclass(frozen=True, kw_only=True)
class Misalignment:
    """A GEMM/conv dimension that is not a multiple of the tensor-core tile."""

    name: str
    """Qualified module name."""
    kind: str
    """Module class name."""
    dim: str
    """Attribute holding the dimension ('in_features', 'out_channels', ...)."""
    value: int
    """The dimension."""
    multiple: int
    """What it should be a multiple of (8; 16 for fp8)."""


@dataclass(frozen=True, kw_only=True)
class ModelReport:
    """Per-layer dtypes under one policy, and the tensor-core misalignments."""

    mode: str
    """The policy's name."""
    layers: tuple[LayerPrecision, ...]
    """Leaf layers (and layers with their own parameters), in module order."""
    misaligned: tuple[Misalignment, ...]
    """Linear/Conv/Bilinear/attention dims that are not multiples of `multiple`."""
    multiple: int | None
    """Alignment checked (8, or 16 for fp8); None for an fp32 policy (no low-precision GEMM)."""
    observed: bool
    """True when the dtypes come from a forward on an example input."""
    conv: tuple[ConvNote, ...] = ()
    """Convolution layout findings (channels-last, first-layer channels; seed 002 3.2)."""

    def table(self) -> str:
        """Two markdown sections: precision by layer, then tensor-core alignment."""
        view = "observed on the example input" if self.observed else "static view"
        headers = ["layer", "type", "params", "compute"] + (["observed"] if self.observed else [])
        rows = [
            [layer.name, layer.kind, layer.param_dtype, layer.compute]
            + ([layer.observed or "not run"] if self.observed else [])
            for layer in self.layers
        ]
        parts = [
            f"## Precision by layer (mode {self.mode!r}, {view})",
            markdown_table(headers, rows),
        ]
        if self.multiple is None:
            parts.append(
                "## Tensor-core alignment\n\nNot checked: fp32 mode runs no fp16/bf16 GEMMs."
            )
        elif not self.misaligned:
            parts.append(
                f"## Tensor-core alignment\n\nEvery Linear/Conv dimension is a multiple of "
                f"{self.multiple}."
            )
        else:
            rows = [[m.name, m.kind, m.dim, m.value, m.multiple] for m in self.misaligned]
            parts.append(
                f"## Tensor-core alignment: {len(rows)} dimension(s) not a multiple of "
                f"{self.multiple}\n\n"
                + markdown_table(["layer", "type", "dimension", "value", "multiple of"], rows)
            )
        if self.multiple is not None and self.conv:
            rows = [[note.name or "<model>", note.finding] for note in self.conv]
            parts.append("## Convolution layout\n\n" + markdown_table(["layer", "finding"], rows))
        return "\n\n".join(parts)


def _reported_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, module)
        for name, module in model.named_modules()
        if not any(True for _ in module.children()) or module._parameters
    ]


def misaligned_dims(model: nn.Module, multiple: int) -> list[Misalignment]:
    """Every GEMM/conv dimension of `model`'s layers that is not a multiple of `multiple`."""
    if multiple < 1:
        raise ValueError(f"multiple={multiple!r} must be >= 1.")
    found = []
    for name, module in model.named_modules():
        for layer_type, dims in ALIGNED_DIMS:
            if not isinstance(module, layer_type):
                continue
            for dim in dims:
                value = getattr(module, dim)
                if value % multiple:
                    found.append(
                        Misalignment(
                            name=name or "<model>",
                            kind=type(module).__name__,
                            dim=dim,
                            value=value,
                            multiple=multiple,
                        )
                    )
    return found


def _static_dtypes(name: str, module: nn.Module, policy: Policy) -> tuple[str, str]:
    floating = [p for p in module._parameters.values() if p is not None and p.is_floating_point()]
    kept = policy.keep_norm_fp32 and isinstance(module, NORM_TYPES)
    param_dtype = torch.float32 if kept else policy.param_dtype
    params = _dtype_name(param_dtype) if floating else "-"
    if policy.casts_params:  # the model itself is low precision; kept norms compute in fp32
        return params, _dtype_name(param_dtype)
    if policy.compute_dtype is None:
        return params, "float32"
    if policy.fp8 and isinstance(module, nn.Linear) and default_fp8_filter(module, name) is True:
        return params, _dtype_name(LP_FORWARD_DTYPE)  # what convert_to_fp8 would swap in
    if isinstance(module, GEMM_TYPES):
        return params, _dtype_name(policy.compute_dtype)
    return params, "as input"


def _dtype_name(dtype: torch.dtype) -> str:
    # dtypes print as 'torch.float16'; the report drops the prefix
    return str(dtype).removeprefix("torch.")


def _observe(
    model: nn.Module, policy: Policy, example_input: Any, names: list[str]
) -> dict[str, str]:
    # Cast a copy when the policy casts parameters: the caller's model stays as it was.
    if policy.casts_params:
        model = cast_module(
            copy.deepcopy(model), policy.param_dtype, keep_norm_fp32=policy.keep_norm_fp32
        )
        example_input = cast_floating(example_input, policy.param_dtype)
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    device = next(
        (t.device for t in tree_leaves(args) if isinstance(t, torch.Tensor)), torch.device("cpu")
    )
    seen: dict[str, set[str]] = {name: set() for name in names}
    modules = dict(model.named_modules())
    handles = []

    def make_hook(layer_name: str):
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            for leaf in tree_leaves(output):
                if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                    seen[layer_name].add(_dtype_name(leaf.dtype))
                    break

        return hook

    training = {module: module.training for module in model.modules()}
    try:
        for layer_name in names:
            # prepend: see what the layer computed, before a kept-fp32 layer's recast hook
            hook = make_hook(layer_name)
            handles.append(modules[layer_name].register_forward_hook(hook, prepend=True))
        model.eval()  # no BatchNorm running-stat updates on the caller's model
        with (
            torch.no_grad(),
            torch.autocast(
                device.type,
                dtype=policy.compute_dtype,
                enabled=policy.compute_dtype not in (None, torch.float32),
            ),
        ):
            model(*args)
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in training.items():
            module.train(mode)
    return {name: ", ".join(sorted(dtypes)) for name, dtypes in seen.items() if dtypes}


def model_report(
    model: nn.Module,
    policy: Policy,
    example_input: Any = None,
    *,
    gpu_capability: tuple[int, int] | None = None,
) -> ModelReport:
    """Which layers run in which dtype under `policy`, and Linear/Conv dims off the tensor-core grid.

    Without example_input: the static view from the policy's rules. With it (a tensor or a
    tuple of positional arguments): one no-grad forward under torch.autocast(compute_dtype)
    (on a cast copy when the policy casts parameters) reports each layer's real output dtype.
    Float8 linears are not swapped in for that forward; their row shows the static view.
    gpu_capability: the CUDA compute capability to check alignment for (8.0+: 16-wide tiles).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_report needs an nn.Module, got {type(model).__name__}.")
    if not isinstance(policy, Policy):
        raise TypeError(
            f"model_report needs a mixprec Policy (e.g. mixprec.core.policy.preset('bf16')), "
            f"got {policy!r}."
        )
    multiple = (
        None
        if policy.low_dtype is None
        else gemm_multiple(gpu_capability, FP8_MULTIPLE if policy.fp8 else TENSOR_CORE_MULTIPLE)
    )
    misaligned = misaligned_dims(model, multiple) if multiple is not None else []
    layers = _reported_layers(model)
    observed = (
        _observe(model, policy, example_input, [name for name, _ in layers])
        if example_input is not None
        else {}
    )
    rows = []
    for name, module in layers:
        params, compute = _static_dtypes(name, module, policy)
        rows.append(
            LayerPrecision(
                name=name or "<model>",
                kind=type(module).__name__,
                param_dtype=params,
                compute=compute,
                observed=observed.get(name),
            )
        )
    return ModelReport(
        mode=policy.name,
        layers=tuple(rows),
        misaligned=tuple(misaligned),
        multiple=multiple,
        observed=example_input is not None,
        conv=tuple(conv_notes(model)),
    )
