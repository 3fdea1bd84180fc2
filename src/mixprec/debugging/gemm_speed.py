"""How fast this machine multiplies in bf16 and fp16, measured against fp32, in about a second.

CPU flags do not tell: one cloud CPU reports AVX-512 and runs bf16 GEMMs at 0.32x fp32,
another at 2x. So `mixprec doctor` and `mixprec bench` time the GEMM itself.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

GEMM_SIZE = 512
"""n of the n x n @ n x n product on a CPU: 0.27 GFLOP, milliseconds in fp32 on one core."""
CUDA_GEMM_SIZE = 4096
"""n on a GPU: 137 GFLOP, compute-bound (a 512^3 GEMM finishes in microseconds, so its time
is the kernel launch and the ratio reads ~1x whatever the tensor cores do)."""
CUDA_GEMMS_PER_TIMING = 10
"""GEMMs between two CUDA events: one event pair times them all, the launch gaps amortized."""
LOW_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True)
class GemmSpeed:
    """Median seconds per GEMM by dtype on one device, timed in the same interleaved rounds."""

    device: str
    """Where the GEMMs ran ('cpu', 'cuda:0')."""
    size: int
    """n of the n x n matrices."""
    rounds: int
    """Timed rounds (one GEMM per dtype each), after one untimed warm-up round."""
    seconds: dict[str, float]
    """dtype name ('float32', 'bfloat16', 'float16') -> median seconds per GEMM."""

    def speedup(self, dtype: str) -> float:
        """fp32's time over `dtype`'s: > 1 means `dtype` multiplies faster than fp32."""
        return self.seconds["float32"] / self.seconds[dtype]

    def line(self) -> str:
        """'GEMM speed on cpu (512x512, median of 9): bfloat16 2.31x fp32, float16 0.04x fp32'."""
        ratios = ", ".join(
            f"{d} {self.speedup(d):.2f}x fp32" for d in self.seconds if d != "float32"
        )
        return (
            f"GEMM speed on {self.device} ({self.size}x{self.size} matmul, median of "
            f"{self.rounds}): {ratios} (> 1: faster than fp32)"
        )


def default_gemm_device() -> torch.device:
    """The device training would use: the current CUDA device when there is one, else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _time_cpu(a: torch.Tensor, b: torch.Tensor) -> float:
    t0 = time.perf_counter()
    torch.mm(a, b)
    return time.perf_counter() - t0


def _time_cuda(a: torch.Tensor, b: torch.Tensor) -> float:
    """Seconds per GEMM from CUDA events around CUDA_GEMMS_PER_TIMING back-to-back GEMMs."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CUDA_GEMMS_PER_TIMING):
        torch.mm(a, b)
    end.record()
    end.synchronize()  # a host sync: the events' times exist once the GEMMs ran
    return start.elapsed_time(end) / 1e3 / CUDA_GEMMS_PER_TIMING


def measure_gemm_speed(
    device: torch.device | str = "cpu",
    *,
    size: int | None = None,
    budget_s: float = 1.0,
    min_rounds: int = 3,
) -> GemmSpeed:
    """Time fp32, bf16 and fp16 GEMMs in interleaved rounds until `budget_s` is spent.

    Interleaving keeps the ratios fair on a machine whose load changes during the measurement.
    At least `min_rounds` timed rounds run, so a dtype without fast kernels can exceed the budget.
    size: None is GEMM_SIZE on a CPU, CUDA_GEMM_SIZE on a GPU (timed with CUDA events).
    """
    device = torch.device(device)
    if size is None:
        size = CUDA_GEMM_SIZE if device.type == "cuda" else GEMM_SIZE
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"measure_gemm_speed size={size!r} must be an int >= 1.")
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or budget_s <= 0:
        raise ValueError(f"measure_gemm_speed budget_s={budget_s!r} must be a number > 0.")
    generator = torch.Generator().manual_seed(0)
    hp_a = torch.randn(size, size, generator=generator).to(device)
    hp_b = torch.randn(size, size, generator=generator).to(device)
    operands = {
        str(dtype).removeprefix("torch."): (hp_a.to(dtype), hp_b.to(dtype))
        for dtype in (torch.float32, *LOW_DTYPES)
    }
    time_one = _time_cuda if device.type == "cuda" else _time_cpu
    times: dict[str, list[float]] = {name: [] for name in operands}
    start = time.perf_counter()
    # round 0 is the warm-up (cuBLAS handle and kernel selection, allocator, caches, clocks)
    rounds = -1
    while rounds < min_rounds or time.perf_counter() - start < budget_s:
        for name, (a, b) in operands.items():
            seconds = time_one(a, b)
            if rounds >= 0:
                times[name].append(seconds)
        rounds += 1
    return GemmSpeed(
        device=str(device),
        size=size,
        rounds=rounds,
        seconds={name: statistics.median(ts) for name, ts in times.items()},
    )
