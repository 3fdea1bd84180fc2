"""Apex's amp.initialize options: one frozen ApexOptions, parsed once, with sentinel defaults.

A keyword the caller passes is honoured or refused whatever its value, even one equal to Apex's
default; one left out takes the opt level's own setting. The Policy, Apex's opt_properties and
the optimizer's master_weights all come from the one parsed object.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn

from mixprec.apex import amp
from mixprec.apex.policy import DEFAULTS, ApexOptions, apex_policy
from mixprec.core.keywords import Default
from mixprec.core.policy import to_policy
from mixprec.mixed_precision import FP16ApexMixedPrecision


def test_options_are_one_frozen_keyword_only_object_parsed_once():
    options = ApexOptions.parse(opt_level="O2", keep_batchnorm_fp32="False", loss_scale="128.0")
    assert options.given == {"opt_level", "keep_batchnorm_fp32", "loss_scale"}
    assert options.keep_batchnorm_fp32 is False  # Apex's "False" string, parsed once
    assert options.policy == apex_policy(opt_level="O2", keep_batchnorm_fp32="False",
                                         loss_scale="128.0")  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.opt_level = "O3"  # type: ignore[misc]
    with pytest.raises(TypeError):
        ApexOptions("O2")  # type: ignore[misc]  # keyword-only
    assert options.properties()["keep_batchnorm_fp32"] is False
    assert options.properties()["loss_scale"] == 128.0
    assert options.optimizer_master_weights() is True


def test_signatures_show_apexs_defaults_and_they_mean_not_passed():
    for fn in (amp.initialize, apex_policy, FP16ApexMixedPrecision):
        params = inspect.signature(fn).parameters
        for name, default in DEFAULTS.items():
            if name == "enabled" and name not in params:
                continue  # FP16ApexMixedPrecision has no enabled keyword
            assert params[name].default == default and isinstance(params[name].default, Default)
    assert repr(DEFAULTS["max_loss_scale"]) == repr(2.0**24)
    assert ApexOptions.parse().given == frozenset()


@pytest.mark.parametrize(
    "build",
    [
        lambda kw: apex_policy(**kw),
        lambda kw: FP16ApexMixedPrecision(**kw),
        lambda kw: to_policy("fp16_apex", kw),
        lambda kw: amp.initialize(nn.Linear(2, 2), **kw),
    ],
    ids=["apex_policy", "FP16ApexMixedPrecision", "to_policy", "amp.initialize"],
)
def test_a_scale_bound_passed_at_its_default_beside_a_static_scale_is_refused(build):
    # max_loss_scale=2**24 is Apex's default value: passed, it is the caller's, and a static
    # loss_scale has no bound to apply it to (Apex ignored it silently)
    with pytest.raises(ValueError, match=r"max_loss_scale bound a dynamic loss scale"):
        build({"opt_level": "O2", "loss_scale": 128.0, "max_loss_scale": 2.0**24})
    with pytest.raises(ValueError, match=r"min_loss_scale and max_loss_scale bound"):
        build({"opt_level": "O2", "loss_scale": 4, "min_loss_scale": 1, "max_loss_scale": 8})


def test_bounds_beside_a_levels_own_static_scale_keep_apexs_rule():
    # one call for every opt level, as Apex documents: O3's static 1.0 has no bounds to apply
    policy = apex_policy(opt_level="O3", max_loss_scale=16.0)
    assert not policy.loss_scale.dynamic and policy.loss_scale.init_scale == 1.0
    dynamic = apex_policy(opt_level="O2", loss_scale="dynamic", max_loss_scale=16.0)
    assert dynamic.loss_scale.init_scale == 16.0 and dynamic.loss_scale.max_scale == 16.0


def test_passing_apexs_none_is_the_levels_own_value_as_in_apex():
    # Apex's overrides take None as "not overridden": passing it changes nothing
    assert apex_policy(opt_level="O2", keep_batchnorm_fp32=None, master_weights=None) == (
        apex_policy(opt_level="O2")
    )
    assert FP16ApexMixedPrecision().policy == apex_policy() == ApexOptions.parse().policy
    assert apex_policy(opt_level="O2").param_dtype == torch.float16
