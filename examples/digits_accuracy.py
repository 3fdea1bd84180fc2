"""Does mixed precision cost accuracy? A small CNN and a small ViT on scikit-learn's digits.

Every mode of `mixprec bench` (fp32, fp16 = AMP_TYPE.TORCH, bf16, fp16_naive = AMP_TYPE.NAIVE,
Apex O1/O2/O3, fp8) trains the same model from the same initial weights on the same batches,
through `mixprec.convert_to_amp`. The digits stay 8x8 (upsampling only made the fp16 modes,
which have no fast CPU kernels, slower). Reports test accuracy per mode next to fp32 (goal:
within 1 point), and plots the loss curves and each optimizer's loss scale.

    python examples/digits_accuracy.py                       # every mode, both models
    python examples/digits_accuracy.py --models vit --modes fp32,bf16 --epochs 5

Writes digits_accuracy.{md,json} and digits_curves.png to a new runs/digits_accuracy-<UTC time>/
(--out benchmarks/results rewrites the committed reference).

Run time on the reference CPU (2-core AMD EPYC, OMP_NUM_THREADS=1), defaults: 177 s for every
mode on both models (the run behind benchmarks/results/digits_accuracy.md, one torch thread); a
tqdm bar counts the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from tqdm import tqdm

from mixprec import convert_to_amp
from mixprec.bench import BENCH_MODES, ResNet, ViT, amp_args, amp_call_text, parse_modes
from mixprec.bench.command import fresh_out_dir
from mixprec.bench.runner import machine_name
from mixprec.core.policy import did_you_mean
from mixprec.fp8 import Float8Linear

IMAGE_SIZE = 8
"""load_digits' images are 8x8, pixel values 0..16."""
TEST_FRACTION = 0.2
"""Share of the 1797 digits held out (359 images: one image is 0.28 accuracy points)."""
TOLERANCE_POINTS = 1.0
"""The goal: every mode's test accuracy within this many points of fp32's."""


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): images (N, 1, 8, 8) scaled to zero mean, unit std."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """How one model trains (the same in every mode)."""

    optimizer: str
    """'sgd' (momentum 0.9) or 'adamw'."""
    lr: float
    """Learning rate."""
    epochs: int
    """Passes over the 1438 training digits."""


RECIPES: dict[str, Recipe] = {
    "cnn": Recipe(optimizer="sgd", lr=0.05, epochs=8),
    # SGD trains this ViT slowly; AdamW's eps is 1e-4 because O3 steps fp16 params directly and
    # eps=1e-8 would round to 0 in fp16 state (mixprec refuses it)
    "vit": Recipe(optimizer="adamw", lr=3e-3, epochs=16),
}
MODELS = tuple(RECIPES)


def build(name: str) -> nn.Module:
    """The two small models, from mixprec.bench's ResNet and ViT."""
    if name == "cnn":  # 4 stages, 8->64 channels over 8->1 pixels; fc 64->10
        return ResNet(in_chans=1, num_classes=10, width=8, blocks=1)
    # 4 patches of 4x4 + cls; dims are multiples of 16, so fp8 converts qkv, proj and the MLP
    return ViT(
        image_size=IMAGE_SIZE,
        patch_size=4,
        in_chans=1,
        num_classes=10,
        dim=64,
        depth=2,
        heads=4,
        mlp_ratio=2,
    )


def make_optimizer(recipe: Recipe, model: nn.Module) -> torch.optim.Optimizer:
    if recipe.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=recipe.lr, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=recipe.lr, eps=1e-4)


def train_one(
    model_name: str,
    mode: str,
    recipe: Recipe,
    data: tuple[torch.Tensor, ...],
    args: argparse.Namespace,
    bar: tqdm,
    seed: int,
) -> dict:
    """Train one model in one mode; return its curves, accuracy and timing."""
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(seed)  # the same initial weights in every mode
    model = build(model_name)
    optimizer = make_optimizer(recipe, model)
    model, optimizer, criterion = convert_to_amp(
        model, optimizer, nn.CrossEntropyLoss(), *amp_args(mode)
    )
    steps_per_epoch = -(-len(y_train) // args.batch)
    # cosine decay to 0: the last steps are small, so the final weights (and the accuracy)
    # depend less on the noise of the last few batches, and modes compare more fairly
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=recipe.epochs * steps_per_epoch
    )
    fp8_layers = sum(isinstance(m, Float8Linear) for m in model.modules())
    order_gen = torch.Generator().manual_seed(seed)  # the same batches in every mode
    losses, scales = [], []
    start = time.perf_counter()
    model.train()
    for _ in range(recipe.epochs):
        order = torch.randperm(len(y_train), generator=order_gen)
        for i in range(0, len(order), args.batch):
            idx = order[i : i + args.batch]
            loss = criterion(model(x_train[idx]), y_train[idx])
            optimizer.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
            losses.append(loss.item())  # a host sync; on CPU it costs nothing
            scales.append(optimizer.loss_scale)
            bar.update()
    seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        correct = (model(x_test).argmax(dim=1) == y_test).sum().item()
    return {
        "model": model_name,
        "mode": mode,
        "seed": seed,
        "recipe": vars(recipe),
        "amp_call": amp_call_text(mode),
        "accuracy": 100.0 * correct / len(y_test),
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "skipped_steps": optimizer.skipped_steps,
        "fp8_layers": fp8_layers,
        "train_s": seconds,
        "losses": losses,
        "loss_scales": scales,
    }


def render(
    runs: list[dict], spread: list[dict], args: argparse.Namespace, wall_s: float, busy: str
) -> str:
    recipes = "; ".join(
        f"{name}: {r['recipe']['optimizer']} lr {r['recipe']['lr']:g}, "
        f"{r['recipe']['epochs']} epochs"
        for name, r in {r["model"]: r for r in runs}.items()
    )
    lines = [
        "# Test accuracy per mode: scikit-learn digits (8x8), small CNN and ViT",
        "",
        f"Machine: {machine_name(torch.device('cpu'))}; {time.strftime('%Y-%m-%d', time.gmtime())}.",
        "",
        f"{recipes}; batch {args.batch}, seed {args.seed}; same initial weights and batches in "
        f"every mode, all through `mixprec.convert_to_amp`. Test set: {runs[0]['n_test']} images "
        f"(one image = {100 / runs[0]['n_test']:.2f} points). Goal: within "
        f"{TOLERANCE_POINTS:g} point of fp32. Whole run: {wall_s:.0f} s on "
        f"{torch.get_num_threads()} CPU thread(s).{busy}",
        "",
        "| model | mode | convert_to_amp | test acc % | Δ vs fp32 (points) | within goal "
        "| final loss | skipped steps | final loss scale | fp8 layers | train s |",
        "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        base = next(r for r in runs if r["model"] == run["model"] and r["mode"] == "fp32")
        delta = run["accuracy"] - base["accuracy"]
        ok = "yes" if abs(delta) <= TOLERANCE_POINTS else "above" if delta > 0 else "**no**"
        lines.append(
            f"| {run['model']} | {run['mode']} | {run['amp_call']} | {run['accuracy']:.2f} "
            f"| {delta:+.2f} | {ok} | {run['final_loss']:.4f} | {run['skipped_steps']} "
            f"| {run['loss_scales'][-1]:g} | {run['fp8_layers']} | {run['train_s']:.1f} |"
        )
    lines += [
        "",
        "within goal: 'above' means more than the goal away but better than fp32. How far apart "
        "fp32 runs land on their own (the yardstick for the Δ column):",
        "",
    ]
    for name in dict.fromkeys(r["model"] for r in runs):
        accs = [r["accuracy"] for r in runs + spread if r["model"] == name and r["mode"] == "fp32"]
        seeds = sorted(
            r["seed"] for r in runs + spread if r["model"] == name and r["mode"] == "fp32"
        )
        lines.append(
            f"- {name}: fp32 over seeds {seeds} (init and batch order): "
            f"{', '.join(f'{a:.2f}' for a in accs)} %; spread {max(accs) - min(accs):.2f} points."
        )
    lines += [
        "",
        "final loss: mean training loss of the last 10 steps. fp8 layers: Linear layers "
        "converted to Float8Linear (the CNN's only Linear, its 64->10 head, is not a multiple "
        "of 16, so its fp8 run computes like bf16). Curves: digits_curves.png.",
        "",
    ]
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in runs))
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 4 * len(models)), squeeze=False)
    window = 10  # steps per moving average: single-batch losses are noisy
    for row, name in enumerate(models):
        ax_loss, ax_scale = axes[row]
        for run in (r for r in runs if r["model"] == name):
            loss = torch.tensor(run["losses"])
            smooth = F.avg_pool1d(loss[None, None], window, stride=1)[0, 0]
            ax_loss.plot(range(window, len(loss) + 1), smooth, label=run["mode"], linewidth=1)
            ax_scale.plot(run["loss_scales"], label=run["mode"], linewidth=1)
        ax_loss.set_yscale("log")
        ax_loss.set_title(f"{name}: training loss ({window}-step moving average)", fontsize=9)
        ax_loss.set_xlabel("step")
        ax_scale.set_yscale("log", base=2)
        ax_scale.set_title(f"{name}: optimizer.loss_scale after each step", fontsize=9)
        ax_scale.set_xlabel("step")
        ax_loss.legend(fontsize=7, ncol=2)
        ax_scale.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="cnn,vit", help="comma-separated: cnn, vit")
    parser.add_argument("--modes", default="all", help=f"comma-separated of {BENCH_MODES}")
    parser.add_argument("--epochs", type=int, help="override both recipes' epochs")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: these models are tiny, and on a shared machine a "
        "second OpenMP thread mostly waits at barriers)",
    )
    parser.add_argument(
        "--fp32-seeds",
        type=int,
        default=4,
        help="extra fp32 runs with other seeds: how far fp32 differs from itself (default 4)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for md/json/png (default: a new runs/digits_accuracy-<UTC time>/; "
        "benchmarks/results/ holds the reference, rewritten only when named here)",
    )
    args = parser.parse_args(argv)
    try:
        modes = parse_modes(args.modes)
    except ValueError as err:
        parser.error(str(err))
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for name in models:
        if name not in MODELS:
            parser.error(f"Unknown model {name!r}." + did_you_mean(name, MODELS))
    torch.set_num_threads(args.threads)
    recipes = {
        name: Recipe(**{**vars(RECIPES[name]), "epochs": args.epochs or RECIPES[name].epochs})
        for name in models
    }
    if "fp32" not in modes:
        modes = ("fp32", *modes)  # the reference every accuracy is compared with

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    busy = (
        f" Timings taken on a busy machine (load average {load:.1f} on {os.cpu_count()} cores)."
        if load > 0.5 * (os.cpu_count() or 1)
        else ""
    )
    data = load_data(args.seed)
    steps_per_epoch = -(-len(data[1]) // args.batch)
    runs_per_model = len(modes) + args.fp32_seeds
    total = sum(r.epochs for r in recipes.values()) * steps_per_epoch * runs_per_model
    runs: list[dict] = []
    spread: list[dict] = []
    start = time.perf_counter()
    with tqdm(total=total, unit="step", file=sys.stderr) as bar:
        for name in models:
            for mode in modes:
                bar.set_postfix_str(f"{name} {mode}")
                run = train_one(name, mode, recipes[name], data, args, bar, args.seed)
                run["n_test"] = len(data[3])
                runs.append(run)
            for seed in range(args.seed + 1, args.seed + 1 + args.fp32_seeds):
                bar.set_postfix_str(f"{name} fp32 seed {seed}")
                spread.append(train_one(name, "fp32", recipes[name], data, args, bar, seed))
    wall_s = time.perf_counter() - start

    args.out = args.out or fresh_out_dir("digits_accuracy")
    args.out.mkdir(parents=True, exist_ok=True)
    table = render(runs, spread, args, wall_s, busy)
    print(table)
    (args.out / "digits_accuracy.md").write_text(table)
    record = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "wall_s": wall_s,
        "runs": runs,
        "fp32_other_seeds": [
            {k: v for k, v in r.items() if k not in ("losses", "loss_scales")} for r in spread
        ],
    }
    (args.out / "digits_accuracy.json").write_text(json.dumps(record) + "\n")
    plot(runs, args.out / "digits_curves.png")
    print(f"wrote {args.out}/digits_accuracy.md, .json and digits_curves.png ({wall_s:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
