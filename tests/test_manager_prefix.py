"""KVCacheManager prefix caching: hits, publication, eviction order, salts, reset and events.

Every test runs once per hash algorithm (the ``make`` fixture). Block size 4 throughout; a fresh
manager hands out blocks 0, 1, 2, ...; freed full published blocks become cached-free (evictable,
least recently freed first, a sequence's tail before its prefix); other freed blocks are clean and
are reused first (LIFO).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedkv import AllBlocksCleared, BlockRemoved, BlockStored, OutOfBlocks
from conftest import removed_hashes, snapshot, stored_blocks, stored_keys, toks


def hashes_of(events):
    return [h for h, _, _ in stored_blocks(events)]


# ---------------------------------------------------------------- hits


def test_hit_between_live_sequences(make):
    """A prompt sharing full blocks with a live sequence reuses them (refcount + 1) and only
    allocates blocks for the rest."""
    m = make(16, 4)
    assert m.add_sequence("a", toks(0, 10)) == 0
    assert m.add_sequence("b", toks(0, 8) + [500, 501]) == 8
    assert m.block_table("a") == [0, 1, 2]
    assert m.block_table("b") == [0, 1, 3]
    assert [m.refcount(b) for b in range(5)] == [2, 2, 1, 1, 0]
    assert m.num_free_blocks == 12
    u = m.usage()
    assert (u.prefix_query_tokens, u.prefix_hit_tokens) == (20, 8)
    assert u.prefix_hit_rate == pytest.approx(8 / 20)
    assert (u.used_blocks, u.blocks_saved_by_sharing, u.stored_tokens) == (4, 2, 12)
    m.check_invariants()
    m.free("a")  # a's blocks 0, 1 stay in use by b: not cached, not free
    assert [m.refcount(b) for b in range(4)] == [1, 1, 0, 1]
    assert m.num_free_blocks == 13
    assert m.usage().cached_blocks == 0
    m.free("b")
    assert m.usage().cached_blocks == 2
    m.check_invariants()


def test_hit_from_freed_sequence(make):
    """Full blocks of a freed sequence stay cached-free (counted as free) and a later prompt
    revives them; the freed partial tail is clean and is reused first."""
    m = make(16, 4)
    m.add_sequence("a", toks(0, 10))  # [0, 1, 2]
    m.take_events()
    m.free("a")
    u = m.usage()
    assert (u.cached_blocks, u.free_blocks, m.num_free_blocks) == (2, 14, 16)
    assert m.add_sequence("b", toks(0, 10)) == 8
    assert m.block_table("b") == [0, 1, 2]
    assert [m.refcount(b) for b in range(3)] == [1, 1, 1]
    u = m.usage()
    assert (u.cached_blocks, u.free_blocks, u.evictions) == (0, 13, 0)
    assert removed_hashes(m.take_events()) == []
    m.check_invariants()


def test_hits_on_live_blocks_need_no_free_block(make):
    """Hits on blocks in use cost nothing from the pool: only the new blocks count, and when
    even those are missing the admission fails with needed=1, available=0, changing nothing."""
    m = make(4, 4)
    m.add_sequence("a", toks(0, 9))  # [0, 1, 2]
    assert m.add_sequence("b", toks(0, 8) + [1]) == 8
    assert m.block_table("b") == [0, 1, 3]
    before = snapshot(m, ["a", "b"])
    m.take_events()
    with pytest.raises(OutOfBlocks) as ei:
        m.add_sequence("c", toks(0, 8) + [2])
    assert (ei.value.needed, ei.value.available) == (1, 0)
    assert snapshot(m, ["a", "b"]) == before
    assert m.take_events() == [] and m.take_copies() == []
    assert "c" not in m


def test_whole_prompt_is_never_a_hit(make):
    """At most (len-1)//bs blocks hit: the last prompt token is always computed, even when the
    whole prompt is cached."""
    m = make(16, 4)
    m.add_sequence("a", toks(0, 8))  # [0, 1], both full and published
    assert m.add_sequence("b", toks(0, 8)) == 4
    assert m.block_table("b") == [0, 2]
    assert m.add_sequence("c", toks(0, 4)) == 0
    assert m.block_table("c") == [3]
    assert m.add_sequence("d", toks(0, 1)) == 0
    assert m.add_sequence("e", toks(0, 9)) == 8
    assert m.block_table("e")[:2] == [0, 1]
    m.check_invariants()


def test_duplicate_block_not_published_and_map_keeps_old(make):
    """A new block with the same content as a cached one is not published (both coexist; the map
    keeps the old block): freed, the duplicate is clean and reused first, and a later hit
    returns the original."""
    m = make(16, 4)
    m.add_sequence("a", toks(0, 8))  # [0, 1]
    ev_a = m.take_events()
    assert len(stored_blocks(ev_a)) == 2
    assert m.add_sequence("b", toks(0, 8)) == 4  # [0, 2]; block 2 duplicates block 1
    assert stored_blocks(m.take_events()) == []
    m.free("a")  # 1 -> cached, 0 still used by b
    m.free("b")  # 2 -> clean (no hash), 0 -> cached
    assert m.usage().cached_blocks == 2
    m.add_sequence("c", toks(100, 1))
    assert m.block_table("c") == [2]
    assert m.add_sequence("d", toks(0, 8) + [9]) == 8
    assert m.block_table("d") == [0, 1, 3]
    m.check_invariants()


# ---------------------------------------------------------------- eviction order


def test_clean_blocks_used_before_cached(make):
    """Allocation takes clean blocks first: cached blocks survive as long as a clean block is
    left, and still hit afterwards."""
    m = make(5, 4)
    m.add_sequence("a", toks(0, 9))  # [0, 1, 2]
    m.free("a")  # 2 clean; 1, 0 cached
    m.take_events()
    m.add_sequence("b", toks(100, 8))
    assert m.block_table("b") == [2, 3]
    assert m.usage().evictions == 0
    assert removed_hashes(m.take_events()) == []
    assert m.add_sequence("c", toks(0, 9)) == 8
    assert m.block_table("c") == [0, 1, 4]
    m.check_invariants()


def test_least_recently_freed_evicted_first_tail_before_prefix(make):
    """With no clean block, allocation evicts the least recently freed cached block: the earlier
    freed sequence goes first, and within a sequence the tail before the prefix. Each eviction
    drops the hash (BlockRemoved) and counts in usage().evictions."""
    m = make(4, 4)
    m.add_sequence("a", toks(0, 8))  # [0, 1]
    m.add_sequence("b", toks(100, 8))  # [2, 3]
    ha, hb = [], []
    for h, _, t in stored_blocks(m.take_events()):
        (ha if t[0] < 100 else hb).append(h)
    assert len(ha) == len(hb) == 2
    m.free("a")
    m.free("b")  # LRU: 1, 0, 3, 2
    assert m.usage().cached_blocks == 4 and m.num_free_blocks == 4
    m.add_sequence("c", toks(200, 4))
    assert m.block_table("c") == [1]
    assert removed_hashes(m.take_events()) == [ha[1]]
    m.add_sequence("d", toks(300, 4))
    assert m.block_table("d") == [0]
    assert removed_hashes(m.take_events()) == [ha[0]]
    assert m.usage().evictions == 2
    m.free("c")
    m.free("d")  # LRU: 3, 2, 1, 0
    # b's prefix (block 2) outlived its tail (block 3): a hit revives 2, the new block evicts 3
    assert m.add_sequence("e", toks(100, 4) + [999]) == 4
    assert m.block_table("e") == [2, 3]
    assert removed_hashes(m.take_events()) == [hb[1]]
    assert m.usage().evictions == 3
    # a's prompt no longer hits at all
    m.free("e")
    assert m.add_sequence("f", toks(0, 5)) == 0
    m.check_invariants()


def test_admission_never_evicts_its_own_hits(make):
    """When an admission revives cached hits and must also evict, it evicts other cached blocks
    (LRU order), never the blocks it is reviving, even when those are least recently freed."""
    m = make(5, 4)
    m.add_sequence("a", toks(0, 9))  # [0, 1, 2]
    m.add_sequence("b", toks(100, 8))  # [3, 4]
    hb = [h for h, _, t in stored_blocks(m.take_events()) if t[0] >= 100]
    m.free("a")  # 2 clean; LRU: 1, 0
    m.free("b")  # LRU: 1, 0, 4, 3
    assert m.add_sequence("c", toks(0, 8) + toks(500, 9)) == 8  # 5 blocks: 2 hits + 3 new
    assert m.block_table("c") == [0, 1, 2, 4, 3]
    assert removed_hashes(m.take_events()) == [hb[1], hb[0]]
    assert m.num_free_blocks == 0
    m.check_invariants()


def test_admission_whose_hits_would_have_to_be_evicted_fails_atomically(make):
    """All cached-free blocks are the prompt's own hits; reviving them leaves too few blocks for
    the rest. The admission fails with OutOfBlocks (releasing needed - available = 1 block would
    let it fit) and nothing changes: no eviction, no event, the cache still hits."""
    m = make(4, 4)
    m.add_sequence("a", toks(0, 13))  # [0, 1, 2, 3]; 0..2 full and published
    m.free("a")  # 3 clean; LRU: 2, 1, 0
    m.take_events()
    before = snapshot(m)
    with pytest.raises(OutOfBlocks) as ei:
        m.add_sequence("b", toks(0, 12) + toks(100, 5))  # 5 blocks: 3 hits + 2 new, 1 clean
    assert ei.value.needed - ei.value.available == 1
    assert "b" not in m
    assert snapshot(m) == before
    assert m.take_events() == [] and m.take_copies() == []
    m.check_invariants()
    assert m.add_sequence("c", toks(0, 13)) == 12
    assert m.block_table("c") == [0, 1, 2, 3]


def test_evicted_hash_republished_in_same_admission(make):
    """If an admission evicts the cached block holding exactly the content of one of its own new
    full blocks, the new block is published (the map must not lose that prefix), and the router
    sees the removal before the store."""
    m = make(3, 4)
    m.add_sequence("b", toks(100, 8))  # [0, 1]
    hb = hashes_of(m.take_events())
    m.add_sequence("x", toks(300, 4))  # [2], stays live
    m.free("b")  # LRU: 1, 0
    m.take_events()
    assert m.add_sequence("e", toks(100, 8)) == 4  # revive 0, evict 1 for the second block
    assert m.block_table("e") == [0, 1]
    ev = m.take_events()
    assert removed_hashes(ev) == [hb[1]]
    assert hashes_of(ev) == [hb[1]]
    kinds = [type(e) for e in ev]
    assert kinds.index(BlockRemoved) < kinds.index(BlockStored)
    m.free("x")
    m.free("e")
    assert m.add_sequence("f", toks(100, 8) + [5]) == 8


# ---------------------------------------------------------------- publication of generated blocks


@pytest.mark.parametrize("how", ["append_token", "append_tokens", "append_batch"])
def test_generated_tokens_published_when_block_fills(make, how):
    """A block filled by generated tokens is published at once: a later prompt equal to
    prompt + generated hits it. A partial generated block is never published."""
    m = make(16, 4)
    m.add_sequence("a", toks(0, 6))  # [0, 1]
    assert len(stored_blocks(m.take_events())) == 1
    if how == "append_token":
        m.append_token("a", 50)
        assert stored_blocks(m.take_events()) == []  # block 1 has 3 of 4 tokens
        m.append_token("a", 51)
    elif how == "append_tokens":
        m.append_tokens("a", [50, 51])
    else:
        m.append_batch(["a"], [50])
        m.append_batch(["a"], [51])
    ev = stored_blocks(m.take_events())
    assert [t for _, _, t in ev] == [(4, 5, 50, 51)]
    assert m.add_sequence("b", toks(0, 6) + [50, 51, 7]) == 8
    assert m.block_table("b") == [0, 1, 2]
    m.check_invariants()


def test_partial_generated_block_not_hit(make):
    """A partially filled block is never hashed, so it never hits."""
    m = make(16, 4)
    m.add_sequence("a", toks(0, 6))
    m.append_token("a", 6)  # block 1: 4, 5, 6
    assert m.add_sequence("b", toks(0, 7) + [1, 2]) == 4
    assert m.block_table("b")[1] != m.block_table("a")[1]


def test_multi_block_generation_published_in_chain(make):
    """append_tokens that fills several blocks publishes each, chained in order."""
    m = make(16, 4)
    m.add_sequence("a", toks(0, 3))  # nothing full yet
    assert m.take_events() == []
    m.append_tokens("a", toks(3, 9))  # 12 tokens: blocks 0, 1, 2 full
    ev = stored_blocks(m.take_events())
    assert [t for _, _, t in ev] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert ev[1][1] == ev[0][0] and ev[2][1] == ev[1][0]
    assert m.add_sequence("b", toks(0, 12) + [1]) == 12


def test_cow_copy_published_when_filled(make):
    """A copy-on-write block filled by the child is published under the child's history; the
    parent's own continuation in the original block is published too, and each hits."""
    m = make(16, 4)
    m.add_sequence("a", toks(0, 6))  # [0, 1]
    m.fork("a", "b")
    m.append_tokens("b", [50, 51])  # CoW 1 -> 2, fills it
    m.take_copies()
    m.append_tokens("a", [60, 61])  # a is the last holder of 1: in place, fills it
    assert m.block_table("b") == [0, 2] and m.block_table("a") == [0, 1]
    assert m.add_sequence("c", toks(0, 6) + [50, 51, 7]) == 8
    assert m.block_table("c")[:2] == [0, 2]
    assert m.add_sequence("d", toks(0, 6) + [60, 61, 7]) == 8
    assert m.block_table("d")[:2] == [0, 1]
    m.check_invariants()


# ---------------------------------------------------------------- hash identity


def test_cache_salt_isolation(make):
    """Different salts never share a block, even with identical prompts; the same salt does;
    a salted prompt does not hit an unsalted one. As in vLLM, the salt is a key of block 0 (its
    event's ``extra_keys``), not a root of its own: every first block names the same parent."""
    m = make(32, 4)
    m.add_sequence("a", toks(0, 9), cache_salt="t1")
    assert m.add_sequence("b", toks(0, 9), cache_salt="t2") == 0
    assert m.add_sequence("c", toks(0, 9)) == 0
    assert m.add_sequence("d", toks(0, 9), cache_salt="t1") == 8
    assert m.block_table("d")[:2] == m.block_table("a")[:2]
    assert set(m.block_table("b")).isdisjoint(m.block_table("a"))
    assert set(m.block_table("c")).isdisjoint(m.block_table("a") + m.block_table("b"))
    events = m.take_events()
    ev = stored_blocks(events)
    assert len(ev) == 6  # a, b and c each publish 2 blocks; d publishes nothing new
    assert len({h for h, _, _ in ev}) == 6
    roots = [ev[0][1], ev[2][1], ev[4][1]]
    assert len(set(roots)) == 1
    assert [k for _, _, k in stored_keys(events)] == [("t1",), None, ("t2",), None, None, None]


def test_forked_child_keeps_parent_salt(make):
    """Blocks a forked child fills are published under the parent's salt."""
    m = make(16, 4)
    m.add_sequence("a", toks(0, 6), cache_salt="t1")
    m.fork("a", "b")
    m.append_tokens("b", [50, 51])
    assert m.add_sequence("c", toks(0, 6) + [50, 51, 1]) == 0
    assert m.add_sequence("d", toks(0, 6) + [50, 51, 1], cache_salt="t1") == 8


@pytest.mark.parametrize("pos", [0, 3, 4, 7, 9, 15])
def test_one_changed_token_changes_every_later_hash(make, pos):
    """Changing one token invalidates its block and every later one, even blocks whose own tokens
    are identical: the hit stops at the changed block and all later hashes are new."""
    m = make(16, 4)
    a = toks(0, 17)  # 4 full blocks + 1
    m.add_sequence("a", a)
    ha = set(hashes_of(m.take_events()))
    b = list(a)
    b[pos] = 1000
    assert m.add_sequence("b", b) == (pos // 4) * 4
    hb = hashes_of(m.take_events())
    assert len(hb) == 4 - pos // 4
    assert ha.isdisjoint(hb)


def test_hashes_deterministic_across_managers(make):
    """Two managers with the same algorithm give the same hashes for the same prompt and salt
    (a router can index events from several instances)."""
    m1, m2 = make(8, 4), make(8, 4)
    for m in (m1, m2):
        m.add_sequence("a", toks(0, 9), cache_salt="s")
        m.add_sequence("b", toks(0, 9))
    e1, e2 = stored_blocks(m1.take_events()), stored_blocks(m2.take_events())
    assert e1 == e2 and len(e1) == 4


@pytest.mark.parametrize("algo_name", ["sha256", "xxh3"])
def test_stable_hashes_across_processes(algo_name):
    """sha256 and xxh3 hashes are stable across processes (different PYTHONHASHSEED), so an
    external router can index them."""
    if algo_name == "xxh3":
        pytest.importorskip("xxhash")
    code = (
        "from pagedkv import KVCacheManager\n"
        f"m = KVCacheManager(num_blocks=8, block_size=4, hash_algo={algo_name!r})\n"
        "m.add_sequence('a', list(range(9)), cache_salt='s')\n"
        "print(repr([(e.parent_block_hash, e.block_hashes) for e in m.take_events()]))\n"
    )
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    assert outs[0] == outs[1] and outs[0].strip() not in ("", "[]")


# ---------------------------------------------------------------- caching off, reset


def test_caching_disabled():
    """With caching off nothing hits, nothing is published or cached, and freed blocks are all
    clean (LIFO)."""
    from pagedkv import KVCacheManager

    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    assert m.add_sequence("a", toks(0, 9)) == 0
    assert m.add_sequence("b", toks(0, 9)) == 0
    assert m.block_table("a") == [0, 1, 2] and m.block_table("b") == [3, 4, 5]
    m.append_tokens("a", [1, 2, 3])
    m.free("a")
    u = m.usage()
    assert (u.cached_blocks, u.free_blocks, u.prefix_query_tokens, u.prefix_hit_tokens) == (
        0,
        5,
        0,
        0,
    )
    assert m.take_events() == []
    assert m.add_sequence("c", toks(0, 9)) == 0
    assert m.block_table("c") == [0, 1, 2]
    m.check_invariants()


def test_reset_refused_while_in_use(make):
    """reset_prefix_cache returns False and changes nothing while any block is in use."""
    m = make(8, 4)
    m.add_sequence("a", toks(0, 9))
    m.free("a")
    m.add_sequence("x", toks(100, 1))
    m.take_events()
    before = snapshot(m, ["x"])
    assert m.reset_prefix_cache() is False
    assert snapshot(m, ["x"]) == before
    assert m.take_events() == []
    assert m.add_sequence("b", toks(0, 9)) == 8  # still cached


def test_reset_drops_every_cached_hash(make):
    """With nothing in use, reset drops every hash: cached blocks become clean (still free), an
    AllBlocksCleared event is emitted, and nothing hits any more."""
    m = make(8, 4)
    m.add_sequence("a", toks(0, 9))
    m.add_sequence("b", toks(100, 8))
    m.free("a")
    m.free("b")
    m.take_events()
    assert m.usage().cached_blocks == 4
    assert m.reset_prefix_cache() is True
    assert m.take_events() == [AllBlocksCleared()]
    u = m.usage()
    assert (u.cached_blocks, u.free_blocks, m.num_free_blocks, u.evictions) == (0, 8, 8, 0)
    m.check_invariants()
    assert m.add_sequence("c", toks(0, 9)) == 0
    assert m.add_sequence("d", toks(100, 8)) == 0
    assert removed_hashes(m.take_events()) == []  # clean blocks: nothing to evict
    m.check_invariants()


def test_reset_fresh_manager(make):
    """Resetting an empty manager succeeds."""
    m = make(4, 4)
    assert m.reset_prefix_cache() is True
    assert m.take_events() == [AllBlocksCleared()]


# ---------------------------------------------------------------- events


def test_events_content(make):
    """BlockStored carries the new blocks' hashes in chain order, the parent hash they chain
    from, their tokens concatenated and the block size; a later prompt's new blocks chain from
    the last hit block's hash. take_events drains."""
    m = make(16, 4)
    m.add_sequence("a", toks(0, 9))
    ev = m.take_events()
    assert all(isinstance(e, BlockStored) and e.block_size == 4 for e in ev)
    blocks = stored_blocks(ev)
    assert [t for _, _, t in blocks] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    (h0, root, _), (h1, p1, _) = blocks
    assert p1 == h0 and len({root, h0, h1}) == 3
    assert m.take_events() == []
    assert m.add_sequence("b", toks(0, 8) + toks(50, 5)) == 8
    blocks = stored_blocks(m.take_events())
    assert len(blocks) == 1
    h2, p2, t2 = blocks[0]
    assert p2 == h1 and t2 == (50, 51, 52, 53) and h2 not in (h0, h1)
    hash(h2)  # hashes are hashable (a router keys a dict by them)
    # the same prompt in a fresh manager chains from the same root
    m2 = make(16, 4)
    m2.add_sequence("z", toks(0, 4) + [1])
    assert stored_blocks(m2.take_events()) == [(h0, root, (0, 1, 2, 3))]


def test_events_disabled(make):
    """With enable_events=False nothing is recorded, but caching still works."""
    m = make(4, 4, enable_events=False)
    m.add_sequence("a", toks(0, 9))
    m.free("a")
    m.add_sequence("b", toks(100, 8))  # evicts
    m.free("b")
    m.reset_prefix_cache()
    assert m.take_events() == []
    m2 = make(8, 4, enable_events=False)
    m2.add_sequence("a", toks(0, 9))
    assert m2.add_sequence("b", toks(0, 9)) == 8


def test_prefix_statistics(make):
    """prefix_query_tokens sums the prompt lengths of successful admissions, prefix_hit_tokens
    their hits; a failed admission counts nothing."""
    m = make(4, 4)
    m.add_sequence("a", toks(0, 9))
    m.add_sequence("b", toks(0, 5))
    with pytest.raises(OutOfBlocks):
        m.add_sequence("c", toks(0, 20))
    u = m.usage()
    assert (u.prefix_query_tokens, u.prefix_hit_tokens) == (14, 4)


def test_prefix_statistics_count_prompts_shorter_than_a_block(make):
    """A prompt too short to fill a block is still a query: its tokens count (the hit rate's
    denominator must not depend on whether anything was ever published)."""
    m = make(8, 4)
    assert m.add_sequence("a", [1, 2]) == 0
    u = m.usage()
    assert (u.prefix_query_tokens, u.prefix_hit_tokens) == (2, 0)


def test_free_uncached_unpublishes_what_the_sequence_alone_holds(make):
    """``free(id, cache=False)``: a request aborted before its prefill must not leave hashed blocks
    without K/V. Its private blocks come back clean and unpublished (one BlockRemoved names them);
    a block another live sequence still holds keeps its hash and keeps hitting."""
    m = make(16, 4)
    m.add_sequence("a", toks(0, 9))  # [0, 1, 2]; blocks 0 and 1 published
    assert m.add_sequence("b", toks(0, 5)) == 4  # hits block 0; table [0, 3]
    published = [e for e in m.take_events()]
    stored_hashes = [h for e in published for h in e.block_hashes]
    assert len(stored_hashes) == 2
    m.free("a", cache=False)
    u = m.usage()
    assert (u.cached_blocks, u.used_blocks, m.num_free_blocks) == (0, 2, 14)
    removed = [e for e in m.take_events() if type(e).__name__ == "BlockRemoved"]
    assert [list(e.block_hashes) for e in removed] == [[stored_hashes[1]]]  # block 1 only
    assert m.add_sequence("c", toks(0, 9)) == 4  # block 0 (held by b) still hits; block 1 does not
    assert m.block_table("c") == [0, 1, 2]  # 1 and 2 came back clean: LIFO, recomputed, not hits
    m.check_invariants()


def test_free_uncached_rejects_a_non_bool_and_changes_nothing(make):
    m = make(8, 4)
    m.add_sequence("a", toks(0, 9))
    with pytest.raises(ValueError):
        m.free("a", cache=0)
    assert "a" in m and m.num_tokens("a") == 9
    m.check_invariants()
