"""Run a function on N real processes joined by a gloo process group (CPU)."""

from __future__ import annotations

import gc
import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any

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
    finally:
        gc.collect()  # free DDP/FSDP state while the group lives: gloo can hang otherwise
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int = 2, *args: Any) -> None:
    """fn(rank, world, *args) on `world` processes; any rank's exception fails the caller."""
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")
        mp.spawn(_entry, args=(world, rendezvous, fn, args), nprocs=world, join=True)
