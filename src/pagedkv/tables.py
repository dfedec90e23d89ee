"""Tables and report sections: the one shape every measured result takes before it is printed.

A section computes its numbers, puts them in :class:`Table` rows, and the CLI renders the same
tables as aligned text (terminal), Markdown (``--out``), JSON (``--out``) and PNG plots (``--out``,
when matplotlib is installed). Keeping the numbers in one structure is what keeps the four views
from disagreeing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["Table", "Section", "fmt"]


def fmt(value: Any) -> str:
    """Format one cell: ints with thousands separators, floats to 4 significant digits."""
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        if value == 0:
            return "0"
        a = abs(value)
        if a >= 1e6 or a < 1e-3:
            return f"{value:.3g}"
        if a >= 100:
            return f"{value:,.1f}"
        return f"{value:.4g}"
    return str(value)


@dataclass
class Table:
    """A titled grid of results.

    ``plot`` optionally says how to draw it: ``{"x": column, "y": [columns], "kind": "line"|"bar",
    "logx": bool, "logy": bool, "ylabel": str}``. Columns named in ``plot`` must hold numbers.
    """

    title: str
    columns: Sequence[str]
    rows: list[Sequence[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plot: dict[str, Any] | None = None

    def add(self, *row: Any) -> None:
        if len(row) != len(self.columns):
            raise ValueError(f"row has {len(row)} cells, table {self.title!r} has {len(self.columns)} columns")
        self.rows.append(list(row))

    def column(self, name: str) -> list[Any]:
        i = list(self.columns).index(name)
        return [r[i] for r in self.rows]

    def to_text(self) -> str:
        cells = [[str(c) for c in self.columns]] + [[fmt(v) for v in r] for r in self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.columns))]

        def line(row: list[str]) -> str:
            parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
            return "  ".join(parts).rstrip()

        out = [self.title, line(cells[0]), "  ".join("-" * w for w in widths)]
        out += [line(r) for r in cells[1:]]
        out += [f"  {n}" for n in self.notes]
        return "\n".join(out)

    def to_markdown(self) -> str:
        head = "| " + " | ".join(self.columns) + " |"
        sep = "|" + "|".join(["---"] + ["---:"] * (len(self.columns) - 1)) + "|"
        body = ["| " + " | ".join(fmt(v) for v in r) + " |" for r in self.rows]
        notes = [f"\n{n}" for n in self.notes]
        return "\n".join([f"**{self.title}**", "", head, sep, *body, *notes])

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "columns": list(self.columns),
            "rows": [list(r) for r in self.rows],
            "notes": list(self.notes),
        }


@dataclass
class Section:
    """One question the report answers: a heading, a short explanation, tables, free text."""

    key: str
    heading: str
    intro: str = ""
    tables: list[Table] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # preformatted blocks (worked examples)
    data: dict[str, Any] = field(default_factory=dict)  # headline numbers for JSON and tests

    def to_text(self) -> str:
        out = [f"{self.heading}\n{'=' * len(self.heading)}"]
        if self.intro:
            out.append(self.intro)
        out += self.text
        out += [t.to_text() for t in self.tables]
        return "\n\n".join(out)

    def to_markdown(self) -> str:
        out = [f"## {self.heading}"]
        if self.intro:
            out.append(self.intro)
        out += [f"```\n{t}\n```" for t in self.text]
        out += [t.to_markdown() for t in self.tables]
        return "\n\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "heading": self.heading,
            "intro": self.intro,
            "text": list(self.text),
            "data": self.data,
            "tables": [t.to_dict() for t in self.tables],
        }
