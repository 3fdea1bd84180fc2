"""Apex's num_losses for the Colossal faces: one loss scaler per loss_id, no global amp state.

The 'fp16_apex' mode with num_losses=N (Colossal's FP16ApexMixedPrecision, its fp16 config
section and convert_to_amp spell it each their way) builds a `MultiLossOptimizer`: the
optimizer `amp.initialize` returns (the per-backward unscale of mixprec.core.per_loss_optim), owning
its N scalers instead of sharing amp's. `optimizer.backward(loss, loss_id=i)` (and
`booster.backward(loss, optimizer, loss_id=i)`, `engine.backward(loss, loss_id=i)`) scales
by scaler i, unscales and checks the new grads at once, and updates scaler i alone.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.per_loss_optim import PerLossOptimizer, UnscaleEvent
from mixprec.core.policy import OPT_LEVELS, Policy, clip_norm_for
from mixprec.core.prepare import prepare_optimizer
from mixprec.core.scaling import (
    LossScaler,
    ProcessGroup,
    all_reduce_found_inf_,
    default_group,
)


def _first_device(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


class MultiLossOptimizer(PerLossOptimizer):
    """A PerLossOptimizer with its own `num_losses` scalers; `backward(loss, loss_id)` does the rest.

    state_dict() adds every scaler under 'loss_scalers' (the core's 'scaler' is scaler 0).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        policy: Policy,
        max_norm: float = 0.0,
        process_group: ProcessGroup | None = None,
    ) -> None:
        device = _first_device(optimizer)
        scalers = [LossScaler(policy.loss_scale, device) for _ in range(policy.num_losses)]
        super().__init__(
            optimizer,
            scalers=scalers,
            verbosity=policy.verbosity,
            master_weights=policy.master_weights,
            max_norm=max_norm,
            process_group=process_group,
        )

    @override
    def backward(self, loss: torch.Tensor, loss_id: int = 0, **kwargs: Any) -> None:
        """Backward of loss times scale `loss_id`; the new grads are unscaled and checked now."""
        if isinstance(loss_id, bool) or not isinstance(loss_id, int):
            raise TypeError(f"loss_id={loss_id!r} must be an int.")
        if not 0 <= loss_id < len(self.scalers):
            raise ValueError(
                f"loss_id={loss_id!r} but num_losses={len(self.scalers)}: valid loss ids are "
                f"0..{len(self.scalers) - 1}."
            )
        scaler = self.scalers[loss_id]
        self.begin_backward()
        (loss.float() * scaler.scale_tensor).backward(**kwargs)
        found_inf = torch.zeros(1, dtype=torch.float32, device=scaler.scale_tensor.device)
        scale_used = scaler.scale_tensor.clone()
        self.unscale_new_grads(scaler.inv_scale(), found_inf)
        all_reduce_found_inf_(found_inf, self.process_group or default_group())
        scaler.update(found_inf)  # this loss's scaler alone follows this loss's overflows
        self.events.append(
            UnscaleEvent(loss_id, found_inf, scale_used, scaler.scale_tensor.clone())
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["loss_scalers"] = [s.state_dict() for s in self.scalers]
        return out

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("loss_scalers")
        if saved is None or len(saved) != len(self.scalers):
            raise ValueError(
                f"This optimizer has num_losses={len(self.scalers)}; the checkpoint holds "
                f"{'no' if saved is None else len(saved)} per-loss scalers ('loss_scalers')."
            )
        super().load_state_dict(state_dict)
        for scaler, scaler_state in zip(self.scalers, saved, strict=True):
            scaler.load_state_dict(scaler_state)


def is_apex_policy(policy: Policy) -> bool:
    """A policy Apex's amp built (its opt levels name it; 'O0 (amp disabled)' is not one)."""
    return policy.name in (*OPT_LEVELS, "fp16_apex")


def prepare_loss_optimizer(
    optimizer: torch.optim.Optimizer,
    policy: Policy,
    *,
    max_norm: float = 0.0,
    process_group: ProcessGroup | None = None,
    single: type[MixedPrecisionOptimizer] = MixedPrecisionOptimizer,
    multi: type[MultiLossOptimizer] = MultiLossOptimizer,
) -> MixedPrecisionOptimizer:
    """The optimizer wrapper for policy: Apex's (per-loss scalers, each backward unscaled as
    Apex's scale_loss exit does) for an Apex policy, whatever num_losses; else the core's.

    One loss went to the core optimizer, which unscales at step(): after
    optimizer.backward(loss) the grads were still multiplied by the loss scale under
    the 'fp16_apex' mode with one loss, and unscaled with two.

    single, multi: the classes built (a face passes its subclasses of MixedPrecisionOptimizer
    and MultiLossOptimizer, so the instance is of the face's class from construction on).
    """
    if policy.num_losses > 1 or is_apex_policy(policy):
        if policy.log_num_zeros_in_grad:
            raise ValueError("log_num_zeros_in_grad=True is not supported with num_losses > 1.")
        return multi(
            optimizer,
            policy=policy,
            max_norm=clip_norm_for(policy, max_norm),  # the policy's own clip, as prepare_optimizer
            process_group=process_group,
        )
    return prepare_optimizer(
        optimizer,
        policy,
        max_norm=max_norm,
        process_group=process_group,
        optimizer_cls=single,
    )


def backward(optimizer: Any, loss: torch.Tensor, loss_id: int = 0) -> None:
    """optimizer.backward(loss, loss_id) where it has per-loss scalers; else loss_id must be 0."""
    if isinstance(optimizer, MultiLossOptimizer):
        optimizer.backward(loss, loss_id=loss_id)
        return
    if loss_id != 0:
        raise ValueError(
            f"loss_id={loss_id!r} but this optimizer has one loss scaler: pass num_losses=N to "
            "the 'fp16_apex' mode (FP16ApexMixedPrecision, Colossal's APEX amp type) for N scalers."
        )
    optimizer.backward(loss)


__all__ = ["MultiLossOptimizer", "backward", "prepare_loss_optimizer"]
