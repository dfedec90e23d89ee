"""How the fleet simulator's cost grows with replicas and trace length (real runs, CPU seconds).

    PYTHONPATH=src python benchmarks/fleet_scale.py            # the full table (several minutes)
    PYTHONPATH=src python benchmarks/fleet_scale.py --quick    # a small one

Each row serves the first N requests of the Mooncake conversation trace on R replicas (an H100's
KV memory for Llama-3.1-8B each, block size 16) and reports the CPU seconds of the run, per
request and per simulated iteration, for a cache-blind router (round-robin) and for the precise
router (which also encodes, decodes and indexes every KV event, and rehashes each prompt).
"""
from __future__ import annotations

import argparse
import sys
import time

from pagedkv.sim import sizing
from pagedkv.sim.costmodel import CostModel
from pagedkv.sim.fleet import run_fleet
from pagedkv.sim.routers import make_router
from pagedkv.sim.traces import load_mooncake_jsonl, trace_path
from pagedkv.tables import Table

FULL = {"replicas": (4, 8, 16, 32), "requests_at": 3_000, "lengths": (1_500, 3_000, 6_000, None), "at": 16}
QUICK = {"replicas": (4, 16), "requests_at": 300, "lengths": (150, 300), "at": 16}


def blocks_per_replica(block_size: int = 16) -> int:
    spec = sizing.get_model("Llama-3.1-8B")
    weights = sizing.estimate_weight_bytes(spec)
    cap = sizing.fit_blocks(sizing.kv_size(spec, block_size=block_size), gpu_mem_gib=80.0, util=0.9,
                            weights_gib=weights / sizing.GIB)
    return cap.num_blocks


def measure(requests, router: str, replicas: int) -> tuple[float, object]:
    t0 = time.process_time()
    res = run_fleet(requests, make_router(router), replicas, blocks_per_replica(), cost=CostModel(),
                    max_len=131_072)
    return time.process_time() - t0, res


def table(plan: dict) -> Table:
    all_reqs = load_mooncake_jsonl(trace_path("mooncake"))
    t = Table("Fleet simulator cost (CPU seconds) vs replicas and trace length, Mooncake conversation trace",
              ["router", "replicas", "requests", "CPU s", "ms / request", "us / iteration", "iterations",
               "hit %"])
    runs = [(r, plan["requests_at"]) for r in plan["replicas"]]
    runs += [(plan["at"], n) for n in plan["lengths"] if (plan["at"], n) not in runs]
    for router in ("round-robin", "precise"):
        for replicas, n in runs:
            reqs = all_reqs if n is None else all_reqs[:n]
            cpu, res = measure(reqs, router, replicas)
            its = int(res.iterations.sum())
            t.add(router, replicas, len(reqs), round(cpu, 1), round(1e3 * cpu / len(reqs), 2),
                  round(1e6 * cpu / max(its, 1), 1), its, round(100 * res.hit_rate, 2))
            # progress for a run of several minutes, on stderr: stdout keeps only the table
            print(f"{router}: {replicas} replicas, {len(reqs):,} requests: {cpu:.1f} CPU s",
                  file=sys.stderr, flush=True)
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    print(table(QUICK if args.quick else FULL).to_text())


if __name__ == "__main__":
    main()
