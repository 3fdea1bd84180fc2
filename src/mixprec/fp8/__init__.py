"""Float8 linear layers: e4m3 forward, e5m2 backward, per-tensor scaling over torch._scaled_mm,
and finer-grained recipes (Float8Config(recipe=...)).

`convert_to_fp8(model)` swaps eligible `nn.Linear` layers for `Float8Linear` (and Hugging Face's
`Conv1D` for `Float8Conv1D`) in place and returns the model; `fp8_summary(model)` says which
Linear-like layers stayed in high precision and why. Each call casts
input and weight to float8_e4m3fn and the incoming gradient to float8_e5m2 with one fp32 scale
per tensor, then runs the three GEMMs of a linear layer in float8:

    out         = input(e4m3)      @ weight(e4m3)^T
    grad_input  = grad_out(e5m2)   @ weight(e4m3)
    grad_weight = grad_out(e5m2)^T @ input(e4m3)

Scales are "dynamic" (from the amax of the tensor being cast, on every call) or "delayed"
(Transformer Engine's recipe: from the max of the last N amaxes, kept in a buffer). Parameters
keep their dtype (fp32 masters); the layer casts them per call, so the state_dict has exactly
nn.Linear's keys. Where no float8 GEMM kernel exists, `Float8Config(emulate=True)` casts to
float8 and back and runs the GEMM in fp32: the same rounding, no speedup.

The other recipes (rowwise, rowwise_with_gw_hp, blockwise, mxfp8, nvfp4) scale per row or per
block (quantize.py: one quantizer per granularity; recipes.py: each GEMM's operand layout);
rowwise and rowwise_with_gw_hp run torch._scaled_mm with rowwise scales where the device has
it (CUDA sm_89+, bf16 outputs), the others are emulated on every device.
Float8Config.amax_group says which ranks share a tensorwise amax (tensor-parallel shards
always do; data-parallel replicas when it names their group). per_module_recipes chooses a recipe (or high precision) per layer;
Float8Telemetry observes each GEMM operand's quantization error; checkpoint.py reads and writes
DeepSeek-V3's block-fp8 weight layout.
"""

from mixprec.core.policy import register_mode_parser
from mixprec.core.prepare import register_fp8_converter
from mixprec.fp8.casts import (
    amax_to_scale,
    cast_to_fp8,
    delayed_amax,
    fp8_to_tensor,
    tensor_to_amax,
    tensor_to_fp8,
)
from mixprec.fp8.checkpoint import (
    block_fp8_state_dict,
    dequantize_weight_block_fp8,
    load_block_fp8_state_dict,
    quantize_weight_block_fp8,
)
from mixprec.fp8.config import (
    AMAX_EPS,
    AMAX_GROUP_NAMES,
    GEMM_ALIGN,
    LP_FORWARD_DTYPE,
    LP_GRAD_DTYPES,
    MX_SCALE_MODES,
    RECIPE_GRAD_DTYPES,
    RECIPES,
    SCALINGS,
    Float8Config,
    Recipe,
)
from mixprec.fp8.convert import (
    Float8Filter,
    Float8Summary,
    convert_to_fp8,
    default_fp8_filter,
    fp8_summary,
    per_module_recipes,
)
from mixprec.fp8.kernels import (
    ROWWISE_KERNEL_RECIPES,
    cpu_has_rowwise_scaled_mm,
    cpu_has_scaled_mm,
    fp8_kernel_problem,
    lp_gemm,
    resolve_emulate,
    resolve_recipe_kernel,
    rowwise_kernel_problem,
)
from mixprec.fp8.linear import Float8Conv1D, Float8Linear, is_hf_conv1d
from mixprec.fp8.quantize import (
    dequantize_blockwise,
    dequantize_mxfp8,
    dequantize_nvfp4,
    dequantize_scaled,
    quantize_blockwise,
    quantize_mxfp8,
    quantize_nvfp4,
    quantize_rowwise,
    quantize_tensorwise,
)
from mixprec.fp8.recipes import RECIPE_OPERANDS, emulated_gemm, recipe_gemm
from mixprec.fp8.settings import fp8_mode_policy
from mixprec.fp8.telemetry import Float8Telemetry, OperandStats, operand_stats

register_fp8_converter(convert_to_fp8)  # the core's prepare_model calls it for 'fp8'
register_mode_parser("fp8", fp8_mode_policy)  # the 'fp8' mode's keys: Float8Config's fields

__all__ = [
    "AMAX_EPS",
    "AMAX_GROUP_NAMES",
    "GEMM_ALIGN",
    "LP_FORWARD_DTYPE",
    "LP_GRAD_DTYPES",
    "MX_SCALE_MODES",
    "RECIPES",
    "RECIPE_GRAD_DTYPES",
    "RECIPE_OPERANDS",
    "ROWWISE_KERNEL_RECIPES",
    "SCALINGS",
    "Float8Config",
    "Float8Conv1D",
    "Float8Filter",
    "Float8Linear",
    "Float8Summary",
    "Float8Telemetry",
    "OperandStats",
    "Recipe",
    "amax_to_scale",
    "block_fp8_state_dict",
    "cast_to_fp8",
    "convert_to_fp8",
    "cpu_has_rowwise_scaled_mm",
    "cpu_has_scaled_mm",
    "default_fp8_filter",
    "delayed_amax",
    "dequantize_blockwise",
    "dequantize_mxfp8",
    "dequantize_nvfp4",
    "dequantize_scaled",
    "dequantize_weight_block_fp8",
    "emulated_gemm",
    "fp8_kernel_problem",
    "fp8_summary",
    "fp8_to_tensor",
    "is_hf_conv1d",
    "load_block_fp8_state_dict",
    "lp_gemm",
    "operand_stats",
    "per_module_recipes",
    "quantize_blockwise",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "quantize_rowwise",
    "quantize_tensorwise",
    "quantize_weight_block_fp8",
    "recipe_gemm",
    "resolve_emulate",
    "resolve_recipe_kernel",
    "rowwise_kernel_problem",
    "tensor_to_amax",
    "tensor_to_fp8",
]
