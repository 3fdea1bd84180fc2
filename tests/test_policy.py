"""Policy presets and parsing: every face's spelling of a mode gives the same Policy."""

from __future__ import annotations

import pytest
import torch

from mixprec.amp_type import AMP_TYPE
from mixprec.core.policy import MODES, PRESETS, Policy, preset, to_policy


def test_every_mode_has_a_preset() -> None:
    assert set(MODES) <= set(PRESETS)


@pytest.mark.parametrize(
    "mode, param, compute, masters, dynamic",
    [
        ("fp32", torch.float32, None, False, False),
        ("fp16", torch.float32, torch.float16, False, True),
        ("bf16", torch.float32, torch.bfloat16, False, False),
        ("fp16_naive", torch.float16, None, True, True),
        ("fp8", torch.float32, torch.bfloat16, False, False),
        ("O0", torch.float32, None, False, False),
        ("O1", torch.float32, torch.float16, False, True),
        ("O2", torch.float16, None, True, True),
        ("O3", torch.float16, None, False, False),
    ],
)
def test_design_table(mode, param, compute, masters, dynamic) -> None:
    p = preset(mode)
    assert (p.param_dtype, p.compute_dtype, p.master_weights, p.loss_scale.dynamic) == (
        param,
        compute,
        masters,
        dynamic,
    )


def test_o3_casts_norms_too_and_o2_keeps_them() -> None:
    assert not preset("O3").keep_norm_fp32 and preset("O2").keep_norm_fp32


@pytest.mark.parametrize(
    "spec, name",
    [
        (AMP_TYPE.TORCH, "fp16"),
        ("torch", "fp16"),
        (AMP_TYPE.NAIVE, "fp16_naive"),
        ({"mode": AMP_TYPE.NAIVE}, "fp16_naive"),
        ({"mode": "bf16"}, "bf16"),
        (None, "fp32"),
        (AMP_TYPE.APEX, "O1"),
    ],
)
def test_spellings_of_a_mode(spec, name) -> None:
    assert to_policy(spec).name == name


def test_dtype_switch_drops_scaling_for_bf16_only() -> None:
    naive_bf16 = to_policy({"mode": AMP_TYPE.NAIVE, "dtype": "bfloat16"})
    assert naive_bf16.param_dtype == torch.bfloat16 and not naive_bf16.loss_scale.dynamic
    fp16 = to_policy("bf16", {"dtype": torch.float16})
    assert fp16.compute_dtype == torch.float16
    kept = to_policy({"mode": AMP_TYPE.TORCH, "dtype": "bfloat16", "init_scale": 8.0})
    assert kept.compute_dtype == torch.bfloat16 and kept.loss_scale.init_scale == 8.0


def test_torch_config_keys_reach_the_scaler() -> None:
    p = to_policy(
        {"mode": AMP_TYPE.TORCH, "init_scale": 2.0**8, "growth_interval": 7, "hysteresis": 2}
    )
    assert (p.loss_scale.init_scale, p.loss_scale.growth_interval, p.loss_scale.hysteresis) == (
        256.0,
        7,
        2,
    )
    assert not to_policy({"mode": AMP_TYPE.TORCH, "enabled": False}).loss_scale.dynamic


def test_naive_config_keys() -> None:
    p = to_policy(
        {
            "mode": AMP_TYPE.NAIVE,
            "initial_scale": 2**16,
            "log_num_zeros_in_grad": True,
            "verbose": True,
        }
    )
    assert p.loss_scale.init_scale == 2**16 and p.log_num_zeros_in_grad


@pytest.mark.parametrize(
    "spec, config, error, match",
    [
        ("fp17", None, ValueError, "Unknown mixed-precision mode 'fp17'. Did you mean 'fp16'"),
        ({"opt_level": "O2"}, None, ValueError, "needs a 'mode' key"),
        (3.5, None, TypeError, "a dict or a Policy, got 3.5"),
        ("fp32", {"dtype": "bfloat16"}, ValueError, "has no low-precision dtype"),
        ("bf16", {"dtyp": "bfloat16"}, ValueError, "key 'dtyp'. Did you mean 'dtype'"),
        ({"mode": AMP_TYPE.TORCH}, {"a": 1}, ValueError, "inside the dict"),
        ({"mode": AMP_TYPE.TORCH, "enabled": "yes"}, None, TypeError, "enabled must be a bool"),
        (
            {"mode": AMP_TYPE.APEX, "opt_level": "O1", "cast_model_type": torch.float16},
            None,
            ValueError,
            "O1 casts",
        ),
        (
            {"mode": AMP_TYPE.APEX, "opt_level": "O1", "keep_batchnorm_fp32": True},
            None,
            ValueError,
            "batchnorm",
        ),
        (
            {"mode": AMP_TYPE.APEX, "opt_level": "O0", "master_weights": True},
            None,
            ValueError,
            "fp32 model weights",
        ),
        ({"mode": AMP_TYPE.APEX, "loss_scale": "auto"}, None, ValueError, "'dynamic' or a number"),
        (
            {"mode": AMP_TYPE.APEX, "keep_batchnorm_fp32": "yes", "opt_level": "O2"},
            None,
            TypeError,
            "'True', 'False'",
        ),
    ],
)
def test_bad_specs(spec, config, error, match) -> None:
    with pytest.raises(error, match=match):
        to_policy(spec, config)


def test_policy_validates_itself() -> None:
    with pytest.raises(ValueError, match="master_weights=True needs low-precision params"):
        Policy(name="x", master_weights=True)
    with pytest.raises(ValueError, match="both the white and the black list"):
        Policy(name="x", custom_white_list=frozenset({"add"}), custom_black_list=frozenset({"add"}))
    with pytest.raises(ValueError, match="param_dtype=torch.float64"):
        Policy(name="x", param_dtype=torch.float64)


def test_apex_overrides_adjust_level() -> None:
    p = to_policy(
        {
            "mode": AMP_TYPE.APEX,
            "opt_level": "O2",
            "keep_batchnorm_fp32": "False",
            "loss_scale": 128.0,
        }
    )
    assert not p.keep_norm_fp32 and p.loss_scale.init_scale == 128.0 and not p.loss_scale.dynamic
    p = to_policy(
        {
            "mode": AMP_TYPE.APEX,
            "opt_level": "O3",
            "keep_batchnorm_fp32": True,
            "cast_model_outputs": torch.float32,
        }
    )
    assert p.keep_norm_fp32 and p.cast_outputs_to == torch.float32
    p = to_policy({"mode": AMP_TYPE.APEX, "opt_level": "O2", "cast_model_type": torch.bfloat16})
    assert p.param_dtype == torch.bfloat16 and p.master_weights
    assert to_policy({"mode": AMP_TYPE.APEX, "enabled": False}).param_dtype == torch.float32
