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

# key -> module under pagedkv.report; the order is the report's order: the vLLM paper's experiments
# in the paper's order (memory waste, then latency against request rate, block size, sharing,
# swap against recompute), the mechanisms they rest on (fork, copy-on-write), then what pagedkv
# adds beyond the paper.
SECTIONS: dict[str, str] = {
    "fig2": "fig2",
    "latency_rate": "latency_rate",
    "block_size": "block_size",
    "sharing": "sharing",
    "swap_vs_recompute": "swap_recompute",
    "fork_cost": "fork_cost",
    "cow_case": "cow_case",
    "cow_proof": "cow_proof",
    "prefix_hits": "prefix_hits",
    "chunked_spec": "chunked_spec",
    "livelock": "livelock",
    "host_offload": "host_offload",
    "fleet": "fleet",
    "hybrid": "hybrid",
    "nanovllm": "nanovllm",
}
# The model and GPU of the sections that do not name their own ({model}: --model).
_SETUPS = {
    "latency_rate": "OPT-13B's memory on an A100-40GB (the paper's); step times modelled",
    "block_size": "OPT-13B's memory (the paper's); allocator times measured on this machine",
    "fork_cost": "{model}'s KV sizes; fork times measured on this machine, copy times modelled for an H100",
    "cow_proof": "a small random-weight Llama on this machine; MiB scaled to {model}",
    "prefix_hits": "{model}'s KV sizes",
    "chunked_spec": "{model}'s KV sizes",
    "livelock": "{model} on an H100, step times modelled",
    "host_offload": "{model} on an H100, times modelled",
    "fleet": "{model} on H100s, times modelled",
    "hybrid": "gpt-oss, Gemma 3, Command R7B, Llama 4 Scout; one H100's KV memory, times modelled",
    "nanovllm": "no model (a stand-in forward pass); allocator times measured on this machine",
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
        if not sec.setup and key in _SETUPS:
            sec.setup = _SETUPS[key].format(model=opts.model)
        sections.append(sec)
    return sections


def render_text(sections: list[Section], summary_only: bool = False, opts: ReportOptions | None = None) -> str:
    """The terminal report: the run's header and the summary, then (unless ``summary_only``)
    every section."""
    from .findings import findings, to_text

    head = findings(sections)
    parts = ["\n".join(_header_lines(opts))] + ([to_text(head)] if head else [])
    if not summary_only:
        parts += [s.to_text() for s in sections]
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
    md = ["# pagedkv report", "", *_header_lines(opts), ""]
    if head:
        md += [to_markdown(head), ""]
    for i, sec in enumerate(sections):
        md.append(sec.to_markdown())
        md += [f"![{p.stem}]({p.name})" for p in pngs.get(i, [])]
        md.append("")
    (out_dir / "report.md").write_text("\n".join(md))
    payload = {"options": _options_dict(opts), "machine": machine(),
               "findings": [{"text": f.text, "claim": f.claim, "ours": f.ours, "published": f.paper,
                             "how": f.how, "gap": f.gap, "section": f.key} for f in head],
               "sections": [s.to_dict() for s in sections]}
    (out_dir / "report.json").write_text(json.dumps(payload, indent=1, default=_jsonable))
    return [out_dir / "report.md", out_dir / "report.json", *written]


def machine() -> dict:
    """What the run ran on: CPU model and cores, Python and package versions (torch only when
    installed; its version is read without importing it)."""
    import os
    import platform
    from importlib import metadata

    import numpy

    from .. import __version__

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 1
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = None
    return {"cpu": cpu, "cores": usable, "python": platform.python_version(), "numpy": numpy.__version__,
            "torch": torch, "pagedkv": __version__}


def _header_lines(opts: ReportOptions | None = None) -> list[str]:
    """The run's header: the machine and versions, and the options that change the numbers."""
    import textwrap

    m = machine()
    text = (f"Run on {m['cpu']} ({m['cores']} cores), Python {m['python']}, numpy {m['numpy']}, "
            f"torch {m['torch'] or 'not installed'}, pagedkv {m['pagedkv']}.")
    if opts is not None:
        text += (f" {'Quick run (small workloads, noisier numbers); ' if opts.quick else ''}seed {opts.seed}, "
                 f"paged block size {opts.block_size}"
                 f"{f', trace {Path(opts.trace).name}' if opts.trace else ''}.")
    return textwrap.wrap(text, 100, break_long_words=False, break_on_hyphens=False)


def _options_dict(opts: ReportOptions) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items() if k != "progress"}


def _jsonable(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, bytes):
        return value.hex()
    return str(value)
