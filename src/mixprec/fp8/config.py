"""Float8Config and the float8 formats and constants the other modules share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

from mixprec.core.policy import did_you_mean

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

LP_FORWARD_DTYPE = torch.float8_e4m3fn
"""Inputs and weights: 3 mantissa bits, range +-448 (precision matters more than range)."""
LP_GRAD_DTYPES: dict[str, torch.dtype] = {
    "e5m2": torch.float8_e5m2,
    "e4m3": torch.float8_e4m3fn,
}
"""Gradient formats: e5m2 (TE's HYBRID, default) trades a mantissa bit for range +-57344."""
AMAX_EPS = 1e-12
"""Floor on amax: an all-zero tensor gets a finite scale (its fp8 image is zeros anyway)."""
GEMM_ALIGN = 16
"""cuBLASLt's float8 GEMMs need the K and N dims of torch._scaled_mm divisible by 16."""
TELEMETRY_ATTR = "_mixprec_fp8_telemetry"
"""The Float8Linear attribute holding (Float8Telemetry, layer name) while one is attached."""


def misaligned_features(in_features: int, out_features: int) -> str | None:
    """Why a Linear of these features cannot run float8 GEMMs (in_features or out_features not
    a multiple of GEMM_ALIGN; says which), or None: the rule default_fp8_filter and the
    telemetry recommender share."""
    bad = [
        f"{name}={value}"
        for name, value in (("in_features", in_features), ("out_features", out_features))
        if value % GEMM_ALIGN
    ]
    if bad:
        return f"{' and '.join(bad)} not a multiple of {GEMM_ALIGN} (float8 GEMM alignment)"
    return None


Scaling = Literal["dynamic", "delayed"]
SCALINGS: tuple[str, ...] = get_args(Scaling)

Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8", "nvfp4"]
RECIPES: tuple[str, ...] = get_args(Recipe)
"""The float8 recipes (what each scales: see mixprec.fp8.recipes), declared once here."""

AmaxGroupName = Literal["world"]
AMAX_GROUP_NAMES: tuple[str, ...] = get_args(AmaxGroupName)
"""Float8Config.amax_group's names for a group (besides None and a ProcessGroup object)."""

MXScaleMode = Literal["rceil", "floor", "ceil", "even"]
MX_SCALE_MODES: tuple[str, ...] = get_args(MXScaleMode)
"""OCP MX scale rounding (torchao's ScaleCalculationMode names; see quantize_mxfp8)."""

RECIPE_GRAD_DTYPES: dict[str, str] = {
    "tensorwise": "e5m2",
    "rowwise": "e4m3",
    "rowwise_with_gw_hp": "e4m3",
    "blockwise": "e4m3",
    "mxfp8": "e4m3",
}
"""Gradient format per float8 recipe when grad_dtype is None: TE's HYBRID for tensorwise;
e4m3 where torchao (rowwise, MX) and TE / DeepSeek-V3 (blockwise) use it. nvfp4 has none:
its gradients are E2M1."""


@dataclass(frozen=True, kw_only=True)
class Float8Config:
    """How Float8Linear scales and where it runs its float8 GEMMs."""

    recipe: Recipe = "tensorwise"
    """What gets a scale: 'tensorwise' (one per tensor; `scaling` picks dynamic or delayed),
    'rowwise' / 'rowwise_with_gw_hp' (one per row of each GEMM operand, torchao's meaning; the
    latter runs the weight-gradient GEMM in high precision), 'blockwise' (1x128 tiles for
    activations and gradients, 128x128 blocks for weights: TE's Float8BlockScaling and
    DeepSeek-V3), 'mxfp8' (1x32 blocks, E8M0 scales), 'nvfp4' (E2M1 values, 16-element blocks
    with e4m3 scales and an fp32 global scale; 16x16 weight blocks; stochastically rounded
    gradients). See mixprec.fp8.recipes for each recipe's GEMM operands."""
    scaling: Scaling = "dynamic"
    """'dynamic': scale from this call's amax. 'delayed': from the max of the amax history.
    Tensorwise only: every other recipe scales each block from its own amax on every call."""
    amax_history_len: int = 16
    """Delayed scaling: how many past amaxes (one per call) the scale is taken over."""
    margin: int = 0
    """Scale down by 2**margin below the fp8 maximum (headroom for growth between calls)."""
    power_of_two_scale: bool | None = None
    """Round each scale down to a power of two: scaling is then exact, only the cast rounds.
    None: the recipe's default (False for tensorwise; True for rowwise, rowwise_with_gw_hp
    and blockwise, as torchao and TE). mxfp8 scales are powers of two by construction and
    nvfp4's e4m3 scales never are: both refuse a value here."""
    grad_dtype: Literal["e5m2", "e4m3"] | None = None
    """float8 format of the incoming gradient in backward. None: the recipe's default
    (RECIPE_GRAD_DTYPES: e5m2 for tensorwise, e4m3 for the others); nvfp4 refuses a value."""
    mx_scale_mode: MXScaleMode = "rceil"
    """mxfp8: how a block's E8M0 scale is rounded (torchao's ScaleCalculationMode): 'rceil'
    (cuBLAS / TE: 2**ceil(log2(amax / 448)), never saturates), 'floor' (the OCP spec),
    'ceil', 'even'. Only read by the mxfp8 recipe."""
    emulate: bool | None = None
    """True: cast to fp8 and back, GEMM in fp32. False: the float8 kernel (torch._scaled_mm)
    or an error. None: on CPU emulation (torch's CPU kernel is a slow reference kernel; same
    fp8 rounding); on CUDA the kernel where the device has one, else for tensorwise an error
    unless allow_emulation, for rowwise / rowwise_with_gw_hp emulation (logged once; their
    CUDA kernel writes bf16 only, so a GEMM with another output dtype emulates too).
    blockwise, mxfp8 and nvfp4 always emulate and refuse False."""
    allow_emulation: bool = False
    """With emulate=None, fall back to emulation (logged) where no float8 kernel exists."""
    use_fast_accum_forward: bool = True
    """The forward GEMM on the CUDA kernel accumulates in the tensor cores' faster, less precise
    way (torch._scaled_mm's use_fast_accum; torchao's default for the output GEMM). Emulation
    and the CPU kernel accumulate in fp32 whatever this says: they have no fast mode."""
    use_fast_accum_backward: bool = False
    """The same for the two backward GEMMs (off, as torchao: gradients keep full accumulation)."""
    persist_amax_history: bool = False
    """Save the delayed-scaling history in state_dict (exact resume; keys then differ from
    nn.Linear's, though a plain nn.Linear checkpoint still loads: the history restarts)."""
    amax_group: AmaxGroupName | ProcessGroup | None = None
    """Which ranks share each tensorwise amax, so that they scale alike (tensorwise only).

    None: the ranks holding pieces of the tensor. A tensor-parallel (DTensor) operand's amax
    is that of the whole tensor (DTensor reduces it over the mesh dims that shard it), so
    every TP rank gets the same scale, dynamic or delayed; a plain tensor's amax is this
    rank's own, so data-parallel replicas scale their own micro-batches and keep their own
    delayed histories (torchao's behaviour).

    A torch.distributed ProcessGroup, or 'world' (the default group; none initialized or one
    rank: nothing to reduce): in every training call (a forward in training mode with grad
    enabled, and its backward) each tensorwise amax is all-reduced (MAX) over the group before
    it is used: dynamic scaling reduces each cast's amax, delayed scaling each entry it records,
    so the histories agree on every rank (Transformer Engine's amax_reduction_group). Pass the
    data-parallel group (with tensor parallelism, the DP x TP group) to give the replicas the
    scales of the one-process run over the whole batch. The reduction is a functional
    collective (traceable under torch.compile, on device: no host sync), one per cast, so
    every rank of the group must run the same Float8Linear training calls in the same order;
    under pipeline parallelism pass the stage's group, never one spanning stages. Eval and
    no_grad calls never reduce."""

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(
                f"Float8Config.recipe={self.recipe!r}." + did_you_mean(self.recipe, RECIPES)
            )
        if self.mx_scale_mode not in MX_SCALE_MODES:
            raise ValueError(
                f"Float8Config.mx_scale_mode={self.mx_scale_mode!r}."
                + did_you_mean(self.mx_scale_mode, MX_SCALE_MODES)
            )
        if self.scaling not in SCALINGS:
            raise ValueError(
                f"Float8Config.scaling={self.scaling!r}." + did_you_mean(self.scaling, SCALINGS)
            )
        if self.grad_dtype is not None and self.grad_dtype not in LP_GRAD_DTYPES:
            raise ValueError(
                f"Float8Config.grad_dtype={self.grad_dtype!r}."
                + did_you_mean(self.grad_dtype, tuple(LP_GRAD_DTYPES))
            )
        for name, low in (("amax_history_len", 1), ("margin", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Float8Config.{name} must be an int, got {value!r}.")
            if value < low:
                raise ValueError(f"Float8Config.{name}={value!r} must be >= {low}.")
        if self.power_of_two_scale is not None and not isinstance(self.power_of_two_scale, bool):
            raise TypeError(
                "Float8Config.power_of_two_scale must be a bool or None, "
                f"got {self.power_of_two_scale!r}."
            )
        for name in (
            "allow_emulation",
            "persist_amax_history",
            "use_fast_accum_forward",
            "use_fast_accum_backward",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Float8Config.{name} must be a bool, got {getattr(self, name)!r}.")
        if self.emulate is not None and not isinstance(self.emulate, bool):
            raise TypeError(
                f"Float8Config.emulate must be True, False or None, got {self.emulate!r}."
            )
        _check_amax_group(self.amax_group)
        if self.emulate is False and self.allow_emulation:
            raise ValueError(
                "Float8Config(emulate=False, allow_emulation=True) contradicts itself: emulate=False "
                "demands the float8 kernel. Use emulate=None with allow_emulation=True to fall back."
            )

        self._check_recipe_fields()

    def _check_recipe_fields(self) -> None:
        """Refuse the fields the chosen recipe cannot honour (never accept and ignore one)."""
        recipe = self.recipe
        if recipe != "mxfp8" and self.mx_scale_mode != "rceil":
            raise ValueError(
                f"Float8Config(recipe={recipe!r}) cannot take mx_scale_mode="
                f"{self.mx_scale_mode!r}: only the mxfp8 recipe has E8M0 block scales."
            )
        if recipe == "tensorwise":
            return
        refused = []
        if self.scaling != "dynamic":
            refused.append(f"scaling={self.scaling!r} (delayed scaling is tensorwise only)")
        if self.margin:
            refused.append(f"margin={self.margin!r} (tensorwise only)")
        if self.amax_group is not None:
            refused.append(
                f"amax_group={self.amax_group!r} (tensorwise only: the other recipes scale "
                "per row or block)"
            )
        if self.emulate is False and recipe not in ("rowwise", "rowwise_with_gw_hp"):
            refused.append(
                "emulate=False (no float8 kernel path for this recipe: it emulates; "
                "use emulate=None or True)"
            )
        if recipe in ("mxfp8", "nvfp4") and self.power_of_two_scale is not None:
            refused.append(
                f"power_of_two_scale={self.power_of_two_scale!r} (fixed by the {recipe} format)"
            )
        if recipe == "nvfp4" and self.grad_dtype is not None:
            refused.append(f"grad_dtype={self.grad_dtype!r} (nvfp4 gradients are E2M1)")
        if refused:
            raise ValueError(
                f"Float8Config(recipe={recipe!r}) cannot take " + "; ".join(refused) + "."
            )

    def __deepcopy__(self, memo: dict[int, Any]) -> Float8Config:
        # Immutable: a deep copy of a model shares it (a ProcessGroup field cannot be copied).
        return self

    @property
    def resolved_power_of_two(self) -> bool:
        """power_of_two_scale, or the recipe's default when it is None."""
        if self.power_of_two_scale is not None:
            return self.power_of_two_scale
        return self.recipe in ("rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8")

    @property
    def lp_grad_dtype(self) -> torch.dtype:
        """The incoming gradient's float8 format (grad_dtype or the recipe's default)."""
        if self.recipe == "nvfp4":
            raise ValueError("Float8Config(recipe='nvfp4'): gradients are E2M1, not float8.")
        return LP_GRAD_DTYPES[self.grad_dtype or RECIPE_GRAD_DTYPES[self.recipe]]


def _check_amax_group(group: object) -> None:
    if group is None or group in AMAX_GROUP_NAMES:
        return
    dist = torch.distributed
    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return
    raise TypeError(
        f"Float8Config.amax_group={group!r}; valid: None (the ranks holding the tensor), "
        + ", ".join(repr(n) for n in AMAX_GROUP_NAMES)
        + " or a torch.distributed ProcessGroup."
    )
