"""Shared fixtures: the device option, deterministic seeds, a tiny model factory, a host-sync counter.

`--device cpu` (the default) and `--device cuda` (repeatable) choose the devices the numerics
tests run on. A test opts in by taking the `device` fixture (or a module's
`pytestmark = pytest.mark.usefixtures("device")`): it is then collected once per requested
device, its CUDA variant marked `cuda`, and while it runs torch's default device is that device,
so every tensor and module it builds without naming a device lands there. With the default
`--device cpu` nothing is parametrized and test ids stay as they were.
The CUDA suite: `python -m pytest --device cuda -m cuda` (its tests skip without a GPU).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub from a test

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n N: N workers share the cores. Each takes its share of intra-op threads (torch
    # would take every core in each worker and they would oversubscribe), and the processes a
    # test launches (gloo ranks, CLI runs) inherit that share through OMP_NUM_THREADS.
    _share = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


DEVICES = ("cpu", "cuda")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        action="append",
        choices=DEVICES,
        dest="devices",
        help="run the device-generic tests on this device (repeatable; default: cpu)",
    )


def requested_devices(config: pytest.Config) -> list[str]:
    return list(dict.fromkeys(config.getoption("devices") or ["cpu"]))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" not in metafunc.fixturenames:
        return
    devices = requested_devices(metafunc.config)
    if any(metafunc.definition.get_closest_marker(m) for m in ("distributed", "host_only")):
        # gloo workers and subprocesses run on the CPU: a CUDA variant would rerun the CPU test
        devices = [d for d in devices if d != "cuda"]
    if devices in ([], ["cpu"]):
        return  # the fixture's default, cpu, and the test ids of a plain run
    metafunc.parametrize(
        "device",
        [pytest.param(d, id=d, marks=[pytest.mark.cuda] if d == "cuda" else []) for d in devices],
        indirect=True,
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (none here)")


@pytest.fixture
def device(request: pytest.FixtureRequest):
    """The device this test variant runs on; torch's default device while it runs."""
    name = getattr(request, "param", "cpu")
    if name == "cpu":
        yield "cpu"
        return
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    previous = torch.get_default_device()
    # The fp32 references are fp32: TF32 (10-bit mantissa, cuDNN's default for convolutions)
    # would put a low-precision error into them that the tests' tolerances do not carry.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_default_device(name)
    try:
        yield name
    finally:
        # back to no default-device mode at all when it was the CPU (the mode costs a call)
        torch.set_default_device(None if previous.type == "cpu" else previous)
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
        torch.backends.cudnn.allow_tf32 = cudnn_tf32


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_paddle_amp_state():
    """Each test starts with no Paddle auto_cast entered: as in Paddle, the last one's dtype is
    process-wide and a bfloat16 one switches later dynamic GradScalers off."""
    yield
    dygraph = sys.modules.get("mixprec.paddle.dygraph")
    if dygraph is not None:
        dygraph.amp_global_state().amp_dtype = None


@pytest.fixture
def paddle_static_mode(monkeypatch):
    """Paddle's static-graph mode around one test, in a fresh Program pair, compiling with
    dynamo's eager backend (the traced ops are the eager ops; no inductor build per test) and
    with the executor's once-per-process notes said again."""
    from mixprec.paddle import static
    from mixprec.paddle.static import executor

    monkeypatch.setitem(executor.COMPILE_OPTIONS, "backend", "eager")
    monkeypatch.setattr(executor, "_SAID_EAGER", set())
    static.enable_static()
    with static.program_guard(static.Program(), static.Program()):
        yield
    static.disable_static()


def tiny_mlp(width: int = 8, norm: bool = True) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Linear(width, 2 * width)]
    if norm:
        layers.append(torch.nn.LayerNorm(2 * width))
    layers += [torch.nn.ReLU(), torch.nn.Linear(2 * width, 4)]
    return torch.nn.Sequential(*layers)


class CountHostSyncs:
    """Counts Tensor.item / __bool__ / tolist / __float__ / __int__ calls while active."""

    NAMES = ("item", "__bool__", "tolist", "__float__", "__int__")

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, _name=name, **k):
                self.calls.append(_name)
                return _original(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


class CountingBackend:
    """A torch.compile backend that runs dynamo's graph as is and counts the graphs it is
    handed (compiles + recompiles)."""

    def __init__(self) -> None:
        self.compiles = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.compiles += 1
        return gm.forward
