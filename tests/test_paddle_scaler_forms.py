"""mixprec.paddle.GradScaler in torch's forms, which Paddle's development branch (and its docs'
torch-style examples) take beside Paddle's order: GradScaler('cpu', ...) and
GradScaler(device='cpu', init_scale=...). A str or torch.device first is the device, never
`enable`; what stays ambiguous is refused with the reason."""

from __future__ import annotations

import pytest
import torch

from mixprec import paddle as amp


def _trajectory(scaler: amp.GradScaler, pattern: list[bool]) -> list[float]:
    """Drive the scale rule through a found-inf pattern; the scale after each update."""
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.0)
    out = []
    for overflow in pattern:
        scaler.scale((param * (float("inf") if overflow else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out.append(float(scaler.get_scale()))
    return out


PATTERN = [False, True, False, False, False, True, True, False, False, False]


@pytest.mark.parametrize(
    "torch_form",
    [
        lambda: amp.GradScaler("cpu", 1024.0, 4.0, 0.25, 3),
        lambda: amp.GradScaler(torch.device("cpu"), 1024.0, 4.0, 0.25, 3),
        lambda: amp.GradScaler(
            device="cpu",
            init_scale=1024.0,
            growth_factor=4.0,
            backoff_factor=0.25,
            growth_interval=3,
        ),
        lambda: amp.GradScaler(
            "cpu", init_scale=1024.0, incr_ratio=4.0, decr_ratio=0.25, growth_interval=3
        ),
    ],
)
def test_torch_forms_are_paddles_scaler(torch_form) -> None:
    paddle_form = amp.GradScaler(True, 1024.0, 4.0, 0.25, 3, device="cpu")
    scaler = torch_form()
    assert scaler.is_enable() and scaler.state_dict() == paddle_form.state_dict()
    assert _trajectory(scaler, PATTERN) == _trajectory(paddle_form, PATTERN)


def test_torch_positional_enabled_and_a_float_first() -> None:
    """torch's sixth positional after a device is enabled; a float first is torch's
    init_scale (torch.cuda.amp.GradScaler's order), as Paddle's development branch reads them."""
    assert not amp.GradScaler("cpu", 1024.0, 2.0, 0.5, 10, False).is_enable()
    scaler = amp.GradScaler(512.0, 4.0, 0.25, 3, device="cpu")
    assert (
        scaler.state_dict() == amp.GradScaler(True, 512.0, 4.0, 0.25, 3, device="cpu").state_dict()
    )


def test_enabled_by_keyword_after_a_device() -> None:
    scaler = amp.GradScaler("cpu", enabled=False)
    assert not scaler.is_enable()
    loss = torch.ones(())
    assert scaler.scale(loss) is loss
    assert not amp.GradScaler("cpu", enable=False).is_enable()  # Paddle's spelling works too


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: amp.GradScaler("cpu", device="cpu"), ValueError, "device twice: 'cpu'"),
        (
            lambda: amp.GradScaler("cpu", 1024.0, 2.0, 0.5, 10, True, 2),
            TypeError,
            "at most 5 values after the device",
        ),
        (
            lambda: amp.GradScaler("cpu", 1024.0, 2.0, 0.5, 10, False, enabled=True),
            ValueError,
            "enabled=False as torch's fifth value",
        ),
        (lambda: amp.GradScaler("gpu0"), ValueError, "device='gpu0' is not a torch device"),
        (lambda: amp.GradScaler(device="nodev"), ValueError, "device='nodev' is not a torch"),
        (
            lambda: amp.GradScaler("cpu", enable=True, enabled=False),
            ValueError,
            "enable=True and enabled=False",
        ),
        (lambda: amp.GradScaler(1), TypeError, "enable=1 must be a bool"),
        (lambda: amp.GradScaler(enable="cpu"), TypeError, "pass the device by keyword"),
    ],
)
def test_ambiguous_forms_are_refused(call, error, match) -> None:
    with pytest.raises(error, match=match):
        call()
