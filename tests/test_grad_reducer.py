"""GradTransfer's reducer slot (core.grad_transfer.GradReducer): what a step's grads go through
after the transfer's way, once per step, before they are unscaled and checked; the parallel layer
supplies its reducers (ZeRO's buckets, the data-parallel mean) instead of overriding the
optimizer. ZeRO vs DDP and the pipeline vs one process, bit for bit, stay in test_zero*.py,
test_pipeline.py and test_hybrid_parallel.py; here the slot's contract, in one process."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mixprec.core.clip import ClipSpan
from mixprec.core.grad_transfer import GradTransfer, NoReduce
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import ScalerConfig
from mixprec.core.scaling import default_group
from mixprec.parallel.pipeline.optim import PipelineOptimizer
from mixprec.parallel.zero import ZeroOptimizer
from mixprec.parallel.zero_buckets import GradBuckets


class Halve:
    """A reducer that records what it saw and halves the grads after the move (a mean over two
    replicas that hold the same grads)."""

    def __init__(self) -> None:
        self.calls = 0
        self.seen_on_masters: list[bool] = []
        self.zeroed: list[bool] = []

    def reduce_(self, transfer: GradTransfer, move: Callable[[], None]) -> None:
        self.calls += 1
        move()
        self.seen_on_masters.append(all(hp.grad is not None for hp in transfer.hp_masters))
        torch._foreach_mul_(transfer.held_grads(), 0.5)

    def zero_grad(self, set_to_none: bool) -> None:
        self.zeroed.append(set_to_none)


def _pair(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))
    twin = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))
    twin.load_state_dict(model.state_dict())
    model[0].half()  # one fp16 layer (fp32 masters), one fp32 layer (its own master)
    twin[0].half()
    return model, twin


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model[1](model[0](x.half()).float()).square().mean()


def test_the_default_slot_reduces_nothing() -> None:
    opt = MixedPrecisionOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    assert isinstance(opt.transfer.reducer, NoReduce)


def test_a_reducer_runs_once_per_step_after_the_move_and_before_the_check() -> None:
    model, twin = _pair()
    cfg = ScalerConfig(init_scale=2.0**4)
    opt = MixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5), loss_scale=cfg, fused_step=False
    )
    ref = MixedPrecisionOptimizer(
        torch.optim.SGD(twin.parameters(), lr=0.25), loss_scale=cfg, fused_step=False
    )
    halve = opt.transfer.reduce_with(Halve())
    assert opt.transfer.reducer is halve
    x = torch.randn(3, 6)
    for _ in range(3):
        opt.backward(_loss(model, x))
        ref.backward(_loss(twin, x))
        opt.clip_grad_norm(1e6)  # transfers and reduces; the step must not reduce again
        opt.step()
        ref.step()
        opt.zero_grad(set_to_none=False)
        ref.zero_grad(set_to_none=False)
    # halved grads with lr 0.5 are the plain grads with lr 0.25, bit for bit (x 0.5 is exact)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    assert halve.calls == 3 and halve.seen_on_masters == [True] * 3
    assert halve.zeroed == [False] * 3  # zero_grad reaches the reducer


def test_a_nonfinite_grad_the_reducer_leaves_skips_the_step() -> None:
    class Poison(Halve):
        def reduce_(self, transfer: GradTransfer, move: Callable[[], None]) -> None:
            move()
            transfer.held_grads()[0].fill_(float("nan"))  # what a reduction could bring in

    model, _ = _pair()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), fused_step=False)
    opt.transfer.reduce_with(Poison())
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(_loss(model, torch.randn(3, 6)))
    assert opt.step().skipped  # the check runs on what the reducer left
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_zero_and_the_pipeline_reduce_through_the_slot_not_overrides() -> None:
    """The parallel layer's reductions are reducers: ZeRO's buckets and the pipeline's
    data-parallel mean; neither class overrides the transfer, the step's end or zero_grad."""
    zero = ZeroOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), stage=1)
    assert isinstance(zero.buckets, GradBuckets) and zero.transfer.reducer is zero.buckets
    for cls in (ZeroOptimizer, PipelineOptimizer):
        for name in ("grads_to_masters", "zero_grad", "_end_step", "unscale_grads"):
            assert name not in vars(cls), f"{cls.__name__}.{name}: reduce in the reducer slot"


def test_the_ranks_a_clip_spans_are_data_not_overrides() -> None:
    """ZeRO's clip spans every shard (the default group, looked up at each use, not held); a
    pipeline stage's its stages; the base class none (replicas hold equal grads)."""
    for cls in (ZeroOptimizer, PipelineOptimizer):
        assert "clip_grad_norm" not in vars(cls), f"{cls.__name__}: set clip_span instead"
    zero = ZeroOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), stage=1)
    assert zero.clip_span == ClipSpan.over(None)
    assert zero.clip_span.resolve() is default_group()
    assert MixedPrecisionOptimizer.clip_span == ClipSpan() and ClipSpan().resolve() is None
