"""Delayed scaling's amax history: who writes it (training steps only) and its dtype (float32).

The rule under test (Float8Linear's docstring): a forward records the input and weight amaxes
iff `module.training and torch.is_grad_enabled()`, its backward records the grad amax iff the
forward did; every other call reads the history read-only. Histories stay float32 through
module dtype conversions. Equalities are bitwise: the same history gives the same scales, the
same fp8 bytes and the same GEMM, so any difference is a rule violation, not rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mixprec.fp8 import Float8Config, Float8Linear, convert_to_fp8, delayed_amax, tensor_to_amax
from mixprec.fp8.linear import HISTORY_NAMES

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

DELAYED = Float8Config(scaling="delayed", amax_history_len=4)


def model(config: Float8Config = DELAYED, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    return convert_to_fp8(mlp, config=config)


def histories(module: nn.Module) -> list[torch.Tensor]:
    return [
        getattr(m, name).clone()
        for m in module.modules()
        if isinstance(m, Float8Linear)
        for name in HISTORY_NAMES
    ]


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def step(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = module(x)
    out.square().sum().backward()
    return out


def test_training_steps_record_input_weight_and_grad_amaxes():
    mlp = model()
    layer = mlp[2]
    x = torch.randn(8, 32)
    hidden = mlp[1](mlp[0](x))  # what the second layer sees (recording does not change it)
    out = step(mlp, x)
    assert layer.input_amax_history.tolist()[1:] == [0.0, 0.0, 0.0]
    assert layer.input_amax_history[0] == tensor_to_amax(hidden)
    assert layer.weight_amax_history[0] == tensor_to_amax(layer.weight)
    assert layer.grad_amax_history[0] == tensor_to_amax(2 * out)  # d(sum out^2)/d out
    step(mlp, torch.randn(8, 32))
    for name in HISTORY_NAMES:  # one entry per step, newest first
        assert bool((getattr(layer, name)[:2] > 0).all()) and getattr(layer, name)[2] == 0


@pytest.mark.parametrize("mode", ["eval", "eval_with_backward", "no_grad", "inference_mode"])
def test_eval_and_no_grad_forwards_leave_the_history_bitwise_unchanged(mode):
    mlp = model()
    for _ in range(2):
        step(mlp, torch.randn(8, 32))
    before = histories(mlp)
    x = torch.randn(8, 32) * 100  # a much larger amax: recording it would show
    if mode == "eval":
        mlp.eval()
        mlp(x)
    elif mode == "eval_with_backward":  # e.g. input saliency in eval mode: grad amax too
        mlp.eval()
        step(mlp, x.requires_grad_())
    elif mode == "no_grad":
        with torch.no_grad():
            mlp(x)
    else:
        with torch.inference_mode():
            mlp(x)
    assert_same(histories(mlp), before)


def test_read_only_forward_uses_the_history_as_a_training_forward_would():
    mlp = model()
    step(mlp, torch.randn(8, 32))
    trained = copy.deepcopy(mlp)
    x = torch.randn(8, 32) * 3
    with torch.no_grad():
        got = mlp.eval()(x)
    want = trained(x)  # records, but scales from the history as it was before the call
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    pairs = zip(histories(trained), histories(mlp), strict=True)
    assert not all(torch.equal(a, b) for a, b in pairs)  # the training forward did record


def test_first_read_only_call_scales_by_the_current_amax_without_recording():
    delayed, dynamic = model(DELAYED), model(Float8Config())
    x = torch.randn(8, 32)
    with torch.no_grad():
        got = delayed(x)
        want = dynamic(x)
    # An all-zero history: the current amax, exactly what dynamic scaling uses.
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert all(h.abs().sum() == 0 for h in histories(delayed))


def test_validation_between_steps_does_not_change_training():
    plain, validated = model(), model()
    for i in range(3):
        x = torch.randn(8, 32)
        torch.testing.assert_close(step(validated, x), step(plain, x), rtol=0, atol=0)
        validated.eval()
        with torch.no_grad():
            validated(torch.randn(8, 32) * (10 + i))
        validated.train()
    assert_same(histories(validated), histories(plain))
    for p, q in zip(validated.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_reentrant_checkpoint_records_once_with_the_same_scales():
    plain, ckpt = model(), model()
    for _ in range(3):
        x = torch.randn(8, 32)
        step(plain, x)
        # use_reentrant=True: first pass under no_grad (reads), recompute in backward (records).
        out = checkpoint(ckpt, x.requires_grad_(), use_reentrant=True)
        out.square().sum().backward()
    assert_same(histories(ckpt), histories(plain))  # three entries, not six
    for p, q in zip(ckpt.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_delayed_amax_record_false_is_read_only():
    history = torch.tensor([0.0, 0.0, 0.0])
    assert delayed_amax(history, torch.tensor(2.0), record=False).item() == 2.0
    assert history.tolist() == [0.0, 0.0, 0.0]
    delayed_amax(history, torch.tensor(3.0))
    assert delayed_amax(history, torch.tensor(9.0), record=False).item() == 3.0
    assert history.tolist() == [3.0, 0.0, 0.0]


# ----------------------------------------------------------------------------- dtype


@pytest.mark.parametrize(
    "convert",
    [
        lambda m: m.half(),
        lambda m: m.bfloat16(),
        lambda m: m.to(torch.float16),
        lambda m: m.to(dtype=torch.bfloat16),
        lambda m: m.double(),
    ],
    ids=["half", "bfloat16", "to-fp16", "to-dtype-bf16", "double"],
)
def test_dtype_conversions_keep_histories_float32_and_exact(convert):
    mlp = model(Float8Config(scaling="delayed", amax_history_len=4, persist_amax_history=True))
    big = torch.randn(8, 32)
    big[0, 0] = 1e5  # above fp16's max (65504): an fp16 history would hold inf
    step(mlp, big)
    step(mlp, torch.randn(8, 32))
    before = histories(mlp)
    assert mlp[0].input_amax_history.max().item() == 1e5
    converted = convert(mlp)
    assert converted is mlp
    lp_dtype = mlp[0].weight.dtype
    assert lp_dtype != torch.float32 and mlp[0].bias.dtype == lp_dtype  # parameters did convert
    assert all(h.dtype == torch.float32 for h in histories(mlp))
    assert_same(histories(mlp), before)
    assert mlp.state_dict()["0.input_amax_history"].dtype == torch.float32
    x = torch.randn(4, 32, dtype=lp_dtype)
    out = step(mlp, x)  # scale 448 / 1e5 from the history: finite (an inf amax gives nan)
    assert out.dtype == lp_dtype and bool(torch.isfinite(out).all())
    assert mlp[0].input_amax_history[2].item() == 1e5  # shifted by one entry, still exact
    assert mlp[0].input_amax_history[0] == tensor_to_amax(x)


def test_device_moves_still_apply_to_histories():
    mlp = model()
    step(mlp, torch.randn(8, 32))
    moved = copy.deepcopy(mlp).to("meta")
    assert all(h.device.type == "meta" and h.dtype == torch.float32 for h in histories(moved))
    both = copy.deepcopy(mlp).to("meta", torch.bfloat16)  # device and dtype in one call
    assert both[0].weight.dtype == torch.bfloat16 and both[0].weight.device.type == "meta"
    assert all(h.device.type == "meta" and h.dtype == torch.float32 for h in histories(both))
    empty = moved.to_empty(device="cpu")
    assert all(h.device.type == "cpu" and h.dtype == torch.float32 for h in histories(empty))
    dynamic = model(Float8Config()).half()  # no histories: nothing to keep
    assert dynamic[0].input_amax_history is None and dynamic[0].weight.dtype == torch.float16


def _skipping_run(bias: bool, bad_step: int, steps: int) -> tuple[list[bool], list[torch.Tensor]]:
    """An fp8-delayed Booster run with an inf target at bad_step: (skipped per step, params
    after the bad step)."""
    import mixprec

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32, bias=bias), nn.ReLU(), nn.Linear(32, 16, bias=bias))
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    precision = mixprec.FP8MixedPrecision(config=DELAYED)
    mlp, opt, crit, _, _ = mixprec.Booster(mixed_precision=precision).boost(mlp, opt, nn.MSELoss())
    skipped, after_bad = [], []
    for i in range(steps):
        gen = torch.Generator(torch.get_default_device()).manual_seed(i)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
        if i == bad_step:
            y[0, 0] = float("inf")
            before = [p.detach().clone() for p in mlp.parameters()]
        opt.zero_grad()
        opt.backward(crit(mlp(x), y))
        skipped.append(opt.step().skipped)
        if i == bad_step:
            after_bad = [p.detach().clone() for p in mlp.parameters()]
            assert_same(after_bad, before)
    for history in histories(mlp):
        assert bool(torch.isfinite(history).all()), history
    return skipped, after_bad


def test_an_inf_gradient_is_skipped_though_a_delayed_scale_is_finite():
    """The cast saturates: with the history's finite scale an inf gradient left as +-fp8_max,
    and a bias-free model (no high-precision grad to show the inf) stepped on an inf loss."""
    skipped, _ = _skipping_run(bias=False, bad_step=2, steps=3)
    assert skipped == [False, False, True]


@pytest.mark.parametrize("bias", [True, False])
def test_one_overflow_skips_one_step_not_the_next_history_len(bias):
    """A non-finite amax is not recorded: before, an inf in the history zeroed every scale
    and skipped the next amax_history_len steps as well."""
    skipped, _ = _skipping_run(bias=bias, bad_step=1, steps=2 + 2 * DELAYED.amax_history_len)
    assert skipped == [False, True] + [False] * (2 * DELAYED.amax_history_len)
