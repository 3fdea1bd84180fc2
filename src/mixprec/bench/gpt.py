"""A byte-level GPT on the Python standard library's own source: the benchmarks' language task.

The model is nanoGPT's shape (256 byte tokens, learned positions, pre-norm blocks of causal
self-attention and a 4x GELU MLP, every projection an nn.Linear so fp8 can convert it). The
data is the standard library's .py files in a fixed order, so every machine trains on the same
bytes without a download. `train_gpt` runs the fixed-step AdamW + cosine schedule the benchmarks
compare modes with; `gpt_val_loss` scores a model on the same validation windows every time.

    train, val = stdlib_text(1_200_000)
    losses = train_gpt(model, opt, train, steps=200, batch=8, context=32, lr=2e-3, seed=0)
    gpt_val_loss(model, val, context=32)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from typing_extensions import override

VOCAB = 256
"""Byte-level: one token per byte value."""
VAL_SEED = 12345
"""The generator seed of the validation windows: the same windows for every run."""


class Block(nn.Module):
    """Pre-norm transformer block: x + proj(causal attention(ln1(x))), x + out(gelu(fc(ln2(x))))."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width={width} must be divisible by heads={heads}.")
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A byte-level GPT (nanoGPT's shape): 256 tokens, learned positions, pre-norm blocks."""

    def __init__(self, width: int, depth: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, width), nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(depth)])
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, VOCAB, bias=False)

    @override
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def stdlib_bytes(limit: int) -> torch.Tensor:
    """The first `limit` bytes of the standard library's own .py sources, in a fixed order."""
    root = Path(os.__file__).parent
    out = bytearray()
    for path in sorted(root.glob("*.py")):
        out += path.read_bytes()
        if len(out) >= limit:
            break
    return torch.tensor(list(out[:limit]), dtype=torch.long)


def stdlib_text(limit: int, train_fraction: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
    """stdlib_bytes(limit) split into (train, validation): the first train_fraction, the rest."""
    if not 0 < train_fraction < 1:
        raise ValueError(f"train_fraction={train_fraction!r} must lie strictly between 0 and 1.")
    text = stdlib_bytes(limit)
    split = int(len(text) * train_fraction)
    return text[:split], text[split:]


def gpt_batch(
    data: torch.Tensor, n: int, context: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """n random windows of `context` bytes (inputs) and the same shifted by one (targets)."""
    start = torch.randint(0, len(data) - context - 1, (n,), generator=g)
    rows = torch.stack([data[s : s + context + 1] for s in start.tolist()])
    return rows[:, :-1], rows[:, 1:]


def gpt_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))


def cosine(step: int, steps: int, peak: float, warmup: int) -> float:
    """Learning rate at `step`: linear warmup to `peak` over `warmup` steps, then cosine to 0."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def set_lr(opt: Any, lr: float) -> None:
    """Every param group's learning rate."""
    for group in opt.param_groups:
        group["lr"] = lr


def train_gpt(
    model: nn.Module,
    opt: Any,
    train: torch.Tensor,
    *,
    steps: int,
    batch: int,
    context: int,
    lr: float,
    seed: int,
    warmup: int = 20,
    on_step: Callable[[int, float], None] | None = None,
) -> None:
    """`steps` steps of a mixprec-prepared (model, opt) on random windows of `train`.

    The windows come from a generator seeded with `seed` (same seed, same batches); the
    learning rate follows cosine(step, steps, lr, warmup). on_step(step, loss) sees each
    step's training loss (a float: reading it synchronizes a device)."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        set_lr(opt, cosine(step, steps, lr, warmup))
        loss = gpt_loss(model, *gpt_batch(train, batch, context, g))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        if on_step is not None:
            on_step(step, loss.item())


def gpt_val_loss(
    model: nn.Module, val: torch.Tensor, context: int, batches: int = 8, batch: int = 32
) -> float:
    """Mean loss over `batches` fixed windows of `val` (VAL_SEED): comparable across runs."""
    gv = torch.Generator().manual_seed(VAL_SEED)
    with torch.no_grad():
        losses = [
            gpt_loss(model, *gpt_batch(val, batch, context, gv)).item() for _ in range(batches)
        ]
    return sum(losses) / len(losses)
