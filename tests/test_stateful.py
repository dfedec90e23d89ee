"""The backbone: a hypothesis state machine driving KVCacheManager the way an engine does.

It interleaves admissions (prompts from a small vocabulary built on shared prefixes, so prefix hits
really happen, with random salts), single/multi/batch appends, forks, frees, cache resets, bad
calls and running out of blocks (pools of 8-40 blocks, block sizes 1-5) and, with contract v2
(``ManagerMachine.V2``), side-effect-free lookups before admissions, chunked admissions
(``prefill=k``) and ``prefill`` chunks, speculative drafts and ``accept``, and pickle round trips.

Engine steps are modelled honestly. A step is a group of calls; at its end ``take_copies()`` is
drained once and run as ONE batched copy (every source read before any destination is written:
the list must name no destination twice and no destination that is also a source), then the
step's K/V writes land. Forks and ``accept`` happen between steps (after the writes: the fork
rule, and verification has computed the drafts). Frees happen mid-step too, which is the hazard
the batch rules exist for: a sequence that scheduled work in this step and is dropped before it
was computed is freed with ``cache=False`` before any later admission (its writes never land).

Beside the manager it keeps

* a reference model: sequence id -> token list, salt, positions scheduled for compute
  (``num_computed``), pending drafts;
* a simulated KV store of *provenance*: each physical slot holds the identity of what was
  computed there (salt and the whole token prefix up to that position, interned in a trie), or
  nothing. A block handed out fresh loses its content at the step's end, so a slot can only
  hold what some step really computed into it;
* a router's view of the prefix cache built only from the events.

Checked after every call (mid-step included, against the store as the step's batch will leave
it): ``check_invariants()``; each live sequence's scheduled positions read back through its
block table hold exactly its tokens under its salt; refcounts equal table references; every
``usage()`` number matches its definition over scheduled positions; block_tables /
flashinfer_layout agree with the tables. A prefix hit (and ``lookup``, which must equal the
admission that follows it) may only map computed slots holding exactly the prompt's prefix
under the same salt, and (events on) is exactly the longest run of the prompt's blocks the
router's view says are cached, capped below the whole prompt. Every published block is one the
call completed (all its positions scheduled, none a pending draft). Any ``OutOfBlocks`` and any
refused call leave a byte-identical snapshot behind. Freed ids are reused.

With a host tier (drawn at setup for a share of the examples: 1 to 2 times the device pool,
write-back or write-through, on smaller device pools so that evictions happen) the machine also
swaps sequences out and back in, in the same step as admissions and appends (``swap_out`` is
legal only for a sequence given no positions since the last drain; attempts on one that was,
without a host tier, or out of host blocks must fail and change nothing, the host tier
included), and the store has host slots. A
step's drain is then ``take_transfers()`` first (the ``to_host`` batch: every source read before
any destination is written; then the ``to_device`` batch likewise), then ``take_copies()``, then
the writes; every drain must list ``to_host`` entries first and no destination twice in one
direction. Transfers not drained yet are read off a pickled twin, so the checks between drains
see the store as the step will leave it. Beside the device checks above it checks: a swapped-out
sequence's host-resident positions read back from the host slots its host blocks name; a hit
that continues on the host is exactly the run the router's host view holds (``PrefixHit.device``
and ``.host`` apart); every hash the host publishes arrives with a ``to_host`` transfer of that
step holding exactly the tokens the hash names under its salt, and its host block keeps them
while it stays published; a host block evicted there is the destination of a transfer of that
step; a device eviction is offloaded unless the host holds the hash or has no block to spare;
write-through copies a block out exactly one drain late (never at the drain right after it was
published, always at the next one while the host has room), write-back never at a drain; and
``usage()``'s host fields (blocks held, swapped sequences, host hits, transfers each way); no
``to_host`` transfer reads a device slot never written (a swapped partial block's empty tail
aside); and, after every call, every host block is reachable in the router's view (its parent on
either medium, or a salt's root), every ``BlockStored`` on the host names a parent the router
knows at that event, and a host block removed without being reused is one whose parent left both
tiers.

``test_seeded_soak_of_the_host_tier`` is the same class of checks without hypothesis: a seeded
engine loop over every write policy, both fast hashes and caching on and off, with a store that
records which chain position was written into which device and host slot.

``V2 = False`` drives only the v1 calls, one call per step, so the machine runs against a
manager without contract v2 (and without a host tier).
"""
from __future__ import annotations

import functools
import itertools
import math
import os
import pickle
import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import Phase, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedkv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CopyOp,
    KVCacheManager,
    OutOfBlocks,
)
from conftest import STATEFUL_FACTOR, snapshot, snapshot_v2, stored_blocks, stored_keys

VOCAB = 4
_rng = random.Random(1234)
PREFIXES = [[_rng.randrange(VOCAB) for _ in range(24)] for _ in range(3)]
TOKEN = st.sampled_from([0, 1, 2, 3, 0, 1, 2, 3, 2**32 - 1])
SALTS = st.sampled_from([None, None, None, "a", "b"])


class StepStore:
    """The physical KV store of a simulated engine, one step at a time: device slots and, with a
    host tier, host slots.

    ``prov[slot]`` (``hprov`` on the host) is the id of what was computed into the slot (-1:
    nothing). During a step the machine records the copies it expects, the blocks handed out
    fresh and the writes each sequence scheduled; ``view(copies, transfers)`` is the store as the
    end of the step will leave it: the ``to_host`` batch (reading the device as the last step
    left it), the copies' sources read, fresh blocks emptied, the ``to_device`` batch, the
    copies written, then the step's writes. A copy reads its source before any load lands: the
    drain checks that no load fills a block a copy reads, so the two orders agree.
    """

    def __init__(self, num_blocks: int, block_size: int, host_blocks: int = 0) -> None:
        self.bs = block_size
        self.prov = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.hprov = np.full(host_blocks * block_size, -1, dtype=np.int64)
        self.copies: list[CopyOp] = []
        self.fresh: set[int] = set()
        self.writes: dict = {}  # seq id -> [(slots, provenance ids)]

    def slots_of(self, table, start: int, stop: int) -> np.ndarray:
        pos = np.arange(start, stop, dtype=np.int64)
        tab = np.asarray(table, dtype=np.int64)
        return tab[pos // self.bs] * self.bs + pos % self.bs

    def block(self, prov, b: int) -> np.ndarray:
        return prov[b * self.bs : (b + 1) * self.bs]

    def view(self, copies=None, transfers=()) -> tuple[np.ndarray, np.ndarray]:
        bs, prov, hprov = self.bs, self.prov.copy(), self.hprov.copy()
        copies = self.copies if copies is None else copies
        out = [t for t in transfers if t.direction == "to_host"]
        into = [t for t in transfers if t.direction == "to_device"]
        for t, data in [(t, self.block(prov, t.src).copy()) for t in out]:
            hprov[t.dst * bs : (t.dst + 1) * bs] = data
        sources = [self.block(prov, c.src).copy() for c in copies]
        for b in self.fresh:
            prov[b * bs : (b + 1) * bs] = -1
        for t, data in [(t, self.block(hprov, t.src).copy()) for t in into]:
            prov[t.dst * bs : (t.dst + 1) * bs] = data
        for c, data in zip(copies, sources):
            prov[c.dst * bs : (c.dst + 1) * bs] = data
        for writes in self.writes.values():
            for slots, ids in writes:
                prov[slots] = ids
        return prov, hprov

    def commit(self, copies, transfers=()) -> None:
        slots = [s for writes in self.writes.values() for s, _ in writes]
        if slots:
            flat = np.concatenate(slots)
            assert len(np.unique(flat)) == len(flat), "two writes to one slot in one step"
        self.prov, self.hprov = self.view(copies, transfers)
        self.copies, self.fresh, self.writes = [], set(), {}


def op(fn):
    """A rule is one call of the engine; without contract v2 every call is its own step."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        if not self.V2:
            self.end_step()
        return out

    return wrapper


class ManagerMachine(RuleBasedStateMachine):
    algo = "sha256"
    V2 = True  # contract v2 calls and multi-call steps; False: v1 calls only, one per step
    TIERS = True  # with V2: a share of the examples get a host tier

    def __init__(self):
        super().__init__()
        self.m = None

    # ------------------------------------------------------------ setup

    @initialize(
        nb=st.integers(8, 40),
        bs=st.integers(1, 5),
        caching=st.sampled_from([True, True, True, False]),
        events=st.sampled_from([True, True, True, False]),
        policy=st.sampled_from([None, None, None, "write-back", "write-through"]),
        host_extra=st.integers(0, 40),
    )
    def setup(self, nb, bs, caching, events, policy, host_extra):
        if not (self.V2 and self.TIERS):
            policy = None
        if policy is not None:  # a host tier of 1..2x a smaller device pool: evictions happen
            nb = 8 + (nb - 8) // 3
        self.hb = 0 if policy is None else nb + host_extra % (nb + 1)
        self.policy = policy
        self.nb, self.bs, self.caching, self.events = nb, bs, caching, events
        tier = {} if policy is None else {"host_blocks": self.hb, "host_write_policy": policy}
        self.m = KVCacheManager(
            num_blocks=nb,
            block_size=bs,
            enable_prefix_caching=caching,
            hash_algo=self.algo,
            enable_events=events,
            **tier,
        )
        event(f"host tier: {policy}")
        self.store = StepStore(nb, bs, self.hb)
        self.model: dict[int, list[int]] = {}
        self.salt: dict[int, object] = {}
        self.nc: dict[int, int] = {}  # positions scheduled for compute (num_computed)
        self.drafts: dict[int, int] = {}  # pending speculative tokens (the tail of the model)
        self.written: dict[int, int] = {}  # leading blocks computed before it was scheduled
        self.nodes: dict[int, list[int]] = {}  # provenance id of each position
        self.trie: dict = {}  # (parent id, token) or ("salt", salt) -> provenance id
        self.admissions = 0  # admissions in the current step
        self.first_write: dict = {}  # seq id -> admissions counted when it first wrote this step
        self.up: dict[int, int] = {}  # provenance id -> the id of the position before it
        self.router: set = set()  # hashes the events say are in the device's cache ("GPU")
        self.router_cpu: set = set()  # ... and in the host tier's ("CPU")
        self.known: set = set()  # every block hash ever published
        self.parent_of: dict = {}  # block hash -> the hash it chains from, learnt from events
        self.chain: dict = {}  # (parent hash, block tokens, extra keys) -> hash, learnt from events
        self.root = None  # the one hash every first block is chained from, learnt from events
        self.hash_node: dict = {}  # hash -> provenance id of its block's last position
        self.next_id = 0
        self.freed_ids: list[int] = []
        self.n_forks = self.n_cow = self.n_query = self.n_hit = self.n_removed = 0
        # the host tier
        self.swapped: dict = {}  # swapped-out seq id -> {table index: host block}
        self.swap_moves: list = []  # (device block, host block) swap_out queued this step
        self.swapped_now: set = set()  # device blocks the last drain swapped out
        self.loading: set = set()  # sequences whose blocks a to_device of this step fills
        self.host_of: dict = {}  # published host hash -> the host block holding it
        self.cpu_new: list = []  # hashes the host published since the last drain
        self.host_evicted: list = []  # host blocks whose hash was evicted since the last drain
        self.wt_new: dict = {}  # hashes the device published since the last drain -> still valid
        self.wt_ready: dict = {}  # ... since the drain before (write-through copies them now)
        self.wt_late: set = set()  # due hashes a twin took over: copied out later (from the twin)
        self.twins_seen = False  # a completed block was not published: its hash was mapped already
        self.drained = [0, 0]  # transfers drained so far: to_host, to_device
        self.history: list = []  # (computed tokens, salt) of the last sequences freed
        self.n_host_hit = 0

    # ------------------------------------------------------------ helpers

    def live(self):
        return sorted(self.model)

    def new_id(self):
        """A fresh id, or every other time one that was freed (ids are reused by engines)."""
        self.next_id += 1
        if self.freed_ids and self.next_id % 2:
            return self.freed_ids.pop(0)
        return self.next_id

    def snap(self):
        live = self.live()
        return snapshot_v2(self.m, live) if self.V2 else snapshot(self.m, live)

    def free_order(self, m=None, blob=None):
        """The order in which the next allocations would take the free blocks (clean ones
        LIFO, never-used ones, then the cached-free LRU oldest first): one admission that takes
        them all, run on a pickled copy (of ``m``, or unpickled from ``blob``). It makes the LRU
        order observable."""
        probe = pickle.loads(blob or pickle.dumps(self.m if m is None else m))
        free = probe.num_free_blocks
        if not free:
            return []
        probe.add_sequence("probe", [7] * (free * self.bs), cache_salt="probe")  # hits nothing
        return probe.block_table("probe")

    def host_order(self, probe):
        """The transfers the manager ``probe`` (a copy: the probe changes it) has pending, then
        the order in which its host tier would hand out free blocks, as far as a probe can see
        it: once they are drained, a sequence of as many blocks as the device has clean (so
        that admitting it evicts nothing) is swapped out."""
        pending = probe.take_transfers()
        k = min(probe.usage().free_blocks, probe.num_free_host_blocks)
        if not k:
            return pending, []
        probe.add_sequence("host probe", [7] * (k * self.bs), cache_salt="probe")
        probe.take_transfers()  # the probe's step runs: swap_out refuses a sequence before that
        probe.swap_out("host probe")
        return pending, [t.dst for t in probe.take_transfers()]

    def host_counts(self):
        """The host tier's part of a snapshot that needs no probe: free blocks and each
        sequence's swapped blocks (``usage()``, in the snapshot, has the rest)."""
        if not self.hb:
            return None
        return self.m.num_free_host_blocks, [self.m.num_swapped_blocks(s) for s in self.live()]

    def state(self):
        """What a call that must change nothing is compared on: the snapshot (with a host tier,
        its part too) and, with v2 (a manager pickles), the free list and LRU order of each
        tier and the pending transfers."""
        return self.snap(), self.host_counts(), (pickle.dumps(self.m) if self.V2 else None)

    def assert_state(self, before, what, host_probe=True):
        snap, host, blob = before
        assert self.snap() == snap, f"{what} changed the manager"
        assert self.host_counts() == host, f"{what} changed the host tier"
        if blob is not None:
            now = pickle.dumps(self.m)
            assert self.free_order(blob=blob) == self.free_order(blob=now), (
                f"{what} changed the free list or the LRU order")
            if self.hb and host_probe:
                assert self.host_order(pickle.loads(blob)) == self.host_order(pickle.loads(now)), (
                    f"{what} changed the pending transfers, or the host's free list or LRU order")

    def pick(self, data, label, ok):
        """A live sequence, three times in four one for which ``ok`` holds (if any): calls the
        contract refuses are drawn, but do not crowd out the ones that run."""
        live = self.live()
        good = [s for s in live if ok(s)]
        if good and len(good) < len(live) and data.draw(st.integers(0, 3), label=f"{label}_ok"):
            live = good
        return data.draw(st.sampled_from(live), label=label)

    def blocked(self, sid, speculative=False):
        """Whether v2 refuses an append (or a fork) on ``sid``: its prompt is not fully
        scheduled, or (for anything but more drafts) drafts are pending."""
        if not self.V2:
            return False
        if sid in self.swapped:
            return True
        return self.nc[sid] < len(self.model[sid]) or (self.drafts[sid] > 0 and not speculative)

    def extend_nodes(self, sid, tokens):
        nodes, trie = self.nodes[sid], self.trie
        parent = nodes[-1] if nodes else trie.setdefault(("salt", self.salt[sid]), len(trie))
        for t in tokens:
            node = trie.setdefault((parent, t), len(trie))
            self.up.setdefault(node, parent)
            nodes.append(node)
            parent = node

    def block_nodes(self, node):
        """The provenance ids of a full block's positions, given its last one."""
        out = [node]
        for _ in range(self.bs - 1):
            out.append(self.up[out[-1]])
        return out[::-1]

    def schedule(self, sid, table, start, stop):
        """The engine computes positions ``start..stop`` of ``sid`` in this step."""
        slots = self.store.slots_of(table, start, stop)
        if stop > start:
            ids = np.asarray(self.nodes[sid][start:stop], dtype=np.int64)
            self.store.writes.setdefault(sid, []).append((slots, ids))
            self.first_write.setdefault(sid, self.admissions)
        return slots

    def queue_copy(self, src, dst):
        """Model of the pending copy list: what take_copies must return at the step's end."""
        pending = self.store.copies
        assert dst not in {c.src for c in pending}, "a pending copy's source became a destination"
        assert dst not in {c.dst for c in pending}, "a pending copy's destination was taken again"
        for c in pending:
            if c.dst == src:  # a copy of a block the batch itself fills: read the original
                src = c.src
                break
        pending.append(CopyOp(src, dst))

    def peek_transfers(self, u=None):
        """The transfers queued so far in this step, read off a pickled copy (the manager's own
        list is drained only at the step's end). Nothing is queued unless the counters moved
        since the last drain. Write-through's copies are made at the drain itself, after the
        to_host entries queued before it (the drain checks that order): the copy's drain would
        list them too, and they are left out."""
        if not self.hb:
            return []
        u = self.m.usage() if u is None else u
        if [u.transfers_to_host, u.transfers_to_device] == self.drained:
            return []
        out = pickle.loads(pickle.dumps(self.m)).take_transfers()
        queued = u.transfers_to_host - self.drained[0]
        return [t for t in out if t.direction == "to_host"][:queued] + [
            t for t in out if t.direction == "to_device"]

    def end_step(self):
        """The step's end: drain the transfers (the to_host batch, then the to_device batch),
        then the copies, each run as one batch, then land the writes."""
        if self.m is None:
            return
        transfers, host_free = [], self.m.num_free_host_blocks if self.hb else 0
        if self.hb:
            queued = self.peek_transfers() if self.policy == "write-through" else None
            transfers = self.m.take_transfers()
            if queued:  # write-through's copies come after what the step queued
                ahead = [t for t in queued if t.direction == "to_host"]
                assert transfers[: len(ahead)] == ahead, "write-through's copies come last"
            self.check_transfers(transfers)
        elif self.V2:
            assert self.m.take_transfers() == []
        copies = self.m.take_copies()
        dsts = [c.dst for c in copies]
        assert len(set(dsts)) == len(dsts), f"a destination twice in one batch: {copies}"
        assert not set(dsts) & {c.src for c in copies}, f"a destination is also a source: {copies}"
        assert sorted(copies) == sorted(self.store.copies), (copies, self.store.copies)
        loads = {t.dst for t in transfers if t.direction == "to_device"}
        assert not loads & {c.src for c in copies}, "a load fills a block a copy reads"
        assert not loads & set(dsts), "a load fills a copy's destination"
        if len(copies) > 1:
            event("several copies in one batch")
        self.check_host_reads(transfers)
        self.store.commit(copies, transfers)
        self.admissions = 0
        self.first_write = {}
        self.loading = set()
        if self.hb:
            self.after_drain(transfers, host_free)

    def check_transfers(self, transfers):
        """The batch rules: every to_host entry before every to_device entry, each direction
        naming no destination twice, ids in range on either side."""
        from pagedkv import Transfer  # contract v2 (the machine runs without it when V2 is off)

        assert all(isinstance(t, Transfer) for t in transfers)
        dirs = [t.direction for t in transfers]
        k = dirs.count("to_host")
        assert dirs == ["to_host"] * k + ["to_device"] * (len(dirs) - k), f"to_host first: {dirs}"
        for batch, (src_n, dst_n) in ((transfers[:k], (self.nb, self.hb)),
                                      (transfers[k:], (self.hb, self.nb))):
            dsts = [t.dst for t in batch]
            assert len(set(dsts)) == len(dsts), f"a destination twice in one direction: {batch}"
            assert all(0 <= t.src < src_n and 0 <= t.dst < dst_n for t in batch), batch
        for d, h in self.swap_moves:  # every block swap_out moved is in this drain
            assert Transfer("to_host", d, h) in transfers[:k], f"swap_out's {d} -> {h} is missing"
        self.swapped_now = {d for d, _ in self.swap_moves}  # for check_host_reads
        self.swap_moves = []
        self.drained[0] += k
        self.drained[1] += len(transfers) - k
        if k and k < len(transfers):
            event("both directions in one drain")

    def check_host_reads(self, transfers):
        """No ``to_host`` transfer reads a device slot never written: it reads the device as
        the last step left it, and its source block's written slots are a prefix of the block
        (a swapped partial block's empty tail is the only unwritten part), the whole block for
        an offload or a write-through copy (a full, published block)."""
        swapped = self.swapped_now
        for t in transfers:
            if t.direction != "to_host":
                continue
            written = self.store.block(self.store.prov, t.src) >= 0
            w = int(written.sum())
            assert w and written[:w].all(), f"to_host reads device block {t.src}: slots never written"
            assert t.src in swapped or w == self.bs, "an offload reads a block not wholly written"

    def after_drain(self, transfers, host_free):
        """What a drain leaves on the host: its own events (write-through's copies, the host
        evictions they cause), each hash published since the last drain in the block a transfer
        of this step filled with exactly its tokens, and the host's counts."""
        hprov = self.store.hprov
        before = set(self.router_cpu)
        at_drain = self.drain_events()
        if self.caching and self.events:
            if self.policy == "write-through":
                # a twin that took over a hash (no event says so) is copied two drains later
                # than the block it replaced: once twins exist, a due hash still on the device
                # may come late, never early
                late = self.wt_late
                assert set(at_drain) <= set(self.wt_ready) | late, "write-through copied a block out early"
                due = {h for h, ok in self.wt_ready.items() if ok and h not in before}
                if self.twins_seen:
                    late |= {h for h in due - set(at_drain) if h in self.router}
                    due = {h for h in due if h not in late}
                late.difference_update(at_drain)
                late.intersection_update(self.router)
                if any(map(self.unknown_parent, due)):  # a device orphan is never copied out
                    event("write-through skipped a device block whose parent left both tiers")
                    due = {h for h in due if not self.unknown_parent(h)}
                assert len(at_drain) == host_free or due <= set(at_drain), (
                    "write-through left a block published two drains ago on the device only")
                if at_drain:
                    event("write-through copied blocks out")
            else:
                assert not at_drain, "write-back copied a block out at a drain"
        self.wt_ready, self.wt_new = self.wt_new, {}
        written = {t.dst: tuple(self.store.block(hprov, t.dst)) for t in transfers
                   if t.direction == "to_host"}
        for h in self.cpu_new:
            node = self.hash_node.get(h)
            if h not in self.router_cpu or node is None:
                continue
            want = tuple(self.block_nodes(node))
            found = [b for b, data in written.items() if data == want]
            assert found, "the host published a hash; no transfer of the step brought its tokens"
            if len(found) == 1:
                self.host_of[h] = found[0]
            else:
                self.host_of.pop(h, None)
        self.cpu_new = []
        assert set(self.host_evicted) <= set(written), "an evicted host block was left unused"
        self.host_evicted = []
        assert len(set(self.host_of.values())) == len(self.host_of), "one host block, two hashes"
        for h, b in self.host_of.items():
            want = self.block_nodes(self.hash_node[h])
            assert self.store.block(hprov, b).tolist() == want, (
                "a host block published under a hash does not hold the tokens it names")
        u = self.m.usage()
        assert [u.transfers_to_host, u.transfers_to_device] == self.drained
        held = sum(len(pos) for pos in self.swapped.values())
        assert u.host_used_blocks == held, "host blocks held by nothing but swapped sequences"
        assert self.m.num_free_host_blocks == self.hb - held
        if self.caching and self.events:
            published_held = {h for h, b in self.host_of.items()
                              if any(b in pos.values() for pos in self.swapped.values())}
            assert u.host_cached_blocks + len(published_held) <= len(self.router_cpu)
            assert len(self.router_cpu) <= u.host_cached_blocks + u.host_used_blocks

    def attempt(self, fn, host=False):
        """Run an allocating call; on OutOfBlocks check that nothing changed (``host``: the
        call may run out of host blocks instead)."""
        before = self.state()
        try:
            return True, fn()
        except OutOfBlocks as e:
            event("OutOfBlocks")
            assert e.needed > e.available >= 0, (e.needed, e.available)
            room = max(self.m.num_free_blocks, self.m.num_free_host_blocks) if host else (
                self.m.num_free_blocks)
            assert e.available <= room
            self.assert_state(before, "a failed call")
            assert self.m.take_events() == []
            return False, None

    def refused(self, fn, exc=ValueError):
        """A call the contract refuses: the error, and nothing changed."""
        before = self.state()
        try:
            fn()
        except exc:
            pass
        else:
            raise AssertionError(f"expected {exc.__name__}")
        self.assert_state(before, "a refused call")
        assert self.m.take_events() == []

    def drain_events(self, completed=(), allow_clear=False, evicting=True, host_released=0):
        """Apply the call's events to the router's views, one per medium; returns the hashes
        the host published.

        ``completed`` lists ``(seq id, block index)`` for every block the call completed (all
        its positions scheduled, none a pending draft) or loaded from the host: each block the
        device publishes must be one of them, chained from the salt's root exactly when it is a
        block 0. The host publishes only blocks the device published before; with ``evicting``
        (the device's removals are evictions, not an uncached free), each evicted hash is on
        the host afterwards unless the host had no block to spare (``host_released``: host
        blocks the call let go of after its evictions)."""
        evs = self.m.take_events()
        if not self.events:
            assert evs == []
            return []
        bs = self.bs
        cands = [(sid, i, tuple(self.model[sid][i * bs : (i + 1) * bs])) for sid, i in completed]
        evicted, host_stored = set(), []  # evicted: not on the host when the device let go
        dropped = 0  # host blocks dropped because their parent left both tiers
        orphans = set()  # hashes the device let go of while their parent was on neither tier
        left_device = set()
        # a router drops a block whose parent it does not know at that event (on either
        # medium): a parent the host is about to publish must not come after its child (one
        # eviction batch lists the child first), nor may it have been removed earlier in the
        # same events; a parent known on the device is enough
        for ev in evs:
            if isinstance(ev, BlockStored) and ev.medium == "CPU":
                assert self.caching and self.hb and ev.block_size == bs
                p = ev.parent_block_hash
                # a parent the router knows now: on either medium (stored earlier in these
                # events, and not removed since), or the chain's root (no block's hash)
                assert p in self.router or p in self.router_cpu or p not in self.known, (
                    "the host published a block whose parent the router does not know")
                for (h, parent, blk), (_, _, extra) in zip(stored_blocks([ev]), stored_keys([ev])):
                    assert h not in self.router_cpu, "the host published a hash it holds"
                    assert self.chain.get((parent, blk, extra)) == h, (
                        "the host published a block the device never did")
                    self.router_cpu.add(h)
                    self.cpu_new.append(h)
                    host_stored.append(h)
                    if h in evicted:
                        event("eviction offloaded")
                        evicted.discard(h)
            elif isinstance(ev, BlockStored):
                assert self.caching and ev.medium == "GPU"
                assert ev.block_size == bs
                for (h, parent, blk), (_, _, extra) in zip(stored_blocks([ev]), stored_keys([ev])):
                    assert h not in self.router, "published a hash the cache already holds"
                    assert len(blk) == bs
                    root = parent not in self.known
                    match = [c for c in cands if c[2] == blk and (c[1] == 0) == root
                             and self.extra(self.salt[c[0]], c[1]) == extra]
                    assert match, f"published {blk} (root={root}, keys {extra}), not a block this call completed"
                    cands.remove(match[0])
                    if root:
                        self.learn_root(parent)
                    prev = self.chain.setdefault((parent, blk, extra), h)
                    assert prev == h, "the same (parent, tokens, extra keys) hashed differently"
                    self.learn_node(h, parent, blk, extra)
                    self.known.add(h)
                    self.parent_of[h] = parent
                    self.router.add(h)
                    self.wt_new[h] = True
            elif isinstance(ev, BlockRemoved) and ev.medium == "CPU":
                assert self.hb
                event("host eviction")
                for h in ev.block_hashes:
                    assert h in self.router_cpu, "the host removed a hash it never stored"
                    self.router_cpu.remove(h)
                    if h in left_device:
                        event("a hash left the device, then the host, in one call")
                    p = self.parent_of.get(h)
                    if self.unknown_parent(h):
                        # its parent left both tiers: dropped with it (not evicted for room)
                        event("host dropped a block whose parent left both tiers")
                        self.host_of.pop(h, None)
                        dropped += 1
                    elif h in self.host_of:
                        self.host_evicted.append(self.host_of.pop(h))
            elif isinstance(ev, BlockRemoved):
                assert ev.medium == "GPU"
                event("eviction")
                for h in ev.block_hashes:
                    assert h in self.router, "removed a hash that was never stored"
                    self.router.remove(h)
                    self.n_removed += 1
                    left_device.add(h)
                    if h not in self.router_cpu:
                        evicted.add(h)
                for h in ev.block_hashes:  # once the whole removal is applied
                    if self.unknown_parent(h):
                        orphans.add(h)
                    for pending in (self.wt_new, self.wt_ready):
                        if h in pending:
                            pending[h] = False
            else:
                assert isinstance(ev, AllBlocksCleared) and allow_clear
                self.router.clear()
                self.router_cpu.clear()
                self.host_of = {}
                self.wt_new = dict.fromkeys(self.wt_new, False)
                self.wt_ready = dict.fromkeys(self.wt_ready, False)
        # every host block is reachable: its parent is on either medium or is a salt's root
        for h in self.router_cpu:
            p = self.parent_of.get(h)
            assert p is None or p not in self.known or p in self.router or p in self.router_cpu, (
                "a host block is unreachable: its parent is on neither tier")
        if any(map(self.unknown_parent, self.router)):
            event("a device block outlives its parent on both tiers (an orphan twin's child)")
        # and each completed block is published now unless its content was published before
        # (then the cache already maps it): a block whose chain hash the events never named is
        # missing from the cache
        for sid, i in completed:
            parent = self.chain_parent(sid, i)
            blk = tuple(self.model[sid][i * bs : (i + 1) * bs])
            assert parent is None or (parent, blk, self.extra(self.salt[sid], i)) in self.chain, (
                f"block {i} of {sid} is complete but was never published")
        if cands:  # completed, not published: the map held the hash already (a twin)
            self.twins_seen = True
        # an evicted block whose parent is now on neither tier is never copied out: the host
        # would hold a block no lookup and no router can reach
        # (at its removal: the same call may publish the parent on the device later)
        if orphans & evicted:
            event("an evicted orphan was not offloaded")
            evicted -= orphans
        if self.hb and self.caching and evicting and evicted and self.policy != "none":
            event("eviction forgotten: no host block to spare")
            # a free host block that holds a hash this call evicted from the device, or an
            # ancestor on the host of one, was held through the offload's host allocation (the
            # first: its copy is the only one left; the second: its child needs it), and a
            # block dropped with its parent came free after it: not room
            held = left_device & self.router_cpu
            for h in left_device:
                p = self.parent_of.get(h)
                while p in self.router_cpu and p not in self.router and p not in held:
                    held.add(p)
                    p = self.parent_of.get(p)
            assert self.m.num_free_host_blocks <= host_released + len(held) + dropped, (
                "an evicted block was not offloaded although the host had room")
        return host_stored

    def unknown_parent(self, h):
        """Whether the block ``h`` names chains from a block hash that neither tier holds now
        (a salt's root, which no event names as a block, is always known)."""
        p = self.parent_of.get(h)
        return p in self.known and p not in self.router and p not in self.router_cpu

    def assert_published(self, sid, blocks):
        """Each of these full blocks of ``sid`` is findable on the device (as the router sees
        it), where the events taught its hash."""
        if not (self.caching and self.events):
            return
        for i in blocks:
            parent = self.chain_parent(sid, i)
            blk = tuple(self.model[sid][i * self.bs : (i + 1) * self.bs])
            h = self.chain.get((parent, blk, self.extra(self.salt[sid], i)))
            assert h is None or h in self.router, f"block {i} of {sid} is not findable on the device"

    def learn_node(self, h, parent, blk, extra):
        """The provenance id of the last position of the block ``h`` names, from its parent's
        (or, for a block 0, the root and the salt its extra keys carry) and its tokens."""
        node = self.hash_node.get(parent)
        if node is None and parent == self.root:
            node = self.trie.get(("salt", extra[0] if extra else None))
        for t in blk:
            if node is None:
                return
            node = self.trie.get((node, t))
        if node is not None:
            self.hash_node[h] = node

    def chain_parent(self, sid, i):
        """The hash block ``i`` of ``sid`` chains from, as the events taught it; None if unknown."""
        bs, tokens, salt = self.bs, self.model[sid], self.salt[sid]
        parent = self.root
        for j in range(i):
            if parent is None:
                return None
            parent = self.chain.get((parent, tuple(tokens[j * bs : (j + 1) * bs]), self.extra(salt, j)))
        return parent

    @staticmethod
    def extra(salt, i):
        """The extra keys the events carry for block ``i`` of a prompt salted ``salt`` (vLLM's
        form): the salt in block 0's entry, no entry elsewhere (the chain carries it on)."""
        return (salt,) if i == 0 and salt is not None else None

    def learn_root(self, root):
        """Every first block is chained from one root, salted or not (the salt is a key of the
        block, as in vLLM): two roots would mean a salt had become a root again."""
        if self.root is None:
            self.root = root
        assert self.root == root, "two first blocks chained from different roots"

    def expected_hit(self, prompt, salt):
        """The longest run of the prompt's full blocks whose hashes the device's cache holds,
        then the run continuing it that the host's holds (as the router sees them), never the
        whole prompt: ``(device tokens, host tokens)``; None where events cannot tell."""
        if not (self.caching and self.events):
            return None
        bs, cap = self.bs, (len(prompt) - 1) // self.bs
        parent, k = self.root, 0
        if parent is None:  # no first block was ever published
            return 0, 0
        runs = []
        for router in (self.router, self.router_cpu):
            start = k
            while k < cap:
                h = self.chain.get((parent, tuple(prompt[k * bs : (k + 1) * bs]), self.extra(salt, k)))
                if h is None or h not in router:
                    break
                parent, k = h, k + 1
            runs.append((k - start) * bs)
        return tuple(runs)

    def expect_extend(self, sid, old_table, old_n, k, rc, new_table):
        """Check the table after appending ``k`` tokens; queue the copy it implies and mark the
        blocks it took as fresh. ``rc`` is a mutable refcount map as seen by this sequence's
        turn in the call. Returns the number of copies."""
        bs = self.bs
        new_n = old_n + k
        assert len(new_table) == math.ceil(new_n / bs)
        full = old_n // bs
        assert new_table[:full] == old_table[:full], "full blocks must never move"
        copies = 0
        if old_n % bs:
            last = old_table[-1]
            if rc[last] > 1:  # shared partial block: copy-on-write
                dst = new_table[full]
                assert dst != last
                self.queue_copy(last, dst)
                copies = 1
                rc[last] -= 1
                fresh = new_table[full:]
            else:
                assert new_table[full] == last, "the last holder writes in place"
                fresh = new_table[full + 1 :]
        else:
            fresh = new_table[full:]
        for b in fresh:
            assert rc.get(b, 0) == 0, "a fresh block was still in use"
            rc[b] = 1
        self.store.fresh.update(fresh)
        return copies

    def draw_chunk(self, data):
        if not self.V2:
            return None
        return data.draw(st.one_of(st.none(), st.integers(0, 3 * self.bs)), label="prefill")

    # ------------------------------------------------------------ admissions

    @rule(data=st.data())
    @op
    def add(self, data):
        bs = self.bs
        base = data.draw(st.sampled_from(PREFIXES), label="base")
        k = data.draw(st.integers(0, min(len(base), 4 * bs)), label="prefix_len")
        suffix = data.draw(st.lists(TOKEN, max_size=2 * bs), label="suffix")
        prompt = base[:k] + suffix or [0]
        salt = data.draw(SALTS, label="salt")
        self._add(prompt, salt, self.draw_chunk(data))

    @rule(data=st.data())
    @op
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
        self._add(tokens[:k] + suffix, salt, self.draw_chunk(data))

    @rule(data=st.data())
    @op
    def add_again(self, data):
        """A later turn of a conversation that ended: a prompt extending what a freed sequence
        held. Its blocks may be cached on the device, or evicted and offloaded to the host
        tier (a host hit), or gone."""
        if not self.history:
            return self.add(data)
        tokens, salt = data.draw(st.sampled_from(self.history), label="earlier")
        if not tokens:
            return self.add(data)
        k = data.draw(st.integers(1, len(tokens)), label="prefix_len")
        suffix = data.draw(st.lists(TOKEN, max_size=self.bs), label="suffix")
        self._add(tokens[:k] + suffix, salt, self.draw_chunk(data))

    @rule(data=st.data())
    @op
    def preempt(self, data):
        """Free a sequence and re-admit its tokens (recompute preemption): hits on the blocks it
        just released, revived from the cached-free LRU. Preemption happens between steps."""
        if not self.model:
            return self.add(data)
        sid = data.draw(st.sampled_from(self.live()), label="seq")
        if sid in self.store.writes or sid in self.loading:
            self.end_step()
        tokens, salt = self.model[sid], self.salt[sid]
        self._free(sid)
        self._add(list(tokens), salt, self.draw_chunk(data))

    def _add(self, prompt, salt, chunk=None):
        bs = self.bs
        sid = self.new_id()
        rc = [self.m.refcount(b) for b in range(self.nb)]
        want_hit = self.expected_hit(prompt, salt)
        looked = None
        if self.V2:
            before = self.state()
            looked = self.m.lookup(prompt, cache_salt=salt)
            # (the host's LRU order is probed when the lookup found blocks there)
            self.assert_state(before, "lookup", host_probe=bool(looked.host))
            assert self.m.take_events() == [], "lookup queued events"
        if looked is not None and looked.host:
            event("lookup: host hit")
        kw = {} if chunk is None else {"prefill": chunk}
        ok, hit = self.attempt(lambda: self.m.add_sequence(sid, prompt, cache_salt=salt, **kw))
        if not ok:
            assert sid not in self.m
            return
        device = hit
        if looked is not None:
            assert hit == looked, "lookup differs from the admission that follows it"
            device, host = looked.device, looked.host
            assert device + host == hit and device % bs == 0 and (host == 0 or self.hb)
        if want_hit is not None:
            assert (device, hit - device) == want_hit, "not the longest cached prefix"
            if hit:
                event("exact hit checked against the router's view")
        event(f"hit blocks: {hit // bs}")
        if hit > device:
            event("host hit" + (" after device hits" if device else ""))
        n = len(prompt)
        assert hit % bs == 0 and 0 <= hit <= (n - 1) // bs * bs
        if not self.caching:
            assert hit == 0
        nc = n if chunk is None else hit + min(chunk, n - hit)
        if chunk is not None:
            event("chunked admission" if nc < n else "chunked admission, whole prompt")
        table = self.m.block_table(sid)
        assert len(table) == math.ceil(nc / bs)
        if self.V2:
            assert (self.m.num_tokens(sid), self.m.num_computed(sid)) == (n, nc)
        self.model[sid], self.salt[sid], self.nc[sid], self.drafts[sid] = list(prompt), salt, nc, 0
        self.written[sid] = hit // bs  # computed before it was scheduled: free(cache=False) keeps them
        self.nodes[sid] = []
        self.extend_nodes(sid, prompt)
        # prefix hits: computed slots (or computed in this very step) holding exactly this
        # prompt's prefix under this salt
        # (a host hit's blocks once the step's loads have run)
        pending = self.peek_transfers()
        held = self.store.view(transfers=pending)[0][self.store.slots_of(table, 0, hit)].tolist()
        assert held == self.nodes[sid][:hit], "a hit on KV never computed, or not this prompt's"
        new_blocks = table[hit // bs :]
        for b in table[: device // bs]:
            assert self.m.refcount(b) == rc[b] + 1
            if rc[b] == 0:
                event("revived a cached block")
        if looked is not None:
            revived = sum(rc[b] == 0 for b in table[: device // bs])
            assert looked.revived == revived, "PrefixHit.revived is not the cached-free hits"
        for b in table[device // bs :]:  # loaded from the host, then newly scheduled
            assert rc[b] == 0 and self.m.refcount(b) == 1, "a new block was already in use"
        self.store.fresh.update(new_blocks)
        self.admissions += 1
        if hit > device:
            self.n_host_hit += hit - device
        if set(table) & {t.dst for t in pending if t.direction == "to_device"}:
            self.loading.add(sid)  # its own loads, or a hit on blocks another one loads
        slots = self.schedule(sid, table, hit, nc)
        if self.V2:
            assert self.m.slots(sid, hit, nc).tolist() == slots.tolist()
        if self.caching:
            self.n_query += n
            self.n_hit += hit
        self.drain_events([(sid, i) for i in range(device // bs, nc // bs)])
        self.assert_published(sid, range(hit // bs))

    @rule(data=st.data())
    @op
    def prefill(self, data):
        """The next chunk of a prompt admitted with a budget."""
        if not self.V2:
            return
        pending = [s for s in self.live() if self.nc[s] < len(self.model[s])]
        if not pending:
            return self.add(data)
        bs = self.bs
        sid = data.draw(st.sampled_from(pending), label="seq")
        old_nc = self.nc[sid]
        n = data.draw(st.integers(0, len(self.model[sid]) - old_nc), label="chunk")
        old_table = self.m.block_table(sid)
        rc = [self.m.refcount(b) for b in range(self.nb)]
        ok, slots = self.attempt(lambda: self.m.prefill(sid, n))
        if not ok:
            return
        event("prefill chunk")
        new_nc = old_nc + n
        table = self.m.block_table(sid)
        assert table[: len(old_table)] == old_table, "a prefill chunk moved a block"
        assert len(table) == math.ceil(new_nc / bs)
        for b in table[len(old_table) :]:
            assert rc[b] == 0 and self.m.refcount(b) == 1, "a new block was already in use"
        self.store.fresh.update(table[len(old_table) :])
        self.nc[sid] = new_nc
        assert self.m.num_computed(sid) == new_nc
        want = self.schedule(sid, table, old_nc, new_nc)
        assert str(slots.dtype) == "int64" and slots.tolist() == want.tolist()
        self.drain_events([(sid, i) for i in range(old_nc // bs, new_nc // bs)])

    # ------------------------------------------------------------ appends

    @rule(data=st.data())
    @op
    def append_token(self, data):
        if not self.model:  # nothing live yet: admit something instead
            return self.add(data)
        sid = self.pick(data, "seq", lambda s: not self.blocked(s))
        tok = data.draw(TOKEN, label="token")
        self._append(sid, [tok], lambda: [self.m.append_token(sid, tok)])

    @rule(data=st.data())
    @op
    def append_tokens(self, data):
        if not self.model:  # nothing live yet: admit something instead
            return self.add(data)
        sid = self.pick(data, "seq", lambda s: not self.blocked(s))
        tokens = data.draw(st.lists(TOKEN, min_size=1, max_size=3 * self.bs + 1), label="tokens")
        self._append(sid, tokens, lambda: list(self.m.append_tokens(sid, tokens)))

    @rule(data=st.data())
    @op
    def speculate(self, data):
        """Draft tokens: slots like any append (copy-on-write included), never published."""
        if not self.V2:
            return
        if not self.model:
            return self.add(data)
        sid = self.pick(data, "seq", lambda s: not self.blocked(s, speculative=True))
        drafts = data.draw(st.lists(TOKEN, min_size=1, max_size=2 * self.bs + 1), label="drafts")
        call = lambda: list(self.m.append_tokens(sid, drafts, speculative=True))  # noqa: E731
        self._append(sid, drafts, call, speculative=True)

    def _append(self, sid, tokens, call, speculative=False):
        if self.blocked(sid, speculative):
            event("append refused (mid-prefill or drafts pending)")
            return self.refused(call)
        bs = self.bs
        old_table, old_n = self.m.block_table(sid), len(self.model[sid])
        rc = {b: self.m.refcount(b) for b in range(self.nb)}
        ok, slots = self.attempt(call)
        if not ok:
            return
        new_table = self.m.block_table(sid)
        copies = self.expect_extend(sid, old_table, old_n, len(tokens), rc, new_table)
        if copies:
            event("copy-on-write" + (" by a draft" if speculative else ""))
        self.n_cow += copies
        self.model[sid].extend(tokens)
        self.extend_nodes(sid, tokens)
        self.nc[sid] += len(tokens)
        if speculative:
            self.drafts[sid] += len(tokens)
            if self.drafts[sid] > len(tokens):
                event("more drafts while drafts are pending")
        want = self.schedule(sid, new_table, old_n, old_n + len(tokens))
        assert list(slots) == want.tolist()
        new_n = old_n + len(tokens)
        done = [] if speculative else [(sid, i) for i in range(old_n // bs, new_n // bs)]
        self.drain_events(done)

    @rule(data=st.data())
    @op
    def append_batch(self, data):
        if not self.model:  # nothing live yet: admit something instead
            return self.add(data)
        pool = [s for s in self.live() if not self.blocked(s)]
        mixed = len(pool) < len(self.model)
        if not pool or (mixed and not data.draw(st.integers(0, 3), label="ok")):
            pool = self.live()
        order = data.draw(st.permutations(pool), label="order")
        ids = order[: data.draw(st.integers(1, len(order)), label="batch_size")]
        tokens = data.draw(st.lists(TOKEN, min_size=len(ids), max_size=len(ids)), label="tokens")
        if any(self.blocked(s) for s in ids):
            event("batch refused")
            return self.refused(lambda: self.m.append_batch(ids, tokens))
        old = {s: (self.m.block_table(s), len(self.model[s])) for s in ids}
        rc = {b: self.m.refcount(b) for b in range(self.nb)}
        ok, slots = self.attempt(lambda: self.m.append_batch(ids, tokens))
        if not ok:
            return
        assert str(slots.dtype) == "int64" and slots.shape == (len(ids),)
        want_slots, done, bs = [], [], self.bs
        for s, t in zip(ids, tokens):
            old_table, old_n = old[s]
            new_table = self.m.block_table(s)
            self.n_cow += self.expect_extend(s, old_table, old_n, 1, rc, new_table)
            self.model[s].append(t)
            self.extend_nodes(s, [t])
            self.nc[s] += 1
            want_slots += self.schedule(s, new_table, old_n, old_n + 1).tolist()
            if (old_n + 1) % bs == 0:
                done.append((s, old_n // bs))
        assert slots.tolist() == want_slots
        self.drain_events(done)

    @rule(data=st.data())
    @op
    def accept(self, data):
        """Verification ran (the step's writes landed): keep the first k drafts."""
        if not self.V2:
            return
        if not self.model:
            return self.add(data)
        with_drafts = [s for s in self.live() if self.drafts[s]]
        if not with_drafts:  # accept(id, 0) with nothing pending is a no-op
            sid = data.draw(st.sampled_from(self.live()), label="seq")
            before = self.snap()
            assert self.m.accept(sid, 0) is None
            assert self.snap() == before and self.m.take_events() == []
            return
        self.end_step()
        bs = self.bs
        sid = data.draw(st.sampled_from(with_drafts), label="seq")
        pending, n = self.drafts[sid], len(self.model[sid])
        k = data.draw(st.integers(0, pending), label="accepted")
        event(f"accept {'none' if k == 0 else 'all' if k == pending else 'some'}")
        old_table = self.m.block_table(sid)
        u0 = self.m.usage()
        assert self.m.accept(sid, k) is None
        base, new_n = n - pending, n - pending + k
        table = self.m.block_table(sid)
        assert table == old_table[: math.ceil(new_n / bs)]
        released = old_table[len(table) :]
        assert all(self.m.refcount(b) == 0 for b in released), "a rolled-back block is still held"
        u = self.m.usage()
        want = (u0.free_blocks + len(released), u0.cached_blocks)
        assert (u.free_blocks, u.cached_blocks) == want, "rolled-back blocks must return clean"
        if released:
            event("rollback released blocks")
            order = self.free_order()
            assert order[: len(released)] == released, "rolled-back blocks are released tail first"
        del self.model[sid][new_n:], self.nodes[sid][new_n:]
        self.nc[sid], self.drafts[sid] = new_n, 0
        assert (self.m.num_tokens(sid), self.m.num_computed(sid)) == (new_n, new_n)
        self.drain_events([(sid, i) for i in range(base // bs, new_n // bs)])

    # ------------------------------------------------------------ fork, free, reset

    @rule(data=st.data())
    @op
    def fork(self, data):
        if not self.model:  # nothing live yet: admit something instead
            return self.add(data)
        self.end_step()  # the fork rule: fork after the step's K/V writes
        self._fork(self.pick(data, "parent", lambda s: not self.blocked(s)))

    def _fork(self, parent):
        child = self.new_id()
        if self.blocked(parent):
            event("fork refused")
            self.refused(lambda: self.m.fork(parent, child))
            assert child not in self.m
            self.freed_ids.append(child)
            return
        free = self.m.num_free_blocks
        self.m.fork(parent, child)
        assert self.m.num_free_blocks == free
        assert self.m.take_copies() == []
        assert self.m.block_table(child) == self.m.block_table(parent)
        self.model[child] = list(self.model[parent])
        self.salt[child] = self.salt[parent]
        self.nc[child], self.drafts[child] = self.nc[parent], 0
        self.written[child] = self.nc[parent] // self.bs  # the parent's step wrote them
        self.nodes[child] = list(self.nodes[parent])
        self.n_forks += 1
        assert self.m.take_events() == []  # a fork publishes and evicts nothing
        return child

    @rule(data=st.data())
    @op
    def free(self, data):
        """Any time: a sequence that scheduled nothing in this step, one that finished (after
        the step's writes), or one dropped before its work was computed (``cache=False``).
        A sequence whose only work in the step is loads from the host tier may also be freed
        with ``cache=True`` before the step: its loads are dropped, and the blocks they were to
        fill lose their device hashes (their K/V never arrives)."""
        if not self.model:  # nothing live yet: admit something instead
            return self.add(data)
        sid = data.draw(st.sampled_from(self.live()), label="seq")
        if sid in self.store.writes or sid in self.loading:
            first = self.first_write.get(sid, self.admissions)
            if first == self.admissions and data.draw(st.booleans(), label="drop"):
                event("dropped before compute" + (" (loads pending)" * (sid in self.loading)))
                return self._free(sid, cache=False, drop=True)
            if sid not in self.store.writes and data.draw(st.booleans(), label="before_loads"):
                event("freed before its loads ran")
                return self._free(sid)
            self.end_step()
        elif self.store.copies:
            event("free with copies pending")
        if sid in self.swapped:
            event("freed while swapped out")
        self._free(sid, cache=data.draw(st.booleans(), label="cache"))

    @rule(data=st.data())
    @op
    def free_copy_source(self, data):
        """The hazard the batch rules exist for, set up on purpose: two forked pairs; in one step
        a child copies its shared partial block, the parent (that block's other holder) is
        freed, so the block is free while the pending copy still reads it; then the other child
        copies on write: its destination must not be the freed source."""
        if not self.V2:
            return
        bs = self.bs
        partial = [s for s in self.live() if not self.blocked(s) and self.nc[s] % bs]
        if len(partial) < 2:
            return
        self.end_step()
        a, b = data.draw(st.permutations(partial), label="pair")[:2]
        ca, cb = self._fork(a), self._fork(b)
        self._append(ca, [1], lambda: [self.m.append_token(ca, 1)])
        if self.store.copies:
            event("freed the source of a pending copy")
        self._free(a, cache=data.draw(st.booleans(), label="cache"))
        self._append(cb, [2], lambda: [self.m.append_token(cb, 2)])
        droppable = ca in self.store.writes and self.first_write[ca] == self.admissions
        if droppable and data.draw(st.booleans(), label="drop_child"):
            event("dropped the holder of a pending copy's destination")
            self._free(ca, cache=False, drop=True)  # its copy goes with it

    # ------------------------------------------------------------ the host tier: swapping

    def swap_refusal(self, sid):
        """Why ``swap_out(sid)`` must be refused now, or None: no host tier, swapped out
        already, mid-prefill or drafts pending, given positions (and so blocks) in this step
        (their K/V is written after the drain), or a copy or a transfer of its blocks is
        pending."""
        if not self.hb:
            return "no host tier"
        if sid in self.swapped:
            return "already swapped out"
        if self.nc[sid] < len(self.model[sid]) or self.drafts[sid]:
            return "not ready"
        if sid in self.store.writes:
            return "given positions in this step"
        table = set(self.m.block_table(sid))
        if table & {c.dst for c in self.store.copies}:
            return "a copy into its block is pending"
        for t in self.peek_transfers():
            if (t.src if t.direction == "to_host" else t.dst) in table:
                return "a transfer of its block is pending"
        return None

    @precondition(lambda self: self.hb)
    @rule(data=st.data())
    @op
    def swap_out(self, data):
        """Swap preemption at a legal point (before anything is appended to the sequence in
        this step: a sequence appended to waits for the step's end), or an attempt the
        contract refuses."""
        if not self.model:
            return self.add(data)
        ok = [s for s in self.live() if self.swap_refusal(s) is None]
        if not ok and self.swapped and data.draw(st.integers(0, 3), label="swap_in_instead"):
            return self._swap_in(data.draw(st.sampled_from(sorted(self.swapped)), label="seq"))
        sid = self.pick(data, "seq", lambda s: s in ok)
        why = self.swap_refusal(sid)
        if why == "given positions in this step" and data.draw(st.booleans(), label="after_step"):
            self.end_step()  # the engine's way: swap it out once the step has run
            why = self.swap_refusal(sid)
        if why is not None:
            event(f"swap_out refused: {why}")
            return self.refused(lambda: self.m.swap_out(sid))
        if self.store.writes or self.admissions:
            event("swapped out in a step with admissions or appends")
        self._swap_out(sid)

    def _swap_out(self, sid):
        m = self.m
        table = m.block_table(sid)
        private = {i for i, b in enumerate(table) if m.refcount(b) == 1}
        free, host_free = m.num_free_blocks, m.num_free_host_blocks
        ok, _ = self.attempt(lambda: m.swap_out(sid), host=True)
        if not ok:
            event("swap_out out of host blocks")
            return
        assert m.block_table(sid) == [-1 if i in private else b for i, b in enumerate(table)]
        assert m.num_swapped_blocks(sid) == len(private)
        assert (m.num_free_blocks, m.num_free_host_blocks) == (
            free + len(private), host_free - len(private))
        out = [t for t in self.peek_transfers() if t.direction == "to_host"]
        moved = {t.src: t.dst for t in out}
        sources = Counter(t.src for t in out)
        assert all(sources[table[i]] == 1 for i in private), "one to_host per block swapped out"
        self.swapped[sid] = {i: moved[table[i]] for i in private}
        self.swap_moves += [(table[i], moved[table[i]]) for i in private]
        event("swapped out" + (" (shared blocks stay)" if len(private) < len(table) else ""))
        self.drain_events()

    @precondition(lambda self: self.hb)
    @rule(data=st.data())
    @op
    def swap_in(self, data):
        """Bring a swapped-out sequence back (any time in a step: its loads run before the
        step's writes), or swap in one that is not swapped out (refused)."""
        if not self.model:
            return self.add(data)
        out = [s for s in self.live() if s in self.swapped]
        if not out and data.draw(st.integers(0, 3), label="swap_out_instead"):
            return self.swap_out(data)
        if not out or not data.draw(st.integers(0, 7), label="swapped"):
            sid = data.draw(st.sampled_from(self.live()), label="seq")
            if sid not in self.swapped:
                event("swap_in refused")
                return self.refused(lambda: self.m.swap_in(sid))
        else:
            sid = data.draw(st.sampled_from(out), label="seq")
        self._swap_in(sid)
        if sid in self.model:
            self.cancel_loading(sid, data)

    def _swap_in(self, sid):
        m, bs = self.m, self.bs
        table, where = m.block_table(sid), self.swapped[sid]
        rc = [m.refcount(b) for b in range(self.nb)]
        cached = m.usage().cached_blocks
        loads = [t for t in self.peek_transfers() if t.direction == "to_device"]
        free, host_free = m.num_free_blocks, m.num_free_host_blocks
        offloads = m.usage().transfers_to_host
        ok, _ = self.attempt(lambda: m.swap_in(sid))
        if not ok:
            event("swap_in out of device blocks")
            return
        new = m.block_table(sid)
        assert [b for i, b in enumerate(new) if i not in where] == [b for b in table if b >= 0]
        assert min(new, default=0) >= 0 and m.num_swapped_blocks(sid) == 0
        moved = Counter(new[i] for i in where)
        for b, k in moved.items():
            assert m.refcount(b) == rc[b] + k
        # a block still cached on the device is revived; the others are loaded from the host
        # block that holds them, into blocks that were free
        queued = {t.dst: t.src for t in self.peek_transfers() if t.direction == "to_device"}
        loaded = [i for i in where if new[i] in queued and new[i] not in {t.dst for t in loads}]
        revived = [i for i in where if i not in loaded]
        for i in loaded:
            assert queued[new[i]] == where[i] and rc[new[i]] == 0, "loaded from the wrong block"
        for i in revived:
            assert i < self.nc[sid] // bs, "only a full, published block can be revived"
        taken = sum(rc[new[i]] == 0 for i in where)
        assert m.num_free_blocks == free - taken
        assert m.usage().cached_blocks <= cached
        pinned = {h for _, h in self.swap_moves} | {t.src for t in loads}
        back = [where[i] for i in revived if where[i] not in pinned]
        offloads = m.usage().transfers_to_host - offloads  # blocks its allocation evicted
        assert m.num_free_host_blocks == host_free + len(back) - offloads, (
            "the host copies of revived blocks come free")
        event(f"swapped in: {len(loaded)} loaded, {len(revived)} revived")
        del self.swapped[sid]
        if set(new) & set(queued):  # loads of its own, or revived blocks another one loads
            self.loading.add(sid)
        done = [(sid, i) for i in sorted(loaded) if i < self.nc[sid] // bs]
        self.drain_events(done, host_released=len(back))
        # the blocks it brought back; a full block that stayed on the device (shared) may be an
        # unpublished twin whose published original was evicted since: swap_in does not touch it
        self.assert_published(sid, sorted(i for i in where if i < self.nc[sid] // bs))

    @precondition(lambda self: self.hb)
    @rule(data=st.data())
    @op
    def swap_after_append(self, data):
        """The illegal point set up on purpose: a fork's child copies its shared partial block
        on write, so swapping it out in this step is refused; its parent, now the block's only
        holder and not appended to, may be swapped out while the copy still reads the block."""
        partial = [s for s in self.live() if not self.blocked(s) and self.nc[s] % self.bs]
        if not partial:
            return
        self.end_step()
        parent = data.draw(st.sampled_from(partial), label="parent")
        child = self._fork(parent)
        self._append(child, [3], lambda: [self.m.append_token(child, 3)])
        if self.swap_refusal(child) is not None:
            event("swap_out refused after copy-on-write")
            self.refused(lambda: self.m.swap_out(child))
        if self.swap_refusal(parent) is None and data.draw(st.booleans(), label="parent_out"):
            if self.store.copies:
                event("swapped out a pending copy's source")
            self._swap_out(parent)

    @precondition(lambda self: self.hb)
    @rule(data=st.data())
    @op
    def crowd_host(self, data):
        """Swap preemption until the host tier is full, set up on purpose: admit a prompt as
        long as the device's free blocks allow and swap it out, until ``swap_out`` runs out of
        host blocks (which changes nothing). Offloads find no host block to spare afterwards."""
        self.end_step()
        base = data.draw(st.sampled_from(PREFIXES), label="base")
        for _ in range(4):
            k = self.m.num_free_blocks
            if not k:
                return
            before = set(self.model)
            # a salt of its own: it hits nothing, and evicts what the device caches
            self._add((base * k)[: k * self.bs], f"crowd {self.next_id}")
            [sid] = set(self.model) - before or [None]
            if sid is None:
                return
            self.end_step()
            if self.swap_refusal(sid) is None:
                free = self.m.num_free_host_blocks
                self._swap_out(sid)
                if sid not in self.swapped:
                    assert self.m.num_free_host_blocks == free
                    return

    @precondition(lambda self: self.hb and self.caching)
    @rule(data=st.data())
    @op
    def offload_and_return(self, data):
        """A prefix pushed off the device and asked for again, set up on purpose: a finished
        sequence is freed (its blocks stay cached), a prompt under a salt of its own takes
        every free device block (evicting them: offloaded to the host, unless already there),
        and after that step a prompt extending the freed sequence's tokens comes back: a hit
        that continues on the host, loaded into fresh device blocks."""
        done = [s for s in self.live() if not self.blocked(s) and self.nc[s] >= self.bs]
        if not done:
            return self.add(data)
        self.end_step()
        sid = data.draw(st.sampled_from(done), label="seq")
        tokens, salt = self.model[sid], self.salt[sid]
        self._free(sid)
        k = self.m.num_free_blocks
        if k:
            before = set(self.model)
            self._add([5] * (k * self.bs), f"filler {self.next_id}")
            self.end_step()
            for filler in set(self.model) - before:
                self._free(filler, cache=data.draw(st.booleans(), label="cache"))
        if data.draw(st.booleans(), label="hazard"):  # a freed block a pending copy reads:
            self.free_a_copy_source(data)  # never a load's destination
        n = max(1, len(tokens) - data.draw(st.integers(0, self.bs), label="cut"))
        suffix = data.draw(st.lists(TOKEN, max_size=self.bs), label="suffix")
        before = set(self.model)
        self._add(tokens[:n] + suffix, salt, self.draw_chunk(data))
        for again in set(self.model) - before:  # cancelled before its step ran, loads pending
            self.cancel_loading(again, data)

    def cancel_loading(self, sid, data):
        """Sometimes cancel ``sid`` while its loads from the host are pending: dropped with
        ``cache=False``, or (with nothing else scheduled for it) freed with ``cache=True``."""
        if sid not in self.loading:
            return
        how = data.draw(st.sampled_from(["keep", "drop", "free"]), label="cancel")
        if how == "drop":
            event("dropped before compute (loads pending)")
            self._free(sid, cache=False, drop=True)
        elif how == "free" and sid not in self.store.writes:
            event("freed before its loads ran")
            tokens, salt = self.model[sid], self.salt[sid]
            self._free(sid)
            if data.draw(st.booleans(), label="asked_again"):  # must not hit the unloaded blocks
                self._add(tokens, salt, self.draw_chunk(data))

    def free_a_copy_source(self, data):
        """Between steps: fork a sequence whose last block is partial, let the child copy it on
        write, and free the parent, so that the block is free while the pending copy reads it."""
        partial = [s for s in self.live() if not self.blocked(s) and self.nc[s] % self.bs]
        if not partial:
            return
        parent = data.draw(st.sampled_from(partial), label="parent")
        child = self._fork(parent)
        self._append(child, [1], lambda: [self.m.append_token(child, 1)])
        if self.store.copies:
            event("freed the source of a pending copy")
        self._free(parent, cache=data.draw(st.booleans(), label="cache"))

    def _free(self, sid, cache=True, drop=False):
        table = [b for b in self.m.block_table(sid) if b >= 0]  # a swapped one's device part
        mine = {b for b in set(table) if self.m.refcount(b) == table.count(b)}
        kept = mine & set(self.m.block_table(sid)[: self.written.pop(sid)])  # its written prefix
        free, cached = self.m.num_free_blocks, self.m.usage().cached_blocks
        if self.hb:
            loads = [t for t in self.peek_transfers() if t.direction == "to_device"]
            host_free = self.m.num_free_host_blocks
        self.m.free(sid, cache=cache)
        assert sid not in self.m
        assert self.m.num_free_blocks == free + len(mine)
        dropped = self.check_host_release(sid, mine, loads, host_free) if self.hb else 0
        # a pending copy into a block of this sequence has nothing left to serve
        self.store.copies = [c for c in self.store.copies if c.dst not in mine]
        if drop:  # its scheduled work never runs
            self.store.writes.pop(sid, None)
            self.first_write.pop(sid, None)
        self.loading.discard(sid)
        self.swapped.pop(sid, None)
        if not drop:
            self.history = self.history[-7:] + [(self.model[sid][: self.nc[sid]], self.salt[sid])]
        for d in (self.model, self.salt, self.nc, self.drafts, self.nodes):
            del d[sid]
        self.freed_ids.append(sid)
        if cache and not dropped:
            assert self.m.take_events() == []  # freeing publishes and evicts nothing
            return
        # An uncached free unpublishes what only this sequence held, a cached one the blocks
        # whose loads it dropped: the removals it reports are not evictions.
        if cache:
            event("a cached free unpublished the blocks of the loads it dropped")
        else:
            event("free(cache=False)")
            # only its written prefix (hits, a fork's inherited blocks) stays revivable
            assert cached <= self.m.usage().cached_blocks <= cached + len(kept)
        removed_before = self.n_removed
        self.drain_events(evicting=False)
        self.n_removed = removed_before

    def check_host_release(self, sid, mine, loads, host_free):
        """After freeing ``sid``: the loads into the blocks it released are dropped (and only
        those), and its host blocks and the dropped loads' sources come free unless a swapped
        sequence or a pending transfer still holds them. Returns how many loads it dropped."""
        left = [t for t in self.peek_transfers() if t.direction == "to_device"]
        dropped = Counter(loads) - Counter(left)
        assert set(dropped) == {t for t in loads if t.dst in mine}, (
            "a free must drop exactly the loads into the blocks it releases")
        if dropped:
            event("a free dropped pending loads")
        held = {h for _, h in self.swap_moves} | {t.src for t in left}
        held |= {t.dst for t in self.peek_transfers() if t.direction == "to_host"}  # offloads
        held |= {h for s, pos in self.swapped.items() if s != sid for h in pos.values()}
        released = set(self.swapped.get(sid, {}).values()) | {t.src for t in dropped}
        assert self.m.num_free_host_blocks == host_free + len(released - held)
        return len(dropped)

    @rule()
    @op
    def reset(self):
        self.end_step()
        before = self.snap()
        ok = self.m.reset_prefix_cache()
        # refused while any block is in use (admitted with prefill=0 and no hit: no block)
        assert ok is (not any(self.nc.values()))
        if ok:
            event("reset done")
            u = self.m.usage()
            assert u.cached_blocks == 0 and self.m.num_free_blocks == self.nb
            assert u.host_cached_blocks == 0 and self.m.num_free_host_blocks == self.hb
            evs = self.m.take_events()
            if self.events and self.caching:
                assert evs == [AllBlocksCleared()]
            else:  # with caching off there is no cache to clear: an event is optional
                assert evs in ([], [AllBlocksCleared()]) and (self.events or not evs)
            self.router.clear()
            self.router_cpu.clear()
            self.host_of = {}
            self.wt_new = dict.fromkeys(self.wt_new, False)
            self.wt_ready = dict.fromkeys(self.wt_ready, False)
        else:
            assert self.snap() == before
            assert self.m.take_events() == []

    @rule()
    @op
    def step(self):
        """The engine ends a step: one batched copy, then the step's writes."""
        self.end_step()

    @rule()
    @op
    def pickle_round_trip(self):
        """A pickled manager is equal in everything observable and carries on identically: the
        machine continues with the copy (pending copies and LRU order included)."""
        if not self.V2:
            return
        before = self.snap()
        old, blob = self.m, pickle.dumps(self.m)
        self.m, twin = pickle.loads(blob), pickle.loads(blob)
        assert self.snap() == before
        self.m.check_invariants()
        if self.hb:  # pending transfers and the host's LRU order survive too
            assert self.host_order(old) == self.host_order(twin)
        # the LRU order survives: the original and an unpickled twin hand out the same blocks
        orders = []
        for m in (old, twin):
            free = m.num_free_blocks
            if free:
                m.add_sequence("probe", [7] * (free * self.bs), cache_salt="probe")
            orders.append(m.block_table("probe") if free else [])
        assert orders[0] == orders[1], "pickling changed the free list or the LRU order"

    @rule(data=st.data())
    @op
    def bad_call(self, data):
        """Errors change nothing: unknown ids, duplicate ids, bad tokens, malformed batches, and
        (v2) chunks, acceptances and slot ranges past what exists."""
        live = self.live()
        kinds = ["unknown", "dup", "token", "batch_dup", "batch_len", "empty"]
        if self.V2:
            kinds += ["prefill_past", "accept_past", "bad_budget", "lookup_empty", "slots_past"]
        if self.swapped:
            kinds += ["export_swapped", "export_swapped"]
        if self.V2 and not self.hb:
            kinds += ["swap_no_tier"]
        kind = data.draw(st.sampled_from(kinds), label="kind")
        exc = ValueError
        if kind == "unknown":
            exc, call = KeyError, lambda: self.m.append_token(-1, 0)
        elif kind == "dup" and live:
            call = lambda: self.m.add_sequence(live[0], [1])  # noqa: E731
        elif kind == "token" and live:
            bad = data.draw(st.sampled_from([-1, 2**32, 0.5]))
            call = lambda: self.m.append_tokens(live[0], [0, bad])  # noqa: E731
        elif kind == "batch_dup" and live:
            call = lambda: self.m.append_batch([live[0], live[0]], [1, 1])  # noqa: E731
        elif kind == "batch_len" and live:
            call = lambda: self.m.append_batch(live, [1] * (len(live) + 1))  # noqa: E731
        elif kind == "prefill_past" and live:
            sid = live[-1]
            past = len(self.model[sid]) - self.nc[sid] + 1
            call = lambda: self.m.prefill(sid, past)  # noqa: E731
        elif kind == "accept_past" and live:
            call = lambda: self.m.accept(live[-1], self.drafts[live[-1]] + 1)  # noqa: E731
        elif kind == "bad_budget":
            budget = data.draw(st.sampled_from([-1, True, 0.5]))
            call = lambda: self.m.add_sequence(-2, [1, 2], prefill=budget)  # noqa: E731
        elif kind == "lookup_empty":
            call = lambda: self.m.lookup([])  # noqa: E731
        elif kind == "slots_past" and live:
            call = lambda: self.m.slots(live[0], 0, self.nc[live[0]] + 1)  # noqa: E731
        elif kind == "swap_no_tier" and live:
            call = lambda: self.m.swap_out(live[-1])  # noqa: E731
        elif kind == "export_swapped":
            event("export of a swapped-out sequence refused")
            out = data.draw(st.sampled_from(sorted(self.swapped)), label="swapped")
            export = data.draw(st.sampled_from(["block_tables", "flashinfer_layout", "slots"]))
            arg = out if export == "slots" else [s for s in live if s != out] + [out]
            call = lambda: getattr(self.m, export)(arg)  # noqa: E731
        else:
            call = lambda: self.m.add_sequence(self.new_id(), [])  # noqa: E731
        self.refused(call, exc)
        assert -2 not in self.m

    # ------------------------------------------------------------ invariants

    @invariant()
    def consistent(self):
        if self.m is None:
            return
        m, bs = self.m, self.bs
        m.check_invariants()
        u = m.usage()
        pending = self.peek_transfers(u)
        held, host_held = self.store.view(transfers=pending)
        refs = [0] * self.nb
        fill: dict[int, int] = {}
        logical = logical_blocks = 0
        for sid, tokens in self.model.items():
            n, nc = len(tokens), self.nc[sid]
            table = m.block_table(sid)
            assert sid in m
            assert m.num_tokens(sid) == n
            assert list(m.tokens(sid)) == tokens
            if self.V2:
                assert m.num_computed(sid) == nc
            assert len(table) == math.ceil(nc / bs)
            where = self.swapped.get(sid, {})
            assert sorted(where) == [i for i, b in enumerate(table) if b < 0], (
                "a swapped-out sequence's table must show -1 exactly at its host positions")
            read = held[self.store.slots_of(table, 0, nc)]
            if where:  # host positions read from the host blocks that hold them
                host_table = [where.get(i, -1) for i in range(len(table))]
                pos = np.arange(nc)
                on_host = np.isin(pos // bs, list(where))
                read[on_host] = host_held[self.store.slots_of(host_table, 0, nc)[on_host]]
            assert read.tolist() == self.nodes[sid][:nc], f"KV content of {sid} is wrong"
            for i, b in enumerate(table):
                if b < 0:
                    continue
                refs[b] += 1
                f = min(bs, nc - i * bs)
                logical += f
                logical_blocks += 1
                assert fill.setdefault(b, f) == f, "holders of a block disagree on its fill"
        assert [m.refcount(b) for b in range(self.nb)] == refs
        # the kernel exports agree with the tables (any order of sequences on the device)
        ids = [s for s in self.live()[::-1] if s not in self.swapped]
        tables = [m.block_table(s) for s in ids]
        width = max(map(len, tables), default=0)
        bt = m.block_tables(ids)
        assert bt.dtype == "int32" and bt.shape == (len(ids), width)
        assert bt.tolist() == [t + [-1] * (width - len(t)) for t in tables]
        indptr, indices, last = m.flashinfer_layout(ids)
        assert indptr.tolist() == [0] + list(itertools.accumulate(map(len, tables)))
        assert indices.tolist() == [b for t in tables for b in t]
        # a sequence with no page yet (admitted with prefill=0 and no hit) has no last page
        assert [x for x, s in zip(last.tolist(), ids) if self.nc[s]] == [
            (self.nc[s] - 1) % bs + 1 for s in ids if self.nc[s]
        ]
        used = sum(1 for r in refs if r)
        assert (u.num_blocks, u.block_size) == (self.nb, bs)
        assert u.num_sequences == m.num_sequences == len(self.model)
        assert u.logical_tokens == logical  # a swapped-out sequence counts its device part
        assert u.stored_tokens == sum(fill.values())
        assert u.used_blocks == used
        assert u.allocated_slots == used * bs
        if used:
            assert abs(u.internal_fragmentation - (1 - u.stored_tokens / (used * bs))) < 1e-9
        assert u.blocks_saved_by_sharing == logical_blocks - used
        assert u.free_blocks + u.cached_blocks == m.num_free_blocks == self.nb - used
        assert (u.prefix_query_tokens, u.prefix_hit_tokens) == (self.n_query, self.n_hit)
        assert (u.cow_copies, u.forks) == (self.n_cow, self.n_forks)
        if not self.caching:
            assert u.cached_blocks == 0
        if self.events:
            # (an eviction whose hash a live twin takes over removes no hash)
            assert u.evictions >= self.n_removed
            assert len(self.router) >= u.cached_blocks
        self.check_host_usage(u, pending)
        live = {s: (len(t), self.nc[s], self.drafts[s]) for s, t in self.model.items()}
        note(f"live (tokens, computed, drafts)={live} swapped={self.swapped} usage={u}")

    def check_host_usage(self, u, pending):
        """``usage()``'s host fields against the model: every host block held is held by a
        swapped-out sequence or pinned by a transfer not drained yet."""
        if not self.V2:
            return
        assert (u.host_blocks, self.m.num_host_blocks) == (self.hb, self.hb)
        assert u.swapped_sequences == len(self.swapped)
        assert u.host_hit_tokens == self.n_host_hit
        if not self.hb:
            return
        into = [t for t in pending if t.direction == "to_device"]
        assert u.transfers_to_device == self.drained[1] + len(into)
        swapped = [h for pos in self.swapped.values() for h in pos.values()]
        assert len(set(swapped)) == len(swapped), "one host block holds two swapped positions"
        held = set(swapped)
        held |= {t.dst for t in pending if t.direction == "to_host"} | {t.src for t in into}
        assert u.host_used_blocks == len(held) == self.hb - self.m.num_free_host_blocks
        assert u.host_cached_blocks <= self.hb - u.host_used_blocks
        for sid, where in self.swapped.items():
            assert self.m.num_swapped_blocks(sid) == len(where)
        if self.caching and self.events:
            assert u.host_cached_blocks <= len(self.router_cpu)
            assert len(self.router_cpu) <= u.host_cached_blocks + u.host_used_blocks


class Sha256Machine(ManagerMachine):
    algo = "sha256"


class BuiltinMachine(ManagerMachine):
    algo = "builtin"
    TIERS = False  # the host tier is the same for every digest: the sha256 machine drives it


class Xxh3Machine(ManagerMachine):
    algo = "xxh3"
    TIERS = False


# The backbone runs once at full depth (STATEFUL_FACTOR times the profile's examples), with the
# default hash. The other algorithms share every line of the machine but the digest, so the
# profile's own number of examples each keeps them exercised without tripling the suite's time.
# Hypothesis' explain phase (re-running a failure under a tracer) takes minutes on this machine
# and adds nothing to a shrunk step list: it is left out.
PHASES = [p for p in settings().phases if p is not Phase.explain]
DEEP = settings(max_examples=STATEFUL_FACTOR * settings().max_examples, phases=PHASES)
LIGHT = settings(max_examples=settings().max_examples, phases=PHASES)


def test_stateful_sha256():
    run_state_machine_as_test(Sha256Machine, settings=DEEP)


def test_stateful_builtin():
    run_state_machine_as_test(BuiltinMachine, settings=LIGHT)


def test_stateful_xxh3():
    """xxh3 needs the optional xxhash package: under CI (which installs every extra) a missing
    one fails here; elsewhere the test is skipped, visibly."""
    if not os.environ.get("CI"):
        pytest.importorskip("xxhash")
    run_state_machine_as_test(Xxh3Machine, settings=LIGHT)


# ---------------------------------------------------------------- the seeded soak


class SlotStore:
    """A physical KV store that records what was written where: each device and host slot holds
    ``(salt, prompt chain up to and including the position)`` of the token computed into it, or
    None (never written). Transfers and copies move these records as the engine moves bytes."""

    def __init__(self, nb: int, hb: int, bs: int) -> None:
        self.bs = bs
        self.dev = [None] * (nb * bs)
        self.host = [None] * (hb * bs)

    def block(self, mem, b):
        return mem[b * self.bs : (b + 1) * self.bs]

    def move(self, src_mem, src, dst_mem, dst):
        bs = self.bs
        dst_mem[dst * bs : (dst + 1) * bs] = src_mem[src * bs : (src + 1) * bs]


def _soak_one(seed: int, policy: str, algo: str, caching: bool, steps: int) -> dict:
    """One seeded run of an engine loop over a tiered manager, checked after every call.

    Each step, in a random order: swap-ins, decode appends (``append_batch`` / ``append_token``
    / ``append_tokens``), prefill chunks, admissions (prompts on shared prefixes, so hits happen
    on both tiers), legal swap-outs of sequences the step has not touched, refused swap-outs of
    ones it has, and frees of untouched sequences. Then the engine's drain: ``take_transfers()``
    (the ``to_host`` batch reads the device as the last step left it: every slot it reads that
    holds a position of a sequence or of a published block must have been written), then
    ``take_copies()``, then the step's writes. Between steps: forks and frees. After every call:
    ``check_invariants()`` (host reachability included) and every ``BlockStored`` names a parent a
    router knows at that event; at every step's end, every sequence reads back its own chain
    through its table (a prefix hit on either tier that served unwritten or foreign K/V shows
    here), a swapped one from the host slots its blocks moved to."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 3, 4])
    nb = rng.randint(8, 20)
    hb = rng.randint(2, 2 * nb)
    m = KVCacheManager(nb, block_size=bs, enable_prefix_caching=caching, hash_algo=algo,
                       host_blocks=hb, host_write_policy=policy)
    store = SlotStore(nb, hb, bs)
    vocab = [[rng.randrange(3) for _ in range(12)] for _ in range(3)]
    seqs: dict = {}  # id -> (salt, tokens)
    swapped: dict = {}  # id -> {table index: host block}, once its swap is drained
    pending_swaps: dict = {}  # id -> {table index: device block} swapped out this step
    router = {"GPU": set(), "CPU": set()}  # what a router mirroring the events holds
    ever: set = set()  # every block hash ever stored (a salt's root never is)
    stats = Counter()
    next_id = itertools.count()

    def events():
        for ev in m.take_events():
            if isinstance(ev, BlockStored):
                p = ev.parent_block_hash
                known = p is None or p in router["GPU"] or p in router["CPU"] or p not in ever
                if ev.medium == "CPU":
                    assert known, "a host store names a parent the router does not know"
                elif not known:  # a device twin's child: see docs/design.md 3.11 (issue 17.3)
                    stats["device store naming an unknown parent"] += 1
                router[ev.medium].update(ev.block_hashes)
                ever.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                router[ev.medium].difference_update(ev.block_hashes)
            else:
                router["GPU"].clear()
                router["CPU"].clear()

    def checked(fn, *a, **kw):
        stats["calls"] += 1
        try:
            out = fn(*a, **kw)
        except OutOfBlocks:
            stats["out of blocks"] += 1
            out = OutOfBlocks
        m.check_invariants()
        events()
        return out

    def chain(sid, upto):
        salt, toks = seqs[sid]
        return [(salt, tuple(toks[: i + 1])) for i in range(upto)]

    for _ in range(steps):
        busy: set = set()
        writes: list = []  # (sid, start, stop): positions scheduled this step

        def schedule(sid, start, stop):
            if stop > start:
                writes.append((sid, start, stop))
                busy.add(sid)

        ops = ["admit"] * 3 + ["decode"] * 3 + ["prefill", "swap_out", "swap_out", "swap_in", "free"]
        for _ in range(rng.randint(1, 8)):
            op = rng.choice(ops)
            live = [s for s in seqs if s not in swapped and s not in pending_swaps]
            ready = [s for s in live if m.num_computed(s) == m.num_tokens(s)]
            if op == "admit":
                base = rng.choice(vocab)
                prompt = base[: rng.randint(0, len(base))] + [rng.randrange(3) for _ in range(rng.randint(0, 2 * bs))]
                prompt = prompt or [0]
                salt = rng.choice([None, None, "x"])
                sid = next(next_id)
                chunk = rng.choice([None, None, 0, rng.randint(0, 2 * bs)])
                before = m.lookup(prompt, cache_salt=salt)
                kw = {} if chunk is None else {"prefill": chunk}
                hit = checked(m.add_sequence, sid, prompt, cache_salt=salt, **kw)
                if hit is OutOfBlocks:
                    continue
                assert hit == before
                stats["host hit tokens"] += before.host
                seqs[sid] = (salt, list(prompt))
                if before.host:
                    busy.add(sid)  # loads from the host land at the drain
                schedule(sid, hit, m.num_computed(sid))
            elif op == "decode" and ready:
                ids = rng.sample(ready, rng.randint(1, len(ready)))
                how = rng.choice(["batch", "token", "tokens"])
                if how == "batch":
                    toks = [rng.randrange(3) for _ in ids]
                    if checked(m.append_batch, ids, toks) is OutOfBlocks:
                        continue
                    for sid, t in zip(ids, toks):
                        seqs[sid][1].append(t)
                        n = len(seqs[sid][1])
                        schedule(sid, n - 1, n)
                else:
                    sid = ids[0]
                    toks = [rng.randrange(3) for _ in range(1 if how == "token" else rng.randint(1, 2 * bs))]
                    call = (lambda: m.append_token(sid, toks[0])) if how == "token" else (
                        lambda: m.append_tokens(sid, toks))
                    if checked(call) is OutOfBlocks:
                        continue
                    seqs[sid][1].extend(toks)
                    n = len(seqs[sid][1])
                    schedule(sid, n - len(toks), n)
            elif op == "prefill":
                mid = [s for s in live if m.num_computed(s) < m.num_tokens(s)]
                if mid:
                    sid = rng.choice(mid)
                    start = m.num_computed(sid)
                    k = rng.randint(1, m.num_tokens(sid) - start)
                    if checked(m.prefill, sid, k) is not OutOfBlocks:
                        schedule(sid, start, start + k)
            elif op == "swap_out" and ready:
                sid = rng.choice(ready)
                if sid in busy:
                    stats["swap_out refused (given work this step)"] += 1
                    before = pickle.dumps(m)
                    with pytest.raises(ValueError):
                        m.swap_out(sid)
                    stats["calls"] += 1
                    assert m.block_table(sid) == pickle.loads(before).block_table(sid)
                    continue
                table = m.block_table(sid)
                out = checked(m.swap_out, sid)
                if out is not OutOfBlocks:
                    stats["swap_out"] += 1
                    if writes or busy:
                        stats["swap_out in a step with admissions or appends"] += 1
                    pending_swaps[sid] = {i: table[i] for i, b in enumerate(m.block_table(sid)) if b < 0}
            elif op == "swap_in" and swapped:
                sid = rng.choice(sorted(swapped))
                loads = m.usage().transfers_to_device
                if checked(m.swap_in, sid) is not OutOfBlocks:
                    stats["swap_in"] += 1
                    del swapped[sid]
                    if m.usage().transfers_to_device > loads:
                        busy.add(sid)  # its loads land at the drain; revived blocks hold it now
            elif op == "free":
                idle = [s for s in seqs if s not in busy and s not in pending_swaps]
                if idle:
                    sid = rng.choice(idle)
                    checked(m.free, sid)
                    swapped.pop(sid, None)
                    del seqs[sid]
        # the drain: transfers (to_host first), copies, then the step's writes
        stats["calls"] += 2
        transfers = m.take_transfers()
        copies = m.take_copies()
        k = sum(t.direction == "to_host" for t in transfers)
        assert all(t.direction == "to_host" for t in transfers[:k])
        moved = {}
        reads = [(t, list(store.block(store.dev, t.src))) for t in transfers[:k]]
        swap_src = {d: sid for sid, pos in pending_swaps.items() for d in pos.values()}
        for t, data in reads:
            filled = [x is not None for x in data]
            w = sum(filled)
            assert w and all(filled[:w]), f"to_host reads device block {t.src}: a slot never written"
            assert t.src in swap_src or w == bs, "an offload reads a block not wholly written"
            store.host[t.dst * bs : (t.dst + 1) * bs] = data
            moved[t.src] = t.dst
            stats["to_host"] += 1
        for sid, pos in pending_swaps.items():
            swapped[sid] = {i: moved[d] for i, d in pos.items()}
        pending_swaps.clear()
        sources = [list(store.block(store.dev, c.src)) for c in copies]
        for t in transfers[k:]:
            store.move(store.host, t.src, store.dev, t.dst)
            stats["to_device"] += 1
        for c, data in zip(copies, sources):
            store.dev[c.dst * bs : (c.dst + 1) * bs] = data
        stats["copies"] += len(copies)
        for sid, start, stop in writes:
            if sid not in seqs:
                continue
            table = m.block_table(sid)
            for pos in range(start, stop):
                store.dev[table[pos // bs] * bs + pos % bs] = (seqs[sid][0], tuple(seqs[sid][1][: pos + 1]))
        m.check_invariants()
        events()
        # every sequence reads back its own chain: device slots through its table, a swapped
        # one's host positions from the host blocks its swap filled
        for sid in seqs:
            n = m.num_computed(sid)
            table = m.block_table(sid)
            got = []
            for pos in range(n):
                b = table[pos // bs]
                if b >= 0:
                    got.append(store.dev[b * bs + pos % bs])
                else:
                    got.append(store.host[swapped[sid][pos // bs] * bs + pos % bs])
            assert got == chain(sid, n), f"seed {seed}: {sid} reads K/V never written or not its own"
        # between steps: forks and frees
        for _ in range(rng.randint(0, 2)):
            live = [s for s in seqs if s not in swapped and m.num_computed(s) == m.num_tokens(s)]
            if live and rng.random() < 0.5:
                parent = rng.choice(live)
                child = next(next_id)
                checked(m.fork, parent, child)
                seqs[child] = (seqs[parent][0], list(seqs[parent][1]))
                stats["fork"] += 1
            elif seqs:
                sid = rng.choice(sorted(seqs))
                checked(m.free, sid)
                swapped.pop(sid, None)
                del seqs[sid]
    return stats


SOAK_CONFIGS = [(policy, algo, caching) for policy in ("write-back", "write-through", "none")
                for algo in ("sha256", "builtin") for caching in (True, False)]


def test_seeded_soak_of_the_host_tier():
    """Deterministic: 12 configurations (write policy x hash x caching) x 4 seeds x 100 steps,
    every call checked (see ``_soak_one``). A few seconds; the totals are printed for the
    record (``pytest -s``)."""
    total = Counter()
    for i, (policy, algo, caching) in enumerate(SOAK_CONFIGS):
        for seed in range(4):
            total += _soak_one(1000 * i + seed, policy, algo, caching, steps=100)
    total["runs"] = len(SOAK_CONFIGS) * 4
    print(dict(total))
    assert total["swap_out"] and total["swap_out refused (given work this step)"] and total["to_device"]
    assert total["swap_out in a step with admissions or appends"]
