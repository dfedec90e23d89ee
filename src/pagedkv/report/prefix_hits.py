"""Report section: prefix hit rate against cache capacity, on a real Mooncake trace.

The Mooncake conversation trace (FAST'25) gives, per request, one ``hash_id`` per 512-token block
of its prompt; equal ids mean an equal prefix. Every request of the trace is replayed through the
real :class:`pagedkv.KVCacheManager` at capacities from a few GiB of KV to a cache that never
evicts: each request is admitted (``add_sequence``, whose return value is the tokens served from
cache), its output appended, and sequences finish in arrival order with at most ``MAX_RUNNING``
resident; when blocks run out the oldest resident one finishes early. A finished sequence's full
blocks stay cached until evicted (least recently freed first), so capacity decides how much
history survives.

The whole-trace replays run at the trace's own granularity with one token per 512-token block: a
block-size-1 manager whose tokens name the trace's blocks chains the same hashes, evicts the same
blocks and hits the same blocks as a block-size-512 manager fed every token, at 1/512 of the
hashing (``block_replay``; a test checks the two agree exactly). Two checks need neither the
manager nor tokens, computed straight from the ``hash_ids``:

- the **ideal** hit rate with an unbounded cache under the manager's rules at block size B (only
  full blocks; the last prompt token is always computed): ``floor(min(512 k, L - 1) / B) * B`` for
  ``k`` leading ids already seen. The unbounded replay must equal it exactly;
- the ideal as more of the trace is replayed: a cold cache hits nothing, so the first requests
  alone can reach only part of the whole trace's rate.

Worked number: over the whole trace (12,031 requests, 144.8M prompt tokens) the ideal is 37.3% of
prompt tokens; the first 2,000 requests alone reach 29.4%.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable


from .. import KVCacheManager
from ..checks import int_at_least, optional_int_at_least
from ..sim.cache_replay import HitCounts, admit, append
from ..sim.request import Request, segment_tokens
from ..sim.sizing import GIB, get_model, kv_size
from ..sim.traces import (
    MOONCAKE_BLOCK,
    bundled_data_dir,
    content_key,
    detect_format,
    load_mooncake_jsonl,
    mooncake_hash_ids,
    trace_not_found,
    trace_path,
)
from .tables import Section, Table
from .options import ReportOptions

__all__ = ["section", "replay", "block_replay", "ideal_hits", "ReplayResult", "MAX_RUNNING"]

MAX_RUNNING = 16  # sequences resident at once in the replay
# Whole-trace capacities, as fractions of the cache that never evicts (1/512 of it is about 36 GiB
# of Llama-3.1-8B KV, one GPU's worth; 1 is 18 TiB).
WHOLE_FRACTIONS = (1 / 512, 1 / 128, 1 / 32, 1 / 16, 1 / 8, 1 / 4)
QUICK_WHOLE_FRACTIONS = (1 / 128, 1 / 16)
CHECK_REQUESTS, QUICK_CHECK_REQUESTS = 200, 100  # token-level replay at the report's block size
QUICK_TRACE_REQUESTS = 1_500  # --quick replays the start of the trace, not all of it
IDEAL_PREFIXES = (250, 500, 1_000, 2_000, 4_000, 8_000)
HASH_ALGO = "builtin"  # fastest; hits do not depend on the hash function (no collisions in practice)


@dataclass(frozen=True)
class ReplayResult(HitCounts):
    """What one replay measured (tokens counted by the manager's own ``usage()``), at
    ``num_blocks`` blocks of ``block_size`` tokens of the replayed trace (512 for a block replay)."""

    num_blocks: int
    block_size: int


def _check_args(num_blocks: int, block_size: int, max_running: int) -> None:
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size), ("max_running", max_running)):
        int_at_least(name, v, 1, expected="a positive int")


def _drive(items: Iterable[tuple], n: int, num_blocks: int, block_size: int, max_running: int,
           hash_algo: str, progress: Callable[[int], None] | None) -> tuple[KVCacheManager, set[int]]:
    """Admit each ``(prompt tokens, output tokens)`` in order; (the manager, indices of the
    requests skipped because they never fit)."""
    m = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True, hash_algo=hash_algo,
                       enable_events=False)
    running: list[int] = []
    skipped: set[int] = set()
    quarter = max(1, -(-n // 4))
    for i, (prompt, output) in enumerate(items):
        if progress is not None and i and i % quarter == 0:
            progress(i)
        while len(running) >= max_running:
            m.free(running.pop(0))
        if not admit(m, running, i, prompt):
            skipped.add(i)
            continue
        if len(output):
            append(m, running, i, output)
        running.append(i)
    return m, skipped


def _check_requests(requests) -> None:
    if not isinstance(requests, list) or not all(isinstance(r, Request) for r in requests):
        raise ValueError("requests must be a list of Request")


def replay(requests: list[Request], num_blocks: int, block_size: int, *,
           max_running: int = MAX_RUNNING, append_outputs: bool = True,
           hash_algo: str = HASH_ALGO, progress: Callable[[int], None] | None = None) -> ReplayResult:
    """Replay ``requests`` token by token, in order, through a fresh manager of ``num_blocks``.

    ``progress``, when given, is called with the number of requests replayed so far after each
    quarter of them. Example: the first 200 Mooncake requests with a cache that never evicts hit
    ~6% of their prompt tokens (the ideal for those 200).
    """
    _check_requests(requests)
    _check_args(num_blocks, block_size, max_running)

    def items():
        for i, r in enumerate(requests):
            out = segment_tokens(content_key("unique", "prefix-hits#output", i), r.output_len) \
                if append_outputs and r.output_len else ()
            yield r.prompt_array(), (out.tolist() if len(out) else ())

    m, skipped = _drive(items(), len(requests), num_blocks, block_size, max_running, hash_algo, progress)
    u = m.usage()
    return ReplayResult(len(requests), len(skipped), u.prefix_query_tokens, u.prefix_hit_tokens, u.evictions,
                        num_blocks, block_size)


def _block_tokens(requests: list[Request], block: int, append_outputs: bool):
    """Per request, ``(prompt, output)`` with two tokens per full ``block``-token block and one per
    partial block: a block-size-2 manager then holds exactly one block per trace block, full where
    the trace's is full (published, hit, cached when freed) and half full where it is partial
    (never published, clean when freed), which is all a manager's behaviour depends on.

    A segment of exactly ``block`` tokens starting on a block boundary (a Mooncake hash id) becomes
    two copies of the token its content key maps to, so equal ids give equal blocks. Every other
    block (content unique to the request: a partial last block, or tokens past the trace's ids) gets
    fresh tokens. The output is as many fresh tokens as take the sequence from ``L`` to ``L + out``
    trace tokens in this encoding: filling the partial block, then one block per trace block.
    Example (block 512): prompt 1,100 tokens, ids [a, b, c], output 500 -> prompt [a, a, b, b, x]
    (x for c's 76 tokens), output [y, z] (y fills x's block: 1,024 tokens; z starts the 1,600th).
    """
    ids: dict[int, int] = {}
    fresh = [0]

    def new() -> int:
        fresh[0] += 1
        return fresh[0] - 1

    def encoded(n_tokens: int) -> int:  # tokens of this encoding for a sequence of n trace tokens
        return 2 * (n_tokens // block) + (n_tokens % block != 0)

    for r in requests:
        prompt, pos = [], 0
        for key, length in r.segments:
            if length == block and pos % block == 0:
                tok = ids.get(key)
                if tok is None:
                    tok = ids[key] = new()
                prompt += [tok, tok]
            elif length > 0:
                prompt += [new() for _ in range(encoded(pos + length) - encoded(pos))]
            pos += length
        total = r.prompt_len + (r.output_len if append_outputs else 0)
        yield prompt, [new() for _ in range(encoded(total) - encoded(r.prompt_len))]


def block_replay(requests: list[Request], num_blocks: int, block: int = MOONCAKE_BLOCK, *,
                 max_running: int = MAX_RUNNING, append_outputs: bool = True,
                 hash_algo: str = HASH_ALGO) -> ReplayResult:
    """:func:`replay` at block size ``block`` with each trace block encoded in two tokens (see
    :func:`_block_tokens`): the same hits, evictions and skips as ``replay(requests, num_blocks,
    block)`` for a trace whose shared content comes in whole aligned blocks (Mooncake), with
    ``2 / block`` of the tokens to hash. Hit and query tokens are counted in the trace's tokens (a
    hit is always a full block of ``block`` tokens)."""
    _check_requests(requests)
    _check_args(num_blocks, block, max_running)
    if block % 2:
        raise ValueError(f"block must be even (two tokens encode a full block), got {block}")
    m, skipped = _drive(_block_tokens(requests, block, append_outputs), len(requests), num_blocks, 2,
                        max_running, hash_algo, None)
    u = m.usage()
    query = sum(r.prompt_len for i, r in enumerate(requests) if i not in skipped)
    return ReplayResult(len(requests), len(skipped), query, u.prefix_hit_tokens // 2 * block, u.evictions,
                        num_blocks, block)


def ideal_hits(records: list[tuple[int, list[int]]], block_size: int | None = None) -> tuple[int, int]:
    """``(hit tokens, prompt tokens)`` with an unbounded cache, straight from the hash ids.

    ``block_size=None``: the trace's granularity, ``min(512 k, L)`` per request for ``k`` leading ids
    already seen. Otherwise the manager's rules at that block size: ``floor(min(512 k, L - 1) / B) * B``.
    Example: ids [0, 1] then [0, 2] (1024 tokens each) -> (512, 2048) at the trace's granularity.
    """
    block_size = optional_int_at_least("block_size", block_size, 1, expected="None or a positive int")
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


# ---- the section ------------------------------------------------------------------------------


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


def describe_trace(path: Path, opts: ReportOptions) -> str:
    """Which file was read, in words: the user's ``--trace`` by name, the copy shipped with pagedkv,
    or a data directory's copy (``--data-dir`` / ``PAGEDKV_DATA``)."""
    path = Path(path)
    if opts.trace is not None and path == Path(opts.trace):
        return f"the trace file {path.name} (given with --trace)"
    if path.parent.resolve() == Path(bundled_data_dir()).resolve():
        return "the Mooncake conversation trace shipped with pagedkv (FAST'25)"
    return f"{path.name} from {path.parent}"


def _never_evicts(requests: list[Request], block_size: int) -> int:
    """Blocks a cache needs to never evict: every request's prompt and output, whole blocks."""
    return sum(math.ceil(r.total_len / block_size) for r in requests)


def _capacities(requests: list[Request], block_size: int, fractions) -> tuple[list[tuple[str, int]], int]:
    """``[(label, blocks)]`` of the bounded capacities (fractions of a cache that never evicts, at
    least one block more than the largest request) and that cache's size in blocks."""
    never = _never_evicts(requests, block_size)
    floor = max(math.ceil(r.total_len / block_size) for r in requests) + 1
    out = {}
    for f in sorted(fractions):
        blocks = max(floor, int(never * f))
        if blocks < never:
            out.setdefault(blocks, f"1/{round(1 / f)}" if blocks == int(never * f) else f"{blocks / never:.3g}")
    return [(label, b) for b, label in out.items()], never


def _gib(blocks: int, block_size: int, bytes_per_token: int) -> float:
    return blocks * block_size * bytes_per_token / GIB


def _whole_trace(requests: list[Request], records, opts: ReportOptions, data: dict, scope: str) -> Table:
    """Every request read (the whole trace, or its start with --quick) through the manager at the
    trace's granularity (block replay)."""
    block = MOONCAKE_BLOCK
    bpt = kv_size(get_model(opts.model)).bytes_per_token
    bounded, never = _capacities(requests, block, QUICK_WHOLE_FRACTIONS if opts.quick else WHOLE_FRACTIONS)
    results = []
    for k, (label, blocks) in enumerate(bounded + [("unbounded", never)], 1):
        opts.note(f"prefix_hits, {len(requests):,} requests: capacity {k}/{len(bounded) + 1}, "
                  f"{blocks:,} blocks of {block}")
        results.append((label, block_replay(requests, blocks, block)))
    h, q = ideal_hits(records, block)
    gib = f"KV GiB ({opts.model})"
    t = Table(f"Prefix hit rate vs cache capacity: {scope} ({len(requests):,} requests) through the "
              f"manager, {block}-token blocks",
              ["capacity", "blocks", gib, "hit rate %", "ideal, unbounded %", "evictions", "skipped"],
              plot={"name": "prefix_hits_capacity", "x": gib, "y": ["hit rate %"], "kind": "line",
                    "logx": True, "logx_base": 10, "ymin": 0,
                    "hline": ["ideal, unbounded %", "ideal (unbounded cache)"],
                    "ylabel": "% of prompt tokens served from cache",
                    "xlabel": f"KV cache capacity, GiB of {opts.model} KV (log scale)",
                    "title": f"Mooncake, {scope}: prefix hit rate vs cache capacity ({block}-token blocks)"})
    for label, res in results:
        t.add(label, res.num_blocks, round(_gib(res.num_blocks, block, bpt), 1), round(100 * res.hit_rate, 2),
              round(100 * h / q, 2), res.evictions, res.skipped)
    t.notes += [
        f"capacity as a fraction of {never:,} blocks, enough to never evict; GiB = blocks x {block} tokens "
        f"x {bpt:,} KV bytes per token of {opts.model}; at most {MAX_RUNNING} sequences resident, "
        "finished in arrival order; each request's output (as many unique tokens as the trace records) "
        "is appended to its sequence before it finishes, so generated blocks take cache space too",
        f"replayed with each {block}-token block encoded in two tokens of a block-size-2 manager (a "
        f"test checks it matches a token-by-token replay at block size {block} exactly); hash "
        f"{HASH_ALGO!r} (sha256 gives the same hits)",
        "ideal: an unbounded cache, from hash_ids alone under the manager's rules (full blocks only, "
        "the last prompt token always computed); the unbounded replay must equal it",
    ]
    data.update({
        "whole_trace_hit_rate": results[-1][1].hit_rate, "whole_trace_ideal_hit_rate": h / q,
        "by_capacity": [{"capacity": label, "blocks": r.num_blocks, "block_size": block,
                         "gib": _gib(r.num_blocks, block, bpt), "hit_rate": r.hit_rate, "evictions": r.evictions,
                         "skipped": r.skipped} for label, r in results],
        "never_evicts_blocks": never, "never_evicts_gib": _gib(never, block, bpt),
    })
    return t


def _block_size_check(requests: list[Request], records, opts: ReportOptions, data: dict) -> Table:
    """The first requests token by token at the report's block size: unbounded = ideal, exactly."""
    bs = opts.block_size
    never = _never_evicts(requests, bs)
    opts.note(f"prefix_hits, first {len(requests):,} token by token: {never:,} blocks of {bs}")
    res = replay(requests, never, bs)
    h, q = ideal_hits(records, bs)
    t = Table(f"Check at block size {bs}: the first {len(requests):,} requests token by token, unbounded cache",
              ["requests", "block size", "prompt tokens", "hit rate (manager) %", "ideal (hash_ids) %",
               "equal"])
    t.add(len(requests), bs, res.query_tokens, round(100 * res.hit_rate, 3), round(100 * h / q, 3),
          res.hit_tokens == h and res.query_tokens == q)
    data["check"] = {"requests": len(requests), "block_size": bs, "hit_rate": res.hit_rate, "ideal": h / q,
                     "hit_tokens": res.hit_tokens, "ideal_hit_tokens": h}
    return t


def _ideal_table(records, block_size: int) -> Table:
    """The ideal hit rate against the history replayed, under the manager's rule (full blocks
    only, the prompt's last token always computed) at the trace's 512-token blocks, which the
    capacity table replays, and at the report's block size (hits inside a partial 512-token
    block count there)."""
    c512, cbs = "hit rate %, 512-token blocks", f"hit rate %, block size {block_size}"
    t = Table("Ideal hit rate (unbounded cache, from hash_ids, the manager's rule) vs how much of the "
              "trace is replayed",
              ["requests", c512, cbs],
              plot={"name": "prefix_hits_history", "x": "requests", "y": [c512, cbs],
                    "kind": "line", "logx": True, "ymin": 0, "ylabel": "% of prompt tokens hit (ideal)",
                    "xlabel": "requests replayed from the start of the trace (log scale)",
                    "styles": {cbs: {"linestyle": "--", "marker": "x"}}, "label_last": "requests replayed",
                    "title": "Ideal prefix hit rate (unbounded cache) against the history replayed, "
                             "Mooncake conversation trace"})
    for k in sorted({k for k in IDEAL_PREFIXES if k < len(records)} | {len(records)}):
        h, q = ideal_hits(records[:k], MOONCAKE_BLOCK)
        hb, _ = ideal_hits(records[:k], block_size)
        t.add(k, round(100 * h / q, 2), round(100 * hb / q, 2))
    t.notes.append("the whole trace's rate is the last row; a replay of only its first requests can reach "
                   "no more than its own row. Both columns follow the manager's rule, as the capacity "
                   "table's replay does: only full blocks hit and the prompt's last token is always "
                   "computed, so its 512-token column's last row is the capacity table's unbounded rate.")
    return t


def section(opts: ReportOptions) -> Section:
    """Prefix hit rate against cache capacity on a Mooncake trace (see the module docstring)."""
    if not isinstance(opts, ReportOptions):
        raise ValueError(f"opts must be ReportOptions, got {type(opts).__name__}")
    sec = Section("prefix_hits", "Prefix hits vs cache capacity (Mooncake trace)")
    path, wrong_kind = _mooncake_file(opts)
    if wrong_kind:
        sec.text.append(wrong_kind)
        sec.data["trace_not_used"] = str(opts.trace)
    if path is None:
        sec.text.append(f"{trace_not_found('mooncake', opts.data_dir)}: section skipped.")
        sec.data["skipped"] = True
        return sec
    limit = QUICK_TRACE_REQUESTS if opts.quick else None
    requests = load_mooncake_jsonl(path, limit=limit)
    records = mooncake_hash_ids(path, limit=limit)
    what = describe_trace(path, opts)
    prompt_tokens = sum(n for n, _ in records)
    sec.intro = (f"Share of prompt tokens served from the prefix cache, replaying {what}: "
                 f"{len(requests):,} requests, {prompt_tokens / 1e6:.1f}M prompt tokens, through "
                 "KVCacheManager at several capacities.")
    data = sec.data
    scope = f"the first {len(requests):,} requests (--quick)" if opts.quick else "the whole trace"
    whole = _whole_trace(requests, records, opts, data, scope)
    n = QUICK_CHECK_REQUESTS if opts.quick else CHECK_REQUESTS
    check = _block_size_check(requests[:n], records[:n], opts, data)
    sec.tables += [whole, check, _ideal_table(records, opts.block_size)]
    caps = data["by_capacity"]
    shown = [caps[0]] + [c for c in caps if c["capacity"] == "1/16"]
    by_size = ", ".join(f"{c['gib']:,.0f} GiB ({c['capacity']}) serves {c['hit_rate']:.1%}" for c in shown)
    sec.text.insert(0,
        f"{scope[0].upper()}{scope[1:]} ({len(requests):,} requests): an unbounded cache serves "
        f"{data['whole_trace_hit_rate']:.1%} of prompt tokens (ideal from hash_ids: "
        f"{data['whole_trace_ideal_hit_rate']:.1%}); it needs {data['never_evicts_gib']:,.0f} GiB of "
        f"{opts.model} KV. Bounded: {by_size}. A replay of the first requests alone reaches less (last "
        "table): a cold cache hits nothing.")
    data.update({"trace": str(path), "trace_description": what, "requests": len(requests),
                 "prompt_tokens": prompt_tokens, "block_size": opts.block_size, "model": opts.model})
    return sec
