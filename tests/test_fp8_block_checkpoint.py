"""DeepSeek-V3's block-fp8 checkpoint layout: weight (e4m3) + weight_scale_inv (fp32 per
128x128 block, padded edges), written and read back bit for bit."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from mixprec.fp8 import (
    Float8Config,
    block_fp8_state_dict,
    convert_to_fp8,
    dequantize_weight_block_fp8,
    load_block_fp8_state_dict,
    quantize_blockwise,
    quantize_weight_block_fp8,
)

E4M3 = torch.float8_e4m3fn


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(208, 304), nn.GELU(), nn.Linear(304, 160), nn.LayerNorm(160))
    return convert_to_fp8(net, config=Float8Config(recipe="blockwise"))


def weight_dequant_reference(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """DeepSeek's weight_dequant written per block: fp32 product of each block and its scale."""
    out = torch.empty(w.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
            out[rows, cols] = w[rows, cols].to(torch.float32) * s[i, j]
    return out


def test_layout_keys_dtypes_and_padded_scale_grid():
    state = block_fp8_state_dict(model(0))
    assert state["0.weight"].dtype == E4M3 and state["0.weight"].shape == (304, 208)
    assert state["0.weight_scale_inv"].dtype == torch.float32
    assert state["0.weight_scale_inv"].shape == (3, 2)  # ceil(304/128) x ceil(208/128)
    assert state["2.weight_scale_inv"].shape == (2, 3)
    assert state["0.bias"].dtype == torch.float32 and "3.weight_scale_inv" not in state


def test_save_load_save_round_trips_bit_for_bit_through_serialization():
    source = model(0)
    saved = block_fp8_state_dict(source)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    fresh = model(1)
    load_block_fp8_state_dict(fresh, loaded)
    again = block_fp8_state_dict(fresh)
    assert list(again) == list(saved)
    for key, value in saved.items():
        assert torch.equal(again[key].view(torch.uint8), value.view(torch.uint8)), key
    # the masters hold exactly the dequantized checkpoint
    assert torch.equal(
        fresh[0].weight, dequantize_weight_block_fp8(saved["0.weight"], saved["0.weight_scale_inv"])
    )


def test_a_deepseek_style_checkpoint_dequantizes_as_weight_dequant():
    """DeepSeek's scales are amax / 448 in fp32 (not powers of two), data = x / scale."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(304, 208, generator=gen)
    amax = torch.nn.functional.pad(w.abs(), (0, 48, 0, 80)).reshape(3, 128, 2, 128).amax((1, 3))
    s = amax / 448.0
    data = (w / s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:304, :208]).to(E4M3)
    target = model(3)
    state = target.state_dict()
    state["0.weight"], state["0.weight_scale_inv"] = data, s
    load_block_fp8_state_dict(target, state)
    assert torch.equal(target[0].weight, weight_dequant_reference(data, s))
    bf16 = dequantize_weight_block_fp8(data, s, torch.bfloat16)
    assert torch.equal(bf16, weight_dequant_reference(data, s).to(torch.bfloat16))


def test_canonical_form_is_a_fixed_point_where_one_pass_is_not():
    """A block whose maximum rounds down to 224: one quantize pass requantizes with a doubled
    scale (equal values, other bits); the checkpoint writer's form is a fixed point."""
    w = torch.full((128, 128), 0.01)
    w[0, 0] = 230.0 / 256.0  # scale 256 (pow2 below 448/0.898); 230 rounds to e4m3's 224
    data, scale_inv = quantize_blockwise(w, block=(128, 128))
    assert data.to(torch.float32).abs().max().item() == 224.0
    redo = quantize_blockwise(data.to(torch.float32) * scale_inv, block=(128, 128))
    assert redo[1].item() == scale_inv.item() / 2  # one pass: not a fixed point
    canon = quantize_weight_block_fp8(w)
    again = quantize_weight_block_fp8(dequantize_weight_block_fp8(*canon))
    assert torch.equal(again[0].view(torch.uint8), canon[0].view(torch.uint8))
    assert torch.equal(again[1], canon[1])


def test_bad_layouts_are_refused_naming_the_shapes():
    with pytest.raises(ValueError, match=r"needs scale_inv \(3, 2\), got torch.float32 \(2, 2\)"):
        dequantize_weight_block_fp8(torch.zeros(300, 200, dtype=E4M3), torch.ones(2, 2))
    with pytest.raises(KeyError, match="'nope.weight'"):
        block_fp8_state_dict(model(0), ["nope.weight"])
