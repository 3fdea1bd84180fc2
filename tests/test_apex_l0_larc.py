"""Apex's tests/L0/run_amp/test_larc.py, ported to mixprec on CPU.

Changes from Apex's file: `from mixprec.apex import amp` and `mixprec.apex.parallel.LARC`
for Apex's; tensors on CPU; the opt-level loop parametrizes. Apex's test only ran one step per
opt level; here that step's result is also compared with LARC run by hand in fp32 (the
same fp32 ops: exact; O2's first fp16 gradient overflows at Apex's initial scale and the
step is skipped, as in Apex; O3 steps fp16 weights without masters: rounded to fp16).
"""

from __future__ import annotations

import pytest
import torch
from tolerances import EXACT
from torch import nn
from torch.nn import Parameter

from mixprec.apex import amp
from mixprec.apex.parallel import LARC


class MyModel(nn.Module):
    def __init__(self, unique):
        super().__init__()
        self.weight0 = Parameter(unique + torch.arange(2, dtype=torch.float32))

    def forward(self, input):
        return (input * self.weight0).sum()


def larc_by_hand(weight, grad, lr, trust=0.02):
    rate = min(trust * weight.norm() / (grad.norm() + 1e-8) / lr, 1.0)
    return weight - lr * rate * grad


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_larc_mixed_precision(opt_level) -> None:
    x = torch.ones(2, dtype=torch.float32)
    model = MyModel(1)
    optimizer = LARC(torch.optim.SGD([{"params": model.parameters(), "lr": 0.25}], momentum=0.125))
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    optimizer.zero_grad()
    loss = model(x)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    # the reference: weight [1, 2], grad [1, 1] (= x), first SGD step (momentum buffer = grad)
    expected = larc_by_hand(torch.tensor([1.0, 2.0]), torch.ones(2), lr=0.25)
    if opt_level == "O2":  # the fp16 grad is 1 * 2**16 > 65504: inf, the step skips (as Apex's)
        expected = torch.tensor([1.0, 2.0])
    if opt_level == "O3":
        expected = expected.half()
    torch.testing.assert_close(model.weight0.detach(), expected.to(model.weight0.dtype), **EXACT)


def test_larc_weight_decay_and_zero_norms_follow_apexs_rule() -> None:
    weight = torch.tensor([3.0, 4.0], requires_grad=True)  # |w| = 5
    zero = torch.zeros(2, requires_grad=True)
    opt = LARC(torch.optim.SGD([weight, zero], lr=0.5, weight_decay=0.25), clip=False)
    (weight * torch.tensor([0.0, 2.0])).sum().backward()  # |g| = 2
    zero.grad = torch.ones(2)
    opt.step()
    rate = 0.02 * 5 / (2 + 5 * 0.25 + 1e-8)
    expected = torch.tensor([3.0, 4.0]) - 0.5 * rate * (
        torch.tensor([0.0, 2.0]) + 0.25 * weight.detach().new_tensor([3.0, 4.0])
    )
    torch.testing.assert_close(
        weight.detach(), expected, rtol=1e-6, atol=0
    )  # fp32 rounding of the rate
    torch.testing.assert_close(
        zero.detach(), -0.5 * torch.ones(2), **EXACT
    )  # |p| = 0: plain SGD, no decay
    assert opt.param_groups[0]["weight_decay"] == 0.25  # restored after the step
