"""Apex's cast registry and decorators under O1, and apex.parallel.DistributedDataParallel."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from dist_utils import assert_same_on_every_rank, spawn

from mixprec.apex import amp, functions
from mixprec.apex.parallel import DistributedDataParallel

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

ORIGINAL_MM = torch.mm
ORIGINAL_SIGMOID = torch.sigmoid


@pytest.fixture(autouse=True)
def clean_registry():
    yield
    functions.restore_functions()
    functions._registry.clear()
    assert torch.mm is ORIGINAL_MM and torch.sigmoid is ORIGINAL_SIGMOID


class MmNet(torch.nn.Module):
    """Calls torch functions by attribute, as user code does, so patches are seen."""

    def __init__(self, ops: object = torch) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.ops = ops

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.ops.mm(x, self.w)
        return y, torch.sigmoid(x)


def _o1(model: torch.nn.Module) -> torch.nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    return model


def test_o1_without_registration_runs_autocasts_choice() -> None:
    model = _o1(MmNet())
    y, s = model(torch.randn(4, 8))
    assert y.dtype == torch.float16 and s.dtype == torch.float32  # autocast: mm low, sigmoid as is


def test_registered_float_and_half_functions_decide_the_dtype() -> None:
    amp.register_float_function(torch, "mm")
    amp.register_half_function(torch, "sigmoid")
    model = _o1(MmNet())
    x = torch.randn(4, 8)
    y, s = model(x)
    assert y.dtype == torch.float32 and s.dtype == torch.float16
    # the same math as raw torch in those dtypes: exact
    torch.testing.assert_close(y, ORIGINAL_MM(x, model.w.detach()), rtol=0, atol=0)
    torch.testing.assert_close(s, ORIGINAL_SIGMOID(x.half()), rtol=0, atol=0)
    # outside an autocast region (outside the model's forward) the patch casts nothing
    assert torch.mm(x, model.w).dtype == torch.float32
    assert torch.sigmoid(x).dtype == torch.float32
    # an initialize that does not patch (O0) puts the originals back
    amp.initialize(MmNet(), opt_level="O0", verbosity=0)
    assert torch.mm is ORIGINAL_MM and torch.sigmoid is ORIGINAL_SIGMOID


def test_registered_promote_function_casts_to_the_widest_input(device: str) -> None:
    ops = types.SimpleNamespace(mm=ORIGINAL_MM)
    model = _o1(MmNet(ops))  # registering while a patching amp is live patches at once
    x16 = torch.randn(4, 8).half()
    w = model.w.detach()
    with torch.autocast(device, dtype=torch.float16):
        assert ops.mm(x16, w).dtype == torch.float16  # autocast's choice
    amp.register_promote_function(ops, "mm")
    with torch.autocast(device, dtype=torch.float16):
        out = ops.mm(x16, w)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ORIGINAL_MM(x16.float(), w), rtol=0, atol=0)


def test_decorators_cast_inside_o1_regions_only(device: str) -> None:
    @amp.half_function
    def scaled_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * 2 + b

    @amp.float_function
    def log_softmax(a: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(a, dim=-1)

    a, b = torch.randn(3), torch.randn(3)
    assert scaled_sum(a, b).dtype == torch.float32  # no region: untouched
    with torch.autocast(device, dtype=torch.bfloat16):
        assert scaled_sum(a, b).dtype == torch.bfloat16  # the region's low dtype
        assert log_softmax(a.bfloat16()).dtype == torch.float32
    torch.testing.assert_close(
        log_softmax(a.bfloat16()), torch.log_softmax(a.bfloat16(), dim=-1), rtol=0, atol=0
    )


def test_registry_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"No function named 'nope' in module"):
        amp.register_half_function(torch, "nope")
    amp.register_half_function(torch, "sigmoid")
    with pytest.raises(ValueError, match=r"already registered as a half function"):
        amp.register_float_function(torch, "sigmoid")
    with pytest.raises(TypeError, match=r"is not callable"):
        amp.half_function(3)


# ----- apex.parallel.DistributedDataParallel -----


def _master_grads(rank: int, **ddp_kwargs: object) -> list[torch.Tensor]:
    torch.manual_seed(0)  # the same model on every rank and for every variant
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    model = DistributedDataParallel(model, **ddp_kwargs)
    g = torch.Generator(torch.get_default_device()).manual_seed(rank)  # each rank its own batch
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    with amp.scale_loss(torch.nn.functional.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    return [m.grad.clone() for m in opt.hp_masters]


def _ddp_after_initialize(rank: int, world: int) -> None:
    default = _master_grads(rank)
    # Apex's arithmetic variants on 2 ranks: scaling by powers of two is exact
    variants = {
        "delay_allreduce": (_master_grads(rank, delay_allreduce=True), 1.0),
        "predivide": (_master_grads(rank, gradient_predivide_factor=2.0), 1.0),
        "fp32 allreduce": (_master_grads(rank, allreduce_always_fp32=True), 1.0),
        "sum": (_master_grads(rank, gradient_average=False), float(world)),
    }
    for name, (grads, factor) in variants.items():
        for got, ref in zip(grads, default, strict=True):
            torch.testing.assert_close(got, ref * factor, rtol=0, atol=0, msg=name)
    assert_same_on_every_rank(default, "averaged master grads")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    model = DistributedDataParallel(model)
    g = torch.Generator(torch.get_default_device()).manual_seed(10 + rank)
    losses = []
    for _ in range(4):
        x = torch.randn(8, 8, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x[:, :4])
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert_same_on_every_rank([*opt.hp_masters, *model.parameters()], "params after training")
    with pytest.raises(TypeError, match=r"already a DistributedDataParallel"):
        DistributedDataParallel(model)
    assert dist.get_world_size() == world


@pytest.mark.distributed
def test_apex_ddp_trains_on_two_ranks_after_initialize() -> None:
    spawn(_ddp_after_initialize, 2)
