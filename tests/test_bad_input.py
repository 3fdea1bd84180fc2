"""Bad input across every face: each raises, naming the value passed and the valid choices.

A table, so the count is visible: nothing here may be silently accepted.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_mlp

import mixprec
from mixprec import AMP_TYPE
from mixprec.core.skip_monitor import SkipMonitor


def model_opt():
    model = tiny_mlp()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def convert(mode, cfg=None):
    model, opt = model_opt()
    return mixprec.convert_to_amp(model, opt, torch.nn.CrossEntropyLoss(), mode, cfg)


def booster(mp):
    return mixprec.Booster(mixed_precision=mp)


def apex_init(**kw):
    from mixprec.apex import amp

    model, opt = model_opt()
    return amp.initialize(model, opt, **kw)


def paddle_cast(**kw):
    from mixprec.paddle import auto_cast

    return auto_cast(**kw)


def paddle_decorate(**kw):
    from mixprec.paddle import decorate

    return decorate(tiny_mlp(), **kw)


def fp8_config(**kw):
    from mixprec.fp8 import Float8Config

    return Float8Config(**kw)


def load_config(path):
    return mixprec.load_config(path)


CASES = [
    # (id, callable, exception, a regex the message must match: the value and the choices)
    ("mode typo", lambda: convert("bf61"), ValueError, r"'bf61'.*Valid: .*'bf16'"),
    ("mode type", lambda: convert(16), TypeError, r"mode=16\).*AMP_TYPE.TORCH.*'bf16'"),
    (
        "torch key typo",
        lambda: convert(AMP_TYPE.TORCH, {"growth_intervl": 5}),
        ValueError,
        r"'growth_intervl'.*'growth_interval'",
    ),
    (
        "naive key from torch",
        lambda: convert(AMP_TYPE.NAIVE, {"init_scale": 8}),
        ValueError,
        r"'init_scale'.*'initial_scale'",
    ),
    (
        "dtype",
        lambda: convert("bf16", {"dtype": "float64"}),
        ValueError,
        r"'float64'.*'float16', 'bfloat16'",
    ),
    (
        "dtype on fp32",
        lambda: convert("fp32", {"dtype": "bfloat16"}),
        ValueError,
        r"'fp32' has no low-precision dtype",
    ),
    (
        "enabled type",
        lambda: convert(AMP_TYPE.TORCH, {"enabled": "no"}),
        TypeError,
        r"enabled must be a bool, got 'no'",
    ),
    (
        "scale <= 0",
        lambda: convert(AMP_TYPE.TORCH, {"init_scale": -1.0}),
        ValueError,
        r"init_scale=-1.0 must be > 0",
    ),
    (
        "backoff >= 1",
        lambda: convert(AMP_TYPE.TORCH, {"backoff_factor": 2.0}),
        ValueError,
        r"backoff_factor=2.0",
    ),
    (
        "hysteresis 0",
        lambda: convert(AMP_TYPE.NAIVE, {"hysteresis": 0}),
        ValueError,
        r"hysteresis=0 must be >= 1",
    ),
    (
        "growth interval float",
        lambda: convert(AMP_TYPE.TORCH, {"growth_interval": 2.5}),
        TypeError,
        r"growth_interval must be an int, got 2.5",
    ),
    (
        "config without mode",
        lambda: mixprec.to_policy({"opt_level": "O2"}),
        ValueError,
        r"needs a 'mode' key.*'torch'",
    ),
    (
        "opt level",
        lambda: convert(AMP_TYPE.APEX, {"opt_level": "O5"}),
        ValueError,
        r"'O5'.*'O0', 'O1', 'O2', 'O3'",
    ),
    (
        "apex O1 cast type",
        lambda: apex_init(opt_level="O1", cast_model_type=torch.float16),
        ValueError,
        r"O1.*cast_model_type",
    ),
    (
        "apex O1 keep bn",
        lambda: apex_init(opt_level="O1", keep_batchnorm_fp32=True),
        ValueError,
        r"O1.*keep_batchnorm_fp32",
    ),
    (
        "apex O1 masters",
        lambda: apex_init(opt_level="O1", master_weights=True),
        ValueError,
        r"O1.*master_weights",
    ),
    (
        "apex loss scale",
        lambda: apex_init(opt_level="O2", loss_scale="auto"),
        ValueError,
        r"'auto'.*'dynamic'",
    ),
    (
        "apex bool string",
        lambda: apex_init(opt_level="O2", keep_batchnorm_fp32="yes"),
        TypeError,
        r"'yes'.*'True', 'False'",
    ),
    ("apex num_losses", lambda: apex_init(num_losses=0), ValueError, r"num_losses=0"),
    ("booster name", lambda: booster("fp16_navie"), ValueError, r"'fp16_navie'.*'fp16_naive'"),
    ("booster type", lambda: booster(3.0), (TypeError, ValueError), r"3.0"),
    (
        "grad scaler paddle keyword",
        lambda: mixprec.GradScaler("cpu", init_loss_scaling=8),
        TypeError,
        r"'init_loss_scaling'.*mixprec.paddle.GradScaler",
    ),
    (
        "autocast op name",
        lambda: mixprec.autocast(dtype=torch.bfloat16, custom_white_list=["sofmax"]),
        ValueError,
        r"'sofmax'.*'softmax'",
    ),
    ("autocast dtype", lambda: mixprec.autocast(dtype=torch.int8), ValueError, r"int8"),
    (
        "op in both lists",
        lambda: mixprec.autocast(
            dtype=torch.bfloat16, custom_white_list=["add"], custom_black_list=["add"]
        ),
        ValueError,
        r"add",
    ),
    ("paddle level", lambda: paddle_cast(level="O4"), ValueError, r"'O4'.*'O0'.*'O1'.*'O2'"),
    (
        "paddle dtype",
        lambda: paddle_cast(dtype="float8"),
        ValueError,
        r"'float8'.*float16.*bfloat16",
    ),
    ("paddle decorate level", lambda: paddle_decorate(level="OD"), ValueError, r"'OD'.*'O1'.*'O2'"),
    (
        "fp8 scaling",
        lambda: fp8_config(scaling="current"),
        ValueError,
        r"'current'.*'dynamic'.*'delayed'",
    ),
    (
        "fp8 amax history",
        lambda: fp8_config(scaling="delayed", amax_history_len=0),
        ValueError,
        r"amax_history_len=0",
    ),
    (
        "config file missing",
        lambda: load_config("/nonexistent/config_AMP_torch.py"),
        FileNotFoundError,
        r"/nonexistent/config_AMP_torch.py",
    ),
    (
        "config extension",
        lambda: load_config(__file__.replace(".py", ".yaml")),
        (ValueError, FileNotFoundError),
        r"\.yaml|\.py",
    ),
    (
        "optimizer type",
        lambda: mixprec.MixedPrecisionOptimizer(object()),
        TypeError,
        r"torch.optim.Optimizer, got",
    ),
    (
        "max_norm",
        lambda: mixprec.MixedPrecisionOptimizer(model_opt()[1], max_norm=-2.0),
        ValueError,
        r"max_norm=-2.0",
    ),
    (
        "fp16 adam eps",
        lambda: mixprec.MixedPrecisionOptimizer(
            torch.optim.Adam(mixprec.cast_module(tiny_mlp(), torch.float16).parameters()),
            master_weights=False,
        ),
        ValueError,
        r"eps=1e-08.*float16",
    ),
    (
        "launch env",
        lambda: mixprec.launch_from_torch({}),
        (RuntimeError, KeyError),
        r"RANK|LOCAL_RANK|WORLD_SIZE|MASTER",
    ),
]


class NoParams(torch.nn.Module):
    """A model without parameters: nothing to train, refused by every face."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def stray_opt():
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def optimizer(**kw):
    return mixprec.MixedPrecisionOptimizer(model_opt()[1], **kw)


def paddle_scaler(**kw):
    from mixprec.paddle import GradScaler

    return GradScaler(**kw)


def boost(model=None, opt=None, criterion=None):
    return mixprec.Booster(device="cpu", mixed_precision="bf16").boost(
        model if model is not None else tiny_mlp(), opt, criterion
    )


CASES += [
    # values of the wrong type reach no comparison: the message names the argument
    (
        "naive initial_scale str",
        lambda: convert(AMP_TYPE.NAIVE, {"initial_scale": "65536"}),
        TypeError,
        r"initial_scale='65536' must be a real number \(int or float\), got a str",
    ),
    (
        "torch init_scale str",
        lambda: convert(AMP_TYPE.TORCH, {"init_scale": "65536"}),
        TypeError,
        r"init_scale='65536' must be a real number",
    ),
    (
        "torch growth_factor str",
        lambda: convert(AMP_TYPE.TORCH, {"growth_factor": "2"}),
        TypeError,
        r"growth_factor='2' must be a real number",
    ),
    (
        "naive bool key str",
        lambda: convert(AMP_TYPE.NAIVE, {"log_num_zeros_in_grad": "no"}),
        TypeError,
        r"log_num_zeros_in_grad='no' must be True or False",
    ),
    (
        "naive keep_norm_fp32 str",
        lambda: convert(AMP_TYPE.NAIVE, {"keep_norm_fp32": "no"}),
        TypeError,
        r"keep_norm_fp32='no' must be True or False",
    ),
    (
        "grad scaler init_scale str",
        lambda: mixprec.GradScaler("cpu", init_scale="1024"),
        TypeError,
        r"init_scale='1024' must be a real number",
    ),
    (
        "grad scaler enabled str",
        lambda: mixprec.GradScaler("cpu", enabled="yes"),
        TypeError,
        r"enabled='yes' must be True or False",
    ),
    (
        "paddle grad scaler str",
        lambda: paddle_scaler(init_loss_scaling="1024"),
        TypeError,
        r"'1024' must be a real number",
    ),
    (
        "naive mixed precision str",
        lambda: mixprec.FP16NaiveMixedPrecision(initial_scale="65536"),
        TypeError,
        r"initial_scale='65536' must be a real number",
    ),
    (
        "torch mixed precision str",
        lambda: mixprec.FP16TorchMixedPrecision(init_scale="65536"),
        TypeError,
        r"init_scale='65536' must be a real number",
    ),
    # modules, optimizers, criteria
    (
        "convert optimizer None",
        lambda: mixprec.convert_to_amp(tiny_mlp(), None, None, "bf16"),
        TypeError,
        r"optimizer must be a torch.optim.Optimizer, got <class 'NoneType'>",
    ),
    (
        "convert model None",
        lambda: mixprec.convert_to_amp(None, model_opt()[1], None, "bf16"),
        TypeError,
        r"model must be an nn.Module, got <class 'NoneType'>",
    ),
    (
        "convert no parameters",
        lambda: mixprec.convert_to_amp(NoParams(), stray_opt(), None, AMP_TYPE.NAIVE),
        ValueError,
        r"model=NoParams has no parameters",
    ),
    (
        "convert criterion str",
        lambda: mixprec.convert_to_amp(*model_opt(), "mse", "bf16"),
        TypeError,
        r"criterion='mse' must be a loss \(an nn.Module or a function\), got a str",
    ),
    (
        "booster no parameters",
        lambda: boost(NoParams()),
        ValueError,
        r"model=NoParams has no parameters",
    ),
    (
        "booster criterion str",
        lambda: boost(criterion="mse"),
        TypeError,
        r"criterion='mse' must be a loss",
    ),
    (
        "booster device",
        lambda: mixprec.Booster(device="tpu"),
        ValueError,
        r"device='tpu' is not a torch device; valid: 'cpu', 'cuda'",
    ),
    (
        "initialize no parameters",
        lambda: mixprec.initialize(NoParams(), stray_opt(), config={}, verbose=False),
        ValueError,
        r"model=NoParams has no parameters",
    ),
    (
        "initialize verbose str",
        lambda: mixprec.initialize(*model_opt(), config={}, verbose="yes"),
        TypeError,
        r"verbose='yes' must be True or False",
    ),
    (
        "apex no parameters",
        lambda: apex_init_model(NoParams()),
        ValueError,
        r"models\[0\]=NoParams has no parameters",
    ),
    (
        "paddle decorate no parameters",
        lambda: paddle_decorate_model(NoParams()),
        ValueError,
        r"models=NoParams has no parameters",
    ),
    (
        "optimizer max_norm str",
        lambda: optimizer(max_norm="1.0"),
        TypeError,
        r"max_norm='1.0' must be a real number",
    ),
    (
        "optimizer max_consecutive_skips str",
        lambda: optimizer(max_consecutive_skips="5"),
        TypeError,
        r"max_consecutive_skips='5' must be an int or None",
    ),
    (
        "optimizer master_weights str",
        lambda: optimizer(master_weights="no"),
        TypeError,
        r"master_weights='no' must be True, False or None",
    ),
    (
        "optimizer fused_step str",
        lambda: optimizer(fused_step="yes"),
        TypeError,
        r"fused_step='yes' must be True, False or None",
    ),
    (
        "optimizer log zeros str",
        lambda: optimizer(log_num_zeros_in_grad="yes"),
        TypeError,
        r"log_num_zeros_in_grad='yes' must be True or False",
    ),
    (
        "optimizer loss_scale str",
        lambda: optimizer(loss_scale="dynamic"),
        TypeError,
        r"loss_scale='dynamic' must be a mixprec.ScalerConfig",
    ),
    (
        "loss scaler cfg str",
        lambda: mixprec.LossScaler("dynamic"),
        TypeError,
        r"cfg='dynamic' must be a mixprec.ScalerConfig or None",
    ),
    # dtypes and callables
    (
        "cast_module int8",
        lambda: mixprec.cast_module(tiny_mlp(), torch.int8),
        ValueError,
        r"dtype=torch.int8 must be a floating torch.dtype",
    ),
    (
        "cast_module not a module",
        lambda: mixprec.cast_module("model", torch.float16),
        TypeError,
        r"needs an nn.Module, got 'model'",
    ),
    (
        "fp8 filter not callable",
        lambda: mixprec.fp8.convert_to_fp8(tiny_mlp(), module_filter_fn="all"),
        TypeError,
        r"module_filter_fn='all' must be a function \(module, fqn\)",
    ),
    (
        "fp8 summary unconverted",
        lambda: mixprec.fp8.fp8_summary(tiny_mlp()),
        ValueError,
        r"Sequential was not converted by convert_to_fp8",
    ),
    (
        "register mode parser",
        lambda: mixprec.core.policy.register_mode_parser("fp17", dict),
        ValueError,
        r"unknown mode 'fp17'.*Valid: 'fp32'",
    ),
    (
        "skip monitor window",
        lambda: SkipMonitor(window=0),
        ValueError,
        r"window=0 must be an int >= 1",
    ),
]


def apex_init_model(model):
    from mixprec.apex import amp

    return amp.initialize(model, stray_opt(), opt_level="O2")


def paddle_decorate_model(model):
    from mixprec.paddle import decorate

    return decorate(model, level="O2")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_named(case, monkeypatch) -> None:
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    _, call, error, match = case
    with pytest.raises(error, match=match):
        call()


def test_table_is_large() -> None:
    assert len(CASES) >= 60


def test_a_step_without_any_gradient_warns_once() -> None:
    # torch's optimizers skip params without a grad silently; a step with none at all is a bug
    model, opt = model_opt()
    _, optimizer, _ = mixprec.convert_to_amp(model, opt, None, "bf16")
    with pytest.warns(UserWarning, match=r"step\(\): no parameter has a gradient") as record:
        optimizer.step()
        optimizer.step()  # said once per optimizer
    assert len(record) == 1
