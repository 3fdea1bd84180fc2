"""Hypothesis drives the master-weight optimizer with random overflow patterns against a
pure-Python model of it (struct's 'e' and 'f' formats round like fp16 and fp32)."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scaling import reference_trajectory

from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import ScalerConfig

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

LR = 2.0**-4  # a power of two: lr * grad is exact, only the final add rounds (once, in fp32)


def f16(x: float) -> float:
    if abs(x) >= 65520.0:  # beyond fp16's max (65504) rounding goes to inf, as the cast does
        return math.copysign(math.inf, x)
    return struct.unpack("e", struct.pack("e", x))[0]


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


grad_values = st.floats(min_value=-4.0, max_value=4.0, allow_nan=False, width=16)
steps_st = st.lists(
    st.tuples(st.booleans(), st.lists(grad_values, min_size=3, max_size=3)), min_size=1, max_size=25
)


@settings(max_examples=60, deadline=None)
@given(
    steps=steps_st,
    init=st.lists(grad_values, min_size=3, max_size=3),
    cfg=st.builds(
        ScalerConfig,
        init_scale=st.sampled_from([2.0**k for k in (0, 3, 8)]),
        growth_interval=st.integers(1, 4),
        hysteresis=st.integers(1, 3),
    ),
)
def test_optimizer_matches_python_model(steps, init, cfg) -> None:
    lp = torch.nn.Parameter(torch.tensor(init, dtype=torch.float16))
    opt = MixedPrecisionOptimizer(torch.optim.SGD([lp], lr=LR), loss_scale=cfg)
    master = [f32(v) for v in init]
    overflows: list[bool] = []
    scale = cfg.init_scale
    for i, (injected, grads) in enumerate(steps):
        # What a scaled fp16 backward would hand over; a grown scale can overflow fp16 by itself.
        scaled = [f16(g * scale) for g in grads]
        if injected:
            scaled[i % 3] = math.inf
        lp.grad = torch.tensor(scaled, dtype=torch.float16)
        opt.note_scaled_backward()  # these stand for a scaled backward's grads
        result = opt.step()
        overflows.append(any(math.isinf(v) for v in scaled))
        assert result.skipped == overflows[-1]
        if not result.skipped:
            master = [f32(m - LR * (s / scale)) for m, s in zip(master, scaled, strict=True)]
        assert result.scale == scale
        assert opt.hp_masters[0].tolist() == master
        assert lp.tolist() == [f16(m) for m in master]
        scale = reference_trajectory(cfg, overflows)[-1][0]
        assert opt.loss_scale == scale
