"""The prefix cache: chained block hash -> physical block, events, and hit statistics.

It sits between the pool (which keeps a cached block's key and evicts it LRU) and the manager
(which knows sequences and computes their hashes). Here live the three things a prefix cache adds:

* ``longest_prefix(hashes)``: how many leading blocks of a prompt are already held, in
  one dict lookup per block, stopping at the first miss (chaining makes later hits impossible).
* ``publish(...)``: a block that just filled becomes findable by its hash. When an equal block
  is already mapped, the new one is simply not published; both may coexist (block tables are
  append-only), and the map keeps the older one.
* events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``), each carrying hashes, so an
  external router can mirror which prefixes this cache holds.
"""
from __future__ import annotations

from typing import Hashable, Sequence

from .pool import BlockPool, _consume
from .types import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["PrefixCache"]


class PrefixCache:
    """Maps full-block hashes to physical blocks held (in use or cached-free) by ``pool``."""

    __slots__ = ("_pool", "_map", "_events", "_removed", "events_enabled", "query_tokens", "hit_tokens")

    def __init__(self, pool: BlockPool, enable_events: bool = True) -> None:
        self._pool = pool
        self._map: dict[Hashable, int] = {}
        self._events: list = []
        self._removed: list = []  # evicted hashes not yet folded into a BlockRemoved event
        self.events_enabled = enable_events
        self.query_tokens = 0
        self.hit_tokens = 0
        pool.on_evict_many = self._on_evict_many

    def __len__(self) -> int:
        return len(self._map)

    def get(self, block_hash: Hashable) -> int | None:
        return self._map.get(block_hash)

    def items(self):
        return self._map.items()

    def longest_prefix(self, hashes: Sequence[Hashable], limit: int) -> list[int]:
        """Blocks holding the first ``k <= limit`` hashes, for the largest such ``k``."""
        m = self._map
        out = []
        for h in hashes[:limit]:
            b = m.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def publish(
        self,
        blocks: Sequence[int],
        hashes: Sequence[Hashable],
        parent: Hashable,
        tokens: Sequence[int],
        block_size: int,
    ) -> None:
        """Make just-filled in-use ``blocks`` (with chained ``hashes``) findable.

        ``parent`` is the hash ``hashes[0]`` was chained from; ``tokens`` the blocks' tokens,
        concatenated. One ``BlockStored`` event per run of newly published blocks.
        """
        m, keys = self._map, self._pool._keys
        if m.keys().isdisjoint(hashes):  # the common case: all new, one run, C-speed updates
            m.update(zip(hashes, blocks))
            keys.update(zip(blocks, hashes))
            self._stored(hashes, parent, tokens, block_size, 0, len(blocks))
            return
        run_start = -1
        for i, (b, h) in enumerate(zip(blocks, hashes)):
            if h in m:
                if run_start >= 0:
                    self._stored(hashes, parent, tokens, block_size, run_start, i)
                    run_start = -1
                continue
            m[h] = b
            keys[b] = h
            if run_start < 0:
                run_start = i
        if run_start >= 0:
            self._stored(hashes, parent, tokens, block_size, run_start, len(blocks))

    def stored_raw(self, hashes: tuple, parent: Hashable, tokens, block_size: int) -> None:
        """Queue a BlockStored event; its token tuple is built in ``take_events``.

        Deferring the tuple keeps the admission and decode paths from creating one Python int
        per published token (13 µs for a 1,088-token prompt); a plain tuple marks it as raw.
        """
        if self._removed:
            self._flush_removed()
        self._events.append((hashes, parent, tokens, block_size))

    def _stored(self, hashes, parent, tokens, bs, i, j) -> None:
        if self.events_enabled:
            self.stored_raw(tuple(hashes[i:j]), parent if i == 0 else hashes[i - 1], tokens[i * bs : j * bs], bs)

    def _on_evict_many(self, blocks: list, keys: list) -> None:
        _consume(map(self._map.__delitem__, keys))  # the map and the pool's keys: one bijection
        if self.events_enabled:
            self._removed.extend(keys)

    def _flush_removed(self) -> None:
        """Fold the evictions since the last event into one BlockRemoved, keeping event order."""
        self._events.append(BlockRemoved(tuple(self._removed)))
        self._removed = []

    def unpublish(self, blocks: Sequence[int]) -> None:
        """Forget the hashes of in-use ``blocks`` (their content cannot be trusted); one
        ``BlockRemoved`` event names them. Once released, the blocks go back clean."""
        keys = self._pool._keys
        hashes = [keys.pop(b) for b in blocks]
        _consume(map(self._map.__delitem__, hashes))
        if self.events_enabled and hashes:
            self._removed += hashes

    def clear(self) -> None:
        """Forget every hash (the pool must hold no block in use: see the manager's reset)."""
        self._pool.clear_cached()
        self._map.clear()
        if self.events_enabled:
            if self._removed:
                self._flush_removed()
            self._events.append(AllBlocksCleared())

    def take_events(self) -> list:
        if self._removed:
            self._flush_removed()
        events, self._events = self._events, []
        return [BlockStored(e[0], e[1], tuple(e[2]), e[3]) if type(e) is tuple else e for e in events]
