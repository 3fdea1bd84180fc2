"""Whether a model repeats its structure: compile_step's `regions="auto"` asks this.

A model built as a stack of identical blocks (children of an nn.Sequential or nn.ModuleList
with the same class and the same parameter names, shapes and dtypes: transformer layers,
residual MLP blocks) has many params of each shape, and compile_step unrolled one update per
param into its graph; inductor's fusion pass and the C++ wrapper's one-file build grew faster
than that graph. With regions="auto" and repeated blocks, compile_step compiles each kind of
param update once, as a nested compile region (see compiled_step._update_values).

The blocks' forward is not made a region: in torch 2.13 (CPU) no form of it gave the step's
values under inductor.
- A region over the block's bound forward (torch.compiler.nested_compile_region(
  type(block).forward), the module an argument): under aot_autograd every block after the
  first computed wrong values (the first step's loss already differed from eager's).
- A region over a function of the block's parameters (functional_call style, every tensor an
  argument): bitwise equal to the eager step under aot_eager, but under inductor the weights
  after 4 AdamW steps (3 residual MLP blocks, width 8, fp32) differed by up to 0.02 and held
  nan, where the one-graph step matches eager within 3e-8 and the update regions alone within
  5e-7.
- Under bf16 autocast a region ran its forward in fp32 (it does not take the caller's autocast
  state), and one that entered that state itself differed from eager in its backward.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger("mixprec")


def _signature(module: nn.Module) -> tuple:
    """What makes two blocks the same: the class and every parameter's name, shape, dtype and
    requires_grad."""
    params = tuple(
        (name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in module.named_parameters()
    )
    return type(module), params


def repeated_blocks(model: nn.Module) -> list[list[nn.Module]]:
    """Groups of two or more children of one nn.Sequential / nn.ModuleList (anywhere in model)
    that have parameters and share a signature (_signature), outermost first: a block inside a
    repeated block is not looked at again."""
    groups: list[list[nn.Module]] = []
    grouped: set[int] = set()

    def visit(module: nn.Module) -> None:
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            by_signature: dict[tuple, dict[int, nn.Module]] = {}
            for child in module.children():
                if any(True for _ in child.parameters()):
                    by_signature.setdefault(_signature(child), {})[id(child)] = child
            for group in by_signature.values():  # a module listed twice is one block
                if len(group) > 1:
                    groups.append(list(group.values()))
                    grouped.update(group)
        for child in module.children():
            if id(child) not in grouped:
                visit(child)

    visit(model)
    return groups


REGIONS = ("auto", True, False)
"""compile_step's `regions` values."""


def regions_supported() -> bool:
    """Whether this torch's nested_compile_region takes a reuse key (reuse_hash_fn, torch
    2.13). Without it (torch 2.11: `nested_compile_region(fn=None, options=None)`) the update
    regions, closures over one code object, cannot be told apart: dynamo reuses one region for
    regions that differ (measured on 2.11: 5 subgraphs where 4 kinds of update were asked for)."""
    region = getattr(torch.compiler, "nested_compile_region", None)
    return region is not None and "reuse_hash_fn" in inspect.signature(region).parameters


def use_regions(model: nn.Module, regions: Any) -> bool:
    """compile_step's `regions`: "auto" (when the model repeats blocks: repeated_blocks, and
    this torch supports regions: regions_supported), True or False."""
    if regions == "auto" and isinstance(regions, str):
        if not repeated_blocks(model):
            return False
        if not regions_supported():
            log.info(
                "compile_step(regions='auto'): torch %s's nested_compile_region takes no "
                "reuse_hash_fn, so the step compiles as one graph.",
                torch.__version__,
            )
            return False
        return True
    if isinstance(regions, bool):
        if regions and not regions_supported():
            raise ValueError(
                f"compile_step(regions=True) needs torch.compiler.nested_compile_region with "
                f"reuse_hash_fn (torch 2.13); torch {torch.__version__} has none. Pass "
                "regions=False (one graph) or 'auto' (one graph on this torch)."
            )
        return regions
    raise ValueError(
        f"regions={regions!r}: pass 'auto' (update regions when the model repeats blocks: "
        "identical children of nn.Sequential / nn.ModuleList), True or False."
    )
