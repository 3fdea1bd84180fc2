"""benchmarks/bench_fp8.py's recipe and training axes at a tiny size, and the training axis's
GPT (mixprec.bench.gpt) in every recipe: skipped steps and resume bit for bit."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import pytest
import torch
from benchmark_scripts import load_benchmark

from mixprec.bench.gpt import GPT, gpt_batch, gpt_loss, stdlib_text
from mixprec.fp8 import RECIPES


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_fp8")


def test_recipe_axis_writes_one_row_per_recipe(bench, tmp_path: Path) -> None:
    out = tmp_path / "recipes"
    argv = ["--recipes", "all", "--widths", "32", "--tokens", "16", "--steps", "1"]
    assert bench.main([*argv, "--warmup", "0", "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {
        "fp8_recipes_cpu.md",
        "fp8_recipes_cpu.json",
        "fp8_recipes_cpu.png",
    }
    rows = json.loads((out / "fp8_recipes_cpu.json").read_text())["results"]
    assert [r["recipe"] for r in rows] == list(RECIPES)
    by_recipe = {r["recipe"]: r["sqnr_db"] for r in rows}
    # rowwise_with_gw_hp leaves grad_weight unquantized: no entry for it
    assert "grad_weight.A" not in by_recipe["rowwise_with_gw_hp"]
    assert set(by_recipe["blockwise"]) == {
        f"{g}.{o}" for g in ("forward", "grad_input", "grad_weight") for o in "AB"
    }
    assert min(by_recipe["nvfp4"].values()) < 25 < min(by_recipe["mxfp8"].values())
    assert "| nvfp4 | 32 |" in (out / "fp8_recipes_cpu.md").read_text()


@pytest.fixture
def keep_threads():
    """bench_fp8 --threads sets torch's thread count for the process: restored after."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


TINY_TRAIN = [
    "--train-width", "32", "--train-depth", "1", "--train-heads", "2", "--train-context", "16",
    "--train-batch", "4", "--train-steps", "8", "--eval-every", "4", "--seeds", "2",
    "--text-bytes", "100000", "--no-progress", "--threads", "1",
]  # fmt: skip
"""A run of every mode in a few seconds of CPU (one thread: on shared cores two wait on
each other at every op)."""


def test_training_axis_runs_every_recipe_and_judges_against_the_seed_spread(
    bench, tmp_path, keep_threads
):
    """The whole --train run at a tiny size: its files, one run per baseline seed and recipe,
    and the table's verdicts recomputed here from the runs' own losses."""
    out = tmp_path / "train"
    assert bench.main(["--train", *TINY_TRAIN, "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {
        "fp8_train_cpu.md",
        "fp8_train_cpu.json",
        "fp8_train_cpu.png",
    }
    record = json.loads((out / "fp8_train_cpu.json").read_text())
    runs = record["runs"]
    plan = [("fp32", 0), ("fp32", 1), ("bf16", 0), ("bf16", 1), *((r, 0) for r in RECIPES)]
    assert [(r["mode"], r["seed"]) for r in runs] == plan
    for run in runs:
        assert len(run["train_loss"]) == 8 and [s for s, _ in run["val_curve"]] == [4, 8]
        assert run["val_curve"][-1][1] == run["val_loss"] and run["skipped_steps"] == 0
        # recipes convert the block's 4 Linear layers, the head stays in bf16
        assert len(run["converted"]) == (0 if run["mode"] in ("fp32", "bf16") else 4)
        assert "head" not in run["converted"]
    # seed 0 of every mode starts from one init on one batch: step 0's losses agree to the
    # quantization error (fp8 vs fp32 logits of a 32-wide untrained GPT: well under 0.01)
    first = [r["train_loss"][0] for r in runs if r["seed"] == 0]
    assert max(first) - min(first) < 0.01, first
    fp32 = [r["val_loss"] for r in runs if r["mode"] == "fp32"]
    bf16 = {r["seed"]: r["val_loss"] for r in runs if r["mode"] == "bf16"}
    table = (out / "fp8_train_cpu.md").read_text()
    for verdict in record["verdicts"]:
        v = verdict["val_loss"]
        if verdict["mode"] == "bf16":
            assert verdict["gap_to_bf16"] is None
        else:
            assert verdict["gap_to_bf16"] == v - bf16[verdict["seed"]]
        where = verdict["vs_fp32_spread"]
        if min(fp32) <= v <= max(fp32):
            assert where == "inside"
        else:
            assert where.endswith("above" if v > max(fp32) else "below")
        assert f"| {verdict['mode']} | {verdict['seed']} | {v:.4f} |" in table


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--train", "--seeds", "1"], "--seeds >= 2"),
        (["--train", "--train-lr", "0"], "'train_lr': 0.0"),
        (["--train", "--widths", "64"], "['--widths'] time the Linear sweeps"),
        (["--recipes", "all", "--train-steps", "9"], "['--train-steps'] set the training axis"),
    ],
)
def test_training_axis_refuses_options_it_would_not_read(bench, capsys, argv, said):
    """One seed has no spread; a sweep's option under --train, or a training option without
    it, would be accepted and not read."""
    with pytest.raises(SystemExit):
        bench.main([*argv, "--no-write"])
    assert said in capsys.readouterr().err


# ----------------------------------------------------------------------------- the GPT's step

TINY = argparse.Namespace(
    train_width=32, train_depth=1, train_heads=2, train_context=16, train_lr=2e-3
)
TEXT = stdlib_text(50_000)[0]


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    return gpt_batch(TEXT, 4, TINY.train_context, torch.Generator().manual_seed(100 + i))


def train(model, opt, steps) -> None:
    for i in steps:
        opt.backward(gpt_loss(model, *batch(i)))
        assert not opt.step().skipped
        opt.zero_grad()


@pytest.mark.parametrize("recipe", RECIPES)
def test_gpt_skipped_step_and_resume_are_bitwise(bench, recipe):
    """The training axis's GPT as bench_fp8 builds it. A step whose loss is inf is skipped and
    leaves the weights and optimizer state as they were: the run then ends on the same bits
    as one that never took it (run in fork_rng: nvfp4's stochastic rounding of the skipped
    step's gradients draws from the default generator, which a step that never happened would
    not). Saved after 2 steps (with the RNG state, for nvfp4) and resumed in a fresh model,
    steps 3-4 give the uninterrupted run's bits."""
    device = torch.device("cpu")
    torch.manual_seed(7)
    model, opt = bench.build_gpt(recipe, 0, TINY, device)
    train(model, opt, range(2))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), torch.get_rng_state()))
    train(model, opt, range(2, 4))

    torch.manual_seed(7)
    skipping, sopt = bench.build_gpt(recipe, 0, TINY, device)
    train(skipping, sopt, range(2))
    before = copy.deepcopy((skipping.state_dict(), sopt.state_dict()))
    with torch.random.fork_rng():
        sopt.backward(gpt_loss(skipping, *batch(99)) * float("inf"))
        assert sopt.step().skipped
        sopt.zero_grad()
    for (name, p), q in zip(skipping.state_dict().items(), before[0].values(), strict=True):
        assert torch.equal(p, q), name
    assert str(sopt.state_dict()["state"]) == str(before[1]["state"])
    train(skipping, sopt, range(2, 4))

    resumed, ropt = bench.build_gpt(recipe, 0, TINY, device)
    resumed.load_state_dict(saved[0])
    ropt.load_state_dict(saved[1])
    torch.set_rng_state(saved[2])
    train(resumed, ropt, range(2, 4))

    want = model.state_dict()
    for other in (skipping, resumed):
        for name, p in other.state_dict().items():
            assert torch.equal(p, want[name]), name


def test_gpt_rejects_heads_that_do_not_divide_the_width():
    with pytest.raises(ValueError, match="width=30 must be divisible by heads=4"):
        GPT(30, 1, 4, 8)
