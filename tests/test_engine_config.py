"""The config Engine parses its config once into a typed EngineConfig and builds the Booster
plugin it means; the plugin assembles policy -> (model, optimizer) as Booster.boost does."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_mlp
from torch import nn

import mixprec
from mixprec.amp import AMP_TYPE
from mixprec.booster.plugin import LowLevelZeroPlugin, Plugin, TorchDDPPlugin
from mixprec.config import EngineConfig, PipelineSection, parse_config
from mixprec.core.multi_loss import MultiLossOptimizer
from mixprec.core.policy import to_policy
from mixprec.engine.from_config import plugin_for
from mixprec.parallel.zero import ZeroConfig, ZeroOptimizer


def _initialize(config: dict) -> mixprec.Engine:
    model = tiny_mlp(8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = mixprec.initialize(model, opt, nn.MSELoss(), config=config, verbose=False)
    return engine


def test_a_config_parses_into_one_typed_frozen_object() -> None:
    config = {
        "fp16": {"mode": AMP_TYPE.NAIVE, "initial_scale": 2.0**8},
        "clip_grad_norm": 0.5,
        "gradient_accumulation": 4,
        "zero": {"level": 2},
        "parallel": {"pipeline": 2},
        "NUM_MICRO_BATCHES": 4,
        "BATCH_SIZE": 32,  # the user's key: left alone
    }
    spec = parse_config(config)
    naive = to_policy(config["fp16"])
    assert spec == EngineConfig(
        policy=dataclasses.replace(naive, max_norm=0.5),
        max_norm=0.5,
        gradient_accumulation=4,
        compile=False,
        zero=ZeroConfig(level=2),
        pipeline=PipelineSection(pp_size=2, num_microbatches=4),
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.max_norm = 1.0  # type: ignore[misc]
    assert parse_config({}) == EngineConfig(policy=to_policy(None))


def test_the_modes_own_clip_and_the_top_level_one_are_one_value() -> None:
    spec = parse_config({"fp16": {"mode": AMP_TYPE.NAIVE, "clip_grad_norm": 2.0}})
    assert spec.max_norm == spec.policy.max_norm == 2.0
    with pytest.raises(ValueError, match="Two clipping norms"):
        parse_config({"fp16": {"mode": "naive", "clip_grad_norm": 2.0}, "clip_grad_norm": 1.0})


@pytest.mark.parametrize(
    "config, world, plugin",
    [
        ({}, 1, Plugin),
        ({}, 2, TorchDDPPlugin),
        ({"zero": {"level": 1}}, 1, LowLevelZeroPlugin),
        ({"zero": {"level": 2}}, 4, LowLevelZeroPlugin),
    ],
)
def test_the_config_names_its_booster_plugin(config: dict, world: int, plugin: type) -> None:
    chosen = plugin_for(parse_config(config), world)
    assert type(chosen) is plugin


def test_zero_levels_3_is_fsdp2() -> None:
    from mixprec.booster.plugin.torch_fsdp import TorchFSDPPlugin

    assert type(plugin_for(parse_config({"zero": {"level": 3}}), 2)) is TorchFSDPPlugin


def test_zero_plugin_from_a_config_keeps_the_configs_whole_policy() -> None:
    """Any mode's policy (here Apex's O2, which Colossal's ZeRO keywords cannot name)."""
    spec = parse_config({"fp16": {"mode": AMP_TYPE.APEX, "opt_level": "O2"}, "zero": {"level": 2}})
    plugin = plugin_for(spec, 1)
    assert isinstance(plugin, LowLevelZeroPlugin)
    assert plugin.policy == spec.policy and plugin.stage == 2
    assert plugin.precision == spec.policy.name and plugin.max_norm == spec.policy.max_norm


def test_zero_plugin_policy_refuses_a_precision_keyword_beside_it() -> None:
    """policy= replaces the precision keywords in __init__: one set beside it would be ignored."""
    policy = parse_config({"fp16": {"mode": AMP_TYPE.NAIVE}}).policy
    plugin = LowLevelZeroPlugin(stage=1, cpu_offload=True, policy=policy)
    assert plugin.policy == policy and plugin.cpu_offload and plugin.precision == policy.name
    with pytest.raises(ValueError, match=r"LowLevelZeroPlugin\(precision='bf16', policy="):
        LowLevelZeroPlugin(precision="bf16", policy=policy)
    with pytest.raises(ValueError, match=r"LowLevelZeroPlugin\(max_norm=1.0, policy="):
        LowLevelZeroPlugin(max_norm=1.0, policy=policy)
    with pytest.raises(TypeError, match="must be a mixprec Policy"):
        LowLevelZeroPlugin(policy="fp16")


@pytest.mark.parametrize(
    "config, optimizer_cls",
    [
        ({"clip_grad_norm": 0.25}, mixprec.MixedPrecisionOptimizer),
        (
            {"fp16": {"mode": AMP_TYPE.NAIVE, "clip_grad_norm": 0.25}},
            mixprec.MixedPrecisionOptimizer,
        ),
        (
            {"fp16": {"mode": AMP_TYPE.APEX, "opt_level": "O2"}, "clip_grad_norm": 0.25},
            MultiLossOptimizer,
        ),
        ({"zero": {"level": 1}, "clip_grad_norm": 0.25}, ZeroOptimizer),
    ],
)
def test_the_clip_reaches_the_optimizer_through_the_policy(
    config: dict, optimizer_cls: type
) -> None:
    """No path sets max_norm behind the validator's back: each plugin reads the policy's."""
    engine = _initialize(config)
    assert isinstance(engine.optimizer, optimizer_cls)
    assert engine.optimizer.max_norm == 0.25
    # Colossal's OptimizerWrapper methods on every path, as Booster.boost gives them
    assert callable(engine.optimizer.clip_grad_by_norm)


def test_initialize_parses_the_config_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import mixprec.config as config_module

    calls = []
    real = config_module.config_to_policy
    monkeypatch.setattr(config_module, "config_to_policy", lambda c: calls.append(c) or real(c))
    _initialize({"fp16": {"mode": "bf16"}, "clip_grad_norm": 1.0})
    assert len(calls) == 1
