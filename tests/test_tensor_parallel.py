"""Tensor parallel (DTensor) through mixprec's core: one rank's inf in its local shard skips all.

A 2-layer MLP is split with torch's tensor parallel (ColwiseParallel up, RowwiseParallel down)
over a 1-D gloo mesh, prepared by mixprec.prepare_model and stepped by MixedPrecisionOptimizer
over the mesh's group. Each rank holds different shards, so an overflow can only be seen
locally; the all-reduced flag must make every rank skip, or the replicas drift apart.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from dist_utils import assert_same_on_every_rank, local_shard, scaler_state
from torch import nn

from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import Policy, to_policy
from mixprec.core.prepare import FP32Criterion, PrecisionModule, prepare_model, prepare_optimizer
from mixprec.core.scaling import LossScaler

WORLD = 2  # the machine has 2 cores: one per rank
WIDTH = 8  # tiny: fp16 matmuls on CPU are very slow; 2 * WIDTH splits evenly over WORLD
LR = 0.1
# Each mode as to_policy reads it. fp16's scale starts at 2**10 (not 2**16) so the O(1)
# gradients of this model, times the scale, stay far from fp16's max (65504) after backoff.
MODES: dict[str, Any] = {
    "bf16": "bf16",
    "fp16": {"mode": "fp16", "init_scale": 2.0**10},
    "fp16_naive-bf16": {"mode": "fp16_naive", "dtype": "bfloat16"},
    "fp16_naive": {"mode": "fp16_naive", "initial_scale": 2.0**8},
}
# (rank that overflows, the parameter whose local gradient shard it poisons): a column shard
# and the replicated row-parallel bias, whose replicas diverge if only one rank skipped.
INJECTIONS = ((1, "up.weight"), (0, "down.bias"))


class TwoLayerMLP(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.act = nn.ReLU()
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


def _low_dtype(policy: Policy) -> torch.dtype:
    low = policy.low_dtype
    assert low is not None, policy
    return low


def _models(policy: Policy, mesh: Any) -> tuple[PrecisionModule, PrecisionModule]:
    """(tensor-parallel model, single-process reference), both prepared from one init."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)  # the same init on every rank: TP shards one model
    model = TwoLayerMLP()
    ref = prepare_model(copy.deepcopy(model), policy)
    tp = prepare_model(model, policy)
    parallelize_module(tp.module, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return tp, ref


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)  # ColwiseParallel wants the same input on every rank
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _is_replicated(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor, Replicate

    return not isinstance(t, DTensor) or all(isinstance(p, Replicate) for p in t.placements)


def _snapshot(model: nn.Module, opt: MixedPrecisionOptimizer) -> list[torch.Tensor]:
    """This rank's shards of every param and master."""
    return [local_shard(t).detach().clone() for t in [*model.parameters(), *opt.hp_masters]]


def _check_against_reference(rank: int, policy: Policy, mesh: Any) -> None:
    """Forward and backward of the TP model equal the unsplit model's within rounding."""
    tp, ref = _models(policy, mesh)
    x, y = _batch()
    criterion = FP32Criterion(nn.MSELoss())
    out, ref_out = tp(x), ref(x)
    criterion(out, y).backward()
    criterion(ref_out, y).backward()
    # RowwiseParallel sums per-rank partial products, each rounded to the low dtype under
    # autocast (or fp16_naive's low params), then sums them again: a few roundings of values
    # no larger than the output, so WORLD + 2 low-dtype eps of the largest entry bounds it.
    eps = torch.finfo(_low_dtype(policy)).eps
    scale = float(ref_out.detach().abs().max())
    tol = (WORLD + 2) * eps * scale
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=0, atol=tol)
    for (name, p), q in zip(tp.module.named_parameters(), ref.module.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        grad, ref_grad = _full(p.grad).float(), q.grad.float()
        # The same bound, against this gradient's own largest entry.
        g_tol = (WORLD + 2) * eps * float(ref_grad.abs().max())
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=g_tol, msg=f"grad of {name}")


def _check_skip_together(rank: int, policy: Policy, mesh: Any) -> None:
    """One rank's inf in its local grad shard: every rank skips, nothing moves, scales agree."""
    group = mesh.get_group()
    tp, ref = _models(policy, mesh)
    opt = prepare_optimizer(
        torch.optim.SGD(tp.parameters(), lr=LR, momentum=0.9), policy, process_group=group
    )
    ref_opt = prepare_optimizer(torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9), policy)
    criterion = FP32Criterion(nn.MSELoss())
    x, y = _batch()
    params = dict(tp.module.named_parameters())
    expected = LossScaler(policy.loss_scale)  # the scaler rule fed two overflows, on its own
    for culprit, name in INJECTIONS:
        before = _snapshot(tp.module, opt)
        opt.backward(criterion(tp(x), y))
        if rank == culprit:
            grad = params[name].grad
            assert grad is not None, name
            local_shard(grad).view(-1)[0] = float("inf")  # this rank's shard only: no collective
        result = opt.step()
        opt.zero_grad()
        expected.update(torch.ones(1))
        assert result.skipped, f"rank {rank} stepped although rank {culprit} overflowed in {name}"
        after = _snapshot(tp.module, opt)
        for i, (a, b) in enumerate(zip(after, before, strict=True)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"tensor {i} moved on a skip")
        assert opt.loss_scale == expected.scale, (opt.loss_scale, expected.scale)
        assert_same_on_every_rank(
            [torch.tensor([float(result.skipped)]), *scaler_state(opt)], "skip flag and scaler"
        )

    # A clean step: every rank steps, and what is replicated stays identical bit for bit.
    out = tp(x)
    opt.backward(criterion(out, y))
    assert not opt.step().skipped
    replicated = [p for p in [*tp.module.parameters(), *opt.hp_masters] if _is_replicated(p)]
    assert replicated  # down.bias (and its master): RowwiseParallel replicates it
    assert_same_on_every_rank([out, *(local_shard(p) for p in replicated)], "replicated state")
    # The skipped steps were no-ops: one clean step from the same init, unsplit, lands on the
    # same params. SGD's first step moves a param by LR * grad, so the gradient bound of
    # _check_against_reference times LR, plus one rounding of the param to its own dtype.
    ref_before = [q.detach().clone() for q in ref.module.parameters()]
    ref_opt.backward(criterion(ref(x), y))
    assert not ref_opt.step().skipped
    eps = torch.finfo(_low_dtype(policy)).eps
    named = zip(tp.module.named_parameters(), ref.module.parameters(), ref_before, strict=True)
    for (name, p), q, q0 in named:
        moved = float((q.detach().float() - q0.float()).abs().max())  # LR * max |grad|
        tol = (WORLD + 2) * eps * moved + torch.finfo(p.dtype).eps * float(q0.abs().max())
        assert moved > 0, f"the clean reference step did not move {name}"
        torch.testing.assert_close(_full(p), q, rtol=0, atol=tol, msg=f"param {name}")


def _tp_worker(
    rank: int, world: int, reference_modes: tuple[str, ...], skip_modes: tuple[str, ...]
) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for mode in reference_modes:
        _check_against_reference(rank, to_policy(MODES[mode]), mesh)
    for mode in skip_modes:
        _check_skip_together(rank, to_policy(MODES[mode]), mesh)


def _spawn(*args: Any) -> None:
    from dist_utils import spawn

    spawn(_tp_worker, WORLD, *args)


@pytest.mark.distributed
def test_tp_autocast_modes_skip_together_and_match_single_process() -> None:
    _spawn(tuple(MODES), ("bf16", "fp16"))


@pytest.mark.distributed
def test_tp_master_weight_modes_skip_together() -> None:
    _spawn((), ("fp16_naive-bf16", "fp16_naive"))
