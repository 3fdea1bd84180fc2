"""Optimizer checkpoints in torch's layout: mixprec <-> plain torch <-> Apex, both directions.

mixprec's optimizers save torch's {'state', 'param_groups'} (of the params the inner optimizer
steps: the fp32 masters) with 'master_weights', 'scaler', 'steps' and 'skipped_steps' beside
them. Exactness is the contract here (rtol=0, atol=0): every transfer is a copy, no arithmetic.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import tiny_mlp
from tolerances import EXACT

from mixprec import MixedPrecisionOptimizer, cast_module
from mixprec.apex import amp
from mixprec.core.policy import ScalerConfig

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

TORCH_KEYS = {"state", "param_groups"}
MIXPREC_KEYS = {"master_weights", "master_index", "scaler", "steps", "skipped_steps"}


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(torch.get_default_device()).manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, y = data(step)
    dtype = next(model.parameters()).dtype
    return torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y)


def mixprec_run(steps: int) -> tuple[torch.nn.Module, MixedPrecisionOptimizer]:
    torch.manual_seed(0)
    model = cast_module(tiny_mlp(), torch.bfloat16)
    opt = MixedPrecisionOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), loss_scale=ScalerConfig(init_scale=64.0)
    )
    for step in range(steps):
        opt.zero_grad()
        opt.backward(loss_of(model, step))
        opt.step()
    return model, opt


def test_layout_is_torchs_with_mixprec_additions_beside_it() -> None:
    _, opt = mixprec_run(2)
    state = opt.state_dict()
    assert set(state) == TORCH_KEYS | MIXPREC_KEYS
    inner = opt.optim.state_dict()
    torch.testing.assert_close(state["state"], inner["state"], **EXACT)
    assert state["param_groups"] == inner["param_groups"]
    assert [m.dtype for m in state["master_weights"]] == [torch.float32] * len(opt.hp_masters)


def test_mixprec_checkpoint_loads_into_a_plain_torch_optimizer() -> None:
    # The plain optimizer over fp32 copies of what mixprec steps (masters and fp32 params) gets
    # the same state, and then takes the same step from the same fp32 grads, bit for bit.
    _, opt = mixprec_run(3)
    held = [p for g in opt.param_groups for p in g["params"]]
    plain_params = [p.detach().clone().requires_grad_() for p in held]
    plain = torch.optim.Adam(plain_params, lr=0.5)  # other hyperparameters: the checkpoint wins
    plain.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch shares tensors otherwise
    assert plain.param_groups[0]["lr"] == 1e-2
    torch.testing.assert_close(
        plain.state_dict()["state"], opt.optim.state_dict()["state"], **EXACT
    )
    for p, q in zip(held, plain_params, strict=True):
        p.grad = q.grad = torch.full_like(p, 0.125)
    opt.optim.step()
    plain.step()
    torch.testing.assert_close(plain_params, held, **EXACT)


def test_plain_torch_checkpoint_loads_into_mixprec_and_rebuilds_the_masters(caplog) -> None:
    # A plain fp32 run's checkpoint has no masters: mixprec takes them from the model it was
    # loaded into (bf16 here, as Apex did), says so once, and keeps the optimizer state.
    torch.manual_seed(0)
    fp32_model = tiny_mlp()
    plain = torch.optim.Adam(fp32_model.parameters(), lr=1e-2)
    for step in range(3):
        plain.zero_grad()
        loss_of(fp32_model, step).backward()
        plain.step()
    torch.manual_seed(1)  # another init: everything must come from the checkpoints
    model = cast_module(tiny_mlp(), torch.bfloat16)
    opt = MixedPrecisionOptimizer(torch.optim.Adam(model.parameters(), lr=0.5))
    model.load_state_dict(fp32_model.state_dict())
    with caplog.at_level(logging.INFO, logger="mixprec"):
        opt.load_state_dict(plain.state_dict())
    said = [r.getMessage() for r in caplog.records if "no fp32 master weights" in r.getMessage()]
    n = len(opt.hp_masters)
    assert len(said) == 1 and f"for {n} of this optimizer's {n}" in said[0]
    torch.testing.assert_close(opt.hp_masters, [lp.float() for lp in opt.lp_params], **EXACT)
    torch.testing.assert_close(
        opt.optim.state_dict()["state"], plain.state_dict()["state"], **EXACT
    )
    assert (opt.steps, opt.skipped_steps, opt.loss_scale) == (0, 0, 1.0)  # kept its own
    opt.backward(loss_of(model, 3))
    assert not opt.step().skipped


def test_older_mixprec_layout_still_loads() -> None:
    _, opt = mixprec_run(3)
    new = opt.state_dict()
    older = MIXPREC_KEYS - {"master_index"}  # the nested layout had no master_index
    old = {k: new[k] for k in older} | {"optimizer": {k: new[k] for k in TORCH_KEYS}}
    _, fresh = mixprec_run(1)
    fresh.load_state_dict(copy.deepcopy(old))
    torch.testing.assert_close(fresh.state_dict(), new, **EXACT)
    with pytest.raises(KeyError, match="Not an optimizer checkpoint.*got keys \\['masters'\\]"):
        fresh.load_state_dict({"masters": []})


def test_checkpoint_moves_between_modes_with_and_without_masters(caplog) -> None:
    # bf16 + masters -> fp32: each saved master lands on its param, exactly (Apex O2 -> O1).
    model, opt = mixprec_run(3)
    saved = copy.deepcopy(opt.state_dict())
    torch.manual_seed(1)
    fp32_model = tiny_mlp()
    fp32_opt = MixedPrecisionOptimizer(torch.optim.Adam(fp32_model.parameters(), lr=0.5))
    fp32_model.load_state_dict(model.state_dict())  # the norm's fp32 params come from here
    fp32_opt.load_state_dict(copy.deepcopy(saved))  # the bf16 layers' exact values from here
    held = [p for g in opt.param_groups for p in g["params"]]
    fp32_held = [p for g in fp32_opt.param_groups for p in g["params"]]
    torch.testing.assert_close(fp32_held, held, **EXACT)
    # fp32 -> bf16 + masters: the checkpoint has none, so they come from the bf16 model (O1 -> O2):
    # masters that round to their params are that model's own fp32 values and stay (the model
    # may have been loaded first, with booster.load_model); params loaded apart from their
    # masters (a plain load_state_dict) make the masters be rebuilt from them, at WARNING.
    bf16_model, bf16_opt = mixprec_run(1)
    own = [m.clone() for m in bf16_opt.hp_masters]
    with caplog.at_level(logging.INFO, logger="mixprec"):
        bf16_opt.load_state_dict(fp32_opt.state_dict())
    assert not any("rebuilt them from" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(bf16_opt.hp_masters, own, **EXACT)
    bf16_model.load_state_dict(fp32_model.state_dict())
    with caplog.at_level(logging.INFO, logger="mixprec"):
        bf16_opt.load_state_dict(fp32_opt.state_dict())
    rebuilt = [r for r in caplog.records if "rebuilt them from" in r.getMessage()]
    assert len(rebuilt) == 1 and rebuilt[0].levelname == "WARNING"
    lp_as_fp32 = [lp.float() for lp in bf16_opt.lp_params]
    torch.testing.assert_close(bf16_opt.hp_masters, lp_as_fp32, **EXACT)


# ----- Apex's amp -----
def o2_model_and_opt(seed: int, state: dict | None = None, verbosity: int = 0):
    torch.manual_seed(seed)
    model = tiny_mlp(width=8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if state is not None:  # Apex's other order: load into the plain optimizer, then initialize
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    return amp.initialize(model, opt, opt_level="O2", max_loss_scale=2.0**10, verbosity=verbosity)


def o2_steps(model, opt, steps) -> None:
    for step in steps:
        opt.zero_grad()
        with amp.scale_loss(loss_of(model, step), opt) as scaled:
            scaled.backward()
        opt.step()


def test_apex_optimizer_checkpoint_is_torch_layout_and_loads_before_initialize(caplog) -> None:
    model, opt = o2_model_and_opt(0)
    o2_steps(model, opt, range(3))
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    assert set(saved["optimizer"]) == TORCH_KEYS | MIXPREC_KEYS
    with caplog.at_level(logging.INFO, logger="mixprec"):
        model2, opt2 = o2_model_and_opt(1, state=copy.deepcopy(saved), verbosity=1)
    inner = opt2.optim.state_dict()
    torch.testing.assert_close(inner["state"], saved["optimizer"]["state"], **EXACT)
    assert inner["param_groups"] == saved["optimizer"]["param_groups"]
    # masters come from the (fp16) model, as in Apex; loading after initialize restores them
    torch.testing.assert_close(opt2.hp_masters, [lp.float() for lp in opt2.lp_params], **EXACT)
    assert any("built from the model" in r.getMessage() for r in caplog.records)
    o2_steps(model2, opt2, range(3, 5))
    assert opt2.steps == 2


def test_apex_checkpoint_without_masters_loads_after_initialize(caplog) -> None:
    # What Apex's amp optimizer saved: plain torch layout over the masters, nothing beside it.
    model, opt = o2_model_and_opt(0)
    o2_steps(model, opt, range(3))
    apex_saved = {k: v for k, v in opt.state_dict().items() if k in TORCH_KEYS}
    model_saved = model.state_dict()
    model2, opt2 = o2_model_and_opt(1)
    model2.load_state_dict(model_saved)
    with caplog.at_level(logging.INFO, logger="mixprec"):
        opt2.load_state_dict(apex_saved)
    assert any("no fp32 master weights" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(opt2.hp_masters, [lp.float() for lp in opt2.lp_params], **EXACT)
    torch.testing.assert_close(opt2.optim.state_dict()["state"], apex_saved["state"], **EXACT)
    o2_steps(model2, opt2, range(3, 5))


def test_apex_o2_checkpoint_restores_into_o1_with_the_exact_masters() -> None:
    # Apex's test_restoring crosses opt levels; here O1's fp32 params take O2's saved masters.
    model, opt = o2_model_and_opt(0)
    o2_steps(model, opt, range(3))
    saved = {"model": model.state_dict(), "optimizer": copy.deepcopy(opt.state_dict())}
    torch.manual_seed(1)
    o1_model = tiny_mlp(width=8)
    o1_model, o1_opt = amp.initialize(
        o1_model, torch.optim.Adam(o1_model.parameters(), lr=1e-2), opt_level="O1", verbosity=0
    )
    o1_model.load_state_dict(saved["model"])
    o1_opt.load_state_dict(saved["optimizer"])
    torch.testing.assert_close(
        list(amp.master_params(o1_opt)), list(amp.master_params(opt)), **EXACT
    )
    o2_steps(o1_model, o1_opt, range(3, 5))
