"""mixprec: automatic mixed precision (fp16, bf16, fp8) training for PyTorch.

One core (Policy, loss scaling, casting, the master-weight optimizer) and several faces:
Colossal-AI's `convert_to_amp`/`AMP_TYPE`, Apex's `mixprec.apex.amp`, Paddle's names.
"""

import importlib
import importlib.abc
import importlib.util
import sys

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
from mixprec.core.compiled_step import CompiledStep, compile_step
from mixprec.core.grad_scaler import GradScaler
from mixprec.core.optim import MixedPrecisionOptimizer, ScaleCollapseError, StepResult
from mixprec.core.policy import MODES, Policy, ScalerConfig, preset, to_policy
from mixprec.core.prepare import FP32Criterion, PrecisionModule, prepare_model, prepare_optimizer
from mixprec.core.scaling import LossScaler
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


# -- module paths from before the core/ and parallel/ layout --------------------------------
# `from mixprec.policy import Policy` (as the README once showed), `import mixprec.pipeline`, ...
# still import: each old path is the very module object it became (one module, two names).
# mixprec.zero is Colossal's package now (colossalai.zero); it forwards the old module's names.
_MOVED = {
    "policy": "core.policy",
    "validate": "core.validate",
    "scaling": "core.scaling",
    "grad_scaler": "core.grad_scaler",
    "casting": "core.casting",
    "autocast": "core.autocast",
    "module": "core.prepare",
    "optim": "core.optim",
    "optim_state": "core.optim_state",
    "fused_step": "core.fused_step",
    "compiled_step": "core.compiled_step",
    "checkpoint": "core.checkpoint",
    "skip_monitor": "core.skip_monitor",
    "lean": "core.lean",
    "step_math": "core.step_math",
    "data": "parallel.data",
    "pipeline": "parallel.pipeline.schedule",
    "pipeline_optim": "parallel.pipeline.optim",
    "pipeline_split": "parallel.pipeline.split",
    "pipeline_checkpoint": "parallel.pipeline.checkpoint",
    "apex.multi_loss": "core.multi_loss",
    "debugging.hardware": "core.hardware",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `mixprec.<old path>` as the module now at `mixprec.<new path>`."""

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001, ANN201 - importlib's API
        new = (
            _MOVED.get(fullname.removeprefix("mixprec."))
            if fullname.startswith("mixprec.")
            else None
        )
        return None if new is None else importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):  # noqa: ANN001, ANN201
        return importlib.import_module("mixprec." + _MOVED[spec.name.removeprefix("mixprec.")])

    def exec_module(self, module) -> None:  # noqa: ANN001 - already executed under its new name
        pass


sys.meta_path.append(_MovedModuleFinder())

# Names that left a module for a face (the core keeps no face's words): still readable at the
# old module path (`from mixprec.core.policy import AMP_TYPE`, mixprec.policy alike), bound here
# where the faces are already imported, so the core's source never names them.
_MOVED_NAMES = {
    "core.policy": (
        "amp_type",
        (
            "AMP_TYPE",
            "AMP_TYPE_TO_MODE",
            "TORCH_KEYS",
            "NAIVE_KEYS",
            "NAIVE_DYNAMIC_KEYS",
            "torch_amp_policy",
            "naive_amp_policy",
        ),
    ),
}
for _old_module, (_new_module, _names) in _MOVED_NAMES.items():
    _new = importlib.import_module(f"mixprec.{_new_module}")
    _old_mod = importlib.import_module(f"mixprec.{_old_module}")
    for _name in _names:
        setattr(_old_mod, _name, getattr(_new, _name))
# An old path that is also a public name here (mixprec.autocast: the class) is bound now: the
# finder importing it later would set the package's attribute to the module, hiding the class.
for _old in [name for name in _MOVED if name in globals()]:
    sys.modules[f"mixprec.{_old}"] = importlib.import_module(f"mixprec.{_MOVED[_old]}")
