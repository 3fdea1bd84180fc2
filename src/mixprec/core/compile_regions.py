"""Repeated blocks of a model, each traced and compiled once inside compile_step's graph.

A model built as a stack of identical blocks (the children of an nn.Sequential or
nn.ModuleList with the same class and the same parameter and buffer shapes: transformer
layers, residual MLP blocks) costs a whole-graph compile once per block: dynamo traces each
block again, and inductor lowers and schedules each copy of its kernels. Marking the block's
forward a nested compile region (torch.compiler.nested_compile_region: dynamo's
invoke_subgraph) traces it once and calls the same compiled code for every block; the forward
runs the same ops, and its backward is one compiled region too.

Each region is a function of tensors only: the block's parameters are arguments, and the
block group's first module runs them (torch.func.functional_call). A region over the block's
own bound forward (the module as its argument) traced and ran, but every block after the
first computed with wrong values under aot_autograd (torch 2.13: the loss of the very first
step already differed from eager; dynamo alone matched), so no region takes a module.

The mark is an instance `forward` set on each block only while the step runs
(BlockRegions.installed), so the user's model is the same object, with no attribute left
behind, outside the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module


def _signature(module: nn.Module) -> tuple:
    """What two blocks must share to run one compiled region: the class, every parameter's
    name, shape, dtype and requires_grad, and the training flag."""
    params = tuple(
        (name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in module.named_parameters()
    )
    return type(module), params, module.training


def _runnable(module: nn.Module) -> bool:
    """Whether module can run as a region: parameters, no buffers (the region passes each
    block's parameters as arguments; its buffers would be the template block's), and no
    instance `forward` of its own (the region replaces it)."""
    has_params = any(True for _ in module.parameters())
    has_buffers = any(True for _ in module.buffers())
    return has_params and not has_buffers and "forward" not in vars(module)


def repeated_blocks(model: nn.Module) -> list[list[nn.Module]]:
    """Groups of two or more children of one nn.Sequential / nn.ModuleList (anywhere in model)
    with one signature (_signature), outermost first: a block inside a marked block is not
    looked at. Blocks that cannot run as a region (_runnable) are left out."""
    groups: list[list[nn.Module]] = []
    marked: set[int] = set()

    def visit(module: nn.Module) -> None:
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            by_signature: dict[tuple, list[nn.Module]] = {}
            for child in module.children():
                if not _runnable(child):
                    continue
                by_signature.setdefault(_signature(child), []).append(child)
            for group in by_signature.values():
                # one module listed twice is one block
                unique = list({id(m): m for m in group}.values())
                if len(unique) > 1:
                    groups.append(unique)
                    marked.update(id(m) for m in unique)
        for child in module.children():
            if id(child) not in marked:
                visit(child)

    visit(model)
    return groups


def explicit_blocks(model: nn.Module, blocks: Iterable[Any]) -> list[list[nn.Module]]:
    """The blocks a caller names, grouped by signature; each must be a submodule of model."""
    inside = {id(m) for m in model.modules()}
    by_signature: dict[tuple, list[nn.Module]] = {}
    for block in blocks:
        if not isinstance(block, nn.Module) or id(block) not in inside:
            raise ValueError(
                f"regions: {block!r} is not a submodule of the model; pass 'auto', None, or "
                "submodules of the model (its repeated blocks)."
            )
        if not _runnable(block):
            raise ValueError(
                f"regions: {type(block).__name__} cannot be a region: it needs parameters and "
                "no buffers (a region passes each block's parameters; a buffer, e.g. "
                "BatchNorm's running stats, would be the first block's) and no instance "
                "`forward` of its own (the region replaces it); leave it out."
            )
        group = by_signature.setdefault(_signature(block), [])
        if all(m is not block for m in group):
            group.append(block)
    return list(by_signature.values())


def _call_with(template: nn.Module, names: tuple[str, ...], autocast: tuple[str, Any]):
    """template's forward run with the given tensors as its parameters (torch.func's
    functional_call, without its __call__: the template's own forward is its mark), under
    torch.autocast as given: (device type, dtype, or None for off)."""
    forward = type(template).forward
    device_type, dtype = autocast

    def call(*args: Any, **kwargs: Any) -> Any:
        params = dict(zip(names, args[: len(names)], strict=True))
        with (
            torch.autocast(device_type, dtype=dtype, enabled=dtype is not None),
            _reparametrize_module(template, params),
        ):
            return forward(template, *args[len(names) :], **kwargs)

    return call


AUTOCAST_DTYPES = (None,)
"""The autocast states a block runs as a region in: off only; under autocast a block runs
inline in the step's graph. torch 2.13, aot_autograd: a region called under bf16 autocast ran
its forward in fp32 (the first step's loss differed from eager); one that enters the caller's
autocast itself matched the forward bitwise, but its backward differed from eager's (the grads
after a step, by fp32 rounding), as if the region's backward were traced under its autocast."""


class BlockRegions:
    """Each group's blocks with one nested compile region over their forward."""

    def __init__(self, groups: list[list[nn.Module]]) -> None:
        self.groups = groups
        self._marks: list[tuple[nn.Module, Any]] = []
        for group in groups:
            template = group[0]
            names = tuple(name for name, _ in template.named_parameters())
            device_type = next(template.parameters()).device.type
            regions = {
                dtype: torch.compiler.nested_compile_region(
                    _call_with(template, names, (device_type, dtype))
                )
                for dtype in AUTOCAST_DTYPES
            }
            for block in group:
                self._marks.append((block, _forward_of(block, device_type, regions)))

    @property
    def blocks(self) -> int:
        return len(self._marks)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Each block's forward is its region while inside (a no-op when run eagerly)."""
        for block, mark in self._marks:
            block.__dict__["forward"] = mark
        try:
            yield
        finally:
            for block, _ in self._marks:
                block.__dict__.pop("forward", None)


def _forward_of(block: nn.Module, device_type: str, regions: dict[Any, Any]):
    """block's mark: its forward as the region of the autocast state it is called in."""
    params = tuple(block.parameters())
    forward = type(block).forward

    def mark(*args: Any, **kwargs: Any) -> Any:
        dtype = None
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
        region = regions.get(dtype)
        if region is None:
            return forward(block, *args, **kwargs)
        return region(*params, *args, **kwargs)

    return mark


def block_regions(model: nn.Module, regions: Any) -> BlockRegions:
    """compile_step's `regions`: "auto" (repeated_blocks), None (none), or the blocks."""
    if regions is None:
        return BlockRegions([])
    if isinstance(regions, str):
        if regions != "auto":
            raise ValueError(
                f"regions={regions!r}: pass 'auto' (repeated children of nn.Sequential / "
                "nn.ModuleList), None (no regions), or a list of the model's blocks."
            )
        return BlockRegions(repeated_blocks(model))
    if isinstance(regions, nn.Module) or not isinstance(regions, Iterable):
        raise ValueError(
            f"regions={regions!r}: pass 'auto', None, or a list of the model's blocks."
        )
    return BlockRegions(explicit_blocks(model, regions))
