"""The core optimizer wrapper, extended with Apex's per-backward unscaling (the grad stash).

The core MixedPrecisionOptimizer unscales every gradient once per step with one scaler. Apex
unscales after each backward instead, with that loss's own scaler: gradients already present
(unscaled, from earlier losses) are stashed before the backward, the new ones are unscaled and
checked on their own, then the stash is added back. That lets each loss keep its own scale and
lets an overflow be traced to the loss that caused it. `StashingOptimizer` implements that over
the core's (lp param, fp32 master) pairs; `PerLossOptimizer` is what `amp.initialize` returns.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from typing_extensions import override

from mixprec.core.backward_watch import GradVersions
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.scaling import (
    LossScaler,
    ProcessGroup,
    all_reduce_found_inf_,
    default_group,
    rank_and_world,
    unscale_and_check_,
)

log = logging.getLogger("mixprec")


def is_rank_zero() -> bool:
    """True outside torch.distributed and on its rank 0 (messages are logged once, there)."""
    return rank_and_world()[0] == 0


@dataclass
class UnscaleEvent:
    """One unscale of one loss's gradients: its (reduced) overflow flag and the scales around it."""

    loss_id: int
    """Which loss scaler unscaled (Apex's loss_id)."""
    found_inf: torch.Tensor
    """1 if this loss's new gradients held inf/nan on any rank (a device tensor, no sync)."""
    scale_used: torch.Tensor
    """The loss scale these gradients were computed with."""
    scale_after: torch.Tensor
    """The loss scale once this overflow flag was applied to the scaler."""
    logged: bool = False
    """Set once the overflow message for this event has been written (one message per event)."""


class StashingOptimizer(MixedPrecisionOptimizer):
    """MixedPrecisionOptimizer whose gradients are unscaled after each backward, per scaler.

    Protocol: `begin_backward()`, the scaled backward, then `unscale_new_grads(inv_scale,
    found_inf)`. Master grads accumulate the unscaled contributions; the step is skipped if any
    contribution since the last step overflowed (see `unscale_grads`).

    As in Apex, the low-precision model params keep the grads of their last backward, still
    scaled (in their own dtype): each is copied into its fp32 master's grad and unscaled there,
    and the step applies the masters' grads. Gradients the step applies that were written or
    replaced after their check (a user's edit, a clip, a hook run outside backward) are checked
    again at the step, and on several ranks that check's flag is reduced over the group, so a
    non-finite value any rank wrote skips the step on every rank.
    """

    traits = dataclasses.replace(
        MixedPrecisionOptimizer.traits,
        scaled_backward_hint="`with amp.scale_loss(loss, optimizer) as scaled: scaled.backward()` "
        "or optimizer.backward(loss)",
        carries_grads=False,  # Apex: the master grads hold only what was unscaled since the step
        steps_on_device=False,  # decides on the host
    )

    def __init__(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        if kwargs.pop("fused_step", None):
            raise ValueError(
                "fused_step=True: this optimizer unscales each backward's gradients as it ends, "
                "and the fused step unscales them again at the step; it runs unfused."
            )
        # fused_step=False: the fused pass would unscale the already unscaled grads again
        super().__init__(optimizer, fused_step=False, **kwargs)
        self.events: list[UnscaleEvent] = []
        self.stash = self.transfer.per_backward()
        """The grads present before a backward, set aside (GradTransfer's PerBackward)."""
        # loss_id whose scaled grads are accumulating (delay_unscale), None when none are.
        self.scaled_grads_from: int | None = None
        self.checked = GradVersions()
        """The model's lp grads and the held grads as their last check left them."""
        # 1 once a held grad written after its check held inf/nan (this rank; reduced at step)
        self._late_inf: torch.Tensor | None = None
        self._warned_lp_edit = False

    def begin_backward(self) -> None:
        """Set aside the unscaled grads so the coming backward's grads can be unscaled alone."""
        if self.stash.stashed:  # scaled grads are accumulating (delay_unscale): keep the stash
            return
        self._check_late_writes()  # a master grad written since its check is summed into below
        self.stash.begin()

    @torch.no_grad()
    def unscale_new_grads(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """Unscale and check the grads since begin_backward(), then add them to the earlier ones.

        The lp grads stay on the model params as backward left them (scaled, as in Apex); their
        fp32 copies, unscaled, are added to the masters' grads. found_inf is raised (not reduced
        over ranks: the caller does that once per loss).
        """
        if not self.stash.stashed:
            self.begin_backward()  # nothing was stashed: every grad present is new
        self.stash.add_unscaled(inv_scale, found_inf)
        self.scaled_grads_from = None
        self.checked.record(self._watched())

    def _watched(self) -> list[torch.Tensor]:
        """The params whose grads the checks cover: the model's lp params and the held ones."""
        return [*self.lp_params, *self.transfer.layout().held]

    @torch.no_grad()
    def _check_late_writes(self) -> None:
        """Check (on this rank) the held grads written or replaced since their last check; a
        non-finite one sets _late_inf, which the step reduces over the group."""
        replaced, written = self.checked.diff(self.transfer.layout().held)
        late = [p.grad for p in (*replaced, *written)]
        if late:
            device = self.scaler.scale_tensor.device
            if self._late_inf is None:
                self._late_inf = torch.zeros(1, dtype=torch.float32, device=device)
            one = torch.ones(1, dtype=torch.float32, device=device)  # x 1 is exact: a check
            unscale_and_check_(self.transfer.local(late), one, self._late_inf)
        self.checked.record(self.transfer.layout().held)

    @override
    def unscale_grads(self) -> torch.Tensor:
        """The overflow flag of every contribution since the last step (grads are unscaled),
        and of the held grads written after their check (checked again here).

        On several ranks this reduces that late check's flag over the group on every call (one
        1-element all-reduce: a rank cannot know another wrote nothing)."""
        if self.scaled_grads_from is not None:
            raise RuntimeError(
                "Gradients are still scaled (the last amp.scale_loss had delay_unscale=True): "
                f"end the accumulation with amp.scale_loss(..., loss_id={self.scaled_grads_from}, "
                "delay_unscale=False) before step() or clipping."
            )
        self._check_scaled_backward()
        self._check_lp_grads()
        device = self.scaler.scale_tensor.device
        self._check_late_writes()
        late = self._late_inf
        if late is None:
            late = torch.zeros(1, dtype=torch.float32, device=device)
        if self._shares_steps():
            late = all_reduce_found_inf_(late.clone(), self.process_group or default_group())
        if not self.events:
            return late
        flags = [e.found_inf.to(device) for e in self.events]
        return torch.stack([*flags, late]).amax(dim=0)

    @override
    def _grads_came_through_backward(self) -> bool:
        # one event per scaled backward since the last step; without one, grads that all came
        # through an earlier scaled backward (kept lp grads, own grads a step left) are no misuse
        if self.events:
            return True
        replaced, written = self.checked.diff(self._watched())
        return not replaced and not written

    def _check_lp_grads(self) -> None:
        """lp grads the masters never received raise; lp grads written after they were copied
        to the masters (applied by no step) are warned about once."""
        replaced, written = self.checked.diff(self.lp_params)
        if replaced:
            raise RuntimeError(
                "Some low-precision model params hold gradients that never reached the fp32 "
                "masters: call backward inside `with amp.scale_loss(loss, optimizer) as s: "
                "s.backward()` (or optimizer.backward(loss)), not on the loss directly."
            )
        if written and not self._warned_lp_edit:
            self._warned_lp_edit = True
            if is_rank_zero():
                log.warning(
                    "mixprec: the low-precision model params' gradients changed after their "
                    "backward copied them into the fp32 master gradients; the step applies the "
                    "masters' gradients (amp.master_params(optimizer)), as Apex does, so that "
                    "change is not applied. Clip or edit the master gradients instead. (Warned "
                    "once.)"
                )

    @override
    def clip_grad_norm(self, max_norm: float, norm_type: float | None = None) -> torch.Tensor:
        norm = super().clip_grad_norm(max_norm, norm_type)
        # this clip scaled checked grads by a finite factor: nothing for a later check to see
        self.checked.record(self.transfer.layout().held)
        return norm

    @override
    def _end_step(self) -> None:
        self.events = []  # this step's unscale events are consumed (skips were reported)
        self._late_inf = None

    def _forget_iteration(self) -> None:
        self.events = []
        self.stash.forget()
        self.scaled_grads_from = None
        self._late_inf = None

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for hp in self.hp_masters:  # master grads accumulate per loss here, so they are cleared
            hp.grad = None
        self._forget_iteration()
        self.checked.record(self._watched())  # None, or zeros: nothing left to check

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._forget_iteration()


class PerLossOptimizer(StashingOptimizer):
    """What `amp.initialize` returns for each optimizer (a torch.optim.Optimizer subclass).

    Loss scalers belong to `amp` (one per loss_id); `scaler` is loss scaler 0, so
    `loss_scale`, `state_dict()` and the core's API read it. Scales are updated by
    `amp.scale_loss` after each (non-delayed) backward, not here; `step()` skips if any loss
    that reached this optimizer since the last step overflowed, and clears the master grads.
    max_norm and process_group are MixedPrecisionOptimizer's.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        scalers: list[LossScaler],
        verbosity: int = 1,
        master_weights: bool | None = None,
        max_consecutive_skips: int | None = 100,
        amp_scale_loss: Callable[..., AbstractContextManager[torch.Tensor]] | None = None,
        max_norm: float = 0.0,
        process_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            optimizer,
            loss_scale=scalers[0].cfg,
            master_weights=master_weights,
            max_consecutive_skips=max_consecutive_skips,
            max_norm=max_norm,
            process_group=process_group,
        )
        self.amp_scale_loss = amp_scale_loss  # from amp.initialize: this module does not import amp
        self.scaler = scalers[0]  # shared with amp: no private scale that could drift from it
        self.scalers = scalers
        self.verbosity = verbosity
        self.amp_state: Any = None  # the amp.initialize call this came from (set by it)

    @property
    @override
    def scales_loss(self) -> bool:
        return any(s.cfg.dynamic or s.cfg.init_scale != 1.0 for s in self.scalers)

    @override
    def backward(self, loss: torch.Tensor, loss_id: int = 0, **kwargs: Any) -> None:
        """Same as `with amp.scale_loss(loss, self, loss_id) as s: s.backward(**kwargs)`."""
        if self.amp_scale_loss is None:
            raise RuntimeError(
                "PerLossOptimizer.backward needs the scale_loss of the amp that built it: "
                "get this optimizer from amp.initialize."
            )
        with self.amp_scale_loss(loss, self, loss_id=loss_id) as scaled_loss:
            scaled_loss.backward(**kwargs)

    @override
    def _report_skip(self, scale: float) -> None:
        self._log_overflows()

    @override
    def _report_skip_pattern(self, message: str) -> None:
        if self.verbosity > 0:  # Apex's verbosity=0 silences every amp message
            super()._report_skip_pattern(message)

    def _log_overflows(self) -> None:
        if self.verbosity <= 0 or not is_rank_zero():
            return
        for event in self.events:
            # a host sync per event, paid only on a skipped step
            if not event.logged and bool(event.found_inf.item()):
                event.logged = True
                log.warning(
                    "Gradient overflow.  Skipping step, loss scaler %d reducing loss scale to %s",
                    event.loss_id,
                    float(event.scale_after.item()),
                )

    # The core's step, configured: the grads were unscaled at each backward; skip if any
    # contributing loss overflowed.
    @override
    def _scale_used(self) -> torch.Tensor:
        """The scale the last contributing loss's grads were computed with."""
        return self.events[-1].scale_used if self.events else self.scaler.scale_tensor

    @override
    def _update_scale(self, found_inf: torch.Tensor) -> None:
        """Nothing: amp.scale_loss advanced each loss's scaler after its backward."""

    @override
    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Apex's rule by default (set_to_none=None): with fp32 masters the model's grads are
        zeroed in place (Apex's patched zero_grad), else dropped (torch's default); the masters'
        grads are dropped either way. True / False: torch's meaning."""
        if set_to_none is None:
            set_to_none = not self.lp_params
        super().zero_grad(set_to_none)

    @override
    def _end_step(self) -> None:
        super()._end_step()
        for hp in self.hp_masters:  # Apex: master grads are cleared after every step
            hp.grad = None

    @override
    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optim!r}, num_losses={len(self.scalers)})"


def reduce_found_inf_(found_inf: torch.Tensor) -> torch.Tensor:
    """MAX-reduce an overflow flag over the world (when initialised): every rank skips alike."""
    return all_reduce_found_inf_(found_inf, default_group())
