"""Find the first module, pass and step where an inf or NaN appears.

"Found overflow. Skip step" says that a step overflowed, not where. NonFiniteLocator hooks
every submodule and records the first place a non-finite value shows up:

- forward: each module's floating outputs (and the model's own inputs: bad data);
- backward: the gradient with respect to each module's inputs, which is what that module's
  backward produced. It uses tensor hooks, not full backward hooks: those wrap activations in
  a custom Function and make in-place layers (ReLU(inplace=True)) raise;
- parameters: `check_grads()` after backward names the parameters whose .grad is non-finite.

Cost: every check reads a flag back to the host (a device sync per tensor per module). This
is a debugging tool: run it for the steps you are investigating, not for production steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

Where = Literal[
    "forward_input", "forward_output", "backward_grad_input", "backward_grad_output", "param_grad"
]
Kind = Literal["inf", "nan"]

_WHERE_TEXT: dict[str, str] = {
    "forward_input": "the forward input",
    "forward_output": "the forward output",
    "backward_grad_input": "the gradient its backward produced for input",
    "backward_grad_output": "the gradient arriving at its output",
    "param_grad": "the .grad of parameter",
}


@dataclass(frozen=True, kw_only=True)
class NonFiniteRecord:
    """One place where an inf or NaN was seen."""

    module: str
    """Qualified name of the module ('' is the model itself)."""
    where: Where
    """Forward output, a backward gradient, or a parameter's .grad."""
    step: int
    """Value of the locator's step counter when it was seen."""
    kind: Kind
    """'nan' if the tensor holds any NaN (inf - inf makes NaN, so NaN is the later stage)."""
    tensor: str
    """Which tensor: 'output[0]', 'input[1]' (flattened order), or a parameter name."""
    dtype: torch.dtype
    """dtype of the non-finite tensor."""
    shape: tuple[int, ...]
    """Shape of the non-finite tensor."""

    def describe(self) -> str:
        """One readable line."""
        module = repr(self.module) if self.module else "<model>"
        return (
            f"{self.kind} in {_WHERE_TEXT[self.where]} {self.tensor} of module {module} "
            f"at step {self.step} ({self.dtype}, shape {tuple(self.shape)})"
        )


class NonFiniteError(FloatingPointError):
    """Raised by a locator built with raise_on_first=True; `.record` says where."""

    def __init__(self, record: NonFiniteRecord) -> None:
        super().__init__("Non-finite value: " + record.describe())
        self.record = record


def tensor_to_kind(tensor: torch.Tensor) -> Kind | None:
    """None if every element is finite, else 'nan' (any NaN) or 'inf'. Syncs to the host."""
    if bool(torch.isfinite(tensor).all()):  # this bool() is the host sync
        return None
    return "nan" if bool(torch.isnan(tensor).any()) else "inf"


def _floating(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point()]


@dataclass
class _GradSite:
    # Modules that took / returned one activation in the forward; its grad hook reads them.
    consumers: list[tuple[str, str]] = field(default_factory=list)
    producers: list[tuple[str, str]] = field(default_factory=list)


class NonFiniteLocator:
    """Hooks on every submodule of `model` that record where inf/NaN first appears.

    Usage::

        with NonFiniteLocator(model) as locator:
            for batch in data:
                loss = loss_fn(model(batch))
                loss.backward()
                locator.check_grads()
                ...
                locator.step()
        print(locator.report())

    Hooks are attached on construction and removed by `remove()` or at the end of a `with`.
    raise_on_first: raise NonFiniteError at the first inf/NaN (a stack trace at the culprit).
    check_backward: also watch gradients (tensor hooks on module inputs and outputs).
    max_records: how many records to keep after the first (they show how it spread).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        raise_on_first: bool = False,
        check_backward: bool = True,
        max_records: int = 32,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"NonFiniteLocator needs an nn.Module, got {type(model).__name__}.")
        if max_records < 1:
            raise ValueError(f"max_records={max_records!r} must be >= 1.")
        self.model = model
        self.raise_on_first = raise_on_first
        self.check_backward = check_backward
        self.max_records = max_records
        self.current_step = 0
        self.records: list[NonFiniteRecord] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._sites: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._generation = 0  # gradient hooks from an earlier attach() go quiet
        self.attach()

    @property
    def first(self) -> NonFiniteRecord | None:
        """The first inf/NaN seen since construction (or `reset()`), or None."""
        return self.records[0] if self.records else None

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def step(self) -> int:
        """Advance the step counter (call once per optimizer step); returns the new value."""
        self.current_step += 1
        return self.current_step

    def reset(self) -> None:
        """Forget the records (the step counter keeps counting)."""
        self.records.clear()

    def attach(self) -> None:
        """Register the hooks (done by the constructor; again after `remove()`)."""
        if self._handles:
            return
        self._generation += 1
        for name, module in self.model.named_modules():
            pre_hook = self._pre_hook(name)
            self._handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(name)))

    def remove(self) -> None:
        """Remove every hook; gradient hooks still pending on live tensors become no-ops."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._sites = WeakIdKeyDictionary()

    def __enter__(self) -> NonFiniteLocator:
        self.attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def check_grads(self) -> list[NonFiniteRecord]:
        """Records for every parameter whose .grad holds inf/NaN (one host sync per grad)."""
        found = []
        for param_name, param in self.model.named_parameters():
            if param.grad is None:
                continue
            kind = tensor_to_kind(param.grad)
            if kind is not None:
                module, _, leaf = param_name.rpartition(".")
                found.append(self._make(module, "param_grad", kind, leaf, param.grad))
        for record in found:
            self._add(record)
        return found

    def report(self) -> str:
        """One line: where the first inf/NaN appeared, or that none did."""
        if self.first is None:
            return f"No inf/nan seen (steps 0..{self.current_step})."
        more = len(self.records) - 1
        tail = f"; {more} later record(s) in .records" if more else ""
        return "First non-finite value: " + self.first.describe() + tail + "."

    # -- hooks -------------------------------------------------------------------------------

    def _pre_hook(self, name: str) -> Callable[[nn.Module, tuple, dict], None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if module is self.model:  # bad data is reported as such, not blamed on a layer
                self._check("", "forward_input", "input", _floating((args, kwargs)))
            self._watch((args, kwargs), name, "input", consumer=True)

        return hook

    def _post_hook(self, name: str) -> Callable[[nn.Module, tuple, Any], None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self._check(name, "forward_output", "output", _floating(output))
            self._watch(output, name, "output", consumer=False)

        return hook

    def _check(self, module: str, where: Where, what: str, tensors: Sequence[torch.Tensor]) -> None:
        for i, tensor in enumerate(tensors):
            kind = tensor_to_kind(tensor)
            if kind is not None:
                self._add(self._make(module, where, kind, f"{what}[{i}]", tensor))

    def _watch(self, obj: Any, name: str, what: str, *, consumer: bool) -> None:
        if not (self.check_backward and torch.is_grad_enabled()):
            return
        for i, tensor in enumerate(_floating(obj)):
            if not tensor.requires_grad:
                continue
            site = self._sites.get(tensor)
            if site is None:
                site = self._sites[tensor] = _GradSite()
                tensor.register_hook(self._grad_hook(site, self._generation))
            (site.consumers if consumer else site.producers).append((name, f"{what}[{i}]"))

    def _grad_hook(self, site: _GradSite, generation: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            live = self._handles and generation == self._generation
            if not live or not grad.is_floating_point():
                return
            kind = tensor_to_kind(grad)
            if kind is None:
                return
            # A module that returned its input unchanged (Identity, eval Dropout) computed
            # nothing; the innermost real consumer's backward made this gradient.
            producer_names = {name for name, _ in site.producers}
            consumers = [c for c in site.consumers if c[0] not in producer_names]
            if consumers:  # forward pre-hooks run outer to inner: the last is innermost
                (module, what), where = consumers[-1], "backward_grad_input"
            else:  # consumed by code outside any submodule (the loss): blame its arrival
                (module, what), where = site.producers[0], "backward_grad_output"
            self._add(self._make(module, where, kind, what, grad))

        return hook

    def _make(
        self, module: str, where: Where, kind: Kind, what: str, tensor: torch.Tensor
    ) -> NonFiniteRecord:
        return NonFiniteRecord(
            module=module,
            where=where,
            step=self.current_step,
            kind=kind,
            tensor=what,
            dtype=tensor.dtype,
            shape=tuple(tensor.shape),
        )

    def _add(self, record: NonFiniteRecord) -> None:
        first = not self.records
        if len(self.records) < self.max_records:
            self.records.append(record)
        if first and self.raise_on_first:
            raise NonFiniteError(record)


def find_nonfinite(
    model: nn.Module,
    example_input: torch.Tensor | tuple[Any, ...],
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    compute_dtype: torch.dtype | None = None,
) -> NonFiniteLocator:
    """Run one forward and backward of `model` under a locator and return it (hooks removed).

    example_input: a tensor, or a tuple of positional arguments.
    loss_fn: output -> scalar loss; default: the sum of the output's floating tensors.
    compute_dtype: run the forward under torch.autocast in this dtype (None: no autocast).
    The parameters' existing .grad are put back afterwards; `locator.first` says what was found.
    """
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    device = next((t.device for t in _floating(args)), torch.device("cpu"))
    saved_grads = {p: p.grad for p in model.parameters()}
    for param in saved_grads:
        param.grad = None
    try:
        with NonFiniteLocator(model) as locator:
            with torch.autocast(
                device.type, dtype=compute_dtype, enabled=compute_dtype is not None
            ):
                output = model(*args)
            if loss_fn is not None:
                loss = loss_fn(output)
            else:
                outputs = _floating(output)
                loss = torch.stack([t.float().sum() for t in outputs]).sum() if outputs else None
            if loss is not None and loss.requires_grad:
                loss.backward()
                locator.check_grads()
    finally:
        for param, grad in saved_grads.items():
            param.grad = grad
    return locator
