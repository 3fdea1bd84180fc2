"""paddle.amp.debugging on mixprec.debugging: operator stats, check_numerics, the tensor checker.

    from mixprec.paddle import debugging

    debugging.enable_operator_stats_collection()      # count ops by dtype until ...
    ...
    debugging.disable_operator_stats_collection()     # ... this prints the table

    config = debugging.TensorCheckerConfig(enable=True, debug_mode=debugging.DebugMode.CHECK_NAN_INF)
    debugging.enable_tensor_checker(config)           # every op's output checked for inf/nan
    ...
    debugging.disable_tensor_checker()

    class Net(nn.Module):
        @debugging.check_layer_numerics               # its inputs and forward's ops checked
        def forward(self, x): ...

Op names are aten's as the dispatcher runs them ('addmm', 'mm'); Paddle's names in
checked_op_list / skipped_op_list are mapped to torch ops (mixprec.paddle.op_names).
Every check reads values back to the host: a debugging tool, slow by design.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from typing_extensions import override

from mixprec.debugging import OperatorStats
from mixprec.debugging import collect_operator_stats as _collect
from mixprec.debugging.op_stats import op_to_name
from mixprec.paddle.accuracy_compare import DumpLine, compare_accuracy, worker_file_name
from mixprec.paddle.op_names import PADDLE_MEANING, REFUSED, TO_TORCH

log = logging.getLogger("mixprec")


class DebugMode(enum.Enum):
    """paddle.amp.debugging.DebugMode (Paddle's values)."""

    CHECK_NAN_INF_AND_ABORT = 0
    """Raise at the first inf/NaN."""
    CHECK_NAN_INF = 1
    """Report every inf/NaN, keep running."""
    CHECK_ALL_FOR_OVERFLOW = 2
    """Also report fp32 outputs beyond float16's range (they would overflow in fp16)."""
    CHECK_ALL = 3
    """Report every checked output's statistics."""


# ----- operator stats -----

_STATS: dict[str, Any] = {}  # the running collection: its context manager and stats


def enable_operator_stats_collection() -> None:
    """Start counting every op by output dtype (float32, float16, bfloat16, other)."""
    if "context" in _STATS:
        raise RuntimeError(
            "enable_operator_stats_collection() was already called: call "
            "disable_operator_stats_collection() first."
        )
    context = _collect()
    _STATS["stats"] = context.__enter__()
    _STATS["context"] = context


def disable_operator_stats_collection() -> OperatorStats | None:
    """Stop counting and print the table (as Paddle); returns the OperatorStats (mixprec's
    addition), None when no collection was running (Paddle: a no-op then)."""
    context = _STATS.pop("context", None)
    if context is None:
        return None
    context.__exit__(None, None, None)
    stats = _STATS.pop("stats")
    print(stats.table())
    return stats


@contextlib.contextmanager
def collect_operator_stats_and_print() -> Iterator[OperatorStats]:
    """paddle.amp.debugging.collect_operator_stats: the table is printed when the block ends."""
    with _collect(print_on_exit=True) as stats:
        yield stats


# ----- check_numerics -----


def _numerics(
    tensor: torch.Tensor,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """On the device: [num_nan, num_inf, num_zero] and [max, min, mean] in fp32, max and min
    skipping NaNs (as Paddle's), mean the plain mean. check_numerics and the checker share it."""
    flat = tensor.detach().float().reshape(-1)
    nan = torch.isnan(flat)
    counts = [nan.sum(), torch.isinf(flat).sum(), (flat == 0).sum()]
    finite_or_inf = flat[~nan]
    if finite_or_inf.numel():
        high, low = finite_or_inf.amax(), finite_or_inf.amin()
    else:
        high = low = flat.new_tensor(float("nan"))
    return counts, [high, low, flat.mean()]


def check_numerics(
    tensor: torch.Tensor,
    op_type: str,
    var_name: str,
    debug_mode: DebugMode = DebugMode.CHECK_NAN_INF_AND_ABORT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Count a tensor's NaNs, infs and zeros; (stats int64 [3], values [max, min, mean] fp32).

    max and min skip NaNs (as Paddle's); mean is the plain mean. With CHECK_NAN_INF_AND_ABORT
    an inf/NaN raises RuntimeError naming op_type and var_name; otherwise it is logged.
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise TypeError(f"check_numerics needs a floating tensor, got {tensor!r}.")
    if not isinstance(debug_mode, DebugMode):
        raise TypeError(f"debug_mode={debug_mode!r} must be a DebugMode.")
    counts, values = _numerics(tensor)
    stats = torch.stack(counts).to(torch.int64)
    values = torch.stack(values)
    num_nan, num_inf, num_zero = stats.tolist()  # the host sync this check is for
    if num_nan or num_inf:
        message = (
            f"There are NAN or INF (num_nan={num_nan}, num_inf={num_inf}, num_zero={num_zero}) "
            f"in [device={tensor.device}, op={op_type}, tensor={var_name}, "
            f"dtype={str(tensor.dtype).removeprefix('torch.')}]."
        )
        if debug_mode is DebugMode.CHECK_NAN_INF_AND_ABORT:
            raise RuntimeError(message)
        log.warning("mixprec.paddle.check_numerics: %s", message)
    return stats, values


# ----- the tensor checker -----


class TensorCheckerConfig:
    """paddle.amp.debugging.TensorCheckerConfig.

    enable: check at all. debug_mode: a DebugMode. output_dir: a directory to write the
    reported outputs to, one Paddle dump line each in worker_<device> (what compare_accuracy
    pairs; CHECK_ALL reports every output), else they are logged. checked_op_list /
    skipped_op_list: op names (torch's or Paddle's) to check only / never. debug_step: [start,
    end): check only the steps (calls of enable_tensor_checker) in that range.
    stack_height_limit: how many Python stack frames (innermost last, mixprec's own frames
    left out) each reported line carries; 0 for none (Paddle prints its C++ stack instead).
    """

    def __init__(
        self,
        enable: bool,
        debug_mode: DebugMode = DebugMode.CHECK_NAN_INF_AND_ABORT,
        output_dir: str | None = None,
        checked_op_list: Sequence[str] | None = None,
        skipped_op_list: Sequence[str] | None = None,
        debug_step: Sequence[int] | None = None,
        stack_height_limit: int = 1,
    ) -> None:
        if not isinstance(enable, bool):
            raise TypeError(f"enable={enable!r} must be a bool.")
        if not isinstance(debug_mode, DebugMode):
            raise TypeError(f"debug_mode={debug_mode!r} must be a DebugMode.")
        if debug_step is not None and not (
            len(debug_step) == 2
            and all(isinstance(s, int) for s in debug_step)
            and 0 <= debug_step[0] < debug_step[1]
        ):
            raise ValueError(
                f"debug_step={debug_step!r} must be [start, end) with 0 <= start < end."
            )
        if not isinstance(stack_height_limit, int) or stack_height_limit < 0:
            raise TypeError(f"stack_height_limit={stack_height_limit!r} must be an int >= 0.")
        self.enable, self.debug_mode, self.output_dir = enable, debug_mode, output_dir
        self.checked_op_list = _aten_names(checked_op_list)
        self.skipped_op_list = _aten_names(skipped_op_list)
        self.debug_step = tuple(debug_step) if debug_step is not None else None
        self.stack_height_limit = stack_height_limit
        self.current_step_id = 0
        self.records: list[TensorCheckRecord] = []
        """Every inf/NaN (and, in the CHECK_ALL modes, every reported output) seen."""

    def update_and_check_step_id(self) -> bool:
        """Count one step; True when this step is to be checked."""
        step = self.current_step_id
        self.current_step_id += 1
        if not self.enable:
            return False
        return self.debug_step is None or self.debug_step[0] <= step < self.debug_step[1]

    def wants(self, op: str) -> bool:
        if self.checked_op_list and op not in self.checked_op_list:
            return False
        return op not in self.skipped_op_list


def _aten_names(names: Sequence[str] | None) -> frozenset[str]:
    """Op names to match what the dispatcher runs: Paddle's are mapped to torch's."""
    if names is None:
        return frozenset()
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"An op list is a list of op names, got {names!r}.")
    out: set[str] = set()
    for name in names:
        if name in REFUSED:
            raise ValueError(f"Paddle op {name!r} cannot be checked by name: {REFUSED[name]}.")
        out.update((name,) if name in PADDLE_MEANING else TO_TORCH.get(name, (name,)))
    return frozenset(out)


@dataclass(frozen=True)
class TensorCheckRecord:
    """One checked op output the tensor checker reported."""

    step: int
    op: str
    output: int
    """Index of the tensor among the op's outputs."""
    kind: str
    """'nan', 'inf', 'overflow' (beyond float16's range) or 'ok' (CHECK_ALL)."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    max_abs: float
    stack: tuple[str, ...] = ()
    """The innermost user frames ('file:line in function'), as many as stack_height_limit."""
    grad_of: str | None = None
    """In the backward: the autograd node that ran the op ('AddmmBackward0'); None forward."""
    device: str = "cpu"
    num_nan: int = 0
    num_inf: int = 0
    num_zero: int = 0
    max: float = 0.0
    min: float = 0.0
    """max and min skip NaNs (as Paddle's)."""
    mean: float = 0.0

    def describe(self) -> str:
        where = f" at {' <- '.join(reversed(self.stack))}" if self.stack else ""
        grad = f" in the backward of {self.grad_of}" if self.grad_of else ""
        return (
            f"[step {self.step}] {self.kind} in output {self.output} of op {self.op} "
            f"({str(self.dtype).removeprefix('torch.')}, shape {list(self.shape)}, "
            f"max |x| {self.max_abs:g}){grad}{where}"
        )

    def dump_line(self) -> str:
        """The line Paddle's tensor checker writes to output_dir, which compare_accuracy reads."""
        tensor = f"{self.grad_of}.out{self.output}@GRAD" if self.grad_of else f"out{self.output}"
        return DumpLine(
            device=self.device,
            op=self.op,
            tensor=tensor,
            dtype=self.dtype,
            shape=self.shape,
            num_nan=self.num_nan,
            num_inf=self.num_inf,
            num_zero=self.num_zero,
            max=self.max,
            min=self.min,
            mean=self.mean,
            step=self.step,
        ).format()


def _user_frames(limit: int) -> tuple[str, ...]:
    """The innermost `limit` stack frames outside torch and this module."""
    if limit == 0:
        return ()
    frames = [
        f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"
        for f in traceback.extract_stack()
        if f.filename != __file__ and f"{os.sep}torch{os.sep}" not in f.filename
    ]
    return tuple(frames[-limit:])


class TensorCheckerError(FloatingPointError):
    """Raised in CHECK_NAN_INF_AND_ABORT mode at the first op that outputs an inf/NaN."""

    def __init__(self, record: TensorCheckRecord) -> None:
        super().__init__("Non-finite value: " + record.describe())
        self.record = record


_FP16_MAX = torch.finfo(torch.float16).max


class _CheckingMode(TorchDispatchMode):
    def __init__(self, config: TensorCheckerConfig, step: int) -> None:
        super().__init__()
        self.config, self.step = config, step

    @override
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        op = op_to_name(func)
        if self.config.wants(op):
            for index, t in enumerate(tree_leaves(out)):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                    self._check(op, index, t)
        return out

    def _check(self, op: str, index: int, t: torch.Tensor) -> None:
        mode = self.config.debug_mode
        counts, values = _numerics(t)
        max_abs = t.detach().abs().float().nan_to_num(nan=0.0).amax()
        # the host sync: one per checked output
        num_nan, num_inf, num_zero, high, low, mean, max_abs = torch.stack(
            [c.float() for c in counts] + values + [max_abs]
        ).tolist()
        kind = "nan" if num_nan else "inf" if num_inf else None
        if kind is None:
            if mode is DebugMode.CHECK_ALL_FOR_OVERFLOW and t.dtype == torch.float32:
                kind = "overflow" if max_abs > _FP16_MAX else None
            elif mode is DebugMode.CHECK_ALL:
                kind = "overflow" if t.dtype == torch.float32 and max_abs > _FP16_MAX else "ok"
        if kind is None:
            return
        node = torch._C._current_autograd_node()  # set while backward runs this op
        record = TensorCheckRecord(
            self.step,
            op,
            index,
            kind,
            t.dtype,
            tuple(t.shape),
            max_abs,
            _user_frames(self.config.stack_height_limit),
            grad_of=node.name() if node is not None else None,
            device=str(t.device),
            num_nan=int(num_nan),
            num_inf=int(num_inf),
            num_zero=int(num_zero),
            max=high,
            min=low,
            mean=mean,
        )
        self.config.records.append(record)
        _report(self.config, record)
        if mode is DebugMode.CHECK_NAN_INF_AND_ABORT:
            raise TensorCheckerError(record)


def _report(config: TensorCheckerConfig, record: TensorCheckRecord) -> None:
    """To output_dir: Paddle's dump line in worker_<device> (what compare_accuracy reads);
    else a WARNING (not in CHECK_NAN_INF_AND_ABORT mode, whose error carries the record)."""
    if config.output_dir is None:
        if config.debug_mode is not DebugMode.CHECK_NAN_INF_AND_ABORT:
            log.warning("mixprec.paddle tensor checker: %s", record.describe())
        return
    os.makedirs(config.output_dir, exist_ok=True)
    with open(os.path.join(config.output_dir, worker_file_name(record.device)), "a") as f:
        f.write(record.dump_line() + "\n")


_CHECKER: dict[str, _CheckingMode] = {}


def enable_tensor_checker(checker_config: TensorCheckerConfig) -> None:
    """Count a step of checker_config; if that step is to be checked, check every op's
    floating outputs until disable_tensor_checker() (call both once per step, as Paddle)."""
    if not isinstance(checker_config, TensorCheckerConfig):
        raise TypeError(f"checker_config={checker_config!r} must be a TensorCheckerConfig.")
    if "mode" in _CHECKER:
        raise RuntimeError("enable_tensor_checker() twice: call disable_tensor_checker() first.")
    step = checker_config.current_step_id
    if checker_config.update_and_check_step_id():
        mode = _CheckingMode(checker_config, step)
        mode.__enter__()
        _CHECKER["mode"] = mode


def disable_tensor_checker() -> None:
    """Stop checking (a no-op when nothing is being checked, as Paddle)."""
    mode = _CHECKER.pop("mode", None)
    if mode is not None:
        mode.__exit__(None, None, None)


# ----- check_layer_numerics -----


def _check_grads(mode: _CheckingMode, where: str, tensors: Sequence[Any]) -> None:
    """Check the gradients of these tensors (those that take one) when backward reaches them."""
    for index, t in enumerate(tensors):
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
            t.register_hook(functools.partial(_check_grad, mode, where, index))


def _check_grad(mode: _CheckingMode, where: str, index: int, grad: torch.Tensor) -> None:
    if grad.numel():
        mode._check(where, index, grad)


def check_layer_numerics(func: Callable[..., Any]) -> Callable[..., Any]:
    """paddle.amp.debugging.check_layer_numerics: decorate a Layer's (nn.Module's) forward so
    its floating tensor inputs and every op the forward runs are checked for inf/NaN; the
    first one raises TensorCheckerError naming the op (or the input), as Paddle's aborts. In
    the backward the gradients at the layer's edges are checked: those reaching its outputs and
    those it gives its inputs (the ones that require grad).

    As Paddle, the forward must be called with at least one positional argument, the first a
    tensor (RuntimeError otherwise). Paddle checks each of the backward's grad ops; here the
    op inside the layer that made a bad gradient is not named (NonFiniteLocator narrows it to
    a module). Paddle marks the first input stop_gradient=False so its gradient is checked;
    torch leaves the caller's tensor as it is.
    """
    if not callable(func):
        raise TypeError(f"check_layer_numerics decorates a forward method, got {func!r}.")

    @functools.wraps(func)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not args:
            raise RuntimeError(
                f"{type(self).__name__}.forward decorated with check_layer_numerics was called "
                "with no positional argument: pass the input tensor first (as Paddle)."
            )
        if not isinstance(args[0], torch.Tensor):
            raise RuntimeError(
                f"{type(self).__name__}.forward: the first input of a layer under "
                f"check_layer_numerics must be a tensor, got {type(args[0]).__name__}."
            )
        config = TensorCheckerConfig(enable=True, stack_height_limit=1)
        mode = _CheckingMode(config, step=0)
        name = type(self).__name__
        inputs = [
            t
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
        ]
        for index, t in enumerate(inputs):
            mode._check(f"{name}.forward's inputs", index, t)
        with mode:
            out = func(self, *args, **kwargs)
        # the backward at the layer's edges: the gradient coming in, the ones going out
        _check_grads(mode, f"{name}.forward's output grads", tree_leaves(out))
        _check_grads(mode, f"{name}.forward's input grads", inputs)
        return out

    return wrapper


collect_operator_stats = collect_operator_stats_and_print
"""Paddle's name: a context manager counting ops by dtype, printing the table when it ends."""

__all__ = [
    "DebugMode",
    "TensorCheckRecord",
    "TensorCheckerConfig",
    "TensorCheckerError",
    "check_layer_numerics",
    "check_numerics",
    "collect_operator_stats",
    "compare_accuracy",
    "disable_operator_stats_collection",
    "disable_tensor_checker",
    "enable_operator_stats_collection",
    "enable_tensor_checker",
]
