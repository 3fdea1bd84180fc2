"""Run a function on N real processes joined by a gloo process group (CPU)."""

from __future__ import annotations

import gc
import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, rendezvous: str, fn: Callable[..., Any], args: tuple) -> None:
    # A file rendezvous: no TCP port that a concurrent test run could take first.
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        # Every rank done before any tears down: a rank destroying its gloo pairs while a peer
        # still finishes its last collective aborted that peer once in CI (SIGABRT,
        # "terminate called without an active exception"). A rank that raised skips this, and
        # mp.spawn then terminates the others.
        dist.barrier()
    finally:
        gc.collect()  # free DDP/FSDP state while the group lives: gloo can hang otherwise
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int = 2, *args: Any) -> None:
    """fn(rank, world, *args) on `world` processes; any rank's exception fails the caller."""
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")
        mp.spawn(_entry, args=(world, rendezvous, fn, args), nprocs=world, join=True)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def scaler_state(opt: Any) -> list[torch.Tensor]:
    """A mixprec optimizer's scale and counters, as tensors to compare across ranks."""
    state = opt.scaler.state_dict()
    return [state["scale"], state["growth_tracker"], state["hysteresis_tracker"]]


def assert_same_on_every_rank(tensors: list[torch.Tensor], what: str) -> None:
    """All-gather tensors and require every rank's copy to equal rank 0's bit for bit."""
    # fp16/bf16 -> fp32 is exact, so comparing in fp32 is comparing bits (no nan expected).
    flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    for rank, other in enumerate(gathered[1:], start=1):
        torch.testing.assert_close(
            other, gathered[0], rtol=0, atol=0, msg=f"{what}: rank {rank} differs from rank 0"
        )
