"""mixprec.core.qstate: torchao's low-bit state read and written in the kernel, torchao's bits."""

from __future__ import annotations

import pytest
import torch
from tolerances import EXACT

from mixprec.core import fused_step, qstate
from mixprec.core import step_math as sm
from mixprec.core.lean import new_state

torchao = pytest.importorskip("torchao")

MAPS = [("int8", True), ("int8", False), ("int4", True), ("int4", False)]


def _state(fmt: str, signed: bool, numel: int = 4096) -> torch.Tensor:
    return new_state(torch.empty(numel), fmt, signed)


def _inputs(point: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Every value where the code steps up inside a bucket, its fp32 neighbours below and above,
    both ends of every bucket (steps falling on a bucket's edge), the map's own points, random
    values (uniform in [-1, 1] and over 40 binades), the ends and nan."""
    g = torch.Generator().manual_seed(0)
    steps = point[torch.isfinite(point)]
    below = torch.nextafter(steps, torch.tensor(-2.0))
    above = torch.nextafter(steps, torch.tensor(2.0))
    uniform = torch.rand(1 << 20, generator=g) * 2 - 1
    sign = torch.where(torch.rand(1 << 20, generator=g) < 0.5, -1.0, 1.0)
    binades = sign * torch.exp2(-40 * torch.rand(1 << 20, generator=g))
    bucket = torch.arange(1 << 16, dtype=torch.int32) << 16
    edges = torch.cat([bucket, bucket | 0xFFFF]).view(torch.float32)
    edges = edges[edges.abs() <= 1]
    ends = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1e-38, float("nan")])
    x = torch.cat([steps, below, above, edges, qmap, uniform, binades, ends])
    return torch.where(x.isnan(), x, x.clamp(-1, 1))


@pytest.mark.parametrize(("fmt", "signed"), MAPS)
def test_nearest_codes_are_torchaos_at_every_step_point(fmt: str, signed: bool) -> None:
    """The table's code is torchao's binary search + rounding's, at each value where the code
    steps up inside a bucket and one fp32 step either side of it (where a wrong table would
    show first), at both ends of every bucket (where the code steps between buckets: int4's
    unsigned map, multiples of 1/16, steps only there), over 2M random values, the map's own
    points, +-0, +-1, subnormals and nan."""
    from torchao.optim.quant_utils import quantize_4bit_with_qmap, quantize_8bit_with_qmap

    state = _state(fmt, signed)
    _, point = qstate._build(state.qmap, type(state).__name__)
    table = qstate.table(state.qmap, type(state).__name__, signed)
    x = _inputs(point, state.qmap)
    search = quantize_8bit_with_qmap if fmt == "int8" else quantize_4bit_with_qmap
    expected = search(x, state.qmap).int()
    got = qstate.nearest_codes(x, table)
    assert torch.equal(got, expected), int((got != expected).sum())


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("signed", [True, False])
def test_write_and_read_are_torchaos_copy_and_dequantize(fmt: str, signed: bool) -> None:
    """write() leaves the codes and scales torchao's copy_ leaves (blocks of very different
    scales, an all-zero block); read() returns its dequantize(), bit for bit."""
    g = torch.Generator().manual_seed(1)
    value = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-30, 10, (64, 1)))
    value[3] = 0.0
    if not signed:
        value = value.abs()
    mine, theirs = _state(fmt, signed, value.numel()), _state(fmt, signed, value.numel())
    theirs.copy_(value.view(-1))
    operand = qstate.unpack(mine)
    qstate.write(operand, value.view(-1))
    assert torch.equal(mine.codes, theirs.codes)
    assert torch.equal(mine.scale, theirs.scale)
    torch.testing.assert_close(qstate.read(operand), theirs.dequantize().view(-1), **EXACT)


def test_fp8_values_are_torchs_for_all_256_codes() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    theirs = codes.view(torch.float8_e4m3fn).float()
    mine = qstate.fp8_values(codes)
    assert torch.equal(mine.view(torch.int32), theirs.view(torch.int32))  # nan's bits, -0.0


@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_codes_are_torchs_at_every_rounding_boundary(compiled: bool) -> None:
    """fp8_codes equals torch's fp32 -> float8_e4m3fn at every value where the rounding
    changes (each midpoint between neighbouring e4m3 values, subnormal ones included), one
    fp32 step either side, the e4m3 values themselves, 1M values over e4m3's binades and
    beyond, +-0, fp32 subnormals and nan, both signs; past +-464 only where torch saturates
    (2.13 does, 2.11 gives nan: outside what a block scaled to 448 reaches)."""
    e4m3 = torch.arange(127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    points = e4m3.float()  # 0 .. 448
    middles = (points[:-1] + points[1:]) / 2  # exact in fp32
    g = torch.Generator().manual_seed(3)
    binades = torch.exp2(torch.rand(1 << 20, generator=g) * 30 - 20)
    near = [torch.nextafter(middles, torch.tensor(v)) for v in (0.0, 1e9)]
    ends = torch.tensor([0.0, 1e-45, 1e-38, 2.0**-10, 448.0, 463.99, float("nan")])
    x = torch.cat([points, middles, *near, binades, ends])
    x = torch.cat([x, -x])
    saturates = bool(torch.tensor(1e6).to(torch.float8_e4m3fn).float() == qstate.FP8_MAX)
    if saturates:
        x = torch.cat([x, torch.tensor([464.0, 479.0, 1e6, float("inf"), -1e6, -float("inf")])])
    else:
        x = x[(x.abs() < 464) | x.isnan()]
    convert = torch.compile(qstate.fp8_codes, dynamic=False) if compiled else qstate.fp8_codes
    theirs = x.to(torch.float8_e4m3fn).view(torch.uint8).int()
    mine = convert(x)
    assert torch.equal(mine, theirs), int((mine != theirs).sum())


def test_plain_state_passes_through() -> None:
    state = torch.arange(6.0).view(2, 3)
    operand = qstate.unpack(state)
    qstate.write(operand, qstate.read(operand) * 2)
    assert torch.equal(state, torch.arange(6.0).view(2, 3) * 2)
    assert not qstate.is_quantized(state)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("formats", [("int8", "int8"), ("int8", "int4"), ("fp8", "fp8")])
def test_adam_kernel_writes_what_torchaos_copy_writes(compiled: bool, formats: tuple) -> None:
    """The update kernel with low-bit moments equals, bit for bit, the same step math with the
    moments read by torchao's dequantize() and written by its copy_ (the kernel may fuse a
    multiply-add when compiled, so there the moments' values are compared after one step, and
    every later code within one code of torchao's)."""
    g = torch.Generator().manual_seed(2)
    n = 8192
    hp = torch.randn(n, generator=g).bfloat16()
    grads = [torch.randn(n, generator=g).bfloat16() * 1e-2 for _ in range(3)]
    ours = [new_state(hp, formats[0], True), new_state(hp, formats[1], False)]
    ref = [new_state(hp, formats[0], True), new_state(hp, formats[1], False)]
    hp_ref = hp.clone()
    flags = (False, False, True, True)  # no clip, no maximize, weight decay, decoupled
    for step, grad in enumerate(grads, start=1):
        s = sm.scalar_vector(sm.adam_scalars(1e-3, 0.1, 0.9, 0.999, 1e-8, float(step)))
        fused_step.update("adam", hp, grad, ours, s, flags, compiled=compiled)
        m, v = ref[0].dequantize(), ref[1].dequantize()
        new, m, v = sm.adam_update(
            hp_ref.float(), sm.unscaled(grad, s, False, False), m, v, s, True, True
        )
        ref[0].copy_(m)
        ref[1].copy_(v)
        hp_ref.copy_(new)
        if not compiled:
            for a, b in zip(ours, ref, strict=True):
                assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
            assert torch.equal(hp, hp_ref)
    if compiled:
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(a.dequantize(), b.dequantize(), rtol=0.15, atol=1e-7)
