"""TorchFSDPPlugin's default shard units on a model whose top level holds containers."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import spawn
from torch import nn

from mixprec import Booster
from mixprec.booster.plugin import TorchFSDPPlugin


class Stacked(nn.Module):
    """A transformer-like layout: blocks in a ModuleList, heads in a ModuleDict."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(2)
        )
        self.heads = nn.ModuleDict({"a": nn.Linear(width, 2), "b": nn.Linear(width, 2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.heads["a"](x) + self.heads["b"](x)


def _units_worker(rank: int, world: int) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = Stacked()
    reference = copy.deepcopy(model)
    booster = Booster(mixed_precision="bf16", plugin=TorchFSDPPlugin())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, crit, *_ = booster.boost(model, opt, nn.MSELoss())
    inner = model.module
    units = {n for n, m in inner.named_modules() if isinstance(m, FSDPModule)}
    # the root, each block and each head: the containers themselves are no unit
    assert units == {"", "embed", "blocks.0", "blocks.1", "heads.a", "heads.b"}, units
    ref_booster = Booster(mixed_precision="bf16")
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref, ref_opt, ref_crit, *_ = ref_booster.boost(reference, ref_opt, nn.MSELoss())
    gen = torch.Generator().manual_seed(1)  # the same batch on every rank
    x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 2, generator=gen)
    lo, hi = rank * 4, (rank + 1) * 4
    booster.backward(crit(model(x[lo:hi]), y[lo:hi]), opt)
    ref_booster.backward(ref_crit(ref(x), y), ref_opt)
    assert not opt.step().skipped and not ref_opt.step().skipped
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        # half-batch bf16 gradients averaged in fp32 vs one full batch: ~1 bf16 eps of an
        # O(1) gradient, times lr 0.1
        torch.testing.assert_close(full, q, rtol=0, atol=0.1 * torch.finfo(torch.bfloat16).eps)


@pytest.mark.distributed
def test_default_units_split_top_level_module_list_and_dict() -> None:
    spawn(_units_worker, 2)
