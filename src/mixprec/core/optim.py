"""The one optimizer wrapper every mode uses: loss scaling, fp32 master weights, skip on overflow.

Low-precision params get fp32 master copies that replace them in the wrapped optimizer's
param_groups (so LR schedulers and the optimizer's own state see fp32 tensors); fp32 params
are their own masters. A step whose gradients hold inf/nan on any rank of the process group
is skipped on every rank: params, masters and optimizer state are left bit for bit unchanged.
"""

from __future__ import annotations

import itertools
import logging
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.core import fused_step as fused
from mixprec.core import lean as lean_step
from mixprec.core import sync_free
from mixprec.core.clip import clip_grads_, local_shards
from mixprec.core.optim_state import place_masters, saved_masters, upgrade_optimizer_checkpoint
from mixprec.core.policy import UNIT_SCALE, ScalerConfig
from mixprec.core.scaling import (
    LossScaler,
    ProcessGroup,
    all_reduce_found_inf_,
    default_group,
    group_to_hold,
    rank_and_world,
    unscale_and_check_,
)
from mixprec.core.skip_monitor import SkipMonitor, SkipStats, scale_text
from mixprec.core.step_math import clip_coefficient
from mixprec.core.step_record import StepRecord
from mixprec.core.validate import check_bool, check_int, check_max_norm, check_norm_type

log = logging.getLogger("mixprec")
LOW_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class StepResult:
    """What one `step()` did."""

    skipped: bool
    """True when a non-finite gradient on some rank made every rank skip the update."""
    scale: float
    """The loss scale this step's gradients were computed with."""
    grad_norm: float | None
    """Total norm of the unscaled gradients, when clipping computed it."""
    num_zeros: int | None
    """Zero gradient entries, when log_num_zeros_in_grad is on."""
    noop: bool = False
    """True when this rank's optimizer had no gradient at all: nothing moved, and the step is
    counted in noop_steps, not in steps."""


@dataclass(frozen=True)
class Layout:
    """What an optimizer's held params are, read once per param_groups layout."""

    probe: torch.Tensor | None
    """The first held param: its .device (which follows .to()) says where the step runs."""
    numel: int
    """Elements of every held param: a bound on a step's gradients."""
    uniform: bool
    """Every held param on the probe's device with the probe's dtype (grads alike)."""
    sharded: bool
    """Some held param is a DTensor: its grad is checked through its local shard."""

    @staticmethod
    def of(params: list[torch.Tensor]) -> Layout:
        probe = params[0] if params else None
        return Layout(
            probe=probe,
            numel=sum(p.numel() for p in params),
            uniform=probe is not None
            and all(p.device == probe.device and p.dtype == probe.dtype for p in params),
            sharded=any(hasattr(p, "to_local") for p in params),
        )


@dataclass(frozen=True)
class _Carry:
    """The gradients a step leaves in .grad, for a backward that comes before zero_grad().

    torch's contract (DDP's, Colossal's): a step leaves its gradients in .grad, so backward +
    step twice with no zero_grad() steps on g1 + g2 the second time. The model's lp grads stay
    as backward left them (scaled, in lp), own params' grads as the step used them (unscaled,
    clipped, in fp32, or as read by the fused step); before the next backward adds to them, each
    is multiplied by its factor and by that backward's scale, so the next unscale gives g1 + g2
    (exact for power-of-two scales; the lp sum rounds as micro-batch accumulation does).
    model.zero_grad() or the optimizer's drops them as in torch; a grad set by hand in their
    place is taken as it is (each kept grad is known by a weak reference).
    """

    lp_grads: list[weakref.ref[torch.Tensor]]
    """The lp grads kept."""
    own_grads: list[weakref.ref[torch.Tensor]]
    """The own params' grads kept."""
    lp_factor: torch.Tensor | None
    """What unscales the kept lp grads (the inverse scale they carry, times a fused clip; None:
    they are unscaled already)."""
    own_factor: torch.Tensor | None
    """The same for own params' grads (None: unscaled and clipped in place already)."""


def _route_zero_grad(inner: torch.optim.Optimizer, wrapper: MixedPrecisionOptimizer) -> None:
    """The inner optimizer's zero_grad() becomes the wrapper's: Lightning, Fabric and a user who
    kept the torch optimizer call it, and it cleared only the masters' grads, so the model's lp
    grads a step leaves in .grad (see _Carry) added into every later step (a skipped step's inf
    grads too). The wrapper's zero_grad clears the inner groups itself (no recursion); a weak
    reference, so the inner optimizer keeps no dropped wrapper alive."""
    owner = weakref.ref(wrapper)
    own = inner.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        target = owner()
        if target is None:
            return own(set_to_none)
        return target.zero_grad(set_to_none)

    inner.zero_grad = zero_grad  # type: ignore[method-assign]


class _PendingStepResult(StepResult):
    """A sync-free step's result: its fields read the step's record row when first read (a
    host sync, paid only by a caller who reads them)."""

    def __init__(self, row: torch.Tensor, has_norm: bool) -> None:
        object.__setattr__(self, "_row", row)
        object.__setattr__(self, "_has_norm", has_norm)
        object.__setattr__(self, "_values", None)

    def _read(self) -> tuple[bool, float, float | None]:
        if self._values is None:
            flag, scale, norm = self._row.reshape(-1).tolist()  # a host sync, when read
            object.__setattr__(self, "_values", (flag > 0, scale, norm if self._has_norm else None))
        return self._values

    skipped = property(lambda self: self._read()[0])  # type: ignore[assignment]
    scale = property(lambda self: self._read()[1])  # type: ignore[assignment]
    grad_norm = property(lambda self: self._read()[2])  # type: ignore[assignment]
    num_zeros = None
    noop = False


class ScaleCollapseError(RuntimeError):
    """Too many consecutive steps were skipped: the run cannot make progress."""


def _is_rank_zero() -> bool:
    return rank_and_world()[0] == 0


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """Wraps any torch optimizer; `backward(loss)` scales, `step()` unscales, checks and steps.

    Args:
        optimizer: the optimizer over the model's (possibly fp16/bf16) parameters.
        loss_scale: scaler settings; UNIT_SCALE scales nothing but still skips non-finite steps.
        master_weights: keep fp32 masters for low-precision params (default: whenever there are any).
        max_norm: clip the unscaled gradients to this total norm in every step (0: off).
        process_group: ranks that must agree on overflow (default: the world when initialised).
        log_num_zeros_in_grad: count zero gradient entries each step (one more host sync).
        max_consecutive_skips: raise ScaleCollapseError after this many skipped steps in a row
            (None: never). From fp16_naive's 2**32 about 34 skips reach a scale of 1; far more
            means the run overflows at any scale and will never train.
        keep_master_grads: keep the fp32 master gradients allocated between steps (None: only
            on CPU). Freeing them lowers peak memory by 4 bytes per low-precision param (the
            backward peak then holds lp grads, not fp32 ones); on CUDA the caching allocator
            hands the memory back for free, on CPU each re-allocation page-faults anew.
        fused_step: run the step as one compiled pass per tensor straight from the lp grads
            (mixprec.core.fused_step: SGD, Adam, AdamW; no fp32 master grads at all). None: on CPU
            steps of at least fused_step.AUTO_MIN_ELEMENTS elements. A step whose grads were
            already unscaled (clip_grad_norm(), an outside GradScaler) runs unfused.
        lean: step through mixprec.core.lean's write-back instead of the inner optimizer's step():
            low-bit optimizer state and/or stochastic rounding into bf16 params (None: off).
    """

    # Why mixprec.compile_step must not run this optimizer's step (None: it may). A subclass
    # whose step() does collective work the compiled step does not know sets its reason.
    whole_step_refusal: str | None = None
    # torch's GradScaler.step then sets found_inf (its check, done once) and grad_scale (the
    # scale still in the grads, or None once unscale_ ran) on this object and calls step()
    # unconditionally, with no host sync of its own; see _reuse_outside_check.
    _step_supports_amp_scaling = True
    # How a user of this class runs the scaled backward (named when grads did not come through it).
    scaled_backward_hint = (
        "booster.backward(loss, optimizer) (Booster), optimizer.backward(loss) "
        "(convert_to_amp, initialize) or engine.backward(loss)"
    )

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        loss_scale: ScalerConfig = UNIT_SCALE,
        master_weights: bool | None = None,
        max_norm: float = 0.0,
        process_group: ProcessGroup | None = None,
        log_num_zeros_in_grad: bool = False,
        max_consecutive_skips: int | None = 100,
        keep_master_grads: bool | None = None,
        fused_step: bool | None = None,
        lean: lean_step.LeanConfig | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)!r}.")
        if isinstance(optimizer, MixedPrecisionOptimizer):
            raise TypeError(
                "This optimizer is already wrapped by mixprec; wrap the inner one once."
            )
        check_max_norm("max_norm", max_norm)
        check_int("max_consecutive_skips", max_consecutive_skips, optional=True)
        check_bool("log_num_zeros_in_grad", log_num_zeros_in_grad)
        for name, flag in (
            ("master_weights", master_weights),
            ("keep_master_grads", keep_master_grads),
            ("fused_step", fused_step),
        ):
            check_bool(name, flag, optional=True)  # None: decided per device / per step
        if not isinstance(loss_scale, ScalerConfig):
            raise TypeError(f"loss_scale={loss_scale!r} must be a mixprec.ScalerConfig.")
        if max_consecutive_skips is not None and max_consecutive_skips < 1:
            raise ValueError(
                f"max_consecutive_skips={max_consecutive_skips!r} must be >= 1 or None."
            )
        reason = fused.unsupported_reason(optimizer)
        if fused_step and reason:
            raise ValueError(f"fused_step=True cannot run this optimizer: {reason}.")
        self.optim = optimizer
        _route_zero_grad(optimizer, self)
        self.fused_step = fused_step
        self.master_weights = master_weights
        self.max_norm = float(max_norm)
        self.process_group = group_to_hold(process_group)
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        self.max_consecutive_skips = max_consecutive_skips
        self.keep_master_grads = keep_master_grads
        self.param_names: dict[int, str] = {}  # id(param as the optimizer holds it) -> name
        self.verbosity = 1
        """0: silent; 1: log skipped steps; 2: also log every loss-scale change (a host sync)."""
        # (lp param, fp32 master) pairs; the master sits in param_groups where lp was.
        self.lp_params: list[torch.Tensor] = []
        self.hp_masters: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            group["params"] = self._masters_for(group["params"])
            self._check_eps(group)
        self._layout_key: tuple[tuple[int, int], ...] | None = None  # see _layout
        self._layout_value = Layout.of([])
        device = self._device()
        self.scaler = LossScaler(loss_scale, device)
        self._found_inf: torch.Tensor | None = None  # set once grads are unscaled this step
        self._grads_on_masters = False  # set once this step's lp grads reached the masters
        self._carry: _Carry | None = None  # the last step's gradients, left in .grad: see _Carry
        self._unscaled_version = -1  # a master grad's version once unscaled: see _keep_grads
        self._inv_used: torch.Tensor | None = None  # the inverse scale the last unscale used
        self._backward_scaled = False  # set by backward()/scale_loss(), cleared by the step
        self._step_had_grads = True  # cleared when this step's unscale found no gradient
        # (a grad, its version) as backward() left it: see _warn_if_grads_changed_while_scaled
        self._grad_seen: tuple[torch.Tensor, int] | None = None
        self._warned_scaled_edit = False
        # The sync-free step's device record (see _step_sync_free), read into the counters below
        # every DEFAULT_CHECK_EVERY steps or when they are read; made at its first step.
        self._sync_free: bool | None = None
        """Private switch: None runs the step with no host sync where it costs one (CUDA; see
        _runs_sync_free); True forces it (tests on CPU); False keeps the one read of the
        overflow flag per step."""
        self._record: StepRecord | None = None
        self._skipped_steps = 0
        self.steps = 0
        self.noop_steps = 0
        """step() calls that found no gradient (not counted in steps)."""
        self._consecutive_skips = 0
        self._last_result: StepResult | None = None
        self._warned_no_grads = False
        self._clean_growth: float | None = None  # see _decide
        self.lean = None if lean is None else lean_step.LeanUpdate(lean, optimizer)
        self.skip_monitor = SkipMonitor()  # says when a run starts by skipping, or skips too often
        # torch.optim.Optimizer's bookkeeping, for hooks and LR schedulers.
        self._optimizer_step_pre_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_state_dict_post_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: dict[int, Any] = OrderedDict()

    # ----- torch.optim.Optimizer's face, delegated to the wrapped optimizer -----
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optim.defaults

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"MixedPrecisionOptimizer({self.optim!r}, scaler={self.scaler.cfg})"

    def _device(self) -> torch.device:
        """Where the held params live: the first one's device (cached with the layout)."""
        probe = self._layout().probe
        return probe.device if probe is not None else torch.device("cpu")

    def _check_eps(self, group: dict[str, Any]) -> None:
        """Adam-style eps below fp16's smallest normal is 0 in fp16 state: updates divide by 0."""
        eps = group.get("eps")
        tiny = torch.finfo(torch.float16).tiny
        fp16_held = any(p.dtype == torch.float16 for p in group["params"])
        if fp16_held and isinstance(eps, float) and eps < tiny:
            raise ValueError(
                f"eps={eps!r} with float16 parameters stepped directly (no fp32 master "
                f"weights): it rounds to 0 in fp16 (smallest normal {tiny:.2e}), so the "
                "update divides by zero and writes inf/nan into the weights. Use master "
                "weights (fp16_naive, Apex O2), bfloat16, or eps >= 1e-4."
            )

    def _masters_for(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        use_masters = self.master_weights is not False
        out = []
        for p in params:
            if use_masters and p.dtype in LOW_DTYPES:
                master = p.detach().clone().float()
                master.requires_grad_(True)
                if p in self.optim.state:  # keep any state the optimizer already had
                    self.optim.state[master] = self.optim.state.pop(p)
                self.lp_params.append(p)
                self.hp_masters.append(master)
                out.append(master)
            else:
                out.append(p)
        return out

    def name_params(self, model: torch.nn.Module) -> None:
        """Learn the model's parameter names, so errors can say which parameters overflowed."""
        lp_to_master = {id(lp): hp for lp, hp in zip(self.lp_params, self.hp_masters, strict=True)}
        for name, p in model.named_parameters():
            held = lp_to_master.get(id(p), p)
            self.param_names[id(held)] = name

    def nonfinite_params(self) -> list[str]:
        """Names (or group/index) of the parameters whose current gradient holds inf/nan."""
        bad = []
        master_to_lp = self._master_to_lp()
        for g, group in enumerate(self.optim.param_groups):
            for i, p in enumerate(group["params"]):
                lp = master_to_lp.get(id(p))
                # A fused step reads the lp grad directly: the master then has none.
                grad = lp.grad if p.grad is None and lp is not None else p.grad
                if grad is not None and not bool(torch.isfinite(grad).all()):
                    bad.append(
                        self.param_names.get(id(p), f"param_groups[{g}][{i}] {tuple(p.shape)}")
                    )
        return bad

    def _master_to_lp(self) -> dict[int, torch.Tensor]:
        return {id(hp): lp for lp, hp in zip(self.lp_params, self.hp_masters, strict=True)}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group["params"] = self._masters_for(params)
        self.optim.add_param_group(group)
        self._check_eps(self.optim.param_groups[-1])

    # ----- counters: host values, or read from the sync-free step's device record -----
    @property
    def skipped_steps(self) -> int:
        self._read_record()
        return self._skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._read_record()
        self._skipped_steps = value

    @property
    def consecutive_skips(self) -> int:
        self._read_record()
        return self._consecutive_skips

    @consecutive_skips.setter
    def consecutive_skips(self, value: int) -> None:
        self._read_record()
        self._consecutive_skips = value

    @property
    def last_result(self) -> StepResult | None:
        self._read_record()
        return self._last_result

    @last_result.setter
    def last_result(self, value: StepResult | None) -> None:
        self._read_record()
        self._last_result = value

    # ----- scaling, unscaling, checking -----
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def skip_stats(self) -> SkipStats:
        """Steps, skipped steps (in a row, in the warm-up) and the last scale: no host sync."""
        last = self.last_result
        return SkipStats(
            steps=self.steps,
            noop_steps=self.noop_steps,
            skipped_steps=self.skipped_steps,
            consecutive_skips=self.consecutive_skips,
            warmup_skips=self.skip_monitor.warmup_skips,
            last_scale=None if last is None else last.scale,
        )

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss (as fp32) times the current scale; call .backward() on the result."""
        self._backward_scaled = True
        self._rescale_carried()
        return loss.float() * self.scaler.scale_tensor

    def note_scaled_backward(self) -> None:
        """Say that this step's grads come from a loss scaled by this optimizer's scale that a
        face multiplied itself (Lightning's backward runs before the optimizer is wrapped)."""
        self._backward_scaled = True

    @property
    def scales_loss(self) -> bool:
        """True when this optimizer's backward multiplies the loss by a scale other than 1 (read
        from the config: a host fact, no sync)."""
        cfg = self.scaler.cfg
        return cfg.dynamic or cfg.init_scale != 1.0

    def _grads_came_through_backward(self) -> bool:
        """Whether this step's grads were produced by this optimizer's scaled backward."""
        return self._backward_scaled

    def _check_scaled_backward(self) -> None:
        """Refuse grads that did not come through the scaled backward (plain loss.backward(), or
        an outside GradScaler's scaler.scale(loss).backward()): unscaling them by this optimizer's
        scale would shrink the update by that scale, silently.

        One flag read on the hot path; the walk over grads runs only when the flag is unset.
        """
        if (
            self._grads_came_through_backward()
            or not self.scales_loss
            or not (self._grads_on_masters or self._step_grads())  # masters' grads may be stale
        ):
            return
        raise RuntimeError(
            f"{type(self).__name__}.step(): the gradients did not come through this "
            "optimizer's scaled backward (a plain loss.backward(), or an outside GradScaler's "
            "scaler.scale(loss).backward()), but this mode scales the loss itself "
            f"({'dynamic' if self.scaler.cfg.dynamic else 'static'} loss scale, starting at "
            f"{self.scaler.cfg.init_scale:g}). Unscaling them would make the update that many "
            f"times too small. Call {self.scaled_backward_hint} instead of loss.backward(), and "
            "use no outside GradScaler with it (this optimizer is the loss scaler). Plain "
            "loss.backward() is fine in modes without loss scaling (bf16, fp32)."
        )

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of the scaled loss; several calls before one step() accumulate."""
        if self._found_inf is not None:
            raise RuntimeError(
                "backward() after the gradients were unscaled (by clip_grad_norm or "
                "unscale_grads) but before step(): the new gradients would stay scaled."
            )
        # x 1.0 is exact: skip its op and its backward node (bitwise); a `gradient=` keeps the
        # scaled loss's shape (1,) it was given for
        if self.scaler.is_unit and "gradient" not in kwargs:
            self._backward_scaled = True
            self._rescale_carried()
            loss.float().backward(**kwargs)
        else:
            self.scale_loss(loss).backward(**kwargs)
            if not self._warned_scaled_edit:
                self._grad_seen = self._probe_grad_version()

    def _probe_grad_version(self) -> tuple[torch.Tensor, int] | None:
        """One model gradient and its version counter (host ints: no sync, ~2 attribute reads)."""
        probe = self.lp_params[0] if self.lp_params else self._layout().probe
        grad = None if probe is None else probe.grad
        return None if grad is None else (grad, grad._version)

    def _warn_if_grads_changed_while_scaled(self) -> None:
        """torch.nn.utils.clip_grad_norm_ between backward() and step() clips the *scaled*
        grads (the update then comes out ~scale times too small): say so once, at WARNING.
        Seen as an in-place write to a model grad after the last scaled backward."""
        seen, self._grad_seen = self._grad_seen, None
        if seen is None or self._found_inf is not None:
            return  # unscaled by this optimizer (its own clip): what comes after is unscaled
        now = self._probe_grad_version()
        if now is None or now[0] is not seen[0] or now[1] == seen[1]:
            return
        self._warned_scaled_edit = True
        if _is_rank_zero():
            log.warning(
                "mixprec: the gradients were changed in place between backward() and step() "
                "while they were still multiplied by the loss scale (%s). If that was "
                "torch.nn.utils.clip_grad_norm_, it clipped the scaled gradients and the update "
                "comes out about that many times too small: clip with optimizer.clip_grad_norm"
                "(max_norm) (it unscales first), or set the clipping in the mode/plugin "
                "(max_norm), instead. (Warned once.)",
                scale_text(self.scaler.scale),
            )

    def _hp_grads(self) -> list[torch.Tensor]:
        """Gradients of everything the wrapped optimizer steps (fp32 masters and fp32 params).

        Sharded (DTensor) grads are checked through their local shard: the same storage, and
        the overflow flag is reduced over the group afterwards, so the check stays exact.
        """
        grads = [p.grad for g in self.optim.param_groups for p in g["params"] if p.grad is not None]
        return self._local(grads)

    def _local(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """local_shards(tensors) of held params (or their masters, lp params, grads, which shard
        alike), skipping the walk when no held param is sharded (the cached layout says so)."""
        return local_shards(tensors) if self._layout().sharded else tensors

    def _lp_grads_to_masters(self) -> None:
        """The transfer at step: each lp grad, as backward left it, into its master's fp32 grad.

        The lp grad stays in .grad after the step (torch's contract: see _Carry); an optimizer
        that does not carry gradients (carries_grads False) frees it here, as before."""
        lp_grads, hp_grads = [], []
        for lp, hp in zip(self.lp_params, self.hp_masters, strict=True):
            if lp.grad is None:
                hp.grad = None  # this param took no part: no stale gradient may be applied
                continue
            if hp.grad is None:
                hp.grad = torch.empty_like(hp)
            lp_grads.append(lp.grad)
            hp_grads.append(hp.grad)
            if not self.carries_grads:
                lp.grad = None  # the lp gradient lives only from backward to step
        if hp_grads:
            torch._foreach_copy_(self._local(hp_grads), self._local(lp_grads))

    def grads_to_masters(self) -> None:
        """Hand this step's lp grads to the fp32 masters, once (an outside GradScaler calls this
        before unscaling, since it only sees the masters in param_groups)."""
        if not self._grads_on_masters:
            self._lp_grads_to_masters()
            self._grads_on_masters = True

    def unscale_grads(self) -> torch.Tensor:
        """The step's first stages, once per step: transfer the grads to the masters (and reduce
        them: the pipeline's dp average, ZeRO's buckets), unscale and check them.

        Returns the overflow flag (a device tensor, reduced over the process group).
        """
        if self._found_inf is not None:
            return self._found_inf
        self._check_scaled_backward()
        self._rescale_carried()  # a second step() with no backward through this optimizer
        self.grads_to_masters()  # transfer + reduce (subclasses reduce here)
        found_inf = self._unscale_and_check()
        self._found_inf = all_reduce_found_inf_(found_inf, self.process_group or default_group())
        self._unscaled_version = self._held_grad_version()
        return self._found_inf

    def _unscale_and_check(self) -> torch.Tensor:
        """Unscale the held grads in place and check them: this rank's overflow flag."""
        found_inf = self.scaler.scale_tensor.new_zeros(1)  # fp32, on the scale's device
        self._inv_used = self.scaler.inv_scale()  # a new tensor once the scale moves: kept
        grads = self._hp_grads()
        self._step_had_grads = bool(grads) or self._shares_steps()
        if grads:
            layout = self._layout()
            one_bucket = layout.uniform and layout.probe.device == found_inf.device
            unscale_and_check_(grads, self._inv_used, found_inf, one_bucket=one_bucket)
        return found_inf

    def _held_grad_version(self) -> int:
        """The version counter of the first held grad (a host int: no sync), -1 without one.
        An in-place write (a clip) after the unscale bumps it: see _keep_grads."""
        for hp in self.hp_masters:
            if hp.grad is not None:
                return hp.grad._version
        return -1

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the unscaled gradients to max_norm; returns their total norm before clipping."""
        check_max_norm("max_norm", max_norm)
        norm_type = check_norm_type("norm_type", norm_type)
        self.unscale_grads()
        grads = [p.grad for g in self.optim.param_groups for p in g["params"] if p.grad is not None]
        # Replicas hold equal grads (no group); DTensor grads complete their norm over their mesh.
        return clip_grads_(grads, max_norm, norm_type, device=self.scaler.scale_tensor.device)

    def _count_zeros(self) -> int:
        grads = self._hp_grads()
        return int(sum(int((g == 0).sum()) for g in grads))  # host sync per tensor: debug counter

    # ----- the step: one fixed sequence, configured by the stages below -----
    @torch.no_grad()
    def step(self, closure: Any = None) -> StepResult:  # type: ignore[override]
        """transfer -> reduce -> unscale+check -> clip -> decide -> update -> commit.

        Every subclass runs this sequence; it configures the stages, never re-sequences them:
        - transfer + reduce: grads_to_masters (_lp_grads_to_masters: at step here; as each
          backward accumulates for Paddle's and the pipeline's hooks; ZeRO's reduce buckets);
        - unscale+check: _unscale_and_check (Apex's per-backward stash: done at each backward);
        - clip: clip_grad_norm (each parallelism's norm), when max_norm > 0;
        - decide: _decide on _scale_used() (the scale the grads carry), then _update_scale;
        - update + commit: _commit (the inner step or the fused pass, masters back to the
          params, the counters), _after_update (ZeRO's all-gather); _end_step always.
        The fused step runs the same stages in one pass per tensor.
        """
        if closure is not None:
            raise RuntimeError(
                f"Closures are not supported with loss scaling ({type(self).__name__}.step)."
            )
        try:
            result = self._run_step()
            self._after_update(result)
            return result
        finally:
            self._end_step()

    def _run_step(self) -> StepResult:
        self._rescale_carried()  # a step() again with no backward through this optimizer
        self._reuse_outside_check()
        self._warn_once_if_no_grads()
        if self._grad_seen is not None:
            self._warn_if_grads_changed_while_scaled()
        fused_grads = self._grads_if_fused()
        if fused_grads is not None:
            self._check_scaled_backward()  # unscale_grads' first check, on the fused path
            return self._fused_step(fused_grads)
        found_inf = self.unscale_grads()  # checks, transfer -> reduce -> unscale+check
        norm = self.clip_grad_norm(self.max_norm) if self.max_norm > 0 else None
        sync_free_inner = self._runs_sync_free()
        if sync_free_inner is not None:
            return self._step_sync_free(found_inf, norm, sync_free_inner)
        grad_norm = None if norm is None else float(norm)
        num_zeros = self._count_zeros() if self.log_num_zeros_in_grad else None
        skipped, scale = self._decide(found_inf, self._scale_used())
        self._update_scale(found_inf)
        self._keep_grads()
        return self._commit(skipped, scale, grad_norm=grad_norm, num_zeros=num_zeros)

    # Stages a subclass configures (the defaults are the core's own).
    def _scale_used(self) -> torch.Tensor | None:
        """The scale this step's grads were computed with, when not this optimizer's own scaler's
        (Apex's per-loss scalers); None: the own scaler's, read with the overflow flag."""
        return None

    def _update_scale(self, found_inf: torch.Tensor) -> None:
        """Advance the own scaler by this step's overflow flag (Apex's amp advances each loss's
        scaler at its backward instead)."""
        self.scaler.update(found_inf, clean_growth=self._clean_growth)

    def _after_update(self, result: StepResult) -> None:
        """After the commit (ZeRO gathers the owners' updated params here)."""

    def _end_step(self) -> None:
        """Per-step state a subclass keeps is reset here, whatever the step did or raised."""

    # ----- gradients left in .grad after a step (torch's contract) -----
    carries_grads = True
    """False where the subclass keeps torch's contract its own way (ZeRO, across ranks) or
    follows its peer's rule instead (Apex clears the master grads after every step; the
    pipeline's schedule zeroes each step)."""

    def _own_params(self) -> list[torch.Tensor]:
        """Params the inner optimizer steps directly (fp32, or low precision without masters)."""
        master_ids = {id(m) for m in self.hp_masters}
        return [p for g in self.optim.param_groups for p in g["params"] if id(p) not in master_ids]

    def _keep_grads(self, *, fused: bool = False, factor: torch.Tensor | None = None) -> None:
        """Leave this step's gradients where a backward before zero_grad() adds to them (see
        _Carry). fused: the lp and own grads were read, not unscaled: factor (None: 1) unscales
        and clips them. Unfused, the lp grads are kept as backward left them, unless the
        masters' grads were written after the unscale (a clip): then the lp grads take the
        masters' values (times the next scale: fp16 keeps its range), one pass."""
        if not self.carries_grads:
            return
        unit = self.scaler.is_unit
        if fused:
            lp_factor, own_factor = factor, factor
        elif self._held_grad_version() == self._unscaled_version:
            lp_factor, own_factor = None if unit else self._inv_used, None
        else:
            pairs = [
                (lp.grad, hp.grad)
                for lp, hp in zip(self.lp_params, self.hp_masters, strict=True)
                if lp.grad is not None and hp.grad is not None
            ]
            if pairs:
                lp_grads = self._local([lp for lp, _ in pairs])
                hp_grads = self._local([hp for _, hp in pairs])
                if not unit:
                    hp_grads = torch._foreach_mul(hp_grads, self.scaler.scale_tensor.reshape(()))
                torch._foreach_copy_(lp_grads, hp_grads)
            lp_factor, own_factor = None if unit else self.scaler.inv_scale(), None
        if unit and lp_factor is None and own_factor is None:
            return  # kept as they are: nothing to bring to any scale
        self._carry = _Carry(
            lp_grads=[weakref.ref(lp.grad) for lp in self.lp_params if lp.grad is not None],
            own_grads=[weakref.ref(p.grad) for p in self._own_params() if p.grad is not None],
            lp_factor=lp_factor,
            own_factor=own_factor,
        )
        if unit:  # no scaled backward need come first (plain loss.backward()): apply it now
            self._rescale_carried()

    def _rescale_carried(self) -> None:
        """Bring the gradients the last step left to the current loss scale, before a backward
        adds to them or a step reads them (device ops, no sync), once."""
        carry, self._carry = self._carry, None
        if carry is None:
            return
        scale = None if self.scaler.is_unit else self.scaler.scale_tensor.reshape(())
        for kept, params, factor in (
            (carry.lp_grads, self.lp_params, carry.lp_factor),
            (carry.own_grads, self._own_params(), carry.own_factor),
        ):
            if factor is None and scale is None:
                continue
            held = {id(p.grad) for p in params if p.grad is not None}
            grads = [g for ref in kept if (g := ref()) is not None and id(g) in held]
            if not grads:
                continue
            if factor is None:
                times = scale
            else:
                factor = factor.reshape(())
                times = factor if scale is None else scale * factor
            torch._foreach_mul_(self._local(grads), times)

    def _reuse_outside_check(self) -> None:
        """An outside GradScaler's overflow flag taken as this step's: one check, one host sync
        (the _decide read) per step, where the scaler's .item() and a second check ran before.

        Only for an optimizer that scales nothing itself (a unit scale); a scaling one keeps its
        own check (its scale is in the grads too)."""
        found_inf = self.__dict__.get("found_inf")  # torch deletes both after step()
        if found_inf is None or self._found_inf is not None or not self.scaler.is_unit:
            return
        self.grads_to_masters()
        grads = self._hp_grads()
        grad_scale = self.__dict__.get("grad_scale")
        if grad_scale is not None and grads:  # checked, not unscaled: unscale without checking
            inv_scale = grad_scale.double().reciprocal().float().to(grads[0].device)
            torch._foreach_mul_(grads, inv_scale)
        flag = found_inf.reshape(1).float().to(self.scaler.scale_tensor.device)
        # mixprec's GradScaler reduced it already; torch's did not (MAX twice changes nothing)
        self._found_inf = all_reduce_found_inf_(flag, self.process_group or default_group())
        self._inv_used = self.scaler.inv_scale()
        self._unscaled_version = -2  # the lp grads hold the outside scale: never kept as they are

    def _shares_steps(self) -> bool:
        """True when other ranks take this step too: a rank without grads then counts it as a
        step like theirs (its counters, and the LR schedule that follows them, stay in step)."""
        group = self.process_group or default_group()
        return group is not None and torch.distributed.get_world_size(group) > 1

    def _warn_once_if_no_grads(self) -> None:
        """torch's optimizers step nothing, silently, when no param has a grad; we say it once.

        Python attribute reads only (no host sync); any() stops at the first grad it finds.
        """
        if self._warned_no_grads:
            return
        held = (p for g in self.optim.param_groups for p in g["params"])
        # Checked until a step has gradients: a misconfigured run shows at its first step, and
        # a healthy one pays this loop once, not every step.
        self._warned_no_grads = True
        if any(p.grad is not None for p in itertools.chain(self.lp_params, held)):
            return
        warnings.warn(
            "MixedPrecisionOptimizer.step(): no parameter has a gradient, so nothing is "
            "updated (torch's optimizers do the same without a word). Call backward(loss) "
            "before step(), and check the parameters passed to the optimizer are the model's.",
            stacklevel=3,
        )

    def _step_grads(self) -> list[torch.Tensor]:
        """This step's grads as backward left them: lp grads, and fp32 params' own."""
        grads = [lp.grad for lp in self.lp_params if lp.grad is not None]
        master_ids = {id(m) for m in self.hp_masters}
        for group in self.optim.param_groups:
            grads += [
                p.grad for p in group["params"] if id(p) not in master_ids and p.grad is not None
            ]
        return grads

    def _grads_if_fused(self) -> list[torch.Tensor] | None:
        """This step's grads when it runs fused (see fused_step in the class docstring), else
        None; the cheap refusals come first, so an unfused step gathers nothing."""
        if self.fused_step is False or self._found_inf is not None or self._grads_on_masters:
            return None
        if self.lean is not None:  # the lean write-back is its own pass
            return None
        if self.fused_step is None:
            layout = self._layout()
            if layout.numel < fused.AUTO_MIN_ELEMENTS or layout.probe.device.type != "cpu":
                return None  # too small to fuse whatever has grads: gather nothing (~8 us a step)
        if self.log_num_zeros_in_grad or fused.unsupported_reason(self.optim):
            return None
        grads = self._step_grads()
        params = [p for g in self.optim.param_groups for p in g["params"]] + self.lp_params
        if any(not t.is_contiguous() or t.layout != torch.strided for t in grads + params):
            return None
        if self.max_norm > 0 and any(hasattr(p, "to_local") for p in params):
            return None  # a sharded norm needs a sum over the shards; the unfused clip has it
        if self.fused_step is None and (
            self._device().type != "cpu" or sum(g.numel() for g in grads) < fused.AUTO_MIN_ELEMENTS
        ):
            return None
        return grads

    def _layout(self) -> Layout:
        """What the held params are, cached per param_groups layout (the groups' lists and
        lengths) and looked at again when a group is added, replaced or resized: the walk
        over every param is not paid per step."""
        groups = self.optim.param_groups
        key = tuple((id(g["params"]), len(g["params"])) for g in groups)
        if self._layout_key != key:
            self._layout_value = Layout.of([p for g in groups for p in g["params"]])
            self._layout_key = key
        return self._layout_value

    def _fused_step(self, grads: list[torch.Tensor]) -> StepResult:
        """Check the lp grads (read only), agree on overflow, then update in one fused pass."""
        inv_scale = self.scaler.inv_scale()
        clipping = self.max_norm > 0
        self._step_had_grads = bool(grads) or self._shares_steps()
        if grads:
            stats = fused.check_grads(grads, inv_scale, norm=clipping)
        else:
            stats = torch.zeros(2, device=inv_scale.device)
        found_inf = stats[:1].clone()
        all_reduce_found_inf_(found_inf, self.process_group or default_group())
        norm = stats[1]
        clip = None
        if clipping:  # torch's clip_grad_norm_ coefficient, applied inside the kernel
            clip = clip_coefficient(self.max_norm, norm)
        scale = self.scaler.scale_tensor.to(found_inf).reshape(1)
        growth = self.scaler.growth_tracker.to(found_inf)  # as in _decide, in the same sync
        values = torch.cat([found_inf, scale, norm.reshape(1), growth]).tolist()
        flag, scale_value, norm_value, growth_value = values
        self.scaler.update(found_inf, clean_growth=None if flag > 0 else growth_value)
        master_to_lp = self._master_to_lp()
        unit = self.scaler.is_unit
        factor = None if unit and clip is None else inv_scale if clip is None else inv_scale * clip
        self._keep_grads(fused=True, factor=factor)

        def apply() -> None:
            fused.fused_step(self.optim, master_to_lp, inv_scale, clip)

        result = self._commit(
            flag > 0,
            scale_value,
            grad_norm=norm_value if clipping else None,
            apply=apply,
        )
        if not self.carries_grads:
            for lp in self.lp_params:
                lp.grad = None  # as in the unfused step: the lp gradient lives to the step
        return result

    def _decide(
        self, found_inf: torch.Tensor, scale: torch.Tensor | None = None
    ) -> tuple[bool, float]:
        """(skip?, the scale this step ran under), read in the one host sync of a step.

        The scale and the growth tracker ride the same sync, or are known on the host already
        (LossScaler.host_state: then the flag is read alone). With the own dynamic scaler the
        tracker is kept (for a clean step) in self._clean_growth for the scaler's update, None
        otherwise.
        """
        scaler = self.scaler
        if scale is not None:  # an outside scale (Apex's per-loss scalers): read with the flag
            self._clean_growth = None
            flag, scale_value = torch.cat([found_inf, scale.to(found_inf)]).tolist()
            return flag > 0, scale_value
        if scaler.is_unit:  # 1.0 on the host: read the flag alone
            self._clean_growth = None
            return found_inf.item() > 0, 1.0
        known = scaler.host_state()
        if known is None:
            scale, growth = scaler.scale_tensor, scaler.growth_tracker
            flag, scale_value, growth_value = torch.cat(
                [found_inf, scale.to(found_inf), growth.to(found_inf)]
            ).tolist()
            scaler.remember_host_state(scale_value, growth_value)
        else:  # both unchanged since the host read them: read the flag alone
            flag = found_inf.item()
            scale_value, growth_value = known
        self._clean_growth = growth_value if scaler.dynamic and not flag > 0 else None
        return flag > 0, scale_value

    def _commit(
        self,
        skipped: bool,
        scale: float,
        *,
        grad_norm: float | None = None,
        num_zeros: int | None = None,
        apply: Any = None,
    ) -> StepResult:
        """Step the inner optimizer unless skipped (`apply`, when given, instead), copy masters
        back, count (the scale is advanced by the caller, which owns the scaler(s)).

        Raises ScaleCollapseError after max_consecutive_skips skipped steps in a row.
        """
        if not skipped and apply is not None:
            apply()
        elif not skipped:
            self.lean.step(self.optim) if self.lean is not None else self.optim.step()
            self._masters_to_params()
        self._finish_step()
        if not self._step_had_grads and not skipped:  # nothing to step: counted apart
            self._step_had_grads = True
            self.noop_steps += 1
            self.last_result = StepResult(
                skipped=False, scale=scale, grad_norm=grad_norm, num_zeros=num_zeros, noop=True
            )
            return self.last_result
        self._step_had_grads = True
        self.steps += 1
        return self._count(
            StepResult(skipped=skipped, scale=scale, grad_norm=grad_norm, num_zeros=num_zeros)
        )

    def _masters_to_params(self) -> None:
        if self.hp_masters:
            torch._foreach_copy_(self._local(self.lp_params), self._local(self.hp_masters))

    def _finish_step(self) -> None:
        """Free the master grads (unless kept) and clear this step's flags."""
        keep = self.keep_master_grads
        if self.hp_masters and not (self._device().type == "cpu" if keep is None else keep):
            for hp in self.hp_masters:
                hp.grad = None
        self._found_inf = None
        self._grads_on_masters = False
        self._backward_scaled = False
        self._grad_seen = None

    def _count(self, result: StepResult) -> StepResult:
        """Count a step (steps itself is counted by the caller), report skips, guard against a
        collapse. Raises ScaleCollapseError after max_consecutive_skips skipped steps in a row."""
        skipped, scale = result.skipped, result.scale
        self._skipped_steps += skipped
        self._consecutive_skips = self._consecutive_skips + 1 if skipped else 0
        self._last_result = result
        message = self.skip_monitor.record(skipped, scale)  # host values: no extra sync
        if message:
            self._report_skip_pattern(message)
        limit = self.max_consecutive_skips
        if limit is not None and self._consecutive_skips >= limit:
            bad = self.nonfinite_params()
            raise ScaleCollapseError(
                f"{self._consecutive_skips} steps in a row were skipped for non-finite gradients "
                f"(loss scale now {self.scaler.scale:g}, floor {self.scaler.cfg.min_scale:g}). "
                f"Non-finite gradients this step in: {bad[:10] or 'another rank'}"
                f"{' ...' if len(bad) > 10 else ''}. The run overflows at any scale: look for a "
                "nan/inf in the data or loss (mixprec.debugging.NonFiniteLocator names the first "
                "module), lower the learning rate, or train in bf16, which has fp32's range."
            )
        if skipped and self.verbosity > 0:
            self._report_skip(scale)
        if self.verbosity >= 2:
            self._report_scale_change(scale, skipped)
        return self._last_result

    # ----- the step with no host sync (#27) -----
    def _runs_sync_free(self) -> sync_free.InnerStep | None:
        """The inner step that skips on the device, when this step runs _step_sync_free (see
        _sync_free); None: this step reads the overflow flag on the host.

        On by default on CUDA, wherever it can run (the plain step: no lean write-back, no
        per-step host log): there a host read of the flag stalls the launch queue every step.
        torch's fused optimizers take found_inf (free); every other optimizer runs the masked
        update, which costs an extra copy of the stepped params + state per step (see
        mixprec.core.sync_free). Off on CPU, where a read costs no stall and the copy is pure
        cost (measured: benchmarks/results/sync_free_cpu.md); forced on by tests.
        """
        forced = self._sync_free
        if forced is False:
            return None
        plain = (
            self.lean is None
            and self.carries_grads  # ZeRO, the pipeline, Apex count and report their own way
            and not self.log_num_zeros_in_grad
            and self.verbosity < 2  # the scale-change log reads the scale each step
        )
        if forced is None and not (plain and self._device().type == "cuda"):
            return None
        step, reason = sync_free.inner_step(self.optim, self.scaler.scale_tensor.device)
        if forced is None or (plain and step is not None):
            return step
        raise RuntimeError(
            f"_sync_free=True with {type(self.optim).__name__}: "
            f"{reason or 'a mode that reads the step on the host (lean, log_num_zeros_in_grad, verbosity 2, or a subclass that counts its own way)'}."
        )

    def _step_sync_free(
        self, found_inf: torch.Tensor, norm: torch.Tensor | None, inner: sync_free.InnerStep
    ) -> StepResult:
        """decide -> update -> commit with no host sync: `inner` steps the inner optimizer and
        leaves everything as it was where found_inf is set (mixprec.core.sync_free), the scaler
        advances by its device-side rule, and the step's row goes to the device StepRecord that
        the counters read every DEFAULT_CHECK_EVERY steps or when read (skipped_steps,
        skip_stats, last_result, the returned StepResult's fields): skip reports and
        ScaleCollapseError come then. An LR scheduler sees what it sees on the syncing path:
        step() returns either way, and its scheduler.step() moves the lr by its own count (a
        skip is a step there too, as on the syncing path)."""
        scale = self.scaler.scale_tensor.clone()  # the scale these grads ran under
        self._update_scale(found_inf)  # no clean_growth: the device-side rule, no read
        self._keep_grads()
        inner(found_inf)
        self._masters_to_params()  # after a skip the masters are unchanged: the same lp values
        self._finish_step()
        if not self._step_had_grads:  # host-known: counted apart, as the syncing step does
            self._step_had_grads = True
            self.noop_steps += 1
            return StepResult(
                skipped=False, scale=float("nan"), grad_norm=None, num_zeros=None, noop=True
            )
        self.steps += 1
        if self._record is None:
            self._record = StepRecord()
        row = self._record.write(found_inf, scale, norm)
        self._record.step_done(self._count_row, has_norm=norm is not None)
        return _PendingStepResult(row, norm is not None)

    def _count_row(self, skipped: bool, scale: float, grad_norm: float | None) -> None:
        self._count(StepResult(skipped=skipped, scale=scale, grad_norm=grad_norm, num_zeros=None))

    def _read_record(self) -> None:
        """Count the steps on the device record (one host sync for all of them)."""
        if self._record is not None:
            self._record.read(self._count_row)

    def _report_scale_change(self, scale: float, skipped: bool) -> None:
        """verbosity 2 (Colossal's NAIVE verbose=True): say when the scale moved and why."""
        new_scale = self.scaler.scale  # a host sync, paid only when asked for debug output
        if new_scale != scale and _is_rank_zero():
            why = "overflow" if skipped else f"{self.scaler.cfg.growth_interval} clean steps"
            log.info(
                "mixprec: loss scale %g -> %g after step %d (%s)", scale, new_scale, self.steps, why
            )

    def _report_skip(self, scale: float) -> None:
        """Log a skipped step once, on rank 0 (faces override this with their own words)."""
        if _is_rank_zero():
            log.info(
                "mixprec: non-finite gradients; skipped step %d (loss scale %g -> %g)",
                self.steps,
                scale,
                self.scaler.scale,
            )

    def _report_skip_pattern(self, message: str) -> None:
        """Log the skip monitor's warm-up summary or rate warning once, on rank 0."""
        if _is_rank_zero():
            log.warning(message)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.lp_params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        # Masters' grads are overwritten each step (or set to None): zeroing them is wasted work.
        master_ids = {id(m) for m in self.hp_masters}
        for group in self.optim.param_groups:
            for p in group["params"]:
                if id(p) not in master_ids and p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()
        self._found_inf = None
        self._grads_on_masters = False
        self._backward_scaled = False
        self._grad_seen = None
        self._carry = None  # the last step's gradients are dropped with the rest

    # ----- checkpoints -----
    def state_dict(self) -> dict[str, Any]:
        """torch's layout ({'state', 'param_groups'} of the params the inner optimizer steps,
        fp32 masters included) with mixprec's additions beside it (see mixprec.core.optim_state):
        'master_weights', 'master_index', 'scaler', 'steps', 'skipped_steps'. A plain torch
        optimizer over the fp32 model loads it as is (torch reads only its own two keys)."""
        state = self.optim.state_dict()
        held = [p for g in self.optim.param_groups for p in g["params"]]
        master_ids = {id(m) for m in self.hp_masters}
        state["master_weights"] = [m.detach().clone() for m in self.hp_masters]
        state["master_index"] = [i for i, p in enumerate(held) if id(p) in master_ids]
        state["scaler"] = self.scaler.state_dict()
        state["steps"] = self.steps
        state["skipped_steps"] = self.skipped_steps
        if self.lean is not None:  # compact low-bit state and the rounding's random stream
            self.lean.state_dict_into(state)
        return state

    def _load_scaler_state(self, saved: dict[str, Any]) -> None:
        """Take a saved scaler's state, unless it came from a mode that scales differently: a
        mode without loss scaling keeps its 1.0 (a scale carried over would multiply every
        backward); a loss-scaling mode resumed from one without keeps its own first scale (a
        dynamic scale restarted at 1.0 would underflow fp16 grads for thousands of steps)."""
        saved_scale = float(torch.as_tensor(saved["scale"]).reshape(-1)[0])
        saved_scales = bool(saved.get("dynamic", saved_scale != 1.0)) or saved_scale != 1.0
        if saved_scales == self.scales_loss:
            self.scaler.load_state_dict(saved)
        elif saved_scales and _is_rank_zero():
            log.warning(
                "mixprec: dropped the checkpoint's loss scale %s: this optimizer's mode does not "
                "scale the loss (bf16, fp32), so it keeps 1.0",
                scale_text(saved_scale),
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint of this class (any mode), of a plain torch optimizer or of Apex.

        Masters the checkpoint lacks (torch, Apex, a mode without them) are rebuilt from the
        model's current params (load the model first); its scaler and counters, if absent, stay.
        """
        state_dict = upgrade_optimizer_checkpoint(state_dict)
        held = [p for g in self.optim.param_groups for p in g["params"]]
        master_to_lp = self._master_to_lp()
        own = [i for i, p in enumerate(held) if id(p) in master_to_lp]
        saved = saved_masters(state_dict, held, own)
        if self.lean is not None:  # loads its own state: torch would cast it to the params'
            state_dict, lean_saved, lean_entry = lean_step.split_state(state_dict)
            self.optim.load_state_dict(state_dict)
            self.lean.load_state(self.optim, lean_saved, lean_entry)
        else:
            self.optim.load_state_dict(lean_step.unpack_state_dict(state_dict))
        rebuilt = place_masters(held, master_to_lp, saved)
        if rebuilt and _is_rank_zero():
            log.warning(
                "mixprec: the optimizer checkpoint holds no fp32 master weights for %d of this "
                "optimizer's %d (a plain torch optimizer's, Apex's, or another mode's), and the "
                "model's low-precision params were loaded apart from them: rebuilt them from "
                "those params (their rounding, not the fp32 values). To resume exactly, load "
                "the model with booster.load_model or mixprec's load_hp_model_state_dict (they "
                "write the masters too), before or after this optimizer",
                rebuilt,
                len(own),
            )
        if "scaler" in state_dict:
            self._load_scaler_state(state_dict["scaler"])
        self.steps = int(state_dict.get("steps", self.steps))
        self.skipped_steps = int(state_dict.get("skipped_steps", self.skipped_steps))
        self.skip_monitor.resume(self.steps)
        self._found_inf = None
        self._grads_on_masters = False
