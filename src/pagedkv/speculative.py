"""Draft proposers for speculative decoding: prompt-lookup n-grams, or a second, smaller model.

The engine (:class:`pagedkv.engine.Engine`) verifies drafts: each step it feeds a decoding
sequence its last chosen token plus up to ``k`` drafts in one forward pass, keeps the drafts its
own greedy choice agrees with, and rolls back the rest with ``KVCacheManager.accept``. A drafter
only guesses; a wrong guess costs compute, never correctness. Every drafter has three methods,
called by the engine with the target's sequence ids:

- ``propose(batch)``: ``batch`` is a list of ``(seq_id, context, k)``, ``context`` the sequence's
  tokens so far (prompt + generated, the last one not yet fed to the target); returns
  ``{seq_id: drafts}`` with at most ``k`` drafts each (fewer, or none, is fine);
- ``settle(seq_id, accepted)``: the target kept the first ``accepted`` drafts of the last proposal;
- ``release(seq_id)``: the sequence finished (or was dropped).

:class:`NgramDrafter` needs no model (prompt lookup: when the text repeats itself, the tokens that
followed the last occurrence of the current suffix are a good guess). :class:`DraftModelDrafter`
runs a smaller :class:`~pagedkv.model.PagedLlama` greedily over its own manager and store, and
rolls its own drafts back with ``accept`` the same way the target does. Both need numpy only.

May import numpy, :mod:`pagedkv.checks` and :mod:`pagedkv.types`: a drafter drives its manager
and model through their public calls and never imports the engine that calls it.
"""
from __future__ import annotations

from typing import Any, Hashable, Sequence

import numpy as np

from .checks import int_at_least
from .types import OutOfBlocks

__all__ = ["NgramDrafter", "DraftModelDrafter", "ngram_drafts"]

Batch = Sequence[tuple[Hashable, Sequence[int], int]]


def ngram_drafts(tokens: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Prompt lookup: up to ``k`` tokens that followed an earlier occurrence of the suffix.

    The suffix length ``n`` is tried from ``max_ngram`` down to ``min_ngram``; the first ``n``
    whose last ``n`` tokens occurred earlier wins. Its drafts are what followed the latest
    occurrence that is followed by ``k`` tokens, or else the earliest occurrence (the longest
    continuation there is). Example: ``[5, 6, 7, 9, 5, 6]`` with ``k = 2``: the suffix ``[5, 6]``
    occurred at position 0, followed by ``[7, 9]``: drafts ``[7, 9]``. In a run ``[8, 8, 8, 8, 8]``
    with ``k = 3`` the latest ``[8, 8, 8]`` before the suffix is followed by one token only, the
    earliest by two: drafts ``[8, 8]``.
    """
    toks = np.asarray(tokens, dtype=np.int64)
    length = toks.size
    if k < 1:
        return []
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(toks[:-1], n)  # starts 0..len-n-1
        hits = np.flatnonzero((windows == toks[length - n:]).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= length]
            start = int(full[-1] if full.size else hits[0]) + n
            return toks[start:start + k].tolist()
    return []


class NgramDrafter:
    """Drafts by prompt lookup (no model): see :func:`ngram_drafts`.

    ``num_drafts`` is ``k``, the most drafts per step; the engine may ask for fewer (token
    budget, tokens left to generate). Worked number: on a sequence that has fallen into a
    period-5 loop, every lookup's drafts are right and a step emits ``k + 1`` tokens.
    """

    def __init__(self, num_drafts: int = 4, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.num_drafts = int_at_least("num_drafts", num_drafts, 1)
        self.max_ngram = int_at_least("max_ngram", max_ngram, 1)
        self.min_ngram = int_at_least("min_ngram", min_ngram, 1)
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram {min_ngram} > max_ngram {max_ngram}")

    def propose(self, batch: Batch) -> dict[Hashable, list[int]]:
        return {sid: ngram_drafts(ctx, min(k, self.num_drafts), self.max_ngram, self.min_ngram)
                for sid, ctx, k in batch if k > 0}

    def settle(self, seq_id: Hashable, accepted: int) -> None:
        """Stateless: nothing to roll back."""

    def release(self, seq_id: Hashable) -> None:
        """Stateless: nothing to free."""


class DraftModelDrafter:
    """Drafts from a smaller model, greedily, with its own manager and KV store.

    Per step the draft model first computes the context tokens it has not seen (the target's
    last chosen token, plus any drafts the target accepted that the draft model never fed: the
    last draft of a fully accepted run), which gives the first draft; each further draft is one
    more forward with the previous draft appended speculatively (``append_tokens(...,
    speculative=True)``). ``settle`` keeps the drafts the target accepted (``accept``) and so
    returns the draft model's blocks that held only rejected drafts. Its counters: ``forwards``,
    ``proposed`` (drafts returned) and ``rollback_blocks`` (draft-model blocks freed by rollback).

    The draft model must share the target's vocabulary (the engine checks ``vocab_size``).
    Sequences the draft manager cannot fit get no drafts that step (the target decodes them
    plainly), so a small draft pool slows speculation down but never stops generation.
    """

    def __init__(self, model: Any, manager: Any, num_drafts: int = 4, store: Any = None) -> None:
        self.num_drafts = int_at_least("num_drafts", num_drafts, 1)
        if len(getattr(model, "kv_groups", ())) > 1 or getattr(manager, "num_groups", 1) > 1:
            # its forward passes one slot array and one table: a full-attention draft only
            raise ValueError("the draft model must be full attention (one KV cache group); a hybrid "
                             "target may use a full-attention draft")
        if manager.num_host_blocks:
            # this drafter runs no host transfers: a host prefix hit would read unloaded blocks
            raise ValueError("the draft manager must have no host tier (host_blocks=0)")
        if store is None:
            store = model.new_store(manager.num_blocks, manager.block_size)
        if (store.num_blocks, store.block_size) != (manager.num_blocks, manager.block_size):
            raise ValueError(f"store has {store.num_blocks} blocks of {store.block_size}, manager "
                             f"{manager.num_blocks} of {manager.block_size}")
        self.model, self.manager, self.store = model, manager, store
        self.forwards = self.proposed = self.rollback_blocks = 0

    @property
    def vocab_size(self) -> int | None:
        return getattr(getattr(self.model, "dims", None), "vocab_size", None)

    def propose(self, batch: Batch) -> dict[Hashable, list[int]]:
        want = {sid: min(k, self.num_drafts) for sid, _, k in batch if k > 0}
        feeds, slots = {}, {}
        for sid, ctx, _ in batch:
            if sid in want:
                got = self._catch_up(sid, list(ctx))
                if got is not None:
                    feeds[sid], slots[sid] = got
        drafts: dict[Hashable, list[int]] = {}
        while feeds:
            for sid, row in self._run(feeds, slots).items():
                drafts.setdefault(sid, []).append(int(np.argmax(row)))
            feeds, slots = {}, {}
            for sid, d in drafts.items():
                if len(d) < want[sid]:
                    try:
                        slots[sid] = self.manager.append_tokens(sid, d[-1:], speculative=True)
                    except OutOfBlocks:
                        continue  # no room for another draft: propose what it has
                    feeds[sid] = d[-1:]
        self.proposed += sum(map(len, drafts.values()))
        return drafts

    def _catch_up(self, sid: Hashable, ctx: list[int]):
        """Admit or extend the draft sequence to ``ctx``; its feed and slots, or None (no room)."""
        m = self.manager
        try:
            if sid in m:
                feed = ctx[m.num_tokens(sid):]
                return (feed, m.append_tokens(sid, feed)) if feed else None
            hit = m.add_sequence(sid, ctx)
            return ctx[hit:], m.slots(sid, hit)
        except OutOfBlocks:
            return None

    def _run(self, feeds: dict, slots: dict) -> dict[Hashable, np.ndarray]:
        """One draft-model forward over every sequence's feed: each one's last logits."""
        m, ids = self.manager, list(feeds)
        self.store.copy_blocks(m.take_copies())
        qlens = [len(feeds[i]) for i in ids]
        toks = [t for i in ids for t in feeds[i]]
        flat = np.concatenate([np.asarray(slots[i], dtype=np.int64) for i in ids])
        lens = [m.num_computed(i) for i in ids]
        logits = np.asarray(self.model.forward(self.store, toks, flat, m.block_tables(ids), lens, qlens),
                            dtype=np.float32)
        self.forwards += 1
        ends = np.cumsum(qlens) - 1
        return {i: logits[e] for i, e in zip(ids, ends)}

    def settle(self, seq_id: Hashable, accepted: int) -> None:
        m = self.manager
        if seq_id in m and m.num_drafts(seq_id):
            before = len(m.block_table(seq_id))
            m.accept(seq_id, min(accepted, m.num_drafts(seq_id)))
            self.rollback_blocks += before - len(m.block_table(seq_id))

    def release(self, seq_id: Hashable) -> None:
        if seq_id in self.manager:
            self.manager.free(seq_id)
