"""Programs recorded from torch code: `data` placeholders, the ops called on them, scopes.

`data(name, shape, dtype)` returns a Variable: a torch.Tensor subclass over a meta tensor
(shape and dtype, no storage). Every torch op that takes a Variable (a module's forward,
a loss) runs on meta tensors for its output's shape and is recorded in the Variable's
Program, its parameters by reference, so the program replays later on fed arrays with the
live parameters (updated in place by the optimizer). Python control flow runs once, at
recording, as in Paddle's static graph: a branch on a value cannot be recorded.

A biased convolution is recorded as Paddle's Conv layers build it: the convolution, then the
bias's own add (the dygraph face's rule, dygraph.add_bias_apart), so the AMP decoration types
the add as Paddle types its elementwise_add: fp32 for an fp32 bias under O1, fp32 under OD,
low under O2 once amp_init cast the bias.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from typing_extensions import override

from mixprec.core.policy import did_you_mean
from mixprec.paddle.dygraph import add_bias_apart

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}
"""data(dtype=...) choices, by Paddle's names."""


@dataclass(frozen=True)
class Ref:
    """A leaf of a recorded op: a program Variable, a parameter, a constant tensor."""

    kind: str  # "var" | "param" | "const"
    index: int


@dataclass
class Op:
    """One recorded torch call: func, its flattened arguments and where its outputs go."""

    func: Any
    leaves: list[Any]
    treedef: Any
    outputs: list[int]
    """Variable ids of the tensor outputs, in flattening order."""
    out_treedef: Any
    guarded: bool
    """Recorded inside fp16_guard()."""


class Variable(torch.Tensor):
    """A static-graph placeholder or op output: shape and dtype only, plus Paddle's `name`."""

    program: Program
    var_id: int

    @staticmethod
    def __new__(cls, meta: torch.Tensor, program: Program, name: str) -> Variable:
        var = torch.Tensor._make_subclass(cls, meta)
        var.var_name, var.program = name, program
        var.var_id = program._new_var_id()
        return var

    @property
    @override
    def name(self) -> str:  # type: ignore[override]  # torch.Tensor.name is read-only
        """The variable's name in its program (data()'s name, or a generated one)."""
        return self.var_name

    @classmethod
    @override
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        program = next(leaf.program for leaf in leaves if isinstance(leaf, Variable))
        # a biased conv is recorded as Paddle's Conv layers build it: the conv, then the bias's
        # own add (the dygraph face's rule); the reshape of the bias is recorded too, so the
        # bias stays a parameter of the program
        split = add_bias_apart(func, args, kwargs, lambda *a: program.call(torch.reshape, a, {}))
        return program.call(func, args, kwargs) if split is None else split

    @override
    def __repr__(self) -> str:  # type: ignore[override]
        shape = list(self.shape)
        return f"Variable(name={self.name!r}, shape={shape}, dtype={str(self.dtype)[6:]})"


def _to_meta(leaf: Any) -> Any:
    if isinstance(leaf, Variable) or not isinstance(leaf, torch.Tensor):
        return leaf
    return leaf.detach().to("meta")


@dataclass
class Program:
    """Paddle's Program: the placeholders and ops recorded while it was the default."""

    placeholders: dict[str, Variable] = field(default_factory=dict)
    ops: list[Op] = field(default_factory=list)
    params: list[torch.nn.Parameter] = field(default_factory=list)
    consts: list[torch.Tensor] = field(default_factory=list)
    var_names: dict[int, str] = field(default_factory=dict)
    minimized: Any = None
    """Set by minimize(): what Executor.run steps (see executor.py)."""
    _ids: Iterator[int] = field(default_factory=itertools.count)

    def call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run func on meta tensors for its outputs' shapes and dtypes and record it; tensor
        outputs come back as Variables of this program."""
        leaves, treedef = pytree.tree_flatten((args, kwargs))
        # Recording runs on meta tensors whose -1 dims stand as 1: a shape warning here (e.g.
        # mse_loss broadcasting [1, n] against [8, n]) is about the stand-in, not the real run,
        # which executes the same ops on the fed arrays and warns there if it must.
        with torch._C.DisableTorchFunctionSubclass(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            meta = [_to_meta(leaf) for leaf in leaves]
            m_args, m_kwargs = pytree.tree_unflatten(meta, treedef)
            out = func(*m_args, **m_kwargs)
        out_leaves, out_treedef = pytree.tree_flatten(out)
        if not any(isinstance(t, torch.Tensor) for t in out_leaves):
            return out  # shape, dtype, dim(): answered by the meta tensor, nothing to record
        return self._record(func, leaves, treedef, out_leaves, out_treedef)

    def _new_var_id(self) -> int:
        return next(self._ids)

    def _ref(self, leaf: Any) -> Any:
        if isinstance(leaf, Variable):
            if leaf.program is not self:
                raise ValueError(
                    f"{leaf!r} belongs to another Program: record one program's ops on its "
                    "own data() placeholders."
                )
            return Ref("var", leaf.var_id)
        if isinstance(leaf, torch.nn.Parameter):
            pool, kind = self.params, "param"
        elif isinstance(leaf, torch.Tensor):
            pool, kind = self.consts, "const"
        else:
            return leaf
        for i, t in enumerate(pool):
            if t is leaf:
                return Ref(kind, i)
        pool.append(leaf)
        return Ref(kind, len(pool) - 1)

    def _record(self, func, leaves, treedef, out_leaves, out_treedef) -> Any:
        refs = [self._ref(leaf) for leaf in leaves]
        wrapped, outputs = [], []
        base = getattr(func, "__name__", "op").strip("_")
        for t in out_leaves:
            if isinstance(t, torch.Tensor):
                var = Variable(t, self, "")
                var.var_name = f"{base}_{var.var_id}.tmp_0"
                self.var_names[var.var_id] = var.var_name
                wrapped.append(var)
                outputs.append(var.var_id)
            else:
                wrapped.append(t)
        self.ops.append(Op(func, refs, treedef, outputs, out_treedef, _GUARD.depth > 0))
        return pytree.tree_unflatten(wrapped, out_treedef)

    def var_of(self, fetch: Any) -> int:
        """The id of a fetched Variable (given as itself or by name)."""
        name = fetch.name if isinstance(fetch, Variable) else fetch
        for var_id, known in self.var_names.items():
            if known == name:
                return var_id
        raise ValueError(
            f"fetch_list item {fetch!r} is not a variable of this program."
            + did_you_mean(name, sorted(self.var_names.values()))
        )


class _Guard:
    depth = 0


_GUARD = _Guard()


@contextlib.contextmanager
def fp16_guard() -> Iterator[None]:
    """paddle.static.amp.fp16_guard: ops recorded inside run in low precision under
    decorate(use_pure_fp16=True, use_fp16_guard=True); those outside stay fp32."""
    _GUARD.depth += 1
    try:
        yield
    finally:
        _GUARD.depth -= 1


class _Mode:
    static = False
    main = Program()
    startup = Program()


_MODE = _Mode()


def in_static_mode() -> bool:
    return _MODE.static


def default_main_program() -> Program:
    return _MODE.main


def default_startup_program() -> Program:
    return _MODE.startup


@contextlib.contextmanager
def program_guard(main_program: Program, startup_program: Program | None = None) -> Iterator[None]:
    """Record into main_program (and treat startup_program as its startup) inside the block."""
    if not isinstance(main_program, Program):
        raise TypeError(f"main_program must be a Program, got {main_program!r}.")
    saved = _MODE.main, _MODE.startup
    _MODE.main = main_program
    _MODE.startup = startup_program if startup_program is not None else _MODE.startup
    try:
        yield
    finally:
        _MODE.main, _MODE.startup = saved


def data(name: str, shape: list[int] | tuple[int, ...], dtype: str = "float32") -> Variable:
    """A placeholder fed by Executor.run(feed={name: array}); -1/None marks a free dimension."""
    if not _MODE.static:
        raise RuntimeError("static.data() records a program: call enable_static() first.")
    if not isinstance(name, str) or not name:
        raise TypeError(f"data(name=...) must be a non-empty str, got {name!r}.")
    program = _MODE.main
    if name in program.placeholders:
        raise ValueError(f"data(name={name!r}) already exists in this program.")
    if not isinstance(shape, list | tuple) or not all(
        d is None or (isinstance(d, int) and (d > 0 or d == -1)) for d in shape
    ):
        raise ValueError(f"data(shape={shape!r}): a list of ints > 0, or -1/None for free dims.")
    key = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
    if key not in DTYPES:
        raise ValueError(f"data(dtype={dtype!r}) is not supported." + did_you_mean(key, [*DTYPES]))
    meta = torch.empty(
        [1 if d in (None, -1) else d for d in shape], dtype=DTYPES[key], device="meta"
    )
    var = Variable(meta, program, name)
    var.declared_shape = tuple(shape)
    program.placeholders[name] = var
    program.var_names[var.var_id] = name
    return var


class Scope:
    """Paddle's Scope: the persistable tensors (parameters) programs use, by name."""

    def find_var(self, name: str) -> torch.Tensor | None:
        for program in (_MODE.main, _MODE.startup):
            for i, p in enumerate(program.params):
                if f"param_{i}" == name:
                    return p
        return None


_SCOPE = Scope()


def global_scope() -> Scope:
    return _SCOPE
