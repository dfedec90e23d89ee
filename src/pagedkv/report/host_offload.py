"""Report section: a host tier behind the paged cache: prefix hits and time to first token against
host capacity, and serving under memory pressure with recompute, swap and offload.

**Prefix hits against host capacity.** The first requests of the Mooncake conversation trace
(FAST'25; one content hash per 512-token block, so hits are real) are replayed through the real
:class:`~pagedkv.KVCacheManager` as the ``prefix_hits`` section replays them (at most
``MAX_RUNNING`` resident, finished in arrival order, the oldest finished early when blocks run
out, outputs appended), on a device pool that holds a sixteenth of what the replay would need
never to evict, with a host tier of 0, 1, 2 and 4 times that pool (write-back: what the device
evicts is offloaded). ``PrefixHit`` splits each admission's hit into device and host tokens, and
the transfers drained at each admission give the blocks loaded and offloaded.

Time to first token is modelled per request, in isolation (no queueing): the cost model's
prefill time of the tokens not served from cache, plus the link time of the blocks loaded from
the host (synchronous: attention reads them), plus whatever the admission's offloads take beyond
the compute (they overlap it): the rule of :mod:`pagedkv.sim.tiered`. Two layouts: per-layer
copies (vLLM's layout before 0.12) and one copy per block (contiguous).

The Azure conversation trace has no content hashes: prefix hits cannot be measured on it and
none is measured. It speaks to load: how many seconds of its arriving prompt KV a device pool
and a host tier hold, and the time to first token with nothing cached. Its rows of hits and time
to first token against host capacity are **modelled**, under a stated sharing model, and labelled
so: each prompt keeps its recorded length and begins with one of ``requests / AZURE_SHARING``
shared system prompts (drawn uniformly, one fixed seed, the same draw in every row), of which it
takes its first ``min(S, length)`` tokens; the rest of the prompt and the output are its own. The
shared-prefix length ``S`` is swept (``AZURE_SHARED_TOKENS``) to show the spread the assumption
causes; the replay and the TTFT model are the Mooncake table's.

**Serving under memory pressure.** The first requests of the Azure conversation trace, at their
real arrival times, through the serving scheduler on a small device pool: recompute preemption
without a host tier (vLLM v1), offload (a host tier twice the pool, SGLang HiCache's ratio, with
recompute preemption: a readmitted victim loads what was offloaded), and swap preemption
(:class:`~pagedkv.sim.tiered.TieredAllocator`), each in both layouts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import KVCacheManager, OutOfBlocks
from ..checks import int_at_least
from ..sim.costmodel import CostModel
from ..sim.metrics import tail_latency
from ..sim.request import Request, segment_tokens
from ..sim.scheduler import SimResult, simulate
from ..sim.sizing import GIB, kv_budget_bytes, kv_bytes_per_token
from ..sim.swap_cost import Link, copies_per_block
from ..sim.tiered import TieredAllocator
from ..sim.traces import content_key, load_azure_csv, load_mooncake_jsonl, trace_path
from .tables import Section, Table
from ..types import TO_HOST
from .options import ReportOptions

__all__ = ["section", "replay_tiered", "TierReplay", "ttft_model", "shared_prefix_prompts", "HOST_MULTIPLES",
           "AZURE_SHARED_TOKENS"]

INTRO = (
    "A host tier behind the paged cache, on real traces through the real manager: prefix hits "
    "(device and host apart) and modelled time to first token against the host's capacity on the "
    "Mooncake conversation trace; what the Azure conversation trace can say (load: it has no "
    "content hashes), and the same hits modelled on its lengths under a stated sharing assumption; "
    "and serving under memory pressure with recompute, offload and swap preemption. "
    "Transfers are priced on a stated link: loads and swap-outs make a step "
    "wait, offloads overlap its compute.")

KEY, HEADING = "host_offload", "Host tier: prefix hits, time to first token and serving under pressure"
HOST_MULTIPLES = (0, 1, 2, 4)  # host tier as a multiple of the device pool
MAX_RUNNING = 16
DEVICE_FRACTION = 16  # the device pool holds at most 1/16 of what the replay needs never to evict
GPU_GIB, GPU_UTIL = 80, 0.9  # an H100's memory (GiB) and the share vLLM reserves by default
REPLAY_BLOCK = 128  # block size of the Mooncake replay (see _hits_table's note)
HIT_REQUESTS = {False: 800, True: 60}  # by opts.quick
SERVE_REQUESTS = {False: 150, True: 24}
AZURE_LOAD_ROWS = {False: None, True: 2_000}  # quick reads the first rows of the trace only
AZURE_HIT_REQUESTS = {False: 1_000, True: 300}  # the modelled Azure replay, by opts.quick
AZURE_SHARED_TOKENS = (256, 1_024, 4_096)  # the swept shared-prefix length S (the spread)
AZURE_SHARING = 8  # requests per system prompt, on average: requests / 8 system prompts
AZURE_SEED = 0  # the draw of each request's system prompt
SERVE_TOKENS = 10_240  # device pool of the serving runs, in token slots
SERVE_MAX_LEN = 8_192  # longer Azure requests are clipped (counted in the table's note)
SERVE_HOST_MULTIPLE = 2  # SGLang HiCache's --hicache-ratio 2
HASH_ALGO = "builtin"  # hits do not depend on the hash function; this one is the fastest



# ---- (b) the Mooncake replay --------------------------------------------------------------------


@dataclass(frozen=True)
class TierReplay:
    """One replay at one host capacity; per-request arrays cover the admitted requests."""

    num_blocks: int
    host_blocks: int
    block_size: int
    requests: int
    skipped: int
    query_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    loaded_blocks: int  # every to_device transfer (host prefix hits)
    offloaded_blocks: int  # every to_host transfer (write-back of evicted blocks)
    computed: np.ndarray  # prompt tokens each admission computed
    loads: np.ndarray  # blocks each admission loaded from the host
    offloads: np.ndarray  # blocks each admission's evictions offloaded

    @property
    def device_hit_rate(self) -> float:
        return self.device_hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def host_hit_rate(self) -> float:
        return self.host_hit_tokens / self.query_tokens if self.query_tokens else 0.0


def _drain(m: KVCacheManager) -> tuple[int, int]:
    """(to_host, to_device) blocks of the transfers pending now, drained."""
    transfers = m.take_transfers()
    to_host = sum(1 for t in transfers if t.direction == TO_HOST)
    return to_host, len(transfers) - to_host


def _retry(call, m: KVCacheManager, running: list) -> bool:
    """``call()`` until it fits, finishing the oldest resident sequences; False if it never does."""
    while True:
        try:
            call()
            return True
        except OutOfBlocks:
            if not running:
                return False
            m.free(running.pop(0))


def replay_tiered(prompts: list[np.ndarray], outputs: list[np.ndarray], num_blocks: int, host_blocks: int,
                  block_size: int, *, max_running: int = MAX_RUNNING) -> TierReplay:
    """Replay prompts (and their outputs) in order through a manager with a host tier.

    ``add_sequence`` returns each admission's hit; the transfers drained right after it are its
    loads (its host hits, ``block_size`` tokens each) and the offloads its evictions caused.
    Example: a prompt replayed after its blocks went to the host hits on the host only.
    """
    if len(prompts) != len(outputs):
        raise ValueError("need one output per prompt")
    m = KVCacheManager(num_blocks, block_size, hash_algo=HASH_ALGO, enable_events=False,
                       host_blocks=host_blocks)
    running: list[int] = []
    computed, loads, offloads = [], [], []
    skipped = query = dev_hits = host_hits = loaded = offloaded = 0
    hit = [0]
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        while len(running) >= max_running:
            m.free(running.pop(0))
        if not _retry(lambda: hit.__setitem__(0, m.add_sequence(i, prompt)), m, running):
            skipped += 1
            continue
        to_host, to_device = _drain(m)
        query += len(prompt)
        host_hits += to_device * block_size
        dev_hits += hit[0] - to_device * block_size
        computed.append(len(prompt) - hit[0])
        loads.append(to_device)
        offloads.append(to_host)
        loaded += to_device
        offloaded += to_host
        if len(out):
            _retry(lambda: m.append_tokens(i, out), m, running)
            offloaded += _drain(m)[0]
        running.append(i)
    return TierReplay(num_blocks, host_blocks, block_size, len(prompts), skipped, query, dev_hits, host_hits,
                      loaded, offloaded, np.array(computed, dtype=np.int64), np.array(loads, dtype=np.int64),
                      np.array(offloads, dtype=np.int64))


def ttft_model(replay: TierReplay, cost: CostModel, link: Link, copies: int, block_bytes: int) -> np.ndarray:
    """Seconds to first token of each admitted request, alone on the GPU: prefill of what it
    computes, plus its loads (synchronous), plus its offloads beyond the prefill (they overlap
    it). Example: 1,000 computed tokens and nothing moved: 1 ms + 1,000 x 2 x 8.03e9 / 989e12."""
    params = cost.weight_bytes / cost.weight_dtype_bytes
    compute = cost.overhead_s + replay.computed * 2.0 * params / cost.peak_flops

    def seconds(blocks: np.ndarray) -> np.ndarray:
        return blocks * copies * link.latency_s + blocks * block_bytes / link.bandwidth

    return compute + seconds(replay.loads) + np.maximum(0.0, seconds(replay.offloads) - compute)


def _mooncake_path(opts: ReportOptions) -> Path | None:
    if opts.trace is not None:
        from ..sim.traces import detect_format

        if detect_format(opts.trace) == "mooncake":
            return Path(opts.trace)
    return trace_path("mooncake", opts.data_dir)


def _mooncake_inputs(path: Path, n: int) -> tuple[list[Request], list[np.ndarray], list[np.ndarray]]:
    requests = load_mooncake_jsonl(path, limit=n)
    prompts = [np.concatenate([segment_tokens(k, length) for k, length in r.segments]) for r in requests]
    outputs = [segment_tokens(content_key("unique", "host-offload#output", i), r.output_len)
               for i, r in enumerate(requests)]
    return requests, prompts, outputs


def _percentiles(values: np.ndarray) -> tuple[float, float, float]:
    """(p50, p90, mean) in milliseconds."""
    if not len(values):
        return math.nan, math.nan, math.nan
    p50, p90 = np.percentile(values, [50, 90])
    return 1e3 * float(p50), 1e3 * float(p90), 1e3 * float(values.mean())


def _gpu_blocks(cost: CostModel, block_bytes: int) -> int | None:
    """Blocks of an H100's KV budget for the cost model's weights (None if they do not fit)."""
    try:
        return kv_budget_bytes(GPU_GIB, GPU_UTIL, cost.weight_bytes / GIB) // block_bytes
    except ValueError:
        return None


def _device_pool(need: list[int], cost: CostModel, block_bytes: int) -> int:
    """Device blocks of a replay whose requests need ``need`` blocks each: an H100's KV budget,
    or 1/DEVICE_FRACTION of what the replay needs never to evict if that is less, and never
    less than the largest request plus one."""
    gpu = _gpu_blocks(cost, block_bytes)
    return max(min(sum(need) // DEVICE_FRACTION, gpu or sum(need)), max(need) + 1)


_LAYOUTS = ("per-layer", "1 copy/block")
TTFT_COLUMNS = [f"{stat} ms {layout}" for layout in _LAYOUTS
                for stat in ("TTFT p50", "TTFT p90", "mean TTFT")]


def _ttft_cells(ttft: dict) -> list[float]:
    """The TTFT columns' cells (``TTFT_COLUMNS``' order) from ``{layout: (p50, p90, mean)}``."""
    return [v for layout in _LAYOUTS for v in ttft[layout]]


def _hits_table(opts: ReportOptions, path: Path, cost: CostModel) -> tuple[Table, dict]:
    n = HIT_REQUESTS[opts.quick]
    requests, prompts, outputs = _mooncake_inputs(path, n)
    bs = REPLAY_BLOCK
    need = [-(-r.total_len // bs) for r in requests]
    kv = kv_bytes_per_token(opts.model)
    block_bytes = bs * kv
    device = _device_pool(need, cost, block_bytes)
    link = Link()
    layouts = {"per-layer": copies_per_block(opts.model), "1 copy/block": 1}
    t = Table(
        f"Prefix hits and modelled TTFT against host capacity (Mooncake, first {len(requests):,} "
        f"requests, block size {bs}, device pool {device:,} blocks = "
        f"{device * block_bytes / GIB:.1f} GiB of {opts.model})",
        ["host capacity", "host GiB", "device hits %", "host hits %", "GiB loaded", "GiB offloaded",
         *TTFT_COLUMNS],
        plot={"name": "host_tier_hits", "x": "host capacity", "y": ["device hits %", "host hits %"], "kind": "bar",
              "ylabel": "% of prompt tokens served from cache", "annotate_values": True,
              "xlabel": "host tier capacity (multiple of the device pool)",
              "legend": {"device hits %": "hit on the device (GPU) cache",
                         "host hits %": "hit in the host tier, loaded back"},
              "title": f"Prefix hits against host tier capacity, measured on the manager (Mooncake, first "
                       f"{len(requests):,} requests); the modelled TTFT is in the table only"},
    )
    data = {}
    for k, mult in enumerate(HOST_MULTIPLES, 1):
        opts.note(f"{KEY}: Mooncake replay {k}/{len(HOST_MULTIPLES)} (host {mult}x the device pool)")
        rep = replay_tiered(prompts, outputs, device, mult * device, bs)
        ttft = {name: _percentiles(ttft_model(rep, cost, link, c, block_bytes)) for name, c in layouts.items()}
        label = "none" if not mult else f"{mult}x device"
        t.add(label, rep.host_blocks * block_bytes / GIB, 100 * rep.device_hit_rate, 100 * rep.host_hit_rate,
              rep.loaded_blocks * block_bytes / GIB, rep.offloaded_blocks * block_bytes / GIB, *_ttft_cells(ttft))
        data[mult] = {"host_blocks": rep.host_blocks, "device_hit_rate": rep.device_hit_rate,
                      "host_hit_rate": rep.host_hit_rate, "loaded_bytes": rep.loaded_blocks * block_bytes,
                      "offloaded_bytes": rep.offloaded_blocks * block_bytes, "skipped": rep.skipped,
                      "ttft_ms": {name: dict(zip(("p50", "p90", "mean"), v)) for name, v in ttft.items()}}
    t.notes.append(
        f"Replayed: the first {len(requests):,} of the trace's requests in order (its real hash_ids), "
        f"each request's recorded output appended as unique tokens before it finishes, at most "
        f"{MAX_RUNNING} resident. Device pool: an H100's KV budget for "
        f"{opts.model} ({GPU_GIB} GiB x {GPU_UTIL} - weights), or 1/{DEVICE_FRACTION} of the "
        f"{sum(need):,} blocks that would never evict if that is less; host tiers write back what "
        f"the device evicts. Hits: share of prompt tokens, host hits counted by the loads each "
        f"admission queued.")
    t.notes.append(
        f"Block size {bs}, not the report's: an offloaded block costs the manager Python work per "
        f"block, and the trace shares prefixes in 512-token units, so hits land on the same "
        f"512-token boundaries at any block size that divides 512.")
    t.notes.append(_ttft_note(cost, link, layouts, data))
    return t, {"requests": len(requests), "block_size": bs, "device_blocks": device, "by_host": data}


def _ttft_note(cost: CostModel, link: Link, layouts: dict, by_row: dict) -> str:
    """The TTFT model, stated, and what the medians do across the rows (read from them)."""
    first, last = by_row[min(by_row)]["ttft_ms"], by_row[max(by_row)]["ttft_ms"]
    same = all(len({round(row["ttft_ms"][layout]["p50"], 1) for row in by_row.values()}) == 1
               for layout in layouts)
    median = ("The median is the same in every row: the median request's TTFT does not move with "
              "the host tier." if same else
              "The median goes from " + " and ".join(
                  f"{first[layout]['p50']:.1f} to {last[layout]['p50']:.1f} ms ({layout})"
                  for layout in layouts) + " between the first and the last row.")
    return (f"TTFT per request alone on an H100 ({cost.model}, cost model): prefill of the tokens "
            f"not hit + loads from the host + offloads beyond the prefill; link {link.describe()}; a "
            f"block is {layouts['per-layer']} copies per-layer or 1 contiguous. No queueing: the "
            f"serving table below has it. {median}")


def _azure_load_table(opts: ReportOptions, path: Path, cost: CostModel, device_tokens: int) -> tuple[Table, dict]:
    reqs = load_azure_csv(path, limit=AZURE_LOAD_ROWS[opts.quick])
    arrival = np.array([r.arrival for r in reqs])
    prompt = np.array([r.prompt_len for r in reqs], dtype=np.int64)
    span = float(arrival[-1] - arrival[0]) or 1.0
    minute = np.bincount((arrival // 60).astype(np.int64), weights=prompt)
    mean_rate, peak_rate = prompt.sum() / span, float(minute.max()) / 60
    kv = kv_bytes_per_token(opts.model)
    t = Table(
        f"Azure conversation trace ({len(reqs):,} requests over {span / 60:.0f} min): seconds of its "
        f"arriving prompt KV that device + host hold (no prefix hits: the trace has no content)",
        ["host capacity", "device + host GiB", "s at the mean rate", "s at the busiest minute"],
    )
    data = {}
    for mult in HOST_MULTIPLES:
        tokens = (1 + mult) * device_tokens
        t.add("none" if not mult else f"{mult}x device", tokens * kv / GIB, tokens / mean_rate, tokens / peak_rate)
        data[mult] = {"tokens": tokens, "seconds_mean": tokens / mean_rate, "seconds_peak": tokens / peak_rate}
    params = cost.weight_bytes / cost.weight_dtype_bytes
    cold = cost.overhead_s + prompt * 2.0 * params / cost.peak_flops
    p50, p90, mean = _percentiles(cold)
    t.notes.append(
        f"Device pool as in the Mooncake table ({device_tokens:,} token slots). Prompt tokens arrive "
        f"at {mean_rate:,.0f}/s on average and {peak_rate:,.0f}/s in the busiest minute "
        f"({mean_rate * kv / GIB:.2f} and {peak_rate * kv / GIB:.2f} GiB/s of {opts.model} KV): a "
        f"prefix must come back within these seconds to hit, roughly (LRU).")
    t.notes.append(
        "Prefix hits cannot be measured on this trace: it has no content hashes (it records arrival "
        "times and lengths only), so replayed as recorded every prompt is content of its own and a "
        "hit rate would be an artefact; none is reported as measured. The next table models hits "
        f"under a stated sharing assumption. Cold TTFT (prefill alone, nothing cached, no queueing): "
        f"p50 {p50:.1f} ms, p90 {p90:.1f} ms, mean {mean:.1f} ms.")
    return t, {"requests": len(reqs), "prompt_tokens_per_s": mean_rate, "peak_minute_tokens_per_s": peak_rate,
               "cold_ttft_ms": {"p50": p50, "p90": p90, "mean": mean}, "by_host": data}


def shared_prefix_prompts(requests: list[Request], shared_tokens: int, num_prompts: int,
                          seed: int = AZURE_SEED) -> list[np.ndarray]:
    """The modelled prompts of a trace without content: each keeps its recorded length and
    begins with the first ``min(shared_tokens, length)`` tokens of one of ``num_prompts`` shared
    system prompts (drawn uniformly with ``seed``: the same draw for every ``shared_tokens``, so
    that a sweep of it changes nothing else); the rest is the request's own content.

    Example: a 1,000-token prompt with ``shared_tokens=256`` is 256 tokens of its system prompt,
    then 744 of its own; with 4,096 it is the first 1,000 tokens of its system prompt.
    """
    if isinstance(requests, (str, bytes)) or not all(isinstance(r, Request) for r in requests):
        raise ValueError("requests must be a sequence of Request")
    seed = int_at_least("seed", seed, 0)
    shared_tokens = int_at_least("shared_tokens", shared_tokens, 0)
    num_prompts = int_at_least("num_prompts", num_prompts, 1)
    pick = np.random.default_rng(seed).integers(0, num_prompts, len(requests))
    out = []
    for r, k in zip(requests, pick.tolist()):
        s = min(shared_tokens, r.prompt_len)
        system = segment_tokens(content_key("system", "host-offload#azure", k), s)
        own = segment_tokens(r.segments[0][0], r.prompt_len - s)  # the request's unique stream
        out.append(np.concatenate([system, own]))
    return out


def _azure_hits_table(opts: ReportOptions, path: Path, cost: CostModel) -> tuple[Table, dict]:
    requests = load_azure_csv(path, limit=AZURE_HIT_REQUESTS[opts.quick])
    bs = REPLAY_BLOCK
    need = [-(-r.total_len // bs) for r in requests]
    block_bytes = bs * kv_bytes_per_token(opts.model)
    device = _device_pool(need, cost, block_bytes)
    num_prompts = max(1, len(requests) // AZURE_SHARING)
    outputs = [segment_tokens(content_key("unique", "host-offload#azure-output", i), r.output_len)
               for i, r in enumerate(requests)]
    link = Link()
    layouts = {"per-layer": copies_per_block(opts.model), "1 copy/block": 1}
    t = Table(
        f"MODELLED, not measured: prefix hits and TTFT against host capacity on the Azure "
        f"conversation trace's lengths (first {len(requests):,} requests), each prompt opening with "
        f"one of {num_prompts:,} shared system prompts of S tokens (block size {bs}, device pool "
        f"{device:,} blocks = {device * block_bytes / GIB:.1f} GiB of {opts.model})",
        ["S, host capacity", "device hits %", "host hits %", "GiB loaded", *TTFT_COLUMNS],
    )
    data = {}
    k, runs = 0, len(AZURE_SHARED_TOKENS) * len(HOST_MULTIPLES)
    for shared in AZURE_SHARED_TOKENS:
        prompts = shared_prefix_prompts(requests, shared, num_prompts)
        rows = {}
        for mult in HOST_MULTIPLES:
            k += 1
            opts.note(f"{KEY}: modelled Azure replay {k}/{runs} (S {shared:,}, host {mult}x)")
            rep = replay_tiered(prompts, outputs, device, mult * device, bs)
            ttft = {name: _percentiles(ttft_model(rep, cost, link, c, block_bytes)) for name, c in layouts.items()}
            t.add(f"S {shared:,}, " + ("no host" if not mult else f"{mult}x device"), 100 * rep.device_hit_rate,
                  100 * rep.host_hit_rate, rep.loaded_blocks * block_bytes / GIB, *_ttft_cells(ttft))
            rows[mult] = {"host_blocks": rep.host_blocks, "device_hit_rate": rep.device_hit_rate,
                          "host_hit_rate": rep.host_hit_rate, "loaded_bytes": rep.loaded_blocks * block_bytes,
                          "skipped": rep.skipped,
                          "ttft_ms": {name: dict(zip(("p50", "p90", "mean"), v)) for name, v in ttft.items()}}
        data[shared] = rows
    lengths = np.array([r.prompt_len for r in requests])
    q25, q50, q99 = np.percentile(lengths, [25, 50, 99])
    top = max(HOST_MULTIPLES)
    host_top = [data[s][top]["host_hit_rate"] for s in AZURE_SHARED_TOKENS]
    all_hits = [row["device_hit_rate"] + row["host_hit_rate"] for rows in data.values() for row in rows.values()]
    t.notes.append(
        "Modelled, not a measurement of the trace: the Azure trace has no content hashes, so every hit "
        "here comes from the stated sharing model and changes with it. Model: each request keeps its "
        f"recorded prompt and output lengths; its prompt opens with the first min(S, length) tokens "
        f"of one of {num_prompts:,} shared system prompts (one per {AZURE_SHARING} requests on "
        f"average; each request's drawn uniformly, seed {AZURE_SEED}, the same draw in every row); "
        f"the rest of the prompt and the output are its own. Fewer system prompts would stay on the "
        f"device (the host adds nothing); many more would rarely repeat (nothing to hit).")
    t.notes.append(
        f"The spread: S swept over {', '.join(f'{s:,}' for s in AZURE_SHARED_TOKENS)} tokens (the "
        f"replayed prompts' lengths: p25 {q25:,.0f}, median {q50:,.0f}, p99 {q99:,.0f}); hits of "
        f"prompt tokens range from {100 * min(all_hits):.1f}% to {100 * max(all_hits):.1f}% over the "
        f"rows, and a host tier {top}x the device pool serves {100 * min(host_top):.1f}% to "
        f"{100 * max(host_top):.1f}% of prompt tokens, depending on S alone. Replay, device pool rule, hits and "
        f"TTFT as in the Mooncake table.")
    return t, {"modelled": True, "requests": len(requests), "block_size": bs, "device_blocks": device,
               "system_prompts": num_prompts, "seed": AZURE_SEED, "by_shared_tokens": data}


# ---- (c) serving under memory pressure ----------------------------------------------------------


def _modes(opts: ReportOptions, blocks: int) -> list[tuple[str, dict]]:
    host = SERVE_HOST_MULTIPLE * blocks
    return [
        ("recompute, no host tier", {}),
        ("offload, per-layer", {"host_blocks": host}),
        ("offload, 1 copy/block", {"host_blocks": host, "copies_per_block": 1}),
        ("swap, per-layer", {"host_blocks": host, "preemption": "swap"}),
        ("swap, 1 copy/block", {"host_blocks": host, "preemption": "swap", "copies_per_block": 1}),
        ("swap only (no offload), 1 copy/block",
         {"host_blocks": host, "preemption": "swap", "copies_per_block": 1, "write_policy": "none"}),
    ]


def _serve_one(reqs: list[Request], blocks: int, opts: ReportOptions, cost: CostModel,
               kw: dict) -> tuple[SimResult, TieredAllocator]:
    alloc = TieredAllocator(blocks, opts.block_size, model=opts.model, hash_algo=HASH_ALGO, **kw)
    return simulate(reqs, alloc, cost, max_len=SERVE_MAX_LEN, on_livelock="return"), alloc


def _serve_table(opts: ReportOptions, path: Path, cost: CostModel) -> tuple[Table, dict]:
    n = SERVE_REQUESTS[opts.quick]
    reqs = load_azure_csv(path, limit=n)
    bs = opts.block_size
    blocks = SERVE_TOKENS // bs
    block_bytes = bs * kv_bytes_per_token(opts.model)
    t = Table(
        f"Serving the first {len(reqs):,} Azure conversation requests at their arrival times on "
        f"{blocks:,} blocks of {bs} ({blocks * block_bytes / GIB:.2f} GiB): recompute, offload, swap",
        ["mode", "output tokens/s", "preemptions", "swap-outs", "recomputed tokens", "GiB to host",
         "GiB to device", "transfer wait s", "TTFT p50 ms", "TTFT p90 ms", "latency p50 s", "latency p90 s"],
        plot={"name": "host_tier_serving", "x": "mode", "y": ["TTFT p50 ms", "TTFT p90 ms"], "kind": "bar",
              "logy": True, "ymin": 1, "annotate_values": True,
              "ylabel": "time to first token, ms (modelled, log scale)", "xlabel": "preemption mode and block layout",
              "legend": {"TTFT p50 ms": "TTFT p50", "TTFT p90 ms": "TTFT p90"},
              "title": f"Modelled TTFT, {len(reqs):,} Azure conversation requests on {blocks:,} blocks of {bs}"},
    )
    data = {}
    clipped = 0
    modes = _modes(opts, blocks)
    for k, (label, kw) in enumerate(modes, 1):
        opts.note(f"{KEY}: serving {k}/{len(modes)} ({label})")
        res, alloc = _serve_one(reqs, blocks, opts, cost, kw)
        st = alloc.stats
        lat = tail_latency(res, (50, 90))
        clipped = res.clipped
        t.add(label, round(res.output_tokens / res.makespan, 1), res.preemptions, st.swap_outs,
              res.recomputed_tokens, st.blocks_to_host * block_bytes / GIB, st.loaded_blocks * block_bytes / GIB,
              round(st.waited_s, 3), round(1e3 * lat["ttft_p50"], 1), round(1e3 * lat["ttft_p90"], 1),
              round(lat["latency_p50"], 2), round(lat["latency_p90"], 2))
        data[label] = {"tokens_per_s": res.output_tokens / res.makespan, "preemptions": res.preemptions,
                       "swap_outs": st.swap_outs, "swap_fallbacks": st.swap_fallbacks,
                       "recomputed_tokens": res.recomputed_tokens, "finished": res.finished,
                       "completed": res.completed, "bytes_to_host": st.blocks_to_host * block_bytes,
                       "bytes_to_device": st.loaded_blocks * block_bytes, "transfer_wait_s": st.waited_s,
                       **lat}
    t.notes.append(
        f"Workload: the trace's first {len(reqs):,} requests (prompts and outputs as recorded, "
        f"{clipped} clipped to {SERVE_MAX_LEN:,} tokens), arrival times as recorded; vLLM v1's "
        f"scheduler guards; {cost.model} on an H100 (cost model). Host tier: {SERVE_HOST_MULTIPLE}x "
        "the device pool, write-back. Offload: recompute preemption, a readmitted victim loads what "
        "the device offloaded (the trace has no shared content, so nothing else hits). Swap: the "
        "victim's private blocks go to the host and come back before new admissions; a victim "
        "admitted in the same step is recomputed. Swap only: the same with the host tier holding "
        "swapped sequences alone (vLLM v0's swap space): evicted prefixes are forgotten, not offloaded.")
    t.notes.append(
        "Transfer wait: what steps waited for loads, swap-outs and offloads beyond their compute "
        f"(the simulator's transfer model); link {Link().describe()}. Preemptions differ between "
        "modes because transfer time changes when requests arrive relative to memory use. Times "
        "are modelled (the cost model's step times), not measured.")
    return t, data


def section(opts: ReportOptions) -> Section:
    if not isinstance(opts, ReportOptions):
        raise ValueError(f"opts must be ReportOptions, got {type(opts).__name__}")
    cost = CostModel.for_model(opts.model)
    sec = Section(KEY, HEADING, intro=INTRO)
    moon, azure = _mooncake_path(opts), trace_path("azure-conv", opts.data_dir)
    device_tokens = None
    if moon is None:
        sec.text.append("Mooncake trace not found: the prefix-hit table is skipped.")
    else:
        hits, hits_data = _hits_table(opts, moon, cost)
        sec.tables.append(hits)
        sec.data["mooncake"] = hits_data
        device_tokens = hits_data["device_blocks"] * hits_data["block_size"]
    if azure is None:
        sec.text.append("Azure conversation trace not found: its load table, its modelled hits "
                        "table and the serving table are skipped.")
    else:
        if device_tokens is not None:
            load, load_data = _azure_load_table(opts, azure, cost, device_tokens)
            sec.tables.append(load)
            sec.data["azure_load"] = load_data
        modelled, modelled_data = _azure_hits_table(opts, azure, cost)
        sec.tables.append(modelled)
        sec.data["azure_modelled"] = modelled_data
        serve, serve_data = _serve_table(opts, azure, cost)
        sec.tables.append(serve)
        sec.data["serving"] = serve_data
    sec.text += _summary(sec.data)
    return sec


def _summary(data: dict) -> list[str]:
    """The headline numbers, read from the tables' data: what was replayed and what it gave."""
    out = []
    moon = data.get("mooncake")
    if moon:
        none, top = moon["by_host"][0], moon["by_host"][max(HOST_MULTIPLES)]
        unchanged = len({row["device_hit_rate"] for row in moon["by_host"].values()}) == 1
        same = " and leaves the device hits as they are at every host size" if unchanged else ""
        out.append(
            f"Mooncake, first {moon['requests']:,} requests at block size {moon['block_size']}: with no "
            f"host tier {none['device_hit_rate']:.1%} of prompt tokens hit on the device; a host tier "
            f"{max(HOST_MULTIPLES)}x the device pool adds {top['host_hit_rate']:.1%} from the host "
            f"({top['loaded_bytes'] / GIB:,.1f} GiB loaded){same}. Mean "
            f"modelled TTFT {none['ttft_ms']['1 copy/block']['mean']:.0f} -> "
            f"{top['ttft_ms']['1 copy/block']['mean']:.0f} ms with one copy per block, "
            f"{none['ttft_ms']['per-layer']['mean']:.0f} -> {top['ttft_ms']['per-layer']['mean']:.0f} ms "
            f"with per-layer copies.")
    modelled = data.get("azure_modelled")
    if modelled:
        top = max(HOST_MULTIPLES)
        parts = [f"S = {s:,}: {100 * rows[0]['device_hit_rate']:.1f}% on the device, +"
                 f"{100 * rows[top]['host_hit_rate']:.1f}% from a {top}x host tier"
                 for s, rows in modelled["by_shared_tokens"].items()]
        out.append(
            f"Azure conversation, MODELLED (no content hashes in the trace; {modelled['system_prompts']:,} "
            f"shared system prompts of S tokens assumed, first {modelled['requests']:,} requests): "
            + "; ".join(parts) + ".")
    serving = data.get("serving")
    if serving:
        rec = serving["recompute, no host tier"]
        parts = [f"{label}: {row['preemptions']} preemptions, {row['recomputed_tokens']:,} tokens recomputed, "
                 f"latency p90 {row['latency_p90']:.2f} s, {row['transfer_wait_s']:.2f} s waiting for transfers"
                 for label, row in serving.items() if label != "recompute, no host tier"]
        out.append(
            f"Serving (Azure conversation): recompute without a host tier had {rec['preemptions']} "
            f"preemptions, {rec['recomputed_tokens']:,} tokens recomputed, latency p90 "
            f"{rec['latency_p90']:.2f} s. " + "; ".join(parts) + ".")
    return out
