"""Colossal-AI's `initialize(...)`: a config's precision, ZeRO, DDP and pipeline applied.

Reads the config, turns `fp16` into a Policy and builds an Engine (or, for
`parallel=dict(pipeline=N)`, a PipelineEngine) from the core's pieces; see the package
docstring.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mixprec.config import (
    ConfigLike,
    config_to_pipeline,
    config_to_policy,
    gpc,
    load_config,
    validate_config,
)
from mixprec.core.multi_loss import prepare_loss_optimizer
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import Policy, clip_norm_for
from mixprec.core.prepare import FP32Criterion, prepare_model
from mixprec.core.scaling import rank_and_world
from mixprec.core.validate import check_bool
from mixprec.engine.engine import Engine, _check_compile
from mixprec.parallel.data import shard_loader
from mixprec.parallel.zero import check_cpu_offload, prepare_zero_optimizer, to_zero_config

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
    Its keys: `fp16=dict(mode=AMP_TYPE.X, **mode_keys)` (absent: fp32), `clip_grad_norm`
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
    if config is None:
        config = gpc.config
        validate_config(config)
    else:
        config = load_config(config)
    policy = config_to_policy(config)
    # fp16=dict(mode=NAIVE, clip_grad_norm=...) or the top-level clip_grad_norm: clipped once
    max_norm = clip_norm_for(policy, float(config.get("clip_grad_norm") or 0.0))
    accumulation = int(config.get("gradient_accumulation") or 1)
    compile_flag = _check_compile(config.get("compile", False), accumulation, lr_scheduler)
    pipeline = config_to_pipeline(config)
    if pipeline is not None:  # parallel=dict(pipeline=N): stages, 1F1B, execute_schedule
        if compile_flag:
            raise ValueError(
                "compile=True cannot run a pipeline (parallel=dict(pipeline=N)): its stages "
                "step through torch.distributed.pipelining's schedules. Drop one of the two."
            )
        from mixprec.engine.pipeline_engine import initialize_pipeline

        pp_size, num_microbatches = pipeline
        return initialize_pipeline(
            model,
            optimizer,
            criterion,
            (train_dataloader, test_dataloader),
            lr_scheduler,
            policy=policy,
            pp_size=pp_size,
            num_microbatches=num_microbatches,
            max_norm=max_norm,
            accumulation=accumulation,
            device=_current_device(),
        )

    zero = to_zero_config(config.get("zero"))

    device = _current_device()
    if device is not None:
        model.to(device)  # moves parameter data in place: the optimizer keeps the same tensors
    if zero is not None:
        check_cpu_offload(zero.cpu_offload, device or torch.device("cpu"))
    if zero is not None and zero.level == 3:
        precision_model, mp_optimizer = _fsdp_prepare(model, optimizer, policy, max_norm, device)
    else:
        precision_model = prepare_model(model, policy)
    rank, world_size = rank_and_world()
    wrapped: nn.Module = precision_model
    if world_size > 1:
        if zero is None:  # ZeRO reduces gradients itself (levels 1-2 at step, 3 in FSDP2)
            # DDP broadcasts rank 0's (already cast) weights; masters are copied after that
            device_ids = None if device is None else [device.index]
            wrapped = DistributedDataParallel(precision_model, device_ids=device_ids)
        train_dataloader, test_dataloader = (
            shard_loader(loader, rank, world_size, f"mixprec.engine.initialize({which})")
            for loader, which in (
                (train_dataloader, "train_dataloader"),
                (test_dataloader, "test_dataloader"),
            )
        )
    if zero is None:
        mp_optimizer = prepare_loss_optimizer(optimizer, policy, max_norm=max_norm)  # num_losses
    elif zero.level < 3:
        mp_optimizer = prepare_zero_optimizer(
            optimizer, policy, stage=zero.level, max_norm=max_norm
        )
    mp_optimizer.name_params(model)  # so a collapsing scale names the overflowing parameters
    engine = Engine(
        wrapped,
        mp_optimizer,
        None if criterion is None else FP32Criterion(criterion),
        lr_scheduler=lr_scheduler,
        gradient_accumulation=accumulation,
        policy=policy,
        compile_step=compile_flag,
    )
    if verbose and rank == 0:
        log.info(
            "mixprec.engine.initialize: mode=%s, world_size=%d, clip_grad_norm=%g, "
            "gradient_accumulation=%d",
            policy.name,
            world_size,
            max_norm,
            accumulation,
        )
    return engine, train_dataloader, test_dataloader, lr_scheduler


def _fsdp_prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    policy: Policy,
    max_norm: float,
    device: torch.device | None,
) -> tuple[nn.Module, MixedPrecisionOptimizer]:
    """zero level 3: the Booster's FSDP2 path (params, grads and state sharded), clipped."""
    from mixprec.booster.plugin.torch_fsdp import TorchFSDPPlugin  # FSDP imports take ~0.5 s
    from mixprec.mixed_precision import MixedPrecision

    device = device or next(model.parameters()).device
    if dist.is_available() and dist.is_initialized():  # else configure() says what to do
        with torch.no_grad():  # fully_shard keeps each rank's own init: start from rank 0's
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.detach(), src=0)
    model, mp_optimizer = TorchFSDPPlugin().configure(
        model, optimizer, MixedPrecision(policy), device
    )
    assert mp_optimizer is not None
    mp_optimizer.max_norm = max_norm
    return model, mp_optimizer
