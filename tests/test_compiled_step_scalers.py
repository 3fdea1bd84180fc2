"""compile_step follows its scaler's own state, as the eager loop does: the scale each step
runs under and how it moves come from the scaler (one protocol: active_scale + advance_)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec.paddle as paddle_amp
from mixprec.core.compiled_step import compile_step

pytestmark = pytest.mark.usefixtures("device")

STEPS = 6
OVERFLOW_AT = 3  # an inf input on this step: every scaler that scales backs off


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(torch.get_default_device()).manual_seed(step)
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
    if step == OVERFLOW_AT:
        x[0, 0] = float("inf")
    return x, y


def paddle_run(dtype: str, compiled: bool, backend: str | None = None) -> tuple[list, list]:
    """A Paddle dygraph O1 loop (auto_cast around the forward, GradScaler): the scale after
    every step and the final params, eagerly or through compile_step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = paddle_amp.GradScaler(
        device=torch.get_default_device().type, init_loss_scaling=1024, incr_every_n_steps=2
    )
    crit = nn.MSELoss()
    step = None
    if compiled:
        options = {"compile": False} if backend is None else {"backend": backend}
        step = compile_step(model, opt, crit, scaler=scaler, **options)
    scales = []
    for i in range(STEPS):
        x, y = batch(i)
        if dtype == "bfloat16" and i == OVERFLOW_AT:
            continue  # the switched-off scaler steps a nan eagerly (Paddle's too): not compared
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the bf16 switch-off's own warning
            if step is not None:
                with paddle_amp.auto_cast(dtype=dtype):
                    step(x, y)
            else:
                with paddle_amp.auto_cast(dtype=dtype):
                    loss = crit(model(x), y)
                scaled = scaler.scale(loss)
                scaled.backward()
                scaler.minimize(opt, scaled)
                opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_paddle_scaler_trajectory_compiled_equals_eager(dtype: str) -> None:
    """bf16: Paddle's scaler switches itself off at its first use (scale 1.0 throughout) in the
    compiled loop as in the eager one; fp16: the scale grows every 2 clean steps and backs off
    on the overflow, step by step the same."""
    eager_scales, eager_params = paddle_run(dtype, compiled=False)
    scales, params = paddle_run(dtype, compiled=True)
    if dtype == "bfloat16":
        assert eager_scales == [1.0] * len(eager_scales)
    else:
        assert eager_scales == [1024.0, 2048.0, 2048.0, 1024.0, 1024.0, 2048.0]
    assert scales == eager_scales
    for p, ref in zip(params, eager_params, strict=True):
        # autocast's fp16/bf16 forward: the functional step and the eager loop run the same
        # ops; only the update's fusion order differs (fp32 rounding of the lr * grad product)
        torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-6)


def test_a_scaler_switched_off_mid_run_is_followed_by_the_compiled_graph() -> None:
    """Through dynamo (backend='eager'): the graph built while the scaler scaled is left for
    one that runs unscaled once Paddle's scaler switched itself off under bf16."""
    eager_scales, eager_params = paddle_run("bfloat16", compiled=False)
    scales, params = paddle_run("bfloat16", compiled=True, backend="eager")
    assert scales == eager_scales
    for p, ref in zip(params, eager_params, strict=True):
        torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-6)
