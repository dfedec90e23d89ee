"""Report section: where the serving scheduler livelocks, and the guards that stop it.

Every run here is the real scheduler (:func:`pagedkv.sim.scheduler.simulate`) driving the real
:class:`~pagedkv.KVCacheManager` through :class:`~pagedkv.sim.samples.SampleAllocator`, with
recompute preemption, prefix caching off (as in vLLM PR #44594's benchmark, so that a recomputed
token is really recomputed) and step times from the cost model of ``opts.model`` on an H100.

Three tables:

1. **Thrashing and the watermark.** Requests with long outputs all arrive at once on a cache
   that holds a fraction of them, the regime of vLLM PR #44594 (input ~1,000 / output ~5,000
   tokens there; about 200 / 800 here). Preemptions, the most of one request, recomputed
   tokens and tail latency for vLLM v1's defaults, without the no-admit rule, and with an
   admission watermark of 2, 5 and 10%.
2. **The failure modes, each with its guard off and on**, on workloads built to show them: a
   request longer than the cache; 8 samples that together outgrow it; fresh forks as victims
   (they free nothing); two 2-sample groups preempted oldest first (each restart loses the
   group's tokens, and each needs more than two thirds of the cache, so neither ever finishes).
3. **Every guard on and off**, one at a time and all together, on one mixed workload that
   thrashes and livelocks without them (see :func:`mixed_workload`).

A run that stops progressing is cut by the scheduler's stall detector and shown as a livelock;
percentiles count every request that was not dropped, one that never finished as infinitely
late ("-").
"""
from __future__ import annotations

import numpy as np

from ..sim.costmodel import CostModel
from ..sim.metrics import tail_latency
from ..sim.request import Request
from ..sim.samples import SampleAllocator, split_samples
from ..sim.scheduler import GUARD_NAMES, Guards, SimResult, simulate
from .tables import Section, Table
from .options import ReportOptions

__all__ = ["section", "thrash_workload", "mixed_workload", "futile_case", "pingpong_case",
           "never_fits_case", "serve", "WATERMARKS"]

KEY, HEADING = "livelock", "Where the scheduler livelocks"
WATERMARKS = (0.02, 0.05, 0.10)
PR_44594 = {"off": 1065, 0.02: 400, 0.05: 187, 0.10: 168}  # their preemptions, for comparison
LABELS = {"newest_first": "newest first", "no_admit_after_preempt": "hold admissions",
          "fit_check": "fit check", "skip_unfreeing": "skip victims freeing nothing", "watermark": "watermark 5%"}


def _req(rid: str, key: int, prompt: int, output: int, arrival: float = 0.0, n: int = 1) -> Request:
    return Request(rid, arrival, ((key, prompt),), output, n=n)


def thrash_workload(num: int, seed: int, long_output: bool = True) -> list[Request]:
    """``num`` single requests at t = 0, prompts uniform in [100, 300) tokens, outputs in
    [400, 1,200) (``long_output``) or [200, 600): long outputs that a saturated cache preempts."""
    rng = np.random.default_rng([seed, 44594])
    lo, hi = (400, 1200) if long_output else (200, 600)
    return [_req(f"r{i}", 10_000 + i, int(rng.integers(100, 300)), int(rng.integers(lo, hi)))
            for i in range(num)]


def mixed_workload(num: int, seed: int, cache_slots: int) -> list[Request]:
    """The ablation workload: ``num`` requests at t = 0, each at random a single request
    (40%), a parallel-sampling request of 8 samples served as 8 requests (30%; vLLM v1: fresh
    samples are forks that free nothing) or of 4 samples run as one group (30%; vLLM v0: a
    restart loses all its tokens); prompts uniform in [20, 120), outputs in [50, 250) tokens.
    A quarter of the way in, one more request: 8 samples of 200 + ``cache_slots // 6`` tokens,
    which fit one by one but not together."""
    rng = np.random.default_rng([seed, 9])
    reqs: list[Request] = []
    for i in range(num):
        kind = rng.choice(3, p=[0.4, 0.3, 0.3])
        prompt, output = int(rng.integers(20, 120)), int(rng.integers(50, 250))
        if kind == 0:
            reqs.append(_req(f"s{i}", 1000 + i, prompt, output))
        elif kind == 1:
            reqs += split_samples([_req(f"g{i}", 1000 + i, prompt, output, n=8)])
        else:
            reqs.append(_req(f"k{i}", 1000 + i, prompt, output, n=4))
    reqs.insert(len(reqs) // 4, _req("wide", 7, 200, cache_slots // 6, n=8))
    return reqs


def futile_case(bs: int) -> tuple[list[Request], int]:
    """(requests, cache blocks): A (4 full blocks, so its next token needs a block), B (12
    blocks, last one partial) and 8 fresh samples of a 2.5-block prompt (all shared) fill the
    cache exactly; the first step needs 1 + 7 blocks (A's, and 7 copies of the shared partial
    block). Newest first, the 7 forks go one by one, each freeing nothing, then their parent;
    skipping victims that free nothing, B alone goes and frees 12."""
    reqs = [_req("A", 1, 4 * bs, 40), _req("B", 2, 12 * bs - 2, 40)]
    reqs += split_samples([_req("G", 3, 2 * bs + bs // 2, 40, n=8)])
    return reqs, 4 + 12 + 3


def pingpong_case(bs: int) -> tuple[list[Request], int]:
    """(requests, cache blocks): two 2-sample groups of a 1-block prompt and 14 blocks of output
    each (29 blocks at the end) on 36 blocks. Preempting the oldest restarts the group that got
    furthest; the two take turns and neither reaches its end (each needs more than two thirds of
    the cache: 29 > (2 x 36 - 1) / 3)."""
    return [_req(f"k{i}", 10 + i, bs, 14 * bs, n=2) for i in range(2)], 36


def never_fits_case(bs: int, samples: bool) -> tuple[list[Request], int]:
    """(requests, cache blocks): 24 blocks; first a request that can never fit (a single one of
    2 + 30 blocks, or 8 samples of 2.5 + 12 blocks each, which fit one by one but not
    together), then three small requests arriving 2 s later. The single one holds the whole
    cache by then and blocks them for ever; the group restarts from its prompt each time and
    lets them pass, but never ends."""
    head = (_req("wide", 9, 2 * bs + bs // 2, 12 * bs, n=8) if samples else _req("long", 9, 2 * bs, 30 * bs))
    return [head] + [_req(f"s{i}", 20 + i, 2 * bs, 3 * bs, arrival=2.0) for i in range(3)], 24


def serve(reqs: list[Request], num_blocks: int, bs: int, guards: Guards, cost: CostModel) -> SimResult | str:
    """One run on a fresh cache (``max_len`` the longest request: these workloads are built to
    their lengths, none is clipped); a configuration the fit check refuses returns its message."""
    alloc = SampleAllocator(num_blocks, bs, enable_prefix_caching=False)
    max_len = max(r.total_len for r in reqs)
    try:
        return simulate(reqs, alloc, cost, max_len=max_len, guards=guards, on_livelock="return")
    except ValueError as e:
        return str(e)


def _q(value: float, digits: int = 2) -> float | None:
    """A percentile cell: None ("-") when it is infinite (requests that never finished)."""
    return None if not np.isfinite(value) else round(value, digits)


def _outcome(res: SimResult | str) -> str:
    if isinstance(res, str):
        return "refused at start-up"
    if not res.completed:
        return f"livelock, {res.finished}/{res.num_requests} done"
    n = len(res.dropped_ids)
    dropped = f", {n} request{'s' if n > 1 else ''} dropped (could never fit)" if n else ""
    return f"completed{dropped}"


def _most(res: SimResult) -> int:
    return int(res.requests.preemptions.max()) if res.requests is not None and len(res.requests.ids) else 0


# ---- table 1: thrashing and the watermark


def _thrash_table(opts: ReportOptions, cost: CostModel) -> tuple[Table, dict]:
    bs = opts.block_size
    num, slots = (16, 1600) if opts.quick else (64, 4800)
    reqs = thrash_workload(num, opts.seed, long_output=not opts.quick)
    blocks = slots // bs
    table = Table(
        title=f"(a) thrashing: {num} long-output requests at t = 0 on {blocks:,} blocks of {bs}",
        columns=["guards", "preemptions", "most of one", "preempted 2+ times", "recomputed tokens",
                 "output tokens/s", "TTFT p99 s", "latency p50 s", "latency p99 s"],
        plot={"name": "livelock_thrashing", "x": "guards", "y": ["preemptions"], "kind": "bar",
              "ylabel": "preemptions over the run (count)", "xlabel": "scheduler guards",
              "legend": {"preemptions": "preemptions (recompute)"},
              "title": f"Recompute thrashing: preemptions of {num} long-output requests on {blocks:,} "
                       f"blocks of {bs}, by admission guard"},
    )
    rows = [("vLLM v1 (no watermark)", Guards()), ("vLLM v1, admissions not held after a preemption",
                                             Guards(no_admit_after_preempt=False))]
    rows += [(f"watermark {w:.0%}", Guards(watermark=w)) for w in WATERMARKS]
    data = {}
    for label, guards in rows:
        res = serve(reqs, blocks, bs, guards, cost)
        lat = tail_latency(res)
        table.add(label, res.preemptions, _most(res), int((res.requests.preemptions >= 2).sum()),
                  res.recomputed_tokens, round(res.output_tokens / res.makespan, 1), _q(lat["ttft_p99"]),
                  _q(lat["latency_p50"]), _q(lat["latency_p99"]))
        data[label] = {"preemptions": res.preemptions, "recomputed_tokens": res.recomputed_tokens,
                       "most_of_one": _most(res), "completed": res.completed}
    p99 = [row[-1] for row in table.rows if row[-1] is not None]
    rates = table.column("output tokens/s")
    table.notes.append(
        f"Latency p99 spans {min(p99):.2f}-{max(p99):.2f} s and throughput {min(rates):,.0f}-{max(rates):,.0f} "
        "output tokens/s across these rows: under the cost model a recomputed prompt is compute-bound and "
        "cheap next to the memory-bound decode steps, so what the guards save here is preemptions "
        "and recomputed tokens.")
    prompts = [r.prompt_len for r in reqs]
    outputs = [r.output_len for r in reqs]
    table.notes.append(
        f"Workload: prompts {min(prompts)}-{max(prompts)} (mean {np.mean(prompts):.0f}) and outputs "
        f"{min(outputs)}-{max(outputs)} (mean {np.mean(outputs):.0f}) tokens, uniform, seed {opts.seed}; "
        f"all {num} need {sum(-(-r.total_len // bs) for r in reqs):,} blocks at their ends, the cache "
        f"holds {blocks:,}. Recompute preemption, prefix caching off.")
    table.notes.append(
        "vLLM PR #44594 (Qwen2.5-7B on a GB200, 16 GiB of KV, input ~1,000 / output ~5,000 tokens, "
        f"their measurement) counted {PR_44594['off']:,} preemptions without a watermark, "
        f"{PR_44594[0.02]} at 2%, {PR_44594[0.05]} at 5%, {PR_44594[0.10]} at 10%: the same direction "
        "as ours, on a far longer run.")
    return table, data


# ---- table 2: each failure mode with its guard off and on


def _mode_runs(opts: ReportOptions, cost: CostModel) -> list[tuple[str, str, SimResult | str]]:
    bs = opts.block_size
    out = []
    for case, guard, build in (
        ("(b) request longer than the cache", "fit_check", lambda: never_fits_case(bs, samples=False)),
        ("(b) 8 samples outgrowing the cache", "fit_check", lambda: never_fits_case(bs, samples=True)),
        ("(c) fresh forks as victims", "skip_unfreeing", lambda: futile_case(bs)),
        ("(d) oldest first, 2-sample groups", "newest_first", lambda: pingpong_case(bs)),
    ):
        reqs, blocks = build()
        for on in (False, True):
            guards = Guards().switched(guard, on)
            out.append((case, f"{LABELS[guard]} {'on' if on else 'off'}", serve(reqs, blocks, bs, guards, cost)))
    return out


def _modes_table(opts: ReportOptions, cost: CostModel) -> tuple[Table, dict, list[str]]:
    table = Table(
        title="(b)-(d) failure modes on constructed workloads, each with its guard off and on "
              "(other guards at vLLM v1's defaults)",
        columns=["case", "guard", "iterations", "preemptions", "victims freeing nothing", "most of one",
                 "recomputed tokens", "discarded tokens", "outcome"],
    )
    data, refusals = {}, []
    for case, guard, res in _mode_runs(opts, cost):
        if isinstance(res, str):
            table.add(case, guard, None, None, None, None, None, None, _outcome(res))
            refusals.append(res)
        else:
            table.add(case, guard, res.iterations, res.preemptions, res.futile_preemptions, _most(res),
                      res.recomputed_tokens, res.discarded_tokens, _outcome(res))
        data[f"{case} | {guard}"] = _outcome(res)
    table.notes.append(
        "victims freeing nothing: preempted requests whose blocks were all shared, so no block came free; discarded: generated tokens "
        "thrown away by restarting a multi-sample group; a livelock is cut after twice the "
        "longest output plus 64 iterations without progress (no request finished, was dropped, "
        "was first admitted or got further than ever).")
    table.notes += [f"fit check on refuses: {msg}" for msg in refusals]
    return table, data, refusals


# ---- table 3: every guard on and off, on the mixed workload


def _ablation(opts: ReportOptions) -> list[tuple[str, Guards]]:
    rows = [("all on", Guards.all_on()), ("all off", Guards.all_off())]
    rows += [(f"all on but {LABELS[g]}", Guards.all_on().switched(g, False)) for g in GUARD_NAMES]
    if not opts.quick:  # each guard alone: the slow rows (most livelock), left out of --quick
        rows += [(f"only {LABELS[g]}", Guards.all_off().switched(g, True)) for g in GUARD_NAMES]
    return rows


def _ablation_table(opts: ReportOptions, cost: CostModel) -> tuple[Table, dict]:
    bs = opts.block_size
    num, slots = (8, 1000) if opts.quick else (24, 1600)
    reqs = mixed_workload(num, opts.seed, slots)
    blocks = slots // bs
    table = Table(
        title=f"every guard on and off: {len(reqs)} requests (mixed workload, seed {opts.seed}) "
              f"on {blocks:,} blocks of {bs}",
        columns=["guards", "preemptions", "victims freeing nothing", "recomputed tokens", "discarded tokens",
                 "latency p50 s", "latency p90 s", "latency p99 s", "TTFT p99 s", "finished", "outcome"],
        plot={"name": "livelock_guards", "x": "guards", "y": ["preemptions"], "kind": "bar",
              "ylabel": "preemptions over the run (count)", "annotate": "finished",
              "xlabel": "guard setting",
              "highlight": {"column": "outcome", "prefix": "livelock", "colour": "#d62728",
                            "label": "livelocked run (cut; preemptions until the cut)",
                            "other": "completed run"},
              "title": f"Preemptions with each scheduler guard on and off ({len(reqs)} requests on "
                       f"{blocks:,} blocks of {bs}); requests finished above each bar"},
    )
    data = {}
    for label, guards in _ablation(opts):
        res = serve(reqs, blocks, bs, guards, cost)
        lat = tail_latency(res)
        table.add(label, res.preemptions, res.futile_preemptions, res.recomputed_tokens,
                  res.discarded_tokens, _q(lat["latency_p50"]), _q(lat["latency_p90"]),
                  _q(lat["latency_p99"]), _q(lat["ttft_p99"]), f"{res.finished}/{res.num_requests}",
                  _outcome(res))
        data[label] = {"preemptions": res.preemptions, "futile": res.futile_preemptions,
                       "recomputed_tokens": res.recomputed_tokens, "latency_p99": _q(lat["latency_p99"]),
                       "completed": res.completed, "iterations": res.iterations}
    split = sum("/" in r.req_id for r in reqs)
    table.notes.append(
        f"Mixed workload: {sum(r.req_id.startswith('s') for r in reqs)} single requests, "
        f"{split // 8} parallel-sampling requests of 8 split into {split} requests, "
        f"{sum(r.req_id.startswith('k') for r in reqs)} groups of 4 samples, all at t = 0, prompts 20-119 "
        f"and outputs 50-249 tokens, plus one 8-sample group of 200 + {slots // 6} tokens that fits one "
        "sample at a time but not all 8 together.")
    table.notes.append(_ablation_summary(data))
    table.notes.append(
        "Guards: newest first (preempt the most recently admitted request), hold admissions (a step "
        "that preempted admits no waiting request), fit check (refuse at start-up a request the "
        "whole cache cannot hold), skip victims freeing nothing (pass over a victim whose blocks are all shared, "
        "as freeing it frees nothing) and a watermark (admit only while 5% of blocks stay free). "
        "Newest first, hold admissions and fit check are vLLM v1's defaults; skipping victims that free nothing and the "
        "watermark are off in vLLM v1 (v0 kept a 1% watermark).")
    return table, data


def _ablation_summary(data: dict) -> str:
    """One sentence on what each guard did in the ablation, read from its rows."""
    on = data["all on"]
    locked = [LABELS[g] for g in GUARD_NAMES if not data[f"all on but {LABELS[g]}"]["completed"]]
    alone = [LABELS[g] for g in GUARD_NAMES if data.get(f"only {LABELS[g]}", {}).get("completed")]
    tried = any(f"only {LABELS[g]}" in data for g in GUARD_NAMES)
    more = [f"{LABELS[g]} {on['preemptions']} -> {data[f'all on but {LABELS[g]}']['preemptions']}"
            for g in GUARD_NAMES if data[f"all on but {LABELS[g]}"]["completed"]]
    return (f"All on: {'completed' if on['completed'] else 'livelock'}, {on['preemptions']} preemptions. "
            f"Turning off {' or '.join(locked) or 'no single guard'} livelocks the run; preemptions with "
            f"one guard off ({', '.join(more)}); "
            + (f"{'no guard alone completes it' if not alone else 'alone, ' + ' or '.join(alone) + ' completes it'}."
               if tried else "each guard alone: in the full report."))


def section(opts: ReportOptions) -> Section:
    if not isinstance(opts, ReportOptions):
        raise ValueError(f"opts must be ReportOptions, got {type(opts).__name__}")
    cost = CostModel.for_model(opts.model)
    thrash, thrash_data = _thrash_table(opts, cost)
    opts.note("livelock: failure modes")
    modes, modes_data, _ = _modes_table(opts, cost)
    opts.note("livelock: guard ablation")
    ablation, ablation_data = _ablation_table(opts, cost)
    return Section(
        key=KEY,
        heading=HEADING,
        intro=(
            "When memory runs out a paged scheduler preempts, and admit, step and preempt can go wrong: "
            "(a) recompute thrashing, the same requests preempted again and again; (b) a request that can "
            "never fit, preempted and readmitted for ever while it blocks the queue; (c) victims whose "
            "blocks are all shared (fresh forks), which free nothing, so the step takes victim after "
            "victim (vLLM issue #49674 describes such a zero-progress cascade for victims whose free is "
            "deferred); (d) preempting the oldest first, which can restart the same groups for ever. "
            "The real scheduler driving the real manager, each guard switched on and off, with the "
            f"step times of {cost.model} on an H100 (cost model)."
        ),
        tables=[thrash, modes, ablation],
        data={"thrash": thrash_data, "modes": modes_data, "ablation": ablation_data,
              "pr_44594_preemptions": {str(k): v for k, v in PR_44594.items()}},
    )
