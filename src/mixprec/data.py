"""Data loading shared by the faces that shard data over ranks (Engine, Booster plugins)."""

from __future__ import annotations

from torch.utils.data import DistributedSampler


class EpochShuffledDistributedSampler(DistributedSampler):
    """A DistributedSampler that reshuffles on every pass, as the RandomSampler it replaces did.

    DistributedSampler draws the same permutation each epoch unless set_epoch is called;
    Colossal-style loops never call it, so each `iter()` advances the epoch by itself. An
    explicit set_epoch(e) before a pass still selects epoch e's permutation.
    """

    def __iter__(self):
        indices = super().__iter__()
        self.set_epoch(self.epoch + 1)
        return indices
