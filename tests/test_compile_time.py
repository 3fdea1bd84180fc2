"""compile_step's compile cost: the C++ wrapper joins only a step of few trained tensors, and
inductor's C++ set-up runs ahead on a thread.

The wrapper is one C++ file for the whole graph, and its build grew much faster than the graph
(benchmarks/results/compile_cpu.md: residual MLP blocks, the build dominates the first step at
8 and 24 blocks). torch.compile is lazy, so these tests read the options without compiling.
"""

from __future__ import annotations

import logging
import threading

import torch
from torch import nn

from mixprec.core import inductor_warmup
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


# ----- inductor's C++ set-up, run ahead on a thread (mixprec.core.inductor_warmup) -----


def test_compile_step_starts_inductors_cpu_setup_once_on_a_thread(monkeypatch):
    ran = []
    monkeypatch.setattr(inductor_warmup, "_started", None)
    monkeypatch.setattr(inductor_warmup, "_warm", lambda: ran.append(threading.current_thread()))
    _step_with(2)
    thread = inductor_warmup._started
    assert thread is not None
    thread.join(timeout=30)
    _step_with(2)  # a second step in the process starts nothing more
    assert inductor_warmup._started is thread
    assert len(ran) == 1 and ran[0] is thread and ran[0] is not threading.main_thread()
    assert thread.daemon  # never holds the process open


def test_the_setup_is_for_inductor_on_cpu_only(monkeypatch):
    monkeypatch.setattr(inductor_warmup, "_started", None)
    monkeypatch.setattr(inductor_warmup, "_warm", lambda: None)
    assert inductor_warmup.start("cuda", {}) is None
    assert inductor_warmup.start("cpu", {"backend": "aot_eager"}) is None
    assert inductor_warmup.start("cpu", {"backend": lambda gm, inputs: gm}) is None
    assert inductor_warmup._started is None
    assert inductor_warmup.start("cpu", {"mode": "max-autotune-no-cudagraphs"}) is not None


def test_the_setup_fills_the_caches_inductors_codegen_reads():
    """The functions exist on this torch and take these arguments (a change in torch would
    otherwise only show as a slower first compile: the thread swallows it), and what they
    leave is what the compile reads: the picked ISA and the header's precompiled path."""
    from torch._inductor import codecache, cpu_vec_isa
    from torch._inductor import config as inductor_config

    inductor_warmup.setup()
    assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 1
    if inductor_config.cpp_cache_precompile_headers:
        assert codecache._precompile_header.cache_info().currsize >= 1


def test_a_failing_setup_is_logged_and_left_to_inductor(monkeypatch, caplog):
    def broken():
        raise AttributeError("no pick_vec_isa in this torch")

    monkeypatch.setattr(inductor_warmup, "setup", broken)
    with caplog.at_level(logging.DEBUG, logger="mixprec"):
        inductor_warmup._warm()  # does not raise
    assert "no pick_vec_isa in this torch" in caplog.text
