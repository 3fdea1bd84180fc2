"""convert_to_fp8: swap eligible nn.Linear / HF Conv1D layers for float8 ones, saying which stay."""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from mixprec.core.policy import did_you_mean
from mixprec.core.validate import check_callable
from mixprec.fp8.config import (
    GEMM_ALIGN,
    RECIPES,
    TELEMETRY_ATTR,
    Float8Config,
    misaligned_features,
)
from mixprec.fp8.kernels import ROWWISE_KERNEL_RECIPES, resolve_emulate, resolve_recipe_kernel
from mixprec.fp8.linear import Float8Conv1D, Float8Linear, is_hf_conv1d
from mixprec.fp8.telemetry import Float8Telemetry

logger = logging.getLogger(__name__)

Float8Filter = Callable[[nn.Linear, str], "bool | str | Float8Config"]
"""(module, fully qualified name) -> True to convert (with convert_to_fp8's config), a
Float8Config to convert with that config (per-module recipes), False or a reason string to
leave it in high precision."""

KEEP = "keep"
"""The rule value of per_module_recipes that leaves a layer in high precision."""


def default_fp8_filter(module: nn.Linear, fqn: str) -> bool | str:
    """Convert a Linear unless its in/out features are not multiples of 16 (says which)."""
    return misaligned_features(module.in_features, module.out_features) or True


def per_module_recipes(
    model: nn.Module,
    rules: Mapping[str, str] | None = None,
    *,
    config: Float8Config | None = None,
    keep_first_last: bool = True,
) -> Float8Filter:
    """A module_filter_fn choosing each Linear's recipe, or high precision, by name.

    rules: fnmatch patterns on the fully qualified name -> a recipe name or 'keep'; the first
    matching pattern (in the mapping's order) decides, before anything below. Unmatched layers:
    - kept when keep_first_last and they are the first or the last Linear-like layer of `model`
      in named_modules order (registration order; Megatron keeps the first and last layers in
      bf16, torchao's recipes skip the output head): the layers nearest the embeddings and the
      logits are the most sensitive to quantization error;
    - kept when in_features or out_features is not a multiple of 16 (default_fp8_filter);
    - otherwise converted with `config` (default Float8Config()).
    A rule's recipe replaces config's recipe (its other fields stay); an unmatched layer gets
    config as it is. Pass the result as convert_to_fp8's (or FP8MixedPrecision's)
    module_filter_fn.
    """
    rules = dict(rules or {})
    for pattern, choice in rules.items():
        if not isinstance(pattern, str):
            raise TypeError(f"per_module_recipes: rule pattern {pattern!r} must be a str.")
        if choice != KEEP and choice not in RECIPES:
            raise ValueError(
                f"per_module_recipes: rule {pattern!r} -> {choice!r}."
                + did_you_mean(choice, (*RECIPES, KEEP))
            )
    base = config if config is not None else Float8Config()
    if not isinstance(base, Float8Config):
        raise TypeError(f"config must be a Float8Config or None, got {config!r}.")
    linears = [
        fqn
        for fqn, module in model.named_modules()
        if isinstance(module, nn.Linear) or is_hf_conv1d(module)
    ]
    ends = {linears[0]: "the first", linears[-1]: "the last"} if linears else {}
    configs = {
        recipe: base if recipe == base.recipe else dataclasses.replace(base, recipe=recipe)
        for recipe in set(rules.values()) - {KEEP}
    }

    def choose(module: nn.Linear, fqn: str) -> bool | str | Float8Config:
        for pattern, choice in rules.items():
            if fnmatch.fnmatchcase(fqn, pattern):
                if choice == KEEP:
                    return f"kept in high precision by rule {pattern!r}"
                return configs[choice]
        if keep_first_last and fqn in ends:
            return f"{ends[fqn]} Linear layer of the model (kept in high precision)"
        verdict = default_fp8_filter(module, fqn)
        return base if verdict is True else verdict

    return choose


LINEAR_LIKE_KEPT: dict[type[nn.Module], str] = {
    nn.MultiheadAttention: "its in_proj and out_proj GEMMs run inside "
    "F.multi_head_attention_forward, which reads the weights, not Linear.forward",
    nn.Bilinear: "a bilinear form x1^T W x2: no float8 kernel",
}
"""Modules that run Linear-shaped GEMMs convert_to_fp8 cannot swap -> why (named in the summary)."""

SUMMARY_ATTR = "_mixprec_fp8_summary"
"""The converted model's attribute holding its Float8Summary (read it with fp8_summary)."""


@dataclass(frozen=True, kw_only=True)
class Float8Summary:
    """What convert_to_fp8 did: the layers converted and the Linear-like ones left high precision."""

    converted: tuple[str, ...] = ()
    """Fully qualified names of the layers now Float8Linear (or Float8Conv1D)."""
    recipes: dict[str, str] = field(default_factory=dict)
    """Converted layer -> its recipe (Float8Config.recipe)."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Linear-like layers left as they were -> why."""
    telemetry: Float8Telemetry | None = None
    """The Float8Telemetry attached to the model when it has observations (fp8_summary sets
    it); str() then ends with its ranked table (Float8Telemetry.table(), worst SQNR first)."""

    def __str__(self) -> str:
        lines = [
            f"float8: {len(self.converted)} Linear layer(s) converted, {len(self.skipped)} left"
        ]
        by_recipe: dict[str, list[str]] = {}
        for fqn in self.converted:
            by_recipe.setdefault(self.recipes.get(fqn, "tensorwise"), []).append(fqn or "<root>")
        if len(by_recipe) > 1:
            lines += [f"  {recipe}: {', '.join(names)}" for recipe, names in by_recipe.items()]
        lines += [f"  kept {fqn or '<root>'}: {why}" for fqn, why in self.skipped.items()]
        if self.telemetry is not None:
            lines += ["float8 telemetry, worst SQNR first:", self.telemetry.table()]
        return "\n".join(lines)


def fp8_summary(model: nn.Module) -> Float8Summary:
    """The Float8Summary of the last convert_to_fp8 on `model` or on a module inside it.

    Works through wrappers that hold the converted model as a submodule (DDP, torch.compile,
    convert_to_amp's PrecisionModule). When a Float8Telemetry with observations is attached
    to the model's float8 layers, the summary carries it and prints its ranked table.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fp8_summary needs an nn.Module, got {type(model).__name__}: {model!r}.")
    for module in model.modules():
        summary = getattr(module, SUMMARY_ATTR, None)
        if summary is not None:
            attached = (m.__dict__.get(TELEMETRY_ATTR) for m in module.modules())
            telemetry = next((a[0] for a in attached if a is not None and a[0].records), None)
            if telemetry is None:
                return summary
            return dataclasses.replace(summary, telemetry=telemetry)
    raise ValueError(
        f"fp8_summary: {type(model).__name__} was not converted by convert_to_fp8 "
        "(nor is any module inside it)."
    )


def _unswappable_reason(module: nn.Module) -> str | None:
    """Why a Linear-like module stays high precision, or None if it is a candidate."""
    if isinstance(module, Float8Linear):
        return "already a Float8Linear"
    if isinstance(module, nn.Linear) and type(module) is not nn.Linear:
        return f"{type(module).__name__} subclasses nn.Linear; its users may bypass forward"
    return next((why for cls, why in LINEAR_LIKE_KEPT.items() if isinstance(module, cls)), None)


def _to_float8(module: nn.Module, config: Float8Config) -> Float8Linear:
    if is_hf_conv1d(module):
        return Float8Conv1D.from_conv1d(module, config)
    return Float8Linear.from_float(module, config)


def _filter_view(module: nn.Module) -> nn.Module:
    """What module_filter_fn sees: an nn.Linear, or for a Conv1D one with its in/out features."""
    if not is_hf_conv1d(module):
        return module
    in_features, out_features = module.weight.shape
    with torch.device("meta"):  # shapes only: the filter reads in_features / out_features
        return nn.Linear(in_features, out_features, bias=module.bias is not None)


def convert_to_fp8(
    model: nn.Module,
    module_filter_fn: Float8Filter | None = None,
    config: Float8Config | None = None,
) -> nn.Module:
    """Swap eligible nn.Linear and HF Conv1D layers of `model` for float8 ones, in place.

    As torchao's convert_to_float8_training: returns the model (a new object only when the
    model itself is a Linear). module_filter_fn(module, fqn) returns True to convert, False or
    a reason string to keep the layer (default: default_fp8_filter; a Conv1D is shown to it as
    an nn.Linear of its in/out features). What was converted and every Linear-like layer left
    in high precision, with the reason, is logged and kept: read it with fp8_summary(model).
    Raises RuntimeError now if a converted layer sits on a device without float8 kernels and
    emulation was not chosen.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"convert_to_fp8 needs an nn.Module, got {type(model).__name__}: {model!r}."
        )
    if config is None:
        config = Float8Config()
    elif not isinstance(config, Float8Config):
        raise TypeError(f"config must be a Float8Config or None, got {config!r}.")
    check_callable(
        "module_filter_fn",
        module_filter_fn,
        what="a function (module, fqn) -> True, False or a reason string",
        optional=True,
    )
    filter_fn = module_filter_fn if module_filter_fn is not None else default_fp8_filter
    converted: list[str] = []
    skipped: dict[str, str] = {}
    swaps: dict[int, nn.Module] = {}  # id(old) -> new: a Linear shared by two parents swaps once
    targets: list[tuple[str, nn.Module]] = []
    inside_kept: list[str] = []  # a kept module's own Linears (MHA's out_proj) are named already
    for fqn, module in model.named_modules(remove_duplicate=False):
        if any(fqn.startswith(prefix + ".") for prefix in inside_kept):
            continue
        if not (isinstance(module, (nn.Linear, *LINEAR_LIKE_KEPT)) or is_hf_conv1d(module)):
            continue
        why = _unswappable_reason(module)
        if why is not None:
            skipped[fqn] = why
            if not isinstance(module, nn.Linear):
                inside_kept.append(fqn)
            continue
        if id(module) not in swaps:
            verdict = filter_fn(_filter_view(module), fqn)
            if verdict is True or isinstance(verdict, Float8Config):
                swaps[id(module)] = _to_float8(module, config if verdict is True else verdict)
            elif verdict is False or isinstance(verdict, str):
                skipped[fqn] = verdict or "module_filter_fn returned False"
                continue
            else:
                raise TypeError(
                    f"module_filter_fn returned {verdict!r} for {fqn!r}; "
                    "valid: True, a Float8Config, False or a reason string."
                )
        targets.append((fqn, swaps[id(module)]))
    for fqn, new in targets:
        converted.append(fqn)
        if fqn == "":
            model = new
        else:
            parent_fqn, _, name = fqn.rpartition(".")
            setattr(model.get_submodule(parent_fqn), name, new)
    placed = {(new.weight.device, new.config) for new in swaps.values()}
    for device, layer_config in placed:
        if device == torch.device("meta"):
            continue
        # Fail at conversion, not at the first step.
        if layer_config.recipe == "tensorwise":
            resolve_emulate(device, layer_config)
        elif layer_config.recipe in ROWWISE_KERNEL_RECIPES and layer_config.emulate is False:
            resolve_recipe_kernel(device, layer_config, torch.bfloat16)
    recipes = {fqn: new.config.recipe for fqn, new in targets}
    summary = Float8Summary(converted=tuple(converted), recipes=recipes, skipped=skipped)
    logger.info("float8: converted %s", ", ".join(converted) or "no Linear layer")
    if not converted:
        logger.warning(
            "float8: nothing in %s was converted (%s): fp8 converts only nn.Linear and HF "
            "Conv1D layers (features multiples of %d); convolutions, embeddings and the rest "
            "are left as they are, so under mode 'fp8' this model runs exactly as mode 'bf16' "
            "(bf16 autocast). Use mode 'bf16' to say so, or check module_filter_fn.",
            type(model).__name__,
            f"{len(skipped)} Linear-like layer(s) left in high precision"
            if skipped
            else "it has no Linear layer",
            GEMM_ALIGN,
        )
    if skipped:
        logger.warning(
            "float8: %d Linear-like layer(s) left in high precision: %s",
            len(skipped),
            "; ".join(f"{fqn or '<root>'} ({why})" for fqn, why in skipped.items()),
        )
    object.__setattr__(model, SUMMARY_ATTR, summary)  # plain attribute: no state_dict entry
    return model
