"""Apex's internals that scripts touch: `amp._amp_state.loss_scalers[i]._loss_scale`,
`opt_properties`, `handle`, and the `amp.frontend` / `amp._amp_state` module paths.

Exact tests: power-of-two weights, inputs and scales (see test_apex_dropin), so every scaled
gradient and update is exact and compared with rtol=0, atol=0.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from test_apex_dropin import LR, A, X, expected_weight, linear
from tolerances import EXACT

from mixprec.apex import amp


def sgd(model: torch.nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=LR)


def test_setting_loss_scale_sets_the_scale_the_next_backward_uses_and_stays_dynamic() -> None:
    model = linear()
    model, opt = amp.initialize(model, sgd(model), opt_level="O2", verbosity=0)
    amp._amp_state.loss_scalers[0]._loss_scale = 4.0  # as published fine-tuning scripts do
    assert amp._amp_state.loss_scalers[0].loss_scale() == 4.0 == opt.scaler.scale
    loss = (model(X.half()).float() * A).sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.item() == loss.item() * 4.0  # the loss is scaled by the value set
        scaled.backward()
    opt.step()
    torch.testing.assert_close(model.weight.float(), expected_weight(1), **EXACT)
    assert amp._amp_state.loss_scalers[0].dynamic
    opt.zero_grad()
    with amp.scale_loss((model(X.half()).float() * A).sum() * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()  # skipped
    assert amp._amp_state.loss_scalers[0]._loss_scale == 2.0  # dynamic: halved from the set 4
    torch.testing.assert_close(model.weight.float(), expected_weight(1), **EXACT)


def test_setting_a_static_scale_changes_it_and_it_stays_static() -> None:
    model = linear()
    model, opt = amp.initialize(model, sgd(model), opt_level="O2", loss_scale=8.0, verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    scaler._loss_scale = 2**3 * 2  # an int, as scripts write it
    assert scaler.loss_scale() == 16.0 and not scaler.dynamic
    with amp.scale_loss((model(X.half()).float() * A).sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert scaler.loss_scale() == 16.0
    torch.testing.assert_close(model.weight.float(), expected_weight(1), **EXACT)


def test_each_loss_scaler_is_set_on_its_own() -> None:
    model = linear()
    model, opt = amp.initialize(model, sgd(model), opt_level="O2", num_losses=2, verbosity=0)
    amp._amp_state.loss_scalers[0]._loss_scale = 4.0
    amp._amp_state.loss_scalers[1]._loss_scale = 16.0
    assert [s.scale for s in opt.scalers] == [4.0, 16.0]
    assert amp._amp_state.loss_scalers[1]._unskipped == 0
    assert amp._amp_state.loss_scalers[1]._max_loss_scale == 2.0**24
    assert amp._amp_state.loss_scalers[1]._min_loss_scale is None  # Apex's default: no floor


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), "4", True, None])
def test_a_bad_loss_scale_is_refused_naming_it(bad) -> None:
    model = linear()
    amp.initialize(model, sgd(model), opt_level="O2", verbosity=0)
    with pytest.raises(ValueError, match="_loss_scale=.*finite number > 0"):
        amp._amp_state.loss_scalers[0]._loss_scale = bad


def test_other_scaler_fields_and_the_scaler_list_are_not_silently_settable() -> None:
    model = linear()
    amp.initialize(model, sgd(model), opt_level="O2", verbosity=0)
    with pytest.raises(AttributeError, match="only _loss_scale"):
        amp._amp_state.loss_scalers[0]._max_loss_scale = 2.0
    with pytest.raises(TypeError):  # a replaced scaler would never reach the optimizer
        amp._amp_state.loss_scalers[0] = None  # type: ignore[index]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            {"opt_level": "O0"},
            {"cast_model_type": torch.float32, "patch_torch_functions": False,
             "keep_batchnorm_fp32": None, "master_weights": False, "loss_scale": 1.0},
        ),
        (
            {"opt_level": "O1"},
            {"cast_model_type": None, "patch_torch_functions": True,
             "keep_batchnorm_fp32": None, "master_weights": None, "loss_scale": "dynamic"},
        ),
        (
            {"opt_level": "O2"},
            {"cast_model_type": torch.float16, "patch_torch_functions": False,
             "keep_batchnorm_fp32": True, "master_weights": True, "loss_scale": "dynamic"},
        ),
        (
            {"opt_level": "O3"},
            {"cast_model_type": torch.float16, "patch_torch_functions": False,
             "keep_batchnorm_fp32": False, "master_weights": False, "loss_scale": 1.0},
        ),
        (
            {"opt_level": "O2", "keep_batchnorm_fp32": "False", "loss_scale": "128.0"},
            {"cast_model_type": torch.float16, "patch_torch_functions": False,
             "keep_batchnorm_fp32": False, "master_weights": True, "loss_scale": 128.0},
        ),
        (
            {"opt_level": "O3", "loss_scale": "dynamic", "cast_model_type": torch.bfloat16},
            {"cast_model_type": torch.bfloat16, "patch_torch_functions": False,
             "keep_batchnorm_fp32": False, "master_weights": False, "loss_scale": "dynamic"},
        ),
    ],
)  # fmt: skip
def test_opt_properties_are_apexs_fields_for_the_level_and_overrides(kwargs, expected) -> None:
    model = linear()
    model, opt = amp.initialize(model, sgd(model), verbosity=0, **kwargs)
    props = amp._amp_state.opt_properties
    assert dict(props.options) == {"enabled": True, "opt_level": kwargs["opt_level"], **expected}
    assert props.opt_level == kwargs["opt_level"] and props.loss_scale == expected["loss_scale"]
    # the properties say what was built
    assert (len(opt.hp_masters) > 0) == bool(props.master_weights)
    assert opt.scaler.dynamic == (props.loss_scale == "dynamic")
    cast = props.cast_model_type
    assert model.weight.dtype == (torch.float32 if cast is None else cast)


def test_opt_properties_are_read_only_and_disabled_amp_reports_apexs_defaults() -> None:
    model = linear()
    amp.initialize(model, sgd(model), opt_level="O2", verbosity=0)
    with pytest.raises(AttributeError, match="pass loss_scale=1.0 to amp.initialize"):
        amp._amp_state.opt_properties.loss_scale = 1.0
    with pytest.raises(AttributeError, match="no field 'fused_optimizer'"):
        _ = amp._amp_state.opt_properties.fused_optimizer
    amp.initialize(linear(), opt_level="O2", enabled=False)
    props = amp._amp_state.opt_properties
    assert not props.enabled and props.opt_level is None and props.loss_scale == 1.0


def test_the_frontend_and_amp_state_module_paths_hold_the_same_state() -> None:
    frontend = importlib.import_module("mixprec.apex.amp.frontend")
    state_module = importlib.import_module("mixprec.apex.amp._amp_state")
    assert frontend._amp_state is amp._amp_state is state_module._amp_state
    model = linear()
    model, opt = amp.initialize(model, sgd(model), opt_level="O2", num_losses=2, verbosity=0)
    frontend._amp_state.loss_scalers[1]._loss_scale = 8.0
    assert opt.scalers[1].scale == 8.0
    assert frontend._amp_state.opt_properties.opt_level == "O2"
    assert list(state_module.master_params(opt)) == list(amp.master_params(opt))


def test_handle_is_active_for_o1_and_deactivate_turns_its_casts_off() -> None:
    model = linear()
    model, _ = amp.initialize(model, sgd(model), opt_level="O1", verbosity=0)
    handle = amp._amp_state.handle
    assert handle.is_active()
    assert model(X).dtype == torch.float16  # O1: the linear runs under autocast
    with amp.disable_casts():
        assert not handle.is_active()
        assert model(X).dtype == torch.float32
    assert handle.is_active() and model(X).dtype == torch.float16
    handle._deactivate()  # Apex's tests end each O1 run so: torch functions unpatched
    assert not handle.is_active() and model(X).dtype == torch.float32
    model2 = linear()
    amp.initialize(model2, sgd(model2), opt_level="O2", verbosity=0)
    assert not amp._amp_state.handle.is_active()  # no patched functions below O1


def test_disable_casts_inside_a_running_o1_forward() -> None:
    class TwoLinears(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = linear(), linear()

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            with amp.disable_casts():  # Apex's pattern: one region in fp32
                kept = self.b(x)
            return self.a(x), kept

    model = TwoLinears()
    model, _ = amp.initialize(model, sgd(model), opt_level="O1", verbosity=0)
    cast, kept = model(X)
    assert cast.dtype == torch.float16 and kept.dtype == torch.float32
