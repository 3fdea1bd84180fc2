"""benchmarks/bench_fp8.py's recipe axis at a tiny size: one row per recipe, its files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from mixprec.fp8 import RECIPES


def test_recipe_axis_writes_one_row_per_recipe(tmp_path: Path) -> None:
    path = Path(__file__).parent.parent / "benchmarks" / "bench_fp8.py"
    spec = importlib.util.spec_from_file_location("bench_fp8", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "recipes"
    argv = ["--recipes", "all", "--widths", "32", "--tokens", "16", "--steps", "1"]
    assert module.main([*argv, "--warmup", "0", "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {
        "fp8_recipes_cpu.md",
        "fp8_recipes_cpu.json",
        "fp8_recipes_cpu.png",
    }
    rows = json.loads((out / "fp8_recipes_cpu.json").read_text())["results"]
    assert [r["recipe"] for r in rows] == list(RECIPES)
    by_recipe = {r["recipe"]: r["sqnr_db"] for r in rows}
    # rowwise_with_gw_hp leaves grad_weight unquantized: no entry for it
    assert "grad_weight.A" not in by_recipe["rowwise_with_gw_hp"]
    assert set(by_recipe["blockwise"]) == {
        f"{g}.{o}" for g in ("forward", "grad_input", "grad_weight") for o in "AB"
    }
    assert min(by_recipe["nvfp4"].values()) < 25 < min(by_recipe["mxfp8"].values())
    assert "| nvfp4 | 32 |" in (out / "fp8_recipes_cpu.md").read_text()
