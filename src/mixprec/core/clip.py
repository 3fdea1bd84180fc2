"""The one gradient clip of every parallelism: torch's clip_grad_norm_, norm over the right ranks.

Which ranks hold which part of the gradients is the only thing a parallelism changes:
- one process, or data-parallel replicas (equal grads): the local norm is the norm (no group);
- DTensor grads (FSDP2, tensor parallel): each DTensor's norm is completed over its own mesh;
- disjoint parts on different ranks (pipeline stages, ZeRO shards): the local norms are
  combined over `group` (sum of p-th powers, or max for p = inf).

The coefficient is step_math's (torch's max_norm / (norm + eps), clamped at 1), applied
unconditionally: no `if coef < 1` host sync, and an inf/nan norm (an overflowed step, which the
optimizer skips) writes inf/nan into grads nobody will use. With no DTensor and no group this is
plain tensor math, so it can also run inside a compiled step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mixprec.core.scaling import ProcessGroup, default_group, group_to_hold
from mixprec.core.step_math import clip_coefficient


def local_shards(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor's local shard (same storage; foreach kernels take no DTensors), else itself.

    A master is a clone of its param, so both have the same layout and shard alike.
    """
    # type() first: hasattr on a plain tensor is a failed attribute lookup (~0.3 us each).
    return [
        t if type(t) is torch.Tensor or not hasattr(t, "to_local") else t.to_local()
        for t in tensors
    ]


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t) is not torch.Tensor and hasattr(t, "full_tensor")


def total_grad_norm(
    grads: Sequence[torch.Tensor],
    norm_type: float = 2.0,
    *,
    group: ProcessGroup | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The p-norm of all `grads` taken together (an fp32 0-dim tensor, no host sync).

    group: the ranks that hold the *other* parts of the model (pipeline stages, ZeRO shards);
        None when the grads on this rank are the whole model (or replicas of it).
    device: where the norm lives on a rank that holds no gradient (it still joins the
        group's reduction); the first gradient's device otherwise.
    """
    p = float(norm_type)
    plain = [g for g in grads if not _is_dtensor(g)]
    parts: list[torch.Tensor] = []
    if plain:  # torch's own norm: bit for bit torch.nn.utils.clip_grad_norm_'s on one process
        parts.append(torch.nn.utils.get_total_norm(plain, p))
    by_mesh: dict[int, list[torch.Tensor]] = {}
    for g in grads:
        if _is_dtensor(g):
            by_mesh.setdefault(id(g.device_mesh), []).append(g)  # type: ignore[attr-defined]
    for dtensors in by_mesh.values():  # the norm over all shards of the mesh (one collective)
        parts.append(torch.nn.utils.get_total_norm(dtensors, p).full_tensor())  # type: ignore[attr-defined]
    if device is None:
        device = parts[0].device if parts else torch.device("cpu")
    if not parts:
        local = torch.zeros((), dtype=torch.float32, device=device)
    elif len(parts) == 1:
        local = parts[0].to(device=device, dtype=torch.float32)
    else:
        stacked = torch.stack([t.to(device=device, dtype=torch.float32) for t in parts])
        local = torch.linalg.vector_norm(stacked, p)
    if group is None or dist.get_world_size(group) == 1:
        return local
    if math.isinf(p):
        total = local.reshape(1).clone()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total[0]
    total = local.pow(p).reshape(1)  # inf/nan stay inf/nan through the sum and the root
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total[0].pow(1.0 / p)


def mul_grads_(grads: Sequence[torch.Tensor], factor: torch.Tensor) -> None:
    """grads *= factor in place (DTensors through their local shard), one foreach per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in local_shards(list(grads)):
        by_device.setdefault(g.device, []).append(g)
    for device, same in by_device.items():
        torch._foreach_mul_(same, factor.to(device))


@dataclass(frozen=True)
class ClipSpan:
    """The ranks one clip's norm is combined over, as an optimizer holds it (data, not code).

    ClipSpan(): none; this rank's grads are the model's (one process, or replicas holding equal
    grads). ClipSpan(group): a group's ranks hold disjoint parts (a pipeline's stages).
    ClipSpan.over(group): the same, but the default group is looked up at each use rather than
    held (core.scaling.group_to_hold); ZeRO spans every rank's shard this way.
    """

    group: ProcessGroup | None = None
    default: bool = False
    """The default group, looked up at each use."""

    @staticmethod
    def over(group: ProcessGroup | None) -> ClipSpan:
        """Span group's ranks (None: the default group)."""
        held = group_to_hold(group or default_group())
        return ClipSpan(held, default=held is None)

    def resolve(self) -> ProcessGroup | None:
        """The group to combine the norm over now (None: no reduction)."""
        return default_group() if self.default else self.group


def clip_grads_(
    grads: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    group: ProcessGroup | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Scale `grads` in place so their joint p-norm is at most max_norm; returns the norm before
    clipping (torch.nn.utils.clip_grad_norm_'s contract, over the ranks of `group`; see
    total_grad_norm for group and device)."""
    total = total_grad_norm(grads, norm_type, group=group, device=device)
    if grads:
        mul_grads_(grads, clip_coefficient(float(max_norm), total))
    return total
