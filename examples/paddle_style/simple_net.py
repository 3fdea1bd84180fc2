"""Seed 002's network, data and command line, shared by the paddle_style training loops.

The seed trains 9 x Linear(8192, 8192) on batches of 2048 on a V100; the defaults here are
small (256 wide, batches of 64) so every loop runs in seconds on a CPU. bf16 is the default
dtype: fp16 matmuls are very slow on CPUs, and bf16 needs no loss scaling (the loops keep the
seed's GradScaler all the same, so the code is the same for both dtypes).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec.paddle as amp


class SimpleNet(nn.Module):
    """`depth` Linear(input_size, output_size) layers in a row (the seed's nine)."""

    def __init__(self, input_size: int, output_size: int, depth: int = 9) -> None:
        super().__init__()
        if depth > 1 and input_size != output_size:
            raise ValueError(
                f"input_size={input_size} != output_size={output_size}: stacked Linears "
                "need equal sizes when depth > 1."
            )
        self.linears = nn.ModuleList([nn.Linear(input_size, output_size) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear in self.linears:
            x = linear(x)
        return x


def build_parser(description: str | None) -> argparse.ArgumentParser:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--input-size", type=int, default=256)
    p.add_argument("--output-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-batches", type=int, default=10, help="batches per epoch")
    p.add_argument("--depth", type=int, default=9, help="Linear layers in SimpleNet")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--dtype", choices=amp.DTYPES, default="bfloat16")
    p.add_argument("--device", default=default_device)
    p.add_argument("--seed", type=int, default=100)
    return p


def make_loader(args: argparse.Namespace) -> DataLoader:
    """num_batches * batch_size uniform [0, 1) samples and labels, in order (shuffle=False)."""
    gen = torch.Generator().manual_seed(args.seed)
    n = args.num_batches * args.batch_size
    data = torch.rand(n, args.input_size, generator=gen)
    label = torch.rand(n, args.output_size, generator=gen)
    return DataLoader(
        TensorDataset(data, label), batch_size=args.batch_size, shuffle=False, drop_last=True
    )


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    """The seed's model (seeded), its SGD optimizer and the loader."""
    torch.manual_seed(args.seed)
    model = SimpleNet(args.input_size, args.output_size, args.depth).to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    return model, optimizer, make_loader(args)


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """What one training run ended with."""

    loss: float
    """Loss of the last batch, as the seed prints it."""
    sec_per_batch: float
    """Mean wall time of one training batch (forward, backward, step)."""
    model: nn.Module
    """The trained model."""
    optimizer: torch.optim.Optimizer
    """The optimizer that trained it (decorate's wrapper when it made one)."""


def report(
    mode: str,
    loss: float,
    train_time: float,
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> RunResult:
    sec_per_batch = train_time / (args.epochs * args.num_batches)
    print("loss:", loss)
    print(f"Time consuming using {mode} mode:{sec_per_batch:.3f} sec")
    return RunResult(loss=loss, sec_per_batch=sec_per_batch, model=model, optimizer=optimizer)
