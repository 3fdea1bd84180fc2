"""HybridParallelPlugin: Colossal-AI's pipeline x tensor x data parallel plugin over
mixprec.parallel.pipeline.schedule.

With a pipeline (pp_size > 1) the schedule runs forward and backward:

    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=4, precision="fp16")
    booster = Booster(plugin=plugin)
    model, optimizer, criterion, _, _ = booster.boost(model, optimizer, criterion)
    out = booster.execute_pipeline(iter(loader), model, criterion, optimizer)
    optimizer.step(); optimizer.zero_grad()

Without one (pp_size=1: tensor parallelism and/or ZeRO) the ordinary loop does, as in
Colossal-AI, where execute_pipeline is refused:

    plugin = HybridParallelPlugin(tp_size=2, pp_size=1, zero_stage=1, tp_plan=plan)
    loss = criterion(model(x), y)
    booster.backward(loss, optimizer)
    optimizer.step(); optimizer.zero_grad()

The world is split into pp_size pipeline stages x tp_size tensor-parallel ranks per stage x
the rest data-parallel replicas.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from mixprec.amp_type import HYBRID_SCALER, ScalerKeywords
from mixprec.booster.checkpoint_io import is_dcp_directory, load_state_file
from mixprec.booster.plugin.low_level_zero import (
    PRECISIONS,
    LowLevelZeroPlugin,
    zero_policy,
)
from mixprec.booster.plugin.plugin_base import (
    Plugin,
    is_distributed,
    rank_and_world,
    refuse_non_defaults,
)
from mixprec.core.validate import check_max_norm
from mixprec.fp8.config import Float8Config
from mixprec.fp8.settings import to_float8_config, with_fp8
from mixprec.mixed_precision import (
    ColossalPipelineOptimizer,
    ColossalPipelineZeroOptimizer,
    FP32Precision,
    MixedPrecision,
    to_mixed_precision,
)
from mixprec.parallel.comm import to_fp8_comm_dtype
from mixprec.parallel.pipeline.checkpoint import (
    load_pipeline_model_state,
    load_pipeline_optimizer_state,
    owns_key,
    pipeline_model_state,
    pipeline_optimizer_state,
    template_from_metadata,
)
from mixprec.parallel.pipeline.optim import StageOptimizer
from mixprec.parallel.pipeline.schedule import (
    PipelineConfig,
    PipelinedModel,
    check_pp_size,
    data_shard,
    next_batch,
    prepare_pipeline,
)
from mixprec.parallel.zero import check_cpu_offload

SHARDFORMER = "a shardformer feature mixprec does not have (tensor parallelism is tp_plan)"
DDP_KNOB = (
    "the hybrid plugin averages data-parallel gradients itself at step() (no DDP wrapper); "
    "ZeRO is zero_stage"
)


_SCALER = ScalerKeywords.defaults(HYBRID_SCALER)  # Colossal's signature defaults

REFUSED: dict[str, tuple[Any, str]] = {
    # Colossal's keywords mixprec does not implement: name -> (the default, why not)
    "sp_size": (None, "sequence parallelism is " + SHARDFORMER),
    "enable_all_optimization": (False, "fused kernels are " + SHARDFORMER),
    "enable_fused_normalization": (False, "fused normalization is " + SHARDFORMER),
    "enable_flash_attention": (False, "flash attention is " + SHARDFORMER),
    "enable_jit_fused": (False, "jit-fused ops are " + SHARDFORMER),
    "enable_sequence_parallelism": (False, "sequence parallelism is " + SHARDFORMER),
    "sequence_parallelism_mode": (None, "sequence parallelism is " + SHARDFORMER),
    "enable_sequence_overlap": (False, "sequence overlap is " + SHARDFORMER),
    "parallel_output": (True, "gathering vocab-parallel outputs is " + SHARDFORMER),
    "custom_policy": (None, "a shard policy is " + SHARDFORMER),
    "gradient_checkpoint_config": (
        None,
        "wrap layers in torch.utils.checkpoint yourself; shardformer's gradient checkpoint "
        "config is " + SHARDFORMER,
    ),
    "make_vocab_size_divisible_by": (64, "vocab padding is " + SHARDFORMER),
    "inner_ring_size": (None, "ring attention is " + SHARDFORMER),
    "broadcast_buffers": (True, DDP_KNOB),
    "ddp_bucket_cap_mb": (25, DDP_KNOB),
    "find_unused_parameters": (False, DDP_KNOB),
    "check_reduction": (False, DDP_KNOB),
    "gradient_as_bucket_view": (False, DDP_KNOB),
    "static_graph": (False, DDP_KNOB),
    "overlap_allgather": (False, "ZeRO gathers params at the end of step()"),
    "enable_metadata_cache": (
        True,
        "torch.distributed.pipelining infers stage shapes once by itself",
    ),
    "overlap_p2p": (True, "torch.distributed.pipelining batches its p2p ops itself"),
    "dp_outside": (True, "the mesh is (dp, pp, tp): data parallel outside"),
}
"""The refusal table: a keyword set away from its default raises NotImplementedError."""

ZERO_KEYWORDS: dict[str, Any] = {
    "zero_bucket_size_in_m": 12,
    "cpu_offload": False,
    "communication_dtype": None,
    "overlap_communication": False,
}
"""ZeRO's keywords and their defaults: set away from them they need zero_stage 1 or 2."""


@dataclass(frozen=True, kw_only=True)
class HybridSettings:
    """HybridParallelPlugin's keywords, checked and parsed once (what the plugin runs on)."""

    pipeline: PipelineConfig
    """The pipeline (pp_size=1: one stage, the model itself) and tp_size."""
    num_layers_per_stage: list[int] | None
    """Colossal's top-level layers per stage (cut at configure), or None."""
    tp_plan: dict[str, Any] | None
    """Module name -> torch ParallelStyle (tp_size > 1), or None."""
    precision: MixedPrecision | None
    """The one precision channel: its Policy reaches the core (None: the Booster's)."""
    max_norm: float
    """Clip by the norm over every stage and shard (0: off)."""
    zero_stage: int
    """0, 1 or 2."""
    fp8_communication: torch.dtype | None
    """The fp8 dtype data-parallel gradients travel in, or None."""
    zero: LowLevelZeroPlugin | None
    """pp = tp = 1 with ZeRO: the LowLevelZeroPlugin over this precision's Policy."""
    stage_zero: LowLevelZeroPlugin | None
    """pp or tp > 1 with ZeRO: ZeRO's settings per stage (only they are read from it)."""

    @classmethod
    def parse(cls, given: dict[str, Any]) -> HybridSettings:
        """given: the plugin's keywords (its locals()); every check raises naming the value."""
        refuse_non_defaults("HybridParallelPlugin", given, REFUSED)
        zero_stage, max_norm = given["zero_stage"], given["max_norm"]
        if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2):
            raise ValueError(f"HybridParallelPlugin(zero_stage={zero_stage!r}); valid: 0, 1, 2.")
        for name, default in ZERO_KEYWORDS.items():
            if zero_stage == 0 and given[name] != default:
                raise ValueError(
                    f"HybridParallelPlugin({name}={given[name]!r}) is a ZeRO setting: it "
                    "needs zero_stage=1 or 2."
                )
        check_max_norm("max_norm", max_norm)
        pipeline, layers = _pipeline_config(given)
        tp_size, tp_plan = given["tp_size"], dict(given["tp_plan"] or {}) or None
        if (tp_size != 1) != bool(tp_plan):
            raise ValueError(
                f"tp_size={tp_size!r} with tp_plan={given['tp_plan']!r}: tensor parallelism "
                "needs both tp_size > 1 and tp_plan (module name -> torch ParallelStyle), or "
                "neither."
            )
        precision = _hybrid_precision(
            given["precision"], ScalerKeywords.of(given), given["use_fp8"]
        )
        zero, stage_zero = _zero_settings(given, precision)
        return cls(
            pipeline=pipeline,
            num_layers_per_stage=layers,
            tp_plan=tp_plan,
            precision=precision,
            max_norm=float(max_norm),
            zero_stage=zero_stage,
            fp8_communication=to_fp8_comm_dtype(given["fp8_communication"], "HybridParallelPlugin"),
            zero=zero,
            stage_zero=stage_zero,
        )


def _pipeline_config(given: Mapping[str, Any]) -> tuple[PipelineConfig, list[int] | None]:
    """The PipelineConfig and num_layers_per_stage of the plugin's pipeline keywords."""
    pp_size, pp_style, pp_schedule = given["pp_size"], given["pp_style"], given["pp_schedule"]
    m, per, chunks = given["num_microbatches"], given["microbatch_size"], given["num_model_chunks"]
    layers, split_points = given["num_layers_per_stage"], given["split_points"]
    if pp_schedule is not None and pp_style not in ("1f1b", pp_schedule):
        raise ValueError(
            f"pp_style={pp_style!r} and pp_schedule={pp_schedule!r} disagree; pp_schedule "
            "is mixprec's older name for pp_style: set one."
        )
    schedule = pp_schedule or pp_style
    if layers is not None and split_points is not None:
        raise ValueError("num_layers_per_stage and split_points both cut stages; set one.")
    if m is not None and per is not None:
        raise ValueError(
            f"num_microbatches={m!r} and microbatch_size={per!r} both set how a batch is "
            "split; set one (Colossal-AI takes one of the two)."
        )
    if pp_size == 1:
        _check_no_pipeline_keywords(given)
    if m is None and per is None:
        if pp_size != 1:
            raise ValueError(
                f"num_microbatches=None and microbatch_size=None: pp_size={pp_size} needs "
                "one of them set (num_microbatches >= pp_size micro-batches per batch, or "
                "microbatch_size samples per micro-batch; either must divide the batch)."
            )
        m = 1  # one stage: the whole batch at once, as without a pipeline
    if chunks not in (None, 1) and schedule != "interleaved":
        raise ValueError(
            f"num_model_chunks={chunks!r} needs pp_style='interleaved' (got {schedule!r}, "
            "which runs one stage per rank)."
        )
    config = PipelineConfig(
        pp_size=pp_size,
        num_microbatches=m,
        microbatch_size=per,
        schedule=schedule,
        num_model_chunks=chunks if schedule == "interleaved" else None,
        split_points=None if split_points is None else tuple(split_points),
        tp_size=given["tp_size"],
    )
    if layers is not None:
        stages = pp_size * config.chunks
        layers = list(layers)
        if len(layers) != stages or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in layers
        ):
            raise ValueError(
                f"num_layers_per_stage={given['num_layers_per_stage']!r} must be {stages} "
                "positive ints (pp_size x num_model_chunks stages)."
            )
    return config, layers


def _zero_settings(
    given: Mapping[str, Any], precision: MixedPrecision | None
) -> tuple[LowLevelZeroPlugin | None, LowLevelZeroPlugin | None]:
    """(ZeRO over the world for pp = tp = 1, ZeRO's settings per stage otherwise)."""
    stage, pp_size, tp_size = given["zero_stage"], given["pp_size"], given["tp_size"]
    if not stage:
        return None, None
    zero_keywords = {
        "reduce_bucket_size_in_m": given["zero_bucket_size_in_m"],
        "communication_dtype": given["communication_dtype"],
        "fp8_communication": given["fp8_communication"],
        "cpu_offload": given["cpu_offload"],
    }
    if pp_size != 1 or tp_size != 1:
        if given["overlap_communication"]:
            raise ValueError(
                f"HybridParallelPlugin(overlap_communication=True, pp_size={pp_size}, "
                f"tp_size={tp_size}): each micro-batch's backward would redo its buckets' "
                "reduction (num_microbatches times the communication); with a pipeline or "
                "tensor parallelism ZeRO reduces once, at step(). Leave "
                "overlap_communication False."
            )
        # checked as LowLevelZeroPlugin checks them; the stages run this plugin's precision
        return None, LowLevelZeroPlugin(stage=stage, precision="fp32", **zero_keywords)
    name = given["precision"]
    if not (isinstance(name, str) and name in PRECISIONS) or precision is None:
        raise NotImplementedError(
            f"HybridParallelPlugin(zero_stage={stage}, pp_size=1) is LowLevelZeroPlugin, "
            f"which takes precision 'fp16'/'bf16'/'fp32' (got precision={name!r})."
        )
    # the precision's one channel: its Policy (scaler and fp8 included), with the clip
    policy = replace(precision.policy, max_norm=float(given["max_norm"]))
    zero = LowLevelZeroPlugin(
        stage=stage,
        policy=policy,
        overlap_communication=given["overlap_communication"],
        **zero_keywords,
    )
    return zero, None


class HybridParallelPlugin(Plugin):
    """Pipeline (x tensor x data) parallelism under any precision, with Colossal-AI's keywords.

    The keywords are parsed and checked once, into HybridSettings.

    Colossal's keywords (its signature; what mixprec lacks is refused when set: REFUSED):
        tp_size, pp_size: tensor-parallel ranks per stage (with tp_plan) and pipeline ranks;
            pp_size x tp_size must divide the world (the rest is data parallel, outside).
        precision: 'fp16' (Colossal's default: fp16 params, fp32 masters, dynamic loss scale),
            'bf16' (bf16 params, fp32 masters), 'fp32'; or, as mixprec extensions, another
            mode name ('fp16_naive', 'fp8', ...), a MixedPrecision, or None for the
            Booster's mixed_precision.
        zero_stage: 0, or 1 / 2: ZeRO over the data-parallel group (pp_size = tp_size = 1:
            LowLevelZeroPlugin), or with pp_size > 1 or tp_size > 1 over each stage's replicas
            of each tp index: each stage's masters and optimizer state (a DTensor's local
            shard) sharded there (PipelineZeroOptimizer).
        num_microbatches: micro-batches per batch (>= pp_size for '1f1b' and 'interleaved');
            with pp_size=1 (no pipeline) None or 1, and likewise the other pipeline keywords
            stay at what means "no schedule" (NO_PIPELINE_KEYWORDS).
        microbatch_size: samples per micro-batch instead (the count is the batch size over it,
            fixed at the first batch); exactly one of the two with pp_size > 1.
        initial_scale ... max_scale: the loss scaler of precision 'fp16' (and of the mode
            'fp16_naive', whose rule it is): mixprec.amp_type.ScalerKeywords. Passed with any
            other precision they are refused, whatever their values.
        max_norm: clip gradients to this norm over all stages (0: off).
        zero_bucket_size_in_m, cpu_offload, communication_dtype, overlap_communication: ZeRO's
            (zero_stage > 0; see LowLevelZeroPlugin).
        fp8_communication: the data-parallel gradient reduction moves fp8 (True = 'e5m2', or
            'e4m3'): ZeRO's buckets (zero_stage > 0) or, with a pipeline, the stage's
            gradients averaged over its replicas (one flat buffer); see mixprec.parallel.comm.
        pp_style: '1f1b', 'gpipe' or 'interleaved' (torch's schedules); pp_schedule is
            mixprec's older spelling of it.
        num_model_chunks: stages per rank for 'interleaved' (default 2 there, else 1).
        num_layers_per_stage: top-level layers of an nn.Sequential per stage (else balanced by
            parameter count).
        use_fp8: eligible Linear layers compute in float8 (mixprec.fp8), with precision
            'fp16', 'bf16' or 'fp32': True (Colossal's: Float8Config(), recipe 'tensorwise'),
            or as mixprec's extension a recipe name, a Float8Config or a dict of its fields.
        dp_outside: must be True (the mesh is (dp, pp, tp)).
    mixprec's (keyword-only):
        split_points: nn.Sequential layer names where stages 1.. begin.
        tp_plan: module name -> torch ParallelStyle (ColwiseParallel(), ...), applied to the
            stage holding each module over its tp ranks (Colossal shards by policy instead).
    """

    def __init__(
        self,
        tp_size: int = 1,
        pp_size: int = 1,
        sp_size: int | None = None,
        precision: str | MixedPrecision | None = "fp16",
        zero_stage: int = 0,
        enable_all_optimization: bool = False,
        enable_fused_normalization: bool = False,
        enable_flash_attention: bool = False,
        enable_jit_fused: bool = False,
        enable_sequence_parallelism: bool = False,
        sequence_parallelism_mode: str | None = None,
        enable_sequence_overlap: bool = False,
        parallel_output: bool = True,
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        initial_scale: float = _SCALER.initial_scale,
        min_scale: float = _SCALER.min_scale,
        growth_factor: float = _SCALER.growth_factor,
        backoff_factor: float = _SCALER.backoff_factor,
        growth_interval: int = _SCALER.growth_interval,
        hysteresis: int = _SCALER.hysteresis,
        max_scale: float = _SCALER.max_scale,
        max_norm: float = 0.0,
        broadcast_buffers: bool = True,
        ddp_bucket_cap_mb: int = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        zero_bucket_size_in_m: int = 12,
        cpu_offload: bool = False,
        communication_dtype: torch.dtype | None = None,
        overlap_communication: bool = False,
        custom_policy: Any = None,
        pp_style: str = "1f1b",
        num_model_chunks: int | None = None,
        num_layers_per_stage: list[int] | None = None,
        gradient_checkpoint_config: Any = None,
        enable_metadata_cache: bool = True,
        make_vocab_size_divisible_by: int = 64,
        dp_outside: bool = True,
        overlap_p2p: bool = True,
        overlap_allgather: bool = False,
        inner_ring_size: int | None = None,
        fp8_communication: bool = False,
        use_fp8: bool | str | Float8Config = False,
        *,
        pp_schedule: str | None = None,
        split_points: list[str] | tuple[str, ...] | None = None,
        tp_plan: Mapping[str, Any] | None = None,
    ) -> None:
        settings = HybridSettings.parse(dict(locals()))
        self.settings = settings
        self.config = settings.pipeline
        self.num_layers_per_stage = settings.num_layers_per_stage
        self.tp_plan = settings.tp_plan
        self.precision = settings.precision
        self.max_norm = settings.max_norm
        self.zero_stage = settings.zero_stage
        self.fp8_communication = settings.fp8_communication
        self._zero = settings.zero  # pp = tp = 1: ZeRO over the world
        # pp > 1 or tp > 1: ZeRO settings per stage (over each stage's data-parallel group of
        # each tp index, on the DTensors' local shards)
        self._stage_zero = settings.stage_zero
        if is_distributed():  # every rank sees the same sizes: all raise, none hangs
            check_pp_size(pp_size, dist.get_world_size(), tp_size)

    @override
    def data_rank_and_world(self) -> tuple[int, int]:
        """Shards per data-parallel replica: a replica's stages must all read the same batch."""
        if not is_distributed():
            return rank_and_world()
        return data_shard(self.config.pp_size, self.config.tp_size)

    @property
    @override
    def process_group(self):  # noqa: ANN201 - a torch ProcessGroup or None
        return None if self._zero is None else self._zero.process_group

    def _precision(self, booster_precision: MixedPrecision) -> MixedPrecision:
        if self.precision is None:
            return booster_precision
        if not isinstance(booster_precision, FP32Precision) and (
            booster_precision.policy.name != self.precision.policy.name
        ):
            raise ValueError(
                f"Booster(mixed_precision={booster_precision.policy.name!r}) and "
                f"HybridParallelPlugin(precision={self.precision.policy.name!r}) disagree; "
                "set the precision in one place."
            )
        return self.precision

    @override
    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        mixed_precision: MixedPrecision,
        device: torch.device,
    ) -> tuple[nn.Module, StageOptimizer | None]:
        precision = self._precision(mixed_precision)
        if self._zero is not None:  # pp = tp = 1: ZeRO over the world (the dp group)
            return self._zero.configure(model, optimizer, FP32Precision(), device)
        config = self.config
        if self.num_layers_per_stage is not None:
            config = replace(config, split_points=_split_points(model, self.num_layers_per_stage))
        zero = None
        if self._stage_zero is not None:  # ZeRO over each stage's data-parallel group
            settings = self._stage_zero
            check_cpu_offload(settings.cpu_offload, device)
            zero = {
                "stage": settings.stage,
                "communication_dtype": settings.communication_dtype,
                "reduce_bucket_numel": settings.reduce_bucket_numel,
                "fp8_communication": settings.fp8_communication,
            }
        return prepare_pipeline(
            model,
            optimizer,
            precision.policy,
            config,
            device=device,
            max_norm=self.max_norm,
            convert=precision.convert_module,
            tp_plan=self.tp_plan,
            fp8_communication=None if zero else self.fp8_communication,
            zero=zero,
            # the stage optimizers with Colossal's OptimizerWrapper methods, built as such
            optimizer_classes=(ColossalPipelineOptimizer, ColossalPipelineZeroOptimizer),
        )

    def execute_pipeline(
        self,
        data_iter: Any,
        model: nn.Module,
        criterion: Callable[..., torch.Tensor],
        optimizer: StageOptimizer,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        if self.config.pp_size == 1:  # Colossal-AI asserts the same ("pipeline parallelism is
            # not enabled"): without a pipeline the ordinary loop runs the model
            raise RuntimeError(
                "execute_pipeline needs HybridParallelPlugin(pp_size > 1); with pp_size=1 there "
                "is no pipeline: train with the ordinary loop (loss = criterion(model(x), y); "
                "booster.backward(loss, optimizer); optimizer.step())."
            )
        return _pipelined(model).run(
            next_batch(data_iter),
            criterion,
            optimizer,
            return_loss=return_loss,
            return_outputs=return_outputs,
        )

    @override
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Gradients are reduced at step() (ZeRO) or averaged there (pipeline): nothing to skip."""
        return contextlib.nullcontext()

    # ----- checkpoints: torch.distributed.checkpoint directories, each stage writes its part -----
    @property
    @override
    def writes_dtensor_shards(self) -> bool:  # type: ignore[override]
        return self._zero is None  # ZeRO's checkpoints are whole files

    @override
    def model_state(self, model: nn.Module, optimizer: Any) -> Any:
        if self._zero is not None:
            return self._zero.model_state(model, optimizer)
        raise NotImplementedError(
            "HybridParallelPlugin: shard=True, use_safetensors=True and gather_dtensor=True "
            "need the whole model on one rank; a pipeline's checkpoint is a "
            "torch.distributed.checkpoint directory each stage writes its part of (leave them "
            "unset; any plugin's load_model reads that directory whole)."
        )

    @override
    def optimizer_state(self, optimizer: Any, model: nn.Module | None) -> Any:
        if self._zero is not None:
            return self._zero.optimizer_state(optimizer, model)
        raise NotImplementedError(
            "HybridParallelPlugin: shard=True and gather_dtensor=True need the whole optimizer "
            "state on one rank; a pipeline's optimizer checkpoint is a "
            "torch.distributed.checkpoint directory each stage writes its part of (leave them "
            "unset)."
        )

    @override
    def save_model(
        self, model: nn.Module, path: str | os.PathLike, optimizer: StageOptimizer | None
    ) -> None:
        if self._zero is not None:
            return self._zero.save_model(model, path, optimizer)
        from mixprec.booster.plugin.torch_fsdp import _dcp_save_atomic

        _dcp_save_atomic(pipeline_model_state(_pipelined(model), optimizer), path)

    @override
    def load_model(
        self,
        model: nn.Module,
        path: str | os.PathLike,
        optimizer: StageOptimizer | None,
        strict: bool = True,
    ) -> None:
        """A pipelined checkpoint directory, or a whole-model file (single process, DDP)."""
        if self._zero is not None:
            return self._zero.load_model(model, path, optimizer, strict=strict)
        import torch.distributed.checkpoint as dcp

        piped = _pipelined(model)
        if is_dcp_directory(path):
            state = {k: v.clone() for k, v in pipeline_model_state(piped, optimizer).items()}
            dcp.load(state, checkpoint_id=os.fspath(path))
        else:
            state = load_state_file(path)
        load_pipeline_model_state(piped, state, optimizer, strict=strict)

    @override
    def save_optimizer(
        self, optimizer: StageOptimizer, path: str | os.PathLike, model: nn.Module | None
    ) -> None:
        from mixprec.booster.plugin.torch_fsdp import _dcp_save_atomic

        if self._zero is not None:
            return self._zero.save_optimizer(optimizer, path, model)
        _dcp_save_atomic(pipeline_optimizer_state(_pipelined(model), optimizer), path)

    @override
    def load_optimizer(
        self, optimizer: StageOptimizer, path: str | os.PathLike, model: nn.Module | None
    ) -> None:
        import torch.distributed.checkpoint as dcp

        if self._zero is not None:
            return self._zero.load_optimizer(optimizer, path, model)
        piped = _pipelined(model)
        metadata = dcp.FileSystemReader(os.fspath(path)).read_metadata()
        state = template_from_metadata(metadata, lambda key: owns_key(piped, optimizer, key))
        dcp.load(state, checkpoint_id=os.fspath(path))
        load_pipeline_optimizer_state(piped, optimizer, state)


NO_PIPELINE_KEYWORDS = {
    # name: the values that mean "no pipeline" (Colossal's tests pass these with pp_size=1)
    "num_microbatches": (None, 1),
    "microbatch_size": (None,),
    "pp_style": ("1f1b",),
    "pp_schedule": (None, "1f1b"),
    "num_model_chunks": (None, 1),
}
"""Pipeline keywords and what they may be at pp_size=1, where there is no schedule to run."""


def _check_no_pipeline_keywords(given: Mapping[str, Any]) -> None:
    """pp_size=1: a pipeline keyword set to split or schedule something would be ignored."""
    for name, allowed in NO_PIPELINE_KEYWORDS.items():
        if not any(given[name] is v or given[name] == v for v in allowed):
            raise ValueError(
                f"HybridParallelPlugin({name}={given[name]!r}, pp_size=1): {name} shapes a "
                f"pipeline schedule, and pp_size=1 runs none (each backward is one pass over "
                f"the batch); leave it at one of {allowed}, or set pp_size > 1."
            )


def _hybrid_precision(
    precision: str | MixedPrecision | None, keywords: ScalerKeywords, use_fp8: Any
) -> MixedPrecision | None:
    """The plugin's precision; the scaler keywords the caller passed are honoured where the
    precision has Colossal's scaler ('fp16', and the mode 'fp16_naive' of the same rule) and
    refused elsewhere, whatever their values."""
    call = "HybridParallelPlugin"
    if isinstance(precision, str) and precision in PRECISIONS:
        if precision == "fp16":
            scaler = keywords.scaler(HYBRID_SCALER)
        else:
            keywords.refuse(call, f"precision={precision!r} scales no loss")
            scaler = HYBRID_SCALER
        policy = with_fp8(zero_policy(precision, scaler, True), use_fp8, f"{call}(use_fp8)")
        return MixedPrecision(replace(policy, name=f"colossal_{precision}"))
    if to_float8_config(use_fp8, f"{call}(use_fp8)") is not None:
        raise ValueError(
            f"use_fp8={use_fp8!r} goes with precision 'fp16', 'bf16' or 'fp32'; for "
            f"precision={precision!r} use the mixprec mode 'fp8' (FP8MixedPrecision(recipe=...) "
            "or FP8MixedPrecision(config=...))."
        )
    if precision == "fp16_naive":  # Colossal's NAIVE mode: the scaler these keywords set
        mode = to_mixed_precision(precision)
        return MixedPrecision(
            replace(mode.policy, loss_scale=keywords.scaler(mode.policy.loss_scale))
        )
    keywords.refuse(
        call,
        f"precision={precision!r} brings its own loss scaler (a MixedPrecision object carries "
        "its settings, None takes the Booster's, a mixprec mode name its preset's; the scaler "
        "keywords set 'fp16' and 'fp16_naive')",
    )
    return None if precision is None else to_mixed_precision(precision)


def _split_points(model: nn.Module, layers_per_stage: list[int]) -> tuple[str, ...]:
    """Colossal's num_layers_per_stage as the names of the layers where stages 1.. begin."""
    names = [name for name, _ in model.named_children()]
    if not isinstance(model, nn.Sequential) or sum(layers_per_stage) != len(names):
        raise ValueError(
            f"num_layers_per_stage={layers_per_stage} (sum {sum(layers_per_stage)}) must cut an "
            f"nn.Sequential of as many layers; this model is a {type(model).__name__} of "
            f"{len(names)} top-level layers."
        )
    starts = list(itertools.accumulate(layers_per_stage))[:-1]
    return tuple(names[i] for i in starts)


def _pipelined(model: nn.Module | None) -> PipelinedModel:
    if not isinstance(model, PipelinedModel):
        raise TypeError(
            "HybridParallelPlugin checkpoints need the model boost() returned (a "
            f"PipelinedModel), got {type(model).__name__}."
        )
    return model
