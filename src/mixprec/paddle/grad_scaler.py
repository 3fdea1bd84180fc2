"""paddle.amp.GradScaler: Paddle's signature, getters/setters, state_dict and scale rule.

A subclass of mixprec.GradScaler (torch's contracts: scale/unscale_/step/update, fused
optimizers), constructed as Paddle's: GradScaler(enable, init_loss_scaling, incr_ratio,
decr_ratio, incr_every_n_steps, decr_every_n_nan_or_inf, use_dynamic_loss_scaling).

The scale follows Paddle's update_loss_scaling rule: _update_scale_ (device-side), which the
core's update() and advance_ (compile_step, the static face's program) both call.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from typing_extensions import override

from mixprec.core.grad_scaler import GradScaler as _CoreGradScaler
from mixprec.core.grad_scaler import default_device
from mixprec.core.policy import TORCH_SCALER, did_you_mean
from mixprec.core.scaling import ProcessGroup
from mixprec.core.validate import check_scaler_values
from mixprec.paddle.dygraph import MasterWeightOptimizer, amp_global_state, holds_pure_lp_params

TORCH_ALIASES: dict[str, str] = {
    "enabled": "enable",
    "init_scale": "init_loss_scaling",
    "growth_factor": "incr_ratio",
    "backoff_factor": "decr_ratio",
    "growth_interval": "incr_every_n_steps",
    "hysteresis": "decr_every_n_nan_or_inf",
}
"""torch's / mixprec's keyword -> Paddle's parameter (either spelling is accepted, not both)."""

PADDLE_STATE_KEYS: tuple[str, ...] = (
    "scale",
    "incr_ratio",
    "decr_ratio",
    "incr_every_n_steps",
    "decr_every_n_nan_or_inf",
    "incr_count",
    "decr_count",
    "use_dynamic_loss_scaling",
)
"""The keys of Paddle 3.3.1's GradScaler.state_dict()."""


def _explicit_arguments(init: Callable) -> Callable:
    """Record on self the names the caller passed (positionally or by keyword), so an alias
    given beside its Paddle spelling is caught even when the values look like defaults."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        filled_enable = False
        if args and isinstance(args[0], str | torch.device | float):
            # torch's order, GradScaler([device,] init_scale, growth_factor, backoff_factor,
            # growth_interval, enabled), as Paddle's development branch reads it: a device or
            # a float first cannot be `enable`; the next four mean Paddle's next four
            device, rest = (None, args) if isinstance(args[0], float) else (args[0], args[1:])
            if len(rest) > 5:
                raise TypeError(
                    f"GradScaler{args!r}: torch's order takes at most 5 values after the "
                    "device (init_scale, growth_factor, backoff_factor, growth_interval, "
                    "enabled); pass Paddle's other settings by keyword."
                )
            if device is not None:
                if "device" in kwargs:
                    raise ValueError(
                        f"GradScaler got the device twice: {device!r} first and device="
                        f"{kwargs['device']!r}. Pass one."
                    )
                kwargs = {**kwargs, "device": device}
            if len(rest) == 5:
                if "enable" in kwargs or "enabled" in kwargs:
                    raise ValueError(
                        f"GradScaler got enabled={rest[4]!r} as torch's fifth value and "
                        "enable/enabled by keyword: pass one."
                    )
                kwargs["enabled"], rest = rest[4], rest[:4]
            filled_enable = "enable" not in kwargs
            args = (kwargs.pop("enable", True), *rest)
        bound = signature.bind(self, *args, **kwargs)
        self._explicit = set(bound.arguments) | set(kwargs)
        if filled_enable:  # True filled in above, not the caller's: torch's enabled= may set it
            self._explicit.discard("enable")
        init(self, *args, **kwargs)

    return wrapper


def _scale_value(value: Any) -> float:
    """A saved scale as a float: Paddle saves a shape-[1] array, torch a float."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value, dtype=np.float64).reshape(-1)
    if array.size != 1:
        raise ValueError(f"state_dict['scale']={value!r} must hold one value.")
    return float(array[0])


class GradScaler(_CoreGradScaler):
    """paddle.amp.GradScaler on mixprec: Paddle's arguments in Paddle's order.

    enable: False makes scale() an identity and step() a plain optimizer step. A str or
        torch.device first, or a float, is torch's order, GradScaler([device,] init_scale,
        growth_factor, backoff_factor, growth_interval, enabled), as Paddle's development
        branch reads it; a device given both first and by keyword is refused.
    init_loss_scaling, incr_ratio, decr_ratio, incr_every_n_steps, decr_every_n_nan_or_inf,
    use_dynamic_loss_scaling: Paddle's, with Paddle's defaults.
    Keyword-only, mixprec's: device (None: 'cuda' when visible, else 'cpu'), min_scale (the
    floor, 1 as Paddle's static kernel), max_scale, process_group; torch's spellings
    (enabled, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis) are
    accepted in place of Paddle's, never beside them.

    Unscales float16 gradients of params that decorate(level='O2') cast (torch refuses them).
    A dynamic scaler used after a bfloat16 auto_cast switches itself off at its next scale(),
    as Paddle 3.x does (bf16 needs no loss scale).
    """

    @_explicit_arguments
    def __init__(
        self,
        enable: bool = True,
        init_loss_scaling: float = TORCH_SCALER.init_scale,
        incr_ratio: float = TORCH_SCALER.growth_factor,
        decr_ratio: float = TORCH_SCALER.backoff_factor,
        incr_every_n_steps: int = TORCH_SCALER.growth_interval,
        decr_every_n_nan_or_inf: int = 1,
        use_dynamic_loss_scaling: bool = True,
        *,
        device: str | torch.device | None = None,
        min_scale: float = 1.0,
        max_scale: float = float("inf"),
        process_group: ProcessGroup | None = None,
        **torch_names: Any,
    ) -> None:
        values = {
            "enable": enable,
            "init_loss_scaling": init_loss_scaling,
            "incr_ratio": incr_ratio,
            "decr_ratio": decr_ratio,
            "incr_every_n_steps": incr_every_n_steps,
            "decr_every_n_nan_or_inf": decr_every_n_nan_or_inf,
        }
        explicit = self.__dict__.pop("_explicit", set())
        for alias, value in torch_names.items():
            if alias not in TORCH_ALIASES:
                valid = [*values, "use_dynamic_loss_scaling", "device", "min_scale"]
                valid += ["max_scale", "process_group", *TORCH_ALIASES]
                raise TypeError(
                    f"GradScaler got an unknown keyword {alias!r}." + did_you_mean(alias, valid)
                )
            paddle_name = TORCH_ALIASES[alias]
            if paddle_name in explicit:
                raise ValueError(
                    f"GradScaler got {paddle_name}={values[paddle_name]!r} and {alias}={value!r}: "
                    f"they name one setting ({alias} is torch's spelling); pass only one."
                )
            values[paddle_name] = value
        for name in ("enable", "use_dynamic_loss_scaling"):
            value = values.get(name, use_dynamic_loss_scaling)
            if not isinstance(value, bool):
                hint = (
                    " Paddle's GradScaler takes enable first; pass the device by keyword: "
                    f"GradScaler(device={value!r}, ...)."
                    if name == "enable" and isinstance(value, str | torch.device)
                    else ""
                )
                raise TypeError(f"{name}={value!r} must be a bool.{hint}")
        if isinstance(device, str | torch.device):
            device = str(device)
            try:
                torch.device(device)
            except RuntimeError:
                raise ValueError(
                    f"device={device!r} is not a torch device. Valid: 'cpu', 'cuda', 'cuda:<i>' "
                    "or another torch device type ('xpu', 'mps', ...)."
                ) from None
        elif device is not None:
            raise TypeError(f"device={device!r} must be a str, a torch.device or None.")
        # each setting named as the user wrote it: Paddle's name, or torch's alias of it
        field_of = {paddle: torch for torch, paddle in TORCH_ALIASES.items() if torch != "enabled"}
        written = {TORCH_ALIASES[alias]: alias for alias in torch_names}
        check_scaler_values(
            {field_of[p]: values[p] for p in field_of},
            {field_of[p]: written.get(p, p) for p in field_of},
        )
        super().__init__(
            device or default_device(),
            init_scale=values["init_loss_scaling"],
            growth_factor=values["incr_ratio"],
            backoff_factor=values["decr_ratio"],
            growth_interval=values["incr_every_n_steps"],
            enabled=values["enable"],
            hysteresis=values["decr_every_n_nan_or_inf"],
            min_scale=min_scale,
            max_scale=max_scale,
            process_group=process_group,
            dynamic=use_dynamic_loss_scaling,
        )
        self._init_bad_steps = 0  # Paddle's decr_count before the state tensors exist
        self._bad_steps: torch.Tensor | None = None

    # ----- the scale rule (Paddle's update_loss_scaling), on the device -----

    @override
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._bad_steps = torch.full((), self._init_bad_steps, dtype=torch.int32, device=dev)

    @override
    def _update_scale_(self, found_inf: torch.Tensor) -> None:
        """Paddle's rule, in place and without a host sync: a bad step zeroes the good count
        and counts; decr_every_n_nan_or_inf bad steps in a row (a clean one resets the count)
        multiply the scale by decr_ratio (floor min_scale) and restart the count;
        incr_every_n_steps clean steps in a row multiply it by incr_ratio (only to a finite
        value) and restart theirs."""
        if self._bad_steps is None:
            raise AssertionError("scale() was never called: the scaler has no state yet.")
        scale, good, bad = self._scale, self._growth_tracker, self._bad_steps
        cfg = self.cfg
        bad_step = found_inf.reshape(()) > 0  # torch keeps scale and trackers 0-d
        bad_now = (bad + 1).masked_fill_(~bad_step, 0)
        good_now = (good + 1).masked_fill_(bad_step, 0)
        backoff = bad_now >= cfg.hysteresis
        grow = good_now >= cfg.growth_interval
        backed = torch.clamp(scale * cfg.backoff_factor, min=cfg.min_scale)
        grown = torch.clamp(scale * cfg.growth_factor, max=cfg.max_scale)
        grown = torch.where(torch.isfinite(grown), grown, scale)  # Paddle keeps a finite scale
        scale.copy_(torch.where(backoff, backed, torch.where(grow, grown, scale)))
        bad.copy_(bad_now.masked_fill_(backoff, 0))
        good.copy_(good_now.masked_fill_(grow, 0))

    # ----- scale / step -----

    @override
    def scale(self, outputs: Any) -> Any:
        self._disable_for_bf16()
        return super().scale(outputs)

    @override
    def active_scale(self) -> torch.Tensor | None:
        """ScaleRule (compile_step's scale() of each step): switched off under bf16 as there."""
        self._disable_for_bf16()
        return super().active_scale()

    def _disable_for_bf16(self) -> None:
        """Paddle 3.x: a dynamic scaler used after a bfloat16 auto_cast switches itself off."""
        if not (self._enabled and self.cfg.dynamic and amp_global_state().amp_dtype == "bfloat16"):
            return
        self._enabled = False
        self._base_cfg = replace(self._base_cfg, dynamic=False, init_scale=1.0)
        self._init_scale = 1.0
        warnings.warn(
            "mixprec.paddle.GradScaler: dynamic loss scaling is not used with bfloat16 (the "
            "last auto_cast's dtype), so this GradScaler is now disabled (scale() returns the "
            "loss unchanged), as Paddle's.",
            UserWarning,
            stacklevel=3,
        )

    @override
    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        allow_fp16 = allow_fp16 or holds_pure_lp_params(optimizer)
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    @override
    def _maybe_opt_step(
        self,
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict[str, Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if not isinstance(optimizer, MasterWeightOptimizer):
            return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        # decorate's optimizer decides the skip itself: hand it this check's flag, so the
        # step has one finite check and one host sync (the optimizer's), not two of each.
        flags = list(optimizer_state["found_inf_per_device"].values())
        found_inf = flags[0] if len(flags) == 1 else torch.stack(flags).amax()
        optimizer.use_checked_grads(found_inf.reshape(1))
        return optimizer.step(*args, **kwargs)

    def minimize(
        self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any
    ) -> tuple[list[Any], list[tuple[torch.Tensor, torch.Tensor]]]:
        """step(optimizer) then update(), as Paddle's minimize after `scaled.backward()`.

        Paddle passes the scaled loss here; backward has already run, so it is not used.
        Returns (optimize_ops, params_grads) as Paddle's dygraph: no ops, and the
        (parameter, unscaled gradient) pairs the optimizer saw (in fp32 masters' case, theirs).
        """
        self.step(optimizer)
        self.update()
        params_grads = [
            (p, p.grad)
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        return [], params_grads

    # ----- Paddle's getters and setters -----

    def is_enable(self) -> bool:
        """Whether loss scaling is on (False after a bf16 auto_cast switched it off)."""
        return self._enabled

    def is_use_dynamic_loss_scaling(self) -> bool:
        """Whether the scale moves (False on a disabled scaler, as Paddle's)."""
        return self._enabled and self.cfg.dynamic

    def get_init_loss_scaling(self) -> float:
        """The initial scale (1.0 on a disabled scaler, as Paddle's)."""
        return float(self._init_scale) if self._enabled else 1.0

    def set_init_loss_scaling(self, new_init_loss_scaling: float) -> None:
        """Set the initial scale; the current scale restarts from it (as Paddle's)."""
        if isinstance(new_init_loss_scaling, bool) or not (
            isinstance(new_init_loss_scaling, int | float)
            and math.isfinite(new_init_loss_scaling)
            and new_init_loss_scaling > 0
        ):
            raise ValueError(
                f"new_init_loss_scaling={new_init_loss_scaling!r} must be a finite number > 0."
            )
        self._base_cfg = replace(self._base_cfg, init_scale=new_init_loss_scaling)
        self._init_scale = float(new_init_loss_scaling)
        if self._scale is not None:
            self._scale.fill_(float(new_init_loss_scaling))

    def get_incr_ratio(self) -> float:
        return self.cfg.growth_factor

    def set_incr_ratio(self, new_incr_ratio: float) -> None:
        """Must be > 1 (ValueError; Paddle asserts)."""
        self.set_growth_factor(new_incr_ratio)

    def get_decr_ratio(self) -> float:
        return self.cfg.backoff_factor

    def set_decr_ratio(self, new_decr_ratio: float) -> None:
        """Must lie in (0, 1) (ValueError; Paddle asserts < 1)."""
        self.set_backoff_factor(new_decr_ratio)

    def get_incr_every_n_steps(self) -> int:
        return self.cfg.growth_interval

    def set_incr_every_n_steps(self, new_incr_every_n_steps: int) -> None:
        self.set_growth_interval(new_incr_every_n_steps)

    def get_decr_every_n_nan_or_inf(self) -> int:
        return self.cfg.hysteresis

    def set_decr_every_n_nan_or_inf(self, new_decr_every_n_nan_or_inf: int) -> None:
        self._base_cfg = replace(self._base_cfg, hysteresis=new_decr_every_n_nan_or_inf)

    @override
    def set_growth_factor(self, new_factor: float) -> None:
        super().set_growth_factor(new_factor)
        self._base_cfg = replace(self._base_cfg, growth_factor=new_factor)

    @override
    def set_backoff_factor(self, new_factor: float) -> None:
        super().set_backoff_factor(new_factor)
        self._base_cfg = replace(self._base_cfg, backoff_factor=new_factor)

    @override
    def set_growth_interval(self, new_interval: int) -> None:
        super().set_growth_interval(new_interval)
        self._base_cfg = replace(self._base_cfg, growth_interval=new_interval)

    # ----- state -----

    def _get_bad_steps(self) -> int:
        return self._init_bad_steps if self._bad_steps is None else int(self._bad_steps.item())

    @override
    def state_dict(self) -> dict[str, Any]:
        """Paddle's eight keys, plus torch's (so torch.amp.GradScaler loads it) and mixprec's
        floor and ceiling; {} when disabled. 'scale' is a float, not Paddle's shape-[1] array
        (torch.load(weights_only=True) refuses numpy arrays)."""
        if not self._enabled:
            return {}
        state = super().state_dict()
        for key in ("hysteresis", "_hysteresis_tracker", "consecutive_hysteresis", "dynamic"):
            state.pop(key, None)  # Paddle's names below carry them
        cfg = self.cfg
        state.update(
            incr_ratio=cfg.growth_factor,
            decr_ratio=cfg.backoff_factor,
            incr_every_n_steps=cfg.growth_interval,
            decr_every_n_nan_or_inf=cfg.hysteresis,
            incr_count=int(state["_growth_tracker"]),
            decr_count=self._get_bad_steps(),
            use_dynamic_loss_scaling=cfg.dynamic,
        )
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load Paddle's layout (its 'scale' array included) or torch's / mixprec's.

        A no-op on a disabled scaler (as Paddle's); an empty dict raises (as both).
        """
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("The state_dict is empty: it was saved from a disabled GradScaler.")
        state = dict(state_dict)
        paddle_to_torch = {
            "incr_ratio": "growth_factor",
            "decr_ratio": "backoff_factor",
            "incr_every_n_steps": "growth_interval",
            "incr_count": "_growth_tracker",
            "decr_every_n_nan_or_inf": "hysteresis",
            "use_dynamic_loss_scaling": "dynamic",
        }
        if "incr_ratio" in state or "decr_count" in state and "growth_factor" not in state:
            missing = [k for k in PADDLE_STATE_KEYS if k not in state]
            if missing:
                raise KeyError(
                    f"GradScaler state_dict in Paddle's layout lacks {missing}; "
                    f"got keys {sorted(state)}."
                )
        for paddle_key, torch_key in paddle_to_torch.items():
            if paddle_key in state:
                state[torch_key] = state.pop(paddle_key)
        bad = int(state.pop("decr_count", 0))
        if "scale" in state:
            state["scale"] = _scale_value(state["scale"])
        super().load_state_dict(state)
        self._init_bad_steps = bad
        if self._bad_steps is not None:
            self._bad_steps.fill_(bad)

    @override
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            state["_init_bad_steps"] = self._get_bad_steps()
            state["_bad_steps"] = None
        return state


__all__ = ["PADDLE_STATE_KEYS", "TORCH_ALIASES", "GradScaler"]
