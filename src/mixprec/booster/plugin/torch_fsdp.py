"""TorchFSDPPlugin: FSDP2 (`fully_shard`) with mixprec's loss scaling — fp16 included.

Params stay fp32 and sharded: the fp32 shards are the master weights the optimizer steps.
When the policy casts params (fp16_naive, Apex O2/O3), FSDP's MixedPrecisionPolicy casts each
unsharded copy to the low dtype for forward and backward, and gradients are reduce-scattered
in `reduce_dtype` (fp32 by default). Loss scaling runs on the sharded gradients; each rank sees
only its shard, so the overflow flag is MAX-reduced over the shard group and every rank skips
together. (Colossal-AI forbids fp16 with ZeRO/FSDP; this makes the combination work.)
Checkpoints go through torch.distributed.checkpoint: a directory, each rank writing its shards.

Lean policies (mixprec.core.lean: bf16 params without masters, e.g. 'bf16_sr', and/or
`optimizer_state`): the sharded params are the bf16 params themselves (no fp32 shard), FSDP
gathers them as they are and casts the reduce-scattered gradient back to bf16; the optimizer
steps each rank's local shard through the lean write-back (stochastic rounding from a stream
seeded per rank, low-bit state of the local shard's shape). Kept-fp32 modules (norms, @fp32)
are their own units: FSDP needs one dtype per unit.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from typing_extensions import override

from mixprec.booster.checkpoint_io import is_dcp_directory, load_state_file, swap_in_directory
from mixprec.booster.plugin.plugin_base import (
    Plugin,
    barrier,
    is_distributed,
    rank_and_world,
    refuse_non_defaults,
    unwrap_model,
)
from mixprec.core.casting import NORM_TYPES, keep_module_fp32
from mixprec.core.lean import LeanConfig, lean_config, merge_shards
from mixprec.core.optim import MixedPrecisionOptimizer
from mixprec.core.policy import Policy
from mixprec.core.prepare import set_verbosity
from mixprec.core.scaling import ProcessGroup
from mixprec.mixed_precision import ColossalMixedPrecisionOptimizer, MixedPrecision
from mixprec.parallel.comm import Fp8ReduceScatter, to_fp8_comm_dtype

ShardFilter = Callable[[str, nn.Module], bool]


def direct_children_with_params(name: str, module: nn.Module) -> bool:
    """Default sharding units: each top-level child that owns parameters (plus the root); a
    container child (ModuleList, ModuleDict) gives its children with parameters instead."""
    return "." not in name and any(True for _ in module.parameters())


class TorchFSDPPlugin(Plugin):
    """FSDP2 sharding of the model and optimizer state over all ranks.

    Colossal-AI's keywords (FSDP1's) first:
        process_group: the ranks to shard over (None: the world).
        sharding_strategy: None or ShardingStrategy.FULL_SHARD (params resharded after
            forward) or SHARD_GRAD_OP (kept unsharded from forward to backward): FSDP2's
            reshard_after_forward True / False. NO_SHARD and the hybrid strategies are refused.
        sync_module_states: broadcast rank 0's params and buffers before sharding.
        cpu_offload, auto_wrap_policy, backward_prefetch, mixed_precision, ignored_modules,
        param_init_fn: must stay None (FSDP1 options FSDP2 spells otherwise: shard_filter is
            the wrap policy, the Booster's mixed_precision and reduce_dtype the precision).
        fp8_communication: True (= 'e5m2') or 'e4m3': each FSDP unit's gradients are
            reduce-scattered in fp8 (one power-of-two scale per rank, summed in fp32:
            mixprec.parallel.comm.Fp8ReduceScatter via FSDP2's set_custom_reduce_scatter);
            the params are still all-gathered in their own dtype.
    mixprec's (keyword-only):
        reduce_dtype: dtype gradients are reduce-scattered in (fp32: no precision lost in the
            sum over ranks, and an fp16 sum of scaled gradients cannot overflow there).
        reshard_after_forward: fully_shard's option (free unsharded params after forward).
        shard_filter: (name, module) -> True for each submodule to make its own FSDP unit
            (default: every top-level child with parameters); the root is always one. A
            container picked (ModuleList, ModuleDict: fully_shard needs a forward) is replaced
            by its children with parameters.
    """

    def __init__(
        self,
        process_group: ProcessGroup | None = None,
        sharding_strategy: Any = None,
        cpu_offload: Any = None,
        auto_wrap_policy: Callable | None = None,
        backward_prefetch: Any = None,
        mixed_precision: Any = None,
        ignored_modules: Any = None,
        param_init_fn: Callable | None = None,
        sync_module_states: bool = False,
        fp8_communication: bool | str = False,
        *,
        reduce_dtype: torch.dtype = torch.float32,
        reshard_after_forward: bool | None = None,
        shard_filter: ShardFilter | None = None,
    ) -> None:
        refuse_non_defaults(
            "TorchFSDPPlugin",
            locals(),
            {
                "cpu_offload": (None, "FSDP2 on this plugin keeps params on the model's device"),
                "auto_wrap_policy": (
                    None,
                    "pass shard_filter=(name, module) -> bool to choose the FSDP units",
                ),
                "backward_prefetch": (None, "FSDP2 prefetches by itself"),
                "mixed_precision": (
                    None,
                    "set the precision with Booster(mixed_precision=...) and the reduction "
                    "dtype with reduce_dtype=",
                ),
                "ignored_modules": (None, "every parameter is sharded"),
                "param_init_fn": (None, "the model is built before boosting, not deferred"),
            },
        )
        self.fp8_communication = to_fp8_comm_dtype(fp8_communication, "TorchFSDPPlugin")
        if self.fp8_communication is not None and not hasattr(
            FSDPModule, "set_custom_reduce_scatter"
        ):
            raise NotImplementedError(
                f"TorchFSDPPlugin(fp8_communication={fp8_communication!r}) needs FSDP2's "
                f"set_custom_reduce_scatter, which torch {torch.__version__} lacks."
            )
        if reduce_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(
                f"reduce_dtype={reduce_dtype!r}; valid: torch.float32, torch.float16, "
                "torch.bfloat16."
            )
        strategy = getattr(sharding_strategy, "name", sharding_strategy)
        if strategy not in (None, "FULL_SHARD", "SHARD_GRAD_OP"):
            raise NotImplementedError(
                f"TorchFSDPPlugin(sharding_strategy={sharding_strategy!r}) is not supported by "
                "mixprec; valid: None, ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP."
            )
        by_strategy = None if strategy is None else strategy == "FULL_SHARD"
        if (
            None not in (by_strategy, reshard_after_forward)
            and by_strategy != reshard_after_forward
        ):
            raise ValueError(
                f"sharding_strategy={strategy} and reshard_after_forward={reshard_after_forward} "
                "disagree (FULL_SHARD reshards after forward, SHARD_GRAD_OP does not); set one."
            )
        if not isinstance(sync_module_states, bool):
            raise TypeError(f"sync_module_states={sync_module_states!r} must be a bool.")
        self.reduce_dtype = reduce_dtype
        self.reshard_after_forward = next(
            (v for v in (reshard_after_forward, by_strategy) if v is not None), True
        )
        self.shard_filter = shard_filter or direct_children_with_params
        self.sync_module_states = sync_module_states
        self.shard_group = process_group
        self.mesh: DeviceMesh | None = None

    @property
    @override
    def process_group(self) -> ProcessGroup | None:
        return None if self.mesh is None else self.mesh.get_group()

    def _shard(self, model: nn.Module, lp_dtype: torch.dtype | None, keep_norm_fp32: bool) -> None:
        """fully_shard model's units. lp_dtype: the dtype FSDP casts gathered params to (None:
        as stored); modules prepare_model kept fp32 inside low-precision params are own units."""
        assert self.mesh is not None
        lp_mp = MixedPrecisionPolicy(param_dtype=lp_dtype, reduce_dtype=self.reduce_dtype)
        hp_mp = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=self.reduce_dtype)
        units: list[tuple[nn.Module, MixedPrecisionPolicy]] = []
        # Containers the filter picked (ModuleList, ModuleDict: no forward of their own, which
        # fully_shard refuses): each of their children with parameters is a unit instead.
        containers: set[str] = set()
        for name, module in model.named_modules():
            if not name:
                continue
            if lp_dtype is not None and keep_norm_fp32 and isinstance(module, NORM_TYPES):
                # Own unit gathered in fp32; the core's hooks upcast its input, recast output.
                keep_module_fp32(module, lp_dtype)
                units.append((module, hp_mp))
            elif getattr(module, "_mixprec_kept_fp32", False):  # fp32 amid bf16 params (lean)
                units.append((module, hp_mp))
            elif self.shard_filter(name, module) or (
                name.rpartition(".")[0] in containers and any(True for _ in module.parameters())
            ):
                if type(module).forward is nn.Module.forward:
                    containers.add(name)
                else:
                    units.append((module, lp_mp))
        # named_modules is pre-order: reversed, every child is sharded before its parent.
        for module, mp in reversed(units):
            fully_shard(
                module,
                mesh=self.mesh,
                mp_policy=mp,
                reshard_after_forward=self.reshard_after_forward,
            )
        fully_shard(
            model, mesh=self.mesh, mp_policy=lp_mp, reshard_after_forward=self.reshard_after_forward
        )
        if self.fp8_communication is not None:
            for module, _ in units:
                module.set_custom_reduce_scatter(Fp8ReduceScatter(self.fp8_communication))
            model.set_custom_reduce_scatter(Fp8ReduceScatter(self.fp8_communication))

    @override
    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        mixed_precision: MixedPrecision,
        device: torch.device,
    ) -> tuple[nn.Module, MixedPrecisionOptimizer | None]:
        if not is_distributed():
            raise RuntimeError(
                "TorchFSDPPlugin needs torch.distributed initialised first: call "
                "mixprec.launch.launch_from_torch() (or launch) before boosting."
            )
        policy = mixed_precision.policy
        if policy.num_losses != 1:  # per-loss unscaling is not written for sharded grads
            raise ValueError(
                f"num_losses={policy.num_losses} is not supported with TorchFSDPPlugin; use "
                "TorchDDPPlugin (or one loss scaler) for several losses."
            )
        lean = lean_config(policy)
        if _shards_low_precision_params(policy, lean):
            # Lean: the bf16 params are what is sharded and stepped; FSDP casts nothing.
            lp_dtype, shard_policy = None, policy
        else:
            lp_dtype = policy.param_dtype if policy.casts_params else None
            # FSDP casts the gathered params; the fp32 shards are the masters (no second copy).
            shard_policy = replace(policy, param_dtype=torch.float32, master_weights=False)
        model = model.to(device)
        names_before = {id(p): name for name, p in model.named_parameters()}
        boosted = mixed_precision.convert_module(model, shard_policy)
        if self.shard_group is None:
            self.mesh = init_device_mesh(device.type, (rank_and_world()[1],))
        else:
            self.mesh = DeviceMesh.from_group(self.shard_group, device.type)
        if self.sync_module_states:  # every rank starts from rank 0's weights and buffers
            group = self.mesh.get_group()
            for t in itertools.chain(boosted.module.parameters(), boosted.module.buffers()):
                dist.broadcast(t.detach(), src=dist.get_global_rank(group, 0), group=group)
        self._shard(boosted.module, lp_dtype, policy.keep_norm_fp32)
        if optimizer is None:
            return boosted, None
        _point_optimizer_at_shards(optimizer, names_before, boosted.module)
        mp_optimizer = ColossalMixedPrecisionOptimizer(  # with Colossal's OptimizerWrapper methods
            optimizer,
            loss_scale=shard_policy.loss_scale,
            master_weights=False,
            max_norm=policy.max_norm,  # a mode's own clip (NAIVE's clip_grad_norm, a config's)
            process_group=self.process_group,
            log_num_zeros_in_grad=shard_policy.log_num_zeros_in_grad,
            lean=lean,
        )
        set_verbosity(mp_optimizer, policy.verbosity)  # Apex verbosity / NAIVE verbose
        return boosted, mp_optimizer

    @override
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return _no_gradient_sync(unwrap_model(model))

    # ----- checkpoints: torch.distributed.checkpoint directories -----
    writes_dtensor_shards = True

    @override
    def model_state(self, model: nn.Module, optimizer: MixedPrecisionOptimizer | None) -> Any:
        """The full state gathered to rank 0 (CPU tensors; a collective: every rank calls)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(unwrap_model(model), options=options)

    @override
    def load_model_state(
        self,
        model: nn.Module,
        state: dict[str, Any],
        optimizer: MixedPrecisionOptimizer | None,
        strict: bool = True,
    ) -> None:
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(unwrap_model(model), state, options=options)

    @override
    def optimizer_state(self, optimizer: MixedPrecisionOptimizer, model: nn.Module | None) -> Any:
        _refuse_lean_checkpoint(optimizer)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return _optimizer_state(optimizer, model, options)

    @override
    def load_optimizer_state(
        self, optimizer: MixedPrecisionOptimizer, state: dict[str, Any], model: nn.Module | None
    ) -> None:
        _refuse_lean_checkpoint(optimizer)
        _load_optimizer_state(optimizer, model, state, StateDictOptions(full_state_dict=True))

    @override
    def save_model(
        self, model: nn.Module, path: str | os.PathLike, optimizer: MixedPrecisionOptimizer | None
    ) -> None:
        _dcp_save_atomic(get_model_state_dict(unwrap_model(model)), path)

    @override
    def load_model(
        self,
        model: nn.Module,
        path: str | os.PathLike,
        optimizer: MixedPrecisionOptimizer | None,
        strict: bool = True,
    ) -> None:
        user_model = unwrap_model(model)
        if not is_dcp_directory(path):  # a full state: each rank reads it all
            self.load_model_state(model, load_state_file(path), optimizer, strict=strict)
            return
        state = get_model_state_dict(user_model)
        dcp.load(state, checkpoint_id=os.fspath(path))
        set_model_state_dict(user_model, state, options=StateDictOptions(strict=strict))

    @override
    def save_optimizer(
        self, optimizer: MixedPrecisionOptimizer, path: str | os.PathLike, model: nn.Module | None
    ) -> None:
        if optimizer.lean is not None:  # each rank's own state: its shard's, its random stream
            state = optimizer.state_dict()
            _save_atomic(lambda tmp: torch.save(state, tmp / _lean_file()), path)
            return
        _dcp_save_atomic(_optimizer_state(optimizer, model), path)

    @override
    def load_optimizer(
        self, optimizer: MixedPrecisionOptimizer, path: str | os.PathLike, model: nn.Module | None
    ) -> None:
        saved_lean = sorted(p.name for p in Path(path).glob("lean_rank*_of_*.pt"))
        if optimizer.lean is not None or saved_lean:
            _load_lean_state(optimizer, Path(path), saved_lean)
            return
        if not is_dcp_directory(path):  # a gathered full state
            self.load_optimizer_state(optimizer, load_state_file(path), model)
            return
        state = _optimizer_state(optimizer, model)
        dcp.load(state, checkpoint_id=os.fspath(path))
        _load_optimizer_state(optimizer, model, state)


def _shards_low_precision_params(policy: Policy, lean: LeanConfig | None) -> bool:
    """The lean write-back steps the low-precision params themselves: no fp32 shard to keep."""
    return lean is not None and policy.casts_params and not policy.master_weights


def _refuse_lean_checkpoint(optimizer: MixedPrecisionOptimizer) -> None:
    """torch.distributed.checkpoint's optimizer state dicts expect DTensor state shaped like
    the params; the lean write-back keeps plain per-rank tensors (torchao codes + scales for
    low bit) of each local shard, which they would gather wrong."""
    if optimizer.lean is not None:
        cfg = optimizer.lean.cfg
        raise NotImplementedError(
            "TorchFSDPPlugin cannot gather a lean optimizer's state into one file "
            f"(optimizer_state={cfg.state!r}, update_rounding={cfg.rounding!r}): its state is "
            "per-rank local shards. Save it unsharded with the default gather_dtensor (one "
            "file per rank, loaded on any number of ranks)."
        )


def _lean_file() -> str:
    """This rank's file in a lean optimizer checkpoint directory."""
    return _lean_file_of(*rank_and_world())


def _lean_file_of(rank: int, world: int) -> str:
    return f"lean_rank{rank}_of_{world}.pt"


def _load_lean_state(optimizer: MixedPrecisionOptimizer, path: Path, saved: list[str]) -> None:
    """Each rank loads the file its rank wrote when as many ranks load as saved (bit for bit:
    the saved codes and streams). On another rank count every rank reads all the files and
    takes its rows of each param's state (lean.merge_shards: dequantized, joined, cut to its
    shard, quantized again in its blocks) and a stream mixed for its rank from the saved base
    seed, at the saved step counter."""
    cfg = None if optimizer.lean is None else optimizer.lean.cfg
    if cfg is None:
        raise ValueError(
            f"{path} holds a lean optimizer's per-rank state ({', '.join(saved)}); this "
            "optimizer is not lean: boost it with the lean policy it was saved with."
        )
    mine = path / _lean_file()
    if mine.is_file():
        optimizer.load_state_dict(torch.load(mine, map_location="cpu", weights_only=True))
        return
    rank, world = rank_and_world()
    worlds = sorted({int(name.rsplit("_of_", 1)[1].removesuffix(".pt")) for name in saved})
    if len(worlds) != 1:
        held = f"files of {' and '.join(map(str, worlds))} ranks" if worlds else "no file"
        raise ValueError(
            f"{path} is not one lean FSDP optimizer checkpoint: it holds {held} "
            f"(lean_rank*_of_*.pt: {', '.join(saved) or 'none'}); save it again into an empty "
            "folder."
        )
    (saved_world,) = worlds
    missing = [
        _lean_file_of(r, saved_world)
        for r in range(saved_world)
        if not (path / _lean_file_of(r, saved_world)).is_file()
    ]
    if missing:
        raise ValueError(
            f"{path} is a lean FSDP optimizer checkpoint of {saved_world} ranks missing "
            f"{', '.join(missing)}; this run has {world} rank{'s' if world != 1 else ''}, "
            "which needs every rank's file to reshard it."
        )
    states = [
        torch.load(path / _lean_file_of(r, saved_world), map_location="cpu", weights_only=True)
        for r in range(saved_world)
    ]
    held = [p for g in optimizer.optim.param_groups for p in g["params"]]
    optimizer.load_state_dict(merge_shards(states, held, rank))


def _user_model(model: nn.Module | None) -> nn.Module:
    """The model an FSDP optimizer was boosted with (its state is keyed by the model's FQNs)."""
    if model is None:
        raise ValueError("An FSDP optimizer checkpoint needs the model it was boosted with.")
    return unwrap_model(model)


def _optimizer_state(
    optimizer: MixedPrecisionOptimizer,
    model: nn.Module | None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """The optimizer's state as torch's get_optimizer_state_dict gives it under options (None:
    each rank's DTensor shards), with the scaler's state and the step counters."""
    return {
        "optimizer": get_optimizer_state_dict(_user_model(model), optimizer.optim, options=options),
        "scaler": optimizer.scaler.state_dict(),
        "steps": optimizer.steps,
        "skipped_steps": optimizer.skipped_steps,
    }


def _load_optimizer_state(
    optimizer: MixedPrecisionOptimizer,
    model: nn.Module | None,
    state: dict[str, Any],
    options: StateDictOptions | None = None,
) -> None:
    """Load what _optimizer_state wrote (under the same options) into optimizer."""
    set_optimizer_state_dict(
        _user_model(model), optimizer.optim, state["optimizer"], options=options
    )
    _load_counters(optimizer, state)


def _load_counters(optimizer: MixedPrecisionOptimizer, state: dict[str, Any]) -> None:
    optimizer.scaler.load_state_dict(state["scaler"])
    optimizer.steps = int(state["steps"])
    optimizer.skipped_steps = int(state["skipped_steps"])


def _point_optimizer_at_shards(
    optimizer: torch.optim.Optimizer, names_before: dict[int, str], sharded: nn.Module
) -> None:
    """fully_shard replaced every param with a DTensor one: swap them into param_groups."""
    if optimizer.state:
        raise ValueError(
            "TorchFSDPPlugin: the optimizer already has state for the unsharded params; boost "
            "it before its first step (FSDP replaces the params it would refer to)."
        )
    params_after = dict(sharded.named_parameters())
    for group in optimizer.param_groups:
        swapped = []
        for p in group["params"]:
            name = names_before.get(id(p))
            if name is None or name not in params_after:
                raise ValueError(
                    f"An optimizer param of shape {tuple(p.shape)} is not a param of the "
                    "boosted model; pass the optimizer built over this model's parameters."
                )
            swapped.append(params_after[name])
        group["params"] = swapped


@contextlib.contextmanager
def _no_gradient_sync(model: nn.Module):
    if not isinstance(model, FSDPModule):
        raise TypeError(f"no_sync needs a model boosted by TorchFSDPPlugin, got {type(model)}.")
    model.set_requires_gradient_sync(False)  # grads accumulate unsharded, no reduce-scatter
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _dcp_save_atomic(state: dict[str, Any], path: str | os.PathLike) -> None:
    """dcp.save of state, swapped in atomically (see _save_atomic)."""
    _save_atomic(lambda tmp: dcp.save(state, checkpoint_id=os.fspath(tmp)), path)


def _save_atomic(write: Callable[[Path], None], path: str | os.PathLike) -> None:
    """write(temp directory) on every rank, then rank 0 swaps it in for path.

    The previous checkpoint stays whole until the new one is complete; a crash between the two
    renames leaves it at '.<name>.old' beside path.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp"
    if rank_and_world()[0] == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a crashed save
        tmp.mkdir()
    barrier()
    write(tmp)
    barrier()  # every rank's shards are written
    if rank_and_world()[0] == 0:
        swap_in_directory(tmp, path)
    barrier()
