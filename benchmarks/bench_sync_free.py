"""The eager step's masked update (mixprec.core.sync_free) against the syncing step, on CPU.

Forces the sync-free path (`_sync_free = True`, off by default on CPU) and times whole training
steps (backward + step) of an fp16 MLP with fp32 masters, interleaved with the syncing path
(`_sync_free = False`) so that both see the same machine load; reports the median ratio and
the bytes the masked update copies per step (the stepped params + their optimizer state).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_sync_free.py [--width 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mixprec.core.casting import cast_module
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import ScalerConfig

OPTIMIZERS = {
    "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
    "AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-4),
}


def build(make, width: int, sync_free: bool):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(4)]
    model = cast_module(torch.nn.Sequential(*layers), torch.float16)
    opt = MixedPrecisionOptimizer(make(model.parameters()), loss_scale=ScalerConfig())
    opt._sync_free = sync_free
    return model, opt


def one_step(model, opt, x) -> None:
    opt.zero_grad()
    opt.backward(model(x).float().square().mean())
    opt.step()


def copied_bytes(opt) -> int:
    """What the masked update snapshots per step: the stepped params and their state tensors."""
    total = 0
    for group in opt.optim.param_groups:
        for p in group["params"]:
            total += p.numel() * p.element_size()
            for value in opt.optim.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    x = torch.randn(64, args.width, dtype=torch.float16)
    print(
        f"4 x Linear({args.width}) fp16 + fp32 masters, batch 64, {torch.get_num_threads()} thread(s)"
    )
    print("| optimizer | syncing ms/step | masked ms/step | masked / syncing | copied per step |")
    print("|---|---|---|---|---|")
    for name, make in OPTIMIZERS.items():
        runs = {flag: build(make, args.width, flag) for flag in (False, True)}
        for model, opt in runs.values():
            for _ in range(3):  # state created, allocator warm
                one_step(model, opt, x)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for flag, (model, opt) in runs.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    one_step(model, opt, x)
                opt.skipped_steps  # noqa: B018 - the record's read, inside the timed round
                times[flag].append((time.perf_counter() - start) / args.steps * 1e3)
        sync, masked = statistics.median(times[False]), statistics.median(times[True])
        mib = copied_bytes(runs[True][1]) / 2**20
        print(f"| {name} | {sync:.3f} | {masked:.3f} | {masked / sync:.2f}x | {mib:.1f} MiB |")


if __name__ == "__main__":
    main()
