"""HybridParallelPlugin(pp_size=1): the ordinary loop, with tensor parallelism and ZeRO.

Colossal-AI trains with tp_size > 1 and zero_stage 0/1/2 and no pipeline through the ordinary
loop: `loss = criterion(model(x), y); booster.backward(loss, optimizer); optimizer.step()`
(its tests/test_booster/test_plugin/test_3d_plugin.py, run_grad_acc_test, pp=1 cases);
execute_pipeline is for pp_size > 1 only (Colossal asserts "pipeline parallelism is not
enabled"). Two gloo ranks run tp_size 1 (2 data-parallel replicas) and 2 (one replica) under
zero_stage 0, 1, 2 and every precision the plugin takes; the reference is one process with a
plain loop over the same model in the same precision (the plugin's own Policy): each replica's
loss times the scale, its gradients in fp32, summed over the replicas and halved, unscaled, and
stepped by a raw torch SGD over fp32 masters. A step with an inf in one rank's gradient is then
skipped on both ranks, nothing moving bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import assert_same_on_every_rank, local_shard, scaler_state, spawn
from test_pipeline import _batches, _model, _tp_plan
from tolerances import EXACT
from torch import nn

from mixprec.booster import Booster
from mixprec.booster.plugin import HybridParallelPlugin
from mixprec.core.policy import Policy
from mixprec.core.prepare import FP32Criterion, prepare_model
from mixprec.parallel.zero import ZeroOptimizer

WORLD = 2
STEPS = 3
LR = 0.05
SCALE = 2.0**8  # O(1) gradients times the scale stay far below fp16's max: no skip by chance
COLOSSAL = ("fp32", "fp16", "bf16")  # Colossal-AI's precisions
EXTRA = ("fp16_naive",)  # a mixprec mode name the plugin also takes (fp16 + hysteresis scaler)

# tp=1, 2 replicas: each replica's fp32 gradient sum is added and halved as the reference does
# (a sum of two is the same in either order; /2 is exact): bit for bit.
DATA_PARALLEL = EXACT
# tp=2: a row-parallel layer sums two partial products where one process computes one matmul.
# fp32: a few ulps of the reordered sums per step (test_hybrid_parallel's TP_ROUNDING).
TP_FP32 = {"rtol": 1e-5, "atol": 1e-6}
# fp16 / bf16 params: each partial product is rounded to the low dtype before the two are
# summed, so activations and gradients differ by about one low-precision ulp (2**-11 fp16,
# 2**-8 bf16 relative); SGD(lr=0.05) carries that into the fp32 masters over 3 steps as about
# lr x steps x |g| x ulp, |g| < 1.
TP_LOW = {
    torch.float16: {"rtol": 2e-3, "atol": 1e-4},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-3},
}


def _cases() -> list[tuple[int, int, str]]:
    cases = [(tp, z, p) for tp in (1, 2) for z in (0, 1, 2) for p in COLOSSAL]
    # ZeRO with tp=1 is LowLevelZeroPlugin, which takes Colossal's precisions only (refused
    # otherwise: see test_zero_without_tensor_parallelism_takes_colossal_precisions)
    cases += [(tp, z, p) for tp in (1, 2) for z in (0, 1, 2) for p in EXTRA if tp > 1 or z == 0]
    return cases


def _plugin(tp: int, zero: int, precision: str) -> HybridParallelPlugin:
    scaled = precision in ("fp16", "fp16_naive")
    kwargs: dict[str, Any] = {"initial_scale": SCALE} if precision == "fp16" else {}
    if precision == "fp16_naive":  # a mixprec mode: its scaler comes as a MixedPrecision
        from mixprec.mixed_precision import FP16NaiveMixedPrecision

        precision = FP16NaiveMixedPrecision(initial_scale=SCALE)  # type: ignore[assignment]
    assert scaled or not kwargs
    return HybridParallelPlugin(
        tp_size=tp,
        pp_size=1,
        zero_stage=zero,
        precision=precision,
        tp_plan=_tp_plan() if tp > 1 else None,
        **kwargs,
    )


def _inner(model: nn.Module) -> nn.Module:
    """The user's module inside the boosted one (a one-stage PipelinedModel or, for ZeRO
    without tensor parallelism, LowLevelZeroPlugin's PrecisionModule)."""
    return model.stages[0].module if hasattr(model, "stages") else model.module


def _weights(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """Every param's whole fp32 value: masters gathered from their owners, then over tp."""
    if isinstance(optimizer, ZeroOptimizer):
        master_of = dict(zip(map(id, optimizer.all_params), optimizer.hp_params(), strict=True))
    else:
        master_of = dict(zip(map(id, optimizer.lp_params), optimizer.hp_masters, strict=True))
    out = {}
    for name, p in _inner(model).named_parameters():
        w = master_of.get(id(p), p).detach()
        out[name] = (w.full_tensor() if hasattr(w, "full_tensor") else w).float().clone()
    return out


def _local_state(model: nn.Module, optimizer: Any) -> list[torch.Tensor]:
    """This rank's local params, masters and optimizer state (all that a step may move)."""
    out = [local_shard(p).detach().clone() for p in _inner(model).parameters()]
    out += [local_shard(m).detach().clone() for m in optimizer.hp_masters]
    for state in optimizer.state.values():
        out += [local_shard(v).detach().clone() for v in state.values() if torch.is_tensor(v)]
    return out


def _reference(policy: Policy, batches: list, replicas: int) -> dict[str, torch.Tensor]:
    """One process, plain torch, the plugin's precision: see the module docstring."""
    ref = prepare_model(_model(), policy)
    names, params = zip(*ref.module.named_parameters(), strict=True)
    masters = [p.detach().float().clone() if policy.master_weights else p for p in params]
    opt = torch.optim.SGD(masters, lr=LR, momentum=0.9)
    criterion = FP32Criterion(nn.MSELoss())
    scale = policy.loss_scale.init_scale if policy.loss_scale.dynamic else 1.0
    for step in range(STEPS):
        total = [torch.zeros_like(m) for m in masters]
        for x, y in batches[step * replicas : (step + 1) * replicas]:
            (criterion(ref(x), y).float() * scale).backward()
            for t, p in zip(total, params, strict=True):
                t.add_(p.grad.float())  # summed in fp32
                p.grad = None
        for master, t in zip(masters, total, strict=True):
            master.grad = t / replicas * (1.0 / scale)  # powers of two: both exact
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, master in zip(params, masters, strict=True):
                p.copy_(master)
    return {n: m.detach().float().clone() for n, m in zip(names, masters, strict=True)}


def _run_case(rank: int, tp: int, zero: int, precision: str) -> None:
    plugin = _plugin(tp, zero, precision)
    booster = Booster(plugin=plugin)
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, optimizer, criterion, _, _ = booster.boost(model, sgd, nn.MSELoss())
    policy = plugin.precision.policy
    replicas, replica = WORLD // tp, rank // tp
    batches = _batches(STEPS * replicas + 1)
    what = f"tp={tp} zero={zero} {precision}"
    with pytest.raises(RuntimeError, match="pp_size=1 there is no pipeline"):
        booster.execute_pipeline(iter([batches[0]]), model, criterion, optimizer)
    for step in range(STEPS):  # the ordinary loop, Colossal's for pp_size=1
        x, y = batches[step * replicas + replica]
        loss = criterion(model(x), y)
        booster.backward(loss, optimizer)
        result = optimizer.step()
        assert not result.skipped, f"{what}: step {step} skipped"
        optimizer.zero_grad()
    weights = _weights(model, optimizer)
    expected = _reference(policy, batches, replicas)
    low = policy.low_dtype
    tol = DATA_PARALLEL if tp == 1 else TP_FP32 if low is None else TP_LOW[low]
    for name, w in weights.items():
        torch.testing.assert_close(w, expected[name], **tol, msg=f"{what}: {name}")
        assert not torch.equal(w, _model().state_dict()[name].float()), f"{what}: {name} idle"

    # An inf in one rank's gradient: both ranks skip, nothing moves, the scalers agree.
    before = _local_state(model, optimizer)
    scale = optimizer.loss_scale
    handle = None
    if rank == 1:
        first = next(_inner(model).parameters())
        poison = lambda g: local_shard(g).view(-1).__setitem__(0, float("inf")) or g  # noqa: E731
        handle = first.register_hook(poison)
    x, y = batches[-1]
    booster.backward(criterion(model(x), y), optimizer)
    result = optimizer.step()
    optimizer.zero_grad()
    if handle is not None:
        handle.remove()
    assert result.skipped, f"{what}: rank {rank} stepped although rank 1 overflowed"
    after = _local_state(model, optimizer)
    assert len(after) == len(before)
    for i, (a, b) in enumerate(zip(after, before, strict=True)):
        torch.testing.assert_close(a, b, **EXACT, msg=f"{what}: tensor {i} moved on a skip")
    # Colossal's scaler backs off only after `hysteresis` (2) overflows: it holds here
    assert optimizer.loss_scale <= scale, f"{what}: the scale grew on an overflow"
    assert_same_on_every_rank(
        [torch.tensor([float(result.skipped), float(optimizer.steps)]), *scaler_state(optimizer)],
        f"{what}: skip flag, step count and scaler",
    )


def _worker(rank: int, world: int) -> None:
    for tp, zero, precision in _cases():
        _run_case(rank, tp, zero, precision)
        dist.barrier()


@pytest.mark.distributed
@pytest.mark.slow
def test_ordinary_loop_with_tensor_parallelism_and_zero() -> None:
    """Every (tp_size, zero_stage, precision) case in one spawn of 2 ranks (processes start
    slowly on 2 cores; each case is a few small steps)."""
    spawn(_worker, WORLD)


def test_zero_without_tensor_parallelism_takes_colossal_precisions() -> None:
    with pytest.raises(NotImplementedError, match="precision 'fp16'/'bf16'/'fp32'"):
        HybridParallelPlugin(pp_size=1, zero_stage=1, precision="fp16_naive")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("num_microbatches", 4),
        ("microbatch_size", 2),
        ("pp_style", "interleaved"),
        ("pp_style", "gpipe"),
        ("num_model_chunks", 2),
    ],
)
def test_pipeline_keywords_without_a_pipeline_are_refused(name: str, value: Any) -> None:
    """pp_size=1 runs no schedule: a keyword that would split or schedule one is refused by
    name; the values Colossal's own pp_size=1 configs pass (num_microbatches=1, '1f1b',
    num_model_chunks=1) are taken."""
    with pytest.raises(ValueError, match=f"{name}={value!r}, pp_size=1"):
        HybridParallelPlugin(pp_size=1, **{name: value})
    HybridParallelPlugin(pp_size=1, num_microbatches=1, pp_style="1f1b", num_model_chunks=1)
