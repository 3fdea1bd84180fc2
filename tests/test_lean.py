"""Lean precision (mixprec.core.lean): stochastic rounding into bf16 params, low-bit optimizer state."""

from __future__ import annotations

import copy
import dataclasses
import io
import math

import pytest
import torch
from conftest import CountingBackend
from tolerances import EXACT, FP32_ROUNDING

import mixprec
from mixprec.core.lean import LeanConfig, fp32_to_bf16_stochastic, new_state, state_bytes, to_fp32
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import Policy, preset, to_policy, with_optimizer_state
from mixprec.core.prepare import prepare_model, prepare_optimizer


def bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(towards zero, away from zero) bf16 neighbours of fp32 x, by truncating its bits."""
    bits = x.view(torch.int32)
    low = (bits & -65536).view(torch.float32)
    high = ((bits & -65536) + 65536).view(torch.float32)
    return low, high


# ----- the rounding itself -----
def test_stochastic_rounding_stays_between_the_two_bf16_neighbours() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10_000, generator=g) * torch.logspace(-30, 30, 10_000)
    low, high = bf16_neighbours(x)
    out = fp32_to_bf16_stochastic(x, g).float()
    assert bool(((out == low) | (out == high)).all())
    both = torch.stack([fp32_to_bf16_stochastic(x, g).float() for _ in range(20)])
    assert bool((both == high).any()) and bool((both == low).any())  # both neighbours occur


def test_stochastic_rounding_keeps_bf16_values_and_nonfinite() -> None:
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.0e38]).bfloat16().float()
    special = torch.tensor([float("inf"), float("-inf"), float("nan")])
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        torch.testing.assert_close(fp32_to_bf16_stochastic(exact, g).float(), exact, **EXACT)
    out = fp32_to_bf16_stochastic(special, g).float()
    assert out[0] == math.inf and out[1] == -math.inf and math.isnan(out[2])


def test_stochastic_rounding_is_unbiased() -> None:
    # Each rounding is one of two values a gap d apart: its std is <= d/2, so the mean of N
    # roundings is within 5 * d / (2 sqrt N) of its expectation except with p < 1e-6 per value.
    n = 4000
    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, generator=g) * torch.logspace(-3, 3, 256)
    low, high = bf16_neighbours(x)
    mean = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(n):
        mean += fp32_to_bf16_stochastic(x, g).double()
    mean /= n
    bound = 5 * (high - low).abs().double() / (2 * math.sqrt(n))
    assert bool(((mean - x.double()).abs() <= bound).all())
    nearest_err = (x.bfloat16().double() - x.double()).abs()
    assert float((mean - x.double()).abs().mean()) < float(nearest_err.mean()) / 4


def test_the_write_backs_counter_stream_rounds_unbiased() -> None:
    """The optimizer's noise (step_math.rounding_noise of rounding_keys: a hash of seed, step
    counter, tensor and element, no generator) rounds as unbiased as torch's generator: the
    same bound as above over N steps of one tensor (each step a new counter value)."""
    from mixprec.core import step_math as sm

    n = 4000
    x = torch.randn(256, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 3, 256)
    low, high = bf16_neighbours(x)
    mean = torch.zeros_like(x, dtype=torch.float64)
    for step in range(n):
        key = sm.rounding_keys(123, torch.tensor(step), 3)[2]
        mean += sm.round_bf16_stochastic(x, sm.rounding_noise(key, x.shape)).double()
    mean /= n
    bound = 5 * (high - low).abs().double() / (2 * math.sqrt(n))
    assert bool(((mean - x.double()).abs() <= bound).all())


def test_the_counter_streams_bits_are_uniform_and_distinct() -> None:
    """16 noise bits per element, uniform: over 2**16 * 16 draws each of the 16 values of the
    top 4 bits holds 1/16 of them within 5 binomial std; every tensor, step and seed draws
    another stream."""
    from mixprec.core import step_math as sm

    counter = torch.tensor(5)
    keys = sm.rounding_keys(7, counter, 16)
    assert len(set(keys.tolist())) == 16  # each tensor its own key
    noise = torch.stack([sm.rounding_noise(k, torch.Size([1 << 16])) for k in keys])
    assert int(noise.min()) >= 0 and int(noise.max()) < 1 << 16
    counts = torch.bincount((noise >> 12).view(-1), minlength=16).double()
    n, p = noise.numel(), 1 / 16
    assert float((counts - n * p).abs().max()) < 5 * math.sqrt(n * p * (1 - p))
    other_step = sm.rounding_keys(7, counter + 1, 16)
    other_seed = sm.rounding_keys(8, counter, 16)
    assert not (keys == other_step).any() and not (keys == other_seed).any()


def test_stochastic_rounding_is_deterministic_for_a_seed() -> None:
    x = torch.randn(1000) / 3
    a = fp32_to_bf16_stochastic(x, torch.Generator().manual_seed(7))
    b = fp32_to_bf16_stochastic(x, torch.Generator().manual_seed(7))
    c = fp32_to_bf16_stochastic(x, torch.Generator().manual_seed(8))
    torch.testing.assert_close(a, b, **EXACT)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_tiny_updates_move_a_bf16_weight_as_fp32_would(rounding: str) -> None:
    # 2000 SGD steps of 1e-4 on a weight of 1: fp32 reaches 1.2; bf16's gap at 1 is 2**-7, so
    # every nearest rounding drops the step (1e-4 < 2**-8) and the weight never moves.
    steps, lr = 2000, 1e-4
    w = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    inner = torch.optim.SGD([w], lr=lr)
    opt = MixedPrecisionOptimizer(
        inner, master_weights=False, lean=LeanConfig(rounding=rounding, seed=0)
    )
    for _ in range(steps):
        w.grad = torch.full_like(w, -1.0)
        opt.step()
    fp32 = 1.0 + steps * lr
    if rounding == "nearest":
        assert bool((w == 1.0).all())  # the stall this mode exists to avoid
        return
    # Each step's rounding error is a zero-mean draw of std <= gap/2 = 2**-8 (gap 2**-7 in
    # [1, 2)); errors carry into the next step unchanged, so after n steps the weight's error is
    # their sum: std <= 2**-8 * sqrt(n) ~ 0.17 per element, 4096 elements average it to 0.003.
    assert abs(float(w.detach().float().mean()) - fp32) < 5 * 2**-8 * math.sqrt(steps) / math.sqrt(
        4096
    )


# ----- the policy -----
def test_bf16_sr_preset_and_policy_fields() -> None:
    p = preset("bf16_sr")
    assert p.param_dtype == torch.bfloat16 and p.master_weights is False
    assert (p.update_rounding, p.optimizer_state) == ("stochastic", "fp32")
    assert Policy(name="x", param_dtype=torch.bfloat16, master_weights="fp32").master_weights
    assert (
        Policy(name="x", param_dtype=torch.bfloat16, master_weights="none").master_weights is False
    )
    for mode in ("fp32", "fp16", "bf16", "fp16_naive", "bf16_sr"):
        assert to_policy(mode, {"optimizer_state": "int4"}).optimizer_state == "int4"
    assert to_policy({"mode": "bf16_sr", "optimizer_state": "int8"}).optimizer_state == "int8"


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: preset("bf16_sr", dtype="float16"), r"stochastic.*bfloat16 params.*fp16"),
        (lambda: to_policy("bf16_sr", {"optimizer_state": "int9"}), r"'int9'.*'int8'"),
        (lambda: to_policy("bf16_sr", {"optimizer_state": "int8/int9"}), r"'int8/int9'.*'int8'"),
        (lambda: to_policy("bf16_sr", {"optimizer_state": "int8/int4/fp8"}), r"two joined"),
        (lambda: Policy(name="x", optimizer_state=8), r"optimizer_state=8"),
        (lambda: Policy(name="x", update_rounding="random"), r"'random'"),
        (lambda: Policy(name="x", master_weights="fp16"), r"'fp16'.*'none'"),
        (
            lambda: Policy(
                name="x",
                param_dtype=torch.bfloat16,
                master_weights=True,
                update_rounding="stochastic",
            ),
            r"master_weights='none'",
        ),
    ],
)
def test_bad_lean_policies_are_refused(build, match) -> None:
    with pytest.raises(ValueError, match=match):
        build()


def test_stochastic_rounding_refuses_fp16_params_in_the_optimizer() -> None:
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"stochastic.*float16"):
        MixedPrecisionOptimizer(
            torch.optim.SGD([w], lr=0.1),
            master_weights=False,
            lean=LeanConfig(rounding="stochastic"),
        )


def test_lean_refuses_optimizers_outside_the_step_math() -> None:
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"RMSprop"):
        MixedPrecisionOptimizer(
            torch.optim.RMSprop([w]), master_weights=False, lean=LeanConfig(state="int8")
        )


# ----- the step: the core's step math, checked against torch's optimizers -----
def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)) for _ in range(n)]


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd_plain": lambda ps: torch.optim.SGD(ps, lr=0.1),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fp32_state_lean_step_equals_torch_optimizer(name: str) -> None:
    """fp32 params, fp32 state: the lean write-back is torch's update (reference: torch's own)."""
    ref, lean = mlp(), mlp()
    ref_opt = OPTIMIZERS[name](ref.parameters())
    opt = MixedPrecisionOptimizer(OPTIMIZERS[name](lean.parameters()), lean=LeanConfig())
    for x, y in batches(3):
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.backward(torch.nn.functional.mse_loss(lean(x), y))
        opt.step()
        opt.zero_grad()
    for a, b in zip(ref.parameters(), lean.parameters(), strict=True):
        torch.testing.assert_close(b, a, **FP32_ROUNDING)


def train(model, opt, data) -> None:
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()


def lean_setup(state: str, seed: int = 0, rounding: str = "stochastic"):
    model = mlp(seed).to(torch.bfloat16)
    opt = MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        master_weights=False,
        lean=LeanConfig(rounding=rounding, state=state, seed=123),
    )
    return model, opt


def snapshot(model, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for st in opt.state.values():
        for v in st.values():
            if type(v) is torch.Tensor:
                out.append(v.clone())
            else:
                out += [v.codes.clone(), v.scale.clone()]
    out.append(opt.lean.counter.clone())
    return out


@pytest.mark.parametrize("state", ["fp32", "bf16", "int8", "int4", "fp8", "int8/int4", "int4/fp32"])
def test_low_bit_state_is_quantized_and_compact(state: str) -> None:
    model, opt = lean_setup(state)
    train(model, opt, batches(2))
    big = opt.state[model[0].weight]  # 64 x 128 = 8192 elements: quantized by torchao
    numel = model[0].weight.numel()
    per_elem = {"fp32": 4, "bf16": 2, "int8": 1 + 4 / 256, "int4": 0.5 + 4 / 128}
    per_elem["fp8"] = 1 + 4 / 256
    first, second = (state.split("/") * 2)[:2]  # 'a/b': exp_avg in a, exp_avg_sq in b
    for key, fmt in (("exp_avg", first), ("exp_avg_sq", second)):
        assert state_bytes(big[key]) == pytest.approx(numel * per_elem[fmt])
    small = opt.state[model[2].bias]  # 8 elements: torchao keeps small tensors unquantized
    if state != "bf16":
        assert type(small["exp_avg"]) is torch.Tensor and small["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("state", ["fp32", "int8", "int4", "fp8", "int8/int4"])
def test_skipped_step_changes_nothing_bitwise(state: str) -> None:
    model, opt = lean_setup(state)
    train(model, opt, batches(2))
    before = snapshot(model, opt)
    x, y = batches(1, seed=5)[0]
    opt.backward(torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y))
    model[0].weight.grad[0, 0] = float("nan")
    result = opt.step()
    opt.zero_grad()
    assert result.skipped
    for a, b in zip(before, snapshot(model, opt), strict=True):
        torch.testing.assert_close(b, a, **EXACT)


@pytest.mark.parametrize("state", ["fp32", "int8", "int4", "int8/int4"])
def test_resume_continues_bit_for_bit(state: str) -> None:
    data = batches(6)
    model, opt = lean_setup(state)
    train(model, opt, data[:3])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train(model, opt, data[3:])
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)  # compact state is plain tensors and dicts
    resumed, resumed_opt = lean_setup(state, seed=9)  # other init and rng: all must be loaded
    resumed.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["opt"])
    train(resumed, resumed_opt, data[3:])
    for a, b in zip(snapshot(model, opt), snapshot(resumed, resumed_opt), strict=True):
        torch.testing.assert_close(b, a, **EXACT)


def test_checkpoint_low_bit_is_compact() -> None:
    """The first Linear's weight (8192 elements) saves its two moments as codes + one fp32
    scale per block, loadable with weights_only=True."""
    per_moment = {"fp32": 8192 * 4, "int8": 8192 + 8192 // 256 * 4, "int4": 4096 + 8192 // 128 * 4}
    for state, expected in per_moment.items():
        model, opt = lean_setup(state)
        train(model, opt, batches(1))
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        entry = torch.load(buf, weights_only=True)["state"][0]
        for key in ("exp_avg", "exp_avg_sq"):
            value = entry[key]
            tensors = (
                [value] if isinstance(value, torch.Tensor) else [value["codes"], value["scale"]]
            )
            assert sum(t.numel() * t.element_size() for t in tensors) == expected


@pytest.mark.parametrize("saved", ["int8", "int4", "fp8", "int8/int4"])
def test_low_bit_checkpoint_loads_into_fp32_state_and_back(saved: str) -> None:
    model, opt = lean_setup(saved)
    train(model, opt, batches(2))
    ckpt = opt.state_dict()
    weight = model[0].weight
    quantized = {k: to_fp32(opt.state[weight][k]) for k in ("exp_avg", "exp_avg_sq")}
    # into fp32 state: the dequantized values, exactly
    fp32_model, fp32_opt = lean_setup("fp32")
    fp32_model.load_state_dict(model.state_dict())
    fp32_opt.load_state_dict(ckpt)
    for key, value in quantized.items():
        got = fp32_opt.state[fp32_model[0].weight][key]
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, value, **EXACT)
    # and back: quantized from fp32 as a step writes it (torchao's copy_: block absmax scale,
    # nearest code), which need not give the saved codes again (a block's scale is re-derived)
    back_model, back_opt = lean_setup(saved)
    back_model.load_state_dict(model.state_dict())
    back_opt.load_state_dict(fp32_opt.state_dict())
    for key, fmt in zip(("exp_avg", "exp_avg_sq"), (saved.split("/") * 2)[:2], strict=True):
        expected = new_state(weight, fmt, signed=key == "exp_avg")
        expected.copy_(quantized[key])
        got = back_opt.state[back_model[0].weight][key]
        assert type(got) is type(expected)
        torch.testing.assert_close(to_fp32(got), to_fp32(expected), **EXACT)


def test_lean_checkpoint_loads_into_a_plain_mixprec_optimizer() -> None:
    model, opt = lean_setup("int8")
    train(model, opt, batches(2))
    plain = mlp().to(torch.bfloat16)
    plain.load_state_dict(model.state_dict())
    plain_opt = MixedPrecisionOptimizer(torch.optim.AdamW(plain.parameters(), lr=1e-2))
    plain_opt.load_state_dict(opt.state_dict())
    master = plain_opt.state[plain_opt.hp_masters[0]]["exp_avg"]
    torch.testing.assert_close(master, to_fp32(opt.state[model[0].weight]["exp_avg"]), **EXACT)


def test_ranks_get_distinct_seeds(monkeypatch) -> None:
    import mixprec.core.lean as lean

    seeds = []
    for rank in (0, 1):
        monkeypatch.setattr(lean, "rank_and_world", lambda rank=rank: (rank, 2))
        seeds.append(lean_setup("fp32")[1].lean.seed)
    assert seeds[0] != seeds[1]


def _several_small_tensors(seed: int) -> torch.nn.Module:
    """Two quantized weights (64 x 128), one too small to quantize, biases of odd sizes."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.Tanh(),
        torch.nn.Linear(128, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 7),
        torch.nn.Tanh(),
        torch.nn.Linear(7, 8),
    ).to(torch.bfloat16)


@pytest.mark.parametrize("state", ["fp32", "bf16", "int8", "int4", "fp8", "int8/int4"])
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_batched_small_tensors_step_as_one_at_a_time_bitwise(monkeypatch, state, name) -> None:
    """Small tensors stepped together (one flat buffer per state format) write the same bits as
    each tensor through its own kernel: weights, state (codes and scales) and the stream."""
    from mixprec.core import fused_step

    calls = []
    update = fused_step.update
    monkeypatch.setattr(fused_step, "update", lambda *a, **k: calls.append(1) or update(*a, **k))
    runs = []
    for batch_max in (0, None):  # 0: every tensor on its own
        model = _several_small_tensors(0)
        opt = MixedPrecisionOptimizer(
            OPTIMIZERS[name](model.parameters()),
            master_weights=False,
            lean=LeanConfig(rounding="stochastic", state=state, seed=7),
        )
        if batch_max is None:
            assert opt.lean.batch_max >= 128 * 64  # this model's tensors all batch
        else:
            opt.lean.batch_max = batch_max
        calls.clear()
        for x, y in batches(3):
            loss = torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
        runs.append((snapshot(model, opt), len(calls)))
    (alone, alone_calls), (batched, batched_calls) = runs
    assert alone_calls == 3 * 8  # one kernel call per tensor per step
    assert batched_calls < alone_calls
    for a, b in zip(alone, batched, strict=True):
        torch.testing.assert_close(b, a, **EXACT)


def _small_tensors_setup(state: str, batch_max: int | None = None):
    model = _several_small_tensors(0)
    opt = MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        master_weights=False,
        lean=LeanConfig(rounding="stochastic", state=state, seed=7),
    )
    if batch_max is not None:
        opt.lean.batch_max = batch_max
    return model, opt


def _small_tensors_step(model, opt, x, y, frozen: int | None = None) -> None:
    loss = torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)
    opt.backward(loss)
    if frozen is not None:  # this param has no grad this step: the batch changes
        list(model.parameters())[frozen].grad = None
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("state", ["fp32", "int8", "fp8", "int8/int4"])
def test_batched_state_lives_joined_and_follows_a_changing_batch(state: str) -> None:
    """A batch's state stays joined between steps (the optimizer's state tensors are views of
    one buffer per column: no state is copied in or out); a step where a param has no grad
    (another batch), a state_dict loaded into the optimizer (new state tensors) or a state
    tensor given other memory joins it again. Every step equals, bit for bit, each tensor
    through its own kernel."""
    (model, opt), (alone, alone_opt) = _small_tensors_setup(state), _small_tensors_setup(state, 0)
    data = batches(6)
    for step, (x, y) in enumerate(data):
        frozen = 1 if step in (1, 2) else 5 if step == 3 else None
        for m, o in ((model, opt), (alone, alone_opt)):
            _small_tensors_step(m, o, x, y, frozen)
        if step == 0:
            first, second = (opt.state[p]["exp_avg"] for p in list(model.parameters())[0:3:2])
            parts = (first, second) if type(first) is torch.Tensor else (first.codes, second.codes)
            assert parts[0].untyped_storage().data_ptr() == parts[1].untyped_storage().data_ptr()
        if step == 3:  # new state tensors, the same values
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        if step == 4:  # the same tensor, its memory elsewhere
            moment = opt.state[next(model.parameters())]["exp_avg"]
            if type(moment) is torch.Tensor:
                moment.data = moment.data.clone()
            else:
                moment.codes = moment.codes.clone()
        for a, b in zip(snapshot(alone, alone_opt), snapshot(model, opt), strict=True):
            torch.testing.assert_close(b, a, **EXACT)
    assert len(opt.lean._joins) <= 2  # joins over the same params replace each other


def test_fp32_masters_with_int8_state() -> None:
    """optimizer_state next to a masters mode: the masters step with int8 moments."""
    model = mlp()
    policy = to_policy("fp16_naive", {"optimizer_state": "int8", "dtype": "bfloat16"})
    pm = prepare_model(model, policy)
    opt = prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), policy)
    assert opt.hp_masters and opt.lean is not None
    losses = []
    for x, y in batches(1) * 20:  # one batch again and again: its loss must fall
        loss = torch.nn.functional.mse_loss(pm(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0]
    assert type(opt.state[opt.hp_masters[0]]["exp_avg"]).__name__ == "OptimState8bit"


# ----- the faces -----
def _loss_falls(model, opt, criterion=None) -> None:
    losses = []
    for x, y in batches(1) * 15:  # one batch again and again: its loss must fall
        out = model(x)
        loss = (criterion or torch.nn.functional.mse_loss)(out, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses


def test_booster_bf16_sr_by_name_and_class() -> None:
    for spec in ("bf16_sr", mixprec.BF16SRMixedPrecision(optimizer_state="int8")):
        model = mlp()
        booster = mixprec.Booster(mixed_precision=spec)
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        assert next(model.parameters()).dtype == torch.bfloat16
        assert opt.lean is not None and opt.lean.cfg.rounding == "stochastic"
        _loss_falls(model, opt)


def test_convert_to_amp_bf16_sr_with_int8_state() -> None:
    model = mlp()
    model, opt, _ = mixprec.convert_to_amp(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        None,
        "bf16_sr",
        {"optimizer_state": "int8"},
    )
    assert opt.lean.cfg.state == "int8"
    _loss_falls(model, opt)


@pytest.mark.parametrize("state", ["int8", "int8/int4"])
def test_config_file_bf16_sr(state: str) -> None:
    config = {"fp16": {"mode": "bf16_sr", "optimizer_state": state}}
    model = mlp()
    engine, *_ = mixprec.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config
    )
    assert engine.optimizer.lean.cfg.state == state
    x, y = batches(1)[0]
    engine.backward(torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y))
    engine.step()
    moments = engine.optimizer.state[model[0].weight]
    kinds = {"int8": "OptimState8bit", "int4": "OptimState4bit"}
    first, second = (state.split("/") * 2)[:2]
    assert type(moments["exp_avg"]).__name__ == kinds[first]
    assert type(moments["exp_avg_sq"]).__name__ == kinds[second]


@pytest.mark.slow  # importing Lightning takes most of its ~10 s
def test_lightning_plugin_bf16_sr_with_int8_state() -> None:
    L = pytest.importorskip("lightning")
    from mixprec.integrations.lightning import MixprecPrecision

    plugin = MixprecPrecision("bf16_sr", optimizer_state="int8")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=plugin)
    model = mlp()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for x, y in batches(1) * 15:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0]
    assert plugin.optimizer.lean.cfg == LeanConfig(rounding="stochastic", state="int8")
    assert model.module[0].weight.dtype == torch.bfloat16


def _lean_pair(optim: str, state: str, rounding: str):
    """Two identical lean (model, optimizer) pairs: bf16 params, no masters."""
    pairs = []
    for _ in range(2):
        model = mlp(0).to(torch.bfloat16)
        if optim == "sgd":
            inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
        else:
            inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        lean = LeanConfig(rounding=rounding, state=state, seed=123)
        pairs.append((model, MixedPrecisionOptimizer(inner, master_weights=False, lean=lean)))
    return pairs


def _lean_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), y)


@pytest.mark.parametrize(
    ("optim", "state", "rounding"),
    [
        ("adamw", "fp32", "stochastic"),
        ("adamw", "bf16", "nearest"),
        ("sgd", "bf16", "stochastic"),
        ("adamw", "int8", "stochastic"),
        ("adamw", "int8/int4", "nearest"),
        ("adamw", "fp8", "stochastic"),
        ("sgd", "int4", "stochastic"),
    ],
)
def test_compiled_lean_step_equals_the_eager_lean_step_bitwise(
    monkeypatch, optim: str, state: str, rounding: str
) -> None:
    """compile_step runs the lean write-back in its graph: the same step_math ops in the same
    order and the same rounding stream (step_math.rounding_keys of the optimizer's counter), so
    dynamo's graph run as is (no inductor: no re-fused arithmetic) equals the eager lean step,
    whose fused kernels run eagerly here, bit for bit: params, state, the stream's counter, a
    skipped step (nothing moves, the stream included). One compile for every step: the
    counter is a tensor, not a guarded constant."""
    from mixprec.core import fused_step
    from mixprec.core.compiled_step import compile_step

    monkeypatch.setattr(fused_step, "_failed", True)  # the eager kernels: the same ops as dynamo
    (model, opt), (ref, ref_opt) = _lean_pair(optim, state, rounding)
    backend = CountingBackend()
    step = compile_step(model, opt, _lean_loss, backend=backend)
    data = batches(5)
    data[2][1][0, 0] = float("inf")  # step 3 skips
    for i, (x, y) in enumerate(data):
        before = snapshot(ref, ref_opt)
        step(x.bfloat16(), y)
        ref_opt.backward(_lean_loss(ref(x.bfloat16()), y))
        assert ref_opt.step().skipped == (i == 2)
        ref_opt.zero_grad()
        if i == 2:
            for a, b in zip(before, snapshot(ref, ref_opt), strict=True):
                torch.testing.assert_close(b, a, **EXACT)
        for a, b in zip(snapshot(model, opt), snapshot(ref, ref_opt), strict=True):
            torch.testing.assert_close(a, b, **EXACT)
    assert step.compiled and backend.compiles == 1
    assert step.sync_counters() == 1
    if rounding == "stochastic":
        assert int(opt.lean.counter) == 4  # four steps wrote back; the skipped one drew nothing
    assert model[0].weight.dtype == torch.bfloat16


def _zero_worker(rank: int, world: int) -> None:
    import torch.distributed as dist
    from dist_utils import assert_same_on_every_rank

    from mixprec.booster.plugin.low_level_zero import LowLevelZeroPlugin

    x, y = batches(1)[0]
    mine = slice(rank * 8, (rank + 1) * 8)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    cases = [("nearest", "int8", sgd), ("stochastic", "int8", sgd)]
    cases.append(("nearest", "int8/int4", adamw))  # per moment: exp_avg int8, exp_avg_sq int4
    for rounding, state, make in cases:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)
        )
        ref_model = copy.deepcopy(model)
        plugin = LowLevelZeroPlugin(
            stage=2, precision="bf16", master_weights=False, optimizer_state=state,
            update_rounding=rounding,
        )  # fmt: skip
        booster = mixprec.Booster(plugin=plugin)
        model, opt, *_ = booster.boost(model, make(model.parameters()))
        assert opt.lean is not None and opt.lean.cfg.state == state
        ref = prepare_model(ref_model, plugin.policy)
        ref_opt = prepare_optimizer(make(ref_model.parameters()), plugin.policy)
        for _ in range(4):
            booster.backward(torch.nn.functional.mse_loss(model(x[mine]).float(), y[mine]), opt)
            ref_opt.backward(torch.nn.functional.mse_loss(ref(x).float(), y))
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        assert_same_on_every_rank(list(model.parameters()), f"{rounding} params")
        # Sharded: each rank holds the int8 buffers of the params it owns, their sum the whole.
        mine_bytes = torch.tensor(opt.shard_bytes()["optimizer_state"])
        dist.all_reduce(mine_bytes)
        whole = sum(state_bytes(t) for s in ref_opt.optim.state.values() for t in s.values())
        assert int(mine_bytes) == whole
        big = opt.optim.state.get(opt.all_params[0])
        if big is not None:
            kinds = {k: type(v).__name__ for k, v in big.items() if k != "step"}
            expected = {"momentum_buffer": "OptimState8bit"}
            if state == "int8/int4":
                expected = {"exp_avg": "OptimState8bit", "exp_avg_sq": "OptimState4bit"}
            assert kinds == expected
        if rounding == "nearest":
            # Half-batch bf16 grads sum in another order than the full batch's: a weight may
            # round to the neighbouring bf16 value (2**-8 relative), momentum carries it on.
            for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
                torch.testing.assert_close(p.float(), q.float(), rtol=2**-6, atol=2e-3)
        # a skip on one rank: nothing moves anywhere, the rounding stream included
        before = [p.detach().clone() for p in model.parameters()]
        rng = opt.lean.counter.clone()
        booster.backward(torch.nn.functional.mse_loss(model(x[mine]).float(), y[mine]), opt)
        if rank == 1:
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float(
                "inf"
            )
        assert opt.step().skipped
        opt.zero_grad()
        for b, p in zip(before, model.parameters(), strict=True):
            torch.testing.assert_close(p, b, **EXACT)
        assert torch.equal(opt.lean.counter.clone(), rng)


@pytest.mark.slow
@pytest.mark.distributed
def test_zero_shards_lean_state_and_matches_one_process() -> None:
    from dist_utils import spawn

    spawn(_zero_worker, 2)


def _pipeline_worker(rank: int, world: int) -> None:
    from dist_utils import assert_same_on_every_rank

    from mixprec.booster.plugin.hybrid_parallel import HybridParallelPlugin
    from mixprec.mixed_precision import MixedPrecision

    micro = 2
    # nearest rounding: a stage's rounding stream differs from one process's (ranks hold other
    # params), so equality with the reference is asked of the deterministic write-back
    policy = dataclasses.replace(
        preset("bf16_sr"), update_rounding="nearest", optimizer_state="int8"
    )

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64),
            torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
        )  # fmt: skip

    data = [(x, y.repeat(1, 8)) for x, y in batches(3)]
    plugin = HybridParallelPlugin(pp_size=world, num_microbatches=micro, precision=None)
    booster = mixprec.Booster(plugin=plugin, mixed_precision=MixedPrecision(policy))
    net = model()
    net, opt, criterion, *_ = booster.boost(
        net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), torch.nn.MSELoss()
    )
    assert opt.lean is not None and opt.lean.cfg.state == "int8"
    ref = model()
    ref_model = prepare_model(ref, policy)
    ref_opt = prepare_optimizer(torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), policy)
    for x, y in data:
        booster.execute_pipeline(iter([(x, y)]), net, criterion, opt)
        assert not opt.step().skipped
        opt.zero_grad()
        for xb, yb in zip(x.chunk(micro), y.chunk(micro), strict=True):
            ref_opt.backward(torch.nn.functional.mse_loss(ref_model(xb).float(), yb) / micro)
        ref_opt.step()
        ref_opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    held = {n: p for stage in net.stages for n, p in stage.module.named_parameters()}
    assert held, f"rank {rank} holds no params"
    for name, p in held.items():
        # bf16 grads summed over micro-batches in the schedule's order vs autograd's: a weight
        # may land on the neighbouring bf16 value; momentum carries it on for a step or two
        torch.testing.assert_close(p.float(), ref_params[name].float(), rtol=2**-6, atol=2e-3)
    assert_same_on_every_rank([opt.scaler.scale_tensor], "scale")


def _zero_gathered_worker(rank: int, world: int) -> None:
    import io

    import torch.distributed as dist

    from mixprec.booster.plugin.low_level_zero import LowLevelZeroPlugin

    x, y = batches(1)[0]
    mine = slice(rank * 8, (rank + 1) * 8)

    def build(seed):
        torch.manual_seed(seed)  # the rounding's base seed too (torch.initial_seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8)
        )
        plugin = LowLevelZeroPlugin(
            stage=2, precision="bf16", master_weights=False, optimizer_state="int8/int4",
            update_rounding="stochastic",
        )  # fmt: skip
        booster = mixprec.Booster(plugin=plugin)
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        return model, opt, booster

    def train(model, opt, booster, steps):
        for _ in range(steps):
            booster.backward(torch.nn.functional.mse_loss(model(x[mine]).float(), y[mine]), opt)
            opt.step()
            opt.zero_grad()

    def held_state(model, opt):
        out = [p.detach().clone() for p in model.parameters()]
        for p in (q for g in opt.optim.param_groups for q in g["params"]):
            for _, v in sorted(opt.optim.state.get(p, {}).items()):
                out += [v.clone()] if type(v) is torch.Tensor else [v.codes, v.scale]
        return [*out, opt.lean.counter.clone()]

    model, opt, booster = build(0)
    train(model, opt, booster, 2)
    gathered = opt.gathered_state_dict()
    blob = [None]
    if rank == 0:
        packed = [v for s in gathered["state"].values() for v in s.values() if isinstance(v, dict)]
        assert {v["lean_format"] for v in packed} == {"OptimState8bit", "OptimState4bit"}
        assert gathered["lean"]["optimizer_state"] == "int8/int4"
        buf = io.BytesIO()
        torch.save(gathered, buf)
        blob = [buf.getvalue()]
    dist.broadcast_object_list(blob, src=0)
    saved = torch.load(io.BytesIO(blob[0]), weights_only=True)
    weights = [p.detach().clone() for p in model.parameters()]
    train(model, opt, booster, 2)  # the run that was not interrupted
    expected = held_state(model, opt)

    resumed, opt2, booster2 = build(1)  # another seed: the stream must come from the file
    with torch.no_grad():
        for p, w in zip(resumed.parameters(), weights, strict=True):
            p.copy_(w)
    opt2.load_gathered_state_dict(saved)
    train(resumed, opt2, booster2, 2)
    for a, b in zip(held_state(resumed, opt2), expected, strict=True):
        torch.testing.assert_close(a, b, **EXACT)

    # one process loads it too: the same codes and scales, the stream at rank 0's seed
    torch.manual_seed(0)
    single = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))
    policy = with_optimizer_state(preset("bf16_sr"), "int8/int4")
    plain = prepare_optimizer(torch.optim.AdamW(single.bfloat16().parameters(), lr=1e-2), policy)
    plain.load_state_dict(saved)
    again = plain.state_dict()
    for i, entry in saved["state"].items():
        for key, value in entry.items():
            if isinstance(value, dict):
                assert torch.equal(again["state"][i][key]["codes"], value["codes"])
                assert torch.equal(again["state"][i][key]["scale"], value["scale"])
    assert int(plain.lean.counter) == int(saved["lean"]["rng"])


@pytest.mark.slow
@pytest.mark.distributed
def test_gathered_zero_checkpoint_of_lean_state_resumes_bit_for_bit() -> None:
    """LowLevelZeroPlugin's gathered optimizer checkpoint (one file, any world size) of int8/int4
    state with stochastic rounding: compact (codes and scales), loadable with
    weights_only=True, and a ZeRO run resumed from it on 2 ranks continues the uninterrupted run
    bit for bit (weights, codes, scales, each rank's rounding stream: the file keeps the base
    seed, each rank mixes its own again); one process loads the same codes and scales."""
    from dist_utils import spawn

    spawn(_zero_gathered_worker, 2)


@pytest.mark.slow
@pytest.mark.distributed
def test_pipeline_runs_lean_modes_as_one_process() -> None:
    from dist_utils import spawn

    spawn(_pipeline_worker, 2)
