"""What compile_step starts ahead of inductor's own order on CPU: its C++ set-up, and the builds.

Set-up. Before inductor's CPU code generation writes its first kernel it picks the vector ISA
(torch._inductor.cpu_vec_isa.pick_vec_isa: a g++ build and a dlopen probe per candidate ISA,
about 9 s with a cold inductor cache and 1.3 s with a warm one, 2-core Xeon), and the first
kernel it loads runs the preprocessor over the header every kernel includes and, once per
machine and torch build, precompiles it (about 5 s). Both run synchronously on the compiling
thread, after dynamo has traced the step and inductor has lowered and scheduled it, and neither
depends on the graph: torch.compile(model) pays them in line. compile_step starts them on a
daemon thread when it is built for inductor on CPU (start(), once per process), so they run in
their g++ and probe subprocesses while this thread traces. The compile then finds them done:
the ISA in pick_vec_isa's caches, the header's path in _precompile_header's, the libraries on
disk. Neither cache locks: a compile that gets there first runs the same work itself, and a
build the thread has started holds its file lock, so the compile waits for that build instead
of repeating it.

Builds. Inductor writes each CPU kernel into the graph's Python module as a call,
`async_compile.cpp_pybinding(argtypes, source)`, and only loading that module, after all code
generation, submits the kernels' g++ builds to its compile threads: code generation keeps one
core busy while the builds wait. During the compile of compile_step's first call, early_builds()
makes each kernel's definition submit its build there and then, with the same call on the same
arguments; loading the module finds each build under its key (CppPythonBindingsCodeCache's
cache) and waits for it instead of starting it: the same builds, run beside code generation
(benchmarks/results/compile_cpu.md, the runs with the ISA probes cached).

Nothing here changes what is built or run. A torch without these functions, or a failure,
leaves inductor to do the work in its own order (logged at debug level).
"""

from __future__ import annotations

import ast
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("mixprec")

_KERNEL = '#include <torch/csrc/inductor/cpp_prefix.h>\nextern "C" void kernel(float* out) {}\n'
"""A kernel source as inductor writes them (its prefix header first): loading it makes the
header's precompiled form; the kernel itself is never built."""
_PYBINDING = "async_compile.cpp_pybinding"
"""How inductor's Python wrapper defines a CPU kernel: this call on (argtypes, source)."""
_started: threading.Thread | None = None


def applies(device_type: str, compile_options: dict[str, Any]) -> bool:
    """Whether compile_options compile for inductor (the default backend) on CPU."""
    return device_type == "cpu" and compile_options.get("backend", "inductor") == "inductor"


def setup() -> None:
    """Pick the vector ISA and precompile the kernels' header, as inductor's first CPU kernel
    would (raises what they raise)."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    cpu_vec_isa.pick_vec_isa()
    # load_async precompiles the header before it hands back the (never called) loader
    CppPythonBindingsCodeCache.load_pybinding_async(["float*"], _KERNEL)


def _warm() -> None:
    try:
        setup()
    except Exception as exc:  # a torch without them: inductor does it in line
        log.debug("mixprec: inductor's C++ set-up did not run ahead (%r)", exc)


def start(device_type: str, compile_options: dict[str, Any]) -> threading.Thread | None:
    """Start the set-up (see the module docstring) when `applies`, once per process; returns
    the thread (None: not started now)."""
    global _started
    if not applies(device_type, compile_options) or _started is not None:
        return None
    _started = threading.Thread(target=_warm, name="mixprec-inductor-warmup", daemon=True)
    _started.start()
    return _started


def build_now(kernel_body: str) -> bool:
    """Submit the build of the CPU kernel that kernel_body (inductor's `_PYBINDING(...)` text)
    defines, as loading the graph's module would; False when kernel_body is not one."""
    if not kernel_body.startswith(_PYBINDING):
        return False
    from torch._inductor.async_compile import AsyncCompile

    argtypes, source = ast.literal_eval(kernel_body[len(_PYBINDING) :])
    AsyncCompile().cpp_pybinding(argtypes, source)
    return True


def _building(define_kernel: Callable[..., Any]) -> Callable[..., Any]:
    def define_and_build(self: Any, kernel_name: str, kernel_body: Any, *args, **kwargs) -> Any:
        out = define_kernel(self, kernel_name, kernel_body, *args, **kwargs)
        if isinstance(kernel_body, str):
            try:
                build_now(kernel_body)
            except Exception as exc:  # loading the module builds it, as without us
                log.debug("mixprec: %s's build did not start early (%r)", kernel_name, exc)
        return out

    define_and_build.mixprec_early = True  # type: ignore[attr-defined]
    return define_and_build


@contextlib.contextmanager
def early_builds() -> Iterator[None]:
    """While the block runs (a call that compiles), inductor's Python wrapper submits each CPU
    kernel's build when it defines the kernel (see the module docstring). Nested or
    concurrent uses patch once; the wrapper's own method is back afterwards."""
    try:
        from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    except ImportError:
        yield
        return
    own = PythonWrapperCodegen.__dict__.get("define_kernel")
    if own is None or getattr(own, "mixprec_early", False):
        yield
        return
    PythonWrapperCodegen.define_kernel = _building(own)
    try:
        yield
    finally:
        PythonWrapperCodegen.define_kernel = own
