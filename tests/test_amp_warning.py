"""The face that switches AMP on says once where the device cannot make it fast (seed 002 1.2)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tiny_mlp

from mixprec.amp import AMP_TYPE, convert_to_amp
from mixprec.apex import amp
from mixprec.core import amp_warning
from mixprec.core.amp_warning import AmpHardwareWarning, amp_hardware_warnings
from mixprec.core.hardware import cpu_findings, cuda_findings
from mixprec.core.policy import preset

K40 = cuda_findings("Tesla K40m", (3, 5))
V100 = cuda_findings("Tesla V100", (7, 0))
BARE_CPU = cpu_findings([])  # no bf16/fp16 instruction flags at all


def test_which_modes_warn_where() -> None:
    cpu = torch.device("cpu")
    (fp16_k40,) = amp_hardware_warnings(preset("fp16"), cpu, K40)
    assert fp16_k40 == (  # Paddle's words, which its users search for
        "AMP only support NVIDIA GPU with Compute Capability 7.0 or higher, current GPU is: "
        "Tesla K40m, with Compute Capability: 3.5."
    )
    assert amp_hardware_warnings(preset("fp16"), cpu, V100) == []
    (bf16_v100,) = amp_hardware_warnings(preset("bf16"), cpu, V100)
    assert "bfloat16 AMP needs an NVIDIA GPU with Compute Capability 8.0" in bf16_v100
    bf16_v100_fp8 = amp_hardware_warnings(preset("fp8"), cpu, V100)
    assert [m.split()[0] for m in bf16_v100_fp8] == ["bfloat16", "float8"]
    (fp16_cpu,) = amp_hardware_warnings(preset("fp16_naive"), cpu, BARE_CPU)
    assert fp16_cpu.startswith("fp16 on this CPU is slow")
    (bf16_cpu,) = amp_hardware_warnings(preset("bf16"), cpu, BARE_CPU)
    assert bf16_cpu.startswith("No native bf16 instructions")
    assert amp_hardware_warnings(preset("fp32"), cpu, BARE_CPU) == []


@pytest.fixture
def slow_fp16_device(monkeypatch):
    monkeypatch.setattr(amp_warning, "_findings", lambda device: K40)
    monkeypatch.setattr(amp_warning, "_warned", set())


def test_faces_warn_once_per_device_and_dtype(slow_fp16_device) -> None:
    with pytest.warns(AmpHardwareWarning, match=r"mixed precision 'fp16': AMP only support"):
        model = tiny_mlp()
        convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1), None, AMP_TYPE.TORCH)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpHardwareWarning)  # said once: not again
        model = tiny_mlp()
        convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1), None, "fp16")
        model = tiny_mlp()
        amp.initialize(model, opt_level="O2", verbosity=0)  # same device, same dtype


def test_apex_initialize_warns(slow_fp16_device) -> None:
    with pytest.warns(AmpHardwareWarning, match=r"amp.initialize: AMP only support"):
        amp.initialize(tiny_mlp(), opt_level="O1", verbosity=0)


def test_autocast_and_paddles_auto_cast_warn_once(slow_fp16_device) -> None:
    import mixprec
    from mixprec import paddle

    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpHardwareWarning)
        paddle.auto_cast(enable=False)  # AMP off: nothing to say
        mixprec.autocast(dtype=torch.float16, enabled=False)
    with pytest.warns(AmpHardwareWarning, match=r"auto_cast: AMP only support NVIDIA GPU"):
        paddle.auto_cast(level="O1", device_type="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpHardwareWarning)
        with mixprec.autocast(dtype=torch.float16, device_type="cpu"):
            pass
