"""Paddle face: auto_cast levels and op lists, decorate (casting, masters, save_dtype), seed 002."""

from __future__ import annotations

import copy
import importlib
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
import mixprec.paddle as amp

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "paddle_style"
LP, HP = torch.bfloat16, torch.float32
SCALE = 1024.0  # a power of two: scaling and unscaling are exact, so reference loops match bitwise


def probe(lin: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.dtype]:
    """Output dtype of a few ops, each on fp32 inputs (relu and view on a GEMM's output)."""
    h = lin(x)
    return {
        "linear": h.dtype,
        "matmul": (x @ y.T).dtype,
        "add": (x + y).dtype,
        "relu_after_gemm": torch.relu(h).dtype,
        "softmax": torch.softmax(x, -1).dtype,
        "layer_norm": F.layer_norm(x, x.shape[-1:]).dtype,
        "mse": F.mse_loss(x, y).dtype,
        "view_after_gemm": h.view(-1).dtype,
    }


@pytest.fixture
def xy() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    return nn.Linear(8, 8), torch.randn(4, 8), torch.randn(4, 8)


EXPECTED = {
    "O0": dict.fromkeys(
        ["linear", "matmul", "add", "relu_after_gemm", "softmax", "layer_norm", "mse"], HP
    )
    | {"view_after_gemm": HP},
    # GEMMs low, every op that computes in fp32; a view moves data and keeps its input's dtype.
    "OD": {
        "linear": LP,
        "matmul": LP,
        "add": HP,
        "relu_after_gemm": HP,
        "softmax": HP,
        "layer_norm": HP,
        "mse": HP,
        "view_after_gemm": LP,
    },
    # Paddle 3's O2 (use_promote=True): the white list low, an op with an fp32 input fp32.
    "O2": {
        "linear": LP,
        "matmul": LP,
        "add": HP,
        "relu_after_gemm": LP,
        "softmax": HP,
        "layer_norm": HP,
        "mse": HP,
        "view_after_gemm": LP,
    },
    # The seed's O2 (use_promote=False): everything low but the norms.
    "O2_no_promote": {
        "linear": LP,
        "matmul": LP,
        "add": LP,
        "relu_after_gemm": LP,
        "softmax": LP,
        "layer_norm": HP,
        "mse": LP,
        "view_after_gemm": LP,
    },
}


@pytest.mark.parametrize("level", ["O0", "OD", "O2", "O2_no_promote"])
def test_level_op_dtypes(device: str, level, xy):
    promote = not level.endswith("_no_promote")
    with amp.auto_cast(level=level[:2], dtype="bfloat16", use_promote=promote, device_type=device):
        assert probe(*xy) == EXPECTED[level]


def test_o1_runs_paddles_black_list_in_fp32(device: str, xy):
    """Paddle's O1 black list: mean (and losses, norms, softmax) in fp32 where torch.autocast
    would keep a low input low, so the loss is not rounded to the low dtype."""
    lin, x, _ = xy
    with torch.autocast(device, dtype=LP):
        assert lin(x).mean().dtype == LP  # torch.autocast alone
    with amp.auto_cast(level="O1", dtype="bfloat16", device_type=device):
        h = lin(x)
        got = h.mean()
    assert h.dtype == LP and got.dtype == HP
    assert got.item() == h.float().mean().item()  # the same fp32 mean of the same low values


def test_o1_is_torch_autocast(device: str, xy):
    with torch.autocast(device, dtype=LP):
        expected = probe(*xy)
    with amp.auto_cast(level="O1", dtype="bfloat16", device_type=device):
        assert probe(*xy) == expected
    assert expected["linear"] == LP and expected["add"] == HP  # the probe tells lists apart


@pytest.mark.parametrize(
    ("level", "white", "black", "op", "dtype"),
    [
        ("O1", {"elementwise_add"}, None, "add", LP),  # seed 002's custom white list
        ("O1", None, {"linear"}, "linear", HP),
        ("O1", None, ["matmul_v2"], "matmul", HP),  # Paddle's name for matmul
        ("OD", {"elementwise_add"}, None, "add", LP),
        ("OD", None, {"linear"}, "linear", HP),
        ("O2", None, {"softmax"}, "softmax", HP),
        ("O2", None, [F.mse_loss], "mse", HP),  # a torch callable names its op
        ("O2", {"layer_norm"}, None, "layer_norm", LP),
        ("O2", {"elementwise_add"}, None, "add", LP),  # under promote the custom list wins
        ("O1", None, ["pool2d"], "linear", LP),  # Paddle's op vocabulary: pool2d is accepted
    ],
)
def test_custom_lists(level, white, black, op, dtype, xy):
    with amp.auto_cast(
        custom_white_list=white, custom_black_list=black, level=level, dtype="bfloat16"
    ):
        got = probe(*xy)
    assert got[op] == dtype
    # every other op is as the level decides (ops fed by the GEMM follow its output's dtype)
    skip = {op, "relu_after_gemm", "view_after_gemm"} if op == "linear" else {op}
    unlisted = {k: v for k, v in got.items() if k not in skip}
    assert unlisted == {k: v for k, v in EXPECTED.get(level, got).items() if k not in skip}


# Paddle's spellings the core's op lists once took as aliases: the face translates them now
PADDLE_SPELLINGS = {
    "elementwise_add": {"add"},
    "elementwise_sub": {"sub"},
    "elementwise_mul": {"mul"},
    "elementwise_div": {"div"},
    "elementwise_pow": {"pow"},
    "elementwise_max": {"maximum"},
    "elementwise_min": {"minimum"},
    "elementwise_mod": {"remainder"},
    "elementwise_floordiv": {"floor_divide"},
    "matmul_v2": {"matmul", "mm", "bmm"},
    "fc": {"linear"},
    "depthwise_conv2d": {"conv2d"},
    "conv2d_transpose": {"conv_transpose2d"},
    "conv3d_transpose": {"conv_transpose3d"},
    "reduce_sum": {"sum"},
    "reduce_mean": {"mean"},
    "reduce_prod": {"prod"},
    "reduce_max": {"amax"},
    "reduce_min": {"amin"},
    "lookup_table": {"embedding"},
    "lookup_table_v2": {"embedding"},
    "softmax_with_cross_entropy": {"cross_entropy"},
    "cross_entropy2": {"cross_entropy"},
    "sigmoid_cross_entropy_with_logits": {"binary_cross_entropy_with_logits"},
    "cos_sim": {"cosine_similarity"},
    "top_k": {"topk"},
    "top_k_v2": {"topk"},
}


def test_paddle_op_names_are_the_faces_not_the_cores(xy):
    from mixprec.core.autocast import ALIASES, resolve_ops
    from mixprec.paddle.op_names import paddle_ops_to_torch

    for name, torch_ops in PADDLE_SPELLINGS.items():
        assert paddle_ops_to_torch([name]) == torch_ops, name
        assert name not in ALIASES
        with pytest.raises(ValueError, match=f"Unknown op '{name}'"):
            resolve_ops([name])  # mixprec.autocast speaks torch only
    _, x, y = xy
    with amp.auto_cast(custom_black_list={"fc"}, dtype="bfloat16"):  # Paddle's name for Linear
        assert F.linear(x, y).dtype == HP
    with amp.auto_cast(custom_white_list={"fc"}, dtype="bfloat16"):
        assert F.linear(x, y).dtype == LP


def test_enable_false_and_nested_o0_turn_everything_off(xy):
    with amp.auto_cast(enable=False, level="O2", dtype="bfloat16"):
        assert probe(*xy) == EXPECTED["O0"]
    with amp.auto_cast(level="O2", dtype="bfloat16"):
        with amp.auto_cast(level="O0"):
            assert probe(*xy) == EXPECTED["O0"]
        assert probe(*xy) == EXPECTED["O2"]  # leaving the inner context restores O2


def test_level_lists_are_disjoint_and_custom_lists_move_ops():
    for level in amp.LEVELS:
        white, black = amp.level_op_lists(level)
        assert not white & black
    white, black = amp.level_op_lists("OD", custom_white_list=["softmax"])
    assert "softmax" in white and "softmax" not in black
    white, black = amp.level_op_lists("o2", custom_black_list=["fc"])  # Paddle's fc = linear
    assert "linear" in black and "linear" not in white


# ----- decorate -----


class Head(nn.Linear):
    """A Linear subclass, to exclude by type."""


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.ln = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 16)
        self.head = Head(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(self.ln(torch.relu(self.bn(self.fc1(x))))))


def batches(n: int = 3, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(torch.get_default_device()).manual_seed(seed)
    return [(torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)) for _ in range(n)]


def dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    return {n: t.dtype for n, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize(
    ("excluded", "fp32_layers"),
    [
        (None, {"bn", "ln"}),
        (lambda m: m.head, {"bn", "ln", "head"}),
        (lambda m: Head, {"bn", "ln", "head"}),
        (lambda m: [m.fc2, Head], {"bn", "ln", "head", "fc2"}),
    ],
)
def test_decorate_o2_dtypes(excluded, fp32_layers):
    model = Net()
    out = amp.decorate(
        model, level="O2", dtype="bfloat16", excluded_layers=excluded and excluded(model)
    )
    assert out is model
    for name, dtype in dtypes(model).items():
        layer = name.split(".")[0]
        if name.endswith("num_batches_tracked"):
            assert dtype == torch.long
        else:
            assert dtype == (HP if layer in fp32_layers else LP), name
    x = torch.randn(5, 8)
    with amp.auto_cast(level="O2", dtype="bfloat16"):
        assert model(x).dtype == LP


def test_excluded_layer_computes_in_fp32_under_o2():
    model = Net()
    amp.decorate(model, level="O2", dtype="bfloat16", excluded_layers=[model.head])
    h = torch.randn(5, 16).to(LP)
    with amp.auto_cast(level="O2", dtype="bfloat16"):
        got = model.head(h)
    w, b = model.head.weight, model.head.bias
    assert got.dtype == LP  # handed back in the model's dtype
    torch.testing.assert_close(got, F.linear(h.float(), w, b).to(LP), rtol=0, atol=0)
    # the O2 lists would otherwise have run it on rounded weights: the two must differ
    assert not torch.equal(got, F.linear(h, w.to(LP), b.to(LP)))


def test_decorate_o1_changes_nothing_and_says_what_it_ignored(caplog):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = dtypes(model)
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        got = amp.decorate([model], opt, level="O1", save_dtype="float16")
    assert got[0] == [model] and got[1] is opt and dtypes(model) == before
    assert "save_dtype" in caplog.text


def test_decorate_returns_the_structure_given():
    m1, m2 = Net(), Net()
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (m1, m2))
    models, opts = amp.decorate([m1, m2], [o1, o2], level="O2", dtype="bfloat16")
    assert models == [m1, m2] and isinstance(opts, list) and len(opts) == 2
    assert all(
        isinstance(o, amp.MasterWeightOptimizer) and o.optim is i
        for o, i in zip(opts, (o1, o2), strict=True)
    )
    m3 = Net()
    models, opt = amp.decorate((m3,), torch.optim.SGD(m3.parameters(), lr=0.1), "O2", "bfloat16")
    assert models == (m3,) and isinstance(opt, amp.MasterWeightOptimizer)
    m4 = Net()
    plain = torch.optim.SGD(m4.parameters(), lr=0.1)
    model, same = amp.decorate(m4, plain, "O2", "bfloat16", master_weight=False)
    assert model is m4 and same is plain  # no masters: the optimizer steps bf16 params


def test_masters_match_hand_written_fp32_master_loop(device: str):
    """decorate(model, optimizer) + mixprec.GradScaler == fp32 masters written out by hand."""
    base = Net()
    hp_init = {n: p.detach().clone() for n, p in base.named_parameters()}
    ctx = amp.auto_cast(level="O2", dtype="bfloat16", device_type=device)

    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = amp.decorate(model, opt, level="O2", dtype="bfloat16")
    scaler = mixprec.GradScaler(device, init_scale=SCALE)  # the core one: any scaler works

    ref = amp.decorate(
        copy.deepcopy(base), level="O2", dtype="bfloat16"
    )  # same forward, no masters
    ref_params = list(ref.parameters())
    masters = [hp_init[n].clone().requires_grad_(True) for n, _ in ref.named_parameters()]
    ref_opt = torch.optim.SGD(masters, lr=0.05, momentum=0.9)

    for lp, hp in zip(opt.lp_params, opt.hp_masters, strict=True):  # masters: the pre-cast fp32
        name = next(n for n, p in model.named_parameters() if p is lp)
        torch.testing.assert_close(hp, hp_init[name], rtol=0, atol=0)

    for x, y in batches():
        with ctx:
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

        with ctx:
            ref_loss = F.mse_loss(ref(x), y)
        (ref_loss.float() * SCALE).backward()
        with torch.no_grad():
            for p, hp in zip(ref_params, masters, strict=True):
                hp.grad = p.grad.float() * (1.0 / SCALE)
                p.grad = None
            ref_opt.step()
            for p, hp in zip(ref_params, masters, strict=True):
                p.copy_(hp)
        assert torch.equal(loss, ref_loss)

    for p, q in zip(model.parameters(), ref_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    lp_ids = {id(p) for p in opt.lp_params}
    ref_masters = [hp for p, hp in zip(model.parameters(), masters, strict=True) if id(p) in lp_ids]
    assert len(ref_masters) == len(opt.hp_masters) == 6  # fc1, fc2, head: weight and bias
    for hp, want in zip(opt.hp_masters, ref_masters, strict=True):
        torch.testing.assert_close(hp, want, rtol=0, atol=0)


def test_overflow_skips_the_step_bit_for_bit(device: str):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = amp.decorate(model, opt, level="O2", dtype="float16")
    scaler = amp.GradScaler(device=device, init_loss_scaling=SCALE)
    ctx = amp.auto_cast(level="O2", dtype="float16")
    (x, y), *_ = batches(1)
    for poison in (1.0, math.inf):
        before = copy.deepcopy((dict(model.named_parameters()), opt.state_dict()))
        with ctx:
            loss = F.mse_loss(model(x), y) * poison
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert scaler.get_scale() == SCALE / 2
    assert all(hp.grad is None for hp in opt.hp_masters)
    after = (dict(model.named_parameters()), opt.state_dict())  # BN's running stats do move
    for k, v in before[0].items():
        torch.testing.assert_close(after[0][k], v, rtol=0, atol=0)
    for hp, saved in zip(after[1]["master_weights"], before[1]["master_weights"], strict=True):
        torch.testing.assert_close(hp, saved, rtol=0, atol=0)
    momenta = [s["momentum_buffer"] for s in after[1]["state"].values()]
    saved = [s["momentum_buffer"] for s in before[1]["state"].values()]
    assert len(momenta) == len(saved) == 10  # the clean first step made every buffer
    for m, m0 in zip(momenta, saved, strict=True):
        torch.testing.assert_close(m, m0, rtol=0, atol=0)


def test_masters_accumulate_grads_in_fp32():
    base = Net()
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp.decorate(model, opt, level="O2", dtype="bfloat16")
    twin = amp.decorate(copy.deepcopy(base), level="O2", dtype="bfloat16")
    ctx = amp.auto_cast(level="O2", dtype="bfloat16")
    want = [None] * len(opt.lp_params)
    twin_lp = [p for p in twin.parameters() if p.dtype == LP]
    for x, y in batches(2):
        with ctx:
            F.mse_loss(model(x), y).backward()
            F.mse_loss(twin(x), y).backward()
        want = [
            g if w is None else w + g
            for w, g in zip(want, (p.grad.float() for p in twin_lp), strict=True)
        ]
        twin.zero_grad()
    assert all(p.grad is None for p in opt.lp_params)  # moved during backward, not kept in bf16
    for hp, w in zip(opt.hp_masters, want, strict=True):
        torch.testing.assert_close(hp.grad, w, rtol=0, atol=0)
    opt.step()  # no GradScaler: the wrapper alone steps
    opt.clear_grad(set_to_zero=False)  # Paddle's name: frees the grads
    assert all(hp.grad is None for hp in opt.hp_masters)


def test_added_param_group_gets_a_master_and_its_grads():
    model = Net()
    opt = torch.optim.SGD(list(model.fc1.parameters()), lr=0.1)
    model, opt = amp.decorate(model, opt, level="O2", dtype="bfloat16")
    opt.add_param_group({"params": list(model.fc2.parameters())})
    assert len(opt.hp_masters) == 4
    with amp.auto_cast(level="O2", dtype="bfloat16"):
        model(torch.randn(3, 8)).sum().backward()
    assert model.fc2.weight.grad is None and opt.hp_masters[2].grad.dtype == HP


def test_pure_fp16_without_optimizers_needs_the_paddle_grad_scaler(
    device: str, caplog, monkeypatch
):
    """Seed 002's O2: decorate(models) only; the earlier optimizer steps fp16 params directly."""
    monkeypatch.setattr(amp.dygraph, "_warned_no_optimizer", False)

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))  # fp16: tiny shapes
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with caplog.at_level(logging.WARNING, logger="mixprec"):
            return amp.decorate(models=model, level="O2", dtype="float16"), opt

    ctx = amp.auto_cast(level="O2", dtype="float16", device_type=device)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    model, opt = make()
    assert "decorate(models, optimizers)" in caplog.text
    core = mixprec.GradScaler(device, init_scale=SCALE)
    with ctx:
        loss = F.mse_loss(model(x), y)
    core.scale(loss).backward()
    with pytest.raises(ValueError, match="FP16 gradients"):
        core.step(opt)  # torch's rule, kept by the core scaler

    model, opt = make()
    ref, ref_opt = make()
    caplog.clear()
    scaler = amp.GradScaler(device=device, init_loss_scaling=SCALE)
    for _ in range(2):
        with ctx:
            loss = F.mse_loss(model(x), y)
            ref_loss = F.mse_loss(ref(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        (ref_loss.float() * SCALE).backward()
        with torch.no_grad():
            for p in ref.parameters():  # the unscale kernel: fp32 math, one rounding to fp16
                p.grad = (p.grad.float() * (1.0 / SCALE)).half()
        ref_opt.step()
        ref_opt.zero_grad()
    assert caplog.text == ""  # the warning is logged once per process
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.dtype == torch.float16
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_minimize_is_step_then_update(device: str):
    ctx = amp.auto_cast(level="O2", dtype="float16")
    (x, y), *_ = batches(1)
    runs = []
    for use_minimize in (True, False):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.decorate(model, opt, level="O2", dtype="float16")
        scaler = amp.GradScaler(device=device, init_loss_scaling=SCALE, incr_every_n_steps=1)
        with ctx:
            scaled = scaler.scale(F.mse_loss(model(x), y))
        scaled.backward()
        if use_minimize:
            scaler.minimize(opt, scaled)
        else:
            scaler.step(opt)
            scaler.update()
        runs.append((scaler.get_scale(), model.state_dict()))
    assert runs[0][0] == runs[1][0] == 2 * SCALE
    for k, v in runs[0][1].items():
        torch.testing.assert_close(v, runs[1][1][k], rtol=0, atol=0)


def test_save_dtype_state_dict_and_reload():
    model = amp.decorate(Net(), level="O2", dtype="bfloat16", save_dtype="float32")
    state = model.state_dict()
    for name, value in state.items():
        assert value.dtype == (torch.long if name.endswith("num_batches_tracked") else HP), name
    assert model.fc1.weight.dtype == LP  # the model itself keeps its dtype
    fresh = Net()
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh.fc1.weight, model.fc1.weight.float(), rtol=0, atol=0)
    model.load_state_dict(fresh.state_dict())
    assert model.fc1.weight.dtype == LP
    parent = nn.Sequential(model)  # the hook casts only its own keys, under any prefix
    assert parent.state_dict()["0.fc2.bias"].dtype == HP
    half = amp.decorate(Net(), level="O2", dtype="bfloat16", save_dtype="float16")
    assert half.state_dict()["ln.weight"].dtype == torch.float16


def test_loading_a_model_state_dict_loads_the_fp32_masters():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.decorate(model, opt, level="O2", dtype="bfloat16", save_dtype="float32")
    target = {
        k: (torch.randn_like(v) if v.is_floating_point() else v)
        for k, v in model.state_dict().items()
    }
    nn.Sequential(model).load_state_dict({"0." + k: v for k, v in target.items()})
    names = {id(p): n for n, p in model.named_parameters()}
    for lp, hp in zip(opt.lp_params, opt.hp_masters, strict=True):
        want = target[names[id(lp)]]
        torch.testing.assert_close(hp, want, rtol=0, atol=0)  # full fp32, not the bf16 rounding
        torch.testing.assert_close(lp, want.to(LP), rtol=0, atol=0)


def test_o2_trains_with_norm_and_excluded_layers(device: str):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp.decorate(model, opt, "O2", "float16", excluded_layers=Head)
    scaler = amp.GradScaler(device=device, init_loss_scaling=SCALE)
    start = copy.deepcopy(model.state_dict())
    with amp.auto_cast(level="O2", dtype="float16"):
        for x, y in batches():
            loss = F.mse_loss(model(x), y)
            scaler.scale(loss).backward()  # backward inside the context works too
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert math.isfinite(loss.item()) and scaler.get_scale() == SCALE
    for k in ("fc1.weight", "bn.running_mean", "ln.weight", "head.weight"):
        assert model.state_dict()[k].dtype == start[k].dtype and not torch.equal(
            model.state_dict()[k], start[k]
        ), k


# ----- bad input -----


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: amp.auto_cast(level="O3"), ValueError, ["'O3'", "'O2'", "'OD'"]),
        (lambda: amp.auto_cast(dtype="bfloat"), ValueError, ["'bfloat'", "'bfloat16'"]),
        (lambda: amp.auto_cast(dtype="float64"), ValueError, ["'float64'", "'float16'"]),
        (lambda: amp.auto_cast(enable="yes"), TypeError, ["'yes'"]),
        (
            lambda: amp.auto_cast(custom_white_list={"elementwise_addd"}),
            ValueError,
            ["elementwise_add"],
        ),
        (
            lambda: amp.auto_cast(custom_white_list={"add"}, custom_black_list={"elementwise_add"}),
            ValueError,
            ["'add'"],
        ),
        (lambda: amp.decorate(Net(), level="OD"), ValueError, ["'OD'", "'O1'", "'O2'"]),
        (lambda: amp.decorate(Net(), level="O2", dtype="fp8"), ValueError, ["'fp8'", "'bfloat16'"]),
        (lambda: amp.decorate(Net(), save_dtype="int8"), ValueError, ["'int8'", "'float32'"]),
        (lambda: amp.decorate("model"), TypeError, ["'model'", "Module"]),
        (lambda: amp.decorate(Net(), optimizers="sgd"), TypeError, ["'sgd'", "Optimizer"]),
        (
            lambda: amp.decorate(Net(), level="O2", excluded_layers=3),
            TypeError,
            ["3", "nn.Module subclass"],
        ),
        (
            lambda: amp.decorate(Net(), level="O2", excluded_layers=nn.Linear(2, 2)),
            ValueError,
            ["not a submodule"],
        ),
        (
            lambda: amp.decorate(Net(), level="O2", master_grad=True),
            ValueError,
            ["master_grad=True", "optimizers=None"],
        ),
        (lambda: amp.decorate(Net(), level="O2", master_weight="yes"), TypeError, ["'yes'"]),
        (lambda: amp.decorate(nn.DataParallel(Net()), level="O2"), RuntimeError, ["DataParallel"]),
    ],
)
def test_bad_input_names_the_value_and_the_choices(call, error, words):
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value)


# ----- seed 002's loops, as the example scripts run them -----

TINY = ["--input-size", "16", "--output-size", "16", "--batch-size", "8", "--num-batches", "4"]
TINY += ["--depth", "3", "--device", "cpu"]


@pytest.fixture(scope="module")
def examples():
    sys.path.insert(0, str(EXAMPLES))
    try:
        names = ["simple_net", "train_fp32", "train_o1", "train_o2", "train_accumulate"]
        yield {name: importlib.import_module(name) for name in names}
    finally:
        sys.path.remove(str(EXAMPLES))


def test_seed_loops_run(examples, capsys):
    fp32 = examples["train_fp32"].main(TINY)
    o1 = examples["train_o1"].main(TINY)
    o2 = examples["train_o2"].main(TINY)
    o2_masters = examples["train_o2"].main([*TINY, "--master-weight"])
    out = capsys.readouterr().out
    for mode in ("FP32", "AMP-O1", "AMP-O2"):
        assert f"Time consuming using {mode} mode:" in out
    assert all(math.isfinite(r.loss) and r.sec_per_batch > 0 for r in (fp32, o1, o2, o2_masters))
    # bf16 keeps 8 significant bits: a few layers of rounding move the loss by well under 2%.
    assert o1.loss == pytest.approx(fp32.loss, rel=2e-2)
    assert o2_masters.loss == pytest.approx(fp32.loss, rel=2e-2)
    assert isinstance(o2_masters.optimizer, amp.MasterWeightOptimizer)
    assert all(p.dtype == LP for p in o2.model.parameters())


def test_seed_loops_run_in_fp16(examples):
    for name in ("train_o1", "train_o2"):
        result = examples[name].main([*TINY, "--dtype", "float16", "--epochs", "1"])
        assert math.isfinite(result.loss)


def test_accumulation_matches_reference(device: str, examples):
    """Updates every 2 batches (5 batches: the last one's grads stay pending) == by hand."""
    # float16: after a bfloat16 auto_cast Paddle's GradScaler switches itself off (no scaling)
    argv = [*TINY, "--num-batches", "5", "--epochs", "1", "--dtype", "float16", "--accumulate", "2"]
    got = examples["train_accumulate"].main(argv)
    sn = examples["simple_net"]
    model, opt, loader = sn.build(sn.build_parser(None).parse_args(argv[:-2]))
    for i, (x, y) in enumerate(loader):
        with torch.autocast(device, dtype=torch.float16):  # O1 without custom lists
            loss = F.mse_loss(model(x), y)
        (loss * SCALE).backward()
        if (i + 1) % 2 == 0:
            for p in model.parameters():
                p.grad.mul_(1.0 / SCALE)
            opt.step()
            opt.zero_grad()
    for p, q in zip(got.model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)  # the pending 5th batch


@pytest.mark.host_only
def test_example_script_runs_from_the_command_line():
    cmd = [sys.executable, str(EXAMPLES / "train_o2.py"), *TINY, "--epochs", "1", "--master-weight"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "loss:" in done.stdout and "AMP-O2 mode" in done.stdout
