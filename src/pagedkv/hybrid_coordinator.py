"""The coordinator of several attention groups (or one that releases): the only loop over groups.

A hybrid model (gpt-oss: sliding window 128 and full attention, alternating; Gemma 3: five
sliding layers of 1,024 per full one; Llama 4: chunked local attention of 8,192) keeps one block
table per group of layers that share an attention type, all drawing block ids from one pool. This
coordinator loops over the groups and asks each group's spec (:mod:`pagedkv.kv_specs`) the rules
of its type; it never looks at a spec's type. What it keeps, and why:

* **One pool for all groups**, so what a window gives back serves the full group's next block;
  a block id is in one group's tables at a time; a call's new blocks are dealt round-robin over
  the groups (two groups, three blocks each: group 0 [0, 2, 4], group 1 [1, 3, 5]).
* **One hash chain per sequence**, serving every group; the cache key is ``(group, hash)``.
* **Release as the window moves**: a group lets go of the blocks its spec puts behind the next
  query (committed positions c = ``num_computed`` minus drafts) at the sequence's next call that
  schedules positions, before that call allocates (not earlier: the step that still reads them
  has not run). A decode step makes every release of the batch before it takes any block.
* **The hit rule**: a hit of h tokens needs, per group, the blocks its spec's ``hit_blocks(h)``
  names, on either tier; the search repeats until the length is stable (as vLLM's does).

Worked example (block size 16, ``[FullAttention(), SlidingWindow(128)]``, a 1,000-token prompt
admitted whole, then one decode token): the admission takes 63 blocks per group (the step's
queries read every position); the first append releases the sliding group's blocks 0 .. 53
(position 1,000 reads 873 .. 1,000), so the sequence holds 63 + 9 blocks, not 126.
"""
from __future__ import annotations

from itertools import chain
from typing import Hashable, Sequence

from .checks import require
from .copy_queue import CopyQueue
from .coordinator import Coordinator
from .hashing import BlockHasher, filled_columns
from .host_tier import HostTier
from .pending_events import EventLog
from .pool import BlockPool
from .prefix_cache import PrefixCache
from .sequence import Seq
from .state_groups import StateGroups
from .types import TO_HOST, OutOfBlocks, PrefixHit, Transfer

__all__ = ["HybridCoordinator"]


class HybridCoordinator(Coordinator):
    """A table per attention group over one pool; keys ``(group, hash)``."""

    releases = True

    def __init__(self, pool: BlockPool, cq: CopyQueue, hasher: BlockHasher, root: Hashable, block_size: int,
                 specs: tuple, caching: bool, events: bool, host_blocks: int, policy: str,
                 window_eviction: str) -> None:
        if host_blocks and any(spec.holds_state for spec in specs):
            raise ValueError("host_blocks with a RecurrentState group is not supported yet: swaps and host "
                             "hits of state blocks are not built; use host_blocks=0")
        log = EventLog(events and caching, specs, keyed=True)
        hosted = bool(host_blocks) and caching and policy != "none"
        cache = PrefixCache(pool, log, "GPU", keep_content=hosted, track_twins=True) if caching else None
        if hosted:
            tier = HostTier(host_blocks, block_size, log, policy, True, device=cache, root=None,
                            anchor=self._host_anchor, tag=self._tag_host)
            cache.forward_evictions(tier.offload)
        else:
            tier = HostTier(host_blocks, block_size, None, policy, caching=False) if host_blocks else None
        super().__init__(pool, cq, hasher, root, block_size, specs, log, cache, tier, window_eviction)
        self.hosted = hosted
        self.write_through = hosted and policy == "write-through"
        self.ng = len(specs)
        self.kept = [spec.kept_blocks(block_size) for spec in specs]
        self.full0 = next((g for g, s in enumerate(specs) if s.reads_whole_prefix), None)
        self.low0 = [0 if spec.holds_state else spec.released_below(0, block_size) for spec in specs]
        held = tuple((g, spec) for g, spec in enumerate(specs) if spec.holds_state)
        self.states = StateGroups(self, held) if held else None
        self.nkv = len(self.kv)

    def key(self, g: int, h: Hashable) -> tuple:
        return (g, h)

    def group_of_key(self, key: tuple) -> int:
        return key[0]

    def rehash(self, parent, *rest):
        return (parent[0], self.hasher.rehash(parent[1], *rest))

    def _host_anchor(self, key: tuple, parent: tuple) -> tuple | None:
        """Reachability of a host block under ``key = (g, h)``: a group that reads the whole
        prefix needs its parent ``(g, previous hash)`` on a tier (none for a first block); a
        group that releases needs the first whole-prefix group's block of the same hash,
        ``(f, h)``: its own chain has released holes, and a hit past position i needs ``(f,
        h_i)`` anyway. With no such group: none (LRU only). Example ([Full, Sliding(8)]): host
        (1, h3) is dropped when (0, h3) leaves both tiers."""
        g = key[0]
        if self.specs[g].reads_whole_prefix:
            return None if parent[1] == self.root else parent
        return None if self.full0 is None else (self.full0, key[1])

    def _tag_host(self, host_blocks: list, keys: list) -> None:
        group = self.host_group
        for hb, k in zip(host_blocks, keys):
            group[hb] = k[0]

    def _deal(self, new: list, counts: list) -> list:
        """``new`` blocks dealt round-robin to the K/V groups, ``counts[i]`` each."""
        if len(set(counts)) == 1:
            n = len(counts)
            return [new[i::n] for i in range(n)]
        out: list = [[] for _ in counts]
        it = iter(new)
        for i in range(max(counts)):
            for g, c in enumerate(counts):
                if i < c:
                    out[g].append(next(it))
        return out

    # ---- the hit search ----------------------------------------------------------------------

    def _hits(self, hashes: list, limit: int) -> tuple[int, list]:
        """The longest hit (in blocks, at most ``limit``) valid for every group, on either tier,
        and per group ``(block, on_host)`` for the blocks its spec's ``hit_blocks`` names. A
        group that reads the whole prefix walks its chain; the others shorten the hit to their
        first miss, repeated until the length is stable. Example ([Full, Sliding(8)], block
        size 4, a 13-token prompt whose 3 full blocks were evicted to the host): k = 3, group 0
        [(h0, host), (h1, host), (h2, host)], group 1 the last two."""
        dget, bs = self.cache.get, self.bs
        hget = self.tier.block_of if self.hosted else None
        memo: list[dict] = [{} for _ in self.specs]

        def get(g: int, i: int):
            seen = memo[g]
            if i in seen:
                return seen[i]
            key = (g, hashes[i])
            b = dget(key)
            if b is not None:
                r = (b, False)
            elif hget is not None:
                hb = hget(key)
                r = None if hb is None else (hb, True)
            else:
                r = None
            seen[i] = r
            return r

        k = limit
        for g, spec in enumerate(self.specs):
            if spec.reads_whole_prefix:
                i = 0
                while i < k and get(g, i) is not None:
                    i += 1
                k = i
        shortening = self.local + (self.states.groups if self.states is not None else ())
        stable = not k  # nothing to shorten
        while not stable:
            stable = True
            for g, spec in shortening:
                shorter = spec.shorten_hit(k, bs, lambda i, g=g: get(g, i))
                if shorter != k:
                    k, stable = shorter, False
                    break
        return k, [[get(g, i) for i in spec.hit_blocks(k * bs, bs)] for g, spec in enumerate(self.specs)]

    def _hit_split(self, k: int, hits: list) -> PrefixHit:
        """The hit of ``k`` blocks as device and host tokens: a position's block counts as host
        when some group loads it; ``revived`` counts the device hit blocks now cached-free.
        Example (block size 4, k = 3, group 0 loads blocks 1 and 2, group 1 loads block 2):
        PrefixHit(4 device, 8 host)."""
        bs = self.bs
        loaded = set()
        device = []
        for g, spec in enumerate(self.specs):
            for i, (b, on_host) in zip(spec.hit_blocks(k * bs, bs), hits[g]):
                if on_host:
                    loaded.add(i)
                else:
                    device.append(b)
        return PrefixHit((k - len(loaded)) * bs, len(loaded) * bs, self.pool.count_cached(device))

    def lookup(self, hashes: list, limit: int) -> PrefixHit:
        return self._hit_split(*self._hits(hashes, limit))

    # ---- admission and prefill ---------------------------------------------------------------

    def admit(self, seq_id: Hashable, tokens, hashes: list, keys, prefill: int | None,
              reserve: bool) -> tuple[Seq, int, bool]:
        """Each group takes the hit blocks its spec needs (its other entries below the hit read
        -1) and a block for every position of the first chunk: the chunk's queries read back
        into the window, so every group holds the chunk. The capacity check is per chunk, so a
        long prompt under a small window prefilled in chunks needs only the window and one
        chunk. Example (block size 4, ``[Full, Sliding(8)]``, 9 tokens, nothing cached, pool
        fresh): tables [0, 2, 4] and [1, 3, 5]; returns 0 hit tokens."""
        if reserve:
            raise ValueError("reserve=True does not take groups that release blocks: a window group would "
                             "hold, from admission, the blocks its window releases before they are read; "
                             "admit the prompt chunk by chunk with prefill=k instead")
        n, bs, cache, specs = len(tokens), self.bs, self.cache, self.specs
        k = 0
        rows: list = [[] for _ in specs]
        loads: list = []  # (group, index, host block)
        if cache is not None:
            k, pairs = self._hits(hashes, (n - 1) // bs)
            for g, spec in enumerate(specs):
                for i, (b, on_host) in zip(spec.hit_blocks(k * bs, bs), pairs[g]):
                    if on_host:
                        loads.append((g, i, b))
                    rows[g].append(-1 if on_host else b)
        hit = k * bs
        computed = n if prefill is None else hit + min(prefill, n - hit)
        counts = [specs[g].new_blocks(hit, computed, bs) for g in self.kv]
        fresh = sum(counts)
        # the first call writes a new state entry (taken by the state groups after this)
        state_fresh = len(self.states.groups) if self.states is not None and computed > hit else 0
        acquire = [b for b in chain.from_iterable(rows) if b >= 0]
        what = f"admitting {seq_id!r}"
        j = len(loads)
        if loads:
            try:
                self.cq.check_room(fresh + state_fresh, j, what, acquire)
            except OutOfBlocks as e:
                # the j load destinations are the hit's fixed cost: needed and available count
                # the chunk's blocks only, so that a caller sizing the chunk from ``available``
                # gets one that fits
                if fresh == 0:
                    raise
                raise OutOfBlocks(e.needed - j, max(0, e.available - j), what) from None
            self.tier.pin([hb for _, _, hb in loads])
            dst, new = self.cq.allocate(fresh, j, acquire)
            self.tier.load_hits([hb for _, _, hb in loads], dst, self._hit_split(k, pairs).host)
        else:
            if state_fresh:
                self.cq.check_room(fresh + state_fresh, 0, what, acquire)
            new = self.cq.fresh(fresh, "admitting", seq_id, acquire)
        dealt = self._deal(new, counts)
        if not k and self.states is None:  # nothing hit: each group's table is its new blocks
            tables, low = dealt, list(self.low0)
        else:
            tables = []
            for spec, row in zip(specs, rows):
                table = [-1] * k
                for i, b in zip(spec.hit_blocks(hit, bs), row):
                    table[i] = b
                tables.append(table)
            for (g, i, _), d in zip(loads, dst if loads else ()):
                tables[g][i] = d
            for g, mine in zip(self.kv, dealt):
                tables[g] += mine
            low = [spec.released_below(hit, bs) if not spec.holds_state else 0 for spec in specs]
            if self.states is not None:
                self.states.admit(tables, k, rows)
        s = Seq(tables, low, tokens, hashes, keys, unscheduled=n - computed, written=k)
        if self.states is not None and computed > hit:
            self.states.schedule(s, hit, computed)
        if cache is not None:
            for g, i, _ in loads:
                self.publish_loaded(s, g, i, s.tables[g][i])
            self.publish_run(s, k, computed // bs)
            cache.record_query(n, hit)
        if not s.unscheduled:
            self.arm(s)
        return s, hit, bool(computed > hit or loads)

    def prefill(self, s: Seq, start: int, stop: int, seq_id: Hashable) -> None:
        """The releases due, then every group's blocks for positions ``start .. stop - 1``."""
        bs, states = self.bs, self.states
        counts = [self.specs[g].new_blocks(start, stop, bs) for g in self.kv]
        due = self._due(s)
        fresh, copies = sum(counts), 0
        gain = self._gain(((s, due),)) if due else []
        if states is not None:
            sf, copies = states.needs(s, start, stop)
            fresh += sf
            gain += self.pool.freed_by({b: 1 for b in states.due(s, start)})
        if fresh or copies or gain:
            self.cq.check_room(fresh, copies, f"prefilling {seq_id!r}", (), gain)
        if due:
            self._release(s, due)
        if states is not None:
            states.release(s, start)
        kv_fresh = sum(counts)
        if kv_fresh:
            for g, mine in zip(self.kv, self._deal(self.cq.allocate(kv_fresh, 0)[1], counts)):
                s.tables[g] += mine
        if states is not None:
            states.schedule(s, start, stop)

    # ---- releases ----------------------------------------------------------------------------

    # ---- the decode path ---------------------------------------------------------------------

    def arm(self, s: Seq) -> None:
        """The fast path of a fully scheduled sequence without drafts: the next slot, valid
        while every group's last block is partial and private and no release falls due."""
        bs = self.bs
        c = len(s.tokens)
        off = c % bs
        s.nxt = -1
        if not off or self._due(s):
            return
        rc = self.pool.refcount
        for t in s.tables:
            if rc(t[-1]) != 1:
                return
        end_c = c - off + bs
        for g, spec in self.local:
            r = spec.next_release(c, bs, end_c)
            if r < end_c:
                end_c = r
        if self.states is not None:
            end_c = min(end_c, self.states.fast_path_end(c))
            if end_c <= c:
                return
        s.shared = False
        s.nxt = s.table[-1] * bs + off
        s.end = s.nxt + end_c - c

    def step_room(self, ss: Sequence[Seq], what: str) -> None:
        """Before a decode step of ``ss``: OutOfBlocks (nothing changed) unless one token each
        fits, counting the blocks the due releases free; then every due release, before any
        block is taken, so that they serve the step rather than an eviction of a cached block.
        (The facade skips this pass when clean blocks cover the step: then no allocation
        evicts, and the slow path makes each release in turn.)"""
        slow = [s for s in ss if s.nxt < 0]
        if not slow:
            return
        dues = [(s, d) for s in slow for d in (self._due(s),) if d]
        fresh, copies = self._needs(slow)
        gain = self._gain(dues) if dues else []
        states = self.states
        if states is not None:
            gain += self.pool.freed_by({b: 1 for s in slow for b in states.due(s, len(s.tokens))})
        if fresh or copies:
            self.cq.check_room(fresh, copies, what, (), gain)
        for s, d in dues:
            self._release(s, d)
        if states is not None:
            for s in slow:
                states.release(s, len(s.tokens))

    def grow(self, s: Seq) -> int:
        """The next token's slot with no release (the caller made those due): the slow path
        of ``append_tokens``, whose later tokens must not release what its earlier ones read."""
        return self.slot_slow(s, False)

    def slot_slow(self, s: Seq, release: bool = True) -> int:
        """The next token's slot (group 0's) when the fast path cannot tell. With ``release``
        (a decode token): make the releases due (capacity is the caller's to check, counting
        them) and apply the call to the state groups. Then a fresh block per K/V group at a
        block end, or a copy of each shared partial last block, and the fast path armed up to
        the block's end or the next release or state boundary, whichever comes first."""
        bs = self.bs
        c = len(s.tokens)
        off = c % bs
        end_c = c - off + bs
        states = self.states
        if release:
            low = s.low
            for g, spec in self.local:
                r, nr = spec.release_step(c, bs, end_c)
                lo = low[g]
                if r > lo:
                    t = s.tables[g]
                    if r == lo + 1 and t[lo] >= 0 and not self.cq.sources and not self.tier and not (
                            self.cache is not None and self.cache.has_twins):
                        b = t[lo]  # one block leaves the window: the common case, inlined
                        t[lo] = -1
                        low[g] = r
                        self.pool.release_all((b,))
                    else:
                        self._release(s, ((g, lo, r),))
                if nr < end_c:
                    end_c = nr if nr > c else c + 1
            if states is not None:
                states.release(s, c)
        tables = s.tables
        if off:
            if s.shared:
                rc = self.pool.refcount
                for g in self.kv:
                    b = tables[g][-1]
                    if rc(b) > 1:
                        self._copy_on_write(s, g, b)
                s.shared = False
        else:
            if self.cq.sources:
                for g, b in zip(self.kv, self.cq.allocate(self.nkv, 0)[1]):
                    tables[g].append(b)
            else:
                one = self.pool.allocate_one
                for g in self.kv:
                    tables[g].append(one())
            s.shared = False
        slot = s.table[-1] * bs + off
        if release and states is not None:
            states.schedule(s, c, c + 1)
            end_c = min(end_c, states.fast_path_end(c + 1))
        s.end = slot + end_c - c
        return slot

    def _copy_on_write(self, s: Seq, g: int, old: int) -> None:
        new = self.cq.destination()
        self.pool.release(old)
        s.tables[g][-1] = new
        self.cq.add(old, new, g)

    # ---- publishing --------------------------------------------------------------------------

    def publish_run(self, s: Seq, first: int, stop: int) -> None:
        """Offer full blocks ``first .. stop - 1`` of every group (one event per group and run):
        the kept blocks, and the live entries from the group's first live one on (a released
        entry was published when it filled)."""
        if stop <= first:
            return
        bs, cache = self.bs, self.cache
        tokens = s.tokens[first * bs : stop * bs]
        bkeys = None if s.keys is None else s.keys.block_keys(first, stop)
        for g in self.kv:
            kept = min(self.kept[g], stop)
            runs = ((first, kept), (max(first, s.low[g]), stop)) if first < kept else ((max(first, s.low[g]), stop),)
            for a, b in runs:
                if a >= b:
                    continue
                blocks, keys = s.tables[g][a:b], [(g, h) for h in s.hashes[a:b]]
                cache.publish(blocks, keys, (g, s.hashes[a - 1] if a else self.root),
                              tokens[(a - first) * bs : (b - first) * bs], bs,
                              None if bkeys is None else bkeys[a - first : b - first])
                if self.write_through:
                    self.tier.published(blocks, keys)

    def publish_filled(self, filled: Sequence[Seq]) -> None:
        """Each sequence's last block just filled: hash it once, publish it in every group."""
        groups = self.kv
        _, hashes, parents, tokens, keys = filled_columns(filled, self.bs, self.hasher.digest, self.root)
        if self.states is None:
            blocks = [t[-1] for s in filled for t in s.tables]
        else:
            blocks = [s.tables[g][-1] for s in filled for g in groups]
        ghashes = [(g, h) for h in hashes for g in groups]
        self.cache.publish_blocks(blocks, ghashes, [(g, p) for p in parents for g in groups],
                                  [tk for tk in tokens for _ in groups], self.bs,
                                  None if keys is None else [k for k in keys for _ in groups])
        if self.write_through:
            self.tier.published(blocks, ghashes)

    # ---- fork, free, swaps -------------------------------------------------------------------

    def fork(self, p: Seq) -> Seq:
        pool = self.pool
        for t in p.tables:
            pool.incref_all([b for b in t if b >= 0])
        p.nxt = -1
        p.shared = True
        child = Seq([t.copy() for t in p.tables], p.low.copy(), p.tokens[:], p.hashes.copy(), p.keys,
                    written=p.computed // self.bs)
        child.shared = True
        return child

    def take_transfers(self) -> list:
        group = self.host_group
        return [Transfer(t.direction, t.src, t.dst, group[t.dst if t.direction == TO_HOST else t.src])
                for t in self.tier.take_transfers(self.cache)]

    # ---- exports and accounting --------------------------------------------------------------

    def rows(self, ss: Sequence[Seq], g: int, unready: bool, live: bool) -> list:
        """Group ``g``'s rows: the whole table (released entries -1), or only its live pages."""
        if live and self.specs[g].holds_state:
            raise ValueError(f"group {g} holds recurrent states, not pages: use state_indices")
        if live:
            return [[b for b in s.tables[g] if b >= 0] for s in ss]
        return [s.tables[g] for s in ss]

    def usage(self, seqs, group: int | None) -> dict:
        """Block counts over the groups (or group ``group``'s); token figures over the K/V groups
        only: each sequence's positions once in ``logical_tokens``, a position once per K/V group
        holding it in ``stored_tokens`` (a state group's are 0). Example (block size 4, [Full,
        Sliding(4)], one 10-token sequence after one decode append): group 0 holds 3 blocks and
        11 states, group 1 2 blocks and 7."""
        bs, pool, kv = self.bs, self.pool, self.kv
        groups = range(self.ng) if group is None else (group,)
        logical = logical_blocks = 0
        used: set = set()
        used_kv: set = set()
        partial: dict[int, int] = {}
        for s in seqs:
            c = s.computed
            logical += c
            for g in groups:
                t = s.tables[g]
                live = [b for b in t if b >= 0]
                used.update(live)
                logical_blocks += len(live)
                if g in kv:
                    used_kv.update(live)
                    if c % bs and t[-1] >= 0:
                        partial[t[-1]] = c % bs
        nused = len(used) if group is not None else pool.num_used
        kv_used = nused - (len(used) - len(used_kv))
        stored = kv_used * bs - len(partial) * bs + sum(partial.values()) if kv_used else 0
        fields = pool.usage_fields()
        if group is not None:
            keyed = pool.keyed_blocks().items() if self.cache is not None else ()
            fields.update(used_blocks=nused,
                          cached_blocks=sum(1 for b, key in keyed if key[0] == group and pool.is_cached(b)))
        allocated = kv_used * bs
        return dict(fields, block_size=bs, logical_tokens=logical if kv_used or group is None or group in kv else 0,
                    stored_tokens=stored, allocated_slots=allocated,
                    internal_fragmentation=1 - stored / allocated if allocated else 0.0,
                    blocks_saved_by_sharing=logical_blocks - nused)

    def take_copies(self) -> list:
        """The copies to run before this step's writes; the checkpoints the previous calls left
        become findable now (the step that computes them runs after this drain)."""
        if self.states is not None:
            self.states.take_checkpoints()
        return self.cq.take()

    def check_live(self, s: Seq, g: int, start: int, stop: int, seq_id: Hashable) -> None:
        if self.specs[g].holds_state:
            raise ValueError(f"group {g} holds recurrent states, not K/V per position: it has no slots "
                             f"(use state_indices)")
        super().check_live(s, g, start, stop, seq_id)

    def state_indices(self, ss: Sequence[Seq], g: int) -> tuple[list, list]:
        if not self.specs[g].holds_state:
            raise ValueError(f"group {g} is not a recurrent-state group")
        return self.states.indices(ss, g)

    def draft_check(self) -> None:
        if self.states is not None:
            raise ValueError("speculative drafts with a RecurrentState group are not supported yet: the "
                             "states after each draft position need blocks of their own")

    def _own_blocks(self, s: Seq, tables: list, rc) -> list:
        own = [b for g in self.kv for b in tables[g][s.written:] if b >= 0 and rc(b) == 1]
        if self.states is not None:
            own += self.states.unpublish_own(s)
        return own

    def check_invariants(self, host_refs: dict) -> None:
        super().check_invariants(host_refs)
        if self.tier is not None:
            for hb, key in self.tier.cached_keys().items():
                require(type(key) is tuple and len(key) == 2 and 0 <= key[0] < self.ng
                        and self.host_group[hb] == key[0], f"host block {hb}: key {key!r} or its group tag is wrong")
        for c in self.cq.pending():
            require(self.pool.refcount(c.dst) > 0, f"copy destination {c.dst} is free")
