"""Module paths from before the core/ and parallel/ layout do not import: a name lives where it
belongs and callers import it from there (nothing is released, so no old path is kept alive)."""

from __future__ import annotations

import importlib

import pytest

import mixprec

OLD_PATHS = (
    "policy",
    "validate",
    "scaling",
    "grad_scaler",
    "casting",
    "module",
    "optim",
    "optim_state",
    "fused_step",
    "compiled_step",
    "checkpoint",
    "skip_monitor",
    "lean",
    "step_math",
    "data",
    "pipeline",
    "pipeline_optim",
    "pipeline_split",
    "pipeline_checkpoint",
    "apex.multi_loss",
    "debugging.hardware",
)


@pytest.mark.parametrize("old", OLD_PATHS)
def test_an_old_module_path_does_not_import(old: str) -> None:
    with pytest.raises(ModuleNotFoundError, match=f"mixprec.{old}"):
        importlib.import_module(f"mixprec.{old}")


def test_autocast_is_the_class_not_a_module_path() -> None:
    """mixprec.autocast is the public context manager; its module is mixprec.core.autocast."""
    from mixprec.core.autocast import autocast

    assert mixprec.autocast is autocast
    with pytest.raises(ModuleNotFoundError, match="mixprec.autocast"):
        importlib.import_module("mixprec.autocast")


def test_the_real_paths_import() -> None:
    from mixprec.amp_type import AMP_TYPE
    from mixprec.core.policy import Policy
    from mixprec.parallel.zero import ZeroOptimizer

    assert mixprec.AMP_TYPE is AMP_TYPE and mixprec.Policy is Policy
    assert ZeroOptimizer.__module__ == "mixprec.parallel.zero"
