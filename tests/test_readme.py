"""Every code block of README.md and docs/**/*.md runs as written, or says why it cannot.

Conventions (what a page may contain, and how each block runs):

- The README's first Python block is the setup (a tiny model, optimizer, loss, loader). Every
  other Python block, in the README or in docs/, runs after that setup and nothing else, in a
  fresh namespace and its own temporary directory (so "ckpt/..." paths land there). A page may
  repeat the setup block word for word to show it; that copy is not run again.
- A Python block whose first line is `# run: mixprec run ...` is a script: setup + block are
  saved as train.py and started with that command, as the page says.
- A block that cannot run here (a shell command, a GPU, output shown as text) carries an HTML
  comment on the line just before its fence, naming the reason:
  `<!-- not-run: needs a CUDA device -->`. Any other fence must be ```python.
- A block that appears word for word in several places runs once (the first place is its id).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import mixprec

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = (README, *sorted((ROOT / "docs").rglob("*.md")))
FENCE = re.compile(r"^( *)```(\S*)\n(.*?)^\1```$", flags=re.S | re.M)  # indented in a list too
NOT_RUN = re.compile(r"<!-- not-run: (\S.*?) -->\s*\Z")
RUN_LINE = re.compile(r"\A# run: (mixprec run .*)\n")
SRC = Path(mixprec.__file__).resolve().parent.parent


@dataclass(frozen=True)
class Block:
    where: str  # "docs/x.md:12", the fence's line
    lang: str
    code: str
    not_run: str | None  # the reason, from the comment before the fence


def read_blocks(page: Path) -> list[Block]:
    text = page.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = NOT_RUN.search(before)
        line = text.count("\n", 0, match.start()) + 1
        where = f"{page.relative_to(ROOT).as_posix()}:{line}"
        code = textwrap.dedent(match.group(3))
        blocks.append(Block(where, match.group(2), code, reason and reason.group(1)))
    return blocks


ALL_BLOCKS = [b for page in PAGES for b in read_blocks(page)]
SETUP = next(b for b in ALL_BLOCKS if b.lang == "python").code
assert ALL_BLOCKS[0].where.startswith("README.md")


def runnable() -> list[Block]:
    seen = {SETUP}
    out = []
    for b in ALL_BLOCKS:
        if b.not_run is None and b.code not in seen:
            seen.add(b.code)
            out.append(b)
    return out


SNIPPETS = runnable()


def test_every_block_runs_or_says_why_not() -> None:
    bad = [
        f"{b.where} (```{b.lang})" for b in ALL_BLOCKS if b.not_run is None and b.lang != "python"
    ]
    assert not bad, f"not Python and no '<!-- not-run: reason -->' before the fence: {bad}"


def test_setup_defines_what_the_snippets_use() -> None:
    assert len(SNIPPETS) >= 10
    ns: dict = {}
    exec(compile(SETUP, "README.md setup", "exec"), ns)
    for name in ("model", "optimizer", "criterion", "lr_scheduler", "x", "y", "loader"):
        assert name in ns, name
    assert sum(bool(RUN_LINE.match(s.code)) for s in SNIPPETS) >= 4  # config, Booster, pipeline


@pytest.mark.parametrize("block", SNIPPETS, ids=[b.where for b in SNIPPETS])
def test_snippet_runs(block: Block, tmp_path: Path, monkeypatch) -> None:
    code, name = block.code, block.where
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    launch = RUN_LINE.match(code)
    if launch is None:
        assert "mixprec.launch" not in code, f"{name} launches: give it a '# run:' line"
        ns: dict = {}
        exec(compile(SETUP, "README.md setup", "exec"), ns)
        exec(compile(code, name, "exec"), ns)
        return
    # As the page says: setup + snippet saved as train.py, started with the stated command
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
