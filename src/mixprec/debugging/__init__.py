"""Tools that tell a user why a mixed-precision run misbehaves.

- `collect_operator_stats()`: which aten ops ran in which dtype (forward and backward);
- `NonFiniteLocator` / `find_nonfinite`: the first module, pass and step with an inf/NaN;
- `hardware_report()`: whether this GPU/CPU runs fp16, bf16 and fp8 fast;
- `model_report()`: each layer's dtype under a Policy, and GEMM dims off the tensor-core grid;
- `add_doctor_arguments` / `run_doctor`: the `mixprec doctor` command.
"""

from mixprec.core.hardware import (
    CUDA_MIN_CAPABILITY,
    Finding,
    cpu_findings,
    cuda_findings,
    parse_cpu_flags,
    read_cpu_flags,
)
from mixprec.debugging.doctor import (
    add_doctor_arguments,
    findings_table,
    hardware_report,
    load_factory,
    run_doctor,
)
from mixprec.debugging.model_report import (
    LayerPrecision,
    Misalignment,
    ModelReport,
    misaligned_dims,
    model_report,
)
from mixprec.debugging.nonfinite import (
    NonFiniteError,
    NonFiniteLocator,
    NonFiniteRecord,
    find_nonfinite,
    tensor_to_kind,
)
from mixprec.debugging.op_stats import OperatorStats, collect_operator_stats

__all__ = [
    "CUDA_MIN_CAPABILITY",
    "Finding",
    "LayerPrecision",
    "Misalignment",
    "ModelReport",
    "NonFiniteError",
    "NonFiniteLocator",
    "NonFiniteRecord",
    "OperatorStats",
    "add_doctor_arguments",
    "collect_operator_stats",
    "cpu_findings",
    "cuda_findings",
    "find_nonfinite",
    "findings_table",
    "hardware_report",
    "load_factory",
    "misaligned_dims",
    "model_report",
    "parse_cpu_flags",
    "read_cpu_flags",
    "run_doctor",
    "tensor_to_kind",
]
