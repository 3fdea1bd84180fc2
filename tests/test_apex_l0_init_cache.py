"""Apex's tests/L0/run_amp/test_cache.py on the `amp.init` handle API, and the handle's cache.

Apex's test_cache (ported as written in test_apex_l0_cache.py) checks that gradients flow
through O1's cast cache across a train / eval (no_grad) / train sequence. The handle API
(`amp.init`) keeps its own cache; this file runs Apex's sequence on it, with the handle's
old-API loss scaling (`handle.scale_loss(loss, optimizer)` around a plain torch optimizer),
on CPU (fp16 CPU kernels exist for mm, pow and mul) for the reasons given in
test_apex_l0_cache.py. The models, the comparison with an fp32 reference gradient and
Apex's default tolerances (torch.testing.assert_close) are Apex's. Then mixprec's own cache
contract: one cast per parameter per iteration, and never a stale copy.
"""

from __future__ import annotations

import pytest
import torch
from test_apex_l0_cache import BlacklistModule, PromoteModule, WhitelistModule, get_reference_grad
from tolerances import FP32_ROUNDING
from torch import nn

from mixprec.apex import amp


@pytest.fixture
def handle():
    handle = amp.init(enabled=True, loss_scale=4.0)  # Apex's test wrote the scale 4.0
    yield handle
    handle._deactivate()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("module", [WhitelistModule, BlacklistModule, PromoteModule])
def test_train_eval_train(handle, module, dtype) -> None:
    x = torch.ones((2, 8), dtype=torch.float32)
    model = module(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)

    def training_step():
        for param in model.parameters():
            param.grad = None
        loss = model(x).sum()
        with handle.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        assert len([p.grad for p in model.parameters() if p.grad is not None]) == 1
        assert model.weight.grad.dtype == model.weight.dtype
        reference_grad = get_reference_grad(x, model.weight, model.ops)
        torch.testing.assert_close(model.weight.grad.float(), reference_grad)
        model.weight.data -= 1.0

    training_step()  # simulates the first epoch
    with torch.no_grad():  # simulates eval
        model(x).sum()
    training_step()  # simulates resuming training after eval


def weight_casts(loss: torch.Tensor, weight: torch.Tensor) -> int:
    """How many distinct cast nodes of `weight` the loss's graph holds."""
    seen, casts, todo = set(), set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if getattr(child, "variable", None) is weight:
                casts.add(node)
            todo.append(child)
    return len(casts)


@pytest.mark.parametrize("caching", [True, False])
def test_a_parameter_is_cast_once_per_iteration_and_scale_loss_drops_the_cache(
    handle, caching
) -> None:
    if not caching:
        handle._deactivate()
        handle = amp.init(enabled=True, enable_caching=False)
    try:
        model = WhitelistModule(torch.float32)  # uses its weight in two mm calls
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        loss = model(torch.ones(2, 8))
        assert weight_casts(loss, model.weight) == (1 if caching else 2)
        with handle.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        if caching:
            assert len(handle.cache) == 0
    finally:
        handle._deactivate()


def test_no_cache_casts_every_use(handle) -> None:
    handle._deactivate()
    handle = amp.init(enabled=True, enable_caching=False)
    try:
        assert not handle.has_cache and handle.cache is None
        model = WhitelistModule(torch.float32)
        torch.testing.assert_close(
            model(torch.ones(2, 8)),
            WhitelistModule.ops(torch.ones(2, 8).half(), model.weight.detach().half()),
            rtol=0,
            atol=0,
        )
    finally:
        handle._deactivate()


def test_an_optimizer_step_between_forwards_never_reads_a_stale_cast(handle) -> None:
    # no scale_loss between the two forwards (nothing clears the cache): the step's in-place
    # write bumps the weight's version, so the second forward casts the new weight
    lin = nn.Linear(8, 8)
    optimizer = torch.optim.SGD(lin.parameters(), lr=0.5)
    x = torch.randn(4, 8)
    lin(x).float().sum().backward()
    optimizer.step()
    got = lin(x)
    want = nn.functional.linear(x.half(), lin.weight.detach().half(), lin.bias.detach().half())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_cast_made_under_no_grad_is_not_reused_for_training(handle) -> None:
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with torch.no_grad():
        lin(x)
    lin(x).float().sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.float32


def test_clear_and_remove_cache(handle) -> None:
    lin = nn.Linear(8, 8)
    lin(torch.randn(2, 8))
    assert len(handle.cache) == 2  # weight and bias
    handle.remove_cache(lin.weight)
    assert len(handle.cache) == 1
    handle._clear_cache()
    assert len(handle.cache) == 0


def test_overflow_backs_off_and_skips_the_next_step_only(handle) -> None:
    handle._deactivate()
    handle = amp.init(enabled=True, loss_scale="dynamic")
    try:
        lin = nn.Linear(8, 8)
        optimizer = torch.optim.SGD(lin.parameters(), lr=0.1)
        before = [p.detach().clone() for p in lin.parameters()]
        scale = handle.loss_scale
        loss = lin(torch.randn(2, 8)).float().sum() * float("inf")
        with handle.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        assert handle.loss_scale == scale * 0.5  # Apex's back-off factor
        optimizer.step()  # skipped: nothing moves, bit for bit
        for p, b in zip(lin.parameters(), before, strict=True):
            torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)
        optimizer.zero_grad()
        x = torch.randn(1, 8) * 0.1  # one row: the bias grad, 1 * scale, stays below 65504
        with handle.scale_loss(lin(x).float().sum(), optimizer) as scaled_loss:
            scaled_loss.backward()
        grads = [p.grad.clone() for p in lin.parameters()]
        # the reference: the same fp16 forward, unscaled. A power-of-two scale that neither
        # overflows nor underflows commutes with every rounding, so the grads agree exactly.
        w, b = (t.clone().requires_grad_() for t in before)
        nn.functional.linear(x.half(), w.half(), b.half()).float().sum().backward()
        torch.testing.assert_close(grads, [w.grad, b.grad], rtol=0, atol=0)
        optimizer.step()  # a real step again
        for p, b0, g in zip(lin.parameters(), before, grads, strict=True):
            torch.testing.assert_close(p.detach(), b0 - 0.1 * g, **FP32_ROUNDING)
    finally:
        handle._deactivate()


def test_scale_loss_refuses_what_is_not_an_optimizer(handle) -> None:
    loss = nn.Linear(8, 1)(torch.randn(2, 8)).float().sum()
    with pytest.raises(TypeError, match="torch optimizer"), handle.scale_loss(loss, object()):
        pass


# ----- handle.wrap_optimizer: Apex's OptimWrapper, one dynamic scale per loss -----
def _two_loss_step(opt, lin, x, poison_second: bool) -> None:
    opt.zero_grad()
    with opt.scale_loss(lin(x).float().mean()) as scaled_loss:
        scaled_loss.backward()
    second = lin(x).float().pow(2).mean()
    if poison_second:
        second = second * float("inf")
    with opt.scale_loss(second) as scaled_loss:
        scaled_loss.backward()
    opt.step()


def test_wrap_optimizer_scales_each_loss_on_its_own_and_skips_on_any_overflow(handle) -> None:
    lin = nn.Linear(8, 8)
    opt = handle.wrap_optimizer(torch.optim.SGD(lin.parameters(), lr=0.1), num_loss=2)
    x = torch.randn(1, 8) * 0.1  # means over 8: each scaled fp16 grad stays below 65504
    before = [p.detach().clone() for p in lin.parameters()]
    start = opt.loss_scales
    _two_loss_step(opt, lin, x, poison_second=True)
    assert opt.loss_scales == [start[0], start[1] * 0.5]  # only loss 1's scaler backs off
    for p, b in zip(lin.parameters(), before, strict=True):  # skipped: bit for bit
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)
    _two_loss_step(opt, lin, x, poison_second=False)
    # the reference: plain torch, the same fp16 forward, the two losses unscaled, torch's SGD.
    # Power-of-two scales commute with fp16 rounding except where the unscaled reference's
    # fp16 grads fall below fp16's normal range (|g| < 2**-14): there the reference rounds to
    # the subnormal spacing 2**-24 (what loss scaling exists to avoid). Each element carries at
    # most one such rounding per loss (batch 1: no sums), half a spacing each: lr * 2**-24 in
    # the weight, plus one fp32 ulp where w - lr * g then rounds the other way.
    tolerance = {"rtol": 2.0**-23, "atol": 0.1 * 2.0**-24}
    ref = nn.Linear(8, 8)
    ref.load_state_dict({"weight": before[0], "bias": before[1]})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for loss in (
        nn.functional.linear(x.half(), ref.weight.half(), ref.bias.half()).float().mean(),
        nn.functional.linear(x.half(), ref.weight.half(), ref.bias.half()).float().pow(2).mean(),
    ):
        loss.backward()
    ref_opt.step()
    for p, r in zip(lin.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), r.detach(), **tolerance)


def test_wrap_optimizer_refuses_more_losses_than_declared_and_the_handles_scale_loss(
    handle,
) -> None:
    lin = nn.Linear(8, 8)
    sgd = torch.optim.SGD(lin.parameters(), lr=0.1)
    opt = handle.wrap_optimizer(sgd, num_loss=1)
    with opt.scale_loss(lin(torch.randn(1, 8)).float().sum()) as scaled_loss:
        scaled_loss.backward()
    with pytest.raises(RuntimeError, match="num_loss=1"), opt.scale_loss(torch.ones(())):
        pass
    with (
        pytest.raises(RuntimeError, match="wrap_optimizer"),
        handle.scale_loss(torch.ones(()), sgd),
    ):
        pass
    with pytest.raises(NotImplementedError, match="closure"):
        opt.step(lambda: 0.0)
