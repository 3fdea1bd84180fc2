"""Apex's `apex.amp.frontend`: initialize, scale_loss, state_dict / load_state_dict, and the
optimizer behind the older handle API's `wrap_optimizer` (see mixprec.apex.amp for how to use
them and the differences from Apex).

`mixprec.apex.amp` re-exports every public name here, so scripts that reach amp's state through
Apex's module path (`from apex.amp.frontend import _amp_state`) find the same objects. The
handle API (mixprec.apex.handle) builds on this module, and mixprec.apex.amp on both.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from mixprec.apex import functions
from mixprec.apex._optimizer_like import REQUIRED, OptimizerLike, missing_members
from mixprec.apex.amp._amp_state import _amp_state
from mixprec.apex.amp_state import AmpHandle, Properties
from mixprec.apex.policy import DEFAULTS, ApexOptions, apex_policy
from mixprec.core.amp_warning import warn_if_amp_cannot_help
from mixprec.core.autocast import fp32_region
from mixprec.core.casting import cast_call_args, cast_floating, cast_module
from mixprec.core.per_loss_optim import (
    PerLossOptimizer,
    UnscaleEvent,
    is_rank_zero,
    reduce_found_inf_,
)
from mixprec.core.policy import Policy, describe
from mixprec.core.prepare import autocast_context, param_probe, probe_device_type
from mixprec.core.scaling import LossScaler
from mixprec.core.validate import check_module_has_parameters

log = logging.getLogger("mixprec")
PARALLEL_WRAPPERS = (nn.parallel.DistributedDataParallel, nn.DataParallel)


class _AmpState:
    """What one `initialize` call set up and `scale_loss`/`state_dict` use."""

    def __init__(
        self, policy: Policy, enabled: bool, verbosity: int, scalers: list[LossScaler]
    ) -> None:
        self.policy = policy
        self.enabled = enabled
        self.verbosity = verbosity
        self.scalers = scalers
        # overflowed backward passes per loss, counted on the device (no sync per step)
        self.overflows = [torch.zeros(1, device=s.scale_tensor.device) for s in scalers]


_state: _AmpState | None = None
# optimizers an initialize call wrapped: their param_groups now hold that call's fp32 masters
_wrapped_optimizers: weakref.WeakSet[Any] = weakref.WeakSet()


def _require_state() -> _AmpState:
    if _state is None:
        raise RuntimeError(
            "amp is not initialized: call `model, optimizer = amp.initialize(model, optimizer, "
            "opt_level=...)` before amp.scale_loss / amp.state_dict / amp.load_state_dict."
        )
    return _state


# ----- models -----
def _amp_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The patched forward: cast inputs to the model dtype, autocast (O1), cast outputs."""
    policy: Policy = self._mixprec_amp_policy
    inner = self._mixprec_amp_inner_forward
    if inner is None:
        inner = functools.partial(type(self).forward, self)  # dynamo cannot trace MethodType()
    if policy.casts_params:
        args, kwargs = cast_call_args(args, kwargs, policy.param_dtype)
    casts = autocast_context if self._mixprec_amp_handle.is_active() else _no_autocast
    with casts(policy, probe_device_type(self._mixprec_amp_probe)):
        out = inner(*args, **kwargs)
    if policy.cast_outputs_to is not None:
        out = cast_floating(out, policy.cast_outputs_to)
    return out


def _no_autocast(policy: Policy, device_type: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()  # O1 after handle._deactivate(): Apex's unpatched torch


def _lp_state_to_fp32_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    # Apex's O2StateDictHook: a cast model saves fp32 tensors, loadable into an fp32 model.
    for name in (*module._parameters, *module._buffers):
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
            state_dict[prefix + name] = value.float()


def _check_model(model: nn.Module, index: int) -> None:
    check_module_has_parameters(f"models[{index}]", model)
    if isinstance(model, PARALLEL_WRAPPERS):
        raise TypeError(
            f"models[{index}] is a {type(model).__name__}: wrap models in parallel wrappers only "
            "AFTER amp.initialize has returned them (casting would break the wrapper's hooks)."
        )
    if "_mixprec_amp_policy" in model.__dict__:
        raise ValueError(f"models[{index}] was already returned by amp.initialize; pass it once.")
    if _amp_state.allow_incoming_model_not_fp32:
        return
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and t.dtype != torch.float32:
            raise ValueError(
                f"models[{index}] has {name} of dtype {t.dtype}; amp.initialize expects an fp32 "
                "model (you need not call .half() first, at any opt_level). To pass it as it "
                "is, set `amp._amp_state.allow_incoming_model_not_fp32 = True` first (as in Apex)."
            )


def _optimizer_list(optimizers: Any) -> tuple[list[Any], bool]:
    """(optimizers, given_as_list): torch optimizers or optimizer-like wrappers (Apex's LARC)."""
    items, was_list = (
        (list(optimizers), True) if isinstance(optimizers, list) else ([optimizers], False)
    )
    for index, opt in enumerate(items):
        where = f"optimizers[{index}]" if was_list else "optimizers"
        kind = f"{type(opt).__module__}.{type(opt).__qualname__}"
        if isinstance(opt, PerLossOptimizer):
            raise ValueError(
                f"{where} is a PerLossOptimizer that amp.initialize returned; pass it once. For a "
                "fresh model/optimizer pair, build a new torch optimizer over the new model."
            )
        if opt in _wrapped_optimizers:
            raise ValueError(
                f"{where} ({kind}) was wrapped by an earlier amp.initialize call (its "
                "param_groups now hold that call's fp32 masters): keep using the optimizer that "
                "call returned, or build a fresh one."
            )
        missing = [] if isinstance(opt, torch.optim.Optimizer) else missing_members(opt)
        if missing:
            raise TypeError(
                f"{where} is a {kind}, which lacks {missing}. amp.initialize takes a "
                f"torch.optim.Optimizer, an optimizer-like wrapper with {', '.join(REQUIRED)} "
                "(such as Apex's LARC), or a list of them."
            )
    return items, was_list


def _wrap_optimizer(
    opt: Any, master_weights: bool | None, scalers: list[LossScaler], verbosity: int
) -> PerLossOptimizer:
    inner = opt if isinstance(opt, torch.optim.Optimizer) else OptimizerLike(opt)
    amp_opt = PerLossOptimizer(
        inner,
        scalers=scalers,
        verbosity=verbosity,
        master_weights=master_weights,
        amp_scale_loss=scale_loss,  # handed in: _optim does not import this module
    )
    with contextlib.suppress(TypeError):  # an object without weakref support: no re-wrap check
        _wrapped_optimizers.add(opt)
    loaded = any(m in amp_opt.optim.state for m in amp_opt.hp_masters)
    if loaded and verbosity > 0 and is_rank_zero():  # Apex's load-before-initialize order
        log.info(
            "amp.initialize: the optimizer already holds state; its fp32 masters are built from "
            "the model's cast params, as in Apex. Load a mixprec optimizer checkpoint after "
            "initialize to restore its saved masters bit for bit."
        )
    return amp_opt


def _cast_and_patch(model: nn.Module, policy: Policy, handle: AmpHandle) -> None:
    if policy.casts_params:
        cast_module(model, policy.param_dtype, keep_norm_fp32=policy.keep_norm_fp32)
        for module in model.modules():
            module.register_state_dict_post_hook(_lp_state_to_fp32_hook)
    model._mixprec_amp_policy = policy
    model._mixprec_amp_handle = handle  # O1 autocasts while handle.is_active()
    model._mixprec_amp_probe = param_probe(model)
    model._mixprec_amp_inner_forward = model.__dict__.get("forward")
    # bound to the instance (not a closure): deepcopy(model) rebinds it to the copy
    model.forward = types.MethodType(_amp_forward, model)


def _held_by(opt: PerLossOptimizer, named: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, the tensor opt steps for it: its fp32 master, or the param itself)."""
    lp_to_master = {id(lp): hp for lp, hp in zip(opt.lp_params, opt.hp_masters, strict=True)}
    for name, p in named:
        yield name, lp_to_master.get(id(p), p)


def _as_list(value: Any, kind: type, what: str) -> tuple[list[Any], bool]:
    if isinstance(value, kind):
        return [value], False
    if isinstance(value, list) and all(isinstance(v, kind) for v in value):
        return list(value), True
    raise TypeError(
        f"{what} must be a single {kind.__module__}.{kind.__qualname__} or a list of them, "
        f"got {value!r}."
    )


def initialize(
    models: nn.Module | list[nn.Module],
    optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
    enabled: bool = DEFAULTS["enabled"],
    opt_level: str = DEFAULTS["opt_level"],
    cast_model_type: torch.dtype | None = DEFAULTS["cast_model_type"],
    patch_torch_functions: bool | None = DEFAULTS["patch_torch_functions"],
    keep_batchnorm_fp32: bool | str | None = DEFAULTS["keep_batchnorm_fp32"],
    master_weights: bool | None = DEFAULTS["master_weights"],
    loss_scale: float | str | None = DEFAULTS["loss_scale"],
    cast_model_outputs: torch.dtype | None = DEFAULTS["cast_model_outputs"],
    num_losses: int = DEFAULTS["num_losses"],
    verbosity: int = DEFAULTS["verbosity"],
    min_loss_scale: float | None = DEFAULTS["min_loss_scale"],
    max_loss_scale: float = DEFAULTS["max_loss_scale"],
) -> Any:
    """Cast models and wrap optimizers for an opt level; returns them as they were passed.

    Returns model / (model, optimizer) / ([models], [optimizers]) / ... mirroring the
    structure of the arguments, as Apex does (the model alone when optimizers is None).
    The overrides adjust the opt level's properties (see mixprec.apex.policy.ApexOptions).
    """
    global _state
    options = ApexOptions.of(locals())
    policy, verbosity = options.policy, options.verbosity
    model_list, models_was_list = _as_list(models, nn.Module, "models")
    if optimizers is None:
        optimizer_list, optimizers_was_list = [], False
    else:
        optimizer_list, optimizers_was_list = _optimizer_list(optimizers)
    properties = Properties(options.properties())
    if not options.enabled:  # Apex: every amp call becomes a no-op
        functions.apply_to(False)  # registered functions run as they were
        _state = _AmpState(policy, False, verbosity, [])
        _amp_state.bind([], properties, verbosity=verbosity)
        return models if optimizers is None else (models, optimizers)
    for index, model in enumerate(model_list):
        _check_model(model, index)
    device = next((p.device for m in model_list for p in m.parameters()), torch.device("cpu"))
    warn_if_amp_cannot_help(policy, device, "amp.initialize")  # once per device and dtype
    scalers = [LossScaler(policy.loss_scale, device) for _ in range(options.num_losses)]
    patches = policy.compute_dtype is not None
    handle = AmpHandle(
        active=patches,
        device_type=device.type,
        on_deactivate=functions.restore_functions,
        verbose=verbosity > 0,
    )
    for model in model_list:
        _cast_and_patch(model, policy, handle)
    # after the casts: the masters copy the cast weights
    masters = options.optimizer_master_weights()
    amp_optimizers = [_wrap_optimizer(o, masters, scalers, verbosity) for o in optimizer_list]
    for opt in amp_optimizers:  # so a collapsing scale names the params that overflowed
        for index, model in enumerate(model_list):
            prefix = f"models[{index}]." if len(model_list) > 1 else ""
            opt.param_names.update(
                {id(held): prefix + name for name, held in _held_by(opt, model.named_parameters())}
            )
    _state = _AmpState(policy, True, verbosity, scalers)
    _amp_state.bind(scalers, properties, handle, verbosity)
    for opt in amp_optimizers:  # an earlier call's optimizers keep their own scalers
        opt.amp_state = _state
    functions.apply_to(patches)  # O1: patch the registered functions
    if verbosity > 0 and is_rank_zero():
        log.info("amp.initialize: opt_level %s -> %s", options.opt_level, describe(policy))
    out_models = model_list if models_was_list else model_list[0]
    if optimizers_was_list:
        return out_models, amp_optimizers
    if not amp_optimizers:
        return out_models
    return out_models, amp_optimizers[0]


def _handle_optimizer(optimizer: Any, num_loss: int) -> PerLossOptimizer:
    """The optimizer behind amp.init's `handle.wrap_optimizer`: num_loss dynamic loss scalers
    of its own (Apex's OptimWrapper), fp32 params stepped as they are (O1)."""
    policy = apex_policy(opt_level="O1", num_losses=num_loss)  # checks num_loss
    (opt,), _ = _optimizer_list(optimizer)
    params = [p for group in opt.param_groups for p in group["params"]]
    device = params[0].device if params else torch.device("cpu")
    scalers = [LossScaler(policy.loss_scale, device) for _ in range(num_loss)]
    amp_opt = _wrap_optimizer(opt, False, scalers, policy.verbosity)
    amp_opt.amp_state = _AmpState(policy, True, policy.verbosity, scalers)
    return amp_opt


# ----- losses -----
def _amp_optimizers(opts: list[Any]) -> tuple[list[PerLossOptimizer], _AmpState]:
    """The optimizers and the amp state (loss scalers) of the initialize call they came from."""
    for opt in opts:
        if not isinstance(opt, PerLossOptimizer):
            raise TypeError(
                f"scale_loss needs the optimizer(s) amp.initialize returned, got {opt!r}."
            )
    if any(opt.amp_state is None for opt in opts):
        raise ValueError("scale_loss needs optimizers returned by amp.initialize.")
    if len({id(opt.amp_state) for opt in opts}) > 1:
        raise ValueError(
            "scale_loss got optimizers from different amp.initialize calls; each call has its "
            "own loss scalers, so scale each loss with the optimizers of one call."
        )
    return opts, opts[0].amp_state


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: PerLossOptimizer | list[PerLossOptimizer],
    loss_id: int = 0,
    model: nn.Module | None = None,
    delay_unscale: bool = False,
) -> Iterator[torch.Tensor]:
    """Yield loss.float() * loss scale `loss_id`; on exit unscale and check the new grads.

    optimizers: those whose params this backward reaches (the ones initialize returned).
    model: unused, as in Apex. delay_unscale=True leaves the grads scaled so that several
    backward passes accumulate; the last scale_loss of the iteration (same loss_id) must have
    delay_unscale=False, and it unscales everything accumulated since the first.
    """
    given = list(optimizers) if isinstance(optimizers, list | tuple) else [optimizers]
    # optimizers from amp.init's handle.wrap_optimizer carry their own scalers: no initialize
    if not all(isinstance(o, PerLossOptimizer) and o.amp_state is not None for o in given):
        state = _require_state()
        if not state.enabled and not all(isinstance(opt, PerLossOptimizer) for opt in given):
            yield loss
            return
    opts, state = _amp_optimizers(given)
    if isinstance(loss_id, bool) or not isinstance(loss_id, int):
        raise TypeError(f"loss_id={loss_id!r} must be an int.")
    if not 0 <= loss_id < len(state.scalers):
        raise ValueError(
            f"loss_id={loss_id!r} but amp.initialize was given num_losses={len(state.scalers)}: "
            f"valid loss ids are 0..{len(state.scalers) - 1}."
        )
    for opt in opts:
        if opt.scaled_grads_from not in (None, loss_id):
            raise ValueError(
                f"loss_id={loss_id} but the grads accumulating under delay_unscale=True are "
                f"scaled by loss scaler {opt.scaled_grads_from}: accumulate with one loss_id."
            )
        opt.begin_backward()
    scaler = state.scalers[loss_id]
    yield loss.float() * scaler.scale_tensor
    if delay_unscale:
        for opt in opts:
            opt.scaled_grads_from = loss_id
        return
    found_inf = torch.zeros(1, dtype=torch.float32, device=scaler.scale_tensor.device)
    scale_used = scaler.scale_tensor.clone()
    inv_scale = scaler.inv_scale()
    for opt in opts:
        opt.unscale_new_grads(inv_scale, found_inf)
    reduce_found_inf_(found_inf)  # every rank must take the same skip decision
    scaler.update(found_inf)
    state.overflows[loss_id] += found_inf
    event = UnscaleEvent(loss_id, found_inf, scale_used, scaler.scale_tensor.clone())
    for opt in opts:
        opt.events.append(event)


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Apex's `amp.disable_casts()`: no autocast (and no registered-function casts) inside."""
    if _state is None or not _state.enabled:
        with fp32_region():
            yield
        return
    with _amp_state.handle._disable_casts():
        yield


# ----- checkpoints -----
def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every loss scaler: {'loss_scaler0': {'loss_scale', 'unskipped', ...}, ...} (as Apex).

    mixprec adds 'hysteresis' (overflows left before a back-off) and 'overflows' (backward
    passes of that loss that overflowed so far).
    """
    state = _require_state()
    destination = OrderedDict() if destination is None else destination
    for index, scaler in enumerate(state.scalers):
        sd = scaler.state_dict()
        destination[f"loss_scaler{index}"] = {
            "loss_scale": float(sd["scale"].item()),
            "unskipped": int(sd["growth_tracker"].item()),
            "hysteresis": int(sd["hysteresis_tracker"].item()),
            "overflows": int(state.overflows[index].item()),
        }
    return destination


def load_state_dict(state_dict: dict[str, Any]) -> None:
    """Restore what `state_dict()` saved (Apex's two keys per scaler suffice)."""
    state = _require_state()
    expected = [f"loss_scaler{i}" for i in range(len(state.scalers))]
    for key in state_dict:
        if key not in expected:
            raise ValueError(
                f"Unexpected key {key!r} in the amp state_dict; this amp has "
                f"num_losses={len(state.scalers)}: keys {expected}."
            )
    missing = [k for k in expected if k not in state_dict]
    if missing:
        raise ValueError(
            f"The amp state_dict lacks {missing} (it holds {len(state_dict)} loss scalers, "
            f"this amp has num_losses={len(state.scalers)})."
        )
    for index, (key, scaler) in enumerate(zip(expected, state.scalers, strict=True)):
        entry = state_dict[key]
        if not {"loss_scale", "unskipped"} <= set(entry):
            raise ValueError(f"{key} needs 'loss_scale' and 'unskipped'; got {sorted(entry)}.")
        scaler.load_state_dict(
            {
                "scale": entry["loss_scale"],
                "growth_tracker": int(entry["unskipped"]),
                "hysteresis_tracker": int(entry.get("hysteresis", scaler.cfg.hysteresis)),
            }
        )
        state.overflows[index].fill_(float(entry.get("overflows", 0)))


__all__ = [
    "PARALLEL_WRAPPERS",
    "Properties",
    "_amp_state",
    "disable_casts",
    "initialize",
    "load_state_dict",
    "scale_loss",
    "state_dict",
]
