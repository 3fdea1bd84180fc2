"""The torch optimizer a user kept (or Lightning holds) clears the wrapper's gradients too.

The core keeps a step's gradients in .grad until zero_grad (torch's g1 + g2 contract); the
inner optimizer's own zero_grad only reached param_groups (the fp32 masters), so the model's
fp16 grads, a skip's inf among them, added into every later step.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from conftest import tiny_mlp
from torch import nn

import mixprec
from mixprec.core.prepare import prepare_model, prepare_optimizer


def test_the_inner_optimizers_zero_grad_clears_the_models_low_precision_grads() -> None:
    policy = mixprec.to_policy("fp16_naive")
    # a scale fp16 grads hold (NAIVE starts at 2**32, which overflows and backs off first)
    policy = replace(policy, loss_scale=replace(policy.loss_scale, init_scale=16.0))
    torch.manual_seed(0)
    model = prepare_model(tiny_mlp(), policy)
    raw = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = prepare_optimizer(raw, policy)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    opt.backward(nn.functional.mse_loss(model(x).float(), y))
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    assert opt.step().skipped
    raw.zero_grad()  # the user's reference, not the wrapper
    assert all(p.grad is None for p in model.parameters())
    opt.backward(nn.functional.mse_loss(model(x).float(), y))
    assert not opt.step().skipped  # the inf stayed with the skipped step
