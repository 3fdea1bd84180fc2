"""core.grad_transfer: the layout MixedPrecisionOptimizer reads once per step follows the
param_groups as they change between steps (a group added, a group's list replaced), and the
step over them equals a plain torch optimizer's, bit for bit (fp32 params, unit scale: the
same ops on the same tensors)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mixprec
from mixprec.core.grad_transfer import GradTransfer
from mixprec.core.skip_monitor import ScaleCollapseError


def _step(opt: torch.optim.Optimizer, model: nn.Module, x: torch.Tensor) -> None:
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_the_step_follows_param_groups_changed_between_steps() -> None:
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    plain = copy.deepcopy(ours)
    wrapped = mixprec.MixedPrecisionOptimizer(torch.optim.SGD(ours[0].parameters(), lr=0.1))
    reference = torch.optim.SGD(plain[0].parameters(), lr=0.1)
    x = torch.randn(8, 4)
    for opt, model in ((wrapped, ours), (reference, plain)):
        _step(opt, model, x)
        opt.add_param_group({"params": list(model[1].parameters())})  # a new group
        _step(opt, model, x)
        group = opt.param_groups[0]
        group["params"] = group["params"][:1]  # the group's list replaced: the bias leaves
        _step(opt, model, x)
    assert wrapped.transfer.layout().numel == sum(p.numel() for p in plain.parameters()) - 4
    for a, b in zip(ours.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_layout_is_pinned_only_inside_a_step() -> None:
    # A step reads the layout once; outside a step (after a raising one too) reads look again.
    model = nn.Linear(4, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = mixprec.MixedPrecisionOptimizer(inner, max_consecutive_skips=1)
    transfer: GradTransfer = opt.transfer
    model(torch.randn(2, 4)).sum().backward()
    model.bias.grad[0] = float("inf")
    with pytest.raises(ScaleCollapseError):
        opt.step()  # raises inside the step, after the layout was pinned
    assert transfer._pinned is None
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.param_groups[0]["params"] = [model.weight]
    assert not opt.step().skipped
    assert transfer._pinned is None and transfer.layout().held == (model.weight,)
