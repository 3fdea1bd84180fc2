"""The seeds' switches that used to be ignored: num_losses/loss_id, NAIVE verbose, verbosity=0."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import tiny_mlp

from mixprec import engine as mixprec_engine
from mixprec.amp import AMP_TYPE, convert_to_amp
from mixprec.apex import amp
from mixprec.booster import Booster
from mixprec.core.multi_loss import MultiLossOptimizer
from mixprec.mixed_precision import FP16ApexMixedPrecision, FP16NaiveMixedPrecision

WIDTH = 8  # fp16 matmuls are slow on CPU: tiny shapes


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, 4, generator=g)


def _two_losses(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, bad: bool = False):
    # two forwards: each loss has its own graph, as with two models or two heads
    loss1 = torch.nn.functional.mse_loss(model(x).float(), y)
    loss2 = model(x).float().abs().mean() * (float("inf") if bad else 1.0)
    return loss1, loss2


@pytest.fixture
def restore_mixprec_logger():
    logger = logging.getLogger("mixprec")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)


def _boosted(num_losses: int = 2, **kw):
    model = tiny_mlp(WIDTH)
    booster = Booster(
        mixed_precision=FP16ApexMixedPrecision(opt_level="O2", num_losses=num_losses, **kw)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt, *_ = booster.boost(model, opt)
    return booster, model, opt


def test_booster_num_losses_builds_a_scaler_per_loss_and_matches_apex_amp() -> None:
    ref = tiny_mlp(WIDTH)
    booster, model, opt = _boosted()
    model.module.load_state_dict(ref.state_dict())
    with torch.no_grad():  # the masters copied the pre-load weights: start both from ref
        for lp, hp in zip(opt.lp_params, opt.hp_masters, strict=True):
            hp.copy_(lp)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref, ref_opt = amp.initialize(ref, ref_opt, opt_level="O2", num_losses=2, verbosity=0)
    assert isinstance(opt, MultiLossOptimizer) and len(opt.scalers) == 2
    x, y = _batch()
    for _ in range(3):
        opt.zero_grad()
        loss1, loss2 = _two_losses(model, x, y)
        booster.backward(loss1, opt, loss_id=0)
        booster.backward(loss2, opt, loss_id=1)
        opt.step()
        ref_opt.zero_grad()
        ref_loss1, ref_loss2 = _two_losses(ref, x, y)
        with amp.scale_loss(ref_loss1, ref_opt, loss_id=0) as s:
            s.backward()
        with amp.scale_loss(ref_loss2, ref_opt, loss_id=1) as s:
            s.backward()
        ref_opt.step()
    # the same per-loss unscale as Apex's amp on the same fp16 math: exact
    for mine, theirs in zip(opt.hp_masters, ref_opt.hp_masters, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_an_overflow_in_one_loss_backs_off_that_scaler_alone_and_skips_bitwise() -> None:
    booster, model, opt = _boosted()
    x, y = _batch()
    loss1, loss2 = _two_losses(model, x, y)
    booster.backward(loss1, opt, loss_id=0)
    booster.backward(loss2, opt, loss_id=1)
    opt.step()  # one clean step so the momentum buffers exist
    before = copy.deepcopy(
        (opt.hp_masters, opt.lp_params, opt.optim.state_dict()["state"], opt.scalers[0].scale)
    )
    opt.zero_grad()
    loss1, loss2 = _two_losses(model, x, y, bad=True)
    booster.backward(loss1, opt, loss_id=0)
    booster.backward(loss2, opt, loss_id=1)
    result = opt.step()
    assert result.skipped and opt.skipped_steps == 1
    assert opt.scalers[0].scale == before[3] == 2.0**16
    assert opt.scalers[1].scale == 2.0**15  # Apex's backoff 0.5, this loss only
    after = (opt.hp_masters, opt.lp_params, opt.optim.state_dict()["state"])
    for old, new in zip(before[:2], after[:2], strict=True):
        for a, b in zip(old, new, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for key, buf in before[2].items():
        torch.testing.assert_close(after[2][key]["momentum_buffer"], buf["momentum_buffer"])


def test_config_dict_num_losses_reaches_engine_and_convert_to_amp() -> None:
    x, y = _batch()
    cfg = {"fp16": {"mode": AMP_TYPE.APEX, "opt_level": "O2", "num_losses": 2}}
    model = tiny_mlp(WIDTH)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = mixprec_engine.initialize(model, opt, config=cfg, verbose=False)
    assert isinstance(engine.optimizer, MultiLossOptimizer)
    loss1, loss2 = _two_losses(engine, x, y, bad=True)
    engine.backward(loss1, loss_id=0)
    engine.backward(loss2, loss_id=1)
    assert engine.step().skipped and engine.optimizer.scalers[1].scale == 2.0**15

    model = tiny_mlp(WIDTH)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = convert_to_amp(model, opt, None, AMP_TYPE.APEX, {"num_losses": 3})
    assert isinstance(opt, MultiLossOptimizer) and len(opt.scalers) == 3
    opt.backward(model(x).float().mean() * 1e-3, loss_id=2)
    assert not opt.step().skipped


def test_loss_id_is_checked() -> None:
    booster, model, opt = _boosted()
    x, _ = _batch()
    with pytest.raises(ValueError, match=r"loss_id=2 but num_losses=2: valid loss ids are 0..1"):
        booster.backward(model(x).sum(), opt, loss_id=2)
    with pytest.raises(TypeError, match=r"loss_id='0' must be an int"):
        booster.backward(model(x).sum(), opt, loss_id="0")
    booster, model, opt = _boosted(num_losses=1)
    assert isinstance(opt, MultiLossOptimizer)  # Apex's one path, one loss or several
    with pytest.raises(ValueError, match=r"loss_id=1 but num_losses=1: valid loss ids are 0..0"):
        booster.backward(model(x).sum(), opt, loss_id=1)


def test_multi_loss_state_dict_round_trips_every_scaler() -> None:
    booster, model, opt = _boosted()
    x, y = _batch()
    loss1, loss2 = _two_losses(model, x, y, bad=True)
    booster.backward(loss1, opt, loss_id=0)
    booster.backward(loss2, opt, loss_id=1)
    opt.step()
    state = opt.state_dict()
    _, _, fresh = _boosted()
    fresh.load_state_dict(state)
    assert [s.scale for s in fresh.scalers] == [2.0**16, 2.0**15]
    _, _, three = _boosted(num_losses=3)
    with pytest.raises(ValueError, match=r"num_losses=3; the checkpoint holds 2 per-loss"):
        three.load_state_dict(state)


def _overflow_once(opt, model, backward) -> None:
    x, _ = _batch()
    backward(model(x).float().sum() * float("inf"))
    opt.step()


@pytest.mark.parametrize("num_losses", [1, 2])
def test_verbosity_zero_silences_the_apex_switch_on_every_face(num_losses, caplog) -> None:
    caplog.set_level(logging.INFO, logger="mixprec")
    for verbosity in (0, 1):
        caplog.clear()
        booster, model, opt = _boosted(num_losses=num_losses, verbosity=verbosity)
        _overflow_once(opt, model, lambda loss: booster.backward(loss, opt))  # noqa: B023
        model = tiny_mlp(WIDTH)
        cfg = {"num_losses": num_losses, "verbosity": verbosity, "opt_level": "O2"}
        model, opt, _ = convert_to_amp(
            model, torch.optim.SGD(model.parameters(), lr=0.1), None, AMP_TYPE.APEX, cfg
        )
        _overflow_once(opt, model, opt.backward)
        messages = [r.getMessage() for r in caplog.records if r.name == "mixprec"]
        assert len(messages) == (0 if verbosity == 0 else 2), messages


def test_naive_verbose_prints_scale_changes(capsys, caplog, restore_mixprec_logger) -> None:
    caplog.set_level(logging.INFO, logger="mixprec")
    x, y = _batch()
    printed = {}
    for verbose in (False, True):
        caplog.clear()
        model = tiny_mlp(WIDTH)
        precision = FP16NaiveMixedPrecision(initial_scale=2.0**8, hysteresis=1, verbose=verbose)
        booster = Booster(mixed_precision=precision)
        model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.01))
        _overflow_once(opt, model, lambda loss: booster.backward(loss, opt))  # noqa: B023
        booster.backward(torch.nn.functional.mse_loss(model(x), y), opt)
        opt.step()
        printed[verbose] = [
            r.getMessage() for r in caplog.records if "loss scale" in r.getMessage()
        ]
    assert printed[False] == [m for m in printed[False] if "skipped step" in m]
    assert "mixprec: loss scale 256 -> 128 after step 1 (overflow)" in printed[True]
    assert "loss scale 256 -> 128" in capsys.readouterr().out  # verbose output reaches stdout


def test_naive_verbose_through_the_config_dict() -> None:
    model = tiny_mlp(WIDTH)
    cfg = {"mode": AMP_TYPE.NAIVE, "verbose": True}
    _, opt, _ = convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1), None, cfg)
    assert opt.verbosity == 2
    with pytest.raises(TypeError, match=r"verbose='yes' must be True, False or None"):
        convert_to_amp(model, opt.optim, None, AMP_TYPE.NAIVE, {"verbose": "yes"})


def test_naive_keeps_norms_fp32_unless_asked_for_the_seeds_all_fp16() -> None:
    x, _ = _batch()
    ref = tiny_mlp(WIDTH)  # Linear, LayerNorm, ReLU, Linear
    default = Booster(mixed_precision=FP16NaiveMixedPrecision())
    model, *_ = default.boost(copy.deepcopy(ref))
    assert model.module[1].weight.dtype == torch.float32
    seed = Booster(mixed_precision=FP16NaiveMixedPrecision(keep_norm_fp32=False))
    model = copy.deepcopy(ref)
    model, opt, *_ = seed.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert {m.dtype for m in opt.hp_masters} == {torch.float32}
    # every op in fp16, as raw torch runs a .half() model: exact
    expected = copy.deepcopy(ref).half()(x.half()).float()
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    cfg = {"mode": AMP_TYPE.NAIVE, "keep_norm_fp32": False}
    model = copy.deepcopy(ref)
    model, _, _ = convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1), None, cfg)
    assert model.module[1].weight.dtype == torch.float16
    with pytest.raises(TypeError, match=r"keep_norm_fp32='no' must be True or False"):
        FP16NaiveMixedPrecision(keep_norm_fp32="no")


def test_fsdp_refuses_several_losses_rather_than_ignoring_them() -> None:
    from dist_utils import free_port

    from mixprec.booster.plugin import TorchFSDPPlugin
    from mixprec.launch import destroy, launch

    launch({}, rank=0, world_size=1, host="127.0.0.1", port=free_port(), verbose=False)
    try:
        booster = Booster(
            mixed_precision=FP16ApexMixedPrecision(opt_level="O2", num_losses=2),
            plugin=TorchFSDPPlugin(),
        )
        model = tiny_mlp(WIDTH)
        with pytest.raises(ValueError, match=r"num_losses=2 is not supported with TorchFSDP"):
            booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    finally:
        destroy()
