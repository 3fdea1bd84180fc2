"""Places and the Executor: `exe.run(main_program, feed, fetch_list)` runs one compiled step.

The recorded program replays as an nn.Module (ProgramModule) whose parameters are the live
parameters the ops referenced, each op's inputs cast as the AMP decoration decided; the core's
compile_step turns forward, backward, unscale, check, skip, update and the loss-scale update
into one compiled program, built on the first run and reused (use_program_cache or not).
An optimizer the compiled step has no fused update for (Adadelta, Adagrad, RMSprop, ...) runs
the same step eagerly (EagerStep): the same scale, skip and scale-update rules, said once at
WARNING with the reason.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree
from typing_extensions import override

from mixprec.core.compiled_step import CompiledStep, CompileStepError, compile_step
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import did_you_mean
from mixprec.paddle.static.program import (
    DTYPES,
    Program,
    Ref,
    default_main_program,
    default_startup_program,
)

COMPILE_OPTIONS: dict[str, Any] = {}
"""torch.compile options for every Executor's step (tests pass backend="eager": dynamo only)."""


@dataclass(frozen=True)
class CPUPlace:
    """paddle.CPUPlace()."""

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


@dataclass(frozen=True)
class CUDAPlace:
    """paddle.CUDAPlace(i): GPU i."""

    device_id: int = 0

    def __post_init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"CUDAPlace({self.device_id}): no CUDA device is visible to torch here; use "
                "CPUPlace()."
            )
        if not 0 <= self.device_id < torch.cuda.device_count():
            raise ValueError(
                f"CUDAPlace({self.device_id}): valid ids are 0..{torch.cuda.device_count() - 1}."
            )

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.device_id)


def _loss_is_output(out: torch.Tensor, target: Any) -> torch.Tensor:
    return out  # the program computes its loss itself: it is the replay's output


class ProgramModule(nn.Module):
    """A recorded program replayed on fed tensors; each op's floating inputs cast to casts[i]
    (None: as recorded, under autocast_dtype's torch.autocast when that is set; "promote":
    fp32 when any floating input is fp32, else as they come)."""

    def __init__(
        self,
        program: Program,
        loss_id: int,
        casts: list[torch.dtype | str | None],
        autocast_dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        for i, p in enumerate(program.params):
            self.register_parameter(f"param_{i}", p)  # the live parameter: shared, not copied
        for i, c in enumerate(program.consts):
            self.register_buffer(f"const_{i}", c)
        self.program, self.loss_id, self.casts = program, loss_id, casts
        self.autocast_dtype = autocast_dtype
        self.feed_ids = [v.var_id for v in program.placeholders.values()]

    def _leaf(self, leaf: Any, env: dict[int, torch.Tensor]) -> Any:
        if not isinstance(leaf, Ref):
            return leaf
        if leaf.kind == "var":
            return env[leaf.index]
        return getattr(self, f"{leaf.kind}_{leaf.index}")

    @override
    def forward(self, *feeds: torch.Tensor) -> torch.Tensor:
        device_type = feeds[0].device.type if feeds else "cpu"
        env = dict(zip(self.feed_ids, feeds, strict=True))
        outer = contextlib.nullcontext()
        if self.autocast_dtype is not None:
            outer = torch.autocast(device_type, dtype=self.autocast_dtype)
        with outer:
            for op, cast in zip(self.program.ops, self.casts, strict=True):
                leaves = [self._leaf(leaf, env) for leaf in op.leaves]
                if cast == PROMOTE:  # Paddle's use_promote: the widest floating input decides
                    floating = [t.dtype for t in leaves if _is_floating(t)]
                    cast = torch.float32 if torch.float32 in floating else None
                if cast is not None:
                    leaves = [
                        t.to(cast) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                        for t in leaves
                    ]
                args, kwargs = pytree.tree_unflatten(leaves, op.treedef)
                if cast is not None and self.autocast_dtype is not None:
                    with torch.autocast(device_type, enabled=False):  # the cast decides
                        out = op.func(*args, **kwargs)
                else:
                    out = op.func(*args, **kwargs)
                tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
                env.update(zip(op.outputs, tensors, strict=True))
        return env[self.loss_id]


PROMOTE = "promote"
"""The cast of an op that runs in fp32 when any floating input is fp32 (Paddle's use_promote)."""


def _is_floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


log = logging.getLogger("mixprec")
_SAID_EAGER: set[str] = set()  # optimizer types whose eager step was already reported


class EagerStep:
    """A program's training step run eagerly, for an optimizer compile_step cannot run: the
    same sequence as the compiled step, through the scaler's own methods. Forward, backward of
    the scaled loss, scaler.step (unscale, one finite check; a non-finite step is not taken, so
    parameters, masters and optimizer state stay as they were), scaler.update (the scaler's
    rule), then the gradients are freed. Without a scaler the optimizer runs inside a
    MixedPrecisionOptimizer of unit scale, which skips a non-finite step the same way."""

    def __init__(
        self, module: ProgramModule, optimizer: torch.optim.Optimizer, scaler: Any
    ) -> None:
        self.module, self.scaler = module, scaler
        if not isinstance(optimizer, MixedPrecisionOptimizer):
            optimizer = MixedPrecisionOptimizer(optimizer)  # unit scale: skips inf/nan only
        self.optimizer = optimizer

    def __call__(self, *feeds: torch.Tensor, target: Any = None) -> torch.Tensor:
        loss = self.module(*feeds)
        if self.scaler is None:
            loss.backward()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)  # each run's gradients are its own
        return loss.detach()


def build_step(
    program: Program,
    loss_id: int,
    optimizer: torch.optim.Optimizer,
    casts: list[torch.dtype | str | None],
    autocast_dtype: torch.dtype | None,
    scaler: Any = None,
) -> CompiledStep | EagerStep:
    """The program's training step: compiled, or eager (EagerStep) for an optimizer the
    compiled step refuses; scaler: the loss scale's owner (a mixprec.paddle.GradScaler, whose
    rule advances it) or None."""
    module = ProgramModule(program, loss_id, casts, autocast_dtype)
    try:
        return compile_step(module, optimizer, _loss_is_output, scaler=scaler, **COMPILE_OPTIONS)
    except CompileStepError as exc:
        inner = optimizer.optim if isinstance(optimizer, MixedPrecisionOptimizer) else optimizer
        name = type(inner).__name__
        if name not in _SAID_EAGER:
            _SAID_EAGER.add(name)
            log.warning(
                "mixprec.paddle.static: %s runs its update eagerly, with the same loss-scale "
                "and skip rules (%s).",
                name,
                exc,
            )
        return EagerStep(module, optimizer, scaler)


class Executor:
    """paddle.static.Executor(place): runs the startup program (places the parameters) and the
    main program (one compiled training step per run)."""

    def __init__(self, place: CPUPlace | CUDAPlace | None = None) -> None:
        if place is not None and not isinstance(place, CPUPlace | CUDAPlace):
            raise TypeError(f"Executor(place={place!r}): pass CPUPlace() or CUDAPlace(i).")
        self.place = place or CPUPlace()

    def run(
        self,
        program: Program | None = None,
        feed: dict[str, Any] | None = None,
        fetch_list: list[Any] | None = None,
        use_program_cache: bool = False,
        return_numpy: bool = True,
    ) -> list[Any]:
        """Run program; returns the fetched variables (numpy arrays when return_numpy)."""
        program = default_main_program() if program is None else program
        if not isinstance(program, Program):
            raise TypeError(f"Executor.run(program={program!r}): pass a Program.")
        if not isinstance(use_program_cache, bool):
            raise TypeError(f"use_program_cache={use_program_cache!r} must be a bool.")
        if program is default_startup_program():
            self._place_parameters(default_main_program())
            return []
        if program.minimized is None:
            raise RuntimeError(
                "Executor.run(main_program) before optimizer.minimize(loss): the program has no "
                "training step yet. Call minimize on the loss you recorded first."
            )
        step = program.minimized.step_for(program)
        feeds = self._feeds(program, feed or {})
        fetch_ids = [program.var_of(item) for item in fetch_list or []]
        loss_name = program.var_names[program.minimized.loss_id]
        for item, var_id in zip(fetch_list or [], fetch_ids, strict=True):
            if var_id != program.minimized.loss_id:
                raise ValueError(
                    f"fetch_list item {item!r}: the compiled step returns the loss only; "
                    f"fetch {loss_name!r}."
                )
        loss = step(*feeds, target=None)
        # Paddle 3 fetches a variable in its own shape: 0-d for a mean loss (float() works)
        out = [loss.detach().reshape(program.minimized.loss_shape) for _ in fetch_ids]
        if not return_numpy:
            return out
        # numpy has no bfloat16: a bf16 loss comes back as float32 (exact widening)
        return [(t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy() for t in out]

    def _place_parameters(self, program: Program) -> None:
        device = self.place.device
        with torch.no_grad():
            for p in program.params:
                if p.device != device:
                    p.data = p.data.to(device)

    def _feeds(self, program: Program, feed: dict[str, Any]) -> list[torch.Tensor]:
        if not isinstance(feed, dict):
            raise TypeError(f"feed must be a dict {{name: array}}, got {type(feed).__name__}.")
        valid = list(program.placeholders)
        for name in feed:
            if name not in program.placeholders:
                raise ValueError(
                    f"feed name {name!r} is not a data() of this program."
                    + did_you_mean(name, valid)
                )
        missing = [n for n in valid if n not in feed]
        if missing:
            raise ValueError(f"feed lacks {missing}: the program's data() are {valid}.")
        out = []
        for name, var in program.placeholders.items():
            value = feed[name]
            tensor = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"feed[{name!r}] must be a numpy array or tensor, got {value!r}.")
            declared = var.declared_shape
            shape_ok = len(tensor.shape) == len(declared) and all(
                d in (None, -1) or d == s for d, s in zip(declared, tensor.shape, strict=True)
            )
            if not shape_ok:
                raise ValueError(
                    f"feed[{name!r}] has shape {list(tensor.shape)}; data() declared "
                    f"{list(declared)} (-1/None: any size)."
                )
            if tensor.dtype != var.dtype:
                names = {v: k for k, v in DTYPES.items()}
                raise ValueError(
                    f"feed[{name!r}] has dtype {names.get(tensor.dtype, tensor.dtype)}; data() "
                    f"declared {names[var.dtype]}."
                )
            out.append(tensor.to(self.place.device))
        return out
