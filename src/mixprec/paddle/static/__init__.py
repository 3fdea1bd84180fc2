"""paddle.static on mixprec: a program recorded from torch code, run as one compiled step.

    from mixprec.paddle import static

    static.enable_static()
    data = static.data(name="data", shape=[64, 128], dtype="float32")
    label = static.data(name="label", shape=[64, 128], dtype="float32")
    loss = torch.nn.MSELoss()(model(data), label)       # records the program
    optimizer = static.amp.decorate(torch.optim.SGD(model.parameters(), lr=1e-4))
    optimizer.minimize(loss)
    exe = static.Executor(static.CPUPlace())
    exe.run(static.default_startup_program())
    (loss_value,) = exe.run(feed={"data": x, "label": y}, fetch_list=[loss.name])

The model is a torch nn.Module, the optimizer a torch optimizer, the loss a torch loss.
enable_static() also gives torch optimizers Paddle's `minimize(loss)` (for the fp32 listing);
disable_static() takes it away. Executor.run fetches the loss (numpy, in its own shape: 0-d for a mean, as Paddle 3); running
the program executes mixprec.compile_step over it: forward, backward, unscale, check, skip,
update and loss-scale update in one compiled program, built on the first run.
"""

from mixprec.paddle.static import amp
from mixprec.paddle.static.executor import CPUPlace, CUDAPlace, Executor
from mixprec.paddle.static.program import (
    Program,
    Scope,
    Variable,
    data,
    default_main_program,
    default_startup_program,
    global_scope,
    in_static_mode,
    program_guard,
)
from mixprec.paddle.static.switch import disable_static, enable_static

__all__ = [
    "CPUPlace",
    "CUDAPlace",
    "Executor",
    "Program",
    "Scope",
    "Variable",
    "amp",
    "data",
    "default_main_program",
    "default_startup_program",
    "disable_static",
    "enable_static",
    "global_scope",
    "in_static_mode",
    "program_guard",
]
