"""Where float8 GEMMs can run (torch._scaled_mm per device) and the GEMM itself, real or emulated."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from mixprec.fp8.config import GEMM_ALIGN, LP_FORWARD_DTYPE, Float8Config

logger = logging.getLogger(__name__)

_CPU_KERNEL: dict[str, bool] = {}  # filled once by cpu_has_scaled_mm (a probe call)
_FALLBACK_LOGGED: set[str] = set()  # devices whose emulation fallback was already logged


def cpu_has_scaled_mm() -> bool:
    """Whether this torch build has a CPU kernel for torch._scaled_mm (probed once)."""
    if "ok" not in _CPU_KERNEL:
        # device="cpu" explicitly: a surrounding torch.device("meta") would fake a success.
        lp = torch.zeros(GEMM_ALIGN, GEMM_ALIGN, dtype=LP_FORWARD_DTYPE, device="cpu")
        one = torch.ones((), dtype=torch.float32, device="cpu")
        try:
            torch._scaled_mm(lp, lp.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            _CPU_KERNEL["ok"] = True
        except (RuntimeError, NotImplementedError, AttributeError):
            _CPU_KERNEL["ok"] = False
    return _CPU_KERNEL["ok"]


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
        if "cpu" not in _FALLBACK_LOGGED:
            _FALLBACK_LOGGED.add("cpu")
            logger.info(
                "float8 on CPU: emulating (cast to fp8 and back, GEMM in fp32), far faster than "
                "torch's reference CPU kernel; Float8Config(emulate=False) runs that kernel."
            )
        return True
    problem = fp8_kernel_problem(device)
    if problem is None:
        return False
    if config.emulate is None and config.allow_emulation:
        if str(device) not in _FALLBACK_LOGGED:  # once per device, not once per forward
            _FALLBACK_LOGGED.add(str(device))
            logger.warning("%s: emulating float8 (cast to fp8 and back, GEMM in fp32).", problem)
        return True
    raise RuntimeError(
        f"{problem}. Pass Float8Config(emulate=True) to emulate it: cast to float8 and back "
        "with the GEMM in fp32 (the same numerics, no speedup), or "
        "Float8Config(allow_emulation=True) to fall back only where needed."
    )


def note_recipe_emulation(device: torch.device | str, recipe: str) -> None:
    """Log once per device type and recipe that a non-tensorwise recipe is emulated there."""
    key = f"{torch.device(device).type}:{recipe}"
    if key in _FALLBACK_LOGGED:
        return
    _FALLBACK_LOGGED.add(key)
    log = logger.warning if torch.device(device).type == "cuda" else logger.info
    log(
        "float8 recipe %r on %s: emulated (quantize, dequantize to fp32, fp32 GEMM): the same "
        "quantization, no speedup; mixprec runs only tensorwise on torch._scaled_mm.",
        recipe,
        torch.device(device).type,
    )


def _pad_dim(lp: torch.Tensor, dim: int) -> torch.Tensor:
    """Zero-pad one dim of a float8 tensor up to a multiple of GEMM_ALIGN (zeros add nothing)."""
    short = -lp.shape[dim] % GEMM_ALIGN
    if short == 0:
        return lp
    pad = [0, 0, 0, 0]
    pad[1 if dim == 1 else 3] = short
    # F.pad has no float8 kernels; the byte pattern 0x00 is +0 in both float8 formats.
    return F.pad(lp.view(torch.uint8), pad).view(lp.dtype)


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

    emulate=True upcasts to fp32, where products of two float8 values are exact and sums
    accumulate in fp32 as in the kernel: the two differ only by summation order and the
    final rounding to out_dtype. It also takes a or b already upcast to fp32 (exactly, from
    float8), which it uses as they are. use_fast_accum goes to the kernel (see Float8Config).
    """
    if emulate:
        hp_out = (lp_a.to(torch.float32) @ lp_b.to(torch.float32)) * (a_inv_scale * b_inv_scale)
        return hp_out.to(out_dtype)
    n = lp_b.shape[1]
    if lp_a.is_cuda:
        # Pad K and N to 16 (zeros leave the product unchanged); M has no such constraint.
        lp_a, lp_b = _pad_dim(lp_a, 1), _pad_dim(_pad_dim(lp_b, 0), 1)
    # cuBLASLt wants a row-major and b column-major; the CPU kernel takes the same layout.
    lp_a = lp_a.contiguous()
    lp_b = lp_b.t().contiguous().t()
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
    ).to(out_dtype)
    return out[:, :n] if out.shape[1] != n else out
