"""PNG plots of report tables (matplotlib, an optional extra: ``pip install "pagedkv[plot]"``).

A table opts in with a ``plot`` hint; this module only draws what the hint names, so a plot can
never show a number the table does not. The hint (see :class:`~pagedkv.report.tables.Table`):

- ``name``: the file's stem, short and stable (``fig2_breakdown`` -> ``fig2_breakdown.png``);
- ``x``, ``y`` (columns), ``kind``: ``"line"``, ``"bar"`` (grouped) or ``"stacked"`` (each row one
  bar, the ``y`` columns stacked; they should sum to 100);
- ``marker``: a column of reference values (the paper's), drawn as a black line across each bar
  (or a diamond on a line plot); a missing value draws nothing; ``marker_label`` names it in the
  legend;
- ``paper_stack`` (``stacked``): columns of a published bar, one per ``y`` column in the same
  order, drawn as a narrow hatched bar beside each of ours (a segment per category, so every
  category has its mark); missing values draw nothing; ``paper_label`` names it in the legend;
- ``band``: ``{y column: [low column, high column]}``, drawn as an error bar from low to high
  (for ``stacked``, on top of the first ``y`` segment), named ``band_label`` in the legend;
  ``bands`` (bars): more ranges around the first ``y`` series, ``[{"cols": [low, high], "label":
  ..., "colour": ..., "offset": ...}]``, drawn beside it;
- ``ref_range``: ``[low column, high column]``, a published range drawn as a grey span beside the
  bar, named ``ref_label`` in the legend;
- ``annotate``: a column whose values are written above the bars (``annotate_format``, e.g.
  ``"batch {}"``);
- ``xlabels``: columns whose values name each bar together (``"k=4, p=0.3"``) instead of ``x``;
  ``legend``: ``{column: label}`` for series whose column names are terse; ``styles`` (lines):
  ``{column: matplotlib line keywords}`` (``{"linestyle": "--"}``: a model apart from measurements);
- ``annotate_values``: write every bar's value on it (a zero shows as "0", not as nothing);
- ``label_replace``: ``[[old, new], ...]`` applied to the bar labels (shorter names under bars);
  ``footnote``: a line under the plot (what a shortened label means);
- ``label_last`` (lines): a dotted vertical line at the last x, labelled ``"<label>: <x>"``
  (the trace's end);
- ``hline``: ``[column, label]``, the column's (first present) value drawn as a dashed line
  across the plot (an ideal, a bound); ``[number, label]`` draws that number (a stated tolerance);
- ``vline``: ``[column or number, label]``, a dotted vertical line at that x (lines only; a
  column's first present value), named in the legend (a capacity rate);
- ``y2`` (lines): columns drawn on a second y axis at the right, labelled ``ylabel2``, dashed, in
  the same legend: a quantity in other units never shares the left axis;
- ``points`` (lines): markers only, no line between them (categories on x, not a trend);
- ``highlight`` (bars): ``{"column": c, "prefix": p, "colour": ..., "label": ..., "other": ...}``,
  bars whose ``c`` starts with ``p`` drawn in ``colour`` and named ``label`` in the legend, the
  others named ``other`` (livelocked runs apart from completed ones);
- ``logx`` (``logx_base``, default 2; ticks at the points' x, in plain numbers), ``logy``, ``ymin`` (e.g. 0: the axis starts there), ``ymax``, ``ylabel``, ``xlabel``, ``title``
  (default: the table's title).
"""
from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path

from .tables import Table, fmt

__all__ = ["plot_available", "plot_table", "plot_name"]

_NAME = re.compile(r"^[a-z0-9_]{1,40}$")
# Colours for the Fig. 2 categories, in the paper's order, so every stacked plot reads the same.
_STACK_COLOURS = ("#2b8cbe", "#a6bddb", "#fdae6b", "#bdbdbd", "#d9d9d9")


def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_name(table: Table) -> str | None:
    """The file stem a table's plot is written under (its hint's ``name``), or None without a plot.
    ValueError for a hint with no name or a name that is not short lowercase ``[a-z0-9_]``."""
    hint = table.plot
    if not hint:
        return None
    name = hint.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"table {table.title!r}: plot hint needs a short lowercase name "
                         f"([a-z0-9_], at most 40 characters), got {name!r}")
    return name


def _numbers(table: Table, name: str) -> list[float]:
    """A column as floats; a missing cell (None, e.g. no published figure) becomes NaN: a gap."""
    return [float("nan") if v is None else float(v) for v in table.column(name)]


def _present(values: list[float]) -> bool:
    return any(not math.isnan(v) for v in values)


def _band(ax, xs, centre, lo, hi, colour="black", label=None) -> None:
    """Error bars from ``lo`` to ``hi`` at ``xs`` (skipping missing values); a dot marks the
    centre, so a range narrower than its caps still shows."""
    pts = [(x, c, c - a, b - c) for x, c, a, b in zip(xs, centre, lo, hi)
           if not (math.isnan(c) or math.isnan(a) or math.isnan(b))]
    if pts:
        x, c, down, up = zip(*pts)
        ax.errorbar(x, c, yerr=[[max(d, 0) for d in down], [max(u, 0) for u in up]], fmt="o", markersize=3,
                    color=colour, ecolor=colour, elinewidth=1.5, capsize=5, capthick=1.5, zorder=6, label=label)


def _marker(ax, xs, values, width, label) -> None:
    """A reference value (the paper's) as a short thick black line across each bar."""
    pts = [(x, v) for x, v in zip(xs, values) if not math.isnan(v)]
    if pts:
        x, v = zip(*pts)
        ax.hlines(v, [a - width * 0.6 for a in x], [a + width * 0.6 for a in x], colors="black",
                  linewidths=2.5, zorder=5, label=label)


def _short(label: str, hint: dict) -> str:
    for old, new in hint.get("label_replace", ()):
        label = label.replace(old, new)
    return label


def _group_positions(x: list, hint: dict) -> tuple[list[float], list[str], list[tuple[float, str]]]:
    """Bar positions with a gap between groups of rows (``"group / name"`` labels), the tick labels
    (the names, wrapped to fit under a bar) and ``(centre, group)`` for each group."""
    pos, labels, groups, at = [], [], [], 0.0
    for v in x:
        group, _, name = (v if isinstance(v, str) else fmt(v)).rpartition(" / ")
        if groups and group != groups[-1][1]:
            at += 0.6
        if not groups or group != groups[-1][1]:
            groups.append(([], group))
        groups[-1][0].append(at)
        pos.append(at)
        width = max(8, 90 // max(len(x), 1))  # whole words only: "unfreeing", never "unfreein g"
        labels.append("\n".join(textwrap.wrap(_short(name, hint), width, break_long_words=False)))
        at += 1.0
    return pos, labels, [(sum(p) / len(p), g) for p, g in groups if g]


def _ref_range(ax, xs, lo, hi, offset, label) -> None:
    first = True
    for x, a, b in zip(xs, lo, hi):
        if math.isnan(a) or math.isnan(b):
            continue
        ax.plot([x + offset, x + offset], [a, b], color="grey", linewidth=5, alpha=0.6,
                solid_capstyle="butt", zorder=3, label=label if first else None)
        first = False


def _group_labels(ax, groups, labels=()) -> None:
    """Each group's name (the workload) right under its bars' tick labels: the offset follows the
    tallest tick label (lines of 7-point text)."""
    lines = max((lab.count("\n") + 1 for lab in labels), default=1)
    for centre, group in groups:
        ax.annotate(group, (centre, 0), xycoords=ax.get_xaxis_transform(), xytext=(0, -(10 + 9 * lines)),
                    textcoords="offset points", ha="center", va="top", fontsize=8, fontweight="bold")


def _draw_bars(ax, table: Table, hint: dict, x: list) -> dict:
    extra: dict = {}
    ys = hint["y"]
    centres, labels, groups = _group_positions(x, hint)
    width = 0.8 / len(ys)
    band = hint.get("band", {})
    fmt = hint.get("annotate_format", "{}")
    tops: list[float] = []
    for i, name in enumerate(ys):
        pos = [c - 0.4 + width * (i + 0.5) for c in centres]
        vals = _numbers(table, name)
        label = hint.get("legend", {}).get(name, name)
        light = hint.get("highlight") if i == 0 else None
        if light:  # some bars apart (livelocked runs): a colour and a legend entry each
            marked = [str(v).startswith(light["prefix"]) for v in table.column(light["column"])]
            colours = [light.get("colour", "#d62728") if m else "#1f77b4" for m in marked]
            bars = ax.bar(pos, vals, width=width, color=colours, zorder=2)
            from matplotlib.patches import Patch

            handles = [Patch(color="#1f77b4", label=light.get("other", label)),
                       Patch(color=light.get("colour", "#d62728"), label=light["label"])]
            extra["handles"] = handles
        else:
            bars = ax.bar(pos, vals, width=width, label=label, zorder=2)
        if name in band:
            lo, hi = band[name]
            _band(ax, pos, vals, _numbers(table, lo), _numbers(table, hi), label=hint.get("band_label"))
        for extra in hint.get("bands", ()) if i == 0 else ():  # more ranges, beside the first
            _band(ax, [p + extra.get("offset", 0.15) for p in pos], vals, _numbers(table, extra["cols"][0]),
                  _numbers(table, extra["cols"][1]), colour=extra.get("colour", "grey"), label=extra.get("label"))
        if hint.get("annotate_values"):  # every bar's own value written on it
            for rect, v in zip(bars, vals):
                if not math.isnan(v):
                    ax.annotate(f"{v:,.4g}", (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                                xytext=(0, 2), textcoords="offset points", ha="center", fontsize=6)
        tops = [t if math.isnan(v) else max(t, v) for t, v in zip(tops, vals)] if i else [
            0.0 if math.isnan(v) else v for v in vals]
    if hint.get("annotate"):  # one label per group, above its tallest bar
        for centre, top, text in zip(centres, tops, table.column(hint["annotate"])):
            if text is not None:
                ax.annotate(fmt.format(text), (centre, top), xytext=(0, 3), textcoords="offset points",
                            ha="center", fontsize=7)
    if hint.get("marker"):
        _marker(ax, [c - 0.4 + width / 2 for c in centres] if len(ys) > 1 else centres,
                _numbers(table, hint["marker"]), width, hint.get("marker_label", hint["marker"]))
    if hint.get("ref_range"):
        lo, hi = hint["ref_range"]
        _ref_range(ax, centres, _numbers(table, lo), _numbers(table, hi), 0.45, hint.get("ref_label", f"{lo} .. {hi}"))
    ax.set_xticks(centres, labels, fontsize=7)
    _group_labels(ax, groups, labels)
    return extra


def _draw_stacked(ax, table: Table, hint: dict, x: list) -> None:
    ys = hint["y"]
    pos, labels, groups = _group_positions(x, hint)
    paper = hint.get("paper_stack")
    width = 0.55 if paper else 0.7
    ours = [p - 0.1 for p in pos] if paper else pos
    bottom = [0.0] * len(x)
    for i, name in enumerate(ys):
        vals = [0.0 if math.isnan(v) else v for v in _numbers(table, name)]
        ax.bar(ours, vals, bottom=bottom, width=width, label=hint.get("legend", {}).get(name, name),
               color=_STACK_COLOURS[i % len(_STACK_COLOURS)], edgecolor="white", linewidth=0.5, zorder=2)
        bottom = [b + v for b, v in zip(bottom, vals)]
    if paper:  # the published bar beside ours, one hatched segment per category
        bottom = [0.0] * len(x)
        first = True
        for i, name in enumerate(paper):
            vals = _numbers(table, name)
            pts = [(p + 0.3, v, b) for p, v, b in zip(pos, vals, bottom) if not math.isnan(v)]
            if pts:
                px, pv, pb = zip(*pts)
                ax.bar(px, pv, bottom=pb, width=0.16, color=_STACK_COLOURS[i % len(_STACK_COLOURS)],
                       edgecolor="black", linewidth=0.6, hatch="///", zorder=2,
                       label=hint.get("paper_label", "paper") if first else None)
                first = False
            bottom = [b + (0.0 if math.isnan(v) else v) for b, v in zip(bottom, vals)]
    band = hint.get("band", {})
    if ys[0] in band:
        lo, hi = band[ys[0]]
        _band(ax, ours, _numbers(table, ys[0]), _numbers(table, lo), _numbers(table, hi),
              label=hint.get("band_label"))
    if hint.get("marker"):
        _marker(ax, ours, _numbers(table, hint["marker"]), width, hint.get("marker_label", hint["marker"]))
    ax.set_xticks(pos, labels, fontsize=7)
    _group_labels(ax, groups, labels)
    ax.set_ylim(0, 100)


def _draw_lines(ax, table: Table, hint: dict, x: list) -> dict:
    extra: dict = {}
    for name in hint["y"]:
        vals = _numbers(table, name)
        style = {"marker": "o", **({"linestyle": "none", "markersize": 8} if hint.get("points") else {}),
                 **hint.get("styles", {}).get(name, {})}
        ax.plot(x, vals, label=hint.get("legend", {}).get(name, name), zorder=3, **style)
        if name in hint.get("band", {}):
            lo, hi = hint["band"][name]
            _band(ax, x, vals, _numbers(table, lo), _numbers(table, hi))
    if hint.get("marker"):
        vals = _numbers(table, hint["marker"])
        pts = [(a, v) for a, v in zip(x, vals) if not math.isnan(v)]
        if pts:
            ax.scatter(*zip(*pts), marker="D", s=50, color="black", zorder=5,
                       label=hint.get("marker_label", hint["marker"]))
    if x and all(isinstance(v, str) for v in x):  # categories: labels wrapped, room at both ends
        ax.set_xticks(range(len(x)), ["\n".join(textwrap.wrap(_short(v, hint), 24, break_long_words=False))
                                      for v in x], fontsize=7)
        ax.set_xlim(-0.5, len(x) - 0.5)
    if hint.get("y2"):  # other units on their own axis, at the right
        right = ax.twinx()
        colours = iter(("#2ca02c", "#9467bd", "#8c564b"))
        for name in hint["y2"]:
            right.plot(x, _numbers(table, name), linestyle="--", marker="s", color=next(colours),
                       label=hint.get("legend", {}).get(name, name) + " (right axis)", zorder=3)
        right.set_ylabel(hint.get("ylabel2", ""))
        if hint.get("ymax2") is not None:
            right.set_ylim(0, hint["ymax2"])
        extra["twin"] = right
    if hint.get("vline"):
        col, label = hint["vline"]
        at = col if isinstance(col, (int, float)) else next(
            (v for v in _numbers(table, col) if not math.isnan(v)), None)
        if at is not None:
            ax.axvline(at, color="grey", linestyle=":", linewidth=1.5, label=f"{label} ({fmt(at)})", zorder=1)
    if hint.get("label_last") and x:  # name the last point (a trace's end) on the axis
        ax.axvline(x[-1], color="grey", linestyle=":", linewidth=1, zorder=1)
        ax.annotate(f"{hint['label_last']}: {fmt(x[-1])}", (x[-1], 0), xycoords=("data", "axes fraction"),
                    xytext=(-3, 4), textcoords="offset points", ha="right", fontsize=7)
    if hint.get("logx"):
        from matplotlib.ticker import FuncFormatter

        from matplotlib.ticker import FixedLocator, NullLocator

        ax.set_xscale("log", base=hint.get("logx_base", 2))
        points = sorted({float(v) for v in x if isinstance(v, (int, float)) and v > 0})
        if points:  # ticks where the points are (250, 500, 1,000), not at powers of the base
            ax.xaxis.set_major_locator(FixedLocator(points))
            ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,g}"))  # 1,024, not 2^10
    return extra


def _title(text: str, width: int = 95) -> str:
    """A title on one line, or broken at a phrase (after a colon, a comma or before a parenthesis)
    rather than mid-phrase when it is too long."""
    if len(text) <= width:
        return text
    for stop in (r"[:;] ", r", ", r"(?= \()"):  # a colon first, then a comma, then a parenthesis
        cuts = [m.end() for m in re.finditer(stop, text) if 20 <= m.end() <= width]
        if cuts:
            head, tail = text[:cuts[-1]].rstrip(), text[cuts[-1]:].strip()
            return head + "\n" + _title(tail, width)
    return "\n".join(textwrap.wrap(text, width))


def plot_table(table: Table, out_dir: Path) -> Path | None:
    """Draw ``table`` as ``out_dir/<hint name>.png``; returns the path, or None without a hint."""
    name = plot_name(table)
    hint = table.plot
    if name is None or not table.rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = table.column(hint["x"])
    if hint.get("xlabels"):  # bars named by several columns: "k=4, p=0.3"
        cols = hint["xlabels"]
        x = [", ".join(f"{c}={fmt(v)}" for c, v in zip(cols, vals)) for vals in zip(*(table.column(c) for c in cols))]
    kind = hint.get("kind", "line")
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=110)
    extra = {"bar": _draw_bars, "stacked": _draw_stacked, "line": _draw_lines}[kind](ax, table, hint, x) or {}
    if hint.get("hline"):
        col, label = hint["hline"]
        if isinstance(col, (int, float)):
            ax.axhline(col, color="black", linestyle="--", linewidth=1, label=label)
        else:
            vals = [v for v in _numbers(table, col) if not math.isnan(v)]
            if vals:
                ax.axhline(vals[0], color="black", linestyle="--", linewidth=1, label=f"{label} ({vals[0]:.1f})")
    if hint.get("logy"):
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,g}"))  # 100, not 10^2
    if hint.get("ymin") is not None:
        ax.set_ylim(bottom=hint["ymin"])
    if hint.get("ymax") is not None:
        ax.set_ylim(top=hint["ymax"])
    ax.set_xlabel(hint.get("xlabel", hint["x"]))
    ax.set_ylabel(hint.get("ylabel", ""))
    ax.set_title(_title(hint.get("title", table.title)), fontsize=9)
    ax.grid(alpha=0.3, zorder=0)
    outside = kind == "stacked" or bool(hint.get("legend_outside"))
    handles, labels = ax.get_legend_handles_labels()
    twin = extra.get("twin")
    if twin is not None:
        more, names = twin.get_legend_handles_labels()
        handles, labels = handles + more, labels + names
    if extra.get("handles"):
        handles, labels = extra["handles"] + handles, [h.get_label() for h in extra["handles"]] + labels
    if twin is not None:  # both y axes carry labels: the legend goes under the plot
        ax.legend(handles, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    elif outside:
        ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(handles, labels, fontsize=7)
    if hint.get("footnote"):  # under the tick labels, the group names and the axis label
        lines = max((t.get_text().count("\n") + 1 for t in ax.get_xticklabels()), default=1)
        below = 10 + 9 * lines + (14 if any(x and " / " in str(x) for x in x) else 0) + (14 if ax.get_xlabel() else 0)
        ax.annotate(hint["footnote"], (0, 0), xycoords="axes fraction", xytext=(0, -below - 6),
                    textcoords="offset points", ha="left", va="top", fontsize=7, style="italic")
    fig.tight_layout()
    path = Path(out_dir) / f"{name}.png"
    fig.savefig(path, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)
    return path
