"""PNG plots of report tables (matplotlib, an optional extra: ``pip install "pagedkv[plot]"``).

A table opts in with a ``plot`` hint; this module only draws what the hint names, so a plot can
never show a number the table does not.
"""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

from ..tables import Table

__all__ = ["plot_available", "plot_table"]


def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "table"


def _numbers(table: Table, name: str) -> list[float]:
    """A column as floats; a missing cell (None, e.g. no published figure) becomes NaN: a gap."""
    return [float("nan") if v is None else float(v) for v in table.column(name)]


def plot_table(table: Table, out_dir: Path, stem: str) -> Path | None:
    """Draw ``table`` as ``out_dir/<stem>-<title>.png``; returns the path, or None without a hint."""
    hint = table.plot
    if not hint or not table.rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = table.column(hint["x"])
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ys = hint["y"]
    if hint.get("kind", "line") == "bar":
        width = 0.8 / len(ys)
        for i, name in enumerate(ys):
            pos = [j + i * width for j in range(len(x))]
            ax.bar(pos, _numbers(table, name), width=width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(x))], [str(v) for v in x], rotation=20, ha="right")
    else:
        for name in ys:
            ax.plot(x, _numbers(table, name), marker="o", label=name)
        if hint.get("logx"):
            ax.set_xscale("log", base=2)
    if hint.get("logy"):
        ax.set_yscale("log")
    ax.set_xlabel(hint["x"])
    ax.set_ylabel(hint.get("ylabel", ""))
    ax.set_title("\n".join(textwrap.wrap(table.title, 90)), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(out_dir) / f"{stem}-{_slug(table.title)}.png"
    fig.savefig(path)
    plt.close(fig)
    return path
