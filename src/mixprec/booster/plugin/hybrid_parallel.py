"""HybridParallelPlugin: Colossal-AI's pipeline (x data) parallel plugin over mixprec.pipeline.

    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=4, precision="fp16")
    booster = Booster(plugin=plugin)
    model, optimizer, criterion, _, _ = booster.boost(model, optimizer, criterion)
    out = booster.execute_pipeline(iter(loader), model, criterion, optimizer)
    optimizer.step(); optimizer.zero_grad()

The world is split into pp_size pipeline stages x tp_size tensor-parallel ranks per stage x
the rest data-parallel replicas.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mixprec.booster.plugin.plugin_base import Plugin, is_distributed, rank_and_world
from mixprec.checkpoint import load_checkpoint
from mixprec.mixed_precision import FP32Precision, MixedPrecision, to_mixed_precision
from mixprec.pipeline import (
    PipelineConfig,
    PipelinedModel,
    check_pp_size,
    data_shard,
    next_batch,
    prepare_pipeline,
)
from mixprec.pipeline_checkpoint import (
    load_pipeline_model_state,
    load_pipeline_optimizer_state,
    owns_key,
    pipeline_model_state,
    pipeline_optimizer_state,
    template_from_metadata,
)
from mixprec.pipeline_optim import PipelineOptimizer


class HybridParallelPlugin(Plugin):
    """Pipeline parallelism (torch.distributed.pipelining) under any mixprec precision.

    Args:
        tp_size: tensor-parallel ranks per stage (with tp_plan).
        pp_size: pipeline ranks; must divide the world size (the rest is data parallel).
        num_microbatches: micro-batches per batch (>= pp_size for '1f1b' and 'interleaved').
        precision: a mode name (mixprec.policy.MODES), a MixedPrecision, or None for the
            Booster's mixed_precision (fp32 when it has none).
        pp_schedule: '1f1b', 'gpipe' or 'interleaved' (torch's schedules of those names).
        num_model_chunks: stages per rank for 'interleaved' (default 2).
        split_points: nn.Sequential layer names where stages 1.. begin (default: balanced
            by parameter count).
        max_norm: clip gradients to this norm over all stages (0: off).
        tp_plan: module name -> torch ParallelStyle (ColwiseParallel(), RowwiseParallel(),
            ...), as torch's parallelize_module takes, applied to the stage holding each
            module over its tp ranks (a mixprec addition: Colossal shards by policy).
    """

    def __init__(
        self,
        tp_size: int = 1,
        pp_size: int = 1,
        num_microbatches: int | None = None,
        precision: str | MixedPrecision | None = None,
        pp_schedule: str = "1f1b",
        num_model_chunks: int | None = None,
        split_points: list[str] | tuple[str, ...] | None = None,
        max_norm: float = 0.0,
        tp_plan: Mapping[str, Any] | None = None,
    ) -> None:
        if num_microbatches is None and pp_size == 1:
            num_microbatches = 1  # one stage: the whole batch at once, as without a pipeline
        if num_microbatches is None:
            raise ValueError(
                f"num_microbatches=None: pp_size={pp_size} needs it set (>= pp_size, "
                "dividing the batch size)."
            )
        if max_norm < 0:
            raise ValueError(f"max_norm={max_norm!r} must be >= 0 (0 turns clipping off).")
        self.config = PipelineConfig(
            pp_size=pp_size,
            num_microbatches=num_microbatches,
            schedule=pp_schedule,
            num_model_chunks=num_model_chunks,
            split_points=None if split_points is None else tuple(split_points),
            tp_size=tp_size,
        )
        self.tp_plan = dict(tp_plan) if tp_plan else None
        if (tp_size != 1) != bool(self.tp_plan):
            raise ValueError(
                f"tp_size={tp_size!r} with tp_plan={tp_plan!r}: tensor parallelism needs both "
                "tp_size > 1 and tp_plan (module name -> torch ParallelStyle), or neither."
            )
        self.precision = None if precision is None else to_mixed_precision(precision)
        self.max_norm = float(max_norm)
        if is_distributed():  # every rank sees the same sizes: all raise, none hangs
            check_pp_size(pp_size, dist.get_world_size(), tp_size)

    def data_rank_and_world(self) -> tuple[int, int]:
        """Shards per data-parallel replica: a replica's stages must all read the same batch."""
        if not is_distributed():
            return rank_and_world()
        return data_shard(self.config.pp_size, self.config.tp_size)

    def _precision(self, booster_precision: MixedPrecision) -> MixedPrecision:
        if self.precision is None:
            return booster_precision
        if not isinstance(booster_precision, FP32Precision) and (
            booster_precision.policy.name != self.precision.policy.name
        ):
            raise ValueError(
                f"Booster(mixed_precision={booster_precision.policy.name!r}) and "
                f"HybridParallelPlugin(precision={self.precision.policy.name!r}) disagree; "
                "set the precision in one place."
            )
        return self.precision

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        mixed_precision: MixedPrecision,
        device: torch.device,
    ) -> tuple[nn.Module, PipelineOptimizer | None]:
        precision = self._precision(mixed_precision)
        return prepare_pipeline(
            model,
            optimizer,
            precision.policy,
            self.config,
            device=device,
            max_norm=self.max_norm,
            convert=precision.convert_module,
            tp_plan=self.tp_plan,
        )

    def execute_pipeline(
        self,
        data_iter: Any,
        model: nn.Module,
        criterion: Callable[..., torch.Tensor],
        optimizer: PipelineOptimizer,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        return _pipelined(model).run(
            next_batch(data_iter),
            criterion,
            optimizer,
            return_loss=return_loss,
            return_outputs=return_outputs,
        )

    # ----- checkpoints: torch.distributed.checkpoint directories, each stage writes its part -----
    def save_model(
        self, model: nn.Module, path: str | os.PathLike, optimizer: PipelineOptimizer | None
    ) -> None:
        from mixprec.booster.plugin.torch_fsdp import _dcp_save_atomic

        _dcp_save_atomic(pipeline_model_state(_pipelined(model), optimizer), path)

    def load_model(
        self,
        model: nn.Module,
        path: str | os.PathLike,
        optimizer: PipelineOptimizer | None,
        strict: bool = True,
    ) -> None:
        """A pipelined checkpoint directory, or a whole-model file (single process, DDP)."""
        import torch.distributed.checkpoint as dcp

        piped = _pipelined(model)
        if Path(path).is_file():
            state = load_checkpoint(path)
        else:
            state = {k: v.clone() for k, v in pipeline_model_state(piped, optimizer).items()}
            dcp.load(state, checkpoint_id=os.fspath(path))
        load_pipeline_model_state(piped, state, optimizer, strict=strict)

    def save_optimizer(
        self, optimizer: PipelineOptimizer, path: str | os.PathLike, model: nn.Module | None
    ) -> None:
        from mixprec.booster.plugin.torch_fsdp import _dcp_save_atomic

        _dcp_save_atomic(pipeline_optimizer_state(_pipelined(model), optimizer), path)

    def load_optimizer(
        self, optimizer: PipelineOptimizer, path: str | os.PathLike, model: nn.Module | None
    ) -> None:
        import torch.distributed.checkpoint as dcp

        piped = _pipelined(model)
        metadata = dcp.FileSystemReader(os.fspath(path)).read_metadata()
        state = template_from_metadata(metadata, lambda key: owns_key(piped, optimizer, key))
        dcp.load(state, checkpoint_id=os.fspath(path))
        load_pipeline_optimizer_state(piped, optimizer, state)


def _pipelined(model: nn.Module | None) -> PipelinedModel:
    if not isinstance(model, PipelinedModel):
        raise TypeError(
            "HybridParallelPlugin checkpoints need the model boost() returned (a "
            f"PipelinedModel), got {type(model).__name__}."
        )
    return model
