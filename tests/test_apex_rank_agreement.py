"""A non-finite gradient written after backward on one rank skips the step on every rank.

Apex's optimizers check each loss's gradients when its backward ends (scale_loss's exit) and
reduce that flag over the ranks. A value written into the gradients after that check (a hook
run outside backward, a user's edit, a clip dividing by an inf norm) on one rank only must still
skip the step on both ranks, as it does in the modes that check at the step: otherwise that
rank applies it (nan weights) and the ranks differ from then on. Two gloo ranks, DDP.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_mlp
from dist_utils import assert_same_on_every_rank, spawn

from mixprec.core.per_loss_optim import StashingOptimizer

WIDTH = 8  # tiny: fp16 matmuls are slow on CPU
ROWS = 2  # rows of the batch per rank
# The rank that writes a nan after backward at each step (None: a clean step).
SCHEDULE = (None, 1, None, 0, 1, None)


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS * world, WIDTH, generator=g), torch.randn(ROWS * world, 4, generator=g)


def _everything(model: torch.nn.Module, optimizer) -> list[torch.Tensor]:
    """Params, the tensors the optimizer steps (masters), its state and its loss scale."""
    held = [p for g in optimizer.param_groups for p in g["params"]]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    tensors = [*model.parameters(), *held, *state, optimizer.scaler.scale_tensor]
    return [t.detach().float().clone() for t in tensors]


def _poison(model: torch.nn.Module, optimizer, step: int) -> None:
    """A nan into a gradient the step applies: the model's, which the core modes move to their
    masters at the step; the masters' (or fp32 params') under Apex, which moved them at backward."""
    if isinstance(optimizer, StashingOptimizer):
        params = [p for g in optimizer.param_groups for p in g["params"]]
    else:
        params = list(model.parameters())
    with_grad = [p for p in params if p.grad is not None]
    with_grad[step % len(with_grad)].grad.view(-1)[0] = float("nan")  # rank-local: no collective


def _booster_worker(rank: int, world: int, modes: list[str]) -> None:
    from mixprec.booster import Booster
    from mixprec.booster.plugin import TorchDDPPlugin
    from mixprec.mixed_precision import (
        FP16ApexMixedPrecision,
        FP16NaiveMixedPrecision,
        FP16TorchMixedPrecision,
    )

    # first scales of 2**10: this model's O(1) grads times the scale stay far below fp16's max,
    # so only the written nan makes a step skip
    precisions = {
        "fp16": lambda: FP16TorchMixedPrecision(init_scale=2.0**10),
        "fp16_naive": lambda: FP16NaiveMixedPrecision(initial_scale=2.0**10),
        "bf16": lambda: "bf16",
        "fp16_apex": lambda: FP16ApexMixedPrecision(max_loss_scale=2.0**10),  # O1
        "fp16_apex-O2": lambda: FP16ApexMixedPrecision(opt_level="O2", max_loss_scale=2.0**10),
    }
    for mode in modes:
        precision = precisions[mode]()
        booster = Booster(mixed_precision=precision, plugin=TorchDDPPlugin())
        torch.manual_seed(0)
        model = tiny_mlp(WIDTH)
        model, optimizer, criterion, _, _ = booster.boost(
            model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), torch.nn.MSELoss()
        )
        for step, culprit in enumerate(SCHEDULE):
            x, y = _batch(step, world)
            rows = slice(rank * ROWS, (rank + 1) * ROWS)  # each rank its own rows
            before = _everything(model, optimizer)
            booster.backward(criterion(model(x[rows]), y[rows]), optimizer)
            if rank == culprit:
                _poison(model, optimizer, step)
            result = optimizer.step()
            optimizer.zero_grad()
            assert result.skipped == (culprit is not None), f"{mode} step {step} rank {rank}"
            if culprit is not None:  # nothing moved but the scale (backed off, or static)
                for i, (a, b) in enumerate(
                    zip(_everything(model, optimizer)[:-1], before[:-1], strict=True)
                ):
                    torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{mode} {step} {i}")
            assert_same_on_every_rank(
                [torch.tensor([float(result.skipped)]), *_everything(model, optimizer)],
                f"{mode} after step {step}",
            )
        assert all(torch.isfinite(p).all() for p in model.parameters()), mode


def _amp_worker(rank: int, world: int) -> None:
    """Apex's own loop: amp.initialize, then torch's DDP, amp.scale_loss, a clip of the masters."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mixprec.apex import amp

    for opt_level in ("O1", "O2"):
        torch.manual_seed(0)
        model = tiny_mlp(WIDTH)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, optimizer = amp.initialize(
            model, optimizer, opt_level=opt_level, max_loss_scale=2.0**8, verbosity=0
        )
        ddp = DDP(model)
        for step, culprit in enumerate(SCHEDULE):
            x, y = _batch(step, world)
            rows = slice(rank * ROWS, (rank + 1) * ROWS)
            loss = torch.nn.functional.mse_loss(ddp(x[rows]).float(), y[rows])
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            if rank == culprit:  # the user's clip, on this rank only, with an inf max_norm
                grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
                torch._foreach_mul_(grads, float("inf"))  # inf * 0 entries: nan
            result = optimizer.step()
            optimizer.zero_grad()
            assert result.skipped == (culprit is not None), f"{opt_level} step {step} rank {rank}"
            assert_same_on_every_rank(
                [torch.tensor([float(result.skipped)]), *_everything(model, optimizer)],
                f"amp {opt_level} after step {step}",
            )
        assert all(torch.isfinite(p).all() for p in model.parameters()), opt_level
        del ddp  # free the reducer while the gloo group lives


@pytest.mark.distributed
def test_a_nan_written_after_backward_on_one_rank_skips_every_rank_in_every_mode() -> None:
    spawn(_booster_worker, 2, ["fp16", "fp16_naive", "bf16", "fp16_apex", "fp16_apex-O2"])


@pytest.mark.distributed
def test_amp_scale_loss_under_ddp_rechecks_grads_written_after_its_exit() -> None:
    spawn(_amp_worker, 2)
