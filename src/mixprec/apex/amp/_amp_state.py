"""Apex's `apex.amp._amp_state` module: `from mixprec.apex.amp._amp_state import _amp_state`.

The one process-wide amp state (see mixprec.apex.amp_state) and `master_params`, as there.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mixprec.apex.amp_state import AmpStateHandle

_amp_state = AmpStateHandle()
"""Apex's `amp._amp_state`: loss_scalers, opt_properties, handle, allow_incoming_model_not_fp32."""


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The params the optimizer steps: fp32 masters where there are any (clip these grads)."""
    for group in optimizer.param_groups:
        yield from group["params"]


__all__ = ["_amp_state", "master_params"]
