"""mixprec.core.autocast: custom op lists over torch.autocast, fp32 and low-precision regions."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.core.autocast import (
    ALIASES,
    COMMON_OPS,
    autocast,
    current_op_lists,
    default_device_type,
    fp16_guard,
    fp32,
    fp32_region,
    is_fp32_module,
    low_precision,
    low_precision_region,
    resolve_ops,
)
from mixprec.core.policy import preset

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")


def bf16_on_device() -> dict:
    return dict(dtype=torch.bfloat16, device_type=torch.get_default_device().type)


def exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # The contract: a listed op runs the very kernel of the reference, on the same cast inputs.
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def mode_stack_depth() -> int:
    return len(torch.overrides._get_current_function_mode_stack())


# --- white list: ops forced to the low dtype ------------------------------------------------


@pytest.mark.parametrize(
    "op",
    ["softmax", torch.softmax, F.softmax, torch.Tensor.softmax],
    ids=["name", "torch", "F", "Tensor"],
)
def test_white_listed_softmax_runs_in_bf16_and_equals_manual_cast(device: str, op: object) -> None:
    x = torch.randn(4, 16)
    with torch.autocast(device, dtype=torch.bfloat16):
        assert torch.softmax(x, -1).dtype == torch.float32  # torch's default, so the list acts
    with autocast(custom_white_list=[op], **bf16_on_device()):
        outs = [torch.softmax(x, -1), F.softmax(x, dim=-1), x.softmax(-1), nn.Softmax(-1)(x)]
    for out in outs:
        exact(out, torch.softmax(x.bfloat16(), -1))


def test_white_listed_add_covers_every_spelling() -> None:
    x, y = torch.randn(3, 5), torch.randn(3, 5)
    ref = x.bfloat16() + y.bfloat16()
    with autocast(custom_white_list=["add"], **bf16_on_device()):
        for out in (x + y, torch.add(x, y), x.add(y), y.__radd__(x)):
            exact(out, ref)
        exact(1.5 + x, 1.5 + x.bfloat16())


def test_white_list_casts_tensors_inside_lists_and_leaves_fp64_and_ints() -> None:
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    with autocast(custom_white_list=["cat", "softmax", "add"], **bf16_on_device()):
        exact(torch.cat([a, b]), torch.cat([a.bfloat16(), b.bfloat16()]))
        assert torch.softmax(a.double(), -1).dtype == torch.float64  # fp64 is never cast
        assert (torch.arange(3) + torch.arange(3)).dtype == torch.int64


def test_white_list_in_float16_on_tiny_tensors(device: str) -> None:
    x = torch.randn(2, 4)  # fp16 kernels are slow on this CPU: tiny shapes only
    with autocast(dtype=torch.float16, custom_white_list=["softmax"], device_type=device):
        out = torch.softmax(x, -1)
    exact(out, torch.softmax(x.half(), -1))


# --- black list: ops forced to fp32 ---------------------------------------------------------


@pytest.mark.parametrize("op", ["linear", F.linear], ids=["name", "F"])
def test_black_listed_linear_runs_in_fp32_and_casts_low_inputs_up(device: str, op: object) -> None:
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    with torch.autocast(device, dtype=torch.bfloat16):
        assert F.linear(x, w, b).dtype == torch.bfloat16  # torch's default, so the list acts
    with autocast(custom_black_list=[op], **bf16_on_device()):
        out = F.linear(x, w, b)
        from_low = F.linear(x.bfloat16(), w, b)
        layer_out = nn.Linear(8, 6)(x)
    exact(out, F.linear(x, w, b))
    exact(from_low, F.linear(x.bfloat16().float(), w, b))
    assert layer_out.dtype == torch.float32


def test_black_listed_matmul_covers_operator_and_method() -> None:
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with autocast(custom_black_list=[torch.matmul], **bf16_on_device()):
        outs = [a @ b, torch.matmul(a, b), a.matmul(b), a.bfloat16() @ b]
        assert torch.mm(a, b).dtype == torch.bfloat16  # mm is another op: torch's lists decide
    for out in outs:
        exact(out, a.bfloat16().float() @ b if out is outs[-1] else a @ b)


def test_unlisted_ops_follow_torch_autocast(device: str) -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    ops = {
        "mm": lambda: torch.mm(x, w),
        "layer_norm": lambda: F.layer_norm(x, (8,)),
        "gelu": lambda: F.gelu(x),
    }
    with torch.autocast(device, dtype=torch.bfloat16):
        expected = {name: fn() for name, fn in ops.items()}
    with autocast(custom_white_list=["softmax"], custom_black_list=["linear"], **bf16_on_device()):
        for name, fn in ops.items():
            exact(fn(), expected[name])


def test_enabled_false_turns_autocast_and_lists_off(device: str) -> None:
    x = torch.randn(3, 4)
    with autocast(custom_white_list=["softmax"], enabled=False, **bf16_on_device()):
        assert not torch.is_autocast_enabled(device)
        assert torch.softmax(x, -1).dtype == torch.float32
        assert (x @ x.T).dtype == torch.float32
        assert current_op_lists() == (frozenset(), frozenset())


# --- names: validation, aliases, normalisation ----------------------------------------------


def test_aliases_and_callables_normalise_to_plain_names() -> None:
    names = ["add", "matmul", "multiply", "subtract", "sum", "linear", "clip"]
    assert resolve_ops(names) == {"add", "matmul", "mul", "sub", "sum", "linear", "clamp"}
    assert resolve_ops([torch.add, torch.Tensor.add, torch.Tensor.__radd__, "__add__"]) == {"add"}
    assert resolve_ops([F.layer_norm, torch.layer_norm, torch.Tensor.softmax]) == {
        "layer_norm",
        "softmax",
    }
    assert resolve_ops(["mul"]) == {"mul"}  # torch's elementwise mul, not Paddle's legacy GEMM
    # a peer's op names are its face's to translate (tests/test_paddle.py): the core knows none
    with pytest.raises(ValueError, match="Unknown op 'elementwise_add'"):
        resolve_ops(["elementwise_add"])
    assert resolve_ops(None) == frozenset()


def test_every_documented_name_resolves() -> None:
    for name in (*COMMON_OPS, *ALIASES):
        assert resolve_ops([name]), name


def test_a_synonym_acts_like_the_torch_name() -> None:
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    with autocast(custom_white_list={"add"}, **bf16_on_device()):
        exact(x + y, x.bfloat16() + y.bfloat16())
    with autocast(custom_white_list=["subtract"], **bf16_on_device()):
        exact(x - y, x.bfloat16() - y.bfloat16())  # synonyms share one op: sub and subtract


@pytest.mark.parametrize(
    ("bad", "needles"),
    [
        ("softmx", ["'softmx'", "Did you mean 'softmax'", "Valid:"]),
        ("substract", ["'substract'", "'subtract'"]),
        ("LayerNorm", ["'LayerNorm'", "'layer_norm'"]),
        (nn.Softmax, ["module class", "'softmax'"]),
        ("add_", ["In-place", "'add_'", "List 'add'"]),
        ("__iadd__", ["In-place", "List 'add'"]),
        (torch.Tensor.mul_, ["In-place", "List 'mul'"]),
        (lambda t: t, ["not a public torch op"]),
    ],
    ids=[
        "typo",
        "synonym-typo",
        "module-name",
        "module-class",
        "inplace",
        "iadd",
        "mul_",
        "lambda",
    ],
)
def test_bad_op_names_raise_with_the_value_and_suggestions(bad: object, needles: list) -> None:
    with pytest.raises(ValueError) as info:
        resolve_ops([bad])
    for needle in needles:
        assert needle in str(info.value)


def test_bad_list_types_and_overlaps_raise() -> None:
    with pytest.raises(TypeError, match=r"\['softmax'\]"):
        resolve_ops("softmax")
    with pytest.raises(TypeError, match="got 3"):
        resolve_ops([3])
    with pytest.raises(ValueError, match=r"\['add'\].*both"):
        autocast(custom_white_list=["add"], custom_black_list=[torch.add])


def test_bad_autocast_arguments_raise() -> None:
    with pytest.raises(ValueError, match="float32"):
        autocast(dtype=torch.float32)
    with pytest.raises(ValueError, match="'cdua'.*Did you mean 'cuda'"):
        autocast(device_type="cdua")
    with pytest.raises(TypeError, match="enabled"):
        autocast(enabled=1)  # type: ignore[arg-type]


def test_device_type_defaults_to_cuda_if_available_else_cpu() -> None:
    assert autocast().device_type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert default_device_type() == autocast().device_type
    assert autocast(dtype="bf16").dtype == torch.bfloat16


def test_policy_lists_feed_autocast(device: str) -> None:
    white = resolve_ops(["add", "softmax"])
    policy = preset("bf16")
    ctx = autocast(dtype=policy.compute_dtype, custom_white_list=white, device_type=device)
    x = torch.randn(2, 3)
    with ctx:
        exact(torch.softmax(x, -1), torch.softmax(x.bfloat16(), -1))


# --- nesting and state ------------------------------------------------------------------------


def test_inner_lists_override_outer_and_exit_restores(device: str) -> None:
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    depth = mode_stack_depth()
    with autocast(custom_white_list=["softmax"], custom_black_list=["matmul"], **bf16_on_device()):
        assert torch.softmax(a, -1).dtype == torch.bfloat16
        assert (a @ b).dtype == torch.float32
        with autocast(
            custom_white_list=["matmul"], custom_black_list=["softmax"], **bf16_on_device()
        ):
            assert torch.softmax(a, -1).dtype == torch.float32
            assert (a @ b).dtype == torch.bfloat16
            assert current_op_lists() == ({"matmul"}, {"softmax"})
        with autocast(
            custom_white_list=["add"], **bf16_on_device()
        ):  # extends: outer lists still hold
            assert current_op_lists() == ({"softmax", "add"}, {"matmul"})
            assert (a @ b).dtype == torch.float32
        assert torch.softmax(a, -1).dtype == torch.bfloat16
        assert (a @ b).dtype == torch.float32
        assert current_op_lists() == ({"softmax"}, {"matmul"})
    assert not torch.is_autocast_enabled(device)
    assert mode_stack_depth() == depth
    assert current_op_lists() == (frozenset(), frozenset())
    assert torch.softmax(a, -1).dtype == torch.float32


def test_inner_dtype_applies_to_its_white_list(device: str) -> None:
    x = torch.randn(2, 4)
    with autocast(custom_white_list=["softmax"], **bf16_on_device()):
        with autocast(dtype=torch.float16, device_type=device):
            exact(torch.softmax(x, -1), torch.softmax(x.half(), -1))
        assert torch.softmax(x, -1).dtype == torch.bfloat16


def test_exception_inside_a_region_restores_state(device: str) -> None:
    depth = mode_stack_depth()
    ctx = autocast(custom_white_list=["softmax"], **bf16_on_device())
    with pytest.raises(RuntimeError, match="boom"), ctx, fp32_region():
        raise RuntimeError("boom")
    assert not torch.is_autocast_enabled(device)
    assert mode_stack_depth() == depth
    with ctx, ctx:  # one object may be entered again, and nested
        assert torch.softmax(torch.randn(2, 2), -1).dtype == torch.bfloat16
    assert mode_stack_depth() == depth


def test_lists_are_per_thread() -> None:
    seen: list[torch.dtype] = []
    x = torch.randn(2, 3)
    with autocast(custom_white_list=["softmax"], **bf16_on_device()):
        worker = threading.Thread(target=lambda: seen.append(torch.softmax(x, -1).dtype))
        worker.start()
        worker.join()
        assert torch.softmax(x, -1).dtype == torch.bfloat16
    assert seen == [torch.float32]


# --- fp32 and low-precision regions -------------------------------------------------------------


def test_fp32_region_turns_autocast_and_lists_off(device: str) -> None:
    a = torch.randn(4, 4)
    with autocast(custom_white_list=["softmax"], **bf16_on_device()):
        with fp32_region():
            assert not torch.is_autocast_enabled(device)
            assert (a @ a).dtype == torch.float32
            assert torch.softmax(a, -1).dtype == torch.float32
            assert (a.bfloat16() @ a.bfloat16()).dtype == torch.bfloat16  # not cast up: documented
        assert (a @ a).dtype == torch.bfloat16


def test_low_precision_region_inherits_the_enclosing_dtype_and_lists() -> None:
    a, w = torch.randn(4, 4), torch.randn(4, 4)
    with autocast(custom_white_list=["softmax"], custom_black_list=["linear"], **bf16_on_device()):
        with fp32_region(), low_precision_region():
            assert (a @ w).dtype == torch.bfloat16
            exact(torch.softmax(a, -1), torch.softmax(a.bfloat16(), -1))
            assert F.linear(a, w).dtype == torch.float32
        with fp32_region(), low_precision_region(dtype=torch.float16):
            assert (a[:2, :2] @ w[:2, :2]).dtype == torch.float16


def test_low_precision_region_alone_is_float16_and_fp16_guard_is_it(device: str) -> None:
    a = torch.randn(2, 2)
    assert fp16_guard is low_precision_region
    with fp16_guard(device_type=device):
        assert (a @ a).dtype == torch.float16
    assert not torch.is_autocast_enabled(device)


# --- decorators ----------------------------------------------------------------------------------


def test_fp32_decorator_on_a_function_casts_low_args_up(device: str) -> None:
    @fp32
    def body(a: torch.Tensor, pair: list, *, k: torch.Tensor, d: torch.Tensor) -> tuple:
        assert not torch.is_autocast_enabled(device)
        return a.dtype, [t.dtype for t in pair], k.dtype, d.dtype, (a @ a).dtype

    x = torch.randn(2, 2)
    with autocast(custom_white_list=["matmul"], **bf16_on_device()):
        got = body(x.bfloat16(), [x.half(), torch.arange(2)], k=x, d=x.double())
    f32 = torch.float32
    assert got == (f32, [f32, torch.int64], f32, torch.float64, f32)
    assert body.__name__ == "body"


def test_fp32_decorator_on_a_module_class_and_instance() -> None:
    @fp32
    class FP32Norm(nn.LayerNorm):
        pass

    x = torch.randn(3, 8)
    norm, lin = FP32Norm(8), fp32(nn.Linear(8, 8))
    plain = nn.Linear(8, 8)
    with autocast(**bf16_on_device()):
        assert norm(x.bfloat16()).dtype == torch.float32
        assert lin(x.bfloat16()).dtype == torch.float32
        assert copy.deepcopy(lin)(x.bfloat16()).dtype == torch.float32
        assert plain(x).dtype == torch.bfloat16  # only the decorated instance changes
        out = lin(x)
    exact(out, F.linear(x, lin.weight, lin.bias))
    assert is_fp32_module(norm) and is_fp32_module(lin) and not is_fp32_module(plain)


def test_decorated_module_that_raises_restores_state(device: str) -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    boom = fp32(Boom())
    with autocast(**bf16_on_device()):
        with pytest.raises(RuntimeError, match="boom"):
            boom(torch.randn(2))
        assert torch.is_autocast_enabled(device)
    assert not torch.is_autocast_enabled(device)


def test_low_precision_decorator_bare_and_with_dtype() -> None:
    a = torch.randn(2, 2)

    @low_precision
    def enclosing(t: torch.Tensor) -> torch.dtype:
        return (t @ t).dtype

    @low_precision(dtype="bfloat16")
    def bf16(t: torch.Tensor) -> torch.dtype:
        return (t @ t).dtype

    assert bf16(a) == torch.bfloat16
    with autocast(**bf16_on_device()), fp32_region():
        assert enclosing(a) == torch.bfloat16
    lp_linear = low_precision(nn.Linear(2, 2), dtype=torch.bfloat16)
    assert lp_linear(a).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="keyword"):
        low_precision(torch.bfloat16)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="decorate"):
        fp32(42)


def test_autocast_as_a_decorator() -> None:
    x = torch.randn(2, 3)

    @autocast(custom_white_list=["softmax"], **bf16_on_device())
    def probs(t: torch.Tensor) -> torch.Tensor:
        return torch.softmax(t, -1)

    exact(probs(x), torch.softmax(x.bfloat16(), -1))
    assert torch.softmax(x, -1).dtype == torch.float32
    module = autocast(custom_black_list=["linear"], **bf16_on_device())(nn.Linear(3, 3))
    with autocast(**bf16_on_device()):
        assert module(x).dtype == torch.float32


# --- autograd --------------------------------------------------------------------------------------


def make_block() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_flows_and_grads_have_the_param_dtype(param_dtype: torch.dtype) -> None:
    model = make_block().to(param_dtype)
    x = torch.randn(5, 8, dtype=param_dtype)
    # layer_norm forced to fp32 casts bf16 params up inside the op; autograd casts grads back.
    with autocast(
        custom_white_list=["softmax", "add"], custom_black_list=["layer_norm"], **bf16_on_device()
    ):
        out = torch.softmax(model(x), -1) + 1
        assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()  # outside the region, as torch.autocast advises
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, name
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_black_listed_linear_gives_the_fp32_gradient_exactly() -> None:
    lin = nn.Linear(8, 4)
    ref = copy.deepcopy(lin)
    x = torch.randn(6, 8)
    with autocast(custom_black_list=["linear"], **bf16_on_device()):
        loss = lin(x).square().sum()
    loss.backward()  # backward inside the region would run its GEMMs under torch's autocast
    ref(x).square().sum().backward()
    exact(lin.weight.grad, ref.weight.grad)
    exact(lin.bias.grad, ref.bias.grad)


# --- torch.compile ---------------------------------------------------------------------------------


def test_compiled_function_matches_eager_under_op_lists() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(3, 8)

    def step(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = model(t)
        return torch.softmax(h, -1) + 1, h @ h.T, F.layer_norm(h, (4,))

    lists = dict(
        custom_white_list=["softmax", "add"],
        custom_black_list=["linear", "matmul"],
        **bf16_on_device(),
    )
    with autocast(**lists):
        eager = step(x)
        compiled = torch.compile(step, fullgraph=True)(x)  # fullgraph: the mode traces, no break
    assert [t.dtype for t in compiled] == [t.dtype for t in eager]
    assert [t.dtype for t in eager] == [torch.bfloat16, torch.float32, torch.float32]
    for c, e in zip(compiled, eager, strict=True):
        # inductor fuses softmax+add and rounds to bf16 once instead of twice: <= 2 bf16 ulps.
        torch.testing.assert_close(c, e, rtol=2 * 2**-7, atol=0)


def test_op_lists_match_a_callable_by_its_op_name():
    """The op-list mode looks an op up by name (dynamo can trace that): the name of every
    callable of an op must be that op, or a listed op would miss one of its spellings."""
    from mixprec.core.autocast import _op_name, _op_table

    for name, fns in _op_table().items():
        for fn in fns:
            assert _op_name(fn) == name, (fn, name)
