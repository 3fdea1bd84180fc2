"""PaddlePaddle's AMP names on mixprec's core: the dynamic graph (`paddle.amp`: auto_cast,
decorate, GradScaler, in mixprec.paddle.dygraph, re-exported here) and the static graph
(`paddle.static` with `paddle.static.amp`, in mixprec.paddle.static, running the compiled step),
and paddle.amp.debugging (mixprec.paddle.debugging).

    import mixprec.paddle as amp                      # paddle.amp
    from mixprec.paddle import static                 # paddle.static
"""

from mixprec.paddle import debugging
from mixprec.paddle.dygraph import (
    COMPUTE_OPS,
    DECORATE_LEVELS,
    DTYPES,
    GEMM_OPS,
    LEVELS,
    NORM_OPS,
    SAVE_DTYPES,
    MasterWeightOptimizer,
    amp_decorate,
    amp_global_state,
    amp_guard,
    auto_cast,
    decorate,
    fp16_guard,
    get_autocast_dtype,
    holds_pure_lp_params,
    is_autocast_enabled,
    level_op_lists,
)
from mixprec.paddle.grad_scaler import GradScaler
from mixprec.paddle.op_names import black_list, white_list

__all__ = [
    "COMPUTE_OPS",
    "DECORATE_LEVELS",
    "DTYPES",
    "GEMM_OPS",
    "LEVELS",
    "NORM_OPS",
    "SAVE_DTYPES",
    "GradScaler",
    "MasterWeightOptimizer",
    "amp_decorate",
    "amp_global_state",
    "amp_guard",
    "auto_cast",
    "black_list",
    "debugging",
    "decorate",
    "fp16_guard",
    "get_autocast_dtype",
    "holds_pure_lp_params",
    "is_autocast_enabled",
    "level_op_lists",
    "white_list",
]
