"""Seed 002 §2.2.2: AMP-O1 in the static graph, CustomOpLists(custom_white_list=['elementwise_add']).

The seed's listing with these substitutions: `from mixprec.paddle import static` for
paddle.static (and static.enable_static / static.CPUPlace for paddle.enable_static /
paddle.CUDAPlace(0)), a torch nn.Module, torch.nn.MSELoss and torch.optim.SGD.

    python examples/paddle_static/train_o1.py [--dtype float16]

Run time on the reference CPU (2-core AMD EPYC, OMP_NUM_THREADS=1), defaults: 5.1 min, most of
it torch.compile, measured while the shared machine ran at load average ~13-17 (idle is several
times faster).
"""

from __future__ import annotations

import time

import torch
from static_net import SimpleNet, build_parser, make_loader

from mixprec.paddle import static


def main(argv: list[str] | None = None) -> tuple[float, float]:
    args = build_parser(__doc__).parse_args(argv)
    epochs, nums_batch, loader = args.epochs, args.nums_batch, make_loader(args)
    batch_size, input_size = args.batch_size, args.input_size
    torch.manual_seed(args.seed)

    static.enable_static()
    place = static.CPUPlace()
    main_program = static.default_main_program()
    startup_program = static.default_startup_program()

    model = SimpleNet(input_size, input_size)
    mse_loss = torch.nn.MSELoss()

    data = static.data(name="data", shape=[batch_size, input_size], dtype="float32")
    label = static.data(name="label", shape=[batch_size, input_size], dtype="float32")

    predict = model(data)
    loss = mse_loss(predict, label)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.0001)

    # 1) use `CustomOpLists` to define Black and white lists
    amp_list = static.amp.CustomOpLists(custom_white_list=["elementwise_add"])

    # 2) decorate the optimizer for amp:
    optimizer = static.amp.decorate(
        optimizer=optimizer,
        amp_lists=amp_list,
        init_loss_scaling=128.0,
        use_dynamic_loss_scaling=True,
        dtype=args.dtype,
    )

    optimizer.minimize(loss)

    exe = static.Executor(place)
    exe.run(startup_program)

    train_time = 0
    for _epoch in range(epochs):
        for train_data, train_label in loader():
            start_time = time.time()
            train_loss = exe.run(
                main_program,
                feed={data.name: train_data, label.name: train_label},
                fetch_list=[loss.name],
                use_program_cache=True,
            )
            train_time += time.time() - start_time

    print("loss:", train_loss)
    print(f"Time consuming using AMP-O1 mode:{train_time / (epochs * nums_batch):.3f} sec")
    return float(train_loss[0]), train_time / (epochs * nums_batch)


if __name__ == "__main__":
    main()
