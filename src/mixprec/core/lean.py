"""Lean precision: bf16 params stepped without fp32 masters, and low-bit optimizer state.

Two ways to keep fewer bytes per parameter than fp32 masters + fp32 moments (16 with AdamW):

- **Stochastic rounding of the write-back** (`update_rounding="stochastic"`). The update is
  computed in fp32 from the bf16 param (a per-tensor transient) and written back to bf16
  rounding up with probability (distance to the lower neighbour) / (gap between neighbours):
  the expected written value is the fp32 one, so updates far below bf16's resolution (~2**-8
  of the weight) still move it on average, where round-to-nearest drops them every step.
  The random stream is one seeded torch.Generator per optimizer (per-rank distinct seed),
  saved in the optimizer's state_dict, so a resume continues bit for bit; a skipped step
  draws nothing from it.
- **Low-bit optimizer state** (`optimizer_state` in fp32 / bf16 / int8 / int4 / fp8). int8,
  int4 and fp8 are torchao's block-wise quantized tensor subclasses (OptimState8bit: dynamic
  8-bit map, blocks of 256; OptimState4bit: 4-bit map, blocks of 128; OptimStateFp8: e4m3,
  blocks of 256). Each step dequantizes a tensor's state to fp32, runs the update and writes
  it back (torchao's copy_ quantizes: nearest code of its map); tensors torchao does not
  quantize (under 4096 elements, or not a whole number of blocks) keep fp32 state.

The update math is the core's one SGD/Adam/AdamW step math (mixprec.core.fused_step's *_update
functions, which the fused master step runs too); this module only says where the fp32
operands come from and how the results are written back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mixprec.core import fused_step as fused
from mixprec.core.policy import OPTIMIZER_STATES, ROUNDINGS, OptimizerState, Policy, Rounding
from mixprec.core.scaling import rank_and_world

__all__ = [
    # the rounding
    "fp32_to_bf16_stochastic",
    # configuration
    "LeanConfig",
    "lean_config",
    # the write-back strategy an optimizer runs
    "LeanUpdate",
    "state_bytes",
]

LOW_BIT = ("int8", "int4", "fp8")
MIN_QUANTIZED_NUMEL = 4096
"""torchao's rule: smaller state tensors are not worth quantizing (their scales would dominate)."""
BLOCK_SIZE = {"int8": 256, "int4": 128, "fp8": 256}
"""torchao's block sizes (AdamW8bit / AdamW4bit / AdamWFp8 defaults): one fp32 scale per block."""
STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
UNSIGNED_KEYS = ("exp_avg_sq",)
"""State that is never negative gets torchao's unsigned map (twice the resolution)."""
_HIGH_BIT_MASK = -65536  # 0xFFFF0000 as int32: keeps sign, exponent and bf16's 7 mantissa bits


def fp32_to_bf16_stochastic(
    hp: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """hp rounded to bf16 stochastically: to the neighbour away from zero with probability
    (low 16 bits of hp's fp32 pattern) / 2**16, otherwise towards zero. Unbiased: E[result] = hp
    for every finite hp within bf16's range; the result is always one of hp's two bf16
    neighbours (values above bf16's largest finite may round to inf, as nearest does);
    inf and nan pass through as nearest rounding gives them.

    Adding 16 uniform random bits to the low half and truncating carries into bf16's last bit
    exactly with that probability (the carry may move the exponent: the next bf16 value).
    """
    hp32 = hp.float().contiguous()
    noise = torch.randint(
        0, 1 << 16, hp32.shape, dtype=torch.int32, device=hp32.device, generator=generator
    )
    bits = (hp32.view(torch.int32) + noise) & _HIGH_BIT_MASK  # int32 adds wrap: no UB in torch
    rounded = bits.view(torch.float32).bfloat16()  # exact: the low 16 bits are zero
    return torch.where(torch.isfinite(hp32), rounded, hp32.bfloat16())


@dataclass(frozen=True, kw_only=True)
class LeanConfig:
    """How an optimizer writes its updates back and keeps its state (from a Policy)."""

    rounding: Rounding = "nearest"
    """'stochastic': bf16 params take fp32_to_bf16_stochastic of the update; 'nearest': a cast."""
    state: OptimizerState = "fp32"
    """Format of the moments / momentum buffers."""
    seed: int | None = None
    """Seed of the rounding's random stream; None: torch.initial_seed() when the optimizer is
    built (so torch.manual_seed makes a run repeatable). Each rank mixes in its rank."""

    def __post_init__(self) -> None:
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"update_rounding={self.rounding!r}; valid: {ROUNDINGS}.")
        if self.state not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer_state={self.state!r}; valid: {OPTIMIZER_STATES}.")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise TypeError(f"LeanConfig.seed={self.seed!r} must be an int or None.")


def lean_config(policy: Policy) -> LeanConfig | None:
    """The policy's lean settings, or None when its optimizer steps as torch's own does."""
    if policy.optimizer_state is None and policy.update_rounding == "nearest":
        return None
    return LeanConfig(rounding=policy.update_rounding, state=policy.optimizer_state or "fp32")


def _rank_seed(seed: int, rank: int) -> int:
    """A distinct 64-bit seed per rank (splitmix64's odd constant spreads consecutive ranks)."""
    return (seed + rank * 0x9E3779B97F4A7C15) % (1 << 64)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (same storage), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _quantizes(fmt: str, numel: int) -> bool:
    return fmt in LOW_BIT and numel >= MIN_QUANTIZED_NUMEL and numel % BLOCK_SIZE[fmt] == 0


def new_state(like: torch.Tensor, fmt: str, signed: bool) -> torch.Tensor:
    """A zero state tensor shaped like `like` in format fmt (torchao's subclasses for low bit)."""
    if fmt == "bf16":
        return torch.zeros(like.shape, dtype=torch.bfloat16, device=like.device)
    if not _quantizes(fmt, like.numel()):
        return torch.zeros(like.shape, dtype=torch.float32, device=like.device)
    from torchao.optim.subclass_4bit import OptimState4bit  # torchao only where low bit is used
    from torchao.optim.subclass_8bit import OptimState8bit
    from torchao.optim.subclass_fp8 import OptimStateFp8

    block, dev = BLOCK_SIZE[fmt], like.device
    if fmt == "int8":
        return OptimState8bit.zeros(like.shape, signed, block, dev, dtype=torch.float32)
    if fmt == "int4":
        return OptimState4bit.zeros(like.shape, signed, block, dev, dtype=torch.float32)
    return OptimStateFp8.zeros(like.shape, block, dev, dtype=torch.float32)


def to_fp32(state: torch.Tensor) -> torch.Tensor:
    """A state tensor's fp32 value (dequantized; a plain fp32 tensor is returned as is)."""
    if hasattr(state, "dequantize") and type(state) is not torch.Tensor:
        return state.dequantize(torch.float32)
    return state.float()


def state_bytes(state: torch.Tensor) -> int:
    """Bytes a state tensor really holds (a quantized one: codes + scales, qmap excluded: one
    256-entry table shared in spirit, 1 KiB per tensor in torchao)."""
    if type(state) is torch.Tensor:
        return state.numel() * state.element_size()
    return sum(t.numel() * t.element_size() for t in (state.codes, state.scale))


def pack(state: torch.Tensor) -> Any:
    """A state tensor as checkpoint data: plain tensors as they are, a torchao subclass as a
    dict of its codes and scales (compact, loadable with weights_only=True)."""
    if type(state) is torch.Tensor:
        return state
    kind = type(state).__name__
    packed = {"lean_format": kind, "codes": state.codes, "scale": state.scale}
    packed["shape"] = list(state.shape)
    packed["signed"] = bool(getattr(state, "signed", True))
    return packed


def unpack_to_fp32(value: Any) -> Any:
    """A packed state value (see pack) as an fp32 tensor; anything else as it is."""
    if not (isinstance(value, dict) and "lean_format" in value):
        return value
    from torchao.optim.quant_utils import dequant_with_qmap
    from torchao.optim.subclass_4bit import get_qmap_signed as qmap4_signed
    from torchao.optim.subclass_4bit import get_qmap_unsigned as qmap4_unsigned
    from torchao.optim.subclass_8bit import get_qmap_signed as qmap8_signed
    from torchao.optim.subclass_8bit import get_qmap_unsigned as qmap8_unsigned

    codes, scale, shape = value["codes"], value["scale"], value["shape"]
    kind = value["lean_format"]
    if kind == "OptimStateFp8":
        block = codes.numel() // scale.numel()
        return (codes.float().view(-1, block) * scale.view(-1, 1)).view(shape)
    if kind == "OptimState8bit":
        table = qmap8_signed() if value["signed"] else qmap8_unsigned()
    elif kind == "OptimState4bit":
        table = qmap4_signed() if value["signed"] else qmap4_unsigned()
        codes = torch.stack([codes >> 4, codes & 0b1111], dim=-1)  # torchao's packing
    else:
        raise ValueError(f"Unknown packed optimizer state format {kind!r}.")
    qmap = torch.tensor(table, dtype=torch.float32, device=codes.device)
    return dequant_with_qmap(codes, qmap, scale).view(shape)


class LeanUpdate:
    """The lean write-back an optimizer wrapper runs instead of its inner optimizer's step().

    Steps torch.optim.SGD, Adam and AdamW (the core's step math) over whatever params the inner
    optimizer holds: bf16/fp16 params directly (no masters), fp32 params or fp32 masters.
    """

    def __init__(self, cfg: LeanConfig, optimizer: torch.optim.Optimizer) -> None:
        reason = fused.unsupported_reason(optimizer)
        if reason:
            raise ValueError(
                f"optimizer_state={cfg.state!r} / update_rounding={cfg.rounding!r} run the "
                f"core's step math, which cannot step this optimizer: {reason}."
            )
        held = [p for g in optimizer.param_groups for p in g["params"]]
        if cfg.rounding == "stochastic":
            bad = sorted({str(p.dtype) for p in held if p.dtype == torch.float16})
            if bad:
                raise ValueError(
                    "update_rounding='stochastic' rounds fp32 updates to bfloat16; this "
                    f"optimizer holds {bad} params. Use bf16 params (mode 'bf16_sr') or keep "
                    "fp32 masters for fp16 params (fp16_naive / O2)."
                )
        self.cfg = cfg
        device = held[0].device if held else torch.device("cpu")
        base = torch.initial_seed() if cfg.seed is None else cfg.seed
        self.seed = _rank_seed(base, rank_and_world()[0])
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(self.seed)

    # ----- the step -----
    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One update of every held param with a grad (grads already unscaled and clipped)."""
        for group in optimizer.param_groups:
            items = [p for p in group["params"] if p.grad is not None]
            if not items:
                continue
            if isinstance(optimizer, torch.optim.SGD):
                self._sgd_group(optimizer, group, items)
            else:
                self._adam_group(optimizer, group, items)

    def _write(self, p: torch.Tensor, new: torch.Tensor) -> None:
        """The write-back: fp32 `new` into p's dtype, rounded as configured."""
        local = _local(p)
        if local.dtype == torch.bfloat16 and self.cfg.rounding == "stochastic":
            local.copy_(fp32_to_bf16_stochastic(new, self.generator))
        else:
            local.copy_(new)  # nearest (a no-op cast for fp32)

    def _state(self, state: dict[str, Any], key: str, p: torch.Tensor) -> torch.Tensor:
        if key not in state:
            state[key] = new_state(_local(p), self.cfg.state, signed=key not in UNSIGNED_KEYS)
        return state[key]

    def _sgd_group(self, optimizer, group, items) -> None:
        momentum, wd, lr = group["momentum"], group["weight_decay"], group["lr"]
        maximize = bool(group.get("maximize"))
        for p in items:
            hp, g = _local(p).float(), self._grad(p, maximize)
            if momentum == 0:
                s = self._scalars([wd, -lr], hp)
                self._write(p, fused.sgd_update(hp, g, s, wd != 0))
                continue
            state = optimizer.state[p]
            first = "momentum_buffer" not in state
            buf = self._state(state, "momentum_buffer", p)
            decay, keep = (0.0, 1.0) if first else (momentum, 1 - group["dampening"])
            s = self._scalars([wd, -lr, decay, keep, momentum], hp)
            new, b = fused.sgd_momentum_update(
                hp, g, to_fp32(buf), s, wd != 0, bool(group["nesterov"])
            )
            buf.copy_(b)  # torchao's copy_ quantizes
            self._write(p, new)

    def _adam_group(self, optimizer, group, items) -> None:
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        maximize = bool(group.get("maximize"))
        decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        for p in items:
            state = optimizer.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
            exp_avg = self._state(state, "exp_avg", p)
            exp_avg_sq = self._state(state, "exp_avg_sq", p)
            state["step"] += 1
            step = float(state["step"])  # a CPU scalar, as torch's non-capturable Adam keeps it
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
            values = [wd, 1 - lr * wd, 1 - beta1, beta2, 1 - beta2]
            values += [bias_correction2**0.5, eps, -(lr / bias_correction1)]
            hp, g = _local(p).float(), self._grad(p, maximize)
            new, m, v = fused.adam_update(
                hp, g, to_fp32(exp_avg), to_fp32(exp_avg_sq), self._scalars(values, hp), wd != 0,
                bool(decoupled),
            )  # fmt: skip
            exp_avg.copy_(m)
            exp_avg_sq.copy_(v)
            self._write(p, new)

    @staticmethod
    def _grad(p: torch.Tensor, maximize: bool) -> torch.Tensor:
        g = _local(p.grad).float()
        return -g if maximize else g

    @staticmethod
    def _scalars(values: list[float], like: torch.Tensor) -> torch.Tensor:
        """The step math's scalar vector s; its first two slots (inv_scale, clip) are 1: the
        wrapper has unscaled and clipped the grads before this write-back runs."""
        return torch.tensor([1.0, 1.0, *values], dtype=torch.float32, device=like.device)

    # ----- checkpoints -----
    def state_dict_into(self, state_dict: dict[str, Any]) -> None:
        """Pack the low-bit state of an inner optimizer's state_dict in place (compact: codes
        and scales) and add the rounding's random stream and this config."""
        state_dict["state"] = {  # torch's entries are the live state dicts: new ones
            i: {k: pack(v) if k in STATE_KEYS else v for k, v in entry.items()}
            for i, entry in state_dict["state"].items()
        }
        state_dict["lean"] = {
            "rng": self.generator.get_state(),
            "seed": self.seed,
            "optimizer_state": self.cfg.state,
            "update_rounding": self.cfg.rounding,
        }

    def load_state(
        self, optimizer: torch.optim.Optimizer, saved: dict[int, dict[str, Any]], lean: Any
    ) -> None:
        """Put the saved per-param state (taken out before torch's load: torch would cast it to
        the params' dtype) into this optimizer's format: low bit is re-quantized from fp32
        (torchao's nearest code), fp32 state is the dequantized value, bf16 the nearest bf16."""
        held = [p for g in optimizer.param_groups for p in g["params"]]
        for index, entry in saved.items():
            p = held[int(index)]
            state = optimizer.state[p]
            state.clear()
            for key, value in entry.items():
                if key not in STATE_KEYS:
                    state[key] = value
                    continue
                target = self._state(state, key, p)
                if _same_format(target, value):  # codes and scales as saved: bit for bit
                    target.codes.copy_(value["codes"])
                    target.scale.copy_(value["scale"])
                    continue
                fp32 = unpack_to_fp32(value).to(device=_local(p).device, dtype=torch.float32)
                target.copy_(fp32.view(_local(p).shape))
        if lean is not None:
            self.generator.set_state(lean["rng"])
            self.seed = int(lean["seed"])


def _same_format(target: torch.Tensor, value: Any) -> bool:
    """value is packed state of target's torchao kind, signedness and block layout."""
    return (
        isinstance(value, dict)
        and value.get("lean_format") == type(target).__name__
        and value["signed"] == bool(getattr(target, "signed", True))
        and value["codes"].shape == target.codes.shape
        and value["scale"].shape == target.scale.shape
    )


def split_state(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[int, dict], Any]:
    """(state_dict without its per-param state, that state, its 'lean' entry or None).

    Torch's Optimizer.load_state_dict casts floating state to each param's dtype (fp32 moments
    of a bf16 param would become bf16) and knows nothing of packed low-bit state, so a lean
    optimizer loads the state itself; see LeanUpdate.load_state."""
    rest = {k: v for k, v in state_dict.items() if k not in ("state", "lean")}
    rest["state"] = {}
    return rest, dict(state_dict.get("state", {})), state_dict.get("lean")


def unpack_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A lean checkpoint for an optimizer that steps as torch does: low-bit state dequantized
    to fp32 tensors (torch then casts them to the params' dtype), the lean entry dropped."""
    if "lean" not in state_dict:
        return state_dict
    out = {k: v for k, v in state_dict.items() if k != "lean"}
    out["state"] = {
        i: {k: unpack_to_fp32(v) for k, v in entry.items()}
        for i, entry in state_dict["state"].items()
    }
    return out
