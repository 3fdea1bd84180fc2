"""The house's layers as path rules (DESIGN.md), checked on every import statement in the source,
deferred ones inside functions included, so a new module cannot slip past a hand-kept list.

  core/      the engine: imports nothing else from mixprec
  fp8/       Float8 layers: imports only core/ (it hands its model converter to the core)
  parallel/  ZeRO, data sharding, pipeline: imports only core/ and fp8/
  debugging/ the analysis library (op stats, inf/nan locator, hardware and model reports):
             imports only core/ and fp8/, so a face may build on it (Paddle's amp.debugging)
  faces      the Colossal-AI mirror at the top level, apex/, paddle/, integrations/: a face
             imports no other face (Colossal's AMP_TYPE.APEX may use apex/policy)
  programs   bench/, cli, worker: anything
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mixprec

SRC = Path(mixprec.__file__).resolve().parent
# the Colossal-AI mirror: top-level modules and packages users import as colossalai.*
COLOSSAL = (
    "amp",
    "amp_type",
    "booster",
    "engine",
    "config",
    "launch",
    "mixed_precision",
    "logging",
    "utils",
    "nn",
    "zero",
    "quantization",
)
FACES = {
    "colossal": COLOSSAL,
    "apex": ("apex",),
    "paddle": ("paddle",),
    "integrations": ("integrations",),
}
PROGRAMS = ("bench", "cli", "worker")
ALLOWED_FACE_IMPORTS = {("colossal", "mixprec.apex.policy")}  # AMP_TYPE.APEX's presets


def imported_modules(path: Path) -> set[str]:
    """Every mixprec module an import statement in `path` names (`from a import b`: a and a.b)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n == "mixprec" or n.startswith("mixprec.")}


def first_part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(top: str) -> str:
    """core / fp8 / parallel / a face's name / tool / root (mixprec/__init__)."""
    if top in ("core", "fp8", "parallel", "debugging"):
        return top
    for face, tops in FACES.items():
        if top in tops:
            return face
    if top in PROGRAMS:
        return "program"
    return "root" if top in ("", "__init__") else f"unknown:{top}"


def source_files() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def module_top(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py")


def existing_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (SRC / rel).with_suffix(".py").exists() or (SRC / rel / "__init__.py").exists()


def test_every_source_file_has_a_layer() -> None:
    unknown = {
        str(p.relative_to(SRC))
        for p in source_files()
        if layer_of(module_top(p)).startswith("unknown")
    }
    assert unknown == set(), "add the new top-level module to a layer in this test and DESIGN"


def offenders(layer: str, allowed: set[str]) -> dict[str, list[str]]:
    found = {}
    for path in source_files():
        if layer_of(module_top(path)) != layer:
            continue
        bad = sorted(
            name
            for name in imported_modules(path)
            if existing_module(name)
            and name != "mixprec"
            and layer_of(first_part(name)) not in allowed
            and (layer, name) not in ALLOWED_FACE_IMPORTS
            and not any(name.startswith(ok) for _, ok in ALLOWED_FACE_IMPORTS if _ == layer)
        )
        if bad:
            found[str(path.relative_to(SRC))] = bad
    return found


def test_the_core_imports_nothing_else_from_mixprec() -> None:
    assert offenders("core", {"core"}) == {}


def test_fp8_imports_only_the_core() -> None:
    assert offenders("fp8", {"core", "fp8"}) == {}


def test_parallel_imports_only_core_and_fp8() -> None:
    assert offenders("parallel", {"core", "fp8", "parallel"}) == {}


def test_debugging_imports_only_core_and_fp8() -> None:
    assert offenders("debugging", {"core", "fp8", "debugging"}) == {}


@pytest.mark.parametrize("face", sorted(FACES))
def test_a_face_imports_no_other_face(face: str) -> None:
    assert offenders(face, {"core", "fp8", "parallel", "debugging", face}) == {}


def test_no_import_circle_between_modules() -> None:
    """Module-level imports (not deferred ones) form no cycle: each module can be imported first."""
    graph: dict[str, set[str]] = {}
    for path in source_files():
        rel = path.relative_to(SRC).with_suffix("")
        name = ".".join(("mixprec", *rel.parts)).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        deps = set()
        for node in tree.body:  # top level only: deferred imports are how a cycle is broken
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if existing_module(full) else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d.startswith("mixprec.") and existing_module(d)}

    # a package's __init__ importing its own submodules is not a circle
    def is_parent(a: str, b: str) -> bool:
        return b.startswith(a + ".")

    seen: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(n: str) -> None:
        seen[n] = 1
        stack.append(n)
        for d in graph.get(n, ()):
            if is_parent(n, d) or is_parent(d, n):
                continue
            if seen.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in seen:
                visit(d)
        stack.pop()
        seen[n] = 2

    for n in sorted(graph):
        if n not in seen:
            visit(n)
    assert cycles == []


def test_the_apex_face_registers_its_mode_parser_with_the_core() -> None:
    from mixprec.apex.policy import apex_policy
    from mixprec.core.policy import MODE_PARSERS, to_policy

    assert "fp16_apex" in MODE_PARSERS
    assert to_policy("fp16_apex", {"opt_level": "O2"}) == apex_policy(opt_level="O2")


# Words that belong to one face; the core must not carry them (the face hands it data instead).
FACE_WORDS = ("AMP_TYPE",)


def test_the_core_source_carries_no_face_vocabulary() -> None:
    found = {
        str(path.relative_to(SRC)): word
        for path in source_files()
        if layer_of(module_top(path)) == "core"
        for word in FACE_WORDS
        if word in path.read_text()
    }
    assert found == {}, "move the face's words into the face (see mixprec/amp_type.py)"


def test_the_colossal_face_hands_the_core_its_amp_types_as_aliases_and_parsers() -> None:
    from mixprec.amp import AMP_TYPE
    from mixprec.amp_type import naive_amp_policy, torch_amp_policy
    from mixprec.core.policy import MODE_ALIASES, MODE_PARSERS, preset, to_policy

    assert MODE_ALIASES == {"torch": "fp16", "apex": "fp16_apex", "naive": "fp16_naive"}
    assert MODE_PARSERS["fp16"] is torch_amp_policy
    assert MODE_PARSERS["fp16_naive"] is naive_amp_policy
    assert to_policy(AMP_TYPE.NAIVE) == to_policy("naive") == to_policy("fp16_naive")
    assert preset(AMP_TYPE.TORCH) == preset("fp16")


FACE_PACKAGES = ("mixprec.amp", "mixprec.booster", "mixprec.engine", "mixprec.zero")
FACE_PACKAGES += ("mixprec.apex", "mixprec.paddle", "mixprec.integrations")


def defined_names(path: Path) -> set[str]:
    """The public names a module's own top-level statements define (imports left out)."""
    defined: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(t.id for t in targets if isinstance(t, ast.Name))
    return {name for name in defined if not name.startswith("_")}


def colossal_names() -> set[str]:
    """The names mixprec/amp_type.py defines that core/policy.py does not."""
    names = defined_names(SRC / "amp_type.py") - defined_names(SRC / "core" / "policy.py")
    assert {"AMP_TYPE", "TORCH_KEYS", "naive_amp_policy"} <= names  # the parse found them
    return names


def test_at_run_time_the_core_holds_no_face_name_and_no_import_hook() -> None:
    """After `import mixprec` and every face, core.policy carries only its own names: no face
    wrote Colossal's words into it, and no meta-path finder keeps old module paths alive."""
    import importlib
    import sys

    from mixprec.core import policy

    for face in FACE_PACKAGES:
        importlib.import_module(face)
    written = sorted(colossal_names() & set(vars(policy)))
    assert written == [], f"Colossal names bound in mixprec.core.policy: {written}"
    finders = [f for f in sys.meta_path if type(f).__module__.split(".")[0] == "mixprec"]
    assert finders == []


# fp8's modules from the bottom up: each imports (at module top) only fp8 modules before it.
FP8_ORDER = (
    "config",
    "settings",
    "casts",
    "quantize",
    "kernels",
    "recipes",
    "linear",
    "telemetry",
    "convert",
    "checkpoint",
    "__init__",
)


def deferred_mixprec_imports(path: Path) -> list[str]:
    """The mixprec modules imported inside a function or class body of `path` (line: name)."""
    found: set[str] = set()  # a set: a method's import is inside its class and its function
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.ImportFrom) and inner.module:
                names = [inner.module]
            elif isinstance(inner, ast.Import):
                names = [a.name for a in inner.names]
            else:
                continue
            found.update(f"{inner.lineno}: {n}" for n in names if n.split(".")[0] == "mixprec")
    return sorted(found)


def test_fp8_modules_import_downward_at_module_top() -> None:
    """No fp8 module defers a mixprec import into a function (the way an import circle hides),
    and each imports only the fp8 modules below it in FP8_ORDER."""
    fp8_dir = SRC / "fp8"
    assert sorted(p.stem for p in fp8_dir.glob("*.py")) == sorted(FP8_ORDER), (
        "place the new fp8 module in FP8_ORDER"
    )
    deferred = {p.name: deferred_mixprec_imports(p) for p in fp8_dir.glob("*.py")}
    assert {name: found for name, found in deferred.items() if found} == {}
    upward = {}
    for rank, stem in enumerate(FP8_ORDER):
        below = {f"mixprec.fp8.{s}" for s in FP8_ORDER[:rank]}
        fp8_deps = {
            n
            for n in imported_modules(fp8_dir / f"{stem}.py")
            if n.startswith("mixprec.fp8.") and existing_module(n)
        }
        if fp8_deps - below:
            upward[stem] = sorted(fp8_deps - below)
    assert upward == {}


def test_the_fp8_order_check_sees_a_deferred_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import torch\n"
        "class A:\n"
        "    def f(self):\n"
        "        from mixprec.fp8.convert import default_fp8_filter\n"
        "        import matplotlib\n"
    )
    assert deferred_mixprec_imports(module) == ["4: mixprec.fp8.convert"]
