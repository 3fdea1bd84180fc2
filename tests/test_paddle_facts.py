"""mixprec.paddle against facts recorded from a real PaddlePaddle 3.3.1 (CPU, numpy 2.4).

tests/data/paddle_331_facts.json was written by tests/data/record_paddle_331_facts.py in a venv
of its own (pip install paddlepaddle==3.3.1). Paddle's AMP is a no-op on CPU, so its GradScaler
was built with the place check bypassed to record its state and arithmetic.
"""

from __future__ import annotations

import inspect
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import CountHostSyncs
from torch import nn

import mixprec
from mixprec import paddle as amp

FACTS = json.loads((Path(__file__).parent / "data" / "paddle_331_facts.json").read_text())


def params_of(fn) -> list[tuple[str, object]]:
    """(name, default) of fn's parameters, as the recorder wrote them (no default: None)."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self" or p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        out.append((p.name, None if p.default is inspect.Parameter.empty else p.default))
    return out


def recorded(name: str) -> list[tuple[str, object]]:
    return [(n, d) for n, d, _ in FACTS["signatures"][name]]


# ----- GradScaler -----


def test_grad_scaler_signature_is_paddles_in_paddles_order() -> None:
    assert params_of(amp.GradScaler.__init__) == recorded("paddle.amp.GradScaler")
    assert params_of(amp.GradScaler) == recorded("paddle.amp.GradScaler")  # what IDEs show
    for name in FACTS["grad_scaler_methods"]:
        assert callable(getattr(amp.GradScaler, name)), name


def test_positional_enable_false_is_a_disabled_scaler() -> None:
    scaler = amp.GradScaler(False)
    assert not scaler.is_enable() and not scaler.is_use_dynamic_loss_scaling()
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss
    assert scaler.state_dict() == FACTS["disabled_state_dict"] == {}
    scaler.load_state_dict({"scale": np.array([1.0])})  # Paddle: a no-op on a disabled scaler
    scaler = amp.GradScaler(True, 1024.0, 3.0, 0.25, 7, 2, False, device="cpu")
    assert (scaler.get_init_loss_scaling(), scaler.get_incr_ratio()) == (1024.0, 3.0)
    assert (scaler.get_decr_ratio(), scaler.get_incr_every_n_steps()) == (0.25, 7)
    assert scaler.get_decr_every_n_nan_or_inf() == 2
    assert scaler.is_enable() and not scaler.is_use_dynamic_loss_scaling()


def test_a_device_passed_first_is_the_device() -> None:
    """torch's form, which Paddle's development branch takes: a str first is no `enable`
    (more forms and refusals: test_paddle_scaler_forms.py)."""
    scaler = amp.GradScaler("cpu")
    assert scaler.is_enable() and scaler.state_dict() == amp.GradScaler(device="cpu").state_dict()
    with pytest.raises(TypeError, match=r"enable='cpu' must be a bool.*device='cpu'"):
        amp.GradScaler(enable="cpu")  # named enable: still refused, with the keyword to use


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"enable": True, "enabled": False}, ["enable=True", "enabled=False", "only one"]),
        ({"init_loss_scaling": 8.0, "init_scale": 8.0}, ["init_loss_scaling=8.0", "init_scale"]),
        ({"decr_every_n_nan_or_inf": 2, "hysteresis": 3}, ["decr_every_n_nan_or_inf=2"]),
    ],
)
def test_an_alias_beside_its_paddle_name_is_refused(kwargs, words) -> None:
    with pytest.raises(ValueError) as err:
        amp.GradScaler(device="cpu", **kwargs)
    for word in words:
        assert word in str(err.value)
    with pytest.raises(ValueError, match="enable=True"):
        amp.GradScaler(True, enabled=False)  # positional counts as given
    assert not amp.GradScaler(enabled=False).is_enable()  # the alias alone is fine


def test_getters_defaults_and_setters_match_paddle() -> None:
    scaler = amp.GradScaler(device="cpu")
    for getter, value in FACTS["defaults"].items():
        assert getattr(scaler, getter)() == value, getter
    scaler.scale(torch.tensor(1.0))
    scaler.set_init_loss_scaling(512)
    assert scaler.get_scale() == FACTS["after_set_init_loss_scaling_512_scale"] == 512.0
    scaler.set_incr_ratio(4.0)
    scaler.set_decr_ratio(0.25)
    scaler.set_incr_every_n_steps(3)
    scaler.set_decr_every_n_nan_or_inf(5)
    assert (scaler.get_incr_ratio(), scaler.get_decr_ratio()) == (4.0, 0.25)
    assert (scaler.get_incr_every_n_steps(), scaler.get_decr_every_n_nan_or_inf()) == (3, 5)
    # Paddle refuses these with AssertionError; mixprec with ValueError naming the value
    assert FACTS["set_incr_ratio_bad"].startswith("AssertionError")
    assert FACTS["set_decr_ratio_bad"].startswith("AssertionError")
    with pytest.raises(ValueError, match="growth_factor"):
        scaler.set_incr_ratio(1.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        scaler.set_decr_ratio(1.0)
    with pytest.raises(ValueError, match="new_init_loss_scaling=0"):
        scaler.set_init_loss_scaling(0)


def test_state_dict_has_paddles_keys_and_values() -> None:
    state = amp.GradScaler(device="cpu").state_dict()
    paddle_state = FACTS["state_dict"]
    assert set(paddle_state) <= set(state)
    for key, value in paddle_state.items():
        got = [state[key]] if key == "scale" else state[key]  # Paddle: a shape-[1] array
        assert got == value, key
        assert type(state[key]).__name__ == (
            "float" if key == "scale" else FACTS["state_dict_types"][key]
        ), key


def drive(scaler: amp.GradScaler, pattern: list[bool]) -> list[list[float]]:
    """scale/step/update with a gradient that is inf on the bad steps; per step
    [scale, incr_count, decr_count] as Paddle's recorder read them."""
    param = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.0)
    out = []
    for overflow in pattern:
        opt.zero_grad()
        scaler.scale((param * (math.inf if overflow else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        state = scaler.state_dict()
        out.append([state["scale"], state["incr_count"], state["decr_count"]])
    return out


@pytest.mark.parametrize("case", sorted(FACTS["dygraph_trajectories"]))
def test_scale_trajectory_is_paddles_step_for_step(case: str) -> None:
    fact = FACTS["dygraph_trajectories"][case]
    expected = fact["scale_incr_decr"]
    # Paddle's dygraph scaler has no floor (its static kernel floors at 1, mixprec's default)
    floor = 2.0**-60 if min(s for s, _, _ in expected) < 1 else 1.0
    scaler = amp.GradScaler(device="cpu", min_scale=floor, **fact["kwargs"])
    # exact: products of small integers and powers of two, in fp32 on both sides
    assert drive(scaler, fact["pattern"]) == expected


def test_state_dict_round_trips_in_both_layouts() -> None:
    pattern = FACTS["dygraph_trajectories"]["rand_d2_i3"]
    kwargs = pattern["kwargs"]
    scaler = amp.GradScaler(device="cpu", **kwargs)
    drive(scaler, pattern["pattern"][:7])
    saved = scaler.state_dict()
    rest = pattern["pattern"][7:]
    expected = drive(scaler, rest)
    # Paddle's layout, as Paddle's state_dict() gives it: scale a float32 array of shape [1]
    paddle_layout = {k: saved[k] for k in FACTS["state_dict"]}
    paddle_layout["scale"] = np.array([saved["scale"]], dtype=np.float32)
    resumed = amp.GradScaler(device="cpu")
    resumed.load_state_dict(paddle_layout)
    assert resumed.get_decr_every_n_nan_or_inf() == kwargs["decr_every_n_nan_or_inf"]
    assert drive(resumed, rest) == expected
    # torch's layout (torch.amp.GradScaler's keys) loads too, and torch loads mixprec's
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(saved)
    assert torch_scaler.get_scale() == saved["scale"]
    assert torch_scaler.get_growth_interval() == kwargs["incr_every_n_steps"]
    from_torch = amp.GradScaler(device="cpu")
    from_torch.load_state_dict(torch_scaler.state_dict())
    assert from_torch.state_dict()["scale"] == saved["scale"]
    assert from_torch.state_dict()["incr_count"] == saved["incr_count"]
    with pytest.raises(RuntimeError, match="empty"):
        amp.GradScaler(device="cpu").load_state_dict({})
    with pytest.raises(KeyError, match="decr_count"):
        amp.GradScaler(device="cpu").load_state_dict(
            {k: v for k, v in paddle_layout.items() if k != "decr_count"}
        )


def test_bf16_auto_cast_switches_a_dynamic_scaler_off() -> None:
    fact = FACTS["bf16"]
    scaler = amp.GradScaler(device="cpu", init_loss_scaling=1024.0)
    with amp.auto_cast(dtype="bfloat16"):
        pass  # Paddle keeps the last auto_cast's dtype after it exits
    with pytest.warns(UserWarning, match="bfloat16.*disabled"):
        out = scaler.scale(torch.tensor(3.0))
    assert fact["warning"] and "bfloat16" in fact["warning"][0]
    assert out.item() == fact["scaled_3"] == 3.0
    assert scaler.is_enable() is fact["is_enable"] is False
    assert scaler.is_use_dynamic_loss_scaling() is fact["is_use_dynamic"] is False
    assert scaler.get_init_loss_scaling() == fact["init_loss_scaling"] == 1.0
    assert scaler.state_dict() == fact["state_dict"] == {}
    # a static scale is kept in bf16; an fp16 auto_cast keeps a dynamic one
    static = amp.GradScaler(device="cpu", init_loss_scaling=1024.0, use_dynamic_loss_scaling=False)
    assert static.scale(torch.tensor(3.0)).item() == FACTS["bf16_static_scale_3"] == 3072.0
    assert static.is_enable() is FACTS["bf16_static_is_enable"] is True
    with amp.auto_cast(dtype="float16"):
        pass
    fp16 = amp.GradScaler(device="cpu", init_loss_scaling=1024.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fp16.scale(torch.tensor(3.0)).item() == FACTS["fp16_after_scale_3"] == 3072.0


def test_minimize_returns_no_ops_and_the_params_grads() -> None:
    assert FACTS["minimize_return_disabled"][:2] == ["tuple", 2]
    assert FACTS["minimize_return_skipped"][:2] == ["tuple", "[]"]
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler(device="cpu", init_loss_scaling=8.0)
    for poison in (math.inf, 1.0):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        scaled = scaler.scale(model(torch.ones(1, 2)).mean() * poison)
        scaled.backward()
        ops, params_grads = scaler.minimize(opt, scaled)
        assert ops == [] and [p for p, _ in params_grads] == list(model.parameters())
        assert all(g is p.grad for p, g in params_grads)
        moved = [not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)]
        assert all(moved) is (poison == 1.0)  # the inf step is skipped, the clean one is not
    # Paddle's skipped step still returns the (param, nan grad) pairs
    assert all(nan for _, _, nan in FACTS["minimize_return_skipped"][2])


def test_decorated_o2_step_checks_once_and_syncs_once(monkeypatch) -> None:
    """decorate's fp32-master optimizer takes the GradScaler's finite check (issue #29)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.decorate(model, opt, level="O2", dtype="bfloat16")
    scaler = amp.GradScaler(device="cpu", init_loss_scaling=8.0, use_dynamic_loss_scaling=False)
    checks = []
    original = torch._amp_foreach_non_finite_check_and_unscale_

    def counted(*args, **kwargs):
        checks.append(len(args[0]))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", counted)
    for poison in (1.0, math.inf):
        before = [hp.detach().clone() for hp in opt.hp_masters]
        loss = model(torch.ones(3, 4, dtype=torch.bfloat16)).float().pow(2).mean() * poison
        scaler.scale(loss).backward()
        checks.clear()
        syncs = CountHostSyncs(monkeypatch)
        scaler.step(opt)
        monkeypatch.undo()
        assert checks == [4] and len(syncs.calls) == 1, (checks, syncs.calls)
        skipped = all(torch.equal(b, hp) for b, hp in zip(before, opt.hp_masters, strict=True))
        assert skipped is (poison == math.inf)
        scaler.update()
        opt.zero_grad()
        monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", counted)
    assert opt.skip_stats.skipped_steps == 1


def test_core_grad_scaler_stays_torchs() -> None:
    scaler = mixprec.GradScaler("cpu")
    assert scaler.is_enabled() and scaler.get_growth_interval() == 2000


def test_paddle_scaler_trains_a_decorated_model_like_the_unscaled_reference() -> None:
    """fp16 O2 with a power-of-two scale: the same masters as a loop without any scaler."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    runs = []
    for scaled in (True, False):
        model = nn.Sequential(*[m for m in __import__("copy").deepcopy(base)])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.decorate(model, opt, level="O2", dtype="float16")
        scaler = amp.GradScaler(scaled, 1024.0, device="cpu")
        for _ in range(3):
            with amp.auto_cast(level="O2"):
                loss = F.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        runs.append([hp.detach().clone() for hp in opt.hp_masters])
    # power-of-two scale, no fp16 overflow or underflow here: scaling is exact
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_auto_cast_and_decorate_signatures_are_paddles() -> None:
    assert params_of(amp.auto_cast.__init__) == recorded("paddle.amp.auto_cast")
    # decorate's `models` has no default, which the recorder wrote as None
    assert params_of(amp.decorate) == recorded("paddle.amp.decorate")
    with pytest.raises(TypeError, match="use_promote"):
        amp.auto_cast(use_promote="yes")


def test_o2_promote_on_a_decorated_model_runs_only_fp32_fed_ops_in_fp32() -> None:
    """decorate(O2) + auto_cast(O2): the white-listed Linear runs low on an fp32 input (the
    white list wins), relu follows its low input, the loss against an fp32 label promotes."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model = amp.decorate(model, level="O2", dtype="bfloat16")
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    with amp.auto_cast(level="O2", dtype="bfloat16"):
        h = model(x)
        loss = F.mse_loss(h, y)
    assert h.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert loss.item() == F.mse_loss(h.float(), y).item()  # computed from the same values
    with amp.auto_cast(level="O2", dtype="bfloat16", use_promote=False):
        assert F.mse_loss(model(x), y).dtype == torch.bfloat16  # the seed's older O2


def test_pickled_scaler_keeps_paddles_counters() -> None:
    import pickle

    fact = FACTS["dygraph_trajectories"]["rand_d2_i3"]
    scaler = amp.GradScaler(device="cpu", **fact["kwargs"])
    drive(scaler, fact["pattern"][:9])
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy.state_dict() == scaler.state_dict()
    assert drive(copy, fact["pattern"][9:]) == fact["scale_incr_decr"][9:]
