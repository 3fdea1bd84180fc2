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
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any

import torch

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


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of a (local shard of a) tensor: every kernel is elementwise."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.view(-1)


@functools.cache
def _compiled(fn: Callable[..., Any], variant: tuple) -> Callable[..., Any]:
    """fn compiled for one variant (flags and dtypes) in a copy with its own code object.

    Dynamo caches graphs per code object and stops compiling after 8 (recompile_limit); one
    code object per variant keeps each cache to its few size-specialised graphs.
    """
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)
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


# ----- the check pass -----
def _grad_max(grad: torch.Tensor) -> torch.Tensor:
    """max |g| of one grad (nan if it holds a nan), read once."""
    return grad.abs().amax().float()


def _grad_stats(grad: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """[max |g|, sum of the unscaled g squared] of one grad, read once (for clipping)."""
    g = grad.float()
    unscaled = g * inv_scale
    return torch.stack([g.abs().amax(), (unscaled * unscaled).sum()])


def check_grads(grads: list[torch.Tensor], inv_scale: torch.Tensor, norm: bool) -> torch.Tensor:
    """[found_inf (1.0 or 0.0), total norm of the unscaled grads (0 unless norm)], on device."""
    if norm:
        stats = torch.stack(
            [_run(_grad_stats, _variant("stats", g), _flat(g), inv_scale) for g in grads]
        )
        amaxes, sum_sq = stats[:, 0], stats[:, 1].sum()
    else:
        amaxes = torch.stack([_run(_grad_max, _variant("max", g), _flat(g)) for g in grads])
        sum_sq = torch.zeros((), device=inv_scale.device)
    found_inf = (~torch.isfinite(amaxes)).any().float()
    return torch.stack([found_inf, sum_sq.sqrt()])


# ----- the update kernels -----
# Scalars arrive as one fp32 tensor s (no recompile as the LR changes); the flags are constants
# of each compiled variant, so terms torch's optimizer would skip cost nothing here either.
def unscaled(grad, s, clip: bool, maximize: bool):
    """The grad as the optimizer sees it: s[0] = inv_scale, s[1] = clip coefficient."""
    g = grad.float() * s[0]
    if clip:
        g = g * s[1]
    return -g if maximize else g


def sgd_update(hp, g, s, decay):
    """The new param for SGD without momentum; s = [inv_scale, clip, weight_decay, -lr]."""
    if decay:
        g = g + s[2] * hp
    return hp + s[3] * g


def _sgd(hp, lp, grad, s, clip, maximize, decay):
    new = sgd_update(hp, unscaled(grad, s, clip, maximize), s, decay)
    hp.copy_(new)
    if lp is not None:
        lp.copy_(new)


def sgd_momentum_update(hp, g, buf, s, decay, nesterov):
    """(new param, new buffer) for SGD with momentum; s = [inv_scale, clip, weight_decay, -lr,
    buffer decay, 1 - dampening, momentum]: the buffer decays by momentum, except on the first
    step, which passes decay 0 and 1 - dampening 1 over a zero buffer: torch's buf = grad,
    exactly."""
    if decay:
        g = g + s[2] * hp
    b = buf * s[4] + s[5] * g
    g = g + s[6] * b if nesterov else b
    return hp + s[3] * g, b


def _sgd_momentum(hp, lp, grad, buf, s, clip, maximize, decay, nesterov):
    g = unscaled(grad, s, clip, maximize)
    new, b = sgd_momentum_update(hp, g, buf, s, decay, nesterov)
    buf.copy_(b)
    hp.copy_(new)
    if lp is not None:
        lp.copy_(new)


def adam_update(hp, g, exp_avg, exp_avg_sq, s, decay, decoupled):
    """(new param, exp_avg, exp_avg_sq) for Adam/AdamW; s = [inv_scale, clip, weight_decay,
    1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, bias_correction2_sqrt, eps,
    -step_size] (torch's foreach Adam/AdamW, op for op)."""
    p = hp
    if decay and decoupled:
        p = p * s[3]
    elif decay:
        g = g + s[2] * p
    m = torch.lerp(exp_avg, g, s[4])
    v = exp_avg_sq * s[5] + s[6] * g * g
    denom = v.sqrt() / s[7] + s[8]
    return p + s[9] * (m / denom), m, v


def _adam(hp, lp, grad, exp_avg, exp_avg_sq, s, clip, maximize, decay, decoupled):
    g = unscaled(grad, s, clip, maximize)
    new, m, v = adam_update(hp, g, exp_avg, exp_avg_sq, s, decay, decoupled)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    hp.copy_(new)
    if lp is not None:
        lp.copy_(new)


def _variant(name: str, grad: torch.Tensor, lp: torch.Tensor | None = None, *flags: bool) -> tuple:
    return (name, grad.dtype, lp is not None, grad.numel() == 1, *flags)


def _scalars(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


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
        flags = (clip is not None, bool(group.get("maximize")), group["weight_decay"] != 0)
        if isinstance(optimizer, torch.optim.SGD):
            _sgd_group(optimizer, group, items, head, flags)
        else:
            _adam_group(optimizer, group, items, head, flags)


def _sgd_group(optimizer, group, items, head, flags) -> None:
    momentum = group["momentum"]
    device = items[0][0].device
    base = [group["weight_decay"], -group["lr"]]
    if momentum == 0:
        s = torch.cat([*head, _scalars(base, device)])
        for hp, lp, grad in items:
            args = (_flat(hp), _opt(lp), _flat(grad), s, *flags)
            _run(_sgd, _variant("sgd", grad, lp, *flags), *args)
        return
    flags = (*flags, bool(group["nesterov"]))
    later = [*base, momentum, 1 - group["dampening"], momentum]
    later = torch.cat([*head, _scalars(later, device)])
    first = torch.cat([*head, _scalars([*base, 0.0, 1.0, momentum], device)])
    for hp, lp, grad in items:
        state = optimizer.state[hp]
        buf = state.get("momentum_buffer")
        s = later
        if buf is None:
            buf = state["momentum_buffer"] = torch.zeros_like(hp)
            s = first
        args = (_flat(hp), _opt(lp), _flat(grad), _flat(buf), s, *flags)
        _run(_sgd_momentum, _variant("sgd_momentum", grad, lp, *flags), *args)


def _adam_group(optimizer, group, items, head, flags) -> None:
    beta1, beta2 = group["betas"]
    lr, wd = group["lr"], group["weight_decay"]
    device = items[0][0].device
    decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
    flags = (*flags, bool(decoupled))
    steps = []
    for hp, _, _ in items:
        state = optimizer.state[hp]
        if not state:  # torch's own initial state, so either path can continue the other
            state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
            state["exp_avg"] = torch.zeros_like(hp, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(hp, memory_format=torch.preserve_format)
        steps.append(state["step"])
    torch._foreach_add_(steps, 1.0)
    by_step: dict[float, torch.Tensor] = {}  # params almost always share one step count
    for (hp, lp, grad), step_t in zip(items, steps, strict=True):
        step = step_t.item()
        if step not in by_step:
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
            values = [wd, 1 - lr * wd, 1 - beta1, beta2, 1 - beta2]
            values += [bias_correction2**0.5, group["eps"], -(lr / bias_correction1)]
            by_step[step] = torch.cat([*head, _scalars(values, device)])
        state = optimizer.state[hp]
        args = (_flat(hp), _opt(lp), _flat(grad), _flat(state["exp_avg"]))
        args += (_flat(state["exp_avg_sq"]), by_step[step], *flags)
        _run(_adam, _variant("adam", grad, lp, *flags), *args)


def _opt(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else _flat(t)
