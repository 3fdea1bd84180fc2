"""The documentation: README.md stays short, the site builds strictly, the API pages cover the
public names, and the README's test command is the one CI runs.

The snippets themselves run in tests/test_readme.py.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 250

# Every module whose `__all__` is public API: the package and each face (Colossal-AI's mirror,
# Apex, Paddle), fp8 and the debugging tools. Each name they export needs an API entry.
PUBLIC_MODULES = (
    "mixprec",
    "mixprec.amp",
    "mixprec.booster",
    "mixprec.booster.plugin",
    "mixprec.engine",
    "mixprec.zero",
    "mixprec.logging",
    "mixprec.utils",
    "mixprec.nn.lr_scheduler",
    "mixprec.quantization.fp8",
    "mixprec.apex",
    "mixprec.apex.amp",
    "mixprec.apex.parallel",
    "mixprec.apex.fp16_utils",
    "mixprec.paddle",
    "mixprec.paddle.debugging",
    "mixprec.paddle.optimizer",
    "mixprec.paddle.static",
    "mixprec.paddle.static.amp",
    "mixprec.fp8",
    "mixprec.debugging",
)


def test_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_readme_test_command_is_what_ci_runs() -> None:
    """The README's second set-up command ends with the commands .ci/run runs, word for word."""
    setup = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S).group(1)
    main_job, tests = setup.strip().splitlines()
    assert main_job.endswith("mixprec bench"), main_job
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    ci_tests = ci[ci.index("# The README's second command (tests): keep the two in step.") + 1]
    assert tests.endswith(" && " + ci_tests), (tests, ci_tests)
    install = "python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e '.[dev]'"
    assert main_job.startswith(install) and tests.startswith(install)
    assert shlex.split(ci_tests)  # one shell line


def test_readme_links_resolve() -> None:
    """README.md is read on GitHub, outside the site's --strict build: its links checked here."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    relative = [link for link in links if "://" not in link]
    assert relative
    missing = [link for link in relative if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_every_public_module_has_an_api_directive() -> None:
    api = "\n".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.md"))
    documented = set(re.findall(r"^::: (\S+)", api, flags=re.M))
    missing = [m for m in PUBLIC_MODULES if m not in documented]
    assert not missing, f"no '::: module' directive in docs/api/ for {missing}"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip(
        "mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'"
    )
    pytest.importorskip("mkdocstrings_handlers.python")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.mark.slow
@pytest.mark.host_only
def test_api_pages_have_an_entry_for_every_exported_name(site: Path) -> None:
    html = "\n".join(p.read_text() for p in (site / "api").rglob("index.html"))
    anchors = set(re.findall(r'id="(mixprec[\w.]*)"', html))
    missing = []
    for m in PUBLIC_MODULES:
        module = importlib.import_module(m)
        for name in module.__all__:
            obj = getattr(module, name)
            # the entry sits under the exporting module, or (a name loaded on first use, or
            # one its module shadows) under the path that defines it
            defined = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
            if f"{m}.{name}" not in anchors and defined not in anchors:
                missing.append(f"{m}.{name}")
    assert not missing, f"the API pages have no entry for {missing}"
