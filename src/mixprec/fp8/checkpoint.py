"""DeepSeek-V3's block-fp8 weight layout: `<name>.weight` in float8_e4m3fn and
`<name>.weight_scale_inv` in fp32, one scale per 128x128 block (edge blocks partial, the scale
grid ceil(rows/128) x ceil(cols/128)), weight ~= weight_fp8 * scale_inv of its block.

block_fp8_state_dict(model) writes a model's float8 Linear weights in that layout (everything
else as model.state_dict() has it); load_block_fp8_state_dict(model, state_dict) dequantizes
each weight that has a `_scale_inv` partner into the model's high-precision masters, as
DeepSeek's weight_dequant does (fp32 product, then the parameter's dtype), and loads the rest
as it is. A model trained with the blockwise recipe keeps fp32 masters: loading dequantizes,
training quantizes every step, saving quantizes again.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from mixprec.fp8.config import LP_FORWARD_DTYPE
from mixprec.fp8.linear import Float8Linear
from mixprec.fp8.quantize import BLOCKWISE_TILE, dequantize_blockwise, quantize_blockwise

SCALE_INV_SUFFIX = "_scale_inv"
"""DeepSeek-V3's key for a weight's block scales: '<weight key>_scale_inv'."""
CHECKPOINT_BLOCK = (BLOCKWISE_TILE, BLOCKWISE_TILE)


def quantize_weight_block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale_inv per 128x128 block) in the canonical form that reloading
    and saving again reproduces bit for bit.

    TE's blockwise quantizer with power-of-two scales, applied to its own dequantized output
    once more: when a block's maximum rounds down to 224 (half of e4m3's range) the first pass
    is not a fixed point (requantizing doubles that block's scale and its data: the same
    values, other bits); the second pass's maxima are exact, so it is.
    """
    data, scale_inv = quantize_blockwise(
        weight.detach(), LP_FORWARD_DTYPE, block=CHECKPOINT_BLOCK, power_of_two=True
    )
    dequantized = dequantize_blockwise(data, scale_inv, block=CHECKPOINT_BLOCK)
    return quantize_blockwise(
        dequantized, LP_FORWARD_DTYPE, block=CHECKPOINT_BLOCK, power_of_two=True
    )


def dequantize_weight_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """weight * scale_inv of its 128x128 block in fp32, then dtype (DeepSeek's weight_dequant)."""
    rows, cols = weight.shape
    grid = (-(-rows // BLOCKWISE_TILE), -(-cols // BLOCKWISE_TILE))
    if weight.dtype != LP_FORWARD_DTYPE or tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"a block-fp8 weight is float8_e4m3fn with a scale_inv of one entry per 128x128 "
            f"block: weight {weight.dtype} {tuple(weight.shape)} needs scale_inv {grid}, got "
            f"{scale_inv.dtype} {tuple(scale_inv.shape)}."
        )
    return dequantize_blockwise(
        weight, scale_inv.to(torch.float32), block=CHECKPOINT_BLOCK, dtype=dtype
    )


def _float8_weight_keys(model: nn.Module) -> list[str]:
    return [
        f"{fqn}.weight" if fqn else "weight"
        for fqn, module in model.named_modules()
        if isinstance(module, Float8Linear)
    ]


def block_fp8_state_dict(
    model: nn.Module, weight_keys: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """model.state_dict() with each of weight_keys (default: every Float8Linear's weight)
    replaced by its e4m3 data and a '<key>_scale_inv' fp32 block-scale tensor after it."""
    state = model.state_dict()
    keys = list(weight_keys) if weight_keys is not None else _float8_weight_keys(model)
    missing = [k for k in keys if k not in state or state[k].dim() != 2]
    if missing:
        raise KeyError(f"block_fp8_state_dict: no 2-D tensor in the state_dict for {missing}.")
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key in keys:
            out[key], out[key + SCALE_INV_SUFFIX] = quantize_weight_block_fp8(value)
        else:
            out[key] = value
    return out


def load_block_fp8_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True
) -> nn.modules.module._IncompatibleKeys:
    """Load a checkpoint in DeepSeek-V3's block-fp8 layout into `model`'s high-precision
    parameters: a weight with a '<key>_scale_inv' partner is dequantized into the dtype of the
    model's tensor of that key; every other entry loads as it is (model.load_state_dict)."""
    target = model.state_dict()
    plain: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key.endswith(SCALE_INV_SUFFIX) and key[: -len(SCALE_INV_SUFFIX)] in state_dict:
            continue
        scale_inv = state_dict.get(key + SCALE_INV_SUFFIX)
        if scale_inv is None:
            plain[key] = value
            continue
        dtype = target[key].dtype if key in target else torch.float32
        plain[key] = dequantize_weight_block_fp8(value, scale_inv, dtype)
    return model.load_state_dict(plain, strict=strict)
