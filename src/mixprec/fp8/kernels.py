"""Where float8 GEMMs can run (torch._scaled_mm per device) and the GEMM itself, real or emulated."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from mixprec.fp8.config import GEMM_ALIGN, LP_FORWARD_DTYPE, Float8Config

logger = logging.getLogger(__name__)

_CPU_KERNEL: dict[str, bool] = {}  # filled once by cpu_has_scaled_mm (a probe call)
_FALLBACK_LOGGED: set[str] = set()  # the emulation fallbacks already logged (_log_once's keys)


def cpu_has_scaled_mm() -> bool:
    """Whether this torch build has a CPU kernel for torch._scaled_mm (probed once)."""
    if "ok" not in _CPU_KERNEL:
        _CPU_KERNEL["ok"] = _cpu_probe(scale_a_shape=(), scale_b_shape=())
    return _CPU_KERNEL["ok"]


def cpu_has_rowwise_scaled_mm() -> bool:
    """Whether this torch build's CPU torch._scaled_mm takes rowwise scales (probed once)."""
    if "rowwise" not in _CPU_KERNEL:
        rows = (GEMM_ALIGN, 1)
        _CPU_KERNEL["rowwise"] = _cpu_probe(scale_a_shape=rows, scale_b_shape=rows[::-1])
    return _CPU_KERNEL["rowwise"]


def _cpu_probe(*, scale_a_shape: tuple[int, ...], scale_b_shape: tuple[int, ...]) -> bool:
    # device="cpu" explicitly: a surrounding torch.device("meta") would fake a success.
    lp = torch.zeros(GEMM_ALIGN, GEMM_ALIGN, dtype=LP_FORWARD_DTYPE, device="cpu")
    scale_a = torch.ones(scale_a_shape, dtype=torch.float32, device="cpu")
    scale_b = torch.ones(scale_b_shape, dtype=torch.float32, device="cpu")
    try:
        torch._scaled_mm(lp, lp.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, AttributeError, ValueError):
        return False
    return True


def fp8_kernel_problem(device: torch.device | str) -> str | None:
    """None if torch._scaled_mm runs on this device, else why not (for error messages)."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(device)
            return (
                f"float8 GEMMs (torch._scaled_mm) need CUDA compute capability 8.9+ "
                f"(Ada, Hopper or newer); {name!r} is sm_{major}{minor}"
            )
        return None
    if device.type == "cpu":
        if cpu_has_scaled_mm():
            return None
        return f"this torch {torch.__version__} has no CPU kernel for torch._scaled_mm"
    return f"no float8 GEMM kernel is known for device type {device.type!r}"


def resolve_emulate(device: torch.device | str, config: Float8Config) -> bool:
    """Whether a Float8Linear on `device` emulates (True) or calls torch._scaled_mm (False)."""
    if config.emulate:
        return True
    if config.emulate is None and torch.device(device).type == "cpu":
        # torch's CPU _scaled_mm is a reference kernel: measured 400-2400x slower than an fp32
        # GEMM of the same shape (64x64x128 to 512^3, 2-core Xeon with AMX). Emulation rounds
        # to fp8 identically and sums in fp32 too: only the summation order differs.
        _log_once(
            "cpu",
            False,
            "float8 on CPU: emulating (cast to fp8 and back, GEMM in fp32), far faster than "
            "torch's reference CPU kernel; Float8Config(emulate=False) runs that kernel.",
        )
        return True
    problem = fp8_kernel_problem(device)
    if problem is None:
        return False
    if config.emulate is None and config.allow_emulation:
        # once per device, not once per forward
        _log_once(
            str(device), True, f"{problem}: emulating float8 (cast to fp8 and back, GEMM in fp32)."
        )
        return True
    raise RuntimeError(
        f"{problem}. Pass Float8Config(emulate=True) to emulate it: cast to float8 and back "
        "with the GEMM in fp32 (the same numerics, no speedup), or "
        "Float8Config(allow_emulation=True) to fall back only where needed."
    )


def note_recipe_emulation(device: torch.device | str, recipe: str) -> None:
    """Log once per device type and recipe that a recipe without a scaled-GEMM path here
    (blockwise, mxfp8, nvfp4) is emulated."""
    _log_once(
        f"{torch.device(device).type}:{recipe}",
        torch.device(device).type == "cuda",
        f"float8 recipe {recipe!r} on {torch.device(device).type}: emulated (quantize, "
        "dequantize to fp32, fp32 GEMM): the same quantization, no speedup; mixprec runs "
        "tensorwise and rowwise GEMMs on torch._scaled_mm, the other recipes emulated.",
    )


ROWWISE_KERNEL_RECIPES = ("rowwise", "rowwise_with_gw_hp")
"""The recipes whose float8 GEMMs torch._scaled_mm runs with rowwise scales (a tensorwise
operand, rowwise_with_gw_hp's weight in grad_input, goes in as its scale repeated per column)."""


def rowwise_kernel_problem(device: torch.device | str, out_dtype: torch.dtype) -> str | None:
    """None if torch._scaled_mm runs rowwise scales ((M, 1) and (1, N)) on this device with
    this output dtype, else why not."""
    device = torch.device(device)
    if device.type == "cuda":
        problem = fp8_kernel_problem(device)  # rowwise kernels: sm_89, sm_90 and sm_100 too
        if problem is not None:
            return problem
        if out_dtype != torch.bfloat16:
            # torch's rowwise CUDA kernel (CUTLASS f8f8bf16_rowwise) writes bf16 only.
            return f"torch._scaled_mm's rowwise CUDA kernel writes bfloat16, not {out_dtype}"
        return None
    if device.type == "cpu":
        if cpu_has_rowwise_scaled_mm():
            return None
        return f"this torch {torch.__version__} has no rowwise CPU kernel for torch._scaled_mm"
    return f"no float8 GEMM kernel is known for device type {device.type!r}"


def resolve_recipe_kernel(
    device: torch.device | str, config: Float8Config, out_dtype: torch.dtype
) -> bool:
    """Whether one GEMM of a non-tensorwise recipe, written in out_dtype on `device`, runs
    torch._scaled_mm (True) or is emulated (False).

    Only rowwise and rowwise_with_gw_hp have a kernel path. emulate=True emulates;
    emulate=None emulates on CPU (torch's CPU kernel is a slow reference kernel: the same
    bits, see tests/test_fp8_scaled_mm.py) and elsewhere where the kernel is missing (logged
    once per device, recipe and output dtype); emulate=False raises there instead.
    """
    if config.recipe not in ROWWISE_KERNEL_RECIPES:
        note_recipe_emulation(device, config.recipe)
        return False
    if config.emulate:
        return False
    device_type = torch.device(device).type
    if config.emulate is None and device_type == "cpu":
        _log_once(
            f"cpu:{config.recipe}",
            False,
            f"float8 recipe {config.recipe!r} on CPU: emulating (quantize, dequantize to fp32, "
            "fp32 GEMM), far faster than torch's reference CPU kernel and the same bits; "
            "Float8Config(emulate=False) runs that kernel.",
        )
        return False
    problem = rowwise_kernel_problem(device, out_dtype)
    if problem is None:
        return True
    if config.emulate is False:
        raise RuntimeError(
            f"{problem}. Float8Config(recipe={config.recipe!r}, emulate=False) demands the "
            "kernel; emulate=None falls back to emulation where it is missing."
        )
    _log_once(
        f"{device}:{config.recipe}:{out_dtype}",
        True,
        f"{problem}: float8 recipe {config.recipe!r} emulates these GEMMs (quantize, "
        "dequantize to fp32, fp32 GEMM).",
    )
    return False


def _log_once(key: str, warn: bool, message: str) -> None:
    if key in _FALLBACK_LOGGED:
        return
    _FALLBACK_LOGGED.add(key)
    (logger.warning if warn else logger.info)("%s", message)


def _pad_dim(lp: torch.Tensor, dim: int) -> torch.Tensor:
    """Zero-pad one dim of a float8 tensor up to a multiple of GEMM_ALIGN (zeros add nothing)."""
    short = -lp.shape[dim] % GEMM_ALIGN
    if short == 0:
        return lp
    pad = [0, 0, 0, 0]
    pad[1 if dim == 1 else 3] = short
    # F.pad has no float8 kernels; the byte pattern 0x00 is +0 in both float8 formats.
    return F.pad(lp.view(torch.uint8), pad).view(lp.dtype)


def gemm_result(out: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """A GEMM's result in out_dtype, never as a `.to` that returns `out` itself.

    A float8 GEMM's result is the output of mixprec's autograd Functions; under torch.compile
    torch 2.11's dynamo gives the Function's inputs all-zero gradients when its forward returns
    a tensor through an op that returns its own input (a `.to`, `.float()` or `.contiguous()`
    that changes nothing), measured with any backend, eager included. torch 2.13 does not.
    """
    return out if out.dtype == out_dtype else out.to(out_dtype)


def lp_gemm(
    lp_a: torch.Tensor,
    lp_b: torch.Tensor,
    a_inv_scale: torch.Tensor,
    b_inv_scale: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    emulate: bool,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """(a @ b) * a_inv_scale * b_inv_scale in out_dtype, from float8 a (M, K) and b (K, N).

    The inverse scales are 0-dim (tensorwise) or, for rowwise scaling, (M, 1) and (1, N) fp32.

    emulate=True upcasts to fp32, where products of two float8 values are exact and sums
    accumulate in fp32 as in the kernel: the two differ only by summation order and the
    final rounding to out_dtype. It also takes a or b already upcast to fp32 (exactly, from
    float8), which it uses as they are. use_fast_accum goes to the kernel (see Float8Config).
    """
    if emulate:
        hp_out = (lp_a.to(torch.float32) @ lp_b.to(torch.float32)) * (a_inv_scale * b_inv_scale)
        return gemm_result(hp_out, out_dtype)
    n = lp_b.shape[1]
    if lp_a.is_cuda:
        # Pad K and N to 16 (zeros leave the product unchanged); M has no such constraint.
        lp_a, lp_b = _pad_dim(lp_a, 1), _pad_dim(_pad_dim(lp_b, 0), 1)
        if b_inv_scale.dim() == 2 and b_inv_scale.shape[1] != lp_b.shape[1]:
            # A rowwise (1, N) scale covers the padded columns too (ones: they are cropped).
            pad = lp_b.shape[1] - b_inv_scale.shape[1]
            b_inv_scale = F.pad(b_inv_scale, (0, pad), value=1.0)
    # cuBLASLt wants a row-major and b column-major; the CPU kernel takes the same layout.
    lp_a = lp_a.contiguous()
    lp_b = lp_b.t().contiguous().t()
    a_inv_scale, b_inv_scale = a_inv_scale.contiguous(), b_inv_scale.contiguous()
    # The oneDNN CPU kernel (Intel) has no float64 output: a float64 model gets the fp32 result,
    # exact to the kernel's own fp32 accumulation, widened.
    kernel_dtype = torch.float32 if out_dtype == torch.float64 else out_dtype
    out = torch._scaled_mm(
        lp_a,
        lp_b,
        scale_a=a_inv_scale,
        scale_b=b_inv_scale,
        out_dtype=kernel_dtype,
        use_fast_accum=use_fast_accum,
    )
    out = gemm_result(out, out_dtype)
    return out[:, :n] if out.shape[1] != n else out
