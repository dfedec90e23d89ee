"""Report section: why virtual nodes, and how many; what bounded loads cost; precise vs ring.

A fleet routes each request to one of ``n`` replicas; consistent hashing of the prompt's first
tokens keeps a conversation on one replica (its cache hits) and moves few keys when replicas
come and go. Four tables:

1. **Virtual nodes.** With ``k`` points per replica on the ring a replica's share of the key
   space has relative standard deviation ``sqrt((n - 1) / (n k + 1))``, about ``1 / sqrt(k)``
   (:mod:`pagedkv.sim.routers` derives it: the shares are sums of ``k`` Dirichlet(1, ..., 1)
   gaps, i.e. Beta(k, n k - k)). Measured over many ring seeds for k = 1, 10, 100, 1,000, with
   the spread across seeds, and the same for the trace's requests, whose keys are not uniform:
   a conversation's turns share a key, so even a perfect ring keeps a floor of
   ``sqrt((n - 1) sum c_j^2) / m`` (``c_j`` requests on key ``j``, ``m`` in all); the prediction
   ``RSD^2 = A + (1 - A) (n - 1) sum c_j^2 / m^2`` with ``A`` the share variance above is exact
   in expectation for keys hashed uniformly.
2. **Bounded loads.** The ring with a cap of ``ceil((1 + eps) x average in flight)`` per replica
   (Mirrokni, Thorup and Zadimoghaddam, SODA'18) on a slice of the Mooncake conversation trace
   (its first 500 requests, 100 with ``quick``: six fleet runs of the whole trace would take
   minutes, see ``benchmarks/fleet_scale.py``; ``pagedkv fleet --num-requests all`` runs it):
   hit rate against balance as ``eps`` varies.
3. **Routers on the same slice**: round-robin (cache-blind; ``pagedkv fleet`` also runs
   least-loaded), the ring with and without bounded loads, and the precise router (an index
   built only from the replicas' KV events on vLLM's wire format, with the SGLang router's cache
   threshold and load guard).
4. **Published figures** (llm-d, the SGLang router, Preble), labelled as theirs, next to the
   precise router against the ring on the same slice here (ours), on each source's own metric.
   None of them compares against a ring: llm-d's nearest baseline is its approximate scorer (a
   prefix index guessed from routing history); SGLang and Preble compare against round-robin, so
   each also gets a row with ours against round-robin. Their workloads and loads differ from
   this trace's, so only the direction is comparable.

Every fleet run is real: 16 replicas, each a :class:`~pagedkv.KVCacheManager` of an H100's KV
memory for ``opts.model`` behind the serving scheduler and cost model, advanced together in
simulated time (:func:`pagedkv.sim.fleet.run_fleet`).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..sim import sizing
from ..sim.costmodel import CostModel
from ..sim.fleet import FleetResult, run_fleet, wire_available
from ..sim.routers import (DEFAULT_KEY_TOKENS, HashRing, PrefixAwareRouter, RingRouter, RoundRobin, prefix_keys,
                           ring_rsd_theory)
from ..sim.traces import detect_format, load_mooncake_jsonl, trace_not_found, trace_path
from .tables import Section, Table
from .options import ReportOptions

__all__ = ["section", "vnode_rsd", "REPLICAS", "VNODES"]

KEY, HEADING = "fleet", "A fleet of replicas: why virtual nodes, and how many"
REPLICAS = 16
VNODES = (1, 10, 100, 1_000)
RING_VNODES = 100  # the ring the fleet runs use
SEEDS = {False: 100, True: 10}  # ring seeds per k (full, quick)
KEY_REQUESTS = {False: None, True: 1_000}  # trace requests whose keys table 1 places (None: all)
FLEET_REQUESTS = {False: 500, True: 100}  # the slice tables 2-4 serve; the whole trace: pagedkv fleet
EPS = {False: (0.1, 0.25, 1.0), True: (0.25,)}
GPU_MEM_GIB, UTIL = 80.0, 0.9  # an H100, as pagedkv simulate assumes by default
MAX_LEN = 131_072

# Their figures, verbatim from the cited pages; shown next to ours, never used as ours. "baseline"
# is what each source itself compares against, in its own words: only a source whose baseline is
# round-robin also gets a row with ours against round-robin; every source gets ours against the ring.
def vnode_rsd(replicas: int, vnodes: int, seeds: int, keys: np.ndarray | None = None) -> dict:
    """Relative standard deviation of load across ``replicas`` on rings of ``vnodes`` points
    each, one ring per seed in ``range(seeds)``.

    ``share``: per seed, std / mean of the replicas' key-space shares (the mean is exactly
    1/n); ``requests``: the same for the number of ``keys`` (uint64) each replica owns. Returns
    per-seed arrays and ``max_share`` / ``max_requests`` (max over mean per seed).
    """
    rsd, top, req_rsd, req_top = [], [], [], []
    names = [f"r{i}" for i in range(replicas)]
    for seed in range(seeds):
        ring = HashRing(names, vnodes, seed)
        s = ring.shares()
        rsd.append(float(np.sqrt(np.mean((s - 1 / replicas) ** 2)) * replicas))
        top.append(float(s.max() * replicas))
        if keys is not None and len(keys):
            counts = np.bincount(ring.owners_of(keys), minlength=replicas).astype(np.float64)
            mean = counts.mean()
            req_rsd.append(float(np.sqrt(np.mean((counts - mean) ** 2)) / mean))
            req_top.append(float(counts.max() / mean))
    return {"share": np.array(rsd), "max_share": np.array(top), "requests": np.array(req_rsd),
            "max_requests": np.array(req_top)}


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x)))) if len(x) else math.nan


def _vnode_table(keys: np.ndarray, seeds: int, sec: Section) -> Table:
    n, m = REPLICAS, len(keys)
    _, per_key = np.unique(keys, return_counts=True)
    floor2 = (n - 1) * float(np.sum(per_key.astype(np.float64) ** 2)) / m**2
    t = Table(f"Load spread on a ring of {n} replicas: relative standard deviation (RSD) vs k, the virtual "
              f"nodes per replica ({seeds} ring seeds each)",
              ["k", "theory", "1/sqrt(k)", "share RSD", "p5", "p95", "max/mean share", "requests RSD",
               "predicted", "max/mean requests"],
              plot={"name": "fleet_vnodes_rsd", "x": "k", "y": ["theory", "share RSD", "requests RSD"], "kind": "line",
                    "logx": True, "logx_base": 10, "logy": True,
                    "legend": {"theory": "ring share RSD, theory sqrt((n-1)/(nk+1))",
                               "share RSD": "ring share RSD, measured",
                               "requests RSD": "requests per replica RSD (Mooncake keys), measured"},
                    "styles": {"theory": {"linestyle": "--", "marker": "x"}},
                    "ylabel": "relative standard deviation across replicas (std / mean, log scale)",
                    "xlabel": "virtual nodes per replica, k (log scale)",
                    "title": f"Load spread over {n} replicas against the virtual nodes per replica on a "
                             f"consistent-hash ring ({seeds} ring seeds each)"})
    rows = []
    for k in VNODES:
        r = vnode_rsd(n, k, seeds, keys)
        theory = ring_rsd_theory(n, k)
        predicted = math.sqrt(theory**2 + (1 - theory**2) * floor2)
        t.add(k, round(theory, 4), round(1 / math.sqrt(k), 4), round(_rms(r["share"]), 4),
              round(float(np.percentile(r["share"], 5)), 4), round(float(np.percentile(r["share"], 95)), 4),
              round(float(np.median(r["max_share"])), 3), round(_rms(r["requests"]), 4), round(predicted, 4),
              round(float(np.median(r["max_requests"])), 3))
        rows.append({"k": k, "theory": theory, "share_rsd_rms": _rms(r["share"]),
                     "share_rsd_p5": float(np.percentile(r["share"], 5)),
                     "share_rsd_p95": float(np.percentile(r["share"], 95)),
                     "requests_rsd_rms": _rms(r["requests"]), "requests_rsd_predicted": predicted})
    sec.data["vnodes"] = rows
    sec.data["key_floor_rsd"] = math.sqrt(floor2)
    t.notes.append("theory sqrt((n-1)/(nk+1)): a replica's share of the ring is Beta(k, nk-k); share RSD: "
                   "root mean square over seeds of std/mean of the 16 shares; p5, p95: its spread across "
                   "seeds; max/mean: median over seeds")
    t.notes.append(f"requests: the first {DEFAULT_KEY_TOKENS:,} tokens of {m:,} Mooncake prompts hashed onto the "
                   f"same rings ({len(per_key):,} distinct keys, up to {int(per_key.max())} requests on one); "
                   f"predicted = sqrt(A + (1-A) F^2), A = theory^2, F = {math.sqrt(floor2):.4f}, the floor "
                   "that a conversation's turns sharing one key leave even with perfectly even shares")
    return t


def _fleet_setup(opts: ReportOptions) -> tuple[int, CostModel]:
    spec = sizing.get_model(opts.model)
    weights = sizing.estimate_weight_bytes(spec)
    size = sizing.kv_size(spec, block_size=opts.block_size)
    cap = sizing.fit_blocks(size, gpu_mem_gib=GPU_MEM_GIB, util=UTIL, weights_gib=weights / sizing.GIB)
    return cap.num_blocks, CostModel.for_model(spec.name)


def _run(requests, router, blocks: int, cost: CostModel, opts: ReportOptions, label: str,
         wire: bool | None = None) -> FleetResult:
    opts.note(f"fleet: {label} ({len(requests):,} requests, {REPLICAS} replicas)")
    return run_fleet(requests, router, REPLICAS, blocks, block_size=opts.block_size, cost=cost,
                     max_len=MAX_LEN, wire=wire)


def _row(res: FleetResult) -> dict:
    s = res.summary()
    s["overflow"] = res.router_stats.get("overflow", 0) / max(res.num_requests, 1)
    s["max_requests"] = float(res.requests_per_replica.max() / res.requests_per_replica.mean())
    latency = np.concatenate([r.requests.finish - r.requests.arrival for r in res.replicas])
    s["latency_mean_s"] = float(np.nanmean(latency)) if len(latency) else math.nan
    s["latency_p99_s"] = float(np.nanpercentile(latency, 99)) if len(latency) else math.nan
    return s


def _eps_table(runs: dict, n: int, sec: Section) -> Table:
    t = Table(f"Bounded loads: hit rate vs balance as eps varies (ring of {RING_VNODES} virtual nodes per replica, "
              f"{REPLICAS} replicas, first {n:,} Mooncake requests)",
              ["eps", "hit %", "imbalance", "max/mean requests", "overflow %", "TTFT p50 ms", "TTFT p90 ms"],
              plot={"name": "fleet_bounded_loads", "x": "eps", "y": ["hit %"], "kind": "bar",
                    "ylabel": "% of prompt tokens served from a replica's cache",
                    "xlabel": "eps (a replica's cap is (1 + eps) x the mean load)",
                    "annotate": "imbalance", "annotate_format": "imbalance {}",
                    "legend": {"hit %": "prefix hit rate (imbalance, max/mean busy time, above each bar)"},
                    "title": f"Bounded loads on a consistent-hash ring ({REPLICAS} replicas): prefix hit rate "
                             "and imbalance against eps"})
    rows = []
    for label, res in runs.items():
        s = _row(res)
        t.add(label, round(100 * s["hit_rate"], 2), round(s["imbalance"], 3), round(s["max_requests"], 3),
              round(100 * s["overflow"], 1), round(1e3 * s["ttft_p50_s"], 1), round(1e3 * s["ttft_p90_s"], 1))
        rows.append({"eps": label, **{k: s[k] for k in ("hit_rate", "imbalance", "max_requests", "overflow",
                                                         "ttft_p50_s", "ttft_p90_s")}})
    sec.data["bounded_loads"] = rows
    t.notes.append("cap = ceil((1 + eps) x (requests in flight + 1) / 16); a replica at its cap passes the "
                   "request clockwise to the next replica under it (overflow %); imbalance = max / mean of the "
                   "replicas' busy seconds; max/mean requests: requests routed")
    ring = runs["unbounded"]
    lat = np.concatenate([r.requests.finish - r.requests.arrival for r in ring.replicas])
    in_flight = float(np.nansum(lat) / ring.makespan / REPLICAS) if ring.makespan > 0 else 0.0
    caps = sorted({math.ceil((1 + float(e)) * (in_flight + 1 / REPLICAS)) for e in runs if e != "unbounded"})
    sec.data["mean_in_flight_per_replica"] = in_flight
    t.notes.append(f"a replica holds {in_flight:.2f} requests in flight on average (Little's law over the "
                   f"unbounded run), so the typical cap is {' to '.join(map(str, caps))} request(s): small eps "
                   "overflow often, and the granularity of ceil() is part of the trade")
    return t


# What each router's counters mean, in words (pagedkv.sim.routers).
ROUTER_STATS = {
    "affinity": "requests sent to the replica holding their longest cached prefix:",
    "below_threshold": "requests whose longest cached prefix was too short to count, sent to the least "
                       "loaded replica:",
    "guard": "requests the load guard sent elsewhere:",
    "overflow": "requests passed on from a full replica (overflow):",
}


def _known(value: float, digits: int) -> float | None:
    """A measured value rounded, or None (shown "-") where nothing was measured (NaN: no prefix
    was shared by two requests on the slice)."""
    return None if value is None or math.isnan(value) else round(value, digits)


def _router_table(results: list[tuple[str, FleetResult]], n: int, sec: Section) -> Table:
    t = Table(f"Routers on the same slice ({REPLICAS} replicas, first {n:,} Mooncake requests)",
              ["router", "hit %", "imbalance", "TTFT p50 ms", "TTFT p90 ms", "replicas/prefix", "one replica %"],
              plot={"name": "fleet_routers", "x": "router", "y": ["hit %"], "kind": "bar",
                    "ylabel": "% of prompt tokens served from a replica's cache", "xlabel": "router",
                    "annotate": "TTFT p90 ms", "annotate_format": "TTFT p90 {} ms",
                    "legend": {"hit %": "prefix hit rate"},
                    "title": "Routers on 16 replicas (Mooncake slice): prefix hit rate, with the modelled "
                             "TTFT p90 above each bar"})
    rows = {}
    for label, res in results:
        s = _row(res)
        t.add(label, round(100 * s["hit_rate"], 2), round(s["imbalance"], 3), round(1e3 * s["ttft_p50_s"], 1),
              round(1e3 * s["ttft_p90_s"], 1), _known(s["replicas_per_prefix_mean"], 2),
              _known(100 * s["prefixes_on_one_replica"], 1))
        rows[label] = s
    sec.data["routers"] = rows
    t.notes.append(f"replicas/prefix: distinct replicas the requests sharing their first {DEFAULT_KEY_TOKENS:,} "
                   "tokens went to (prefixes used twice or more); one replica %: the share kept on one; "
                   "- where no prefix was used twice on the slice")
    for label, res in results:
        if res.router_stats:
            stats = ", ".join(f"{ROUTER_STATS.get(k, k)} {v:,}" for k, v in sorted(res.router_stats.items()))
            t.notes.append(f"{label}: {stats}" + (f"; {res.event_bytes / 1e6:.1f} MB of KV events decoded"
                                                  if res.event_bytes else "; KV events handed over in process"
                                                  if label == "precise" else ""))
    return t


def _mooncake(opts: ReportOptions) -> tuple[Path | None, str | None]:
    """The Mooncake trace to use, and a sentence when ``opts.trace`` is of another kind."""
    if opts.trace is not None and detect_format(opts.trace) == "mooncake":
        return Path(opts.trace), None
    fallback = trace_path("mooncake", opts.data_dir)
    if opts.trace is None:
        return fallback, None
    return fallback, (f"The trace given ({Path(opts.trace).name}) carries no content hashes, so routing cannot "
                      "change its hit rate; this section needs a Mooncake trace"
                      + (f" and uses {fallback.name} instead." if fallback else "."))


def section(opts: ReportOptions) -> Section:
    """Virtual nodes, bounded loads and routers on the Mooncake trace (see the module docstring)."""
    if not isinstance(opts, ReportOptions):
        raise ValueError(f"opts must be ReportOptions, got {type(opts).__name__}")
    sec = Section(KEY, HEADING, intro=(
        "A request routed away from the replica that caches its prefix recomputes it. Consistent hashing "
        "keeps a prefix on one replica; virtual nodes even out the key space it hashes onto; bounded "
        "loads cap what a hot key can pile on one replica; a precise router follows the replicas' own "
        "KV events instead of a hash."))
    path, why = _mooncake(opts)
    if why:
        sec.text.append(why)
    if path is None:
        sec.text.append(f"{trace_not_found('mooncake', opts.data_dir)}: section skipped.")
        sec.data["skipped"] = True
        return sec
    quick = opts.quick
    opts.note("fleet: hashing the trace's prompt keys onto rings")
    keyed = load_mooncake_jsonl(path, limit=KEY_REQUESTS[quick])
    both = [prefix_keys(r, (DEFAULT_KEY_TOKENS, 512)) for r in keyed]
    keys = np.array([k for k, _ in both], dtype=np.uint64)
    sec.tables.append(_vnode_table(keys, SEEDS[quick], sec))
    short = len({k for _, k in both})
    sec.data["distinct_keys_512"] = short
    sec.text.append(
        f"Why the key is {DEFAULT_KEY_TOKENS:,} tokens: the first 512 tokens of the Mooncake prompts take "
        f"{short:,} distinct value{'s' if short != 1 else ''} over {len(keyed):,} requests (one shared system "
        "prompt), and no number of virtual nodes spreads one key: with a 512-token key one replica would take "
        "every request.")

    requests = keyed[:FLEET_REQUESTS[quick]]
    of = f" of the trace's {len(keyed):,}" if KEY_REQUESTS[quick] is None else " of the trace"
    sec.text.append(
        f"The bounded-loads and routers tables replay the first {len(requests):,} requests{of} on {REPLICAS} replicas, a slice that keeps "
        "the report quick; pagedkv fleet --num-requests all replays the whole trace, and "
        "benchmarks/fleet_scale.py measures what that costs (docs/design.md, section 2.8).")
    blocks, cost = _fleet_setup(opts)
    eps_runs: dict[str, FleetResult] = {}
    for eps in EPS[quick]:
        label = f"ring-bounded eps {eps:g}"
        eps_runs[f"{eps:g}"] = _run(requests, RingRouter(RING_VNODES, eps), blocks, cost, opts, label)
    eps_runs["unbounded"] = _run(requests, RingRouter(RING_VNODES), blocks, cost, opts, "ring")
    sec.tables.append(_eps_table(eps_runs, len(requests), sec))

    results = [("round-robin", _run(requests, RoundRobin(), blocks, cost, opts, "round-robin"))]
    rr = results[0][1]
    sec.data["utilization"] = float(rr.busy_s.mean() / rr.makespan) if rr.makespan > 0 else 0.0
    results += [("ring", eps_runs["unbounded"]), ("ring-bounded 0.25", eps_runs["0.25"])]
    wire = wire_available()
    precise = PrefixAwareRouter(opts.block_size)
    results.append(("precise", _run(requests, precise, blocks, cost, opts, "precise", wire=wire)))
    if not wire:
        sec.text.append("The precise router's index is built from the replicas' KV events handed over in "
                        "process (msgspec, which puts them on vLLM's wire format, is not installed: "
                        "pip install \"pagedkv[events]\"); the index and the routes are the same either way.")
    sec.tables.append(_router_table(results, len(requests), sec))
    sec.data.update({"trace": str(path), "replicas": REPLICAS, "blocks_per_replica": blocks,
                     "fleet_requests": len(requests), "key_requests": len(keyed), "seeds": SEEDS[quick]})
    _summary(sec)
    return sec


def _summary(sec: Section) -> None:
    rows = {r["k"]: r for r in sec.data["vnodes"]}
    k1, k1000 = rows[VNODES[0]], rows[VNODES[-1]]
    floor = sec.data["key_floor_rsd"]
    enough = _enough_k(sec)
    routers = sec.data["routers"]
    text = (f"Measured share RSD (relative standard deviation of the replicas' shares of the ring) falls "
            f"from {k1['share_rsd_rms']:.3f} at k = 1 virtual node per replica to {k1000['share_rsd_rms']:.4f} at "
            f"k = 1,000 (theory {k1['theory']:.3f} and {k1000['theory']:.4f}). On the trace's own keys the "
            f"request RSD cannot go below {floor:.3f} (a conversation's turns share a key); from k = {enough:,} "
            f"it is {rows[enough]['requests_rsd_rms']:.3f}, at that floor, so more virtual nodes buy nothing "
            "on this trace.")
    ring, rr = routers.get("ring"), routers.get("round-robin")
    if ring and rr:
        loses = [f"TTFT p50/p90 {1e3 * ring['ttft_p50_s']:.0f}/{1e3 * ring['ttft_p90_s']:.0f} ms against "
                 f"{1e3 * rr['ttft_p50_s']:.0f}/{1e3 * rr['ttft_p90_s']:.0f} ms"
                 if ring["ttft_p90_s"] > rr["ttft_p90_s"] else "",
                 f"imbalance {ring['imbalance']:.2f} against {rr['imbalance']:.2f}"
                 if ring["imbalance"] > rr["imbalance"] else ""]
        loses = [x for x in loses if x]
        text += (f" The ring hits {100 * ring['hit_rate']:.1f}% of prompt tokens against round-robin's "
                 f"{100 * rr['hit_rate']:.1f}%")
        text += (f", but loses on {' and on '.join(loses)} (TTFT modelled): keeping a conversation on "
                 "one replica piles its turns there, so requests queue behind each other while other "
                 "replicas idle." if loses else ", and is no worse on TTFT p90 or imbalance.")
    if "precise" in routers:
        p, ring = routers["precise"], routers["ring"]
        text += (f" The precise router hits {100 * p['hit_rate']:.1f}% of prompt tokens against the ring's "
                 f"{100 * ring['hit_rate']:.1f}%, at imbalance {p['imbalance']:.2f} vs {ring['imbalance']:.2f} "
                 f"and TTFT p90 {1e3 * p['ttft_p90_s']:.0f} vs {1e3 * ring['ttft_p90_s']:.0f} ms.")
    sec.text.append(text)


def _enough_k(sec: Section) -> int:
    """The smallest k whose share RSD is below the key floor: beyond it the keys, not the ring,
    decide the spread."""
    for row in sec.data["vnodes"]:
        if row["share_rsd_rms"] < sec.data["key_floor_rsd"]:
            return row["k"]
    return VNODES[-1]
