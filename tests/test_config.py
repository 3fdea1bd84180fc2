"""Config (Colossal-style attribute dict), load_config from .py/.json/.toml, and gpc."""

from __future__ import annotations

import copy
import importlib.util
import json
import pickle
import sys

import pytest
import torch

from mixprec.amp_type import AMP_TYPE
from mixprec.config import Config, GlobalContext, config_to_policy, gpc, load_config
from mixprec.core.policy import Policy

# Seed 001's four config files (config/config_AMP_{torch,naive,apex}.py, config_fp32.py), each
# written three ways. The .py ones import AMP_TYPE as the seed's do (from the package).
USER_KEYS = "BATCH_SIZE = 128\nDROP_RATE = 0.1\nNUM_EPOCHS = 300\n"
TRAIN_KEYS = "gradient_accumulation = 16\nclip_grad_norm = 1.0\n"
SHAPES: dict[str, AMP_TYPE | None] = {
    "config_AMP_torch": AMP_TYPE.TORCH,
    "config_AMP_naive": AMP_TYPE.NAIVE,
    "config_AMP_apex": AMP_TYPE.APEX,
    "config_fp32": None,
}
EXPECTED_MODE_NAME = {AMP_TYPE.TORCH: "fp16", AMP_TYPE.NAIVE: "fp16_naive", None: "fp32"}


def write_shape(tmp_path, stem: str, suffix: str):
    mode = SHAPES[stem]
    path = tmp_path / f"{stem}{suffix}"
    if suffix == ".py":
        fp16 = "" if mode is None else f"fp16 = dict(mode=AMP_TYPE.{mode.name})\n"
        path.write_text("from mixprec import AMP_TYPE\n\n" + USER_KEYS + fp16 + TRAIN_KEYS)
    elif suffix == ".json":
        data = {"BATCH_SIZE": 128, "DROP_RATE": 0.1, "NUM_EPOCHS": 300}
        if mode is not None:
            data["fp16"] = {"mode": mode.value}
        data |= {"gradient_accumulation": 16, "clip_grad_norm": 1.0}
        path.write_text(json.dumps(data))
    else:
        fp16 = "" if mode is None else f'[fp16]\nmode = "{mode.value}"\n'
        path.write_text(USER_KEYS + TRAIN_KEYS + fp16)  # TOML tables come after plain keys
    return path


def apex_face_missing() -> bool:
    return importlib.util.find_spec("mixprec.apex") is None


@pytest.mark.parametrize("suffix", [".py", ".json", ".toml"])
@pytest.mark.parametrize("stem", list(SHAPES))
def test_seed_001_config_shapes_load(tmp_path, stem, suffix):
    mode = SHAPES[stem]
    # the Apex face (mixprec.apex.policy) validates AMP_TYPE.APEX; it is checked separately
    config = load_config(write_shape(tmp_path, stem, suffix), validate=mode is not AMP_TYPE.APEX)
    expected_keys = {"BATCH_SIZE", "DROP_RATE", "NUM_EPOCHS", "gradient_accumulation"}
    expected_keys |= {"clip_grad_norm"} | ({"fp16"} if mode is not None else set())
    assert set(config) == expected_keys  # the .py file's `AMP_TYPE` import is not a key
    assert (config.BATCH_SIZE, config.NUM_EPOCHS, config["DROP_RATE"]) == (128, 300, 0.1)
    assert (config.gradient_accumulation, config.clip_grad_norm) == (16, 1.0)
    if mode is not None:
        assert isinstance(config.fp16, Config)
        assert config.fp16.mode is mode  # JSON/TOML value strings become the same enum
    if mode is not AMP_TYPE.APEX:
        assert config_to_policy(config).name == EXPECTED_MODE_NAME[mode]


@pytest.mark.parametrize("stem", list(SHAPES))
def test_the_three_formats_load_the_same_config(tmp_path, stem):
    loaded = [
        load_config(write_shape(tmp_path, stem, suffix), validate=False).to_dict()
        for suffix in (".py", ".json", ".toml")
    ]
    assert loaded[0] == loaded[1] == loaded[2]


@pytest.mark.skipif(apex_face_missing(), reason="mixprec.apex (the Apex face) is not built yet")
def test_apex_config_validates_through_the_apex_face(tmp_path):
    config = load_config(write_shape(tmp_path, "config_AMP_apex", ".py"))
    policy = config_to_policy(config)
    # Apex's default opt_level is O1: fp32 params, fp16 autocast
    assert (policy.param_dtype, policy.compute_dtype) == (torch.float32, torch.float16)


def test_torch_config_keys_reach_the_policy(tmp_path):
    path = tmp_path / "c.py"
    path.write_text(
        "from mixprec import AMP_TYPE\n"
        "fp16 = dict(mode=AMP_TYPE.TORCH, init_scale=2.**10, growth_interval=7)\n"
    )
    policy = config_to_policy(load_config(path))
    assert (policy.loss_scale.init_scale, policy.loss_scale.growth_interval) == (1024.0, 7)


def test_bad_fp16_section_fails_at_load_unless_validate_is_false(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"fp16": {"mode": "torch", "init_scal": 4.0}}))
    with pytest.raises(ValueError, match=r"'init_scal'.*'init_scale'"):
        load_config(path)
    assert load_config(path, validate=False).fp16.init_scal == 4.0
    with pytest.raises(ValueError, match="needs a 'mode' key"):
        load_config({"fp16": {"init_scale": 4.0}})
    with pytest.raises(ValueError, match="'torhc'"):
        load_config({"fp16": {"mode": "torhc"}})


@pytest.mark.parametrize(
    "key, value, error",
    [
        ("clip_grad_norm", -1.0, ValueError),
        ("clip_grad_norm", "1.0", TypeError),  # mixprec.core.validate: a type error, as everywhere
        ("gradient_accumulation", 0, ValueError),
        ("gradient_accumulation", 2.0, ValueError),
        ("gradient_accumulation", True, ValueError),
    ],
)
def test_bad_training_keys_fail_at_load(key, value, error):
    with pytest.raises(error, match=f"{key}={value!r}"):
        load_config({key: value})
    assert load_config({key: value}, validate=False)[key] == value


def test_missing_file_and_unknown_extension(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_config(missing)
    (tmp_path / "c.yaml").write_text("a: 1\n")
    with pytest.raises(ValueError, match=r"'\.yaml'.*'\.py', '\.json', '\.toml'"):
        load_config(tmp_path / "c.yaml")
    with pytest.raises(TypeError, match="42"):
        load_config(42)  # type: ignore[arg-type]
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="object at top level"):
        load_config(tmp_path / "list.json")


def test_python_config_runs_exactly_the_named_file(tmp_path):
    # two files with the same module name: a sys.path/module-name lookup would mix them up
    for name, size in (("a", 1), ("b", 2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.py").write_text(f"BATCH_SIZE = {size}\n")
    modules_before = set(sys.modules)
    assert load_config(tmp_path / "a" / "config.py").BATCH_SIZE == 1
    assert load_config(str(tmp_path / "b" / "config.py")).BATCH_SIZE == 2
    assert set(sys.modules) == modules_before  # nothing registered as an importable module


def test_python_config_keeps_definitions_not_imports(tmp_path):
    path = tmp_path / "c.py"
    path.write_text(
        "import math\n"
        "import os.path\n"
        "from mixprec import AMP_TYPE as T\n"
        "_helper = 3\n"
        "SQRT = math.sqrt\n"
        "LR = 0.1 * _helper\n"
        "def schedule(step):\n"
        "    import random\n"
        "    return step\n"
        "model = dict(width=8, blocks=[dict(kind='mlp')])\n"
    )
    config = load_config(path)
    assert set(config) == {"SQRT", "LR", "schedule", "model"}
    assert config.SQRT(4.0) == 2.0 and config.schedule(5) == 5
    assert config.model.blocks[0].kind == "mlp"  # dicts inside lists become Config too


def test_config_is_a_dict_with_attribute_access():
    config = Config({"fp16": {"mode": AMP_TYPE.TORCH, "init_scale": 8.0}}, BATCH_SIZE=4)
    assert isinstance(config, dict) and isinstance(config.fp16, Config)
    assert config.fp16.init_scale == config["fp16"]["init_scale"] == 8.0
    assert "BATCH_SIZE" in config and "batch_size" not in config
    assert list(config) == ["fp16", "BATCH_SIZE"]
    assert config.get("NUM_EPOCHS", 10) == 10
    config.NUM_EPOCHS = 3
    config.extra = {"depth": 2}
    config.update(more={"x": 1})
    config.setdefault("other", {"y": 2})
    assert isinstance(config.extra, Config) and config.more.x == 1 and config.other.y == 2
    del config.NUM_EPOCHS
    assert "NUM_EPOCHS" not in config
    with pytest.raises(AttributeError, match=r"'BATCH_SZE'.*Did you mean 'BATCH_SIZE'"):
        _ = config.BATCH_SZE
    with pytest.raises(TypeError, match="keys must be str"):
        config[1] = 2  # type: ignore[index]
    # attribute access never hides a dict method; such keys are read by item
    config["items"] = 5
    assert callable(config.items) and config["items"] == 5


def test_to_dict_is_a_plain_deep_copy():
    config = Config(a={"b": {"c": [{"d": 1}]}})
    plain = config.to_dict()
    assert type(plain) is dict and type(plain["a"]["b"]) is dict
    assert type(plain["a"]["b"]["c"][0]) is dict
    plain["a"]["b"]["c"][0]["d"] = 2
    assert config.a.b.c[0].d == 1
    assert json.loads(json.dumps(plain)) == plain


def test_config_survives_pickle_and_deepcopy():
    config = Config(fp16={"mode": AMP_TYPE.NAIVE}, BATCH_SIZE=2)
    for clone in (pickle.loads(pickle.dumps(config)), copy.deepcopy(config), config.copy()):
        assert type(clone) is Config and isinstance(clone.fp16, Config)
        assert clone == config and clone.fp16.mode is AMP_TYPE.NAIVE


def test_global_context_before_launch_reads_torch_distributed():
    context = GlobalContext()
    assert not context.is_initialized
    assert (context.rank, context.world_size, context.local_rank) == (0, 1, None)
    assert context.config == {}
    loaded = context.load_config({"fp16": {"mode": "naive"}, "BATCH_SIZE": 3})
    assert context.config is loaded and context.config.BATCH_SIZE == 3
    assert isinstance(config_to_policy(context.config), Policy)
    context.reset()
    assert context.config == {} and context.local_rank is None
    assert isinstance(gpc, GlobalContext)
