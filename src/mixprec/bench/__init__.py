"""`mixprec bench`: the seeds' experiments (mode, memory, it/s, throughput) as a product.

fp32 and every mode the device supports run through `mixprec.convert_to_amp`, each in its own
process (so peak memory is that mode's alone), on seed 002's MLP, a ViT or a ResNet-shaped CNN
with synthetic data. The modes are interleaved in rounds, so a change in the machine's load
lands on all of them; each speedup is the median over rounds with its min-max, marked or
withheld when the rounds disagree (report.VERDICT_RULE). The result is the seeds' table,
written as markdown, JSON and a PNG chart; an interrupted run writes what it measured.

    from mixprec.bench import BenchConfig, PRESETS, run_bench, write_report
    report = run_bench(BenchConfig(model=PRESETS["mlp"], modes=("fp32", "bf16")))
    write_report(report, "my-bench-results")
"""

from mixprec.bench.command import add_bench_arguments, bench_command, config_from_args
from mixprec.bench.models import (
    MLP,
    MODEL_NAMES,
    PRESETS,
    ModelSpec,
    ResNet,
    ViT,
    build_model,
    make_batch,
    make_criterion,
)
from mixprec.bench.modes import BENCH_MODES, amp_args, amp_call_text, mode_policy, parse_modes
from mixprec.bench.report import (
    load_report,
    render_markdown,
    render_table,
    summary_rows,
    write_report,
)
from mixprec.bench.runner import BenchConfig, BenchReport, ModePlan, plan_modes, run_bench
from mixprec.bench.worker import ModeResult

__all__ = [
    "BENCH_MODES",
    "MLP",
    "MODEL_NAMES",
    "PRESETS",
    "BenchConfig",
    "BenchReport",
    "ModePlan",
    "ModeResult",
    "ModelSpec",
    "ResNet",
    "ViT",
    "add_bench_arguments",
    "amp_args",
    "amp_call_text",
    "bench_command",
    "build_model",
    "config_from_args",
    "load_report",
    "make_batch",
    "make_criterion",
    "mode_policy",
    "parse_modes",
    "plan_modes",
    "render_markdown",
    "render_table",
    "run_bench",
    "summary_rows",
    "write_report",
]
