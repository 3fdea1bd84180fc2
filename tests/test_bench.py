"""mixprec bench: models, mode vocabulary, planning, the subprocess runner, reports, the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from benchmark_scripts import load_benchmark

import mixprec
from mixprec import convert_to_amp
from mixprec.bench import (
    BENCH_MODES,
    MODEL_NAMES,
    BenchConfig,
    BenchReport,
    ModelSpec,
    ModeResult,
    amp_args,
    build_model,
    load_report,
    make_batch,
    make_criterion,
    mode_policy,
    parse_modes,
    plan_modes,
    render_table,
    run_bench,
    runner,
    summary_rows,
    write_report,
)
from mixprec.bench import report as bench_report
from mixprec.bench.command import NO_MATPLOTLIB_NOTE, OUT_PREFIX, RUNS_DIR, fresh_out_dir
from mixprec.bench.progress import NO_TQDM_NOTE, progress_bar
from mixprec.cli import main

TINY = {
    "mlp": ModelSpec(name="mlp", width=16, depth=3, batch=4, lr=0.1),
    "vit": ModelSpec(name="vit", width=16, depth=1, batch=2, heads=2, image_size=8, lr=0.1),
    "resnet": ModelSpec(name="resnet", width=4, depth=1, batch=2, image_size=8, lr=0.1),
}
CPU = torch.device("cpu")


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_models_train_one_step(name: str, mode: str) -> None:
    spec = TINY[name]
    model = build_model(spec)
    x, y = make_batch(spec, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr)
    model, optimizer, criterion = convert_to_amp(
        model, optimizer, make_criterion(spec), *amp_args(mode)
    )
    out = model(x)
    assert out.shape == ((spec.batch, spec.width) if name == "mlp" else (spec.batch, 10))
    loss = criterion(out, y)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    optimizer.backward(loss)
    assert not optimizer.step().skipped
    changed = [
        not torch.equal(b, p) for b, p in zip(before, model.module.parameters(), strict=True)
    ]
    assert any(changed), f"{name}/{mode}: one SGD step left every parameter unchanged"


def test_same_seed_same_data_and_init() -> None:
    spec = TINY["vit"]
    (x1, y1), (x2, y2) = make_batch(spec, seed=3), make_batch(spec, seed=3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)  # exact: same generator, same draws
    torch.manual_seed(3)
    a = build_model(spec).state_dict()
    torch.manual_seed(3)
    b = build_model(spec).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_model_spec_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match=r"Unknown model 'vitt'.*'vit'"):
        ModelSpec(name="vitt", width=8, depth=1, batch=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ModelSpec.width=0"):
        ModelSpec(name="mlp", width=0, depth=1, batch=1)
    with pytest.raises(ValueError, match="divisible by heads=3"):
        ModelSpec(name="vit", width=16, depth=1, batch=1, heads=3)
    with pytest.raises(ValueError, match="image_size=30 must be a multiple of patch_size=16"):
        ModelSpec(name="vit", width=16, depth=1, batch=1, image_size=30, patch_size=16)


def test_vit_b16_shape_flags_reach_the_spec_and_the_repeat_command() -> None:
    import argparse

    from mixprec.bench.command import add_bench_arguments, config_from_args
    from mixprec.bench.runner import config_to_command

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    argv = "--model vit --width 768 --depth 12 --image-size 224 --patch-size 16 --heads 12"
    config = config_from_args(parser.parse_args(argv.split()))
    spec = config.model
    assert (spec.width, spec.depth, spec.image_size, spec.patch_size, spec.heads) == (
        768,
        12,
        224,
        16,
        12,
    )
    assert "--image-size 224 --patch-size 16 --heads 12" in config_to_command(config)
    default = config_from_args(parser.parse_args(["--model", "vit"]))
    assert "--image-size" not in config_to_command(default)  # preset values are not repeated


@pytest.mark.parametrize("mode", BENCH_MODES)
def test_every_mode_parses_to_a_policy(mode: str) -> None:
    policy = mode_policy(mode)
    expected_low = {
        "fp32": None,
        "bf16": torch.bfloat16,
        "fp8": torch.bfloat16,
    }.get(mode, torch.float16)
    assert policy.low_dtype == expected_low
    assert policy.fp8 == (mode == "fp8")


def test_dtype_reaches_only_the_modes_that_take_it() -> None:
    assert mode_policy("fp16", "bfloat16").compute_dtype == torch.bfloat16
    assert mode_policy("fp16_naive", "bf16").param_dtype == torch.bfloat16
    o2 = mode_policy("O2", "bfloat16")
    assert o2.param_dtype == torch.bfloat16 and o2.master_weights
    assert mode_policy("O1", "bfloat16").compute_dtype == torch.float16  # O1 refuses a cast type
    assert mode_policy("fp32", "bfloat16").low_dtype is None


def test_parse_modes_and_unknown_mode_text() -> None:
    assert parse_modes("bf16,fp32") == ("fp32", "bf16")  # table order, not typing order
    assert parse_modes("torch, naive,apex") == ("fp16", "fp16_naive", "O1")
    assert parse_modes("all") == BENCH_MODES
    with pytest.raises(ValueError) as err:
        parse_modes("fp32,fp61")
    text = str(err.value)
    assert "Unknown bench mode 'fp61'" in text and "Did you mean 'fp16'" in text
    assert all(repr(m) in text for m in BENCH_MODES)  # every valid choice is listed
    with pytest.raises(ValueError, match=r"Unknown bench mode 'O4'.*Valid: 'fp32'"):
        BenchConfig(model=TINY["mlp"], modes=("O4",))


def test_plan_cuts_fp16_steps_on_a_slow_cpu_unless_forced(monkeypatch) -> None:
    monkeypatch.setattr(runner, "cpu_has_fast_fp16", lambda: False)
    monkeypatch.setattr(runner, "cpu_has_fast_bf16", lambda: True)
    config = BenchConfig(model=TINY["mlp"], modes=("bf16", "fp16"), steps=7, warmup=3)
    plans = {p.mode: p for p in plan_modes(config, CPU)}
    assert list(plans) == ["fp32", "fp16", "bf16"]  # fp32 joins as the baseline
    assert (plans["bf16"].steps, plans["bf16"].warmup, plans["bf16"].note) == (7, 3, "")
    fp16 = plans["fp16"]
    assert (fp16.steps, fp16.warmup) == (runner.CPU_FP16_STEPS, runner.CPU_FP16_WARMUP)
    assert "no fast kernel" in fp16.note and "--modes" in fp16.note
    assert fp16.expect_slower and not plans["bf16"].expect_slower
    forced = plan_modes(replace(config, forced=True), CPU)
    assert all(p.steps == 7 and p.warmup == 3 for p in forced)
    # --dtype bfloat16 moves fp16 off the slow path; O1 stays fp16
    bf = plan_modes(replace(config, modes=("fp16", "O1"), dtype="bfloat16"), CPU)
    slow = runner.CPU_FP16_STEPS
    assert [(p.mode, p.steps) for p in bf] == [("fp32", 7), ("fp16", 7), ("O1", slow)]
    # a CPU without bf16 kernels: bf16 is cut too; fp8 is not (its CPU GEMMs emulate in fp32)
    monkeypatch.setattr(runner, "cpu_has_fast_bf16", lambda: False)
    no_bf16 = {p.mode: p for p in plan_modes(replace(config, modes=("bf16", "fp8")), CPU)}
    assert no_bf16["bf16"].steps == slow and no_bf16["bf16"].expect_slower
    assert "bf16 matmul has no fast kernel" in no_bf16["bf16"].note
    assert no_bf16["fp8"].steps == 7 and not no_bf16["fp8"].expect_slower
    assert not no_bf16["fp32"].expect_slower


def test_a_mode_the_device_cannot_run_is_skipped_or_refused(monkeypatch) -> None:
    def no_fp8(mode, dtype, device):
        return "no float8 kernel here" if mode == "fp8" else None

    monkeypatch.setattr(runner, "device_problem", no_fp8)
    config = BenchConfig(model=TINY["mlp"], modes=BENCH_MODES)
    fp8 = {p.mode: p for p in plan_modes(config, CPU)}["fp8"]
    assert fp8.skip_reason == "no float8 kernel here"
    with pytest.raises(ValueError, match=r"Mode 'fp8' cannot run on cpu: no float8 kernel here"):
        plan_modes(replace(config, modes=("fp8",), forced=True), CPU)


def test_runner_end_to_end_in_subprocesses(tmp_path, monkeypatch) -> None:
    # fp8 is planned as skipped (parent side), so two workers run: fp32 and bf16.
    monkeypatch.setattr(
        runner, "device_problem", lambda m, d, dev: "test: no fp8" if m == "fp8" else None
    )
    monkeypatch.setattr(runner, "cpu_has_fast_bf16", lambda: True)  # bf16 runs all its steps
    # 8 MiB of weights (+ grads): enough to lift the peak RSS above the import-time high-water
    # mark (smaller models fit in heap memory malloc kept from the imports: a zero delta)
    model = ModelSpec(name="mlp", width=1024, depth=2, batch=4, lr=0.1)
    config = BenchConfig(
        model=model, modes=("bf16", "fp8"), steps=2, rounds=2, warmup=1, device="cpu"
    )
    report = run_bench(config, progress=False)
    assert report.rounds_done == 2 and not report.interrupted
    by_mode = {r.mode: r for r in report.results}
    assert list(by_mode) == ["fp32", "bf16", "fp8"]
    assert by_mode["fp8"].status == "skipped" and by_mode["fp8"].reason == "test: no fp8"
    for mode in ("fp32", "bf16"):
        r = by_mode[mode]
        assert r.status == "ok", r.reason
        assert len(r.losses) == 5 and len(r.loss_scales) == 5  # warm-up + 2 rounds of 2 steps
        assert len(r.step_s) == 4 and len(r.round_step_s) == 2 and all(r.round_step_s)
        assert r.it_s > 0 and r.samples_s == pytest.approx(r.it_s * 4)  # batch 4
        assert r.peak_delta_bytes > 2**20 and r.memory_kind.startswith("peak RSS")
        assert r.peak_bytes == r.baseline_bytes + r.peak_delta_bytes
    assert by_mode["bf16"].low_dtype == "bfloat16" and by_mode["fp32"].low_dtype == ""
    # same seed, same init and data: the first loss (before any update) agrees to bf16 rounding
    assert by_mode["bf16"].losses[0] == pytest.approx(by_mode["fp32"].losses[0], rel=2**-7)

    paths = write_report(report, tmp_path)
    assert {p.name for p in paths.values()} == {f"bench_mlp_cpu.{e}" for e in ("md", "json", "png")}
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(paths["json"].read_text())
    rows = {row["mode"]: row for row in data["summary"]}
    assert rows["fp32"]["speedup_vs_fp32"] == 1.0 and rows["fp32"]["memory_vs_fp32"] == 1.0
    assert rows["bf16"]["speedup"]["rounds"] == 2  # paired round by round with fp32
    assert rows["fp8"]["speedup_vs_fp32"] is None and rows["fp8"]["reason"] == "test: no fp8"
    md = paths["md"].read_text()
    assert "| fp32 " in md and "| bf16 " in md and "test: no fp8" in md
    assert load_report(paths["json"]).results == report.results  # the JSON round-trips


def _result(
    mode: str,
    step_s: float,
    delta: int,
    losses: list[float],
    rounds: list[float] | None = None,
    **extra,
) -> ModeResult:
    rounds = rounds or [step_s] * 3
    return ModeResult(
        mode=mode,
        status="ok",
        amp_call=repr(mode),
        steps=len(losses),
        round_step_s=rounds,
        step_s=rounds,
        step_s_median=step_s,
        it_s=1 / step_s,
        samples_s=8 / step_s,
        baseline_bytes=100,
        peak_bytes=100 + delta,
        peak_delta_bytes=delta,
        losses=losses,
        **extra,
    )


def test_summary_ratios_and_common_loss_step() -> None:
    report = BenchReport(
        config={"model": {"name": "mlp"}},
        device="cpu",
        machine="test",
        command="mixprec bench",
        results=[
            _result("fp32", 0.5, 4096, [3.0, 2.0, 1.0]),
            _result("bf16", 0.25, 2048, [3.0, 2.5, 1.5]),
            _result("fp16", 2.0, 3072, [3.0, 2.25]),
            ModeResult(mode="fp8", status="skipped", reason="no kernel"),
        ],
    )
    rows = {r["mode"]: r for r in summary_rows(report)}
    # power-of-two times and sizes: the ratios are exact
    assert rows["fp32"]["speedup_vs_fp32"] == 1.0 and rows["fp32"]["memory_vs_fp32"] == 1.0
    assert rows["bf16"]["speedup_vs_fp32"] == 2.0 and rows["bf16"]["memory_vs_fp32"] == 0.5
    assert rows["fp16"]["speedup_vs_fp32"] == 0.25 and rows["fp16"]["memory_vs_fp32"] == 0.75
    assert [rows[m]["loss"] for m in ("fp32", "bf16", "fp16")] == [2.0, 2.5, 2.25]  # step 2
    assert rows["bf16"]["final_loss"] == 1.5
    assert rows["fp8"]["speedup_vs_fp32"] is None and rows["fp8"]["reason"] == "no kernel"
    table = render_table(report)
    assert "loss @ step 2" in table and "| skipped " in table and "[1] no kernel" in table


def _report(*results: ModeResult) -> BenchReport:
    return BenchReport(
        config={"model": {"name": "mlp"}},
        device="cpu",
        machine="test",
        command="mixprec bench",
        results=list(results),
    )


def test_a_noisy_speedup_is_withheld_and_a_wobbly_one_marked() -> None:
    # made-up round timings: fp32 steady at 1 s; bf16 steady at 0.5 s; fp8 reads like the
    # issue's busy-machine run (3.85x, 12.15x, 0.93x, ...); O1 wobbles by ~30%
    fp32 = [1.0] * 5
    report = _report(
        _result("fp32", 1.0, 4096, [1.0], fp32),
        _result("bf16", 0.5, 4096, [1.0], [0.5] * 5),
        _result("fp8", 0.3, 4096, [1.0], [1 / 3.85, 1 / 12.15, 1 / 0.93, 1 / 3.0, 1 / 1.5]),
        _result("O1", 1.0, 4096, [1.0], [1.0, 0.8, 1.25, 0.8, 1.25]),
        _result("O2", 1.0, 4096, [1.0], [1.0, 1.0]),
    )
    rows = {r["mode"]: r for r in summary_rows(report)}
    assert rows["bf16"]["speedup_vs_fp32"] == 2.0 and rows["bf16"]["speedup"]["verdict"] == "ok"
    noisy = rows["fp8"]["speedup"]
    assert noisy["verdict"] == "withheld" and noisy["spread"] > bench_report.WITHHOLD_SPREAD
    assert rows["fp8"]["speedup_vs_fp32"] is None  # not printed, not in the JSON's value
    assert (noisy["low"], noisy["high"]) == pytest.approx((0.93, 12.15))  # the range still is
    wobbly = rows["O1"]["speedup"]
    assert wobbly["verdict"] == "marked" and rows["O1"]["speedup_vs_fp32"] == 1.0
    assert bench_report.MARK_SPREAD < wobbly["spread"] <= bench_report.WITHHOLD_SPREAD
    few = rows["O2"]["speedup"]  # two rounds agree, but two are fewer than MIN_ROUNDS
    assert few["verdict"] == "marked" and "only 2 round(s)" in few["why"]
    table = render_table(report)
    lines = {line.split("|")[1].strip(): line for line in table.splitlines() if "|" in line}
    assert "| 2.00x " in lines["bf16"] and "| 0.93–12.15x (5) " in lines["fp8"]
    assert "| withheld " in lines["fp8"] and "3.00x" not in lines["fp8"]  # not its median
    assert "| 1.00x ? " in lines["O1"]
    assert "rounds disagree (spread" in table and "rerun when idle" in table


def test_a_speedup_contradicting_its_slow_footnote_is_not_printed() -> None:
    # fp16 on a CPU without fp16 kernels: the plan notes "slow here"; a run where the
    # machine got quieter just for fp16 must not print "1.44x faster" above that note
    slow = "fp16 matmul has no fast kernel on this CPU (no avx512_fp16/amx_fp16)"
    report = _report(
        _result("fp32", 1.0, 4096, [1.0], [1.0] * 5),
        _result("fp16", 0.7, 4096, [1.0], [0.7] * 5, note=slow, expect_slower=True),
        _result("fp16_naive", 25.0, 4096, [1.0], [25.0] * 5, note=slow, expect_slower=True),
        # slow as noted, but its rounds disagree: withheld for the spread, its range still shown
        _result(
            "O2", 25.0, 4096, [1.0], [25.0, 5.0, 25.0, 50.0, 10.0], note=slow, expect_slower=True
        ),
    )
    rows = {r["mode"]: r for r in summary_rows(report)}
    assert rows["fp16"]["speedup_vs_fp32"] is None
    assert rows["fp16"]["speedup"]["verdict"] == "withheld"
    assert "contradicts" in rows["fp16"]["speedup"]["why"]
    assert rows["fp16_naive"]["speedup_vs_fp32"] == 0.04  # slower, as the note says: shown
    table = render_table(report)
    fp16_line = next(line for line in table.splitlines() if line.startswith("| fp16 "))
    assert "1.43x" not in fp16_line and "| withheld " in fp16_line and slow in table
    o2_line = next(line for line in table.splitlines() if line.startswith("| O2 "))
    assert "| withheld " in o2_line and "| 0.02–0.20x (5) " in o2_line


def test_judge_speedup_rule_edges() -> None:
    assert bench_report.judge_speedup([]) is None
    one = bench_report.judge_speedup([2.0])
    assert (one.median, one.spread, one.verdict) == (2.0, 0.0, "marked")
    steady = bench_report.judge_speedup([2.0, 2.0, 2.0])
    assert steady.verdict == "ok" and steady.why == ""
    # slower than fp32 with the slow note is consistent, even with one round above 1
    assert bench_report.judge_speedup([0.9, 0.95, 1.05], expect_slower=True).verdict == "ok"
    # rounds fp32 or the mode missed (None) are not paired
    assert bench_report.round_ratios([1.0, 1.0, None], [0.5, None, 0.5]) == [2.0]


def test_worker_timeout_is_a_failed_row_with_its_reason(tmp_path) -> None:
    config = BenchConfig(model=TINY["mlp"], steps=1, warmup=0, timeout_s=0.05)
    plan = runner.ModePlan(mode="fp32", steps=1, warmup=0)

    class Bar:
        n = 0

        def update(self, k: int) -> None:
            self.n += k

    worker = runner.ModeWorker(plan, config, CPU, tmp_path)
    worker.wait_ready(Bar())  # importing torch takes far more than 0.05 s
    assert worker.result.status == "failed" and "stopped after 0.05 s" in worker.result.reason
    assert worker.proc.poll() is not None  # the worker is gone


def _children(pid: int) -> list[int]:
    """Live child processes of `pid` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc for children")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_parent_alone_stops_the_run_and_writes_partial_results(
    tmp_path, sig
) -> None:
    src = Path(mixprec.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    argv = "bench --width 16 --depth 2 --batch 4 --steps 1 --warmup 0 --rounds 100000"
    argv += " --modes fp32,bf16 --no-progress --out out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mixprec.cli", *argv.split()],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stderr:  # wait until two rounds are measured
            if line.startswith("mixprec bench: round 2/"):
                break
        workers = _children(proc.pid)
        assert len(workers) == 2  # fp32's and bf16's
        proc.send_signal(sig)  # to the parent alone, not its process group
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err
    name = signal.Signals(sig).name
    assert f"mixprec bench: {name} during round" in err and "partial results written" in err
    for pid in workers:  # killed, not left running (reaped or at most a zombie)
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    data = json.loads((tmp_path / "out" / "bench_mlp_cpu.json").read_text())
    assert data["interrupted"].startswith(f"{name} during round")
    assert data["rounds_done"] >= 2
    rows = {r["mode"]: r for r in data["summary"]}
    assert rows["bf16"]["status"] == "ok" and rows["bf16"]["speedup"]["rounds"] >= 2
    md = (tmp_path / "out" / "bench_mlp_cpu.md").read_text()
    assert "**Interrupted**" in md and "| bf16 " in md and "| bf16 " in out


def test_cli_bench_help_and_errors(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--modes" in out and "--model {mlp,vit,resnet}" in out and "--dtype" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--modes", "bf61"])
    assert exit_info.value.code == 2
    assert "Unknown bench mode 'bf61'. Did you mean 'bf16'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "--device", "cuda"]) == 2
        assert "no CUDA device is visible" in capsys.readouterr().err


# None in sys.modules reads as "not installed": import raises ModuleNotFoundError and
# importlib.util.find_spec (which torch._dynamo calls for tqdm) returns None
HIDE_BENCH_EXTRAS = """
import sys

sys.modules.update(tqdm=None, matplotlib=None)  # a base install (`pip install mixprec`)
"""


@pytest.mark.slow
def test_bench_runs_on_the_base_install_without_tqdm_or_matplotlib(tmp_path) -> None:
    # sitecustomize runs at start-up in the CLI process and, through PYTHONPATH, in its workers
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_BENCH_EXTRAS)
    src = Path(mixprec.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), str(src)])}
    argv = "bench --model mlp --width 16 --depth 2 --batch 4 --steps 1 --warmup 0 --rounds 1"
    argv += " --modes bf16"
    done = subprocess.run(
        [sys.executable, "-m", "mixprec.cli", *argv.split()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    assert NO_TQDM_NOTE in done.stderr.splitlines()  # one line, said once
    assert done.stderr.count("tqdm") == 1
    assert "| fp32 " in done.stdout and "| bf16 " in done.stdout
    assert done.stdout.startswith("GEMM speed on cpu (512x512 matmul")  # the line above the table
    assert NO_MATPLOTLIB_NOTE in done.stdout
    # the default --out: one fresh directory under ./runs/, md + JSON, no PNG
    (out,) = (tmp_path / RUNS_DIR).glob(f"{OUT_PREFIX}*")
    assert sorted(p.name for p in out.iterdir()) == ["bench_mlp_cpu.json", "bench_mlp_cpu.md"]
    data = json.loads((out / "bench_mlp_cpu.json").read_text())
    assert data["gemm_speed"].startswith("GEMM speed on cpu")
    assert data["gemm_speed"] in (out / "bench_mlp_cpu.md").read_text()
    rows = data["summary"]
    assert [(r["mode"], r["status"]) for r in rows] == [("fp32", "ok"), ("bf16", "ok")]


def test_default_out_is_fresh_and_a_stale_chart_is_removed(tmp_path, monkeypatch) -> None:
    first = fresh_out_dir(parent=tmp_path)
    first.mkdir()
    second = fresh_out_dir(parent=tmp_path)  # same second: a -N suffix, never the same one
    assert second != first and not second.exists() and second.name.startswith(OUT_PREFIX)
    model = {"name": "mlp", "width": 2, "depth": 1, "batch": 1, "lr": 0.1}
    config = {"model": model, "seed": 0, "warmup": 0, "steps": 1}
    report = BenchReport(config=config, device="cpu", machine="t", command="c")
    (tmp_path / "bench_mlp_cpu.png").write_bytes(b"old chart")

    def no_matplotlib(report, path):
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    monkeypatch.setattr(bench_report, "plot", no_matplotlib)
    paths = write_report(report, tmp_path)
    assert set(paths) == {"md", "json"} and not (tmp_path / "bench_mlp_cpu.png").exists()


def test_progress_bar_without_tqdm_is_a_silent_no_op(capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # None in sys.modules: import raises
    with progress_bar(total=3, enabled=True) as bar:
        bar.update(2)
        bar.set_postfix_str("bf16")
    assert capsys.readouterr().err == NO_TQDM_NOTE + "\n"
    with progress_bar(total=3, enabled=False) as bar:  # --no-progress: no bar and no note
        bar.update(1)
    assert capsys.readouterr().err == ""


def test_write_record_is_the_one_writer_of_the_benchmark_scripts(tmp_path) -> None:
    """The benchmark scripts write through write_record: md as given, JSON
    (a Path in argparse args as its str), the chart only when asked, a stale one removed."""
    (tmp_path / "zero_cpu.png").write_bytes(b"old chart")
    record = {"args": {"out": tmp_path}, "rows": [{"speed": 1.5}]}
    paths = bench_report.write_record(tmp_path, "zero_cpu", "| a |\n", record)
    assert set(paths) == {"md", "json"} and not (tmp_path / "zero_cpu.png").exists()
    assert paths["md"].read_text() == "| a |\n"
    assert json.loads(paths["json"].read_text()) == {
        "args": {"out": str(tmp_path)},
        "rows": [{"speed": 1.5}],
    }
    drawn = []
    paths = bench_report.write_record(tmp_path, "zero_cpu", "", record, drawn.append)
    assert drawn == [tmp_path / "zero_cpu.png"] and paths["png"] == drawn[0]
    scripts = ("bench_zero", "bench_fp8_comm", "bench_fp8", "bench_sync_free", "bench_lean")
    for script in (*scripts, "bench_compile", "bench_compile_gpt"):
        text = (Path(__file__).parent.parent / "benchmarks" / f"{script}.py").read_text()
        assert "write_record(" in text and "write_text" not in text.split("def main")[1], script


def test_bench_sync_free_runs_and_writes_its_record(tmp_path) -> None:
    """benchmarks/bench_sync_free.py at a tiny size: one row per optimizer with its per-round
    spread, the bytes the masked update copies counted from the state (params + moments)."""
    module = load_benchmark("bench_sync_free")
    out = tmp_path / "sf"
    assert module.main(["--width", "8", "--rounds", "2", "--steps", "1", "--out", str(out)]) == 0
    record = json.loads((out / "sync_free_cpu.json").read_text())
    rows = {r["optimizer"]: r for r in record["rows"]}
    assert set(rows) == set(module.OPTIMIZERS)
    for r in rows.values():
        assert r["ratio_min"] <= r["ratio_median"] <= r["ratio_max"]
    params = 4 * (8 * 8 + 8) * 4  # 4 x Linear(8): fp32 masters
    assert rows["SGD momentum"]["copied_mib"] * 2**20 == params * 2  # + momentum
    assert (
        rows["AdamW foreach"]["copied_mib"] * 2**20 == params * 3 + 4 * 2 * 4
    )  # + 2 moments, steps
    assert "| SGD momentum |" in (out / "sync_free_cpu.md").read_text()
