"""Tolerances the tests share, each with the reason it holds."""

EXACT = {"rtol": 0, "atol": 0}
"""Bit for bit: the same ops in the same order, and every skipped step (nothing may move)."""

FP32_ROUNDING = {"rtol": 1e-6, "atol": 1e-6}
"""A compiled or functional update against torch's eager one: the same math in the same order,
except where eager torch contracts p + alpha * g into one fused multiply-add (foreach SGD / Adam
kernels) and the other does not, or the reverse: ~1 ulp of fp32 (2**-23 relative) per update;
3 steps of |p| < 4 stay within 1e-6."""
