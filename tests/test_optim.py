"""The master-weight optimizer against a hand-written fp32-master loop, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import CountHostSyncs, tiny_mlp
from tolerances import EXACT, fp32_rounding

from mixprec.core.casting import cast_module
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import ScalerConfig
from mixprec.core.scaling import LossScaler

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

SCALE = ScalerConfig(dynamic=False, init_scale=2.0**10)


def batch(n: int = 16, width: int = 8, dtype: torch.dtype = torch.float32):
    return torch.randn(n, width, dtype=dtype), torch.randint(0, 4, (n,))


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x).float(), y)


def reference_step(model, masters, opt, x, y, scale: float) -> None:
    """Plain fp32-master step: scaled backward, copy grads to fp32 and unscale, step, copy back."""
    (loss_fn(model, x, y) * scale).backward()
    for p, m in zip(model.parameters(), masters, strict=True):
        m.grad = p.grad.float() * (1.0 / scale)
        p.grad = None
    opt.step()
    with torch.no_grad():
        for p, m in zip(model.parameters(), masters, strict=True):
            p.copy_(m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW])
def test_matches_hand_written_master_loop_exactly(dtype, opt_cls) -> None:
    model = cast_module(tiny_mlp(norm=False), dtype)
    ref_model = copy.deepcopy(model)
    kwargs = {"lr": 0.05, "momentum": 0.9} if opt_cls is torch.optim.SGD else {"lr": 1e-2}
    opt = MixedPrecisionOptimizer(opt_cls(model.parameters(), **kwargs), loss_scale=SCALE)
    masters = [p.detach().float().requires_grad_() for p in ref_model.parameters()]
    ref_opt = opt_cls(masters, **kwargs)
    for _ in range(5):
        x, y = batch(dtype=dtype)
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y))
        assert not opt.step().skipped
        reference_step(ref_model, masters, ref_opt, x, y, SCALE.init_scale)
    # Same ops in the same order on the same values: exact.
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(opt.hp_masters, masters, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def snapshot(model, opt):
    return (
        [p.detach().clone() for p in model.parameters()],
        copy.deepcopy(opt.optim.state_dict()),
        [m.detach().clone() for m in opt.hp_masters],
    )


def assert_snapshots_equal(a, b) -> None:
    for x, y in zip(a[0] + a[2], b[0] + b[2], strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -float("inf")])
def test_skipped_step_changes_nothing_bitwise(bad: float) -> None:
    model = cast_module(tiny_mlp(), torch.bfloat16)
    opt = MixedPrecisionOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2),
        loss_scale=ScalerConfig(init_scale=2.0**8),
    )
    x, y = batch(dtype=torch.bfloat16)
    opt.backward(loss_fn(model, x, y))
    opt.step()  # Adam now has state (step count 1) worth protecting
    before = snapshot(model, opt)
    opt.zero_grad()
    opt.backward(loss_fn(model, x, y))
    next(model.parameters()).grad.view(-1)[3] = bad
    result = opt.step()
    assert result.skipped and result.scale == 2.0**8
    assert opt.loss_scale == 2.0**7 and opt.skipped_steps == 1
    assert_snapshots_equal(before, snapshot(model, opt))
    assert all(int(s["step"]) == 1 for s in opt.optim.state.values())


def test_gradient_accumulation_unscales_once() -> None:
    model = cast_module(tiny_mlp(norm=False), torch.bfloat16)
    ref = copy.deepcopy(model)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=SCALE)
    masters = [p.detach().float().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.SGD(masters, lr=0.1)
    micro = [batch(dtype=torch.bfloat16) for _ in range(3)]
    for x, y in micro:
        opt.backward(loss_fn(model, x, y))
        (loss_fn(ref, x, y) * SCALE.init_scale).backward()
    opt.step()
    for p, m in zip(ref.parameters(), masters, strict=True):
        m.grad = p.grad.float() * (1.0 / SCALE.init_scale)
    ref_opt.step()
    for a, m in zip(opt.hp_masters, masters, strict=True):
        torch.testing.assert_close(a, m, rtol=0, atol=0)


def test_clip_grad_norm_sees_unscaled_grads() -> None:
    model = cast_module(tiny_mlp(norm=False), torch.bfloat16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=SCALE)
    x, y = batch(dtype=torch.bfloat16)
    loss = loss_fn(model, x, y)
    opt.backward(loss)
    expected = torch.linalg.vector_norm(
        torch.cat([p.grad.float().flatten() / SCALE.init_scale for p in model.parameters()])
    )
    norm = opt.clip_grad_norm(1e-3)
    # fp32 sums of the same values in another order: a few ulps apart at most.
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    clipped = torch.linalg.vector_norm(torch.cat([m.grad.flatten() for m in opt.hp_masters]))
    torch.testing.assert_close(clipped, torch.tensor(1e-3), rtol=1e-4, atol=0)
    with pytest.raises(RuntimeError, match="after the gradients were unscaled"):
        opt.backward(loss_fn(model, x, y))
    assert not opt.step().skipped


def test_max_norm_clips_inside_step_and_reports_norm() -> None:
    model = cast_module(tiny_mlp(), torch.bfloat16)
    opt = MixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), loss_scale=SCALE, max_norm=1e-3
    )
    opt.backward(loss_fn(model, *batch(dtype=torch.bfloat16)))
    result = opt.step()
    assert result.grad_norm is not None and result.grad_norm > 1e-3


def test_num_zeros_counted() -> None:
    model = torch.nn.Linear(4, 3, bias=False)
    opt = MixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), log_num_zeros_in_grad=True
    )
    x = torch.tensor([[1.0, 0.0, 2.0, 0.0]])  # columns 1 and 3 of the weight get zero grad
    opt.backward(model(x).sum())
    assert opt.step().num_zeros == 6


def test_param_without_grad_is_not_stepped_with_a_stale_grad() -> None:
    model = cast_module(
        torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]), torch.bfloat16
    )
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    opt.backward((model[0](x) + model[1](x)).sum())
    opt.step()
    frozen = model[1].weight.detach().clone()
    opt.zero_grad()
    opt.backward(model[0](x).sum())  # model[1] takes no part this step
    opt.step()
    torch.testing.assert_close(model[1].weight, frozen, rtol=0, atol=0)


def test_lr_scheduler_drives_the_masters() -> None:
    model = cast_module(tiny_mlp(), torch.bfloat16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        opt.zero_grad()
        opt.backward(loss_fn(model, *batch(dtype=torch.bfloat16)))
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.125
    assert all(p.dtype == torch.float32 for p in opt.param_groups[0]["params"])


def test_add_param_group_gets_masters() -> None:
    a, b = (
        cast_module(torch.nn.Linear(4, 4), torch.float16),
        cast_module(torch.nn.Linear(4, 2), torch.float16),
    )
    opt = MixedPrecisionOptimizer(torch.optim.SGD(a.parameters(), lr=0.1))
    opt.add_param_group({"params": b.parameters(), "lr": 0.01})
    assert len(opt.hp_masters) == 4
    assert [p.dtype for p in opt.param_groups[1]["params"]] == [torch.float32] * 2


def run(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y))
        opt.step()


def test_state_dict_resume_equals_uninterrupted_run_bitwise() -> None:
    cfg = ScalerConfig(init_scale=2.0**12, growth_interval=2, hysteresis=2)
    batches = [batch(dtype=torch.bfloat16) for _ in range(8)]
    batches[2] = (batches[2][0] * float("inf"), batches[2][1])  # one overflow on the way

    def fresh():
        torch.manual_seed(1)
        model = cast_module(tiny_mlp(), torch.bfloat16)
        return model, MixedPrecisionOptimizer(
            torch.optim.Adam(model.parameters(), lr=1e-2), loss_scale=cfg
        )

    model, opt = fresh()
    run(model, opt, batches)
    straight = snapshot(model, opt)
    straight_scaler = opt.scaler.state_dict()

    model, opt = fresh()
    run(model, opt, batches[:4])
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    model2, opt2 = fresh()
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    run(model2, opt2, batches[4:])
    assert_snapshots_equal(straight, snapshot(model2, opt2))
    for key in ("scale", "growth_tracker", "hysteresis_tracker"):
        assert torch.equal(opt2.scaler.state_dict()[key], straight_scaler[key])
    assert opt2.skipped_steps == 1 and opt2.steps == 8


def test_load_rejects_foreign_state() -> None:
    opt = MixedPrecisionOptimizer(
        torch.optim.SGD(cast_module(torch.nn.Linear(2, 2), torch.float16).parameters(), lr=1)
    )
    with pytest.raises(KeyError, match="Not an optimizer checkpoint.*got keys \\['scale'\\]"):
        opt.load_state_dict({"scale": 1.0})
    with pytest.raises(ValueError, match="doesn't match the size"):  # torch's own check
        opt.load_state_dict(
            torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1).state_dict()
        )
    other = MixedPrecisionOptimizer(
        torch.optim.SGD(cast_module(torch.nn.Linear(2, 3), torch.float16).parameters(), lr=1)
    )
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(other.state_dict())


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        MixedPrecisionOptimizer(object())  # type: ignore[arg-type]
    inner = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1)
    with pytest.raises(ValueError, match="max_norm=-1"):
        MixedPrecisionOptimizer(inner, max_norm=-1)
    with pytest.raises(TypeError, match="already wrapped"):
        MixedPrecisionOptimizer(MixedPrecisionOptimizer(inner))


def _ranks_agree_on_overflow(rank: int, world: int) -> None:
    import torch.distributed as dist

    torch.manual_seed(0)  # same init on every rank
    model = cast_module(tiny_mlp(), torch.float16)
    opt = MixedPrecisionOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), loss_scale=ScalerConfig(init_scale=2.0**6)
    )
    before = snapshot(model, opt)
    torch.manual_seed(rank)  # different data per rank, as under data parallelism
    opt.backward(loss_fn(model, *batch(n=4, dtype=torch.float16)))
    if rank == world - 1:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    assert opt.step().skipped, f"rank {rank} stepped although rank {world - 1} overflowed"
    assert opt.loss_scale == 2.0**5
    assert_snapshots_equal(before, snapshot(model, opt))
    # And a clean step afterwards: every rank steps (grads differ, so params do too, but the
    # decision and the scale are shared).
    opt.zero_grad()
    opt.backward(loss_fn(model, *batch(n=4, dtype=torch.float16)))
    assert not opt.step().skipped
    flags = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(flags, torch.tensor([opt.loss_scale]))
    assert all(f.item() == 2.0**5 for f in flags)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_overflow_on_one_rank_skips_everywhere(world: int) -> None:
    from dist_utils import spawn

    spawn(_ranks_agree_on_overflow, world)


def test_scale_collapse_raises_naming_the_parameters() -> None:
    model = cast_module(tiny_mlp(), torch.bfloat16)
    opt = MixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_scale=ScalerConfig(init_scale=4.0),
        max_consecutive_skips=5,
    )
    opt.name_params(model)
    x, y = batch(dtype=torch.bfloat16)
    for i in range(5):
        opt.zero_grad()
        opt.backward(loss_fn(model, x, y))
        model[3].bias.grad[0] = float("nan")  # persistent: overflows at any scale
        if i < 4:
            assert opt.step().skipped
    with pytest.raises(RuntimeError, match=r"5 steps in a row.*floor 1.*\['3.bias'\].*bf16"):
        opt.step()
    assert opt.loss_scale == 1.0  # the floor held: the scale never fell to 0


def test_adam_eps_that_vanishes_in_fp16_is_refused_without_masters() -> None:
    model = cast_module(tiny_mlp(), torch.float16)
    with pytest.raises(ValueError, match=r"eps=1e-08 with float16 parameters.*eps >= 1e-4"):
        MixedPrecisionOptimizer(torch.optim.Adam(model.parameters()), master_weights=False)
    MixedPrecisionOptimizer(torch.optim.Adam(model.parameters()))  # with masters: fine (fp32 state)


@pytest.mark.parametrize("keep", [True, False])
def test_master_grads_freed_between_steps_unless_kept(keep: bool) -> None:
    model = cast_module(tiny_mlp(), torch.bfloat16)
    ref = copy.deepcopy(model)
    opt = MixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), keep_master_grads=keep
    )
    kept = MixedPrecisionOptimizer(
        torch.optim.SGD(ref.parameters(), lr=0.1), keep_master_grads=True
    )
    for _ in range(3):
        x, y = batch(dtype=torch.bfloat16)
        for o, m in ((opt, model), (kept, ref)):
            o.zero_grad()
            o.backward(loss_fn(m, x, y))
            o.step()
    assert all((m.grad is not None) == keep for m in opt.hp_masters)
    for a, b in zip(opt.hp_masters, kept.hp_masters, strict=True):  # same numbers either way
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def dynamic_run(monkeypatch, *, mirror: bool) -> list:
    """Steps through clean runs, growth and overflows (growth_interval 3); what each reported
    and the final state. mirror=False: the scaler never knows its values on the host."""
    torch.manual_seed(0)
    model = cast_module(tiny_mlp(norm=False), torch.float16)
    cfg = ScalerConfig(init_scale=2.0**8, growth_interval=3, hysteresis=1)
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), loss_scale=cfg)
    if not mirror:
        monkeypatch.setattr(opt.scaler, "host_state", lambda: None)
    seen = []
    for i in range(12):
        x, y = batch(dtype=torch.float16)
        if i in (4, 5, 9):
            x[0, 0] = float("inf")
        opt.backward(loss_fn(model, x, y))
        result = opt.step()
        opt.zero_grad()
        seen.append((result.skipped, result.scale, opt.scaler.growth_tracker.item()))
    return [seen, snapshot(model, opt), opt.scaler.state_dict()]


def test_the_scale_known_on_the_host_reports_and_steps_as_a_read_one(monkeypatch) -> None:
    known, read = dynamic_run(monkeypatch, mirror=True), dynamic_run(monkeypatch, mirror=False)
    skipped_at = [i for i, (skipped, _, _) in enumerate(known[0]) if skipped]
    assert skipped_at == [4, 5, 9]
    assert len({scale for _, scale, _ in known[0]}) > 2  # it grew and backed off
    assert known[0] == read[0]
    assert_snapshots_equal(known[1], read[1])
    assert read[2].keys() == known[2].keys()
    for key, value in read[2].items():
        same = torch.equal if isinstance(value, torch.Tensor) else (lambda a, b: a == b)
        assert same(known[2][key], value), key


def test_a_clean_step_reads_the_overflow_flag_alone(monkeypatch) -> None:
    model = cast_module(tiny_mlp(norm=False), torch.float16)
    cfg = ScalerConfig(init_scale=2.0**8, growth_interval=100)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=1e-2), loss_scale=cfg)
    for _ in range(2):  # the first step reads scale and growth tracker with the flag
        opt.backward(loss_fn(model, *batch(dtype=torch.float16)))
        opt.step()
    syncs = CountHostSyncs(monkeypatch)
    opt.backward(loss_fn(model, *batch(dtype=torch.float16)))
    assert opt.step().scale == 2.0**8
    assert syncs.calls == ["item"]


def test_the_host_copy_of_the_scale_is_dropped_by_any_write(device: str) -> None:
    scaler = LossScaler(ScalerConfig(init_scale=4.0, growth_interval=10))
    assert scaler.host_state() is None  # never read yet
    scaler.remember_host_state(4.0, 0.0)
    scaler.update(torch.zeros(1), clean_growth=0.0)  # a counted clean step keeps it current
    assert scaler.host_state() == (4.0, 1.0) and scaler.growth_tracker.item() == 1
    scaler.update(torch.ones(1))  # the device-side rule wrote both tensors
    assert scaler.host_state() is None
    scaler.remember_host_state(scaler.scale, float(scaler.growth_tracker.item()))
    scaler.load_state_dict(LossScaler(ScalerConfig(init_scale=64.0)).state_dict())
    assert scaler.host_state() is None
    scaler.remember_host_state(64.0, 0.0)
    scaler.scale_tensor.mul_(2)  # anyone's in-place write
    assert scaler.host_state() is None
    scaler.remember_host_state(128.0, 0.0)
    scaler.to(device)  # same device: the same tensors, still known
    assert scaler.host_state() == (128.0, 0.0)


ROUNDS_SCALES = {
    "unit": None,  # bf16's and fp32's mode: no loss scaling
    "static": SCALE,
    # the scale doubles after every clean step: the carried gradient meets a new scale
    "growing": ScalerConfig(init_scale=2.0**8, growth_interval=1),
}


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("scaling", sorted(ROUNDS_SCALES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rounds_without_zero_grad_step_on_the_sum(dtype, scaling: str, fused: bool) -> None:
    """torch's contract: a step leaves its gradients in .grad, so backward + step twice with no
    zero_grad() steps on g1 + g2 the second time (DDP and Colossal alike). The optimizer dropped
    the lp grads at step(), so the second round stepped on g2 alone. Reference: the plain torch
    loop, with fp32 masters written out by hand for lp params (their grads accumulate in the lp
    model's .grad, as micro-batches do, at the scale of each backward); power-of-two scales
    unscale exactly, so: bitwise, except the fused kernel's own rounding."""
    cfg = ROUNDS_SCALES[scaling]
    if cfg is not None and dtype == torch.bfloat16:
        cfg = ScalerConfig(dynamic=False, init_scale=2.0**10)  # bf16 with a scale still sums
    scale_kw = {} if cfg is None else {"loss_scale": cfg}
    model = cast_module(tiny_mlp(norm=False), dtype)
    ref_model = copy.deepcopy(model)
    sgd = {"lr": 0.05, "momentum": 0.9}
    opt = MixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), **sgd), fused_step=fused, **scale_kw
    )
    lp = dtype != torch.float32
    masters = (
        [p.detach().float().requires_grad_() for p in ref_model.parameters()]
        if lp
        else list(ref_model.parameters())
    )
    ref_opt = torch.optim.SGD(masters, **sgd)
    scale = 1.0
    for _ in range(3):  # no zero_grad anywhere: round k steps on g1 + ... + gk
        x, y = batch(dtype=dtype)
        last_scale, scale = scale, opt.loss_scale
        opt.backward(loss_fn(model, x, y))
        assert not opt.step().skipped
        if lp:  # the lp grads kept from the last round meet this round's scale, then add
            for p in ref_model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale / last_scale)
            (loss_fn(ref_model, x, y) * scale).backward()
            for p, m in zip(ref_model.parameters(), masters, strict=True):
                m.grad = p.grad.float() * (1.0 / scale)
        else:
            loss_fn(ref_model, x, y).backward()
        ref_opt.step()
        with torch.no_grad():
            for p, m in zip(ref_model.parameters(), masters, strict=True):
                p.copy_(m)
    # the fused step's own kernel rounds as the compiled one does: within FP32_ROUNDING
    tol = fp32_rounding() if fused else EXACT
    held = [p for g in opt.param_groups for p in g["params"]]
    for a, b in zip(held, masters, strict=True):
        torch.testing.assert_close(a, b, **tol)
    opt.zero_grad()  # drops the carried gradient: the next round steps on its own again
    x, y = batch(dtype=dtype)
    scale = opt.loss_scale if lp else 1.0
    opt.backward(loss_fn(model, x, y))
    opt.step()
    ref_opt.zero_grad()
    for p in ref_model.parameters():
        p.grad = None
    (loss_fn(ref_model, x, y) * scale).backward()
    if lp:
        for p, m in zip(ref_model.parameters(), masters, strict=True):
            m.grad = p.grad.float() * (1.0 / scale)
    ref_opt.step()
    for a, b in zip(held, masters, strict=True):
        torch.testing.assert_close(a, b, **tol)


FUSED_INNER = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
}


def sync_free_run(make, *, sync_free: bool, overflows: list[bool], max_norm: float = 0.0):
    """An fp16 model with fp32 masters, stepped through overflows (inf written into one lp
    grad after backward); the same seed and batches whichever path runs."""
    torch.manual_seed(0)
    model = cast_module(tiny_mlp(norm=False), torch.float16)
    cfg = ScalerConfig(init_scale=2.0**8, growth_interval=2, hysteresis=1)
    opt = MixedPrecisionOptimizer(make(model.parameters()), loss_scale=cfg, max_norm=max_norm)
    opt._sync_free = sync_free
    results = []
    for bad in overflows:
        opt.zero_grad()
        opt.backward(loss_fn(model, *batch(dtype=torch.float16)))
        if bad:
            model[0].weight.grad[0, 0] = float("inf")
        results.append(opt.step())
    return model, opt, results


@pytest.mark.parametrize("max_norm", [0.0, 0.5])
@pytest.mark.parametrize("name", sorted(FUSED_INNER))
def test_sync_free_step_equals_the_syncing_one_bitwise(name: str, max_norm: float) -> None:
    """The same kernel, told found_inf instead of being skipped on the host: params, masters,
    optimizer state (Adam's step count too), scale and counters come out bit for bit alike
    over bad, clean, bad, bad, bad and clean steps with growth."""
    pattern = [False, True, False, True, True, True, False, False, False]
    runs = [
        sync_free_run(FUSED_INNER[name], sync_free=flag, overflows=pattern, max_norm=max_norm)
        for flag in (False, True)
    ]
    (ref_model, ref, ref_results), (model, opt, results) = runs
    for a, b in zip(
        [*model.parameters(), *opt.hp_masters],
        [*ref_model.parameters(), *ref.hp_masters],
        strict=True,
    ):
        torch.testing.assert_close(a, b, **EXACT)
    for got, want in zip(opt.optim.state.values(), ref.optim.state.values(), strict=True):
        assert got.keys() == want.keys()
        for key in got:
            torch.testing.assert_close(got[key], want[key], **EXACT)
    assert [r.skipped for r in results] == [r.skipped for r in ref_results] == pattern
    assert [r.scale for r in results] == [r.scale for r in ref_results]
    assert [r.grad_norm for r in results] == [r.grad_norm for r in ref_results]
    assert opt.loss_scale == ref.loss_scale
    assert opt.skip_stats == ref.skip_stats and opt.skipped_steps == 4
    assert opt.last_result.skipped is False and opt.consecutive_skips == 0


@pytest.mark.parametrize("name", sorted(FUSED_INNER))
def test_sync_free_clean_step_reads_nothing_on_the_host(monkeypatch, name: str) -> None:
    """Forced on CPU (it runs by itself on CUDA): a clean step, backward to step, makes no
    .item()/tolist()/bool() call; the counters read the device record when they are read."""
    model, opt, _ = sync_free_run(FUSED_INNER[name], sync_free=True, overflows=[False, True])
    assert opt.skipped_steps == 1  # read (and the skip logged) before counting
    syncs = CountHostSyncs(monkeypatch)
    for _ in range(3):
        opt.zero_grad()
        opt.backward(loss_fn(model, *batch(dtype=torch.float16)))
        opt.step()
    assert syncs.calls == []
    assert opt.skipped_steps == 1 and opt.steps == 5  # the read: one sync for the record
    assert syncs.calls == ["tolist"]


def test_sync_free_refuses_a_mode_that_reads_the_step_on_the_host() -> None:
    """Any optimizer runs sync-free (fused: found_inf; others: tests/test_sync_free.py's masked
    update); a mode that logs the scale each step (verbosity 2) cannot, and forcing says so."""
    model = cast_module(tiny_mlp(norm=False), torch.float16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt._sync_free, opt.verbosity = True, 2
    opt.backward(loss_fn(model, *batch(dtype=torch.float16)))
    with pytest.raises(RuntimeError, match=r"_sync_free=True with SGD: .*verbosity 2"):
        opt.step()


@pytest.mark.cuda
def test_sync_free_step_on_cuda_makes_no_host_sync() -> None:
    """On CUDA the path is the default: torch's sync debug mode turns any sync into an error."""
    torch.manual_seed(0)
    model = cast_module(tiny_mlp(norm=False), torch.float16).cuda()
    opt = MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        loss_scale=ScalerConfig(init_scale=2.0**8),
    )
    x, y = torch.randn(16, 8, device="cuda"), torch.randint(0, 4, (16,), device="cuda")
    for _ in range(2):  # the first step creates the optimizer state
        opt.zero_grad()
        opt.backward(loss_fn(model, x.half(), y))
        opt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.zero_grad()
        opt.backward(loss_fn(model, x.half(), y))
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.skipped_steps == 0 and opt.steps == 3


def test_state_an_optimizer_built_at_construction_moves_to_the_master_in_fp32() -> None:
    """Adagrad makes its `sum` at construction, like the fp16 param: the state moves onto the
    fp32 master in fp32 (torch 2.11's Adagrad divided by sqrt(fp16 sum) + 1e-10, which is 0 in
    fp16: inf weights after one clean step), and a step equals Adagrad on fp32 params."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 4)
    model = copy.deepcopy(ref).half()
    ref.load_state_dict({k: v.half().float() for k, v in ref.state_dict().items()})
    opt = MixedPrecisionOptimizer(
        torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.5),
        loss_scale=ScalerConfig(init_scale=2.0**4),
    )
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1, initial_accumulator_value=0.5)
    for master in opt.hp_masters:
        assert opt.optim.state[master]["sum"].dtype == torch.float32
    x = torch.randn(16, 8)
    opt.backward(model(x.half()).float().square().mean())
    ref(x).square().mean().backward()
    assert not opt.step().skipped
    ref_opt.step()
    # the fp16 forward's rounding of the grads is the only difference (no overflow, no inf)
    for master, p in zip(opt.hp_masters, ref.parameters(), strict=True):
        torch.testing.assert_close(master, p, rtol=0, atol=2e-3)
