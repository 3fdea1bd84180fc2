"""ZeRO-1/2 (LowLevelZeroPlugin, mixprec.parallel.zero) against one process on the concatenated batch."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mixprec.amp_type import AMP_TYPE
from mixprec.booster import Booster
from mixprec.booster.plugin import LowLevelZeroPlugin
from mixprec.config import load_config
from mixprec.core.prepare import prepare_model, prepare_optimizer
from mixprec.parallel.zero import ZeroOptimizer
from mixprec.parallel.zero_layout import partition_params

WIDTH = 16  # tiny: fp16 matmuls are slow on CPU
STEPS = 4
LR = 1e-2
MAX_NORM = 0.5  # below the first steps' gradient norm, so the global-norm clip is exercised
CASES = [(stage, precision) for stage in (1, 2) for precision in ("fp16", "bf16", "fp32")]


def zero_model() -> nn.Module:
    """Four equal Linears and a LayerNorm: sizes that split evenly over 2 ranks."""
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH),
        nn.LayerNorm(WIDTH),
        nn.ReLU(),
        nn.Linear(WIDTH, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        nn.ReLU(),
        nn.Linear(WIDTH, WIDTH),
    )


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)


def _plugin(stage: int, precision: str) -> LowLevelZeroPlugin:
    # 2**8, not 2**32: the default first scale skips ~24 steps before one lands; a mode that
    # scales no loss refuses a scaler keyword
    scaling = {"initial_scale": 2**8} if precision.startswith("fp16") else {}
    return LowLevelZeroPlugin(stage=stage, precision=precision, max_norm=MAX_NORM, **scaling)


def _optimizer(model: nn.Module, precision: str) -> torch.optim.Optimizer:
    """AdamW in fp32; SGD with momentum over lp gradients: Adam's g/sqrt(v) turns the sign of
    a near-zero gradient's rounding noise into a whole lr step, SGD keeps it proportional."""
    if precision == "fp32":
        return torch.optim.AdamW(model.parameters(), lr=LR)
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def _state_tensors(opt: ZeroOptimizer) -> list[torch.Tensor]:
    return [t.clone() for s in opt.optim.state.values() for t in s.values()] + [
        m.clone() for m in opt.hp_masters
    ]


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _gather_ints(values: list[int]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.int64)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out)


def _equality_worker(rank: int, world: int, cases: list[tuple[int, str]]) -> None:
    from dist_utils import assert_same_on_every_rank, scaler_state

    per_rank = 4
    x, y = _data(per_rank * world)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for stage, precision in cases:
        torch.manual_seed(0)
        model = zero_model()
        ref_model = copy.deepcopy(model)
        plugin = _plugin(stage, precision)
        booster = Booster(plugin=plugin)
        opt = _optimizer(model, precision)
        model, opt, criterion, *_ = booster.boost(model, opt, nn.MSELoss())
        assert isinstance(opt, ZeroOptimizer) and opt.world == world
        assert opt.process_group is None  # the world group is looked up at use, never held
        assert not opt.reduce_scatter  # gloo's all-reduce is the faster of the two
        opt.buckets.reduce_scatter = precision == "fp16"  # both collectives of stage 2 are checked
        low = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[precision]
        assert opt.communication_dtype == torch.float32  # gloo sums fp16 slower than fp32
        if stage == 2:  # the lp sum, divided by the world first (the default off gloo)
            opt.buckets.communication_dtype = low
        assert model.module[0].weight.dtype == low  # lp params on every rank

        # The reference: one process, the whole batch, the same policy and fp32-master math.
        ref = prepare_model(ref_model, plugin.policy)
        ref_opt = prepare_optimizer(
            _optimizer(ref_model, precision), plugin.policy, max_norm=MAX_NORM
        )
        for _ in range(STEPS):
            booster.backward(criterion(model(x[mine]), y[mine]), opt)
            ref_opt.backward(nn.functional.mse_loss(ref(x).float(), y))
            got, want = opt.step(), ref_opt.step()
            assert got.skipped == want.skipped
            # The norm over all shards, not this rank's: equal to the one-process norm.
            torch.testing.assert_close(got.grad_norm, want.grad_norm, rtol=1e-3, atol=0)
            if stage == 2:  # a rank keeps no gradient of what another rank owns
                assert all(p.grad is None for i, p in enumerate(opt.all_params) if not opt.owns(i))
            opt.zero_grad()
            ref_opt.zero_grad()
        assert opt.skipped_steps < STEPS
        # Half-batch lp gradients round separately from the full batch's: about 1 eps of the
        # low dtype of a gradient clipped below 1; SGD moves a master by lr times it, momentum
        # 0.9 sums at most 10 of them. fp32: the sums only run in another order.
        tol = 10 * LR * torch.finfo(low).eps if precision != "fp32" else 1e-6
        ref_hp = {id(lp): hp for lp, hp in zip(ref_opt.lp_params, ref_opt.hp_masters, strict=True)}
        gathered = opt.hp_params()
        ref_params = list(ref_model.parameters())
        for hp, q in zip(gathered, ref_params, strict=True):
            torch.testing.assert_close(
                hp, ref_hp.get(id(q), q).float(), rtol=0, atol=tol, msg=f"{stage}/{precision}"
            )
        assert_same_on_every_rank(list(model.parameters()), f"{stage}/{precision} params")
        # The lp params are the masters rounded, on every rank (owners all-gathered them).
        for p, hp in zip(opt.all_params, gathered, strict=True):
            torch.testing.assert_close(p, hp.to(p.dtype), rtol=0, atol=0)

        # Sharded state, measured from each optimizer's own state: 1/world of the whole.
        sizes = _gather_ints(list(opt.shard_bytes().values()))
        whole_state = _nbytes(t for s in ref_opt.optim.state.values() for t in s.values())
        whole_masters = _nbytes(ref_opt.hp_masters)
        ref_params_held = [p for g in ref_opt.optim.param_groups for p in g["params"]]
        assert sizes[:, 0].sum() == whole_state and sizes[:, 1].sum() == whole_masters
        if world == 2:  # the model's sizes split evenly in two
            assert (sizes[:, 0] == whole_state // world).all(), sizes
            assert (sizes[:, 1] == whole_masters // world).all(), sizes
        # Each rank holds exactly the unsharded optimizer's bytes for the params it owns.
        ref_bytes = [_nbytes(ref_opt.optim.state.get(p, {}).values()) for p in ref_params_held]
        ref_bytes = [
            b + (_nbytes([ref_hp[id(q)]]) if id(q) in ref_hp else 0)
            for b, q in zip(ref_bytes, ref_params, strict=True)
        ]
        for r in range(world):
            assert sizes[r].sum() == sum(
                b for b, o in zip(ref_bytes, opt.owners, strict=True) if o == r
            )
        if precision != "fp32":
            assert whole_masters > 0

        # A nan on rank 1 only, in a param rank 0 owns: every rank skips, nothing moves.
        params_before = [p.detach().clone() for p in opt.all_params]
        state_before = _state_tensors(opt)
        steps_before = [s["step"].clone() for s in opt.optim.state.values() if "step" in s]
        booster.backward(criterion(model(x[mine]), y[mine]), opt)
        if rank == 1:
            owned_by_0 = next(i for i, r in enumerate(opt.owners) if r == 0)
            opt.all_params[owned_by_0].grad.view(-1)[0] = float("nan")
        assert opt.step().skipped
        opt.zero_grad()
        for before, p in zip(params_before, opt.all_params, strict=True):
            torch.testing.assert_close(p, before, rtol=0, atol=0, equal_nan=False)
        for before, now in zip(state_before, _state_tensors(opt), strict=True):
            torch.testing.assert_close(now, before, rtol=0, atol=0)
        assert [s["step"] for s in opt.optim.state.values() if "step" in s] == steps_before
        assert_same_on_every_rank(scaler_state(opt), f"{stage}/{precision} scaler")


@pytest.mark.slow
@pytest.mark.distributed
def test_zero_four_ranks_equal_one_process() -> None:
    from dist_utils import spawn

    # Two of the six cases (each stage, each low dtype): 4 processes share 2 cores in CI.
    spawn(_equality_worker, 4, [(1, "bf16"), (2, "fp16")])


def test_partition_is_greedy_largest_first() -> None:
    assert partition_params([256, 16, 256, 16], 2) == [0, 0, 1, 1]
    assert partition_params([10, 1, 1, 1], 2) == [0, 1, 1, 1]
    assert partition_params([5], 3) == [0]


def test_stage_3_asks_for_fsdp() -> None:
    with pytest.raises(ValueError, match=r"stage=3.*TorchFSDPPlugin"):
        LowLevelZeroPlugin(stage=3)
    with pytest.raises(ValueError, match=r"precision='fp8'.*'fp16', 'bf16', 'fp32'"):
        LowLevelZeroPlugin(precision="fp8")
    with pytest.raises(TypeError, match="cpu_offload='yes'"):
        LowLevelZeroPlugin(cpu_offload="yes")
    with pytest.raises(ValueError, match="growth_factor"):
        LowLevelZeroPlugin(growth_factor=0.5)
    with pytest.raises(ValueError, match=r"communication_dtype='fp16'.*torch.float16"):
        LowLevelZeroPlugin(communication_dtype="fp16")


def test_booster_precision_and_plugin_precision_conflict() -> None:
    booster = Booster(mixed_precision="fp16", plugin=LowLevelZeroPlugin(precision="bf16"))
    model = zero_model()
    with pytest.raises(ValueError, match=r"mixed_precision.*precision='bf16'"):
        booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("stage", [1, 2])
def test_world_of_one_trains_and_says_it_shards_nothing(
    stage: int, caplog: pytest.LogCaptureFixture
) -> None:
    x, y = _data(8)
    model = zero_model()
    ref_model = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        booster = Booster(
            plugin=LowLevelZeroPlugin(stage=stage, precision="bf16", cpu_offload=True)
        )
        model, opt, criterion, *_ = booster.boost(
            model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss()
        )
    assert "shards nothing" in caplog.text
    assert "nothing to offload" in caplog.text  # cpu_offload on CPU: a no-op that says so
    policy = booster.plugin.policy
    ref = prepare_model(ref_model, policy)
    ref_opt = prepare_optimizer(torch.optim.SGD(ref_model.parameters(), lr=0.1), policy)
    for _ in range(3):
        booster.backward(criterion(model(x), y), opt)
        ref_opt.backward(nn.functional.mse_loss(ref(x).float(), y))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    # One rank: the same math in the same order as the unsharded optimizer, bit for bit.
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert opt.shard_bytes()["master_weights"] == sum(
        m.numel() * m.element_size() for m in ref_opt.hp_masters
    )


def test_zero_optimizer_refuses_an_optimizer_with_state() -> None:
    model = zero_model()
    inner = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, WIDTH)).sum().backward()
    inner.step()
    with pytest.raises(ValueError, match="already holds state"):
        ZeroOptimizer(inner, stage=1)
    with pytest.raises(ValueError, match=r"stage=0.*Stage 3"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=0)


# ----- the config face: zero=dict(level=...) next to fp16=dict(mode=...) -----
CONFIG_MODES = {
    "fp32": None,
    "fp16": {"mode": AMP_TYPE.TORCH},
    "bf16": {"mode": "bf16"},
    "fp16_naive": {"mode": AMP_TYPE.NAIVE, "initial_scale": 2**8},
    "O2": {"mode": AMP_TYPE.APEX, "opt_level": "O2"},
    "fp8": {"mode": "fp8"},
}


def _config_worker(rank: int, world: int) -> None:
    from dist_utils import assert_same_on_every_rank
    from torch.distributed.fsdp import FSDPModule

    from mixprec.engine import initialize

    x, y = _data(4 * world)
    mine = slice(rank * 4, (rank + 1) * 4)
    for level in (1, 2, 3):
        for name, fp16 in CONFIG_MODES.items():
            torch.manual_seed(rank)  # different inits: ZeRO must start every rank from rank 0's
            model = zero_model()
            config = {"zero": {"level": level}, "clip_grad_norm": 1.0}
            if fp16 is not None:
                config["fp16"] = fp16
            engine, *_ = initialize(
                model, torch.optim.AdamW(model.parameters(), lr=LR), nn.MSELoss(), config=config
            )
            for _ in range(2):
                engine.zero_grad()
                loss = engine.criterion(engine(x[mine]), y[mine])
                engine.backward(loss)
                engine.step()
                assert torch.isfinite(loss), f"level {level} {name}"
            what = f"level {level} {name}"
            assert engine.optimizer.max_norm == 1.0, what  # the config's clip, every plugin
            if level == 3:
                assert isinstance(engine.model.module, FSDPModule), what
                params = [p.full_tensor() for p in engine.model.parameters()]
            else:
                opt = engine.optimizer
                assert isinstance(opt, ZeroOptimizer) and opt.stage == level, what
                sizes = _gather_ints([sum(opt.shard_bytes().values())])
                assert (sizes < sizes.sum()).all() and (sizes > 0).all(), f"{what}: {sizes}"
                params = list(engine.model.parameters())
            assert_same_on_every_rank(params, what)
            if level == 2 and name == "fp16_naive":
                _engine_resumes_bitwise(engine, config, x[mine], y[mine])


def _engine_resumes_bitwise(engine: Any, config: dict, x: torch.Tensor, y: torch.Tensor) -> None:
    """Each rank's Engine.state_dict (its own ZeRO shard) resumes that rank bit for bit."""
    from mixprec.engine import initialize

    saved = copy.deepcopy(engine.state_dict())
    model = zero_model()
    twin, *_ = initialize(
        model, torch.optim.AdamW(model.parameters(), lr=LR), nn.MSELoss(), config=config
    )
    twin.load_state_dict(saved)
    for run in (engine, twin):
        run.zero_grad()
        run.backward(run.criterion(run(x), y))
        run.step()
    for p, q in zip(engine.model.parameters(), twin.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    for p, q in zip(engine.optimizer.hp_params(), twin.optimizer.hp_params(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("zero", "match"),
    [
        ({"level": 2, "stage": 1}, r"Unknown zero config key 'stage'.*'cpu_offload', 'level'"),
        ({"level": 4}, r"level=4; valid: 1 .* 3"),
        ({}, r"level=None"),
        ({"level": True}, r"level=True"),
        ({"level": 1, "model_config": {}}, r"\['model_config'\].*legacy"),
    ],
)
def test_bad_zero_sections_name_the_key(zero: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_config({"fp16": {"mode": AMP_TYPE.NAIVE}, "zero": zero})
    with pytest.raises(TypeError, match="cpu_offload='no'"):
        load_config({"zero": {"level": 1, "cpu_offload": "no"}})


def test_known_unsupported_config_section_is_an_error() -> None:
    with pytest.raises(ValueError, match="'gradient_handler' is not supported"):
        load_config({"gradient_handler": [{"type": "DataParallelGradientHandler"}]})


def test_config_zero_in_a_world_of_one(caplog: pytest.LogCaptureFixture) -> None:
    from mixprec.engine import initialize

    model = zero_model()
    config = {"fp16": {"mode": AMP_TYPE.NAIVE}, "zero": {"level": 2, "cpu_offload": True}}
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        engine, *_ = initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    assert isinstance(engine.optimizer, ZeroOptimizer) and engine.optimizer.stage == 2
    assert "shards nothing" in caplog.text and "nothing to offload" in caplog.text


# ----- checkpoints: gathered files that load on any world size, sharded or not -----
def _half_steps(booster, model, opt, criterion, x, y, steps: int) -> None:  # noqa: ANN001
    for _ in range(steps):
        booster.backward(criterion(model(x), y), opt)
        opt.step()
        opt.zero_grad()


def _checkpoint_worker(rank: int, world: int, directory: str) -> None:
    from dist_utils import assert_same_on_every_rank, scaler_state

    from mixprec.core.checkpoint import (
        hp_model_state_dict,
        load_checkpoint,
        load_hp_model_state_dict,
        save_checkpoint,
    )

    x, y = _data(8 * world)
    mine = slice(rank * 8, (rank + 1) * 8)
    solo = dist.new_group([0])  # the unsharded run: rank 0 alone
    for stage, precision in [(2, "fp16"), (1, "fp32")]:
        path = f"{directory}/{stage}{precision}"

        def boosted(stage: int = stage, precision: str = precision):  # noqa: ANN202
            torch.manual_seed(0)
            model = zero_model()
            booster = Booster(plugin=_plugin(stage, precision))
            return booster, *booster.boost(model, _optimizer(model, precision), nn.MSELoss())[:3]

        booster, model, opt, criterion = boosted()
        _half_steps(booster, model, opt, criterion, x[mine], y[mine], 2)
        booster.save_model(model, f"{path}-model.pt")
        booster.save_optimizer(opt, f"{path}-optim.pt")
        saved_masters = opt.hp_params()
        _half_steps(booster, model, opt, criterion, x[mine], y[mine], 2)

        # Resume on the same world size: bit for bit the run that never stopped.
        booster2, model2, opt2, criterion2 = boosted()
        _half_steps(booster2, model2, opt2, criterion2, x[mine], y[mine], 1)  # state to overwrite
        booster2.load_model(model2, f"{path}-model.pt")
        booster2.load_optimizer(opt2, f"{path}-optim.pt")
        assert (opt2.steps, opt2.skipped_steps) == (opt.steps - 2, opt.skipped_steps)
        _half_steps(booster2, model2, opt2, criterion2, x[mine], y[mine], 2)
        for a, b in zip(
            opt.hp_params() + list(model.parameters()),
            opt2.hp_params() + list(model2.parameters()),
            strict=True,
        ):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        for a, b in zip(_state_tensors(opt), _state_tensors(opt2), strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        assert_same_on_every_rank(scaler_state(opt2) + scaler_state(opt), "scalers")
        torch.testing.assert_close(scaler_state(opt2), scaler_state(opt), rtol=0, atol=0)

        # Into an unsharded run (rank 0 alone, the plain optimizer every other plugin uses):
        # masters bitwise; two full-batch steps continue where the 2-rank run went.
        if rank == 0:
            policy = booster.plugin.policy
            torch.manual_seed(5)
            plain = zero_model()
            ref = prepare_model(plain, policy)
            ref_opt = prepare_optimizer(
                _optimizer(plain, precision), policy, max_norm=MAX_NORM, process_group=solo
            )
            load_hp_model_state_dict(plain, load_checkpoint(f"{path}-model.pt"), ref_opt)
            ref_opt.load_state_dict(load_checkpoint(f"{path}-optim.pt"))
            hp = {id(lp): m for lp, m in zip(ref_opt.lp_params, ref_opt.hp_masters, strict=True)}
            for q, want in zip(plain.parameters(), saved_masters, strict=True):
                torch.testing.assert_close(hp.get(id(q), q).float(), want, rtol=0, atol=0)
            for _ in range(2):
                ref_opt.backward(nn.functional.mse_loss(ref(x).float(), y))
                ref_opt.step()
                ref_opt.zero_grad()
            low = torch.float16 if precision == "fp16" else torch.float32
            tol = 10 * LR * torch.finfo(low).eps if precision != "fp32" else 1e-6  # as above
            for q, want in zip(plain.parameters(), opt.hp_params(), strict=True):
                torch.testing.assert_close(hp.get(id(q), q).float(), want, rtol=0, atol=tol)
            # ... and back: its plain checkpoint into a sharded run.
            save_checkpoint(hp_model_state_dict(plain, ref_opt), f"{path}-plain-model.pt")
            save_checkpoint(ref_opt.state_dict(), f"{path}-plain-optim.pt")
            plain_masters = [hp.get(id(q), q).float() for q in plain.parameters()]
        else:
            opt.hp_params()  # the collective rank 0's check above took part in
        dist.barrier()
        booster3, model3, opt3, _ = boosted()
        booster3.load_model(model3, f"{path}-plain-model.pt")
        booster3.load_optimizer(opt3, f"{path}-plain-optim.pt")
        loaded = opt3.hp_params()
        if rank == 0:
            for got, want in zip(loaded, plain_masters, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert opt3.steps == opt.steps
        assert_same_on_every_rank(list(model3.parameters()), "lp params after loading")


def _two_rank_worker(rank: int, world: int, directory: str) -> None:
    _equality_worker(rank, world, CASES)
    _config_worker(rank, world)
    _checkpoint_worker(rank, world, directory)


@pytest.mark.slow
@pytest.mark.distributed
def test_zero_two_ranks(tmp_path) -> None:  # noqa: ANN001
    """One spawn (each costs seconds): stage x precision equality, sharded bytes and skips;
    the config face for every mode and level; checkpoints bitwise, unsharded and back."""
    from dist_utils import spawn

    spawn(_two_rank_worker, 2, str(tmp_path))


class _PartlyUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(WIDTH, WIDTH)
        self.unused = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_param_without_gradient_is_not_stepped(stage: int) -> None:
    from mixprec.core.policy import preset
    from mixprec.parallel.zero import prepare_zero_optimizer

    x, y = _data(8)
    policy = preset("fp16_naive", dtype="bfloat16")
    model, ref_model = _PartlyUsed(), _PartlyUsed()
    ref_model.load_state_dict(model.state_dict())
    unused_before = [p.detach().clone() for p in model.unused.parameters()]
    lp, ref = prepare_model(model, policy), prepare_model(ref_model, policy)
    opt = prepare_zero_optimizer(
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1), policy, stage=stage
    )
    ref_opt = prepare_optimizer(
        torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=0.1), policy
    )
    for _ in range(3):
        opt.backward(nn.functional.mse_loss(lp(x).float(), y))
        ref_opt.backward(nn.functional.mse_loss(ref(x).float(), y))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    # One rank runs the unsharded optimizer's math in its order: bit for bit. Weight decay
    # would move the unused Linear if a zero gradient stood in for the missing one.
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for p, before in zip(model.unused.parameters(), unused_before, strict=True):
        torch.testing.assert_close(p.float(), before.to(p.dtype).float(), rtol=0, atol=0)


def test_cpu_offload_from_an_accelerator_is_refused() -> None:
    from mixprec.parallel.zero import check_cpu_offload

    with pytest.raises(ValueError, match=r"cpu_offload=True on cuda:0.*not supported"):
        check_cpu_offload(True, torch.device("cuda", 0))
    check_cpu_offload(False, torch.device("cuda", 0))  # off: nothing to check


def test_zero_takes_the_policys_verbosity_and_refuses_several_losses() -> None:
    # The ZeRO optimizer is built by the same prepare_optimizer as every face's: a switch the
    # policy carries (verbosity, num_losses) is honoured or refused, never dropped.
    from dataclasses import replace

    from mixprec.core.policy import preset
    from mixprec.parallel.zero import prepare_zero_optimizer

    model = prepare_model(zero_model(), preset("fp16_naive"))
    quiet = replace(preset("fp16_naive"), verbosity=0)
    opt = prepare_zero_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), quiet, stage=1)
    assert isinstance(opt, ZeroOptimizer) and opt.verbosity == 0
    two_losses = replace(preset("fp16_naive"), num_losses=2)
    with pytest.raises(ValueError, match=r"num_losses=2 .*ZeroOptimizer does not have"):
        prepare_zero_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), two_losses, stage=1)


def _accumulation_worker(rank: int, world: int) -> None:
    """ZeRO against DDP over a plain fp32 copy and torch's SGD, 3 rounds of backward + step,
    with and without zero_grad() between them (torch's contract: the second step runs on
    g1 + g2; ZeRO used to step on g2, or g1 / world + g2)."""
    per_rank = 4
    x, y = _data(per_rank * world)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for stage in (1, 2):
        for precision in ("fp32", "bf16"):
            for zero_grad in (True, False):
                torch.manual_seed(0)
                model = zero_model()
                ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
                ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
                booster = Booster(plugin=LowLevelZeroPlugin(stage=stage, precision=precision))
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                model, opt, criterion, *_ = booster.boost(model, opt, nn.MSELoss())
                for _ in range(3):
                    booster.backward(criterion(model(x[mine]), y[mine]), opt)
                    nn.functional.mse_loss(ref(x[mine]), y[mine]).backward()
                    assert not opt.step().skipped
                    ref_opt.step()
                    if zero_grad:
                        opt.zero_grad()
                        ref_opt.zero_grad()
                # fp32: the same sums in another order. bf16: forward and backward round to
                # bf16 (grads ~2**-8 relative, x lr 0.1 x 3 steps of grads < 1); a step on g2
                # instead of g1 + g2 moves a weight by lr x |g1| ~ 1e-2.
                tol = 1e-6 if precision == "fp32" else 2e-3
                what = f"stage {stage} {precision} zero_grad={zero_grad}"
                for hp, q in zip(opt.hp_params(), ref.parameters(), strict=True):
                    torch.testing.assert_close(hp, q.detach(), rtol=0, atol=tol, msg=what)


@pytest.mark.distributed
def test_zero_accumulates_across_steps_as_ddp() -> None:
    from dist_utils import spawn

    spawn(_accumulation_worker, 2)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_plain_torch_optimizer_state_loads_into_zero_keeping_params_masters_and_scale(
    precision: str, tmp_path
) -> None:  # noqa: ANN001
    """A plain torch optimizer's state_dict (no fp32 masters, no scaler) loads its moments into
    ZeRO; the params, their fp32 masters and the loss scale stay, by the unsharded optimizer's
    rules (its load rebuilt them from zeroed stand-ins: the model's weights became 0)."""
    x, y = _data(8)
    model = zero_model()
    booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision=precision))
    model, opt, criterion, *_ = booster.boost(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), nn.MSELoss()
    )
    for _ in range(2):
        booster.backward(criterion(model(x), y), opt)
        opt.step()
        opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in opt.hp_masters]
    scale = opt.loss_scale
    plain = torch.optim.Adam([torch.zeros_like(p, dtype=torch.float32) for p in params], lr=1e-2)
    for p in plain.param_groups[0]["params"]:
        p.grad = torch.full_like(p, 0.5)
    plain.step()  # moments of a constant 0.5 gradient
    torch.save(plain.state_dict(), tmp_path / "plain.pt")
    booster.load_optimizer(opt, str(tmp_path / "plain.pt"))
    for p, q in zip(model.parameters(), params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for m, q in zip(opt.hp_masters, masters, strict=True):
        torch.testing.assert_close(m, q, rtol=0, atol=0)
    assert opt.loss_scale == scale
    for state in opt.optim.state.values():  # the loaded moments
        torch.testing.assert_close(state["exp_avg"], torch.full_like(state["exp_avg"], 0.05))
