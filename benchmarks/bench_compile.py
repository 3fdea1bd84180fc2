"""compile_step's first step (its compile) and steady step against torch.compile(model).

A stack of identical residual MLP blocks (LayerNorm -> Linear(w, 4w) -> GELU -> Linear(4w, w),
plus the residual; width 256, batch 32), AdamW, MSE, at each depth:

    eager           torch.autocast (bf16) + foreach AdamW, no compile
    torch.compile   the same with torch.compile(model): the forward and backward compiled, the
                    optimizer eager (how users compile today)
    compile_step    convert_to_amp(..., "bf16") + mixprec.compile_step (its defaults: one
                    graph): forward, backward, check, update and the scaler in one compiled step
    compile_step regions  the same with regions=True: each kind of param update one nested
                    compile region, compiled once (not run by default; --loops adds it)

Each (depth, loop) runs in a fresh subprocess with a cold inductor cache (TORCHINDUCTOR_CACHE_DIR
a new temporary folder), one torch thread. The first step is wall time (it includes the
compile, whose C++ builds run in worker processes); steady steps are the median of --steps
steps after --warmup, by the process's CPU time (load from other processes on a shared machine
inflates wall time, not that). The runs go depth by depth, the loops of one depth in a rotated
order, and the 1-minute load average is recorded before and after each. compile_step's run
also records torch._dynamo.utils.compile_times()'s phase totals (dynamo tracing, AOT autograd,
inductor's scheduling, codegen and C++ builds) and what inductor generated (kernel_counts: IR
nodes before fusion, C++ loop nests, distinct C++ kernel functions).

Where compile_step's compile goes (one graph, torch 2.13, CPU; the record's count columns):

- The forward and backward are torch.compile(model)'s, about 30 IR nodes per block. The update
  joins each param group (mixprec.core.compiled_join): one scalar vector per group, one update
  per chunk of at most 2**18 elements (a block's two 256 x 1024 weights are a chunk each, its
  small params share one), so a block adds about 15 nodes of update, where one update per
  trained tensor, each with its own scalar vector, added about 140 (23 per tensor).
- Identical blocks share kernels only when nothing in them names a place: inductor writes a
  joined tensor's offset into every kernel that reads or writes it. A chunk spanning blocks put
  each block's small params (read by its forward and backward kernels) and each gradient's slot
  in the chunk's concatenation (written by the backward kernel that makes it) at offsets of
  their own, and the found-inf check's torch.stack gave each amax a slot: every block built
  kernels of its own (the record's C++ functions: 28 at 8 blocks, 76 at 24). A chunk now
  holds one block's params at most (compiled_join.JoinedGroup) and the check takes the
  amaxes' max: 22 at 8 blocks and 23 at 24, inductor's realization pattern settling after the
  first few blocks.
- Inductor's fusion pass tries pairs of nodes that read one buffer; every update node reads the
  step's scalars and skip flag, so the update was one buffer group whose pairwise checks grew
  with the model (scheduler: 28 s of a 92 s first step at 24 blocks). compile_step limits them
  to 4 partners a node on CPU (compiled_step.CPU_FUSION_OPTIONS): 9 s there, the steady step no
  slower. 1 partner was no faster.
- Before its first CPU kernel inductor picks the vector ISA: a g++ build and a load of a probe
  library per candidate ISA, about 9 s with a cold cache (1.3 s warm), on the compiling
  thread after tracing, in both loops. compile_step runs it (and the kernels' precompiled
  header) on a thread from when it is built (mixprec.core.inductor_warmup): the probes build
  while dynamo traces. Their builds count in its c++ builds column. --isa-cached (default: depth
  8) runs both loops once more with the probe libraries already in the cold cache, so the
  compile's own cost shows beside the cold start.
- Inductor submits the kernels' C++ builds when the graph's module loads, after code generation
  (a core idle meanwhile on 2 cores); compile_step's first call submits each as inductor
  defines it (inductor_warmup.early_builds): about 2-3 s less at 8 blocks, the same builds.
- What still costs more than torch.compile(model) at 8 blocks (one profile, s): creating the
  scheduler's nodes +3 (the graph has about 390 IR nodes to torch.compile's 236: the update,
  the check and the scalars), code generation +2, lowering +2, dynamo tracing the update +1.4,
  waiting for C++ builds +1.7.
- Tried and dropped (probes at 8 and 24 blocks, cold cache): the model's own params left out of
  the joined buffers (a chunk steps their concatenation and writes each from its slice): their
  forward kernels shared, but the concatenations and writes cost more scheduling than they
  saved (+2.6 s at 8 blocks); each chunk's update as a compiled program of its own, compiled
  once per layout and called per chunk after the graph: 30 s at 8 blocks, the steady step
  16 ms against 12; the forward as a program of its own (torch.compile's forward and backward
  graphs, the backward run eagerly) and the rest as another: 31 s, the steady step 25 ms
  against 12 (the one graph's speed comes from forward, backward and update compiled
  together); inductor's realize_cpu_acc_reads_threshold at 2 or 4: fewer kernels, none shared.
- Larger chunks gave fewer nodes but a slower step: a chunk's update makes temporaries of its
  size (its flat gradient, its new values), and temporaries of a few MiB were mapped afresh by
  the allocator at every step (page faults in the update kernel, seen with perf): at depth 8,
  chunks of 2**19 or 2**20 elements stepped in 34 ms against 11-14 ms with 2**18.
- The C++ wrapper (compiled_step.CPU_WRAPPER_MAX_TENSORS): built only for a step of at most 32
  trained tensors; it is one C++ file for the whole graph, whose build grew much faster than the
  graph (at 24 blocks, per-tensor updates: 2049 s of a 2227 s first step).

--dtype fp32 runs the same without autocast. The blocks' forward and backward are inline in
every compiled loop.

    python benchmarks/bench_compile.py                       # depths 2, 8, 24 -> runs/
    python benchmarks/bench_compile.py --out benchmarks/results --name compile_cpu
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOOPS = ("eager", "torch.compile", "compile_step", "compile_step regions")
DEFAULT_LOOPS = LOOPS[:3]
GOALS = {
    "first step: compile_step / torch.compile at depth 8 (<=)": 1.5,
    "compile_step growth, s per block (<=)": 2.0,
    "steady: torch.compile / compile_step at depth 8 (>=)": 1.5,
    "steady: torch.compile / compile_step, every depth (>=)": 1.0,
}
"""Issue 44's goals."""
PHASES = {
    "dynamo": "bytecode_tracing",
    "aot + inductor": "create_aot_dispatcher_function",
    "inductor": "compile_fx_inner",
    "scheduler": "Scheduler.__init__",
    "codegen": "Scheduler.codegen",
    "c++ builds": "compile_file",
}
"""compile_times() keys summed per phase (each over every graph and region)."""


# ----- the worker: one (depth, loop) in this process -----
def build(depth: int, width: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.fc1 = nn.Linear(width, 4 * width)
            self.fc2 = nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))

    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(depth)])


def worker(args: argparse.Namespace) -> dict:
    import torch
    from torch import nn

    import mixprec

    torch.set_num_threads(1)
    model = build(args.depth, args.width)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randn(args.batch, args.width, generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    mse = nn.MSELoss()
    autocast = args.dtype == "bf16"
    if args.loop.startswith("compile_step"):
        if autocast:
            model, opt, mse = mixprec.convert_to_amp(model, opt, mse, "bf16")
        step_fn = mixprec.compile_step(model, opt, mse, regions=args.loop == "compile_step regions")

        def step():
            return step_fn(x, y)
    else:
        forward = torch.compile(model) if args.loop == "torch.compile" else model

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = forward(x)
            loss = mse(out.float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

    t0 = time.perf_counter()
    first_loss = float(step())
    first = time.perf_counter() - t0
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.process_time()
        step()
        times.append(time.process_time() - t0)
    result = {
        "depth": args.depth,
        "loop": args.loop,
        "first_step_s": first,
        "steady_ms": 1e3 * statistics.median(times),
        "first_loss": first_loss,
    }
    if args.loop.startswith("compile_step"):
        result["regional"] = step_fn.regional
        result["compiled"] = step_fn.compiled
    if args.loop != "eager":
        result["phases_s"] = phase_totals()
        result["counts"] = kernel_counts()
    return result


def kernel_counts() -> dict[str, int]:
    """What inductor generated in this process: IR nodes before fusion (the scheduler's
    nodes), C++ loop nests, and distinct C++ kernel functions in the (cold, per-run) cache:
    inductor defines a function once per distinct source, so repeated work shows as loop
    nests that do not add functions."""
    import re

    from torch._inductor import metrics

    names: set[str] = set()
    for path in Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).rglob("*"):
        if path.suffix in (".cpp", ".py") and path.is_file():
            text = path.read_text(errors="ignore")
            names.update(re.findall(r"void\s+(cpp_fused_\w+)\(", text))  # the C++ wrapper's
            names.update(re.findall(r"^(cpp_fused_\w+) = async_compile", text, re.M))  # Python's
    return {
        "ir_nodes": metrics.ir_nodes_pre_fusion,
        "loop_nests": metrics.generated_kernel_count,
        "functions": len(names),
    }


def phase_totals() -> dict[str, float]:
    from torch._dynamo.utils import compilation_time_metrics

    return {
        phase: round(sum(compilation_time_metrics.get(key, [])), 2) for phase, key in PHASES.items()
    }


# ----- the driver -----
def isa_probes(folder: str) -> None:
    """Build inductor's vector ISA probe libraries into the cache `folder` (see --isa-cached)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": folder}
    probe = "from torch._inductor import cpu_vec_isa; cpu_vec_isa.pick_vec_isa()"
    subprocess.run([sys.executable, "-c", probe], env=env, check=True)


def run_one(args: argparse.Namespace, depth: int, loop: str, isa: str | None = None) -> dict:
    """One (depth, loop) in a fresh process and a cold inductor cache; isa: a cache folder
    holding only the ISA probe libraries, copied in first (None: none)."""
    with tempfile.TemporaryDirectory(prefix="inductor-cold-") as cache:
        if isa is not None:
            shutil.copytree(isa, cache, dirs_exist_ok=True)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, __file__, "--worker", loop, "--depth", str(depth)]
        argv += ["--width", str(args.width), "--batch", str(args.batch)]
        argv += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--dtype", args.dtype]
        load_before = os.getloadavg()[0]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        load_after = os.getloadavg()[0]
    if done.returncode != 0:
        raise RuntimeError(f"{loop} at depth {depth} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["load_1min"] = [round(load_before, 2), round(load_after, 2)]
    result["isa_cached"] = isa is not None
    return result


def growth(rows: list[dict], loop: str) -> float | None:
    """Least-squares seconds of first step per added block."""
    points = [(r["depth"], r["first_step_s"]) for r in _cold(rows) if r["loop"] == loop]
    if len(points) < 2:
        return None
    mx = statistics.fmean(d for d, _ in points)
    my = statistics.fmean(t for _, t in points)
    den = sum((d - mx) ** 2 for d, _ in points)
    return sum((d - mx) * (t - my) for d, t in points) / den if den else None


def _cold(rows: list[dict]) -> list[dict]:
    """The runs with nothing cached (the goals' runs)."""
    return [r for r in rows if not r.get("isa_cached")]


def ratio(rows: list[dict], depth: int, key: str, num: str, den: str) -> float | None:
    """Loop num's `key` over loop den's at depth, among rows (None: either run missing)."""
    by = {r["loop"]: r for r in rows if r["depth"] == depth}
    a, b = by.get(num), by.get(den)
    return None if a is None or b is None else a[key] / b[key]


def goals(rows: list[dict]) -> list[tuple[str, float | None, float, bool | None]]:
    cold = _cold(rows)
    depths = sorted({r["depth"] for r in rows})
    first8 = ratio(cold, 8, "first_step_s", "compile_step", "torch.compile")
    steady8 = ratio(cold, 8, "steady_ms", "torch.compile", "compile_step")
    steady_all = [ratio(cold, d, "steady_ms", "torch.compile", "compile_step") for d in depths]
    steady_min = min((s for s in steady_all if s is not None), default=None)
    values = [first8, growth(rows, "compile_step"), steady8, steady_min]
    out = []
    for (name, target), value in zip(GOALS.items(), values, strict=True):
        met = None
        if value is not None:
            met = value <= target if "(<=)" in name else value >= target
        out.append((name, value, target, met))
    return out


def _row_order(r: dict) -> tuple:
    return (r["depth"], bool(r.get("isa_cached")), LOOPS.index(r["loop"]))


def render(args, rows: list[dict], where: str) -> str:
    lines = [
        f"# compile_step vs torch.compile(model): first step and steady step ({args.dtype})",
        "",
        f"Machine: {where}. Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC.",
        f"Residual MLP blocks, width {args.width}, batch {args.batch}, AdamW, MSE; each run in a "
        "fresh process with a cold inductor cache, one torch thread. First step: wall seconds "
        f"(the compile); steady: median of {args.steps} steps after {args.warmup}, process CPU "
        "ms. Load: the 1-minute load average before / after each run (other jobs share the "
        "machine). ISA probes: inductor's vector-ISA probe libraries (a g++ build and a load "
        "per candidate ISA, made once per inductor cache before the first CPU kernel) built by "
        "the run, as in a cold cache, or cached (--isa-cached: copied into the cold cache "
        "first; the probes' loads still run).",
        "",
        "| depth | loop | ISA probes | first step (s) | steady (ms) | load before/after | "
        "regions | "
        "dynamo / aot+inductor / scheduler / codegen / c++ builds (s) | "
        "IR nodes / C++ loop nests / C++ functions |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=_row_order):
        phases = r.get("phases_s")
        phase_text = (
            ""
            if phases is None
            else " / ".join(
                f"{phases[k]:.1f}"
                for k in ("dynamo", "aot + inductor", "scheduler", "codegen", "c++ builds")
            )
        )
        regions = {True: "yes", False: "no"}.get(r.get("regional"), "")
        counts = r.get("counts")
        count_text = (
            ""
            if counts is None
            else f"{counts['ir_nodes']} / {counts['loop_nests']} / {counts['functions']}"
        )
        lines.append(
            f"| {r['depth']} | {r['loop']} | {'cached' if r.get('isa_cached') else 'built'} | "
            f"{r['first_step_s']:.1f} | {r['steady_ms']:.2f} | "
            f"{r['load_1min'][0]:.1f} / {r['load_1min'][1]:.1f} | {regions} | {phase_text} | "
            f"{count_text} |"
        )
    lines += [
        "",
        "Goals (issue 44):",
        "",
        "| goal | measured | target | met |",
        "|---|---|---|---|",
    ]
    for name, value, target, met in goals(rows):
        shown = "n/a" if value is None else f"{value:.2f}"
        lines.append(f"| {name} | {shown} | {target} | {'n/a' if met is None else met} |")
    cached_rows = [r for r in rows if r.get("isa_cached")]
    for depth in sorted({r["depth"] for r in cached_rows}):
        cached = ratio(cached_rows, depth, "first_step_s", "compile_step", "torch.compile")
        if cached is not None:
            lines.append(
                f"\nFirst step with the ISA probes cached, depth {depth}: compile_step / "
                f"torch.compile {cached:.2f} (compile_step probes on a thread while it traces: "
                "mixprec.core.inductor_warmup)."
            )
    for loop in ("torch.compile", "compile_step"):
        g = growth(rows, loop)
        if g is not None:
            lines.append(f"\n{loop}: first step grows {g:.2f} s per block (least squares).")
    return "\n".join(lines) + "\n"


def chart(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for loop in LOOPS:
        mine = sorted((r for r in _cold(rows) if r["loop"] == loop), key=lambda r: r["depth"])
        depths = [r["depth"] for r in mine]
        if loop != "eager":
            left.plot(depths, [r["first_step_s"] for r in mine], marker="o", label=loop)
        right.plot(depths, [r["steady_ms"] for r in mine], marker="o", label=loop)
    for r in rows:
        if r.get("isa_cached") and r["loop"] != "eager":
            left.scatter([r["depth"]], [r["first_step_s"]], marker="x", color="black")
            left.annotate(f"{r['loop']}, ISA cached", (r["depth"], r["first_step_s"]), fontsize=7)
    left.set_xlabel("blocks")
    left.set_ylabel("first step (s, cold cache)")
    right.set_xlabel("blocks")
    right.set_ylabel("steady step (ms CPU)")
    for ax in (left, right):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--depths", default="2,8,24", help="comma-separated block counts")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30, help="timed steady steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--loops", default=",".join(DEFAULT_LOOPS), help=f"of {LOOPS}")
    parser.add_argument(
        "--isa-cached",
        default="8",
        help="depths also run (torch.compile and compile_step) with the ISA probe libraries "
        "cached; '' for none",
    )
    parser.add_argument("--out", type=Path, help="folder (default: a fresh runs/ folder)")
    parser.add_argument("--name", default="compile_cpu", help="file stem of the results")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for value, name in ((args.width, "width"), (args.batch, "batch"), (args.steps, "steps")):
        if value < 1:
            parser.error(f"--{name} {value}: must be >= 1")
    loops = tuple(args.loops.split(","))
    unknown = [loop for loop in loops if loop not in LOOPS]
    if unknown:
        parser.error(f"--loops {args.loops!r}: {unknown} unknown; choose from {LOOPS}")
    args.loops = loops
    try:
        args.depths = [int(d) for d in args.depths.split(",")]
    except ValueError:
        parser.error(f"--depths {args.depths!r}: comma-separated ints, e.g. 2,8,24")
    if any(d < 1 for d in args.depths):
        parser.error(f"--depths {args.depths}: each must be >= 1")
    try:
        args.isa_cached = [int(d) for d in args.isa_cached.split(",") if d.strip()]
    except ValueError:
        parser.error(f"--isa-cached {args.isa_cached!r}: comma-separated ints, e.g. 8")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        print(json.dumps(worker(argparse.Namespace(**{**vars(args), "loop": args.worker}))))
        return 0
    import torch

    from mixprec.bench.command import fresh_out_dir
    from mixprec.bench.report import write_record
    from mixprec.bench.runner import cpu_model

    out = args.out or fresh_out_dir("bench_compile")
    where = f"{cpu_model()}, {os.cpu_count()} cores, 1 torch thread, torch {torch.__version__}"
    rows: list[dict] = []
    compiled = [loop for loop in args.loops if loop in ("torch.compile", "compile_step")]
    runs = []
    for i, depth in enumerate(args.depths):
        order = list(args.loops[i % len(args.loops) :] + args.loops[: i % len(args.loops)])
        runs += [(depth, loop, False) for loop in order]
        if depth in args.isa_cached:
            runs += [(depth, loop, True) for loop in (compiled if i % 2 else compiled[::-1])]
    with tempfile.TemporaryDirectory(prefix="inductor-isa-") as isa:
        if any(cached for *_, cached in runs):
            isa_probes(isa)
        for depth, loop, cached in runs:
            note = ", ISA cached" if cached else ""
            print(
                f"[{len(rows) + 1}/{len(runs)}] depth {depth}, {loop}{note} ...",
                end=" ",
                flush=True,
            )
            row = run_one(args, depth, loop, isa if cached else None)
            rows.append(row)
            print(
                f"first {row['first_step_s']:.1f} s, steady {row['steady_ms']:.2f} ms, "
                f"load {row['load_1min']}",
                flush=True,
            )
    text = render(args, rows, where)
    meta = {"machine": where, "args": {k: str(v) for k, v in vars(args).items()}}
    data = {"meta": meta, "rows": rows, "goals": goals(rows)}
    title = f"compile_step vs torch.compile ({where})"
    paths = write_record(out, args.name, text, data, lambda png: chart(rows, png, title))
    print(text)
    print("written:", ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
