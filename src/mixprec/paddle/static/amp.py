"""paddle.static.amp: decorate, CustomOpLists / AutoMixedPrecisionLists, fp16_guard.

Like Paddle's static AMP pass, decoration rewrites the program's precision op by op: O1
replays it under torch.autocast with Paddle's white list (and the custom one) forced low and
Paddle's black list (and the custom one) forced fp32; O2 (use_pure_fp16=True) runs every op low
except norms, Paddle's O2 black list and the custom one (and, with the guard, except ops
recorded outside fp16_guard(); with use_promote, except ops with an fp32 input), and amp_init
casts the parameters only low ops use, keeping fp32 master weights in the optimizer; OD runs
only the white list low. The loss scale is a mixprec.paddle.GradScaler: Paddle's rule.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from typing_extensions import override

from mixprec.core.autocast import resolve_ops
from mixprec.core.compiled_step import CompiledStep
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import NAIVE_SCALER, TORCH_SCALER, to_low_dtype
from mixprec.paddle import op_names
from mixprec.paddle.dygraph import NORM_OPS
from mixprec.paddle.grad_scaler import GradScaler
from mixprec.paddle.op_names import paddle_ops_to_torch
from mixprec.paddle.static.executor import (
    PROMOTE,
    CPUPlace,
    CUDAPlace,
    EagerStep,
    build_step,
)
from mixprec.paddle.static.program import Program, Ref, Scope, Variable, fp16_guard


class AutoMixedPrecisionLists:
    """paddle.static.amp.AutoMixedPrecisionLists (CustomOpLists is the same class, as in Paddle).

    white_list / black_list / gray_list: Paddle's default lists by Paddle's op names, with the
    custom lists moved in (a custom white op leaves black and gray; a custom black op leaves
    white and gray). Every name in Paddle's lists maps to torch ops (op_names.TO_TORCH) or is
    refused with its reason (op_names.REFUSED); torch names and callables work too.
    custom_black_varnames: variables whose ops stay fp32. dtype: 'float16' or 'bfloat16'.
    """

    def __init__(
        self,
        custom_white_list: list[str] | None = None,
        custom_black_list: list[str] | None = None,
        custom_black_varnames: list[str] | None = None,
        dtype: str = "float16",
    ) -> None:
        self.amp_dtype = _dtype_name(to_low_dtype(dtype))
        self.custom_lp_ops = paddle_ops_to_torch(custom_white_list)  # raises on unknown names
        self.custom_hp_ops = paddle_ops_to_torch(custom_black_list)
        both = self.custom_lp_ops & self.custom_hp_ops
        if both:
            raise ValueError(
                f"The given custom_white_list overlaps custom_black_list: {sorted(both)} "
                "(as torch ops); pick one list for each."
            )
        varnames = custom_black_varnames or []
        if isinstance(varnames, str) or not all(isinstance(v, str) for v in varnames):
            raise TypeError(f"custom_black_varnames={varnames!r} must be a list of names.")
        self.black_varnames = frozenset(varnames)
        white = set(op_names.WHITE_LIST | op_names.STATIC_EXTRA_WHITE_LIST)
        if self.amp_dtype == "float16":
            white |= op_names.ONLY_FP16_WHITE_LIST
        black = set(op_names.FP16_BLACK_LIST | op_names.EXTRA_BLACK_LIST)
        gray = set(op_names.GRAY_LIST)
        for name in _names(custom_white_list):
            black.discard(name)
            gray.discard(name)
            white.add(name)
        for name in _names(custom_black_list):
            white.discard(name)
            gray.discard(name)
            black.add(name)
        self.white_list, self.black_list, self.gray_list = white, black, gray
        default_white, default_black = op_names.default_lists("O1", self.amp_dtype)
        self.lp_ops = (default_white - self.custom_hp_ops) | self.custom_lp_ops
        """Torch ops run low: Paddle's white list and the custom one, in torch's names."""
        self.hp_ops = (default_black - self.custom_lp_ops) | self.custom_hp_ops
        """Torch ops run in fp32: Paddle's O1 black list and the custom one."""


CustomOpLists = AutoMixedPrecisionLists
"""paddle.static.amp.CustomOpLists: the same class (Paddle 3.3.1 aliases it too)."""


def _names(ops: Any) -> list[str]:
    return [op for op in ops or [] if isinstance(op, str)]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _op_name(func: Any) -> str | None:
    try:
        return next(iter(resolve_ops([func])))
    except (ValueError, TypeError):  # not a named torch op (a getter, a private function)
        return None


@dataclass(frozen=True, kw_only=True)
class AmpConfig:
    """What static.amp.decorate was asked for."""

    lists: AutoMixedPrecisionLists
    """White/black op lists (Paddle's defaults and the custom ones) and black variable names."""
    lp_dtype: torch.dtype
    """float16 or bfloat16."""
    level: str
    """'O1' (autocast with the lists), 'O2' (parameters low; every op low but norms, the black
    list and, with use_promote, ops with an fp32 input) or 'OD' (only the white list low)."""
    guard: bool
    """use_fp16_guard / use_amp_guard: under O2, only ops recorded in fp16_guard() run low."""
    promote: bool
    """use_promote (O2): a non-white op with an fp32 input runs in fp32."""
    scaler: dict[str, Any]
    """The loss scale in Paddle's terms: GradScaler's keyword arguments."""

    @property
    def pure(self) -> bool:
        """Parameters cast low by amp_init (use_pure_fp16 / level 'O2')."""
        return self.level == "O2"


def op_casts(program: Program, cfg: AmpConfig) -> list[torch.dtype | str | None]:
    """Per recorded op: the dtype its floating inputs are cast to, PROMOTE, or None (autocast
    decides)."""
    names = program.var_names
    casts: list[torch.dtype | str | None] = []
    lists = cfg.lists
    if cfg.level == "O1":
        lp_ops, hp_ops = lists.lp_ops, lists.hp_ops
    else:  # O2 keeps Paddle's extra black list (and norms) fp32; OD computes all but white fp32
        white, black = op_names.default_lists(cfg.level, _dtype_name(cfg.lp_dtype))
        lp_ops = (white - lists.custom_hp_ops) | lists.custom_lp_ops
        hp_ops = (black - lists.custom_lp_ops) | lists.custom_hp_ops
        if cfg.pure:
            hp_ops |= frozenset(NORM_OPS) - lists.custom_lp_ops
    for op in program.ops:
        name = _op_name(op.func)
        var_ids = [leaf.index for leaf in op.leaves if isinstance(leaf, Ref) and leaf.kind == "var"]
        black_var = any(names.get(i) in lists.black_varnames for i in var_ids + op.outputs)
        if name in hp_ops or black_var:
            casts.append(torch.float32)
        elif cfg.pure and cfg.guard and not op.guarded:  # outside fp16_guard(): fp32
            casts.append(cfg.lp_dtype if name in lists.custom_lp_ops else torch.float32)
        elif name in lp_ops:
            casts.append(cfg.lp_dtype)
        elif cfg.level == "OD":
            casts.append(torch.float32)
        elif cfg.pure:
            casts.append(PROMOTE if cfg.promote else cfg.lp_dtype)
        else:
            casts.append(None)
    return casts


def _check_loss(loss: Any) -> Variable:
    if not isinstance(loss, Variable):
        raise TypeError(
            f"minimize(loss={loss!r}): pass the loss recorded on static.data() placeholders "
            "(a static Variable) after enable_static()."
        )
    if loss.numel() != 1:
        raise ValueError(f"minimize(loss): the loss must hold one value, got {loss!r}.")
    return loss


class _Minimized:
    """A program's training step: optimizer, loss, and the compiled step once built."""

    def __init__(self, optimizer: torch.optim.Optimizer, loss: Variable) -> None:
        self.optimizer, self.loss_id = optimizer, loss.var_id
        self.loss_shape = tuple(loss.shape)  # what Executor.run fetches: the loss's own shape
        self._step: CompiledStep | EagerStep | None = None

    def step_for(self, program: Program) -> CompiledStep | EagerStep:
        if self._step is None:
            casts = [None] * len(program.ops)
            self._step = build_step(program, self.loss_id, self.optimizer, casts, None)
        return self._step


def _plain_minimize(self: torch.optim.Optimizer, loss: Any, *args: Any, **kwargs: Any) -> None:
    """Optimizer.minimize(loss) in static mode: bind this optimizer to the loss's program."""
    loss = _check_loss(loss)
    loss.program.minimized = _Minimized(self, loss)


def install_minimize() -> None:
    """Give torch optimizers Paddle's static `minimize(loss)` (enable_static calls this)."""
    if not hasattr(torch.optim.Optimizer, "minimize"):
        torch.optim.Optimizer.minimize = _plain_minimize  # type: ignore[attr-defined]


def remove_minimize() -> None:
    if getattr(torch.optim.Optimizer, "minimize", None) is _plain_minimize:
        del torch.optim.Optimizer.minimize  # type: ignore[attr-defined]


class OptimizerWithMixedPrecision(_Minimized):
    """What static.amp.decorate returns: minimize(loss), amp_init(place), get_loss_scaling().

    The loss scale is a mixprec.paddle.GradScaler (`scaler`): the compiled step advances it by
    that class's rule, Paddle's update_loss_scaling, the same as in the dynamic graph.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: AmpConfig) -> None:
        self.inner, self.cfg = optimizer, cfg
        self.scaler = GradScaler(**cfg.scaler)
        self.program: Program | None = None
        self.wrapped: MixedPrecisionOptimizer | None = None
        self._step = None

    def minimize(self, loss: Any, *args: Any, **kwargs: Any) -> None:
        loss = _check_loss(loss)
        self.loss_id, self.program = loss.var_id, loss.program
        self.loss_shape = tuple(loss.shape)
        self.casts = op_casts(self.program, self.cfg)
        if not self.cfg.pure:  # O1/OD: fp32 params are the masters; the step skips inf/nan
            self.wrapped = MixedPrecisionOptimizer(self.inner)
        loss.program.minimized = self

    def amp_init(
        self,
        place: CPUPlace | CUDAPlace,
        scope: Scope | None = None,
        test_program: Program | None = None,
        use_fp16_test: bool = False,
        rewrite_master_weight: bool = False,
    ) -> None:
        """Cast the parameters that only low-precision ops use; keep their fp32 masters.

        Paddle's signature. test_program is refused: Executor runs the minimized program's
        training step only, so there is no separate test program to cast. use_fp16_test without
        one does nothing in Paddle either. rewrite_master_weight: the masters start from the
        parameters' low-precision rounding (as Paddle) instead of their fp32 values.
        """
        _check_bool("use_fp16_test", use_fp16_test)
        _check_bool("rewrite_master_weight", rewrite_master_weight)
        if test_program is not None:
            raise NotImplementedError(
                f"amp_init(test_program={test_program!r}): mixprec's Executor runs the "
                "minimized program's training step only, so there is no test program to cast; "
                "evaluate the torch model eagerly under mixprec.paddle.auto_cast instead."
            )
        if self.program is None:
            raise RuntimeError("amp_init before minimize(loss): there is no program to cast yet.")
        if not self.cfg.pure:
            raise ValueError(
                "amp_init casts parameters for use_pure_fp16=True / level='O2'; this optimizer "
                f"was decorated with level={self.cfg.level!r}, whose parameters stay fp32."
            )
        if not isinstance(place, CPUPlace | CUDAPlace):
            raise TypeError(f"amp_init(place={place!r}): pass CPUPlace() or CUDAPlace(i).")
        if scope is not None and not isinstance(scope, Scope):
            raise TypeError(f"amp_init(scope={scope!r}): pass static.global_scope() or None.")
        if self.wrapped is not None:
            raise RuntimeError("amp_init was already called for this optimizer.")
        low, fp32 = set(), set()
        for op, cast in zip(self.program.ops, self.casts, strict=True):
            for leaf in op.leaves:
                if isinstance(leaf, Ref) and leaf.kind == "param":
                    (low if cast in (self.cfg.lp_dtype, PROMOTE) else fp32).add(leaf.index)
        hp_values = {}
        with torch.no_grad():
            for i in sorted(low - fp32):
                p = self.program.params[i]
                hp_values[id(p)] = p.detach().clone()
                p.data = p.data.to(place.device, self.cfg.lp_dtype)
        self.wrapped = MixedPrecisionOptimizer(self.inner, master_weights=True)
        if rewrite_master_weight:  # Paddle: the masters take the parameters' rounding
            return  # the wrapper built its masters from the cast parameters
        with torch.no_grad():  # masters hold the fp32 values, not their low-precision rounding
            for lp, hp in zip(self.wrapped.lp_params, self.wrapped.hp_masters, strict=True):
                hp.copy_(hp_values[id(lp)])

    def get_loss_scaling(self) -> torch.Tensor:
        """The current loss scale, a one-element tensor (reading it is a host sync)."""
        if self.scaler._scale is None:
            return torch.tensor([self.scaler.get_init_loss_scaling()])
        return self.scaler._scale.reshape(1)

    @override
    def step_for(self, program: Program) -> CompiledStep | EagerStep:
        if self.wrapped is None:
            raise RuntimeError(
                "use_pure_fp16=True: call optimizer.amp_init(place) after "
                "exe.run(startup_program) and before running the main program."
            )
        if self._step is None:
            autocast = self.cfg.lp_dtype if self.cfg.level == "O1" else None
            self._step = build_step(
                program, self.loss_id, self.wrapped, self.casts, autocast, scaler=self.scaler
            )
        return self._step


def _check_bool(name: str, value: object, *, none_ok: bool = False) -> None:
    if not (isinstance(value, bool) or (none_ok and value is None)):
        raise TypeError(f"{name}={value!r} must be a bool{' or None' if none_ok else ''}.")


def _check_optimizer(optimizer: object, amp_lists: object) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(
        optimizer, MixedPrecisionOptimizer
    ):
        raise TypeError(f"optimizer must be a plain torch optimizer, got {optimizer!r}.")
    if amp_lists is not None and not isinstance(amp_lists, AutoMixedPrecisionLists):
        raise TypeError(
            f"amp_lists={amp_lists!r} must be a static.amp.CustomOpLists / "
            "AutoMixedPrecisionLists or None."
        )


def decorate_fp16_only(
    optimizer: torch.optim.Optimizer,
    amp_lists: AutoMixedPrecisionLists | None = None,
    init_loss_scaling: float = 2.0**15,
    incr_every_n_steps: int = NAIVE_SCALER.growth_interval,
    decr_every_n_nan_or_inf: int = 2,
    incr_ratio: float = 2.0,
    decr_ratio: float = 0.8,
    use_dynamic_loss_scaling: bool = True,
    use_pure_fp16: bool = False,
    use_fp16_guard: bool | None = None,
    use_bf16: bool = False,
    use_promote: bool = False,
    *,
    dtype: str | torch.dtype | None = None,
) -> OptimizerWithMixedPrecision:
    """paddle.static.amp.decorate's older overload (seed 002's), Paddle's defaults.

    use_fp16_guard None means use_pure_fp16, as Paddle. dtype: mixprec's addition, 'float16'
    or 'bfloat16' (use_bf16=True is 'bfloat16').
    """
    _check_optimizer(optimizer, amp_lists)
    for name, value in (
        ("use_dynamic_loss_scaling", use_dynamic_loss_scaling),
        ("use_pure_fp16", use_pure_fp16),
        ("use_bf16", use_bf16),
        ("use_promote", use_promote),
    ):
        _check_bool(name, value)
    _check_bool("use_fp16_guard", use_fp16_guard, none_ok=True)
    if use_fp16_guard and not use_pure_fp16:
        raise ValueError(
            "use_fp16_guard=True only applies with use_pure_fp16=True (fp16_guard marks the ops "
            "that run low in pure fp16); got use_pure_fp16=False."
        )
    if use_bf16 and dtype is not None and to_low_dtype(dtype) != torch.bfloat16:
        raise ValueError(f"use_bf16=True and dtype={dtype!r} disagree: pass one of them.")
    lp_dtype = torch.bfloat16 if use_bf16 else to_low_dtype(dtype or "float16")
    return _decorated(
        optimizer,
        amp_lists,
        locals(),
        lp_dtype=lp_dtype,
        level="O2" if use_pure_fp16 else "O1",
        guard=use_pure_fp16 if use_fp16_guard is None else use_fp16_guard,
        promote=use_promote,
    )


def decorate_common(
    optimizer: torch.optim.Optimizer,
    amp_lists: AutoMixedPrecisionLists | None = None,
    level: str = "O1",
    dtype: str | torch.dtype = "float16",
    master_weight: bool | None = None,
    master_grad: bool = False,
    init_loss_scaling: float = TORCH_SCALER.init_scale,
    incr_every_n_steps: int = TORCH_SCALER.growth_interval,
    decr_every_n_nan_or_inf: int = 1,
    incr_ratio: float = TORCH_SCALER.growth_factor,
    decr_ratio: float = TORCH_SCALER.backoff_factor,
    use_dynamic_loss_scaling: bool | None = None,
    use_amp_guard: bool = False,
    use_promote: bool = False,
) -> OptimizerWithMixedPrecision:
    """paddle.static.amp.decorate's 3.x overload, Paddle's defaults.

    level: 'O1', 'O2' or 'OD' ('O0' is refused: decorate nothing instead). master_weight:
    None or True (fp32 masters for O2's low parameters); False is refused (mixprec keeps
    masters for low parameters). master_grad: the masters always take fp32 gradients, so
    False behaves as True. use_dynamic_loss_scaling None: dynamic for float16 only, as Paddle.
    """
    _check_optimizer(optimizer, amp_lists)
    upper = level.upper() if isinstance(level, str) else level
    if upper not in ("O1", "O2", "OD"):
        raise ValueError(
            f"level={level!r}: static.amp.decorate takes 'O1', 'O2' or 'OD'"
            + (" ('O0' is fp32: leave the optimizer undecorated)." if upper == "O0" else ".")
        )
    lp_dtype = to_low_dtype(dtype)
    _check_bool("master_weight", master_weight, none_ok=True)
    _check_bool("master_grad", master_grad)
    _check_bool("use_dynamic_loss_scaling", use_dynamic_loss_scaling, none_ok=True)
    _check_bool("use_amp_guard", use_amp_guard)
    _check_bool("use_promote", use_promote)
    if master_weight is False and upper == "O2":
        raise ValueError(
            "master_weight=False: mixprec's static O2 keeps fp32 master weights for the "
            "parameters amp_init casts (an update in fp16 loses small steps); pass None or True."
        )
    if use_dynamic_loss_scaling is None:
        use_dynamic_loss_scaling = lp_dtype == torch.float16
    return _decorated(
        optimizer,
        amp_lists,
        locals(),
        lp_dtype=lp_dtype,
        level=upper,
        guard=use_amp_guard and upper == "O2",
        promote=use_promote,
    )


_SCALE_KEYWORDS = (
    "init_loss_scaling",
    "incr_ratio",
    "decr_ratio",
    "incr_every_n_steps",
    "decr_every_n_nan_or_inf",
    "use_dynamic_loss_scaling",
)
"""The loss-scale keywords both decorate overloads take (Paddle's GradScaler's names)."""


def _decorated(
    optimizer: torch.optim.Optimizer,
    amp_lists: AutoMixedPrecisionLists | None,
    arguments: Mapping[str, Any],
    **config: Any,
) -> OptimizerWithMixedPrecision:
    """optimizer decorated with config (AmpConfig's fields but lists and scaler): the lists
    default to Paddle's for config's lp_dtype; the scaler takes the _SCALE_KEYWORDS among the
    overload's arguments (a locals() dict), validated now, naming a bad value."""
    scaler = {key: arguments[key] for key in _SCALE_KEYWORDS}
    GradScaler(**scaler)  # validates now, at decorate, naming the bad value
    lists = amp_lists or AutoMixedPrecisionLists(dtype=_dtype_name(config["lp_dtype"]))
    return OptimizerWithMixedPrecision(optimizer, AmpConfig(lists=lists, scaler=scaler, **config))


_OVERLOADS = (decorate_fp16_only, decorate_common)


def decorate(*args: Any, **kwargs: Any) -> OptimizerWithMixedPrecision:
    """paddle.static.amp.decorate: Paddle 3.3.1's two overloads, chosen as Paddle chooses.

    A keyword only one overload has picks it (use_pure_fp16 / use_fp16_guard / use_bf16 the
    older, seed 002's; level / master_weight / master_grad / use_amp_guard the 3.x one). Else
    a float third positional (init_loss_scaling) picks the older one, and anything else the
    3.x one: decorate(optimizer) gets level 'O1' and Paddle 3's scale defaults.
    """
    fits = [
        fn
        for fn in _OVERLOADS
        if set(kwargs) <= set(inspect.signature(fn).parameters)
        and len(args) <= _positional_count(fn)
    ]
    if not fits:
        raise TypeError(
            f"static.amp.decorate got {sorted(kwargs)} together: no overload takes them all. "
            f"The older one takes {list(inspect.signature(decorate_fp16_only).parameters)}, "
            f"the 3.x one {list(inspect.signature(decorate_common).parameters)}."
        )
    if len(fits) == 1:
        return fits[0](*args, **kwargs)
    if len(args) >= 3 and isinstance(args[2], float):
        return decorate_fp16_only(*args, **kwargs)
    return decorate_common(*args, **kwargs)


def _positional_count(fn: Any) -> int:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in inspect.signature(fn).parameters.values())


__all__ = [
    "AutoMixedPrecisionLists",
    "CustomOpLists",
    "OptimizerWithMixedPrecision",
    "decorate",
    "decorate_common",
    "decorate_fp16_only",
    "fp16_guard",
]
