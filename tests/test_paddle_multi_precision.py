"""Paddle's test/contrib/test_multi_precision_fp16_train, ported to mixprec.paddle.static.

Paddle's test trains a small ResNet with static-graph pure-fp16 AMP (use_pure_fp16=True, fp32
master weights, the residual blocks in fp16_guard(), amp_init after the startup program) under
Momentum, Momentum with Nesterov, AdamW and Lars, and checks every step's loss against the
same program trained in fp32 within rtol 0.01. Here the network is torch layers (conv, batch
norm, a residual block, average pool, a linear head, cross-entropy summed over the batch) at a
tiny size so each run takes about a second.

Steps are compiled with backend="eager" (dynamo only), as tests/test_paddle_static.py does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._dynamo
from tolerances import EXACT, FP32_ROUNDING
from torch import nn
from torch.nn import functional as F

from mixprec.paddle import static
from mixprec.paddle.optimizer import LarsMomentumOptimizer
from mixprec.paddle.static import executor

# tiny on purpose: Paddle's is 3x32x32 images, batch 16, a 32-deep ResNet, 5 batches
CHANNELS, SIDE, BATCH, STEPS, CLASSES = 3, 8, 4, 4, 10

# Paddle compares fp16 against fp32 with rtol 0.01. bfloat16 keeps 8 significand bits to
# float16's 11, so its rounding error is 2**3 times larger: the same test in bf16 gets 0.08.
RTOL = {torch.float16: 0.01, torch.bfloat16: 0.08}

# The updates against fp32 (relative error of all parameters' total update) take RTOL too
# under Momentum (measured 0.007 fp16, 0.04 bf16). AdamW's first steps move each weight by about
# lr * g / |g|: a weight whose gradient sits within its rounding of 0 (conv2's bias before a
# batch norm has gradient 0 in exact arithmetic) moves a full lr either way, so its error is set
# by how many such weights there are, not by the dtype (measured 0.23 in bf16). Below 0.5 the
# fp32 direction still dominates; a frozen or unscaled run reads 1 or more.
UPDATE_RTOL = {"adamw": 0.5}


@pytest.fixture(autouse=True)
def _static_mode(monkeypatch):
    monkeypatch.setitem(executor.COMPILE_OPTIONS, "backend", "eager")
    static.enable_static()
    yield
    static.disable_static()


class Net(nn.Module):
    """A stem conv + BN outside the guard, one residual block inside it, pool and head outside."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(CHANNELS, 8, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(8)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem_bn(self.stem(x)))
        with static.amp.fp16_guard():  # Paddle's test guards its residual blocks
            h = F.relu(self.bn1(self.conv1(x)))
            x = F.relu(self.bn2(self.conv2(h)) + x)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw":  # Paddle's AdamW(learning_rate=0.001, epsilon=1e-8, weight_decay=0.0)
        return torch.optim.AdamW(params, lr=0.001, eps=1e-8, weight_decay=0.0)
    # Paddle's Momentum(0.001, 0.9, weight_decay=L2Decay(1e-4)): L2 added to the gradient
    return torch.optim.SGD(
        params, lr=0.001, momentum=0.9, nesterov=name == "nesterov", weight_decay=1e-4
    )


def batches(seed: int, n: int = STEPS):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.random((BATCH, CHANNELS, SIDE, SIDE), dtype=np.float32),
            rng.integers(0, CLASSES - 1, (BATCH,), dtype=np.int64),
        )
        for _ in range(n)
    ]


def train(optimizer_name: str, dtype: torch.dtype | None):
    """Train the program (pure low precision when dtype is given); the fetched losses and net."""
    with static.program_guard(static.Program(), static.Program()):
        torch.manual_seed(123)
        net = Net()
        images = static.data(name="pixel", shape=[-1, CHANNELS, SIDE, SIDE], dtype="float32")
        label = static.data(name="label", shape=[-1], dtype="int64")
        sum_cost = F.cross_entropy(net(images), label, reduction="sum")
        optimizer = make_optimizer(optimizer_name, net.parameters())
        if dtype is not None:
            optimizer = static.amp.decorate(
                optimizer,
                init_loss_scaling=128.0,
                use_dynamic_loss_scaling=True,
                use_pure_fp16=True,
                dtype=dtype,
            )
        optimizer.minimize(sum_cost)
        place = static.CPUPlace()
        exe = static.Executor(place)
        exe.run(static.default_startup_program())
        if dtype is not None:
            optimizer.amp_init(place)
        losses = []
        for x, y in batches(seed=123):
            (loss,) = exe.run(feed={"pixel": x, "label": y}, fetch_list=[sum_cost])
            losses.append(float(loss))  # Paddle 3 fetches the sum 0-d: float() works
        return losses, net, optimizer


# bfloat16 for the optimizer sweep: a CPU has no fast float16 kernels (convolutions and GEMMs
# in fp16 are slow fallbacks), so fp16, Paddle's dtype, runs once, on Momentum, at this tiny size.
# Paddle's fourth optimizer, Lars (mixprec.paddle.optimizer), steps eagerly only: tested below.
@pytest.mark.parametrize(
    ("optimizer_name", "dtype"),
    [
        ("momentum", torch.float16),
        ("momentum", torch.bfloat16),
        ("nesterov", torch.bfloat16),
        ("adamw", torch.bfloat16),
    ],
    ids=["momentum-fp16", "momentum-bf16", "nesterov-bf16", "adamw-bf16"],
)
def test_pure_low_precision_training_follows_fp32(optimizer_name, dtype):
    torch._dynamo.reset()
    torch.manual_seed(123)
    initial = [p.detach().clone() for p in Net().parameters()]
    low, low_net, low_opt = train(optimizer_name, dtype)
    fp32, fp32_net, _ = train(optimizer_name, None)
    assert all(np.isfinite(low)) and len(low) == STEPS
    np.testing.assert_allclose(low, fp32, rtol=RTOL[dtype], atol=1e-5)  # Paddle's check
    # The losses above differ from fp32 by ~1e-4 here, mostly the data's spread: the updates
    # are the sharper check. Each parameter's total update (its fp32 master's, for the cast
    # ones) must follow the fp32 run's within the dtype's relative tolerance.
    masters = dict(zip(map(id, low_opt.wrapped.lp_params), low_opt.wrapped.hp_masters, strict=True))
    low_update, fp32_update = [], []
    for start, p, q in zip(initial, low_net.parameters(), fp32_net.parameters(), strict=True):
        low_update.append((masters.get(id(p), p).detach().float() - start).flatten())
        fp32_update.append((q.detach() - start).flatten())
    low_update, fp32_update = torch.cat(low_update), torch.cat(fp32_update)
    assert fp32_update.norm() > 0  # the steps moved the weights: a frozen run fails below
    error = float((low_update - fp32_update).norm() / fp32_update.norm())
    assert error < UPDATE_RTOL.get(optimizer_name, RTOL[dtype]), error


def test_use_fp16_guard_defaults_to_use_pure_fp16_and_amp_init_casts_the_guarded_layers():
    _, net, optimizer = train("momentum", torch.bfloat16)
    assert optimizer.cfg.guard is True  # use_fp16_guard=None: Paddle sets it to use_pure_fp16
    low = {n for n, p in net.named_parameters() if p.dtype == torch.bfloat16}
    # the guarded block's conv weights run low; its batch norms and all outside stay fp32
    assert low == {"conv1.weight", "conv2.weight", "conv2.bias"}
    masters = optimizer.wrapped.hp_masters
    assert len(masters) == len(low) and all(m.dtype == torch.float32 for m in masters)


def test_amp_init_takes_paddles_arguments_and_names_what_it_cannot_do():
    with static.program_guard(static.Program(), static.Program()):
        net = nn.Linear(4, 2)
        x = static.data(name="x", shape=[-1, 4], dtype="float32")
        loss = net(x).sum()
        opt = static.amp.decorate(
            torch.optim.SGD(net.parameters(), lr=0.1),
            use_pure_fp16=True,
            use_fp16_guard=False,  # no fp16_guard() here: every op may run low
            dtype="bfloat16",
        )
        opt.minimize(loss)
        place = static.CPUPlace()
        static.Executor(place).run(static.default_startup_program())
        with pytest.raises(TypeError, match="unexpected keyword argument 'use_fp16_testt'"):
            opt.amp_init(place, use_fp16_testt=True)
        with pytest.raises(NotImplementedError, match="test_program"):
            opt.amp_init(place, test_program=static.Program(), use_fp16_test=True)
        with pytest.raises(TypeError, match="use_fp16_test='yes' must be a bool"):
            opt.amp_init(place, use_fp16_test="yes")
        fp32_weight = net.weight.detach().clone()
        opt.amp_init(place, scope=static.global_scope(), use_fp16_test=False)
        assert net.weight.dtype == torch.bfloat16
        (master, _) = opt.wrapped.hp_masters
        torch.testing.assert_close(master, fp32_weight, rtol=0, atol=0)  # the fp32 values


def test_amp_init_rewrite_master_weight_starts_the_masters_from_the_rounding():
    with static.program_guard(static.Program(), static.Program()):
        torch.manual_seed(0)
        net = nn.Linear(4, 2)
        fp32_weight = net.weight.detach().clone()
        x = static.data(name="x", shape=[-1, 4], dtype="float32")
        loss = net(x).sum()
        opt = static.amp.decorate(
            torch.optim.SGD(net.parameters(), lr=0.1),
            use_pure_fp16=True,
            use_fp16_guard=False,  # no fp16_guard() here: every op may run low
            dtype="bfloat16",
        )
        opt.minimize(loss)
        place = static.CPUPlace()
        static.Executor(place).run(static.default_startup_program())
        opt.amp_init(place, rewrite_master_weight=True)
        (master, _) = opt.wrapped.hp_masters
        rounded = fp32_weight.to(torch.bfloat16).float()
        assert not torch.equal(rounded, fp32_weight)  # the rounding is visible at this seed
        torch.testing.assert_close(master, rounded, rtol=0, atol=0)


# ----- Lars: Paddle's fourth optimizer, written for torch -----

LARS = json.loads((Path(__file__).parent / "data" / "paddle_331_lars.json").read_text())


def _lars_run(param: torch.Tensor, grads, **kwargs) -> list[torch.Tensor]:
    opt = LarsMomentumOptimizer(parameter_list=[param], **kwargs)
    out = []
    for g in grads:
        param.grad = torch.tensor(g, dtype=param.dtype)
        opt.step()
        out.append(param.detach().clone())
    return out


@pytest.mark.parametrize("case", sorted(LARS["cases"]))
def test_lars_steps_as_paddles_recorded_kernel(case):
    fact = LARS["cases"][case]
    param = nn.Parameter(torch.tensor(LARS["p0"]))
    got = _lars_run(param, LARS["grads"], **fact["kwargs"])
    # Paddle's CPU kernel is Eigen over fp32: its norms sum in another order (FP32_ROUNDING)
    for step, expected in zip(got, fact["params"], strict=True):
        torch.testing.assert_close(step, torch.tensor(expected), **FP32_ROUNDING)


def test_lars_multi_precision_keeps_fp32_masters_as_the_fp32_run():
    # gradients exact in bfloat16, so the bf16 run's fp32 masters see the fp32 run's gradients
    torch.manual_seed(0)
    start = torch.randn(4, 3)
    grads = [(torch.randint(-8, 8, (4, 3)) / 8).tolist() for _ in range(4)]
    kwargs = {"learning_rate": 0.5, "momentum": 0.9, "lars_coeff": 0.01}
    fp32 = _lars_run(nn.Parameter(start.clone()), grads, **kwargs)
    low = nn.Parameter(start.to(torch.bfloat16))
    opt = LarsMomentumOptimizer(parameter_list=[low], multi_precision=True, **kwargs)
    for g in grads:
        low.grad = torch.tensor(g, dtype=torch.bfloat16)
        opt.step()
        master = opt.state[low]["master_weight"]
        assert master.dtype == opt.state[low]["velocity"].dtype == torch.float32
        # the master starts from the bf16 rounding of start, as Paddle's master weights do
        assert low.dtype == torch.bfloat16 and torch.equal(low, master.to(torch.bfloat16))
    reference = _lars_run(nn.Parameter(start.to(torch.bfloat16).float()), grads, **kwargs)
    torch.testing.assert_close(master, reference[-1], **EXACT)  # the same fp32 math, bit for bit
    assert not torch.equal(reference[-1], fp32[-1])  # (the starting rounding is visible)
    # without multi_precision the bf16 parameter moves in bf16, with Paddle's warning
    with pytest.warns(UserWarning, match="multi_precision=True"):
        plain = _lars_run(nn.Parameter(start.to(torch.bfloat16)), grads, **kwargs)
    assert plain[-1].dtype == torch.bfloat16 and not torch.equal(plain[-1].float(), master)


def test_lars_has_paddles_signature_but_its_graph_options():
    import inspect

    # regularization, grad_clip, name, exclude_from_weight_decay: README says why they are out
    left_out = {"regularization", "grad_clip", "name", "exclude_from_weight_decay"}
    recorded = [[n, d] for n, d in LARS["signature"] if n not in left_out]
    ours = inspect.signature(LarsMomentumOptimizer.__init__).parameters.values()
    got = [[p.name, None if p.default is p.empty else p.default] for p in ours if p.name != "self"]
    assert got == recorded


def test_lars_param_groups_and_bad_arguments():
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    opt = LarsMomentumOptimizer(
        0.1, 0.9, parameter_list=[{"params": [a]}, {"params": [b], "lars_weight_decay": 0.0}]
    )
    a.grad, b.grad = torch.full((3,), 0.5), torch.full((3,), 0.5)
    opt.step()
    # no decay: plain momentum SGD (Paddle's exclude_from_weight_decay), b = 1 - 0.1 * 0.5
    torch.testing.assert_close(b.detach(), torch.full((3,), 0.95), **EXACT)
    # the LARS rate: 0.1 * 0.001 * |a| / (|g| + 5e-4 |a|) times (g + 5e-4 a)
    norm_a, norm_g = math.sqrt(3), math.sqrt(3) * 0.5
    local = 0.1 * 0.001 * norm_a / (norm_g + 0.0005 * norm_a)
    torch.testing.assert_close(
        a.detach(), torch.full((3,), 1 - local * (0.5 + 0.0005)), **FP32_ROUNDING
    )
    with pytest.raises(TypeError, match="parameter_list"):
        LarsMomentumOptimizer(0.1, 0.9)
    with pytest.raises(ValueError, match="momentum=-1"):
        LarsMomentumOptimizer(0.1, -1, parameter_list=[a])
    with pytest.raises(TypeError, match="multi_precision=1"):
        LarsMomentumOptimizer(0.1, 0.9, parameter_list=[a], multi_precision=1)
    with pytest.raises(TypeError, match="exclude_from_weight_decay"):
        LarsMomentumOptimizer(0.1, 0.9, parameter_list=[a], exclude_from_weight_decay=["b"])


def test_lars_under_the_static_executor_steps_eagerly_and_skips_bitwise():
    # the compiled step's fused update knows SGD, Adam and AdamW: LARS runs the same step
    # eagerly (fp32 masters, the scaler's skip), as Paddle's static decorate takes any optimizer
    with static.program_guard(static.Program(), static.Program()):
        net = nn.Linear(4, 2)
        x = static.data(name="x", shape=[-1, 4], dtype="float32")
        loss = net(x).sum()
        lars = LarsMomentumOptimizer(0.1, 0.9, parameter_list=net.parameters())
        opt = static.amp.decorate(lars, use_pure_fp16=True, use_fp16_guard=False, dtype="bfloat16")
        opt.minimize(loss)
        place = static.CPUPlace()
        exe = static.Executor(place)
        exe.run(static.default_startup_program())
        opt.amp_init(place)
        masters = opt.wrapped.hp_masters
        start = [m.detach().clone() for m in masters]
        exe.run(feed={"x": np.ones((2, 4), np.float32)}, fetch_list=[loss])
        moved = [m.detach().clone() for m in masters]
        assert all(not torch.equal(a, b) for a, b in zip(start, moved, strict=True))
        bad = np.ones((2, 4), np.float32)
        bad[0, 0] = np.inf
        exe.run(feed={"x": bad}, fetch_list=[loss])
        for a, b in zip(moved, masters, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
