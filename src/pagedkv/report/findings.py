"""The report's opening: a one-page summary of its headline results, read from the sections' data.

Each finding is one row: the claim, pagedkv's figure, the published figure beside it (the vLLM
paper's unless another source is named), whether ours is measured (counted on the real manager;
in a simulated serving run where one is involved) or modelled (computed from a cost model with
stated assumptions), and the gap with its explanation. Nothing here is computed anew or typed in:
a finding reads what its section put in ``Section.data``, and a section that was not run
(``--sections``) or was skipped (no trace) gives no finding. Worked example (the full report):
"KV memory holding token states, paged (Fig. 2) | 92.0% | 96.3% | measured | the other 8.0% ...".
"""
from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from typing import Callable

from .tables import TEXT_WIDTH, Section, plain

__all__ = ["Finding", "findings", "anchor", "to_markdown", "to_text", "HEADING", "ORDER"]

HEADING = "Summary"
MEASURED, MODELLED, COMPUTED = "measured", "modelled", "computed"


@dataclass(frozen=True)
class Finding:
    """One headline result: what is claimed, our figure, the published one ("-" where none is
    published), ``how`` ours was obtained (measured or modelled), the gap and why; ``key`` and
    ``heading`` name the section it comes from."""

    claim: str
    ours: str
    paper: str
    how: str
    gap: str
    key: str = ""
    heading: str = ""

    @property
    def text(self) -> str:
        """The finding as one sentence: "claim: ours (how; paper: X). gap"."""
        paper = "" if self.paper == "-" else f"; published: {self.paper}"
        return f"{self.claim}: {self.ours} ({self.how}{paper}). {self.gap}"


def anchor(heading: str) -> str:
    """The Markdown anchor GitHub gives a heading: lower case, punctuation dropped, spaces to
    hyphens. ``"Memory waste: pre-allocation vs paging (vLLM Fig. 2)"`` ->
    ``"memory-waste-pre-allocation-vs-paging-vllm-fig-2"``."""
    text = re.sub(r"[^\w\- ]", "", plain(heading).lower())
    return text.replace(" ", "-")


def _pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f}%"


def _fig2(sec: Section) -> list[Finding]:
    d = sec.data["workloads"].get("ShareGPT-like")
    if d is None:
        return []
    srv = d["serving"]
    bars = sec.data["paper_bars"]
    paged = srv["paged"]["paper_categories"]
    names = ("Max", "Pow2", "Oracle")
    cats = {n: {k: 100 * v for k, v in srv[n]["paper_categories"].items()} for n in names}
    gaps = {n: max(((abs(cats[n][k] - v), k) for k, v in bars[n].items() if v is not None)) for n in names}
    worst = max(names, key=lambda n: gaps[n][0])
    wk = gaps[worst][1]
    label = {"token_states": "token states", "reserved": "reservation",
             "internal_fragmentation": "internal fragmentation", "external_and_others": "external & others"}
    sat = d["saturated"]
    speedup = sat["paged"]["throughput_rps"] / sat["Max"]["throughput_rps"]
    other = 1 - paged["token_states"]
    return [
        Finding("KV memory holding token states, paged (Fig. 2, serving run)", _pct(paged["token_states"]),
                "96.3%", MEASURED,
                f"The other {_pct(other)}: {_pct(paged['internal_fragmentation'])} internal fragmentation "
                f"(last blocks' tails) and {_pct(paged['external_and_others'])} free, counted as external "
                f"fragmentation & others as the Orca rows' free memory is."),
        Finding("KV memory holding token states, Orca Max / Pow2 / Oracle (Fig. 2)",
                " / ".join(f"{cats[n]['token_states']:.1f}%" for n in names),
                " / ".join(f"{bars[n]['token_states']:g}%" for n in names), MEASURED,
                "Largest gap to the paper's bars over its four categories: "
                + ", ".join(f"{n} {gaps[n][0]:.1f}" for n in names)
                + f" points; the largest, {worst}'s {label[wk]} ({cats[worst][wk]:.1f}% against "
                f"{bars[worst][wk]:g}%)"
                + (", depends on where lengths fall between powers of two, which the paper's published "
                   "ShareGPT means do not fix." if worst == "Pow2" else ".")),
        Finding("Requests/s when saturated, paged against Orca Max", f"{speedup:.2f}x",
                "2-4x over Orca", MODELLED,
                f"{sat['paged']['throughput_rps']:.2f} against {sat['Max']['throughput_rps']:.2f} requests/s, "
                f"step times modelled for OPT-13B on an A100-40GB; the paper's 2-4x is the request rate "
                f"sustained at equal latency, which the latency against request rate finding reads."),
    ]


def _block_size(sec: Section) -> list[Finding]:
    by = sec.data["by_block_size"]
    if 16 not in by or 256 not in by:
        return []
    return [Finding("Internal fragmentation at block size 16 / 256",
                    f"{_pct(by[16]['internal_fragmentation'])} / {_pct(by[256]['internal_fragmentation'])}",
                    "-", MEASURED,
                    f"As (block size - 1) / 2 unused slots per sequence predicts "
                    f"({_pct(by[16]['predicted'])} / {_pct(by[256]['predicted'])}).")]


def _sharing(sec: Section) -> list[Finding]:
    s, p = sec.data["saving"], sec.data["paper_saving"]

    def span(prefix: str, widths=(2, 6)) -> str:
        lo, hi = (100 * s[f"{prefix}/{w}"]["saved"] for w in widths)
        return f"{lo:.1f}-{hi:.1f}%"

    above = [w for w in (2, 4, 6) if min(s[f"alpaca/beam/{w}"]["seeds"]) > p[f"beam/{w}"] / 100]
    out = [
        Finding("Blocks saved by sharing, parallel sampling n = 2-6, Alpaca-like (Fig. 15)",
                span("alpaca/parallel"), f"{p['parallel/2']}-{p['parallel/6']}%", MEASURED,
                "Samples share only full prompt blocks, and most Alpaca prompts hold zero or one: the "
                "saving follows a prompt-length shape the paper does not publish."),
        Finding("Blocks saved by sharing, beam search width 2-6, Alpaca-like (Fig. 15)",
                span("alpaca/beam"), f"{p['beam/2']}-{p['beam/6']}%", MEASURED,
                "Which beams survive comes from a synthetic beam model (random next-token scores), not "
                "a language model; its beams converge on one ancestor more often than a real decoder's"
                + (f", and the excess at width {' and '.join(map(str, above))} (above the paper on every "
                   "seed) comes from that model, not the allocator." if above else ".")),
    ]
    rng = sec.data["paper_sharegpt_range"]
    got = {k: s.get(f"sharegpt/{k}", {}).get("serving") for k in ("parallel/2", "parallel/6", "beam/2", "beam/6")}
    if all(got.values()):
        par = f"{_pct(got['parallel/2']['saved'])}-{_pct(got['parallel/6']['saved'])}"
        beam = f"{_pct(got['beam/2']['saved'])}-{_pct(got['beam/6']['saved'])}"
        out.append(Finding(
            "Blocks saved, ShareGPT-like serving run, parallel n = 2-6 / beam width 2-6 (section 6.3)",
            f"{par} / {beam}",
            f"{rng['parallel'][0]:g}-{rng['parallel'][1]:g}% / {rng['beam'][0]:g}-{rng['beam'][1]:g}%",
            MEASURED,
            _against_range("Parallel sampling", [got["parallel/2"]["saved"], got["parallel/6"]["saved"]],
                           rng["parallel"])
            + "; " + _against_range("beam search", [got["beam/2"]["saved"], got["beam/6"]["saved"]], rng["beam"])
            + "; beams that share more than the paper's come from the synthetic beam model, not the "
              "allocator, as on Alpaca."))
    return out


def _against_range(what: str, saved: list[float], rng) -> str:
    """Where the saving at widths 2 and 6 falls against a published range, in words:
    "Parallel sampling against 16.2-30.5%: at width 2 inside it and at width 6 above it (35.7%)"."""
    lo, hi = rng
    parts = []
    for width, x in zip((2, 6), saved):
        pct = 100 * x
        where = "inside it" if lo <= pct <= hi else f"{'above' if pct > hi else 'below'} it ({pct:.1f}%)"
        parts.append(f"at width {width} {where}")
    return f"{what} against {lo:g}-{hi:g}%: {' and '.join(parts)}"


def _swap(sec: Section) -> list[Finding]:
    from .swap_recompute import crossover_words

    d = sec.data
    paper = d["paper_setup"]
    b = paper["bound"]
    r16 = paper["rows"][16]["swap_over_recompute"]
    lo, hi = paper["spread"]["lowest"], paper["spread"]["highest"]
    low = "8 or below" if lo[0] is None else str(lo[1])
    return [Finding(
        "Swap against recompute, one preemption (Fig. 19; OPT-13B, A100, PCIe 4.0)",
        f"swap {r16:.2f}x the recompute at block size 16; swap first wins "
        f"{crossover_words(paper['crossover'])} ({low} to {hi[1]} as the assumptions move)",
        "comparable from 16 to 64", MODELLED,
        f"Assumed: {d['latencies_us'][1]} µs per copy (5 to 20), one copy per layer's K and V, "
        f"{round(100 * d['mfu'])}% MFU (30 to 60). The paper's recompute is never over "
        f"{d['paper_recompute_bound']:g}x the swap; the model's is {b['recompute_over_swap']:.1f}x at "
        f"block size {b['block_size']}, because it moves bytes at the link's {b['link_bytes_per_s'] / 1e9:.0f} "
        f"GB/s peak: at {b['bandwidth_needed'] / 1e9:.1f} GB/s the bound holds.")]


def _fork(sec: Section) -> list[Finding]:
    t = next(iter(sec.tables))
    rows = {r[0]: r for r in t.rows}
    row = rows.get(2048)
    if row is None:
        return []
    us = row[t.columns.index("fork µs (median)")]
    eager = row[t.columns.index("eager copy MiB")]
    return [Finding("Forking a 2,048-token sequence", f"{us:.1f} µs, no KV copied", "-", MEASURED,
                    f"Copying it eagerly would move {eager:,.0f} MiB.")]


def _cow(sec: Section) -> list[Finding]:
    d = sec.data
    return [Finding("Copy-on-write keeps samples exact (a random-weight decoder)",
                    f"largest logit error {d['max_error_cow']:.1e}", "-", MEASURED,
                    f"Against {d['max_error_in_place']:.2f} when the child writes in place.")]


def _prefix(sec: Section) -> list[Finding]:
    d = sec.data
    if "whole_trace_hit_rate" not in d:
        return []
    caps = d.get("by_capacity") or []
    small = caps[0] if caps else None
    gap = f"Over {d['requests']:,} requests of the Mooncake conversation trace"
    if small is not None:
        gap += f"; a cache of {small['gib']:,.0f} GiB ({small['capacity']} of it) serves {_pct(small['hit_rate'])}"
    return [Finding("Prompt tokens served by an unbounded prefix cache (Mooncake)",
                    _pct(d["whole_trace_hit_rate"], 2), "-", MEASURED, gap + ".")]


def _livelock(sec: Section) -> list[Finding]:
    th = sec.data["thrash"]
    pr = sec.data["pr_44594_preemptions"]
    off, ten = th.get("vLLM v1 (no watermark)"), th.get("watermark 10%")
    if off is None or ten is None:
        return []
    return [Finding("Preemptions without an admission watermark / at 10%",
                    f"{off['preemptions']:,} / {ten['preemptions']:,}",
                    f"vLLM PR #44594: {pr['off']:,} / {pr['0.1']:,}", MEASURED,
                    "The same direction on a far shorter run (theirs: Qwen2.5-7B on a GB200).")]


def _host(sec: Section) -> list[Finding]:
    m = sec.data.get("mooncake")
    if not m:
        return []
    by = m["by_host"]
    keys = sorted(by, key=int)
    none, big = by[keys[0]], by[keys[-1]]
    return [Finding(f"Prompt tokens hit in a host tier {int(keys[-1])}x the device pool (Mooncake)",
                    f"+{_pct(big['host_hit_rate'])}", "-", MEASURED,
                    f"On top of the device's {_pct(none['device_hit_rate'])} (first {m['requests']:,} "
                    f"requests).")]


def _fleet(sec: Section) -> list[Finding]:
    r = sec.data.get("routers")
    if not r or "ring" not in r or "round-robin" not in r:
        return []
    ring, rr = r["ring"], r["round-robin"]
    gap = (f"Round-robin hits {_pct(rr['hit_rate'])}; the ring loses on TTFT p90 "
           f"({1e3 * ring['ttft_p90_s']:.0f} against {1e3 * rr['ttft_p90_s']:.0f} ms, modelled) and on "
           f"imbalance ({ring['imbalance']:.2f} against {rr['imbalance']:.2f})")
    p = r.get("precise")
    if p:
        gap += f"; the precise router hits {_pct(p['hit_rate'])} at TTFT p90 {1e3 * p['ttft_p90_s']:.0f} ms"
    return [Finding("Prompt tokens hit on 16 replicas behind a consistent-hash ring", _pct(ring["hit_rate"]),
                    "-", MEASURED, gap + ".")]


def _hybrid(sec: Section) -> list[Finding]:
    mem = sec.data["memory"]["gpt-oss-20b"]
    short, long_ = min(mem, key=int), max(mem, key=int)
    out = [Finding("KV one gpt-oss-20b request holds, grouped by attention type, against uniform",
                   f"-{_pct(mem[short]['saved'])} at {int(short):,} tokens, -{_pct(mem[long_]['saved'])} "
                   f"at {int(long_):,}", "-", COMPUTED,
                   "A sliding-window layer keeps only the blocks its window reads.")]
    runs = sec.data.get("serving", {}).get("runs")
    if runs:
        gains = [by["paged grouped"]["mean_running"] / by["paged uniform"]["mean_running"] for by in runs.values()]
        out.append(Finding("Requests at once, gpt-oss-20b served grouped against uniform (Mooncake)",
                           f"{min(gains):.2f}x-{max(gains):.2f}x", "-", MEASURED,
                           "At the same KV bytes; tokens/s in the section are modelled."))
    rows = sec.data.get("hit_cost", {}).get("rows")
    if rows:
        order = [100 * (r["with_prefix"] - r["on_release"]) for r in rows]
        rule = [100 * (r["with_prefix"] - r["uniform"]) for r in rows]
        where = ", ".join(f"{r['model']} on an {r['gpu']}" for r in rows)
        none = max(abs(x) for x in rule) < 0.005
        out.append(Finding(
            "Prefix hits, grouped cache (hybrid hit rule) minus uniform, one GPU's KV memory (Mooncake)",
            f"{min(rule):+.2f} to {max(rule):+.2f} points", "-", MEASURED,
            f"{where}. "
            + (f"Re-aging released window blocks with their prefix gains {min(order):+.2f} to "
               f"{max(order):+.2f} points over plain LRU order: it removes what plain LRU order loses "
               "(the reuse cliff), "
               if max(abs(x) for x in order) >= 0.005 else
               "Re-aging released window blocks with their prefix changes nothing over plain LRU order "
               "here (no reuse cliff at these budgets); it removes what plain LRU order loses, ")
            + "but not the grouped cache's own gap to uniform, "
            + ("which is nil at these budgets." if none else
               f"{min(rule):+.2f} to {max(rule):+.2f} points here.")))
    return out


def _latency_rate(sec: Section) -> list[Finding]:
    d = sec.data
    w = d["workloads"]["ShareGPT-like"]
    by = {s["multiple"]: s["paged_over"] for s in w["sustained"]}
    head = by[d["headline_threshold"]]
    if head["oracle"] is None or head["max"] is None:
        return []
    spread = {o: [v[o] for v in by.values() if v[o] is not None] for o in ("oracle", "max")}
    sus, top = w["batch"][0]["paged_over"], w["batch"][-1]
    po, pm = d["paper_sustained"]["oracle"], d["paper_sustained"]["max"]
    return [Finding(
        "Request rate sustained at equal latency, paged against Orca (Oracle) / (Max) (Fig. 12, ShareGPT-like)",
        f"{head['oracle']:.2f}x / {head['max']:.2f}x", f"{po[0]:g}-{po[1]:g}x / {pm[0]:g}-{pm[1]:g}x", MODELLED,
        f"At {d['headline_threshold']:g}x a request's latency alone (the paper states no threshold): "
        f"{min(spread['oracle']):.2f}-{max(spread['oracle']):.2f}x / {min(spread['max']):.2f}-"
        f"{max(spread['max']):.2f}x over {min(d['thresholds']):g}-{max(d['thresholds']):g}x; step times "
        f"modelled for OPT-13B on an A100-40GB, the paper's ranges span OPT-13B to 175B. Requests "
        f"batched: {sus['oracle']:.2f}x / {sus['max']:.2f}x at {w['batch'][0]['rate']:g} req/s, the highest "
        f"rate paging sustains, and {top['paged_over']['oracle']:.2f}x / {top['paged_over']['max']:.2f}x at "
        f"{top['rate']:g} req/s (paper Fig. 13a: {d['paper_batched']['oracle']:g}x / "
        f"{d['paper_batched']['max']:g}x).")]


def _nanovllm(sec: Section) -> list[Finding]:
    d = sec.data
    n, p = d["allocators"]["nano-vllm"], d["allocators"]["pagedkv"]
    own = d["engine"]["own"]
    who = "nano-vllm's own scheduler" if own else "a scheduler written with nano-vllm's rules"
    theirs = "nano-vllm's BlockManager" if own else "a block manager written with its rules"
    return [Finding(
        f"Time in the allocator under {who}, pagedkv's drop-in against {theirs}",
        f"{p['allocator_ms']:,.0f} ms against {n['allocator_ms']:,.0f} ms", "-", MEASURED,
        f"Both ran on {d['requests']} Mooncake requests, with {p['preemptions']} preemptions against "
        f"{n['preemptions']} and {_pct(p['hit_rate'])} of admitted tokens from cache against "
        f"{_pct(n['hit_rate'])}.")]


_FINDERS: dict[str, Callable[[Section], list[Finding]]] = {
    "fig2": _fig2, "fork_cost": _fork, "cow_proof": _cow, "block_size": _block_size, "sharing": _sharing,
    "prefix_hits": _prefix, "livelock": _livelock, "swap_vs_recompute": _swap, "host_offload": _host,
    "fleet": _fleet, "hybrid": _hybrid, "latency_rate": _latency_rate, "nanovllm": _nanovllm,
}
# The order findings are listed in: the paper's questions first, in its order, then the rest.
ORDER = ("fig2", "latency_rate", "block_size", "sharing", "swap_vs_recompute", "fork_cost", "cow_proof",
         "prefix_hits", "livelock", "host_offload", "fleet", "hybrid", "nanovllm")


def findings(sections: list[Section]) -> list[Finding]:
    """The headline results of the sections given, the paper's first (:data:`ORDER`), then any
    section not listed there in report order."""
    by_key = {s.key: s for s in sections}
    keys = [k for k in ORDER if k in by_key] + [s.key for s in sections if s.key not in ORDER]
    out = []
    for key in keys:
        sec = by_key[key]
        finder = _FINDERS.get(key)
        if finder is None or sec.data.get("skipped"):
            continue
        try:
            found = finder(sec)
        except (KeyError, StopIteration, ValueError, ZeroDivisionError):
            found = []  # a section run without the rows a finding reads (e.g. another block size)
        out += [Finding(f.claim, f.ours, f.paper, f.how, f.gap, key, sec.heading) for f in found]
    return out


def _cell(text: str) -> str:
    return text.replace("|", "/")


def to_markdown(items: list[Finding]) -> str:
    """The summary as a Markdown table, each claim linking to its section."""
    lines = [f"## {HEADING}", "",
             "| claim | pagedkv | published | how | gap, and why |", "|---|---|---|---|---|"]
    for f in items:
        claim = f"[{_cell(f.claim)}](#{anchor(f.heading)})"
        lines.append(f"| {claim} | {_cell(f.ours)} | {_cell(f.paper)} | {f.how} | {_cell(f.gap)} |")
    lines += ["", *textwrap.wrap(
        "published: the vLLM paper's figure (Kwon et al., SOSP'23) unless another source is named; "
        "measured: counted on the real block manager (in a simulated serving run where requests are "
        "served); modelled: from a cost model whose assumptions the section states; computed: "
        "arithmetic on a model's published config.", TEXT_WIDTH)]
    return "\n".join(lines)


def to_text(items: list[Finding], width: int = TEXT_WIDTH) -> str:
    """The summary as terminal text: one wrapped paragraph per finding, naming its section."""
    out = [HEADING, "=" * len(HEADING), ""]
    for f in items:
        out += textwrap.wrap(f"{f.text} (section: {plain(f.heading).split(':')[0]})", width,
                             initial_indent="- ", subsequent_indent="  ", break_long_words=False,
                             break_on_hyphens=False)
    return "\n".join(out)
