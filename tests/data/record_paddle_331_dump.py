"""Record PaddlePaddle 3.3.1 (CPU) tensor-checker dumps into tests/data/paddle_331_dump/.

Run in a venv of its own (not mixprec's): pip install paddlepaddle==3.3.1; then
    python tests/data/record_paddle_331_dump.py
check_all/: DebugMode.CHECK_ALL over a Linear, relu, mean and its backward (every op's line);
nan_inf/: DebugMode.CHECK_NAN_INF over a division making inf and nan (only the [ERROR] lines).
These are the files paddle.amp.debugging.compare_accuracy reads (worker_* under a dump dir);
compare_accuracy.json holds its signature.
"""

import inspect
import json
import os
import shutil

import paddle
from paddle.amp import debugging

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paddle_331_dump")


def run(name, mode, body):
    out = os.path.join(HERE, name)
    shutil.rmtree(out, ignore_errors=True)
    config = debugging.TensorCheckerConfig(enable=True, debug_mode=mode, output_dir=out)
    debugging.enable_tensor_checker(config)
    body()
    debugging.disable_tensor_checker()


def check_all():
    paddle.seed(1)
    lin = paddle.nn.Linear(3, 2)
    x = paddle.to_tensor([[1.0, 0.0, 3.0], [2.0, 1.0, 0.5]], stop_gradient=False)
    paddle.nn.functional.relu(lin(x)).mean().backward()


def nan_inf():
    x = paddle.to_tensor([1.0, 0.0, 3.0, 0.0])
    y = paddle.to_tensor([0.5, 0.0, 0.0, 2.0])
    x / y


run("check_all", debugging.DebugMode.CHECK_ALL, check_all)
run("nan_inf", debugging.DebugMode.CHECK_NAN_INF, nan_inf)

signature = inspect.signature(debugging.compare_accuracy).parameters.values()
signature = [p.replace(default=None) if p.default is p.empty else p for p in signature]
with open(os.path.join(HERE, "compare_accuracy.json"), "w") as f:
    json.dump({"signature": [[p.name, p.default] for p in signature]}, f)
