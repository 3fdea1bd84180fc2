"""What the seed scripts import beyond AMP: get_dist_logger, get_dataloader, the LR schedulers;
and seed 000's and seed 003's scripts themselves, run end to end on offline data."""

from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import free_port, spawn
from torch.utils.data import DistributedSampler, TensorDataset

from mixprec.logging import get_dist_logger
from mixprec.nn.lr_scheduler import CosineAnnealingLR, LinearWarmupLR
from mixprec.utils import get_dataloader

ROOT = Path(__file__).resolve().parents[1]
SEED_SCRIPTS = ROOT / "examples" / "seed_scripts"
EPOCH_LINE = re.compile(r"Epoch (\d+) - train loss: (\S+), lr: (\S+)")


@pytest.fixture
def restore_logger():
    logger = logging.getLogger("seed_scripts_test")
    yield logger
    logger.handlers.clear()


def test_dist_logger_writes_on_the_ranks_asked_for(restore_logger, capsys, tmp_path) -> None:
    logger = get_dist_logger("seed_scripts_test")
    assert get_dist_logger("seed_scripts_test") is logger  # one per name, as in Colossal-AI
    logger.log_to_file(tmp_path, mode="w")
    logger.info("to rank 0", ranks=[0])
    logger.info("to rank 1", ranks=[1])  # outside torch.distributed this process is rank 0
    logger.warning("to everyone")
    out = capsys.readouterr().out
    assert "seed_scripts_test - INFO: to rank 0" in out and "to everyone" in out
    assert "to rank 1" not in out
    assert "to rank 0" in (tmp_path / "rank_0.log").read_text()
    with pytest.raises(TypeError, match=r"ranks=0 must be None or a list of int ranks"):
        logger.info("x", ranks=0)
    with pytest.raises(ValueError, match=r"level='LOUD'; valid: 'DEBUG'"):
        logger.set_level("LOUD")


def _linear_warmup_reference(base: float, t: int, warmup: int, total: int) -> float:
    if t < warmup:
        return base * (t + 1) / (warmup + 1)
    return base * max(0.0, (total - t) / max(1, total - warmup))


@pytest.mark.parametrize("warmup, total", [(3, 10), (0, 4), (50, 5)])
def test_linear_warmup_lr_follows_colossals_formula(warmup: int, total: int) -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.4)
    sched = LinearWarmupLR(opt, warmup_steps=warmup, total_steps=total)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(total + 2):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    expected = [_linear_warmup_reference(0.4, t, warmup, total) for t in range(total + 3)]
    torch.testing.assert_close(lrs, expected, rtol=1e-12, atol=0)  # float64 arithmetic
    assert min(lrs) >= 0.0  # held at 0 past total_steps


def test_cosine_annealing_lr_by_total_steps() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = CosineAnnealingLR(opt, total_steps=8, eta_min=0.01)
    lrs = []
    for _ in range(8):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    expected = [0.01 + 0.09 * (1 + math.cos(math.pi * t / 8)) / 2 for t in range(1, 9)]
    torch.testing.assert_close(lrs, expected, rtol=1e-9, atol=1e-12)  # torch's recursive form


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda o: CosineAnnealingLR(o, total_steps=0), ValueError, r"total_steps=0 must be >= 1"),
        (lambda o: LinearWarmupLR(o, 10, warmup_steps=-1), ValueError, r"warmup_steps=-1"),
        (lambda o: LinearWarmupLR(o, 10.0), TypeError, r"total_steps=10.0 must be an int"),
    ],
)
def test_schedulers_reject_bad_steps(make, error, match) -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(error, match=match):
        make(opt)


def test_get_dataloader_without_a_group_is_a_plain_loader() -> None:
    data = TensorDataset(torch.arange(10.0))
    loader = get_dataloader(data, shuffle=False, batch_size=4, drop_last=True)
    assert [b[0].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match=r"get_dataloader chooses sampler itself"):
        get_dataloader(data, sampler=None)


def _sharded_loader_and_logger(rank: int, world: int, log_dir: str) -> None:
    data = TensorDataset(torch.arange(20.0))
    loader = get_dataloader(data, shuffle=True, batch_size=5)
    assert isinstance(loader.sampler, DistributedSampler)
    first = torch.cat([b[0] for b in loader])
    second = torch.cat([b[0] for b in loader])
    gathered = [torch.empty_like(first) for _ in range(world)]
    dist.all_gather(gathered, first)
    assert sorted(torch.cat(gathered).tolist()) == list(range(20))  # disjoint shards, all data
    assert not torch.equal(first, second)  # reshuffled on the next pass
    logger = get_dist_logger("seed_scripts_dist")
    logger.log_to_file(log_dir, mode="w")
    logger.info(f"only rank 0 (I am {rank})", ranks=[0])
    logger.info(f"every rank (I am {rank})")


@pytest.mark.distributed
def test_get_dataloader_shards_and_the_logger_filters_ranks_on_two_processes(tmp_path) -> None:
    spawn(_sharded_loader_and_logger, 2, str(tmp_path))
    rank0, rank1 = ((tmp_path / f"rank_{r}.log").read_text() for r in (0, 1))
    assert "only rank 0 (I am 0)" in rank0 and "every rank (I am 0)" in rank0
    assert "only rank 0" not in rank1 and "every rank (I am 1)" in rank1


def _run_seed_script(name: str, **env: str) -> list[tuple[int, float, float]]:
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    full_env.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
        OFFLINE_SAMPLES="16",  # one batch: fp16 convolutions are slow on CPU
        OFFLINE_WIDTH="4",
        NUM_EPOCHS="2",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), full_env.get("PYTHONPATH", "")]),
        **env,
    )
    proc = subprocess.run(
        [sys.executable, str(SEED_SCRIPTS / name)],
        cwd=SEED_SCRIPTS,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [(int(e), float(loss), float(lr)) for e, loss, lr in EPOCH_LINE.findall(proc.stdout)]


@pytest.mark.slow
def test_seed_000_resnet_script_runs_as_written() -> None:
    lines = _run_seed_script("seed000_resnet_amp.py")
    assert [e for e, _, _ in lines] == [0, 1]  # logged once per epoch, on rank 0
    assert all(math.isfinite(loss) for _, loss, _ in lines)
    # CosineAnnealingLR(total_steps=NUM_EPOCHS=2) stepped per epoch: 0.1 -> 0.05 -> 0
    assert [lr for _, _, lr in lines] == pytest.approx([0.05, 0.0], abs=1e-12)


def test_seed_003_booster_script_runs_as_written() -> None:
    lines = _run_seed_script("seed003_booster_amp.py", BATCH_SIZE="16")
    assert [e for e, _, _ in lines] == [0, 1]
    assert all(math.isfinite(loss) for _, loss, _ in lines)
    # LinearWarmupLR(warmup_steps=50, total_steps=2) stepped per epoch from lr 1e-2
    expected = [_linear_warmup_reference(1e-2, t, 50, 2) for t in (1, 2)]
    assert [lr for _, _, lr in lines] == pytest.approx(expected, rel=1e-4)  # printed with .5g
