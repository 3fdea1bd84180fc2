"""Pipeline parallelism under every precision mode, on torch.distributed.pipelining.

Each rank of a (dp, pp, tp) mesh holds one stage (two or more with the interleaved schedule)
of the model, cast and wrapped by the same core as a single-process model (prepare_model) and,
with tp_size > 1, sharded by torch's parallelize_module. The
schedules are torch's (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B); mixprec adds the
precision rules a pipeline needs:

- one loss scale for every stage: each rank's scaler starts alike and is fed the same
  (all-reduced) overflow flag, so the scales never differ;
- the last stage seeds backward with loss / num_microbatches * scale; earlier stages receive
  gradients already scaled, and nothing is rescaled at stage boundaries;
- fp32 accumulation of micro-batch gradients, dp averaging, global-norm clipping and the skip
  agreed over every rank: see mixprec.parallel.pipeline.optim.PipelineOptimizer.

A rank whose process dies mid-step resets its gloo connections: its peers' sends/receives
raise at once. A rank that hangs holds its peers until the process group's timeout
(init_process_group(timeout=...), torch's default 30 min), after which they raise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from mixprec.core.policy import Policy, did_you_mean
from mixprec.core.prepare import PrecisionModule, prepare_model, prepare_optimizer
from mixprec.parallel.pipeline.optim import (
    PipelineOptimizer,
    PipelineZeroOptimizer,
    StageOptimizer,
)
from mixprec.parallel.pipeline.split import split_sequential

Schedule = Literal["1f1b", "gpipe", "interleaved"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
Convert = Callable[[nn.Module, Policy], PrecisionModule]
StageClasses = tuple[type[PipelineOptimizer], type[PipelineZeroOptimizer]]
"""The stage optimizer classes prepare_pipeline builds: (without ZeRO, with ZeRO)."""


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """How a model is pipelined."""

    pp_size: int
    """Pipeline ranks per model replica (stages: pp_size x num_model_chunks)."""
    num_microbatches: int | None = None
    """Micro-batches each batch is split into (dim 0 must divide evenly); or None with
    microbatch_size."""
    microbatch_size: int | None = None
    """Samples per micro-batch (Colossal-AI's alternative to num_microbatches: the count is
    the batch size over it, fixed at the first batch as the stages' shapes are)."""
    schedule: str = "1f1b"
    """One of SCHEDULES: torch's Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B."""
    num_model_chunks: int | None = None
    """Stages per rank (None: 2 for 'interleaved', else 1)."""
    split_points: tuple[str, ...] | None = None
    """Names of the nn.Sequential layers where stages 1.. begin (None: balanced by params)."""
    tp_size: int = 1
    """Tensor-parallel ranks per stage (torch's DTensor parallelize_module with tp_plan)."""

    def __post_init__(self) -> None:
        if (self.num_microbatches is None) == (self.microbatch_size is None):
            raise ValueError(
                f"num_microbatches={self.num_microbatches!r}, microbatch_size="
                f"{self.microbatch_size!r}: set exactly one (the micro-batch count, or the "
                "samples per micro-batch)."
            )
        for name in ("pp_size", "num_microbatches", "microbatch_size", "tp_size"):
            value = getattr(self, name)
            if value is None and name in ("num_microbatches", "microbatch_size"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1.")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"Unknown pp_schedule {self.schedule!r}." + did_you_mean(self.schedule, SCHEDULES)
            )
        chunks = self.num_model_chunks
        if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int)):
            raise ValueError(f"num_model_chunks={chunks!r} must be an int or None.")
        if chunks is not None and self.schedule != "interleaved" and chunks != 1:
            raise ValueError(
                f"num_model_chunks={chunks!r} needs pp_schedule='interleaved' "
                f"(got {self.schedule!r}, which runs one stage per rank)."
            )
        if self.schedule == "interleaved" and self.chunks < 2:
            raise ValueError(f"num_model_chunks={chunks!r}: 'interleaved' needs >= 2.")
        if self.num_microbatches is not None:
            self.check_microbatches(self.num_microbatches)

    def check_microbatches(self, m: int, how: str = "") -> None:
        """Whether the schedule runs m micro-batches a batch (how: where m came from)."""
        named = f"num_microbatches={m}{how}"
        if self.schedule != "gpipe" and m < self.pp_size:
            raise ValueError(
                f"{named} < pp_size={self.pp_size}: pp_schedule={self.schedule!r} keeps every "
                "stage busy only with at least pp_size micro-batches; "
                + (
                    "raise num_microbatches"
                    if not how
                    else "use a larger batch or a smaller microbatch_size"
                )
                + " or use 'gpipe'."
            )
        rounds = max(1, m // self.pp_size)
        if self.schedule == "interleaved" and m % rounds:
            raise ValueError(
                f"{named} must be a multiple of its {rounds} rounds of pp_size={self.pp_size} "
                "for pp_schedule='interleaved' (torch's ScheduleInterleaved1F1B rule); a "
                "multiple of pp_size always works."
            )

    def microbatches_of(self, size: int) -> int:
        """The micro-batch count of a batch of size samples; raises when it does not split."""
        if self.num_microbatches is not None:
            if size % self.num_microbatches:
                raise ValueError(
                    f"The batch of {size} samples does not split into num_microbatches="
                    f"{self.num_microbatches} equal micro-batches; use a batch size that is a "
                    f"multiple of {self.num_microbatches}."
                )
            return self.num_microbatches
        per = self.microbatch_size
        assert per is not None
        if size % per:
            raise ValueError(
                f"The batch of {size} samples does not split into micro-batches of "
                f"microbatch_size={per}; use a batch size that is a multiple of {per} (or set "
                "num_microbatches instead)."
            )
        m = size // per
        self.check_microbatches(m, f" (batch {size} / microbatch_size={per})")
        return m

    @property
    def chunks(self) -> int:
        if self.num_model_chunks is not None:
            return self.num_model_chunks
        return 2 if self.schedule == "interleaved" else 1

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.chunks


def stage_modules(
    model: nn.Module | Sequence[nn.Module], config: PipelineConfig
) -> list[nn.Module]:
    """Every stage of the model, in order: an nn.Sequential cut, or the user's own stages."""
    if isinstance(model, nn.Sequential):
        split = list(config.split_points) if config.split_points is not None else None
        return list(split_sequential(model, config.num_stages, split))
    if config.split_points is not None:
        raise ValueError(
            f"split_points={config.split_points!r} cut an nn.Sequential; this model is a "
            f"{type(model).__name__}: pass its stages as a list (nn.ModuleList) instead."
        )
    if isinstance(model, nn.ModuleList | list | tuple):
        stages = list(model)
        if len(stages) != config.num_stages or not all(isinstance(m, nn.Module) for m in stages):
            raise ValueError(
                f"A list of {len(stages)} stage modules was given; pp_size={config.pp_size} x "
                f"num_model_chunks={config.chunks} needs {config.num_stages} nn.Modules."
            )
        return stages
    raise TypeError(
        "A pipelined model is an nn.Sequential (cut into balanced stages or at split_points) "
        f"or a list / nn.ModuleList of its stage modules, got {type(model).__name__}."
    )


class PipelinedModel(nn.Module):
    """This rank's stages of a pipelined model, and the torch schedule that runs them."""

    def __init__(
        self,
        stages: list[PrecisionModule],
        stage_ids: list[int],
        config: PipelineConfig,
        pp_group: dist.ProcessGroup,
        device: torch.device,
        stage_prefixes: list[str],
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.stage_ids = stage_ids
        self.stage_prefixes = stage_prefixes
        """Each local stage's key prefix in the unsplit model's state_dict."""
        self.config = config
        self.pipeline_stages = [
            PipelineStage(stage, i, config.num_stages, device, group=pp_group)
            for stage, i in zip(stages, stage_ids, strict=True)
        ]
        self._schedule: Any = None
        self._batch_size: int | None = None  # the batch size the schedule's shapes were set for
        self._microbatches = 0  # micro-batches per batch, fixed with _batch_size
        self._run: tuple[Callable[..., torch.Tensor], StageOptimizer] | None = None
        self._losses: list[torch.Tensor] = []

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.config.num_stages - 1 in self.stage_ids

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """One stage (pp_size=1, no pipeline): the model itself, run as any module is."""
        if self.config.num_stages == 1:
            return self.stages[0](*args, **kwargs)
        raise RuntimeError(
            "A pipelined model runs only through its schedule: call "
            "booster.execute_pipeline(data_iter, model, criterion, optimizer)."
        )

    def _loss_fn(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        """The last stage's loss per micro-batch: its backward seed is loss / m * scale."""
        assert self._run is not None
        criterion, optimizer = self._run
        loss = criterion(output, target)
        self._losses.append(loss.detach())
        return optimizer.scale_loss(loss / self._microbatches)

    def _make_schedule(self, m: int) -> Any:
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        # scale_grads=False: the 1/m is in the loss, so no extra pass rescales the grads.
        if self.config.schedule == "interleaved":
            return ScheduleInterleaved1F1B(
                self.pipeline_stages, m, loss_fn=self._loss_fn, scale_grads=False
            )
        cls = Schedule1F1B if self.config.schedule == "1f1b" else ScheduleGPipe
        return cls(self.pipeline_stages[0], m, loss_fn=self._loss_fn, scale_grads=False)

    def _microbatches_of(self, size: int) -> int:
        """The micro-batch count of a batch of size samples; the first batch fixes the size
        (and builds the schedule). Checked on every rank before the schedule runs (every rank
        of a pipeline reads the same batch): all raise the same error, none is left waiting in
        a send or receive."""
        m = self.config.microbatches_of(size)
        if self._batch_size is not None and size != self._batch_size:
            raise ValueError(
                f"The batch of {size} samples differs from the {self._batch_size} the pipeline "
                f"was first run with: its stages fix the micro-batch shape ({self._batch_size} "
                f"/ {m}) at the first batch. A short last batch is the usual cause: build the "
                "DataLoader with drop_last=True (plugin.prepare_dataloader(..., "
                "drop_last=True)), or pad the last batch to the same size."
            )
        if self._schedule is None:
            self._schedule = self._make_schedule(m)
            self._batch_size = size
            self._microbatches = m
        return m

    def run(
        self,
        batch: Any,
        criterion: Callable[..., torch.Tensor],
        optimizer: StageOptimizer,
        *,
        return_loss: bool = True,
        return_outputs: bool = False,
        forward_only: bool = False,
    ) -> dict[str, Any]:
        """One batch through the schedule (forward and backward of every micro-batch; only
        forward with forward_only, which leaves the gradients alone).

        batch: (inputs, targets) with the same batch size on every rank. Returns 'loss' (the
        mean of the micro-batch losses) and 'outputs' (concatenated) on the rank holding the
        last stage, None elsewhere. Gradients accumulate until optimizer.step().
        """
        if not isinstance(optimizer, PipelineOptimizer | PipelineZeroOptimizer):
            raise TypeError(
                "Pass the optimizer boost() returned with this pipelined model, got "
                f"{type(optimizer).__name__}."
            )
        inputs, targets = _inputs_and_targets(batch)
        m = self._microbatches_of(inputs.shape[0])
        self._run = (criterion, optimizer)
        self._losses = []
        if not forward_only:  # every stage's grads come from the last stage's scaled loss
            optimizer.note_scaled_backward()
        args = (inputs,) if self.has_first_stage else ()
        target = targets if self.has_last_stage else None
        try:
            run = self._schedule.eval if forward_only else self._schedule.step
            output = run(*args, target=target, return_outputs=return_outputs)
        finally:
            self._run = None
        loss = outputs = None
        if self.has_last_stage:
            # The first call may be torch's metadata inference on an empty batch: keep the last m.
            losses = self._losses[-m:]
            loss = torch.stack(losses).float().mean() if return_loss else None
            outputs = output if return_outputs else None
        self._losses = []
        return {"loss": loss, "outputs": outputs}


def _inputs_and_targets(batch: Any) -> tuple[torch.Tensor, Any]:
    if isinstance(batch, list | tuple) and len(batch) == 2 and isinstance(batch[0], torch.Tensor):
        return batch[0], batch[1]
    raise TypeError(
        "Each batch of a pipeline's data_iter must be (inputs, targets) with inputs a tensor, "
        f"got {type(batch).__name__}."
    )


def next_batch(data_iter: Iterator[Any] | Any) -> Any:
    """The next batch of data_iter (an iterator; a single batch tuple is taken as is)."""
    if isinstance(data_iter, list | tuple):
        return data_iter
    if not isinstance(data_iter, Iterator):
        raise TypeError(
            f"data_iter must be an iterator over (inputs, targets) batches (e.g. "
            f"iter(dataloader)), got {type(data_iter).__name__}."
        )
    return next(data_iter)


def check_pp_size(pp_size: int, world: int, tp_size: int = 1) -> None:
    """pp_size x tp_size must divide the world (the rest is data parallel); all ranks raise."""
    if world % (pp_size * tp_size):
        valid = [d for d in range(1, world + 1) if world % (d * tp_size) == 0]
        raise ValueError(
            f"pp_size={pp_size} x tp_size={tp_size} does not divide the world size {world}; "
            f"valid pp_size with this tp_size: {valid}."
        )


def data_shard(pp_size: int, tp_size: int = 1) -> tuple[int, int]:
    """(this rank's replica, replicas) of the (dp, pp, tp) mesh: a replica's pp x tp ranks sit
    on adjacent ranks and must all read the same batches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_replica = pp_size * tp_size
    return rank // per_replica, world // per_replica


def prepare_pipeline(
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | None,
    policy: Policy,
    config: PipelineConfig,
    *,
    device: torch.device,
    max_norm: float = 0.0,
    convert: Convert = prepare_model,
    tp_plan: Mapping[str, Any] | None = None,
    fp8_communication: torch.dtype | None = None,
    zero: Mapping[str, Any] | None = None,
    optimizer_classes: StageClasses = (PipelineOptimizer, PipelineZeroOptimizer),
) -> tuple[PipelinedModel, StageOptimizer | None]:
    """Cut model into stages, keep this rank's (cast per policy), and wrap optimizer over them.

    The layers of other ranks' stages are moved to the meta device (their memory freed). The
    optimizer may be built over the whole model: its param groups are narrowed to this
    rank's params. torch.distributed must be initialised; the world is a (dp, pp) mesh.
    zero: ZeroOptimizer's arguments (stage, communication_dtype, ...) to shard each stage's
    masters and optimizer state over its data-parallel group (PipelineZeroOptimizer), or None.
    optimizer_classes: the (PipelineOptimizer, PipelineZeroOptimizer) subclasses to build (a
    face's, with its own methods).
    """
    if zero is not None and fp8_communication is not None:
        raise ValueError("fp8_communication with zero: pass it among zero's arguments.")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "Pipeline parallelism needs torch.distributed initialised first: call "
            "mixprec.launch.launch_from_torch() (or launch) before boosting."
        )
    world, tp = dist.get_world_size(), config.tp_size
    check_pp_size(config.pp_size, world, tp)
    all_stages = stage_modules(model, config)  # bad models raise here, before any collective
    plans = _stage_tp_plans(all_stages, tp_plan, tp)
    mesh = _mesh(device, world, config)
    stage_ids = [mesh.get_local_rank("pp") + k * config.pp_size for k in range(config.chunks)]
    wrapped = _place_stages(all_stages, stage_ids, optimizer, policy, config, device, convert)
    if tp > 1:
        _parallelize(wrapped, [plans[i] for i in stage_ids], mesh["tp"], optimizer)
    # A cut nn.Sequential keeps its layer names; a list of stages is keyed by list index.
    prefixes = ["" if isinstance(model, nn.Sequential) else f"{i}." for i in stage_ids]
    piped = PipelinedModel(wrapped, stage_ids, config, mesh.get_group("pp"), device, prefixes)
    if optimizer is None:
        return piped, None
    return piped, _stage_optimizer(
        optimizer, policy, mesh, wrapped, max_norm, fp8_communication, zero, optimizer_classes
    )


def _stage_optimizer(
    optimizer: torch.optim.Optimizer,
    policy: Policy,
    mesh: Any,
    stages: list[PrecisionModule],
    max_norm: float,
    fp8_communication: torch.dtype | None,
    zero: Mapping[str, Any] | None,
    classes: StageClasses,
) -> StageOptimizer:
    """optimizer wrapped over this rank's stages: averaged over the stage's replicas
    (PipelineOptimizer), or ZeRO over them (PipelineZeroOptimizer)."""
    dp_group = mesh.get_group("dp") if mesh.size(0) > 1 or zero is not None else None
    # every stage and replica skips together: the overflow flag is reduced over the world
    if zero is not None:  # fp8_communication among zero's keywords (ZeRO's own buckets)
        norm_group = _tp_index_group(mesh) if mesh.size(2) > 1 else None
        cls, extra = classes[1], {"norm_group": norm_group, **zero}
    else:
        cls, extra = classes[0], {"fp8_communication": fp8_communication}
    mp_optimizer: StageOptimizer = prepare_optimizer(  # type: ignore[assignment]
        optimizer,
        policy,
        max_norm=max_norm,
        process_group=dist.group.WORLD,
        optimizer_cls=cls,
        pp_group=mesh.get_group("pp"),
        dp_group=dp_group,
        **extra,
    )
    for stage in stages:
        mp_optimizer.name_params(stage.module)
    return mp_optimizer


def _mesh(device: torch.device, world: int, config: PipelineConfig) -> Any:
    """The (dp, pp, tp) device mesh of the world."""
    from torch.distributed.device_mesh import init_device_mesh

    dp_size = world // (config.pp_size * config.tp_size)
    shape = (dp_size, config.pp_size, config.tp_size)
    return init_device_mesh(device.type, shape, mesh_dim_names=("dp", "pp", "tp"))


def _place_stages(
    all_stages: list[nn.Module],
    stage_ids: list[int],
    optimizer: torch.optim.Optimizer | None,
    policy: Policy,
    config: PipelineConfig,
    device: torch.device,
    convert: Convert,
) -> list[PrecisionModule]:
    """This rank's stages on device, converted per policy; the others' layers on the meta
    device (their memory freed) and out of the optimizer's param groups."""
    local = [all_stages[i] for i in stage_ids]
    if optimizer is not None:
        local_ids = {id(p) for stage in local for p in stage.parameters()}
        _narrow_optimizer(optimizer, local_ids, {id(p) for s in all_stages for p in s.parameters()})
    for i, stage in enumerate(all_stages):
        if i not in stage_ids:
            stage.to("meta")  # another rank's layers: free their memory here
    last = config.num_stages - 1
    wrapped = []
    for stage, i in zip(local, stage_ids, strict=True):
        # Only the last stage's output is the model's; earlier ones cross to the next stage in
        # the dtype they were computed in (an fp32 cast there would double the bytes sent).
        stage_policy = policy if i == last else replace(policy, cast_outputs_to=None)
        wrapped.append(convert(stage.to(device), stage_policy))
    return wrapped


def _tp_index_group(mesh: Any) -> dist.ProcessGroup:
    """The ranks of the (dp, pp, tp) mesh at this rank's tp index (every dp replica of every
    stage): under ZeRO with tensor parallelism the clip norm's parts are summed over them, each
    DTensor's norm having been completed over its tp mesh (a tp-replicated param counted once).
    Every rank creates every group, in the same order (torch's new_group rule)."""
    ranks = mesh.mesh  # (dp, pp, tp) global ranks
    mine = None
    for t in range(ranks.shape[2]):
        group = dist.new_group(ranks[:, :, t].flatten().tolist())
        if t == mesh.get_local_rank("tp"):
            mine = group
    assert mine is not None
    return mine


def _narrow_optimizer(
    optimizer: torch.optim.Optimizer, local_ids: set[int], model_ids: set[int]
) -> None:
    """Keep in optimizer's param groups only the params of this rank's stages."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in model_ids:
                raise ValueError(
                    f"An optimizer param of shape {tuple(p.shape)} is not a param of the "
                    "pipelined model; pass the optimizer built over this model's parameters."
                )
        group["params"] = [p for p in group["params"] if id(p) in local_ids]


def _stage_tp_plans(
    stages: list[nn.Module], tp_plan: Mapping[str, Any] | None, tp: int
) -> list[dict[str, Any]]:
    """tp_plan (module name -> torch ParallelStyle, names as in the stage modules) split by
    stage; every name must be a module of some stage."""
    if tp == 1:
        if tp_plan:
            raise ValueError("tp_plan given but tp_size=1: set tp_size > 1 or drop tp_plan.")
        return [{} for _ in stages]
    if not tp_plan:
        raise ValueError(
            f"tp_size={tp} needs tp_plan: module name -> torch ParallelStyle (e.g. "
            "{'0': ColwiseParallel(), '2': RowwiseParallel()}), as parallelize_module takes."
        )
    names = [dict(stage.named_modules()) for stage in stages]
    plans: list[dict[str, Any]] = [{} for _ in stages]
    for key, style in tp_plan.items():
        owner = [i for i, mods in enumerate(names) if key in mods and key]
        if not owner:
            every = sorted({k for mods in names for k in mods if k})
            raise ValueError(f"tp_plan names no module {key!r}." + did_you_mean(key, every))
        plans[owner[0]][key] = style
    return plans


def _parallelize(
    stages: list[PrecisionModule],
    plans: list[dict[str, Any]],
    tp_mesh: Any,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """Shard each stage over the tp mesh; the optimizer then holds the new (DTensor) params."""
    from torch.distributed.tensor.parallel import parallelize_module

    before = {id(p): (i, n) for i, s in enumerate(stages) for n, p in s.module.named_parameters()}
    for stage, plan in zip(stages, plans, strict=True):
        if plan:
            parallelize_module(stage.module, tp_mesh, plan)
    if optimizer is None:
        return
    after = [dict(s.module.named_parameters()) for s in stages]
    for group in optimizer.param_groups:
        group["params"] = [after[before[id(p)][0]][before[id(p)][1]] for p in group["params"]]
