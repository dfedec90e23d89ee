"""The report's opening: its headline results, one sentence each, read from the sections' data.

Each finding is a sentence with its number, the published number beside it where one exists,
and a link to the section that measured it. Nothing here is computed anew or typed in: a finding
reads what its section put in ``Section.data`` (or its tables), and a section that was not run
(``--sections``) or was skipped (no trace) gives no finding. Worked example (the full report):
"Paging keeps 92.0% of KV memory holding token states over a serving run (paper: 96.3%) ...".
"""
from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from typing import Callable

from .tables import TEXT_WIDTH, Section, plain

__all__ = ["Finding", "findings", "anchor", "to_markdown", "to_text", "HEADING"]

HEADING = "Findings"


@dataclass(frozen=True)
class Finding:
    """One headline result: ``text`` (a sentence with its numbers) and the section it comes from."""

    text: str
    key: str
    heading: str


def anchor(heading: str) -> str:
    """The Markdown anchor GitHub gives a heading: lower case, punctuation dropped, spaces to
    hyphens. ``"Memory waste: pre-allocation vs paging (vLLM Fig. 2)"`` ->
    ``"memory-waste-pre-allocation-vs-paging-vllm-fig-2"``."""
    text = re.sub(r"[^\w\- ]", "", plain(heading).lower())
    return text.replace(" ", "-")


def _wrap(text: str, width: int, first: str, rest: str) -> list[str]:
    return textwrap.wrap(text, width, initial_indent=first, subsequent_indent=rest,
                         break_long_words=False, break_on_hyphens=False)


def _pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f}%"


def _table(sec: Section, plot: str):
    return next(t for t in sec.tables if t.plot and t.plot.get("name") == plot)


def _fig2(sec: Section) -> list[str]:
    d = sec.data["workloads"].get("ShareGPT-like")
    if d is None:
        return []
    srv = d["serving"]
    paper = sec.data["paper_bars"]
    paged = srv["paged"]["paper_categories"]
    ts = {n: 100 * srv[n]["paper_categories"]["token_states"] for n in ("Max", "Pow2", "Oracle")}
    gaps = {n: max(abs(100 * srv[n]["paper_categories"][k] - v) for k, v in paper[n].items())
            for n in ("Max", "Oracle")}
    sat = d["saturated"]
    speedup = sat["paged"]["throughput_rps"] / sat["Max"]["throughput_rps"]
    return [
        f"Paging keeps {_pct(paged['token_states'])} of KV memory holding token states over a "
        f"ShareGPT-like serving run (paper: 96.3%), its only waste the last block's tail "
        f"({_pct(paged['internal_fragmentation'])}); the Orca reservations keep Max "
        f"{ts['Max']:.1f}%, Pow2 {ts['Pow2']:.1f}%, Oracle {ts['Oracle']:.1f}% (paper: 20.4%, 26.8%, "
        f"38.2%).",
        f"By the paper's four categories (token states, reservation, internal and external "
        f"fragmentation) Max's largest gap to the paper's bars is {gaps['Max']:.1f} points and "
        f"Oracle's {gaps['Oracle']:.1f}; Oracle has no internal fragmentation "
        f"({_pct(srv['Oracle']['paper_categories']['internal_fragmentation'])}, paper 0%).",
        f"Saturated, paging serves {speedup:.2f}x the requests/s of Orca Max ({sat['paged']['throughput_rps']:.2f} "
        f"against {sat['Max']['throughput_rps']:.2f} requests/s, step times modelled for OPT-13B on an "
        f"A100-40GB; the paper reports 2-4x over Orca at equal latency, a different measure).",
    ]


def _fork(sec: Section) -> list[str]:
    t = next(iter(sec.tables))
    rows = {r[0]: r for r in t.rows}
    row = rows.get(2048)
    if row is None:
        return []
    us = row[t.columns.index("fork µs (median)")]
    eager = row[t.columns.index("eager copy MiB")]
    return [f"Forking a 2,048-token sequence takes {us:.1f} µs (median, measured) and copies no KV, "
            f"where copying it eagerly would move {eager:,.0f} MiB."]


def _cow(sec: Section) -> list[str]:
    d = sec.data
    return [f"Copy-on-write keeps every sample of a real (random-weight) decoder exact: largest logit "
            f"error {d['max_error_cow']:.1e}, against {d['max_error_in_place']:.2f} when the child "
            f"writes in place."]


def _block_size(sec: Section) -> list[str]:
    by = sec.data["by_block_size"]
    if 16 not in by or 256 not in by:
        return []
    return [f"Paging's internal fragmentation follows (block size - 1) / 2 slots per sequence: "
            f"{_pct(by[16]['internal_fragmentation'])} of allocated memory at block size 16 "
            f"(model {_pct(by[16]['predicted'])}), {_pct(by[256]['internal_fragmentation'])} at 256 "
            f"(model {_pct(by[256]['predicted'])})."]


def _sharing(sec: Section) -> list[str]:
    s, p = sec.data["saving"], sec.data["paper_saving"]
    par = [100 * s[f"alpaca/parallel/{n}"]["saved"] for n in (2, 4, 6)]
    beam = [100 * s[f"alpaca/beam/{n}"]["saved"] for n in (2, 4, 6)]
    return [f"Sharing saves {par[0]:.1f}% to {par[2]:.1f}% of blocks for parallel sampling (n = 2 to 6) "
            f"and {beam[0]:.1f}% to {beam[2]:.1f}% for beam search (width 2 to 6) on Alpaca-like "
            f"lengths (paper Fig. 15: {p['parallel/2']}% to {p['parallel/6']}% and {p['beam/2']}% to "
            f"{p['beam/6']}%)."] + _sharegpt_serving(sec)


def _sharegpt_serving(sec: Section) -> list[str]:
    """The ShareGPT-like serving run against the paper's section 6.3 ranges, where it ran."""
    s, rng = sec.data["saving"], sec.data["paper_sharegpt_range"]
    got = {k: s[f"sharegpt/{k}"]["serving"]["saved"] for k in ("parallel/2", "parallel/6", "beam/2", "beam/6")
           if "serving" in s.get(f"sharegpt/{k}", {})}
    if len(got) < 4:
        return []
    return [f"Served on ShareGPT-like lengths (Poisson arrivals), sharing saves {_pct(got['parallel/2'])} to "
            f"{_pct(got['parallel/6'])} for parallel sampling and {_pct(got['beam/2'])} to {_pct(got['beam/6'])} "
            f"for beam search at widths 2 and 6 (paper section 6.3: {rng['parallel'][0]:g}% to "
            f"{rng['parallel'][1]:g}% and {rng['beam'][0]:g}% to {rng['beam'][1]:g}%)."]


def _prefix(sec: Section) -> list[str]:
    d = sec.data
    if "whole_trace_hit_rate" not in d:
        return []
    caps = d.get("by_capacity") or []
    small = caps[0] if caps else None
    text = (f"An unbounded prefix cache serves {_pct(d['whole_trace_hit_rate'], 2)} of the Mooncake "
            f"conversation trace's prompt tokens ({d['requests']:,} requests)")
    if small is not None:
        text += f"; one of {small['gib']:,.0f} GiB ({small['capacity']}) serves {_pct(small['hit_rate'])}"
    return [text + "."]


def _livelock(sec: Section) -> list[str]:
    th = sec.data["thrash"]
    pr = sec.data["pr_44594_preemptions"]
    off, ten = th.get("vLLM v1 (no watermark)"), th.get("watermark 10%")
    if off is None or ten is None:
        return []
    return [f"An admission watermark cuts recompute thrashing: {off['preemptions']:,} preemptions "
            f"without one, {ten['preemptions']:,} at 10% (vLLM PR #44594, their run: "
            f"{pr['off']:,} and {pr['0.1']:,})."]


def _swap(sec: Section) -> list[str]:
    d = sec.data
    rows = d["by_block_size"]
    mfu = d["mfu"]
    r16 = rows[16]["swap_s"][10] / rows[16]["recompute_s_by_mfu"][mfu]
    cross = d["crossover"][10]["per_layer"][d["tokens"]]
    return [f"Swapping a preempted {d['tokens']:,}-token sequence first beats recomputing it at block "
            f"size {cross} (modelled: 10 µs per copy, recompute at {100 * mfu:.0f}% MFU); at 16 it "
            f"takes {r16:.2f}x the recompute (paper: comparable from 16 to 64)."]


def _host(sec: Section) -> list[str]:
    m = sec.data.get("mooncake")
    if not m:
        return []
    by = m["by_host"]
    keys = sorted(by, key=int)
    none, big = by[keys[0]], by[keys[-1]]
    return [f"On the Mooncake trace a host tier {int(keys[-1])}x the device "
            f"pool adds {_pct(big['host_hit_rate'])} of prompt tokens as host hits to the device's "
            f"{_pct(none['device_hit_rate'])} (first {m['requests']:,} requests)."]


def _fleet(sec: Section) -> list[str]:
    r = sec.data.get("routers")
    if not r or "ring" not in r or "round-robin" not in r:
        return []
    ring, rr = r["ring"], r["round-robin"]
    text = (f"On 16 replicas the consistent-hash ring hits {_pct(ring['hit_rate'])} of prompt tokens "
            f"against round-robin's {_pct(rr['hit_rate'])}, but loses on TTFT p90 "
            f"({1e3 * ring['ttft_p90_s']:.0f} against {1e3 * rr['ttft_p90_s']:.0f} ms, modelled) and "
            f"on imbalance ({ring['imbalance']:.2f} against {rr['imbalance']:.2f})")
    p = r.get("precise")
    if p:
        text += (f"; the precise router hits {_pct(p['hit_rate'])} at TTFT p90 "
                 f"{1e3 * p['ttft_p90_s']:.0f} ms")
    return [text + "."]


def _hybrid(sec: Section) -> list[str]:
    mem = sec.data["memory"]["gpt-oss-20b"]
    short, long_ = min(mem, key=int), max(mem, key=int)
    text = (f"Keeping each gpt-oss-20b layer group's K/V only as far back as it attends saves "
            f"{_pct(mem[short]['saved'])} of a request's KV at {int(short):,} tokens and "
            f"{_pct(mem[long_]['saved'])} at {int(long_):,}")
    runs = sec.data.get("serving", {}).get("runs")
    if runs:
        gains = [by["paged grouped"]["mean_running"] / by["paged uniform"]["mean_running"] for by in runs.values()]
        text += (f"; served on Mooncake at the same bytes, grouped runs {min(gains):.2f}x to "
                 f"{max(gains):.2f}x the requests at once")
    rows = sec.data.get("hit_cost", {}).get("rows")
    out = [text + "."]
    if rows:
        worst = min(rows, key=lambda r: r["on_release"] - r["with_prefix"])
        gap = 100 * (worst["on_release"] - worst["with_prefix"])
        if gap < 0:
            out.append(f"The hybrid hit rule's reuse cliff: on {worst['model']} at 1/{round(1 / worst['fraction'])} "
                       f"of a never-evicting cache, plain LRU order of released window blocks hits {-gap:.2f} "
                       f"points less than re-aging them with their prefix "
                       f"({_pct(worst['on_release'], 2)} against {_pct(worst['with_prefix'], 2)}).")
    return out


def _latency_rate(sec: Section) -> list[str]:
    """The sustained-rate and batch ratios on ShareGPT-like lengths beside the paper's ranges."""
    d = sec.data
    w = d["workloads"]["ShareGPT-like"]
    by = {s["multiple"]: s["paged_over"] for s in w["sustained"]}
    head = by[d["headline_threshold"]]
    if head["oracle"] is None or head["max"] is None:
        return []
    spread = {o: [v[o] for v in by.values() if v[o] is not None] for o in ("oracle", "max")}
    sus, top = w["batch"][0]["paged_over"], w["batch"][-1]
    po, pm = d["paper_sustained"]["oracle"], d["paper_sustained"]["max"]
    return [f"At equal normalized latency ({d['headline_threshold']:g} x a request's latency alone) paging "
            f"sustains {head['oracle']:.2f}x the request rate of Orca (Oracle) and {head['max']:.2f}x that "
            f"of Orca (Max) on ShareGPT-like lengths ({min(spread['oracle']):.2f}-{max(spread['oracle']):.2f}x "
            f"and {min(spread['max']):.2f}-{max(spread['max']):.2f}x over thresholds of "
            f"{min(d['thresholds']):g}-{max(d['thresholds']):g}x; modelled for OPT-13B on an A100-40GB; "
            f"paper: {po[0]:g}-{po[1]:g}x and {pm[0]:g}-{pm[1]:g}x); it batches {sus['oracle']:.2f}x and "
            f"{sus['max']:.2f}x their requests at the highest rate it sustains ({w['batch'][0]['rate']:g} "
            f"req/s) and {top['paged_over']['oracle']:.2f}x and {top['paged_over']['max']:.2f}x at "
            f"{top['rate']:g} req/s (paper Fig. 13a: {d['paper_batched']['oracle']:g}x and "
            f"{d['paper_batched']['max']:g}x)."]


def _nanovllm(sec: Section) -> list[str]:
    d = sec.data
    n, p = d["allocators"]["nano-vllm"], d["allocators"]["pagedkv"]
    own = d["engine"]["own"]
    who = "nano-vllm's own scheduler" if own else "a scheduler written with nano-vllm's rules"
    theirs = "nano-vllm's BlockManager" if own else "a block manager written with its rules"
    return [f"Under {who} on {d['requests']} Mooncake requests, pagedkv's drop-in spends "
            f"{p['allocator_ms']:,.0f} ms in the allocator against {n['allocator_ms']:,.0f} for {theirs} "
            f"(measured), with {p['preemptions']} preemptions against {n['preemptions']} and "
            f"{_pct(p['hit_rate'])} of admitted tokens from cache against {_pct(n['hit_rate'])}."]


_FINDERS: dict[str, Callable[[Section], list[str]]] = {
    "fig2": _fig2, "fork_cost": _fork, "cow_proof": _cow, "block_size": _block_size, "sharing": _sharing,
    "prefix_hits": _prefix, "livelock": _livelock, "swap_vs_recompute": _swap, "host_offload": _host,
    "fleet": _fleet, "hybrid": _hybrid, "latency_rate": _latency_rate, "nanovllm": _nanovllm,
}
# The order findings are listed in: the paper's question first.
_ORDER = ("fig2", "latency_rate", "block_size", "fork_cost", "cow_proof", "sharing", "prefix_hits", "swap_vs_recompute",
          "livelock", "host_offload", "fleet", "hybrid", "nanovllm")


def findings(sections: list[Section]) -> list[Finding]:
    """The headline results of the sections given, in :data:`_ORDER`."""
    by_key = {s.key: s for s in sections}
    out = []
    for key in _ORDER:
        sec = by_key.get(key)
        if sec is None or sec.data.get("skipped"):
            continue
        try:
            texts = _FINDERS[key](sec)
        except (KeyError, StopIteration, ValueError, ZeroDivisionError):
            texts = []  # a section run without the rows a finding reads (e.g. another block size)
        out += [Finding(t, key, sec.heading) for t in texts]
    return out


def to_markdown(items: list[Finding]) -> str:
    """The findings as a Markdown section: a bullet per finding, wrapped at 100 columns, each
    ending with a link to its section."""
    lines = [f"## {HEADING}", ""]
    for f in items:
        text = f"{f.text} ([{plain(f.heading).split(':')[0]}](#{anchor(f.heading)}))"
        lines += _wrap(text, TEXT_WIDTH, "- ", "  ")
    return "\n".join(lines)


def to_text(items: list[Finding], width: int = TEXT_WIDTH) -> str:
    """The findings as terminal text, each naming its section."""
    out = [HEADING, "=" * len(HEADING), ""]
    for f in items:
        out += _wrap(f"{f.text} (section: {plain(f.heading)})", width, "- ", "  ")
    return "\n".join(out)
