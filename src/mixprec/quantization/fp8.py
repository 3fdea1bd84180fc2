"""Colossal-AI's `colossalai.quantization.fp8`: the same names, signatures and return values,
on mixprec's fp8 quantizers (`mixprec.fp8.quantize`) and fp8 collectives (`mixprec.parallel.comm`).

- Casts: `cast_to_fp8` returns `(fp8 tensor, scale_inv)` with scale = fp8_max / amax (per
  tensor, or per row of a 2-D tensor), `cast_from_fp8` multiplies by `scale_inv`; the pipeline
  pair packs a dict's `hidden_states` into fp8 for a point-to-point send and back.
- Collectives (`all_reduce_fp8`, `reduce_scatter_fp8`, `all_gather_fp8`, `all_to_all_fp8`,
  `all_to_all_single_fp8`): each rank casts what it sends to fp8 with one power-of-two scale
  of its own, the fp8 bytes and the scales travel, and receivers dequantize exactly and sum
  in fp32; the error bound is `mixprec.parallel.comm`'s. They always move fp8 (Colossal's
  public all_reduce_fp8 and reduce_scatter_fp8 call the plain collective, and its all_gather /
  all-to-all ones do within one node). `async_op=True` returns a `Handle` whose `wait()`
  finishes the operation; the output holds the result only after it.
- Hooks: DDP gradient hooks (`register_comm_hook`) and FSDP (torch's FullyShardedDataParallel)
  gradient and parameter hooks that average or gather in fp8.
- `linear_fp8`: F.linear with its three GEMMs in float8 (mixprec's Float8Linear).

`fp8_format` is 'e4m3' or 'e5m2'; any other value raises (Colossal reads every value other
than 'e4m3' as 'e5m2').
"""

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ReduceOp

from mixprec.core.policy import did_you_mean
from mixprec.fp8 import Float8Config, Float8Linear
from mixprec.fp8.casts import amax_to_scale, tensor_to_amax, tensor_to_fp8
from mixprec.fp8.config import GEMM_ALIGN
from mixprec.fp8.quantize import dequantize_scaled, quantize_rowwise, quantize_tensorwise
from mixprec.parallel.comm import (
    FP8_COMM_FORMATS,
    PendingFp8AllGather,
    PendingFp8AllReduce,
    PendingFp8AllToAll,
    PendingFp8ReduceScatter,
    fp8_all_reduce_mean,
)

# This module has no `from __future__ import annotations`: DDP's register_comm_hook compares
# the hooks' `bucket` and return annotations with dist.GradBucket / Future[Tensor] objects.

__all__ = [
    # casts
    "cast_to_fp8",
    "cast_from_fp8",
    "cast_to_fp8_pipeline",
    "cast_from_fp8_pipeline",
    # collectives and their handle
    "Handle",
    "all_reduce_fp8",
    "reduce_scatter_fp8",
    "all_gather_fp8",
    "all_to_all_fp8",
    "all_to_all_single_fp8",
    # communication hooks
    "fp8_compress_ddp_grad_comm_hook_async",
    "fp8_compress_ddp_grad_comm_hook_sync",
    "fp8_compress_fsdp_grad_comm_hook",
    "fp8_compress_fsdp_params_comm_hook",
    # layers and helpers
    "linear_fp8",
    "split_chunk_by_channel",
]

HP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LP_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _lp_dtype(fp8_format: object, who: str) -> torch.dtype:
    if isinstance(fp8_format, str) and fp8_format in FP8_COMM_FORMATS:
        return FP8_COMM_FORMATS[fp8_format]
    raise ValueError(
        f"{who}(fp8_format={fp8_format!r})." + did_you_mean(fp8_format, ("e4m3", "e5m2"))
    )


def _check_hp(tensor: torch.Tensor, who: str, name: str) -> None:
    if tensor.dtype not in HP_DTYPES:
        raise TypeError(f"{who}: {name}.dtype={tensor.dtype}; valid: float32, float16, bfloat16.")


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def _check_list(tensors: Sequence[torch.Tensor], world: int, who: str, name: str) -> None:
    if len(tensors) != world:
        raise ValueError(
            f"{who}: {name} holds {len(tensors)} tensors; the group has {world} ranks."
        )


# ----- casts -----
def _check_out(out: torch.Tensor | None, dtype: torch.dtype, shape: torch.Size, who: str) -> None:
    if out is not None and (out.dtype != dtype or out.shape != shape):
        raise ValueError(
            f"{who}: out must be a {dtype} tensor of shape {tuple(shape)}; "
            f"got {out.dtype} of shape {tuple(out.shape)}."
        )


def cast_to_fp8(
    inp: torch.Tensor,
    fp8_format: str = "e4m3",
    per_channel_scale: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inp cast to fp8, scale_inv): x * scale rounded to nearest, scale = fp8_max / amax(|x|).

    One scale for the tensor (scale_inv of shape (1,)), or with `per_channel_scale` one per row
    of a 2-D `inp` (scale_inv of shape (1, rows)). The cast saturates at +-fp8_max; an all-zero
    tensor or row gets a finite scale (amax floored at mixprec.fp8's AMAX_EPS; its fp8 image is
    zeros), an empty tensor scale_inv 1. `out`, an fp8 tensor of inp's shape and the format's
    dtype, receives the cast and is returned.
    """
    _check_hp(inp, "cast_to_fp8", "inp")
    lp_dtype = _lp_dtype(fp8_format, "cast_to_fp8")
    if per_channel_scale and inp.dim() != 2:
        raise ValueError(
            f"cast_to_fp8(per_channel_scale=True) scales each row of a 2-D tensor; "
            f"got shape {tuple(inp.shape)}."
        )
    _check_out(out, lp_dtype, inp.shape, "cast_to_fp8")
    if inp.numel() == 0:
        lp, scale_inv = inp.to(lp_dtype), torch.ones(1, device=inp.device)
    elif per_channel_scale:
        lp, scale_inv = quantize_rowwise(inp, lp_dtype, power_of_two=False)
        scale_inv = scale_inv.reshape(1, -1)  # Colossal's layout: (1, rows)
    else:
        lp, scale_inv = quantize_tensorwise(inp, lp_dtype)
        scale_inv = scale_inv.reshape(1)
    if out is not None:
        return out.copy_(lp), scale_inv
    return lp, scale_inv


def cast_from_fp8(
    inp: torch.Tensor,
    scale_inv: torch.Tensor,
    ret_type: torch.dtype,
    per_channel_scale: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """inp * scale_inv in ret_type (computed in fp32, rounded once): the inverse of cast_to_fp8
    up to its rounding. `scale_inv` is cast_to_fp8's (one element, or with `per_channel_scale`
    one per row of a 2-D `inp`); `out`, of inp's shape and dtype ret_type, receives the result."""
    if inp.dtype not in LP_DTYPES:
        raise TypeError(f"cast_from_fp8: inp.dtype={inp.dtype}; valid: float8_e4m3fn, float8_e5m2.")
    rows = inp.shape[0] if per_channel_scale and inp.dim() == 2 else None
    if per_channel_scale and (rows is None or scale_inv.numel() != rows):
        raise ValueError(
            f"cast_from_fp8(per_channel_scale=True) takes a 2-D inp and one scale_inv per row; "
            f"got inp of shape {tuple(inp.shape)} and {scale_inv.numel()} scales."
        )
    if not per_channel_scale and scale_inv.numel() != 1:
        raise ValueError(
            f"cast_from_fp8: a per-tensor scale_inv has one element, got shape "
            f"{tuple(scale_inv.shape)} (per_channel_scale=True reads one per row)."
        )
    _check_out(out, ret_type, inp.shape, "cast_from_fp8")
    scale_inv = scale_inv.reshape(-1, 1) if per_channel_scale else scale_inv.reshape(())
    hp = dequantize_scaled(inp, scale_inv, ret_type)
    return hp if out is None else out.copy_(hp)


def cast_to_fp8_pipeline(inp: Any) -> None:
    """Pack `inp['hidden_states']` into fp8 in place for a pipeline's point-to-point send.

    The tensor's data becomes its fp8 bytes viewed as bfloat16 (e4m3) or float16 (e5m2, chosen
    when amax exceeds e4m3's maximum), half as many elements in the last dim, which must be
    even; `inp['fp8_scale']` (the inverse scale) and `inp['dtype']` (a 0-d tensor of the
    original dtype) are added. A tensor or None is left as it is. This reads amax on the host
    (the view dtype depends on it).
    """
    if inp is None or type(inp) is torch.Tensor:
        return
    if "hidden_states" not in inp:
        raise KeyError(f"cast_to_fp8_pipeline needs a 'hidden_states' entry; got keys {list(inp)}.")
    hp_tensor = inp["hidden_states"]
    _check_hp(hp_tensor, "cast_to_fp8_pipeline", "hidden_states")
    if hp_tensor.dim() == 0 or hp_tensor.size(-1) % 2:
        raise ValueError(
            "cast_to_fp8_pipeline views two fp8 bytes as one 16-bit element: hidden_states' "
            f"last dim must be even, got shape {tuple(hp_tensor.shape)}."
        )
    amax = tensor_to_amax(hp_tensor)
    wide = bool(amax > torch.finfo(torch.float8_e4m3fn).max)  # a host sync
    lp_dtype, view_dtype = (
        (torch.float8_e5m2, torch.float16) if wide else (torch.float8_e4m3fn, torch.bfloat16)
    )
    scale = amax_to_scale(amax, lp_dtype)
    hp_dtype = hp_tensor.dtype
    hp_tensor.data = tensor_to_fp8(hp_tensor.data, scale, lp_dtype).view(view_dtype)
    inp["fp8_scale"] = scale.reciprocal()
    inp["dtype"] = torch.zeros_like(scale).to(hp_dtype)  # the dtype travels as a tensor


def cast_from_fp8_pipeline(inp: Any, del_metadata: bool = True) -> None:
    """Unpack what cast_to_fp8_pipeline packed: `inp['hidden_states']` back in its dtype, in
    place; with `del_metadata` the 'fp8_scale' and 'dtype' entries are removed."""
    if inp is None or type(inp) is torch.Tensor:
        return
    for key in ("hidden_states", "fp8_scale", "dtype"):
        if key not in inp:
            raise KeyError(f"cast_from_fp8_pipeline needs a {key!r} entry; got keys {list(inp)}.")
    packed = inp["hidden_states"]
    lp_dtype = {torch.float16: torch.float8_e5m2, torch.bfloat16: torch.float8_e4m3fn}.get(
        packed.dtype
    )
    if lp_dtype is None:
        raise TypeError(
            f"cast_from_fp8_pipeline: hidden_states.dtype={packed.dtype}; a packed tensor is "
            "bfloat16 (e4m3) or float16 (e5m2)."
        )
    packed.data = dequantize_scaled(
        packed.data.view(lp_dtype), inp["fp8_scale"], inp["dtype"].dtype
    )
    if del_metadata:
        del inp["fp8_scale"]
        del inp["dtype"]


# ----- collectives -----
class Handle:
    """What an fp8 collective returns with async_op=True: wait() waits for each of `handles`
    (objects with a wait()), then runs `remain_ops` (the dequantization into the output)."""

    def __init__(self, handles: Sequence[Any] = (), remain_ops: Callable[[], None] | None = None):
        self.handles = list(handles)
        self.remain_ops = remain_ops

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()
        if self.remain_ops:
            self.remain_ops()


def _finish(finish: Callable[[], None], async_op: bool) -> Handle | None:
    """Handle(remain_ops=finish) for async_op, else finish now. The collectives were launched
    (asynchronously) before this; finish waits for them and writes the output."""
    if async_op:
        return Handle(remain_ops=finish)
    finish()
    return None


def all_reduce_fp8(
    tensor: torch.Tensor,
    fp8_format: str = "e4m3",
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle | None:
    """In-place all-reduce moving fp8: a reduce-scatter (fp8 all-to-all, fp32 sums), each
    rank's summed chunk re-quantized and all-gathered; every rank ends with the same bits.
    op is ReduceOp.SUM or ReduceOp.AVG (the sum divided by the group size)."""
    who = "all_reduce_fp8"
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"{who}(op={op!r}); valid: ReduceOp.SUM, ReduceOp.AVG.")
    _check_hp(tensor, who, "tensor")
    pending = PendingFp8AllReduce(tensor, group, _lp_dtype(fp8_format, who))
    summed = pending.gather()  # waits for the reduce-scatter, launches the all-gather

    def finish() -> None:
        result = summed.wait()
        if op == ReduceOp.AVG:
            result.div_(pending.world)
        tensor.copy_(result)

    return _finish(finish, async_op)


def reduce_scatter_fp8(
    output: torch.Tensor,
    input_list: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    fp8_format: str = "e5m2",
    async_op: bool = False,
) -> Handle | None:
    """dist.reduce_scatter moving fp8: `output` gets the sum over ranks of their
    input_list[this rank], summed in fp32. Each rank casts its whole input_list with one scale."""
    who = "reduce_scatter_fp8"
    _check_list(input_list, _world(group), who, "input_list")
    for i, hp_input in enumerate(input_list):
        _check_hp(hp_input, who, f"input_list[{i}]")
        if hp_input.numel() != output.numel():
            raise ValueError(
                f"{who}: input_list[{i}] has {hp_input.numel()} elements, output "
                f"{output.numel()}; each input is one rank's share of the output's size."
            )
    hp_flat = torch.cat([t.reshape(-1) for t in input_list])
    pending = PendingFp8ReduceScatter(hp_flat, group, _lp_dtype(fp8_format, who))

    def finish() -> None:
        output.copy_(pending.wait().view(output.shape))

    return _finish(finish, async_op)


def all_gather_fp8(
    output_list: Sequence[torch.Tensor],
    input_: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    fp8_format: str = "e5m2",
    async_op: bool = False,
) -> Handle | None:
    """dist.all_gather moving fp8: output_list[j] gets rank j's input_ (cast with its scale)."""
    who = "all_gather_fp8"
    _check_hp(input_, who, "input_")
    _check_list(output_list, _world(group), who, "output_list")
    for j, out in enumerate(output_list):
        if out.numel() != input_.numel():
            raise ValueError(
                f"{who}: output_list[{j}] has {out.numel()} elements, input_ {input_.numel()}."
            )
    pending = PendingFp8AllGather(input_.reshape(-1), group, _lp_dtype(fp8_format, who))

    def finish() -> None:
        for out, row in zip(output_list, pending.wait(), strict=True):
            out.copy_(row.view(out.shape))

    return _finish(finish, async_op)


def _all_to_all(
    hp_flat: torch.Tensor,
    input_split_sizes: list[int],
    output_split_sizes: list[int],
    group: dist.ProcessGroup | None,
    fp8_format: str,
    who: str,
    write: Callable[[torch.Tensor], None],
    async_op: bool,
) -> Handle | None:
    pending = PendingFp8AllToAll(
        hp_flat, group, _lp_dtype(fp8_format, who), input_split_sizes, output_split_sizes
    )
    return _finish(lambda: write(pending.wait()), async_op)


def all_to_all_fp8(
    output_list: Sequence[torch.Tensor],
    input_list: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    fp8_format: str = "e5m2",
    async_op: bool = False,
) -> Handle | None:
    """dist.all_to_all moving fp8: input_list[i] goes to rank i, output_list[j] comes from rank
    j. Each rank casts its whole input_list with one scale."""
    who = "all_to_all_fp8"
    world = _world(group)
    _check_list(input_list, world, who, "input_list")
    _check_list(output_list, world, who, "output_list")
    for i, hp_input in enumerate(input_list):
        _check_hp(hp_input, who, f"input_list[{i}]")
    out_sizes = [t.numel() for t in output_list]

    def write(received: torch.Tensor) -> None:
        for out, piece in zip(output_list, received.split(out_sizes), strict=True):
            out.copy_(piece.view(out.shape))

    hp_flat = torch.cat([t.reshape(-1) for t in input_list])
    in_sizes = [t.numel() for t in input_list]
    return _all_to_all(hp_flat, in_sizes, out_sizes, group, fp8_format, who, write, async_op)


def _element_splits(
    tensor: torch.Tensor, rows: list[int] | None, world: int, who: str, name: str
) -> list[int]:
    """Split sizes along dim 0 (rows) as element counts; None: world equal parts."""
    if rows is None:
        if tensor.numel() % world:
            raise ValueError(
                f"{who}: without {name}_split_sizes the {name} ({tensor.numel()} elements) "
                f"must divide into {world} equal parts."
            )
        return [tensor.numel() // world] * world
    if len(rows) != world or sum(rows) != (tensor.shape[0] if tensor.dim() else 1):
        raise ValueError(
            f"{who}: {name}_split_sizes={list(rows)!r} must hold {world} row counts summing to "
            f"the {name}'s dim 0 ({tensor.shape[0] if tensor.dim() else 1})."
        )
    inner = math.prod(tensor.shape[1:])
    return [n * inner for n in rows]


def all_to_all_single_fp8(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - Colossal's (and dist.all_to_all_single's) keyword
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    fp8_format: str = "e5m2",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle | None:
    """dist.all_to_all_single moving fp8: `input` split along dim 0 (by input_split_sizes rows,
    or in equal parts) goes rank by rank; `output` receives rank j's part in j's place. The
    whole input is cast with one scale."""
    who = "all_to_all_single_fp8"
    _check_hp(input, who, "input")
    world = _world(group)
    in_sizes = _element_splits(input, input_split_sizes, world, who, "input")
    out_sizes = _element_splits(output, output_split_sizes, world, who, "output")

    def write(received: torch.Tensor) -> None:
        output.copy_(received.view(output.shape))

    return _all_to_all(
        input.reshape(-1), in_sizes, out_sizes, group, fp8_format, who, write, async_op
    )


# ----- communication hooks -----
def fp8_compress_ddp_grad_comm_hook_async(
    process_group: dist.ProcessGroup,
    bucket: dist.GradBucket,
    fp8_format: str = "e5m2",
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's mean over `process_group` (None: the default group), moved in
    fp8 (all_reduce_fp8's algorithm); `ddp_model.register_comm_hook(None, this hook)`.

    The returned Future completes with the all-gather, which overlaps the rest of backward;
    the hook waits for its bucket's reduce-scatter before it returns, so every collective is
    issued from DDP's hook calls, in bucket order on every rank (one issued from a Future's
    callback could race DDP's own collectives). TorchDDPPlugin(fp8_communication=True) also
    overlaps the reduce-scatter (mixprec.parallel.comm.fp8_ddp_comm_hook, one hook per model)."""
    who = "fp8_compress_ddp_grad_comm_hook_async"
    return fp8_all_reduce_mean(bucket.buffer(), process_group, _lp_dtype(fp8_format, who))


def fp8_compress_ddp_grad_comm_hook_sync(
    process_group: dist.ProcessGroup,
    bucket: dist.GradBucket,
    fp8_format: str = "e5m2",
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's mean over `process_group` in fp8, computed before the hook
    returns (no overlap with backward; the async hook's result, bit for bit)."""
    who = "fp8_compress_ddp_grad_comm_hook_sync"
    mean = fp8_all_reduce_mean(bucket.buffer(), process_group, _lp_dtype(fp8_format, who))
    mean.wait()
    return mean


def fp8_compress_fsdp_grad_comm_hook(
    state: object,
    unsharded_gradient_flattened: torch.Tensor,
    sharded_gradient: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    fp8_format: str = "e5m2",
) -> None:
    """FSDP (FullyShardedDataParallel) gradient hook, `fsdp_model.register_comm_hook(None,
    this hook)`: `sharded_gradient` gets this rank's shard of the mean over `group` (None: the
    default group) of the flat unsharded gradients, reduce-scattered in fp8 and summed in fp32.
    `state` is FSDP's hook state, unused."""
    who = "fp8_compress_fsdp_grad_comm_hook"
    world = _world(group)
    if unsharded_gradient_flattened.numel() != world * sharded_gradient.numel():
        raise ValueError(
            f"{who}: the unsharded gradient has {unsharded_gradient_flattened.numel()} elements, "
            f"not {world} x the shard's {sharded_gradient.numel()}."
        )
    hp_flat = unsharded_gradient_flattened.reshape(-1)
    summed = PendingFp8ReduceScatter(hp_flat, group, _lp_dtype(fp8_format, who)).wait()
    sharded_gradient.copy_(summed.div_(world).view(sharded_gradient.shape))


def fp8_compress_fsdp_params_comm_hook(
    state: object,
    padded_unsharded_flat_param: torch.Tensor,
    sharded_flat_param: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    fp8_format: str = "e5m2",
) -> None:
    """FSDP parameter all-gather in fp8: `padded_unsharded_flat_param` gets every rank's
    `sharded_flat_param` (rank order), each cast with its own scale; every rank gets the same
    bits. The hook interface of Colossal's patched FSDP (register_params_comm_hook), which
    mixprec does not install; call it where a flat parameter is unsharded. `state` is unused."""
    who = "fp8_compress_fsdp_params_comm_hook"
    _check_hp(sharded_flat_param, who, "sharded_flat_param")
    world = _world(group)
    if padded_unsharded_flat_param.numel() != world * sharded_flat_param.numel():
        raise ValueError(
            f"{who}: padded_unsharded_flat_param has {padded_unsharded_flat_param.numel()} "
            f"elements, not {world} x the shard's {sharded_flat_param.numel()}."
        )
    rows = PendingFp8AllGather(sharded_flat_param.reshape(-1), group, _lp_dtype(fp8_format, who))
    padded_unsharded_flat_param.copy_(rows.wait().view(padded_unsharded_flat_param.shape))


# ----- layers and helpers -----
LINEAR_FP8_CONFIG = Float8Config(use_fast_accum_backward=True, allow_emulation=True)
"""linear_fp8's recipe, Colossal's: dynamic per-tensor scales, e4m3 input and weight, e5m2
gradient, fast accumulation in all three GEMMs on the CUDA kernel; emulated where no float8
kernel exists (CPU, GPUs before sm_89)."""


def linear_fp8(
    input: torch.Tensor,  # noqa: A002 - F.linear's and Colossal's keyword
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(input, weight, bias) with its three GEMMs in float8 (Float8Linear's autograd
    function with LINEAR_FP8_CONFIG); input, weight and bias share one dtype (bf16, fp16 or
    fp32) and the output has it.

    As in Colossal, shapes whose last dim or leading-dims product is not a multiple of 16 run
    plain F.linear. Where torch._scaled_mm has no kernel (CPU, GPUs before sm_89) the GEMMs are
    emulated: operands cast to float8 and back, products summed in fp32, the same roundings.
    """
    who = "linear_fp8"
    for name, tensor in (("input", input), ("weight", weight), ("bias", bias)):
        if tensor is not None:
            _check_hp(tensor, who, name)
            if tensor.dtype != input.dtype:
                raise TypeError(
                    f"{who}: {name}.dtype={tensor.dtype} differs from input.dtype={input.dtype}."
                )
    if input.shape[-1] % GEMM_ALIGN or math.prod(input.shape[:-1]) % GEMM_ALIGN:
        return F.linear(input, weight, bias)
    out_features, in_features = weight.shape
    with torch.device("meta"):  # parameters come from the call: nothing to initialize
        layer = Float8Linear(
            in_features, out_features, bias=bias is not None, config=LINEAR_FP8_CONFIG
        )
    params = {"weight": weight} if bias is None else {"weight": weight, "bias": bias}
    return torch.func.functional_call(layer, params, (input,))


def split_chunk_by_channel(
    chunk: torch.Tensor,
    channel_size: int,
    num_channels: int,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[torch.Tensor, ...]:
    """`chunk`, rank `rank`'s equal share of a flat buffer of `num_channels` channels of
    `channel_size` elements (the buffer's elements rank * chunk.numel() onward), split where a
    channel starts or ends inside it: views, one per channel the chunk touches."""
    who = "split_chunk_by_channel"
    if not 0 <= rank < world_size:
        raise ValueError(
            f"{who}(rank={rank!r}, world_size={world_size!r}): need 0 <= rank < world_size."
        )
    if channel_size <= 0 or num_channels < 0:
        raise ValueError(
            f"{who}(channel_size={channel_size!r}, num_channels={num_channels!r}): need "
            "channel_size > 0 and num_channels >= 0."
        )
    start = chunk.numel() * rank
    end = start + chunk.numel()
    first = -(-start // channel_size)  # the first channel boundary at or after start
    last = min(end // channel_size, num_channels)
    cuts = sorted({start, end, *(k * channel_size for k in range(first, last + 1))})
    return chunk.split([b - a for a, b in zip(cuts[:-1], cuts[1:], strict=False)])
