"""Float8Linear under FSDP2 (fully_shard), 2 gloo ranks on CPU, against one process.

The single-process reference runs what data parallelism computes: each rank's half of the
batch through its own forward and backward, gradients summed then halved. Each rank's
delayed-scaling histories see only that rank's inputs and gradients (they are buffers, not
sharded and not reduced), so the reference keeps one replica per rank: the same Parameter
objects, its own histories. FSDP2 all-gathers the fp32 weight before the forward, so weight
amaxes are those of the full weight, as in the reference. The contract is bitwise equality:
the same half-batch GEMMs on the same bytes, and a 2-rank average (g0 + g1) / 2 is one
commutative fp32 sum and an exact halving, so the order of reduction cannot matter.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mixprec.fp8 import Float8Config, Float8Linear, convert_to_fp8, fp8_summary
from mixprec.fp8.linear import HISTORY_NAMES

WORLD, ROWS, STEPS = 2, 8, 3  # rows per rank; dims below are multiples of 16 (GEMM alignment)
CONFIGS = {
    "dynamic": Float8Config(),
    "delayed": Float8Config(scaling="delayed", amax_history_len=4),
}


def make_model(config: Float8Config) -> nn.Module:
    torch.manual_seed(0)
    mlp = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16)
    )
    model = convert_to_fp8(mlp, config=config)
    summary = fp8_summary(model)
    assert summary.converted == ("0", "2", "4")
    return model


def replica_sharing_parameters(model: nn.Module) -> nn.Module:
    """A copy holding the same Parameter objects (grads accumulate there) but its own buffers."""
    replica = copy.deepcopy(model)
    for mine, theirs in zip(replica.modules(), model.modules(), strict=True):
        for name, param in theirs.named_parameters(recurse=False):
            setattr(mine, name, param)
    return replica


def histories(model: nn.Module) -> list[torch.Tensor]:
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    found = [getattr(m, name) for m in layers for name in HISTORY_NAMES]
    return [h for h in found if h is not None]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # The fp8 mode: bf16 autocast around float8 linears, the loss in fp32.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    return nn.functional.mse_loss(out.float(), y)


def _worker(rank: int, world: int) -> None:
    from dist_utils import assert_same_on_every_rank
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(world * ROWS, 32, generator=generator)
    y = torch.randn(world * ROWS, 16, generator=generator)
    x[3, 5] = 40.0  # rank 0's input amax well above rank 1's: per-rank scales must differ
    halves = [slice(r * ROWS, (r + 1) * ROWS) for r in range(world)]
    for scaling, config in CONFIGS.items():
        model = make_model(config)
        ref = copy.deepcopy(model)
        replicas = [ref] + [replica_sharing_parameters(ref) for _ in range(world - 1)]
        for layer in model.modules():
            if isinstance(layer, Float8Linear):
                fully_shard(layer)
        fully_shard(model)
        assert isinstance(model, FSDPModule) and isinstance(model[0].weight, DTensor)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for _ in range(STEPS):
            loss_of(model, x[halves[rank]], y[halves[rank]]).backward()
            opt.step()
            opt.zero_grad()
            for replica, half in zip(replicas, halves, strict=True):
                loss_of(replica, x[half], y[half]).backward()  # accumulates g0 + g1
            for p in ref.parameters():
                p.grad /= world  # FSDP's average: exact halving of the same sum
            ref_opt.step()
            ref_opt.zero_grad()
        full = [p.full_tensor() for p in model.parameters()]
        for name, got, want in zip(
            [n for n, _ in ref.named_parameters()], full, ref.parameters(), strict=True
        ):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{scaling} {name}")
        assert_same_on_every_rank(full, f"{scaling} parameters")
        mine = histories(model)
        if scaling == "delayed":
            # Each rank recorded its own inputs and grads once per step, like its replica.
            assert len(mine) == 9 and all(int((h > 0).sum()) == STEPS for h in mine)
            for got, want in zip(mine, histories(replicas[rank]), strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert not torch.equal(mine[0], histories(replicas[1 - rank])[0])
        else:
            assert mine == []


@pytest.mark.distributed
def test_fsdp2_fp8_matches_one_process_bitwise_two_ranks() -> None:
    from dist_utils import spawn

    spawn(_worker, WORLD)
