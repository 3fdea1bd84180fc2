"""Apex's face on mixprec: `from mixprec.apex import amp` (pure PyTorch, no CUDA extension).

`amp.initialize` / `amp.scale_loss` / `amp.master_params` / `amp.state_dict` and the cast
registry (`amp.register_half_function`, `@amp.half_function`, ...) follow Apex's amp;
`FP16_Optimizer` follows apex.fp16_utils; `mixprec.apex.parallel.DistributedDataParallel`
follows apex.parallel. Both run on the core (Policy, LossScaler,
MixedPrecisionOptimizer); see mixprec.apex.amp for the differences from Apex.
"""

from mixprec.apex import amp
from mixprec.apex.fp16_utils import FP16_Optimizer
from mixprec.apex.policy import apex_policy
from mixprec.core.per_loss_optim import PerLossOptimizer

__all__ = ["FP16_Optimizer", "PerLossOptimizer", "amp", "apex_policy"]
