"""One param group's update plan: which kernel steps it, its flags and scalar values, torch's
initial state and its step count. The fused, lean and compiled steps all read it from here, so
a group means the same update on every path (step_math holds the math itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from mixprec.core import step_math as sm

Kind = Literal["sgd", "sgd_momentum", "adam"]
"""The kernel a group runs (fused_step.KERNELS): plain SGD, SGD with a momentum buffer, Adam(W)."""


def group_scalars(
    kind: Kind, values: Any, *, step: sm.Scalar = 0.0, first: bool = False
) -> list[sm.Scalar]:
    """The scalar values s[2:] of a group's update (step_math's), from its values: Python
    floats (the eager paths) or fp64 device tensors (the compiled step). step: Adam's count
    from 1; first: SGD's buffer is created this step (see step_math.sgd_scalars)."""
    if kind == "adam":
        return sm.adam_scalars(*values, step)
    return sm.sgd_scalars(*values, first=first)


@dataclass(frozen=True)
class GroupPlan:
    """How one param group of a torch.optim.SGD / Adam / AdamW steps."""

    kind: Kind
    flags: tuple[bool, ...]
    """(maximize, weight decay on, nesterov for sgd_momentum | decoupled decay for adam): each
    a constant of the compiled kernel, so a term torch's optimizer would skip costs nothing."""
    values: tuple[float, ...]
    """sgd / sgd_momentum: (lr, weight_decay, momentum, dampening); adam: (lr, weight_decay,
    beta1, beta2, eps): what group_scalars turns into the kernel's scalars."""

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> GroupPlan:
        """The plan of `group`, one of optimizer's param_groups (fused_step.SUPPORTED)."""
        head = (bool(group.get("maximize")), group["weight_decay"] != 0)
        if isinstance(optimizer, torch.optim.SGD):
            values = (group["lr"], group["weight_decay"], group["momentum"], group["dampening"])
            if group["momentum"] == 0:
                return cls("sgd", head, values)
            return cls("sgd_momentum", (*head, bool(group["nesterov"])), values)
        # torch's default: AdamW decouples the decay, Adam adds it to the gradient
        decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        beta1, beta2 = group["betas"]
        values = (group["lr"], group["weight_decay"], beta1, beta2, group["eps"])
        return cls("adam", (*head, bool(decoupled)), values)

    def init_state(
        self, state: dict[str, Any], like: torch.Tensor, zeros: sm.Zeros = sm.torch_zeros
    ) -> tuple[list[torch.Tensor], bool]:
        """torch's initial state in `state` where missing (`zeros(like, key)` makes a zero
        state tensor: torch's zeros_like by default, lean's format otherwise), so every path
        continues the others. Returns (the state tensors the kernel takes, whether SGD's buffer
        was created now); Adam's `step` is counted by count_steps, not passed."""
        if self.kind == "sgd":
            return [], False
        if self.kind == "sgd_momentum":
            buf, first = sm.momentum_buffer(state, like, zeros)
            return [buf], first
        sm.adam_state(state, like, zeros)
        return [state["exp_avg"], state["exp_avg_sq"]], False

    def prepare(
        self,
        optimizer: torch.optim.Optimizer,
        params: list[torch.Tensor],
        head: list[torch.Tensor] | None,
        device: torch.device,
        zeros: sm.Zeros = sm.torch_zeros,
    ) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        """This step of params (the group's, each with a gradient): per param, its state
        tensors (created where missing; Adam's step counts advanced) and its scalar vector
        (step_math.scalar_vector over head: inv_scale and clip, None for both 1), one vector
        shared by params at the same step count (or buffer state)."""
        if self.kind == "sgd":  # no state: optimizer.state (a defaultdict) gets no entry
            vector = sm.scalar_vector(group_scalars(self.kind, self.values), head, device)
            return [([], vector)] * len(params)
        states = [optimizer.state[p] for p in params]
        prepared = [
            self.init_state(state, p, zeros) for state, p in zip(states, params, strict=True)
        ]
        if self.kind == "adam":
            steps = [state["step"] for state in states]
            torch._foreach_add_(steps, 1.0)
            # CPU scalars, as torch's non-capturable Adam keeps them: read without a device sync
            counts = [float(step) for step in steps]
        else:
            counts = [float(first) for _, first in prepared]
        vectors: dict[float, torch.Tensor] = {}  # params almost always share one step count
        out = []
        for (tensors, first), count in zip(prepared, counts, strict=True):
            if count not in vectors:
                values = group_scalars(self.kind, self.values, step=count, first=first)
                vectors[count] = sm.scalar_vector(values, head, device)
            out.append((tensors, vectors[count]))
        return out
