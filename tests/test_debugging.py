"""mixprec.debugging: op dtype stats, the non-finite locator, hardware/model reports, doctor."""

from __future__ import annotations

import argparse
import sys
import textwrap

import pytest
import torch
from torch import nn

from mixprec.core.policy import preset
from mixprec.debugging import (
    CUDA_MIN_CAPABILITY,
    Finding,
    NonFiniteError,
    NonFiniteLocator,
    OperatorStats,
    add_doctor_arguments,
    collect_operator_stats,
    cpu_findings,
    cuda_findings,
    find_nonfinite,
    findings_table,
    hardware_report,
    load_factory,
    model_report,
    parse_cpu_flags,
    read_cpu_flags,
    run_doctor,
)

# -- operator statistics ----------------------------------------------------------------------


def _linear_softmax_ce_step(autocast: bool) -> OperatorStats:
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    x, target = torch.randn(2, 8), torch.tensor([1, 2])
    with (
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
        collect_operator_stats() as stats,
    ):
        logits = lin(x)
        probs = torch.softmax(logits, -1)
        loss = nn.functional.cross_entropy(logits, target) + probs.sum()
        loss.backward()
        logits.argmax(-1)
    return stats


def test_op_stats_under_cpu_bf16_autocast_counts_what_autocast_dispatched():
    stats = _linear_softmax_ce_step(autocast=True)
    # linear is on CPU autocast's lower-precision list: one addmm, in bf16.
    assert stats.as_dict("forward")["addmm"] == {
        "float32": 0,
        "float16": 0,
        "bfloat16": 1,
        "other": 0,
    }
    # torch 2.13's CPU autocast has no softmax in its fp32 list (CUDA's does): it follows its
    # bf16 input. cross_entropy is on the CPU fp32 list: log_softmax and nll_loss run in fp32.
    assert stats.calls("_softmax", "bfloat16", "forward") == 1
    assert stats.calls("_softmax", "float32") == 0
    assert stats.calls("_log_softmax", torch.float32, "forward") == 1
    assert stats.calls("nll_loss_forward", "float32", "forward") == 1
    # Backward: the weight gradient is one bf16 mm (x needs no grad); the fp32 loss backward.
    assert stats.calls("mm", "bfloat16", "backward") == 1
    assert stats.calls("mm", "bfloat16", "forward") == 0
    assert stats.calls("_log_softmax_backward_data", "float32", "backward") == 1
    assert stats.calls("_softmax_backward_data", "bfloat16", "backward") == 1
    # argmax's int64 output is 'other'.
    assert stats.calls("argmax", "other") == 1


def test_op_stats_without_autocast_count_float32():
    stats = _linear_softmax_ce_step(autocast=False)
    assert stats.calls("addmm", "float32") == 1
    assert stats.total_by_dtype()["bfloat16"] == 0
    assert stats.total_by_dtype()["float16"] == 0


def test_op_stats_totals_phases_and_table_agree():
    stats = _linear_softmax_ce_step(autocast=True)
    for phase in ("all", "forward", "backward"):
        table = stats.as_dict(phase)
        totals = stats.total_by_dtype(phase)
        for column, total in totals.items():
            assert total == sum(counts[column] for counts in table.values())
    fwd, bwd, both = (stats.total_by_dtype(p) for p in ("forward", "backward", "all"))
    assert all(fwd[c] + bwd[c] == both[c] for c in both)
    assert both["bfloat16"] > 0 and bwd["bfloat16"] > 0

    lines = stats.table().splitlines()
    header = [cell.strip() for cell in lines[0].split("|")[1:-1]]
    assert header == ["op", "float32", "float16", "bfloat16", "other", "calls"]
    ops = [line.split("|")[1].strip() for line in lines[2:-1]]
    assert ops == sorted(ops) == list(stats.as_dict())
    assert lines[-1].split("|")[-2].strip() == str(sum(both.values()))


def test_op_stats_accumulates_into_a_given_object_and_checks_names():
    stats = OperatorStats()
    for _ in range(2):
        with collect_operator_stats(stats):
            torch.ones(3) + 1
    assert stats.calls("add", "float32") == 2
    with pytest.raises(ValueError, match="'backwards'.*Did you mean 'backward'"):
        stats.as_dict("backwards")
    with pytest.raises(ValueError, match="'bf16'.*'bfloat16'"):
        stats.calls("add", "bf16")


def test_op_stats_print_on_exit(capsys):
    with collect_operator_stats(print_on_exit=True):
        torch.ones(2, dtype=torch.bfloat16) * 2
    out = capsys.readouterr().out
    assert "| mul" in out and "**total**" in out


# -- non-finite locator -----------------------------------------------------------------------

_PLANT_STEP = 3


class InfAtStep(nn.Module):
    """Multiplies its input by inf on one chosen step only."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float("inf") if self.step == _PLANT_STEP else x * 1.0


class _NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, poison):  # type: ignore[override]
        ctx.poison = poison
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return (grad * float("nan") if ctx.poison else grad), None


class NanInBackward(nn.Module):
    """Identity in the forward; its backward returns NaN on one chosen step only."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NanGrad.apply(x, self.step == _PLANT_STEP)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.block = nn.Sequential(InfAtStep(), nn.ReLU(inplace=True), nn.Linear(8, 8))
        # Identity returns its input as-is: it must not be blamed for the gradient it passes.
        self.stage = nn.Sequential(NanInBackward(), nn.Identity())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stage(self.block(self.first(x))))


def _train(net: Net, locator: NonFiniteLocator, *, plant: str, steps: int = 5) -> list:
    """Run steps; returns locator.first after each step (None until the planted step)."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    firsts = []
    for step in range(steps):
        target = net.block[0] if plant == "forward" else net.stage[0]
        target.step = step
        net.zero_grad(set_to_none=True)
        net(x).square().mean().backward()
        firsts.append(locator.first)
        locator.step()
    return firsts


def test_locator_finds_planted_inf_in_forward_output():
    net = Net()
    with NonFiniteLocator(net) as locator:
        firsts = _train(net, locator, plant="forward")
    assert firsts[:_PLANT_STEP] == [None] * _PLANT_STEP
    first = locator.first
    assert (first.module, first.where, first.step, first.kind) == (
        "block.0",
        "forward_output",
        _PLANT_STEP,
        "inf",
    )
    assert first.tensor == "output[0]" and first.shape == (3, 8) and first.dtype == torch.float32
    # The inf then reaches the enclosing block's output: recorded later, not first.
    assert any(r.module == "block" and r.where == "forward_output" for r in locator.records[1:])
    line = locator.report()
    assert "'block.0'" in line and f"step {_PLANT_STEP}" in line and "inf" in line
    assert "\n" not in line


def test_locator_finds_planted_nan_in_backward_and_check_grads_names_params():
    net = Net()
    with NonFiniteLocator(net) as locator:
        torch.manual_seed(0)
        x = torch.randn(3, 4)
        for step in range(_PLANT_STEP + 1):
            net.stage[0].step = step
            net.zero_grad(set_to_none=True)
            net(x).square().mean().backward()
            bad = locator.check_grads()
            if step < _PLANT_STEP:
                assert bad == [] and locator.first is None
            locator.step()
    first = locator.first
    assert (first.module, first.where, first.step, first.kind) == (
        "stage.0",
        "backward_grad_input",
        _PLANT_STEP,
        "nan",
    )
    # Everything upstream of `stage.0` gets NaN grads; the head's, computed before, stay finite.
    named = {(r.module, r.tensor) for r in bad}
    assert named == {
        ("first", "weight"),
        ("first", "bias"),
        ("block.2", "weight"),
        ("block.2", "bias"),
    }
    assert {r.where for r in bad} == {"param_grad"} and {r.kind for r in bad} == {"nan"}


def test_locator_blames_the_loss_when_nan_arrives_from_outside_the_model():
    # The Identity takes the output in and hands it back: not blamed for the loss's NaN.
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1), nn.Identity())
    with NonFiniteLocator(net) as locator:
        (net(torch.randn(2, 4)).sum() * float("nan")).backward()
    first = locator.first
    assert (first.module, first.where, first.kind) == ("1", "backward_grad_output", "nan")


def test_locator_reports_bad_input_data_as_such():
    net = nn.Sequential(nn.Linear(4, 4))
    with NonFiniteLocator(net) as locator:
        net(torch.tensor([[1.0, float("nan"), 0.0, 0.0]]))
    assert (locator.first.module, locator.first.where) == ("", "forward_input")
    assert "<model>" in locator.report()


def test_locator_removes_its_hooks_on_exit():
    net = Net()

    def hook_counts() -> list[tuple[int, int]]:
        return [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in net.modules()]

    before = hook_counts()
    net.stage[0].step = _PLANT_STEP  # its backward will return NaN
    with NonFiniteLocator(net) as locator:
        assert all(
            pre == b[0] + 1 and post == b[1] + 1
            for (pre, post), b in zip(hook_counts(), before, strict=True)
        )
        out = net(torch.randn(2, 4))  # gradient hooks now pending on live activations
    assert hook_counts() == before and not locator.attached
    out.sum().backward()  # NaN gradients, but the pending gradient hooks are quiet after exit
    assert not torch.isfinite(net.first.weight.grad).all()
    net.block[0].step = _PLANT_STEP
    net(torch.randn(2, 4)).sum().backward()
    assert locator.first is None
    assert locator.report().startswith("No inf/nan seen")


def test_locator_raise_on_first():
    net = Net()
    net.block[0].step = _PLANT_STEP
    with NonFiniteLocator(net, raise_on_first=True), pytest.raises(NonFiniteError) as info:
        net(torch.randn(2, 4))
    assert info.value.record.module == "block.0"
    assert "block.0" in str(info.value)
    assert all(len(m._forward_hooks) == 0 for m in net.modules())


def test_locator_keeps_inplace_relu_models_working():
    # Full backward hooks would raise here (in-place op on a BackwardHookFunction view).
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    net(x).sum().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    with NonFiniteLocator(net) as locator:
        net(x).sum().backward()
        assert locator.check_grads() == []
    for p, r in zip(net.parameters(), ref, strict=True):
        torch.testing.assert_close(p.grad, r, rtol=0, atol=0)  # hooks only read: bitwise same


def test_locator_validates_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        NonFiniteLocator("model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_records=0"):
        NonFiniteLocator(nn.Linear(2, 2), max_records=0)


def test_find_nonfinite_runs_one_step_and_restores_grads():
    net = Net()
    net.stage[0].step = _PLANT_STEP
    sentinel = torch.full_like(net.head.weight, 7.0)
    net.head.weight.grad = sentinel
    locator = find_nonfinite(net, torch.randn(2, 4))
    assert (locator.first.module, locator.first.where) == ("stage.0", "backward_grad_input")
    assert net.head.weight.grad is sentinel and net.first.weight.grad is None
    assert not locator.attached
    clean = find_nonfinite(nn.Linear(4, 2), torch.randn(2, 4), compute_dtype=torch.bfloat16)
    assert clean.first is None


# -- hardware report --------------------------------------------------------------------------


def _levels(findings: list[Finding]) -> dict[str, str]:
    return {f.dtype: f.level for f in findings if f.dtype and f.level != "info"}


def test_cuda_findings_by_compute_capability():
    old = cuda_findings("Tesla K40m", (3, 5))
    assert _levels(old) == {"float16": "warn", "bfloat16": "warn", "float8": "warn"}
    assert old[0].message == (
        "AMP only support NVIDIA GPU with Compute Capability 7.0 or higher, "
        "current GPU is: Tesla K40m, with Compute Capability: 3.5."
    )
    assert _levels(cuda_findings("GTX 1080", (6, 1)))["float16"] == "warn"
    assert _levels(cuda_findings("T4", (7, 5))) == {
        "float16": "ok",
        "bfloat16": "warn",
        "float8": "warn",
    }
    assert _levels(cuda_findings("A100", (8, 0))) == {
        "float16": "ok",
        "bfloat16": "ok",
        "float8": "warn",
    }
    assert _levels(cuda_findings("L4", (8, 9), device="cuda:1")) == dict.fromkeys(
        CUDA_MIN_CAPABILITY, "ok"
    )
    assert {f.device for f in cuda_findings("L4", (8, 9), device="cuda:1")} == {"cuda:1"}
    assert _levels(cuda_findings("H100", (9, 0)))["float8"] == "ok"
    assert "8.9" in cuda_findings("A100", (8, 0))[2].message


def test_parse_cpu_flags_x86_and_arm():
    x86 = textwrap.dedent(
        """\
        processor\t: 0
        model name\t: Some Xeon
        flags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile amx_bf16
        processor\t: 1
        flags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile amx_bf16
        """
    )
    assert parse_cpu_flags(x86) == {"fpu", "sse2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
    arm = "processor\t: 0\nFeatures\t: fp asimd asimdhp bf16 sve\nCPU part\t: 0xd40\n"
    assert parse_cpu_flags(arm) == {"fp", "asimd", "asimdhp", "bf16", "sve"}
    assert parse_cpu_flags("model name : no flags here") == frozenset()


def test_cpu_findings_from_fake_flags():
    plain = cpu_findings({"sse2", "avx2", "avx512f"})
    assert _levels(plain) == {"bfloat16": "warn", "float16": "warn"}
    fp16_warning = next(f for f in plain if f.dtype == "float16").message
    assert "slow" in fp16_warning and "avx512_fp16" in fp16_warning

    amx = cpu_findings({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, mkldnn_bf16=True)
    bf16 = [f for f in amx if f.dtype == "bfloat16"]
    assert bf16[0].level == "ok" and "amx_bf16" in bf16[0].message
    assert any("amx_tile" in f.message for f in bf16)
    assert _levels(amx)["float16"] == "warn"

    sapphire = cpu_findings({"avx512_bf16", "avx512_fp16", "amx_fp16"})
    assert _levels(sapphire) == {"bfloat16": "ok", "float16": "ok"}
    assert _levels(cpu_findings({"asimd", "asimdhp", "bf16"})) == {
        "bfloat16": "ok",
        "float16": "ok",
    }
    no_mkldnn = cpu_findings({"avx512_bf16"}, mkldnn_bf16=False)
    assert any(f.level == "warn" and "oneDNN" in f.message for f in no_mkldnn)

    unknown = cpu_findings(None, cpu_capability="AVX2")
    assert [f.level for f in unknown] == ["info", "info"] and "AVX2" in unknown[0].message


def test_read_cpu_flags_and_real_machine_report(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("flags : avx2 avx512_bf16\n")
    assert read_cpu_flags(path) == {"avx2", "avx512_bf16"}
    assert read_cpu_flags(tmp_path / "missing") is None

    findings = hardware_report()
    assert all(isinstance(f, Finding) for f in findings)
    cpu = [f for f in findings if f.device == "cpu" and f.dtype in ("bfloat16", "float16")]
    expected = cpu_findings(read_cpu_flags())
    assert _levels(cpu) == _levels(expected)
    if not torch.cuda.is_available():
        assert any(f.device == "cuda" and f.level == "info" for f in findings)
    table = findings_table(findings)
    assert table.splitlines()[0].startswith("| device") and len(table.splitlines()) == 2 + len(
        findings
    )


# -- model report -----------------------------------------------------------------------------


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(30, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 16), nn.BatchNorm1d(16)
    )


def test_model_report_static_fp16_naive_keeps_norms_fp32_and_flags_dims():
    report = model_report(_mlp(), preset("fp16_naive"))
    rows = {layer.name: layer for layer in report.layers}
    assert list(rows) == ["0", "1", "2", "3", "4"]
    for norm in ("1", "4"):
        assert (rows[norm].param_dtype, rows[norm].compute) == ("float32", "float32")
    for linear in ("0", "3"):
        assert (rows[linear].param_dtype, rows[linear].compute) == ("float16", "float16")
    assert rows["2"].param_dtype == "-"
    assert not report.observed and all(layer.observed is None for layer in report.layers)
    assert [(m.name, m.kind, m.dim, m.value, m.multiple) for m in report.misaligned] == [
        ("0", "Linear", "in_features", 30, 8)
    ]
    table = report.table()
    assert "in_features" in table and "| 30" in table and "static view" in table
    assert "LayerNorm | float32" in table.replace("  ", "")


def test_model_report_fp8_wants_multiples_of_16_and_o3_casts_norms():
    report = model_report(_mlp(), preset("fp8"))
    assert report.multiple == 16
    assert {(m.name, m.value) for m in report.misaligned} == {("0", 30)}
    rows = {layer.name: layer.compute for layer in report.layers}
    assert rows["0"] == "bfloat16" and rows["3"] == "float8_e4m3fn"
    o3 = {layer.name: layer.param_dtype for layer in model_report(_mlp(), preset("O3")).layers}
    assert o3["1"] == "float16"  # O3 keeps norms fp32 only if asked
    fp32 = model_report(_mlp(), preset("fp32"))
    assert fp32.multiple is None and fp32.misaligned == () and "Not checked" in fp32.table()


def test_model_report_flags_conv_channels():
    net = nn.Sequential(nn.Conv2d(3, 30, 3), nn.Conv2d(30, 32, 1))
    report = model_report(net, preset("bf16"))
    assert [(m.name, m.dim, m.value) for m in report.misaligned] == [
        ("0", "in_channels", 3),
        ("0", "out_channels", 30),
        ("1", "in_channels", 30),
    ]


def test_model_report_observed_bf16_autocast_leaves_model_untouched():
    net = _mlp().train()
    running_mean = net[4].running_mean.clone()
    report = model_report(net, preset("bf16"), torch.randn(4, 30))
    observed = {layer.name: layer.observed for layer in report.layers}
    # Linear is autocast-listed; on torch 2.13's CPU autocast layer_norm and batch_norm are
    # not fp32-listed, so they follow their bf16 input.
    assert observed == dict.fromkeys(["0", "1", "2", "3", "4"], "bfloat16")
    assert net.training and all(m.training for m in net.modules())
    torch.testing.assert_close(net[4].running_mean, running_mean, rtol=0, atol=0)
    assert "observed" in report.table()


def test_model_report_fp16_naive_keeps_norms_fp32_and_feeds_them_fp16_on_cpu():
    net = _mlp()
    report = model_report(net, preset("fp16_naive"), torch.randn(2, 30))  # fp16: tiny on CPU
    by_name = {layer.name: layer for layer in report.layers}
    assert {name: layer.param_dtype for name, layer in by_name.items()} == {
        "0": "float16",
        "1": "float32",
        "2": "-",
        "3": "float16",
        "4": "float32",
    }
    # CPU's mixed-dtype norm kernels take the fp16 activation with fp32 params, accumulate in
    # fp32 and return fp16: no fp32 copy of the activation anywhere.
    assert {layer.observed for layer in report.layers} == {"float16"}
    assert {p.dtype for p in net.parameters()} == {torch.float32}


def test_model_report_rejects_non_policy():
    with pytest.raises(TypeError, match="preset"):
        model_report(_mlp(), "bf16")  # type: ignore[arg-type]


# -- doctor -----------------------------------------------------------------------------------


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    name = "mixprec_doctor_test_models"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """\
            from torch import nn

            def build():
                return nn.Sequential(nn.Linear(30, 64), nn.LayerNorm(64), nn.Linear(64, 8))

            def not_a_model():
                return 42

            SIZE = 3
            """
        )
    )
    monkeypatch.chdir(tmp_path)  # the factory is found from the working directory
    yield name
    sys.modules.pop(name, None)


def _doctor(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mixprec doctor")
    add_doctor_arguments(parser)
    return parser.parse_args(list(argv))


def test_run_doctor_without_model_prints_hardware_report(capsys):
    assert run_doctor(_doctor()) == 0
    out = capsys.readouterr().out
    assert out.startswith("| device") and "| cpu" in out


def test_run_doctor_with_model_prints_model_report(capsys, factory_module):
    path_before = list(sys.path)
    assert run_doctor(_doctor("--model", f"{factory_module}:build", "--mode", "fp16_naive")) == 0
    out = capsys.readouterr().out
    assert "mode 'fp16_naive'" in out and "in_features" in out and "| 30" in out
    assert "LayerNorm | float32" in out.replace("  ", "")
    assert sys.path == path_before  # the working directory was on sys.path only to import
    code = run_doctor(_doctor("--model", f"{factory_module}:build", "--input-shape", "2,30"))
    assert code == 0 and "observed on the example input" in capsys.readouterr().out


def test_run_doctor_bad_input_returns_2_with_the_reason(capsys, factory_module):
    cases = [
        (["--model", "no_colon_here"], "must look like 'package.module:factory'"),
        (["--model", f"{factory_module}:biuld"], "has no 'biuld'"),
        (["--model", "mixprec_no_such_module_xyz:build"], "cannot import"),
        (["--model", f"{factory_module}:SIZE"], "not callable"),
        (["--model", f"{factory_module}:not_a_model"], "returned int"),
        (["--model", f"{factory_module}:build", "--input-shape", "2,x"], "--input-shape '2,x'"),
    ]
    for argv, reason in cases:
        assert run_doctor(_doctor(*argv)) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("mixprec doctor: error:") and reason in err, (argv, err)
    with pytest.raises(SystemExit):
        _doctor("--mode", "fp17")
    capsys.readouterr()


def test_load_factory_resolves_dotted_attributes(factory_module):
    assert load_factory(f"{factory_module}:build")().__class__ is nn.Sequential
    assert load_factory("mixprec.core.policy:preset.__call__")("bf16").name == "bf16"
