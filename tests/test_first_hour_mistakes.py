"""The first-hour mistakes of issue 24: each one either trains right or says so, never silently.

Each test reproduces a mistake as a new user makes it (from the README's loops) and checks
that the run now raises or warns naming the fix, or trains like the plain reference.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_mlp
from tolerances import EXACT

from mixprec import GradScaler
from mixprec.amp import convert_to_amp
from mixprec.booster import Booster
from mixprec.mixed_precision import FP16ApexMixedPrecision, FP16NaiveMixedPrecision

WIDTH = 16
SCALING = ["fp16", "fp16_naive", "O1", "O2"]
"""Modes whose optimizer scales the loss itself (Booster's names; O1/O2: Apex through it)."""


def _precision(mode: str):
    if mode == "fp16_naive":  # a small first scale: the test's steps are not skipped
        return FP16NaiveMixedPrecision(initial_scale=2.0**8)
    if mode in ("O1", "O2"):
        return FP16ApexMixedPrecision(opt_level=mode)
    return mode


def _boost(mode: str, model: torch.nn.Module | None = None, lr: float = 0.1):
    model = tiny_mlp(WIDTH) if model is None else model
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    booster = Booster(device="cpu", mixed_precision=_precision(mode))
    model, optimizer, criterion, _, _ = booster.boost(model, optimizer, torch.nn.MSELoss())
    return booster, model, optimizer, criterion


def _batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, 4, generator=g)


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in model.parameters()]


pytestmark = pytest.mark.filterwarnings("ignore::mixprec.core.amp_warning.AmpHardwareWarning")


# ----- 1. plain loss.backward() under a loss-scaling mode -----
@pytest.mark.parametrize("mode", SCALING)
def test_plain_backward_in_a_scaling_mode_is_refused(mode: str) -> None:
    # On main fp16 stepped an update 65536x too small and fp16_naive one 256x too small.
    _, model, optimizer, criterion = _boost(mode)
    before = _weights(model)
    x, y = _batch()
    criterion(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"did not come through .* scaled backward.*Call"):
        optimizer.step()
    for a, b in zip(_weights(model), before, strict=True):
        torch.testing.assert_close(a, b, **EXACT)  # refused before anything moved


@pytest.mark.parametrize("mode", ["bf16", "fp32"])
def test_plain_backward_without_loss_scaling_trains_as_booster_backward(mode: str) -> None:
    # Nothing to unscale: loss.backward() and booster.backward() give the same update.
    model = tiny_mlp(WIDTH)
    runs = []
    for use_booster in (True, False):
        booster, m, opt, crit = _boost(mode, copy.deepcopy(model))
        x, y = _batch()
        for _ in range(2):
            loss = crit(m(x), y)
            booster.backward(loss, opt) if use_booster else loss.backward()
            opt.step()
            opt.zero_grad()
        runs.append(_weights(m))
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, **EXACT)


@pytest.mark.parametrize("mode", ["fp16", "fp16_naive"])
def test_scaled_backward_accumulates_over_several_calls(mode: str) -> None:
    # Gradient accumulation: several booster.backward calls, one step, then a plain backward is
    # refused again (the flag lives from backward to step).
    booster, model, optimizer, criterion = _boost(mode)
    x, y = _batch()
    for half in (slice(0, 4), slice(4, 8)):
        booster.backward(criterion(model(x[half]), y[half]), optimizer)
    assert not optimizer.step().skipped
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    with pytest.raises(RuntimeError, match="scaled backward"):
        optimizer.step()
    optimizer.zero_grad()  # a zero_grad forgets the refused grads: the loop may go on
    booster.backward(criterion(model(x), y), optimizer)
    assert not optimizer.step().skipped


def test_plain_backward_refused_by_the_clip_too() -> None:
    # clip_grad_norm unscales: it must not unscale grads that were never scaled either.
    _, model, optimizer, criterion = _boost("fp16")
    x, y = _batch()
    criterion(model(x), y).backward()
    with pytest.raises(RuntimeError, match="scaled backward"):
        optimizer.clip_grad_norm(1.0)


def test_plain_backward_with_convert_to_amp_is_refused() -> None:
    raw = tiny_mlp(WIDTH)
    model, optimizer, _ = convert_to_amp(
        raw, torch.optim.SGD(raw.parameters(), lr=0.1), None, "fp16"
    )
    x, y = _batch()
    torch.nn.functional.mse_loss(model(x).float(), y).backward()
    with pytest.raises(RuntimeError, match=r"optimizer.backward\(loss\)"):
        optimizer.step()


# ----- 2. an outside GradScaler stacked on an optimizer that scales already -----
@pytest.mark.parametrize("mode", ["fp16", "fp16_naive"])
def test_mixprec_grad_scaler_on_a_scaling_optimizer_is_refused(mode: str) -> None:
    # On main: fp16 stepped an update 65536x too small; fp16_naive hit torch's unrelated
    # "No inf checks were recorded for this optimizer".
    _, model, optimizer, criterion = _boost(mode)
    scaler = GradScaler("cpu")
    x, y = _batch()
    scaler.scale(criterion(model(x), y)).backward()
    with pytest.raises(RuntimeError, match="GradScaler .* scales the loss itself.*Drop"):
        scaler.unscale_(optimizer)  # before clipping, as torch's docs write it
    with pytest.raises(RuntimeError, match="GradScaler .* scales the loss itself"):
        scaler.step(optimizer)


def test_torch_grad_scaler_on_a_scaling_optimizer_is_refused() -> None:
    _, model, optimizer, criterion = _boost("fp16")
    before = _weights(model)
    scaler = torch.amp.GradScaler("cpu")
    x, y = _batch()
    scaler.scale(criterion(model(x), y)).backward()
    with pytest.raises(RuntimeError, match="outside GradScaler"):
        scaler.step(optimizer)
    for a, b in zip(_weights(model), before, strict=True):
        torch.testing.assert_close(a, b, **EXACT)


@pytest.mark.parametrize("mode", ["bf16", "fp32"])
def test_grad_scaler_on_an_optimizer_that_does_not_scale_still_trains(mode: str) -> None:
    # The legitimate stack: the optimizer scales nothing, the GradScaler scales once.
    model = tiny_mlp(WIDTH)
    runs = []
    for with_scaler in (True, False):
        booster, m, opt, crit = _boost(mode, copy.deepcopy(model))
        scaler = GradScaler("cpu", init_scale=2.0**4)  # a power of two: exact round trip
        x, y = _batch()
        loss = crit(m(x), y)
        if with_scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            booster.backward(loss, opt)
            opt.step()
        runs.append(_weights(m))
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, **EXACT)


# ----- 3. a model already in bf16/fp16 given to a mode that keeps fp32 weights -----
@pytest.mark.parametrize("mode", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_low_precision_model_trains_like_its_fp32_copy(mode: str, low, caplog) -> None:
    # On main a bf16 model in Booster('bf16') at lr=1e-4 moved 4 of 676 weights in 20 steps
    # (a pure-bf16 update, no fp32 masters). Now it is cast up, said at WARNING, and trains
    # exactly as the same values given in fp32.
    low_model = tiny_mlp(WIDTH).to(low)
    fp32_model = copy.deepcopy(low_model).float()
    initial = _weights(fp32_model)
    runs = []
    for model in (low_model, fp32_model):
        caplog.clear()
        with caplog.at_level("WARNING", logger="mixprec"):
            booster, m, opt, crit = _boost(mode, model, lr=1e-4)
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        if model is low_model:
            assert any(
                f"mode {mode!r} trains fp32 weights" in w and "fp16_naive" in w for w in warned
            ), warned
        else:
            assert not any("trains fp32 weights" in w for w in warned)
        assert {p.dtype for p in m.parameters()} == {torch.float32}
        x, y = _batch()
        for _ in range(3):
            booster.backward(crit(m(x), y), opt)
            opt.step()
            opt.zero_grad()
        runs.append(_weights(m))
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, **EXACT)
    assert all(not torch.equal(a, b) for a, b in zip(runs[0], initial, strict=True))


def test_bf16_model_in_convert_to_amp_bf16_gets_fp32_weights(caplog) -> None:
    raw = tiny_mlp(WIDTH).bfloat16()
    with caplog.at_level("WARNING", logger="mixprec"):
        model, optimizer, _ = convert_to_amp(
            raw, torch.optim.SGD(raw.parameters(), lr=1e-4), None, "bf16"
        )
    assert "mode 'bf16' trains fp32 weights" in caplog.text
    assert all(p.dtype == torch.float32 for g in optimizer.param_groups for p in g["params"])


# ----- 4. torch's clip_grad_norm_ between booster.backward and step -----
@pytest.mark.parametrize("mode", ["fp16", "fp16_naive"])
def test_torch_clip_of_scaled_grads_warns_and_the_own_clip_does_not(mode: str, caplog) -> None:
    # On main the update came out ~56,000x too small in fp16, without a word.
    booster, model, optimizer, criterion = _boost(mode)
    x, y = _batch()
    with caplog.at_level("WARNING", logger="mixprec"):
        booster.backward(criterion(model(x), y), optimizer)
        optimizer.clip_grad_norm(1.0)  # the optimizer's own clip unscales first: no warning
        optimizer.step()
        optimizer.zero_grad()
        assert "changed in place" not in caplog.text
        booster.backward(criterion(model(x), y), optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    warned = [r.getMessage() for r in caplog.records if "changed in place" in r.getMessage()]
    assert len(warned) == 1 and "optimizer.clip_grad_norm(max_norm)" in warned[0]


# ----- 5. fp8 on a model with nothing to convert -----
class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.head = torch.nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x))).mean(dim=(2, 3))


def test_fp8_with_nothing_to_convert_warns(caplog) -> None:
    # On main: fp8_summary said "0 converted, 0 left" and nothing was logged; the run was bf16.
    with caplog.at_level("WARNING", logger="mixprec"):
        Booster(device="cpu", mixed_precision="fp8").boost(ConvNet())
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(
        "nothing in ConvNet was converted" in w and "nn.Linear" in w and "'bf16'" in w
        for w in warned
    ), warned


def test_fp8_with_a_linear_to_convert_says_nothing_of_the_kind(caplog) -> None:
    with caplog.at_level("WARNING", logger="mixprec"):
        Booster(device="cpu", mixed_precision="fp8").boost(tiny_mlp(WIDTH))
    assert "was converted" not in caplog.text


# ----- 6. cross-mode resume: exact in either load order, no scale carried where none is used -----
def _train_and_save(mode: str, where, steps: int = 3):
    booster, model, optimizer, criterion = _boost(mode, lr=0.05)
    x, y = _batch()
    for _ in range(steps):
        booster.backward(criterion(model(x), y), optimizer)
        optimizer.step()
        optimizer.zero_grad()
    booster.save_model(model, where / "model.pt")
    booster.save_optimizer(optimizer, where / "optim.pt")
    return model, optimizer


def _held(optimizer) -> list[torch.Tensor]:
    """What the optimizer steps (fp32 masters or fp32 params), as fp32 copies."""
    return [p.detach().float().clone() for g in optimizer.param_groups for p in g["params"]]


@pytest.mark.parametrize("model_first", [True, False])
@pytest.mark.parametrize(("saved", "resumed"), [("bf16", "fp16_naive"), ("fp16_naive", "bf16")])
def test_cross_mode_resume_is_exact_in_either_order(saved, resumed, model_first, tmp_path):
    # On main bf16 -> fp16_naive in the README's order (load_model, then load_optimizer) rebuilt
    # the masters from the fp16 params (max error 1.2e-4, an INFO line).
    _, old_optimizer = _train_and_save(saved, tmp_path)
    want = _held(old_optimizer)
    torch.manual_seed(7)  # the resumed model starts elsewhere: the checkpoint must win
    booster, model, optimizer, _ = _boost(resumed, lr=0.05)
    loads = [
        lambda: booster.load_model(model, tmp_path / "model.pt"),
        lambda: booster.load_optimizer(optimizer, tmp_path / "optim.pt"),
    ]
    for load in loads if model_first else loads[::-1]:
        load()
    for a, b in zip(_held(optimizer), want, strict=True):
        torch.testing.assert_close(a, b, **EXACT)


def test_fp16_naive_scale_is_not_carried_into_bf16(tmp_path, caplog) -> None:
    # On main the 2**30 scale of an fp16_naive run came over into bf16, which never scales.
    _train_and_save("fp16_naive", tmp_path)
    booster, model, optimizer, criterion = _boost("bf16")
    with caplog.at_level("WARNING", logger="mixprec"):
        booster.load_optimizer(optimizer, tmp_path / "optim.pt")
    assert optimizer.loss_scale == 1.0
    assert "dropped the checkpoint's loss scale 2**8" in caplog.text
    x, y = _batch()
    booster.backward(criterion(model(x), y), optimizer)
    assert optimizer.step().scale == 1.0


def test_bf16_checkpoint_leaves_fp16_naive_its_own_scale(tmp_path) -> None:
    # bf16 saved a static 1.0; a dynamic fp16 scale resumed at 1.0 would underflow fp16 grads.
    _train_and_save("bf16", tmp_path)
    booster, model, optimizer, _ = _boost("fp16_naive")
    fresh = optimizer.loss_scale
    booster.load_optimizer(optimizer, tmp_path / "optim.pt")
    assert optimizer.loss_scale == fresh == 2.0**8


# ----- 8. a step() with no gradients is a no-op step, counted as such -----
@pytest.mark.parametrize("mode", ["fp16", "bf16", "fp16_naive"])
def test_step_without_grads_is_counted_as_a_noop(mode: str) -> None:
    # On main skip_stats counted it as a step, and the skip-aware LR schedule advanced on it.
    raw = tiny_mlp(WIDTH)
    opt = torch.optim.SGD(raw.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    booster = Booster(device="cpu", mixed_precision=_precision(mode))
    model, optimizer, criterion, _, sched = booster.boost(
        raw, opt, torch.nn.MSELoss(), lr_scheduler=sched
    )
    x, y = _batch()
    booster.backward(criterion(model(x), y), optimizer)
    assert not optimizer.step().noop
    sched.step()
    optimizer.zero_grad()
    before = _weights(model)
    result = optimizer.step()  # no backward since zero_grad: nothing to step
    sched.step()
    assert result.noop and not result.skipped
    stats = booster.skip_stats(optimizer)
    assert (stats.steps, stats.noop_steps, stats.skipped_steps) == (1, 1, 0)
    assert sched.get_last_lr() == [0.05]  # advanced once, for the one real step
    for a, b in zip(_weights(model), before, strict=True):
        torch.testing.assert_close(a, b, **EXACT)
