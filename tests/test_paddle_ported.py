"""Paddle's own AMP unit tests, ported to mixprec.paddle with torch layers for Paddle's.

From PaddlePaddle/Paddle test/amp/: test_amp_api.py (TestAutoCast OD, TestGradScaler,
TestFp16Guard, TestStaticDecorate OD) and test_amp_promote.py (TestEagerAmpPromoteSimple,
the eager O2 op-stats cases). Paddle runs them on a GPU in float16; here they run on CPU in
bfloat16 (torch's CPU float16 convolutions are slow reference kernels), with the facts the
dtype does not change. Where mixprec differs, the assertion says so and docs/differences.md's
"PaddlePaddle 3.3.1" section gives the reason.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import paddle as amp
from mixprec.paddle import debugging, static
from mixprec.paddle.static import executor
from mixprec.paddle.static.amp import _op_name

LP = torch.bfloat16


@pytest.fixture
def conv_linear():
    torch.manual_seed(0)
    return nn.Conv2d(1, 6, 3, bias=False), nn.Linear(4, 4)


def test_auto_cast_od_level(conv_linear) -> None:
    """TestAutoCast.test_amp_OD_level: conv (white) low, an add fp32, and the Linear after it."""
    conv, linear = conv_linear
    with amp.auto_cast(level="OD", dtype="bfloat16"):
        out1 = conv(torch.rand(1, 1, 6, 6))
        out2 = out1 + torch.rand(out1.shape, dtype=LP)
        out3 = linear(out2)
    assert out1.dtype == LP
    assert out2.dtype == torch.float32
    # Paddle's test: float32 (its Linear was matmul + a bias add, and OD runs the add in fp32);
    # Paddle 3.3.1 runs Linear as linear_v2, one white-listed op, as torch's F.linear: low
    assert out3.dtype == LP


@pytest.mark.parametrize("use_promote", [True, False])
def test_eager_o2_promote_simple(conv_linear, use_promote) -> None:
    """TestEagerAmpPromoteSimple: conv on an fp32 input low (white list), the add of two low
    tensors low; the Linear with its fp32 weight low here (see the OD case: one op in torch)."""
    conv, linear = conv_linear
    with amp.auto_cast(level="O2", dtype="bfloat16", use_promote=use_promote):
        conv_out = conv(torch.rand(1, 1, 6, 6))
        add_out = conv_out + torch.rand(conv_out.shape, dtype=LP)
        linear_out = linear(add_out)
    assert conv_out.dtype == add_out.dtype == LP
    # Paddle's test: float32 with use_promote (Linear as matmul + a promoted bias add, before
    # 3.3.1's linear_v2), float16 without; see test_paddle_promote.py
    assert linear_out.dtype == LP


class ConvModel(nn.Module):
    """A build_conv_model-like net: conv, an add with an fp32 tensor, relu, linear, softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 6, 3, bias=False)
        self.linear = nn.Linear(4, 4)
        self.shift = torch.ones(6, 4, 4)  # fp32, not a parameter: decorate leaves it fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.conv(x) + self.shift)
        return torch.softmax(self.linear(out), dim=-1)


@pytest.mark.parametrize("use_promote, low_relu", [(True, 0), (False, 1)])
def test_eager_o2_promote_op_stats(use_promote, low_relu) -> None:
    """TestEagerAmpPromoteStats: O2 over a decorated conv model. Paddle's fp16 calls: conv2d 1
    and matmul 1 either way, relu 0 with promote (its input was promoted) and 1 without.
    Counted here by aten op and output dtype."""
    torch.manual_seed(0)
    model = ConvModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.decorate(model, opt, level="O2", dtype="bfloat16")
    scaler = amp.GradScaler(device="cpu", use_dynamic_loss_scaling=False, init_loss_scaling=1.0)
    debugging.enable_operator_stats_collection()
    with amp.auto_cast(level="O2", dtype="bfloat16", use_promote=use_promote):
        loss = model(torch.rand(1, 1, 6, 6)).mean()
    scaled = scaler.scale(loss)
    scaled.backward()
    scaler.minimize(opt, scaled)
    opt.clear_grad()
    forward = debugging.disable_operator_stats_collection().as_dict("forward")
    assert forward["convolution"]["bfloat16"] == 1
    assert forward["relu"]["bfloat16"] == low_relu
    matmul_low = sum(forward.get(op, {}).get("bfloat16", 0) for op in ("addmm", "mm", "bmm"))
    assert matmul_low == 1


def test_grad_scaler_switches_off_after_a_bf16_auto_cast() -> None:
    """TestGradScaler.test_amp_grad_scaler: bf16 auto_cast with conv2d black-listed; the
    scaler ends disabled and static, and the conv ran in fp32."""
    torch.manual_seed(0)
    model = nn.Conv2d(3, 2, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = amp.GradScaler(device="cpu")
    data = torch.rand(1, 3, 8, 8)
    debugging.enable_operator_stats_collection()
    with amp.auto_cast(custom_black_list=["conv2d"], dtype="bfloat16"):
        out = model(data)
        loss = out.mean()
    with pytest.warns(UserWarning, match="bfloat16"):
        scaled = scaler.scale(loss)
    scaled.backward()
    scaler.minimize(optimizer, scaled)
    optimizer.zero_grad()
    stats = debugging.disable_operator_stats_collection()
    assert not scaler.is_enable() and not scaler.is_use_dynamic_loss_scaling()
    assert stats.total_by_dtype()["bfloat16"] == 0  # nothing low: the conv was black-listed
    assert scaled is loss  # no scale multiplication ran


@pytest.fixture
def static_mode(monkeypatch):
    monkeypatch.setitem(executor.COMPILE_OPTIONS, "backend", "eager")
    static.enable_static()
    with static.program_guard(static.Program(), static.Program()):
        yield
    static.disable_static()


def test_fp16_guard_example(static_mode) -> None:
    """TestFp16Guard: conv + batch norm inside fp16_guard, pool black-listed by Paddle's name
    'pool2d', fc outside; after amp_init the fc bias stays fp32, the conv weight goes low."""
    torch.manual_seed(0)
    conv, bn, fc = nn.Conv2d(1, 6, 3), nn.BatchNorm2d(6), nn.Linear(6 * 3 * 3, 10)
    data = static.data(name="X", shape=[-1, 1, 8, 8], dtype="float32")
    with static.amp.fp16_guard():
        hidden = torch.relu(bn(conv(data)))
    pool = F.max_pool2d(hidden, kernel_size=2, stride=2)
    loss = fc(pool.flatten(1)).mean()
    optimizer = torch.optim.SGD([*conv.parameters(), *bn.parameters(), *fc.parameters()], 0.01)
    amp_list = static.amp.CustomOpLists(custom_black_list=["pool2d"])
    optimizer = static.amp.decorate(
        optimizer,
        amp_list,
        init_loss_scaling=128.0,
        use_dynamic_loss_scaling=True,
        use_pure_fp16=True,
    )
    optimizer.minimize(loss)
    exe = static.Executor(static.CPUPlace())
    exe.run(static.default_startup_program())
    optimizer.amp_init(static.CPUPlace(), scope=static.global_scope())
    assert fc.bias.dtype == torch.float32
    assert conv.weight.dtype == torch.float16
    assert bn.weight.dtype == torch.float32  # norms stay fp32 (NORM_OPS)
    (got,) = exe.run(feed={"X": np.ones((2, 1, 8, 8), np.float32)}, fetch_list=[loss])
    assert np.isfinite(got) and got.shape == ()


def test_static_decorate_od(static_mode) -> None:
    """TestStaticDecorate.test_static_amp_OD: under OD the conv and the matmul run low, the
    add and the mean in fp32."""
    torch.manual_seed(0)
    conv, linear = nn.Conv2d(1, 6, 3, bias=False), nn.Linear(4, 4)
    x = static.data(name="input", shape=[-1, 1, 6, 6], dtype="float32")
    out1 = conv(x)
    out2 = out1 + torch.rand(1, 6, 4, 4, dtype=torch.float16)
    loss = linear(out2).mean()
    optimizer = static.amp.decorate(
        # Paddle's optimizer: Adadelta, which runs the same step eagerly (no fused update)
        torch.optim.Adadelta([*conv.parameters(), *linear.parameters()], lr=0.001),
        init_loss_scaling=128.0,
        use_dynamic_loss_scaling=True,
        level="OD",
        dtype="bfloat16",
    )
    optimizer.minimize(loss)
    casts = {
        _op_name(op.func): cast for op, cast in zip(loss.program.ops, optimizer.casts, strict=True)
    }
    assert casts["conv2d"] == casts["linear"] == LP  # conv2d: 1, matmul_v2: 1 low calls
    assert casts["add"] == casts["mean"] == torch.float32  # elementwise_add, reduce_mean: 0
    exe = static.Executor(static.CPUPlace())
    exe.run(static.default_startup_program())
    for _ in range(2):  # max_iters = 2
        (got,) = exe.run(
            feed={"input": np.random.default_rng(0).random((1, 1, 6, 6), dtype=np.float32)},
            fetch_list=[loss],
        )
        assert np.isfinite(got)


# ----- test/legacy_test/test_imperative_auto_mixed_precision.py (TestAmpScaler, decorator) ---


def run_simple_conv(use_scaler: bool, nan: bool = False):
    """A Conv2d + relu trained one SGD step, through the scaler's minimize or plainly."""
    torch.manual_seed(10)
    model = nn.Sequential(nn.Conv2d(3, 8, 7, stride=2), nn.ReLU())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.rand(1, 3, 32, 32)
    if nan:
        data[0, 1, 2, 3] = torch.nan
    loss = model(data).mean()
    if use_scaler:
        scaler = amp.GradScaler(init_loss_scaling=1024, device="cpu")
        scaled = scaler.scale(loss)
        scaled.backward()
        ops, params_grads = scaler.minimize(optimizer, scaled)
    else:
        loss.backward()
        optimizer.step()
        ops, params_grads = [], [(p, p.grad) for p in model.parameters()]
    return ops, params_grads


def test_minimize_with_a_scaler_equals_without() -> None:
    """TestAmpScaler.test_minimize / test_step: the same grads and parameters (Paddle:
    rtol 1e-5; here bit for bit: 1024 is a power of two and fp32 grads neither overflow nor
    underflow); optimize_ops is [] in dygraph mode."""
    with_scaler, without = run_simple_conv(True), run_simple_conv(False)
    assert with_scaler[0] == without[0] == []
    for (p, g), (q, h) in zip(with_scaler[1], without[1], strict=True):
        torch.testing.assert_close(g, h, rtol=0, atol=0)
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_nan_input_skips_the_step() -> None:
    """TestAmpScaler.test_nan_inf: a NaN in the input; the parameters do not move."""
    torch.manual_seed(10)
    before = [p.detach().clone() for p in nn.Sequential(nn.Conv2d(3, 8, 7, stride=2)).parameters()]
    _, params_grads = run_simple_conv(True, nan=True)
    for (p, _), b in zip(params_grads, before, strict=True):
        torch.testing.assert_close(p, b, rtol=0, atol=0)
    assert torch.isnan(params_grads[0][1]).any()  # the weight's grad holds the NaN


def test_step_update_exceptions() -> None:
    """TestAmpScaler.test_step_update_exception: unscale_ twice, unscale_ after step, step
    twice: each a RuntimeError, as Paddle's."""

    def scaled_setup():
        model = nn.Conv2d(3, 2, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = amp.GradScaler(init_loss_scaling=1024, device="cpu")
        scaler.scale(model(torch.rand(2, 3, 8, 8)).mean()).backward()
        return scaler, optimizer

    scaler, optimizer = scaled_setup()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(optimizer)
    scaler, optimizer = scaled_setup()
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(optimizer)
    scaler, optimizer = scaled_setup()
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(optimizer)


def test_get_and_set() -> None:
    """TestAmpScaler.test_get_and_set."""
    scaler = amp.GradScaler(
        enable=True,
        init_loss_scaling=1024,
        incr_ratio=2.0,
        decr_ratio=0.5,
        incr_every_n_steps=1000,
        decr_every_n_nan_or_inf=2,
        use_dynamic_loss_scaling=True,
    )
    assert scaler.is_enable() and scaler.is_use_dynamic_loss_scaling()
    assert scaler.get_init_loss_scaling() == 1024 and scaler.get_incr_ratio() == 2.0
    assert scaler.get_decr_ratio() == 0.5 and scaler.get_incr_every_n_steps() == 1000
    assert scaler.get_decr_every_n_nan_or_inf() == 2
    scaler.set_decr_every_n_nan_or_inf(4)
    scaler.set_decr_ratio(0.1)
    scaler.set_incr_every_n_steps(200)
    scaler.set_incr_ratio(3.0)
    scaler.set_init_loss_scaling(100)
    assert scaler.get_decr_every_n_nan_or_inf() == 4 and scaler.get_decr_ratio() == 0.1
    assert scaler.get_incr_every_n_steps() == 200 and scaler.get_incr_ratio() == 3.0
    assert scaler.get_init_loss_scaling() == 100


def test_state_dict_and_load_state_dict() -> None:
    """TestAmpScaler.test_state_dict_and_load_state_dict (and _error)."""
    scaler1 = amp.GradScaler(True, 14, 233.0, 0.523, 1090, 20, True, device="cpu")
    state = scaler1.state_dict()
    scaler2 = amp.GradScaler(enable=True, device="cpu")
    scaler2.load_state_dict(state)
    assert scaler2.get_init_loss_scaling() == 14 and scaler2.get_incr_ratio() == 233.0
    assert scaler2.get_decr_ratio() == 0.523 and scaler2.get_incr_every_n_steps() == 1090
    assert scaler2.get_decr_every_n_nan_or_inf() == 20
    scaler3 = amp.GradScaler(enable=False)
    scaler3.load_state_dict(state)
    assert not scaler3.is_enable()
    with pytest.raises(RuntimeError):
        amp.GradScaler(enable=True, device="cpu").load_state_dict({})


def test_decorate_errors() -> None:
    """TestAmpDecorator: a bad level is a ValueError, a non-model or non-optimizer a
    TypeError, a DataParallel model a RuntimeError."""
    model = nn.Conv2d(3, 2, 3, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'O'"):
        amp.decorate(models=model, optimizers=opt, level="O")
    with pytest.raises(TypeError):
        amp.decorate(models=object(), optimizers=None, level="O2")
    with pytest.raises(RuntimeError, match="DataParallel"):
        amp.decorate(models=nn.DataParallel(model), level="O2")
    with pytest.raises(TypeError):
        amp.decorate(models=model, optimizers=object(), level="O2")
