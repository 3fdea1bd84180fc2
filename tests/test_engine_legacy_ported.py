"""Colossal-AI's tests/test_legacy/test_engine/test_gradient_accumluation.py, ported, and the
legacy Engine's optimizer API (Colossal's OptimizerWrapper methods, Engine.backward_by_grad).

The port's changes, each for a stated reason: `mixprec` for `colossalai`; 2 gloo processes on
CPU (tests/dist_utils.spawn, which also stands for Colossal's `launch(config=...)`: the config
goes to initialize) instead of 4 nccl ranks on GPUs; CIFAR10 and resnet18 (a download and
~11M parameters) become 64 random 3x8x8 images in a DataLoader and a small conv net with
BatchNorm; `retain_grad()` on a leaf parameter (a no-op) is dropped. Colossal's CONFIG
(gradient_accumulation=4, clip_grad_norm=1.0, fp32), its Adam(lr=1e-3), batch size 2 and its
checks (the gradient grows over the window; the weights move only on the window's last
micro-batch) are kept; the port also checks every rank ends with the same weights.
test_engine.py of the same folder is ported in test_colossal_legacy_engine.py.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import assert_same_on_every_rank, spawn
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mixprec import AMP_TYPE
from mixprec.engine import initialize
from mixprec.mixed_precision import OptimizerWrapperAPI

BATCH_SIZE = 2
NUM_CLASSES = 10
CONFIG = dict(
    parallel=dict(pipeline=dict(size=1), tensor=dict(size=1, mode=None)),
    clip_grad_norm=1.0,
    gradient_accumulation=4,
)


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, NUM_CLASSES),
    )


def _run_no_pipeline(rank: int, world: int) -> None:
    torch.manual_seed(0)  # the same initial weights on every rank, as Colossal's seed gives
    model = small_cnn()
    gen = torch.Generator().manual_seed(1)
    dataset = TensorDataset(
        torch.randn(64, 3, 8, 8, generator=gen), torch.randint(0, NUM_CLASSES, (64,), generator=gen)
    )
    train_dataloader = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    engine, train_dataloader, *_ = initialize(
        model=model,
        optimizer=optimizer,
        criterion=nn.CrossEntropyLoss(),
        train_dataloader=train_dataloader,
        config=CONFIG,
    )
    param_track, grad_track = [], []
    engine.train()
    for step, (img, label) in enumerate(train_dataloader, start=1):
        engine.zero_grad()
        output = engine(img)
        loss = engine.criterion(output, label)
        engine.backward(loss)
        engine.step()
        param_track.append(next(model.parameters())[0].detach().clone())
        grad_track.append(next(model.parameters()).grad[0].clone())
        if step == CONFIG["gradient_accumulation"]:
            break
    assert not torch.all(grad_track[0] == grad_track[-1]), "grads should differ over the window"
    assert torch.all(param_track[0] == param_track[1]), "params should not move mid-window"
    assert not torch.all(param_track[0] == param_track[-1]), "params move at the window's end"
    assert_same_on_every_rank(
        [p.detach() for p in model.parameters()], "weights after one accumulated step"
    )


@pytest.mark.slow
def test_gradient_accumulation_on_two_ranks() -> None:
    spawn(_run_no_pipeline, 2)


# ----- the Engine's optimizer API (Colossal's OptimizerWrapper) -----
def _engine(fp16, seed: int = 0, **config):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    cfg = dict(config)
    if fp16 is not None:
        cfg["fp16"] = dict(mode=fp16)
    engine, *_ = initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), config=cfg
    )
    return engine, model


MODES = [None, AMP_TYPE.TORCH, AMP_TYPE.NAIVE]


@pytest.mark.parametrize("fp16", MODES, ids=["fp32", "torch", "naive"])
def test_engine_optimizer_has_colossals_wrapper_methods(fp16) -> None:
    engine, _ = _engine(fp16)
    assert isinstance(engine.optimizer, OptimizerWrapperAPI)
    for name in (
        "clip_grad_by_norm",
        "clip_grad_by_value",
        "get_grad_norm",
        "backward_by_grad",
        "scale_loss",
        "unscale_grad",
        "unwrap",
    ):
        assert callable(getattr(engine.optimizer, name)), name
    assert isinstance(engine.optimizer.unwrap(), torch.optim.SGD)


@pytest.mark.parametrize("fp16", MODES, ids=["fp32", "torch", "naive"])
def test_engine_backward_by_grad_equals_backward_exactly(fp16) -> None:
    # Colossal's contract: backward_by_grad(out, d(scaled loss)/d out) is backward(loss)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    by_loss, model_a = _engine(fp16)
    by_grad, model_b = _engine(fp16)
    for _ in range(2):
        by_loss.zero_grad()
        by_loss.backward(by_loss.criterion(by_loss(x), y))
        by_loss.step()
        by_grad.zero_grad()
        out = by_grad(x)
        scaled = by_grad.optimizer.scale_loss(by_grad.criterion(out, y))
        (grad_out,) = torch.autograd.grad(scaled, out, retain_graph=True)
        by_grad.backward_by_grad(out, grad_out)
        by_grad.step()
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_engine_clip_grad_by_norm_reports_the_unscaled_norm() -> None:
    engine, model = _engine(AMP_TYPE.TORCH)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x), y))
    assert engine.optimizer.get_grad_norm() is None  # no norm computed yet
    engine.optimizer.clip_grad_by_norm(1e9)  # unscales the grads; a ceiling that clips nothing
    # the reference: the plain 2-norm of the unscaled grads the optimizer now holds (the loss
    # scale, 2**16, must not be in it); default fp32 tolerances: only the summation order differs
    grads = [p.grad for p in engine.optimizer.parameters if p.grad is not None]
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    torch.testing.assert_close(torch.as_tensor(engine.optimizer.get_grad_norm()), want)
