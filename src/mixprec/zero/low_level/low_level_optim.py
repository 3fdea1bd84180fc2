"""Colossal-AI's `LowLevelZeroOptimizer(optimizer, ...)`: ZeRO-1/2 built directly by a script.

A thin face over mixprec.parallel.zero.ZeroOptimizer, the one ZeRO (LowLevelZeroPlugin builds the
same one): Colossal's keywords become a Policy through the plugin's own translators
(ScalerKeywords, zero_policy) and the optimizer is built by the core's prepare_optimizer. The
model is not converted: as in Colossal, the precision is the params' dtype (forced_dtype casts
them first): fp16 params get fp32 masters and a dynamic loss scale, bf16 params fp32 masters,
fp32 params neither.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from mixprec.amp_type import ZERO_OPTIMIZER_SCALER, ScalerKeywords
from mixprec.booster.plugin.low_level_zero import zero_policy
from mixprec.booster.plugin.plugin_base import refuse_non_defaults
from mixprec.core.prepare import prepare_optimizer
from mixprec.core.scaling import ProcessGroup
from mixprec.core.validate import check_bool, check_max_norm
from mixprec.mixed_precision import OptimizerWrapperAPI
from mixprec.parallel.zero import (
    ZeroOptimizer,
    check_communication_dtype,
    check_cpu_offload,
    check_fp8_communication,
)

PRECISION_OF_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_SCALER = ScalerKeywords.defaults(ZERO_OPTIMIZER_SCALER)  # Colossal's signature defaults


class LowLevelZeroOptimizer(OptimizerWrapperAPI, ZeroOptimizer):
    """ZeRO stage 1 (or 2 with partition_grad=True) with Colossal-AI's signature.

    Args:
        optimizer: a torch optimizer over the model's params (fp16, bf16 or fp32, one dtype).
        pg_to_param_list: must be None (one data-parallel group for every param).
        initial_scale ... max_scale: the fp16 loss scaler (Megatron's hysteresis rule); unused
            for bf16/fp32 params, as in Colossal.
        clip_grad_norm: clip the gradients by their 2-norm over the whole model (0: off).
        verbose: also log every loss-scale change and why.
        reduce_bucket_size: at most this many gradient elements per collective.
        communication_dtype: the dtype gradients are summed in (None: mixprec.parallel.zero's
            choice; over gloo fp32).
        overlap_communication: reduce each bucket during backward (async), bit-identical to
            reducing at step(); every rank's backward must give grads to the same params.
        partition_grad: ZeRO-2 (gradients kept only by their owner) instead of ZeRO-1.
        cpu_offload: masters and state in CPU memory: with the params on the CPU a no-op that
            says so (a WARNING); with them on an accelerator refused (not supported yet).
        dp_process_group: the data-parallel group (None: the default group).
        extra_dp_group: must be None (one flat data-parallel group).
        forced_dtype: cast every param to this dtype first (torch.float16 / bfloat16 / float32).
        master_weights: fp32 masters of fp16/bf16 params (False: step them directly).
        overlap_allgather: must be False (params are gathered at the end of step()).
        fp8_communication: gradients travel in fp8 with a per-bucket power-of-two scale.
        backward_context: a callable returning a context manager backward() runs inside.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        pg_to_param_list: dict[Any, list[nn.Parameter]] | None = None,
        initial_scale: float = _SCALER.initial_scale,
        min_scale: float = _SCALER.min_scale,
        growth_factor: float = _SCALER.growth_factor,
        backoff_factor: float = _SCALER.backoff_factor,
        growth_interval: int = _SCALER.growth_interval,
        hysteresis: int = _SCALER.hysteresis,
        max_scale: float = _SCALER.max_scale,
        clip_grad_norm: float = 0.0,
        verbose: bool = False,
        reduce_bucket_size: int = 1024 * 1024,
        communication_dtype: torch.dtype | None = None,
        overlap_communication: bool = False,
        partition_grad: bool = False,
        cpu_offload: bool = False,
        dp_process_group: ProcessGroup | None = None,
        extra_dp_group: ProcessGroup | None = None,
        forced_dtype: torch.dtype | None = None,
        master_weights: bool = True,
        overlap_allgather: bool = False,
        fp8_communication: bool = False,
        backward_context: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> None:
        refuse_non_defaults(
            "LowLevelZeroOptimizer",
            locals(),
            {
                "pg_to_param_list": (
                    None,
                    "every param is sharded over one data-parallel group (dp_process_group)",
                ),
                "extra_dp_group": (None, "the data-parallel group is one level"),
                "overlap_allgather": (
                    False,
                    "the updated params are gathered at the end of step(), not overlapped with "
                    "the next forward",
                ),
            },
        )
        who = "LowLevelZeroOptimizer"
        for name, value in (
            ("verbose", verbose),
            ("overlap_communication", overlap_communication),
            ("partition_grad", partition_grad),
            ("cpu_offload", cpu_offload),
            ("master_weights", master_weights),
        ):
            check_bool(f"{who}: {name}", value)
        if backward_context is not None and not callable(backward_context):
            raise TypeError(
                f"{who}(backward_context={backward_context!r}) must be a callable returning a "
                "context manager, or None."
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{who}(optimizer=...) must be a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}."
            )
        if (
            isinstance(reduce_bucket_size, bool)
            or not isinstance(reduce_bucket_size, int)
            or reduce_bucket_size < 1
        ):
            raise ValueError(
                f"{who}(reduce_bucket_size={reduce_bucket_size!r}) must be a positive int "
                "(gradient elements per collective)."
            )
        check_max_norm(f"{who}: clip_grad_norm", clip_grad_norm)
        check_communication_dtype(communication_dtype, who)
        check_fp8_communication(fp8_communication, communication_dtype, who)
        # checked under Colossal's names even where the precision does not scale
        scaler = ScalerKeywords.of(locals()).scaler(ZERO_OPTIMIZER_SCALER)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if not params:
            raise ValueError(f"{who}: the optimizer holds no parameters.")
        if forced_dtype is not None and forced_dtype not in PRECISION_OF_DTYPE:
            raise ValueError(
                f"{who}(forced_dtype={forced_dtype!r}); valid: {list(PRECISION_OF_DTYPE)} or None."
            )
        check_cpu_offload(cpu_offload, params[0].device)
        # Every check above runs before the model is touched: a refused call leaves it as it was.
        if forced_dtype is not None:
            with torch.no_grad():
                for p in params:
                    p.data = p.data.to(forced_dtype)  # as Colossal: the model's params, in place
        dtypes = sorted({str(p.dtype) for p in params})
        if len(dtypes) > 1 or params[0].dtype not in PRECISION_OF_DTYPE:
            raise ValueError(
                f"{who}: the params have dtypes {dtypes}; they must share one of "
                f"{list(PRECISION_OF_DTYPE)} (cast the model, or pass forced_dtype=)."
            )
        precision = PRECISION_OF_DTYPE[params[0].dtype]
        policy = replace(
            zero_policy(precision, scaler, master_weights), verbosity=2 if verbose else 1
        )
        self._dtype = params[0].dtype
        self._backward_context = backward_context

        def build(*args: Any, **kwargs: Any) -> LowLevelZeroOptimizer:
            ZeroOptimizer.__init__(self, *args, **kwargs)
            return self

        # The core's one mapping of a Policy onto an optimizer's constructor (scaler, masters,
        # clip, verbosity), building this instance as the plugin builds its ZeroOptimizer.
        prepare_optimizer(
            optimizer,
            policy,
            max_norm=clip_grad_norm,
            process_group=dp_process_group,
            optimizer_cls=build,  # type: ignore[arg-type]
            stage=2 if partition_grad else 1,
            communication_dtype=communication_dtype,
            reduce_bucket_numel=reduce_bucket_size,
            overlap_communication=overlap_communication,
            fp8_communication=fp8_communication,
        )

    def __del__(self) -> None:
        """Colossal's subclasses call super().__del__(). Nothing needs releasing by hand; with
        overlap_communication the gradient hooks parallel/zero.py puts on the params hold this
        optimizer, so it is not collected while its model lives (an xfail in
        tests/test_colossal_zero_ported.py; Colossal removes its hooks here)."""

    @property
    def dtype(self) -> torch.dtype:
        """The params' dtype (the working precision)."""
        return self._dtype

    @property
    def num_param_groups(self) -> int:
        return len(self.optim.param_groups)

    @property
    def require_grad_sync(self) -> bool:
        """False inside no_sync()."""
        return self.buckets.syncs

    @override
    def backward(
        self,
        loss: torch.Tensor,
        inputs: Any = None,
        retain_graph: bool = False,
    ) -> None:
        """Backward of the scaled loss (inside backward_context when one was given)."""
        context = contextlib.nullcontext() if self._backward_context is None else None
        with context or self._backward_context():  # type: ignore[misc]
            super().backward(loss, inputs=inputs, retain_graph=retain_graph)

    def get_param_grad(self, working_param: nn.Parameter) -> torch.Tensor | None:
        """The data-parallel group's mean of working_param's current gradient, whole and in its
        dtype (still carrying the loss scale, as Colossal's); None when no rank holds one.

        A collective over the group (every rank must call it), summed in fp32 whatever the
        communication format the step uses; grads a previous step left (the core's
        carry: GradTransfer.give_back) are part of the sum, as they will be at the next step."""
        if not any(working_param is p for p in self.all_params):
            raise ValueError(
                "get_param_grad: this parameter is not one this optimizer steps (pass a param "
                "of the model whose optimizer it wraps)."
            )
        grad = working_param.grad
        flat = torch.zeros(
            working_param.numel() + 1, dtype=torch.float32, device=working_param.device
        )
        if grad is not None:
            flat[:-1] = grad.detach().reshape(-1).float()
            flat[-1] = 1.0  # how many ranks hold a gradient
        if self.world > 1:
            dist.all_reduce(flat, group=self.shard_group)
        if flat[-1] == 0:
            return None
        mean = flat[:-1] / self.world
        return mean.view_as(working_param).to(working_param.dtype)

    def _force_wait_all_gather(self) -> None:
        """Colossal waits here for overlap_allgather's gathers; mixprec gathers the updated
        params inside step() (overlap_allgather is refused), so none is in flight."""

    def update_master_params(self, model: nn.Module) -> None:
        """Copy the model's params into the fp32 masters this rank holds (after the model's
        weights were loaded apart from the optimizer)."""
        lp_to_hp = {id(lp): hp for lp, hp in zip(self.lp_params, self.hp_masters, strict=True)}
        with torch.no_grad():
            for p in model.parameters():
                hp = lp_to_hp.get(id(p))
                if hp is not None:
                    hp.copy_(p)

    @override
    def state_dict(  # type: ignore[override]
        self,
        pinned_state_dicts: dict[str, dict[str, torch.Tensor]] | None = None,
        only_on_master: bool = False,
    ) -> dict[str, Any] | None:
        """The whole (unsharded) optimizer state, in torch's layout plus mixprec's keys
        (fp32 masters, scaler): on every rank, or with only_on_master=True on group rank 0
        (None elsewhere). A collective: every rank must call it."""
        if pinned_state_dicts is not None:
            raise NotImplementedError(
                "LowLevelZeroOptimizer.state_dict(pinned_state_dicts=...) is not supported by "
                "mixprec: the gathered state is built in ordinary CPU memory. Leave it None."
            )
        gathered = self.gathered_state_dict()
        if only_on_master or self.world == 1:
            return gathered
        box = [gathered]
        dist.broadcast_object_list(box, src=self.layout.global_rank(0), group=self.shard_group)
        return box[0]

    def state_dict_shard(
        self,
        max_shard_size: int = 1024,
        pinned_state_dicts: dict[str, dict[str, torch.Tensor]] | None = None,
        only_on_master: bool = False,
    ) -> Iterator[tuple[dict[int, dict[str, Any]], float]]:
        """state_dict()'s per-param 'state' in blocks of at most max_shard_size MB (a param
        whose state is larger alone in its own), each with its size in MB, as Colossal's.

        The state is gathered whole first (a collective: every rank must iterate it); with
        only_on_master=True the other ranks get one empty block."""
        if pinned_state_dicts is not None:
            raise NotImplementedError(
                "LowLevelZeroOptimizer.state_dict_shard(pinned_state_dicts=...) is not "
                "supported by mixprec: the gathered state is built in ordinary CPU memory. "
                "Leave it None."
            )
        if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int | float):
            raise TypeError(f"state_dict_shard(max_shard_size={max_shard_size!r}) must be MB.")
        if not max_shard_size > 0:
            raise ValueError(f"state_dict_shard(max_shard_size={max_shard_size!r}) must be > 0.")
        state = self.state_dict(only_on_master=only_on_master)
        block: dict[int, dict[str, Any]] = {}
        size = 0.0
        for index, param_state in ({} if state is None else state["state"]).items():
            mb = (
                sum(
                    v.numel() * v.element_size()
                    for k, v in param_state.items()
                    if torch.is_tensor(v) and k != "step"
                )
                / 1024**2
            )
            if block and size + mb > max_shard_size:
                yield block, size
                block, size = {}, 0.0
            block[index] = param_state
            size += mb
        yield block, size

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole optimizer state (state_dict()'s, a torch optimizer's over the same
        params, or a plain mixprec one); each rank keeps its own shard. Every rank passes it.

        As Colossal's, a torch optimizer's state (no fp32 masters, no scaler in it) loads the
        optimizer state only: the params, their masters and the loss scale stay as they are
        (the masters follow the model's weights: update_master_params after loading those)."""
        kept: list[torch.Tensor] = []
        if "master_weights" not in state_dict:
            kept = [*self.all_params, *self.hp_masters]
        saved = [t.detach().clone() for t in kept]
        scaler = None if "scaler" in state_dict else self.scaler.state_dict()
        # As torch's load_state_dict, the loaded state replaces whatever the inner optimizer held
        # (a script may have emptied it by hand, e.g. `optim.state = []`).
        self.optim.state = defaultdict(dict)
        self.load_gathered_state_dict(state_dict)
        with torch.no_grad():
            for t, value in zip(kept, saved, strict=True):
                t.copy_(value)  # not the stand-ins the unsharded load rebuilt them from
        if scaler is not None:
            self.scaler.load_state_dict(scaler)
