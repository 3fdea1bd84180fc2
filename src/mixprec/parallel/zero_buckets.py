"""ZeRO's gradient buckets: each owner's gradients summed over the shard group, in flat buffers.

A bucket is one flat buffer per communication dtype and size cap, cut into rank-ordered chunks
of equal length: a chunk holds its owner's params' grads, then one presence count per param
(a param no rank touched gets no gradient), then padding. It is all-reduced (stage 1, and stage
2 over gloo) or reduce-scattered (stage 2) and each rank keeps its own chunk. By default every
bucket is reduced at step(), in order; with overlap a bucket is launched (async) from a
post-accumulate-grad hook as soon as its last param's grad is ready: the same buffers and
collectives, so bit-identical results. Under fp8 communication the grads travel in fp8
(mixprec.parallel.comm) and the presence counts apart, in fp32.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from mixprec.core.grad_transfer import GradTransfer, Handed
from mixprec.parallel.comm import PendingFp8ReduceScatter
from mixprec.parallel.zero_layout import ShardLayout, local, shaped_like


class LaunchedBucket:
    """One bucket's launched reduction; wait() gives index -> this rank's mean gradient of
    each param it owns that some rank produced a gradient for."""

    def __init__(
        self,
        layout: ShardLayout,
        chunk: list[int],
        size: int,
        divide_after: bool,
        finish: Callable[[], torch.Tensor | None],
    ) -> None:
        self.layout, self.chunk, self.size = layout, chunk, size
        self.divide_after, self.finish = divide_after, finish

    def wait(self) -> dict[int, torch.Tensor]:
        mine = self.finish()
        if mine is None:
            return {}
        world, chunk, size = self.layout.world, self.chunk, self.size
        if world > 1 and self.divide_after:
            mine.div_(world)  # the mean over ranks (exact for powers of 2)
        present = (mine[size : size + len(chunk)] > 0).tolist()  # one host sync
        out: dict[int, torch.Tensor] = {}
        offset = 0
        for i, has_grad in zip(chunk, present, strict=True):
            p = self.layout.local_param(i)
            if has_grad:
                out[i] = mine[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return out


class GradBuckets:
    """The buckets of a ZeRO optimizer's gradients and their reductions.

    Args:
        layout: the params and their owners.
        stage: 1 (all-reduce) or 2 (reduce-scatter where reduce_scatter says so).
        reduce_scatter: stage 2's collective (None: reduce-scatter, except over gloo).
        communication_dtype: the dtype grads are summed in (None: each param's own; over gloo
            fp32, where an fp16 sum ran 1.3-1.6x slower than fp32's and bf16's no faster).
        fp8_dtype: the fp8 dtype grads travel in (None: off).
        bucket_numel: at most this many grad elements per bucket (None: one per dtype).
    """

    def __init__(
        self,
        layout: ShardLayout,
        *,
        stage: int,
        reduce_scatter: bool | None,
        communication_dtype: torch.dtype | None,
        fp8_dtype: torch.dtype | None,
        bucket_numel: int | None,
    ) -> None:
        self.layout, self.stage = layout, stage
        gloo = layout.gloo
        self.reduce_scatter = not gloo if reduce_scatter is None else reduce_scatter
        gloo_dtype = torch.float32 if gloo else None
        self.communication_dtype = (
            gloo_dtype if communication_dtype is None else communication_dtype
        )
        self.fp8_dtype, self.bucket_numel = fp8_dtype, bucket_numel
        self.pending: dict[int, LaunchedBucket] = {}
        """bucket -> its reduction launched during backward (overlap), not yet waited for."""
        self._ready: dict[int, set[int]] = {}  # bucket -> params whose grad this backward gave
        self.syncs = True
        """False inside no_sync(): backward passes launch no reduction."""

    def plan(self) -> list[tuple[torch.dtype, list[int]]]:
        """(communication dtype, param indices) of each bucket, in reduction order."""
        return [
            (dtype, bucket)
            for dtype, indices in self.layout.indices_by_dtype(self.communication_dtype).items()
            for bucket in self._cut(indices)
        ]

    def _cut(self, indices: list[int]) -> list[list[int]]:
        """indices cut into buckets of at most bucket_numel elements (a param larger than its
        rank's share alone in its own), each in index order.

        Every rank's chunk of a bucket is padded to the longest one, so a bucket takes about
        the same number of elements from each owner: each rank's params (in order) are cut
        into segments of bucket_numel / world elements, and bucket b joins every rank's b-th
        segment. Cut in plain index order instead, a bucket whose params one rank mostly owns
        sent up to world x its elements (measured: 2.5x DDP's bytes at 2 ranks)."""
        if self.bucket_numel is None:
            return [indices]
        share = max(1, self.bucket_numel // self.layout.world)
        segments = []
        for chunk in self.layout.chunks(indices):
            mine: list[list[int]] = [[]]
            size = 0
            for i in chunk:
                n = self.layout.all_params[i].numel()
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

    def reduce(self) -> dict[int, torch.Tensor]:
        """index -> the group's mean gradient of each param this rank owns, in its
        communication dtype (one collective per bucket). Buckets launched during backward are
        waited for; the others are reduced here, in order."""
        out: dict[int, torch.Tensor] = {}
        pending, self.pending, self._ready = self.pending, {}, {}
        for b, (dtype, bucket) in enumerate(self.plan()):
            launched = pending.pop(b, None)
            out.update((launched or self.launch(dtype, bucket)).wait())
        return out

    # ----- the reducer slot (core.grad_transfer.GradReducer) -----
    def reduce_(self, transfer: GradTransfer, move: Callable[[], None]) -> None:
        """The lp grads reduced (reduce()), then handed to this rank's masters: each owned
        param's mean copied into its master's fp32 grad (exact), or, for a param without a
        master, set as its grad in its dtype; no rank keeps a gradient of a param another rank
        owns. move() is not run: the group's mean, not this rank's lp grad, is what the masters
        take. What each owner steps with is handed to the transfer's carry (GradTransfer.hand):
        after the step it goes back into the param's .grad times the world size (the next
        reduction divides the sum by it; the other ranks hold none of it), shaped_like its
        param, so the next step runs on mean(g1) + mean(g2) as torch's contract has it."""
        reduced = self.reduce()
        lp_to_hp = {
            id(lp): hp for lp, hp in zip(transfer.lp_params, transfer.hp_masters, strict=True)
        }
        masters, means = [], []
        stepped: dict[int, torch.Tensor] = {}
        for i, p in enumerate(self.layout.all_params):
            if not self.layout.owns(i):
                p.grad = None  # no rank keeps a gradient of a param another rank owns
                continue
            hp, mean = lp_to_hp.get(id(p)), reduced.get(i)
            if hp is None:  # None when no rank produced a gradient: no update
                if mean is not None and mean.dtype != p.dtype:
                    mean = mean.to(p.dtype)
                p.grad = None if mean is None else shaped_like(p, mean)
                if mean is not None:
                    stepped[i] = mean  # p.grad's local shard (the same storage)
                continue
            p.grad = None
            if mean is None:
                hp.grad = None
                continue
            if hp.grad is None:  # kept between steps on CPU (MixedPrecisionOptimizer's rule)
                hp.grad = torch.empty_like(hp)
            masters.append(local(hp.grad))
            means.append(mean)
            stepped[i] = masters[-1]
        if masters:
            torch._foreach_copy_(masters, means)  # lp -> fp32 is exact
        params = self.layout.all_params
        transfer.hand(
            Handed(
                params=[params[i] for i in stepped],
                grads=list(stepped.values()),
                divisor=self.layout.world,
                shape=shaped_like,
            )
        )

    def zero_grad(self, set_to_none: bool) -> None:
        """The reductions in flight are completed and dropped (discard_pending), and the grads
        of every param, those other ranks own too, cleared as torch's zero_grad does."""
        self.discard_pending()
        for p in self.layout.all_params:  # params other ranks own are not in the optimizer
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def discard_pending(self) -> None:
        """Complete and drop the reductions launched for grads about to be dropped."""
        for launched in self.pending.values():
            launched.wait()  # every rank launched it: each must complete it
        self.pending, self._ready = {}, {}

    # ----- overlap: a bucket is reduced as soon as its last grad is ready -----
    def install_overlap_hooks(self) -> None:
        """A post-accumulate-grad hook per param: a bucket whose every trainable param got its
        gradient in this backward is launched (async) at once, while backward goes on.

        Bucket order follows backward order, which must be the same on every rank (the same
        params receive grads, as for DDP without find_unused_parameters): a bucket some param
        of which got no gradient waits for reduce(), where the rest are reduced in order."""
        params, self._plan = self.layout.all_params, self.plan()
        self._bucket_of = {i: b for b, (_, bucket) in enumerate(self._plan) for i in bucket}
        self._expected = [sum(params[i].requires_grad for i in bucket) for _, bucket in self._plan]
        # The hooks live on the model's params, which outlive these buckets: they hold them
        # weakly (a bound method would keep them, and the hooks firing, as long as the model)
        # and are removed when they are collected.
        handles = [
            p.register_post_accumulate_grad_hook(
                functools.partial(_grad_ready_if_alive, weakref.ref(self), i)
            )
            for i, p in enumerate(params)
            if p.requires_grad
        ]
        weakref.finalize(self, _remove_hooks, handles)

    def grad_ready(self, index: int) -> None:
        if not self.syncs:
            return  # inside no_sync(): the last backward's hooks reduce the accumulated sum
        b = self._bucket_of[index]
        launched = self.pending.pop(b, None)
        if launched is not None:
            # A second backward before step() (accumulation without no_sync): the bucket's
            # grads changed, so its reduction is redone on their sum (the first is discarded).
            launched.wait()
        ready = self._ready.setdefault(b, set())
        ready.add(index)
        if len(ready) == self._expected[b]:
            del self._ready[b]
            self.pending[b] = self.launch(*self._plan[b])

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate their gradients without reducing any bucket; the
        first backward after it reduces the sums (the same values as reducing at step())."""
        previous, self.syncs = self.syncs, False
        try:
            yield
        finally:
            self.syncs = previous

    # ----- one bucket -----
    def launch(self, dtype: torch.dtype, indices: list[int]) -> LaunchedBucket:
        """Pack one flat buffer of rank-ordered chunks of equal length and launch its
        reduction. wait() on the result gives this rank's mean grads.

        Low-precision grads are divided by the world size before the sum, as DDP's comm hooks
        do: the mean of finite values then cannot overflow in fp16 (exact for a power-of-2
        world). fp32 sums first and divides after. Under fp8 the grads travel as fp8 (a
        reduce-scatter: this rank needs only its chunk) and the presence counts separately, in
        fp32: counts stay exact.
        """
        layout, world = self.layout, self.layout.world
        chunks = layout.chunks(indices)
        sizes = [layout.numel(c) for c in chunks]
        length = max(s + len(c) for s, c in zip(sizes, chunks, strict=True))
        if length == 0:
            return LaunchedBucket(layout, [], 0, False, lambda: None)
        device = layout.all_params[indices[0]].device
        fp8 = world > 1 and self.fp8_dtype is not None
        pre = world > 1 and dtype != torch.float32 and not fp8
        flat = torch.empty(world * length, dtype=torch.float32 if fp8 else dtype, device=device)
        flags = torch.zeros(world, max(len(c) for c in chunks), dtype=torch.float32)
        for rank, chunk in enumerate(chunks):
            part = flat[rank * length : (rank + 1) * length]
            self._pack_chunk(part, sizes[rank], chunk, flags[rank], divide=pre, fp8=fp8)
        mine = layout.rank
        if fp8:
            finish = self._fp8_reduce_scatter(flat, flags, len(chunks[mine]), sizes[mine])
        else:
            finish = self._reduce(flat, length)
        return LaunchedBucket(layout, chunks[mine], sizes[mine], not pre, finish)

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
        views = self.layout.views(chunk, part)
        grads = [self.layout.all_params[i].grad for i in chunk]
        grads = [None if g is None else local(g) for g in grads]
        given = [(v, g) for v, g in zip(views, grads, strict=True) if g is not None]
        if given:
            torch._foreach_copy_([v for v, _ in given], [g for _, g in given])
        for v, g in zip(views, grads, strict=True):
            if g is None:
                v.zero_()
        if divide:
            part[:size].div_(self.layout.world)  # the grads only: a flag is a count of ranks
        flags[: len(chunk)] = torch.tensor([g is not None for g in grads])
        if fp8:
            part[size : size + len(chunk)].zero_()
        else:
            part[size : size + len(chunk)].copy_(flags[: len(chunk)])
        part[size + len(chunk) :].zero_()  # padding

    def _fp8_reduce_scatter(
        self, flat: torch.Tensor, flags: torch.Tensor, count: int, size: int
    ) -> Callable[[], torch.Tensor]:
        """The grads reduce-scattered in fp8, the presence counts all-reduced in fp32; finish()
        writes this rank's counts into its chunk."""
        group, rank = self.layout.group, self.layout.rank
        flags = flags.to(flat.device)
        counted = dist.all_reduce(flags, group=group, async_op=True)
        summed = PendingFp8ReduceScatter(flat, group, self.fp8_dtype)

        def finish() -> torch.Tensor:
            counted.wait()
            mine = summed.wait()
            mine[size : size + count] = flags[rank, :count]
            return mine

        return finish

    def _reduce(self, flat: torch.Tensor, length: int) -> Callable[[], torch.Tensor]:
        """flat's sum over the group launched; finish() gives this rank's chunk of it."""
        group, rank, world = self.layout.group, self.layout.rank, self.layout.world
        if world == 1:
            return lambda: flat
        if self.stage == 2 and self.reduce_scatter:
            mine = torch.empty(length, dtype=flat.dtype, device=flat.device)
            work = dist.reduce_scatter_tensor(mine, flat, group=group, async_op=True)

            def finish() -> torch.Tensor:
                work.wait()
                return mine

            return finish
        work = dist.all_reduce(flat, group=group, async_op=True)

        def finish_all() -> torch.Tensor:
            work.wait()  # the whole buffer is freed: only this rank's chunk lives on
            return flat[rank * length : (rank + 1) * length].clone()

        return finish_all


def _grad_ready_if_alive(ref: weakref.ref, index: int, param: torch.Tensor) -> None:
    buckets = ref()
    if buckets is not None:
        buckets.grad_ready(index)


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
