"""A BenchReport as the seeds' table (mode, memory, it/s, throughput, vs fp32, loss), md/JSON/PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mixprec.bench.modes import BASELINE
from mixprec.bench.runner import BenchReport
from mixprec.debugging._markdown import markdown_table

MIB = 2**20
HEADERS = (
    "mode",
    "convert_to_amp",
    "dtype",
    "steps",
    "peak mem Δ MiB",
    "peak mem MiB",
    "mem vs fp32",
    "it/s",
    "samples/s",
    "speedup vs fp32",
    "{loss}",
    "note",
)


def common_loss_step(report: BenchReport) -> int:
    """The last step every mode that ran reached (losses compare at equal step counts)."""
    counts = [len(r.losses) for r in report.results if r.status == "ok" and r.losses]
    return min(counts, default=0)


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base <= 0:
        return None
    return value / base


def summary_rows(report: BenchReport) -> list[dict[str, Any]]:
    """Per mode: the measured numbers and the ratios against fp32 (None where not measured)."""
    base = report.result(BASELINE)
    base_ok = base is not None and base.status == "ok"
    step = common_loss_step(report)
    rows = []
    for r in report.results:
        ok = r.status == "ok"
        rows.append(
            {
                "mode": r.mode,
                "status": r.status,
                "amp_call": r.amp_call,
                "low_dtype": r.low_dtype,
                "steps": r.steps,
                "peak_delta_mib": r.peak_delta_bytes / MIB if ok and r.peak_delta_bytes else None,
                "peak_mib": r.peak_bytes / MIB if ok and r.peak_bytes else None,
                "it_s": r.it_s if ok else None,
                "samples_s": r.samples_s if ok else None,
                # fp32 time over this mode's time: > 1 is faster than fp32
                "speedup_vs_fp32": _ratio(base.step_s_median, r.step_s_median)
                if base_ok and ok
                else None,
                "memory_vs_fp32": _ratio(r.peak_delta_bytes, base.peak_delta_bytes)
                if base_ok and ok
                else None,
                "loss_step": step if ok and step else None,
                "loss": r.losses[step - 1] if ok and step else None,
                "final_loss": r.losses[-1] if ok and r.losses else None,
                "reason": r.reason,
                "note": r.note,
            }
        )
    return rows


def _shape(model: dict[str, Any]) -> str:
    """', image 224, patch 16, 12 heads' for a vit; ', image 32' for a resnet; '' for an mlp."""
    if model["name"] == "vit":
        return f", image {model['image_size']}, patch {model['patch_size']}, {model['heads']} heads"
    if model["name"] == "resnet":
        return f", image {model['image_size']}"
    return ""


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def render_table(report: BenchReport) -> str:
    """The markdown table plus numbered notes (skip reasons and remarks, each written once)."""
    rows = summary_rows(report)
    step = common_loss_step(report)
    all_same = len({len(r.losses) for r in report.results if r.status == "ok"}) <= 1
    loss_header = "final loss" if all_same else f"loss @ step {step}"
    notes: list[str] = []

    def note_ref(text: str) -> str:
        if not text:
            return ""
        if text not in notes:
            notes.append(text)
        return f"[{notes.index(text) + 1}]"

    cells = []
    for row in rows:
        if row["status"] != "ok":
            ref = note_ref(row["reason"])
            cells.append([row["mode"], row["amp_call"] or "—", "—", row["status"]] + ["—"] * 7)
            cells[-1].append(ref)
            continue
        cells.append(
            [
                row["mode"],
                row["amp_call"],
                row["low_dtype"] or "float32",
                str(row["steps"]),
                _fmt(row["peak_delta_mib"], ".1f"),
                _fmt(row["peak_mib"], ".1f"),
                _fmt(row["memory_vs_fp32"], ".2f", "x"),
                _fmt(row["it_s"], ".2f"),
                _fmt(row["samples_s"], ".1f"),
                _fmt(row["speedup_vs_fp32"], ".2f", "x"),
                _fmt(row["loss"], ".6g"),
                note_ref(row["note"]),
            ]
        )
    headers = [h.format(loss=loss_header) for h in HEADERS]
    lines = [markdown_table(headers, cells)]
    if notes:
        lines.append("")
        lines += [f"[{i}] {text}" for i, text in enumerate(notes, 1)]
    return "\n".join(lines)


def render_markdown(report: BenchReport) -> str:
    """The whole results page: what ran where, how memory was measured, the table."""
    cfg, model = report.config, report.config["model"]
    kind = next((r.memory_kind for r in report.results if r.memory_kind), "")
    if kind.startswith("peak RSS"):
        memory = (
            f"Memory: the worker process's {kind}. 'peak mem MiB' is that peak; 'peak mem Δ' "
            "subtracts the RSS at a baseline taken after imports and data creation, so it holds "
            "the model, optimizer state, fp32 masters, autocast's weight copies and activations. "
            "'mem vs fp32' compares the Δ."
        )
        if "VmHWM" in kind:
            memory += (
                " VmHWM is reset to the current RSS at the baseline, so import-time transients "
                "do not hide a small model."
            )
    else:
        memory = (
            "Memory: `torch.cuda.max_memory_allocated` over the run; 'peak mem Δ' subtracts "
            "`memory_allocated` after data creation. 'mem vs fp32' compares the Δ."
        )
    busy = ""
    if report.load_start is not None and report.load_end is not None:
        busy = (
            f"\nLoad: 1-minute load average {report.load_start:.1f} before the run, "
            f"{report.load_end:.1f} after, on {report.cpus} cores.\n"
        )
    if report.busy:
        busy = (
            f"\n**Timings taken on a busy machine**: 1-minute load average {report.load_start:.1f} "
            f"on {report.cpus} cores when the run began (other jobs shared the cores), so speeds "
            "are noisy and lower than on an idle machine.\n"
        )
    lines = [
        f"# mixprec bench: {model['name']} on {report.device}",
        "",
        f"Machine: {report.machine}.",
        *([f"{report.gemm_speed}."] if report.gemm_speed else []),
        f"Model: {model['name']} width {model['width']}, depth {model['depth']}, "
        f"batch {model['batch']}{_shape(model)}, SGD lr {model['lr']:g}; synthetic data, "
        f"seed {cfg['seed']}.",
        f"Each mode ran in its own process through `mixprec.convert_to_amp`: {cfg['warmup']} "
        f"warm-up step(s), then {cfg['steps']} timed steps unless noted; it/s is 1 / the median "
        f"step time. Whole run: {report.wall_s:.0f} s.",
        "",
        memory,
        busy,
        render_table(report),
        "",
        f"Repeat: `{report.command}`",
        "",
    ]
    return "\n".join(lines)


def plot(report: BenchReport, path: Path) -> None:
    """Two bar charts: speedup vs fp32 and peak-memory Δ vs fp32, skipped modes labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary_rows(report)
    names = [r["mode"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in (
        (axes[0], "speedup_vs_fp32", "speedup vs fp32 (higher is faster)"),
        (axes[1], "memory_vs_fp32", "peak memory Δ vs fp32 (lower is smaller)"),
    ):
        values = [r[key] or 0.0 for r in rows]
        colors = [
            "#888888" if r["mode"] == BASELINE else "#d62728" if r[key] is None else "#1f77b4"
            for r in rows
        ]
        bars = ax.bar(names, values, color=colors)
        ax.bar_label(
            bars,
            labels=[r["status"] if r[key] is None else f"{r[key]:.2f}x" for r in rows],
            fontsize=8,
        )
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelrotation=30)
    model = report.config["model"]
    title = (
        f"mixprec bench {model['name']} (width {model['width']}, depth {model['depth']}, "
        f"batch {model['batch']}) on {report.machine}"
    )
    if report.busy:
        title += " [busy machine]"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def result_stem(report: BenchReport) -> str:
    """bench_<model>_<device type>, e.g. bench_mlp_cpu."""
    return f"bench_{report.config['model']['name']}_{report.device.split(':')[0]}"


def write_report(report: BenchReport, out_dir: Path | str) -> dict[str, Path]:
    """Write <stem>.md, .json (report + summary rows) and, with matplotlib, .png under out_dir.

    Returns the paths written, by extension: no "png" key when matplotlib is not installed.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / result_stem(report)
    paths = {ext: stem.with_suffix(f".{ext}") for ext in ("md", "json")}
    paths["md"].write_text(render_markdown(report))
    data = {**report.to_json(), "summary": summary_rows(report)}
    paths["json"].write_text(json.dumps(data, indent=2) + "\n")
    png = stem.with_suffix(".png")
    png.unlink(missing_ok=True)  # a chart left from an earlier run would not match these numbers
    try:
        plot(report, png)
    except ImportError:  # the base install has no matplotlib: the md and JSON hold every number
        return paths
    paths["png"] = png
    return paths


def load_report(path: Path | str) -> BenchReport:
    """A BenchReport back from its JSON file."""
    data = json.loads(Path(path).read_text())
    data.pop("summary", None)
    return BenchReport.from_json(data)
