"""``pagedkv bench``: time the allocator's hot paths; one table of medians against the design targets.

Rows time the allocator (the performance table of the design document, docs/design.md in the
source repository, and a trace replay) and, when torch is installed, the physical KV store. ``ratio`` is ``median / target``:
at most 1 meets the target. Targets are goals, not results. Speed is never asserted anywhere;
this command only measures and prints (``--json`` also writes the rows plus the machine
description). On two cores the full run takes about 40 s, ``--quick`` a few seconds.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import time
from pathlib import Path

from ..report.tables import TEXT_WIDTH
from . import check_out_file, emit, reports_errors, write_text_atomically


def environment() -> dict:
    import numpy as np

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        import pagedkv

        pv = getattr(pagedkv, "__version__", "?")
    except ImportError:
        pv = "not importable"
    return {
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "numpy": np.__version__,
        "pagedkv": pv,
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "openblas_env": {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")},
    }


def _optional_rows(module: str, quick: bool) -> list[dict]:
    """Rows of an optional benchmark module; [] if it or torch is absent."""
    try:
        mod = importlib.import_module(module)
        return list(mod.rows(quick=quick))
    except ModuleNotFoundError as e:
        if e.name in (module, "torch") or (e.name or "").startswith("torch."):
            return []
        raise


def gather(quick: bool = False) -> list[dict]:
    from ..bench import core

    rows = list(core.rows(quick=quick))
    rows += _optional_rows("pagedkv.bench.store", quick)
    return rows


def _num(x) -> str:
    if x is None:
        return "-"
    x = float(x)
    if x != x:
        return "n/a"
    a = abs(x)
    if a == 0:
        return "0"
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:,.1f}"
    if a >= 1:
        return f"{x:.3g}" if a < 10 else f"{x:.1f}"
    return f"{x:.3g}"


def table(rows: list[dict], width: int = TEXT_WIDTH) -> str:
    """The rows as aligned text no wider than ``width``: a note that does not fit after its row
    goes on the lines below it, indented."""
    import textwrap

    head = ["name", "median", "unit", "target", "ratio"]
    body = []
    for r in rows:
        t = r.get("target")
        ratio = "-" if not t else f"{r['median'] / t:.2f}"
        body.append([r["name"], _num(r["median"]), r["unit"], _num(t), ratio])
    widths = [max(len(str(x[i])) for x in [head] + body) for i in range(len(head))]
    right = {1, 3, 4}

    def grid(row: list) -> str:
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(row, widths)))

    lines = [grid(head) + "  note", "  ".join("-" * w for w in widths) + "  ----"]
    for r, cells in zip(rows, body):
        line, note = grid(cells), r.get("note", "")
        if len(line) + 2 + len(note) <= width:
            lines.append(f"{line}  {note}".rstrip())
        else:
            lines.append(line.rstrip())
            lines += textwrap.wrap(note, width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines)


def verdict(rows: list[dict]) -> str:
    """The verdict on the rows that have a target: one line saying how many meet it (``median <=
    target``), then one line per row that does not, with its ratio. Example: ``Verdict: 2 of 3
    rows with a target meet it; 1 does not:`` and ``  fork, 2,048-token seq: 1.30x its target``."""
    judged = [r for r in rows if r.get("target")]
    missed = [r for r in judged if r["median"] > r["target"]]
    head = f"Verdict: {len(judged) - len(missed)} of {len(judged)} rows with a target meet it"
    if not missed:
        return head + "."
    lines = [f"{head}; {len(missed)} do{'es' if len(missed) == 1 else ''} not:"]
    lines += [f"  {r['name']}: {r['median'] / r['target']:.2f}x its target" for r in missed]
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, smaller replay: a few seconds (a smoke run)")
    ap.add_argument("--json", metavar="FILE", help="also write rows and environment as JSON")


@reports_errors("bench")
def run(args: argparse.Namespace) -> int:
    if args.json:
        check_out_file("--json", Path(args.json))
    env = environment()
    ob = ", ".join(f"{k}={v}" for k, v in env["openblas_env"].items()) or "none set"
    print(f"Python {env['python']}, numpy {env['numpy']}, pagedkv {env['pagedkv']}")
    print(f"CPU: {env['cpu']} ({env['cpu_count']} CPUs, {env['cpus_usable']} usable); {env['platform']}")
    print(f"OPENBLAS_* env: {ob}")
    t0 = time.perf_counter()
    rows = gather(args.quick)
    elapsed = time.perf_counter() - t0
    emit("\n" + table(rows) + f"\n\n{len(rows)} rows in {elapsed:.1f} s{' (--quick)' if args.quick else ''}; "
         "ratio = median / target (<= 1 meets the target of docs/design.md)\n" + verdict(rows))
    if args.json:
        write_text_atomically("--json", Path(args.json),
                              json.dumps({"environment": env, "quick": args.quick, "rows": rows}, indent=2))
    return 0

