"""initialize + Engine (Colossal-AI's face): each mode against a plain loop, accumulation,
clipping, skipped steps, exact resume, DDP on two gloo processes, and seed 001's example."""

from __future__ import annotations

import copy
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_mlp
from dist_utils import free_port, spawn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from mixprec import AMP_TYPE
from mixprec.config import gpc
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import preset
from mixprec.core.prepare import prepare_model
from mixprec.core.skip_monitor import ScaleCollapseError
from mixprec.engine import (
    Engine,
    EpochShuffledDistributedSampler,
    dataloader_to_distributed,
    initialize,
)
from mixprec.launch import destroy, launch_from_torch

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

CE = torch.nn.CrossEntropyLoss()
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "colossal_engine"


def data(steps: int = 6, n: int = 8, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(torch.get_default_device()).manual_seed(seed)
    return [
        (torch.randn(n, 8, generator=gen), torch.randint(0, 4, (n,), generator=gen))
        for _ in range(steps)
    ]


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def make_engine(config, *, norm=True, opt=sgd, scheduler=None, seed=0):
    torch.manual_seed(seed)
    model = tiny_mlp(norm=norm)
    optimizer = opt(model)
    sched = None if scheduler is None else scheduler(optimizer)
    engine, _, _, _ = initialize(model, optimizer, CE, lr_scheduler=sched, config=config)
    return engine, model


def run_engine(engine: Engine, batches) -> list[float]:
    engine.train()
    losses = []
    for x, y in batches:
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.dtype == q.dtype, name
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


# ----- each mode against the loop a user would write without mixprec -----


def test_fp32_engine_equals_plain_loop_exactly() -> None:
    engine, model = make_engine({})
    run_engine(engine, data())
    torch.manual_seed(0)
    ref = tiny_mlp()
    opt = sgd(ref)
    for x, y in data():
        opt.zero_grad()
        CE(ref(x), y).backward()
        opt.step()
    # fp32 with a unit scale: x*1.0 and grad*1.0 are exact, so the same ops give the same bits
    assert_same_params(model, ref)
    assert engine.loss_scale == 1.0 and engine.skipped_steps == 0


def test_bf16_engine_equals_plain_autocast_loop_exactly(device: str) -> None:
    engine, model = make_engine({"fp16": {"mode": "bf16"}})
    run_engine(engine, data())
    torch.manual_seed(0)
    ref = tiny_mlp()
    opt = sgd(ref)
    for x, y in data():
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16):
            out = ref(x)
        CE(out.float(), y).backward()
        opt.step()
    assert_same_params(model, ref)


def test_torch_fp16_clips_unscaled_grads_like_grad_scaler_exactly(device: str) -> None:
    max_norm = 0.05  # far below these gradients' norm, so every step really clips
    config = {"fp16": {"mode": AMP_TYPE.TORCH, "init_scale": 2.0**10}, "clip_grad_norm": max_norm}
    adam = lambda m: torch.optim.Adam(m.parameters(), lr=1e-2)  # noqa: E731
    engine, model = make_engine(config, opt=adam)
    torch.manual_seed(0)
    ref = tiny_mlp()
    opt = adam(ref)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
    for x, y in data(4, n=4):  # fp16 matmuls are slow on CPU: tiny batches
        run_engine(engine, [(x, y)])
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            out = ref(x)
        scaler.scale(CE(out.float(), y)).backward()
        scaler.unscale_(opt)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()
        # the norm the engine clipped with is the unscaled one (a scaled one is 2**10 larger)
        assert engine.last_result.grad_norm == float(ref_norm) > max_norm
    assert_same_params(model, ref)
    assert engine.loss_scale == 2.0**10 and engine.skipped_steps == 0


@pytest.mark.parametrize(
    ("fp16", "dtype", "scale"),
    [
        ({"mode": AMP_TYPE.NAIVE, "dtype": "bfloat16"}, torch.bfloat16, 1.0),
        ({"mode": AMP_TYPE.NAIVE, "initial_scale": 2.0**8}, torch.float16, 2.0**8),
        ({"mode": AMP_TYPE.APEX, "opt_level": "O2"}, torch.float16, 2.0**16),
    ],
    ids=["naive-bf16", "naive-fp16", "apex-O2"],
)
def test_master_weight_modes_equal_hand_written_master_loop_exactly(fp16, dtype, scale) -> None:
    engine, model = make_engine({"fp16": fp16}, norm=False)
    batches = data(4, n=4)
    run_engine(engine, batches)
    assert engine.skipped_steps == 0 and engine.loss_scale == scale  # no overflow: same steps
    torch.manual_seed(0)
    ref = tiny_mlp(norm=False).to(dtype)
    masters = [p.detach().float().requires_grad_() for p in ref.parameters()]
    opt = torch.optim.SGD(masters, lr=0.05, momentum=0.9)
    for x, y in batches:
        (CE(ref(x.to(dtype)).float(), y) * scale).backward()
        for p, m in zip(ref.parameters(), masters, strict=True):
            m.grad = p.grad.float() * (1.0 / scale)  # 1/scale is a power of two: exact
            p.grad = None
        opt.step()
        with torch.no_grad():
            for p, m in zip(ref.parameters(), masters, strict=True):
                p.copy_(m)
    assert_same_params(model, ref)
    for a, b in zip(engine.optimizer.hp_masters, masters, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_naive_fp16_default_scale_backs_off_and_schedule_counts_real_steps() -> None:
    steps = 24  # the scale needs a dozen or so back-offs from 2**32 to fit fp16
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)  # noqa: E731
    engine, model = make_engine({"fp16": {"mode": AMP_TYPE.NAIVE}}, scheduler=sched)
    run_engine(engine, data(steps, n=4))
    # 2**32 times these gradients overflows fp16: the first steps skip until the scale fits
    assert 0 < engine.skipped_steps < steps
    assert engine.loss_scale < 2.0**32
    assert engine.lr_scheduler.last_epoch == steps - engine.skipped_steps
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model[1].weight.dtype == torch.float32  # LayerNorm kept fp32
    assert model[0].weight.dtype == torch.float16


# ----- gradient accumulation -----


@pytest.mark.parametrize("fp16", [None, {"mode": "bf16"}], ids=["fp32", "bf16"])
def test_accumulation_equals_mean_of_micro_losses_exactly(device: str, fp16) -> None:
    n_accum, windows = 2, 3
    config = {"gradient_accumulation": n_accum, **({"fp16": fp16} if fp16 else {})}
    engine, model = make_engine(config)
    batches = data(n_accum * windows)
    engine.train()
    for i, (x, y) in enumerate(batches):
        engine.zero_grad()  # mid-window this must keep the gradients gathered so far
        engine.backward(engine.criterion(engine(x), y))
        result = engine.step()
        assert (result is None) == (i % n_accum != n_accum - 1)
        assert engine.accumulated_steps == (i + 1) % n_accum
    assert engine.optimizer.steps == windows
    torch.manual_seed(0)
    ref = tiny_mlp()
    opt = sgd(ref)
    dtype = torch.bfloat16 if fp16 else torch.float32
    for w in range(windows):
        opt.zero_grad()
        losses = []
        for x, y in batches[w * n_accum : (w + 1) * n_accum]:
            # one autocast region per micro-batch: its cast cache must not join their graphs
            with torch.autocast(device, dtype=dtype, enabled=fp16 is not None):
                out = ref(x)
            losses.append(CE(out.float(), y))
        (sum(losses) / n_accum).backward()
        opt.step()
    assert_same_params(model, ref)


def test_accumulation_matches_one_step_on_the_concatenated_batch() -> None:
    engine, model = make_engine({"gradient_accumulation": 2})
    batches = data(6)
    run_engine(engine, batches)
    torch.manual_seed(0)
    ref = tiny_mlp()
    opt = sgd(ref)
    for i in range(0, len(batches), 2):
        x = torch.cat([batches[i][0], batches[i + 1][0]])
        y = torch.cat([batches[i][1], batches[i + 1][1]])
        opt.zero_grad()
        CE(ref(x), y).backward()
        opt.step()
    # mathematically equal; fp32 sums over 2B rows vs two B-row means round differently
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# ----- skipped steps -----


def test_skipped_step_leaves_weights_state_and_schedule_unchanged() -> None:
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)  # noqa: E731
    config = {"fp16": {"mode": AMP_TYPE.TORCH, "init_scale": 2.0**10}, "clip_grad_norm": 1.0}
    engine, model = make_engine(config, scheduler=sched)
    (x, y), (x2, y2) = data(2, n=4)
    run_engine(engine, [(x, y)])
    assert engine.lr_scheduler.last_epoch == 1
    before = copy.deepcopy(model.state_dict())
    momentum = [s["momentum_buffer"].clone() for s in engine.optimizer.state.values()]
    lr = engine.optimizer.param_groups[0]["lr"]

    engine.zero_grad()
    engine.backward(engine.criterion(engine(x2), y2))
    model[0].weight.grad[0, 0] = float("inf")  # an overflow planted in one gradient
    result = engine.step()
    assert result.skipped and engine.skipped_steps == 1
    assert engine.lr_scheduler.last_epoch == 1 and engine.optimizer.param_groups[0]["lr"] == lr
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
    for a, s in zip(momentum, engine.optimizer.state.values(), strict=True):
        torch.testing.assert_close(s["momentum_buffer"], a, rtol=0, atol=0)
    assert engine.loss_scale == 2.0**9  # backed off once (hysteresis 1)

    run_engine(engine, [(x2, y2)])
    assert not engine.last_result.skipped and engine.lr_scheduler.last_epoch == 2


def test_collapsing_scale_names_the_overflowing_parameter() -> None:
    engine, model = make_engine({"fp16": {"mode": AMP_TYPE.NAIVE, "dtype": "bfloat16"}})
    ((x, y),) = data(1, n=4)
    limit = engine.optimizer.max_consecutive_skips = 3  # the default (100) only costs time
    with pytest.raises(ScaleCollapseError, match=r"in: \['3\.weight'\]"):
        for _ in range(limit):
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x), y))
            model[3].weight.grad[0, 0] = float(
                "nan"
            )  # reaches its fp32 master, named by initialize
            engine.step()
    assert engine.skipped_steps == limit


def test_engine_without_scheduler_returns_callers_none() -> None:
    torch.manual_seed(0)
    model = tiny_mlp()
    engine, train, test, sched = initialize(model, sgd(model), CE, config={})
    assert (train, test, sched) == (None, None, None) and engine.lr_scheduler is None
    assert isinstance(engine.model.module, torch.nn.Sequential)  # no DDP in a world of one
    assert isinstance(engine.optimizer, MixedPrecisionOptimizer)


# ----- exact resume -----


@pytest.mark.parametrize(
    "fp16",
    [{"mode": AMP_TYPE.NAIVE, "dtype": "bfloat16"}, {"mode": AMP_TYPE.TORCH}],
    ids=["naive-bf16", "torch-fp16"],
)
def test_state_dict_resume_equals_uninterrupted_exactly(fp16) -> None:
    config = {"fp16": fp16, "gradient_accumulation": 2, "clip_grad_norm": 1.0}
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)  # noqa: E731
    sched = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))  # noqa: E731
    batches = data(7, n=4)
    straight, straight_model = make_engine(config, opt=adamw, scheduler=sched)
    run_engine(straight, batches)

    first, _ = make_engine(config, opt=adamw, scheduler=sched)
    run_engine(first, batches[:3])  # stops mid-window: one micro-batch gathered
    assert first.accumulated_steps == 1
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed, resumed_model = make_engine(config, opt=adamw, scheduler=sched, seed=1)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    run_engine(resumed, batches[3:])

    assert_same_params(resumed_model, straight_model)
    for a, b in zip(resumed.optimizer.hp_masters, straight.optimizer.hp_masters, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert resumed.optimizer.state_dict()["state"].keys() == (
        straight.optimizer.state_dict()["state"].keys()
    )
    for sa, sb in zip(
        resumed.optimizer.state.values(), straight.optimizer.state.values(), strict=True
    ):
        for key in sa:
            torch.testing.assert_close(sa[key], sb[key], rtol=0, atol=0)
    assert resumed.lr_scheduler.state_dict() == straight.lr_scheduler.state_dict()
    assert resumed.loss_scale == straight.loss_scale
    assert resumed.accumulated_steps == straight.accumulated_steps


def test_state_dict_model_weights_are_fp32_masters() -> None:
    engine, model = make_engine({"fp16": {"mode": AMP_TYPE.NAIVE, "dtype": "bfloat16"}})
    run_engine(engine, data(2))
    state = engine.state_dict()["model"]
    assert all(v.dtype == torch.float32 for v in state.values())
    masters = dict(zip(engine.optimizer.lp_params, engine.optimizer.hp_masters, strict=True))
    for name, p in model.named_parameters():
        expected = masters.get(p, p)
        torch.testing.assert_close(state[name], expected.float(), rtol=0, atol=0, msg=name)


def test_load_state_dict_refuses_a_mismatched_engine() -> None:
    engine, _ = make_engine({"gradient_accumulation": 2})
    state = engine.state_dict()
    other, _ = make_engine({}, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1))
    with pytest.raises(ValueError, match="LR scheduler"):
        other.load_state_dict(state)
    with pytest.raises(KeyError, match="accumulated_steps"):
        engine.load_state_dict({k: v for k, v in state.items() if k != "accumulated_steps"})
    state["accumulated_steps"] = 2
    with pytest.raises(ValueError, match="gradient_accumulation=2"):
        engine.load_state_dict(state)


# ----- configs and bad input -----


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"gradient_accumulation": 0}, ValueError, "gradient_accumulation=0"),
        ({"clip_grad_norm": -1.0}, ValueError, "clip_grad_norm=-1.0"),
        ({"fp16": {"mode": "fp61"}}, ValueError, "'fp61'.*Did you mean 'fp16'"),
        ({"fp16": {"mode": AMP_TYPE.TORCH, "init_scal": 2.0}}, ValueError, "'init_scal'"),
    ],
)
def test_bad_config_names_value_and_choices(config, error, match) -> None:
    model = tiny_mlp()
    with pytest.raises(error, match=match):
        initialize(model, sgd(model), CE, config=config)


def test_engine_refuses_unprepared_pieces() -> None:
    model = tiny_mlp()
    with pytest.raises(TypeError, match="prepare_model"):
        Engine(model, MixedPrecisionOptimizer(sgd(model)))
    with pytest.raises(TypeError, match="MixedPrecisionOptimizer"):
        Engine(prepare_model(tiny_mlp(), preset("fp32")), sgd(model))


def test_bad_optimizer_fails_before_the_model_is_cast() -> None:
    model = tiny_mlp()
    wrapped = MixedPrecisionOptimizer(sgd(model))
    with pytest.raises(TypeError, match="MixedPrecisionOptimizer"):
        initialize(model, wrapped, CE, config={"fp16": {"mode": AMP_TYPE.NAIVE}})
    assert model[0].weight.dtype == torch.float32


def test_initialize_reads_a_config_file(tmp_path) -> None:
    path = tmp_path / "cfg.py"
    path.write_text(
        "from mixprec import AMP_TYPE\n"
        "fp16 = dict(mode=AMP_TYPE.NAIVE, dtype='bfloat16')\n"
        "gradient_accumulation = 3\nclip_grad_norm = 2.0\n"
    )
    model = tiny_mlp()
    engine, *_ = initialize(model, sgd(model), CE, config=path)
    assert engine.policy.name == "fp16_naive" and model[0].weight.dtype == torch.bfloat16
    assert engine.gradient_accumulation == 3 and engine.optimizer.max_norm == 2.0


@pytest.fixture
def teardown():
    yield
    destroy()
    assert not dist.is_initialized()


def test_seed_000_loop_runs_from_launch_from_torch(monkeypatch, teardown) -> None:
    """Seed 000's script with mixprec in place of colossalai (CPU: no .cuda())."""
    port = free_port()
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    for key, value in {**env, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    CONFIG = dict(BATCH_SIZE=4, NUM_EPOCHS=2, fp16=dict(mode=AMP_TYPE.TORCH, init_scale=2.0**8))
    launch_from_torch(config=CONFIG)
    model = tiny_mlp()
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=gpc.config.NUM_EPOCHS
    )
    x, y = data(1, n=12)[0]
    train_dataloader = DataLoader(
        TensorDataset(x, y), batch_size=gpc.config.BATCH_SIZE, shuffle=True
    )
    engine, train_dataloader, _, _ = initialize(model, optimizer, criterion, train_dataloader)
    for _epoch in range(gpc.config.NUM_EPOCHS):
        engine.train()
        for img, label in train_dataloader:
            engine.zero_grad()
            output = engine(img)
            train_loss = engine.criterion(output, label)
            engine.backward(train_loss)
            engine.step()
        lr_scheduler.step()
    assert engine.optimizer.steps == gpc.config.NUM_EPOCHS * 3 and engine.skipped_steps == 0
    assert lr_scheduler.last_epoch == gpc.config.NUM_EPOCHS
    assert torch.isfinite(train_loss) and train_loss.dtype == torch.float32


def _collate(batch):
    return torch.stack([b[0] for b in batch])


def test_dataloader_to_distributed_keeps_the_loader_and_shards_it() -> None:
    dataset = TensorDataset(torch.arange(10.0))
    loader = DataLoader(dataset, batch_size=2, shuffle=False, drop_last=True, collate_fn=_collate)
    shard = dataloader_to_distributed(loader, rank=1, world_size=2)
    assert (shard.batch_size, shard.drop_last, shard.collate_fn) == (2, True, _collate)
    assert [b.tolist() for b in shard] == [[1.0, 3.0], [5.0, 7.0]]  # every 2nd from rank 1

    shuffled = DataLoader(dataset, batch_size=5, shuffle=True)
    shards = [dataloader_to_distributed(shuffled, rank=r, world_size=2) for r in (0, 1)]
    epochs = [[torch.cat([b[0] for b in s]) for s in shards] for _ in range(2)]
    for first, second in epochs:  # each pass: the two shards partition the data
        assert sorted(torch.cat([first, second]).tolist()) == list(map(float, range(10)))
    assert not torch.equal(epochs[0][0], epochs[1][0])  # a RandomSampler reshuffled per pass


def test_dataloader_to_distributed_refuses_orders_it_cannot_keep() -> None:
    dataset = TensorDataset(torch.arange(10.0))
    weighted = DataLoader(dataset, batch_size=2, sampler=WeightedRandomSampler([1.0] * 10, 10))
    with pytest.raises(ValueError, match="WeightedRandomSampler"):
        dataloader_to_distributed(weighted, rank=0, world_size=2)
    batched = DataLoader(dataset, batch_sampler=[[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="batch_sampler"):
        dataloader_to_distributed(batched, rank=0, world_size=2)
    with pytest.raises(TypeError, match="DataLoader"):
        dataloader_to_distributed([dataset[0]], rank=0, world_size=2)


# ----- two processes: DDP, sharded data, overflow agreement -----


def _ddp_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)  # same init on both ranks (DDP broadcasts rank 0's anyway)
    model = tiny_mlp()
    gen = torch.Generator(torch.get_default_device()).manual_seed(5)
    n = 32
    dataset = TensorDataset(
        torch.randn(n, 8, generator=gen), torch.randint(0, 4, (n,), generator=gen), torch.arange(n)
    )
    config = {
        "fp16": {"mode": AMP_TYPE.NAIVE, "dtype": "bfloat16"},
        "gradient_accumulation": 2,
        "clip_grad_norm": 1.0,
    }
    engine, train, test, _ = initialize(
        model,
        sgd(model),
        CE,
        DataLoader(dataset, batch_size=4, shuffle=True),
        DataLoader(dataset, batch_size=4, shuffle=False),
        config=config,
    )
    assert isinstance(engine.model, DistributedDataParallel)
    assert isinstance(train.sampler, EpochShuffledDistributedSampler)
    assert type(test.sampler) is DistributedSampler and not test.sampler.shuffle
    assert len(train) == n // world // 4

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t.contiguous())
        return out

    epoch_orders = []
    engine.train()
    for _epoch in range(2):
        seen = []
        for i, (x, y, idx) in enumerate(train):
            seen.append(idx)
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x), y))
            g0, g1 = gather(model[0].weight.grad)
            # no_sync on the window's first micro-batch, one all-reduce on its last
            assert torch.equal(g0, g1) == (i % 2 == 1)
            engine.step()
        mine = torch.cat(seen)
        everyone = torch.cat(gather(mine))
        assert sorted(everyone.tolist()) == list(range(n))  # the shards partition the data
        epoch_orders.append(mine)
    assert not torch.equal(*epoch_orders)  # reshuffled for the second epoch
    for p in [*model.parameters(), *engine.optimizer.hp_masters]:
        a, b = gather(p.detach())
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # replicas agree bit for bit

    # an overflow on rank 0 alone: both ranks skip, weights unchanged everywhere
    before = [p.detach().clone() for p in model.parameters()]
    steps_before = engine.optimizer.steps
    x, y, _ = next(iter(train))
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x), y))
    assert engine.step() is None  # the window's first micro-batch only accumulates
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x), y))
    if rank == 0:
        model[0].weight.grad[0, 0] = float("inf")  # after DDP's all-reduce: rank 0's alone
    result = engine.step()
    assert result.skipped and engine.skipped_steps == 1
    assert engine.optimizer.steps == steps_before + 1
    for p, q in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)


@pytest.mark.distributed
def test_ddp_engine_on_two_processes() -> None:
    spawn(_ddp_worker, 2)


# ----- seed 001's example, end to end -----

CONFIGS = ["config_fp32.py", "config_AMP_torch.py", "config_AMP_naive.py", "config_AMP_apex.py"]
ACCURACY = re.compile(r"Epoch (\d+) - .*test accuracy: ([0-9.]+)")


def _example_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"  # several processes share two cores
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def _accuracies(stdout: str) -> list[float]:
    return [float(m[2]) for m in ACCURACY.finditer(stdout)]


@pytest.mark.host_only
def test_example_runs_with_each_config() -> None:
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(EXAMPLE / "train.py"), "--config", str(EXAMPLE / "config" / name)]
            + ["--epochs", "1"],
            env=_example_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in CONFIGS
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{name}:\n{err}"
        accuracies = _accuracies(out)
        assert len(accuracies) == 1, out
        # ten classes: chance is 0.1; one epoch of any mode learns well past it
        assert accuracies[0] > 0.3, f"{name}: {out}"


@pytest.mark.distributed
def test_example_runs_under_mixprec_run_on_two_processes() -> None:
    cmd = [sys.executable, "-m", "mixprec.cli", "run", "--nproc_per_node", "2"]
    cmd += [str(EXAMPLE / "train.py")]
    cmd += ["--config", str(EXAMPLE / "config" / "config_AMP_torch.py"), "--epochs", "1"]
    proc = subprocess.run(cmd, env=_example_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "world_size=2" in proc.stdout and "DistributedDataParallel" in proc.stdout
    accuracies = _accuracies(proc.stdout)
    assert len(accuracies) == 1 and accuracies[0] > 0.3, proc.stdout  # rank 0 prints once


def test_state_dict_keeps_fp64_buffers_fp64_and_resumes_them_bitwise() -> None:
    """One rule with checkpoint.hp_model_state_dict: only fp16/bf16 are up-cast."""
    config = {"fp16": {"mode": AMP_TYPE.NAIVE, "dtype": "bfloat16"}}
    engine, model = make_engine(config)
    model.register_buffer("calibration", torch.tensor([1.0 + 2.0**-40], dtype=torch.float64))
    state = engine.state_dict()
    assert state["model"]["calibration"].dtype == torch.float64
    model.calibration.zero_()
    engine.load_state_dict(state)
    assert model.calibration.item() == 1.0 + 2.0**-40  # fp32 would have rounded it to 1.0
