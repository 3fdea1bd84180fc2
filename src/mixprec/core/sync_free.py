"""The inner optimizer's step, skipped on the device: the eager step's way to skip an overflowed
step without reading the overflow flag on the host (issue #27).

Two ways, picked per step by `inner_step`:
- torch's contract for optimizers with `_step_supports_amp_scaling` (fused Adam/AdamW/SGD): the
  kernel is handed `found_inf`, writes nothing where it is set and puts Adam's step count back.
  No extra memory, no extra pass.
- the masked update, for every other optimizer (foreach/for-loop Adam, AdamW, SGD with or
  without momentum, RMSprop, Adagrad, ...): snapshot what the step writes (the params that have
  gradients and every tensor of their optimizer state, `step` counts included), run the step,
  then `torch.where(found_inf, snapshot, new)` back into each of them. Cost: one extra copy of
  those params and their state per step (transient: allocated for the step, freed after it),
  one read + one masked write of each, and one small kernel per tensor. A step that creates or
  replaces state (an optimizer's first step; an optimizer that swaps state objects or keeps
  Python numbers in it) cannot be undone by masking values: it reads the flag once (a host
  sync, on that step only) and puts the old state back if the step was skipped.

Everything the masked update restores must live on the flag's device: a CPU `step` count (torch's
non-capturable Adam on CUDA) restored by a CUDA flag is a device -> host copy, the very sync
this avoids, so such a step keeps the syncing path (`blocker` says why; capturable=True or
fused=True keeps the count on the device).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec.core.clip import local_shards

InnerStep = Callable[[torch.Tensor], None]
"""step(found_inf): the inner optimizer's step, leaving everything as it was where found_inf
(a one-element fp32 device tensor) is non-zero, with no host read of it."""

_HOST_SCALARS = (bool, int, float, str, type(None))


def found_inf_step(optimizer: torch.optim.Optimizer) -> InnerStep:
    """torch's fused contract: the optimizer reads `found_inf` off itself during step()."""

    def step(found_inf: torch.Tensor) -> None:
        optimizer.found_inf = found_inf.reshape(())  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]

    return step


def _stepped_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The params a torch optimizer writes this step: those with a gradient."""
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def _restorable(t: torch.Tensor) -> bool:
    """A dense plain tensor (a Parameter counts): torch.where can write it back exactly."""
    return (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) and t.layout == torch.strided


def blocker(optimizer: torch.optim.Optimizer, device: torch.device) -> str | None:
    """Why the masked update cannot skip this optimizer's step on `device` without a host
    sync (None: it can). Host facts only (devices, types): no sync."""
    params = _stepped_params(optimizer)
    for p, local_p in zip(params, local_shards(params), strict=True):
        if not _restorable(local_p) or local_p.device != device:
            return (
                f"a parameter is a {type(local_p).__name__} on {local_p.device} ({local_p.layout})"
            )
        for key, value in optimizer.state.get(p, {}).items():  # get: creates no entry
            if isinstance(value, torch.Tensor):
                (local,) = local_shards([value])
                if not _restorable(local) or local.device != device:
                    return (
                        f"its state {key!r} is a {type(local).__name__} on {local.device} (a "
                        f"skip restored from the flag on {device} would copy it to the host; "
                        "capturable=True or fused=True keeps it on the device)"
                    )
    return None


def _unchanged(before: dict[str, Any] | None, now: dict[str, Any] | None) -> bool:
    """Whether a param's state holds the same objects (tensors) and numbers as before the step:
    then restoring the tensors' values undoes the step. Host compares only."""
    if not before or not now:
        return not before and not now
    if before.keys() != now.keys():
        return False
    for key, old in before.items():
        new = now[key]
        if isinstance(old, _HOST_SCALARS) and type(old) is type(new):
            if old != new:
                return False
        elif new is not old:
            return False
    return True


class MaskedStep:
    """The inner optimizer's step, undone where found_inf is set (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def __call__(self, found_inf: torch.Tensor) -> None:
        optimizer = self.optimizer
        state = optimizer.state
        params = _stepped_params(optimizer)
        before = {p: dict(state[p]) for p in params if p in state}  # `in`: creates no entry
        live: dict[int, torch.Tensor] = {}
        for t in local_shards(params) + [
            v for s in before.values() for v in s.values() if isinstance(v, torch.Tensor)
        ]:
            (t,) = local_shards([t])
            live.setdefault(id(t), t)
        written = list(live.values())
        saved = [t.clone() for t in written]  # the extra copy of params + state, for this step
        optimizer.step()
        skip = found_inf.reshape(()) > 0
        for t, old in zip(written, saved, strict=True):
            torch.where(skip, old, t, out=t)  # elementwise, in place: the old value on a skip
        if all(_unchanged(before.get(p), state.get(p) if p in state else None) for p in params):
            return
        # State was created or replaced (a first step): whether it stays depends on the flag.
        if found_inf.item() > 0:  # a host sync, on such a step only (see the module docstring)
            for p in params:
                if p in before:
                    state[p] = before[p]  # the old objects, their values restored above
                else:
                    state.pop(p, None)


def inner_step(
    optimizer: torch.optim.Optimizer, device: torch.device
) -> tuple[InnerStep | None, str | None]:
    """(the step that skips on `device` with no host read, None) or (None, why there is none)."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return found_inf_step(optimizer), None
    reason = blocker(optimizer, device)
    if reason is not None:
        return None, reason
    return MaskedStep(optimizer), None
