"""Inductor's once-per-process C++ set-up, started on a thread before compile_step compiles.

Before inductor's CPU code generation writes its first kernel it picks the vector ISA
(torch._inductor.cpu_vec_isa.pick_vec_isa: a g++ build and a dlopen probe per candidate ISA,
about 9 s with a cold inductor cache and 1.3 s with a warm one, 2-core Xeon), and the first
kernel it loads runs the preprocessor over the header every kernel includes and, once per
machine and torch build, precompiles it (about 5 s). Both run synchronously on the compiling
thread, after dynamo has traced the step and inductor has lowered and scheduled it, and neither
depends on the graph: torch.compile(model) pays them in line.

compile_step starts them on a daemon thread when it is built for inductor on CPU (start(), once
per process), so they run in their g++ and probe subprocesses while this thread traces. The
compile then finds them done: the ISA in pick_vec_isa's caches, the header's path in
_precompile_header's, the libraries on disk. Neither cache locks: a compile that gets there
first runs the same work itself, and a build the thread has started holds its file lock, so the
compile waits for that build instead of repeating it. The values are the same either way.
Nothing here is needed: a torch without these functions, or a failure, leaves inductor to do
it in line (logged at debug level).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("mixprec")

_KERNEL = '#include <torch/csrc/inductor/cpp_prefix.h>\nextern "C" void kernel(float* out) {}\n'
"""A kernel source as inductor writes them (its prefix header first): loading it makes the
header's precompiled form; the kernel itself is never built."""
_started: threading.Thread | None = None


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
    """Start the set-up (see the module docstring) when compile_options compile for inductor
    (the default backend) on CPU, once per process; returns the thread (None: not started
    now)."""
    global _started
    if device_type != "cpu" or compile_options.get("backend", "inductor") != "inductor":
        return None
    if _started is not None:
        return None
    _started = threading.Thread(target=_warm, name="mixprec-inductor-warmup", daemon=True)
    _started.start()
    return _started
