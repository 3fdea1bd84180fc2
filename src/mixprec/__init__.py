"""mixprec: automatic mixed precision (fp16, bf16, fp8) training for PyTorch."""

from mixprec.policy import AMP_TYPE, MODES, Policy, ScalerConfig, preset, to_policy

__version__ = "0.1.0"

__all__ = ["AMP_TYPE", "MODES", "Policy", "ScalerConfig", "preset", "to_policy"]
