"""bench_lean's --size memory run: the bytes it reports are the tensors' own, per mode."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = {"width": 32, "depth": 1, "heads": 1, "context": 8, "batch": 1}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_lean", ROOT / "benchmarks/bench_lean.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.SIZES["tiny"] = TINY
    return module


def _tensors(bench) -> list[tuple[int, bool]]:
    """(numel, is a LayerNorm's) of each parameter of the tiny GPT, written out plainly."""
    model = bench.GPT(TINY["width"], TINY["depth"], TINY["heads"], TINY["context"])
    norms = {id(p) for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()}  # fmt: skip
    return [(p.numel(), id(p) in norms) for p in model.parameters()]


def _int8_state_bytes(numel: int) -> int:
    """Two moments: torchao's int8 codes + one fp32 scale per 256 when it quantizes, else fp32."""
    if numel >= 4096 and numel % 256 == 0:
        return 2 * (numel + 4 * numel // 256)
    return 2 * 4 * numel


def test_size_worker_counts_each_modes_bytes(bench) -> None:
    tensors = _tensors(bench)
    n = sum(k for k, _ in tensors)
    low = sum(k for k, norm in tensors if not norm)
    steps = 4 * len(tensors)  # AdamW's fp32 step count, one scalar tensor per param
    naive = bench.size_worker("NAIVE (fp16)", "tiny", 2)
    assert naive["params"] == n and naive["skipped_steps"] == 0
    assert naive["weights"] == 2 * low + 4 * (n - low)  # fp16, LayerNorms kept fp32
    assert naive["grads"] == naive["weights"]  # counted before its step frees them
    assert naive["masters"] == 4 * low
    assert naive["state"] == 8 * n + steps
    lean = bench.size_worker("bf16_sr+int8", "tiny", 2)
    assert lean["weights"] == lean["grads"] == 2 * low + 4 * (n - low)
    assert lean["masters"] == lean["master_grads"] == 0
    assert lean["state"] == sum(_int8_state_bytes(k) for k, _ in tensors) + steps
    for run in (naive, lean):
        assert set(run["peak_mib"]) == set(bench.PHASES)
        assert run["peak_rss_mib"] == max(run["peak_mib"].values())
        assert len(run["step_s"]) == 2 and run["trace"]
