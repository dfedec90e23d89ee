"""The host tier at its edges (issue 17, section 1): no host copy of K/V that was never written,
no host block that no lookup or router can reach, and what each write policy does.

Each test of a bug names it; every one of those fails on the code before the fix.
"""
from __future__ import annotations

import pickle

import pytest

from pagedkv import BlockRemoved, BlockStored, KVCacheManager, Transfer

BS = 4


def _refused(m: KVCacheManager, seq_id) -> None:
    """swap_out(seq_id) is refused and changes nothing: tables, counts, and (read off pickled
    twins, so that nothing is drained here) the pending transfers, copies and events."""
    before = pickle.dumps(m)
    with pytest.raises(ValueError, match="given positions or blocks in this step"):
        m.swap_out(seq_id)
    was, now = pickle.loads(before), pickle.loads(pickle.dumps(m))
    assert m.block_table(seq_id) == was.block_table(seq_id)
    assert m.usage() == was.usage() and m.num_free_host_blocks == was.num_free_host_blocks
    assert now.take_transfers() == was.take_transfers()
    assert now.take_copies() == was.take_copies()
    assert now.take_events() == was.take_events()


# ---- swap_out of a sequence given blocks in this step ----------------------------------------


def test_swap_out_right_after_admission_is_refused():
    """The issue's repro: the admission's 3 blocks have no K/V until the step runs; swapping
    them out queued 3 to_host moves of garbage and published them on the host."""
    m = KVCacheManager(num_blocks=16, block_size=BS, host_blocks=16)
    m.add_sequence("s", list(range(10, 19)))
    _refused(m, "s")
    m.take_transfers()  # the step: its K/V is written after this drain
    m.take_copies()
    m.swap_out("s")  # between steps: legal
    assert [t.direction for t in m.take_transfers()] == ["to_host"] * 3
    m.check_invariants()


def test_swap_out_after_an_append_that_opened_a_block_is_refused():
    m = KVCacheManager(num_blocks=16, block_size=BS, host_blocks=16)
    m.add_sequence("s", list(range(8)))  # two full blocks
    m.take_transfers()
    m.append_token("s", 5)  # a third block, fresh
    _refused(m, "s")
    m.take_transfers()
    m.swap_out("s")
    m.check_invariants()


def test_swap_out_after_any_append_in_the_step_is_refused():
    """An append into the private last block takes no block, but its slot is written only
    after the drain: the to_host would copy the block without it, and the sequence would come
    back with a position that holds nothing."""
    m = KVCacheManager(num_blocks=16, block_size=BS, host_blocks=16)
    m.add_sequence("s", list(range(5)))
    m.add_sequence("t", list(range(50, 55)))
    m.take_transfers()
    m.append_token("s", 1)
    m.append_batch(["t"], [2])
    _refused(m, "s")
    _refused(m, "t")
    m.append_tokens("t", [3])
    _refused(m, "t")


def test_swap_out_after_a_prefill_chunk_is_refused():
    m = KVCacheManager(num_blocks=16, block_size=BS, host_blocks=16)
    m.add_sequence("s", list(range(12)), prefill=0)
    m.take_transfers()
    m.prefill("s", 12)  # the whole prompt, in one chunk: fully scheduled, not computed
    _refused(m, "s")
    m.take_transfers()
    m.swap_out("s")


def test_swap_out_after_copy_on_write_and_of_a_fork_of_an_unwritten_parent_is_refused():
    m = KVCacheManager(num_blocks=16, block_size=BS, host_blocks=16)
    m.add_sequence("p", list(range(6)))
    m.take_transfers()
    m.fork("p", "c")
    m.append_token("c", 9)  # copy-on-write: c's last block is a pending copy's destination
    _refused(m, "c")
    m.append_token("p", 7)  # p writes its shared block in place, unwritten till the step
    m.fork("p", "q")  # against the fork rule: q shares p's unwritten position
    _refused(m, "q")


def test_swap_out_of_a_sequence_loaded_from_the_host_waits_for_the_drain():
    m = KVCacheManager(num_blocks=4, block_size=BS, host_blocks=8)
    a = list(range(9))
    m.add_sequence("a", a)
    m.free("a")
    m.add_sequence("b", list(range(100, 116)))  # evicts a's blocks: offloaded
    m.free("b")
    m.take_transfers()
    assert m.lookup(a).host == 8
    m.add_sequence("c", a)  # two loads and a fresh block for the last token
    _refused(m, "c")
    m.take_transfers()
    m.swap_out("c")
    m.check_invariants()


def test_a_sequence_given_nothing_this_step_swaps_out_mid_step():
    """A sequence the step has not scheduled may be swapped out in the very step others are
    admitted and appended to (the engine's preemption point); one admitted or appended to in
    it may not."""
    m = KVCacheManager(num_blocks=16, block_size=BS, host_blocks=16)
    m.add_sequence("a", list(range(9)))
    m.add_sequence("h", list(range(50, 59)))
    m.take_transfers()
    m.add_sequence("x", list(range(9)))  # 8 tokens hit on a's blocks
    m.append_token("a", 4)
    _refused(m, "x")
    _refused(m, "a")
    m.swap_out("h")
    assert m.num_swapped_blocks("h") == 3
    assert [t.direction for t in m.take_transfers()] == ["to_host"] * 3
    m.check_invariants()


# ---- every host block reachable ---------------------------------------------------------------


def _parent_known_at_each_store(events, known: set) -> None:
    """Replay events as a router does: each BlockStored's parent must be known (on either
    medium) at that event, or be a salt's root (never a block hash)."""
    ever = set(known)
    for ev in events:
        if isinstance(ev, BlockStored):
            p = ev.parent_block_hash
            assert p is None or p in known or p not in ever, f"{ev.medium} store names an unknown parent"
            known.update(ev.block_hashes)
            ever.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            known.difference_update(ev.block_hashes)


def test_the_host_never_evicts_a_parent_to_make_room_for_its_child():
    """The issue's repro: the host held a1; the device evicted a0 and a2 (a1's child) into a
    two-block host; the host evicted a1 to store a2, which nothing could reach: the prompt hit
    4 tokens on the host. Now a1 is held through the allocation, a0 is stored and a2 is not:
    the prompt hits 8."""
    m = KVCacheManager(num_blocks=8, block_size=BS, host_blocks=2)
    p = list(range(100, 113))
    m.add_sequence("x", p, prefill=0)
    m.add_sequence("y", p[:9])
    m.take_transfers()
    m.prefill("x", 13)
    m.take_transfers()
    m.free("y")
    m.add_sequence("g", [8] * 9)
    m.take_transfers()
    m.free("x")
    m.free("g")
    known = set()
    _parent_known_at_each_store(m.take_events(), known)
    m.add_sequence("h", list(range(900, 929)))
    m.take_transfers()
    events = m.take_events()
    _parent_known_at_each_store(events, known)
    m.check_invariants()
    m.free("h")
    hit = m.lookup(p)
    assert (hit, hit.device, hit.host) == (8, 0, 8)


def test_a_host_block_goes_with_its_parent_when_the_parent_leaves_both_tiers():
    """Under "none": a swap moves b1 to the host (its parent b0, shared, stays on the device)
    and publishes it there. The device then evicts b0, which "none" never copies out: no
    lookup can reach b1 any more and a router that was told b0 is gone would drop it, so b1
    goes too, in a BlockRemoved after the device's. Before, it stayed, unreachable."""
    m = KVCacheManager(num_blocks=4, block_size=BS, host_blocks=4, host_write_policy="none")
    a = list(range(8)) + [1]
    m.add_sequence("a", a)  # b0, b1, a partial tail
    m.take_transfers()
    m.add_sequence("s", a[:4] + [7])  # shares b0
    m.take_transfers()
    m.swap_out("a")  # b1 and the tail go to the host; b1 is published there
    m.take_transfers()
    m.free("a")
    m.free("s")
    assert m.usage().host_cached_blocks == 1  # b1, reachable: its parent is on the device
    m.check_invariants()
    m.take_events()
    m.add_sequence("q", list(range(200, 216)))  # evicts b1's device copy and b0
    assert m.take_transfers() == []  # "none": nothing is copied out
    events = m.take_events()
    media = [(type(e).__name__, e.medium) for e in events if isinstance(e, BlockRemoved)]
    assert media == [("BlockRemoved", "GPU"), ("BlockRemoved", "CPU")]
    assert m.usage().host_cached_blocks == 0
    m.check_invariants()
    m.free("q")
    assert m.lookup(a) == 0


def test_a_device_orphan_is_never_copied_out():
    """The device may keep a block whose parent it evicted: two forks fill the same block, the
    second (a twin) is not published, and its child chains from the first's hash. Once the
    first is evicted the child is unreachable on the device (documented); it must not become a
    host block, since the host would keep what no lookup reaches."""
    m = KVCacheManager(num_blocks=6, block_size=BS, host_blocks=6)
    m.add_sequence("a", [1, 2, 3])
    m.take_transfers()
    m.fork("a", "b")
    m.append_batch(["a", "b"], [4, 4])  # a publishes [1,2,3,4]; b's copy is a twin
    m.take_transfers()
    m.take_copies()
    m.free("a")  # the published block goes cached-free
    m.add_sequence("f", list(range(50, 70)))  # evicts it: offloaded to the host
    m.take_transfers()
    m.free("f", cache=False)
    m.append_tokens("b", [5, 6, 7, 8])  # b's second block, chained from the evicted hash
    m.take_transfers()
    m.check_invariants()
    m.free("b")
    m.add_sequence("g", list(range(80, 100)))  # evicts b's blocks: the child has a host parent
    m.take_transfers()
    m.check_invariants()
    hit = m.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert hit.device + hit.host in (4, 8)


# ---- the write policies -----------------------------------------------------------------------


def test_write_through_copies_out_again_a_block_the_host_dropped():
    """Write-through copies a block out once it is computed; if the host drops it later (for
    room), the device's eviction copies it out again, as write-back would."""
    m = KVCacheManager(num_blocks=4, block_size=BS, host_blocks=1, host_write_policy="write-through")
    a = list(range(4)) + [9]
    m.add_sequence("a", a)  # a0 in device block 0
    m.take_transfers()
    assert m.take_transfers() == [Transfer("to_host", 0, 0)]  # one drain late
    m.add_sequence("z", list(range(50, 54)) + [9])  # z0 in device block 2
    m.take_transfers()
    assert m.take_transfers() == [Transfer("to_host", 2, 0)]  # the host drops a0 for z0
    assert (m.lookup(a).device, m.lookup(a).host) == (4, 0)
    m.free("a")  # z stays: z0 in use on the device
    m.add_sequence("q", list(range(100, 108)))  # 2 blocks: a's tail, then a0 evicted
    assert m.take_transfers() == [Transfer("to_host", 0, 0)]  # copied out again
    m.free("q")
    assert (m.lookup(a).device, m.lookup(a).host) == (0, 4)
    m.check_invariants()


def test_under_none_the_host_serves_hits_from_blocks_a_swap_left_behind():
    """"none" copies nothing out on eviction or publication, but a swapped-out sequence's
    published blocks are published on the host; after the sequence is freed they stay there,
    findable, until the host needs the room. Dropping them would throw away correct K/V."""
    m = KVCacheManager(num_blocks=3, block_size=BS, host_blocks=4, host_write_policy="none")
    a = list(range(8)) + [1]
    m.add_sequence("a", a)
    m.take_transfers()
    m.swap_out("a")
    m.take_transfers()
    m.free("a")
    m.add_sequence("q", list(range(200, 212)))  # the device evicts a's blocks: not offloaded
    assert m.take_transfers() == []
    m.free("q")
    hit = m.lookup(a)
    assert (hit.device, hit.host) == (0, 8)
    assert m.add_sequence("b", a) == 8
    assert [t.direction for t in m.take_transfers()] == ["to_device", "to_device"]
    m.check_invariants()


def test_reset_clears_the_host_too_and_is_refused_while_a_sequence_is_swapped_out():
    for policy in ("write-back", "write-through", "none"):
        m = KVCacheManager(num_blocks=4, block_size=BS, host_blocks=8, host_write_policy=policy)
        a = list(range(8)) + [1]
        m.add_sequence("a", a)
        m.take_transfers()
        m.swap_out("a")
        m.take_transfers()
        assert m.reset_prefix_cache() is False  # a sequence is swapped out
        m.swap_in("a")
        m.take_transfers()
        m.free("a")
        m.add_sequence("q", list(range(200, 216)))
        m.take_transfers()
        m.free("q")
        m.take_transfers()
        assert m.lookup(a).host == 8, policy
        m.take_events()
        assert m.reset_prefix_cache() is True
        assert m.lookup(a) == 0 and m.usage().host_cached_blocks == 0
        m.check_invariants()


def test_a_swapped_out_sequence_with_no_private_block_also_blocks_reset():
    """It holds no host block, only its share of the device: reset is still refused."""
    m = KVCacheManager(num_blocks=8, block_size=BS, host_blocks=8)
    m.add_sequence("a", list(range(8)))
    m.take_transfers()
    m.fork("a", "b")
    m.swap_out("b")
    assert m.num_swapped_blocks("b") == 0
    m.free("a")
    assert m.reset_prefix_cache() is False


def test_a_pickled_tiered_manager_still_refuses_a_swap_after_a_fast_path_append():
    """append_token of a tiered manager is an instance-bound wrapper (the untiered per-token
    path pays nothing); a pickled copy must rebind it, or swap_out would accept unwritten K/V."""
    import pickle

    m = KVCacheManager(16, 4, host_blocks=8)
    m.add_sequence("s", [1, 2, 3, 4, 5])
    m.take_transfers()
    twin = pickle.loads(pickle.dumps(m))
    for mgr in (m, twin):
        mgr.append_token("s", 9)  # into its own partial block: the fast path
        with pytest.raises(ValueError, match="take_transfers"):
            mgr.swap_out("s")
        mgr.take_transfers()
        mgr.swap_out("s")
        mgr.check_invariants()
