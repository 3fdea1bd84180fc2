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
from mixprec.paddle.accuracy_compare import read_dump

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
    (line,) = read_dump(str(tmp_path / "worker_cpu"))  # Paddle's dump line, file name
    assert (line.op, line.tensor, line.dtype, line.max, line.shape) == (
        "mul",
        "out0",
        "fp32",
        1e6,
        (1,),
    )
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


def test_paddles_debugging_names_are_all_here() -> None:
    missing = {n for n in FACTS["paddle_amp_debugging_names"] if not hasattr(debugging, n)}
    assert missing == set()


# ----- compare_accuracy -----

DUMPS = Path(__file__).parent / "data" / "paddle_331_dump"  # recorded from Paddle 3.3.1 (CPU)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _dumped_step(model, out_dir, dtype=None, loss_scale=1.0):
    """One forward and backward under CHECK_ALL dumping to out_dir; returns the config."""
    config = debugging.TensorCheckerConfig(
        enable=True, debug_mode=debugging.DebugMode.CHECK_ALL, output_dir=str(out_dir)
    )
    x = torch.linspace(-2, 2, 32).reshape(4, 8)
    model.zero_grad()  # each run's gradients land in None (the same ops as the other run)
    debugging.enable_tensor_checker(config)
    try:
        with amp.auto_cast(enable=dtype is not None, dtype=dtype or "float16"):
            loss = model(x).float().pow(2).mean()
        (loss * loss_scale if loss_scale != 1 else loss).backward()
    finally:
        debugging.disable_tensor_checker()
    return config


def _rows(path):
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_compare_accuracy_pairs_an_fp32_run_with_a_bf16_run_and_flags_a_mismatch(
    tmp_path, capsys
) -> None:
    model = _mlp()
    fp32 = _dumped_step(model, tmp_path / "fp32")
    _dumped_step(model, tmp_path / "bf16", dtype="bfloat16")
    # the records carry op, order, forward/backward, dtype, shape and the statistics
    addmm = [r for r in fp32.records if r.op == "addmm"]
    assert [(r.shape, r.dtype, r.grad_of) for r in addmm] == [
        ((4, 16), torch.float32, None),
        ((4, 4), torch.float32, None),
    ]
    assert {r.grad_of for r in fp32.records if r.op == "mm"} == {"AddmmBackward0"}
    out = debugging.compare_accuracy(
        str(tmp_path / "fp32"), str(tmp_path / "bf16"), str(tmp_path / "cmp.csv")
    )
    assert out == str(tmp_path / "cmp.csv")
    rows = _rows(out)
    # every fp32 op output found its bf16 partner; the bf16 run's extra rows are autocast's casts
    assert all(r["lp_dtype"] != "--" for r in rows)
    assert {r["op_type"] for r in rows if r["fp32_dtype"] == "--"} == {"_to_copy"}
    paired = [r for r in rows if r["fp32_dtype"] != "--"]
    assert len(paired) == len(fp32.records)
    assert [r["op_type"] for r in paired if r["op_type"] == "addmm"] == ["addmm", "addmm"]
    assert {r["lp_dtype"] for r in paired if r["op_type"] in ("addmm", "mm")} == {"bf16"}
    assert [
        r for r in rows if r["infinite"] != "0"
    ] == []  # bf16 rounding stays within Paddle's 1e-2
    # inject a mismatch: the bf16 run's second layer gets a wrong bias
    with torch.no_grad():
        model[2].bias[1] += 0.5
    _dumped_step(model, tmp_path / "bad", dtype="bfloat16")
    rows = _rows(
        debugging.compare_accuracy(
            str(tmp_path / "fp32"), str(tmp_path / "bad"), str(tmp_path / "bad.csv")
        )
    )
    flagged = [(r["op_type"], r["tensor_name"]) for r in rows if r["infinite"] == "1"]
    assert flagged[0] == ("addmm", "out0#1")  # the op that took the bias, nothing before it
    first = rows.index(next(r for r in rows if r["infinite"] == "1"))
    assert all(r["infinite"] == "0" for r in rows[:first])
    assert "differ" in rows[first]["why"] and "addmm" in capsys.readouterr().out


def test_compare_accuracy_divides_the_low_precision_backward_by_loss_scale(tmp_path) -> None:
    model = _mlp()
    _dumped_step(model, tmp_path / "fp32")
    scaled = _dumped_step(model, tmp_path / "bf16", dtype="bfloat16", loss_scale=1024.0)
    args = (str(tmp_path / "fp32"), str(tmp_path / "bf16"))
    rows = _rows(debugging.compare_accuracy(*args, str(tmp_path / "a.csv"), loss_scale=1024))
    assert [r for r in rows if r["infinite"] != "0"] == []
    grads = [r for r in rows if r["op_type"] == "mm"]  # the weight and input grads
    assert len(grads) == 3 and {r["lp_divided_by"] for r in grads} == {"1024.0"}
    mm = [r for r in scaled.records if r.op == "mm"]
    assert [float(r["lp_max_value"]) * 1024 for r in grads] == pytest.approx(
        [r.max for r in mm],
        rel=1e-6,  # the dump's 7 significant digits
    )
    # a backward op on a saved forward tensor (the transposed weight) ran unscaled: not divided
    weight_t = next(r for r in rows if r["tensor_name"] == "AddmmBackward0.out0@GRAD#0")
    assert weight_t["op_type"] == "t" and weight_t["lp_divided_by"] == "1.0"
    # told loss_scale=1, the scaled gradients differ from the fp32 run's
    rows = _rows(debugging.compare_accuracy(*args, str(tmp_path / "b.csv")))
    assert {r["op_type"] for r in rows if r["infinite"] == "1"} >= {"mm", "threshold_backward"}
    assert all(r["infinite"] == "0" for r in rows if "GRAD" not in r["tensor_name"])


def test_compare_accuracy_reads_paddles_own_dumps(tmp_path, caplog) -> None:
    # Paddle 3.3.1's CHECK_ALL dump of Linear, relu, mean and backward, compared with itself
    check_all = str(DUMPS / "check_all")
    path = debugging.compare_accuracy(check_all, check_all, str(tmp_path / "cmp.xlsx"))
    if path.endswith(".csv"):  # no xlsxwriter here: CSV beside the asked-for name, with why
        assert path == str(tmp_path / "cmp.csv") and "xlsxwriter" in caplog.text
        rows = _rows(path)
        ops = [r["op_type"] for r in rows]
        assert ops[:6] == ["uniform", "full_", "matmul", "add", "relu", "mean"]
        assert ops.count("matmul_grad") == 2 and all(r["infinite"] == "0" for r in rows)
        assert {r["lp/fp32_max_value"] for r in rows} == {"1.0"}
        assert rows[1]["tensor_name"] == "linear_0.b_0#0"
    else:
        import zipfile

        assert "matmul_grad" in zipfile.ZipFile(path).read("xl/sharedStrings.xml").decode()
    # its [ERROR] line (CHECK_NAN_INF): counts, inf, nan
    (line,) = read_dump(str(DUMPS / "nan_inf" / "worker_cpu"))
    assert (line.op, line.num_nan, line.num_inf, line.num_zero, line.max) == (
        "divide",
        1,
        1,
        1,
        math.inf,
    )
    assert math.isnan(line.mean)
    # mixprec writes the same fields in the same order (shape and step added at the end)
    model = _mlp()
    _dumped_step(model, tmp_path / "ours")
    theirs = (DUMPS / "check_all" / "worker_cpu").read_text().splitlines()[2]
    ours = (tmp_path / "ours" / "worker_cpu").read_text().splitlines()[0]
    import re

    def fields(text):
        return re.findall(r"(\w+)=", text)

    assert fields(ours)[: len(fields(theirs))] == fields(theirs)
    assert ours.startswith("[PRECISION] in [device=cpu, op=")
    config = debugging.TensorCheckerConfig(
        enable=True, debug_mode=debugging.DebugMode.CHECK_NAN_INF, output_dir=str(tmp_path / "e")
    )
    debugging.enable_tensor_checker(config)
    try:
        torch.tensor([1.0, 0.0, 3.0, 0.0]) / torch.tensor([0.5, 0.0, 0.0, 2.0])
    finally:
        debugging.disable_tensor_checker()
    ours = (tmp_path / "e" / "worker_cpu").read_text().strip()
    theirs = (DUMPS / "nan_inf" / "worker_cpu").read_text().strip()
    assert fields(ours)[: len(fields(theirs))] == fields(theirs)
    assert ours.startswith("[PRECISION] [ERROR] in [device=cpu, op=div, tensor=out0, dtype=fp32]")


def test_compare_accuracy_has_paddles_signature() -> None:
    import inspect

    recorded = json.loads((DUMPS / "compare_accuracy.json").read_text())["signature"]
    ours = inspect.signature(debugging.compare_accuracy).parameters.values()
    assert [[p.name, None if p.default is p.empty else p.default] for p in ours] == recorded


def test_compare_accuracy_refuses_what_it_cannot_compare(tmp_path) -> None:
    with pytest.raises(ValueError, match="dump_all_tensors=True"):
        debugging.compare_accuracy(str(DUMPS), str(DUMPS), "x.csv", dump_all_tensors=True)
    with pytest.raises(FileNotFoundError, match="no directory"):
        debugging.compare_accuracy(str(tmp_path / "nope"), str(DUMPS), "x.csv")
    with pytest.raises(FileNotFoundError, match="No worker_"):
        debugging.compare_accuracy(str(tmp_path), str(tmp_path), "x.csv")
    with pytest.raises(ValueError, match="loss_scale=0"):
        debugging.compare_accuracy(str(DUMPS), str(DUMPS), "x.csv", loss_scale=0)
    (tmp_path / "worker_cpu").write_text("[PRECISION] in [device=cpu, op=add], numel=x\n")
    with pytest.raises(ValueError, match="Not a tensor-checker dump line"):
        debugging.compare_accuracy(str(tmp_path), str(tmp_path), str(tmp_path / "x.csv"))
