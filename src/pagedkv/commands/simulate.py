"""``pagedkv simulate``: serve a workload with the paged cache or a reservation baseline.

Examples:

    pagedkv simulate                                   # ShareGPT-like, the vLLM paper's setup
    pagedkv simulate azure-conv-trace --num-requests 2000 --rate 4 --progress
    pagedkv simulate my_trace.jsonl.gz --num-requests 1000
    pagedkv simulate alpaca --beam-width 4
    pagedkv simulate sharegpt --model Llama-3.1-8B --gpu-mem-gib 80 --bandwidth-tbs 3.35 --tflops 989

``sharegpt``, ``alpaca``, ``azure-conv`` and ``azure-code`` are synthetic: lognormal lengths with
the published means (ShareGPT, Alpaca) or lengths drawn from the Azure traces' percentiles.
``azure-conv-trace``, ``azure-code-trace`` and ``mooncake-trace`` replay the real traces shipped
with pagedkv; a file path replays your own. The output says which kind it ran.

Defaults are the vLLM paper's setup, where KV memory limits the batch: OPT-13B on an A100-40GB,
its 2,048-token context, and every request of a built-in workload at t = 0 (saturated). The KV
memory is what the model leaves on the GPU (``--gpu-mem-gib`` x ``--util`` - weights, as
``pagedkv size`` computes it) or ``--kv-gib``; step times come from the bandwidth cost model. The
table gives each allocator's time-weighted memory breakdown while requests wait, its batch size
and its throughput, and what paging serves against each reservation.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

from ..sim.baselines import ALLOCATORS, POLICY_NAMES, make_allocator
from ..sim.hybrid_serving import GROUPED_NAME, UNIFORM_NAME, HybridMemory, hybrid_allocators
from ..sim.sizing import MAX_MEMORY_GIB
from ..sim.costmodel import A100_40GB_HBM_BYTES_PER_S, A100_BF16_FLOPS, CostModel
from ..sim.metrics import compute
from ..sim.scheduler import GUARD_PRESETS, clip_request, simulate
from ..report.tables import TEXT_WIDTH, Table
from . import (
    MAX_BLOCKS,
    UsageError,
    add_data_dir_argument,
    attention_name,
    check_data_dir,
    check_gpu_flags,
    check_int,
    check_number,
    check_requests_fit,
    context_limit,
    emit,
    grouped_kv_memory,
    kv_memory,
    progress_bar,
    reports_errors,
)

__all__ = ["add_arguments", "run", "describe", "MAX_BLOCKS", "MAX_REQUESTS", "MAX_LEN", "SHIPPED_TRACES"]

MAX_REQUESTS = 1_000_000
MAX_LEN = 1 << 20
# Below one request per 100 s no two requests share the server (a request is served in seconds):
# the run costs as much as at 1 request/s and measures idleness, and its requests/s rounds to 0.
MIN_RATE = 0.01
# Workload names that replay a trace shipped with pagedkv (short names of sim.traces.TRACE_FILES).
SHIPPED_TRACES = {"azure-conv-trace": "azure-conv", "azure-code-trace": "azure-code", "mooncake-trace": "mooncake"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register ``simulate``'s options on ``p``."""
    p.add_argument("workload", nargs="?", default="sharegpt",
                   help="synthetic workload (sharegpt, alpaca, azure-conv, azure-code), a real trace shipped "
                        "with pagedkv (azure-conv-trace, azure-code-trace, mooncake-trace) or a trace file "
                        "(default: sharegpt)")
    p.add_argument("--allocator", default="all", choices=[*ALLOCATORS, "all"], help="default: all four")
    p.add_argument("--num-requests", type=int, default=500,
                   help=f"requests to serve (default 500, at most {MAX_REQUESTS:,}; a trace's first N)")
    p.add_argument("--rate", type=float, default=None,
                   help=f"Poisson arrivals per second, at least {MIN_RATE:g}; default: the trace's timestamps, "
                        "or all at t=0 for a built-in workload; 0 puts every arrival at t=0")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-len", type=int, default=None,
                   help="context limit and Max's reservation (default: the model's context, at most what "
                        "the KV cache holds; 2,048 for OPT-13B)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="running sequences cap (default 256)")
    p.add_argument("--n", type=int, default=1,
                   help="parallel samples per request (default 1; not a request count: see --num-requests)")
    p.add_argument("--beam-width", type=int, default=1, help="beam width per request (default 1)")
    p.add_argument("--model", default="OPT-13B",
                   help="built-in model for KV and weight bytes (default OPT-13B, the vLLM paper's)")
    p.add_argument("--gpu-mem-gib", type=float, default=40.0, help="GPU memory (default 40, an A100-40GB)")
    p.add_argument("--util", type=float, default=0.9, help="memory utilisation (default 0.9)")
    p.add_argument("--kv-gib", type=float, default=None, help="KV budget in GiB instead of GPU memory")
    p.add_argument("--weights-gib", type=float, default=None,
                   help="weights per GPU in GiB (default: estimated from the model's config; needed for a "
                        "mixture-of-experts model such as gpt-oss)")
    p.add_argument("--bandwidth-tbs", type=float, default=A100_40GB_HBM_BYTES_PER_S / 1e12,
                   help="HBM bandwidth in TB/s (default 1.555, A100-40GB)")
    p.add_argument("--tflops", type=float, default=A100_BF16_FLOPS / 1e12,
                   help="peak TFLOP/s for prefill (default 312, A100 BF16)")
    p.add_argument("--overhead-ms", type=float, default=1.0, help="fixed overhead per iteration (ms)")
    p.add_argument("--no-prefix-caching", action="store_true", help="paged: turn prefix caching off")
    p.add_argument("--guards", default="vllm", choices=list(GUARD_PRESETS),
                   help="scheduler guards against livelock: vLLM v1's (default), all (plus skipping victims "
                        "that free nothing and a 5%% admission watermark) or none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", action="store_true",
                   help="a progress bar on stderr from the start (on a terminal it appears unasked once the "
                        "run has taken 5 s)")
    add_data_dir_argument(p)


def describe() -> str:
    """The ``--help`` text: the module docstring and the default setup's KV memory, computed by
    :func:`kv_memory` as a run computes it. OPT-13B on 40 GiB at 0.9: 36 - 23.92 GiB of weights
    = 12.08 GiB of KV, 989 blocks of 16 tokens (12.5 MiB each), 15,824 token slots."""
    from ..sim.sizing import GIB, get_model, kv_size

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([])
    num_blocks, cost = kv_memory(args, grouped=True)
    block_bytes = kv_size(get_model(args.model), block_size=args.block_size).bytes_per_block
    weights = cost.weight_bytes / GIB
    text = (f"The default setup, as a run computes it: {args.gpu_mem_gib:g} GiB x {args.util:g} - {weights:.2f} "
            f"GiB of {args.model} weights = {args.gpu_mem_gib * args.util - weights:.2f} GiB of KV, {num_blocks:,} "
            f"blocks of {args.block_size} tokens ({block_bytes / 2**20:g} MiB each), {num_blocks * args.block_size:,} "
            f"token slots; {args.bandwidth_tbs:g} TB/s, {args.tflops:g} TFLOP/s.")
    return f"{__doc__.rstrip()}\n\n{textwrap.fill(text, TEXT_WIDTH)}\n"


def _check(args: argparse.Namespace) -> None:
    """Every numeric flag, by the name the user typed, before anything is loaded or simulated."""
    check_int("--num-requests", args.num_requests, 1, MAX_REQUESTS)
    if args.max_len is not None:
        check_int("--max-len", args.max_len, 2, MAX_LEN)
    check_int("--block-size", args.block_size, 1, args.max_len, " (at most --max-len)")
    check_int("--max-num-seqs", args.max_num_seqs, 1)
    check_int("--n", args.n, 1, 1024)
    check_int("--beam-width", args.beam_width, 1, 1024)
    check_int("--seed", args.seed, 0)
    if args.n > 1 and args.beam_width > 1:
        raise UsageError("use --n or --beam-width, not both")
    if args.rate is not None:
        check_number("--rate", args.rate, lo_open=False)
        if 0 < args.rate < MIN_RATE:
            raise UsageError(f"--rate must be 0 (every arrival at t = 0) or at least {MIN_RATE:g} requests/s, "
                             f"got {args.rate:g}: below that no two requests share the server and "
                             "requests/s rounds to 0")
    check_gpu_flags(args)
    if args.weights_gib is not None:
        check_number("--weights-gib", args.weights_gib, lo_open=False, hi=MAX_MEMORY_GIB, why=" (1 PiB)")
    check_data_dir("--data-dir", args.data_dir)


def _source(args: argparse.Namespace) -> tuple[str | Path, str]:
    """The workload name or the trace file the positional argument names, and what it is in words
    (synthetic or a real trace)."""
    from ..sim.traces import trace_path
    from ..sim.workloads import BUILTIN_WORKLOADS, LOGNORMAL_SPECS

    name = args.workload
    if name.lower() in BUILTIN_WORKLOADS:
        if name.lower() in LOGNORMAL_SPECS:
            spec = LOGNORMAL_SPECS[name.lower()]
            what = (f"synthetic: lognormal lengths, mean prompt {spec.prompt_mean:g} and output "
                    f"{spec.output_mean:g} tokens as published, log-sd {spec.output_sigma:g} assumed")
        else:
            what = "synthetic: lengths drawn from the real Azure trace's percentiles"
        return name.lower(), what
    if name.lower() in SHIPPED_TRACES:
        path = trace_path(SHIPPED_TRACES[name.lower()], args.data_dir)
        if path is None:
            raise UsageError(f"{name}: the trace is not in {args.data_dir or 'the data directory'}")
        return path, f"real trace: {path.name}"
    if not Path(name).is_file():
        raise UsageError(f"{name!r} is neither a workload ({', '.join([*BUILTIN_WORKLOADS, *SHIPPED_TRACES])}) "
                         "nor a trace file")
    return Path(name), f"real trace file: {Path(name).name}"


def _requests(args: argparse.Namespace, limit: int | None,
              origin: str) -> tuple[list, str, list[str], tuple[int, str] | None, str]:
    """(requests, their source in words, notes on arrivals and the context limit, None or how
    many requests were left out and why, where the limit came from). ``limit`` is the context limit (None: the model states none, so the
    longest request of a trace, or the vLLM paper's 2,048 for a synthetic workload); it is set as
    ``args.max_len``, which everything after serves under."""
    from ..report.fig2 import PAPER_MAX_LEN, fit_to_model
    from ..sim.workloads import LOGNORMAL_SPECS, load_workload, over_limit_share

    src, what = _source(args)
    rate = args.rate if args.rate else None
    notes, left_out = [], None
    if isinstance(src, str):
        if limit is None:
            limit, origin = PAPER_MAX_LEN, "the vLLM paper's, as the model states no context"
        args.max_len = limit
        if src in LOGNORMAL_SPECS:
            try:
                share = over_limit_share(src, limit)
            except ValueError:  # the limit is too tight to keep the published means
                spec = LOGNORMAL_SPECS[src]
                raise UsageError(f"{src}'s lengths (mean prompt {spec.prompt_mean:g} + output {spec.output_mean:g} "
                                 f"tokens) do not fit a context limit of {limit:,} tokens ({origin}): give more KV "
                                 "memory (--kv-gib, --gpu-mem-gib) or a larger --max-len") from None
        reqs = load_workload(src, args.num_requests, args.seed, max_len=limit, rate=rate,
                             n=args.n, beam_width=args.beam_width)
        if src in LOGNORMAL_SPECS:
            notes.append(f"{100 * share:.1f}% of lognormal draws exceed the context limit {limit:,} and are "
                         "redrawn (the means are re-solved to stay the published ones)")
    else:
        raw = load_workload(src, args.num_requests, args.seed, rate=rate, n=args.n, beam_width=args.beam_width)
        if len(raw) < args.num_requests:
            default = " (the default)" if args.num_requests == 500 else ""
            print(f"pagedkv simulate: --num-requests {args.num_requests:,}{default}: {src.name} has only "
                  f"{len(raw):,} request{'s' if len(raw) != 1 else ''}; serving all of them", file=sys.stderr)
        if limit is None:
            limit = min(max((r.total_len for r in raw), default=PAPER_MAX_LEN), MAX_LEN)
            origin = "the longest request, as the model states no context"
        args.max_len = limit
        reqs, rejected, stopped = fit_to_model(raw, limit)
        if rejected:
            left_out = rejected, (f"{rejected:,} of {len(raw):,} requests, whose prompt is {limit:,} tokens or longer: "
                        f"the context limit ({origin}); a larger --max-len serves them")
        if stopped:
            notes.append(f"{stopped:,} request{'s' if stopped != 1 else ''} stop generating at the context "
                         f"limit of {limit:,} tokens (output shortened)")
        if not reqs:
            raise UsageError(f"no request of {src.name} fits the context limit of {limit:,} tokens ({origin}); "
                             "give a larger --max-len")
    if origin != "--max-len":
        notes.append(f"context limit {limit:,} tokens: {origin} (--max-len sets it)")
    if args.rate == 0 or (rate is None and isinstance(src, str)):
        reqs = [replace(r, arrival=0.0) for r in reqs]
        notes.append("every request arrives at t = 0: the server is saturated, so memory, not demand, "
                     "limits the batch")
    elif rate is not None:
        notes.append(f"Poisson arrivals at {rate:g} requests/s")
    else:
        notes.append("arrivals at the trace's own timestamps")
    return reqs, what, notes, left_out, origin


def _allocators(args: argparse.Namespace, num_blocks: int, hybrid: HybridMemory | None) -> list:
    """The allocators ``--allocator`` names. For a hybrid model ``paged`` is the grouped paged
    cache; ``all`` adds the paged cache held uniformly (every layer keeps every block) beside it."""
    names = ALLOCATORS if args.allocator == "all" else (args.allocator,)
    out = []
    for name in names:
        if name != "paged":
            out.append(make_allocator(name, num_blocks, args.block_size, args.max_len))
            continue
        kw = {"enable_prefix_caching": not args.no_prefix_caching, "beam_seed": args.seed}
        if hybrid is None:
            out.append(make_allocator(name, num_blocks, args.block_size, args.max_len, **kw))
            continue
        uniform, grouped = hybrid_allocators(hybrid, **kw)
        out += [uniform, grouped] if args.allocator == "all" else [grouped]
    return out


def _table(args: argparse.Namespace, num_blocks: int, cost: CostModel, reqs: list, what: str,
           workload_notes: list[str], hybrid: HybridMemory | None = None,
           left_out: tuple[int, str] | None = None, origin: str = "--max-len") -> Table:
    """The results table. Whatever was not served (requests left out for the context limit, or
    dropped by an allocator because one could never fit) is said in the title and in the first
    notes, before any ratio that it changes."""
    served = f"{len(reqs):,} requests" + (f" served, {left_out[0]:,} left out (see the first note)"
                                          if left_out else "")
    t = Table(
        f"{args.workload} ({what}): {served} on {num_blocks * args.block_size:,} KV slots "
        f"({cost.model})",
        ["allocator", "token states %", "reserved %", "internal frag %", "buddy rounding %", "external frag %", "free %",
         "avg batch", "requests/s", "tokens/s", "paged speed-up", "preemptions", "hits, shared %",
         "hits, recomputed %", "sharing saved %"],
        plot={"name": "simulate_breakdown", "x": "allocator", "y": ["token states %"], "kind": "bar",
              "ylabel": "% of KV memory"},
    )
    metrics, dropped, hits = {}, [], []
    allocators = _allocators(args, num_blocks, hybrid)
    fitted = [clip_request(r, args.max_len) for r in reqs]
    for alloc in allocators:
        if GUARD_PRESETS[args.guards].fit_check:
            check_requests_fit(fitted, alloc, args.max_len, origin, f"the KV cache of {alloc.name}")
    bar = progress_bar(args, len(allocators) * len(reqs), "simulate")
    for k, alloc in enumerate(allocators):
        report = None
        if bar is not None:
            report = lambda done, status, final, k=k, name=alloc.name: bar.update(  # noqa: E731
                k * len(reqs) + done, f"{name} {status}")
        res = simulate(reqs, alloc, cost, max_len=args.max_len, max_num_seqs=args.max_num_seqs,
                       progress=report or False, guards=GUARD_PRESETS[args.guards])
        metrics[alloc.name] = (res, compute(res))
    if bar is not None:
        bar.close(len(allocators) * len(reqs), "every allocator done")
    paged = metrics.get("paged" if hybrid is None else GROUPED_NAME)
    for name, (res, m) in metrics.items():
        sh = {k: round(100 * v, 1) for k, v in m.shares.items()}
        gain = round(paged[1].throughput_rps / m.throughput_rps, 2) if paged and m.throughput_rps else None
        t.add(name, sh["token_states"], sh["reserved"], sh["internal_fragmentation"], sh["buddy_rounding"],
              sh["external_fragmentation"], sh["free"], round(m.avg_batch, 1), round(m.throughput_rps, 3),
              round(m.tokens_per_s, 1), gain, m.preemptions, round(100 * m.shared_hit_rate, 1),
              round(100 * m.readmit_hit_rate, 1), round(100 * m.sharing_saving, 1))
        if m.prefix_hit_rate:
            hits.append(f"{name} {100 * m.shared_hit_rate:.1f}% from other requests, "
                        f"{100 * m.readmit_hit_rate:.1f}% recomputed after preemption")
        if res.dropped:
            dropped.append(f"{name} dropped {res.dropped:,} of {len(reqs):,} requests, which could never fit "
                           "its KV memory even alone")
    if paged and len(metrics) > 1:
        others = [(n, m) for n, (_, m) in metrics.items() if metrics[n] is not paged]
        t.notes.insert(0, "What paging buys: " + ", ".join(
            f"{paged[1].throughput_rps / m.throughput_rps:.2f}x the requests/s of {n}" for n, m in others
            if m.throughput_rps) + f" (token states {100 * paged[1].token_share:.1f}% of KV memory vs "
            + ", ".join(f"{100 * m.token_share:.1f}% for {n}" for n, m in others) + ").")
    t.notes[:0] = ([f"Left out: {left_out[1]}."] if left_out else []) + (
        [f"Dropped: {'; '.join(dropped)}; its ratios count only the requests it served."] if dropped else [])
    if hits:
        t.notes.append("Prefix hits (prompt tokens found in the cache, of those admissions looked up): "
                       + "; ".join(hits) + ". A request preempted and readmitted finds its own blocks "
                       "still cached: those hits save the recompute, they are not sharing between requests")
    if paged and len(metrics) > 1:
        t.notes.append("paged speed-up: the paged cache's requests/s over each allocator's")
    t.notes += workload_notes
    if hybrid is not None:
        t.notes.append(
            f"{hybrid.model} is a hybrid model (attention groups: {', '.join(map(attention_name, hybrid.groups))}): "
            f"{GROUPED_NAME} "
            f"keeps one table per KV cache group over {hybrid.grouped_blocks:,} blocks of "
            f"{hybrid.grouped_block_bytes / 2**10:g} KiB (one group's layers) and releases what a window no "
            f"longer reads; {UNIFORM_NAME} and the reservations keep every layer's K/V for the whole context "
            f"({hybrid.uniform_blocks:,} blocks of {hybrid.uniform_block_bytes / 2**10:g} KiB); the same "
            f"{hybrid.budget_bytes / 2**30:.2f} GiB. The cost model prices every layer reading the whole "
            "context for all of them")
    if any(n in POLICY_NAMES.values() or "buddy" in n for n in metrics):
        t.notes.append("Reservations (vLLM paper 6.1): Max reserves the context limit, Pow2 the prompt + the output "
                       "rounded up to a power of two, Oracle the prompt + the true output, each placed by a "
                       "classic buddy allocator")
    t.notes.append(f"shares time-weighted over iterations with requests waiting (all busy ones if none); "
                   f"cost model {cost.describe()}")
    return t


@reports_errors("simulate")
def run(args: argparse.Namespace) -> int:
    """Print the table; 0 on success, 2 with one line on stderr for bad input."""
    from ..sim.sizing import get_model

    _check(args)
    num_blocks, cost = kv_memory(args, grouped=True)
    spec = get_model(args.model)
    hybrid = grouped_kv_memory(args) if spec.is_hybrid else None
    limit, origin = context_limit(args, spec, num_blocks * args.block_size, MAX_LEN)
    reqs, what, notes, left_out, origin = _requests(args, limit, origin)
    emit(_table(args, num_blocks, cost, reqs, what, notes, hybrid, left_out, origin).to_text())
    return 0
