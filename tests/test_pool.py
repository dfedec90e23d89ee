"""The standalone block pool: refcounts, the clean LIFO free stack, the cached-free LRU.

Engines that keep their own block tables use ``BlockPool`` directly, so each rule here is one a
user relies on: which block ids come out, in which order, and that failures change nothing.
"""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv import BlockPool, OutOfBlocks


def counts(p: BlockPool):
    return (p.num_free, p.num_clean, p.num_cached, p.num_used)


def pool_state(p: BlockPool):
    return (
        counts(p),
        [p.refcount(b) for b in range(p.num_blocks)],
        [p.key(b) for b in range(p.num_blocks)],
    )


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, block, key):
        self.calls.append((block, key))


# ---------------------------------------------------------------- construction and counts


def test_fresh_pool_counts():
    """A fresh pool has every block clean and free, nothing cached or used."""
    p = BlockPool(10)
    assert p.num_blocks == 10
    assert counts(p) == (10, 10, 0, 0)
    assert all(p.refcount(b) == 0 for b in range(10))
    assert all(p.key(b) is None for b in range(10))
    p.check_invariants()


@pytest.mark.parametrize("n", [0, -1, -100])
def test_bad_num_blocks(n):
    """A pool needs at least one block."""
    with pytest.raises(ValueError):
        BlockPool(n)


def test_importable_from_module():
    """The pool is reachable both from the package and from ``pagedkv.pool``."""
    import pagedkv.pool

    assert pagedkv.pool.BlockPool is BlockPool


# ---------------------------------------------------------------- allocation order


def test_fresh_pool_hands_out_blocks_in_order():
    """A fresh pool hands out 0, 1, 2, ... in order, each with refcount 1."""
    p = BlockPool(8)
    assert p.allocate(3) == [0, 1, 2]
    assert p.allocate(1) == [3]
    assert [p.refcount(b) for b in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert counts(p) == (4, 4, 0, 4)
    p.check_invariants()


def test_released_clean_block_is_next_out():
    """Clean free blocks are a LIFO stack: a freed block comes out before never-used ones."""
    p = BlockPool(8)
    p.allocate(4)  # 0..3
    p.release(1)
    assert p.allocate(1) == [1]
    p.release(2)
    p.release(0)
    assert p.allocate(3) == [0, 2, 4]
    p.check_invariants()


def test_release_all_in_given_order():
    """release_all pushes in the order given: the last one released is the first reused."""
    p = BlockPool(8)
    p.allocate(4)
    p.release_all([3, 2, 1])  # how a manager frees a table [1, 2, 3] tail first
    assert p.allocate(3) == [1, 2, 3]
    p.release_all([0, 1])
    assert p.allocate(1) == [1]
    assert p.allocate(1) == [0]
    p.check_invariants()


def test_allocate_zero():
    """Allocating zero blocks succeeds and changes nothing."""
    p = BlockPool(2)
    assert p.allocate(0) == []
    assert counts(p) == (2, 2, 0, 0)


# ---------------------------------------------------------------- exhaustion


def test_exhaustion_and_recovery():
    """Asking for more than is free raises OutOfBlocks(needed, available) and changes nothing;
    releasing makes the same request succeed."""
    p = BlockPool(4)
    assert p.allocate(3) == [0, 1, 2]
    before = pool_state(p)
    with pytest.raises(OutOfBlocks) as ei:
        p.allocate(2)
    assert (ei.value.needed, ei.value.available) == (2, 1)
    assert pool_state(p) == before
    p.release(1)
    assert p.allocate(2) == [1, 3]
    assert counts(p) == (0, 0, 0, 4)
    with pytest.raises(OutOfBlocks) as ei:
        p.allocate(1)
    assert (ei.value.needed, ei.value.available) == (1, 0)
    p.check_invariants()


def test_failed_allocate_evicts_nothing():
    """A failed allocation must not evict cached blocks on the way (atomic failure)."""
    rec = Recorder()
    p = BlockPool(4, on_evict=rec)
    blocks = p.allocate(3)
    for b in blocks:
        p.set_key(b, ("k", b))
    p.release_all(blocks)  # 3 cached + 1 clean
    assert counts(p) == (4, 1, 3, 0)
    before = pool_state(p)
    with pytest.raises(OutOfBlocks) as ei:
        p.allocate(5)
    assert (ei.value.needed, ei.value.available) == (5, 4)
    assert rec.calls == []
    assert pool_state(p) == before
    p.check_invariants()


# ---------------------------------------------------------------- refcounts


def test_incref_release_refcounts():
    """incref/release move the refcount; the block is free only when it reaches zero."""
    p = BlockPool(4)
    (b,) = p.allocate(1)
    p.incref(b)
    p.incref(b)
    assert p.refcount(b) == 3
    p.release(b)
    p.release(b)
    assert p.refcount(b) == 1 and p.num_used == 1
    p.release(b)
    assert p.refcount(b) == 0 and p.num_used == 0 and p.num_clean == 4
    p.check_invariants()


def test_incref_free_block_is_error():
    """incref of a block not in use is a ValueError (use revive / allocate instead)."""
    p = BlockPool(4)
    with pytest.raises(ValueError):
        p.incref(0)  # never used
    (b,) = p.allocate(1)
    p.release(b)
    with pytest.raises(ValueError):
        p.incref(b)  # freed
    assert counts(p) == (4, 4, 0, 0)


def test_release_free_block_is_error():
    """Releasing a free block (double free) is a ValueError and changes nothing."""
    p = BlockPool(4)
    with pytest.raises(ValueError):
        p.release(2)
    (b,) = p.allocate(1)
    p.release(b)
    before = pool_state(p)
    with pytest.raises(ValueError):
        p.release(b)
    assert pool_state(p) == before
    p.check_invariants()


def test_release_cached_free_block_is_error():
    """A cached-free block is free too: releasing it again is a ValueError."""
    p = BlockPool(4)
    (b,) = p.allocate(1)
    p.set_key(b, "k")
    p.release(b)
    with pytest.raises(ValueError):
        p.release(b)
    assert counts(p) == (4, 3, 1, 0)


# ---------------------------------------------------------------- keys and the cached LRU


def test_keyed_block_goes_to_cached_on_release():
    """A released block with a key becomes cached-free (still free, key kept, not clean)."""
    p = BlockPool(4)
    a, b = p.allocate(2)
    p.set_key(a, "ka")
    assert p.key(a) == "ka" and p.key(b) is None
    p.release(a)
    p.release(b)
    assert counts(p) == (4, 3, 1, 0)
    assert p.key(a) == "ka"
    assert p.refcount(a) == 0
    p.check_invariants()


def test_set_key_needs_block_in_use():
    """Only a block in use can be given a key."""
    p = BlockPool(4)
    with pytest.raises(ValueError):
        p.set_key(0, "k")
    assert p.key(0) is None


def test_clean_before_cached():
    """Allocation takes every clean block before evicting any cached one."""
    rec = Recorder()
    p = BlockPool(4, on_evict=rec)
    blocks = p.allocate(4)
    p.set_key(0, "k0")
    p.set_key(1, "k1")
    p.release_all([0, 1, 2, 3])  # cached: 0, 1 ; clean stack: 2, 3 (3 on top)
    assert counts(p) == (4, 2, 2, 0)
    assert p.allocate(2) == [3, 2]
    assert rec.calls == []
    assert p.key(0) == "k0" and p.key(1) == "k1"
    assert blocks == [0, 1, 2, 3]
    p.check_invariants()


def test_evicts_least_recently_freed_first():
    """With no clean block left, allocation evicts the least recently freed cached block, calls
    on_evict(block, key) for it and drops its key."""
    rec = Recorder()
    p = BlockPool(3, on_evict=rec)
    p.allocate(3)
    for b in range(3):
        p.set_key(b, f"k{b}")
    p.release(2)
    p.release(0)
    p.release(1)  # LRU order: 2, 0, 1
    assert counts(p) == (3, 0, 3, 0)
    assert p.allocate(1) == [2]
    assert rec.calls == [(2, "k2")]
    assert p.key(2) is None and p.refcount(2) == 1
    assert p.allocate(2) == [0, 1]
    assert rec.calls == [(2, "k2"), (0, "k0"), (1, "k1")]
    assert counts(p) == (0, 0, 0, 3)
    p.check_invariants()


def test_mixed_clean_then_evict_in_one_call():
    """One allocate call drains the clean stack first, then evicts in LRU order."""
    rec = Recorder()
    p = BlockPool(4, on_evict=rec)
    p.allocate(4)
    p.set_key(0, "a")
    p.set_key(1, "b")
    p.release_all([1, 0, 2])  # cached LRU: 1, 0 ; clean: 2 ; 3 in use
    assert p.allocate(2) == [2, 1]
    assert rec.calls == [(1, "b")]
    assert p.key(0) == "a"
    p.check_invariants()


def test_revive_cached_block():
    """revive brings a cached-free block back in use with refcount 1 and its key, and takes it
    out of the LRU so it is never evicted while in use."""
    rec = Recorder()
    p = BlockPool(2, on_evict=rec)
    p.allocate(2)
    p.set_key(0, "k0")
    p.set_key(1, "k1")
    p.release_all([0, 1])  # LRU: 0, 1
    p.revive(0)
    assert p.refcount(0) == 1 and p.key(0) == "k0"
    assert counts(p) == (1, 0, 1, 1)
    assert p.allocate(1) == [1]  # 0 is no longer evictable
    assert rec.calls == [(1, "k1")]
    with pytest.raises(OutOfBlocks):
        p.allocate(1)
    p.check_invariants()


def test_revived_block_released_again_is_most_recent():
    """A revived and re-released block goes to the most recently freed end of the LRU."""
    rec = Recorder()
    p = BlockPool(3, on_evict=rec)
    p.allocate(3)
    for b in range(3):
        p.set_key(b, b)
    p.release_all([0, 1, 2])  # LRU: 0, 1, 2
    p.revive(0)
    p.release(0)  # LRU: 1, 2, 0
    assert p.allocate(3) == [1, 2, 0]
    assert [b for b, _ in rec.calls] == [1, 2, 0]


def test_revive_errors():
    """revive of a clean block or a block in use is a ValueError and changes nothing."""
    p = BlockPool(3)
    p.allocate(2)
    p.set_key(0, "k")
    before = pool_state(p)
    with pytest.raises(ValueError):
        p.revive(0)  # in use
    with pytest.raises(ValueError):
        p.revive(2)  # clean (never used)
    assert pool_state(p) == before
    p.release(1)
    before = pool_state(p)
    with pytest.raises(ValueError):
        p.revive(1)  # clean (freed without key)
    assert pool_state(p) == before
    assert p.refcount(0) == 1 and p.num_used == 1
    p.check_invariants()


def test_drop_key_on_used_block_frees_clean():
    """A block whose key was dropped while in use is freed to the clean stack."""
    p = BlockPool(3)
    a, b = p.allocate(2)
    p.set_key(a, "ka")
    p.drop_key(a)
    assert p.key(a) is None
    p.release(a)
    assert counts(p) == (2, 2, 0, 1)  # b still in use
    assert p.allocate(1) == [a]
    p.check_invariants()


def test_drop_key_on_cached_block_makes_it_clean():
    """Dropping the key of a cached-free block turns it clean (no on_evict call: the caller
    asked for it)."""
    rec = Recorder()
    p = BlockPool(3, on_evict=rec)
    p.allocate(1)
    p.set_key(0, "k")
    p.release(0)
    p.drop_key(0)
    assert p.key(0) is None
    assert counts(p) == (3, 3, 0, 0)
    assert rec.calls == []
    p.check_invariants()


def test_clear_cached():
    """clear_cached returns every cached-free (block, key) and makes those blocks clean; blocks in
    use are untouched."""
    rec = Recorder()
    p = BlockPool(5, on_evict=rec)
    p.allocate(4)
    for b in range(4):
        p.set_key(b, f"k{b}")
    p.release_all([0, 1, 2])  # 3 stays in use
    got = p.clear_cached()
    assert sorted(got) == [(0, "k0"), (1, "k1"), (2, "k2")]
    assert counts(p) == (4, 4, 0, 1)
    assert all(p.key(b) is None for b in range(3))
    assert p.refcount(3) == 1
    assert p.clear_cached() == []
    assert sorted(p.allocate(4)) == [0, 1, 2, 4]
    p.check_invariants()


# ---------------------------------------------------------------- random walk vs a model


# ---------------------------------------------------------------- the key <-> block bijection


def test_a_key_finds_its_block_while_it_is_carried_and_not_after():
    """``block_of`` is the inverse of ``key``: it finds an in-use or cached-free block by its key,
    and forgets it when the key goes (dropped, evicted, cleared), in one step with ``key``."""
    p = BlockPool(3)
    a, b, c = p.allocate(3)
    p.set_keys([a, b], ["ka", "kb"])
    assert (p.block_of("ka"), p.block_of("kb"), p.block_of("kc")) == (a, b, None)
    p.release_all([c, b, a])  # a and b cached-free, c clean
    assert (p.block_of("ka"), p.block_of("kb")) == (a, b)
    p.drop_key(b)
    assert p.block_of("kb") is None and p.key(b) is None
    assert p.allocate(3) == [b, c, a]  # the clean ones, then a evicted: its key goes
    assert p.block_of("ka") is None and p.key(a) is None
    p.check_invariants()


def test_held_prefix_stops_at_the_first_key_no_block_carries():
    """``held_prefix(keys, limit)``: the blocks of the longest run of carried keys from the
    start, at most ``limit`` (a chained hash cannot hit after a miss)."""
    p = BlockPool(4)
    p.allocate(3)
    p.set_keys([2, 0, 1], ["h0", "h1", "h2"])
    assert p.held_prefix(["h0", "h1", "h2", "h3"], 4) == [2, 0, 1]
    assert p.held_prefix(["h0", "h1", "h2"], 2) == [2, 0]
    assert p.held_prefix(["h0", "hx", "h2"], 3) == [2]
    assert p.held_prefix(["hx", "h0"], 2) == [] and p.held_prefix(["h0"], 0) == []


def test_publish_keys_keys_only_the_blocks_whose_key_is_new():
    """A key already carried keeps its older block (also one met earlier in the same call);
    the result names, per pair, the block that carries the key; all new -> the caller's list."""
    p = BlockPool(6)
    p.allocate(5)
    p.set_key(0, "h")
    blocks = [1, 2, 3]
    assert p.publish_keys(blocks, ["h", "g", "g"]) == [0, 2, 2]
    assert [p.key(b) for b in range(4)] == ["h", None, "g", None]
    fresh = [3, 4]
    assert p.publish_keys(fresh, ["f", "e"]) is fresh
    assert (p.block_of("f"), p.block_of("e")) == (3, 4)
    p.check_invariants()


def test_a_key_is_carried_by_one_block_and_a_refusal_changes_nothing():
    """``set_keys`` refuses a key another block carries, a key twice, a block twice, and a
    block that carries a key is refused by ``publish_keys``; each refusal keys nothing."""
    p = BlockPool(4)
    p.allocate(4)
    p.set_key(0, "k")
    before = pool_state(p)
    with pytest.raises(ValueError, match="carried by block 0"):
        p.set_keys([1, 2], ["j", "k"])
    with pytest.raises(ValueError, match="key appears twice"):
        p.set_keys([1, 2], ["j", "j"])
    with pytest.raises(ValueError, match="block appears twice"):
        p.set_keys([1, 1], ["j", "i"])
    with pytest.raises(ValueError, match="carries a key already"):
        p.publish_keys([0, 1], ["x", "y"])
    assert pool_state(p) == before and p.block_of("j") is None
    p.set_keys([0], ["k2"])  # re-keying a block: its old key leaves the map
    assert (p.block_of("k"), p.block_of("k2"), p.key(0)) == (None, 0, "k2")
    p.check_invariants()


@given(st.data())
def test_pool_matches_model(data):
    """Random allocate/incref/release/set_key/revive/clear sequences against a plain model of the
    clean stack and the LRU: same block ids, same evictions, same counts."""
    n = data.draw(st.integers(1, 12), label="num_blocks")
    rec = Recorder()
    p = BlockPool(n, on_evict=rec)
    rc = [0] * n
    key = [None] * n
    never_used = list(range(n - 1, -1, -1))  # a stack: 0 on top
    clean: list[int] = []  # freed clean blocks, top at the end
    lru: list[int] = []  # cached-free blocks, least recently freed first
    evicted = []
    next_key = 0

    def take():
        if clean:
            return clean.pop()
        if never_used:
            return never_used.pop()
        b = lru.pop(0)
        evicted.append((b, key[b]))
        key[b] = None
        return b

    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        used = [b for b in range(n) if rc[b] > 0]
        op = data.draw(st.sampled_from(["alloc", "incref", "release", "set_key", "revive", "clear"]))
        if op == "alloc":
            k = data.draw(st.integers(0, n))
            avail = len(clean) + len(never_used) + len(lru)
            if k > avail:
                with pytest.raises(OutOfBlocks) as ei:
                    p.allocate(k)
                assert (ei.value.needed, ei.value.available) == (k, avail)
            else:
                want = [take() for _ in range(k)]
                for b in want:
                    rc[b] = 1
                assert p.allocate(k) == want
        elif op == "incref" and used:
            b = data.draw(st.sampled_from(used))
            p.incref(b)
            rc[b] += 1
        elif op == "release" and used:
            b = data.draw(st.sampled_from(used))
            p.release(b)
            rc[b] -= 1
            if rc[b] == 0:
                (lru if key[b] is not None else clean).append(b)
        elif op == "set_key" and used:
            b = data.draw(st.sampled_from(used))
            if key[b] is None:
                key[b] = next_key
                next_key += 1
                p.set_key(b, key[b])
        elif op == "revive" and lru:
            b = data.draw(st.sampled_from(lru))
            lru.remove(b)
            rc[b] = 1
            p.revive(b)
        elif op == "clear":
            got = p.clear_cached()
            assert sorted(got) == sorted((b, key[b]) for b in lru)
            for b in lru:
                key[b] = None
            clean.extend(b for b, _ in got)
            lru.clear()
            # The order in which cleared blocks join the clean stack is unspecified: realign the
            # model by taking every clean block and releasing them back in a known order.
            m = len(clean) + len(never_used)
            got_blocks = p.allocate(m)
            assert sorted(got_blocks) == sorted(clean + never_used)
            order = sorted(got_blocks, reverse=True)
            p.release_all(order)
            clean[:] = order  # the last released (smallest id) is on top
            never_used.clear()
        assert rec.calls == evicted
        assert [p.refcount(b) for b in range(n)] == rc
        assert [p.key(b) for b in range(n)] == key
        assert p.num_used == sum(1 for r in rc if r)
        assert p.num_cached == len(lru)
        assert p.num_clean == len(clean) + len(never_used)
        assert p.num_free == n - p.num_used
        p.check_invariants()


def test_numpy_integer_block_ids():
    """An engine keeping its own block tables as numpy arrays can pass their elements back:
    numpy integers are valid block ids and counts."""
    import numpy as np

    p = BlockPool(np.int64(4))
    table = np.array(p.allocate(np.int64(2)), dtype=np.int32)
    p.incref(table[0])
    assert p.refcount(table[0]) == 2
    p.set_key(table[1], "k")
    p.release_all(table[::-1])
    assert p.refcount(table[0]) == 1 and p.key(table[1]) == "k"
    p.release(table[0])
    assert counts(p) == (4, 3, 1, 0)
    p.revive(table[1])
    p.check_invariants()


def test_a_raising_eviction_callback_fails_the_allocation_and_keeps_the_pool_consistent():
    """The owner's callback is foreign code: if it raises, the allocation is undone (the evicted
    blocks come back clean, their keys gone) and the pool's invariants still hold."""

    def boom(block, key):
        raise RuntimeError("owner failed")

    p = BlockPool(2, on_evict=boom)
    a, b = p.allocate(2)
    p.set_key(a, "ka")
    p.release_all([a, b])  # a cached-free, b clean
    with pytest.raises(RuntimeError):
        p.allocate(2)  # takes b (clean), must evict a
    p.check_invariants()
    assert (p.num_free, p.num_clean, p.num_cached, p.num_used) == (2, 2, 0, 0)
    assert p.key(a) is None and p.evictions == 1


def test_a_raising_callback_on_a_single_eviction_also_leaves_the_pool_consistent():
    """The one-block path (a decode step taking the last cached block) undoes the same way."""

    def boom(block, key):
        raise RuntimeError("owner failed")

    p = BlockPool(1, on_evict=boom)
    (a,) = p.allocate(1)
    p.set_key(a, "ka")
    p.release(a)
    with pytest.raises(RuntimeError):
        p.allocate_one()
    p.check_invariants()
    assert (p.num_free, p.num_clean, p.num_cached) == (1, 1, 0)


def test_freed_by_names_the_blocks_a_release_would_free():
    """A grouped manager's window release: which blocks it frees, asked before it happens."""
    p = BlockPool(8)
    a, b, c = p.allocate(3)
    p.incref(b)  # b is held twice (a fork)
    assert p.freed_by({a: 1, b: 1, c: 1}) == [a, c]
    assert p.freed_by({b: 2}) == [b]
    assert p.refcounts()[:3] == [1, 2, 1]  # nothing changed


def test_revive_keyed_revives_only_cached_free_blocks():
    """Re-aging released window blocks: a cached-free block comes back with refcount 1 and leaves
    the LRU; a key no block carries, or whose block is in use, gives None."""
    p = BlockPool(8)
    a, b = p.allocate(2)
    p.set_keys([a, b], ["ka", "kb"])
    p.release(a)  # cached-free
    assert p.revive_keyed(["ka", "kb", "nope"]) == [a, None, None]
    assert (p.refcount(a), p.refcount(b), p.num_cached) == (1, 1, 0)
    p.release_all([b, a])  # released again, a now the most recently freed
    got = p.allocate(7)  # six never-used blocks, then the least recently freed: b
    assert b in got and a not in got and p.num_cached == 1
    p.check_invariants()
