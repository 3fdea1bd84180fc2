"""Colossal-AI's launchers: build the default process group, set the device, seed, fill gpc.

`launch` is the general one; `launch_from_torch`, `launch_from_slurm` and
`launch_from_openmpi` read rank and world size from the variables each launcher exports.

Both of Colossal-AI's signatures work: today's, without a config
(`launch(rank, world_size, host, port)`, `launch_from_torch()`,
`launch_from_slurm(host, port)`), and the legacy one with the config first
(`launch(config, rank, world_size, host, port)`, `launch_from_torch(config)`, ...). Without a
config gpc.config is empty (`config=` may still be given by keyword); `initialize` then takes
its settings from its own `config=` argument.

Seeding: every rank gets the same `seed` (as Colossal-AI does), so replicated models are
initialised identically on every rank, which data parallelism needs; draw per-rank randomness
(dropout masks, data shuffles) from `seed + gpc.rank` yourself where it must differ.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mixprec.config import Config, ConfigLike, gpc, load_config
from mixprec.core.policy import did_you_mean

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


def _is_backend_name(value: object) -> bool:
    """A backend spelling ('gloo', 'cpu:gloo,cuda:nccl'), as opposed to a config path."""
    return isinstance(value, str) and (value in BACKENDS or ":" in value)


def _plain(sig: inspect.Signature) -> inspect.Signature:
    """A signature as a user reads it: names and defaults, no annotations."""
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return sig.replace(parameters=params, return_annotation=inspect.Signature.empty)


def _today(legacy: inspect.Signature) -> inspect.Signature:
    """Colossal-AI's current form of a legacy signature: the config leaves the front and is
    a keyword-only argument defaulting to None."""
    params = [p for name, p in legacy.parameters.items() if name != "config"]
    config = legacy.parameters["config"].replace(kind=inspect.Parameter.KEYWORD_ONLY, default=None)
    return legacy.replace(parameters=[*params, config])


def _bind(who: str, legacy: Callable[..., Any], is_modern: bool, args, kwargs) -> dict[str, Any]:
    """The call's arguments by name, read in Colossal-AI's current or legacy signature (the
    legacy one is `legacy`'s: the config first)."""
    legacy_form = inspect.signature(legacy)
    modern_form = _today(legacy_form)
    try:
        bound = (modern_form if is_modern else legacy_form).bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(
            f"{who}: {err}. Call it as {who}{_plain(modern_form)} (Colossal-AI today) "
            f"or {who}{_plain(legacy_form)} (legacy: the config first)."
        ) from None
    bound.apply_defaults()
    return dict(bound.arguments)


def launch(*args: Any, **kwargs: Any) -> Config:
    """launch(rank, world_size, host, port, backend=None, local_rank=None, seed=1024,
    verbose=True, timeout=None, *, config=None), or the legacy launch(config, rank, ...).

    Both Colossal-AI signatures: the legacy one is recognised by a first positional argument
    that is not an int (the config). See `_launch` for the arguments.
    """
    modern = not args or (isinstance(args[0], int) and not isinstance(args[0], bool))
    return _launch(**_bind("launch", _launch, modern, args, kwargs))


def _launch(
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


def _host_launcher_legacy(
    config: ConfigLike,
    host: str,
    port: int,
    backend: str | None = None,
    seed: int = 1024,
    verbose: bool = True,
) -> None: ...


def _host_launcher_args(who: str, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    # legacy: (config, host, port, ...) -- a second positional str, or a positional before host=
    legacy = (len(args) >= 2 and isinstance(args[1], str)) or (bool(args) and "host" in kwargs)
    return _bind(who, _host_launcher_legacy, not legacy, args, kwargs)


def launch_from_torch(*args: Any, **kwargs: Any) -> Config:
    """launch() from torchrun's (and `mixprec run`'s) RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*.

    launch_from_torch(backend=None, seed=1024, verbose=True, *, config=None) as Colossal-AI
    today, or the legacy launch_from_torch(config, backend=None, seed=1024, verbose=True).
    """
    modern = not args or _is_backend_name(args[0])
    return _launch_from_torch(
        **_bind("launch_from_torch", _launch_from_torch, modern, args, kwargs)
    )


def _launch_from_torch(
    config: ConfigLike, backend: str | None = None, seed: int = 1024, verbose: bool = True
) -> Config:
    who = "launch_from_torch (torchrun / mixprec run)"
    return _launch(
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


@dataclass(frozen=True)
class _SchedulerEnv:
    """Where a scheduler's processes find their rank, world size and local rank."""

    tool: str  # what starts the processes, named in errors
    rank: str
    world_size: tuple[str, ...]  # the variable, then its fallback
    local_rank: str
    local_rank_optional: bool  # unset leaves local_rank=None


_SLURM = _SchedulerEnv(
    "srun", "SLURM_PROCID", ("SLURM_NPROCS", "SLURM_NTASKS"), "SLURM_LOCALID", True
)
_OPENMPI = _SchedulerEnv(
    "mpirun",
    "OMPI_COMM_WORLD_RANK",
    ("OMPI_COMM_WORLD_SIZE",),
    "OMPI_COMM_WORLD_LOCAL_RANK",
    False,
)


def _launch_from_scheduler(who: str, env: _SchedulerEnv, args: tuple, kwargs: dict) -> Config:
    """launch() with the ranks from env's variables, host and port from the call."""
    bound = _host_launcher_args(who, args, kwargs)
    launcher = f"{who} ({env.tool})"
    fallback = env.world_size[1] if len(env.world_size) > 1 else None
    unset = env.local_rank_optional and env.local_rank not in os.environ
    return _launch(
        bound["config"],
        rank=_env_int(env.rank, launcher),
        world_size=_env_int(env.world_size[0], launcher, fallback=fallback),
        host=bound["host"],
        port=bound["port"],
        backend=bound["backend"],
        local_rank=None if unset else _env_int(env.local_rank, launcher),
        seed=bound["seed"],
        verbose=bound["verbose"],
    )


def launch_from_slurm(*args: Any, **kwargs: Any) -> Config:
    """launch() from srun's SLURM_PROCID, SLURM_NPROCS (or SLURM_NTASKS), SLURM_LOCALID.

    launch_from_slurm(host, port, backend=None, seed=1024, verbose=True, *, config=None), or
    the legacy launch_from_slurm(config, host, port, ...).
    """
    return _launch_from_scheduler("launch_from_slurm", _SLURM, args, kwargs)


def launch_from_openmpi(*args: Any, **kwargs: Any) -> Config:
    """launch() from mpirun's OMPI_COMM_WORLD_RANK, _LOCAL_RANK and _SIZE.

    launch_from_openmpi(host, port, backend=None, seed=1024, verbose=True, *, config=None), or
    the legacy launch_from_openmpi(config, host, port, ...).
    """
    return _launch_from_scheduler("launch_from_openmpi", _OPENMPI, args, kwargs)


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
