"""`amp._amp_state`: the parts of Apex's global amp state that user code reads or sets.

    from mixprec.apex import amp

    amp._amp_state.allow_incoming_model_not_fp32 = True  # accept a model holding fp16 params
    amp._amp_state.loss_scalers[0].loss_scale()  # the current loss scale of loss_id 0

Assigning any other attribute raises (no setting is silently ignored).
"""

from __future__ import annotations

from mixprec.scaling import LossScaler


class ApexLossScaler:
    """Apex's LossScaler as user code reads it, over one of mixprec's loss scalers."""

    __slots__ = ("_scaler",)

    def __init__(self, scaler: LossScaler) -> None:
        self._scaler = scaler

    def loss_scale(self) -> float:
        """The current loss scale (a host sync, as Apex's float was)."""
        return self._scaler.scale

    @property
    def dynamic(self) -> bool:
        return self._scaler.dynamic

    def __repr__(self) -> str:
        return f"ApexLossScaler(loss_scale={self.loss_scale()}, dynamic={self.dynamic})"


class AmpStateHandle:
    """One per process, as Apex's `_amp_state`; `amp.initialize` rebinds its loss scalers."""

    __slots__ = ("_allow_not_fp32", "_scalers")

    def __init__(self) -> None:
        self._scalers: list[LossScaler] = []
        self._allow_not_fp32 = False

    @property
    def allow_incoming_model_not_fp32(self) -> bool:
        """Apex's switch: let amp.initialize take models whose floating params are not fp32."""
        return self._allow_not_fp32

    @allow_incoming_model_not_fp32.setter
    def allow_incoming_model_not_fp32(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"allow_incoming_model_not_fp32={value!r} must be True or False.")
        self._allow_not_fp32 = value

    def bind(self, scalers: list[LossScaler]) -> None:
        self._scalers = scalers

    @property
    def loss_scalers(self) -> list[ApexLossScaler]:
        """The latest amp.initialize's loss scalers, one per loss_id ([] before it or disabled)."""
        return [ApexLossScaler(s) for s in self._scalers]
