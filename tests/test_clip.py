"""mixprec.core.clip: the one clip of every parallelism against torch's clip_grad_norm_.

Reference: torch.nn.utils.clip_grad_norm_ on the whole model's gradients in one process. On one
process the clip is torch's own norm and coefficient (bit for bit); split over ranks (disjoint
parts, as ZeRO's shards and the pipeline's stages hold them) or into DTensor shards (FSDP2,
tensor parallel) the same norm is summed in another order, within FP32_REORDER.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from tolerances import EXACT

from mixprec.core.clip import clip_grads_, total_grad_norm

NORM_TYPES = (2.0, math.inf, 1.0)
MAX_NORM = 0.5  # below the test gradients' norm for every p: every clip scales
# The same fp32 norm summed per rank / shard first, then over ranks: a few ulps of reordering.
FP32_REORDER = {"rtol": 1e-5, "atol": 1e-7}


def _grads() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) for shape in ((6, 4), (4,), (3, 6), (7,))]


def _as_params(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = []
    for grad in grads:
        p = torch.nn.Parameter(torch.zeros_like(grad))
        p.grad = grad.clone()
        params.append(p)
    return params


def _torch_clip(grads: list[torch.Tensor], norm_type: float) -> tuple[torch.Tensor, list]:
    params = _as_params(grads)
    norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type=norm_type)
    return norm, [p.grad for p in params]


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_one_process_is_torchs_clip_bit_for_bit(norm_type: float) -> None:
    ref_norm, ref_grads = _torch_clip(_grads(), norm_type)
    grads = _grads()
    norm = clip_grads_(grads, MAX_NORM, norm_type)
    assert float(ref_norm) > MAX_NORM  # the clip scaled
    torch.testing.assert_close(norm, ref_norm, **EXACT)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **EXACT)


def test_low_precision_grads_clip_as_torch_does() -> None:
    """The norm is torch's (its bf16 value, reported in fp32); the coefficient stays fp32 where
    torch rounds it to bf16 first, so a clipped grad may differ by its last bf16 rounding."""
    grads = [g.to(torch.bfloat16) for g in _grads()]
    ref_norm, ref_grads = _torch_clip(grads, 2.0)
    norm = clip_grads_(grads, MAX_NORM)
    assert norm.dtype == torch.float32
    torch.testing.assert_close(norm, ref_norm.float(), **EXACT)  # bf16 -> fp32 is exact
    for got, want in zip(grads, ref_grads, strict=True):
        # one bf16 rounding of the product (2**-8 relative) plus the coefficient's (2**-8)
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_non_finite_gradient_gives_a_non_finite_norm_without_raising(bad: float) -> None:
    """The optimizer skips such a step; the clip must neither raise nor read the norm."""
    grads = _grads()
    grads[1][0] = bad
    norm = clip_grads_(grads, MAX_NORM)
    assert not math.isfinite(float(norm))


def test_no_gradients_give_a_zero_norm_on_the_device_asked() -> None:
    norm = clip_grads_([], MAX_NORM, device=torch.device("cpu"))
    assert norm.dtype == torch.float32 and float(norm) == 0.0


def test_runs_inside_a_compiled_function_without_a_graph_break() -> None:
    """compiled_step's in-graph clip can be this function: no DTensor and no group is plain math.

    backend="eager" traces with dynamo (what fullgraph checks) without generating code."""
    compiled = torch.compile(clip_grads_, backend="eager", fullgraph=True)
    grads = _grads()
    norm = compiled(grads, MAX_NORM)
    ref_norm, ref_grads = _torch_clip(_grads(), 2.0)
    torch.testing.assert_close(norm, ref_norm, **EXACT)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **EXACT)


# ----- 2 gloo ranks: disjoint parts (ZeRO shards, pipeline stages) and DTensor shards -----
def _split_worker(rank: int, world: int) -> None:
    """Each rank holds every other whole tensor plus one half of a split one, as ZeRO's flat
    shards cut a param in two; the clip over the group equals torch's on the whole list."""
    for norm_type in NORM_TYPES:
        ref_norm, ref_grads = _torch_clip(_grads(), norm_type)
        full = _grads()
        whole = [g for i, g in enumerate(full[:3]) if i % world == rank]
        split = full[3].chunk(world)[rank]  # a view: clipped in place inside full[3]
        norm = clip_grads_([*whole, split], MAX_NORM, norm_type, group=dist.group.WORLD)
        torch.testing.assert_close(norm, ref_norm, **FP32_REORDER, msg=f"p={norm_type}")
        # the other ranks' parts: gathered by summing, as each rank clipped only its own
        mine = [torch.zeros_like(g) for g in full]
        for i, g in enumerate(full[:3]):
            if i % world == rank:
                mine[i] = g
        mine[3].chunk(world)[rank].copy_(split)
        for got, want in zip(mine, ref_grads, strict=True):
            dist.all_reduce(got)
            torch.testing.assert_close(got, want, **FP32_REORDER, msg=f"p={norm_type}")
    # a rank with no gradient still joins the reduction (ZeRO: a rank may own no shard)
    grads = _grads() if rank == 0 else []
    norm = total_grad_norm(grads, 2.0, group=dist.group.WORLD, device=torch.device("cpu"))
    torch.testing.assert_close(norm, total_grad_norm(_grads(), 2.0), **FP32_REORDER)


def _dtensor_worker(rank: int, world: int) -> None:
    """DTensor grads (FSDP2's Shard(0), plus a plain replicated one as a pipeline stage with
    tensor parallelism holds them): each mesh completes its own norm, no group is passed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    for norm_type in NORM_TYPES:
        ref_norm, ref_grads = _torch_clip(_grads(), norm_type)
        full = _grads()
        grads = [distribute_tensor(g, mesh, [Shard(0)]) for g in full[:3]] + [full[3]]
        norm = clip_grads_(grads, MAX_NORM, norm_type)
        assert type(norm) is torch.Tensor  # the value every rank sees, not a DTensor
        torch.testing.assert_close(norm, ref_norm, **FP32_REORDER, msg=f"p={norm_type}")
        for got, want in zip(grads, ref_grads, strict=True):
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            torch.testing.assert_close(got, want, **FP32_REORDER, msg=f"p={norm_type}")


def _worker(rank: int, world: int) -> None:
    _split_worker(rank, world)
    _dtensor_worker(rank, world)


def test_over_ranks_and_dtensor_shards_equals_torchs_clip_on_the_whole_model() -> None:
    """One spawn for both cases: starting the processes is most of the time."""
    from dist_utils import spawn

    spawn(_worker, 2)
