"""Report section: hybrid models, what grouping their layers by attention type saves, and how a pool holds the groups.

Owns the "hybrid models" section of ``pagedkv report``. Reads model configs through
:mod:`pagedkv.sim.sizing` and replays trace lengths through :mod:`pagedkv.sim.page_layout`; the
runs on the real grouped manager (a serving run, and the hit rule's cost on Mooncake) are
:func:`grouped_runs`'.

gpt-oss, Gemma 3, Command R7B and Llama 4 Scout give most of their layers a sliding window or a
local chunk. A uniform allocator keeps every layer's K/V for the whole context; grouped, each
layer keeps only the blocks its next query still reads. Every number here is computed from the
models' config fields (bf16, block size 16): gpt-oss-20b at 4,096 tokens keeps 12 full layers x
256 blocks + 12 sliding layers x 8 blocks, 51.6% of the uniform 24 x 256, so grouping saves
48.4%. The groups' pages then differ in bytes (Gemma 3 27B: 52 sliding layers against 10 full),
and the second part measures two ways to hold them: vLLM's one pool of equal pages (the last
group padded) and separate pools at a fixed split (memory stranded in the pool that is not
short), replaying the Mooncake trace's lengths (modelled).
"""
from __future__ import annotations

import numpy as np

from ..sim import page_layout as pl
from ..sim.sizing import GIB, attention_groups, get_model, request_kv_bytes
from ..sim.traces import trace_lengths, trace_not_found, trace_path
from .tables import Section, Table
from .options import ReportOptions

__all__ = ["section", "MODELS", "CONTEXTS", "LAYOUT_MODELS", "memory_rows", "layout_budget",
           "grouped_runs"]

MODELS = ("gpt-oss-20b", "gpt-oss-120b", "Gemma-3-4B", "Gemma-3-12B", "Gemma-3-27B", "Command-R7B",
          "Llama-4-Scout")
CONTEXTS = (4096, 8192, 32768, 131072)
LAYOUT_MODELS = ("Gemma-3-27B", "gpt-oss-120b")
BLOCK_SIZE = 16  # the table is at 16-token blocks, whatever --block-size says
GPU_MEM_GIB, UTIL = 80, 0.9  # one H100, vLLM's default utilisation
REPLAY_REQUESTS, QUICK_REPLAY_REQUESTS = 400, 100  # the first requests of the Mooncake trace
SPLIT_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0)  # x the split matched to the trace's demand
MIB = 2**20


def _mix(model: str) -> str:
    """"12 sliding 128 + 12 full" from the model's attention groups."""
    parts = []
    for a, n in attention_groups(get_model(model)):
        what = {"sliding_window": f"sliding {getattr(a, 'window', '')}",
                "chunked_local_attention": f"chunked {getattr(a, 'chunk', '')}"}.get(a.kind, "full")
        parts.append(f"{n} {what}")
    return " + ".join(parts)


def memory_rows(models=MODELS, contexts=CONTEXTS) -> dict[str, dict[int, dict[str, float]]]:
    """KV bytes of one request, uniform and grouped, and the share grouping saves, per model and
    context (bf16, block size 16). Example: gpt-oss-20b at 4,096 tokens saves 48.4%."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for model in models:
        spec = get_model(model)
        out[model] = {}
        for n in contexts:
            uniform = request_kv_bytes(spec, n, grouped=False, block_size=BLOCK_SIZE)
            grouped = request_kv_bytes(spec, n, block_size=BLOCK_SIZE)
            out[model][n] = {"uniform": uniform, "grouped": grouped, "saved": 1 - grouped / uniform}
    return out


def _memory_table(rows) -> Table:
    t = Table("KV memory of one request, uniform against grouped (bf16, block size 16, per GPU)",
              ["model", "layers", "context tokens", "uniform MiB", "grouped MiB", "saved %"])
    for model, by_context in rows.items():
        for n, r in by_context.items():
            t.add(model, _mix(model), n, round(r["uniform"] / MIB, 1), round(r["grouped"] / MIB, 1),
                  round(100 * r["saved"], 1))
    t.notes += [
        "uniform: every layer keeps every block of the context (today's allocator); grouped: a "
        "sliding-window layer keeps the blocks its last position read, a chunked-local layer those "
        "of its current chunk, a full layer every block.",
        "computed from each model's config fields (pagedkv size MODEL shows them); saved % is what "
        "a uniform allocator holds beyond what the model can ever attend to.",
    ]
    return t


def layout_budget() -> int:
    """The KV budget of the layout replay: what one H100 (80 GiB at utilisation 0.9) leaves Gemma 3
    27B after its weights (estimated from its config by sizing: 52.9 GiB, so 19.07 GiB of KV).
    gpt-oss-120b gets the same budget, so the two layouts compare at equal bytes."""
    from .hybrid_serving import deployment_budget

    return deployment_budget("Gemma-3-27B", "H100")


def _layouts(model: str, budget: int, final: np.ndarray) -> list[tuple[pl.Layout, float | None]]:
    """The layouts compared for ``model``: uniform, vLLM's equal pages, pages of gcd layers (no
    padding) when that differs, and separate pools at splits around the one matched to the
    trace's demand, plus the split by layer count. Each with its non-full pool's share."""
    spec = get_model(model)
    counts = [n for _, n in attention_groups(spec)]
    gcd = int(np.gcd.reduce(counts))
    out: list[tuple[pl.Layout, float | None]] = [(pl.uniform_layout(spec, budget, block_size=BLOCK_SIZE), None),
                                                 (pl.equal_page_layout(spec, budget, block_size=BLOCK_SIZE), None)]
    if gcd != pl.vllm_group_layers(spec):
        out.append((pl.equal_page_layout(spec, budget, group_layers=gcd, block_size=BLOCK_SIZE), None))
    matched = pl.demand_share(spec, final, block_size=BLOCK_SIZE)[0]
    shares = sorted({round(min(0.95, matched * f), 6) for f in SPLIT_FACTORS} | {round(counts[0] / sum(counts), 6)})
    for s in shares:
        out.append((pl.separate_pool_layout(spec, budget, [s, 1 - s], block_size=BLOCK_SIZE), s))
    return out


def _layout_tables(opts: ReportOptions) -> tuple[list[Table], dict, list[str]]:
    path = trace_path("mooncake", opts.data_dir)
    if path is None:
        return [], {}, [f"{trace_not_found('mooncake', opts.data_dir)}: page-layout replay skipped."]
    n = QUICK_REPLAY_REQUESTS if opts.quick else REPLAY_REQUESTS
    prompts, outputs = trace_lengths(path)
    prompts, outputs = np.array(prompts[:n]), np.array(outputs[:n])
    budget = layout_budget()
    tables, data = [], {}
    for model in LAYOUT_MODELS:
        opts.note(f"hybrid: page layouts of {model}")
        t = Table(f"Page layouts, modelled: {model} ({_mix(model)}), the first {n:,} Mooncake "
                  f"requests, {budget / GIB:.2f} GiB of KV",
                  ["layout", "page MiB", "tables/request", "padding layers", "MiB/request @32k",
                   "fit @32k", "never fit", "mean running", "peak running", "steps", "preemptions",
                   "free while waiting %", "padding % of held"])
        rows = {}
        for lay, share in _layouts(model, budget, prompts + outputs):
            r = pl.replay(lay, prompts, outputs)
            page = "/".join(f"{p.page_bytes / MIB:.3g}" for p in lay.pools)
            t.add(lay.name, page, lay.num_tables, lay.padding_layers, round(lay.bytes_per_request(32768) / MIB, 1),
                  lay.requests_fit(32768), r.never_fit, round(r.mean_running, 2), r.peak_running, r.steps,
                  r.preemptions, round(100 * r.free_while_waiting, 1), round(100 * r.padding_share, 2))
            rows[lay.name] = {"share": share, "mean_running": r.mean_running, "never_fit": r.never_fit,
                              "steps": r.steps, "padding_share": r.padding_share,
                              "free_while_waiting": r.free_while_waiting, "tables": lay.num_tables}
        data[model] = rows
        t.notes.append(_verdict(model, rows))
        tables.append(t)
    tables[-1].notes += [
        "modelled: requests queue at t = 0 in trace order (a saturated server), each admitted first "
        "come first served with its prompt computed at once, then one token per step; the newest is "
        "preempted (recomputed) when a pool overflows; at most 256 run. Prefix sharing is not "
        "modelled (each request holds its own blocks).",
        "separate pools: the first share is the sliding pool's; the splits are 1/4 to 4 times the one "
        "matched to these requests' demand in hindsight, and the split by layer count. free while "
        "waiting: the budget's share free while the queue's head could not be admitted (stranded, "
        "for separate pools). padding: layer slots of vLLM's last group that hold no layer.",
        f"KV budget: one H100 ({GPU_MEM_GIB} GiB) at utilisation {UTIL} less Gemma 3 27B's weights "
        "(estimated from its config); gpt-oss-120b is given the same budget.",
    ]
    return tables, {"budget_bytes": budget, "requests": n, "layouts": data}, []


def _verdict(model: str, rows: dict) -> str:
    """One sentence: one pool against the best and worst fixed split, and vLLM's padding cost."""
    one = {k: v for k, v in rows.items() if k.startswith("equal pages")}
    split = {k: v for k, v in rows.items() if v["share"] is not None}
    best_one = max(one.items(), key=lambda kv: kv[1]["mean_running"])
    best_split = max(split.items(), key=lambda kv: kv[1]["mean_running"])
    worst_split = min(split.items(), key=lambda kv: kv[1]["mean_running"])
    vllm = next(v for k, v in one.items() if k.endswith("(vLLM)"))
    text = (f"{model}: one pool ({best_one[0]}) runs {best_one[1]['mean_running']:.2f} requests on average; "
            f"the best fixed split {best_split[1]['mean_running']:.2f} "
            f"({100 * (best_split[1]['mean_running'] / best_one[1]['mean_running'] - 1):+.1f}%), the worst "
            f"{worst_split[1]['mean_running']:.2f} "
            f"({100 * (worst_split[1]['mean_running'] / best_one[1]['mean_running'] - 1):+.1f}%)")
    if vllm is not best_one[1]:
        text += (f"; vLLM's padded pages {vllm['mean_running']:.2f} "
                 f"({100 * (vllm['mean_running'] / best_one[1]['mean_running'] - 1):+.1f}%, "
                 f"{100 * vllm['padding_share']:.1f}% of held bytes padding)")
    return text + "."


def grouped_runs(opts: ReportOptions) -> tuple[list[Table], dict, list[str]]:
    """The runs on the real grouped manager: gpt-oss-20b served on a real trace, uniform against
    grouped (concurrency, throughput, preemptions: :mod:`.hybrid_serving`), and the hit rate under
    the hybrid rule against full attention at one GPU's KV memory, in both orders of released
    window blocks (:mod:`.hybrid_hits`). Tables, data and finding sentences; a table left out (a trace
    missing) is absent, never an n/a row."""
    from .hybrid_hits import hit_cost_tables
    from .hybrid_serving import serving_tables

    serving, serving_data, serving_text = serving_tables(opts)
    hits, hits_data, hits_text = hit_cost_tables(opts)
    return [*serving, *hits], {"serving": serving_data, "hit_cost": hits_data}, [*serving_text, *hits_text]


def section(opts: ReportOptions) -> Section:
    """Memory per request of the hybrid built-ins, uniform against grouped; the page-layout replay."""
    if not isinstance(opts, ReportOptions):
        raise ValueError(f"opts must be ReportOptions, got {type(opts).__name__}")
    rows = memory_rows()
    layout_tables, layout_data, text = _layout_tables(opts)
    grouped_tables, grouped_data, grouped_text = grouped_runs(opts)
    return Section(
        key="hybrid",
        heading="Hybrid models: KV per attention group, and page layouts",
        intro=(__doc__ or "").split("\n\n")[2].replace("\n", " "),
        tables=[_memory_table(rows), *layout_tables, *grouped_tables],
        text=[*text, *grouped_text],
        data={"memory": {m: {str(n): r for n, r in by.items()} for m, by in rows.items()},
              "page_layouts": layout_data, **grouped_data, "model": ", ".join(MODELS)},
    )
