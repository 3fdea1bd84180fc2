"""The eager step reads GradTransfer.layout() a fixed, small number of times per iteration.

The layout (which held params are masters, where they live) changes only when the param groups
do; the step pins it once and its other reads take the pinned value. A regression here costs
every eager step Python time (the walk's key over the groups at each read), so the count of
layout() calls per backward + step + zero_grad is held to what the step needs: one to pin it,
one for the fused-step check, one for zero_grad (outside the step, where groups may change).
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec.core.grad_transfer import GradTransfer
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import ScalerConfig


def _counted(opt: MixedPrecisionOptimizer, calls: list[int]) -> None:
    layout = GradTransfer.layout

    def counting(transfer: GradTransfer):  # noqa: ANN202
        calls[0] += 1
        return layout(transfer)

    opt.transfer.layout = counting.__get__(opt.transfer)  # this instance only


def test_an_eager_step_reads_the_layout_three_times_whatever_the_model_size() -> None:
    for depth in (1, 4):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(depth)]).to(torch.bfloat16)
        opt = MixedPrecisionOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            loss_scale=ScalerConfig(init_scale=2.0**16),
        )
        calls = [0]
        _counted(opt, calls)
        x = torch.randn(8, 16, dtype=torch.bfloat16)
        for i in range(3):
            calls[0] = 0
            opt.backward(model(x).float().square().mean())
            opt.step()
            opt.zero_grad()
            # the first step also looks once for params that never get a grad (a warning)
            assert calls[0] == (4 if i == 0 else 3), (depth, i, calls[0])


def test_the_cached_layout_follows_a_changed_param_group() -> None:
    """The cache is keyed on the groups' lists and lengths: a param appended to a group, a group
    added, or a group's list replaced is seen at the next read."""
    model = nn.Linear(4, 4).to(torch.bfloat16)
    extra, other = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    opt = MixedPrecisionOptimizer(torch.optim.SGD([model.weight], lr=0.1))
    transfer = opt.transfer
    assert transfer.layout().numel == 16 and transfer.layout().own == ()
    opt.optim.param_groups[0]["params"].append(extra)
    assert transfer.layout().own == (extra,) and transfer.layout().numel == 19
    opt.add_param_group({"params": [other]})
    assert transfer.layout().own == (extra, other)
    opt.optim.param_groups[1]["params"] = [extra]
    assert transfer.layout().own == (extra, extra) and transfer.layout().numel == 22
