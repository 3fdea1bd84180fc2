"""Cross-check: mixprec's Float8Linear against torchao's float8 training linear (tensorwise).

Both use the same recipe: per-tensor dynamic scales fp8_max / max(amax, 1e-12) (torchao divides
in fp64 and rounds to fp32; fp64 has more than 2 * 24 + 2 bits, so that double rounding gives
the correctly rounded fp32 quotient, as our fp32 division does), a saturating cast of
x.float() * scale, e4m3 input and weight, e5m2 grad_output, and torch._scaled_mm with the
reciprocal scales. So with the real kernel the two agree bit for bit: that is the contract
tested. Known and tested differences:
- Output dtypes of the backward GEMMs: torchao computes grad_input and grad_weight in the
  input's dtype (the autograd engine then casts grad_weight to the weight's dtype); mixprec
  computes grad_weight directly in the weight's dtype. With a bf16 input and fp32 weights, or
  under CPU autocast, torchao's gradients are mixprec's rounded to bf16, exactly.
- Emulation: torchao dequantizes each operand (fp8 / scale) before an fp32 matmul, mixprec
  multiplies the exact fp8 product by the two inverse scales afterwards: both are fp32 sums of
  the same exact terms, so they differ by rounding only (bound below).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mixprec.fp8 import Float8Config, Float8Linear, convert_to_fp8, fp8_summary
from mixprec.fp8 import kernels as fp8_kernels

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

torchao_float8 = pytest.importorskip("torchao.float8")

needs_cpu_kernel = pytest.mark.skipif(
    not fp8_kernels.cpu_has_scaled_mm(), reason="this torch has no CPU torch._scaled_mm"
)
SHAPES = [(32, 64, 48), (20, 48, 32)]  # (M, K, N); M=20 is not 16-aligned (only K, N must be)


def pair(k: int, n: int, *, emulate: bool) -> tuple[nn.Module, nn.Module]:
    """(mixprec, torchao) one-layer models with identical weights."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(k, n))
    ours = convert_to_fp8(copy.deepcopy(base), config=Float8Config(emulate=emulate))
    summary = fp8_summary(ours)
    assert summary.converted == ("0",) and isinstance(ours[0], Float8Linear)
    if emulate:
        ao_config = torchao_float8.Float8LinearConfig(emulate=True)
    else:
        ao_config = torchao_float8.Float8LinearConfig.from_recipe_name("tensorwise")
    theirs = torchao_float8.convert_to_float8_training(copy.deepcopy(base), config=ao_config)
    assert type(theirs[0]).__module__.startswith("torchao.float8")
    return ours, theirs


def fwd_bwd(
    model: nn.Module, x: torch.Tensor, grad: torch.Tensor, autocast: bool = False
) -> list[torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    with torch.autocast(torch.get_default_device().type, dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.backward(grad.to(out.dtype))
    return [out, x.grad, model[0].weight.grad, model[0].bias.grad]


def data(m: int, k: int, n: int, dtype: torch.dtype = torch.float32):
    generator = torch.Generator(torch.get_default_device()).manual_seed(1)
    x = 3 * torch.randn(m, k, generator=generator)
    grad = torch.randn(m, n, generator=generator)
    return x.to(dtype), grad.to(dtype)


@needs_cpu_kernel
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_kernel_matches_torchao_bitwise(shape, dtype):
    m, k, n = shape
    ours, theirs = pair(k, n, emulate=False)
    ours.to(dtype), theirs.to(dtype)  # parameters and input in one dtype
    x, grad = data(m, k, n, dtype)
    x = x.reshape(2, m // 2, k)  # a batch dim: both flatten to 2-D for the GEMM
    grad = grad.reshape(2, m // 2, n)
    names = ("out", "grad_input", "grad_weight", "grad_bias")
    for name, got, want in zip(
        names, fwd_bwd(ours, x, grad), fwd_bwd(theirs, x, grad), strict=True
    ):
        assert got.dtype == want.dtype == dtype, name
        # Same scales, same fp8 bytes, same kernel: exactness is the contract.
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


@needs_cpu_kernel
@pytest.mark.parametrize("mode", ["bf16_input_fp32_weight", "cpu_autocast"])
def test_bf16_activations_torchao_grads_are_ours_rounded_to_bf16(mode):
    m, k, n = SHAPES[0]
    ours, theirs = pair(k, n, emulate=False)
    x, grad = data(m, k, n)
    autocast = mode == "cpu_autocast"
    if not autocast:
        x = x.bfloat16()  # what torchao's forward does to its input under CUDA autocast
    got = fwd_bwd(ours, x, grad, autocast)
    want = fwd_bwd(theirs, x, grad, autocast)
    assert got[0].dtype == want[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # the forward: identical
    assert got[2].dtype == want[2].dtype == torch.float32
    for name, g, w in zip(("grad_input", "grad_weight"), got[1:3], want[1:3], strict=True):
        # torchao's backward GEMMs output bf16; ours output the hp tensor's dtype. Rounding
        # ours to bf16 must give torchao's bits: the same fp32 GEMM, one rounding later.
        torch.testing.assert_close(g.bfloat16().to(w.dtype), w, rtol=0, atol=0, msg=name)
    # fp32 grad_weight keeps bits torchao drops (guards against this test passing vacuously).
    assert not torch.equal(got[2], want[2])


def fp8_image(t: torch.Tensor, lp_dtype: torch.dtype) -> torch.Tensor:
    """|dequantized fp8 copy| in fp64: the terms both emulations sum (scale cancels exactly)."""
    from mixprec.fp8 import amax_to_scale, tensor_to_amax, tensor_to_fp8

    scale = amax_to_scale(tensor_to_amax(t), lp_dtype)
    return (tensor_to_fp8(t, scale, lp_dtype).double() / scale.double()).abs()


@pytest.mark.parametrize("shape", SHAPES)
def test_emulation_matches_torchao_emulation_to_fp32_rounding(shape):
    m, k, n = shape
    ours, theirs = pair(k, n, emulate=True)
    x, grad = data(m, k, n)
    got, want = fwd_bwd(ours, x, grad), fwd_bwd(theirs, x, grad)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    xq, wq, gq = fp8_image(x, e4m3), fp8_image(ours[0].weight.detach(), e4m3), fp8_image(grad, e5m2)
    # Each side is an fp32 evaluation of the same exact sum over K terms with at most K + 3
    # roundings per term (torchao: two dequantizations, product, sums; mixprec: sums, two
    # inverse scales), so each is within gamma_{K+3} * sum|terms| of it; the two within twice.
    u = 2.0**-24
    bounds = {
        "out": (xq @ wq.T, k),
        "grad_input": (gq @ wq, n),
        "grad_weight": (gq.T @ xq, m),
    }
    for name, g, w in zip(bounds, got[:3], want[:3], strict=True):
        abs_terms, depth = bounds[name]
        gamma = (depth + 3) * u / (1 - (depth + 3) * u)
        excess = (g.double() - w.double()).abs() - 2 * gamma * abs_terms
        assert excess.max().item() <= 0, name
    torch.testing.assert_close(got[3], want[3], rtol=0, atol=0)  # the bias grad: the same sum
