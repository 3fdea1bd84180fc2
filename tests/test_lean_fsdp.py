"""FSDP2 (TorchFSDPPlugin) with the lean modes: bf16 shards without fp32 masters, stochastic
rounding of each rank's local shard, low-bit optimizer state of the shards."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from dist_utils import spawn
from tolerances import EXACT

import mixprec
from mixprec.booster.plugin import TorchFSDPPlugin
from mixprec.core.lean import state_bytes
from mixprec.core.policy import preset, to_policy, with_optimizer_state
from mixprec.core.prepare import prepare_model, prepare_optimizer
from mixprec.mixed_precision import MixedPrecision

STEPS = 4
LR = 0.05


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 128x64 weights: a 64x64 shard per rank, 4096 elements, which torchao quantizes
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Tanh(), torch.nn.Linear(128, 64)
    )  # fmt: skip


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)  # the same batch on every rank
    return torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _held_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """Bytes this process holds of params + grads + optimizer state, counted from the tensors
    (a DTensor counts its local shard; low-bit state its codes and scales)."""
    from dist_utils import local_shard

    total = 0
    for p in params:
        for t in (p, p.grad):
            if t is not None:
                t = local_shard(t)
                total += t.numel() * t.element_size()
    for state in optimizer.state.values():
        total += sum(state_bytes(v) for k, v in state.items() if k != "step")
    return total


def _fsdp_lean_worker(rank: int, world: int) -> None:
    import torch.distributed as dist
    from dist_utils import assert_same_on_every_rank, local_shard
    from torch.distributed.tensor import DTensor

    x, y = _batch()
    mine = slice(rank * 8, (rank + 1) * 8)
    cases = [
        ("nearest", "int8", "sgd"),
        ("stochastic", "int8", "sgd"),
        ("stochastic", "fp32", "adamw"),
    ]
    for rounding, state, kind in cases:
        policy = dataclasses.replace(
            preset("bf16_sr"), update_rounding=rounding, optimizer_state=state
        )

        model = _model()
        ref_model = copy.deepcopy(model)
        booster = mixprec.Booster(mixed_precision=MixedPrecision(policy), plugin=TorchFSDPPlugin())
        model, opt, *_ = booster.boost(model, _optimizer(kind, model.parameters()))
        assert opt.lean is not None and opt.lean.cfg == dataclasses.replace(
            opt.lean.cfg, rounding=rounding, state=state
        )
        # No fp32 masters: the shards the optimizer steps are the bf16 params (norms stay fp32)
        held = [p for g in opt.optim.param_groups for p in g["params"]]
        assert all(isinstance(p, DTensor) for p in held)
        dtypes = {n: p.dtype for n, p in model.module.named_parameters()}
        assert {d for n, d in dtypes.items() if not n.startswith("1.")} == {torch.bfloat16}
        assert {d for n, d in dtypes.items() if n.startswith("1.")} == {torch.float32}, dtypes
        ref = prepare_model(ref_model, policy)
        init = [q.detach().float().clone() for q in ref_model.parameters()]
        ref_opt = prepare_optimizer(_optimizer(kind, ref_model.parameters()), policy)
        for _ in range(STEPS):
            booster.backward(torch.nn.functional.mse_loss(model(x[mine]), y[mine]), opt)
            ref_opt.backward(torch.nn.functional.mse_loss(ref(x), y))
            assert not opt.step().skipped
            ref_opt.step()
            if rounding == "nearest":  # bytes with grads alive: the peak of the step
                mine_bytes = _held_bytes(held, opt.optim)
                whole = _held_bytes(list(ref_model.parameters()), ref_opt.optim)
            opt.zero_grad()
            ref_opt.zero_grad()
        what = f"{rounding}/{state}/{kind}"
        for p in held:  # FSDP casts the reduce-scattered grad back to the shard's dtype
            assert p.dtype in (torch.bfloat16, torch.float32)
        if state == "int8":
            big = opt.optim.state[held[0]]["momentum_buffer"]
            assert type(big).__name__ == "OptimState8bit", what
            assert big.shape == local_shard(held[0]).shape  # state of the local shard only
        lr = opt.optim.param_groups[0]["lr"]
        for p, q, q0 in zip(model.module.parameters(), ref_model.parameters(), init, strict=True):
            full, q = p.full_tensor().float(), q.float()
            if rounding == "nearest":
                # Half-batch bf16 grads reduced in fp32 then rounded to bf16, vs one full-batch
                # bf16 grad: a weight may land on the neighbouring bf16 value (2**-8 relative)
                # and momentum carries that on for the remaining steps (as the ZeRO test).
                torch.testing.assert_close(full, q, rtol=2**-6, atol=2e-3, msg=what)
                continue
            # Each rank rounds its shard from its own stream, the reference from one other
            # stream: every step a weight may take the other of its two bf16 neighbours
            # (<= 2**-7 relative apart), STEPS times over; plus the grad difference above,
            # which for Adam (a step of ~lr whatever the grad's size) can flip the sign of a
            # near-zero grad's step: 2 lr per step.
            atol = 2 * lr * STEPS if kind == "adamw" else 2e-3
            torch.testing.assert_close(full, q, rtol=STEPS * 2**-7, atol=atol, msg=what)
            # ...and those differences are noise around the same update: the distance each
            # weight tensor moved agrees within 10% (a missing or doubled step is off by 100%).
            moved, ref_moved = (full - q0).norm(), (q - q0).norm()
            assert abs(moved - ref_moved) <= 0.1 * ref_moved, (what, moved, ref_moved)
        if rounding == "nearest":
            # per rank: half the reference's bytes (every dim 0 here splits evenly over 2)
            total = torch.tensor(mine_bytes)
            dist.all_reduce(total)
            assert int(total) == whole, (int(total), whole)
            assert mine_bytes * world == whole, (mine_bytes, whole)
        # each rank rounds with its own stream
        seeds = [None] * world
        dist.all_gather_object(seeds, opt.lean.seed)
        assert len(set(seeds)) == world, seeds
        # a skip on one rank: nothing moves on any rank, the rounding's stream included
        before = [local_shard(p).detach().clone() for p in held]
        states = [
            {k: v.clone() if type(v) is torch.Tensor else v.dequantize() for k, v in s.items()}
            for s in opt.optim.state.values()
        ]
        rng = opt.lean.counter.clone()
        booster.backward(torch.nn.functional.mse_loss(model(x[mine]), y[mine]), opt)
        if rank == 1:
            local_shard(held[0].grad).view(-1)[0] = float("inf")
        assert opt.step().skipped
        opt.zero_grad()
        for b, p in zip(before, held, strict=True):
            torch.testing.assert_close(local_shard(p), b, **EXACT)
        for s, saved in zip(opt.optim.state.values(), states, strict=True):
            for k, v in saved.items():
                now = s[k] if type(s[k]) is torch.Tensor else s[k].dequantize()
                torch.testing.assert_close(now, v, **EXACT)
        assert torch.equal(opt.lean.counter.clone(), rng)
        assert_same_on_every_rank([opt.scaler.scale_tensor], "scale")
        if (rounding, state) == ("stochastic", "int8"):
            _resume_bitwise(booster, model, opt, x[mine], y[mine], held)
    # the lean state is per-rank local shards: it is not gathered into one file
    with pytest.raises(NotImplementedError, match="optimizer_state='fp32'"):
        booster.save_optimizer(opt, "unused", shard=True)
    _masters_with_int8_state(rank, x, y)


def _masters_with_int8_state(rank: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """A policy with fp32 masters and int8 state: FSDP's fp32 shards are the masters, and
    their state is quantized per shard."""
    from dist_utils import local_shard

    policy = with_optimizer_state(to_policy("fp16_naive", {"dtype": "bfloat16"}), "int8")
    mine = slice(rank * 8, (rank + 1) * 8)
    model = _model()
    ref_model = copy.deepcopy(model)
    booster = mixprec.Booster(mixed_precision=MixedPrecision(policy), plugin=TorchFSDPPlugin())
    model, opt, *_ = booster.boost(model, _optimizer("sgd", model.parameters()))
    held = [p for g in opt.optim.param_groups for p in g["params"]]
    assert {p.dtype for p in held} == {torch.float32} and opt.lean.cfg.state == "int8"
    ref = prepare_model(ref_model, policy)
    ref_opt = prepare_optimizer(_optimizer("sgd", ref_model.parameters()), policy)
    for _ in range(STEPS):
        booster.backward(torch.nn.functional.mse_loss(model(x[mine]), y[mine]), opt)
        ref_opt.backward(torch.nn.functional.mse_loss(ref(x), y))
        assert not opt.step().skipped and not ref_opt.step().skipped
        opt.zero_grad()
        ref_opt.zero_grad()
    buf = opt.optim.state[held[0]]["momentum_buffer"]
    assert type(buf).__name__ == "OptimState8bit" and buf.shape == local_shard(held[0]).shape
    ref_held = [p for g in ref_opt.optim.param_groups for p in g["params"]]  # fp32 masters
    assert {p.dtype for p in ref_held} == {torch.float32}
    for p, m in zip(held, ref_held, strict=True):
        # fp32 weights on both sides: only the grads differ (half-batch bf16 grads reduced in
        # fp32 vs one full-batch bf16 grad, ~2**-8 relative), times lr, through momentum
        torch.testing.assert_close(p.full_tensor(), m, rtol=2**-8, atol=1e-3)


def _resume_bitwise(booster, model, opt, x, y, held) -> None:
    """Save model + lean optimizer (one file per rank: int8 codes and scales, the rounding's
    stream), step twice, load, step twice again: the same weights and stream, bit for bit."""
    import tempfile

    import torch.distributed as dist
    from dist_utils import local_shard

    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    model_dir, opt_dir = f"{folder[0]}/model", f"{folder[0]}/opt"
    booster.save_model(model, model_dir)
    booster.save_optimizer(opt, opt_dir)

    def two_steps() -> list[torch.Tensor]:
        for _ in range(2):
            booster.backward(torch.nn.functional.mse_loss(model(x), y), opt)
            assert not opt.step().skipped
            opt.zero_grad()
        return [local_shard(p).detach().clone() for p in held] + [opt.lean.counter.clone()]

    first = two_steps()
    booster.load_model(model, model_dir)
    booster.load_optimizer(opt, opt_dir)
    assert type(opt.optim.state[held[0]]["momentum_buffer"]).__name__ == "OptimState8bit"
    for a, b in zip(first, two_steps(), strict=True):
        torch.testing.assert_close(a, b, **EXACT)


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_lean_matches_one_process_and_halves_memory_per_rank() -> None:
    spawn(_fsdp_lean_worker, 2)


def test_lean_checkpoint_missing_a_ranks_file_is_refused_naming_it(tmp_path) -> None:
    """Resharding needs every saving rank's file: a 2-rank checkpoint missing rank 1's is
    refused on 1 rank, naming the file; files of two different runs are refused too."""
    from mixprec.core.lean import LeanConfig
    from mixprec.core.optim import MixedPrecisionOptimizer

    model = _model().to(torch.bfloat16)
    opt = MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters()), master_weights=False, lean=LeanConfig()
    )
    torch.save({}, tmp_path / "lean_rank0_of_2.pt")
    with pytest.raises(ValueError, match=r"of 2 ranks missing lean_rank1_of_2.pt; this run has 1"):
        TorchFSDPPlugin().load_optimizer(opt, tmp_path, model)
    torch.save({}, tmp_path / "lean_rank0_of_3.pt")
    with pytest.raises(ValueError, match=r"files of 2 and 3 ranks"):
        TorchFSDPPlugin().load_optimizer(opt, tmp_path, model)


RESHARD_STATES = ("int8", "fp32")


def _reshard_policy(state: str):
    return dataclasses.replace(preset("bf16_sr"), optimizer_state=state)


def _fp32_rows(saved: dict, index: int, key: str) -> torch.Tensor:
    from mixprec.core.lean import unpack_to_fp32

    return unpack_to_fp32(saved["state"][index][key]).float()


def _reshard_save_worker(rank: int, world: int, folder: str) -> None:
    """2 FSDP ranks train 3 steps (AdamW, stochastic rounding) and save per rank."""
    x, y = _batch()
    mine = slice(rank * 8, (rank + 1) * 8)
    for state in RESHARD_STATES:
        plugin = TorchFSDPPlugin()
        booster = mixprec.Booster(
            mixed_precision=MixedPrecision(_reshard_policy(state)), plugin=plugin
        )
        model = _model()
        model, opt, *_ = booster.boost(model, _optimizer("adamw", model.parameters()))
        for _ in range(3):
            booster.backward(torch.nn.functional.mse_loss(model(x[mine]), y[mine]), opt)
            opt.step()
            opt.zero_grad()
        booster.save_optimizer(opt, f"{folder}/{state}")


def _reshard_load_worker(rank: int, world: int, folder: str) -> None:
    """2 FSDP ranks load a 1-process lean checkpoint: each its rows of every state tensor."""
    from dist_utils import local_shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for state in RESHARD_STATES:
        booster = mixprec.Booster(
            mixed_precision=MixedPrecision(_reshard_policy(state)), plugin=TorchFSDPPlugin()
        )
        model = _model()
        model, opt, *_ = booster.boost(model, _optimizer("adamw", model.parameters()))
        saved = torch.load(f"{folder}/{state}/lean_rank0_of_1.pt", weights_only=True)
        booster.load_optimizer(opt, f"{folder}/{state}")
        held = [p for g in opt.optim.param_groups for p in g["params"]]
        for index, p in enumerate(held):
            shape, offset = compute_local_shape_and_global_offset(
                p.shape, p.device_mesh, p.placements
            )
            for key in ("exp_avg", "exp_avg_sq"):
                want = _fp32_rows(saved, index, key)[offset[0] : offset[0] + shape[0]]
                _assert_resharded(opt.optim.state[p][key], want, state)
                assert opt.optim.state[p][key].shape == local_shard(p).shape
        assert int(opt.lean.counter) == int(saved["lean"]["rng"])
        from mixprec.core.lean import rank_seed

        assert opt.lean.seed == rank_seed(int(saved["lean"]["seed"]), rank)


def _assert_resharded(got: torch.Tensor, want: torch.Tensor, state: str) -> None:
    from mixprec.core.lean import to_fp32

    got = to_fp32(got)
    if state == "fp32":  # rows moved as they are
        torch.testing.assert_close(got, want, **EXACT)
        return
    # int8 quantized again over this rank's blocks: within one code step of the block's
    # scale (the dynamic map's largest gap is ~2**-6 of it), never another row's values
    step = want.abs().amax().clamp(min=1e-30) / 64
    torch.testing.assert_close(got, want, rtol=0, atol=float(step))


@pytest.mark.slow
@pytest.mark.distributed
def test_lean_checkpoint_reshards_from_2_ranks_to_1_and_from_1_to_2(tmp_path) -> None:
    """A lean FSDP optimizer checkpoint loads on another rank count: saved by 2 FSDP ranks,
    one process gets each param's state as the two ranks' rows joined (fp32 state exactly,
    int8 re-quantized within a code step), the step counter and rank 0's seed; saved by one
    process, 2 FSDP ranks each get their rows and a seed mixed for their rank."""
    from mixprec.core.lean import LeanConfig
    from mixprec.core.optim import MixedPrecisionOptimizer

    spawn(_reshard_save_worker, 2, str(tmp_path / "two"))
    for state in RESHARD_STATES:
        ranks = [
            torch.load(tmp_path / "two" / state / f"lean_rank{r}_of_2.pt", weights_only=True)
            for r in range(2)
        ]
        model = _model().to(torch.bfloat16)
        norm = model[1]
        norm.float()  # as the FSDP run kept it
        opt = MixedPrecisionOptimizer(
            _optimizer("adamw", model.parameters()),
            master_weights=False,
            lean=LeanConfig(rounding="stochastic", state=state),
        )
        TorchFSDPPlugin().load_optimizer(opt, tmp_path / "two" / state, model)
        held = [p for g in opt.optim.param_groups for p in g["params"]]
        for index, p in enumerate(held):
            for key in ("exp_avg", "exp_avg_sq"):
                want = torch.cat([_fp32_rows(r, index, key) for r in ranks])
                _assert_resharded(opt.optim.state[p][key], want, state)
        assert int(opt.lean.counter) == int(ranks[0]["lean"]["rng"]) == 3
        assert opt.lean.seed == int(ranks[0]["lean"]["seed"])
        # and it trains on: one more step from the resharded state
        x, y = _batch()
        opt.backward(torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y))
        assert not opt.step().skipped
        # one process saves (lean_rank0_of_1.pt); 2 FSDP ranks load their rows of it
        TorchFSDPPlugin().save_optimizer(opt, tmp_path / "one" / state, model)
    spawn(_reshard_load_worker, 2, str(tmp_path / "one"))
