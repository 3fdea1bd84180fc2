"""Colossal-AI's mixed-precision objects for the Booster: one thin class per mode.

Each class holds a `Policy` built by mixprec.core.policy's parsers (the one vocabulary; every
default below is read from there, not retyped) and applies it through the same few hooks:
`convert_module`, `convert_optimizer`, `convert_criterion`. A subclass overrides only what
differs from the base (Lightning Fabric's precision-plugin style); most override nothing but
the policy they build.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from mixprec.amp_type import ScalerKeywords, naive_amp_policy, torch_amp_policy
from mixprec.apex.policy import DEFAULTS as APEX_DEFAULTS
from mixprec.apex.policy import ApexOptions
from mixprec.core.keywords import Default, passed
from mixprec.core.multi_loss import MultiLossOptimizer, prepare_loss_optimizer
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import (
    MODES,
    NAIVE_SCALER,
    TORCH_SCALER,
    Policy,
    did_you_mean,
    to_policy,
)
from mixprec.core.prepare import FP32Criterion, PrecisionModule, prepare_model
from mixprec.core.scaling import ProcessGroup
from mixprec.core.validate import check_max_norm, check_norm_type
from mixprec.parallel.pipeline.optim import PipelineOptimizer, PipelineZeroOptimizer
from mixprec.parallel.zero import ZeroOptimizer


class OptimizerWrapperAPI:
    """Colossal-AI's OptimizerWrapper methods over a mixprec optimizer: a base of every
    optimizer class the Colossal faces build (the classes below, AMPOptimizer,
    LowLevelZeroOptimizer), so each optimizer has them from its construction on.

    Clipping acts on the unscaled gradients (the grads are unscaled and checked first, once a
    step) through the parallelism's own clip: the norm spans every ZeRO shard, pipeline stage
    and DTensor shard. A step whose gradients overflowed is still skipped by step().
    """

    _colossal_grad_norm: torch.Tensor | float | None = None
    _colossal_norm_type: float = 2.0
    _colossal_norm_steps = 0  # the step count when the last norm was taken (or computed)

    @property
    def parameters(self) -> list[torch.Tensor]:
        """The tensors the wrapped optimizer steps (fp32 masters where the model is lp)."""
        return [p for group in self.param_groups for p in group["params"]]  # type: ignore[attr-defined]

    def unwrap(self) -> torch.optim.Optimizer:
        """The torch optimizer inside (its param_groups hold the fp32 masters)."""
        return self.optim  # type: ignore[attr-defined]

    def unscale_grad(self) -> None:
        """Unscale (and check) this step's gradients now; step() then does not again."""
        self.unscale_grads()  # type: ignore[attr-defined]

    def backward_by_grad(
        self,
        tensor: torch.Tensor,
        grad: torch.Tensor,
        inputs: Any = None,
        retain_graph: bool = False,
    ) -> None:
        """Backward from tensor with the upstream gradient grad, which already carries the
        loss scale (a later pipeline stage's input gradient), so it is not scaled again."""
        if isinstance(self, MultiLossOptimizer):
            raise TypeError(
                "backward_by_grad: this optimizer (num_losses > 1) unscales each loss's grads "
                "inside backward(loss, loss_id); call backward(loss, loss_id=i) instead."
            )
        if self.step_flags.found_inf is not None:  # type: ignore[attr-defined]
            raise RuntimeError(
                "backward_by_grad() after the gradients were unscaled (unscale_grad, "
                "clip_grad_by_norm/value) but before step(): the new gradients would stay scaled."
            )
        torch.autograd.backward(tensor, grad, inputs=inputs, retain_graph=retain_graph)
        self.note_scaled_backward()  # type: ignore[attr-defined] # grad carries this scale

    @override
    def clip_grad_norm(
        self,
        model: nn.Module | float,
        max_norm: float | None = None,
        norm_type: float | None = None,
    ) -> torch.Tensor:
        """Colossal's AMP optimizers' clip_grad_norm(model, max_norm), or the core's
        clip_grad_norm(max_norm, norm_type=None); returns the total norm before clipping."""
        if isinstance(model, nn.Module):
            if max_norm is None:
                raise TypeError("clip_grad_norm(model, max_norm): max_norm is missing.")
            return super().clip_grad_norm(max_norm, norm_type)  # type: ignore[misc]
        if max_norm is not None:
            raise TypeError(
                f"clip_grad_norm({model!r}, {max_norm!r}): Colossal's form takes the model "
                "first, clip_grad_norm(model, max_norm); the core's takes max_norm alone, "
                "clip_grad_norm(max_norm, norm_type=...) with norm_type by keyword."
            )
        # max_norm is validated by the core's clip: "1.0" is refused, not float()ed
        return super().clip_grad_norm(model, norm_type)  # type: ignore[misc]

    def clip_grad_by_norm(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Clip the unscaled gradients to max_norm (total norm over all shards / stages);
        returns the total norm before clipping (inf/nan on an overflowed step, which step()
        then skips). error_if_nonfinite: raise instead when that norm is not finite."""
        if args or kwargs:
            raise TypeError(
                f"clip_grad_by_norm: extra arguments {args or ''}{kwargs or ''} are torch's "
                "clip_grad_norm_ options; mixprec's clip takes max_norm, norm_type and "
                "error_if_nonfinite only."
            )
        check_max_norm("max_norm", max_norm)
        norm_type = check_norm_type("norm_type", norm_type)
        # the core's clip (its clip_span's ranks), past this class's two-form clip_grad_norm
        total = super().clip_grad_norm(float(max_norm), norm_type)  # type: ignore[misc]
        if hasattr(total, "full_tensor"):  # FSDP2's norm is a DTensor: the value every rank sees
            total = total.full_tensor()
        # A non-finite norm means non-finite grads: step() skips this step whatever the clip
        # wrote into them, so checking after the clip (one host read) changes no weight.
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {norm_type} of the gradients is non-finite "
                "(error_if_nonfinite=True); step() will skip this step. Pass "
                "error_if_nonfinite=False to let it skip without raising."
            )
        self._colossal_norm_steps = self.steps  # type: ignore[attr-defined] # a host count
        self._colossal_grad_norm = total
        self._colossal_norm_type = norm_type
        return total

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        """Clamp every unscaled gradient element to [-clip_value, clip_value] (elementwise, so
        each rank clamps the shard it holds)."""
        if args or kwargs:
            raise TypeError(
                f"clip_grad_by_value: extra arguments {args or ''}{kwargs or ''} are not "
                "supported (mixprec's clip takes clip_value only)."
            )
        if isinstance(clip_value, bool) or not isinstance(clip_value, int | float):
            raise TypeError(f"clip_grad_by_value(clip_value={clip_value!r}) must be a number.")
        self.unscale_grads()  # type: ignore[attr-defined]
        grads = self._hp_grads()  # type: ignore[attr-defined]
        if grads:
            torch._foreach_clamp_min_(grads, -float(clip_value))
            torch._foreach_clamp_max_(grads, float(clip_value))

    def get_grad_norm(self, norm_type: float = 2.0, **kwargs: Any) -> float | None:
        """The total gradient norm last computed (clip_grad_by_norm, or step() with max_norm);
        None when none was. A host read of the norm."""
        if kwargs:
            raise TypeError(f"get_grad_norm: unexpected arguments {kwargs}.")
        self._take_step_norm()
        if float(norm_type) != self._colossal_norm_type:
            raise ValueError(
                f"get_grad_norm(norm_type={norm_type!r}): the last norm computed was of order "
                f"{self._colossal_norm_type}; mixprec keeps only that one."
            )
        norm = self._colossal_grad_norm
        return None if norm is None else float(norm)

    def _take_step_norm(self) -> None:
        """The last step's norm, if it clipped by max_norm, is the last norm now. Read here, not
        in step(): a sync-free step's result is on the device until asked for."""
        if self.steps == self._colossal_norm_steps:  # type: ignore[attr-defined]
            return  # no step since the last norm taken or computed
        self._colossal_norm_steps = self.steps  # type: ignore[attr-defined]
        result = self.last_result  # type: ignore[attr-defined] # read from the step record
        if result is not None and result.grad_norm is not None:
            self._colossal_grad_norm = result.grad_norm
            self._colossal_norm_type = float(self.norm_type)  # type: ignore[attr-defined]


# Each optimizer class a Colossal face returns, declared here with Colossal's OptimizerWrapper
# methods and built as such by the face (pickle finds them by this module and their names).
class ColossalMixedPrecisionOptimizer(OptimizerWrapperAPI, MixedPrecisionOptimizer):
    """The core optimizer (single process, DDP, FSDP) with Colossal's methods."""


class ColossalMultiLossOptimizer(OptimizerWrapperAPI, MultiLossOptimizer):
    """Apex's per-loss optimizer ('fp16_apex', num_losses) with Colossal's methods."""


class ColossalZeroOptimizer(OptimizerWrapperAPI, ZeroOptimizer):
    """ZeRO (LowLevelZeroPlugin) with Colossal's methods."""


class ColossalPipelineOptimizer(OptimizerWrapperAPI, PipelineOptimizer):
    """A pipeline stage's optimizer (HybridParallelPlugin) with Colossal's methods."""


class ColossalPipelineZeroOptimizer(OptimizerWrapperAPI, PipelineZeroOptimizer):
    """A pipeline stage's ZeRO optimizer (HybridParallelPlugin, zero_stage) with its methods."""


_NAIVE = ScalerKeywords.defaults(NAIVE_SCALER)  # FP16NaiveMixedPrecision's signature defaults


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
        """Wrap optimizer (after convert_module: masters copy the cast params), with
        Colossal's OptimizerWrapper methods."""
        return prepare_loss_optimizer(
            optimizer,
            policy or self.policy,
            max_norm=max_norm,
            process_group=process_group,
            single=ColossalMixedPrecisionOptimizer,
            multi=ColossalMultiLossOptimizer,
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
    """'fp16': fp32 weights, fp16 autocast, dynamic loss scale with torch's GradScaler rules.

    The keywords are torch's GradScaler's; one passed is honoured whatever its value."""

    def __init__(
        self,
        init_scale: float = Default(TORCH_SCALER.init_scale),
        growth_factor: float = Default(TORCH_SCALER.growth_factor),
        backoff_factor: float = Default(TORCH_SCALER.backoff_factor),
        growth_interval: int = Default(TORCH_SCALER.growth_interval),
    ) -> None:
        given = {
            "init_scale": init_scale,
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": growth_interval,
        }
        super().__init__(torch_amp_policy(passed(given)))


class FP16ApexMixedPrecision(MixedPrecision):
    """'fp16_apex': Apex's opt levels O0..O3 and property overrides (see mixprec.apex)."""

    def __init__(
        self,
        opt_level: str = APEX_DEFAULTS["opt_level"],
        cast_model_type: torch.dtype | None = APEX_DEFAULTS["cast_model_type"],
        patch_torch_functions: bool | None = APEX_DEFAULTS["patch_torch_functions"],
        keep_batchnorm_fp32: bool | str | None = APEX_DEFAULTS["keep_batchnorm_fp32"],
        master_weights: bool | None = APEX_DEFAULTS["master_weights"],
        loss_scale: float | str | None = APEX_DEFAULTS["loss_scale"],
        cast_model_outputs: Any = APEX_DEFAULTS["cast_model_outputs"],
        num_losses: int = APEX_DEFAULTS["num_losses"],
        verbosity: int = APEX_DEFAULTS["verbosity"],
        min_loss_scale: float | None = APEX_DEFAULTS["min_loss_scale"],
        max_loss_scale: float = APEX_DEFAULTS["max_loss_scale"],
    ) -> None:
        super().__init__(ApexOptions.of(locals()).policy)


class FP16NaiveMixedPrecision(MixedPrecision):
    """'fp16_naive': fp16 weights and compute, fp32 masters, Megatron's hysteresis scaler.

    Norm layers stay fp32 (their statistics overflow or lose precision in fp16);
    keep_norm_fp32=False casts them too: the seeds' "all operations into fp16".
    """

    def __init__(
        self,
        log_num_zeros_in_grad: bool = False,
        initial_scale: float = _NAIVE.initial_scale,
        growth_factor: float = _NAIVE.growth_factor,
        backoff_factor: float = _NAIVE.backoff_factor,
        hysteresis: int = _NAIVE.hysteresis,
        max_scale: float = _NAIVE.max_scale,
        verbose: bool | None = None,
        min_scale: float = _NAIVE.min_scale,
        keep_norm_fp32: bool = True,
    ) -> None:
        config = {
            "log_num_zeros_in_grad": log_num_zeros_in_grad,
            "verbose": verbose,
            "keep_norm_fp32": keep_norm_fp32,
        }
        # Colossal's scaler keywords (growth_interval is not among this class's): only the
        # ones passed reach the parser, so each is honoured whatever its value
        config |= ScalerKeywords.of(locals()).passed()
        super().__init__(naive_amp_policy(config))


class BF16MixedPrecision(MixedPrecision):
    """'bf16': fp32 weights, bf16 autocast; bf16 has fp32's range, so no loss scaling."""

    def __init__(self) -> None:
        super().__init__(to_policy("bf16"))


class BF16SRMixedPrecision(MixedPrecision):
    """'bf16_sr': bf16 weights without fp32 masters, updates stochastically rounded into them
    (mixprec.core.lean); optimizer_state: 'fp32' (default), 'bf16', 'int8', 'int4', 'fp8', or
    one per moment ('int8/int4': see mixprec.core.policy.state_formats)."""

    def __init__(self, optimizer_state: str = "fp32") -> None:
        super().__init__(to_policy("bf16_sr", {"optimizer_state": optimizer_state}))


class FP8MixedPrecision(MixedPrecision):
    """'fp8': eligible Linear layers become Float8Linear; the rest runs under bf16 autocast.

    module_filter_fn and config are convert_to_fp8's (None: its defaults). recipe (a
    Float8Config recipe name: 'tensorwise', 'rowwise', 'rowwise_with_gw_hp', 'blockwise',
    'mxfp8', 'nvfp4') replaces config's recipe, keeping its other fields.
    """

    def __init__(
        self,
        module_filter_fn: Callable[[nn.Module, str], Any] | None = None,
        config: Any = None,
        *,
        recipe: str | None = None,
    ) -> None:
        keys = {"config": config} if recipe is None else {"config": config, "recipe": recipe}
        super().__init__(to_policy("fp8", keys))  # the policy carries the Float8Config
        self.module_filter_fn = module_filter_fn
        self.config = self.policy.fp8_config

    @override
    def convert_module(self, model: nn.Module, policy: Policy | None = None) -> PrecisionModule:
        return prepare_model(model, policy or self.policy, fp8_filter=self.module_filter_fn)


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
