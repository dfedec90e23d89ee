"""Recurrent-state groups driven as an engine drives them, against a physical store.

The store keeps, for every K/V slot, the token prefix whose K/V was computed there, and for every
state block the token prefix whose state it holds (the state after its last position). Each
scheduling call is one engine step: drain ``take_copies()`` (every source read before any
destination is written), then, for the positions a .. b - 1 the call scheduled, read the state
``state_indices`` names (it must hold exactly the state after position a - 1, or be -1 when
a = 0), write the state after b - 1 into the block it names, write each position's K/V into its
slot and check every K/V read. So a hit restored from the wrong checkpoint, a running state two
forks both write in place, or a released block handed out while still read is caught where it
would corrupt a model's output. ``check_invariants()`` after every step; an ``OutOfBlocks``
leaves a byte-identical pickle.

Negative control: a state group whose hit reads the checkpoint one interval early must be caught.
"""
from __future__ import annotations

import pickle
import numpy as np
import pytest
from hypothesis import Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from recurrent_setup import EarlyCheckpoint
from pagedkv import (BlockStored, FullAttention, KVCacheManager, OutOfBlocks, RecurrentState, SlidingWindow)

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [1, 2, 3, 4, 5, 6, 7, 8, 30, 31], [40, 41, 42]]


class Engine:
    """The physical side: K/V slots and state blocks, each holding the prefix computed there."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m = m
        self.kv = {}  # (group, slot) -> prefix
        self.state = {}  # (group, block) -> prefix whose state it holds

    def step(self, scheduled: dict) -> None:
        m = self.m
        copies = m.take_copies()
        snapshot = dict(self.state), dict(self.kv)
        bs = m.block_size
        for c in copies:
            if m.groups[c.group].holds_state:
                if (c.group, c.src) in snapshot[0]:
                    self.state[c.group, c.dst] = snapshot[0][c.group, c.src]
            else:
                for o in range(bs):
                    v = snapshot[1].get((c.group, c.src * bs + o))
                    if v is not None:
                        self.kv[c.group, c.dst * bs + o] = v
        reads = {}
        for sid, (a, b) in scheduled.items():
            toks = tuple(m.tokens(sid))
            for g, spec in enumerate(m.groups):
                if spec.holds_state:
                    (r,), (w,) = m.state_indices([sid], g)
                    if a == 0:
                        assert r == -1, f"{sid!r}: a call from position 0 reads state block {r}"
                    else:
                        got = self.state.get((g, r))
                        assert got == toks[:a], f"{sid!r} group {g}: call {a}..{b} reads block {r} holding {got}"
                    reads[sid, g] = w
                else:
                    for p, slot in zip(range(a, b), m.slots(sid, a, b, group=g).tolist()):
                        self.kv[g, slot] = toks[: p + 1]
        for sid, (a, b) in scheduled.items():  # every state read before any state write
            toks = tuple(m.tokens(sid))
            for (s2, g), w in reads.items():
                if s2 == sid:
                    self.state[g, w] = toks[:b]
            for g, spec in enumerate(m.groups):
                if spec.holds_state:
                    continue
                table = m.block_table(sid, group=g)
                for q in range(a, b):
                    for p in (p for r in spec.read_ranges(q, bs) for p in r):
                        blk = table[p // bs]
                        assert blk >= 0 and self.kv.get((g, blk * bs + p % bs)) == toks[: p + 1], (sid, g, q, p)


class StateMachine(RuleBasedStateMachine):
    state_spec = RecurrentState

    @initialize(data=st.data(), bs=st.sampled_from([1, 2, 4]), mult=st.sampled_from([1, 2]), nb=st.integers(8, 30),
                caching=st.booleans(), window=st.booleans())
    def setup(self, data, bs, mult, nb, caching, window):
        groups = [FullAttention(), self.state_spec(bs * mult)]
        if window:
            groups.insert(1, SlidingWindow(3))
        self.m = KVCacheManager(num_blocks=nb, block_size=bs, groups=groups, enable_prefix_caching=caching)
        self.e = Engine(self.m)
        self.tokens: dict = {}
        self.sched: dict = {}
        self.next_id = 0

    def attempt(self, call):
        before = pickle.dumps(self.m)
        try:
            return call(), True
        except OutOfBlocks:
            event("OutOfBlocks")
            assert pickle.dumps(self.m) == before, "a failing call changed the manager"
            return None, False

    def ready(self):
        return [s for s in self.tokens if self.sched[s] == len(self.tokens[s])]

    @rule(pre=st.integers(0, 2), cut=st.integers(1, 17), tail=st.lists(st.integers(50, 60), max_size=4),
          chunk=st.none() | st.integers(0, 6))
    def admit(self, pre, cut, tail, chunk):
        prompt = PREFIXES[pre][:cut] + tail
        sid = f"s{self.next_id}"
        hit, ok = self.attempt(lambda: self.m.add_sequence(sid, prompt, prefill=chunk))
        if not ok:
            return
        self.next_id += 1
        if hit:
            event("state restored from a checkpoint")
        self.tokens[sid] = prompt
        self.sched[sid] = self.m.num_computed(sid)
        self.e.step({sid: (hit, self.sched[sid])} if self.sched[sid] > hit else {})

    @precondition(lambda self: any(self.sched[s] < len(self.tokens[s]) for s in self.tokens))
    @rule(data=st.data(), n=st.integers(1, 6))
    def prefill(self, data, n):
        sid = data.draw(st.sampled_from([s for s in self.tokens if self.sched[s] < len(self.tokens[s])]))
        n = min(n, len(self.tokens[sid]) - self.sched[sid])
        a = self.sched[sid]
        _, ok = self.attempt(lambda: self.m.prefill(sid, n))
        if ok:
            self.sched[sid] = a + n
            self.e.step({sid: (a, a + n)})

    @precondition(lambda self: self.ready())
    @rule(data=st.data(), tok=st.integers(70, 72), k=st.integers(1, 3))
    def append(self, data, tok, k):
        sid = data.draw(st.sampled_from(self.ready()))
        a = self.sched[sid]
        _, ok = self.attempt(lambda: self.m.append_tokens(sid, [tok] * k) if k > 1 else self.m.append_token(sid, tok))
        if ok:
            self.tokens[sid] += [tok] * k
            self.sched[sid] = a + k
            self.e.step({sid: (a, a + k)})

    @precondition(lambda self: len(self.ready()) >= 2)
    @rule(data=st.data())
    def decode_step(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.ready()), min_size=2, unique=True))
        toks = [80 + i for i in range(len(ids))]
        _, ok = self.attempt(lambda: self.m.append_batch(ids, toks))
        if ok:
            step = {}
            for sid, t in zip(ids, toks):
                step[sid] = (self.sched[sid], self.sched[sid] + 1)
                self.tokens[sid].append(t)
                self.sched[sid] += 1
            self.e.step(step)

    @precondition(lambda self: self.ready())
    @rule(data=st.data())
    def fork(self, data):
        sid = data.draw(st.sampled_from(self.ready()))
        child = f"s{self.next_id}"
        self.next_id += 1
        self.m.fork(sid, child)
        self.tokens[child] = list(self.tokens[sid])
        self.sched[child] = self.sched[sid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), cache=st.booleans())
    def free(self, data, cache):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(sid, cache=cache)
        del self.tokens[sid], self.sched[sid]

    @invariant()
    def agrees(self):
        if getattr(self, "m", None) is None:
            return
        m = self.m
        m.check_invariants()
        for sid, toks in self.tokens.items():
            assert m.tokens(sid) == toks and m.num_computed(sid) == self.sched[sid]
            for g, spec in enumerate(m.groups):
                if spec.holds_state and self.sched[sid]:
                    table = m.block_table(sid, group=g)
                    assert len(table) == -(-self.sched[sid] // spec.interval) and table[-1] >= 0
        u = m.usage()
        assert u.used_blocks == m.num_blocks - m.num_free_blocks


TestStates = StateMachine.TestCase
TestStates.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                               phases=[p for p in settings().phases if p is not Phase.explain])


def test_reading_the_checkpoint_one_interval_early_is_caught():
    class Broken(StateMachine):
        state_spec = EarlyCheckpoint

    Broken.__name__ = "Broken"
    with pytest.raises(AssertionError, match="reads block|keyed as another checkpoint"):
        run_state_machine_as_test(Broken, settings=settings(max_examples=200, stateful_step_count=30,
                                                            deadline=None, database=None, phases=[Phase.generate]))


def test_exact_checkpoint_hit_and_copy_on_write():
    """Block size 4, interval 8: a 13-token prompt writes entry 1; three decode tokens end the
    interval at 16, a checkpoint published at the next take_copies(); a prompt sharing the 16
    tokens then hits 16 and reads that block; a fork's first in-place write copies the state."""
    m = KVCacheManager(32, 4, groups=[FullAttention(), RecurrentState(8)])
    assert m.add_sequence("a", list(range(13))) == 0
    assert m.block_table("a", group=1) == [-1, 4] and m.state_indices(["a"], 1)[1].tolist() == [4]
    for t in (13, 14, 15):
        m.append_token("a", t)
    assert m.lookup(list(range(17))) == 0  # not before the next take_copies()
    m.take_copies()
    stored = [e for e in m.take_events() if isinstance(e, BlockStored) and e.group_idx == 1]
    assert [e.kv_cache_spec_kind for e in stored] == ["mamba"] and stored[0].token_ids == (12, 13, 14, 15)
    assert m.lookup(list(range(17))) == 16
    assert m.add_sequence("b", list(range(17))) == 16
    read, write = m.state_indices(["b"], 1)
    assert read.tolist() == [4] and write.tolist() != [4] and m.block_table("b", group=1)[1] == 4
    m.append_token("a", 16)  # a moves to entry 2: a fresh block, entry 1 stays until its next call
    m.fork("a", "c")
    m.append_token("c", 17)
    copies = m.take_copies()  # the shared partial K/V block and the shared running state
    assert sorted(c.group for c in copies) == [0, 1]
    [cp] = [c for c in copies if c.group == 1]
    assert cp.src == m.block_table("a", group=1)[-1] and cp.dst == m.block_table("c", group=1)[-1]
    m.check_invariants()


def test_state_groups_refuse_what_is_not_built():
    with pytest.raises(ValueError, match="interval must be a multiple of block_size"):
        KVCacheManager(32, 4, groups=[FullAttention(), RecurrentState(6)])
    with pytest.raises(ValueError, match="interval"):
        RecurrentState(0)
    with pytest.raises(ValueError, match="groups\\[0\\] must be an attention group"):
        KVCacheManager(32, 4, groups=[RecurrentState(8), FullAttention()])
    with pytest.raises(ValueError, match="host_blocks"):
        KVCacheManager(32, 4, groups=[FullAttention(), RecurrentState(8)], host_blocks=4)
    m = KVCacheManager(32, 4, groups=[FullAttention(), RecurrentState(8)])
    m.add_sequence("a", [1, 2, 3])
    before = pickle.dumps(m)
    with pytest.raises(ValueError, match="drafts"):
        m.append_tokens("a", [4], speculative=True)
    with pytest.raises(ValueError, match="not a recurrent-state group"):
        m.state_indices(["a"], 0)
    with pytest.raises(ValueError, match="no slots"):
        m.slots("a", 0, 1, group=1)
    assert pickle.dumps(m) == before
    u = m.usage(group=1)
    assert (u.used_blocks, u.stored_tokens, u.allocated_slots, u.internal_fragmentation) == (1, 0, 0, 0.0)
    assert np.array_equal(m.state_indices(["a"], 1)[0], [-1])
