"""HybridParallelPlugin beyond test_pipeline.py: Colossal's microbatch_size, gradients carried
across execute_pipeline rounds until zero_grad (g1 + g2), ZeRO over each stage's
data-parallel group (zero_stage with pp_size > 1: fp8 communication, a checkpoint loaded at
another data-parallel size), and ZeRO with tensor parallelism (over each tp index's
data-parallel group, on the DTensors' local shards).

References are one-process plain loops doing the same micro-batches in the same order: loss /
m times the scale, gradients summed in fp32 and carried unscaled between steps as torch leaves
them in .grad, stepped by a raw torch optimizer over fp32 masters.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import assert_same_on_every_rank, local_shard, scaler_state, spawn
from test_pipeline import (
    BATCH,
    LR,
    MODES,
    WIDTH,
    _batches,
    _boost,
    _check_skip_together,
    _local_weights,
    _model,
    _precision,
    _reference,
    _snapshot,
    _tp_plan,
)
from test_pipeline import M as M_
from tolerances import EXACT
from torch import nn

from mixprec.booster import Booster
from mixprec.booster.plugin import HybridParallelPlugin
from mixprec.core.policy import to_policy
from mixprec.core.prepare import FP32Criterion, prepare_model
from mixprec.parallel.pipeline.optim import PipelineZeroOptimizer

PP = 2


def _plain(mode: str, steps: list[tuple[list[Any], bool]], m: int) -> dict[str, torch.Tensor]:
    """One process: steps is [(the batches whose rounds come before this step, zero_grad after
    it)]. Gradients accumulate over micro-batches and rounds in one fp32 sum per param, in the
    scaled domain; a step unscales it (the step's grad), and a step without zero_grad leaves
    that grad to be brought back to the next round's scale (torch's contract: g1 + g2)."""
    policy = to_policy(MODES[mode])
    ref = prepare_model(_model(), policy)
    names, params = zip(*ref.module.named_parameters(), strict=True)
    masters = [p.detach().float().clone() if policy.master_weights else p for p in params]
    opt = torch.optim.SGD(masters, lr=LR, momentum=0.9)
    criterion = FP32Criterion(nn.MSELoss())
    scale = policy.loss_scale.init_scale  # no overflow and no growth within these steps
    carried: list[torch.Tensor | None] = [None] * len(params)
    for batches, zero_after in steps:
        acc = [None if c is None else c * scale for c in carried]
        for x, y in batches:
            for xb, yb in zip(x.chunk(m), y.chunk(m), strict=True):
                ((criterion(ref(xb), yb) / m).float() * scale).backward()
                for i, p in enumerate(params):
                    g = p.grad.float()
                    acc[i] = g.clone() if acc[i] is None else acc[i].add_(g)
                    p.grad = None
        for master, a in zip(masters, acc, strict=True):
            master.grad = a * (1.0 / scale)  # a power of two: exact
        opt.step()
        carried = [None if zero_after else master.grad.clone() for master in masters]
        opt.zero_grad()
        with torch.no_grad():
            for p, master in zip(params, masters, strict=True):
                p.copy_(master)
    return {n: m.detach().clone() for n, m in zip(names, masters, strict=True)}


# ----- two processes (pp=2): microbatch_size, and g1 + g2 -----
def _microbatch_size(rank: int) -> None:
    """microbatch_size=2 on batches of 8 is num_microbatches=4, bit for bit; a batch it does
    not split, or one of too few micro-batches for 1f1b, is refused on every rank."""
    batches = _batches(3)
    got = []
    for split in ({"num_microbatches": 4}, {"microbatch_size": BATCH // 4}):
        plugin = HybridParallelPlugin(pp_size=PP, precision="fp32", **split)
        booster = Booster(plugin=plugin)
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        model, optimizer, criterion, *_ = booster.boost(model, optimizer, nn.MSELoss())
        losses = []
        for batch in batches:
            out = booster.execute_pipeline(iter([batch]), model, criterion, optimizer)
            losses.append(out["loss"])
            assert not optimizer.step().skipped
            optimizer.zero_grad()
        got.append((_local_weights(model, optimizer), losses))
    (by_count, count_losses), (by_size, size_losses) = got
    for name, w in by_count.items():
        torch.testing.assert_close(by_size[name], w, **EXACT, msg=f"microbatch_size: {name}")
    if rank == PP - 1:  # the last stage reports the loss, the same mean of 4 micro-batches
        torch.testing.assert_close(torch.stack(size_losses), torch.stack(count_losses), **EXACT)
    for size, match in (
        (4, "batch of 6 samples .* microbatch_size=4"),
        (6, r"num_microbatches=1 \(batch 6 / microbatch_size=6\) < pp_size=2"),
    ):
        plugin = HybridParallelPlugin(pp_size=PP, precision="fp32", microbatch_size=size)
        booster = Booster(plugin=plugin)
        model = _model()
        model, optimizer, criterion, *_ = booster.boost(
            model, torch.optim.SGD(model.parameters(), lr=LR), nn.MSELoss()
        )
        batch = (torch.randn(6, WIDTH), torch.randn(6, WIDTH))
        with pytest.raises(ValueError, match=match):
            booster.execute_pipeline(iter([batch]), model, criterion, optimizer)
        dist.barrier()  # every rank raised: none waits in a send or receive


def _carries_grads(rank: int) -> None:
    """Two rounds, step, a third round with no zero_grad, step: torch's g1 + g2 (the second
    step's grads are the first's plus the third round's), as the plain loop, bit for bit."""
    a, b, c = _batches(3)
    steps = [([a, b], False), ([c], True)]
    for mode in ("fp32", "fp16", "fp16_naive"):  # own params, own params scaled, masters
        expected = _plain(mode, steps, 4)
        booster, model, optimizer, criterion = _boost(mode)
        for batches, zero_after in steps:
            for batch in batches:
                booster.execute_pipeline(iter([batch]), model, criterion, optimizer)
            assert not optimizer.step().skipped
            if zero_after:
                optimizer.zero_grad()
        for name, w in _local_weights(model, optimizer).items():
            torch.testing.assert_close(w, expected[name], **EXACT, msg=f"{mode} g1+g2: {name}")
        assert_same_on_every_rank(scaler_state(optimizer), f"{mode} scaler")
        # zero_grad drops what the steps left: a fresh round then steps on its own grads only
        fresh = _plain(mode, [*steps, ([a], True)], 4)
        booster.execute_pipeline(iter([a]), model, criterion, optimizer)
        assert not optimizer.step().skipped
        for name, w in _local_weights(model, optimizer).items():
            torch.testing.assert_close(w, fresh[name], **EXACT, msg=f"{mode} after zero: {name}")


def _two_worker(rank: int, world: int) -> None:
    _microbatch_size(rank)
    _carries_grads(rank)


@pytest.mark.distributed
def test_microbatch_size_and_gradients_carried_until_zero_grad() -> None:
    spawn(_two_worker, PP)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"num_microbatches": 4, "microbatch_size": 2},
            "num_microbatches=4 and microbatch_size=2 both",
        ),
        ({}, "num_microbatches=None and microbatch_size=None"),
        ({"microbatch_size": 0}, "microbatch_size=0"),
        ({"microbatch_size": True}, "microbatch_size=True"),
    ],
)
def test_microbatch_size_is_checked(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HybridParallelPlugin(pp_size=PP, **kwargs)


# ----- four processes (pp=2 x dp=2): ZeRO over each stage's data-parallel group -----
# fp16 params sum their micro-batch grads in fp16 under ZeRO (Colossal-AI's accumulation; the
# pipeline without ZeRO sums in fp32): each of the M - 1 adds rounds by at most 2**-11 relative,
# of grads that stay below 1 here, so a step's grad differs by < M * 2**-11; SGD(momentum 0.9)
# moves a weight by LR / (1 - 0.9) times that per step at most, over the steps run.
ZERO_STEPS = 4
FP16_ACCUMULATION = {"rtol": 0, "atol": ZERO_STEPS * LR / (1 - 0.9) * M_ * 2**-11}


def _zero_equals_pipeline(rank: int) -> None:
    """Each replica trains on its own batches; ZeRO-sharded stages equal the one-process loop
    (fp32: bit for bit, the same sums in the same order) and the plugin without ZeRO (fp16
    params: within FP16_ACCUMULATION); replicas agree bit for bit."""
    replica = rank // PP  # the (dp, pp) mesh puts a replica's stages on adjacent ranks
    batches = _batches(2 * ZERO_STEPS)
    # fp32 against the loop for both stages; fp16 params against the pipeline without ZeRO
    for mode, stages in (("fp32", (1, 2)), ("fp16_naive", (0, 2))):
        runs = {}
        for stage in stages:
            booster, model, optimizer, criterion = _boost(mode, zero_stage=stage)
            assert isinstance(optimizer, PipelineZeroOptimizer) == (stage > 0)
            for step in range(ZERO_STEPS):
                mine = batches[2 * step + replica]
                booster.execute_pipeline(iter([mine]), model, criterion, optimizer)
                assert not optimizer.step().skipped
                optimizer.zero_grad()
            # fp32 weights: the masters (under ZeRO gathered from their owners), else params
            weights = (
                _gathered_masters(model, optimizer) if stage else _local_weights(model, optimizer)
            )
            runs[stage] = {n: w.detach().clone() for n, w in weights.items()}
            if stage:  # each replica holds half of its stage's masters and state
                others: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(others, sorted(_held_names(model, optimizer)))
                twin = others[(rank + PP) % len(others)]
                mine_names = others[rank]
                assert mine_names and twin and not set(mine_names) & set(twin), (mine_names, twin)
                assert set(mine_names) | set(twin) == set(runs[stage]), rank
        expected = _reference(mode, batches, replicas=2) if mode == "fp32" else runs[0]
        tol = EXACT if mode == "fp32" else FP16_ACCUMULATION
        for stage in stages[-1:] if mode == "fp16_naive" else stages:
            for name, w in runs[stage].items():
                torch.testing.assert_close(w, expected[name], **tol, msg=f"{mode} z{stage} {name}")
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, runs[2])
        for name, w in runs[2].items():
            torch.testing.assert_close(everyone[(rank + PP) % 4][name], w, **EXACT, msg=name)


def _zero_clips_globally(rank: int) -> None:
    """max_norm under ZeRO clips by the norm over every stage's every shard (each rank sums the
    squares of the grads it owns, over the world): the one-process clip within rounding."""
    replica = rank // PP
    batches = _batches(2 * 3)
    max_norm = 0.05  # far below these gradients' norm: every step clips
    expected = _reference("fp32", batches, max_norm=max_norm, replicas=2)
    booster, model, optimizer, criterion = _boost("fp32", max_norm=max_norm, zero_stage=2)
    for step in range(3):
        mine = batches[2 * step + replica]
        booster.execute_pipeline(iter([mine]), model, criterion, optimizer)
        result = optimizer.step()
        assert not result.skipped and result.grad_norm > max_norm
        optimizer.zero_grad()
    for name, w in _params(model).items():
        # as test_pipeline's global clipping: the norm summed per shard, then over the world
        # (another order than torch's): a few fp32 ulps in the coefficient, 3 steps
        torch.testing.assert_close(w, expected[name], rtol=1e-5, atol=1e-6, msg=name)


# Under ZeRO the grad a step leaves is kept by its owner only, times the replica count, so the
# next reduction adds it as (2c + t0) + t1 where the pipeline without ZeRO adds (c + t0) + (c +
# t1): a few fp32 ulps of a gradient, times LR, over two steps.
CARRY_SUM_ORDER = {"rtol": 1e-6, "atol": 1e-6}


def _zero_carries_grads(rank: int) -> None:
    """g1 + g2 under ZeRO over the stages' replicas: as the pipeline without ZeRO (which
    test_microbatch_size_and_gradients_carried_until_zero_grad holds to the plain loop)."""
    replica = rank // PP
    batches = _batches(6)
    runs = []
    for stage in (0, 2):
        booster, model, optimizer, criterion = _boost("fp32", zero_stage=stage)
        for rounds, zero_after in (((0, 1), False), ((2,), True)):
            for r in rounds:
                mine = batches[2 * r + replica]
                booster.execute_pipeline(iter([mine]), model, criterion, optimizer)
            assert not optimizer.step().skipped
            if zero_after:
                optimizer.zero_grad()
        runs.append({n: p.detach().clone() for n, p in _params(model).items()})
    plain, zero = runs
    for name, w in zero.items():
        torch.testing.assert_close(w, plain[name], **CARRY_SUM_ORDER, msg=f"g1+g2: {name}")
        assert not torch.equal(w, _model().state_dict()[name]), name  # it trained


def _params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p for stage in model.stages for n, p in stage.module.named_parameters()}


def _held_names(model: Any, optimizer: Any) -> list[str]:
    """The names of the params whose master / state this rank's optimizer holds."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    lp_of = dict(zip(map(id, optimizer.hp_masters), optimizer.lp_params, strict=True))
    ids = {id(lp_of[i]) if i in lp_of else i for i in held}
    return [n for n, p in _params(model).items() if id(p) in ids]


def _zero_checkpoint_resume(rank: int, path: str) -> None:
    """Each rank saves its shard under the unsplit model's names; a fresh ZeRO run loaded from
    the directory continues bit for bit, and the whole model loads it in one piece."""
    from mixprec.booster.plugin import Plugin

    adamw = lambda ps: torch.optim.AdamW(ps, lr=LR)  # noqa: E731 - state with a step count
    replica = rank // PP
    batches = _batches(2 * 4)

    def train(booster: Any, model: Any, optimizer: Any, criterion: Any, steps: range) -> None:
        for step in steps:
            mine = batches[2 * step + replica]
            booster.execute_pipeline(iter([mine]), model, criterion, optimizer)
            assert not optimizer.step().skipped
            optimizer.zero_grad()

    booster, model, optimizer, criterion = _boost("fp16_naive", optim=adamw, zero_stage=2)
    train(booster, model, optimizer, criterion, range(2))
    booster.save_model(model, f"{path}/model")
    booster.save_optimizer(optimizer, f"{path}/optim")
    saved = {n: m.clone() for n, m in _gathered_masters(model, optimizer).items()}
    train(booster, model, optimizer, criterion, range(2, 4))

    booster2, model2, optimizer2, criterion2 = _boost("fp16_naive", optim=adamw, zero_stage=2)
    booster2.load_model(model2, f"{path}/model")
    booster2.load_optimizer(optimizer2, f"{path}/optim")
    assert optimizer2.steps == 2 and optimizer2.state
    train(booster2, model2, optimizer2, criterion2, range(2, 4))
    resumed = _snapshot(model2, optimizer2) + scaler_state(optimizer2)
    for i, (a, b) in enumerate(
        zip(resumed, _snapshot(model, optimizer) + scaler_state(optimizer), strict=True)
    ):
        torch.testing.assert_close(a, b, **EXACT, msg=f"resumed tensor {i}")
    whole = _model()
    Plugin().load_model(whole, f"{path}/model", None)
    params = dict(whole.named_parameters())
    for name, w in saved.items():  # the owners' fp32 masters, not the fp16 params
        torch.testing.assert_close(params[name], w, **EXACT, msg=f"whole model: {name}")


def _gathered_masters(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in _params(model).items()}
    return {
        names[id(p)]: hp
        for p, hp in zip(optimizer.all_params, optimizer.hp_params(), strict=True)
        if id(p) in names
    }


# ----- ZeRO over pipeline stages: fp8 communication, and a checkpoint at another dp size -----
def _replica_grads(batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One replica's fp32 gradient of the whole model on its batch (M micro-batches summed):
    what it hands to the data-parallel reduction."""
    model = _model()
    x, y = batch
    for xb, yb in zip(x.chunk(M_), y.chunk(M_), strict=True):
        (nn.functional.mse_loss(model(xb), yb) / M_).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _zero_fp8_pipeline(rank: int) -> None:
    """fp8_communication=True under ZeRO-2 over pp=2 x dp=2: one SGD(lr=1) step applies the
    replicas' mean gradient within test_zero_comm's fp8 bound of the fp32-communicated one."""
    from test_zero_comm import E5M2, fp8_sum_bound

    replica = rank // PP
    batches = _batches(2)
    sgd = lambda ps: torch.optim.SGD(ps, lr=1.0)  # noqa: E731 - the step is the mean gradient
    deltas = []
    for fp8 in (False, True):
        booster, model, optimizer, criterion = _boost(
            "fp32", optim=sgd, zero_stage=2, fp8_communication=fp8
        )
        before = {n: w.clone() for n, w in _gathered_masters(model, optimizer).items()}
        booster.execute_pipeline(iter([batches[replica]]), model, criterion, optimizer)
        assert not optimizer.step().skipped
        after = _gathered_masters(model, optimizer)
        deltas.append({n: before[n] - after[n] for n in before})
    # Each rank's fp8 scale comes from the amax of one bucket of its stage's grads, at most the
    # whole model's amax, which fp8_sum_bound's rows give (a smaller amax only tightens it).
    grads = [_replica_grads(b) for b in batches]
    names = list(grads[0])
    rows = torch.stack([torch.cat([g[n].reshape(-1) for n in names]) for g in grads])
    bound = fp8_sum_bound(rows, E5M2, requantized=False) / 2  # each owner sums in fp32
    bounds = dict(zip(names, bound.split([grads[0][n].numel() for n in names]), strict=True))
    ref, got = deltas
    assert ref
    for name, d in got.items():
        err = (d.double() - ref[name].double()).abs().reshape(-1)
        slack = 2**-22 * (1 + ref[name].abs().double().reshape(-1))  # w - g rounded in fp32
        assert (err <= bounds[name] + slack).all(), (name, float(err.max()))
    assert max(float((d - ref[n]).abs().max()) for n, d in got.items()) > 0  # it went fp8


def _zero_save_at_dp2(rank: int, path: str) -> None:
    """A ZeRO-2 pipeline checkpoint at pp=2 x dp=2, and (rank 0) what it must load back as:
    the fp32 masters and every rank's optimizer state, by name."""
    from mixprec.parallel.pipeline.checkpoint import pipeline_optimizer_state

    adamw = lambda ps: torch.optim.AdamW(ps, lr=LR)  # noqa: E731
    booster, model, optimizer, criterion = _boost("fp16_naive", optim=adamw, zero_stage=2)
    batches = _batches(4)
    for step in range(2):
        booster.execute_pipeline(
            iter([batches[2 * step + rank // PP]]), model, criterion, optimizer
        )
        assert not optimizer.step().skipped
        optimizer.zero_grad()
    booster.save_model(model, f"{path}/dp2_model")
    booster.save_optimizer(optimizer, f"{path}/dp2_optim")
    mine = {
        "masters": {n: w.clone() for n, w in _gathered_masters(model, optimizer).items()},
        "state": {
            k: v for k, v in pipeline_optimizer_state(model, optimizer).items() if "state." in k
        },
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        merged: dict[str, dict[str, Any]] = {"masters": {}, "state": {}}
        for part in everyone:
            for kind in merged:
                merged[kind].update(part[kind])
        merged["steps"] = optimizer.steps
        merged["scaler"] = scaler_state(optimizer)
        torch.save(merged, f"{path}/dp2_expected.pt")


def _zero_load_at_dp1(rank: int, world: int, path: str) -> None:
    """That checkpoint loads at pp=2 x dp=1 (state stored by parameter name): every master and
    state tensor as saved, bit for bit, the scaler and step count too; training goes on."""
    from mixprec.parallel.pipeline.checkpoint import pipeline_optimizer_state

    expected = torch.load(f"{path}/dp2_expected.pt", weights_only=True)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=LR)  # noqa: E731
    booster, model, optimizer, criterion = _boost("fp16_naive", optim=adamw, zero_stage=2)
    booster.load_model(model, f"{path}/dp2_model")
    booster.load_optimizer(optimizer, f"{path}/dp2_optim")
    masters = _gathered_masters(model, optimizer)
    assert masters
    for name, w in masters.items():
        torch.testing.assert_close(w, expected["masters"][name], **EXACT, msg=name)
    state = {k: v for k, v in pipeline_optimizer_state(model, optimizer).items() if "state." in k}
    assert state and any(k.endswith("exp_avg") for k in state)
    for key, value in state.items():
        torch.testing.assert_close(value, expected["state"][key], **EXACT, msg=key)
    assert optimizer.steps == expected["steps"] == 2
    for a, b in zip(scaler_state(optimizer), expected["scaler"], strict=True):
        torch.testing.assert_close(a, b, **EXACT)
    booster.execute_pipeline(iter(_batches(1)), model, criterion, optimizer)
    assert not optimizer.step().skipped


def _four_worker(rank: int, world: int, path: str) -> None:
    _zero_equals_pipeline(rank)
    _zero_carries_grads(rank)
    _zero_clips_globally(rank)
    _check_skip_together(rank, "fp16_naive", functools.partial(_boost, zero_stage=1))
    _zero_checkpoint_resume(rank, path)
    _zero_fp8_pipeline(rank)
    fp8_zero = functools.partial(_boost, zero_stage=1, fp8_communication=True)
    _check_skip_together(rank, "fp16_naive", fp8_zero)  # skips agree bit for bit
    _zero_save_at_dp2(rank, path)


@pytest.mark.distributed
@pytest.mark.slow
def test_zero_over_each_pipeline_stages_data_parallel_group(tmp_path: Any) -> None:
    """pp=2 x dp=2 in one spawn (4 processes start slowly on 2 cores), fp8 communication
    included; then pp=2 x dp=1 loads the checkpoint it saved at dp=2."""
    spawn(_four_worker, 2 * PP, str(tmp_path))
    spawn(_zero_load_at_dp1, PP, str(tmp_path))


# ----- ZeRO with tensor parallelism: tp=2 x dp=2 (pp=1), on each DTensor's local shard -----
TP = 2
# A row-parallel layer sums two partial products where one process sums one: fp32 roundings of
# the reordered sums, a few ulps a step (test_pipeline's pp x tp bound against the same loop).
TP_ROUNDING = {"rtol": 1e-5, "atol": 1e-6}


def _tp_boost(mode: str, zero_stage: int = 0, max_norm: float = 0.0, optim: Any = None) -> tuple:
    """HybridParallelPlugin(pp_size=1, tp_size=2) over 4 ranks: (dp, pp, tp) = (2, 1, 2)."""
    plugin = HybridParallelPlugin(
        pp_size=1,
        tp_size=TP,
        tp_plan=_tp_plan(),
        precision=None,
        max_norm=max_norm,
        zero_stage=zero_stage,
    )
    booster = Booster(plugin=plugin, mixed_precision=_precision(mode))
    model = _model()
    make = optim or (lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9))
    model, optimizer, criterion, _, _ = booster.boost(model, make(model.parameters()), nn.MSELoss())
    assert isinstance(optimizer, PipelineZeroOptimizer) == (zero_stage > 0)
    return booster, model, optimizer, criterion


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _tp_backward(run: tuple, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """pp_size=1 runs the ordinary loop: M_ backward passes of loss / M_ accumulate, the same
    micro-batches the one-process reference (and a pipeline) runs."""
    booster, model, optimizer, criterion = run
    x, y = batch
    for xb, yb in zip(x.chunk(M_), y.chunk(M_), strict=True):
        booster.backward(criterion(model(xb), yb) / M_, optimizer)


def _tp_train(run: tuple, batches: list, steps: range, replica: int) -> list[torch.Tensor]:
    """Steps on this replica's batches (alternating entries); returns each step's grad norm."""
    _, _, optimizer, _ = run
    norms = []
    for step in steps:
        _tp_backward(run, batches[2 * step + replica])
        result = optimizer.step()
        assert not result.skipped
        norms.append(result.grad_norm)
        optimizer.zero_grad()
    return norms


def _tp_weights(run: tuple) -> dict[str, torch.Tensor]:
    """Every param's whole fp32 value (masters gathered from their owners, then over tp)."""
    _, model, optimizer, _ = run
    zero = isinstance(optimizer, PipelineZeroOptimizer)
    weights = _gathered_masters(model, optimizer) if zero else _local_weights(model, optimizer)
    return {n: _full(w).detach().clone() for n, w in weights.items()}


def _tp_local_state(run: tuple) -> dict[str, torch.Tensor]:
    """This rank's local shards of params, held masters and optimizer state, by name."""
    from mixprec.parallel.pipeline.checkpoint import pipeline_optimizer_state

    _, model, optimizer, _ = run
    names = {id(p): n for n, p in _params(model).items()}
    out = {f"param {n}": p for n, p in _params(model).items()}
    for lp, hp in zip(optimizer.lp_params, optimizer.hp_masters, strict=True):
        out[f"master {names[id(lp)]}"] = hp
    for key, value in pipeline_optimizer_state(model, optimizer).items():
        if key.startswith("state.") and torch.is_tensor(value):  # the scaler is checked apart
            out[key] = value
    return {k: local_shard(v).detach().clone() for k, v in out.items()}


def _zero_tp_equals(rank: int) -> None:
    """ZeRO-1/2 over each tp index's data-parallel group equals the same plugin without ZeRO
    (fp32: bit for bit, the same sums in the same order; fp16 params: within
    FP16_ACCUMULATION) and the one-process loop (TP_ROUNDING); each rank holds half of its tp
    index's masters, replicas agree bit for bit."""
    from torch.distributed.tensor import DTensor

    replica = rank // TP
    batches = _batches(2 * ZERO_STEPS)
    for mode in ("fp32", "fp16_naive"):
        runs = {}
        for stage in (0, 1, 2) if mode == "fp32" else (0, 2):
            run = _tp_boost(mode, zero_stage=stage)
            assert any(isinstance(p, DTensor) for p in run[1].parameters())
            _tp_train(run, batches, range(ZERO_STEPS), replica)
            runs[stage] = _tp_weights(run)
            if stage:
                names: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(names, sorted(_held_names(run[1], run[2])))
                twin = names[(rank + TP) % len(names)]  # this tp index, the other replica
                assert names[rank] and twin and not set(names[rank]) & set(twin), names
                assert set(names[rank]) | set(twin) == set(runs[stage])
                assert names[rank] == names[rank ^ 1]  # tp peers own the same params
        expected = _reference(mode, batches, replicas=2) if mode == "fp32" else None
        for stage in runs:
            for name, w in runs[stage].items():
                if stage:
                    tol = EXACT if mode == "fp32" else FP16_ACCUMULATION
                    msg = f"{mode} tp z{stage} vs no ZeRO: {name}"
                    torch.testing.assert_close(w, runs[0][name], **tol, msg=msg)
                if expected is not None:
                    msg = f"{mode} tp z{stage} vs one process: {name}"
                    torch.testing.assert_close(w, expected[name], **TP_ROUNDING, msg=msg)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, runs[2])
        for name, w in runs[2].items():
            torch.testing.assert_close(everyone[(rank + TP) % 4][name], w, **EXACT, msg=name)


def _zero_tp_clips(rank: int) -> None:
    """max_norm under ZeRO x tp: the norm counts each element once (a sharded param's shards
    summed over tp, a tp-replicated one not twice), as the plugin without ZeRO and the
    one-process clip."""
    replica = rank // TP
    batches = _batches(2 * 3)
    max_norm = 0.05  # far below these gradients' norm: every step clips
    expected = _reference("fp32", batches, max_norm=max_norm, replicas=2)
    plain = _tp_boost("fp32", max_norm=max_norm)
    zero = _tp_boost("fp32", zero_stage=2, max_norm=max_norm)
    plain_norms = _tp_train(plain, batches, range(3), replica)
    zero_norms = _tp_train(zero, batches, range(3), replica)
    for a, b in zip(zero_norms, plain_norms, strict=True):
        assert float(b) > max_norm
        # the same squares summed in another order (per shard, then over the ranks)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    for name, w in _tp_weights(zero).items():
        torch.testing.assert_close(w, expected[name], **TP_ROUNDING, msg=f"clipped: {name}")


def _zero_tp_skips(rank: int) -> None:
    """An inf in one local shard on one rank (tp 1 of replica 1): all four ranks skip, nothing
    moves bit for bit (params, masters, AdamW state), the scalers agree."""
    adamw = lambda ps: torch.optim.AdamW(ps, lr=LR)  # noqa: E731 - state with a step count
    run = _tp_boost("fp16_naive", zero_stage=2, optim=adamw)
    booster, model, optimizer, criterion = run
    batches = _batches(2)
    _tp_train(run, batches, range(1), replica=0)  # a clean step first: AdamW has state
    before = _tp_local_state(run)
    if rank == 3:
        first = next(model.parameters())
        first.register_hook(lambda g: local_shard(g).view(-1).__setitem__(0, float("inf")) or g)
    _tp_backward(run, batches[1])
    result = optimizer.step()
    optimizer.zero_grad()
    assert result.skipped, f"rank {rank} stepped although rank 3 overflowed"
    after = _tp_local_state(run)
    assert after.keys() == before.keys() and any(k.endswith("exp_avg") for k in after)
    for key, value in after.items():
        torch.testing.assert_close(value, before[key], **EXACT, msg=f"{key} moved on a skip")
    assert_same_on_every_rank(
        [torch.tensor([float(result.skipped), float(optimizer.steps)]), *scaler_state(optimizer)],
        "tp x ZeRO skip flag, step count and scaler",
    )


def _zero_tp_checkpoint_resume(rank: int, path: str) -> None:
    """A ZeRO x tp checkpoint (each owner's DTensor shards under the unsplit names) resumes bit
    for bit, and the whole model loads it in one piece."""
    from mixprec.booster.plugin import Plugin

    adamw = lambda ps: torch.optim.AdamW(ps, lr=LR)  # noqa: E731
    replica = rank // TP
    batches = _batches(2 * 4)
    first = _tp_boost("fp16_naive", zero_stage=2, optim=adamw)
    booster = first[0]
    _tp_train(first, batches, range(2), replica)
    booster.save_model(first[1], f"{path}/tp_model")
    booster.save_optimizer(first[2], f"{path}/tp_optim")
    saved = _tp_weights(first)
    _tp_train(first, batches, range(2, 4), replica)

    second = _tp_boost("fp16_naive", zero_stage=2, optim=adamw)
    second[0].load_model(second[1], f"{path}/tp_model")
    second[0].load_optimizer(second[2], f"{path}/tp_optim")
    assert second[2].steps == 2 and second[2].state
    _tp_train(second, batches, range(2, 4), replica)
    ours, theirs = _tp_local_state(second), _tp_local_state(first)
    assert ours.keys() == theirs.keys() and any(k.endswith("exp_avg") for k in ours)
    for key, value in ours.items():
        torch.testing.assert_close(value, theirs[key], **EXACT, msg=f"resumed {key}")
    assert_same_on_every_rank(scaler_state(second[2]), "resumed scaler")
    whole = _model()
    Plugin().load_model(whole, f"{path}/tp_model", None)
    for name, p in whole.named_parameters():  # the owners' fp32 masters, not the fp16 params
        torch.testing.assert_close(p.detach(), saved[name], **EXACT, msg=f"whole model: {name}")


def _zero_pp_tp(rank: int) -> None:
    """pp=2 x tp=2 x dp=1 on the same four processes: the pp x tp x dp path with one replica
    (each shard group is one rank). The clip norm's parts are summed over both stages of a tp
    index: ZeRO-2 with clipping equals the plugin without ZeRO and the one-process clip."""
    tp = {"tp_size": TP, "tp_plan": _tp_plan()}
    batches = _batches(3)
    max_norm = 0.05  # every step clips, by the norm over stages and shards
    expected = _reference("fp32", batches, max_norm=max_norm)
    norms, weights = {}, {}
    for stage in (0, 2):
        booster, model, optimizer, criterion = _boost(
            "fp32", max_norm=max_norm, zero_stage=stage, **tp
        )
        assert isinstance(optimizer, PipelineZeroOptimizer) == (stage > 0)
        norms[stage] = []
        for batch in batches:
            booster.execute_pipeline(iter([batch]), model, criterion, optimizer)
            result = optimizer.step()
            assert not result.skipped
            norms[stage].append(result.grad_norm)
            optimizer.zero_grad()
        weights[stage] = {n: _full(w).clone() for n, w in _local_weights(model, optimizer).items()}
    for a, b in zip(norms[2], norms[0], strict=True):
        assert float(b) > max_norm
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)  # the same squares, reordered
    assert weights[2]
    for name, w in weights[2].items():
        torch.testing.assert_close(w, weights[0][name], **TP_ROUNDING, msg=f"pp x tp z2: {name}")
        torch.testing.assert_close(w, expected[name], **TP_ROUNDING, msg=f"pp x tp clip: {name}")


def _tp_four_worker(rank: int, world: int, path: str) -> None:
    _zero_tp_equals(rank)
    _zero_pp_tp(rank)
    _zero_tp_clips(rank)
    _zero_tp_skips(rank)
    _zero_tp_checkpoint_resume(rank, path)


@pytest.mark.distributed
@pytest.mark.slow
def test_zero_with_tensor_parallel_over_each_tp_index(tmp_path: Any) -> None:
    """tp=2 x dp=2, then pp=2 x tp=2 x dp=1, in one spawn (4 processes start slowly on 2
    cores)."""
    spawn(_tp_four_worker, 2 * TP, str(tmp_path))


def test_zero_with_a_pipeline_or_tp_refuses_overlap_communication() -> None:
    sizes: dict[str, Any]
    for sizes in (
        {"pp_size": 2, "num_microbatches": 2},
        {"tp_size": 2, "tp_plan": {"0": object()}},
    ):
        with pytest.raises(ValueError, match="overlap_communication=True, pp_size=.*tp_size="):
            HybridParallelPlugin(**sizes, zero_stage=1, overlap_communication=True)
