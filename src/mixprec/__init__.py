"""mixprec: automatic mixed precision (fp16, bf16, fp8) training for PyTorch.

One core (Policy, loss scaling, casting, the master-weight optimizer) and several faces:
Colossal-AI's `convert_to_amp`/`AMP_TYPE`, Apex's `mixprec.apex.amp`, Paddle's names.
"""

from mixprec import fp8  # `import mixprec` gives mixprec.fp8.convert_to_fp8
from mixprec.amp import AMPOptimizer, convert_to_amp
from mixprec.amp_type import AMP_TYPE
from mixprec.booster import Booster
from mixprec.config import Config, gpc, load_config
from mixprec.core.autocast import (
    autocast,
    fp16_guard,
    fp32,
    fp32_region,
    low_precision,
    low_precision_region,
    resolve_ops,
)
from mixprec.core.casting import cast_floating, cast_module
from mixprec.core.checkpoint import load_checkpoint, save_checkpoint
from mixprec.core.commit import StepResult
from mixprec.core.compiled_step import CompiledStep, compile_step
from mixprec.core.grad_scaler import GradScaler
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import MODES, Policy, ScalerConfig, preset, to_policy
from mixprec.core.prepare import FP32Criterion, PrecisionModule, prepare_model, prepare_optimizer
from mixprec.core.scaling import LossScaler
from mixprec.core.skip_monitor import ScaleCollapseError
from mixprec.engine import Engine, initialize
from mixprec.launch import (
    get_default_parser,
    launch,
    launch_from_openmpi,
    launch_from_slurm,
    launch_from_torch,
)
from mixprec.mixed_precision import (
    BF16MixedPrecision,
    BF16SRMixedPrecision,
    FP8MixedPrecision,
    FP16ApexMixedPrecision,
    FP16NaiveMixedPrecision,
    FP16TorchMixedPrecision,
)

__version__ = "0.1.0"

__all__ = [
    "BF16MixedPrecision",
    "BF16SRMixedPrecision",
    "Booster",
    "Engine",
    "FP16ApexMixedPrecision",
    "FP16NaiveMixedPrecision",
    "FP16TorchMixedPrecision",
    "FP8MixedPrecision",
    "initialize",
    "load_checkpoint",
    "save_checkpoint",
    "Config",
    "autocast",
    "fp16_guard",
    "fp32",
    "fp32_region",
    "get_default_parser",
    "gpc",
    "launch",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
    "load_config",
    "low_precision",
    "low_precision_region",
    "resolve_ops",
    "AMP_TYPE",
    "AMPOptimizer",
    "FP32Criterion",
    "GradScaler",
    "LossScaler",
    "MODES",
    "MixedPrecisionOptimizer",
    "Policy",
    "PrecisionModule",
    "ScaleCollapseError",
    "ScalerConfig",
    "StepResult",
    "cast_floating",
    "cast_module",
    "fp8",
    "CompiledStep",
    "compile_step",
    "convert_to_amp",
    "preset",
    "prepare_model",
    "prepare_optimizer",
    "to_policy",
]
