"""The grouped manager driven the way an engine drives it, against a plain reference model and a
store of what was physically written (issue 19 section 1).

Reference model: sequence id -> its tokens, how many positions are scheduled, how many pending
drafts. The store: per group, a dict slot -> the identity of what was computed there (the whole
token prefix up to that position, interned). Every scheduling call is one engine step: drain
``take_copies()`` (one batched copy per group: every source read before any destination is
written), write the K/V of every position the call scheduled into every group's slots, then run
the step's attention: each query at position q reads, in group g, the positions the group's spec
says it reads (q-W+1 .. q for a window, the chunk for a chunked group, all for full attention),
and every one of them must be a live table entry whose slot holds exactly that position's
prefix. So a block released too early, a hit on a block whose content is not the prompt's, a
copy-on-write that copied the wrong block, or a freed block handed to two tables is caught where
it would corrupt a model's output. After every step ``check_invariants()``, and the model's own
checks: tokens, counts, and for each group no entry below ``released_below`` of the committed
positions at the last scheduling call is held (the "at the latest" of the release rule).
Any ``OutOfBlocks`` leaves a byte-identical pickle behind.

Negative control: the same harness on a manager patched to release one block too early must
fail (``test_releasing_one_block_too_early_is_caught``).
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass

import pytest
from hypothesis import Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from pagedkv.sim.routers import PrefixAwareRouter
from pagedkv import ChunkedLocalAttention, FullAttention, KVCacheManager, OutOfBlocks, SlidingWindow
from pagedkv.kv_specs import AttentionSpec


@dataclass(frozen=True)
class SinksAndWindow(AttentionSpec):
    """An attention type the library does not ship, defined here only (StreamingLLM's attention
    sinks): a query reads the first ``sinks`` positions and its own window of ``window``. The
    manager runs it through the same coordinator with no change to its code: the spec keeps
    the sinks' blocks (``kept_blocks``) and releases the rest below the window."""

    sinks: int
    window: int
    kind = "sliding_window"

    @property
    def sliding_window(self):
        return self.window

    def first_read(self, q: int) -> int:
        return max(0, q - self.window + 1)

    def kept_blocks(self, block_size: int) -> int:
        return -(-self.sinks // block_size)


CONFIGS = [
    [FullAttention(), SlidingWindow(3)],
    [FullAttention(), SlidingWindow(8)],
    [SlidingWindow(5)],
    [FullAttention(), ChunkedLocalAttention(6)],
    [SlidingWindow(2), ChunkedLocalAttention(4), FullAttention()],
    [ChunkedLocalAttention(3), SlidingWindow(7)],
    [FullAttention(), SinksAndWindow(sinks=2, window=4)],
    [SinksAndWindow(sinks=3, window=5), SlidingWindow(3)],
]
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6, 20, 21, 22], [30, 31, 32, 33]]


class Engine:
    """The physical side: the store and the step's writes and reads (see the module docstring)."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m = m
        self.specs = m.groups
        self.store = [dict() for _ in self.specs]
        self.ids: dict[tuple, int] = {}  # token prefix -> its identity

    def ident(self, tokens, p: int) -> int:
        return self.ids.setdefault(tuple(tokens[: p + 1]), len(self.ids))

    def step(self, scheduled: dict) -> None:
        """``scheduled``: seq id -> (start, stop) positions this call scheduled."""
        m, bs = self.m, self.m.block_size
        for c in m.take_copies():
            event(f"copy-on-write in group {c.group}")
            store = self.store[c.group]
            rows = [store.get(c.src * bs + o) for o in range(bs)]
            for o, v in enumerate(rows):
                if v is None:
                    store.pop(c.dst * bs + o, None)
                else:
                    store[c.dst * bs + o] = v
        for sid, (a, b) in scheduled.items():
            toks = m.tokens(sid)
            for g in range(m.num_groups):
                for p, slot in zip(range(a, b), m.slots(sid, a, b, group=g).tolist()):
                    self.store[g][slot] = self.ident(toks, p)
        for sid, (a, b) in scheduled.items():
            self.read(sid, a, b)

    def read(self, sid, a: int, b: int) -> None:
        m, bs = self.m, self.m.block_size
        toks = m.tokens(sid)
        for g, spec in enumerate(self.specs):
            table = m.block_table(sid, group=g)
            for q in range(a, b):
                for p in (p for r in spec.read_ranges(q, bs) for p in r):
                    blk = table[p // bs]
                    assert blk >= 0, f"{sid!r} group {g}: query {q} reads position {p}, released"
                    got = self.store[g].get(blk * bs + p % bs)
                    assert got == self.ident(toks, p), (
                        f"{sid!r} group {g}: query {q} reads position {p} from block {blk}, which holds "
                        f"{'nothing' if got is None else 'other K/V'}")


class GroupsMachine(RuleBasedStateMachine):
    configs = CONFIGS  # the negative control draws windows that release one block early

    def __init__(self) -> None:
        super().__init__()
        self.m = None

    @initialize(data=st.data(), bs=st.sampled_from([1, 2, 4]), nb=st.integers(6, 24), caching=st.booleans())
    def setup(self, data, bs, nb, caching):
        cfg = data.draw(st.sampled_from(self.configs))
        self.m = KVCacheManager(num_blocks=nb, block_size=bs, groups=cfg, enable_prefix_caching=caching)
        self.e = Engine(self.m)
        # a router's view of the cache, built from the events alone, under the hit rule
        self.router = PrefixAwareRouter(block_size=bs, groups=cfg)
        self.router.bind(["replica"])
        self.tokens: dict = {}
        self.sched: dict = {}   # positions scheduled
        self.drafts: dict = {}
        self.at_call: dict = {}  # committed positions at the last scheduling call
        self.next_id = 0

    # -- helpers --------------------------------------------------------------------------------

    def ready(self):
        return [s for s in self.tokens if self.sched[s] == len(self.tokens[s]) and not self.drafts[s]]

    def attempt(self, call):
        before = pickle.dumps(self.m)
        try:
            return call(), True
        except OutOfBlocks:
            event("OutOfBlocks")
            assert pickle.dumps(self.m) == before, "a failing call changed the manager"
            return None, False

    def committed(self, s):
        return self.sched[s] - self.drafts[s]

    # -- rules ----------------------------------------------------------------------------------

    @rule(pre=st.integers(0, len(PREFIXES) - 1), cut=st.integers(1, 12),
          tail=st.lists(st.integers(40, 43), max_size=6), chunk=st.none() | st.integers(0, 6))
    def admit(self, pre, cut, tail, chunk):
        prompt = PREFIXES[pre][:cut] + tail
        sid = f"s{self.next_id}"
        self.router.on_events(0, self.m.take_events())
        looked = self.m.lookup(prompt)
        if self.m.prefix_caching:  # the events tell a router exactly what a lookup finds
            routed = self.router.match_blocks(prompt)[0] * self.m.block_size  # on the device
            assert routed == looked if not looked.host else routed <= looked  # (host: "CPU" events)
            if looked.host:
                event("lookup hits the host")
        hit, ok = self.attempt(lambda: self.m.add_sequence(sid, prompt, prefill=chunk))
        if not ok:
            return
        self.next_id += 1
        assert hit == looked and hit % self.m.block_size == 0 and hit < len(prompt)
        if hit:
            event("prefix hit")
            if any(-1 in self.m.block_table(sid, group=g) for g in range(self.m.num_groups)):
                event("hit with entries a group does not need")
        self.tokens[sid] = list(prompt)
        self.sched[sid] = len(prompt) if chunk is None else hit + min(chunk, len(prompt) - hit)
        self.drafts[sid] = 0
        self.at_call[sid] = hit
        self.e.step({sid: (hit, self.sched[sid])})

    @precondition(lambda self: self.m is not None and any(self.sched[s] < len(self.tokens[s]) for s in self.tokens))
    @rule(data=st.data())
    def prefill(self, data):
        sid = data.draw(st.sampled_from(sorted(s for s in self.tokens if self.sched[s] < len(self.tokens[s]))))
        n = data.draw(st.integers(0, len(self.tokens[sid]) - self.sched[sid]))
        start = self.sched[sid]
        _, ok = self.attempt(lambda: self.m.prefill(sid, n))
        if ok:
            if n:
                self.at_call[sid] = start
            self.sched[sid] += n
            self.e.step({sid: (start, start + n)})

    @precondition(lambda self: self.m is not None and self.ready())
    @rule(data=st.data())
    def decode(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.ready())), min_size=1, max_size=4, unique=True))
        toks = data.draw(st.lists(st.integers(0, 3), min_size=len(ids), max_size=len(ids)))
        slots, ok = self.attempt(lambda: self.m.append_batch(ids, toks) if len(ids) > 1
                                 else [self.m.append_token(ids[0], toks[0])])
        if ok:
            step = {}
            for sid, t, slot in zip(ids, toks, list(slots)):
                p = len(self.tokens[sid])
                self.at_call[sid] = p
                self.tokens[sid].append(t)
                self.sched[sid] += 1
                assert self.m.slots(sid, p, p + 1).tolist() == [slot]
                step[sid] = (p, p + 1)
            self.e.step(step)

    @precondition(lambda self: self.m is not None and any(self.sched[s] == len(self.tokens[s]) for s in self.tokens))
    @rule(data=st.data(), spec=st.booleans())
    def append_many(self, data, spec):
        choices = sorted(s for s in self.tokens if self.sched[s] == len(self.tokens[s])
                         and (spec or not self.drafts[s]))
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

    @precondition(lambda self: self.m is not None and any(self.drafts.values()))
    @rule(data=st.data())
    def accept(self, data):
        sid = data.draw(st.sampled_from(sorted(s for s in self.drafts if self.drafts[s])))
        k = data.draw(st.integers(0, self.drafts[sid]))
        self.m.accept(sid, k)
        drop = self.drafts[sid] - k
        if drop:
            del self.tokens[sid][-drop:]
        self.sched[sid] -= drop
        self.drafts[sid] = 0

    @precondition(lambda self: self.m is not None and self.ready())
    @rule(data=st.data())
    def fork(self, data):
        p = data.draw(st.sampled_from(sorted(self.ready())))
        c = f"s{self.next_id}"
        self.next_id += 1
        self.m.fork(p, c)
        self.tokens[c] = list(self.tokens[p])
        self.sched[c], self.drafts[c], self.at_call[c] = self.sched[p], 0, self.at_call[p]

    @precondition(lambda self: self.m is not None and self.tokens)
    @rule(data=st.data(), cache=st.booleans())
    def free(self, data, cache):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(sid, cache=cache)
        for d in (self.tokens, self.sched, self.drafts, self.at_call):
            del d[sid]

    @precondition(lambda self: self.m is not None)
    @rule(now=st.integers(0, 7))
    def reset(self, now):
        if now:  # rarely: a reset empties the cache the hits need
            return
        held = self.m.usage().used_blocks
        done = self.m.reset_prefix_cache()
        assert done == (held == 0)  # refused while any block is in use, as the plain manager
        if done:
            assert self.m.usage().cached_blocks == 0

    @precondition(lambda self: self.m is not None)
    @rule()
    def roundtrip(self):
        self.m = pickle.loads(pickle.dumps(self.m))
        self.e.m = self.m

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def agrees(self):
        if self.m is None:
            return
        m, bs = self.m, self.m.block_size
        m.check_invariants()
        assert sorted(m.seq_ids()) == sorted(self.tokens)
        ids = sorted(self.tokens)
        live = [{b for s in ids for b in m.block_table(s, group=g) if b >= 0} for g in range(m.num_groups)]
        u = m.usage()
        assert u.used_blocks == sum(map(len, live)) == m.num_blocks - m.num_free_blocks
        assert u.logical_tokens == sum(self.sched.values())
        for g in range(m.num_groups):
            assert m.usage(group=g).used_blocks == len(live[g])
            rows = m.block_tables(ids, group=g, pad=-7)
            indptr, indices, last = m.flashinfer_layout(ids, group=g)
            for i, s in enumerate(ids):
                t = m.block_table(s, group=g)
                assert rows[i, : len(t)].tolist() == t and (rows[i, len(t):] == -7).all()
                assert indices[indptr[i]: indptr[i + 1]].tolist() == [b for b in t if b >= 0]
        for sid, toks in self.tokens.items():
            assert m.tokens(sid) == toks and m.num_computed(sid) == self.sched[sid]
            assert m.num_drafts(sid) == self.drafts[sid]
            c = self.committed(sid)
            for g, spec in enumerate(m.groups):
                table = m.block_table(sid, group=g)
                assert len(table) == -(-self.sched[sid] // bs)
                needed = {p // bs for r in spec.read_ranges(c, bs) for p in r if p < self.sched[sid]}
                assert all(table[i] >= 0 for i in needed), (sid, g, table)  # the next query's reads
                kept = spec.kept_blocks(bs)
                gone = spec.released_below(self.at_call[sid], bs)  # released at the latest by now
                if gone > kept:
                    event("released entries")
                assert all(b == -1 for b in table[kept:gone]), (sid, g, table, self.at_call[sid])


TestGroups = GroupsMachine.TestCase
TestGroups.settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                               phases=[p for p in settings().phases if p is not Phase.explain])


@dataclass(frozen=True)
class EarlyWindow(SlidingWindow):
    """A window whose releases run one block ahead of the rule: it lets go of the block the next
    query still reads the end of (never a block the sequence is still filling). Reads are the
    real window's (``first_read`` is inherited), so the harness checks what a model would read."""

    def released_below(self, computed: int, block_size: int) -> int:
        return min(super().released_below(computed, block_size) + 1, computed // block_size)


def test_releasing_one_block_too_early_is_caught():
    """The negative control: the physical read check (a query reading a released position)
    fails on a manager that releases one block early, in a plain scenario: block size 4,
    [Full, Sliding(8)], a 9-token prompt then decode. The unpatched manager passes it."""
    for patched in (False, True):
        window = EarlyWindow(8) if patched else SlidingWindow(8)
        m = KVCacheManager(num_blocks=32, block_size=4, groups=[FullAttention(), window])
        e = Engine(m)
        m.add_sequence("a", list(range(9)))
        e.step({"a": (0, 9)})

        def run():
            for t in range(12):
                p = m.num_computed("a")
                m.append_token("a", t)
                e.step({"a": (p, p + 1)})

        if patched:
            with pytest.raises(AssertionError, match="released"):
                run()
        else:
            run()
            m.check_invariants()


def test_state_machine_catches_one_block_early():
    """The same control through the state machine: hypothesis must find a failing run."""

    class Early(GroupsMachine):
        configs = [[FullAttention(), EarlyWindow(3)], [EarlyWindow(5)], [FullAttention(), EarlyWindow(8)]]

    Early.__name__ = "Early"
    with pytest.raises(AssertionError):
        run_state_machine_as_test(Early, settings=settings(max_examples=200, stateful_step_count=30,
                                                           deadline=None, database=None,
                                                           phases=[Phase.generate]))
