"""The README's Python snippets run as written: each after the README's setup block, nothing else.

The first Python block of the README is the setup every other snippet starts from (a tiny
model, optimizer, loss, loader). A snippet whose first line is `# run: mixprec run ...` is a
script: it runs as the README says, setup + snippet saved as train.py and started with that
command. Every other snippet runs in-process in a fresh namespace holding only what the setup
defined. Each runs in its own temporary directory, so "ckpt/..." paths land there.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import mixprec

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
SETUP, SNIPPETS = BLOCKS[0], BLOCKS[1:]
RUN_LINE = re.compile(r"\A# run: (mixprec run .*)\n")
SRC = Path(mixprec.__file__).resolve().parent.parent


def test_readme_setup_defines_what_the_snippets_use() -> None:
    assert len(SNIPPETS) >= 10
    ns: dict = {}
    exec(compile(SETUP, "README.md setup", "exec"), ns)
    for name in ("model", "optimizer", "criterion", "lr_scheduler", "x", "y", "loader"):
        assert name in ns, name
    assert sum(bool(RUN_LINE.match(s)) for s in SNIPPETS) >= 4  # config, Booster x2, pipeline


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_runs(index: int, tmp_path: Path, monkeypatch) -> None:
    code = SNIPPETS[index]
    name = f"README.md snippet {index + 1}"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    launch = RUN_LINE.match(code)
    if launch is None:
        assert "mixprec.launch" not in code, f"{name} launches: give it a '# run:' line"
        ns: dict = {}
        exec(compile(SETUP, "README.md setup", "exec"), ns)
        exec(compile(code, name, "exec"), ns)
        return
    # As the README says: setup + snippet saved as train.py, started with the stated command
    argv = shlex.split(launch.group(1))
    assert argv[:2] == ["mixprec", "run"] and argv[-1] == "train.py", argv
    (tmp_path / "train.py").write_text(SETUP + "\n" + code)
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mixprec.cli", "run", *argv[2:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{name}:\n{done.stdout}\n{done.stderr[-4000:]}"
