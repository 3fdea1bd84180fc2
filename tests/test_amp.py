"""convert_to_amp (Colossal-AI's face): each mode against its raw-torch twin and fp32."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_mlp

from mixprec import AMP_TYPE, convert_to_amp

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

CE = torch.nn.CrossEntropyLoss()


def data(steps: int = 6, n: int = 16):
    gen = torch.Generator(torch.get_default_device()).manual_seed(3)
    return [
        (torch.randn(n, 8, generator=gen), torch.randint(0, 4, (n,), generator=gen))
        for _ in range(steps)
    ]


def amp_run(mode, cfg=None, steps=6, opt_cls=torch.optim.SGD):
    torch.manual_seed(0)
    model = tiny_mlp()
    model, opt, crit = convert_to_amp(model, opt_cls(model.parameters(), lr=0.05), CE, mode, cfg)
    losses = []
    for x, y in data(steps):
        opt.zero_grad()
        loss = crit(model(x), y)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return model, opt, losses


def twin_run(dtype, scaler=None, steps=6, opt_cls=torch.optim.SGD):
    """The loop a user writes with plain torch.autocast (+ torch.amp.GradScaler for fp16)."""
    torch.manual_seed(0)
    model = tiny_mlp()
    opt = opt_cls(model.parameters(), lr=0.05)
    for x, y in data(steps):
        opt.zero_grad()
        with torch.autocast(torch.get_default_device().type, dtype=dtype):
            out = model(x)
        loss = CE(out.float(), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return model


def assert_same_params(a, b) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_torch_mode_equals_autocast_plus_grad_scaler_exactly(device: str) -> None:
    model, opt, _ = amp_run(AMP_TYPE.TORCH, {"init_scale": 2.0**10}, opt_cls=torch.optim.Adam)
    twin = twin_run(
        torch.float16, torch.amp.GradScaler(device, init_scale=2.0**10), opt_cls=torch.optim.Adam
    )
    assert_same_params(model.module, twin)
    assert opt.loss_scale == 2.0**10


def test_bf16_mode_equals_plain_autocast_loop_exactly() -> None:
    model, _, _ = amp_run("bf16")
    assert_same_params(model.module, twin_run(torch.bfloat16))


def test_fp32_mode_equals_plain_loop_exactly() -> None:
    model, _, _ = amp_run("fp32")
    torch.manual_seed(0)
    ref = tiny_mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for x, y in data():
        opt.zero_grad()
        CE(ref(x), y).backward()
        opt.step()
    assert_same_params(model.module, ref)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_naive_mode_casts_model_keeps_norm_fp32_and_tracks_fp32(dtype: str) -> None:
    # Start low enough that no step overflows, so the comparison with fp32 is step for step.
    model, opt, losses = amp_run(
        AMP_TYPE.NAIVE, {"initial_scale": 2.0**8, "dtype": dtype}, steps=20
    )
    low = getattr(torch, dtype)
    assert model.module[0].weight.dtype == low and model.module[1].weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    assert model(torch.randn(2, 8)).dtype == torch.float32  # outputs cast back (Colossal default)
    _, _, ref_losses = amp_run("fp32", steps=20)
    # Both start from the same fp32 init; the low-precision forward differs by ~1e-2 relative
    # (bf16 has 8 mantissa bits), which the masters keep from compounding over 20 SGD steps.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0.03, atol=0.03)
    assert opt.skipped_steps == 0


def test_naive_default_scale_backs_off_with_hysteresis() -> None:
    # 2**32 overflows fp16 gradients at once; hysteresis 2 spends one overflow, then halves.
    _, opt, _ = amp_run(AMP_TYPE.NAIVE, steps=3)
    assert opt.skipped_steps == 3
    assert opt.loss_scale == 2.0**30


def test_colossal_optimizer_clip_grad_norm_signature() -> None:
    model = tiny_mlp()
    model, opt, crit = convert_to_amp(
        model, torch.optim.SGD(model.parameters(), lr=0.1), CE, AMP_TYPE.TORCH
    )
    x, y = data(1)[0]
    opt.backward(crit(model(x), y))
    norm = opt.clip_grad_norm(model, 1.0)
    assert torch.isfinite(norm)
    opt.step()


@pytest.mark.parametrize("mode", [AMP_TYPE.TORCH, AMP_TYPE.NAIVE, AMP_TYPE.APEX])
def test_clip_grad_norm_takes_either_form_and_refuses_a_mix(mode) -> None:
    """Colossal's (model, max_norm) and the core's (max_norm, norm_type=...) give one norm;
    (1.0, 2.0) is neither (it clipped at 2.0 before, the 1.0 dropped): refused."""
    norms = []
    for form in ("colossal", "core"):
        torch.manual_seed(0)
        model = tiny_mlp()
        model, opt, crit = convert_to_amp(
            model, torch.optim.SGD(model.parameters(), lr=0.1), CE, mode
        )
        x, y = data(1)[0]
        opt.backward(crit(model(x), y))
        if form == "colossal":
            norms.append(opt.clip_grad_norm(model, 0.5))
        else:
            norms.append(opt.clip_grad_norm(0.5, norm_type=2.0))
        with pytest.raises(TypeError, match="model first"):
            opt.clip_grad_norm(1.0, 2.0)
    # bitwise; NAIVE's first step overflows at 2**32 (a nan norm in both forms)
    torch.testing.assert_close(norms[0], norms[1], rtol=0, atol=0, equal_nan=True)


def test_criterion_runs_in_fp32_inside_autocast(device: str) -> None:
    model = tiny_mlp()
    model, _, crit = convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1), CE, "bf16")
    x, y = data(1)[0]
    out = model(x)
    assert out.dtype == torch.bfloat16
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = crit(out, y)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, CE(out.float(), y), rtol=0, atol=0)


@pytest.mark.parametrize(
    "mode, cfg, match",
    [
        (
            AMP_TYPE.TORCH,
            {"init_scal": 2.0},
            "Unknown AMP_TYPE.TORCH config key 'init_scal'.*'init_scale'",
        ),
        (
            AMP_TYPE.NAIVE,
            {"init_scale": 2.0},
            "Unknown AMP_TYPE.NAIVE config key 'init_scale'.*'initial_scale'",
        ),
        ("bf17", None, "Unknown mixed-precision mode 'bf17'.*'bf16'"),
        (AMP_TYPE.APEX, {"opt_level": "O4"}, "Unknown opt_level 'O4'.*'O0', 'O1', 'O2', 'O3'"),
        (AMP_TYPE.APEX, {"num_losses": 0}, "num_losses=0"),
        (AMP_TYPE.TORCH, {"dtype": "float8"}, "dtype='float8' is not a low-precision dtype"),
    ],
)
def test_bad_config_names_value_and_choices(mode, cfg, match) -> None:
    model = tiny_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1), CE, mode, cfg)
    for key, value in model.state_dict().items():  # refused before the model is touched
        assert value.dtype == before[key].dtype and torch.equal(value, before[key]), key


@pytest.mark.parametrize(
    "mode, match",
    [
        # issue 39 fault 5: None was taken as fp32, silently; Colossal asserts an AMP_TYPE
        (None, r"mode=None\); valid: AMP_TYPE.TORCH, AMP_TYPE.APEX, AMP_TYPE.NAIVE.*'fp32'"),
        (2, r"mode=2\); valid: AMP_TYPE.TORCH"),
    ],
)
def test_mode_of_wrong_type_is_refused_naming_the_modes(mode, match) -> None:
    model = tiny_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match=match):
        convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1), CE, mode)
    for key, value in model.state_dict().items():  # refused before the model is touched
        assert value.dtype == before[key].dtype and torch.equal(value, before[key]), key


def test_apex_mode_o2_casts_model_with_masters() -> None:
    model = tiny_mlp()
    ref = copy.deepcopy(model)
    model, opt, _ = convert_to_amp(
        model, torch.optim.SGD(model.parameters(), lr=0.1), CE, AMP_TYPE.APEX, {"opt_level": "O2"}
    )
    assert (
        model.module[0].weight.dtype == torch.float16
        and model.module[1].weight.dtype == torch.float32
    )
    torch.testing.assert_close(opt.hp_masters[0], ref[0].weight.half().float(), rtol=0, atol=0)
