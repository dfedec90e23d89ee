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

from typing import Hashable, Sequence

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
                 specs: tuple, log: EventLog, cache: PrefixCache | None, tier: HostTier | None) -> None:
        self.pool = pool
        self.cq = cq
        self.hasher = hasher
        self.root = root
        self.bs = block_size
        self.specs = specs
        self.log = log
        self.cache = cache
        self.tier = tier

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

    def check_live(self, s: Seq, g: int, start: int, stop: int, seq_id: Hashable) -> None:
        """ValueError when positions ``start .. stop - 1`` include one group ``g`` released."""

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
        log = EventLog(events and caching)
        tiered = host_blocks > 0
        cache = PrefixCache(pool, log, "GPU", keep_content=tiered, track_twins=True) if caching else None
        tier = (HostTier(host_blocks, block_size, log, policy, caching, device=cache, root=root)
                if tiered else None)
        super().__init__(pool, cq, hasher, root, block_size, specs, log, cache, tier)
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
        """OutOfBlocks (nothing changed) unless one token each for ``ss`` fits. A full last block
        needs a fresh block; ``k`` members sharing a partial block held ``r`` times copy
        ``min(k, r - 1)`` times (each writer copies while another holder remains). Example: 3
        forks of one partial block all appending -> 0 fresh, 2 copies."""
        bs, refcount = self.bs, self.pool.refcount
        fresh = 0
        sharers: dict[int, int] = {}
        for s in ss:
            if s.nxt >= 0:  # a fast-path slot: private room in its last block
                continue
            if len(s.tokens) % bs:
                b = s.table[-1]
                if refcount(b) > 1:
                    sharers[b] = sharers.get(b, 0) + 1
            else:
                fresh += 1
        copies = sum(min(k, refcount(b) - 1) for b, k in sharers.items())
        if fresh or copies:
            self.cq.check_room(fresh, copies, what)

    def tokens_room(self, s: Seq, k: int, what: str) -> None:
        n, bs = len(s.tokens), self.bs
        fresh = -(-(n + k) // bs) - -(-n // bs)
        copies = 1 if n % bs and self.pool.refcount(s.table[-1]) > 1 else 0
        if fresh + copies:
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

    def drop_tail(self, s: Seq, keep: int) -> None:
        """Blocks past the first ``keep`` held only dropped drafts: back clean, tail first."""
        dropped = s.table[keep:]
        if dropped:
            del s.table[keep:]
            self.pool.release_all(dropped[::-1])

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

    def free(self, s: Seq, cache: bool) -> None:
        table = s.table
        if s.host is not None:  # swapped out: its host blocks go, its shared device blocks stay
            host = s.host[0]
            self.tier.release([host[i] for i in sorted(host)])
            table = [b for b in table if b >= 0]
        refcount = self.pool.refcount
        if self.cq.sources:
            self.cq.drop_into([b for b in table if refcount(b) == 1])
        tier = self.tier
        unloaded = tier.drop_released_loads(table, refcount) if tier is not None else []
        prefix = self.cache
        if prefix is not None and prefix.has_twins:  # a twin going back clean is no twin
            prefix.forget_twins([b for b in prefix.twins_among(table) if refcount(b) == 1])
        if prefix is not None and (unloaded or not cache):
            # a dropped load never fills its block: like unwritten K/V, it must not stay findable
            mine = unloaded
            if not cache:  # and the blocks after the written prefix, which it computed itself
                mine = mine + [b for b in s.table[s.written :]
                               if b >= 0 and refcount(b) == 1 and b not in unloaded]
            self.unpublish(mine)
            if self.write_through:
                tier.forget_published(mine)
        self.pool.release_all(table[::-1])

    def pending_on(self, s: Seq) -> bool:
        """Whether a pending transfer or copy touches the sequence's blocks."""
        table = s.table
        return self.tier.pending_on(table) or any(map(self.cq.is_destination, table))

    def swap_out(self, s: Seq, seq_id: Hashable) -> None:
        table, refcount, hashed = s.table, self.pool.refcount, self.cache is not None
        private = [i for i, b in enumerate(table) if refcount(b) == 1]
        released = [table[i] for i in private]
        nh = len(s.hashes) if hashed else 0
        hashes = [s.hashes[i] if i < nh else None for i in private]
        host = self.tier.swap_out(released, hashes, f"swapping out {seq_id!r}")
        for i in private:
            table[i] = -1
        s.drop_mirror()
        s.host = [dict(zip(private, host))]
        s.nxt = -1
        if self.cache is not None and self.cache.has_twins:
            self.cache.forget_twins(released)  # (all private: their last reference goes)
        self.pool.release_all(released[::-1])

    def swap_in(self, s: Seq, seq_id: Hashable) -> None:
        nfull = s.computed // self.bs
        host = s.host[0]
        revive, loads = self.tier.plan_swap_in(host, s.hashes, nfull)
        revived = list(revive.values())
        self.cq.check_room(0, len(loads), f"swapping in {seq_id!r}", revived)
        new = self.cq.allocate(0, len(loads), revived)[0]
        table = s.table
        for i, d in revive.items():
            table[i] = d
        for i, d in zip(loads, new):
            table[i] = d
        s.host = None
        self.tier.swap_in([host[i] for i in loads], new, [host[i] for i in revive])
        if self.cache is not None:  # loaded full blocks are findable again, once their K/V is back
            for i, d in zip(loads, new):
                if i < nfull:
                    self.publish_loaded(s, 0, i, d)
        self.arm(s)

    def take_transfers(self) -> list:
        return self.tier.take_transfers(self.cache)

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
