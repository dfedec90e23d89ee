"""Contract v3: the grouped manager (issue 19 sections 1, 2 and 6), with exact expectations.

Block ids are deterministic (a fresh pool hands out 0, 1, 2, ... and reuses the newest freed
block first), and an admission takes its blocks interleaved by group: with two groups and three
new blocks each, group 0 gets [0, 2, 4] and group 1 [1, 3, 5].
"""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from pagedkv import (BlockRemoved, BlockStored, ChunkedLocalAttention, CopyOp, FullAttention,
                     KVCacheManager, OutOfBlocks, SlidingWindow)

GPT_OSS = [FullAttention(), SlidingWindow(window=32)]


def grouped(num_blocks=64, block_size=4, groups=(FullAttention(), SlidingWindow(window=8)), **kw):
    m = KVCacheManager(num_blocks=num_blocks, block_size=block_size, groups=list(groups), **kw)
    assert m.num_groups > 1 or type(m.groups[0]) is not FullAttention
    return m


def state(m):
    """Everything observable, as bytes: a failing call must leave it unchanged."""
    return pickle.dumps(m)


# ---- construction and dispatch -----------------------------------------------------------------


def test_plain_groups_are_todays_manager():
    for groups in (None, [FullAttention()], (FullAttention(),)):
        m = KVCacheManager(num_blocks=8, block_size=4, groups=groups)
        assert type(m) is KVCacheManager and m.num_groups == 1
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("a", [1, 2, 3, 4, 5])
    assert m.block_table("a", group=0) == [0, 1] and m.slots("a", 0, 2, group=0).tolist() == [0, 1]
    assert m.block_tables(["a"], group=0).tolist() == [[0, 1]]
    assert m.usage(group=0) == m.usage()
    with pytest.raises(ValueError, match="group"):
        m.block_table("a", group=1)


def test_groups_positionally_and_gpt_oss_at_block_size_4():
    """gpt-oss's pattern [Full, Sliding(32)] at block size 4: a 40-token prompt takes 10 blocks
    a group; the first decode call (position 40 reads 9..40) releases the window group's blocks
    0 and 1 (positions 0..7, published: cached-free) and then takes a block per group."""
    m = KVCacheManager(64, 4, True, "sha256", True, 0, "write-back", GPT_OSS)
    assert m.num_groups > 1 or type(m.groups[0]) is not FullAttention and m.num_groups == 2
    m.add_sequence("r", list(range(40)))
    assert m.block_table("r", group=1) == list(range(1, 20, 2))
    m.append_token("r", 5)
    assert m.block_table("r") == list(range(0, 20, 2)) + [20]
    assert m.block_table("r", group=1) == [-1, -1] + list(range(5, 20, 2)) + [21]
    assert (m.num_free_blocks, m.usage().cached_blocks, m.usage().used_blocks) == (44, 2, 20)
    for t in range(3):
        m.append_token("r", t)                  # committed 41..43: position 43 reads 12..43
    assert m.block_table("r", group=1)[:3] == [-1, -1, -1]
    m.check_invariants()


@pytest.mark.parametrize("bad", [[], [FullAttention(), "sliding"], "full", [SlidingWindow], None.__class__])
def test_bad_groups_are_value_errors(bad):
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=8, groups=bad)


def test_bad_windows_and_group_indices():
    with pytest.raises(ValueError, match="window"):
        SlidingWindow(window=0)
    with pytest.raises(ValueError, match="chunk"):
        ChunkedLocalAttention(chunk=0)
    m = grouped()
    m.add_sequence("a", list(range(9)))
    before = state(m)
    for call in (lambda: m.block_table("a", group=2), lambda: m.block_table("a", group=-1),
                 lambda: m.block_tables(["a"], group=2), lambda: m.slots("a", group=True),
                 lambda: m.flashinfer_layout(["a"], group=5), lambda: m.usage(group=2)):
        with pytest.raises(ValueError, match="group"):
            call()
    assert state(m) == before


def test_grouped_manager_refuses_what_it_does_not_take():
    """reserve=True is refused; without a host tier, so are swaps (with one: test_groups_host)."""
    m = grouped()
    with pytest.raises(ValueError, match="reserve"):
        m.add_sequence("a", [1, 2, 3], prefill=0, reserve=True)
    m.add_sequence("a", [1, 2, 3])
    with pytest.raises(ValueError, match="needs a host tier"):
        m.swap_out("a")
    with pytest.raises(ValueError, match="not swapped out"):
        m.swap_in("a")
    assert m.take_transfers() == [] and m.num_host_blocks == 0 and m.num_swapped_blocks("a") == 0


def test_release_timing_block_size_4_window_8():
    """Position q reads q-7 .. q. Block 0 (positions 0..3) is read last by the query at 10; it
    is released at the call that schedules position 11 (committed count 11), before that call
    allocates, and not earlier."""
    m = grouped()
    assert m.add_sequence("a", list(range(9))) == 0
    assert (m.block_table("a"), m.block_table("a", group=1)) == ([0, 2, 4], [1, 3, 5])
    assert m.num_free_blocks == 58
    m.append_token("a", 9)
    m.append_token("a", 10)      # the query at 10 reads 3..10: block 0 still read
    assert m.block_table("a", group=1) == [1, 3, 5] and m.num_free_blocks == 58
    m.append_token("a", 11)      # committed 11 at the call: block 0 wholly below 4 -> released
    assert m.block_table("a", group=1) == [-1, 3, 5]
    assert m.num_free_blocks == 59 and m.usage().cached_blocks == 1  # full and published: revivable
    m.append_token("a", 12)      # a new block per group, the freshest clean one first
    assert (m.block_table("a"), m.block_table("a", group=1)) == ([0, 2, 4, 6], [-1, 3, 5, 7])
    for t in range(13, 16):
        m.append_token("a", t)
    assert m.block_table("a", group=1) == [-1, -1, 5, 7]  # released at committed 15
    m.check_invariants()
    assert m.block_table("a") == [0, 2, 4, 6]             # full attention keeps everything


def test_gpt_oss_block_size_16_decode_holds_the_window():
    """[Full, Sliding(32)] at block size 16: a 100-token prompt takes 7 blocks per group (the
    step's queries read every position); after the first decode call the sliding group holds
    blocks 4..6 only (position 100 reads 69..100); 200 tokens later it holds 3 blocks."""
    m = grouped(num_blocks=100, block_size=16, groups=GPT_OSS)
    m.add_sequence("r", list(range(100)))
    assert m.block_table("r", group=1) == [1, 3, 5, 7, 9, 11, 13]
    m.append_token("r", 7)
    assert m.block_table("r", group=1) == [-1, -1, -1, -1, 9, 11, 13]
    assert m.num_free_blocks == 100 - 14 + 4
    for t in range(199):
        m.append_batch(["r"], [t]) if t % 2 else m.append_token("r", t)
    n = m.num_computed("r")
    assert n == 300
    live = [b for b in m.block_table("r", group=1) if b >= 0]
    assert len(live) == SlidingWindow(32).blocks_held(n, 16) == 3
    assert len(m.block_table("r")) == 19
    assert m.usage().used_blocks == 19 + 3
    m.check_invariants()


def test_next_release_is_where_released_below_grows():
    for spec in (SlidingWindow(8), SlidingWindow(5), SlidingWindow(128), ChunkedLocalAttention(8),
                 ChunkedLocalAttention(6), ChunkedLocalAttention(40)):
        for bs in (1, 4, 16):
            for c in range(0, 300):
                r = spec.next_release(c, bs, 1 << 40)
                assert r > c
                assert spec.released_below(r, bs) > spec.released_below(c, bs)
                assert spec.released_below(r - 1, bs) == spec.released_below(c, bs)
    assert SlidingWindow(128).next_release(1000, 16, 1 << 40) == 1007
    assert FullAttention().next_release(5, 4, 1 << 40) > 2**60


def test_chunked_prefill_under_a_small_window_never_deadlocks():
    """vLLM #39734: a 100-token prompt under a window of 8 (block size 4) in a pool of 6 blocks
    cannot be scheduled whole (25 blocks), but chunk by chunk it needs 3 blocks at a time: each
    chunk releases what the window has left before it allocates."""
    m = grouped(num_blocks=6, groups=[SlidingWindow(8)])
    prompt = list(range(100))
    with pytest.raises(OutOfBlocks) as e:
        m.add_sequence("whole", prompt)
    assert (e.value.needed, e.value.available) == (25, 6)
    assert m.num_sequences == 0 and m.num_free_blocks == 6
    m.add_sequence("r", prompt, prefill=4)
    peak = 0
    while m.num_computed("r") < 100:
        m.prefill("r", 4)
        peak = max(peak, m.usage().used_blocks)
        m.check_invariants()
    assert peak == 3
    assert m.block_table("r")[-3:] == [b for b in m.block_table("r") if b >= 0]
    m.append_token("r", 1)
    m.check_invariants()


def test_admission_checks_the_chunk_not_the_prompt_with_a_full_group():
    """[Full, Sliding(8)], a 40-token prompt in chunks of 8 needs 2 blocks per chunk per group;
    the full group keeps all of them, the sliding group at most 3 + 1."""
    m = grouped(num_blocks=20)
    m.add_sequence("r", list(range(40)), prefill=8)
    assert m.usage().used_blocks == 4
    for _ in range(4):
        m.prefill("r", 8)
    assert len(m.block_table("r")) == 10
    assert m.block_table("r", group=1)[:6] == [-1] * 6   # position 32's window starts at 25
    assert m.usage().used_blocks == 10 + 4
    m.check_invariants()


# ---- the hit rule ------------------------------------------------------------------------------


def test_released_block_is_revived_by_a_hit():
    m = grouped()
    m.add_sequence("a", list(range(9)))
    for t in range(9, 12):
        m.append_token("a", t)   # group 1's block 0 (id 1) released, cached-free
    prompt = list(range(8)) + [50, 51]
    hit = m.lookup(prompt)
    assert (int(hit), hit.device, hit.revived) == (8, 8, 1)
    assert m.add_sequence("b", prompt) == 8
    assert m.block_table("b") == [0, 2, 6] and m.block_table("b", group=1) == [1, 3, 7]
    assert m.refcount(1) == 1 and m.refcount(3) == 2
    m.check_invariants()


def test_hit_rule_a_window_needs_only_its_last_blocks():
    """Sliding(4) at block size 4: a hit of h tokens needs only the block covering h-3..h-1.
    Evicting the cached prompt's blocks from the tail shrinks the hit one block at a time."""
    m = grouped(num_blocks=4, groups=[SlidingWindow(4)])
    m.add_sequence("a", list(range(12)))        # blocks [0, 1, 2], all full and published
    m.free("a")                                 # LRU, oldest first: 2, 1, 0 (tail first)
    m.add_sequence("x", [99])                   # the never-used block 3
    m.add_sequence("y", [98])                   # evicts block 2
    assert m.lookup(list(range(12)) + [5]) == 8  # h = 12 needs block 2; h = 8 needs block 1 only
    m.add_sequence("z", [97])                   # evicts block 1
    assert m.lookup(list(range(12)) + [5]) == 4  # h = 4 needs block 0
    for s in "xyz":
        m.free(s)                               # clean stack: 3, 2, 1 (1 on top)
    assert m.add_sequence("b", list(range(9))) == 4
    assert m.block_table("b") == [0, 1, 2]
    m.check_invariants()


def test_hit_rule_evicted_low_block_keeps_the_window_hit():
    """The first blocks of a cached prompt gone or not, a window hit needs only its last ones:
    the entries below read -1, and the cached block 0 is left cached-free."""
    m = grouped(num_blocks=8, groups=[SlidingWindow(4)])
    prompt = list(range(16))
    m.add_sequence("a", prompt)                 # blocks [0, 1, 2, 3]
    m.free("a")                                 # LRU, oldest first: 3, 2, 1, 0
    for i in range(4):
        m.add_sequence(f"f{i}", [200 + i])      # never-used blocks 4..7
    m.add_sequence("e1", [300])                 # evicts 3
    assert m.lookup(prompt + [1]) == 12         # h = 12 needs block 2 only
    m.add_sequence("e2", [301])                 # evicts 2
    assert m.lookup(prompt + [1]) == 8          # h = 8 needs block 1 only
    m.free("e1")
    m.free("e2")                                # clean stack: 3, 2 (2 on top)
    assert m.add_sequence("b", prompt[:12] + [7]) == 8
    assert m.block_table("b") == [-1, 1, 2, 3]  # block 0 not needed: -1, and left cached-free
    assert m.usage().cached_blocks == 1 and m.refcount(0) == 0
    m.check_invariants()


def test_hit_rule_full_group_limits_the_hit_and_chunk_boundary_needs_nothing():
    m = grouped(num_blocks=32, groups=[FullAttention(), ChunkedLocalAttention(8)])
    prompt = list(range(12))
    m.add_sequence("a", prompt)                 # g0 [0, 2, 4], g1 [1, 3, 5]
    for t in range(4):
        m.append_token("a", 100 + t)           # committed 12 at the 1st call: chunk 8..15
    assert m.block_table("a", group=1) == [-1, -1, 5, 7]  # committed 12: the chunk from 8
    m.free("a")
    # h = 8 is a chunk boundary: the chunked group needs no block; the full group needs 0, 1
    hit = m.lookup(list(range(8)) + [1, 2])
    assert int(hit) == 8
    assert m.add_sequence("b", list(range(8)) + [1, 2]) == 8
    # a's blocks were all full and published, so cached-free now: b's new ones are never-used
    assert m.block_table("b", group=1) == [-1, -1, 9] and m.block_table("b", group=0) == [0, 2, 8]
    m.check_invariants()


def test_lookup_changes_nothing_and_add_sequence_agrees():
    m = grouped(num_blocks=16)
    m.add_sequence("a", list(range(13)))
    m.free("a")
    m.take_events()
    before = m.usage()
    prompt = list(range(12)) + [7, 7]
    hit = m.lookup(prompt)
    assert m.usage() == before and m.take_events() == []
    assert m.usage().prefix_query_tokens == 13
    assert m.add_sequence("b", prompt) == hit == 12
    assert m.usage().prefix_hit_tokens == 12


def test_never_the_whole_prompt():
    m = grouped()
    m.add_sequence("a", list(range(8)))
    assert m.lookup(list(range(8))) == 4 and m.add_sequence("b", list(range(8))) == 4


# ---- fork, copy-on-write, drafts, free -----------------------------------------------------------


def test_fork_and_copy_on_write_per_group():
    m = grouped()
    m.add_sequence("p", list(range(9)))         # g0 [0, 2, 4], g1 [1, 3, 5]; 4 and 5 partial
    m.fork("p", "c")
    assert [m.refcount(b) for b in range(6)] == [2] * 6 and m.num_free_blocks == 58
    m.append_token("c", 1)
    assert m.take_copies() == [CopyOp(4, 6, group=0), CopyOp(5, 7, group=1)]
    assert m.block_table("c") == [0, 2, 6] and m.block_table("c", group=1) == [1, 3, 7]
    m.append_token("p", 2)                      # the last holder writes in place
    assert m.take_copies() == [] and m.block_table("p", group=1) == [1, 3, 5]
    assert m.usage().cow_copies == 2 and m.usage().forks == 1
    m.check_invariants()


def test_fork_shares_live_entries_only():
    m = grouped()
    m.add_sequence("p", list(range(9)))
    for t in range(3):
        m.append_token("p", t)                  # g1 [-1, 3, 5]
    m.fork("p", "c")
    assert m.block_table("c", group=1) == [-1, 3, 5] and m.refcount(3) == 2 and m.refcount(0) == 2
    m.free("p")
    m.free("c")
    m.check_invariants()
    assert m.usage().used_blocks == 0


def test_drafts_rollback_per_group():
    m = grouped()
    m.add_sequence("s", list(range(9)))         # g0 [0, 2, 4], g1 [1, 3, 5]
    slots = m.append_tokens("s", [1, 2, 3, 4, 5], speculative=True)
    assert slots == [17, 18, 19, 24, 25]        # group 0: block 4 offsets 1..3, block 6
    assert m.block_table("s", group=1) == [1, 3, 5, 7]
    free = m.num_free_blocks
    m.accept("s", 1)                            # 10 tokens kept: blocks 6, 7 held only drafts
    assert m.block_table("s") == [0, 2, 4] and m.block_table("s", group=1) == [1, 3, 5]
    assert m.num_free_blocks == free + 2 and m.usage().cached_blocks == 0  # back clean
    m.check_invariants()
    m.append_tokens("s", [6, 7], speculative=True)  # fills block 4/5 (10, 11) as drafts
    m.accept("s", 2)                            # kept: the blocks fill and are published
    ev = m.take_events()
    assert [(e.group_idx, len(e.block_hashes)) for e in ev][-2:] == [(0, 1), (1, 1)]
    m.check_invariants()


def test_free_without_cache_unpublishes_what_it_computed():
    m = grouped(num_blocks=32)
    m.add_sequence("a", list(range(9)))
    m.free("a")
    m.add_sequence("b", list(range(17)))        # hits 8; computes blocks 2, 3 itself
    m.free("b", cache=False)
    assert m.lookup(list(range(17))) == 8
    m.check_invariants()


def test_failures_change_nothing():
    m = grouped(num_blocks=7)
    m.add_sequence("a", list(range(8)))         # 4 blocks
    m.fork("a", "b")
    before = state(m)
    with pytest.raises(OutOfBlocks):
        m.add_sequence("c", list(range(100, 120)))
    with pytest.raises(OutOfBlocks):
        m.append_batch(["a", "b"], [1, 2])      # needs 4 fresh blocks, 3 free
    with pytest.raises(OutOfBlocks):
        m.append_tokens("a", list(range(9)))
    with pytest.raises(ValueError):
        m.append_batch(["a", "a"], [1, 2])
    with pytest.raises(KeyError):
        m.append_batch(["a", "zz"], [1, 2])
    with pytest.raises(ValueError):
        m.prefill("a", 1)
    assert state(m) == before
    m.check_invariants()


def test_append_batch_releases_before_it_allocates():
    """Two sequences whose windows let blocks go in the step that needs new blocks: 4 fresh
    blocks with 1 free fit only because the 4 released blocks serve the step (released tail
    first, published, so evicted oldest first)."""
    m = grouped(num_blocks=13, groups=[FullAttention(), SlidingWindow(4)])
    m.add_sequence("a", list(range(12)))        # g0 [0, 2, 4], g1 [1, 3, 5]
    m.add_sequence("b", list(range(50, 62)))    # g0 [6, 8, 10], g1 [7, 9, 11]
    assert m.num_free_blocks == 1
    m.append_batch(["a", "b"], [1, 2])          # committed 12: position 12 reads 9..12
    assert (m.block_table("a"), m.block_table("a", group=1)) == ([0, 2, 4, 12], [-1, -1, 5, 3])
    assert (m.block_table("b"), m.block_table("b", group=1)) == ([6, 8, 10, 1], [-1, -1, 11, 9])
    assert m.usage().evictions == 3 and m.num_free_blocks == 1
    m.check_invariants()


# ---- exports and usage ---------------------------------------------------------------------------


def test_exports_per_group():
    m = grouped()
    m.add_sequence("a", list(range(9)))
    for t in range(4):
        m.append_token("a", t)                  # 13 tokens; g1 [-1, 3, 5, 7]
    m.add_sequence("b", [1, 2, 3])
    assert m.block_tables(["a", "b"], group=1, pad=0).tolist() == [[-1, 3, 5, 7], [9, 0, 0, 0]]
    assert m.block_tables(["a", "b"]).tolist() == [[0, 2, 4, 6], [8, -1, -1, -1]]
    assert m.slots("a", 4, 6, group=1).tolist() == [12, 13]
    with pytest.raises(ValueError, match="released"):
        m.slots("a", 3, 6, group=1)
    assert m.slots("a", 12, group=1).tolist() == [28]
    indptr, indices, last = m.flashinfer_layout(["a", "b"], group=1)
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 3, 4], [3, 5, 7, 9], [1, 3])
    indptr, indices, last = m.flashinfer_layout(["a", "b"])
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 4, 5], [0, 2, 4, 6, 8], [1, 3])
    assert all(a.dtype == np.int32 for a in (indptr, indices, last))


def test_usage_totals_and_per_group():
    m = grouped(groups=[FullAttention(), SlidingWindow(4)])
    m.add_sequence("a", list(range(10)))
    m.append_token("a", 1)                      # committed 10: position 10 reads 7..10: g1 block 0 goes
    u0, u1, u = m.usage(group=0), m.usage(group=1), m.usage()
    assert (u0.used_blocks, u0.stored_tokens, u0.logical_tokens) == (3, 11, 11)
    assert (u1.used_blocks, u1.stored_tokens, u1.logical_tokens) == (2, 7, 11)
    assert (u.used_blocks, u.stored_tokens, u.logical_tokens) == (5, 18, 11)
    assert u.cached_blocks == 1 and u1.cached_blocks == 1 and u0.cached_blocks == 0
    assert u.allocated_slots == 20 and u.blocks_saved_by_sharing == 0


def test_pickle_round_trip_is_equal_and_behaves_the_same():
    m = grouped()
    m.add_sequence("a", list(range(9)))
    m.fork("a", "b")
    m.append_token("b", 3)
    m2 = pickle.loads(pickle.dumps(m))
    assert m2.usage() == m.usage() and m2.take_copies() == m.take_copies()
    for x in (m, m2):
        for t in range(6):
            x.append_batch(["a", "b"], [t, t])
    assert [m.block_table(s, g) for s in "ab" for g in (0, 1)] == [m2.block_table(s, g) for s in "ab" for g in (0, 1)]
    assert m.take_events() == m2.take_events()
    m2.check_invariants()


# ---- events ------------------------------------------------------------------------------------


def test_events_name_the_group_and_spec():
    m = grouped(num_blocks=6, groups=[FullAttention(), SlidingWindow(8)])
    m.add_sequence("a", list(range(9)))
    ev = m.take_events()
    assert [type(e) for e in ev] == [BlockStored, BlockStored]
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in ev] == [
        (0, "full_attention", None), (1, "sliding_window", 8)]
    assert ev[0].block_hashes == ev[1].block_hashes and ev[0].token_ids == tuple(range(8))
    stored_hashes = ev[0].block_hashes
    m.free("a")
    # freed tail first, block i of every group before block i - 1: clean 4, 5; LRU 2, 3, 0, 1
    m.add_sequence("b", list(range(100, 112)))  # 6 blocks: 5, 4, then evicts 2, 3, 0, 1
    assert m.block_table("b") == [5, 2, 0] and m.block_table("b", group=1) == [4, 3, 1]
    ev = m.take_events()
    removed = [e for e in ev if isinstance(e, BlockRemoved)]
    assert [(e.group_idx, len(e.block_hashes)) for e in removed] == [(0, 1), (1, 1), (0, 1), (1, 1)]
    assert removed[0].block_hashes == removed[1].block_hashes == stored_hashes[1:]


def test_events_on_the_wire_decode_with_vllms_structs():
    msgspec = pytest.importorskip("msgspec")
    from pagedkv.events import decode_vllm, encode_vllm
    from test_events import VllmBlockRemoved, VllmBlockStored, _vllm_decode

    m = grouped(num_blocks=6, groups=[ChunkedLocalAttention(8), SlidingWindow(8)])
    m.add_sequence("a", list(range(9)))
    m.free("a")
    m.add_sequence("b", list(range(100, 112)))
    payload = encode_vllm(m.take_events(), 1.0)
    batch = _vllm_decode(payload)
    stored = [e for e in batch.events if isinstance(e, VllmBlockStored)]
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored][:2] == [
        (0, "chunked_local_attention", None), (1, "sliding_window", 8)]
    assert stored[0].parent_block_hash is None and stored[0].token_ids == list(range(8))
    removed = [e for e in batch.events if isinstance(e, VllmBlockRemoved)]
    assert {e.group_idx for e in removed} == {0, 1}
    _, ours, _ = decode_vllm(payload)
    assert [msgspec.structs.asdict(e) for e in ours] == [msgspec.structs.asdict(e) for e in batch.events]


def test_copyop_and_transfer_stay_pairs_and_triples():
    """``group`` is kept beside the tuple: unpacking, numpy conversion and comparison with plain
    tuples work as before contract v3, and the group still tells two ops apart."""
    from pagedkv import Transfer

    op = CopyOp(3, 5, group=1)
    src, dst = op
    assert (src, dst, op.group) == (3, 5, 1) and np.asarray([op, CopyOp(1, 2)]).shape == (2, 2)
    assert op == (3, 5) and CopyOp(3, 5) == (3, 5) and op != CopyOp(3, 5) and op == CopyOp(3, 5, 1)
    assert repr(CopyOp(3, 5)) == "CopyOp(src=3, dst=5)" and repr(op) == "CopyOp(src=3, dst=5, group=1)"
    assert pickle.loads(pickle.dumps(op)).group == 1 and op._replace(group=0) == CopyOp(3, 5)
    t = Transfer("to_host", 1, 2)
    assert t == ("to_host", 1, 2) and len(t) == 3 and t.group == 0 and t.direction == "to_host"


def test_plain_manager_events_carry_group_zero():
    """As vLLM tags a one-group model's events: group 0, full attention, no window."""
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("a", list(range(9)))
    [e] = m.take_events()
    assert (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) == (0, "full_attention", None)


# ---- the fleet's precise router on hybrid replicas ---------------------------------------------


def test_precise_router_keys_on_group_and_hash():
    """A replica whose sliding group released (and then evicted) a prompt's first block still
    holds it in the full group: keyed on (group, hash), the router keeps the full group's entry,
    and with ``groups`` it matches what the replica's own ``lookup`` returns."""
    from pagedkv.sim.routers import PrefixAwareRouter

    groups = [FullAttention(), SlidingWindow(8)]
    m = grouped(num_blocks=64, groups=groups)
    router = PrefixAwareRouter(block_size=4, groups=groups)
    plain = PrefixAwareRouter(block_size=4)
    for r in (router, plain):
        r.bind(["r0", "r1"])
    m.add_sequence("a", list(range(16)))
    for t in range(8):
        m.append_token("a", t)
    ev = m.take_events()
    for r in (router, plain):
        r.on_events(0, ev)
    assert router.blocks_held(0) == plain.blocks_held(0) and len(router.blocks_held(0)) == 6
    assert len(router.blocks_held(0, group=1)) == 6
    # a removal in group 1 leaves group 0's entry of the same hash
    [h0] = [e.block_hashes[0] for e in ev if e.group_idx == 1][:1]
    from pagedkv import BlockRemoved as Removed
    from pagedkv.events import hash_to_u64
    router.on_events(0, [Removed((h0,), "GPU", 1)])
    assert hash_to_u64(h0) in router.blocks_held(0) and hash_to_u64(h0) not in router.blocks_held(0, group=1)
    prompt = list(range(16)) + list(range(8)) + [9]
    assert router.match_blocks(prompt)[1] == 0
    # the hybrid rule: the window needs only the blocks covering h-7 .. h-1
    assert router.match_blocks(prompt)[0] * 4 == m.lookup(prompt) == 24


def test_a_decode_step_makes_every_release_before_it_takes_a_block():
    """Twins under a window of 2 (block size 1): b's release frees what a's new block needs, so
    the step must release first; taking a's block first would evict the cached [7] block."""
    m = KVCacheManager(8, block_size=1, groups=[SlidingWindow(window=2)])
    m.add_sequence("a", [1, 2, 3], prefill=0)
    m.add_sequence("b", [1, 2, 3])
    m.prefill("a", 3)
    m.add_sequence("c", [7])
    m.add_sequence("d", [8])
    m.free("c")
    m.free("d")
    assert m.lookup([7, 0]) == 1
    m.append_batch(["b", "a"], [9, 9])
    assert m.lookup([7, 0]) == 1 and m.usage().evictions == 0
    m.check_invariants()
