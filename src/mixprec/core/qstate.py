"""torchao's low-bit optimizer state, read and written inside the update's kernel.

torchao's OptimState8bit / OptimState4bit / OptimStateFp8 hold codes and one fp32 scale per
block. Writing one (its copy_) scales each block by its absmax and finds each value's nearest
code with a binary search of the 256- (16-) entry code map and a rounding step: 10 (6) table
lookups per element, the larger part of a lean step on a CPU (2**17 elements, one thread,
compiled: block scale + search 14.5 ns an element, an elementwise update 0.7).

Here the nearest code is one lookup in a table over the value's top 16 bits (its bf16-sized
bucket) and one comparison. torchao's code is a non-decreasing function of the value, and it
steps up at most once inside any bucket (checked when the table is built: the map's points
are further apart than a bucket is wide), so per bucket the table keeps, in one int32, the code
of its lowest value and where in the bucket the code steps up (the low 16 bits of the smallest
fp32 value taking the next code, counted in value order; 2**16 where it does not step), both
found with torchao's own quantize function. The code is then torchao's for every value in
[-1, 1] (all a block's absmax scaling gives) and nan, exactly: tests/test_qstate.py checks
every step point, its neighbours and every bucket's ends, and scripts/check_qstate_exhaustive.py
checked every fp32 value in [-1, 1] for each of the four maps once (0 mismatches). Scales, dequantization and the
4-bit packing are torchao's formulas; fp8 (a cast, no search) is torchao's own quantize_fp8.

The kernels index only these tables and code maps, with indices in range by construction
(a masked 16-bit bucket, a uint8 code, a 4-bit nibble), so fused_step compiles them without
inductor's per-element bounds checks. Measured (135168 elements, one thread, an AdamW kernel
with both moments int8): ~48 ns an element with torchao's copy_ in the graph, ~16 with this
table (block scale + table alone: 4.0 ns, against the search's 14.5).

The kernel sees plain tensors (unpack): no tensor subclass in a compiled graph.
"""

from __future__ import annotations

from typing import Any

import torch

INT8, INT4, FP8 = "OptimState8bit", "OptimState4bit", "OptimStateFp8"

_TABLES: dict[tuple, torch.Tensor] = {}
NO_STEP = 1 << 16
"""A table entry's step position where the code does not step inside the bucket."""


def is_quantized(state: torch.Tensor) -> bool:
    """state is one of torchao's low-bit tensors (codes + block scales)."""
    return type(state).__name__ in (INT8, INT4, FP8)


def unpack(state: torch.Tensor) -> Any:
    """What the kernel takes for a state tensor: a plain tensor flattened (as it is), or for
    torchao's quantized state a tuple of flat plain tensors: (codes, scale) for fp8, (codes,
    scale, code map, nearest-code table) for int8 and int4 (same storage: the kernel writes
    the state in place); fp8's codes as their uint8 bits."""
    kind = type(state).__name__
    if kind not in (INT8, INT4, FP8):
        return state.view(-1)
    codes = state.codes.view(-1)
    if kind == FP8:
        return (codes.view(torch.uint8), state.scale)  # the e4m3 bits: see fp8_values
    return (codes, state.scale, state.qmap, table(state.qmap, kind, bool(state.signed)))


def table(qmap: torch.Tensor, kind: str, signed: bool) -> torch.Tensor:
    """The nearest-code table of a torchao code map (built once per map and device): per
    bucket of the top 16 bits of an fp32 value, an int32 holding (code of the bucket's lowest
    value) << 17 | (position in value order, 0..65535, of the first value taking the next
    code; NO_STEP where the code does not step inside the bucket)."""
    key = (kind, signed, str(qmap.device))
    if key not in _TABLES:
        code, point = _build(qmap.detach().float().cpu(), kind)
        _TABLES[key] = _pack(code, point).to(qmap.device)
    return _TABLES[key]


def _position(bits: torch.Tensor) -> torch.Tensor:
    """Where an fp32 value (its int32 bits) lies in its bucket, in value order: the low 16
    bits count up for positive values and down for negative ones."""
    low = bits & 0xFFFF
    return torch.where(bits < 0, 0xFFFF - low, low)


def _pack(code: torch.Tensor, point: torch.Tensor) -> torch.Tensor:
    steps = torch.isfinite(point)
    position = torch.where(steps, _position(point.view(torch.int32)), NO_STEP)
    return ((code.to(torch.int32) << 17) | position.to(torch.int32)).to(torch.int32)


def _torchao_codes(x: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    from torchao.optim.quant_utils import quantize_4bit_with_qmap, quantize_8bit_with_qmap

    search = quantize_8bit_with_qmap if qmap.numel() == 256 else quantize_4bit_with_qmap
    return search(x, qmap).long()


def _build(qmap: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    bucket = torch.arange(1 << 16, dtype=torch.int64)
    negative = bucket >= 1 << 15

    def value(t: torch.Tensor) -> torch.Tensor:
        """The t-th lowest fp32 value of each bucket (t in 0..65535): the low 16 bits count
        up for positive values and down for negative ones."""
        low = torch.where(negative, 0xFFFF - t, t)
        bits = (bucket << 16) | low
        bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
        return bits.view(torch.float32)

    lowest, highest = value(torch.zeros_like(bucket)), value(torch.full_like(bucket, 0xFFFF))
    finite = torch.isfinite(lowest) & torch.isfinite(highest)

    def codes(x: torch.Tensor) -> torch.Tensor:
        return _torchao_codes(torch.where(finite, x, 0.0), qmap)

    low_code, high_code = codes(lowest), codes(highest)
    if (high_code - low_code).max() > 1:
        raise RuntimeError(
            f"mixprec: torchao's {kind} code map steps twice inside one bf16-sized bucket; the "
            "nearest-code table cannot represent it (torchao's map changed?)."
        )
    # the first t whose value takes the next code: binary search over each bucket's values
    below, above = torch.zeros_like(bucket), torch.full_like(bucket, 0xFFFF)
    for _ in range(17):
        middle = (below + above) // 2
        up = codes(value(middle)) > low_code
        above, below = torch.where(up, middle, above), torch.where(up, below, middle)
    steps = finite & (high_code > low_code)
    point = torch.where(steps, value(above), torch.tensor(float("inf")))
    # buckets of inf and nan: only nan reaches them (a scaled block is within [-1, 1]), which
    # torchao codes 0 (no comparison with nan holds)
    code = torch.where(finite, low_code, 0).to(torch.uint8)
    return code, point


def nearest_codes(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """torchao's nearest code (int32) of each value of x (fp32 in [-1, 1], or nan) from the
    nearest-code table of its code map (see table). A nan's bucket holds code 0, no step."""
    bits = x.view(torch.int32)
    entry = torch.gather(table, 0, ((bits >> 16) & 0xFFFF).long())
    return (entry >> 17) + (_position(bits) >= (entry & 0x1FFFF)).int()


def read(state: Any) -> torch.Tensor:
    """A kernel's state operand (see unpack) as flat fp32 values: torchao's dequantize (its
    table is not read, so (codes, scale, code map) will do; lean's checkpoint loads call it)."""
    if not isinstance(state, tuple):
        return state.float()
    codes, scale = state[0], state[1]
    if len(state) == 2:  # fp8: torchao's dequantize
        values = fp8_values(codes.view(torch.uint8))
        return (values.view(scale.numel(), -1) * scale.view(-1, 1)).view(-1)
    qmap = state[2]
    index = codes
    if qmap.numel() == 16:  # int4: two codes a byte, high nibble first (torchao's packing)
        index = torch.stack([codes >> 4, codes & 0b1111], dim=-1).view(-1)
    values = torch.gather(qmap, 0, index.long())
    return (values.view(scale.numel(), -1) * scale.view(-1, 1)).view(-1)


def write(state: Any, value: torch.Tensor) -> None:
    """value (flat fp32) into a kernel's state operand in place: quantized as torchao's copy_
    does (block absmax scale, nearest code; fp8: scale to e4m3's max and cast)."""
    for old, new in writes(state, value):
        old.copy_(new)


def writes(state: Any, value: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (tensor, new value) pairs write() copies: a plain operand and value, or a quantized
    operand's codes and scale and quantize()'s (compile_step keeps the old ones on a skipped
    step with torch.where instead of copying)."""
    if not isinstance(state, tuple):
        return [(state, value)]
    return list(zip(state[:2], quantize(state, value.reshape(-1)), strict=True))


def quantize(state: tuple, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (codes, scale) that write() leaves in a quantized operand for value (flat fp32),
    written nowhere."""
    scale = state[1]
    if len(state) == 2:  # torchao's quantize_fp8: block absmax to e4m3's largest value
        blocks = value.view(scale.numel(), -1)
        new_scale = blocks.abs().amax(-1).clip(1e-12) / FP8_MAX
        return fp8_codes(blocks / new_scale.view(-1, 1)).view(-1).to(torch.uint8), new_scale
    from torchao.optim.quant_utils import scale_tensor

    scaled, new_scale = scale_tensor(value, value.numel() // scale.numel())
    new = nearest_codes(scaled, state[3]).to(torch.uint8)
    if state[2].numel() == 16:  # int4: pack pairs, high nibble first
        new = (new[::2] << 4) | new[1::2]
    return new, new_scale


# ----- fp8 (e4m3fn) in integer arithmetic -----
# Torch converts fp32 to and from float8 one element at a time in plain C++ on CPUs without
# AVX-512 (the kernel's at::vec::convert falls back to it): fp8 state cost more than int8's
# table lookups (22 against 16 ns an element, AdamW kernel, one thread). These are the same
# conversions in int32 and fp32 operations, which inductor vectorizes.
FP8_MAX = 448.0
"""e4m3fn's largest finite value (torch.finfo(torch.float8_e4m3fn).max): torchao's block scale
maps a block's absmax to it."""


def fp8_codes(x: torch.Tensor) -> torch.Tensor:
    """The e4m3fn bits (int32, 0..255) of fp32 x: torch's conversion (round to nearest even,
    e4m3fn's subnormals; nan to 0x7F with its sign), for every fp32 value: beyond the largest
    finite value torch 2.13 saturates to +-448 and this does too (torch 2.11 gives nan from
    464 on; a block scaled by its absmax never gets there). Checked against torch's own
    conversion on all 2**32 fp32 values (tests: the boundaries; scripts/check_qstate_exhaustive.py)."""
    bits = x.view(torch.int32)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # below 2**-6 (e4m3's subnormals, steps of 2**-9): fp32's own rounding, adding 2**14
    sub = (x.abs() + 16384.0).view(torch.int32) - (141 << 23)
    # normal: round the mantissa to 3 bits, half to even, and rebias the exponent (127 -> 7)
    normal = (a + (0x7FFFF - (120 << 23)) + ((a >> 20) & 1)) >> 20
    code = torch.where(a < (121 << 23), sub, normal).clamp(max=0x7E)
    return torch.where(a > 0x7F800000, 0x7F, code) | sign


def fp8_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of e4m3fn bits (uint8 codes): torch's conversion, bit for bit (all 256)."""
    c = codes.int()
    mag = c & 0x7F
    normal = torch.where(mag == 0x7F, 0x7FF00000, (mag << 20) + (120 << 23))  # 0x7F: nan
    sub = mag.float() * 2.0**-9  # subnormals: mag * 2**-9, exact
    value = torch.where(mag < 8, sub, normal.view(torch.float32))
    return torch.where(c >= 128, -value, value)
