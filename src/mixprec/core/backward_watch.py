"""What came between an optimizer's backward() and its step(), checked at the step.

Three misuses that train on silently with the wrong update, each found from host facts the step
has anyway (a flag, a tensor's version counter: no host sync): grads that did not come through
the optimizer's scaled backward (plain loss.backward() in a loss-scaling mode), grads written in
place while still scaled (torch's clip_grad_norm_ between backward() and step()), and a step with
no gradient at all. MixedPrecisionOptimizer holds one BackwardWatch.

GradVersions is the same host fact kept for many grads: an optimizer that checks its gradients
before the step (Apex's, at each backward) finds with it the ones written or replaced after
their check, so the step checks those again instead of applying them unseen.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from mixprec.core.scaling import rank_and_world
from mixprec.core.skip_monitor import scale_text

log = logging.getLogger("mixprec")


class BackwardWatch:
    """One optimizer's record of its last backward() and what it has warned about (once each)."""

    def __init__(self) -> None:
        self.scaled = False
        """This step's grads came through the scaled backward (or a face said they did); cleared
        by the step and zero_grad()."""
        self.seen: tuple[torch.Tensor, int] | None = None
        """A model grad and its version counter as the last scaled backward left it."""
        self._warned_edit = False
        self.warned_no_grads = False
        """Set at the first step: warn_no_grads looks once."""

    def clear(self) -> None:
        """A step ended (or zero_grad ran): the next grads are the next backward's."""
        self.scaled = False
        self.seen = None

    def note_scaled(self, probe: torch.Tensor | None) -> None:
        """A scaled backward just ran; probe: a model param whose grad is watched for an
        in-place write before the step (None: watch none)."""
        if self._warned_edit:
            return
        grad = None if probe is None else probe.grad
        self.seen = None if grad is None else (grad, grad._version)

    def check_edit(self, probe: torch.Tensor | None, *, unscaled: bool, scale: Any) -> None:
        """torch.nn.utils.clip_grad_norm_ between backward() and step() clips the *scaled*
        grads (the update then comes out ~scale times too small): say so once, at WARNING.
        Seen as an in-place write to the probe's grad after the last scaled backward; unscaled:
        the optimizer unscaled them itself (its own clip), so what came after is unscaled."""
        seen, self.seen = self.seen, None
        if seen is None or unscaled:
            return
        grad = None if probe is None else probe.grad
        if grad is None or grad is not seen[0] or grad._version == seen[1]:
            return
        self._warned_edit = True
        if rank_and_world()[0] == 0:
            log.warning(
                "mixprec: the gradients were changed in place between backward() and step() "
                "while they were still multiplied by the loss scale (%s). If that was "
                "torch.nn.utils.clip_grad_norm_, it clipped the scaled gradients and the update "
                "comes out about that many times too small: clip with optimizer.clip_grad_norm"
                "(max_norm) (it unscales first), or set the clipping in the mode/plugin "
                "(max_norm), instead. (Warned once.)",
                scale_text(scale.scale),
            )

    def warn_no_grads(self, params: Iterable[torch.Tensor]) -> None:
        """torch's optimizers step nothing, silently, when no param has a grad; we say so.

        Called at the first step only (warned_no_grads): a misconfigured run shows there, and
        a healthy one pays this loop once, not every step (any() stops at the first grad)."""
        self.warned_no_grads = True
        if any(p.grad is not None for p in params):
            return
        warnings.warn(
            "MixedPrecisionOptimizer.step(): no parameter has a gradient, so nothing is "
            "updated (torch's optimizers do the same without a word). Call backward(loss) "
            "before step(), and check the parameters passed to the optimizer are the model's.",
            stacklevel=4,
        )


class GradVersions:
    """The gradients of some params as a check left them: each known by a weak reference and
    its version counter (host ints: reading them costs no sync), so a later in-place write
    (a clip, a user's edit) or a replaced .grad is found without looking at any value."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}

    def record(self, params: Iterable[torch.Tensor]) -> None:
        """Note params' grads as they are now (a param without a grad is forgotten)."""
        for p in params:
            grad = p.grad
            if grad is None:
                self._seen.pop(id(p), None)
            else:
                self._seen[id(p)] = (weakref.ref(grad), grad._version)

    def clear(self) -> None:
        self._seen = {}

    def diff(self, params: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(params whose grad is not the recorded tensor, params whose recorded grad was written
        in place since): grads set to None since the record are in neither."""
        replaced, written = [], []
        for p in params:
            grad = p.grad
            if grad is None:
                continue
            seen = self._seen.get(id(p))
            if seen is None or seen[0]() is not grad:
                replaced.append(p)
            elif grad._version != seen[1]:
                written.append(p)
        return replaced, written


def unscaled_grads_error(owner: str, cfg: Any, hint: str) -> RuntimeError:
    """The error for grads that did not come through a loss-scaling optimizer's scaled backward
    (owner: its class name; cfg: its ScalerConfig; hint: how its users run that backward):
    unscaling them by the optimizer's scale would shrink the update by that scale, silently."""
    return RuntimeError(
        f"{owner}.step(): the gradients did not come through this "
        "optimizer's scaled backward (a plain loss.backward(), or an outside GradScaler's "
        "scaler.scale(loss).backward()), but this mode scales the loss itself "
        f"({'dynamic' if cfg.dynamic else 'static'} loss scale, starting at "
        f"{cfg.init_scale:g}). Unscaling them would make the update that many "
        f"times too small. Call {hint} instead of loss.backward(), and "
        "use no outside GradScaler with it (this optimizer is the loss scaler). Plain "
        "loss.backward() is fine in modes without loss scaling (bf16, fp32)."
    )
