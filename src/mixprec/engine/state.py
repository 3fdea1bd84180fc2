"""The Engine's checkpoint: fp32 weights, optimizer, schedule and the accumulation window.

The weights follow checkpoint.hp_model_state_dict's one rule, as every face's checkpoint does.

Engine.state_dict / load_state_dict hand their pieces to these functions, so the resume
rules (what is saved, what must match on load) read in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from mixprec.core.checkpoint import hp_model_state_copy
from mixprec.core.optim import MixedPrecisionOptimizer

ENGINE_STATE_KEYS: tuple[str, ...] = (
    "model",
    "optimizer",
    "lr_scheduler",
    "accumulated_steps",
    "accumulated_grads",
)
"""Keys of Engine.state_dict(); load_state_dict requires all of them."""


def engine_state_dict(
    module: nn.Module,
    optimizer: MixedPrecisionOptimizer,
    lr_scheduler: Any,
    accumulated_steps: int,
) -> dict[str, Any]:
    """Everything needed to resume bit for bit: fp32 model weights (masters where they
    exist), optimizer (inner state, masters, scaler), scheduler, the accumulation window
    position and, mid-window, the gradients accumulated so far."""
    grads = {}
    if accumulated_steps > 0:
        grads = {
            name: p.grad.detach().clone()
            for name, p in module.named_parameters()
            if p.grad is not None
        }
    return {
        # masters for cast params, fp16/bf16 up-cast, other dtypes (fp64 buffers) as they are
        "model": hp_model_state_copy(module, optimizer),
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict(),
        "accumulated_steps": accumulated_steps,
        "accumulated_grads": grads,
    }


def load_engine_state_dict(
    state_dict: Mapping[str, Any],
    module: nn.Module,
    optimizer: MixedPrecisionOptimizer,
    lr_scheduler: Any,
    gradient_accumulation: int,
) -> int:
    """Restore what engine_state_dict() saved; returns the accumulation window position."""
    missing = [k for k in ENGINE_STATE_KEYS if k not in state_dict]
    if missing:
        raise KeyError(
            f"Not a mixprec Engine checkpoint: lacks {missing}; got keys {sorted(state_dict)}."
        )
    has_sched = state_dict["lr_scheduler"] is not None
    if has_sched != (lr_scheduler is not None):
        raise ValueError(
            f"Checkpoint {'has' if has_sched else 'has no'} LR scheduler state but this "
            f"engine {'has none' if lr_scheduler is None else 'owns one'}: build it "
            "with the same lr_scheduler argument to initialize."
        )
    accumulated = state_dict["accumulated_steps"]
    if not 0 <= accumulated < gradient_accumulation:
        raise ValueError(
            f"Checkpoint accumulated_steps={accumulated!r} does not fit "
            f"gradient_accumulation={gradient_accumulation}."
        )
    module.load_state_dict(state_dict["model"])  # rounds fp32 to each param's dtype
    optimizer.load_state_dict(state_dict["optimizer"])  # masters, then lp <- masters
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(state_dict["lr_scheduler"])
    optimizer.zero_grad(set_to_none=True)
    params = dict(module.named_parameters())
    for name, grad in state_dict["accumulated_grads"].items():
        if name not in params:
            raise KeyError(f"Checkpoint holds a gradient for unknown parameter {name!r}.")
        params[name].grad = grad.to(params[name].device, params[name].dtype).clone()
    return int(accumulated)
