"""ZeRO checkpoints: one shard per rank, or the whole optimizer gathered as an unsharded one.

A shard (ZeroOptimizer.state_dict) records its layout (stage, world, rank, owners) and loads
only where the layout is the same. A gathered checkpoint goes through an unsharded
MixedPrecisionOptimizer over CPU stand-ins of every param (its "twin"): gathered on group rank
0 into the twin's state_dict, it is an ordinary mixprec optimizer checkpoint and loads into any
world size, sharded or not; loaded through the twin, each rank keeps its own shard of it.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mixprec.core.grad_transfer import LOW_DTYPES
from mixprec.core.lean import base_seed
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.scaling import rank_and_world
from mixprec.parallel.zero_layout import local

if TYPE_CHECKING:
    from mixprec.parallel.zero import ZeroOptimizer

LAYOUT_KEYS = ("world", "rank", "owners")
"""What a shard's layout must match to load (the stage may differ: the shards hold the same)."""


def check_shard(saved: dict[str, Any] | None, mine: dict[str, Any]) -> None:
    """Raise unless a shard saved with layout `saved` (None: no ZeRO shard) loads here."""
    if saved is not None and all(saved.get(k) == mine[k] for k in LAYOUT_KEYS):
        return
    layout = None if saved is None else {k: saved.get(k) for k in ("world", "rank")}
    here = {k: mine[k] for k in ("world", "rank")}
    raise ValueError(
        f"This ZeRO shard was saved as {layout or 'no ZeRO shard'}; this rank is {here} with a "
        "different param layout. Load it on the same world size and model."
    )


def held(zero: ZeroOptimizer) -> dict[int, torch.Tensor]:
    """index -> the tensor this rank's inner optimizer steps for it (master or param)."""
    lp_to_hp = {id(lp): hp for lp, hp in zip(zero.lp_params, zero.hp_masters, strict=True)}
    layout = zero.layout
    return {i: lp_to_hp.get(id(p), p) for i, p in enumerate(layout.all_params) if layout.owns(i)}


def hp_params(zero: ZeroOptimizer) -> list[torch.Tensor]:
    """Every param's fp32 value (the master where one exists), broadcast from its owner."""
    lp_to_hp = {id(lp): hp for lp, hp in zip(zero.lp_params, zero.hp_masters, strict=True)}
    out = []
    for i, p in enumerate(zero.layout.all_params):
        hp = lp_to_hp.get(id(p))
        if hp is None and (p.dtype not in LOW_DTYPES or zero.master_weights is False):
            out.append(p.detach().float().clone())  # fp32 or master-less: replicated
            continue
        value = hp.detach().clone() if hp is not None else torch.empty_like(p, dtype=torch.float32)
        zero.layout.broadcast_from_owner(i, value)
        out.append(value)
    return out


def _twin_optimizer(zero: ZeroOptimizer, stand_ins: list[torch.Tensor]) -> torch.optim.Optimizer:
    """zero's inner optimizer class over stand_ins, with its param groups' hyperparameters."""
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [s for s, g in zip(stand_ins, zero.layout.group_of, strict=True) if g == k],
        }
        for k, group in enumerate(zero.optim.param_groups)
    ]
    cls = type(zero.optim)
    accepted = inspect.signature(cls).parameters  # defaults may hold more (AdamW's)
    defaults = {k: v for k, v in zero.optim.defaults.items() if k in accepted}
    try:
        return cls(groups, **defaults)
    except TypeError as exc:
        raise TypeError(
            f"A gathered ZeRO checkpoint rebuilds {cls.__name__} from its param_groups and "
            f"defaults, which failed: {exc}"
        ) from exc


def unsharded_twin(
    zero: ZeroOptimizer, *, current: bool = False
) -> tuple[MixedPrecisionOptimizer, list[torch.Tensor]]:
    """An unsharded MixedPrecisionOptimizer over CPU stand-ins of every param, and what its
    inner optimizer holds for each (master or param), in param index order.

    current=True (for a load): the stand-ins hold the params' current values, the masters
    this rank owns their current fp32 values, the scaler and counters zero's, so what a
    checkpoint lacks (a plain torch optimizer's has no masters, no scaler) stays as it is, by
    the unsharded load's own rules, instead of coming back as zeros."""
    stand_ins = [  # a DTensor's stand-in stays zeros: its values live over its tp mesh
        p.detach().to("cpu", copy=True)
        if current and local(p) is p
        else torch.zeros_like(p, device="cpu")
        for p in zero.layout.all_params
    ]
    inner = _twin_optimizer(zero, stand_ins)
    twin = MixedPrecisionOptimizer(
        inner,
        loss_scale=zero.scaler.cfg,
        master_weights=zero.master_weights,
        max_consecutive_skips=None,
        fused_step=False,
        lean=None if zero.lean is None else zero.lean.cfg,  # its state format, its stream
    )
    if zero.lean is not None:  # the stream as rank 0 of one process would hold it
        twin.lean.seed = base_seed(zero.lean.seed, rank_and_world()[0])
        twin.lean.counter.copy_(zero.lean.counter.cpu())
    twin_held = [p for g in inner.param_groups for p in g["params"]]
    twin.scaler.load_state_dict(zero.scaler.state_dict())
    twin.steps, twin.skipped_steps = zero.steps, zero.skipped_steps
    if current:
        with torch.no_grad():
            for i, mine in held(zero).items():
                if local(mine) is mine:
                    twin_held[i].copy_(mine)  # an owned fp32 master (or the param itself)
    return twin, twin_held


def gathered_state_dict(zero: ZeroOptimizer) -> dict[str, Any] | None:
    """The whole optimizer, gathered on group rank 0 as an unsharded optimizer's state_dict
    (None on other ranks). Rank 0 holds the full masters and state while building it."""
    lp_ids = {id(lp) for lp in zero.lp_params}
    layout = zero.layout
    local_part = {
        i: (
            {
                k: v.detach().cpu() if torch.is_tensor(v) else v
                for k, v in zero.state.get(tensor, {}).items()
            },
            tensor.detach().cpu() if id(layout.all_params[i]) in lp_ids else None,
        )
        for i, tensor in held(zero).items()
    }
    parts: list[Any] = [local_part]
    if layout.world > 1:
        parts = [None] * layout.world if layout.rank == 0 else []
        dist.gather_object(
            local_part,
            parts if layout.rank == 0 else None,
            dst=layout.global_rank(0),
            group=layout.group,
        )
    if layout.rank != 0:
        return None
    twin, twin_held = unsharded_twin(zero)
    for part in parts:
        for i, (state, master) in part.items():
            if master is not None:
                twin_held[i].detach().copy_(master)
            if state:
                twin.optim.state[twin_held[i]] = state
    return twin.state_dict()


def load_gathered(zero: ZeroOptimizer, state_dict: dict[str, Any]) -> MixedPrecisionOptimizer:
    """Load an unsharded optimizer's state_dict into zero's params, masters, optimizer state
    and param groups, each rank its own shard; returns the twin it was loaded through (its
    scaler, counters and lean stream are the checkpoint's, for zero to take)."""
    twin, twin_held = unsharded_twin(zero, current=True)
    twin.load_state_dict(state_dict)  # the unsharded optimizer's own checks and layout
    for mine, loaded in zip(zero.optim.param_groups, twin.optim.param_groups, strict=True):
        mine.update({k: v for k, v in loaded.items() if k != "params"})  # lr, betas, ...
    twin_masters = {id(hp) for hp in twin.hp_masters}
    owned = held(zero)
    with torch.no_grad():
        for i, p in enumerate(zero.layout.all_params):
            source = twin_held[i]
            if id(source) in twin_masters:
                p.copy_(source)  # every rank's lp copy, rounded from the loaded master
            if i not in owned:
                continue
            if owned[i] is not p:
                owned[i].copy_(source)
            state = twin.optim.state.get(source, {})
            zero.optim.state.pop(owned[i], None)
            if state:  # per-param tensors follow the param; scalars (Adam's step) stay put
                zero.optim.state[owned[i]] = {
                    k: v.to(owned[i].device) if torch.is_tensor(v) and v.shape == p.shape else v
                    for k, v in state.items()
                }
    return twin
