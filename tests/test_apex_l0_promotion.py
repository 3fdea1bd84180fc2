"""Apex's tests/L0/run_amp/test_promotion.py, ported to mixprec (the `amp.init` handle API).

Changes from Apex's file, each for a stated reason: `from mixprec.apex import amp` for
`from apex import amp`; tensors on the `device` fixture's device (CPU by default: mul, atan2,
cat, exp and add have fp16 and bf16 CPU kernels, so both of Apex's classes run as written)
instead of CUDA; dtype comparisons for Apex's type strings; the Half and BFloat16 classes
become one parametrized fixture (`amp.init(enabled=True, patch_type=dtype)`, deactivated
after each test). Apex ran atan2 for Half only; it runs for both here. Ops, shapes and the
expected dtypes (widest input out of place, self's dtype in place, in-place exp on a
low-precision tensor refused) are Apex's.
"""

from __future__ import annotations

import itertools as it

import pytest
import torch

from mixprec.apex import amp

pytestmark = pytest.mark.usefixtures("device")
B = 16  # Apex's common_init


@pytest.fixture(params=[torch.float16, torch.bfloat16], ids=["half", "bfloat16"])
def lp_type(request, device):
    handle = amp.init(enabled=True, patch_type=request.param)
    yield request.param
    handle._deactivate()


def run_binary_promote_test(fns, input_shape, lp_type, x_inplace=False):
    dtypes = [lp_type, torch.float32]
    for fn, (xtype, ytype) in it.product(fns, it.product(dtypes, dtypes)):
        x = torch.randn(input_shape, dtype=xtype).requires_grad_()
        x_leaf = x
        if x_inplace:
            x = x.clone()  # in place needs a non-leaf
        y = torch.randn(input_shape, dtype=ytype)
        out = fn(x, y)
        if x_inplace:
            assert out.dtype == x.dtype  # in place: always self's dtype
        elif torch.float32 in (xtype, ytype):
            assert out.dtype == torch.float32  # out of place: the widest
        else:
            assert out.dtype == lp_type
        out.float().sum().backward()
        assert x_leaf.grad.dtype == xtype


def test_atan2_matches_widest(lp_type) -> None:
    fns = [lambda x, y: torch.atan2(x, y), lambda x, y: x.atan2(y)]
    run_binary_promote_test(fns, (B,), lp_type)


def test_mul_matches_widest(lp_type) -> None:
    fns = [lambda x, y: torch.mul(x, y), lambda x, y: x.mul(y)]
    run_binary_promote_test(fns, (B,), lp_type)


def test_cat_matches_widest(lp_type) -> None:
    ys = [torch.randn(B, dtype=lp_type) for _ in range(5)]
    assert torch.cat([*ys, torch.randn(B)]).dtype == torch.float32
    assert torch.cat([*ys, torch.randn(B, dtype=lp_type)]).dtype == lp_type


def test_inplace_exp_is_error_for_lp(lp_type) -> None:
    xs = torch.randn(B)
    xs.exp_()
    assert xs.dtype == torch.float32
    xs = torch.randn(B, dtype=lp_type)
    with pytest.raises(NotImplementedError, match="exp_"):
        xs.exp_()


def test_inplace_add_matches_self(lp_type) -> None:
    run_binary_promote_test([lambda x, y: x.add_(y)], (B,), lp_type, x_inplace=True)


def test_promoted_values_equal_torch_promotion_exactly(lp_type) -> None:
    # mixprec adds: promotion is torch's own (no extra rounding): the fp32 result of a mixed
    # op equals the op on the low-precision input cast up, bit for bit
    x, y = torch.randn(B, dtype=lp_type), torch.randn(B)
    torch.testing.assert_close(torch.mul(x, y), x.float() * y, rtol=0, atol=0)
