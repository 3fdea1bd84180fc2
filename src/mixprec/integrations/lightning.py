"""mixprec as a Lightning precision plugin: `Fabric(plugins=...)` and `Trainer(plugins=...)`.

    from mixprec.integrations.lightning import MixprecPrecision
    trainer = lightning.Trainer(plugins=MixprecPrecision("fp16_naive", initial_scale=2**16))

What Lightning's own precisions lack and this brings: fp16/bf16 parameters with fp32 master
weights and a hysteresis loss scaler (Lightning's "16-true"/"bf16-true" have no masters),
runtime op lists (custom_white_list / custom_black_list), a skipped step that leaves weights,
masters and optimizer state bitwise unchanged, and fp8 on CPU. One optimizer per plugin: the
loss scale is applied in backward, before Lightning names the optimizer (Fabric never does).
Needs the optional `lightning` package (`pip install lightning`).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Generator
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from typing_extensions import override

from mixprec.core.autocast import default_device_type
from mixprec.core.casting import cast_floating, cast_module
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import MODES, Policy, did_you_mean, to_policy
from mixprec.core.prepare import autocast_context, prepare_optimizer
from mixprec.core.scaling import LossScaler
from mixprec.core.validate import check_module_has_parameters

OP_LIST_KEYS = ("custom_white_list", "custom_black_list")
"""Options that set the policy's runtime op lists, in any mode with a low compute dtype."""


def _raw(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Lightning's wrappers (LightningOptimizer, _FabricOptimizer)."""
    for attr in ("_optimizer", "optimizer"):
        inner = getattr(optimizer, attr, None)
        if isinstance(inner, torch.optim.Optimizer):
            return inner
    return optimizer


def _in_trainer(module: Any) -> bool:
    """A LightningModule attached to a Trainer (under Fabric there is none)."""
    return isinstance(module, LightningModule) and module._trainer is not None


class MixprecPrecision(Precision):
    """One Lightning precision plugin for every mixprec mode, for Fabric and for the Trainer.

    Args:
        mode: a mixprec mode ('fp32', 'fp16', 'bf16', 'fp16_naive', 'fp16_apex', 'fp8').
        **options: the mode's keys (e.g. initial_scale/hysteresis for fp16_naive, init_scale
            for fp16, opt_level for fp16_apex, dtype; for fp8 config=Float8Config(...) and
            Float8Config's fields, e.g. recipe='rowwise') and custom_white_list /
            custom_black_list (op names kept low / forced fp32 under autocast).
    """

    precision = "32-true"  # Lightning's label for the dtype it creates tensors in: we cast later

    def __init__(self, mode: str = "bf16", **options: Any) -> None:
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(
                f"MixprecPrecision mode={mode!r} is not a mixprec mode." + did_you_mean(mode, MODES)
            )
        op_lists = {k: frozenset(options.pop(k)) for k in OP_LIST_KEYS if k in options}
        policy = to_policy(mode, options)
        self.policy: Policy = dataclasses.replace(policy, **op_lists) if op_lists else policy
        self.scaler: LossScaler | None = None  # made at the first backward, on the loss's device
        self.optimizer: MixedPrecisionOptimizer | None = None  # made at the first step
        self._wrapped_id: int | None = None
        self._pending: dict[str, Any] | None = None  # checkpoint state loaded before the step
        self._module: weakref.ref[nn.Module] | None = None  # the module convert_module saw

    # ----- the module and its inputs / outputs -----
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast (and fp8-convert) in place: a LightningModule must stay itself for the Trainer."""
        check_module_has_parameters("module", module)
        self._module = weakref.ref(module)
        if self.policy.fp8:
            from mixprec.fp8 import convert_to_fp8

            for name, child in list(module.named_children()):  # the root stays the same object
                setattr(module, name, convert_to_fp8(child, None, self.policy.fp8_config))
        if self.policy.casts_params:
            cast_module(module, self.policy.param_dtype, keep_norm_fp32=self.policy.keep_norm_fp32)
        return module

    @override
    def forward_context(self) -> Any:
        return autocast_context(self.policy, self._device_type())

    def _device_type(self) -> str:
        """Where Lightning's accelerator put the module (its parameters' device), read at each
        forward: a CPU accelerator on a machine with a GPU autocasts on the CPU. Before any
        module was converted: the default device."""
        module = self._module() if self._module is not None else None
        param = next(module.parameters(), None) if module is not None else None
        return default_device_type() if param is None else param.device.type

    @override
    def convert_input(self, data: Any) -> Any:
        if self.policy.casts_params:  # low-precision params take low-precision inputs
            return cast_floating(data, self.policy.param_dtype)
        return data

    @override
    def convert_output(self, data: Any) -> Any:
        if self.policy.cast_outputs_to is not None:
            return cast_floating(data, self.policy.cast_outputs_to)
        return data

    # ----- backward: scale the loss -----
    @override
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        if _in_trainer(module):  # the Trainer's hooks (on_before_backward); Fabric has none
            return super().pre_backward(tensor, module)
        return tensor

    @override
    def post_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        if _in_trainer(module):
            return super().post_backward(tensor, module)
        return tensor

    def _scaler_on(self, device: torch.device) -> LossScaler:
        if self.scaler is None:
            self.scaler = LossScaler(self.policy.loss_scale, device)
            if self._pending is not None:  # a resumed run scales its first backward as saved
                self.scaler.load_state_dict(self._pending["scaler"])
        return self.scaler

    @override
    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        # the Trainer passes (tensor, model, optimizer, *args), Fabric (tensor, model, *args);
        # the optimizer is wrapped at the step: loading a resumed run's masters writes the
        # params, which this backward's graph still needs
        if args and (args[0] is None or hasattr(args[0], "param_groups")):
            args = args[1:]
        scaled = tensor.float() * self._scaler_on(tensor.device).scale_tensor
        if _in_trainer(model):
            model.backward(scaled, *args, **kwargs)  # the user's LightningModule.backward hook
        else:
            scaled.backward(*args, **kwargs)

    # ----- the step: masters, unscale, check, skip -----
    def _wrap(self, optimizer: Any) -> MixedPrecisionOptimizer:
        """The master-weight optimizer, told that its grads come from this plugin's backward()
        (which scaled every loss before the optimizer was wrapped)."""
        raw = _raw(optimizer)
        if self.optimizer is not None:
            if id(raw) != self._wrapped_id:
                raise ValueError(
                    "MixprecPrecision steps one optimizer (the loss scale is applied in "
                    f"backward, before Lightning names it); got a second: {type(raw).__name__}."
                )
            self.optimizer.note_scaled_backward()
            return self.optimizer
        mp = prepare_optimizer(raw, self.policy)
        # Fabric's and the Trainer's optimizer wrappers zero the grads of param_groups (the
        # masters once wrapped), never the model's lp params: gradients kept past a step (the
        # core's g1 + g2 carry) would add into every later step, a skip's inf grads included.
        # Lightning zeroes before each optimizer step's backward, so nothing is lost by freeing
        # them at the step (accumulate_grad_batches accumulates before the step).
        mp.traits = dataclasses.replace(mp.traits, carries_grads=False)
        device = mp.scaler.scale_tensor.device
        mp.scaler = self._scaler_on(device)  # one scale: the one backward multiplied by
        if self._pending is not None:
            mp.load_state_dict(self._pending)
            self._pending = None
        self.optimizer, self._wrapped_id = mp, id(raw)
        mp.note_scaled_backward()
        return mp

    @override
    def optimizer_step(
        self,
        optimizer: Any,
        model: Any = None,
        closure: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the closure (Trainer), then step through the master-weight optimizer."""
        if kwargs:
            raise TypeError(f"MixprecPrecision.optimizer_step takes no step kwargs, got {kwargs}.")
        closure_result = closure() if closure is not None else None
        if _in_trainer(model):
            if closure_result is None and model.automatic_optimization:
                return None  # training_step returned None: no backward ran, nothing to step
            self._after_closure(model, optimizer)  # on_before_optimizer_step + clipping
        self._wrap(optimizer).step()
        return closure_result

    @override
    def main_params(self, optimizer: Any) -> Generator[torch.Tensor, None, None]:
        """The fp32 masters (and fp32 params) the optimizer steps: clip these."""
        for group in self._wrap(optimizer).param_groups:
            yield from group["params"]

    @override
    def unscale_gradients(self, optimizer: Any) -> None:
        self._wrap(optimizer).unscale_grads()  # grads reach the masters, unscaled and checked

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        self._wrap(optimizer).clip_grad_norm(clip_val)  # the core's clip validates it

    @override
    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        self.unscale_gradients(optimizer)
        torch.nn.utils.clip_grad_value_(list(self.main_params(optimizer)), clip_val)

    # ----- checkpoints: masters, scaler and counters travel in Lightning's checkpoint -----
    @override
    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is not None:
            return self.optimizer.state_dict()
        return self._pending or {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state_dict)
        else:
            self._pending = dict(state_dict)  # applied when the optimizer is first seen
            if self.scaler is not None:
                self.scaler.load_state_dict(state_dict["scaler"])

    @property
    def skip_stats(self) -> Any:
        """The optimizer's step and skip counts (None before the first step)."""
        return None if self.optimizer is None else self.optimizer.skip_stats
