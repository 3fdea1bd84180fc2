"""The subclass contract is explicit: every method a class in core/ or parallel/ overrides, and
every method any optimizer class anywhere in mixprec overrides (MixedPrecisionOptimizer's
subclasses in every face, and the other torch.optim.Optimizer subclasses), is marked @override
(typing_extensions'), so a renamed base method cannot leave a silent orphan. The classes are
found by walking the whole package: a new module or class is held to it unlisted."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch
from typing_extensions import override

import mixprec

LAYERS = ("mixprec.core", "mixprec.parallel")
DUNDERS = ("__getstate__", "__setstate__", "__repr__")  # the dunders a class here overrides
ALL_MODULES = [info.name for info in pkgutil.walk_packages(mixprec.__path__, "mixprec.")]


def modules() -> list[str]:
    return [name for name in ALL_MODULES if name.startswith(LAYERS)]


def optimizer_subclasses() -> list[type]:
    """Every torch.optim.Optimizer subclass (MixedPrecisionOptimizer and its subclasses
    included) defined in a mixprec module (the walk imports each module, so a class defined
    anywhere in the package is found)."""
    found = []
    for name in ALL_MODULES:
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and value.__module__ == name
                and issubclass(value, torch.optim.Optimizer)
            ):
                found.append(value)
    return found


def unmarked_overrides(cls: type) -> list[str]:
    """The methods (and properties) cls defines over a base's without @override."""
    found = []
    for name, value in vars(cls).items():
        if name.startswith("__") and name not in DUNDERS:
            continue
        function = value.fget if isinstance(value, property) else value
        if not callable(function):
            continue
        if not any(name in vars(base) for base in cls.__mro__[1:] if base is not object):
            continue
        if not getattr(function, "__override__", False):
            found.append(f"{cls.__qualname__}.{name}")
    return found


@pytest.mark.parametrize("module_name", modules())
def test_every_override_is_marked(module_name: str) -> None:
    module = importlib.import_module(module_name)
    classes = [c for c in vars(module).values() if inspect.isclass(c)]
    found = [u for c in classes if c.__module__ == module_name for u in unmarked_overrides(c)]
    assert found == []


def test_every_optimizer_subclass_marks_its_overrides() -> None:
    """Each face's optimizer classes too (Apex's FP16_Optimizer and LARC adapter, Paddle's
    master-weight and LARS optimizers, Colossal's LowLevelZeroOptimizer and convert_to_amp's)."""
    classes = optimizer_subclasses()
    names = {f"{c.__module__}.{c.__qualname__}" for c in classes}
    # the walk reaches every face (a walk that found none would pass vacuously)
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
    ):
        assert expected in names, expected
    assert [u for c in classes for u in unmarked_overrides(c)] == []


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
