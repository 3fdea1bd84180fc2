"""The benchmark's models, from torch layers only: seed 002's MLP, a ViT and a ResNet-shaped CNN.

Each preset is a ModelSpec (sizes) plus a builder and a synthetic batch maker, so the runner,
the worker and the tests build exactly the same thing from a few integers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from mixprec.core.policy import did_you_mean

ModelName = Literal["mlp", "vit", "resnet"]
MODEL_NAMES: tuple[str, ...] = get_args(ModelName)


class MLP(nn.Sequential):
    """Seed 002's SimpleNet: `depth` Linear(width, width) layers in a row, no activations."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__(*[nn.Linear(width, width) for _ in range(depth)])


class Attention(nn.Module):
    """Multi-head self-attention with nn.Linear projections (so fp8 can convert them)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} must be divisible by heads={heads}.")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim)
        )

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """ViT-B/16's shape at any size: conv patch embedding, cls token, pre-norm blocks, head."""

    def __init__(
        self,
        *,
        image_size: int,
        patch_size: int,
        in_chans: int,
        num_classes: int,
        dim: int,
        depth: int,
        heads: int,
        mlp_ratio: int = 4,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size={image_size} must be a multiple of patch={patch_size}.")
        self.patch_embed = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)
        num_patches = (image_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, patches, dim)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv+BN, identity (or 1x1 conv+BN) shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet-18's shape at any size: 3x3 stem, 4 stages of basic blocks (x2 channels, /2 size)."""

    def __init__(self, *, in_chans: int, num_classes: int, width: int, blocks: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_chans, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        layers: list[nn.Module] = []
        c_in = width
        for stage in range(4):
            c_out = width * 2**stage
            for i in range(blocks):
                layers.append(BasicBlock(c_in, c_out, stride=2 if stage and i == 0 else 1))
                c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(c_in, num_classes)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A benchmark model and its synthetic data, as plain numbers (travels to the worker as JSON)."""

    name: ModelName
    """'mlp' (seed 002's 9xLinear), 'vit' (ViT-B/16-shaped) or 'resnet' (ResNet-18-shaped)."""
    width: int
    """mlp: features per layer; vit: embedding dim; resnet: channels of the first stage."""
    depth: int
    """mlp: Linear layers; vit: transformer blocks; resnet: basic blocks per stage."""
    batch: int
    """Samples per step."""
    image_size: int = 32
    """vit/resnet: side of the square synthetic images."""
    patch_size: int = 4
    """vit: side of a patch (16 in ViT-B/16; 4 suits 32x32 images)."""
    heads: int = 4
    """vit: attention heads."""
    num_classes: int = 10
    """vit/resnet: classes of the synthetic labels."""
    lr: float = 0.01
    """SGD learning rate."""

    def __post_init__(self) -> None:
        if self.name not in MODEL_NAMES:
            raise ValueError(f"Unknown model {self.name!r}." + did_you_mean(self.name, MODEL_NAMES))
        for key in ("width", "depth", "batch", "image_size", "patch_size", "heads", "num_classes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.{key}={value!r} must be an int >= 1.")
        if self.name == "vit" and self.width % self.heads:
            raise ValueError(f"vit: width={self.width} must be divisible by heads={self.heads}.")
        if self.name == "vit" and self.image_size % self.patch_size:
            raise ValueError(
                f"vit: image_size={self.image_size} must be a multiple of "
                f"patch_size={self.patch_size}."
            )


PRESETS: dict[str, ModelSpec] = {
    # seed 002 runs width 4096, batch 1024 (~0.9 TFLOP a step); 512/256 keeps the default run
    # of every mode on a 2-core CPU under 2 minutes, GEMMs still big enough for bf16 to pay off.
    "mlp": ModelSpec(name="mlp", width=512, depth=9, batch=256, lr=1e-4),
    "vit": ModelSpec(name="vit", width=192, depth=4, batch=64, heads=3, lr=0.01),
    "resnet": ModelSpec(name="resnet", width=32, depth=2, batch=64, lr=0.01),
}
"""Default sizes per model; --width/--depth/--batch override them."""


def build_model(spec: ModelSpec) -> nn.Module:
    """A freshly initialised fp32 model for spec (seed torch's RNG first for equal inits)."""
    if spec.name == "mlp":
        return MLP(spec.width, spec.depth)
    if spec.name == "vit":
        return ViT(
            image_size=spec.image_size,
            patch_size=spec.patch_size,
            in_chans=3,
            num_classes=spec.num_classes,
            dim=spec.width,
            depth=spec.depth,
            heads=spec.heads,
        )
    return ResNet(in_chans=3, num_classes=spec.num_classes, width=spec.width, blocks=spec.depth)


def make_batch(
    spec: ModelSpec, *, seed: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """One synthetic (input, target) batch, the same for every mode given the same seed."""
    # made on the CPU (one stream of numbers for every device, whatever the default device is)
    gen, cpu = torch.Generator().manual_seed(seed), "cpu"
    if spec.name == "mlp":  # seed 002: uniform inputs and targets, MSE
        x = torch.rand(spec.batch, spec.width, generator=gen, device=cpu)
        y = torch.rand(spec.batch, spec.width, generator=gen, device=cpu)
    else:
        x = torch.randn(spec.batch, 3, spec.image_size, spec.image_size, generator=gen, device=cpu)
        y = torch.randint(0, spec.num_classes, (spec.batch,), generator=gen, device=cpu)
    return x.to(device), y.to(device)


def make_criterion(spec: ModelSpec) -> Callable[..., torch.Tensor]:
    """MSE for the MLP (seed 002), cross-entropy for the classifiers."""
    return nn.MSELoss() if spec.name == "mlp" else nn.CrossEntropyLoss()


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
