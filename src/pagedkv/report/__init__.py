"""``pagedkv report``: the sections that answer what paging costs and saves, and their assembly.

Each section module exposes ``section(opts: ReportOptions) -> Section`` and runs the real
manager (or the simulator driving it); this package only orders, renders and writes them.
``tables`` is the one shape every result takes (``Table``, ``Section``) and ``plots`` draws them.

What it may import: ``pagedkv`` (the allocator and the decoder proof: ``engine``, ``model``,
``store``), ``pagedkv.sim`` and ``pagedkv.events``; never ``commands`` or ``cli`` above it
(options come in as :class:`~pagedkv.report.options.ReportOptions`).
"""
from __future__ import annotations

import importlib
import json
import time
from pathlib import Path
from typing import Callable, Iterable

from .tables import Section
from .options import ReportOptions

__all__ = ["SECTIONS", "TRACE_SECTIONS", "ReportOptions", "build_report", "write_report", "render_text"]

# key -> module under pagedkv.report; the order is the report's order.
SECTIONS: dict[str, str] = {
    "fork_cost": "fork_cost",
    "cow_case": "cow_case",
    "cow_proof": "cow_proof",
    "fig2": "fig2",
    "block_size": "block_size",
    "hybrid": "hybrid",
    "sharing": "sharing",
    "prefix_hits": "prefix_hits",
    "chunked_spec": "chunked_spec",
    "livelock": "livelock",
    "swap_vs_recompute": "swap_recompute",
    "host_offload": "host_offload",
    "fleet": "fleet",
}
# The sections that replay a --trace file; the others run built-in workloads only.
TRACE_SECTIONS = frozenset({"fig2", "prefix_hits", "host_offload", "fleet"})


def _load(key: str) -> Callable[[ReportOptions], Section]:
    return importlib.import_module(f"{__name__}.{SECTIONS[key]}").section


def build_report(
    opts: ReportOptions,
    keys: Iterable[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[Section]:
    """Run the chosen sections (default: all) in report order; each reports its own seconds."""
    keys = list(SECTIONS) if keys is None else list(keys)
    unknown = [k for k in keys if k not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown report sections {unknown}; choose from {list(SECTIONS)}")
    sections = []
    for key in keys:
        if progress:
            progress(key)
        t0 = time.perf_counter()
        sec = _load(key)(opts)
        sec.data.setdefault("seconds", round(time.perf_counter() - t0, 2))
        sections.append(sec)
    return sections


def render_text(sections: list[Section]) -> str:
    """The terminal report: the findings first, then every section."""
    from .findings import findings, to_text

    head = findings(sections)
    parts = ([to_text(head)] if head else []) + [s.to_text() for s in sections]
    return "\n\n\n".join(parts) + "\n"


def write_report(sections: list[Section], opts: ReportOptions, out_dir: Path) -> list[Path]:
    """Write report.json, report.md and (with matplotlib) one PNG per plottable table, named by
    its hint (``fig2_breakdown.png``); two plots of one name are a ValueError."""
    from .plots import plot_available, plot_name, plot_table

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    pngs: dict[int, list[Path]] = {}
    names = [plot_name(t) for sec in sections for t in sec.tables if t.plot and t.rows]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"two plots are named {', '.join(repeated)}: each table's plot needs its own name")
    if plot_available():
        for i, sec in enumerate(sections):
            for table in sec.tables:
                path = plot_table(table, out_dir)
                if path is not None:
                    pngs.setdefault(i, []).append(path)
                    written.append(path)
    from .findings import findings, to_markdown

    head = findings(sections)
    md = ["# pagedkv report", "", *_options_lines(opts, sections), ""]
    if head:
        md += [to_markdown(head), ""]
    for i, sec in enumerate(sections):
        md.append(sec.to_markdown())
        md += [f"![{p.stem}]({p.name})" for p in pngs.get(i, [])]
        md.append("")
    (out_dir / "report.md").write_text("\n".join(md))
    payload = {"options": _options_dict(opts),
               "findings": [{"text": f.text, "section": f.key} for f in head],
               "sections": [s.to_dict() for s in sections]}
    (out_dir / "report.json").write_text(json.dumps(payload, indent=1, default=_jsonable))
    return [out_dir / "report.md", out_dir / "report.json", *written]


def _options_dict(opts: ReportOptions) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items() if k != "progress"}


def _options_lines(opts: ReportOptions, sections: list[Section]) -> list[str]:
    """The options header, true of every section: the model each section used is named (the
    sections that rebuild the vLLM paper's experiments run its OPT-13B, whatever ``--model``)."""
    import textwrap

    shown = {k: v for k, v in _options_dict(opts).items() if k != "model"}
    models: dict[str, list[str]] = {}
    for sec in sections:
        models.setdefault(sec.data.get("model", opts.model), []).append(sec.key)
    parts = [f"{model} in {', '.join(keys)}" for model, keys in models.items()]
    flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in shown.items()
             if v is not None and v is not False]  # as the user would type them
    text = ("Options: " + (" ".join(flags) or "the defaults")
            + f". Model (--model {opts.model}): " + "; ".join(parts) + ".")
    return textwrap.wrap(text, 100, break_long_words=False, break_on_hyphens=False)


def _jsonable(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, bytes):
        return value.hex()
    return str(value)
