"""apex.parallel.DistributedDataParallel on torch's DDP (wrap AFTER amp.initialize, as in Apex).

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    model = DistributedDataParallel(model)

torch's DDP does the work (bucketed all-reduce overlapped with backward); Apex's keywords map
onto it: message_size (elements per bucket) sets the bucket size, delay_allreduce=True puts
every gradient in one bucket reduced once backward is done, and gradient_average,
gradient_predivide_factor and allreduce_always_fp32 keep Apex's arithmetic through a comm
hook: grads / predivide, all-reduce (in fp32 if asked), then * predivide / world_size when
averaging. Apex's stream and communicator tuning keywords have no torch counterpart and are
not accepted.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mixprec.apex.amp.frontend import PARALLEL_WRAPPERS

BYTES_PER_MB = 2**20


# no annotations on bucket and the result: DDP compares them to the live classes, and
# `from __future__ import annotations` would hand it strings
def _apex_allreduce_hook(state: tuple[Any, bool, float, bool], bucket):
    """Apex's all-reduce arithmetic for one bucket (see the module docstring)."""
    group, average, predivide, always_fp32 = state
    grads = bucket.buffer()
    work = grads.float() if always_fp32 else grads
    if predivide != 1.0:
        work.mul_(1.0 / predivide)
    world = dist.get_world_size(group)
    future = dist.all_reduce(work, group=group, async_op=True).get_future()

    def finish(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        reduced = fut.value()[0]
        if average:
            reduced.mul_(predivide / world)
        if reduced is not grads:
            grads.copy_(reduced)  # back into the bucket's own (low-precision) dtype
        return grads

    return future.then(finish)


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """apex.parallel.DistributedDataParallel: torch DDP with Apex's keywords.

    Args:
        module: the model amp.initialize returned (cast already; DDP broadcasts rank 0's).
        message_size: elements per all-reduce bucket (Apex's default 1e7).
        delay_allreduce: True reduces every gradient in one bucket after backward.
        gradient_average: False sums the gradients over ranks instead of averaging them.
        gradient_predivide_factor: divide before the all-reduce by this, and multiply after by
            factor / world_size (when averaging): keeps fp16 sums of many ranks in range.
        allreduce_always_fp32: all-reduce fp16/bf16 gradients in fp32.
        process_group: the ranks to reduce over (default: the world).
    """

    def __init__(
        self,
        module: nn.Module,
        message_size: int = 10_000_000,
        delay_allreduce: bool = False,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        allreduce_always_fp32: bool = False,
        process_group: Any = None,
    ) -> None:
        if isinstance(module, PARALLEL_WRAPPERS):
            raise TypeError(f"module is already a {type(module).__name__}; wrap it once.")
        if isinstance(message_size, bool) or not isinstance(message_size, int) or message_size < 1:
            raise ValueError(f"message_size={message_size!r} must be an int >= 1 (elements).")
        if not gradient_predivide_factor > 0:
            raise ValueError(
                f"gradient_predivide_factor={gradient_predivide_factor!r} must be > 0."
            )
        for name, flag in (
            ("delay_allreduce", delay_allreduce),
            ("gradient_average", gradient_average),
            ("allreduce_always_fp32", allreduce_always_fp32),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}={flag!r} must be a bool.")
        element_bytes = max(
            (p.element_size() for p in module.parameters() if p.requires_grad), default=4
        )
        bucket_mb = message_size * element_bytes / BYTES_PER_MB
        if delay_allreduce:  # one bucket holding every gradient: reduced when backward is done
            bucket_mb = max(
                bucket_mb,
                sum(p.numel() * p.element_size() for p in module.parameters()) / BYTES_PER_MB + 1,
            )
        super().__init__(module, bucket_cap_mb=bucket_mb, process_group=process_group)
        self.message_size = message_size
        self.delay_allreduce = delay_allreduce
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.allreduce_always_fp32 = allreduce_always_fp32
        if not gradient_average or gradient_predivide_factor != 1.0 or allreduce_always_fp32:
            group = process_group or dist.group.WORLD
            state = (
                group,
                gradient_average,
                float(gradient_predivide_factor),
                allreduce_always_fp32,
            )
            self.register_comm_hook(state, _apex_allreduce_hook)


class LARC:
    """apex.parallel.LARC: layer-wise adaptive rate control around any torch optimizer.

    Per parameter p with grad g and weight decay wd, the local rate is
    trust_coefficient * |p| / (|g| + wd * |p| + eps); g becomes (g + wd * p) times that rate
    (clip=False) or times min(rate / lr, 1) (clip=True: the step uses min(local rate, lr)).
    A parameter or gradient of norm 0 keeps its gradient. The wrapped optimizer then steps
    with its weight decay set to 0 for the call (LARC applied it). Everything is computed on
    the device: no host sync per parameter. amp.initialize takes it like an optimizer.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        trust_coefficient: float = 0.02,
        clip: bool = True,
        eps: float = 1e-8,
    ) -> None:
        if not trust_coefficient > 0:
            raise ValueError(f"trust_coefficient={trust_coefficient!r} must be > 0.")
        if not eps >= 0:
            raise ValueError(f"eps={eps!r} must be >= 0.")
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.clip = clip
        self.eps = eps

    @property
    def state(self) -> Any:
        return self.optim.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    def __repr__(self) -> str:
        return repr(self.optim)  # as Apex's LARC

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    @torch.no_grad()
    def _scale_grads(self, group: dict[str, Any], weight_decay: float) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            param_norm = torch.linalg.vector_norm(p)
            grad_norm = torch.linalg.vector_norm(p.grad)
            rate = (
                self.trust_coefficient
                * param_norm
                / (grad_norm + param_norm * weight_decay + self.eps)
            )
            if self.clip:
                rate = torch.clamp(rate / group["lr"], max=1.0)
            both = (param_norm != 0) & (grad_norm != 0)
            rate = torch.where(both, rate, torch.ones_like(rate))
            if weight_decay != 0:
                decayed = p.grad + weight_decay * p
                p.grad.copy_(torch.where(both, decayed, p.grad))
            p.grad.mul_(rate.to(p.grad.dtype))

    def step(self, closure: Any = None) -> Any:
        weight_decays = [group.get("weight_decay", 0) for group in self.optim.param_groups]
        for group, weight_decay in zip(self.optim.param_groups, weight_decays, strict=True):
            group["weight_decay"] = 0  # LARC applies it to the gradient itself
            self._scale_grads(group, weight_decay)
        try:
            return self.optim.step(closure) if closure is not None else self.optim.step()
        finally:
            for group, weight_decay in zip(self.optim.param_groups, weight_decays, strict=True):
                group["weight_decay"] = weight_decay


__all__ = ["LARC", "DistributedDataParallel"]
