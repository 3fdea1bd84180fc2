"""One quantizer per scaling granularity, each with its dequantize (pure tensor functions).

Every quantizer returns the low-precision data and the *dequantization* scale ("scale_inv" in
Transformer Engine and DeepSeek-V3 checkpoints, what a scaled GEMM multiplies by):
x ~= data * scale, the scale broadcast over its block. Shapes are 2-D (rows, cols); a block is
(block_rows, block_cols) starting at index 0, and the last block of a dim that is not a
multiple of the block size is a partial block (its amax is over the elements that exist).

- tensorwise / rowwise: torchao.float8's math (fp8_max / max(amax, 1e-12), a saturating cast of
  x * scale; power_of_two rounds the scale down), one scale per tensor / per row.
- blockwise: Transformer Engine's Float8BlockScaling scale (amax floored at eps; amax 0, inf or
  nan -> scale 1; an fp32-infinite scale -> the input dtype's max; power_of_two masks the
  mantissa), 1x128 tiles (activations, gradients) or 128x128 blocks (weights).
- mxfp8: OCP MX, 1x32 blocks with E8M0 (power-of-two) scales, the rounding modes of
  torchao.prototype.mx_formats (floor, ceil, even, rceil), its bits exactly.
- nvfp4: E2M1 values in 16-element blocks, e4m3 block scales over an fp32 global scale
  (torchao's two-level nvfp4_quantize, its bits exactly), 16x16 2-D blocks for weights, and
  optional stochastic rounding (gradients).
"""

from __future__ import annotations

import torch

from mixprec.core.policy import did_you_mean
from mixprec.fp8.casts import amax_to_scale, tensor_to_amax, tensor_to_fp8
from mixprec.fp8.config import MX_SCALE_MODES, MXScaleMode

MX_BLOCK = 32
"""OCP MX block: 32 consecutive elements share one E8M0 scale."""
NVFP4_BLOCK = 16
"""NVFP4 block: 16 elements (or 16x16 for 2-D weight blocks) share one e4m3 scale."""
BLOCKWISE_TILE = 128
"""Float8BlockScaling: 1x128 activation / gradient tiles and 128x128 weight blocks."""

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitudes of E2M1 codes 0..7; code | 8 is the negative (sign bit 3)."""
_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
_E4M3_TINY = torch.finfo(torch.float8_e4m3fn).tiny  # 2**-6, torchao's floor on a block scale
_F32_MIN_NORMAL = 2.0**-126
_E8M0_BIAS = 127
_E8M0_NAN = 255
_MX_MAX_POW2 = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}  # largest power of 2 <= max
_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def _check_2d(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} quantizes 2-D tensors (rows, cols); got shape {tuple(x.shape)}.")


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if (
        not isinstance(block, tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)
    ):
        raise ValueError(f"block={block!r}: a (rows, cols) tuple of two positive ints.")
    return block


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |x| over each block of a 2-D x, in fp32: shape (ceil(rows/br), ceil(cols/bc)).

    Partial edge blocks are zero-padded, which leaves their amax unchanged; nan propagates.
    """
    br, bc = _check_block(block)
    rows, cols = x.shape
    pad_r, pad_c = -rows % br, -cols % bc
    ax = x.abs().to(torch.float32)
    if pad_r or pad_c:
        ax = torch.nn.functional.pad(ax, (0, pad_c, 0, pad_r))
    tiles = ax.reshape((rows + pad_r) // br, br, (cols + pad_c) // bc, bc)
    return torch.amax(tiles, dim=(1, 3))


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """A per-block tensor repeated over its blocks and cropped to `shape` (elementwise form)."""
    br, bc = block
    return scale.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)[: shape[0], : shape[1]]


# --- tensorwise and rowwise (torchao.float8) -------------------------------------------------


def quantize_tensorwise(
    x: torch.Tensor, lp_dtype: torch.dtype = torch.float8_e4m3fn, *, power_of_two: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 data, 0-dim fp32 scale_inv): one scale for the whole tensor."""
    scale = amax_to_scale(tensor_to_amax(x), lp_dtype, power_of_two=power_of_two)
    return tensor_to_fp8(x, scale, lp_dtype), scale.reciprocal()


def quantize_rowwise(
    x: torch.Tensor,
    lp_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    dim: int = -1,
    power_of_two: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 data, fp32 scale_inv with `dim` kept as size 1): one scale per slice along dim.

    torchao's axiswise scaling: dim=-1 gives one scale per row (the GEMM's K is the last dim).
    power_of_two defaults to True as in torchao's rowwise recipes.
    """
    amax = torch.amax(x.abs(), dim=dim, keepdim=True).to(torch.float32)
    scale = amax_to_scale(amax, lp_dtype, power_of_two=power_of_two)
    return tensor_to_fp8(x, scale, lp_dtype), scale.reciprocal()


def dequantize_scaled(
    data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """data * scale_inv (broadcast), in fp32 then `dtype`: tensorwise and rowwise."""
    return (data.to(torch.float32) * scale_inv).to(dtype)


# --- blockwise (Transformer Engine Float8BlockScaling, DeepSeek-V3) --------------------------


def te_block_scale(
    amax: torch.Tensor,
    lp_dtype: torch.dtype,
    *,
    power_of_two: bool,
    eps: float,
    value_for_inf: float,
) -> torch.Tensor:
    """Transformer Engine's compute_scale_from_amax, elementwise over fp32 amaxes.

    amax < eps is raised to eps; amax 0, inf or nan gives scale 1; fp8_max / amax (one
    correctly rounded fp32 division) that overflows to inf becomes value_for_inf (the input
    dtype's max); power_of_two keeps sign and exponent bits only (rounds down).
    """
    amax = amax.to(torch.float32)
    amax = torch.where(amax < eps, torch.full_like(amax, eps), amax)
    one = torch.ones_like(amax)
    scale = torch.full_like(amax, torch.finfo(lp_dtype).max) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(amax, value_for_inf), scale)
    if power_of_two:
        scale = (scale.view(torch.int32) & ~0x7FFFFF).view(torch.float32)
    special = torch.isinf(amax) | (amax == 0) | torch.isnan(amax)
    return torch.where(special, one, scale)


def quantize_blockwise(
    x: torch.Tensor,
    lp_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    block: tuple[int, int] = (1, BLOCKWISE_TILE),
    power_of_two: bool = True,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 data, fp32 scale_inv per block): TE's Float8BlockScaling quantization.

    block (1, 128) for activations and gradients, (128, 128) for weights (DeepSeek-V3's
    `weight_scale_inv` layout: one entry per 128x128 block, edge blocks partial). Each element
    is x * scale saturated to +-fp8_max (nan stays nan) and rounded to nearest even;
    scale_inv = 1 / scale (exact when power_of_two).
    """
    _check_2d(x, "quantize_blockwise")
    scale = te_block_scale(
        block_amax(x, block),
        lp_dtype,
        power_of_two=power_of_two,
        eps=eps,
        value_for_inf=torch.finfo(x.dtype).max,
    )
    data = tensor_to_fp8(x, expand_blocks(scale, block, x.shape), lp_dtype)
    return data, scale.reciprocal()


def dequantize_blockwise(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    block: tuple[int, int] = (1, BLOCKWISE_TILE),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """data * scale_inv of its block, in fp32 then `dtype`."""
    return (data.to(torch.float32) * expand_blocks(scale_inv, block, data.shape)).to(dtype)


# --- MXFP8 (OCP MX, torchao.prototype.mx_formats) ---------------------------------------------


def _f32_exponent(v: torch.Tensor) -> torch.Tensor:
    """The unbiased exponent field of fp32 values (denormals and 0 give -127), as int32."""
    return ((v.view(torch.int32) >> 23) & 0xFF) - 127


def quantize_mxfp8(
    x: torch.Tensor,
    lp_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    scale_mode: MXScaleMode = "rceil",
    block_size: int = MX_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 data, E8M0 scale (rows, ceil(cols/32)) as torch.float8_e8m0fnu): MX along rows.

    scale_mode (torchao's ScaleCalculationMode, bit for bit):
    - 'floor' (the OCP spec): 2**(floor(log2 amax) - emax_elem), emax_elem = 8 for e4m3;
      values above the largest element saturate.
    - 'ceil': the exponent rounded up when amax's mantissa is non-zero (no saturation).
    - 'even': amax rounded to the element's mantissa width (half up) before 'floor'.
    - 'rceil' (cuBLAS / TE MXFP8, the default): 2**ceil(log2(amax / elem_max)), no saturation.
    An all-zero block gets code 0 under the first three (torchao then divides by 2**-126, the
    smallest normal fp32, not 2**-127) and code 127 (scale 1) under rceil. A nan in a block
    gives code 255 (nan); an inf gives 254 under rceil. cols not a multiple of block_size end
    in a partial block (torchao requires a multiple; its bits are those of the zero-padded
    tensor, cropped).
    """
    _check_2d(x, "quantize_mxfp8")
    if lp_dtype not in _MX_MAX_POW2:
        raise ValueError(f"quantize_mxfp8: lp_dtype={lp_dtype}; valid: {tuple(_MX_MAX_POW2)}.")
    if scale_mode not in MX_SCALE_MODES:
        raise ValueError(f"scale_mode={scale_mode!r}." + did_you_mean(scale_mode, MX_SCALE_MODES))
    block = (1, block_size)
    amax = block_amax(x, block)
    lp_max = torch.finfo(lp_dtype).max
    x32 = x.to(torch.float32)
    if scale_mode == "rceil":
        descale = amax / lp_max
        exponent = torch.clamp(torch.ceil(torch.log2(descale)), -_E8M0_BIAS, _E8M0_BIAS)
        code = (exponent + _E8M0_BIAS).to(torch.uint8)
        code = torch.where(torch.isinf(descale), 254, code).to(torch.uint8)
        code = torch.where(torch.isnan(descale), _E8M0_NAN, code).to(torch.uint8)
        inverse = torch.exp2(_E8M0_BIAS - code.to(torch.float32))
        inverse = torch.where(code == 0, 1.0, inverse)
        inverse = torch.where(code == 254, 2.0**-127, inverse)
        inverse = torch.where(code == _E8M0_NAN, descale, inverse)
        scaled = x32 * expand_blocks(inverse, block, x.shape)
    else:
        if scale_mode == "even":
            bits = amax.view(torch.int32)
            rounded = (bits + (1 << (23 - _MANTISSA_BITS[lp_dtype] - 1))) & (0x1FF << 23)
            amax = torch.where(torch.isnan(amax), amax, rounded.view(torch.float32))
        exponent = _f32_exponent(amax)
        if scale_mode == "ceil":
            exponent = exponent + ((amax.view(torch.int32) & 0x7FFFFF) > 0).to(torch.int32)
        unbiased = torch.clamp(exponent - _MX_MAX_POW2[lp_dtype], -_E8M0_BIAS, _E8M0_BIAS + 1)
        code = (unbiased + _E8M0_BIAS).to(torch.uint8)
        code = torch.where(torch.isnan(amax), _E8M0_NAN, code).to(torch.uint8)
        divisor = (code.to(torch.int32) << 23).view(torch.float32).clamp(min=_F32_MIN_NORMAL)
        scaled = x32 / expand_blocks(divisor, block, x.shape)
    data = scaled.clamp(-lp_max, lp_max).to(lp_dtype)
    return data, code.view(torch.float8_e8m0fnu)


def e8m0_to_fp32(scale: torch.Tensor) -> torch.Tensor:
    """2**(code - 127) in fp32 (code 0 is 2**-127, a denormal); code 255 is nan."""
    code = scale.view(torch.uint8).to(torch.float32)
    return torch.where(code == _E8M0_NAN, float("nan"), torch.exp2(code - _E8M0_BIAS))


def dequantize_mxfp8(
    data: torch.Tensor,
    scale: torch.Tensor,
    *,
    block_size: int = MX_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """data * 2**(code - 127) of its block, in fp32 then `dtype` (torchao's to_dtype)."""
    fp_scale = expand_blocks(e8m0_to_fp32(scale), (1, block_size), data.shape)
    return (data.to(torch.float32) * fp_scale).to(dtype)


# --- NVFP4 (E2M1 data, e4m3 block scales, fp32 global scale) ----------------------------------

_E2M1_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)  # midpoints whose lower neighbour has an even code
_E2M1_TIES_UP = (0.75, 1.75, 3.5)  # midpoints whose upper neighbour has an even code


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 codes (uint8, sign in bit 3): round to nearest even, saturating at 6.

    The code of |x| counts the midpoints between grid neighbours that |x| passes; a tie goes
    to the neighbour whose code is even. nan gives code 0 with its sign (E2M1 has no nan).
    """
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid in _E2M1_TIES_DOWN:
        code += (mag > mid).to(torch.uint8)
    for mid in _E2M1_TIES_UP:
        code += (mag >= mid).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def _e2m1_magnitude(code: torch.Tensor) -> torch.Tensor:
    """The magnitude of E2M1 codes 0..7 in fp32, arithmetically (0.5 c below 2, else
    2**(c // 2 - 1) * (1 + (c % 2) / 2)): no table lookup, which torch.compile fuses freely."""
    c = code.to(torch.float32)
    half = torch.floor(c / 2)
    return torch.where(c < 2, c * 0.5, torch.exp2(half - 1) * (1 + (c - 2 * half) * 0.5))


def e2m1_stochastic_round(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 codes, rounding |x| up to the next grid value with probability equal to its
    distance from the lower one over the gap (unbiased: E[value] = x for |x| <= 6).

    noise: uniform [0, 1) samples, one per element (the caller's generator makes it
    reproducible). |x| above 6 saturates; nan gives code 0 with its sign.
    """
    mag = x.abs().clamp(max=E2M1_MAX)
    lower = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for value in E2M1_VALUES[1:-1]:  # the grid value at or below |x|, capped at code 6 (4.0)
        lower += (mag >= value).to(torch.uint8)
    lo = _e2m1_magnitude(lower)
    hi = _e2m1_magnitude(lower + 1)
    up = noise * (hi - lo) < (mag - lo)
    code = lower + up.to(torch.uint8)
    code = torch.where(torch.isnan(x), 0, code).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_to_fp32(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, sign in bit 3) -> fp32 values."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = grid[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -mag, mag)


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """amax / (448 * 6) in fp32 (torchao's per_tensor_amax_to_scale); 1 for an all-zero x."""
    amax = tensor_to_amax(x)
    return torch.where(amax > 0, amax / (_E4M3_MAX * E2M1_MAX), torch.ones_like(amax))


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    block: tuple[int, int] = (1, NVFP4_BLOCK),
    global_scale: torch.Tensor | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E2M1 codes, e4m3 block scales, fp32 global scale): x ~= value(code) * block * global.

    Codes are one uint8 per element (unpacked; sign in bit 3). block (1, 16) for activations
    and gradients, (16, 16) for weights (one scale per 2-D block, so the columnwise operand is
    the transpose of the rowwise one, bit for bit). global_scale defaults to
    nvfp4_global_scale(x). The block scale is (block amax / 6) / global rounded to e4m3 (clamped
    to [2**-6, 448]), and x is multiplied by (1 / global) / block_scale: torchao's two-level
    nvfp4_quantize exactly. stochastic rounds the scaled values stochastically (noise from
    `generator`, or torch's default generator of x's device).
    """
    _check_2d(x, "quantize_nvfp4")
    if global_scale is None:
        global_scale = nvfp4_global_scale(x)
    block_scale = (block_amax(x, block) / E2M1_MAX) / global_scale
    block_fp8 = block_scale.clamp(min=_E4M3_TINY, max=_E4M3_MAX).to(torch.float8_e4m3fn)
    reciprocal = (1.0 / global_scale) / block_fp8.to(torch.float32)
    scaled = x.to(torch.float32) * expand_blocks(reciprocal, block, x.shape)
    scaled = scaled.clamp(-E2M1_MAX, E2M1_MAX)
    if stochastic:
        noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        codes = e2m1_stochastic_round(scaled, noise)
    else:
        codes = e2m1_round(scaled)
    return codes, block_fp8, global_scale


def dequantize_nvfp4(
    codes: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor,
    *,
    block: tuple[int, int] = (1, NVFP4_BLOCK),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """value(code) * (global * block_scale) in fp32, then `dtype` (torchao's dequantize)."""
    hp_scale = global_scale * block_scale.to(torch.float32)
    return (e2m1_to_fp32(codes) * expand_blocks(hp_scale, block, codes.shape)).to(dtype)
