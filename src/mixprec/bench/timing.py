"""Timing one call on a device: CUDA events on a GPU, a host clock on the CPU."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def time_call(
    fn: Callable[[], object],
    device: torch.device | str,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds fn() takes on device.

    CUDA: two events on the current stream around fn's kernels, read after the second one
    completed (one host sync per call, after the timed work, never inside it); the launch gaps
    the host leaves between kernels count, as they cost a training step too. CPU: `clock`
    around the call (time.process_time on a shared machine, perf_counter for wall time).
    """
    if torch.device(device).type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()  # a host sync: the elapsed time exists once the kernels ran
        return start.elapsed_time(end) / 1e3
    t0 = clock()
    fn()
    return clock() - t0
