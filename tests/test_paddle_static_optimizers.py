"""mixprec.paddle.static with any torch optimizer, as Paddle's static decorate takes any.

An optimizer compile_step has no fused update for (Adadelta, as Paddle's static AMP tests use;
Adagrad, RMSprop, ...) runs the same step eagerly: checked here against the step written out
by hand on the same replayed program (the same ops, so bit for bit with a power-of-two scale),
a non-finite step that changes nothing bit for bit, and the scale moving by Paddle's rule.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

from mixprec.paddle import static

pytestmark = pytest.mark.usefixtures("paddle_static_mode")  # conftest

OPTIMIZERS = {
    "Adadelta": lambda params: torch.optim.Adadelta(params, lr=1.0),
    "Adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
    "RMSprop": lambda params: torch.optim.RMSprop(params, lr=0.01, momentum=0.9),
}


def _record():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = static.data(name="x", shape=[3, 4], dtype="float32")
    y = static.data(name="y", shape=[3, 2], dtype="float32")
    return model, ((model(x) - y) ** 2).mean()


def _feed(step: int, bad: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    if bad:
        x[0, 0] = np.inf
    return {"x": x, "y": rng.standard_normal((3, 2)).astype(np.float32)}


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [t.detach().clone() for t in [*model.parameters(), *state]]


PATTERN = [False, True, False, False, True, False]  # True: an inf in the feed


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_o1_step_is_the_hand_written_step_with_paddles_skip_and_scale(name, caplog) -> None:
    model, loss = _record()
    opt = static.amp.decorate(
        OPTIMIZERS[name](model.parameters()),
        level="O1",
        init_loss_scaling=64.0,
        incr_every_n_steps=2,
        decr_every_n_nan_or_inf=1,
        incr_ratio=2.0,
        decr_ratio=0.5,
    )
    opt.minimize(loss)
    exe = static.Executor(static.CPUPlace())
    exe.run(static.default_startup_program())
    # the reference: the same replayed program on cloned parameters, the step by hand
    ref_params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    ref_opt = OPTIMIZERS[name](ref_params)
    scale, good, bad, scales = 64.0, 0, 0, []
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        for i, overflow in enumerate(PATTERN):
            module = opt.step_for(opt.program).module
            before = _snapshot(model, opt.inner)
            exe.run(feed=_feed(i, overflow), fetch_list=[loss])
            feeds = [torch.from_numpy(v) for v in _feed(i, overflow).values()]
            names = [n for n, _ in module.named_parameters()]
            params = dict(zip(names, ref_params, strict=True))
            ref_loss = torch.func.functional_call(module, params, tuple(feeds))
            grads = torch.autograd.grad(ref_loss * scale, ref_params)
            finite = all(torch.isfinite(g).all() for g in grads)
            assert finite == (not overflow)
            if finite:  # Paddle's update_loss_scaling: grow after incr_every_n_steps clean
                for p, g in zip(ref_params, grads, strict=True):
                    p.grad = g * (1.0 / scale)
                ref_opt.step()
                good, bad = good + 1, 0
                if good == 2:
                    scale, good = scale * 2.0, 0
            else:  # a skipped step: nothing moved, bit for bit
                for a, b in zip(before, _snapshot(model, opt.inner), strict=True):
                    torch.testing.assert_close(a, b, rtol=0, atol=0)
                bad, good = bad + 1, 0
                scale, bad = scale * 0.5, 0
            scales.append(float(opt.get_loss_scaling()[0]))
            for p, q in zip(model.parameters(), ref_params, strict=True):
                torch.testing.assert_close(p, q, rtol=0, atol=0)  # power-of-two scale: exact
            assert scales[-1] == scale
    assert scales == [64.0, 32.0, 32.0, 64.0, 32.0, 32.0]  # backed off twice, grown once
    said = [r.getMessage() for r in caplog.records if "runs its update eagerly" in r.message]
    assert len(said) == 1 and name in said[0] and "no fused master step" in said[0]


def test_o2_adadelta_keeps_fp32_masters_and_skips_bitwise() -> None:
    """Pure fp16 (Paddle's static O2 test setup) with Adadelta: amp_init casts the parameters,
    the update runs on the fp32 masters, a non-finite step leaves all of it as it was."""
    model, loss = _record()
    opt = static.amp.decorate(
        torch.optim.Adadelta(model.parameters(), lr=1.0),
        init_loss_scaling=128.0,
        use_pure_fp16=True,
        use_fp16_guard=False,  # every op low, not only those recorded in fp16_guard()
        decr_every_n_nan_or_inf=1,
        decr_ratio=0.5,
    )
    opt.minimize(loss)
    exe = static.Executor(static.CPUPlace())
    exe.run(static.default_startup_program())
    opt.amp_init(static.CPUPlace())
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    exe.run(feed=_feed(0), fetch_list=[loss])
    masters = opt.wrapped.hp_masters
    before = [t.detach().clone() for t in [*model.parameters(), *masters]]
    before += _snapshot(model, opt.inner)
    exe.run(feed=_feed(1, bad=True), fetch_list=[loss])
    after = [t.detach().clone() for t in [*model.parameters(), *masters]]
    after += _snapshot(model, opt.inner)
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert float(opt.get_loss_scaling()[0]) == 64.0  # backed off by decr_ratio 0.5
    first = [m.detach().clone() for m in masters]
    exe.run(feed=_feed(2), fetch_list=[loss])
    assert any(not torch.equal(a, b) for a, b in zip(first, masters, strict=True))  # it trains
    assert all(m.dtype == torch.float32 for m in masters)


def test_plain_minimize_with_adagrad_steps_and_skips_a_non_finite_step() -> None:
    model, loss = _record()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    opt.minimize(loss)
    exe = static.Executor(static.CPUPlace())
    exe.run(static.default_startup_program())
    start = [p.detach().clone() for p in model.parameters()]
    exe.run(feed=_feed(0), fetch_list=[loss])
    moved = [p.detach().clone() for p in model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(start, moved, strict=True))
    state = _snapshot(model, opt)
    exe.run(feed=_feed(1, bad=True), fetch_list=[loss])
    for a, b in zip(state, _snapshot(model, opt), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
