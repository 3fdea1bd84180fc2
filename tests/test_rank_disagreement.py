"""Four ranks, one overflows at a time: every rank skips, and the ranks never drift apart.

An inf written into one rank's gradient after the data-parallel reduction is seen by that rank
alone; the optimizer's all-reduced overflow flag is all that keeps the other three from
stepping. Each step a different rank (or none) overflows; afterwards every rank's parameters,
optimizer state and loss scale must be identical bit for bit.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from conftest import tiny_mlp
from dist_utils import assert_same_on_every_rank, local_shard, scaler_state
from torch import nn

from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import to_policy
from mixprec.core.prepare import FP32Criterion, prepare_model, prepare_optimizer
from mixprec.core.scaling import LossScaler

WORLD = 4
WIDTH = 8  # tiny: fp16 matmuls on CPU are very slow
ROWS = 2  # rows of the batch per rank
LR = 0.05
# The rank that overflows at each step (None: a clean step): every rank once, two in a row.
SCHEDULE = (3, None, 1, 0, None, 2, None)
# DDP modes as to_policy reads them. fp16 starts at 2**10 so this model's O(1) gradients,
# times the scale, stay far from fp16's max (65504): only the injected infs overflow.
DDP_MODES: dict[str, Any] = {
    "fp16_naive-bf16": {"mode": "fp16_naive", "dtype": "bfloat16"},
    "fp16": {"mode": "fp16", "init_scale": 2.0**10},
}


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, 4, generator=g)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _poison_local_grad(params: list[torch.Tensor], step: int) -> None:
    """inf into this rank's (local shard of a) gradient, a different param each step."""
    with_grad = [p for p in params if p.grad is not None]
    grad = with_grad[step % len(with_grad)].grad
    assert grad is not None
    local_shard(grad).view(-1)[0] = float("inf")  # no collective: the other ranks cannot see it


def _snapshot(opt: MixedPrecisionOptimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's params, masters and optimizer state (local shards), copied."""
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [local_shard(t).detach().clone() for t in [*params, *opt.hp_masters, *state]]


def _train_with_one_rank_overflowing(
    rank: int,
    step_fn: Any,
    opt: MixedPrecisionOptimizer,
    params: list[torch.Tensor],
    expected: LossScaler,
) -> None:
    """Run SCHEDULE: step_fn(step) runs forward+backward; the culprit then poisons its grads."""
    for step, culprit in enumerate(SCHEDULE):
        before = _snapshot(opt, params)
        step_fn(step)
        if rank == culprit:
            _poison_local_grad(params, step)
        result = opt.step()
        opt.zero_grad()
        overflowed = culprit is not None
        expected.update(torch.tensor([float(overflowed)]))
        assert result.skipped == overflowed, f"step {step}: rank {rank} got {result}"
        if overflowed:
            for i, (a, b) in enumerate(zip(_snapshot(opt, params), before, strict=True)):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"step {step}: tensor {i}")
        assert opt.loss_scale == expected.scale, (step, opt.loss_scale, expected.scale)
        assert_same_on_every_rank(
            [torch.tensor([float(result.skipped)]), *scaler_state(opt)], f"step {step} decision"
        )
    assert opt.skipped_steps == sum(c is not None for c in SCHEDULE)


def _ddp_worker(rank: int, world: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    criterion = FP32Criterion(nn.MSELoss())
    for mode, spec in DDP_MODES.items():
        policy = to_policy(spec)
        torch.manual_seed(0)  # DDP also broadcasts rank 0's params; same init anyway
        model = prepare_model(tiny_mlp(WIDTH), policy)
        ddp = DDP(model)
        opt = prepare_optimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), policy)
        params = list(model.parameters())

        def step_fn(step: int, ddp: nn.Module = ddp, opt: MixedPrecisionOptimizer = opt) -> None:
            x, y = _batch(step, ROWS * WORLD)
            lo = rank * ROWS  # each rank its own rows, as under data parallelism
            opt.backward(criterion(ddp(x[lo : lo + ROWS]), y[lo : lo + ROWS]))

        start = [p.detach().clone() for p in params]
        _train_with_one_rank_overflowing(rank, step_fn, opt, params, LossScaler(policy.loss_scale))
        assert any(not torch.equal(p, q) for p, q in zip(params, start, strict=True)), mode
        everything = [*_snapshot(opt, params), *scaler_state(opt)]
        assert_same_on_every_rank(everything, f"{mode}: params, masters, momentum, scaler")
        del ddp  # free the reducer while the gloo group lives


def _fsdp_worker(rank: int, world: int) -> None:
    from mixprec.booster import Booster
    from mixprec.booster.plugin import TorchFSDPPlugin

    torch.manual_seed(0)
    model = tiny_mlp(WIDTH)
    ref_model = copy.deepcopy(model)
    booster = Booster(mixed_precision="bf16", plugin=TorchFSDPPlugin())
    model, opt, criterion, *_ = booster.boost(
        model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), nn.MSELoss()
    )
    # The reference: one process, the whole batch, and the skipped steps simply not taken.
    ref_booster = Booster(mixed_precision="bf16")
    ref, ref_opt, ref_criterion, *_ = ref_booster.boost(
        ref_model, torch.optim.SGD(ref_model.parameters(), lr=LR, momentum=0.9), nn.MSELoss()
    )
    assert isinstance(opt, MixedPrecisionOptimizer) and isinstance(ref_opt, MixedPrecisionOptimizer)
    params = list(model.parameters())
    ref_params = list(ref_model.parameters())
    path = [0.0] * len(ref_params)  # per param: the sum over clean steps of max |update|

    def step_fn(step: int) -> None:
        x, y = _batch(step, ROWS * WORLD)
        lo = rank * ROWS  # FSDP averages the ranks' gradients: the mean over the whole batch
        booster.backward(criterion(model(x[lo : lo + ROWS]), y[lo : lo + ROWS]), opt)
        if SCHEDULE[step] is None:
            before = [q.detach().clone() for q in ref_params]
            ref_booster.backward(ref_criterion(ref(x), y), ref_opt)
            assert not ref_opt.step().skipped
            ref_opt.zero_grad()
            for i, (q, q0) in enumerate(zip(ref_params, before, strict=True)):
                path[i] += float((q.detach() - q0).abs().max())

    _train_with_one_rank_overflowing(rank, step_fn, opt, params, LossScaler(opt.scaler.cfg))
    full = [_full(p).detach() for p in params]
    # full_tensor all-gathers the shards; what each rank computed itself is the step count,
    # the scaler and the decisions (checked per step), and whether its shard stepped: had a
    # rank stepped alone on a poisoned step, its shard would be a whole update away from the
    # reference, about path / (clean steps) here, far outside the tolerance below.
    assert_same_on_every_rank(
        [*full, torch.tensor([float(opt.steps), float(opt.skipped_steps)])], "FSDP params"
    )
    # Quarter-batch gradients, each rounded to bf16 and averaged in fp32, vs one full-batch
    # gradient: each update is off by at most ~2 bf16 eps of itself, and the errors add up.
    eps = torch.finfo(torch.bfloat16).eps
    for i, (p, q) in enumerate(zip(full, ref_params, strict=True)):
        assert path[i] > 0, f"param {i} never moved"
        tol = 2 * eps * path[i]
        torch.testing.assert_close(p, q, rtol=0, atol=tol, msg=f"param {i} vs one process")


def _worker(rank: int, world: int) -> None:
    _ddp_worker(rank, world)
    _fsdp_worker(rank, world)


@pytest.mark.distributed
def test_one_rank_overflows_every_rank_skips_ddp_and_fsdp_four_ranks() -> None:
    # One spawn for both: starting four processes (torch and mixprec imported in each) costs
    # more on 2 cores than the two training runs together.
    from dist_utils import spawn

    spawn(_worker, WORLD)
