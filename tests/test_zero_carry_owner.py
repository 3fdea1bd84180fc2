"""ZeRO's g1 + g2 carry runs through the core's one carry (GradTransfer.hand / give_back).

torch's contract: a step leaves its gradients in .grad, so backward + step twice without
zero_grad() steps on g1 + g2 the second time. Under ZeRO each owner steps on its share of the
group's mean; the reducer (zero_buckets.GradBuckets) hands that share to the core's carry as data
(Handed: the params, the grads, the world size the next reduction divides by, DTensor shaping),
and the carry gives it back into .grad after the update. These tests run 2 gloo ranks with a
loss scale other than 1 (fp16), where the carried grad must come back at the next scale.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mixprec.core.grad_transfer import Handed
from mixprec.core.policy import ScalerConfig
from mixprec.parallel.zero import ZeroOptimizer
from mixprec.parallel.zero_buckets import GradBuckets

WIDTH = 8
SCALE = ScalerConfig(init_scale=2.0**10, growth_interval=1000)  # no growth within these steps


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)


def _pair(stage: int) -> tuple[nn.Module, ZeroOptimizer, nn.Module, torch.optim.Optimizer]:
    """An fp16 model under ZeRO and an fp32 DDP twin under torch's SGD, from the same weights."""
    model = _model()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    model = model.half()
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=stage, loss_scale=SCALE)
    return model, opt, ref, torch.optim.SGD(ref.parameters(), lr=0.1)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x.to(next(model.parameters()).dtype))
    return nn.functional.mse_loss(out.float(), y)


# fp16 forward and backward round the grads (~2**-11 relative), x lr 0.1 over 4 steps of grads
# below 1; a step on g2 alone instead of g1 + g2 moves a weight by lr x |g1| ~ 1e-2.
TOL = 2e-3


def _carry_worker(rank: int, world: int) -> None:
    x, y = _data(4 * world)
    mine = slice(rank * 4, (rank + 1) * 4)
    for stage in (1, 2):
        model, opt, ref, ref_opt = _pair(stage)
        for round_ in range(4):
            opt.backward(_loss(model, x[mine], y[mine]))
            _loss(ref, x[mine], y[mine]).backward()
            assert not opt.step().skipped
            ref_opt.step()
            # No zero_grad() between the rounds: every step runs on the sum so far. The owner
            # holds its stepped share at the next scale times the world size (the next
            # reduction divides the ranks' sum by it); no rank holds another owner's grad.
            scale = opt.scaler.scale_tensor
            params = zip(model.parameters(), opt.hp_params(), ref.parameters(), strict=True)
            for i, (p, hp, q) in enumerate(params):
                if opt.owns(i):
                    master = next(
                        m for lp, m in zip(opt.lp_params, opt.hp_masters, strict=True) if lp is p
                    )
                    want = (master.grad * (scale * world)).to(torch.float16)
                    assert p.grad is not None and torch.equal(p.grad, want), (stage, round_, i)
                else:
                    assert p.grad is None, (stage, round_, i)
                what = f"stage {stage} round {round_} param {i}"
                torch.testing.assert_close(hp, q.detach(), rtol=0, atol=TOL, msg=what)
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        assert opt.transfer.handed is None and opt.transfer.carry is None


@pytest.mark.distributed
def test_zero_steps_on_g1_plus_g2_at_a_loss_scale_as_ddp() -> None:
    from dist_utils import spawn

    spawn(_carry_worker, 2)


def _skip_worker(rank: int, world: int) -> None:
    x, y = _data(4 * world)
    mine = slice(rank * 4, (rank + 1) * 4)
    for stage in (1, 2):
        model, opt, ref, ref_opt = _pair(stage)
        # round 0 steps; round 1 gets an inf on rank 1 only: every rank skips, the weights stay
        # bit for bit, and the carried grads (inf included, as torch leaves a skipped step's
        # grads) make the next step skip too until zero_grad(); then training goes on as DDP's
        # that never saw the bad rounds.
        opt.backward(_loss(model, x[mine], y[mine]))
        _loss(ref, x[mine], y[mine]).backward()
        assert not opt.step().skipped
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        masters = [hp.detach().clone() for hp in opt.hp_params()]
        for poisoned in (True, False):
            opt.backward(_loss(model, x[mine], y[mine]))
            if poisoned and rank == 1:
                next(model.parameters()).grad[0, 0] = float("inf")
            assert opt.step().skipped, (stage, poisoned)  # False: the inf carried from the skip
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
            assert all(torch.equal(h, m) for h, m in zip(opt.hp_params(), masters, strict=True))
        assert opt.loss_scale == SCALE.init_scale / 4  # two skips, two backoffs
        opt.zero_grad()
        for _ in range(2):
            opt.backward(_loss(model, x[mine], y[mine]))
            _loss(ref, x[mine], y[mine]).backward()
            assert not opt.step().skipped
            ref_opt.step()
        for i, (hp, q) in enumerate(zip(opt.hp_params(), ref.parameters(), strict=True)):
            what = f"stage {stage} param {i}"
            torch.testing.assert_close(hp, q.detach(), rtol=0, atol=TOL, msg=what)


@pytest.mark.distributed
def test_zero_skipped_step_carries_as_torch_and_zero_grad_recovers() -> None:
    from dist_utils import spawn

    spawn(_skip_worker, 2)


def test_zero_hands_its_shares_to_the_core_carry_and_keeps_no_copy() -> None:
    """One process (world 1): the buckets hand the transfer what the step ran on, as Handed;
    GradBuckets keeps no second store of it, and ZeroOptimizer no carry of its own."""
    model = _model().half()
    opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=1, loss_scale=SCALE)
    assert opt.traits.carries_grads
    assert not hasattr(GradBuckets, "take_stepped") and "_carry_grads" not in vars(ZeroOptimizer)
    x, y = _data(4)
    opt.backward(_loss(model, x, y))
    opt.grads_to_masters()
    handed = opt.transfer.handed
    assert isinstance(handed, Handed) and handed.divisor == 1
    assert [id(p) for p in handed.params] == [id(p) for p in model.parameters()]
    assert all(g is hp.grad for g, hp in zip(handed.grads, opt.hp_masters, strict=True))
    opt.step()
    assert opt.transfer.handed is None  # given back once
    scale = opt.scaler.scale_tensor
    for p, hp in zip(model.parameters(), opt.hp_masters, strict=True):
        assert torch.equal(p.grad, (hp.grad * (scale * 1)).to(torch.float16))
