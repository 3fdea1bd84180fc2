"""Colossal-AI's `initialize(...)`: a config's precision, ZeRO, DDP and pipeline applied.

Parses the config once (mixprec.config.parse_config: one typed EngineConfig), builds the Booster
plugin it means (ZeRO 1/2, FSDP2, DDP or one process) and lets the plugin assemble policy ->
(model, optimizer) as Booster.boost does, then wraps them in an Engine; `parallel=dict(pipeline=N)`
builds a PipelineEngine through the pipeline's own assembly (mixprec.parallel.pipeline).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mixprec.booster.plugin import LowLevelZeroPlugin, Plugin, TorchDDPPlugin
from mixprec.config import ConfigLike, EngineConfig, gpc, load_config, parse_config
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.prepare import FP32Criterion
from mixprec.core.scaling import rank_and_world
from mixprec.core.validate import check_bool
from mixprec.engine.engine import Engine
from mixprec.mixed_precision import FP32Precision, MixedPrecision
from mixprec.parallel.data import shard_loader
from mixprec.parallel.zero import check_cpu_offload

log = logging.getLogger("mixprec")


def _current_device() -> torch.device | None:
    """The launched rank's CUDA device, or None on CPU (the model then stays where it is)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: Callable[..., torch.Tensor] | None = None,
    train_dataloader: Iterable[Any] | None = None,
    test_dataloader: Iterable[Any] | None = None,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    *,
    config: ConfigLike = None,
    verbose: bool = True,
) -> tuple[Engine, Iterable[Any] | None, Iterable[Any] | None, Any]:
    """Colossal-AI's `initialize`: the config's precision applied to model, optimizer, criterion.

    config: a mapping or a .py/.json/.toml path; None reads `gpc.config` (set by launch).
    Its keys: `fp16=dict(mode=AMP_TYPE.X, **mode_keys)` (absent: fp32), `fp8=dict(recipe=...,
    **Float8Config_fields)` (or True, a recipe name, a Float8Config: float8 Linear layers under
    the fp16 section's mode; mixprec's extension), `clip_grad_norm`
    (float; 0 or absent: off), `gradient_accumulation` (int N >= 1), `zero=dict(level=1|2|3)`
    (mixprec.parallel.zero: sharded masters and state, + gradients, + params via FSDP2; no DDP then).
    Other keys are the user's and are left alone.
    lr_scheduler: when given, the engine steps it after every optimizer step that was not
    skipped; it is returned unchanged. Leave it out to step a schedule yourself.
    On CUDA the model moves to the current device first. With world size > 1 the prepared
    model is wrapped in DistributedDataParallel and DataLoaders get DistributedSamplers; any
    other data iterable is returned as it is, with a WARNING: each rank then iterates what it
    yields to that rank (shard it yourself, as under Colossal-AI's initialize, which never
    shards).
    Returns (engine, train_dataloader, test_dataloader, lr_scheduler). With
    `parallel=dict(pipeline=N)` and NUM_MICRO_BATCHES the engine is a PipelineEngine
    (mixprec.engine.pipeline_engine).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model)!r}.")
    # checked before the model is cast in place, so a bad call leaves it untouched
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(
        optimizer, MixedPrecisionOptimizer
    ):
        raise TypeError(
            f"optimizer must be a plain torch.optim.Optimizer over model's parameters, got "
            f"{type(optimizer)!r}; initialize wraps it once."
        )
    check_bool("verbose", verbose)
    # parsed once, into one typed object (load_config's own check would parse it twice)
    spec = parse_config(gpc.config if config is None else load_config(config, validate=False))
    policy = spec.policy  # carries the clip: every path reads max_norm from the policy
    if spec.pipeline is not None:  # parallel=dict(pipeline=N): stages, 1F1B, execute_schedule
        if spec.compile:
            raise ValueError(
                "compile=True cannot run a pipeline (parallel=dict(pipeline=N)): its stages "
                "step through torch.distributed.pipelining's schedules. Drop one of the two."
            )
        from mixprec.engine.pipeline_engine import initialize_pipeline

        return initialize_pipeline(
            model,
            optimizer,
            criterion,
            (train_dataloader, test_dataloader),
            lr_scheduler,
            policy=policy,
            pp_size=spec.pipeline.pp_size,
            num_microbatches=spec.pipeline.num_microbatches,
            max_norm=spec.max_norm,
            accumulation=spec.gradient_accumulation,
            device=_current_device(),
        )

    device = _current_device()
    if device is not None:
        model.to(device)  # moves parameter data in place: the optimizer keeps the same tensors
    rank, world_size = rank_and_world()
    plugin = plugin_for(spec, world_size)
    fsdp = spec.zero is not None and spec.zero.level == 3
    if fsdp:  # FSDP2 keeps params on the model's device: offloading is refused or a no-op
        check_cpu_offload(spec.zero.cpu_offload, device or torch.device("cpu"))
    if fsdp and dist.is_available() and dist.is_initialized():
        with torch.no_grad():  # fully_shard keeps each rank's own init: start from rank 0's
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.detach(), src=0)
    # the Booster's assembly: policy -> (model, optimizer), wrapped as the plugin wraps
    precision = (
        FP32Precision() if isinstance(plugin, LowLevelZeroPlugin) else MixedPrecision(policy)
    )
    wrapped, mp_optimizer = plugin.configure(
        model, optimizer, precision, device or next(model.parameters(), torch.empty(0)).device
    )
    assert mp_optimizer is not None  # a plugin builds it with Colossal's methods, as for boost()
    if world_size > 1:
        train_dataloader, test_dataloader = (
            shard_loader(loader, rank, world_size, f"mixprec.engine.initialize({which})")
            for loader, which in (
                (train_dataloader, "train_dataloader"),
                (test_dataloader, "test_dataloader"),
            )
        )
    mp_optimizer.name_params(model)  # so a collapsing scale names the overflowing parameters
    engine = Engine(
        wrapped,
        mp_optimizer,
        None if criterion is None else FP32Criterion(criterion),
        lr_scheduler=lr_scheduler,
        gradient_accumulation=spec.gradient_accumulation,
        policy=policy,
        compile_step=spec.compile,
    )
    if verbose and rank == 0:
        log.info(
            "mixprec.engine.initialize: mode=%s, world_size=%d, clip_grad_norm=%g, "
            "gradient_accumulation=%d, plugin=%s",
            policy.name,
            world_size,
            spec.max_norm,
            spec.gradient_accumulation,
            type(plugin).__name__,
        )
    return engine, train_dataloader, test_dataloader, lr_scheduler


def plugin_for(spec: EngineConfig, world_size: int) -> Plugin:
    """The Booster plugin a parsed config means (no pipeline): ZeRO 1/2 -> LowLevelZeroPlugin,
    ZeRO 3 -> TorchFSDPPlugin, else DDP over more than one process, else the single process."""
    zero = spec.zero
    if zero is not None and zero.level == 3:
        from mixprec.booster.plugin.torch_fsdp import TorchFSDPPlugin  # ~0.5 s: when asked for

        return TorchFSDPPlugin()
    if zero is not None:
        return LowLevelZeroPlugin.from_policy(
            spec.policy, stage=zero.level, cpu_offload=zero.cpu_offload
        )
    return TorchDDPPlugin() if world_size > 1 else Plugin()
