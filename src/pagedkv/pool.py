"""BlockPool: reference counts, the clean free list, and the evictable (cached-free) LRU.

The pool knows nothing of sequences or of what a key means. It hands out physical block ids,
counts references to them, and when a block's last reference goes it files the block as either

* **clean** (no content worth keeping): pushed on a LIFO stack, the next to be handed out, or
* **cached-free** (it carries a key, e.g. a prefix hash): appended to an LRU, still revivable by
  :meth:`revive`, and evicted oldest-first only when no clean block is left. Eviction drops the
  key and calls ``on_evict(block, key)`` so the owner can forget it.

Every block is in exactly one of three states: in use (refcount > 0), clean, or cached-free.

Bookkeeping is one list slot (8 bytes) of refcount per block, shared zeros until used; a block
that was never handed out has no free-list entry at all: the clean stack sits on top of a
watermark ``[fresh, num_blocks)`` of never-used blocks, handed out lowest first. So a fresh pool
of 1,000,000 blocks costs one 8 MB list and builds in a few milliseconds, and hands out 0, 1, 2, …

Engines that keep their own block tables can use the pool alone::

    pool = BlockPool(1024)
    a, b = pool.allocate(2)        # [0, 1]
    pool.incref(a)                 # a shared by two tables
    pool.release_all([b, a])       # b is clean again; a still has one reference
"""
from __future__ import annotations

import operator
from collections import OrderedDict, deque
from itertools import islice, repeat
from typing import Callable, Hashable, Iterable, Optional

from .types import OutOfBlocks

__all__ = ["BlockPool"]

EvictCallback = Callable[[int, Hashable], None]


class BlockPool:
    """Physical block ids with refcounts, a LIFO clean stack and an LRU of cached-free blocks."""

    __slots__ = ("_num_blocks", "_rc", "_clean", "_fresh", "_lru", "_keys", "_evicted_keys",
                 "on_evict", "on_evict_many", "evictions")

    def __init__(
        self,
        num_blocks: int,
        on_evict: Optional[EvictCallback] = None,
        on_evict_many: Optional[Callable[[list, list], None]] = None,
    ) -> None:
        num_blocks = as_int(num_blocks, "num_blocks")
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not all(f is None or callable(f) for f in (on_evict, on_evict_many)):
            raise ValueError("on_evict and on_evict_many must be callables or None")
        self._num_blocks = num_blocks
        self._rc: list[int] = [0] * num_blocks  # refcount per block (hot paths read it directly)
        self._clean: list[int] = []  # freed clean blocks; top (end) is handed out first
        self._fresh = 0  # blocks [_fresh, num_blocks) were never handed out
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached-free, least recently freed first
        self._keys: dict[int, Hashable] = {}  # block -> key, for in-use and cached-free blocks
        self._evicted_keys: list = []  # keys of blocks evicted by the allocation under way
        # Told of evictions: on_evict(block, key) once per block, or, when set instead,
        # on_evict_many(blocks, keys) once per allocation (one admission can evict 50 blocks).
        self.on_evict = on_evict
        self.on_evict_many = on_evict_many
        self.evictions = 0

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_clean(self) -> int:
        """Free blocks holding nothing worth keeping (never used, or freed without a key)."""
        return len(self._clean) + self._num_blocks - self._fresh

    @property
    def num_cached(self) -> int:
        """Free blocks whose content is still revivable (they carry a key)."""
        return len(self._lru)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: clean plus cached-free (evicted on demand)."""
        return len(self._clean) + self._num_blocks - self._fresh + len(self._lru)

    @property
    def num_used(self) -> int:
        return self._fresh - len(self._clean) - len(self._lru)

    # ---- queries -----------------------------------------------------------------------------

    def refcount(self, block: int) -> int:
        block = self._check_id(block)
        return self._rc[block]

    def key(self, block: int) -> Optional[Hashable]:
        """The block's key (in use or cached-free), or None."""
        block = self._check_id(block)
        return self._keys.get(block)

    def is_cached(self, block: int) -> bool:
        """True when the block is free but revivable."""
        block = self._check_id(block)
        return block in self._lru

    # ---- allocation --------------------------------------------------------------------------

    def allocate(self, n: int = 1) -> list[int]:
        """Take ``n`` blocks, each with refcount 1: clean ones first (most recently freed first,
        then never-used lowest first), then by evicting the least recently freed cached blocks.

        Atomic: raises :class:`OutOfBlocks` and changes nothing if fewer than ``n`` are free.
        """
        n = as_int(n, "n")
        if n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        available = self.num_free
        if n > available:
            raise OutOfBlocks(n, available)
        return self._take(n)

    def _take(self, n: int) -> list[int]:
        """Allocation without checks; the caller has made sure ``n <= num_free``."""
        clean = self._clean
        k = min(n, len(clean))
        out = clean[len(clean) - k :]
        out.reverse()
        del clean[len(clean) - k :]
        n -= k
        if n:
            m = min(n, self._num_blocks - self._fresh)
            out.extend(range(self._fresh, self._fresh + m))
            self._fresh += m
            if n > m:
                evicted = self._evict_oldest_n(n - m)
                out += evicted
                _consume(map(self._rc.__setitem__, out, repeat(1)))  # rc = 1 each, at C speed
                self._notify(out, evicted)
                return out
        _consume(map(self._rc.__setitem__, out, repeat(1)))
        return out

    def _take_one(self) -> int:
        """One block, refcount 1, or OutOfBlocks(1, 0): the per-token hot path."""
        clean = self._clean
        if clean:
            b = clean.pop()
        elif self._fresh < self._num_blocks:
            b = self._fresh
            self._fresh = b + 1
        elif self._lru:
            return self._evict_one()
        else:
            raise OutOfBlocks(1, 0)
        self._rc[b] = 1
        return b

    def _evict_oldest_n(self, n: int) -> list[int]:
        """Evict the ``n`` least recently freed cached blocks (an admission may need 50).

        Their keys move to ``_evicted_keys`` until :meth:`_notify` tells the owner.
        """
        lru = self._lru
        out = list(islice(lru, n))  # the n oldest, then drop them: two C-level passes
        _consume(map(lru.__delitem__, out))
        self._evicted_keys = list(map(self._keys.pop, out))
        self.evictions += n
        return out

    def _evict_one(self) -> int:
        """``_take_one`` when only a cached block is left: evict the oldest, tell the owner."""
        b, _ = self._lru.popitem(last=False)
        key = self._keys.pop(b)
        self.evictions += 1
        self._rc[b] = 1
        try:
            if self.on_evict_many is not None:
                self.on_evict_many((b,), (key,))
            elif self.on_evict is not None:
                self.on_evict(b, key)
        except BaseException:  # as in _notify: undo the allocation, keep the pool consistent
            self._release_all((b,))
            raise
        return b

    def _notify(self, taken: list, evicted: list) -> None:
        """Tell the owner which blocks were evicted, once the allocation is complete.

        Should the callback raise, the allocation is undone (every taken block goes back clean:
        the evicted ones have lost their keys either way) and the error propagates, so the pool
        stays consistent whatever the owner's code does.
        """
        keys, self._evicted_keys = self._evicted_keys, []
        try:
            if self.on_evict_many is not None:
                self.on_evict_many(evicted, keys)
            elif self.on_evict is not None:
                for b, k in zip(evicted, keys):
                    self.on_evict(b, k)
        except BaseException:
            self._release_all(reversed(taken))
            raise

    # ---- references --------------------------------------------------------------------------

    def incref(self, block: int) -> None:
        """One more holder of an in-use block (a fork, a prefix hit on a live block)."""
        block = self._check_in_use(block)
        self._rc[block] += 1

    def incref_all(self, blocks: Iterable[int]) -> None:
        blocks = [self._check_in_use(b) for b in blocks]
        rc = self._rc
        for b in blocks:
            rc[b] += 1

    def release(self, block: int) -> None:
        """Drop one reference; at zero the block becomes cached-free (keyed) or clean."""
        block = self._check_in_use(block)
        self._release_all((block,))

    def release_all(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block, in the given order (which sets the LRU order).

        Validated first, so a bad id or an over-release changes nothing.
        """
        blocks = [self._check_id(b) for b in blocks]
        need: dict[int, int] = {}
        for b in blocks:
            need[b] = need.get(b, 0) + 1
        for b, k in need.items():
            if self._rc[b] < k:
                raise ValueError(f"block {b} has {self._rc[b]} references, cannot release {k}")
        self._release_all(blocks)

    def _release_all(self, blocks: Iterable[int]) -> None:
        rc, keys, lru, clean = self._rc, self._keys, self._lru, self._clean
        for b in blocks:
            c = rc[b] - 1
            rc[b] = c
            if not c:
                if b in keys:
                    lru[b] = None
                else:
                    clean.append(b)

    def revive(self, block: int) -> None:
        """Bring a cached-free block back into use with refcount 1 (a prefix hit), O(1)."""
        block = self._check_id(block)
        if block not in self._lru:
            raise ValueError(f"block {block} is not cached-free")
        del self._lru[block]
        self._rc[block] = 1

    def _acquire_all(self, blocks: Iterable[int]) -> None:
        """Unchecked: +1 reference to each block, in use or cached-free (prefix hits)."""
        rc, lru = self._rc, self._lru
        for b in blocks:
            if rc[b]:
                rc[b] += 1
            else:
                del lru[b]
                rc[b] = 1

    # ---- keys --------------------------------------------------------------------------------

    def set_key(self, block: int, key: Hashable) -> None:
        """Mark an in-use block's content as worth keeping after its last release."""
        block = self._check_in_use(block)
        if key is None:
            raise ValueError("key must not be None")
        self._keys[block] = key

    def drop_key(self, block: int) -> None:
        """Forget a block's key; a cached-free block becomes clean (pushed on the clean stack)."""
        block = self._check_id(block)
        if self._keys.pop(block, None) is not None and block in self._lru:
            del self._lru[block]
            self._clean.append(block)

    def clear_cached(self) -> list[tuple[int, Hashable]]:
        """Every cached-free block becomes clean (oldest pushed first); returns (block, key) pairs.

        Keys of in-use blocks are kept. ``on_evict`` is not called: the caller is clearing.
        """
        out = [(b, self._keys.pop(b)) for b in self._lru]
        self._lru.clear()
        self._clean.extend(b for b, _ in out)
        return out

    # ---- checks ------------------------------------------------------------------------------

    def _check_id(self, block: int) -> int:
        """The block id as a Python int, or ValueError when it is not one in range."""
        if type(block) is not int:
            block = as_int(block, "block id")
        if not 0 <= block < self._num_blocks:
            raise ValueError(f"block id must be an int in [0, {self._num_blocks}), got {block!r}")
        return block

    def _check_in_use(self, block: int) -> int:
        block = self._check_id(block)
        if not self._rc[block]:
            raise ValueError(f"block {block} is free")
        return block

    def check_invariants(self) -> None:
        """Raise AssertionError unless every block is in exactly one consistent state."""
        n, rc = self._num_blocks, self._rc
        _require(0 <= self._fresh <= n, f"watermark {self._fresh} outside [0, {n}]")
        clean, lru = self._clean, self._lru
        _require(len(set(clean)) == len(clean), "a block is twice on the clean stack")
        _require(not set(clean) & set(lru), "a block is both clean and cached-free")
        for b in clean:
            _require(b < self._fresh and rc[b] == 0, f"clean block {b} is in use or never used")
            _require(b not in self._keys, f"clean block {b} has a key")
        for b in lru:
            _require(b < self._fresh and rc[b] == 0, f"cached-free block {b} is in use")
            _require(b in self._keys, f"cached-free block {b} has no key")
        for b in range(self._fresh, n):
            _require(rc[b] == 0 and b not in self._keys, f"never-used block {b} has state")
        used = sum(1 for c in rc if c > 0)
        _require(min(rc) >= 0, "negative refcount")
        _require(used == self.num_used, f"{used} blocks referenced, {self.num_used} counted used")
        _require(used + self.num_clean + self.num_cached == n, "free + cached + used != total")


def _consume(iterator) -> None:
    """Run an iterator to its end in C (``deque(maxlen=0)``): a loop with no bytecode per item."""
    deque(iterator, maxlen=0)


def as_int(value, what: str) -> int:
    """``value`` as a Python int (numpy integers welcome); ValueError for bools and non-integers."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or isinstance(value, float):
        raise ValueError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an int, got {type(value).__name__}") from None


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)
