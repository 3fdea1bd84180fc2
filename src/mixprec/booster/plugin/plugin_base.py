"""The plugin base: how a Booster places, wraps and checkpoints what it boosts.

The base class is the single-process plugin (the Booster's default): it wraps nothing and,
when a process group is up, lets rank 0 alone write checkpoints. TorchDDPPlugin and
TorchFSDPPlugin override only the hooks that differ.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from mixprec.core.checkpoint import (
    hp_model_state_copy,
    hp_model_state_dict,
    load_checkpoint,
    load_hp_model_state_dict,
    save_checkpoint,
)
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.prepare import PrecisionModule
from mixprec.core.scaling import ProcessGroup, rank_and_world
from mixprec.mixed_precision import MixedPrecision
from mixprec.parallel.data import EpochShuffledDistributedSampler


def refuse_non_defaults(plugin: str, given: dict[str, Any], refused: dict[str, tuple]) -> None:
    """Raise naming the first keyword of Colossal's signature that mixprec does not implement
    when it is set away from its default: refused[name] = (default, why)."""
    for name, (default, why) in refused.items():
        value = given[name]
        if value is not default and value != default:
            raise NotImplementedError(
                f"{plugin}({name}={value!r}) is not supported by mixprec: {why}. Leave {name} "
                f"at {default!r}."
            )


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside a boosted one (peels DDP and PrecisionModule wrappers)."""
    while isinstance(model, DDP | PrecisionModule):
        model = model.module
    return model


class Plugin:
    """Single process: no parallel wrapper; rank 0 writes checkpoints when a world is up."""

    @property
    def process_group(self) -> ProcessGroup | None:
        """Ranks that must agree on skipping a step (None: the world, if initialised)."""
        return None

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        mixed_precision: MixedPrecision,
        device: torch.device,
    ) -> tuple[nn.Module, MixedPrecisionOptimizer | None]:
        """Model in precision, then wrapped; optimizer wrapped last (masters copy final params)."""
        boosted = self.wrap_model(mixed_precision.convert_module(model.to(device)), device)
        if optimizer is None:
            return boosted, None
        return boosted, mixed_precision.convert_optimizer(
            optimizer, process_group=self.process_group
        )

    def wrap_model(self, model: PrecisionModule, device: torch.device) -> nn.Module:
        return model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Accumulate gradients without cross-rank communication (nothing to skip here)."""
        return contextlib.nullcontext()

    def data_rank_and_world(self) -> tuple[int, int]:
        """(this rank's data shard, number of shards): every rank reads its own by default."""
        return rank_and_world()

    def prepare_dataloader(
        self,
        dataset: Dataset,
        batch_size: int,
        shuffle: bool = False,
        seed: int = 1024,
        drop_last: bool = False,
        pin_memory: bool = False,
        num_workers: int = 0,
        **kwargs: Any,
    ) -> DataLoader:
        """A DataLoader over this rank's part of dataset (DistributedSampler when world > 1)."""
        rank, world = self.data_rank_and_world()
        order: dict[str, Any]
        if world > 1:
            # Reshuffles on every pass by itself: seed 003's loop never calls set_epoch.
            sampler = EpochShuffledDistributedSampler(
                dataset,
                num_replicas=world,
                rank=rank,
                shuffle=shuffle,
                seed=seed,
                drop_last=drop_last,
            )
            order = {"sampler": sampler}
        else:  # the same order on every run
            order = {"shuffle": shuffle, "generator": torch.Generator().manual_seed(seed)}
        return DataLoader(
            dataset,
            batch_size=batch_size,
            drop_last=drop_last,
            pin_memory=pin_memory,
            num_workers=num_workers,
            **order,
            **kwargs,
        )

    # ----- checkpoints: one torch.save file, written by rank 0 -----
    writes_dtensor_shards = False
    """True where the plugin's own checkpoint is per-rank DTensor shards (a DCP directory)."""

    def _write(self, obj: Any, path: str | os.PathLike) -> None:
        if rank_and_world()[0] == 0:
            save_checkpoint(obj, path)
        barrier()  # no rank reads the file before it is complete

    def model_state(self, model: nn.Module, optimizer: MixedPrecisionOptimizer | None) -> Any:
        """The whole model's fp32 state on rank 0 (masters where the optimizer keeps them)."""
        return hp_model_state_dict(unwrap_model(model), optimizer)

    def load_model_state(
        self,
        model: nn.Module,
        state: dict[str, Any],
        optimizer: MixedPrecisionOptimizer | None,
        strict: bool = True,
    ) -> None:
        load_hp_model_state_dict(unwrap_model(model), state, optimizer, strict=strict)

    def optimizer_state(self, optimizer: MixedPrecisionOptimizer, model: nn.Module | None) -> Any:
        """The whole optimizer's state on rank 0 (masters, scaler, counters)."""
        return optimizer.state_dict()

    def load_optimizer_state(
        self, optimizer: MixedPrecisionOptimizer, state: dict[str, Any], model: nn.Module | None
    ) -> None:
        optimizer.load_state_dict(state)

    def save_as(
        self,
        what: str,
        target: Any,
        path: str | os.PathLike,
        partner: Any,
        *,
        shard: bool = False,
        gather_dtensor: bool | None = None,
        size_per_shard: int = 1024,
        use_safetensors: bool = False,
        prefix: str | None = None,
    ) -> None:
        """Booster.save_model / save_optimizer with Colossal's keywords (what: 'model' or
        'optimizer'; partner: the optimizer of a model, the model of an optimizer)."""
        from mixprec.booster.checkpoint_io import (
            MODEL_INDEX,
            OPTIMIZER_INDEX,
            save_safetensors_file,
            save_sharded,
        )

        native = self.writes_dtensor_shards
        if gather_dtensor is False and not native:
            raise ValueError(
                f"gather_dtensor=False: {type(self).__name__} holds no DTensor shards; its "
                "checkpoints are whole tensors (leave gather_dtensor unset or True)."
            )
        if gather_dtensor is False and (shard or use_safetensors):
            raise ValueError(
                "gather_dtensor=False writes each rank's DTensor shards (a "
                "torch.distributed.checkpoint directory); shard=True / use_safetensors=True "
                "write gathered tensors: leave gather_dtensor unset."
            )
        gather = gather_dtensor if gather_dtensor is not None else not native
        if not (shard or use_safetensors or (gather and native)):
            if what == "model":
                return self.save_model(target, path, partner)
            return self.save_optimizer(target, path, partner)
        if what == "model":
            state = self.model_state(target, partner)
        else:
            state = self.optimizer_state(target, partner)
        if rank_and_world()[0] == 0:
            if shard:
                index = MODEL_INDEX[use_safetensors] if what == "model" else OPTIMIZER_INDEX
                save_sharded(
                    state,
                    path,
                    index_name=index,
                    size_per_shard=size_per_shard,
                    use_safetensors=use_safetensors,
                    prefix=prefix,
                )
            elif use_safetensors:
                save_safetensors_file(state, path)
            else:
                save_checkpoint(state, path)
        barrier()

    def save_model(
        self, model: nn.Module, path: str | os.PathLike, optimizer: MixedPrecisionOptimizer | None
    ) -> None:
        self._write(self.model_state(model, optimizer), path)

    def load_model(
        self,
        model: nn.Module,
        path: str | os.PathLike,
        optimizer: MixedPrecisionOptimizer | None,
        strict: bool = True,
    ) -> None:
        from mixprec.booster.checkpoint_io import is_dcp_directory, load_state_file

        user_model = unwrap_model(model)
        if is_dcp_directory(path):  # from FSDP or the pipeline
            state = _dcp_read_model_state(user_model, path, optimizer)
        else:  # a file (torch or safetensors) or a sharded directory
            state = load_state_file(path)
        self.load_model_state(model, state, optimizer, strict=strict)

    def save_optimizer(
        self, optimizer: MixedPrecisionOptimizer, path: str | os.PathLike, model: nn.Module | None
    ) -> None:
        self._write(self.optimizer_state(optimizer, model), path)

    def load_optimizer(
        self, optimizer: MixedPrecisionOptimizer, path: str | os.PathLike, model: nn.Module | None
    ) -> None:
        from mixprec.booster.checkpoint_io import load_state_file

        self.load_optimizer_state(optimizer, load_state_file(path), model)

    def save_lr_scheduler(self, lr_scheduler: Any, path: str | os.PathLike) -> None:
        self._write(lr_scheduler.state_dict(), path)

    def load_lr_scheduler(self, lr_scheduler: Any, path: str | os.PathLike) -> None:
        lr_scheduler.load_state_dict(load_checkpoint(path))


def _dcp_read_model_state(
    model: nn.Module, path: str | os.PathLike, optimizer: MixedPrecisionOptimizer | None
) -> dict[str, Any]:
    """Read a torch.distributed.checkpoint model directory into full fp32 CPU tensors."""
    import torch.distributed.checkpoint as dcp

    # fresh tensors: DCP reads into them, the model's own params stay untouched until loaded
    template = hp_model_state_copy(model, optimizer)
    with warnings.catch_warnings():  # single-process loading is intended here, not a mistake
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, checkpoint_id=os.fspath(path), no_dist=not is_distributed())
    return template
