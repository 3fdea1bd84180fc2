"""Optimizer checkpoints: torch's layout, with mixprec's fp32 masters placed by param index.

`state`/`param_groups` are the inner optimizer's (it steps the masters, so its state is fp32);
beside them `master_weights` and `master_index` (each master's position in torch's flat param
numbering) let a checkpoint move between modes: a saved master lands on this optimizer's
master at that index, or on the param itself where this mode keeps none (exact for fp32
params); a master this optimizer has but the checkpoint lacks is rebuilt from its lp param.
"""

from __future__ import annotations

from typing import Any

import torch


def upgrade_optimizer_checkpoint(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint in torch's layout: mixprec's older {'optimizer': {...}, ...} is flattened."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}.")
    if "param_groups" in state_dict and "state" in state_dict:
        return state_dict
    if {"optimizer", "master_weights", "scaler"} <= set(state_dict):  # before torch's layout
        old = dict(state_dict)
        return {**old.pop("optimizer"), **old}
    raise KeyError(
        "Not an optimizer checkpoint: it needs torch's 'state' and 'param_groups' (or mixprec's "
        f"older 'optimizer', 'master_weights' and 'scaler'); got keys {sorted(state_dict)}."
    )


def saved_masters(
    state_dict: dict[str, Any], held: list[torch.Tensor], own: list[int]
) -> dict[int, torch.Tensor]:
    """{flat param index: saved fp32 master}, checked against `held` (the params the inner
    optimizer steps). `own`: the indices of this optimizer's masters, which older checkpoints
    (no master_index) fill in order."""
    masters = list(state_dict.get("master_weights") or [])
    index = state_dict.get("master_index")
    if index is None:
        if masters and len(masters) != len(own):
            raise ValueError(
                f"Checkpoint holds {len(masters)} master weights, this optimizer has {len(own)}: "
                "was it saved from another model or mode?"
            )
        index = own[: len(masters)]
    if len(index) != len(masters):
        raise ValueError(
            f"Checkpoint's master_index names {len(index)} params for {len(masters)} masters."
        )
    out = {}
    for i, saved in zip(index, masters, strict=True):
        if not 0 <= int(i) < len(held):
            raise ValueError(
                f"Checkpoint has a master for param {i}; this optimizer steps {len(held)} params: "
                "was it saved from another model?"
            )
        if held[i].shape != saved.shape:
            raise ValueError(
                f"Master weight shape {tuple(saved.shape)} != {tuple(held[i].shape)} (param {i})."
            )
        out[int(i)] = saved
    return out


@torch.no_grad()
def place_masters(
    held: list[torch.Tensor], master_to_lp: dict[int, torch.Tensor], saved: dict[int, torch.Tensor]
) -> int:
    """Copy each saved master onto the param at its index (and its lp param); rebuild the
    masters the checkpoint lacks from their lp params, unless a master already rounds to its
    lp param (a load_model that came first wrote both, the master with the checkpoint's fp32
    value: keeping it makes the load order not matter). Returns how many were rebuilt."""
    rebuilt = 0
    for i, p in enumerate(held):
        lp = master_to_lp.get(id(p))
        if i in saved:
            p.copy_(saved[i])
            if lp is not None:
                lp.copy_(saved[i])
        elif lp is not None and not torch.equal(p.to(lp.dtype), lp):
            p.copy_(lp)  # the lp param was loaded apart from its master: it is the newer value
            rebuilt += 1
    return rebuilt
