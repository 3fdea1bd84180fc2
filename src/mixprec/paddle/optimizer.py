"""Paddle optimizers torch has no counterpart of: LarsMomentumOptimizer.

Paddle's Momentum and AdamW are torch's SGD(momentum=...) and AdamW (see
tests/test_paddle_multi_precision.py); Lars (paddle.incubate.optimizer.LarsMomentumOptimizer,
the fourth optimizer of Paddle's test_multi_precision_fp16_train) is written here.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from typing_extensions import override

_LOW = (torch.float16, torch.bfloat16)


def _check_number(name: str, value: Any, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"{name}={value!r} must be a finite number.")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name}={value!r} must be {'> 0' if positive else '>= 0'}.")


class LarsMomentumOptimizer(torch.optim.Optimizer):
    """paddle.incubate.optimizer.LarsMomentumOptimizer: momentum with a layer-wise LR (LARS).

    Per parameter, as Paddle 3.3.1's lars_momentum kernel (tests/data/paddle_331_lars.json):
        g = rescale_grad * grad
        local_lr = learning_rate * lars_coeff * ||p|| / (||g|| + lars_weight_decay * ||p|| + epsilon)
            (learning_rate itself when lars_weight_decay, ||p|| or ||g|| is 0)
        velocity = momentum * velocity + local_lr * (g + lars_weight_decay * p)
        p = p - velocity
    multi_precision: float16/bfloat16 parameters are updated through an fp32 master copy (and
    fp32 velocity) held in the optimizer state, then rounded into the parameter, as Paddle's.
    Without it a low-precision parameter is updated in its own dtype, with Paddle's warning.

    parameter_list: the parameters, or torch param groups (dicts), whose keys may override
    learning_rate (as 'lr'), momentum, lars_coeff, lars_weight_decay, epsilon, rescale_grad:
    a group with lars_weight_decay=0 is Paddle's exclude_from_weight_decay (torch parameters
    have no names to exclude by). The update runs on the device: no host sync.
    """

    def __init__(
        self,
        learning_rate: float,
        momentum: float,
        lars_coeff: float = 0.001,
        lars_weight_decay: float = 0.0005,
        parameter_list: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | None = None,
        epsilon: float = 0.0,
        multi_precision: bool = False,
        rescale_grad: float = 1.0,
    ) -> None:
        if parameter_list is None:
            raise TypeError(
                "LarsMomentumOptimizer needs parameter_list (Paddle's dygraph needs it too): "
                "pass model.parameters()."
            )
        _check_number("learning_rate", learning_rate)
        _check_number("momentum", momentum)
        _check_number("lars_coeff", lars_coeff)
        _check_number("lars_weight_decay", lars_weight_decay)
        _check_number("epsilon", epsilon)
        _check_number("rescale_grad", rescale_grad, positive=True)
        if not isinstance(multi_precision, bool):
            raise TypeError(f"multi_precision={multi_precision!r} must be a bool.")
        defaults = {
            "lr": float(learning_rate),
            "momentum": float(momentum),
            "lars_coeff": float(lars_coeff),
            "lars_weight_decay": float(lars_weight_decay),
            "epsilon": float(epsilon),
            "rescale_grad": float(rescale_grad),
        }
        super().__init__(parameter_list, defaults)
        self.multi_precision = multi_precision
        self._warned = False

    @torch.no_grad()
    @override
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if not state:
            if p.dtype in _LOW and self.multi_precision:
                state["master_weight"] = p.detach().float()
            elif p.dtype in _LOW and not self._warned:
                self._warned = True
                warnings.warn(
                    f"LarsMomentumOptimizer updates a {p.dtype} parameter in its own dtype: "
                    "accumulating in fp16/bf16 can lead to poor accuracy or slow convergence "
                    "(as Paddle warns); pass multi_precision=True for fp32 master weights.",
                    UserWarning,
                    stacklevel=3,
                )
            weight = state.get("master_weight", p)
            state["velocity"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
        weight = state.get("master_weight", p)
        velocity = state["velocity"]
        decay, lr = group["lars_weight_decay"], group["lr"]
        grad = p.grad.to(weight.dtype) * group["rescale_grad"]
        p_norm, g_norm = torch.linalg.vector_norm(weight), torch.linalg.vector_norm(grad)
        lars_lr = lr * group["lars_coeff"] * p_norm / (g_norm + decay * p_norm + group["epsilon"])
        use_lars = (p_norm > 0) & (g_norm > 0) if decay > 0 else torch.zeros((), dtype=torch.bool)
        local_lr = torch.where(use_lars.to(weight.device), lars_lr, lr)
        velocity.mul_(group["momentum"]).add_(local_lr * (grad + decay * weight))
        weight.sub_(velocity)
        if weight is not p:
            p.copy_(weight)


__all__ = ["LarsMomentumOptimizer"]
