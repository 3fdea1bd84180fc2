"""Booster checkpoints with Colossal-AI's keywords: shard=True (index + size-capped shards, torch
or safetensors), prefix, size_per_shard, gather_dtensor; refused keywords name themselves.

Ported in spirit from Colossal-AI's tests/test_checkpoint_io (general, low-level-zero, torch
FSDP): save sharded, load into a fresh boosted model/optimizer, and the resumed run must equal
the uninterrupted one bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mixprec.booster import Booster
from mixprec.booster.plugin import (
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from mixprec.mixed_precision import FP16NaiveMixedPrecision

WIDTH = 256  # 256 x 256 fp32 = 256 KiB a weight: 6 layers need 2 shards of 1 MB


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(6)])


def _data(rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)


def _boost(plugin=None, mixed_precision=None) -> tuple:  # noqa: ANN001
    booster = Booster(plugin=plugin, mixed_precision=mixed_precision)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt, criterion, *_ = booster.boost(model, opt, nn.MSELoss())
    return booster, model, opt, criterion


def _step(booster, model, opt, criterion, x, y) -> None:  # noqa: ANN001
    booster.backward(criterion(model(x), y), opt)
    opt.step()
    opt.zero_grad()


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for p in model.parameters()
    ]


def _resume_equals(make, where: Path, rank: int = 0, **save) -> None:  # noqa: ANN001
    """Train 2 steps, save (with save's keywords), train 1 more; a fresh run that loads the
    checkpoint and trains that step must equal it bit for bit (masters, Adam state, scaler)."""
    x, y = _data(rank)
    booster, model, opt, criterion = make()
    for _ in range(2):
        _step(booster, model, opt, criterion, x, y)
    booster.save_model(model, where / "model", **save)
    save.pop("use_safetensors", None)
    booster.save_optimizer(opt, where / "optim", **save)
    _step(booster, model, opt, criterion, x, y)
    booster2, model2, opt2, criterion2 = make()
    booster2.load_model(model2, where / "model")
    booster2.load_optimizer(opt2, where / "optim")
    _step(booster2, model2, opt2, criterion2, x, y)
    for a, b in zip(_weights(model), _weights(model2), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert opt.loss_scale == opt2.loss_scale and opt.steps == opt2.steps


def _check_sharded_layout(directory: Path, index_name: str, ext: str, limit_mb: int) -> None:
    index = json.loads((directory / index_name).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and all(f.endswith(ext) for f in files), files
    assert sorted(p.name for p in directory.iterdir()) == sorted([*files, index_name])
    for file in files:  # each shard holds exactly the tensors the index maps to it
        if ext == ".safetensors":
            from safetensors.torch import load_file

            keys = set(load_file(directory / file))
        else:
            keys = set(torch.load(directory / file, weights_only=True))
        assert keys == {k for k, f in index["weight_map"].items() if f == file}, file
    for file in files:  # tensor bytes per shard within the cap (a file adds a small header)
        assert (directory / file).stat().st_size <= limit_mb * 2**20 + 64 * 1024


@pytest.mark.parametrize("use_safetensors", [False, True])
def test_sharded_checkpoint_resumes_bitwise(tmp_path: Path, use_safetensors: bool) -> None:
    if use_safetensors:
        pytest.importorskip("safetensors")

    def make() -> tuple:
        return _boost(mixed_precision=FP16NaiveMixedPrecision(initial_scale=2.0**8))

    _resume_equals(
        make,
        tmp_path,
        shard=True,
        size_per_shard=1,
        use_safetensors=use_safetensors,
        prefix="run1-",
    )
    index = "run1-" + (
        "model.safetensors.index.json" if use_safetensors else "pytorch_model.bin.index.json"
    )
    _check_sharded_layout(
        tmp_path / "model", index, ".safetensors" if use_safetensors else ".bin", 1
    )
    _check_sharded_layout(tmp_path / "optim", "run1-pytorch_optim.bin.index.json", ".bin", 1)
    # A sharded checkpoint loads into another mode too (fp32 weights are fp32 weights).
    booster, model, *_ = _boost()
    booster.load_model(model, tmp_path / "model")


def test_unsharded_safetensors_file(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    booster, model, opt, criterion = _boost()
    booster.save_model(model, tmp_path / "model.safetensors", use_safetensors=True)
    from safetensors.torch import load_file

    state = load_file(tmp_path / "model.safetensors")
    for (name, p), q in zip(model.module.named_parameters(), state.values(), strict=False):
        torch.testing.assert_close(state[name], p.detach(), rtol=0, atol=0)
        del q
    booster2, model2, *_ = _boost()
    booster2.load_model(model2, tmp_path / "model.safetensors")
    for a, b in zip(_weights(model), _weights(model2), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("shard", [False, True])
def test_low_cpu_mem_mode_is_a_hint_that_loads_the_same_values(tmp_path: Path, shard: bool) -> None:
    """Colossal's checkpoint tests load with low_cpu_mem_mode False and True: both give the
    saved tensors exactly (model weights with their masters, optimizer state, scaler)."""
    booster, model, opt, criterion = _boost(mixed_precision=FP16NaiveMixedPrecision())
    _step(booster, model, opt, criterion, *_data())
    booster.save_model(model, tmp_path / "model", shard=shard)
    booster.save_optimizer(opt, tmp_path / "optim", shard=shard)
    loaded = []
    for low_cpu_mem_mode in (False, True):
        booster2, model2, opt2, _ = _boost(mixed_precision=FP16NaiveMixedPrecision())
        booster2.load_model(model2, tmp_path / "model", low_cpu_mem_mode=low_cpu_mem_mode)
        booster2.load_optimizer(opt2, tmp_path / "optim", low_cpu_mem_mode=low_cpu_mem_mode)
        loaded.append((model2, opt2))
    for model2, opt2 in loaded:
        for a, b in zip(_weights(model2), _weights(model), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for a, b in zip(opt2.hp_masters, opt.hp_masters, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert opt2.loss_scale == opt.loss_scale and opt2.steps == opt.steps == 1
        state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        state2 = [v for s in opt2.state.values() for v in s.values() if torch.is_tensor(v)]
        assert len(state) == len(state2)
        for a, b in zip(state2, state, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_refused_and_misused_keywords_name_themselves(tmp_path: Path) -> None:
    booster, model, opt, _ = _boost()
    with pytest.raises(NotImplementedError, match="use_async"):
        booster.save_model(model, tmp_path / "m", use_async=True)
    with pytest.raises(NotImplementedError, match="use_async"):
        booster.save_optimizer(opt, tmp_path / "o", use_async=True)
    with pytest.raises(ValueError, match="prefix.*shard=True"):
        booster.save_model(model, tmp_path / "m", prefix="x")
    with pytest.raises(ValueError, match="size_per_shard.*shard=True"):
        booster.save_optimizer(opt, tmp_path / "o", size_per_shard=10)
    with pytest.raises(ValueError, match="gather_dtensor=False"):
        booster.save_model(model, tmp_path / "m", gather_dtensor=False)
    booster.save_model(model, tmp_path / "m")
    with pytest.raises(TypeError, match="low_cpu_mem_mode='no' must be a bool"):
        booster.load_model(model, tmp_path / "m", low_cpu_mem_mode="no")
    with pytest.raises(NotImplementedError, match="num_threads"):
        booster.load_optimizer(opt, tmp_path / "m", num_threads=4)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp left behind


# ----- every plugin, two gloo ranks -----
def _dist_worker(rank: int, world: int, directory: str) -> None:
    root = Path(directory)

    def zero() -> tuple:
        return _boost(LowLevelZeroPlugin(stage=2, precision="bf16"))

    def ddp() -> tuple:
        return _boost(TorchDDPPlugin(), FP16NaiveMixedPrecision(initial_scale=2.0**8))

    def fsdp() -> tuple:
        return _boost(TorchFSDPPlugin())

    def hybrid_zero() -> tuple:
        return _boost(HybridParallelPlugin(precision="fp32", zero_stage=1))

    for name, make in (("zero", zero), ("ddp", ddp), ("fsdp", fsdp), ("hybrid", hybrid_zero)):
        _resume_equals(make, root / name, rank, shard=True, size_per_shard=1)
        dist.barrier()
    # FSDP, gathered whole into one file (gather_dtensor=True): a plain process loads it
    booster, model, opt, criterion = fsdp()
    booster.save_model(model, root / "fsdp_full.pt", gather_dtensor=True)
    booster.save_optimizer(opt, root / "fsdp_optim.pt", gather_dtensor=True)
    booster.load_optimizer(opt, root / "fsdp_optim.pt")
    full = _weights(model)
    if rank == 0:
        plain, model1, *_ = _boost()
        plain.load_model(model1, root / "fsdp_full.pt")
        for a, b in zip(full, _weights(model1), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    dist.barrier()
    # A pipeline's checkpoint is per stage: shard=True is refused by name
    piped = Booster(plugin=HybridParallelPlugin(pp_size=2, num_microbatches=2, precision="fp32"))
    pmodel, *_ = piped.boost(_model())
    with pytest.raises(NotImplementedError, match="shard=True"):
        piped.save_model(pmodel, root / "pipe", shard=True)


def test_every_plugin_writes_and_reads_sharded_checkpoints(tmp_path: Path) -> None:
    from dist_utils import spawn

    spawn(_dist_worker, 2, str(tmp_path))
    for name in ("zero", "ddp", "fsdp", "hybrid"):
        _check_sharded_layout(tmp_path / name / "model", "pytorch_model.bin.index.json", ".bin", 1)
