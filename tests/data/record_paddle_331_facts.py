"""Record PaddlePaddle 3.3.1 (CPU) AMP facts into tests/data/paddle_331_facts.json.

Run in a venv of its own (not mixprec's): pip install paddlepaddle==3.3.1; then
    python tests/data/record_paddle_331_facts.py
Paddle's AMP is a no-op on CPU, so the GradScaler is built with its place check bypassed to
record its state and arithmetic; GPU-only behaviour (casts) is not recorded here.
"""

import inspect
import json
import random
import warnings

import numpy as np
import paddle
import paddle.amp.grad_scaler as gs
from paddle import _C_ops

# numpy 2.4 refuses float() of a shape-(1,) array, which Paddle 3.3.1 _update calls in its back-off
# message: read one element instead (the arithmetic is untouched).
paddle.Tensor.__float__ = lambda self: float(self.numpy().reshape(-1)[0])

facts = {"paddle_version": paddle.__version__}


def sig(f):
    out = []
    for p in inspect.signature(f).parameters.values():
        if p.name == "self":
            continue
        d = None if p.default is inspect.Parameter.empty else p.default
        if isinstance(d, float) and d in (float("inf"),):
            d = "inf"
        out.append(
            [
                p.name,
                d if isinstance(d, (int, float, str, bool, type(None))) else repr(d),
                p.kind.name,
            ]
        )
    return out


facts["signatures"] = {
    "paddle.amp.GradScaler": sig(paddle.amp.GradScaler.__init__),
    "paddle.amp.auto_cast": sig(paddle.amp.auto_cast),
    "paddle.amp.decorate": sig(paddle.amp.decorate),
    "paddle.static.amp.decorate": sig(paddle.static.amp.decorate),
    "paddle.static.amp.CustomOpLists": sig(paddle.static.amp.CustomOpLists.__init__),
    "paddle.static.amp.AutoMixedPrecisionLists": sig(
        paddle.static.amp.AutoMixedPrecisionLists.__init__
    ),
}
facts["grad_scaler_methods"] = sorted(
    n for n in dir(paddle.amp.GradScaler) if not n.startswith("_")
)
facts["paddle_amp_names"] = sorted(n for n in dir(paddle.amp) if not n.startswith("_"))
facts["paddle_amp_debugging_names"] = sorted(n for n in paddle.amp.debugging.__all__)
facts["debug_modes"] = {m.name: m.value for m in paddle.amp.debugging.DebugMode}
facts["tensor_checker_config_sig"] = sig(paddle.amp.debugging.TensorCheckerConfig.__init__)
facts["check_numerics_sig"] = sig(paddle.amp.debugging.check_numerics)

# A scaler on CPU: Paddle disables it ("can only be enabled on CUDAPlace"); record that, then
# build an enabled one with the place check bypassed to record its state and arithmetic.
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    s = paddle.amp.GradScaler()
facts["cpu_scaler_is_enable"] = s.is_enable()
facts["disabled_state_dict"] = s.state_dict()
s.load_state_dict({"scale": np.array([1.0])})  # disabled: no-op, no error
facts["disabled_load_state_dict_is_noop"] = True


def enabled(**kw):
    orig = gs.in_dynamic_mode
    gs.in_dynamic_mode = lambda: False
    try:
        return paddle.amp.GradScaler(**kw)
    finally:
        gs.in_dynamic_mode = orig


s = enabled()
facts["defaults"] = {
    "is_enable": s.is_enable(),
    "is_use_dynamic_loss_scaling": s.is_use_dynamic_loss_scaling(),
    "get_init_loss_scaling": s.get_init_loss_scaling(),
    "get_incr_ratio": s.get_incr_ratio(),
    "get_decr_ratio": s.get_decr_ratio(),
    "get_incr_every_n_steps": s.get_incr_every_n_steps(),
    "get_decr_every_n_nan_or_inf": s.get_decr_every_n_nan_or_inf(),
}
sd = s.state_dict()
facts["state_dict"] = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in sd.items()}
facts["state_dict_types"] = {
    k: type(v).__name__ + (f"{v.shape}/{v.dtype}" if isinstance(v, np.ndarray) else "")
    for k, v in sd.items()
}
s.set_init_loss_scaling(512)
facts["after_set_init_loss_scaling_512_scale"] = float(s._scale.numpy()[0])
for name, bad in (("set_incr_ratio", 1.0), ("set_decr_ratio", 1.0)):
    try:
        getattr(s, name)(bad)
        facts[name + "_bad"] = "accepted"
    except AssertionError as e:
        facts[name + "_bad"] = "AssertionError: " + str(e)
try:
    enabled(incr_ratio=1.0)
    facts["init_incr_ratio_1"] = "accepted"
except AssertionError as e:
    facts["init_incr_ratio_1"] = "AssertionError: " + str(e)


# The dygraph rule: drive _update with recorded overflow patterns.
def trajectory(pattern, **kw):
    sc = enabled(**kw)
    out = []
    for bad in pattern:
        sc._cache_found_inf = bad
        sc._update()
        out.append([float(sc._scale.numpy()[0]), sc._incr_count, sc._decr_count])
    return out


rng = random.Random(0)
pats = {
    "issue": ([True, False, True], dict(init_loss_scaling=1024.0, decr_every_n_nan_or_inf=2)),
    "issue5": (
        [True, False, True, True, True],
        dict(init_loss_scaling=1024.0, decr_every_n_nan_or_inf=2),
    ),
    "rand_d2_i3": (
        [rng.random() < 0.45 for _ in range(30)],
        dict(init_loss_scaling=1024.0, decr_every_n_nan_or_inf=2, incr_every_n_steps=3),
    ),
    "rand_d1_i2_r": (
        [rng.random() < 0.5 for _ in range(30)],
        dict(init_loss_scaling=256.0, incr_every_n_steps=2, incr_ratio=3.0, decr_ratio=0.25),
    ),
}
facts["dygraph_trajectories"] = {
    k: {"pattern": p, "kwargs": kw, "scale_incr_decr": trajectory(p, **kw)}
    for k, (p, kw) in pats.items()
}

# bf16 auto-disable: an enabled dynamic scaler's scale() after a bf16 auto_cast.
sc = enabled(init_loss_scaling=1024.0)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    with paddle.amp.auto_cast(dtype="bfloat16"):
        pass
    out = sc.scale(paddle.to_tensor([3.0]))
facts["bf16"] = {
    "is_enable": sc.is_enable(),
    "is_use_dynamic": sc.is_use_dynamic_loss_scaling(),
    "init_loss_scaling": sc.get_init_loss_scaling(),
    "scaled_3": float(out.numpy()[0]),
    "warning": [str(x.message) for x in w if "loss scaling" in str(x.message)],
    "state_dict": sc.state_dict(),
}
sc = enabled(init_loss_scaling=1024.0)
with paddle.amp.auto_cast(dtype="float16"):
    pass
facts["fp16_after_scale_3"] = float(sc.scale(paddle.to_tensor([3.0])).numpy()[0])
sc = enabled(init_loss_scaling=1024.0, use_dynamic_loss_scaling=False)
with paddle.amp.auto_cast(dtype="bfloat16"):
    pass
facts["bf16_static_scale_3"] = float(sc.scale(paddle.to_tensor([3.0])).numpy()[0])
facts["bf16_static_is_enable"] = sc.is_enable()

# minimize return on a disabled scaler / skipped step
lin = paddle.nn.Linear(2, 2)
opt = paddle.optimizer.SGD(parameters=lin.parameters(), learning_rate=0.1)
loss = lin(paddle.ones([1, 2])).mean()
loss.backward()
r = paddle.amp.GradScaler(enable=False).minimize(opt, loss)
facts["minimize_return_disabled"] = [
    type(r).__name__,
    len(r),
    type(r[0]).__name__,
    type(r[1]).__name__,
    len(r[1]),
    [type(x).__name__ for x in r[1][0]],
]
sc = enabled(init_loss_scaling=8.0)
opt.clear_grad()
(lin(paddle.ones([1, 2])).mean() * float("inf")).backward()
r = sc.minimize(opt, loss)
facts["minimize_return_skipped"] = [
    type(r).__name__,
    repr(r[0]),
    [[type(p).__name__, type(g).__name__, bool(np.isnan(g.numpy()).all())] for p, g in r[1]],
]
opt.clear_grad()
(lin(paddle.ones([1, 2])).mean()).backward()
r = sc.minimize(opt, loss)
facts["minimize_return_clean_enabled"] = [
    type(r).__name__,
    type(r[0]).__name__,
    type(r[1]).__name__,
]

# paddle.amp queries
facts["queries_outside"] = {
    "is_autocast_enabled": paddle.amp.is_autocast_enabled(),
    "get_autocast_dtype": paddle.amp.get_autocast_dtype(),
}
with paddle.amp.auto_cast(dtype="bfloat16"):
    facts["queries_in_bf16_O1"] = {
        "is_autocast_enabled": paddle.amp.is_autocast_enabled(),
        "get_autocast_dtype": paddle.amp.get_autocast_dtype(),
    }
with paddle.amp.auto_cast(level="O0"):
    facts["queries_in_O0"] = {
        "is_autocast_enabled": paddle.amp.is_autocast_enabled(),
        "get_autocast_dtype": paddle.amp.get_autocast_dtype(),
    }
with paddle.amp.auto_cast(enable=False, dtype="bfloat16"):
    facts["queries_in_enable_false"] = {
        "is_autocast_enabled": paddle.amp.is_autocast_enabled(),
        "get_autocast_dtype": paddle.amp.get_autocast_dtype(),
    }

facts["white_list"] = {
    d: {lv: sorted(v) for lv, v in x.items()} for d, x in paddle.amp.white_list().items()
}
facts["black_list"] = {
    d: {lv: sorted(v) for lv, v in x.items()} for d, x in paddle.amp.black_list().items()
}

# decorate: default level, DataParallel error
m = paddle.nn.Linear(2, 2)
o = paddle.optimizer.SGD(parameters=m.parameters())
r = paddle.amp.decorate(models=m, optimizers=o)
facts["decorate_default_weight_dtype"] = str(m.weight.dtype)

# ----- static graph -----
sfacts = {}


# update_loss_scaling_ (the static kernel Paddle's static AMP runs), driven step by step
def static_rule(pattern, init, incr_n, decr_n, incr_ratio, decr_ratio):
    x = [paddle.ones([2], dtype="float32")]
    scale = paddle.to_tensor(np.array([init], np.float32))
    good = paddle.to_tensor(np.array([0], np.int32))
    bad = paddle.to_tensor(np.array([0], np.int32))
    stop = paddle.to_tensor(np.array([False]))
    out = []
    for overflow in pattern:
        found = paddle.to_tensor(np.array([overflow]))
        _C_ops.update_loss_scaling_(
            x, found, scale, good, bad, incr_n, decr_n, incr_ratio, decr_ratio, stop
        )
        out.append(
            [
                float(scale.numpy()[0]),
                int(good.numpy()[0]),
                int(bad.numpy()[0]),
                float(x[0].numpy()[0]),
            ]
        )
        x = [paddle.ones([2], dtype="float32")]
    return out


rng = random.Random(1)
cases = {
    "issue": ([True, False, True], 1024.0, 1000, 2, 2.0, 0.5),
    "floor": ([True] * 6, 4.0, 1000, 1, 2.0, 0.5),
    "rand": ([rng.random() < 0.5 for _ in range(30)], 1024.0, 3, 2, 2.0, 0.8),
    "grow_to_inf": ([False] * 4, 2.0**126, 1, 2, 2.0, 0.5),
}
sfacts["update_loss_scaling"] = {
    k: {
        "pattern": c[0],
        "init": c[1],
        "incr_every_n_steps": c[2],
        "decr_every_n_nan_or_inf": c[3],
        "incr_ratio": c[4],
        "decr_ratio": c[5],
        "scale_good_bad_x0": static_rule(*c),
    }
    for k, c in cases.items()
}

paddle.enable_static()
main, startup = paddle.static.Program(), paddle.static.Program()
with paddle.static.program_guard(main, startup):
    x = paddle.static.data(name="x", shape=[4, 3], dtype="float32")
    y = paddle.static.data(name="y", shape=[4, 2], dtype="float32")
    out = paddle.static.nn.fc(x, 2)
    loss = paddle.mean(paddle.square(out - y))
    per_row = paddle.sum(out, axis=1)
    opt = paddle.optimizer.SGD(learning_rate=0.1)
    opt.minimize(loss)
exe = paddle.static.Executor(paddle.CPUPlace())
exe.run(startup)
feed = {"x": np.ones([4, 3], np.float32), "y": np.zeros([4, 2], np.float32)}
res = exe.run(main, feed=feed, fetch_list=[loss, per_row, out])
sfacts["fetch"] = {
    "loss_shape": list(res[0].shape),
    "loss_type": type(res[0]).__name__,
    "per_row_shape": list(res[1].shape),
    "out_shape": list(res[2].shape),
    "loss_dtype": str(res[0].dtype),
}
res = exe.run(main, feed=feed, fetch_list=[loss], return_numpy=False)
sfacts["fetch_return_numpy_false_type"] = type(res[0]).__name__


# static.amp.decorate: which overload, and the resulting settings
def settings(o):
    keys = [
        "_init_loss_scaling",
        "_use_dynamic_loss_scaling",
        "_incr_every_n_steps",
        "_decr_every_n_nan_or_inf",
        "_incr_ratio",
        "_decr_ratio",
        "_use_fp16_guard",
        "_amp_level",
        "_use_pure_fp16",
        "_use_promote",
        "_use_master_grad",
    ]
    return {k: getattr(o, k, "<absent>") for k in keys}


with paddle.static.program_guard(paddle.static.Program(), paddle.static.Program()):
    sgd = paddle.optimizer.SGD(learning_rate=0.1)
    sfacts["decorate_plain"] = settings(paddle.static.amp.decorate(sgd))
    sfacts["decorate_seed_o1_kwargs"] = settings(
        paddle.static.amp.decorate(
            optimizer=sgd,
            amp_lists=paddle.static.amp.CustomOpLists(custom_black_list=["pool2d"]),
            init_loss_scaling=128.0,
            use_dynamic_loss_scaling=True,
        )
    )
    sfacts["decorate_pure"] = settings(paddle.static.amp.decorate(sgd, use_pure_fp16=True))
    sfacts["decorate_pure_guard_false"] = settings(
        paddle.static.amp.decorate(sgd, use_pure_fp16=True, use_fp16_guard=False)
    )
    sfacts["decorate_third_positional_float"] = settings(
        paddle.static.amp.decorate(sgd, None, 1024.0)
    )
    sfacts["decorate_level_o2"] = settings(paddle.static.amp.decorate(sgd, level="O2"))
    sfacts["decorate_bf16_dynamic_default"] = settings(
        paddle.static.amp.decorate(sgd, level="O2", dtype="bfloat16")
    )
    sfacts["decorate_old_pure_fp16_guard_none"] = settings(
        paddle.static.amp.decorate(sgd, use_pure_fp16=False)
    )
lists = paddle.static.amp.AutoMixedPrecisionLists()
sfacts["amp_lists_default"] = {
    "white": sorted(lists.white_list),
    "black": sorted(lists.black_list),
    "gray": sorted(lists.gray_list),
}
cl = paddle.static.amp.CustomOpLists(custom_black_list=["pool2d"], custom_white_list=["softmax"])
sfacts["custom_lists_moved"] = {
    "pool2d_in_black": "pool2d" in cl.black_list,
    "softmax_in_white": "softmax" in cl.white_list,
    "softmax_in_black": "softmax" in cl.black_list,
}
sfacts["CustomOpLists_is_AutoMixedPrecisionLists"] = (
    paddle.static.amp.CustomOpLists is paddle.static.amp.AutoMixedPrecisionLists
)
try:
    paddle.static.amp.CustomOpLists(custom_white_list=["a"], custom_black_list=["a"])
except ValueError as e:
    sfacts["custom_overlap_error"] = str(e)
sfacts["static_amp_names"] = sorted(n for n in dir(paddle.static.amp) if not n.startswith("_"))

facts["static"] = sfacts
facts["_about"] = (
    "Recorded from paddlepaddle 3.3.1 on CPU (numpy 2.4) by tests/data/record_paddle_331_facts.py; "
    "reference data for tests/test_paddle_facts.py, not read by mixprec itself."
)
path = __file__.rsplit("/", 1)[0] + "/paddle_331_facts.json"
with open(path, "w") as f:
    json.dump(facts, f, indent=1, sort_keys=True, default=repr)
print("wrote", path)
