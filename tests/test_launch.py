"""Launchers on CPU with gloo: real process groups (world 1 in-process, world 2 in subprocesses)."""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mixprec.config import gpc
from mixprec.launch import (
    default_backend,
    destroy,
    get_default_parser,
    launch,
    launch_from_openmpi,
    launch_from_slurm,
    launch_from_torch,
)

CONFIG = {"fp16": {"mode": "torch"}, "BATCH_SIZE": 8}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def teardown():
    """Whatever a test initialises is torn down, so later tests start without a group."""
    yield
    destroy()
    assert not dist.is_initialized()


def test_launch_world_of_one_builds_a_real_gloo_group(teardown):
    config = launch(CONFIG, rank=0, world_size=1, host="127.0.0.1", port=free_port())
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert gpc.is_initialized and (gpc.rank, gpc.world_size) == (0, 1)
    assert config is gpc.config and gpc.config.BATCH_SIZE == 8
    assert gpc.config.fp16.mode == "torch"
    t = torch.tensor([3.0])
    dist.all_reduce(t)
    assert t.item() == 3.0  # one rank: the sum is the tensor itself
    destroy()
    assert not gpc.is_initialized and gpc.config == {} and gpc.local_rank is None


def test_launch_seeds_torch_random_and_numpy(teardown):
    launch({}, rank=0, world_size=1, host="127.0.0.1", port=free_port(), seed=7)
    drawn = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    torch.testing.assert_close(drawn[0], torch.rand(3), rtol=0, atol=0)  # same generator state
    assert (drawn[1], drawn[2]) == (random.random(), np.random.rand())


def test_launch_reuses_a_matching_group_and_refuses_another(teardown):
    port = free_port()
    launch({"A": 1}, rank=0, world_size=1, host="127.0.0.1", port=port)
    launch({"A": 2}, rank=0, world_size=1, host="127.0.0.1", port=port)  # same world: reuse
    assert gpc.config.A == 2
    # asking for a bigger world must not call init_process_group (it would wait forever)
    with pytest.raises(RuntimeError, match=r"world_size=1.*world_size=2.*destroy"):
        launch({}, rank=0, world_size=2, host="127.0.0.1", port=port)


def test_launch_from_torch_reads_torchrun_variables(monkeypatch, teardown):
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**env, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    launch_from_torch(CONFIG, verbose=False)
    assert gpc.is_initialized and (gpc.rank, gpc.world_size, gpc.local_rank) == (0, 1, 0)


def test_launch_from_slurm_reads_srun_variables(monkeypatch, teardown):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NPROCS", "1")
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    launch_from_slurm(CONFIG, host="127.0.0.1", port=free_port())
    assert gpc.is_initialized and gpc.world_size == 1
    # without SLURM_LOCALID (and without CUDA to derive one from) the local rank stays unknown
    assert gpc.local_rank == (0 if torch.cuda.is_available() else None)


def test_launch_from_slurm_takes_localid_and_ntasks(monkeypatch, teardown):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.delenv("SLURM_NPROCS", raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "1")  # SLURM_NPROCS's current name
    monkeypatch.setenv("SLURM_LOCALID", "0")
    launch_from_slurm({}, host="127.0.0.1", port=free_port())
    assert (gpc.world_size, gpc.local_rank) == (1, 0)


def test_launch_from_openmpi_reads_mpirun_variables(monkeypatch, teardown):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    launch_from_openmpi(CONFIG, host="127.0.0.1", port=free_port())
    assert gpc.is_initialized and (gpc.rank, gpc.world_size, gpc.local_rank) == (0, 1, 0)


TORCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_ENV = ("SLURM_PROCID", "SLURM_NPROCS")
OMPI_ENV = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE")
LAUNCHERS = {
    "launch_from_torch": (lambda: launch_from_torch({}), TORCH_ENV),
    "launch_from_slurm": (lambda: launch_from_slurm({}, "127.0.0.1", 1), SLURM_ENV),
    "launch_from_openmpi": (lambda: launch_from_openmpi({}, "127.0.0.1", 1), OMPI_ENV),
}
MISSING_CASES = [(name, var) for name, (_, names) in LAUNCHERS.items() for var in names]


@pytest.mark.parametrize("launcher, missing", MISSING_CASES)
def test_a_missing_variable_names_itself_and_its_launcher(monkeypatch, launcher, missing):
    call, names = LAUNCHERS[launcher]
    for name in (*TORCH_ENV, *SLURM_ENV, *OMPI_ENV, "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    for name in names:
        if name != missing:
            monkeypatch.setenv(name, "127.0.0.1" if name == "MASTER_ADDR" else "0")
    with pytest.raises(RuntimeError, match=rf"{launcher} .*{missing}"):
        call()
    assert not dist.is_initialized()


def test_a_non_integer_variable_names_itself(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "zero")
    with pytest.raises(ValueError, match=r"OMPI_COMM_WORLD_RANK='zero'"):
        launch_from_openmpi({}, host="127.0.0.1", port=1)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"rank": 2, "world_size": 2}, ValueError, "rank=2 must be < world_size=2"),
        ({"rank": -1}, ValueError, "rank=-1"),
        ({"world_size": 0}, ValueError, "world_size=0"),
        ({"world_size": 1.0}, TypeError, "world_size must be an int"),
        ({"port": 0}, ValueError, r"port=0 must be in \[1, 65535\]"),
        ({"host": ""}, ValueError, "host must be"),
        ({"backend": "glo"}, ValueError, "'glo'.*Did you mean 'gloo'"),
        ({"local_rank": -1}, ValueError, "local_rank=-1"),
        ({"config": {"fp16": {"mode": "fp61"}}}, ValueError, "'fp61'"),
    ],
)
def test_bad_arguments_fail_before_any_group_exists(kwargs, error, match):
    args = {"config": {}, "rank": 0, "world_size": 1, "host": "127.0.0.1", "port": 29500}
    with pytest.raises(error, match=match):
        launch(**(args | kwargs))
    assert not dist.is_initialized() and gpc.config == {}


def test_default_backend_follows_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_backend() == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_backend() == "nccl"


def test_only_rank_zero_logs_and_only_when_verbose(caplog, teardown):
    caplog.set_level(logging.INFO, logger="mixprec.launch")
    launch({}, rank=0, world_size=1, host="127.0.0.1", port=free_port(), verbose=False)
    assert caplog.records == []
    destroy()
    launch({}, rank=0, world_size=1, host="127.0.0.1", port=free_port(), seed=5)
    assert len(caplog.records) == 1
    assert "world_size=1, backend=gloo" in caplog.text and "seed=5" in caplog.text


def test_default_parser_reads_seed_001_arguments():
    parser = get_default_parser()
    args = parser.parse_args(
        [
            "--config",
            "config/config_AMP_torch.py",
            "--host",
            "node0",
            "--port",
            "29500",
            "--world_size",
            "4",
            "--rank",
            "3",
            "--local-rank",
            "1",
            "--backend",
            "gloo",
        ]
    )
    assert vars(args) == {
        "config": "config/config_AMP_torch.py",
        "host": "node0",
        "port": 29500,
        "world_size": 4,
        "rank": 3,
        "local_rank": 1,
        "backend": "gloo",
    }
    assert parser.parse_args(["--local_rank", "2"]).local_rank == 2
    assert parser.parse_args([]).backend is None  # None: launch picks nccl or gloo


WORKER = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from mixprec.config import gpc
    from mixprec.launch import launch, destroy

    rank, port, config, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    launch(config, rank=rank, world_size=2, host="127.0.0.1", port=port, verbose=False)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    result = {
        "rank": gpc.rank, "world_size": gpc.world_size, "sum": t.item(),
        "batch": gpc.config.BATCH_SIZE, "rand": torch.rand(4).tolist(),
    }
    destroy()
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    """
)


@pytest.mark.distributed
def test_launch_world_of_two_all_reduces_across_processes(tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "config.json").write_text(json.dumps({"BATCH_SIZE": 16, "fp16": {"mode": "naive"}}))
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two workers on two cores
    procs = [
        subprocess.Popen(
            [sys.executable, "worker.py", str(rank), port, "config.json", str(tmp_path)],
            cwd=tmp_path,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    errors = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2)]
    assert [r["sum"] for r in results] == [3.0, 3.0]  # 1 + 2, exact in fp32
    assert [r["batch"] for r in results] == [16, 16]
    # one seed on every rank (as Colossal-AI): replicated inits agree bit for bit
    assert results[0]["rand"] == results[1]["rand"]


# Colossal-AI today: no config (launch(rank, world_size, host, port), launch_from_torch(), ...)
def test_launch_without_config_in_todays_colossal_signature(teardown):
    config = launch(0, 1, "127.0.0.1", free_port(), "gloo", verbose=False)
    assert config == {} and gpc.is_initialized and (gpc.rank, gpc.world_size) == (0, 1)
    destroy()
    launch(rank=0, world_size=1, host="127.0.0.1", port=free_port(), config=CONFIG)
    assert gpc.config["BATCH_SIZE"] == 8  # config= by keyword still loads one


def test_launch_from_torch_without_config(monkeypatch, teardown):
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**env, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    launch_from_torch("gloo", 7, False)  # Colossal today: (backend, seed, verbose)
    assert gpc.config == {} and dist.get_backend() == "gloo"
    assert torch.initial_seed() == 7
    destroy()
    launch_from_torch()
    assert gpc.is_initialized and gpc.config == {}


def test_host_launchers_without_config(monkeypatch, teardown):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NPROCS", "1")
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    launch_from_slurm("127.0.0.1", free_port())
    assert gpc.config == {} and gpc.world_size == 1
    destroy()
    for name in ("RANK", "LOCAL_RANK", "SIZE"):
        monkeypatch.setenv(f"OMPI_COMM_WORLD_{name}", "1" if name == "SIZE" else "0")
    launch_from_openmpi(host="127.0.0.1", port=free_port(), config=CONFIG)
    assert gpc.config["BATCH_SIZE"] == 8


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: launch(0, 1, "127.0.0.1"), "missing a required argument: 'port'"),
        (lambda: launch({}, 0, 1), "legacy: the config first"),
        (lambda: launch_from_torch("gloo", backend="nccl"), "multiple values"),
        (lambda: launch_from_slurm("127.0.0.1"), r"launch_from_slurm\(host, port"),
    ],
)
def test_a_call_matching_neither_signature_names_both(call, match):
    with pytest.raises(TypeError, match=match):
        call()
    assert not dist.is_initialized()
