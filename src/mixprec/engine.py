"""Colossal-AI's `initialize(...)` and Engine: the config-driven face over the core.

`initialize` reads `fp16`, `clip_grad_norm`, `gradient_accumulation` and `compile` (bool:
`engine.train_step(x, target=y)` runs mixprec.compile_step's compiled whole step) from a config (by
default the one `mixprec.launch.*` put in `gpc.config`), turns `fp16` into a Policy with
`mixprec.config.config_to_policy`, and applies it with the core's `prepare_model`,
`prepare_optimizer` and `FP32Criterion`; it holds no precision logic of its own. With more
than one process it wraps the prepared model in DistributedDataParallel and gives the
dataloaders DistributedSamplers. The Engine is the loop-facing object of seed 000:

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

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from mixprec.apex import multi_loss
from mixprec.apex.multi_loss import prepare_loss_optimizer
from mixprec.compiled_step import CompiledStep, compile_step
from mixprec.config import (
    ConfigLike,
    config_to_pipeline,
    config_to_policy,
    gpc,
    load_config,
    validate_config,
)
from mixprec.data import EpochShuffledDistributedSampler
from mixprec.module import FP32Criterion, PrecisionModule, prepare_model
from mixprec.optim import MixedPrecisionOptimizer, StepResult
from mixprec.policy import Policy
from mixprec.skip_monitor import SkipStats
from mixprec.validate import check_bool
from mixprec.zero import check_cpu_offload, prepare_zero_optimizer, to_zero_config

log = logging.getLogger("mixprec")

ENGINE_STATE_KEYS: tuple[str, ...] = (
    "model",
    "optimizer",
    "lr_scheduler",
    "accumulated_steps",
    "accumulated_grads",
)
"""Keys of Engine.state_dict(); load_state_dict requires all of them."""


def _distributed_world() -> tuple[int, int]:
    """(rank, world size) of the default group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def dataloader_to_distributed(loader: DataLoader, rank: int, world_size: int) -> DataLoader:
    """The same DataLoader over this rank's shard: one DistributedSampler per rank.

    A RandomSampler becomes a sampler reshuffled every epoch (seed shared by all ranks, so
    shards never overlap), a SequentialSampler an unshuffled one. Loaders that already use a
    DistributedSampler, or stream an IterableDataset (shard those yourself), are returned
    unchanged; any other sampler is an error, since its order could not be kept.
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"Dataloaders passed to initialize must be torch DataLoaders, got {type(loader)!r}."
        )
    if isinstance(loader.dataset, IterableDataset):
        log.warning(
            "mixprec.engine.initialize: %s streams an IterableDataset, which a "
            "DistributedSampler cannot shard; each rank reads what the dataset yields to it.",
            type(loader.dataset).__name__,
        )
        return loader
    if isinstance(loader.sampler, DistributedSampler):
        return loader
    if loader.batch_size is None:
        raise ValueError(
            f"Cannot shard a DataLoader built with batch_sampler={loader.batch_sampler!r}: "
            "pass batch_size=... with shuffle=True/False (or your own DistributedSampler)."
        )
    if isinstance(loader.sampler, RandomSampler):
        if loader.sampler.replacement or loader.sampler._num_samples is not None:
            raise ValueError(
                "Cannot shard a RandomSampler that draws with replacement or a num_samples "
                "subset; pass a DataLoader with shuffle=True or your own DistributedSampler."
            )
        sampler: DistributedSampler = EpochShuffledDistributedSampler(
            loader.dataset, num_replicas=world_size, rank=rank, shuffle=True
        )
    elif isinstance(loader.sampler, SequentialSampler):
        sampler = DistributedSampler(
            loader.dataset, num_replicas=world_size, rank=rank, shuffle=False
        )
    else:
        raise ValueError(
            f"Cannot shard a DataLoader with sampler {type(loader.sampler).__name__}. Valid: "
            "RandomSampler (shuffle=True), SequentialSampler (shuffle=False), or a "
            "DistributedSampler you built yourself."
        )
    kwargs: dict[str, Any] = {}
    if loader.num_workers > 0:  # DataLoader refuses these options without worker processes
        kwargs.update(
            prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers,
            multiprocessing_context=loader.multiprocessing_context,
        )
        if hasattr(loader, "in_order"):  # torch >= 2.6
            kwargs["in_order"] = loader.in_order
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        pin_memory_device=loader.pin_memory_device,
        **kwargs,
    )


class Engine:
    """Runs a prepared model, optimizer and criterion the way Colossal-AI's Engine does.

    Built by `initialize`; the pieces are the core's: model is a PrecisionModule (inside
    DistributedDataParallel when distributed), optimizer a MixedPrecisionOptimizer, criterion
    an FP32Criterion (or None).

    Args:
        model: the prepared model, possibly wrapped in DistributedDataParallel.
        optimizer: the core's optimizer wrapper (clipping and loss scaling live there).
        criterion: the fp32 loss, reached as `engine.criterion(output, label)`.
        lr_scheduler: stepped after every optimizer step that was not skipped (None: the
            caller steps its own scheduler, as seed 000 does once per epoch).
        gradient_accumulation: micro-batches per optimizer step (>= 1).
        policy: the precision policy the pieces were prepared with (for reports, checkpoints).
        compile_step: compile `train_step` (config key `compile=True`): see mixprec.compile_step.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: MixedPrecisionOptimizer,
        criterion: FP32Criterion | None = None,
        *,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        gradient_accumulation: int = 1,
        policy: Policy | None = None,
        compile_step: bool = False,
    ) -> None:
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        if not isinstance(inner, PrecisionModule):
            raise TypeError(
                f"Engine needs a model from mixprec.prepare_model (optionally inside "
                f"DistributedDataParallel), got {type(model)!r}; use mixprec.engine.initialize."
            )
        if not isinstance(optimizer, MixedPrecisionOptimizer):
            raise TypeError(
                f"Engine needs a mixprec MixedPrecisionOptimizer, got {type(optimizer)!r}; "
                "use mixprec.engine.initialize."
            )
        if criterion is not None and not isinstance(criterion, FP32Criterion):
            raise TypeError(f"Engine needs an FP32Criterion or None, got {type(criterion)!r}.")
        if (
            isinstance(gradient_accumulation, bool)
            or not isinstance(gradient_accumulation, int)
            or gradient_accumulation < 1
        ):
            raise ValueError(
                f"gradient_accumulation={gradient_accumulation!r} must be an int >= 1."
            )
        self.model = model
        self.optimizer = optimizer
        self.criterion = criterion
        self.lr_scheduler = lr_scheduler
        self.gradient_accumulation = gradient_accumulation
        self.compile_step = _check_compile(compile_step, gradient_accumulation, lr_scheduler)
        self._train_step: CompiledStep | None = None
        self.policy = policy if policy is not None else inner.policy
        self._precision_module = inner
        # micro-batches already backpropagated into the current accumulation window
        self._accumulated_steps = 0

    # ----- Colossal-AI's loop API -----
    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    @property
    def training(self) -> bool:
        return self.model.training

    def _window_closes(self) -> bool:
        """Whether the next step() is a real optimizer step (the window's last micro-batch)."""
        return self._accumulated_steps + 1 >= self.gradient_accumulation

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward (under DDP, without gradient sync until the window's last)."""
        sync_off = (
            isinstance(self.model, DistributedDataParallel)
            and self.model.training
            and torch.is_grad_enabled()
            and not self._window_closes()
        )
        # DDP decides in forward whether the coming backward all-reduces, so no_sync wraps it
        with self.model.no_sync() if sync_off else contextlib.nullcontext():
            return self.model(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients, but only at the start of an accumulation window."""
        if self._accumulated_steps == 0:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def backward(self, loss: torch.Tensor, loss_id: int = 0) -> None:
        """Scaled backward of loss / gradient_accumulation (gradients add up over a window).

        loss_id picks the loss scaler under fp16=dict(mode=AMP_TYPE.APEX, num_losses=N)."""
        if self.gradient_accumulation > 1:
            loss = loss / self.gradient_accumulation
        multi_loss.backward(self.optimizer, loss, loss_id)

    def step(self) -> StepResult | None:
        """Step on the window's last micro-batch: unscale, clip, step or skip, then the schedule.

        Returns the optimizer's StepResult, or None for a micro-batch that only accumulated.
        The LR scheduler (if the engine owns one) advances only when the step was not skipped.
        """
        if not self._window_closes():
            self._accumulated_steps += 1
            return None
        self._accumulated_steps = 0
        result = self.optimizer.step()
        if self.lr_scheduler is not None and not result.skipped:
            self.lr_scheduler.step()
        return result

    def train_step(self, *inputs: Any, target: Any) -> torch.Tensor:
        """One whole step (zero_grad .. step) as mixprec.compile_step runs it, compiled when
        the config says `compile=True`; returns the loss as a 0-dim tensor (no host sync)."""
        if self.criterion is None:
            raise RuntimeError("train_step needs a criterion: pass one to initialize().")
        if self._train_step is None:
            self._train_step = compile_step(
                self.model, self.optimizer, self.criterion, compile=self.compile_step
            )
        return self._train_step(*inputs, target=target)

    # ----- counters -----
    @property
    def loss_scale(self) -> float:
        """The current loss scale (a host sync)."""
        return self.optimizer.loss_scale

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because some rank's gradients were not finite."""
        return self.optimizer.skipped_steps

    @property
    def skip_stats(self) -> SkipStats:
        """The optimizer's step and skip counts, for logging (no host sync)."""
        return self.optimizer.skip_stats

    @property
    def last_result(self) -> StepResult | None:
        """What the last real optimizer step did (None before the first)."""
        return self.optimizer.last_result

    @property
    def accumulated_steps(self) -> int:
        """Micro-batches accumulated in the current window (0 right after a real step)."""
        return self._accumulated_steps

    # ----- checkpoints -----
    def _lp_to_hp(self) -> dict[int, torch.Tensor]:
        return {
            id(lp): hp
            for lp, hp in zip(self.optimizer.lp_params, self.optimizer.hp_masters, strict=True)
        }

    def _model_state_fp32(self) -> dict[str, Any]:
        """The model's state with fp32 values: masters for cast params, up-casts elsewhere.

        fp16/bf16 -> fp32 is exact, so loading this back into a cast model restores it bitwise.
        """
        module = self._precision_module.module
        lp_to_hp = self._lp_to_hp()
        state = module.state_dict()
        for name, param in module.named_parameters(remove_duplicate=False):
            if id(param) in lp_to_hp and name in state:
                state[name] = lp_to_hp[id(param)]
        return {
            k: v.detach().float().clone() if v.is_floating_point() else v.detach().clone()
            for k, v in state.items()
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit for bit: fp32 model weights (masters where they
        exist), optimizer (inner state, masters, scaler), scheduler, the accumulation window
        position and, mid-window, the gradients accumulated so far."""
        module = self._precision_module.module
        grads = {}
        if self._accumulated_steps > 0:
            grads = {
                name: p.grad.detach().clone()
                for name, p in module.named_parameters()
                if p.grad is not None
            }
        return {
            "model": self._model_state_fp32(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "accumulated_steps": self._accumulated_steps,
            "accumulated_grads": grads,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what state_dict() saved; the engine must be built the same way."""
        missing = [k for k in ENGINE_STATE_KEYS if k not in state_dict]
        if missing:
            raise KeyError(
                f"Not a mixprec Engine checkpoint: lacks {missing}; got keys {sorted(state_dict)}."
            )
        has_sched = state_dict["lr_scheduler"] is not None
        if has_sched != (self.lr_scheduler is not None):
            raise ValueError(
                f"Checkpoint {'has' if has_sched else 'has no'} LR scheduler state but this "
                f"engine {'has none' if self.lr_scheduler is None else 'owns one'}: build it "
                "with the same lr_scheduler argument to initialize."
            )
        accumulated = state_dict["accumulated_steps"]
        if not 0 <= accumulated < self.gradient_accumulation:
            raise ValueError(
                f"Checkpoint accumulated_steps={accumulated!r} does not fit "
                f"gradient_accumulation={self.gradient_accumulation}."
            )
        module = self._precision_module.module
        module.load_state_dict(state_dict["model"])  # rounds fp32 to each param's dtype
        self.optimizer.load_state_dict(state_dict["optimizer"])  # masters, then lp <- masters
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state_dict["lr_scheduler"])
        self.optimizer.zero_grad(set_to_none=True)
        params = dict(module.named_parameters())
        for name, grad in state_dict["accumulated_grads"].items():
            if name not in params:
                raise KeyError(f"Checkpoint holds a gradient for unknown parameter {name!r}.")
            params[name].grad = grad.to(params[name].device, params[name].dtype).clone()
        self._accumulated_steps = int(accumulated)

    def __repr__(self) -> str:
        return (
            f"Engine(policy={self.policy.name!r}, model={type(self.model).__name__}, "
            f"gradient_accumulation={self.gradient_accumulation}, "
            f"clip_grad_norm={self.optimizer.max_norm}, "
            f"lr_scheduler={type(self.lr_scheduler).__name__ if self.lr_scheduler else None})"
        )


def _check_compile(flag: object, accumulation: int, lr_scheduler: object) -> bool:
    if not isinstance(flag, bool):
        raise TypeError(f"compile={flag!r} must be a bool.")
    if flag and accumulation > 1:
        raise ValueError(
            f"compile=True with gradient_accumulation={accumulation}: the compiled step is one "
            "whole optimizer step per batch. Use one or the other."
        )
    if flag and lr_scheduler is not None:
        raise ValueError(
            "compile=True with an lr_scheduler the engine steps: the compiled step decides "
            "skips on the device, so the engine cannot know when to step it without a host "
            "sync. Step your schedule yourself."
        )
    return flag


def _current_device() -> torch.device | None:
    """The launched rank's CUDA device, or None on CPU (the model then stays where it is)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: Callable[..., torch.Tensor] | None = None,
    train_dataloader: DataLoader | None = None,
    test_dataloader: DataLoader | None = None,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    *,
    config: ConfigLike = None,
    verbose: bool = True,
) -> tuple[Engine, DataLoader | None, DataLoader | None, Any]:
    """Colossal-AI's `initialize`: the config's precision applied to model, optimizer, criterion.

    config: a mapping or a .py/.json/.toml path; None reads `gpc.config` (set by launch).
    Its keys: `fp16=dict(mode=AMP_TYPE.X, **mode_keys)` (absent: fp32), `clip_grad_norm`
    (float; 0 or absent: off), `gradient_accumulation` (int N >= 1), `zero=dict(level=1|2|3)`
    (mixprec.zero: sharded masters and state, + gradients, + params via FSDP2; no DDP then).
    Other keys are the user's and are left alone.
    lr_scheduler: when given, the engine steps it after every optimizer step that was not
    skipped; it is returned unchanged. Leave it out to step a schedule yourself.
    On CUDA the model moves to the current device first. With world size > 1 the prepared
    model is wrapped in DistributedDataParallel and the dataloaders get DistributedSamplers.
    Returns (engine, train_dataloader, test_dataloader, lr_scheduler). With
    `parallel=dict(pipeline=N)` and NUM_MICRO_BATCHES the engine is a pipeline_engine.PipelineEngine.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model)!r}.")
    # checked before the model is cast in place, so a bad call leaves it untouched
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(
        optimizer, MixedPrecisionOptimizer
    ):
        raise TypeError(
            f"optimizer must be a plain torch.optim.Optimizer over model's parameters, got "
            f"{type(optimizer)!r}; initialize wraps it once."
        )
    check_bool("verbose", verbose)
    if config is None:
        config = gpc.config
        validate_config(config)
    else:
        config = load_config(config)
    policy = config_to_policy(config)
    max_norm = float(config.get("clip_grad_norm") or 0.0)
    accumulation = int(config.get("gradient_accumulation") or 1)
    compile_flag = _check_compile(config.get("compile", False), accumulation, lr_scheduler)
    pipeline = config_to_pipeline(config)
    if pipeline is not None:  # parallel=dict(pipeline=N): stages, 1F1B, execute_schedule
        if compile_flag:
            raise ValueError(
                "compile=True cannot run a pipeline (parallel=dict(pipeline=N)): its stages "
                "step through torch.distributed.pipelining's schedules. Drop one of the two."
            )
        from mixprec.pipeline_engine import initialize_pipeline

        pp_size, num_microbatches = pipeline
        return initialize_pipeline(
            model,
            optimizer,
            criterion,
            (train_dataloader, test_dataloader),
            lr_scheduler,
            policy=policy,
            pp_size=pp_size,
            num_microbatches=num_microbatches,
            max_norm=max_norm,
            accumulation=accumulation,
        )

    zero = to_zero_config(config.get("zero"))

    device = _current_device()
    if device is not None:
        model.to(device)  # moves parameter data in place: the optimizer keeps the same tensors
    if zero is not None:
        check_cpu_offload(zero.cpu_offload, device or torch.device("cpu"))
    if zero is not None and zero.level == 3:
        precision_model, mp_optimizer = _fsdp_prepare(model, optimizer, policy, max_norm, device)
    else:
        precision_model = prepare_model(model, policy)
    rank, world_size = _distributed_world()
    wrapped: nn.Module = precision_model
    if world_size > 1:
        if zero is None:  # ZeRO reduces gradients itself (levels 1-2 at step, 3 in FSDP2)
            # DDP broadcasts rank 0's (already cast) weights; masters are copied after that
            device_ids = None if device is None else [device.index]
            wrapped = DistributedDataParallel(precision_model, device_ids=device_ids)
        train_dataloader, test_dataloader = (
            None if loader is None else dataloader_to_distributed(loader, rank, world_size)
            for loader in (train_dataloader, test_dataloader)
        )
    if zero is None:
        mp_optimizer = prepare_loss_optimizer(optimizer, policy, max_norm=max_norm)  # num_losses
    elif zero.level < 3:
        mp_optimizer = prepare_zero_optimizer(
            optimizer, policy, stage=zero.level, max_norm=max_norm
        )
    mp_optimizer.name_params(model)  # so a collapsing scale names the overflowing parameters
    engine = Engine(
        wrapped,
        mp_optimizer,
        None if criterion is None else FP32Criterion(criterion),
        lr_scheduler=lr_scheduler,
        gradient_accumulation=accumulation,
        policy=policy,
        compile_step=compile_flag,
    )
    if verbose and rank == 0:
        log.info(
            "mixprec.engine.initialize: mode=%s, world_size=%d, clip_grad_norm=%g, "
            "gradient_accumulation=%d",
            policy.name,
            world_size,
            max_norm,
            accumulation,
        )
    return engine, train_dataloader, test_dataloader, lr_scheduler


def _fsdp_prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    policy: Policy,
    max_norm: float,
    device: torch.device | None,
) -> tuple[nn.Module, MixedPrecisionOptimizer]:
    """zero level 3: the Booster's FSDP2 path (params, grads and state sharded), clipped."""
    from mixprec.booster.plugin.torch_fsdp import TorchFSDPPlugin  # FSDP imports take ~0.5 s
    from mixprec.mixed_precision import MixedPrecision

    device = device or next(model.parameters()).device
    if dist.is_available() and dist.is_initialized():  # else configure() says what to do
        with torch.no_grad():  # fully_shard keeps each rank's own init: start from rank 0's
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.detach(), src=0)
    model, mp_optimizer = TorchFSDPPlugin().configure(
        model, optimizer, MixedPrecision(policy), device
    )
    assert mp_optimizer is not None
    mp_optimizer.max_norm = max_norm
    return model, mp_optimizer


__all__ = [
    "Engine",
    "EpochShuffledDistributedSampler",
    "dataloader_to_distributed",
    "initialize",
]
