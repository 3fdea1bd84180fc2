"""The fused master step against the unfused one (itself exact against a hand-written loop)."""

from __future__ import annotations

import logging

import pytest
import torch
from dist_utils import spawn
from tolerances import fp32_rounding

from mixprec.core import fused_step as fused
from mixprec.core.commit import FusedCommit
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import ScalerConfig

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

SCALE = ScalerConfig(init_scale=2.0**8, growth_interval=2)  # grows during the test: 2**8..2**9


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-decay-momentum-dampening": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, weight_decay=0.01, dampening=0.1
    ),
    "sgd-nesterov-maximize": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, maximize=True
    ),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw-decay": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "adamw-maximize": lambda ps: torch.optim.AdamW(ps, lr=0.01, maximize=True),
    # Coupled decay: g + wd * p near 0 would let Adam's normalisation blow a 1-ulp difference
    # up to a full step; |wd * p| >= 0.1 > |g| (see make_params) keeps it away from 0.
    "adam-coupled-decay": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1),
}


def make_params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """A lp matrix, a 1-element lp param and an fp32 param (its own master); |p| in [1, 2)."""
    torch.manual_seed(0)
    shapes = [((37, 19), dtype), ((1,), dtype), ((5,), torch.float32)]
    params = []
    for shape, dt in shapes:
        magnitude = 1 + torch.rand(shape)
        params.append(torch.nn.Parameter((magnitude * torch.randn(shape).sign()).to(dt)))
    return params


def set_grads(params, opt, step: int, bad: bool = False) -> None:
    """Scaled grads, |unscaled g| < 0.05; `bad` puts an inf into the first one."""
    torch.manual_seed(100 + step)
    for p in params:
        g = torch.rand(p.shape) * 0.1 - 0.05
        p.grad = (g * opt.loss_scale).to(p.dtype)
    opt.note_scaled_backward()  # these stand for a scaled backward's grads
    if bad:
        params[0].grad.view(-1)[3] = float("inf")


def train(make_opt, fused_step: bool, dtype=torch.bfloat16, steps=3, **kwargs):
    params = make_params(dtype)
    opt = MixedPrecisionOptimizer(
        make_opt(params), loss_scale=SCALE, fused_step=fused_step, **kwargs
    )
    results = []
    for step in range(steps):
        set_grads(params, opt, step)
        results.append(opt.step())
    return params, opt, results


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_matches_unfused(name) -> None:
    ref_params, ref_opt, _ = train(OPTIMIZERS[name], fused_step=False)
    params, opt, results = train(OPTIMIZERS[name], fused_step=True)
    assert not any(r.skipped for r in results)
    assert all(m.grad is None for m in opt.hp_masters), "fused steps allocate no master grads"
    # torch's contract: the step leaves the lp grads in .grad for a backward before zero_grad()
    assert all(p.grad is not None for p in params[:2])
    for got, want in zip(opt.hp_masters, ref_opt.hp_masters, strict=True):
        torch.testing.assert_close(got, want, **fp32_rounding())
    torch.testing.assert_close(params[2], ref_params[2], **fp32_rounding())
    for got, want in zip(params[:2], opt.hp_masters, strict=True):
        assert torch.equal(got, want.to(got.dtype)), "lp params are their masters, rounded"
    for (_, got), (_, want) in zip(
        opt.optim.state.items(), ref_opt.optim.state.items(), strict=True
    ):
        assert got.keys() == want.keys()
        for key in got:
            torch.testing.assert_close(got[key], want[key], **fp32_rounding())
    assert opt.scaler.scale == ref_opt.scaler.scale == 2.0**9


def test_fused_fp16_matches_unfused() -> None:
    make = OPTIMIZERS["adamw-decay"]
    _, ref_opt, _ = train(make, fused_step=False, dtype=torch.float16)
    _, opt, _ = train(make, fused_step=True, dtype=torch.float16)
    for got, want in zip(opt.hp_masters, ref_opt.hp_masters, strict=True):
        torch.testing.assert_close(got, want, **fp32_rounding())


@pytest.mark.parametrize("name", ["sgd-decay-momentum-dampening", "adamw-decay"])
def test_skipped_fused_step_changes_nothing(name) -> None:
    params, opt, _ = train(OPTIMIZERS[name], fused_step=True, steps=2)
    before_params = [p.detach().clone() for p in params]
    before_masters = [m.detach().clone() for m in opt.hp_masters]
    before_state = {k: v.clone() for s in opt.optim.state.values() for k, v in s.items()}
    scale = opt.loss_scale
    set_grads(params, opt, 5, bad=True)
    result = opt.step()
    assert result.skipped and result.scale == scale
    assert opt.loss_scale == scale / 2 and opt.skipped_steps == 1
    for got, want in zip(params + opt.hp_masters, before_params + before_masters, strict=True):
        assert torch.equal(got, want)
    after_state = {k: v for s in opt.optim.state.values() for k, v in s.items()}
    for key, want in before_state.items():
        assert torch.equal(after_state[key], want), key  # Adam's step count too


def test_clipping_fused_matches_unfused() -> None:
    make = OPTIMIZERS["sgd-decay-momentum-dampening"]
    _, ref_opt, ref_results = train(make, fused_step=False, max_norm=0.05)
    _, opt, results = train(make, fused_step=True, max_norm=0.05)
    for got, want in zip(results, ref_results, strict=True):
        assert got.grad_norm > 0.05  # every step clips
        # A norm summed in another order: within fp32 rounding of a sum of ~700 squares.
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-6)
    for got, want in zip(opt.hp_masters, ref_opt.hp_masters, strict=True):
        torch.testing.assert_close(got, want, **fp32_rounding())


def test_fused_and_unfused_steps_continue_each_other() -> None:
    """clip_grad_norm() before step() unscales on the masters: that step runs unfused, on the
    optimizer state the fused steps built, and the next one fuses again."""
    make = OPTIMIZERS["sgd-decay-momentum-dampening"]
    ref_params, ref_opt, _ = train(make, fused_step=False, steps=4)
    params = make_params(torch.bfloat16)
    opt = MixedPrecisionOptimizer(make(params), loss_scale=SCALE, fused_step=True)
    for step in range(4):
        set_grads(params, opt, step)
        if step == 2:
            opt.clip_grad_norm(1e9)  # never clips; moves the grads to the masters
            assert opt.hp_masters[0].grad is not None
        opt.step()
    for got, want in zip(opt.hp_masters, ref_opt.hp_masters, strict=True):
        torch.testing.assert_close(got, want, **fp32_rounding())


def test_lr_changes_reach_the_compiled_kernel() -> None:
    make = OPTIMIZERS["adamw-decay"]
    results = {}
    for fused_step in (False, True):
        params = make_params(torch.bfloat16)
        opt = MixedPrecisionOptimizer(make(params), loss_scale=SCALE, fused_step=fused_step)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for step in range(3):
            set_grads(params, opt, step)
            opt.step()
            sched.step()
        results[fused_step] = opt.hp_masters
    for got, want in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(got, want, **fp32_rounding())


def test_auto_fuses_only_large_cpu_steps() -> None:
    small = torch.nn.Parameter(torch.randn(8, 8).bfloat16())
    opt = MixedPrecisionOptimizer(torch.optim.SGD([small], lr=0.1))
    small.grad = torch.ones_like(small)
    opt.step()
    assert opt.hp_masters[0].grad is not None  # unfused: the fp32 master grad exists (kept)
    rows = fused.AUTO_MIN_ELEMENTS // 1024  # 2**25 elements: 64 MiB in bf16
    large = torch.nn.Parameter(torch.zeros(rows, 1024).bfloat16())
    opt = MixedPrecisionOptimizer(torch.optim.SGD([large], lr=0.5))
    large.grad = torch.ones_like(large)
    opt.step()
    assert opt.hp_masters[0].grad is None
    assert torch.equal(large, torch.full_like(large, -0.5))


def test_auto_fuse_size_is_recounted_when_param_groups_change(monkeypatch) -> None:
    # The held-element count is cached per param_groups layout; adding a group must re-count.
    monkeypatch.setattr(fused, "AUTO_MIN_ELEMENTS", 100)
    first = torch.nn.Parameter(torch.randn(8, 8).bfloat16())
    opt = MixedPrecisionOptimizer(torch.optim.SGD([first], lr=0.1))
    first.grad = torch.ones_like(first)
    assert FusedCommit.grads_for(opt) is None  # 64 elements < 100
    second = torch.nn.Parameter(torch.randn(8, 8).bfloat16())
    second.grad = torch.ones_like(second)
    opt.add_param_group({"params": [second]})
    assert FusedCommit.grads_for(opt) is not None  # 128 elements: fused
    opt.param_groups[1]["params"] = opt.param_groups[1]["params"][:0]  # a group emptied
    assert FusedCommit.grads_for(opt) is None


def test_fused_step_true_refuses_unsupported_optimizers() -> None:
    p = torch.nn.Parameter(torch.randn(4).bfloat16())
    with pytest.raises(ValueError, match=r"fused_step=True.*RMSprop.*supported: SGD, Adam, AdamW"):
        MixedPrecisionOptimizer(torch.optim.RMSprop([p]), fused_step=True)
    with pytest.raises(ValueError, match="amsgrad=True"):
        MixedPrecisionOptimizer(torch.optim.Adam([p], amsgrad=True), fused_step=True)


def test_compile_failure_falls_back_to_the_same_math_eagerly(monkeypatch, caplog) -> None:
    ref_params, ref_opt, _ = train(OPTIMIZERS["adamw-decay"], fused_step=True)

    def no_compiler(fn, variant):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(fused, "_compiled", no_compiler)
    monkeypatch.setattr(fused, "_failed", False)
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        _, opt, _ = train(OPTIMIZERS["adamw-decay"], fused_step=True)
    assert "could not compile (no C++ compiler)" in caplog.text
    for got, want in zip(opt.hp_masters, ref_opt.hp_masters, strict=True):
        torch.testing.assert_close(got, want, **fp32_rounding())


def _one_rank_overflows(rank: int, world: int) -> None:
    params = make_params(torch.bfloat16)
    opt = MixedPrecisionOptimizer(
        OPTIMIZERS["adamw-decay"](params), loss_scale=SCALE, fused_step=True
    )
    set_grads(params, opt, 0)
    assert not opt.step().skipped
    before = [m.detach().clone() for m in opt.hp_masters]
    set_grads(params, opt, 1, bad=rank == 1)
    assert opt.step().skipped  # rank 0's grads are finite: it skips because rank 1 overflowed
    assert all(torch.equal(m, b) for m, b in zip(opt.hp_masters, before, strict=True))
    assert opt.loss_scale == SCALE.init_scale / 2


@pytest.mark.distributed
def test_fused_step_skips_on_every_rank_when_one_overflows() -> None:
    spawn(_one_rank_overflows, 2)
