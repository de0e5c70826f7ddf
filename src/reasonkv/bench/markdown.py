"""The report's markdown: a cell, a row, a table, a section, and a comparison's tables, one per batch size."""

from __future__ import annotations

__all__ = ["cell", "per_batch", "row", "section", "table"]


def cell(value, fmt: str = "{:.2f}") -> str:
    """``value`` formatted, or ``-`` for a value not measured (None)."""
    return "-" if value is None else fmt.format(value)


def row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A whole table and the blank line after it."""
    return [row(header), "|" + "|".join("---" for _ in header) + "|", *(row(cells) for cells in rows), ""]


def section(title: str, text: str, level: str = "##") -> list[str]:
    """A heading and its one paragraph."""
    return [f"{level} {title}", "", text, ""]


def per_batch(summary: dict, title: str, text: str, header: list[str], rows, notes=None) -> list[str]:
    """A comparison of variants, one section per batch size (``summary``: batch -> variant -> its summary):
    ``title`` with the batch, ``text``, the table of ``rows(variants)`` and the sentences ``notes(variants)``."""
    lines: list[str] = []
    for batch, variants in summary.items():
        lines += [*section(f"{title} (batch {batch})", text, "###"), *table(header, rows(variants))]
        sentences = notes(variants) if notes else []
        lines += [*sentences, ""] if sentences else []
    return lines
