"""Colossal-AI-style configs: a dict with attribute access, loaded from .py/.json/.toml files.

A config holds `fp16=dict(mode=AMP_TYPE.X, **mode_keys)` (seed 000), `fp8=dict(recipe=...)`
(float8 Linear layers under that mode: mixprec's extension), `clip_grad_norm`,
`gradient_accumulation` and any user keys (BATCH_SIZE, NUM_EPOCHS). After `launch(...)` it is
readable anywhere as `gpc.config`, the way Colossal-AI's global context exposes it.

Python config files run code, so only the exact file the user names is ever executed (by
path, never by a module-name search on sys.path). JSON and TOML files run nothing.
"""

from __future__ import annotations

import ast
import json
import os
import runpy
import sys
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch.distributed as dist
from typing_extensions import override

from mixprec.amp_type import AMP_TYPE
from mixprec.core.policy import Policy, clip_norm_for, did_you_mean, to_policy
from mixprec.core.validate import check_bool, check_max_norm
from mixprec.fp8.settings import with_fp8
from mixprec.parallel.zero import ZeroConfig, to_zero_config

CONFIG_SUFFIXES: tuple[str, ...] = (".py", ".json", ".toml")
"""File types load_config reads: Python (runs the file), JSON and TOML (run nothing)."""

UNSUPPORTED_SECTIONS: dict[str, str] = {
    "gradient_handler": "gradients are reduced by DDP, ZeRO (zero=dict(level=1|2)) or FSDP2 "
    "(level=3) itself; remove the section.",
}
"""Colossal-AI config sections mixprec knows but does not implement: an error, never ignored."""

ConfigLike = Mapping[str, Any] | str | os.PathLike[str] | None
"""What launchers and initialize accept as a config: a mapping, a file path, or None (empty)."""


def _to_config_value(value: Any) -> Any:
    """Nested dicts become Config (also inside lists/tuples) so `a.b.c` works at every level."""
    if isinstance(value, Config):
        return value
    if isinstance(value, Mapping):
        return Config(value)
    if isinstance(value, list):
        return [_to_config_value(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):  # leave namedtuples whole
        return tuple(_to_config_value(v) for v in value)
    return value


def _to_plain_value(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _to_plain_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_plain_value(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_to_plain_value(v) for v in value)
    return value


class Config(dict):
    """A dict whose keys are also attributes; nested dicts become Configs.

    Item access, `in`, iteration, `.get` and `len` are the dict's. Attribute access reads and
    writes items; a key that shadows a dict method (`items`, `get`, ...) is reachable only as
    `config["items"]`. A missing attribute raises AttributeError naming the keys that exist.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.update(*args, **kwargs)

    @override
    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(key, str):
            raise TypeError(f"Config keys must be str, got {key!r} ({type(key).__name__}).")
        super().__setitem__(key, _to_config_value(value))

    @override
    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        # dict.update bypasses __setitem__; route through it so nested dicts convert
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    @override
    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"Config has no key {name!r}." + did_you_mean(name, sorted(self))
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self[name]
        except KeyError:
            raise AttributeError(
                f"Config has no key {name!r}." + did_you_mean(name, sorted(self))
            ) from None

    def __dir__(self) -> Iterable[str]:
        return [*super().__dir__(), *self.keys()]

    @override
    def __repr__(self) -> str:
        return f"Config({dict.__repr__(self)})"

    def to_dict(self) -> dict[str, Any]:
        """A plain, deep copy as builtin dicts (for JSON dumps and checkpoint metadata)."""
        return _to_plain_value(self)

    @override
    def copy(self) -> Config:
        return Config(self)

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled as a plain dict payload (spawn start methods pickle configs to workers)
        return (Config, (self.to_dict(),))


def _imported_names(tree: ast.Module) -> set[str]:
    """Names bound at module level by import statements (not inside functions or classes)."""
    names: set[str] = set()
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
        else:
            stack.extend(ast.iter_child_nodes(node))
    return names


def _load_python(path: Path) -> dict[str, Any]:
    """Run exactly `path` and keep what it defines: no imports, modules or _private names."""
    source = path.read_text(encoding="utf-8")
    imported = _imported_names(ast.parse(source, filename=str(path)))
    # run_path executes the file at this path; nothing is looked up by module name
    namespace = runpy.run_path(str(path), run_name=f"mixprec_config_{path.stem}")
    return {
        key: value
        for key, value in namespace.items()
        if not key.startswith("_")
        and key not in imported
        and not isinstance(value, types.ModuleType)
    }


def _load_toml(path: Path) -> dict[str, Any]:
    if sys.version_info < (3, 11):
        raise RuntimeError(
            f"Reading the TOML config {str(path)!r} needs Python >= 3.11 (tomllib); this is "
            f"Python {sys.version.split()[0]}. Use a .py or .json config instead."
        )
    import tomllib

    with path.open("rb") as f:
        return tomllib.load(f)


def _mode_str_to_amp_type(data: dict[str, Any]) -> dict[str, Any]:
    """JSON/TOML write AMP_TYPE by value ("torch"); store the enum as .py configs do."""
    fp16 = data.get("fp16")
    if isinstance(fp16, Mapping) and isinstance(fp16.get("mode"), str):
        mode = fp16["mode"]
        if mode.lower() in {t.value for t in AMP_TYPE}:
            data["fp16"] = {**fp16, "mode": AMP_TYPE(mode.lower())}
    return data


def _read_file(path: Path) -> dict[str, Any]:
    if path.suffix == ".py":
        return _load_python(path)
    if path.suffix == ".json":
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(
                f"The JSON config {str(path)!r} must hold an object at top level, "
                f"got {type(data).__name__}."
            )
        return _mode_str_to_amp_type(data)
    return _mode_str_to_amp_type(_load_toml(path))


def config_to_policy(config: Mapping[str, Any]) -> Policy:
    """The Policy a config's `fp16` section names (no `fp16` key, or None: fp32), with the
    `fp8` section's float8 Linear layers on top: `fp8=dict(recipe='rowwise', ...)` (Float8Config's
    fields), True, a recipe name or a Float8Config (mixprec.fp8.settings.to_float8_config);
    absent, None or False: none beyond what the fp16 section's mode has."""
    policy = to_policy(config.get("fp16"))
    fp8 = config.get("fp8")
    if fp8 is None:
        return policy
    if isinstance(fp8, Mapping):
        fp8 = dict(fp8)  # a Config section: its plain fields
    return with_fp8(policy, fp8, "fp8")


PARALLEL_KEYS: tuple[str, ...] = ("pipeline", "tensor")
"""Keys of a config's `parallel` section (Colossal's legacy names; data = world / pipeline)."""


def _check_keys(what: str, given: Mapping[str, Any], valid: tuple[str, ...]) -> None:
    from mixprec.core.policy import check_keys  # here, not above: keeps the import block as it was

    check_keys(what, given, valid)


def _parallel_size(section: str, value: Any) -> int:
    size = value.get("size", 1) if isinstance(value, Mapping) else value
    if isinstance(value, Mapping):
        _check_keys(f"parallel.{section}", value, ("size", "mode"))
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"parallel.{section}={value!r}: the size must be an int >= 1.")
    return size


def config_to_pipeline(config: Mapping[str, Any]) -> tuple[int, int] | None:
    """(pipeline size, NUM_MICRO_BATCHES) of a config's `parallel=dict(pipeline=N)`, or None
    without a pipeline (absent or size 1)."""
    parallel = config.get("parallel") or {}
    if not isinstance(parallel, Mapping):
        raise TypeError(f"parallel must be a dict like dict(pipeline=2), got {parallel!r}.")
    _check_keys("parallel", parallel, PARALLEL_KEYS)
    tensor = _parallel_size("tensor", parallel.get("tensor", 1))
    if tensor != 1:
        raise ValueError(
            f"parallel.tensor={parallel['tensor']!r}: configs run tensor size 1 only "
            "(tensor parallelism: mixprec's DTensor path)."
        )
    pp_size = _parallel_size("pipeline", parallel.get("pipeline", 1))
    if pp_size == 1:
        return None
    micro = config.get("NUM_MICRO_BATCHES")
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
        raise ValueError(
            f"parallel.pipeline={pp_size} needs NUM_MICRO_BATCHES, an int >= {pp_size}; "
            f"got {micro!r}."
        )
    return pp_size, micro


@dataclass(frozen=True, kw_only=True)
class PipelineSection:
    """A config's `parallel=dict(pipeline=N)` with its NUM_MICRO_BATCHES."""

    pp_size: int
    """Pipeline stages (ranks per replica); the data-parallel size is world // pp_size."""
    num_microbatches: int
    """Micro-batches each batch is split into (>= pp_size)."""


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What `initialize` reads from a config, parsed once (parse_config) and checked whole."""

    policy: Policy
    """The fp16 section's precision (fp32 when absent) with the fp8 section's float8 config,
    its max_norm set to the clip below."""
    max_norm: float = 0.0
    """clip_grad_norm (top level, or NAIVE's own; both set must agree); 0: no clipping."""
    gradient_accumulation: int = 1
    """Micro-batches whose gradients are summed before one optimizer step."""
    compile: bool = False
    """engine.train_step runs mixprec.compile_step's compiled whole step."""
    zero: ZeroConfig | None = None
    """zero=dict(level=1|2|3, cpu_offload=...): sharded masters/state, + grads, + params."""
    pipeline: PipelineSection | None = None
    """parallel=dict(pipeline=N) with NUM_MICRO_BATCHES; None: no pipeline."""


def parse_config(config: Mapping[str, Any]) -> EngineConfig:
    """The training keys of a config (fp16, fp8, clip_grad_norm, gradient_accumulation,
    compile, zero, parallel) as one typed object; a bad key fails here, naming it. Other keys are the
    user's and are left alone."""
    policy = config_to_policy(config)
    zero = to_zero_config(config.get("zero"))
    for key, why in UNSUPPORTED_SECTIONS.items():
        if key in config:
            raise ValueError(f"Config section {key!r} is not supported by mixprec: {why}")
    clip = config.get("clip_grad_norm")
    if clip is not None:  # None: no clipping, as 0
        check_max_norm("clip_grad_norm", clip)
    max_norm = clip_norm_for(policy, float(clip or 0.0))  # and agrees with fp16's own
    accum = config.get("gradient_accumulation")
    if accum is not None and (isinstance(accum, bool) or not isinstance(accum, int) or accum < 1):
        raise ValueError(f"gradient_accumulation={accum!r} must be an int >= 1.")
    compile_flag = config.get("compile", False)
    check_bool("compile", compile_flag)
    pipeline = config_to_pipeline(config)
    return EngineConfig(
        policy=replace(policy, max_norm=max_norm),
        max_norm=max_norm,
        gradient_accumulation=accum or 1,
        compile=compile_flag,
        zero=zero,
        pipeline=None
        if pipeline is None
        else PipelineSection(pp_size=pipeline[0], num_microbatches=pipeline[1]),
    )


def validate_config(config: Mapping[str, Any]) -> None:
    """Fail early on a bad fp16 section, clip_grad_norm, gradient_accumulation, compile, zero
    or parallel section (parse_config, its result dropped)."""
    parse_config(config)


def load_config(config: ConfigLike, *, validate: bool = True) -> Config:
    """A Config from a mapping or a .py/.json/.toml file path (None gives an empty Config).

    validate: check the fp16 section with mixprec.core.policy.to_policy (and clip_grad_norm,
    gradient_accumulation) now, so a bad config fails before any process group is built.
    """
    if config is None:
        result = Config()
    elif isinstance(config, Mapping):
        result = Config(config)
    elif isinstance(config, str | os.PathLike):
        path = Path(config).expanduser()
        if path.suffix not in CONFIG_SUFFIXES:
            raise ValueError(
                f"Unknown config file type {path.suffix!r} for {str(config)!r}. "
                f"Valid: {', '.join(repr(s) for s in CONFIG_SUFFIXES)}."
            )
        if not path.is_file():
            raise FileNotFoundError(f"Config file {str(path)!r} does not exist.")
        result = Config(_read_file(path))
    else:
        raise TypeError(
            f"config must be a mapping, a path to a .py/.json/.toml file or None, got {config!r}."
        )
    if validate:
        validate_config(result)
    return result


class GlobalContext:
    """Colossal's `gpc`, minimal: the launched config plus rank facts read from torch.distributed.

    rank, world_size and is_initialized are read live from the default process group (0, 1
    and False without one), so they can never disagree with torch.distributed.
    """

    def __init__(self) -> None:
        self._config = Config()
        self._local_rank: int | None = None

    @property
    def config(self) -> Config:
        """The config set by launch (an empty Config before any launch)."""
        return self._config

    def load_config(self, config: ConfigLike, *, validate: bool = True) -> Config:
        """Load `config` (see mixprec.config.load_config) and make it gpc.config."""
        self._config = load_config(config, validate=validate)
        return self._config

    @property
    def is_initialized(self) -> bool:
        """Whether the default torch.distributed process group exists."""
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        """Global rank in the default group (0 when not initialised)."""
        return dist.get_rank() if self.is_initialized else 0

    @property
    def world_size(self) -> int:
        """Processes in the default group (1 when not initialised)."""
        return dist.get_world_size() if self.is_initialized else 1

    @property
    def local_rank(self) -> int | None:
        """Rank on this node as given to launch (None before launch)."""
        return self._local_rank

    def set_local_rank(self, local_rank: int | None) -> None:
        self._local_rank = local_rank

    def reset(self) -> None:
        """Forget the config and local rank (the process group is left to mixprec.launch)."""
        self._config = Config()
        self._local_rank = None

    def __repr__(self) -> str:
        return (
            f"GlobalContext(is_initialized={self.is_initialized}, rank={self.rank}, "
            f"world_size={self.world_size}, local_rank={self.local_rank}, "
            f"config keys={sorted(self.config)})"
        )


gpc = GlobalContext()
"""The process-wide context launch() fills: gpc.config.BATCH_SIZE, gpc.rank, ..."""
