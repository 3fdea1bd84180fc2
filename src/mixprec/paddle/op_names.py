"""Paddle's AMP op vocabulary: its default lists (paddle/amp/amp_lists.py and the static graph's
gray list, as in 3.3.1) and every one of their names mapped to torch ops or refused by name.

The core's op lists speak torch; this face translates Paddle's names before handing lists in.
A name that is not Paddle's passes through to mixprec.resolve_ops (torch names, callables).
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Iterable

from mixprec.core.autocast import resolve_ops

# ----- Paddle 3.3.1's lists, by Paddle's names (python/paddle/amp/amp_lists.py) -----

WHITE_LIST: frozenset[str] = frozenset(
    {"conv2d", "einsum", "matmul", "matmul_v2", "linear_v2", "max_pool2d_with_index", "mul"}
    | {"fused_gemm_epilogue", "fused_rotary_position_embedding", "flash_attn"}
)
ONLY_FP16_WHITE_LIST: frozenset[str] = frozenset(
    {"fake_quantize_dequantize_abs_max", "fake_quantize_dequantize_moving_average_abs_max"}
    | {"fused_attention", "fused_feedforward"}
)
FP16_BLACK_LIST: frozenset[str] = frozenset(
    {"tan", "acos", "asin", "sinh", "cosh", "atanh", "tanh_shrink", "erfinv", "exp", "expm1"}
    | {"log", "log10", "log2", "reciprocal", "rsqrt", "pow", "square", "reduce_sum", "mean"}
    | {"reduce_mean", "reduce_prod", "cumprod", "cumsum", "dist", "pnorm", "frobenius_norm"}
    | {"renorm", "group_norm", "layer_norm", "softmax", "softmin", "softplus", "log_softmax"}
    | {"softmax_with_cross_entropy", "sigmoid_cross_entropy_with_logits"}
    | {"c_softmax_with_cross_entropy", "c_softmax_with_multi_label_cross_entropy"}
    | {"cross_entropy", "cross_entropy2", "nll_loss", "huber_loss", "triplet_margin_loss"}
    | {"log_loss", "hsigmoid_loss", "margin_cross_entropy"}
)
EXTRA_BLACK_LIST: frozenset[str] = frozenset(
    {"linear_interp_v2", "nearest_interp_v2", "bilinear_interp_v2", "bicubic_interp_v2"}
    | {"trilinear_interp_v2", "lookup_table", "lookup_table_v2", "scatter"}
)
GRAY_LIST: frozenset[str] = frozenset(
    # the static graph's gray list (paddle.static.amp.fp16_lists.gray_list): ops that follow
    # their inputs' dtype
    {"elementwise_add", "elementwise_sub", "elementwise_mul", "elementwise_div"}
    | {"elementwise_max", "elementwise_min", "elementwise_pow", "elementwise_mod"}
    | {"elementwise_floordiv", "batch_norm", "layer_norm", "tanh", "sigmoid", "top_k"}
    | {"pool2d", "pool3d", "dropout", "relu", "relu6", "leaky_relu", "soft_relu", "flatten2"}
    | {"stack", "unstack", "uniform_random", "uniform_random_batch_size_like"}
    | {"gaussian_random", "slice", "rank", "scale", "transpose2", "reshape2", "gather"}
    | {"fill_constant", "get_tensor_from_selected_rows", "sign", "cast", "fused_bn_add_activation"}
    | {"c_identity", "c_concat", "all_reduce", "concat", "split", "fused_feedforward"}
    | {"fused_attention", "fused_multi_transformer"}
)
STATIC_EXTRA_WHITE_LIST: frozenset[str] = frozenset({"fused_bn_add_activation", "resnet_unit"})
"""In the static graph's default white list beside WHITE_LIST and ONLY_FP16_WHITE_LIST."""


def white_list() -> dict[str, dict[str, set[str]]]:
    """paddle.amp.white_list(): {dtype: {level: op names run low}}, Paddle's names."""
    fp16 = set(WHITE_LIST | ONLY_FP16_WHITE_LIST)
    return {
        "float16": {level: set(fp16) for level in ("OD", "O1", "O2")},
        "bfloat16": {level: set(WHITE_LIST) for level in ("OD", "O1", "O2")},
    }


def black_list() -> dict[str, dict[str, set[str]]]:
    """paddle.amp.black_list(): {dtype: {level: op names run in fp32}}, Paddle's names."""
    o1 = set(FP16_BLACK_LIST | EXTRA_BLACK_LIST)
    return {
        dtype: {"OD": set(), "O1": set(o1), "O2": set(EXTRA_BLACK_LIST)}
        for dtype in ("float16", "bfloat16")
    }


# ----- Paddle op name -> torch op names -----

TO_TORCH: dict[str, tuple[str, ...]] = {
    # white list: GEMMs and convolutions
    "conv2d": ("conv2d",),
    "depthwise_conv2d": ("conv2d",),
    "conv2d_transpose": ("conv_transpose2d",),
    "conv3d": ("conv3d",),
    "conv3d_transpose": ("conv_transpose3d",),
    "einsum": ("einsum",),
    "matmul": ("matmul", "mm", "bmm"),
    "matmul_v2": ("matmul", "mm", "bmm"),
    "mul": ("mm",),  # Paddle's legacy `mul` op is a matmul (see PADDLE_MEANING)
    "linear_v2": ("linear",),
    "fc": ("linear",),
    "fused_gemm_epilogue": ("linear", "addmm"),  # matmul + bias (+ activation) in one kernel
    "max_pool2d_with_index": ("max_pool2d",),
    "flash_attn": ("scaled_dot_product_attention",),
    # black list
    "tan": ("tan",),
    "acos": ("acos",),
    "asin": ("asin",),
    "sinh": ("sinh",),
    "cosh": ("cosh",),
    "atanh": ("atanh",),
    "tanh_shrink": ("tanhshrink",),
    "erfinv": ("erfinv",),
    "exp": ("exp",),
    "expm1": ("expm1",),
    "log": ("log",),
    "log10": ("log10",),
    "log2": ("log2",),
    "reciprocal": ("reciprocal",),
    "rsqrt": ("rsqrt",),
    "pow": ("pow",),
    "square": ("square",),
    "reduce_sum": ("sum",),
    "mean": ("mean",),
    "reduce_mean": ("mean",),
    "reduce_prod": ("prod",),
    "cumprod": ("cumprod",),
    "cumsum": ("cumsum",),
    "dist": ("dist",),
    "pnorm": ("norm", "linalg_vector_norm"),
    "frobenius_norm": ("norm", "linalg_norm"),
    "renorm": ("renorm",),
    "group_norm": ("group_norm",),
    "layer_norm": ("layer_norm",),
    "softmax": ("softmax",),
    "softmin": ("softmin",),
    "softplus": ("softplus",),
    "log_softmax": ("log_softmax",),
    "softmax_with_cross_entropy": ("cross_entropy",),
    "sigmoid_cross_entropy_with_logits": ("binary_cross_entropy_with_logits",),
    "cross_entropy": ("cross_entropy",),
    "cross_entropy2": ("cross_entropy",),
    "nll_loss": ("nll_loss",),
    "huber_loss": ("huber_loss",),
    "triplet_margin_loss": ("triplet_margin_loss",),
    "log_loss": ("binary_cross_entropy",),  # -y log p - (1 - y) log(1 - p)
    "linear_interp_v2": ("interpolate",),
    "nearest_interp_v2": ("interpolate",),
    "bilinear_interp_v2": ("interpolate",),
    "bicubic_interp_v2": ("interpolate",),
    "trilinear_interp_v2": ("interpolate",),
    "lookup_table": ("embedding",),
    "lookup_table_v2": ("embedding",),
    "scatter": ("scatter",),
    # gray list and other common spellings
    "elementwise_add": ("add",),
    "elementwise_sub": ("sub",),
    "elementwise_mul": ("mul",),
    "elementwise_div": ("div",),
    "elementwise_max": ("maximum",),
    "elementwise_min": ("minimum",),
    "elementwise_pow": ("pow",),
    "elementwise_mod": ("remainder",),
    "elementwise_floordiv": ("floor_divide",),
    "batch_norm": ("batch_norm",),
    "tanh": ("tanh",),
    "sigmoid": ("sigmoid",),
    "top_k": ("topk",),
    "top_k_v2": ("topk",),
    "pool2d": ("max_pool2d", "avg_pool2d", "adaptive_max_pool2d", "adaptive_avg_pool2d"),
    "pool3d": ("max_pool3d", "avg_pool3d", "adaptive_max_pool3d", "adaptive_avg_pool3d"),
    "dropout": ("dropout",),
    "relu": ("relu",),
    "relu6": ("relu6",),
    "leaky_relu": ("leaky_relu",),
    "soft_relu": ("softplus",),  # log(1 + exp(x)) with x clipped to +-threshold
    "flatten2": ("flatten",),
    "stack": ("stack",),
    "unstack": ("unbind",),
    "transpose2": ("transpose", "permute"),
    "reshape2": ("reshape",),
    "gather": ("gather", "index_select"),
    "sign": ("sign",),
    "concat": ("cat",),
    "split": ("split",),
    "reduce_max": ("amax",),
    "reduce_min": ("amin",),
    "cos_sim": ("cosine_similarity",),
}
"""Paddle op names -> the torch ops that compute the same thing."""

REFUSED: dict[str, str] = {
    "fused_rotary_position_embedding": "a fused Paddle kernel with no torch op; list the ops "
    "your rotary embedding calls (e.g. 'mul', 'cat')",
    "fake_quantize_dequantize_abs_max": "quantization-aware-training kernel with no torch op",
    "fake_quantize_dequantize_moving_average_abs_max": "quantization-aware-training kernel "
    "with no torch op",
    "fused_attention": "a fused Paddle kernel; list its parts ('linear', "
    "'scaled_dot_product_attention', 'layer_norm')",
    "fused_feedforward": "a fused Paddle kernel; list its parts ('linear', 'dropout', "
    "'layer_norm')",
    "fused_multi_transformer": "a fused Paddle kernel; list its parts ('linear', "
    "'scaled_dot_product_attention', 'layer_norm')",
    "fused_bn_add_activation": "a fused Paddle kernel; list its parts ('batch_norm', 'add', "
    "'relu')",
    "resnet_unit": "a fused Paddle kernel; list its parts ('conv2d', 'batch_norm', 'relu')",
    "c_softmax_with_cross_entropy": "model-parallel cross entropy (Paddle's collective op); "
    "list 'cross_entropy'",
    "c_softmax_with_multi_label_cross_entropy": "model-parallel cross entropy (Paddle's "
    "collective op); list 'cross_entropy'",
    "margin_cross_entropy": "Paddle's margin (ArcFace) loss has no torch op; list the ops it is "
    "written with",
    "hsigmoid_loss": "Paddle's hierarchical sigmoid loss has no torch op",
    "uniform_random": "creates a tensor from no floating input: its dtype argument decides",
    "uniform_random_batch_size_like": "creates a tensor from no floating input: its dtype "
    "argument decides",
    "gaussian_random": "creates a tensor from no floating input: its dtype argument decides",
    "fill_constant": "creates a tensor from no floating input: its dtype argument decides",
    "cast": "a cast chooses its own output dtype",
    "slice": "indexing moves data without computing: it keeps its input dtype",
    "rank": "returns an integer, computes nothing floating",
    "scale": "Paddle's x * scale + bias is no single torch op; list 'mul' and 'add'",
    "get_tensor_from_selected_rows": "Paddle's SelectedRows have no torch counterpart",
    "c_identity": "a collective communication op, not a computation autocast sees",
    "c_concat": "a collective communication op, not a computation autocast sees",
    "all_reduce": "a collective communication op, not a computation autocast sees",
}
"""Paddle op names mixprec refuses, each with the reason (and what to list instead)."""

PADDLE_MEANING: frozenset[str] = frozenset({"mul"})
"""Names that are torch ops too but mean another op in Paddle: translated in Paddle's default
lists only; in a user's custom list they keep torch's meaning (elementwise `mul`)."""


def paddle_ops_to_torch(
    names: Iterable[str | Callable] | None, *, paddle_meaning: bool = False
) -> frozenset[str]:
    """Resolve an op list that may hold Paddle's names to torch op names.

    A refused Paddle name raises ValueError with its reason; other names and torch callables go
    to mixprec.resolve_ops (unknown ones raise there). paddle_meaning: translate names in
    PADDLE_MEANING as Paddle means them (for Paddle's own lists).
    """
    if names is None:
        return frozenset()
    if isinstance(names, str) or not isinstance(names, Iterable):
        return resolve_ops(names)  # raises its TypeError: wrap a single op in a list
    out: set[str] = set()
    rest: list[str | Callable] = []
    for name in names:
        if isinstance(name, str) and name in REFUSED:
            raise ValueError(f"Paddle op {name!r} cannot be listed: {REFUSED[name]}.")
        if (
            isinstance(name, str)
            and name in TO_TORCH
            and (paddle_meaning or name not in PADDLE_MEANING)
        ):
            out.update(TO_TORCH[name])
        else:
            rest.append(name)
    for name in rest:
        if isinstance(name, str):
            _check_known(name)
    return frozenset(out) | resolve_ops(rest)


def _check_known(name: str) -> None:
    """A name neither Paddle's nor torch's: the error offers Paddle's close spellings first."""
    try:
        resolve_ops([name])
    except ValueError as err:
        close = difflib.get_close_matches(name, sorted(TO_TORCH), n=3, cutoff=0.6)
        if not close:
            raise
        hint = " or ".join(repr(c) for c in close)
        raise ValueError(f"Unknown op {name!r}: did you mean Paddle's {hint}? {err}") from None


@functools.cache
def default_lists(level: str, dtype: str) -> tuple[frozenset[str], frozenset[str]]:
    """Paddle's default (white, black) lists for an auto_cast level and dtype, in torch ops.

    Refused names (fused kernels, collectives) are left out: no torch op computes them.
    """
    white = {n for n in white_list()[dtype][level] if n not in REFUSED}
    black = {n for n in black_list()[dtype][level] if n not in REFUSED}
    return (
        paddle_ops_to_torch(sorted(white), paddle_meaning=True),
        paddle_ops_to_torch(sorted(black), paddle_meaning=True),
    )


__all__ = [
    "EXTRA_BLACK_LIST",
    "FP16_BLACK_LIST",
    "GRAY_LIST",
    "ONLY_FP16_WHITE_LIST",
    "PADDLE_MEANING",
    "REFUSED",
    "STATIC_EXTRA_WHITE_LIST",
    "TO_TORCH",
    "WHITE_LIST",
    "black_list",
    "default_lists",
    "paddle_ops_to_torch",
    "white_list",
]
