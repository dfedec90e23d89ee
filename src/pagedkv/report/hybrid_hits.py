"""Report tables: the hybrid prefix-hit rule's cost on the Mooncake trace.

Replays the first requests of the Mooncake conversation trace through the real manager at the KV
memory one GPU leaves (an H100 at 0.9 utilisation, less the weights), for gpt-oss-20b and Gemma 3
27B: a uniform cache (every layer keeps every block:
full attention's rule) against a grouped one holding the same bytes in smaller pages, with the
grouped manager's two orders for released window blocks (``window_eviction``). See
:mod:`pagedkv.sim.hybrid_hits` for the replay and why the orders differ.
"""
from __future__ import annotations

from dataclasses import replace

from ..sim.hybrid_hits import HitRun, layouts, never_evicts_bytes, replay_hits
from ..sim.sizing import GIB, get_model
from ..sim.traces import load_mooncake_jsonl, trace_path
from .hybrid_serving import GPUS, UTIL, deployment_budget
from .options import ReportOptions
from .tables import Table

__all__ = ["hit_cost_tables", "HIT_MODELS"]

# (model, the GPUs whose KV budget it is replayed at): one H100, at vLLM's 0.9 utilisation, less
# the model's weights (gpt-oss-20b: 59.2 GiB of KV; Gemma 3 27B: 19.1 GiB).
HIT_MODELS = (("gpt-oss-20b", ("H100",)), ("Gemma-3-27B", ("H100",)))
QUICK_HIT_MODELS = (("gpt-oss-20b", ("H100",)),)
HIT_REQUESTS, QUICK_HIT_REQUESTS = 300, 60
ORDERS = ("with_prefix", "on_release")
ORDER_NAMES = {"with_prefix": "window blocks re-aged with their prefix",
               "on_release": "window blocks in plain LRU order"}


def _runs(opts: ReportOptions, requests, prompts, model: str, gpus,
          uniform_runs: dict) -> list[tuple[str, int, float, list[HitRun]]]:
    """Per GPU, the uniform replay and the grouped one under each order, at that GPU's KV budget
    (capped at what never evicts). A uniform replay depends only on its block count, so
    ``uniform_runs`` (block count -> run) lets the models share it."""
    spec = get_model(model)
    never = never_evicts_bytes(spec, requests)
    out = []
    for gpu in gpus:
        budget = min(deployment_budget(model, gpu), never)
        uniform, grouped = layouts(spec, budget)
        opts.note(f"hybrid hit cost, {model}: the KV budget of one {gpu}")
        u = uniform_runs.get(uniform.num_blocks)
        if u is None:
            u = uniform_runs[uniform.num_blocks] = replay_hits(requests, uniform, prompts=prompts)
        u = replace(u, layout=uniform)  # the same replay, this model's bytes
        runs = [u] + [replay_hits(requests, grouped, prompts=prompts, window_eviction=o) for o in ORDERS]
        out.append((gpu, budget, budget / never, runs))
    return out


def hit_cost_tables(opts: ReportOptions) -> tuple[list[Table], dict, list[str]]:
    """The hit-rate table (one row per model and GPU), its data, and one sentence per model;
    nothing when the Mooncake trace is not found."""
    path = trace_path("mooncake", opts.data_dir)
    if path is None:
        return [], {}, []
    n = QUICK_HIT_REQUESTS if opts.quick else HIT_REQUESTS
    requests = load_mooncake_jsonl(path, limit=n)
    prompts = [r.prompt_array() for r in requests]
    cols = ["model", "GPU", "KV GiB", "share of a never-evicting cache %", "uniform hit %",
            "grouped, re-aged hit %", "grouped, plain LRU hit %", "grouped blocks / uniform"]
    t = Table(f"Prefix hit rate under the hybrid rule against full attention at one GPU's KV memory "
              f"(the first {n:,} Mooncake requests, 16-token blocks)", cols)
    data: dict = {"requests": n, "rows": []}
    text, uniform_runs = [], {}
    for model, gpus in (QUICK_HIT_MODELS if opts.quick else HIT_MODELS):
        rows = []
        for gpu, budget, share, (u, wp, orl) in _runs(opts, requests, prompts, model, gpus, uniform_runs):
            t.add(model, gpu, round(budget / GIB, 1), round(100 * share, 1), round(100 * u.hit_rate, 2),
                  round(100 * wp.hit_rate, 2), round(100 * orl.hit_rate, 2),
                  round(wp.layout.num_blocks / u.layout.num_blocks, 2))
            rows.append({"model": model, "gpu": gpu, "gib": budget / GIB, "fraction": share,
                         "uniform": u.hit_rate, "with_prefix": wp.hit_rate, "on_release": orl.hit_rate,
                         "uniform_blocks": u.layout.num_blocks, "grouped_blocks": wp.layout.num_blocks})
        data["rows"] += rows
        text.append(_finding(model, rows))
    t.notes += [_budget_note(), *NOTES]
    return [t], data, text


def _budget_note() -> str:
    parts = [f"{model} on an {gpu}: {deployment_budget(model, gpu) / GIB:.1f} GiB"
             for model, gpus in HIT_MODELS for gpu in gpus]
    gpus = sorted({g for _, gs in HIT_MODELS for g in gs})
    return (f"KV GiB: one GPU's memory ({', '.join(f'{g} {GPUS[g]:g} GiB' for g in gpus)}) x {UTIL} "
            f"utilisation, less the model's weights ({'; '.join(parts)}), or what a cache that never evicts "
            "needs if that is less; share: of the bytes a uniform cache needs to keep every request's "
            "prompt and output (nothing evicted).")


def _points(rows: list[dict], a: str, b: str) -> str:
    return ", ".join(f"{100 * (r[a] - r[b]):+.2f}" for r in rows)


def _finding(model: str, rows: list[dict]) -> str:
    """One sentence: the grouped cache against the uniform one, and plain LRU against re-aging,
    in points of hit rate, GPU by GPU."""
    gpus = ", ".join(f"an {r['gpu']}" for r in rows)
    return (f"{model} at the KV memory of {gpus}: the grouped cache's hit rate minus the uniform "
            f"one's is {_points(rows, 'with_prefix', 'uniform')} points with window blocks re-aged with "
            f"their prefix and {_points(rows, 'on_release', 'uniform')} in plain LRU order.")


NOTES = [
        "the same bytes hold uniform pages of every layer, or the grouped manager's smaller pages of "
        "one group's layers (vLLM's equal-page groups)",
        "re-aged: window blocks a sequence released are put back in the eviction order with its prefix "
        "when it finishes, so eviction shortens a cached prefix from its tail in every group at once; "
        "plain LRU: they stay where they were released, the first evicted, and a prefix whose "
        "full-attention blocks survive can hit nothing past its last whole window (the reuse cliff)",
        "at most 16 sequences resident, finished in arrival order (early when blocks run out); each "
        "output appended before its sequence finishes; hits counted by the manager itself",
]
