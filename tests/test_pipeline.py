"""Pipeline parallelism (HybridParallelPlugin, torch.distributed.pipelining) under every mode.

Two gloo ranks hold two stages of an nn.Sequential (four with the interleaved schedule). The
reference is one process running the same micro-batches with a hand-written loop: loss / m
times the scale, gradients summed in fp32, unscaled, stepped by a raw torch optimizer over fp32
masters. The micro-batches, their order and every op are the same, so the pipelined weights
must equal the reference's bit for bit (rtol=0, atol=0); only clipping, whose norm is summed
over the stages in another order, gets a tolerance.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import assert_same_on_every_rank, scaler_state, spawn
from torch import nn

from mixprec.booster import Booster
from mixprec.booster.plugin import HybridParallelPlugin, TorchDDPPlugin
from mixprec.core.policy import to_policy
from mixprec.core.prepare import FP32Criterion, prepare_model
from mixprec.core.scaling import LossScaler
from mixprec.parallel.pipeline.schedule import PipelineConfig, stage_modules
from mixprec.parallel.pipeline.split import balanced_boundaries

WORLD = 2
WIDTH = 16  # tiny (fp16 matmuls on CPU are very slow), yet fp8's GEMMs need multiples of 16
M = 4  # micro-batches per batch
BATCH = 8
STEPS = 10
LR = 0.05
# fp16 scales start low enough that O(1) gradients times the scale stay far below fp16's max
# (no skip in the equality runs), and grow never within STEPS (intervals >= 1000).
MODES: dict[str, Any] = {
    "fp32": "fp32",
    "bf16": "bf16",
    "fp16": {"mode": "fp16", "init_scale": 2.0**10},
    "fp16_naive": {"mode": "fp16_naive", "initial_scale": 2.0**8},
    "fp8": "fp8",
}
# Every schedule for a mode without masters and one with them (the fp32 accumulation hooks);
# the schedule only reorders micro-batches, which the other modes do not see differently.
SCHEDULES_OF: dict[str, tuple[str, ...]] = {
    "fp32": ("1f1b", "gpipe", "interleaved"),
    "bf16": ("1f1b",),
    "fp16": ("1f1b",),
    "fp16_naive": ("1f1b", "gpipe", "interleaved"),
    "fp8": ("1f1b",),
}
PRECISIONS: dict[str, Any] = {  # the same modes as the Booster's precision objects take them
    "fp32": "fp32",
    "bf16": "bf16",
    "fp16": ("fp16", {"init_scale": 2.0**10}),
    "fp16_naive": ("fp16_naive", {"initial_scale": 2.0**8}),
    "fp8": "fp8",
}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, 2 * WIDTH),
        nn.ReLU(),
        nn.Linear(2 * WIDTH, 2 * WIDTH),
        nn.ReLU(),
        nn.Linear(2 * WIDTH, 2 * WIDTH),
        nn.ReLU(),
        nn.Linear(2 * WIDTH, WIDTH),
    )


def _batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)  # the same batches on every rank
    return [
        (torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g))
        for _ in range(n)
    ]


def _precision(mode: str) -> Any:
    from mixprec.mixed_precision import MODE_TO_PRECISION

    spec = PRECISIONS[mode]
    if isinstance(spec, str):
        return spec
    name, kwargs = spec
    return MODE_TO_PRECISION[name](**kwargs)


def _reference(
    mode: str, batches: list, max_norm: float = 0.0, replicas: int = 1
) -> dict[str, torch.Tensor]:
    """One process, plain torch: the pipelined run must land on these weights (fp32 view).

    With replicas > 1, each step's batch is `replicas` consecutive entries of batches, one per
    data-parallel replica; their fp32 gradient sums are added and divided by replicas (what
    an all-reduce of 2 then a halving computes, bit for bit).
    """
    policy = to_policy(MODES[mode])
    ref = prepare_model(_model(), policy)
    names, params = zip(*ref.module.named_parameters(), strict=True)
    masters = [p.detach().float().clone() if policy.master_weights else p for p in params]
    opt = torch.optim.SGD(masters, lr=LR, momentum=0.9)
    criterion = FP32Criterion(nn.MSELoss())
    scale = policy.loss_scale.init_scale
    for step in range(len(batches) // replicas):
        total: list[torch.Tensor] = []
        for x, y in batches[step * replicas : (step + 1) * replicas]:
            acc: list[torch.Tensor | None] = [None] * len(params)
            for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True):
                ((criterion(ref(xb), yb) / M).float() * scale).backward()
                for i, p in enumerate(params):
                    g = p.grad.float()
                    acc[i] = g if acc[i] is None else acc[i].add_(g)  # summed in fp32
                    p.grad = None
            total = list(acc) if not total else [t + a for t, a in zip(total, acc, strict=True)]
        for master, t in zip(masters, total, strict=True):
            master.grad = t / replicas * (1.0 / scale)  # powers of two: both exact
        if max_norm:
            torch.nn.utils.clip_grad_norm_(masters, max_norm)
        opt.step()
        opt.zero_grad()  # fp32 modes: the masters are the params, whose next grads start fresh
        with torch.no_grad():
            for p, master in zip(params, masters, strict=True):
                p.copy_(master)
    return {n: m.detach().clone() for n, m in zip(names, masters, strict=True)}


def _boost(
    mode: str, schedule: str = "1f1b", max_norm: float = 0.0, optim: Any = None, **tp: Any
) -> tuple:
    spec = _precision(mode)  # mixprec's modes: the Booster's (the plugin's precision=None)
    plugin = HybridParallelPlugin(
        pp_size=WORLD,
        num_microbatches=M,
        precision=None,
        pp_schedule=schedule,
        max_norm=max_norm,
        **tp,
    )
    booster = Booster(plugin=plugin, mixed_precision=spec)
    model = _model()
    optimizer = (optim or (lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9)))(model.parameters())
    model, optimizer, criterion, _, _ = booster.boost(model, optimizer, nn.MSELoss())
    return booster, model, optimizer, criterion


def _local_weights(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """This rank's params by their name in the unsplit model, as fp32 (masters if any)."""
    master_of = dict(zip(map(id, optimizer.lp_params), optimizer.hp_masters, strict=True))
    return {
        name: master_of.get(id(p), p).detach()
        for stage in model.stages
        for name, p in stage.module.named_parameters()
    }


def _train(mode: str, schedule: str, batches: list, max_norm: float = 0.0) -> tuple:
    booster, model, optimizer, criterion = _boost(mode, schedule, max_norm)
    losses = []
    for batch in batches:
        out = booster.execute_pipeline(iter([batch]), model, criterion, optimizer)
        losses.append(out["loss"])
        assert not optimizer.step().skipped
        optimizer.zero_grad()
    return model, optimizer, losses


def _check_equal_to_reference(rank: int, modes: tuple[str, ...]) -> None:
    batches = _batches()
    for mode in modes:
        expected = _reference(mode, batches)
        for schedule in SCHEDULES_OF[mode]:
            model, optimizer, losses = _train(mode, schedule, batches)
            got = _local_weights(model, optimizer)
            assert got, f"rank {rank} holds no params"
            if mode == "fp8":  # the stages' Linears really run float8 GEMMs
                kinds = {type(m).__name__ for stage in model.stages for m in stage.modules()}
                assert any("Float8" in kind for kind in kinds), kinds
            for name, w in got.items():
                torch.testing.assert_close(
                    w, expected[name], rtol=0, atol=0, msg=f"{mode} {schedule}: {name}"
                )
            if model.has_last_stage:  # the loss is the mean of the micro-batch losses
                assert all(loss is not None and torch.isfinite(loss) for loss in losses)
            else:
                assert all(loss is None for loss in losses)
            assert_same_on_every_rank(scaler_state(optimizer), f"{mode} {schedule} scaler")


def _check_global_clipping(rank: int) -> None:
    """max_norm clips by the norm over both stages: the single-process clip within rounding."""
    batches = _batches(3)
    max_norm = 0.05  # far below these gradients' norm: every step clips
    expected = _reference("fp16_naive", batches, max_norm=max_norm)
    model, optimizer, _ = _train("fp16_naive", "1f1b", batches, max_norm=max_norm)
    assert optimizer.last_result.grad_norm > max_norm
    for name, w in _local_weights(model, optimizer).items():
        # The norm is summed per stage then across stages (another order than torch's): a few
        # fp32 ulps in the clip coefficient, times LR-sized updates, 3 steps with momentum.
        torch.testing.assert_close(w, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def _snapshot(model: Any, optimizer: Any) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for s in model.stages for p in s.parameters()]
    tensors += [m.detach().clone() for m in optimizer.hp_masters]
    for state in optimizer.state.values():
        tensors += [v.detach().clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _check_skip_together(rank: int, mode: str, boost: Any = None) -> None:
    """An inf in one micro-batch's gradient on stage 0 only: every rank skips, bit for bit.
    boost: what builds the run (default _boost; test_hybrid_parallel.py passes ZeRO's)."""
    booster, model, optimizer, criterion = (boost or _boost)(
        mode, optim=lambda ps: torch.optim.AdamW(ps, lr=LR)
    )
    batches = _batches(2)
    booster.execute_pipeline(iter([batches[0]]), model, criterion, optimizer)
    assert not optimizer.step().skipped  # a clean step first: AdamW has state and a count
    optimizer.zero_grad()
    before = _snapshot(model, optimizer)
    scale_before = optimizer.loss_scale
    handles = []
    if rank == 0:  # stage 0 of the first replica only
        calls = []

        def poison(grad: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            if len(calls) == 3:  # the third micro-batch only
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")
            return grad

        first = next(model.stages[0].parameters())
        handles.append(first.register_hook(poison))
    booster.execute_pipeline(iter([batches[1]]), model, criterion, optimizer)
    result = optimizer.step()
    optimizer.zero_grad()
    for h in handles:
        h.remove()
    assert result.skipped, f"rank {rank} stepped although stage 0 overflowed"
    for i, (a, b) in enumerate(zip(_snapshot(model, optimizer), before, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{mode}: tensor {i} moved")
    expected = LossScaler(to_policy(MODES[mode]).loss_scale)
    expected.update(torch.zeros(1))
    expected.update(torch.ones(1))
    assert expected.scale == optimizer.loss_scale, (mode, expected.scale, optimizer.loss_scale)
    if mode == "fp16":  # torch's rule: the one overflow halves the scale
        assert optimizer.loss_scale == scale_before / 2
    assert_same_on_every_rank(
        [torch.tensor([float(result.skipped), float(optimizer.steps)]), *scaler_state(optimizer)],
        f"{mode}: skip flag, step count and scaler",
    )


def _numerics_worker(rank: int, world: int) -> None:
    _check_equal_to_reference(rank, tuple(MODES))
    _check_global_clipping(rank)
    for mode in MODES:
        _check_skip_together(rank, mode)


@pytest.mark.distributed
def test_pipeline_equals_one_process_clips_globally_and_skips_together() -> None:
    """One spawn for the numerics (starting processes costs seconds on this CPU)."""
    spawn(_numerics_worker, WORLD)


def _dp_worker(rank: int, world: int) -> None:
    """pp=2 x dp=2: each replica trains on its own batches; all equal the one-process loop."""
    replica = rank // WORLD  # the (dp, pp) mesh puts a replica's stages on adjacent ranks
    batches = _batches(2 * 4)  # 4 steps, alternating replica 0's and replica 1's batch
    for mode in ("fp32", "fp16_naive"):
        expected = _reference(mode, batches, replicas=2)
        booster, model, optimizer, criterion = _boost(mode)
        for step in range(4):
            mine = batches[2 * step + replica]
            booster.execute_pipeline(iter([mine]), model, criterion, optimizer)
            assert not optimizer.step().skipped
            optimizer.zero_grad()
        got = _local_weights(model, optimizer)
        for name, w in got.items():
            torch.testing.assert_close(w, expected[name], rtol=0, atol=0, msg=f"{mode}: {name}")
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, got)
        twin = everyone[(rank + WORLD) % world]  # the same stage in the other replica
        for name, w in got.items():
            torch.testing.assert_close(twin[name], w, rtol=0, atol=0, msg=f"replicas: {name}")
    _check_skip_together(rank, "fp16")  # an inf on replica 0's stage 0 skips all four ranks
    # prepare_dataloader shards over replicas only: a replica's two stages read the same data.
    data = torch.utils.data.TensorDataset(torch.arange(16.0))
    loader = booster.plugin.prepare_dataloader(data, batch_size=4, shuffle=True)
    samples = torch.cat([b[0] for b in loader])
    everyone = [None] * world
    dist.all_gather_object(everyone, samples)
    torch.testing.assert_close(everyone[rank ^ 1], samples, rtol=0, atol=0)  # the other stage
    other_replica = everyone[(rank + WORLD) % world]
    assert sorted(torch.cat([samples, other_replica]).tolist()) == list(range(16))


def _tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    # Megatron's pairs inside each stage (layers 0-2 | 3-6): column- then row-parallel.
    return {
        "0": ColwiseParallel(),
        "2": RowwiseParallel(),
        "4": ColwiseParallel(),
        "6": RowwiseParallel(),
    }


def _tp_worker(rank: int, world: int) -> None:
    """pp=2 x tp=2: the one-process loop within fp32 rounding; a skip agreed by all four."""
    from torch.distributed.tensor import DTensor

    tp = {"tp_size": 2, "tp_plan": _tp_plan()}
    batches = _batches(4)
    for max_norm in (0.0, 0.05):  # 0.05: every step clips, by the norm over stages and shards
        expected = _reference("fp32", batches, max_norm=max_norm)
        booster, model, optimizer, criterion = _boost("fp32", max_norm=max_norm, **tp)
        assert any(isinstance(p, DTensor) for s in model.stages for p in s.parameters())
        for batch in batches:
            booster.execute_pipeline(iter([batch]), model, criterion, optimizer)
            assert not optimizer.step().skipped
            optimizer.zero_grad()
        for name, w in _local_weights(model, optimizer).items():
            full = w.full_tensor() if isinstance(w, DTensor) else w
            # A row-parallel layer sums two partial products where one process sums one:
            # fp32 roundings of the reordered sums, a few ulps a step over 4 steps.
            torch.testing.assert_close(full, expected[name], rtol=1e-5, atol=1e-6, msg=name)

    booster, model, optimizer, criterion = _boost("fp16", **tp)
    before = [
        (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for s in model.stages
        for p in s.parameters()
    ]
    if rank == 0:  # one shard of one param on one of the four ranks
        first = next(model.stages[0].parameters())
        first.register_hook(lambda g: g.to_local().view(-1).__setitem__(0, float("inf")) or g)
    booster.execute_pipeline(iter(_batches(1)), model, criterion, optimizer)
    assert optimizer.step().skipped, f"rank {rank} stepped although rank 0 overflowed"
    after = [
        (p.to_local() if isinstance(p, DTensor) else p)
        for s in model.stages
        for p in s.parameters()
    ]
    for a, b in zip(after, before, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert_same_on_every_rank(scaler_state(optimizer), "pp x tp scaler")


def _tp_checkpoint_resume(path: str) -> None:
    """pp=2 x tp=2 checkpoints (DTensor shards, sharded AdamW state) resume bit for bit."""
    from torch.distributed.tensor import DTensor

    from mixprec.parallel.pipeline.checkpoint import pipeline_optimizer_state

    def local(t: Any) -> Any:
        return t.to_local() if isinstance(t, DTensor) else t

    tp = {"tp_size": 2, "tp_plan": _tp_plan()}
    adamw = lambda ps: torch.optim.AdamW(ps, lr=LR)  # noqa: E731 - sharded state, a step count
    runs = [_boost("fp16_naive", optim=adamw, **tp)]
    booster, model, optimizer, criterion = runs[0]
    for batch in _batches(2):
        booster.execute_pipeline(iter([batch]), model, criterion, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    booster.save_model(model, f"{path}/tp_model")
    booster.save_optimizer(optimizer, f"{path}/tp_optim")
    runs.append(_boost("fp16_naive", optim=adamw, **tp))
    runs[1][0].load_model(runs[1][1], f"{path}/tp_model")
    runs[1][0].load_optimizer(runs[1][2], f"{path}/tp_optim")
    for booster, model, optimizer, criterion in runs:  # the same next step, saved and resumed
        booster.execute_pipeline(iter(_batches(3)[2:]), model, criterion, optimizer)
        optimizer.step()
    (_, m0, o0, _), (_, m1, o1, _) = runs
    s0, s1 = pipeline_optimizer_state(m0, o0), pipeline_optimizer_state(m1, o1)
    assert s0.keys() == s1.keys() and any(k.endswith("exp_avg") for k in s0)
    for key, value in s0.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(local(s1[key]), local(value), rtol=0, atol=0, msg=key)
        else:
            assert s1[key] == value, key
    for a, b in zip(m0.parameters(), m1.parameters(), strict=True):
        torch.testing.assert_close(local(b), local(a), rtol=0, atol=0)


def _four_worker(rank: int, world: int, path: str) -> None:
    _dp_worker(rank, world)
    _tp_worker(rank, world)
    _tp_checkpoint_resume(path)


@pytest.mark.distributed
@pytest.mark.slow
def test_pipeline_times_data_and_tensor_parallel_on_four_processes(tmp_path: Path) -> None:
    """pp=2 x dp=2, then pp=2 x tp=2, in one spawn (4 processes start slowly on 2 cores)."""
    spawn(_four_worker, 2 * WORLD, str(tmp_path))


def _raises_everywhere(fn: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        fn()
    dist.barrier()  # every rank got here: none is left waiting in a collective


def _bad_input_worker(rank: int, world: int) -> None:
    _raises_everywhere(
        lambda: HybridParallelPlugin(pp_size=3, num_microbatches=4), ValueError, "pp_size=3"
    )
    _raises_everywhere(lambda: _boost_with(nn.Sequential(nn.Linear(2, 2))), ValueError, "1 layers")
    _raises_everywhere(
        lambda: _boost_with(_model(), split_points=["9"]), ValueError, "Split point '9'"
    )
    booster, model, optimizer, criterion = _boost("fp32")
    odd = (torch.randn(6, WIDTH), torch.randn(6, WIDTH))
    _raises_everywhere(
        lambda: booster.execute_pipeline(iter([odd]), model, criterion, optimizer),
        ValueError,
        "6 samples",
    )
    # The pipeline still runs after the refusal.
    booster.execute_pipeline(iter(_batches(1)), model, criterion, optimizer)
    assert not optimizer.step().skipped
    # A short last batch (60 samples in batches of 8: 4 left) splits into M micro-batches, but
    # not of the shape the stages were built for. On main: torch's "Expected input batch_size
    # (2) to match target batch_size (1)" on one rank, "Connection closed by peer" on the other.
    short = (torch.randn(60 % BATCH, WIDTH), torch.randn(60 % BATCH, WIDTH))
    _raises_everywhere(
        lambda: booster.execute_pipeline(iter([short]), model, criterion, optimizer),
        ValueError,
        r"batch of 4 samples differs from the 8 .* drop_last=True",
    )
    booster.execute_pipeline(iter(_batches(1)), model, criterion, optimizer)
    assert not optimizer.step().skipped
    _raises_everywhere(
        lambda: Booster(plugin=TorchDDPPlugin()).execute_pipeline(
            iter([]), model, criterion, optimizer
        ),
        TypeError,
        "HybridParallelPlugin",
    )


def _boost_with(model: nn.Module, **kwargs: Any) -> None:
    plugin = HybridParallelPlugin(pp_size=WORLD, num_microbatches=M, **kwargs)
    Booster(plugin=plugin).boost(model, torch.optim.SGD(model.parameters(), lr=LR))


def _config_face(rank: int) -> None:
    """initialize + parallel=dict(pipeline=2): execute_schedule equals the one-process loop."""
    from mixprec.amp_type import AMP_TYPE
    from mixprec.engine import initialize

    batches = _batches(3)
    data = torch.utils.data.TensorDataset(
        torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
    )
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    config = {
        "fp16": {"mode": AMP_TYPE.NAIVE, "initial_scale": 2.0**8},
        "parallel": {"pipeline": WORLD},
        "NUM_MICRO_BATCHES": M,
    }
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    engine, loader, _, _ = initialize(model, optimizer, nn.MSELoss(), loader, config=config)
    engine.train()
    seen = []
    for batch in loader:
        seen.append(batch)
        engine.zero_grad()
        output, label, loss = engine.execute_schedule(iter([batch]))
        if engine.model.has_last_stage:
            assert output.shape == label.shape == (BATCH, WIDTH)
            torch.testing.assert_close(label, batch[1], rtol=0, atol=0)
            assert torch.isfinite(loss)
        else:
            assert output is label is loss is None
        assert not engine.step().skipped
    assert len(seen) == len(batches)
    stats = engine.skip_stats  # the counters every Engine shares (EngineBase)
    assert (stats.steps, stats.skipped_steps, engine.skipped_steps) == (len(batches), 0, 0)
    assert engine.training and engine.loss_scale == 2.0**8
    # Both stages read the same shuffled batches (else inputs and labels would not match).
    assert_same_on_every_rank([t for batch in seen for t in batch], "batches each stage read")
    expected = _reference("fp16_naive", seen)
    for name, w in _local_weights(engine.model, engine.optimizer).items():
        torch.testing.assert_close(w, expected[name], rtol=0, atol=0, msg=f"engine: {name}")
    before = _snapshot(engine.model, engine.optimizer)
    engine.eval()
    assert not engine.training
    _, _, loss = engine.execute_schedule(iter(batches), forward_only=True)
    assert (loss is not None) == engine.model.has_last_stage
    assert engine.optimizer.lp_params[0].grad is None  # forward only: no gradient
    for a, b in zip(_snapshot(engine.model, engine.optimizer), before, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _checkpoint_resume(rank: int, path: str) -> None:
    """Each stage saves its part; a fresh run loaded from it continues bit for bit, and the
    whole model loads the directory in one piece."""
    from mixprec.booster.plugin import Plugin

    adamw = lambda ps: torch.optim.AdamW(ps, lr=LR)  # noqa: E731 - state with a step count
    batches = _batches(5)

    def train(booster: Any, model: Any, optimizer: Any, criterion: Any, part: list) -> None:
        for batch in part:
            booster.execute_pipeline(iter([batch]), model, criterion, optimizer)
            optimizer.step()
            optimizer.zero_grad()

    booster, model, optimizer, criterion = _boost("fp16_naive", optim=adamw)
    train(booster, model, optimizer, criterion, batches[:3])
    booster.save_model(model, f"{path}/model")
    booster.save_optimizer(optimizer, f"{path}/optim")
    saved = {k: v.clone() for k, v in _local_weights(model, optimizer).items()}
    train(booster, model, optimizer, criterion, batches[3:])

    booster2, model2, optimizer2, criterion2 = _boost("fp16_naive", optim=adamw)
    booster2.load_model(model2, f"{path}/model")
    booster2.load_optimizer(optimizer2, f"{path}/optim")
    assert optimizer2.steps == 3 and optimizer2.state
    train(booster2, model2, optimizer2, criterion2, batches[3:])
    resumed = _snapshot(model2, optimizer2) + scaler_state(optimizer2)
    for i, (a, b) in enumerate(
        zip(resumed, _snapshot(model, optimizer) + scaler_state(optimizer), strict=True)
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"resumed tensor {i}")

    whole = _model()  # the unsplit model, as one process would build it
    Plugin().load_model(whole, f"{path}/model", None)
    params = dict(whole.named_parameters())
    for name, w in saved.items():
        torch.testing.assert_close(params[name], w, rtol=0, atol=0, msg=f"whole model: {name}")


def _own_stages(rank: int, path: str) -> None:
    """A model given as its stage modules: trains like the same layers in one process, and
    its checkpoint loads into the whole ModuleList."""
    from mixprec.booster.plugin import Plugin

    def stages() -> nn.ModuleList:
        torch.manual_seed(0)
        return nn.ModuleList(
            [nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU()), nn.Linear(2 * WIDTH, WIDTH)]
        )

    ref = nn.Sequential(*stages())  # the same layers, the same names ("0.0.weight", "1.weight")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    booster = Booster(
        plugin=HybridParallelPlugin(pp_size=WORLD, num_microbatches=M, precision="fp32")
    )
    model = stages()
    model, optimizer, criterion, _, _ = booster.boost(
        model, torch.optim.SGD(model.parameters(), lr=LR), nn.MSELoss()
    )
    for x, y in _batches(2):
        booster.execute_pipeline(iter([(x, y)]), model, criterion, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        for xb, yb in zip(x.chunk(M), y.chunk(M), strict=True):
            (nn.functional.mse_loss(ref(xb), yb) / M).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    expected = dict(ref.named_parameters())
    got = {
        prefix + name: p
        for prefix, stage in zip(model.stage_prefixes, model.stages, strict=True)
        for name, p in stage.module.named_parameters()
    }
    assert got
    for name, p in got.items():
        torch.testing.assert_close(p, expected[name], rtol=0, atol=0, msg=name)
    booster.save_model(model, f"{path}/stages")
    whole = stages()
    Plugin().load_model(whole, f"{path}/stages", None)
    for name, p in whole.named_parameters():
        torch.testing.assert_close(p, expected[name], rtol=0, atol=0, msg=f"loaded {name}")


def _faces_worker(rank: int, world: int, path: str) -> None:
    _bad_input_worker(rank, world)
    _config_face(rank)
    _checkpoint_resume(rank, path)
    _own_stages(rank, path)


@pytest.mark.distributed
def test_bad_input_config_face_and_checkpoints(tmp_path: Any) -> None:
    spawn(_faces_worker, WORLD, str(tmp_path))


def _failing_rank(rank: int, how: str, rendezvous: str, out: str) -> None:
    from datetime import timedelta

    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
    )
    booster, model, optimizer, criterion = _boost("fp32")
    if rank == 1:  # the last stage's process dies (or hangs) inside its first forward
        fail = (lambda *a: os._exit(3)) if how == "exits" else (lambda *a: time.sleep(600))
        model.stages[0].register_forward_hook(fail)
    t0 = time.monotonic()
    try:
        booster.execute_pipeline(iter(_batches(1)), model, criterion, optimizer)
        optimizer.step()
        Path(out).write_text("no error")
    except Exception as exc:  # what a surviving rank sees: an error, not a hang
        Path(out).write_text(f"{time.monotonic() - t0:.1f} {type(exc).__name__}: {exc}")


PG_TIMEOUT_S = 3  # seconds; torch defaults to 30 minutes


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["exits", "hangs"])
def test_a_failed_rank_makes_the_other_raise(how: str, tmp_path: Path) -> None:
    """A peer that exits resets gloo's connection (the survivor raises at once); one that hangs
    holds the survivor only until the process group's timeout."""
    ctx = torch.multiprocessing.get_context("spawn")
    out = tmp_path / "rank0.txt"
    procs = [
        ctx.Process(target=_failing_rank, args=(r, how, str(tmp_path / "rdzv"), str(out)))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    procs[0].join(120)
    for p in procs:
        if p.is_alive():
            p.kill()  # the hung rank: what a launcher does once a peer has failed
        p.join()
    assert procs[0].exitcode == 0, "the surviving rank hung or crashed"
    text = out.read_text()
    assert text != "no error"
    seconds, error = text.split(" ", 1)
    assert "RuntimeError" in error or "DistBackendError" in error, error
    if how == "hangs":
        assert PG_TIMEOUT_S <= float(seconds) < 60, (seconds, error)


@pytest.mark.parametrize(
    ("parallel", "extra", "match"),
    [
        ({"pipeline": 2}, {}, "needs NUM_MICRO_BATCHES"),
        ({"pipe": 2}, {"NUM_MICRO_BATCHES": 4}, "Unknown parallel key 'pipe'"),
        ({"pipeline": 2, "tensor": {"size": 2}}, {"NUM_MICRO_BATCHES": 4}, "tensor size 1"),
        ({"pipeline": 0}, {}, "parallel.pipeline=0"),
    ],
)
def test_config_parallel_section_is_checked(
    parallel: dict[str, Any], extra: dict[str, Any], match: str
) -> None:
    from mixprec.config import validate_config

    with pytest.raises(ValueError, match=match):
        validate_config({"parallel": parallel, **extra})


# ----- single process: the plugin's arguments and the stage split -----
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pp_size": 2, "num_microbatches": 1}, "num_microbatches=1 < pp_size=2"),
        ({"pp_size": 2, "num_microbatches": 4, "pp_schedule": "zb"}, "Unknown pp_schedule 'zb'"),
        ({"pp_size": 2, "num_microbatches": 4, "precision": "fp17"}, "Unknown mixed_precision"),
        ({"pp_size": 2, "num_microbatches": 4, "tp_size": 2}, "tp_size=2"),
        ({"pp_size": 2}, "num_microbatches=None"),
        ({"pp_size": 0, "num_microbatches": 4}, "pp_size=0"),
        ({"pp_size": 2, "num_microbatches": 4, "max_norm": -1.0}, "max_norm=-1.0"),
        (
            {
                "pp_size": 2,
                "num_microbatches": 4,
                "pp_schedule": "interleaved",
                "num_model_chunks": 1,
            },
            "num_model_chunks=1",
        ),
        ({"pp_size": 2, "num_microbatches": 5, "pp_schedule": "interleaved"}, "multiple of"),
    ],
)
def test_plugin_rejects_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HybridParallelPlugin(**kwargs)


def test_plugin_and_booster_precision_must_agree() -> None:
    from mixprec.mixed_precision import to_mixed_precision

    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=2, precision="fp16")
    with pytest.raises(ValueError, match="mixed_precision='bf16'.*precision='colossal_fp16'"):
        plugin._precision(to_mixed_precision("bf16"))
    # Colossal's 'fp16' (its default): fp16 params, fp32 masters, its dynamic scaler
    policy = plugin._precision(to_mixed_precision(None)).policy
    assert (policy.name, policy.param_dtype, policy.master_weights) == (
        "colossal_fp16",
        torch.float16,
        True,
    )
    assert policy.loss_scale.init_scale == 2**16 and policy.loss_scale.hysteresis == 2


def test_gpipe_takes_fewer_microbatches_than_stages() -> None:
    HybridParallelPlugin(pp_size=4, num_microbatches=2, pp_schedule="gpipe")


def test_execute_pipeline_without_pipeline_plugin() -> None:
    with pytest.raises(TypeError, match="HybridParallelPlugin"):
        Booster().execute_pipeline(iter([]), nn.Linear(2, 2), nn.MSELoss(), None)


def test_boost_without_process_group_raises() -> None:
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=2)
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        Booster(plugin=plugin).boost(_model())


@pytest.mark.parametrize(
    ("sizes", "parts", "starts"),
    [
        ([144, 0, 272, 0, 272, 0, 136], 2, [0, 3]),  # 416 | 408
        ([5, 5, 5, 5], 4, [0, 1, 2, 3]),
        ([1, 1, 1, 9], 2, [0, 3]),
        ([9, 1, 1, 1], 2, [0, 1]),
        ([0, 0, 0], 3, [0, 1, 2]),  # parameter-free layers still give every stage one
    ],
)
def test_balanced_boundaries(sizes: list[int], parts: int, starts: list[int]) -> None:
    assert balanced_boundaries(sizes, parts) == starts


def test_stages_split_by_params_and_at_named_points() -> None:
    model = _model()
    stages = stage_modules(model, PipelineConfig(pp_size=2, num_microbatches=2))
    assert [list(dict(s.named_children())) for s in stages] == [
        ["0", "1", "2"],
        ["3", "4", "5", "6"],
    ]
    config = PipelineConfig(pp_size=2, num_microbatches=2, split_points=("5",))
    stages = stage_modules(model, config)
    assert [len(s) for s in stages] == [5, 2]
    assert stages[1][0] is model[5]  # shared, not copied: the optimizer's params stay valid
    with pytest.raises(ValueError, match="Did you mean '5'"):
        stage_modules(model, PipelineConfig(pp_size=2, num_microbatches=2, split_points=("55",)))
    with pytest.raises(ValueError, match="fewer than the 4"):
        interleaved = PipelineConfig(pp_size=2, num_microbatches=2, schedule="interleaved")
        stage_modules(_model()[:3], interleaved)
    custom = [nn.Linear(2, 2), nn.Linear(2, 2)]
    assert stage_modules(custom, PipelineConfig(pp_size=2, num_microbatches=2)) == custom
    with pytest.raises(TypeError, match="nn.Sequential"):
        stage_modules(nn.Linear(2, 2), PipelineConfig(pp_size=2, num_microbatches=2))
