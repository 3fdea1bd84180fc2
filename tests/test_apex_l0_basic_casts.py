"""Apex's tests/L0/run_amp/test_basic_casts.py, ported to mixprec (the `amp.init` handle API).

Changes from Apex's file, each for a stated reason: `from mixprec.apex import amp` for
`from apex import amp`; tensors on the `device` fixture's device (CPU by default: torch has
fp16 CPU kernels for every op here, so Apex's fp16 runs as written) instead of CUDA; the type
checks compare dtypes (Apex's 'torch.cuda.HalfTensor' strings name the device); unittest
classes become pytest functions over a `handle` fixture (setUp's `amp.init(enabled=True)`,
tearDown's `handle._deactivate()`); `x.cpu()` keeps Apex's check that the result is fp32 (on
CPU it is no transfer, but the op still runs through the fp32 list as in Apex). Shapes, ops
and the expected dtypes are Apex's.
"""

from __future__ import annotations

import functools as ft
import itertools as it

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.apex import amp

pytestmark = pytest.mark.usefixtures("device")

HALF, FLOAT = torch.float16, torch.float32
ALWAYS_HALF = {FLOAT: HALF, HALF: HALF}
ALWAYS_FLOAT = {FLOAT: FLOAT, HALF: FLOAT}
MATCH_INPUT = {FLOAT: FLOAT, HALF: HALF}
B, H, C, K = 16, 64, 16, 3  # Apex's common_init (t, the sequence length, is unused here)


@pytest.fixture
def handle(device):
    handle = amp.init(enabled=True)
    yield handle
    handle._deactivate()


def run_layer_test(fns, expected, input_shape, test_backward=True):
    for fn, typ in it.product(fns, expected.keys()):
        x = torch.randn(input_shape, dtype=typ).requires_grad_()
        y = fn(x)
        assert y.dtype == expected[typ]
        if test_backward:
            y.float().sum().backward()
            assert x.grad.dtype == MATCH_INPUT[typ]


# ----- TestBasicCasts -----
def test_linear_is_half(handle) -> None:
    m = nn.Linear(H, H)
    f = ft.partial(F.linear, weight=m.weight, bias=m.bias)
    run_layer_test([m, f], ALWAYS_HALF, (B, H))


def test_conv2d_is_half(handle) -> None:
    m = nn.Conv2d(C, C, K)
    f = ft.partial(F.conv2d, weight=m.weight, bias=m.bias)
    run_layer_test([m, f], ALWAYS_HALF, (B, C, H, H))


def test_softmax_is_float(handle) -> None:
    m = nn.Softmax(dim=1)
    f = ft.partial(F.softmax, dim=1)
    run_layer_test([m, f], ALWAYS_FLOAT, (B, H))


def test_group_norm_is_float(handle) -> None:
    m = nn.GroupNorm(num_groups=4, num_channels=C)
    run_layer_test([m], ALWAYS_FLOAT, (B, C, H, H))


def test_mse_loss_is_float(handle) -> None:
    shape = (B, H)
    target = torch.randn(shape)
    mod = nn.MSELoss()

    def m(x):
        return mod(x, target)

    f = ft.partial(F.mse_loss, target=target)
    run_layer_test([m, f], ALWAYS_FLOAT, shape)  # Apex built f but ran only m; both run here


def test_relu_is_match(handle) -> None:
    run_layer_test([nn.ReLU(), F.relu], MATCH_INPUT, (B, H))


def test_batch_norm_is_match(handle) -> None:
    m = nn.BatchNorm2d(num_features=C)
    run_layer_test([m], MATCH_INPUT, (B, C, H, H))
    # forward only for BN inference
    m.eval()
    f = ft.partial(
        F.batch_norm,
        running_mean=m.running_mean,
        running_var=m.running_var,
        weight=m.weight,
        bias=m.bias,
        training=False,
    )
    run_layer_test([m, f], MATCH_INPUT, (B, C, H, H), test_backward=False)


# ----- TestBannedMethods -----
def bce_common(assertion):
    shape = (B, H)
    target = torch.rand(shape)
    mod = nn.BCELoss()

    def m(x):
        return mod(x, target)

    f = ft.partial(F.binary_cross_entropy, target=target)
    for fn in [m, f]:
        x = torch.rand(shape, dtype=torch.half)
        assertion(fn, x)


def test_bce_raises_by_default(handle) -> None:
    def assertion(fn, x):
        with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
            fn(x)

    bce_common(assertion)


def test_bce_is_float_with_allow_banned(handle) -> None:
    handle._deactivate()
    handle = amp.init(enabled=True, allow_banned=True)
    try:

        def assertion(fn, x):
            assert fn(x).dtype == FLOAT

        bce_common(assertion)
    finally:
        handle._deactivate()


# ----- TestTensorCasts -----
def test_matmul_method_is_half(handle) -> None:
    other = torch.randn(H, H)
    run_layer_test([lambda x: x.matmul(other), lambda x: other.matmul(x)], ALWAYS_HALF, (H, H))


def test_matmul_op_is_half(handle) -> None:
    other = torch.randn(H, H)
    run_layer_test([lambda x: x @ other, lambda x: other @ x], ALWAYS_HALF, (H, H))


def test_pow_method_is_float(handle) -> None:
    run_layer_test([lambda x: x.pow(2.0)], ALWAYS_FLOAT, (B, H))


def test_pow_op_is_float(handle) -> None:
    run_layer_test([lambda x: x**2.0], ALWAYS_FLOAT, (B, H))


def test_cpu_is_float(handle) -> None:
    def fn(x):
        return x.cpu()

    out_half = fn(torch.randn(B, H, dtype=HALF))
    assert out_half.dtype == FLOAT and out_half.device.type == "cpu"
    run_layer_test([fn], ALWAYS_FLOAT, (B, H))


def test_sum_is_float(handle) -> None:
    run_layer_test([lambda x: x.sum()], ALWAYS_FLOAT, (B, H))


# ----- what the handle's lifetime means (mixprec's additions) -----
def test_deactivate_turns_every_cast_off(handle) -> None:
    m = nn.Linear(H, H)
    assert m(torch.randn(B, H)).dtype == HALF
    handle._deactivate()
    assert not handle.is_active()
    x = torch.randn(B, H)
    assert m(x).dtype == FLOAT and F.softmax(x.half(), dim=1).dtype == HALF
    torch.randn(B, dtype=HALF).exp_()  # the in-place guard is gone too
    handle._deactivate()  # a second call changes nothing


def test_disable_casts_runs_plain_torch_inside(handle) -> None:
    m = nn.Linear(H, H)
    with handle._disable_casts():
        assert m(torch.randn(B, H)).dtype == FLOAT
        assert not handle.is_active()
    assert handle.is_active() and m(torch.randn(B, H)).dtype == HALF


def test_cast_values_equal_a_plain_cast_reference(handle) -> None:
    # the casts are plain .half()/.float(): values equal the hand-cast computation bit for bit
    m = nn.Linear(H, H)
    x = torch.randn(B, H)
    x_half = torch.randn(B, H, dtype=HALF)
    got_linear, got_softmax = m(x), F.softmax(x_half, dim=1)
    handle._deactivate()
    want_linear = F.linear(x.half(), m.weight.half(), m.bias.half())
    torch.testing.assert_close(got_linear, want_linear, rtol=0, atol=0)
    torch.testing.assert_close(got_softmax, F.softmax(x_half.float(), dim=1), rtol=0, atol=0)


def test_a_second_init_while_active_is_refused(handle) -> None:
    with pytest.raises(RuntimeError, match="_deactivate"):
        amp.init(enabled=True)


def test_disabled_init_is_apex_noop_handle() -> None:
    handle = amp.init(enabled=False)
    assert not handle.is_active()
    m = nn.Linear(H, H)
    assert m(torch.randn(B, H)).dtype == FLOAT
    loss = m(torch.randn(B, H)).sum()
    with handle.scale_loss(loss, torch.optim.SGD(m.parameters(), lr=0.1)) as scaled:
        assert scaled is loss
    handle._deactivate()


@pytest.mark.parametrize("bad", [None, "yes", 1])
def test_bad_flag_is_refused_with_its_name(bad) -> None:
    with pytest.raises(TypeError, match="allow_banned"):
        amp.init(enabled=True, allow_banned=bad)


def test_verbose_logs_each_cast(handle, caplog) -> None:
    handle._deactivate()
    handle = amp.init(enabled=True, verbose=True)
    try:
        with caplog.at_level("INFO", logger="mixprec"):
            nn.Linear(H, H)(torch.randn(B, H))
            F.softmax(torch.randn(B, H, dtype=HALF), dim=1)
        assert "Float->Half (linear)" in caplog.text
        assert "Half->Float (softmax)" in caplog.text
    finally:
        handle._deactivate()


def test_registered_function_is_patched_until_deactivate() -> None:
    import mixprec.apex.functions as functions

    class Mod:  # a stand-in module namespace: registering never touches torch itself here
        @staticmethod
        def scale(x):
            return x * 2

    amp.register_float_function(Mod, "scale")
    try:
        handle = amp.init(enabled=True)
        assert Mod.scale(torch.randn(4, dtype=HALF)).dtype == FLOAT
        handle._deactivate()
        assert Mod.scale(torch.randn(4, dtype=HALF)).dtype == HALF
    finally:
        functions._registry.pop((id(Mod), "scale"), None)


def test_decorated_functions_cast_while_the_handle_is_active() -> None:
    @amp.half_function
    def to_half(x):
        return x * 1

    @amp.float_function
    def to_float(x):
        return x * 1

    handle = amp.init(enabled=True)
    try:
        assert to_half(torch.randn(4)).dtype == HALF
        assert to_float(torch.randn(4, dtype=HALF)).dtype == FLOAT
    finally:
        handle._deactivate()
    assert to_half(torch.randn(4)).dtype == FLOAT  # Apex: outside amp they run untouched


@pytest.mark.parametrize("bad", ["fast", 0, -1.0, float("inf")])
def test_bad_loss_scale_is_refused_with_its_value(bad) -> None:
    with pytest.raises(ValueError, match="loss_scale"):
        amp.init(enabled=True, loss_scale=bad)
