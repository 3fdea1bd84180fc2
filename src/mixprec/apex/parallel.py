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

from mixprec.apex.amp import PARALLEL_WRAPPERS

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


__all__ = ["DistributedDataParallel"]
