"""compile_step's compile cost: the C++ wrapper joins only a step of few trained tensors.

The wrapper is one C++ file for the whole graph, and its build grew much faster than the graph
(benchmarks/results/compile_cpu.md: residual MLP blocks, the build dominates the first step at
8 and 24 blocks). torch.compile is lazy, so these tests read the options without compiling.
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec.core.compiled_step import (
    CPU_FUSION_OPTIONS,
    CPU_INDUCTOR_OPTIONS,
    CPU_WRAPPER_MAX_TENSORS,
    compile_step,
)


def _step_with(tensors: int):
    """A compile_step (not yet compiled) over a model of `tensors` trained tensors."""
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(tensors)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return compile_step(model, opt, nn.MSELoss())


def test_the_cpp_wrapper_joins_a_small_step():
    step = _step_with(CPU_WRAPPER_MAX_TENSORS)
    assert step.compile_options["options"] == {**CPU_FUSION_OPTIONS, **CPU_INDUCTOR_OPTIONS}


def test_a_step_of_many_tensors_compiles_without_the_cpp_wrapper():
    step = _step_with(CPU_WRAPPER_MAX_TENSORS + 1)
    assert step.compile_options["options"] == CPU_FUSION_OPTIONS  # no wrapper
    assert step.compile_options["fullgraph"] is True


def test_the_callers_options_still_reach_a_large_step():
    model = nn.Sequential(
        *[nn.Linear(4, 4, bias=False) for _ in range(CPU_WRAPPER_MAX_TENSORS + 1)]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = compile_step(model, opt, nn.MSELoss(), options={"cpp_wrapper": True})
    assert step.compile_options["options"] == {**CPU_FUSION_OPTIONS, "cpp_wrapper": True}
