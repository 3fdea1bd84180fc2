"""compile_step's joined groups: a param group's fp32 masters and their optimizer state stepped
as one flat buffer each, so the compiled graph holds one update per group whatever the depth.

Unrolled per param, each trained tensor added about 23 nodes to compile_step's graph (mostly its
own scalar vector: the bias corrections of its own Adam step count), and inductor's scheduler and
code generation grew faster than the graph (benchmarks/results/compile_cpu.md). A joined group
adds one update for all its params; per param, the graph keeps only what is its own: its
gradient's slice of the group's flat gradient (one concatenation) and the write of its new
low-precision value.

A group's params join when each has an fp32 contiguous hp (its master, or the model's own fp32
param when it has none) and plain fp32 state on the hp's device, and the step runs no lean
write-back. Adam's step counts must all be equal: the group then shares one scalar vector, as
the eager step shares one among params at the same count (GroupPlan.prepare). The values are
the per-param update's, element for element: the same step_math on the same scalars. A group
is stepped in chunks (CHUNK_ELEMENTS): masters and the model's own params in chunks of their
own; a large param is a chunk over its own tensors; small ones are joined, the model's own
params too (they become views of one buffer the graph writes in place, which dynamo and
aot_autograd treat as one input), a chunk holding one repeated block's params at most
(JoinedGroup: so identical blocks share their kernels).

The joined tensors stay the optimizer's own (joined.JoinedState: rebound in place), so
state_dict(), checkpoints and eager steps see them. CompiledStep checks on the host before each
step that they still are (ids and pointers: a loaded state_dict plans again), and after steps it
did not take (an eager step may skip a param without a gradient) reads Adam's counts once (one
sync) and releases a group whose counts differ back to per-param updates.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.core import step_math as sm
from mixprec.core.joined import JoinedState
from mixprec.core.step_plan import group_scalars

MIN_MEMBERS = 2
"""A group joins from this many joinable params (one param gains nothing)."""
CHUNK_ELEMENTS = 1 << 18
"""Joined params are stepped in chunks of at most this many elements (a param of this size or
more is a chunk of its own, over its own tensors): a chunk's update makes temporaries of its
size (its flat gradient, its new values), and temporaries of a few MiB are mapped afresh by the
allocator at every step, whose page faults cost more than the update (residual MLP blocks,
width 256, bf16, 8 blocks: a step took 34 ms with chunks of 2**19 or 2**20 elements, 14 ms with
2**18; the per-param step 12 ms)."""


def joinable(hp: torch.Tensor, lp: torch.Tensor | None, state: list[Any]) -> bool:
    """Whether hp (with its low-precision twin lp and its state tensors, Adam's step first) can
    be stepped in a joined group: see the module docstring."""
    if hp.dtype != torch.float32 or not hp.is_contiguous():
        return False
    for t in state:
        if type(t) is not torch.Tensor or t.device != hp.device or not t.is_contiguous():
            return False
    moments = state[1:] if len(state) == 3 else state  # Adam: [step, exp_avg, exp_avg_sq]
    return all(t.dtype == torch.float32 for t in moments)


def counts_equal(steps: list[torch.Tensor] | torch.Tensor) -> bool:
    """Whether Adam's step counts (0-dim tensors, or one tensor of them) are all equal (reads
    them: one host sync)."""
    if len(steps) < 2:
        return True
    counts = steps if isinstance(steps, torch.Tensor) else torch.stack(list(steps))
    if counts.device.type == "meta":  # no values (a shape-only dry run): none can differ
        return True
    return bool((counts == counts[0]).all())


@dataclass
class _Chunk:
    """Consecutive members of a joined group, stepped by one update."""

    members: list[int]
    lp: list[torch.Tensor | None]
    """The model's low-precision twins of the masters, written from their slices of the new
    values (None: hp is the model's own fp32 param)."""
    sizes: list[int]
    hp: list[torch.Tensor]
    """The members' masters, or the model's own params for members without one."""
    moments: list[list[torch.Tensor]]
    """Per member, its state tensors but Adam's step (exp_avg, exp_avg_sq | momentum_buffer)."""
    joined: JoinedState | None = None
    """Two or more members: their hp column, then their state columns, joined. None for one
    member: its own tensors are the operands."""


def _chunked(sizes: list[int], blocks: list[Hashable], limit: int) -> list[list[int]]:
    """Positions 0..len(sizes)-1 in runs: a member of `limit` elements or more alone, the others
    packed in order into runs of at most `limit` elements (a layer's small params join across
    its large ones), a run ending where the block changes (see JoinedGroup)."""
    runs: list[list[int]] = []
    open_run: list[int] | None = None
    total, block = 0, None
    for position, size in enumerate(sizes):
        if size >= limit:
            runs.append([position])
            continue
        if open_run is None or total + size > limit or blocks[position] != block:
            open_run, total, block = [], 0, blocks[position]
            runs.append(open_run)
        open_run.append(position)
        total += size
    return runs


def _runs(sizes: list[int], masters: list[bool], blocks: list[Hashable]) -> list[list[int]]:
    """_chunked runs of the members with masters, then of those stepping the model's own param
    (a chunk's hp are one kind: its low-precision writes are all there or all absent)."""
    runs = []
    for kind in (True, False):
        at = [k for k, has in enumerate(masters) if has is kind]
        chunked = _chunked([sizes[k] for k in at], [blocks[k] for k in at], CHUNK_ELEMENTS)
        runs += [[at[k] for k in run] for run in chunked]
    return runs


def _tensors(hp: list[torch.Tensor], states: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [*hp, *(t for state in states for t in state)]


class JoinedGroup:
    """Params of one param group (indices into CompiledStep's per-param lists) stepped with one
    scalar vector: their state (and masters) joined into flat buffers per chunk of about
    CHUNK_ELEMENTS (a param that large is a chunk on its own, over its own tensors), Adam's step
    counts into one buffer for the group.

    blocks: each member's block (compile_regions.repeated_blocks: one of a model's identical
    blocks; None outside them): a chunk holds one block's params at most. Inductor writes a
    joined tensor's offset into every kernel that reads it (a joined own param in the forward
    and the backward, a gradient written into its chunk's concatenation), so a chunk spanning
    blocks gave every block kernels of its own, where identical blocks share them when each
    block's chunk has the same layout (benchmarks/bench_compile.py)."""

    def __init__(
        self,
        group: int,
        kind: str,
        members: list[int],
        hp: list[torch.Tensor],
        lp: list[torch.Tensor | None],
        states: list[list[torch.Tensor]],
        blocks: list[Hashable],
    ) -> None:
        self.group, self.kind, self.members = group, kind, members
        adam = kind == "adam"
        self.steps = JoinedState([[st[0] for st in states]]) if adam else None
        """Adam's step counts, one per member, in one buffer: equal, so they advance as one."""
        moments = [st[1:] if adam else st for st in states]
        sizes = [t.numel() for t in hp]
        self.chunks: list[_Chunk] = []
        for run in _runs(sizes, [t is not None for t in lp], blocks):
            chunk = _Chunk(
                [members[k] for k in run],
                [lp[k] for k in run],
                [sizes[k] for k in run],
                [hp[k] for k in run],
                [moments[k] for k in run],
            )
            if len(run) > 1:
                columns = [chunk.hp, *(list(col) for col in zip(*chunk.moments, strict=True))]
                chunk.joined = JoinedState(columns)
            self.chunks.append(chunk)
        self.key = self._key(hp, states)
        """Ids and data pointers of every tensor joined or held: see holds()."""

    @staticmethod
    def _key(hp: list[torch.Tensor], states: list[list[torch.Tensor]]) -> list[tuple[int, int]]:
        return [(id(t), t.data_ptr()) for t in _tensors(hp, states)]

    def holds(self, hp: list[torch.Tensor], states: list[list[torch.Tensor]]) -> bool:
        """The optimizer's masters and state are still the tensors this group steps, in their
        places (a loaded state_dict makes new ones)."""
        return self._key(hp, states) == self.key

    def counts_equal(self) -> bool:
        """Whether the members' Adam step counts are still equal (one host sync; SGD: True)."""
        return self.steps is None or counts_equal(self.steps.whole[0])

    def release(self) -> None:
        """Give the members' tensors storages of their own (see JoinedState.release)."""
        for joined in [self.steps, *(chunk.joined for chunk in self.chunks)]:
            if joined is not None:
                joined.release()

    # ----- inside the compiled graph -----
    def gather(self, grads: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Each chunk's gradients as one flat tensor, in member order (mixed low-precision
        dtypes promote exactly, as each is read as fp32 anyway)."""
        return [_flat([grads[i] for i in chunk.members]) for chunk in self.chunks]

    def update(
        self,
        grads: list[torch.Tensor],
        head: list[torch.Tensor],
        h: torch.Tensor,
        keep: torch.Tensor,
        skip: torch.Tensor,
        flags: tuple[str, tuple[bool, ...]],
        clipping: bool,
    ) -> None:
        """The group's step (step_math's update over each chunk) written in place, every write
        the old value on a skipped step, then each low-precision param from its slice. grads:
        gather()'s; h: the group's values (GroupPlan.values, fp64); head: [inv_scale, clip];
        keep: 1.0 unless skipped; skip: found_inf > 0."""
        kind = flags[0]
        values = list(h.unbind())
        if self.steps is not None:
            steps = self.steps.whole[0]
            counted = steps + keep.reshape(()).to(steps.dtype)  # unchanged on a skip
            s = sm.scalar_vector(group_scalars(kind, values, step=counted[0].double()), head)
            steps.copy_(counted)
        else:
            s = sm.scalar_vector(group_scalars(kind, values), head)
        scalars = s.unbind()  # read once for all chunks (indexing s selected anew per chunk)
        for chunk, grad in zip(self.chunks, grads, strict=True):
            _update_chunk(chunk, grad, scalars, skip, flags, clipping)


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """tensors as one flat tensor: a view of a single one, else their concatenation (a 1-D
    tensor as it is: each traced view is a node the compile pays for)."""
    flat = [t if t.dim() == 1 else t.reshape(-1) for t in tensors]
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def _operands(chunk: _Chunk) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(hp, state moments) of a chunk as flat tensors: the joined columns, or views of its one
    member's own tensors."""
    if chunk.joined is None:
        return _flat(chunk.hp), [_flat(list(col)) for col in zip(*chunk.moments, strict=True)]
    return chunk.joined.whole[0], chunk.joined.whole[1:]


def _update_chunk(
    chunk: _Chunk,
    grad: torch.Tensor,
    s: tuple[torch.Tensor, ...],
    skip: torch.Tensor,
    flags: tuple[str, tuple[bool, ...]],
    clipping: bool,
) -> None:
    """One chunk's update with the group's scalars s, unbound (see JoinedGroup.update)."""
    kind, (maximize, decay, *extra) = flags
    hp, moments = _operands(chunk)
    g = sm.unscaled(grad, s, clipping, maximize)
    written: list[tuple[torch.Tensor, torch.Tensor]] = []
    if kind == "sgd":
        new = sm.sgd_update(hp, g, s, decay)
    elif kind == "sgd_momentum":
        new, buf = sm.sgd_momentum_update(hp, g, moments[0], s, decay, *extra)
        written.append((moments[0], buf))
    else:
        new, m, v = sm.adam_update(hp, g, moments[0], moments[1], s, decay, *extra)
        written += [(moments[0], m), (moments[1], v)]
    for old, value in written:
        old.copy_(torch.where(skip, old, value))
    offset = 0
    for lp, size in zip(chunk.lp, chunk.sizes, strict=True):
        if lp is not None:
            piece = new[offset : offset + size].view(lp.shape).to(lp.dtype)
            lp.copy_(torch.where(skip, lp, piece))
        offset += size
    hp.copy_(torch.where(skip, hp, new))  # the joined column, or a view of the one hp
