"""One core, thin faces: the core imports no face, and the Apex face has no import circle.

Checked on the source (every import statement, deferred ones inside functions included).
"""

from __future__ import annotations

import ast
from pathlib import Path

import mixprec

SRC = Path(mixprec.__file__).resolve().parent
CORE = [
    "policy.py",
    "autocast.py",
    "casting.py",
    "scaling.py",
    "grad_scaler.py",
    "optim.py",
    "fused_step.py",
    "step_math.py",
    "checkpoint.py",
    "module.py",
    "fp8",
]
FACES = (
    "mixprec.amp",
    "mixprec.engine",
    "mixprec.booster",
    "mixprec.apex",
    "mixprec.paddle",
    "mixprec.integrations",
    "mixprec.cli",
    "mixprec.mixed_precision",
)


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement in `path` names (`from a import b` gives a and a.b)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def core_files() -> list[Path]:
    files = []
    for name in CORE:
        path = SRC / name
        files += sorted(path.glob("*.py")) if path.is_dir() else [path]
    return files


def test_the_core_imports_no_face() -> None:
    offenders = {
        str(path.relative_to(SRC)): sorted(
            name for name in imported_modules(path) if name.startswith(FACES)
        )
        for path in core_files()
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_apex_optimizer_does_not_import_apex_amp() -> None:
    # amp imports _optim and hands AmpOptimizer its scale_loss: no circle back
    assert "mixprec.apex.amp" not in imported_modules(SRC / "apex" / "_optim.py")


def test_the_apex_face_registers_its_mode_parser_with_the_core() -> None:
    from mixprec.apex.policy import apex_policy
    from mixprec.policy import MODE_PARSERS, to_policy

    assert "fp16_apex" in MODE_PARSERS
    assert to_policy("fp16_apex", {"opt_level": "O2"}) == apex_policy(opt_level="O2")
