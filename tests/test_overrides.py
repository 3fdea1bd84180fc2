"""The subclass contract is explicit: every method, property, classmethod and staticmethod a
class defined anywhere in mixprec overrides (a base's other than object's) is marked @override
(typing_extensions'), so a renamed base method cannot leave a silent orphan. The classes are
found by walking the whole package: a new module or class is held to it unlisted."""

from __future__ import annotations

import enum
import importlib
import inspect
import pkgutil
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch
from torch.autograd.function import FunctionMeta
from typing_extensions import override

import mixprec

ALL_MODULES = [info.name for info in pkgutil.walk_packages(mixprec.__path__, "mixprec.")]

# The constructor-like dunders are exempt: each class has its own signature for them and no base
# can rename them (pyright's reportImplicitOverride and ty's missing-override-decorator exempt the
# same four). Every other dunder overriding a base's is held to the rule (__repr__, __getstate__,
# __torch_function__, __enter__, ...); object's are the language's, never a base's to rename.
CONSTRUCTORS = ("__init__", "__new__", "__init_subclass__", "__post_init__")


def is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


# Names the class-building machinery writes into the dict of each class it builds: no class body
# here writes them, so there is nothing to mark. A value the class's own module defines under one
# of these names is still held to the rule (see written_by_machinery).
MACHINERY: tuple[tuple[Callable[[type], bool], frozenset[str]], ...] = (
    # EnumType: its member-building hooks, on every Enum; and Enum's __repr__, __str__ and
    # __format__, which it copies over a mixed-in type's (str's, on the str enum AMP_TYPE)
    (
        lambda cls: isinstance(cls, enum.EnumMeta),
        frozenset(
            {
                "_generate_next_value_",
                "_new_member_",
                "_member_type_",
                "_value_repr_",
                "__repr__",
                "__str__",
                "__format__",
            }
        ),
    ),
    # autograd's FunctionMeta: the backward node class it generates for each Function
    (lambda cls: isinstance(cls, FunctionMeta), frozenset({"_backward_cls"})),
    # collections.namedtuple (typing.NamedTuple builds through it): its __repr__ and
    # __getnewargs__ over tuple's (QuantizedOperand)
    (is_namedtuple, frozenset({"__repr__", "__getnewargs__"})),
)

# The layers and each face's package: a class in each must show marked overrides.
PACKAGES = (
    "mixprec.core",
    "mixprec.parallel",
    "mixprec.apex",
    "mixprec.paddle",
    "mixprec.booster",
    "mixprec.zero",
    "mixprec.fp8",
    "mixprec.integrations",
)


def defined_classes(module_name: str) -> list[type]:
    """The classes module_name defines (not the ones it imports)."""
    module = importlib.import_module(module_name)
    return [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == module_name]


def unwrap(value: Any) -> Any:
    """The function a class attribute's @override marks: a property's getter, a classmethod's
    or staticmethod's function (typing_extensions' order: @override innermost, next to def)."""
    if isinstance(value, property):
        return value.fget
    if isinstance(value, (classmethod, staticmethod)):
        return value.__func__
    return value


def written_by_machinery(cls: type, name: str, function: Any) -> bool:
    """name is one MACHINERY writes into cls, and its value is not code of cls's own module."""
    code = getattr(function, "__code__", None)
    if code is not None and code.co_filename == inspect.getfile(cls):
        return False
    return any(applies(cls) and name in names for applies, names in MACHINERY)


def overrides(cls: type) -> Iterator[tuple[str, bool]]:
    """(name, marked) for each method (or property) cls defines over a base's."""
    for name, value in vars(cls).items():
        if name in CONSTRUCTORS:
            continue
        function = unwrap(value)
        if not callable(function) or written_by_machinery(cls, name, function):
            continue
        if not any(name in vars(base) for base in cls.__mro__[1:] if base is not object):
            continue
        yield name, bool(getattr(function, "__override__", False))


def unmarked_overrides(cls: type) -> list[str]:
    """The methods (and properties) cls defines over a base's without @override."""
    return [f"{cls.__qualname__}.{name}" for name, marked in overrides(cls) if not marked]


@pytest.mark.parametrize("module_name", ALL_MODULES)
def test_every_override_is_marked(module_name: str) -> None:
    found = [
        f"{module_name}.{u}" for c in defined_classes(module_name) for u in unmarked_overrides(c)
    ]
    assert sorted(found) == []


def test_the_walk_reaches_every_face() -> None:
    """A walk that found no class, or no override, in a face would pass vacuously."""
    classes = {
        f"{c.__module__}.{c.__qualname__}": c for n in ALL_MODULES for c in defined_classes(n)
    }
    for expected in (
        "mixprec.amp.AMPOptimizer",
        "mixprec.apex._optimizer_like.OptimizerLike",
        "mixprec.apex.fp16_utils.FP16_Optimizer",
        "mixprec.core.multi_loss.MultiLossOptimizer",
        "mixprec.core.per_loss_optim.PerLossOptimizer",
        "mixprec.paddle.dygraph.MasterWeightOptimizer",
        "mixprec.paddle.optimizer.LarsMomentumOptimizer",
        "mixprec.parallel.zero.ZeroOptimizer",
        "mixprec.zero.low_level.low_level_optim.LowLevelZeroOptimizer",
        "mixprec.booster.plugin.hybrid_parallel.HybridParallelPlugin",
        "mixprec.fp8.linear.Float8Linear",
        "mixprec.integrations.lightning.MixprecPrecision",
        "mixprec.paddle.grad_scaler.GradScaler",
    ):
        assert expected in classes, expected
    for package in PACKAGES:
        marked = [
            name
            for name, c in classes.items()
            if name.startswith(f"{package}.") and any(m for _, m in overrides(c))
        ]
        assert marked, package
    optimizers = [c for c in classes.values() if issubclass(c, torch.optim.Optimizer)]
    assert len(optimizers) > 10


def test_the_exemptions_are_machinery_only() -> None:
    """The machinery's names are exempt where the machinery wrote them, not where a class body
    did; a classmethod, staticmethod and property are checked through the function they wrap."""

    class Mode(str, enum.Enum):
        A = "a"

    class Written(str, enum.Enum):
        A = "a"

        def __repr__(self) -> str:
            return "A"

    class Pair(NamedTuple):
        a: int
        b: int

    class Base:
        @classmethod
        def make(cls) -> None: ...

        @staticmethod
        def helper() -> None: ...

        @property
        def size(self) -> int:
            return 0

    class Child(Base):
        @classmethod
        def make(cls) -> None: ...

        @staticmethod
        @override
        def helper() -> None: ...

        @property
        def size(self) -> int:
            return 1

    assert unmarked_overrides(Mode) == unmarked_overrides(Pair) == []
    assert [u.rsplit(".", 2)[-2:] for u in unmarked_overrides(Written)] == [["Written", "__repr__"]]
    assert [u.rsplit(".", 1)[-1] for u in unmarked_overrides(Child)] == ["make", "size"]


def test_the_check_sees_an_unmarked_override() -> None:
    class Base:
        def run(self) -> None: ...

        def stop(self) -> None: ...

    class Child(Base):
        def run(self) -> None: ...

        @override
        def stop(self) -> None: ...

        def own(self) -> None: ...

    assert [u.rsplit(".", 2)[-2:] for u in unmarked_overrides(Child)] == [["Child", "run"]]


def test_the_class_switches_are_one_frozen_traits_value_per_class():
    """Subclasses configure the step through one frozen StepTraits (no loose class flags):
    ZeRO, the pipeline and Apex's per-loss optimizer decide on the host; ZeRO and Apex keep
    torch's grads contract their own way; ZeRO and the pipeline refuse the compiled step."""
    import dataclasses

    from mixprec.core.optim import MixedPrecisionOptimizer, StepTraits
    from mixprec.core.per_loss_optim import StashingOptimizer
    from mixprec.parallel.pipeline.optim import PipelineOptimizer
    from mixprec.parallel.zero import ZeroOptimizer

    base = MixedPrecisionOptimizer.traits
    assert base == StepTraits() and base.carries_grads and base.steps_on_device
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.carries_grads = False
    for cls in (ZeroOptimizer, PipelineOptimizer, StashingOptimizer):
        assert not cls.traits.steps_on_device, cls
        for name in ("whole_step_refusal", "carries_grads", "steps_on_device"):
            assert name not in vars(cls), f"{cls.__name__}.{name}: set it in traits"
    assert ZeroOptimizer.traits.whole_step_refusal and PipelineOptimizer.traits.whole_step_refusal
    # ZeRO's owners' shares are carried by the core's carry (GradTransfer.hand / give_back)
    assert ZeroOptimizer.traits.carries_grads and not StashingOptimizer.traits.carries_grads


def test_step_is_final_the_one_sequence_every_optimizer_runs() -> None:
    """No optimizer class (mixins included) redefines step(): a face reads what it needs from
    the counters instead (Colossal's get_grad_norm: steps and last_result)."""
    from mixprec.core.optim import MixedPrecisionOptimizer

    assert getattr(MixedPrecisionOptimizer.step, "__final__", False)
    found = set()
    for name in ALL_MODULES:
        for cls in vars(importlib.import_module(name)).values():
            if isinstance(cls, type) and issubclass(cls, MixedPrecisionOptimizer):
                found.add(cls)
    assert len(found) > 10
    for cls in found:
        owners = [k for k in cls.__mro__ if "step" in vars(k)]
        assert owners[0] is MixedPrecisionOptimizer, f"{cls.__name__}: step() in {owners[0]}"
