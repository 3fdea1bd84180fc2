"""mixprec.GradScaler held against torch.amp.GradScaler's documented behaviour, side by side.

Each test names the torch behaviour it mirrors and runs the same script through both scalers
(mixprec's with its defaults, hysteresis=1, is torch's update rule); the last tests cover what
mixprec adds: floor, ceiling, hysteresis and a process group.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from dist_utils import spawn

from mixprec import GradScaler

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

PAIR = [torch.amp.GradScaler, GradScaler]


def make(cls: type, **kwargs: object) -> torch.amp.GradScaler:
    return cls(torch.get_default_device().type, **kwargs)


def model_and_opt(seed: int = 0) -> tuple[torch.nn.Linear, torch.optim.SGD]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def one_step(scaler: torch.amp.GradScaler, model, opt, overflow: bool) -> None:
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 4)).square().mean()).backward()
    if overflow:
        model.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()


def scales_after(scaler: torch.amp.GradScaler, pattern: str, seed: int = 0) -> list[float]:
    """Run one step per character ('x' overflows, '.' is clean); the scale after each."""
    model, opt = model_and_opt(seed)
    out = []
    for c in pattern:
        one_step(scaler, model, opt, overflow=c == "x")
        out.append(scaler.get_scale())
    return out


def test_setters_drive_update() -> None:
    # torch: set_growth_factor/set_backoff_factor/set_growth_interval change what update() does.
    runs = []
    for cls in PAIR:
        scaler = make(cls, init_scale=64.0, growth_interval=100)
        scaler.set_backoff_factor(0.25)
        scaler.set_growth_factor(4.0)
        scaler.set_growth_interval(1)
        runs.append(scales_after(scaler, "x."))
    assert runs[0] == runs[1] == [16.0, 64.0]


def test_load_state_dict_factors_drive_update(device: str) -> None:
    # torch: load_state_dict restores the factors and the interval, and update() uses them,
    # whatever the loading scaler was constructed with.
    source = torch.amp.GradScaler(device, init_scale=64.0, growth_factor=4.0, backoff_factor=0.25)
    source.set_growth_interval(1)
    runs = []
    for cls in PAIR:
        scaler = make(cls, init_scale=2.0, growth_factor=2.0, growth_interval=50)
        scaler.load_state_dict(source.state_dict())
        runs.append(scales_after(scaler, "x.."))
    assert runs[0] == runs[1] == [16.0, 64.0, 256.0]


def test_getters_match_torch() -> None:
    # get_scale is init_scale before the first scale(), 1.0 when disabled; the other getters
    # return what the constructor, a setter or load_state_dict gave.
    kw = dict(init_scale=8.0, growth_factor=3.0, backoff_factor=0.125, growth_interval=7)
    for enabled in (True, False):
        a, b = (make(cls, enabled=enabled, **kw) for cls in PAIR)
        assert a.is_enabled() == b.is_enabled() == enabled
        assert a.get_scale() == b.get_scale()
        if enabled:
            for get in ("get_growth_factor", "get_backoff_factor", "get_growth_interval"):
                assert getattr(a, get)() == getattr(b, get)()
            a.set_growth_interval(9)
            b.set_growth_interval(9)
            assert a.get_growth_interval() == b.get_growth_interval() == 9


def test_setters_reject_values_torch_would_misuse(device: str) -> None:
    # mixprec validates what torch's setters store blindly (a factor <= 1 would shrink on growth).
    # The messages name the call the user made (a torch user never sees mixprec's ScalerConfig).
    scaler = GradScaler(device)
    with pytest.raises(
        ValueError, match=r"GradScaler.set_growth_factor: new_factor=1.0 must be > 1"
    ):
        scaler.set_growth_factor(1.0)
    with pytest.raises(ValueError, match=r"set_backoff_factor: new_factor=2.0 must be in \(0, 1\)"):
        scaler.set_backoff_factor(2.0)
    with pytest.raises(
        TypeError, match="set_growth_interval: new_interval must be an int, got 2.5"
    ):
        scaler.set_growth_interval(2.5)
    assert scaler.get_growth_factor() == 2.0  # a refused value is not stored


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        ("hysteresis", 0, ValueError),
        ("growth_factor", 0.5, ValueError),
        ("dynamic", "no", TypeError),
    ],
)
def test_load_state_dict_names_the_bad_entry(key: str, value: object, error: type) -> None:
    # A bad entry in a loaded state_dict is named as the user passed it, and nothing is loaded.
    scaler = GradScaler("cpu", init_scale=2.0**10)
    state = scaler.state_dict() | {"scale": 4.0, key: value}
    with pytest.raises(error, match=rf"GradScaler.load_state_dict: state_dict\['{key}'\]") as info:
        scaler.load_state_dict(state)
    assert "ScalerConfig" not in str(info.value)
    assert scaler.get_scale() == 2.0**10 and scaler.state_dict()["hysteresis"] == 1


@pytest.mark.parametrize("direction", ["mixprec->torch", "torch->mixprec"])
def test_state_dict_round_trips_with_torch(direction: str) -> None:
    # A state_dict saved by one scaler resumes in the other: same scale, same tracker, same
    # trajectory afterwards (torch ignores mixprec's extra keys).
    src_cls, dst_cls = PAIR[::-1] if direction == "mixprec->torch" else PAIR
    kw = dict(init_scale=2.0**10, growth_interval=3)
    src = make(src_cls, **kw)
    scales_after(src, ".x.")
    state = src.state_dict()
    dst = make(dst_cls)  # other constructor arguments: the checkpoint wins
    dst.load_state_dict(state)
    assert dst.get_scale() == src.get_scale() and dst.get_growth_interval() == 3
    assert scales_after(dst, "..x...") == scales_after(src, "..x...")
    for key in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"):
        assert dst.state_dict()[key] == src.state_dict()[key]


def test_disabled_state_dict_is_empty_and_refused_like_torch() -> None:
    # torch: a disabled scaler saves {} and an enabled one refuses an empty state_dict.
    for cls in PAIR:
        assert make(cls, enabled=False).state_dict() == {}
        make(cls, enabled=False).load_state_dict({"scale": 3.0})  # a no-op when disabled
        with pytest.raises(RuntimeError, match="source state dict is empty"):
            make(cls).load_state_dict({})


def test_pickling_mid_run_keeps_every_tracker(device: str) -> None:
    # torch: pickling between iterations keeps scale and growth tracker; mixprec also keeps
    # the hysteresis tracker (one overflow of three tolerated already spent).
    scaler = GradScaler(device, init_scale=64.0, hysteresis=3, growth_interval=10)
    scales_after(scaler, "..x")
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == scaler.state_dict()
    assert clone.state_dict()["_hysteresis_tracker"] == 2
    # two units left: one more overflow is tolerated, the next backs off (a reset tracker
    # would tolerate two and give [64, 64, 64, 32])
    assert scales_after(clone, "xx.x") == [64.0, 32.0, 32.0, 16.0]


def test_pickling_mid_iteration_is_refused_like_torch() -> None:
    for cls in PAIR:
        scaler = make(cls)
        model, opt = model_and_opt()
        scaler.scale(model(torch.ones(1, 4)).sum()).backward()
        scaler.unscale_(opt)
        with pytest.raises(AssertionError, match="only be pickled at the beginning"):
            pickle.dumps(scaler)


def test_disabled_is_a_passthrough_like_torch() -> None:
    # torch: scale() returns its input, step() is optimizer.step(*args, **kwargs) (closures
    # included), update() does nothing, get_scale() is 1.0.
    results = []
    for cls in PAIR:
        scaler = make(cls, enabled=False)
        model, opt = model_and_opt()
        loss = model(torch.ones(2, 4)).sum()
        assert scaler.scale(loss) is loss

        def closure(model=model, opt=opt) -> torch.Tensor:
            opt.zero_grad()
            out = model(torch.ones(2, 4)).sum()
            out.backward()
            return out

        ret = scaler.step(opt, closure)
        scaler.update()
        assert scaler.get_scale() == 1.0
        results.append((float(ret.detach()), model.weight.detach().clone()))
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)


def test_closure_is_refused_when_enabled_like_torch() -> None:
    for cls in PAIR:
        scaler = make(cls)
        model, opt = model_and_opt()
        scaler.scale(model(torch.ones(1, 4)).sum()).backward()
        with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
            scaler.step(opt, closure=lambda: None)


def test_update_new_scale_sets_it_and_keeps_trackers() -> None:
    # torch: update(new_scale) fills the scale from a float or a one-element tensor and leaves
    # the growth tracker; mixprec leaves the hysteresis tracker too.
    for cls in PAIR:
        scaler = make(cls, init_scale=64.0, growth_interval=3)
        scales_after(scaler, "..")
        before = scaler.state_dict()
        scaler.update(5.0)
        assert scaler.get_scale() == 5.0
        scaler.update(torch.tensor(7.0))
        after = scaler.state_dict()
        assert after["scale"] == 7.0 and after["_growth_tracker"] == before["_growth_tracker"] == 2
        if isinstance(scaler, GradScaler):
            assert after["_hysteresis_tracker"] == before["_hysteresis_tracker"]
        with pytest.raises(AssertionError, match="new_scale should be a float or a 1-element"):
            scaler.update(torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize(
    ("script", "error", "message"),
    [
        ("step_no_grads", AssertionError, "No inf checks were recorded for this optimizer"),
        ("update_without_step", AssertionError, "No inf checks were recorded prior to update"),
        ("step_twice", RuntimeError, "step\\(\\) has already been called since the last"),
        ("unscale_twice", RuntimeError, "unscale_\\(\\) has already been called"),
        ("unscale_after_step", RuntimeError, "unscale_\\(\\) is being called after step"),
        ("step_before_scale", AssertionError, "Attempted step but _scale is None"),
        ("fp16_grads", ValueError, "Attempting to unscale FP16 gradients"),
    ],
)
def test_errors_match_torch(script: str, error: type, message: str) -> None:
    for cls in PAIR:
        scaler = make(cls)
        model, opt = model_and_opt()
        if script == "fp16_grads":
            model.half()
            scaler.scale(model(torch.ones(1, 4).half()).float().sum()).backward()
        elif script == "step_no_grads":
            scaler.scale(torch.ones((), requires_grad=True))  # a scale exists, no param has a grad
        elif script != "step_before_scale":
            scaler.scale(model(torch.ones(1, 4)).sum()).backward()
        with pytest.raises(error, match=message):
            if script in ("step_no_grads", "step_before_scale"):
                scaler.step(opt)
            elif script == "update_without_step":
                scaler.update()
            elif script == "step_twice":
                scaler.step(opt)
                scaler.step(opt)
            elif script == "unscale_twice":
                scaler.unscale_(opt)
                scaler.unscale_(opt)
            elif script == "unscale_after_step":
                scaler.step(opt)
                scaler.unscale_(opt)
            else:
                scaler.unscale_(opt)


def test_skipped_step_changes_nothing_like_torch() -> None:
    # torch: an inf/nan gradient skips optimizer.step(); weights and Adam state stay bit for bit.
    for cls in PAIR:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.Adam(model.parameters())
        scaler = make(cls)
        one_step(scaler, model, opt, overflow=False)
        weights = [p.detach().clone() for p in model.parameters()]
        state = copy.deepcopy(opt.state_dict())
        one_step(scaler, model, opt, overflow=True)
        for a, b in zip(model.parameters(), weights, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for i, s in state["state"].items():
            for key, value in s.items():
                torch.testing.assert_close(opt.state_dict()["state"][i][key], value, rtol=0, atol=0)


# ----- what mixprec adds -----
def test_floor_and_ceiling(device: str) -> None:
    # torch's scale halves without a bound and doubles up to fp32's max; mixprec clamps both.
    low = GradScaler(device, init_scale=4.0, min_scale=2.0)
    assert scales_after(low, "xxx") == [2.0, 2.0, 2.0]
    high = GradScaler(device, init_scale=4.0, growth_interval=1, max_scale=16.0)
    assert scales_after(high, "....") == [8.0, 16.0, 16.0, 16.0]


def test_hysteresis_tolerates_overflows_and_round_trips(device: str) -> None:
    # hysteresis=2: the first overflow of a run only spends it; a growth refills it.
    scaler = GradScaler(device, init_scale=64.0, hysteresis=2, growth_interval=2)
    assert scales_after(scaler, "xx..x") == [64.0, 32.0, 32.0, 64.0, 64.0]
    other = GradScaler(device)
    other.load_state_dict(scaler.state_dict())
    assert other.cfg.hysteresis == 2 and other.state_dict() == scaler.state_dict()


def test_torch_state_dict_into_hysteresis_scaler_starts_full(device: str) -> None:
    # torch's state_dict has no hysteresis: the loading scaler keeps its own, tracker full.
    torch_scaler = torch.amp.GradScaler(device, init_scale=32.0, growth_interval=5)
    scales_after(torch_scaler, ".")
    scaler = GradScaler(device, hysteresis=3, min_scale=4.0)
    scales_after(scaler, "x")  # spends one unit of hysteresis before the load
    scaler.load_state_dict(torch_scaler.state_dict())
    state = scaler.state_dict()
    assert (state["scale"], state["_growth_tracker"], state["_hysteresis_tracker"]) == (32.0, 1, 3)
    assert (state["hysteresis"], state["min_scale"]) == (3, 4.0)


def test_static_scale_survives_a_round_trip(device: str) -> None:
    scaler = GradScaler(device, init_scale=8.0, dynamic=False)
    other = GradScaler(device)
    other.load_state_dict(scaler.state_dict())
    assert scales_after(other, "x.x") == [8.0, 8.0, 8.0]


def _rank_without_grads(rank: int, world: int) -> None:
    # Rank 1's optimizer has no gradient; rank 0 overflows. Rank 1 joins the all-reduce, warns,
    # and both ranks skip and back off alike (torch would raise on rank 1 and hang rank 0).
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(torch.get_default_device().type, init_scale=16.0)
    loss = model(torch.ones(2, 4)).sum()
    if rank == 0:
        scaler.scale(loss).backward()
        model.weight.grad[0, 0] = float("inf")
    else:
        scaler.scale(loss)  # the scale exists, but no backward reaches the params
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler.step(opt)
    scaler.update()
    said = [str(w.message) for w in caught if "No inf checks were recorded" in str(w.message)]
    assert len(said) == (rank == 1), f"rank {rank}: {said}"
    assert scaler.get_scale() == 8.0, f"rank {rank} did not back off"
    for a, b in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.distributed
def test_rank_without_grads_joins_the_reduction_and_warns() -> None:
    spawn(_rank_without_grads, 2)


def test_a_scaler_pickled_by_an_older_mixprec_still_loads(device: str) -> None:
    # Older pickles held the settings as `cfg` and no hysteresis value: they load, tracker full.
    scaler = GradScaler(device, init_scale=32.0, hysteresis=2)
    state = scaler.__getstate__()
    state["cfg"] = state.pop("_base_cfg")
    del state["_init_hysteresis_tracker"]
    old = GradScaler.__new__(GradScaler)
    old.__setstate__(state)
    assert (old.cfg.hysteresis, old.get_scale()) == (2, 32.0)
    assert scales_after(old, "xx") == [32.0, 16.0]
