"""Seed 002, 2.1.2: AMP-O1 with a custom white list, and a GradScaler.

Inside auto_cast(level='O1') torch.autocast's lists decide each op's dtype; the custom white
list adds 'elementwise_add' (Paddle's name for torch's add), so additions run low as well.

    python examples/paddle_style/train_o1.py [--dtype float16]

Run time on the reference CPU (2-core AMD EPYC, OMP_NUM_THREADS=1), defaults: 39 s, measured
while the shared machine ran at load average ~13 (idle is faster).
"""

from __future__ import annotations

import time

from simple_net import RunResult, build, build_parser, report
from torch import nn

import mixprec.paddle as amp


def main(argv: list[str] | None = None) -> RunResult:
    args = build_parser(__doc__).parse_args(argv)
    model, optimizer, loader = build(args)
    mse = nn.MSELoss()
    device_type = args.device.split(":")[0]

    # logic 1: the AMP context, built once and entered every batch (re-entrant)
    amp_context = amp.auto_cast(
        custom_white_list={"elementwise_add"}, level="O1", dtype=args.dtype, device_type=device_type
    )
    # logic 2: optional, a GradScaler scales the loss to avoid fp16 gradient underflow
    scaler = amp.GradScaler(init_loss_scaling=1024, device=device_type)

    train_time = 0.0
    for _epoch in range(args.epochs):
        for data, label in loader:
            start_time = time.perf_counter()
            data, label = data.to(args.device), label.to(args.device)
            with amp_context:
                output = model(data)
                loss = mse(output, label)
            # logic 2: scale the loss, unscale and check the grads, step, update the scale
            scaled = scaler.scale(loss)
            scaled.backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()  # Paddle: optimizer.clear_grad(set_to_zero=False)

            train_loss = loss.item()
            train_time += time.perf_counter() - start_time
    return report("AMP-O1", train_loss, train_time, args, model, optimizer)


if __name__ == "__main__":
    main()
