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
from typing import Any, ClassVar, final

import torch
from typing_extensions import override

from mixprec.core import fused_step as fused
from mixprec.core import lean as lean_step
from mixprec.core.backward_watch import BackwardWatch, unscaled_grads_error
from mixprec.core.clip import ClipSpan, clip_grads_
from mixprec.core.commit import (
    Accounting,
    FusedCommit,
    StepAccounts,
    StepFlags,
    StepResult,
    SyncFreeCommit,
    SyncingCommit,
    commit,
    outside_check,
)
from mixprec.core.grad_transfer import GradTransfer
from mixprec.core.optim_state import load_optimizer_state, optimizer_state
from mixprec.core.policy import UNIT_SCALE, ScalerConfig
from mixprec.core.scaling import (
    LossScaler,
    ProcessGroup,
    all_reduce_found_inf_,
    default_group,
    group_to_hold,
)
from mixprec.core.skip_monitor import StepCounter
from mixprec.core.validate import check_bool, check_max_norm, check_norm_type

log = logging.getLogger("mixprec")
__all__ = ["MixedPrecisionOptimizer", "StepTraits", "WrapsOptimizer"]


def _route_zero_grad(inner: torch.optim.Optimizer, wrapper: MixedPrecisionOptimizer) -> None:
    """The inner optimizer's zero_grad() becomes the wrapper's: Lightning, Fabric and a user who
    kept the torch optimizer call it, and it cleared only the masters' grads, so the model's lp
    grads a step leaves in .grad (see grad_transfer.Carry) added into every later step (a skipped step's inf
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


def _check_bools(**optional: bool | None) -> None:
    """Each a bool or None (None: decided per device / step)."""
    for name, value in optional.items():
        check_bool(name, value, optional=True)


TORCH_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)
"""The hook registries torch.optim.Optimizer.__init__ would make (the wrapper skips it)."""


def _check_eps(group: dict[str, Any]) -> None:
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


class WrapsOptimizer(torch.optim.Optimizer):
    """torch.optim.Optimizer's face over a wrapped optimizer (`optim`): param_groups, state and
    defaults are the wrapped one's, so LR schedulers and hooks see one optimizer."""

    optim: torch.optim.Optimizer

    def _wrap(self, optimizer: torch.optim.Optimizer) -> None:
        """Hold optimizer and make the hook registries torch's __init__ would (it is skipped)."""
        self.optim = optimizer
        for hooks in TORCH_HOOK_DICTS:
            setattr(self, hooks, OrderedDict())

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


@dataclass(frozen=True)
class StepTraits:
    """The class-level switches of a MixedPrecisionOptimizer subclass, in one frozen value."""

    whole_step_refusal: str | None = None
    """Why mixprec.compile_step must not run this optimizer's step (None: it may): set by a
    subclass whose step() does collective work the compiled step does not know."""
    scaled_backward_hint: str = (
        "booster.backward(loss, optimizer) (Booster), optimizer.backward(loss) "
        "(convert_to_amp, initialize) or engine.backward(loss)"
    )
    """How a user of this class runs the scaled backward (named when grads did not come
    through it)."""
    carries_grads: bool = True
    """Whether a step keeps torch's contract (it leaves its grads in .grad: GradTransfer's
    carry, ZeRO's owners' shares included); False where the subclass follows its peer's rule
    instead (Apex clears the master grads after every step; Lightning's wrappers zero
    param_groups only)."""
    steps_on_device: bool = True
    """False where a subclass's step reads its outcome on the host, so the sync-free step must
    not run it: ZeRO and the pipeline (their reductions, owners and stage bookkeeping follow
    the host's decision) and Apex's per-loss scalers."""


class MixedPrecisionOptimizer(StepAccounts, WrapsOptimizer):
    """Wraps any torch optimizer; `backward(loss)` scales, `step()` unscales, checks and steps.

    Args:
        optimizer: the optimizer over the model's (possibly fp16/bf16) parameters.
        loss_scale: scaler settings; UNIT_SCALE scales nothing but still skips non-finite steps.
        master_weights: keep fp32 masters for low-precision params (default: whenever there are any).
        max_norm: clip the unscaled gradients to this total norm in every step (0: off).
        process_group: ranks that must agree on overflow (default: the world when initialised).
        log_num_zeros_in_grad: count zero gradient entries each step (one more host sync).
        max_consecutive_skips: raise skip_monitor.ScaleCollapseError after this many skipped steps in a row
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

    traits: ClassVar[StepTraits] = StepTraits()
    """How this class's step behaves (StepTraits): a subclass sets its own, derived with
    dataclasses.replace from its base's."""
    clip_span: ClipSpan = ClipSpan()
    """The ranks clip_grad_norm's norm spans (core.clip.ClipSpan): none here, as replicas hold
    equal grads; a parallelism whose ranks hold disjoint parts sets its own."""
    norm_type: float = 2.0
    """clip_grad_norm's p when none is passed."""
    # torch's GradScaler.step then sets found_inf (its check, done once) and grad_scale (the
    # scale still in the grads, or None once unscale_ ran) on this object and calls step()
    # unconditionally, with no host sync of its own; see commit.outside_check.
    _step_supports_amp_scaling = True

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
        _check_bools(master_weights=master_weights, keep_master_grads=keep_master_grads)
        self.counts = StepCounter(max_consecutive_skips)  # checks it before anything changes
        """steps, skips, the skip monitor and the collapse guard (core.skip_monitor)."""
        self.accounting = Accounting(self)
        """Counts each step in self.counts and reports skips (core.commit)."""
        self._wrap(optimizer)
        _route_zero_grad(optimizer, self)
        self.fused_step, self.master_weights = fused_step, master_weights
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
            _check_eps(group)
        self.scaler = LossScaler(loss_scale, self.transfer.device())
        self.step_flags = StepFlags()
        """The step in progress: its overflow flag, where its grads are (core.commit)."""
        self.watch = BackwardWatch()
        """The last backward() and the misuse seen before the step (core.backward_watch)."""
        self._sync_free: bool | None = None
        """None runs the step with no host sync where it costs one (CUDA: see
        SyncFreeCommit.inner_step); True forces it (tests on CPU); False keeps the one read of
        the overflow flag per step."""
        self.lean = None if lean is None else lean_step.LeanUpdate(lean, optimizer)

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

    def _masters_for(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.transfer.masters_for(params, use_masters=self.master_weights is not False)

    def name_params(self, model: torch.nn.Module) -> None:
        """Learn the model's parameter names, so errors can say which parameters overflowed."""
        self.param_names.update(self.transfer.held_names(model))

    def nonfinite_params(self) -> list[str]:
        """Names (or group/index) of the parameters whose current gradient holds inf/nan."""
        return self.transfer.nonfinite(self.param_names)

    @override
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group["params"] = self._masters_for(params)
        self.optim.add_param_group(group)
        _check_eps(self.optim.param_groups[-1])

    # ----- scaling, unscaling, checking -----
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

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
        scale would shrink the update by that scale, silently. One flag read on the hot path."""
        if (
            self._grads_came_through_backward()
            or not self.scales_loss
            # the masters' grads may be stale: this step's lp grads are what backward left
            or not (self.step_flags.on_masters or self.transfer.step_grads())
        ):
            return
        raise unscaled_grads_error(
            type(self).__name__, self.scaler.cfg, self.traits.scaled_backward_hint
        )

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of the scaled loss; several calls before one step() accumulate."""
        if self.step_flags.found_inf is not None:
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

    def grads_to_masters(self) -> None:
        """Hand this step's grads to the fp32 masters and reduce them, once per step
        (GradTransfer.to_masters: its way, then its reducer; an outside GradScaler calls this
        before unscaling, since it only sees the masters in param_groups)."""
        flags = self.step_flags
        if not flags.transferred:
            self.transfer.to_masters(free_lp=not self.traits.carries_grads)
            flags.on_masters = flags.transferred = True

    def unscale_grads(self) -> torch.Tensor:
        """The step's first stages, once per step: transfer the grads to the masters (and reduce
        them by the transfer's reducer: a dp mean, ZeRO's buckets), unscale and check them.

        Returns the overflow flag (a device tensor, reduced over the process group).
        """
        if self.step_flags.found_inf is not None:
            return self.step_flags.found_inf
        self._check_scaled_backward()
        # a second step() with no backward through this optimizer
        self.transfer.rescale_carried(self.scaler)
        self.grads_to_masters()  # transfer + reduce (GradTransfer's way and reducer)
        found_inf = self._unscale_and_check()
        group = self.process_group or default_group()
        self.step_flags.found_inf = all_reduce_found_inf_(found_inf, group)
        self.transfer.note_unscaled()
        return self.step_flags.found_inf

    def _unscale_and_check(self) -> torch.Tensor:
        """Unscale the held grads in place and check them: this rank's overflow flag."""
        found_inf, had_grads = self.transfer.unscale_and_check(self.scaler)
        self.step_flags.had_grads = had_grads or self._shares_steps()
        return found_inf

    def clip_grad_norm(self, max_norm: float, norm_type: float | None = None) -> torch.Tensor:
        """Clip the unscaled gradients to max_norm by their norm over self.clip_span's ranks
        (norm_type None: self.norm_type); returns the total norm before clipping."""
        check_max_norm("max_norm", max_norm)
        p = self.norm_type if norm_type is None else check_norm_type("norm_type", norm_type)
        self.unscale_grads()
        grads = [q.grad for g in self.optim.param_groups for q in g["params"] if q.grad is not None]
        # DTensor grads complete their norm over their own mesh first (core.clip).
        group, device = self.clip_span.resolve(), self.scaler.scale_tensor.device
        return clip_grads_(grads, max_norm, p, group=group, device=device)

    def count_zero_grads(self) -> int:
        """Zero entries of the held grads (log_num_zeros_in_grad: a host sync per tensor)."""
        return int(sum(int((g == 0).sum()) for g in self._hp_grads()))

    # ----- the step: one fixed sequence, configured by the stages below -----
    @final
    @override
    @torch.no_grad()
    def step(self, closure: Any = None) -> StepResult:  # type: ignore[override]
        """plan -> transfer -> reduce -> unscale+check -> clip -> decide -> commit -> account.

        Every subclass runs this sequence and configures its stages, never re-sequences them:
        _plan picks the commit strategy (core.commit); grads_to_masters runs GradTransfer's way
        and its reducer (GradReducer, set by the parallel layer); _unscale_and_check, clip_grad_norm (max_norm > 0), decide on
        _scale_used() then _update_scale; core.commit.commit updates unless skipped and counts;
        then the grads a reducer handed the step given back (the carry), _after_update (ZeRO's
        all-gather); _end_step always. A fused step runs unscale,
        check, clip and update in one pass per tensor (FusedCommit).
        """
        if closure is not None:
            raise RuntimeError(
                f"Closures are not supported with loss scaling ({type(self).__name__}.step)."
            )
        self.transfer.pin_layout()  # a step changes no param group: its layout is read once
        try:
            result = commit(self, self._plan().outcome(self))
            if self.transfer.handed is not None and self.traits.carries_grads:
                self.transfer.give_back(self.scaler)  # a reducer's grads (ZeRO's) into .grad
            self._after_update(result)
            return result
        finally:
            self.transfer.unpin_layout()
            self._end_step()

    def _plan(self) -> FusedCommit | SyncFreeCommit | SyncingCommit:
        """The checks before a step, then this step's commit strategy (its stages run here)."""
        self.transfer.rescale_carried(self.scaler)  # a step() again with no backward
        outside = outside_check(self)
        if outside is not None:
            self.step_flags.found_inf = outside
        if not self.watch.warned_no_grads:
            self.watch.warn_no_grads(itertools.chain(self.lp_params, self.transfer.layout().held))
        if self.watch.seen is not None:
            unscaled = self.step_flags.found_inf is not None
            self.watch.check_edit(self._model_probe(), unscaled=unscaled, scale=self.scaler)
        fused_grads = FusedCommit.grads_for(self)
        if fused_grads is not None:
            self._check_scaled_backward()  # unscale_grads' first check, on the fused path
            return FusedCommit(fused_grads)
        found_inf = self.unscale_grads()  # checks, transfer -> reduce -> unscale+check
        norm = self.clip_grad_norm(self.max_norm) if self.max_norm > 0 else None
        inner = SyncFreeCommit.inner_step(self)
        if inner is not None:
            return SyncFreeCommit(found_inf, norm, inner)
        return SyncingCommit(found_inf, norm)

    # Stages a subclass configures (the defaults are the core's own).
    def _scale_used(self) -> torch.Tensor | None:
        """The scale this step's grads were computed with, when not this optimizer's own scaler's
        (Apex's per-loss scalers); None: the own scaler's, read with the overflow flag."""
        return None

    def _update_scale(self, found_inf: torch.Tensor) -> None:
        """Advance the own scaler by this step's overflow flag (Apex's amp advances each loss's
        scaler at its backward instead)."""
        self.scaler.update(found_inf, clean_growth=self.step_flags.clean_growth)

    def _after_update(self, result: StepResult) -> None:
        """After the commit (ZeRO gathers the owners' updated params here)."""

    def _end_step(self) -> None:
        """Per-step state a subclass keeps is reset here, whatever the step did or raised."""

    def _shares_steps(self) -> bool:
        """True when other ranks take this step too: a rank without grads then counts it as a
        step like theirs (its counters, and the LR schedule that follows them, stay in step)."""
        group = self.process_group or default_group()
        return group is not None and torch.distributed.get_world_size(group) > 1

    def _keep_grads(self, *, fused: bool = False, factor: torch.Tensor | None = None) -> None:
        """Leave this step's gradients in .grad for a backward before zero_grad()
        (GradTransfer.keep: fused, factor as there), unless this optimizer does not carry them."""
        if self.traits.carries_grads:
            self.transfer.keep(self.scaler, fused=fused, factor=factor)

    def _finish_step(self) -> None:
        """Free the master grads (unless kept) and clear this step's flags."""
        keep = self.keep_master_grads
        if keep is None and self.hp_masters:
            keep = self.transfer.device().type == "cpu"
        if self.hp_masters and not keep:
            self.transfer.free_master_grads()
        self._clear_step_flags()

    def _clear_step_flags(self) -> None:
        self.step_flags.clear()
        self.watch.clear()

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
        self.step_flags.clear()
