"""The GEMM speed check behind `mixprec doctor` and `mixprec bench`: bf16/fp16 vs fp32, timed."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from mixprec.debugging.doctor import add_doctor_arguments, run_doctor
from mixprec.debugging.gemm_speed import GemmSpeed, measure_gemm_speed


def test_measure_times_every_dtype_for_at_least_min_rounds() -> None:
    speed = measure_gemm_speed("cpu", size=32, budget_s=0.01, min_rounds=3)
    assert speed.device == "cpu" and speed.size == 32 and speed.rounds >= 3
    assert list(speed.seconds) == ["float32", "bfloat16", "float16"]
    assert all(s > 0 for s in speed.seconds.values())


def test_ratio_and_line_come_from_the_measured_seconds() -> None:
    # power-of-two times: the ratios are exact
    speed = GemmSpeed(
        device="cpu", size=512, rounds=9, seconds={"float32": 0.5, "bfloat16": 0.25, "float16": 4.0}
    )
    assert speed.speedup("bfloat16") == 2.0 and speed.speedup("float16") == 0.125
    assert speed.line() == (
        "GEMM speed on cpu (512x512 matmul, median of 9): bfloat16 2.00x fp32, "
        "float16 0.12x fp32 (> 1: faster than fp32)"
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"size": 0}, r"size=0 must be an int >= 1"), ({"budget_s": "1"}, r"budget_s='1'")],
)
def test_bad_settings_name_the_value(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        measure_gemm_speed("cpu", **kwargs)


def test_doctor_prints_the_measured_ratio_under_the_hardware_table(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_doctor_arguments(parser)
    assert run_doctor(parser.parse_args([])) == 0
    out = capsys.readouterr().out
    assert out.startswith("| device")
    line = out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"GEMM speed on cpu \(512x512 matmul, median of \d+\): bfloat16 \d+\.\d\dx fp32, "
        r"float16 \d+\.\d\dx fp32 \(> 1: faster than fp32\)",
        line,
    ), line


def test_default_size_is_per_device() -> None:
    from mixprec.debugging.gemm_speed import GEMM_SIZE

    assert measure_gemm_speed("cpu", budget_s=0.01, min_rounds=1).size == GEMM_SIZE


@pytest.mark.cuda
def test_cuda_gemm_is_compute_bound_and_bf16_beats_fp32() -> None:
    from mixprec.debugging.gemm_speed import CUDA_GEMM_SIZE

    speed = measure_gemm_speed("cuda", budget_s=0.5)
    assert speed.size == CUDA_GEMM_SIZE
    # tensor cores (sm_80+): bf16 several times fp32 at a compute-bound size; a launch-bound
    # timing would read ~1x
    if torch.cuda.get_device_capability() >= (8, 0):
        assert speed.speedup("bfloat16") > 2.0, speed.line()
