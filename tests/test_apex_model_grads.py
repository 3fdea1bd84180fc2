"""Apex with fp32 master weights keeps the model's low-precision gradients, as Apex does.

Apex's post-backward (NVIDIA/apex apex/amp/_process_optimizer.py,
post_backward_with_master_weights, at e13873d, the last tree with apex/amp) copies each fp16
model grad into its fp32 master's grad and unscales it there; the fp16 model grad stays as
backward left it, still multiplied by the loss scale. Its patched zero_grad zeroes the model
grads in place and drops the masters'. The step applies the masters' grads.

Also here: a port of Colossal-AI's tests/test_legacy/test_amp/test_naive_fp16.py (hpcaitech/
ColossalAI at 42d7b299c), NAIVE against Apex O2, comparing the model params' (scaled) grads
after backward as Colossal does. The port's changes, each for its reason: mixprec.amp for
colossalai.legacy.amp; CPU, one process (Colossal spawned one rank); Colossal's model-zoo
entries are written here from their definitions (repeated_computed_layers, nested_model), and
resnet18 (torchvision is not installed) is replaced by a small residual conv net with batchnorm;
`assert_close_loose` is Colossal's rtol=1e-3, atol=1e-3; batchnorm stays fp32 on both sides
(Colossal halved it on both; mixprec's NAIVE keeps norms fp32), so the fp32 batchnorm params'
grads are compared as Apex leaves them, unscaled in place, and the final params as fp32.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from mixprec import AMP_TYPE, convert_to_amp
from mixprec.amp import convert_to_apex_amp, convert_to_naive_amp
from mixprec.apex import FP16_Optimizer, amp
from mixprec.core import fused_step

LOOSE = {"rtol": 1e-3, "atol": 1e-3}  # Colossal's assert_close_loose: two fp16 paths
EXACT = {"rtol": 0, "atol": 0}
# Colossal passed keep_batchnorm_fp32=False, and its NAIVE halved batchnorm too; mixprec's NAIVE
# keeps norm layers fp32, so Apex keeps them fp32 here as well (with fp16 batchnorm on one side
# only, the grads before a batchnorm, which sum() makes cancel to rounding noise, differ).
KEEP_BN = True
SCALE = 128.0  # a power of two: unscaling is exact, so masters == model grads / SCALE bit for bit


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def sgd(model: nn.Module, **kwargs) -> tuple[nn.Module, torch.optim.SGD]:
    return model, torch.optim.SGD(model.parameters(), lr=0.5, **kwargs)


def scaled_reference_grads(model: nn.Module, x: torch.Tensor, scale: float) -> list[torch.Tensor]:
    """The grads of loss * scale through the cast model, by torch.autograd.grad (no .grad)."""
    loss = model(x).float().sum() * scale
    return list(torch.autograd.grad(loss, list(model.parameters())))


@pytest.mark.parametrize(
    "overrides",
    [
        {"opt_level": "O2", "loss_scale": SCALE},
        {"opt_level": "O2", "max_loss_scale": SCALE},  # dynamic: starts at min(2**16, max)
        {"opt_level": "O3", "master_weights": True, "loss_scale": SCALE},
    ],
    ids=["O2-static", "O2-dynamic", "O3-master_weights"],
)
def test_model_grads_after_scale_loss_are_the_scaled_grads_and_masters_the_unscaled(overrides):
    model, opt = amp.initialize(*sgd(mlp()), verbosity=0, **overrides)
    x = torch.randn(3, 4)
    expected = scaled_reference_grads(model, x, SCALE)
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    params = list(model.parameters())
    assert all(p.dtype == torch.float16 for p in params)
    for p, ref in zip(params, expected, strict=True):
        assert p.grad is not None, "Apex keeps the model grads after scale_loss"
        torch.testing.assert_close(p.grad, ref, **EXACT)  # still scaled, in fp16
    for master, ref in zip(amp.master_params(opt), expected, strict=True):
        assert master.dtype == torch.float32
        torch.testing.assert_close(master.grad, ref.float() / SCALE, **EXACT)

    kept = [p.grad for p in params]
    opt.step()  # the masters' grads are applied; the model grads stay, the masters' go
    assert all(p.grad is g for p, g in zip(params, kept, strict=True))
    assert all(m.grad is None for m in amp.master_params(opt))
    opt.zero_grad()  # Apex's patched zero_grad: model grads zeroed in place
    for p, g in zip(params, kept, strict=True):
        assert p.grad is g and not g.any()
    opt.zero_grad(set_to_none=True)  # torch's keyword keeps torch's meaning
    assert all(p.grad is None for p in params)


def test_a_skipped_step_changes_nothing_and_the_model_keeps_its_overflowed_grads():
    model, opt = amp.initialize(
        *sgd(mlp(), momentum=0.9), opt_level="O2",
        max_loss_scale=SCALE, verbosity=0,
    )  # fmt: skip
    x = torch.randn(3, 4)
    for _ in range(2):  # momentum state exists before the overflow
        opt.zero_grad()
        with amp.scale_loss(model(x).float().sum(), opt) as scaled:
            scaled.backward()
        assert not opt.step().skipped
    before = (
        [p.detach().clone() for p in model.parameters()],
        [m.detach().clone() for m in amp.master_params(opt)],
        [s["momentum_buffer"].clone() for s in opt.state.values()],
    )
    opt.zero_grad()
    with amp.scale_loss(model(x).float().sum() * float("inf"), opt) as scaled:
        scaled.backward()
    assert any(not torch.isfinite(p.grad).all() for p in model.parameters())
    assert opt.step().skipped and opt.loss_scale == SCALE / 2
    after = (
        list(model.parameters()),
        list(amp.master_params(opt)),
        [s["momentum_buffer"] for s in opt.state.values()],
    )
    for old, new in zip(before, after, strict=True):
        for a, b in zip(old, new, strict=True):
            torch.testing.assert_close(a, b, **EXACT)


def test_colossal_apex_o2_backward_keeps_the_scaled_model_grads():
    model, opt, _ = convert_to_amp(
        *sgd(mlp()), None, AMP_TYPE.APEX,
        {"opt_level": "O2", "loss_scale": SCALE},
    )  # fmt: skip
    x = torch.randn(3, 4)
    expected = scaled_reference_grads(model, x, SCALE)
    opt.backward(model(x).float().sum())
    for p, ref in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, ref, **EXACT)
    assert not opt.step().skipped


def test_fp16_optimizer_keeps_the_scaled_model_grads_too():
    model = mlp().half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.5), static_loss_scale=SCALE)
    x = torch.randn(3, 4).half()
    expected = scaled_reference_grads(model, x, SCALE)
    opt.backward(model(x).float().sum())
    for p, ref in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, ref, **EXACT)


def test_an_edit_of_the_model_grads_after_backward_is_not_applied_and_is_warned(caplog):
    model, opt = amp.initialize(*sgd(mlp()), opt_level="O2", loss_scale=SCALE)
    ref_opt_model, ref_opt = amp.initialize(
        *sgd(mlp()), opt_level="O2", loss_scale=SCALE, verbosity=0
    )
    x = torch.randn(3, 4)
    for m, o in ((model, opt), (ref_opt_model, ref_opt)):
        with amp.scale_loss(m(x).float().sum(), o) as scaled:
            scaled.backward()
    # torch's clip on the model params clips the scaled fp16 grads, which no step applies
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        assert not opt.step().skipped
    assert "the step applies the masters' gradients" in caplog.text
    ref_opt.step()
    for a, b in zip(model.parameters(), ref_opt_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, **EXACT)  # as in Apex: the edit changed nothing


def test_a_plain_backward_after_zero_grad_is_refused_not_dropped():
    model, opt = amp.initialize(*sgd(mlp()), opt_level="O2", loss_scale=SCALE)
    x = torch.randn(3, 4)
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    model.zero_grad()  # set_to_none: the kept grads go
    model(x).float().sum().backward()  # unscaled, and no scale_loss: never reaches the masters
    with pytest.raises(RuntimeError, match="never reached the fp32 masters"):
        opt.step()


def test_a_second_step_without_backward_applies_no_stale_master_grads():
    model, opt = amp.initialize(*sgd(mlp()), opt_level="O2", loss_scale=SCALE)
    x = torch.randn(3, 4)
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # Apex: the master grads were dropped by the first step: nothing to apply
    for a, b in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(a, b, **EXACT)


def test_apex_grads_are_not_unscaled_twice_by_the_fused_step(monkeypatch):
    """The fused step unscales the grads it reads; Apex's were unscaled at scale_loss's exit."""
    monkeypatch.setattr(fused_step, "AUTO_MIN_ELEMENTS", 1)  # fuse even this tiny model's step
    model, opt = amp.initialize(*sgd(mlp()), opt_level="O1", loss_scale=SCALE, verbosity=0)
    x = torch.randn(3, 4)
    grads = scaled_reference_grads(model, x, SCALE)
    # lr 0.5 and SCALE are powers of two: p - 0.5 * (g / SCALE) rounds once, as SGD's step
    expected = [
        p.detach() - 0.5 * (g / SCALE) for p, g in zip(model.parameters(), grads, strict=True)
    ]
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    for p, ref in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p, ref, **EXACT)


# ----- the port of Colossal-AI's test_naive_fp16.py -----
class NetWithRepeatedlyComputedLayers(nn.Module):
    """Colossal's custom_repeated_computed_layers: fc1 and fc2 run twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.fc1, self.fc2, self.fc1, self.fc2, self.fc3):
            x = layer(x)
        return x


class NestedNet(nn.Module):
    """Colossal's custom_nested_model: a submodule that borrows fc1's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 5)
        self.sub_bias = nn.Parameter(torch.zeros(5))
        self.fc2 = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.linear(self.fc1(x), self.fc1.weight, self.sub_bias)
        return self.fc2(self.fc1(x))


class SmallResNet(nn.Module):
    """Stands in for torchvision's resnet18: conv, batchnorm, a residual block, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
        )  # fmt: skip
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(x + self.block(x))
        return self.head(x.mean(dim=(2, 3)))


MODELS = {
    "custom_repeated_computed_layers": (NetWithRepeatedlyComputedLayers, lambda: torch.rand(16, 5)),
    "custom_nested_model": (NestedNet, lambda: torch.rand(16, 5)),
    "resnet_stand_in": (SmallResNet, lambda: torch.rand(4, 3, 8, 8)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_colossal_naive_fp16_matches_apex_o2(name: str) -> None:
    builder, data_gen = MODELS[name]
    torch.manual_seed(0)
    naive_model = builder()
    apex_model = copy.deepcopy(naive_model)
    # SGD: the correctness of gradient clipping can't be tested with Adam (Colossal's reason)
    naive_opt = torch.optim.SGD(naive_model.parameters(), lr=1e-3)
    apex_opt = torch.optim.SGD(apex_model.parameters(), lr=1e-3)
    naive_model, naive_opt = convert_to_naive_amp(
        naive_model, naive_opt, dict(initial_scale=128, clip_grad_norm=1.0)
    )
    apex_model, apex_opt = convert_to_apex_amp(
        apex_model, apex_opt, dict(opt_level="O2", loss_scale=128, keep_batchnorm_fp32=KEEP_BN)
    )
    data = data_gen()
    naive_out, apex_out = naive_model(data), apex_model(data)
    torch.testing.assert_close(naive_out.float(), apex_out.float(), **LOOSE)
    naive_opt.backward(naive_out.sum())  # sum(): big gradients
    apex_opt.backward(apex_out.sum())
    for naive_param, apex_param in zip(
        naive_model.parameters(), apex_model.parameters(), strict=True
    ):
        assert apex_param.grad is not None, "Apex O2 keeps the model grads (scaled)"
        naive_grad = naive_param.grad.float()
        if apex_param.dtype == torch.float32:  # Apex unscales an fp32 param's grad in place
            naive_grad = naive_grad / 128
        torch.testing.assert_close(naive_grad, apex_param.grad.float(), **LOOSE)
    apex_opt.clip_grad_norm(model=apex_model, max_norm=1.0)
    naive_opt.step()
    apex_opt.step()
    for naive_param, apex_param in zip(
        naive_model.parameters(), apex_model.parameters(), strict=True
    ):
        torch.testing.assert_close(naive_param.float(), apex_param.float(), **LOOSE)


@pytest.mark.parametrize("between_losses", [False, True], ids=["before-step", "between-losses"])
def test_a_nan_written_after_scale_loss_is_checked_again_and_skips(between_losses: bool):
    """A grad the step applies, written after its check at scale_loss's exit (before the step,
    or before the next loss's backward adds to it), is checked again: the step skips."""
    model, opt = amp.initialize(
        *sgd(mlp(), momentum=0.9), opt_level="O2", loss_scale=SCALE, verbosity=0
    )
    x = torch.randn(3, 4)
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    assert not opt.step().skipped  # momentum state exists
    opt.zero_grad()
    before = [t.detach().clone() for t in (*model.parameters(), *amp.master_params(opt))]
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    next(iter(amp.master_params(opt))).grad.view(-1)[0] = float("nan")  # after the check
    if between_losses:
        with amp.scale_loss(model(x).float().sum(), opt) as scaled:
            scaled.backward()  # adds to the nan: the sum is checked before the step
    assert opt.step().skipped
    after = [*model.parameters(), *amp.master_params(opt)]
    for a, b in zip(after, before, strict=True):
        torch.testing.assert_close(a, b, **EXACT)
