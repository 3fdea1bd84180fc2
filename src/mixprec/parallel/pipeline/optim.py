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

from mixprec.core.optim import MixedPrecisionOptimizer, local_shards
from mixprec.core.scaling import ProcessGroup
from mixprec.core.step_math import clip_coefficient


class PipelineOptimizer(MixedPrecisionOptimizer):
    """A MixedPrecisionOptimizer over one pipeline rank's stage parameters.

    Args (beyond MixedPrecisionOptimizer's):
        pp_group: the ranks holding the other stages of this replica (global norm; a
            tensor-parallel stage's norm is first completed over its DTensor shards).
        dp_group: the ranks holding this stage's replicas (gradient average), or None.
    """

    whole_step_refusal = "a pipeline's backward runs inside torch.distributed.pipelining's schedule"
    carries_grads = False  # each step's micro-batch sums start afresh (the schedule's step)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        pp_group: ProcessGroup | None,
        dp_group: ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        self.pp_group = pp_group
        self.dp_group = dp_group
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
            for grad in grads:  # fp32 sums (masters or fp32 params): no lp rounding here
                dist.all_reduce(grad, group=self.dp_group)
            torch._foreach_div_(grads, float(self._dp_size))
            self._dp_averaged = True

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every stage's unscaled gradients by one coefficient from their joint 2-norm."""
        if norm_type != 2.0:
            raise ValueError(f"norm_type={norm_type!r}: pipeline clipping supports 2.0 only.")
        self.unscale_grads()
        grads = [p.grad for g in self.optim.param_groups for p in g["params"] if p.grad is not None]
        sq = torch.zeros(1, dtype=torch.float32, device=self.scaler.scale_tensor.device)
        plain = [g.float() for g in grads if not hasattr(g, "full_tensor")]
        if plain:
            sq += torch.stack(torch._foreach_norm(plain)).square().sum()
        for g in grads:
            if hasattr(g, "full_tensor"):  # a tensor-parallel DTensor: its norm over all shards
                sq += torch.linalg.vector_norm(g.float()).full_tensor().square()
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            dist.all_reduce(sq, group=self.pp_group)  # dp replicas hold equal grads: pp only
        total = sq.sqrt().reshape(())
        coef = clip_coefficient(max_norm, total)
        if grads:
            torch._foreach_mul_(local_shards(grads), coef)
        return total

    def _reset_step(self) -> None:
        self._fresh.clear()
        self._dp_averaged = False

    def _end_step(self) -> None:
        self._reset_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._reset_step()  # accumulated master grads are discarded with the lp ones
