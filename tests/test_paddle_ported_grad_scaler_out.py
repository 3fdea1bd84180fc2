"""Port of PaddlePaddle/Paddle test/amp/test_grad_scaler_out.py
(commit 4c3533d7cdc6189280be2547db28f0ddb8411f0d): GradScaler's torch-style forms.

Changed throughout: Paddle reads private attributes (_enable, _init_loss_scaling, ...); here
the public getters Paddle also has (is_enable, get_init_loss_scaling, ...). 'cuda' becomes
'cpu' (no GPU here). Every scaler here is built with device='cpu' where Paddle names none:
mixprec's default is 'cuda' when a GPU is visible. Deselected, each with its reason below.
"""

from __future__ import annotations

import pytest

from mixprec.paddle import GradScaler

GETTERS = {
    "enable": "is_enable",
    "init_loss_scaling": "get_init_loss_scaling",
    "incr_ratio": "get_incr_ratio",
    "decr_ratio": "get_decr_ratio",
    "incr_every_n_steps": "get_incr_every_n_steps",
    "decr_every_n_nan_or_inf": "get_decr_every_n_nan_or_inf",
    "use_dynamic_loss_scaling": "is_use_dynamic_loss_scaling",
}


def check(scaler: GradScaler, **expected: object) -> None:
    for key, value in expected.items():
        assert getattr(scaler, GETTERS[key])() == value, key


def test_default_values() -> None:
    check(
        GradScaler(device="cpu"),
        enable=True,
        init_loss_scaling=2.0**16,
        incr_ratio=2.0,
        decr_ratio=0.5,
        incr_every_n_steps=2000,
        decr_every_n_nan_or_inf=1,
        use_dynamic_loss_scaling=True,
    )


def test_pytorch_style_kwargs() -> None:
    scaler = GradScaler(
        enabled=True,
        init_scale=1024.0,
        growth_factor=3.0,
        backoff_factor=0.25,
        growth_interval=500,
        device="cpu",
    )
    check(scaler, enable=True, init_loss_scaling=1024.0, incr_ratio=3.0, decr_ratio=0.25)
    check(scaler, incr_every_n_steps=500)


def test_mixed_kwargs() -> None:
    scaler = GradScaler(
        enable=True,
        init_loss_scaling=1024.0,
        growth_factor=3.0,
        decr_ratio=0.25,
        growth_interval=500,
        device="cpu",
    )
    check(scaler, init_loss_scaling=1024.0, incr_ratio=3.0, decr_ratio=0.25)
    check(scaler, incr_every_n_steps=500)


def test_single_alias_each() -> None:
    assert not GradScaler(enabled=False, device="cpu").is_enable()
    assert GradScaler(init_scale=512.0, device="cpu").get_init_loss_scaling() == 512.0
    assert GradScaler(growth_factor=5.0, device="cpu").get_incr_ratio() == 5.0
    assert GradScaler(backoff_factor=0.1, device="cpu").get_decr_ratio() == 0.1
    assert GradScaler(growth_interval=100, device="cpu").get_incr_every_n_steps() == 100


def test_positional_args() -> None:
    check(
        GradScaler(True, 1024.0, 3.0, 0.25, 500, 2, True, device="cpu"),
        enable=True,
        init_loss_scaling=1024.0,
        incr_ratio=3.0,
        decr_ratio=0.25,
        incr_every_n_steps=500,
        decr_every_n_nan_or_inf=2,
    )


def test_positional_with_alias_kwarg() -> None:
    check(
        GradScaler(True, 1024.0, growth_factor=5.0, device="cpu"),
        enable=True,
        init_loss_scaling=1024.0,
        incr_ratio=5.0,
    )


def test_non_aliased_with_aliases() -> None:
    check(
        GradScaler(
            enabled=True,
            init_scale=2048.0,
            decr_every_n_nan_or_inf=3,
            use_dynamic_loss_scaling=False,
            device="cpu",
        ),
        enable=True,
        init_loss_scaling=2048.0,
        decr_every_n_nan_or_inf=3,
        use_dynamic_loss_scaling=False,
    )


def test_pytorch_vs_paddle_equivalence() -> None:
    pt = GradScaler(
        enabled=True,
        init_scale=1024.0,
        growth_factor=3.0,
        backoff_factor=0.25,
        growth_interval=500,
        device="cpu",
    )
    pd = GradScaler(
        enable=True,
        init_loss_scaling=1024.0,
        incr_ratio=3.0,
        decr_ratio=0.25,
        incr_every_n_steps=500,
        device="cpu",
    )
    for getter in list(GETTERS.values())[:5]:
        assert getattr(pt, getter)() == getattr(pd, getter)(), getter


@pytest.mark.parametrize(
    "kwargs",
    [
        {"enable": True, "enabled": False},
        {"init_loss_scaling": 1024.0, "init_scale": 2048.0},
        {"incr_ratio": 2.0, "growth_factor": 3.0},
        {"decr_ratio": 0.5, "backoff_factor": 0.25},
        {"incr_every_n_steps": 1000, "growth_interval": 2000},
    ],
)
def test_conflict_raises_error(kwargs) -> None:
    with pytest.raises(ValueError):
        GradScaler(**kwargs, device="cpu")


def test_torch_positional_no_device() -> None:
    check(
        GradScaler(1024.0, 3.0, 0.25, 500, True, device="cpu"),
        enable=True,
        init_loss_scaling=1024.0,
        incr_ratio=3.0,
        decr_ratio=0.25,
        incr_every_n_steps=500,
    )


def test_torch_positional_no_device_disabled() -> None:
    scaler = GradScaler(1024.0, 2.0, 0.5, 2000, False, device="cpu")
    assert not scaler.is_enable()
    assert scaler.get_init_loss_scaling() == 1.0


def test_torch_positional_with_device() -> None:
    check(
        GradScaler("cpu", 1024.0, 3.0, 0.25, 500, True),
        enable=True,
        init_loss_scaling=1024.0,
        incr_ratio=3.0,
        decr_ratio=0.25,
        incr_every_n_steps=500,
    )


def test_torch_device_kwarg() -> None:
    # Paddle: "device kwarg is silently ignored"; mixprec places the scale on it (kept, as
    # the scaler's device is honoured, not dropped)
    check(
        GradScaler(device="cpu", init_scale=2048.0, growth_factor=3.0),
        init_loss_scaling=2048.0,
        incr_ratio=3.0,
    )


def test_torch_device_string_with_kwargs() -> None:
    check(GradScaler("cpu", init_scale=512.0, enabled=True), enable=True, init_loss_scaling=512.0)


def test_torch_positional_partial() -> None:
    check(
        GradScaler(4096.0, device="cpu"),
        init_loss_scaling=4096.0,
        incr_ratio=2.0,
        decr_ratio=0.5,
        incr_every_n_steps=2000,
    )


def test_torch_device_string_only() -> None:
    check(
        GradScaler("cpu"),
        enable=True,
        init_loss_scaling=2.0**16,
        incr_ratio=2.0,
        decr_ratio=0.5,
        incr_every_n_steps=2000,
    )


def test_torch_device_string_partial_positional() -> None:
    check(
        GradScaler("cpu", 1024.0),
        enable=True,
        init_loss_scaling=1024.0,
        incr_ratio=2.0,
        decr_ratio=0.5,
        incr_every_n_steps=2000,
    )


def test_torch_positional_with_kwarg_disabled() -> None:
    scaler = GradScaler(1024.0, enabled=False, device="cpu")
    assert not scaler.is_enable()
    assert scaler.get_init_loss_scaling() == 1.0


def test_disabled_scaler() -> None:
    scaler = GradScaler(enabled=False, device="cpu")
    assert not scaler.is_enable()
    assert scaler.get_init_loss_scaling() == 1.0


# TestGradScalerPytorchCompatMethods


def test_is_enabled() -> None:
    assert GradScaler(enabled=True, device="cpu").is_enabled()
    assert not GradScaler(enabled=False, device="cpu").is_enabled()


def test_get_scale() -> None:
    assert GradScaler(init_scale=2048.0, device="cpu").get_scale() == 2048.0
    # changed: Paddle's development branch returns 0.0 for a disabled scaler; mixprec keeps
    # torch.amp.GradScaler's 1.0 (its get_scale contract, which mixprec's scaler inherits)
    assert GradScaler(enabled=False, device="cpu").get_scale() == 1.0


@pytest.mark.parametrize(
    ("torch_name", "paddle_name", "first", "second"),
    [
        ("growth_factor", "incr_ratio", 3.0, 5.0),
        ("backoff_factor", "decr_ratio", 0.25, 0.1),
        ("growth_interval", "incr_every_n_steps", 500, 100),
    ],
)
def test_torch_getters_and_setters(torch_name, paddle_name, first, second) -> None:
    scaler = GradScaler(**{torch_name: first}, device="cpu")
    assert getattr(scaler, f"get_{torch_name}")() == first
    getattr(scaler, f"set_{torch_name}")(second)
    assert getattr(scaler, f"get_{torch_name}")() == second
    assert getattr(scaler, f"get_{paddle_name}")() == second


# Deselected: TestGradScalerCallPathsAndInheritance. paddle.device.amp.GradScaler /
# paddle.cuda.amp.GradScaler are Paddle's module paths (mixprec's face is mixprec.paddle), and
# AmpScaler (Paddle's older scaler with other defaults) is not part of mixprec.paddle.
