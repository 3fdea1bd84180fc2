"""Cut a model into pipeline stages: balanced by parameter count, or at named split points."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from mixprec.core.policy import did_you_mean


def balanced_boundaries(sizes: Sequence[int], parts: int) -> list[int]:
    """Start index of each of `parts` contiguous runs of `sizes` minimising the largest run's sum.

    Every run gets at least one item. Exact (dynamic programming, O(parts * n^2)): the slowest
    stage sets a pipeline's pace, so the bottleneck sum is what is minimised; ties go to the
    earliest cut, so every rank computes the same split.
    """
    n = len(sizes)
    if not 1 <= parts <= n:
        raise ValueError(f"Cannot cut {n} layers into {parts} stages: need 1 <= stages <= layers.")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: smallest bottleneck for the first i items in k runs; cut[k][i]: last run start.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def split_sequential(
    model: nn.Sequential, num_stages: int, split_points: Sequence[str] | None = None
) -> list[nn.Sequential]:
    """model's children as `num_stages` nn.Sequential stages, keeping the children's names.

    split_points: names of the children where stages 1.. begin (len num_stages - 1), e.g.
    ["3"]; None: balanced by parameter count (balanced_boundaries). Stages share the
    children (and so the parameters) with model.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"Pipeline stages are cut from an nn.Sequential (or pass a list of stage modules), "
            f"got {type(model).__name__}."
        )
    children = list(model.named_children())
    names = [name for name, _ in children]
    if len(children) < num_stages:
        raise ValueError(
            f"The model has {len(children)} layers, fewer than the {num_stages} pipeline "
            "stages: every stage needs at least one layer (lower pp_size, or num_model_chunks "
            "for the interleaved schedule)."
        )
    if split_points is None:
        sizes = [sum(p.numel() for p in child.parameters()) for _, child in children]
        starts = balanced_boundaries(sizes, num_stages)
    else:
        starts = [0] + [_index_of(point, names) for point in split_points]
        if len(starts) != num_stages:
            raise ValueError(
                f"split_points={list(split_points)!r} makes {len(starts)} stages; "
                f"{num_stages} stages need {num_stages - 1} split points."
            )
        if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
            raise ValueError(
                f"split_points={list(split_points)!r} must name layers in model order, each "
                "after the previous one and none the first layer."
            )
    ends = [*starts[1:], len(children)]
    return [nn.Sequential(OrderedDict(children[a:b])) for a, b in zip(starts, ends, strict=True)]


def _index_of(point: str, names: list[str]) -> int:
    if not isinstance(point, str) or point not in names:
        raise ValueError(
            f"Split point {point!r} names no layer of the model." + did_you_mean(point, names)
        )
    return names.index(point)
