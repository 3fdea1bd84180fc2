"""The end of MixedPrecisionOptimizer's step: decide -> commit -> account, run one of three ways.

A step's gradients are on the masters (or read where backward left them), unscaled and checked
(the overflow flag reduced over the ranks) before anything here runs. What is left is one
sequence, the same for every way a step runs:

- decide: skip or not, and the scale the gradients ran under (`decide`: the step's one host read);
- commit: the update unless skipped, masters back to the params, the step's flags cleared
  (`commit`: one place, every way);
- account: the counters (`StepCounter`, the only counter), the skip monitor, ScaleCollapseError
  and the skip reports (`Accounting`).

The ways differ only in how the update runs and when the outcome is read, so each is a strategy
handed to `commit`:

- `SyncingCommit`: the flag (and the scale, the growth tracker) read on the host, the inner
  optimizer (or the lean write-back) steps unless skipped;
- `SyncFreeCommit`: nothing read on the host; the inner step skips on the device
  (mixprec.core.sync_free) and the outcome goes to a device `StepRecord`, counted in batches;
- `FusedCommit`: check, clip and update in one compiled pass per tensor straight from the lp
  grads (mixprec.core.fused_step); no fp32 master grads at all.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mixprec.core import fused_step as fused
from mixprec.core import sync_free
from mixprec.core.scaling import LossScaler, all_reduce_found_inf_, default_group, rank_and_world
from mixprec.core.skip_monitor import SkipMonitor, SkipStats, StepCounter
from mixprec.core.step_math import clip_coefficient, inverse_scale
from mixprec.core.step_record import StepRecord

if TYPE_CHECKING:
    from mixprec.core.optim import MixedPrecisionOptimizer

log = logging.getLogger("mixprec")


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


class PendingStepResult(StepResult):
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


@dataclass
class StepFlags:
    """What the optimizer knows about the step in progress (cleared when it ends)."""

    found_inf: torch.Tensor | None = None
    """The reduced overflow flag, once this step's grads are unscaled."""
    on_masters: bool = False
    """This step's gradients reached the masters (at step, or by a hook during backward)."""
    transferred: bool = False
    """This step's transfer and reduction ran (GradTransfer.to_masters: once per step)."""
    had_grads: bool = True
    """Cleared when this step's check found no gradient on this rank (and no rank shares it)."""
    clean_growth: float | None = None
    """The growth tracker the host read with a clean step's flag (see decide), for the scaler."""

    def clear(self) -> None:
        self.found_inf = None
        self.on_masters = self.transferred = False


def decide(
    scaler: LossScaler, found_inf: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[bool, float, float | None]:
    """(skip?, the scale this step ran under, the clean step's growth tracker), read in the one
    host sync of a step.

    The scale and the growth tracker ride the same sync, or are known on the host already
    (LossScaler.host_state: then the flag is read alone). The tracker is returned for a clean
    step of a dynamic scaler (the scaler's update then needs no read), None otherwise. `scale`:
    an outside scale (Apex's per-loss scalers), read with the flag.
    """
    if scale is not None:
        flag, scale_value = torch.cat([found_inf, scale.to(found_inf)]).tolist()
        return flag > 0, scale_value, None
    if scaler.is_unit:  # 1.0 on the host: read the flag alone
        return found_inf.item() > 0, 1.0, None
    known = scaler.host_state()
    if known is None:
        tracker = scaler.growth_tracker
        flag, scale_value, growth = torch.cat(
            [found_inf, scaler.scale_tensor.to(found_inf), tracker.to(found_inf)]
        ).tolist()
        scaler.remember_host_state(scale_value, growth)
    else:  # both unchanged since the host read them: read the flag alone
        flag = found_inf.item()
        scale_value, growth = known
    return flag > 0, scale_value, growth if scaler.dynamic and not flag > 0 else None


def _is_rank_zero() -> bool:
    return rank_and_world()[0] == 0


class Accounting:
    """Counts each step in the optimizer's StepCounter (`counts`) and reports skips: the one
    accounting of every way a step runs (the compiled step's rows come through
    count_recorded_step too). Holds the sync-free step's device StepRecord."""

    def __init__(self, opt: MixedPrecisionOptimizer) -> None:
        # a proxy, not a reference: the optimizer holds this object, and a cycle would keep a
        # deleted optimizer (its hooks, buffers, masters) alive until the next gc pass
        self.opt = weakref.proxy(opt)
        self.record: StepRecord | None = None  # made at the first sync-free step

    def count(self, result: StepResult, *, per_step_reports: bool = True) -> StepResult:
        """Count a step (`steps` itself is counted by commit) and report it. Raises
        ScaleCollapseError after max_consecutive_skips skipped steps in a row."""
        opt = self.opt
        message = opt.counts.record(result)  # host values: no extra sync
        if message:
            opt._report_skip_pattern(message)
        opt.counts.check_collapse(opt.scaler, opt.nonfinite_params)
        if not per_step_reports:
            return result
        if result.skipped and opt.verbosity > 0:
            opt._report_skip(result.scale)
        if opt.verbosity >= 2:
            self.report_scale_change(result.scale, result.skipped)
        return result

    def count_recorded(self, skipped: bool, scale: float, grad_norm: float | None) -> None:
        """One row of a device StepRecord, counted as a syncing step is, but for the per-step
        skip lines (they would name the scale and count at the read, up to check_every late)."""
        result = StepResult(skipped=skipped, scale=scale, grad_norm=grad_norm, num_zeros=None)
        self.count(result, per_step_reports=False)

    def read_record(self) -> None:
        """Count the steps on the device record (one host sync for all of them)."""
        if self.record is not None:
            self.record.read(self.opt.count_recorded_step)

    def write_record(self, found_inf: torch.Tensor, scale: torch.Tensor, norm: Any) -> StepResult:
        """A sync-free step's row onto the device record; its result reads it when read."""
        if self.record is None:
            self.record = StepRecord()
        row = self.record.write(found_inf, scale, norm)
        self.record.step_done(self.opt.count_recorded_step, has_norm=norm is not None)
        return PendingStepResult(row, norm is not None)

    @property
    def unread(self) -> int:
        return 0 if self.record is None else self.record.pending

    def report_scale_change(self, scale: float, skipped: bool) -> None:
        """verbosity 2 (Colossal's NAIVE verbose=True): say when the scale moved and why."""
        opt = self.opt
        new_scale = opt.scaler.scale  # a host sync, paid only when asked for debug output
        if new_scale != scale and _is_rank_zero():
            why = "overflow" if skipped else f"{opt.scaler.cfg.growth_interval} clean steps"
            log.info(
                "mixprec: loss scale %g -> %g after step %d (%s)", scale, new_scale, opt.steps, why
            )


class _Counted:
    """A counter that lives in the optimizer's StepCounter (self.counts); with
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
            obj.accounting.read_record()
        return getattr(obj.counts, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        if self.read_record:
            obj.accounting.read_record()
        setattr(obj.counts, self.name, value)


class StepAccounts:
    """The optimizer's counters and skip reports, as MixedPrecisionOptimizer shows them: each
    lives in its StepCounter (`counts`), read from the sync-free step's device record first
    where it depends on skips (`accounting`). Faces override the reports with their own words."""

    counts: StepCounter
    accounting: Accounting
    scaler: LossScaler

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
        return self.accounting.unread

    @property
    def skip_monitor(self) -> SkipMonitor:
        """Says when a run starts by skipping, or skips too often."""
        return self.counts.monitor

    @property
    def skip_stats(self) -> SkipStats:
        """Steps, skipped steps (in a row, in the warm-up) and the last scale: no host sync."""
        self.accounting.read_record()
        return self.counts.stats()

    def count_recorded_step(self, skipped: bool, scale: float, grad_norm: float | None) -> None:
        """Count one step read from a device StepRecord (this optimizer's sync-free step's, or
        compile_step's) as a syncing step is counted (Accounting.count_recorded)."""
        self.accounting.count_recorded(skipped, scale, grad_norm)

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


@dataclass(frozen=True)
class Outcome:
    """What a strategy decided, for commit."""

    skipped: bool | None
    """The host's decision; None: not read (the update skips on the device itself)."""
    update: Callable[[], None]
    """The update, run unless skipped."""
    count: Callable[[], StepResult]
    """Counts the (stepped or skipped) step and returns its result."""
    host: StepResult | None = None
    """The result as the host knows it (None: on the device record), for a no-op step."""
    after: Callable[[], None] | None = None
    """Run once the step is finished, whatever it did."""


def commit(opt: MixedPrecisionOptimizer, outcome: Outcome) -> StepResult:
    """Update unless skipped, finish the step (master grads freed unless kept, flags cleared),
    then count it: a step with no gradient on this rank (none shared) as a no-op, else a step."""
    if outcome.skipped is not True:
        outcome.update()
    opt._finish_step()
    if outcome.after is not None:
        outcome.after()
    flags = opt.step_flags
    if not flags.had_grads and not outcome.skipped:  # nothing to step: counted apart
        flags.had_grads = True
        opt.noop_steps += 1
        if outcome.host is None:
            return StepResult(
                skipped=False, scale=math.nan, grad_norm=None, num_zeros=None, noop=True
            )
        noop = dataclasses.replace(outcome.host, skipped=False, noop=True)
        opt.last_result = noop
        return noop
    flags.had_grads = True
    opt.steps += 1
    return outcome.count()


def inner_update(opt: MixedPrecisionOptimizer) -> None:
    """The unfused update: the lean write-back or the inner optimizer's step, masters back."""
    opt.lean.step(opt.optim) if opt.lean is not None else opt.optim.step()
    opt.transfer.masters_to_params()


class SyncingCommit:
    """decide on the host (one read), then the inner step unless skipped."""

    def __init__(self, found_inf: torch.Tensor, norm: torch.Tensor | None) -> None:
        self.found_inf, self.norm = found_inf, norm

    def outcome(self, opt: MixedPrecisionOptimizer) -> Outcome:
        grad_norm = None if self.norm is None else float(self.norm)
        num_zeros = opt.count_zero_grads() if opt.log_num_zeros_in_grad else None
        skipped, scale, opt.step_flags.clean_growth = decide(
            opt.scaler, self.found_inf, opt._scale_used()
        )
        opt._update_scale(self.found_inf)
        opt._keep_grads()
        result = StepResult(skipped=skipped, scale=scale, grad_norm=grad_norm, num_zeros=num_zeros)
        count = lambda: opt.accounting.count(result)  # noqa: E731
        return Outcome(skipped, lambda: inner_update(opt), count, host=result)


class SyncFreeCommit:
    """decide -> update -> commit with no host sync: the inner step leaves everything as it was
    where found_inf is set (mixprec.core.sync_free), the scaler advances by its device-side
    rule, and the step's row goes to the device StepRecord that the counters read every
    DEFAULT_CHECK_EVERY steps or when read (skipped_steps, skip_stats, last_result, the
    returned StepResult's fields): skip reports and ScaleCollapseError come then. An LR
    scheduler sees what it sees on the syncing path (a skip is a step there too)."""

    def __init__(
        self, found_inf: torch.Tensor, norm: torch.Tensor | None, inner: sync_free.InnerStep
    ) -> None:
        self.found_inf, self.norm, self.inner = found_inf, norm, inner

    @staticmethod
    def inner_step(opt: MixedPrecisionOptimizer) -> sync_free.InnerStep | None:
        """The inner step that skips on the device, when this step runs sync-free; None: this
        step reads the overflow flag on the host.

        opt._sync_free None: on where it can run and a host read stalls the launch queue every
        step (CUDA; the plain step: no lean write-back, no per-step host log). torch's fused
        optimizers take found_inf (free); every other optimizer runs the masked update, an extra
        copy of the stepped params + state per step (mixprec.core.sync_free). Off on CPU, where
        a read costs no stall and the copy is pure cost (benchmarks/results/sync_free_cpu/).
        True forces it (tests), False keeps the host read.
        """
        forced = opt._sync_free
        if forced is False or (forced is None and opt.transfer.device().type != "cuda"):
            return None
        plain = (
            opt.lean is None
            and opt.traits.steps_on_device  # ZeRO, the pipeline, Apex decide on the host
            and not opt.log_num_zeros_in_grad
            and opt.verbosity < 2  # the scale-change log reads the scale each step
        )
        if forced is None and not plain:
            return None
        step, reason = sync_free.inner_step(opt.optim, opt.scaler.scale_tensor.device)
        if forced is None or (plain and step is not None):
            return step
        raise RuntimeError(
            f"_sync_free=True with {type(opt.optim).__name__}: "
            f"{reason or 'a mode that reads the step on the host (lean, log_num_zeros_in_grad, verbosity 2, or a subclass that counts its own way)'}."
        )

    def outcome(self, opt: MixedPrecisionOptimizer) -> Outcome:
        scale = opt.scaler.scale_tensor.clone()  # the scale these grads ran under
        opt._update_scale(self.found_inf)  # no clean_growth: the device-side rule, no read

        def update() -> None:
            opt._keep_grads()
            self.inner(self.found_inf)
            opt.transfer.masters_to_params()  # after a skip: the unchanged masters' values

        def count() -> StepResult:
            return opt.accounting.write_record(self.found_inf, scale, self.norm)

        return Outcome(None, update, count)


class FusedCommit:
    """Check the lp grads (read only), agree on overflow, then update in one fused pass."""

    def __init__(self, grads: list[torch.Tensor]) -> None:
        self.grads = grads

    @staticmethod
    def grads_for(opt: MixedPrecisionOptimizer) -> list[torch.Tensor] | None:
        """This step's grads when it runs fused (opt.fused_step), else None; the cheap
        refusals come first, so an unfused step gathers nothing."""
        flags = opt.step_flags
        if opt.fused_step is False or flags.found_inf is not None or flags.on_masters:
            return None
        if opt.lean is not None:  # the lean write-back is its own pass
            return None
        cpu_auto = opt.fused_step is None
        layout = opt.transfer.layout()  # pinned by the step: read once here
        if cpu_auto and (
            layout.numel < fused.AUTO_MIN_ELEMENTS or layout.probe.device.type != "cpu"
        ):
            return None  # too small to fuse whatever has grads: gather nothing (~8 us a step)
        if opt.log_num_zeros_in_grad or fused.unsupported_reason(opt.optim):
            return None
        grads = opt.transfer.step_grads()
        params = [*layout.held, *opt.lp_params]
        if any(not t.is_contiguous() or t.layout != torch.strided for t in grads + params):
            return None
        if opt.max_norm > 0 and any(hasattr(p, "to_local") for p in params):
            return None  # a sharded norm needs a sum over the shards; the unfused clip has it
        if cpu_auto and sum(g.numel() for g in grads) < fused.AUTO_MIN_ELEMENTS:
            return None
        return grads

    def outcome(self, opt: MixedPrecisionOptimizer) -> Outcome:
        grads, scaler = self.grads, opt.scaler
        inv_scale = scaler.inv_scale()
        clipping = opt.max_norm > 0
        opt.step_flags.had_grads = bool(grads) or opt._shares_steps()
        if grads:
            stats = fused.check_grads(grads, inv_scale, norm=clipping)
        else:
            stats = torch.zeros(2, device=inv_scale.device)
        found_inf = stats[:1].clone()
        all_reduce_found_inf_(found_inf, opt.process_group or default_group())
        norm = stats[1]
        clip = clip_coefficient(opt.max_norm, norm) if clipping else None  # torch's, in-kernel
        scale = scaler.scale_tensor.to(found_inf).reshape(1)
        growth = scaler.growth_tracker.to(found_inf)  # as in decide, in the same sync
        flag, scale_value, norm_value, growth_value = torch.cat(
            [found_inf, scale, norm.reshape(1), growth]
        ).tolist()
        scaler.update(found_inf, clean_growth=None if flag > 0 else growth_value)
        master_to_lp = opt.transfer.master_to_lp()
        unit = scaler.is_unit
        factor = None if unit and clip is None else inv_scale if clip is None else inv_scale * clip
        opt._keep_grads(fused=True, factor=factor)

        def update() -> None:
            fused.fused_step(opt.optim, master_to_lp, inv_scale, clip)

        def after() -> None:
            if not opt.traits.carries_grads:
                for lp in opt.lp_params:
                    lp.grad = None  # as in the unfused step: the lp gradient lives to the step

        grad_norm = norm_value if clipping else None
        result = StepResult(
            skipped=flag > 0, scale=scale_value, grad_norm=grad_norm, num_zeros=None
        )
        count = lambda: opt.accounting.count(result)  # noqa: E731
        return Outcome(flag > 0, update, count, host=result, after=after)


def outside_check(opt: MixedPrecisionOptimizer) -> torch.Tensor | None:
    """An outside GradScaler's overflow flag taken as this step's (its check, done once: one
    host sync per step, the decide read), with its grads unscaled if it only checked them;
    None when there is none to take.

    Only for an optimizer that scales nothing itself (a unit scale); a scaling one keeps its
    own check (its scale is in the grads too). torch's GradScaler.step sets found_inf and
    grad_scale on the optimizer and deletes them after step()."""
    found_inf = opt.__dict__.get("found_inf")
    if found_inf is None or opt.step_flags.found_inf is not None or not opt.scaler.is_unit:
        return None
    opt.grads_to_masters()
    grads = opt.transfer.held_grads()
    grad_scale = opt.__dict__.get("grad_scale")
    if grad_scale is not None and grads:  # checked, not unscaled: unscale without checking
        torch._foreach_mul_(grads, inverse_scale(grad_scale).to(grads[0].device))
    flag = found_inf.reshape(1).float().to(opt.scaler.scale_tensor.device)
    # mixprec's GradScaler reduced it already; torch's did not (MAX twice changes nothing)
    found = all_reduce_found_inf_(flag, opt.process_group or default_group())
    opt.transfer.inv_used = opt.scaler.inv_scale()
    opt.transfer.note_unscaled(version=-2)  # the lp grads hold the outside scale: never kept
    return found
