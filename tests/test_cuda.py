"""CUDA-only checks (all marked `cuda`; they skip without a GPU): host syncs per step, the real
float8 kernel, the compiled step under CUDA graphs, NCCL world-1 runs of DDP / FSDP2 / ZeRO.

Run with the rest of the CUDA suite: `python -m pytest --device cuda -m cuda`.
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
import warnings

import pytest
import torch
import torch._dynamo
from tolerances import EXACT, FP32_ROUNDING_CUDA
from torch import nn

import mixprec
from mixprec.core.compiled_step import compile_step
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import ScalerConfig

pytestmark = pytest.mark.cuda

CUDA = "cuda"


def mlp(width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width, 2 * width), nn.LayerNorm(2 * width), nn.ReLU(), nn.Linear(2 * width, 16)
    ).to(CUDA)


def batch(step: int, width: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(CUDA).manual_seed(step)
    return (
        torch.randn(32, width, generator=gen, device=CUDA),
        torch.randn(32, 16, generator=gen, device=CUDA),
    )


@contextlib.contextmanager
def count_syncs():
    """Warnings torch raises for each synchronizing CUDA call (set_sync_debug_mode('warn'))."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode(0)


def sync_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16"])
def test_compiled_step_makes_no_host_sync(mode: str) -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = mixprec.GradScaler(CUDA, init_scale=2.0**8) if mode == "fp16" else None
    step = compile_step(model, opt, nn.MSELoss(), scaler=scaler)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]
    ctx = (
        (lambda: torch.autocast(CUDA, dtype=dtype)) if dtype else (lambda: contextlib.nullcontext())
    )
    for i in range(3):  # compile and warm up outside the check
        with ctx():
            step(*batch(i))
    x, y = batch(3)
    x[0, 0] = float("inf")  # a skipped step takes no host branch either
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with ctx():
            step(x, y)
            step(*batch(4))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert step.compiled


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_eager_step_makes_at_most_one_host_sync(dtype: torch.dtype) -> None:
    model = mlp().to(dtype)
    cfg = ScalerConfig(init_scale=2.0**8, growth_interval=100)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=1e-2), loss_scale=cfg)
    loss_fn = nn.MSELoss()
    for i in range(3):  # the first steps read scale and trackers with the flag
        x, y = batch(i)
        opt.backward(loss_fn(model(x.to(dtype)).float(), y))
        opt.step()
        opt.zero_grad()
    x, y = batch(3)
    loss = loss_fn(model(x.to(dtype)).float(), y)
    torch.cuda.synchronize()
    with count_syncs() as caught:
        opt.backward(loss)
        opt.step()
    assert len(sync_warnings(caught)) <= 1, sync_warnings(caught)


def _scaled_mm_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _scaled_mm_capable(), reason="float8 GEMMs need sm_89+")
@pytest.mark.parametrize("fast_accum", [False, True])
def test_real_scaled_mm_matches_emulation(fast_accum: bool) -> None:
    from mixprec.fp8 import Float8Config, Float8Linear

    torch.manual_seed(0)
    base = nn.Linear(256, 128).to(CUDA)
    real = Float8Linear.from_float(
        copy.deepcopy(base), Float8Config(emulate=False, use_fast_accum_forward=fast_accum)
    )
    emulated = Float8Linear.from_float(copy.deepcopy(base), Float8Config(emulate=True))
    x = torch.randn(64, 256, device=CUDA)
    got, want = real(x).float(), emulated(x).float()
    ref = base(x).float()
    if not fast_accum:
        # the same exact fp8 products summed in fp32: summation order only
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # fast accumulation trades accuracy for speed: still far inside fp8's own error vs fp32
    snr = 20 * torch.log10(ref.norm() / (ref - got).norm()).item()
    assert snr > 25.0, snr


def test_compiled_step_under_cuda_graphs_equals_the_eager_step() -> None:
    model, twin = mlp(), mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-3)
    torch._dynamo.utils.counters.clear()
    graphed = compile_step(model, opt, nn.MSELoss(), mode="reduce-overhead")
    eager = compile_step(twin, twin_opt, nn.MSELoss(), compile=False)
    for i in range(5):
        x, y = batch(i)
        if i == 3:
            x[0, 0] = float("nan")  # a skipped step inside the graph replays too
        before = [p.detach().clone() for p in model.parameters()]
        graphed(x.clone(), y.clone())
        eager(x, y)
        if i == 3:
            for p, b in zip(model.parameters(), before, strict=True):
                torch.testing.assert_close(p, b, **EXACT)
    assert graphed.compiled
    # inductor counts each graph it ran without CUDA graphs (a mutated input, a CPU tensor...)
    assert not torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, **FP32_ROUNDING_CUDA)


@contextlib.contextmanager
def nccl_world_of_one():
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "nccl", init_method=f"file://{os.path.join(tmp, 'rdzv')}", rank=0, world_size=1
        )
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("plugin", ["ddp", "fsdp2", "zero1", "zero2"])
def test_nccl_world_of_one_equals_the_single_process_step(plugin: str) -> None:
    from mixprec.booster import Booster
    from mixprec.booster.plugin import LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin

    make = {
        "ddp": lambda: TorchDDPPlugin(),
        "fsdp2": lambda: TorchFSDPPlugin(),
        "zero1": lambda: LowLevelZeroPlugin(stage=1, precision="bf16"),
        "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="bf16"),
    }
    with nccl_world_of_one():
        model, reference = mlp(), mlp()
        # ZeRO's plugin brings its own precision (the Booster's must stay unset)
        precision = {} if plugin.startswith("zero") else {"mixed_precision": "bf16"}
        booster = Booster(device=CUDA, plugin=make[plugin](), **precision)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        model, opt, crit, *_ = booster.boost(model, opt, nn.MSELoss())
        ref_booster = Booster(device=CUDA, mixed_precision="bf16")
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
        ref, ref_opt, ref_crit, *_ = ref_booster.boost(reference, ref_opt, nn.MSELoss())
        for i in range(3):
            x, y = batch(i)
            booster.backward(crit(model(x), y), opt)
            ref_booster.backward(ref_crit(ref(x), y), ref_opt)
            assert not opt.step().skipped and not ref_opt.step().skipped
            opt.zero_grad()
            ref_opt.zero_grad()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            # FSDP2 gathers bf16 params and reduces bf16 grads, ZeRO's bf16 keeps bf16 params:
            # within a bf16 rounding (2**-8) of the autocast reference's weights, 3 steps
            torch.testing.assert_close(full.float(), q.float(), rtol=2**-7, atol=2**-10)
