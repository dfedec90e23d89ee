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


# ---------------------------------------------------------------- the rules, under random calls

from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

TOK = st.integers(0, 1)  # two token ids: equal blocks (twins) are common


class EdgeMachine(RuleBasedStateMachine):
    """Random admissions (whole or chunked), appends, drafts, batches, forks, aborts and steps on
    a small pool with a two-token alphabet. Models of its own:

    * a **slot store**: each step's writes (the slots the calls returned, with their tokens) and
      copies, applied at the step's end in the engine's order (copies, then writes); a sequence
      dropped with ``free(cache=False)`` never writes. At each step's end every prefix hit a
      prompt would get (probed on a pickled clone) must read blocks whose slots hold the
      prompt's tokens.
    * **findability**: after every call, each live sequence's full scheduled non-draft blocks are
      a prefix that ``lookup`` finds in full.
    * **capacity**: before every append, the free blocks, the freed pending-copy sources (read on
      a pickled clone's ``take_copies``) and the fresh blocks and copies the call needs; the call
      raises OutOfBlocks exactly when a brute-force search finds no assignment (copy
      destinations outside the freed sources), with ``available`` the blocks its shape can use.
    * **aborts**: ``free(cache=False)`` leaves the written prefix (hits, or a fork's inherited
      full blocks) findable and none of the blocks it computed alone.
    """

    @initialize(num_blocks=st.integers(3, 10), caching=st.booleans(),
                algo=st.sampled_from(["builtin", "sha256"]))
    def setup(self, num_blocks, caching, algo):
        self.m = KVCacheManager(num_blocks, block_size=BS, enable_prefix_caching=caching, hash_algo=algo)
        self.caching = caching
        self.store: dict[int, list] = {}  # block -> its slots' tokens (None: never written)
        self.pending: list[tuple] = []  # (slot, token, seq id): this step's writes
        self.written: dict = {}  # seq id -> its written prefix in blocks (the test's own count)
        self.next_id = 0
        self.prompts: list[list[int]] = []  # recent prompts, whose prefixes later ones reuse
        self.counts = {"oob": 0, "aborts": 0}

    # ---- helpers

    def ids(self, ready=True):
        m = self.m
        return [s for s in m.seq_ids() if not ready or (m.num_computed(s) == m.num_tokens(s) and not m.num_drafts(s))]

    def write(self, sid, slots, tokens):
        self.pending += [(int(sl), t, sid) for sl, t in zip(slots, tokens)]

    def pending_sources(self):
        return {c.src for c in pickle.loads(pickle.dumps(self.m)).take_copies()}

    def free_blocks(self):
        return [b for b in range(self.m.num_blocks) if self.m.refcount(b) == 0]

    def check_capacity(self, call, fresh, copies):
        """Run ``call``; it must fail exactly when no assignment exists."""
        free = self.free_blocks()
        srcs = set(free) & self.pending_sources()
        exists = any(len(free) - copies >= fresh
                     for dsts in itertools.combinations(free, copies) if not srcs & set(dsts))
        try:
            out = call()
        except OutOfBlocks as e:
            self.counts["oob"] += 1
            assert not exists, f"OutOfBlocks({e.needed}, {e.available}) though an assignment exists"
            assert (e.needed, e.available) == (fresh + copies, min(len(free), fresh + len(free) - len(srcs)))
            return None
        assert exists
        return out

    def needs(self, sid, k):
        """Fresh blocks and copies of appending k tokens to sid."""
        m, n = self.m, self.m.num_computed(sid)
        fresh = -(-(n + k) // BS) - -(-n // BS)
        copies = 1 if n % BS and m.refcount(m.block_table(sid)[-1]) > 1 else 0
        return fresh, copies

    # ---- rules

    @rule(prompt=st.lists(TOK, min_size=1, max_size=13), chunk=st.none() | st.integers(0, 13),
          reuse=st.integers(0, 3))
    def admit(self, prompt, chunk, reuse):
        if reuse and self.prompts:  # a recent prompt's first blocks, then its own: hits
            prompt = self.prompts[-reuse % len(self.prompts)][: reuse * BS] + prompt
        self.prompts = self.prompts[-7:] + [prompt]
        sid = f"s{self.next_id}"
        self.next_id += 1
        try:
            hit = self.m.add_sequence(sid, prompt, prefill=chunk)
        except OutOfBlocks:
            return
        self.written[sid] = hit // BS
        self.write(sid, self.m.slots(sid, hit), prompt[hit: self.m.num_computed(sid)])

    @rule(data=st.data())
    def prefill(self, data):
        m = self.m
        todo = [s for s in m.seq_ids() if m.num_computed(s) < m.num_tokens(s)]
        if todo:
            sid = data.draw(st.sampled_from(todo))
            start = m.num_computed(sid)
            n = data.draw(st.integers(1, m.num_tokens(sid) - start))
            try:
                slots = m.prefill(sid, n)
            except OutOfBlocks:
                return
            self.write(sid, slots, m.tokens(sid)[start:start + n])

    @rule(data=st.data(), toks=st.lists(TOK, min_size=1, max_size=6), spec=st.booleans())
    def append(self, data, toks, spec):
        m = self.m
        ok = [s for s in m.seq_ids() if m.num_computed(s) == m.num_tokens(s) and (spec or not m.num_drafts(s))]
        if ok:
            sid = data.draw(st.sampled_from(ok))
            if len(toks) == 1 and not spec:
                call = lambda: [m.append_token(sid, toks[0])]  # noqa: E731
            else:
                call = lambda: m.append_tokens(sid, toks, speculative=spec)  # noqa: E731
            slots = self.check_capacity(call, *self.needs(sid, len(toks)))
            if slots is not None:
                self.write(sid, slots, toks)

    @rule(data=st.data())
    def accept(self, data):
        with_drafts = [s for s in self.m.seq_ids() if self.m.num_drafts(s)]
        if with_drafts:
            sid = data.draw(st.sampled_from(with_drafts))
            self.m.accept(sid, data.draw(st.integers(0, self.m.num_drafts(sid))))

    @rule(data=st.data())
    def batch(self, data):
        m, ready = self.m, self.ids()
        if len(ready) < 2:
            return
        ids = data.draw(st.lists(st.sampled_from(ready), min_size=2, max_size=len(ready), unique=True))
        toks = data.draw(st.lists(TOK, min_size=len(ids), max_size=len(ids)))
        fresh, sharers = 0, {}
        for s in ids:
            n = m.num_computed(s)
            if not n % BS:
                fresh += 1
            elif m.refcount(m.block_table(s)[-1]) > 1:
                b = m.block_table(s)[-1]
                sharers[b] = sharers.get(b, 0) + 1
        copies = sum(min(k, m.refcount(b) - 1) for b, k in sharers.items())
        slots = self.check_capacity(lambda: m.append_batch(ids, toks), fresh, copies)
        if slots is not None:
            for s, sl, t in zip(ids, slots, toks):
                self.write(s, [sl], [t])

    @rule(data=st.data())
    def fork(self, data):
        busy = {p[2] for p in self.pending}
        ok = [s for s in self.ids() if s not in busy]  # fork after the parent's step wrote
        if ok:
            parent = data.draw(st.sampled_from(ok))
            child = f"s{self.next_id}"
            self.next_id += 1
            self.m.fork(parent, child)
            self.written[child] = self.m.num_computed(parent) // BS

    @rule(data=st.data(), cache=st.booleans())
    def free(self, data, cache):
        m = self.m
        busy = {p[2] for p in self.pending}
        if cache:  # a finished sequence: its step ran
            ok = [s for s in m.seq_ids() if s not in busy]
        else:  # dropped before its step: legal when nobody shares a block it writes this step
            ok = [s for s in m.seq_ids()
                  if all(m.refcount(sl // BS) == 1 for sl, _, q in self.pending if q == s)]
        if not ok:
            return
        sid = data.draw(st.sampled_from(ok))
        tokens, table, w = m.tokens(sid), m.block_table(sid), self.written.pop(sid)
        full = (m.num_computed(sid) - m.num_drafts(sid)) // BS
        own_alone = {b for b in table[w:] if m.refcount(b) == 1}
        m.free(sid, cache=cache)
        self.pending = [p for p in self.pending if p[2] != sid]
        if not cache and self.caching:
            self.counts["aborts"] += 1
            assert findable(m, tokens[: w * BS]) >= w  # the written prefix stays
            probe = pickle.loads(pickle.dumps(m))
            hit = probe.add_sequence("probe", tokens[: full * BS] + [9], prefill=0)
            assert not own_alone & set(probe.block_table("probe")[: hit // BS])

    @rule()
    def step(self):
        """The step runs: copies, then the scheduled writes."""
        for c in self.m.take_copies():
            self.store[c.dst] = list(self.store.get(c.src, [None] * BS))
        for slot, tok, _ in self.pending:
            self.store.setdefault(slot // BS, [None] * BS)[slot % BS] = tok
        self.pending = []
        self.check_hits([self.m.tokens(s) for s in self.m.seq_ids()])

    @rule(prompt=st.lists(TOK, min_size=1, max_size=13))
    def probe(self, prompt):
        if not self.pending:
            self.check_hits([prompt])

    def check_hits(self, prompts):
        """Every hit block holds, slot by slot, the tokens of the prompt that hits it."""
        if not self.caching:
            return
        clone = pickle.loads(pickle.dumps(self.m))
        for i, p in enumerate(prompts):
            hit = clone.add_sequence(("probe", i), list(p) + [9], prefill=0)
            for j, b in enumerate(clone.block_table(("probe", i))[: hit // BS]):
                assert self.store.get(b) == list(p[j * BS:(j + 1) * BS]), f"block {b} serves other K/V"

    @invariant()
    def every_full_block_findable(self):
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        if self.caching:
            for s in self.m.seq_ids():
                m = self.m
                full = (m.num_computed(s) - m.num_drafts(s)) // BS
                assert findable(m, m.tokens(s)[: full * BS]) >= full, f"{s}: a full block is unfindable"


EdgeMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestEdgeMachine = EdgeMachine.TestCase
