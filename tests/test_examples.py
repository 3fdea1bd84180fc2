"""The seeds' training scripts as runnable examples, each trained for a few steps.

examples/colossal_resnet (seed 000: launch, CONFIG, initialize, the Engine loop),
examples/colossal_engine (seed 001: a ViT with each of the four config files) and
examples/booster (seed 003: TorchDDPPlugin, Booster, boost, save_model/save_optimizer) run
in-process through their main(argv) in bf16 and one fp16 mode; the Booster example also runs
once on two processes under `mixprec run`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from mixprec import AMP_TYPE, prepare_model, to_policy
from mixprec.config import config_to_policy, gpc, load_config
from mixprec.core.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
EPOCH_LINE = re.compile(
    r"Epoch (\d+) - train loss: (\S+), test accuracy: ([0-9.]+), lr: \S+, "
    r"loss scale: (\S+), skipped steps: (\d+)"
)
CHANCE = 0.1
"""Ten balanced digit classes."""
LEARNED = 3 * CHANCE
"""Accuracy the few steps below must beat (they reach 0.4-0.75 in every mode)."""


def load_example(name: str) -> ModuleType:
    """examples/<name>/train.py as a module (both examples are called train.py)."""
    path = ROOT / "examples" / name / "train.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}_train", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


resnet_example = load_example("colossal_resnet")
engine_example = load_example("colossal_engine")
booster_example = load_example("booster")


def epoch_lines(text: str) -> list[tuple[int, float, float, float, int]]:
    """(epoch, train loss, test accuracy, loss scale, skipped steps) per logged epoch."""
    return [
        (int(m[1]), float(m[2]), float(m[3]), float(m[4]), int(m[5]))
        for m in EPOCH_LINE.finditer(text)
    ]


def logged(caplog: pytest.LogCaptureFixture, logger: str) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == logger)


def assert_torn_down() -> None:
    """main() leaves no process group or config behind (so it can run again in-process)."""
    assert not dist.is_initialized()
    assert dict(gpc.config) == {}


# ----- seed 000: ResNet34-style, launch + initialize + Engine -----


def test_resnet_config_is_seed_000s() -> None:
    config = resnet_example.make_config("torch", batch_size=128, num_epochs=200)
    assert config == dict(
        BATCH_SIZE=128,
        NUM_EPOCHS=200,
        fp16=dict(
            mode=AMP_TYPE.TORCH,
            init_scale=2.0**16,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=2000,
            enabled=True,
        ),
    )
    names = {
        mode: config_to_policy(resnet_example.make_config(mode, 1, 1)).name
        for mode in resnet_example.MODE_CHOICES
    }
    assert names == {
        "torch": "fp16",
        "naive": "fp16_naive",
        "apex": "O1",  # Apex opt_level O1, seed 000's default
        "bf16": "bf16",
        "fp32": "fp32",
    }
    with pytest.raises(ValueError, match=r"'bf61'.*Did you mean 'bf16'.*'torch'"):
        resnet_example.make_config("bf61", 1, 1)


def test_resnet_example_defaults_are_minutes_and_full_is_the_seeds(capsys) -> None:
    default = resnet_example.parse_args([])
    assert (default.epochs, default.batch_size) == (2, 64)
    full = resnet_example.parse_args(["--full"])
    seed = resnet_example.make_config("torch", batch_size=128, num_epochs=200)
    assert (full.epochs, full.batch_size) == (seed["NUM_EPOCHS"], seed["BATCH_SIZE"])
    with pytest.raises(SystemExit):
        resnet_example.parse_args(["--full", "--epochs", "3"])
    assert "--full sets --epochs and --batch-size" in capsys.readouterr().err


@pytest.mark.parametrize(("mode", "scaled"), [("bf16", False), ("torch", True)])
def test_resnet_example_learns(mode: str, scaled: bool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="colossal_resnet")
    argv = ["--mode", mode, "--epochs", "1", "--max-steps", "30", "--batch-size", "32"]
    accuracy = resnet_example.main([*argv, "--width", "4"])  # width 4: fp16 convs are slow on CPU
    assert_torn_down()
    assert accuracy > LEARNED, accuracy
    ((epoch, loss, logged_accuracy, scale, skipped),) = epoch_lines(
        logged(caplog, "colossal_resnet")
    )
    assert epoch == 0 and abs(logged_accuracy - accuracy) < 1e-4  # logged with 4 decimals
    assert torch.isfinite(torch.tensor(loss))
    if scaled:  # torch amp: starts at init_scale=2**16 and only halves, growth_interval is 2000
        assert scale == 2.0**16 / 2**skipped
    else:  # bf16: no loss scaling at all
        assert (scale, skipped) == (1.0, 0)


# ----- seed 001: ViT, a config file per precision, initialize + Engine -----

ENGINE_CONFIGS = ROOT / "examples" / "colossal_engine" / "config"
SEED_001_POLICIES = {
    "config_fp32.py": "fp32",
    "config_AMP_torch.py": "fp16",
    "config_AMP_naive.py": "fp16_naive",
    "config_AMP_apex.py": "O1",  # Apex's default opt_level
}
"""Seed 001's four config files and the precision each one must select."""


def test_engine_configs_are_seed_001s() -> None:
    assert sorted(p.name for p in ENGINE_CONFIGS.glob("*.py")) == sorted(SEED_001_POLICIES)
    configs = {name: load_config(ENGINE_CONFIGS / name) for name in SEED_001_POLICIES}
    assert {n: config_to_policy(c).name for n, c in configs.items()} == SEED_001_POLICIES
    assert "fp16" not in configs["config_fp32.py"]
    # the files differ in their fp16 section alone, so the table compares precisions only
    shared = [{k: v for k, v in c.items() if k != "fp16"} for c in configs.values()]
    assert all(s == shared[0] for s in shared), shared
    assert shared[0]["clip_grad_norm"] == 1.0  # the seed's
    model = engine_example.build_model(configs["config_fp32.py"])
    assert isinstance(model, engine_example.ViT)


@pytest.mark.parametrize("name", list(SEED_001_POLICIES))
def test_engine_example_learns_with_each_config(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="colossal_engine")
    threads = torch.get_num_threads()
    history = engine_example.main(["--config", str(ENGINE_CONFIGS / name), "--epochs", "2"])
    assert_torn_down()
    assert torch.get_num_threads() == threads  # --cpu-threads is undone on the way out
    assert [s.epoch for s in history] == [0, 1]
    first, last = history
    assert last.test_accuracy > LEARNED, history
    assert last.train_loss < first.train_loss, history
    batch = load_config(ENGINE_CONFIGS / name).BATCH_SIZE  # one process: the global batch
    assert all(s.it_s > 0 and s.samples_s == s.it_s * batch for s in history)
    assert all(0 <= s.peak_delta_bytes <= s.peak_bytes for s in history)

    # each epoch is logged with what main returned, then the seed's table row
    text = logged(caplog, "colossal_engine")
    lines = epoch_lines(text)
    assert [(e, round(a, 4), k) for e, _, a, _, k in lines] == [
        (s.epoch, round(s.test_accuracy, 4), s.skipped_steps) for s in history
    ]
    policy = SEED_001_POLICIES[name]
    label = "FP32 training" if policy == "fp32" else f"({policy})"
    assert re.search(
        rf"^\| [^|]*{re.escape(label)} \|.* \| {last.test_accuracy:.4f} \|$", text, re.M
    )

    scale, skipped = last.loss_scale, last.skipped_steps
    if policy == "fp32":  # no loss scaling, nothing to overflow
        assert (scale, skipped) == (1.0, 0)
    elif policy == "fp16_naive":
        # Megatron's scaler starts at 2**32, which overflows fp16 gradients: the first
        # overflow spends the hysteresis of 2, every later one halves the scale
        assert skipped >= 1 and scale == 2.0**32 / 2 ** (skipped - 1)
    else:  # torch / Apex O1: 2**16, halved per overflow, growth only after 2000 clean steps
        assert scale == 2.0**16 / 2**skipped


# ----- seed 003: ViT, Booster + TorchDDPPlugin, checkpoint -----


def checkpoint_accuracy(out: Path, mode: str) -> float:
    """Test accuracy of the saved fp32 model, rebuilt from scratch and prepared for mode."""
    model = booster_example.build_model()
    model.load_state_dict(load_checkpoint(out / "model.pt"))  # strict: every key, no extras
    _, test_dataset = booster_example.build_datasets()
    loader = DataLoader(test_dataset, batch_size=256)
    return booster_example.evaluate(
        prepare_model(model, to_policy(mode)), loader, torch.device("cpu")
    )


@pytest.mark.parametrize(
    ("mode", "extra"), [("bf16", []), ("fp16", ["--custom"])], ids=["bf16", "fp16-custom"]
)
def test_booster_example_learns_and_saves(
    mode: str, extra: list[str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="booster_example")
    steps = 10
    argv = ["--mixed-precision", mode, "--epochs", "1", "--max-steps", str(steps)]
    accuracy = booster_example.main([*argv, "--out", str(tmp_path), *extra])
    assert_torn_down()
    assert accuracy > LEARNED, accuracy
    text = logged(caplog, "booster_example")
    custom = "FP16TorchMixedPrecision" if extra else "BF16MixedPrecision"
    assert f"Booster(mixed_precision={custom}(policy='{mode}')" in text
    ((_, _, _, scale, skipped),) = epoch_lines(text)

    # the model file holds fp32 weights that score exactly what training reported (same
    # weights, same kernels, same batches: bitwise equal logits on one process)
    assert checkpoint_accuracy(tmp_path, mode) == accuracy
    state = load_checkpoint(tmp_path / "optimizer.pt")
    assert (state["steps"], state["skipped_steps"]) == (steps, skipped)
    assert float(state["scaler"]["scale"]) == scale
    assert all(m.dtype == torch.float32 for m in state["master_weights"])


@pytest.mark.distributed
def test_booster_example_under_mixprec_run_on_two_processes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"  # two workers share two cores
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "mixprec.cli", "run", "--nproc_per_node", "2"]
    cmd += [str(ROOT / "examples" / "booster" / "train.py"), "--mixed-precision", "fp16"]
    cmd += ["--epochs", "1", "--max-steps", "10", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "world_size=2" in proc.stdout, proc.stdout
    lines = epoch_lines(proc.stdout)
    assert len(lines) == 1, proc.stdout  # rank 0 alone logs
    assert lines[0][2] > LEARNED, proc.stdout  # accuracy over both ranks' test shards
    # rank 0 wrote one fp32 model file that loads into a fresh model, and the optimizer's
    assert checkpoint_accuracy(tmp_path, "fp16") > LEARNED
    assert load_checkpoint(tmp_path / "optimizer.pt")["steps"] == 10


# ----- every script writes to a fresh runs/<name>-<UTC time>/ by default -----


def _reference_results() -> dict[str, bytes]:
    results = ROOT / "benchmarks" / "results"
    return {
        str(p.relative_to(results)): p.read_bytes()
        for p in sorted(results.rglob("*"))
        if p.is_file()
    }


def test_booster_example_saves_to_a_fresh_runs_folder_by_default(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["--mixed-precision", "bf16", "--epochs", "1", "--max-steps", "2"]
    booster_example.main(argv)
    booster_example.main(argv)  # a second run: a second folder, the first one untouched
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all(r.name.startswith("booster-") for r in runs)
    for run in runs:
        assert sorted(p.name for p in run.iterdir()) == ["model.pt", "optimizer.pt"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "argv", "files"),
    [
        (
            "benchmarks/bench_fp8.py",
            "--widths 16 --mlp-max-width 16 --steps 1 --warmup 0 --modes bf16 --threads 1",
            {"fp8_cpu.md", "fp8_cpu.json", "fp8_cpu.png"},
        ),
        (
            "examples/digits_accuracy.py",
            "--models cnn --modes fp32 --epochs 1 --fp32-seeds 0",
            {"digits_accuracy.md", "digits_accuracy.json", "digits_curves.png"},
        ),
    ],
    ids=["bench_fp8", "digits_accuracy"],
)
def test_results_go_to_a_fresh_runs_folder_not_the_references(
    script: str, argv: str, files: set[str], tmp_path: Path
) -> None:
    before = _reference_results()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / script), *argv.split()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.startswith(Path(script).stem + "-")
    assert {p.name for p in run.iterdir()} == files
    assert str(run.relative_to(tmp_path)) in proc.stdout + proc.stderr  # the path is printed
    assert _reference_results() == before  # the tracked references are untouched
