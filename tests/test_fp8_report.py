"""The fp8 quantization report: Float8Telemetry's ranked rows as markdown and PNG in a fresh
folder, and `mixprec doctor --fp8-report` (run in-process through the CLI's main)."""

from __future__ import annotations

import logging
import sys

import pytest

from mixprec import cli
from mixprec.debugging.fp8_report import (
    MARKDOWN_NAME,
    PNG_NAME,
    recipe_telemetry,
    report_markdown,
    write_report,
)
from mixprec.fp8 import Float8Telemetry
from mixprec.fp8.telemetry import OperandStats


def stats(layer, gemm, operand, role, sqnr, underflow=0.0):
    return OperandStats(
        layer=layer,
        gemm=gemm,
        operand=operand,
        role=role,
        kind="tensor",
        call=0,
        amax=448.0,
        scale_inv_min=0.5,
        scale_inv_max=0.5,
        underflow_pct=underflow,
        clipped_pct=0.0,
        sqnr_db=sqnr,
        block_range_log2=3.0,
    )


def test_markdown_is_the_ranked_rows_worst_first():
    telemetry = Float8Telemetry()
    telemetry.records += [
        stats("fc1", "forward", "A", "input", 30.0),
        stats("fc2", "forward", "B", "weight", 12.5, underflow=2.0),
        stats("fc1", "forward", "A", "input", 20.0),  # a later call replaces the first
    ]
    assert report_markdown(telemetry).splitlines() == [
        "| layer | gemm    | op       | kind   | amax | scale_inv | underflow% | clipped% | sqnr_dB "
        "| range_log2 |",
        "| ----- | ------- | -------- | ------ | ---- | --------- | ---------- | -------- | ------- "
        "| ---------- |",
        "| fc2   | forward | B:weight | tensor | 448  | 0.5..0.5  | 2.000      | 0.000    | 12.50   "
        "| 3.0        |",
        "| fc1   | forward | A:input  | tensor | 448  | 0.5..0.5  | 0.000      | 0.000    | 20.00   "
        "| 3.0        |",
    ]


@pytest.fixture(scope="module")
def tensorwise():
    return recipe_telemetry(["tensorwise"], steps=1)[0][1]


def test_write_report_writes_table_and_png_into_a_fresh_folder(tmp_path, tensorwise):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    folder = write_report(tensorwise, tmp_path / "report")
    assert folder == tmp_path / "report"
    assert (folder / MARKDOWN_NAME).read_text() == report_markdown(tensorwise) + "\n"
    assert (folder / PNG_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(folder / PNG_NAME).shape
    assert height > 100 and width > 100
    before = (folder / MARKDOWN_NAME).read_text()
    with pytest.raises(FileExistsError, match="never overwrites"):
        write_report(tensorwise, folder)
    assert (folder / MARKDOWN_NAME).read_text() == before


def test_write_report_without_a_folder_makes_a_new_one(tmp_path, monkeypatch, tensorwise):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    first, second = write_report(tensorwise), write_report(tensorwise)
    assert first != second and first.parent == second.parent == tmp_path
    assert first.name.startswith("mixprec-fp8-report-")
    assert (second / PNG_NAME).exists()


def test_write_report_without_matplotlib_says_so_and_writes_nothing(
    tmp_path, monkeypatch, tensorwise
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match=r"needs matplotlib: pip install 'mixprec\[bench\]'"):
        write_report(tensorwise, tmp_path / "report")
    assert not (tmp_path / "report").exists()
    with pytest.raises(ValueError, match="no observations"):
        write_report(Float8Telemetry(), tmp_path / "other")


def test_doctor_fp8_report_prints_each_recipe_table_and_writes_it(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    # an earlier test in this process may have given the "mixprec" logger its stdout handler
    # (get_dist_logger, verbose modes): its INFO lines are not the command's output
    monkeypatch.setattr(logging.getLogger("mixprec"), "handlers", [])
    argv = ["doctor", "--fp8-report", "--recipes", "tensorwise,nvfp4", "--steps", "1"]
    assert cli.main([*argv, "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    want = "".join(
        f"## {recipe}\n\n{report_markdown(t)}\n\n"
        for recipe, t in recipe_telemetry(["tensorwise", "nvfp4"], steps=1)
    )
    assert out.startswith(want)
    assert out[len(want) :] == (
        f"written: {tmp_path / 'r' / MARKDOWN_NAME}, {tmp_path / 'r' / PNG_NAME}\n"
    )
    assert (tmp_path / "r" / MARKDOWN_NAME).read_text() == want.rstrip("\n") + "\n"
    # the same folder again: refused, nothing overwritten
    assert cli.main([*argv, "--out", str(tmp_path / "r")]) == 2
    assert "never overwrites" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fp8-report", "--recipes", "tensorwise,bogus"], "'tensorwise,bogus': recipes are"),
        (["--fp8-report", "--steps", "0"], "--steps 0"),
        (["--out", "somewhere"], "--out apply only with --fp8-report"),
        (["--fp8-report", "--model", "m:f"], "--model do(es) not apply to --fp8-report"),
    ],
)
def test_doctor_fp8_report_refuses_bad_options(argv, message, capsys):
    assert cli.main(["doctor", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    if "bogus" in argv[-1]:
        assert "tensorwise, rowwise" in err
