"""paddle.amp.GradScaler's scale rule, step for step; the Colossal/torch faces keep Megatron's.

The reference below is Paddle's rule written out by hand (its update_loss_scaling kernel and
the dygraph GradScaler._update). Checked once by hand against real paddlepaddle 3.3.1 (CPU,
driving GradScaler._update with these patterns): identical scales at every step, except that
Paddle's dygraph scaler has no floor (its static-graph kernel floors at 1, as mixprec's
default min_scale=1 does; min_scale below 1 gives the dygraph trajectory, tested below).
"""

from __future__ import annotations

import random

import pytest
import torch

import mixprec
from mixprec import paddle as amp

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")


def paddle_rule(
    pattern: list[bool], init: float, decr_n: int, incr_n: int, floor: float = 1.0
) -> list[float]:
    """Paddle's update_loss_scaling written out by hand: scales after each step's update."""
    scale, good, bad, out = init, 0, 0, []
    for overflow in pattern:
        if overflow:
            good, bad = 0, bad + 1
            if bad == decr_n:
                scale, bad = max(scale * 0.5, floor), 0
        else:
            good, bad = good + 1, 0
            if good == incr_n:
                scale, good = scale * 2.0, 0
        out.append(scale)
    return out


def run_scaler(scaler: torch.amp.GradScaler, pattern: list[bool]) -> list[float]:
    """Drive scaler.scale/step/update with a gradient that is inf on the bad steps."""
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.0)
    out = []
    for overflow in pattern:
        opt.zero_grad()
        loss = (param * (float("inf") if overflow else 1.0)).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        out.append(float(scaler.get_scale()))
    return out


def test_issue_trajectory_is_paddles(device: str) -> None:
    pattern = [True, False, True, True, True]
    scaler = amp.GradScaler(device=device, init_loss_scaling=1024, decr_every_n_nan_or_inf=2)
    assert run_scaler(scaler, pattern) == [1024, 1024, 1024, 512, 512]
    assert paddle_rule(pattern, 1024, 2, 2000) == [1024, 1024, 1024, 512, 512]
    # the Colossal/torch face keeps Megatron's hysteresis: a clean step refills nothing
    core = mixprec.GradScaler(device, init_scale=1024, hysteresis=2)
    assert run_scaler(core, pattern) == [1024, 1024, 512, 256, 128]


@pytest.mark.parametrize("decr_n, incr_n", [(1, 2), (2, 3), (3, 1)])
def test_random_pattern_follows_paddles_rule_step_for_step(
    device: str, decr_n: int, incr_n: int
) -> None:
    rng = random.Random(decr_n * 10 + incr_n)
    pattern = [rng.random() < 0.45 for _ in range(40)]
    scaler = amp.GradScaler(
        device=device,
        init_loss_scaling=2.0**10,
        decr_every_n_nan_or_inf=decr_n,
        incr_every_n_steps=incr_n,
    )
    # powers of two: the scales are exact, so the comparison is too
    assert run_scaler(scaler, pattern) == paddle_rule(pattern, 2.0**10, decr_n, incr_n)


def test_floor_of_one_and_state_dict_carries_the_bad_count(device: str) -> None:
    scaler = amp.GradScaler(device=device, init_loss_scaling=2, decr_every_n_nan_or_inf=1)
    assert run_scaler(scaler, [True, True, True]) == [1, 1, 1]  # Paddle's floor: 1
    scaler = amp.GradScaler(device=device, init_loss_scaling=64, decr_every_n_nan_or_inf=2)
    run_scaler(scaler, [True])
    state = scaler.state_dict()
    assert state["decr_count"] == 1
    resumed = amp.GradScaler(device=device, init_loss_scaling=64, decr_every_n_nan_or_inf=2)
    resumed.load_state_dict(state)
    assert run_scaler(resumed, [True]) == [32]  # the saved bad step counts toward the back-off


def test_a_lower_floor_gives_paddles_floorless_dygraph_trajectory(device: str) -> None:
    rng = random.Random(12)
    pattern = [rng.random() < 0.6 for _ in range(40)]
    scaler = amp.GradScaler(
        device=device, init_loss_scaling=2.0**4, incr_every_n_steps=2, min_scale=2.0**-60
    )
    expected = paddle_rule(pattern, 2.0**4, 1, 2, floor=0.0)
    assert min(expected) < 1  # the pattern does reach below Paddle's static floor
    assert run_scaler(scaler, pattern) == expected
