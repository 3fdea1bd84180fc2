"""Apex's older amp API: `handle = amp.init(...)`, casts on until `handle._deactivate()`.

    from mixprec.apex import amp

    handle = amp.init(enabled=True, loss_scale="dynamic")
    out = model(x)                                   # O1 casts: linear in fp16, softmax in fp32
    with handle.scale_loss(loss_fn(out, y), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()                                 # skipped once if the grads overflowed
    handle._deactivate()                             # casts off, registered functions restored

Apex patched torch's functions for the whole process; here `amp.init` enters a
`mixprec.autocast` holding Apex's O1 lists (mixprec.apex.lists) on the calling thread, with a
guard above it for what the lists cannot say (Apex's banned binary_cross_entropy, in-place
fp32 ops on a low-precision tensor, the weight-cast cache, verbose cast messages), and
patches the functions registered with `amp.register_*_function`. Regions must be left in the
order they were entered: `_deactivate()` the handle after any region opened after `init`.

The cast cache (enable_caching=True, Apex's default): the low-precision copy of an
nn.Parameter made for a white-listed op is kept and reused by later ops until the handle's
scale_loss exits (as in Apex), `_clear_cache()` / `remove_cache()` is called, or the parameter
changes: an in-place write through it (optimizer.step, `p.sub_()` under no_grad) bumps its
version and the next use casts afresh, and a copy cast under no_grad is not reused where
gradients must reach the parameter (Apex's two stale-cache hazards). A write through
`p.data` bumps no version (it is hidden from autograd too): clear the cache after one.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from typing_extensions import override

from mixprec.apex import functions
from mixprec.apex.amp.frontend import _handle_optimizer, scale_loss
from mixprec.apex.amp_state import AmpHandle
from mixprec.apex.lists import BANNED_OPS, FP32_OPS, INPLACE_FP32_OPS, LOW_PRECISION_OPS
from mixprec.apex.policy import _as_bool, _scaler_config
from mixprec.core.autocast import _op_name, autocast, default_device_type
from mixprec.core.per_loss_optim import reduce_found_inf_
from mixprec.core.policy import APEX_SCALER, to_low_dtype
from mixprec.core.scaling import LossScaler, unscale_and_check_

log = logging.getLogger("mixprec")
_LOW = (torch.float16, torch.bfloat16)
_DTYPE_NAMES = {torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float"}


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, list | tuple):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


class _CastCache:
    """param -> its low-precision copy, valid while the param is unchanged (see module doc)."""

    def __init__(self) -> None:
        # id(param) -> (weakref to param, param._version, made with grad enabled, the copy)
        self.entries: dict[int, tuple[weakref.ref, int, bool, torch.Tensor]] = {}

    def cast(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        grad_on = torch.is_grad_enabled()
        entry = self.entries.get(id(param))
        if entry is not None:
            ref, version, made_with_grad, copy = entry
            fresh = ref() is param and version == param._version and copy.dtype == dtype
            if fresh and (made_with_grad or not grad_on):  # a no_grad copy carries no graph
                return copy
        copy = param.to(dtype)
        self.entries[id(param)] = (weakref.ref(param), param._version, grad_on, copy)
        return copy

    def remove(self, param: torch.Tensor) -> None:
        self.entries.pop(id(param), None)

    def clear(self) -> None:
        self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)


class _ApexGuardMode(TorchFunctionMode):
    """Sits above the O1 autocast: banned ops, in-place fp32 ops, the cast cache, messages."""

    def __init__(self, handle: InitHandle) -> None:
        super().__init__()
        self.handle = handle

    @override
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handle = self.handle
        if not handle._active:  # inside _disable_casts(): Apex's casts (and checks) are off
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in INPLACE_FP32_OPS or name == "__ipow__":
            self_arg = args[0] if args else None
            if isinstance(self_arg, torch.Tensor) and self._is_low(self_arg):
                raise NotImplementedError(
                    f"In-place {name} on a {self_arg.dtype} tensor under amp: the op runs in "
                    f"fp32 under O1, but in place its result would keep {self_arg.dtype}. Use "
                    f"the out-of-place form, or cast the tensor with .float() first."
                )
        op = _op_name(func)
        if op in BANNED_OPS and not handle._allow_banned:
            low = [t.dtype for t in _tensors((args, kwargs)) if self._is_low(t)]
            if low:
                raise NotImplementedError(BANNED_OPS[op] + f" (inputs included {low[0]}.)")
        if op in LOW_PRECISION_OPS:
            if handle._verbose:
                self._report(op, args, kwargs, handle._dtype)
            if handle._cache is not None:
                args, kwargs = self._cached((args, kwargs), handle._cache, handle._dtype)
        elif op in FP32_OPS and handle._verbose:
            self._report(op, args, kwargs, torch.float32)
        return func(*args, **kwargs)

    def _is_low(self, t: torch.Tensor) -> bool:
        return t.dtype in _LOW and t.device.type == self.handle._device_type

    def _cached(self, tree: Any, cache: _CastCache, dtype: torch.dtype) -> Any:
        if isinstance(tree, torch.nn.Parameter):
            if tree.dtype == torch.float32 and tree.device.type == self.handle._device_type:
                return cache.cast(tree, dtype)
            return tree
        if type(tree) in (list, tuple):
            return type(tree)(self._cached(item, cache, dtype) for item in tree)
        if type(tree) is dict:
            return {k: self._cached(v, cache, dtype) for k, v in tree.items()}
        return tree

    def _report(self, op: str, args: Any, kwargs: Any, dtype: torch.dtype) -> None:
        floating = [t for t in _tensors((args, kwargs)) if t.dtype in (torch.float32, *_LOW)]
        for dt in sorted({t.dtype for t in floating if t.dtype != dtype}, key=str):
            log.info("%s->%s (%s)", _DTYPE_NAMES[dt], _DTYPE_NAMES[dtype], op)


class InitHandle(AmpHandle):
    """What `amp.init()` returns: Apex's AmpHandle (is_active, scale_loss, _deactivate, ...)."""

    __slots__ = (
        "_allow_banned",
        "_cache",
        "_dtype",
        "_exits",
        "_scaler",
        "_wrapped_optimizer",
    )

    def __init__(
        self,
        *,
        enabled: bool,
        loss_scale: float | str,
        enable_caching: bool,
        verbose: bool,
        allow_banned: bool,
        dtype: torch.dtype,
    ) -> None:
        device_type = default_device_type()
        super().__init__(active=False, device_type=device_type, verbose=verbose)
        self._allow_banned = allow_banned
        self._dtype = dtype
        self._cache = _CastCache() if enable_caching else None
        self._scaler = LossScaler(
            _scaler_config(loss_scale, None, APEX_SCALER.max_scale), device_type
        )
        self._exits: list[contextlib.AbstractContextManager] = []
        self._wrapped_optimizer = False
        if enabled:
            self._activate()

    def _activate(self) -> None:
        region = autocast(
            dtype=self._dtype,
            custom_white_list=LOW_PRECISION_OPS,
            custom_black_list=FP32_OPS,
            device_type=self._device_type,
        )
        region.__enter__()
        self._exits.append(region)
        guard = _ApexGuardMode(self)
        guard.__enter__()
        self._exits.append(guard)
        if not functions.is_patching():  # an O1 amp.initialize may have patched them already
            functions.patch_functions()
            self._on_deactivate = functions.restore_functions
        self._active = True

    @override
    def _deactivate(self) -> None:
        """Casts off (Apex's unpatching): leave the regions init entered, restore functions."""
        was_active = self._active
        super()._deactivate()
        while self._exits:
            self._exits.pop().__exit__(None, None, None)
        if self._cache is not None:
            self._cache.clear()
        if was_active and _current[0] is self:
            _current[0] = None

    # ----- the cast cache -----
    @property
    def has_cache(self) -> bool:
        return self._cache is not None

    @property
    def cache(self) -> _CastCache | None:
        """The cast cache (None with enable_caching=False); len() counts cached params."""
        return self._cache

    @override
    def _clear_cache(self) -> None:
        if self._cache is not None:
            self._cache.clear()

    def remove_cache(self, param: torch.Tensor) -> None:
        """Forget param's cached low-precision copy (the next op casts it afresh)."""
        if self._cache is not None:
            self._cache.remove(param)

    # ----- loss scaling (the old API's) -----
    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> OptimWrapper:
        """Apex's OptimWrapper over optimizer: `with opt.scale_loss(loss) as s: s.backward()`
        for each of num_loss losses per iteration, each with its own dynamic loss scale; step()
        skips if any of them overflowed. handle.scale_loss is refused from then on, as in Apex.
        """
        self._wrapped_optimizer = True
        return OptimWrapper(_handle_optimizer(optimizer, num_loss), self, num_loss)

    @property
    def loss_scale(self) -> float:
        """The handle's current loss scale (a host sync)."""
        return self._scaler.scale

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> Iterator[Any]:
        """Yield loss.float() * scale; on exit unscale and check the optimizer's grads.

        On an overflow the scale backs off and the optimizer's next step() is skipped once
        (nothing in it changes); the cast cache is cleared, as in Apex's old API.
        """
        if not self._active:
            yield loss
            return
        if self._wrapped_optimizer:
            raise RuntimeError(
                "handle.scale_loss after handle.wrap_optimizer(): scale each loss with the "
                "wrapped optimizer's own scale_loss, `with optimizer.scale_loss(loss) as s:`."
            )
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(f"scale_loss needs a torch optimizer, got {optimizer!r}.")
        scaler = self._scaler
        if scaler.scale_tensor.device != loss.device:
            scaler.to(loss.device)
        yield loss.float() * scaler.scale_tensor
        grads = [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        found_inf = torch.zeros(1, dtype=torch.float32, device=scaler.scale_tensor.device)
        if grads:
            unscale_and_check_(grads, scaler.inv_scale(), found_inf)
        reduce_found_inf_(found_inf)  # every rank skips alike
        scaler.update(found_inf)
        if bool(found_inf.item()):  # a host sync per backward, as Apex's old API had
            _skip_next_step(optimizer, scaler.scale)
        self._clear_cache()

    @override
    def __repr__(self) -> str:
        return (
            f"InitHandle(active={self._active}, dtype={self._dtype}, "
            f"caching={self.has_cache}, allow_banned={self._allow_banned})"
        )


class OptimWrapper:
    """Apex's OptimWrapper (handle.wrap_optimizer): per-loss scaling over one optimizer.

    The i-th `scale_loss(loss)` since the last step uses loss scaler i; the unscaled grads
    of the losses add up, and step() skips (nothing changes) if any loss overflowed, each
    scaler moving by its own loss. Everything else is the wrapped optimizer's.
    """

    def __init__(self, optimizer: Any, handle: InitHandle, num_loss: int) -> None:
        self._optimizer = optimizer  # a PerLossOptimizer with num_loss scalers of its own
        self._amp_handle = handle
        self._num_loss = num_loss
        self._loss_idx = 0

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor) -> Iterator[Any]:
        if not self._amp_handle.is_active():
            yield loss
            return
        if self._loss_idx >= self._num_loss:
            raise RuntimeError(
                f"scale_loss called {self._loss_idx + 1} times since the last step(), but "
                f"wrap_optimizer(num_loss={self._num_loss}): raise num_loss."
            )
        with scale_loss(loss, self._optimizer, loss_id=self._loss_idx) as scaled_loss:
            yield scaled_loss
        self._loss_idx += 1

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise NotImplementedError("The amp optimizer wrapper does not take a closure.")
        self._loss_idx = 0
        if not self._amp_handle.is_active():  # after _deactivate: the plain optimizer
            return self._optimizer.optim.step()
        return self._optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._optimizer.add_param_group(param_group)

    @property
    def loss_scales(self) -> list[float]:
        """Each loss's current scale (a host sync)."""
        return [s.scale for s in self._optimizer.scalers]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_optimizer"], name)

    def __repr__(self) -> str:
        return f"OptimWrapper({self._optimizer!r}, num_loss={self._num_loss})"


def _skip_next_step(optimizer: torch.optim.Optimizer, new_scale: float) -> None:
    """Replace optimizer.step for one call by a skip (Apex's old API did the same)."""
    if getattr(optimizer, "_mixprec_skip_pending", False):
        return
    had_own = "step" in optimizer.__dict__
    own = optimizer.__dict__.get("step")

    def skip_step(closure: Any = None) -> None:
        if closure is not None:
            raise RuntimeError("amp's skipped step cannot run a closure; call step() without.")
        log.warning("Gradient overflow, skipping update (loss scale now %s)", new_scale)
        if had_own:
            optimizer.step = own
        else:
            del optimizer.step
        optimizer._mixprec_skip_pending = False

    optimizer.step = skip_step
    optimizer._mixprec_skip_pending = True


_current: list[InitHandle | None] = [None]
"""The handle of the last amp.init that is still active (one at a time)."""


def init(
    enabled: bool = True,
    loss_scale: float | str = "dynamic",
    enable_caching: bool = True,
    verbose: bool = False,
    allow_banned: bool = False,
    patch_type: torch.dtype | str = torch.float16,
) -> InitHandle:
    """Apex's `amp.init`: O1's casts from now until `handle._deactivate()`; returns the handle.

    enabled=False returns an inactive handle (Apex's NoOpHandle: scale_loss yields the loss).
    loss_scale: 'dynamic' or a static number, for `handle.scale_loss`. enable_caching: reuse a
    parameter's low-precision copy across ops (see the module doc). verbose: log each cast
    (Apex's "Float->Half (linear)") on the "mixprec" logger at INFO. allow_banned: run
    binary_cross_entropy in fp32 instead of refusing low-precision inputs. patch_type: the low
    dtype (torch.float16 or torch.bfloat16).
    """
    flags = {
        "enabled": enabled,
        "enable_caching": enable_caching,
        "verbose": verbose,
        "allow_banned": allow_banned,
    }
    for name, value in flags.items():
        if _as_bool(name, value) is None:
            raise TypeError(f"{name}=None must be True or False.")
        flags[name] = _as_bool(name, value)
    dtype = to_low_dtype(patch_type)
    if flags["enabled"] and _current[0] is not None:
        raise RuntimeError(
            "amp.init() was called while the handle of an earlier amp.init() is still active: "
            "call that handle's _deactivate() first (Apex would have patched torch twice)."
        )
    handle = InitHandle(loss_scale=loss_scale, dtype=dtype, **flags)
    if flags["enabled"]:
        _current[0] = handle
    return handle
