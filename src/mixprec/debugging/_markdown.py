"""One markdown-table formatter shared by every debugging report."""

from __future__ import annotations

from collections.abc import Sequence


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-markdown table with padded columns, readable both raw and rendered."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"Row {row!r} has {len(row)} cells; the header has {len(headers)}.")
    widths = [max(3, *(len(row[i]) for row in cells)) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in cells
    ]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)
