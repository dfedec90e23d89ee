"""Reserve now, publish as computed: ``add_sequence(..., prefill=k, reserve=True)``.

An engine that holds a whole prompt's memory from admission (nano-vllm: ``allocate`` fills the
block table for every prompt position, and its later chunks make no block-manager call) needs
blocks for positions it has not scheduled, without those blocks becoming findable. Exact
expectations, block size 4: a fresh manager hands out blocks 0, 1, 2, ... in order. Expected
hashes come from a manager that admits the same tokens whole, never typed in.
"""
from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import KVCacheManager, OutOfBlocks
from conftest import SlotStore, removed_hashes, snapshot_v2, stored_blocks, toks

BS = 4


def mk(num_blocks=16, **kw):
    return KVCacheManager(num_blocks=num_blocks, block_size=BS, **kw)


def published(make_events):
    return [h for h, _, _ in stored_blocks(make_events)]


def whole_hashes(tokens):
    ref = mk(64)
    ref.add_sequence("ref", tokens)
    return published(ref.take_events())


def test_reserve_takes_every_block_and_publishes_nothing_unscheduled():
    """A 10-token prompt admitted with prefill=0, reserve=True: three blocks taken, none
    scheduled, none findable; the kernel exports describe no position yet."""
    m = mk()
    prompt = toks(100, 10)
    assert m.add_sequence("r", prompt, prefill=0, reserve=True) == 0
    assert m.reserved_table("r") == [0, 1, 2]
    assert m.block_table("r") == []
    assert (m.num_tokens("r"), m.num_computed("r")) == (10, 0)
    assert m.num_free_blocks == 13
    assert m.lookup(prompt) == 0
    assert m.take_events() == []
    indptr, indices, last = m.flashinfer_layout(["r"])
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 0], [], [0])
    assert m.block_tables(["r"]).shape == (1, 0)
    assert m.slots("r").tolist() == []
    u = m.usage()
    assert (u.used_blocks, u.logical_tokens, u.stored_tokens, u.allocated_slots) == (3, 0, 0, 12)
    assert u.internal_fragmentation == 1.0
    assert u.blocks_saved_by_sharing == 0
    m.check_invariants()


def test_prefill_after_reserve_allocates_nothing_and_publishes_as_it_schedules():
    """Chunks of 5 then 5: the same slots and the same hashes, in the same order, as a whole
    admission; the free count never moves after admission."""
    m = mk()
    prompt = toks(100, 10)
    m.add_sequence("r", prompt, prefill=0, reserve=True)
    assert m.prefill("r", 5).tolist() == [0, 1, 2, 3, 4]
    assert m.num_free_blocks == 13
    assert m.block_table("r") == [0, 1]
    assert m.reserved_table("r") == [0, 1, 2]
    assert m.lookup(prompt) == 4  # block 0 is full and scheduled; block 1 holds one position
    indptr, indices, last = m.flashinfer_layout(["r"])
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 2], [0, 1], [1])
    assert m.block_tables(["r"]).tolist() == [[0, 1]]
    u = m.usage()
    assert (u.used_blocks, u.logical_tokens, u.stored_tokens) == (3, 5, 5)
    m.check_invariants()
    assert m.prefill("r", 5).tolist() == [5, 6, 7, 8, 9]
    assert m.num_free_blocks == 13
    assert m.block_table("r") == m.reserved_table("r") == [0, 1, 2]
    assert published(m.take_events()) == whole_hashes(prompt)
    assert m.lookup(prompt) == 8
    assert m.append_token("r", 7) == 2 * BS + 2  # the decode fast path, as after any prefill
    m.check_invariants()


def test_prefill_slots_after_reserve():
    m = mk()
    m.add_sequence("r", toks(0, 10), prefill=3, reserve=True)
    assert m.slots("r").tolist() == [0, 1, 2]
    assert m.prefill("r", 7).tolist() == [3, 4, 5, 6, 7, 8, 9]
    assert m.slots("r").tolist() == list(range(10))


def test_reserve_with_hits_shares_the_hits_and_reserves_the_rest():
    m = mk()
    a = toks(100, 10)
    m.add_sequence("a", a)  # [0, 1, 2]; blocks 0, 1 published
    m.take_events()
    assert m.add_sequence("b", a + [5, 6], prefill=0, reserve=True) == 8
    assert m.reserved_table("b") == [0, 1, 3]
    assert m.block_table("b") == [0, 1]
    assert (m.refcount(0), m.refcount(1), m.refcount(3)) == (2, 2, 1)
    assert m.num_computed("b") == 8
    assert m.take_events() == []
    m.prefill("b", 4)  # completes block 3 (positions 8..11)
    assert published(m.take_events()) == whole_hashes(a + [5, 6])[2:]
    m.check_invariants()


def test_reserve_needs_the_whole_prompt_to_fit_and_failure_changes_nothing():
    """prefill=0 alone would fit (no blocks); reserving the prompt's 3 blocks does not."""
    m = mk(num_blocks=4)
    m.add_sequence("x", toks(0, 6))  # blocks 0, 1
    before = snapshot_v2(m, ["x"])
    with pytest.raises(OutOfBlocks) as e:
        m.add_sequence("r", toks(100, 10), prefill=0, reserve=True)
    assert (e.value.needed, e.value.available) == (3, 2)
    assert snapshot_v2(m, ["x"]) == before
    assert "r" not in m
    m.check_invariants()
    m.add_sequence("r", toks(100, 10), prefill=0)  # unreserved: takes nothing yet
    assert m.block_table("r") == []


def test_reserved_sequence_is_unready():
    """Appends, forks and swaps refuse a sequence whose reserved prompt is not all scheduled,
    exactly as for a chunked one; nothing changes."""
    m = mk(host_blocks=8)
    m.add_sequence("a", toks(0, 5))
    m.add_sequence("r", toks(100, 10), prefill=2, reserve=True)
    before = snapshot_v2(m, ["a", "r"])
    for call in (lambda: m.append_token("r", 1), lambda: m.append_tokens("r", [1, 2]),
                 lambda: m.append_batch(["a", "r"], [1, 2]), lambda: m.fork("r", "c"),
                 lambda: m.swap_out("r"), lambda: m.append_tokens("r", [1], speculative=True)):
        with pytest.raises(ValueError, match="not scheduled yet"):
            call()
        assert snapshot_v2(m, ["a", "r"]) == before
    with pytest.raises(ValueError, match="8 of the prompt are unscheduled"):
        m.prefill("r", 9)
    m.check_invariants()


@pytest.mark.parametrize("bad", [1, 0, None, "yes", np.int64(1)])
def test_reserve_must_be_a_bool(bad):
    m = mk()
    with pytest.raises(ValueError, match="reserve must be True or False"):
        m.add_sequence("r", toks(0, 10), prefill=0, reserve=bad)
    assert m.num_sequences == 0 and m.num_free_blocks == 16


def test_reserve_with_whole_prefill_changes_nothing():
    m, ref = mk(), mk()
    assert m.add_sequence("r", toks(0, 10), reserve=True) == ref.add_sequence("r", toks(0, 10))
    assert m.block_table("r") == m.reserved_table("r") == ref.block_table("r")
    assert m.num_computed("r") == 10


def test_free_returns_reserved_blocks_clean_and_keeps_scheduled_ones_cached():
    m = mk()
    prompt = toks(100, 12)
    m.add_sequence("r", prompt, prefill=5, reserve=True)  # [0, 1, 2]; block 0 published
    m.take_events()
    m.free("r")
    assert m.take_events() == []
    u = m.usage()
    assert (u.used_blocks, u.cached_blocks, u.free_blocks) == (0, 1, 15)
    assert m.lookup(prompt) == 4
    m.check_invariants()
    # the reserved blocks went back clean, tail first: the next allocation takes them
    m.add_sequence("n", toks(500, 8))
    assert m.block_table("n") == [1, 2]


def test_free_without_cache_unpublishes_only_what_it_scheduled_alone():
    m = mk()
    a = toks(100, 10)
    m.add_sequence("a", a)  # blocks 0, 1 published
    m.add_sequence("r", a[:8] + toks(900, 9), prefill=4, reserve=True)  # hits 0, 1; 3 reserved
    m.take_events()
    assert m.reserved_table("r") == [0, 1, 3, 4, 5]
    m.free("r", cache=False)  # block 3 (published by the chunk) goes; 0 and 1 stay with "a"
    assert len(removed_hashes(m.take_events())) == 1
    assert m.lookup(a) == 8
    assert m.num_free_blocks == 16 - 3
    m.check_invariants()


def test_pickled_reserved_manager_continues_identically():
    m = mk()
    prompt = toks(100, 10)
    m.add_sequence("r", prompt, prefill=3, reserve=True)
    m2 = pickle.loads(pickle.dumps(m))
    assert m2.reserved_table("r") == m.reserved_table("r")
    assert m2.prefill("r", 7).tolist() == m.prefill("r", 7).tolist()
    assert m2.take_events() == m.take_events()
    m2.check_invariants()


def test_reserve_with_host_hits_reserves_behind_the_loads():
    """A host hit is loaded into the first new block; the rest of the prompt is reserved."""
    m = mk(num_blocks=4, host_blocks=8)
    a = toks(100, 9)
    m.add_sequence("a", a)  # [0, 1, 2]
    m.free("a")
    m.add_sequence("x", toks(500, 16))  # evicts a's cached blocks to the host
    m.free("x")
    m.add_sequence("y", toks(700, 16))
    m.free("y")
    m.take_transfers()
    hit = m.lookup(a + [1, 2, 3])
    assert (hit.device, hit.host) == (0, 8)
    assert m.add_sequence("r", a + [1, 2, 3], prefill=0, reserve=True) == 8
    assert len(m.reserved_table("r")) == 3 and len(m.block_table("r")) == 2
    loads = [t for t in m.take_transfers() if t.direction == "to_device"]
    assert [t.dst for t in loads] == m.block_table("r")
    m.prefill("r", 4)
    assert m.num_computed("r") == 12
    m.check_invariants()


# ---------------------------------------------------------------- random schedules

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 5), st.integers(1, 23), st.integers(0, 12), st.booleans()),
        st.tuples(st.just("prefill"), st.integers(0, 12)),
        st.tuples(st.just("append"), st.integers(0, 99)),
        st.tuples(st.just("free"), st.booleans()),
    ),
    max_size=40,
)
PREFIXES = [toks(1000 * i, 24) for i in range(3)]


def _prompt(kind: int, length: int) -> list[int]:
    """Prompts that share prefixes (kinds 0-2 reuse three stems) or share nothing (3-5)."""
    if kind < 3:
        return PREFIXES[kind][:length]
    return toks(50_000 + 100 * kind + 7 * length, length)


class _Engine:
    """An engine of nano-vllm's shape over one manager: every sequence's computed positions are
    written to a slot store, so a hit that reads a slot not holding its token is caught."""

    def __init__(self, m: KVCacheManager, reserve: bool | None):
        self.m, self.reserve = m, reserve
        self.store = SlotStore(m.num_blocks, m.block_size)
        self.n = 0

    def admit(self, kind, length, k, reserve):
        m = self.m
        prompt = _prompt(kind, length)
        sid = self.n
        if self.reserve is not None:
            reserve = self.reserve
        before = snapshot_v2(m, m.seq_ids())
        try:
            hit = m.add_sequence(sid, prompt, prefill=k, reserve=reserve)
        except OutOfBlocks:
            assert snapshot_v2(m, m.seq_ids()) == before
            return None
        self.n += 1
        # a hit reads K/V a computed sequence wrote
        assert self.store.read(m.block_table(sid), hit) == prompt[:hit]
        self.store.write(m.slots(sid, hit), prompt[hit : m.num_computed(sid)])
        if reserve:
            assert len(m.reserved_table(sid)) == -(-len(prompt) // m.block_size)
        return sid

    def prefill(self, sid, n):
        m = self.m
        rest = m.num_tokens(sid) - m.num_computed(sid)
        n = min(n, rest)
        start = m.num_computed(sid)
        free_before = m.num_free_blocks
        # a reserved prompt holds a block for every position: its chunks take nothing
        reserved = len(m.reserved_table(sid)) == -(-m.num_tokens(sid) // m.block_size)
        before = snapshot_v2(m, m.seq_ids())
        try:
            slots = m.prefill(sid, n)
        except OutOfBlocks:
            assert not reserved, "a reserved prompt's prefill allocates nothing"
            assert snapshot_v2(m, m.seq_ids()) == before
            return
        if reserved:
            assert m.num_free_blocks == free_before
        self.store.write(slots, m.tokens(sid)[start : start + n])

    def append(self, sid, t):
        m = self.m
        if m.num_computed(sid) < m.num_tokens(sid):
            return
        try:
            slot = m.append_token(sid, t)
        except OutOfBlocks:
            return
        self.store.copy(m.take_copies())
        self.store.write([slot], [t])

    def check(self):
        m = self.m
        m.check_invariants()
        ids = m.seq_ids()
        indptr, indices, last = m.flashinfer_layout(ids)
        for i, sid in enumerate(ids):
            table, full = m.block_table(sid), m.reserved_table(sid)
            done = m.num_computed(sid)
            assert full[: len(table)] == table
            assert len(table) == -(-done // m.block_size)
            assert indices[indptr[i] : indptr[i + 1]].tolist() == table
            # every scheduled position holds its token
            assert self.store.read(table, done) == m.tokens(sid)[:done]


def _drive(engines, ops):
    live: list = []
    for op in ops:
        if op[0] == "admit":
            sids = [e.admit(*op[1:]) for e in engines]
            assert len(set(s is None for s in sids)) == 1
            if sids[0] is not None:
                live.append(sids[0])
        elif not live:
            continue
        elif op[0] == "prefill":
            for e in engines:
                e.prefill(live[0], op[1])
            live.append(live.pop(0))
        elif op[0] == "append":
            for e in engines:
                e.append(live[-1], op[1])
        else:
            sid = live.pop(0)
            for e in engines:
                e.m.free(sid, cache=op[1])
        for e in engines:
            e.check()


@settings(max_examples=150)
@given(OPS)
def test_reserved_and_unreserved_publish_the_same(ops):
    """With room for everything, a manager that reserves every prompt and one that allocates per
    chunk see the same hits, publish the same hashes in the same order, and schedule the same
    positions; every hit reads K/V that a computed position wrote."""
    a, b = _Engine(mk(num_blocks=512), reserve=True), _Engine(mk(num_blocks=512), reserve=False)
    _drive([a, b], ops)
    ea, eb = a.m.take_events(), b.m.take_events()
    assert published(ea) == published(eb)
    assert removed_hashes(ea) == removed_hashes(eb)
    for sid in a.m.seq_ids():
        assert a.m.num_computed(sid) == b.m.num_computed(sid)
    ua, ub = a.m.usage(), b.m.usage()
    assert (ua.logical_tokens, ua.prefix_hit_tokens) == (ub.logical_tokens, ub.prefix_hit_tokens)


@settings(max_examples=150)
@given(OPS, st.integers(3, 12))
def test_reserve_under_pressure(ops, num_blocks):
    """A small pool, reserve chosen per admission: failures change nothing, a reserved prompt's
    chunks never fail, invariants hold after every call, and no hit reads an unwritten slot."""
    _drive([_Engine(mk(num_blocks=num_blocks), reserve=None)], ops)
