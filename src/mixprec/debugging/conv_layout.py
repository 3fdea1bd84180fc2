"""Seed 002 3.1-3.2 beyond channel counts: A100's 16-wide GEMM tiles, conv layout and the first
conv layer's channels.

- fp16/bf16 GEMM dims want multiples of 8, and of 16 on A100 and newer (compute capability
  8.0+); fp8's are 16 everywhere.
- Tensor cores convolve NHWC: an NCHW (contiguous) conv weight and input are transposed on
  every call, which costs more than the conv for large activations: use channels_last.
- The first conv layer's input channels (3 for RGB) are best padded to 4, for which NVIDIA has
  a dedicated first-layer kernel (or to 8, the general tile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

A100_CAPABILITY = (8, 0)
"""From Ampere (A100) on, fp16/bf16 tensor-core GEMM tiles are 16 wide (seed 002 3.1)."""
A100_MULTIPLE = 16
FIRST_LAYER_CHANNELS = 4
"""Input channels of the first conv layer that NVIDIA's first-layer kernel takes best."""

LAYOUTS = {
    nn.Conv2d: torch.channels_last,
    nn.Conv3d: torch.channels_last_3d,
}
"""Conv types whose weights (and inputs) tensor cores want channels-last."""


@dataclass(frozen=True, kw_only=True)
class ConvNote:
    """One convolution layout finding."""

    name: str
    """Layer name in the model ('' for the model as a whole)."""
    finding: str
    """What is off and what to do about it."""


def gemm_multiple(capability: tuple[int, int] | None, base: int) -> int:
    """The GEMM alignment to check: base (8; 16 for fp8), 16 on A100+ GPUs."""
    if capability is not None and capability >= A100_CAPABILITY:
        return max(base, A100_MULTIPLE)
    return base


def conv_notes(model: nn.Module) -> list[ConvNote]:
    """The first conv layer's input channels and every conv weight not in channels-last."""
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.modules.conv._ConvNd)]
    notes: list[ConvNote] = []
    if not convs:
        return notes
    name, first = convs[0]
    c_in = first.in_channels
    if c_in < 8 and c_in != FIRST_LAYER_CHANNELS:
        pad = FIRST_LAYER_CHANNELS if c_in < FIRST_LAYER_CHANNELS else 8
        notes.append(
            ConvNote(
                name=name,
                finding=f"first conv layer takes {c_in} input channels: pad the input with "
                f"zero channels to {pad} (NVIDIA's fastest first-layer kernel takes "
                f"{FIRST_LAYER_CHANNELS}; 8 is the general tensor-core tile).",
            )
        )
    nchw = [
        n
        for n, m in convs
        if type(m) in LAYOUTS
        and m.weight.dim() >= 4
        and not m.weight.is_contiguous(memory_format=LAYOUTS[type(m)])
    ]
    if nchw:
        listed = ", ".join(nchw[:5]) + (" ..." if len(nchw) > 5 else "")
        notes.append(
            ConvNote(
                name="",
                finding=f"{len(nchw)} conv layer(s) hold NCHW weights ({listed}): tensor cores "
                "convolve NHWC, so each call transposes; use model.to(memory_format="
                "torch.channels_last) and inputs .to(memory_format=torch.channels_last).",
            )
        )
    return notes


__all__ = ["ConvNote", "conv_notes", "gemm_multiple"]
