"""The optimizer of one pipeline stage: MixedPrecisionOptimizer plus what a pipeline changes.

- Micro-batch gradients of low-precision params are summed into the fp32 masters' grads as
  each micro-batch's backward lands (a hook per param), never in fp16/bf16: m micro-batches
  summed in fp16 would lose log2(m) bits and can overflow where their fp32 sum does not.
- Data-parallel replicas of a stage average their gradients once per step, in fp32.
- Clipping uses the norm over every stage: each stage holds only its params' gradients, so
  the squared norms are summed over the pipeline group before one coefficient is applied.
- The overflow flag is reduced over every rank (MixedPrecisionOptimizer's process_group),
  so a non-finite gradient on any stage or replica skips the step everywhere.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mixprec.core.clip import clip_grads_
from mixprec.core.optim import MixedPrecisionOptimizer, local_shards
from mixprec.core.scaling import ProcessGroup
from mixprec.core.validate import check_max_norm, check_norm_type
from mixprec.parallel.comm import fp8_all_reduce


class PipelineOptimizer(MixedPrecisionOptimizer):
    """A MixedPrecisionOptimizer over one pipeline rank's stage parameters.

    Args (beyond MixedPrecisionOptimizer's):
        pp_group: the ranks holding the other stages of this replica (global norm; a
            tensor-parallel stage's norm is first completed over its DTensor shards).
        dp_group: the ranks holding this stage's replicas (gradient average), or None.
        fp8_communication: the fp8 dtype the data-parallel average moves the gradients in
            (one flat buffer, one power-of-two scale per replica: mixprec.parallel.comm), or
            None: each gradient all-reduced in fp32.
    """

    whole_step_refusal = "a pipeline's backward runs inside torch.distributed.pipelining's schedule"
    carries_grads = False  # each step's micro-batch sums start afresh (the schedule's step)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        pp_group: ProcessGroup | None,
        dp_group: ProcessGroup | None = None,
        fp8_communication: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        self.pp_group = pp_group
        self.dp_group = dp_group
        self.fp8_communication = fp8_communication
        self._dp_size = 1 if dp_group is None else dist.get_world_size(dp_group)
        if kwargs.get("max_norm", 0.0) > 0 or self._dp_size > 1:
            # The fused step reads grads before this class averages / globally clips them.
            kwargs["fused_step"] = False
        super().__init__(optimizer, **kwargs)
        self._fresh: set[int] = set()  # ids of masters whose grad holds this step's sum
        self._dp_averaged = False
        self._master_of = {
            id(lp): hp for lp, hp in zip(self.lp_params, self.hp_masters, strict=True)
        }
        for lp in self.lp_params:
            lp.register_post_accumulate_grad_hook(self._accumulate_in_fp32)

    def _accumulate_in_fp32(self, lp: torch.Tensor) -> None:
        """After each micro-batch's backward: lp grad -> fp32 master grad (sum), lp grad freed."""
        grad, hp = lp.grad, self._master_of[id(lp)]
        if grad is None:
            return
        if id(hp) in self._fresh:
            hp.grad.add_(grad)  # fp32 += lp: the add upcasts exactly
        elif hp.grad is not None:
            hp.grad.copy_(grad)  # reuse the buffer kept between steps (CPU: no page faults)
            self._fresh.add(id(hp))
        else:
            hp.grad = grad.float()
            self._fresh.add(id(hp))
        lp.grad = None
        self._grads_on_masters = True  # the step must not copy (absent) lp grads over these

    def grads_to_masters(self) -> None:
        """This step's grads are on the masters already; drop stale ones, average over dp."""
        for hp in self.hp_masters:
            if id(hp) not in self._fresh:
                hp.grad = None  # took no part this step: no stale gradient may be applied
        self._grads_on_masters = True
        if self._dp_size > 1 and not self._dp_averaged:
            grads = [p.grad for g in self.optim.param_groups for p in g["params"]]
            grads = local_shards([g for g in grads if g is not None])
            if self.fp8_communication is None:
                for grad in grads:  # fp32 sums (masters or fp32 params): no lp rounding here
                    dist.all_reduce(grad, group=self.dp_group)
            elif grads:
                # One flat buffer, one scale per replica (as a DDP bucket): a collective per
                # tensor would send more headers than fp8 saves on small ones.
                sizes = [g.numel() for g in grads]
                flat = torch.cat([g.reshape(-1) for g in grads])
                summed = fp8_all_reduce(flat, self.dp_group, self.fp8_communication).split(sizes)
                views = [v.view_as(g) for v, g in zip(summed, grads, strict=True)]
                torch._foreach_copy_(grads, views)
            torch._foreach_div_(grads, float(self._dp_size))
            self._dp_averaged = True

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every stage's unscaled gradients by one coefficient from their joint norm."""
        check_max_norm("max_norm", max_norm)
        norm_type = check_norm_type("norm_type", norm_type)
        self.unscale_grads()
        grads = [p.grad for g in self.optim.param_groups for p in g["params"] if p.grad is not None]
        # Stages hold disjoint params (pp group); dp replicas hold equal grads (not summed).
        device = self.scaler.scale_tensor.device
        return clip_grads_(grads, max_norm, norm_type, group=self.pp_group, device=device)

    def _reset_step(self) -> None:
        self._fresh.clear()
        self._dp_averaged = False

    def _end_step(self) -> None:
        self._reset_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._reset_step()  # accumulated master grads are discarded with the lp ones
