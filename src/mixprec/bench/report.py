"""A BenchReport as the seeds' table (mode, memory, it/s, throughput, vs fp32, loss), md/JSON/PNG."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from mixprec.bench.modes import BASELINE
from mixprec.bench.runner import BenchReport
from mixprec.debugging._markdown import markdown_table

MIB = 2**20
HEADERS = (
    "mode",
    "convert_to_amp",
    "dtype",
    "timed steps",
    "peak mem Δ MiB",
    "peak mem MiB",
    "mem vs fp32",
    "it/s",
    "samples/s",
    "speedup vs fp32",
    "min–max over rounds",
    "{loss}",
    "note",
)


MIN_ROUNDS = 3
"""Rounds a speedup needs before it is shown unmarked."""
MARK_SPREAD = 0.2
"""Relative spread (IQR over the rounds / median) above which a speedup is marked '?'."""
WITHHOLD_SPREAD = 0.5
"""Relative spread above which a speedup is withheld: the rounds disagree too much for their
median to mean anything (e.g. 3.85x / 12.15x / 0.93x on a busy machine: spread 1.5)."""
VERDICT_RULE = (
    f"A speedup is the median over rounds of (fp32's step time / the mode's step time), both "
    f"timed in the same round; its spread is the interquartile range over rounds / the median. "
    f"Shown when at least {MIN_ROUNDS} rounds agree within a spread of {MARK_SPREAD:.0%}; "
    f"marked '?' with fewer rounds or a spread up to {WITHHOLD_SPREAD:.0%}; withheld above that, "
    "or when it reads faster than fp32 for a mode this device is known to run slower."
)

Verdict = Literal["ok", "marked", "withheld"]


@dataclass(frozen=True, kw_only=True)
class Speedup:
    """A mode's speed vs fp32 over the rounds, and whether it can be trusted."""

    median: float
    """Median over rounds of fp32's round step time / the mode's."""
    low: float
    """Smallest round ratio."""
    high: float
    """Largest round ratio."""
    spread: float
    """Interquartile range of the round ratios / their median (0 for one round)."""
    rounds: int
    """Rounds both fp32 and the mode ran."""
    verdict: Verdict
    """'ok': shown; 'marked': shown with '?' and `why`; 'withheld': not shown, `why` says so."""
    why: str = ""
    """The reason for a mark or a withheld ratio."""


def round_ratios(base: list[float | None], mode: list[float | None]) -> list[float]:
    """fp32's / the mode's step time, for every round both ran (the pairs share a load)."""
    return [b / m for b, m in zip(base, mode, strict=False) if b and m]


def judge_speedup(ratios: list[float], *, expect_slower: bool = False) -> Speedup | None:
    """Median, range and verdict of a mode's round ratios (VERDICT_RULE); None without any."""
    if not ratios:
        return None
    median = statistics.median(ratios)
    if len(ratios) > 1:
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        spread = (q3 - q1) / median
    else:
        spread = 0.0
    verdict: Verdict = "ok"
    why = ""
    n = len(ratios)
    if expect_slower and median > 1.0:
        verdict = "withheld"
        why = (
            "speedup withheld: it timed faster than fp32, which contradicts this device's slow "
            "path for the mode (see its note): timing noise, not a speedup (the JSON keeps it)"
        )
    elif spread > WITHHOLD_SPREAD:
        verdict = "withheld"
        why = (
            f"speedup withheld: its {n} rounds disagree (spread {spread:.0%} > "
            f"{WITHHOLD_SPREAD:.0%}): the machine's load changed under the run; rerun when idle"
        )
    elif spread > MARK_SPREAD:
        verdict = "marked"
        why = f"speedup uncertain: spread {spread:.0%} over {n} rounds (> {MARK_SPREAD:.0%})"
    elif n < MIN_ROUNDS:
        verdict = "marked"
        why = f"speedup uncertain: only {n} round(s) (fewer than {MIN_ROUNDS})"
    return Speedup(
        median=median,
        low=min(ratios),
        high=max(ratios),
        spread=spread,
        rounds=n,
        verdict=verdict,
        why=why,
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
        speedup = (
            judge_speedup(
                round_ratios(base.round_step_s, r.round_step_s), expect_slower=r.expect_slower
            )
            if base_ok and ok
            else None
        )
        shown = speedup is not None and speedup.verdict != "withheld"
        rows.append(
            {
                "mode": r.mode,
                "status": r.status,
                "amp_call": r.amp_call,
                "low_dtype": r.low_dtype,
                "steps": len(r.step_s),
                "rounds": sum(t is not None for t in r.round_step_s),
                "peak_delta_mib": r.peak_delta_bytes / MIB if ok and r.peak_delta_bytes else None,
                "peak_mib": r.peak_bytes / MIB if ok and r.peak_bytes else None,
                "it_s": r.it_s if ok else None,
                "samples_s": r.samples_s if ok else None,
                # fp32 time over this mode's time, median over rounds: > 1 is faster than fp32;
                # None when not measured or withheld (judge_speedup's verdict)
                "speedup_vs_fp32": speedup.median if shown else None,
                "speedup": asdict(speedup) if speedup else None,
                "expect_slower": r.expect_slower,
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
            cells.append([row["mode"], row["amp_call"] or "—", "—", row["status"]] + ["—"] * 8)
            cells[-1].append(ref)
            continue
        speedup = row["speedup"]
        refs = [note_ref(row["note"])]
        if speedup is None:
            shown, spread = "—", "—"
        else:
            shown = {"ok": f"{speedup['median']:.2f}x", "marked": f"{speedup['median']:.2f}x ?"}
            shown = shown.get(speedup["verdict"], "withheld")
            spread = f"{speedup['low']:.2f}–{speedup['high']:.2f}x ({speedup['rounds']})"
            if speedup["verdict"] == "withheld" and row["expect_slower"] and speedup["median"] > 1:
                spread = "—"  # its numbers read faster than the note says it can be
            refs.append(note_ref(speedup["why"]))
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
                shown,
                spread,
                _fmt(row["loss"], ".6g"),
                " ".join(r for r in refs if r),
            ]
        )
    headers = [h.format(loss=loss_header) for h in HEADERS]
    lines = [markdown_table(headers, cells)]
    if report.interrupted:
        notes.append(f"interrupted ({report.interrupted}): the rows hold what ran until then")
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
        f"Each mode ran in its own process through `mixprec.convert_to_amp`, the modes "
        f"interleaved: {cfg.get('rounds', 1)} rounds, each running every mode's {cfg['steps']} "
        f"timed steps (unless noted) in turn, the order rotated every round; {cfg['warmup']} "
        f"untimed warm-up step(s) before a mode's first round. it/s is 1 / the median step "
        f"time. Whole run: {report.wall_s:.0f} s.",
        "",
        VERDICT_RULE,
        "",
        *(
            [f"**Interrupted** ({report.interrupted}): partial results.", ""]
            if report.interrupted
            else []
        ),
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
        if key == "speedup_vs_fp32":  # the min–max over rounds of every shown speedup
            for bar, r in zip(bars, rows, strict=True):
                if r[key] is not None and r["speedup"]:
                    x = bar.get_x() + bar.get_width() / 2
                    ax.plot([x, x], [r["speedup"]["low"], r["speedup"]["high"]], color="black")
        labels = []
        for r in rows:
            if r[key] is not None:
                marked = key == "speedup_vs_fp32" and r["speedup"]["verdict"] == "marked"
                labels.append(f"{r[key]:.2f}x" + (" ?" if marked else ""))
            elif r["status"] == "ok" and key == "speedup_vs_fp32":
                labels.append("withheld")
            else:
                labels.append(r["status"])
        ax.bar_label(bars, labels=labels, fontsize=8)
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
    if report.interrupted:
        title += " [interrupted: partial]"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def result_stem(report: BenchReport) -> str:
    """bench_<model>_<device type>, e.g. bench_mlp_cpu."""
    return f"bench_{report.config['model']['name']}_{report.device.split(':')[0]}"


def write_record(
    out_dir: Path | str,
    stem: str,
    table: str,
    record: dict[str, Any],
    chart: Callable[[Path], None] | None = None,
) -> dict[str, Path]:
    """Write one benchmark's results: <stem>.md (table), <stem>.json (record) and, when chart
    is given and matplotlib is installed, <stem>.png (chart(path) draws it) under out_dir.
    Values JSON has no type for (paths, dtypes in an argparse namespace) are written as str.

    Returns the paths written, by extension: no "png" key without a chart or matplotlib."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / stem
    paths = {ext: base.with_suffix(f".{ext}") for ext in ("md", "json")}
    paths["md"].write_text(table)
    paths["json"].write_text(json.dumps(record, indent=2, default=str) + "\n")
    png = base.with_suffix(".png")
    png.unlink(missing_ok=True)  # a chart left from an earlier run would not match these numbers
    if chart is None:
        return paths
    try:
        chart(png)
    except ImportError:  # the base install has no matplotlib: the md and JSON hold every number
        return paths
    paths["png"] = png
    return paths


def write_report(report: BenchReport, out_dir: Path | str) -> dict[str, Path]:
    """A BenchReport through write_record: its table, report + summary rows, its chart."""
    data = {**report.to_json(), "summary": summary_rows(report)}
    return write_record(
        out_dir, result_stem(report), render_markdown(report), data, lambda png: plot(report, png)
    )


def load_report(path: Path | str) -> BenchReport:
    """A BenchReport back from its JSON file."""
    data = json.loads(Path(path).read_text())
    data.pop("summary", None)
    return BenchReport.from_json(data)
