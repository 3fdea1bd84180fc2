"""Colossal-AI's `colossalai.utils.get_dataloader`: a DataLoader that shards itself over ranks.

    train_dataloader = get_dataloader(dataset=train_dataset, shuffle=True, batch_size=128,
                                      num_workers=1, pin_memory=True)

With torch.distributed up and more than one rank, each rank reads its own shard through a
DistributedSampler (reshuffled on every pass when shuffle=True, as a plain shuffled loader
is); otherwise it is an ordinary DataLoader. Keywords beyond the named ones go to DataLoader.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from mixprec.parallel.data import EpochShuffledDistributedSampler


def seed_worker(worker_id: int, seed: int) -> None:
    """Seed a worker's Python and torch RNGs (its random augmentations) with seed + its id."""
    random.seed(seed + worker_id)
    torch.manual_seed(seed + worker_id)


def get_dataloader(
    dataset: Dataset,
    shuffle: bool = False,
    seed: int = 1024,
    add_sampler: bool = True,
    drop_last: bool = False,
    pin_memory: bool = False,
    num_workers: int = 0,
    **kwargs: Any,
) -> DataLoader:
    """A DataLoader over dataset; a DistributedSampler (seeded with seed) when several ranks run.

    add_sampler=False keeps a plain DataLoader even then (every rank reads all of dataset).
    seed also seeds each worker process's RNGs. kwargs: DataLoader's (batch_size, ...).
    """
    if not isinstance(shuffle, bool):
        raise TypeError(f"shuffle={shuffle!r} must be a bool.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed={seed!r} must be an int.")
    for name in ("sampler", "batch_sampler", "worker_init_fn"):
        if name in kwargs:
            raise ValueError(
                f"get_dataloader chooses {name} itself; build a torch DataLoader to pass your own."
            )
    sharded = add_sampler and dist.is_available() and dist.is_initialized()
    if sharded and dist.get_world_size() > 1:
        cls = EpochShuffledDistributedSampler if shuffle else DistributedSampler
        sampler = cls(dataset, shuffle=shuffle, seed=seed)
        kwargs["sampler"] = sampler
    else:
        kwargs["shuffle"] = shuffle
    return DataLoader(
        dataset,
        drop_last=drop_last,
        pin_memory=pin_memory,
        num_workers=num_workers,
        worker_init_fn=functools.partial(seed_worker, seed=seed),  # picklable: spawn works
        **kwargs,
    )


__all__ = ["get_dataloader"]
