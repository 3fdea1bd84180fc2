"""mixprec.paddle.static against facts recorded from PaddlePaddle 3.3.1 (CPU): fetch shapes,
decorate's two overloads and their defaults, the op lists, the loss-scale rule.

The facts are in tests/data/paddle_331_facts.json (see tests/data/record_paddle_331_facts.py).
Steps compile with backend="eager", as in test_paddle_static.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from mixprec import paddle as amp
from mixprec.paddle import op_names, static

pytestmark = pytest.mark.usefixtures("paddle_static_mode")  # conftest

FACTS = json.loads((Path(__file__).parent / "data" / "paddle_331_facts.json").read_text())
STATIC = FACTS["static"]


def record(width: int = 4, batch: int = 3):
    torch.manual_seed(0)
    model = nn.Linear(width, 2)
    x = static.data(name="x", shape=[batch, width], dtype="float32")
    y = static.data(name="y", shape=[batch, 2], dtype="float32")
    loss = ((model(x) - y) ** 2).mean()
    return model, loss


def feed(bad: bool = False, width: int = 4, batch: int = 3) -> dict[str, np.ndarray]:
    x = np.ones((batch, width), np.float32)
    if bad:
        x[0, 0] = np.inf
    return {"x": x, "y": np.zeros((batch, 2), np.float32)}


def test_a_mean_loss_is_fetched_0d_and_float_works() -> None:
    model, loss = record()
    torch.optim.SGD(model.parameters(), lr=0.1).minimize(loss)
    exe = static.Executor(static.CPUPlace())
    exe.run(static.default_startup_program())
    (got,) = exe.run(feed=feed(), fetch_list=[loss])
    assert list(got.shape) == STATIC["fetch"]["loss_shape"] == []
    assert type(got).__name__ == STATIC["fetch"]["loss_type"]
    assert str(got.dtype) == STATIC["fetch"]["loss_dtype"]
    assert float(got) > 0  # numpy 2.4 refuses float() of a shape-(1,) array


def settings(opt: static.amp.OptimizerWithMixedPrecision) -> dict[str, object]:
    """The recorder's attribute names, read off mixprec's decorated optimizer."""
    scaler, cfg = opt.scaler, opt.cfg
    out = {
        "_init_loss_scaling": scaler.get_init_loss_scaling(),
        "_use_dynamic_loss_scaling": scaler.is_use_dynamic_loss_scaling(),
        "_use_fp16_guard": cfg.guard,
        "_amp_level": cfg.level,
        "_use_pure_fp16": cfg.pure,
    }
    if scaler.is_use_dynamic_loss_scaling():
        out.update(
            _incr_every_n_steps=scaler.get_incr_every_n_steps(),
            _decr_every_n_nan_or_inf=scaler.get_decr_every_n_nan_or_inf(),
            _incr_ratio=scaler.get_incr_ratio(),
            _decr_ratio=scaler.get_decr_ratio(),
        )
    return out


def expected(name: str) -> dict[str, object]:
    return {k: v for k, v in STATIC[name].items() if v != "<absent>" and k in KEYS}


KEYS = (
    "_init_loss_scaling",
    "_use_dynamic_loss_scaling",
    "_use_fp16_guard",
    "_amp_level",
    "_use_pure_fp16",
    "_incr_every_n_steps",
    "_decr_every_n_nan_or_inf",
    "_incr_ratio",
    "_decr_ratio",
)


@pytest.mark.parametrize(
    "fact, call",
    [
        ("decorate_plain", lambda sgd: static.amp.decorate(sgd)),
        (
            "decorate_seed_o1_kwargs",
            lambda sgd: static.amp.decorate(
                optimizer=sgd,
                amp_lists=static.amp.CustomOpLists(custom_black_list=["pool2d"]),
                init_loss_scaling=128.0,
                use_dynamic_loss_scaling=True,
            ),
        ),
        ("decorate_pure", lambda sgd: static.amp.decorate(sgd, use_pure_fp16=True)),
        (
            "decorate_pure_guard_false",
            lambda sgd: static.amp.decorate(sgd, use_pure_fp16=True, use_fp16_guard=False),
        ),
        ("decorate_third_positional_float", lambda sgd: static.amp.decorate(sgd, None, 1024.0)),
        ("decorate_level_o2", lambda sgd: static.amp.decorate(sgd, level="O2")),
        (
            "decorate_bf16_dynamic_default",
            lambda sgd: static.amp.decorate(sgd, level="O2", dtype="bfloat16"),
        ),
        (
            "decorate_old_pure_fp16_guard_none",
            lambda sgd: static.amp.decorate(sgd, use_pure_fp16=False),
        ),
    ],
)
def test_decorate_picks_paddles_overload_with_its_defaults(fact, call) -> None:
    sgd = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    assert settings(call(sgd)) == expected(fact)


def test_decorate_refuses_keywords_of_both_overloads() -> None:
    sgd = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(TypeError, match="no overload takes them all"):
        static.amp.decorate(sgd, use_pure_fp16=True, level="O2")
    with pytest.raises(ValueError, match="master_weight=False"):
        static.amp.decorate(sgd, level="O2", master_weight=False)
    with pytest.raises(ValueError, match="'O0'"):
        static.amp.decorate(sgd, level="O0")


def test_amp_lists_defaults_and_custom_moves_are_paddles() -> None:
    lists = static.amp.AutoMixedPrecisionLists()
    default = STATIC["amp_lists_default"]
    assert sorted(lists.white_list) == default["white"]
    assert sorted(lists.black_list) == default["black"]
    assert sorted(lists.gray_list) == default["gray"]
    assert static.amp.CustomOpLists is static.amp.AutoMixedPrecisionLists
    assert STATIC["CustomOpLists_is_AutoMixedPrecisionLists"]
    moved = static.amp.CustomOpLists(custom_black_list=["pool2d"], custom_white_list=["softmax"])
    fact = STATIC["custom_lists_moved"]
    assert ("pool2d" in moved.black_list) is fact["pool2d_in_black"] is True
    assert ("softmax" in moved.white_list) is fact["softmax_in_white"] is True
    assert ("softmax" in moved.black_list) is fact["softmax_in_black"] is False
    assert {"max_pool2d", "avg_pool2d"} <= moved.hp_ops and "softmax" in moved.lp_ops
    assert "overlaps" in STATIC["custom_overlap_error"]
    with pytest.raises(ValueError, match="overlaps"):
        static.amp.CustomOpLists(custom_white_list=["exp"], custom_black_list=["exp"])


def test_every_paddle_list_name_maps_to_torch_ops_or_is_refused_by_name() -> None:
    default = STATIC["amp_lists_default"]
    names = sorted(set(default["white"]) | set(default["black"]) | set(default["gray"]))
    mapped = refused = 0
    for name in names:
        try:
            lists = static.amp.CustomOpLists(custom_black_list=[name])
        except ValueError as err:
            assert repr(name) in str(err) and name in op_names.REFUSED, name
            refused += 1
        else:
            # 'mul' keeps torch's (elementwise) meaning in a user's list: PADDLE_MEANING
            torch_ops = {name} if name in op_names.PADDLE_MEANING else op_names.TO_TORCH[name]
            assert lists.custom_hp_ops == set(torch_ops), name
            mapped += 1
    assert mapped + refused == len(names) and mapped > refused > 0


def test_one_scale_rule_matches_paddles_static_kernel() -> None:
    """update_loss_scaling_ (Paddle's static kernel), recorded step by step, against the
    GradScaler's _update_scale_: the rule the static face's compiled step runs."""
    for case, fact in STATIC["update_loss_scaling"].items():
        scaler = amp.GradScaler(
            device="cpu",
            init_loss_scaling=fact["init"],
            incr_every_n_steps=fact["incr_every_n_steps"],
            decr_every_n_nan_or_inf=fact["decr_every_n_nan_or_inf"],
            incr_ratio=fact["incr_ratio"],
            decr_ratio=fact["decr_ratio"],
        )
        scaler.scale(torch.ones(()))  # creates the state tensors
        got = []
        for overflow in fact["pattern"]:
            scaler._update_scale_(torch.tensor(float(overflow)))
            state = scaler.state_dict()
            got.append([state["scale"], state["incr_count"], state["decr_count"]])
        # the kernel's 4th column is the grads it zeroes on overflow: a skipped step here
        assert got == [row[:3] for row in fact["scale_good_bad_x0"]], case


def test_static_program_backs_off_by_paddles_rule() -> None:
    """The issue's case: decr_every_n_nan_or_inf=2 and [inf, clean, inf] keep 1024."""
    fact = STATIC["update_loss_scaling"]["issue"]
    model, loss = record()
    opt = static.amp.decorate(
        torch.optim.SGD(model.parameters(), lr=0.1),
        level="O1",
        dtype="bfloat16",
        init_loss_scaling=fact["init"],
        decr_every_n_nan_or_inf=fact["decr_every_n_nan_or_inf"],
        use_dynamic_loss_scaling=True,
    )
    opt.minimize(loss)
    exe = static.Executor(static.CPUPlace())
    exe.run(static.default_startup_program())
    scales = []
    for bad in fact["pattern"]:
        exe.run(feed=feed(bad), fetch_list=[loss])
        scales.append(float(opt.get_loss_scaling()[0]))
    assert scales == [row[0] for row in fact["scale_good_bad_x0"]] == [1024.0] * 3
    assert opt.scaler.state_dict()["decr_count"] == 1


def test_use_promote_runs_ops_with_an_fp32_input_in_fp32() -> None:
    """O2: the white-listed Linear layers run low either way; with use_promote the loss ops,
    which read the fp32 label, run in fp32; without it they run low (the seed's older O2)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    data = feed()
    x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
    lp = torch.bfloat16
    with torch.no_grad():
        out = base.to(lp)(x.to(lp))  # what O2 computes up to the model's output
        expected = {
            True: ((out.float() - y) ** 2).mean(),  # promoted: the fp32 label decides
            False: ((out - y.to(lp)) ** 2).mean().float(),  # all low
        }
    base.float()
    for promote in (False, True):
        model = nn.Sequential(*[copy.deepcopy(m) for m in base])
        with static.program_guard(static.Program(), static.Program()):
            xv = static.data(name="x", shape=[3, 4], dtype="float32")
            yv = static.data(name="y", shape=[3, 2], dtype="float32")
            loss = ((model(xv) - yv) ** 2).mean()
            opt = static.amp.decorate(
                torch.optim.SGD(model.parameters(), lr=0.1),
                level="O2",
                dtype="bfloat16",
                use_promote=promote,
            )
            opt.minimize(loss)
            exe = static.Executor(static.CPUPlace())
            exe.run(static.default_startup_program())
            opt.amp_init(static.CPUPlace())
            (got,) = exe.run(feed=data, fetch_list=[loss])
        assert [p.dtype for p in model.parameters()] == [lp] * 4
        # the same torch ops in the same dtypes: bit for bit
        assert float(got) == float(expected[promote]), promote
    assert float(expected[True]) != float(expected[False])  # the test tells them apart
