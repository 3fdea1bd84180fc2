"""Does this machine run each low-precision dtype fast? Pure checks plus one machine reader.

`cuda_findings` and `cpu_findings` take the capability / CPU flags as arguments (testable
without the hardware); `hardware_report()` reads the real machine and calls them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Level = Literal["ok", "info", "warn"]

CUDA_MIN_CAPABILITY: dict[str, tuple[int, int]] = {
    "float16": (7, 0),  # Volta: first fp16 tensor cores
    "bfloat16": (8, 0),  # Ampere: first bf16 tensor cores (older GPUs emulate it slowly)
    "float8": (8, 9),  # Ada / Hopper: first fp8 tensor cores (torch._scaled_mm needs them)
}
"""Lowest CUDA compute capability with tensor cores for each dtype."""

X86_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""x86 /proc/cpuinfo flags for native bf16 math, fastest first."""
X86_FP16_FLAGS = ("amx_fp16", "avx512_fp16")
"""x86 /proc/cpuinfo flags for native fp16 math, fastest first."""
ARM_BF16_FLAGS = ("bf16",)
"""aarch64 /proc/cpuinfo 'Features' for bf16 dot products."""
ARM_FP16_FLAGS = ("asimdhp", "fphp")
"""aarch64 /proc/cpuinfo 'Features' for fp16 arithmetic."""


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One line of the hardware report."""

    device: str
    """'cuda:0', 'cpu', ..."""
    dtype: str
    """'float16', 'bfloat16', 'float8', or '' for a general note."""
    level: Level
    """'ok': fast path available; 'warn': works slowly or not at all; 'info': a fact."""
    message: str
    """What was found and what it means."""


def cuda_findings(
    name: str, capability: tuple[int, int], *, device: str = "cuda:0"
) -> list[Finding]:
    """What an NVIDIA GPU of this compute capability does for fp16, bf16 and fp8."""
    major, minor = capability
    have = f"current GPU is: {name}, with Compute Capability: {major}.{minor}."
    findings = []
    for dtype, need in CUDA_MIN_CAPABILITY.items():
        if (major, minor) >= need:
            message = (
                f"{dtype} tensor cores available ({name}, Compute Capability {major}.{minor})."
            )
            findings.append(Finding(device=device, dtype=dtype, level="ok", message=message))
            continue
        need_text = f"{need[0]}.{need[1]}"
        if dtype == "float16":  # Paddle's wording, which its users search for
            message = (
                f"AMP only support NVIDIA GPU with Compute Capability {need_text} or higher, {have}"
            )
        else:
            message = (
                f"{dtype} AMP needs an NVIDIA GPU with Compute Capability {need_text} or higher "
                f"for tensor cores, {have}"
            )
        findings.append(Finding(device=device, dtype=dtype, level="warn", message=message))
    return findings


def fp8_finding(device: str, kernel_problem: str | None) -> Finding:
    """What `device` can run for float8 and how mixprec's 'fp8' mode will run it there.

    kernel_problem: mixprec.fp8.fp8_kernel_problem(device), None where torch._scaled_mm runs.
    """
    if device.startswith("cuda"):
        if kernel_problem is None:
            message = (
                "Real float8 GEMMs (torch._scaled_mm; e4m3 forward, e5m2 gradients): "
                "mixprec's 'fp8' mode runs its Linear layers on them."
            )
            return Finding(device=device, dtype="float8", level="ok", message=message)
        message = (
            f"{kernel_problem}: mixprec's 'fp8' mode raises here unless "
            "Float8Config(emulate=True) or allow_emulation=True, which emulate it (cast to "
            "float8 and back, GEMM in fp32: fp8's rounding, no speedup)."
        )
        return Finding(device=device, dtype="float8", level="warn", message=message)
    if kernel_problem is None:
        kernel = (
            "torch has a CPU torch._scaled_mm, a reference kernel (measured 400-2400x slower "
            "than an fp32 GEMM), which Float8Config(emulate=False) runs"
        )
    else:
        kernel = f"{kernel_problem} (no real float8 GEMM)"
    message = (
        f"{kernel}; mixprec's 'fp8' mode emulates on CPU: cast to float8 and back, GEMM in "
        "fp32 (fp8's rounding, no speedup; bf16 autocast around it)."
    )
    return Finding(device=device, dtype="float8", level="warn", message=message)


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The CPU feature flags in /proc/cpuinfo text: x86 'flags' and aarch64 'Features' lines."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return frozenset(flags)


def cpu_findings(
    flags: Iterable[str] | None,
    *,
    cpu_capability: str | None = None,
    mkldnn_bf16: bool | None = None,
) -> list[Finding]:
    """What a CPU with these feature flags does for bf16 and fp16.

    flags: /proc/cpuinfo flags (None: unknown, e.g. not Linux).
    cpu_capability: torch.backends.cpu.get_cpu_capability() ('AVX512', 'AVX2', ...).
    mkldnn_bf16: whether oneDNN reports bf16 kernels for this CPU.
    """
    findings = []
    if cpu_capability is not None:
        message = f"PyTorch CPU kernels dispatch to the {cpu_capability} build."
        findings.append(Finding(device="cpu", dtype="", level="info", message=message))
    if flags is None:
        message = "CPU feature flags unknown (no /proc/cpuinfo); bf16/fp16 speed not checked."
        return [*findings, Finding(device="cpu", dtype="", level="info", message=message)]
    flags = frozenset(flags)
    bf16 = _native_math(
        flags,
        "bfloat16",
        (*X86_BF16_FLAGS, *ARM_BF16_FLAGS),
        fast="Native bf16 math ({}): bf16 autocast is fast on this CPU.",
        slow=f"No native bf16 instructions (none of {', '.join(X86_BF16_FLAGS)}): bf16 is "
        "converted to fp32 per op and is often no faster than fp32.",
    )
    findings.append(bf16)
    if "amx_tile" in flags:
        message = "AMX tile unit present (amx_tile): oneDNN runs bf16/int8 matmuls on it."
        findings.append(Finding(device="cpu", dtype="bfloat16", level="info", message=message))
    if mkldnn_bf16 is not None:
        state = "available" if mkldnn_bf16 else "not available"
        level: Level = "info" if mkldnn_bf16 else "warn"
        message = f"oneDNN (mkldnn) bf16 kernels {state}."
        findings.append(Finding(device="cpu", dtype="bfloat16", level=level, message=message))
    fp16 = _native_math(
        flags,
        "float16",
        (*X86_FP16_FLAGS, *ARM_FP16_FLAGS),
        fast="Native fp16 math ({}): fp16 runs at full speed on this CPU.",
        slow=f"fp16 on this CPU is slow: no fp16 kernels (none of {', '.join(X86_FP16_FLAGS)}), "
        "so fp16 matmuls can be many times slower than fp32. Use bfloat16 on CPU.",
    )
    findings.append(fp16)
    return findings


def _native_math(
    flags: frozenset[str], dtype: str, names: tuple[str, ...], *, fast: str, slow: str
) -> Finding:
    """'ok' with fast (naming the flags found) when flags hold any of names, else 'warn'."""
    found = [f for f in names if f in flags]
    if found:
        return Finding(device="cpu", dtype=dtype, level="ok", message=fast.format(", ".join(found)))
    return Finding(device="cpu", dtype=dtype, level="warn", message=slow)


def read_cpu_flags(path: str | Path = "/proc/cpuinfo") -> frozenset[str] | None:
    """This machine's CPU flags, or None where there is no readable cpuinfo file."""
    try:
        return parse_cpu_flags(Path(path).read_text(errors="replace"))
    except OSError:
        return None
