"""Seed 001's ViT AMP example with mixprec in place of colossalai, on scikit-learn's digits.

One process (no launcher: the script starts a world of one itself):
    python examples/colossal_engine/train.py --config examples/colossal_engine/config/config_AMP_torch.py
Two processes (gloo on CPU, nccl on GPUs; initialize shards the data):
    mixprec run --nproc_per_node 2 examples/colossal_engine/train.py \
        --config examples/colossal_engine/config/config_AMP_naive.py

The config picks the precision (config_fp32, config_AMP_torch, config_AMP_naive,
config_AMP_apex) and the ViT's shape; the loop below is the same for all of them. The 8x8
digits ship with scikit-learn (no download) and stand in for Caltech101.

Run time on the reference CPU (2-core AMD EPYC, OMP_NUM_THREADS=1), defaults: 98 s with
config_AMP_torch.py (one log line per epoch), measured while the shared machine ran at load
average ~17-21 (idle is several times faster).
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec
from mixprec import AMP_TYPE
from mixprec.bench.models import ViT
from mixprec.bench.worker import reset_peak_rss, rss_peak_bytes
from mixprec.config import gpc
from mixprec.launch import destroy, get_default_parser

logger = logging.getLogger("colossal_engine")

DIGIT_SIZE = 8
"""Side of scikit-learn's digit images; IMG_SIZE above it upsamples them."""
TEST_FRACTION = 0.2
"""Share of the 1797 digits held out for the test accuracy (359 images)."""
SPLIT_SEED = 0
"""Seed of the train/test split: the same on every rank, so shards partition one split."""
MODEL_SEED = 0
"""Seed of the ViT's initialisation, so every config starts from the same weights."""
MIB = 2**20


class EpochStats(NamedTuple):
    """What one epoch measured, as logged on rank 0."""

    epoch: int
    """0-based epoch index."""
    train_loss: float
    """Mean criterion value over this epoch's training steps on this rank (fp32)."""
    test_accuracy: float
    """Share of the test set classified correctly, over every rank's shard."""
    lr: float
    """Learning rate after the epoch's last step."""
    loss_scale: float
    """The loss scale the next step will use (1 where the mode does not scale)."""
    skipped_steps: int
    """Steps skipped so far for inf/nan gradients."""
    it_s: float
    """Training iterations per second over the epoch (data loading included, as in the seed)."""
    samples_s: float
    """Training samples per second over all ranks: it_s x BATCH_SIZE x world size."""
    peak_bytes: int
    """Peak memory so far: CUDA allocator peak, or the process's peak RSS on CPU."""
    peak_delta_bytes: int
    """peak_bytes minus the baseline taken before the model existed: model, state, activations."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digits_to_images(images: torch.Tensor, image_size: int) -> torch.Tensor:
    """(N, 8, 8) pixel values 0..16 -> (N, 1, S, S), normalised as the seed's
    transforms.Normalize(0.5, 0.5) does; S > 8 upsamples bilinearly."""
    x = images.unsqueeze(1) / 16.0
    if image_size != DIGIT_SIZE:
        x = F.interpolate(x, size=image_size, mode="bilinear")
    return (x - 0.5) / 0.5


def build_datasets(image_size: int) -> tuple[TensorDataset, TensorDataset]:
    """Digits as (1, S, S) images, split train/test the same way on every rank."""
    digits = load_digits()
    x = digits_to_images(torch.tensor(digits.images, dtype=torch.float32), image_size)
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(len(y) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def build_model(cfg: mixprec.Config) -> nn.Module:
    """ViT-B/16's layout (conv patch embedding, class token, pre-norm blocks of LayerNorm,
    multi-head self-attention and MLP) at the config's size, DROP_RATE dropout before the head
    (timm's head_drop; the seed builds vit_base_patch16_224(drop_rate=0.1))."""
    torch.manual_seed(MODEL_SEED)
    model = ViT(
        image_size=cfg.IMG_SIZE,
        patch_size=cfg.PATCH_SIZE,
        in_chans=1,
        num_classes=cfg.NUM_CLASSES,
        dim=cfg.HIDDEN_SIZE,
        depth=cfg.DEPTH,
        heads=cfg.NUM_HEADS,
        mlp_ratio=cfg.MLP_RATIO,
    )
    model.head = nn.Sequential(nn.Dropout(cfg.DROP_RATE), model.head)
    return model


def warmup_cosine(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """LR factor per optimizer step: linear warmup, then cosine decay to 0."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


class PeakMemory:
    """Peak memory since construction: the CUDA allocator's, or the process's RSS on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline = torch.cuda.memory_allocated(device)
        else:
            reset_peak_rss()  # else import-time transients would hide the small model
            self.baseline = rss_peak_bytes()

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return rss_peak_bytes()


def evaluate(engine: mixprec.Engine, loader: DataLoader, device: torch.device) -> float:
    """Test accuracy over every rank's shard (counts summed across ranks)."""
    engine.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # correct, seen
    with torch.no_grad():
        for img, label in loader:
            img, label = img.to(device), label.to(device)
            counts[0] += (engine(img).argmax(dim=-1) == label).sum()
            counts[1] += label.numel()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    return float(counts[0] / counts[1])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = get_default_parser()
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("--epochs", type=int, default=None, help="override the config's NUM_EPOCHS")
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="torch's intra-op CPU threads while training (default 1: this ViT's ops are too "
        "small to split, and split ones stall whenever another process holds a core)",
    )
    args = parser.parse_args(argv)
    if args.config is None:
        parser.error("--config is required (one of examples/colossal_engine/config/*.py)")
    for key in ("epochs", "cpu_threads"):
        value = getattr(args, key)
        if value is not None and value < 1:
            parser.error(f"--{key.replace('_', '-')}={value} must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> list[EpochStats]:
    """Train as seed 001 does; log each epoch and a summary row on rank 0; return the epochs."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.cpu_threads)

    # initialize distributed setting: torchrun / `mixprec run` export RANK, else a world of one
    if "RANK" in os.environ:
        mixprec.launch_from_torch(config=args.config, backend=args.backend)
    else:
        mixprec.launch(
            args.config,
            rank=0,
            world_size=1,
            host="127.0.0.1",
            port=free_port(),
            backend=args.backend,
        )
    try:
        return train(num_epochs=args.epochs)
    finally:
        # A gloo group whose last owner is DDP's reducer is destroyed with the GIL held, which
        # can deadlock gloo's worker thread at exit: free every DDP (train's frame) first.
        gc.collect()
        destroy()
        torch.set_num_threads(threads)  # main() may run inside a bigger program (the tests)


def train(num_epochs: int | None = None) -> list[EpochStats]:
    """Build everything from gpc.config, train, log loss, accuracy, it/s and memory per epoch."""
    cfg = gpc.config
    num_epochs = cfg.NUM_EPOCHS if num_epochs is None else num_epochs
    # initialize moves the model to the current CUDA device where there is one
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    # build dataloaders first, so the memory baseline holds the data but not the model
    train_dataset, test_dataset = build_datasets(cfg.IMG_SIZE)
    train_dataloader = DataLoader(train_dataset, batch_size=cfg.BATCH_SIZE, shuffle=True)
    test_dataloader = DataLoader(test_dataset, batch_size=256, shuffle=False)
    memory = PeakMemory(device)

    # build model, optimizer, criterion and the per-step schedule
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.LEARNING_RATE, weight_decay=cfg.WEIGHT_DECAY
    )
    criterion = nn.CrossEntropyLoss()
    # every rank sees ceil(N / world) samples per epoch (DistributedSampler pads)
    steps_per_epoch = math.ceil(math.ceil(len(train_dataset) / gpc.world_size) / cfg.BATCH_SIZE)
    total_steps = num_epochs * steps_per_epoch
    # at most half the run warms up, so a one-epoch run still trains at the full LR
    warmup_steps = min(cfg.WARMUP_EPOCHS * steps_per_epoch, total_steps // 2)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(warmup_steps, total_steps)
    )

    # the config's fp16 / clip_grad_norm / gradient_accumulation are applied here; the engine
    # owns the schedule and advances it after every step that was not skipped on overflow
    engine, train_dataloader, test_dataloader, _ = mixprec.initialize(
        model, optimizer, criterion, train_dataloader, test_dataloader, lr_scheduler
    )
    if gpc.rank == 0:
        logger.info("%r world_size=%d", engine, gpc.world_size)

    history: list[EpochStats] = []
    for epoch in range(num_epochs):
        engine.train()
        loss_sum = torch.zeros((), device=device)  # summed on device: no host sync per step
        steps = 0
        start = time.perf_counter()
        for img, label in train_dataloader:
            img, label = img.to(device), label.to(device)
            engine.zero_grad()
            output = engine(img)
            train_loss = engine.criterion(output, label)
            engine.backward(train_loss)
            engine.step()
            loss_sum += train_loss.detach().float()
            steps += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the epoch's time must include its queued kernels
        it_s = steps / (time.perf_counter() - start)
        accuracy = evaluate(engine, test_dataloader, device)
        peak = memory.peak()
        stats = EpochStats(
            epoch=epoch,
            train_loss=float(loss_sum) / max(1, steps),
            test_accuracy=accuracy,
            lr=lr_scheduler.get_last_lr()[0],
            loss_scale=engine.loss_scale,
            skipped_steps=engine.skipped_steps,
            it_s=it_s,
            samples_s=it_s * cfg.BATCH_SIZE * gpc.world_size,
            peak_bytes=peak,
            peak_delta_bytes=peak - memory.baseline,
        )
        history.append(stats)
        if gpc.rank == 0:
            logger.info(
                "Epoch %d - train loss: %.5g, test accuracy: %.4f, lr: %.5g, loss scale: %g, "
                "skipped steps: %d, it/s: %.1f, samples/s: %.0f, peak memory: %.0f MiB "
                "(+%.1f MiB over the pre-model baseline)",
                stats.epoch,
                stats.train_loss,
                stats.test_accuracy,
                stats.lr,
                stats.loss_scale,
                stats.skipped_steps,
                stats.it_s,
                stats.samples_s,
                stats.peak_bytes / MIB,
                stats.peak_delta_bytes / MIB,
            )
    if gpc.rank == 0 and history:
        for line in summary_table(run_label(cfg, engine.policy.name), history, device):
            logger.info("%s", line)
    return history


def run_label(cfg: mixprec.Config, policy_name: str) -> str:
    """The seed table's row name: 'FP32 training' or the fp16 mode, e.g. 'AMP_TYPE.APEX (O1)'."""
    fp16 = cfg.get("fp16")
    if fp16 is None:
        return "FP32 training"
    mode = fp16["mode"]
    name = f"AMP_TYPE.{mode.name}" if isinstance(mode, AMP_TYPE) else repr(mode)
    return f"{name} ({policy_name})"


def summary_table(label: str, history: Sequence[EpochStats], device: torch.device) -> list[str]:
    """The seed's table for this run (memory, it/s, throughput) plus the final test accuracy.

    it/s and samples/s are medians over epochs, so epoch 0's one-off start-up costs and a
    busy machine's slow epochs weigh less.
    """
    it_s = statistics.median(s.it_s for s in history)
    samples_s = statistics.median(s.samples_s for s in history)
    last = history[-1]
    memory = "CUDA allocator peak" if device.type == "cuda" else "peak RSS"
    return [
        f"| | {memory} / MiB (over baseline) | Iteration/s | throughput (samples/s) "
        "| test accuracy |",
        "| --- | --- | --- | --- | --- |",
        f"| {label} | {last.peak_bytes / MIB:.0f} (+{last.peak_delta_bytes / MIB:.1f}) "
        f"| {it_s:.1f} | {samples_s:.0f} | {last.test_accuracy:.4f} |",
    ]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    main()
