"""Contract v2: the modern engine loop (chunked prefill, speculative decoding, side-effect-free
lookup, batch-safe copies, pickling).

Exact expectations throughout, as in test_manager_basic.py: block size 4; a fresh manager hands
out blocks 0, 1, 2, ... in order; clean free blocks are a LIFO stack; full published blocks of a
freed sequence become cached-free, least recently freed evicted first, a sequence's tail before
its prefix. Expected hashes are never typed in: they come from a second manager that admits the
same tokens whole (v1 behaviour), so every chunked path must publish exactly what a whole
admission publishes, in the same order, only later.
"""
from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest

from pagedkv import BlockRemoved, BlockStored, CopyOp, KVCacheManager, OutOfBlocks
from conftest import removed_hashes, snapshot_v2, stored_blocks, toks

BS = 4


def mk(num_blocks=16, block_size=BS, **kw):
    return KVCacheManager(num_blocks=num_blocks, block_size=block_size, **kw)


def hashes_of(events):
    return [h for h, _, _ in stored_blocks(events)]


def whole(make, tokens, salt=None):
    """(hash, parent, tokens) of every full block of ``tokens`` admitted whole in a fresh manager:
    what the cache must end up publishing for them, in order."""
    ref = make(64, BS)
    ref.add_sequence("ref", tokens, cache_salt=salt)
    return stored_blocks(ref.take_events())


def assert_unchanged(m, before, ids):
    """After a refused or failed call: the same state, no queued events, no queued copies."""
    assert snapshot_v2(m, ids) == before
    assert m.take_events() == []
    assert m.take_copies() == []
    m.check_invariants()


# ---------------------------------------------------------------- lookup


def test_lookup_equals_the_following_add_sequence(make):
    """lookup returns exactly what add_sequence returns right after it: the longest run of
    cached full blocks, never the whole prompt, live or cached-free."""
    m = make(16, BS)
    assert m.add_sequence("a", toks(0, 10)) == 0  # [0, 1, 2]; blocks 0 and 1 published
    cases = [
        ("b", toks(0, 8) + [500, 501], 8),
        ("c", toks(0, 9), 8),
        ("d", toks(0, 8), 4),  # a whole-prompt hit is capped: the last token is computed
        ("e", toks(0, 3), 0),  # shorter than a block
        ("f", [999] * 10, 0),
        ("g", toks(0, 4) + [7] * 5, 4),
    ]
    for sid, prompt, want in cases:
        assert m.lookup(prompt) == want, sid
        assert m.add_sequence(sid, prompt) == want, sid
    for sid in ["a", "b", "c", "d", "e", "f", "g"]:
        m.free(sid)
    assert m.lookup(toks(0, 10)) == 8  # cached-free blocks count: they would be revived
    assert m.add_sequence("h", toks(0, 10)) == 8
    assert m.lookup([999] * 9) == 8
    m.check_invariants()


def test_lookup_changes_nothing(make):
    """lookup touches no LRU order, no statistic, no event: after many lookups of the least
    recently freed blocks, the evictions still take them first, in the original order."""
    m = make(6, BS)
    m.add_sequence("a", toks(0, 8))  # [0, 1]
    m.add_sequence("b", toks(100, 8))  # [2, 3]
    ha0, ha1, hb0, hb1 = hashes_of(m.take_events())
    m.free("a")  # tail first: LRU is 1, 0
    m.free("b")  # then 3, 2
    before = snapshot_v2(m)
    for _ in range(3):
        assert m.lookup(toks(0, 8) + [7]) == 8
        assert m.lookup(toks(0, 5)) == 4
        assert m.lookup(toks(100, 8) + [7], cache_salt="x") == 0
        assert m.lookup(toks(100, 9)) == 8
    assert snapshot_v2(m) == before  # usage() included: prefix statistics unchanged
    assert m.take_events() == [] and m.take_copies() == []
    m.add_sequence("c", toks(200, 12))  # fresh 4 and 5, then evicts the least recently freed
    assert m.block_table("c") == [4, 5, 1]
    assert removed_hashes(m.take_events()) == [ha1]
    m.add_sequence("d", toks(300, 12))
    assert m.block_table("d") == [0, 3, 2]
    assert removed_hashes(m.take_events()) == [ha0, hb1, hb0]
    m.check_invariants()


def test_lookup_sees_salts(make):
    m = make(16, BS)
    m.add_sequence("a", toks(0, 9), cache_salt="s")
    m.take_events()
    before = snapshot_v2(m, ["a"])
    assert m.lookup(toks(0, 9)) == 0
    assert m.lookup(toks(0, 9), cache_salt="s") == 8
    assert m.lookup(toks(0, 9), cache_salt="t") == 0
    assert m.lookup(toks(0, 9), cache_salt=b"t") == 0
    assert m.lookup(toks(0, 9), cache_salt=bytearray(b"t")) == 0
    assert_unchanged(m, before, ["a"])
    assert m.add_sequence("b", toks(0, 9), cache_salt="s") == 8


@pytest.mark.parametrize(
    "prompt, salt",
    [([], None), ([-1], None), ([2**32], None), ([0.5], None), ("abc", None), (None, None),
     ([1, 2], ["s"]), ([1, 2], 3)],
)
@pytest.mark.parametrize("caching", [True, False])
def test_lookup_bad_arguments_are_value_errors(prompt, salt, caching):
    """An empty prompt, a bad token or a bad salt is a ValueError, caching on or off."""
    m = mk(8, enable_prefix_caching=caching)
    m.add_sequence("a", toks(0, 9))
    m.take_events()
    before = snapshot_v2(m, ["a"])
    with pytest.raises(ValueError):
        m.lookup(prompt, cache_salt=salt)
    assert_unchanged(m, before, ["a"])


def test_lookup_with_caching_off_is_zero():
    m = mk(8, enable_prefix_caching=False)
    m.add_sequence("a", toks(0, 9))
    m.free("a")
    assert m.lookup(toks(0, 9)) == 0
    assert m.lookup(toks(0, 9), cache_salt="s") == 0
    assert m.add_sequence("b", toks(0, 9)) == 0
    u = m.usage()
    assert (u.prefix_query_tokens, u.prefix_hit_tokens) == (0, 0)


def test_lookup_memo_is_bounded_and_survives_a_failed_admission(monkeypatch):
    """The hashes a lookup remembers for the admission are bounded by prompts and by blocks in
    all, and an admission refused for lack of blocks leaves them there for its retry. Seen
    through the work the memo saves: a prompt it holds is not hashed again (the test counts the
    hasher's public ``chain_keyed`` calls; a bound of 10 blocks, prompts of 3 full blocks)."""
    import pagedkv.manager as manager
    from pagedkv.hashing import BlockHasher

    monkeypatch.setattr(manager, "HASH_MEMO_BLOCKS", 10)
    hashed = []
    real = BlockHasher.chain_keyed

    def counting(self, parent, data, block_bytes, first, n, keys):
        hashed.append(n)
        return real(self, parent, data, block_bytes, first, n, keys)

    monkeypatch.setattr(BlockHasher, "chain_keyed", counting)
    m = mk(4)
    prompts = [toks(100 * i, 13) for i in range(5)]
    for p in prompts:
        m.lookup(p)
    assert hashed == [3] * 5
    hashed.clear()
    for p in prompts[2:]:  # at most 10 blocks: the newest 3 prompts (9 blocks) are held
        m.lookup(p)
    assert hashed == []
    m.lookup(prompts[1])  # dropped, oldest first: hashed again, and it pushes prompts[2] out
    m.lookup(prompts[2])
    assert hashed == [3, 3]
    hashed.clear()
    big = toks(900, 4 * 11)  # 11 full blocks: more than the bound, never remembered
    m.lookup(big)
    m.lookup(big)
    assert hashed == [11, 11]
    hashed.clear()
    for p in prompts[1:3]:  # and remembering nothing, it pushed nothing out
        m.lookup(p)
    assert hashed == []
    with pytest.raises(OutOfBlocks):
        m.add_sequence("big", toks(400, 13 + 8))  # 6 blocks needed, 4 in the pool
    assert hashed == [5]  # not looked up: hashed by the admission itself
    hashed.clear()
    m.lookup(toks(400, 21))
    for _ in range(2):
        with pytest.raises(OutOfBlocks):
            m.add_sequence("big", toks(400, 21))
    assert hashed == [5]  # the lookup's only: each refused admission found the memo intact
    m.check_invariants()


# ---------------------------------------------------------------- add_sequence(prefill=k)


def test_chunked_admission_then_prefill_chunks(make):
    """prefill=k schedules the first k positions: table, counts and slots cover them only; each
    block is published by the call that schedules its last position, in chain order."""
    prompt = toks(0, 18)  # blocks: 4 full + 2 tokens
    ref = whole(make, prompt)
    assert len(ref) == 4
    m = make(16, BS)
    assert m.add_sequence("a", prompt, prefill=6) == 0
    assert m.block_table("a") == [0, 1]
    assert (m.num_tokens("a"), m.num_computed("a")) == (18, 6)
    assert m.tokens("a") == prompt  # the sequence knows its whole prompt
    s = m.slots("a")  # stop defaults to num_computed
    assert s.dtype == np.int64 and s.tolist() == list(range(6))
    assert m.slots("a", 0, 6).tolist() == list(range(6))
    assert stored_blocks(m.take_events()) == ref[:1]  # block 0 scheduled whole; block 1 not
    u = m.usage()
    assert (u.prefix_query_tokens, u.prefix_hit_tokens) == (18, 0)
    m.check_invariants()

    s = m.prefill("a", 5)
    assert s.dtype == np.int64 and s.tolist() == [6, 7, 8, 9, 10]
    assert m.block_table("a") == [0, 1, 2]
    assert (m.num_tokens("a"), m.num_computed("a")) == (18, 11)
    assert stored_blocks(m.take_events()) == ref[1:2]
    m.check_invariants()

    assert m.prefill("a", 7).tolist() == list(range(11, 18))
    assert m.block_table("a") == [0, 1, 2, 3, 4]
    assert (m.num_tokens("a"), m.num_computed("a")) == (18, 18)
    assert stored_blocks(m.take_events()) == ref[2:4]  # the partial block 4 is not published
    empty = m.prefill("a", 0)
    assert empty.dtype == np.int64 and empty.tolist() == []
    u = m.usage()
    assert (u.prefix_query_tokens, u.prefix_hit_tokens) == (18, 0)  # counted once, at admission
    m.check_invariants()
    # fully scheduled: an ordinary sequence now; decode fills and publishes the last block
    assert m.append_tokens("a", [18, 19]) == [18, 19]
    assert stored_blocks(m.take_events()) == whole(make, toks(0, 20))[4:5]


def test_chunked_admission_with_hits_and_prefill_zero(make):
    """The hit blocks come first; prefill=k then counts uncached positions only; prefill=0 admits
    with the hit blocks alone and allocates nothing."""
    m = make(16, BS)
    m.add_sequence("a", toks(0, 16) + [99])  # [0, 1, 2, 3, 4]; blocks 0-3 published
    m.take_events()
    q = toks(0, 12) + toks(100, 9)  # 21 tokens: 3 blocks shared with a, 5 full blocks in all
    ref = whole(make, q)
    assert m.add_sequence("b", q, prefill=5) == 12
    assert m.block_table("b") == [0, 1, 2, 5, 6]
    assert (m.num_tokens("b"), m.num_computed("b")) == (21, 17)
    assert m.slots("b", 12, 17).tolist() == [20, 21, 22, 23, 24]  # slots(id, hit, num_computed)
    assert [m.refcount(b) for b in range(8)] == [2, 2, 2, 1, 1, 1, 1, 0]
    assert stored_blocks(m.take_events()) == ref[3:4]  # block 3 of b is scheduled whole
    u = m.usage()
    assert (u.prefix_query_tokens, u.prefix_hit_tokens) == (17 + 21, 12)

    free = m.num_free_blocks
    assert m.add_sequence("c", q, prefill=0) == 16  # b's block 5 is published: 4 blocks hit
    assert m.block_table("c") == [0, 1, 2, 5]
    assert (m.num_tokens("c"), m.num_computed("c")) == (21, 16)
    assert m.num_free_blocks == free  # nothing allocated
    assert m.refcount(5) == 2
    assert m.slots("c").tolist() == list(range(12)) + [20, 21, 22, 23]
    assert m.take_events() == []
    u = m.usage()
    assert (u.prefix_query_tokens, u.prefix_hit_tokens) == (17 + 21 + 21, 12 + 16)
    m.check_invariants()

    assert m.prefill("c", 5).tolist() == [28, 29, 30, 31, 32]  # fresh blocks 7 and 8
    assert m.block_table("c") == [0, 1, 2, 5, 7, 8]
    assert stored_blocks(m.take_events()) == ref[4:5]
    m.check_invariants()


def test_prefill_zero_without_hits_admits_an_empty_table(make):
    m = make(8, BS)
    assert m.add_sequence("d", toks(300, 6), prefill=0) == 0
    assert m.block_table("d") == []
    assert (m.num_tokens("d"), m.num_computed("d")) == (6, 0)
    assert m.num_free_blocks == 8
    assert m.slots("d").tolist() == []
    assert m.take_events() == []
    u = m.usage()
    assert (u.num_sequences, u.logical_tokens, u.used_blocks, u.prefix_query_tokens) == (1, 0, 0, 6)
    assert m.block_tables(["d"]).shape == (1, 0)
    m.check_invariants()
    assert m.prefill("d", 6).tolist() == list(range(6))
    assert m.block_table("d") == [0, 1]
    assert stored_blocks(m.take_events()) == whole(make, toks(300, 6))
    m.check_invariants()


def test_prefill_budget_is_clipped_to_the_uncached_rest(make):
    m = make(16, BS)
    assert m.add_sequence("e", toks(400, 6), prefill=100) == 0
    assert (m.num_tokens("e"), m.num_computed("e")) == (6, 6)
    assert m.block_table("e") == [0, 1]
    m.take_events()
    assert m.add_sequence("f", toks(400, 6), prefill=3) == 4  # hit 4 + min(3, 2)
    assert (m.num_tokens("f"), m.num_computed("f")) == (6, 6)
    assert m.block_table("f") == [0, 2]
    assert m.prefill("f", 0).tolist() == []
    before = snapshot_v2(m, ["e", "f"])
    with pytest.raises(ValueError):
        m.prefill("f", 1)
    assert_unchanged(m, before, ["e", "f"])


@pytest.mark.parametrize("bad", [-1, True, False, 1.5, "3", [2]])
def test_bad_prefill_budget_is_a_value_error(make, bad):
    m = make(8, BS)
    m.add_sequence("a", toks(0, 9))
    m.take_events()
    before = snapshot_v2(m, ["a"])
    with pytest.raises(ValueError):
        m.add_sequence("x", toks(0, 9), prefill=bad)
    assert "x" not in m
    assert_unchanged(m, before, ["a"])


def test_prefill_budget_accepts_none_and_numpy_ints(make):
    m = make(8, BS)
    assert m.add_sequence("a", toks(0, 9), prefill=None) == 0  # the v1 admission
    assert m.num_computed("a") == 9
    assert m.add_sequence("b", toks(50, 9), prefill=np.int64(2)) == 0
    assert m.num_computed("b") == 2
    assert m.prefill("b", np.int32(3)).tolist() == [14, 15, 16]  # block 3, then fresh 4
    m.check_invariants()


def test_chunked_admission_out_of_blocks_is_atomic(make):
    """Only the blocks of the first chunk are needed; more than the pool has fails cleanly."""
    m = make(4, BS)
    assert m.add_sequence("a", toks(0, 20), prefill=8) == 0  # [0, 1]
    m.take_events()
    before = snapshot_v2(m, ["a"])
    with pytest.raises(OutOfBlocks) as ei:
        m.add_sequence("b", toks(100, 20), prefill=9)
    assert (ei.value.needed, ei.value.available) == (3, 2)
    assert "b" not in m
    assert_unchanged(m, before, ["a"])
    assert m.add_sequence("b", toks(100, 20), prefill=8) == 0
    assert m.block_table("b") == [2, 3]


# ---------------------------------------------------------------- prefill(id, n)


def test_prefill_out_of_blocks_is_atomic_and_keeps_the_lru(make):
    """A chunk that needs more blocks than are free changes nothing (not even the LRU order);
    the next chunk that fits takes clean blocks first, then the least recently freed."""
    prompt = toks(0, 24)
    ref = whole(make, prompt)
    m = make(5, BS)
    assert m.add_sequence("a", prompt, prefill=4) == 0  # [0]
    m.add_sequence("x", toks(100, 8))  # [1, 2]
    hx = hashes_of(m.take_events())[1:]
    m.free("x")  # cached-free, least recently freed first: 2, 1
    before = snapshot_v2(m, ["a"])
    with pytest.raises(OutOfBlocks) as ei:
        m.prefill("a", 20)  # positions 4..23: 5 blocks; 2 clean + 2 cached are free
    assert (ei.value.needed, ei.value.available) == (5, 4)
    assert_unchanged(m, before, ["a"])
    assert m.prefill("a", 12).tolist() == list(range(12, 20)) + list(range(8, 12))
    assert m.block_table("a") == [0, 3, 4, 2]
    assert m.num_computed("a") == 16
    ev = m.take_events()
    assert removed_hashes(ev) == [hx[1]]
    assert stored_blocks(ev) == ref[1:4]
    m.check_invariants()


@pytest.mark.parametrize("bad", [8, -1, 1.5, True, "2", None])
def test_prefill_bad_n_is_a_value_error(make, bad):
    """n must be an int in [0, unscheduled rest]: 7 here."""
    m = make(8, BS)
    m.add_sequence("a", toks(0, 10), prefill=3)
    m.take_events()
    before = snapshot_v2(m, ["a"])
    with pytest.raises(ValueError):
        m.prefill("a", bad)
    assert_unchanged(m, before, ["a"])
    assert m.prefill("a", 7).tolist() == list(range(3, 10))


def test_prefill_on_a_fully_scheduled_sequence_takes_only_zero(make):
    m = make(8, BS)
    m.add_sequence("a", toks(0, 6))
    m.take_events()
    assert m.prefill("a", 0).tolist() == []
    before = snapshot_v2(m, ["a"])
    with pytest.raises(ValueError):
        m.prefill("a", 1)
    assert_unchanged(m, before, ["a"])


def test_unknown_ids_in_v2_methods_are_key_errors(make):
    m = make(8, BS)
    for call in (lambda: m.num_computed("x"), lambda: m.prefill("x", 0), lambda: m.accept("x", 0),
                 lambda: m.append_tokens("x", [1], speculative=True)):
        with pytest.raises(KeyError):
            call()


def test_slots_stop_defaults_to_num_computed_and_is_bounded_by_it(make):
    m = make(8, BS)
    m.add_sequence("a", toks(0, 10), prefill=5)
    assert m.slots("a").tolist() == [0, 1, 2, 3, 4]
    assert m.slots("a", 2).tolist() == [2, 3, 4]
    assert m.slots("a", np.int64(1), np.int32(3)).tolist() == [1, 2]
    for start, stop in [(0, 6), (0, 10), (3, 2), (-1, 2)]:
        with pytest.raises(ValueError):
            m.slots("a", start, stop)


# ---------------------------------------------------------------- publishing


def test_second_request_mid_prefill_hits_only_published_blocks(make):
    """A block is findable once every one of its positions is scheduled; a request admitted while
    the first is mid-prefill hits exactly those, and computes the rest itself."""
    prompt = toks(0, 18)
    ref = whole(make, prompt)
    probe = toks(0, 16) + [999]
    m = make(32, BS)
    m.add_sequence("a", prompt, prefill=6)
    assert hashes_of(m.take_events()) == [ref[0][0]]
    assert m.lookup(probe) == 4
    m.prefill("a", 5)  # 11 scheduled: block 1 complete
    assert hashes_of(m.take_events()) == [ref[1][0]]
    assert m.lookup(probe) == 8
    m.prefill("a", 3)  # 14 scheduled: block 2 complete, block 3 half
    assert hashes_of(m.take_events()) == [ref[2][0]]
    assert m.lookup(probe) == 12
    assert m.add_sequence("b", probe) == 12
    assert m.block_table("a") == [0, 1, 2, 3]
    assert m.block_table("b") == [0, 1, 2, 4, 5]
    assert stored_blocks(m.take_events()) == ref[3:4]  # b computes block 3 itself
    m.prefill("a", 4)  # a completes its own block 3: same content, already mapped (b's)
    assert m.take_events() == []
    assert (m.refcount(3), m.refcount(4)) == (1, 1)
    assert m.lookup(prompt + [1]) == 16
    m.check_invariants()


def test_prompt_tail_published_when_decode_fills_it(make):
    m = make(8, BS)
    m.add_sequence("a", toks(0, 6), prefill=2)
    assert m.take_events() == []  # block 0 half scheduled
    m.prefill("a", 4)
    assert stored_blocks(m.take_events()) == whole(make, toks(0, 6))
    m.append_token("a", 6)
    assert m.take_events() == []
    m.append_token("a", 7)
    assert stored_blocks(m.take_events()) == whole(make, toks(0, 8))[1:]


# ---------------------------------------------------------------- refused mid-prefill / with drafts


def _refused_calls(m, sid, other):
    return [
        ("append_token", lambda: m.append_token(sid, 1)),
        ("append_tokens", lambda: m.append_tokens(sid, [1, 2])),
        ("append_batch", lambda: m.append_batch([other, sid], [1, 2])),
        ("fork", lambda: m.fork(sid, "child")),
    ]


def test_appends_and_fork_refused_mid_prefill(make):
    """While a prompt is not fully scheduled its next token has no place: appends (speculative or
    not), batches containing it (the whole batch) and forks are ValueErrors that change nothing."""
    m = make(16, BS)
    m.add_sequence("a", toks(0, 10), prefill=5)
    m.add_sequence("o", toks(100, 3))
    m.take_events()
    ids = ["a", "o"]
    before = snapshot_v2(m, ids)
    calls = _refused_calls(m, "a", "o") + [
        ("speculative", lambda: m.append_tokens("a", [1, 2], speculative=True)),
    ]
    for name, call in calls:
        with pytest.raises(ValueError):
            call()
        assert "child" not in m, name
        assert_unchanged(m, before, ids)
    assert m.accept("a", 0) is None  # no drafts pending: a no-op
    assert_unchanged(m, before, ids)
    m.prefill("a", 5)  # [0, 1, 3]: o holds 2
    assert m.append_token("a", 1) == 3 * BS + 2
    m.fork("a", "child")
    m.check_invariants()


def test_appends_and_fork_refused_with_drafts_pending(make):
    m = make(16, BS)
    m.add_sequence("r", toks(0, 6))
    m.add_sequence("o", toks(100, 3))
    m.append_tokens("r", [50, 51], speculative=True)
    m.take_events()
    ids = ["r", "o"]
    before = snapshot_v2(m, ids)
    for name, call in _refused_calls(m, "r", "o"):
        with pytest.raises(ValueError):
            call()
        assert "child" not in m, name
        assert_unchanged(m, before, ids)
    assert m.append_tokens("r", [52], speculative=True) == [3 * BS]  # more drafts are fine
    m.accept("r", 3)
    assert m.append_token("r", 9) == 3 * BS + 1
    m.fork("r", "child")
    m.check_invariants()


# ---------------------------------------------------------------- speculative decoding


def test_speculative_appends_take_slots_and_publish_nothing(make):
    m = make(16, BS)
    m.add_sequence("r", toks(0, 6))  # [0, 1]
    m.take_events()
    assert m.append_tokens("r", [50, 51, 52], speculative=True) == [6, 7, 8]
    assert m.block_table("r") == [0, 1, 2]
    assert (m.num_tokens("r"), m.num_computed("r")) == (9, 9)
    assert m.tokens("r") == toks(0, 6) + [50, 51, 52]
    assert m.take_events() == []  # block 1 is full, but of drafts
    assert m.lookup(toks(0, 6) + [50, 51, 99]) == 4
    assert m.append_tokens("r", [53, 54, 55, 56], speculative=True) == [9, 10, 11, 12]
    assert m.block_table("r") == [0, 1, 2, 3]
    assert (m.num_tokens("r"), m.num_computed("r")) == (13, 13)
    assert m.take_events() == []
    u = m.usage()
    assert (u.logical_tokens, u.used_blocks, u.stored_tokens) == (13, 4, 13)
    m.check_invariants()


def test_accept_none_releases_draft_blocks_clean_tail_first(make):
    m = make(16, BS)
    m.add_sequence("r", toks(0, 6))  # [0, 1]
    m.take_events()
    m.append_tokens("r", [50, 51, 52], speculative=True)
    m.append_tokens("r", [53, 54, 55, 56], speculative=True)  # [0, 1, 2, 3]
    u0 = m.usage()
    assert m.accept("r", 0) is None
    assert (m.num_tokens("r"), m.num_computed("r")) == (6, 6)
    assert m.tokens("r") == toks(0, 6)
    assert m.block_table("r") == [0, 1]
    assert (m.refcount(2), m.refcount(3)) == (0, 0)
    u = m.usage()
    assert (u.free_blocks, u.cached_blocks) == (u0.free_blocks + 2, u0.cached_blocks)
    assert m.take_events() == []
    m.check_invariants()
    # released tail first (3, then 2): the clean stack hands back 2, then 3
    assert m.append_tokens("r", list(range(60, 67))) == [6, 7, 8, 9, 10, 11, 12]
    assert m.block_table("r") == [0, 1, 2, 3]
    assert stored_blocks(m.take_events()) == whole(make, toks(0, 6) + list(range(60, 67)))[1:3]


def test_accept_all_publishes_the_completed_blocks_in_order(make):
    drafts = list(range(70, 79))
    m = make(16, BS)
    m.add_sequence("r", toks(200, 2))  # [0]
    assert m.append_tokens("r", drafts, speculative=True) == list(range(2, 11))
    assert m.block_table("r") == [0, 1, 2]
    assert m.take_events() == []
    m.accept("r", 9)
    assert (m.num_tokens("r"), m.num_computed("r")) == (11, 11)
    assert m.block_table("r") == [0, 1, 2]
    assert stored_blocks(m.take_events()) == whole(make, toks(200, 2) + drafts)
    m.accept("r", 0)  # nothing pending: a no-op
    before = snapshot_v2(m, ["r"])
    with pytest.raises(ValueError):
        m.accept("r", 1)
    assert_unchanged(m, before, ["r"])


def test_accept_some_keeps_the_first_k(make):
    m = make(16, BS)
    m.add_sequence("r", toks(0, 6))  # [0, 1]
    m.take_events()
    m.append_tokens("r", [50, 51, 52, 53, 54, 55, 56], speculative=True)  # [0, 1, 2, 3]
    u0 = m.usage()
    m.accept("r", 3)  # keeps 50, 51, 52
    assert (m.num_tokens("r"), m.num_computed("r")) == (9, 9)
    assert m.tokens("r") == toks(0, 6) + [50, 51, 52]
    assert m.block_table("r") == [0, 1, 2]  # block 2 still holds an accepted token
    assert m.refcount(3) == 0
    u = m.usage()
    assert (u.free_blocks, u.cached_blocks) == (u0.free_blocks + 1, u0.cached_blocks)
    assert stored_blocks(m.take_events()) == whole(make, toks(0, 6) + [50, 51, 52])[1:2]
    assert m.append_token("r", 99) == 9  # in place, after the last accepted token
    m.check_invariants()


@pytest.mark.parametrize("bad", [4, -1, True, 1.5, "1", None])
def test_accept_bad_k_is_a_value_error(make, bad):
    m = make(16, BS)
    m.add_sequence("r", toks(0, 6))
    m.append_tokens("r", [50, 51, 52], speculative=True)
    m.take_events()
    before = snapshot_v2(m, ["r"])
    with pytest.raises(ValueError):
        m.accept("r", bad)
    assert_unchanged(m, before, ["r"])
    m.accept("r", np.int64(1))
    assert m.num_tokens("r") == 7


def test_draft_on_a_shared_partial_block_copies_on_write(make):
    """A draft is written like any token: into a shared partial block only after a copy."""
    m = make(16, BS)
    m.add_sequence("p", toks(0, 6))  # [0, 1]
    m.fork("p", "c")
    m.take_events()
    assert m.append_tokens("c", [70, 71], speculative=True) == [10, 11]
    assert m.block_table("c") == [0, 2] and m.block_table("p") == [0, 1]
    assert (m.refcount(1), m.refcount(2)) == (1, 1)
    assert m.take_copies() == [CopyOp(1, 2)]
    assert m.take_events() == []  # block 2 is full of drafts: not published
    assert m.usage().cow_copies == 1
    m.accept("c", 1)
    assert m.block_table("c") == [0, 2] and m.num_tokens("c") == 7
    assert m.take_events() == []
    assert m.append_token("p", 80) == 6  # p is block 1's last holder: in place
    assert m.take_copies() == []
    m.check_invariants()


def test_speculative_append_out_of_blocks_is_atomic(make):
    m = make(2, BS)
    m.add_sequence("r", toks(0, 6))  # [0, 1]
    m.take_events()
    before = snapshot_v2(m, ["r"])
    with pytest.raises(OutOfBlocks) as ei:
        m.append_tokens("r", [1, 2, 3], speculative=True)
    assert (ei.value.needed, ei.value.available) == (1, 0)
    assert_unchanged(m, before, ["r"])


# ---------------------------------------------------------------- take_copies: one safe batch


def _two_forked_pairs(num_blocks, caching):
    m = mk(num_blocks, enable_prefix_caching=caching)
    m.add_sequence("a", toks(0, 6))  # [0, 1]
    m.add_sequence("d", toks(100, 6))  # [2, 3]
    m.fork("a", "b")
    m.fork("d", "e")
    m.take_events()
    return m


@pytest.mark.parametrize("caching", [True, False])
def test_freed_source_of_a_pending_copy_is_not_a_copy_destination(caching):
    """Within one step: b copies block 1; a (1's other holder) is freed, so 1 is free while the
    pending copy still reads it; e's copy-on-write must not write into 1 in the same batch."""
    m = _two_forked_pairs(8, caching)
    assert m.append_token("b", 9) == 4 * BS + 2  # CoW 1 -> 4
    m.free("a")
    assert m.refcount(1) == 0
    slot = m.append_token("e", 7)
    dst = m.block_table("e")[1]
    assert dst in (5, 6, 7) and slot == dst * BS + 2
    copies = m.take_copies()
    assert sorted(copies) == [CopyOp(1, 4), CopyOp(3, dst)]
    assert not {c.src for c in copies} & {c.dst for c in copies}
    m.check_invariants()


@pytest.mark.parametrize("caching", [True, False])
def test_no_copy_destination_left_is_out_of_blocks_excluding_the_freed_source(caching):
    """The only free block is the freed source of a pending copy: a copy-on-write has nowhere
    to go (OutOfBlocks, available 0) and changes nothing; after the batch ran, 1 serves."""
    m = _two_forked_pairs(5, caching)
    m.append_token("b", 9)  # CoW 1 -> 4: the pool is full
    m.free("a")  # block 1 is free but still the pending copy's source
    ids = ["b", "d", "e"]
    before = snapshot_v2(m, ids)
    calls = [
        lambda: m.append_token("e", 7),
        lambda: m.append_tokens("e", [7, 8]),
        lambda: m.append_tokens("e", [7], speculative=True),
        lambda: m.append_batch(["b", "e"], [5, 7]),
    ]
    for call in calls:
        with pytest.raises(OutOfBlocks) as ei:
            call()
        assert (ei.value.needed, ei.value.available) == (1, 0)
        assert snapshot_v2(m, ids) == before
        assert m.take_events() == []
    assert m.take_copies() == [CopyOp(1, 4)]  # the failures queued and dropped nothing
    assert m.append_token("e", 7) == 1 * BS + 2  # the batch ran: 1 is an ordinary free block
    assert m.take_copies() == [CopyOp(3, 1)]
    m.check_invariants()


def test_batch_needing_a_fresh_block_and_a_copy_beside_a_freed_source():
    """Two free blocks, one of them the freed source of a pending copy; a decode step needs one
    fresh block (f) and one copy (e). Giving f the source and e the other block serves both;
    refusing the whole step is allowed too. Taking the other block for f first and then failing
    on e's copy (or copying into the source) is not: the step is atomic and its batch safe."""
    m = mk(7, enable_prefix_caching=False)
    m.add_sequence("a", toks(0, 6))  # [0, 1]
    m.add_sequence("d", toks(100, 6))  # [2, 3]
    m.add_sequence("f", toks(200, 4))  # [4]: full, its next token needs a fresh block
    m.add_sequence("g", toks(300, 2))  # [5]
    m.fork("a", "b")
    m.fork("d", "e")
    m.append_token("b", 9)  # CoW 1 -> 6
    m.free("a")  # 1: free, still the pending copy's source
    m.free("g")  # 5: free
    ids = ["b", "d", "e", "f"]
    before = snapshot_v2(m, ids)
    try:
        slots = m.append_batch(["f", "e"], [7, 8])
    except OutOfBlocks:
        assert snapshot_v2(m, ids) == before
        assert m.take_copies() == [CopyOp(1, 6)]
    else:
        assert sorted(m.block_table("f")[1:] + m.block_table("e")[1:]) == [1, 5]
        assert m.block_table("e")[1] == 5
        assert slots.tolist() == [1 * BS, 5 * BS + 2]
        assert sorted(m.take_copies()) == [CopyOp(1, 6), CopyOp(3, 5)]
    m.check_invariants()


def test_copy_chain_is_rewritten_to_the_original_source():
    """X->Y pending, Y's holder forked and the child writes: Y->Z would read Y before the batch
    wrote it; the list says X->Z instead, which is what running the two in order gives."""
    m = mk(8, enable_prefix_caching=False)
    m.add_sequence("a", toks(0, 6))  # [0, 1]
    m.fork("a", "b")
    m.append_token("b", 9)  # CoW 1 -> 2
    m.fork("b", "c")
    m.append_token("c", 8)  # c's last block 2 is shared: copy-on-write into 3
    assert m.block_table("c") == [0, 3]
    copies = m.take_copies()
    assert sorted(copies) == [CopyOp(1, 2), CopyOp(1, 3)]
    m.check_invariants()


def test_copy_destination_is_never_twice_in_one_batch():
    m = mk(8, enable_prefix_caching=False)
    m.add_sequence("a", toks(0, 6))  # [0, 1]
    m.fork("a", "b")
    m.fork("a", "c")
    m.append_token("b", 9)  # CoW 1 -> 2
    m.free("b")  # its pending copy goes with it; 2 is clean again
    m.append_token("c", 8)  # CoW 1 -> a free block, possibly 2 again
    copies = m.take_copies()
    assert copies == [CopyOp(1, m.block_table("c")[1])]
    m.check_invariants()


# ---------------------------------------------------------------- free(cache=False) mid-prefill


def test_free_mid_prefill(make):
    """An aborted chunked prefill: free(cache=False) unpublishes only the blocks it alone holds;
    a plain free keeps its published (scheduled, hence computed) blocks cached."""
    m = make(16, BS)
    m.add_sequence("a", toks(0, 18), prefill=6)  # [0, 1]; block 0 published
    assert m.add_sequence("b", toks(0, 9)) == 4  # [0, 2, 3]; b publishes its block 2
    m.take_events()
    m.free("a", cache=False)  # block 1 is unpublished anyway; block 0 is b's too
    assert removed_hashes(m.take_events()) == []
    assert (m.refcount(0), m.refcount(1)) == (1, 0)
    assert m.usage().cached_blocks == 0
    assert m.lookup(toks(0, 18)) == 8
    assert m.add_sequence("c", toks(100, 12), prefill=8) == 0
    assert m.block_table("c") == [1, 4]
    hc = hashes_of(m.take_events())
    assert len(hc) == 2
    free = m.usage().free_blocks
    m.free("c", cache=False)
    assert set(removed_hashes(m.take_events())) == set(hc)
    assert m.lookup(toks(100, 12)) == 0
    u = m.usage()
    assert (u.cached_blocks, u.free_blocks) == (0, free + 2)
    m.add_sequence("g", toks(200, 10), prefill=5)  # block 0 of g published, block 1 not
    m.free("g")
    u = m.usage()
    assert u.cached_blocks == 1
    assert m.lookup(toks(200, 10)) == 4
    m.check_invariants()


# ---------------------------------------------------------------- exports: scheduled positions


def test_usage_and_exports_describe_scheduled_positions():
    m = mk(16)
    m.add_sequence("a", toks(0, 18), prefill=6)  # [0, 1]
    m.add_sequence("z", toks(100, 5))  # [2, 3]
    u = m.usage()
    assert (u.num_sequences, u.logical_tokens, u.stored_tokens, u.used_blocks) == (2, 11, 11, 4)
    assert (u.allocated_slots, u.blocks_saved_by_sharing) == (16, 0)
    assert u.internal_fragmentation == pytest.approx(1 - 11 / 16)
    assert m.block_tables(["a", "z"]).tolist() == [[0, 1], [2, 3]]
    indptr, indices, last = m.flashinfer_layout(["a", "z"])
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 2, 4], [0, 1, 2, 3], [2, 1])
    m.prefill("a", 5)  # [0, 1, 4]
    assert m.usage().logical_tokens == 16
    indptr, indices, last = m.flashinfer_layout(["a", "z"])
    assert indptr.tolist() == [0, 3, 5] and indices.tolist() == [0, 1, 4, 2, 3]
    assert last.tolist() == [3, 1]
    m.append_tokens("z", [1, 2, 3, 4], speculative=True)  # drafts are scheduled: [2, 3, 5]
    assert m.usage().logical_tokens == 20
    assert m.block_tables(["z", "a"]).tolist() == [[2, 3, 5], [0, 1, 4]]
    assert m.flashinfer_layout(["z"])[2].tolist() == [1]


# ---------------------------------------------------------------- pickling


def _rich_manager(make):
    """Every kind of state at once: a fork sharing a partial block, pending drafts that copied
    on write (a pending copy), a salted sequence mid-prefill, cached-free blocks in LRU order,
    events not yet drained, statistics."""
    m = make(15, BS)
    m.add_sequence("p", toks(0, 10))  # [0, 1, 2]
    m.fork("p", "q")
    m.add_sequence("mid", toks(0, 8) + toks(50, 10), cache_salt="s", prefill=3)  # [3]
    m.add_sequence("old", toks(300, 9))  # [4, 5, 6]
    m.free("old")  # 6 clean; cached-free LRU: 5, 4
    m.append_tokens("p", [7, 8, 9], speculative=True)  # CoW 2 -> 6, then 7: p = [0, 1, 6, 7]
    return m


def _record(call):
    try:
        out = call()
    except Exception as exc:  # the same failure on both sides is equal behaviour too
        return ("raised", type(exc).__name__, str(exc))
    return out.tolist() if isinstance(out, np.ndarray) else out


def _drive(m):
    """The same later calls; returns everything they and the manager show."""
    r = [_record(m.take_copies), _record(m.take_events)]
    r.append(_record(lambda: m.lookup(toks(0, 10))))
    r.append(_record(lambda: m.lookup(toks(0, 8) + toks(50, 10), cache_salt="s")))
    r.append(_record(lambda: m.accept("p", 2)))  # drops the draft in 7; publishes block 6
    r.append(_record(lambda: m.prefill("mid", 15)))  # 7 (clean), then 8, 9, 10
    r.append(_record(lambda: m.add_sequence("ev", toks(500, 17))))  # 11..14, evicts 5
    r.append(_record(lambda: m.free("q")))  # 2 clean
    r.append(_record(lambda: m.add_sequence("new", toks(300, 5))))  # revives 4, takes 2: full
    r.append(_record(lambda: m.append_batch(["mid", "new"], [1, 2])))
    r.append(_record(lambda: m.append_tokens("new", [5, 6], speculative=True)))  # in place
    ids = m.seq_ids()
    r += [_record(m.take_copies), _record(m.take_events), ids, snapshot_v2(m, ids)]
    m.check_invariants()
    return r


def test_pickle_round_trip_is_equal_in_state_and_behaviour(make):
    m = _rich_manager(make)
    m2 = pickle.loads(pickle.dumps(m))
    ids = ["p", "q", "mid"]
    assert m2.seq_ids() == m.seq_ids()
    assert snapshot_v2(m2, ids) == snapshot_v2(m, ids)
    assert (m2.hash_algo, m2.block_size, m2.num_blocks, m2.prefix_caching) == (
        m.hash_algo, m.block_size, m.num_blocks, m.prefix_caching)
    m2.check_invariants()
    r, r2 = _drive(m), _drive(m2)
    assert r2 == r
    # the script did what it is there for: evicted the least recently freed, revived, published
    ev = r[1] + r[-3]
    assert any(isinstance(e, BlockRemoved) for e in ev)
    assert any(isinstance(e, BlockStored) for e in ev)
    assert r[8] == 4 and r[9] == [10 * BS + 2, 2 * BS + 1] and r[10] == [2 * BS + 2, 2 * BS + 3]
    assert r[-1]["tables"]["new"] == [4, 2] and r[-1]["num_free"] == 0
    assert not any(isinstance(x, tuple) and x and x[0] == "raised" for x in r)


def test_pickle_carries_to_another_process_for_stable_hashes(tmp_path):
    """sha256 hashes are the same in another process: the unpickled manager behaves the same
    there (builtin hashes are per process by design: same-process round trips only)."""
    m = _rich_manager(lambda n, bs: mk(n, bs, hash_algo="sha256"))
    path = tmp_path / "m.pkl"
    path.write_bytes(pickle.dumps(m))
    code = (
        "import pickle, sys\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from test_v2_contract import _drive\n"
        "m = pickle.loads(open(sys.argv[1], 'rb').read())\n"
        "print(repr(_drive(m)))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="123")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", code, str(path), tests_dir], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == repr(_drive(m))


# ---------------------------------------------------------------- documentation


def test_docstring_states_thread_safety_and_the_fork_rule():
    doc = " ".join((KVCacheManager.__doc__ or "").split()).lower()
    assert re.search(r"not\s+thread[- ]safe", doc), "the docstring must say it is not thread-safe"
    sentences = re.split(r"(?<=[.;:])\s", doc)
    assert any("fork" in s and re.search(r"\bwrit(e|es|ten|ing)\b", s) for s in sentences), (
        "the docstring must state the fork rule: fork after the step's K/V writes")
