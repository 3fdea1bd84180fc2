"""Colossal-AI's legacy AMP: the NAIVE amp_config keys `clip_grad_norm` and
`dynamic_grad_scale`, and `convert_to_naive_amp` / `convert_to_apex_amp`. The port of
ColossalAI's tests/test_legacy/test_amp/test_naive_fp16.py (NAIVE vs Apex O2, the model grads
compared after backward) is in tests/test_apex_model_grads.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mixprec import AMP_TYPE, convert_to_amp
from mixprec.amp import convert_to_apex_amp, convert_to_naive_amp
from mixprec.apex import amp as apex_amp

LOOSE = {"rtol": 1e-3, "atol": 1e-3}  # Colossal's assert_close_loose: fp16 vs fp16 paths


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Sequential(nn.Linear(4 * 4 * 4, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


# ---- the NAIVE amp_config keys Colossal's legacy initialize writes (clip_grad_norm) ----
def naive_step(amp_config: dict, data: torch.Tensor, *, scale_loss_by: float = 1.0):
    torch.manual_seed(0)
    model = Net()
    model, opt = convert_to_naive_amp(
        model, torch.optim.SGD(model.parameters(), lr=0.5), amp_config
    )
    opt.zero_grad()
    opt.backward(model(data).sum() * scale_loss_by)
    return model, opt


def test_naive_clip_grad_norm_clips_the_unscaled_grads_in_step() -> None:
    data = torch.randn(8, 3, 4, 4)
    _, ref = naive_step({"initial_scale": 128}, data)
    before = [p.detach().clone() for p in apex_amp.master_params(ref)]
    ref.unscale_grads()
    grads = [p.grad.clone() for p in apex_amp.master_params(ref)]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert norm > 0.5  # the clip below acts
    _, opt = naive_step({"initial_scale": 128, "clip_grad_norm": 0.5}, data)
    assert opt.max_norm == 0.5
    opt.step()
    coef = 0.5 / (norm + 1e-6)  # torch's clip_grad_norm_ coefficient
    for p, p0, g in zip(apex_amp.master_params(opt), before, grads, strict=True):
        # fp32 rounding: the clipped update against the same math written here (one rounding
        # of the coefficient and of each product differs at most)
        torch.testing.assert_close(p.detach(), p0 - 0.5 * coef * g, rtol=1e-5, atol=1e-6)


def test_naive_dynamic_grad_scale_false_keeps_a_constant_scale_and_still_skips() -> None:
    data = torch.randn(8, 3, 4, 4)
    model, opt = naive_step(
        {"dynamic_grad_scale": False, "initial_scale": 8}, data, scale_loss_by=float("inf")
    )
    assert not opt.scaler.dynamic and opt.scaler.scale == 8.0
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # inf grads: skipped, the constant scale stays
    assert opt.scaler.scale == 8.0
    for p, p0 in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, p0)


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"dynamic_grad_scale": False}, ValueError, "needs initial_scale"),
        (
            {"dynamic_grad_scale": False, "initial_scale": 8, "growth_interval": 10},
            ValueError,
            r"dynamic_grad_scale=False with \['growth_interval'\]",
        ),
        ({"dynamic_grad_scale": "no"}, TypeError, "dynamic_grad_scale"),
        (
            {"clip_grad_norm": -1.0},
            ValueError,
            "clip_grad_norm=-1.0 must be a real number, finite and >= 0",
        ),
        ({"clip_grad_norm": "1"}, TypeError, "clip_grad_norm"),
    ],
)
def test_bad_naive_keys_are_refused_naming_them(config, error, match) -> None:
    model = Net()
    with pytest.raises(error, match=match):
        convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=1.0), None, "naive", config)


def test_initialize_honours_fp16_clip_grad_norm_and_refuses_two_different_norms() -> None:
    from mixprec.engine import initialize

    def engine_for(config):
        model = Net()
        engine, *_ = initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), config=config)
        return engine

    naive = {"mode": AMP_TYPE.NAIVE, "clip_grad_norm": 1.0}
    assert engine_for({"fp16": naive}).optimizer.max_norm == 1.0
    # Colossal's legacy initialize writes the top-level clip_grad_norm into the NAIVE config
    assert engine_for({"fp16": naive, "clip_grad_norm": 1.0}).optimizer.max_norm == 1.0
    with pytest.raises(ValueError, match="Two clipping norms"):
        engine_for({"fp16": naive, "clip_grad_norm": 2.0})


def test_torch_fp16_matches_apex_o1_with_clipping_after_a_configless_launch() -> None:
    """ColossalAI's tests/test_legacy/test_amp/test_torch_fp16.py, ported: its world of one
    is `launch(rank=0, world_size=1, host, port)` without a config (Colossal's legacy launch in
    that test), gloo on CPU. Colossal's Apex grads were unscaled after backward (compared times
    the loss scale); mixprec's core keeps both optimizers' grads scaled until `unscale_grads()`
    or step, so both are compared after unscale_grads()."""
    from dist_utils import free_port

    from mixprec.amp import convert_to_torch_amp
    from mixprec.launch import destroy, launch

    launch(rank=0, world_size=1, host="127.0.0.1", port=free_port(), verbose=False)
    try:
        torch.manual_seed(0)
        torch_model = Net()
        apex_model = copy.deepcopy(torch_model)
        torch_opt = torch.optim.SGD(torch_model.parameters(), lr=1e-3)
        apex_opt = torch.optim.SGD(apex_model.parameters(), lr=1e-3)
        torch_model, torch_opt, _ = convert_to_torch_amp(
            torch_model, torch_opt, amp_config=dict(init_scale=128, enabled=True)
        )
        apex_model, apex_opt = convert_to_apex_amp(
            apex_model, apex_opt, dict(opt_level="O1", loss_scale=128)
        )
        data = torch.randn(8, 3, 4, 4)
        torch_out, apex_out = torch_model(data), apex_model(data)
        torch.testing.assert_close(torch_out, apex_out, **LOOSE)
        for p, q in zip(torch_model.parameters(), apex_model.parameters(), strict=True):
            torch.testing.assert_close(p, q, **LOOSE)
        torch_opt.backward(torch_out.sum())  # sum(): big gradients
        apex_opt.backward(apex_out.sum())
        for opt in (torch_opt, apex_opt):
            opt.unscale_grads()
        for p, q in zip(torch_model.parameters(), apex_model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **LOOSE)
        apex_opt.clip_grad_norm(model=apex_model, max_norm=1.0)
        torch_opt.clip_grad_norm(model=torch_model, max_norm=1.0)
        torch_opt.step()
        apex_opt.step()
        for p, q in zip(torch_model.parameters(), apex_model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **LOOSE)
            torch.testing.assert_close(p, q, **LOOSE)
    finally:
        destroy()
