"""MkDocs hook: serve the benchmark records in benchmarks/results/ under results/ in the site.

The records (markdown tables and PNG charts, each naming its machine, torch version and date)
stay where the benchmarks write them; the pages link `results/<record>` and this hook adds the
files to the build, so `mkdocs build --strict` checks every such link and `mkdocs serve` shows
the charts offline.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SERVED = (".md", ".png")


def on_files(files: Files, config) -> Files:
    for path in sorted((BENCHMARKS / "results").rglob("*")):
        if path.suffix in SERVED and path.is_file():
            rel = path.relative_to(BENCHMARKS).as_posix()  # "results/..."
            files.append(
                File(rel, str(BENCHMARKS), config["site_dir"], config["use_directory_urls"])
            )
    return files
