"""``pagedkv fleet``: route a real trace across replicas and compare the routers.

Examples:

    pagedkv fleet                                  # Mooncake trace, first 2,000 requests, 16 replicas
    pagedkv fleet --num-requests all --router precise
    pagedkv fleet --router ring-bounded --eps 0.1 --vnodes 1000
    pagedkv fleet azure-conv-trace --router least-loaded --replicas 4
    pagedkv fleet --router dynamo --replicas 4 --num-requests 500   # needs pagedkv[dynamo]

Each replica is a real KVCacheManager behind the serving scheduler and the bandwidth cost model
(H100 and Llama-3.1-8B by default, like ``pagedkv simulate``); the replicas advance together in
simulated time and the router decides at each request's arrival (a hybrid ``--model``, such as
gpt-oss-20b with ``--weights-gib``, keeps one block table per attention group on every replica,
as ``pagedkv simulate`` serves it). Routers: round-robin,
least-loaded, ring (consistent hashing of the prompt's first ``--key-tokens`` tokens with
``--vnodes`` virtual nodes per replica), ring-bounded (the same with bounded loads: a replica
takes a request only under ceil((1 + eps) x average) requests in flight), and precise (an index
of every replica's cached blocks built only from their KV events, sent as vLLM's wire format, with
the SGLang router's cache threshold and load guard). ``all`` runs each in turn. ``dynamo`` runs
the precise router and then the same policy on NVIDIA Dynamo's KV indexer (started here, or the
one at ``--indexer-url``), fed by the replicas' events over ZMQ, and prints both rows.

The precise router's events travel as vLLM's wire bytes when msgspec is installed (``pip install
"pagedkv[events]"``); without it they travel in process as the managers' own event objects, which
give the same routing (the table says which way they went).

The Mooncake conversation trace carries content hashes, so routing changes the prefix hit rate.
The Azure traces carry none (every prompt is unique): they show load balancing only.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..sim.costmodel import H100_BF16_FLOPS, H100_HBM_BYTES_PER_S, CostModel
from ..sim.routers import (DEFAULT_EPS, DEFAULT_KEY_TOKENS, DEFAULT_VNODES, ROUTERS, SGLANG_BALANCE_ABS,
                           SGLANG_BALANCE_REL, SGLANG_CACHE_THRESHOLD, make_router)
from ..report.tables import Table
from ..sim.sizing import MAX_MEMORY_GIB
from . import (
    UsageError,
    add_data_dir_argument,
    attention_name,
    check_gpu_flags,
    check_data_dir,
    check_int,
    check_number,
    check_out_file,
    check_requests_fit,
    context_limit,
    emit,
    grouped_kv_memory,
    kv_memory,
    progress_bar,
    reports_errors,
    write_text_atomically,
)
from .simulate import MAX_LEN, SHIPPED_TRACES

__all__ = ["add_arguments", "run", "MAX_REPLICAS", "DEFAULT_REQUESTS"]

MAX_REPLICAS = 1024
MAX_VNODES = 100_000
DEFAULT_REQUESTS = 2_000  # about 11 minutes of the hour-long Mooncake trace
HASH_ALGOS = ("sha256", "xxh3", "builtin")


def _count_or_all(text: str) -> int | None:
    if text.strip().lower() == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of requests or 'all', got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register ``fleet``'s options on ``p``."""
    p.add_argument("trace", nargs="?", default="mooncake-trace",
                   help="a shipped trace (mooncake-trace, the default; azure-conv-trace, azure-code-trace) "
                        "or a trace file (Mooncake JSONL or Azure CSV, plain or .gz)")
    p.add_argument("--router", default="all", choices=[*ROUTERS, "dynamo", "all"],
                   help="default: all, one after another; dynamo: the precise router beside Dynamo's KV indexer")
    p.add_argument("--indexer-url", default=None, metavar="URL",
                   help="dynamo: a running Dynamo indexer (python -m dynamo.indexer --threads 1) instead of "
                        "starting one")
    p.add_argument("--replicas", type=int, default=16, help="replicas in the fleet (default 16)")
    p.add_argument("--num-requests", type=_count_or_all, default=DEFAULT_REQUESTS, metavar="N|all",
                   help=f"the first N requests of the trace, or all (default {DEFAULT_REQUESTS:,})")
    p.add_argument("--vnodes", type=int, default=DEFAULT_VNODES,
                   help=f"ring: virtual nodes per replica (default {DEFAULT_VNODES})")
    p.add_argument("--eps", type=float, default=DEFAULT_EPS,
                   help=f"ring-bounded: a replica's cap is ceil((1 + eps) x average in flight) "
                        f"(default {DEFAULT_EPS})")
    p.add_argument("--key-tokens", type=int, default=DEFAULT_KEY_TOKENS,
                   help="ring: hash the prompt's first N tokens; also what counts as one prefix in the "
                        f"replicas-per-prefix column (default {DEFAULT_KEY_TOKENS:,})")
    p.add_argument("--ring-seed", type=int, default=0, help="ring: seed of the virtual nodes' positions")
    p.add_argument("--cache-threshold", type=float, default=SGLANG_CACHE_THRESHOLD,
                   help="precise: follow the longest cached prefix only above this share of the prompt "
                        f"(default {SGLANG_CACHE_THRESHOLD}, the value in SGLang's router docs)")
    p.add_argument("--balance-abs", type=int, default=SGLANG_BALANCE_ABS,
                   help=f"precise: the load guard's absolute gap (default {SGLANG_BALANCE_ABS}, the value "
                        "in SGLang's router docs)")
    p.add_argument("--balance-rel", type=float, default=SGLANG_BALANCE_REL,
                   help=f"precise: the load guard's ratio (default {SGLANG_BALANCE_REL}, the value in "
                        "SGLang's router docs)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hash-algo", default="sha256", choices=HASH_ALGOS, help="block hashes (default sha256)")
    p.add_argument("--max-len", type=int, default=None,
                   help="context limit: longer requests are clipped (default: the model's context, at most "
                        "what one replica's KV cache holds)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="running sequences cap per replica (default 256)")
    p.add_argument("--model", default="Llama-3.1-8B", help="built-in model for KV and weight bytes")
    p.add_argument("--gpu-mem-gib", type=float, default=80.0, help="GPU memory per replica (default 80, an H100)")
    p.add_argument("--util", type=float, default=0.9, help="memory utilisation (default 0.9)")
    p.add_argument("--kv-gib", type=float, default=None, help="KV budget per replica in GiB instead")
    p.add_argument("--weights-gib", type=float, default=None,
                   help="weights per replica in GiB (default: estimated from the model's config; needed for "
                        "a mixture-of-experts model such as gpt-oss)")
    p.add_argument("--bandwidth-tbs", type=float, default=H100_HBM_BYTES_PER_S / 1e12,
                   help="HBM bandwidth in TB/s (default 3.35, H100 SXM)")
    p.add_argument("--tflops", type=float, default=H100_BF16_FLOPS / 1e12, help="peak TFLOP/s for prefill")
    p.add_argument("--overhead-ms", type=float, default=1.0, help="fixed overhead per iteration (ms)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("--progress", action="store_true",
                   help="a progress bar on stderr from the start (on a terminal it appears unasked once the "
                        "run has taken 5 s)")
    add_data_dir_argument(p)


def _check(args: argparse.Namespace) -> None:
    """Every numeric flag, by the name the user typed, before anything is loaded or simulated."""
    check_int("--replicas", args.replicas, 1, MAX_REPLICAS)
    if args.num_requests is not None:
        check_int("--num-requests", args.num_requests, 1)
    check_int("--vnodes", args.vnodes, 1, MAX_VNODES)
    check_number("--eps", args.eps, lo_open=False, hi=1e6)
    check_int("--key-tokens", args.key_tokens, 1)
    check_int("--ring-seed", args.ring_seed, 0)
    check_number("--cache-threshold", args.cache_threshold, lo_open=False, hi=0.999999, why=" (a share below 1)")
    check_int("--balance-abs", args.balance_abs, 0)
    check_number("--balance-rel", args.balance_rel, lo=1.0, lo_open=False, hi=1e6)
    if args.max_len is not None:
        check_int("--max-len", args.max_len, 2, MAX_LEN)
    check_int("--block-size", args.block_size, 1, args.max_len, " (at most --max-len)")
    check_int("--max-num-seqs", args.max_num_seqs, 1)
    check_gpu_flags(args)
    if args.weights_gib is not None:
        check_number("--weights-gib", args.weights_gib, lo_open=False, hi=MAX_MEMORY_GIB, why=" (1 PiB)")
    check_data_dir("--data-dir", args.data_dir)
    if args.json is not None:
        check_out_file("--json", args.json)
    if args.hash_algo == "xxh3":
        try:
            import xxhash  # noqa: F401
        except ImportError:
            raise UsageError('--hash-algo xxh3 needs the xxhash package: pip install "pagedkv[xxhash]"') from None
    if args.router == "dynamo":
        _check_dynamo(args)
    elif args.indexer_url is not None:
        raise UsageError("--indexer-url is for --router dynamo")


def _check_dynamo(args: argparse.Namespace) -> None:
    from ..sim.dynamo_router import DYNAMO_VERSION, dynamo_installed

    if args.hash_algo == "builtin":
        raise UsageError("--router dynamo: builtin hashes differ between processes; use --hash-algo sha256 or xxh3")
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError:
        raise UsageError("--router dynamo publishes KV events in vLLM's wire format over ZMQ, which needs "
                         'msgspec and pyzmq: pip install "pagedkv[events]"') from None
    if args.indexer_url is None and not dynamo_installed():
        raise UsageError(f'--router dynamo needs Dynamo\'s indexer: pip install "pagedkv[dynamo]" '
                         f"(ai-dynamo-runtime=={DYNAMO_VERSION}), or give --indexer-url")
    if args.indexer_url is not None and not args.indexer_url.startswith(("http://", "https://")):
        raise UsageError(f"--indexer-url must be an http:// URL, got {args.indexer_url!r}")


def _trace(args: argparse.Namespace) -> tuple[Path, str]:
    """The trace file and its format (``mooncake`` or ``azure``)."""
    from ..sim.traces import detect_format, trace_path

    name = args.trace
    if name.lower() in SHIPPED_TRACES:
        path = trace_path(SHIPPED_TRACES[name.lower()], args.data_dir)
        if path is None:
            raise UsageError(f"{name}: the trace is not in {args.data_dir or 'the data directory'}")
    else:
        path = Path(name)
        if not path.is_file():
            raise UsageError(f"{name!r} is neither a shipped trace ({', '.join(SHIPPED_TRACES)}) nor a trace file")
    return path, detect_format(path)


def _requests(args: argparse.Namespace, path: Path, num_blocks: int, origin: str,
              groups=None) -> tuple[list, str]:
    """The requests clipped to the context limit ``args.max_len`` (the replicas would clip them;
    the routers see what the replicas serve, so a precise router never hashes tokens no replica
    can hold), refused when one cannot fit a replica's cache; and a note on the limit and on
    how many requests it clipped ("" when it clipped none and ``--max-len`` set it)."""
    from ..sim.fleet import ReplicaAllocator
    from ..sim.scheduler import clip_request
    from ..sim.traces import load_trace

    reqs = load_trace(path, limit=args.num_requests)
    if not reqs:
        raise UsageError(f"{path}: no requests to route")
    if args.num_requests is not None and len(reqs) < args.num_requests:
        default = " (the default)" if args.num_requests == DEFAULT_REQUESTS else ""
        print(f"pagedkv fleet: --num-requests {args.num_requests:,}{default}: the trace has only {len(reqs):,} "
              f"request{'s' if len(reqs) != 1 else ''}; routing all of them", file=sys.stderr)
    if args.max_len is None:  # the model states no context: the longest request's
        args.max_len = min(max(r.total_len for r in reqs), MAX_LEN)
        origin = "the longest request, as the model states no context"
    clipped = [clip_request(r, args.max_len) for r in reqs]
    check_requests_fit(clipped, ReplicaAllocator(num_blocks, args.block_size, groups=groups), args.max_len,
                       origin, "one replica's KV cache")
    cut = sum(c is not r for c, r in zip(clipped, reqs))
    note = "" if origin == "--max-len" else f"context limit {args.max_len:,} tokens: {origin} (--max-len sets it)"
    if cut:
        note = (f"{cut:,} of {len(reqs):,} requests were longer than the context limit of {args.max_len:,} "
                f"tokens ({origin}) and were cut to fit it (output shortened, a longer prompt's tail dropped)")
    return clipped, note


def _router(args: argparse.Namespace, name: str, groups=None):
    if name == "dynamo":
        from ..sim.dynamo_router import DynamoRouter

        return DynamoRouter(args.block_size, args.hash_algo, args.balance_abs, args.balance_rel,
                            args.cache_threshold, indexer_url=args.indexer_url)
    return make_router(name, vnodes=args.vnodes, eps=args.eps, seed=args.ring_seed, key_tokens=args.key_tokens,
                       block_size=args.block_size, hash_algo=args.hash_algo, balance_abs=args.balance_abs,
                       balance_rel=args.balance_rel, cache_threshold=args.cache_threshold, groups=groups)


# The routers' decision counts (their ``stats`` keys, kept as they are in --json) in words.
STAT_WORDS = {
    "affinity": "{n} requests sent to the longest cached prefix",
    "below_threshold": "{n} to the least loaded as their cached prefix was too short",
    "guard": "{n} to the least loaded by the load guard",
    "overflow": "{n} requests passed from a full owner to the next replica on the ring",
    "sentinel_resent": "{n} retries to bring the index up to date",
    "dynamo_equal": "Dynamo's overlap equal to ours for {n}",
    "dynamo_last_block": "one last block longer for {n}",
    "dynamo_other": "different for {n}",
}


def _stats_in_words(stats: dict) -> str:
    """A router's decision counts as a phrase, in :data:`STAT_WORDS` order: ``{"affinity": 1,
    "below_threshold": 39}`` -> ``"1 requests sent to the longest cached prefix, 39 to the least
    loaded as their cached prefix was too short"``."""
    known = [STAT_WORDS[k].format(n=f"{stats[k]:,}") for k in STAT_WORDS if k in stats]
    other = [f"{k.replace('_', ' ')} {v:,}" for k, v in sorted(stats.items()) if k not in STAT_WORDS]
    return ", ".join(known + other)


def _table(args: argparse.Namespace, results: list, n: int, fmt: str, num_blocks: int, cost: CostModel,
           wire: bool = True) -> Table:
    t = Table(f"{args.trace}: {n:,} requests on {args.replicas} replicas of {num_blocks:,} blocks of "
              f"{args.block_size} ({cost.model})",
              ["router", "hit %", "imbalance", "TTFT p50 ms", "TTFT p90 ms", "req/s", "tokens/s",
               "replicas/prefix", "max", "one replica %", "preemptions", "wall s"],
              plot={"x": "router", "y": ["hit %"], "kind": "bar", "ylabel": "% of prompt tokens from cache"})
    for res in results:
        s = res.summary()
        t.add(res.router.split(" ")[0], round(100 * s["hit_rate"], 2), round(s["imbalance"], 3),
              round(1e3 * s["ttft_p50_s"], 1), round(1e3 * s["ttft_p90_s"], 1), round(s["throughput_rps"], 3),
              round(s["tokens_per_s"], 1), round(s["replicas_per_prefix_mean"], 2), s["replicas_per_prefix_max"],
              round(100 * s["prefixes_on_one_replica"], 1), s["preemptions"], round(s["wall_s"], 1))
    for res in results:
        extra = f"; {res.event_bytes / 1e6:,.1f} MB of KV events decoded" if res.event_bytes else ""
        if res.router.startswith("precise") and not wire:
            extra = ('; KV events delivered in process as event objects (same routing; install msgspec, '
                     'pip install "pagedkv[events]", to send them as vLLM wire bytes)')
        stats = _stats_in_words(res.router_stats)
        if stats or extra or res.router != res.router.split(" ")[0]:
            t.notes.append(f"{res.router}" + (f": {stats}" if stats else "") + extra)
    t.notes.append("hit % = prompt tokens served from the replicas' prefix caches / prompt tokens asked for; "
                   "imbalance = max / mean of the replicas' busy seconds; replicas/prefix: distinct replicas "
                   f"that the requests sharing their first {args.key_tokens:,} tokens went to (prefixes used "
                   "at least twice); wall s: seconds this machine took")
    t.notes.append(f"cost model {cost.describe()}")
    if fmt == "azure":
        t.notes.append("Azure traces carry no content hashes: every prompt is unique, so no router can hit "
                       "and the prefix routers reduce to load balancing (the ring to random placement)")
    return t


@reports_errors("fleet")
def run(args: argparse.Namespace) -> int:
    """Print the table; 0 on success, 2 with one line on stderr for bad input."""
    from ..sim.dynamo_router import IndexerError
    from ..sim.fleet import run_fleet, wire_available

    from ..sim.sizing import get_model

    _check(args)
    num_blocks, cost = kv_memory(args, " per replica", grouped=True)
    spec = get_model(args.model)
    hybrid = grouped_kv_memory(args, " per replica") if spec.is_hybrid else None
    groups = None
    if hybrid is not None:
        if args.router == "dynamo":
            raise UsageError(f"--router dynamo: Dynamo's indexer matches one block table per replica, and "
                             f"--model {spec.name} is a hybrid model (one table per attention group); "
                             "use --router precise")
        num_blocks, groups = hybrid.grouped_blocks, list(hybrid.groups)
    args.max_len, origin = context_limit(args, spec, None, MAX_LEN)
    path, fmt = _trace(args)
    reqs, limit_note = _requests(args, path, num_blocks, origin, groups)
    names = list(ROUTERS) if args.router == "all" else ["precise", "dynamo"] if args.router == "dynamo" else [args.router]
    results = []
    bar = progress_bar(args, len(names) * len(reqs), "fleet")
    for k, name in enumerate(names):
        progress = None
        if bar is not None:
            progress = lambda done, total, k=k, name=name: bar.update(  # noqa: E731
                k * total + done, f"{name}: {done:,}/{total:,} requests routed")
        router = _router(args, name, groups)
        try:
            results.append(run_fleet(reqs, router, args.replicas, num_blocks, block_size=args.block_size,
                                     cost=cost, hash_algo=args.hash_algo, max_len=args.max_len,
                                     max_num_seqs=args.max_num_seqs, key_tokens=args.key_tokens,
                                     progress=progress, groups=groups))
        except IndexerError as e:  # the Dynamo indexer did not start, answer or catch up
            raise UsageError(f"--router {name}: {e}") from None
        finally:
            if hasattr(router, "close"):
                router.close()
    if bar is not None:
        bar.close(len(names) * len(reqs), "every router done")
    t = _table(args, results, len(reqs), fmt, num_blocks, cost, wire_available())
    if limit_note:
        t.notes.insert(0, limit_note)
    if hybrid is not None:
        t.notes.append(
            f"{spec.name} is a hybrid model (attention groups: {', '.join(map(attention_name, groups))}): each "
            f"replica keeps one table per group over {num_blocks:,} blocks of {hybrid.grouped_block_bytes / 2**10:g} "
            f"KiB (one group's layers; {hybrid.budget_bytes / 2**30:.2f} GiB) and releases what a window no longer "
            "reads; a prefix hits where every group holds what it reads. The cost model prices every layer "
            "reading the whole context")
    emit(t.to_text())
    if args.json is not None:
        payload = {"trace": str(path), "format": fmt, "requests": len(reqs), "replicas": args.replicas,
                   "blocks_per_replica": num_blocks, "block_size": args.block_size, "cost_model": cost.describe(),
                   "attention_groups": [attention_name(g) for g in groups] if groups else ["full"],
                   "events": "wire" if wire_available() else "in process", "results": [r.summary() for r in results]}
        write_text_atomically("--json", args.json, json.dumps(payload, indent=1))
    return 0
