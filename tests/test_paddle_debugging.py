"""paddle.amp.debugging and the paddle.amp queries, against facts recorded from Paddle 3.3.1
(tests/data/paddle_331_facts.json) and plain references."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec import paddle as amp
from mixprec.paddle import debugging

FACTS = json.loads((Path(__file__).parent / "data" / "paddle_331_facts.json").read_text())


def test_debug_modes_and_signatures_are_paddles() -> None:
    assert {m.name: m.value for m in debugging.DebugMode} == FACTS["debug_modes"]
    import inspect

    def names(fn):
        return [p for p in inspect.signature(fn).parameters if p != "self"]

    assert names(debugging.TensorCheckerConfig.__init__) == [
        n for n, _, _ in FACTS["tensor_checker_config_sig"]
    ]
    assert names(debugging.check_numerics) == [n for n, _, _ in FACTS["check_numerics_sig"]]


def test_check_numerics_counts_as_paddle() -> None:
    # recorded from Paddle 3.3.1 (CPU): x = [1, 0, nan, inf, -2, 0] in CHECK_NAN_INF mode gave
    # stats [1, 1, 2] (int64) and values [inf, -2, nan]; y = [1, 0, 3, -2]: [0, 0, 1], [3, -2, 0.5]
    x = torch.tensor([1.0, 0.0, math.nan, math.inf, -2.0, 0.0])
    stats, values = debugging.check_numerics(x, "my_op", "x", debugging.DebugMode.CHECK_NAN_INF)
    assert stats.tolist() == [1, 1, 2] and stats.dtype == torch.int64
    assert values[:2].tolist() == [math.inf, -2.0] and math.isnan(values[2])
    stats, values = debugging.check_numerics(torch.tensor([1.0, 0.0, 3.0, -2.0]), "my_op", "y")
    assert stats.tolist() == [0, 0, 1] and values.tolist() == [3.0, -2.0, 0.5]
    with pytest.raises(RuntimeError, match=r"num_nan=1, num_inf=1, num_zero=2.*op=my_op"):
        debugging.check_numerics(x, "my_op", "x")


def test_operator_stats_collection_counts_and_prints(capsys) -> None:
    model = nn.Linear(4, 4)
    debugging.enable_operator_stats_collection()
    with pytest.raises(RuntimeError, match="already called"):
        debugging.enable_operator_stats_collection()
    with amp.auto_cast(dtype="bfloat16"):
        model(torch.ones(2, 4)).sum()
    stats = debugging.disable_operator_stats_collection()
    assert stats.calls("addmm", "bfloat16") == 1  # the Linear ran low under O1
    assert "| addmm" in capsys.readouterr().out
    assert debugging.disable_operator_stats_collection() is None  # nothing running: no-op
    with debugging.collect_operator_stats() as stats:
        torch.ones(3).exp()
    assert stats.calls("exp", "float32") == 1 and "| exp" in capsys.readouterr().out


def test_tensor_checker_aborts_at_the_first_bad_op() -> None:
    config = debugging.TensorCheckerConfig(enable=True)
    debugging.enable_tensor_checker(config)
    try:
        x = torch.tensor([1.0, 0.0])
        y = x + 1
        with pytest.raises(debugging.TensorCheckerError, match="inf in output 0 of op div"):
            y / x
    finally:
        debugging.disable_tensor_checker()
    assert [r.op for r in config.records] == ["div"]
    # stack_height_limit=1 (Paddle's default): the innermost user frame, this test's line
    (frame,) = config.records[0].stack
    assert frame.startswith("test_paddle_debugging.py:") and "test_tensor_checker" in frame
    (torch.tensor([1.0]) / 0).sum()  # unchecked after disable


def test_tensor_checker_steps_op_lists_and_modes(caplog, tmp_path) -> None:
    config = debugging.TensorCheckerConfig(
        enable=True,
        debug_mode=debugging.DebugMode.CHECK_NAN_INF,
        skipped_op_list=["elementwise_div"],  # Paddle's name for div
        debug_step=[1, 2],
    )
    for _ in range(3):
        debugging.enable_tensor_checker(config)
        try:
            x = torch.tensor([0.0, 1.0])
            (x / x).sum()  # nan from div (skipped), then sum sees it
        finally:
            debugging.disable_tensor_checker()
    assert [(r.step, r.op, r.kind) for r in config.records] == [(1, "sum", "nan")]
    big = debugging.TensorCheckerConfig(
        enable=True,
        debug_mode=debugging.DebugMode.CHECK_ALL_FOR_OVERFLOW,
        checked_op_list=["mul"],
        output_dir=str(tmp_path),
    )
    debugging.enable_tensor_checker(big)
    try:
        torch.tensor([1e5]) * torch.tensor([10.0])  # 1e6 > float16's 65504
        torch.tensor([1e5]) + 1.0  # not checked
    finally:
        debugging.disable_tensor_checker()
    assert [(r.op, r.kind) for r in big.records] == [("mul", "overflow")]
    assert "overflow in output 0 of op mul" in (tmp_path / "tensor_checker.log").read_text()
    with pytest.raises(ValueError, match="'fused_attention' cannot be checked"):
        debugging.TensorCheckerConfig(enable=True, checked_op_list=["fused_attention"])
    with pytest.raises(ValueError, match="debug_step"):
        debugging.TensorCheckerConfig(enable=True, debug_step=[3, 1])
    with pytest.raises(TypeError, match="stack_height_limit=-1"):
        debugging.TensorCheckerConfig(enable=True, stack_height_limit=-1)
    with pytest.raises(TypeError, match="DebugMode"):
        debugging.TensorCheckerConfig(enable=True, debug_mode=1)


def test_autocast_queries_follow_the_innermost_auto_cast() -> None:
    # Paddle 3.3.1 on CPU reports False/'float16' everywhere (its AMP is off on CPU); these are
    # its documented GPU answers, which mixprec gives on every device.
    assert FACTS["queries_outside"] == {
        "is_autocast_enabled": False,
        "get_autocast_dtype": "float16",
    }
    assert (amp.is_autocast_enabled(), amp.get_autocast_dtype()) == (False, "float16")
    with amp.auto_cast(dtype="bfloat16"):
        assert (amp.is_autocast_enabled(), amp.get_autocast_dtype()) == (True, "bfloat16")
        with amp.auto_cast(level="O0"):
            assert (amp.is_autocast_enabled(), amp.get_autocast_dtype()) == (False, "float16")
        with amp.auto_cast(enable=False, dtype="bfloat16"):
            assert not amp.is_autocast_enabled()
        assert amp.is_autocast_enabled("gpu")
    assert not amp.is_autocast_enabled()


def test_white_and_black_lists_are_paddles() -> None:
    def as_lists(d):
        return {dtype: {level: sorted(ops) for level, ops in x.items()} for dtype, x in d.items()}

    assert as_lists(amp.white_list()) == FACTS["white_list"]
    assert as_lists(amp.black_list()) == FACTS["black_list"]


def test_decorate_defaults_to_o1_as_paddle(caplog) -> None:
    assert dict((n, d) for n, d, _ in FACTS["signatures"]["paddle.amp.decorate"])["level"] == "O1"
    assert FACTS["decorate_default_weight_dtype"] == "paddle.float32"
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        got_model, got_opt = amp.decorate(model, opt)
    assert got_model is model and got_opt is opt and model.weight.dtype == torch.float32
    with pytest.raises(RuntimeError, match="decorate the model first"):
        amp.decorate(nn.DataParallel(model), level="O2")


class _Checked(nn.Module):
    """Paddle's check_layer_numerics example: x @ w + b, or 1 / x * w + b with divide=True."""

    def __init__(self, divide: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w, self.b = nn.Parameter(torch.rand(2, 3)), nn.Parameter(torch.rand(2, 3))
        self.divide = divide

    def plain(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        if self.divide:
            return 1 / x * self.w + self.b
        return x @ self.w * scale + self.b

    forward = debugging.check_layer_numerics(plain)


def test_check_layer_numerics_passes_a_clean_forward_through_unchanged() -> None:
    layer, x = _Checked(), torch.rand(10, 2, 2)
    out = layer(x, scale=2.0)
    torch.testing.assert_close(out, layer.plain(x, scale=2.0), rtol=0, atol=0)
    out.sum().backward()  # the backward runs as without the decorator
    assert layer.w.grad is not None and torch.isfinite(layer.w.grad).all()
    with amp.auto_cast(dtype="bfloat16"):  # under AMP too: the same casts, the same values
        with debugging.collect_operator_stats() as stats:
            checked = layer(x)
        torch.testing.assert_close(checked, layer.plain(x), rtol=0, atol=0)
    assert stats.calls("bmm", "bfloat16") + stats.calls("mm", "bfloat16") == 1  # ran low
    assert _Checked.forward.__name__ == "plain"  # functools.wraps


def test_check_layer_numerics_aborts_at_the_op_that_made_the_inf() -> None:
    layer = _Checked(divide=True)
    x = torch.rand(10, 2, 3) + 0.5
    x[0] = 0.0  # Paddle's example: 1 / x gives inf in the divide op
    with pytest.raises(debugging.TensorCheckerError, match=r"inf in output 0 of op \w+") as e:
        layer(x)
    assert e.value.record.kind == "inf" and e.value.record.op in ("reciprocal", "div")
    (frame,) = e.value.record.stack  # the forward's own line, as Paddle's traceback shows
    assert "in plain" in frame
    (torch.tensor([1.0]) / 0).sum()  # the check ends with the forward


def test_check_layer_numerics_checks_the_gradients_at_the_layers_edges() -> None:
    layer = _Checked()
    x = torch.rand(10, 2, 2, requires_grad=True)
    out = layer(x)
    with pytest.raises(
        debugging.TensorCheckerError, match="inf in .* op _Checked.forward.s output grads"
    ):
        out.backward(torch.full_like(out, math.inf))  # an inf gradient reaches the output
    assert layer.w.grad is None  # it stopped there, before the layer's own grad ops
    x.grad = None
    out = layer(x)
    # a finite gradient in, an fp32 overflow out: x.grad = g @ w.T overflows to inf
    with pytest.raises(debugging.TensorCheckerError, match=r"input grads \(float32"):
        out.backward(torch.full_like(out, 3e38))


def test_check_layer_numerics_checks_the_inputs_and_refuses_what_paddle_refuses() -> None:
    layer = _Checked()
    x = torch.rand(10, 2, 2)
    x[3, 1, 0] = math.nan
    with pytest.raises(debugging.TensorCheckerError, match="nan in output 0 of op _Checked"):
        layer(x)
    with pytest.raises(RuntimeError, match="no positional argument"):
        layer()
    with pytest.raises(RuntimeError, match="first input .* must be a tensor, got list"):
        layer([1.0, 2.0])
    with pytest.raises(TypeError, match="decorates a forward method"):
        debugging.check_layer_numerics(3)


def test_paddles_debugging_names_are_here_but_compare_accuracy() -> None:
    # compare_accuracy is left out on purpose: README, "Differences from PaddlePaddle 3.3.1"
    missing = {n for n in FACTS["paddle_amp_debugging_names"] if not hasattr(debugging, n)}
    assert missing == {"compare_accuracy"}
