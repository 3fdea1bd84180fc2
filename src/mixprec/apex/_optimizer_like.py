"""Optimizer-like wrappers (Apex's LARC and its kin) seen as a torch.optim.Optimizer.

Apex patched whatever object it was handed; mixprec's core wraps a torch.optim.Optimizer, so
a wrapper that only quacks like one (step, zero_grad, param_groups, state_dict) is put behind
this adapter, which delegates each call to it: its own step() still runs on every step.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from typing_extensions import override

REQUIRED = ("step", "zero_grad", "param_groups", "state_dict")
"""What amp.initialize needs of an optimizer that is not a torch.optim.Optimizer."""


def missing_members(obj: Any) -> list[str]:
    return [name for name in REQUIRED if not hasattr(obj, name)]


class OptimizerLike(torch.optim.Optimizer):
    """A torch.optim.Optimizer face over `wrapped`; param_groups and state are its own."""

    def __init__(self, wrapped: Any) -> None:
        # torch.optim.Optimizer.__init__ would build new param_groups: the wrapped one's stay.
        self.wrapped = wrapped
        # No torch hook tables: every method torch would run hooks in is the wrapped one's.
        self._fallback_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.wrapped.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.wrapped.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return getattr(self.wrapped, "state", self._fallback_state)

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return getattr(self.wrapped, "defaults", {})

    @override
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return self.wrapped.step() if closure is None else self.wrapped.step(closure)

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wrapped.zero_grad()

    @override
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self.wrapped.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not hasattr(self.wrapped, "load_state_dict"):
            raise TypeError(
                f"{type(self.wrapped).__qualname__} has no load_state_dict(): this optimizer "
                "wrapper cannot restore a checkpoint."
            )
        self.wrapped.load_state_dict(state_dict)

    @override
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not hasattr(self.wrapped, "add_param_group"):
            raise TypeError(f"{type(self.wrapped).__qualname__} has no add_param_group().")
        self.wrapped.add_param_group(param_group)

    @override
    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    @override
    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @override
    def __repr__(self) -> str:
        return f"OptimizerLike({type(self.wrapped).__module__}.{type(self.wrapped).__qualname__})"
