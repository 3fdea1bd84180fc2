"""Float8Linear: nn.Linear whose three GEMMs run in float8 through one autograd.Function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from mixprec.fp8.casts import cast_to_fp8
from mixprec.fp8.config import LP_FORWARD_DTYPE, TELEMETRY_ATTR, Float8Config
from mixprec.fp8.kernels import (
    ROWWISE_KERNEL_RECIPES,
    cpu_has_rowwise_scaled_mm,
    cpu_has_scaled_mm,
    lp_gemm,
    resolve_emulate,
)
from mixprec.fp8.recipes import recipe_gemm


class _Float8LinearFn(torch.autograd.Function):
    """input (M, K) @ weight (N, K)^T with all three GEMMs in float8; see the module docstring.

    forward / setup_context style (not forward(ctx, ...)): torch.func transforms (grad, vmap)
    accept only this style. So the GEMM operands and inverse scales backward reuses leave
    forward as extra, non-differentiable outputs; Float8Linear.forward keeps the first.

    Emulated GEMMs under torch.compile hand backward the operands upcast to fp32, not the
    float8 copies: in one graph holding forward and backward (compile_step) inductor would
    otherwise inline each float8 cast into both of its upcasts and round every activation to
    float8 twice (measured on a 4-block ViT: 1.9x the casts of torch.compile(model)'s split
    graphs, and a 0.96x slower step); torch.compile(model) gets faster too (2-block fp8 ViT,
    one CPU thread: 485 -> 449 ms a step), as its partitioner is free to keep either. Eager
    keeps the 1-byte float8 copies (memory). The values, and so the numerics, are equal.
    """

    @staticmethod
    @override
    def forward(  # type: ignore[override]
        hp_input: torch.Tensor,
        hp_weight: torch.Tensor,
        input_history: torch.Tensor | None,
        weight_history: torch.Tensor | None,
        grad_history: torch.Tensor | None,
        out_dtype: torch.dtype,
        config: Float8Config,
        emulate: bool,
        record: bool,
    ) -> tuple[torch.Tensor, ...]:
        # Autocast off inside: the CPU _scaled_mm is upcast-scale-matmul, and autocast would run
        # that matmul in bf16 (measured: half the outputs moved); emulation's must stay fp32 too.
        with torch.autocast(hp_input.device.type, enabled=False):
            lp_input, input_inv = cast_to_fp8(
                hp_input, LP_FORWARD_DTYPE, input_history, config, record=record
            )
            lp_weight, weight_inv = cast_to_fp8(
                hp_weight, LP_FORWARD_DTYPE, weight_history, config, record=record
            )
            if emulate and torch.compiler.is_compiling():  # see the class docstring
                lp_input, lp_weight = _upcast(lp_input), _upcast(lp_weight)
            out = lp_gemm(
                lp_input,
                lp_weight.t(),
                input_inv,
                weight_inv,
                out_dtype,
                emulate=emulate,
                use_fast_accum=config.use_fast_accum_forward,
            )
        return out, lp_input, lp_weight, input_inv, weight_inv

    @staticmethod
    @override
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        hp_input, hp_weight, _, _, grad_history, _, config, emulate, record = inputs
        _, lp_input, lp_weight, input_inv, weight_inv = output
        ctx.mark_non_differentiable(lp_input, lp_weight, input_inv, weight_inv)
        # Saving the float8 copies (1 byte per element) is what backward needs: the spec'd GEMMs
        # reuse the forward's e4m3 input and weight, not fresh casts (compiled emulation: their
        # exact fp32 upcasts, see the class docstring).
        ctx.save_for_backward(lp_input, lp_weight, input_inv, weight_inv)
        ctx.grad_history = grad_history
        ctx.hp_dtypes = (hp_input.dtype, hp_weight.dtype)
        ctx.config, ctx.emulate, ctx.record = config, emulate, record

    @staticmethod
    @override
    def backward(ctx: Any, grad_out: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        with torch.autocast(grad_out.device.type, enabled=False):  # as in forward
            lp_input, lp_weight, input_inv, weight_inv = ctx.saved_tensors
            input_dtype, weight_dtype = ctx.hp_dtypes
            # A backward records the grad amax exactly when its forward recorded.
            lp_grad, grad_inv = cast_to_fp8(
                grad_out, ctx.config.lp_grad_dtype, ctx.grad_history, ctx.config, record=ctx.record
            )
            if ctx.emulate:  # both GEMMs read one upcast, not one each
                lp_grad = _upcast(lp_grad)
            grad_input = grad_weight = None
            fast = {"emulate": ctx.emulate, "use_fast_accum": ctx.config.use_fast_accum_backward}
            if ctx.needs_input_grad[0]:
                grad_input = lp_gemm(lp_grad, lp_weight, grad_inv, weight_inv, input_dtype, **fast)
            if ctx.needs_input_grad[1]:
                grad_weight = lp_gemm(
                    lp_grad.t(), lp_input, grad_inv, input_inv, weight_dtype, **fast
                )
            return grad_input, grad_weight, None, None, None, None, None, None, None


class _RecipeLinearFn(torch.autograd.Function):
    """input (M, K) @ weight (N, K)^T under a recipe other than tensorwise (recipes.recipe_gemm:
    rowwise on torch._scaled_mm where the device has it, else emulated).

    The three GEMMs quantize their operands as mixprec.fp8.recipes.RECIPE_OPERANDS says, each
    from the high-precision tensor (a columnwise operand is not requantized from a rowwise
    float8 copy), so backward keeps the high-precision input and weight.
    """

    @staticmethod
    @override
    def forward(  # type: ignore[override]
        hp_input: torch.Tensor,
        hp_weight: torch.Tensor,
        out_dtype: torch.dtype,
        config: Float8Config,
    ) -> torch.Tensor:
        with torch.autocast(hp_input.device.type, enabled=False):  # as _Float8LinearFn
            return recipe_gemm("forward", hp_input, hp_weight, config, out_dtype)

    @staticmethod
    @override
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        hp_input, hp_weight, _, config = inputs
        ctx.save_for_backward(hp_input, hp_weight)
        ctx.config = config

    @staticmethod
    @override
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with torch.autocast(grad_out.device.type, enabled=False):
            hp_input, hp_weight = ctx.saved_tensors
            grad_input = grad_weight = None
            if ctx.needs_input_grad[0]:
                grad_input = recipe_gemm(
                    "grad_input", grad_out, hp_weight.t(), ctx.config, hp_input.dtype
                )
            if ctx.needs_input_grad[1]:
                grad_weight = recipe_gemm(
                    "grad_weight", grad_out.t(), hp_input.t(), ctx.config, hp_weight.dtype
                )
            return grad_input, grad_weight, None, None


def _upcast(lp: torch.Tensor) -> torch.Tensor:
    """A float8 GEMM operand in fp32, exactly (emulation's GEMM upcasts it anyway)."""
    return lp.to(torch.float32)


def _autocast_dtype_or(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The surrounding autocast's dtype on this device type, else `dtype`."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return dtype


HISTORY_NAMES = ("input_amax_history", "weight_amax_history", "grad_amax_history")


class Float8Linear(nn.Linear):
    """nn.Linear whose GEMMs run in float8; same parameters, same state_dict keys.

    config.recipe chooses the scaling (mixprec.fp8.recipes): tensorwise runs torch._scaled_mm
    where the device has it (else emulates, as Float8Config.emulate says); rowwise and
    rowwise_with_gw_hp run it with rowwise scales where the device has that (CUDA sm_89+, bf16
    outputs), else emulate (logged once); blockwise, mxfp8 and nvfp4 are emulated on every
    device (quantize -> dequantize to fp32 -> fp32 GEMM; logged once per device type and
    recipe). Every recipe but tensorwise keeps the high-precision input and weight for backward.

    The output dtype is the surrounding autocast's dtype when autocast is on, else the input's;
    the bias is added in that dtype.

    Delayed scaling keeps one float32 amax history buffer per tensor (input, weight, grad).
    When the history is written: a forward records the input and weight amaxes if and only if
    `self.training and torch.is_grad_enabled()` at the call, and its backward records the grad
    amax if and only if that forward recorded. Every other forward (eval mode, torch.no_grad,
    torch.inference_mode) reads the history and leaves it bitwise unchanged; while the history is
    still all zeros it scales by the current amax without recording it. So a validation pass
    does not move the training scales, and reentrant activation checkpointing (a no-grad first
    pass, then a grad-enabled recompute) records once per step, with the same scales in both
    passes. Non-reentrant checkpointing (use_reentrant=False) runs both passes with grad enabled:
    it records twice, and its recompute scales from a history one entry newer.

    The histories stay float32 through `.half()`, `.bfloat16()` and `.to(dtype)` (device moves
    still apply): an amax above 65504 would be inf in fp16 and zero the scale.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        config: Float8Config | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if config is not None and not isinstance(config, Float8Config):
            raise TypeError(f"config must be a Float8Config or None, got {config!r}.")
        self.config = config if config is not None else Float8Config()
        # Probe now: under torch.compile the cached answers are read, not traced.
        cpu_has_scaled_mm()
        cpu_has_rowwise_scaled_mm()
        self._register_histories(device)

    def _register_histories(self, device: torch.device | str | None) -> None:
        delayed = self.config.scaling == "delayed"  # tensorwise only (Float8Config checks)
        for name in HISTORY_NAMES:
            history = (
                torch.zeros(self.config.amax_history_len, dtype=torch.float32, device=device)
                if delayed
                else None
            )
            self.register_buffer(name, history, persistent=self.config.persist_amax_history)

    @classmethod
    def from_float(cls, linear: nn.Linear, config: Float8Config | None = None) -> Float8Linear:
        """A Float8Linear sharing `linear`'s Parameter objects (optimizers keep pointing at them)."""
        with torch.device("meta"):  # no throwaway init of a weight we replace right away
            new = cls(linear.in_features, linear.out_features, bias=False, config=config)
        new.weight = linear.weight
        new.bias = linear.bias
        new._register_histories(linear.weight.device)
        new.train(linear.training)
        return new

    def hp_weight_out_in(self) -> torch.Tensor:
        """The weight as the GEMM takes it, (out_features, in_features): nn.Linear's layout."""
        return self.weight

    @override
    def forward(self, hp_input: torch.Tensor) -> torch.Tensor:
        device_type = hp_input.device.type
        out_dtype = _autocast_dtype_or(device_type, hp_input.dtype)
        hp_2d = hp_input.reshape(-1, self.in_features)
        if self.config.recipe != "tensorwise":
            out = _RecipeLinearFn.apply(hp_2d, self.hp_weight_out_in(), out_dtype, self.config)
        else:
            emulate = resolve_emulate(hp_input.device, self.config)
            # Only a training step writes the history; see the class docstring for the rule.
            record = self.training and torch.is_grad_enabled()
            out, *_ = _Float8LinearFn.apply(
                hp_2d,
                self.hp_weight_out_in(),
                self.input_amax_history,
                self.weight_amax_history,
                self.grad_amax_history,
                out_dtype,
                self.config,
                emulate,
                record,
            )
        observer = self.__dict__.get(TELEMETRY_ATTR)
        if observer is not None and self.training and torch.is_grad_enabled():
            telemetry, name = observer  # a Float8Telemetry: reads copies only (see its module)
            hook = telemetry.on_forward(name, self.config, hp_2d, self.hp_weight_out_in())
            if hook is not None and out.requires_grad:
                out.register_hook(hook)
        out = out.reshape(*hp_input.shape[:-1], self.out_features)
        if self.bias is not None:
            # The bias stays out of float8: its gradient is a plain sum in the output dtype.
            out = out + self.bias.to(out_dtype)
        return out

    @override
    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """nn.Module._apply, except that the amax histories keep float32 (only devices move)."""
        hp_histories = {name: getattr(self, name) for name in HISTORY_NAMES}
        module = super()._apply(fn, recurse)
        for name, hp_history in hp_histories.items():
            moved = self._buffers.get(name)
            if hp_history is not None and moved is not None and moved.dtype != hp_history.dtype:
                # Move the fp32 original, not the converted copy: an fp16 round trip would have
                # turned amaxes above 65504 into inf and rounded the rest.
                self._buffers[name] = hp_history.to(device=moved.device)
        return module

    @override
    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        for name in HISTORY_NAMES:
            if prefix + name in missing_keys:  # a plain nn.Linear checkpoint: restart the history
                missing_keys.remove(prefix + name)
                getattr(self, name).zero_()

    @override
    def extra_repr(self) -> str:
        c = self.config
        if c.recipe != "tensorwise":
            emulate = c.emulate if c.recipe in ROWWISE_KERNEL_RECIPES else True
            return f"{super().extra_repr()}, recipe={c.recipe}, emulate={emulate}"
        scaling = f"delayed(len={c.amax_history_len})" if c.scaling == "delayed" else c.scaling
        grad = c.grad_dtype or "e5m2"
        group = "" if c.amax_group is None else f", amax_group={c.amax_group!r}"
        return f"{super().extra_repr()}, scaling={scaling}, grad={grad}, emulate={c.emulate}{group}"


def is_hf_conv1d(module: nn.Module) -> bool:
    """Whether `module` is Hugging Face's transformers.pytorch_utils.Conv1D (GPT-2's Linears).

    Checked by name so that mixprec never imports transformers.
    """
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")


class Float8Conv1D(Float8Linear):
    """Hugging Face's Conv1D (GPT-2's attention and MLP layers) with its GEMMs in float8.

    Conv1D is a Linear whose weight is stored transposed, (in_features, out_features), and whose
    forward is x @ weight + bias. This layer keeps that Parameter object as it is (same
    state_dict key and shape, so HF checkpoints load and optimizers keep pointing at it) and
    hands the GEMM `weight.t()`, a view, so the gradient lands on the original layout.
    """

    @classmethod
    def from_conv1d(cls, conv1d: nn.Module, config: Float8Config | None = None) -> Float8Conv1D:
        """A Float8Conv1D sharing `conv1d`'s weight (in, out) and bias Parameter objects."""
        in_features, out_features = conv1d.weight.shape
        with torch.device("meta"):  # no throwaway init of a weight we replace right away
            new = cls(in_features, out_features, bias=False, config=config)
        new.weight = conv1d.weight
        new.bias = conv1d.bias
        new.nf = out_features  # Conv1D's own attribute name, read by HF's pruning helpers
        new._register_histories(conv1d.weight.device)
        new.train(conv1d.training)
        return new

    @override
    def hp_weight_out_in(self) -> torch.Tensor:
        return self.weight.t()  # a view: (in, out) storage seen as (out, in), no copy
