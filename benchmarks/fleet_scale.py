"""How the fleet simulator's cost grows with replicas and trace length: wall-clock and CPU seconds
of what a user runs, measured.

    PYTHONPATH=src python benchmarks/fleet_scale.py            # the full tables (about 10 minutes on two cores)
    PYTHONPATH=src python benchmarks/fleet_scale.py --quick    # small ones (seconds)

Why wall clock and CPU both: a user waits for the wall clock, which also counts whatever else the
machine runs; CPU seconds (``time.process_time``, this process only) are what the simulator itself
costs and are steadier on a shared machine. Both are printed for every row.

Each row of the first table is one run of everything ``pagedkv fleet`` does for one router, timed
from the first byte read to the last result: load and parse the first N requests of the shipped
Mooncake conversation trace (:func:`pagedkv.sim.traces.load_mooncake_jsonl`), size the replicas
(an H100's KV memory for Llama-3.1-8B each, block size 16), check that the longest request fits,
build R replicas, serve the requests and, for the precise router, encode every replica's KV
events as vLLM's wire format and decode them. ``load s`` is the loading and parsing alone. Rows
cover R = 1 ... 32 replicas on one eighth of the trace, and one eighth ... all of the trace on 16
replicas, for round-robin (cache-blind), the consistent-hash ring with bounded loads and the
precise router.

The second table fits the growth: the least-squares slope of log(seconds) against log(requests)
at 16 replicas (1 means linear in the trace) and against log(replicas) at one length (0 means
the number of replicas costs nothing). The third times the command itself, as a user types it,
in a child process: ``pagedkv fleet --num-requests all --replicas 16 --router NAME``, wall clock
around it and the child's own CPU seconds (``os.wait4``), interpreter start-up and imports
included. (No peak memory: on Linux a child's ``ru_maxrss`` starts from the size of the parent it
was forked from, which by then holds the runs above.)
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pagedkv.sim import sizing
from pagedkv.sim.costmodel import CostModel
from pagedkv.sim.fleet import ReplicaAllocator, run_fleet
from pagedkv.sim.routers import make_router
from pagedkv.sim.scheduler import check_fits, clip_request
from pagedkv.sim.traces import load_mooncake_jsonl, trace_path
from pagedkv.report.tables import Table

__all__ = ["FULL", "QUICK", "ROUTERS", "growth_exponent", "measure", "measure_cli", "plan_runs", "main"]

ROUTERS = ("round-robin", "ring-bounded", "precise")
MAX_LEN = 131_072  # pagedkv fleet's default: Llama-3.1's context
# Request counts are fractions of the trace (1/8, 1/4, ...) in the full plan, so "whole" means
# every record of the shipped file; the quick plan uses small absolute counts.
FULL = {"replicas": (1, 2, 4, 8, 16, 32), "replicas_at": 1 / 8, "lengths": (1 / 8, 1 / 4, 1 / 2, 1.0),
        "at": 16, "cli_requests": None, "cli_replicas": 16}
QUICK = {"replicas": (1, 4), "replicas_at": 120, "lengths": (60, 120), "at": 4, "cli_requests": 60,
         "cli_replicas": 4}


def blocks_per_replica(block_size: int = 16) -> int:
    """Blocks of Llama-3.1-8B KV that an 80 GiB GPU at 90% holds after the weights (what
    ``pagedkv fleet`` gives each replica by default)."""
    spec = sizing.get_model("Llama-3.1-8B")
    weights = sizing.estimate_weight_bytes(spec)
    cap = sizing.fit_blocks(sizing.kv_size(spec, block_size=block_size), gpu_mem_gib=80.0, util=0.9,
                            weights_gib=weights / sizing.GIB)
    return cap.num_blocks


def _count(n: int | float, total: int) -> int:
    """A request count: ``n`` itself when it is an int, else that fraction of ``total``, rounded up."""
    return n if isinstance(n, int) else min(total, math.ceil(n * total))


def plan_runs(plan: dict, total: int) -> list[tuple[int, int]]:
    """The (replicas, requests) pairs a plan measures, each once, in the order they run."""
    at = _count(plan["replicas_at"], total)
    runs = [(r, at) for r in plan["replicas"]]
    runs += [(plan["at"], _count(n, total)) for n in plan["lengths"]]
    return list(dict.fromkeys(runs))


def measure(path: Path, requests: int, router: str, replicas: int) -> dict:
    """One run as ``pagedkv fleet`` does it, timed from loading the trace to the last result."""
    t0, c0 = time.perf_counter(), time.process_time()
    reqs = load_mooncake_jsonl(path, limit=requests)
    load_s = time.perf_counter() - t0
    blocks = blocks_per_replica()
    check_fits([clip_request(r, MAX_LEN) for r in reqs], ReplicaAllocator(blocks), MAX_LEN)
    res = run_fleet(reqs, make_router(router), replicas, blocks, cost=CostModel(), max_len=MAX_LEN)
    summary = res.summary()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"router": router, "replicas": replicas, "requests": len(reqs), "wall_s": wall, "cpu_s": cpu,
            "load_s": load_s, "iterations": int(res.iterations.sum()), "hit_rate": summary["hit_rate"],
            "event_bytes": res.event_bytes}


def cli_command(router: str, requests: int | None, replicas: int) -> list[str]:
    """The words a user types (after ``pagedkv``) to run ``router`` on the trace."""
    return ["fleet", "--num-requests", "all" if requests is None else str(requests), "--replicas",
            str(replicas), "--router", router]


def measure_cli(router: str, requests: int | None, replicas: int) -> dict:
    """``python -m pagedkv fleet ...`` in a child process: wall clock around it, and the child's
    own CPU seconds from ``os.wait4``."""
    words = cli_command(router, requests, replicas)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "pagedkv", *words], stdout=out, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - t0
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"pagedkv {' '.join(words)} exited {child.returncode}: "
                               f"{err.read().decode(errors='replace').strip()}")
    return {"command": "pagedkv " + " ".join(words), "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime}


def growth_exponent(x, y) -> float:
    """The least-squares slope of log(y) against log(x): y ~ x ** slope (nan with < 2 points)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 2 or len(set(x.tolist())) < 2:
        return math.nan
    return float(np.polyfit(np.log(x), np.log(y), 1)[0])


def _load() -> str:
    return "load average " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


def _machine() -> str:
    return (f"{datetime.date.today().isoformat()}, {platform.system()} {platform.machine()}, "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}, {_load()}")


def _progress(text: str) -> None:
    # stderr, so that stdout holds only the tables of a run that takes minutes
    print(text, file=sys.stderr, flush=True)


def tables(plan: dict, cli: bool = True) -> list[Table]:
    """Run ``plan`` and return its tables: the runs, the growth fits and (with ``cli``) the command."""
    path = trace_path("mooncake")
    if path is None:
        raise SystemExit("the Mooncake trace is not shipped in this checkout")
    total = len(load_mooncake_jsonl(path))
    runs = plan_runs(plan, total)
    started = _machine()
    t = Table(f"Fleet simulator cost vs replicas and trace length, Mooncake conversation trace "
              f"({total:,} requests): wall clock and CPU seconds of load + build + run",
              ["router", "replicas", "requests", "wall s", "CPU s", "load s", "ms / request", "us / iteration",
               "iterations", "hit %"])
    rows = []
    for router in ROUTERS:
        for replicas, n in runs:
            r = measure(path, n, router, replicas)
            rows.append(r)
            t.add(router, replicas, r["requests"], round(r["wall_s"], 2), round(r["cpu_s"], 2), round(r["load_s"], 2),
                  round(1e3 * r["wall_s"] / r["requests"], 2), round(1e6 * r["wall_s"] / max(r["iterations"], 1), 1),
                  r["iterations"], round(100 * r["hit_rate"], 2))
            _progress(f"{router}: {replicas} replicas, {r['requests']:,} requests: {r['wall_s']:.1f} s wall, "
                      f"{r['cpu_s']:.1f} s CPU")
    t.notes.append(f"ms / request and us / iteration: wall clock; iterations: scheduler iterations over all "
                   f"replicas (coalesced decode stretches counted one by one)")
    at = _count(plan["replicas_at"], total)
    g = Table(f"Growth: seconds ~ requests ** a at {plan['at']} replicas, seconds ~ replicas ** b at {at:,} "
              "requests (least-squares fits of the runs above)",
              ["router", "a (wall)", "a (CPU)", "ms / request (wall)", "b (wall)", "b (CPU)",
               f"wall at {max(plan['replicas'])} / at {min(plan['replicas'])} replicas"])
    for router in ROUTERS:
        mine = [r for r in rows if r["router"] == router]
        by_len = sorted((r for r in mine if r["replicas"] == plan["at"]), key=lambda r: r["requests"])
        by_rep = sorted((r for r in mine if r["requests"] == at and r["replicas"] in plan["replicas"]),
                        key=lambda r: r["replicas"])
        per_req = " to ".join(f"{1e3 * r['wall_s'] / r['requests']:.2f}" for r in (by_len[0], by_len[-1]))
        g.add(router, round(growth_exponent([r["requests"] for r in by_len], [r["wall_s"] for r in by_len]), 2),
              round(growth_exponent([r["requests"] for r in by_len], [r["cpu_s"] for r in by_len]), 2), per_req,
              round(growth_exponent([r["replicas"] for r in by_rep], [r["wall_s"] for r in by_rep]), 2),
              round(growth_exponent([r["replicas"] for r in by_rep], [r["cpu_s"] for r in by_rep]), 2),
              round(by_rep[-1]["wall_s"] / by_rep[0]["wall_s"], 2))
    g.notes.append(f"a = 1: cost linear in the trace; b = 0: flat in the number of replicas; ms / request: at "
                   f"{by_len[0]['requests']:,} and at {by_len[-1]['requests']:,} requests")
    out = [t, g]
    if cli:
        c = Table("The command as a user types it (child process; interpreter start-up and imports included)",
                  ["command", "wall s", "CPU s"])
        for router in ROUTERS:
            r = measure_cli(router, plan["cli_requests"], plan["cli_replicas"])
            c.add(r["command"], round(r["wall_s"], 2), round(r["cpu_s"], 2))
            _progress(f"{r['command']}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU")
        out.append(c)
    out[-1].notes.append(f"measured {started} (at the start; at the end: {_load()})")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small runs (seconds) instead of the whole trace")
    p.add_argument("--no-cli", action="store_true", help="skip timing the pagedkv fleet command itself")
    args = p.parse_args(argv)
    for t in tables(QUICK if args.quick else FULL, cli=not args.no_cli):
        print(t.to_text())
        print()


if __name__ == "__main__":
    main()
