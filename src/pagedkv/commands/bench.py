"""``pagedkv bench``: time the allocator's hot paths; one table of medians against DESIGN.md's targets.

Rows come from :mod:`pagedkv.bench.core` (the allocator: DESIGN.md's performance table and the
issue-2 trace replay) and, when present, :mod:`pagedkv.bench.store` (the physical KV store;
skipped if torch is missing). ``ratio`` is ``median / target``: at most 1 meets the target.
Targets are DESIGN.md's goals, not results. Speed is never asserted anywhere; this command only
measures and prints (``--json`` also writes the rows plus the machine description).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import time
from pathlib import Path

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


def table(rows: list[dict]) -> str:
    head = ["name", "median", "unit", "target", "ratio", "note"]
    body = []
    for r in rows:
        t = r.get("target")
        ratio = "-" if not t else f"{r['median'] / t:.2f}"
        body.append([r["name"], _num(r["median"]), r["unit"], _num(t), ratio, r.get("note", "")])
    widths = [max(len(str(x[i])) for x in [head] + body) for i in range(len(head) - 1)]
    right = {1, 3, 4}
    lines = []
    for row in [head] + body:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells + [str(row[-1])]).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 4)
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, smaller replay (smoke run)")
    ap.add_argument("--json", metavar="FILE", help="also write rows and environment as JSON")


def run(args: argparse.Namespace) -> int:
    env = environment()
    ob = ", ".join(f"{k}={v}" for k, v in env["openblas_env"].items()) or "none set"
    print(f"Python {env['python']}, numpy {env['numpy']}, pagedkv {env['pagedkv']}")
    print(f"CPU: {env['cpu']} ({env['cpu_count']} CPUs, {env['cpus_usable']} usable); {env['platform']}")
    print(f"OPENBLAS_* env: {ob}")
    t0 = time.perf_counter()
    rows = gather(args.quick)
    elapsed = time.perf_counter() - t0
    print()
    print(table(rows))
    print(f"\n{len(rows)} rows in {elapsed:.1f} s{' (--quick)' if args.quick else ''}; "
          "ratio = median / target (<= 1 meets DESIGN.md's target)")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": env, "quick": args.quick, "rows": rows}, indent=2))
    return 0

