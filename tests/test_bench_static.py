"""benchmarks/bench_static.py's bookkeeping: the timing loop and the target table it prints.

The timings themselves are the benchmark's to measure; here, made-up seconds go through the
same ratio and target code the results files come from, so a wrong ratio or verdict fails.
"""

from __future__ import annotations

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_static")


class _Bar:
    def __init__(self) -> None:
        self.updates = 0

    def update(self) -> None:
        self.updates += 1

    def set_postfix_str(self, _text: str) -> None:
        pass


def test_each_round_times_every_loop_once_in_a_shuffled_order(bench):
    calls: list[str] = []
    steps = {name: (lambda name=name: calls.append(name)) for name in "abcd"}
    bar = _Bar()
    medians = bench.interleaved_medians(steps, warmup=2, rounds=30, bar=bar)
    assert set(medians) == set(steps) and bar.updates == 4 * (2 + 30)
    assert calls[:8] == ["a", "a", "b", "b", "c", "c", "d", "d"]  # warm-up, loop by loop
    rounds = [calls[8 + 4 * i : 12 + 4 * i] for i in range(30)]
    assert all(sorted(r) == list("abcd") for r in rounds)
    firsts = {r[0] for r in rounds}
    assert len(firsts) > 1, "the same loop opened every round: the order is not shuffled"


def test_ratios_and_targets_take_the_worst_row_against_each_goal(bench):
    def row(step, eager, compiled, raw, checked):
        return {
            "mixprec step": step,
            "mixprec eager": eager,
            "raw compile": compiled,
            "raw eager": raw,
            bench.CHECKED: checked,
        }

    speed = {
        "tiny": {"bf16": row(1.0, 1.5, 2.0, 1.4, 1.5), "naive": row(1.0, 1.2, 1.1, 1.15, 1.15)},
        "vit": {"fp8": row(10.0, 12.0, 9.9, 12.0, 12.0)},
    }
    rows = bench.ratio_rows(speed)
    tiny_bf16 = rows[0]
    assert tiny_bf16["step / mixprec eager"] == pytest.approx(1.5)
    assert tiny_bf16["step / raw compile"] == pytest.approx(2.0)
    assert tiny_bf16["mixprec eager / raw eager"] == pytest.approx(1.4 / 1.5)
    assert tiny_bf16["mixprec eager / raw eager + check"] == pytest.approx(1.0)
    verdicts = {name: (where, value, met) for name, where, value, _, met in bench.targets(rows)}
    # tiny naive's 1.2x misses 1.3x; vit fp8 is the only size under raw compile (0.99x)
    assert verdicts["step / mixprec eager (tiny; bf16, naive)"] == ("tiny naive", 1.2, False)
    where, value, met = verdicts["step / raw compile"]
    assert (where, round(value, 2), met) == ("vit fp8", 0.99, False)
    assert "mixprec eager / raw eager" not in verdicts  # a ratio, not a goal (see TARGETS)
    assert round(tiny_bf16["mixprec eager / raw eager"], 3) == 0.933
    where, value, met = verdicts["mixprec eager / raw eager + check"]
    assert (where, round(value, 3), met) == ("tiny naive", 0.958, False)
