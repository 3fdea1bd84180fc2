"""mixprec.paddle.static: seed 002 §2.2's four listings, numerics against eager loops, errors.

Steps are compiled with backend="eager" (dynamo only: a graph break or fallback would still
show, and it costs ~1 s instead of ~25 s of inductor per program on this CPU).
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._dynamo
from tolerances import fp32_rounding
from torch import nn

import mixprec
from mixprec.paddle import static

# numerics: one variant per --device (conftest); tensors built here land on that device
pytestmark = pytest.mark.usefixtures("device", "paddle_static_mode")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "paddle_static"
TINY = ["--input-size", "16", "--batch-size", "8", "--nums-batch", "3", "--epochs", "1"]


def load_listing(name: str):
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(f"paddle_static_{name}", EXAMPLES / name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(EXAMPLES))
    return module


@pytest.mark.slow  # ~10 s each on the shared 2-core CPU (dynamo traces 9 layers, 2 passes)
@pytest.mark.parametrize(
    "listing", ["train_fp32.py", "train_o1.py", "train_o2.py", "train_o2_guard.py"]
)
def test_the_four_listings_run_compiled_without_a_graph_break(listing, capsys):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # an eager fallback would warn
        loss, _ = load_listing(listing).main(TINY)
    assert np.isfinite(loss)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert "loss: [array(" in capsys.readouterr().out  # Paddle 3: the mean loss fetched 0-d


def record_simple_net(width=16, batch=8, guard=False):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(3)])
    data = static.data(name="data", shape=[batch, width], dtype="float32")
    label = static.data(name="label", shape=[-1, width], dtype="float32")
    if guard:
        h = model[0](data)
        with static.amp.fp16_guard():
            h = model[2](model[1](h))
        loss = nn.MSELoss()(h, label)
    else:
        loss = nn.MSELoss()(model(data), label)
    return model, data, label, loss


def batches(n=3, width=16, batch=8):
    rng = np.random.default_rng(0)
    return [
        (rng.random((batch, width), dtype=np.float32), rng.random((batch, width), dtype=np.float32))
        for _ in range(n)
    ]


def run(exe, data, label, loss, feeds):
    return [exe.run(feed={data.name: x, label.name: y}, fetch_list=[loss])[0] for x, y in feeds]


def test_fp32_program_equals_the_eager_torch_loop():
    model, data, label, loss = record_simple_net()
    reference = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.optim.SGD(model.parameters(), lr=0.1).minimize(loss)
    exe = static.Executor(static.CPUPlace())
    exe.run(static.default_startup_program())
    losses = run(exe, data, label, loss, batches())
    for (x, y), got in zip(batches(), losses, strict=True):
        ref_loss = nn.MSELoss()(reference(torch.from_numpy(x)), torch.from_numpy(y))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert got.shape == () and got.dtype == np.float32  # Paddle 3: a mean loss is 0-d
        np.testing.assert_allclose(float(got), ref_loss.item(), rtol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, **fp32_rounding())


def test_o1_program_equals_the_core_autocast_loop():
    """O1 = autocast with a dynamic scale of 128: convert_to_amp('fp16', dtype=bf16) eagerly."""
    model, data, label, loss = record_simple_net()
    reference = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    reference.load_state_dict(model.state_dict())
    ref_model, ref_opt, ref_crit = mixprec.convert_to_amp(
        reference,
        torch.optim.SGD(reference.parameters(), lr=0.1),
        nn.MSELoss(),
        "fp16",
        {"dtype": "bfloat16", "init_scale": 128.0},
    )
    opt = static.amp.decorate(
        torch.optim.SGD(model.parameters(), lr=0.1), init_loss_scaling=128.0, dtype="bfloat16"
    )
    opt.minimize(loss)
    exe = static.Executor(static.CPUPlace())
    exe.run(static.default_startup_program())
    run(exe, data, label, loss, batches())
    for x, y in batches():
        ref_opt.backward(ref_crit(ref_model(torch.from_numpy(x)), torch.from_numpy(y)))
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, **fp32_rounding())
    assert float(opt.get_loss_scaling()) == 128.0


def test_o2_casts_parameters_keeps_exact_fp32_masters_and_skips_bitwise():
    model, data, label, loss = record_simple_net(guard=True)
    fp32_values = [p.detach().clone() for p in model.parameters()]
    opt = static.amp.decorate(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        init_loss_scaling=128.0,
        use_pure_fp16=True,
        use_fp16_guard=True,
    )
    opt.minimize(loss)
    exe = static.Executor(static.CPUPlace())
    exe.run(static.default_startup_program())
    place = static.CPUPlace()
    opt.amp_init(place, scope=static.global_scope())
    dtypes = [p.dtype for p in model.parameters()]
    assert dtypes == [torch.float32] * 2 + [torch.float16] * 4  # layer 0 is outside the guard
    masters = opt.wrapped.hp_masters
    for master, value in zip(masters, fp32_values[2:], strict=True):
        torch.testing.assert_close(master, value, rtol=0, atol=0)  # not the fp16 rounding
    (x, y), (x2, y2) = batches(2)
    first = exe.run(feed={"data": x, "label": y}, fetch_list=[loss.name])
    assert first[0].dtype == np.float32  # the loss op sits outside the guard: fp32, as the seed
    before = [t.detach().clone() for t in [*model.parameters(), *masters]]
    before += [s["momentum_buffer"].clone() for s in opt.inner.state.values()]
    x2[0, 0] = np.inf
    exe.run(feed={"data": x2, "label": y2}, fetch_list=[loss.name])
    after = [t.detach().clone() for t in [*model.parameters(), *masters]]
    after += [s["momentum_buffer"].clone() for s in opt.inner.state.values()]
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (
        float(opt.get_loss_scaling()[0]) == 128.0
    )  # decr_every_n_nan_or_inf=2: one bad step keeps it


def test_bad_input_names_the_value_and_the_choices():
    static.disable_static()
    with pytest.raises(RuntimeError, match="enable_static"):
        static.data(name="x", shape=[2, 2])
    static.enable_static()
    with pytest.raises(ValueError, match="dtype='float8'.*'float32'"):
        static.data(name="x", shape=[2, 2], dtype="float8")
    with pytest.raises(ValueError, match="Unknown op 'elementwise_addd'.*'elementwise_add'"):
        static.amp.CustomOpLists(custom_white_list=["elementwise_addd"])
    model, data, label, loss = record_simple_net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="use_fp16_guard=True only applies with use_pure_fp16"):
        static.amp.decorate(sgd, use_fp16_guard=True)
    pure = static.amp.decorate(sgd, use_pure_fp16=True)
    with pytest.raises(RuntimeError, match="amp_init before minimize"):
        pure.amp_init(static.CPUPlace())
    exe = static.Executor(static.CPUPlace())
    ((x, y),) = batches(1)
    with pytest.raises(RuntimeError, match="before optimizer.minimize"):
        exe.run(feed={"data": x, "label": y}, fetch_list=[loss])
    pure.minimize(loss)
    with pytest.raises(RuntimeError, match="call optimizer.amp_init"):
        exe.run(feed={"data": x, "label": y}, fetch_list=[loss])
    pure.amp_init(static.CPUPlace())
    with pytest.raises(ValueError, match="feed name 'dta'.*Did you mean 'data'"):
        exe.run(feed={"dta": x, "label": y}, fetch_list=[loss])
    with pytest.raises(ValueError, match=r"shape \[8, 4\]; data\(\) declared \[8, 16\]"):
        exe.run(feed={"data": x[:, :4], "label": y}, fetch_list=[loss])
    with pytest.raises(ValueError, match="dtype float64; data.. declared float32"):
        exe.run(feed={"data": x.astype(np.float64), "label": y}, fetch_list=[loss])
    with pytest.raises(ValueError, match="feed lacks \\['label'\\]"):
        exe.run(feed={"data": x}, fetch_list=[loss])
    with pytest.raises(ValueError, match="fetch_list item 'nope'"):
        exe.run(feed={"data": x, "label": y}, fetch_list=["nope"])
    with pytest.raises(ValueError, match="returns the loss only"):
        exe.run(feed={"data": x, "label": y}, fetch_list=[data])
    ok = exe.run(feed={"data": x, "label": y[:3].repeat(3, 0)[:8]}, fetch_list=[loss.name])
    assert np.isfinite(ok[0]).all()  # label's first dimension is free (-1)
