"""mixprec.GradScaler is torch.amp.GradScaler where they overlap, plus hysteresis and ranks."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import spawn

from mixprec import GradScaler

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")


def train(scaler, model, opt, overflow_steps, steps=12):
    scales = []
    gen = torch.Generator(torch.get_default_device()).manual_seed(
        7
    )  # the same batches for every scaler compared
    for i in range(steps):
        opt.zero_grad()
        x = torch.randn(4, 6, generator=gen)
        scaler.scale(model(x).square().mean()).backward()
        if i in overflow_steps:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("fused", [False, True])
def test_drop_in_for_torch_grad_scaler(device: str, fused: bool) -> None:
    # Same arguments, same overflow pattern: same scales and bitwise-equal parameters.
    kw = dict(init_scale=2.0**8, growth_interval=3)
    model = torch.nn.Linear(6, 3)
    twin = copy.deepcopy(model)
    ours = train(
        GradScaler(device, **kw),
        model,
        torch.optim.Adam(model.parameters(), fused=fused),
        {2, 5, 6},
    )
    torch.manual_seed(0)
    ref = train(
        torch.amp.GradScaler(device, **kw),
        twin,
        torch.optim.Adam(twin.parameters(), fused=fused),
        {2, 5, 6},
    )
    assert ours == ref
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_hysteresis_and_floor(device: str) -> None:
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(device, init_scale=4.0, hysteresis=2, min_scale=1.0, growth_interval=100)
    scales = train(scaler, model, opt, set(range(6)), steps=6)
    assert scales == [4.0, 2.0, 1.0, 1.0, 1.0, 1.0]


def test_state_dict_round_trip_includes_hysteresis(device: str) -> None:
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a = GradScaler(device, init_scale=64.0, hysteresis=3, growth_interval=5)
    train(a, model, opt, {1}, steps=3)
    state = a.state_dict()
    assert state["_hysteresis_tracker"] == 2 and state["_growth_tracker"] == 1
    b = GradScaler(device)
    b.load_state_dict(state)
    assert b.state_dict() == state


def test_disabled_is_passthrough(device: str) -> None:
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(device, enabled=False)
    loss = model(torch.randn(2, 6)).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    before = model.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(model.weight, before)  # a plain optimizer step happened


def _one_rank_overflows(rank: int, world: int) -> None:
    torch.manual_seed(0)  # same init on every rank
    model = torch.nn.Linear(6, 3)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(torch.get_default_device().type, init_scale=2.0**4)
    scaler.scale(model(torch.randn(4, 6)).sum()).backward()
    if rank == 1:
        model.bias.grad[0] = float("nan")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**3, f"rank {rank} did not back off"
    for a, b in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.distributed
def test_overflow_on_one_rank_skips_on_all() -> None:
    spawn(_one_rank_overflows, 2)


def test_paddle_keyword_names_go_to_the_paddle_scaler(device: str) -> None:
    # mixprec.GradScaler is torch's drop-in; seed 002's GradScaler(init_loss_scaling=1024) is
    # mixprec.paddle.GradScaler's (tests/test_paddle_scaler.py)
    with pytest.raises(TypeError, match="'init_loss_scaling'.*mixprec.paddle.GradScaler"):
        GradScaler(device, init_loss_scaling=1024)
    with pytest.raises(TypeError, match="'init_scael'.*Did you mean 'init_scale'"):
        GradScaler(device, init_scael=8)


def test_static_scale_never_moves(device: str) -> None:
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(device, init_scale=8.0, dynamic=False, growth_interval=1)
    assert set(train(scaler, model, opt, {1, 2}, steps=5)) == {8.0}


def test_drives_the_master_weight_optimizer(device: str) -> None:
    # GradScaler + MixedPrecisionOptimizer over fp16 params == a hand-written fp32-master loop.
    from mixprec import MixedPrecisionOptimizer, cast_module

    torch.manual_seed(0)
    model = cast_module(torch.nn.Linear(6, 3), torch.float16)
    ref = copy.deepcopy(model)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    masters = [p.detach().float().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.SGD(masters, lr=0.1)
    scaler = GradScaler(device, init_scale=2.0**6)
    gen = torch.Generator(torch.get_default_device()).manual_seed(1)
    for step in range(4):
        x = torch.randn(4, 6, generator=gen).half()
        opt.zero_grad()
        scaler.scale(model(x).float().square().mean()).backward()
        if step == 2:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        if step != 2:  # the reference skips the poisoned step by not taking it
            (ref(x).float().square().mean() * 2.0**6).backward()
            for p, m in zip(ref.parameters(), masters, strict=True):
                m.grad = p.grad.float() * 2.0**-6
                p.grad = None
            ref_opt.step()
            with torch.no_grad():
                for p, m in zip(ref.parameters(), masters, strict=True):
                    p.copy_(m)
    for a, b in zip(opt.hp_masters, masters, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert scaler.get_scale() == 2.0**5
