"""Checkpoints: atomic writes, clear errors, fp32 model states, bitwise resume (1 rank and FSDP)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from conftest import tiny_mlp

from mixprec.booster import Booster
from mixprec.booster.plugin import TorchDDPPlugin, TorchFSDPPlugin
from mixprec.core.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from mixprec.mixed_precision import FP16NaiveMixedPrecision, FP16TorchMixedPrecision

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

WIDTH = 8  # fp16 matmuls are slow on CPU: tiny layers


class _Boom:
    def __reduce__(self):  # fails halfway through torch.save, after the tensor before it
        raise RuntimeError("disk full (simulated)")


def test_atomic_write_keeps_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"w": torch.arange(4.0)}, path)
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint({"w": torch.zeros(1000), "boom": _Boom()}, path)
    torch.testing.assert_close(load_checkpoint(path)["w"], torch.arange(4.0), rtol=0, atol=0)
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # the half-written temp file is gone


def test_unreadable_files_name_the_path(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"w": torch.randn(256)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="ckpt.pt.*truncated"):
        load_checkpoint(path)
    foreign = tmp_path / "notes.txt"
    foreign.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="notes.txt"):
        load_checkpoint(foreign)
    unsafe = tmp_path / "obj.pt"
    torch.save(copy.copy, unsafe)  # a function: torch.load(weights_only=True) refuses it
    with pytest.raises(CheckpointError, match="obj.pt"):
        load_checkpoint(unsafe)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_checkpoint(tmp_path / "missing.pt")


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(torch.get_default_device()).manual_seed(3)
    return torch.randn(8, WIDTH, generator=g), torch.randn(8, 4, generator=g)


def _setup(precision, seed: int, plugin=None):
    torch.manual_seed(seed)  # a different seed for the resumed run: the checkpoint must win
    booster = Booster(mixed_precision=precision, plugin=plugin)
    model = tiny_mlp(WIDTH)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    return booster, *booster.boost(model, optimizer, torch.nn.MSELoss(), None, scheduler)


def _train(booster, model, optimizer, criterion, scheduler, x, y, steps: int) -> None:
    for _ in range(steps):
        booster.backward(criterion(model(x), y), optimizer)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def _save(booster, model, optimizer, scheduler, where: Path) -> None:
    booster.save_model(model, where / "model")
    booster.save_optimizer(optimizer, where / "optimizer")
    booster.save_lr_scheduler(scheduler, where / "scheduler")


def _load(booster, model, optimizer, scheduler, where: Path) -> None:
    booster.load_model(model, where / "model")
    booster.load_optimizer(optimizer, where / "optimizer")
    booster.load_lr_scheduler(scheduler, where / "scheduler")


PRECISIONS = {
    # high first scales make the run skip steps and back off: the scaler state must resume too
    "fp16_naive": lambda: FP16NaiveMixedPrecision(initial_scale=2.0**20),
    "fp16": lambda: FP16TorchMixedPrecision(init_scale=2.0**24, growth_interval=2),
    "bf16": lambda: "bf16",
}


@pytest.mark.parametrize("mode", list(PRECISIONS))
def test_resume_is_bitwise_identical(mode: str, tmp_path: Path) -> None:
    x, y = _data()
    booster, model, optimizer, criterion, _, scheduler = _setup(PRECISIONS[mode](), seed=0)
    _train(booster, model, optimizer, criterion, scheduler, x, y, 4)
    _save(booster, model, optimizer, scheduler, tmp_path)
    _train(booster, model, optimizer, criterion, scheduler, x, y, 4)

    booster2, model2, optimizer2, criterion2, _, scheduler2 = _setup(PRECISIONS[mode](), seed=1)
    _load(booster2, model2, optimizer2, scheduler2, tmp_path)
    _train(booster2, model2, optimizer2, criterion2, scheduler2, x, y, 4)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # resuming is exact by contract
    for p, q in zip(optimizer.hp_masters, optimizer2.hp_masters, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert optimizer.loss_scale == optimizer2.loss_scale
    assert optimizer.skipped_steps == optimizer2.skipped_steps
    assert scheduler.get_last_lr() == scheduler2.get_last_lr()
    if mode != "bf16":
        assert optimizer.skipped_steps > 0  # the scaler really had something to resume


def test_fp16_naive_checkpoint_loads_into_fp32_model(tmp_path: Path) -> None:
    x, y = _data()
    booster, model, optimizer, criterion, _, scheduler = _setup(FP16NaiveMixedPrecision(), 0)
    optimizer.scaler.load_state_dict({**optimizer.scaler.state_dict(), "scale": 2.0**8})
    _train(booster, model, optimizer, criterion, scheduler, x, y, 3)
    booster.save_model(model, tmp_path / "model.pt")
    saved = load_checkpoint(tmp_path / "model.pt")
    assert all(t.dtype == torch.float32 for t in saved.values())
    lp_weight = model.module[0].weight
    hp_weight = optimizer.hp_masters[0]
    assert lp_weight.dtype == torch.float16
    # The file holds the fp32 master, not the fp16 param: precision fp16 cannot hold survives.
    torch.testing.assert_close(saved["0.weight"], hp_weight, rtol=0, atol=0)
    assert not torch.equal(saved["0.weight"], lp_weight.float())

    fp32_booster = Booster()
    fp32_model, *_ = fp32_booster.boost(tiny_mlp(WIDTH))
    fp32_booster.load_model(fp32_model, tmp_path / "model.pt")
    assert fp32_model.module[0].weight.dtype == torch.float32
    torch.testing.assert_close(fp32_model.module[0].weight, hp_weight, rtol=0, atol=0)

    # and back: an fp32 file into a naive model sets its masters to the exact fp32 values
    torch.manual_seed(5)
    booster3, model3, optimizer3, *_ = _setup(FP16NaiveMixedPrecision(), 5)
    booster3.load_model(model3, tmp_path / "model.pt")
    torch.testing.assert_close(optimizer3.hp_masters[0], hp_weight, rtol=0, atol=0)
    torch.testing.assert_close(model3.module[0].weight, hp_weight.half(), rtol=0, atol=0)


# ----- two gloo processes: DDP (one file, written by rank 0) and FSDP2 (DCP directories) -----


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _dist_worker(rank: int, world: int, tmp: str) -> None:
    where = Path(tmp)
    x, y = _data()
    x, y = x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]

    # DDP: rank 0 writes one file; every rank reads it into a differently initialised model
    booster, model, optimizer, criterion, _, scheduler = _setup(
        PRECISIONS["fp16_naive"](), 0, TorchDDPPlugin()
    )
    _train(booster, model, optimizer, criterion, scheduler, x, y, 2)
    booster.save_model(model, where / "ddp_model.pt")
    booster2, model2, optimizer2, *_ = _setup(PRECISIONS["fp16_naive"](), 1, TorchDDPPlugin())
    booster2.load_model(model2, where / "ddp_model.pt")
    for p, q in zip(optimizer.hp_masters, optimizer2.hp_masters, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)

    # FSDP2: save (twice: the second replaces the first), train on; resume elsewhere, compare
    fsdp = where / "fsdp"
    booster, model, optimizer, criterion, _, scheduler = _setup(
        PRECISIONS["fp16_naive"](), 0, TorchFSDPPlugin()
    )
    _train(booster, model, optimizer, criterion, scheduler, x, y, 1)
    _save(booster, model, optimizer, scheduler, fsdp)
    _train(booster, model, optimizer, criterion, scheduler, x, y, 2)
    _save(booster, model, optimizer, scheduler, fsdp)
    full = {n: _full(p).clone() for n, p in model.module.named_parameters()}
    if rank == 0:
        save_checkpoint(full, where / "fsdp_full.pt")
    _train(booster, model, optimizer, criterion, scheduler, x, y, 3)
    assert optimizer.skipped_steps > 0

    booster2, model2, optimizer2, criterion2, _, scheduler2 = _setup(
        PRECISIONS["fp16_naive"](), 1, TorchFSDPPlugin()
    )
    _load(booster2, model2, optimizer2, scheduler2, fsdp)
    for n, p in model2.module.named_parameters():
        torch.testing.assert_close(_full(p), full[n], rtol=0, atol=0)
    _train(booster2, model2, optimizer2, criterion2, scheduler2, x, y, 3)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        torch.testing.assert_close(_full(p), _full(q), rtol=0, atol=0)  # exact resume
    assert optimizer.loss_scale == optimizer2.loss_scale
    assert (optimizer.steps, optimizer.skipped_steps) == (
        optimizer2.steps,
        optimizer2.skipped_steps,
    )
    assert scheduler.get_last_lr() == scheduler2.get_last_lr()


@pytest.mark.distributed
def test_ddp_and_fsdp_checkpoints_two_ranks(tmp_path: Path) -> None:
    from dist_utils import spawn

    spawn(_dist_worker, 2, str(tmp_path))
    assert sorted(p.name for p in (tmp_path / "fsdp").iterdir()) == [
        "model",
        "optimizer",
        "scheduler",
    ]  # no temp or old directory left behind
    # The sharded DCP directory loads into a plain single-process fp32 model.
    booster = Booster()
    model, *_ = booster.boost(tiny_mlp(WIDTH))
    booster.load_model(model, tmp_path / "fsdp" / "model")
    full = load_checkpoint(tmp_path / "fsdp_full.pt")
    for name, p in model.module.named_parameters():
        torch.testing.assert_close(p, full[name], rtol=0, atol=0)


KILLED_SAVER = """
import sys, torch
from mixprec.core.checkpoint import save_checkpoint

class Slow:  # pickled after the big tensor: the writer is killed while the temp file is open
    def __reduce__(self):
        print("writing", flush=True)
        import time; time.sleep(60)
        return (int, (0,))

save_checkpoint({"w": torch.zeros(1 << 20), "slow": Slow()}, sys.argv[1])
"""


@pytest.mark.host_only
def test_a_killed_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    path = tmp_path / "ckpt.pt"
    save_checkpoint({"w": torch.arange(4.0)}, path)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "writing"  # mid-save now
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    torch.testing.assert_close(load_checkpoint(path)["w"], torch.arange(4.0), rtol=0, atol=0)


def test_apex_o2_checkpoint_loads_into_a_bf16_model(tmp_path: Path) -> None:
    from mixprec.mixed_precision import BF16MixedPrecision, FP16ApexMixedPrecision

    x, y = _data()
    booster, model, optimizer, criterion, _, scheduler = _setup(
        FP16ApexMixedPrecision(opt_level="O2", loss_scale=2.0**8), 0
    )
    _train(booster, model, optimizer, criterion, scheduler, x, y, 3)
    booster.save_model(model, tmp_path / "model.pt")
    bf16_booster = Booster(mixed_precision=BF16MixedPrecision())
    bf16_model, *_ = bf16_booster.boost(tiny_mlp(WIDTH))
    bf16_booster.load_model(bf16_model, tmp_path / "model.pt")
    # bf16 mode keeps fp32 params: they receive O2's fp32 masters exactly
    for name, p in bf16_model.module.named_parameters():
        assert p.dtype == torch.float32, name
    torch.testing.assert_close(bf16_model.module[0].weight, optimizer.hp_masters[0], rtol=0, atol=0)
