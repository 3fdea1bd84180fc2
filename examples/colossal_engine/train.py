"""Seed 001's AMP example with mixprec in place of colossalai, on scikit-learn's digits (offline).

One process:
    python examples/colossal_engine/train.py --config examples/colossal_engine/config/config_AMP_torch.py
Two processes (gloo on CPU, nccl on GPUs):
    mixprec run --nproc_per_node 2 examples/colossal_engine/train.py \
        --config examples/colossal_engine/config/config_AMP_naive.py

The config picks the precision (config_fp32, config_AMP_torch, config_AMP_naive,
config_AMP_apex); the loop below is the same for all of them.
"""

from __future__ import annotations

import gc
import math
import os
import socket

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec.engine
from mixprec.config import gpc
from mixprec.launch import destroy, get_default_parser, launch, launch_from_torch

TEST_FRACTION = 0.2
"""Share of the 1797 digits held out for the test accuracy."""
SPLIT_SEED = 0
"""Seed of the train/test split (the same on every rank, so shards partition one split)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_datasets() -> tuple[TensorDataset, TensorDataset]:
    """8x8 digit images flattened to 64 features in [0, 1], split train/test."""
    digits = load_digits()
    features = torch.tensor(digits.data, dtype=torch.float32) / 16.0  # pixel values are 0..16
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(len(labels) * TEST_FRACTION)
    test_idx, train_idx = order[:n_test], order[n_test:]
    return (
        TensorDataset(features[train_idx], labels[train_idx]),
        TensorDataset(features[test_idx], labels[test_idx]),
    )


def build_model(hidden: int, num_classes: int) -> nn.Module:
    """A small MLP; its BatchNorm stays fp32 in the modes that cast the model to fp16."""
    return nn.Sequential(
        nn.Linear(64, hidden),
        nn.BatchNorm1d(hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def warmup_cosine(warmup_steps: int, total_steps: int):
    """LR factor per optimizer step: linear warmup, then cosine decay to 0."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def evaluate(engine: mixprec.engine.Engine, loader: DataLoader, device: torch.device) -> float:
    """Accuracy over every rank's shard of the test set."""
    engine.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # correct, total
    with torch.no_grad():
        for img, label in loader:
            img, label = img.to(device), label.to(device)
            output = engine(img)
            counts[0] += (output.argmax(dim=-1) == label).sum()
            counts[1] += label.numel()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    return float(counts[0] / counts[1])


def main() -> None:
    parser = get_default_parser()
    parser.add_argument("--epochs", type=int, default=None, help="override the config's NUM_EPOCHS")
    args = parser.parse_args()

    # initialize distributed setting: torchrun / `mixprec run` set RANK, else one process
    if "RANK" in os.environ:
        launch_from_torch(config=args.config, backend=args.backend)
    else:
        launch(
            config=args.config,
            rank=0,
            world_size=1,
            host="127.0.0.1",
            port=free_port(),
            backend=args.backend,
        )
    try:
        train(num_epochs=args.epochs)
    finally:
        # A gloo group whose last owner is DDP's reducer is destroyed with the GIL held, which
        # can deadlock gloo's worker thread at exit: free every DDP (train's frame) first.
        gc.collect()
        destroy()


def train(num_epochs: int | None = None) -> None:
    """Build everything from gpc.config, train, print the test accuracy after each epoch."""
    cfg = gpc.config
    num_epochs = cfg.NUM_EPOCHS if num_epochs is None else num_epochs

    # build model, optimizer, criterion, dataloaders and the per-step schedule
    model = build_model(cfg.HIDDEN_SIZE, cfg.NUM_CLASSES)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.LEARNING_RATE, weight_decay=cfg.WEIGHT_DECAY
    )
    criterion = nn.CrossEntropyLoss()
    train_dataset, test_dataset = build_datasets()
    train_dataloader = DataLoader(train_dataset, batch_size=cfg.BATCH_SIZE, shuffle=True)
    test_dataloader = DataLoader(test_dataset, batch_size=cfg.BATCH_SIZE, shuffle=False)
    # every rank sees ceil(N / world) samples per epoch (DistributedSampler pads)
    shard = math.ceil(len(train_dataset) / gpc.world_size)
    steps_per_epoch = math.ceil(shard / cfg.BATCH_SIZE)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        warmup_cosine(cfg.WARMUP_EPOCHS * steps_per_epoch, num_epochs * steps_per_epoch),
    )

    # the config's fp16 / clip_grad_norm / gradient_accumulation are applied here; the engine
    # owns the schedule and advances it after every step that was not skipped on overflow
    engine, train_dataloader, test_dataloader, _ = mixprec.engine.initialize(
        model, optimizer, criterion, train_dataloader, test_dataloader, lr_scheduler
    )
    device = next(engine.model.parameters()).device
    if gpc.rank == 0:
        print(f"{engine!r} world_size={gpc.world_size}", flush=True)

    for epoch in range(num_epochs):
        engine.train()
        for img, label in train_dataloader:
            img, label = img.to(device), label.to(device)
            engine.zero_grad()
            output = engine(img)
            train_loss = engine.criterion(output, label)
            engine.backward(train_loss)
            engine.step()
        accuracy = evaluate(engine, test_dataloader, device)
        if gpc.rank == 0:
            print(
                f"Epoch {epoch} - train loss: {train_loss.item():.5}, "
                f"test accuracy: {accuracy:.4f}, lr: {lr_scheduler.get_last_lr()[0]:.5g}, "
                f"loss scale: {engine.loss_scale:g}, skipped steps: {engine.skipped_steps}",
                flush=True,
            )


if __name__ == "__main__":
    main()
