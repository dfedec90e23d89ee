"""Tables and report sections: the one shape every measured result takes before it is printed.

A section computes its numbers, puts them in :class:`Table` rows, and the CLI renders the same
tables as aligned text (terminal), Markdown (``--out``), JSON (``--out``) and PNG plots (``--out``,
when matplotlib is installed). Keeping the numbers in one structure is what keeps the four views
from disagreeing.

The terminal view fits ``TEXT_WIDTH`` (100) columns, so a report reads in an ordinary terminal and
survives a pager: prose is wrapped, a column of long explanations becomes a list under its table,
and a grid still too wide is split into several grids that each repeat the first column (the row
names). Markdown and JSON keep every table whole. Texts often come from docstrings, so Sphinx
roles (``:class:`~pagedkv.KVCacheManager```) are reduced to the name they point at.
"""
from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["Table", "Section", "fmt", "plain", "TEXT_WIDTH"]

TEXT_WIDTH = 100  # columns of terminal output
PROSE_MIN = 30  # a text column with a cell this long is listed under the grid, not inside it

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(~?)([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def _role_target(m: re.Match) -> str:
    target = m.group(2)
    return target.rsplit(".", 1)[-1] if m.group(1) else target


def plain(text: str) -> str:
    """``text`` without reStructuredText markup: ``:class:`~a.B``` -> ``B``, ``:func:`a.f``` ->
    ``a.f``, ````x```` -> ``x``."""
    return _LITERAL.sub(r"\1", _ROLE.sub(_role_target, text))


def _markdown(text: str) -> str:
    """reStructuredText roles and literals as Markdown code spans."""
    return _LITERAL.sub(r"`\1`", _ROLE.sub(lambda m: f"`{_role_target(m)}`", text))


def _wrap(text: str, width: int, indent: str = "", hang: str | None = None) -> list[str]:
    """Wrap one paragraph; ``hang`` indents the continuation lines (default: ``indent``)."""
    return textwrap.wrap(text, width, initial_indent=indent,
                         subsequent_indent=indent if hang is None else hang,
                         break_long_words=True, break_on_hyphens=False) or [indent.rstrip()]


def _wrap_block(block: str, width: int) -> list[str]:
    """A text block: one line is a paragraph, wrapped; several lines are preformatted (a worked
    example), short lines kept as they are and long ones wrapped under their own indentation
    (plus two)."""
    if "\n" not in block:
        return _wrap(block, width)
    out = []
    for line in block.splitlines():
        if len(line) <= width:
            out.append(line)
        else:
            lead = line[: len(line) - len(line.lstrip())]
            out += _wrap(line.strip(), width, lead, lead + "  ")
    return out


def fmt(value: Any) -> str:
    """Format one cell: ints (and integral floats) with thousands separators, other floats to 4
    significant digits (one decimal from 100 on): 256.0 -> "256", 1234.56 -> "1,234.6"."""
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
        if value.is_integer() and a < 1e6:  # 256.0 -> 256: integers show no ".0"
            return f"{int(value):,}"
        if a >= 100:
            return f"{value:,.1f}"
        return f"{value:.4g}"
    return str(value)


@dataclass
class Table:
    """A titled grid of results.

    ``plot`` optionally says how to draw it: ``{"name": file stem, "x": column, "y": [columns],
    "kind": "line"|"bar"|"stacked", ...}`` (every key: :mod:`pagedkv.report.plots`). Columns named
    in ``plot`` must hold numbers (None draws nothing).
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

    def to_text(self, width: int = TEXT_WIDTH) -> str:
        """Aligned text no wider than ``width``: long text columns listed under the grid, and the
        other columns split into grids that fit, each repeating the first column."""
        cells = [[str(c) for c in self.columns]] + [[fmt(v) for v in r] for r in self.rows]
        prose = [i for i in range(1, len(self.columns))
                 if any(isinstance(r[i], str) and len(r[i]) >= PROSE_MIN for r in self.rows)]
        grid = [i for i in range(len(self.columns)) if i not in prose]
        out = _wrap(plain(self.title), width)
        for k, group in enumerate(_column_groups(cells, grid, width)):
            if k:
                out.append("")
            out += _grid(cells, group, frozenset(self.text_columns()))
        for i in prose:
            out.append(f"  {self.columns[i]}:")
            for row in cells[1:]:
                out += _wrap(f"{row[0]}: {row[i]}", width, "  - ", "      ")
        out += [line for n in self.notes for line in _wrap(plain(n), width, "  ", "    ")]
        return "\n".join(out)

    def text_columns(self) -> list[int]:
        """Indices of the columns that hold text (any str cell): left-aligned in every view."""
        return [i for i in range(len(self.columns)) if any(isinstance(r[i], str) for r in self.rows)]

    def to_markdown(self) -> str:
        """A Markdown table (rows stay whole: a table is never wrapped), its title and notes as
        prose wrapped at ``TEXT_WIDTH``; text columns left-aligned, numbers right-aligned."""
        text = set(self.text_columns()) | {0}
        head = "| " + " | ".join(self.columns) + " |"
        sep = "|" + "|".join("---" if i in text else "---:" for i in range(len(self.columns))) + "|"
        body = ["| " + " | ".join(fmt(v) for v in r) + " |" for r in self.rows]
        notes = ["\n" + "\n".join(_wrap(_markdown(n), TEXT_WIDTH)) for n in self.notes]
        title = "\n".join(_wrap(f"**{_markdown(self.title)}**", TEXT_WIDTH))
        return "\n".join([title, "", head, sep, *body, *notes])

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "columns": list(self.columns),
            "rows": [list(r) for r in self.rows],
            "notes": [plain(n) for n in self.notes],
            "plot": self.plot.get("name") if self.plot else None,  # the PNG's stem, when drawn
        }


def _column_groups(cells: list[list[str]], columns: list[int], width: int) -> list[list[int]]:
    """Split ``columns`` (the first one being the row names) into as few runs as fit ``width``,
    as even in width as that allows; every run starts with the row names. A single column wider
    than ``width`` gets a run alone."""
    widths = {i: max(len(row[i]) for row in cells) for i in columns}
    first, rest = columns[0], columns[1:]

    def greedy(limit: int) -> list[list[int]]:
        groups, current, used = [], [first], widths[first]
        for i in rest:
            if len(current) > 1 and used + 2 + widths[i] > limit:
                groups.append(current)
                current, used = [first], widths[first]
            current.append(i)
            used += 2 + widths[i]
        return groups + [current]

    fewest = greedy(width)
    if len(fewest) == 1:
        return fewest
    body = sum(2 + widths[i] for i in rest)
    for limit in range(widths[first] + body // len(fewest), width):
        even = greedy(limit)
        if len(even) == len(fewest):
            return even
    return fewest


def _grid(cells: list[list[str]], columns: list[int], text: frozenset = frozenset()) -> list[str]:
    """Header, rule and rows of ``columns``: the first and the ``text`` columns left-aligned, the
    others (numbers) right-aligned."""
    widths = [max(len(row[i]) for row in cells) for i in columns]

    def line(row: list[str]) -> str:
        parts = [row[columns[0]].ljust(widths[0])]
        parts += [row[i].ljust(w) if i in text else row[i].rjust(w) for i, w in zip(columns[1:], widths[1:])]
        return "  ".join(parts).rstrip()

    return [line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]]


@dataclass
class Section:
    """One question the report answers: a heading, a short explanation, tables, free text."""

    key: str
    heading: str
    intro: str = ""
    tables: list[Table] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # preformatted blocks (worked examples)
    data: dict[str, Any] = field(default_factory=dict)  # headline numbers for JSON and tests
    setup: str = ""  # the model and GPU the section uses: "OPT-13B on an A100-40GB"

    def setup_line(self) -> str:
        """The one line naming the section's model and GPU (empty when it names none)."""
        return f"Model and GPU: {self.setup}." if self.setup else ""

    def to_text(self, width: int = TEXT_WIDTH) -> str:
        """The section as terminal text no line of which is wider than ``width``."""
        heading = plain(self.heading)
        out = [f"{heading}\n{'=' * min(len(heading), width)}"]
        if self.setup:
            out.append("\n".join(_wrap(self.setup_line(), width)))
        if self.intro:
            out.append("\n".join(_wrap(plain(self.intro), width)))
        out += ["\n".join(_wrap_block(plain(t), width)) for t in self.text]
        out += [t.to_text(width) for t in self.tables]
        return "\n\n".join(out)

    def to_markdown(self) -> str:
        """Markdown no prose line of which is wider than ``TEXT_WIDTH``: the intro and one-line
        text blocks are paragraphs, wrapped; a several-line block (a worked example) stays a
        code block, its long lines wrapped under their own indentation."""
        out = [f"## {_markdown(self.heading)}"]
        if self.setup:
            out.append("\n".join(_wrap(f"*{self.setup_line()}*", TEXT_WIDTH)))
        if self.intro:
            out.append("\n".join(_wrap(_markdown(self.intro), TEXT_WIDTH)))
        for t in self.text:
            if "\n" in t:
                out.append("```\n" + "\n".join(_wrap_block(plain(t), TEXT_WIDTH)) + "\n```")
            else:
                out.append("\n".join(_wrap(_markdown(t), TEXT_WIDTH)))
        out += [t.to_markdown() for t in self.tables]
        return "\n\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "heading": plain(self.heading),
            "setup": self.setup,
            "intro": plain(self.intro),
            "text": [plain(t) for t in self.text],
            "data": self.data,
            "tables": [t.to_dict() for t in self.tables],
        }
