"""Seed 002 §2.2's network, data and command line, shared by the four static-graph listings.

The seed trains 9 x Linear(8192) on batches of 2048 on a V100; the defaults here are small
(256 wide, batches of 64) so each listing runs in seconds on a CPU (plus one compile of the
step). bf16 is the default low dtype: CPUs have no fast fp16 matmul (--dtype float16 for the
seed's). Paddle's static AMP is a no-op on CPU places; mixprec's runs there too.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import numpy
import torch
from torch import nn

from mixprec.paddle import static


class SimpleNet(nn.Module):
    """The seed's nine Linear layers; `guard=True` runs all but the first in fp16_guard()."""

    def __init__(self, input_size: int, output_size: int, guard: bool = False) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(input_size, output_size) for i in range(9)])
        self.guard = guard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, linear in enumerate(self.linears):
            if i > 0 and self.guard:
                with static.amp.fp16_guard():
                    x = linear(x)
            else:
                x = linear(x)
        return x


def build_parser(description: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--input-size", type=int, default=256, help="the seed: 8192")
    p.add_argument("--batch-size", type=int, default=64, help="the seed: 2048")
    p.add_argument("--nums-batch", type=int, default=10)
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--seed", type=int, default=100)
    return p


def make_loader(args: argparse.Namespace):
    """The seed's RandomDataset: uniform [0, 1) float32 data and labels, as numpy batches."""

    def loader() -> Iterator[tuple[numpy.ndarray, numpy.ndarray]]:
        rng = numpy.random.default_rng(args.seed)
        for _ in range(args.nums_batch):
            shape = [args.batch_size, args.input_size]
            yield rng.random(shape, dtype=numpy.float32), rng.random(shape, dtype=numpy.float32)

    return loader
