"""``pagedkv report``: the main job. Measures fork cost, copy-on-write, and memory waste.

With no arguments it runs every section on the built-in workloads and the public traces shipped
with pagedkv, and prints the summary and every section as plain-text tables (about 140 s of CPU,
measured as README.md says); ``--out DIR`` writes report.md, report.json and PNG plots instead and
prints only the summary and where they went. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from ..report import SECTIONS, TRACE_SECTIONS, ReportOptions, build_report, render_text, write_report
from . import (
    OutputError,
    UsageError,
    add_data_dir_argument,
    check_data_dir,
    check_int,
    check_model,
    check_out_dir,
    emit,
    reports_errors,
)

MAX_BLOCK_SIZE = 2048  # the report's context limit (the vLLM paper's max length)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="Llama-3.1-8B", metavar="NAME",
                   help="model whose KV bytes per token turn blocks into bytes (pagedkv size --list)")
    p.add_argument("--block-size", type=int, default=16, help="block size of the paged runs (default 16)")
    p.add_argument("--trace", type=Path, default=None, metavar="FILE",
                   help="also replay this trace file (Azure CSV or Mooncake JSONL, plain or .gz): "
                        "fig2 serves it; prefix_hits replays it if it is a Mooncake trace")
    add_data_dir_argument(p)
    p.add_argument("--sections", default=None, metavar="A,B",
                   help=f"run only these sections, in this order; any of: {', '.join(SECTIONS)}")
    p.add_argument("--seed", type=int, default=0, help="seed of every workload (default 0)")
    p.add_argument("--quick", action="store_true",
                   help="small workloads: about 20 s of CPU instead of about 140 s; a smoke "
                        "run whose numbers are noisier")
    p.add_argument("--nanovllm", type=Path, default=None, metavar="PATH",
                   help="a checkout of github.com/GeeeekExplorer/nano-vllm: the nanovllm section runs "
                        "its own scheduler (default: $PAGEDKV_NANOVLLM, an installed nanovllm, else "
                        "an engine written here with its rules)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="write report.md, report.json and PNG plots (with matplotlib) here, and print "
                        "only the summary")


def _sections(text: str | None) -> list[str] | None:
    """The ``--sections`` list, in the order given; empty, unknown or repeated names are errors."""
    if text is None:
        return None
    keys = [k.strip() for k in text.split(",")]
    if not any(keys):
        raise UsageError(f"--sections is empty; choose from {','.join(SECTIONS)}")
    if "" in keys:
        raise UsageError(f"--sections {text!r} has an empty name (a stray comma)")
    unknown = [k for k in keys if k not in SECTIONS]
    if unknown:
        raise UsageError(f"--sections: unknown {', '.join(unknown)}; choose from {','.join(SECTIONS)}")
    repeated = sorted({k for k in keys if keys.count(k) > 1}, key=keys.index)
    if repeated:
        raise UsageError(f"--sections names {', '.join(repeated)} more than once")
    return keys


def _check_trace(path: Path) -> None:
    """Read the whole ``--trace`` now, so that a malformed line stops the report before it starts."""
    from ..sim.traces import load_trace

    if not path.is_file():
        raise UsageError(f"--trace {path}: no such file")
    load_trace(path)


def _check_user_traces(data_dir: Path | None) -> None:
    """Read the traces of a user's data directory (``--data-dir`` or ``$PAGEDKV_DATA``) now: a
    malformed copy must stop the report before the first section, not after five of them."""
    from ..sim.traces import TRACE_FILES, bundled_data_dir, default_data_dir, load_trace, trace_path

    directory = data_dir if data_dir is not None else default_data_dir()
    if directory is None or directory == bundled_data_dir():
        return
    for name in TRACE_FILES:
        path = trace_path(name, directory)
        if path is not None:
            load_trace(path)


def _check_nanovllm(path: Path | None) -> None:
    """Load nano-vllm's files now (``--nanovllm``, else ``$PAGEDKV_NANOVLLM``): a path that holds
    no usable engine must stop the report before the first section."""
    from ..sim.nanovllm_files import ENV, load_engine

    env = os.environ.get(ENV)
    if path is not None:
        load_engine(path, "--nanovllm")
    elif env:
        try:
            load_engine(env, f"{ENV}")
        except ValueError as e:
            raise UsageError(f"{e} (unset {ENV} to run the engine written here)") from None


def _options(args: argparse.Namespace, progress) -> ReportOptions:
    check_int("--block-size", args.block_size, 1, MAX_BLOCK_SIZE, " (the report's context limit)")
    check_int("--seed", args.seed, 0)
    check_model("--model", args.model)
    check_data_dir("--data-dir", args.data_dir)
    _check_user_traces(args.data_dir)
    if args.trace is not None:
        _check_trace(args.trace)
    _check_nanovllm(args.nanovllm)
    return ReportOptions(model=args.model, block_size=args.block_size, seed=args.seed, quick=args.quick,
                         trace=args.trace, data_dir=args.data_dir, nanovllm=args.nanovllm, progress=progress)


def _write_out(sections, opts: ReportOptions, out: Path) -> list[Path]:
    """``write_report`` into a fresh directory inside ``out``, then each file renamed into
    ``out``: a disk that fills up or fails halfway leaves the files of an earlier run as they
    were and no truncated report.json or report.md that reads as complete."""
    try:
        staging = Path(tempfile.mkdtemp(prefix=".pagedkv-report-", dir=out))
    except OSError as e:
        raise OutputError(f"--out {out}: cannot write ({e.strerror or e}); nothing was written") from None
    moved: list[Path] = []
    try:
        written = write_report(sections, opts, staging)
        for path in written:
            os.replace(path, out / path.name)
            moved.append(out / path.name)
    except OSError as e:
        done = (f"only {', '.join(p.name for p in moved)} replaced" if moved else "nothing was written")
        raise OutputError(f"--out {out}: cannot write ({e.strerror or e}); {done}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [out / path.name for path in written]


@reports_errors("report")
def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[pagedkv report] {message} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr, flush=True)

    keys = _sections(args.sections)
    if args.trace is not None and keys is not None and not set(keys) & TRACE_SECTIONS:
        raise UsageError(f"--trace: none of the chosen sections reads a trace "
                         f"(those that do: {','.join(sorted(TRACE_SECTIONS))})")
    if args.nanovllm is not None and keys is not None and "nanovllm" not in keys:
        raise UsageError("--nanovllm: the nanovllm section, the only one that runs nano-vllm, is not "
                         "among the chosen sections")
    opts = _options(args, progress)
    if args.out is not None:
        check_out_dir("--out", args.out)
    sections = build_report(opts, keys, progress)
    if args.out is None:
        text = render_text(sections, opts=opts)
        emit(text[:-1] if text.endswith("\n") else text)
    else:
        from ..report.plots import plot_available

        progress("writing report.md, report.json and the plots")
        try:
            written = _write_out(sections, opts, args.out)
        except OutputError:
            text = render_text(sections, opts=opts)  # the files failed: the run's results still show
            emit(text[:-1] if text.endswith("\n") else text)
            raise
        pngs = [p for p in written if p.suffix == ".png"]
        where = (f"The whole report: {args.out / 'report.md'} (Markdown) and {args.out / 'report.json'} "
                 f"(every number)" + (f", with {len(pngs)} PNG plots in {args.out}." if pngs else "."))
        lines = textwrap.wrap(where, 100, break_long_words=False)
        if not plot_available():
            lines.append("No PNG plots: matplotlib is not installed (pip install 'pagedkv[plot]').")
        emit(render_text(sections, summary_only=True, opts=opts) + "\n" + "\n".join(lines))
    print(f"[pagedkv report] done in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0
