"""Tensors rebound in place to slices of one flat buffer per column.

A batch of same-layout tensors (optimizer state, fp32 masters) stepped by one kernel call needs
one operand: `join` concatenates a column, and `JoinedState` moves each tensor into its slice of
that buffer (`Tensor.set_`), so later steps neither copy in nor copy out, and every holder of a
tensor (the optimizer's state, its param_groups, a checkpoint) still sees its values. Lean's
batched eager step (core.lean) and compile_step's joined groups (core.compiled_join) use it.
"""

from __future__ import annotations

import torch


def layout_of(state: torch.Tensor) -> tuple:
    """What must agree for state tensors to be stepped in one batch: kind, dtype, and for
    torchao's quantized state its signedness and block size (and so its code map)."""
    if type(state) is torch.Tensor:
        return (torch.Tensor, state.dtype)
    return (type(state), bool(getattr(state, "signed", True)), state.block_size)


def join(column: list[torch.Tensor]) -> torch.Tensor:
    """One state tensor of all of a batch's state tensors (same layout_of), flattened and
    concatenated: a plain tensor, or torchao's quantized tensor over the joined codes and
    scales (whole blocks each, so every block and its scale stay as they were)."""
    first = column[0]
    if _plain(first):
        return torch.cat([t.view(-1) for t in column])
    codes = torch.cat([t.codes.view(-1) for t in column])
    scale = torch.cat([t.scale for t in column])
    kind = type(first).__name__
    if kind == "OptimState8bit":
        return type(first)(codes, scale, first.qmap, first.signed, dtype=first.dtype)
    if kind == "OptimState4bit":
        numel = sum(t.numel() for t in column)
        return type(first)(codes, scale, first.qmap, first.signed, (numel,), dtype=first.dtype)
    return type(first)(codes, scale, dtype=first.dtype)  # OptimStateFp8


class JoinedState:
    """Columns of tensors joined once: each tensor (for torchao's state, its codes and scales)
    rebound in place to its slice of its column's joined buffer (`whole`), so the tensors the
    optimizer holds and the one operand a kernel steps share memory. The tensors keep their
    identity (the optimizer's state dict, its param_groups and every reference stay valid)."""

    @torch.no_grad()  # a param (a leaf that requires grad) is rebound too
    def __init__(self, columns: list[list[torch.Tensor]]) -> None:
        self.whole = [join(col) for col in columns]
        for col, whole in zip(columns, self.whole, strict=True):
            for parts, joined in zip(_parts(col), _parts([whole]), strict=True):
                storage, offset = joined[0].untyped_storage(), joined[0].storage_offset()
                for t in parts:
                    t.set_(storage, offset, t.shape, t.stride())
                    offset += t.numel()
        self.columns = columns  # held: their ids stay theirs while compared
        self.ids = [id(t) for col in columns for t in col]
        self.pointers = self._pointers(columns)

    @staticmethod
    def _pointers(columns: list[list[torch.Tensor]]) -> list[int]:
        return [t.data_ptr() for col in columns for parts in _parts(col) for t in parts]

    def holds(self, columns: list[list[torch.Tensor]]) -> bool:
        """columns are still the joined tensors, still in their slices."""
        ids = [id(t) for col in columns for t in col]
        return ids == self.ids and self._pointers(columns) == self.pointers

    @torch.no_grad()
    def release(self) -> None:
        """Give every joined tensor a storage of its own again (its values kept): a column no
        longer stepped as one must not alias its neighbours."""
        for col in self.columns:
            for parts in _parts(col):
                for t in parts:
                    t.set_(t.clone())


def _plain(t: torch.Tensor) -> bool:
    """A plain tensor or parameter (not a tensor subclass such as torchao's quantized state)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def _parts(column: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """A column's plain tensors: itself, or torchao's codes and scales."""
    if _plain(column[0]):
        return [column]
    return [[t.codes for t in column], [t.scale for t in column]]


def split_into(column: list[torch.Tensor], whole: torch.Tensor) -> None:
    """Copy a joined state tensor (see join) back into the batch's own state tensors."""
    for parts, joined in zip(_parts(column), _parts([whole]), strict=True):
        flat = [t.view(-1) for t in parts]
        torch._foreach_copy_(flat, joined[0].view(-1).split([t.numel() for t in flat]))
