"""Colossal-AI's launchers: build the default process group, set the device, seed, fill gpc.

`launch` is the general one; `launch_from_torch`, `launch_from_slurm` and
`launch_from_openmpi` read rank and world size from the variables each launcher exports.

Seeding: every rank gets the same `seed` (as Colossal-AI does), so replicated models are
initialised identically on every rank, which data parallelism needs; draw per-rank randomness
(dropout masks, data shuffles) from `seed + gpc.rank` yourself where it must differ.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import random
from datetime import timedelta

import torch
import torch.distributed as dist

from mixprec.config import Config, ConfigLike, gpc, load_config
from mixprec.policy import did_you_mean

logger = logging.getLogger(__name__)

BACKENDS: tuple[str, ...] = ("gloo", "nccl", "mpi", "ucc", "xccl")
"""Process-group backends launch accepts by name (composite 'cpu:gloo,cuda:nccl' also pass)."""


def default_backend() -> str:
    """nccl when CUDA is usable, gloo otherwise (gloo is the only CPU collective torch ships)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _check_backend(backend: str | None) -> str:
    if backend is None:
        return default_backend()
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {backend!r}.")
    if ":" in backend:  # device-specific form, e.g. 'cpu:gloo,cuda:nccl': torch validates it
        return backend
    if backend.lower() not in BACKENDS:
        raise ValueError(f"Unknown backend {backend!r}." + did_you_mean(backend, BACKENDS))
    return backend.lower()


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}.")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name}={value!r} must be {bound}.")
    return value


def seed_everything(seed: int) -> None:
    """Seed python's random, numpy (when installed) and torch (CPU and every CUDA device)."""
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device's generator


def launch(
    config: ConfigLike,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str | None = None,
    local_rank: int | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: timedelta | None = None,
) -> Config:
    """Load `config` into gpc, join the default process group, pick the device, seed.

    config: a mapping or a .py/.json/.toml path (see mixprec.config.load_config).
    host, port: the rank-0 rendezvous address (tcp://host:port).
    backend: None picks nccl with CUDA, gloo without.
    local_rank: this process's index on its node; with CUDA it selects the device
        (None: rank % device_count, as Colossal-AI does).
    seed: the same on every rank (see the module docstring).
    timeout: collective timeout handed to init_process_group (None: torch's default).
    Returns gpc.config. An already initialised default group is reused when its rank and
    world size match; a different one is an error.
    """
    rank = _check_int("rank", rank, 0)
    world_size = _check_int("world_size", world_size, 1)
    if rank >= world_size:
        raise ValueError(f"rank={rank} must be < world_size={world_size}.")
    port = _check_int("port", port, 1, 65535)
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be a non-empty address string, got {host!r}.")
    if local_rank is not None:
        local_rank = _check_int("local_rank", local_rank, 0)
    seed = _check_int("seed", seed, 0)
    backend = _check_backend(backend)
    # load (and validate) before joining the group, so a bad config fails without a hang
    loaded = load_config(config)
    if dist.is_initialized():
        have = (dist.get_rank(), dist.get_world_size())
        if have != (rank, world_size):
            raise RuntimeError(
                f"A default process group already exists with rank={have[0]}, "
                f"world_size={have[1]}; launch was asked for rank={rank}, "
                f"world_size={world_size}. Call mixprec.launch.destroy() first."
            )

    if torch.cuda.is_available():
        if local_rank is None:
            local_rank = rank % torch.cuda.device_count()
        # set before init: NCCL binds each rank's communicator to the current device
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        kwargs = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{host}:{port}",
            rank=rank,
            world_size=world_size,
            **kwargs,
        )
    gpc.load_config(loaded, validate=False)  # validated above
    gpc.set_local_rank(local_rank)
    seed_everything(seed)
    if verbose and rank == 0:
        logger.info(
            "Distributed environment initialised: world_size=%d, backend=%s, master=%s:%d, "
            "seed=%d, config keys=%s",
            world_size,
            dist.get_backend(),
            host,
            port,
            seed,
            sorted(gpc.config),
        )
    return gpc.config


def _env_int(name: str, launcher: str, *, fallback: str | None = None) -> int:
    """An integer environment variable; a missing or non-integer one names itself."""
    if name not in os.environ and fallback is not None and fallback in os.environ:
        name = fallback
    raw = os.environ.get(name)
    if raw is None:
        also = f" (or {fallback})" if fallback else ""
        raise RuntimeError(
            f"{launcher} expects the environment variable {name}{also}, but it is not set. "
            f"Start the script with the launcher that sets it, or call mixprec.launch.launch "
            f"with explicit rank/world_size/host/port."
        )
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"{launcher}: environment variable {name}={raw!r} is not an integer."
        ) from None


def _env_str(name: str, launcher: str) -> str:
    raw = os.environ.get(name)
    if not raw:
        raise RuntimeError(
            f"{launcher} expects the environment variable {name}, but it is not set."
        )
    return raw


def launch_from_torch(
    config: ConfigLike,
    backend: str | None = None,
    seed: int = 1024,
    verbose: bool = True,
) -> Config:
    """launch() from torchrun's (and `mixprec run`'s) RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*."""
    who = "launch_from_torch (torchrun / mixprec run)"
    return launch(
        config,
        rank=_env_int("RANK", who),
        world_size=_env_int("WORLD_SIZE", who),
        host=_env_str("MASTER_ADDR", who),
        port=_env_int("MASTER_PORT", who),
        backend=backend,
        local_rank=_env_int("LOCAL_RANK", who),
        seed=seed,
        verbose=verbose,
    )


def launch_from_slurm(
    config: ConfigLike,
    host: str,
    port: int,
    backend: str | None = None,
    seed: int = 1024,
    verbose: bool = True,
) -> Config:
    """launch() from srun's SLURM_PROCID, SLURM_NPROCS (or SLURM_NTASKS), SLURM_LOCALID."""
    who = "launch_from_slurm (srun)"
    local_rank = _env_int("SLURM_LOCALID", who) if "SLURM_LOCALID" in os.environ else None
    return launch(
        config,
        rank=_env_int("SLURM_PROCID", who),
        world_size=_env_int("SLURM_NPROCS", who, fallback="SLURM_NTASKS"),
        host=host,
        port=port,
        backend=backend,
        local_rank=local_rank,
        seed=seed,
        verbose=verbose,
    )


def launch_from_openmpi(
    config: ConfigLike,
    host: str,
    port: int,
    backend: str | None = None,
    seed: int = 1024,
    verbose: bool = True,
) -> Config:
    """launch() from mpirun's OMPI_COMM_WORLD_RANK, _LOCAL_RANK and _SIZE."""
    who = "launch_from_openmpi (mpirun)"
    return launch(
        config,
        rank=_env_int("OMPI_COMM_WORLD_RANK", who),
        world_size=_env_int("OMPI_COMM_WORLD_SIZE", who),
        host=host,
        port=port,
        backend=backend,
        local_rank=_env_int("OMPI_COMM_WORLD_LOCAL_RANK", who),
        seed=seed,
        verbose=verbose,
    )


def destroy() -> None:
    """Tear down the default process group (if any) and reset gpc.

    Drop DDP/FSDP models first: one freed after the group is gone can hang gloo's threads.
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()  # free unreferenced DDP reducers while their group still exists
        dist.destroy_process_group()
    gpc.reset()


def get_default_parser() -> argparse.ArgumentParser:
    """Colossal-AI's parser: --config, --host, --port, --world_size, --rank, --local_rank, --backend."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=str, help="path to the config file (.py/.json/.toml)")
    parser.add_argument("--host", type=str, help="the master address for distributed training")
    parser.add_argument("--port", type=int, help="the master port for distributed training")
    parser.add_argument("--world_size", type=int, help="world size for distributed training")
    parser.add_argument("--rank", type=int, help="rank for the default process group")
    # torch.distributed.launch passes --local-rank (torch >= 2.0) or --local_rank (older)
    parser.add_argument(
        "--local_rank", "--local-rank", dest="local_rank", type=int, help="local rank on the node"
    )
    parser.add_argument(
        "--backend",
        type=str,
        default=None,
        choices=BACKENDS,
        help="backend for distributed communication (default: nccl with CUDA, gloo without)",
    )
    return parser
