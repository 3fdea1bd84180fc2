"""Colossal-AI's mixed-precision objects for the Booster: one thin class per mode.

Each class holds a `Policy` built by mixprec.policy's parsers (the one vocabulary; every
default below is read from there, not retyped) and applies it through the same few hooks:
`convert_module`, `convert_optimizer`, `convert_criterion`. A subclass overrides only what
differs from the base (Lightning Fabric's precision-plugin style); most override nothing but
the policy they build.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.apex.multi_loss import prepare_loss_optimizer
from mixprec.apex.policy import apex_policy
from mixprec.module import FP32Criterion, PrecisionModule, prepare_model
from mixprec.optim import MixedPrecisionOptimizer
from mixprec.policy import (
    MODES,
    NAIVE_SCALER,
    TORCH_SCALER,
    Policy,
    did_you_mean,
    naive_amp_policy,
    to_policy,
    torch_amp_policy,
)
from mixprec.scaling import ProcessGroup

_APEX_DEFAULTS: dict[str, Any] = {
    name: p.default for name, p in inspect.signature(apex_policy).parameters.items()
}


class MixedPrecision:
    """Base of every mode: a Policy and the hooks that apply it (each hook calls the core)."""

    def __init__(self, policy: Policy) -> None:
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a mixprec Policy, got {policy!r}.")
        self.policy = policy

    def __repr__(self) -> str:
        return f"{type(self).__name__}(policy={self.policy.name!r})"

    def convert_module(self, model: nn.Module, policy: Policy | None = None) -> PrecisionModule:
        """Cast model in place and wrap its forward (policy: an override, e.g. from FSDP)."""
        return prepare_model(model, policy or self.policy)

    def convert_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_norm: float = 0.0,
        process_group: ProcessGroup | None = None,
        policy: Policy | None = None,
    ) -> MixedPrecisionOptimizer:
        """Wrap optimizer (after convert_module: masters copy the cast params)."""
        return prepare_loss_optimizer(
            optimizer, policy or self.policy, max_norm=max_norm, process_group=process_group
        )

    def convert_criterion(self, criterion: Callable[..., torch.Tensor]) -> FP32Criterion:
        return FP32Criterion(criterion)

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., torch.Tensor] | None = None,
        *,
        process_group: ProcessGroup | None = None,
    ) -> tuple[PrecisionModule, MixedPrecisionOptimizer | None, FP32Criterion | None]:
        """Model, optimizer and criterion in this precision (the single-process path)."""
        lp_model = self.convert_module(model)
        mp_optimizer = (
            None
            if optimizer is None
            else self.convert_optimizer(optimizer, process_group=process_group)
        )
        fp32_criterion = None if criterion is None else self.convert_criterion(criterion)
        return lp_model, mp_optimizer, fp32_criterion


class FP32Precision(MixedPrecision):
    """No reduced precision ('fp32', the Booster's default); non-finite steps still skip."""

    def __init__(self) -> None:
        super().__init__(to_policy("fp32"))


class FP16TorchMixedPrecision(MixedPrecision):
    """'fp16': fp32 weights, fp16 autocast, dynamic loss scale with torch's GradScaler rules."""

    def __init__(
        self,
        init_scale: float = TORCH_SCALER.init_scale,
        growth_factor: float = TORCH_SCALER.growth_factor,
        backoff_factor: float = TORCH_SCALER.backoff_factor,
        growth_interval: int = TORCH_SCALER.growth_interval,
    ) -> None:
        super().__init__(
            torch_amp_policy(
                {
                    "init_scale": init_scale,
                    "growth_factor": growth_factor,
                    "backoff_factor": backoff_factor,
                    "growth_interval": growth_interval,
                }
            )
        )


class FP16ApexMixedPrecision(MixedPrecision):
    """'fp16_apex': Apex's opt levels O0..O3 and property overrides (see mixprec.apex)."""

    def __init__(
        self,
        opt_level: str = _APEX_DEFAULTS["opt_level"],
        cast_model_type: torch.dtype | None = _APEX_DEFAULTS["cast_model_type"],
        patch_torch_functions: bool | None = _APEX_DEFAULTS["patch_torch_functions"],
        keep_batchnorm_fp32: bool | str | None = _APEX_DEFAULTS["keep_batchnorm_fp32"],
        master_weights: bool | None = _APEX_DEFAULTS["master_weights"],
        loss_scale: float | str | None = _APEX_DEFAULTS["loss_scale"],
        cast_model_outputs: Any = _APEX_DEFAULTS["cast_model_outputs"],
        num_losses: int = _APEX_DEFAULTS["num_losses"],
        verbosity: int = _APEX_DEFAULTS["verbosity"],
        min_loss_scale: float | None = _APEX_DEFAULTS["min_loss_scale"],
        max_loss_scale: float = _APEX_DEFAULTS["max_loss_scale"],
    ) -> None:
        super().__init__(
            apex_policy(
                opt_level=opt_level,
                cast_model_type=cast_model_type,
                patch_torch_functions=patch_torch_functions,
                keep_batchnorm_fp32=keep_batchnorm_fp32,
                master_weights=master_weights,
                loss_scale=loss_scale,
                cast_model_outputs=cast_model_outputs,
                num_losses=num_losses,
                verbosity=verbosity,
                min_loss_scale=min_loss_scale,
                max_loss_scale=max_loss_scale,
            )
        )


class FP16NaiveMixedPrecision(MixedPrecision):
    """'fp16_naive': fp16 weights and compute, fp32 masters, Megatron's hysteresis scaler.

    Norm layers stay fp32 (their statistics overflow or lose precision in fp16);
    keep_norm_fp32=False casts them too: the seeds' "all operations into fp16".
    """

    def __init__(
        self,
        log_num_zeros_in_grad: bool = False,
        initial_scale: float = NAIVE_SCALER.init_scale,
        growth_factor: float = NAIVE_SCALER.growth_factor,
        backoff_factor: float = NAIVE_SCALER.backoff_factor,
        hysteresis: int = NAIVE_SCALER.hysteresis,
        max_scale: float = NAIVE_SCALER.max_scale,
        verbose: bool | None = None,
        min_scale: float = NAIVE_SCALER.min_scale,
        keep_norm_fp32: bool = True,
    ) -> None:
        super().__init__(
            naive_amp_policy(
                {
                    "log_num_zeros_in_grad": log_num_zeros_in_grad,
                    "initial_scale": initial_scale,
                    "growth_factor": growth_factor,
                    "backoff_factor": backoff_factor,
                    "hysteresis": hysteresis,
                    "max_scale": max_scale,
                    "verbose": verbose,
                    "min_scale": min_scale,
                    "keep_norm_fp32": keep_norm_fp32,
                }
            )
        )


class BF16MixedPrecision(MixedPrecision):
    """'bf16': fp32 weights, bf16 autocast; bf16 has fp32's range, so no loss scaling."""

    def __init__(self) -> None:
        super().__init__(to_policy("bf16"))


class BF16SRMixedPrecision(MixedPrecision):
    """'bf16_sr': bf16 weights without fp32 masters, updates stochastically rounded into them
    (mixprec.lean); optimizer_state: 'fp32' (default), 'bf16', 'int8', 'int4' or 'fp8'."""

    def __init__(self, optimizer_state: str = "fp32") -> None:
        super().__init__(to_policy("bf16_sr", {"optimizer_state": optimizer_state}))


class FP8MixedPrecision(MixedPrecision):
    """'fp8': eligible Linear layers become Float8Linear; the rest runs under bf16 autocast.

    module_filter_fn and config are convert_to_fp8's (None: its defaults).
    """

    def __init__(
        self,
        module_filter_fn: Callable[[nn.Module, str], bool | str] | None = None,
        config: Any = None,
    ) -> None:
        super().__init__(to_policy("fp8"))
        self.module_filter_fn = module_filter_fn
        self.config = config

    def convert_module(self, model: nn.Module, policy: Policy | None = None) -> PrecisionModule:
        return prepare_model(
            model, policy or self.policy, fp8_filter=self.module_filter_fn, fp8_config=self.config
        )


MODE_TO_PRECISION: dict[str, type[MixedPrecision]] = {
    "fp32": FP32Precision,
    "fp16": FP16TorchMixedPrecision,
    "bf16": BF16MixedPrecision,
    "fp16_naive": FP16NaiveMixedPrecision,
    "fp16_apex": FP16ApexMixedPrecision,
    "fp8": FP8MixedPrecision,
    "bf16_sr": BF16SRMixedPrecision,
}
"""Booster's mixed_precision names -> classes; its keys are exactly policy.MODES."""
if set(MODE_TO_PRECISION) != set(MODES):  # one vocabulary: a new mode must get a class here
    raise ImportError(f"MODE_TO_PRECISION {sorted(MODE_TO_PRECISION)} != MODES {sorted(MODES)}.")


def to_mixed_precision(spec: str | MixedPrecision | None) -> MixedPrecision:
    """A Booster's mixed_precision argument (a mode name, an instance or None) -> instance."""
    if spec is None:
        return FP32Precision()
    if isinstance(spec, MixedPrecision):
        return spec
    if isinstance(spec, str):
        if spec not in MODE_TO_PRECISION:
            raise ValueError(f"Unknown mixed_precision {spec!r}." + did_you_mean(spec, MODES))
        return MODE_TO_PRECISION[spec]()
    raise TypeError(
        f"mixed_precision must be None, a mode name ({', '.join(MODES)}) or a MixedPrecision "
        f"instance, got {spec!r}."
    )
