"""Report section: prefix hit rate against cache capacity, on the real Mooncake trace.

The Mooncake conversation trace (FAST'25) gives, per request, one ``hash_id`` per 512-token block
of its prompt; equal ids mean an equal prefix. Loaded by ``pagedkv.sim.traces`` into token
recipes, it is replayed through the real :class:`pagedkv.KVCacheManager` at several capacities:
each request is admitted (``add_sequence``, whose return value is the tokens served from cache),
its output appended, and sequences finish in arrival order with at most ``MAX_RUNNING`` resident;
when blocks run out the oldest resident one finishes early. A finished sequence's full blocks stay
cached until evicted (least recently freed first), so capacity decides how much history survives.

Two independent checks, computed straight from the ``hash_ids`` without the manager or tokens:

- the **ideal** hit rate with an unbounded cache at the trace's own 512-token granularity: a
  request hits the longest run of leading ids already seen, ``min(512 k, input_length)`` tokens;
- the same at the replay's block size under the manager's rules (only full blocks; the last prompt
  token is always computed): ``floor(min(512 k, L - 1) / B) * B``. The unbounded replay must
  equal it exactly.

Worked number: over the whole trace (12,031 requests, 144.8M prompt tokens) the ideal is 37.4%
of prompt tokens. The hit rate grows with history (a cold cache hits nothing), so a replay of the
first 2,000 requests can reach only that prefix's ideal (~29%); a second table shows the ideal
climbing to 37% as more of the trace is replayed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .. import KVCacheManager, OutOfBlocks
from ..sim.request import Request, segment_tokens
from ..sim.sizing import GIB, get_model, kv_size
from ..sim.traces import (
    MOONCAKE_BLOCK,
    TRACE_FILES,
    content_key,
    default_data_dir,
    detect_format,
    load_mooncake_jsonl,
    mooncake_hash_ids,
    trace_path,
)
from ..tables import Section, Table
from .options import ReportOptions

__all__ = ["section", "replay", "ideal_hits", "ReplayResult", "MAX_RUNNING"]

MAX_RUNNING = 16  # sequences resident at once in the replay
FULL_REQUESTS = 2_000  # replayed with quick=False (~11 minutes of the hour-long trace)
QUICK_REQUESTS = 200
FULL_FRACTIONS = (1 / 64, 1 / 16, 1 / 8, 1 / 4, 1 / 2)  # bounded capacities, as fractions of "never evicts"
QUICK_FRACTIONS = (1 / 16,)
IDEAL_PREFIXES = (250, 500, 1_000, 2_000, 4_000, 8_000)
# The whole trace is replayed at the trace's own 512-token granularity: 32x fewer blocks than at
# block size 16, so all 12,031 requests take ~5 s per capacity instead of ~25 s and 2 GB.
WHOLE_BLOCK_SIZE = MOONCAKE_BLOCK
WHOLE_FRACTIONS = (1 / 16, 1 / 4)
HASH_ALGO = "builtin"  # fastest; hits do not depend on the hash function (no collisions in practice)


@dataclass(frozen=True)
class ReplayResult:
    """What one replay measured (tokens counted by the manager's own ``usage()``)."""

    num_blocks: int
    requests: int
    skipped: int  # requests larger than the whole cache
    query_tokens: int
    hit_tokens: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def _admit(m: KVCacheManager, running: list, sid: int, tokens: np.ndarray) -> bool:
    """Admit, finishing the oldest resident sequences while blocks are short; False if it never fits."""
    while True:
        try:
            m.add_sequence(sid, tokens)
            return True
        except OutOfBlocks:
            if not running:
                return False
            m.free(running.pop(0))


def _append(m: KVCacheManager, running: list, sid: int, tokens: np.ndarray) -> None:
    while True:
        try:
            m.append_tokens(sid, tokens)
            return
        except OutOfBlocks:
            if not running:  # alone and still too big: finish it where it is
                return
            m.free(running.pop(0))


def replay(requests: list[Request], num_blocks: int, block_size: int, *,
           max_running: int = MAX_RUNNING, append_outputs: bool = True,
           hash_algo: str = HASH_ALGO, progress: Callable[[int], None] | None = None) -> ReplayResult:
    """Replay ``requests`` in order through a fresh manager of ``num_blocks`` blocks.

    ``progress``, when given, is called with the number of requests replayed so far after each
    quarter of them (a whole-trace replay takes tens of seconds). Example: the first 200 Mooncake
    requests with a cache that never evicts hit ~6% of their prompt tokens (the ideal for those 200).
    """
    if not isinstance(requests, list) or not all(isinstance(r, Request) for r in requests):
        raise ValueError("requests must be a list of Request")
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size), ("max_running", max_running)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    m = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True, hash_algo=hash_algo,
                       enable_events=False)
    running: list[int] = []
    skipped = 0
    quarter = max(1, -(-len(requests) // 4))
    for i, r in enumerate(requests):
        if progress is not None and i and i % quarter == 0:
            progress(i)
        while len(running) >= max_running:
            m.free(running.pop(0))
        if not _admit(m, running, i, np.concatenate([segment_tokens(k, n) for k, n in r.segments])):
            skipped += 1
            continue
        if append_outputs and r.output_len:
            out = segment_tokens(content_key("unique", "prefix-hits#output", i), r.output_len)
            _append(m, running, i, out.tolist())
        running.append(i)
    u = m.usage()
    return ReplayResult(num_blocks, len(requests), skipped, u.prefix_query_tokens,
                        u.prefix_hit_tokens, u.evictions)


def ideal_hits(records: list[tuple[int, list[int]]], block_size: int | None = None) -> tuple[int, int]:
    """``(hit tokens, prompt tokens)`` with an unbounded cache, straight from the hash ids.

    ``block_size=None``: the trace's granularity, ``min(512 k, L)`` per request for ``k`` leading ids
    already seen. Otherwise the manager's rules at that block size: ``floor(min(512 k, L - 1) / B) * B``.
    Example: ids [0, 1] then [0, 2] (1024 tokens each) -> (512, 2048) at the trace's granularity.
    """
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"block_size must be None or a positive int, got {block_size!r}")
    seen: set[int] = set()
    hit = total = 0
    for n_in, ids in records:
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        matched = min(k * MOONCAKE_BLOCK, n_in)
        hit += matched if block_size is None else min(matched, n_in - 1) // block_size * block_size
        total += n_in
        seen.update(ids)
    return hit, total


def _mooncake_file(opts: ReportOptions) -> tuple[Path | None, str | None]:
    """The Mooncake trace to replay, and a sentence when ``opts.trace`` cannot be it."""
    if opts.trace is not None:
        fmt = detect_format(opts.trace)
        if fmt == "mooncake":
            return Path(opts.trace), None
        fallback = trace_path("mooncake", opts.data_dir)
        why = (f"The trace given ({Path(opts.trace).name}) is an {fmt.capitalize()} trace: it has "
               "no content hashes, so it cannot show prefix hits; this section needs a Mooncake "
               "trace (JSON lines with hash_ids)")
        return fallback, why + (f" and replays {fallback.name} instead." if fallback else ".")
    return trace_path("mooncake", opts.data_dir), None


def _capacities(requests: list[Request], block_size: int, fractions) -> tuple[list[int], int]:
    """Bounded block counts (fractions of a cache that never evicts) and that cache's size."""
    per_req = [math.ceil(r.total_len / block_size) for r in requests]
    never = sum(per_req)
    floor = max(per_req) + 1
    bounded = sorted({max(floor, int(never * f)) for f in fractions})
    return [b for b in bounded if b < never], never


def _capacity_table(results, never: int, opts: ReportOptions, ideal_b: float, n: int,
                    block_size: int, scope: str) -> Table:
    bpt = kv_size(get_model(opts.model)).bytes_per_token
    t = Table(f"Prefix hit rate vs cache capacity (Mooncake, {scope} {n:,} requests, block size {block_size})",
              ["capacity", "blocks", f"KV GiB ({opts.model})", "hit rate (manager) %",
               "ideal (hash_ids) %", "evictions", "skipped"],
              plot={"x": "blocks", "y": ["hit rate (manager) %"], "kind": "line", "logx": True,
                    "ylabel": "% of prompt tokens served from cache"})
    for res in results:
        label = "unbounded" if res.num_blocks >= never else f"1/{round(never / res.num_blocks)}"
        ideal = ideal_b if res.num_blocks >= never else float("nan")
        t.add(label, res.num_blocks, res.num_blocks * block_size * bpt / GIB, 100 * res.hit_rate,
              100 * ideal, res.evictions, res.skipped)
    t.notes.append(f"capacity as a fraction of {never:,} blocks, enough to never evict; at most "
                   f"{MAX_RUNNING} sequences resident, finished in arrival order; outputs appended")
    t.notes.append(f"hash {HASH_ALGO!r} for speed (sha256 gives the same hits); hit rate = "
                   "usage().prefix_hit_tokens / prefix_query_tokens")
    t.notes.append("ideal: unbounded cache, from hash_ids alone, full blocks only and the last prompt "
                   "token always computed (the manager's rules); the unbounded replay must equal it")
    return t


def _ideal_table(records, n_replayed: int, block_size: int) -> Table:
    t = Table("Ideal hit rate (unbounded cache, from hash_ids) vs how much of the trace is replayed",
              ["requests", "hit rate %, 512-token ids", f"hit rate %, block size {block_size}"],
              plot={"x": "requests", "y": ["hit rate %, 512-token ids"], "kind": "line", "logx": True,
                    "ylabel": "% of prompt tokens"})
    sizes = sorted({k for k in IDEAL_PREFIXES if k < len(records)} | {n_replayed, len(records)})
    for k in sizes:
        h, q = ideal_hits(records[:k])
        hb, _ = ideal_hits(records[:k], block_size)
        t.add(k, 100 * h / q, 100 * hb / q)
    t.notes.append("a cold cache hits nothing: the share grows with the history replayed")
    return t


def _replays(requests: list[Request], capacities: list[int], block_size: int, opts: ReportOptions,
             what: str, quarters: bool = False) -> list[ReplayResult]:
    """One replay per capacity, each announced on ``opts.note`` (and, with ``quarters``, each
    quarter of the requests too: a whole-trace replay runs for tens of seconds)."""
    results = []
    n = len(requests)
    for k, blocks in enumerate(capacities, 1):
        head = f"prefix_hits, {what}: capacity {k}/{len(capacities)} ({blocks:,} blocks of {block_size})"
        opts.note(f"{head}, {n:,} requests")
        marks = (lambda i: opts.note(f"{head}: {i:,} of {n:,} requests")) if quarters else None
        results.append(replay(requests, blocks, block_size, progress=marks))
    return results


def _whole_trace_table(path: Path, records, opts: ReportOptions, data: dict) -> Table:
    """Every request of the trace through the manager, at the trace's 512-token granularity."""
    requests = load_mooncake_jsonl(path)
    bounded, never = _capacities(requests, WHOLE_BLOCK_SIZE, WHOLE_FRACTIONS)
    results = _replays(requests, bounded + [never], WHOLE_BLOCK_SIZE, opts, "whole trace", quarters=True)
    h, q = ideal_hits(records, WHOLE_BLOCK_SIZE)
    data["whole_trace_unbounded_hit_rate"] = results[-1].hit_rate
    data["whole_trace_ideal_hit_rate"] = h / q
    return _capacity_table(results, never, opts, h / q, len(requests), WHOLE_BLOCK_SIZE, "all")


def section(opts: ReportOptions) -> Section:
    """Prefix hit rate against cache capacity on the Mooncake trace (see the module docstring)."""
    if not isinstance(opts, ReportOptions):
        raise ValueError(f"opts must be ReportOptions, got {type(opts).__name__}")
    sec = Section("prefix_hits", "Prefix hits vs cache capacity (Mooncake trace)",
                  intro="Share of prompt tokens served from the prefix cache, replaying the real "
                        "Mooncake conversation trace through KVCacheManager at several capacities.")
    path, wrong_kind = _mooncake_file(opts)
    if wrong_kind:
        sec.text.append(wrong_kind)
        sec.data["trace_not_used"] = str(opts.trace)
    if path is None:
        where = opts.data_dir if opts.data_dir is not None else default_data_dir()
        sec.text.append(f"Mooncake trace not found ({TRACE_FILES['mooncake']}[.gz] is not in "
                        f"{where if where is not None else 'any data directory'}): section skipped.")
        sec.data["skipped"] = True
        return sec
    n = QUICK_REQUESTS if opts.quick else FULL_REQUESTS
    requests = load_mooncake_jsonl(path, limit=n)
    records = mooncake_hash_ids(path)
    bounded, never = _capacities(requests, opts.block_size, QUICK_FRACTIONS if opts.quick else FULL_FRACTIONS)
    results = _replays(requests, bounded + [never], opts.block_size, opts, f"first {len(requests):,}")
    hb, q = ideal_hits(records[: len(requests)], opts.block_size)
    h512, _ = ideal_hits(records[: len(requests)])
    hall, qall = ideal_hits(records)
    sec.tables += [_capacity_table(results, never, opts, hb / q, len(requests), opts.block_size, "first"),
                   _ideal_table(records, len(requests), opts.block_size)]
    if not opts.quick and len(records) > len(requests):
        sec.tables.append(_whole_trace_table(path, records, opts, sec.data))
    sec.data.update({
        "trace": str(path), "requests": len(requests), "block_size": opts.block_size,
        "unbounded_hit_rate": results[-1].hit_rate, "ideal_hit_rate": hb / q,
        "ideal_hit_rate_512": h512 / q, "ideal_hit_rate_full_trace": hall / qall,
        "full_trace_requests": len(records),
        "by_capacity": [{"blocks": r.num_blocks, "hit_rate": r.hit_rate, "evictions": r.evictions,
                         "skipped": r.skipped} for r in results],
    })
    sec.text.append(
        f"Replayed the first {len(requests):,} of {len(records):,} requests. Unbounded cache: "
        f"{results[-1].hit_rate:.1%} of prompt tokens hit (ideal from hash_ids: {hb / q:.1%}). "
        f"Over the whole trace ({len(records):,} requests) the ideal is {hall / qall:.1%}: what an "
        "unbounded cache approaches as more of the trace is replayed (second table).")
    if "whole_trace_unbounded_hit_rate" in sec.data:
        sec.text.append(
            f"The whole trace through the manager at block size {WHOLE_BLOCK_SIZE} (third table): "
            f"{sec.data['whole_trace_unbounded_hit_rate']:.1%} of prompt tokens hit with an unbounded "
            f"cache (ideal {sec.data['whole_trace_ideal_hit_rate']:.1%}).")
    return sec
