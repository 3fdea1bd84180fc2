"""Which ranks share a tensorwise amax (Float8Config.amax_group), 2 gloo ranks against one process.

Data parallel: each rank runs its half of the batch; its loss is its half's share of the
full batch's mean (a sum over its rows divided by the full row count) and the gradients are
summed over the ranks, so every rank's GEMM operands are rows of the one-process run's. With
amax_group set to the data-parallel group every tensorwise amax (dynamic: each cast's;
delayed: each recorded entry) is the max over both halves: the one-process run's amax. So
the scales are equal on both ranks and equal the one-process run's bit for bit, as long as
the operands are (checked in the first step, where the weights are the same bytes). Without
it (the default) each rank scales its half by its own amax: rank scales differ where the
one-process run has one.

Tensor parallel (torch's ColwiseParallel / RowwiseParallel, DTensor): the amax of a sharded
operand is that of the whole tensor (DTensor reduces it), so ranks share one scale with the
default amax_group; the input and weight scales equal the one-process run's bit for bit and
the gradient scales within a few fp32 ulps (the gradient is the output of an upstream GEMM
that TP sums in another order, see test_tensor_parallel).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from mixprec.fp8 import Float8Config, Float8Linear, convert_to_fp8
from mixprec.fp8 import linear as fp8_linear

WORLD, ROWS, STEPS, LR = 2, 8, 3, 0.05  # rows per rank; dims multiples of 16 (GEMM alignment)
SCALINGS = {
    "dynamic": {},
    "delayed": {"scaling": "delayed", "amax_history_len": 4},
}


def make_model(**config: Any) -> nn.Module:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    return convert_to_fp8(mlp, config=Float8Config(**config))


def batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world * ROWS, 32, generator=g)
    x[3, 5] = 40.0  # rank 0's rows hold the input amax: rank 1's own amax is far smaller
    x[ROWS + 2] *= 1e-2
    return x, torch.randn(world * ROWS, 32, generator=g)


class ScaleLog:
    """Every inverse scale Float8Linear's tensorwise casts return, in call order."""

    def __init__(self) -> None:
        self.scales: list[torch.Tensor] = []
        self._real = fp8_linear.cast_to_fp8

    def __enter__(self) -> ScaleLog:
        def spy(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            lp, inv = self._real(*args, **kwargs)
            full = inv.full_tensor() if hasattr(inv, "full_tensor") else inv
            self.scales.append(full.detach().clone().reshape(()))
            return lp, inv

        fp8_linear.cast_to_fp8 = spy
        return self

    def __exit__(self, *exc: Any) -> None:
        fp8_linear.cast_to_fp8 = self._real


def step_share(model: nn.Module, x: torch.Tensor, y: torch.Tensor, full_rows: int) -> None:
    """Forward and backward of these rows' share of the full batch's mean squared error."""
    out = model(x)
    (nn.functional.mse_loss(out, y, reduction="sum") / (full_rows * y.shape[1])).backward()


def sgd(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
            p.grad = None


def reference_run(config: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> tuple:
    """The one-process run over the full batch: its per-step scales and final weights."""
    ref = make_model(**config)
    steps = []
    for _ in range(STEPS):
        with ScaleLog() as log:
            step_share(ref, x, y, x.shape[0])
        steps.append(log.scales)
        sgd(ref)
    return steps, [p.detach().clone() for p in ref.parameters()]


def dp_run(rank: int, world: int, config: dict[str, Any], x, y) -> tuple:
    import torch.distributed as dist

    model = make_model(**config)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    steps = []
    for _ in range(STEPS):
        with ScaleLog() as log:
            step_share(model, x[rows], y[rows], x.shape[0])
        steps.append(log.scales)
        for p in model.parameters():  # data parallel: the gradient of the full batch's loss
            dist.all_reduce(p.grad)
        sgd(model)
    return steps, [p.detach().clone() for p in model.parameters()]


def gathered(scales: list[torch.Tensor]) -> list[torch.Tensor]:
    import torch.distributed as dist

    flat = torch.stack(scales)
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


def _data_parallel(rank: int, world: int, group_of: str) -> None:
    import torch.distributed as dist

    x, y = batch(world)
    for scaling, base in SCALINGS.items():
        group = {"default": None, "world": "world", "group": dist.new_group(list(range(world)))}
        config = dict(base)
        if group[group_of] is not None:
            config["amax_group"] = group[group_of]
        ref_steps, ref_weights = reference_run(base, x, y)
        steps, weights = dp_run(rank, world, config, x, y)
        # Forward then backward per layer: input, weight (x2 layers), grad (x2 layers).
        assert len(steps[0]) == len(ref_steps[0]) == 6
        mine, other = gathered(steps[0])[rank], gathered(steps[0])[1 - rank]
        ref = torch.stack(ref_steps[0])
        if group_of == "default":
            # Each rank scales its own half: rank 0 holds the outlier, rank 1 does not, and
            # the trained weights leave the one-process run's by fp8 quantization error.
            assert not torch.equal(mine, other), f"{scaling}: rank scales equal {mine}"
            gaps = [float((a - b).abs().max()) for a, b in zip(weights, ref_weights, strict=True)]
            assert max(gaps) > 1e-4, gaps
            continue
        torch.testing.assert_close(mine, other, rtol=0, atol=0, msg=f"{scaling}: rank scales")
        torch.testing.assert_close(mine, ref, rtol=0, atol=0, msg=f"{scaling}: vs one process")
        for later, ref_later in zip(steps[1:], ref_steps[1:], strict=True):
            mine_later = torch.stack(later)
            torch.testing.assert_close(
                mine_later, gathered(later)[1 - rank], rtol=0, atol=0, msg=f"{scaling}: ranks"
            )
            # Later steps: the weights differ from the one-process run's by fp32 summation
            # order of the halved gradient GEMM (below), so their amaxes by a few fp32 ulps.
            torch.testing.assert_close(mine_later, torch.stack(ref_later), rtol=1e-5, atol=0)
        # The weight gradient is two half-batch float8 GEMMs summed across ranks instead of one
        # full-batch GEMM: the same exact fp8 products, summed in another fp32 order. After
        # STEPS steps of lr 0.05 that stays within a few fp32 ulps of |w| <= 0.25 (ulp 1.5e-8;
        # measured: 1 ulp; without the amax group: 1e-3, the fp8 error itself).
        for got, want in zip(weights, ref_weights, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-7)
        # Calls that do not train never reduce: one rank alone may evaluate (no collective).
        if rank == 0:
            model = make_model(**config)
            with torch.no_grad():
                model(x)
            model.eval()
            model(x)
        if scaling == "delayed":
            layers = [m for m in make_model(**config).modules() if isinstance(m, Float8Linear)]
            assert layers and all(m.config.amax_group is group[group_of] for m in layers)


@pytest.mark.distributed
def test_data_parallel_ranks_scale_alike_only_with_an_amax_group() -> None:
    from dist_utils import spawn

    spawn(_data_parallel, WORLD, "default")


@pytest.mark.distributed
@pytest.mark.parametrize("group_of", ["world", "group"])
def test_an_amax_group_gives_data_parallel_ranks_the_one_process_scales(group_of: str) -> None:
    from dist_utils import spawn

    spawn(_data_parallel, WORLD, group_of)


def _tensor_parallel(rank: int, world: int, amax_group: str | None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    x, y = batch(world)
    for scaling, config in SCALINGS.items():
        ref_steps, ref_weights = reference_run(config, x, y)
        model = make_model(**config, **({"amax_group": amax_group} if amax_group else {}))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        steps = []
        for _ in range(STEPS):
            with ScaleLog() as log:
                step_share(model, x, y, x.shape[0])  # TP: every rank runs the whole batch
            steps.append(log.scales)
            sgd(model)
        first, ref_first = torch.stack(steps[0]), torch.stack(ref_steps[0])
        torch.testing.assert_close(first, gathered(steps[0])[1 - rank], rtol=0, atol=0)
        # input and weight scales of both layers: bitwise; gradient scales: fp32 rounding.
        torch.testing.assert_close(first[:4], ref_first[:4], rtol=0, atol=0, msg=scaling)
        torch.testing.assert_close(first[4:], ref_first[4:], rtol=1e-6, atol=0, msg=scaling)
        for later, ref_later in zip(steps[1:], ref_steps[1:], strict=True):
            torch.testing.assert_close(
                torch.stack(later), gathered(later)[1 - rank], rtol=0, atol=0, msg=scaling
            )
            torch.testing.assert_close(
                torch.stack(later), torch.stack(ref_later), rtol=1e-5, atol=0
            )
        # RowwiseParallel sums the two ranks' partial products in another order than the
        # one-process GEMM: fp32 rounding (measured 1.2e-7, 8 ulps of |w| <= 0.25).
        for got, want in zip(model.parameters(), ref_weights, strict=True):
            torch.testing.assert_close(got.full_tensor(), want, rtol=0, atol=5e-7, msg=scaling)


@pytest.mark.distributed
def test_tensor_parallel_shards_share_the_one_process_scales_by_default() -> None:
    from dist_utils import spawn

    spawn(_tensor_parallel, WORLD, None)


@pytest.mark.distributed
def test_an_amax_group_over_tensor_parallel_ranks_reduces_dtensor_amaxes_alike() -> None:
    """A group spanning the TP ranks (as DP x TP does) takes the DTensor amaxes through the
    functional all-reduce too: the same scales as the default (a max of equal values)."""
    from dist_utils import spawn

    spawn(_tensor_parallel, WORLD, "world")


def _compiled(rank: int, world: int) -> None:
    x, y = batch(world)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    config = dict(SCALINGS["delayed"], amax_group="world")
    runs = []
    for compiled in (False, True):
        model = make_model(**config)
        run = torch.compile(model, fullgraph=True) if compiled else model  # no graph break
        for _ in range(2):
            step_share(run, x[rows], y[rows], x.shape[0])
            sgd(model)
        runs.append([*model.parameters(), *model.buffers()])
    for got, want in zip(*runs, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_amax_reduction_compiles_in_one_graph_and_equals_eager() -> None:
    """The all-reduce is a functional collective: torch.compile(fullgraph=True) traces it,
    and the compiled steps (weights, delayed histories) equal eager bit for bit."""
    from dist_utils import spawn

    spawn(_compiled, WORLD)


def test_a_deep_copy_shares_the_config() -> None:
    """Float8Config is immutable: deepcopy(model) shares it (a ProcessGroup cannot be copied)."""
    model = make_model()
    assert copy.deepcopy(model)[0].config is model[0].config


def test_amax_group_refuses_what_it_cannot_honour() -> None:
    with pytest.raises(TypeError, match=r"amax_group='dp'.*None.*'world'.*ProcessGroup"):
        Float8Config(amax_group="dp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"recipe='rowwise'.*amax_group='world'.*per row"):
        Float8Config(recipe="rowwise", amax_group="world")
    # 'world' in one process (no process group): nothing to reduce, the plain scales.
    x = torch.randn(16, 32)
    plain, grouped = make_model(), make_model(amax_group="world")
    torch.testing.assert_close(grouped(x), plain(x), rtol=0, atol=0)
