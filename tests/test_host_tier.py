"""The host tier: offload on eviction, prefix hits served from host memory, swap preemption.

Exact block ids and transfer lists where the design fixes them: the device hands out clean
blocks LIFO above a never-used watermark (lowest first) and evicts its least recently freed
cached block; the host tier is a pool of the same kind.
"""
from __future__ import annotations

import pickle

import pytest

from pagedkv import BlockRemoved, BlockStored, KVCacheManager, OutOfBlocks, PrefixHit, Transfer

BS = 4


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def to_host(src, dst):
    return Transfer("to_host", src, dst)


def to_device(src, dst):
    return Transfer("to_device", src, dst)


def make(num_blocks=6, host_blocks=8, **kw):
    return KVCacheManager(num_blocks=num_blocks, block_size=BS, host_blocks=host_blocks, **kw)


def fill_and_evict(m):
    """Prompt A (3 full blocks + 1 token) cached and freed, then other prompts evict it."""
    a = toks(0, 13)
    m.add_sequence("a", a)  # blocks 0, 1, 2 full and published, 3 partial
    m.free("a")  # released tail first: LRU order 2, 1, 0 (block 3 goes clean)
    m.take_events()
    return a


# ---------------------------------------------------------------- construction and bad input


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4", 2**31])
def test_bad_host_sizes_are_refused(bad):
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=8, block_size=BS, host_blocks=bad)


def test_bad_write_policy_is_refused():
    with pytest.raises(ValueError, match="host_write_policy"):
        KVCacheManager(num_blocks=8, block_size=BS, host_blocks=4, host_write_policy="lazy")


def test_without_a_host_tier_nothing_changes():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    m.add_sequence("a", toks(0, 9))
    assert m.take_transfers() == []
    hit = m.lookup(toks(0, 9))
    assert (hit, hit.device, hit.host) == (8, 8, 0)
    assert (str(hit), f"{hit}", f"{hit:,}") == ("8", "8", "8")  # prints as the number it is
    with pytest.raises(ValueError, match="host tier"):
        m.swap_out("a")
    u = m.usage()
    assert (u.host_blocks, u.host_used_blocks, u.swapped_sequences) == (0, 0, 0)


# ---------------------------------------------------------------- write-back offload


def test_eviction_offloads_to_the_host_with_events_tagged_by_medium():
    m = make()
    fill_and_evict(m)
    # 6 device blocks: 3 cached (2, 1, 0 oldest first... released tail first: 2 is oldest), 3 clean
    m.add_sequence("b", toks(100, 20))  # 5 blocks: 3 clean (3, 4, 5), then evicts 2 and 1
    assert m.block_table("b") == [3, 4, 5, 2, 1]
    # evicted child (2) first, parent (1) second; copied out parent first, into host 0 then 1
    assert m.take_transfers() == [to_host(1, 0), to_host(2, 1)]
    events = m.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [e.medium for e in removed] == ["GPU"]
    host_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    # one event for the chain, parent first, chained from A's block 0 (still on the device)
    assert [e.token_ids for e in host_stored] == [tuple(toks(4, 8))]
    assert removed[0].block_hashes == tuple(reversed(host_stored[0].block_hashes))
    assert host_stored[0].parent_block_hash not in removed[0].block_hashes
    u = m.usage()
    assert (u.host_cached_blocks, u.transfers_to_host, u.evictions) == (2, 2, 2)
    m.check_invariants()


def test_a_prefix_hit_continues_on_the_host_and_loads_blocks():
    m = make(num_blocks=8)
    a = fill_and_evict(m)
    m.add_sequence("b", toks(100, 24))  # 6 blocks: 5 clean ones (3..7), then evicts 2
    m.free("b")
    m.take_transfers()
    m.take_events()
    # A's block 0 and 1 are still on the device; block 2's content went to the host
    hit = m.lookup(a)
    assert hit == 12 and isinstance(hit, PrefixHit) and (hit.device, hit.host) == (8, 4)
    assert m.take_events() == [] and m.take_transfers() == []  # lookup changes nothing
    assert m.add_sequence("a2", a) == 12
    # No clean block is left: B's blocks (cached, LRU 2, 7, ...) are evicted for the load's
    # destination and the fresh tail, and offloaded themselves, parent (7) before child (2).
    # Device block 2 is read out to the host before A's third block is loaded into it:
    # to_host entries come first.
    assert m.block_table("a2") == [0, 1, 2, 7]
    assert m.take_transfers() == [to_host(7, 1), to_host(2, 2), to_device(0, 2)]
    u = m.usage()
    assert (u.host_hit_tokens, u.prefix_hit_tokens, u.transfers_to_device) == (4, 12, 1)
    m.check_invariants()


def test_write_through_copies_blocks_out_one_drain_after_publishing():
    m = make(host_write_policy="write-through")
    m.add_sequence("a", toks(0, 9))  # blocks 0, 1 full and published now, K/V computed this step
    assert m.take_transfers() == []  # not computed yet at this drain
    assert m.take_transfers() == [to_host(0, 0), to_host(1, 1)]
    m.free("a")
    m.add_sequence("b", toks(100, 24))  # evicts 1 and 0: the host holds them already
    assert m.take_transfers() == []
    assert m.usage().host_cached_blocks == 2
    m.check_invariants()


def test_write_policy_none_keeps_the_host_for_swaps_only():
    m = make(host_write_policy="none")
    fill_and_evict(m)
    m.add_sequence("b", toks(100, 20))  # evicts 2 and 1: forgotten, as without a tier
    assert m.take_transfers() == []
    assert m.usage().host_cached_blocks == 0 and m.lookup(toks(0, 13)).host == 0
    m.swap_out("b")  # the host still takes swapped-out sequences
    assert [t.direction for t in m.take_transfers()] == ["to_host"] * 5
    m.check_invariants()


class Router:
    """A KV-aware router's index, as NVIDIA Dynamo and llm-d keep one: a ``BlockStored`` whose
    parent it knows on neither medium (nor is a prompt's root) is dropped, as theirs are."""

    def __init__(self):
        from pagedkv.hashing import BlockHasher

        self.root = BlockHasher().root(None)
        self.held = {"GPU": set(), "CPU": set()}
        self.dropped = []

    def apply(self, events):
        for e in events:
            if isinstance(e, BlockStored):
                known = self.held["GPU"] | self.held["CPU"] | {self.root}
                if e.parent_block_hash not in known:
                    self.dropped.append(e)
                    continue
                self.held[e.medium].update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self.held[e.medium].difference_update(e.block_hashes)
        return self


def test_host_events_name_parents_first_in_one_eviction_batch():
    """Two prompts sharing a first block, freed, then evicted by one admission: the device's
    LRU lists the tails first, the host publishes each chain parent first (one event per
    chained run, the sibling chained from the shared parent), so a router drops nothing."""
    m = make(num_blocks=7, host_blocks=8)
    r = Router()
    m.add_sequence("p", toks(0, 9))  # blocks 0, 1 full (P, C1), 2 partial
    m.add_sequence("q", toks(0, 4) + toks(50, 5))  # hits P; 3 full (C2), 4 partial
    m.free("p")
    m.free("q")
    r.apply(m.take_events())
    evictions = m.usage().evictions
    m.add_sequence("f", toks(100, 28))  # 7 blocks: 2 clean, then evicts all 5 cached... 3 hashed
    assert m.usage().evictions - evictions == 3
    events = m.take_events()
    (removed,) = [e for e in events if isinstance(e, BlockRemoved)]
    cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    p, c1, c2 = (m.lookup(t) for t in (toks(0, 5), toks(0, 9), toks(0, 4) + toks(50, 5)))
    assert (p.host, c1.host, c2.host) == (4, 8, 8)
    assert [len(e.block_hashes) for e in cpu] in ([2, 1], [1, 2])  # P with one child, the other alone
    assert cpu[0].parent_block_hash == r.root
    assert cpu[1].parent_block_hash == cpu[0].block_hashes[0]  # the sibling names the shared P
    assert set(removed.block_hashes) == {h for e in cpu for h in e.block_hashes}
    assert removed.block_hashes[-1] == cpu[0].block_hashes[0]  # the LRU gave P last
    r.apply(events)
    assert r.dropped == [] and len(r.held["CPU"]) == 3
    m.take_transfers()
    m.check_invariants()


def test_a_short_host_keeps_the_prefix_of_an_evicted_chain():
    """Room for two of three evicted chained blocks: the host keeps blocks 0 and 1 (a prefix,
    findable), not 1 and 2 (unreachable without 0); the drain files the child as the older,
    so the next host eviction takes the tail first and the prefix stays findable."""
    m = make(num_blocks=5, host_blocks=2)
    a = toks(0, 13)  # blocks 0, 1, 2 full, 3 partial
    m.add_sequence("a", a)
    m.free("a")
    m.add_sequence("b", toks(100, 20))  # 5 blocks: 3 and 4, then evicts A's 3 (LRU 2, 1, 0)
    assert m.block_table("b") == [3, 4, 2, 1, 0]
    assert m.take_transfers() == [to_host(0, 0), to_host(1, 1)]
    hit = m.lookup(a)
    assert (hit, hit.device, hit.host) == (8, 0, 8)
    m.free("b")
    m.add_sequence("c", toks(200, 3))  # 1 block: evicts B's tail (0), copied out over a host block...
    assert m.take_transfers() == [to_host(0, 1)]
    hit = m.lookup(a)
    assert (hit.device, hit.host) == (0, 4)  # ...A's tail's (host 1), not its head's
    m.check_invariants()


def test_one_allocation_evicting_blocks_the_host_holds_loses_none_of_them():
    """One device allocation evicts X (whose hash the host already holds, as its oldest block)
    and Y (new to the host) into a host with no free block: copying Y out must evict some host
    block, and it must not be X, or X would be on neither tier. X is held through the host
    allocation; Z (on the host and still on the device) goes instead. Each evicted block is
    then findable on exactly one tier."""
    m = make(num_blocks=4, host_blocks=2)
    x, y, z = toks(0, 4), toks(100, 4), toks(200, 4)
    m.add_sequence("x", x)  # device 0
    m.take_transfers()  # the step ran: the K/V swap_out moves exists
    m.swap_out("x")  # host 0 holds X; device 0 stays cached
    m.take_transfers()
    m.free("x")  # host LRU: [0 (X)]
    m.add_sequence("y", y)  # device 1
    m.free("y")
    m.add_sequence("z", z)  # device 2
    m.take_transfers()  # the step ran: the K/V swap_out moves exists
    m.swap_out("z")  # host 1 holds Z
    m.take_transfers()
    m.free("z")  # host LRU: [0 (X), 1 (Z)]; device LRU: [0 (X), 1 (Y), 2 (Z)]
    evictions = m.usage().evictions
    m.add_sequence("q", toks(300, 12))  # 3 blocks: 3, then evicts 0 (X) and 1 (Y)
    assert m.block_table("q") == [3, 0, 1] and m.usage().evictions - evictions == 2
    assert m.take_transfers() == [to_host(1, 1)]  # Y into host 1: Z's, the host's other block
    for prompt in (x, y):
        hit = m.lookup(prompt + [9])
        assert (hit.device, hit.host) == (0, 4), prompt
    hit = m.lookup(z + [9])
    assert (hit.device, hit.host) == (4, 0)  # Z left the host, not the device
    m.check_invariants()


def test_offload_is_best_effort_when_the_host_is_held():
    """Host blocks pinned by pending transfers are never evicted; with none to spare, an evicted
    device block is simply forgotten, the tail before the prefix."""
    m = make(num_blocks=6, host_blocks=1)
    fill_and_evict(m)
    m.add_sequence("b", toks(100, 20))  # evicts 2 and 1: 1 (the parent) gets host 0, 2 is forgotten
    assert m.take_transfers() == [to_host(1, 0)]
    hit = m.lookup(toks(0, 13))
    assert (hit.device, hit.host) == (4, 4)  # A's block 0 on the device, its block 1 on the host
    m.check_invariants()


# ---------------------------------------------------------------- swapping


def test_swap_out_moves_private_blocks_and_keeps_shared_ones():
    m = make(num_blocks=8, host_blocks=8)
    m.add_sequence("p", toks(0, 6))  # table [0, 1]: block 0 full, block 1 partial
    m.fork("p", "c")
    m.append_token("c", 50)  # copy-on-write of block 1 into 2
    assert m.take_copies() == [(1, 2)]
    m.take_transfers()
    m.swap_out("c")
    assert m.block_table("c") == [0, -1]  # shared block 0 stays, private block 2 goes
    assert m.take_transfers() == [to_host(2, 0)]
    assert m.refcount(0) == 2 and m.refcount(2) == 0
    u = m.usage()
    assert (u.swapped_sequences, u.host_used_blocks) == (1, 1)
    assert (m.num_host_blocks, m.num_swapped_blocks("c"), m.num_swapped_blocks("p")) == (8, 1, 0)
    assert m.num_free_host_blocks == 7
    for call in (lambda: m.append_token("c", 1), lambda: m.fork("c", "d"),
                 lambda: m.block_tables(["c"]), lambda: m.slots("c")):
        with pytest.raises(ValueError, match="swapped out"):
            call()
    with pytest.raises(ValueError, match="already swapped"):
        m.swap_out("c")
    m.check_invariants()
    m.swap_in("c")
    new = m.block_table("c")
    assert new[0] == 0 and new[1] != -1
    assert m.take_transfers() == [to_device(0, new[1])]
    assert m.usage().swapped_sequences == 0
    assert m.append_token("c", 51) == new[1] * BS + 3  # the tail resumes where it was
    m.check_invariants()


def test_swap_in_revives_blocks_still_cached_on_the_device():
    m = make(num_blocks=8, host_blocks=8)
    m.add_sequence("a", toks(0, 9))  # [0, 1, 2]: two full published blocks, one partial
    m.take_transfers()  # the step ran: the K/V swap_out moves exists
    m.swap_out("a")
    assert m.block_table("a") == [-1, -1, -1]
    assert m.take_transfers() == [to_host(0, 0), to_host(1, 1), to_host(2, 2)]
    m.swap_in("a")
    table = m.block_table("a")
    assert table[:2] == [0, 1]  # full blocks revived from the device's cache: no transfer
    assert m.take_transfers() == [to_device(2, table[2])]  # the partial tail comes back
    assert m.usage().host_used_blocks == 0
    m.check_invariants()


def test_swap_is_atomic_when_either_tier_is_full():
    m = make(num_blocks=4, host_blocks=1)
    m.add_sequence("a", toks(0, 10))  # 3 private blocks, host has 1
    m.take_transfers()  # the step ran: the K/V swap_out moves exists
    before = (m.block_table("a"), m.num_free_blocks, m.usage())
    with pytest.raises(OutOfBlocks) as ei:
        m.swap_out("a")
    assert (ei.value.needed, ei.value.available) == (3, 1)
    assert (m.block_table("a"), m.num_free_blocks, m.usage()) == before
    assert m.take_transfers() == [] and m.take_events()  # only the admission's events

    m = make(num_blocks=3, host_blocks=4, enable_prefix_caching=False)
    m.add_sequence("a", toks(0, 10))
    m.take_transfers()  # the step ran: the K/V swap_out moves exists
    m.swap_out("a")
    m.take_transfers()
    m.add_sequence("b", toks(100, 10))  # takes the device back
    before = m.usage()
    with pytest.raises(OutOfBlocks):
        m.swap_in("a")
    assert m.usage() == before and m.block_table("a") == [-1, -1, -1]
    m.free("b")
    m.swap_in("a")
    m.check_invariants()


def test_swapping_out_a_sequence_given_blocks_this_step_is_refused():
    m = make(num_blocks=8, host_blocks=8)
    m.add_sequence("p", toks(0, 6))
    m.fork("p", "c")
    m.append_token("c", 9)  # a copy into c's new block is pending
    with pytest.raises(ValueError, match="pending"):
        m.swap_out("c")
    m.take_copies()
    m.check_invariants()


def test_freeing_a_swapped_sequence_releases_its_host_blocks():
    m = make(num_blocks=8, host_blocks=8, enable_prefix_caching=False)
    m.add_sequence("a", toks(0, 10))
    m.take_transfers()  # the step ran: the K/V swap_out moves exists
    m.swap_out("a")
    m.take_transfers()
    m.free("a")
    u = m.usage()
    assert (u.host_used_blocks, u.swapped_sequences, u.used_blocks) == (0, 0, 0)
    m.check_invariants()


def test_reset_is_refused_while_the_host_holds_a_sequence():
    m = make(num_blocks=8, host_blocks=8)
    m.add_sequence("a", toks(0, 10))
    m.take_transfers()  # the step ran: the K/V swap_out moves exists
    m.swap_out("a")
    m.take_transfers()
    assert m.reset_prefix_cache() is False
    m.free("a")
    assert m.reset_prefix_cache() is True
    assert m.usage().host_cached_blocks == 0
    m.check_invariants()


def test_pickling_keeps_both_tiers():
    m = make(num_blocks=6, host_blocks=4)
    fill_and_evict(m)
    m.add_sequence("b", toks(100, 20))
    m2 = pickle.loads(pickle.dumps(m))
    assert m2.take_transfers() == m.take_transfers()
    assert m2.take_events() == m.take_events()
    assert m2.usage() == m.usage()
    m2.check_invariants()


@pytest.mark.parametrize("how", ["host hit", "swap_in"])
def test_freeing_a_sequence_whose_loads_are_pending_unpublishes_those_blocks(how):
    """A sequence whose blocks are being loaded from the host (a host hit, or ``swap_in``) is
    freed before the step runs: its loads are dropped, so those device blocks never receive
    their K/V and must not serve a later hit. The next prompt hits the host again and loads.
    (Found by the state machine: the blocks stayed published on the device.)"""
    m = KVCacheManager(num_blocks=4, block_size=4, host_blocks=8)
    a = list(range(9))  # two full blocks and one token
    if how == "host hit":
        m.add_sequence("a", a)
        m.free("a")
        m.add_sequence("b", list(range(100, 116)))  # evicts a's blocks: offloaded to the host
        m.free("b")
        m.take_transfers()
        assert m.lookup(a).host == 8
        m.add_sequence("c", a, prefill=0)  # loads both blocks, published on the device at once
    else:
        m.add_sequence("c", a)
        m.take_transfers()  # the step ran: the K/V swap_out moves exists
        m.swap_out("c")
        m.add_sequence("b", list(range(100, 116)))  # takes the device: c's cached blocks go
        m.free("b", cache=False)
        m.take_transfers()
        m.swap_in("c")  # loads c's three blocks; the two full ones are published again
    m.take_events()
    m.free("c")  # before the step ran
    removed = [e for e in m.take_events() if isinstance(e, BlockRemoved) and e.medium == "GPU"]
    assert len(removed) == 1 and len(removed[0].block_hashes) == 2
    assert [t for t in m.take_transfers() if t.direction == "to_device"] == []
    m.check_invariants()
    hit = m.lookup(a)
    assert (hit.device, hit.host) == (0, 8)
    assert m.add_sequence("d", a) == 8
    loads = [t for t in m.take_transfers() if t.direction == "to_device"]
    assert [t.dst for t in loads] == m.block_table("d")[:2]
    m.check_invariants()


# ---------------------------------------------------------------- content checks


def _device_chain(m, prompt):
    """Admit, free and read back the device's BlockStored: (block hashes, root parent, tokens)."""
    m.add_sequence("a", prompt)
    m.free("a")
    (ev,) = [e for e in m.take_events() if isinstance(e, BlockStored)]
    return ev.block_hashes, ev.parent_block_hash, ev.token_ids


@pytest.mark.parametrize("corrupt", [False, True])
def test_check_invariants_rehashes_the_host_blocks_content(corrupt):
    """A host block's kept (parent, tokens) must hash to the hash it is mapped under: that is
    what the host republishes and loads. A manager cannot be led there through its public API,
    so a tier is handed an offload of the hash a manager published for tokens 0..3 (read from
    its BlockStored), with those tokens or with one token off, and checked with the manager's
    hash function (sha256 over little-endian uint32 tokens, chained): one token off is caught."""
    from pagedkv.hashing import BlockHasher, token_bytes
    from pagedkv.host_tier import HostTier

    m = make(num_blocks=6, host_blocks=4)
    hashes, root, tokens = _device_chain(m, toks(0, 9))
    assert tokens == tuple(toks(0, 8))
    hasher = BlockHasher(m.hash_algo)
    assert root == hasher.root()
    content = tuple(toks(0, 4)) if not corrupt else (0, 1, 2, 99)
    tier = HostTier(4, BS, None)
    tier.offload([0], [hashes[0]], [(root, content)])
    tier.take_transfers(None)
    rehash = lambda parent, t: hasher.block(parent, token_bytes(t))  # noqa: E731
    if corrupt:
        with pytest.raises(AssertionError, match="CPU block 0: its kept tokens"):
            tier.check_invariants({}, rehash)
    else:
        tier.check_invariants({}, rehash)
    assert tier.longest_prefix(hashes, 2) == [0]  # the offloaded block serves its hash


def test_host_tier_check_invariants_needs_the_hash_function_to_see_content():
    """The tier does not hash: without ``block_hash`` it checks structure only, with it the
    content; a bad argument is a ValueError, not a silent skip."""
    from pagedkv.hashing import BlockHasher, token_bytes
    from pagedkv.host_tier import HostTier

    hasher = BlockHasher()
    root = hasher.root(None)
    good = hasher.block(root, token_bytes(toks(0, 4)))
    tier = HostTier(4, BS, None)
    tier.offload([0, 1], [good, b"not the hash of these tokens"], [(root, tuple(toks(0, 4))), (good, (4, 5, 6, 7))])
    tier.take_transfers(None)
    tier.check_invariants({})  # structure alone holds
    rehash = lambda parent, t: hasher.block(parent, token_bytes(t))  # noqa: E731
    with pytest.raises(AssertionError, match="CPU block 1"):
        tier.check_invariants({}, rehash)
    for bad in ("sha256", 3):
        with pytest.raises(ValueError, match="block_hash"):
            tier.check_invariants({}, bad)
    with pytest.raises(ValueError, match="swapped_refs"):
        tier.check_invariants([], rehash)


def test_a_healthy_tiered_manager_passes_the_content_check():
    """Offloads, host hits, swaps and write-through, each step checked: every kept content on
    both tiers rehashes to its hash."""
    for policy in ("write-back", "write-through"):
        m = make(num_blocks=6, host_blocks=6, host_write_policy=policy)
        a = fill_and_evict(m)
        m.take_transfers()
        m.add_sequence("b", toks(100, 20))
        m.take_transfers()
        m.check_invariants()
        m.free("b")
        assert m.add_sequence("a2", a) == 12
        m.take_transfers()
        m.check_invariants()
        m.swap_out("a2")
        m.take_transfers()
        m.check_invariants()
        m.swap_in("a2")
        m.take_transfers()
        m.check_invariants()
        assert m.usage().host_cached_blocks > 0
