"""The float8 recipes as data: how each quantizes the two operands of each of a linear's GEMMs.

A linear layer runs three GEMMs, each written here as A (M, K) @ B (K, N) with both operands
handed over K-last (A as it is, B transposed), so that "a 1xB block" always runs along the
contraction dim:

    forward      out    = x        @ W^T    operands (x, W)      x: (tokens, in), W: (out, in)
    grad_input   dx     = dy       @ W      operands (dy, W^T)
    grad_weight  dW     = dy^T     @ x      operands (dy^T, x^T)

RECIPE_OPERANDS[recipe][gemm] names the quantization of (A, B):

- 'tensor': one scale per tensor (torchao tensorwise).
- 'row': one scale per K-last row (torchao rowwise: x and dy per row in forward, W per
  column for grad_input, dy and x per column for grad_weight).
- 'tile': 1x128 tiles (TE Float8BlockScaling / DeepSeek-V3 activations and gradients; the
  grad_weight operands are the columnwise tiles of dy and x, quantized from high precision).
- 'block': 128x128 blocks (weights; W^T's blocks are W's, transposed, bit for bit).
- 'mx': 1x32 MX blocks with E8M0 scales, each layout quantized from high precision.
- 'fp4': NVFP4 1x16 blocks; 'fp4_2d': 16x16 blocks (weights); 'fp4_sr': 1x16 with stochastic
  rounding (gradients; draws from torch's default generator of the gradient's device, so a
  run is reproducible under torch.manual_seed and a resume must restore the RNG state).
- 'hp': not quantized (rowwise_with_gw_hp's weight-gradient GEMM).

Kernel: rowwise and rowwise_with_gw_hp GEMMs run torch._scaled_mm with an (M, 1) scale for A
and a (1, N) one for B where kernels.resolve_recipe_kernel says the device has it (CUDA sm_89+
with a bf16 output; on CPU only with emulate=False); a 'tensor' operand goes in as its one
scale repeated per row. Every other GEMM is emulated.

Emulation (every recipe but tensorwise, on every device): each operand is quantized and
dequantized to fp32 (exact where the scales are powers of two: rowwise, blockwise and mxfp8
by default; an fp32 or e4m3-times-fp32 scale rounds the product once to fp32), then one fp32
GEMM (torch.matmul: fp32 products and fp32 accumulation, the BLAS's summation order) is
rounded to the output dtype. Hardware block-scaled GEMMs accumulate each block's exact
products in fp32 and apply the scales per block; the two differ by fp32 rounding only.
A non-finite element of a high-precision operand stays non-finite in its emulated operand
(the saturating cast would turn inf into +-max and hide an overflow from the loss scaler).

Random Hadamard transforms (TE's nvfp4 option for the weight-gradient GEMM) are not applied.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mixprec.fp8.config import LP_FORWARD_DTYPE, RECIPES, Float8Config
from mixprec.fp8.kernels import gemm_result, lp_gemm, resolve_recipe_kernel
from mixprec.fp8.quantize import (
    BLOCKWISE_TILE,
    E2M1_MAX,
    MX_BLOCK,
    NVFP4_BLOCK,
    dequantize_blockwise,
    dequantize_mxfp8,
    dequantize_nvfp4,
    dequantize_scaled,
    e8m0_to_fp32,
    quantize_blockwise,
    quantize_mxfp8,
    quantize_nvfp4,
    quantize_rowwise,
    quantize_tensorwise,
)

GEMMS = ("forward", "grad_input", "grad_weight")
"""A linear layer's three GEMMs, in RECIPE_OPERANDS' order."""
OPERAND_ROLES = {
    "forward": ("input", "weight"),
    "grad_input": ("grad", "weight"),
    "grad_weight": ("grad", "input"),
}
"""Which tensor each GEMM's (A, B) operand comes from (its float8 format follows the role)."""

RECIPE_OPERANDS: dict[str, dict[str, tuple[str, str]]] = {
    "tensorwise": {g: ("tensor", "tensor") for g in GEMMS},
    "rowwise": {g: ("row", "row") for g in GEMMS},
    "rowwise_with_gw_hp": {
        "forward": ("row", "row"),
        "grad_input": ("row", "tensor"),
        "grad_weight": ("hp", "hp"),
    },
    "blockwise": {
        "forward": ("tile", "block"),
        "grad_input": ("tile", "block"),
        "grad_weight": ("tile", "tile"),
    },
    "mxfp8": {g: ("mx", "mx") for g in GEMMS},
    "nvfp4": {
        "forward": ("fp4", "fp4_2d"),
        "grad_input": ("fp4_sr", "fp4_2d"),
        "grad_weight": ("fp4_sr", "fp4"),
    },
}
"""recipe -> GEMM -> (A's quantization, B's quantization); see the module docstring."""
assert tuple(RECIPE_OPERANDS) == RECIPES  # one vocabulary: config.Recipe declares the names

OPERAND_BLOCKS: dict[str, tuple[int, int] | None] = {
    "tile": (1, BLOCKWISE_TILE),
    "block": (BLOCKWISE_TILE, BLOCKWISE_TILE),
    "fp4": (1, NVFP4_BLOCK),
    "fp4_sr": (1, NVFP4_BLOCK),
    "fp4_2d": (NVFP4_BLOCK, NVFP4_BLOCK),
}


def operand_lp_dtype(role: str, config: Float8Config) -> torch.dtype:
    """The float8 format of an operand: e4m3 for inputs and weights, the recipe's for grads
    (nvfp4 operands are E2M1 whatever their role: the format returned is not read)."""
    if role == "grad" and config.recipe != "nvfp4":
        return config.lp_grad_dtype
    return LP_FORWARD_DTYPE


class QuantizedOperand(NamedTuple):
    """An operand after quantize -> dequantize, with what telemetry reads about it."""

    dequantized: torch.Tensor
    """fp32, the operand's shape."""
    scale_inv: torch.Tensor | None
    """Dequantization scale per block (fp32; nvfp4: global * e4m3 block scale); None for 'hp'."""
    block: tuple[int, int] | None
    """The block each scale_inv entry covers (None: scale_inv broadcasts as it is)."""
    lp_max: float
    """Largest magnitude of the element format (448, 57344 or 6)."""


def quantize_operand(
    t: torch.Tensor,
    kind: str,
    lp_dtype: torch.dtype,
    config: Float8Config,
    *,
    stochastic: bool = True,
) -> QuantizedOperand:
    """A K-last 2-D operand quantized as `kind` prescribes and dequantized to fp32 (no
    non-finite propagation: see emulated_operand). stochastic=False rounds 'fp4_sr' to
    nearest (telemetry: it must not draw from the training RNG)."""
    pow2 = config.resolved_power_of_two
    lp_max = torch.finfo(lp_dtype).max
    if kind == "hp":
        return QuantizedOperand(t.to(torch.float32), None, None, lp_max)
    if kind in ("tensor", "row"):
        quantize = quantize_tensorwise if kind == "tensor" else quantize_rowwise
        data, scale_inv = quantize(t, lp_dtype, power_of_two=pow2)
        return QuantizedOperand(dequantize_scaled(data, scale_inv), scale_inv, None, lp_max)
    if kind in ("tile", "block"):
        block = OPERAND_BLOCKS[kind]
        data, scale_inv = quantize_blockwise(t, lp_dtype, block=block, power_of_two=pow2)
        deq = dequantize_blockwise(data, scale_inv, block=block)
        return QuantizedOperand(deq, scale_inv, block, lp_max)
    if kind == "mx":
        data, scale = quantize_mxfp8(t, lp_dtype, scale_mode=config.mx_scale_mode)
        deq = dequantize_mxfp8(data, scale)
        return QuantizedOperand(deq, e8m0_to_fp32(scale), (1, MX_BLOCK), lp_max)
    if kind in ("fp4", "fp4_sr", "fp4_2d"):
        block = OPERAND_BLOCKS[kind]
        codes, block_scale, global_scale = quantize_nvfp4(
            t, block=block, stochastic=stochastic and kind == "fp4_sr"
        )
        deq = dequantize_nvfp4(codes, block_scale, global_scale, block=block)
        scale_inv = global_scale * block_scale.to(torch.float32)
        return QuantizedOperand(deq, scale_inv, block, E2M1_MAX)
    raise ValueError(f"unknown operand quantization {kind!r}; valid: {sorted(_KINDS)}.")


_EAGER_UNDER_COMPILE = frozenset({"mx", "fp4", "fp4_sr", "fp4_2d"})
"""Operand kinds quantized outside torch.compile's graph (a graph break): inductor (torch
2.13) fails with an AssertionError fusing the block reductions of an operand and of its
transpose (mxfp8's and nvfp4's backward GEMMs) in one graph; each alone compiles."""
_quantize_outside_compile = torch.compiler.disable(quantize_operand)

_KINDS = {"hp", "tensor", "row", *OPERAND_BLOCKS, "mx"}


def emulated_operand(
    t: torch.Tensor, kind: str, lp_dtype: torch.dtype, config: Float8Config
) -> torch.Tensor:
    """quantize_operand's fp32 operand, with t's inf and nan elements kept as they are (see
    the module docstring)."""
    quantize = _quantize_outside_compile if kind in _EAGER_UNDER_COMPILE else quantize_operand
    deq = quantize(t, kind, lp_dtype, config).dequantized
    return torch.where(torch.isfinite(t), deq, t.to(torch.float32))


def emulated_gemm(
    gemm: str,
    a: torch.Tensor,
    b_t: torch.Tensor,
    config: Float8Config,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """A (M, K) @ B (K, N) of one of a linear's GEMMs under config.recipe, given B^T (N, K).

    Both operands are quantized K-last as RECIPE_OPERANDS says, dequantized to fp32, multiplied
    in fp32 and the result rounded to out_dtype.
    """
    kind_a, kind_b = RECIPE_OPERANDS[config.recipe][gemm]
    role_a, role_b = OPERAND_ROLES[gemm]
    hp_a = emulated_operand(a, kind_a, operand_lp_dtype(role_a, config), config)
    hp_b = emulated_operand(b_t, kind_b, operand_lp_dtype(role_b, config), config)
    return gemm_result(hp_a @ hp_b.t(), out_dtype)


_KERNEL_KINDS = frozenset({"row", "tensor"})


def recipe_gemm(
    gemm: str,
    a: torch.Tensor,
    b_t: torch.Tensor,
    config: Float8Config,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """One of a linear's GEMMs under config.recipe (not tensorwise): on torch._scaled_mm with
    rowwise scales where resolve_recipe_kernel allows it, else emulated_gemm."""
    kind_a, kind_b = RECIPE_OPERANDS[config.recipe][gemm]
    # An 'hp' GEMM (rowwise_with_gw_hp's grad_weight) is no float8 GEMM: no kernel to resolve.
    if "hp" in (kind_a, kind_b) or not resolve_recipe_kernel(a.device, config, out_dtype):
        return emulated_gemm(gemm, a, b_t, config, out_dtype)
    assert {kind_a, kind_b} <= _KERNEL_KINDS, (config.recipe, gemm)  # the rowwise recipes
    role_a, role_b = OPERAND_ROLES[gemm]
    pow2 = config.resolved_power_of_two
    lp_a, a_inv = _quantize_for_kernel(a, kind_a, operand_lp_dtype(role_a, config), pow2)
    lp_b_t, b_inv = _quantize_for_kernel(b_t, kind_b, operand_lp_dtype(role_b, config), pow2)
    fast = config.use_fast_accum_forward if gemm == "forward" else config.use_fast_accum_backward
    return lp_gemm(
        lp_a, lp_b_t.t(), a_inv, b_inv.t(), out_dtype, emulate=False, use_fast_accum=fast
    )


def _quantize_for_kernel(
    t: torch.Tensor, kind: str, lp_dtype: torch.dtype, power_of_two: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A K-last operand's float8 data and its (rows, 1) scale_inv (a tensorwise scale repeated
    per row: _scaled_mm takes both operands' scales rowwise or both tensorwise)."""
    quantize = quantize_tensorwise if kind == "tensor" else quantize_rowwise
    data, scale_inv = quantize(t, lp_dtype, power_of_two=power_of_two)
    return data, scale_inv.reshape(-1, 1).expand(t.shape[0], 1)
