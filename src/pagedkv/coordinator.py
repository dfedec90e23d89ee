"""The coordinator of one full-attention group: the plain model's block tables, with no loop over
groups at all.

A coordinator does, for the manager's facade, everything that depends on the model's attention
groups: the hit search, admission's allocation and table building, publishing, the decode slow
path, releases, fork sharing, the free order, the group side of swaps, the kernel rows, the
block and token counts of ``usage()``. The facade picks one at construction: this one for a
model of one full-attention group (keys are bare chain hashes, one table, nothing released),
:class:`~pagedkv.hybrid_coordinator.HybridCoordinator` for anything else. :class:`Coordinator`
holds what both do the same way. Imports the parts below it (pool, copy queue, prefix cache, host
tier, event log, sequence state, exports); never the facade.
"""
from __future__ import annotations

from array import array
from typing import Hashable, Iterable, Sequence

from .checks import require
from .copy_queue import CopyQueue
from .hashing import BlockHasher, filled_columns
from .host_tier import HostTier
from .pending_events import EventLog
from .pool import BlockPool
from .prefix_cache import PrefixCache
from .sequence import Seq
from .types import PrefixHit

__all__ = ["Coordinator", "UnitaryCoordinator"]


class Coordinator:
    """The parts a coordinator drives and what every coordinator does alike. ``releases`` says
    whether a decode step can make releases due (then the facade always asks
    :meth:`step_room`, which makes them before any block is taken)."""

    releases = False

    def __init__(self, pool: BlockPool, cq: CopyQueue, hasher: BlockHasher, root: Hashable, block_size: int,
                 specs: tuple, log: EventLog, cache: PrefixCache | None, tier: HostTier | None,
                 window_eviction: str) -> None:
        self.pool = pool
        self.cq = cq
        self.hasher = hasher
        self.root = root
        self.bs = block_size
        self.specs = specs
        self.log = log
        self.cache = cache
        self.tier = tier
        # the groups that release blocks (sliding, chunked): (index, spec); none for one full group
        self.local = tuple((g, spec) for g, spec in enumerate(specs)
                           if not spec.reads_whole_prefix and not spec.holds_state)
        # the groups whose tables hold a block per block_size positions (K/V)
        self.kv = tuple(g for g, spec in enumerate(specs) if not spec.holds_state)
        self.states = None  # the recurrent-state groups' tables, when any
        self.window_eviction = window_eviction
        self.write_through = False
        # each host block's group (set when a swap or an offload stores it: a host block is in
        # one group while held), to tag its transfers
        self.host_group = array("i", bytes(4 * tier.num_blocks)) if tier is not None else None

    def reset(self) -> bool:
        """Drop every cached key on both tiers; refused while a block is in use or a transfer is
        pending."""
        tier = self.tier
        if self.pool.num_used or (tier is not None and (tier.num_used or tier.has_pending())):
            return False
        if self.cache is not None:
            self.cache.clear()
            if tier is not None:
                tier.reset()
            if self.log.enabled:
                self.log.cleared()
        return True

    def unpublish(self, blocks: list[int]) -> None:
        """Forget device blocks' keys (their K/V will never be written); with a host tier, host
        blocks anchored on a key that is now on neither tier go with it."""
        tier = self.tier
        gone = [k for k in map(self.pool.key, blocks) if k is not None] if tier is not None else ()
        self.cache.unpublish(blocks)
        if gone:
            tier.drop_orphans(gone)

    def publish_loaded(self, s: Seq, g: int, i: int, block: int) -> None:
        """Block ``i`` of group ``g``, loaded from the host, is findable on the device at once
        (its K/V arrives before the step's reads); a key mapped meanwhile makes it a twin."""
        bs, h = self.bs, s.hashes
        self.cache.publish([block], [self.key(g, h[i])], self.key(g, h[i - 1] if i else self.root),
                           s.tokens[i * bs : (i + 1) * bs], bs,
                           None if s.keys is None else s.keys.block_keys(i, i + 1))

    def key(self, g: int, h: Hashable) -> Hashable:
        """The cache key of chain hash ``h`` in group ``g``."""
        raise NotImplementedError

    def group_of_key(self, key: Hashable) -> int:
        """The group a cache key belongs to."""
        raise NotImplementedError

    # ---- releases, the free order and swaps: the same rules for every configuration ---------

    def _due(self, s: Seq) -> list:
        """``(group, first, stop)`` runs of entries the committed positions let go; changes
        nothing."""
        c = len(s.tokens) - s.unscheduled - s.drafts
        bs, low = self.bs, s.low
        out = []
        for g, spec in self.local:
            r = spec.released_below(c, bs)
            if r > low[g]:
                out.append((g, low[g], r))
        return out

    def _gain(self, runs: Iterable[tuple[Seq, list]]) -> list[int]:
        """Blocks whose last reference these releases drop (they become free)."""
        count: dict[int, int] = {}
        for s, due in runs:
            for g, a, b in due:
                for blk in s.tables[g][a:b]:
                    if blk >= 0:
                        count[blk] = count.get(blk, 0) + 1
        return self.pool.freed_by(count)

    def _release(self, s: Seq, due: list) -> None:
        """Release the runs ``_due`` named: entries read -1, blocks go back (tail first, so that
        within a run the earlier block outlives the later one, as when a sequence is freed)."""
        pool = self.pool
        rc = pool.refcount
        for g, a, b in due:
            table = s.tables[g]
            blocks = [x for x in table[a:b] if x >= 0]
            table[a:b] = [-1] * (b - a)
            s.low[g] = b
            self._let_go(blocks, rc)
            tier = self.tier
            if tier is not None and tier.has_pending():  # a load into a block released before
                unloaded = tier.drop_released_loads(blocks, rc)  # the step ran serves nothing
                if unloaded and self.cache is not None:
                    self.unpublish(unloaded)
            pool.release_all(blocks[::-1])

    def _let_go(self, blocks: list, rc) -> None:
        """Blocks whose last reference is about to go: a pending copy into one has nothing to
        serve (the block is unpublished, its content never arrives), and a twin among them no
        longer holds anything worth its key."""
        cq = self.cq
        if cq.sources:
            into = [b for b in blocks if cq.is_destination(b) and rc(b) == 1]
            if into:
                cq.drop_into(into)
                if self.cache is not None:
                    self.unpublish(into)
        cache = self.cache
        if cache is not None and cache.has_twins:
            cache.forget_twins([b for b in cache.twins_among(blocks) if rc(b) == 1])

    def drop_tail(self, s: Seq, keep: int) -> None:
        """Entries past the first ``keep`` held only dropped drafts: back clean, block i of
        every group before block i - 1."""
        dropped = []
        for t in s.tables:
            dropped.append(t[keep:])
            del t[keep:]
        order = [d[i] for i in range(len(dropped[0]) - 1, -1, -1) for d in dropped]
        if order:
            self._let_go(order, self.pool.refcount)
            self.pool.release_all(order)

    def free(self, s: Seq, cache: bool) -> None:
        """Release every live block of every group, tail first (block i of every group before
        block i - 1). ``cache=False``: the blocks after the written prefix that it alone holds
        are unpublished first."""
        if s.host is not None:
            self.tier.release([hb for mine in s.host for _, hb in sorted(mine.items())])
        tables = s.tables
        rc = self.pool.refcount
        if cache and self.window_eviction == "with_prefix" and self.local and self.cache is not None:
            tables = self._with_released(s)
        order = self._free_order(s, tables)
        self._let_go(order, rc)
        tier = self.tier
        unloaded = tier.drop_released_loads(order, rc) if tier is not None else []
        if self.states is not None:
            self.states.forget_pending(order)
        if self.cache is not None and (unloaded or not cache):
            mine = unloaded
            if not cache:
                gone = set(unloaded)
                mine = mine + [b for b in self._own_blocks(s, tables, rc) if b not in gone]
            if mine:
                self.unpublish(mine)
                if self.write_through:
                    tier.forget_published(mine)
        self.pool.release_all(order)

    def _own_blocks(self, s: Seq, tables: list, rc) -> list:
        """The blocks after the sequence's written prefix that it alone holds."""
        return [b for t in tables for b in t[s.written:] if b >= 0 and rc(b) == 1]

    def take_copies(self) -> list:
        return self.cq.take()

    def state_indices(self, ss: Sequence[Seq], g: int) -> tuple[list, list]:
        raise ValueError(f"group {g} is not a recurrent-state group")

    def draft_check(self) -> None:
        """ValueError when speculative drafts cannot be taken."""

    def _free_order(self, s: Seq, tables: list) -> list:
        """Every live block, tail first: block i of every group before block i - 1."""
        n = max(map(len, tables))
        return [t[i] for i in range(n - 1, -1, -1) for t in tables if i < len(t) and t[i] >= 0]

    def _with_released(self, s: Seq) -> list:
        """The sequence's tables with the full blocks its windows released earlier put back where
        they are still cached-free (revived here; ``free`` releases them again with the rest), so
        a finished prefix's blocks of every group age together.

        Why (``window_eviction="with_prefix"``, the default): a window block released mid-sequence
        is the least recently freed block of its prefix, so plain LRU evicts it first; then the
        prefix's full-attention blocks, all still cached, can hit nothing past the last point a
        whole window survives (the "reuse cliff", vLLM #48435). Re-aged with the prefix, eviction
        takes every group's block i before any group's block i - 1: the cached prefix shortens
        from its tail and every shorter prefix still hits. ``"on_release"`` keeps plain LRU order.
        """
        hashes, revive_keyed = s.hashes, self.pool.revive_keyed
        tables = [list(t) for t in s.tables]
        for g, _spec in self.local:
            table = tables[g]
            stop = min(s.low[g], len(hashes), len(table))
            gone = [i for i in range(stop) if table[i] < 0]
            for i, b in zip(gone, revive_keyed([self.key(g, hashes[i]) for i in gone])):
                if b is not None:
                    table[i] = b
        return tables

    def pending_on(self, s: Seq) -> bool:
        live = [b for t in s.tables for b in t if b >= 0]
        return self.tier.pending_on(live) or any(map(self.cq.is_destination, live))

    def swap_out(self, s: Seq, seq_id: Hashable) -> None:
        """First the releases due (no host block for what the next query no longer reads);
        then, group by group, entries in table order, each private block gets a host block and
        ``Transfer("to_host", block, host, group=g)``, its entry reads -1, and the device block
        is released (tail first over the groups). Example (block size 4, ``[Full,
        Sliding(4)]``, 9 tokens then one decode token: tables [0, 2, 4] and [-1, 3, 5]): five
        host blocks, to_host 0->0, 2->1, 4->2 (group 0) and 3->3, 5->4 (group 1)."""
        due = self._due(s)
        released = {g: range(a, b) for g, a, b in due}
        rc = self.pool.refcount
        moved = [[i for i, b in enumerate(t) if b >= 0 and rc(b) == 1 and i not in released.get(g, ())]
                 for g, t in enumerate(s.tables)]
        device = [s.tables[g][i] for g, idx in enumerate(moved) for i in idx]
        hashes = [None] * len(device)
        if self.cache is not None:
            nfull = s.computed // self.bs
            hashes = [self.key(g, s.hashes[i]) if i < nfull else None for g, idx in enumerate(moved) for i in idx]
        host = self.tier.swap_out(device, hashes, f"swapping out {seq_id!r}")
        if due:
            self._release(s, due)
        s.host = []
        it = iter(host)
        group = self.host_group
        at = {}  # (index, group) -> the device block that entry held
        for g, idx in enumerate(moved):
            table, mine = s.tables[g], {}
            for i in idx:
                hb = mine[i] = next(it)
                group[hb] = g
                at[i, g] = table[i]
                table[i] = -1
            s.host.append(mine)
        s.nxt = -1
        s.drop_mirror()
        order = [at[k] for k in sorted(at, key=lambda k: (-k[0], k[1]))]
        cache = self.cache
        if cache is not None and cache.has_twins:
            cache.forget_twins(cache.twins_among(order))  # (all private: their last reference goes)
        self.pool.release_all(order)

    def swap_in(self, s: Seq, seq_id: Hashable) -> None:
        """Each moved entry gets a device block and ``Transfer("to_device", host, block,
        group=g)``, or, for a full block whose ``(group, hash)`` the device still caches, that
        block (revived, no transfer); loaded full blocks are published again."""
        cache, bs = self.cache, self.bs
        nfull = s.computed // bs
        revive: list[tuple[int, int, int]] = []  # (group, index, device block)
        loads: list[tuple[int, int]] = []  # (group, index)
        for g, mine in enumerate(s.host):
            for i in sorted(mine):
                d = cache.get(self.key(g, s.hashes[i])) if cache is not None and i < nfull else None
                if d is not None and not self.cq.is_destination(d):
                    revive.append((g, i, d))
                else:
                    loads.append((g, i))
        revived = [d for _, _, d in revive]
        self.cq.check_room(0, len(loads), f"swapping in {seq_id!r}", revived)
        new = self.cq.allocate(0, len(loads), revived)[0]
        for g, i, d in revive:
            s.tables[g][i] = d
        for (g, i), d in zip(loads, new):
            s.tables[g][i] = d
        self.tier.swap_in([s.host[g][i] for g, i in loads], new, [s.host[g][i] for g, i, _ in revive])
        s.host = None
        if cache is not None:
            for (g, i), d in zip(loads, new):
                if i < nfull:
                    self.publish_loaded(s, g, i, d)
        self.arm(s)

    def _needs(self, ss: Sequence[Seq]) -> tuple[int, int]:
        """Fresh blocks and copies one token each for ``ss`` takes (the slow ones): a full last
        block needs a block per group; ``k`` members sharing a partial block held ``r`` times
        copy ``min(k, r - 1)`` times."""
        bs, rc, kv, states = self.bs, self.pool.refcount, self.kv, self.states
        fresh = 0
        sharers: dict[int, int] = {}
        for s in ss:
            if s.nxt >= 0:
                continue
            c = len(s.tokens)
            if c % bs:
                for g in kv:
                    b = s.tables[g][-1]
                    if rc(b) > 1:
                        sharers[b] = sharers.get(b, 0) + 1
            else:
                fresh += len(kv)
            if states is not None:  # a new state entry, or the running one written in place
                for g, spec in states.groups:
                    if c % spec.interval == 0:
                        fresh += 1
                    elif rc(s.tables[g][-1]) > 1:
                        b = s.tables[g][-1]
                        sharers[b] = sharers.get(b, 0) + 1
        return fresh, sum(min(k, rc(b) - 1) for b, k in sharers.items())

    def tokens_room(self, s: Seq, k: int, what: str) -> None:
        """Before ``k`` tokens are appended to ``s``: capacity (counting what its due releases
        free), then those releases (and the state groups' entries for the call)."""
        n, bs, specs, states = len(s.tokens), self.bs, self.specs, self.states
        due = self._due(s)
        fresh = sum(specs[g].new_blocks(n, n + k, bs) for g in self.kv)
        rc = self.pool.refcount
        copies = sum(1 for g in self.kv if rc(s.tables[g][-1]) > 1) if n % bs else 0
        gain = self._gain(((s, due),)) if due else []
        if states is not None:
            sf, sc = states.needs(s, n, n + k)
            fresh, copies = fresh + sf, copies + sc
            gain += self.pool.freed_by({b: 1 for b in states.due(s, n)})
        if fresh or copies or gain:
            self.cq.check_room(fresh, copies, what, (), gain)
        if due:
            self._release(s, due)
        s.shared = s.shared or bool(copies)
        if states is not None:
            states.release(s, n)
            states.schedule(s, n, n + k)

    def check_live(self, s: Seq, g: int, start: int, stop: int, seq_id: Hashable) -> None:
        bs = self.bs
        if start < stop and any(b < 0 for b in s.tables[g][start // bs : -(-stop // bs)]):
            raise ValueError(f"positions from {start} of {seq_id!r} are released in group {g} "
                             f"(its live blocks start at position {s.low[g] * bs})")


    def check_invariants(self, host_refs: dict) -> None:
        """The host tier's own check, given the host blocks the swapped-out sequences hold."""
        if self.tier is not None:
            self.tier.check_invariants(host_refs, self.rehash if self.cache is not None else None)
        else:
            require(not host_refs, "a sequence is swapped out without a host tier")
        if self.cache is not None:
            self.cache.check_invariants(self.rehash)

    def rehash(self, parent, *rest):
        return self.hasher.rehash(parent, *rest)


class UnitaryCoordinator(Coordinator):
    """One full-attention group: a table per sequence, keys are bare chain hashes, and every
    per-block decision is the plain model's (no release, no loop over groups)."""

    def __init__(self, pool: BlockPool, cq: CopyQueue, hasher: BlockHasher, root: Hashable, block_size: int,
                 specs: tuple, caching: bool, events: bool, host_blocks: int, policy: str,
                 window_eviction: str) -> None:
        log = EventLog(events and caching, specs, keyed=False)
        tiered = host_blocks > 0
        cache = PrefixCache(pool, log, "GPU", keep_content=tiered, track_twins=True) if caching else None
        tier = (HostTier(host_blocks, block_size, log, policy, caching, device=cache, root=root)
                if tiered else None)
        super().__init__(pool, cq, hasher, root, block_size, specs, log, cache, tier, window_eviction)
        if tier is not None and cache is not None:  # every policy: see HostTier.offload
            cache.forward_evictions(tier.offload)
        self.write_through = tiered and caching and policy == "write-through"

    def key(self, g: int, h: Hashable) -> Hashable:
        return h

    def group_of_key(self, key: Hashable) -> int:
        return 0

    # ---- hits and admission ------------------------------------------------------------------

    def _hits(self, hashes: list, limit: int) -> tuple[list[int], list[int]]:
        """The longest cached prefix: device blocks, then host blocks continuing it."""
        device = self.cache.longest_prefix(hashes, limit)
        if self.tier is None or len(device) == limit:
            return device, []
        return device, self.tier.longest_prefix(hashes[len(device) :], limit - len(device))

    def lookup(self, hashes: list, limit: int) -> PrefixHit:
        device, host = self._hits(hashes, limit)
        bs = self.bs
        return PrefixHit(len(device) * bs, len(host) * bs, self.pool.count_cached(device))

    def admit(self, seq_id: Hashable, tokens, hashes: list, keys, prefill: int | None,
              reserve: bool) -> tuple[Seq, int, bool]:
        """The admission's blocks: the hits (device, then host loads), then fresh blocks for the
        first chunk (or, with ``reserve``, the whole prompt). Returns the sequence, the hit
        tokens, and whether it was given positions or loads this step."""
        n, bs, cache = len(tokens), self.bs, self.cache
        hits: list[int] = []
        loads: list[int] = []  # host blocks continuing the device hits
        if cache is not None:
            hits, loads = self._hits(hashes, (n - 1) // bs)
        hit = (len(hits) + len(loads)) * bs
        computed = n if prefill is None else hit + min(prefill, n - hit)
        need = -(-(n if reserve else computed) // bs) - len(hits)
        if loads:
            j = len(loads)
            self.cq.check_room(need - j, j, f"admitting {seq_id!r}", hits)
            self.tier.pin(loads)
            dst, fresh = self.cq.allocate(need - j, j, hits)
            self.tier.load_hits(loads, dst)
            table = hits + dst + fresh
        else:
            table = hits + self.cq.fresh(need, "admitting", seq_id, hits)
        s = Seq([table], [0], tokens, hashes, keys, unscheduled=n - computed, written=len(hits) + len(loads))
        if cache is not None:
            self.publish_run(s, len(hits), computed // bs)
            cache.record_query(n, hit)
        if not s.unscheduled:
            self.arm(s)
        return s, hit, bool(need)

    def prefill(self, s: Seq, start: int, stop: int, seq_id: Hashable) -> None:
        need = -(-stop // self.bs) - len(s.table)  # < 0 when blocks were reserved at admission
        if need > 0:
            s.add_blocks(self.cq.fresh(need, "prefilling", seq_id))

    # ---- the decode path ---------------------------------------------------------------------

    def arm(self, s: Seq) -> None:
        """The fast path of a fully scheduled sequence without drafts: the next slot, valid to
        the block's end while its partial last block is private."""
        n, bs = len(s.tokens), self.bs
        s.nxt = -1
        if n % bs:
            b = s.table[-1]
            if self.pool.refcount(b) == 1:
                s.nxt = b * bs + n % bs
                s.end = b * bs + bs
                s.shared = False

    def step_room(self, ss: Sequence[Seq], what: str) -> None:
        """OutOfBlocks (nothing changed) unless one token each for ``ss`` fits."""
        fresh, copies = self._needs(ss)
        if fresh or copies:
            self.cq.check_room(fresh, copies, what)

    def slot_slow(self, s: Seq) -> int:
        """Where the next token goes when the fast path cannot tell: a full last block takes a
        fresh block; a partial one a fork may have shared is copied if another table still
        holds it (capacity was checked by the caller). Sets ``end`` to the block's end."""
        bs = self.bs
        off = len(s.tokens) % bs
        if off:
            b = s.table[-1]
            if self.pool.refcount(b) > 1:
                b = self._copy_on_write(s, b)
        else:
            b = self.cq.fresh_one()
            s.add_block(b)
        s.end = b * bs + bs
        s.shared = False
        return b * bs + off

    grow = slot_slow

    def _copy_on_write(self, s: Seq, old: int) -> int:
        """Give ``s`` a private copy of its shared partial last block; returns the new block.
        The copy queue keeps the pending list batch-safe (see :mod:`pagedkv.copy_queue`)."""
        new = self.cq.destination()
        self.pool.release(old)  # still >= 1: another table holds it
        s.set_last(new)
        self.cq.add(old, new)
        return new

    # ---- publishing --------------------------------------------------------------------------

    def publish_run(self, s: Seq, first: int, stop: int) -> None:
        """Offer the sequence's full blocks ``first .. stop - 1`` (chained) to the prefix cache."""
        if stop > first:
            bs = self.bs
            parent = s.hashes[first - 1] if first else self.root
            keys = s.keys
            self.cache.publish(s.table[first:stop], s.hashes[first:stop], parent,
                               s.tokens[first * bs : stop * bs], bs,
                               None if keys is None else keys.block_keys(first, stop))
            if self.write_through:
                self.tier.published(s.table[first:stop], s.hashes[first:stop])

    def publish_filled(self, filled: Sequence[Seq]) -> None:
        """Each sequence's last block just filled: hash it (chained), offer it to the cache. One
        call per decode step, not per block."""
        blocks, hashes, parents, tokens, keys = filled_columns(filled, self.bs, self.hasher.digest, self.root)
        self.cache.publish_blocks(blocks, hashes, parents, tokens, self.bs, keys)
        if self.write_through:
            self.tier.published(blocks, hashes)

    # ---- fork, free, swaps -------------------------------------------------------------------

    def fork(self, p: Seq) -> Seq:
        self.pool.incref_all(p.table)
        p.nxt = -1  # the partial last block, if any, is shared now: the next write decides
        p.shared = True
        mirror = None if p.mirror is None else p.mirror.copy()
        # the parent's step wrote every block it shares: the child's full ones count as written
        child = Seq([p.table.copy()], [0], p.tokens[:], p.hashes.copy(), p.keys, written=p.computed // self.bs,
                    mirror=mirror)
        child.shared = True
        return child

    def take_transfers(self) -> list:
        return self.tier.take_transfers(self.cache)

    def drop_tail(self, s: Seq, keep: int) -> None:
        """Blocks past the first ``keep`` held only dropped drafts (never published, never a
        copy's destination): back clean, tail first."""
        dropped = s.table[keep:]
        if dropped:
            del s.table[keep:]
            self.pool.release_all(dropped[::-1])

    def _free_order(self, s: Seq, tables: list) -> list:
        table = tables[0]
        return table[::-1] if s.host is None else [b for b in reversed(table) if b >= 0]

    # ---- exports and accounting --------------------------------------------------------------

    def rows(self, ss: Sequence[Seq], g: int, unready: bool, live: bool) -> list:
        """Each sequence's int32 table over its scheduled positions (a reserved tail is not
        exported)."""
        if unready:
            bs = self.bs
            return [s.int32_table()[: -(-s.computed // bs)] if s.unscheduled else s.int32_table() for s in ss]
        return [s.int32_table() for s in ss]

    def usage(self, seqs, group: int | None) -> dict:
        """The block and token fields of ``usage()``: stored tokens count each used block once,
        less partial last blocks' empty tails and reserved blocks (held, nothing scheduled in
        them yet). Example (block size 4): one 6-token sequence in [0, 1] -> 6 logical and 6
        stored tokens, 2 blocks, 8 slots."""
        bs, pool = self.bs, self.pool
        used = pool.num_used
        logical = logical_blocks = reserved = 0
        partial: dict[int, int] = {}
        for s in seqs:
            n = len(s.tokens) - s.unscheduled
            if s.host is not None:  # swapped out: only the shared blocks left on the device
                for i, b in enumerate(s.table):
                    if b >= 0:
                        logical += min(bs, n - i * bs)
                        logical_blocks += 1
                        if n - i * bs < bs:
                            partial[b] = n % bs
                continue
            logical += n
            logical_blocks += len(s.table)
            if n % bs:
                partial[s.table[n // bs]] = n % bs
            if s.unscheduled:
                reserved += len(s.table) - -(-n // bs)
        stored = (used - reserved) * bs - len(partial) * bs + sum(partial.values())
        allocated = used * bs
        return dict(block_size=bs, logical_tokens=logical, stored_tokens=stored, allocated_slots=allocated,
                    internal_fragmentation=1 - stored / allocated if allocated else 0.0,
                    blocks_saved_by_sharing=logical_blocks - used, **pool.usage_fields())
