"""Markdown tables, as every report and the docs print them."""

from __future__ import annotations


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


__all__ = ["markdown_table"]
