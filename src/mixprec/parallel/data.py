"""Data loading shared by the faces that shard data over ranks (Engine, Booster plugins)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)
from typing_extensions import override

log = logging.getLogger("mixprec")


class EpochShuffledDistributedSampler(DistributedSampler):
    """A DistributedSampler that reshuffles on every pass, as the RandomSampler it replaces did.

    DistributedSampler draws the same permutation each epoch unless set_epoch is called;
    Colossal-style loops never call it, so each `iter()` advances the epoch by itself. An
    explicit set_epoch(e) before a pass still selects epoch e's permutation.
    """

    @override
    def __iter__(self):
        indices = super().__iter__()
        self.set_epoch(self.epoch + 1)
        return indices


def _distributed_sampler(loader: DataLoader, rank: int, world_size: int) -> DistributedSampler:
    """The DistributedSampler that keeps loader's order: epoch-reshuffled for a RandomSampler,
    unshuffled for a SequentialSampler; any other sampler (or a random draw with replacement or
    of a subset) raises ValueError naming it."""
    if isinstance(loader.sampler, RandomSampler):
        if loader.sampler.replacement or loader.sampler._num_samples is not None:
            raise ValueError(
                "Cannot shard a RandomSampler that draws with replacement or a num_samples "
                "subset; pass a DataLoader with shuffle=True or your own DistributedSampler."
            )
        return EpochShuffledDistributedSampler(
            loader.dataset, num_replicas=world_size, rank=rank, shuffle=True
        )
    if isinstance(loader.sampler, SequentialSampler):
        return DistributedSampler(loader.dataset, num_replicas=world_size, rank=rank, shuffle=False)
    raise ValueError(
        f"Cannot shard a DataLoader with sampler {type(loader.sampler).__name__}. Valid: "
        "RandomSampler (shuffle=True), SequentialSampler (shuffle=False), or a "
        "DistributedSampler you built yourself."
    )


def dataloader_to_distributed(loader: DataLoader, rank: int, world_size: int) -> DataLoader:
    """The same DataLoader over this rank's shard: one DistributedSampler per rank.

    A RandomSampler becomes a sampler reshuffled every epoch (seed shared by all ranks, so
    shards never overlap), a SequentialSampler an unshuffled one. Loaders that already use a
    DistributedSampler, or stream an IterableDataset (shard those yourself), are returned
    unchanged; any other sampler is an error, since its order could not be kept.
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"Dataloaders passed to initialize must be torch DataLoaders, got {type(loader)!r}."
        )
    if isinstance(loader.dataset, IterableDataset):
        log.warning(
            "mixprec.engine.initialize: %s streams an IterableDataset, which a "
            "DistributedSampler cannot shard; each rank reads what the dataset yields to it.",
            type(loader.dataset).__name__,
        )
        return loader
    if isinstance(loader.sampler, DistributedSampler):
        return loader
    if loader.batch_size is None:
        raise ValueError(
            f"Cannot shard a DataLoader built with batch_sampler={loader.batch_sampler!r}: "
            "pass batch_size=... with shuffle=True/False (or your own DistributedSampler)."
        )
    sampler = _distributed_sampler(loader, rank, world_size)
    kwargs: dict[str, Any] = {}
    if loader.num_workers > 0:  # DataLoader refuses these options without worker processes
        kwargs.update(
            prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers,
            multiprocessing_context=loader.multiprocessing_context,
        )
        if hasattr(loader, "in_order"):  # torch >= 2.6
            kwargs["in_order"] = loader.in_order
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        pin_memory_device=loader.pin_memory_device,
        **kwargs,
    )


def shard_loader(
    loader: Iterable[Any] | None, rank: int, world_size: int, who: str
) -> Iterable[Any] | None:
    """What initialize hands back for one data iterable in a world of world_size ranks.

    A DataLoader gets this rank's shard (dataloader_to_distributed). Any other iterable (a
    generator, a list of batches, a custom loader) cannot be sharded by mixprec: it is returned
    as it is, with a WARNING, and each rank iterates what it yields to that rank, as Colossal-AI's
    initialize (which never shards) did. None stays None.
    """
    if loader is None:
        return None
    if isinstance(loader, DataLoader):
        return dataloader_to_distributed(loader, rank, world_size)
    if not isinstance(loader, Iterable):
        raise TypeError(f"{who}: the data must be an iterable of batches, got {loader!r}.")
    if world_size > 1:
        log.warning(
            "%s: a %s is not a torch DataLoader, so mixprec cannot shard it over the %d ranks: "
            "every rank iterates whatever it yields to that rank. Make it yield each rank its "
            "own shard (e.g. index by torch.distributed.get_rank()), or pass a DataLoader.",
            who,
            type(loader).__name__,
            world_size,
        )
    return loader
