"""Report tables: gpt-oss-20b served on the Mooncake trace, its KV held uniformly against grouped.

Owns the serving run (called from :func:`pagedkv.report.hybrid.grouped_runs`) and the one source
of the hybrid models' weights and of a GPU's KV budget (:func:`weight_bytes`,
:func:`deployment_budget`). Imports the simulator (scheduler, cost model, sizing, :mod:`pagedkv.sim.hybrid_serving`) and the
report's tables; knows nothing of the other sections.

The same KV budget of gpt-oss-20b is held two ways by the real manager: uniform (one table, every
layer keeps every block: today's allocator) and grouped (``groups=[SlidingWindow(128),
FullAttention()]``, blocks of 12 layers, the sliding group releasing what its window no longer
reads). The first Mooncake requests (long contexts: memory binds) all wait at t = 0, and the
serving scheduler runs them FCFS under vLLM's guards. Each budget is the uniform KV of k requests
at the served requests' mean final length, for k = 8, 16, 32, computed by sizing, never typed:
at k = 8 a uniform allocator can hold about 8 average requests, grouped about twice as many
(gpt-oss-20b's grouped request is 51.8% of its uniform one at 4,096 tokens).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..sim.costmodel import CostModel
from ..sim.hybrid_serving import GROUPED_NAME, UNIFORM_NAME, hybrid_allocators, hybrid_memory
from ..sim.metrics import compute
from ..sim.scheduler import simulate
from ..sim.sizing import (GIB, estimate_mxfp4_moe_weight_bytes, estimate_weight_bytes, get_model, kv_budget_bytes,
                          kv_size, request_kv_bytes)
from ..sim.traces import trace_not_found, trace_path
from ..sim.workloads import load_workload
from .options import ReportOptions
from .tables import Table

__all__ = ["MODEL", "MAX_LEN", "BUDGET_REQUESTS", "GPUS", "UTIL", "serving_runs", "serving_tables",
           "weight_bytes", "deployment_budget"]

MODEL = "gpt-oss-20b"
MAX_LEN = 32768  # context limit of the run: longer Mooncake prompts are left out
REQUESTS, QUICK_REQUESTS = 100, 60  # the first requests of the Mooncake trace
BUDGET_REQUESTS = (8, 16, 32)  # KV budget: uniform KV of this many requests of mean final length
QUICK_BUDGET_REQUESTS = (8, 16)
BLOCK_SIZE = 16


def _requests(opts: ReportOptions, n: int):
    from .fig2 import fit_to_model

    path = trace_path("mooncake", opts.data_dir)
    if path is None:
        return None, trace_not_found("mooncake", opts.data_dir)
    raw = load_workload(path, n, opts.seed)
    reqs, rejected, stopped = fit_to_model(raw, MAX_LEN)
    return [replace(r, arrival=0.0) for r in reqs], (rejected, stopped, len(raw))


GPUS = {"H100": 80, "H200": 141}  # GiB of memory of one GPU
UTIL = 0.9  # vLLM's default gpu_memory_utilization


def weight_bytes(model: str) -> int:
    """The weights the report prices and subtracts for a model: gpt-oss's MXFP4 experts and bf16
    rest (gpt-oss-20b: 12.8 GiB), or a dense model's estimate (Gemma 3 27B: 52.9 GiB), both
    computed by sizing from the config."""
    spec = get_model(model)
    w = estimate_mxfp4_moe_weight_bytes(spec) if not spec.dense else estimate_weight_bytes(spec)
    if w is None:
        raise ValueError(f"model {model!r}: sizing cannot estimate its weights")
    return w


def deployment_budget(model: str, gpu: str) -> int:
    """KV bytes one GPU leaves the model: memory x 0.9 - weights (gpt-oss-20b on an H100:
    80 x 0.9 - 12.8 = 59.2 GiB)."""
    return kv_budget_bytes(GPUS[gpu], UTIL, weight_bytes(model) / GIB)


def _cost_model(spec) -> CostModel:
    """H100 defaults; KV bytes per token of every layer (the same pricing for both allocators);
    weights from :func:`weight_bytes`, every expert priced as read each step (a batch of a few
    tokens, each routed to 4 of gpt-oss-20b's 32 experts, touches most of them)."""
    return CostModel(kv_bytes_per_token=kv_size(spec).bytes_per_token, weight_bytes=weight_bytes(spec.name),
                     model=spec.name)


def serving_runs(opts: ReportOptions) -> dict:
    """Run both allocators at every budget; a dict of the rows (``runs``: budget requests k ->
    allocator name -> metrics), the budgets in bytes and what was served, or ``{"skipped": why}``
    when the trace is missing."""
    quick = opts.quick
    reqs, info = _requests(opts, QUICK_REQUESTS if quick else REQUESTS)
    if reqs is None:
        return {"skipped": info}
    rejected, stopped, raw = info
    spec = get_model(MODEL)
    mean_final = int(round(float(np.mean([r.total_len for r in reqs]))))
    per_request = request_kv_bytes(spec, mean_final, grouped=False, block_size=BLOCK_SIZE)
    cost = _cost_model(spec)
    runs: dict = {}
    budgets: dict = {}
    for k in (QUICK_BUDGET_REQUESTS if quick else BUDGET_REQUESTS):
        budget = k * per_request
        memory = hybrid_memory(spec, budget, block_size=BLOCK_SIZE)
        budgets[k] = {"bytes": budget, "uniform_blocks": memory.uniform_blocks,
                      "grouped_blocks": memory.grouped_blocks}
        runs[k] = {}
        for alloc in hybrid_allocators(memory):
            opts.note(f"hybrid: {MODEL} served, {alloc.name}, {budget / GIB:.2f} GiB")
            res = simulate(reqs, alloc, cost, max_len=MAX_LEN)
            m = compute(res)
            runs[k][alloc.name] = {"mean_running": m.avg_batch, "peak_running": m.max_batch,
                                   "tokens_per_s": m.tokens_per_s, "requests_per_s": m.throughput_rps,
                                   "preemptions": m.preemptions, "finished": m.finished,
                                   "dropped": m.dropped, "makespan_s": m.makespan_s}
    return {"model": MODEL, "requests": len(reqs), "trace_requests": raw, "rejected": rejected,
            "stopped": stopped, "mean_final_tokens": mean_final, "uniform_request_bytes": per_request,
            "budgets": budgets, "runs": runs, "cost_model": cost.describe(),
            "weights_gib": cost.weight_bytes / GIB}


def serving_tables(opts: ReportOptions) -> tuple[list[Table], dict, list[str]]:
    """The serving table (one row per budget and allocator), its data, and text when skipped."""
    data = serving_runs(opts)
    if "skipped" in data:
        return [], data, [f"{data['skipped']}: the grouped serving run is skipped."]
    t = Table(f"Serving {MODEL} on the first {data['trace_requests']:,} Mooncake requests, uniform "
              "against grouped KV (modelled throughput)",
              ["KV budget GiB", "budget (uniform requests)", "allocator", "blocks", "mean running",
               "peak running", "output tokens/s (modelled)", "preemptions", "finished"])
    for k, by in data["runs"].items():
        b = data["budgets"][k]
        for name, r in by.items():
            blocks = b["uniform_blocks"] if name == UNIFORM_NAME else b["grouped_blocks"]
            t.add(round(b["bytes"] / GIB, 2), k, name, blocks, round(r["mean_running"], 2), r["peak_running"],
                  round(r["tokens_per_s"], 1), r["preemptions"], r["finished"])
    gains = []
    for k, by in data["runs"].items():
        u, g = by[UNIFORM_NAME], by[GROUPED_NAME]
        gains.append(f"{g['mean_running'] / u['mean_running']:.2f}x the requests at once and "
                     f"{g['tokens_per_s'] / u['tokens_per_s']:.2f}x the output tokens/s at {k} requests' budget")
    t.notes += [
        f"grouped against uniform: {'; '.join(gains)}.",
        f"budget: the uniform KV of k requests of the served requests' mean final length "
        f"({data['mean_final_tokens']:,} tokens: {data['uniform_request_bytes'] / 2**20:,.1f} MiB each, bf16, "
        f"block size {BLOCK_SIZE}); uniform blocks hold all 24 layers, grouped blocks one group's 12 "
        "(the same bytes, twice the blocks).",
        f"{data['requests']:,} requests served (of the first {data['trace_requests']:,}: {data['rejected']:,} with "
        f"a prompt of {MAX_LEN:,} tokens or more left out, {data['stopped']:,} stopped at {MAX_LEN:,}), all "
        "waiting at t = 0 (saturated); vLLM v1's scheduler guards; recompute preemption; prefix caching on.",
        f"modelled: tokens/s from the bandwidth cost model of an H100 ({data['cost_model']}), priced alike "
        f"for both (every layer read over the whole context); weights {data['weights_gib']:.1f} GiB: "
        "the MXFP4 experts (4.25 bits a weight) and bf16 rest, computed from the config, all read each "
        "step (pass the same to pagedkv simulate --weights-gib).",
    ]
    return [t], data, []
