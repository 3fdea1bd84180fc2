"""The optimizer of one pipeline stage: MixedPrecisionOptimizer plus what a pipeline changes.

- Micro-batch gradients of low-precision params are summed into the fp32 masters' grads as
  each micro-batch's backward lands (a hook per param), never in fp16/bf16: m micro-batches
  summed in fp16 would lose log2(m) bits and can overflow where their fp32 sum does not.
- A step leaves its gradients where the next round's backward adds to them (torch's contract,
  the core's grad_transfer.Carry): two execute_pipeline rounds with no zero_grad() step on g1 + g2.
- Data-parallel replicas of a stage average their gradients once per step, in fp32 (or moved
  in fp8): the transfer's reducer, mixprec.parallel.dp_mean.DataParallelMean.
- Clipping uses the norm over every stage: each stage holds only its params' gradients, so
  the squared norms are summed over the pipeline group before one coefficient is applied.
- The overflow flag is reduced over every rank (MixedPrecisionOptimizer's process_group),
  so a non-finite gradient on any stage or replica skips the step everywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from mixprec.core.clip import ClipSpan
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.scaling import ProcessGroup
from mixprec.parallel.dp_mean import DataParallelMean
from mixprec.parallel.zero import ZeroOptimizer


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

    # carries_grads: the core's carry (GradTransfer.keep / rescale_carried) over the masters'
    # grads, which the hook below sums each micro-batch into: GradTransfer.carry_masters.
    traits = dataclasses.replace(
        MixedPrecisionOptimizer.traits,
        whole_step_refusal="a pipeline's backward runs inside torch.distributed.pipelining's "
        "schedule",
        steps_on_device=False,  # decides on the host
    )

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
        # stages hold disjoint params; a stage's replicas hold equal grads (not summed)
        self.clip_span = ClipSpan(pp_group)
        self.dp_group = dp_group
        self.fp8_communication = fp8_communication
        self._dp_size = 1 if dp_group is None else dist.get_world_size(dp_group)
        if kwargs.get("max_norm", 0.0) > 0 or self._dp_size > 1:
            # The fused step reads grads before the dp mean (the reducer) and the global clip.
            kwargs["fused_step"] = False
        if kwargs.get("keep_master_grads") is False:
            raise ValueError(
                "PipelineOptimizer(keep_master_grads=False): a pipeline sums each micro-batch's "
                "gradient into the masters' grads, which a step leaves for the next backward "
                "(torch's contract); they cannot be freed at the step. Leave it None."
            )
        kwargs["keep_master_grads"] = True
        super().__init__(optimizer, **kwargs)
        if self.lp_params:
            # The fused step reads lp grads; here they are summed on the masters by the hook.
            self.fused_step = False
        self.transfer.carry_masters = True
        # each micro-batch's lp grad summed into its master's fp32 grad, the lp grad freed; the
        # sum goes on from what the last step left (its grads, brought to this round's scale by
        # note_scaled_backward) until zero_grad(); after it, the first micro-batch overwrites
        accumulate = self.transfer.accumulate_as_backward(
            reuse_buffers=True, on_add=self._on_masters
        )
        for lp, hp in zip(self.lp_params, self.hp_masters, strict=True):
            accumulate.hook(lp, hp)
        if self._dp_size > 1:  # the replicas' mean of the masters' sums, once per step
            self.transfer.reduce_with(DataParallelMean(dp_group, fp8_communication))

    def _on_masters(self) -> None:
        self.step_flags.on_masters = True  # the step must not copy (absent) lp grads over these

    @override
    def note_scaled_backward(self) -> None:
        """A round of the schedule is about to run backward on every stage: the grads the last
        step left are brought to this round's loss scale first (GradTransfer.rescale_carried;
        only the last stage calls scale_loss, so the other stages would not otherwise)."""
        super().note_scaled_backward()
        self.transfer.rescale_carried(self.scaler)


class PipelineZeroOptimizer(ZeroOptimizer):
    """ZeRO over one pipeline stage's data-parallel group (HybridParallelPlugin(zero_stage=1|2,
    pp_size > 1), Colossal-AI's layout): each stage's fp32 masters and optimizer state (and,
    at stage 2, its gradients) are sharded over the replicas of that stage.

    - Micro-batch gradients sum in the params' .grad (autograd, in the params' dtype, as
      Colossal-AI's ZeRO accumulates them; the pipeline without ZeRO sums in fp32 instead), and
      are reduced over the stage's replicas once, at step() (ZeroOptimizer's buckets).
    - process_group is every rank of every stage: the overflow flag (a skip on any rank skips
      everywhere) and the clip norm (each rank's shard of its stage's grads) are summed there.
    - A step leaves each owner's gradient in .grad for the next round (ZeroOptimizer's carry):
      two execute_pipeline rounds with no zero_grad() step on g1 + g2, as without ZeRO.

    Args (beyond ZeroOptimizer's):
        pp_group: the ranks holding the other stages of this replica.
        dp_group: this stage's replicas (of this tp index), the ranks its params (a DTensor's
            local shards) are sharded over.
        norm_group: with tensor parallelism, the ranks of this tp index (ZeroOptimizer's).
    """

    traits = dataclasses.replace(
        ZeroOptimizer.traits, whole_step_refusal=PipelineOptimizer.traits.whole_step_refusal
    )

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        pp_group: ProcessGroup | None,
        dp_group: ProcessGroup,
        **kwargs: Any,
    ) -> None:
        self.pp_group = pp_group
        self.dp_group = dp_group
        super().__init__(optimizer, shard_group=dp_group, **kwargs)


StageOptimizer = PipelineOptimizer | PipelineZeroOptimizer
"""The optimizer of a pipeline stage: averaged over its replicas, or ZeRO over them."""
