"""Report section: chunked prefill and speculative decoding, read from a real manager.

Three questions, each answered by driving :class:`pagedkv.KVCacheManager` (numpy only, no model):

(a) **When is each block published in a chunked prefill?** A prompt of ``5.5`` blocks plus 2
    tokens is scheduled in chunks of 1.5 blocks (``add_sequence(..., prefill=k)``, then
    ``prefill(id, k)``); after each step the table reads what the manager holds, how many blocks
    its event stream says it published, and what a second prompt sharing the first 4 blocks
    would hit (``lookup``, side-effect free) at that moment, next to what it would hit if the
    whole prompt had been admitted at once (``prefill=None``, which publishes every full block
    at admission, before any chunk is computed). Worked number (block size 16, 90-token prompt,
    chunks of 24): after the first step 24 positions are scheduled, 1 block is published and the
    second prompt would hit 16 tokens; admitted whole, it would hit 64, of which 48 hold no K/V.
(b) **Memory held mid-prefill.** Chunked allocation takes blocks as chunks need them; allocating
    the whole prompt at admission holds them all from the first chunk on. Over a prefill of ``n``
    equal chunks the chunked way holds ``(n + 1) / 2n`` as much on average (53% for 16 chunks).
(c) **Blocks freed by rolling back rejected drafts.** A seeded simulation: every step each
    sequence appends its last token and ``k`` drafts (``speculative=True``); each draft is right
    with probability ``p`` and the target keeps the drafts up to the first wrong one
    (``accept``). The table counts the blocks ``accept`` returned, and the blocks (and rejected
    tokens) that a manager publishing drafts as they fill a block would have put in the prefix
    cache with wrong content; the manager's own events are checked to hold only accepted tokens.
"""
from __future__ import annotations

import textwrap
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..manager import KVCacheManager
from ..sim.sizing import kv_bytes_per_token
from .tables import Section, Table
from ..types import BlockStored
from .options import ReportOptions

__all__ = ["section", "timeline", "memory_rows", "rollback_run", "RollbackRun",
           "ACCEPT_RATES", "DRAFT_LENGTHS"]

KEY, HEADING = "chunked_spec", "Chunked prefill and speculative decoding"
ACCEPT_RATES = (0.3, 0.6, 0.9)
DRAFT_LENGTHS = (4, 8)
VOCAB = 32_000
MIB = 2**20
WIDTH = 96  # printed lines stay under 100 columns


def _wrap(text: str, indent: str = "") -> list[str]:
    """A note, whole: the table wraps its notes itself (a note split here would read as two
    paragraphs, cut mid-sentence). ``indent`` is kept for callers and ignored."""
    return [text]


def _published(events) -> list[tuple]:
    """The token tuples of every block a list of events stored, in order."""
    out = []
    for ev in events:
        if isinstance(ev, BlockStored):
            bs = ev.block_size
            out += [tuple(ev.token_ids[i * bs:(i + 1) * bs]) for i in range(len(ev.block_hashes))]
    return out


# ---- (a) the publishing timeline


def timeline_shape(bs: int) -> tuple[int, int, int]:
    """(prompt length, chunk, shared prefix): 5.5 blocks + 2 tokens, chunks of 1.5 blocks, 4
    blocks shared with the second prompt. Block size 16: (90, 24, 64)."""
    return 5 * bs + max(1, bs // 2) + 2, max(1, bs + bs // 2), 4 * bs


def timeline(bs: int, seed: int = 0) -> list[dict]:
    """One row per step of a chunked prefill (then the decode steps that fill the last partial
    block), read from a real manager; see the module docstring."""
    n, chunk, shared = timeline_shape(bs)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, VOCAB, n).tolist()
    second = prompt[:shared] + rng.integers(1, VOCAB, bs // 2 + 3).tolist()
    whole = KVCacheManager(64, bs)
    whole.add_sequence("A", prompt)  # prefill=None: every full block published at admission
    m = KVCacheManager(64, bs)
    rows, step, published = [], 0, 0
    while True:
        done = m.num_computed("A") if "A" in m else 0
        if done < n:
            k = min(chunk, n - done)
            if "A" in m:
                m.prefill("A", k)
            else:
                m.add_sequence("A", prompt, prefill=k)
            what = f"prefill {done}-{done + k}"
        else:
            m.append_token("A", int(rng.integers(1, VOCAB)))
            what = "decode 1 token"
        new = len(_published(m.take_events()))
        published += new
        rows.append({"step": step, "scheduled": what, "computed": m.num_computed("A"),
                     "table": len(m.block_table("A")), "published": new, "pub. total": published,
                     "full blocks": m.num_computed("A") // bs,
                     "B hits": m.lookup(second), "B hits, whole": whole.lookup(second)})
        step += 1
        if m.num_computed("A") >= n and m.num_computed("A") % bs == 0:
            return rows


def _timeline_table(rows, bs) -> Table:
    n, chunk, shared = timeline_shape(bs)
    t = Table(f"(a) publishing: {n}-token prompt A in chunks of {chunk}, block size {bs}; "
              f"B shares A's first {shared}",
              list(rows[0]),
              plot={"name": "chunked_prefix_hits", "x": "step", "y": ["B hits", "B hits, whole"], "kind": "line",
                    "ymin": 0, "xlabel": "scheduler step (one chunk of A per step, then decoding)",
                    "ylabel": "tokens of B's prompt found in the prefix cache",
                    "legend": {"B hits": "A prefilled in chunks: blocks published as scheduled",
                               "B hits, whole": "A admitted whole: every full block published at once"},
                    "styles": {"B hits, whole": {"linestyle": "--", "marker": "s"}},
                    "title": f"What a second prompt B finds in the prefix cache while A ({n} tokens) is "
                             f"prefilled in chunks of {chunk} (block size {bs})"})
    for r in rows:
        t.add(*r.values())
    for note in (
            "computed: A's tokens in KV; table: blocks in A's table; published: blocks this step made "
            "findable by other requests' prefix lookups (announced as BlockStored, vLLM's KV event for "
            "a block entering the prefix cache); full blocks: computed // block size (= pub. total: "
            "the manager publishes a block once all its positions are scheduled)",
            "B hits: lookup(B) right after this step's scheduling (side-effect free). Chunked, B hits "
            "only blocks whose positions are all scheduled: a block published in this step is "
            "computed in this step's forward, before B's attention reads it",
            "B hits, whole: A admitted whole (add_sequence with no chunk size: every "
            "prompt position counts as scheduled at admission) publishes every full block at step 0, "
            "before an engine computing the prompt in chunks has its K/V. A's last partial block is "
            "published when decoding fills it"):
        t.notes += _wrap(note, "  ")
    return t


# ---- (b) memory held mid-prefill


def memory_rows(prompt_len: int, chunk: int, bs: int) -> list[tuple[int, int, int]]:
    """After each chunk: (positions computed, blocks held chunked, blocks held if the whole
    prompt is allocated at admission), read from two real managers."""
    prompt = [(7 * i) % VOCAB + 1 for i in range(prompt_len)]
    blocks = -(-prompt_len // bs) + 1
    chunked = KVCacheManager(blocks, bs, enable_events=False)
    whole = KVCacheManager(blocks, bs, enable_events=False)
    whole.add_sequence("A", prompt)  # the whole prompt's blocks, from the first chunk on
    rows, done = [], 0
    while done < prompt_len:
        k = min(chunk, prompt_len - done)
        if done:
            chunked.prefill("A", k)
        else:
            chunked.add_sequence("A", prompt, prefill=k)
        done += k
        rows.append((done, blocks - chunked.num_free_blocks, blocks - whole.num_free_blocks))
    return rows


def _memory_summary(rows, block_bytes, data) -> None:
    """What a chunked prefill holds against a whole one, averaged over its chunks, into ``data``
    (the text states it: blocks grow one chunk at a time, so a table of them is a straight line)."""
    prompt_len, chunk = rows[-1][0], rows[0][0]
    held, whole = sum(r[1] for r in rows), sum(r[2] for r in rows)
    data.update(memory_prompt_tokens=prompt_len, memory_chunk=chunk, memory_chunks=len(rows),
                mean_blocks_chunked=held / len(rows), mean_blocks_whole=whole / len(rows),
                mean_held_ratio=held / whole, block_bytes=block_bytes)


# ---- (c) rollback of rejected drafts


@dataclass
class RollbackRun:
    """One seeded speculative run: totals, and one record per verify step
    ``(tokens before the drafts, drafts, accepted, blocks accept returned)``."""

    p: float
    k: int
    block_size: int
    records: list[tuple[int, int, int, int]] = field(default_factory=list)
    published_blocks: int = 0  # blocks the manager's events stored
    published_wrong: int = 0  # of them, blocks whose tokens are no sequence's accepted tokens
    peak_blocks: int = 0

    @property
    def drafts(self) -> int:
        return sum(r[1] for r in self.records)

    @property
    def accepted(self) -> int:
        return sum(r[2] for r in self.records)

    @property
    def freed(self) -> int:
        return sum(r[3] for r in self.records)

    @property
    def wrong_blocks_without_rollback(self) -> int:
        """Blocks the drafts filled that hold a rejected draft: what publishing drafts as they
        fill a block would have put in the cache with wrong content."""
        bs = self.block_size
        return sum(max(0, (n + d) // bs - (n + a) // bs) for n, d, a, _ in self.records)

    @property
    def wrong_tokens_without_rollback(self) -> int:
        """Rejected drafts inside those blocks."""
        bs = self.block_size
        return sum(max(0, (n + d) // bs * bs - (n + a)) for n, d, a, _ in self.records)


def rollback_run(p: float, k: int, bs: int, seqs: int, steps: int, seed: int = 0) -> RollbackRun:
    """``seqs`` sequences decode ``steps`` speculative steps each on a real manager."""
    rng = np.random.default_rng([seed, round(100 * p), k, bs])
    prompts = [rng.integers(1, VOCAB, int(rng.integers(1, 8 * bs + 1))).tolist() for _ in range(seqs)]
    need = sum(-(-(len(q) + steps * (k + 1) + 1) // bs) for q in prompts)
    m = KVCacheManager(need + 1, bs)
    run = RollbackRun(p, k, bs)
    last = {}
    for i, q in enumerate(prompts):
        m.add_sequence(i, q)
        last[i] = int(rng.integers(1, VOCAB))
    for _ in range(steps):
        for i in range(seqs):
            m.append_token(i, last[i])  # last step's chosen token: an ordinary token
            n = m.num_tokens(i)
            m.append_tokens(i, rng.integers(1, VOCAB, k).tolist(), speculative=True)
            right = rng.random(k) < p
            a = k if right.all() else int(np.argmin(right))  # drafts up to the first wrong one
            run.peak_blocks = max(run.peak_blocks, m.num_blocks - m.num_free_blocks)
            free = m.num_free_blocks
            m.accept(i, a)
            run.records.append((n, k, a, m.num_free_blocks - free))
            last[i] = int(rng.integers(1, VOCAB))  # the target's own token after the kept drafts
    stored = _published(m.take_events())
    accepted = Counter()
    for i in range(seqs):
        toks = m.tokens(i)
        accepted.update(tuple(toks[j:j + bs]) for j in range(0, len(toks) // bs * bs, bs))
    run.published_blocks = len(stored)
    run.published_wrong = sum((Counter(stored) - accepted).values())
    m.check_invariants()
    return run


def _rollback_table(runs, block_bytes, model, seqs, steps) -> Table:
    t = Table(f"(b) rollback: {seqs} sequences x {steps} steps of k drafts, each right with "
              f"probability p",
              ["p", "k", "accepted %", "tok/step", "freed", "MiB freed", "wrong blk", "wrong tok",
               "published", "pub. wrong"],
              plot={"name": "spec_rollback", "x": "p", "xlabels": ["k", "p"], "y": ["freed", "wrong blk"],
                    "kind": "bar", "ylabel": "blocks (count over the run)", "xlabel": "drafts per step k, each right with probability p",
                    "legend": {"freed": "blocks accept() freed (held only rejected drafts)",
                               "wrong blk": "blocks that would hold wrong tokens without rollback"}})
    for r in runs:
        verifies = len(r.records)
        t.add(r.p, r.k, 100 * r.accepted / r.drafts, (r.accepted + verifies) / verifies, r.freed,
              r.freed * block_bytes / MIB, r.wrong_blocks_without_rollback,
              r.wrong_tokens_without_rollback, r.published_blocks, r.published_wrong)
    for note in (
            "accepted %: kept / drafted; below p, as drafts are kept only up to the first wrong one. "
            "tok/step: kept drafts + the target's own token",
            f"freed: blocks accept() returned (free-count delta), whose only tokens were rejected "
            f"drafts; MiB freed: those blocks for {model}",
            "wrong blk / wrong tok: blocks the drafts filled that hold a rejected draft, and the "
            "rejected drafts in them: what a manager publishing drafts as they fill a block would "
            "have cached with wrong content",
            "published: blocks the manager entered into its prefix cache (its BlockStored events); "
            "pub. wrong: those whose tokens are no sequence's accepted tokens"):
        t.notes += _wrap(note, "  ")
    return t


def section(opts: ReportOptions) -> Section:
    """Chunked prefill and speculative decoding on a real manager (see the module docstring)."""
    if not isinstance(opts, ReportOptions):
        raise ValueError(f"opts must be ReportOptions, got {type(opts).__name__}")
    bs = opts.block_size
    block_bytes = kv_bytes_per_token(opts.model) * bs
    prompt_len, chunk = (2048, 256) if opts.quick else (8192, 512)
    seqs, steps = (4, 50) if opts.quick else (16, 200)
    data: dict = {"block_size": bs, "model": opts.model}
    rows = timeline(bs, opts.seed)
    data["timeline_computed"] = [r["computed"] for r in rows]
    data["timeline_lookup"] = [r["B hits"] for r in rows]
    data["timeline_lookup_whole"] = [r["B hits, whole"] for r in rows]
    data["timeline_published"] = [r["pub. total"] for r in rows]
    mem = memory_rows(prompt_len, chunk, bs)
    runs = [rollback_run(p, k, bs, seqs, steps, opts.seed) for k in DRAFT_LENGTHS for p in ACCEPT_RATES]
    data["rollback"] = [{"p": r.p, "k": r.k, "drafts": r.drafts, "accepted": r.accepted,
                         "blocks_freed": r.freed, "wrong_blocks_without_rollback": r.wrong_blocks_without_rollback,
                         "wrong_tokens_without_rollback": r.wrong_tokens_without_rollback,
                         "published": r.published_blocks, "published_wrong": r.published_wrong}
                        for r in runs]
    sec = Section(KEY, HEADING, intro=textwrap.fill(
        "The manager's rule for chunked prefill and drafts, on the real manager: a block is "
        "published (entered into the prefix cache, where other requests' lookups find it, and "
        "announced as a BlockStored KV event in vLLM's format) only once every position in it is "
        "scheduled for compute; chunks allocate only what they schedule; draft tokens are never "
        "published and roll back with accept(). Every number below is read from KVCacheManager "
        "runs (numpy only, no model).", WIDTH))
    _memory_summary(mem, block_bytes, data)
    sec.tables = [_timeline_table(rows, bs), _rollback_table(runs, block_bytes, opts.model, seqs, steps)]
    sec.data = data
    first = rows[0]
    sec.text.append(textwrap.fill(
        f"After A's first chunk ({first['computed']} positions) B would hit {first['B hits']} tokens; "
        f"with A admitted whole, {first['B hits, whole']}. Prefilling a {data['memory_prompt_tokens']:,}-token "
        f"prompt in chunks of {data['memory_chunk']}, the chunked manager holds "
        f"{data['mean_held_ratio']:.0%} of the whole prompt's blocks on average (blocks grow with each "
        f"chunk). Blocks freed by "
        f"rollback (k={DRAFT_LENGTHS[0]}): "
        + ", ".join(f"p={r.p}: {r.freed:,}" for r in runs if r.k == DRAFT_LENGTHS[0]) + ".", WIDTH))
    return sec
