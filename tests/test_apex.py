"""The Apex face: amp.initialize / scale_loss / state_dict and FP16_Optimizer.

Exact tests (rtol=0, atol=0) use power-of-two weights, inputs and loss coefficients and losses
linear in the outputs: every gradient is a small dyadic number, so fp16 forward/backward, the
power-of-two loss scale and its inverse are all exact, and the fp32 reference is written by hand.
"""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
from conftest import tiny_mlp
from tolerances import EXACT
from torch import nn

from mixprec import AMP_TYPE, convert_to_amp, to_policy
from mixprec.apex import FP16_Optimizer, amp
from mixprec.core.per_loss_optim import PerLossOptimizer
from mixprec.core.skip_monitor import ScaleCollapseError

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

X = torch.tensor([[1.0, 2.0]])
W0 = [[0.5, -1.0], [2.0, 0.25]]
W1 = [[-0.5, 1.0], [1.0, 0.5]]
# loss_k = sum(coefficient * model(X)) for each model loss k reaches: dL/dW = coefficient^T X.
A0 = torch.tensor([[1.0, -2.0]])  # loss 0 on model 0
A1 = torch.tensor([[0.5, 1.0]])  # loss 1 on model 0
B1 = torch.tensor([[-1.0, 0.5]])  # loss 1 on model 1
B2 = torch.tensor([[2.0, 1.0]])  # loss 2 on model 1
LR0, LR1, MOMENTUM0 = 0.25, 0.5, 0.5
# small initial scale (Apex starts at min(2**16, max_loss_scale)): 2**16 * grads overflows fp16
MAX_SCALE = 16.0


def linear(weight: list[list[float]]) -> nn.Linear:
    layer = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(weight))
    return layer


def grads_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad.float() for p in amp.master_params(opt)]


def reference_run(schedule: list[set[int]]) -> list[dict[str, object]]:
    """Hand-written fp32 loop: per iteration, master grads (None if skipped) and weights after."""
    w0, w1 = torch.tensor(W0), torch.tensor(W1)
    buf0 = None
    out = []
    for overflowed in schedule:
        skip0 = bool(overflowed & {0, 1})  # losses 0 and 1 reach optimizer 0
        skip1 = bool(overflowed & {1, 2})  # losses 1 and 2 reach optimizer 1
        g0 = A0.T @ X + A1.T @ X
        g1 = B1.T @ X + B2.T @ X
        losses = [(w0 @ X.T).T @ A0.T, (w0 @ X.T).T @ A1.T + (w1 @ X.T).T @ B1.T]
        losses.append((w1 @ X.T).T @ B2.T)
        if not skip0:
            buf0 = g0.clone() if buf0 is None else MOMENTUM0 * buf0 + g0
            w0 = w0 - LR0 * buf0
        if not skip1:
            w1 = w1 - LR1 * g1
        out.append(
            {
                "losses": [loss.reshape(()) for loss in losses],
                "g0": None if skip0 else g0,
                "g1": None if skip1 else g1,
                "w0": w0,
                "w1": w1,
            }
        )
    return out


SCHEDULE = [set(), {0}, {1}, {2}, set(), {0, 2}]


@pytest.mark.parametrize(
    "opt_level, overrides",
    [("O1", {}), ("O2", {}), ("O3", {"loss_scale": "dynamic"})],
)
def test_two_models_two_optimizers_three_losses_match_fp32_reference(opt_level, overrides):
    model0, model1 = linear(W0), linear(W1)
    opt0 = torch.optim.SGD(model0.parameters(), lr=LR0, momentum=MOMENTUM0)
    opt1 = torch.optim.SGD(model1.parameters(), lr=LR1)
    (model0, model1), (opt0, opt1) = amp.initialize(
        [model0, model1],
        [opt0, opt1],
        opt_level=opt_level,
        num_losses=3,
        max_loss_scale=MAX_SCALE,
        **overrides,
    )
    plan = [(0, [opt0], model0), (1, [opt0, opt1], model1), (2, [opt1], model1)]
    for it, (overflowed, ref) in enumerate(zip(SCHEDULE, reference_run(SCHEDULE), strict=True)):
        opt0.zero_grad()
        opt1.zero_grad()
        y0, y1 = model0(X), model1(X)
        losses = [(y0 * A0).sum(), (y0 * A1).sum() + (y1 * B1).sum(), (y1 * B2).sum()]
        for loss, expected in zip(losses, ref["losses"], strict=True):
            torch.testing.assert_close(loss.float(), expected, **EXACT)
        for loss_id, opts, poisoned in plan:
            with amp.scale_loss(losses[loss_id], opts, loss_id=loss_id) as scaled_loss:
                scaled_loss.backward(retain_graph=loss_id < 2)
                if loss_id in overflowed:  # only this loss's fresh grads carry the inf
                    poisoned.weight.grad[0, 0] = float("inf")
        if ref["g0"] is not None:
            torch.testing.assert_close(grads_of(opt0), [ref["g0"]], **EXACT)
        if ref["g1"] is not None:
            torch.testing.assert_close(grads_of(opt1), [ref["g1"]], **EXACT)
        assert opt0.step().skipped == (ref["g0"] is None), it
        assert opt1.step().skipped == (ref["g1"] is None), it
        for model, opt, key in ((model0, opt0, "w0"), (model1, opt1, "w1")):
            torch.testing.assert_close(model.weight.float(), ref[key], **EXACT)
            torch.testing.assert_close(next(amp.master_params(opt)).float(), ref[key], **EXACT)
    assert (opt0.skipped_steps, opt1.skipped_steps) == (3, 3)
    state = amp.state_dict()
    # each scaler halves on its own overflows only: loss 0 twice, losses 1 and 2 ...
    assert [state[f"loss_scaler{i}"]["loss_scale"] for i in range(3)] == [4.0, 8.0, 4.0]
    assert [state[f"loss_scaler{i}"]["overflows"] for i in range(3)] == [2, 1, 2]
    # clean backward passes since each scaler's last overflow
    assert [state[f"loss_scaler{i}"]["unskipped"] for i in range(3)] == [0, 3, 0]


def test_delay_unscale_accumulates_scaled_grads_then_unscales_once():
    model = linear(W0)
    opt = torch.optim.SGD(model.parameters(), lr=LR0)
    model, opt = amp.initialize(model, opt, opt_level="O2", max_loss_scale=MAX_SCALE)
    for coefficient in (A0, A1):
        with amp.scale_loss((model(X) * coefficient).sum(), opt, delay_unscale=True) as s:
            s.backward()
    assert opt.scaled_grads_from == 0
    with pytest.raises(RuntimeError, match="still scaled"):
        opt.step()
    with amp.scale_loss((model(X) * B2).sum(), opt) as s:
        s.backward()
    torch.testing.assert_close(grads_of(opt), [(A0 + A1 + B2).T @ X], **EXACT)
    assert not opt.step().skipped
    torch.testing.assert_close(
        model.weight.float(), torch.tensor(W0) - LR0 * (A0 + A1 + B2).T @ X, **EXACT
    )
    # an inf in an early (delayed) backward is found by the final unscale: the step is skipped
    before = model.weight.detach().clone()
    with amp.scale_loss((model(X) * A0).sum(), opt, delay_unscale=True) as s:
        s.backward()
        model.weight.grad[1, 1] = float("nan")
    with amp.scale_loss((model(X) * A1).sum(), opt) as s:
        s.backward()
    assert opt.step().skipped
    torch.testing.assert_close(model.weight, before, **EXACT)


def test_accumulating_under_two_loss_ids_is_refused():
    model = linear(W0)
    model, opt = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.5), opt_level="O2", num_losses=2
    )
    with amp.scale_loss(model(X).sum(), opt, loss_id=0, delay_unscale=True) as s:
        s.backward()
    with (
        pytest.raises(ValueError, match="loss_id=1 .* scaled by loss scaler 0"),
        amp.scale_loss(model(X).sum(), opt, loss_id=1),
    ):
        pass


def norm_model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.LayerNorm(4), nn.Linear(4, 2))


@pytest.mark.parametrize(
    "opt_level, overrides, linear_dtype, norm_dtype, out_dtype, n_masters, dynamic",
    [
        ("O0", {}, torch.float32, torch.float32, torch.float32, 0, False),
        ("O1", {}, torch.float32, torch.float32, torch.float16, 0, True),
        ("O2", {}, torch.float16, torch.float32, torch.float32, 4, True),
        ("O3", {}, torch.float16, torch.float16, torch.float32, 0, False),
        # the overrides Apex documents: fp32 batchnorm in O3, fp16 norms and fp16 outputs in O2
        ("O3", {"keep_batchnorm_fp32": True}, torch.float16, torch.float32, torch.float32, 0, False),
        (
            "O2",
            {"keep_batchnorm_fp32": "False", "cast_model_outputs": torch.float16},
            torch.float16,
            torch.float16,
            torch.float16,
            8,
            True,
        ),
        ("O2", {"master_weights": False, "loss_scale": 128.0}, torch.float16, torch.float32,
         torch.float32, 0, False),
    ],
)  # fmt: skip
def test_each_opt_level_casts_as_apex(
    opt_level, overrides, linear_dtype, norm_dtype, out_dtype, n_masters, dynamic
):
    model = norm_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    same_model = model
    model, opt = amp.initialize(model, opt, opt_level=opt_level, **overrides)
    assert model is same_model and isinstance(opt, PerLossOptimizer)
    assert (model[0].weight.dtype, model[3].weight.dtype) == (linear_dtype, linear_dtype)
    assert (model[1].weight.dtype, model[2].weight.dtype) == (norm_dtype, norm_dtype)
    assert len(opt.hp_masters) == n_masters
    assert all(p.dtype == torch.float32 for p in opt.hp_masters)
    out = model(torch.randn(4, 2))  # fp32 inputs: cast to the model dtype by the patched forward
    assert out.dtype == out_dtype
    assert opt.scaler.dynamic == dynamic
    expected_scale = 128.0 if "loss_scale" in overrides else (2.0**16 if dynamic else 1.0)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == expected_scale
    # Apex's O2/O3 model.state_dict() holds fp32 tensors, loadable into an fp32 model
    assert all(
        t.dtype == torch.float32 for t in model.state_dict().values() if t.is_floating_point()
    )


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"opt_level": "O1", "cast_model_type": torch.float16}, ValueError,
         r"opt_level='O1' with cast_model_type=torch.float16: O1 casts"),
        ({"opt_level": "O1", "keep_batchnorm_fp32": True}, ValueError,
         r"opt_level='O1' with keep_batchnorm_fp32=True"),
        ({"opt_level": "O1", "master_weights": True}, ValueError,
         r"opt_level='O1' with master_weights=True"),
        ({"opt_level": "O2", "patch_torch_functions": True}, ValueError,
         r"opt_level='O2' with patch_torch_functions=True"),
        ({"opt_level": "O0", "master_weights": True}, ValueError, r"fp32 model weights"),
        ({"opt_level": "O4"}, ValueError, r"Unknown opt_level 'O4'.*'O0', 'O1', 'O2', 'O3'"),
        ({"loss_scale": "auto"}, ValueError, r"loss_scale='auto' must be 'dynamic' or a number"),
        ({"loss_scale": -2.0}, ValueError, r"loss_scale=-2.0"),
        ({"keep_batchnorm_fp32": "yes", "opt_level": "O2"}, TypeError, r"'yes' must be True"),
        ({"num_losses": 0}, ValueError, r"num_losses=0 must be an int >= 1"),
        ({"verbosity": "loud"}, TypeError, r"verbosity='loud'"),
        ({"min_loss_scale": 0.0}, ValueError, r"min_loss_scale=0.0"),
        ({"cast_model_outputs": torch.int8, "opt_level": "O2"}, ValueError,
         r"cast_model_outputs=torch.int8"),
    ],
)  # fmt: skip
def test_apex_rejections_name_the_conflict(kwargs, error, match):
    model = linear(W0)
    with pytest.raises(error, match=match):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    assert model.weight.dtype == torch.float32  # nothing was cast before the check


def test_allowed_overrides_and_config_routes():
    model = linear(W0)
    # O1 with cast_model_type=torch.float32 is what O1 means anyway: Apex allows it
    model = amp.initialize(model, opt_level="O1", cast_model_type=torch.float32)
    assert model.weight.dtype == torch.float32
    policy = to_policy({"mode": AMP_TYPE.APEX, "opt_level": "O2", "min_loss_scale": 2.0})
    assert (policy.loss_scale.min_scale, policy.loss_scale.max_scale) == (2.0, 2.0**24)
    # Apex: the first scale is min(2**16, max_loss_scale); no min_loss_scale is no floor
    policy = to_policy({"mode": AMP_TYPE.APEX, "opt_level": "O2", "max_loss_scale": 2.0**8})
    assert policy.loss_scale.init_scale == 2.0**8 and policy.loss_scale.min_scale < 2.0**-100
    assert to_policy({"mode": AMP_TYPE.APEX, "loss_scale": "64"}).loss_scale.init_scale == 64.0
    with pytest.raises(ValueError, match="'opt_levle'. Did you mean 'opt_level'"):
        to_policy({"mode": AMP_TYPE.APEX, "opt_levle": "O2"})
    # Colossal's AMP_TYPE.APEX route builds the same O2 (fp32 outputs, as Apex's forward)
    model = tiny_mlp(width=4)
    wrapped, _, _ = convert_to_amp(
        model, torch.optim.SGD(model.parameters(), lr=0.1), None, AMP_TYPE.APEX, {"opt_level": "O2"}
    )
    assert wrapped(torch.randn(2, 4)).dtype == torch.float32


def test_initialize_returns_what_it_was_given():
    def fresh():
        m = linear(W0)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    m, o = fresh()
    assert amp.initialize(m, opt_level="O2") is m
    m, o = fresh()
    m2, o2 = amp.initialize(m, o, opt_level="O2")
    assert m2 is m and isinstance(o2, PerLossOptimizer) and o2.optim is o
    (m, o), (n, p) = fresh(), fresh()
    models, opts = amp.initialize([m, n], [o, p], opt_level="O2")
    assert models == [m, n] and [x.optim for x in opts] == [o, p]
    (m, o), (n, _) = fresh(), fresh()
    models, opt = amp.initialize([m, n], o, opt_level="O2")
    assert models == [m, n] and opt.optim is o
    m, o = fresh()
    model, opts = amp.initialize(m, [o], opt_level="O2")
    assert model is m and len(opts) == 1
    # disabled: everything passes through untouched, and scale_loss hands back the loss itself
    m, o = fresh()
    assert amp.initialize(m, o, enabled=False) == (m, o)
    loss = m(X).sum()
    with amp.scale_loss(loss, o) as scaled_loss:
        assert scaled_loss is loss
    assert amp.state_dict() == {}


def test_initialize_and_scale_loss_refuse_misuse():
    with pytest.raises(TypeError, match="models must be a single"):
        amp.initialize("model")
    with pytest.raises(TypeError, match="DataParallel: wrap models in parallel wrappers"):
        amp.initialize(nn.DataParallel(linear(W0)), opt_level="O2")
    with pytest.raises(ValueError, match=r"0.weight of dtype torch.float16"):
        amp.initialize(nn.Sequential(linear(W0).half()), opt_level="O2")
    model = linear(W0)
    raw = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, raw, opt_level="O2", num_losses=2)
    with pytest.raises(ValueError, match="already returned by amp.initialize"):
        amp.initialize(model, opt_level="O2")
    with (
        pytest.raises(TypeError, match=r"the optimizer\(s\) amp.initialize returned"),
        amp.scale_loss(model(X).sum(), raw),
    ):
        pass
    with (
        pytest.raises(ValueError, match=r"loss_id=2 .*num_losses=2: valid loss ids are 0..1"),
        amp.scale_loss(model(X).sum(), opt, loss_id=2),
    ):
        pass
    model(X).sum().backward()  # an unscaled backward: the fp16 grads never reach the masters
    with pytest.raises(RuntimeError, match="did not come through this optimizer.s scaled backward"):
        opt.step()
    other = linear(W1)
    _, other_opt = amp.initialize(
        other, torch.optim.SGD(other.parameters(), lr=0.1), opt_level="O2"
    )
    with (
        pytest.raises(ValueError, match="optimizers from different amp.initialize calls"),
        amp.scale_loss(model(X).sum(), [opt, other_opt]),
    ):
        pass


def test_patched_forward_follows_deepcopy_and_lr_schedulers_see_the_optimizer():
    model = linear(W0)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), opt_level="O2")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.weight.mul_(2)
    torch.testing.assert_close(twin(X), 2 * model(X), **EXACT)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with amp.scale_loss(model(X).sum(), opt) as s:
        s.backward()
    opt.step()
    scheduler.step()
    assert opt.optim.param_groups[0]["lr"] == 0.25


def o2_run(model, opt, steps, poison_at=()):
    """A few O2 steps of a tiny MLP on fixed data; inf written into a grad at poison_at."""
    data = torch.linspace(-1.0, 1.0, 8 * 4).reshape(8, 4)
    for step in steps:
        opt.zero_grad()
        x = data.roll(step, dims=0)
        loss = (model(x) - x[:, :4].sum(dim=1, keepdim=True)).pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled_loss:
            scaled_loss.backward()
            if step in poison_at:
                model[0].weight.grad[0, 0] = float("inf")
        opt.step()


def test_o2_checkpoint_round_trip_equals_an_uninterrupted_run_bit_for_bit():
    init = tiny_mlp(width=4)
    kwargs = {"opt_level": "O2", "max_loss_scale": 2.0**10}
    model = copy.deepcopy(init)
    model, opt = amp.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2), **kwargs)
    o2_run(model, opt, range(6), poison_at={2})
    expected_model, expected_masters = model.state_dict(), [m.clone() for m in opt.hp_masters]
    expected_amp, expected_inner = amp.state_dict(), opt.optim.state_dict()["state"]

    model = copy.deepcopy(init)
    model, opt = amp.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2), **kwargs)
    o2_run(model, opt, range(3), poison_at={2})
    # the masters hold bits the fp16 model lacks: rebuilding them from it would drift
    assert any(
        not torch.equal(m, lp.float()) for m, lp in zip(opt.hp_masters, opt.lp_params, strict=True)
    )
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()},
        buffer,
    )
    buffer.seek(0)

    torch.manual_seed(1)  # a different fresh model: everything must come from the checkpoint
    model = tiny_mlp(width=4)
    model, opt = amp.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2), **kwargs)
    checkpoint = torch.load(buffer)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    o2_run(model, opt, range(3, 6))

    torch.testing.assert_close(model.state_dict(), expected_model, **EXACT)
    torch.testing.assert_close(opt.hp_masters, expected_masters, **EXACT)
    torch.testing.assert_close(opt.optim.state_dict()["state"], expected_inner, **EXACT)
    assert amp.state_dict() == expected_amp and expected_amp["loss_scaler0"]["overflows"] == 1


def test_amp_load_state_dict_reads_apex_checkpoints_and_refuses_mismatches():
    model = linear(W0)
    amp.initialize(model, opt_level="O2", num_losses=2)
    amp.load_state_dict(
        {
            "loss_scaler0": {"loss_scale": 512.0, "unskipped": 7},
            "loss_scaler1": {"loss_scale": 2.0, "unskipped": 0},
        }
    )  # Apex's own two keys per scaler
    state = amp.state_dict()
    assert (state["loss_scaler0"]["loss_scale"], state["loss_scaler0"]["unskipped"]) == (512.0, 7)
    assert state["loss_scaler1"]["loss_scale"] == 2.0
    with pytest.raises(ValueError, match="Unexpected key 'scaler0'.*'loss_scaler0'"):
        amp.load_state_dict({"scaler0": {}})
    with pytest.raises(ValueError, match=r"lacks \['loss_scaler1'\].*num_losses=2"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})


def two_model_overflow_step(verbosity: int) -> None:
    model0, model1 = linear(W0), linear(W1)
    (model0, model1), (opt0, opt1) = amp.initialize(
        [model0, model1],
        [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model0, model1)],
        opt_level="O2",
        max_loss_scale=MAX_SCALE,
        verbosity=verbosity,
    )
    with amp.scale_loss((model0(X) + model1(X)).sum(), [opt0, opt1]) as scaled_loss:
        scaled_loss.backward()
        model1.weight.grad[0, 1] = float("inf")
    assert opt0.step().skipped and opt1.step().skipped  # one overflow event, two skipped steps
    opt0.zero_grad()
    opt1.zero_grad()
    with amp.scale_loss((model0(X) + model1(X)).sum(), [opt0, opt1]) as scaled_loss:
        scaled_loss.backward()
    assert not opt0.step().skipped and not opt1.step().skipped  # a clean step logs nothing


def test_overflow_is_logged_once_per_event_and_verbosity_0_silences_it(caplog):
    caplog.set_level(logging.INFO, logger="mixprec")
    two_model_overflow_step(verbosity=1)
    overflow = [r for r in caplog.records if "overflow" in r.getMessage()]
    assert [r.getMessage() for r in overflow] == [
        "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 8.0"
    ]
    assert overflow[0].name == "mixprec" and overflow[0].levelno == logging.WARNING
    caplog.clear()
    two_model_overflow_step(verbosity=0)
    assert caplog.records == []


def half_linear(weight: list[list[float]]) -> nn.Linear:
    return linear(weight).half()


def test_fp16_optimizer_static_scale_matches_fp32_reference():
    model = half_linear(W0)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=LR0), static_loss_scale=128.0)
    assert opt.loss_scale == 128.0 and opt.optimizer.param_groups[0]["params"][0].dtype == (
        torch.float32
    )
    opt.zero_grad()
    opt.backward((model(X.half()) * A0).sum())  # two backward calls accumulate
    opt.backward((model(X.half()) * A1).sum())
    # g = (A0 + A1)^T X = [[1.5, 3], [-1, -2]], norm sqrt(16.25): a bound above it clips nothing
    norm = opt.clip_master_grads(8.0)
    assert norm == pytest.approx(16.25**0.5, rel=1e-6)  # fp32 sqrt of an exact sum of squares
    assert not opt.step().skipped
    expected = torch.tensor(W0) - LR0 * (A0 + A1).T @ X
    torch.testing.assert_close(model.weight.float(), expected, **EXACT)
    # an overflow skips the step, leaves the weights bit for bit, and a static scale stays put
    before = model.weight.detach().clone()
    opt.zero_grad()
    opt.backward((model(X.half()) * A0).sum(), update_master_grads=False)
    model.weight.grad[0, 0] = float("inf")
    assert opt.clip_master_grads(1.0) == -1.0
    assert opt.step().skipped and opt.overflow and opt.loss_scale == 128.0
    torch.testing.assert_close(model.weight, before, **EXACT)
    opt.zero_grad()
    (model(X.half()) * A0).sum().backward()  # unscaled, never moved to the masters: refused
    with pytest.raises(RuntimeError, match="did not come through this optimizer.s scaled backward"):
        opt.step()


def test_fp16_optimizer_dynamic_scale_backs_off_and_grows(caplog):
    caplog.set_level(logging.WARNING, logger="mixprec")
    model = half_linear(W0)
    opt = FP16_Optimizer(
        torch.optim.SGD(model.parameters(), lr=LR0),
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**4, "scale_window": 2},
    )
    scales = []
    for step in range(4):
        opt.zero_grad()
        opt.backward((model(X.half()) * A0).sum(), update_master_grads=False)
        if step == 0:  # the fp16 grad, before step() moves it into the master
            model.weight.grad[1, 0] = float("nan")
        opt.step()
        scales.append(opt.loss_scale)
    assert scales == [8.0, 8.0, 16.0, 16.0]  # halved by the overflow, doubled after 2 clean steps
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "Gradient overflow.  Skipping step, reducing loss scale to 8.0"
    # then, once, the skip monitor's summary of a run that started by skipping
    assert len(messages) == 2 and "the first 1 step(s) were skipped" in messages[1]
    assert "fell from 2**4 to 2**3" in messages[1]
    torch.testing.assert_close(model.weight.float(), torch.tensor(W0) - 3 * LR0 * A0.T @ X, **EXACT)
    # state_dict carries the masters and the scaler: a fresh FP16_Optimizer resumes exactly
    twin = half_linear(W1)
    twin_opt = FP16_Optimizer(torch.optim.SGD(twin.parameters(), lr=LR0), dynamic_loss_scale=True)
    twin_opt.load_state_dict(opt.state_dict())
    assert twin_opt.loss_scale == 16.0
    torch.testing.assert_close(twin.weight, model.weight, **EXACT)
    with pytest.raises(ValueError, match="'scale_windows'. Did you mean 'scale_window'"):
        FP16_Optimizer(
            torch.optim.SGD(twin.parameters(), lr=0.1),
            dynamic_loss_scale=True,
            dynamic_loss_args={"scale_windows": 2},
        )


def test_a_run_that_overflows_at_every_scale_fails_loudly_naming_the_param():
    model = linear(W0)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), opt_level="O2")
    opt.max_consecutive_skips = 3  # the core's guard (default 100), lowered to keep this fast
    for _ in range(2):
        with amp.scale_loss(model(X).sum(), opt) as scaled_loss:
            scaled_loss.backward()
            model.weight.grad.fill_(float("nan"))
        assert opt.step().skipped
    with amp.scale_loss(model(X).sum(), opt) as scaled_loss:
        scaled_loss.backward()
        model.weight.grad.fill_(float("nan"))
    with pytest.raises(ScaleCollapseError, match=r"3 steps in a row.*\['weight'\]"):
        opt.step()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _one_rank_overflows(rank: int, world: int) -> None:
    records = _Records()
    logging.getLogger("mixprec").addHandler(records)
    model = linear(W0)
    model, opt = amp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.5), opt_level="O2", max_loss_scale=16.0
    )
    with amp.scale_loss((model(X) * (rank + 1)).sum(), opt) as scaled_loss:
        scaled_loss.backward()
        if rank == world - 1:
            model.weight.grad[0, 0] = float("inf")
    assert opt.step().skipped, f"rank {rank} stepped although rank {world - 1} overflowed"
    torch.testing.assert_close(model.weight.float(), torch.tensor(W0), **EXACT)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 8.0
    assert len(records.messages) == (1 if rank == 0 else 0), (rank, records.messages)


@pytest.mark.distributed
def test_an_overflow_on_one_rank_skips_every_rank_and_is_logged_on_rank_0_only():
    from dist_utils import spawn

    spawn(_one_rank_overflows, 2)
