"""torch.autocast with custom op lists, and fp32 / low-precision regions.

PyTorch's autocast op lists are fixed in C++. `autocast` adds a runtime layer over it: ops in
`custom_white_list` run in the low dtype, ops in `custom_black_list` run in fp32, every other op
runs as torch.autocast decides. The layer is a `torch.overrides.TorchFunctionMode` that sees
each public torch call (torch.X, torch.nn.functional.X, torch.Tensor.X and the operators), casts
the op's floating inputs and runs it with torch's autocast off, so torch cannot re-cast them.

Naming ops: a plain name ("softmax", "add", "layer_norm", "matmul"), a torch callable
(torch.softmax, F.layer_norm, torch.Tensor.add, torch.matmul), or a torch synonym (ALIASES,
e.g. "subtract" -> "sub"). Every name is normalised to one plain torch name; a name stands for
all its spellings: "add" is torch.add, torch.Tensor.add, `a + b` and `1 + a`; "sub" is
torch.sub and torch.subtract. A peer's op names (Paddle's "elementwise_add") are its face's to
translate (mixprec.paddle.auto_cast takes them). In-place ops (add_, `a += b`) cannot be
listed: their result keeps self's dtype whatever the inputs are.

Nesting: an inner `autocast` starts from the enclosing one's lists; its white list adds ops to
the low set and takes them out of the fp32 set, its black list does the reverse; its dtype and
device_type apply inside it. Leaving it restores the outer lists, dtype and torch's state.

Regions:
- `fp32_region()` turns torch's autocast off and suspends the op lists. Like
  torch.autocast(enabled=False), it does not cast tensors that are already fp16/bf16; the
  decorator `@fp32` does: it casts the function's (or module's forward's) fp16/bf16 tensor
  arguments to fp32 on entry and runs the body in an fp32_region.
- `low_precision_region(dtype=None)` (Paddle's `fp16_guard`) turns autocast back on, in dtype,
  else the enclosing mixprec autocast's dtype, else float16, with the enclosing op lists;
  `@low_precision` is its decorator.

Autograd and compile: casts are recorded by autograd, so gradients reach parameters in their
own dtype. Call backward outside the region, as torch.autocast advises: the mode does not see
backward kernels, and torch's autocast would re-cast them. Under torch.compile, a context
entered outside the compiled code is traced (fullgraph works), and so is one built and entered
inside it, and every decorated function, class and module: a region is a generator of plain
`with` statements, its lists constants dynamo embeds. One exception: a context object built
outside compiled code and entered inside it (`with self.ctx:`), which dynamo cannot enter
(torch 2.13): build it where you enter it.

Limits: ops called inside torch's own Python-level composites (e.g. the softmax inside
F.multi_head_attention_forward) are not seen one by one, only the composite. The Python hook
costs about 1 us per unlisted torch call and 10 us per listed one (2-core CPU, two small casts),
and is only installed while a list is non-empty.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, get_overridable_functions
from typing_extensions import override

from mixprec.core.policy import did_you_mean, to_low_dtype

T = TypeVar("T")

ALIASES: dict[str, str] = {
    # torch's own synonyms: one op, several spellings.
    "subtract": "sub",
    "multiply": "mul",
    "divide": "div",
    "true_divide": "div",
    "absolute": "abs",
    "negative": "neg",
    "clip": "clamp",
}
"""torch's other spellings -> the plain torch name they are normalised to. A face whose peer
names ops otherwise (Paddle's "elementwise_add") translates them before handing a list in
(mixprec.paddle.op_names)."""

OPERATOR_DUNDERS: dict[str, str] = {
    "__add__": "add",
    "__radd__": "add",
    "__sub__": "sub",
    "__rsub__": "sub",
    "__mul__": "mul",
    "__rmul__": "mul",
    "__truediv__": "div",
    "__rtruediv__": "div",
    "__div__": "div",
    "__rdiv__": "div",
    "__matmul__": "matmul",
    "__rmatmul__": "matmul",
    "__pow__": "pow",
    "__rpow__": "pow",
    "__floordiv__": "floor_divide",
    "__rfloordiv__": "floor_divide",
    "__mod__": "remainder",
    "__rmod__": "remainder",
    "__neg__": "neg",
    "__abs__": "abs",
}
"""torch.Tensor operator methods -> the op they compute."""

COMMON_OPS: tuple[str, ...] = (
    # torch's autocast lists (low-precision, fp32 and promote), then common elementwise ops:
    # the vocabulary error messages suggest from; any other torch op name is accepted too.
    *("addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "conv1d"),
    *("conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
    *("linear", "matmul", "mm", "mv", "prelu", "einsum", "scaled_dot_product_attention"),
    *("acos", "asin", "cosh", "sinh", "tan", "exp", "expm1", "log", "log10", "log1p", "log2"),
    *("erfinv", "reciprocal", "rsqrt", "pow", "cumprod", "cumsum", "prod", "sum", "mean"),
    *("norm", "normalize", "dist", "cdist", "pdist", "renorm", "softmax", "softmin"),
    *("log_softmax", "softplus", "layer_norm", "group_norm", "batch_norm", "instance_norm"),
    *("binary_cross_entropy_with_logits", "cross_entropy", "nll_loss", "kl_div", "l1_loss"),
    *("mse_loss", "smooth_l1_loss", "cosine_similarity", "cosine_embedding_loss"),
    *("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "tensordot", "cat", "stack"),
    *("add", "sub", "mul", "div", "neg", "abs", "sqrt", "square", "maximum", "minimum"),
    *("clamp", "where", "relu", "gelu", "silu", "tanh", "sigmoid", "dropout", "embedding"),
    *("var", "std", "amax", "amin", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d"),
)
"""Op names error messages offer as close matches (torch's documented autocast lists + more)."""

_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)  # fp64 is never cast, as in torch
_LOW = (torch.float16, torch.bfloat16)
_FP32_MARK = "_mixprec_fp32"


def default_device_type() -> str:
    """'cuda' when a GPU is visible, else 'cpu': the device an autocast without one covers."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.cache
def _op_table() -> dict[str, frozenset[Callable]]:
    """Plain op name -> every public callable the TorchFunctionMode sees for it."""
    namespaces = get_overridable_functions()
    groups: dict[str, set[Callable]] = {}
    for ns in (torch, torch.functional, nn.functional, torch.Tensor, torch.linalg, torch.fft):
        for fn in namespaces.get(ns, ()):
            name = getattr(fn, "__name__", "")
            name = OPERATOR_DUNDERS.get(name, name)
            if name.startswith("_") or name.endswith("_"):  # private, dunder or in-place
                continue
            groups.setdefault(ALIASES.get(name, name), set()).add(fn)
    for ns in (torch.special,):  # their __name__ is already prefixed: special_erf, ...
        for fn in namespaces.get(ns, ()):
            groups.setdefault(fn.__name__, set()).add(fn)
    return {name: frozenset(fns) for name, fns in groups.items()}


def _unknown_op(shown: object, why: str = "") -> ValueError:
    pool = sorted(set(COMMON_OPS) | set(ALIASES))
    tail = (
        " Any other public op of torch, torch.nn.functional, torch.linalg, torch.fft or"
        " torch.special, or torch.Tensor method, is accepted by its name."
    )
    return ValueError(
        f"Unknown op {shown!r} in a custom op list.{why}" + did_you_mean(shown, pool) + tail
    )


def _inplace_base(name: str) -> str | None:
    """'add_' / '__iadd__' -> 'add' when that op exists; None for other names."""
    if name.startswith("__i") and name.endswith("__"):
        base = OPERATOR_DUNDERS.get("__" + name[3:])
    elif name.endswith("_") and not name.endswith("__"):
        base = name.rstrip("_")
    else:
        return None
    base = ALIASES.get(base, base) if base else None
    return base if base in _op_table() else None


def _inplace_error(op: object, base: str) -> ValueError:
    return ValueError(
        f"In-place op {op!r} cannot be listed: its result keeps self's dtype. List {base!r}."
    )


def _resolve_op(op: str | Callable) -> str:
    if isinstance(op, str):
        name = ALIASES.get(op, OPERATOR_DUNDERS.get(op, op))
        if name in _op_table():
            return name
        base = _inplace_base(op)
        if base is not None:
            raise _inplace_error(op, base)
        raise _unknown_op(op)
    if callable(op):
        name = _op_name(op)
        try:
            if op in _op_table().get(name, ()):
                return name
        except TypeError:  # an unhashable callable is no torch op
            pass
        name = getattr(op, "__name__", repr(op))
        if isinstance(op, type) and issubclass(op, nn.Module):
            raise _unknown_op(name, " A module class is not an op; list the function it calls.")
        base = _inplace_base(name)
        if base is not None:
            raise _inplace_error(op, base)
        raise _unknown_op(name, f" {op!r} is not a public torch op.")
    raise TypeError(f"An op is a name (str) or a torch callable, got {op!r} ({type(op).__name__}).")


def resolve_ops(names: Iterable[str | Callable] | None) -> frozenset[str]:
    """Validate a custom op list and normalise it to plain torch op names.

    names: op names ("softmax", torch synonyms "subtract"), or torch callables
    (torch.softmax, F.layer_norm, torch.Tensor.add); None means no ops.
    """
    if names is None:
        return frozenset()
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(
            f"A custom op list is a list/set/tuple of op names or callables, got {names!r}; "
            f"wrap a single op: [{names!r}]."
        )
    return frozenset(_resolved(tuple(names)))


@torch.compiler.assume_constant_result  # bookkeeping on constants: run at trace time, baked in
def _resolved(ops: tuple[str | Callable, ...]) -> tuple[str, ...]:
    """The op names of ops (a tuple of str: a constant dynamo can embed in a graph)."""
    return tuple(sorted({_resolve_op(op) for op in ops}))


def _check_lists(white: frozenset[str], black: frozenset[str]) -> None:
    overlap = white & black
    if overlap:
        raise ValueError(
            f"Ops {sorted(overlap)} are in both custom_white_list and custom_black_list."
        )


def _cast_floating(obj: Any, dtype: torch.dtype, device_type: str | None) -> Any:
    """Cast fp32/fp16/bf16 tensors in obj (through lists/tuples) on device_type to dtype."""
    if isinstance(obj, torch.Tensor):
        if (
            obj.dtype != dtype
            and obj.dtype in _CASTABLE
            and (device_type is None or obj.device.type == device_type)
        ):
            return obj.to(dtype)
        return obj
    if type(obj) in (list, tuple):
        cast = [_cast_floating(v, dtype, device_type) for v in obj]
        return obj if all(c is v for c, v in zip(cast, obj, strict=True)) else type(obj)(cast)
    return obj


def _low_to_fp32(obj: Any) -> Any:
    """fp16/bf16 tensors in obj (through lists, tuples, dicts) -> fp32; fp32/fp64 untouched."""
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in _LOW else obj
    if type(obj) in (list, tuple):
        return type(obj)(_low_to_fp32(v) for v in obj)
    if type(obj) is dict:
        return {k: _low_to_fp32(v) for k, v in obj.items()}
    return obj


def _op_name(func: Callable) -> str:
    """The plain op name of a torch callable: torch.add, Tensor.add and Tensor.__add__ -> 'add'.

    For every callable of _op_table() it is that table's key, so a lookup by name matches
    exactly the callables of a listed op; by name because dynamo can trace a str-keyed dict
    but cannot hash Tensor's slot wrappers (Tensor.__add__) as dict keys.
    """
    name = getattr(func, "__name__", "")
    name = OPERATOR_DUNDERS.get(name, name)
    return ALIASES.get(name, name)


class _OpListMode(TorchFunctionMode):
    """Runs listed ops with their floating inputs cast to the list's dtype and autocast off."""

    def __init__(self, region: _Region) -> None:
        super().__init__()
        self.op_dtypes = {op: torch.float32 for op in region.hp_ops}
        self.op_dtypes.update({op: region.lp_dtype for op in region.lp_ops})
        self.device_type = region.device_type
        self.shadowed = 0  # > 0 while an inner mixprec region decides instead

    @override
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtype = None if self.shadowed else self.op_dtypes.get(_op_name(func))
        if dtype is None:
            return func(*args, **kwargs)
        args = _cast_floating(args, dtype, self.device_type)
        kwargs = {
            k: v if k == "out" else _cast_floating(v, dtype, self.device_type)
            for k, v in kwargs.items()
        }
        # autocast off inside the op: torch's own lists would otherwise re-cast the inputs.
        if torch.compiler.is_compiling():  # dynamo traces the context manager, not the setter
            with torch.autocast(self.device_type, enabled=False):
                return func(*args, **kwargs)
        was_enabled = torch.is_autocast_enabled(self.device_type)
        torch.set_autocast_enabled(self.device_type, False)  # 6x cheaper than the context
        try:
            return func(*args, **kwargs)
        finally:
            torch.set_autocast_enabled(self.device_type, was_enabled)


@dataclass(frozen=True, kw_only=True)
class _Region:
    """The precision state inside one mixprec context (the top of a per-thread stack)."""

    device_type: str
    """Device whose autocast this region sets."""
    lp_dtype: torch.dtype
    """Low dtype of autocast and of white-listed ops."""
    enabled: bool
    """Autocast (and the op lists) on; False inside fp32 regions."""
    lp_ops: frozenset[str] = field(default_factory=frozenset)
    """Effective white list: ops forced to lp_dtype."""
    hp_ops: frozenset[str] = field(default_factory=frozenset)
    """Effective black list: ops forced to fp32."""


class _State(threading.local):
    def __init__(self) -> None:
        self.regions: list[_Region] = []
        self.active_mode: _OpListMode | None = None  # innermost installed op-list mode
        self.exits: list[tuple[int, contextlib.AbstractContextManager]] = []  # (owner, scope)


_STATE = _State()


def _outer_region(device_type: str | None) -> _Region:
    if _STATE.regions:
        outer = _STATE.regions[-1]
        return outer if device_type is None else replace(outer, device_type=device_type)
    return _Region(
        device_type=device_type or default_device_type(), lp_dtype=torch.float16, enabled=False
    )


@contextlib.contextmanager
def _region_scope(region: _Region) -> Iterator[None]:
    """Push region: set torch's autocast, shadow the outer op-list mode, install our own.

    Plain `with` statements in a generator, so dynamo traces a region entered inside a compiled
    forward (compile_step, torch.compile) instead of breaking the graph there.
    """
    outer_mode = _STATE.active_mode
    mode = None
    if region.enabled and (region.lp_ops or region.hp_ops):
        mode = _OpListMode(region)
    with torch.autocast(region.device_type, dtype=region.lp_dtype, enabled=region.enabled):
        if outer_mode is not None:
            outer_mode.shadowed += 1
        _STATE.regions.append(region)
        _STATE.active_mode = mode or outer_mode
        try:
            with mode or contextlib.nullcontext():
                yield
        finally:
            _STATE.active_mode = outer_mode
            _STATE.regions.pop()
            if outer_mode is not None:
                outer_mode.shadowed -= 1


@contextlib.contextmanager
def scopes_set_aside() -> Iterator[None]:
    """The caller's open region scopes set aside (their effect stays: autocast, op lists) while
    a compiled program runs: dynamo guards on what the program reads, and a region it enters
    reads this stack, whose entries are owned by objects built anew each call (the identity of
    the caller's auto_cast(...)): each call recompiled. Regions entered inside push and pop on
    an empty stack; the caller's come back on exit."""
    held, _STATE.exits = _STATE.exits, []
    try:
        yield
    finally:
        _STATE.exits = held


class _RegionContext(contextlib.ContextDecorator):
    """A context manager that pushes one _Region (re-entrant, per thread); also a decorator."""

    def _region(self) -> _Region:
        raise NotImplementedError

    def __enter__(self) -> _RegionContext:
        _push_scope(id(self), self._region())
        return self

    def __exit__(self, *exc: object) -> None:
        _pop_scope(id(self))

    @override
    def __call__(self, target: T) -> T:
        return _decorate(target, self, cast_to_fp32=False)


def _push_scope(owner: int, region: _Region) -> None:
    scope = _region_scope(region)
    scope.__enter__()
    _STATE.exits.append((owner, scope))


def _pop_scope(owner: int) -> None:
    if not _STATE.exits or _STATE.exits[-1][0] != owner:
        raise RuntimeError(
            "mixprec precision regions must be exited in the reverse order of entry."
        )
    _STATE.exits.pop()[1].__exit__(None, None, None)


class autocast(_RegionContext):  # noqa: N801 - mirrors torch.autocast
    """torch.autocast plus custom white/black op lists; a context manager and a decorator.

    dtype: the low dtype (torch.float16/bfloat16 or 'float16'/'bfloat16').
    custom_white_list: ops run in dtype (floating inputs cast down).
    custom_black_list: ops run in fp32 (floating inputs cast up, torch autocast off inside).
    enabled: False runs everything as if no autocast were active (lists suspended too).
    device_type: the device whose autocast is set; None is 'cuda' if torch.cuda.is_available()
    else 'cpu'. Tensors on other devices are never cast by the lists.
    """

    def __init__(
        self,
        dtype: torch.dtype | str = torch.float16,
        custom_white_list: Iterable[str | Callable] | None = None,
        custom_black_list: Iterable[str | Callable] | None = None,
        enabled: bool = True,
        device_type: str | None = None,
    ) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {enabled!r}.")
        self.dtype = to_low_dtype(dtype)
        self.custom_white_list = resolve_ops(custom_white_list)
        self.custom_black_list = resolve_ops(custom_black_list)
        _check_lists(self.custom_white_list, self.custom_black_list)
        self.enabled = enabled
        self.device_type = _check_device_type(device_type)
        # warn once per device and dtype where it cannot be fast (as Paddle does); not while
        # torch.compile traces a forward that builds this context
        if enabled and not torch.compiler.is_compiling():
            from mixprec.core.amp_warning import warn_if_amp_cannot_help

            warn_if_amp_cannot_help(self.dtype, self.device_type, type(self).__name__)

    @override
    def _region(self) -> _Region:
        outer = _outer_region(None)
        white, black = self.custom_white_list, self.custom_black_list
        return _Region(
            device_type=self.device_type,
            lp_dtype=self.dtype,
            enabled=self.enabled,
            lp_ops=(outer.lp_ops - black) | white,
            hp_ops=(outer.hp_ops - white) | black,
        )

    def __repr__(self) -> str:
        return (
            f"mixprec.autocast(dtype={self.dtype}, custom_white_list="
            f"{sorted(self.custom_white_list)}, custom_black_list={sorted(self.custom_black_list)}"
            f", enabled={self.enabled}, device_type={self.device_type!r})"
        )


_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "ipu", "maia")
# Asked once here, not per region: dynamo (torch 2.11) cannot trace the C call behind
# torch.amp.is_autocast_available, and fp32_region(device_type) runs inside compiled steps.
_AUTOCAST_AVAILABLE = {d: torch.amp.is_autocast_available(d) for d in _DEVICE_TYPES}


def _check_device_type(device_type: str | None) -> str:
    if device_type is None:
        return default_device_type()
    ok = _AUTOCAST_AVAILABLE.get(device_type) if isinstance(device_type, str) else False
    if ok is None:  # a device type outside the table (a backend registered later): ask torch
        try:  # torch raises RuntimeError on a string that names no device at all
            ok = torch.amp.is_autocast_available(device_type)
        except RuntimeError:
            ok = False
    if not ok:
        available = [d for d, on in _AUTOCAST_AVAILABLE.items() if on]
        raise ValueError(
            f"device_type={device_type!r} has no autocast here."
            + did_you_mean(device_type, available)
        )
    return device_type


class fp32_region(_RegionContext):  # noqa: N801 - used like a function: `with fp32_region():`
    """Autocast off and the op lists suspended: ops on fp32 tensors compute in fp32.

    Tensors that are already fp16/bf16 stay so (as under torch.autocast(enabled=False)); use
    the `@fp32` decorator to cast a function's or module's inputs up as well.
    device_type: None is the enclosing mixprec autocast's device, else the default device.
    """

    def __init__(self, device_type: str | None = None) -> None:
        self.device_type = None if device_type is None else _check_device_type(device_type)

    @override
    def _region(self) -> _Region:
        return replace(_outer_region(self.device_type), enabled=False)

    @override
    def __call__(self, target: T) -> T:
        return _decorate(target, self, cast_to_fp32=True)


class low_precision_region(_RegionContext):  # noqa: N801 - used like a function
    """Autocast on again inside an fp32 region (Paddle's fp16_guard), with the enclosing lists.

    dtype: None is the enclosing mixprec autocast's dtype, else float16.
    device_type: None is the enclosing mixprec autocast's device, else the default device.
    """

    def __init__(
        self, dtype: torch.dtype | str | None = None, device_type: str | None = None
    ) -> None:
        self.dtype = None if dtype is None else to_low_dtype(dtype)
        self.device_type = None if device_type is None else _check_device_type(device_type)

    @override
    def _region(self) -> _Region:
        outer = _outer_region(self.device_type)
        return replace(outer, enabled=True, lp_dtype=self.dtype or outer.lp_dtype)


fp16_guard = low_precision_region
"""Paddle's name for a low-precision region (paddle.static.amp.fp16_guard)."""


def _decorate(target: T, region: _RegionContext, *, cast_to_fp32: bool) -> T:
    """Run a function, an nn.Module class's forward or a module instance inside region."""
    if isinstance(target, nn.Module):
        target.register_forward_pre_hook(
            functools.partial(_enter_hook, region, cast_to_fp32), with_kwargs=True
        )
        target.register_forward_hook(_exit_hook, always_call=True)
        if cast_to_fp32:
            setattr(target, _FP32_MARK, True)
        return target
    if isinstance(target, type) and issubclass(target, nn.Module):
        target.forward = _wrap(target.forward, region, cast_to_fp32, skip_self=True)
        if cast_to_fp32:
            setattr(target, _FP32_MARK, True)
        return target
    if callable(target) and not isinstance(target, type):
        return _wrap(target, region, cast_to_fp32, skip_self=False)  # type: ignore[return-value]
    raise TypeError(
        f"Can only decorate a function, an nn.Module subclass or an nn.Module, got {target!r}."
    )


def _wrap(fn: Callable, region: _RegionContext, cast_to_fp32: bool, *, skip_self: bool) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if cast_to_fp32:
            head, rest = (args[:1], args[1:]) if skip_self else ((), args)
            args, kwargs = head + _low_to_fp32(rest), _low_to_fp32(kwargs)
        # not `with region:` — dynamo cannot enter a context object built outside the graph
        _push_scope(id(wrapper), region._region())
        try:
            return fn(*args, **kwargs)
        finally:
            _pop_scope(id(wrapper))

    return wrapper


def _enter_hook(
    region: _RegionContext, cast_to_fp32: bool, module: nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict] | None:
    _push_scope(id(module), region._region())
    if cast_to_fp32:
        return _low_to_fp32(args), _low_to_fp32(kwargs)
    return None


def _exit_hook(module: nn.Module, args: tuple, output: Any) -> None:
    # always_call hooks also run when an earlier pre-hook raised before ours pushed anything.
    if _STATE.exits and _STATE.exits[-1][0] == id(module):
        _pop_scope(id(module))


def fp32(target: T) -> T:
    """Decorator: run a function / module's forward in an fp32_region, fp16/bf16 args cast to fp32.

    target: a function, an nn.Module subclass (its forward is wrapped) or an nn.Module
    instance (forward hooks). Parameters are not cast: a face that casts the model to low
    precision keeps modules for which is_fp32_module() is True in fp32.
    """
    return fp32_region()(target)


def low_precision(
    target: T | None = None, *, dtype: torch.dtype | str | None = None
) -> T | Callable[[T], T]:
    """Decorator: run a function / module's forward in a low_precision_region(dtype).

    Usable bare (`@low_precision`) or with arguments (`@low_precision(dtype=torch.bfloat16)`).
    """
    if isinstance(target, torch.dtype | str):
        raise TypeError(f"Pass the dtype by keyword: @low_precision(dtype={target!r}).")
    region = low_precision_region(dtype)
    return region if target is None else region(target)


def is_fp32_module(module: nn.Module) -> bool:
    """True when module (or its class) was marked with @fp32: keep its parameters fp32."""
    return bool(getattr(module, _FP32_MARK, False))


def current_op_lists() -> tuple[frozenset[str], frozenset[str]]:
    """The (white, black) op lists in effect on this thread now; empty outside/fp32 regions."""
    if not _STATE.regions or not _STATE.regions[-1].enabled:
        return frozenset(), frozenset()
    return _STATE.regions[-1].lp_ops, _STATE.regions[-1].hp_ops
