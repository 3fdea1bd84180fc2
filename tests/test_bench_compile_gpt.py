"""benchmarks/bench_compile_gpt.py: its ratio bookkeeping on made-up seconds, and a tiny run end
to end (both loops train, the record is written, the compiled step compiled)."""

from __future__ import annotations

import json

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_compile_gpt")


def test_ratios_are_raw_over_compiled_per_block(bench):
    out = bench.ratios([0.030, 0.020, 0.040], [0.010, 0.020, 0.020])
    assert out["raw_ms"] == pytest.approx(30.0)
    assert out["compile_step_ms"] == pytest.approx(20.0)
    assert (out["ratio_min"], out["ratio_median"], out["ratio_max"]) == pytest.approx((1, 2, 3))


def test_bad_arguments_name_the_value(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse(["--steps", "1"])
    assert "--steps 1" in capsys.readouterr().err


def test_a_tiny_run_writes_its_record(bench, tmp_path):
    argv = ["--width", "16", "--depth", "1", "--heads", "2", "--context", "8", "--batch", "2"]
    argv += ["--steps", "5", "--block", "2", "--text", "5000", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    data = json.loads((tmp_path / "compile_gpt_cpu.json").read_text())
    assert data["compiled"] and data["blocks"] == 2
    assert data["raw_ms"] > 0 and data["compile_step_ms"] > 0
    # the same init, windows and schedule: 5 steps apart only by rounding (compiled vs eager)
    assert data["val_loss"]["raw"] == pytest.approx(data["val_loss"]["compile_step"], abs=0.05)
    text = (tmp_path / "compile_gpt_cpu.md").read_text()
    assert "| compile_step |" in text and "per block: median" in text
