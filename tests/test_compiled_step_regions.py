"""compile_step through mixprec's precision regions: traced into the graph, not a fallback.

A region (autocast with custom lists, fp32_region, fp16_guard, @fp32 functions, classes and
instances) is a generator of plain `with` statements that dynamo traces, so a forward that
enters one compiles whole. The caller's region ends at the loss: scaling, backward and the
update run in fp32 as in an eager loop. Compiled with backend="eager" (dynamo's trace only):
the traced ops are the eager ops, so compiled and uncompiled steps agree bit for bit.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from test_compiled_step import state_of
from tolerances import EXACT, fp32_rounding
from torch import nn

import mixprec
import mixprec.paddle as paddle_amp
from mixprec.core.autocast import autocast, fp16_guard, fp32, fp32_region
from mixprec.core.compiled_step import compile_step

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")


@fp32
def _fp32_gelu(h: torch.Tensor) -> torch.Tensor:
    return F.gelu(h)


@fp32
class _FP32Norm(nn.LayerNorm):
    pass


class RegionNet(nn.Module):
    """Enters every kind of region; each assert holds in eager and while dynamo traces (a
    failed assert fails the trace, which the tests see as a fallback warning)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.norm = _FP32Norm(16)
        self.mid = fp32(nn.Linear(16, 16))  # an instance: forward hooks enter the region
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        assert h.dtype == torch.bfloat16  # the face's autocast
        h = _fp32_gelu(h)
        assert h.dtype == torch.float32
        with autocast(torch.bfloat16, custom_white_list=["add"], custom_black_list=["softmax"]):
            h = h + h
            assert h.dtype == torch.bfloat16  # white-listed
            s = torch.softmax(h, dim=-1)
            assert s.dtype == torch.float32  # black-listed
            with fp32_region():
                t = h.float() @ self.mid.weight.float().T
                assert t.dtype == torch.float32
                with fp16_guard():
                    u = t @ self.mid.weight.float()
                    assert u.dtype == torch.bfloat16  # low again, in the enclosing dtype
        h = self.norm(h.float() + s + u.float() * 1e-2)
        assert h.dtype == torch.float32
        h = self.mid(h)
        assert h.dtype == torch.float32
        return self.b(h)


def region_step(compile: bool):
    torch.manual_seed(0)
    model = RegionNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    model, opt, crit = mixprec.convert_to_amp(model, opt, nn.MSELoss(), "bf16")
    step = compile_step(model, opt, crit, compile=compile, backend="eager")
    return model, opt, step


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(torch.get_default_device()).manual_seed(1)
    return [
        (torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)) for _ in range(n)
    ]


def test_regions_compile_whole_and_equal_the_uncompiled_step():
    model, opt, step = region_step(compile=False)
    for x, y in batches(3):
        step(x, y)
    reference = state_of(model, opt)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, opt, step = region_step(compile=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="mixprec.compile_step")  # no fallback
        for x, y in batches(3):
            step(x, y)
    assert step.compiled
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    for i, (a, b) in enumerate(zip(state_of(model, opt), reference, strict=True)):
        torch.testing.assert_close(a, b, **EXACT, msg=f"state tensor {i}")


def _plain_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# Paddle's white list may name the elementwise ops the optimizer update is made of.
AMBIENT = [
    lambda: paddle_amp.auto_cast(custom_white_list=["elementwise_mul", "add"], dtype="bfloat16"),
    contextlib.nullcontext,
    lambda: paddle_amp.auto_cast(custom_black_list=["gelu"], dtype="bfloat16"),
]


@pytest.mark.parametrize("compile", [False, True])
def test_a_callers_auto_cast_reaches_the_forward_and_stops_at_the_loss(compile):
    """The eager loop a Paddle user writes: auto_cast around forward and loss only. The step
    under the same auto_cast must equal it: the update never runs in the white list's bf16
    (which would round every new weight to bf16), and a changed region recompiles.

    backend="aot_eager": dynamo traces the caller's op-list mode into the graph, and the
    "eager" debug backend, which runs the graph's torch calls, meets the still-installed mode
    a second time (torch 2.13); aot_eager and inductor run aten ops, which it never sees."""
    model, opt = _plain_model()
    crit = nn.MSELoss()
    for ctx, (x, y) in zip(AMBIENT, batches(3), strict=True):
        with ctx():
            loss = crit(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    reference = state_of(model, opt)

    torch._dynamo.reset()
    model, opt = _plain_model()
    step = compile_step(
        model, opt, lambda out, y: crit(out.float(), y), compile=compile, backend="aot_eager"
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="mixprec.compile_step")
        for ctx, (x, y) in zip(AMBIENT, batches(3), strict=True):
            with ctx():
                step(x, y)
    assert step.compiled == compile
    # foreach SGD vs the functional update: ~1 fp32 ulp per step (test_compiled_step)
    for i, (a, b) in enumerate(zip(state_of(model, opt), reference, strict=True)):
        torch.testing.assert_close(a, b, **fp32_rounding(), msg=f"state tensor {i}")


class PrebuiltContext(nn.Module):
    """`with self.ctx:` on a region object built outside the graph: dynamo cannot enter a
    context manager it did not see created (torch 2.13), so the step falls back."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.ctx = fp32_region()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.ctx:
            return self.lin(x)


def test_a_region_object_built_outside_the_forward_falls_back_with_one_warning():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = PrebuiltContext()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = compile_step(model, opt, nn.MSELoss(), backend="eager")
    (x, y), (x2, y2) = batches(2)
    with pytest.warns(RuntimeWarning, match="did not compile.*context manager"):
        step(x, y[:, :4])
    assert not step.compiled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(x2, y2[:, :4])  # warned once
