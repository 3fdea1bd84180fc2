"""Seed 000's ResNet34 AMP training with mixprec in place of colossalai, on scikit-learn's digits.

One process (no launcher: the script starts a world of one itself):
    python examples/colossal_resnet/train.py --mode torch
Two processes (gloo on CPU, nccl on GPUs; initialize shards the data):
    mixprec run --nproc_per_node 2 examples/colossal_resnet/train.py --mode bf16

`--mode` picks CONFIG's fp16 section (torch, naive, apex, bf16, fp32); the loop below is the
seed's and the same for all of them. The 8x8 digits (shipped with scikit-learn, no download)
are upsampled to 16x16 and repeated to 3 channels, standing in for CIFAR-10.

Run time on the reference CPU (2-core AMD EPYC, OMP_NUM_THREADS=1), defaults: 10.5 min for the
2 fp16 epochs (a tqdm bar per epoch, a log line after each), measured while the shared
machine's load average fell from 8 to 3 (idle is faster); --full, seed 000's 200 epochs of
batch 128, takes hours.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

import mixprec
from mixprec import AMP_TYPE
from mixprec.bench.models import BasicBlock
from mixprec.config import gpc
from mixprec.core.policy import did_you_mean
from mixprec.launch import destroy

logger = logging.getLogger("colossal_resnet")

FP16_SECTIONS: dict[str, dict[str, Any] | None] = {
    # seed 000's torch amp section: GradScaler's defaults, spelled out
    "torch": dict(
        mode=AMP_TYPE.TORCH,
        init_scale=2.0**16,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2000,
        enabled=True,
    ),
    # seed 000's naive amp section: Megatron's scaler starts at 2**32 and backs off on overflow
    "naive": dict(
        mode=AMP_TYPE.NAIVE,
        log_num_zeros_in_grad=False,
        initial_scale=2**32,
        min_scale=1,
        growth_factor=2,
        backoff_factor=0.5,
        growth_interval=1000,
        hysteresis=2,
    ),
    # seed 000's apex amp section (opt_level O1: fp32 weights, fp16 autocast, dynamic scale)
    "apex": dict(mode=AMP_TYPE.APEX, enabled=True, opt_level="O1", max_loss_scale=2.0**24),
    "bf16": dict(mode="bf16"),  # bf16 autocast: fp32's exponent range, so no loss scale
    "fp32": None,  # no fp16 section: every op in fp32
}
"""--mode -> CONFIG['fp16'] (None: the key is left out)."""
MODE_CHOICES: tuple[str, ...] = tuple(FP16_SECTIONS)

STAGE_BLOCKS: tuple[int, ...] = (3, 4, 6, 3)
"""Basic blocks per stage: ResNet34's layout."""
IMAGE_SIZE = 16
"""Side the 8x8 digits are upsampled to (ResNet's 3 stride-2 stages leave 2x2)."""
NUM_CLASSES = 10
TEST_FRACTION = 0.2
"""Share of the 1797 digits held out for the test accuracy (359 images)."""
SPLIT_SEED = 0
"""Seed of the train/test split: the same on every rank, so shards partition one split."""


class ResNet34Style(nn.Module):
    """ResNet34's layout (3, 4, 6, 3 basic blocks) at any width, with a 3x3 stem for small images.

    Each block's last BatchNorm starts at weight 0 (torchvision's zero_init_residual=True), so
    every block starts as the identity: without it, 16 blocks deep, the first few dozen steps
    leave eval-mode accuracy near chance (running BatchNorm statistics lag the moving weights).
    """

    def __init__(
        self, *, width: int, num_classes: int, stage_blocks: Sequence[int] = STAGE_BLOCKS
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        c_in = width
        for stage, count in enumerate(stage_blocks):
            c_out = width * 2**stage
            for i in range(count):
                # the first block of every stage after the first halves the image
                blocks.append(BasicBlock(c_in, c_out, stride=2 if stage and i == 0 else 1))
                c_in = c_out
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(c_in, num_classes)
        for block in blocks:
            nn.init.zeros_(block.bn2.weight)  # residual branch off: the block is x -> relu(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def make_config(mode: str, batch_size: int, num_epochs: int) -> dict[str, Any]:
    """Seed 000's CONFIG: BATCH_SIZE, NUM_EPOCHS and the fp16 section --mode names."""
    if mode not in FP16_SECTIONS:
        raise ValueError(f"Unknown --mode {mode!r}." + did_you_mean(mode, MODE_CHOICES))
    config: dict[str, Any] = dict(BATCH_SIZE=batch_size, NUM_EPOCHS=num_epochs)
    if FP16_SECTIONS[mode] is not None:
        config["fp16"] = dict(FP16_SECTIONS[mode])
    return config


def digits_to_images(images: torch.Tensor) -> torch.Tensor:
    """(N, 8, 8) pixel values 0..16 -> (N, 3, 16, 16) in [0, 1], zero mean and unit std."""
    x = F.interpolate(images.unsqueeze(1) / 16.0, size=IMAGE_SIZE, mode="bilinear")
    x = (x - x.mean()) / x.std()  # one global statistic, as Normalize does with fixed numbers
    return x.expand(-1, 3, -1, -1).contiguous()  # grey -> the 3 channels an RGB stem expects


def build_datasets() -> tuple[TensorDataset, TensorDataset]:
    """Digits as 16x16 RGB-shaped tensors, split train/test the same way on every rank."""
    digits = load_digits()
    x = digits_to_images(torch.tensor(digits.images, dtype=torch.float32))
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(len(y) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def evaluate(engine: mixprec.Engine, loader: DataLoader) -> float:
    """Test accuracy over every rank's shard (counts summed across ranks)."""
    engine.eval()
    device = next(engine.model.parameters()).device
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # correct, seen
    with torch.no_grad():
        for img, label in loader:
            img, label = img.to(device), label.to(device)
            counts[0] += (engine(img).argmax(dim=-1) == label).sum()
            counts[1] += label.numel()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    return float(counts[0] / counts[1])


DEFAULT_EPOCHS, DEFAULT_BATCH = 2, 64
"""What runs without flags: a few minutes on a CPU."""
FULL_EPOCHS, FULL_BATCH = 200, 128
"""Seed 000's CONFIG (NUM_EPOCHS, BATCH_SIZE), behind --full."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="torch", choices=MODE_CHOICES, help="fp16 section")
    parser.add_argument("--epochs", type=int, default=None, help="CONFIG's NUM_EPOCHS (2)")
    parser.add_argument("--batch-size", type=int, default=None, help="CONFIG's BATCH_SIZE (64)")
    parser.add_argument(
        "--full",
        action="store_true",
        help=f"seed 000's settings: {FULL_EPOCHS} epochs of batch {FULL_BATCH} (hours on a CPU)",
    )
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (seed: 0.1)")
    parser.add_argument("--width", type=int, default=16, help="channels of the first stage")
    parser.add_argument(
        "--max-steps", type=int, default=None, help="stop each epoch after this many steps"
    )
    args = parser.parse_args(argv)
    if args.full and (args.epochs is not None or args.batch_size is not None):
        parser.error("--full sets --epochs and --batch-size to the seed's; pass one or the other")
    defaults = (FULL_EPOCHS, FULL_BATCH) if args.full else (DEFAULT_EPOCHS, DEFAULT_BATCH)
    args.epochs = args.epochs or defaults[0]
    args.batch_size = args.batch_size or defaults[1]
    for key in ("epochs", "batch_size", "width", "max_steps"):
        value = getattr(args, key)
        if value is not None and value < 1:
            parser.error(f"--{key.replace('_', '-')}={value} must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> float:
    """Train as seed 000 does; log each epoch on rank 0; return the last test accuracy."""
    args = parse_args(argv)
    CONFIG = make_config(args.mode, args.batch_size, args.epochs)  # noqa: N806 - the seed's name

    # launch distributed setting: torchrun / `mixprec run` export RANK, else a world of one
    if "RANK" in os.environ:
        mixprec.launch_from_torch(config=CONFIG)
    else:
        mixprec.launch(CONFIG, rank=0, world_size=1, host="127.0.0.1", port=free_port())
    try:
        return train(args)
    finally:
        # DDP's reducer owns a reference to the gloo group: free it before the group goes
        gc.collect()
        destroy()


def train(args: argparse.Namespace) -> float:
    # build your model, optimizer, criterion, dataloaders
    model = ResNet34Style(width=args.width, num_classes=NUM_CLASSES)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=gpc.config.NUM_EPOCHS
    )
    train_dataset, test_dataset = build_datasets()
    train_dataloader = DataLoader(train_dataset, batch_size=gpc.config.BATCH_SIZE, shuffle=True)
    test_dataloader = DataLoader(test_dataset, batch_size=256, shuffle=False)

    # gpc.config's fp16 section converts model, optimizer and criterion to mixed precision
    engine, train_dataloader, test_dataloader, _ = mixprec.initialize(
        model, optimizer, criterion, train_dataloader, test_dataloader
    )
    device = next(engine.model.parameters()).device
    if gpc.rank == 0:
        logger.info("%r world_size=%d", engine, gpc.world_size)

    accuracy = 0.0
    for epoch in range(gpc.config.NUM_EPOCHS):
        engine.train()
        # an fp16 epoch takes minutes on a CPU without fp16 kernels: a bar on rank 0 shows it move
        batches = tqdm(train_dataloader, desc=f"epoch {epoch}", leave=False, disable=gpc.rank != 0)
        for step, (img, label) in enumerate(batches):
            if args.max_steps is not None and step >= args.max_steps:
                break
            img, label = img.to(device), label.to(device)
            engine.zero_grad()
            output = engine(img)
            train_loss = engine.criterion(output, label)
            engine.backward(train_loss)
            engine.step()
        # the seed steps its schedule once per epoch, outside the engine
        lr_scheduler.step()
        accuracy = evaluate(engine, test_dataloader)
        if gpc.rank == 0:
            logger.info(
                "Epoch %d - train loss: %.5g, test accuracy: %.4f, lr: %.5g, loss scale: %g, "
                "skipped steps: %d",
                epoch,
                train_loss.item(),
                accuracy,
                lr_scheduler.get_last_lr()[0],
                engine.loss_scale,
                engine.skipped_steps,
            )
    return accuracy


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    main()
