"""LowLevelZeroPlugin: Colossal-AI's ZeRO-1/2 plugin over mixprec.parallel.zero, fp16 included.

Colossal-AI refuses fp16 with ZeRO; here every rank keeps the fp16/bf16 model, the fp32 masters
and optimizer state are sharded (mixprec.parallel.zero.ZeroOptimizer), and the loss scale's overflow
flag is agreed over the group, so a step skips on every rank together.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from mixprec.amp_type import LOW_LEVEL_ZERO_SCALER, ScalerKeywords
from mixprec.booster.plugin.plugin_base import (
    Plugin,
    refuse_non_defaults,
    unwrap_model,
)
from mixprec.core.checkpoint import hp_model_state_dict
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import Policy, ScalerConfig, preset
from mixprec.core.prepare import prepare_optimizer
from mixprec.core.scaling import default_group
from mixprec.core.validate import check_max_norm, check_norm_type
from mixprec.fp8.config import Float8Config
from mixprec.fp8.settings import with_fp8
from mixprec.mixed_precision import ColossalZeroOptimizer, FP32Precision, MixedPrecision
from mixprec.parallel.zero import (
    ZeroOptimizer,
    check_communication_dtype,
    check_cpu_offload,
    check_fp8_communication,
)

PRECISIONS = ("fp16", "bf16", "fp32")
_SCALER = ScalerKeywords.defaults(LOW_LEVEL_ZERO_SCALER)  # Colossal's signature defaults


class LowLevelZeroPlugin(Plugin):
    """ZeRO stage 1 or 2 with Colossal-AI's arguments (its signature, keyword for keyword).

    Args:
        stage: 1 shards fp32 masters and optimizer state, all-reducing gradients; 2
            reduce-scatters them (over gloo an all-reduce, which ran faster). Both keep, after
            step(), only the gradients of the params this rank owns.
        precision: 'fp16' (fp16 params, fp32 masters, dynamic loss scale), 'bf16' (bf16 params,
            fp32 masters, no scaling) or 'fp32'.
        initial_scale ... max_scale: the fp16 loss scaler (Megatron's hysteresis rule),
            mixprec.amp_type.ScalerKeywords; passed with 'bf16' / 'fp32' or beside policy=
            they are refused (there is no scaler they could set), whatever their values.
        max_norm, norm_type: clip the gradients by their norm over the whole model (0: off).
        reduce_bucket_size_in_m: at most this many million (2**20) gradient elements per
            collective; a larger model is reduced in several buckets.
        communication_dtype: the dtype gradients are summed in; None: each param's own (over
            gloo fp32, whose sums ran faster than fp16's), or torch.float32/float16/bfloat16.
        overlap_communication: reduce each gradient bucket (async) as soon as its grads are
            ready during backward (hooks on grad accumulation), not all at step(); the results
            are bit-identical. Every rank's backward must give grads to the same params (as
            DDP without find_unused_parameters). Accumulate inside booster.no_sync(model).
            Default False (Colossal: True): see docs/differences.md, Colossal-AI.
        overlap_allgather: must be False (params are gathered at the end of step()).
        cpu_offload: keep masters and optimizer state in CPU memory (on CPU already: no-op).
        master_weights: keep fp32 masters of fp16/bf16 params (False: step them directly).
        update_rounding: how updates are written into params without masters: 'stochastic'
            (bf16 only, mixprec.core.lean) or 'nearest'. None: stochastic for bf16 without masters
            (round-to-nearest drops updates below ~2**-8 of a weight), else nearest.
        optimizer_state: 'fp32', 'bf16', 'int8', 'int4' or 'fp8' moments, or one per moment
            ('int8/int4') (sharded like fp32 state: each owner quantizes its own); None: the optimizer's own, except fp32
            under stochastic rounding.
        verbose: also log every loss-scale change and why (verbosity 2; skipped steps are
            always logged).
        cast_inputs: cast floating forward inputs to the params' dtype (False: as given).
        fp8_communication: gradients travel in fp8 with a per-bucket power-of-two scale
            (True or 'e5m2'; 'e4m3' as a mixprec extension) and are summed in fp32 by their
            owner (mixprec.parallel.comm); communication_dtype must then stay None.
        use_fp8: eligible Linear layers compute in float8 (mixprec.fp8) under this precision:
            True (Colossal's: Float8Config(), recipe 'tensorwise'), or as mixprec's extension a
            recipe name ('rowwise', 'blockwise', 'mxfp8', ...), a Float8Config or a dict of its
            fields (mixprec.fp8.settings.to_float8_config).
        extra_dp_size: must be 1 (one flat data-parallel group).
        policy: (mixprec) a Policy parsed elsewhere (the config Engine's, any mode: see
            from_policy) instead of the precision keywords; it sets the precision, scaler and
            clip, so precision, the scaler keywords, max_norm, master_weights, update_rounding,
            optimizer_state, verbose, cast_inputs and use_fp8 must then stay at their defaults.
    """

    def __init__(
        self,
        stage: int = 1,
        precision: str = "fp16",
        initial_scale: float = _SCALER.initial_scale,
        min_scale: float = _SCALER.min_scale,
        growth_factor: float = _SCALER.growth_factor,
        backoff_factor: float = _SCALER.backoff_factor,
        growth_interval: int = _SCALER.growth_interval,
        hysteresis: int = _SCALER.hysteresis,
        max_scale: float = _SCALER.max_scale,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        reduce_bucket_size_in_m: int = 12,
        communication_dtype: torch.dtype | None = None,
        overlap_communication: bool = False,
        overlap_allgather: bool = False,
        cpu_offload: bool = False,
        master_weights: bool = True,
        update_rounding: str | None = None,
        optimizer_state: str | None = None,
        verbose: bool = False,
        cast_inputs: bool = True,
        fp8_communication: bool = False,
        use_fp8: bool | str | Float8Config = False,
        extra_dp_size: int = 1,
        *,
        policy: Policy | None = None,
    ) -> None:
        refuse_non_defaults(
            "LowLevelZeroPlugin",
            locals(),
            {
                "overlap_allgather": (
                    False,
                    "the updated params are gathered at the end of step(), not overlapped with "
                    "the next forward",
                ),
                "extra_dp_size": (1, "the data-parallel group is the whole world, one level"),
            },
        )
        if isinstance(stage, bool) or stage not in (1, 2):
            raise ValueError(
                f"LowLevelZeroPlugin(stage={stage!r}); valid: 1, 2. Stage 3 (sharded params) "
                "is TorchFSDPPlugin (FSDP2)."
            )
        if precision not in PRECISIONS:
            raise ValueError(f"LowLevelZeroPlugin(precision={precision!r}); valid: {PRECISIONS}.")
        for name, value in (
            ("cpu_offload", cpu_offload),
            ("master_weights", master_weights),
            ("verbose", verbose),
            ("cast_inputs", cast_inputs),
            ("overlap_communication", overlap_communication),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"LowLevelZeroPlugin({name}={value!r}) must be a bool.")
        check_max_norm("max_norm", max_norm)
        norm_type = check_norm_type("norm_type", norm_type)
        if (
            isinstance(reduce_bucket_size_in_m, bool)
            or not isinstance(reduce_bucket_size_in_m, int | float)
            or reduce_bucket_size_in_m <= 0
        ):
            raise ValueError(
                f"LowLevelZeroPlugin(reduce_bucket_size_in_m={reduce_bucket_size_in_m!r}) must "
                "be a positive number (million gradient elements per collective)."
            )
        keywords = ScalerKeywords.of(locals())  # validated: a bad value fails here
        self.stage = stage
        if policy is not None:
            _check_policy_alone(policy, locals())
            self.precision = policy.name
            self.policy = policy
            max_norm = policy.max_norm
        else:
            if precision == "fp16":
                scaler = keywords.scaler(LOW_LEVEL_ZERO_SCALER)
            else:
                keywords.refuse("LowLevelZeroPlugin", f"precision={precision!r} scales no loss")
                scaler = LOW_LEVEL_ZERO_SCALER
            self.precision = precision
            self.policy = colossal_zero_policy(
                precision, scaler, master_weights, update_rounding, optimizer_state
            )
            self.policy = replace(
                self.policy, verbosity=2 if verbose else 1, cast_inputs=cast_inputs
            )
            self.policy = with_fp8(self.policy, use_fp8, "LowLevelZeroPlugin(use_fp8)")
        self.max_norm = float(max_norm)
        self.norm_type = norm_type
        self.cpu_offload = cpu_offload
        self.reduce_bucket_numel = max(1, int(reduce_bucket_size_in_m * 2**20))
        check_communication_dtype(communication_dtype, "LowLevelZeroPlugin")
        self.communication_dtype = communication_dtype
        self.overlap_communication = overlap_communication
        check_fp8_communication(fp8_communication, communication_dtype, "LowLevelZeroPlugin")
        self.fp8_communication = fp8_communication
        self._zero_of_model: weakref.WeakKeyDictionary[nn.Module, ZeroOptimizer] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def from_policy(
        cls, policy: Policy, *, stage: int, cpu_offload: bool = False
    ) -> LowLevelZeroPlugin:
        """The plugin over a Policy parsed elsewhere (the config Engine's fp16 section, any
        mode): stage and offload as given, precision, scaler and clip (policy.max_norm) from
        the policy, where Colossal's keywords can name only fp16 / bf16 / fp32 ZeRO."""
        return cls(stage=stage, cpu_offload=cpu_offload, policy=policy)

    @property
    @override
    def process_group(self):  # noqa: ANN201 - a torch ProcessGroup or None
        return default_group()

    @override
    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        mixed_precision: MixedPrecision,
        device: torch.device,
    ) -> tuple[nn.Module, ZeroOptimizer | None]:
        if not isinstance(mixed_precision, FP32Precision):
            raise ValueError(
                f"Booster(mixed_precision={mixed_precision!r}) with LowLevelZeroPlugin: the "
                f"plugin sets the precision (precision={self.precision!r}); leave the "
                "Booster's mixed_precision unset."
            )
        check_cpu_offload(self.cpu_offload, device)
        boosted = mixed_precision.convert_module(model.to(device), self.policy)
        if optimizer is None:
            return boosted, None
        # ZeroOptimizer with Colossal's OptimizerWrapper methods, built by the core's one
        # mapping of a Policy onto an optimizer's constructor
        zero = prepare_optimizer(
            optimizer,
            self.policy,
            optimizer_cls=ColossalZeroOptimizer,
            stage=self.stage,
            max_norm=self.max_norm,
            norm_type=self.norm_type,
            process_group=self.process_group,
            communication_dtype=self.communication_dtype,
            reduce_bucket_numel=self.reduce_bucket_numel,
            overlap_communication=self.overlap_communication,
            fp8_communication=self.fp8_communication,
        )
        self._zero_of_model[boosted] = zero
        return boosted, zero

    @override
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Backward passes inside reduce no bucket. Without overlap_communication gradients are
        reduced at step() anyway, so this changes nothing; with it, the buckets are reduced by
        the first backward after it, on the accumulated sums (not once per backward)."""
        zero = self._zero_of_model.get(model)
        if zero is None:
            return contextlib.nullcontext()
        return zero.no_sync()

    # ----- checkpoints -----
    @override
    def model_state(self, model: nn.Module, optimizer: MixedPrecisionOptimizer | None) -> Any:
        """fp32 weights; each master comes from the rank that owns it."""
        user_model = unwrap_model(model)
        state = hp_model_state_dict(user_model)
        if isinstance(optimizer, ZeroOptimizer):
            names = {id(p): name for name, p in user_model.named_parameters()}
            for p, hp in zip(optimizer.all_params, optimizer.hp_params(), strict=True):
                if id(p) in names:
                    state[names[id(p)]] = hp.cpu()
        return state

    @override
    def optimizer_state(self, optimizer: MixedPrecisionOptimizer, model: nn.Module | None) -> Any:
        """Gathered on rank 0: an unsharded optimizer checkpoint (any world loads it)."""
        return _zero(optimizer).gathered_state_dict()

    @override
    def load_optimizer_state(
        self, optimizer: MixedPrecisionOptimizer, state: dict[str, Any], model: nn.Module | None
    ) -> None:
        """Every rank reads the whole state and keeps its shard (a plain mixprec one loads too)."""
        _zero(optimizer).load_gathered_state_dict(state)


def _zero(optimizer: MixedPrecisionOptimizer) -> ZeroOptimizer:
    if not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(
            f"LowLevelZeroPlugin checkpoints the ZeroOptimizer boost() returned, got "
            f"{type(optimizer).__name__}."
        )
    return optimizer


POLICY_KEYWORDS = (
    "precision",
    *ScalerKeywords.NAMES,
    "max_norm",
    "master_weights",
    "update_rounding",
    "optimizer_state",
    "verbose",
    "cast_inputs",
    "use_fp8",
)
"""LowLevelZeroPlugin's keywords a `policy=` sets instead."""


def _check_policy_alone(policy: Policy, given: dict[str, Any]) -> None:
    """policy= replaces the precision keywords: one of them set beside it would be ignored."""
    if not isinstance(policy, Policy):
        raise TypeError(f"LowLevelZeroPlugin(policy={policy!r}) must be a mixprec Policy.")
    defaults = inspect.signature(LowLevelZeroPlugin.__init__).parameters
    for name in POLICY_KEYWORDS:
        default = defaults[name].default
        if given[name] is not default and given[name] != default:
            raise ValueError(
                f"LowLevelZeroPlugin({name}={given[name]!r}, policy={policy.name!r}): the policy "
                f"sets {name}; leave {name} at its default ({default!r}), or set it in the policy."
            )


def colossal_zero_policy(
    precision: str,
    scaler: ScalerConfig,
    master_weights: bool,
    update_rounding: str | None,
    optimizer_state: str | None,
) -> Policy:
    """The Policy Colossal's precision keywords mean, lean update settings included."""
    policy = zero_policy(precision, scaler, master_weights)
    if update_rounding is None and precision == "bf16" and not master_weights:
        update_rounding = "stochastic"
    if update_rounding is None and optimizer_state is None:
        return policy
    return replace(
        policy,
        update_rounding=update_rounding or "nearest",
        optimizer_state=optimizer_state or ("fp32" if update_rounding == "stochastic" else None),
    )  # Policy validates both, naming the value and the valid ones


def zero_policy(precision: str, scaler: ScalerConfig, master_weights: bool) -> Policy:
    """Colossal's LowLevelZero precisions as mixprec Policies (fp16/bf16 params + masters)."""
    if precision == "fp32":
        return preset("fp32")
    policy = preset("fp16_naive", dtype="float16" if precision == "fp16" else "bfloat16")
    if precision == "fp16":
        policy = replace(policy, loss_scale=scaler)
    return replace(policy, name=f"zero_{precision}", master_weights=master_weights)
