"""Booster: Colossal-AI's one-call face over mixprec's core.

    booster = Booster(mixed_precision="fp16", plugin=TorchDDPPlugin())
    model, optimizer, criterion, dataloader, lr_scheduler = booster.boost(
        model, optimizer, criterion, dataloader, lr_scheduler)
    loss = criterion(model(x), y)
    booster.backward(loss, optimizer)
    optimizer.step(); optimizer.zero_grad(); lr_scheduler.step()

The mixed-precision object turns its mode into a Policy and the core applies it; the plugin
wraps the result (DDP, FSDP2) and writes checkpoints. Nothing here decides a dtype.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.booster.plugin.plugin_base import Plugin
from mixprec.core import multi_loss
from mixprec.core.compiled_step import CompiledStep, compile_step
from mixprec.core.lr_schedule import SkipAwareLRScheduler
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.prepare import FP32Criterion
from mixprec.core.skip_monitor import SkipStats
from mixprec.mixed_precision import MixedPrecision, OptimizerWrapperAPI, to_mixed_precision


class Booster:
    """Boosts a model, optimizer, criterion, dataloader and LR scheduler for training.

    Args:
        device: where the model trains (default: 'cuda' when available, else 'cpu').
        mixed_precision: None (fp32), a mode name (mixprec.core.policy.MODES: 'fp16', 'bf16',
            'fp16_naive', 'fp16_apex', 'fp8', 'fp32') or a MixedPrecision instance.
        plugin: TorchDDPPlugin, TorchFSDPPlugin, HybridParallelPlugin, or None (one process).
        compile_step: compile `train_step` (mixprec.compile_step); single process or DDP.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        mixed_precision: str | MixedPrecision | None = None,
        plugin: Plugin | None = None,
        *,
        compile_step: bool = False,
    ) -> None:
        if plugin is not None and not isinstance(plugin, Plugin):
            raise TypeError(
                f"plugin must be a mixprec Plugin (TorchDDPPlugin, TorchFSDPPlugin) or None, "
                f"got {plugin!r}."
            )
        if not isinstance(compile_step, bool):
            raise TypeError(f"compile_step={compile_step!r} must be a bool.")
        self.compile_step = compile_step
        self._steps: dict[tuple[int, int], CompiledStep] = {}
        self.mixed_precision = to_mixed_precision(mixed_precision)
        self.plugin = plugin or Plugin()
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(
                f"Booster device={device!r} is not a torch device; valid: 'cpu', 'cuda', "
                "'cuda:N' or a torch.device."
            ) from None
        # boosted model <-> its optimizer: checkpoints need the pair (masters, FSDP shards).
        self._optimizer_of: dict[int, MixedPrecisionOptimizer] = {}
        self._model_of: dict[int, nn.Module] = {}

    def boost(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., torch.Tensor] | None = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[
        nn.Module,
        MixedPrecisionOptimizer | None,
        FP32Criterion | None,
        Any,
        SkipAwareLRScheduler | None,
    ]:
        """The five, boosted: model in precision then wrapped by the plugin, optimizer wrapped
        for loss scaling and masters, criterion in fp32, LR scheduler skip-aware; the
        dataloader is returned as is (build it with plugin.prepare_dataloader)."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model)!r}.")
        if lr_scheduler is not None:
            if optimizer is None:
                raise ValueError("An lr_scheduler needs its optimizer passed to boost() too.")
            if getattr(lr_scheduler, "optimizer", optimizer) is not optimizer:
                raise ValueError(
                    "lr_scheduler was built over another optimizer than the one passed to boost()."
                )
        boosted, mp_optimizer = self.plugin.configure(
            model, optimizer, self.mixed_precision, self.device
        )
        if mp_optimizer is not None and not isinstance(mp_optimizer, OptimizerWrapperAPI):
            raise TypeError(
                f"{type(self.plugin).__name__}.configure returned a {type(mp_optimizer).__name__}"
                ", which has no Colossal OptimizerWrapper methods; a plugin builds one of "
                "mixprec.mixed_precision's Colossal*Optimizer classes (e.g. through "
                "mixed_precision.convert_optimizer)."
            )
        fp32_criterion = (
            None if criterion is None else self.mixed_precision.convert_criterion(criterion)
        )
        scheduler = None
        if lr_scheduler is not None:
            assert mp_optimizer is not None
            scheduler = SkipAwareLRScheduler(lr_scheduler, mp_optimizer)
        if mp_optimizer is not None:
            self._optimizer_of[id(boosted)] = mp_optimizer
            self._model_of[id(mp_optimizer)] = boosted
        return boosted, mp_optimizer, fp32_criterion, dataloader, scheduler

    @staticmethod
    def _check_optimizer(optimizer: Any) -> MixedPrecisionOptimizer:
        if not isinstance(optimizer, MixedPrecisionOptimizer):
            raise TypeError(
                f"Pass the optimizer boost() returned (a MixedPrecisionOptimizer), got "
                f"{type(optimizer).__name__}."
            )
        return optimizer

    def backward(
        self, loss: torch.Tensor, optimizer: MixedPrecisionOptimizer, loss_id: int = 0
    ) -> None:
        """Backward of the loss times the current loss scale (accumulates until step()).

        loss_id picks the loss scaler under FP16ApexMixedPrecision(num_losses=N)."""
        multi_loss.backward(self._check_optimizer(optimizer), loss, loss_id)

    def skip_stats(self, optimizer: MixedPrecisionOptimizer) -> SkipStats:
        """The boosted optimizer's step and skip counts, for logging (no host sync)."""
        return self._check_optimizer(optimizer).skip_stats

    def train_step(
        self,
        model: nn.Module,
        optimizer: MixedPrecisionOptimizer,
        criterion: Callable[..., torch.Tensor],
        *inputs: Any,
        target: Any,
    ) -> torch.Tensor:
        """One whole step of what boost() returned (forward .. optimizer step), as
        mixprec.compile_step runs it: compiled when Booster(compile_step=True). Returns the loss
        as a 0-dim tensor (no host sync). A boosted lr_scheduler sees this step's skip only
        after the CompiledStep's sync_counters()."""
        key = (id(model), id(optimizer))
        step = self._steps.get(key)
        if step is None:
            from mixprec.booster.plugin.torch_fsdp import TorchFSDPPlugin

            if isinstance(self.plugin, TorchFSDPPlugin):
                raise ValueError(
                    "train_step cannot run FSDP2-sharded models (DTensor parameters); use "
                    "TorchDDPPlugin or no plugin, or the eager booster.backward loop."
                )
            self._check_optimizer(optimizer)
            step = compile_step(model, optimizer, criterion, compile=self.compile_step)
            self._steps[key] = step
        return step(*inputs, target=target)

    def no_sync(
        self, model: nn.Module, optimizer: MixedPrecisionOptimizer | None = None
    ) -> contextlib.AbstractContextManager:
        """Gradient accumulation: backward passes inside skip the cross-rank reduction."""
        return self.plugin.no_sync(model)

    def execute_pipeline(
        self,
        data_iter: Any,
        model: nn.Module,
        criterion: Callable[..., torch.Tensor],
        optimizer: MixedPrecisionOptimizer,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        """Forward and backward of the next batch of data_iter through the pipeline schedule;
        {'loss': ..., 'outputs': ...} on the last stage's ranks, None elsewhere."""
        from mixprec.booster.plugin.hybrid_parallel import HybridParallelPlugin

        if not isinstance(self.plugin, HybridParallelPlugin):
            raise TypeError(
                f"execute_pipeline needs Booster(plugin=HybridParallelPlugin(pp_size=...)), "
                f"this Booster's plugin is {type(self.plugin).__name__}."
            )
        return self.plugin.execute_pipeline(
            data_iter, model, criterion, optimizer, return_loss, return_outputs
        )

    # ----- checkpoints -----
    def save_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike,
        shard: bool = False,
        gather_dtensor: bool | None = None,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_safetensors: bool = False,
        use_async: bool = False,
    ) -> None:
        """Save the model's weights in fp32 (the optimizer's masters where it keeps them).

        shard=True: a directory of an index JSON and shards of at most size_per_shard MB
        (prefix starts their names; safetensors with use_safetensors=True). gather_dtensor:
        None writes the plugin's own layout (FSDP and pipeline: each rank's DTensor shards, a
        torch.distributed.checkpoint directory; else one file), True gathers whole tensors
        (FSDP), False keeps the shards. use_async is refused (the write is synchronous)."""
        _check_save_keywords(shard, prefix, size_per_shard, use_async)
        self.plugin.save_as(
            "model",
            model,
            checkpoint,
            self._optimizer_of.get(id(model)),
            shard=shard,
            gather_dtensor=gather_dtensor,
            size_per_shard=size_per_shard,
            use_safetensors=use_safetensors,
            prefix=prefix,
        )

    def load_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike,
        strict: bool = True,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """Load weights saved in any mode and layout (file, sharded directory, safetensors,
        torch.distributed.checkpoint directory); the masters (if any) get the fp32 values.

        low_cpu_mem_mode: Colossal's memory/speed hint (False: cache shards in RAM to load
        faster). Either value loads the same tensor values; mixprec reads every checkpoint the
        one way (each file into CPU memory, then applied), so the hint changes nothing else.
        num_threads: must be 1 (shards are read one after another)."""
        _check_load_keywords(low_cpu_mem_mode, num_threads)
        self.plugin.load_model(model, checkpoint, self._optimizer_of.get(id(model)), strict=strict)

    def save_optimizer(
        self,
        optimizer: MixedPrecisionOptimizer,
        checkpoint: str | os.PathLike,
        shard: bool = False,
        gather_dtensor: bool | None = None,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_async: bool = False,
    ) -> None:
        """Save optimizer state, fp32 masters and the loss-scaler state (keywords as
        save_model's; a sharded optimizer checkpoint is in torch's format)."""
        optimizer = self._check_optimizer(optimizer)
        _check_save_keywords(shard, prefix, size_per_shard, use_async)
        self.plugin.save_as(
            "optimizer",
            optimizer,
            checkpoint,
            self._model_of.get(id(optimizer)),
            shard=shard,
            gather_dtensor=gather_dtensor,
            size_per_shard=size_per_shard,
            prefix=prefix,
        )

    def load_optimizer(
        self,
        optimizer: MixedPrecisionOptimizer,
        checkpoint: str | os.PathLike,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """Load optimizer state, fp32 masters and the loss-scaler state saved by
        save_optimizer (low_cpu_mem_mode and num_threads as load_model's)."""
        optimizer = self._check_optimizer(optimizer)
        _check_load_keywords(low_cpu_mem_mode, num_threads)
        self.plugin.load_optimizer(optimizer, checkpoint, self._model_of.get(id(optimizer)))

    def save_lr_scheduler(self, lr_scheduler: Any, path: str | os.PathLike) -> None:
        self.plugin.save_lr_scheduler(lr_scheduler, path)

    def load_lr_scheduler(self, lr_scheduler: Any, path: str | os.PathLike) -> None:
        self.plugin.load_lr_scheduler(lr_scheduler, path)


def _check_save_keywords(
    shard: bool, prefix: str | None, size_per_shard: int, use_async: bool
) -> None:
    if use_async:
        raise NotImplementedError(
            "use_async=True is not supported by mixprec: checkpoints are written before the "
            "call returns (atomically). Leave use_async at False."
        )
    if (
        isinstance(size_per_shard, bool)
        or not isinstance(size_per_shard, int)
        or size_per_shard < 1
    ):
        raise ValueError(f"size_per_shard={size_per_shard!r} must be a positive int (MB).")
    if not shard and (prefix is not None or size_per_shard != 1024):
        raise ValueError(
            f"prefix={prefix!r} / size_per_shard={size_per_shard!r} name and size the shard "
            "files of a sharded checkpoint: pass shard=True."
        )


def _check_load_keywords(low_cpu_mem_mode: bool, num_threads: int) -> None:
    if not isinstance(low_cpu_mem_mode, bool):  # a hint: either value loads the same tensors
        raise TypeError(f"low_cpu_mem_mode={low_cpu_mem_mode!r} must be a bool.")
    if num_threads != 1:
        raise NotImplementedError(
            f"num_threads={num_threads!r} is not supported by mixprec: shards are read one "
            "after another. Leave num_threads at 1."
        )
