"""The data-parallel mean as a reducer (core.grad_transfer.GradReducer): replicas average the
fp32 gradients their masters hold, once per step, after the transfer.

A pipeline stage's replicas use it (their micro-batch grads are summed into the masters as each
backward lands, so there is no DDP bucket to reduce them in). ZeRO's reducer is its buckets
(mixprec.parallel.zero_buckets.GradBuckets).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mixprec.core.scaling import ProcessGroup
from mixprec.parallel.comm import fp8_all_reduce

if TYPE_CHECKING:
    from mixprec.core.grad_transfer import GradTransfer


class DataParallelMean:
    """The held grads (fp32 masters' and fp32 params') averaged over group after the way moved
    them: the sum in fp32, one all-reduce per tensor, or (fp8_dtype) moved in fp8 in one flat
    buffer with one power-of-two scale per replica (mixprec.parallel.comm.fp8_all_reduce), then
    divided by the group's size.

    Grads a step left for the next backward (the g1 + g2 carry) are alike on every replica
    (averaged at that step), so the mean of carried + new is carried + the mean of the new.

    Args:
        group: the replicas (a group of more than one rank).
        fp8_dtype: the fp8 dtype the grads travel in, or None (fp32).
    """

    def __init__(self, group: ProcessGroup, fp8_dtype: torch.dtype | None = None) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.fp8_dtype = fp8_dtype

    def reduce_(self, transfer: GradTransfer, move: Callable[[], None]) -> None:
        move()
        grads = transfer.held_grads()
        if self.fp8_dtype is None:
            for grad in grads:  # fp32 sums (masters or fp32 params): no lp rounding here
                dist.all_reduce(grad, group=self.group)
        elif grads:
            # One flat buffer, one scale per replica (as a DDP bucket): a collective per tensor
            # would send more headers than fp8 saves on small ones.
            sizes = [g.numel() for g in grads]
            flat = torch.cat([g.reshape(-1) for g in grads])
            summed = fp8_all_reduce(flat, self.group, self.fp8_dtype).split(sizes)
            views = [v.view_as(g) for v, g in zip(summed, grads, strict=True)]
            torch._foreach_copy_(grads, views)
        torch._foreach_div_(grads, float(self.world))

    def zero_grad(self, set_to_none: bool) -> None:
        """Nothing held between steps."""
