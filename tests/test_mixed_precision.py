"""The five MixedPrecision classes: seed 003's signatures over mixprec's one Policy vocabulary."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import tiny_mlp

from mixprec.amp_type import naive_amp_policy, torch_amp_policy
from mixprec.apex.policy import apex_policy
from mixprec.core.keywords import Default
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import MODES, ScalerConfig, to_policy
from mixprec.core.prepare import FP32Criterion, PrecisionModule
from mixprec.mixed_precision import (
    MODE_TO_PRECISION,
    BF16MixedPrecision,
    FP8MixedPrecision,
    FP16ApexMixedPrecision,
    FP16NaiveMixedPrecision,
    FP16TorchMixedPrecision,
    MixedPrecision,
    to_mixed_precision,
)

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")


def _defaults(cls: type) -> dict[str, object]:
    """Each keyword's default as the signature shows it (a Default: the value it stands for)."""
    params = inspect.signature(cls).parameters.items()
    return {n: p.default.value if isinstance(p.default, Default) else p.default for n, p in params}


def test_seed_003_signatures() -> None:
    # The defaults the seed documents, as users read them in the signature.
    assert _defaults(FP16TorchMixedPrecision) == {
        "init_scale": 2.0**16,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
    }
    apex = _defaults(FP16ApexMixedPrecision)
    assert apex["opt_level"] == "O1" and apex["max_loss_scale"] == 2.0**24
    assert apex["num_losses"] == 1 and apex["verbosity"] == 1
    assert all(apex[k] is None for k in ("cast_model_type", "loss_scale", "min_loss_scale"))
    naive = list(_defaults(FP16NaiveMixedPrecision))
    assert naive[:7] == [
        "log_num_zeros_in_grad",
        "initial_scale",
        "growth_factor",
        "backoff_factor",
        "hysteresis",
        "max_scale",
        "verbose",
    ]
    assert _defaults(BF16MixedPrecision) == {}
    assert all(d is None for d in _defaults(FP8MixedPrecision).values())


def test_defaults_are_the_policy_presets() -> None:
    assert FP16TorchMixedPrecision().policy == torch_amp_policy({})
    assert FP16TorchMixedPrecision().policy.loss_scale == ScalerConfig()
    assert FP16NaiveMixedPrecision().policy == naive_amp_policy({})
    assert FP16ApexMixedPrecision().policy == apex_policy()
    assert BF16MixedPrecision().policy == to_policy("bf16")
    assert FP8MixedPrecision().policy == to_policy("fp8")


def test_arguments_reach_the_policy() -> None:
    torch_scale = FP16TorchMixedPrecision(init_scale=2.0**10, growth_interval=7).policy.loss_scale
    assert (torch_scale.init_scale, torch_scale.growth_interval) == (2.0**10, 7)
    naive = FP16NaiveMixedPrecision(
        log_num_zeros_in_grad=True, initial_scale=2.0**12, hysteresis=3, max_scale=2.0**20,
        min_scale=4.0,
    ).policy  # fmt: skip
    assert naive.log_num_zeros_in_grad
    assert (naive.loss_scale.init_scale, naive.loss_scale.hysteresis) == (2.0**12, 3)
    assert (naive.loss_scale.min_scale, naive.loss_scale.max_scale) == (4.0, 2.0**20)
    o2 = FP16ApexMixedPrecision(opt_level="O2", loss_scale=128.0).policy
    assert o2.param_dtype == torch.float16 and o2.master_weights
    assert not o2.loss_scale.dynamic and o2.loss_scale.init_scale == 128.0


def test_bad_arguments_are_reported() -> None:
    with pytest.raises(ValueError, match="'O4'"):
        FP16ApexMixedPrecision(opt_level="O4")
    with pytest.raises(ValueError, match="backoff_factor"):
        FP16TorchMixedPrecision(backoff_factor=2.0)
    with pytest.raises(ValueError, match="hysteresis"):
        FP16NaiveMixedPrecision(hysteresis=0)
    with pytest.raises(TypeError, match="Policy"):
        MixedPrecision("fp16")  # type: ignore[arg-type]


def test_configure_applies_the_core() -> None:
    model = tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    lp_model, mp_opt, criterion = FP16NaiveMixedPrecision().configure(
        model, optimizer, torch.nn.MSELoss()
    )
    assert isinstance(lp_model, PrecisionModule) and lp_model.module is model
    assert isinstance(mp_opt, MixedPrecisionOptimizer) and isinstance(criterion, FP32Criterion)
    assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32
    assert len(mp_opt.hp_masters) == 4  # two Linears' weight and bias
    assert all(m.dtype == torch.float32 for m in mp_opt.hp_masters)
    assert mp_opt.loss_scale == naive_amp_policy({}).loss_scale.init_scale


def test_fp8_filter_is_honoured_not_overridden() -> None:
    fp8 = pytest.importorskip("mixprec.fp8", reason="mixprec.fp8 not importable")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))

    def only_first(module: torch.nn.Module, fqn: str) -> bool | str:
        return True if fqn == "0" else "kept by the test's filter"

    lp_model, _, _ = FP8MixedPrecision(module_filter_fn=only_first).configure(model)
    # The core must not convert the second layer again with its default filter.
    assert isinstance(lp_model.module[0], fp8.Float8Linear)
    assert type(lp_model.module[1]) is torch.nn.Linear
    bare, _, _ = FP8MixedPrecision().configure(torch.nn.Linear(16, 16))
    assert isinstance(bare.module, fp8.Float8Linear)  # a bare Linear is replaced, not lost


def test_names_map_onto_modes() -> None:
    assert set(MODE_TO_PRECISION) == set(MODES)
    for mode in MODES:
        assert isinstance(to_mixed_precision(mode), MODE_TO_PRECISION[mode])
    instance = BF16MixedPrecision()
    assert to_mixed_precision(instance) is instance
    assert to_mixed_precision(None).policy == to_policy("fp32")
    with pytest.raises(ValueError, match="Did you mean 'bf16'"):
        to_mixed_precision("bf61")
