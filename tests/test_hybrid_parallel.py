"""HybridParallelPlugin beyond test_pipeline.py: Colossal's microbatch_size, gradients carried
across execute_pipeline rounds until zero_grad (g1 + g2), and ZeRO over each stage's
data-parallel group (zero_stage with pp_size > 1).

References are one-process plain loops doing the same micro-batches in the same order: loss /
m times the scale, gradients summed in fp32 and carried unscaled between steps as torch leaves
them in .grad, stepped by a raw torch optimizer over fp32 masters.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import assert_same_on_every_rank, scaler_state, spawn
from test_pipeline import BATCH, LR, MODES, WIDTH, _batches, _boost, _local_weights, _model
from tolerances import EXACT
from torch import nn

from mixprec.booster import Booster
from mixprec.booster.plugin import HybridParallelPlugin
from mixprec.core.policy import to_policy
from mixprec.core.prepare import FP32Criterion, prepare_model

PP = 2


def _plain(mode: str, steps: list[tuple[list[Any], bool]], m: int) -> dict[str, torch.Tensor]:
    """One process: steps is [(the batches whose rounds come before this step, zero_grad after
    it)]. Gradients accumulate over micro-batches and rounds in one fp32 sum per param, in the
    scaled domain; a step unscales it (the step's grad), and a step without zero_grad leaves
    that grad to be brought back to the next round's scale (torch's contract: g1 + g2)."""
    policy = to_policy(MODES[mode])
    ref = prepare_model(_model(), policy)
    names, params = zip(*ref.module.named_parameters(), strict=True)
    masters = [p.detach().float().clone() if policy.master_weights else p for p in params]
    opt = torch.optim.SGD(masters, lr=LR, momentum=0.9)
    criterion = FP32Criterion(nn.MSELoss())
    scale = policy.loss_scale.init_scale  # no overflow and no growth within these steps
    carried: list[torch.Tensor | None] = [None] * len(params)
    for batches, zero_after in steps:
        acc = [None if c is None else c * scale for c in carried]
        for x, y in batches:
            for xb, yb in zip(x.chunk(m), y.chunk(m), strict=True):
                ((criterion(ref(xb), yb) / m).float() * scale).backward()
                for i, p in enumerate(params):
                    g = p.grad.float()
                    acc[i] = g.clone() if acc[i] is None else acc[i].add_(g)
                    p.grad = None
        for master, a in zip(masters, acc, strict=True):
            master.grad = a * (1.0 / scale)  # a power of two: exact
        opt.step()
        carried = [None if zero_after else master.grad.clone() for master in masters]
        opt.zero_grad()
        with torch.no_grad():
            for p, master in zip(params, masters, strict=True):
                p.copy_(master)
    return {n: m.detach().clone() for n, m in zip(names, masters, strict=True)}


# ----- two processes (pp=2): microbatch_size, and g1 + g2 -----
def _microbatch_size(rank: int) -> None:
    """microbatch_size=2 on batches of 8 is num_microbatches=4, bit for bit; a batch it does
    not split, or one of too few micro-batches for 1f1b, is refused on every rank."""
    batches = _batches(3)
    got = []
    for split in ({"num_microbatches": 4}, {"microbatch_size": BATCH // 4}):
        plugin = HybridParallelPlugin(pp_size=PP, precision="fp32", **split)
        booster = Booster(plugin=plugin)
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        model, optimizer, criterion, *_ = booster.boost(model, optimizer, nn.MSELoss())
        losses = []
        for batch in batches:
            out = booster.execute_pipeline(iter([batch]), model, criterion, optimizer)
            losses.append(out["loss"])
            assert not optimizer.step().skipped
            optimizer.zero_grad()
        got.append((_local_weights(model, optimizer), losses))
    (by_count, count_losses), (by_size, size_losses) = got
    for name, w in by_count.items():
        torch.testing.assert_close(by_size[name], w, **EXACT, msg=f"microbatch_size: {name}")
    if rank == PP - 1:  # the last stage reports the loss, the same mean of 4 micro-batches
        torch.testing.assert_close(torch.stack(size_losses), torch.stack(count_losses), **EXACT)
    for size, match in (
        (4, "batch of 6 samples .* microbatch_size=4"),
        (6, r"num_microbatches=1 \(batch 6 / microbatch_size=6\) < pp_size=2"),
    ):
        plugin = HybridParallelPlugin(pp_size=PP, precision="fp32", microbatch_size=size)
        booster = Booster(plugin=plugin)
        model = _model()
        model, optimizer, criterion, *_ = booster.boost(
            model, torch.optim.SGD(model.parameters(), lr=LR), nn.MSELoss()
        )
        batch = (torch.randn(6, WIDTH), torch.randn(6, WIDTH))
        with pytest.raises(ValueError, match=match):
            booster.execute_pipeline(iter([batch]), model, criterion, optimizer)
        dist.barrier()  # every rank raised: none waits in a send or receive


def _carries_grads(rank: int) -> None:
    """Two rounds, step, a third round with no zero_grad, step: torch's g1 + g2 (the second
    step's grads are the first's plus the third round's), as the plain loop, bit for bit."""
    a, b, c = _batches(3)
    steps = [([a, b], False), ([c], True)]
    for mode in ("fp32", "fp16", "fp16_naive"):  # own params, own params scaled, masters
        expected = _plain(mode, steps, 4)
        booster, model, optimizer, criterion = _boost(mode)
        for batches, zero_after in steps:
            for batch in batches:
                booster.execute_pipeline(iter([batch]), model, criterion, optimizer)
            assert not optimizer.step().skipped
            if zero_after:
                optimizer.zero_grad()
        for name, w in _local_weights(model, optimizer).items():
            torch.testing.assert_close(w, expected[name], **EXACT, msg=f"{mode} g1+g2: {name}")
        assert_same_on_every_rank(scaler_state(optimizer), f"{mode} scaler")
        # zero_grad drops what the steps left: a fresh round then steps on its own grads only
        fresh = _plain(mode, [*steps, ([a], True)], 4)
        booster.execute_pipeline(iter([a]), model, criterion, optimizer)
        assert not optimizer.step().skipped
        for name, w in _local_weights(model, optimizer).items():
            torch.testing.assert_close(w, fresh[name], **EXACT, msg=f"{mode} after zero: {name}")


def _two_worker(rank: int, world: int) -> None:
    _microbatch_size(rank)
    _carries_grads(rank)


@pytest.mark.distributed
def test_microbatch_size_and_gradients_carried_until_zero_grad() -> None:
    spawn(_two_worker, PP)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"num_microbatches": 4, "microbatch_size": 2},
            "num_microbatches=4 and microbatch_size=2 both",
        ),
        ({}, "num_microbatches=None and microbatch_size=None"),
        ({"microbatch_size": 0}, "microbatch_size=0"),
        ({"microbatch_size": True}, "microbatch_size=True"),
    ],
)
def test_microbatch_size_is_checked(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HybridParallelPlugin(pp_size=PP, **kwargs)
