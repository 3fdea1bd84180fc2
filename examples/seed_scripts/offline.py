"""Offline stand-ins for what the seed scripts import from torchvision, timm and titans.

The seeds train on CIFAR10 / Caltech101 (downloaded) with torchvision's resnet34 and timm's
ViT-B/16. Here the datasets are scikit-learn's 8x8 digits (shipped, no download), upsampled
to 32x32 RGB-shaped uint8 images, and the models are the same layouts at a small width, so
the seeds' lines that build data and models run unchanged. Sizes come from the environment:
OFFLINE_SAMPLES (images per dataset, default all 1797), OFFLINE_WIDTH (model width, 8).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import Dataset

from mixprec.bench.models import ViT


def _colossal_resnet_example() -> ModuleType:
    """examples/colossal_resnet/train.py, for its ResNet34 layout (loaded under its own name)."""
    path = Path(__file__).resolve().parents[1] / "colossal_resnet" / "train.py"
    spec = importlib.util.spec_from_file_location("colossal_resnet_train", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


IMAGE_SIZE = 32
"""CIFAR10's side; the digits are upsampled to it."""


def _size(name: str, default: int) -> int:
    value = int(os.environ.get(name, default))
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1.")
    return value


class _Digits(Dataset):
    """(image, label): a uint8 HxWx3 array-like tensor and an int, through `transform`."""

    def __init__(self, root: Any = None, download: bool = False, transform: Callable = None):
        digits = load_digits()
        n = _size("OFFLINE_SAMPLES", len(digits.target))
        x = torch.tensor(digits.images[:n], dtype=torch.float32).unsqueeze(1) / 16.0
        x = F.interpolate(x, size=IMAGE_SIZE, mode="bilinear").clamp(0, 1)
        self.images = (x * 255).round().to(torch.uint8).expand(-1, 3, -1, -1).permute(0, 2, 3, 1)
        self.labels = [int(t) for t in digits.target[:n]]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        image = self.images[index]
        return (image if self.transform is None else self.transform(image)), self.labels[index]


CIFAR10 = _Digits


class datasets:  # noqa: N801 - torchvision's module name
    Caltech101 = _Digits
    CIFAR10 = _Digits


class transforms:  # noqa: N801 - torchvision's module name
    """The few torchvision transforms the seeds use, over uint8 HxWxC / float CxHxW tensors."""

    class Compose:
        def __init__(self, steps: Sequence[Callable]) -> None:
            self.steps = list(steps)

        def __call__(self, x: Any) -> Any:
            for step in self.steps:
                x = step(x)
            return x

    class ToTensor:
        def __call__(self, image: torch.Tensor) -> torch.Tensor:
            return image.permute(2, 0, 1).float() / 255.0  # HxWxC uint8 -> CxHxW in [0, 1]

    class Normalize:
        def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
            self.mean = torch.tensor(mean).view(-1, 1, 1)
            self.std = torch.tensor(std).view(-1, 1, 1)

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return (x - self.mean) / self.std

    class RandomCrop:
        def __init__(self, size: int, padding: int = 0) -> None:
            self.size, self.padding = size, padding

        def __call__(self, image: torch.Tensor) -> torch.Tensor:
            chw = image.permute(2, 0, 1)
            chw = F.pad(chw, [self.padding] * 4)
            top = random.randint(0, chw.shape[1] - self.size)
            left = random.randint(0, chw.shape[2] - self.size)
            return chw[:, top : top + self.size, left : left + self.size].permute(1, 2, 0)

    class RandomHorizontalFlip:
        def __call__(self, image: torch.Tensor) -> torch.Tensor:
            return image.flip(1) if random.random() < 0.5 else image


def resnet34(num_classes: int = 1000) -> nn.Module:
    """torchvision's resnet34 layout (3, 4, 6, 3 basic blocks) at OFFLINE_WIDTH channels."""
    resnet_style = _colossal_resnet_example().ResNet34Style
    return resnet_style(width=_size("OFFLINE_WIDTH", 8), num_classes=num_classes)


def vit_base_patch16_224(drop_rate: float = 0.0) -> nn.Module:
    """timm's ViT-B/16 shape, shrunk to 32x32 images: 4 patches of 16, 2 blocks; drop_rate is
    a dropout on the input pixels here (timm drops inside the blocks)."""
    vit = ViT(
        image_size=IMAGE_SIZE,
        patch_size=16,
        in_chans=3,
        num_classes=10,
        dim=4 * _size("OFFLINE_WIDTH", 8),
        depth=2,
        heads=4,
        mlp_ratio=2,
    )
    return nn.Sequential(nn.Dropout(drop_rate), vit) if drop_rate else vit


@contextlib.contextmanager
def barrier_context() -> Iterator[None]:
    """titans' barrier_context: rank 0 prepares the data first, the others wait for it."""
    dist = torch.distributed
    ranked = dist.is_available() and dist.is_initialized()
    if ranked and dist.get_rank() != 0:
        dist.barrier()
    yield
    if ranked and dist.get_rank() == 0:
        dist.barrier()
