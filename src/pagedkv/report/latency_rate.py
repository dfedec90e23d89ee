"""Report section: normalized latency against request rate, and the rate each system sustains.

The vLLM paper's headline (its Fig. 12 and section 6.2) serves Poisson arrivals at a sweep of
request rates and plots the normalized latency, the mean over requests of end-to-end latency
divided by output length (seconds per token), for vLLM and three Orca variants; each curve stays
flat while the server keeps up and explodes once the rate passes what it can serve. On ShareGPT
vLLM sustains 1.7-2.7x the rate of Orca (Oracle) and 2.7-8x that of Orca (Max) at similar
latency (over its three models), and its Fig. 13a counts 2.2x and 4.3x the requests batched
(OPT-13B). We rebuild it on the Fig. 2 section's setup: OPT-13B's 12 GiB of KV on an A100-40GB,
step times modelled by the same cost model, the real KVCacheManager for paging and the three
reservations on the buddy allocator, one continuous-batching scheduler for all four. The
sustained rate is read off each curve where it crosses a threshold stated as a multiple of the
latency a request has alone, at two more multiples to show what the choice moves.

Worked number: ShareGPT-like requests alone take 0.0178 s per output token on that setup; the
headline threshold, 2 x that, is 0.0356 s per token.
"""
from __future__ import annotations

import numpy as np

from ..sim.latency_rate import SYSTEM_LABELS, SYSTEMS, Curve, Sustained, sustained_rate, sweep, unloaded_latency
from ..sim.preemptions import Anatomy, anatomy
from ..sim.workloads import load_workload
from .fig2 import FULL_REQUESTS, PAPER_GPU, PAPER_MAX_LEN, PAPER_MODEL, paper_setup
from .options import ReportOptions
from .tables import Section, Table

__all__ = ["section", "PAPER_SUSTAINED", "PAPER_BATCHED", "THRESHOLDS", "HEADLINE_THRESHOLD", "WORKLOADS",
           "rate_grid", "batch_read_rate"]

# vLLM paper (SOSP'23) section 6.2, ShareGPT: the request rate vLLM sustains over Orca's at similar
# latency (a range over OPT-13B, OPT-66B and OPT-175B), and Fig. 13a's requests batched (OPT-13B).
PAPER_SUSTAINED = {"oracle": (1.7, 2.7), "max": (2.7, 8.0)}
PAPER_BATCHED = {"oracle": 2.2, "max": 4.3}
# Thresholds as multiples of the latency a request has alone; the first is the headline.
HEADLINE_THRESHOLD = 2.0
THRESHOLDS = (HEADLINE_THRESHOLD, 1.5, 4.0)
# (key, label, requests, lowest and highest rate, rates): full and --quick. The grids span from
# below the rate Orca (Max) sustains to above paging's; the rates are geometric between the ends.
WORKLOADS = {
    False: (("sharegpt", "ShareGPT-like", 500, 0.4, 5.0, 9), ("alpaca", "Alpaca-like", 1000, 4.0, 400.0, 10)),
    True: (("sharegpt", "ShareGPT-like", 150, 0.5, 5.0, 5), ("alpaca", "Alpaca-like", 300, 4.0, 400.0, 5)),
}
# The saturated run whose preemptions are explained: the Fig. 2 section's (fewer with --quick).
ANATOMY_REQUESTS = {False: FULL_REQUESTS, True: 150}


def rate_grid(lo: float, hi: float, num: int) -> list[float]:
    """``num`` geometric rates from ``lo`` to ``hi``, each to 3 significant digits (the rate stated
    is the rate run): 0.3 to 5 in 10 -> 0.3, 0.410, 0.561, ..., 5."""
    return sorted({float(f"{r:.3g}") for r in np.geomspace(lo, hi, num)})


def batch_read_rate(curve: Curve, threshold: float) -> int:
    """Index of the rate at which requests batched are compared: the highest swept rate at which
    paging's normalized latency is still below ``threshold`` (where paging is loaded and the
    reservations, which explode earlier, hold all the requests their memory allows); the first
    rate when even it is above."""
    lat = curve.latencies
    above = [i for i, v in enumerate(lat) if not v < threshold]
    return max((above[0] if above else len(lat)) - 1, 0)


def _ratio(num: Sustained, den: Sustained) -> float | None:
    """paged / other, None unless both are read inside the sweep."""
    return round(num.rate / den.rate, 2) if num.exact and den.exact and den.rate > 0 else None


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}") if x == x else x


class _Run:
    """One workload's sweep and its readings."""

    def __init__(self, key: str, label: str, n: int, rates: list[float], curves: dict[str, Curve],
                 unloaded: float) -> None:
        self.key, self.label, self.n, self.rates, self.curves, self.unloaded = key, label, n, rates, curves, unloaded
        self.sustained = {m: {s: sustained_rate(c.rates, c.latencies, m * unloaded) for s, c in curves.items()}
                          for m in THRESHOLDS}
        self.batch_at = batch_read_rate(curves["paged"], HEADLINE_THRESHOLD * unloaded)

    def ratio(self, m: float, other: str) -> float | None:
        return _ratio(self.sustained[m]["paged"], self.sustained[m][other])

    def batch(self, system: str, at: int | None = None) -> float:
        """Requests ``system`` batched at rate index ``at`` (default: the paged-sustained rate)."""
        return self.curves[system].points[self.batch_at if at is None else at].mean_batch

    def batch_ratio(self, other: str, at: int | None = None) -> float:
        return round(self.batch("paged", at) / self.batch(other, at), 2)


def _run(key: str, label: str, n: int, lo: float, hi: float, num: int, opts: ReportOptions) -> _Run:
    num_blocks, cost = paper_setup(opts.block_size)
    rates = rate_grid(lo, hi, num)

    def requests(rate: float):
        return load_workload(key, n, opts.seed, max_len=PAPER_MAX_LEN, rate=rate)

    curves = sweep(requests, rates, num_blocks, opts.block_size, cost, PAPER_MAX_LEN,
                   progress=lambda msg: opts.note(f"latency_rate, {label}: {msg}"))
    return _Run(key, label, n, rates, curves, unloaded_latency(load_workload(key, n, opts.seed, max_len=PAPER_MAX_LEN),
                                                               cost))


def _curve_table(run: _Run) -> Table:
    lat_cols = [f"{SYSTEM_LABELS[s]} s/token" for s in SYSTEMS]
    batch_cols = [f"{SYSTEM_LABELS[s]} batch" for s in SYSTEMS]
    threshold = HEADLINE_THRESHOLD * run.unloaded
    t = Table(
        f"Normalized latency against request rate, {run.label} ({run.n:,} requests per rate, Poisson arrivals; "
        f"modelled step times, {PAPER_MODEL} on an {PAPER_GPU})",
        ["rate req/s"] + lat_cols + batch_cols + ["paged preemptions"],
        plot={"name": f"latency_rate_{run.key}", "x": "rate req/s", "y": lat_cols, "kind": "line", "logy": True,
              "legend": dict(zip(lat_cols, (SYSTEM_LABELS[s] for s in SYSTEMS))),
              "hline": [_sig(threshold), f"threshold: {HEADLINE_THRESHOLD:g} x the latency alone "
                                         f"({_sig(threshold, 3):g} s/token)"],
              "ylabel": "normalized latency, s/token (modelled, log scale)", "xlabel": "request rate (req/s)",
              "title": f"Normalized latency against request rate, {run.label}, {PAPER_MODEL} on an {PAPER_GPU} "
                       f"(modelled; the vLLM paper's Fig. 12 measure)"},
    )
    if run.rates[-1] / run.rates[0] >= 50:  # two decades and more: a log rate axis, as swept
        t.plot.update(logx=True, logx_base=10, xlabel="request rate (req/s, log scale)")
    for i, rate in enumerate(run.rates):
        pts = [run.curves[s].points[i] for s in SYSTEMS]
        t.add(rate, *[_sig(p.normalized_latency) for p in pts], *[round(p.mean_batch, 1) for p in pts],
              run.curves["paged"].points[i].preemptions)
    t.notes.append(f"s/token: mean over requests of (finish - arrival) / output tokens, the paper's "
                   f"normalized latency. batch: requests decoded per iteration while requests arrive "
                   f"(tokens decoded over iterations, until the last arrival). Alone, a request takes {_sig(run.unloaded, 3):g} s/token (modelled).")
    return t


def _fmt_rate(s: Sustained) -> str:
    return {"=": "", ">=": ">= ", "<": "< "}[s.bound] + f"{s.rate:.3g}"


def _sustained_table(runs: list[_Run]) -> Table:
    t = Table(
        "Sustained request rate: the highest rate each system serves with its normalized latency below the "
        "threshold (modelled), and paging's ratio to Orca's beside the paper's (ShareGPT)",
        ["workload / threshold", "threshold s/token"] + [f"{SYSTEM_LABELS[s]} req/s" for s in SYSTEMS]
        + ["paged / Oracle", "paged / Max", "paged / Pow2", "paper paged / Oracle", "paper paged / Max"],
    )
    for run in runs:
        paper = run.key == "sharegpt"
        for m in THRESHOLDS:
            sus = run.sustained[m]
            t.add(f"{run.label} / {m:g} x alone" + (" (headline)" if m == HEADLINE_THRESHOLD else ""),
                  _sig(m * run.unloaded, 3), *[_fmt_rate(sus[s]) for s in SYSTEMS],
                  run.ratio(m, "oracle"), run.ratio(m, "max"), run.ratio(m, "pow2"),
                  "-".join(f"{x:g}" for x in PAPER_SUSTAINED["oracle"]) if paper else None,
                  "-".join(f"{x:g}" for x in PAPER_SUSTAINED["max"]) if paper else None)
    t.notes += [
        "Reading: from the lowest rate up, the first rate whose latency is at or above the threshold ends "
        "the curve; the crossing is interpolated between it and the rate before (linear in rate, in the "
        "logarithm of latency). '>= x': the curve never crosses in the sweep; '< x': it starts above. A "
        "ratio is given only when both rates are read inside the sweep.",
        "Threshold: a multiple of the latency a request has alone (no queue, no batch), the same for every "
        "system: the paper reads where a curve explodes at similar latency and states no threshold, so "
        "the ratio is shown at three multiples to show what that choice moves.",
        "Paper: vLLM paper section 6.2, ShareGPT; its ranges span OPT-13B, OPT-66B and OPT-175B, ours is "
        "OPT-13B only. It gives no ratio for Alpaca.",
    ]
    return t


def _batch_table(runs: list[_Run]) -> Table:
    t = Table(
        "Requests batched per iteration (modelled) at the highest swept rate paging sustains under the "
        "headline threshold and at the highest rate swept, beside the paper's Fig. 13a (OPT-13B, ShareGPT)",
        ["workload / rate", "rate req/s"] + [f"{SYSTEM_LABELS[s]} batch" for s in SYSTEMS]
        + ["paged / Oracle", "paged / Max", "paper paged / Oracle", "paper paged / Max"],
    )
    for run in runs:
        paper = run.key == "sharegpt"
        last = len(run.rates) - 1
        for name, at in (("highest rate paging sustains", run.batch_at), ("highest rate swept", last)):
            t.add(f"{run.label} / {name}", run.rates[at], *[round(run.batch(s, at), 1) for s in SYSTEMS],
                  run.batch_ratio("oracle", at), run.batch_ratio("max", at),
                  PAPER_BATCHED["oracle"] if paper else None, PAPER_BATCHED["max"] if paper else None)
    for run in runs:
        t.notes.append(_batch_note(run))
    t.notes.append("A system past the rate it sustains batches what its memory holds. The paper reads "
                   "Fig. 13a at one rate; the curve tables give the batch at every rate.")
    return t


def _batch_note(run: _Run) -> str:
    """Which systems are past the rate they sustain (headline threshold) at the two rates read:
    there a system batches what its memory holds."""
    sus = run.sustained[HEADLINE_THRESHOLD]

    def past(at: int) -> str:
        names = [SYSTEM_LABELS[s] for s in SYSTEMS if sus[s].bound != ">=" and run.rates[at] > sus[s].rate]
        return ", ".join(names) if names else "none"

    return (f"{run.label}, past the rate each sustains: at {run.rates[run.batch_at]:g} req/s "
            f"{past(run.batch_at)}; at {run.rates[-1]:g} req/s {past(len(run.rates) - 1)}.")


def _anatomy_text(a: Anatomy, quick: bool) -> str:
    text = (
        f"Why paging preempts about once per request when saturated (the Fig. 2 section's "
        f"saturated view counts them; here {a.requests:,} ShareGPT-like requests at t = 0 give "
        f"{a.preemptions:,} preemptions): each finish's freed blocks go at once to the head of the "
        f"queue, admitted while its prompt fits with the admission watermark ({a.watermark_blocks} of the "
        f"{a.num_blocks:,} blocks) left free. Between two finishes ({a.steps_per_finish:.1f} decode steps apart "
        f"while requests wait) the ~{a.mean_batch:.0f} running sequences grow by "
        f"{a.growth_between_finishes:.1f} blocks, {a.growth_between_finishes - a.watermark_blocks:.1f} "
        f"more than the watermark leaves, so a step runs out and preempts the newest request, which "
        f"frees {a.freed_mean:.1f} blocks on average (median {a.freed_median:g}: a young request holds "
        f"little more than its prompt; the next admission takes {a.taken_after:.1f}). That is "
        f"{a.per_finish:.2f} preemptions per finish, {a.predicted():,.0f} over the "
        f"{a.loaded_finishes:,} finishes while requests wait, against {a.loaded_preemptions:,} counted; "
        f"{a.preempted:,} requests are preempted, {a.repeated:,} more than once (one {a.most} times). "
        f"The livelock section shows what a larger admission watermark does to this churn.")
    if quick:
        text = f"--quick: {a.requests:,} requests, not the Fig. 2 section's {FULL_REQUESTS:,}. " + text
    return text


def section(opts: ReportOptions) -> Section:
    """Normalized latency against request rate on ShareGPT-like and Alpaca-like lengths."""
    if not isinstance(opts, ReportOptions):
        raise ValueError(f"opts must be ReportOptions, got {type(opts).__name__}")
    runs = [_run(*spec, opts) for spec in WORKLOADS[opts.quick]]
    num_blocks, cost = paper_setup(opts.block_size)
    opts.note("latency_rate: the saturated paged run's preemptions")
    sat = load_workload("sharegpt", ANATOMY_REQUESTS[opts.quick], opts.seed, max_len=PAPER_MAX_LEN)
    anat = anatomy(sat, num_blocks, opts.block_size, cost, PAPER_MAX_LEN)
    tables = [_sustained_table(runs), _batch_table(runs)] + [_curve_table(r) for r in runs]
    sizes = ", ".join(f"{r.label} {r.n:,} requests at {len(r.rates)} rates from {r.rates[0]:g} to "
                      f"{r.rates[-1]:g} req/s" for r in runs)
    text = [f"Setup: {PAPER_MODEL}, {num_blocks * opts.block_size:,} token slots of KV (block size "
            f"{opts.block_size}), context {PAPER_MAX_LEN:,}, step times modelled for an {PAPER_GPU} "
            f"({cost.describe()}); {sizes}; the same lengths at every rate (seed {opts.seed}). Every "
            f"request is served to its end, so past its limit a system's latency keeps growing with "
            f"the number of requests: that sets how high a curve climbs, hardly where it starts to."]
    if opts.quick:
        text.insert(0, "--quick: fewer requests and rates than the full report; the curves explode "
                       "later and less, and a ratio may be left out: a smoke test, not the measure.")
    head = runs[0]
    text.append(_headline_text(head))
    text.append(_anatomy_text(anat, opts.quick))
    sec = Section(key="latency_rate", heading="Latency against request rate (vLLM Fig. 12-13)",
                  intro=(__doc__ or "").split("\n\n")[1].replace("\n", " "), tables=tables, text=text)
    sec.data.update(_data(runs, anat))
    return sec


def _headline_text(run: _Run) -> str:
    m = HEADLINE_THRESHOLD
    sus = run.sustained[m]
    ratios = {o: [run.ratio(x, o) for x in THRESHOLDS] for o in ("oracle", "max")}
    spread = {o: [r for r in v if r is not None] for o, v in ratios.items()}
    parts = []
    for o in ("oracle", "max"):
        lo, hi = PAPER_SUSTAINED[o]
        got = ratios[o][0]
        head = f"{got:.2f}x" if got is not None else "a ratio not read (a rate outside the sweep)"
        band = (f"{min(spread[o]):.2f}-{max(spread[o]):.2f}x over the {len(THRESHOLDS)} thresholds; "
                if len(spread[o]) > 1 else "")
        parts.append(f"{head} that of {SYSTEM_LABELS[o]} ({band}paper {lo:g}-{hi:g}x)")
    last = len(run.rates) - 1
    return (f"{run.label}, modelled: at {m:g} x the latency alone ({_sig(m * run.unloaded, 3):g} s/token), "
            f"paging sustains {_fmt_rate(sus['paged'])} req/s: {parts[0]} and {parts[1]}. At "
            f"{run.rates[run.batch_at]:g} req/s it batches {run.batch_ratio('oracle'):.2f}x the requests of "
            f"Orca (Oracle) and {run.batch_ratio('max'):.2f}x those of Orca (Max), at {run.rates[last]:g} "
            f"req/s {run.batch_ratio('oracle', last):.2f}x and {run.batch_ratio('max', last):.2f}x (paper "
            f"Fig. 13a: {PAPER_BATCHED['oracle']:g}x and {PAPER_BATCHED['max']:g}x).")


def _data(runs: list[_Run], anat: Anatomy) -> dict:
    out = {"model": PAPER_MODEL, "paper_sustained": {k: list(v) for k, v in PAPER_SUSTAINED.items()},
           "paper_batched": dict(PAPER_BATCHED), "headline_threshold": HEADLINE_THRESHOLD,
           "thresholds": list(THRESHOLDS), "preemptions": anat.as_dict(), "workloads": {}}
    for run in runs:
        out["workloads"][run.label] = {
            "key": run.key, "num_requests": run.n, "rates": run.rates, "unloaded_s_per_token": run.unloaded,
            "curves": {s: [{"rate": p.rate, "normalized_latency": p.normalized_latency, "mean_batch": p.mean_batch,
                            "preemptions": p.preemptions, "finished": p.finished} for p in c.points]
                       for s, c in run.curves.items()},
            "sustained": [{"multiple": m, "threshold_s_per_token": m * run.unloaded,
                           "rate": {s: v.rate for s, v in run.sustained[m].items()},
                           "bound": {s: v.bound for s, v in run.sustained[m].items()},
                           "paged_over": {o: run.ratio(m, o) for o in SYSTEMS[1:]}} for m in THRESHOLDS],
            "batch": [{"read_at": name, "rate": run.rates[at], "by_system": {s: run.batch(s, at) for s in SYSTEMS},
                       "paged_over": {o: run.batch_ratio(o, at) for o in SYSTEMS[1:]}}
                      for name, at in (("paged_sustained", run.batch_at), ("highest", len(run.rates) - 1))],
        }
    return out
