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
updated lp params are all-gathered.

By default gradients are reduced once per step, not during backward: gradient accumulation
needs no no_sync, and a micro-batch's backward costs no communication. The price: no overlap
with backward. overlap_communication=True launches each bucket's reduction from a
post-accumulate-grad hook as soon as its grads are ready (the same buffers and collectives:
bit-identical results); fp8_communication moves the grads in fp8 (mixprec.parallel.comm).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any, cast

import torch
import torch.distributed as dist
from typing_extensions import override

from mixprec.core.clip import clip_grads_, local_shards
from mixprec.core.lean import LeanConfig, base_seed, rank_seed, state_bytes
from mixprec.core.optim import LOW_DTYPES, MixedPrecisionOptimizer, StepResult
from mixprec.core.policy import UNIT_SCALE, Policy, ScalerConfig, check_keys
from mixprec.core.prepare import prepare_optimizer
from mixprec.core.scaling import ProcessGroup, default_group, group_to_hold, rank_and_world
from mixprec.core.validate import check_max_norm, check_norm_type
from mixprec.parallel.comm import PendingFp8ReduceScatter, to_fp8_comm_dtype

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


def partition_params(numels: list[int], world: int) -> list[int]:
    """Owner rank of each param: largest first to the least-loaded rank (ties: lowest rank).

    ZeroRedundancyOptimizer's greedy rule; same sizes on every rank give the same owners.
    """
    loads = [0] * world
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += numels[i]
    return owners


def group_rank_and_world(group: ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


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
    """

    whole_step_refusal = "ZeRO reduces gradients and gathers the owners' params inside step()"
    carries_grads = False  # kept by _carry_grads, on the model's params, across ranks
    steps_on_device = False  # decides on the host: see MixedPrecisionOptimizer

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
        self.reduce_bucket_numel = reduce_bucket_numel
        self.fp8_communication = check_fp8_communication(
            fp8_communication, communication_dtype, "ZeroOptimizer"
        )
        self.overlap_communication = overlap_communication
        self._pending: dict[int, _LaunchedBucket] = {}  # bucket -> its launched reduction
        self._ready: dict[int, set[int]] = {}  # bucket -> params whose grad this backward gave
        self._sync_grads = True  # False inside no_sync()
        group = process_group or default_group()
        shard = group if shard_group is None else shard_group
        self.shard_group = group_to_hold(shard)  # None: the default group, looked up at use
        self.norm_group = group_to_hold(group if norm_group is None else norm_group)
        self.stage = stage
        self.norm_type = check_norm_type("norm_type", norm_type)
        self.rank, self.world = group_rank_and_world(shard)
        gloo = shard is not None and dist.get_backend(shard) == "gloo"
        self.reduce_scatter = not gloo if reduce_scatter is None else reduce_scatter
        # Over gloo (measured on 1M elements, 2 and 4 ranks): an fp16 all-reduce ran 1.3-1.6x
        # slower than fp32's on the same elements (gloo sums fp16 element by element) and bf16
        # no faster than fp32, so gradients travel in fp32 there; and each owner broadcasting
        # its chunk beat all_gather by 1.1-2x.
        self.gather_by_broadcast = gloo
        gloo_dtype = torch.float32 if gloo else None
        self.communication_dtype = (
            gloo_dtype if communication_dtype is None else communication_dtype
        )
        self._take_shard(optimizer, shard)
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
        self._stepped: dict[int, torch.Tensor] = {}  # see _carry_grads
        if overlap_communication:
            self._install_overlap_hooks()
        if self.world == 1:
            log.warning("mixprec ZeRO: a world of 1 rank, so ZeRO shards nothing.")

    def _take_shard(self, optimizer: torch.optim.Optimizer, shard: ProcessGroup | None) -> None:
        """Every rank starts from rank 0's params; each param gets its owner rank, and the inner
        optimizer keeps only this rank's (an emptied group keeps its hyperparameters)."""
        self.all_params = [p for g in optimizer.param_groups for p in g["params"]]
        self.group_of = [k for k, g in enumerate(optimizer.param_groups) for _ in g["params"]]
        if len({id(p) for p in self.all_params}) != len(self.all_params):
            raise ValueError("A parameter appears twice in the optimizer's param_groups.")
        if self.world > 1:
            _broadcast_from_first(self.all_params, shard)  # every rank starts from rank 0's
        # A DTensor's numel is its global one: every tp rank picks the same owners (the clip
        # norm's collectives over the tp mesh need a param's owners to be tp peers).
        self.owners = partition_params([p.numel() for p in self.all_params], self.world)
        mine = {id(p) for p, r in zip(self.all_params, self.owners, strict=True) if r == self.rank}
        for g in optimizer.param_groups:  # an emptied group keeps its hyperparameters (LR)
            g["params"] = [p for p in g["params"] if id(p) in mine]

    @override
    def __repr__(self) -> str:
        return (
            f"ZeroOptimizer(stage={self.stage}, rank={self.rank}/{self.world}, "
            f"{self.optim!r}, scaler={self.scaler.cfg})"
        )

    def _global_rank(self, group_rank: int) -> int:
        """The global rank of a rank of the shard group (None: the default group)."""
        if self.shard_group is None:
            return group_rank
        return dist.get_global_rank(self.shard_group, group_rank)

    def owns(self, index: int) -> bool:
        return self.owners[index] == self.rank

    # ----- gradients: reduced once per step, then handed to this rank's masters -----
    @override
    def _lp_grads_to_masters(self) -> None:
        reduced = self._reduce_grads()
        lp_to_hp = {id(lp): hp for lp, hp in zip(self.lp_params, self.hp_masters, strict=True)}
        masters, means = [], []
        self._stepped = {}
        for i, p in enumerate(self.all_params):
            if not self.owns(i):
                p.grad = None  # no rank keeps a gradient of a param another rank owns
                continue
            hp, mean = lp_to_hp.get(id(p)), reduced.get(i)
            if hp is None:  # None when no rank produced a gradient: no update
                if mean is not None and mean.dtype != p.dtype:
                    mean = mean.to(p.dtype)
                p.grad = None if mean is None else _shaped_like(p, mean)
                if mean is not None:
                    self._stepped[i] = mean  # p.grad's local shard (the same storage)
                continue
            p.grad = None
            if mean is None:
                hp.grad = None
                continue
            if hp.grad is None:  # kept between steps on CPU (MixedPrecisionOptimizer's rule)
                hp.grad = torch.empty_like(hp)
            masters.append(_local(hp.grad))
            means.append(mean)
            self._stepped[i] = masters[-1]
        if masters:
            torch._foreach_copy_(masters, means)  # lp -> fp32 is exact

    def _indices_by_dtype(
        self, override: torch.dtype | None = None
    ) -> dict[torch.dtype, list[int]]:
        """dtype -> indices of the params in it (all of them in override, when given)."""
        buckets: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(self.all_params):
            buckets.setdefault(override or p.dtype, []).append(i)
        return buckets

    def _bucket_plan(self) -> list[tuple[torch.dtype, list[int]]]:
        """(communication dtype, param indices) of each bucket, in reduction order."""
        return [
            (dtype, bucket)
            for dtype, indices in self._indices_by_dtype(self.communication_dtype).items()
            for bucket in self._buckets(indices)
        ]

    def _reduce_grads(self) -> dict[int, torch.Tensor]:
        """index -> the group's mean gradient of each param this rank owns, in its
        communication dtype (one collective per bucket). Buckets overlap_communication
        launched during backward are waited for; the others are reduced here, in order."""
        out: dict[int, torch.Tensor] = {}
        pending, self._pending, self._ready = self._pending, {}, {}
        for b, (dtype, bucket) in enumerate(self._bucket_plan()):
            launched = pending.pop(b, None)
            out.update((launched or self._launch_bucket(dtype, bucket)).wait())
        return out

    # ----- overlap_communication: a bucket is reduced as soon as its last grad is ready -----
    def _install_overlap_hooks(self) -> None:
        """A post-accumulate-grad hook per param: a bucket whose every trainable param got its
        gradient in this backward is launched (async) at once, while backward goes on.

        Bucket order follows backward order, which must be the same on every rank (the same
        params receive grads, as for DDP without find_unused_parameters): a bucket some param
        of which got no gradient waits for step(), where the rest are reduced in order."""
        self._plan = self._bucket_plan()
        self._bucket_of = {i: b for b, (_, bucket) in enumerate(self._plan) for i in bucket}
        self._expected = [
            sum(self.all_params[i].requires_grad for i in bucket) for _, bucket in self._plan
        ]
        # The hooks live on the model's params, which outlive the optimizer: they hold it weakly
        # (a bound method would keep it, and its hooks firing, as long as the model) and are
        # removed when it is collected.
        handles = [
            p.register_post_accumulate_grad_hook(
                functools.partial(_grad_ready_if_alive, weakref.ref(self), i)
            )
            for i, p in enumerate(self.all_params)
            if p.requires_grad
        ]
        weakref.finalize(self, _remove_hooks, handles)

    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        if not self._sync_grads:
            return  # inside no_sync(): the last backward's hooks reduce the accumulated sum
        b = self._bucket_of[index]
        launched = self._pending.pop(b, None)
        if launched is not None:
            # A second backward before step() (accumulation without no_sync): the bucket's
            # grads changed, so its reduction is redone on their sum (the first is discarded).
            launched.wait()
        ready = self._ready.setdefault(b, set())
        ready.add(index)
        if len(ready) == self._expected[b]:
            del self._ready[b]
            self._pending[b] = self._launch_bucket(*self._plan[b])

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate their gradients without reducing any bucket; the
        first backward after it reduces the sums (the same values as reducing at step())."""
        previous, self._sync_grads = self._sync_grads, False
        try:
            yield
        finally:
            self._sync_grads = previous

    def _discard_pending(self) -> None:
        for launched in self._pending.values():
            launched.wait()  # every rank launched it: each must complete it
        self._pending, self._ready = {}, {}

    def _buckets(self, indices: list[int]) -> list[list[int]]:
        """indices cut into buckets of at most reduce_bucket_numel elements (a param larger
        than its rank's share alone in its own), each in index order.

        Every rank's chunk of a bucket is padded to the longest one, so a bucket takes about
        the same number of elements from each owner: each rank's params (in order) are cut
        into segments of reduce_bucket_numel / world elements, and bucket b joins every
        rank's b-th segment. Cut in plain index order instead, a bucket whose params one rank
        mostly owns sent up to world x its elements (measured: 2.5x DDP's bytes at 2 ranks)."""
        limit = self.reduce_bucket_numel
        if limit is None:
            return [indices]
        share = max(1, limit // self.world)
        segments = []
        for rank in range(self.world):
            mine: list[list[int]] = [[]]
            size = 0
            for i in (i for i in indices if self.owners[i] == rank):
                n = self.all_params[i].numel()
                if mine[-1] and size + n > share:
                    mine.append([])
                    size = 0
                mine[-1].append(i)
                size += n
            segments.append(mine)
        count = max(len(mine) for mine in segments)
        return [
            sorted(i for mine in segments if b < len(mine) for i in mine[b]) for b in range(count)
        ]

    def _pack_chunk(
        self,
        part: torch.Tensor,
        size: int,
        chunk: list[int],
        flags: torch.Tensor,
        *,
        divide: bool,
        fp8: bool,
    ) -> None:
        """One owner's slice of a bucket: its params' grads (zeros where a param has none;
        divided by the world size first when `divide`), one presence count per param (written
        into flags; left zero in an fp8 buffer, whose counts travel on their own), padding."""
        views = self._views(chunk, part)
        grads = [self.all_params[i].grad for i in chunk]
        grads = [None if g is None else _local(g) for g in grads]
        given = [(v, g) for v, g in zip(views, grads, strict=True) if g is not None]
        if given:
            torch._foreach_copy_([v for v, _ in given], [g for _, g in given])
        for v, g in zip(views, grads, strict=True):
            if g is None:
                v.zero_()
        if divide:
            part[:size].div_(self.world)  # the grads only: a flag is a count of ranks
        flags[: len(chunk)] = torch.tensor([g is not None for g in grads])
        if fp8:
            part[size : size + len(chunk)].zero_()
        else:
            part[size : size + len(chunk)].copy_(flags[: len(chunk)])
        part[size + len(chunk) :].zero_()  # padding

    def _launch_bucket(self, dtype: torch.dtype, indices: list[int]) -> _LaunchedBucket:
        """Pack one flat buffer of rank-ordered chunks of equal length and launch its
        reduction: a chunk holds its owner's grads, then one presence count per param (a param
        no rank touched gets no gradient). wait() on the result gives this rank's mean grads.

        Low-precision grads are divided by the world size before the sum, as DDP's comm hooks
        do: the mean of finite values then cannot overflow in fp16 (exact for a power-of-2
        world). fp32 sums first and divides after, as before. This rank keeps its own chunk.
        Under fp8_communication the grads travel as fp8 (a reduce-scatter: this rank needs only
        its chunk) and the presence counts separately, in fp32: counts stay exact.
        """
        params, world = self.all_params, self.world
        chunks = [[i for i in indices if self.owners[i] == rank] for rank in range(world)]
        sizes = [sum(self._local_param(i).numel() for i in c) for c in chunks]
        length = max(s + len(c) for s, c in zip(sizes, chunks, strict=True))
        if length == 0:
            return _LaunchedBucket(self, [], 0, None, lambda: None)
        device = params[indices[0]].device
        fp8 = world > 1 and self.fp8_communication is not None
        pre = world > 1 and dtype != torch.float32 and not fp8
        flat = torch.empty(world * length, dtype=torch.float32 if fp8 else dtype, device=device)
        flags = torch.zeros(world, max(len(c) for c in chunks), dtype=torch.float32)
        for rank, chunk in enumerate(chunks):
            part = flat[rank * length : (rank + 1) * length]
            self._pack_chunk(part, sizes[rank], chunk, flags[rank], divide=pre, fp8=fp8)
        group = self.shard_group
        if fp8:
            flags = flags.to(device)
            counted = dist.all_reduce(flags, group=group, async_op=True)
            summed = PendingFp8ReduceScatter(flat, group, self.fp8_communication)
            chunk, size = chunks[self.rank], sizes[self.rank]

            def finish() -> torch.Tensor:
                counted.wait()
                mine = summed.wait()
                mine[size : size + len(chunk)] = flags[self.rank, : len(chunk)]
                return mine

        elif world > 1 and self.stage == 2 and self.reduce_scatter:
            mine = torch.empty(length, dtype=dtype, device=device)
            work = dist.reduce_scatter_tensor(mine, flat, group=group, async_op=True)

            def finish() -> torch.Tensor:
                work.wait()
                return mine

        elif world > 1:
            work = dist.all_reduce(flat, group=group, async_op=True)

            def finish() -> torch.Tensor:
                work.wait()  # the whole buffer is freed: only this rank's chunk lives on
                return flat[self.rank * length : (self.rank + 1) * length].clone()

        else:

            def finish() -> torch.Tensor:
                return flat

        return _LaunchedBucket(self, chunks[self.rank], sizes[self.rank], not pre, finish)

    @override
    def clip_grad_norm(self, max_norm: float, norm_type: float | None = None) -> torch.Tensor:
        """Clip every rank's gradients by the norm over the whole model (all shards)."""
        check_max_norm("max_norm", max_norm)
        p = self.norm_type if norm_type is None else check_norm_type("norm_type", norm_type)
        self.unscale_grads()
        # Each rank holds its own shard (of its pipeline stage, when sharded over a stage's
        # data-parallel group); DTensor grads complete their norm over their tp mesh first.
        group = self.norm_group or default_group()
        grads = [q.grad for g in self.optim.param_groups for q in g["params"] if q.grad is not None]
        device = self.scaler.scale_tensor.device
        return clip_grads_(grads, max_norm, p, group=group, device=device)

    # ----- the step: this rank's shard, then the updated lp params to every rank -----
    @override
    def _after_update(self, result: StepResult) -> None:
        self._carry_grads()
        if not result.skipped and self.world > 1:
            self._all_gather_params()

    def _carry_grads(self) -> None:
        """torch's contract (DDP's, Colossal's): a step leaves its gradients in .grad, so a
        backward without zero_grad() adds to them and the next step runs on g1 + g2. Each owner
        keeps the gradient it stepped with (unscaled, clipped, the group's mean) in its param's
        .grad, times the next loss scale (the next backward's grads come scaled by it) and times
        the world size (the next reduction divides the sum of every rank's grads by it; the
        other ranks hold none of this param): that reduction then gives mean(g1) + mean(g2).
        zero_grad(), the optimizer's or the model's, drops it as in torch."""
        if not self._stepped:
            return
        factor = self.scaler.scale_tensor * self.world  # device tensors: no sync
        for i, grad in self._stepped.items():  # local shards: DTensor grads rebuilt around them
            p = self.all_params[i]
            p.grad = _shaped_like(p, (grad * factor).to(p.dtype))
        self._stepped = {}

    def _all_gather_params(self) -> None:
        """Each owner's updated params to every rank: per param dtype, one all-gather (or,
        over gloo, one broadcast from each owner)."""
        for dtype, indices in self._indices_by_dtype().items():
            chunks = [[i for i in indices if self.owners[i] == r] for r in range(self.world)]
            sizes = [sum(self.all_params[i].numel() for i in c) for c in chunks]
            if max(sizes) == 0:
                continue
            device = self.all_params[indices[0]].device
            if self.gather_by_broadcast:
                self._broadcast_chunks(chunks, sizes, dtype, device)
                continue
            length = max(sizes)
            send = torch.zeros(length, dtype=dtype, device=device)
            self._pack(chunks[self.rank], send)
            recv = torch.empty(self.world * length, dtype=dtype, device=device)
            dist.all_gather_into_tensor(recv, send, group=self.shard_group)
            for rank, chunk in enumerate(chunks):
                if rank != self.rank:
                    self._unpack(chunk, recv[rank * length : (rank + 1) * length])

    def _broadcast_chunks(
        self, chunks: list[list[int]], sizes: list[int], dtype: torch.dtype, device: torch.device
    ) -> None:
        """Every owner broadcasts its packed params at once (async), then each rank unpacks."""
        pending = []
        for rank, chunk in enumerate(chunks):
            if sizes[rank] == 0:
                continue
            buffer = torch.empty(sizes[rank], dtype=dtype, device=device)
            if rank == self.rank:
                self._pack(chunk, buffer)
            src = self._global_rank(rank)
            work = dist.broadcast(buffer, src=src, group=self.shard_group, async_op=True)
            pending.append((rank, chunk, buffer, work))
        for rank, chunk, buffer, work in pending:
            work.wait()
            if rank != self.rank:
                self._unpack(chunk, buffer)

    def _pack(self, chunk: list[int], buffer: torch.Tensor) -> None:
        if chunk:
            torch._foreach_copy_(self._views(chunk, buffer), [self._local_param(i) for i in chunk])

    def _unpack(self, chunk: list[int], buffer: torch.Tensor) -> None:
        if chunk:
            torch._foreach_copy_([self._local_param(i) for i in chunk], self._views(chunk, buffer))

    def _local_param(self, index: int) -> torch.Tensor:
        """The param's values this rank holds (a DTensor's local shard), detached: ZeRO's flat
        buffers pack, reduce and gather local shards over the shard group (one tp index)."""
        return _local(self.all_params[index].detach())

    def _views(self, chunk: list[int], buffer: torch.Tensor) -> list[torch.Tensor]:
        """Views of buffer shaped as the params of chunk, back to back from its start."""
        views, offset = [], 0
        for i in chunk:
            p = self._local_param(i)
            views.append(buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        self._discard_pending()  # reductions of grads about to be dropped
        super().zero_grad(set_to_none)
        for p in self.all_params:  # params other ranks own are not in the inner optimizer
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    # ----- checkpoints: one shard per rank (resumes on the same world size) -----
    def shard_layout(self) -> dict[str, Any]:
        """Which rank owns which param: a shard only loads where this layout is the same."""
        return {"stage": self.stage, "world": self.world, "rank": self.rank, "owners": self.owners}

    @override
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: its optimizer state and masters, the scaler, and the layout."""
        return {**super().state_dict(), "zero": self.shard_layout()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("zero")
        mine = self.shard_layout()
        if saved is None or {k: saved.get(k) for k in ("world", "rank", "owners")} != {
            k: mine[k] for k in ("world", "rank", "owners")
        }:
            layout = None if saved is None else {k: saved.get(k) for k in ("world", "rank")}
            raise ValueError(
                f"This ZeRO shard was saved as {layout or 'no ZeRO shard'}; this rank is "
                f"{ {'world': self.world, 'rank': self.rank} } with a different param layout. "
                "Load it on the same world size and model."
            )
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "zero"})
        if self.world > 1:
            self._all_gather_params()  # each owner loaded its params: every rank needs them

    def hp_params(self) -> list[torch.Tensor]:
        """Every param's fp32 value (the master where one exists), gathered from its owner."""
        lp_to_hp = {id(lp): hp for lp, hp in zip(self.lp_params, self.hp_masters, strict=True)}
        out = []
        for i, p in enumerate(self.all_params):
            hp = lp_to_hp.get(id(p))
            if hp is None and (p.dtype not in LOW_DTYPES or self.master_weights is False):
                out.append(p.detach().float().clone())  # fp32 or master-less: replicated
                continue
            value = (
                hp.detach().clone() if hp is not None else torch.empty_like(p, dtype=torch.float32)
            )
            if self.world > 1:  # a DTensor's local shard, over this tp index's shard group
                src = self._global_rank(self.owners[i])
                dist.broadcast(_local(value), src=src, group=self.shard_group)
            out.append(value)
        return out

    # ----- gathered checkpoints: an unsharded MixedPrecisionOptimizer's state_dict -----
    def _unsharded_twin(
        self, *, current: bool = False
    ) -> tuple[MixedPrecisionOptimizer, list[torch.Tensor]]:
        """An unsharded MixedPrecisionOptimizer over CPU stand-ins of every param, and what its
        inner optimizer holds for each (master or param). Gathered checkpoints go through its
        own state_dict/load_state_dict, so they are ordinary mixprec optimizer checkpoints.

        current=True (for a load): the stand-ins hold the params' current values, the masters
        this rank owns their current fp32 values, the scaler and counters this optimizer's, so
        what a checkpoint lacks (a plain torch optimizer's has no masters, no scaler) stays as
        it is, by the unsharded load's own rules, instead of coming back as zeros."""
        stand_ins = [  # a DTensor's stand-in stays zeros: its values live over its tp mesh
            p.detach().to("cpu", copy=True)
            if current and _local(p) is p
            else torch.zeros_like(p, device="cpu")
            for p in self.all_params
        ]
        groups = [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [s for s, g in zip(stand_ins, self.group_of, strict=True) if g == k],
            }
            for k, group in enumerate(self.optim.param_groups)
        ]
        cls = type(self.optim)
        accepted = inspect.signature(cls).parameters  # defaults may hold more (AdamW's)
        defaults = {k: v for k, v in self.optim.defaults.items() if k in accepted}
        try:
            inner = cls(groups, **defaults)
        except TypeError as exc:
            raise TypeError(
                f"A gathered ZeRO checkpoint rebuilds {type(self.optim).__name__} from its "
                f"param_groups and defaults, which failed: {exc}"
            ) from exc
        twin = MixedPrecisionOptimizer(
            inner,
            loss_scale=self.scaler.cfg,
            master_weights=self.master_weights,
            max_consecutive_skips=None,
            fused_step=False,
            lean=None if self.lean is None else self.lean.cfg,  # its state format, its stream
        )
        if self.lean is not None:  # the stream as rank 0 of one process would hold it
            twin.lean.seed = base_seed(self.lean.seed, rank_and_world()[0])
            twin.lean.counter.copy_(self.lean.counter.cpu())
        twin_held = [p for g in inner.param_groups for p in g["params"]]  # all_params order
        if current:
            with torch.no_grad():
                for i, mine in self._held().items():
                    if _local(mine) is mine:
                        twin_held[i].copy_(mine)  # an owned fp32 master (or the param itself)
            twin.scaler.load_state_dict(self.scaler.state_dict())
            twin.steps, twin.skipped_steps = self.steps, self.skipped_steps
        return twin, twin_held

    def _held(self) -> dict[int, torch.Tensor]:
        """index -> the tensor this rank's inner optimizer steps for it (master or param)."""
        lp_to_hp = {id(lp): hp for lp, hp in zip(self.lp_params, self.hp_masters, strict=True)}
        return {i: lp_to_hp.get(id(p), p) for i, p in enumerate(self.all_params) if self.owns(i)}

    def gathered_state_dict(self) -> dict[str, Any] | None:
        """The whole optimizer, gathered on group rank 0 as an unsharded optimizer's
        state_dict (None on other ranks): it loads into any world size, sharded or not.

        Rank 0 holds the full masters and state while building it (checkpoint time only).
        """
        lp_ids = {id(lp) for lp in self.lp_params}
        local = {
            i: (
                {
                    k: v.detach().cpu() if torch.is_tensor(v) else v
                    for k, v in self.state.get(held, {}).items()
                },
                held.detach().cpu() if id(self.all_params[i]) in lp_ids else None,
            )
            for i, held in self._held().items()
        }
        parts: list[Any] = [local]
        if self.world > 1:
            parts = [None] * self.world if self.rank == 0 else []
            dst = self._global_rank(0)
            dist.gather_object(
                local, parts if self.rank == 0 else None, dst=dst, group=self.shard_group
            )
        if self.rank != 0:
            return None
        twin, twin_held = self._unsharded_twin()
        for part in parts:
            for i, (state, master) in part.items():
                if master is not None:
                    twin_held[i].detach().copy_(master)
                if state:
                    twin.optim.state[twin_held[i]] = state
        twin.scaler.load_state_dict(self.scaler.state_dict())
        twin.steps, twin.skipped_steps = self.steps, self.skipped_steps
        return twin.state_dict()

    def load_gathered_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an unsharded optimizer's state_dict (gathered_state_dict's, or a plain
        MixedPrecisionOptimizer's): each rank keeps its own shard of it."""
        twin, twin_held = self._unsharded_twin(current=True)
        twin.load_state_dict(state_dict)  # the unsharded optimizer's own checks and layout
        for mine, loaded in zip(self.optim.param_groups, twin.optim.param_groups, strict=True):
            mine.update({k: v for k, v in loaded.items() if k != "params"})  # lr, betas, ...
        twin_masters = {id(hp) for hp in twin.hp_masters}
        held = self._held()
        with torch.no_grad():
            for i, p in enumerate(self.all_params):
                source = twin_held[i]
                if id(source) in twin_masters:
                    p.copy_(source)  # every rank's lp copy, rounded from the loaded master
                if i not in held:
                    continue
                if held[i] is not p:
                    held[i].copy_(source)
                state = twin.optim.state.get(source, {})
                self.optim.state.pop(held[i], None)
                if state:  # per-param tensors follow the param; scalars (Adam's step) stay put
                    self.optim.state[held[i]] = {
                        k: v.to(held[i].device) if torch.is_tensor(v) and v.shape == p.shape else v
                        for k, v in state.items()
                    }
        self.scaler.load_state_dict(twin.scaler.state_dict())
        self.steps, self.skipped_steps = twin.steps, twin.skipped_steps
        if self.lean is not None:  # each rank's own stream, mixed from the saved base seed
            self.lean.seed = rank_seed(twin.lean.seed, rank_and_world()[0])
            self.lean.counter.copy_(twin.lean.counter)
        self._found_inf = None
        self._grads_on_masters = False

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


def _grad_ready_if_alive(ref: weakref.ref, index: int, param: torch.Tensor) -> None:
    zero = ref()
    if zero is not None:
        zero._grad_ready(index, param)


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


class _LaunchedBucket:
    """One bucket's launched reduction; wait() gives index -> this rank's mean gradient of
    each param it owns that some rank produced a gradient for."""

    def __init__(
        self,
        zero: ZeroOptimizer,
        chunk: list[int],
        size: int,
        divide_after: bool | None,
        finish: Callable[[], torch.Tensor | None],
    ) -> None:
        self.zero, self.chunk, self.size = zero, chunk, size
        self.divide_after, self.finish = divide_after, finish

    def wait(self) -> dict[int, torch.Tensor]:
        mine = self.finish()
        if mine is None:
            return {}
        world, chunk, size = self.zero.world, self.chunk, self.size
        if world > 1 and self.divide_after:
            mine.div_(world)  # the mean over ranks (exact for powers of 2)
        present = (mine[size : size + len(chunk)] > 0).tolist()  # one host sync
        out: dict[int, torch.Tensor] = {}
        offset = 0
        for i, has_grad in zip(chunk, present, strict=True):
            p = self.zero._local_param(i)
            if has_grad:
                out[i] = mine[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return out


def _broadcast_from_first(params: list[torch.Tensor], group: ProcessGroup) -> None:
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for p in local_shards([p.detach() for p in params]):
            dist.broadcast(p, src=src, group=group)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage), else t."""
    return local_shards([t])[0]


def _shaped_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A gradient for param from this rank's values of it: local itself for a plain param, a
    DTensor laid out as param around local (no copy, no communication) for a DTensor one."""
    if local_shards([param])[0] is param:
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        param.device_mesh,  # type: ignore[attr-defined]
        param.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


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
