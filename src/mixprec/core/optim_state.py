"""Optimizer checkpoints: torch's layout, with mixprec's fp32 masters placed by param index.

`state`/`param_groups` are the inner optimizer's (it steps the masters, so its state is fp32);
beside them `master_weights` and `master_index` (each master's position in torch's flat param
numbering) let a checkpoint move between modes: a saved master lands on this optimizer's
master at that index, or on the param itself where this mode keeps none (exact for fp32
params); a master this optimizer has but the checkpoint lacks is rebuilt from its lp param.
optimizer_state / load_optimizer_state are MixedPrecisionOptimizer's state_dict / load_state_dict.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from mixprec.core import lean as lean_step
from mixprec.core.scaling import rank_and_world
from mixprec.core.skip_monitor import scale_text

if TYPE_CHECKING:
    from mixprec.core.optim import MixedPrecisionOptimizer
    from mixprec.core.scaling import LossScaler

log = logging.getLogger("mixprec")


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


def optimizer_state(opt: MixedPrecisionOptimizer) -> dict[str, Any]:
    """A MixedPrecisionOptimizer's state_dict: torch's layout ({'state', 'param_groups'} of the
    params the inner optimizer steps, fp32 masters included) with mixprec's additions beside
    it: 'master_weights', 'master_index', 'scaler', 'steps', 'skipped_steps'. A plain torch
    optimizer over the fp32 model loads it as is (torch reads only its own two keys)."""
    # Counted first (the steps on the sync-free step's device record: one host sync), so what
    # watches the counts (StepCounter.watch: the LR schedule's rule) settles the param groups'
    # lr before they are saved.
    skipped = opt.skipped_steps
    state = opt.optim.state_dict()
    held = [p for g in opt.optim.param_groups for p in g["params"]]
    master_ids = {id(m) for m in opt.hp_masters}
    state["master_weights"] = [m.detach().clone() for m in opt.hp_masters]
    state["master_index"] = [i for i, p in enumerate(held) if id(p) in master_ids]
    state["scaler"] = opt.scaler.state_dict()
    state["steps"] = opt.steps
    state["skipped_steps"] = skipped
    if opt.lean is not None:  # compact low-bit state and the rounding's random stream
        opt.lean.state_dict_into(state)
    return state


def load_optimizer_state(opt: MixedPrecisionOptimizer, state_dict: dict[str, Any]) -> None:
    """Load into a MixedPrecisionOptimizer a checkpoint of its class (any mode), of a plain
    torch optimizer or of Apex.

    Masters the checkpoint lacks (torch, Apex, a mode without them) are rebuilt from the
    model's current params (load the model first); its scaler and counters, if absent, stay.
    """
    state_dict = upgrade_optimizer_checkpoint(state_dict)
    # The steps still on the sync-free step's device record belong to the run being left: they
    # are counted (one host sync; watchers told, StepCounter.watch) before anything is replaced.
    skipped = opt.skipped_steps
    held = [p for g in opt.optim.param_groups for p in g["params"]]
    master_to_lp = opt.transfer.master_to_lp()
    own = [i for i, p in enumerate(held) if id(p) in master_to_lp]
    saved = saved_masters(state_dict, held, own)
    if opt.lean is not None:  # loads its own state: torch would cast it to the params'
        state_dict, lean_saved, lean_entry = lean_step.split_state(state_dict)
        opt.optim.load_state_dict(state_dict)
        opt.lean.load_state(opt.optim, lean_saved, lean_entry)
    else:
        opt.optim.load_state_dict(lean_step.unpack_state_dict(state_dict))
    rebuilt = place_masters(held, master_to_lp, saved)
    if rebuilt and rank_and_world()[0] == 0:
        log.warning(
            "mixprec: the optimizer checkpoint holds no fp32 master weights for %d of this "
            "optimizer's %d (a plain torch optimizer's, Apex's, or another mode's), and the "
            "model's low-precision params were loaded apart from them: rebuilt them from "
            "those params (their rounding, not the fp32 values). To resume exactly, load "
            "the model with booster.load_model or mixprec's load_hp_model_state_dict (they "
            "write the masters too), before or after this optimizer",
            rebuilt,
            len(own),
        )
    if "scaler" in state_dict:
        load_scaler_state(opt.scaler, state_dict["scaler"], scales_loss=opt.scales_loss)
    opt.steps = int(state_dict.get("steps", opt.steps))
    opt.skipped_steps = int(state_dict.get("skipped_steps", skipped))
    opt.skip_monitor.resume(opt.steps)


def load_scaler_state(scaler: LossScaler, saved: dict[str, Any], *, scales_loss: bool) -> None:
    """Take a saved scaler's state, unless it came from a mode that scales differently: a
    mode without loss scaling (scales_loss False) keeps its 1.0 (a scale carried over would
    multiply every backward); a loss-scaling mode resumed from one without keeps its own first
    scale (a dynamic scale restarted at 1.0 would underflow fp16 grads for thousands of steps)."""
    saved_scale = float(torch.as_tensor(saved["scale"]).reshape(-1)[0])
    saved_scales = bool(saved.get("dynamic", saved_scale != 1.0)) or saved_scale != 1.0
    if saved_scales == scales_loss:
        scaler.load_state_dict(saved)
    elif saved_scales and rank_and_world()[0] == 0:
        log.warning(
            "mixprec: dropped the checkpoint's loss scale %s: this optimizer's mode does not "
            "scale the loss (bf16, fp32), so it keeps 1.0",
            scale_text(saved_scale),
        )
