"""The float8 quantization report: Float8Telemetry's ranked rows as a markdown table and a PNG,
and `mixprec doctor --fp8-report`'s run of a small built-in model under each recipe."""

from __future__ import annotations

import copy
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from mixprec.debugging._markdown import markdown_table
from mixprec.fp8 import RECIPES, Float8Config, Float8Telemetry, convert_to_fp8
from mixprec.fp8.telemetry import ROW_HEADERS

MARKDOWN_NAME = "fp8_telemetry.md"
PNG_NAME = "fp8_sqnr.png"


def report_markdown(telemetry: Float8Telemetry) -> str:
    """telemetry.rows() (worst SQNR first) as a GitHub-markdown table."""
    return markdown_table(ROW_HEADERS, telemetry.rows())


def fresh_folder(folder: str | Path | None) -> Path:
    """`folder` created (it must not exist, or be an empty directory: nothing is overwritten),
    or a new mixprec-fp8-report-* directory in the working directory when None."""
    if folder is None:
        return Path(tempfile.mkdtemp(prefix="mixprec-fp8-report-", dir=Path.cwd()))
    path = Path(folder)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(
            f"fp8 report folder {str(path)!r} exists and is not an empty directory "
            "(the report never overwrites): name a new one, or pass None for a fresh one."
        )
    path.mkdir(parents=True, exist_ok=True)
    return path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            "The fp8 report's PNG needs matplotlib: pip install 'mixprec[bench]' "
            f"(or matplotlib) ({err})."
        ) from err
    return plt


def write_report(
    telemetry: Float8Telemetry | Sequence[tuple[str, Float8Telemetry]],
    folder: str | Path | None = None,
) -> Path:
    """Write the ranked table (fp8_telemetry.md) and a bar chart of each operand's SQNR
    (fp8_sqnr.png, worst at the top) into a fresh folder; returns it.

    telemetry: one Float8Telemetry, or (title, telemetry) pairs (one section and one panel
    each, e.g. one per recipe). An exact operand (infinite SQNR) is drawn at the largest
    finite SQNR of its panel and labelled 'exact'.
    """
    sections = [("", telemetry)] if isinstance(telemetry, Float8Telemetry) else list(telemetry)
    if not sections or any(not t.records for _, t in sections):
        raise ValueError("write_report: a telemetry has no observations (run a training step).")
    plt = _pyplot()  # before creating the folder: a missing matplotlib leaves nothing behind
    path = fresh_folder(folder)
    text = []
    for title, t in sections:
        text += [f"## {title}", ""] if title else []
        text += [report_markdown(t), ""]
    (path / MARKDOWN_NAME).write_text("\n".join(text))
    heights = [len(t.report()) for _, t in sections]
    fig, axes = plt.subplots(
        len(sections),
        1,
        figsize=(8, 1.0 + 0.28 * sum(heights)),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    for ax, (title, t) in zip(axes[:, 0], sections, strict=True):
        rows = t.report()[::-1]  # barh draws bottom-up: worst at the top
        finite = [r.sqnr_db for r in rows if math.isfinite(r.sqnr_db)]
        top = max(finite, default=0.0)
        values = [r.sqnr_db if math.isfinite(r.sqnr_db) else top for r in rows]
        labels = [
            f"{r.layer} {r.gemm} {r.operand}:{r.role}"
            + ("" if math.isfinite(r.sqnr_db) else " (exact)")
            for r in rows
        ]
        ax.barh(range(len(rows)), values)
        ax.set_yticks(range(len(rows)), labels, fontsize=7)
        ax.set_xlabel("SQNR of quantize-dequantize (dB)")
        if title:
            ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path / PNG_NAME, dpi=100)
    plt.close(fig)
    return path


def builtin_model() -> nn.Module:
    """The small MLP the doctor's fp8 report trains (every dim a multiple of 128, so every
    recipe's blocks tile it)."""
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))


def recipe_telemetry(
    recipes: Sequence[str] = RECIPES, steps: int = 3
) -> list[tuple[str, Float8Telemetry]]:
    """(recipe, telemetry of `steps` SGD steps of builtin_model on seeded N(0,1) data) per
    recipe, every layer converted, the same initial weights and data for all."""
    torch.manual_seed(0)
    base = builtin_model()
    out = []
    for recipe in recipes:
        model = convert_to_fp8(copy.deepcopy(base), config=Float8Config(recipe=recipe))
        telemetry = Float8Telemetry().attach(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x = torch.randn(64, 128, generator=gen)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x).backward()
            opt.step()
        out.append((recipe, telemetry))
    return out
