"""Quantization telemetry: exact figures on constructed tensors, the operands each GEMM
reports, and training bit-identical with it on or off."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from mixprec.fp8 import (
    RECIPE_OPERANDS,
    RECIPES,
    Float8Config,
    Float8Linear,
    Float8Telemetry,
    convert_to_fp8,
    operand_stats,
)

E4M3 = torch.float8_e4m3fn


def test_counts_on_a_constructed_tensor_mx_floor():
    """One 1x32 MX block with amax 500: 'floor' gives scale 2**0, so 500 > 448 saturates
    (1 clipped); 2**-12 is below e4m3's smallest subnormal 2**-9 (1 underflow); the block
    spans 500 / 2**-12 = 2**(log2 500 + 12)."""
    x = torch.ones(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 500.0, 2.0**-12, 0.0
    stats = operand_stats(x, "mx", E4M3, Float8Config(recipe="mxfp8", mx_scale_mode="floor"))
    assert stats["clipped_pct"] == 100 / 32 and stats["underflow_pct"] == 100 / 32
    assert stats["amax"] == 500.0 and stats["scale_inv_min"] == stats["scale_inv_max"] == 1.0
    assert stats["block_range_log2"] == pytest.approx(math.log2(500) + 12, abs=1e-6)
    # rceil never saturates: scale 2**ceil(log2(500/448)) = 2, 500 -> 250 representable
    rceil = operand_stats(x, "mx", E4M3, Float8Config(recipe="mxfp8"))
    assert rceil["clipped_pct"] == 0 and rceil["scale_inv_max"] == 2.0


def test_tensorwise_and_exact_sqnr():
    x = torch.tensor([[448.0, 1.0, 0.5, 0.0]])  # all e4m3 values at scale 1: exact
    stats = operand_stats(x, "tensor", E4M3, Float8Config())
    assert stats["sqnr_db"] == math.inf and stats["underflow_pct"] == 0
    assert stats["clipped_pct"] == 0 and stats["block_range_log2"] == pytest.approx(
        math.log2(896), rel=1e-6
    )  # fp32 log2
    y = torch.tensor([[448.0, 1e-9, 1.0, 3.0]])  # 1e-9 * 1 underflows
    assert operand_stats(y, "tensor", E4M3, Float8Config())["underflow_pct"] == 25.0


def test_every_gemm_operand_is_reported_per_recipe():
    for recipe in RECIPES:
        layer = Float8Linear(32, 48, config=Float8Config(recipe=recipe))
        telemetry = Float8Telemetry().attach(nn.Sequential(layer))
        layer(torch.randn(8, 32, requires_grad=True)).sum().backward()
        got = {(r.gemm, r.operand, r.kind) for r in telemetry.report()}
        want = {
            (gemm, op, kind)
            for gemm, kinds in RECIPE_OPERANDS[recipe].items()
            for op, kind in zip("AB", kinds, strict=True)
            if kind != "hp"
        }
        assert got == want, recipe
        sqnrs = [r.sqnr_db for r in telemetry.report()]
        assert sqnrs == sorted(sqnrs)  # worst first
    assert "sqnr_dB" in telemetry.table()


def test_every_n_calls_and_eval_is_not_observed():
    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32)))
    telemetry = Float8Telemetry(every=2).attach(model)
    for _ in range(3):
        model(torch.randn(4, 32)).sum().backward()
    model.eval()
    model(torch.randn(4, 32))
    assert sorted({r.call for r in telemetry.records}) == [0, 2]
    Float8Telemetry.detach(model)
    model.train()
    model(torch.randn(4, 32)).sum().backward()
    assert sorted({r.call for r in telemetry.records}) == [0, 2]
    with pytest.raises(ValueError, match="every=0"):
        Float8Telemetry(every=0)
    with pytest.raises(ValueError, match="no Float8Linear"):
        Float8Telemetry().attach(nn.Linear(4, 4))


@pytest.mark.parametrize("recipe", RECIPES)
def test_training_is_bit_identical_with_telemetry_on_or_off(recipe):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    config = Float8Config(recipe=recipe, emulate=True if recipe == "tensorwise" else None)
    runs = []
    for observe in (False, True):
        model = convert_to_fp8(copy.deepcopy(base), config=config)
        if observe:
            telemetry = Float8Telemetry().attach(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(1)  # nvfp4's stochastic rounding draws from here
        for i in range(3):
            gen = torch.Generator().manual_seed(i)
            x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert telemetry.records
    for p, q in zip(*runs, strict=True):
        assert torch.equal(p, q)


def test_recommend_names_the_layer_an_outlier_hurts_and_the_rule_keeps_it():
    """An outlier feature (1e4 among N(0,1)) crushes the tensorwise input scale of the layer
    that reads it: its small inputs underflow, though the outlier's energy keeps its SQNR
    high; the rule keeps exactly that layer."""
    from mixprec.fp8 import per_module_recipes

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    model = convert_to_fp8(copy.deepcopy(base), config=Float8Config(emulate=True))
    telemetry = Float8Telemetry().attach(model)
    x = torch.randn(64, 32)
    x[:, 3] *= 1e4
    model(x).sum().backward()
    assert telemetry.recommend(min_sqnr_db=20.0, no_gain=False) == {}  # SQNR alone misses it
    recommended = telemetry.recommend(min_sqnr_db=20.0, max_underflow_pct=1.0, no_gain=False)
    assert list(recommended) == ["0"]
    assert recommended["0"].startswith("forward operand A (input, tensor): underflow above 1.0 %")
    line = Float8Telemetry.keep_rule(recommended)
    assert line == "convert_to_fp8(model, per_module_recipes(model, {'0': 'keep'}), config)"
    again = copy.deepcopy(base)
    convert_to_fp8(again, per_module_recipes(again, {"0": "keep"}, keep_first_last=False))
    assert not isinstance(again[0], Float8Linear) and isinstance(again[2], Float8Linear)
    with pytest.raises(TypeError, match="min_sqnr_db"):
        telemetry.recommend(min_sqnr_db="20")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="no_gain must be True or False, got 'yes'"):
        telemetry.recommend(min_sqnr_db=20.0, no_gain="yes")  # type: ignore[arg-type]
    # both layers are far below torchao's tensorwise sizes: with no_gain (the default) both are
    # marked, the hurt layer with both reasons
    both = telemetry.recommend(min_sqnr_db=20.0, max_underflow_pct=1.0)
    small = "(torchao's tensorwise auto filter: too small to gain)"
    assert both == {
        "0": f"{recommended['0']}; expected not to gain: N=64, K=32: K <= 4096 and N <= 1024 "
        + small,
        "2": f"expected not to gain: N=32, K=64: K <= 4096 and N <= 1024 {small}",
    }


def test_recommend_by_sqnr_flags_layers_below_the_threshold():
    """nvfp4 operands sit near 20 dB on N(0,1)-like data: a 25 dB bar flags every layer, a
    10 dB bar none."""
    torch.manual_seed(0)
    model = convert_to_fp8(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)),
        config=Float8Config(recipe="nvfp4"),
    )
    telemetry = Float8Telemetry().attach(model)
    model(torch.randn(64, 32)).sum().backward()
    flagged = telemetry.recommend(min_sqnr_db=25.0)
    assert set(flagged) == {"0", "2"} and all("SQNR below 25.0 dB" in v for v in flagged.values())
    assert telemetry.recommend(min_sqnr_db=10.0) == {}


def test_fp8_summary_ends_with_the_attached_telemetry_ranked_table():
    from mixprec.fp8 import fp8_summary

    model = convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)))
    plain = str(fp8_summary(model))
    telemetry = Float8Telemetry().attach(model)
    assert fp8_summary(model).telemetry is None  # attached, nothing observed yet
    model(torch.randn(4, 32)).sum().backward()
    summary = fp8_summary(model)
    assert summary.telemetry is telemetry
    assert str(summary) == f"{plain}\nfloat8 telemetry, worst SQNR first:\n{telemetry.table()}"
    # header + layer 1's 6 operands + layer 0's 4 (its input needs no grad: no grad_input GEMM)
    assert len(telemetry.table().splitlines()) == 1 + 6 + 4
    Float8Telemetry.detach(model)
    assert str(fp8_summary(model)) == plain


def test_recommend_marks_layers_expected_not_to_gain_by_torchao_auto_filter():
    """Marks, before any step, the layers torchao's auto filter leaves in high precision:
    dims not multiples of 16, and GEMMs at or below its sizes for the layer's recipe (each
    boundary hit exactly); recipes torchao gives no sizes for are judged on alignment alone."""
    from collections import OrderedDict

    from torchao.float8 import _auto_filter_for_recipe

    from mixprec.fp8 import per_module_recipes

    rowwise, mxfp8 = Float8Config(recipe="rowwise"), Float8Config(recipe="mxfp8")
    layers = OrderedDict(
        odd=Float8Linear(24, 32),  # in_features 24: not a multiple of 16
        tw_small=Float8Linear(4096, 1024),  # K=4096, N=1024: tensorwise's bound, inclusive
        tw_big=Float8Linear(16, 1040),  # N=1040 > 1024
        rw_small=Float8Linear(2048, 4096, config=rowwise),  # N <= 4096 and K <= 2048
        rw_big=Float8Linear(2064, 2064, config=rowwise),  # K=2064 > 2048, N > 2048
        mx_small=Float8Linear(32, 32, config=mxfp8),  # no size rule for mxfp8
    )
    model = nn.Sequential(layers)
    telemetry = Float8Telemetry().attach(model)
    marks = telemetry.recommend(min_sqnr_db=0.0)  # nothing observed: only the size marks
    why = "expected not to gain: "
    assert marks == {
        "odd": why + "in_features=24 not a multiple of 16 (float8 GEMM alignment)",
        "tw_small": why + "N=1024, K=4096: K <= 4096 and N <= 1024 (torchao's tensorwise auto "
        "filter: too small to gain)",
        "rw_small": why + "N=4096, K=2048: N <= 2048, or K <= 1024, or N <= 4096 and K <= 2048 "
        "(torchao's rowwise auto filter: too small to gain)",
    }
    for name, layer in layers.items():  # the reference: torchao's own filter
        if layer.config.recipe in ("tensorwise", "rowwise"):
            keep = not _auto_filter_for_recipe(layer.config.recipe, [])(
                nn.Linear(layer.in_features, layer.out_features, device="meta"), name
            )
            assert keep == (name in marks), name
    assert telemetry.recommend(min_sqnr_db=0.0, no_gain=False) == {}
    assert Float8Telemetry.keep_rule(marks) == (
        "convert_to_fp8(model, per_module_recipes(model, {'odd': 'keep', 'tw_small': 'keep', "
        "'rw_small': 'keep'}), config)"
    )
    base = nn.Sequential(OrderedDict(odd=nn.Linear(24, 32), tw_small=nn.Linear(32, 32)))
    base.add_module("tw_big", nn.Linear(32, 32))
    convert_to_fp8(base, per_module_recipes(base, {"tw_small": "keep"}, keep_first_last=False))
    assert [type(m) is Float8Linear for m in base] == [False, False, True]
