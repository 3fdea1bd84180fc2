"""Checkpoint files: atomic writes, safe loads, and model states kept in fp32.

A model trained with low-precision params is saved with fp32 weights (the optimizer's fp32
masters where they exist, the params upcast otherwise), so a checkpoint from any mode loads
into any other. The optimizer's own state_dict carries masters and the loss-scaler state.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.core.grad_transfer import LOW_DTYPES
from mixprec.core.optim import MixedPrecisionOptimizer


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read back: truncated, foreign or not weights-only."""


def save_checkpoint(obj: Any, path: str | os.PathLike) -> None:
    """torch.save obj to path atomically: a crash mid-write leaves any previous file intact.

    Written to a temp file in the same directory (same filesystem, so the rename is atomic),
    fsynced, then os.replace'd over path; the directory is fsynced so the rename persists.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """torch.load(path, weights_only=True); a truncated or foreign file raises CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No checkpoint file at {str(path)!r}.")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except OSError:
        raise
    except Exception as exc:  # torch raises RuntimeError/EOFError/KeyError/UnpicklingError here
        raise CheckpointError(
            f"Cannot read checkpoint {str(path)!r} ({path.stat().st_size} bytes): it is "
            f"truncated, not written by torch.save, or holds objects other than tensors and "
            f"plain containers. {type(exc).__name__}: {exc}"
        ) from exc


def _lp_to_hp_master(optimizer: MixedPrecisionOptimizer | None) -> dict[int, torch.Tensor]:
    if optimizer is None:
        return {}
    return {id(lp): hp for lp, hp in zip(optimizer.lp_params, optimizer.hp_masters, strict=True)}


def hp_model_state_dict(
    model: nn.Module, optimizer: MixedPrecisionOptimizer | None = None
) -> dict[str, Any]:
    """model.state_dict() with every fp16/bf16 tensor in fp32, on CPU.

    Params with an fp32 master in optimizer are taken from the master (no precision lost);
    other low-precision tensors are upcast (exact: fp16/bf16 -> fp32 is lossless).
    """
    lp_to_hp = _lp_to_hp_master(optimizer)
    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, Any] = {}
    for name, value in model.state_dict().items():
        param = params.get(name)
        if param is not None and id(param) in lp_to_hp:
            value = lp_to_hp[id(param)]
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if value.dtype in LOW_DTYPES:
                value = value.float()
            value = value.cpu()
        out[name] = value
    return out


def hp_model_state_copy(
    model: nn.Module, optimizer: MixedPrecisionOptimizer | None = None
) -> dict[str, Any]:
    """hp_model_state_dict with every tensor a fresh copy: a snapshot that training (or a
    checkpoint read into it) does not alias with the model or the masters."""
    return {
        k: v.clone() if isinstance(v, torch.Tensor) else v
        for k, v in hp_model_state_dict(model, optimizer).items()
    }


def load_hp_model_state_dict(
    model: nn.Module,
    state_dict: dict[str, Any],
    optimizer: MixedPrecisionOptimizer | None = None,
    strict: bool = True,
) -> None:
    """Load an (fp32) state into model, whatever dtype its params have now, and its masters.

    load_state_dict copies (and so casts) into each param; the fp32 masters in optimizer get
    the checkpoint's fp32 values directly, not the params' rounded ones.
    """
    model.load_state_dict(state_dict, strict=strict)
    lp_to_hp = _lp_to_hp_master(optimizer)
    with torch.no_grad():
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) in lp_to_hp and name in state_dict:
                lp_to_hp[id(param)].copy_(state_dict[name])
