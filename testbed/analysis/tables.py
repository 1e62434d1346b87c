"""Markdown tables, one way for every report (run, repetitions, sweeps, calibration, bathtub,
client against server)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

_ALIGN = {"l": "---", "r": "---:"}


def table_head(header: Sequence[str], align: str = "") -> list[str]:
    """The header line and the separator; ``align`` has one letter per column, ``l`` or
    ``r`` (missing letters: left)."""
    if len(align) > len(header) or set(align) - set(_ALIGN):
        raise ValueError(f"align {align!r} does not fit {len(header)} columns of l/r")
    seps = [_ALIGN[a] for a in align.ljust(len(header), "l")]
    return [table_row(header), "|" + "|".join(seps) + "|"]


def table_row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> list[str]:
    return [*table_head(header, align), *(table_row(r) for r in rows)]
