"""Rowwise recipes on torch._scaled_mm (rowwise scales (M, 1) and (1, N)) against emulation.

On CPU the kernel runs with Float8Config(emulate=False) (the default emulates: torch's CPU
kernel is a slow reference kernel). It dequantizes each operand to fp32 and multiplies in
fp32, as the emulation does, so the two agree bit for bit: that is the contract checked here.
On CUDA (sm_89+, bf16 outputs) the kernel multiplies the exact float8 products in fp32 and
scales once per output element: it differs from the emulation by fp32 summation order and
the final rounding to bf16 (the CUDA-marked test: within 1 bf16 ulp on >= 99.9 % of elements).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from mixprec.fp8 import Float8Config, Float8Linear, convert_to_fp8
from mixprec.fp8 import kernels as fp8_kernels
from mixprec.fp8.kernels import resolve_recipe_kernel, rowwise_kernel_problem
from mixprec.fp8.recipes import GEMMS, emulated_gemm, recipe_gemm

ROWWISE = ("rowwise", "rowwise_with_gw_hp")
# GEMMs with two float8 operands (rowwise_with_gw_hp's grad_weight runs in high precision).
KERNEL_GEMMS = {"rowwise": 3, "rowwise_with_gw_hp": 2}


def count_scaled_mm(monkeypatch) -> list[tuple[int, ...]]:
    """Record the scale_a shape of every torch._scaled_mm call (the kernel really ran)."""
    calls: list[tuple[int, ...]] = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append(tuple(kwargs["scale_a"].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    return calls


def operands(gemm: str, m: int = 48, k: int = 64, n: int = 32, seed: int = 0):
    """(A, B^T) of one GEMM in its K-last layout, with a spread of row magnitudes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m).reshape(m, 1)
    w = torch.randn(n, k, generator=g) * 0.05
    dy = torch.randn(m, n, generator=g) * torch.logspace(-4, 1, m).reshape(m, 1)
    return {"forward": (x, w), "grad_input": (dy, w.t()), "grad_weight": (dy.t(), x.t())}[gemm]


@pytest.mark.skipif(not fp8_kernels.cpu_has_rowwise_scaled_mm(), reason="no CPU rowwise kernel")
@pytest.mark.parametrize("recipe", ROWWISE)
@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("power_of_two", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_equals_emulation_bitwise(
    monkeypatch, recipe, gemm, power_of_two, out_dtype
) -> None:
    kernel = Float8Config(recipe=recipe, emulate=False, power_of_two_scale=power_of_two)
    emulated = Float8Config(recipe=recipe, emulate=True, power_of_two_scale=power_of_two)
    a, b_t = operands(gemm)
    calls = count_scaled_mm(monkeypatch)
    got = recipe_gemm(gemm, a, b_t, kernel, out_dtype)
    want = emulated_gemm(gemm, a, b_t, emulated, out_dtype)
    assert got.dtype == want.dtype == out_dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    float8_gemm = not (recipe == "rowwise_with_gw_hp" and gemm == "grad_weight")
    assert calls == ([(a.shape[0], 1)] if float8_gemm else [])


@pytest.mark.skipif(not fp8_kernels.cpu_has_rowwise_scaled_mm(), reason="no CPU rowwise kernel")
@pytest.mark.parametrize("recipe", ROWWISE)
def test_cpu_kernel_layer_trains_as_the_emulated_layer_bitwise(monkeypatch, recipe) -> None:
    """Float8Linear's forward and both gradients, under bf16 autocast, kernel vs emulation."""
    torch.manual_seed(0)
    x = torch.randn(2, 24, 64)
    results = []
    for emulate in (False, None):
        layer = Float8Linear(64, 32, config=Float8Config(recipe=recipe, emulate=emulate))
        with torch.no_grad():
            layer.weight.copy_(torch.linspace(-0.2, 0.2, 64 * 32).reshape(32, 64))
            layer.bias.fill_(0.1)
        hp_x = x.clone().requires_grad_(True)
        calls = count_scaled_mm(monkeypatch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(hp_x)
        out.float().square().sum().backward()
        assert len(calls) == (KERNEL_GEMMS[recipe] if emulate is False else 0)
        results.append((out, hp_x.grad, layer.weight.grad, layer.bias.grad))
        monkeypatch.undo()
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_rowwise_recipes_take_emulate_false_and_the_block_recipes_refuse_it() -> None:
    assert Float8Config(recipe="rowwise", emulate=False).emulate is False
    assert Float8Config(recipe="rowwise_with_gw_hp", emulate=False).emulate is False
    with pytest.raises(ValueError, match="blockwise.*emulate=False"):
        Float8Config(recipe="blockwise", emulate=False)


def kernel_config(recipe: str) -> Float8Config:
    return Float8Config(recipe=recipe, emulate=False)


def fake_cuda(monkeypatch, capability) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")


def test_where_the_rowwise_kernel_runs_and_the_fallback_is_said_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(fp8_kernels, "_FALLBACK_LOGGED", set())
    bf16, fp32 = torch.bfloat16, torch.float32
    config = Float8Config(recipe="rowwise")
    fake_cuda(monkeypatch, (9, 0))
    assert rowwise_kernel_problem("cuda", bf16) is None
    assert resolve_recipe_kernel("cuda", config, bf16) is True
    assert "bfloat16" in rowwise_kernel_problem("cuda", fp32)
    with caplog.at_level(logging.INFO, logger="mixprec.fp8"):
        for _ in range(3):  # an fp32 output (an fp32 master's gradient): emulated, said once
            assert resolve_recipe_kernel("cuda", config, fp32) is False
    assert sum("writes bfloat16" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(RuntimeError, match="writes bfloat16.*emulate=False"):
        resolve_recipe_kernel("cuda", Float8Config(recipe="rowwise", emulate=False), fp32)
    fake_cuda(monkeypatch, (8, 0))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mixprec.fp8"):
        assert resolve_recipe_kernel("cuda", config, bf16) is False
        assert resolve_recipe_kernel("cuda", config, bf16) is False
    assert sum("sm_80" in r.getMessage() for r in caplog.records) == 1
    assert (
        resolve_recipe_kernel("cuda", Float8Config(recipe="rowwise", emulate=True), bf16) is False
    )
    # CPU: emulated by default (said once); emulate=False needs the CPU kernel.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mixprec.fp8"):
        assert resolve_recipe_kernel("cpu", config, bf16) is False
        assert resolve_recipe_kernel("cpu", config, fp32) is False
    assert sum("emulate=False" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setitem(fp8_kernels._CPU_KERNEL, "rowwise", False)
    with pytest.raises(RuntimeError, match="no rowwise CPU kernel"):
        resolve_recipe_kernel("cpu", Float8Config(recipe="rowwise", emulate=False), fp32)
    with pytest.raises(RuntimeError, match="no rowwise CPU kernel"):  # at conversion already
        convert_to_fp8(nn.Sequential(nn.Linear(16, 16)), config=kernel_config("rowwise"))
    assert convert_to_fp8(nn.Linear(16, 16), config=Float8Config(recipe="rowwise"))


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (8 significant bits), floored at the smallest normal."""
    tiny = torch.finfo(torch.bfloat16).tiny
    exponent = torch.floor(torch.log2(x.abs().float().clamp(min=tiny)))
    return torch.exp2(exponent - 7)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ROWWISE)
@pytest.mark.parametrize("gemm", GEMMS)
def test_cuda_kernel_within_one_bf16_ulp_of_emulation(recipe, gemm) -> None:
    """torch._scaled_mm's rowwise kernel vs the emulation at a Llama-like shape: the same
    quantized operands, fp32 sums in another order (and fast accumulation in the forward),
    each rounded once to bf16: within 1 bf16 ulp of the emulation on >= 99.9 % of elements."""
    if rowwise_kernel_problem("cuda", torch.bfloat16) is not None:
        pytest.skip(rowwise_kernel_problem("cuda", torch.bfloat16))
    g = torch.Generator(device="cuda").manual_seed(0)
    m, k, n = 512, 2048, 1024
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    dy = torch.randn(m, n, device="cuda", generator=g) * 1e-3
    a, b_t = {"forward": (x, w), "grad_input": (dy, w.t()), "grad_weight": (dy.t(), x.t())}[gemm]
    kernel = Float8Config(recipe=recipe, emulate=False)
    assert resolve_recipe_kernel("cuda", kernel, torch.bfloat16) is True
    got = recipe_gemm(gemm, a, b_t, kernel, torch.bfloat16).float()
    want = emulated_gemm(gemm, a, b_t, Float8Config(recipe=recipe, emulate=True), torch.bfloat16)
    within = (got - want.float()).abs() <= bf16_ulp(want)
    assert within.float().mean().item() >= 0.999, within.float().mean().item()
