"""TorchDDPPlugin: data parallelism with torch's DistributedDataParallel (gloo on CPU)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from typing_extensions import override

from mixprec.booster.plugin.plugin_base import Plugin, is_distributed
from mixprec.core.prepare import PrecisionModule
from mixprec.parallel.comm import fp8_ddp_comm_hook, to_fp8_comm_dtype


class TorchDDPPlugin(Plugin):
    """Wrap the precision-wrapped model in DDP; the arguments are DDP's (Colossal's names).

    fp8_communication: True (= 'e5m2') or 'e4m3': a DDP comm hook averages each gradient
    bucket in fp8 with a per-bucket power-of-two scale (mixprec.parallel.comm.fp8_ddp_comm_hook,
    as Colossal's fp8_compress_ddp_grad_comm_hook), asynchronously, so buckets travel while
    backward runs (as DDP's own all-reduce); every replica gets the same result.

    The model is cast before DDP wraps it, so DDP broadcasts (and all-reduces) the params in
    the dtype they train in; fp32 masters are made after that broadcast, so they agree too.
    """

    def __init__(
        self,
        broadcast_buffers: bool = True,
        bucket_cap_mb: int = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        fp8_communication: bool | str = False,
    ) -> None:
        self.fp8_communication = to_fp8_comm_dtype(fp8_communication, "TorchDDPPlugin")
        self.ddp_kwargs: dict[str, object] = {
            "bucket_cap_mb": bucket_cap_mb,
            "find_unused_parameters": find_unused_parameters,
            "check_reduction": check_reduction,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
        }
        if not broadcast_buffers:  # torch 2.13 deprecates the name but keeps its meaning
            self.ddp_kwargs["broadcast_buffers"] = False

    @override
    def wrap_model(self, model: PrecisionModule, device: torch.device) -> nn.Module:
        if not is_distributed():
            raise RuntimeError(
                "TorchDDPPlugin needs torch.distributed initialised first: call "
                "mixprec.launch.launch_from_torch() (or launch) before boosting."
            )
        device_ids = [device] if device.type == "cuda" else None  # CPU (gloo): no device ids
        ddp = DDP(model, device_ids=device_ids, **self.ddp_kwargs)
        if self.fp8_communication is not None:
            ddp.register_comm_hook(None, fp8_ddp_comm_hook(self.fp8_communication))
        return ddp

    @override
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        if not isinstance(model, DDP):
            raise TypeError(f"no_sync needs the model boost() returned (a DDP), got {type(model)}.")
        return model.no_sync()
