"""Module casting keeps norm layers fp32; input casting reaches into every container."""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import pytest
import torch
from torch import nn

from mixprec.core.casting import NORM_TYPES, cast_call_args, cast_floating, cast_module

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.ln = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        h = self.gn(self.bn(self.conv(x))).mean((2, 3))
        return self.fc(self.ln(h))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norms_stay_fp32_and_compute_in_fp32(dtype) -> None:
    net = cast_module(Net(), dtype)
    assert net.conv.weight.dtype == net.fc.weight.dtype == dtype
    for norm in (net.bn, net.gn, net.ln):
        assert all(
            t.dtype == torch.float32
            for t in [*norm.parameters(), *norm.buffers()]
            if t.is_floating_point()
        )
    assert net.bn.num_batches_tracked.dtype == torch.int64  # integer buffers untouched
    out = net(torch.randn(2, 3, 6, 6, dtype=dtype))
    assert out.dtype == dtype
    out.float().sum().backward()
    assert net.ln.weight.grad.dtype == torch.float32 and net.fc.weight.grad.dtype == dtype
    # The LayerNorm computes in fp32 and rounds its output once: layer_norm of the up-cast
    # input, cast back, to within one rounding (CPU's mixed-dtype kernel sums in another order).
    h = torch.randn(64, 4, dtype=dtype)
    expected = torch.nn.functional.layer_norm(h.float(), (4,), net.ln.weight, net.ln.bias).to(dtype)
    torch.testing.assert_close(net.ln(h), expected, rtol=torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kept_norms_on_cpu_save_the_lp_input_not_an_fp32_copy(dtype) -> None:
    net = cast_module(Net(), dtype)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        net(torch.randn(2, 3, 6, 6, dtype=dtype)).float().sum().backward()
    activations = {(2, 4, 4, 4), (2, 4)}  # the norms' inputs: after the conv, after the mean
    lp_shapes = {tuple(t.shape) for t in saved if t.dtype == dtype}
    fp32_shapes = {tuple(t.shape) for t in saved if t.dtype == torch.float32}
    assert activations <= lp_shapes
    assert not activations & fp32_shapes, fp32_shapes  # fp32: params and statistics only


def test_keep_norm_fp32_false_casts_everything() -> None:
    net = cast_module(Net(), torch.bfloat16, keep_norm_fp32=False)
    assert net.ln.weight.dtype == torch.bfloat16 and net.bn.running_mean.dtype == torch.bfloat16


def test_keep_fp32_predicate_and_idempotent_hooks() -> None:
    net = cast_module(Net(), torch.bfloat16, keep_fp32=lambda name, m: name == "fc")
    assert net.fc.weight.dtype == torch.float32
    cast_module(net, torch.bfloat16, keep_fp32=lambda name, m: name == "fc")
    assert len(net.fc._forward_pre_hooks) == 1  # casting twice does not stack hooks
    assert net(torch.randn(1, 3, 5, 5, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_norm_types_cover_the_usual_layers() -> None:
    for layer in (
        nn.BatchNorm1d(2),
        nn.InstanceNorm2d(2),
        nn.LayerNorm(2),
        nn.GroupNorm(1, 2),
        nn.SyncBatchNorm(2),
    ):
        assert isinstance(layer, NORM_TYPES)


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    mask: torch.Tensor
    name: str


Pair = namedtuple("Pair", "a b")


def test_cast_floating_is_recursive_and_leaves_non_floats() -> None:
    obj = {
        "t": (torch.ones(2), [torch.ones(1, dtype=torch.float64)]),
        "b": Batch(torch.ones(2), torch.ones(2, dtype=torch.bool), "n"),
        "p": Pair(torch.ones(1), torch.arange(3)),
        "s": "text",
    }
    out = cast_floating(obj, torch.bfloat16)
    assert out["t"][0].dtype == out["t"][1][0].dtype == torch.bfloat16
    assert isinstance(out["t"], tuple) and isinstance(out["t"][1], list)
    assert (
        out["b"].x.dtype == torch.bfloat16
        and out["b"].mask.dtype == torch.bool
        and out["b"].name == "n"
    )
    assert (
        isinstance(out["p"], Pair)
        and out["p"].a.dtype == torch.bfloat16
        and out["p"].b.dtype == torch.int64
    )
    assert out["s"] == "text"
    same = torch.ones(1, dtype=torch.bfloat16)
    assert cast_floating(same, torch.bfloat16) is same  # no copy when already right


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((torch.ones(2), torch.arange(3), torch.ones(1, dtype=torch.bfloat16)), {}),  # fast path
        ((nn.Parameter(torch.ones(2)), torch.ones(2)), {}),  # a Tensor subclass: the generic walk
        ((torch.ones(2),), {"target": torch.ones(2, dtype=torch.float64)}),
        ((Pair(torch.ones(1), torch.arange(2)), "text"), {}),
    ],
)
def test_cast_call_args_equals_cast_floating(args: tuple, kwargs: dict) -> None:
    got_args, got_kwargs = cast_call_args(args, kwargs, torch.float32)
    want_args, want_kwargs = cast_floating((args, kwargs), torch.float32)
    assert type(got_args) is tuple and got_kwargs.keys() == want_kwargs.keys()
    got_all, want_all = [*got_args, *got_kwargs.values()], [*want_args, *want_kwargs.values()]
    for got, want in zip(got_all, want_all, strict=True):
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and torch.equal(got, want)
        else:
            assert got == want
    fp32 = args[0] if type(args[0]) is torch.Tensor else None
    if fp32 is not None and fp32.dtype == torch.float32:
        assert got_args[0] is fp32  # no copy when already right


def test_modules_marked_fp32_stay_fp32() -> None:
    from mixprec import fp32

    net = Net()
    fp32(net.fc)
    cast_module(net, torch.float16)
    assert net.fc.weight.dtype == torch.float32 and net.conv.weight.dtype == torch.float16
    assert net(torch.randn(1, 3, 5, 5, dtype=torch.float16)).dtype == torch.float16
