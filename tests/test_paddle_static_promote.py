"""The static face's biased convolution, Paddle's way: conv2d, then the bias's own add.

Ported: PaddlePaddle/Paddle test/amp/test_amp_promote.py at commit
09d06946d919bc338915788c5bbae50c0db44458, class TestStaticAmpPromoteStats (test_static_amp_o1,
test_static_amp_o2), with its model from test/amp/amp_base_models.py at commit
0d4f783a24b3f5856f822a8643ffbe734eb907f1 (SimpleConvNet, build_conv_model, _build_optimizer).
Paddle runs them on a GPU in float16; here they run on CPU in bfloat16 (torch's CPU float16
convolutions are slow reference kernels); the rule does not depend on the low dtype.

Paddle counts the low-precision ops of the program (amp.debugging.collect_operator_stats on the
main program). Here the program's forward is replayed eagerly through the module its compiled
step runs (the same ops and casts) and counted by aten name and output dtype: conv2d is
`convolution`, elementwise_add `add`, matmul_v2 `addmm`, softmax `_softmax`, reduce_mean `mean`.
Changed assertions, each with its reason:
- main_program.num_blocks == 1: dropped, a mixprec Program has no blocks (one op list).
- elementwise_add under O2: 1 low call where Paddle counts 2. Paddle's static Linear is matmul_v2
  plus its own elementwise_add; torch's nn.Linear is one op (addmm), low, as Paddle 3.3.1's
  linear_v2 (see test_paddle_promote.py). The conv's bias add is the 1 counted.
- adamw 4 (O2) / 0 (O1) low calls: mixprec updates fp32 master weights, never low parameters in
  place; what Paddle's count shows, that amp_init cast the 4 parameters low, is asserted instead.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_paddle_promote import PADDLE_331
from tolerances import fp32_rounding
from torch import nn

from mixprec import paddle as amp
from mixprec.paddle import debugging, static
from mixprec.paddle.static.amp import _op_name

pytestmark = pytest.mark.usefixtures("paddle_static_mode")  # conftest

LP = torch.bfloat16


class SimpleConvNet(nn.Module):
    """amp_base_models.SimpleConvNet: a biased conv, relu over its output cast to fp32, a
    flattened Linear, softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 6, 3)
        self.linear = nn.Linear(96, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.conv(x).float())
        return torch.softmax(self.linear(out.flatten(1)), dim=-1)


def build_conv_model(level: str, use_promote: bool):
    """build_conv_model(use_amp=True, ...) with _build_optimizer's AdamW, static.amp.decorate."""
    torch.manual_seed(0)
    model = SimpleConvNet()
    x = static.data(name="input", shape=[None, 1, 6, 6], dtype="float32")
    loss = model(x).mean()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=0.01, betas=(0.78, 0.836), eps=1e-4, weight_decay=0.01
    )
    optimizer = static.amp.decorate(
        optimizer, level=level, dtype="bfloat16", use_promote=use_promote
    )
    optimizer.minimize(loss)
    return model, optimizer, x, loss


def forward_low_calls(program: static.Program, feed: np.ndarray) -> dict[str, int]:
    """The low-precision forward calls of each op, replaying the program through the module
    its training step runs."""
    module = program.minimized.step_for(program).model
    with debugging.collect_operator_stats_and_print() as stats:
        module(torch.from_numpy(feed))
    return {op: row["bfloat16"] for op, row in stats.as_dict("forward").items()}


@pytest.mark.parametrize(
    "level, expected",
    [
        # Paddle: conv2d 1, elementwise_add 0, relu 0, matmul_v2 1, softmax 0, reduce_mean 0
        ("O1", {"convolution": 1, "add": 0, "relu": 0, "addmm": 1, "_softmax": 0, "mean": 0}),
        # Paddle: conv2d 1, elementwise_add 2 (1 here: Linear is one op), relu 0, matmul_v2 1,
        # softmax 1, reduce_mean 1
        ("O2", {"convolution": 1, "add": 1, "relu": 0, "addmm": 1, "_softmax": 1, "mean": 1}),
    ],
)
def test_static_amp_promote_stats(level: str, expected: dict[str, int]) -> None:
    """TestStaticAmpPromoteStats.test_static_amp_o1 / test_static_amp_o2 (use_promote=True)."""
    model, optimizer, x, loss = build_conv_model(level, use_promote=True)
    exe = static.Executor(static.CPUPlace())
    exe.run(static.default_startup_program())
    if level == "O2":
        optimizer.amp_init(static.CPUPlace())
    # adamw: Paddle 4 low calls under O2 (its 4 parameters), 0 under O1
    assert [p.dtype for p in model.parameters()] == [LP if level == "O2" else torch.float32] * 4
    x_fp32 = np.random.default_rng(0).random((1, 1, 6, 6), dtype=np.float32)
    got = forward_low_calls(loss.program, x_fp32)
    assert {op: got.get(op, 0) for op in expected} == expected
    for _ in range(2):  # max_iters = 2
        (value,) = exe.run(feed={x.name: x_fp32}, fetch_list=[loss])
        assert np.isfinite(value)


def _conv_program(level: str, use_promote: bool):
    """A program whose loss is a biased Conv2D's one-element output, fp32 parameters."""
    torch.manual_seed(0)
    conv = nn.Conv2d(1, 1, 3)
    x = static.data(name="x", shape=[1, 1, 3, 3], dtype="float32")
    loss = conv(x)
    optimizer = static.amp.decorate(
        torch.optim.SGD(conv.parameters(), lr=0.1),
        level=level,
        dtype="bfloat16",
        use_promote=use_promote,
    )
    optimizer.minimize(loss)
    return conv, optimizer, loss


@pytest.mark.parametrize("key", ["O1", "OD"])
def test_a_conv_with_an_fp32_bias_gives_paddles_output_dtype(key: str) -> None:
    """O1 and OD keep the parameters fp32: the conv runs low, its fp32 bias is added by its own
    add, so the layer's output is fp32 (Paddle 3.3.1's dtypes, test_paddle_promote.PADDLE_331),
    and its value is the low convolution, widened, plus the bias, exactly."""
    conv, optimizer, loss = _conv_program(key, use_promote=True)
    names = [_op_name(op.func) for op in loss.program.ops]
    assert names == ["conv2d", "reshape", "add"]  # the bias stays a parameter of the program
    assert loss.program.params == [conv.weight, conv.bias]
    x = torch.randn(1, 1, 3, 3)
    out = loss.program.minimized.step_for(loss.program).model(x)
    expected = PADDLE_331[key][("conv2d", "float32", "float32", True)]
    assert str(out.dtype).removeprefix("torch.") == expected == "float32"
    with torch.autocast("cpu", dtype=LP):
        low = torch.nn.functional.conv2d(x, conv.weight)
    torch.testing.assert_close(out, low.float() + conv.bias.view(-1, 1, 1), rtol=0, atol=0)


@pytest.mark.parametrize("use_promote", [True, False])
def test_o2_runs_the_bias_add_low_after_amp_init(use_promote: bool) -> None:
    """O2: amp_init casts the bias (only low or promoted ops read it) as Paddle's amp_init, so
    the bias add runs low with or without use_promote (Paddle's elementwise_add: low)."""
    conv, optimizer, loss = _conv_program("O2", use_promote)
    static.Executor(static.CPUPlace()).run(static.default_startup_program())
    optimizer.amp_init(static.CPUPlace())
    assert conv.bias.dtype == conv.weight.dtype == LP
    out = loss.program.minimized.step_for(loss.program).model(torch.randn(1, 1, 3, 3))
    assert out.dtype == LP


def test_static_o1_conv_step_equals_the_eager_auto_cast_step() -> None:
    """The compiled static O1 step over a biased conv computes what the dygraph face's O1 step
    computes (conv low, fp32 bias add, the rest by Paddle's O1 lists): parameters and losses
    equal up to fp32 rounding of the update (FP32_ROUNDING's reason). A fused low conv (the
    bias added in bfloat16) would differ by bfloat16's rounding."""
    torch.manual_seed(0)
    model = SimpleConvNet()
    reference = SimpleConvNet()
    reference.load_state_dict(model.state_dict())
    x = static.data(name="input", shape=[None, 1, 6, 6], dtype="float32")
    loss = model(x).mul(4.0).log().mean()  # not a constant: the softmax's mean is 1/4
    optimizer = static.amp.decorate(
        torch.optim.SGD(model.parameters(), lr=0.5),
        level="O1",
        dtype="bfloat16",
        init_loss_scaling=1.0,
        use_dynamic_loss_scaling=False,
    )
    optimizer.minimize(loss)
    exe = static.Executor(static.CPUPlace())
    exe.run(static.default_startup_program())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    rng = np.random.default_rng(0)
    for _ in range(3):
        feed = rng.random((2, 1, 6, 6), dtype=np.float32)
        (got,) = exe.run(feed={"input": feed}, fetch_list=[loss])
        with amp.auto_cast(level="O1", dtype="bfloat16", device_type="cpu"):
            ref_loss = reference(torch.from_numpy(feed)).mul(4.0).log().mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        np.testing.assert_allclose(float(got), ref_loss.item(), **fp32_rounding())
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, **fp32_rounding())
