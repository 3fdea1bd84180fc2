"""compile_step's joined groups (mixprec.core.compiled_join, issue 44): a param group's state and
masters stepped as flat buffers with one scalar vector, so the graph's update does not grow
with the param count; the values are the per-param update's, bit for bit.

The per-param reference is the same step with joining switched off (MIN_MEMBERS above the
param count). Most runs use compile=False (the same traced code, run eagerly) or aot_eager; one
inductor run checks the generated kernels.
"""

from __future__ import annotations

import collections
import re

import pytest
import torch
from test_compile_once import WIDTH, Block, batch  # the benchmark block, small
from tolerances import EXACT
from torch import nn

import mixprec
from mixprec.core import compiled_join, compiled_step
from mixprec.core.compile_regions import regions_supported
from mixprec.core.compiled_join import _chunked
from mixprec.core.compiled_step import compile_step


class Stack(nn.Module):
    """n blocks; `depth` (default all) says how many the forward runs."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(n)])
        self.depth = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks[: self.depth]:
            x = block(x)
        return x


def build(n: int, mode: str | None, opt_cls=torch.optim.AdamW, **opt_kwargs):
    torch.manual_seed(0)
    model = Stack(n)
    opt_kwargs = opt_kwargs or {"lr": 0.01, "weight_decay": 0.1}
    opt = opt_cls(model.parameters(), **opt_kwargs)
    crit = nn.MSELoss()
    if mode is not None:
        config = {"initial_scale": 2.0**10} if mode == mixprec.AMP_TYPE.NAIVE else None
        model, opt, crit = mixprec.convert_to_amp(model, opt, crit, mode, config)
    return model, opt, crit


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    out += [m.detach().clone() for m in getattr(opt, "hp_masters", [])]
    for state in opt.state.values():
        out += [v.clone() for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    return out


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        torch.testing.assert_close(x, y, **EXACT, msg=f"tensor {i}")


@pytest.fixture
def per_param(monkeypatch):
    """Switch joining off (the per-param reference)."""

    def off() -> None:
        monkeypatch.setattr(compiled_join, "MIN_MEMBERS", 10**9)

    return off


def steps(step, n: int = 4, bad: int = 1) -> None:
    for i in range(n):
        step(*batch(i, bad=i == bad))


MODES = [None, "bf16", mixprec.AMP_TYPE.NAIVE]
OPTIMIZERS = [
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01, "maximize": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 0.1}),
]


@pytest.mark.parametrize("mode", MODES, ids=["fp32", "bf16", "naive"])
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=["adamw", "adam_max", "sgd_nesterov", "sgd"])
def test_joined_step_equals_the_per_param_step_bitwise(mode, opt, per_param):
    """Clipping and a skipped step among 4 (the skip changes nothing, by either path)."""
    model, optimizer, crit = build(3, mode, opt[0], **opt[1])
    step = compile_step(model, optimizer, crit, max_norm=0.5, compile=False)
    assert len(step.joins) == 1 and step.solo == []  # every param of the one group
    steps(step)
    joined = snapshot(model, optimizer)
    per_param()
    model, optimizer, crit = build(3, mode, opt[0], **opt[1])
    reference = compile_step(model, optimizer, crit, max_norm=0.5, compile=False)
    assert reference.joins == []
    steps(reference)
    assert_bitwise(joined, snapshot(model, optimizer))
    assert step.sync_counters() == reference.sync_counters() == 1


def test_the_state_is_joined_in_place_and_stays_the_optimizers():
    """The masters and moments keep their identity (state_dict, param_groups) and become views
    of one buffer per column and chunk; Adam's counts share one buffer for the group."""
    model, opt, crit = build(2, mixprec.AMP_TYPE.NAIVE)
    masters = list(opt.hp_masters)
    step = compile_step(model, opt, crit, compile=False)
    assert [id(m) for m in opt.hp_masters] == [id(m) for m in masters]
    (join,) = step.joins
    # width 8, per block: one chunk of masters (of fp16 params), one of the params NAIVE keeps
    # fp32 (its norms)
    assert len(join.chunks) == 4
    chunks = [c for c in join.chunks if c.lp[0] is not None]
    own = [c for c in join.chunks if c.lp[0] is None]
    assert len(chunks) == len(own) == 2
    assert all(lp is not None for c in chunks for lp in c.lp)
    assert all(lp is None for c in own for lp in c.lp)
    for o in own:  # the model's own fp32 params, views of one buffer too
        assert {p.untyped_storage().data_ptr() for p in o.hp} == {
            o.joined.whole[0].untyped_storage().data_ptr()
        }
    chunk = chunks[0]
    whole = chunk.joined.whole
    storage = {m.untyped_storage().data_ptr() for m in chunk.hp}
    assert storage == {whole[0].untyped_storage().data_ptr()}
    assert all(any(m is c for m in masters) for c in chunk.hp)  # the optimizer's own masters
    counts = {opt.state[m]["step"].untyped_storage().data_ptr() for m in masters}
    assert counts == {join.steps.whole[0].untyped_storage().data_ptr()}
    steps(step, n=2, bad=-1)
    assert all(int(opt.state[m]["step"]) == 2 for m in masters)
    first = chunk.hp[0]
    torch.testing.assert_close(whole[0][: first.numel()], first.reshape(-1), **EXACT)


def test_a_chunk_holds_one_blocks_params_and_blocks_chunk_alike():
    """Chunks end at block boundaries (compile_regions.repeated_blocks), so each block's chunk
    has the same layout; params outside the blocks pack apart from them; a large param is
    still a chunk of its own."""
    assert _chunked([5, 5, 5, 5], ["a", "a", "b", "b"], 100) == [[0, 1], [2, 3]]
    assert _chunked([5, 100, 3, 5], ["a", "a", "a", "b"], 10) == [[0, 2], [1], [3]]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), Block(), Block(), nn.LayerNorm(WIDTH))
    opt = torch.optim.AdamW(model.parameters())
    step = compile_step(model, opt, nn.MSELoss(), compile=False)
    (join,) = step.joins
    names = dict(enumerate(step.train_names))
    layouts = [[names[i] for i in chunk.members] for chunk in join.chunks]
    outside = [["0.weight", "0.bias"], ["3.weight", "3.bias"]]  # a run ends at each block
    block = ["norm.weight", "norm.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert layouts == [
        outside[0],
        [f"1.{name}" for name in block],
        [f"2.{name}" for name in block],
        outside[1],
    ]
    first, second = join.chunks[1:3]
    assert first.sizes == second.sizes


def test_large_params_are_chunks_of_their_own(monkeypatch):
    assert _chunked([5, 100, 3, 2, 100, 4], [None] * 6, 10) == [[0, 2, 3], [1], [4], [5]]
    assert _chunked([4, 4, 4], [None] * 3, 10) == [[0, 1], [2]]
    monkeypatch.setattr(compiled_join, "CHUNK_ELEMENTS", 64)  # fc1/fc2 weights: 256 elements
    model, opt, crit = build(2, "bf16")
    step = compile_step(model, opt, crit, compile=False)
    (join,) = step.joins
    sizes = sorted(sum(chunk.sizes) for chunk in join.chunks)
    assert sizes.count(256) == 4  # each weight alone, over its own tensors
    assert all(chunk.joined is None for chunk in join.chunks if len(chunk.members) == 1)


def test_large_chunks_equal_the_per_param_step(monkeypatch, per_param):
    monkeypatch.setattr(compiled_join, "CHUNK_ELEMENTS", 64)
    for mode in ("bf16", mixprec.AMP_TYPE.NAIVE):
        model, opt, crit = build(2, mode)
        step = compile_step(model, opt, crit, max_norm=0.5, compile=False)
        assert len(step.joins[0].chunks) > 1
        steps(step)
        joined = snapshot(model, opt)
        with monkeypatch.context() as m:
            m.setattr(compiled_join, "MIN_MEMBERS", 10**9)
            model, opt, crit = build(2, mode)
            steps(compile_step(model, opt, crit, max_norm=0.5, compile=False))
        assert_bitwise(joined, snapshot(model, opt))


def _checkpointed_run(mode, join: bool, monkeypatch):
    """3 compiled steps, a state_dict taken after the first, loaded back into the same
    optimizer (new tensors), 2 more compiled steps."""
    monkeypatch.setattr(compiled_join, "MIN_MEMBERS", 2 if join else 10**9)
    model, opt, crit = build(2, mode)
    step = compile_step(model, opt, crit, compile=False)
    step(*batch(0))
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved = opt.state_dict()
    saved = {
        **saved,
        "state": {k: {n: t.clone() for n, t in v.items()} for k, v in saved["state"].items()},
    }
    step(*batch(1))
    step(*batch(2))
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved)
    step(*batch(1))
    step(*batch(2))
    return snapshot(model, opt), step


@pytest.mark.parametrize("mode", [None, mixprec.AMP_TYPE.NAIVE], ids=["fp32", "naive"])
def test_a_loaded_state_dict_is_what_the_next_step_steps(mode, monkeypatch):
    """Loading makes new state tensors: the step plans again and steps them (joined or not),
    so the run continues from the checkpoint exactly as an uninterrupted one does."""
    monkeypatch.setattr(compiled_join, "MIN_MEMBERS", 10**9)
    model, opt, crit = build(2, mode)
    reference = compile_step(model, opt, crit, compile=False)
    for i in range(3):
        reference(*batch(i))
    expected = snapshot(model, opt)
    for join in (True, False):
        got, step = _checkpointed_run(mode, join, monkeypatch)
        assert bool(step.joins) == join
        assert_bitwise(got, expected)


@pytest.mark.parametrize("mode", [mixprec.AMP_TYPE.NAIVE, None], ids=["naive", "plain_fp32"])
def test_eager_steps_that_leave_counts_unequal_release_the_group(mode, per_param):
    """An eager step skips a param that got no gradient (torch's Adam counts it no step): the
    counts differ, so the group is released (one read, only after steps the compiled step did
    not take: the wrapper's count, or a plain optimizer's own step() calls) and the params step
    one by one, as the per-param reference does."""

    def run():
        model, opt, crit = build(2, mode)
        stack = next(m for m in model.modules() if isinstance(m, Stack))
        step = compile_step(model, opt, crit, compile=False)
        step(*batch(0))
        opt.zero_grad()
        stack.depth = 1  # the second block gets no gradient
        loss = crit(model(batch(1)[0]), batch(1)[1])
        if mode is None:
            loss.backward()
        else:
            opt.backward(loss)
        opt.step()
        stack.depth = 2
        step(*batch(2))
        step(*batch(3))
        return model, opt, step

    model, opt, step = run()
    assert step.joins == [] and len(step.solo) == len(list(model.parameters()))
    counts = {int(s["step"]) for s in opt.state.values()}
    assert counts == {3, 4}
    joined = snapshot(model, opt)
    per_param()
    model, opt, _ = run()
    assert_bitwise(joined, snapshot(model, opt))


def test_eager_steps_that_keep_counts_equal_keep_the_group():
    model, opt, crit = build(2, mixprec.AMP_TYPE.NAIVE)
    step = compile_step(model, opt, crit, compile=False)
    (join,) = step.joins
    step(*batch(0))
    x, y = batch(1)
    opt.zero_grad()
    opt.backward(crit(model(x), y))
    opt.step()
    step(*batch(2))
    assert step.joins == [join]
    assert {int(s["step"]) for s in opt.state.values()} == {3}


class OpCounter:
    """aot_eager that counts, per compiled graph, the aten ops of each kind."""

    def __init__(self) -> None:
        self.graphs: list[collections.Counter] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        def count(graph_module, inputs):
            ops = collections.Counter(
                str(node.target) for node in graph_module.graph.nodes if node.op == "call_function"
            )
            self.graphs.append(ops)
            return graph_module

        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=count)(gm, example_inputs)


def _graph_ops(n: int) -> collections.Counter:
    counter = OpCounter()
    model, opt, crit = build(n, "bf16")
    step = compile_step(model, opt, crit, backend=counter)
    steps(step, n=2, bad=-1)
    assert step.compiled and len(counter.graphs) == 1
    return counter.graphs[0]


def _update_ops(ops: collections.Counter) -> dict[str, int]:
    """The ops only Adam's update and its scalars use (the model's forward and backward use
    none of them; the skip's where also writes each gathered param back, so it is not one)."""
    return {k: v for k, v in ops.items() if k.startswith(("aten.lerp", "aten.pow", "aten.sqrt"))}


def test_each_block_is_one_update_in_the_graph(per_param):
    """A compile counter, not a timing: the graph of a stack of 2 or 6 blocks holds one Adam
    update per block (one lerp of the first moment, one sqrt of the second: each block's params
    are one chunk, whose kernels identical blocks share) and one set of the group's scalars
    (the bias corrections' powers) at either depth; per param, one lerp each."""
    two, six = _graph_ops(2), _graph_ops(6)
    for ops, blocks in ((two, 2), (six, 6)):
        assert ops["aten.lerp.Scalar"] + ops["aten.lerp.Tensor"] == blocks
        assert ops["aten.sqrt.default"] == blocks
    powers = {k: v for k, v in _update_ops(two).items() if k.startswith("aten.pow")}
    assert powers == {k: v for k, v in _update_ops(six).items() if k.startswith("aten.pow")}
    per_param()
    torch._dynamo.reset()
    ops = _graph_ops(2)
    assert ops["aten.lerp.Scalar"] + ops["aten.lerp.Tensor"] == 12  # 6 params per block


def _kernels(n: int) -> int:
    """How many distinct C++ kernels inductor builds for a bf16 stack of n blocks (its Python
    wrapper defines each distinct kernel source once, however often the step calls it)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model, opt, crit = build(n, "bf16")
    step = compile_step(model, opt, crit, options={"cpp_wrapper": False})
    _, code = run_and_get_code(step, *batch(0))
    assert step.compiled
    return len({k for c in code for k in re.findall(r"^(cpp_fused_\w+) = async_compile", c, re.M)})


@pytest.mark.slow
def test_more_identical_blocks_build_no_more_kernels(monkeypatch):
    """A compile counter, not a timing (issue 44): 12 blocks build at most 2 C++ kernels more
    than 8 (identical blocks share their forward, backward and update kernels, inductor's
    realization pattern settling after the first few), where one chunk across the blocks gave
    each block kernels of its own (the joined offsets written into them)."""
    eight, twelve = _kernels(8), _kernels(12)
    assert twelve - eight <= 2, (eight, twelve)
    monkeypatch.setattr(compiled_step, "repeated_blocks", lambda model: [])  # one chunk
    across = _kernels(8), _kernels(12)
    assert across[1] - across[0] >= 8, across


@pytest.mark.slow
def test_inductor_joined_step_equals_the_per_param_step(per_param):
    """The generated kernels: joined and per-param steps agree bit for bit under inductor
    (the same elementwise math), a skip and clipping included."""
    results = []
    for join in (True, False):
        if not join:
            per_param()
        torch._dynamo.reset()
        model, opt, crit = build(2, "bf16")
        step = compile_step(model, opt, crit, max_norm=0.5)
        steps(step)
        assert step.compiled and bool(step.joins) == join
        results.append(snapshot(model, opt))
    assert_bitwise(*results)


def test_lean_and_regional_steps_do_not_join():
    """A lean write-back (stochastic rounding keyed per param, low-bit state) and update
    regions step param by param."""
    from mixprec.core.lean import LeanConfig
    from mixprec.core.optim import MixedPrecisionOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(3)]).to(torch.bfloat16)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lean = LeanConfig(rounding="stochastic", state="bf16", seed=1)
    opt = MixedPrecisionOptimizer(inner, master_weights=False, lean=lean)
    step = compile_step(model, opt, nn.MSELoss(), compile=False)
    assert step.joins == [] and len(step.solo) == 6
    if regions_supported():
        model, opt, crit = build(2, "bf16")
        assert compile_step(model, opt, crit, compile=False, regions=True).joins == []
