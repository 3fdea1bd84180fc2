"""compile_step on models whose backward is custom: Float8Linear (fp8) and a user's Function.

dynamo traces torch.func.grad over an autograd.Function by inlining its forward and dropping
its custom backward (pytorch/pytorch#193279): the step differentiates with torch.autograd.grad,
which keeps it. These tests compile with backend="eager" (dynamo's trace, no inductor codegen):
what decides whether the custom backward survives tracing, at a fraction of inductor's cost.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo
from test_compiled_step import _core_eager, state_of
from tolerances import fp32_rounding
from torch import nn

import mixprec
from mixprec.core.compiled_step import compile_step
from mixprec.fp8.config import Float8Config
from mixprec.fp8.linear import HISTORY_NAMES, Float8Linear

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

# FP32_ROUNDING holds for fp8 too: a 1-ulp different weight or amax lands on the other side of
# an fp8 rounding boundary with probability ~2**-20 per element, so at these sizes the fp8
# casts agree and only the update's fp32 rounding differs.


def plain_model() -> nn.Module:
    """The fp32 model fp8_model converts, with the same initial weights."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def fp8_model(scaling: str) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module]:
    model = plain_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    precision = mixprec.FP8MixedPrecision(config=Float8Config(scaling=scaling))
    model, opt, crit, _, _ = mixprec.Booster(mixed_precision=precision).boost(
        model, opt, nn.MSELoss()
    )
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 2
    return model, opt, crit


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(torch.get_default_device()).manual_seed(step)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)


def eager_steps(model, opt, crit, steps: range) -> None:
    step = _core_eager(model, opt, crit)
    for i in steps:
        step(*batch(i))


@pytest.mark.parametrize("compiled", [False, True], ids=["functional", "dynamo"])
@pytest.mark.parametrize("scaling", ["dynamic", "delayed"])
def test_fp8_step_equals_the_eager_fp8_step(scaling, compiled):
    model, opt, crit = fp8_model(scaling)
    eager_steps(model, opt, crit, range(3))
    reference = state_of(model, opt)
    model, opt, crit = fp8_model(scaling)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    options = {"backend": "eager"} if compiled else {"compile": False}
    step = compile_step(model, opt, crit, **options)
    with warnings.catch_warnings():
        # a fallback to eager warns: fail instead (dynamo's own DeprecationWarning, raised while
        # it traces an autograd.Function, stays a warning)
        warnings.filterwarnings("error", message="mixprec.compile_step")
        for i in range(3):
            step(*batch(i))
    assert step.compiled == compiled
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    got = state_of(model, opt)
    assert len(got) == len(reference)
    for i, (a, b) in enumerate(zip(got, reference, strict=True)):
        torch.testing.assert_close(a, b, msg=f"state tensor {i}", **fp32_rounding())
    if scaling == "delayed":  # three steps recorded: input, weight and grad amaxes
        for layer in (m for m in model.modules() if isinstance(m, Float8Linear)):
            for name in HISTORY_NAMES:
                history = getattr(layer, name)
                assert bool((history[:3] > 0).all()) and bool((history[3:] == 0).all()), name


def test_fp8_skipped_step_changes_no_weight_or_optimizer_state_and_records_as_eager():
    """A skip keeps params and AdamW state bitwise; the histories record as the eager step
    does (its forward and backward ran): the compiled and eager runs stay identical."""
    runs = []
    for compiled in (False, True):
        model, opt, crit = fp8_model("delayed")
        torch._dynamo.reset()
        eager = _core_eager(model, opt, crit)
        step = compile_step(model, opt, crit, backend="eager") if compiled else eager
        for i in range(2):
            step(*batch(i))
        n_params = len(list(model.parameters()))
        before = state_of(model, opt)
        x, y = batch(2)
        y[0, 0] = float("inf")  # an inf target: the loss and every grad are inf/nan
        step(x, y)
        if compiled:
            step.sync_counters()  # the device count joins opt.skipped_steps
        assert opt.skipped_steps == 1
        after = state_of(model, opt)
        n_buffers = len(list(model.buffers()))
        kept = before[:n_params] + before[n_params + n_buffers :]
        now = after[:n_params] + after[n_params + n_buffers :]
        for i, (a, b) in enumerate(zip(kept, now, strict=True)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"state tensor {i} changed")
        runs.append(after)
    for i, (a, b) in enumerate(zip(*runs, strict=True)):
        torch.testing.assert_close(a, b, msg=f"state tensor {i}", **fp32_rounding())


class _TripledWeightGrad(torch.autograd.Function):
    """x @ w.t(), but backward triples the weight's gradient: a rule autograd cannot derive.

    The weight goes in directly, as Float8Linear's does: under torch.func.grad dynamo saw that
    wrapped parameter as not requiring grad and inlined the forward.
    """

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x @ weight.t()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        return grad @ weight, 3 * grad.t() @ x


class _UserModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.randn(8, 8) / 3), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_TripledWeightGrad.apply(x, self.a))


def test_a_user_autograd_function_keeps_its_custom_backward_when_compiled():
    """The torch.func.grad route gave `a` a third of its gradient here, silently."""
    results = []
    for options in ({"compile": False}, {"backend": "eager"}):
        torch.manual_seed(0)
        model = _UserModel()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch._dynamo.reset()
        step = compile_step(model, opt, nn.MSELoss(), **options)
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        step(x, y)
        results.append([p.detach().clone() for p in model.parameters()])
    torch.manual_seed(0)
    model = _UserModel()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    nn.MSELoss()(model(x), y).backward()
    with torch.no_grad():
        expected = [p - 0.1 * p.grad for p in model.parameters()]
    for got in results:
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, **fp32_rounding())


# torch 2.13's inductor honours emulate_precision_casts on the fp8 path: the compiled fp8 step
# then rounds as eager does, step for step. torch 2.11's does not (measured on its CPU wheel: the
# first step's grads differ from eager's by 0.5-9 % in norm, while each stays as far from the
# fp32 grads as the other, 0.170 vs 0.166 for the first weight): there only "not worse than eager"
# holds, and that is what the test asserts.
_INDUCTOR_EMULATES_FP8_CASTS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)


@pytest.mark.slow
def test_inductor_fp8_step_with_emulated_precision_casts_equals_the_eager_step():
    """Inductor keeps fused bf16 intermediates in fp32 (what the fp8 casts then see moves by a
    bf16 ulp, and fp8 rounding turns that into a few % on some grads: a different, not a worse,
    rounding). Its emulate_precision_casts option rounds as eager does: then the runs agree."""
    model, opt, crit = fp8_model("delayed")
    eager_steps(model, opt, crit, range(1))
    eager_first = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    eager_steps(model, opt, crit, range(1, 3))
    reference = state_of(model, opt)
    model, opt, crit = fp8_model("delayed")
    torch._dynamo.reset()
    step = compile_step(model, opt, crit, options={"emulate_precision_casts": True})
    step(*batch(0))
    compiled_first = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    for i in range(1, 3):
        step(*batch(i))
    assert step.compiled
    if _INDUCTOR_EMULATES_FP8_CASTS:
        for i, (a, b) in enumerate(zip(state_of(model, opt), reference, strict=True)):
            torch.testing.assert_close(a, b, msg=f"state tensor {i}", **fp32_rounding())
        return
    # exp_avg after one AdamW step is (1 - beta1) * grad: compare each run's grads to fp32's
    plain = plain_model()
    nn.MSELoss()(plain(batch(0)[0]), batch(0)[1]).backward()
    for p, e, c in zip(plain.parameters(), eager_first, compiled_first, strict=True):
        fp32 = 0.1 * p.grad
        eager_err = float((e - fp32).norm() / fp32.norm())
        compiled_err = float((c - fp32).norm() / fp32.norm())
        # 1.25x + 0.01: the measured spread (the compiled step's error is 0.96-1.2x eager's)
        assert compiled_err <= 1.25 * eager_err + 0.01, (compiled_err, eager_err)


def test_warnings_as_errors_do_not_stop_the_compile_at_torchs_own_deprecation(caplog):
    """Under -W error (or pytest's filterwarnings = error) the DeprecationWarning dynamo itself
    raises while tracing an autograd.Function stopped the compile: eager fallback, whose own
    warning was then an error too. The step compiles again with torch's deprecations ignored."""
    model, opt, crit = fp8_model("dynamic")
    torch._dynamo.reset()
    step = compile_step(model, opt, crit, backend="eager")
    with warnings.catch_warnings(), caplog.at_level("INFO", logger="mixprec"):
        warnings.simplefilter("error")
        for i in range(2):
            step(*batch(i))
    assert step.compiled
    assert "DeprecationWarnings ignored" in caplog.text


FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def test_each_float8_cast_of_the_compiled_step_feeds_one_upcast():
    """In one graph holding forward and backward, a float8 tensor read by two upcasts (the
    forward GEMM's and the backward's) is recomputed by inductor in each: every activation was
    rounded to float8 twice (1.9x the casts of torch.compile(model) on the bench ViT, a 4%
    slower step). The step's ATen graph must give each float8 tensor one reader."""
    graphs = []

    def keep(gm, _example_inputs):
        graphs.append(gm)
        return gm

    from torch._dynamo.backends.common import aot_autograd

    model, opt, crit = fp8_model("dynamic")
    torch._dynamo.reset()
    step = compile_step(model, opt, crit, backend=aot_autograd(fw_compiler=keep))
    step(*batch(0))
    assert step.compiled and len(graphs) == 1
    casts = [
        n for n in graphs[0].graph.nodes if getattr(n.meta.get("val"), "dtype", None) in FLOAT8
    ]
    # per Float8Linear: input and weight in e4m3, the output grad in e5m2
    assert len(casts) == 3 * 2
    for node in casts:
        assert len(node.users) == 1, f"{node.format_node()} is read by {list(node.users)}"
