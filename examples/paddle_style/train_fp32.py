"""Seed 002, 2.1.1: the fp32 training loop of SimpleNet (the baseline the AMP loops compare to).

python examples/paddle_style/train_fp32.py [--input-size 1024 --output-size 1024]

Run time on the reference CPU (2-core AMD EPYC, OMP_NUM_THREADS=1), defaults: 24 s, measured
while the shared machine ran at load average ~12 (idle is faster).
"""

from __future__ import annotations

import time

from simple_net import RunResult, build, build_parser, report
from torch import nn


def main(argv: list[str] | None = None) -> RunResult:
    args = build_parser(__doc__).parse_args(argv)
    model, optimizer, loader = build(args)
    mse = nn.MSELoss()

    train_time = 0.0
    for _epoch in range(args.epochs):
        for data, label in loader:
            start_time = time.perf_counter()
            data, label = data.to(args.device), label.to(args.device)
            # forward
            output = model(data)
            loss = mse(output, label)
            # backward
            loss.backward()
            # update parameters
            optimizer.step()
            optimizer.zero_grad()  # Paddle: optimizer.clear_grad(set_to_zero=False)

            train_loss = loss.item()  # a host sync, as the seed's loss.numpy()
            train_time += time.perf_counter() - start_time
    return report("FP32", train_loss, train_time, args, model, optimizer)


if __name__ == "__main__":
    main()
