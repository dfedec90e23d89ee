"""CopyQueue: the pending copy-on-write copies, and the one allocation rule around them.

The manager queues a copy when a sequence writes into a partial block another table still
holds (copy-on-write); the engine drains the list once per step (``take_copies``) and runs it as
one batched kernel before the step's K/V writes. This module owns that list, its two indexes
(destination -> source, source -> how many pending copies read it), and every allocation made
while copies are pending, because those are the allocations the copies constrain.

The rule. A call takes two kinds of device blocks. ``fresh`` blocks are written by this step's
K/V, after the copies run; ``avoiding`` blocks are written before them: copy-on-write
destinations, and host loads (transfers run before copies). A freed block that a pending copy
still reads must keep its bytes until the copies run, so it may be a fresh block but never an
avoiding one. With F free blocks of which S are such freed copy sources, a call can be served
exactly when ``fresh + avoiding <= F`` and ``avoiding <= F - S``; it is, whatever order the call
takes its blocks in, because every fresh block takes a freed source while one is left
(:meth:`take`). Example: free blocks {0, 3}, a copy reads 0, a call needs one fresh block and
one copy: the copy takes 3, the fresh position 0.

The pending list is batch-safe for one kernel: no block is a destination twice, and no
destination is the source of another copy (a copy of a pending destination reads that copy's
source instead: the same bytes, as running them in order would give).
"""
from __future__ import annotations

from collections import Counter
from typing import Collection, Hashable, Iterable, Sequence

from .checks import require
from .pool import BlockPool
from .types import CopyOp, OutOfBlocks

__all__ = ["CopyQueue"]


class CopyQueue:
    """Pending copies over ``pool``'s blocks; every allocation while some are pending.

    ``sources`` (block -> pending copies reading it) is public so that a hot path can ask
    "is any copy pending?" with one attribute load; only this class writes it.
    """

    __slots__ = ("_pool", "_copies", "_dst", "sources", "queued")

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._copies: list[CopyOp] = []
        self._dst: dict[int, int] = {}  # destination -> its source
        self.sources: dict[int, int] = {}  # source -> how many pending copies read it
        self.queued = 0  # copy-on-write copies queued since construction (Usage.cow_copies)

    # ---- the queue ---------------------------------------------------------------------------

    def add(self, old: int, new: int, group: int = 0) -> None:
        """Queue the copy of ``old`` into ``new`` (a destination from :meth:`destination`);
        ``group`` is the attention group whose table holds it (a grouped manager's)."""
        src = self._dst.get(old, old)
        self._copies.append(CopyOp(src, new, group))
        self._dst[new] = src
        self.sources[src] = self.sources.get(src, 0) + 1
        self.queued += 1

    def is_destination(self, block: int) -> bool:
        return block in self._dst

    def drop_into(self, blocks: Iterable[int]) -> None:
        """Their only holder releases ``blocks`` before the step ran: pending copies into them
        have nothing left to serve (and the blocks may be handed out again)."""
        dst_index, sources = self._dst, self.sources
        if not dst_index:
            return
        dropped = [b for b in blocks if b in dst_index]
        for dst in dropped:
            src = dst_index.pop(dst)
            left = sources[src] - 1
            if left:
                sources[src] = left
            else:
                del sources[src]
        if dropped:
            gone = set(dropped)
            self._copies = [c for c in self._copies if c.dst not in gone]

    def pending(self) -> list[CopyOp]:
        """The pending copies, in the order they were queued (a copy of the list)."""
        return list(self._copies)

    def take(self) -> list[CopyOp]:
        """Drain the pending copies, in the order they were queued."""
        copies, self._copies = self._copies, []
        self._dst, self.sources = {}, {}
        return copies

    # ---- the allocation rule -----------------------------------------------------------------

    def freed_sources(self, revived: Collection[int] = (), gain: Collection[int] = ()) -> list[int]:
        """Free blocks a pending copy still reads (none of ``revived``: hits about to be taken;
        ``gain``: blocks about to be freed first, by a grouped manager's window releases)."""
        refcount = self._pool.refcount
        return [b for b in self.sources if (not refcount(b) or b in gain) and b not in revived]

    def check_room(self, fresh: int, avoiding: int, what: str, acquire: Sequence[int] = (),
                   gain: Collection[int] = ()) -> None:
        """Raise OutOfBlocks (changing nothing) unless :meth:`allocate` ``(fresh, avoiding,
        acquire)`` can be served. ``available`` is ``min(F, fresh + F - S)``, the blocks this
        call's shape can use, so that releasing ``needed - available`` ordinary blocks always
        makes it fit. Example: F = 2 with S = 1 and a call of one copy only: available 1.
        ``gain``: blocks the call frees before it allocates (a grouped manager's window
        releases), counted as free."""
        pool = self._pool
        free = pool.num_free - (pool.count_cached(acquire) if acquire else 0) + len(gain)
        available = free
        if avoiding and self.sources:
            usable = free - len(self.freed_sources(set(acquire) if acquire else (), gain))
            available = min(free, fresh + usable)
        if fresh + avoiding > available:
            raise OutOfBlocks(fresh + avoiding, available, what)

    def allocate(self, fresh: int, avoiding: int, acquire: Sequence[int] = ()) -> tuple[list[int], list[int]]:
        """``(avoiding blocks, fresh blocks)``, after one more reference to each of ``acquire``
        (prefix hits). Fresh blocks take the freed copy sources first. Call it after
        :meth:`check_room` (or for one block, whose failure changes nothing)."""
        pool = self._pool
        if acquire:
            pool.acquire(acquire)
        reads = self.sources
        if not reads:
            new = pool.allocate(avoiding + fresh)
            return new[:avoiding], new[avoiding:]
        dst = [pool.allocate_one_avoiding(reads) for _ in range(avoiding)]
        sources = self.freed_sources()[:fresh]
        if sources:
            pool.claim(sources)
        return dst, sources + pool.allocate(fresh - len(sources))

    def fresh(self, n: int, doing: str, seq_id: Hashable, acquire: Sequence[int] = ()) -> list[int]:
        """``n`` blocks this step writes after the copies run (after acquiring ``acquire``):
        the pool's own allocation when no copy is pending, the rule otherwise. Atomic:
        OutOfBlocks, naming the call (``"admitting 'r1'"``: ``doing`` and ``seq_id``, formatted
        only on failure), changes nothing."""
        if self.sources:
            self.check_room(n, 0, f"{doing} {seq_id!r}", acquire)
            return self.allocate(n, 0, acquire)[1]
        try:
            return self._pool.allocate(n, acquire=acquire)
        except OutOfBlocks as e:
            raise OutOfBlocks(e.needed, e.available, f"{doing} {seq_id!r}") from None

    def fresh_one(self) -> int:
        """One fresh block (the per-block append path); its failure changes nothing."""
        if self.sources:
            return self.allocate(1, 0)[1][0]
        return self._pool.allocate_one()

    def destination(self) -> int:
        """One block a copy (or load) writes before the step's copies run: never a freed block
        a pending copy still reads. OutOfBlocks changes nothing."""
        try:
            if self.sources:
                return self.allocate(0, 1)[0][0]
            return self._pool.allocate_one()
        except OutOfBlocks:
            raise OutOfBlocks(1, 0, "a copy-on-write destination") from None

    # ---- checks ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """The pending list is batch-safe, its indexes agree with it, and every destination is
        held (a released destination's copy was dropped)."""
        dsts = [c.dst for c in self._copies]
        srcs = Counter(c.src for c in self._copies)
        require(len(set(dsts)) == len(dsts), "a block is a copy destination twice")
        require(not set(dsts) & set(srcs), "a copy destination is the source of another copy")
        require(self._dst == {c.dst: c.src for c in self._copies}, "copy index differs")
        require(self.sources == dict(srcs), "copy source counts differ")
        for d in dsts:
            require(self._pool.refcount(d) > 0, f"copy destination {d} is free")
