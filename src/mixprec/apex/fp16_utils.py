"""Apex's `fp16_utils.FP16_Optimizer`: fp32 masters and loss scaling for a model you cast yourself.

    model = model.half()
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               dynamic_loss_scale=True)
    optimizer.zero_grad()
    optimizer.backward(loss)           # instead of loss.backward()
    optimizer.clip_master_grads(1.0)   # optional: clips the unscaled fp32 master grads
    optimizer.step()                   # skipped (and the scale reduced) on inf/nan

A thin face over the core MixedPrecisionOptimizer: it is a torch.optim.Optimizer (LR
schedulers take it directly, where Apex's needed `optimizer.optimizer`), and state_dict()
holds the inner state, the fp32 masters and the scaler, so a resumed run continues exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from typing_extensions import override

from mixprec.core.commit import StepResult
from mixprec.core.per_loss_optim import (
    StashingOptimizer,
    UnscaleEvent,
    is_rank_zero,
    reduce_found_inf_,
)
from mixprec.core.policy import ScalerConfig, check_keys
from mixprec.core.validate import check_scaler_values

log = logging.getLogger("mixprec")
DYNAMIC_LOSS_ARGS = ("init_scale", "scale_factor", "scale_window")


def dynamic_loss_args_to_config(args: Mapping[str, Any] | None) -> ScalerConfig:
    """Apex's DynamicLossScaler(init_scale=2**32, scale_factor=2., scale_window=1000), floor 1."""
    args = dict(args or {})
    check_keys("dynamic_loss_args", args, DYNAMIC_LOSS_ARGS)
    settings = {
        "init_scale": args.get("init_scale", 2.0**32),
        "growth_factor": args.get("scale_factor", 2.0),
        "growth_interval": args.get("scale_window", 1000),
    }
    apex_names = {"init_scale": "init_scale", "growth_factor": "scale_factor"}
    apex_names["growth_interval"] = "scale_window"
    check_scaler_values(settings, {k: f"dynamic_loss_args {v}" for k, v in apex_names.items()})
    factor = float(settings["growth_factor"])
    return ScalerConfig(
        init_scale=float(settings["init_scale"]),
        growth_factor=factor,
        backoff_factor=1.0 / factor,
        growth_interval=settings["growth_interval"],
        min_scale=1.0,
    )


class FP16_Optimizer(StashingOptimizer):  # noqa: N801 - Apex's name, which scripts import
    """Apex's FP16_Optimizer(init_optimizer, static_loss_scale, dynamic_loss_scale, ...).

    Args:
        init_optimizer: a torch optimizer over the (already fp16) model's params.
        static_loss_scale: the fixed scale, used when dynamic_loss_scale is False.
        dynamic_loss_scale: adapt the scale (halve on overflow, double after a clean window).
        dynamic_loss_args: Apex's DynamicLossScaler keywords: init_scale, scale_factor,
            scale_window.
        verbose: log the overflow message ("Gradient overflow.  Skipping step, reducing loss
            scale to X") on rank 0.
    """

    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: Mapping[str, Any] | None = None,
        verbose: bool = True,
    ) -> None:
        if dynamic_loss_scale:
            cfg = dynamic_loss_args_to_config(dynamic_loss_args)
        else:
            if dynamic_loss_args is not None:
                raise ValueError(
                    f"dynamic_loss_args={dict(dynamic_loss_args)!r} given with "
                    "dynamic_loss_scale=False; set dynamic_loss_scale=True to use them."
                )
            cfg = ScalerConfig(dynamic=False, init_scale=float(static_loss_scale))
        super().__init__(init_optimizer, loss_scale=cfg)
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self.verbose = verbose
        self.overflow = False

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer (Apex's attribute name)."""
        return self.optim

    @override
    def backward(  # type: ignore[override]
        self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False
    ) -> None:
        """Backward of loss * scale; with update_master_grads, unscale into the fp32 masters.

        Several backward calls before one step accumulate; update_master_grads=False defers
        the unscale of all of them to update_master_grads() (called by step() if needed).
        """
        self.begin_backward()
        self.scaled_grads_from = 0
        (loss.float() * self.scaler.scale_tensor).backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscale the grads of the backward calls since the last update into the masters."""
        if self.scaled_grads_from is None:
            return
        scale = self.scaler.scale_tensor
        found_inf = torch.zeros(1, dtype=torch.float32, device=scale.device)
        self.unscale_new_grads(self.scaler.inv_scale(), found_inf)
        reduce_found_inf_(found_inf)
        self.events.append(UnscaleEvent(0, found_inf, scale.clone(), scale.clone()))

    @override
    def zero_grad(  # type: ignore[override]
        self,
        set_grads_to_None: bool = False,
        *,
        set_to_none: bool | None = None,  # noqa: N803
    ) -> None:
        """Zero the model grads in place (Apex's default) or drop them; master grads are dropped."""
        super().zero_grad(set_grads_to_None if set_to_none is None else set_to_none)

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the fp32 master grads; their total norm, or -1 if they overflowed (as Apex)."""
        self.update_master_grads()
        if bool(self.unscale_grads().item()):  # host sync: Apex returns -1 on overflow
            return -1.0
        return float(self.clip_grad_norm(max_norm, norm_type))

    # The core's step, configured: grads deferred by update_master_grads=False are unscaled
    # first; the own scaler decides and advances as the core's.
    @override
    def unscale_grads(self) -> torch.Tensor:
        self.update_master_grads()
        return super().unscale_grads()

    @override
    def _after_update(self, result: StepResult) -> None:
        self.overflow = result.skipped  # Apex's attribute

    @override
    def _report_skip(self, scale: float) -> None:
        if self.verbose and is_rank_zero():
            log.warning(
                "Gradient overflow.  Skipping step, reducing loss scale to %s", self.scaler.scale
            )

    @override
    def _report_skip_pattern(self, message: str) -> None:
        if self.verbose:  # verbose=False silences every message, as in Apex
            super()._report_skip_pattern(message)

    @override
    def __repr__(self) -> str:
        return f"FP16_Optimizer({self.optim!r}, scaler={self.scaler.cfg})"


__all__ = ["FP16_Optimizer"]
