"""benchmarks/bench_compile.py's bookkeeping on made-up seconds: issue 44's goals are judged on the
cold runs, the runs with the ISA probes cached are reported beside them and change no goal."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_compile")


def _row(depth, loop, first, steady, cached=False):
    return {
        "depth": depth,
        "loop": loop,
        "first_step_s": first,
        "steady_ms": steady,
        "isa_cached": cached,
        "load_1min": [0.0, 0.0],
    }


ROWS = [
    _row(2, "torch.compile", 10.0, 6.0),
    _row(2, "compile_step", 12.0, 3.0),
    _row(8, "torch.compile", 20.0, 30.0),
    _row(8, "compile_step", 24.0, 10.0),
    _row(8, "torch.compile", 10.0, 30.0, cached=True),
    _row(8, "compile_step", 19.0, 10.0, cached=True),
]


def test_goals_are_judged_on_the_cold_runs(bench):
    goals = {name: (value, met) for name, value, _, met in bench.goals(ROWS)}
    first, growth, steady8, steady_all = goals.values()
    assert first == (pytest.approx(24.0 / 20.0), True)
    assert growth == (pytest.approx(2.0), True)  # (24 - 12) / 6 blocks, cached rows left out
    assert steady8 == (pytest.approx(3.0), True)
    assert steady_all == (pytest.approx(2.0), True)
    cached = [r for r in ROWS if r["isa_cached"]]
    assert bench.ratio(cached, 8, "first_step_s", "compile_step", "torch.compile") == 1.9
    assert bench.ratio(cached, 2, "first_step_s", "compile_step", "torch.compile") is None


def test_the_record_shows_the_cached_runs_and_their_ratio(bench):
    args = bench.parse([])
    text = bench.render(args, ROWS, "a machine")
    assert "| 8 | compile_step | cached | 19.0 |" in text
    assert "| 8 | compile_step | built | 24.0 |" in text
    assert "ISA probes cached, depth 8: compile_step / torch.compile 1.90" in text


def test_isa_cached_takes_depths_or_nothing(bench, capsys):
    assert bench.parse([]).isa_cached == [8]
    assert bench.parse(["--isa-cached", ""]).isa_cached == []
    assert bench.parse(["--isa-cached", "2,24"]).isa_cached == [2, 24]
    with pytest.raises(SystemExit):
        bench.parse(["--isa-cached", "eight"])
    assert "--isa-cached 'eight'" in capsys.readouterr().err
