"""Seed 002 3.1-3.2 in the model report: A100's 16-wide tiles, channels-last, first-layer channels."""

from __future__ import annotations

import torch
from torch import nn

from mixprec.core.policy import preset
from mixprec.debugging import model_report
from mixprec.debugging.conv_layout import conv_notes


def _cnn(c_in: int = 3) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(c_in, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 1), nn.Flatten()
    )


def test_first_layer_channels_and_nchw_weights_are_reported() -> None:
    model = _cnn(3)
    first, layout = conv_notes(model)
    assert first.name == "0" and "takes 3 input channels: pad the input" in first.finding
    assert "to 4" in first.finding
    assert layout.finding.startswith("1 conv layer(s) hold NCHW weights (0)")  # 1x1 is both
    report = model_report(model, preset("bf16"))
    assert "## Convolution layout" in report.table() and report.conv == (first, layout)


def test_channels_last_model_with_four_input_channels_is_clean() -> None:
    model = _cnn(4).to(memory_format=torch.channels_last)
    assert conv_notes(model) == []
    assert conv_notes(_cnn(8).to(memory_format=torch.channels_last)) == []
    (note,) = conv_notes(_cnn(5).to(memory_format=torch.channels_last))
    assert "pad the input with zero channels to 8" in note.finding


def test_fp32_reports_no_layout_section() -> None:
    assert "Convolution layout" not in model_report(_cnn(3), preset("fp32")).table()


def test_a100_and_newer_check_multiples_of_16() -> None:
    model = nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 32))
    assert model_report(model, preset("fp16"), gpu_capability=(7, 0)).misaligned == ()
    a100 = model_report(model, preset("fp16"), gpu_capability=(8, 0))
    assert a100.multiple == 16
    assert [(m.name, m.dim, m.value) for m in a100.misaligned] == [
        ("0", "in_features", 8),
        ("0", "out_features", 24),
        ("2", "in_features", 24),
    ]
    assert model_report(model, preset("fp8"), gpu_capability=(7, 0)).multiple == 16
