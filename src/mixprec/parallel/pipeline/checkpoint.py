"""Checkpoint states of a pipelined model: each rank's stages under the unsplit model's names.

Model states hold fp32 weights (the masters where they exist) keyed as the unsplit model's
state_dict is (an nn.Sequential's '2.weight'; stage lists get the list index, '1.0.weight'),
so a torch.distributed.checkpoint directory written by the stages loads into the whole model
in one process. Optimizer states are flat too: per-param state under 'state.<name>.<key>',
the param groups' hyperparameters (LRs a scheduler moved), the scaler and the step counters;
each rank reads back only the keys of its own params.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.core.checkpoint import hp_model_state_dict, load_hp_model_state_dict
from mixprec.parallel.pipeline.optim import PipelineZeroOptimizer, StageOptimizer
from mixprec.parallel.pipeline.schedule import PipelinedModel

STATE = "state."


def pipeline_model_state(model: PipelinedModel, optimizer: StageOptimizer | None) -> dict:
    """This rank's stages' fp32 state under the unsplit model's keys (under ZeRO every master
    comes from the replica that owns it: a collective over the stage's data-parallel group)."""
    gathered: dict[int, torch.Tensor] = {}
    if isinstance(optimizer, PipelineZeroOptimizer):
        gathered = {
            id(p): hp.cpu()
            for p, hp in zip(optimizer.all_params, optimizer.hp_params(), strict=True)
        }
    out: dict[str, Any] = {}
    for prefix, stage in zip(model.stage_prefixes, model.stages, strict=True):
        state = hp_model_state_dict(stage.module, optimizer)
        for name, p in stage.module.named_parameters():
            if id(p) in gathered:
                state[name] = gathered[id(p)]
        for key, value in state.items():
            out[prefix + key] = value
    return out


def load_pipeline_model_state(
    model: PipelinedModel,
    state: dict[str, Any],
    optimizer: StageOptimizer | None,
    strict: bool = True,
) -> None:
    """Load this rank's keys of a (whole-model or pipelined) fp32 state into its stages."""
    for prefix, stage in zip(model.stage_prefixes, model.stages, strict=True):
        mine = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if prefix == "":  # an nn.Sequential cut: keep only the keys of this stage's layers
            layers = {name for name, _ in stage.module.named_children()}
            mine = {k: v for k, v in mine.items() if k.split(".", 1)[0] in layers}
        load_hp_model_state_dict(stage.module, mine, optimizer, strict=strict)


def _held_param_names(model: PipelinedModel, optimizer: StageOptimizer) -> dict[int, str]:
    """id(param as the optimizer holds it: the master for lp params) -> its global name, for
    the params this rank's optimizer steps (under ZeRO: those it owns)."""
    master_of = {
        id(lp): hp for lp, hp in zip(optimizer.lp_params, optimizer.hp_masters, strict=True)
    }
    held = {id(p) for g in optimizer.optim.param_groups for p in g["params"]}
    names = {}
    for prefix, stage in zip(model.stage_prefixes, model.stages, strict=True):
        for name, p in stage.module.named_parameters():
            key = id(master_of.get(id(p), p))
            if key in held:
                names[key] = prefix + name
    return names


def pipeline_optimizer_state(model: PipelinedModel, optimizer: StageOptimizer) -> dict:
    """This rank's optimizer state, flat: per-param state by global name, groups, scaler."""
    names = _held_param_names(model, optimizer)
    out: dict[str, Any] = {}
    for param, state in optimizer.optim.state.items():
        for key, value in state.items():
            out[f"{STATE}{names[id(param)]}.{key}"] = value
    for g, group in enumerate(optimizer.optim.param_groups):
        for key, value in group.items():
            if key != "params":
                out[f"param_groups.{g}.{key}"] = value
    for key, value in optimizer.scaler.state_dict().items():
        out[f"scaler.{key}"] = value
    out["steps"] = optimizer.steps
    out["skipped_steps"] = optimizer.skipped_steps
    return out


def owns_key(model: PipelinedModel, optimizer: StageOptimizer, key: str) -> bool:
    """Whether a saved optimizer key belongs to this rank (its params, or shared state)."""
    if not key.startswith(STATE):
        return True
    name = key[len(STATE) :].rsplit(".", 1)[0]
    return name in set(_held_param_names(model, optimizer).values())


def load_pipeline_optimizer_state(
    model: PipelinedModel, optimizer: StageOptimizer, state: dict[str, Any]
) -> None:
    """Install what pipeline_optimizer_state saved (this rank's keys) into optimizer."""
    by_name = {name: pid for pid, name in _held_param_names(model, optimizer).items()}
    held = {id(p): p for g in optimizer.optim.param_groups for p in g["params"]}
    optimizer.optim.state.clear()
    scaler: dict[str, Any] = {}
    for key, value in state.items():
        if key.startswith(STATE):
            name, field = key[len(STATE) :].rsplit(".", 1)
            if name in by_name:
                param = held[by_name[name]]
                optimizer.optim.state[param][field] = _laid_out_like(value, param)
        elif key.startswith("param_groups."):
            _, g, field = key.split(".", 2)
            optimizer.optim.param_groups[int(g)][field] = value
        elif key.startswith("scaler."):
            scaler[key[len("scaler.") :]] = value
    optimizer.scaler.load_state_dict(scaler)
    optimizer.steps = int(state["steps"])
    optimizer.skipped_steps = int(state["skipped_steps"])
    optimizer.zero_grad()


def template_from_metadata(metadata: Any, keep: Any) -> dict[str, Any]:
    """Empty tensors (and placeholders for pickled values) for the saved keys keep(key) wants."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not keep(key):
            continue
        if isinstance(meta, TensorStorageMetadata):
            out[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        else:
            out[key] = None  # a pickled value (a float, a tuple of betas): read whole
    return out


def _laid_out_like(value: Any, param: torch.Tensor) -> Any:
    """A whole saved state tensor sharded like its tensor-parallel (DTensor) param.

    Each tp rank read the whole tensor, so it cuts out its own shard with no communication.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor) or value.shape != param.shape:
        return value  # a scalar state (Adam's step) stays as saved
    return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
