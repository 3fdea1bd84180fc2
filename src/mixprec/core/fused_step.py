"""The fused master-weight step: one read-only overflow check, then one pass per tensor.

The unfused step moves every low-precision gradient through four passes (copy to an fp32
master grad, unscale + check in place, the optimizer's own update, copy the master back to the
lp param): about 32 bytes per param for SGD where a plain fp32 step moves 12. Here a
torch.compile'd kernel per tensor reads the lp grad, unscales (and clips) it in registers,
updates the fp32 master and the optimizer state, and writes the master and the lp param, after a
check pass that only reads the lp grads (2 bytes per param). No fp32 master grads are ever
allocated, which also lowers peak memory by 4 bytes per lp param.

Numerics are the optimizer's own, op for op (torch's foreach SGD/Adam/AdamW with their
scalars as fp32); the compiled kernel may contract a*b + c into one fused multiply-add, so
results can differ from the unfused step in the last bit, never more.

Supported: torch.optim.SGD, Adam and AdamW (not amsgrad, differentiable or capturable), with
no step hooks. Anything else takes the unfused path, which supports every optimizer.

The same kernels run mixprec.core.lean's write-back (`update`): a param without a master is
read as fp32, updated and written back in its own dtype (bf16 with stochastic rounding in the
kernel, its noise from step_math.rounding_noise), and torchao's quantized state is dequantized
and quantized again inside the kernel. The math is mixprec.core.step_math's.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any

import torch

from mixprec.core import qstate
from mixprec.core import step_math as sm
from mixprec.core.step_plan import GroupPlan

log = logging.getLogger("mixprec")

AUTO_MIN_ELEMENTS = 1 << 25
"""fused_step=None fuses CPU steps over at least this many elements (~34M). Compiling costs
seconds and ~150 MiB of host memory once (torch.compile's machinery); above this size the
fp32 master grads it never allocates (4 bytes per element) outweigh that, and the step itself
gets faster (AdamW at seed 002's size: 0.53 s -> 0.13 s). On CUDA it stays opt-in: each
per-tensor launch costs ~30 us of Python, which can exceed torch's multi-tensor kernels."""

SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def unsupported_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the fused step cannot run this optimizer, or None when it can."""
    if type(optimizer) not in SUPPORTED:
        names = ", ".join(c.__name__ for c in SUPPORTED)
        return f"{type(optimizer).__name__} has no fused master step (supported: {names})"
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return "the optimizer has step hooks, which only its own step() runs"
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "differentiable", "capturable"):
            if group.get(flag):
                return f"{flag}=True"
        for key in ("lr", "momentum", "weight_decay", "dampening"):
            if isinstance(group.get(key), torch.Tensor):
                return f"{key} is a Tensor"
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (same storage), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a (local shard of a) tensor: every kernel is elementwise."""
    return _local(t).view(-1)


STATIC = "static shapes"
"""A variant marked so (its last element: the args' shapes) compiles for exactly those shapes,
without inductor's bounds check of each indirect load: its kernels (quantized state, see
update) index only qstate's tables and code maps, with indices in range by construction."""


@functools.cache
def _compiled(fn: Callable[..., Any], variant: tuple) -> Callable[..., Any]:
    """fn compiled for one variant (flags and dtypes) in a copy with its own code object.

    Dynamo caches graphs per code object and stops compiling after 8 (recompile_limit); one
    code object per variant keeps each cache to its few size-specialised graphs. A STATIC
    variant carries its shapes, so each shape is its own variant: its own code object, one
    graph, no recompile limit to reach.
    """
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)
    if STATIC in variant:
        # the checks cost ~15% of a quantized kernel (measured 22 -> 19 ns an element)
        options = {"assert_indirect_indexing": False}
        return torch.compile(copy, dynamic=False, fullgraph=True, options=options)
    return torch.compile(copy, dynamic=True, fullgraph=True)


_failed = False  # set once compilation failed on this machine (e.g. no C++ compiler)


def _run(fn: Callable[..., Any], variant: tuple, *args: Any) -> Any:
    """Run fn's compiled variant; if compiling fails, say so once and run fn eagerly (same math)."""
    global _failed
    if not _failed:
        try:
            return _compiled(fn, variant)(*args)
        except Exception as exc:  # a missing compiler or backend surfaces as many types
            _failed = True
            log.warning(
                "mixprec: fused optimizer step could not compile (%s); running it eagerly", exc
            )
    return fn(*args)


# ----- the check pass (step_math's read, one compiled kernel per grad) -----
def check_grads(grads: list[torch.Tensor], inv_scale: torch.Tensor, norm: bool) -> torch.Tensor:
    """[found_inf (1.0 or 0.0), total norm of the unscaled grads (0 unless norm)], on device."""
    if norm:
        stats = torch.stack(
            [_run(sm.grad_stats, _variant("stats", g), _flat(g), inv_scale) for g in grads]
        )
        amaxes, sum_sq = stats[:, 0], stats[:, 1].sum()
    else:
        amaxes = torch.stack([_run(sm.grad_amax, _variant("max", g), _flat(g)) for g in grads])
        sum_sq = torch.zeros((), device=inv_scale.device)
    return torch.stack([sm.found_inf(amaxes), sum_sq.sqrt()])


# ----- the update kernels: step_math's updates, one compiled kernel per tensor -----
# Scalars arrive as one fp32 tensor s (no recompile as the LR changes); the flags are constants
# of each compiled variant, so terms torch's optimizer would skip cost nothing here either.
# hp is what the optimizer steps: an fp32 master (its lp twin then gets the new value too), or a
# lean param of any dtype (no master) written back by _write; `.float()` of fp32 is a no-op.
def _write(hp, new, key, stochastic):
    """new (fp32) into hp: to bf16 with stochastic rounding (noise from key), else a cast. key:
    one tensor's 0-d key, or for tensors stepped together in one flat buffer (lean's batches)
    a [2, n] int32 tensor of each element's key and its index in its own tensor."""
    if stochastic:
        if key.dim() == 0:
            noise = sm.rounding_noise(key, new.shape)
        else:
            noise = sm.rounding_noise(key[0], new.shape, index=key[1])
        new = sm.round_bf16_stochastic(new, noise)
    hp.copy_(new)


def _sgd(hp, lp, grad, s, key, clip, maximize, decay, stochastic):
    new = sm.sgd_update(hp.float(), sm.unscaled(grad, s, clip, maximize), s, decay)
    _write(hp, new, key, stochastic)
    if lp is not None:
        lp.copy_(new)


def _sgd_momentum(hp, lp, grad, buf, s, key, clip, maximize, decay, nesterov, stochastic):
    g = sm.unscaled(grad, s, clip, maximize)
    new, b = sm.sgd_momentum_update(hp.float(), g, qstate.read(buf), s, decay, nesterov)
    qstate.write(buf, b)
    _write(hp, new, key, stochastic)
    if lp is not None:
        lp.copy_(new)


def _adam(hp, lp, grad, exp_avg, exp_avg_sq, s, key, clip, maximize, decay, decoupled, stochastic):
    g = sm.unscaled(grad, s, clip, maximize)
    m, v = qstate.read(exp_avg), qstate.read(exp_avg_sq)
    new, m, v = sm.adam_update(hp.float(), g, m, v, s, decay, decoupled)
    qstate.write(exp_avg, m)
    qstate.write(exp_avg_sq, v)
    _write(hp, new, key, stochastic)
    if lp is not None:
        lp.copy_(new)


KERNELS = {"sgd": _sgd, "sgd_momentum": _sgd_momentum, "adam": _adam}


def update(
    kind: str,
    hp: torch.Tensor,
    grad: torch.Tensor,
    state: list[torch.Tensor],
    s: torch.Tensor,
    flags: tuple[bool, ...],
    *,
    lp: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    compiled: bool = True,
) -> None:
    """One tensor's update in its compiled kernel (kind: sgd, sgd_momentum or adam): hp and its
    state (any float dtype, or torchao's quantized state: dequantized in the kernel, quantized
    again by its copy_) written in place; key: the stochastic rounding's key
    (step_math.rounding_keys) for a bf16 hp, None for round to nearest. compiled=False runs
    the same kernel function eagerly (no compile: a small step, see LeanUpdate)."""
    stochastic = key is not None
    kinds = tuple((type(t).__name__, t.dtype) for t in (hp, *state))
    per_element_keys = stochastic and key.dim() > 0
    variant = (*_variant(kind, grad, lp, *flags, stochastic, per_element_keys), *kinds)
    # torchao's quantized state enters the kernel as its plain codes, scales and tables
    args = (_flat(hp), _opt(lp), _flat(grad), *(qstate.unpack(_local(t)) for t in state), s, key)
    if any(qstate.is_quantized(t) for t in state):
        # Compiled for its exact shapes: with symbolic ones inductor's code for the block-wise
        # (de)quantize (the block a symbolic numel // blocks) ran ~2x slower (GPT of
        # bench_lean: int8 step 18 -> 9 ms). Each size compiles once; the step's layout, and so
        # its sizes, repeat every step.
        tensors = [a for arg in args for a in (arg if isinstance(arg, tuple) else (arg,))]
        shapes = tuple(tuple(a.shape) for a in tensors if isinstance(a, torch.Tensor))
        variant = (*variant, STATIC, shapes)
    if compiled:
        _run(KERNELS[kind], variant, *args, *flags, stochastic)
    else:
        KERNELS[kind](*args, *flags, stochastic)


def _variant(name: str, grad: torch.Tensor, lp: torch.Tensor | None = None, *flags: bool) -> tuple:
    return (name, grad.dtype, lp is not None, grad.numel() == 1, *flags)


def fused_step(
    optimizer: torch.optim.Optimizer,
    master_to_lp: dict[int, torch.Tensor],
    inv_scale: torch.Tensor,
    clip: torch.Tensor | None,
) -> None:
    """Step `optimizer` (SGD/Adam/AdamW over fp32 masters) from the lp params' grads.

    master_to_lp maps id(master) to its lp param, whose .grad is this step's gradient; params
    without an lp twin (fp32 params) use their own .grad. inv_scale and clip (None: no
    clipping) are fp32 device scalars applied in that order, as the unfused unscale-then-clip.
    """
    one = torch.ones(1, device=inv_scale.device)
    head = [inv_scale.reshape(1), one if clip is None else clip.reshape(1)]
    for group in optimizer.param_groups:
        items = []
        for p in group["params"]:
            lp = master_to_lp.get(id(p))
            grad = lp.grad if lp is not None else p.grad
            if grad is not None:
                items.append((p, lp, grad))
        if not items:
            continue
        plan = GroupPlan.of(optimizer, group)
        flags = (clip is not None, *plan.flags)
        device = items[0][0].device
        prepared = plan.prepare(optimizer, [hp for hp, _, _ in items], head, device)
        for (hp, lp, grad), (state, s) in zip(items, prepared, strict=True):
            update(plan.kind, hp, grad, state, s, flags, lp=lp)


def _opt(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else _flat(t)
