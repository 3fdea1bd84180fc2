"""paddle.static.amp: decorate, CustomOpLists, fp16_guard over a recorded program.

Like Paddle's static AMP pass, decoration rewrites the program's precision op by op: O1
(use_pure_fp16=False) replays it under torch.autocast with the custom white list forced low
and the black list forced fp32; O2 (use_pure_fp16=True) runs every op low except norms and the
black list (and, with use_fp16_guard=True, except ops recorded outside fp16_guard()), and
amp_init casts the parameters only low ops use, keeping fp32 master weights in the optimizer.
The loss scale (dynamic by default, Paddle's names) lives in the core's optimizer wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mixprec.autocast import resolve_ops
from mixprec.compiled_step import CompiledStep
from mixprec.optim import MixedPrecisionOptimizer
from mixprec.paddle.dygraph import NORM_OPS
from mixprec.paddle.static.executor import CPUPlace, CUDAPlace, build_step
from mixprec.paddle.static.program import Program, Ref, Scope, Variable, fp16_guard
from mixprec.policy import ScalerConfig, to_low_dtype


class CustomOpLists:
    """paddle.static.amp.CustomOpLists: ops forced low (white) or fp32 (black), by op name
    (Paddle's spellings such as 'elementwise_add' accepted), and variables whose ops stay fp32."""

    def __init__(
        self,
        custom_white_list: list[str] | None = None,
        custom_black_list: list[str] | None = None,
        custom_black_varnames: list[str] | None = None,
    ) -> None:
        self.white_list = resolve_ops(custom_white_list)  # raises on unknown op names
        self.black_list = resolve_ops(custom_black_list)
        both = self.white_list & self.black_list
        if both:
            raise ValueError(
                f"{sorted(both)} in both custom_white_list and custom_black_list: pick one."
            )
        varnames = custom_black_varnames or []
        if isinstance(varnames, str) or not all(isinstance(v, str) for v in varnames):
            raise TypeError(f"custom_black_varnames={varnames!r} must be a list of names.")
        self.black_varnames = frozenset(varnames)


def _op_name(func: Any) -> str | None:
    try:
        return next(iter(resolve_ops([func])))
    except (ValueError, TypeError):  # not a named torch op (a getter, a private function)
        return None


@dataclass(frozen=True, kw_only=True)
class AmpConfig:
    """What static.amp.decorate was asked for."""

    lists: CustomOpLists
    """Custom white/black op lists and black variable names."""
    lp_dtype: torch.dtype
    """float16 or bfloat16."""
    pure: bool
    """use_pure_fp16: parameters low, every op low but norms and the black list."""
    guard: bool
    """use_fp16_guard: under pure, only ops recorded in fp16_guard() run low."""
    scaler: ScalerConfig
    """The loss scale in Paddle's terms (init_loss_scaling, incr_*, decr_*)."""


def op_casts(program: Program, cfg: AmpConfig) -> list[torch.dtype | None]:
    """Per recorded op: the dtype its floating inputs are cast to, or None (autocast decides)."""
    names = program.var_names
    casts: list[torch.dtype | None] = []
    fp32_ops = cfg.lists.black_list | (frozenset(NORM_OPS) if cfg.pure else frozenset())
    for op in program.ops:
        name = _op_name(op.func)
        var_ids = [leaf.index for leaf in op.leaves if isinstance(leaf, Ref) and leaf.kind == "var"]
        black_var = any(names.get(i) in cfg.lists.black_varnames for i in var_ids + op.outputs)
        if name in fp32_ops or black_var:
            casts.append(torch.float32)
        elif name in cfg.lists.white_list:
            casts.append(cfg.lp_dtype)
        elif cfg.pure:
            casts.append(cfg.lp_dtype if op.guarded or not cfg.guard else torch.float32)
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
        self._step: CompiledStep | None = None

    def step_for(self, program: Program) -> CompiledStep:
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
    """What static.amp.decorate returns: minimize(loss), amp_init(place), get_loss_scaling()."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: AmpConfig) -> None:
        self.inner, self.cfg = optimizer, cfg
        self.program: Program | None = None
        self.wrapped: MixedPrecisionOptimizer | None = None
        self._step = None

    def minimize(self, loss: Any, *args: Any, **kwargs: Any) -> None:
        loss = _check_loss(loss)
        self.loss_id, self.program = loss.var_id, loss.program
        self.casts = op_casts(self.program, self.cfg)
        if not self.cfg.pure:  # O1: fp32 params are the masters; the wrapper scales and skips
            self.wrapped = MixedPrecisionOptimizer(self.inner, loss_scale=self.cfg.scaler)
        loss.program.minimized = self

    def amp_init(self, place: CPUPlace | CUDAPlace, scope: Scope | None = None, **_: Any) -> None:
        """Cast the parameters that only low-precision ops use; keep their fp32 masters."""
        if self.program is None:
            raise RuntimeError("amp_init before minimize(loss): there is no program to cast yet.")
        if not self.cfg.pure:
            raise ValueError(
                "amp_init casts parameters for use_pure_fp16=True; this optimizer was decorated "
                "with use_pure_fp16=False (O1), whose parameters stay fp32."
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
                    (low if cast == self.cfg.lp_dtype else fp32).add(leaf.index)
        hp_values = {}
        with torch.no_grad():
            for i in sorted(low - fp32):
                p = self.program.params[i]
                hp_values[id(p)] = p.detach().clone()
                p.data = p.data.to(place.device, self.cfg.lp_dtype)
        self.wrapped = MixedPrecisionOptimizer(
            self.inner, loss_scale=self.cfg.scaler, master_weights=True
        )
        with torch.no_grad():  # masters hold the fp32 values, not their low-precision rounding
            for lp, hp in zip(self.wrapped.lp_params, self.wrapped.hp_masters, strict=True):
                hp.copy_(hp_values[id(lp)])

    def get_loss_scaling(self) -> torch.Tensor:
        """The current loss scale, a one-element tensor (reading it is a host sync)."""
        if self.wrapped is None:
            return torch.tensor([self.cfg.scaler.init_scale])
        return self.wrapped.scaler.scale_tensor

    def step_for(self, program: Program) -> CompiledStep:
        if self.wrapped is None:
            raise RuntimeError(
                "use_pure_fp16=True: call optimizer.amp_init(place) after "
                "exe.run(startup_program) and before running the main program."
            )
        if self._step is None:
            autocast = None if self.cfg.pure else self.cfg.lp_dtype
            self._step = build_step(program, self.loss_id, self.wrapped, self.casts, autocast)
        return self._step


def decorate(
    optimizer: torch.optim.Optimizer,
    amp_lists: CustomOpLists | None = None,
    init_loss_scaling: float = 2.0**15,
    incr_every_n_steps: int = 1000,
    decr_every_n_nan_or_inf: int = 2,
    incr_ratio: float = 2.0,
    decr_ratio: float = 0.8,
    use_dynamic_loss_scaling: bool = True,
    use_pure_fp16: bool = False,
    use_fp16_guard: bool | None = None,
    dtype: str | torch.dtype = "float16",
) -> OptimizerWithMixedPrecision:
    """paddle.static.amp.decorate with Paddle's defaults; dtype 'float16' or 'bfloat16'."""
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(
        optimizer, MixedPrecisionOptimizer
    ):
        raise TypeError(f"optimizer must be a plain torch optimizer, got {optimizer!r}.")
    if amp_lists is not None and not isinstance(amp_lists, CustomOpLists):
        raise TypeError(f"amp_lists={amp_lists!r} must be a static.amp.CustomOpLists or None.")
    for name, value in (
        ("use_dynamic_loss_scaling", use_dynamic_loss_scaling),
        ("use_pure_fp16", use_pure_fp16),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r} must be a bool.")
    if use_fp16_guard is not None and not isinstance(use_fp16_guard, bool):
        raise TypeError(f"use_fp16_guard={use_fp16_guard!r} must be a bool or None.")
    if use_fp16_guard and not use_pure_fp16:
        raise ValueError(
            "use_fp16_guard=True only applies with use_pure_fp16=True (fp16_guard marks the ops "
            "that run low in pure fp16); got use_pure_fp16=False."
        )
    scaler = ScalerConfig(
        dynamic=use_dynamic_loss_scaling,
        init_scale=init_loss_scaling,
        growth_interval=incr_every_n_steps,
        hysteresis=decr_every_n_nan_or_inf,
        growth_factor=incr_ratio,
        backoff_factor=decr_ratio,
    )
    cfg = AmpConfig(
        lists=amp_lists or CustomOpLists(),
        lp_dtype=to_low_dtype(dtype),
        pure=use_pure_fp16,
        guard=bool(use_fp16_guard),  # Paddle: None means False under decorate
        scaler=scaler,
    )
    return OptimizerWithMixedPrecision(optimizer, cfg)


__all__ = ["CustomOpLists", "OptimizerWithMixedPrecision", "decorate", "fp16_guard"]
