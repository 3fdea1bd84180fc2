"""`mixprec.GradScaler`: torch.amp.GradScaler plus hysteresis, a floor/ceiling and rank agreement.

A subclass, so every torch contract holds (scale/unscale_/step/update, fused optimizers'
`grad_scale`/`found_inf`); only the overflow reduction and the update rule are mixprec's.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import _refresh_per_optimizer_state
from typing_extensions import override

from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import TORCH_SCALER, ScalerConfig, did_you_mean
from mixprec.core.scaling import (
    ProcessGroup,
    all_reduce_found_inf_,
    default_group,
    group_to_hold,
    update_scale_,
)
from mixprec.core.validate import (
    SCALER_FIELDS,
    check_bool,
    check_scaler_value,
    check_scaler_values,
)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


SCALING_KEYWORDS: tuple[str, ...] = (
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "enabled",
    "hysteresis",
    "min_scale",
    "max_scale",
)
"""GradScaler's keywords that set its scale and rule: torch.amp.GradScaler's and mixprec's
hysteresis, floor and ceiling (what a config that builds a torch-style scaler may set)."""
TORCH_KEYWORDS: tuple[str, ...] = (
    "device",
    *SCALING_KEYWORDS,
    "consecutive_hysteresis",
    "dynamic",
    "process_group",
)
"""GradScaler's keywords: torch.amp.GradScaler's and mixprec's extras."""


def unknown_keyword(kwargs: dict[str, Any]) -> TypeError:
    """The error for keywords that are not GradScaler's: other peers' spellings belong to
    their faces' scalers (this class stays torch's drop-in)."""
    key = next(iter(kwargs))
    return TypeError(
        f"mixprec.GradScaler got an unexpected keyword {key!r}: it is torch.amp.GradScaler's "
        "drop-in and takes torch's keywords." + did_you_mean(key, TORCH_KEYWORDS) + " A "
        "peer's own scaler keywords go to its face's scaler: mixprec.paddle.GradScaler takes "
        "Paddle's."
    )


def refuse_stacked_scaler(optimizer: MixedPrecisionOptimizer) -> None:
    """An outside GradScaler over an optimizer that scales the loss itself scales twice and
    unscales twice: the update comes out the optimizer's scale times too small. Refuse it."""
    if optimizer.scales_loss:
        raise RuntimeError(
            f"A GradScaler was given a {type(optimizer).__name__} that scales the loss itself "
            "(a loss-scaling mode: fp16, fp16_naive, Apex O1/O2): both would scale and the "
            "update would come out the loss scale times too small. Drop the GradScaler and call "
            f"{optimizer.traits.scaled_backward_hint} then optimizer.step(); or keep the GradScaler "
            "with a mode that does not scale (fp32/bf16 Booster, mixprec.MixedPrecisionOptimizer "
            "with the default loss_scale)."
        )


class GradScaler(torch.amp.GradScaler):
    """Drop-in for torch.amp.GradScaler (same arguments, same defaults but `device`).

    Extra keywords: hysteresis (overflows tolerated before backing off), min_scale (floor,
    default 1: the scale never collapses to 0), max_scale, consecutive_hysteresis, and
    process_group (the group whose ranks must agree on overflow; default: the world group
    when torch.distributed is initialised), dynamic (False: the scale stays init_scale;
    overflowing steps are still skipped). Another peer's keywords raise TypeError naming its
    face's scaler (mixprec.paddle.GradScaler takes Paddle's).
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = TORCH_SCALER.init_scale,
        growth_factor: float = TORCH_SCALER.growth_factor,
        backoff_factor: float = TORCH_SCALER.backoff_factor,
        growth_interval: int = TORCH_SCALER.growth_interval,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = float("inf"),
        consecutive_hysteresis: bool = False,
        dynamic: bool = True,
        process_group: ProcessGroup | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise unknown_keyword(unknown)
        check_bool("enabled", enabled)  # bool('no') would be True
        check_bool("dynamic", dynamic)
        settings = {"init_scale": init_scale, "growth_factor": growth_factor}
        settings |= {"backoff_factor": backoff_factor, "growth_interval": growth_interval}
        settings |= {"hysteresis": hysteresis, "min_scale": min_scale, "max_scale": max_scale}
        check_scaler_values(settings)  # named as torch names them, before ScalerConfig does
        # mixprec's own settings; the growth/backoff factors and interval live in torch's
        # attributes (setters and load_state_dict write there) and `cfg` reads them from there.
        self._base_cfg = ScalerConfig(
            dynamic=dynamic, consecutive_hysteresis=consecutive_hysteresis, **settings
        )
        super().__init__(
            device or default_device(),
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = group_to_hold(process_group)
        self._hysteresis_tracker: torch.Tensor | None = None
        self._init_hysteresis_tracker = self._base_cfg.hysteresis

    @property
    def cfg(self) -> ScalerConfig:
        """The settings update() applies now: torch's live factors plus mixprec's extras."""
        if not self._enabled:  # torch keeps no factors on a disabled scaler
            return self._base_cfg
        return replace(
            self._base_cfg,
            growth_factor=self._growth_factor,
            backoff_factor=self._backoff_factor,
            growth_interval=self._growth_interval,
        )

    def _check_setting(self, call: str, field: str, value: Any) -> None:
        """A value torch's setter would store blindly, checked by its field's rule and named as
        the user called it ("GradScaler.set_growth_factor: new_factor=1.0 must be > 1 ...")."""
        check_scaler_value(field, value, name=f"{type(self).__name__}.{call}")

    @override
    def set_growth_factor(self, new_factor: float) -> None:
        self._check_setting("set_growth_factor: new_factor", "growth_factor", new_factor)
        super().set_growth_factor(new_factor)

    @override
    def set_backoff_factor(self, new_factor: float) -> None:
        self._check_setting("set_backoff_factor: new_factor", "backoff_factor", new_factor)
        super().set_backoff_factor(new_factor)

    @override
    def set_growth_interval(self, new_interval: int) -> None:
        self._check_setting("set_growth_interval: new_interval", "growth_interval", new_interval)
        super().set_growth_interval(new_interval)

    @override
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis_tracker = torch.full(
            (), self._init_hysteresis_tracker, dtype=torch.int32, device=dev
        )

    def _get_hysteresis_tracker(self) -> int:
        tracker = self._hysteresis_tracker
        return self._init_hysteresis_tracker if tracker is None else int(tracker)

    @override
    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        if isinstance(optimizer, MixedPrecisionOptimizer):
            refuse_stacked_scaler(optimizer)
            optimizer.grads_to_masters()  # param_groups hold the masters: give them the grads
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        group = self.process_group or default_group()
        if not per_device:
            if group is None or dist.get_world_size(group) == 1:
                return per_device  # torch's step() then raises "No inf checks were recorded"
            # The other ranks wait in the all-reduce below: join it rather than raise and hang.
            warnings.warn(
                f"No inf checks were recorded for this optimizer on rank {dist.get_rank()}: "
                "none of its parameters has a gradient. It joined the overflow all-reduce; "
                "its step changes nothing unless another rank overflowed.",
                stacklevel=3,
            )
            per_device = {found_inf.device: found_inf}
        for flag in per_device.values():
            all_reduce_found_inf_(flag, group)
        return per_device

    @override
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if not self._enabled or new_scale is not None:
            super().update(new_scale)  # a set scale leaves both trackers alone, as in torch
            return
        scale, _ = self._check_scale_growth_tracker("update")
        found_infs = [
            found_inf.to(device=scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if not found_infs:
            raise AssertionError("No inf checks were recorded prior to update.")
        if self._hysteresis_tracker is None:
            raise AssertionError("hysteresis tracker missing: scale() was never called.")
        if self.cfg.dynamic:
            self._update_scale_(torch.stack(found_infs).amax())
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def active_scale(self) -> torch.Tensor | None:
        """ScaleRule: the scale tensor (created on this scaler's device if scale() was never
        called), or None while the scaler is disabled."""
        return self.scale_tensor if self._enabled else None

    def advance_(self, found_inf: torch.Tensor) -> None:
        """ScaleRule: this scaler's rule (_update_scale_) unless the scale is static."""
        if self._enabled and self.cfg.dynamic:
            self._update_scale_(found_inf.reshape(()))

    def _update_scale_(self, found_inf: torch.Tensor) -> None:
        """This scaler's update rule (Megatron's hysteresis, scaling.update_scale_) on its own
        state tensors, in place, on the device: no host sync. found_inf is already reduced over
        the ranks. Every path that steps under this scaler (update(), advance_) calls it; a
        scaler with another rule (Paddle's) overrides it."""
        update_scale_(
            self._scale, self._growth_tracker, self._hysteresis_tracker, found_inf, self.cfg
        )

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The scale as a device tensor (no host sync; created on this scaler's device if
        scale() was never called), as LossScaler.scale_tensor."""
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(torch.device(self._device))
        return self._scale

    @override
    def state_dict(self) -> dict[str, Any]:
        """torch's five entries plus mixprec's (torch's load_state_dict ignores the extras)."""
        state = super().state_dict()
        if self._enabled:
            cfg = self._base_cfg
            state["hysteresis"] = cfg.hysteresis
            state["_hysteresis_tracker"] = self._get_hysteresis_tracker()
            state["min_scale"] = cfg.min_scale
            state["max_scale"] = cfg.max_scale
            state["consecutive_hysteresis"] = cfg.consecutive_hysteresis
            state["dynamic"] = cfg.dynamic
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict of this class or of torch.amp.GradScaler.

        A torch one carries no hysteresis: mixprec's extras keep this scaler's settings and
        the hysteresis tracker starts full, as on a fresh run.
        """
        if not self._enabled:
            return
        extras = ("hysteresis", "min_scale", "max_scale", "consecutive_hysteresis", "dynamic")
        factors = ("growth_factor", "backoff_factor", "growth_interval")
        # Checked before anything is loaded, named as the user passed them (state_dict[...]).
        where = f"{type(self).__name__}.load_state_dict: state_dict"
        for key in ("consecutive_hysteresis", "dynamic"):
            if key in state_dict:
                check_bool(f"{where}[{key!r}]", state_dict[key])
        given = {k: state_dict[k] for k in SCALER_FIELDS if k in state_dict}
        check_scaler_values(given, {k: f"{where}[{k!r}]" for k in given})
        base = replace(self._base_cfg, **{k: state_dict[k] for k in extras if k in state_dict})
        replace(base, **{k: state_dict[k] for k in factors if k in state_dict})  # min <= max
        super().load_state_dict(state_dict)
        self._base_cfg = base
        hyst = int(state_dict.get("_hysteresis_tracker", base.hysteresis))
        self._init_hysteresis_tracker = hyst
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(hyst)

    @override
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # torch drops the tensors and keeps their values
        if self._enabled:
            state["_init_hysteresis_tracker"] = self._get_hysteresis_tracker()
            state["_hysteresis_tracker"] = None
        return state

    @override
    def __setstate__(self, state: dict[str, Any]) -> None:
        if "cfg" in state:  # pickled before `cfg` became a view over torch's live factors
            state["_base_cfg"] = state.pop("cfg")
            state.setdefault("_init_hysteresis_tracker", state["_base_cfg"].hysteresis)
        super().__setstate__(state)
