"""Every tensor the compiled step creates lives on the parameters' device (issue 27).

No GPU is needed: the step runs on meta-device parameters (shapes and devices, no data) under
a dispatch mode that records the device of every tensor each op returns. A CPU tensor among
them is a host tensor the step builds or copies per step: on CUDA it mixes devices in one op
(torch.cat refuses) or costs a host<->device copy, so it must not exist.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mixprec.core.compiled_step import compile_step


class RecordDevices(TorchDispatchMode):
    """(op, device type) of every tensor an op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.created.append((str(func), t.device.type))
        return out


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_compiled_step_update_creates_tensors_on_the_params_device(name: str) -> None:
    model = nn.Sequential(
        nn.Linear(4, 8, device="meta"),
        nn.LayerNorm(8, device="meta"),
        nn.Linear(8, 2, device="meta"),
    )
    opt = OPTIMIZERS[name](model.parameters())
    step = compile_step(model, opt, nn.MSELoss(), compile=False, max_norm=1.0)
    assert step.joins and not step.solo  # the joined update (core.compiled_join) is the one run
    # meta has no autocast; the step's fp32 region (autocast off) is entered on the CPU's
    step.device_type = "cpu"
    x, y = torch.randn(3, 4, device="meta"), torch.randn(3, 2, device="meta")
    recorder = RecordDevices()
    with recorder:
        step(x, y)
        step(x, y)  # a second step: state that exists already, hyperparameters read again
    elsewhere = sorted({(op, dev) for op, dev in recorder.created if dev != "meta"})
    assert recorder.created and not elsewhere, (
        f"ops that made tensors off the params' device: {elsewhere}"
    )
