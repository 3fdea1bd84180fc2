"""TorchDDPPlugin: data parallelism with torch's DistributedDataParallel (gloo on CPU)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mixprec.booster.plugin.plugin_base import (
    FP8_COMMUNICATION,
    Plugin,
    is_distributed,
    refuse_non_defaults,
)
from mixprec.core.prepare import PrecisionModule


class TorchDDPPlugin(Plugin):
    """Wrap the precision-wrapped model in DDP; the arguments are DDP's (Colossal's names;
    fp8_communication must stay False: DDP's buckets are reduced in the gradients' dtype).

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
        fp8_communication: bool = False,
    ) -> None:
        refuse_non_defaults(
            "TorchDDPPlugin", locals(), {"fp8_communication": (False, FP8_COMMUNICATION)}
        )
        self.ddp_kwargs: dict[str, object] = {
            "bucket_cap_mb": bucket_cap_mb,
            "find_unused_parameters": find_unused_parameters,
            "check_reduction": check_reduction,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
        }
        if not broadcast_buffers:  # torch 2.13 deprecates the name but keeps its meaning
            self.ddp_kwargs["broadcast_buffers"] = False

    def wrap_model(self, model: PrecisionModule, device: torch.device) -> nn.Module:
        if not is_distributed():
            raise RuntimeError(
                "TorchDDPPlugin needs torch.distributed initialised first: call "
                "mixprec.launch.launch_from_torch() (or launch) before boosting."
            )
        device_ids = [device] if device.type == "cuda" else None  # CPU (gloo): no device ids
        return DDP(model, device_ids=device_ids, **self.ddp_kwargs)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        if not isinstance(model, DDP):
            raise TypeError(f"no_sync needs the model boost() returned (a DDP), got {type(model)}.")
        return model.no_sync()
