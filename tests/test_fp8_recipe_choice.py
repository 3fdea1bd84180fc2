"""Per-module recipe choice: per_module_recipes(model, rules) as convert_to_fp8's filter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec.fp8 import (
    Float8Config,
    Float8Linear,
    convert_to_fp8,
    fp8_summary,
    per_module_recipes,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_proj = nn.Linear(32, 64)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"attn": nn.Linear(64, 64), "mlp": nn.Linear(64, 64)}) for _ in range(2)
        )
        self.odd = nn.Linear(64, 40)  # 40: not a multiple of 16
        self.back = nn.Linear(40, 64)
        self.head = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed_proj(x)
        for block in self.blocks:
            x = x + block["mlp"](torch.relu(block["attn"](x)))
        return self.head(self.back(self.odd(x)))


def test_default_keeps_first_last_and_misaligned_converts_the_rest_with_the_config():
    model = Net()
    base = Float8Config(recipe="blockwise")
    convert_to_fp8(model, per_module_recipes(model, config=base))
    summary = fp8_summary(model)
    assert summary.converted == ("blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp")
    assert set(summary.recipes.values()) == {"blockwise"}
    assert "the first Linear layer" in summary.skipped["embed_proj"]
    assert "the last Linear layer" in summary.skipped["head"]
    assert (
        "out_features=40" in summary.skipped["odd"] and "in_features=40" in summary.skipped["back"]
    )
    assert model.blocks[0]["mlp"].config is base


def test_rules_choose_recipes_first_match_wins_and_keep():
    model = Net()
    rules = {"blocks.0.*": "keep", "*.attn": "mxfp8", "head": "nvfp4", "blocks.*": "rowwise"}
    convert_to_fp8(model, per_module_recipes(model, rules))
    summary = fp8_summary(model)
    assert summary.recipes == {"blocks.1.attn": "mxfp8", "blocks.1.mlp": "rowwise", "head": "nvfp4"}
    assert summary.skipped["blocks.0.attn"] == "kept in high precision by rule 'blocks.0.*'"
    assert isinstance(model.head, Float8Linear) and not isinstance(model.embed_proj, Float8Linear)
    assert "mxfp8: blocks.1.attn" in str(summary)
    model(torch.randn(4, 32)).sum().backward()  # every layer runs its own recipe
    assert model.head.weight.grad is not None


def test_keep_first_last_off_and_bad_rules_name_the_choices():
    model = Net()
    convert_to_fp8(model, per_module_recipes(model, keep_first_last=False))
    assert {"embed_proj", "head"} <= set(fp8_summary(model).converted)
    with pytest.raises(ValueError, match="'blocks.*' -> 'mx_fp8'.*'mxfp8'.*'keep'"):
        per_module_recipes(Net(), {"blocks.*": "mx_fp8"})
    with pytest.raises(TypeError, match="Float8Config or None"):
        per_module_recipes(Net(), config="rowwise")  # type: ignore[arg-type]


def test_a_filter_returning_a_config_reaches_the_booster():
    model = Net()
    rules = per_module_recipes(model, {"blocks.*": "rowwise"})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = mixprec.FP8MixedPrecision(module_filter_fn=rules)
    model, opt, crit, _, _ = mixprec.Booster(mixed_precision=precision).boost(
        model, opt, nn.MSELoss()
    )
    summary = fp8_summary(model)
    assert set(summary.recipes.values()) == {"rowwise"} and len(summary.converted) == 4
    opt.zero_grad()
    opt.backward(crit(model(torch.randn(4, 32)), torch.randn(4, 32)))
    assert not opt.step().skipped


def test_fp8_mixed_precision_takes_a_recipe_keeping_the_config_fields():
    precision = mixprec.FP8MixedPrecision(
        config=Float8Config(allow_emulation=True), recipe="blockwise"
    )
    assert precision.config == Float8Config(allow_emulation=True, recipe="blockwise")
    assert mixprec.FP8MixedPrecision(recipe="nvfp4").config.recipe == "nvfp4"
    assert mixprec.FP8MixedPrecision().config is None  # convert_to_fp8's default, as before
    with pytest.raises(ValueError, match="recipe='mx'.*'mxfp8'"):
        mixprec.FP8MixedPrecision(recipe="mx")
    with pytest.raises(TypeError, match="Float8Config or None"):
        mixprec.FP8MixedPrecision(config={"recipe": "rowwise"}, recipe="rowwise")
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, *_ = mixprec.Booster(mixed_precision=mixprec.FP8MixedPrecision(recipe="mxfp8")).boost(
        model, opt
    )
    assert set(fp8_summary(model).recipes.values()) == {"mxfp8"}
