"""Seed 003's Booster AMP practice with mixprec in place of colossalai: a small ViT on digits.

One process (no launcher: the script starts a world of one itself):
    python examples/booster/train.py --mixed-precision fp16
Two processes (gloo on CPU, nccl on GPUs; the plugin's dataloader shards the data):
    mixprec run --nproc_per_node 2 examples/booster/train.py --mixed-precision bf16

`--mixed-precision` is the Booster's mode name; `--custom` passes a MixedPrecision object
instead (for fp16: FP16TorchMixedPrecision with the seed's scaler arguments). The 8x8 digits
(shipped with scikit-learn, no download) are upsampled to 16x16 and repeated to 3 channels,
standing in for Caltech101. The model and optimizer are saved under --out at the end.

Run time on the reference CPU (2-core AMD EPYC, OMP_NUM_THREADS=1), defaults: 5.1 min for the
10 epochs (one log line per epoch), measured while the shared machine ran at load average
~16-21 (idle is several times faster).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mixprec
from mixprec.bench.command import fresh_out_dir
from mixprec.bench.models import ViT
from mixprec.booster import Booster, TorchDDPPlugin
from mixprec.launch import destroy
from mixprec.mixed_precision import (
    BF16MixedPrecision,
    FP8MixedPrecision,
    FP16ApexMixedPrecision,
    FP16NaiveMixedPrecision,
    FP16TorchMixedPrecision,
    MixedPrecision,
)
from mixprec.nn.lr_scheduler import LinearWarmupLR

logger = logging.getLogger("booster_example")

CUSTOM_PRECISIONS: dict[str, Callable[[], MixedPrecision]] = {
    # seed 003's customised torch amp: GradScaler's defaults, spelled out
    "fp16": lambda: FP16TorchMixedPrecision(
        init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000
    ),
    "fp16_apex": lambda: FP16ApexMixedPrecision(opt_level="O1", max_loss_scale=2.0**24),
    "fp16_naive": lambda: FP16NaiveMixedPrecision(),
    "bf16": lambda: BF16MixedPrecision(),
    "fp8": lambda: FP8MixedPrecision(),
}
"""--mixed-precision -> the MixedPrecision object --custom passes instead of the name."""
PRECISION_CHOICES: tuple[str, ...] = tuple(CUSTOM_PRECISIONS)

IMAGE_SIZE = 16
"""Side the 8x8 digits are upsampled to."""
NUM_CLASSES = 10
TEST_FRACTION = 0.2
"""Share of the 1797 digits held out for the test accuracy (359 images)."""
SPLIT_SEED = 0
"""Seed of the train/test split: the same on every rank, so shards partition one split."""
WARMUP_EPOCHS = 1
"""Epochs of linear warmup before the linear decay (seed: LinearWarmupLR)."""


def build_model() -> nn.Module:
    """ViT-B/16's shape, shrunk: 4 patches of 8x8 (each a 4x4 patch of the original digit; finer
    patches learn several times slower), dim 64, 2 blocks. The widths are multiples of 16, so
    fp8 converts the attention and MLP Linears."""
    return ViT(
        image_size=IMAGE_SIZE,
        patch_size=8,
        in_chans=3,
        num_classes=NUM_CLASSES,
        dim=64,
        depth=2,
        heads=4,
        mlp_ratio=2,
    )


def digits_to_images(images: torch.Tensor) -> torch.Tensor:
    """(N, 8, 8) pixel values 0..16 -> (N, 3, 16, 16), normalised to mean 0.5, std 0.5 as the
    seed's transforms.Normalize([0.5] * 3, [0.5] * 3) does."""
    x = F.interpolate(images.unsqueeze(1) / 16.0, size=IMAGE_SIZE, mode="bilinear")
    x = (x - 0.5) / 0.5
    return x.expand(-1, 3, -1, -1).contiguous()  # grey -> the 3 channels the ViT embeds


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


def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> float:
    """Test accuracy over every rank's shard (counts summed across ranks)."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # correct, seen
    with torch.no_grad():
        for img, label in loader:
            img, label = img.to(device), label.to(device)
            counts[0] += (model(img).argmax(dim=-1) == label).sum()
            counts[1] += label.numel()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    model.train()
    return float(counts[0] / counts[1])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = mixprec.get_default_parser()  # the seed's colossalai.get_default_parser()
    parser.description = __doc__.splitlines()[0]
    parser.add_argument(
        "--mixed-precision", default="fp16", choices=PRECISION_CHOICES, help="Booster mode"
    )
    parser.add_argument(
        "--custom", action="store_true", help="pass a MixedPrecision object, not the mode name"
    )
    parser.add_argument("--epochs", type=int, default=10, help="NUM_EPOCHS")
    parser.add_argument("--batch-size", type=int, default=32, help="BATCH_SIZE per process")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument(
        "--max-steps", type=int, default=None, help="stop each epoch after this many steps"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="checkpoint directory (default: a new runs/booster-<UTC time>/)",
    )
    args = parser.parse_args(argv)
    for key in ("epochs", "batch_size", "max_steps"):
        value = getattr(args, key)
        if value is not None and value < 1:
            parser.error(f"--{key.replace('_', '-')}={value} must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> float:
    """Train as seed 003 does; log each epoch on rank 0; save; return the last test accuracy."""
    args = parse_args(argv)
    # launch from torch: torchrun / `mixprec run` export RANK, else a world of one
    if "RANK" in os.environ:
        mixprec.launch_from_torch(config={}, backend=args.backend)
    else:
        mixprec.launch(
            {}, rank=0, world_size=1, host="127.0.0.1", port=free_port(), backend=args.backend
        )
    try:
        return train(args)
    finally:
        # DDP's reducer owns a reference to the gloo group: free it before the group goes
        gc.collect()
        destroy()


def train(args: argparse.Namespace) -> float:
    rank = dist.get_rank()

    # build model, dataset, optimizer, loss and lr scheduler
    model = build_model()
    train_dataset, test_dataset = build_datasets()
    # AdamW, not the seed's SGD(lr=1e-2): SGD needs many epochs to move this small ViT
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    criterion = nn.CrossEntropyLoss()
    lr_scheduler = LinearWarmupLR(optimizer, warmup_steps=WARMUP_EPOCHS, total_steps=args.epochs)

    # inject AMP: the plugin shards the data, the booster applies the precision
    plugin = TorchDDPPlugin()
    train_dataloader = plugin.prepare_dataloader(
        train_dataset, batch_size=args.batch_size, shuffle=True, drop_last=True
    )
    test_dataloader = plugin.prepare_dataloader(test_dataset, batch_size=256)
    if args.custom:
        mixed_precision: str | MixedPrecision = CUSTOM_PRECISIONS[args.mixed_precision]()
    else:
        mixed_precision = args.mixed_precision
    booster = Booster(mixed_precision=mixed_precision, plugin=plugin)
    model, optimizer, criterion, train_dataloader, lr_scheduler = booster.boost(
        model, optimizer, criterion, train_dataloader, lr_scheduler
    )
    if rank == 0:
        logger.info(
            "Booster(mixed_precision=%r, plugin=TorchDDPPlugin) world_size=%d",
            booster.mixed_precision,
            dist.get_world_size(),
        )

    accuracy = 0.0
    for epoch in range(args.epochs):
        if isinstance(train_dataloader.sampler, DistributedSampler):
            train_dataloader.sampler.set_epoch(epoch)  # a new shuffle every epoch
        for step, (img, label) in enumerate(train_dataloader):
            if args.max_steps is not None and step >= args.max_steps:
                break
            img, label = img.to(booster.device), label.to(booster.device)
            output = model(img)
            loss = criterion(output, label)
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
        lr_scheduler.step()
        accuracy = evaluate(model, test_dataloader, booster.device)
        if rank == 0:
            logger.info(
                "Epoch %d - train loss: %.5g, test accuracy: %.4f, lr: %.5g, loss scale: %g, "
                "skipped steps: %d",
                epoch,
                loss.item(),
                accuracy,
                lr_scheduler.get_last_lr()[0],
                optimizer.loss_scale,
                optimizer.skipped_steps,
            )

    # fp32 weights (the masters where the mode keeps them) and the optimizer with its scaler,
    # in a fresh directory by default: rank 0 names it, every rank writes there
    if args.out is None:
        name = [fresh_out_dir("booster") if rank == 0 else None]
        dist.broadcast_object_list(name, src=0)
        args.out = name[0]
    booster.save_model(model, args.out / "model.pt")
    booster.save_optimizer(optimizer, args.out / "optimizer.pt")
    if rank == 0:
        logger.info("Saved %s and %s", args.out / "model.pt", args.out / "optimizer.pt")
    return accuracy


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    main()
