"""Sharded checkpoints for the Booster (Colossal-AI's `shard=True`): an index + size-capped shards.

A checkpoint directory holds one index JSON and shard files of at most `size_per_shard` MB
each (a single tensor larger than that gets a shard of its own), in torch's format (loaded
with `weights_only=True`) or safetensors. Any nested state (an optimizer's `state`,
`param_groups`, the scaler) is flattened: its tensors go to the shards under dotted keys, the
rest (numbers, strings, the nesting) to the index's "skeleton". The directory is written under
a temporary name and swapped in whole, so a crash leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from mixprec.core.checkpoint import load_checkpoint, save_checkpoint

MODEL_INDEX = {False: "pytorch_model.bin.index.json", True: "model.safetensors.index.json"}
OPTIMIZER_INDEX = "pytorch_optim.bin.index.json"
FORMAT = "mixprec-sharded-1"


def swap_in_directory(tmp: Path, path: Path) -> None:
    """Replace the directory path by tmp; a crash between the two renames leaves the old one
    at '.<name>.old' beside it (a non-empty directory cannot be replaced in one rename)."""
    old = path.parent / f".{path.name}.old"
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


# ----- nested state <-> (JSON skeleton, flat tensors) -----
def _flatten(obj: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj
        return {"t": key}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, int | str):
                raise TypeError(f"A sharded checkpoint takes int or str keys, got {k!r}.")
            tag = "i" if isinstance(k, int) else "s"
            items.append([tag, k, _flatten(v, f"{key}.{k}" if key else str(k), tensors)])
        return {"d": items}
    if isinstance(obj, list | tuple):
        kind = "l" if isinstance(obj, list) else "u"
        return {kind: [_flatten(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, bool | int | float | str):
        return {"v": obj}
    raise TypeError(f"A sharded checkpoint cannot hold {type(obj).__name__} at {key!r}.")


def _unflatten(skeleton: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    if "t" in skeleton:
        return tensors[skeleton["t"]]
    if "d" in skeleton:
        return {k: _unflatten(v, tensors) for _, k, v in skeleton["d"]}
    if "l" in skeleton:
        return [_unflatten(v, tensors) for v in skeleton["l"]]
    if "u" in skeleton:
        return tuple(_unflatten(v, tensors) for v in skeleton["u"])
    return skeleton["v"]


def save_sharded(
    state: dict[str, Any],
    path: str | os.PathLike,
    *,
    index_name: str,
    size_per_shard: int,
    use_safetensors: bool = False,
    prefix: str | None = None,
) -> None:
    """Write state as index_name + shards of at most size_per_shard MB into directory path."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _flatten(state, "", tensors)
    limit = size_per_shard * 1024**2
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        # a contiguous CPU copy of its own: safetensors refuses views and shared storage
        shards[-1][key] = t.detach().to("cpu", copy=True).contiguous()
        size += nbytes
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a crashed save
    tmp.mkdir(parents=True)
    ext = "safetensors" if use_safetensors else "bin"
    stem = index_name.split(".")[0]
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"{prefix or ''}{stem}-{i:05d}-of-{len(shards):05d}.{ext}"
        if use_safetensors:
            from safetensors.torch import save_file

            save_file(shard, os.fspath(tmp / name))
        else:
            save_checkpoint(shard, tmp / name)
        weight_map.update(dict.fromkeys(shard, name))
    index = {
        "metadata": {
            "format": FORMAT,
            "total_size": sum(t.numel() * t.element_size() for t in tensors.values()),
        },
        "weight_map": weight_map,
        "skeleton": skeleton,
    }
    (tmp / f"{prefix or ''}{index_name}").write_text(json.dumps(index))
    swap_in_directory(tmp, path)


def find_index(path: str | os.PathLike) -> Path | None:
    """The index file of a sharded checkpoint directory (None: not one)."""
    path = Path(path)
    if not path.is_dir():
        return None
    found = sorted(path.glob("*.index.json"))
    if len(found) > 1:
        raise ValueError(f"{path} holds several index files {[p.name for p in found]}.")
    return found[0] if found else None


def is_dcp_directory(path: str | os.PathLike) -> bool:
    """A torch.distributed.checkpoint directory (per-rank DTensor shards): a directory that is
    not a sharded checkpoint. Anything else is a whole state load_state_file reads."""
    return Path(path).is_dir() and find_index(path) is None


def load_sharded(index_file: Path) -> dict[str, Any]:
    """The state a sharded checkpoint holds (torch shards read with weights_only=True)."""
    index = json.loads(index_file.read_text())
    if index.get("metadata", {}).get("format") != FORMAT:
        raise ValueError(f"{index_file} is not a mixprec sharded checkpoint index.")
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        file = index_file.parent / name
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            tensors.update(load_file(os.fspath(file)))
        else:
            tensors.update(load_checkpoint(file))
    return _unflatten(index["skeleton"], tensors)


def save_safetensors_file(state: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """One safetensors file (a flat name -> tensor state), written atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp"
    save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}, tmp)
    os.replace(tmp, path)


def load_state_file(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint file or sharded directory, whichever path is."""
    index = find_index(path)
    if index is not None:
        return load_sharded(index)
    if os.fspath(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(os.fspath(path))
    return load_checkpoint(path)
