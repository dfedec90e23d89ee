"""Swaps on the grouped manager (issue 19 section 1, contract v3: "swaps and host loads work per
group; Transfer carries group").

Exact block ids and transfers for small cases; the plain manager's refusal rules; atomicity on
OutOfBlocks (a failing call leaves a byte-identical pickle); and the physical check: a store of
written ``(group, block, offset)`` slots on each tier, driven in the engine's order (transfers,
then copies, then the step's writes, then its reads), where no transfer may move a block with
nothing written in it and no query may read a slot that does not hold exactly that position's
K/V. A hypothesis state machine adds swap_out / swap_in rules to the grouped state machine.

The host prefix cache (write-back): exact ids, transfers and events for an evict -> offload ->
host hit -> load cycle on ``[FullAttention(), SlidingWindow(8)]``, the hit rule across tiers,
the per-group reachability rule, and the same physical check over the cycle (with a negative
control); the state machine draws write-back, write-through or none and adds eviction pressure and
re-admissions that hit the host.
"""
from __future__ import annotations

import pickle

import pytest
from hypothesis import Phase, settings
from hypothesis import event as _event
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from pagedkv import (BlockRemoved, BlockStored, ChunkedLocalAttention, FullAttention, KVCacheManager, OutOfBlocks,
                     SlidingWindow,
                     Transfer)

import test_groups_stateful as base

BS = 4


def event(what: str) -> None:
    """hypothesis' ``event``, a no-op outside a hypothesis run (the scripted physical test)."""
    if currently_in_test_context():
        _event(what)
HYBRID = [FullAttention(), SlidingWindow(4)]


def make(num_blocks=16, host_blocks=8, groups=HYBRID, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=BS, groups=groups, host_blocks=host_blocks, **kw)


def tables(m, sid):
    return [m.block_table(sid, group=g) for g in range(m.num_groups)]


def unchanged(m, call, exc, match):
    """``call`` raises ``exc`` and changes nothing (pending transfers, copies, events included)."""
    before = pickle.dumps(m)
    with pytest.raises(exc, match=match):
        call()
    assert pickle.dumps(m) == before


# ---- exact ids ---------------------------------------------------------------------------------


def test_swap_out_moves_every_live_private_entry_of_every_group():
    m = make()
    m.add_sequence("a", list(range(9)))
    assert tables(m, "a") == [[0, 2, 4], [1, 3, 5]]
    m.take_transfers()
    m.append_token("a", 9)  # position 9: the window (4) reads 6..9, block 0 of group 1 goes
    assert tables(m, "a") == [[0, 2, 4], [-1, 3, 5]]
    m.take_transfers()
    m.swap_out("a")
    assert tables(m, "a") == [[-1, -1, -1], [-1, -1, -1]]
    assert m.num_swapped_blocks("a") == 5 and m.num_free_host_blocks == 3
    assert m.take_transfers() == [Transfer("to_host", 0, 0), Transfer("to_host", 2, 1), Transfer("to_host", 4, 2),
                                  Transfer("to_host", 3, 3, group=1), Transfer("to_host", 5, 4, group=1)]
    u = m.usage()
    assert (u.used_blocks, u.host_used_blocks, u.swapped_sequences, u.transfers_to_host) == (0, 5, 1, 5)
    m.check_invariants()


def test_swap_in_revives_cached_full_blocks_and_loads_the_rest():
    m = make()
    m.add_sequence("a", list(range(9)))
    m.take_transfers()
    m.append_token("a", 9)
    m.take_transfers()
    m.swap_out("a")
    m.take_transfers()
    m.swap_in("a")
    # full blocks 0, 2 (group 0) and 3 (group 1) are still cached on the device: revived
    assert tables(m, "a") == [[0, 2, 5], [-1, 3, 4]]
    got = m.take_transfers()
    assert got == [Transfer("to_device", 2, 5), Transfer("to_device", 4, 4, group=1)]
    assert [t.group for t in got] == [0, 1]
    assert m.num_swapped_blocks("a") == 0 and m.num_free_host_blocks == 8
    m.check_invariants()
    m.append_token("a", 3)  # decodes again
    m.check_invariants()


def test_swap_in_without_prefix_caching_loads_every_entry():
    m = make(enable_prefix_caching=False)
    m.add_sequence("a", list(range(9)))
    m.take_transfers()
    m.swap_out("a")
    assert [t.group for t in m.take_transfers()] == [0, 0, 0, 1, 1]  # the window's block 0 released, not moved
    m.add_sequence("b", [7] * 5)  # takes device blocks the swap released
    m.swap_in("a")
    assert tables(m, "b") == [[0, 2], [3, 5]]
    assert tables(m, "a") == [[4, 1, 6], [-1, 7, 8]]
    assert m.take_transfers() == [Transfer("to_device", 0, 4), Transfer("to_device", 1, 1), Transfer("to_device", 2, 6),
                                  Transfer("to_device", 3, 7, group=1), Transfer("to_device", 4, 8, group=1)]
    m.check_invariants()


def test_shared_entries_stay_on_the_device():
    """A fork's shared blocks are not moved: the swapped parent keeps its reference."""
    m = make()
    m.add_sequence("p", list(range(6)))
    m.take_transfers()
    m.fork("p", "c")
    m.swap_out("p")  # every entry is shared with c: nothing moves
    assert m.num_swapped_blocks("p") == 0 and m.take_transfers() == []
    assert tables(m, "p") == tables(m, "c") == [[0, 2], [1, 3]]
    m.check_invariants()
    m.swap_in("p")
    assert m.take_transfers() == []
    m.append_token("p", 1)  # a shared partial block: copy-on-write per group, as before
    assert [(c.group) for c in m.take_copies()] == [0, 1]
    m.check_invariants()


def test_swap_out_makes_the_releases_due_first():
    """Released window blocks never go to the host: 12 tokens under a window of 4 after one
    decode token hold 2 live blocks in the sliding group, not 4."""
    m = make(num_blocks=32, host_blocks=16, groups=[SlidingWindow(4), FullAttention()])
    m.add_sequence("a", list(range(12)))
    m.take_transfers()
    m.append_token("a", 0)
    m.take_transfers()
    m.swap_out("a")
    moved = m.take_transfers()
    assert [t.group for t in moved] == [0, 0, 1, 1, 1, 1]
    assert m.block_table("a", group=0) == [-1, -1, -1, -1]
    m.check_invariants()


# ---- refusals ----------------------------------------------------------------------------------


def test_refused_without_a_tier_and_in_the_wrong_state():
    plain = KVCacheManager(num_blocks=8, block_size=BS, groups=HYBRID)
    plain.add_sequence("a", [1, 2, 3])
    unchanged(plain, lambda: plain.swap_out("a"), ValueError, "needs a host tier")
    m = make()
    m.add_sequence("a", list(range(9)), prefill=4)
    m.take_transfers()
    unchanged(m, lambda: m.swap_out("a"), ValueError, "not scheduled")
    unchanged(m, lambda: m.swap_in("a"), ValueError, "not swapped out")
    m.prefill("a", 5)
    m.take_transfers()
    m.append_tokens("a", [1, 2], speculative=True)
    m.take_transfers()
    unchanged(m, lambda: m.swap_out("a"), ValueError, "drafts")
    m.accept("a", 2)
    m.swap_out("a")
    unchanged(m, lambda: m.swap_out("a"), ValueError, "already swapped out")
    for call in (lambda: m.append_token("a", 1), lambda: m.append_tokens("a", [1]),
                 lambda: m.append_batch(["a", "a"], [1, 2]), lambda: m.fork("a", "b"),
                 lambda: m.slots("a"), lambda: m.block_tables(["a"]), lambda: m.flashinfer_layout(["a"], group=1)):
        unchanged(m, call, ValueError, "swapped out|twice")
    m.add_sequence("x", [5, 6])
    m.take_transfers()
    unchanged(m, lambda: m.append_batch(["x", "a"], [1, 2]), ValueError, "swapped out")
    m.check_invariants()


@pytest.mark.parametrize("work", ["admit", "prefill", "append_token", "append_batch", "append_tokens",
                                  "copy_on_write", "fork_before_step", "swap_in_loads"])
def test_swap_out_of_a_sequence_given_work_this_step_is_refused(work):
    """Its K/V is written only after the next take_transfers(): moving it now would copy
    unwritten slots to the host. After the drain it is legal."""
    m = make(num_blocks=24, host_blocks=16, enable_prefix_caching=False)
    sid = "a"
    if work == "admit":
        m.add_sequence("a", list(range(9)))
    elif work == "prefill":
        m.add_sequence("a", list(range(9)), prefill=0)
        m.take_transfers()
        m.prefill("a", 9)
    else:
        m.add_sequence("a", list(range(9)))
        m.add_sequence("b", list(range(5)))
        m.take_transfers()
        if work == "append_token":
            m.append_token("a", 1)
        elif work == "append_batch":
            m.append_batch(["a", "b"], [1, 2])
        elif work == "append_tokens":
            m.append_tokens("a", [1, 2])
        elif work == "copy_on_write":
            m.fork("a", "c")
            m.append_token("c", 3)
            sid = "c"
        elif work == "fork_before_step":
            m.append_token("a", 1)
            m.fork("a", "c")
            sid = "c"
        elif work == "swap_in_loads":
            m.swap_out("a")
            m.take_transfers()
            m.swap_in("a")
    unchanged(m, lambda: m.swap_out(sid), ValueError, "given positions or blocks in this step")
    m.take_transfers()
    m.take_copies()
    m.swap_out(sid)
    m.check_invariants()


def test_out_of_host_blocks_changes_nothing():
    m = make(host_blocks=4)
    m.add_sequence("a", list(range(9)))
    m.take_transfers()
    unchanged(m, lambda: m.swap_out("a"), OutOfBlocks, "host")
    m.check_invariants()


def test_out_of_device_blocks_on_swap_in_changes_nothing():
    m = make(num_blocks=8, enable_prefix_caching=False)
    m.add_sequence("a", list(range(9)))
    m.take_transfers()
    m.swap_out("a")
    m.take_transfers()
    m.add_sequence("b", list(range(20, 29)))  # 6 of the 8 blocks
    m.take_transfers()
    unchanged(m, lambda: m.swap_in("a"), OutOfBlocks, "swapping in")
    m.free("b")
    m.swap_in("a")
    m.check_invariants()


def test_free_while_swapped_and_free_before_the_loads_ran():
    m = make(enable_prefix_caching=True)
    m.add_sequence("a", list(range(9)))
    m.take_transfers()
    m.swap_out("a")
    m.free("a")  # the pending to_host transfers still pin their host blocks
    assert m.num_free_host_blocks == 3  # 5 moved (the window had let go of one)
    m.check_invariants()
    m.take_transfers()
    assert m.num_free_host_blocks == 8
    m.add_sequence("b", list(range(9)))
    m.take_transfers()
    m.swap_out("b")
    m.take_transfers()
    m.add_sequence("filler", list(range(100, 129)))  # evicts b's cached device blocks
    m.free("filler")
    m.take_transfers()
    m.swap_in("b")
    m.free("b")  # before the drain: the loads are dropped, the blocks unpublished
    # (what swap_in's allocation evicted is offloaded: to_host only)
    assert [t for t in m.take_transfers() if t.direction == "to_device"] == []
    assert m.lookup(list(range(9))) == 0
    m.check_invariants()


def test_reset_prefix_cache_is_refused_while_a_sequence_is_swapped_out():
    m = make()
    m.add_sequence("a", list(range(9)))
    m.take_transfers()
    m.swap_out("a")
    m.take_transfers()
    assert m.usage().used_blocks == 0 and not m.reset_prefix_cache()
    m.free("a")
    assert m.reset_prefix_cache()


def test_pickle_keeps_the_host_state():
    m = make()
    m.add_sequence("a", list(range(9)))
    m.take_transfers()
    m.swap_out("a")
    twin = pickle.loads(pickle.dumps(m))
    twin.check_invariants()
    assert twin.take_transfers() == m.take_transfers()
    twin.swap_in("a")
    twin.take_transfers()
    twin.append_token("a", 1)
    twin.add_sequence("z", [1])
    with pytest.raises(ValueError, match="given positions"):  # the marking append survived pickling
        twin.swap_out("a")


# ---- the physical check ------------------------------------------------------------------------


class Engine(base.Engine):
    """``base.Engine`` with a host store: each step runs the drained transfers first (every
    to_host, then every to_device), then the copies, writes and reads. A transfer moves a
    block's slots; one whose source holds no written slot is a transfer of garbage."""

    def __init__(self, m) -> None:
        super().__init__(m)
        self.host = [dict() for _ in self.specs]

    def transfers(self) -> None:
        bs = self.m.block_size
        for t in self.m.take_transfers():
            event(f"transfer {t.direction} in group {t.group}")
            src, dst = ((self.store, self.host) if t.direction == "to_host" else (self.host, self.store))
            src, dst = src[t.group], dst[t.group]
            rows = [src.get(t.src * bs + o) for o in range(bs)]
            assert any(v is not None for v in rows), f"{t} moves a block with nothing written"
            for o, v in enumerate(rows):
                if v is None:
                    dst.pop(t.dst * bs + o, None)
                else:
                    dst[t.dst * bs + o] = v

    def step(self, scheduled: dict) -> None:
        self.transfers()
        super().step(scheduled)

    def holds_next_reads(self, sid) -> None:
        """What the sequence's next query reads is on the device, each slot its position's."""
        m, bs = self.m, self.m.block_size
        toks, c = m.tokens(sid), m.num_computed(sid) - m.num_drafts(sid)
        for g, spec in enumerate(self.specs):
            table = m.block_table(sid, group=g)
            for p in (p for r in spec.read_ranges(c, bs) for p in r if p < c):
                blk = table[p // bs]
                assert blk >= 0 and self.store[g].get(blk * bs + p % bs) == self.ident(toks, p), (sid, g, p)


def test_physical_swap_round_trip_under_contention():
    """Two sequences decode; a is swapped out, b grows into the blocks a gave back, a comes
    back by loads (no prefix caching: nothing to revive), and both decode on: every read holds
    its position's K/V, on both groups."""
    m = make(num_blocks=20, host_blocks=12, enable_prefix_caching=False)
    e = Engine(m)
    m.add_sequence("a", list(range(9)))
    m.add_sequence("b", list(range(50, 55)))
    e.step({"a": (0, 9), "b": (0, 5)})
    for t in range(3):
        m.append_batch(["a", "b"], [t, t])
        e.step({"a": (9 + t, 10 + t), "b": (5 + t, 6 + t)})
    m.swap_out("a")
    gave_back = set(range(20)) - {b for g in range(2) for b in m.block_table("b", group=g)}
    for t in range(12):
        p = m.num_computed("b")
        m.append_token("b", t)
        e.step({"b": (p, p + 1)})
    assert gave_back & {b for g in range(2) for b in m.block_table("b", group=g)}  # b reuses a's blocks
    m.swap_in("a")
    e.step({})
    e.holds_next_reads("a")
    for t in range(6):
        pa, pb = m.num_computed("a"), m.num_computed("b")
        m.append_batch(["a", "b"], [t, t])
        e.step({"a": (pa, pa + 1), "b": (pb, pb + 1)})
    m.check_invariants()
    assert m.usage().transfers_to_device > 0


class SwapMachine(base.GroupsMachine):
    """The grouped state machine with a host tier and swap rules (drains at every step)."""

    @initialize(data=st.data(), bs=st.sampled_from([1, 2, 4]), nb=st.integers(6, 24), caching=st.booleans(),
                hb=st.integers(1, 24), policy=st.sampled_from(["write-back", "write-through", "none"]))
    def setup(self, data, bs, nb, caching, hb, policy):
        cfg = data.draw(st.sampled_from(self.configs))
        self.m = KVCacheManager(num_blocks=nb, block_size=bs, groups=cfg, enable_prefix_caching=caching,
                                host_blocks=hb, host_write_policy=policy)
        self.e = Engine(self.m)
        self.router = base.PrefixAwareRouter(block_size=bs, groups=cfg)
        self.router.bind(["replica"])
        self.tokens, self.sched, self.drafts, self.at_call = {}, {}, {}, {}
        self.swapped: set = set()
        self.next_id = 0

    def ready(self):
        return [s for s in super().ready() if s not in self.swapped]

    @precondition(lambda self: self.m is not None and any(self.sched[s] == len(self.tokens[s]) for s in self.tokens))
    @rule(data=st.data(), spec=st.booleans())
    def append_many(self, data, spec):
        choices = sorted(s for s in self.tokens if self.sched[s] == len(self.tokens[s])
                         and (spec or not self.drafts[s]) and s not in self.swapped)
        if not choices:
            return
        sid = data.draw(st.sampled_from(choices))
        toks = data.draw(st.lists(st.integers(0, 3), max_size=5))
        p = len(self.tokens[sid])
        committed = self.committed(sid)
        _, ok = self.attempt(lambda: self.m.append_tokens(sid, toks, speculative=spec))
        if ok and toks:
            self.at_call[sid] = committed
            self.tokens[sid] += toks
            self.sched[sid] += len(toks)
            if spec:
                self.drafts[sid] += len(toks)
            self.e.step({sid: (p, p + len(toks))})

    @precondition(lambda self: self.m is not None and self.ready())
    @rule(data=st.data())
    def swap_out(self, data):
        sid = data.draw(st.sampled_from(sorted(self.ready())))
        c = self.committed(sid)
        _, ok = self.attempt(lambda: self.m.swap_out(sid))
        if ok:
            event("swapped out")
            self.swapped.add(sid)
            self.at_call[sid] = c  # the releases due were made

    @precondition(lambda self: self.m is not None and self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        sid = data.draw(st.sampled_from(sorted(self.swapped)))
        _, ok = self.attempt(lambda: self.m.swap_in(sid))
        if ok:
            event("swapped in")
            self.swapped.discard(sid)
            self.e.step({})
            self.e.holds_next_reads(sid)

    @precondition(lambda self: self.m is not None and self.m.prefix_caching)
    @rule(n=st.integers(1, 12))
    def pressure(self, n):
        """Eviction pressure: a one-off prompt of ``n`` blocks is admitted, computed and freed,
        evicting cached blocks (offloaded to the host under write-back), so that later prompts
        of the shared prefixes hit the host."""
        bs = self.m.block_size
        sid = f"p{self.next_id}"
        prompt = [1000 + self.next_id] + [44] * (n * bs - 1)
        self.m.lookup(prompt)
        hit, ok = self.attempt(lambda: self.m.add_sequence(sid, prompt))
        self.next_id += 1
        if ok:
            self.e.step({sid: (hit, len(prompt))})
            self.m.free(sid)
            event("pressure")

    @precondition(lambda self: self.m is not None and self.m.prefix_caching)
    @rule(pre=st.integers(0, len(base.PREFIXES) - 1), n=st.integers(1, 12), chunk=st.none() | st.integers(0, 6))
    def evict_and_rehit(self, pre, n, chunk):
        """A prefix is computed and freed, pressure evicts it (to the host), and the same prompt
        comes back: the admission's lookup may hit the host (``admit`` checks it all)."""
        sid = f"r{self.next_id}"
        prompt = base.PREFIXES[pre] + [40]
        self.m.lookup(prompt)  # (as admit does: the hash memo's order is the same either way)
        hit, ok = self.attempt(lambda: self.m.add_sequence(sid, prompt))
        self.next_id += 1
        if not ok:
            return
        self.e.step({sid: (hit, len(prompt))})
        self.m.free(sid)
        self.pressure(n)
        self.admit(pre, len(base.PREFIXES[pre]), [40], chunk)

    @precondition(lambda self: self.m is not None and self.tokens)
    @rule(data=st.data(), cache=st.booleans())
    def free(self, data, cache):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.swapped.discard(sid)
        self.m.free(sid, cache=cache)
        for d in (self.tokens, self.sched, self.drafts, self.at_call):
            del d[sid]

    @precondition(lambda self: self.m is not None)
    @rule(now=st.integers(0, 7))
    def reset(self, now):
        if now:
            return
        u = self.m.usage()
        done = self.m.reset_prefix_cache()
        assert done == (u.used_blocks == 0 and u.host_used_blocks == 0)

    @invariant()
    def agrees(self):
        if self.m is None:
            return
        m, bs = self.m, self.m.block_size
        m.check_invariants()
        assert sorted(m.seq_ids()) == sorted(self.tokens)
        on = sorted(s for s in self.tokens if s not in self.swapped)
        live = [{b for s in self.tokens for b in m.block_table(s, group=g) if b >= 0} for g in range(m.num_groups)]
        u = m.usage()
        assert u.used_blocks == sum(map(len, live)) == m.num_blocks - m.num_free_blocks
        assert u.swapped_sequences == len(self.swapped)
        assert u.host_used_blocks >= sum(m.num_swapped_blocks(s) for s in self.swapped)
        for g in range(m.num_groups):
            indptr, indices, _ = m.flashinfer_layout(on, group=g)
            for i, s in enumerate(on):
                assert indices[indptr[i]: indptr[i + 1]].tolist() == [b for b in m.block_table(s, group=g) if b >= 0]
        for sid, toks in self.tokens.items():
            assert m.tokens(sid) == toks and m.num_computed(sid) == self.sched[sid]
            if sid in self.swapped:
                continue
            c = self.committed(sid)
            for g, spec in enumerate(m.groups):
                table = m.block_table(sid, group=g)
                assert all(table[p // bs] >= 0 for r in spec.read_ranges(c, bs) for p in r if p < c), (sid, g, table)
                kept = spec.kept_blocks(bs)
                assert all(b == -1 for b in table[kept:spec.released_below(self.at_call[sid], bs)]), (sid, g, table)


TestSwaps = SwapMachine.TestCase
TestSwaps.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                              phases=[p for p in settings().phases if p is not Phase.explain])


def test_the_physical_check_catches_an_untagged_transfer(monkeypatch):
    """Negative control: transfers stripped of their group (every one moving group 0's layers)
    leave group 1's K/V behind, and the round trip's reads catch it."""
    from pagedkv import KVCacheManager as GroupedKVCacheManager

    real = GroupedKVCacheManager.take_transfers
    monkeypatch.setattr(GroupedKVCacheManager, "take_transfers",
                        lambda self: [Transfer(*t) for t in real(self)])
    with pytest.raises(AssertionError, match="group 1|nothing written"):
        test_physical_swap_round_trip_under_contention()


# ---- the host prefix cache (write-back) ----------------------------------------------------------

WB = [FullAttention(), SlidingWindow(8)]
A13 = list(range(13))  # three full blocks and a partial one at block size 4
B16 = list(range(100, 116))  # four full blocks, no prefix in common with A13


def _evict_a_to_the_host(m, e=None):
    """a (A13) computed and freed, then b (B16) takes the whole pool: a's six cached blocks are
    evicted and offloaded; b is freed. Returns the drained transfers and events of b's admission."""
    m.add_sequence("a", A13)
    assert tables(m, "a") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    if e is not None:
        e.step({"a": (0, 13)})
    else:
        m.take_transfers()
    m.take_events()
    m.free("a")
    m.add_sequence("b", B16)
    assert tables(m, "b") == [[7, 4, 2, 0], [6, 5, 3, 1]]  # clean 7, 6, then a's LRU 4, 5, 2, 3, 0, 1
    events = m.take_events()
    if e is not None:
        e.step({"b": (0, 16)})
        moved = None
    else:
        moved = m.take_transfers()
    m.free("b")
    return moved, events


def test_write_back_offloads_evicted_blocks_under_group_and_hash_and_loads_host_hits():
    m = make(num_blocks=8, host_blocks=16, groups=WB)
    moved, events = _evict_a_to_the_host(m)
    # parents first within each group's chain, the full group's before the sliding group's
    assert moved == [Transfer("to_host", 0, 0), Transfer("to_host", 2, 1), Transfer("to_host", 4, 2),
                     Transfer("to_host", 1, 3, group=1), Transfer("to_host", 3, 4, group=1),
                     Transfer("to_host", 5, 5, group=1)]
    assert [t.group for t in moved] == [0, 0, 0, 1, 1, 1]
    removed = [ev for ev in events if isinstance(ev, BlockRemoved)]
    assert [(ev.medium, ev.group_idx, len(ev.block_hashes)) for ev in removed] == [("GPU", 0, 1), ("GPU", 1, 1)] * 3
    cpu = [ev for ev in events if isinstance(ev, BlockStored) and ev.medium == "CPU"]
    assert [(ev.group_idx, ev.token_ids, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window) for ev in cpu] == [
        (0, tuple(range(12)), "full_attention", None), (1, tuple(range(12)), "sliding_window", 8)]
    assert cpu[0].block_hashes == cpu[1].block_hashes  # one chain of hashes serves both groups
    assert cpu[0].parent_block_hash == cpu[1].parent_block_hash  # the chain's root
    gpu = [ev for ev in events if isinstance(ev, BlockStored) and ev.medium == "GPU"]
    assert [(ev.group_idx, ev.token_ids) for ev in gpu] == [(0, tuple(B16)), (1, tuple(B16))]  # b's own
    assert {h for ev in removed for h in ev.block_hashes} == set(cpu[0].block_hashes)
    assert events.index(cpu[0]) < events.index(gpu[0])  # offloaded during b's allocation

    hit = m.lookup(A13)
    assert (int(hit), hit.device, hit.host, hit.revived) == (12, 0, 12, 0)
    assert m.add_sequence("c", A13) == 12
    # loads into b's evicted blocks 0..4 (the LRU order), then two fresh ones; group 1's window
    # at position 12 reads 5..11: blocks 1 and 2 only
    assert tables(m, "c") == [[0, 1, 2, 5], [-1, 3, 4, 7]]
    out = m.take_transfers()
    assert [t for t in out if t.direction == "to_device"] == [
        Transfer("to_device", 0, 0), Transfer("to_device", 1, 1), Transfer("to_device", 2, 2),
        Transfer("to_device", 4, 3, group=1), Transfer("to_device", 5, 4, group=1)]
    assert [(t.src, t.dst, t.group) for t in out if t.direction == "to_host"] == [
        (7, 6, 0), (4, 7, 0), (2, 8, 0), (0, 9, 0), (5, 10, 1), (3, 11, 1), (1, 12, 1)]
    u = m.usage()
    assert (u.host_hit_tokens, u.transfers_to_device, u.transfers_to_host, u.host_cached_blocks) == (12, 5, 13, 13)
    assert m.lookup(A13).device == 12  # loaded blocks are findable on the device at once
    m.check_invariants()


def test_a_host_hit_needs_every_groups_blocks_and_write_through_copies_every_group():
    # three host blocks: the full group's chain is kept, the sliding group's blocks are not,
    # so the hit rule finds nothing (group 1 needs blocks 1 and 2 for a hit of 12, 0 and 1 for 8)
    m = make(num_blocks=8, host_blocks=3, groups=WB)
    moved, _ = _evict_a_to_the_host(m)
    assert [(t.src, t.dst, t.group) for t in moved] == [(0, 0, 0), (2, 1, 0), (4, 2, 0)]
    assert m.lookup(A13) == 0 and m.lookup(A13).host == 0
    m.check_invariants()
    # write-through takes groups too: every published block of every group is copied out once
    m = make(num_blocks=8, host_blocks=16, groups=WB, host_write_policy="write-through")
    m.add_sequence("w", A13)
    m.take_transfers()  # the step that computes them
    out = m.take_transfers()  # the drain after: their K/V exists, so they are copied out
    assert sorted(t.group for t in out) == [0, 0, 0, 1, 1, 1]
    m.check_invariants()
    # "none": swaps only, nothing offloaded
    m = make(num_blocks=8, host_blocks=16, groups=WB, host_write_policy="none")
    moved, events = _evict_a_to_the_host(m)
    assert moved == [] and not any(getattr(ev, "medium", None) == "CPU" for ev in events)
    assert m.lookup(A13) == 0


def test_a_sliding_groups_host_block_goes_with_the_full_groups_block_of_its_hash():
    """Reachability per group: host (1, h) hangs on (0, h); when the host evicts (0, h) and no
    tier holds it, (1, h) is dropped with it (under the plain parent rule it would stay: its
    parent is the root)."""
    from pagedkv.host_tier import HostTier
    from pagedkv.pool import BlockPool
    from pagedkv.prefix_cache import PrefixCache

    def anchor(key, parent):
        if key[0] == 0:
            return None if parent[1] == "R" else parent
        return (0, key[1])

    for rule, kept in ((anchor, False), (None, True)):
        device = PrefixCache(BlockPool(4), None, "GPU", keep_content=True)
        # (the control, the plain rule, runs without a device: a tier alone trusts its parents)
        tier = HostTier(2, 1, None, device=device if rule else None, anchor=rule)
        tier.offload([0, 1], [(0, "a"), (1, "a")], [((0, "R"), [1]), ((1, "R"), [1])])
        tier.pin([tier.block_of((1, "a"))])  # (1, a) becomes the host's most recently used
        tier.take_transfers(None)
        tier.offload([2], [(0, "c")], [((0, "R"), [2])])  # evicts (0, a), the oldest
        assert tier.block_of((0, "a")) is None and tier.block_of((0, "c")) is not None
        assert (tier.block_of((1, "a")) is not None) == kept
        tier.take_transfers(None)
        tier.check_invariants({})


def test_physical_evict_offload_host_hit_load_cycle():
    """The engine's order (transfers, copies, writes, reads) over the cycle above: c's first
    step reads positions 0..12 (group 0) and 5..12 (group 1) from loaded blocks, each holding
    its position's K/V; c decodes on past a window release."""
    m = make(num_blocks=8, host_blocks=16, groups=WB)
    e = Engine(m)
    _evict_a_to_the_host(m, e)
    assert m.add_sequence("c", A13) == 12
    e.step({"c": (12, 13)})
    e.holds_next_reads("c")
    for t in range(5):
        p = m.num_computed("c")
        m.append_token("c", t)
        e.step({"c": (p, p + 1)})
    e.holds_next_reads("c")
    m.check_invariants()
    assert m.usage().host_hit_tokens == 12


def test_the_physical_check_catches_a_missing_host_load(monkeypatch):
    """Negative control: the host hits' to_device transfers dropped, c's first reads find b's
    K/V (or nothing) in the blocks that should hold a's."""
    from pagedkv import KVCacheManager as GroupedKVCacheManager

    real = GroupedKVCacheManager.take_transfers
    monkeypatch.setattr(GroupedKVCacheManager, "take_transfers",
                        lambda self: [t for t in real(self) if t.direction == "to_host"])
    m = make(num_blocks=8, host_blocks=16, groups=WB)
    e = Engine(m)
    _evict_a_to_the_host(m, e)
    assert m.add_sequence("c", A13) == 12
    with pytest.raises(AssertionError, match="reads position"):
        e.step({"c": (12, 13)})


@pytest.mark.parametrize("call", ["append_token", "append_tokens"])
def test_a_window_release_before_the_drain_drops_the_loads_into_released_blocks(call):
    """c hits a's 12 tokens on the host and its prompt runs 18 tokens on; appended to before
    the drain (against the engine's order, but allowed), group 1's window lets go of blocks 0..4,
    among them the two it was loading: those loads are dropped and the blocks unpublished (an
    evicted block with a pending load would be offloaded before its K/V arrived)."""
    m = make(num_blocks=20, host_blocks=32, groups=WB)
    m.add_sequence("a", A13)
    m.take_transfers()
    m.free("a")
    m.add_sequence("b", list(range(100, 140)))  # 20 blocks: evicts a's six cached ones
    m.take_transfers()
    m.free("b")
    prompt = A13[:12] + list(range(50, 68))
    assert m.add_sequence("c", prompt) == 12
    loaded = tables(m, "c")[1][1:3]
    getattr(m, call)("c", *([7] if call == "append_token" else [[7]]))
    assert tables(m, "c")[1][:5] == [-1] * 5
    out = m.take_transfers()
    assert [t.group for t in out if t.direction == "to_device"] == [0, 0, 0]
    assert not {t.dst for t in out if t.direction == "to_device"} & set(loaded)
    hit = m.lookup(A13)  # group 1's blocks 1 and 2 are on the host only now (not on the device)
    assert (hit.device, hit.host) == (4, 8)
    m.check_invariants()


def test_a_host_hit_that_does_not_fit_changes_nothing_and_counts_the_chunk_only():
    """c needs 5 loads and 2 fresh blocks; x holds 2 of the 8: OutOfBlocks, nothing changed
    (the host blocks are not pinned either), and its numbers count the chunk's blocks only
    (needed 2, available 1: 6 usable minus the 5 loads), which the engine sizes chunks from."""
    m = make(num_blocks=8, host_blocks=16, groups=WB)
    _evict_a_to_the_host(m)
    m.add_sequence("x", [900])
    m.take_transfers()
    m.take_events()
    before = pickle.dumps(m)
    with pytest.raises(OutOfBlocks) as e:
        m.add_sequence("c", A13)
    assert (e.value.needed, e.value.available) == (2, 1)
    assert pickle.dumps(m) == before
    m.free("x")
    assert m.add_sequence("c", A13) == 12
    m.check_invariants()
