"""The --device option and the device fixture (conftest.py), run in a throwaway pytest."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()
PROBE = """
import pytest
import torch

pytestmark = pytest.mark.usefixtures("device")


def test_builds_on_the_device(device):
    assert torch.get_default_device().type == device
    assert torch.zeros(1).device.type == device


def test_module_mark_is_enough():
    assert torch.ones(1).device.type in ("cpu", "cuda")


@pytest.mark.distributed
def test_gloo_workers_stay_on_cpu(device):
    assert device == "cpu"
"""


@pytest.fixture
def probe(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    cuda: c\n    distributed: d\n")
    pytester.makepyfile(test_probe=PROBE)
    return pytester


def test_default_run_is_cpu_with_the_old_test_ids(probe: pytest.Pytester) -> None:
    result = probe.runpytest("-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*::test_builds_on_the_device PASSED*"])


def test_cuda_variants_are_collected_marked_and_skip_without_a_gpu(
    probe: pytest.Pytester,
) -> None:
    result = probe.runpytest("--device", "cpu", "--device", "cuda", "-p", "no:cacheprovider")
    import torch

    gpu = torch.cuda.is_available()
    # two device tests x two devices, the distributed one on the CPU only
    result.assert_outcomes(passed=5 if gpu else 3, skipped=0 if gpu else 2)
    only_cuda = probe.runpytest(
        "--device", "cuda", "-m", "cuda", "--collect-only", "-q", "-p", "no:cacheprovider"
    )
    only_cuda.stdout.fnmatch_lines(
        ["*test_builds_on_the_device[[]cuda[]]", "*test_module_mark_is_enough[[]cuda[]]"]
    )
    assert "test_gloo_workers_stay_on_cpu" not in only_cuda.stdout.str()
