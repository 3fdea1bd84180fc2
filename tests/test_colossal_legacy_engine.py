"""Colossal-AI's legacy `initialize` / Engine as its own tests use it: a port of ColossalAI's
tests/test_legacy/test_engine/test_engine.py, and data iterables that are not DataLoaders.

The port's changes, each for a stated reason: `mixprec` for `colossalai`; gloo on CPU with
2 processes (tests/dist_utils.spawn) for nccl on GPUs; Colossal's test-component models are
not a package, so a small MLP stands in; its data comes as a plain list of batches per rank
(Colossal passes its components' DataLoaders; a list exercises initialize's any-iterable
path). Colossal's CONFIG (parallel sizes 1, clip_grad_norm=1.0) and the four amp modes are
kept; Colossal only checked that one step runs, the port also checks that every rank holds
the same finite weights after it.
"""

from __future__ import annotations

import logging

import pytest
import torch
from dist_utils import assert_same_on_every_rank, spawn
from torch import nn

from mixprec import AMP_TYPE
from mixprec.engine import initialize

CONFIG = dict(
    parallel=dict(pipeline=dict(size=1), tensor=dict(size=1, mode=None)),
    fp16=dict(mode=None),
    clip_grad_norm=1.0,
)
CE = nn.CrossEntropyLoss()


def batches(rank: int, n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's own shard: the user shards a plain iterable (mixprec cannot)."""
    gen = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen))
        for _ in range(n)
    ]


def _run_train(rank: int, world: int) -> None:
    for amp_mode in (AMP_TYPE.APEX, AMP_TYPE.TORCH, AMP_TYPE.NAIVE, None):
        config = dict(CONFIG, fp16=dict(mode=amp_mode))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        data = batches(rank)
        engine, train_dataloader, *_ = initialize(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
            criterion=CE,
            train_dataloader=data,
            config=config,
        )
        assert train_dataloader is data  # returned as it is: each rank already holds its shard
        engine.train()
        for x, label in train_dataloader:
            engine.zero_grad()
            loss = engine.criterion(engine(x), label)
            engine.backward(loss)
            engine.step()
            break
        weights = [p.detach() for p in model.parameters()]
        assert all(torch.isfinite(w).all() for w in weights)
        assert_same_on_every_rank(weights, f"weights after one step, amp_mode={amp_mode}")


def _warns_once_per_iterable(rank: int, world: int) -> None:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("mixprec")
    logger.addHandler(handler)
    try:
        model = nn.Linear(8, 4)
        data = iter(batches(rank))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _, train, *_ = initialize(model, opt, CE, data, None, config={})
    finally:
        logger.removeHandler(handler)
    assert train is data
    warned = [m for m in records if "cannot shard it over the 2 ranks" in m]
    assert len(warned) == 1 and "list_iterator" in warned[0], records


def _two_ranks(rank: int, world: int) -> None:
    _run_train(rank, world)
    _warns_once_per_iterable(rank, world)


@pytest.mark.slow
def test_engine_one_step_per_amp_mode_and_a_plain_iterable_on_two_ranks() -> None:
    # one spawn for both checks: starting two processes costs most of this test's time
    spawn(_two_ranks, 2)


def test_one_process_takes_any_iterable_without_warning(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="mixprec")
    model = nn.Linear(8, 4)
    data = batches(0)
    _, train, test, _ = initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), CE, data, (b for b in data), config={}
    )
    assert train is data and test is not None
    assert not [r for r in caplog.records if "cannot shard" in r.getMessage()]


def test_something_that_is_not_iterable_is_refused_when_sharding() -> None:
    from mixprec.parallel.data import shard_loader

    with pytest.raises(TypeError, match="iterable of batches, got 3"):
        shard_loader(3, 0, 2, "initialize(train_dataloader)")  # type: ignore[arg-type]
