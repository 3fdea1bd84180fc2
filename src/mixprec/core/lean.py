"""Lean precision: bf16 params stepped without fp32 masters, and low-bit optimizer state.

Two ways to keep fewer bytes per parameter than fp32 masters + fp32 moments (16 with AdamW):

- **Stochastic rounding of the write-back** (`update_rounding="stochastic"`). The update is
  computed in fp32 from the bf16 param (in registers of a compiled kernel) and written back
  to bf16 rounding up with probability (distance to the lower neighbour) / (gap between
  neighbours): the expected written value is the fp32 one, so updates far below bf16's
  resolution (~2**-8 of the weight) still move it on average, where round-to-nearest drops
  them every step. The random stream is counter-based (step_math.rounding_keys: a hash of a
  per-rank seed, the optimizer's step counter, the param's place and the element), saved in
  the optimizer's state_dict, so a resume continues bit for bit; a skipped step leaves the
  counter, so it draws nothing; compile_step draws the same bits in its graph.
- **Low-bit optimizer state** (`optimizer_state` in fp32 / bf16 / int8 / int4 / fp8). int8,
  int4 and fp8 are torchao's block-wise quantized tensor subclasses (OptimState8bit: dynamic
  8-bit map, blocks of 256; OptimState4bit: 4-bit map, blocks of 128; OptimStateFp8: e4m3,
  blocks of 256). Each step dequantizes a tensor's state inside the update's compiled kernel
  and writes it back there (torchao's copy_ quantizes: nearest code of its map); tensors torchao does not
  quantize (under 4096 elements, or not a whole number of blocks) keep fp32 state.

The update math is the core's one SGD/Adam/AdamW step math (mixprec.core.step_math), run in
mixprec.core.fused_step's compiled per-tensor kernels as the fused master step runs it; this
module only says where the operands come from and how the results are written back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mixprec.core import fused_step as fused
from mixprec.core import qstate
from mixprec.core import step_math as sm
from mixprec.core.joined import JoinedState, join, layout_of, split_into
from mixprec.core.policy import ROUNDINGS, OptimizerState, Policy, Rounding, state_formats
from mixprec.core.scaling import rank_and_world
from mixprec.core.step_plan import GroupPlan

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


def fp32_to_bf16_stochastic(
    hp: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """hp rounded to bf16 stochastically (step_math.round_bf16_stochastic) with noise drawn from
    a torch.Generator: to the neighbour away from zero with probability (low 16 bits of hp's
    fp32 pattern) / 2**16, otherwise towards zero. Unbiased: E[result] = hp for every finite hp
    within bf16's range; always one of hp's two bf16 neighbours (values above bf16's largest
    finite may round to inf, as nearest does); inf and nan pass through as nearest gives them.
    The optimizer's write-back draws its noise from step_math.rounding_noise instead (the same
    rounding; a counter-based stream that a compiled step can draw too)."""
    hp32 = hp.float().contiguous()
    noise = torch.randint(
        0, 1 << 16, hp32.shape, dtype=torch.int32, device=hp32.device, generator=generator
    )
    return sm.round_bf16_stochastic(hp32, noise)


@dataclass(frozen=True, kw_only=True)
class LeanConfig:
    """How an optimizer writes its updates back and keeps its state (from a Policy)."""

    rounding: Rounding = "nearest"
    """'stochastic': bf16 params take fp32_to_bf16_stochastic of the update; 'nearest': a cast."""
    state: OptimizerState = "fp32"
    """Format of the moments / momentum buffers: one for all, or 'first/second' (see formats)."""
    seed: int | None = None
    """Seed of the rounding's random stream; None: torch.initial_seed() when the optimizer is
    built (so torch.manual_seed makes a run repeatable). Each rank mixes in its rank."""

    def __post_init__(self) -> None:
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"update_rounding={self.rounding!r}; valid: {ROUNDINGS}.")
        state_formats(self.state)
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise TypeError(f"LeanConfig.seed={self.seed!r} must be an int or None.")

    @property
    def formats(self) -> tuple[str, str]:
        """(the first moment's format: Adam's exp_avg, SGD's momentum_buffer; the second
        moment's: exp_avg_sq), policy.state_formats of state."""
        return state_formats(self.state)

    @property
    def low_bit(self) -> bool:
        """Some state is block-wise quantized (torchao's tensors: int8 / int4 / fp8)."""
        return any(f in LOW_BIT for f in self.formats)


def lean_config(policy: Policy) -> LeanConfig | None:
    """The policy's lean settings, or None when its optimizer steps as torch's own does."""
    if policy.optimizer_state is None and policy.update_rounding == "nearest":
        return None
    return LeanConfig(rounding=policy.update_rounding, state=policy.optimizer_state or "fp32")


_RANK_STRIDE = 0x9E3779B97F4A7C15  # splitmix64's odd constant: spreads consecutive ranks


def rank_seed(seed: int, rank: int) -> int:
    """A distinct 64-bit seed per rank (rank 0's is the base seed itself)."""
    return (seed + rank * _RANK_STRIDE) % (1 << 64)


def base_seed(seed: int, rank: int) -> int:
    """The base seed a rank's seed was mixed from (rank_seed's inverse): what a checkpoint
    gathered from several ranks keeps, so each rank of a load mixes its own seed again."""
    return (seed - rank * _RANK_STRIDE) % (1 << 64)


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
    from torchao.optim.subclass_4bit import get_qmap_signed as qmap4_signed
    from torchao.optim.subclass_4bit import get_qmap_unsigned as qmap4_unsigned
    from torchao.optim.subclass_8bit import get_qmap_signed as qmap8_signed
    from torchao.optim.subclass_8bit import get_qmap_unsigned as qmap8_unsigned

    codes, scale, shape = value["codes"].view(-1), value["scale"], value["shape"]
    kind = value["lean_format"]
    if kind == qstate.FP8:
        return qstate.read((codes, scale)).view(shape)
    if kind == qstate.INT8:
        table = qmap8_signed() if value["signed"] else qmap8_unsigned()
    elif kind == qstate.INT4:
        table = qmap4_signed() if value["signed"] else qmap4_unsigned()
    else:
        raise ValueError(f"Unknown packed optimizer state format {kind!r}.")
    qmap = torch.tensor(table, dtype=torch.float32, device=codes.device)
    return qstate.read((codes, scale, qmap)).view(shape)  # the kernel's own dequantize


COMPILE_MIN_ELEMENTS = 1 << 16
"""A lean step compiles its kernels from this many held elements (see LeanUpdate.step)."""
BATCH_MAX_ELEMENTS = 1 << 16
"""Tensors of at most this many elements are stepped together, flattened into one buffer per
batch (LeanUpdate.step): one kernel call instead of one per tensor."""
BATCH_CHUNK_ELEMENTS = 1 << 20
"""At most this many elements per batch: bounds the batch's fp32 temporaries (a few MiB)."""


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
        self.seed = rank_seed(base, rank_and_world()[0])
        self.counter = torch.zeros((), dtype=torch.int64, device=device)
        """The rounding's random stream: steps written back so far (step_math.rounding_keys).
        With the seed it is the stream's whole state: saved in checkpoints, unchanged by a
        skipped step, advanced on the device (no sync)."""
        self.batch_max = BATCH_MAX_ELEMENTS
        """Tensors up to this size are stepped in batches (0: every tensor on its own)."""
        self._batch_layouts: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._joins: dict[tuple, JoinedState] = {}

    # ----- the step -----
    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One update of every held param with a grad (grads already unscaled and clipped): the
        core's step math in fused_step's kernels, with the write-back's rounding in the same
        kernel; then the rounding's step counter advances (on device). Small tensors are
        stepped in batches: concatenated into one flat buffer per (state format, dtype,
        scalars), one kernel call each, results copied back: the same elementwise math (and
        for quantized state the same blocks, as torchao's blocks never straddle two tensors),
        at a fraction of the per-tensor calls."""
        held = [p for g in optimizer.param_groups for p in g["params"]]
        count = len(held)
        # Compile the kernels from COMPILE_MIN_ELEMENTS held elements or on a GPU: eagerly, each
        # of the ~60 elementwise ops of an update (the rounding's hash, torchao's binary search
        # of its code map) is a separate pass over memory, ~4x a foreach AdamW step's time; a
        # kernel does them in one. Smaller steps run the same kernels eagerly (the same math;
        # compiling costs 20-50 s on a 2-core CPU and ~150 MiB of host memory once per
        # variant: more than a small model's whole run, and most of the tests' time).
        numel = sum(_local(p).numel() for p in held)
        self.compiled = numel >= COMPILE_MIN_ELEMENTS or any(
            _local(p).device.type != "cpu" for p in held[:1]
        )
        keys = None
        if self.cfg.rounding == "stochastic":
            keys = sm.rounding_keys(self.seed, self.counter, count)
        index = 0
        for group in optimizer.param_groups:
            params = group["params"]
            items = [(index + i, p) for i, p in enumerate(params) if p.grad is not None]
            index += len(params)
            if not items:
                continue
            plan = GroupPlan.of(optimizer, group)
            device = _local(items[0][1]).device
            params = [p for _, p in items]
            prepared = plan.prepare(optimizer, params, None, device, self.zeros)
            work = [(i, p, st, s) for (i, p), (st, s) in zip(items, prepared, strict=True)]
            self._run(plan.kind, (False, *plan.flags), keys, work)
        if keys is not None:
            self.counter += 1

    def zeros(self, like: torch.Tensor, key: str) -> torch.Tensor:
        """A new state tensor in this config's format for key (the second moment's for
        exp_avg_sq, the first's otherwise; step_math's initial state calls it)."""
        second = key in UNSIGNED_KEYS
        fmt = self.cfg.formats[1 if second else 0]
        return new_state(_local(like), fmt, signed=not second)

    def _run(self, kind, flags, keys, work) -> None:
        """Run `work` (index, param, state tensors, scalar vector) through fused_step's kernel:
        tensors above batch_max one by one, the rest in batches (see step)."""
        batches: dict[tuple, list] = {}
        for i, p, state, s in work:
            local = _local(p)
            if local.numel() > self.batch_max or not local.is_contiguous():
                self._update(kind, p, state, s, flags, keys, i)
                continue
            stochastic = keys is not None and local.dtype == torch.bfloat16
            layout = (id(s), local.dtype, p.grad.dtype, stochastic, *map(layout_of, state))
            batches.setdefault(layout, []).append((i, p, state, s))
        for batch in batches.values():
            chunk: list = []
            size = 0
            for entry in batch:
                if chunk and size + _local(entry[1]).numel() > BATCH_CHUNK_ELEMENTS:
                    self._update_batch(kind, chunk, flags, keys)
                    chunk, size = [], 0
                chunk.append(entry)
                size += _local(entry[1]).numel()
            self._update_batch(kind, chunk, flags, keys)

    def _update(self, kind, p, state, s, flags, keys, index) -> None:
        """p's update in fused_step's kernel: low-bit state dequantized and quantized again
        inside it (torchao's copy_: nearest code), a bf16 p rounded stochastically there."""
        local = _local(p)
        key = None
        if keys is not None and local.dtype == torch.bfloat16:
            key = keys[index]
        state = [_local(t) for t in state]
        fused.update(kind, local, _local(p.grad), state, s, flags, key=key, compiled=self.compiled)

    def _update_batch(self, kind, batch, flags, keys) -> None:
        """Several tensors' updates as one: params, grads and each state (torchao's codes and
        scales for quantized state) concatenated, one kernel call, the results copied back."""
        if len(batch) == 1:
            i, p, state, s = batch[0]
            self._update(kind, p, state, s, flags, keys, i)
            return
        params = [_local(p).view(-1) for _, p, _, _ in batch]
        hp = torch.cat(params)
        grad = torch.cat([_local(p.grad).view(-1) for _, p, _, _ in batch])
        columns = [
            [_local(t) for t in col] for col in zip(*(st for _, _, st, _ in batch), strict=True)
        ]
        joined = self._joined_state(batch, columns)
        copy_back = joined is None
        if copy_back:  # DTensor state: joined and split each step
            joined = [join(col) for col in columns]
        key = None
        if keys is not None and hp.dtype == torch.bfloat16:
            key = self._batch_keys(batch, keys)
        s = batch[0][3]
        fused.update(kind, hp, grad, joined, s, flags, key=key, compiled=self.compiled)
        torch._foreach_copy_(params, hp.split([t.numel() for t in params]))
        if copy_back:
            for col, whole in zip(columns, joined, strict=True):
                split_into(col, whole)

    def _joined_state(self, batch, columns) -> list[torch.Tensor] | None:
        """The batch's state columns joined (see joined.join), kept from step to step: the first step
        moves each state tensor into its column's joined buffer (the tensor, the one in the
        optimizer's state, becomes a view of it), so later steps copy no state in or out (on
        the GPT of bench_lean, 0.6-0.8 ms a step). A state tensor replaced since (a loaded
        state_dict) or moved elsewhere is joined again; DTensor state (FSDP2) is not kept
        (None: joined and split each step)."""
        if any(hasattr(p, "to_local") for _, p, _, _ in batch):
            return None
        key = tuple(id(p) for _, p, _, _ in batch)
        held = self._joins.get(key)
        if held is not None and held.holds(columns):
            return held.whole
        held = JoinedState(columns)
        params = set(key)  # a param's state lives in one join: older joins over it go
        self._joins = {k: v for k, v in self._joins.items() if params.isdisjoint(k)}
        self._joins[key] = held
        return held.whole

    def _batch_keys(self, batch, keys) -> torch.Tensor:
        """A batch's [2, n] int32 rounding keys: each element's tensor's key (this step's) and
        its index in its own tensor. The layout (which key each element takes, its index) is
        built once per batch layout and kept (12 bytes per batched element, small tensors
        only); each step fills in its keys with one index_select."""
        layout = tuple((i, _local(p).numel()) for i, p, _, _ in batch)
        cached = self._batch_layouts.get(layout)
        if cached is None:
            device = keys.device
            sizes = torch.tensor([n for _, n in layout], device=device)
            starts = torch.cumsum(sizes, 0) - sizes
            owner = torch.tensor([i for i, _ in layout], device=device).repeat_interleave(sizes)
            key = torch.empty((2, owner.numel()), dtype=torch.int32, device=device)
            key[1] = torch.arange(owner.numel(), device=device) - starts.repeat_interleave(sizes)
            cached = self._batch_layouts[layout] = (owner.to(torch.int32), key)
        owner, key = cached
        torch.index_select(keys, 0, owner, out=key[0])
        return key

    # ----- checkpoints -----
    def state_dict_into(self, state_dict: dict[str, Any]) -> None:
        """Pack the low-bit state of an inner optimizer's state_dict in place (compact: codes
        and scales) and add the rounding's random stream and this config."""
        state_dict["state"] = {  # torch's entries are the live state dicts: new ones
            i: {k: pack(v) if k in STATE_KEYS else v for k, v in entry.items()}
            for i, entry in state_dict["state"].items()
        }
        state_dict["lean"] = {
            "rng": self.counter.clone(),  # with the seed, the whole random stream
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
                if key not in state:
                    state[key] = self.zeros(p, key)
                target = state[key]
                if _same_format(target, value):  # codes and scales as saved: bit for bit
                    target.codes.copy_(value["codes"])
                    target.scale.copy_(value["scale"])
                    continue
                fp32 = unpack_to_fp32(value).to(device=_local(p).device, dtype=torch.float32)
                target.copy_(fp32.view(_local(p).shape))
        if lean is not None:
            rng = lean["rng"]
            if not isinstance(rng, torch.Tensor) or rng.dtype != torch.int64 or rng.numel() != 1:
                raise ValueError(
                    f"This lean checkpoint's rounding stream ('rng': {type(rng).__name__} "
                    f"{getattr(rng, 'dtype', '')}) is not a step counter: it was written by an "
                    "older mixprec that drew its noise from a torch.Generator. Load it into an "
                    "optimizer without stochastic rounding, or drop its 'lean' entry to restart "
                    "the stream (the resume is then not bit for bit)."
                )
            self.counter.copy_(rng.reshape(()))
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


def merge_shards(saved: list[dict[str, Any]], held: list[torch.Tensor], rank: int) -> dict:
    """This rank's lean optimizer state_dict from the per-rank ones of a run on len(saved)
    ranks (saved[r]: rank r's) whose params were sharded along dim 0 in rank order (FSDP2's
    Shard(0)): each param's state dequantized to fp32, the ranks' rows concatenated into the
    whole param's state and cut to the rows this rank holds of `held` (the params its inner
    optimizer steps, in order: a DTensor's local shard, a plain tensor all of it). The load
    then quantizes them in this optimizer's format: low-bit state is re-quantized over this
    rank's blocks (the saving ranks' block boundaries may differ: torchao's nearest code
    again, not the saved codes). The rounding stream keeps its step counter; its seed is
    mixed for `rank` from the base seed (saving rank 0's), as a fresh run's would be."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    first = saved[0]
    if any(s.get("master_weights") for s in saved):
        raise ValueError(
            "This lean checkpoint holds fp32 master shards, which mixprec does not reshard: "
            "load it on as many ranks as saved it."
        )
    indices = sorted({int(i) for s in saved for i in s["state"]})
    state: dict[int, dict[str, Any]] = {}
    for index in indices:
        if index >= len(held):
            raise ValueError(
                f"The lean checkpoint holds state for param {index}; this optimizer holds "
                f"{len(held)} params: it was saved for another model or param_groups."
            )
        p = held[index]
        entries = [s["state"].get(index, s["state"].get(str(index))) for s in saved]
        entry: dict[str, Any] = {}
        for key, value in next(e for e in entries if e is not None).items():
            if key not in STATE_KEYS:
                entry[key] = value
                continue
            parts = [unpack_to_fp32(e[key]).float() for e in entries if e is not None]
            whole = torch.cat(parts) if parts[0].dim() > 0 else parts[0]
            if tuple(whole.shape) != tuple(p.shape):
                raise ValueError(
                    f"The lean checkpoint's {key} of param {index} is {tuple(whole.shape)} "
                    f"when its {len(saved)} ranks' rows are joined; the param is "
                    f"{tuple(p.shape)}: it was saved for another model, or not sharded by rows."
                )
            if hasattr(p, "device_mesh"):  # a DTensor: this rank's rows of it
                shape, offset = compute_local_shape_and_global_offset(
                    p.shape, p.device_mesh, p.placements
                )
                if tuple(shape[1:]) != tuple(p.shape[1:]):
                    raise ValueError(
                        f"Param {index} is sharded along more than its rows ({p.placements}); "
                        "mixprec reshards lean state of row-sharded (FSDP2) params only."
                    )
                rows = slice(offset[0], offset[0] + shape[0]) if whole.dim() > 0 else ...
                whole = whole[rows].reshape(shape)
            entry[key] = whole.contiguous()
        state[index] = entry
    merged = {k: v for k, v in first.items() if k not in ("state", "lean")}
    merged["state"] = state
    if first.get("lean") is not None:
        merged["lean"] = dict(first["lean"])
        merged["lean"]["seed"] = rank_seed(int(first["lean"]["seed"]), rank)
    return merged
