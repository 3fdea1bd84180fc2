"""Float8Config and the float8 formats and constants the other modules share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from mixprec.core.policy import did_you_mean

LP_FORWARD_DTYPE = torch.float8_e4m3fn
"""Inputs and weights: 3 mantissa bits, range +-448 (precision matters more than range)."""
LP_GRAD_DTYPES: dict[str, torch.dtype] = {
    "e5m2": torch.float8_e5m2,
    "e4m3": torch.float8_e4m3fn,
}
"""Gradient formats: e5m2 (TE's HYBRID, default) trades a mantissa bit for range +-57344."""
AMAX_EPS = 1e-12
"""Floor on amax: an all-zero tensor gets a finite scale (its fp8 image is zeros anyway)."""
GEMM_ALIGN = 16
"""cuBLASLt's float8 GEMMs need the K and N dims of torch._scaled_mm divisible by 16."""

Scaling = Literal["dynamic", "delayed"]
SCALINGS: tuple[str, ...] = get_args(Scaling)


@dataclass(frozen=True, kw_only=True)
class Float8Config:
    """How Float8Linear scales and where it runs its float8 GEMMs."""

    scaling: Scaling = "dynamic"
    """'dynamic': scale from this call's amax. 'delayed': from the max of the amax history."""
    amax_history_len: int = 16
    """Delayed scaling: how many past amaxes (one per call) the scale is taken over."""
    margin: int = 0
    """Scale down by 2**margin below the fp8 maximum (headroom for growth between calls)."""
    power_of_two_scale: bool = False
    """Round each scale down to a power of two: scaling is then exact, only the cast rounds."""
    grad_dtype: Literal["e5m2", "e4m3"] = "e5m2"
    """float8 format of the incoming gradient in backward."""
    emulate: bool | None = None
    """True: cast to fp8 and back, GEMM in fp32. False: the float8 kernel or an error.
    None: on CUDA the kernel where the device has one, else an error unless allow_emulation;
    on CPU emulation (torch's CPU kernel is a slow reference kernel; same fp8 rounding)."""
    allow_emulation: bool = False
    """With emulate=None, fall back to emulation (logged) where no float8 kernel exists."""
    use_fast_accum_forward: bool = True
    """The forward GEMM on the CUDA kernel accumulates in the tensor cores' faster, less precise
    way (torch._scaled_mm's use_fast_accum; torchao's default for the output GEMM). Emulation
    and the CPU kernel accumulate in fp32 whatever this says: they have no fast mode."""
    use_fast_accum_backward: bool = False
    """The same for the two backward GEMMs (off, as torchao: gradients keep full accumulation)."""
    persist_amax_history: bool = False
    """Save the delayed-scaling history in state_dict (exact resume; keys then differ from
    nn.Linear's, though a plain nn.Linear checkpoint still loads: the history restarts)."""

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(
                f"Float8Config.scaling={self.scaling!r}." + did_you_mean(self.scaling, SCALINGS)
            )
        if self.grad_dtype not in LP_GRAD_DTYPES:
            raise ValueError(
                f"Float8Config.grad_dtype={self.grad_dtype!r}."
                + did_you_mean(self.grad_dtype, tuple(LP_GRAD_DTYPES))
            )
        for name, low in (("amax_history_len", 1), ("margin", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Float8Config.{name} must be an int, got {value!r}.")
            if value < low:
                raise ValueError(f"Float8Config.{name}={value!r} must be >= {low}.")
        for name in (
            "power_of_two_scale",
            "allow_emulation",
            "persist_amax_history",
            "use_fast_accum_forward",
            "use_fast_accum_backward",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Float8Config.{name} must be a bool, got {getattr(self, name)!r}.")
        if self.emulate is not None and not isinstance(self.emulate, bool):
            raise TypeError(
                f"Float8Config.emulate must be True, False or None, got {self.emulate!r}."
            )
        if self.emulate is False and self.allow_emulation:
            raise ValueError(
                "Float8Config(emulate=False, allow_emulation=True) contradicts itself: emulate=False "
                "demands the float8 kernel. Use emulate=None with allow_emulation=True to fall back."
            )

    @property
    def lp_grad_dtype(self) -> torch.dtype:
        return LP_GRAD_DTYPES[self.grad_dtype]
