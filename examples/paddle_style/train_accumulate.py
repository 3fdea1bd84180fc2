"""Seed 002, 4.1: AMP-O1 with gradient accumulation: one update every --accumulate batches.

Scaled gradients of the batches in between add up in .grad; the GradScaler unscales and
checks their sum once, at the update.

    python examples/paddle_style/train_accumulate.py [--accumulate 5]

Run time on the reference CPU (2-core AMD EPYC, OMP_NUM_THREADS=1), defaults: 45 s, measured
while the shared machine ran at load average ~11 (idle is faster).
"""

from __future__ import annotations

import time

from simple_net import RunResult, build, build_parser, report
from torch import nn

import mixprec.paddle as amp


def main(argv: list[str] | None = None) -> RunResult:
    parser = build_parser(__doc__)
    parser.add_argument("--accumulate", type=int, default=10, help="batches per update")
    args = parser.parse_args(argv)
    if args.accumulate < 1:
        parser.error(f"--accumulate={args.accumulate} must be >= 1")
    model, optimizer, loader = build(args)
    mse = nn.MSELoss()
    device_type = args.device.split(":")[0]
    accumulate_batchs_num = args.accumulate  # the seed's name

    amp_context = amp.auto_cast(level="O1", dtype=args.dtype, device_type=device_type)
    scaler = amp.GradScaler(init_loss_scaling=1024, device=device_type)

    train_time = 0.0
    for _epoch in range(args.epochs):
        for i, (data, label) in enumerate(loader):
            start_time = time.perf_counter()
            data, label = data.to(args.device), label.to(args.device)
            with amp_context:
                output = model(data)
                loss = mse(output, label)
            scaled = scaler.scale(loss)
            scaled.backward()

            # update the parameters once accumulate_batchs_num batches have added their grads
            if (i + 1) % accumulate_batchs_num == 0:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()  # Paddle: optimizer.clear_grad(set_to_zero=False)

            train_loss = loss.item()
            train_time += time.perf_counter() - start_time
    return report("AMP-O1", train_loss, train_time, args, model, optimizer)


if __name__ == "__main__":
    main()
