"""Every keyword of Colossal-AI's plugins is honoured (a behaviour check) or refused by name.

The keyword lists are recorded copies of Colossal-AI's signatures (name: default), from
hpcaitech/ColossalAI colossalai/booster/plugin/{low_level_zero_plugin, torch_ddp_plugin,
torch_fsdp_plugin, hybrid_parallel_plugin}.py (v0.4.x, with fp8_communication / use_fp8).
Each keyword is classified once: REFUSED ones must raise NotImplementedError naming them when
set away from their default; HONOURED ones must construct and are checked by the behaviour
tests below (their names are listed so a keyword cannot slip through unclassified).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_mlp
from torch import nn

from mixprec.booster import Booster
from mixprec.booster.plugin import (
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)

# ----- Colossal-AI's signatures, recorded (name: Colossal's default) -----
COLOSSAL_LOW_LEVEL_ZERO = {
    "stage": 1,
    "precision": "fp16",
    "initial_scale": 2**32,
    "min_scale": 1,
    "growth_factor": 2,
    "backoff_factor": 0.5,
    "growth_interval": 1000,
    "hysteresis": 2,
    "max_scale": 2**32,
    "max_norm": 0.0,
    "norm_type": 2.0,
    "reduce_bucket_size_in_m": 12,
    "communication_dtype": None,
    "overlap_communication": True,
    "overlap_allgather": False,
    "cpu_offload": False,
    "master_weights": True,
    "verbose": False,
    "cast_inputs": True,
    "fp8_communication": False,
    "use_fp8": False,
    "extra_dp_size": 1,
}
COLOSSAL_TORCH_DDP = {
    "broadcast_buffers": True,
    "bucket_cap_mb": 25,
    "find_unused_parameters": False,
    "check_reduction": False,
    "gradient_as_bucket_view": False,
    "static_graph": False,
    "fp8_communication": False,
}
COLOSSAL_TORCH_FSDP = {
    "process_group": None,
    "sharding_strategy": None,
    "cpu_offload": None,
    "auto_wrap_policy": None,
    "backward_prefetch": None,
    "mixed_precision": None,
    "ignored_modules": None,
    "param_init_fn": None,
    "sync_module_states": False,
    "fp8_communication": False,
}
COLOSSAL_HYBRID = {
    "tp_size": None,  # required in Colossal (no default)
    "pp_size": None,  # required in Colossal (no default)
    "sp_size": None,
    "precision": "fp16",
    "zero_stage": 0,
    "enable_all_optimization": False,
    "enable_fused_normalization": False,
    "enable_flash_attention": False,
    "enable_jit_fused": False,
    "enable_sequence_parallelism": False,
    "sequence_parallelism_mode": None,
    "enable_sequence_overlap": False,
    "parallel_output": True,
    "num_microbatches": None,
    "microbatch_size": None,
    "initial_scale": 2**16,
    "min_scale": 1,
    "growth_factor": 2,
    "backoff_factor": 0.5,
    "growth_interval": 1000,
    "hysteresis": 2,
    "max_scale": 2**32,
    "max_norm": 0,
    "broadcast_buffers": True,
    "ddp_bucket_cap_mb": 25,
    "find_unused_parameters": False,
    "check_reduction": False,
    "gradient_as_bucket_view": False,
    "static_graph": False,
    "zero_bucket_size_in_m": 12,
    "cpu_offload": False,
    "communication_dtype": None,
    "overlap_communication": True,
    "custom_policy": None,
    "pp_style": "1f1b",
    "num_model_chunks": 1,
    "num_layers_per_stage": None,
    "gradient_checkpoint_config": None,
    "enable_metadata_cache": True,
    "make_vocab_size_divisible_by": 64,
    "dp_outside": True,
    "overlap_p2p": True,
    "overlap_allgather": False,
    "inner_ring_size": None,
    "fp8_communication": False,
    "use_fp8": False,
}

# ----- each keyword: refused (a non-default value to try) or honoured (checked below) -----
REFUSED: dict[type, dict[str, Any]] = {
    LowLevelZeroPlugin: {
        "overlap_allgather": True,
        "extra_dp_size": 2,
    },
    TorchDDPPlugin: {},
    TorchFSDPPlugin: {
        "cpu_offload": object(),
        "auto_wrap_policy": lambda *a: True,
        "backward_prefetch": "BACKWARD_PRE",
        "mixed_precision": object(),
        "ignored_modules": [nn.Linear(1, 1)],
        "param_init_fn": lambda m: None,
    },
    HybridParallelPlugin: {
        "sp_size": 2,
        "enable_all_optimization": True,
        "enable_fused_normalization": True,
        "enable_flash_attention": True,
        "enable_jit_fused": True,
        "enable_sequence_parallelism": True,
        "sequence_parallelism_mode": "all_to_all",
        "enable_sequence_overlap": True,
        "parallel_output": False,
        "broadcast_buffers": False,
        "ddp_bucket_cap_mb": 50,
        "find_unused_parameters": True,
        "check_reduction": True,
        "gradient_as_bucket_view": True,
        "static_graph": True,
        "custom_policy": object(),
        "gradient_checkpoint_config": object(),
        "enable_metadata_cache": False,
        "make_vocab_size_divisible_by": 128,
        "dp_outside": False,
        "overlap_p2p": False,
        "overlap_allgather": True,
        "inner_ring_size": 2,
    },
}
HONOURED: dict[type, set[str]] = {
    LowLevelZeroPlugin: set(COLOSSAL_LOW_LEVEL_ZERO) - set(REFUSED[LowLevelZeroPlugin]),
    TorchDDPPlugin: set(COLOSSAL_TORCH_DDP) - set(REFUSED[TorchDDPPlugin]),
    TorchFSDPPlugin: set(COLOSSAL_TORCH_FSDP) - set(REFUSED[TorchFSDPPlugin]),
    HybridParallelPlugin: set(COLOSSAL_HYBRID) - set(REFUSED[HybridParallelPlugin]),
}
SIGNATURES = {
    LowLevelZeroPlugin: COLOSSAL_LOW_LEVEL_ZERO,
    TorchDDPPlugin: COLOSSAL_TORCH_DDP,
    TorchFSDPPlugin: COLOSSAL_TORCH_FSDP,
    HybridParallelPlugin: COLOSSAL_HYBRID,
}
# Where each honoured keyword's behaviour is checked (a test of this file or another's).
CHECKED_BY = {
    LowLevelZeroPlugin: {
        "stage": "test_zero.py (stage 1 / 2 equal one process)",
        "precision": "test_low_level_zero_keywords_reach_the_optimizer",
        "initial_scale": "test_low_level_zero_keywords_reach_the_optimizer",
        "min_scale": "test_low_level_zero_keywords_reach_the_optimizer",
        "growth_factor": "test_low_level_zero_keywords_reach_the_optimizer",
        "backoff_factor": "test_low_level_zero_keywords_reach_the_optimizer",
        "growth_interval": "test_low_level_zero_keywords_reach_the_optimizer",
        "hysteresis": "test_low_level_zero_keywords_reach_the_optimizer",
        "max_scale": "test_low_level_zero_keywords_reach_the_optimizer",
        "max_norm": "test_low_level_zero_keywords_reach_the_optimizer",
        "norm_type": "test_low_level_zero_keywords_reach_the_optimizer",
        "reduce_bucket_size_in_m": "test_distributed_keywords (collectives counted)",
        "communication_dtype": "test_zero.py (communication dtypes)",
        "cpu_offload": "test_zero.py (world of one, accelerator refusal)",
        "master_weights": "test_low_level_zero_keywords_reach_the_optimizer",
        "verbose": "test_low_level_zero_keywords_reach_the_optimizer",
        "cast_inputs": "test_cast_inputs_false_passes_inputs_as_given",
        "use_fp8": "test_use_fp8_converts_linears; test_fp8_faces.py (every recipe, bit for bit)",
        "overlap_communication": "test_zero_comm.py (bit-identical, reduced in backward)",
        "fp8_communication": "test_zero_comm.py (bytes counted, error bound, skips agree)",
    },
    TorchDDPPlugin: {
        **{
            name: "test_distributed_keywords (DDP's attributes)"
            for name in set(COLOSSAL_TORCH_DDP) - {"fp8_communication"}
        },
        "fp8_communication": "test_zero_comm.py (DDP: bytes counted, error bound)",
    },
    TorchFSDPPlugin: {
        "process_group": "test_distributed_keywords (sharded over the given group)",
        "sharding_strategy": "test_fsdp_sharding_strategy_maps_to_reshard_after_forward",
        "sync_module_states": "test_distributed_keywords (rank 1 starts from rank 0's)",
        "fp8_communication": "test_zero_comm.py (FSDP2: bytes counted, error bound)",
    },
    HybridParallelPlugin: {
        "tp_size": "test_pipeline.py (tp_plan runs)",
        "pp_size": "test_pipeline.py",
        "precision": "test_hybrid_precision_is_colossals",
        "zero_stage": "test_distributed_keywords (equals LowLevelZeroPlugin); "
        "test_hybrid_parallel.py (pp x dp and tp x dp: equal the loop and the plugin without "
        "ZeRO, clip, skip, checkpoint)",
        "num_microbatches": "test_pipeline.py",
        "microbatch_size": "test_hybrid_parallel.py (equals num_microbatches, bad batches)",
        "initial_scale": "test_hybrid_precision_is_colossals",
        "min_scale": "test_hybrid_precision_is_colossals",
        "growth_factor": "test_hybrid_precision_is_colossals",
        "backoff_factor": "test_hybrid_precision_is_colossals",
        "growth_interval": "test_hybrid_precision_is_colossals",
        "hysteresis": "test_hybrid_precision_is_colossals",
        "max_scale": "test_hybrid_precision_is_colossals",
        "max_norm": "test_pipeline.py (global clipping)",
        "zero_bucket_size_in_m": "test_distributed_keywords (zero_stage run)",
        "cpu_offload": "test_hybrid_zero_keywords_need_zero",
        "communication_dtype": "test_hybrid_zero_keywords_need_zero",
        "pp_style": "test_hybrid_pp_style_and_layers_per_stage",
        "num_model_chunks": "test_hybrid_pp_style_and_layers_per_stage",
        "num_layers_per_stage": "test_distributed_keywords (stage cut)",
        "use_fp8": "test_hybrid_precision_is_colossals; test_fp8_faces.py (every recipe)",
        "overlap_communication": "test_hybrid_zero_keywords_need_zero",
        "fp8_communication": "test_zero_comm.py (pipeline dp and zero_stage)",
    },
}


@pytest.mark.parametrize("plugin", list(SIGNATURES), ids=lambda p: p.__name__)
def test_every_colossal_keyword_is_classified_and_accepted_by_name(plugin: type) -> None:
    ours = inspect.signature(plugin.__init__).parameters
    for name in SIGNATURES[plugin]:
        assert name in ours, f"{plugin.__name__} lacks Colossal's keyword {name!r}"
    assert set(CHECKED_BY[plugin]) == HONOURED[plugin], (
        "honoured keywords without a behaviour check: "
        f"{sorted(HONOURED[plugin] - set(CHECKED_BY[plugin]))}"
    )


def _minimal(plugin: type) -> dict[str, Any]:
    return {"pp_size": 1, "tp_size": 1} if plugin is HybridParallelPlugin else {}


@pytest.mark.parametrize(
    ("plugin", "name"),
    [(p, n) for p, names in REFUSED.items() for n in names],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_refused_keyword_names_itself(plugin: type, name: str) -> None:
    with pytest.raises(NotImplementedError, match=rf"{plugin.__name__}\({name}="):
        plugin(**_minimal(plugin), **{name: REFUSED[plugin][name]})
    plugin(**_minimal(plugin), **{name: inspect.signature(plugin).parameters[name].default})


def test_low_level_zero_keywords_reach_the_optimizer() -> None:
    plugin = LowLevelZeroPlugin(
        stage=2,
        precision="bf16",  # no loss scaler: the scaler keywords are refused here (see below)
        max_norm=1.5,
        norm_type=1.0,
        master_weights=False,
        verbose=True,
    )
    model = tiny_mlp(16)
    _, opt, *_ = Booster(plugin=plugin).boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert opt.stage == 2 and opt.max_norm == 1.5 and opt.norm_type == 1.0
    assert opt.verbosity == 2  # verbose: every scale change is logged
    assert not opt.hp_masters  # master_weights=False: bf16 params stepped directly
    assert next(model.parameters()).dtype == torch.bfloat16
    fp16 = LowLevelZeroPlugin(
        initial_scale=2**10,
        min_scale=2,
        growth_factor=4,
        backoff_factor=0.25,
        growth_interval=7,
        hysteresis=3,
        max_scale=2**20,
    )
    cfg = fp16.policy.loss_scale
    assert (cfg.init_scale, cfg.min_scale, cfg.growth_factor, cfg.backoff_factor) == (
        2**10,
        2,
        4,
        0.25,
    )
    assert (cfg.growth_interval, cfg.hysteresis, cfg.max_scale) == (7, 3, 2**20)
    assert fp16.policy.param_dtype == torch.float16 and fp16.policy.master_weights
    with pytest.raises(ValueError, match=r"LowLevelZeroPlugin\(hysteresis=3\).*'bf16' scales no"):
        LowLevelZeroPlugin(precision="bf16", hysteresis=3)


def test_cast_inputs_false_passes_inputs_as_given() -> None:
    x = torch.randn(4, 16)
    for cast_inputs in (True, False):
        model = tiny_mlp(16, norm=False)
        plugin = LowLevelZeroPlugin(precision="bf16", cast_inputs=cast_inputs)
        boosted, *_ = Booster(plugin=plugin).boost(model)
        if cast_inputs:  # the fp32 input is cast to the bf16 weights' dtype
            assert torch.isfinite(boosted(x)).all()
        else:  # an fp32 input meets bf16 weights: torch refuses the mixed matmul
            with pytest.raises(RuntimeError, match="dtype"):
                boosted(x)
            assert torch.isfinite(boosted(x.bfloat16())).all()


def test_use_fp8_converts_linears() -> None:
    pytest.importorskip("mixprec.fp8")
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    boosted, *_ = Booster(plugin=LowLevelZeroPlugin(precision="bf16", use_fp8=True)).boost(model)
    kinds = {type(m).__name__ for m in boosted.modules()}
    assert any("Float8" in k for k in kinds), kinds


def test_hybrid_precision_is_colossals() -> None:
    """'fp16' (the default) = fp16 params + fp32 masters + the scaler keywords; bf16 alike."""
    plugin = HybridParallelPlugin(pp_size=1, tp_size=1, initial_scale=2**8, hysteresis=3)
    policy = plugin.precision.policy
    assert (policy.param_dtype, policy.master_weights) == (torch.float16, True)
    assert policy.loss_scale.init_scale == 2**8 and policy.loss_scale.hysteresis == 3
    for name, value in (
        ("min_scale", 2),
        ("growth_factor", 4),
        ("backoff_factor", 0.25),
        ("growth_interval", 9),
        ("max_scale", 2**20),
    ):
        cfg = HybridParallelPlugin(pp_size=1, tp_size=1, **{name: value}).precision.policy
        got = getattr(cfg.loss_scale, name)
        assert got == value, (name, got)
        with pytest.raises(ValueError, match=name):  # bf16 has no scaler to set
            HybridParallelPlugin(pp_size=1, tp_size=1, precision="bf16", **{name: value})
    bf16 = HybridParallelPlugin(pp_size=1, tp_size=1, precision="bf16").precision.policy
    assert (bf16.param_dtype, bf16.master_weights) == (torch.bfloat16, True)
    assert HybridParallelPlugin(pp_size=1, tp_size=1, use_fp8=True).precision.policy.fp8
    assert HybridParallelPlugin(pp_size=1, precision=None).precision is None  # the Booster's


def test_hybrid_zero_keywords_need_zero() -> None:
    for name, value in (
        ("cpu_offload", True),
        ("communication_dtype", torch.float32),
        ("zero_bucket_size_in_m", 4),
        ("overlap_communication", True),
    ):
        with pytest.raises(ValueError, match=f"{name}=.*zero_stage"):
            HybridParallelPlugin(pp_size=1, tp_size=1, **{name: value})
        plugin = HybridParallelPlugin(pp_size=1, tp_size=1, zero_stage=1, **{name: value})
        zero = plugin._zero
        if name == "communication_dtype":
            assert zero.communication_dtype == torch.float32
        elif name == "cpu_offload":
            assert zero.cpu_offload
        elif name == "overlap_communication":
            assert zero.overlap_communication
        else:
            assert zero.reduce_bucket_numel == 4 * 2**20
    # with a pipeline, ZeRO's settings apply to each stage's data-parallel group
    plugin = HybridParallelPlugin(
        pp_size=2, num_microbatches=2, zero_stage=2, zero_bucket_size_in_m=4, cpu_offload=True
    )
    assert plugin._zero is None and plugin._stage_zero.stage == 2
    assert plugin._stage_zero.reduce_bucket_numel == 4 * 2**20 and plugin._stage_zero.cpu_offload
    # with tensor parallelism (any pp_size), over each tp index's data-parallel group
    plugin = HybridParallelPlugin(tp_size=2, tp_plan={"0": object()}, zero_stage=1)
    assert plugin._zero is None and plugin._stage_zero.stage == 1


def test_hybrid_pp_style_and_layers_per_stage() -> None:
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=2, pp_style="gpipe")
    assert plugin.config.schedule == "gpipe"
    plugin = HybridParallelPlugin(
        pp_size=2, num_microbatches=4, pp_style="interleaved", num_model_chunks=3
    )
    assert plugin.config.chunks == 3
    with pytest.raises(ValueError, match="pp_style.*pp_schedule"):
        HybridParallelPlugin(pp_size=2, num_microbatches=2, pp_style="gpipe", pp_schedule="1f1b")
    with pytest.raises(ValueError, match="num_layers_per_stage"):
        HybridParallelPlugin(pp_size=2, num_microbatches=2, num_layers_per_stage=[1, 2, 3])


def test_fsdp_sharding_strategy_maps_to_reshard_after_forward() -> None:
    from torch.distributed.fsdp import ShardingStrategy

    assert TorchFSDPPlugin().reshard_after_forward
    assert TorchFSDPPlugin(sharding_strategy=ShardingStrategy.FULL_SHARD).reshard_after_forward
    assert not TorchFSDPPlugin(
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP
    ).reshard_after_forward
    for strategy in (ShardingStrategy.NO_SHARD, ShardingStrategy.HYBRID_SHARD):
        with pytest.raises(NotImplementedError, match="sharding_strategy"):
            TorchFSDPPlugin(sharding_strategy=strategy)


# ----- the keywords that need a process group: one 2-rank spawn -----
def _count_collectives(monkeypatch_target: Any) -> tuple[list[int], Any]:
    calls: list[int] = []
    original = monkeypatch_target.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    return calls, counted


def _zero_run(plugin: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[list, int]:
    torch.manual_seed(0)
    model = tiny_mlp(16, norm=False)
    booster = Booster(plugin=plugin)
    model, opt, criterion, *_ = booster.boost(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss()
    )
    # ZeRO's buckets call torch.distributed.all_reduce through the module: patched there
    calls, counted = _count_collectives(torch.distributed)
    original = torch.distributed.all_reduce
    torch.distributed.all_reduce = counted
    try:
        for _ in range(2):
            booster.backward(criterion(model(x), y), opt)
            opt.step()
            opt.zero_grad()
    finally:
        torch.distributed.all_reduce = original
    return [p.detach().clone() for p in model.parameters()], len(calls)


def _distributed_worker(rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
    # reduce_bucket_size_in_m: more, smaller collectives; the same sums (2 ranks: a + b)
    one, calls_one = _zero_run(LowLevelZeroPlugin(precision="fp32"), x, y)
    small = 300 / 2**20  # 300 elements per bucket: tiny_mlp's 948 params need several
    many, calls_many = _zero_run(
        LowLevelZeroPlugin(precision="fp32", reduce_bucket_size_in_m=small), x, y
    )
    assert calls_many > calls_one, (calls_many, calls_one)
    for a, b in zip(one, many, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # HybridParallelPlugin(zero_stage=k) with pp = tp = 1 is LowLevelZero over the world
    for stage in (1, 2):
        hybrid, _ = _zero_run(
            HybridParallelPlugin(precision="fp32", zero_stage=stage, zero_bucket_size_in_m=small),
            x,
            y,
        )
        for a, b in zip(one, hybrid, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # TorchDDPPlugin: each keyword reaches torch's DDP
    model = tiny_mlp(16)
    ddp, *_ = Booster(
        plugin=TorchDDPPlugin(
            broadcast_buffers=False,
            bucket_cap_mb=1,
            find_unused_parameters=True,
            gradient_as_bucket_view=True,
            check_reduction=True,
        )
    ).boost(model)
    assert ddp.broadcast_buffers is False and ddp.find_unused_parameters is True
    assert ddp.gradient_as_bucket_view is True and ddp.bucket_bytes_cap == 2**20
    static, *_ = Booster(plugin=TorchDDPPlugin(static_graph=True)).boost(tiny_mlp(16))
    assert static.static_graph
    # TorchFSDPPlugin: sync_module_states and process_group
    torch.manual_seed(rank)  # different weights on each rank
    model = tiny_mlp(16)
    group = dist.new_group([0, 1])
    plugin = TorchFSDPPlugin(process_group=group, sync_module_states=True)
    sharded, *_ = Booster(plugin=plugin).boost(model)
    assert plugin.process_group is group
    full = [p.full_tensor() for p in sharded.parameters()]
    torch.manual_seed(0)
    rank0 = tiny_mlp(16)
    for a, b in zip(full, rank0.parameters(), strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
    # HybridParallelPlugin(num_layers_per_stage=[3, 1]): stage 0 holds layers 0..2
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    ref = copy.deepcopy(model)
    piped, *_ = Booster(
        plugin=HybridParallelPlugin(
            pp_size=2, num_microbatches=2, precision="fp32", num_layers_per_stage=[3, 1]
        )
    ).boost(model)
    names = {n.split(".")[0] for stage in piped.stages for n, _ in stage.module.named_parameters()}
    assert names == ({"0", "1", "2"} if rank == 0 else {"3"}), names
    del ref


def test_distributed_keywords() -> None:
    from dist_utils import spawn

    spawn(_distributed_worker, 2)
