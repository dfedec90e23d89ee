"""The backbone: a hypothesis state machine driving KVCacheManager like an engine would.

It interleaves admissions (prompts from a small vocabulary built on shared prefixes, so prefix hits
really happen, with random salts), single/multi/batch appends, forks, frees, cache resets, bad
calls and running out of blocks (pools of 8-40 blocks, block sizes 1-5). Beside the manager it
keeps

* a plain reference model: sequence id -> token list (and its salt);
* a simulated KV store (``SlotStore``): each drained ``CopyOp`` is executed before the step's
  tokens are written at the returned slots; an admission writes the prompt from position ``hit``
  on, into the slots its block table names;
* the block each full block was filled from: ``(salt, tokens up to and including the block)``;
* a router's view of the prefix cache built only from the events.

After every step: ``check_invariants()``; reading every live sequence back through its block table
from the store gives exactly the model's tokens (so copies, in-place writes and prefix hits all
returned the right physical blocks); refcounts equal table references; every ``usage()`` number
matches its definition; block_tables / flashinfer_layout agree with the tables. A prefix hit must
return blocks filled under the same salt with exactly the prompt's tokens so far, and (events on)
be exactly the longest run of the prompt's blocks the router's view says are cached, capped below
the whole prompt. Any ``OutOfBlocks`` must leave a byte-identical snapshot behind. Freed ids are
reused.
"""
from __future__ import annotations

import itertools
import math
import random

from hypothesis import event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedkv import AllBlocksCleared, BlockRemoved, BlockStored, CopyOp, KVCacheManager, OutOfBlocks
from conftest import HAVE_XXHASH, STATEFUL_FACTOR, SlotStore, snapshot, stored_blocks

VOCAB = 4
_rng = random.Random(1234)
PREFIXES = [[_rng.randrange(VOCAB) for _ in range(24)] for _ in range(3)]
TOKEN = st.sampled_from([0, 1, 2, 3, 0, 1, 2, 3, 2**32 - 1])
SALTS = st.sampled_from([None, None, None, "a", "b"])


class ManagerMachine(RuleBasedStateMachine):
    algo = "sha256"

    def __init__(self):
        super().__init__()
        self.m = None

    # ------------------------------------------------------------ setup

    @initialize(
        nb=st.integers(8, 40),
        bs=st.integers(1, 5),
        caching=st.sampled_from([True, True, True, False]),
        events=st.sampled_from([True, True, True, False]),
    )
    def setup(self, nb, bs, caching, events):
        self.nb, self.bs, self.caching, self.events = nb, bs, caching, events
        self.m = KVCacheManager(
            num_blocks=nb,
            block_size=bs,
            enable_prefix_caching=caching,
            hash_algo=self.algo,
            enable_events=events,
        )
        self.store = SlotStore(nb, bs)
        self.model: dict[int, list[int]] = {}
        self.salt: dict[int, object] = {}
        self.filled: dict[int, tuple] = {}  # block -> (salt, tokens up to the end of the block)
        self.router: set = set()  # hashes the events say are in the cache
        self.known: set = set()  # every block hash ever published
        self.chain: dict = {}  # (parent hash, block tokens) -> hash, learnt from events
        self.roots: dict = {}  # salt -> root hash, learnt from events
        self.next_id = 0
        self.freed_ids: list[int] = []
        self.n_forks = self.n_cow = self.n_query = self.n_hit = self.n_removed = 0

    # ------------------------------------------------------------ helpers

    def live(self):
        return sorted(self.model)

    def new_id(self):
        """A fresh id, or every other time one that was freed (ids are reused by engines)."""
        self.next_id += 1
        if self.freed_ids and self.next_id % 2:
            return self.freed_ids.pop(0)
        return self.next_id

    def attempt(self, fn):
        """Run an allocating call; on OutOfBlocks check that nothing changed."""
        before = snapshot(self.m, self.live())
        try:
            return True, fn()
        except OutOfBlocks as e:
            event("OutOfBlocks")
            assert e.needed > e.available >= 0, (e.needed, e.available)
            assert snapshot(self.m, self.live()) == before
            assert self.m.take_copies() == []
            assert self.m.take_events() == []
            return False, None

    def drain_events(self, allow_clear=False):
        """Apply the step's events to the router's view; return the roots seen: (root, tokens)
        of each published block chained from a salt's root rather than from a block hash."""
        evs = self.m.take_events()
        if not self.events:
            assert evs == []
            return []
        roots = []
        for ev in evs:
            if isinstance(ev, BlockStored):
                assert self.caching
                assert ev.block_size == self.bs
                for h, parent, blk in stored_blocks([ev]):
                    assert h not in self.router, "published a hash the cache already holds"
                    assert len(blk) == self.bs
                    if parent not in self.known:
                        roots.append((parent, blk))
                    prev = self.chain.setdefault((parent, blk), h)
                    assert prev == h, "the same (parent, tokens) hashed differently"
                    self.known.add(h)
                    self.router.add(h)
            elif isinstance(ev, BlockRemoved):
                event("eviction")
                for h in ev.block_hashes:
                    assert h in self.router, "removed a hash that was never stored"
                    self.router.remove(h)
                    self.n_removed += 1
            else:
                assert isinstance(ev, AllBlocksCleared) and allow_clear
                self.router.clear()
        return roots

    def learn_root(self, salt, root):
        """Hashes chain from a root that is a function of the salt alone: one root per salt,
        different salts never share one."""
        known = self.roots.setdefault(salt, root)
        assert known == root, f"two roots for salt {salt!r}"
        assert list(self.roots.values()).count(root) == 1, "two salts share a root"

    def expected_hit(self, prompt, salt):
        """The longest run of the prompt's full blocks whose hashes the cache holds (as the
        router sees it), never the whole prompt; None where events cannot tell."""
        if not (self.caching and self.events):
            return None
        bs, cap = self.bs, (len(prompt) - 1) // self.bs
        parent, k = self.roots.get(salt), 0
        if parent is None:  # no first block under this salt was ever published
            return 0
        while k < cap:
            h = self.chain.get((parent, tuple(prompt[k * bs : (k + 1) * bs])))
            if h is None or h not in self.router:
                break
            parent, k = h, k + 1
        return k * bs

    def record_full_blocks(self, sid, start_block):
        """Remember what every full block of ``sid`` from ``start_block`` on was filled with."""
        tokens, table, bs = self.model[sid], self.m.block_table(sid), self.bs
        for i in range(start_block, len(tokens) // bs):
            self.filled[table[i]] = (self.salt[sid], tuple(tokens[: (i + 1) * bs]))

    def forget(self, blocks):
        for b in blocks:
            self.filled.pop(b, None)

    def expect_extend(self, sid, old_table, old_n, k, rc, new_table):
        """Check the table after appending ``k`` tokens; return the copies it implies.

        ``rc`` is a mutable refcount map as seen by this sequence's turn in the step."""
        bs = self.bs
        new_n = old_n + k
        assert len(new_table) == math.ceil(new_n / bs)
        full = old_n // bs
        assert new_table[:full] == old_table[:full], "full blocks must never move"
        copies = []
        if old_n % bs:
            last = old_table[-1]
            if rc[last] > 1:  # shared partial block: copy-on-write
                dst = new_table[full]
                assert dst != last
                copies.append(CopyOp(last, dst))
                rc[last] -= 1
                fresh = new_table[full:]
            else:
                assert new_table[full] == last, "the last holder writes in place"
                fresh = new_table[full + 1 :]
        else:
            fresh = new_table[full:]
        self.forget(fresh)
        for b in fresh:
            assert rc.get(b, 0) == 0, "a fresh block was still in use"
            rc[b] = 1
        return copies

    # ------------------------------------------------------------ rules

    @rule(data=st.data())
    def add(self, data):
        bs = self.bs
        base = data.draw(st.sampled_from(PREFIXES), label="base")
        k = data.draw(st.integers(0, min(len(base), 4 * bs)), label="prefix_len")
        suffix = data.draw(st.lists(TOKEN, max_size=2 * bs), label="suffix")
        prompt = base[:k] + suffix or [0]
        salt = data.draw(SALTS, label="salt")
        self._add(prompt, salt)

    @rule(data=st.data())
    def add_continuation(self, data):
        """A prompt extending (a prefix of) a live sequence's tokens, generated ones included:
        hits on live blocks and on blocks published by appends."""
        if not self.model:
            return self.add(data)
        src = data.draw(st.sampled_from(self.live()), label="source")
        tokens = self.model[src]
        k = data.draw(st.integers(1, len(tokens)), label="prefix_len")
        suffix = data.draw(st.lists(TOKEN, max_size=self.bs), label="suffix")
        salt = data.draw(st.sampled_from([self.salt[src], self.salt[src], "b"]), label="salt")
        self._add(tokens[:k] + suffix, salt)

    @rule(data=st.data())
    def preempt(self, data):
        """Free a sequence and re-admit its tokens (recompute preemption): hits on the blocks it
        just released, revived from the cached-free LRU."""
        if not self.model:
            return self.add(data)
        sid = data.draw(st.sampled_from(self.live()), label="seq")
        tokens, salt = self.model[sid], self.salt[sid]
        self._free(sid)
        self._add(list(tokens), salt)

    def _add(self, prompt, salt):
        bs = self.bs
        sid = self.new_id()
        rc = [self.m.refcount(b) for b in range(self.nb)]
        want_hit = self.expected_hit(prompt, salt)
        ok, hit = self.attempt(lambda: self.m.add_sequence(sid, prompt, cache_salt=salt))
        if not ok:
            assert sid not in self.m
            return
        if want_hit is not None:
            assert hit == want_hit, "not the longest cached prefix"
            if hit:
                event("exact hit checked against the router's view")
        event(f"hit blocks: {hit // bs}")
        assert hit % bs == 0 and 0 <= hit <= (len(prompt) - 1) // bs * bs
        if not self.caching:
            assert hit == 0
        assert self.m.take_copies() == []
        table = self.m.block_table(sid)
        assert len(table) == math.ceil(len(prompt) / bs)
        # prefix hits: the returned blocks hold exactly the prompt, filled under the same salt
        assert self.store.read(table, hit) == prompt[:hit]
        for i in range(hit // bs):
            assert self.filled.get(table[i]) == (salt, tuple(prompt[: (i + 1) * bs])), i
        new_blocks = table[hit // bs :]
        for b in table[: hit // bs]:
            assert self.m.refcount(b) == rc[b] + 1
            if rc[b] == 0:
                event("revived a cached block")
        for b in new_blocks:
            assert rc[b] == 0 and self.m.refcount(b) == 1, "a new block was already in use"
        self.forget(new_blocks)
        self.store.write_prompt(table, prompt, hit)
        self.model[sid] = list(prompt)
        self.salt[sid] = salt
        self.record_full_blocks(sid, hit // bs)
        if self.caching:
            self.n_query += len(prompt)
            self.n_hit += hit
        for root, blk in self.drain_events():
            assert hit == 0 and blk == tuple(prompt[:bs])
            self.learn_root(salt, root)

    @rule(data=st.data())
    def append_token(self, data):
        if not self.model:  # nothing live yet: admit something instead
            return self.add(data)
        sid = data.draw(st.sampled_from(self.live()), label="seq")
        tok = data.draw(TOKEN, label="token")
        self._append(sid, [tok], lambda: [self.m.append_token(sid, tok)])

    @rule(data=st.data())
    def append_tokens(self, data):
        if not self.model:  # nothing live yet: admit something instead
            return self.add(data)
        sid = data.draw(st.sampled_from(self.live()), label="seq")
        tokens = data.draw(st.lists(TOKEN, min_size=1, max_size=3 * self.bs + 1), label="tokens")
        self._append(sid, tokens, lambda: list(self.m.append_tokens(sid, tokens)))

    def _append(self, sid, tokens, call):
        old_table, old_n = self.m.block_table(sid), len(self.model[sid])
        rc = {b: self.m.refcount(b) for b in range(self.nb)}
        ok, slots = self.attempt(call)
        if not ok:
            return
        new_table = self.m.block_table(sid)
        want_copies = self.expect_extend(sid, old_table, old_n, len(tokens), rc, new_table)
        copies = self.m.take_copies()
        assert copies == want_copies
        if copies:
            event("copy-on-write")
        self.n_cow += len(copies)
        assert list(slots) == self.store.slots_of(new_table, old_n, old_n + len(tokens)).tolist()
        self.store.copy(copies)
        self.store.write(slots, tokens)
        self.model[sid].extend(tokens)
        self.record_full_blocks(sid, old_n // self.bs)
        for root, blk in self.drain_events():
            assert old_n < self.bs and blk == tuple(self.model[sid][: self.bs])
            self.learn_root(self.salt[sid], root)

    @rule(data=st.data())
    def append_batch(self, data):
        if not self.model:  # nothing live yet: admit something instead
            return self.add(data)
        order = data.draw(st.permutations(self.live()), label="order")
        ids = order[: data.draw(st.integers(1, len(order)), label="batch_size")]
        tokens = data.draw(st.lists(TOKEN, min_size=len(ids), max_size=len(ids)), label="tokens")
        old = {s: (self.m.block_table(s), len(self.model[s])) for s in ids}
        rc = {b: self.m.refcount(b) for b in range(self.nb)}
        ok, slots = self.attempt(lambda: self.m.append_batch(ids, tokens))
        if not ok:
            return
        assert str(slots.dtype) == "int64" and slots.shape == (len(ids),)
        want_copies, want_slots = [], []
        for s in ids:
            old_table, old_n = old[s]
            new_table = self.m.block_table(s)
            want_copies += self.expect_extend(s, old_table, old_n, 1, rc, new_table)
            want_slots.append(int(self.store.slots_of(new_table, old_n, old_n + 1)[0]))
        copies = self.m.take_copies()
        assert copies == want_copies
        assert slots.tolist() == want_slots
        if copies:
            event("copy-on-write in a batch")
        self.n_cow += len(copies)
        self.store.copy(copies)
        self.store.write(slots, tokens)
        for s, t in zip(ids, tokens):
            self.model[s].append(t)
            self.record_full_blocks(s, old[s][1] // self.bs)
        for root, blk in self.drain_events():
            salts = {
                self.salt[s]
                for s in ids
                if old[s][1] == self.bs - 1 and tuple(self.model[s][: self.bs]) == blk
            }
            assert salts, "a root-chained block that no sequence filled"
            if len(salts) == 1:
                self.learn_root(salts.pop(), root)

    @rule(data=st.data())
    def fork(self, data):
        if not self.model:  # nothing live yet: admit something instead
            return self.add(data)
        parent = data.draw(st.sampled_from(self.live()), label="parent")
        child = self.new_id()
        free = self.m.num_free_blocks
        self.m.fork(parent, child)
        assert self.m.num_free_blocks == free
        assert self.m.take_copies() == []
        assert self.m.block_table(child) == self.m.block_table(parent)
        self.model[child] = list(self.model[parent])
        self.salt[child] = self.salt[parent]
        self.n_forks += 1
        assert self.m.take_events() == []  # a fork publishes and evicts nothing

    @rule(data=st.data())
    def free(self, data):
        if not self.model:  # nothing live yet: admit something instead
            return self.add(data)
        sid = data.draw(st.sampled_from(self.live()), label="seq")
        self._free(sid, cache=data.draw(st.booleans(), label="cache"))

    def _free(self, sid, cache=True):
        table = self.m.block_table(sid)
        freed = sum(1 for b in set(table) if self.m.refcount(b) == table.count(b))
        free, cached = self.m.num_free_blocks, self.m.usage().cached_blocks
        self.m.free(sid, cache=cache)
        assert sid not in self.m
        assert self.m.num_free_blocks == free + freed
        del self.model[sid], self.salt[sid]
        self.freed_ids.append(sid)
        if cache:
            assert self.m.take_events() == []  # freeing publishes and evicts nothing
            return
        # An uncached free unpublishes what only this sequence held: nothing new is revivable,
        # and the removals it reports are not evictions.
        event("free(cache=False)")
        assert self.m.usage().cached_blocks == cached
        removed_before = self.n_removed
        self.drain_events()
        self.n_removed = removed_before

    @rule()
    def reset(self):
        before = snapshot(self.m, self.live())
        ok = self.m.reset_prefix_cache()
        assert ok is (not self.model)
        if ok:
            event("reset done")
            u = self.m.usage()
            assert u.cached_blocks == 0 and self.m.num_free_blocks == self.nb
            self.filled.clear()  # no old block may hit again
            evs = self.m.take_events()
            if self.events and self.caching:
                assert evs == [AllBlocksCleared()]
            else:  # with caching off there is no cache to clear: an event is optional
                assert evs in ([], [AllBlocksCleared()]) and (self.events or not evs)
            self.router.clear()
        else:
            assert snapshot(self.m, self.live()) == before
            assert self.m.take_events() == []

    @rule(data=st.data())
    def bad_call(self, data):
        """Errors change nothing: unknown ids, duplicate ids, bad tokens, malformed batches."""
        live = self.live()
        before = snapshot(self.m, live)
        kind = data.draw(st.sampled_from(["unknown", "dup", "token", "batch_dup", "batch_len"]))
        if kind == "unknown":
            exc, call = KeyError, lambda: self.m.append_token(-1, 0)
        elif kind == "dup" and live:
            exc, call = ValueError, lambda: self.m.add_sequence(live[0], [1])
        elif kind == "token" and live:
            bad = data.draw(st.sampled_from([-1, 2**32, 0.5]))
            exc, call = ValueError, lambda: self.m.append_tokens(live[0], [0, bad])
        elif kind == "batch_dup" and live:
            exc, call = ValueError, lambda: self.m.append_batch([live[0], live[0]], [1, 1])
        elif kind == "batch_len" and live:
            exc, call = ValueError, lambda: self.m.append_batch(live, [1] * (len(live) + 1))
        else:
            exc, call = ValueError, lambda: self.m.add_sequence(self.new_id(), [])
        try:
            call()
        except exc:
            pass
        else:
            raise AssertionError(f"{kind}: expected {exc.__name__}")
        assert snapshot(self.m, live) == before
        assert self.m.take_copies() == [] and self.m.take_events() == []

    # ------------------------------------------------------------ invariants

    @invariant()
    def consistent(self):
        if self.m is None:
            return
        m, bs = self.m, self.bs
        m.check_invariants()
        refs = [0] * self.nb
        fill: dict[int, int] = {}
        for sid, tokens in self.model.items():
            n = len(tokens)
            table = m.block_table(sid)
            assert sid in m
            assert m.num_tokens(sid) == n
            assert list(m.tokens(sid)) == tokens
            assert len(table) == math.ceil(n / bs)
            assert self.store.read(table, n) == tokens, f"KV content of {sid} is wrong"
            for i, b in enumerate(table):
                refs[b] += 1
                f = min(bs, n - i * bs)
                assert fill.setdefault(b, f) == f, "holders of a block disagree on its fill"
        assert [m.refcount(b) for b in range(self.nb)] == refs
        # the kernel exports agree with the tables (any order of sequences)
        ids = self.live()[::-1]
        tables = [m.block_table(s) for s in ids]
        width = max(map(len, tables), default=0)
        bt = m.block_tables(ids)
        assert bt.dtype == "int32" and bt.shape == (len(ids), width)
        assert bt.tolist() == [t + [-1] * (width - len(t)) for t in tables]
        indptr, indices, last = m.flashinfer_layout(ids)
        assert indptr.tolist() == [0] + list(itertools.accumulate(map(len, tables)))
        assert indices.tolist() == [b for t in tables for b in t]
        assert last.tolist() == [(len(self.model[s]) - 1) % bs + 1 for s in ids]
        used = sum(1 for r in refs if r)
        u = m.usage()
        assert (u.num_blocks, u.block_size) == (self.nb, bs)
        assert u.num_sequences == m.num_sequences == len(self.model)
        assert u.logical_tokens == sum(len(t) for t in self.model.values())
        assert u.stored_tokens == sum(fill.values())
        assert u.used_blocks == used
        assert u.allocated_slots == used * bs
        if used:
            assert abs(u.internal_fragmentation - (1 - u.stored_tokens / (used * bs))) < 1e-9
        assert u.blocks_saved_by_sharing == sum(
            math.ceil(len(t) / bs) for t in self.model.values()
        ) - used
        assert u.free_blocks + u.cached_blocks == m.num_free_blocks == self.nb - used
        assert (u.prefix_query_tokens, u.prefix_hit_tokens) == (self.n_query, self.n_hit)
        assert (u.cow_copies, u.forks) == (self.n_cow, self.n_forks)
        if not self.caching:
            assert u.cached_blocks == 0
        if self.events:
            assert u.evictions == self.n_removed
            assert len(self.router) >= u.cached_blocks
        note(f"live={ {s: len(t) for s, t in self.model.items()} } usage={u}")


class Sha256Machine(ManagerMachine):
    algo = "sha256"


class BuiltinMachine(ManagerMachine):
    algo = "builtin"


# The backbone gets more examples than the profile's default (inherits everything else).
STATEFUL_SETTINGS = settings(max_examples=STATEFUL_FACTOR * settings().max_examples)

TestStatefulSha256 = Sha256Machine.TestCase
TestStatefulSha256.settings = STATEFUL_SETTINGS
TestStatefulBuiltin = BuiltinMachine.TestCase
TestStatefulBuiltin.settings = STATEFUL_SETTINGS

if HAVE_XXHASH:

    class Xxh3Machine(ManagerMachine):
        algo = "xxh3"

    TestStatefulXxh3 = Xxh3Machine.TestCase
    TestStatefulXxh3.settings = STATEFUL_SETTINGS
