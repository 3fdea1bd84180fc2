"""The Engine: Colossal-AI's loop-facing object over a prepared model, optimizer, criterion.

Built by `mixprec.engine.initialize` (see the package docstring for the loop it runs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mixprec.core import multi_loss
from mixprec.core.commit import StepResult
from mixprec.core.compiled_step import CompiledStep, compile_step
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import Policy
from mixprec.core.prepare import FP32Criterion, PrecisionModule
from mixprec.engine.base import EngineBase
from mixprec.engine.state import engine_state_dict, load_engine_state_dict
from mixprec.mixed_precision import OptimizerWrapperAPI


class Engine(EngineBase):
    """Runs a prepared model, optimizer and criterion the way Colossal-AI's Engine does.

    Built by `initialize`; the pieces are the core's: model is a PrecisionModule (inside
    DistributedDataParallel when distributed), optimizer a MixedPrecisionOptimizer, criterion
    an FP32Criterion (or None).

    Args:
        model: the prepared model, possibly wrapped in DistributedDataParallel.
        optimizer: the core's optimizer wrapper with Colossal's OptimizerWrapper methods, as
            initialize, Booster.boost and convert_to_amp build it (clipping and loss scaling
            live there); a MixedPrecisionOptimizer without those methods is refused.
        criterion: the fp32 loss, reached as `engine.criterion(output, label)`.
        lr_scheduler: stepped after every optimizer step that was not skipped (None: the
            caller steps its own scheduler, as seed 000 does once per epoch).
        gradient_accumulation: micro-batches per optimizer step (>= 1).
        policy: the precision policy the pieces were prepared with (for reports, checkpoints).
        compile_step: compile `train_step` (config key `compile=True`): see mixprec.compile_step.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: MixedPrecisionOptimizer,
        criterion: FP32Criterion | None = None,
        *,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        gradient_accumulation: int = 1,
        policy: Policy | None = None,
        compile_step: bool = False,
    ) -> None:
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        if not isinstance(inner, PrecisionModule):
            raise TypeError(
                f"Engine needs a model from mixprec.prepare_model (optionally inside "
                f"DistributedDataParallel), got {type(model)!r}; use mixprec.engine.initialize."
            )
        if not isinstance(optimizer, MixedPrecisionOptimizer):
            raise TypeError(
                f"Engine needs a mixprec MixedPrecisionOptimizer, got {type(optimizer)!r}; "
                "use mixprec.engine.initialize."
            )
        if not isinstance(optimizer, OptimizerWrapperAPI):  # Colossal's Engine takes its wrapper
            raise TypeError(
                f"Engine needs an optimizer with Colossal's OptimizerWrapper methods "
                f"(backward_by_grad, clip_grad_by_norm, ...), got a {type(optimizer).__name__}; "
                "pass the one mixprec.engine.initialize, Booster.boost or "
                "mixprec.amp.convert_to_amp returns."
            )
        if criterion is not None and not isinstance(criterion, FP32Criterion):
            raise TypeError(f"Engine needs an FP32Criterion or None, got {type(criterion)!r}.")
        if (
            isinstance(gradient_accumulation, bool)
            or not isinstance(gradient_accumulation, int)
            or gradient_accumulation < 1
        ):
            raise ValueError(
                f"gradient_accumulation={gradient_accumulation!r} must be an int >= 1."
            )
        self.model = model
        self.optimizer = optimizer
        self.criterion = criterion
        self.lr_scheduler = lr_scheduler
        self.gradient_accumulation = gradient_accumulation
        self.compile_step = _check_compile(compile_step, gradient_accumulation, lr_scheduler)
        self._train_step: CompiledStep | None = None
        self.policy = policy if policy is not None else inner.policy
        self._precision_module = inner
        # micro-batches already backpropagated into the current accumulation window
        self._accumulated_steps = 0

    # ----- Colossal-AI's loop API (train, eval: EngineBase) -----
    def _window_closes(self) -> bool:
        """Whether the next step() is a real optimizer step (the window's last micro-batch)."""
        return self._accumulated_steps + 1 >= self.gradient_accumulation

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward (under DDP, without gradient sync until the window's last)."""
        sync_off = (
            isinstance(self.model, DistributedDataParallel)
            and self.model.training
            and torch.is_grad_enabled()
            and not self._window_closes()
        )
        # DDP decides in forward whether the coming backward all-reduces, so no_sync wraps it
        with self.model.no_sync() if sync_off else contextlib.nullcontext():
            return self.model(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients, but only at the start of an accumulation window."""
        if self._accumulated_steps == 0:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def backward(self, loss: torch.Tensor, loss_id: int = 0) -> None:
        """Scaled backward of loss / gradient_accumulation (gradients add up over a window).

        loss_id picks the loss scaler under fp16=dict(mode=AMP_TYPE.APEX, num_losses=N)."""
        if self.gradient_accumulation > 1:
            loss = loss / self.gradient_accumulation
        multi_loss.backward(self.optimizer, loss, loss_id)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Colossal's Engine.backward_by_grad: backward from tensor with the upstream grad.

        grad must already carry the loss scale (`engine.optimizer.scale_loss`, or a later
        stage's input gradient): the optimizer's backward_by_grad does not scale it again. As
        in Colossal, it is not divided by gradient_accumulation (only backward(loss) is)."""
        self.optimizer.backward_by_grad(tensor, grad)

    def step(self) -> StepResult | None:
        """Step on the window's last micro-batch: unscale, clip, step or skip, then the schedule.

        Returns the optimizer's StepResult, or None for a micro-batch that only accumulated.
        The LR scheduler (if the engine owns one) advances only when the step was not skipped.
        """
        if not self._window_closes():
            self._accumulated_steps += 1
            return None
        self._accumulated_steps = 0
        return self._optimizer_step()

    def train_step(self, *inputs: Any, target: Any) -> torch.Tensor:
        """One whole step (zero_grad .. step) as mixprec.compile_step runs it, compiled when
        the config says `compile=True`; returns the loss as a 0-dim tensor (no host sync)."""
        if self.criterion is None:
            raise RuntimeError("train_step needs a criterion: pass one to initialize().")
        if self._train_step is None:
            self._train_step = compile_step(
                self.model, self.optimizer, self.criterion, compile=self.compile_step
            )
        return self._train_step(*inputs, target=target)

    # ----- counters (loss_scale, skipped_steps, skip_stats, last_result: EngineBase) -----
    @property
    def accumulated_steps(self) -> int:
        """Micro-batches accumulated in the current window (0 right after a real step)."""
        return self._accumulated_steps

    # ----- checkpoints (the rules: mixprec.engine.state) -----
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit for bit (see engine_state_dict)."""
        return engine_state_dict(
            self._precision_module.module,
            self.optimizer,
            self.lr_scheduler,
            self._accumulated_steps,
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what state_dict() saved; the engine must be built the same way."""
        self._accumulated_steps = load_engine_state_dict(
            state_dict,
            self._precision_module.module,
            self.optimizer,
            self.lr_scheduler,
            self.gradient_accumulation,
        )

    def __repr__(self) -> str:
        return (
            f"Engine(policy={self.policy.name!r}, model={type(self.model).__name__}, "
            f"gradient_accumulation={self.gradient_accumulation}, "
            f"clip_grad_norm={self.optimizer.max_norm}, "
            f"lr_scheduler={type(self.lr_scheduler).__name__ if self.lr_scheduler else None})"
        )


def _check_compile(flag: object, accumulation: int, lr_scheduler: object) -> bool:
    if not isinstance(flag, bool):
        raise TypeError(f"compile={flag!r} must be a bool.")
    if flag and accumulation > 1:
        raise ValueError(
            f"compile=True with gradient_accumulation={accumulation}: the compiled step is one "
            "whole optimizer step per batch. Use one or the other."
        )
    if flag and lr_scheduler is not None:
        raise ValueError(
            "compile=True with an lr_scheduler the engine steps: the compiled step decides "
            "skips on the device, so the engine cannot know when to step it without a host "
            "sync. Step your schedule yourself."
        )
    return flag
