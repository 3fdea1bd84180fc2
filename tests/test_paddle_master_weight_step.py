"""Paddle's master-weight optimizer (decorate O2) steps its fp32 masters whatever the step's size.

Its hooks move each low-precision grad into the master's fp32 grad during backward, so at the
step the lp grads are gone: a step that reads them (the fused pass, chosen on CPU once the
own fp32 grads reach fused_step.AUTO_MIN_ELEMENTS) must not run, or the masters stay put.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec.core.fused_step as fused
from mixprec.paddle.dygraph import MasterWeightOptimizer


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    lp = nn.Linear(4, 4).half()
    hp = nn.Linear(4, 4)  # an fp32 layer kept out of the cast (its params are their own masters)
    return lp, hp


@pytest.mark.parametrize("outside_check", [False, True], ids=["own-check", "scaler-check"])
def test_masters_step_past_the_fused_size(
    monkeypatch: pytest.MonkeyPatch, outside_check: bool
) -> None:
    # the CPU auto-fuse threshold, lowered so that this small model's fp32 grads reach it
    monkeypatch.setattr(fused, "AUTO_MIN_ELEMENTS", 8)
    lp, hp = _models()
    ref_lp = nn.Linear(4, 4)
    ref_lp.load_state_dict({k: v.float() for k, v in lp.state_dict().items()})
    ref_hp = nn.Linear(4, 4)
    ref_hp.load_state_dict(hp.state_dict())
    opt = MasterWeightOptimizer(torch.optim.SGD([*lp.parameters(), *hp.parameters()], lr=0.5))
    x = torch.randn(2, 4)
    (lp(x.half()).float().sum() + hp(x).sum()).backward()
    # the reference: plain fp32 SGD on the same gradients (the lp grads widened exactly)
    master_grads = [m.grad.clone() for m in opt.hp_masters]
    for ref, g in zip(ref_lp.parameters(), master_grads, strict=True):
        ref.grad = g
    for ref, p in zip(ref_hp.parameters(), hp.parameters(), strict=True):
        ref.grad = p.grad.clone()
    torch.optim.SGD([*ref_lp.parameters(), *ref_hp.parameters()], lr=0.5).step()
    if outside_check:  # Paddle's GradScaler hands in its (clean) check
        opt.use_checked_grads(torch.zeros(1))
    result = opt.step()
    assert not result.skipped
    # exact: SGD in fp32 on the same fp32 grads, then the masters rounded back to fp16
    for master, ref in zip(opt.hp_masters, ref_lp.parameters(), strict=True):
        assert torch.equal(master, ref.detach())
    for p, ref in zip(lp.parameters(), ref_lp.parameters(), strict=True):
        assert torch.equal(p, ref.detach().half())
    for p, ref in zip(hp.parameters(), ref_hp.parameters(), strict=True):
        assert torch.equal(p, ref)


def test_an_outside_check_skips_the_step() -> None:
    """The scaler's overflow flag is the step's: a flagged step changes nothing, and the flag
    does not outlive its step."""
    lp, hp = _models()
    opt = MasterWeightOptimizer(torch.optim.SGD([*lp.parameters(), *hp.parameters()], lr=0.5))
    x = torch.randn(2, 4)
    (lp(x.half()).float().sum() + hp(x).sum()).backward()
    before = [p.detach().clone() for p in (*lp.parameters(), *hp.parameters(), *opt.hp_masters)]
    opt.use_checked_grads(torch.ones(1))
    assert opt.step().skipped
    after = [p.detach() for p in (*lp.parameters(), *hp.parameters(), *opt.hp_masters)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert opt.step_flags.found_inf is None
    assert not opt.step().skipped  # the same finite grads, checked by the optimizer itself
