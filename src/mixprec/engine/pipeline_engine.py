"""Colossal-AI's config face for pipelines: `parallel=dict(pipeline=N)` + NUM_MICRO_BATCHES.

    CONFIG = dict(fp16=dict(mode=AMP_TYPE.NAIVE), parallel=dict(pipeline=2), NUM_MICRO_BATCHES=4)
    engine, train_dataloader, _, _ = mixprec.engine.initialize(model, optimizer, criterion,
                                                               train_dataloader, config=CONFIG)
    engine.train()
    data_iter = iter(train_dataloader)
    for _ in range(len(train_dataloader)):
        engine.zero_grad()
        output, label, loss = engine.execute_schedule(data_iter)
        engine.step()

initialize builds this engine when the config names a pipeline; everything precise happens in
mixprec.parallel.pipeline.schedule (the core), with torch's Schedule1F1B.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from mixprec.booster.plugin.hybrid_parallel import HybridParallelPlugin
from mixprec.core.commit import StepResult
from mixprec.core.policy import Policy
from mixprec.core.prepare import FP32Criterion
from mixprec.engine.base import EngineBase
from mixprec.mixed_precision import FP32Precision, MixedPrecision
from mixprec.parallel.data import shard_loader
from mixprec.parallel.pipeline.optim import PipelineOptimizer
from mixprec.parallel.pipeline.schedule import PipelinedModel, data_shard, next_batch


class PipelineEngine(EngineBase):
    """The Engine of a pipelined model: `execute_schedule` replaces forward + backward."""

    def __init__(
        self,
        model: PipelinedModel,
        optimizer: PipelineOptimizer,
        criterion: FP32Criterion,
        *,
        lr_scheduler: Any = None,
        policy: Policy,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.criterion = criterion
        self.lr_scheduler = lr_scheduler
        self.policy = policy

    def execute_schedule(
        self,
        data_iter: Any,
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> tuple[torch.Tensor | None, Any, torch.Tensor | None]:
        """The next (inputs, labels) batch through the 1F1B schedule: (output, label, loss).

        All three are None on ranks without the last stage (and output, label when
        return_output_label is False). Gradients accumulate until step().
        """
        batch = next_batch(data_iter)
        result = self.model.run(
            batch,
            self.criterion,
            self.optimizer,
            return_loss=return_loss,
            return_outputs=return_output_label,
            forward_only=forward_only,
        )
        label = batch[1] if return_output_label and self.model.has_last_stage else None
        return result["outputs"], label, result["loss"]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "A pipelined engine runs whole batches: call engine.execute_schedule(data_iter)."
        )

    def backward(self, loss: torch.Tensor) -> None:
        raise RuntimeError(
            "execute_schedule already ran backward on every stage; call engine.step() next."
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> StepResult:
        """Unscale, check (all ranks agree), clip, step or skip; the LR schedule unless skipped."""
        return self._optimizer_step()

    def __repr__(self) -> str:
        return (
            f"PipelineEngine(policy={self.policy.name!r}, stages={self.model.stage_ids}, "
            f"num_microbatches={self.model.config.num_microbatches}, "
            f"clip_grad_norm={self.optimizer.max_norm})"
        )


def initialize_pipeline(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: Callable[..., torch.Tensor] | None,
    loaders: tuple[Iterable[Any] | None, Iterable[Any] | None],
    lr_scheduler: Any,
    *,
    policy: Policy,
    pp_size: int,
    num_microbatches: int,
    max_norm: float,
    accumulation: int,
    device: torch.device | None,
) -> tuple[PipelineEngine, Iterable[Any] | None, Iterable[Any] | None, Any]:
    """initialize's pipeline branch: stages, optimizer and loaders for a (dp, pp) world.

    device: the launched rank's CUDA device, or None on CPU.
    """
    if criterion is None:
        raise ValueError("A pipelined model needs its criterion: the last stage computes the loss.")
    if accumulation != 1:
        raise ValueError(
            f"gradient_accumulation={accumulation} with parallel.pipeline: the pipeline "
            "already accumulates NUM_MICRO_BATCHES micro-batches; set it to 1 or drop it."
        )
    # the Booster's pipeline plugin, over the config's whole policy (any mode, its clip)
    plugin = HybridParallelPlugin(
        pp_size=pp_size,
        num_microbatches=num_microbatches,
        precision=MixedPrecision(policy),
        max_norm=max_norm,
    )
    piped, mp_optimizer = plugin.configure(
        model, optimizer, FP32Precision(), device or torch.device("cpu")
    )
    # the plugin builds the stage optimizer with Colossal's methods, as for boost()
    assert isinstance(piped, PipelinedModel) and mp_optimizer is not None
    # A replica's stages must read the same batches in the same order: shard over dp only.
    dp_rank, dp_size = data_shard(pp_size)
    train, test = (
        shard_loader(loader, dp_rank, dp_size, "mixprec.engine.initialize (pipeline)")
        for loader in loaders
    )
    engine = PipelineEngine(
        piped, mp_optimizer, FP32Criterion(criterion), lr_scheduler=lr_scheduler, policy=policy
    )
    return engine, train, test, lr_scheduler
