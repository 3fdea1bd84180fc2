"""Colossal-AI's `initialize(...)` and Engine: the config-driven face over the core.

Where each piece lives:
    from_config.py      initialize and its branches (ZeRO, FSDP, DDP, pipeline)
    engine.py           the Engine (the loop below, gradient accumulation, compiled train_step)
    state.py            the Engine's checkpoint (state_dict / load_state_dict)
    pipeline_engine.py  the Engine of `parallel=dict(pipeline=N)`
    base.py             what both Engines share (train/eval, step with the LR schedule, counters)
    mixprec.parallel.data        dataloader_to_distributed: a loader sharded over ranks

`initialize` reads `fp16`, `clip_grad_norm`, `gradient_accumulation` and `compile` (bool:
`engine.train_step(x, target=y)` runs mixprec.compile_step's compiled whole step) from a config (by
default the one `mixprec.launch.*` put in `gpc.config`), parses it once into a typed
`mixprec.config.EngineConfig` (`parse_config`) and builds the Booster plugin it means
(`from_config.plugin_for`: LowLevelZeroPlugin for zero 1/2, TorchFSDPPlugin for zero 3,
TorchDDPPlugin with more than one process, else the single-process Plugin), whose `configure`
assembles policy -> (model, optimizer) as `Booster.boost` does; it holds no precision logic of
its own. With more than one process the dataloaders get DistributedSamplers. The Engine is the loop-facing object of seed 000:

    engine, train_dataloader, _, _ = mixprec.engine.initialize(model, optimizer, criterion,
                                                               train_dataloader)
    engine.train()
    for img, label in train_dataloader:
        engine.zero_grad()
        output = engine(img)
        loss = engine.criterion(output, label)
        engine.backward(loss)
        engine.step()

Gradient accumulation over N micro-batches: every loss is divided by N in `backward`,
`zero_grad` only clears at the start of a window, `step` only steps on the N-th call (the
gradients are unscaled, checked and clipped once, on their sum), and under DDP the first N-1
forwards run under `no_sync` so gradients are all-reduced once per window. Unlike Colossal-AI,
the dataloader is not shortened to a multiple of N: a partial window at the end of an epoch
carries over into the next one.
"""

from mixprec.engine.engine import Engine
from mixprec.engine.from_config import initialize
from mixprec.engine.state import ENGINE_STATE_KEYS
from mixprec.parallel.data import EpochShuffledDistributedSampler, dataloader_to_distributed

__all__ = [
    "ENGINE_STATE_KEYS",
    "Engine",
    "EpochShuffledDistributedSampler",
    "dataloader_to_distributed",
    "initialize",
]
