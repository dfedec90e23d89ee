"""``pagedkv report``: the main job. Measures fork cost, copy-on-write, and memory waste.

With no arguments it runs every section on built-in workloads (no files needed) and prints
plain-text tables; ``--out DIR`` also writes report.md, report.json and PNG plots.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..report import SECTIONS, ReportOptions, build_report, render_text, write_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="Llama-3.1-8B", help="model whose KV bytes per token turn blocks into bytes")
    p.add_argument("--block-size", type=int, default=16, help="block size of the paged runs (default 16)")
    p.add_argument("--trace", type=Path, default=None, help="replay this trace file (Azure CSV or Mooncake JSONL)")
    p.add_argument("--data-dir", type=Path, default=None, help="where the public traces are (default ../shared/data)")
    p.add_argument("--sections", default=None, help=f"comma-separated subset of: {','.join(SECTIONS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small workloads (seconds): a smoke run")
    p.add_argument("--out", type=Path, default=None, help="also write report.md, report.json and PNG plots here")


def run(args: argparse.Namespace) -> int:
    if args.block_size < 1:
        raise SystemExit("pagedkv report: --block-size must be >= 1")
    if args.trace is not None and not args.trace.is_file():
        raise SystemExit(f"pagedkv report: no trace file at {args.trace}")
    opts = ReportOptions(
        model=args.model,
        block_size=args.block_size,
        seed=args.seed,
        quick=args.quick,
        trace=args.trace,
        data_dir=args.data_dir,
    )
    keys = [k.strip() for k in args.sections.split(",") if k.strip()] if args.sections else None
    t0 = time.perf_counter()

    def progress(key: str) -> None:
        print(f"[pagedkv report] {key} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr, flush=True)

    try:
        sections = build_report(opts, keys, progress)
    except ValueError as exc:
        raise SystemExit(f"pagedkv report: {exc}") from None
    sys.stdout.write(render_text(sections))
    if args.out is not None:
        for path in write_report(sections, opts, args.out):
            print(f"wrote {path}", file=sys.stderr)
    print(f"[pagedkv report] done in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0
