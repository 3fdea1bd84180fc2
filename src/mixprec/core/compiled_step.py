"""The whole training step as one compiled program with no host sync (seed 002's static graph).

`compile_step(model, optimizer, criterion)` takes what any face returns and gives back
`step(*inputs, target) -> loss`. One call runs forward and backward (torch.autograd.grad, which
dynamo traces into the graph with its trace_autograd_ops switch, set for this call only;
`.backward()` would break the graph), unscales, checks for inf/nan, clips, all-reduces the
overflow flag (multi-rank), updates the fp32 masters and the optimizer state with fused_step's
math, writes the low-precision params, and advances the loss scale by its owning scaler's own rule
(scaling.ScaleRule: the host asks the scaler for this step's scale, where a loop calls scale(),
and the graph runs its advance_: Megatron's hysteresis, torch's or Paddle's rule). A
skipped step is a `torch.where` on the device over every tensor it would write, so nothing is
read on the host: the returned loss is a 0-dim tensor and reading it is the caller's choice.

State stays where the eager step keeps it: params, masters (MixedPrecisionOptimizer.hp_masters),
the inner optimizer's `state` (torch's own keys: step, exp_avg, exp_avg_sq, momentum_buffer)
and the scaler's tensors are read and written in place, so state_dict(), checkpoints and
alternating compiled and eager steps keep working. Supported: torch.optim.SGD (dampening 0
when momentum is on), Adam, AdamW, with no amsgrad/capturable/differentiable, no step hooks;
lean optimizers (mixprec.core.lean: bf16 params without masters, stochastic rounding drawn
from the eager step's counter stream, fp32, bf16 or torchao's int8/int4/fp8 state, read and
quantized in the graph by mixprec.core.qstate, kept on a skipped step with torch.where).
The update is mixprec.core.step_math's, as in the eager, fused and lean steps.

Modes: fp32, bf16, fp16 (dynamic scale), fp16_naive / Apex O2 (fp32 masters, hysteresis), O3 and
fp8 (Float8Linear, dynamic or delayed scaling: the amax histories are written in the graph, on
skipped steps too, as the eager step writes them) compile with no graph break: 0 per step
measured (torch._dynamo counters, tests) for an MLP, an fp8 MLP, and mixprec.bench.models' ViT
and ResNet; with 2+ ranks the found-inf MAX all-reduce is a traceable functional collective in
the graph. Why torch.autograd.grad and not torch.func.grad: dynamo traces an autograd.Function
under torch.func.grad by inlining its forward and dropping its custom backward (torch 2.13,
pytorch/pytorch#193279), silently wrong gradients for Float8Linear or any user Function;
torch.autograd.grad keeps the custom backward (a test holds both). Under inductor an fp8 step
rounds differently from eager, not worse: fused bf16 intermediates stay fp32, so an fp8 cast can
round the other way; torch.compile's options={"emulate_precision_casts": True} rounds as eager
does (tests: the two then agree within fp32 rounding). Refused (CompileStepError): multi-loss
Apex, log_num_zeros_in_grad. mixprec's precision regions trace into the graph (autocast with
custom lists, fp32_region, fp16_guard, @fp32 functions, classes and modules, Paddle dygraph O2's
fp32 norm layers); a region object built outside the forward and entered in it (`with
self.ctx:`) falls back to eager with one warning: dynamo cannot enter a context manager created
outside the graph (torch 2.13). A caller's region around `step(...)` (Paddle's auto_cast around
the loop body) reaches the forward and the loss and ends there: scaling, backward and the update
run in an fp32_region, as an eager loop runs them outside auto_cast. One call is one optimizer
step: no gradient accumulation.

The update's size does not grow with the param count: each param group's params are joined
(mixprec.core.compiled_join: their state and masters rebound in place into flat buffers, the
optimizer's own tensors still), so the graph holds one update per chunk of the group with one
scalar vector, where one per param gave each trained tensor ~23 graph nodes and a compile that
grew ~9 s per residual block (benchmarks/results/compile_cpu.md). The values are the per-param
update's, bit for bit. A chunk holds one repeated block's params at most, so identical blocks
share their kernels (compiled_join.JoinedGroup), and on CPU inductor's fusion pass tries fewer
partners per node (CPU_FUSION_OPTIONS), inductor's once-per-process C++ set-up (the vector
ISA probes, the kernels' precompiled header) runs on a thread from when the step is built,
while the first call traces, and each kernel's build starts as inductor defines it rather than
after all code generation (inductor_warmup). Before each step the host checks that the joined
tensors are still the optimizer's (a loaded state_dict plans again) and, after steps it did not
take, that Adam's counts are still equal (one read, only then). A lean write-back (stochastic
rounding, low-bit state) steps param by param; for it, regions="auto" (a model of repeated
blocks: identical children of an nn.Sequential / nn.ModuleList, mixprec.core.compile_regions)
or True compiles each kind of param update (same group flags, shape, dtypes and state format)
once as a nested compile region called once per param, the in-place writes outside it; a
regional step joins nothing. The blocks' forward and backward stay inline: compile_regions says why.

Skips are counted and reported by the optimizer's own StepCounter, as its eager steps are
(optimizer.skipped_steps, consecutive_skips, skip_stats, the skip monitor's warm-up summary and
rate warning, ScaleCollapseError after its max_consecutive_skips; a plain torch optimizer gets
a StepCounter of its own, `step.counts`) without a host sync per step: the graph writes each step's
skip flag and scale into a device buffer, and the host reads it once every `check_every` steps
(one sync) and when the user reads the counts (step.sync_counters(), step.skip_stats). A
collapse is therefore raised up to check_every - 1 steps after the step that reached the limit.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from mixprec.core import compiled_join, inductor_warmup, qstate
from mixprec.core import fused_step as fused
from mixprec.core import step_math as sm
from mixprec.core.autocast import fp32_region, scopes_set_aside
from mixprec.core.clip import total_grad_norm
from mixprec.core.commit import StepResult
from mixprec.core.compile_regions import repeated_blocks, use_regions
from mixprec.core.compiled_join import JoinedGroup, counts_equal, joinable
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.scaling import ProcessGroup, ScaleRule, default_group, rank_and_world
from mixprec.core.skip_monitor import SkipStats, StepCounter
from mixprec.core.step_plan import GroupPlan, group_scalars
from mixprec.core.step_record import Count, StepRecord
from mixprec.core.validate import check_max_norm

_LAST = object()  # step(x, y): no target keyword, so the last positional is the target
_TRACE_AUTOGRAD_GRAD = torch._dynamo.config.patch(trace_autograd_ops=True)
"""dynamo traces torch.autograd.grad into the graph instead of breaking there (read while a
call compiles; patched per call, so a user's own torch.compile keeps torch's default)."""
_NO_SCOPE = contextlib.nullcontext()  # the step's usual warning scope: none
CPU_INDUCTOR_OPTIONS = {"cpp_wrapper": True}
"""Inductor options compile_step adds on CPU (the caller's own `options` win). The C++ wrapper
runs the graph's host side (allocating buffers, calling kernels) without Python, which is most
of what a small step still spends: measured 1.10-1.17x faster at 3 x Linear(128) (bf16, NAIVE,
fp8) and ~1.01x on the bench ViT (2-core AMD EPYC, one thread). The first compile takes longer
(~8 s instead of ~3.5 s there; 147 s instead of 117 s for the fp8 ViT, cold cache). Should it
fail to build, the step compiles once more without these options before any eager fallback.
Not joined when the step compiles regions (torch 2.13's C++ wrapper cannot call one:
"NotImplementedError: codegen invoke_subgraph is not implemented for cpp wrapper"), nor when
the step trains more than CPU_WRAPPER_MAX_TENSORS tensors: the wrapper is one C++ file whose
build grows much faster than the graph (benchmarks/results/compile_cpu.md)."""
CPU_FUSION_OPTIONS = {"max_fusion_buffer_group_pairwise_attempts": 4}
"""Inductor options every compile_step adds on CPU (the caller's own `options` win): the
scheduler tries each node against at most 4 others of a buffer group for fusion (torch's
default: 64). Every update node reads the step's scalars and skip flag, so they form one large
buffer group whose pairwise fusion checks grew with the model: at 24 residual MLP blocks the
scheduler was the first step's largest phase after the C++ builds, and with 4 attempts it took
a third of that time, the steady step no slower (benchmarks/results/compile_cpu.md: its
scheduler column). Not measured on GPU, so not added there."""
CPU_WRAPPER_MAX_TENSORS = 32
"""The most trained tensors a step may have for CPU_INDUCTOR_OPTIONS to join its compile."""

log = logging.getLogger("mixprec")


@contextlib.contextmanager
def _torch_deprecations_ignored():
    """torch's own DeprecationWarnings ignored: under `-W error` (or pytest's filterwarnings =
    error) the one dynamo raises while tracing an autograd.Function (Float8Linear, a user's
    Function) became an error that stopped the compile."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch(\.|$)")
        yield


_INNER_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""step() calls of the torch optimizers compiled steps run, counted by one global post hook (a
hook of the optimizer's own would make fused_step refuse it): a plain optimizer's eager steps
show here, not in any StepCounter."""
_COUNTING: list[Any] = []  # the global hook's handle, once registered


def _count_inner_steps(optimizer: torch.optim.Optimizer) -> None:
    """Count optimizer's step() calls in _INNER_STEPS from now on."""
    if not _COUNTING:

        def count(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if opt in _INNER_STEPS:
                _INNER_STEPS[opt] += 1

        _COUNTING.append(register_optimizer_step_post_hook(count))
    _INNER_STEPS.setdefault(optimizer, 0)


class CompileStepError(ValueError):
    """compile_step cannot run this model/optimizer/scaler combination."""


def _refusal(optimizer: torch.optim.Optimizer) -> str | None:
    reason = fused.unsupported_reason(optimizer)
    if reason is not None:
        return reason
    if isinstance(optimizer, torch.optim.SGD):
        for group in optimizer.param_groups:
            # the compiled step creates torch's zero buffer up front (a skipped first step may
            # not create state), and only with dampening 0 does a zero buffer give buf = grad
            if group["momentum"] and group["dampening"]:
                return f"SGD momentum with dampening={group['dampening']!r} (only 0 is compiled)"
    return None


def _runnable_inner(
    model: nn.Module, optimizer: torch.optim.Optimizer, criterion: Callable[..., torch.Tensor]
) -> torch.optim.Optimizer:
    """The torch optimizer the step runs (optimizer's inner one, or optimizer); raises
    TypeError or CompileStepError naming what the compiled step cannot run."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model)!r}.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)!r}.")
    if not callable(criterion):
        raise TypeError(f"criterion must be callable (a loss), got {criterion!r}.")
    wrapped = isinstance(optimizer, MixedPrecisionOptimizer)
    inner = optimizer.optim if wrapped else optimizer
    reason = _refusal(inner)
    if reason is not None:
        raise CompileStepError(
            f"compile_step cannot run {type(inner).__name__}: {reason}. Supported: "
            "SGD (dampening 0 with momentum), Adam, AdamW; step it eagerly instead."
        )
    if wrapped and optimizer.traits.whole_step_refusal is not None:
        raise CompileStepError(
            f"compile_step cannot run {type(optimizer).__name__}: "
            f"{optimizer.traits.whole_step_refusal}. Step it eagerly."
        )
    if any(hasattr(p, "to_local") for p in model.parameters()):  # DTensor params
        raise CompileStepError(
            "compile_step cannot run a model with DTensor parameters (FSDP2, tensor "
            "parallel, ZeRO level 3): their collectives live outside the functional step. "
            "Step it eagerly."
        )
    if wrapped and optimizer.log_num_zeros_in_grad:
        raise CompileStepError(
            "log_num_zeros_in_grad=True counts zeros on the host every step; the compiled "
            "step has no host sync. Turn it off or step eagerly."
        )
    if len(getattr(optimizer, "scalers", ())) > 1:
        raise CompileStepError(
            f"num_losses={len(optimizer.scalers)}: compile_step runs one loss per step."
        )
    return inner


class _UnitScale:
    """The scale of a step no scaler owns (a plain optimizer), or of one whose scaler is off:
    static 1.0, still skips inf/nan (ScaleRule)."""

    def __init__(self, device: torch.device) -> None:
        self.scale_tensor = torch.ones(1, device=device)

    def active_scale(self) -> torch.Tensor:
        return self.scale_tensor

    def advance_(self, found_inf: torch.Tensor) -> None:
        pass


def _scale_owner(optimizer: torch.optim.Optimizer, scaler: Any) -> ScaleRule | None:
    """The scaler that owns this step's loss scale: the given one, the optimizer's own
    LossScaler, or None (a unit scale). Each step asks it for its scale (active_scale) and
    advances it by its own rule (advance_): one rule per scaler, whichever path steps."""
    own = optimizer.scaler if isinstance(optimizer, MixedPrecisionOptimizer) else None
    if scaler is None:
        return own
    if not isinstance(scaler, ScaleRule):
        raise TypeError(
            f"scaler={scaler!r}: compile_step takes a mixprec.GradScaler (e.g. "
            "mixprec.paddle.GradScaler; its update rule runs on the device), or None when the "
            "optimizer scales its own loss."
        )
    if own is not None and (own.cfg.dynamic or own.cfg.init_scale != 1.0):
        raise CompileStepError(
            f"scaler={scaler!r} given, but the optimizer already scales the loss "
            f"({own.cfg}): pass one of them."
        )
    return scaler


def _init_state(
    plan: GroupPlan, state: dict[str, Any], hp: torch.Tensor, zeros: Any
) -> list[torch.Tensor]:
    """torch's initial state for hp (the plan's), created now: a compiled step cannot create it
    lazily, and a skipped first step may not. SGD's buffer starts at zero and decays from its
    first step (with dampening 0, buf = 0 * momentum + grad = grad, torch's first buffer)."""
    tensors, _ = plan.init_state(state, hp, zeros)
    if plan.kind != "adam":
        return tensors
    # On the param's device (torch keeps a non-capturable step on the CPU): the graph counts it
    # there, where a CPU step would cost a device -> host copy each step. torch's eager Adam
    # reads either (it takes the value with .item()).
    state["step"] = state["step"].to(hp.device)
    return [state["step"], *tensors]


def _read(state: Any, like: torch.Tensor) -> torch.Tensor:
    """A state operand's fp32 value in like's shape (a quantized one dequantized: qstate.read)."""
    return qstate.read(state).view(like.shape)


def _update_values(spec: tuple, grad: torch.Tensor, hp: torch.Tensor, *rest: torch.Tensor):
    """The new values of one param's update (step_math, as fused_step's kernels run it), each
    the old one on a skipped step: the state's (qstate.writes' order), hp's, the lp twin's,
    then Adam's step count. rest: the lp twin (when the spec has one), the state operands (a
    quantized one as its qstate.unpack parts), the group's values h, the head (inv_scale,
    clip), keep, skip and the rounding key (when the spec has one). Lean: hp may be a bf16
    param (no master) and its state bf16, both read as fp32; a key rounds a bf16 hp
    stochastically (none: nearest)."""
    flags, clipping, parts, keyed, _, _, lp_dtype = spec
    kind, (maximize, decay, *extra) = flags  # extra: nesterov or decoupled (GroupPlan)
    rest = list(rest)
    lp = rest.pop(0) if lp_dtype is not None else None
    key = rest.pop() if keyed else None
    state: list[Any] = []
    for n in parts:
        state.append(tuple(rest[:n]) if n else rest[0])
        del rest[: max(n, 1)]
    h, inv_scale, clip, keep, skip = rest
    head = [inv_scale, clip]
    # the group's values as fresh tensors: unpacking h itself gave the region views of one
    # input as several inputs, which dynamo refuses in a region (input-to-input aliasing)
    h = list(h.clone().unbind())
    written: list[tuple[torch.Tensor, torch.Tensor]] = []
    step = []
    if kind != "adam":
        # h: the plan's values (fp64); a zero buffer decays: no `first` scalars needed
        s = sm.scalar_vector(group_scalars(kind, h), head)
        g = sm.unscaled(grad, s, clipping, maximize)
        if kind == "sgd_momentum":
            new, buf = sm.sgd_momentum_update(hp.float(), g, _read(state[0], hp), s, decay, *extra)
            written += qstate.writes(state[0], buf)
        else:
            new = sm.sgd_update(hp.float(), g, s, decay)
    else:
        step_t, exp_avg, exp_avg_sq = state
        step = [step_t + keep.reshape(()).to(step_t.dtype)]  # unchanged on a skip: keep is 0
        # the bias corrections in fp64, as torch's Python floats
        s = sm.scalar_vector(group_scalars(kind, h, step=step[0].double()), head)
        g = sm.unscaled(grad, s, clipping, maximize)
        m, v = _read(exp_avg, hp), _read(exp_avg_sq, hp)
        new, m, v = sm.adam_update(hp.float(), g, m, v, s, decay, *extra)
        written += qstate.writes(exp_avg, m) + qstate.writes(exp_avg_sq, v)
    if key is not None and hp.dtype == torch.bfloat16:
        written.append((hp, sm.round_bf16_stochastic(new, sm.rounding_noise(key, new.shape))))
    else:
        written.append((hp, new))
    if lp is not None:
        written.append((lp, new.to(lp.dtype)))
    return (*(torch.where(skip, old, value) for old, value in written), *step)


def _constant(key: int) -> Callable[..., int]:
    """An update region's reuse key (nested_compile_region's reuse_hash_fn): its place among
    the step's regions. Every region runs one code object (_update_of's `update`), which
    invoke_subgraph's cache keys on, and its own guards cannot read the spec in the closure
    (torch 2.13: 'subgraph_reuse: failed to resolve source ... __closure__'), so the key tells
    the regions apart; the spec fixes each one's shapes and dtypes."""

    def reuse_key(*tensors: torch.Tensor) -> int:
        return key

    return reuse_key


def _update_of(spec: tuple) -> Callable[..., tuple[torch.Tensor, ...]]:
    """_update_values for one spec, as a plain function (dynamo's invoke_subgraph takes a user
    function, not a functools.partial: torch 2.13)."""

    def update(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _update_values(spec, *tensors)

    return update


class CompiledStep:
    """`step(*inputs, target) -> loss`: one whole training step, compiled. See compile_step."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        criterion: Callable[..., torch.Tensor],
        *,
        max_norm: float | None,
        scaler: Any,
        compile: bool,
        compile_options: dict[str, Any],
        check_every: int = 32,
        regions: Any = False,
    ) -> None:
        wrapped = isinstance(optimizer, MixedPrecisionOptimizer)
        inner = _runnable_inner(model, optimizer, criterion)
        if max_norm is None:
            max_norm = optimizer.max_norm if wrapped else 0.0
        check_max_norm("max_norm", max_norm)  # None: the optimizer's own, checked when set
        model = self._take_ranks(model, optimizer)
        self.model, self.optimizer, self.inner, self.criterion = model, optimizer, inner, criterion
        self.regional = use_regions(model, regions)
        """Whether the step compiles each kind of param update once, as a region (see
        compile_step's `regions`)."""
        self.max_norm = float(max_norm)
        self.lean = optimizer.lean if wrapped else None
        """The optimizer's lean write-back (stochastic rounding, state format), run in the
        graph; None: torch's own."""
        # one accounting: the optimizer's StepCounter, which counts its eager steps too
        self.counts = optimizer.counts if wrapped else StepCounter(None)
        _count_inner_steps(inner)
        self.joins: list[JoinedGroup] = []
        """Each param group's joined params (compiled_join), updated as one per chunk."""
        self._plan()
        device = self.hp[0].device if self.hp else torch.device("cpu")
        self.device_type = device.type
        self.device = device
        self._unit = _UnitScale(device)
        owner = _scale_owner(optimizer, scaler)
        self.scaler: ScaleRule = self._unit if owner is None else owner
        """Whose loss scale the step runs under and advances, by that scaler's own rule."""
        self._step_rule: ScaleRule = self._unit  # this step's: the scaler, or unit while it is off
        self._step_scale: torch.Tensor | None = None  # the scale tensor this step runs under
        self._hp_key: tuple | None = None  # the host values self._hp_tensors holds
        self._hp_tensors: list[torch.Tensor] = []
        self._step_record = StepRecord(check_every, device)  # made now: the graph writes it
        self.check_every = self._step_record.check_every
        """Steps between the host's reads of the skip record (each read is one host sync)."""
        self._unreported = 0  # skips read since the last sync_counters() call
        self._count: Count = optimizer.count_recorded_step if wrapped else self._count_plain
        self._regions: dict[tuple, Callable[..., tuple[torch.Tensor, ...]]] = {}
        self._flags_seen: set[tuple] = set()  # the group flags _make_regions has run for
        self._compiled = None
        self._early_builds = False  # set by _compile: the next call compiles
        self._plain_options: dict[str, Any] | None = None  # a second try, without CPU options
        self._quiet_torch_deprecations = False  # set once one of them stopped a compile
        self.compile_options: dict[str, Any] | None = None
        """What torch.compile was given (None: the step runs eagerly)."""
        if compile:
            self._compile_first(compile_options)

    def _take_ranks(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        """The ranks the step's found-inf (and, under DDP, gradient) reductions span; the
        model the graph runs (a DDP model's module: the step averages the grads itself, as
        DDP's reducer would, which never runs here)."""
        group: ProcessGroup | None = getattr(optimizer, "process_group", None)
        self.average_grads = isinstance(model, nn.parallel.DistributedDataParallel)
        if self.average_grads:
            group = group or model.process_group
            model = model.module
        self.process_group = group or default_group()
        return model

    def _compile_first(self, compile_options: dict[str, Any]) -> None:
        """Compile with the caller's options (fullgraph, static shapes by default) plus, on
        CPU, CPU_FUSION_OPTIONS and, for one graph of at most CPU_WRAPPER_MAX_TENSORS trained
        tensors, CPU_INDUCTOR_OPTIONS; the caller's alone are kept for a second try. Inductor's
        C++ set-up starts now on a thread (inductor_warmup)."""
        options = {"fullgraph": True, "dynamic": False, **compile_options}
        inductor_warmup.start(self.device_type, options)  # runs while the first call traces
        wrapper = not self.regional and len(self.hp) <= CPU_WRAPPER_MAX_TENSORS
        self.compile_options = _with_cpu_options(options, self.device_type, wrapper)
        if self.compile_options is not options:
            self._plain_options = options
        self._compiled = self._compile()

    def _compile(self) -> Callable[..., torch.Tensor]:
        """torch.compile of this object's own copy of _run. dynamo keys its cache (and its
        recompile limit, 8) by code object: with one shared _run every compile_step in a process
        filled one cache, guarded on `self`, and the ninth ran eagerly. A fresh code object per
        step object gives each its own cache: one entry per step object and input shape."""
        run = CompiledStep._run
        code = run.__code__.replace(co_name=f"_run_{id(self):x}")
        fresh = types.FunctionType(code, run.__globals__, code.co_name, run.__defaults__)
        # its first call compiles: inductor's CPU builds start as it defines each kernel
        self._early_builds = inductor_warmup.applies(self.device_type, self.compile_options)
        return torch.compile(types.MethodType(fresh, self), **self.compile_options)

    @property
    def scale(self) -> torch.Tensor | None:
        """The loss scale the latest step ran under (the scaler's live tensor, 1.0 while it
        is off; no sync); None before the first step."""
        return self._step_scale

    def _take_scale(self) -> None:
        """Host side, before each step, where an eager loop calls scale(): the scaler says
        whether it scales this step (a Paddle scaler switches itself off under bf16 here)."""
        scale = self.scaler.active_scale()
        self._step_rule = self._unit if scale is None else self.scaler
        self._step_scale = self._unit.scale_tensor if scale is None else scale

    def _plan(self) -> None:
        """Match each param the optimizer steps to the model param that gets its gradient."""
        master_to_lp = {}
        if isinstance(self.optimizer, MixedPrecisionOptimizer):
            master_to_lp = self.optimizer.transfer.master_to_lp()
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.train_names: list[str] = []  # model param names, in optimizer order
        self.hp: list[torch.Tensor] = []  # what the optimizer steps (fp32 master, or the param)
        self.lp: list[torch.Tensor | None] = []  # the model's lp twin of a master, else None
        self.states: list[list[torch.Tensor]] = []
        self.param_index: list[int] = []  # each hp's place in param_groups (its rounding key)
        self._param_count = sum(len(g["params"]) for g in self.inner.param_groups)
        zeros = sm.torch_zeros if self.lean is None else self.lean.zeros
        place = -1
        self.group_of: list[int] = []
        for index, group in enumerate(self.inner.param_groups):
            plan = GroupPlan.of(self.inner, group)
            for hp in group["params"]:
                place += 1
                lp = master_to_lp.get(id(hp))
                held = hp if lp is None else lp
                if not held.requires_grad:
                    continue
                name = names.get(id(held))
                if name is None:
                    raise CompileStepError(
                        f"The optimizer steps a parameter of shape {tuple(held.shape)} that is "
                        "not in model.named_parameters(): pass the model the face returned with "
                        "this optimizer."
                    )
                self.train_names.append(name)
                self.hp.append(hp)
                self.lp.append(lp)
                state = _init_state(plan, self.inner.state[hp], hp, zeros)
                # torchao's low-bit state as its plain codes and scales (qstate's operands, the
                # same memory): read, quantized and kept on a skip with torch.where in the graph
                self.states.append(
                    [qstate.unpack(t) if qstate.is_quantized(t) else t for t in state]
                )
                self.param_index.append(place)
                self.group_of.append(index)
        # the live params, in optimizer order, looked up once: a step walks no module tree
        params = dict(self.model.named_parameters())
        self._train = [params[name] for name in self.train_names]
        self._join_groups()
        self._planned = self._state_key()
        self._steps_seen = self._steps_taken()  # the steps the plan saw

    def _steps_taken(self) -> int:
        """Steps taken by any path: the optimizer's count (its eager steps and this object's)
        plus the inner optimizer's own step() calls."""
        return self.counts.steps + _INNER_STEPS.get(self.inner, 0)

    def _state_now(self, i: int) -> list[Any]:
        """Param i's state tensors as the optimizer holds them now (the plan's keys)."""
        state = self.inner.state.get(self.hp[i], {})
        keys = ("step", "exp_avg", "exp_avg_sq") if "exp_avg" in state else ("momentum_buffer",)
        return [state[k] for k in keys if k in state]

    def _state_key(self) -> tuple:
        """What the plan holds, as ids and data pointers of every hp and state tensor: a
        loaded state_dict (new tensors) or a moved one changes it (host only, no sync)."""
        key = []
        for i, hp in enumerate(self.hp):
            key += [id(hp), hp.data_ptr()]
            for t in self._state_now(i):
                key += [id(t), t.data_ptr() if type(t) is torch.Tensor else 0]
        return tuple(key)

    def _join_groups(self) -> None:
        """Join each group's joinable params (compiled_join): one update per group in the
        graph. A join that still holds the same tensors is kept (no copy, no recompile); one
        whose Adam counts differ is not made (one host sync per group, at planning only)."""
        old = {tuple(j.members): j for j in self.joins}
        self.joins = []
        block_of = {  # each param of a repeated block -> its block (a chunk stays in one)
            id(p): id(block)
            for blocks in repeated_blocks(self.model)
            for block in blocks
            for p in block.parameters()
        }
        for g, group in enumerate(self.inner.param_groups):
            kind = GroupPlan.of(self.inner, group).kind
            members = [
                i
                for i, index in enumerate(self.group_of)
                if index == g and joinable(self.hp[i], self.lp[i], self.states[i])
            ]
            if len(members) < compiled_join.MIN_MEMBERS or self.lean is not None or self.regional:
                continue
            hp = [self.hp[i] for i in members]
            states = [self.states[i] for i in members]
            kept = old.pop(tuple(members), None)
            if kept is not None and kept.holds(hp, states):
                self.joins.append(kept)
                continue
            if kind == "adam" and not counts_equal([st[0] for st in states]):
                continue
            lp = [self.lp[i] for i in members]
            blocks = [block_of.get(id(self._train[i])) for i in members]
            self.joins.append(JoinedGroup(g, kind, members, hp, lp, states, blocks))
        joined = {i for j in self.joins for i in j.members}
        self.solo = [i for i in range(len(self.hp)) if i not in joined]
        """The params updated one by one (not in a joined group)."""

    def _keep_plan(self) -> None:
        """Host side, before each step: plan again if the optimizer's tensors changed (a
        loaded state_dict); after steps this object did not take, release a joined group whose
        Adam counts are no longer equal (one sync, only then)."""
        if self._state_key() != self._planned:
            self._replan()
            return
        if self._steps_taken() == self._steps_seen or not self.joins:
            return
        self._steps_seen = self._steps_taken()
        unequal = [j for j in self.joins if not j.counts_equal()]
        if unequal:
            for j in unequal:
                j.release()
            self._replan()

    def _replan(self) -> None:
        """_plan again; the per-param updates are looked up again for the params now solo."""
        self._plan()
        self._flags_seen.clear()

    def _hparams(self) -> tuple[list[torch.Tensor], tuple[tuple[str, tuple[bool, ...]], ...]]:
        """Each group's values (GroupPlan.values) as an fp64 tensor on the params' device, and
        its kernel kind and flags.

        The values enter the graph as tensors, so an LR schedule (or a changing weight decay,
        betas, eps) recompiles nothing; the graph reads no param_group (dynamo guards every
        value of a dict it reads: each new lr recompiled). A tensor is rebuilt only when its
        values changed (written on the device, no sync). The kind and flags pick code paths (a
        zero weight decay skips its term): they are guarded constants, a change recompiles.
        """
        plans = [GroupPlan.of(self.inner, group) for group in self.inner.param_groups]
        key = tuple(plan.values for plan in plans)
        if key != self._hp_key:
            self._hp_tensors = [
                # made on the params' device (a host->device write of the values, no sync)
                torch.tensor(values, dtype=torch.float64, device=self.device)
                for values in key
            ]
            self._hp_key = key
        return self._hp_tensors, tuple((plan.kind, plan.flags) for plan in plans)

    # ----- the step: everything below runs inside the compiled graph -----
    def _run(
        self,
        params: list[torch.Tensor],
        hparams: list[torch.Tensor],
        flags: tuple[tuple[str, tuple[bool, ...]], ...],
        inputs: tuple[Any, ...],
        target: Any,
    ) -> torch.Tensor:
        with torch.enable_grad():  # the model's own leaves; buffers (BatchNorm) update in place
            loss = self.criterion(self.model(*inputs), target)
        # The caller's autocast and op lists end at the loss, as in an eager loop: scaling,
        # backward and the update are fp32 math (a white-listed 'mul' must not round them).
        with fp32_region(self.device_type):
            return self._backward_and_update(params, hparams, flags, loss)

    def _backward_and_update(
        self,
        params: list[torch.Tensor],
        hparams: list[torch.Tensor],
        flags: tuple[tuple[str, tuple[bool, ...]], ...],
        loss: torch.Tensor,
    ) -> torch.Tensor:
        scale = self._step_scale.reshape(1)
        scale_used = scale.float().clone()  # the scaler's rule writes `scale` in place below
        inv_scale = sm.inverse_scale(scale)
        with torch.enable_grad():
            # materialize: a param the loss does not reach gets zeros, as the eager path's
            grads = torch.autograd.grad(
                (loss.float() * scale).sum(), params, materialize_grads=True
            )
        loss = loss.detach()
        if self.average_grads:
            grads = self._all_reduce_grads(grads)
        joined = [j.gather(grads) for j in self.joins]  # each chunk's flat gradient
        flat = [g for chunks in joined for g in chunks]
        checked = [grads[i] for i in self.solo] + flat  # each grad once: its own, or its chunk's
        # The largest unscaled |g|: the scaled grads' max times inv_scale, the same value as the
        # max of each product (rounding is monotonic: inf or nan when any product is), one
        # multiply where each element took one. Their max, not torch.stack: inductor writes each
        # stacked amax into its slot from the kernel that reduces it, an offset of its own in
        # every block's kernel, so identical blocks stopped sharing their kernels.
        amaxes = [sm.grad_amax(g) for g in checked]
        amax = functools.reduce(torch.maximum, amaxes) * inv_scale if amaxes else inv_scale
        found_inf = sm.found_inf(amax).reshape(1)
        found_inf = self._all_reduce_max(found_inf)
        skip = found_inf > 0
        clip, total = torch.ones_like(inv_scale), None
        if self.max_norm > 0 and grads:
            # core/clip's norm over each grad (traced, no graph break); only a clip reads them
            total = total_grad_norm([g.float() * inv_scale for g in grads])
            clip = sm.clip_coefficient(self.max_norm, total).reshape(1)
        head = [inv_scale, clip]
        keep = (~skip).float()
        keys = None
        if self.lean is not None and self.lean.cfg.rounding == "stochastic":
            # the eager write-back's stream (step_math.rounding_keys), advanced unless skipped
            counter = self.lean.counter
            keys = sm.rounding_keys(self.lean.seed, counter, self._param_count)
            counter.copy_(counter + keep.reshape(()).to(counter.dtype))
        for i in self.solo:
            g = self.group_of[i]
            key = None if keys is None else keys[self.param_index[i]]
            self._update(i, grads[i], head, hparams[g], keep, skip, flags[g], key)
        clipping = self.max_norm > 0
        for join, grad in zip(self.joins, joined, strict=True):
            g = join.group
            join.update(grad, head, hparams[g], keep, skip, flags[g], clipping)
        self._step_rule.advance_(found_inf)
        self._step_record.write(found_inf, scale_used, total)  # a device cursor: no guard, no sync
        return loss.reshape(())

    def _update(self, i, grad, head, h, keep, skip, flags, key) -> None:
        """Step param i: its new values from its kind's update region (_update_values, traced
        and compiled once per kind), then written in place here, outside the region."""
        hp, lp, state = self.hp[i], self.lp[i], self.states[i]
        flat = [x for t in state for x in (t if isinstance(t, tuple) else (t,))]
        twin = [] if lp is None else [lp]
        operands = [grad, hp, *twin, *flat, h, *head, keep, skip, *([] if key is None else [key])]
        values = self._regions[self._spec(i, flags)](*operands)
        # what _update_values writes, in its order: qstate.writes' targets (a plain operand,
        # or a quantized one's codes and scale) of each moment, hp, lp, then Adam's step
        step = [state[0]] if flags[0] == "adam" else []
        moments = state[len(step) :]
        targets = [x for t in moments for x in (t[:2] if isinstance(t, tuple) else (t,))]
        for old, value in zip([*targets, hp, *twin, *step], values, strict=True):
            old.copy_(value)

    def _spec(self, i: int, flags: tuple[str, tuple[bool, ...]]) -> tuple:
        """What param i's update code depends on: its group's kind and flags, clipping, its
        state's parts, whether it rounds stochastically, and hp's shape and dtype and lp's."""
        hp, lp, state = self.hp[i], self.lp[i], self.states[i]
        parts = tuple(len(t) if isinstance(t, tuple) else 0 for t in state)
        keyed = self.lean is not None and self.lean.cfg.rounding == "stochastic"
        lp_dtype = None if lp is None else lp.dtype
        return (flags, self.max_norm > 0, parts, keyed, tuple(hp.shape), hp.dtype, lp_dtype)

    def _make_regions(self, flags: tuple[tuple[str, tuple[bool, ...]], ...]) -> None:
        """Host side, once per set of group flags: each kind of param's update as one nested
        compile region (torch.compiler.nested_compile_region: made outside the graph, as
        dynamo refuses to trace the call that makes it), so the graph compiles each kind's
        update once and every param of that kind calls the same code."""
        if flags in self._flags_seen:
            return
        for i in self.solo:
            spec = self._spec(i, flags[self.group_of[i]])
            if spec in self._regions:
                continue
            update = _update_of(spec)
            if self.regional:
                key = _constant(len(self._regions))
                update = torch.compiler.nested_compile_region(update, reuse_hash_fn=key)
            self._regions[spec] = update
        self._flags_seen.add(flags)

    def _all_reduce_max(self, flag: torch.Tensor) -> torch.Tensor:
        group = self.process_group
        if group is None or torch.distributed.get_world_size(group) == 1:
            return flag
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(flag, "max", group)  # a traceable collective: stays on device

    def _all_reduce_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        from torch.distributed import _functional_collectives as funcol

        world = torch.distributed.get_world_size(self.process_group)
        return [funcol.all_reduce(g, "sum", self.process_group) / world for g in grads]

    # ----- the host side: a few dict lookups, no sync -----
    def __call__(self, *inputs: Any, target: Any = _LAST) -> torch.Tensor:
        """One step on model(*inputs) against target (keyword, or the last positional)."""
        if target is _LAST:
            if len(inputs) < 2:
                raise TypeError(
                    f"step(*inputs, target) got {len(inputs)} positional argument(s): pass the "
                    "model's inputs and then the target (or target=...)."
                )
            *inputs, target = inputs
        self._keep_plan()
        self._take_scale()
        hparams, flags = self._hparams()
        self._make_regions(flags)
        args = (self._train, hparams, flags, tuple(inputs), target)
        with torch.no_grad():  # _run enables grad for forward and backward; the writes need none
            loss = self._step(args)
        self.counts.steps += 1
        self._steps_seen = self._steps_taken()
        self._step_record.step_done(self._count_row, has_norm=self._records_norm)
        return loss

    def _step(self, args: tuple[Any, ...]) -> torch.Tensor:
        """The compiled step. If compiling fails: once more with torch's own deprecations ignored
        (when one of them, made an error, was the cause) or without the CPU options, then the
        same step eagerly (a compile error comes before the graph runs: nothing is written).
        The first call of each compiled function compiles with inductor_warmup.early_builds."""
        while self._compiled is not None:
            quiet = self._quiet_torch_deprecations
            try:
                with (
                    _TRACE_AUTOGRAD_GRAD,
                    scopes_set_aside(),
                    _torch_deprecations_ignored() if quiet else _NO_SCOPE,
                    inductor_warmup.early_builds() if self._early_builds else _NO_SCOPE,
                ):
                    loss = self._compiled(*args)
                self._early_builds = False
                return loss
            except Exception as exc:  # a missing compiler or an untraceable model
                self._compile_failed(exc)
        return self._run(*args)

    def _compile_failed(self, exc: Exception) -> None:
        why = " ".join(str(exc).split())[:400]  # one line, the cause up front
        deprecation = isinstance(exc, DeprecationWarning) or why.startswith("DeprecationWarning:")
        if deprecation and not self._quiet_torch_deprecations:
            log.info(
                "mixprec.compile_step: torch's own deprecation warning (%s...) became an error "
                "under your warning filters; compiling again with torch's DeprecationWarnings "
                "ignored.",
                why[:160],
            )
            self._quiet_torch_deprecations = True
            self._compiled = self._compile()
            return
        if self.regional:
            log.info(
                "mixprec.compile_step: compiling with update regions failed (%s: %s); "
                "compiling the whole step as one graph.",
                type(exc).__name__,
                why,
            )
            self.regional = False
            seen = list(self._flags_seen)  # the updates again, as plain functions
            self._regions.clear()
            self._flags_seen.clear()
            for flags in seen:
                self._make_regions(flags)
            self._compiled = self._compile()
            return
        if self._plain_options is not None:
            log.info(
                "mixprec.compile_step: compiling with %s failed (%s: %s); compiling without them.",
                self.compile_options.get("options"),
                type(exc).__name__,
                why,
            )
            self.compile_options, self._plain_options = self._plain_options, None
            self._compiled = self._compile()
            return
        self._compiled = self.compile_options = None
        warnings.warn(
            f"mixprec.compile_step: the step did not compile ({type(exc).__name__}: {why}); "
            "running the same step eagerly from now on.",
            RuntimeWarning,
            stacklevel=4,
        )

    @property
    def compiled(self) -> bool:
        """False once compiling failed and the step runs eagerly."""
        return self._compiled is not None

    @property
    def _records_norm(self) -> bool:
        """Whether each step's row carries the clip's grad norm (a host fact)."""
        return self.max_norm > 0 and bool(self.hp)

    def _read_record(self) -> None:
        """Read the steps recorded on the device (one host sync) and count them as the eager
        step does: steps, skips, the skip monitor's messages, the consecutive-skip guard."""
        self._step_record.read(self._count_row)

    def _count_row(self, skipped: bool, scale: float, grad_norm: float | None) -> None:
        """One recorded step into the counts (the optimizer's own counting, or _count_plain)."""
        self._unreported += skipped
        self._count(skipped, scale, grad_norm)

    def _count_plain(self, skipped: bool, scale: float, grad_norm: float | None) -> None:
        """A recorded step of a plain torch optimizer: counted, the skip monitor's message
        logged on rank 0 (no consecutive-skip limit: a plain optimizer sets none)."""
        result = StepResult(skipped=skipped, scale=scale, grad_norm=grad_norm, num_zeros=None)
        message = self.counts.record(result)
        if message and rank_and_world()[0] == 0:
            log.warning(message)

    @property
    def skip_stats(self) -> SkipStats:
        """Steps, skipped steps (in a row, in the warm-up), the last scale: reads the device
        record first (one host sync)."""
        self._read_record()
        if isinstance(self.optimizer, MixedPrecisionOptimizer):
            return self.optimizer.skip_stats  # its own sync-free steps' record read too
        return self.counts.stats()

    def sync_counters(self) -> int:
        """Read the device record (a host sync) into the counts (optimizer.skipped_steps,
        steps, consecutive_skips); returns the steps skipped since the last call."""
        self._read_record()
        skipped, self._unreported = self._unreported, 0
        return skipped


def _with_cpu_options(options: dict[str, Any], device_type: str, wrapper: bool) -> dict[str, Any]:
    """options plus CPU_FUSION_OPTIONS (and, with wrapper, CPU_INDUCTOR_OPTIONS) under
    `options`, for inductor on CPU without a `mode` (torch.compile takes mode or options, not
    both); the same dict otherwise."""
    if (
        device_type != "cpu"
        or options.get("backend", "inductor") != "inductor"
        or "mode" in options
    ):
        return options
    cpu = {**CPU_FUSION_OPTIONS, **(CPU_INDUCTOR_OPTIONS if wrapper else {})}
    return {**options, "options": {**cpu, **options.get("options", {})}}


def compile_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: Callable[..., torch.Tensor],
    *,
    max_norm: float | None = None,
    scaler: Any = None,
    compile: bool = True,
    check_every: int = 32,
    regions: Any = False,
    **compile_options: Any,
) -> CompiledStep:
    """The whole training step of any face, compiled: `loss = step(*inputs, target=y)`.

    model, optimizer, criterion: what convert_to_amp / initialize / Booster.boost /
        mixprec.apex.amp.initialize / mixprec.paddle.decorate returned (or a plain fp32 model
        and torch optimizer). A DistributedDataParallel model is unwrapped: the step averages
        the grads over its process group itself.
    max_norm: clip the unscaled grads to this total norm (None: the optimizer's own max_norm).
    scaler: a mixprec.GradScaler (e.g. mixprec.paddle.GradScaler) when the loss scale lives
        outside the optimizer, as in Paddle's dygraph loop; None otherwise. Each call asks it
        for this step's scale (scaling.ScaleRule.active_scale) where a loop calls scale(): a
        disabled scaler, or a Paddle one switched off under a bfloat16 auto_cast, runs the step
        unscaled, as the eager loop does.
    compile: False runs the same step eagerly (a reference, and the fallback when compiling
        fails, which warns once).
    check_every: steps between the host's reads of the on-device skip record (one sync each):
        skip counts, the skip monitor's reports and ScaleCollapseError arrive then, or when
        step.sync_counters() / step.skip_stats is read.
    regions: False (default): one graph, each param group's update joined (see the module
        docstring: the update does not grow with the param count; a lean write-back steps param
        by param). "auto": when the model repeats blocks (two or more children of an
        nn.Sequential / nn.ModuleList with one class and the same parameter names, shapes and
        dtypes: mixprec.core.compile_regions.repeated_blocks), each kind of param update (group
        flags, shape, dtypes, state format) is a nested compile region, compiled once and
        called once per param of that kind, joining nothing (for lean steps, which cannot
        join; each step runs slower: the regions' results are copied into place, no fusion
        across params); True: update regions whatever the model. With regions, or more than
        CPU_WRAPPER_MAX_TENSORS trained tensors, the step compiles without
        CPU_INDUCTOR_OPTIONS. The values are the same either way (the same step_math). Should
        compiling with regions fail, the step compiles once more as one graph.
    compile_options: passed to torch.compile (mode="reduce-overhead" for CUDA graphs,
        backend=...); fullgraph=True and dynamic=False unless given. On CPU with inductor and
        no mode, CPU_FUSION_OPTIONS and CPU_INDUCTOR_OPTIONS (the C++ wrapper: see `regions`)
        join `options`, yours winning; the step's compile_options attribute shows what
        torch.compile got. With inductor on CPU, building the step starts inductor's C++
        set-up on a thread, and the first call starts each kernel's build as inductor defines
        it (mixprec.core.inductor_warmup).
    """
    return CompiledStep(
        model,
        optimizer,
        criterion,
        max_norm=max_norm,
        scaler=scaler,
        compile=compile,
        compile_options=compile_options,
        check_every=check_every,
        regions=regions,
    )
