"""The one optimizer wrapper every mode uses: loss scaling, fp32 master weights, skip on overflow.

Low-precision params get fp32 master copies that replace them in the wrapped optimizer's
param_groups (so LR schedulers and the optimizer's own state see fp32 tensors); fp32 params
are their own masters. A step whose gradients hold inf/nan on any rank of the process group
is skipped on every rank: params, masters and optimizer state are left bit for bit unchanged.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from typing_extensions import override

from mixprec.core import fused_step as fused
from mixprec.core import lean as lean_step
from mixprec.core import sync_free
from mixprec.core.backward_watch import BackwardWatch, unscaled_grads_error
from mixprec.core.clip import clip_grads_, local_shards
from mixprec.core.grad_transfer import LOW_DTYPES, GradTransfer, Layout
from mixprec.core.grad_transfer import Carry as _Carry
from mixprec.core.optim_state import load_optimizer_state, optimizer_state
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
from mixprec.core.skip_monitor import (
    ScaleCollapseError,
    SkipMonitor,
    SkipStats,
    StepCounter,
)
from mixprec.core.step_math import clip_coefficient, inverse_scale
from mixprec.core.step_record import StepRecord
from mixprec.core.validate import check_bool, check_max_norm, check_norm_type

log = logging.getLogger("mixprec")
__all__ = [  # the names below StepResult were imported from here before the split
    "MixedPrecisionOptimizer",
    "StepResult",
    "LOW_DTYPES",
    "Layout",
    "ScaleCollapseError",
    "_Carry",
    "local_shards",
]


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


def _is_rank_zero() -> bool:
    return rank_and_world()[0] == 0


class _Counted:
    """A MixedPrecisionOptimizer attribute that lives in its StepCounter (self.counts); with
    read_record, the sync-free step's device record is counted first (a host sync, if any)."""

    def __init__(self, *, read_record: bool = False) -> None:
        self.read_record = read_record
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        if self.read_record:
            obj._read_record()
        return getattr(obj.counts, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        if self.read_record:
            obj._read_record()
        setattr(obj.counts, self.name, value)


def _check_arguments(
    optimizer: Any, loss_scale: Any, max_norm: Any, fused_step: Any, log_num_zeros_in_grad: Any
) -> None:
    """MixedPrecisionOptimizer's arguments checked before anything is built, each error naming
    the value passed."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)!r}.")
    if isinstance(optimizer, MixedPrecisionOptimizer):
        raise TypeError("This optimizer is already wrapped by mixprec; wrap the inner one once.")
    check_max_norm("max_norm", max_norm)
    check_bool("log_num_zeros_in_grad", log_num_zeros_in_grad)
    check_bool("fused_step", fused_step, optional=True)  # None: decided per step
    if not isinstance(loss_scale, ScalerConfig):
        raise TypeError(f"loss_scale={loss_scale!r} must be a mixprec.ScalerConfig.")
    reason = fused.unsupported_reason(optimizer)
    if fused_step and reason:
        raise ValueError(f"fused_step=True cannot run this optimizer: {reason}.")


TORCH_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)
"""The hook registries torch.optim.Optimizer.__init__ would make (the wrapper skips it)."""


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
        _check_arguments(optimizer, loss_scale, max_norm, fused_step, log_num_zeros_in_grad)
        check_bool("master_weights", master_weights, optional=True)  # None: per device/step
        check_bool("keep_master_grads", keep_master_grads, optional=True)
        self.counts = StepCounter(max_consecutive_skips)  # checks it before anything changes
        """steps, skips, the skip monitor and the collapse guard (core.skip_monitor)."""
        self.optim = optimizer
        _route_zero_grad(optimizer, self)
        self.fused_step = fused_step
        self.master_weights = master_weights
        self.max_norm = float(max_norm)
        self.process_group = group_to_hold(process_group)
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        self.keep_master_grads = keep_master_grads
        self.param_names: dict[int, str] = {}  # id(param as the optimizer holds it) -> name
        self.verbosity = 1
        """0: silent; 1: log skipped steps; 2: also log every loss-scale change (a host sync)."""
        self.transfer = GradTransfer(optimizer)
        """lp params, their fp32 masters and the grads between them (core.grad_transfer)."""
        for group in optimizer.param_groups:
            group["params"] = self._masters_for(group["params"])
            self._check_eps(group)
        self.scaler = LossScaler(loss_scale, self._device())
        self._found_inf: torch.Tensor | None = None  # set once grads are unscaled this step
        self._grads_on_masters = False  # set once this step's lp grads reached the masters
        self.watch = BackwardWatch()
        """The last backward() and the misuse seen before the step (core.backward_watch)."""
        self._step_had_grads = True  # cleared when this step's unscale found no gradient
        # The sync-free step's device record (see _step_sync_free), read into the counters
        # every DEFAULT_CHECK_EVERY steps or when they are read; made at its first step.
        self._sync_free: bool | None = None
        """Private switch: None runs the step with no host sync where it costs one (CUDA; see
        _runs_sync_free); True forces it (tests on CPU); False keeps the one read of the
        overflow flag per step."""
        self._record: StepRecord | None = None
        self._clean_growth: float | None = None  # see _decide
        self.lean = None if lean is None else lean_step.LeanUpdate(lean, optimizer)
        # torch.optim.Optimizer's bookkeeping, for hooks and LR schedulers.
        for hooks in TORCH_HOOK_DICTS:
            setattr(self, hooks, OrderedDict())

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

    @override
    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    @override
    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @override
    def __repr__(self) -> str:
        return f"MixedPrecisionOptimizer({self.optim!r}, scaler={self.scaler.cfg})"

    # ----- the params: lp params and their fp32 masters, held by self.transfer -----
    @property
    def lp_params(self) -> list[torch.Tensor]:
        """The low-precision params that have fp32 masters (hp_masters, in the same order)."""
        return self.transfer.lp_params

    @property
    def hp_masters(self) -> list[torch.Tensor]:
        """The fp32 masters the inner optimizer steps in place of lp_params."""
        return self.transfer.hp_masters

    def _device(self) -> torch.device:
        return self.transfer.device()

    def _own_params(self) -> list[torch.Tensor]:
        """Params the inner optimizer steps directly (fp32, or low precision without masters)."""
        return list(self.transfer.layout().own)

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
        return self.transfer.masters_for(params, use_masters=self.master_weights is not False)

    def name_params(self, model: torch.nn.Module) -> None:
        """Learn the model's parameter names, so errors can say which parameters overflowed."""
        lp_to_master = {id(lp): hp for lp, hp in zip(self.lp_params, self.hp_masters, strict=True)}
        for name, p in model.named_parameters():
            held = lp_to_master.get(id(p), p)
            self.param_names[id(held)] = name

    def nonfinite_params(self) -> list[str]:
        """Names (or group/index) of the parameters whose current gradient holds inf/nan."""
        bad = []
        master_to_lp = self.transfer.master_to_lp()
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

    @override
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group["params"] = self._masters_for(params)
        self.optim.add_param_group(group)
        self._check_eps(self.optim.param_groups[-1])

    # ----- counters (self.counts): host values, or read from the sync-free step's record -----
    steps = _Counted()
    """Optimizer steps taken, skipped ones included (no-op steps not)."""
    noop_steps = _Counted()
    """step() calls that found no gradient (not counted in steps)."""
    max_consecutive_skips = _Counted()
    skipped_steps = _Counted(read_record=True)
    consecutive_skips = _Counted(read_record=True)
    last_result = _Counted(read_record=True)

    @property
    def unread_steps(self) -> int:
        """Steps whose skip flag is still on the sync-free step's device record (a host count,
        no sync): the skip counters cover every step but these until the record is read."""
        return 0 if self._record is None else self._record.pending

    @property
    def skip_monitor(self) -> SkipMonitor:
        """Says when a run starts by skipping, or skips too often."""
        return self.counts.monitor

    # ----- scaling, unscaling, checking -----
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def skip_stats(self) -> SkipStats:
        """Steps, skipped steps (in a row, in the warm-up) and the last scale: no host sync."""
        self._read_record()
        return self.counts.stats()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss (as fp32) times the current scale; call .backward() on the result."""
        self.watch.scaled = True
        self.transfer.rescale_carried(self.scaler)
        return loss.float() * self.scaler.scale_tensor

    def note_scaled_backward(self) -> None:
        """Say that this step's grads come from a loss scaled by this optimizer's scale that a
        face multiplied itself (Lightning's backward runs before the optimizer is wrapped)."""
        self.watch.scaled = True

    @property
    def scales_loss(self) -> bool:
        """True when this optimizer's backward multiplies the loss by a scale other than 1 (read
        from the config: a host fact, no sync)."""
        cfg = self.scaler.cfg
        return cfg.dynamic or cfg.init_scale != 1.0

    def _grads_came_through_backward(self) -> bool:
        """Whether this step's grads were produced by this optimizer's scaled backward."""
        return self.watch.scaled

    def _check_scaled_backward(self) -> None:
        """Refuse grads that did not come through the scaled backward (plain loss.backward(), or
        an outside GradScaler's scaler.scale(loss).backward()): unscaling them by this optimizer's
        scale would shrink the update by that scale, silently.

        One flag read on the hot path; the walk over grads runs only when the flag is unset.
        """
        if (
            self._grads_came_through_backward()
            or not self.scales_loss
            # the masters' grads may be stale: this step's lp grads are what backward left
            or not (self._grads_on_masters or self.transfer.step_grads())
        ):
            return
        raise unscaled_grads_error(type(self).__name__, self.scaler.cfg, self.scaled_backward_hint)

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
            self.watch.scaled = True
            self.transfer.rescale_carried(self.scaler)
            loss.float().backward(**kwargs)
        else:
            self.scale_loss(loss).backward(**kwargs)
            self.watch.note_scaled(self._model_probe())

    def _model_probe(self) -> torch.Tensor | None:
        """A model param whose grad tells an in-place edit (see BackwardWatch.check_edit)."""
        return self.lp_params[0] if self.lp_params else self.transfer.layout().probe

    def _hp_grads(self) -> list[torch.Tensor]:
        """Gradients of everything the wrapped optimizer steps (local shards of DTensors)."""
        return self.transfer.held_grads()

    def _lp_grads_to_masters(self) -> None:
        """The transfer at step (GradTransfer.to_masters); a subclass that moves the grads its
        own way (Paddle's and the pipeline's hooks, ZeRO's buckets) overrides this. The lp grad
        stays in .grad after the step unless this optimizer does not carry grads."""
        self.transfer.to_masters(free_lp=not self.carries_grads)

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
        # a second step() with no backward through this optimizer
        self.transfer.rescale_carried(self.scaler)
        self.grads_to_masters()  # transfer + reduce (subclasses reduce here)
        found_inf = self._unscale_and_check()
        self._found_inf = all_reduce_found_inf_(found_inf, self.process_group or default_group())
        self.transfer.note_unscaled()
        return self._found_inf

    def _unscale_and_check(self) -> torch.Tensor:
        """Unscale the held grads in place and check them: this rank's overflow flag."""
        found_inf = self.scaler.scale_tensor.new_zeros(1)  # fp32, on the scale's device
        inv_scale = self.transfer.inv_used = self.scaler.inv_scale()  # kept: see GradTransfer
        grads = self._hp_grads()
        self._step_had_grads = bool(grads) or self._shares_steps()
        if grads:
            layout = self.transfer.layout()
            one_bucket = layout.uniform and layout.probe.device == found_inf.device
            unscale_and_check_(grads, inv_scale, found_inf, one_bucket=one_bucket)
        return found_inf

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
    @override
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
        self.transfer.pin_layout()  # a step changes no param group: its layout is read once
        try:
            result = self._run_step()
            self._after_update(result)
            return result
        finally:
            self.transfer.unpin_layout()
            self._end_step()

    def _run_step(self) -> StepResult:
        # a step() again with no backward through this optimizer
        self.transfer.rescale_carried(self.scaler)
        self._reuse_outside_check()
        if not self.watch.warned_no_grads:
            self.watch.warn_no_grads(itertools.chain(self.lp_params, self.transfer.layout().held))
        if self.watch.seen is not None:
            unscaled = self._found_inf is not None
            self.watch.check_edit(self._model_probe(), unscaled=unscaled, scale=self.scaler)
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
    follows its peer's rule instead (Apex clears the master grads after every step)."""

    steps_on_device = True
    """False where a subclass's step reads its outcome on the host, so the sync-free step
    (_runs_sync_free) must not run it: ZeRO and the pipeline (their reductions, owners and
    stage bookkeeping follow the host's decision) and Apex's per-loss scalers."""

    def _keep_grads(self, *, fused: bool = False, factor: torch.Tensor | None = None) -> None:
        """Leave this step's gradients in .grad for a backward before zero_grad()
        (GradTransfer.keep: fused, factor as there), unless this optimizer does not carry them."""
        if self.carries_grads:
            self.transfer.keep(self.scaler, fused=fused, factor=factor)

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
            inv_scale = inverse_scale(grad_scale).to(grads[0].device)
            torch._foreach_mul_(grads, inv_scale)
        flag = found_inf.reshape(1).float().to(self.scaler.scale_tensor.device)
        # mixprec's GradScaler reduced it already; torch's did not (MAX twice changes nothing)
        self._found_inf = all_reduce_found_inf_(flag, self.process_group or default_group())
        self.transfer.inv_used = self.scaler.inv_scale()
        # the lp grads hold the outside scale: never kept as they are
        self.transfer.note_unscaled(version=-2)

    def _shares_steps(self) -> bool:
        """True when other ranks take this step too: a rank without grads then counts it as a
        step like theirs (its counters, and the LR schedule that follows them, stay in step)."""
        group = self.process_group or default_group()
        return group is not None and torch.distributed.get_world_size(group) > 1

    def _grads_if_fused(self) -> list[torch.Tensor] | None:
        """This step's grads when it runs fused (see fused_step in the class docstring), else
        None; the cheap refusals come first, so an unfused step gathers nothing."""
        if self.fused_step is False or self._found_inf is not None or self._grads_on_masters:
            return None
        if self.lean is not None:  # the lean write-back is its own pass
            return None
        if self.fused_step is None:
            layout = self.transfer.layout()
            if layout.numel < fused.AUTO_MIN_ELEMENTS or layout.probe.device.type != "cpu":
                return None  # too small to fuse whatever has grads: gather nothing (~8 us a step)
        if self.log_num_zeros_in_grad or fused.unsupported_reason(self.optim):
            return None
        grads = self.transfer.step_grads()
        params = [*self.transfer.layout().held, *self.lp_params]
        if any(not t.is_contiguous() or t.layout != torch.strided for t in grads + params):
            return None
        if self.max_norm > 0 and any(hasattr(p, "to_local") for p in params):
            return None  # a sharded norm needs a sum over the shards; the unfused clip has it
        if self.fused_step is None and (
            self._device().type != "cpu" or sum(g.numel() for g in grads) < fused.AUTO_MIN_ELEMENTS
        ):
            return None
        return grads

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
        master_to_lp = self.transfer.master_to_lp()
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
        self.transfer.masters_to_params()

    def _finish_step(self) -> None:
        """Free the master grads (unless kept) and clear this step's flags."""
        keep = self.keep_master_grads
        if self.hp_masters and not (self._device().type == "cpu" if keep is None else keep):
            self.transfer.free_master_grads()
        self._clear_step_flags()

    def _clear_step_flags(self) -> None:
        self._found_inf = None
        self._grads_on_masters = False
        self.watch.clear()

    def _count(self, result: StepResult, *, per_step_reports: bool = True) -> StepResult:
        """Count a step (steps itself is counted by the caller) in self.counts, report skips.
        Raises ScaleCollapseError after max_consecutive_skips skipped steps in a row."""
        message = self.counts.record(result)  # host values: no extra sync
        if message:
            self._report_skip_pattern(message)
        self.counts.check_collapse(self.scaler, self.nonfinite_params)
        if not per_step_reports:
            return result
        if result.skipped and self.verbosity > 0:
            self._report_skip(result.scale)
        if self.verbosity >= 2:
            self._report_scale_change(result.scale, result.skipped)
        return result

    # ----- the step with no host sync (#27) -----
    def _runs_sync_free(self) -> sync_free.InnerStep | None:
        """The inner step that skips on the device, when this step runs _step_sync_free (see
        _sync_free); None: this step reads the overflow flag on the host.

        On by default on CUDA, wherever it can run (the plain step: no lean write-back, no
        per-step host log): there a host read of the flag stalls the launch queue every step.
        torch's fused optimizers take found_inf (free); every other optimizer runs the masked
        update, which costs an extra copy of the stepped params + state per step (see
        mixprec.core.sync_free). Off on CPU, where a read costs no stall and the copy is pure
        cost (measured: benchmarks/results/sync_free_cpu/); forced on by tests.
        """
        forced = self._sync_free
        if forced is False:
            return None
        plain = (
            self.lean is None
            and self.steps_on_device  # ZeRO, the pipeline, Apex decide on the host
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
        self._record.step_done(self.count_recorded_step, has_norm=norm is not None)
        return _PendingStepResult(row, norm is not None)

    def count_recorded_step(self, skipped: bool, scale: float, grad_norm: float | None) -> None:
        """Count one step read from a device StepRecord (this optimizer's sync-free step's, or
        compile_step's) as a syncing step is counted: the counters, the skip monitor's messages
        and ScaleCollapseError; not the per-step skip lines (verbosity), which would name the
        scale and step count at the read, up to check_every steps later, each a host read.
        `steps` itself is counted by the step when it runs."""
        result = StepResult(skipped=skipped, scale=scale, grad_norm=grad_norm, num_zeros=None)
        self._count(result, per_step_reports=False)

    def _read_record(self) -> None:
        """Count the steps on the device record (one host sync for all of them)."""
        if self._record is not None:
            self._record.read(self.count_recorded_step)

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

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad over the model's params (GradTransfer.zero_grad); the grads a
        step left in .grad are dropped with the rest, and this step's flags cleared."""
        self.transfer.zero_grad(set_to_none)
        self._clear_step_flags()

    # ----- checkpoints (mixprec.core.optim_state) -----
    @override
    def state_dict(self) -> dict[str, Any]:
        """torch's layout with mixprec's additions beside it: see optim_state.optimizer_state."""
        return optimizer_state(self)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint of this class (any mode), of a plain torch optimizer or of Apex:
        see optim_state.load_optimizer_state."""
        load_optimizer_state(self, state_dict)
        self._found_inf = None
        self._grads_on_masters = False
