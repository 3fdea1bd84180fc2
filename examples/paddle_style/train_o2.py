"""Seed 002, 2.1.3: AMP-O2: decorate casts the parameters, auto_cast(level='O2') runs ops low.

As in the seed, decorate(models=model) gets no optimizer: the optimizer built before it steps
the low-precision parameters directly (pure fp16/bf16, no fp32 master weights), which is why
the seed's O2 loss (0.6743) drifts from fp32's (0.6486). --master-weight passes the optimizer
to decorate as well, which wraps it with fp32 master weights.

    python examples/paddle_style/train_o2.py [--master-weight] [--dtype float16]

Run time on the reference CPU (2-core AMD EPYC, OMP_NUM_THREADS=1), defaults: 37 s, measured
while the shared machine ran at load average ~12 (idle is faster).
"""

from __future__ import annotations

import time

from simple_net import RunResult, build, build_parser, report
from torch import nn

import mixprec.paddle as amp


def main(argv: list[str] | None = None) -> RunResult:
    parser = build_parser(__doc__)
    parser.add_argument(
        "--master-weight", action="store_true", help="decorate(model, optimizer): fp32 masters"
    )
    args = parser.parse_args(argv)
    model, optimizer, loader = build(args)
    mse = nn.MSELoss()
    device_type = args.device.split(":")[0]

    # logic 1: cast the network parameters to the low dtype (norm layers would stay fp32)
    if args.master_weight:
        model, optimizer = amp.decorate(
            models=model, optimizers=optimizer, level="O2", dtype=args.dtype
        )
    else:
        model = amp.decorate(models=model, level="O2", dtype=args.dtype)

    # logic 2: every op but the black list runs low (the context is built once, entered per batch)
    amp_context = amp.auto_cast(level="O2", dtype=args.dtype, device_type=device_type)
    # logic 3: optional, scale the loss; this GradScaler unscales pure-fp16 grads too
    scaler = amp.GradScaler(init_loss_scaling=1024, device=device_type)

    train_time = 0.0
    for _epoch in range(args.epochs):
        for data, label in loader:
            start_time = time.perf_counter()
            data, label = data.to(args.device), label.to(args.device)
            with amp_context:
                output = model(data)
                loss = mse(output, label)
            # logic 3: scaled backward, unscale + check, step, update the scale
            scaled = scaler.scale(loss)
            scaled.backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()  # Paddle: optimizer.clear_grad(set_to_zero=False)

            train_loss = loss.item()
            train_time += time.perf_counter() - start_time
    return report("AMP-O2", train_loss, train_time, args, model, optimizer)


if __name__ == "__main__":
    main()
