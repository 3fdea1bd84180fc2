"""convert_to_fp8: swap eligible nn.Linear layers for Float8Linear, saying which stay and why."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from mixprec.fp8.config import GEMM_ALIGN, Float8Config
from mixprec.fp8.kernels import resolve_emulate
from mixprec.fp8.linear import Float8Linear

logger = logging.getLogger(__name__)

Float8Filter = Callable[[nn.Linear, str], "bool | str"]
"""(module, fully qualified name) -> True to convert; False or a reason string to leave it."""


def default_fp8_filter(module: nn.Linear, fqn: str) -> bool | str:
    """Convert a Linear unless its in/out features are not multiples of 16 (says which)."""
    bad = [
        f"{name}={value}"
        for name, value in (
            ("in_features", module.in_features),
            ("out_features", module.out_features),
        )
        if value % GEMM_ALIGN
    ]
    if bad:
        return f"{' and '.join(bad)} not a multiple of {GEMM_ALIGN} (float8 GEMM alignment)"
    return True


@dataclass(frozen=True, kw_only=True)
class Float8Summary:
    """What convert_to_fp8 did: the layers converted and the ones left in high precision."""

    converted: tuple[str, ...] = ()
    """Fully qualified names of the layers now Float8Linear."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Linear layers left as they were -> why."""

    def __str__(self) -> str:
        lines = [
            f"float8: {len(self.converted)} Linear layer(s) converted, {len(self.skipped)} left"
        ]
        lines += [f"  kept {fqn or '<root>'}: {why}" for fqn, why in self.skipped.items()]
        return "\n".join(lines)


def convert_to_fp8(
    model: nn.Module,
    module_filter_fn: Float8Filter | None = None,
    config: Float8Config | None = None,
) -> tuple[nn.Module, Float8Summary]:
    """Swap eligible nn.Linear layers of `model` for Float8Linear, in place.

    module_filter_fn(module, fqn) returns True to convert, False or a reason string to keep the
    layer (default: default_fp8_filter). Returns the model (a new object only when the model
    itself is a Linear) and a summary, which is also logged. Raises RuntimeError now if a
    converted layer sits on a device without float8 kernels and emulation was not chosen.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"convert_to_fp8 needs an nn.Module, got {type(model).__name__}: {model!r}."
        )
    if config is None:
        config = Float8Config()
    elif not isinstance(config, Float8Config):
        raise TypeError(f"config must be a Float8Config or None, got {config!r}.")
    filter_fn = module_filter_fn if module_filter_fn is not None else default_fp8_filter
    converted: list[str] = []
    skipped: dict[str, str] = {}
    swaps: dict[int, nn.Module] = {}  # id(old) -> new: a Linear shared by two parents swaps once
    targets: list[tuple[str, nn.Module]] = []
    for fqn, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, nn.Linear):
            continue
        if isinstance(module, Float8Linear):
            skipped[fqn] = "already a Float8Linear"
            continue
        if type(module) is not nn.Linear:
            skipped[fqn] = (
                f"{type(module).__name__} subclasses nn.Linear; its users may bypass forward"
            )
            continue
        if id(module) not in swaps:
            verdict = filter_fn(module, fqn)
            if verdict is True:
                swaps[id(module)] = Float8Linear.from_float(module, config)
            elif verdict is False or isinstance(verdict, str):
                skipped[fqn] = verdict or "module_filter_fn returned False"
                continue
            else:
                raise TypeError(
                    f"module_filter_fn returned {verdict!r} for {fqn!r}; "
                    "valid: True, False or a reason string."
                )
        targets.append((fqn, swaps[id(module)]))
    for fqn, new in targets:
        converted.append(fqn)
        if fqn == "":
            model = new
        else:
            parent_fqn, _, name = fqn.rpartition(".")
            setattr(model.get_submodule(parent_fqn), name, new)
    for device in {new.weight.device for new in swaps.values()} - {torch.device("meta")}:
        resolve_emulate(device, config)  # fail at conversion, not at the first step
    summary = Float8Summary(converted=tuple(converted), skipped=skipped)
    logger.info("float8: converted %s", ", ".join(converted) or "no Linear layer")
    if skipped:
        logger.warning(
            "float8: %d Linear layer(s) left in high precision: %s",
            len(skipped),
            "; ".join(f"{fqn or '<root>'} ({why})" for fqn, why in skipped.items()),
        )
    return model, summary
