"""Report section: where KV memory goes under pre-allocation and under paging (vLLM Fig. 2).

The paper's Fig. 2 averages, over its section 6.2 serving experiment (OPT-13B on an A100-40GB,
ShareGPT, Poisson arrivals), how much KV memory holds token states: 20.4% when each request
reserves the model's 2,048 positions (Orca Max), 26.8% when it reserves its prompt plus its output
rounded up to a power of two (Pow2), 38.2% when it reserves its true length (Oracle), each placed
by the buddy algorithm, and 96.3% with vLLM's paging; the rest of each bar is reservation,
internal fragmentation (memory reserved beyond a request's real length) and external
fragmentation & others (the buddy's rounding among them). We rebuild that experiment from parts that
run: the same KV memory (OPT-13B, 12 GiB -> 15,728 token slots, computed from its config), the
three reservations as real buddy allocators, the real KVCacheManager for paging, one
continuous-batching scheduler for all four, and the A100's bandwidth for step times. The headline
is a serving run: Poisson arrivals at 1.25 x the rate paging serves when saturated (measured and
stated below; the offered-load table shows why 1.25), so paging is loaded and the reservations,
which serve far less, are overloaded, with shares averaged over the whole run as the paper does. A
second view puts every request at t = 0 (saturated) and averages only while requests wait. Every
slot is classified by the paper's definitions and all four categories are compared with its bars.

Worked number (Max): 15,728 slots hold 7 reservations of 2,048 (14,336 slots); the other 1,392
(8.9%) can never hold an eighth, so they are external fragmentation whenever a request waits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from ..checks import int_at_least
from ..sim import sizing
from ..sim.baselines import ALLOCATORS, PAPER_CATEGORIES, make_allocator
from ..sim.costmodel import A100_40GB_HBM_BYTES_PER_S, A100_BF16_FLOPS, CostModel
from ..sim.metrics import Metrics, compute
from ..sim.request import Request
from ..sim.scheduler import SimResult, simulate
from .tables import Section, Table
from .options import ReportOptions

__all__ = ["section", "PAPER_TOKEN_SHARE", "PAPER_BARS", "paper_setup", "saturated", "load", "prepare", "Prepared",
           "fit_to_model", "run_one", "serving_rate", "spread_range", "workloads"]

# vLLM paper (SOSP'23) Fig. 2, share of KV memory holding token states, OPT-13B on ShareGPT.
PAPER_TOKEN_SHARE = {"Max": 20.4, "Pow2": 26.8, "Oracle": 38.2, "paged": 96.3}
# The same figure's four bars per allocator, in PAPER_CATEGORIES order (token states, reservation,
# internal fragmentation, external fragmentation & others); paging's bar gives token states only.
PAPER_BARS = {"Max": (20.4, 13.3, 57.3, 8.9), "Pow2": (26.8, 17.9, 13.6, 41.6), "Oracle": (38.2, 25.2, 0.0, 36.6),
              "paged": (96.3, None, None, None)}
PAPER_MODEL = "OPT-13B"  # the paper's Fig. 2 model
PAPER_KV_GIB = 12  # KV memory of OPT-13B on an A100-40GB (paper, Table 1: 15.7K token slots)
PAPER_MAX_LEN = 2048  # OPT's context, Orca Max's reservation
PAPER_GPU = "A100-40GB"
NAMES = {"max": "Max", "pow2": "Pow2", "oracle": "Oracle", "paged": "paged"}
EXACT = " (exact buddy, not the paper's)"
FULL_REQUESTS, QUICK_REQUESTS = 1000, 40
# The headline offered load, as a multiple of what paging serves when saturated. At 1.0 the queue
# is critically loaded: it empties at random and paging's token share swings with the seed (74-89%
# over seeds 0-2); from 1.25 on, requests wait through over 80% of the run and the share is on its
# plateau (88-93% for 1.25, 1.5 and 2 over the same seeds). The sweep table shows it on every run.
HEADLINE_LOAD = 1.25
SWEEP = (0.5, 1.0, 2.0)  # other offered loads shown, same unit
QUICK_SWEEP = (1.0,)
# The paper's four categories (ours), then what the fourth holds, split.
SHARE_COLUMNS = ["token states %", "reservation %", "internal frag %", "external frag & others %"]
PAPER_COLUMNS = ["paper token states %", "paper reservation %", "paper internal frag %",
                 "paper external frag & others %"]
DETAIL_COLUMNS = ["buddy rounding %", "stranded %", "free %"]
DETAIL_KEYS = ["buddy_rounding", "external_fragmentation", "free"]


def paper_setup(block_size: int = 16) -> tuple[int, CostModel]:
    """(num_blocks, cost model) of the paper's setup: OPT-13B with 12 GiB of KV at ``block_size``
    on an A100-40GB's bandwidth and FLOP/s.

    At block size 16: floor(12 x 2**30 / (819,200 x 16)) = 983 blocks = 15,728 slots.
    """
    block_size = int_at_least("block_size", block_size, 1, expected="a positive int")
    spec = sizing.get_model(PAPER_MODEL)
    cap = sizing.fit_blocks(sizing.kv_size(spec, block_size=block_size), kv_budget_gib=PAPER_KV_GIB)
    cost = CostModel.for_model(PAPER_MODEL, bandwidth=A100_40GB_HBM_BYTES_PER_S, peak_flops=A100_BF16_FLOPS)
    return cap.num_blocks, cost


def saturated(reqs: list[Request]) -> list[Request]:
    """The same requests, all arriving at t = 0 (a saturated server)."""
    return [replace(r, arrival=0.0) for r in reqs]


# ---- workloads under the model's limit --------------------------------------------------------


@dataclass(frozen=True)
class Prepared:
    """A workload fitted to the model's context, and what fitting it did (nothing is cut silently).

    ``read``: requests drawn or read; ``rejected``: trace requests whose prompt alone fills the
    context (left out: a server refuses them); ``stopped``: trace requests whose output would run
    past the context (generation stops there: output shortened); ``redrawn``: for a lognormal
    workload, the share of draws over the limit that were redrawn (None otherwise).
    """

    requests: list[Request]
    read: int
    rejected: int = 0
    stopped: int = 0
    redrawn: float | None = None


def fit_to_model(reqs: list[Request], max_len: int) -> tuple[list[Request], int, int]:
    """``(kept, rejected, stopped)``: what a server with a ``max_len`` context does with them. A
    prompt of ``max_len`` tokens or more leaves no room for one output token: the request is
    refused (left out). A request that fits but would generate past ``max_len`` stops there (its
    output shortened). Example at 2,048: prompt 3,000 -> refused; prompt 2,000 + output 100 ->
    output 48."""
    kept, rejected, stopped = [], 0, 0
    for r in reqs:
        if r.prompt_len >= max_len:
            rejected += 1
            continue
        if r.total_len > max_len:
            stopped += 1
            r = replace(r, output_len=max_len - r.prompt_len)
        kept.append(r)
    return kept, rejected, stopped


def prepare(source: str | Path, num_requests: int, seed: int, *, rate: float | None = None,
            log_sd: float | None = None, max_len: int = PAPER_MAX_LEN) -> Prepared:
    """A built-in workload or a trace file under ``max_len``; Poisson arrivals at ``rate`` per
    second, or every arrival at t = 0 (``rate=None``). Synthetic lengths are drawn under the limit
    (the draws over it are redrawn; for ShareGPT/Alpaca the lognormal is re-solved so the published
    means hold), trace requests go through :func:`fit_to_model`."""
    from ..sim.workloads import BUILTIN_WORKLOADS, LOGNORMAL_SPECS, load_workload, over_limit_share

    if isinstance(source, str) and source.lower() in BUILTIN_WORKLOADS:
        name = source.lower()
        reqs = load_workload(name, num_requests, seed, max_len=max_len, rate=rate, log_sd=log_sd)
        share = over_limit_share(name, max_len, log_sd) if name in LOGNORMAL_SPECS else None
        out = Prepared(reqs, num_requests, redrawn=share)
    else:
        raw = load_workload(source, num_requests, seed, rate=rate, log_sd=log_sd)
        kept, rejected, stopped = fit_to_model(raw, max_len)
        out = Prepared(kept, len(raw), rejected, stopped)
    if rate is None:
        out = replace(out, requests=saturated(out.requests))
    return out


def load(name_or_path, num_requests: int, seed: int, max_len: int = PAPER_MAX_LEN,
         log_sd: float | None = None) -> list[Request]:
    """:func:`prepare`'s requests with every arrival at t = 0 (a saturated server)."""
    return prepare(name_or_path, num_requests, seed, max_len=max_len, log_sd=log_sd).requests


def workloads(opts: ReportOptions) -> list[tuple[str, str, object]]:
    """``(key, label, name or path)`` of the section's workloads: ShareGPT-like (synthetic), the
    real Azure conversation trace (its quantile-matched synthetic twin when the file is absent),
    and ``opts.trace`` when given."""
    from ..sim.traces import trace_path

    out = [("sharegpt", "ShareGPT-like", "sharegpt")]
    azure = trace_path("azure-conv", opts.data_dir)
    out.append(("azure-conv", "Azure conv trace", azure) if azure else ("azure-conv", "Azure-conv-like", "azure-conv"))
    if opts.trace is not None:
        out.append(("trace", f"trace {Path(opts.trace).name}", opts.trace))
    return out


def spread_range(opts: ReportOptions) -> tuple[float, float] | None:
    """The log-sd range of the real traces' lengths (:func:`pagedkv.sim.workloads.log_sd_range`):
    the band the synthetic workloads' assumed spread is varied over. None without traces."""
    from ..sim.workloads import log_sd_range

    return log_sd_range(opts.data_dir)


# ---- runs ---------------------------------------------------------------------------------------


def run_one(reqs: list[Request], allocator: str, block_size: int = 16, max_len: int = PAPER_MAX_LEN,
            *, window: str = "saturated", **kw) -> tuple[SimResult, Metrics]:
    """One simulation on the paper's memory; the raw result and its metrics over ``window``
    (``"saturated"`` for a t = 0 run, ``"run"`` for a serving run). ``kw`` go to
    :func:`~pagedkv.sim.baselines.make_allocator` (``exact`` for reservations, paged options)."""
    over = sum(r.total_len > max_len for r in reqs)
    if over:  # the scheduler would clip them silently; the report counts them first (prepare)
        raise ValueError(f"{over} requests are longer than max_len {max_len}: fit them with prepare() or "
                         "fit_to_model(), which count what they do")
    num_blocks, cost = paper_setup(block_size)
    alloc = make_allocator(allocator, num_blocks, block_size, max_len, **kw)
    res = simulate(reqs, alloc, cost, max_len=max_len)
    return res, compute(res, window)


def _round3(x: float) -> float:
    return round(x, 2 - math.floor(math.log10(x)))


def paged_capacity(saturated_paged: Metrics) -> float:
    """What paging serves when saturated: requests finished over the makespan of the t = 0 run,
    rounded to 3 significant digits."""
    x = saturated_paged.throughput_rps
    if not x > 0:
        raise ValueError("the saturated paged run served nothing: no rate to choose")
    return _round3(x)


def serving_rate(saturated_paged: Metrics, load: float = HEADLINE_LOAD) -> float:
    """The arrival rate at ``load`` x :func:`paged_capacity` (3 significant digits, so the stated
    rate is the one run). At the headline's 1.25 paging is loaded through the run (requests wait
    over 80% of it) and the reservations, which serve far less, are overloaded."""
    return _round3(load * paged_capacity(saturated_paged))


def _pct(x: float) -> float:
    return round(100 * x, 1)


def _mean_live_len(res: SimResult) -> float:
    """Time-weighted mean length of a running sequence (KV read per step / batch)."""
    s = res.steps
    busy = s.tokens > 0
    return float((s.kv_read[busy] * s.dt[busy]).sum() / max((s.batch[busy] * s.dt[busy]).sum(), 1e-12))


CATEGORY_NAMES = dict(zip(PAPER_CATEGORIES, ("token states", "reservation", "internal frag",
                                              "external frag & others")))


def _gap(m: Metrics, name: str) -> str:
    """The largest gap between our four categories and the paper's bar for ``name``, in words."""
    paper = PAPER_BARS[name]
    gaps = [(abs(100 * m.paper_shares[k] - p), k) for k, p in zip(PAPER_CATEGORIES, paper) if p is not None]
    gap, key = max(gaps)
    return f"largest gap to the paper {gap:.1f} points ({CATEGORY_NAMES[key]})"


def _why(name: str, m: Metrics, res: SimResult, max_len: int, synthetic: bool, paper: bool) -> str:
    """One sentence on where the row differs from the paper's bar (``paper``: a ShareGPT row) and
    why, or (other workloads) what its waste is, with measured numbers."""
    sh = m.shares
    ours = {k: 100 * v for k, v in m.paper_shares.items()}
    live = _mean_live_len(res)
    if name.endswith(EXACT):
        return (f"An extra model, not the paper's: the buddy holds exactly the reservation (no rounding), "
                f"but each reservation still needs a free aligned 2^k block, so "
                f"{_pct(sh['external_fragmentation'])}% of memory is stranded instead.")
    gap = _gap(m, name) if paper else ""
    if name == "Max":
        k = res.capacity // max_len
        text = (f"{k} x {max_len:,} reservations fit and the other {res.capacity - k * max_len:,} slots never "
                f"hold one; live sequences average {live:.0f} tokens")
        if paper and synthetic:
            implied = PAPER_TOKEN_SHARE["Max"] / 100 * res.capacity / k
            text = f"{gap[0].upper() + gap[1:]}: {text} (the paper's 20.4% implies ~{implied:.0f})"
        return text + "."
    if name == "Pow2":
        text = (f"internal frag {ours['internal_fragmentation']:.1f}% is the output's rounding up to 2^k, "
                f"buddy rounding of prompt + that adds {_pct(sh['buddy_rounding'])}% and "
                f"{_pct(sh['external_fragmentation'])}% is stranded")
        if paper:
            text = (f"Differs most in internal frag ({ours['internal_fragmentation']:.1f}% vs 13.6%) and external "
                    f"& others ({ours['external_and_others']:.1f}% vs 41.6%): both are set by where lengths fall "
                    f"between powers of two, which ShareGPT's published means do not fix (ours are "
                    f"lognormal with those means); {text}")
        return text[0].upper() + text[1:] + "."
    if name == "Oracle":
        text = (f"it knows every length, so no internal fragmentation; external & others "
                f"{ours['external_and_others']:.1f}% is buddy rounding {_pct(sh['buddy_rounding'])}%, "
                f"stranded {_pct(sh['external_fragmentation'])}% and free {_pct(sh['free'])}%")
        if paper:
            text = f"{gap[0].upper() + gap[1:]}: {text} (paper 36.6%)"
        return text[0].upper() + text[1:] + "."
    bs = res.block_size
    text = (f"internal frag {_pct(sh['internal_fragmentation'])}% of memory is the last block's unused tail "
            f"(~(bs-1)/2 = {(bs - 1) / 2:.1f} slots per sequence, measured by the manager), its own category; "
            f"{_pct(sh['free'])}% is free: memory the requests present do not need")
    if paper:
        text = (f"Token states {ours['token_states']:.1f}% vs 96.3%: {text} (the serving run's ramp-up and "
                f"drain, the 1% admission watermark, room too small for the first request in the waiting queue)")
    return text[0].upper() + text[1:] + "."


@dataclass
class _Workload:
    """Every run of one workload: saturated and serving, and (ShareGPT) band and sweep runs."""

    key: str
    label: str
    synthetic: bool
    sat: Prepared
    srv: Prepared
    capacity: float  # requests/s paging serves when saturated
    rate: float  # the serving runs' arrival rate
    saturated: dict  # name -> (SimResult, Metrics)
    serving: dict
    band: dict  # name -> [token share at each log-sd], serving runs
    sat_band: dict  # the same, saturated runs
    band_rates: list  # the rate chosen at each log-sd (the same rule as the headline's)
    sweep: list  # (multiple of capacity, SimResult, Metrics), paged serving runs


def _run_all(reqs: list[Request], bs: int, window: str, names=ALLOCATORS, note=None, **kw) -> dict:
    """Every allocator on ``reqs``; ``note`` (when given) hears of paging's run, the slow one."""
    out = {}
    for a in names:
        if note is not None and a == "paged":
            note("paged")
        out[NAMES[a]] = run_one(reqs, a, bs, window=window, **kw)
    return out


def _workload(key: str, label: str, src, opts: ReportOptions, n: int, spread, sweep) -> _Workload | Prepared:
    """Every run of one workload; just its :class:`Prepared` when no request fits the context."""
    bs = opts.block_size
    synthetic = isinstance(src, str)
    opts.note(f"fig2, {label}: saturated runs (t = 0)")
    sat = prepare(src, n, opts.seed)
    if not sat.requests:
        return sat
    sat_runs = _run_all(sat.requests, bs, "saturated", note=lambda a: opts.note(f"fig2, {label}: saturated, {a}"))
    capacity = paged_capacity(sat_runs["paged"][1])
    rate = serving_rate(sat_runs["paged"][1])
    opts.note(f"fig2, {label}: serving runs at {rate:g} req/s")
    srv = prepare(src, n, opts.seed, rate=rate)
    srv_runs = _run_all(srv.requests, bs, "run", note=lambda a: opts.note(f"fig2, {label}: serving, {a}"))
    band, sat_band, band_rates, sweep_runs = {}, {}, [], []
    if key == "sharegpt":
        for a in ("pow2", "oracle"):
            srv_runs[NAMES[a] + EXACT] = run_one(srv.requests, a, bs, window="run", exact=True)
        if spread is not None:
            opts.note(f"fig2, {label}: length-spread band ({spread[0]:.2f} and {spread[1]:.2f})")
            for sd in spread:  # the whole procedure again, its rate included
                opts.note(f"fig2, {label}: band at spread {sd:.2f}, saturated")
                sat_sd = prepare(src, n, opts.seed, log_sd=sd).requests
                runs_sd = _run_all(sat_sd, bs, "saturated")
                for name, (_, m) in runs_sd.items():
                    sat_band.setdefault(name, []).append(m.token_share)
                rate_sd = serving_rate(runs_sd["paged"][1])
                band_rates.append(rate_sd)
                opts.note(f"fig2, {label}: band at spread {sd:.2f}, serving")
                reqs = prepare(src, n, opts.seed, rate=rate_sd, log_sd=sd).requests
                for name, (_, m) in _run_all(reqs, bs, "run").items():
                    band.setdefault(name, []).append(m.token_share)
        for f in sweep:
            opts.note(f"fig2, {label}: paged at {f:g} x {capacity:g} req/s")
            reqs = prepare(src, n, opts.seed, rate=_round3(capacity * f)).requests
            sweep_runs.append((f, *run_one(reqs, "paged", bs, window="run")))
    return _Workload(key, label, synthetic, sat, srv, capacity, rate, sat_runs, srv_runs, band, sat_band,
                     band_rates, sweep_runs)


# ---- tables -------------------------------------------------------------------------------------


def _breakdown_table(title: str, name: str, with_band: bool) -> Table:
    """A Fig. 2 table in the paper's four categories, ours beside the paper's, then what the fourth
    holds; ``with_band`` marks the headline one (exact-buddy rows, footnote, title)."""
    cols = (["run"] + [c for pair in zip(SHARE_COLUMNS, PAPER_COLUMNS) for c in pair] + DETAIL_COLUMNS
            + ["band lo %", "band hi %", "where and why ours differs"])
    plot = {"name": name, "x": "run", "y": SHARE_COLUMNS, "kind": "stacked", "paper_stack": PAPER_COLUMNS,
            "paper_label": "the paper's bar (vLLM Fig. 2), same colours", "ylabel": "% of KV memory (time-weighted)",
            "xlabel": "", "legend": dict(zip(SHARE_COLUMNS, ("token states", "reservation", "internal fragmentation",
                                                             "external fragmentation & others")))}
    plot["band"] = {SHARE_COLUMNS[0]: ["band lo %", "band hi %"]}
    plot["band_label"] = "token states over the length-spread band"
    if with_band:
        plot["label_replace"] = [[EXACT, " exact*"]]
        plot["footnote"] = ("* exact: reservations placed by a buddy allocator without the buddy's rounding to a power of "
                            "two; an extra model, not the paper's")
    return Table(title, cols, plot=plot)


def _add_rows(t: Table, wl: _Workload, runs: dict, band: dict) -> None:
    for name, (res, m) in runs.items():
        paper = PAPER_BARS.get(name) if wl.key == "sharegpt" else None
        p = m.paper_shares
        row = [f"{wl.label} / {name}"]
        for i, k in enumerate(PAPER_CATEGORIES):
            row += [_pct(p[k]), paper[i] if paper else None]
        row += [_pct(m.shares[k]) for k in DETAIL_KEYS]
        vals = band.get(name, [])
        row += [_pct(min(vals + [m.token_share])), _pct(max(vals + [m.token_share]))] if vals else [None, None]
        t.add(*row, _why(name, m, res, PAPER_MAX_LEN, wl.synthetic, paper is not None))


def _cost_table(wls: list[_Workload], cm: CostModel) -> Table:
    t = Table(
        f"What the waste costs: batch and throughput when saturated (t = 0), step times modelled for "
        f"{PAPER_MODEL} on an {PAPER_GPU}",
        ["run", "avg batch", "requests/s (modelled)", "output tokens/s (modelled)", "x Max", "preemptions"],
        plot={"name": "fig2_throughput", "x": "run", "y": ["requests/s (modelled)"], "kind": "bar",
              "annotate": "avg batch", "annotate_format": "batch {}",
              "ylabel": "requests/s served when saturated (modelled)", "legend": {"requests/s (modelled)":
                                                                               "requests/s, modelled step times"},
              "xlabel": "", "title": f"Requests/s each allocator serves when saturated, step times modelled for "
                                     f"{PAPER_MODEL} on an {PAPER_GPU} (label: average batch, sequences per step)"},
    )
    for wl in wls:
        base = wl.saturated["Max"][1].throughput_rps
        for name, (_, m) in wl.saturated.items():
            t.add(f"{wl.label} / {name}", round(m.avg_batch, 1), round(m.throughput_rps, 3),
                  round(m.tokens_per_s, 1), round(m.throughput_rps / base, 2) if base else None,
                  m.preemptions)
    t.notes.append(f"Cost model: {cm.describe()} (an {PAPER_GPU}). Requests/s when saturated is each "
                   "allocator's capacity: what it serves with every request waiting.")
    return t


def _waiting_share(res: SimResult) -> float:
    """Share of the run's busy time during which a request waited for memory or a slot."""
    s = res.steps
    busy = ~s.idle
    total = float(s.dt[busy].sum())
    return float(s.dt[busy & s.waiting].sum()) / total if total > 0 else 0.0


def _sweep_table(wl: _Workload) -> Table:
    t = Table(
        f"Offered load: paged on {wl.label}, Poisson arrivals at multiples of its saturated "
        f"throughput ({wl.capacity:g} req/s); shares over the serving run",
        ["rate req/s", "x capacity", "token states %", "free %", "time with a queue %",
         "requests/s served", "preemptions", "headline %"],
        plot={"name": "fig2_load", "x": "rate req/s", "y": ["token states %", "free %"],
              "y2": ["time with a queue %"], "ylabel2": "% of the run's busy time with a request waiting",
              "ymax2": 100,
              "legend": {"token states %": "KV memory holding token states",
                         "free %": "KV memory free",
                         "time with a queue %": "time with a request waiting"},
              "kind": "line", "ymin": 0, "ymax": 100, "ylabel": "% of KV memory (time-weighted)",
              "xlabel": "Poisson arrival rate (requests/s)", "marker": "headline %",
              "marker_label": "token states in the headline run",
              "vline": [wl.capacity, "paging's capacity, req/s saturated"],
              "title": f"Paged on {wl.label}: KV memory use and queueing against the offered load"},
    )
    rows = [(f, res, m) for f, res, m in wl.sweep] + [(HEADLINE_LOAD, *wl.serving["paged"])]
    for f, res, m in sorted(rows, key=lambda r: r[0]):
        t.add(_round3(wl.capacity * f) if f != HEADLINE_LOAD else wl.rate, f, _pct(m.shares["token_states"]),
              _pct(m.shares["free"]), _pct(_waiting_share(res)), round(m.throughput_rps, 3), m.preemptions,
              _pct(m.shares["token_states"]) if f == HEADLINE_LOAD else None)
    t.notes.append(f"Headline: {HEADLINE_LOAD:g} x capacity. At 1 x the queue is critically loaded and "
                   "empties at random, so the share swings with the seed; from 1.25 x requests wait "
                   "through most of the run and the share is on its plateau. Below capacity paged "
                   "memory is partly idle (free), not wasted.")
    return t


def _fit_note(wl: _Workload) -> str:
    p = wl.srv
    if wl.key == "sharegpt" or p.redrawn is not None:
        share = f"{100 * p.redrawn:.1f}% of draws" if p.redrawn is not None else "the draws"
        return (f"{wl.label}: synthetic lengths; {share} over {PAPER_MAX_LEN:,} tokens are redrawn (as "
                f"vLLM's benchmark drops ShareGPT pairs over 2,048), the lognormal re-solved so the "
                f"published means hold; {len(p.requests):,} requests served.")
    if p.read == len(p.requests) and not p.stopped:
        return f"{wl.label}: all {p.read:,} requests fit the {PAPER_MAX_LEN:,}-token context."
    return (f"{wl.label}: of the first {p.read:,} requests, {p.rejected:,} have a prompt of "
            f"{PAPER_MAX_LEN:,} tokens or more and are left out (a {PAPER_MAX_LEN:,}-token model refuses "
            f"them); {p.stopped:,} would generate past {PAPER_MAX_LEN:,} and stop there (output "
            f"shortened); {len(p.requests):,} served.")


def _regime_text(wl: _Workload, quick: bool) -> str:
    srv, sat = wl.serving, wl.saturated
    pg_srv, pg_sat = srv["paged"][1], sat["paged"][1]
    caps = ", ".join(f"{n} {sat[n][1].throughput_rps:.2f}" for n in ("Max", "Pow2", "Oracle"))
    text = (
        f"Serving run vs saturated ({wl.label}): the headline rate, {wl.rate:g} req/s, is "
        f"{HEADLINE_LOAD:g} x what paging serves when saturated ({wl.capacity:g} req/s); requests wait "
        f"through {_pct(_waiting_share(wl.serving['paged'][0]))}% of the paged run. Averaged over the "
        f"whole run, ramp-up and final drain included, {_pct(pg_srv.shares['free'])}% of memory is free "
        f"and {_pct(pg_srv.token_share)}% holds token states; with every request at t = 0, averaged while "
        f"requests wait, paging holds {_pct(pg_sat.token_share)}%. The reservations serve at most {caps} "
        f"req/s, so at {wl.rate:g} req/s they are overloaded: Max holds {_pct(srv['Max'][1].token_share)}% "
        f"in the serving run and {_pct(sat['Max'][1].token_share)}% saturated."
    )
    if quick:
        text = (f"--quick: {len(wl.srv.requests):,} requests per workload are too few to load the server; "
                "these numbers are a smoke test, not the paper's regime. ") + text
    return text


def section(opts: ReportOptions) -> Section:
    """Fig. 2 on ShareGPT-like and Azure-conversation workloads, serving run and saturated."""
    if not isinstance(opts, ReportOptions):
        raise ValueError(f"opts must be ReportOptions, got {type(opts).__name__}")
    n = QUICK_REQUESTS if opts.quick else FULL_REQUESTS
    spread = spread_range(opts)
    sweep = QUICK_SWEEP if opts.quick else SWEEP
    wls, empty = [], []
    for key, label, src in workloads(opts):
        wl = _workload(key, label, src, opts, n, spread, sweep)
        if isinstance(wl, Prepared):
            empty.append(f"{label}: none of its first {wl.read:,} requests fits the {PAPER_MAX_LEN:,}-token "
                         f"context ({wl.rejected:,} prompts of {PAPER_MAX_LEN:,} tokens or more): left out.")
        else:
            wls.append(wl)
    head = wls[0]
    num_blocks, cm = paper_setup(opts.block_size)
    srv_t = _breakdown_table(
        f"Fig. 2, serving run: KV memory in the paper's four categories, ours beside the paper's (% of "
        f"all KV memory, time-weighted over the run; Poisson arrivals at {head.rate:g} req/s on "
        f"ShareGPT-like)", "fig2_breakdown", with_band=True)
    srv_t.plot["title"] = (f"KV memory by the paper's categories, serving run (ShareGPT-like at {head.rate:g} "
                           f"req/s, OPT-13B, 12 GiB): ours (wide bars) against vLLM Fig. 2 (narrow bars)")
    sat_t = _breakdown_table(
        "Fig. 2, second view: saturated, every request at t = 0 (time-weighted while requests wait)",
        "fig2_saturated", with_band=False)
    sat_t.plot["title"] = ("KV memory by the paper's categories when every request arrives at t = 0 "
                           "(averaged while requests wait): ours (wide bars) against vLLM Fig. 2 (narrow bars)")
    for wl in wls:
        _add_rows(srv_t, wl, wl.serving, wl.band)
        _add_rows(sat_t, wl, wl.saturated, wl.sat_band)
    memory = (f"Memory: {PAPER_MODEL}, {PAPER_KV_GIB} GiB of KV = {num_blocks * opts.block_size:,} token slots "
              f"(block size {opts.block_size}), context {PAPER_MAX_LEN:,}; {n:,} requests per workload.")
    rates = "; ".join(f"{wl.label} {wl.rate:g} req/s ({HEADLINE_LOAD:g} x {wl.capacity:g})" for wl in wls)
    srv_t.notes += [
        memory,
        f"Arrival rate per workload = {HEADLINE_LOAD:g} x what paging serves when saturated (its t = 0 "
        f"run), so paging is loaded and the reservations overloaded (see the offered-load table): {rates}.",
        "Baselines (vLLM paper 6.1): Max reserves 2,048; Pow2 the prompt + the output rounded up to a "
        "power of two; Oracle the prompt + the true output; each placed by a classic buddy allocator "
        "(reservations held as powers of two, the paper's assumption). Rows marked exact buddy place "
        "without that rounding: an extra model, not the paper's.",
        "Categories (the paper's, section 2.3): token states; reservation = slots a request will "
        "fill before it finishes; internal frag = slots reserved beyond the request's real final "
        "length (Oracle, knowing every length, has none; for paging, the unused tail of each last "
        "block, measured by the manager); external frag & others = everything else: the buddy's "
        "rounding of a reservation up to a power of two, free slots stranded in blocks too small "
        "for the waiting request (stranded), and free memory. The last three columns split it.",
        _band_note(spread, head),
        "Paper columns: vLLM paper Fig. 2 (ShareGPT, OPT-13B, read from its bars); it has no Azure "
        "bars, and for vLLM it gives the token states share only.",
    ]
    sat_t.notes += ["Memory, band (the same reruns at the two spreads of log length), categories and "
                    "columns as in the serving-run table."]
    tables = [srv_t, sat_t, _cost_table(wls, cm)]
    if head.sweep:
        tables.append(_sweep_table(head))
    sec = Section(
        key="fig2",
        heading="Memory waste: pre-allocation vs paging (vLLM Fig. 2)",
        intro=(__doc__ or "").split("\n\n")[1].replace("\n", " "),
        tables=tables,
        setup="OPT-13B's memory on an A100-40GB (the paper's); step times modelled",
        text=[_regime_text(head, opts.quick),
              "Requests over the model's limit: " + " ".join([_fit_note(wl) for wl in wls] + empty)],
    )
    sec.data.update(_data(wls, spread, n))
    return sec


def _band_note(spread, head: _Workload) -> str:
    if spread is None or not head.band:
        return "Band: no public trace found to measure the length spread on; the band is left out."
    from ..sim.workloads import LOGNORMAL_SPECS

    rates = " and ".join(f"{r:g}" for r in head.band_rates)
    assumed = LOGNORMAL_SPECS["sharegpt"].output_sigma
    return (f"Band: token states % from the whole procedure rerun with the ShareGPT-like spread of "
            f"log length (its standard deviation, the lognormal's spread) of "
            f"prompt and output lengths set to {spread[0]:.2f} and {spread[1]:.2f} (assumed {assumed:g}; rates "
            f"{rates} req/s by the same rule), the smallest and largest spread of any length in the "
            "public traces (Azure conv, Azure code, Mooncake), since the paper publishes only "
            "ShareGPT's means. Same seed.")


def _shares(m: Metrics) -> dict:
    return {"shares": m.shares, "paper_categories": m.paper_shares, "avg_batch": m.avg_batch, "throughput_rps": m.throughput_rps,
            "internal_fragmentation_ratio": m.internal_fragmentation_ratio, "preemptions": m.preemptions,
            "window": m.window}


def _data(wls: list[_Workload], spread, n: int) -> dict:
    out = {"paper_token_share": PAPER_TOKEN_SHARE, "num_requests": n, "model": PAPER_MODEL,
           "paper_bars": {k: dict(zip(PAPER_CATEGORIES, v)) for k, v in PAPER_BARS.items()},
           "log_sd_range": list(spread) if spread else None, "workloads": {}}
    for wl in wls:
        out["workloads"][wl.label] = {
            "rate_rps": wl.rate, "paged_capacity_rps": wl.capacity, "headline_load": HEADLINE_LOAD,
            "served": len(wl.srv.requests), "read": wl.srv.read, "rejected": wl.srv.rejected,
            "stopped": wl.srv.stopped, "redrawn_share": wl.srv.redrawn,
            "serving": {name: _shares(m) for name, (_, m) in wl.serving.items()},
            "saturated": {name: _shares(m) for name, (_, m) in wl.saturated.items()},
            "band_rates_rps": wl.band_rates,
            "band_token_share": {name: [min(v + [wl.serving[name][1].token_share]),
                                        max(v + [wl.serving[name][1].token_share])]
                                 for name, v in wl.band.items()},
            "saturated_band_token_share": {name: [min(v + [wl.saturated[name][1].token_share]),
                                                  max(v + [wl.saturated[name][1].token_share])]
                                           for name, v in wl.sat_band.items()},
            "sweep": [{"x_capacity": f, "token_share": m.token_share, "free": m.shares["free"],
                       "waiting": _waiting_share(res)} for f, res, m in wl.sweep],
        }
    return out
