"""Module paths from before the core/ and parallel/ layout still import, as the same objects."""

from __future__ import annotations

import importlib

import pytest

import mixprec


@pytest.mark.parametrize("old", sorted(mixprec._MOVED))
def test_an_old_module_path_is_the_module_it_became(old: str) -> None:
    moved = importlib.import_module(f"mixprec.{old}")
    assert moved is importlib.import_module(f"mixprec.{mixprec._MOVED[old]}")


def test_names_import_from_old_paths() -> None:
    from mixprec.policy import Policy as OldPolicy

    from mixprec.core.policy import Policy
    from mixprec.parallel.zero import ZeroOptimizer
    from mixprec.zero import ZeroOptimizer as OldZero

    assert OldPolicy is Policy and OldZero is ZeroOptimizer


def test_an_old_path_that_is_also_a_public_name_keeps_the_name() -> None:
    """mixprec.autocast is the class; its old module path imports without replacing it."""
    from mixprec.autocast import fp32_region  # the old module path

    from mixprec.core.autocast import autocast
    from mixprec.core.autocast import fp32_region as new_fp32_region

    importlib.import_module("mixprec.autocast")
    assert fp32_region is new_fp32_region
    assert mixprec.autocast is autocast


def test_an_unknown_path_still_fails() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mixprec.no_such_module")


def test_names_that_left_the_core_for_a_face_import_from_their_old_paths() -> None:
    """AMP_TYPE and the Colossal key parsers moved from core/policy.py to mixprec/amp_type.py."""
    from mixprec.policy import AMP_TYPE as old_path

    from mixprec.amp_type import AMP_TYPE, naive_amp_policy, torch_amp_policy
    from mixprec.core.policy import AMP_TYPE as core_path
    from mixprec.core.policy import naive_amp_policy as old_naive
    from mixprec.core.policy import torch_amp_policy as old_torch

    assert core_path is old_path is AMP_TYPE is mixprec.AMP_TYPE is mixprec.amp.AMP_TYPE
    assert old_naive is naive_amp_policy and old_torch is torch_amp_policy


def test_names_that_left_core_optim_import_from_it() -> None:
    """MixedPrecisionOptimizer's split (#29): the gradient transfer, the step counter and the
    checkpoint code moved to their own core modules; the names kept their old import path."""
    from mixprec.core import optim
    from mixprec.core.clip import local_shards
    from mixprec.core.grad_transfer import LOW_DTYPES, Carry, Layout
    from mixprec.core.skip_monitor import ScaleCollapseError

    assert optim.ScaleCollapseError is ScaleCollapseError is mixprec.ScaleCollapseError
    assert optim.Layout is Layout and optim._Carry is Carry and optim.LOW_DTYPES is LOW_DTYPES
    assert optim.local_shards is local_shards
