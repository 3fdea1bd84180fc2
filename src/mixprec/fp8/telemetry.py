"""Quantization telemetry: how each float8 GEMM operand fares under its recipe (observation only).

Float8Telemetry(every=N).attach(model) makes every Float8Linear of the model report, on every
N-th training call, for each operand of its three GEMMs (mixprec.fp8.recipes):

- amax: max |x| of the high-precision operand;
- scale_inv_min / scale_inv_max: the range of its dequantization scales;
- underflow_pct: non-zero elements that quantize to 0;
- clipped_pct: elements beyond the largest magnitude their block can represent (saturated);
- sqnr_db: 10 log10(sum x^2 / sum (x - dequantized)^2) over finite elements (inf: exact);
- block_range_log2: the largest in-block dynamic range, log2(block amax / smallest non-zero
  |x| of that block) (the whole tensor for tensorwise, a row for rowwise).

It never changes the numbers: it reads the operands (forward: the input and weight; backward:
the incoming gradient, through a read-only hook on the GEMM's output) and quantizes its own
copies. Stochastically rounded operands (nvfp4 gradients) are observed rounded to nearest,
so telemetry never draws from the training RNG. A tensorwise layer is observed with dynamic
scaling even when it trains with delayed scaling (its history is not read). 'hp' operands
(rowwise_with_gw_hp's weight-gradient GEMM) are not quantized and not reported.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from mixprec.fp8.config import TELEMETRY_ATTR, Float8Config, misaligned_features
from mixprec.fp8.linear import Float8Linear
from mixprec.fp8.quantize import block_amax, expand_blocks
from mixprec.fp8.recipes import (
    GEMMS,
    OPERAND_ROLES,
    RECIPE_OPERANDS,
    operand_lp_dtype,
    quantize_operand,
)

ROW_HEADERS = (
    "layer",
    "gemm",
    "op",
    "kind",
    "amax",
    "scale_inv",
    "underflow%",
    "clipped%",
    "sqnr_dB",
    "range_log2",
)
"""The columns of Float8Telemetry.rows() and table()."""


def _tensorwise_no_gain(n: int, k: int) -> bool:
    return k <= 4096 and n <= 1024


def _rowwise_no_gain(n: int, k: int) -> bool:
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


NO_GAIN_SIZES = {
    "tensorwise": (_tensorwise_no_gain, "K <= 4096 and N <= 1024"),
    "rowwise": (_rowwise_no_gain, "N <= 2048, or K <= 1024, or N <= 4096 and K <= 2048"),
}
"""recipe -> (rule on the weight's N = out_features, K = in_features; the rule as text) for
the GEMM sizes expected to run no faster in float8 than in bf16: the thresholds of torchao's
auto filter (torchao.float8.float8_linear_utils._auto_filter_for_tensorwise and
_auto_filter_for_rowwise, from its H100 benchmarks). torchao states none for the other recipes,
so they are judged on the multiple-of-16 rule alone."""


def no_gain_reason(in_features: int, out_features: int, recipe: str) -> str | None:
    """Why a float8 `recipe` GEMM of this Linear's size is expected not to gain, or None:
    default_fp8_filter's multiple-of-16 rule first, then NO_GAIN_SIZES."""
    misaligned = misaligned_features(in_features, out_features)
    if misaligned is not None:
        return misaligned
    if recipe in NO_GAIN_SIZES:
        small, text = NO_GAIN_SIZES[recipe]
        if small(out_features, in_features):
            return (
                f"N={out_features}, K={in_features}: {text} (torchao's {recipe} auto filter: "
                "too small to gain)"
            )
    return None


@dataclass(frozen=True)
class OperandStats:
    """One observation of one GEMM operand (see the module docstring for each figure)."""

    layer: str
    gemm: str
    operand: str
    """'A' or 'B' of A @ B."""
    role: str
    """'input', 'weight' or 'grad'."""
    kind: str
    """The quantization (RECIPE_OPERANDS' names)."""
    call: int
    amax: float
    scale_inv_min: float
    scale_inv_max: float
    underflow_pct: float
    clipped_pct: float
    sqnr_db: float
    block_range_log2: float


def operand_stats(
    t: torch.Tensor, kind: str, lp_dtype: torch.dtype, config: Float8Config
) -> dict[str, float]:
    """The telemetry figures of one K-last 2-D operand quantized as `kind`."""
    with torch.no_grad():
        q = quantize_operand(t, kind, lp_dtype, config, stochastic=False)
        x = t.detach().to(torch.float32)
        numel = max(x.numel(), 1)
        finite = torch.isfinite(x)
        amax = x.abs().max().item() if x.numel() else 0.0
        underflow = ((x != 0) & finite & (q.dequantized == 0)).sum().item()
        if q.block is None:
            scale_inv = q.scale_inv.expand(x.shape) if q.scale_inv.dim() else q.scale_inv
            block = (x.shape[0], x.shape[1]) if q.scale_inv.dim() == 0 else (1, x.shape[1])
        else:
            scale_inv = expand_blocks(q.scale_inv, q.block, x.shape)
            block = q.block
        clipped = ((x.abs() > q.lp_max * scale_inv) & finite).sum().item()
        err = torch.where(finite, x - q.dequantized, 0.0)
        signal = torch.where(finite, x, 0.0).pow(2).sum().item()
        noise = err.pow(2).sum().item()
        sqnr = math.inf if noise == 0 else 10 * math.log10(signal / noise) if signal else -math.inf
        ax = torch.where(finite, x.abs(), 0.0)
        top = block_amax(ax, block)
        inverse = torch.where(ax > 0, 1.0 / ax, 0.0)
        smallest = 1.0 / block_amax(inverse, block)
        ranges = torch.where(top > 0, torch.log2(top / smallest), 0.0)
        return {
            "amax": amax,
            "scale_inv_min": q.scale_inv.min().item(),
            "scale_inv_max": q.scale_inv.max().item(),
            "underflow_pct": 100.0 * underflow / numel,
            "clipped_pct": 100.0 * clipped / numel,
            "sqnr_db": sqnr,
            "block_range_log2": ranges.max().item() if ranges.numel() else 0.0,
        }


class Float8Telemetry:
    """Collects OperandStats from the Float8Linear layers it is attached to.

    every: observe a layer's every N-th training call (forward with grad enabled in training
    mode, and its backward). records keeps every observation; report() the latest per
    operand, worst SQNR first.
    """

    def __init__(self, every: int = 1) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Float8Telemetry(every={every!r}): a positive int.")
        self.every = every
        self.records: list[OperandStats] = []
        self.layers: dict[str, tuple[int, int, str]] = {}
        """Attached layer -> (in_features, out_features, recipe)."""
        self._calls: dict[str, int] = {}

    def attach(self, model: nn.Module) -> Float8Telemetry:
        """Observe every Float8Linear inside `model` (named by its fully qualified name)."""
        found = False
        for fqn, module in model.named_modules():
            if isinstance(module, Float8Linear):
                name = fqn or "<root>"
                object.__setattr__(module, TELEMETRY_ATTR, (self, name))
                recipe = module.config.recipe
                self.layers[name] = (module.in_features, module.out_features, recipe)
                found = True
        if not found:
            raise ValueError(
                f"Float8Telemetry.attach: {type(model).__name__} holds no Float8Linear "
                "(convert it with convert_to_fp8 first)."
            )
        return self

    @staticmethod
    def detach(model: nn.Module) -> None:
        """Stop observing the layers of `model`."""
        for module in model.modules():
            if TELEMETRY_ATTR in module.__dict__:
                object.__delattr__(module, TELEMETRY_ATTR)

    def _observe(
        self,
        layer: str,
        gemm: str,
        config: Float8Config,
        call: int,
        a: torch.Tensor,
        b_t: torch.Tensor,
    ) -> None:
        for operand, t, kind, role in zip(
            "AB", (a, b_t), RECIPE_OPERANDS[config.recipe][gemm], OPERAND_ROLES[gemm], strict=True
        ):
            if kind == "hp":
                continue
            stats = operand_stats(t, kind, operand_lp_dtype(role, config), config)
            self.records.append(
                OperandStats(
                    layer=layer,
                    gemm=gemm,
                    operand=operand,
                    role=role,
                    kind=kind,
                    call=call,
                    **stats,
                )
            )

    def on_forward(
        self, layer: str, config: Float8Config, hp_input: torch.Tensor, hp_weight: torch.Tensor
    ) -> Any:
        """Observe the forward GEMM now; return the hook for the GEMM output (or None)."""
        call = self._calls.get(layer, 0)
        self._calls[layer] = call + 1
        if call % self.every:
            return None
        x, w = hp_input.detach(), hp_weight.detach()
        self._observe(layer, "forward", config, call, x, w)
        gemms = [
            g
            for g, needed in (
                ("grad_input", hp_input.requires_grad),
                ("grad_weight", hp_weight.requires_grad),
            )
            if needed
        ]

        def on_grad(grad_out: torch.Tensor) -> None:  # the backward GEMMs that will run
            dy = grad_out.detach()
            if "grad_input" in gemms:
                self._observe(layer, "grad_input", config, call, dy, w.t())
            if "grad_weight" in gemms:
                self._observe(layer, "grad_weight", config, call, dy.t(), x.t())

        return on_grad

    def report(self) -> list[OperandStats]:
        """The latest observation of each (layer, GEMM, operand), lowest SQNR first."""
        latest: dict[tuple[str, str, str], OperandStats] = {}
        for record in self.records:
            latest[(record.layer, record.gemm, record.operand)] = record
        return sorted(latest.values(), key=lambda r: (r.sqnr_db, r.layer, GEMMS.index(r.gemm)))

    def rows(self) -> list[tuple[str, ...]]:
        """report() as text cells under ROW_HEADERS, one row per GEMM operand, worst first."""
        return [
            (
                r.layer,
                r.gemm,
                f"{r.operand}:{r.role}",
                r.kind,
                f"{r.amax:.3g}",
                f"{r.scale_inv_min:.2g}..{r.scale_inv_max:.2g}",
                f"{r.underflow_pct:.3f}",
                f"{r.clipped_pct:.3f}",
                f"{r.sqnr_db:.2f}",
                f"{r.block_range_log2:.1f}",
            )
            for r in self.report()
        ]

    def table(self) -> str:
        """rows() under ROW_HEADERS as an aligned text table."""
        rows = [ROW_HEADERS, *self.rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(ROW_HEADERS))]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
        )

    def recommend(
        self,
        min_sqnr_db: float,
        max_underflow_pct: float | None = None,
        *,
        no_gain: bool = True,
    ) -> dict[str, str]:
        """Layers to keep in high precision -> why ('; ' between reasons).

        Expected to hurt (worst SQNR first): an observed operand below min_sqnr_db, or (when
        given) one whose underflow exceeds max_underflow_pct. Expected not to gain (when
        no_gain, in attach order, observed or not): in/out features not multiples of 16, or a
        GEMM at or below torchao's auto-filter sizes for its recipe (NO_GAIN_SIZES).

        SQNR weighs errors by energy, so an outlier-dominated operand can keep a high SQNR
        while its small values vanish: max_underflow_pct catches that. There is no default
        threshold: on N(0, 1) operands e4m3 gives ~31.5 dB, e5m2 ~25.6 dB, nvfp4 ~20 dB
        (tests/test_fp8_recipes.py), real activations and gradients less. keep_rule() turns
        the result into per_module_recipes rules keeping those layers in high precision.
        """
        for name, value in (("min_sqnr_db", min_sqnr_db), ("max_underflow_pct", max_underflow_pct)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float))
            ):
                raise TypeError(f"{name} must be a number, got {value!r}.")
        if not isinstance(no_gain, bool):
            raise TypeError(f"no_gain must be True or False, got {no_gain!r}.")
        found: dict[str, list[str]] = {}
        for r in self.report():  # lowest SQNR first
            what = f"{r.gemm} operand {r.operand} ({r.role}, {r.kind})"
            detail = (
                f"{r.sqnr_db:.1f} dB, underflow {r.underflow_pct:.2f} %, clipped "
                f"{r.clipped_pct:.2f} %, in-block range 2**{r.block_range_log2:.0f}"
            )
            if r.layer in found:
                continue
            if r.sqnr_db < min_sqnr_db:
                found[r.layer] = [f"{what}: SQNR below {min_sqnr_db} dB ({detail})"]
            elif max_underflow_pct is not None and r.underflow_pct > max_underflow_pct:
                found[r.layer] = [f"{what}: underflow above {max_underflow_pct} % ({detail})"]
        if no_gain:
            for layer, (in_features, out_features, recipe) in self.layers.items():
                why = no_gain_reason(in_features, out_features, recipe)
                if why is not None:
                    found.setdefault(layer, []).append(f"expected not to gain: {why}")
        return {layer: "; ".join(reasons) for layer, reasons in found.items()}

    @staticmethod
    def keep_rule(recommended: dict[str, str]) -> str:
        """The one line keeping `recommended` layers in high precision:
        per_module_recipes(model, {...: 'keep'}) as convert_to_fp8's module_filter_fn."""
        rules = ", ".join(f"{layer!r}: 'keep'" for layer in recommended)
        return f"convert_to_fp8(model, per_module_recipes(model, {{{rules}}}), config)"

    def as_dicts(self) -> list[dict[str, Any]]:
        """report() as plain dicts (for CSV / JSON)."""
        return [asdict(r) for r in self.report()]
