"""core.grad_transfer's ways for grads to reach the masters: as each backward accumulates
(Accumulate: Paddle's master-weight optimizer without buffer reuse, a pipeline stage with it)
and per backward (PerBackward: Apex's stash). Each is checked against the plain fp32 sum of the
same low-precision grads, bit for bit (lp -> fp32 is exact, and the adds are the same adds)."""

from __future__ import annotations

import pytest
import torch

from mixprec.core.grad_transfer import Accumulate, GradTransfer, PerBackward


def _transfer(n: int = 2) -> tuple[GradTransfer, list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    lps = [torch.nn.Parameter(torch.randn(5).bfloat16()) for _ in range(n)]
    opt = torch.optim.SGD(lps, lr=0.1)
    transfer = GradTransfer(opt)
    opt.param_groups[0]["params"] = transfer.masters_for(lps, use_masters=True)
    return transfer, lps


def _backward(lps: list[torch.nn.Parameter], seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    weights = [torch.randn(5).bfloat16() for _ in lps]
    sum((w * p).sum() for w, p in zip(weights, lps, strict=True)).backward()
    return weights  # each param's grad: its weight, in bf16


@pytest.mark.parametrize("reuse_buffers", [False, True])
def test_accumulate_sums_micro_batches_in_fp32_and_frees_the_lp_grads(reuse_buffers) -> None:
    transfer, lps = _transfer()
    way = transfer.accumulate_as_backward(reuse_buffers=reuse_buffers)
    assert transfer.way is way and isinstance(way, Accumulate)
    for lp, hp in zip(lps, transfer.hp_masters, strict=True):
        way.hook(lp, hp)
    grads = [_backward(lps, seed) for seed in (1, 2, 3)]
    transfer.to_masters(free_lp=True)
    for i, (lp, hp) in enumerate(zip(lps, transfer.hp_masters, strict=True)):
        assert lp.grad is None
        expected = grads[0][i].float() + grads[1][i].float() + grads[2][i].float()
        assert torch.equal(hp.grad, expected)


def test_accumulate_with_reuse_overwrites_a_kept_buffer_and_drops_a_stale_one() -> None:
    transfer, lps = _transfer()
    way = transfer.accumulate_as_backward(reuse_buffers=True)
    for lp, hp in zip(lps, transfer.hp_masters, strict=True):
        way.hook(lp, hp)
    _backward(lps, 1)
    kept = [hp.grad for hp in transfer.hp_masters]
    way.reset()  # zero_grad: the sums are discarded, the buffers kept
    lps[1].requires_grad_(False)  # the second param takes no part in the next backward
    weights = _backward(lps[:1], 2)
    transfer.to_masters(free_lp=True)
    first, second = transfer.hp_masters
    assert first.grad is kept[0] and torch.equal(first.grad, weights[0].float())  # overwritten
    assert second.grad is None  # not summed into since reset: no stale gradient applied


def test_accumulate_without_reuse_adds_to_a_present_grad_and_folds_a_hand_set_one() -> None:
    transfer, lps = _transfer(1)
    transfer.accumulate_as_backward(reuse_buffers=False)
    (hp,) = transfer.hp_masters
    hp.grad = torch.ones(5)  # zeroed by clear_grad(set_to_zero=True), say: added to
    lps[0].grad = torch.full((5,), 2.0, dtype=torch.bfloat16)  # set by hand, no hook ran
    transfer.to_masters(free_lp=True)
    assert lps[0].grad is None and torch.equal(hp.grad, torch.full((5,), 3.0))


def test_per_backward_unscales_each_backward_alone_and_keeps_the_model_grads() -> None:
    transfer, lps = _transfer()
    way = transfer.per_backward()
    assert isinstance(way, PerBackward)
    sums = [torch.zeros(5) for _ in lps]
    for seed, scale in ((1, 4.0), (2, 0.5)):
        way.begin()
        weights = _backward(lps, seed)
        for lp in lps:
            lp.grad.mul_(scale)  # as a scaled backward leaves them
        found_inf = torch.zeros(1)
        way.add_unscaled(torch.tensor(1.0 / scale), found_inf)
        assert found_inf.item() == 0 and not way.stashed
        for i, w in enumerate(weights):
            sums[i] += (w * scale).float() * (1.0 / scale)
            assert torch.equal(lps[i].grad, w * scale)  # the model grads stay, still scaled
    transfer.to_masters(free_lp=True)  # nothing to move at the step: done per backward
    for hp, expected in zip(transfer.hp_masters, sums, strict=True):
        assert torch.equal(hp.grad, expected)
