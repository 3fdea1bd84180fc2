"""Colossal-AI's face: `convert_to_amp(model, optimizer, criterion, AMP_TYPE.X, amp_config)`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from mixprec.amp_type import AMP_TYPE
from mixprec.core.multi_loss import prepare_loss_optimizer
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import MODES, Policy, to_policy
from mixprec.core.prepare import FP32Criterion, PrecisionModule, prepare_model, prepare_optimizer
from mixprec.mixed_precision import ColossalMultiLossOptimizer, OptimizerWrapperAPI


class AMPOptimizer(OptimizerWrapperAPI, MixedPrecisionOptimizer):
    """What convert_to_amp returns for one loss: the core optimizer wrapper with Colossal-AI's
    OptimizerWrapper methods, clip_grad_norm(model, max_norm) among them."""


def convert_to_amp(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: Callable[..., torch.Tensor] | None,
    mode: AMP_TYPE | str | Policy | Mapping[str, Any],
    amp_config: Mapping[str, Any] | None = None,
) -> tuple[PrecisionModule, AMPOptimizer | ColossalMultiLossOptimizer, FP32Criterion | None]:
    """Convert model, optimizer and criterion to mixed precision.

    mode: AMP_TYPE.TORCH / APEX / NAIVE, a mixprec mode name ('bf16', 'fp16', ...), a config
    file's `dict(mode=..., **keys)` or a Policy; required (None is refused, as Colossal-AI asserts an AMP_TYPE: fp32 is 'fp32').
    amp_config: that mode's keys (seed 000: init_scale, growth_interval, ... for TORCH;
    initial_scale, hysteresis, ... for NAIVE; opt_level, loss_scale, ... for APEX).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model)!r}.")
    if not isinstance(mode, AMP_TYPE | str | Policy | Mapping):
        valid = ", ".join(f"AMP_TYPE.{t.name}" for t in AMP_TYPE)
        raise TypeError(
            f"convert_to_amp(mode={mode!r}); valid: {valid}, a mixprec mode name "
            f"({', '.join(map(repr, MODES))}), a dict(mode=..., **keys) or a Policy."
        )
    policy = to_policy(mode, amp_config)
    model = prepare_model(model, policy)
    # APEX with num_losses=N: N scalers, optimizer.backward(loss, loss_id=i)
    optimizer = prepare_loss_optimizer(
        optimizer, policy, single=AMPOptimizer, multi=ColossalMultiLossOptimizer
    )
    return model, optimizer, (None if criterion is None else FP32Criterion(criterion))


def convert_to_naive_amp(
    model: nn.Module, optimizer: torch.optim.Optimizer, amp_config: Mapping[str, Any] | None = None
) -> tuple[PrecisionModule, AMPOptimizer]:
    """Colossal-AI's legacy `convert_to_naive_amp(model, optimizer, amp_config)`: AMP_TYPE.NAIVE.

    amp_config: initial_scale, growth_factor, ..., clip_grad_norm (clip the unscaled fp32
    master grads in step(); 0: off), dynamic_grad_scale (False: a constant initial_scale).
    """
    model, optimizer, _ = convert_to_amp(model, optimizer, None, AMP_TYPE.NAIVE, amp_config)
    return model, optimizer


def convert_to_apex_amp(
    model: nn.Module, optimizer: torch.optim.Optimizer, amp_config: Mapping[str, Any] | None = None
) -> tuple[PrecisionModule, AMPOptimizer | ColossalMultiLossOptimizer]:
    """Colossal-AI's legacy `convert_to_apex_amp(model, optimizer, amp_config)`: Apex's keys."""
    model, optimizer, _ = convert_to_amp(model, optimizer, None, AMP_TYPE.APEX, amp_config)
    return model, optimizer


def convert_to_torch_amp(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: Callable[..., torch.Tensor] | None = None,
    amp_config: Mapping[str, Any] | None = None,
) -> tuple[PrecisionModule, AMPOptimizer, FP32Criterion | None]:
    """Colossal-AI's legacy `convert_to_torch_amp(model, optimizer, criterion, amp_config)`."""
    return convert_to_amp(model, optimizer, criterion, AMP_TYPE.TORCH, amp_config)


__all__ = [
    "AMP_TYPE",
    "AMPOptimizer",
    "convert_to_amp",
    "convert_to_apex_amp",
    "convert_to_naive_amp",
    "convert_to_torch_amp",
    "prepare_optimizer",
]
