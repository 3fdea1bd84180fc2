"""compile_step compiles repeated structure once (issue 44): in a stack of identical blocks each
kind of param update is one region called once per param of that kind, as many regions at any
depth, and the step still equals the eager step bit for bit.

Compiles use aot_eager (dynamo + aot_autograd, which build the regions; no inductor) behind a
backend that counts the graphs it is handed and reads their invoke_subgraph calls; the inductor
test is marked slow.
"""

from __future__ import annotations

import collections
import logging

import pytest
import torch
from tolerances import EXACT
from torch import nn
from torch._dynamo.backends.registry import lookup_backend

import mixprec
from mixprec.core import compile_regions
from mixprec.core.compile_regions import regions_supported, repeated_blocks, use_regions
from mixprec.core.compiled_step import CPU_FUSION_OPTIONS, compile_step

WIDTH = 8
needs_regions = pytest.mark.skipif(
    not regions_supported(),
    reason=f"torch {torch.__version__}'s nested_compile_region takes no reuse_hash_fn: compile_step "
    "refuses regions=True and compiles 'auto' as one graph there "
    "(test_regions_on_a_torch_without_reuse_keys)",
)


class Block(nn.Module):
    """A pre-norm residual MLP block (the issue's benchmark block, small)."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def blocks(n: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), *[Block() for _ in range(n)])


class RegionCounter:
    """aot_eager that counts the graphs it compiles and, per graph, the calls of each region
    (invoke_subgraph's subgraph name -> calls)."""

    def __init__(self) -> None:
        self.graphs: list[collections.Counter] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        calls = collections.Counter(
            node.args[0].target
            for node in gm.graph.nodes
            if node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph
        )
        self.graphs.append(calls)
        return lookup_backend("aot_eager")(gm, example_inputs)


def batch(i: int, bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(i)
    x, y = torch.randn(4, WIDTH, generator=gen), torch.randn(4, WIDTH, generator=gen)
    if bad:
        y[0, 0] = float("inf")
    return x, y


def run(n: int, mode: str | None, **options):
    """(model, step) after 4 steps (the second overflows: a skip)."""
    model = blocks(n)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    crit = nn.MSELoss()
    if mode is not None:
        model, opt, crit = mixprec.convert_to_amp(model, opt, crit, mode)
    options.setdefault("regions", "auto")
    step = compile_step(model, opt, crit, max_norm=1.0, **options)
    for i in range(4):
        step(*batch(i, bad=i == 1))
    return model, step


# Params by kind: per block LayerNorm weight/bias and fc2.bias (WIDTH,), fc1.weight, fc1.bias,
# fc2.weight: four kinds of update that repeat, whatever the depth. The stem Linear's bias is
# one more (WIDTH,); its weight (WIDTH, WIDTH) is a kind of its own, whose single-use region
# dynamo inlines (torch._dynamo.config.inline_single_use_invoke_subgraph).
UPDATE_KINDS = 4


@needs_regions
@pytest.mark.parametrize("n", [2, 5])
def test_n_identical_blocks_compile_each_kind_of_update_once(n):
    counter = RegionCounter()
    model, step = run(n, None, backend=counter)
    assert step.compiled and step.regional
    assert len(counter.graphs) == 1  # one compile for 4 steps, a skip among them
    calls = counter.graphs[0]
    assert len(calls) == UPDATE_KINDS  # the same number of regions at any depth
    assert sorted(calls.values()) == sorted([n, n, n, 3 * n + 1])
    assert sum(calls.values()) == len(list(model.parameters())) - 1  # the stem's weight inline


@needs_regions
@pytest.mark.parametrize("mode", [None, "bf16"], ids=["fp32", "bf16_autocast"])
def test_regional_step_equals_the_eager_step_bitwise(mode):
    """A skipped step, clipping and AdamW's decoupled decay included."""
    counter = RegionCounter()
    compiled, step = run(3, mode, backend=counter)
    eager, reference = run(3, mode, compile=False)
    assert step.compiled and step.regional and len(counter.graphs) == 1
    assert len(counter.graphs[0]) == UPDATE_KINDS
    assert step.sync_counters() == reference.sync_counters() == 1
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b, **EXACT, msg=name)
    for a, b in zip(step.states, reference.states, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, **EXACT)


def test_without_regions_the_step_is_one_graph_with_the_cpu_options():
    counter = RegionCounter()
    _, step = run(2, None, backend=counter, regions=False)
    assert step.compiled and not step.regional
    assert counter.graphs == [collections.Counter()]
    model = blocks(2)
    opt = torch.optim.AdamW(model.parameters())
    inductor = compile_step(model, opt, nn.MSELoss(), regions="auto")
    if regions_supported():  # 'auto' with repeated blocks: regions, without the C++ wrapper
        assert inductor.regional  # the fusion option, not the wrapper
        assert inductor.compile_options["options"] == CPU_FUSION_OPTIONS
    else:  # one graph (torch 2.11), with the CPU options
        assert not inductor.regional and "options" in inductor.compile_options
    assert not compile_step(model, opt, nn.MSELoss(), compile=False).regional  # the default


def test_repeated_blocks_are_the_children_that_share_class_and_shapes():
    model = nn.Sequential(
        nn.Linear(WIDTH, WIDTH),
        Block(),
        Block(),
        Block(2 * WIDTH),  # another width: not one of them
        nn.ModuleList([nn.ReLU(), nn.ReLU()]),  # no parameters: nothing to compile once
    )
    assert [[id(m) for m in g] for g in repeated_blocks(model)] == [[id(model[1]), id(model[2])]]
    assert use_regions(model, "auto") == regions_supported()  # torch 2.11: one graph
    assert not use_regions(model[3], "auto") and not use_regions(model, False)
    if regions_supported():
        assert use_regions(model[3], True)


@pytest.mark.parametrize("regions", ["all", None, 1, [nn.Linear(2, 2)]])
def test_bad_regions_raise_naming_the_value_and_the_choices(regions):
    with pytest.raises(ValueError, match=r"regions=.*: pass 'auto' .*True or False"):
        use_regions(blocks(2), regions)


@needs_regions
def test_a_region_that_fails_to_compile_falls_back_to_one_graph(monkeypatch, caplog):
    """Should compiling with regions fail, the step compiles once more as one graph (no eager
    fallback, no warning), with the same values."""
    counter = RegionCounter()

    def broken(gm, example_inputs):
        if any(n.target is torch.ops.higher_order.invoke_subgraph for n in gm.graph.nodes):
            raise RuntimeError("no regions here")
        return counter(gm, example_inputs)

    with caplog.at_level(logging.INFO, logger="mixprec"):
        model, step = run(2, None, backend=broken)
    assert step.compiled and not step.regional
    assert "compiling the whole step as one graph" in caplog.text
    eager, _ = run(2, None, compile=False)
    for a, b in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b, **EXACT)


@needs_regions
@pytest.mark.slow
def test_inductor_regional_step_matches_eager():
    """inductor (the default backend): regional, the weights as the eager step's within fp32
    rounding (inductor fuses differently from eager, as without regions)."""
    from tolerances import FP32_ROUNDING

    torch._dynamo.reset()
    compiled, step = run(3, None)
    eager, _ = run(3, None, compile=False)
    assert step.compiled and step.regional
    for a, b in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b, **FP32_ROUNDING)


def lean_pair(optim: str, state: str, rounding: str):
    """Two identical lean (model, optimizer) pairs: three identical bf16 Linear(64, 64) layers,
    no masters."""
    from mixprec.core.lean import LeanConfig
    from mixprec.core.optim import MixedPrecisionOptimizer

    pairs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)]).to(torch.bfloat16)
        if optim == "sgd":
            inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
        else:
            inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        lean = LeanConfig(rounding=rounding, state=state, seed=123)
        pairs.append((model, MixedPrecisionOptimizer(inner, master_weights=False, lean=lean)))
    return pairs


@needs_regions
@pytest.mark.parametrize(
    ("optim", "state", "rounding"),
    [("adamw", "int8", "stochastic"), ("sgd", "bf16", "stochastic"), ("adamw", "fp8", "nearest")],
)
def test_lean_update_regions_equal_the_eager_lean_step_bitwise(monkeypatch, optim, state, rounding):
    """A lean optimizer: bf16 params without masters, quantized or bf16 state, the stochastic
    rounding stream, each kind of update a region; a skipped step moves nothing."""
    from test_lean import snapshot

    from mixprec.core import fused_step

    monkeypatch.setattr(fused_step, "_failed", True)  # the eager kernels: the same ops
    (model, opt), (ref, ref_opt) = lean_pair(optim, state, rounding)
    counter = RegionCounter()
    step = compile_step(model, opt, nn.MSELoss(), backend=counter, regions="auto")
    gen = torch.Generator().manual_seed(0)
    for i in range(4):
        x, y = torch.randn(4, 64, generator=gen), torch.randn(4, 64, generator=gen)
        if i == 1:
            y[0, 0] = float("inf")  # a skip
        x, y = x.bfloat16(), y.bfloat16()
        step(x, y)
        ref_opt.backward(nn.functional.mse_loss(ref(x), y))
        ref_opt.step()
        ref_opt.zero_grad()
        for a, b in zip(snapshot(model, opt), snapshot(ref, ref_opt), strict=True):
            torch.testing.assert_close(a, b, **EXACT)
    assert step.compiled and step.regional and len(counter.graphs) == 1
    assert sorted(counter.graphs[0].values()) == [3, 3]  # the weights' kind, the biases'
    assert step.sync_counters() == 1


def test_regions_on_a_torch_without_reuse_keys(monkeypatch, caplog):
    """torch 2.11's nested_compile_region has no reuse_hash_fn (regions_supported): 'auto'
    compiles one graph and says why, True is refused naming the torch version and the choices."""
    monkeypatch.setattr(compile_regions, "regions_supported", lambda: False)
    model = blocks(2)
    with caplog.at_level(logging.INFO, logger="mixprec"):
        assert use_regions(model, "auto") is False
    assert "reuse_hash_fn" in caplog.text and torch.__version__ in caplog.text
    with pytest.raises(ValueError, match=r"regions=True.*reuse_hash_fn.*regions=False"):
        use_regions(model, True)
    assert use_regions(model, False) is False
