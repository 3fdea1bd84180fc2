"""The `mixprec` command: one argparse subcommand per entry of COMMANDS.

`mixprec run` starts a training script on N processes per node through torch's own elastic
launcher (torch.distributed.run, i.e. torchrun), so workers see the RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT that mixprec.launch.launch_from_torch reads.
A new subcommand is one more COMMANDS entry: a help line, an add_arguments and a run function.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mixprec.core.policy import did_you_mean

WORKER = str(Path(__file__).with_name("worker.py"))
"""The file each `mixprec run` worker runs (by path): it runs the training script."""

NPROC_WORDS: tuple[str, ...] = ("auto", "cpu", "gpu", "xpu")
"""torchrun's non-numeric --nproc_per_node values (one worker per device of that kind)."""
MASTER_ADDR = "127.0.0.1"
"""`mixprec run`'s default --master_addr: this machine."""


@dataclass(frozen=True, kw_only=True)
class Command:
    """One `mixprec <name>` subcommand."""

    help: str
    """One line shown in `mixprec --help`."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Declares the subcommand's options on its own parser."""
    run: Callable[[argparse.Namespace], int]
    """Runs the subcommand; returns the process exit status."""


def _nproc_per_node(value: str) -> str:
    if value in NPROC_WORDS or (value.isdigit() and int(value) >= 1):
        return value
    raise argparse.ArgumentTypeError(
        f"--nproc_per_node={value!r} must be an int >= 1 or a device word."
        + did_you_mean(value, NPROC_WORDS)
    )


def _nnodes(value: str) -> str:
    match = re.fullmatch(r"(\d+)(?::(\d+))?", value)
    if match is None or int(match[1]) < 1 or (match[2] and int(match[2]) < int(match[1])):
        raise argparse.ArgumentTypeError(
            f"--nnodes={value!r} must be an int >= 1 or a range MIN:MAX with 1 <= MIN <= MAX."
        )
    return value


def _port(value: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"--master_port={value!r} must be an int in [1, 65535].")
    return int(value)


def _non_negative(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"--node_rank={value!r} must be an int >= 0.")
    return int(value)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """`mixprec run`'s options: the torchrun subset Colossal-AI's examples use."""
    # both spellings, as torchrun accepts: seed 001 writes --nproc_per_node
    parser.add_argument(
        "--nproc_per_node",
        "--nproc-per-node",
        dest="nproc_per_node",
        type=_nproc_per_node,
        default="1",
        help="worker processes per node: an int, or auto/cpu/gpu/xpu (default: 1)",
    )
    parser.add_argument(
        "--nnodes",
        type=_nnodes,
        default="1",
        help="number of nodes, or MIN:MAX for an elastic job (default: 1)",
    )
    parser.add_argument(
        "--node_rank",
        "--node-rank",
        dest="node_rank",
        type=_non_negative,
        default=0,
        help="rank of this node (default: 0)",
    )
    parser.add_argument(
        "--master_addr",
        "--master-addr",
        dest="master_addr",
        default=MASTER_ADDR,
        help="address of the rank-0 node (default: 127.0.0.1)",
    )
    parser.add_argument(
        "--master_port",
        "--master-port",
        dest="master_port",
        type=_port,
        default=None,
        help="port on the rank-0 node (default: a free port when single-node, else 29500)",
    )
    parser.add_argument("training_script", help="the Python script each worker runs")
    parser.add_argument(
        "training_script_args",
        nargs=argparse.REMAINDER,
        help="arguments passed to the script unchanged (e.g. --config config.py)",
    )


def run_args_to_torchrun_argv(args: argparse.Namespace) -> list[str]:
    """`mixprec run`'s parsed options -> the argv torch.distributed.run parses."""
    argv = [
        "--nproc-per-node",
        str(args.nproc_per_node),
        "--nnodes",
        str(args.nnodes),
        "--node-rank",
        str(args.node_rank),
        "--master-addr",
        str(args.master_addr),
    ]
    if args.master_port is not None:
        argv += ["--master-port", str(args.master_port)]
    elif _one_node(args.nnodes) and args.master_addr == MASTER_ADDR:
        # A free port, bound by the rendezvous store itself (torchrun's --standalone), on every
        # torch: torch 2.11's torchrun would take 29500, so two jobs on one machine collided.
        # (--standalone serves on localhost: an address the user names keeps torchrun's way.)
        argv.insert(0, "--standalone")
    # each worker runs mixprec/worker.py, which runs the script and then tears its group down
    return [*argv, WORKER, str(args.training_script), *args.training_script_args]


def _one_node(nnodes: str) -> bool:
    """--nnodes is exactly one node ("1" or "1:1"), not an elastic range."""
    return set(nnodes.split(":")) == {"1"}


def run_command(args: argparse.Namespace) -> int:
    """Start the script on every worker through torchrun; 1 if any worker failed."""
    if not Path(args.training_script).is_file():
        print(
            f"mixprec run: error: training script {args.training_script!r} does not exist.",
            file=sys.stderr,
        )
        return 2
    import torch.distributed.run as torchrun  # deferred: importing torch costs ~1 s
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.run(torchrun.parse_args(run_args_to_torchrun_argv(args)))
    except ChildFailedError as err:
        # the workers' own tracebacks are already on stderr; this is torchrun's summary, under
        # the script's name (torchrun's entrypoint is the worker)
        named = ChildFailedError(Path(args.training_script).name, err.failures)
        print(named.format_msg(), file=sys.stderr)
        return 1
    return 0


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    from mixprec.debugging.doctor import add_doctor_arguments as add

    add(parser)


def doctor_command(args: argparse.Namespace) -> int:
    from mixprec.debugging.doctor import run_doctor

    return run_doctor(args)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from mixprec.bench import add_bench_arguments as add

    add(parser)


def bench_command(args: argparse.Namespace) -> int:
    from mixprec.bench import bench_command as run

    return run(args)


COMMANDS: dict[str, Command] = {
    "run": Command(
        help="run a training script on N processes per node (torchrun underneath)",
        add_arguments=add_run_arguments,
        run=run_command,
    ),
    "doctor": Command(
        help="what this hardware can run (fp16/bf16/fp8), and a model's dtype/alignment report",
        add_arguments=add_doctor_arguments,
        run=doctor_command,
    ),
    "bench": Command(
        help="fp32 vs every mixed-precision mode: memory, it/s, samples/s, speedup, loss",
        add_arguments=add_bench_arguments,
        run=bench_command,
    ),
}
"""Every `mixprec` subcommand, by name; `mixprec --help` lists them in this order."""


def build_parser() -> argparse.ArgumentParser:
    """The `mixprec` parser with one subparser per COMMANDS entry."""
    parser = argparse.ArgumentParser(
        prog="mixprec",
        description="mixprec: automatic mixed precision training for PyTorch.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        sub = subparsers.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `mixprec` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
