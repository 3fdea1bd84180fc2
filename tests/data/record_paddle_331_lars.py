"""Record PaddlePaddle 3.3.1 (CPU) LarsMomentumOptimizer steps into tests/data/paddle_331_lars.json.

Run in a venv of its own (not mixprec's): pip install paddlepaddle==3.3.1; then
    python tests/data/record_paddle_331_lars.py
Each case: one fp32 parameter, three steps with fixed gradients (loss = sum(p * g)), the
parameter after each step. CPU Paddle has no fp16 lars kernel: multi_precision is not recorded.
"""

import inspect
import json
import os

import numpy as np
import paddle
from paddle.incubate.optimizer import LarsMomentumOptimizer

P0 = [[0.5, -1.0, 2.0], [0.25, 0.0, -0.75]]
GRADS = [
    [[0.1, 0.2, -0.3], [0.05, -0.5, 1.0]],
    [[-0.2, 0.4, 0.1], [0.3, 0.0, -0.25]],
    [[0.0, -0.1, 0.6], [0.15, 0.2, 0.05]],
]
CASES = {
    "defaults": {"learning_rate": 0.1, "momentum": 0.9},
    "coeff_decay_eps": {
        "learning_rate": 0.5,
        "momentum": 0.8,
        "lars_coeff": 0.02,
        "lars_weight_decay": 0.01,
        "epsilon": 1e-3,
    },
    "no_decay_plain_momentum": {"learning_rate": 0.1, "momentum": 0.9, "lars_weight_decay": 0.0},
    "rescale_grad": {"learning_rate": 0.1, "momentum": 0.5, "rescale_grad": 0.25},
}

facts = {"paddle_version": paddle.__version__, "p0": P0, "grads": GRADS, "cases": {}}
for name, kwargs in CASES.items():
    p = paddle.create_parameter([2, 3], "float32")
    p.set_value(np.array(P0, dtype=np.float32))
    opt = LarsMomentumOptimizer(parameter_list=[p], **kwargs)
    params = []
    for g in GRADS:
        (p * paddle.to_tensor(np.array(g, dtype=np.float32))).sum().backward()
        opt.step()
        opt.clear_grad()
        params.append(p.numpy().tolist())
    facts["cases"][name] = {"kwargs": kwargs, "params": params}

facts["signature"] = [
    [p.name, None if p.default is inspect.Parameter.empty else p.default]
    for p in inspect.signature(LarsMomentumOptimizer.__init__).parameters.values()
    if p.name != "self"
]
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paddle_331_lars.json")
with open(out, "w") as f:
    json.dump(facts, f, indent=1)
