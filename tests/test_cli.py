"""The `mixprec` command: the subcommand table, `run`'s torchrun argv, and real 2-process runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed.run as torchrun

from mixprec import cli


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name, command in cli.COMMANDS.items():
        assert name in out and command.help.split()[0] in out


def test_the_console_script_is_installed_and_runs_main():
    # pyproject's [project.scripts] entry, installed next to this interpreter
    script = shutil.which("mixprec", path=str(Path(sys.executable).parent))
    assert script is not None, "the `mixprec` console script is not installed in this env"
    done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "run" in done.stdout


def test_a_new_subcommand_is_one_table_entry(monkeypatch):
    def add_arguments(parser):
        parser.add_argument("--times", type=int, required=True)

    calls = []
    extra = cli.Command(
        help="say hello", add_arguments=add_arguments, run=lambda args: calls.append(args) or 7
    )
    monkeypatch.setitem(cli.COMMANDS, "hello", extra)
    assert cli.main(["hello", "--times", "3"]) == 7
    assert calls[0].times == 3 and calls[0].command == "hello"


def test_no_or_unknown_subcommand_is_an_error(capsys):
    for argv in ([], ["rum"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2
    assert "'rum'" in capsys.readouterr().err


def parse_run(argv):
    return cli.build_parser().parse_args(["run", *argv])


def test_run_builds_torchrun_argv_that_torchrun_parses():
    args = parse_run(
        [
            "--nproc_per_node",
            "2",
            "--nnodes",
            "1",
            "--node_rank",
            "0",
            "--master_addr",
            "localhost",
            "--master_port",
            "1234",
            "train.py",
            "--config",
            "config/config_AMP_torch.py",
            "--flag",
        ]
    )
    argv = cli.run_args_to_torchrun_argv(args)
    assert argv == [
        "--nproc-per-node",
        "2",
        "--nnodes",
        "1",
        "--node-rank",
        "0",
        "--master-addr",
        "localhost",
        "--master-port",
        "1234",
        cli.WORKER,
        "train.py",
        "--config",
        "config/config_AMP_torch.py",
        "--flag",
    ]
    parsed = torchrun.parse_args(argv)
    assert (parsed.nproc_per_node, parsed.nnodes, parsed.node_rank) == ("2", "1", 0)
    assert (parsed.master_addr, parsed.master_port) == ("localhost", 1234)
    assert parsed.training_script == cli.WORKER  # which runs train.py with its arguments
    assert parsed.training_script_args == [
        "train.py",
        *("--config", "config/config_AMP_torch.py", "--flag"),
    ]


def test_run_leaves_the_port_to_torchrun_when_not_given():
    args = parse_run(["--nproc-per-node", "auto", "--nnodes", "1:2", "s.py"])
    argv = cli.run_args_to_torchrun_argv(args)
    assert "--master-port" not in argv and "--standalone" not in argv
    assert argv[:4] == ["--nproc-per-node", "auto", "--nnodes", "1:2"]
    # torchrun's own default then (2.13: None, a free port; 2.11: 29500)
    assert torchrun.parse_args(argv).master_port == torchrun.parse_args(["s.py"]).master_port


@pytest.mark.parametrize("nnodes", ["1", "1:1"])
def test_one_node_without_a_port_gets_a_free_one_on_every_torch(nnodes):
    """torchrun --standalone: the rendezvous store binds a free port itself (torch 2.11's
    torchrun alone would take 29500, and two single-node jobs on one machine collided)."""
    argv = cli.run_args_to_torchrun_argv(parse_run(["--nnodes", nnodes, "s.py"]))
    parsed = torchrun.parse_args(argv)
    assert parsed.standalone and "--master-port" not in argv
    given = cli.run_args_to_torchrun_argv(parse_run(["--master_port", "1234", "s.py"]))
    assert "--standalone" not in given  # a port the user names is used as named
    addr = cli.run_args_to_torchrun_argv(parse_run(["--master_addr", "10.0.0.2", "s.py"]))
    assert "--standalone" not in addr  # and so is an address (--standalone serves on localhost)
    assert torchrun.parse_args(addr).master_addr == "10.0.0.2"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc_per_node", "0", "s.py"], "--nproc_per_node='0'"),
        (["--nproc_per_node", "gpus", "s.py"], "Did you mean 'gpu'"),
        (["--nnodes", "2:1", "s.py"], "--nnodes='2:1'"),
        (["--nnodes", "0", "s.py"], "--nnodes='0'"),
        (["--master_port", "70000", "s.py"], r"--master_port='70000'"),
        (["--node_rank", "-1", "s.py"], "--node_rank='-1'"),
        ([], "training_script"),
    ],
)
def test_bad_run_options_are_rejected_with_the_value(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        parse_run(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_run_of_a_missing_script_fails_before_torchrun(tmp_path, capsys):
    assert cli.main(["run", str(tmp_path / "nope.py")]) == 2
    assert "nope.py" in capsys.readouterr().err


SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from mixprec.config import gpc
    from mixprec.launch import destroy, get_default_parser, launch_from_torch

    parser = get_default_parser()
    parser.add_argument("--out")
    args = parser.parse_args()
    launch_from_torch(args.config, verbose=False)
    t = torch.tensor([float(gpc.rank + 1)])
    dist.all_reduce(t)
    result = {
        "rank": gpc.rank, "local_rank": gpc.local_rank, "world_size": gpc.world_size,
        "sum": t.item(), "mode": gpc.config.fp16.mode, "epochs": gpc.config.NUM_EPOCHS,
    }
    destroy()
    with open(os.path.join(args.out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
    """
)


def mixprec_run(tmp_path, *argv):
    # the console script is `mixprec`; `-m mixprec.cli` is the same main() under this venv
    return subprocess.run(
        [sys.executable, "-m", "mixprec.cli", "run", *argv],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.distributed
def test_mixprec_run_starts_two_workers_that_all_reduce(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "config_AMP_torch.py").write_text(
        "from mixprec import AMP_TYPE\nNUM_EPOCHS = 2\nfp16 = dict(mode=AMP_TYPE.TORCH)\n"
    )
    port = str(free_port())
    done = mixprec_run(
        tmp_path,
        *("--nproc_per_node", "2", "--master_port", port, "train.py"),
        *("--config", "config_AMP_torch.py", "--out", str(tmp_path)),
    )
    assert done.returncode == 0, done.stderr
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["local_rank"], r["world_size"]) for r in results] == [
        (0, 0, 2),
        (1, 1, 2),
    ]
    assert [r["sum"] for r in results] == [3.0, 3.0]  # 1 + 2, exact in fp32
    assert [(r["mode"], r["epochs"]) for r in results] == [("torch", 2), ("torch", 2)]


@pytest.mark.distributed
def test_mixprec_run_exits_1_when_a_worker_fails(tmp_path):
    (tmp_path / "fail.py").write_text(
        "import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n"
    )
    done = mixprec_run(tmp_path, "--nproc_per_node", "2", "fail.py")
    assert done.returncode == 1
    assert "fail.py FAILED" in done.stderr
    assert re.search(r"exitcode\s*:\s*3", done.stderr), done.stderr  # torchrun's summary


WHAT_THE_SCRIPT_SEES = textwrap.dedent(
    """
    import json, sys
    seen = {
        "name": __name__, "argv": sys.argv, "path0": sys.path[0],
        "preloaded": sorted(m for m in ("torch", "mixprec") if m in sys.modules),
    }
    def main():
        with open("seen.json", "w") as f:
            json.dump(seen, f)
    if __name__ == "__main__":
        main()
    """
)


def test_the_worker_runs_the_script_as_python_would(tmp_path):
    """sys.argv, __main__, sys.path[0] as `python script args`; nothing imported before the
    script (torch reads OMP_NUM_THREADS and others at import)."""
    (tmp_path / "sub").mkdir()
    script = tmp_path / "sub" / "train.py"
    script.write_text(WHAT_THE_SCRIPT_SEES)
    done = subprocess.run(
        [sys.executable, cli.WORKER, str(script), "--lr", "0.1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen == {
        "name": "__main__",
        "argv": [str(script), "--lr", "0.1"],
        "path0": str(script.parent),
        "preloaded": [],
    }


def test_a_failing_script_keeps_its_traceback_and_status(tmp_path):
    (tmp_path / "bad.py").write_text("import sys\nx = 1\nraise ValueError('boom')\n")
    done = subprocess.run(
        [sys.executable, cli.WORKER, "bad.py"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 1
    assert 'bad.py", line 3' in done.stderr and "ValueError: boom" in done.stderr
    (tmp_path / "exit.py").write_text("import sys\nsys.exit(5)\n")
    done = subprocess.run([sys.executable, cli.WORKER, "exit.py"], cwd=tmp_path)
    assert done.returncode == 5


LEAVES_THE_GROUP_UP = textwrap.dedent(
    """
    import atexit, os
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from mixprec.launch import launch_from_torch

    launch_from_torch(config={}, verbose=False)
    model = DDP(torch.nn.Linear(4, 2))  # alive in the globals at the script's end
    model(torch.ones(3, 4)).sum().backward()

    def at_exit():
        with open(f"rank{dist.get_rank() if dist.is_initialized() else os.environ['RANK']}", "w") as f:
            f.write(str(dist.is_initialized()))

    atexit.register(at_exit)
    """
)


@pytest.mark.distributed
def test_mixprec_run_destroys_the_group_a_script_leaves_up(tmp_path):
    """A gloo group held by live objects at interpreter exit sometimes aborted a finished
    worker (SIGABRT): the worker frees the script's globals, then destroys the group."""
    (tmp_path / "train.py").write_text(LEAVES_THE_GROUP_UP)
    done = mixprec_run(tmp_path, "--nproc_per_node", "2", "train.py")
    assert done.returncode == 0, done.stderr
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["False", "False"]


def test_doctor_reports_fp8_for_every_device_and_how_mixprec_runs_it(capsys):
    from mixprec.core.hardware import fp8_finding
    from mixprec.fp8 import fp8_kernel_problem

    real = fp8_finding("cuda:0", None)  # sm_89+: the kernel exists
    assert real.dtype == "float8" and real.level == "ok" and "torch._scaled_mm" in real.message
    old = fp8_finding("cuda:0", "float8 GEMMs (torch._scaled_mm) need CUDA compute capability 8.9+")
    assert old.level == "warn" and "raises here unless" in old.message
    assert "Float8Config(emulate=True)" in old.message
    cpu = fp8_finding("cpu", None)
    assert cpu.level == "warn" and "emulates on CPU" in cpu.message
    assert "reference kernel" in cpu.message and "emulate=False" in cpu.message
    no_kernel = fp8_finding("cpu", "this torch 2.x has no CPU kernel for torch._scaled_mm")
    assert "no CPU kernel" in no_kernel.message and "emulates on CPU" in no_kernel.message

    assert cli.main(["doctor"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "| float8" in line]
    expected = fp8_finding("cpu", fp8_kernel_problem("cpu")).message
    assert any(row.startswith("| cpu ") and expected in row for row in rows), rows
