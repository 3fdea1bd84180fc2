"""fp8-compressed gradient communication (Colossal-AI's fp8_communication=True).

A gradient buffer is cast to float8 with one per-tensor scale (a power of two: scaling and
unscaling are exact, only the fp8 rounding loses bits), and the collectives move the fp8 bytes
(viewed as uint8: gloo and NCCL reduce no float8 dtype) plus one fp32 scale per rank:

- all-to-all / all-gather: each rank casts its whole input with its own scale and the fp8
  bytes travel with every rank's scale; the receiver dequantizes (exact) in fp32;
- reduce-scatter: an all-to-all of the fp8 chunks, then each rank dequantizes the chunks it
  received and sums them in fp32 (the sum is never rounded to fp8);
- all-reduce: that reduce-scatter, then each rank re-quantizes its summed chunk (its own scale)
  and the fp8 chunks are all-gathered; every rank, its own chunk included, uses the
  dequantized gathered values, so replicas stay bit-identical (DDP's contract).

Error bound (per element, in units of the input): fp8 round-to-nearest of v = x * s errs by at
most max(|v| * 2**-(m+1), 2**(emin-m-1)) (half an ulp, or half the smallest subnormal), m the
mantissa bits and emin the least normal exponent (e4m3: 3, -6; e5m2: 2, -14), so per rounding
|err| <= max(|x| * 2**-(m+1), 2**(emin-m-1) / s), with s >= fp8_max / (2 * amax). The
reduce-scatter rounds each rank's input once; the all-reduce rounds the sum once more. A non-finite value anywhere makes that
rank's scale 0 or nan, so the whole result is nan on every rank: the overflow reaches the loss
scaler's finite check and the step is skipped everywhere, as without compression.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mixprec.core.scaling import ProcessGroup
from mixprec.fp8.casts import amax_to_scale, tensor_to_amax, tensor_to_fp8

FP8_COMM_FORMATS: dict[str, torch.dtype] = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
}
DEFAULT_FP8_COMM_FORMAT = "e5m2"  # gradients: e5m2's range (2**32 vs e4m3's 2**18) per scale


def to_fp8_comm_dtype(value: Any, who: str) -> torch.dtype | None:
    """fp8_communication=False | True | 'e4m3' | 'e5m2' as the wire dtype (None: off)."""
    if value is False:
        return None
    if value is True:
        return FP8_COMM_FORMATS[DEFAULT_FP8_COMM_FORMAT]
    if isinstance(value, str) and value in FP8_COMM_FORMATS:
        return FP8_COMM_FORMATS[value]
    raise ValueError(
        f"{who}(fp8_communication={value!r}); valid: False, True (= "
        f"{DEFAULT_FP8_COMM_FORMAT!r}) or one of {sorted(FP8_COMM_FORMATS)}."
    )


def _world(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def _quantize(hp: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the fp8 bytes as uint8, the fp32 scale as a 1-element tensor)."""
    scale = amax_to_scale(tensor_to_amax(hp), fp8_dtype, power_of_two=True).reshape(1)
    return tensor_to_fp8(hp, scale, fp8_dtype).view(torch.uint8), scale


def _dequantize(
    lp_bytes: torch.Tensor, scales: torch.Tensor, fp8_dtype: torch.dtype
) -> torch.Tensor:
    """(world, n) uint8 rows with one scale per row -> fp32 (exact: power-of-two scales)."""
    return lp_bytes.view(fp8_dtype).to(torch.float32) / scales.reshape(-1, 1)


class PendingFp8AllToAll:
    """A launched fp8 all-to-all of one flat tensor, cast with one scale (this rank's): piece i
    (input_split_sizes[i] elements; world equal pieces when None) goes to rank i, and this rank
    receives output_split_sizes[j] elements from rank j. wait() gives what was received,
    dequantized to fp32 (exact: power-of-two scales), source rank by source rank, flat."""

    def __init__(
        self,
        hp_flat: torch.Tensor,
        group: ProcessGroup | None,
        fp8_dtype: torch.dtype,
        input_split_sizes: list[int] | None = None,
        output_split_sizes: list[int] | None = None,
    ) -> None:
        world = _world(group)
        if hp_flat.dim() != 1:
            raise ValueError(
                f"fp8 all-to-all needs a flat tensor, got shape {tuple(hp_flat.shape)}."
            )
        if (input_split_sizes is None) != (output_split_sizes is None):
            raise ValueError(
                "fp8 all-to-all takes both input_split_sizes and output_split_sizes or neither, "
                f"got {input_split_sizes!r} and {output_split_sizes!r}."
            )
        if input_split_sizes is None:
            if hp_flat.numel() % world:
                raise ValueError(
                    f"fp8 all-to-all without split sizes needs a length ({hp_flat.numel()}) "
                    f"that divides by the world size ({world})."
                )
            output_split_sizes = [hp_flat.numel() // world] * world
        else:
            for name, sizes in (("input", input_split_sizes), ("output", output_split_sizes)):
                if len(sizes) != world or any(n < 0 for n in sizes):
                    raise ValueError(
                        f"fp8 all-to-all: {name}_split_sizes={sizes!r} must hold {world} "
                        "non-negative sizes, one per rank."
                    )
            if sum(input_split_sizes) != hp_flat.numel():
                raise ValueError(
                    f"fp8 all-to-all: input_split_sizes={input_split_sizes!r} sum to "
                    f"{sum(input_split_sizes)}, the tensor has {hp_flat.numel()} elements."
                )
        self.fp8_dtype, self.world = fp8_dtype, world
        self.output_split_sizes = list(output_split_sizes)
        lp_bytes, scale = _quantize(hp_flat, fp8_dtype)
        self.received = torch.empty(
            sum(self.output_split_sizes), dtype=torch.uint8, device=hp_flat.device
        )
        self.scales = torch.empty(world, dtype=torch.float32, device=hp_flat.device)
        self.works = [
            dist.all_to_all_single(
                self.received,
                lp_bytes,
                output_split_sizes=None if input_split_sizes is None else output_split_sizes,
                input_split_sizes=input_split_sizes,
                group=group,
                async_op=True,
            ),
            dist.all_gather_into_tensor(self.scales, scale, group=group, async_op=True),
        ]

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        sizes = self.output_split_sizes
        if len(set(sizes)) == 1:  # equal pieces: one (world, n) dequantization
            rows = self.received.view(self.world, -1)
            return _dequantize(rows, self.scales, self.fp8_dtype).reshape(-1)
        pieces = self.received.split(sizes)
        return torch.cat(
            [
                _dequantize(piece.view(1, -1), scale, self.fp8_dtype).reshape(-1)
                for piece, scale in zip(pieces, self.scales.split(1), strict=True)
            ]
        )


class PendingFp8ReduceScatter:
    """A launched fp8 reduce-scatter; wait() gives this rank's chunk of the sum, in fp32."""

    def __init__(self, hp_flat: torch.Tensor, group: ProcessGroup | None, fp8_dtype: torch.dtype):
        world = _world(group)
        if hp_flat.dim() != 1 or hp_flat.numel() % world:
            raise ValueError(
                f"fp8 reduce-scatter needs a flat tensor whose length ({hp_flat.numel()}) "
                f"divides by the world size ({world})."
            )
        self.world = world
        self.all_to_all = PendingFp8AllToAll(hp_flat, group, fp8_dtype)

    def wait(self) -> torch.Tensor:
        rows = self.all_to_all.wait().view(self.world, -1)
        return rows.sum(dim=0)  # fp32, in rank order: the same sum on every run


def fp8_reduce_scatter(
    hp_flat: torch.Tensor, group: ProcessGroup | None, fp8_dtype: torch.dtype
) -> torch.Tensor:
    """This rank's chunk (hp_flat split in world equal parts) of the sum over the group, fp32."""
    return PendingFp8ReduceScatter(hp_flat, group, fp8_dtype).wait()


class PendingFp8AllGather:
    """A launched fp8 all-gather: every rank's flat tensor (equal lengths), each cast with its
    own scale; wait() gives the (world, n) rows in fp32, the same bytes on every rank."""

    def __init__(self, hp_flat: torch.Tensor, group: ProcessGroup | None, fp8_dtype: torch.dtype):
        if hp_flat.dim() != 1:
            raise ValueError(
                f"fp8 all-gather needs a flat tensor, got shape {tuple(hp_flat.shape)}."
            )
        self.world, self.fp8_dtype = _world(group), fp8_dtype
        lp_bytes, scale = _quantize(hp_flat, fp8_dtype)
        device = hp_flat.device
        self.gathered = torch.empty(self.world * lp_bytes.numel(), dtype=torch.uint8, device=device)
        self.scales = torch.empty(self.world, dtype=torch.float32, device=device)
        self.works = [
            dist.all_gather_into_tensor(self.gathered, lp_bytes, group=group, async_op=True),
            dist.all_gather_into_tensor(self.scales, scale, group=group, async_op=True),
        ]

    def future(self) -> torch.futures.Future:
        """Completes when both collectives have landed (then rows() may be read)."""
        return torch.futures.collect_all([work.get_future() for work in self.works])

    def rows(self) -> torch.Tensor:
        """(world, n) fp32, row j rank j's tensor; only once the collectives have landed."""
        return _dequantize(self.gathered.view(self.world, -1), self.scales, self.fp8_dtype)

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.rows()


class PendingFp8AllReduce:
    """An fp8 all-reduce in its two phases: the reduce-scatter is launched at construction;
    gather() waits for it, re-quantizes this rank's summed chunk, launches the all-gather
    and returns a Future of the sum (hp_tensor's shape and dtype) that completes with it.

    Launching is left to the caller so that every rank issues the collectives in the same
    order (gloo and NCCL match them by issue order): a DDP comm hook launches a bucket's
    reduce-scatter at once and gathers it from the next bucket's hook."""

    def __init__(
        self, hp_tensor: torch.Tensor, group: ProcessGroup | None, fp8_dtype: torch.dtype
    ) -> None:
        self.world, self.group, self.fp8_dtype = _world(group), group, fp8_dtype
        self.shape, self.dtype, self.numel = hp_tensor.shape, hp_tensor.dtype, hp_tensor.numel()
        flat = hp_tensor.detach().reshape(-1).to(torch.float32)
        pad = -flat.numel() % self.world
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        # quantized here: the caller may reuse hp_tensor as soon as this returns
        self.scatter = PendingFp8ReduceScatter(flat, group, fp8_dtype)

    def gather(self) -> torch.futures.Future:
        hp_chunk = self.scatter.wait()
        gathered = PendingFp8AllGather(hp_chunk, self.group, self.fp8_dtype)

        def total(_: torch.futures.Future) -> torch.Tensor:
            # every rank, its own chunk included, dequantizes the same gathered bytes
            flat = gathered.rows().reshape(-1)
            return flat[: self.numel].view(self.shape).to(self.dtype)

        return gathered.future().then(total)


def fp8_all_reduce(
    hp_tensor: torch.Tensor, group: ProcessGroup | None, fp8_dtype: torch.dtype
) -> torch.Tensor:
    """The sum of hp_tensor over the group, moved in fp8 (see the module docstring); a new
    tensor of hp_tensor's shape and dtype, bit-identical on every rank."""
    return PendingFp8AllReduce(hp_tensor, group, fp8_dtype).gather().wait()


class Fp8ReduceScatter:
    """FSDP2's reduce-scatter moving fp8 (FSDPModule.set_custom_reduce_scatter's interface:
    allocate + the call): each FSDP unit's gradient buffer is reduce-scattered with one scale
    per rank and summed in fp32 (one fp8 rounding), then averaged when FSDP asks for AVG."""

    def __init__(self, fp8_dtype: torch.dtype) -> None:
        self.fp8_dtype = fp8_dtype

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise NotImplementedError(
                f"fp8 reduce-scatter under FSDP2 with op {op!r}: only SUM and AVG are "
                "implemented (a gradient_divide_factor other than the world size asks for "
                "PREMUL_SUM)."
            )
        summed = fp8_reduce_scatter(input_tensor.reshape(-1), group, self.fp8_dtype)
        if op == dist.ReduceOp.AVG:
            summed.div_(_world(group))
        output_tensor.copy_(summed.view_as(output_tensor))
        return None  # done synchronously: FSDP ignores the work handle when async_op is False


def fp8_ddp_comm_hook(fp8_dtype: torch.dtype) -> Callable[..., torch.futures.Future]:
    """A DDP comm hook (register_comm_hook(group, hook)) averaging each bucket in fp8, as
    Colossal's fp8_compress_ddp_grad_comm_hook; state is the process group (None: default).

    It returns before the bucket is reduced, so buckets travel while backward goes on: the
    hook launches its bucket's reduce-scatter and gathers the previous bucket's (whose
    reduce-scatter has had the backward in between to complete); the last bucket is gathered
    at once. All collectives are issued from DDP's hook calls, which come in bucket order on
    every rank, so every rank issues them in the same order (a callback on a communication
    thread would race DDP's own collectives, e.g. find_unused_parameters' used-map). The
    returned Future completes with the mean, bit-identical to fp8_all_reduce(buffer) / world.
    Register a fresh hook per DDP model: it holds that model's bucket in flight."""
    in_flight: list[tuple[PendingFp8AllReduce, torch.futures.Future]] = []

    # No annotations: DDP checks them against dist.GradBucket / Future[Tensor] objects, and
    # this module's postponed annotations are strings.
    def hook(group, bucket):  # noqa: ANN001, ANN202
        buffer = bucket.buffer()
        pending = PendingFp8AllReduce(buffer, group, fp8_dtype)
        mean = _future_on(buffer.device)
        if in_flight:
            _gather_mean(*in_flight.pop())
        if bucket.is_last():
            _gather_mean(pending, mean)
        else:
            in_flight.append((pending, mean))
        return mean

    return hook


def _gather_mean(pending: PendingFp8AllReduce, mean: torch.futures.Future) -> None:
    """Launch pending's all-gather; mean gets the sum / world (or its error) when it lands."""

    def done(summed: torch.futures.Future) -> None:
        try:
            mean.set_result(summed.value().div_(pending.world))
        except Exception as error:  # noqa: BLE001 - handed to the Future DDP waits on
            mean.set_exception(error)

    pending.gather().add_done_callback(done)


def _future_on(device: torch.device) -> torch.futures.Future:
    """An empty Future that may hold tensors on `device` (a Future names its devices; none:
    CPU only)."""
    return torch.futures.Future(devices=[device] if device.type != "cpu" else None)


def fp8_all_reduce_mean(
    hp_tensor: torch.Tensor, group: ProcessGroup | None, fp8_dtype: torch.dtype
) -> torch.futures.Future:
    """The mean over the group of hp_tensor, moved in fp8, as a Future on its device: waits
    for the reduce-scatter, launches the all-gather and completes when it lands (all
    collectives issued before it returns). Bit-identical to fp8_ddp_comm_hook's mean."""
    mean = _future_on(hp_tensor.device)
    _gather_mean(PendingFp8AllReduce(hp_tensor, group, fp8_dtype), mean)
    return mean
