"""Shared fixtures: deterministic seeds, a tiny model factory, a host-sync counter."""

from __future__ import annotations

import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub from a test


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_paddle_amp_state():
    """Each test starts with no Paddle auto_cast entered: as in Paddle, the last one's dtype is
    process-wide and a bfloat16 one switches later dynamic GradScalers off."""
    yield
    dygraph = sys.modules.get("mixprec.paddle.dygraph")
    if dygraph is not None:
        dygraph.amp_global_state().amp_dtype = None


def tiny_mlp(width: int = 8, norm: bool = True) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Linear(width, 2 * width)]
    if norm:
        layers.append(torch.nn.LayerNorm(2 * width))
    layers += [torch.nn.ReLU(), torch.nn.Linear(2 * width, 4)]
    return torch.nn.Sequential(*layers)


class CountHostSyncs:
    """Counts Tensor.item / __bool__ / tolist / __float__ / __int__ calls while active."""

    NAMES = ("item", "__bool__", "tolist", "__float__", "__int__")

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, _name=name, **k):
                self.calls.append(_name)
                return _original(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)
