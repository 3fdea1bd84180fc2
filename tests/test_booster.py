"""Booster: every mode's loop against the core it must equal, skip-aware schedules, DDP, FSDP2."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_mlp

from mixprec.booster import Booster
from mixprec.booster.plugin import Plugin, TorchDDPPlugin, TorchFSDPPlugin
from mixprec.core.lr_schedule import SkipAwareLRScheduler
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import MODES
from mixprec.core.prepare import FP32Criterion, PrecisionModule, prepare_optimizer
from mixprec.mixed_precision import (
    FP16ApexMixedPrecision,
    FP16NaiveMixedPrecision,
    MixedPrecision,
    to_mixed_precision,
)

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

try:
    import mixprec.fp8  # noqa: F401

    FP8_MISSING = None
except ImportError as exc:  # written by another part of the project
    FP8_MISSING = f"mixprec.fp8 is not importable: {exc}"

WIDTH = 16  # multiples of 16 let fp8 convert the first Linear; tiny keeps fp16 CPU matmuls fast
STEPS = 6


def _data(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, 4, generator=g)


def _precision(name: str) -> str | MixedPrecision:
    # fp16_naive's default first scale (2**32) skips ~17 steps before one lands: start lower.
    if name == "fp16_naive":
        return FP16NaiveMixedPrecision(initial_scale=2.0**8)
    if name in ("O1", "O2"):
        return FP16ApexMixedPrecision(opt_level=name)
    return name


LOOP_MODES = [m for m in MODES if m != "fp16_apex"] + ["O1", "O2"]


@pytest.mark.parametrize("mode", LOOP_MODES)
def test_booster_loop_equals_core_and_learns(mode: str) -> None:
    if mode == "fp8" and FP8_MISSING:
        pytest.skip(FP8_MISSING)
    x, y = _data()
    model = tiny_mlp(WIDTH)
    ref_model = copy.deepcopy(model)

    booster = Booster(mixed_precision=_precision(mode))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.5, total_iters=STEPS)
    model, optimizer, criterion, _, scheduler = booster.boost(
        model, optimizer, torch.nn.MSELoss(), None, scheduler
    )
    assert isinstance(model, PrecisionModule)
    assert isinstance(optimizer, MixedPrecisionOptimizer)
    assert isinstance(criterion, FP32Criterion)
    losses = []
    for _ in range(STEPS):
        loss = criterion(model(x), y)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())

    # The same loop on the core by hand: the Booster must add nothing and drop nothing.
    policy = booster.mixed_precision.policy
    ref = booster.mixed_precision.convert_module(ref_model)
    ref_opt = prepare_optimizer(
        torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9), policy
    )
    ref_sched = torch.optim.lr_scheduler.LinearLR(ref_opt.optim, 1.0, 0.5, total_iters=STEPS)
    ref_loss = FP32Criterion(torch.nn.MSELoss())
    for _ in range(STEPS):
        ref_opt.backward(ref_loss(ref(x), y))
        if not ref_opt.step().skipped:
            ref_sched.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # same ops in the same order
    assert optimizer.skipped_steps < STEPS
    assert losses[-1] < losses[0], losses
    assert scheduler.last_epoch == STEPS - optimizer.skipped_steps


def test_fp8_booster_swaps_linears() -> None:
    if FP8_MISSING:
        pytest.skip(FP8_MISSING)
    from mixprec.fp8 import Float8Linear

    model, *_ = Booster(mixed_precision="fp8").boost(tiny_mlp(WIDTH))
    kinds = [type(m) for m in model.module]
    # Linear(16, 32) is aligned and converts; Linear(32, 4) is not (4 % 16) and stays.
    assert kinds[0] is Float8Linear and kinds[-1] is torch.nn.Linear


def test_param_dtypes_follow_the_mode() -> None:
    model, *_ = Booster(mixed_precision="fp16_naive").boost(tiny_mlp(WIDTH))
    dtypes = [p.dtype for p in model.parameters()]
    # Linear weights fp16; LayerNorm (index 2, 3) kept fp32 by the naive policy.
    assert dtypes == [torch.float16] * 2 + [torch.float32] * 2 + [torch.float16] * 2


def _inject_inf(optimizer: MixedPrecisionOptimizer) -> None:
    from torch.distributed.tensor import DTensor

    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                # An FSDP grad is a DTensor: write into this rank's shard only (no collective).
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                grad.view(-1)[0] = float("inf")
                return
    # low-precision params keep their grads outside param_groups (the masters sit there)
    optimizer.lp_params[0].grad.view(-1)[0] = float("inf")


@pytest.mark.parametrize("mode", ["bf16", "fp16_naive"])
def test_skipped_step_does_not_advance_the_schedule(mode: str) -> None:
    x, y = _data()
    booster = Booster(mixed_precision=_precision(mode))
    model = tiny_mlp(WIDTH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, criterion, _, scheduler = booster.boost(
        model, optimizer, torch.nn.MSELoss(), None, scheduler
    )
    assert isinstance(scheduler, SkipAwareLRScheduler)
    before = [p.detach().clone() for p in model.parameters()]
    booster.backward(criterion(model(x), y), optimizer)
    _inject_inf(optimizer)
    assert optimizer.step().skipped
    optimizer.zero_grad()
    scheduler.step()
    assert scheduler.get_last_lr() == [0.1] and scheduler.last_epoch == 0
    assert scheduler.held_steps == 1
    for p, q in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # a skipped step moves nothing
    booster.backward(criterion(model(x), y), optimizer)
    assert not optimizer.step().skipped
    scheduler.step()
    assert scheduler.get_last_lr() == [0.05]


def test_bad_mixed_precision_names_every_mode() -> None:
    with pytest.raises(ValueError, match="fp61") as info:
        Booster(mixed_precision="fp61")
    for mode in MODES:
        assert repr(mode) in str(info.value)
    with pytest.raises(TypeError, match="mixed_precision"):
        Booster(mixed_precision=16)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="plugin"):
        Booster(plugin="ddp")  # type: ignore[arg-type]


def test_every_mode_name_is_accepted() -> None:
    for mode in MODES:
        assert to_mixed_precision(mode).policy.name in (mode, "O1")  # fp16_apex means O1


def test_boost_rejects_misuse() -> None:
    booster = Booster()
    model = tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    with pytest.raises(ValueError, match="needs its optimizer"):
        booster.boost(model, lr_scheduler=scheduler)
    other = torch.optim.SGD(tiny_mlp().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="another optimizer"):
        booster.boost(model, other, lr_scheduler=scheduler)
    with pytest.raises(TypeError, match="MixedPrecisionOptimizer"):
        booster.backward(torch.ones(()), optimizer)
    with pytest.raises(RuntimeError, match="launch_from_torch"):
        Booster(plugin=TorchDDPPlugin()).boost(tiny_mlp())
    with pytest.raises(ValueError, match="reduce_dtype"):
        TorchFSDPPlugin(reduce_dtype=torch.int8)


def test_prepare_dataloader_single_process_is_seeded() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(10))
    orders = [
        [int(v) for (b,) in Plugin().prepare_dataloader(data, 4, shuffle=True, seed=7) for v in b]
        for _ in range(2)
    ]
    assert orders[0] == orders[1] and sorted(orders[0]) == list(range(10))
    assert orders[0] != list(range(10))  # 1/10! chance of the identity: seed 7 is not it
    plain = Plugin().prepare_dataloader(data, 4, drop_last=True)
    assert [len(b) for (b,) in plain] == [4, 4]


# ----- two gloo processes -----


def _all_equal_across_ranks(tensors: list[torch.Tensor]) -> None:
    import torch.distributed as dist

    flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    for other in gathered[1:]:
        torch.testing.assert_close(other, gathered[0], rtol=0, atol=0)  # DDP's contract


def _ddp_worker(rank: int, world: int) -> None:
    import torch.distributed as dist

    dataset = torch.utils.data.TensorDataset(*_data(32))
    for mode in ("bf16", "fp16", "fp8"):  # fp8: Float8Linear layers under DDP
        torch.manual_seed(0)
        plugin = TorchDDPPlugin()
        booster = Booster(mixed_precision=mode, plugin=plugin)
        loader = plugin.prepare_dataloader(dataset, batch_size=4, shuffle=True)
        model = tiny_mlp(WIDTH)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        model, optimizer, criterion, loader, scheduler = booster.boost(
            model, optimizer, torch.nn.MSELoss(), loader, scheduler
        )
        if mode == "fp8":
            from mixprec.fp8 import Float8Linear

            assert any(isinstance(m, Float8Linear) for m in model.modules())
        seen = []
        for x, y in loader:
            seen.append(x)
            booster.backward(criterion(model(x), y), optimizer)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        # each rank saw its own half of the data: together, all of it
        mine = torch.cat(seen)
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        assert torch.cat(everyone).shape[0] == 32
        assert (
            optimizer.skipped_steps < len(seen)
            and scheduler.last_epoch == len(seen) - optimizer.skipped_steps
        )
        assert not torch.equal(everyone[0], everyone[1])
        _all_equal_across_ranks(list(model.parameters()))

        # overflow on rank 1's gradients only: both ranks skip, nothing moves
        x, y = next(iter(loader))
        before = [p.detach().clone() for p in model.parameters()]
        lr_before, epoch_before = scheduler.get_last_lr(), scheduler.last_epoch
        booster.backward(criterion(model(x), y), optimizer)
        if rank == 1:
            _inject_inf(optimizer)
        assert optimizer.step().skipped
        optimizer.zero_grad()
        scheduler.step()
        assert (scheduler.get_last_lr(), scheduler.last_epoch) == (lr_before, epoch_before)
        for p, q in zip(model.parameters(), before, strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)

    # no_sync: gradients stay local inside, the backward after it reduces them
    inner = model.module.module
    with booster.no_sync(model, optimizer):
        booster.backward(criterion(model(x + rank), y), optimizer)
    local = inner[0].weight.grad.clone()
    others = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(others, local)
    assert not torch.equal(others[0], others[1])
    booster.backward(criterion(model(x), y), optimizer)
    _all_equal_across_ranks([inner[0].weight.grad])
    optimizer.zero_grad()


@pytest.mark.distributed
def test_ddp_booster_bf16_fp16_and_fp8_two_ranks() -> None:
    from dist_utils import spawn

    spawn(_ddp_worker, 2)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _fsdp_worker(rank: int, world: int) -> None:
    from torch.distributed.fsdp import FSDPModule

    x, y = _data(16)
    lo, hi = rank * 8, (rank + 1) * 8
    for mode in ("bf16", "fp16", "fp16_naive"):
        torch.manual_seed(0)
        model = tiny_mlp(WIDTH)
        ref_model = copy.deepcopy(model)
        booster = Booster(mixed_precision=_precision(mode), plugin=TorchFSDPPlugin())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer, criterion, *_ = booster.boost(model, optimizer, torch.nn.MSELoss())
        assert isinstance(model.module, FSDPModule)
        # Single-process reference on the full batch in the same mode.
        ref_booster = Booster(mixed_precision=_precision(mode))
        ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05)
        ref, ref_opt, ref_crit, *_ = ref_booster.boost(ref_model, ref_opt, torch.nn.MSELoss())
        for _ in range(4):
            booster.backward(criterion(model(x[lo:hi]), y[lo:hi]), optimizer)
            ref_booster.backward(ref_crit(ref(x), y), ref_opt)
            assert optimizer.step().skipped == ref_opt.step().skipped
            optimizer.zero_grad()
            ref_opt.zero_grad()
        assert optimizer.skipped_steps < 4
        masters = {id(lp): hp for lp, hp in zip(ref_opt.lp_params, ref_opt.hp_masters, strict=True)}
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
            assert p.dtype == torch.float32  # the sharded fp32 params are the masters
            # Half-batch gradients (rounded in the low dtype, averaged in fp32) vs one full
            # batch: per step at most ~1 low-dtype eps of an O(1) gradient, times lr, 4 steps.
            low = torch.bfloat16 if mode == "bf16" else torch.float16
            tol = 0.05 * 4 * torch.finfo(low).eps
            torch.testing.assert_close(_full(p), masters.get(id(q), q), rtol=0, atol=tol)

        # overflow on one rank's shard only: every rank skips, nothing moves
        before = [_full(p).clone() for p in model.parameters()]
        booster.backward(criterion(model(x[lo:hi]), y[lo:hi]), optimizer)
        if rank == 1:
            _inject_inf(optimizer)
        assert optimizer.step().skipped
        optimizer.zero_grad()
        for p, q in zip(model.parameters(), before, strict=True):
            torch.testing.assert_close(_full(p), q, rtol=0, atol=0)

    # no_sync: FSDP2 keeps the accumulated gradient unsharded and reduce-scatters nothing
    with booster.no_sync(model, optimizer):
        booster.backward(criterion(model(x[lo:hi]), y[lo:hi]), optimizer)
    assert all(p.grad is None for p in model.parameters())
    booster.backward(criterion(model(x[lo:hi]), y[lo:hi]), optimizer)
    assert all(p.grad is not None for p in model.parameters())
    assert not optimizer.step().skipped


@pytest.mark.distributed
def test_fsdp2_booster_bf16_fp16_and_naive_two_ranks() -> None:
    from dist_utils import spawn

    spawn(_fsdp_worker, 2)


def test_per_epoch_schedule_advances_if_any_step_of_the_epoch_went_through() -> None:
    from mixprec.core.optim import MixedPrecisionOptimizer

    model = torch.nn.Linear(4, 2)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    sched = SkipAwareLRScheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), opt)

    def epoch(poison_last: bool, steps: int = 3) -> None:
        for i in range(steps):
            opt.zero_grad()
            opt.backward(model(torch.ones(1, 4)).sum())
            if poison_last and i == steps - 1:
                model.bias.grad[0] = float("nan")
            opt.step()
        sched.step()

    epoch(poison_last=True)  # two steps applied, the last skipped: the epoch still counts
    assert opt.param_groups[0]["lr"] == 0.5 and sched.held_steps == 0
    epoch(poison_last=True, steps=1)  # nothing applied this epoch: hold
    assert opt.param_groups[0]["lr"] == 0.5 and sched.held_steps == 1
