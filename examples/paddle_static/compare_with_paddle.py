"""The fp32 static listing on real Paddle and on mixprec.paddle.static, same weights and data.

Needs paddlepaddle (3.3.1 was used: `pip install --target DIR paddlepaddle==3.3.1`, then
`--paddle-path DIR`). Prints both loss trajectories; on the 2-core CPU they agreed to within
one fp32 ulp (3e-8) over 5 SGD steps of 9 x Linear(16), batch 8. Paddle's own AMP does nothing
on a CPUPlace, so only fp32 can be compared here.

    python examples/paddle_static/compare_with_paddle.py --paddle-path /tmp/paddle_ref
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
from torch import nn

from mixprec.paddle import static


def main(argv: list[str] | None = None) -> list[tuple[float, float]]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--paddle-path", default=None, help="a --target dir holding paddle")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    if args.paddle_path:
        sys.path.append(args.paddle_path)  # after the venv's own torch and numpy
    import paddle

    width, batch = args.width, args.batch
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(9)])
    rng = np.random.default_rng(0)
    shape = (batch, width)
    feeds = [
        (rng.random(shape, dtype=np.float32), rng.random(shape, dtype=np.float32))
        for _ in range(args.steps)
    ]

    paddle.enable_static()
    main_program, startup_program = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main_program, startup_program):
        layers = [paddle.nn.Linear(width, width) for _ in range(9)]
        x = data = paddle.static.data(name="data", shape=list(shape), dtype="float32")
        label = paddle.static.data(name="label", shape=list(shape), dtype="float32")
        for layer in layers:
            x = layer(x)
        loss = paddle.nn.MSELoss()(x, label)
        paddle.optimizer.SGD(learning_rate=0.1).minimize(loss)
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(startup_program)
    scope = paddle.static.global_scope()
    for layer, linear in zip(layers, model, strict=True):  # Paddle stores weight as [in, out]
        scope.find_var(layer.weight.name).get_tensor().set(
            linear.weight.detach().numpy().T.copy(), paddle.CPUPlace()
        )
        scope.find_var(layer.bias.name).get_tensor().set(
            linear.bias.detach().numpy().copy(), paddle.CPUPlace()
        )
    feed = [{"data": a, "label": b} for a, b in feeds]
    paddle_losses = [
        float(np.ravel(exe.run(main_program, feed=f, fetch_list=[loss])[0])[0]) for f in feed
    ]
    paddle.disable_static()

    static.enable_static()
    with static.program_guard(static.Program(), static.Program()):
        data = static.data(name="data", shape=list(shape), dtype="float32")
        label = static.data(name="label", shape=list(shape), dtype="float32")
        loss = nn.MSELoss()(model(data), label)
        torch.optim.SGD(model.parameters(), lr=0.1).minimize(loss)
        exe = static.Executor(static.CPUPlace())
        exe.run(static.default_startup_program())
        ours = [float(exe.run(feed=f, fetch_list=[loss])[0]) for f in feed]
    static.disable_static()
    pairs = list(zip(paddle_losses, ours, strict=True))
    print("step | Paddle 3.3.1 | mixprec.paddle.static | |diff|")
    for i, (a, b) in enumerate(pairs):
        print(f"{i} | {a:.8f} | {b:.8f} | {abs(a - b):.1e}")
    return pairs


if __name__ == "__main__":
    main()
