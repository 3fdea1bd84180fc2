"""Apex's tests/L0/run_amp/test_update_scale_hysteresis.py, ported to mixprec's scale rule.

Apex tested its `amp_C.update_scale_hysteresis` CUDA kernel; mixprec's one rule is
`mixprec.core.scaling.update_scale_` with `ScalerConfig(consecutive_hysteresis=True)` (the kernel
refills the hysteresis on every clean step). Changes, each for a stated reason: CPU tensors;
`growth_factor=1.0` is left out of the fuzz list (ScalerConfig refuses a growth factor <= 1:
a scale that can never grow back is a configuration error); the random extra iterations are
drawn from 0..40 with a fixed seed instead of 0..1000 unseeded (each update is ~20 small ops on
CPU; 1000 would take minutes); where Apex's reference backs the scale off below fp32's smallest
normal to 0, mixprec's scale stops at `min_scale` (here 2**-126: a zero scale would zero every
gradient). Everything else (the phases and their expected scales, exact) is Apex's.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from mixprec.core.policy import ScalerConfig
from mixprec.core.scaling import update_scale_

TINY = torch.finfo(torch.float32).smallest_normal


def isfinite(val: float) -> bool:
    return TINY <= val <= torch.finfo(torch.float32).max


def body(init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, rng) -> None:
    cfg = ScalerConfig(
        init_scale=float(init_scale),
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        consecutive_hysteresis=True,
        min_scale=TINY,
    )
    scale = torch.tensor([init_scale], dtype=torch.float32)
    growth_tracker = torch.tensor([0], dtype=torch.int32)
    hysteresis_tracker = torch.tensor([hysteresis], dtype=torch.int32)

    def update(found_inf: torch.Tensor) -> None:
        update_scale_(scale, growth_tracker, hysteresis_tracker, found_inf, cfg)

    found_inf = torch.tensor([1.0])
    for _ in range(hysteresis - 1):  # infs for hysteresis-1 iterations: the scale holds
        update(found_inf)
    assert scale.item() == init_scale
    found_inf.zero_()
    for _ in range(growth_interval - 1):  # growth_interval-1 clean iterations: still holds
        update(found_inf)
    assert scale.item() == init_scale

    found_inf.fill_(1)  # infs for more than hysteresis iterations: backed off each time
    extra_iters = rng.randint(0, 40)
    scale_ref = scale.item()
    for _ in range(hysteresis + extra_iters):
        update(found_inf)
    for _ in range(1 + extra_iters):
        scale_new = scale_ref * backoff_factor
        scale_ref = scale_new if isfinite(scale_new) else TINY  # Apex's kernel: 0
    assert scale.item() == scale_ref

    found_inf.fill_(0)  # growth_interval clean iterations: grown every growth_interval
    extra_iters = rng.randint(0, 40)
    scale_ref = scale.item()
    for _ in range(growth_interval + extra_iters):
        update(found_inf)
    for _ in range(1 + int(math.floor(extra_iters / growth_interval))):
        scale_new = scale_ref * growth_factor
        if isfinite(scale_new):
            scale_ref = scale_new
    assert scale.item() == scale_ref


@pytest.mark.parametrize("init_scale", [1, 1024, 65536])
def test_fuzz(init_scale) -> None:
    rng = random.Random(init_scale)
    for growth_factor in (2.0, 4.0):
        for backoff_factor in (0.5, 0.25):
            for growth_interval in (10, 100):
                for hysteresis in (10, 100):
                    body(
                        init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, rng
                    )
