"""Apply a Policy to a model, an optimizer and a criterion: the core every face calls."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from mixprec.core.casting import cast_call_args, cast_floating, cast_module
from mixprec.core.grad_transfer import LOW_DTYPES
from mixprec.core.lean import lean_config
from mixprec.core.logs import log_info_to_stdout
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import Policy, clip_norm_for
from mixprec.core.scaling import ProcessGroup
from mixprec.core.validate import check_callable, check_module_has_parameters

log = logging.getLogger("mixprec")


def device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def param_probe(module: nn.Module) -> tuple[torch.Tensor, ...]:
    """One parameter of module (or none) whose .device says where the module runs.

    Walking module.parameters() every forward cost ~25 us a step in a training loop; the kept
    Parameter follows .to()/.cuda() (they move its data, or swap its contents, in place). Only
    new Parameter objects (load_state_dict(assign=True)) need a new probe. A tuple, so an
    nn.Module holding it does not register it as its own parameter.
    """
    return tuple(itertools.islice(module.parameters(), 1))


def probe_device_type(probe: tuple[torch.Tensor, ...]) -> str:
    return probe[0].device.type if probe else "cpu"


def autocast_context(policy: Policy, device_type: str) -> contextlib.AbstractContextManager:
    """The autocast a policy asks for: torch.autocast, or mixprec's op-list autocast."""
    if policy.compute_dtype in (None, torch.float32):
        return contextlib.nullcontext()
    if policy.custom_white_list or policy.custom_black_list:
        from mixprec.core.autocast import autocast

        return autocast(
            dtype=policy.compute_dtype,
            custom_white_list=policy.custom_white_list,
            custom_black_list=policy.custom_black_list,
            device_type=device_type,
        )
    return torch.autocast(device_type=device_type, dtype=policy.compute_dtype)


class PrecisionModule(nn.Module):
    """Runs the wrapped model's forward in a policy's precision.

    Inputs are cast to the param dtype when params are low precision, the forward runs under
    the policy's autocast, and floating outputs are cast to policy.cast_outputs_to if set.
    """

    def __init__(self, module: nn.Module, policy: Policy) -> None:
        super().__init__()
        self.module = module
        self.policy = policy
        self._probe = param_probe(module)  # the wrapper's _apply and load_state_dict renew it

    @override
    def _apply(self, fn: Any, recurse: bool = True) -> PrecisionModule:
        out = super()._apply(fn, recurse)
        self._probe = param_probe(self.module)
        return out

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        policy = self.policy
        if policy.casts_params and policy.cast_inputs:
            args, kwargs = cast_call_args(args, kwargs, policy.param_dtype)
        with autocast_context(policy, probe_device_type(self._probe)):
            out = self.module(*args, **kwargs)
        if policy.cast_outputs_to is not None:
            out = cast_floating(out, policy.cast_outputs_to)
        return out

    @override
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped model's state, keys unprefixed (as the user's model has them)."""
        return self.module.state_dict(*args, **kwargs)

    @override
    def load_state_dict(
        self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False
    ):
        result = self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        self._probe = param_probe(
            self.module
        )  # assign=True puts new Parameter objects in the model
        return result


class FP32Criterion(nn.Module):
    """Computes a loss in fp32 with autocast off, whatever dtype the model produced."""

    def __init__(self, criterion: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        check_callable("criterion", criterion, what="a loss (an nn.Module or a function)")
        self.criterion = criterion

    @override
    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        args, kwargs = cast_call_args(args, kwargs, torch.float32)
        on = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        if not on:  # the usual call (the forward's autocast has exited): no context to build
            return self.criterion(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for device_type in on:
                stack.enter_context(torch.autocast(device_type, enabled=False))
            return self.criterion(*args, **kwargs)


# mixprec.fp8 builds on the core (its config and validation), so the core does not import it:
# the package registers convert_to_fp8 here when imported (`import mixprec` imports it first).
_FP8_CONVERTER: Callable[..., nn.Module] | None = None


def register_fp8_converter(convert: Callable[..., nn.Module]) -> None:
    """Set what prepare_model calls for an fp8 policy: convert(model, fp8_filter, fp8_config)."""
    global _FP8_CONVERTER
    _FP8_CONVERTER = convert


def prepare_model(
    model: nn.Module,
    policy: Policy,
    *,
    fp8_filter: Callable[[nn.Module, str], bool | str] | None = None,
    fp8_config: Any = None,
) -> PrecisionModule:
    """Cast (and fp8-convert) model in place per policy; return it wrapped for forward.

    fp8_filter / fp8_config go to mixprec.fp8.convert_to_fp8 when policy.fp8 is set;
    fp8_config defaults to policy.fp8_config (the faces' channel), and both set must agree.
    """
    if isinstance(model, PrecisionModule):
        raise TypeError("This model is already prepared by mixprec; prepare the original once.")
    check_module_has_parameters("model", model)
    if not policy.casts_params:
        upcast_lp_params(model, policy)
    if policy.fp8:
        if _FP8_CONVERTER is None:
            raise RuntimeError("An fp8 policy needs mixprec.fp8: import mixprec (or mixprec.fp8).")
        if fp8_config is None:
            fp8_config = policy.fp8_config
        elif policy.fp8_config is not None and policy.fp8_config != fp8_config:
            raise ValueError(
                f"fp8_config={fp8_config!r} and policy {policy.name!r}'s fp8_config="
                f"{policy.fp8_config!r} disagree; set the float8 config in one place."
            )
        model = _FP8_CONVERTER(model, fp8_filter, fp8_config)  # a bare Linear is replaced
    elif fp8_filter is not None or fp8_config is not None:
        raise ValueError(f"fp8_filter/fp8_config given, but mode {policy.name!r} is not fp8.")
    if policy.casts_params:
        cast_module(model, policy.param_dtype, keep_norm_fp32=policy.keep_norm_fp32)
    from mixprec.core.amp_warning import warn_if_amp_cannot_help  # imports the doctor

    warn_if_amp_cannot_help(policy, device_of(model), f"mixed precision {policy.name!r}")
    return PrecisionModule(model, policy)


def upcast_lp_params(model: nn.Module, policy: Policy) -> None:
    """A mode that keeps fp32 weights, given a model already in fp16/bf16: cast it to fp32, and
    say so at WARNING. Stepped as it came, it would train with no fp32 masters (a bf16 weight
    does not move for an update below 2**-8 of its value) or, in fp16, unscaled."""
    low = [(n, p) for n, p in model.named_parameters() if p.dtype in LOW_DTYPES]
    if not low:
        return
    dtypes = sorted({str(p.dtype) for _, p in low})
    cast_module(model, torch.float32, keep_norm_fp32=False)
    total = sum(1 for _ in model.parameters())
    log.warning(
        "mixprec: mode %r trains fp32 weights (low precision only inside the forward), but the "
        "model %s came with %d of its %d parameters in %s (e.g. %r): they were cast to "
        "float32, so the optimizer steps fp32 values (a pure low-precision update loses small "
        "steps: in bf16 an update below about 2**-8 of the weight rounds away). To keep "
        "low-precision weights with fp32 master copies instead, use mode 'fp16_naive' (its "
        "dtype='bfloat16' option keeps bf16 weights) or Apex O2, or pass the model in float32.",
        policy.name,
        type(model).__name__,
        len(low),
        total,
        "/".join(dtypes),
        low[0][0],
    )


def prepare_optimizer(
    optimizer: torch.optim.Optimizer,
    policy: Policy,
    *,
    max_norm: float = 0.0,
    process_group: ProcessGroup | None = None,
    optimizer_cls: type[MixedPrecisionOptimizer] = MixedPrecisionOptimizer,
    **cls_kwargs: Any,
) -> MixedPrecisionOptimizer:
    """Wrap optimizer for policy (call after prepare_model: masters copy the cast params).

    optimizer_cls: a face's or a parallelism's subclass (ZeRO, pipeline, Apex), built with the
    policy's scaler, masters, zero counting and verbosity, plus its own cls_kwargs.
    A policy with num_losses > 1 needs per-loss unscaling: the faces build that optimizer
    (mixprec.core.multi_loss), so here it is refused rather than run with one scaler.
    """
    if policy.num_losses != 1:
        raise ValueError(
            f"num_losses={policy.num_losses} needs one loss scaler per loss, which "
            f"{optimizer_cls.__name__} does not have: the Booster's DDP/no plugin, initialize "
            "without zero/pipeline, and convert_to_amp build one "
            "(mixprec.core.multi_loss.prepare_loss_optimizer)."
        )
    mp_optimizer = optimizer_cls(
        optimizer,
        loss_scale=policy.loss_scale,
        master_weights=policy.master_weights,
        max_norm=clip_norm_for(policy, max_norm),
        process_group=process_group,
        log_num_zeros_in_grad=policy.log_num_zeros_in_grad,
        **({"lean": lean} if (lean := lean_config(policy)) is not None else {}),
        **cls_kwargs,
    )
    set_verbosity(mp_optimizer, policy.verbosity)
    return mp_optimizer


def set_verbosity(optimizer: MixedPrecisionOptimizer, verbosity: int) -> None:
    """Set what the optimizer logs; debug output (2) also makes sure it reaches stdout."""
    optimizer.verbosity = verbosity
    if verbosity >= 2:
        log_info_to_stdout(log)  # the "mixprec" logger then writes INFO to stdout
