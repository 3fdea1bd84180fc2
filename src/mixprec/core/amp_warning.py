"""Say once, when AMP is switched on, that this device cannot make that dtype fast (seed 002 1.2).

Paddle warns "AMP only support NVIDIA GPU with Compute Capability 7.0 or higher" when AMP is
turned on; mixprec's faces (convert_to_amp, initialize, the Booster, Apex's amp.initialize)
say the same through `warn_if_amp_cannot_help`, from what `mixprec doctor` knows: fp16 on a
CPU without fp16 kernels, bf16 where the device has no bf16 math, a CUDA capability below the
dtype's tensor cores. Once per (device, dtype) per process; the training still runs.
"""

from __future__ import annotations

import functools
import warnings

import torch

from mixprec.core.hardware import Finding, cpu_findings, cuda_findings, read_cpu_flags
from mixprec.core.policy import Policy


class AmpHardwareWarning(UserWarning):
    """AMP was switched on for a dtype this device runs slowly (or emulates)."""


_warned: set[tuple[str, str]] = set()


@functools.cache
def _cpu_findings() -> tuple[Finding, ...]:
    mkldnn_bf16 = None
    if torch.backends.mkldnn.is_available():
        mkldnn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return tuple(cpu_findings(read_cpu_flags(), mkldnn_bf16=mkldnn_bf16))


def _findings(device: torch.device) -> list[Finding]:
    if device.type == "cuda" and torch.version.hip is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        return cuda_findings(name, torch.cuda.get_device_capability(index), device=str(device))
    if device.type == "cpu":
        return list(_cpu_findings())
    return []  # other devices (mps, xpu, ROCm): no knowledge to warn from


def policy_dtypes(policy: Policy) -> list[str]:
    """The low-precision dtypes a policy computes in, by the hardware report's names."""
    names = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
    dtypes = [names[policy.low_dtype]] if policy.low_dtype in names else []
    return dtypes + (["float8"] if policy.fp8 else [])


def amp_hardware_warnings(
    policy: Policy | torch.dtype, device: torch.device, findings: list[Finding] | None = None
) -> list[str]:
    """The 'warn' findings for the dtypes policy (or one low dtype) uses on device.

    findings: the hardware findings to read (default: this machine's; tests pass their own).
    """
    findings = _findings(device) if findings is None else findings
    if isinstance(policy, torch.dtype):
        wanted = {torch.float16: ["float16"], torch.bfloat16: ["bfloat16"]}.get(policy, [])
    else:
        wanted = policy_dtypes(policy)
    messages: dict[str, str] = {}
    for finding in findings:
        if finding.level == "warn" and finding.dtype in wanted:
            messages.setdefault(finding.dtype, finding.message)  # the first says it best
    return [messages[d] for d in wanted if d in messages]


def warn_if_amp_cannot_help(
    policy: Policy | torch.dtype, device: torch.device | str, face: str
) -> None:
    """Warn once per (device, dtype) that AMP in `policy` (or a low dtype) cannot be fast there.

    face: who switched AMP on, for the message ('amp.initialize', "mode 'fp16'", ...).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())  # one key per real device
    for message in amp_hardware_warnings(policy, device):
        key = (str(device), message)
        if key in _warned:
            continue
        _warned.add(key)
        warnings.warn(f"{face}: {message} (see `mixprec doctor`)", AmpHardwareWarning, stacklevel=3)


__all__ = ["AmpHardwareWarning", "amp_hardware_warnings", "warn_if_amp_cannot_help"]
