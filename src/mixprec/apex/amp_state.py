"""`amp._amp_state`: the parts of Apex's global amp state that user code reads or sets.

    from mixprec.apex import amp

    amp._amp_state.allow_incoming_model_not_fp32 = True  # accept a model holding fp16 params
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    amp._amp_state.loss_scalers[0]._loss_scale = 2**20  # set loss scaler 0's current scale
    amp._amp_state.loss_scalers[0].loss_scale()  # read it (a host sync, as Apex's float was)
    amp._amp_state.opt_properties.opt_level  # 'O2'; Apex's Properties fields, read-only
    amp._amp_state.handle.is_active()  # True while O1's casts are on

The same object is `mixprec.apex.amp._amp_state` and `mixprec.apex.amp.frontend._amp_state`.
Assigning anything else raises (no setting is silently ignored).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch

from mixprec.apex.policy import NO_FLOOR
from mixprec.core.autocast import fp32_region
from mixprec.core.scaling import LossScaler


class ApexLossScaler:
    """Apex's LossScaler as user code reads and sets it, over one of mixprec's loss scalers.

    `_loss_scale` is the live scale: assigning it sets the current scale of that loss (a
    dynamic scaler stays dynamic and moves on from the new value by its rule, as in Apex).
    """

    __slots__ = ("_scaler",)

    def __init__(self, scaler: LossScaler) -> None:
        object.__setattr__(self, "_scaler", scaler)

    def loss_scale(self) -> float:
        """The current loss scale (a host sync, as Apex's float was)."""
        return self._scaler.scale

    @property
    def _loss_scale(self) -> float:
        return self._scaler.scale

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 < value < math.inf
        ):
            raise ValueError(f"_loss_scale={value!r}: a loss scale must be a finite number > 0.")
        # an in-place write bumps the tensor's version: the cached 1/scale and host copy renew
        self._scaler.scale_tensor.fill_(float(value))

    @property
    def dynamic(self) -> bool:
        return self._scaler.dynamic

    @property
    def _unskipped(self) -> int:
        """Clean steps since the last overflow or growth (Apex's counter; a host sync)."""
        return int(self._scaler.growth_tracker.item())

    @property
    def _max_loss_scale(self) -> float:
        return self._scaler.cfg.max_scale

    @property
    def _min_loss_scale(self) -> float | None:
        floor = self._scaler.cfg.min_scale
        return None if floor <= NO_FLOOR else floor  # Apex's None: no floor

    @property
    def _scale_seq_len(self) -> int:
        return self._scaler.cfg.growth_interval

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "_loss_scale":
            raise AttributeError(
                f"amp._amp_state.loss_scalers[i].{name} cannot be set: only _loss_scale (the "
                "current scale) is writable; the scaler's rule comes from amp.initialize's "
                "loss_scale / min_loss_scale / max_loss_scale."
            )
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"ApexLossScaler(loss_scale={self.loss_scale()}, dynamic={self.dynamic})"


class Properties:
    """Apex's `opt_properties`: the options amp.initialize settled on (read-only here).

    Fields as Apex names them: enabled, opt_level, cast_model_type, patch_torch_functions,
    keep_batchnorm_fp32, master_weights, loss_scale ('dynamic' or a float); `options` is the
    mapping of all of them. Apex routed later writes through checks but nothing re-read most of
    them after initialize; mixprec refuses them instead of keeping a value it would not use.
    """

    __slots__ = ("_options",)

    def __init__(self, options: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_options", MappingProxyType(dict(options)))

    @property
    def options(self) -> Mapping[str, Any]:
        return self._options

    def __getattr__(self, name: str) -> Any:
        options = object.__getattribute__(self, "_options")
        if name in options:
            return options[name]
        raise AttributeError(
            f"opt_properties has no field {name!r}; Apex's fields are {sorted(options)}."
        )

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"amp._amp_state.opt_properties.{name} is fixed by amp.initialize: pass "
            f"{name}={value!r} to amp.initialize instead (mixprec builds the models, optimizers "
            "and loss scalers from it there and does not re-read the properties afterwards)."
        )

    def __repr__(self) -> str:
        return "Properties(" + ", ".join(f"{k}={v!r}" for k, v in self._options.items()) + ")"


class AmpHandle:
    """Apex's `_amp_state.handle`: whether O1's casts are on, and the switch to turn them off.

    is_active(): True after an initialize that patches torch functions (O1), until
    `_deactivate()` (O1's models then run their forward without autocast and registered
    functions are restored, as Apex's unpatching did). `_disable_casts()` turns casts off for a
    block (Apex's `amp.disable_casts()`). `_clear_cache()` is a no-op: mixprec keeps no cast
    cache across calls (torch's autocast drops its weight-cast cache on leaving each forward).
    """

    __slots__ = ("_active", "_device_type", "_on_deactivate", "_verbose")

    def __init__(
        self,
        active: bool,
        device_type: str = "cpu",
        on_deactivate: Callable[[], None] | None = None,
        verbose: bool = False,
    ) -> None:
        self._active = active
        self._device_type = device_type
        self._on_deactivate = on_deactivate
        self._verbose = verbose

    def is_active(self) -> bool:
        return self._active

    @property
    def verbose(self) -> bool:
        return self._verbose

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        was = self._active
        self._active = False
        try:
            with fp32_region(self._device_type):  # also inside an already-running forward
                yield
        finally:
            self._active = was

    def _deactivate(self) -> None:
        if self._active and self._on_deactivate is not None:
            self._on_deactivate()
        self._active = False

    def _clear_cache(self) -> None:
        """No cast cache outlives a forward here (see the class docstring)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> AmpHandle:
        return self  # process-wide, as Apex's: a deep-copied model follows the same switch

    def __repr__(self) -> str:
        return f"AmpHandle(active={self._active})"


class AmpStateHandle:
    """One per process, as Apex's `_amp_state`; `amp.initialize` rebinds what it set up."""

    __slots__ = ("_allow_not_fp32", "_handle", "_properties", "_scalers", "_verbosity")

    def __init__(self) -> None:
        self._scalers: tuple[ApexLossScaler, ...] = ()
        self._allow_not_fp32 = False
        self._properties: Properties | None = None
        self._handle = AmpHandle(active=False)
        self._verbosity = 1

    @property
    def allow_incoming_model_not_fp32(self) -> bool:
        """Apex's switch: let amp.initialize take models whose floating params are not fp32."""
        return self._allow_not_fp32

    @allow_incoming_model_not_fp32.setter
    def allow_incoming_model_not_fp32(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"allow_incoming_model_not_fp32={value!r} must be True or False.")
        self._allow_not_fp32 = value

    def bind(
        self,
        scalers: list[LossScaler],
        properties: Properties | None = None,
        handle: AmpHandle | None = None,
        verbosity: int = 1,
    ) -> None:
        self._scalers = tuple(ApexLossScaler(s) for s in scalers)
        self._properties = properties
        self._handle = handle if handle is not None else AmpHandle(active=False)
        self._verbosity = verbosity

    @property
    def loss_scalers(self) -> tuple[ApexLossScaler, ...]:
        """The latest amp.initialize's loss scalers, one per loss_id (() before it or disabled).

        A tuple: replacing a scaler would not reach the optimizers; set `[i]._loss_scale`.
        """
        return self._scalers

    @property
    def opt_properties(self) -> Properties:
        """Apex's Properties of the latest amp.initialize (absent before it, as in Apex)."""
        if self._properties is None:
            raise AttributeError(
                "amp._amp_state.opt_properties is set by amp.initialize; call it first."
            )
        return self._properties

    @property
    def handle(self) -> AmpHandle:
        """The latest amp.initialize's handle (active for O1 until `_deactivate()`)."""
        return self._handle

    @property
    def verbosity(self) -> int:
        """amp.initialize's verbosity (0 silences amp's messages)."""
        return self._verbosity


def device_type_of(params: list[torch.Tensor]) -> str:
    """The device type casts apply to: the first param's (cpu when there are none)."""
    return params[0].device.type if params else "cpu"
