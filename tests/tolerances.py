"""Tolerances the tests share, each with the reason it holds."""

EXACT = {"rtol": 0, "atol": 0}
"""Bit for bit: the same ops in the same order, and every skipped step (nothing may move)."""

FP32_ROUNDING = {"rtol": 1e-6, "atol": 1e-6}
"""A compiled or functional update against torch's eager one: the same math in the same order,
except where eager torch contracts p + alpha * g into one fused multiply-add (foreach SGD / Adam
kernels) and the other does not, or the reverse: ~1 ulp of fp32 (2**-23 relative) per update;
3 steps of |p| < 4 stay within 1e-6."""

FP32_ROUNDING_CUDA = {"rtol": 1e-5, "atol": 1e-5}
"""FP32_ROUNDING on a GPU: the CUDA foreach/fused optimizer kernels and Triton's generated code
each decide their own fused multiply-adds and compute 1/sqrt(v) with the hardware rsqrt (up to 2
ulp), so the same update differs by a few fp32 ulps per step, not one; 3 steps of |p| < 4 stay
within 1e-5. A first estimate from those error bounds: the GPU run checks it."""

_FP32_ROUNDING_BY_DEVICE = {"cpu": FP32_ROUNDING, "cuda": FP32_ROUNDING_CUDA}


def fp32_rounding(device: str | None = None) -> dict[str, float]:
    """FP32_ROUNDING for device (default: torch's default device, which the device fixture sets).

    EXACT has no per-device twin: a skipped step moves nothing bit for bit on every device.
    """
    import torch

    name = device or torch.get_default_device().type
    return _FP32_ROUNDING_BY_DEVICE[name]
