"""bench_lean's --size memory run: the bytes it reports are the tensors' own, per mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from benchmark_scripts import load_benchmark

from mixprec.bench.gpt import GPT

ROOT = Path(__file__).resolve().parents[1]
TINY = {"width": 32, "depth": 1, "heads": 1, "context": 8, "batch": 1}


@pytest.fixture(scope="module")
def bench():
    module = load_benchmark("bench_lean")
    module.SIZES["tiny"] = TINY
    return module


def _tensors(bench) -> list[tuple[int, bool]]:
    """(numel, is a LayerNorm's) of each parameter of the tiny GPT, written out plainly."""
    model = GPT(TINY["width"], TINY["depth"], TINY["heads"], TINY["context"])
    norms = {id(p) for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()}  # fmt: skip
    return [(p.numel(), id(p) in norms) for p in model.parameters()]


def _moment_bytes(numel: int, fmt: str) -> int:
    """One moment: torchao's codes (int8: a byte, int4: half) + one fp32 scale per block (256,
    128) when it quantizes (>= 4096 elements, whole blocks), else fp32."""
    block, code = {"int8": (256, 1.0), "int4": (128, 0.5)}[fmt]
    if numel >= 4096 and numel % block == 0:
        return int(code * numel) + 4 * numel // block
    return 4 * numel


def _int8_state_bytes(numel: int) -> int:
    return 2 * _moment_bytes(numel, "int8")


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
    mixed = bench.size_worker("bf16_sr+int8/int4", "tiny", 2)  # exp_avg int8, exp_avg_sq int4
    expected = sum(_moment_bytes(k, "int8") + _moment_bytes(k, "int4") for k, _ in tensors)
    assert mixed["state"] == expected + steps < lean["state"]
    for run in (naive, lean, mixed):
        assert set(run["peak_mib"]) == set(bench.PHASES)
        assert run["peak_rss_mib"] == max(run["peak_mib"].values())
        assert len(run["step_s"]) == 2 and run["trace"]
        assert ", 1 threads," in run["machine"]  # the worker pins one thread, and says so


def test_size_table_reports_each_modes_step_time_against_naives(bench) -> None:
    """The committed 100M run's record renders a step-time row per mode and allocator: the
    first step, the later steps' median, and NAIVE's later median over it (same allocator)."""
    record = json.loads((ROOT / "benchmarks/results/lean_memory_100m_compiled/lean_memory.json").read_text())  # fmt: skip
    int8 = record["memory"]["bf16_sr+int8"]["glibc default"]["step_s"]
    naive = record["memory"]["NAIVE (fp16)"]["glibc default"]["step_s"]
    assert [round(s, 2) for s in int8] == [36.43, 18.26, 18.25]
    assert [round(s, 2) for s in naive] == [21.25, 17.6, 17.82]
    table = bench.size_markdown(record)
    assert record["machine"].startswith("AMD EPYC, 1 threads")  # the workers', not the parent's
    assert "| bf16_sr+int8 | glibc default | 36.43 | 18.26 | 0.98 |" in table  # 17.82 / 18.26
    assert "| NAIVE (fp16) | fixed mmap threshold | 20.97 | 17.77 | 1.00 |" in table
    rows = [r for r in table.splitlines() if r.count(" | ") == 4 and "|---" not in r]
    assert len(rows) == 1 + 7 * 2  # the header, then every mode under both allocators
    one_step = record | {"steps": 1}
    assert "later steps" not in bench.size_markdown(one_step)  # no later steps, no table


def test_quality_and_time_runs_write_their_table_record_and_picture(bench, tmp_path) -> None:
    """--quality-only with --modes (fp32 joins for the spread) and --time-only, tiny: each
    writes md + json + png to its fresh folder, one row per mode it ran."""
    threads = torch.get_num_threads()  # main() pins one thread: give the worker its own back
    try:
        _quality_and_time_runs(bench, tmp_path)
    finally:
        torch.set_num_threads(threads)


def _quality_and_time_runs(bench, tmp_path) -> None:
    tiny = ["--gpt-width", "16", "--gpt-depth", "1", "--batch", "2", "--context", "8"]
    quality = tmp_path / "quality"
    args = ["--quality-only", "--modes", "bf16_sr+int8/int4", "--seeds", "1", "--gpt-seeds", "1"]
    args += ["--fp32-seeds", "2", "--digits-steps", "2", "--gpt-steps", "2", "--no-progress"]
    assert bench.main([*args, *tiny, "--out", str(quality)]) == 0
    table = (quality / "quality.md").read_text()
    rows = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ")]
    assert rows == ["| mode", "| fp32", "| bf16_sr+int8/int4"]
    assert (quality / "quality.png").stat().st_size > 0
    timing = tmp_path / "time"
    args = ["--time-only", "--time-rounds", "1", "--no-progress", "--out", str(timing)]
    assert bench.main([*args, *tiny]) == 0
    assert "| bf16_sr+int8/int4 |" in (timing / "time.md").read_text()
    assert (timing / "time.png").stat().st_size > 0
    with pytest.raises(SystemExit):  # --modes names quality modes, and only with --quality-only
        bench.main(["--modes", "fp32", "--out", str(tmp_path / "x")])


def test_the_default_run_writes_memory_quality_and_time_in_one_record(
    bench, tmp_path, monkeypatch
) -> None:
    """The full run (no --*-only), tiny: memory workers, quality and step time land in one
    lean.md / lean.json / lean.png. The memory workers of fp32 and NAIVE (the peaks the others
    are divided by) run as the run starts them, each in its own process; the other modes' run
    in this one (the same function without a process each: their peaks here are this process's
    high-water mark, meaningless but harmless)."""
    launch = bench.run_memory

    def run_memory(mode, args):
        if mode in ("fp32", "NAIVE (bf16)"):
            return launch(mode, args)
        return bench.memory_worker(mode, args.mem_width, args.mem_depth, args.mem_batch, args.context)  # fmt: skip

    monkeypatch.setattr(bench, "run_memory", run_memory)
    threads = torch.get_num_threads()  # main() pins one thread: give the worker its own back
    try:
        args = ["--mem-width", "16", "--mem-depth", "1", "--mem-batch", "1"]
        args += ["--gpt-width", "16", "--gpt-depth", "1", "--batch", "2", "--context", "8"]
        args += ["--seeds", "1", "--gpt-seeds", "1", "--fp32-seeds", "2", "--digits-steps", "2"]
        args += ["--gpt-steps", "2", "--time-rounds", "1", "--no-progress"]
        assert bench.main([*args, "--out", str(tmp_path / "run")]) == 0
    finally:
        torch.set_num_threads(threads)
    record = json.loads((tmp_path / "run" / "lean.json").read_text())
    assert set(record) >= {"machine", "memory", "quality", "time"}
    assert ", 1 threads," in record["machine"]
    table = (tmp_path / "run" / "lean.md").read_text()
    assert "| bf16_sr + int8 |" in table or "| bf16_sr+int8 |" in table
    assert (tmp_path / "run" / "lean.png").stat().st_size > 0
