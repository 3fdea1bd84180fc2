"""Fault injection in every mode: inf/nan in chosen gradients and losses at chosen steps.

Every injected step must be skipped with weights and optimizer state bitwise unchanged; no
NaN may reach a weight; the loss scale must follow the reference trajectory; and the run must
end exactly where a clean run that never saw the injected batches ends.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import tiny_mlp
from test_scaling import reference_trajectory

from mixprec import AMP_TYPE, convert_to_amp

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

STEPS = 40
CE = torch.nn.CrossEntropyLoss()

# mode name -> (mode, config); fp16 shapes are tiny because fp16 matmul is slow on CPU.
MODES = {
    "fp32": ("fp32", None),
    "bf16": ("bf16", None),
    "fp16": (AMP_TYPE.TORCH, {"init_scale": 2.0**8, "growth_interval": 5}),
    "fp16_naive": (AMP_TYPE.NAIVE, {"initial_scale": 2.0**8, "growth_interval": 5}),
    "fp16_naive-bf16": (AMP_TYPE.NAIVE, {"dtype": "bfloat16"}),
    "O1": (AMP_TYPE.APEX, {"opt_level": "O1"}),
    "O2": (AMP_TYPE.APEX, {"opt_level": "O2", "loss_scale": 2.0**6}),
    "O3": (AMP_TYPE.APEX, {"opt_level": "O3"}),
}


def injection_plan(seed: int) -> dict[int, tuple[str, str, int]]:
    """step -> (where: 'grad' or 'loss', value: 'inf'/'-inf'/'nan', param index)."""
    gen = torch.Generator(torch.get_default_device()).manual_seed(seed)
    steps = torch.randperm(STEPS, generator=gen)[:12].tolist()
    plan = {}
    for i, step in enumerate(sorted(steps)):
        where = "loss" if i % 4 == 0 else "grad"
        value = ("inf", "-inf", "nan")[i % 3]
        plan[step] = (where, value, int(torch.randint(0, 6, (1,), generator=gen)))
    return plan


def batches():
    gen = torch.Generator(torch.get_default_device()).manual_seed(11)
    return [
        (torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen))
        for _ in range(STEPS)
    ]


def build(mode, config):
    torch.manual_seed(0)
    model = tiny_mlp()
    # O3 steps fp16 weights directly: Adam's eps must be representable in fp16 (mixprec
    # refuses the default 1e-8, which rounds to 0 and divides by zero).
    eps = 1e-4 if config and config.get("opt_level") == "O3" else 1e-8
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=eps)
    return convert_to_amp(model, opt, CE, mode, copy.deepcopy(config))


def state_of(model, opt):
    return (
        [t.detach().clone() for t in model.module.state_dict().values()],
        copy.deepcopy(opt.optim.state_dict()),
        [m.detach().clone() for m in opt.hp_masters],
    )


def assert_bitwise(a, b) -> None:
    for x, y in zip(a[0] + a[2], b[0] + b[2], strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=False)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)


def poisoned(grad: torch.Tensor, value: float) -> torch.Tensor:
    """grad with its first element set to value (a new tensor: a hook must not write in place)."""
    out = grad.clone()
    out.view(-1)[0] = value
    return out


@pytest.mark.parametrize("name", list(MODES))
def test_injected_faults_are_skipped_and_change_nothing(name: str) -> None:
    mode, config = MODES[name]
    plan = injection_plan(seed=len(name))
    model, opt, crit = build(mode, config)
    cfg = opt.scaler.cfg
    overflows = []
    for step, (x, y) in enumerate(batches()):
        opt.zero_grad()
        loss = crit(model(x), y)
        fault = plan.get(step)
        if fault and fault[0] == "loss":
            loss = loss * float(fault[1])
        handle = None
        if fault and fault[0] == "grad":
            # the fault arises in backward, as a real one does: Apex's modes check each loss's
            # grads when its backward ends (scale_loss's exit), so a write after it is unseen
            params = list(model.parameters())
            param = params[fault[2] % len(params)]
            handle = param.register_hook(lambda g, v=float(fault[1]): poisoned(g, v))
        opt.backward(loss)
        if handle is not None:
            handle.remove()
        before = state_of(model, opt)
        result = opt.step()
        overflows.append(result.skipped)
        if fault:
            assert result.skipped, f"{name}: injected {fault} at step {step} was not skipped"
            assert_bitwise(before, state_of(model, opt))
        for t in model.module.state_dict().values():
            assert torch.isfinite(t).all(), f"{name}: a non-finite value reached a weight"
    # Only the injected steps overflowed, and the scale moved exactly as the reference says.
    assert [i for i, s in enumerate(overflows) if s] == sorted(plan)
    expected_scale = reference_trajectory(cfg, overflows)[-1][0] if cfg.dynamic else cfg.init_scale
    assert opt.loss_scale == expected_scale
    assert math.isfinite(opt.loss_scale) and opt.loss_scale >= cfg.min_scale

    # A clean run that never saw the injected batches ends in the same place: a skip is exactly
    # "this batch did not happen". Bit for bit where the scale is static. Where it is dynamic,
    # the two runs' scales differ (backoffs), and fp16 backward intermediates that fall into
    # fp16's subnormal range round differently at different powers of two: ~1 ulp of fp32.
    tol = {"rtol": 1e-5, "atol": 1e-7} if cfg.dynamic else {"rtol": 0, "atol": 0}
    clean_model, clean_opt, clean_crit = build(mode, config)
    for step, (x, y) in enumerate(batches()):
        if step in plan:
            continue
        clean_opt.zero_grad()
        clean_opt.backward(clean_crit(clean_model(x), y))
        clean_opt.step()
    for a, b in zip(
        model.module.state_dict().values(), clean_model.module.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, **tol)


def test_enough_injections_across_modes() -> None:
    assert sum(len(injection_plan(seed=len(n))) for n in MODES) >= 50
