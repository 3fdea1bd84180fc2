"""ZeRO stages 1 and 2 for every precision mode: fp32 masters and optimizer state sharded.

Every rank keeps the whole model in its training dtype (lp params). Each param is owned by one
rank of the data-parallel group, chosen as torch's ZeroRedundancyOptimizer does (largest first
to the least-loaded rank); a rank's wrapped optimizer holds only its own params, so the fp32
masters and the optimizer state it creates are that rank's shard. At step time the gradients
are summed over one flat buffer per communication dtype (each param's own dtype unless
communication_dtype says otherwise, as Colossal-AI), all-reduced (stage 1) or reduce-scattered
(stage 2; over gloo an all-reduce, see ZeroOptimizer); each rank keeps the chunk of the params
it owns and no gradient of the others. The owner unscales, checks and steps its shard, the
overflow flag is MAX-reduced over the group (MixedPrecisionOptimizer does this), and the
updated lp params are all-gathered. As torch's contract has it, a step leaves its gradients in
.grad (a backward without zero_grad() adds to them): each owner's share of the mean, times the
next loss scale and the world size, no grad on the params other ranks own; the buckets hand that
share to the core's one carry (core.grad_transfer.Handed), which puts it back after the update.

By default gradients are reduced once per step, not during backward: gradient accumulation
needs no no_sync, and a micro-batch's backward costs no communication. The price: no overlap
with backward. overlap_communication=True launches each bucket's reduction from a
post-accumulate-grad hook as soon as its grads are ready (the same buffers and collectives:
bit-identical results); fp8_communication moves the grads in fp8 (mixprec.parallel.comm).

The parts: who owns which param and the params' all-gather (mixprec.parallel.zero_layout), the
gradient buckets and their reductions (mixprec.parallel.zero_buckets), sharded and gathered
checkpoints (mixprec.parallel.zero_checkpoint); ZeroOptimizer is the step over them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, cast

import torch
from typing_extensions import override

from mixprec.core.clip import ClipSpan, local_shards
from mixprec.core.commit import StepResult
from mixprec.core.lean import LeanConfig, rank_seed, state_bytes
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import UNIT_SCALE, Policy, ScalerConfig, check_keys
from mixprec.core.prepare import prepare_optimizer
from mixprec.core.scaling import ProcessGroup, default_group, group_to_hold, rank_and_world
from mixprec.core.validate import check_norm_type
from mixprec.parallel import zero_checkpoint
from mixprec.parallel.comm import to_fp8_comm_dtype
from mixprec.parallel.zero_buckets import GradBuckets
from mixprec.parallel.zero_layout import ShardLayout

log = logging.getLogger("mixprec")
STAGES = (1, 2)
COMMUNICATION_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16)


def check_communication_dtype(value: Any, who: str) -> None:
    if value not in COMMUNICATION_DTYPES:
        raise ValueError(
            f"{who}(communication_dtype={value!r}); valid: None (each gradient in its param's "
            "dtype, as Colossal-AI), torch.float32, torch.float16, torch.bfloat16."
        )


def check_fp8_communication(
    fp8_communication: Any, communication_dtype: torch.dtype | None, who: str
) -> torch.dtype | None:
    """The fp8 wire dtype fp8_communication asks for (None: off); it excludes
    communication_dtype, which would name another wire dtype."""
    fp8_dtype = to_fp8_comm_dtype(fp8_communication, who)
    if fp8_dtype is not None and communication_dtype is not None:
        raise ValueError(
            f"{who}(fp8_communication={fp8_communication!r}, communication_dtype="
            f"{communication_dtype!r}): fp8_communication sets the dtype gradients travel in "
            "(fp8, summed in fp32); leave communication_dtype None."
        )
    return fp8_dtype


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """A config's `zero=dict(level=..., ...)` section."""

    level: int
    """1: optimizer state and fp32 masters sharded; 2: gradients too; 3: params too (FSDP2)."""
    cpu_offload: bool = False
    """Keep masters and optimizer state in CPU memory (a no-op when training on the CPU)."""


ZERO_KEYS = tuple(f.name for f in fields(ZeroConfig))
LEGACY_ZERO_KEYS = ("model_config", "optimizer_config")  # Colossal's old sharded-model format


def to_zero_config(section: Mapping[str, Any] | None) -> ZeroConfig | None:
    """A config's `zero` section (None: no ZeRO); every key is checked, none ignored."""
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise TypeError(f"zero={section!r} must be a dict like dict(level=2).")
    legacy = [k for k in LEGACY_ZERO_KEYS if k in section]
    if legacy:
        raise ValueError(
            f"zero: {legacy} are Colossal-AI's legacy sharded-model settings, which mixprec does "
            f"not support; write zero=dict(level=1|2|3) (valid keys: {', '.join(ZERO_KEYS)})."
        )
    check_keys("zero config", section, ZERO_KEYS)
    level = section.get("level")
    if isinstance(level, bool) or level not in (1, 2, 3):
        raise ValueError(
            f"zero level={level!r}; valid: 1 (optimizer state and fp32 masters sharded), 2 (and "
            "gradients), 3 (and params: FSDP2)."
        )
    offload = section.get("cpu_offload", False)
    if not isinstance(offload, bool):
        raise TypeError(f"zero cpu_offload={offload!r} must be a bool.")
    return ZeroConfig(level=level, cpu_offload=offload)


def check_cpu_offload(cpu_offload: bool, device: torch.device) -> None:
    """cpu_offload where the model trains on the CPU is a no-op that says so; elsewhere an error."""
    if not cpu_offload:
        return
    if device.type != "cpu":
        raise ValueError(
            f"cpu_offload=True on {device}: offloading masters and optimizer state from an "
            "accelerator is not supported yet; use cpu_offload=False."
        )
    log.warning(
        "mixprec ZeRO cpu_offload=True: the model trains on the CPU, so the masters and "
        "optimizer state are in CPU memory already; nothing to offload."
    )


def _check_zero_arguments(
    stage: Any,
    optimizer: Any,
    communication_dtype: Any,
    reduce_bucket_numel: Any,
    overlap_communication: Any,
) -> None:
    """ZeroOptimizer's own arguments checked before anything is built or communicated."""
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(
            f"stage={stage!r}; valid: 1 (sharded optimizer state and fp32 masters), 2 (and "
            "sharded gradients). Stage 3 (sharded params) is FSDP2: TorchFSDPPlugin."
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)!r}.")
    if optimizer.state:
        raise ValueError(
            "ZeRO: the optimizer already holds state for the whole model; wrap it before "
            "its first step so each rank creates only its own shard."
        )
    check_communication_dtype(communication_dtype, "ZeroOptimizer")
    if reduce_bucket_numel is not None and (
        isinstance(reduce_bucket_numel, bool)
        or not isinstance(reduce_bucket_numel, int)
        or reduce_bucket_numel < 1
    ):
        raise ValueError(
            f"reduce_bucket_numel={reduce_bucket_numel!r} must be a positive int or None."
        )
    if not isinstance(overlap_communication, bool):
        raise TypeError(f"overlap_communication={overlap_communication!r} must be a bool.")


class ZeroOptimizer(MixedPrecisionOptimizer):
    """MixedPrecisionOptimizer whose masters and state are sharded over a process group.

    Args:
        optimizer: the optimizer over the model's (already cast) parameters, with no state yet.
        stage: 1 (gradients all-reduced) or 2 (gradients reduce-scattered to their owner).
        norm_type: the p of the global gradient norm that max_norm clips.
        reduce_scatter: stage 2's collective. False all-reduces and keeps this rank's chunk
            (the same values, the same memory after the step). None: reduce-scatter, except
            over gloo, whose reduce-scatter ran 1.5-3x slower than its all-reduce on 4 MiB.
        reduce_bucket_numel: at most this many gradient elements per collective (Colossal's
            reduce_bucket_size_in_m * 2**20): a larger model is reduced in several buckets,
            bounding the flat buffer; a param larger than it gets a bucket of its own. None:
            one bucket per communication dtype.
        communication_dtype: the dtype gradients are summed in. None: each param's own (fp16
            and bf16 grads travel in half the bytes, divided by the world size first, as DDP's
            comm hooks do); torch.float32: the exact sum of the lp grads, twice the bytes.
        overlap_communication: reduce each bucket (async) as soon as its params' grads are
            ready during backward, instead of all at step(); the same collectives on the same
            buffers, so the results are bit-identical. Accumulating over several backwards:
            inside no_sync() (else each backward redoes the reduction of the sums).
        fp8_communication: True, 'e5m2' (True's format) or 'e4m3': gradients travel in fp8
            with one power-of-two scale per bucket and rank, summed in fp32 by their owner
            (mixprec.parallel.comm): a quarter of fp32's bytes, an fp8 rounding of each grad.
        shard_group: the ranks the params are sharded over and their gradients reduced over
            (None: process_group). A pipeline stage's data-parallel group: process_group (every
            rank of every stage) then only agrees on overflow and sums the clip norm.
        norm_group: the ranks the clip norm's parts are summed over (None: process_group).
            Tensor-parallel (DTensor) params are sharded over the local shards of this rank's
            tp index (each DTensor's norm is completed over its tp mesh first), so here the
            ranks of this rank's tp index: a param replicated over tp is counted once.
        Others: as MixedPrecisionOptimizer (the fused step is off: it reads unreduced grads).

    Attributes: `layout` (a ShardLayout: the params, their owners, this rank) and `buckets`
    (GradBuckets: the gradient reductions).
    """

    traits = dataclasses.replace(
        MixedPrecisionOptimizer.traits,
        whole_step_refusal="ZeRO reduces gradients and gathers the owners' params inside step()",
        steps_on_device=False,  # decides on the host
    )

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        stage: int,
        loss_scale: ScalerConfig = UNIT_SCALE,
        master_weights: bool | None = None,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        process_group: ProcessGroup | None = None,
        log_num_zeros_in_grad: bool = False,
        max_consecutive_skips: int | None = 100,
        reduce_scatter: bool | None = None,
        communication_dtype: torch.dtype | None = None,
        lean: LeanConfig | None = None,
        reduce_bucket_numel: int | None = None,
        overlap_communication: bool = False,
        fp8_communication: bool | str = False,
        shard_group: ProcessGroup | None = None,
        norm_group: ProcessGroup | None = None,
    ) -> None:
        _check_zero_arguments(
            stage, optimizer, communication_dtype, reduce_bucket_numel, overlap_communication
        )
        fp8_dtype = check_fp8_communication(fp8_communication, communication_dtype, "ZeroOptimizer")
        group = process_group or default_group()
        shard = group if shard_group is None else shard_group
        self.stage = stage
        self.norm_type = check_norm_type("norm_type", norm_type)
        self.clip_span = ClipSpan.over(group if norm_group is None else norm_group)
        self.overlap_communication = overlap_communication
        layout = self.layout = ShardLayout(optimizer, shard, group_to_hold(shard))
        self.rank, self.world, self.shard_group = layout.rank, layout.world, layout.group
        self.all_params, self.owners = layout.all_params, layout.owners
        self.buckets = GradBuckets(
            self.layout,
            stage=stage,
            reduce_scatter=reduce_scatter,
            communication_dtype=communication_dtype,
            fp8_dtype=fp8_dtype,
            bucket_numel=reduce_bucket_numel,
        )
        super().__init__(
            optimizer,
            loss_scale=loss_scale,
            master_weights=master_weights,
            max_norm=max_norm,
            process_group=group,  # stored as None when it is the default group
            log_num_zeros_in_grad=log_num_zeros_in_grad,
            max_consecutive_skips=max_consecutive_skips,
            fused_step=False,
            lean=lean,  # each owner's low-bit state is its shard, as fp32 state is
        )
        # gradients reduced once per step and handed to this rank's masters (the reducer)
        self.transfer.reduce_with(self.buckets)
        if overlap_communication:
            self.buckets.install_overlap_hooks()
        if self.world == 1:
            log.warning("mixprec ZeRO: a world of 1 rank, so ZeRO shards nothing.")

    # The bucket settings, read from the buckets that use them.
    reduce_scatter = property(lambda self: self.buckets.reduce_scatter)
    communication_dtype = property(lambda self: self.buckets.communication_dtype)
    reduce_bucket_numel = property(lambda self: self.buckets.bucket_numel)
    fp8_communication = property(lambda self: self.buckets.fp8_dtype)

    @override
    def __repr__(self) -> str:
        return (
            f"ZeroOptimizer(stage={self.stage}, rank={self.rank}/{self.world}, "
            f"{self.optim!r}, scaler={self.scaler.cfg})"
        )

    def owns(self, index: int) -> bool:
        return self.layout.owns(index)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate their gradients without reducing any bucket; the
        first backward after it reduces the sums (the same values as reducing at step())."""
        return self.buckets.no_sync()

    # ----- the step: this rank's shard, then the updated lp params to every rank -----
    @override
    def _after_update(self, result: StepResult) -> None:
        if not result.skipped and self.world > 1:
            self.layout.all_gather_params()

    # ----- checkpoints: one shard per rank (resumes on the same world size), or gathered -----
    def shard_layout(self) -> dict[str, Any]:
        """Which rank owns which param: a shard only loads where this layout is the same."""
        return self.layout.describe(self.stage)

    @override
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: its optimizer state and masters, the scaler, and the layout."""
        return {**super().state_dict(), "zero": self.shard_layout()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        zero_checkpoint.check_shard(state_dict.get("zero"), self.shard_layout())
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "zero"})
        if self.world > 1:  # each owner loaded its params: every rank needs them
            self.layout.all_gather_params()

    def hp_params(self) -> list[torch.Tensor]:
        """Every param's fp32 value (the master where one exists), gathered from its owner."""
        return zero_checkpoint.hp_params(self)

    def gathered_state_dict(self) -> dict[str, Any] | None:
        """The whole optimizer, gathered on group rank 0 as an unsharded optimizer's
        state_dict (None on other ranks): it loads into any world size, sharded or not.

        Rank 0 holds the full masters and state while building it (checkpoint time only).
        """
        return zero_checkpoint.gathered_state_dict(self)

    def load_gathered_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an unsharded optimizer's state_dict (gathered_state_dict's, or a plain
        MixedPrecisionOptimizer's): each rank keeps its own shard of it."""
        twin = zero_checkpoint.load_gathered(self, state_dict)
        self.scaler.load_state_dict(twin.scaler.state_dict())
        self.steps, self.skipped_steps = twin.steps, twin.skipped_steps
        if self.lean is not None:  # each rank's own stream, mixed from the saved base seed
            self.lean.seed = rank_seed(twin.lean.seed, rank_and_world()[0])
            self.lean.counter.copy_(twin.lean.counter)
        self._clear_step_flags()

    # ----- what this rank holds -----
    def shard_bytes(self) -> dict[str, int]:
        """Bytes of fp32 masters and optimizer state this rank holds, read from the state."""
        state = sum(  # a low-bit state's real bytes (codes + scales), not its fp32 appearance
            state_bytes(t)
            for s in self.optim.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )
        masters = sum(m.numel() * m.element_size() for m in local_shards(self.hp_masters))
        return {"optimizer_state": state, "master_weights": masters}


def prepare_zero_optimizer(
    optimizer: torch.optim.Optimizer,
    policy: Policy,
    *,
    stage: int,
    max_norm: float = 0.0,
    norm_type: float = 2.0,
    process_group: ProcessGroup | None = None,
    communication_dtype: torch.dtype | None = None,
    reduce_bucket_numel: int | None = None,
    overlap_communication: bool = False,
    fp8_communication: bool | str = False,
) -> ZeroOptimizer:
    """prepare_optimizer with ZeroOptimizer: wrap optimizer for policy, sharded."""
    optimizer = prepare_optimizer(
        optimizer,
        policy,
        max_norm=max_norm,
        process_group=process_group,
        optimizer_cls=ZeroOptimizer,
        stage=stage,
        norm_type=norm_type,
        communication_dtype=communication_dtype,
        reduce_bucket_numel=reduce_bucket_numel,
        overlap_communication=overlap_communication,
        fp8_communication=fp8_communication,
    )
    return cast(ZeroOptimizer, optimizer)
