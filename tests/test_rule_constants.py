"""Each step rule's constant is written once in src/ (issue 29): the clip epsilon in
core/step_math.py, the loss-scale defaults in core/policy.py's ScalerConfig and its presets
(TORCH_SCALER, NAIVE_SCALER, APEX_SCALER), which every face's signature refers to. A copy typed
again elsewhere is how paths drift apart (the clip epsilon was spelled in five modules), so an
AST scan of the source fails on one:

- CLIP_EPS (1e-6 however spelled: 1e-06, 0.000001, 10**-6, 1 / 10**6) as a numeric literal
  anywhere, in a formula too;
- a loss-scale rule value bound as a literal to a setting of its role, under any face's name
  for it: an initial scale of 2**16 or 2**32, the 2**24 ceiling, a growth interval of 2000 or
  1000, the backoff 0.5; bound as a parameter default, a keyword argument, a (dataclass
  field) assignment or a dict entry.
"""

from __future__ import annotations

import ast
import operator
from pathlib import Path

import pytest

import mixprec

SRC = Path(mixprec.__file__).resolve().parent
CLIP_EPS = 1e-6
ROLES = {
    # role: the names mixprec / torch, Colossal-AI, Apex and Paddle give the setting
    "initial scale": {"init_scale", "initial_scale", "init_loss_scaling"},
    "ceiling": {"max_scale", "max_loss_scale"},
    "growth interval": {"growth_interval", "incr_every_n_steps", "scale_window"},
    "backoff": {"backoff_factor", "decr_ratio"},
}
RULES = {
    ("initial scale", 2.0**16): "core/policy.py",  # ScalerConfig's default (torch's)
    ("initial scale", 2.0**32): "core/policy.py",  # NAIVE_SCALER (Megatron's)
    ("ceiling", 2.0**24): "core/policy.py",  # APEX_SCALER
    ("growth interval", 2000): "core/policy.py",  # ScalerConfig's default (torch's)
    ("growth interval", 1000): "core/policy.py",  # NAIVE_SCALER
    ("backoff", 0.5): "core/policy.py",  # ScalerConfig's default
}
_OPS = {ast.Pow: operator.pow, ast.Mult: operator.mul, ast.Div: operator.truediv}


def literal(node: ast.AST) -> float | None:
    """The number a literal expression spells (2.0**16, -1e-6, 10**-6), else None."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = literal(node.operand)
        return None if value is None else (-value if isinstance(node.op, ast.USub) else value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = literal(node.left), literal(node.right)
        if left is not None and right is not None:
            try:
                return _OPS[type(node.op)](left, right)
            except (ZeroDivisionError, OverflowError):
                return None
    return None


def bindings(tree: ast.AST):
    """(setting name, value node) for each value bound to a named setting."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            a = node.args
            positional = a.posonlyargs + a.args
            named = positional[len(positional) - len(a.defaults) :]
            yield from ((arg.arg, d) for arg, d in zip(named, a.defaults, strict=True))
            for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
                if default is not None:
                    yield arg.arg, default
        elif isinstance(node, ast.Call):
            yield from ((kw.arg, kw.value) for kw in node.keywords if kw.arg is not None)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.value is not None:
                yield node.target.id, node.value
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    yield target.id, node.value
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    yield key.value, value


def clip_eps_places(name: str, tree: ast.AST) -> list[str]:
    """Where a numeric literal expression (not part of a larger one) equals CLIP_EPS."""
    literal_ops = [n for n in ast.walk(tree) if isinstance(n, ast.BinOp | ast.UnaryOp)]
    inner = {id(c) for n in literal_ops if literal(n) is not None for c in ast.iter_child_nodes(n)}
    return [
        f"{name}:{node.lineno}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant | ast.BinOp | ast.UnaryOp)
        and id(node) not in inner
        and literal(node) == CLIP_EPS
    ]


def scale_places(name: str, tree: ast.AST) -> dict[tuple[str, float], list[str]]:
    found: dict[tuple[str, float], list[str]] = {}
    for setting, value_node in bindings(tree):
        value = literal(value_node)
        for role, names in ROLES.items():
            if setting in names and (role, value) in RULES:
                found.setdefault((role, value), []).append(f"{name}:{value_node.lineno}")
    return found


def scan(root: Path = SRC) -> tuple[list[str], dict[tuple[str, float], list[str]]]:
    eps: list[str] = []
    scale: dict[tuple[str, float], list[str]] = {rule: [] for rule in RULES}
    for path in sorted(root.rglob("*.py")):
        name = str(path.relative_to(root))
        tree = ast.parse(path.read_text(), filename=name)
        eps += clip_eps_places(name, tree)
        for rule, places in scale_places(name, tree).items():
            scale[rule] += places
    return eps, scale


def test_each_rule_constant_is_defined_once_in_src() -> None:
    eps, scale = scan()
    assert [p.split(":")[0] for p in eps] == ["core/step_math.py"], eps
    for rule, places in scale.items():
        assert len(places) == 1 and places[0].startswith(RULES[rule] + ":"), (rule, places)


@pytest.mark.parametrize(
    "source",
    [
        "def clip(n, total):\n    return n / (total + 1e-6)\n",
        "def clip(n, total):\n    return n / (total + 10**-6)\n",
        "EPS = 0.000001\n",
        "def f(init_scale=2.0**16):\n    pass\n",
        "def f(*, growth_interval: int = 1000):\n    pass\n",
        "cfg = ScalerConfig(max_scale=2**24)\n",
        "KEYS = {'decr_ratio': 0.5}\n",
        "class C:\n    incr_every_n_steps: int = 2000\n",
    ],
)
def test_the_scan_finds_a_retyped_constant(tmp_path, source: str) -> None:
    """The check can fail: each spelling of a copy, written into a module, is found."""
    (tmp_path / "copy.py").write_text(source)
    eps, scale = scan(tmp_path)
    found = eps + [place for places in scale.values() for place in places]
    assert len(found) == 1 and found[0].startswith("copy.py:"), found


def test_unrelated_values_are_not_rules(tmp_path) -> None:
    """A 0.5 dropout, a 1000-step loop or Colossal's 2**32 ceiling are no loss-scale rule."""
    (tmp_path / "other.py").write_text(
        "def f(p=0.5, steps=1000, max_scale=2**32, eps=1e-5):\n    return 2**16\n"
    )
    eps, scale = scan(tmp_path)
    assert eps == [] and not any(scale.values())
