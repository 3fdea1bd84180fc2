"""Apex's amp as migrating code uses it: optimizer wrappers (LARC-style), a second initialize,
cast_model_type=False, models that already hold fp16 params, and `amp._amp_state`.

Exact tests (rtol=0, atol=0): power-of-two weights, inputs, loss coefficients and learning
rates, and a loss linear in the outputs, so fp16 forward/backward and every update are exact
and the fp32 reference below is written by hand.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tolerances import EXACT
from torch import nn

from mixprec.apex import amp

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

X = torch.tensor([[1.0, 2.0]])
W = [[0.5, -1.0], [2.0, 0.25]]
A = torch.tensor([[1.0, -2.0]])  # loss = sum(A * model(X)): dL/dW = A^T X
LR = 0.25
SCALE = 16.0  # Apex's default 2**16 times these grads (up to 4) overflows fp16


def linear(dtype: torch.dtype = torch.float32) -> nn.Linear:
    layer = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(W))
    return layer.to(dtype)


def expected_weight(steps: int, grad_factor: float = 1.0) -> torch.Tensor:
    """Plain SGD in fp32: W - steps * LR * grad_factor * A^T X."""
    return torch.tensor(W) - steps * LR * grad_factor * (A.T @ X)


def train(model: nn.Module, opt: Any, steps: int = 1) -> None:
    for _ in range(steps):
        opt.zero_grad()
        loss = (model(X.to(next(model.parameters()).dtype)).float() * A).sum()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()


@pytest.fixture
def allow_not_fp32() -> Iterator[None]:
    amp._amp_state.allow_incoming_model_not_fp32 = True
    try:
        yield
    finally:
        amp._amp_state.allow_incoming_model_not_fp32 = False


class HalvingWrapper:
    """A LARC-style wrapper: not a torch.optim.Optimizer; rescales the grads, then steps the
    inner optimizer (and, like LARC, reports the inner optimizer's repr as its own)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optim = optimizer
        self.steps = 0

    def __repr__(self) -> str:
        return repr(self.optim)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property
    def state(self) -> Any:
        return self.optim.state

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self) -> None:
        self.optim.zero_grad()

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        for group in self.optim.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)
        self.optim.step()


def test_optimizer_like_wrapper_is_accepted_and_its_step_runs() -> None:
    model = linear()
    wrapper = HalvingWrapper(torch.optim.SGD(model.parameters(), lr=LR))
    model, opt = amp.initialize(model, wrapper, opt_level="O2", max_loss_scale=SCALE, verbosity=0)
    train(model, opt, steps=2)
    assert wrapper.steps == 2
    assert all(p.dtype == torch.float32 for g in wrapper.param_groups for p in g["params"])
    torch.testing.assert_close(opt.hp_masters[0], expected_weight(2, grad_factor=0.5), **EXACT)
    torch.testing.assert_close(model.weight.float(), expected_weight(2, 0.5), **EXACT)
    # its checkpoint is the wrapped optimizer's, in torch's layout, and loads back
    state = opt.state_dict()
    assert {"state", "param_groups", "master_weights"} <= set(state)
    opt.load_state_dict(state)


def test_something_that_is_not_an_optimizer_is_named_with_what_it_lacks() -> None:
    class NoStep:
        param_groups: list = []

        def __repr__(self) -> str:
            return "SGD (looks like one)"

    with pytest.raises(TypeError, match=r"test_apex_dropin.*NoStep, which lacks \['step'"):
        amp.initialize(linear(), NoStep(), opt_level="O2")  # type: ignore[arg-type]


def test_second_initialize_with_fresh_objects_and_the_first_pair_keeps_working() -> None:
    first_model = linear()
    first_raw = torch.optim.SGD(first_model.parameters(), lr=LR)
    first_model, first = amp.initialize(
        first_model, first_raw, opt_level="O2", max_loss_scale=SCALE, verbosity=0
    )
    train(first_model, first)
    second_model = linear()
    second_model, second = amp.initialize(
        second_model,
        torch.optim.SGD(second_model.parameters(), lr=LR),
        opt_level="O2",
        max_loss_scale=SCALE,
        verbosity=0,
    )
    train(first_model, first)  # the first pair still trains, with its own loss scaler
    train(second_model, second)
    torch.testing.assert_close(first.hp_masters[0], expected_weight(2), **EXACT)
    torch.testing.assert_close(second.hp_masters[0], expected_weight(1), **EXACT)
    assert amp._amp_state.loss_scalers[0].loss_scale() == second.loss_scale
    with (
        pytest.raises(ValueError, match="optimizers from different amp.initialize calls"),
        amp.scale_loss((first_model(X.half()) * 0).sum(), [first, second]),
    ):
        pass
    # the objects the first call consumed cannot be wrapped again, with the reason said
    with pytest.raises(ValueError, match="wrapped by an earlier amp.initialize call"):
        amp.initialize(linear(), first_raw, opt_level="O2")
    with pytest.raises(ValueError, match="PerLossOptimizer that amp.initialize returned"):
        amp.initialize(linear(), first, opt_level="O2")


def test_cast_model_type_false_leaves_an_fp32_model_fp32() -> None:
    model = linear()
    model, opt = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=LR), opt_level="O2", cast_model_type=False
    )  # fp32 grads: no overflow at the default scale
    assert model.weight.dtype == torch.float32 and opt.hp_masters == []
    train(model, opt)
    torch.testing.assert_close(model.weight, expected_weight(1), **EXACT)


def test_fp16_model_is_refused_unless_apexs_switch_is_set() -> None:
    with pytest.raises(ValueError, match="allow_incoming_model_not_fp32 = True"):
        amp.initialize(linear(torch.float16), opt_level="O2")
    with pytest.raises(TypeError, match="allow_incoming_model_not_fp32='yes' must be"):
        amp._amp_state.allow_incoming_model_not_fp32 = "yes"  # type: ignore[assignment]
    with pytest.raises(AttributeError):
        amp._amp_state.hard_override = True  # not a setting mixprec has: never silently taken


@pytest.mark.parametrize(("opt_level", "masters"), [("O2", 1), ("O3", 0)])
@pytest.mark.usefixtures("allow_not_fp32")
def test_fp16_model_uncast_gets_masters_where_the_level_has_them(opt_level, masters) -> None:
    # Apex's own tests: an fp16 model, cast_model_type=False; O2 gives it fp32 masters.
    model = linear(torch.float16)
    model, opt = amp.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        opt_level=opt_level,
        cast_model_type=False,
        max_loss_scale=SCALE,
        verbosity=0,
    )
    assert model.weight.dtype == torch.float16 and len(opt.hp_masters) == masters
    train(model, opt, steps=2)
    torch.testing.assert_close(model.weight.float(), expected_weight(2), **EXACT)


def test_amp_state_loss_scalers_answer_per_loss() -> None:
    model = linear()
    model, opt = amp.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=LR),
        opt_level="O2",
        num_losses=2,
        max_loss_scale=SCALE,
        verbosity=0,
    )
    scalers = amp._amp_state.loss_scalers
    assert [s.loss_scale() for s in scalers] == [SCALE, SCALE] and scalers[1].dynamic
    with amp.scale_loss((model(X.half()).float() * A).sum() * float("inf"), opt, loss_id=1) as s:
        s.backward()
    opt.step()  # skipped: loss 1 overflowed
    assert [s.loss_scale() for s in amp._amp_state.loss_scalers] == [SCALE, SCALE / 2]
    amp.initialize(linear(), opt_level="O1", enabled=False)
    assert amp._amp_state.loss_scalers == ()  # disabled amp has no scalers
