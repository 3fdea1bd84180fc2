"""The eager step's masked update (mixprec.core.sync_free): any optimizer skips an overflowed
step on the device, with no host read of the overflow flag, bit for bit as the syncing step.

Forced on CPU (`_sync_free = True`; it is the default on CUDA), against the same run with the
flag read on the host (`_sync_free = False`)."""

from __future__ import annotations

import pytest
import torch
from conftest import CountHostSyncs, tiny_mlp
from tolerances import EXACT

from mixprec.core.casting import cast_module
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import ScalerConfig
from mixprec.core.sync_free import MaskedStep, blocker

pytestmark = pytest.mark.usefixtures("device")

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd_nesterov": lambda ps: torch.optim.SGD(
        ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01
    ),
    "sgd_dampening_forloop": lambda ps: torch.optim.SGD(
        ps, lr=0.05, momentum=0.9, dampening=0.1, foreach=False
    ),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adam_amsgrad_forloop": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=False),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "rmsprop_centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, centered=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "adadelta": lambda ps: torch.optim.Adadelta(ps),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
}
PATTERN = [True, False, True, True, True, False, False]
"""bad, clean, bad, bad, bad, then clean: a first step that creates no state, the step that
creates it, skips over existing state, and steps after them (growth every 2 clean steps)."""


def _forced() -> bool | None:
    """Forced where it is off by default (CPU); the default where it is on (CUDA)."""
    return True if torch.get_default_device().type == "cpu" else None


def run(make, *, sync_free: bool | None, overflows: list[bool], dtype=torch.float16, **kw):
    """A model (fp16 with fp32 masters, or fp32 stepped directly) stepped through overflows (an
    inf input); the same seed and batches whichever path runs."""
    torch.manual_seed(0)
    model = cast_module(tiny_mlp(norm=False), dtype)
    cfg = ScalerConfig(init_scale=2.0**8, growth_interval=2, hysteresis=1)
    opt = MixedPrecisionOptimizer(make(model.parameters()), loss_scale=cfg, **kw)
    opt._sync_free = sync_free
    results = []
    for bad in overflows:
        opt.zero_grad()
        x, y = torch.randn(16, 8, dtype=dtype), torch.randint(0, 4, (16,))
        if bad:
            x[0, 0] = float("inf")
        opt.backward(torch.nn.functional.cross_entropy(model(x).float(), y))
        results.append(opt.step())
    return model, opt, results


def assert_same_run(a, b) -> None:
    """Params, masters, every optimizer state tensor (step counts too; a state that a skipped
    step must not have created is absent alike), results, scale and counters: bit for bit."""
    (model_a, opt_a, results_a), (model_b, opt_b, results_b) = a, b
    for x, y in zip(
        [*model_a.parameters(), *opt_a.hp_masters],
        [*model_b.parameters(), *opt_b.hp_masters],
        strict=True,
    ):
        torch.testing.assert_close(x, y, **EXACT)
    state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for index, entry in state_a.items():
        assert entry.keys() == state_b[index].keys()
        for key, value in entry.items():
            torch.testing.assert_close(value, state_b[index][key], **EXACT)
    assert [r.skipped for r in results_a] == [r.skipped for r in results_b]
    assert [r.scale for r in results_a] == [r.scale for r in results_b]
    # an overflowed step's norm is inf or nan on both paths (nan != nan: compared as text)
    assert [repr(r.grad_norm) for r in results_a] == [repr(r.grad_norm) for r in results_b]
    assert opt_a.loss_scale == opt_b.loss_scale
    assert opt_a.skip_stats == opt_b.skip_stats


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_masked_step_equals_the_syncing_one_bitwise(name: str) -> None:
    """Every optimizer kind over bad/clean/bad/bad/bad/clean/clean with fp32 masters."""
    runs = [run(OPTIMIZERS[name], sync_free=f, overflows=PATTERN) for f in (False, _forced())]
    assert_same_run(*runs)
    assert [r.skipped for r in runs[1][2]] == PATTERN
    assert runs[1][1].skipped_steps == sum(PATTERN)


@pytest.mark.parametrize("name", ["sgd_nesterov", "adamw", "rmsprop_centered"])
def test_masked_step_of_fp32_params_with_clipping_equals_the_syncing_one(name: str) -> None:
    """fp32 params stepped directly (no masters: the params are what is restored), clipped."""
    runs = [
        run(OPTIMIZERS[name], sync_free=f, overflows=PATTERN, dtype=torch.float32, max_norm=0.5)
        for f in (False, _forced())
    ]
    assert_same_run(*runs)
    assert runs[1][2][1].grad_norm is not None


@pytest.mark.parametrize("name", ["sgd", "sgd_nesterov", "rmsprop_centered"])
def test_masked_clean_step_reads_nothing_on_the_host(monkeypatch, name: str) -> None:
    """Once the state exists, a clean step (backward to step) makes no .item()/tolist()/bool()
    call: the skip is a device select, the counters read the record when read. (Not Adam here:
    its non-capturable step reads its own CPU step count with .item(), no device sync, as do
    Adagrad's and others'; on CUDA capturable Adam keeps it on the device: the cuda test.)"""
    if torch.get_default_device().type != "cpu":
        pytest.skip("the CPU count of host reads; tests/test_sync_free.py's cuda test on a GPU")
    model, opt, _ = run(OPTIMIZERS[name], sync_free=True, overflows=[True, False, True])
    assert opt.skipped_steps == 2  # read (and logged) before counting
    syncs = CountHostSyncs(monkeypatch)
    for _ in range(3):
        opt.zero_grad()
        x, y = torch.randn(16, 8, dtype=torch.float16), torch.randint(0, 4, (16,))
        opt.backward(torch.nn.functional.cross_entropy(model(x).float(), y))
        opt.step()
    assert syncs.calls == []
    assert opt.skipped_steps == 2 and opt.steps == 6
    assert syncs.calls == ["tolist"]  # the record's one read


def test_the_step_that_creates_state_reads_the_flag_once(monkeypatch) -> None:
    """A first step creates RMSprop's state: whether it stays depends on the flag, so that step
    reads it (one .item()); a skipped first step leaves no state, as the syncing step."""
    if torch.get_default_device().type != "cpu":
        pytest.skip("the CPU count of host reads")
    syncs = CountHostSyncs(monkeypatch)
    _, opt, _ = run(OPTIMIZERS["rmsprop_centered"], sync_free=True, overflows=[True])
    assert syncs.calls == ["item"] and opt.optim.state_dict()["state"] == {}
    assert opt.skipped_steps == 1


def test_blocker_names_state_off_the_flags_device() -> None:
    """A CPU step count restored by a CUDA flag would be a device -> host copy: refused, with
    the way out named (host facts only; shown with a step count on the meta device)."""
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([param], lr=0.1)
    param.grad = torch.ones(3)
    opt.step()
    assert blocker(opt, param.device) is None
    opt.state[param]["step"] = torch.tensor(1.0, device="meta")
    reason = blocker(opt, param.device)
    assert reason is not None and "'step' is a Tensor on meta" in reason
    assert "capturable=True or fused=True" in reason


def test_masked_step_restores_a_replaced_state_object() -> None:
    """An optimizer that swaps a state tensor for a new object (not in place) is put back on a
    skip: the old object, its old value."""

    class Swapping(torch.optim.SGD):
        def step(self, closure=None):
            for p in self.param_groups[0]["params"]:
                self.state[p]["acc"] = self.state[p]["acc"] + p.grad
                p.data.add_(p.grad, alpha=-1.0)

    param = torch.nn.Parameter(torch.ones(2))
    opt = Swapping([param], lr=0.1)
    acc = opt.state[param]["acc"] = torch.zeros(2)
    param.grad = torch.full((2,), float("inf"))
    with torch.no_grad():
        MaskedStep(opt)(torch.ones(1))
    assert opt.state[param]["acc"] is acc and torch.equal(acc, torch.zeros(2))
    assert torch.equal(param, torch.ones(2))
    param.grad = torch.ones(2)
    with torch.no_grad():
        MaskedStep(opt)(torch.zeros(1))
    assert torch.equal(opt.state[param]["acc"], torch.ones(2))
    assert torch.equal(param, torch.zeros(2))


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["sgd_nesterov", "adam_capturable", "rmsprop_centered"])
def test_masked_step_on_cuda_makes_no_host_sync(name: str) -> None:
    """On by default on CUDA: torch's sync debug mode turns any sync into an error."""
    make = {
        **OPTIMIZERS,
        "adam_capturable": lambda ps: torch.optim.Adam(ps, lr=1e-3, capturable=True),
    }[name]
    torch.manual_seed(0)
    model = cast_module(tiny_mlp(norm=False), torch.float16).cuda()
    opt = MixedPrecisionOptimizer(
        make(model.parameters()), loss_scale=ScalerConfig(init_scale=2.0**8)
    )
    x, y = torch.randn(16, 8, device="cuda").half(), torch.randint(0, 4, (16,), device="cuda")
    for _ in range(2):  # the first step creates the optimizer state (one read)
        opt.zero_grad()
        opt.backward(torch.nn.functional.cross_entropy(model(x).float(), y))
        opt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.zero_grad()
        opt.backward(torch.nn.functional.cross_entropy(model(x).float(), y))
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.skipped_steps == 0 and opt.steps == 3
