"""Step rules every path shares (the eager, fused and compiled steps, lean, ZeRO, the pipeline).

Written once here so the paths cannot drift apart: a second copy of a rule is how the eager and
compiled steps came to disagree. Every function is plain tensor math, so the same code runs
eagerly, inside fused_step's per-tensor kernels and inside compile_step's whole-step graph:

- the inverse loss scale and the unscale + finite check of the gradients;
- torch's clip_grad_norm_ coefficient (its one epsilon, CLIP_EPS);
- the optimizer scalar vector `s` (hyperparameters, bias corrections, inverse scale and clip
  packed as one fp32 tensor: a new lr recompiles nothing) and torch's initial state;
- the SGD (momentum, dampening, nesterov, weight decay) and Adam/AdamW updates, op for op as
  torch's foreach implementations;
- the write-back into bf16 with stochastic rounding, its noise drawn from a counter-based hash
  of (seed, step counter, tensor, element) so that a compiled graph draws the same bits as the
  eager step with no generator object and no recompile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

CLIP_EPS = 1e-6
"""torch.nn.utils.clip_grad_norm_'s epsilon in max_norm / (total_norm + eps)."""


# ----- loss scale, unscale + check, clip -----
def inverse_scale(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale as fp32, taken in fp64: an fp32 reciprocal can be inexact under some compile
    options, and a power-of-two scale's inverse is then exact (as torch's GradScaler takes it)."""
    return scale.double().reciprocal().float()


def grad_amax(grad: torch.Tensor) -> torch.Tensor:
    """max |g| of one grad as fp32 (inf or nan when it holds one): the finite check's read."""
    return grad.abs().amax().float()


def grad_stats(grad: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """[max |g|, sum of the unscaled g squared] of one grad, read once (check + clip norm)."""
    g = grad.float()
    unscaled = g * inv_scale
    return torch.stack([g.abs().amax(), (unscaled * unscaled).sum()])


def found_inf(amaxes: torch.Tensor) -> torch.Tensor:
    """1.0 if any of the per-grad maxima is inf/nan, else 0.0 (an fp32 device scalar: no sync)."""
    return (~torch.isfinite(amaxes)).any().float()


def clip_coefficient(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """torch's clip_grad_norm_ coefficient, max_norm / (total_norm + CLIP_EPS) clamped at 1 (a
    device tensor: no sync). inf/nan on a step that will be skipped is harmless."""
    return torch.clamp(max_norm / (total_norm + CLIP_EPS), max=1.0)


# ----- the scalar vector s = [inv_scale, clip, *optimizer values] -----
Scalar = float | torch.Tensor


def sgd_scalars(
    lr: Scalar, weight_decay: Scalar, momentum: Scalar, dampening: Scalar, *, first: bool = False
) -> list[Scalar]:
    """SGD's values for s[2:]: [weight_decay, -lr, buffer decay, 1 - dampening, momentum].

    The buffer decays by momentum, except on the step that creates it (first=True): decay 0
    and 1 - dampening 1 over a zero buffer give torch's buf = grad, exactly. Works alike on
    Python floats (the eager and fused steps) and fp64 device tensors (the compiled step)."""
    if first:
        return [weight_decay, -lr, 0.0, 1.0, momentum]
    return [weight_decay, -lr, momentum, 1 - dampening, momentum]


def adam_scalars(
    lr: Scalar, weight_decay: Scalar, beta1: Scalar, beta2: Scalar, eps: Scalar, step: Scalar
) -> list[Scalar]:
    """Adam/AdamW's values for s[2:] at step `step` (counted from 1): [weight_decay,
    1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, sqrt(bias_correction2), eps,
    -lr / bias_correction1], in fp64 (torch computes the bias corrections in Python floats)."""
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return [
        weight_decay,
        1 - lr * weight_decay,
        1 - beta1,
        beta2,
        1 - beta2,
        bias_correction2**0.5,
        eps,
        -(lr / bias_correction1),
    ]


def scalar_vector(
    values: Sequence[Scalar],
    head: Sequence[torch.Tensor] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """s as one fp32 tensor: head (inv_scale, clip: one-element fp32 device tensors; None: both
    1, for grads already unscaled and clipped), then values rounded once from fp64 to fp32."""
    if any(isinstance(v, torch.Tensor) for v in values):
        like = next(v for v in values if isinstance(v, torch.Tensor))
        tail = torch.stack(
            [torch.as_tensor(v, dtype=like.dtype, device=like.device) for v in values]
        )
        tail = tail.float()
    else:
        tail = torch.tensor(list(values), dtype=torch.float32, device=device)
    if head is None:
        head = [torch.ones(2, dtype=torch.float32, device=tail.device)]
    return torch.cat([*(h.reshape(-1) for h in head), tail])


# ----- torch's initial optimizer state -----
def torch_zeros(like: torch.Tensor, key: str) -> torch.Tensor:
    """torch's own zero state for `key` (zeros_like): the default `Zeros`."""
    return torch.zeros_like(like, memory_format=torch.preserve_format)


Zeros = Callable[[torch.Tensor, str], torch.Tensor]


def adam_state(state: dict[str, Any], like: torch.Tensor, zeros: Zeros = torch_zeros) -> None:
    """torch's Adam/AdamW initial state in `state` where missing: step 0.0 (a CPU tensor of the
    default dtype, as torch's non-capturable Adam) and zero moments (`zeros(like, key)`: torch's
    zeros_like by default; lean passes its state format), so either path continues the other."""
    if "step" not in state:
        state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
    for key in ("exp_avg", "exp_avg_sq"):
        if key not in state:
            state[key] = zeros(like, key)


def momentum_buffer(
    state: dict[str, Any], like: torch.Tensor, zeros: Zeros = torch_zeros
) -> tuple[torch.Tensor, bool]:
    """(SGD's momentum buffer, whether it was created now: see sgd_scalars' `first`)."""
    buf = state.get("momentum_buffer")
    if buf is not None:
        return buf, False
    buf = state["momentum_buffer"] = zeros(like, "momentum_buffer")
    return buf, True


# ----- the updates (s as above; the flags are constants of each compiled variant) -----
def unscaled(grad, s, clip: bool, maximize: bool):
    """The grad as the optimizer sees it: s[0] = inv_scale, s[1] = clip coefficient."""
    g = grad.float() * s[0]
    if clip:
        g = g * s[1]
    return -g if maximize else g


def sgd_update(hp, g, s, decay):
    """The new param for SGD without momentum; s[2:] = sgd_scalars (the first two used)."""
    if decay:
        g = g + s[2] * hp
    return hp + s[3] * g


def sgd_momentum_update(hp, g, buf, s, decay, nesterov):
    """(new param, new buffer) for SGD with momentum; s[2:] = sgd_scalars."""
    if decay:
        g = g + s[2] * hp
    b = buf * s[4] + s[5] * g
    g = g + s[6] * b if nesterov else b
    return hp + s[3] * g, b


def adam_update(hp, g, exp_avg, exp_avg_sq, s, decay, decoupled):
    """(new param, exp_avg, exp_avg_sq) for Adam/AdamW; s[2:] = adam_scalars (torch's foreach
    Adam/AdamW, op for op)."""
    p = hp
    if decay and decoupled:
        p = p * s[3]
    elif decay:
        g = g + s[2] * p
    m = torch.lerp(exp_avg, g, s[4])
    v = exp_avg_sq * s[5] + s[6] * g * g
    denom = v.sqrt() / s[7] + s[8]
    return p + s[9] * (m / denom), m, v


# ----- stochastic rounding of the write-back into bf16 -----
_HIGH_BIT_MASK = -65536  # 0xFFFF0000 as int32: keeps sign, exponent and bf16's 7 mantissa bits
_GOLDEN = 0x61C88647  # 2**32 / golden ratio, as a positive int32 (the negated 0x9E3779B9)


def round_bf16_stochastic(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """x (fp32) rounded to bf16 with 16 uniform random bits per element (int32 in [0, 2**16)):
    to the neighbour away from zero with probability (low 16 bits of x) / 2**16, else towards
    zero. Unbiased, always one of x's two bf16 neighbours; inf and nan as nearest rounding gives.

    Adding the noise to the low half and truncating carries into bf16's last bit exactly with
    that probability (the carry may move the exponent: the next bf16 value)."""
    bits = (x.view(torch.int32) + noise) & _HIGH_BIT_MASK  # int32 adds wrap: no UB in torch
    rounded = bits.view(torch.float32).bfloat16()  # exact: the low 16 bits are zero
    return torch.where(torch.isfinite(x), rounded, x.bfloat16())


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (xorshift-multiply, lowbias32's shape) on int32 tensors:
    products wrap mod 2**32; each right shift is masked, so it acts as a logical shift."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * 0x5BD1E995
    return x ^ ((x >> 16) & 0xFFFF)


def rounding_keys(seed: int, counter: torch.Tensor, count: int) -> torch.Tensor:
    """The int32 keys of `count` tensors' rounding noise at step `counter` (a 0-d int64 device
    tensor the caller advances once per step that writes back: a skipped step leaves it, and so
    draws nothing). Key i is the one of the optimizer's i-th param (its place in param_groups),
    whichever params have grads this step."""
    seed32 = (seed ^ (seed >> 32)) & 0xFFFFFFFF
    seed32 = seed32 - (1 << 32) if seed32 >= 1 << 31 else seed32  # the same bits as an int32
    step = _mix32(counter.to(torch.int32) ^ seed32)
    index = torch.arange(1, count + 1, dtype=torch.int32, device=counter.device)
    return _mix32(step + index * _GOLDEN)


def rounding_noise(
    key: torch.Tensor, shape: torch.Size, index: torch.Tensor | None = None
) -> torch.Tensor:
    """16 uniform random bits per element of `shape` (int32 in [0, 2**16)) from a key: two
    rounds of the hash over the element's row-major index, the top 16 bits kept. Tensors
    stepped together in one flat buffer pass each element's key (an int32 tensor of `shape`)
    and its row-major index in its own tensor: the same bits as one tensor at a time."""
    if index is None:
        index = torch.arange(shape.numel(), dtype=torch.int32, device=key.device).view(shape)
    return (_mix32(_mix32(index ^ key)) >> 16) & 0xFFFF
