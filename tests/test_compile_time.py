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


# ----- each CPU kernel's build submitted as inductor defines it (inductor_warmup.early_builds) -----
_BODY = (
    "async_compile.cpp_pybinding(['float*'], r'''\n"
    "#include <torch/csrc/inductor/cpp_prefix.h>\n"
    'extern "C" void kernel(float* out_ptr0)\n'
    "{\n"
    "    out_ptr0[0] = 7.0f;\n"
    "}\n"
    "''')"
)


def test_early_builds_patch_inductors_wrapper_only_inside_and_once():
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    own = PythonWrapperCodegen.__dict__["define_kernel"]
    with inductor_warmup.early_builds():
        patched = PythonWrapperCodegen.__dict__["define_kernel"]
        assert patched is not own and patched.mixprec_early
        with inductor_warmup.early_builds():  # nested (or another thread's): no second layer
            assert PythonWrapperCodegen.__dict__["define_kernel"] is patched
        assert PythonWrapperCodegen.__dict__["define_kernel"] is patched
    assert PythonWrapperCodegen.__dict__["define_kernel"] is own


def test_an_early_build_is_the_one_loading_the_module_finds():
    """build_now makes the module's own call on the same arguments: the module's call then
    finds the build under its key (no second build) and the kernel runs."""
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    body = _BODY.replace("7.0f", f"{threading.get_ident() % 1000}.0f")  # a source of this run
    before = len(CppPythonBindingsCodeCache.cache)
    assert inductor_warmup.build_now(body)
    assert len(CppPythonBindingsCodeCache.cache) == before + 1
    kernel = eval(body, {"async_compile": AsyncCompile()})  # what loading the module runs
    assert len(CppPythonBindingsCodeCache.cache) == before + 1  # found, not built again
    out = torch.zeros(1)
    kernel.result()(out)
    assert out.item() == threading.get_ident() % 1000
    assert not inductor_warmup.build_now("async_compile.triton('k', '''...''')")


def test_a_failed_early_build_leaves_the_definition_and_logs(monkeypatch, caplog):
    def broken(body):
        raise SyntaxError("not inductor's call")

    monkeypatch.setattr(inductor_warmup, "build_now", broken)
    define = inductor_warmup._building(lambda self, name, body, **kw: ("defined", name, kw))
    with caplog.at_level(logging.DEBUG, logger="mixprec"):
        assert define(None, "cpp_fused_0", _BODY, gpu=False) == (
            "defined",
            "cpp_fused_0",
            {"gpu": False},
        )
    assert "cpp_fused_0's build did not start early" in caplog.text


def test_the_first_call_builds_its_kernels_as_they_are_defined(monkeypatch):
    """A step compiled with inductor's Python wrapper: its first call submits every kernel's
    build from the definition, and loading the module adds no build of its own; later calls
    patch nothing."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    built = []
    real = inductor_warmup.build_now
    monkeypatch.setattr(inductor_warmup, "build_now", lambda body: built.append(real(body)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = {"cpp_wrapper": False, "fx_graph_cache": False}
    step = compile_step(model, opt, nn.MSELoss(), options=options)
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    before = len(CppPythonBindingsCodeCache.cache)
    step(x, y)
    assert step.compiled and built and all(built)
    assert len(CppPythonBindingsCodeCache.cache) - before <= len(built)  # the module built none
    count = len(built)
    step(x, y)
    assert len(built) == count
