"""PaddlePaddle's dynamic-graph AMP names on mixprec's core: auto_cast, decorate (GradScaler: grad_scaler.py).

    import mixprec.paddle as amp                      # paddle.amp

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    model, optimizer = amp.decorate(models=model, optimizers=optimizer, level="O2")
    scaler = amp.GradScaler(init_loss_scaling=1024)
    for x, y in loader:
        with amp.auto_cast(level="O2"):
            loss = mse(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()                         # Paddle: optimizer.clear_grad()

Levels of `auto_cast`, on Paddle 3.3.1's default lists (paddle.amp.white_list() and
black_list(), mixprec.paddle.op_names) in torch's op names; Paddle's names ('elementwise_add',
'matmul_v2', 'pool2d', ...) are accepted in the custom lists, a fused Paddle kernel is refused
with its reason:

    O0  nothing is cast: torch's autocast off, op lists suspended.
    OD  Paddle's white list (matmul/linear/conv2d/einsum/...) runs low; every other op that
        computes (GEMM_OPS, COMPUTE_OPS, NORM_OPS) runs in fp32 (inputs cast up). Ops in no
        list (views, reshapes, indexing) move data and keep their input dtype.
    O1  Paddle's white list low and its O1 black list (mean, softmax, losses, norms, exp/log,
        interpolation, embedding, ...) in fp32, over torch.autocast's own lists.
    O2  use_promote=True (Paddle 3's default): the white list low, Paddle's O2 black list
        (interpolation, embedding, scatter) and NORM_OPS in fp32, and an op in neither list
        runs in its widest input's dtype (torch's type promotion; torch.autocast's own lists
        still apply). use_promote=False (the seed's O2): GEMM_OPS and COMPUTE_OPS run low, their
        fp32 inputs cast down; only NORM_OPS and the black list in fp32. Layers `decorate` kept
        in fp32 (norm layers, excluded_layers) run in an fp32_region either way.
    In every level the custom white list runs low and the custom black list fp32.
    A Conv layer's bias is added by its own add after the convolution, as Paddle's Conv layers
    do, so under O1, OD and O2 with use_promote an fp32 bias (a layer decorate did not cast)
    makes the layer's output fp32 (tests/test_paddle_promote.py holds Paddle 3.3.1's dtypes).

`decorate(..., level='O2')` casts the models in place (norm layers and excluded_layers stay
fp32). With optimizers (master_weight None or True) each one is wrapped in a
`MasterWeightOptimizer`: its param_groups hold fp32 master weights, initialised from the fp32
values the parameters had before the cast, and the low-precision gradients are moved into fp32
master gradients during backward, so any GradScaler (torch's, mixprec's or this module's)
unscales and checks fp32 tensors. Without optimizers (Paddle's pure fp16, seed 002's O2 loop)
the optimizer built earlier steps the low-precision parameters directly; use this module's
`GradScaler` then: torch's refuses to unscale float16 gradients.

Differences from Paddle, each deliberate:
- OD keeps data-movement ops in their input dtype (Paddle casts every non-white op to fp32);
  all arithmetic still runs in fp32.
- O2 with use_promote promotes through torch's type promotion and keeps torch.autocast's own
  fp32 list (on CUDA: exp, log, softmax, sum, ... run fp32 where Paddle runs fp16 inputs low).
- nn.Linear is one white-listed op (low at every level), as Paddle 3.3.1's linear_v2 on its
  CUDA builds; Paddle's CPU builds, FLAGS_use_legacy_linear and Paddle < 3.3.1 add the bias by
  its own op (then an fp32 bias gives an fp32 output, as for Conv here).
- All norm layers stay fp32 in O2 (Paddle keeps LayerNorm/InstanceNorm bf16 under bfloat16).
- Nested auto_cast contexts add their lists to the enclosing ones (mixprec.autocast's rule);
  Paddle's replace them. O0 / enable=False inside any level turns everything off, as Paddle.
- master_grad: fp32 master gradients are always kept (they accumulate in fp32 across
  micro-batches), so master_grad=False behaves as True; it needs master weights to exist.
- Loading a model state_dict into a model decorated with master weights also loads the fp32
  masters (at full precision when the checkpoint holds fp32 tensors, e.g. save_dtype='float32').
- decorate(level='O1') changes nothing, as Paddle's; O2-only options passed with it are logged.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 - torch's own alias
from torch.overrides import TorchFunctionMode
from typing_extensions import override

from mixprec.core.autocast import autocast, fp16_guard, fp32, is_fp32_module, resolve_ops
from mixprec.core.casting import NORM_TYPES, cast_module
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import UNIT_SCALE, did_you_mean, to_low_dtype
from mixprec.core.scaling import rank_and_world
from mixprec.core.validate import check_module_has_parameters
from mixprec.paddle import op_names

log = logging.getLogger("mixprec")

LEVELS: tuple[str, ...] = ("O0", "OD", "O1", "O2")
"""auto_cast levels, as Paddle names them."""
DECORATE_LEVELS: tuple[str, ...] = ("O1", "O2")
"""decorate levels: O1 changes nothing, O2 casts the models."""
DTYPES: tuple[str, ...] = ("float16", "bfloat16")
"""Low-precision dtypes by Paddle's names (torch.float16 / torch.bfloat16 are accepted too)."""
SAVE_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
"""decorate(save_dtype=...) choices: the dtype state_dict() returns floating tensors in."""

GEMM_OPS: tuple[str, ...] = (
    # torch.autocast's low-precision GEMM/conv ops: Paddle's default white list
    # (conv2d, matmul, matmul_v2, mul, einsum) in torch's vocabulary.
    *("addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "conv1d"),
    *("conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
    *("einsum", "linear", "matmul", "mm", "mv", "scaled_dot_product_attention"),
)
"""Ops every enabled level runs low (tensor-core work)."""
COMPUTE_OPS: tuple[str, ...] = (
    # elementwise arithmetic and math
    *("add", "sub", "mul", "div", "neg", "abs", "pow", "sqrt", "rsqrt", "square", "exp"),
    *("expm1", "log", "log1p", "log2", "log10", "reciprocal", "sin", "cos", "tan", "sinh"),
    *("cosh", "tanh", "asin", "acos", "atan", "atan2", "erf", "erfc", "erfinv", "maximum"),
    *("minimum", "clamp", "where", "addcmul", "addcdiv", "lerp"),
    # activations
    *("relu", "relu6", "leaky_relu", "elu", "selu", "celu", "gelu", "silu", "mish"),
    *("sigmoid", "softplus", "softsign", "hardtanh", "tanhshrink", "prelu", "glu"),
    # reductions, softmax, distances
    *("sum", "mean", "prod", "cumsum", "cumprod", "var", "std", "norm", "amax", "amin"),
    *("logsumexp", "softmax", "log_softmax", "softmin", "normalize", "cdist", "dist"),
    *("renorm", "cosine_similarity", "bilinear", "tensordot", "dot", "inner", "outer"),
    # losses
    *("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "cross_entropy", "nll_loss"),
    *("kl_div", "binary_cross_entropy", "binary_cross_entropy_with_logits"),
    "cosine_embedding_loss",
    # pooling, dropout, embedding, joining, resampling
    *("avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d"),
    *("adaptive_avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d", "dropout"),
    *("embedding", "cat", "stack", "interpolate"),
)
"""Non-GEMM ops that compute: fp32 under OD, low under O2."""
NORM_OPS: tuple[str, ...] = (
    *("layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm"),
    "local_response_norm",
)
"""Normalisations: fp32 under OD and O2 (their statistics lose accuracy in fp16)."""

_PURE_LP_MARK = "_mixprec_pure_lp"  # on params decorate cast: low-precision grads are intended

_BIASED_LAYER_OPS: dict[str, int] = {
    # torch op taking `bias` third -> its spatial dims (the bias broadcasts over them). Not
    # F.linear: Paddle 3.3.1 runs Linear as one white-listed op (linear_v2) where it has AMP
    # (CUDA builds; FLAGS_use_legacy_linear=0, its default), low like torch's.
    F.conv1d.__name__: 1,
    F.conv2d.__name__: 2,
    F.conv3d.__name__: 3,
    F.conv_transpose1d.__name__: 1,
    F.conv_transpose2d.__name__: 2,
    F.conv_transpose3d.__name__: 3,
}
"""Ops torch fuses with their bias and Paddle's layers run as two ops: the op, then an add."""


def _check_level(level: object, valid: tuple[str, ...]) -> str:
    upper = level.upper() if isinstance(level, str) else level
    if upper not in valid:
        raise ValueError(f"level={level!r} is not a Paddle AMP level." + did_you_mean(level, valid))
    return upper  # type: ignore[return-value]


def _check_dtype(dtype: object) -> torch.dtype:
    try:
        return to_low_dtype(dtype)  # type: ignore[arg-type]
    except ValueError:
        raise ValueError(
            f"dtype={dtype!r} is not a low-precision dtype."
            + did_you_mean(dtype, DTYPES)
            + " (torch.float16, torch.bfloat16 work too)"
        ) from None


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__}).")


@functools.cache
def _base_lists(
    level: str, dtype: str = "float16", use_promote: bool = True
) -> tuple[frozenset[str], frozenset[str]]:
    """(low, fp32) torch ops of a level before the custom lists: Paddle's lists in torch ops."""
    gemm, compute, norm = (resolve_ops(ops) for ops in (GEMM_OPS, COMPUTE_OPS, NORM_OPS))
    if level == "O0":
        return frozenset(), frozenset()
    white, black = op_names.default_lists(level, dtype)
    if level == "OD":  # only the white list low: everything else that computes in fp32
        return white, (gemm | compute | norm) - white
    if level == "O2" and not use_promote:  # seed 002's (Paddle < 2.5's) O2: all low but norms
        return gemm | compute, norm
    if level == "O2":  # promote: unlisted ops take their widest input (torch's promotion)
        return white, (black | norm) - white
    return white, black  # O1: over torch.autocast's own lists


def level_op_lists(
    level: str,
    custom_white_list: Iterable[str | Callable] | None = None,
    custom_black_list: Iterable[str | Callable] | None = None,
    *,
    dtype: str | torch.dtype = "float16",
    use_promote: bool = True,
) -> tuple[frozenset[str], frozenset[str]]:
    """The (low, fp32) op lists auto_cast(level, ...) hands to mixprec.core.autocast.

    Paddle's default white and black lists for level and dtype (paddle.amp.white_list(),
    black_list(), in torch's op names), the custom lists moved in; in O1 and O2 torch.autocast
    decides the ops in neither list (in O0 nothing is cast and the lists are not used).
    use_promote=False gives O2 as the seed (Paddle < 2.5): every computing op low but norms.
    """
    level = _check_level(level, LEVELS)
    dtype_name = _dtype_name(_check_dtype(dtype))
    white = op_names.paddle_ops_to_torch(custom_white_list)
    black = op_names.paddle_ops_to_torch(custom_black_list)
    overlap = white & black
    if overlap:
        raise ValueError(
            f"Ops {sorted(overlap)} are in both custom_white_list and custom_black_list."
        )
    base_white, base_black = _base_lists(level, dtype_name, use_promote)
    return (base_white - black) | white, (base_black - white) | black


class _SeparateBiasMode(TorchFunctionMode):
    """Runs a biased convolution as Paddle's Conv layers do: the op without its bias, then the
    bias added by its own add, which the level's rule types like any add (promote: fp32 when
    the bias is fp32; OD: fp32 always). torch fuses the bias into the white-listed op, which
    would make the whole layer low where Paddle's output is fp32."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.shadowed = 0  # > 0 while an inner auto_cast decides instead

    @override
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # autocast is off in fp32 regions (norm and excluded layers): there the add is fp32 too
        if self.shadowed or not torch.is_autocast_enabled(self.device_type):
            return func(*args, **kwargs)
        out = add_bias_apart(func, args, kwargs)
        return func(*args, **kwargs) if out is None else out


def add_bias_apart(
    func: Any, args: tuple, kwargs: dict, reshape: Any = torch.reshape
) -> torch.Tensor | None:
    """A biased convolution (an op of _BIASED_LAYER_OPS given a bias) run as Paddle's Conv
    layers run it: the op without its bias, then `out + reshape(bias, shape)`, the bias's own
    add broadcast over the channel dim. None for any other call (the caller runs it as given).

    The auto_cast mode and the static face's recording both call this one rule; reshape lets
    the recording keep the bias a parameter of the program."""
    # by name, as mixprec.core.autocast matches ops: dynamo cannot hash every callable
    spatial = _BIASED_LAYER_OPS.get(getattr(func, "__name__", ""))
    if spatial is None:
        return None
    if len(args) > 2:
        bias, args = args[2], (*args[:2], None, *args[3:])
    else:
        bias, kwargs = kwargs.get("bias"), {**kwargs, "bias": None}
    if bias is None:
        return None
    # the channel dim precedes the spatial ones, batched or not
    return func(*args, **kwargs) + reshape(bias, (-1, *([1] * spatial)))


class auto_cast(autocast):  # noqa: N801 - Paddle's name
    """paddle.amp.auto_cast: a mixprec.autocast configured by a Paddle AMP level.

    enable: False runs everything as if no autocast were active (as level O0).
    custom_white_list: ops run in dtype (Paddle or torch names, or torch callables).
    custom_black_list: ops run in fp32.
    level: 'O0', 'OD', 'O1' or 'O2' (see the module docstring; lower case works).
    dtype: 'float16' or 'bfloat16'.
    use_promote: O2 only (Paddle 3's default True): an op in neither list runs in its widest
        input's dtype (fp32 if any input is fp32); False is the seed's older O2, where every
        computing op but the norms runs low.
    device_type: mixprec's addition: the device whose autocast is set; None is 'cuda' when a
    GPU is visible, else 'cpu'.
    A context manager and a decorator, like mixprec.core.autocast.
    """

    def __init__(
        self,
        enable: bool = True,
        custom_white_list: Iterable[str | Callable] | None = None,
        custom_black_list: Iterable[str | Callable] | None = None,
        level: str = "O1",
        dtype: str | torch.dtype = "float16",
        use_promote: bool = True,
        *,
        device_type: str | None = None,
    ) -> None:
        _check_bool("enable", enable)
        _check_bool("use_promote", use_promote)
        self.level = _check_level(level, LEVELS)
        self.use_promote = use_promote
        lp_ops, hp_ops = level_op_lists(
            self.level, custom_white_list, custom_black_list, dtype=dtype, use_promote=use_promote
        )
        super().__init__(
            dtype=_check_dtype(dtype),
            custom_white_list=lp_ops,
            custom_black_list=hp_ops,
            enabled=enable and self.level != "O0",
            device_type=device_type,
        )
        # Where a layer's bias add can take another dtype than its white-listed op: every level
        # that promotes (O1 always, O2 with use_promote) or runs unlisted ops fp32 (OD), and a
        # black-listed add. O2 without promote runs the add low, as torch's fused op.
        self._splits_bias = self.enabled and (self.level != "O2" or use_promote or "add" in hp_ops)

    @override
    def __enter__(self) -> auto_cast:
        # Paddle records the dtype of every auto_cast entered, and keeps it after exit: a
        # dynamic GradScaler reads it (bfloat16 switches the scaler off).
        amp_global_state().amp_dtype = _dtype_name(self.dtype)
        super().__enter__()
        _ACTIVE.stack.append(self)
        # pushed after the region's op-list mode, so the two ops it makes pass through that
        outer = _ACTIVE.bias_modes[-1] if _ACTIVE.bias_modes else None
        mode = _SeparateBiasMode(self.device_type) if self._splits_bias else None
        if outer is not None:  # the innermost auto_cast decides, as with its lists
            outer.shadowed += 1
        if mode is not None:
            mode.__enter__()
        _ACTIVE.bias_modes.append(mode)
        return self

    @override
    def __exit__(self, *exc: object) -> None:
        mode = _ACTIVE.bias_modes.pop()
        if mode is not None:
            mode.__exit__(*exc)
        outer = _ACTIVE.bias_modes[-1] if _ACTIVE.bias_modes else None
        if outer is not None:
            outer.shadowed -= 1
        if _ACTIVE.stack and _ACTIVE.stack[-1] is self:
            _ACTIVE.stack.pop()
        super().__exit__(*exc)

    @override
    def __repr__(self) -> str:
        return (
            f"mixprec.paddle.auto_cast(level={self.level!r}, dtype={self.dtype}, "
            f"use_promote={self.use_promote}, "
            f"enabled={self.enabled}, device_type={self.device_type!r})"
        )


amp_guard = auto_cast
"""Paddle's older name for auto_cast."""


class AmpGlobalState:
    """Paddle's amp_global_state(): the dtype name of the last auto_cast entered, kept after it
    exits (None until one is entered: then no GradScaler is switched off; see
    docs/differences.md, PaddlePaddle)."""

    def __init__(self) -> None:
        self.amp_dtype: str | None = None


_AMP_GLOBAL_STATE = AmpGlobalState()


def amp_global_state() -> AmpGlobalState:
    """The process-wide AMP state Paddle's GradScaler reads (amp_dtype)."""
    return _AMP_GLOBAL_STATE


class _ActiveAutoCasts(threading.local):
    def __init__(self) -> None:
        self.stack: list[auto_cast] = []
        self.bias_modes: list[_SeparateBiasMode | None] = []  # per entered auto_cast


_ACTIVE = _ActiveAutoCasts()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_autocast_enabled(device_type: str | None = None) -> bool:
    """paddle.amp.is_autocast_enabled: True inside an enabled auto_cast of level OD/O1/O2.

    device_type: accepted for Paddle (all devices share one AMP state there); None or a str.
    """
    if device_type is not None and not isinstance(device_type, str):
        raise TypeError(f"device_type={device_type!r} must be a str or None.")
    return bool(_ACTIVE.stack) and _ACTIVE.stack[-1].enabled


def get_autocast_dtype(device_type: str | None = None) -> str:
    """paddle.amp.get_autocast_dtype: the innermost enabled auto_cast's dtype name, else
    'float16' (Paddle's default AMP dtype)."""
    if not is_autocast_enabled(device_type):
        return "float16"
    return _dtype_name(_ACTIVE.stack[-1].dtype)


# ----- decorate -----


class MasterWeightOptimizer(MixedPrecisionOptimizer):
    """MixedPrecisionOptimizer whose fp32 masters receive the gradients during backward.

    Low-precision params get post-accumulate-grad hooks that add their gradient to the master's
    fp32 gradient and free it, so after backward every gradient the optimizer sees lives on an
    fp32 tensor in param_groups: an external GradScaler unscales and checks those. The wrapper
    itself scales nothing (UNIT_SCALE) but still skips a step whose gradients are not finite.

    optimizer: the optimizer over the (already cast) model params.
    hp_values: id(param) -> the fp32 value it had before the cast, to initialise its master
        (default: the master is the low-precision value, widened).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        hp_values: dict[int, torch.Tensor] | None = None,
    ) -> None:
        # The masters' grads stay until clear_grad() (torch's contract: a backward before it
        # adds to them through the hooks), on every device. fused_step=False: the fused pass
        # steps from the lp grads, which the hooks have already moved into the masters' grads.
        super().__init__(
            optimizer,
            loss_scale=UNIT_SCALE,
            master_weights=True,
            keep_master_grads=True,
            fused_step=False,
        )
        self._hp_values = hp_values or {}
        self._hooks: list[Any] = []
        # the masters' grads are None after clear_grad() or zeroed: each hook adds to them
        self.accumulate = self.transfer.accumulate_as_backward(reuse_buffers=False)
        self._hook_pairs(0)
        self._hp_values = {}  # release the pre-cast fp32 tensors: the masters hold the values

    def use_checked_grads(self, found_inf: torch.Tensor) -> None:
        """An outside GradScaler unscaled and checked the masters' grads this step (found_inf,
        reduced over the ranks): the step takes it as this step's overflow flag (the base's
        StepFlags, cleared by the step and zero_grad) instead of checking again."""
        self.step_flags.found_inf = found_inf

    @override
    def _report_skip(self, scale: float) -> None:
        # Own scale is a constant 1: the loss scale lives in the GradScaler, so no host read here.
        if rank_and_world()[0] == 0:
            log.info("mixprec.paddle: non-finite gradients; skipped step %d", self.steps)

    def _hook_pairs(self, start: int) -> None:
        with torch.no_grad():
            for lp, hp in zip(self.lp_params[start:], self.hp_masters[start:], strict=True):
                value = self._hp_values.get(id(lp))
                if value is not None and value.shape == hp.shape:
                    hp.copy_(value)  # the pre-cast fp32 value, not its low-precision rounding
                self._hooks.append(self.accumulate.hook(lp, hp))

    @override
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        start = len(self.lp_params)
        super().add_param_group(param_group)
        self._hook_pairs(start)

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for hp in self.hp_masters:  # masters accumulate: clear them like any param
            if hp.grad is not None:
                if set_to_none:
                    hp.grad = None
                else:
                    hp.grad.zero_()

    def clear_grad(self, set_to_zero: bool = True) -> None:
        """Paddle's name: set_to_zero=False frees the grads (torch's set_to_none=True)."""
        self.zero_grad(set_to_none=not set_to_zero)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the model's params (before discarding this wrapper)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def holds_pure_lp_params(optimizer: torch.optim.Optimizer) -> bool:
    """True when optimizer steps low-precision params that decorate cast (pure fp16/bf16)."""
    return any(
        getattr(p, _PURE_LP_MARK, False) for g in optimizer.param_groups for p in g["params"]
    )


def _as_list(value: Any, kind: type, what: str) -> tuple[list[Any], bool]:
    """(items, given_as_sequence): a single `kind` or a list/tuple of them."""
    if isinstance(value, kind):
        return [value], False
    if isinstance(value, list | tuple) and value and all(isinstance(v, kind) for v in value):
        return list(value), True
    raise TypeError(
        f"{what} must be a {kind.__module__}.{kind.__qualname__} or a non-empty list of them, "
        f"got {value!r}."
    )


def _excluded(
    excluded_layers: Any, models: Sequence[nn.Module]
) -> tuple[set[int], tuple[type[nn.Module], ...]]:
    if excluded_layers is None:
        return set(), ()
    items = (
        list(excluded_layers)
        if isinstance(excluded_layers, list | tuple) and not isinstance(excluded_layers, nn.Module)
        else [excluded_layers]
    )
    instances, types = [], []
    for item in items:
        if isinstance(item, nn.Module):
            instances.append(item)
        elif isinstance(item, type) and issubclass(item, nn.Module):
            types.append(item)
        else:
            raise TypeError(
                f"excluded_layers holds {item!r} ({type(item).__name__}). Valid: an nn.Module "
                "instance, an nn.Module subclass, or a list of them."
            )
    in_models = {id(m) for model in models for m in model.modules()}
    for module in instances:
        if id(module) not in in_models:
            raise ValueError(
                f"excluded_layers holds {type(module).__name__} {module!r}, which is not a "
                "submodule of the models being decorated."
            )
    return {id(m) for m in instances}, tuple(types)


def _fp32_roots(
    model: nn.Module, excluded_ids: set[int], excluded_types: tuple[type[nn.Module], ...]
) -> list[nn.Module]:
    """Outermost modules to keep fp32: norm layers, excluded layers, @fp32-marked ones."""
    roots: dict[int, nn.Module] = {}

    def visit(module: nn.Module) -> None:
        if (
            id(module) in excluded_ids
            or isinstance(module, excluded_types + NORM_TYPES)
            or is_fp32_module(module)
        ):
            roots[id(module)] = module  # its whole subtree stays fp32, hooked once here
            return
        for child in module.children():
            visit(child)

    visit(model)
    return list(roots.values())


def _cast_model_o2(
    model: nn.Module,
    lp_dtype: torch.dtype,
    excluded_ids: set[int],
    excluded_types: tuple[type[nn.Module], ...],
) -> dict[int, torch.Tensor]:
    """Cast model in place; returns id(param) -> its fp32 value before the cast."""
    roots = _fp32_roots(model, excluded_ids, excluded_types)
    for module in roots:
        if not is_fp32_module(module):
            fp32(module)  # forward in an fp32_region: O2's lists would cast its weights down
    root_ids = {id(m) for m in roots}
    hp_values = {id(p): p.data for p in model.parameters() if p.dtype == torch.float32}
    cast_module(model, lp_dtype, keep_norm_fp32=False, keep_fp32=lambda _, m: id(m) in root_ids)
    cast = {}
    for p in model.parameters():
        if p.dtype == lp_dtype and id(p) in hp_values:
            setattr(p, _PURE_LP_MARK, True)
            cast[id(p)] = hp_values[id(p)]
    return cast


def _save_dtype_hook(
    dtype: torch.dtype, module: nn.Module, state_dict: dict[str, Any], prefix: str, _: Any
) -> None:
    for key, value in state_dict.items():
        if key.startswith(prefix) and isinstance(value, torch.Tensor) and value.is_floating_point():
            state_dict[key] = value.to(dtype)


def _load_masters_hook(
    masters: dict[str, torch.Tensor],
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    *_: Any,
) -> None:
    # The masters are what the optimizer steps: loading only the low-precision params would be
    # undone by the next step's master -> param copy.
    with torch.no_grad():
        for name, hp in masters.items():
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.shape == hp.shape:
                hp.copy_(value)


_warned_no_optimizer = False


def _warn_pure_lp_once(lp_dtype: torch.dtype) -> None:
    global _warned_no_optimizer
    if not _warned_no_optimizer:
        _warned_no_optimizer = True
        log.warning(
            "mixprec.paddle.decorate(level='O2') without optimizers: an optimizer built over "
            "these parameters steps them in %s directly (pure %s, no fp32 master weights), as "
            "Paddle does. Pass decorate(models, optimizers) for fp32 master weights; unscale "
            "float16 gradients with mixprec.paddle.GradScaler.",
            *[str(lp_dtype).removeprefix("torch.")] * 2,
        )


def decorate(
    models: nn.Module | Sequence[nn.Module],
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    level: str = "O1",
    dtype: str | torch.dtype = "float16",
    master_weight: bool | None = None,
    save_dtype: str | torch.dtype | None = None,
    master_grad: bool = False,
    excluded_layers: nn.Module | type[nn.Module] | Sequence[Any] | None = None,
) -> Any:
    """paddle.amp.decorate: cast models for pure low precision (O2) and wire fp32 masters.

    models: an nn.Module or a list of them (before any DistributedDataParallel wrapping).
    optimizers: None, a torch optimizer, or a list of them, built over the models' params.
    level: 'O1' (the default, as Paddle 3.x: nothing changes) or 'O2' (params cast to dtype;
        norm layers stay fp32).
    dtype: 'float16' or 'bfloat16'.
    master_weight: O2 with optimizers: None or True wraps each in a MasterWeightOptimizer
        (fp32 masters); False leaves the optimizers stepping the low-precision params.
    save_dtype: None, 'float16', 'bfloat16', 'float32' or 'float64': the dtype the models'
        state_dict() returns floating tensors in (load_state_dict takes any of them).
    master_grad: accepted for Paddle; masters always get fp32 grads. True needs masters.
    excluded_layers: a module instance, an nn.Module subclass, or a list of them: kept fp32.
    Returns the models, or (models, optimizers) when optimizers are given, each as given
    (single or list); models are the same objects, cast in place.
    """
    level = _check_level(level, DECORATE_LEVELS)
    lp_dtype = _check_dtype(dtype)
    if master_weight is not None:
        _check_bool("master_weight", master_weight)
    _check_bool("master_grad", master_grad)
    hp_save_dtype = _check_save_dtype(save_dtype)
    model_list, models_seq = _as_list(models, nn.Module, "models")
    for index, model in enumerate(model_list):
        check_module_has_parameters(f"models[{index}]" if models_seq else "models", model)
    opt_list, opts_seq = (
        ([], False)
        if optimizers is None
        else _as_list(optimizers, torch.optim.Optimizer, "optimizers")
    )

    def result(new_opts: list[Any]) -> Any:
        out_models = type(models)(model_list) if models_seq else model_list[0]
        if optimizers is None:
            return out_models
        return out_models, (type(optimizers)(new_opts) if opts_seq else new_opts[0])

    if level == "O1":
        ignored = {
            "master_weight": master_weight,
            "save_dtype": save_dtype,
            "master_grad": master_grad or None,
            "excluded_layers": excluded_layers,
        }
        ignored = {k: v for k, v in ignored.items() if v is not None}
        if ignored:
            log.warning("mixprec.paddle.decorate(level='O1') changes nothing; ignored %s", ignored)
        return result(opt_list)

    for model in model_list:
        if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            raise RuntimeError(  # RuntimeError as Paddle's for paddle.DataParallel
                f"decorate got a {type(model).__name__}: for distributed AMP training, decorate "
                "the model first, then wrap it."
            )
    use_masters = bool(opt_list) and master_weight is not False
    if master_grad and not use_masters:
        raise ValueError(
            "master_grad=True keeps fp32 gradients on fp32 master weights, and there are none: "
            f"optimizers={optimizers!r}, master_weight={master_weight!r}. Pass optimizers "
            "(master_weight None or True), or master_grad=False."
        )
    excluded_ids, excluded_types = _excluded(excluded_layers, model_list)
    hp_values: dict[int, torch.Tensor] = {}
    for model in model_list:
        hp_values.update(_cast_model_o2(model, lp_dtype, excluded_ids, excluded_types))
        if hp_save_dtype is not None:
            model.register_state_dict_post_hook(functools.partial(_save_dtype_hook, hp_save_dtype))
    if not opt_list:
        _warn_pure_lp_once(lp_dtype)
    if not use_masters:
        return result(opt_list)
    wrapped = [MasterWeightOptimizer(opt, hp_values=hp_values) for opt in opt_list]
    lp_to_master = {
        id(lp): hp for w in wrapped for lp, hp in zip(w.lp_params, w.hp_masters, strict=True)
    }
    for model in model_list:
        masters = {
            n: lp_to_master[id(p)] for n, p in model.named_parameters() if id(p) in lp_to_master
        }
        if masters:
            model.register_load_state_dict_pre_hook(functools.partial(_load_masters_hook, masters))
    return result(wrapped)


amp_decorate = decorate
"""Paddle's older name for decorate."""


def _check_save_dtype(save_dtype: object) -> torch.dtype | None:
    if save_dtype is None:
        return None
    if isinstance(save_dtype, torch.dtype) and save_dtype in SAVE_DTYPES.values():
        return save_dtype
    if isinstance(save_dtype, str) and save_dtype in SAVE_DTYPES:
        return SAVE_DTYPES[save_dtype]
    raise ValueError(
        f"save_dtype={save_dtype!r} is not supported."
        + did_you_mean(save_dtype, [*SAVE_DTYPES, "None"])
    )


__all__ = [
    "COMPUTE_OPS",
    "DECORATE_LEVELS",
    "DTYPES",
    "GEMM_OPS",
    "LEVELS",
    "NORM_OPS",
    "SAVE_DTYPES",
    "MasterWeightOptimizer",
    "amp_decorate",
    "amp_global_state",
    "amp_guard",
    "auto_cast",
    "decorate",
    "fp16_guard",
    "get_autocast_dtype",
    "holds_pure_lp_params",
    "is_autocast_enabled",
    "level_op_lists",
]
