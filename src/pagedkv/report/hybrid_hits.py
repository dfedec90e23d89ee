"""Report tables: the hybrid prefix-hit rule's cost on the Mooncake trace.

Replays the first requests of the Mooncake conversation trace through the real manager at a few
memory budgets, for gpt-oss-20b and Gemma 3 27B: a uniform cache (every layer keeps every block:
full attention's rule) against a grouped one holding the same bytes in smaller pages, with the
grouped manager's two orders for released window blocks (``window_eviction``). See
:mod:`pagedkv.sim.hybrid_hits` for the replay and why the orders differ.
"""
from __future__ import annotations

from dataclasses import replace

from ..sim.hybrid_hits import HitRun, layouts, never_evicts_bytes, replay_hits
from ..sim.sizing import GIB, get_model
from ..sim.traces import load_mooncake_jsonl, trace_path
from .options import ReportOptions
from .tables import Table

__all__ = ["hit_cost_tables", "HIT_MODELS"]

# (model, budgets as fractions of what a uniform cache needs to never evict)
HIT_MODELS = (("gpt-oss-20b", (1 / 8, 1 / 4, 1 / 2)), ("Gemma-3-27B", (1 / 4,)))  # Gemma: 7 tables, ~7 s a run
QUICK_HIT_MODELS = (("gpt-oss-20b", (1 / 4,)),)
HIT_REQUESTS, QUICK_HIT_REQUESTS = 500, 120
ORDERS = ("with_prefix", "on_release")


def _runs(opts: ReportOptions, requests, prompts, model: str, fractions,
          uniform_runs: dict) -> list[tuple[float, list[HitRun]]]:
    """Per budget, the uniform replay and the grouped one under each order. A uniform replay
    depends only on its block count, not on the model, so ``uniform_runs`` (block count -> run)
    lets the models share it."""
    spec = get_model(model)
    never = never_evicts_bytes(spec, requests)
    out = []
    for f in fractions:
        uniform, grouped = layouts(spec, int(never * f))
        opts.note(f"hybrid hit cost, {model}: budget {f:g} of a never-evicting cache")
        u = uniform_runs.get(uniform.num_blocks)
        if u is None:
            u = uniform_runs[uniform.num_blocks] = replay_hits(requests, uniform, prompts=prompts)
        u = replace(u, layout=uniform)  # the same replay, this model's bytes
        runs = [u] + [replay_hits(requests, grouped, prompts=prompts, window_eviction=o) for o in ORDERS]
        out.append((f, runs))
    return out


def hit_cost_tables(opts: ReportOptions) -> tuple[list[Table], dict, list[str]]:
    """The hit-rate table (one row per model and budget) with its plot, its data, and one finding
    sentence per model; nothing when the Mooncake trace is not found."""
    path = trace_path("mooncake", opts.data_dir)
    if path is None:
        return [], {}, []
    n = QUICK_HIT_REQUESTS if opts.quick else HIT_REQUESTS
    requests = load_mooncake_jsonl(path, limit=n)
    prompts = [r.prompt_array() for r in requests]
    cols = ["budget", "KV GiB", "uniform hit %", "grouped, with_prefix hit %", "grouped, on_release hit %",
            "grouped blocks / uniform"]
    data: dict = {"requests": n, "rows": []}
    tables, text, uniform_runs = [], [], {}
    for model, fractions in (QUICK_HIT_MODELS if opts.quick else HIT_MODELS):
        t = Table(f"{model}: prefix hit rate under the hybrid rule against full attention at the same "
                  f"memory (the first {n:,} Mooncake requests, 16-token blocks)",
                  cols,
                  plot={"name": f"hybrid_hit_cost_{model.lower().replace('-', '_').replace('.', '_')}",
                        "x": "budget", "y": cols[2:5], "kind": "bar", "ymin": 0, "annotate_values": True,
                        "ylabel": "% of prompt tokens served from cache",
                        "xlabel": f"KV cache budget: share of what a uniform cache needs to never evict ({model})",
                        "title": f"{model}: hybrid prefix-hit rule vs full attention, same bytes "
                                 f"(Mooncake, first {n:,} requests)"})
        rows = []
        for f, (u, wp, orl) in _runs(opts, requests, prompts, model, fractions, uniform_runs):
            gib = u.layout.num_blocks * u.layout.page_bytes / GIB
            t.add(f"1/{round(1 / f)}", round(gib, 1), round(100 * u.hit_rate, 2), round(100 * wp.hit_rate, 2),
                  round(100 * orl.hit_rate, 2), round(wp.layout.num_blocks / u.layout.num_blocks, 2))
            rows.append({"model": model, "fraction": f, "gib": gib, "uniform": u.hit_rate,
                         "with_prefix": wp.hit_rate, "on_release": orl.hit_rate,
                         "uniform_blocks": u.layout.num_blocks, "grouped_blocks": wp.layout.num_blocks})
        data["rows"] += rows
        text.append(_finding(model, rows))
        t.notes += NOTES
        tables.append(t)
    return tables, data, text


def _points(rows: list[dict], a: str, b: str) -> str:
    return ", ".join(f"{100 * (r[a] - r[b]):+.2f}" for r in rows)


def _finding(model: str, rows: list[dict]) -> str:
    """One sentence: the grouped cache against the uniform one, and plain LRU against re-aging,
    in points of hit rate, budget by budget (the spread, not one point)."""
    budgets = ", ".join(f"1/{round(1 / r['fraction'])}" for r in rows)
    return (f"{model} (budgets {budgets} of a never-evicting cache): the grouped cache's hit rate minus "
            f"the uniform one's at the same bytes is {_points(rows, 'with_prefix', 'uniform')} points with "
            f"window blocks re-aged with their prefix, {_points(rows, 'on_release', 'uniform')} in plain "
            f"LRU order (the reuse cliff where negative).")


NOTES = [
        "budget: a fraction of the bytes a uniform cache needs to keep every request's prompt and output "
        "(nothing evicted); the same bytes hold uniform pages of every layer, or the grouped manager's "
        "smaller pages of one group's layers (vLLM's equal-page groups)",
        "with_prefix: window blocks a sequence released are re-aged with its prefix when it finishes, so "
        "eviction shortens a cached prefix from its tail in every group at once; on_release: they stay "
        "where plain LRU put them, the first evicted, and a prefix whose full-attention blocks survive "
        "can hit nothing past its last whole window",
        "at most 16 sequences resident, finished in arrival order (early when blocks run out); each "
        "output appended before its sequence finishes; hits counted by the manager's usage()",
]
