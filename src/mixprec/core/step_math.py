"""Step rules every path shares (the eager, fused and compiled steps, ZeRO, the pipeline).

Written once here so the paths cannot drift apart: a second copy of a rule is how the eager and
compiled steps came to disagree.
"""

from __future__ import annotations

import torch

CLIP_EPS = 1e-6
"""torch.nn.utils.clip_grad_norm_'s epsilon in max_norm / (total_norm + eps)."""


def clip_coefficient(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """torch's clip_grad_norm_ coefficient, max_norm / (total_norm + CLIP_EPS) clamped at 1 (a
    device tensor: no sync). inf/nan on a step that will be skipped is harmless."""
    return torch.clamp(max_norm / (total_norm + CLIP_EPS), max=1.0)
