"""Issue 17, sections 2 and 3: aborts keep what was computed, every live full block stays
findable, and a call that copies fails only when no assignment of blocks exists.

Block size 4 throughout. The focused tests are the issue's repros and one per call that can
leave a full block unpublished (its twin, a block with the same hash, was mapped when it filled).
The hypothesis test at the end drives random calls and checks, after each one, the three rules
against models of its own (a store of which token every slot holds, a brute-force capacity
model), never against the manager's internals.
"""
from __future__ import annotations

import itertools
import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv import KVCacheManager, OutOfBlocks

BS = 4


def filler(m: KVCacheManager, sid: str = "fill", base: int = 7000) -> None:
    """Admit a prompt of distinct tokens that takes every free block (evicting every cached one)."""
    n = m.num_free_blocks
    m.add_sequence(sid, list(range(base, base + n * BS)))
    assert m.num_free_blocks == 0


def findable(m: KVCacheManager, tokens: list[int]) -> int:
    """How many leading full blocks of ``tokens`` a later prompt would hit."""
    return m.lookup(list(tokens) + [999_999]) // BS


# ---------------------------------------------------------------- 2: aborts keep what was computed


def test_abort_keeps_revived_hits_and_drops_its_own_blocks():
    """b hits a's two freed blocks (revived: an earlier request computed them), schedules two
    more blocks and is dropped before its step: only its own blocks lose their hashes."""
    m = KVCacheManager(16, block_size=BS)
    p = list(range(100, 108))
    m.add_sequence("a", p + [1])
    m.free("a")
    assert m.add_sequence("b", p + list(range(200, 209))) == 8
    m.take_events()
    m.free("b", cache=False)
    assert findable(m, p) == 2
    assert findable(m, p + list(range(200, 208))) == 2
    [removed] = m.take_events()
    assert len(removed.block_hashes) == 2  # b's own two full blocks, nothing else
    m.check_invariants()


def test_abort_of_a_fork_keeps_what_it_inherited():
    """A fork shares its parent's blocks after the parent's step wrote them: written K/V. The
    child's own blocks (the shared partial block it completes, the ones after) are dropped."""
    m = KVCacheManager(16, block_size=BS)
    p = list(range(100, 110))            # blocks: full, full, partial (2 tokens)
    m.add_sequence("a", p)
    m.fork("a", "b")
    m.free("a")
    m.append_tokens("b", [1, 2, 3, 4, 5])  # completes block 2 in place, then opens block 3
    m.free("b", cache=False)
    assert findable(m, p[:8]) == 2
    assert findable(m, p + [1, 2]) == 2
    m.check_invariants()


# ---------------------------------------------------------------- 3a: every full block findable


def test_issue_repro_append_tokens_evicts_the_twin_in_the_same_call():
    """The issue's repro: b fills [0, 0, 1, 1] while c's freed block of that content is mapped
    (so b's is not published), then the same call evicts c's block for its next block."""
    m = KVCacheManager(3, block_size=4)
    m.add_sequence("a", [0, 0, 1]); m.fork("a", "b")
    m.add_sequence("c", [0, 0, 1, 1, 0, 0, 1, 1]); m.free("c")
    m.append_tokens("b", [1, 0])
    assert m.tokens("b")[:4] == [0, 0, 1, 1]
    assert m.lookup([0, 0, 1, 1, 9]) == 4  # b's block holds it: findable
    m.check_invariants()


def _twin_holder(m: KVCacheManager) -> None:
    """Sequence "c" holds and publishes [0, 0, 1, 1] (a 5-token prompt: block 0 full)."""
    m.add_sequence("c", [0, 0, 1, 1, 7])


def _evict_twin(m: KVCacheManager) -> None:
    """c goes; a filler takes every free block, evicting c's cached block."""
    m.free("c")
    filler(m)


@pytest.mark.parametrize("how", ["append_token", "append_tokens", "append_batch", "accept", "prefill",
                                 "add_sequence"])
def test_a_block_filled_while_its_twin_is_mapped_stays_findable_when_the_twin_goes(how):
    """Each call that publishes can meet a mapped twin and skip the publish; when the twin is
    evicted later (another call), the live block must become the one its hash finds."""
    m = KVCacheManager(8, block_size=BS)
    if how == "prefill":
        m.add_sequence("a", [0, 0, 1, 1, 5], prefill=0)
        _twin_holder(m)
        m.prefill("a", 5)
    elif how == "add_sequence":
        _twin_holder(m)
        m.add_sequence("a", [0, 0, 1, 1])  # the whole prompt is one block: never a hit (the last
        # token is always computed), so it is filled afresh while c's block is mapped
    else:
        m.add_sequence("a", [0, 0, 1])
        m.add_sequence("z", [50, 51, 52])
        _twin_holder(m)
        if how == "append_token":
            m.append_token("a", 1)
        elif how == "append_tokens":
            m.append_tokens("a", [1])
        elif how == "append_batch":
            m.append_batch(["a", "z"], [1, 53])
        else:
            m.append_tokens("a", [1, 6], speculative=True)
            m.accept("a", 1)
    a_block = m.block_table("a")[0]
    assert m.tokens("a")[:4] == [0, 0, 1, 1]
    m.check_invariants()
    _evict_twin(m)
    assert findable(m, [0, 0, 1, 1]) == 1
    probe = pickle.loads(pickle.dumps(m))  # a clone: which block does the hit serve?
    probe.free("fill")
    probe.add_sequence("p", [0, 0, 1, 1, 9], prefill=0)
    assert probe.block_table("p") == [a_block]
    m.check_invariants()


def test_an_unpublished_twin_hands_its_hash_to_the_live_block():
    """free(c, cache=False) unpublishes c's block (its K/V may never have been written); a's live
    block of the same content, computed by a, takes over the hash. No event reaches a router:
    the hash never stopped being held."""
    m = KVCacheManager(8, block_size=BS)
    m.add_sequence("a", [0, 0, 1])
    _twin_holder(m)
    m.append_token("a", 1)
    m.take_events()
    m.free("c", cache=False)
    assert findable(m, [0, 0, 1, 1]) == 1
    assert m.take_events() == []
    m.check_invariants()


def test_twin_released_first_is_forgotten():
    """A twin whose only holder goes is clean again and never handed the hash later."""
    m = KVCacheManager(8, block_size=BS)
    m.add_sequence("a", [0, 0, 1])
    _twin_holder(m)
    m.append_token("a", 1)
    a_block = m.block_table("a")[0]
    m.free("a")
    assert m.refcount(a_block) == 0
    m.add_sequence("x", list(range(100, 106)))  # clean blocks first: a's block is reused
    assert a_block in m.block_table("x")
    _evict_twin(m)
    assert findable(m, [0, 0, 1, 1]) == 0
    m.check_invariants()


# ---------------------------------------------------------------- 3b: copies and capacity


def _freed_copy_source(m: KVCacheManager, *then: tuple) -> None:
    """p holds [1, 2]; its fork c writes (a copy of p's block into a new one); ``then`` admits
    ``(id, prompt[, fork id])`` sequences; p goes last: its block is free and the pending copy's
    source."""
    m.add_sequence("p", [1, 2]); m.fork("p", "c")
    m.append_token("c", 3)
    for sid, prompt, *fork in then:
        m.add_sequence(sid, prompt)
        if fork:
            m.fork(sid, fork[0])
    m.free("p")


def test_issue_repro_append_tokens_copies_and_takes_the_freed_source_as_fresh():
    m = KVCacheManager(4, block_size=4, enable_prefix_caching=False)
    m.add_sequence("p", [1, 2]); m.fork("p", "c"); m.add_sequence("e", [5, 6]); m.fork("e", "f")
    m.append_token("c", 3)           # CopyOp(0 -> 2) pending
    m.free("p")                      # block 0: free, and the pending copy's source
    slots = m.append_tokens("e", [7, 8, 9])
    assert m.block_table("e") == [3, 0]  # the copy lands in 3; the freed source serves as fresh
    assert slots == [14, 15, 0]
    assert [(c.src, c.dst) for c in m.take_copies()] == [(0, 2), (1, 3)]
    m.check_invariants()


@pytest.mark.parametrize("order", [("e", "g"), ("g", "e")])
def test_append_batch_copies_and_takes_the_freed_source_as_fresh(order):
    """One step: e copies its shared partial block, g needs a fresh block. Free: block 0 (a
    pending copy reads it) and block 4. Whatever the batch order, the copy takes 4 and g takes 0."""
    m = KVCacheManager(5, block_size=4, enable_prefix_caching=False)
    _freed_copy_source(m, ("e", [5, 6], "f"), ("g", [1, 2, 3, 4]))  # c: copy 0 -> 1; e: 2; g: 3
    assert m.num_free_blocks == 2
    m.append_batch(list(order), [7, 8])
    assert m.block_table("e") == [4]
    assert m.block_table("g") == [3, 0]
    assert sorted((c.src, c.dst) for c in m.take_copies()) == [(0, 1), (2, 4)]
    m.check_invariants()


def test_append_batch_still_fails_when_no_assignment_exists():
    """Two copies, one non-source free block: impossible; nothing changes."""
    m = KVCacheManager(5, block_size=4, enable_prefix_caching=False)
    _freed_copy_source(m, ("e", [5, 6], "f"), ("g", [5, 6], "h"))
    before = pickle.dumps(m)
    with pytest.raises(OutOfBlocks) as exc:
        m.append_batch(["e", "g"], [7, 8])
    assert (exc.value.needed, exc.value.available) == (2, 1)
    assert pickle.dumps(m) == before


def test_host_load_admission_takes_the_freed_source_as_fresh():
    """An admission with a host hit needs a load destination (written by its transfer before the
    copies run: never a block a pending copy reads) and a fresh block (written after them). Free:
    the freed copy source and one cached block. The load takes the cached block, the fresh
    position the source."""
    m = KVCacheManager(6, block_size=4, host_blocks=8)
    q = [10, 11, 12, 13]
    m.add_sequence("q", q + [14]); m.free("q")
    filler(m)                                   # evicts q's block: offloaded to the host
    m.take_transfers()
    m.free("fill")
    m.add_sequence("w", list(range(300, 312)))  # 3 blocks: 3 left
    _freed_copy_source(m)                       # p's block (free now, a copy source), c's copy
    assert m.num_free_blocks == 2
    assert m.lookup(q + [99]).host == 4
    m.add_sequence("r", q + [99])
    assert m.num_free_blocks == 0
    m.check_invariants()
    (copy,) = m.take_copies()
    loads = [t for t in m.take_transfers() if t.direction == "to_device"]
    assert len(loads) == 1 and loads[0].dst != copy.src
    assert m.block_table("r") == [loads[0].dst, copy.src]
