"""The host tier: a second pool of KV blocks in host (CPU) memory, its own prefix cache and LRU,
and the queue of block transfers between it and the device.

Why: when device blocks run out, a paged cache can only forget. An evicted prefix is recomputed
at its next hit, and a preempted sequence is recomputed from scratch. A host pool several times
the device's keeps what the device drops: prefixes evicted from the device are **offloaded**
(write-back: copied out when the device evicts them; write-through: copied out once computed,
so that eviction later costs nothing) and **loaded** back on a hit, and a preempted sequence can
be **swapped** out and back in. Whether a load beats recomputing depends on the link: moving a
block costs a fixed latency plus its bytes over PCIe, so small blocks lose to recompute and
large ones win (the vLLM paper's Fig. 19; ``pagedkv report`` measures the crossover).

The tier is another :class:`~pagedkv.pool.BlockPool` (refcounts, a clean stack, an LRU of
revivable blocks) under another :class:`~pagedkv.prefix_cache.PrefixCache` (hash -> host block,
events tagged ``"CPU"``). A host block is held (one reference) by every swapped-out sequence that
owns it and by every pending transfer that reads or writes it, so that no transfer's host block
is evicted or reused before the engine has run it.

Transfers are drained once per step, like copies, and run before the step's K/V writes:
``to_host`` entries first (they read device blocks that this step may hand to new owners), then
``to_device`` entries (they fill device blocks that this step's attention reads).
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

from .pending_events import EventLog
from .pool import BlockPool
from .prefix_cache import PrefixCache
from .types import TO_DEVICE, TO_HOST, OutOfBlocks, Transfer

__all__ = ["HostTier", "WRITE_POLICIES"]

# write-back: copy a block out when the device evicts it; write-through: once it is computed, and
# again when the device evicts a block the host has dropped since; none: never offload (the host
# takes only swapped-out sequences, vLLM v0's swap space, and their published blocks stay findable).
WRITE_POLICIES = ("write-back", "write-through", "none")


class HostTier:
    """Host blocks, the host prefix cache, and the pending transfers to and from the device.

    The manager owns the device side and tells the tier what the device evicted, published,
    loads and swaps; the tier owns every host block and the transfer queue.
    """

    def __init__(self, num_blocks: int, block_size: int, log: EventLog | None,
                 write_policy: str = "write-back", caching: bool = True,
                 device: PrefixCache | None = None, root: Hashable = None,
                 anchor: Callable[[Hashable, Hashable], Hashable] | None = None,
                 tag: Callable[[list, list], None] | None = None) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"host_write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        self._pool = BlockPool(num_blocks, check_args=False)
        self._cache = PrefixCache(self._pool, log, "CPU", keep_content=True) if caching else None
        # Reachability (see "Every host block is reachable" in :meth:`check_invariants`): the
        # device's prefix cache (None for a tier used alone, which trusts its caller's parents),
        # the chain's root (every prompt's first block chains from it: a salt is a key of block 0,
        # not a root of its own), each parent hash's host children, and the host blocks that are
        # a prompt's first block (their parent is the root).
        self._device = device if caching else None
        self._root = root
        # Optional, for a grouped manager (cache keys ``(group, hash)``): ``anchor(key, parent)``
        # names the key whose presence on a tier keeps a host block reachable (None: none needed,
        # as for a first block); without it a block's anchor is its parent. ``tag(host_blocks,
        # keys)`` is told which key each freshly stored host block holds (the manager tags its
        # transfers with the key's group).
        self._anchor = anchor
        self._tag = tag
        self._kids: dict[Hashable, set[int]] = {}
        self._first: set[int] = set()
        self._gone: list = []  # hashes the host evicted in the allocation under way
        if self._cache is not None:
            self._cache.forward_evictions(self._host_evicted)
        self._bs = block_size
        self._policy = write_policy
        self._to_host: list[Transfer] = []
        self._to_device: list[Transfer] = []
        self._pinned: list[int] = []  # one entry per reference a pending transfer holds
        self._load_dst: dict[int, int] = {}  # device block a pending to_device fills -> host source
        self._store_src: set[int] = set()  # device blocks a pending to_host reads
        self._wt_new: list[tuple[int, Hashable]] = []  # published since the last drain: not computed yet
        self._wt_ready: list[tuple[int, Hashable]] = []  # published before it: computed by now
        self.hit_tokens = 0
        self.to_host_count = 0
        self.to_device_count = 0

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free(self) -> int:
        return self._pool.num_free

    @property
    def num_used(self) -> int:
        return self._pool.num_used

    @property
    def num_cached(self) -> int:
        return self._pool.num_cached

    def has_pending(self) -> bool:
        return bool(self._to_host or self._to_device)

    def pending_on(self, device_blocks: Sequence[int]) -> bool:
        """Whether a pending transfer reads or fills any of ``device_blocks`` (a sequence whose
        blocks are such cannot be swapped out before the drain)."""
        load, store = self._load_dst, self._store_src
        return any(d in load or d in store for d in device_blocks)

    def usage_fields(self) -> dict:
        """The host tier's part of :class:`~pagedkv.types.Usage`, from its own counters."""
        return dict(host_blocks=self.num_blocks, host_used_blocks=self.num_used,
                    host_cached_blocks=self.num_cached, host_hit_tokens=self.hit_tokens,
                    transfers_to_host=self.to_host_count, transfers_to_device=self.to_device_count)

    # ---- reachability ------------------------------------------------------------------------

    def _anchor_of(self, key: Hashable, parent: Hashable) -> Hashable:
        """The key a host block under ``key`` chained from ``parent`` needs on a tier: its
        parent, unless an ``anchor`` function was given (a grouped manager's rule: a sliding
        group's block hangs on the first full group's block of the same hash)."""
        return parent if self._anchor is None else self._anchor(key, parent)

    def _known(self, parent: Hashable) -> bool:
        """Whether a block anchored at ``parent`` would be reachable: the anchor is on the host
        or the device, or is the chain's root (or None). (A tier used alone knows no device: it
        trusts.)"""
        if self._device is None:
            return True
        return (parent is None or parent == self._root or self._cache.get(parent) is not None
                or self._device.get(parent) is not None)

    def _linked(self, host_block: int, parent: Hashable) -> None:
        """Index a block the host just published under its anchor (by default its parent)."""
        kids = self._kids.get(parent)
        if kids is None:
            self._kids[parent] = {host_block}
        else:
            kids.add(host_block)
        if parent is None or parent == self._root:
            self._first.add(host_block)

    def _unlinked(self, host_block: int, parent: Hashable) -> None:
        kids = self._kids.get(parent)
        if kids is not None:
            kids.discard(host_block)
            if not kids:
                del self._kids[parent]
        self._first.discard(host_block)

    def _host_evicted(self, blocks: list, keys: list, contents: list) -> None:
        """The host pool evicted cached blocks to make room and the host cache has forgotten
        them: their hashes are checked for orphaned children once the allocation is complete."""
        for b, k, c in zip(blocks, keys, contents):
            self._unlinked(b, self._anchor_of(k, c[0]))
        self._gone += keys

    def drop_orphans(self, hashes: Sequence[Hashable]) -> None:
        """These hashes just left a tier. Each one now on neither tier takes its host children
        with it, and theirs in turn (unless a child is still on the device): no lookup (a prefix
        walk) and no router (it drops a block whose parent it does not know) could reach them.
        A cached-free child goes back clean; one held by a swapped-out sequence or a pending
        transfer loses only its hash. One ``BlockRemoved`` names them all."""
        kids, cache, device = self._kids, self._cache, self._device
        if not kids or cache is None:
            return
        todo = [h for h in hashes if h in kids and cache.get(h) is None
                and (device is None or device.get(h) is None)]
        drop: list[int] = []
        while todo:
            for hb in sorted(kids.pop(todo.pop(), ())):
                drop.append(hb)
                self._first.discard(hb)
                h = self._pool.key(hb)
                if h in kids and (device is None or device.get(h) is None):
                    todo.append(h)
        if drop:
            cache.unpublish(drop)

    # ---- prefix hits -------------------------------------------------------------------------

    def block_of(self, key: Hashable) -> int | None:
        """The host block cached under ``key`` (None if the host does not hold it)."""
        return self._cache.get(key) if self._cache is not None else None

    def cached_keys(self) -> dict:
        """Every host block that carries a key -> that key (a copy)."""
        return dict(self._pool.keyed_blocks()) if self._cache is not None else {}

    def longest_prefix(self, hashes: Sequence[Hashable], limit: int) -> list[int]:
        """Host blocks holding the first ``k <= limit`` of ``hashes``, for the largest ``k``."""
        if self._cache is None or limit <= 0:
            return []
        return self._cache.longest_prefix(hashes, limit)

    def pin(self, host_blocks: Sequence[int]) -> None:
        """Hold host blocks a load will read (before the device allocation that may offload,
        and so allocate host blocks, can evict them)."""
        if host_blocks:
            self._pool.acquire(host_blocks)
            self._pinned += host_blocks

    def load_hits(self, host_blocks: Sequence[int], device_blocks: Sequence[int], tokens: int | None = None) -> None:
        """An admission's prefix hits on the host (pinned first): ``to_device`` transfers into
        ``device_blocks``, counted as host hit tokens (a block's worth each, unless ``tokens``
        says otherwise: a grouped manager loads a position's block once per group). Example
        (block size 16): two host hits -> two transfers, ``hit_tokens`` up by 32."""
        self.queue_loads(host_blocks, device_blocks)
        self.hit_tokens += len(host_blocks) * self._bs if tokens is None else tokens

    def queue_loads(self, host_blocks: Sequence[int], device_blocks: Sequence[int]) -> None:
        """``to_device`` transfers of pinned host blocks into fresh device blocks."""
        for h, d in zip(host_blocks, device_blocks):
            self._to_device.append(Transfer(TO_DEVICE, h, d))
            self._load_dst[d] = h
        self.to_device_count += len(host_blocks)

    def drop_released_loads(self, device_blocks: Sequence[int], refcount: Callable[[int], int]) -> list[int]:
        """A sequence is freed holding ``device_blocks``: the ones it alone holds (``refcount``
        1) and a pending load fills lose that load (see :meth:`drop_loads_into`). Returns them:
        their K/V never arrives, so the device must not keep them findable."""
        if not (self._to_host or self._to_device):
            return []
        load = self._load_dst
        unloaded = [d for d in device_blocks if d in load and refcount(d) == 1]
        self.drop_loads_into(unloaded)
        return unloaded

    def drop_loads_into(self, device_blocks: Sequence[int]) -> None:
        """Their only holder released these device blocks before the step ran: the loads into
        them have nothing left to serve (and the blocks may be handed out again)."""
        for d in device_blocks:
            h = self._load_dst.pop(d)
            self._to_device.remove(Transfer(TO_DEVICE, h, d))
            self._pinned.remove(h)
            self._pool.release(h)
            self.to_device_count -= 1

    # ---- offloading --------------------------------------------------------------------------

    def offload(self, device_blocks: Sequence[int], hashes: Sequence[Hashable], contents: Sequence[tuple]) -> None:
        """Write-back: the device evicted these cached blocks (one allocation's batch; the
        device cache calls this, see :meth:`PrefixCache.forward_evictions`). Each one
        the host does not hold yet gets a host block (evicting the host's least recently used if
        need be) and a ``to_host`` transfer; with no host block to spare, it is simply forgotten.

        The ones the host holds already are held through the host allocation, so that it cannot
        evict them to make room for the others: the device has just let go of them, and the
        host's copy is the only one left. Afterwards they go back to the host's LRU as its most
        recently used, as the blocks copied out in this batch will at the drain: a prefix the
        device was still caching is not the host's oldest.

        Under ``"none"`` nothing is copied out. Under every policy, host blocks whose parent
        was one of these hashes and is now on neither tier are dropped (see
        :meth:`drop_orphans`).
        """
        cache = self._cache
        if cache is None:
            return
        if self._wt_new or self._wt_ready:  # an evicted block's pending write-through is void
            self.forget_published(device_blocks)  # (the block may come back under the same
            # hash in this very allocation, recomputed: the copy waits for that publication's)
        if self._policy != "none":
            new, held = [], []
            for d, h, c in zip(device_blocks, hashes, contents):
                hb = cache.get(h)
                if hb is None:
                    new.append((d, h, c))
                else:
                    held.append(hb)
            self._store(new, held)
        self.drop_orphans(hashes)

    def _store(self, items: list[tuple[int, Hashable, tuple]], keep: list[int] | None = None) -> None:
        """Copy ``(device block, hash, (parent, tokens))`` items out to fresh host blocks, one
        batch: one host allocation, one publication, one extension of the queue.

        Parents first: an item whose parent hash is another item's comes after it, so the host's
        ``BlockStored`` events never name a parent the router has not been told of (a router
        drops such a block), and consecutive chained blocks share one event. With too few host
        blocks for all, the first ones in that order are kept: the prefixes, since a host block
        whose parent is on neither tier can never be hit (a lookup is a prefix walk). ``keep``:
        host blocks that the allocation must not evict (see :meth:`offload`).

        Reachable by construction: an item whose parent is on neither tier (nor an earlier item,
        nor the chain's root) is not copied out, and the host ancestors of every item (up to the
        first one the device holds) are held through the allocation like ``keep``, so that the
        host never evicts a block's parent to make room for the block itself. Example (host of
        2 blocks holding a1; the device evicts a0 and a2, a2 chained from a1): a1 is held, one
        block is left, a0 is stored and a2 forgotten; before, a1 was evicted for a2, and a2 was
        stored unreachable. Hashes the allocation evicted take their orphans along afterwards.
        """
        pool, cache = self._pool, self._cache
        ordered = _parents_first(items)
        anchor = self._anchor_of
        if self._anchor is not None and ordered:  # blocks anchored off their own chain after
            ordered.sort(key=lambda it: anchor(it[1], it[2][0]) not in (None, it[2][0]))  # the rest
        if self._device is not None and ordered:
            ok, seen = [], set()
            for it in ordered:
                parent = anchor(it[1], it[2][0])
                if parent in seen or self._known(parent):
                    ok.append(it)
                    seen.add(it[1])
            ordered = ok
        hold = list(keep) if keep else []
        if self._device is not None and (ordered or hold):
            held = set(hold)
            key_of = self._pool.key
            starts = ([anchor(it[1], it[2][0]) for it in ordered]
                      + [anchor(key_of(hb), cache.content_of(hb)[0]) for hb in hold])
            for p in starts:  # host ancestors, up to the first one the device holds
                while p is not None and self._device.get(p) is None:
                    hb = cache.get(p)
                    if hb is None or hb in held:
                        break
                    held.add(hb)
                    hold.append(hb)
                    p = anchor(p, cache.content_of(hb)[0])
        room = pool.num_free - (sum(map(pool.is_cached, hold)) if hold else 0)
        n = min(len(ordered), room)
        if n > 0:
            items = ordered[:n]
            host = pool.allocate(n, acquire=hold)  # each one reference: the transfer's pin
        elif hold:
            pool.acquire(hold)
        if hold:
            pool.release_all(hold)  # in the device's eviction order, its oldest first
        gone, self._gone = self._gone, []
        if n > 0:
            cache.publish_chained([(hb, h, *c) for hb, (_, h, c) in zip(host, items)], self._bs)
            for hb, (_, h, c) in zip(host, items):
                self._linked(hb, anchor(h, c[0]))
            if self._tag is not None:
                self._tag(host, [h for _, h, _ in items])
            # the drain releases pins in list order, the first as the oldest: children before
            # their parents, so that the host evicts a chain's tail before its prefix
            self._pinned += host[::-1]
            self._to_host += [Transfer(TO_HOST, d, hb) for hb, (d, _, _) in zip(host, items)]
            self._store_src.update(d for d, _, _ in items)
            self.to_host_count += n
        if gone:
            self.drop_orphans(gone)

    def published(self, device_blocks: Sequence[int], hashes: Sequence[Hashable]) -> None:
        """Write-through: remember blocks the device published this step; their K/V exists
        once the step has run, so they are copied out at the next drain but one. A block whose
        hash the device cache already mapped to another block (a twin) was not published and
        is not remembered: should it be published later, that publication starts its wait."""
        device = self._device
        self._wt_new += [(d, h) for d, h in zip(device_blocks, hashes) if device is None or device.get(h) == d]

    def _write_through(self, device_cache: PrefixCache) -> None:
        """Copy out the blocks published the step before last. A hash whose block left the
        device map meanwhile, with a live twin taking it over (see the prefix cache), is copied
        from the twin, two drains from now: the twin may have been filled this very step, so
        its K/V is trusted only once a step has run since (a later copy, never an unwritten one)."""
        cache, store, later = self._cache, [], []
        for d, h in self._wt_ready:
            if cache.get(h) is not None:
                continue
            mapped = device_cache.get(h)
            if mapped == d:
                store.append((d, h, device_cache.content_of(d)))
            elif mapped is not None:
                later.append((mapped, h))
        self._store(store)
        self._wt_ready, self._wt_new = self._wt_new + later, []

    def forget_published(self, device_blocks: Sequence[int]) -> None:
        """Unpublished device blocks (their K/V was never computed): no write-through."""
        if self._wt_new or self._wt_ready:
            gone = set(device_blocks)
            self._wt_new = [e for e in self._wt_new if e[0] not in gone]
            self._wt_ready = [e for e in self._wt_ready if e[0] not in gone]

    # ---- swapping ----------------------------------------------------------------------------

    def swap_out(self, device_blocks: Sequence[int], hashes: Sequence[Hashable | None], what: str) -> list[int]:
        """Host blocks for a swapped-out sequence's private device blocks (one reference each,
        the sequence's), with their ``to_host`` transfers. ``hashes``: each block's chained hash
        (None for a block not full). A block the device cache maps under its hash is published
        on the host too, with the device's kept content, so later prompts can load it. Atomic:
        OutOfBlocks if the host has too few free blocks."""
        device = self._device
        contents = []
        if device is not None:  # only blocks the device really publishes under their hash
            hashes = [h if h is not None and device.get(h) == d else None for d, h in zip(device_blocks, hashes)]
            contents = [device.content_of(d) if h is not None else None for d, h in zip(device_blocks, hashes)]
        else:
            hashes = contents = [None] * len(device_blocks)
        n = len(device_blocks)
        try:
            host = self._pool.allocate(n)
        except OutOfBlocks as e:
            raise OutOfBlocks(e.needed, e.available, f"{what} (host tier)") from None
        self._pool.incref_all(host)  # the transfers' pins, on top of the sequence's reference
        self._pinned += host
        cache = self._cache
        for d, hb, h, c in zip(device_blocks, host, hashes, contents):
            self._to_host.append(Transfer(TO_HOST, d, hb))
            self._store_src.add(d)
            # published only where reachable (a twin's child may chain from an evicted hash)
            if h is not None and cache is not None and cache.get(h) is None and self._known(self._anchor_of(h, c[0])):
                cache.publish([hb], [h], c[0], c[1], self._bs, c[2:] or None)
                self._linked(hb, self._anchor_of(h, c[0]))
        self.to_host_count += n
        gone, self._gone = self._gone, []
        if gone:
            self.drop_orphans(gone)
        return host

    def swap_in(self, host_blocks: Sequence[int], device_blocks: Sequence[int], revived: Sequence[int] = ()) -> None:
        """The swapped sequence's host blocks go back into ``device_blocks``: ``to_device``
        transfers (pinning the host blocks until drained), and the sequence lets go of them and
        of ``revived`` (host blocks whose content the device still had)."""
        self.pin(host_blocks)
        self.queue_loads(host_blocks, device_blocks)
        self.release(host_blocks)
        if revived:
            self.release(revived)

    def release(self, host_blocks: Sequence[int]) -> None:
        """A sequence lets go of host blocks (freed while swapped out, or swapped back in)."""
        self._pool.release_all(list(host_blocks)[::-1])

    # ---- drain -------------------------------------------------------------------------------

    def take_transfers(self, device_cache: PrefixCache | None) -> list[Transfer]:
        """Every pending transfer, ``to_host`` first; releases the pins they held."""
        if self._wt_ready and device_cache is not None:
            self._write_through(device_cache)
        elif self._wt_new or self._wt_ready:
            self._wt_ready, self._wt_new = self._wt_new, []
        out = self._to_host + self._to_device
        self._to_host, self._to_device, self._load_dst, self._store_src = [], [], {}, set()
        if self._pinned:
            pinned, self._pinned = self._pinned, []
            self._pool.release_all(pinned)
        return out

    def reset(self) -> bool:
        """Drop every cached host block; refused while a host block is held."""
        if self._pool.num_used:
            return False
        if self._cache is not None:
            self._cache.clear()
            self._kids.clear()
            self._first.clear()
        self._wt_new, self._wt_ready = [], []  # the device forgot them too: nothing to copy
        return True

    # ---- checks ------------------------------------------------------------------------------

    def check_invariants(self, swapped_refs: dict[int, int],
                         block_hash: Callable[[Hashable, Any], Hashable] | None = None) -> None:
        """The host pool's own states; each host block's refcount equals the swapped-out
        sequences holding it plus the pending transfers pinning it; each direction of the
        pending transfers is batch-safe; and, given ``block_hash(parent, tokens)`` (the
        manager's hash function: the tier does not hash), every cached host block's kept tokens
        chained from its kept parent give its hash. ``swapped_refs`` maps a host block to the
        swapped-out sequences holding it."""
        if not isinstance(swapped_refs, dict):
            raise ValueError(f"swapped_refs must be a dict, got {type(swapped_refs).__name__}")
        if block_hash is not None and not callable(block_hash):
            raise ValueError(f"block_hash must be a callable or None, got {type(block_hash).__name__}")
        self._pool.check_invariants()
        if self._cache is not None:
            self._cache.check_invariants(block_hash)
        refs = dict(swapped_refs)
        for h in self._pinned:
            refs[h] = refs.get(h, 0) + 1
        for b, c in enumerate(self._pool.refcounts()):
            if refs.get(b, 0) != c:
                raise AssertionError(f"host block {b}: refcount {c}, held {refs.get(b, 0)} times")
        for batch in (self._to_host, self._to_device):  # sources and destinations live in
            dsts = [t.dst for t in batch]  # different tiers: a destination twice is the hazard
            if len(set(dsts)) != len(dsts):
                raise AssertionError("a block is a transfer destination twice")
        if self._load_dst != {t.dst: t.src for t in self._to_device}:
            raise AssertionError("load index differs from the pending loads")
        if self._store_src != {t.src for t in self._to_host}:
            raise AssertionError("store index differs from the pending stores")
        self._check_reachable()

    def _check_reachable(self) -> None:
        """Every host block is reachable: its parent is on the host or the device, or it is a
        prompt's first block; and the child index is the host content's."""
        cache = self._cache
        if cache is None:
            return
        kids: dict = {}
        mapped = self._pool.keyed_blocks()  # host block -> its hash (one bijection with the map)
        for hb, key in mapped.items():
            parent = self._anchor_of(key, cache.content_of(hb)[0])
            kids.setdefault(parent, set()).add(hb)
            if (parent is None or parent == self._root) != (hb in self._first):
                raise AssertionError(f"host block {hb}: its first-block mark differs from its anchor")
            if self._device is not None and not (
                    hb in self._first or cache.get(parent) is not None or self._device.get(parent) is not None):
                raise AssertionError(f"host block {hb} is unreachable: its parent is on neither tier "
                                     f"and it is not a first block")
        if kids != self._kids:
            raise AssertionError("the host's child index differs from its content")
        if not self._first <= mapped.keys():
            raise AssertionError("a first-block mark outlived its host block")


def _parents_first(items: list[tuple[int, Hashable, tuple]]) -> list[tuple[int, Hashable, tuple]]:
    """``(block, hash, (parent, tokens))`` items reordered so that each comes after the item
    whose hash is its parent: depth first from the items whose parent is not among them, each
    chain unbroken (so that it can be one event), siblings and roots in their given order.

    Why not sorted by position: the items come from the device's LRU, in which a sequence freed
    tail first lies child before parent, and one batch may hold several chains. Unchanged (the
    same list) when no item's parent is another's, as in most batches. An item on a cycle of
    hashes (only a hash collision could make one) is appended at the end rather than lost.
    """
    index = {h: i for i, (_, h, _) in enumerate(items)}
    children: dict[int, list[int]] = {}
    roots = []
    for i, (_, _, c) in enumerate(items):
        p = index.get(c[0])
        if p is None or p == i:
            roots.append(i)
        else:
            children.setdefault(p, []).append(i)
    if not children:
        return items
    out: list[int] = []
    stack = roots[::-1]
    while stack:
        i = stack.pop()
        out.append(i)
        kids = children.get(i)
        if kids:
            stack += kids[::-1]
    if len(out) < len(items):
        seen = set(out)
        out += [i for i in range(len(items)) if i not in seen]
    return [items[i] for i in out]
