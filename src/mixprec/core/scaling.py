"""Loss scaling: the scale-update rule, one scaler class, and the overflow check.

State lives on the device as tensors and is updated with tensor ops, so a step costs no host
sync here; the single `.item()` per step belongs to whoever decides to skip (see optim.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from mixprec.core.policy import ScalerConfig
from mixprec.core.step_math import inverse_scale

ProcessGroup = Any  # torch.distributed.ProcessGroup; Any keeps import-time cost nil


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    cfg: ScalerConfig,
) -> None:
    """Advance a dynamic scale by one step, in place, without leaving the device.

    Megatron's rule: an overflow zeroes the growth count and spends one unit of hysteresis;
    once it is spent, every overflow multiplies the scale by backoff_factor (floor min_scale).
    `growth_interval` clean steps in a row multiply it by growth_factor (ceiling max_scale) and
    refill the hysteresis; with `consecutive_hysteresis` every clean step refills it.
    """
    overflow = found_inf > 0
    # Clamped at 0: once spent it stays spent (Megatron lets it run negative; same decisions).
    hyst_left = torch.where(overflow, (hysteresis_tracker - 1).clamp(min=0), hysteresis_tracker)
    backoff = overflow & (hyst_left <= 0)
    # masked_fill_ on fresh temporaries: torch.where's values against a zeros/full tensor in
    # 2 ops, not 3 (each op is ~2 us of dispatch on CPU: most of a small step's scale update)
    clean_count = (growth_tracker + 1).masked_fill_(overflow, 0)
    grow = clean_count >= cfg.growth_interval  # implies a clean step: overflow zeroed it
    backed = torch.clamp(scale * cfg.backoff_factor, min=cfg.min_scale)
    grown = torch.clamp(scale * cfg.growth_factor, max=cfg.max_scale)
    grown = torch.where(torch.isfinite(grown), grown, scale)  # fp32 overflow: keep the scale
    scale.copy_(torch.where(backoff, backed, torch.where(grow, grown, scale)))
    growth_tracker.copy_(clean_count.masked_fill_(grow, 0))
    refill = grow | ~overflow if cfg.consecutive_hysteresis else grow
    hysteresis_tracker.copy_(hyst_left.masked_fill_(refill, cfg.hysteresis))


def default_group() -> ProcessGroup | None:
    """The world group when torch.distributed is up, else None (no reduction needed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def group_to_hold(group: ProcessGroup | None) -> ProcessGroup | None:
    """What an object keeps of a process group: None for the default group (looked up again at
    each use, as default_group()), the group itself otherwise.

    An optimizer holding the world group past destroy_process_group() kept its gloo threads
    alive to interpreter exit, whose teardown then aborted the process (SIGABRT in ~1 run of
    14 of a 2-rank ZeRO script; 0 of 48 once the group was not held).
    """
    return None if group is default_group() else group


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) in the default group; (0, 1) when torch.distributed is not up."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_found_inf_(found_inf: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """MAX-reduce an overflow flag so every rank of `group` takes the same skip decision."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf


def group_by_device_and_dtype(
    tensors: Iterable[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """Bucket tensors so each foreach kernel sees one device and one dtype."""
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.device, t.dtype), []).append(t)
    return buckets


def unscale_and_check_(
    grads: Iterable[torch.Tensor],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    one_bucket: bool = False,
) -> torch.Tensor:
    """grads *= inv_scale in place and set found_inf to 1 if any entry is inf/nan (one pass).

    one_bucket: the caller knows every grad has one dtype and found_inf's device (a cached
    fact): one kernel call, without bucketing them again every step.
    """
    if one_bucket:
        torch._amp_foreach_non_finite_check_and_unscale_(list(grads), found_inf, inv_scale)
        return found_inf
    for (device, _), bucket in group_by_device_and_dtype(grads).items():
        flag = found_inf if found_inf.device == device else torch.zeros(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(bucket, flag, inv_scale.to(device))
        if flag is not found_inf:
            found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device)))
    return found_inf


@runtime_checkable
class ScaleRule(Protocol):
    """A loss scaler as a step that never calls its scale()/update() drives it (compile_step):
    its state, read on the host once per step, and its rule, run on the device after the step.
    LossScaler and mixprec.GradScaler (Paddle's included) implement it; each keeps one rule."""

    def active_scale(self) -> torch.Tensor | None:
        """Host side, once before each step (where an eager loop calls scale()): the live
        device tensor the step multiplies its loss by, or None while this scaler is off (the
        step then runs unscaled, still skipping inf/nan, and advance_ is not called)."""
        ...

    def advance_(self, found_inf: torch.Tensor) -> None:
        """Device side, after a step that ran under active_scale(): move the state by this
        scaler's rule, in place, no host sync. found_inf is already reduced over the ranks."""
        ...


class LossScaler:
    """Static or dynamic loss scale whose state (scale, trackers) is a set of device tensors.

    `found_inf` for `update` must already be reduced over the ranks that share the step.
    """

    def __init__(self, cfg: ScalerConfig | None = None, device: torch.device | str = "cpu"):
        if cfg is not None and not isinstance(cfg, ScalerConfig):
            raise TypeError(
                f"LossScaler cfg={cfg!r} must be a mixprec.ScalerConfig or None, "
                f"got a {type(cfg).__name__}."
            )
        self.cfg = cfg or ScalerConfig()
        device = torch.device(device)
        self._scale = torch.full(
            (1,), float(self.cfg.init_scale), dtype=torch.float32, device=device
        )
        self._growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)
        self._hysteresis_tracker = torch.full(
            (1,), self.cfg.hysteresis, dtype=torch.int32, device=device
        )
        self._unit_scale, self._unit_version = self._scale, self._scale._version  # see is_unit
        self._inv: torch.Tensor | None = None  # inv_scale's cache, of this tensor at this version
        self._inv_of: torch.Tensor | None = None
        self._inv_version = -1
        self._host: tuple | None = None  # see host_state

    @property
    def dynamic(self) -> bool:
        return self.cfg.dynamic

    @property
    def is_unit(self) -> bool:
        """True while the scale is known on the host to be a static 1.0 (no sync): the config's
        and never written since (a loaded checkpoint writes it: then False, conservatively)."""
        return (
            not self.cfg.dynamic
            and self.cfg.init_scale == 1.0
            and self._scale is self._unit_scale
            and self._scale._version == self._unit_version
        )

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The scale as a one-element fp32 tensor (no sync to read it)."""
        return self._scale

    @property
    def scale(self) -> float:
        """The scale as a Python float (this is a host sync)."""
        return float(self._scale.item())

    def inv_scale(self) -> torch.Tensor:
        # fp32 reciprocal can be inexact under some compile options: take it in fp64 (as torch does).
        # Cached until the scale tensor is replaced or written in place (its version counter, a
        # host int): a static scale's 3 ops are paid once, not every step.
        scale, version = self._scale, self._scale._version
        if self._inv is None or self._inv_of is not scale or self._inv_version != version:
            self._inv = inverse_scale(scale)
            self._inv_of, self._inv_version = scale, version
        return self._inv

    def host_state(self) -> tuple[float, float] | None:
        """(scale, growth tracker) as the host last read them, while both are the tensors read
        and neither was written since (their version counters, host ints, which every in-place
        write bumps, a compiled step's too); None when a read is due.

        A clean step short of growth_interval only counts (update), which keeps this current:
        the optimizer then reads the overflow flag alone, not the scale and tracker with it.
        """
        known = self._host
        if known is None:
            return None
        scale, growth, scale_tensor, tracker, scale_version, tracker_version = known
        if (
            scale_tensor is not self._scale
            or tracker is not self._growth_tracker
            or scale_tensor._version != scale_version
            or tracker._version != tracker_version
        ):
            return None
        return scale, growth

    def remember_host_state(self, scale: float, growth: float) -> None:
        """Keep the scale and growth tracker just read on the host (see host_state)."""
        s, g = self._scale, self._growth_tracker
        self._host = (scale, growth, s, g, s._version, g._version)

    def to(self, device: torch.device | str) -> LossScaler:
        self._scale = self._scale.to(device)
        self._growth_tracker = self._growth_tracker.to(device)
        self._hysteresis_tracker = self._hysteresis_tracker.to(device)
        return self

    @property
    def growth_tracker(self) -> torch.Tensor:
        """Clean steps since the last growth or overflow (one-element int32 tensor)."""
        return self._growth_tracker

    def update(self, found_inf: torch.Tensor, *, clean_growth: float | None = None) -> None:
        """Advance the scale by one step given this step's (reduced) overflow flag.

        clean_growth: only for a step the caller already knows was clean (it read the flag on
        the host), the growth tracker's value read in that same sync. A clean step short of
        growth_interval then only counts (and refills a consecutive hysteresis): 1-2 ops
        instead of update_scale_'s ~20 (~40 us of dispatch on CPU), the same values.
        """
        cfg = self.cfg
        if not cfg.dynamic:
            return
        # < 2**24: the count came through an fp32 tensor exactly
        if clean_growth is not None and clean_growth + 1 < min(cfg.growth_interval, 2**24):
            known = self.host_state()
            self._growth_tracker.add_(1)
            if known is not None:  # the count is known on the host: it stays known
                self.remember_host_state(known[0], clean_growth + 1)
            if cfg.consecutive_hysteresis:
                self._hysteresis_tracker.fill_(cfg.hysteresis)
            return
        update_scale_(
            self._scale,
            self._growth_tracker,
            self._hysteresis_tracker,
            found_inf.to(self._scale.device),
            self.cfg,
        )

    def active_scale(self) -> torch.Tensor:
        """ScaleRule: a LossScaler is never off (a static one scales by its fixed value)."""
        return self._scale

    def advance_(self, found_inf: torch.Tensor) -> None:
        """ScaleRule: update() (a static scale stays)."""
        self.update(found_inf)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale.clone(),
            "growth_tracker": self._growth_tracker.clone(),
            "hysteresis_tracker": self._hysteresis_tracker.clone(),
            "dynamic": self.cfg.dynamic,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"scale", "growth_tracker", "hysteresis_tracker"} - set(state)
        if missing:
            raise KeyError(f"Loss-scaler state lacks {sorted(missing)}; got keys {sorted(state)}.")
        self._scale.copy_(torch.as_tensor(state["scale"], dtype=torch.float32).reshape(1))
        self._growth_tracker.copy_(torch.as_tensor(state["growth_tracker"]).reshape(1))
        self._hysteresis_tracker.copy_(torch.as_tensor(state["hysteresis_tracker"]).reshape(1))
