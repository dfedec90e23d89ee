"""BlockPool: reference counts, the clean free list, and the evictable (cached-free) LRU.

The pool knows nothing of sequences or of what a key means. It hands out physical block ids,
counts references to them, and when a block's last reference goes it files the block as either

* **clean** (no content worth keeping): pushed on a LIFO stack, the next to be handed out, or
* **cached-free** (it carries a key, e.g. a prefix hash): appended to an LRU, still revivable by
  :meth:`acquire`, and evicted oldest-first only when no clean block is left. Eviction drops the
  key and tells the owner (``on_evict`` / ``on_evict_many``) so that it can forget it.

The pool owns the key <-> block bijection, both directions, as vLLM v1's block pool keeps a
block's hash next to the block and the hash -> block map beside it: a key is carried by at most
one block, :meth:`block_of` and :meth:`held_prefix` find blocks by key, and :meth:`publish_keys`
keys only the blocks whose key is new. Eviction, :meth:`drop_keys` and :meth:`clear_cached` drop
both directions at once, so no owner's callback has to keep a second map in step.

Every block is in exactly one of three states: in use (refcount > 0), clean, or cached-free.

A block that was never handed out has no bookkeeping at all: the clean stack sits on top of a
watermark ``[fresh, num_blocks)`` of never-used blocks, handed out lowest first, and the refcount
list only grows as the watermark rises. So a pool of 2**31 - 1 blocks costs nothing to build, and
a used block costs one 8-byte list slot of refcount (plus a dict entry while it carries a key).

The batch operations are the ones an allocator's hot paths need, so that a caller never has to
reach into the pool: :meth:`allocate` (n blocks, optionally after acquiring prefix hits, atomic),
:meth:`allocate_one` (the per-token path), :meth:`allocate_one_avoiding` and :meth:`claim` (an
owner's choice of which free blocks serve which use), :meth:`acquire` (prefix hits, reviving
cached-free blocks), :meth:`incref_all` (a fork), :meth:`release_all` (a freed table, tail first) and
:meth:`set_keys` / :meth:`drop_keys` (publishing and unpublishing). Each validates its arguments
and either succeeds completely or changes nothing.

Validating a batch (ids are ints in range, distinct, in use) costs as much as the batch itself:
about as long as the refcount loop of a 128-block fork. An owner that only ever passes back
blocks this pool handed it, such as :class:`~pagedkv.KVCacheManager` passing its own block
tables, builds the pool with ``check_args=False`` and skips those passes; every other check
(capacity, atomicity) stays. Leave it on when your own code passes ids in.

Engines that keep their own block tables can use the pool alone::

    pool = BlockPool(1024)
    a, b = pool.allocate(2)        # [0, 1]
    pool.incref(a)                 # a shared by two tables
    pool.release_all([b, a])       # b is clean again; a still has one reference
"""
from __future__ import annotations

from collections import OrderedDict, deque
from itertools import islice, repeat
from typing import Callable, Collection, Hashable, Iterable, Optional, Sequence

from .checks import as_int
from .checks import require as _require
from .types import OutOfBlocks

__all__ = ["BlockPool", "MAX_BLOCKS"]

EvictCallback = Callable[[int, Hashable], None]

# Block ids are exported to kernels as int32 (vLLM's block tables, FlashInfer's indices).
MAX_BLOCKS = 2**31 - 1
_INT_ONLY = {int}


class BlockPool:
    """Physical block ids with refcounts, a LIFO clean stack and an LRU of cached-free blocks.

    Not thread-safe: one owner (the engine's scheduler thread) calls it.
    """

    __slots__ = ("_num_blocks", "_rc", "_clean", "_lru", "_keys", "_blocks", "_evicted_keys",
                 "on_evict", "on_evict_many", "evictions", "_check_args")

    def __init__(
        self,
        num_blocks: int,
        on_evict: Optional[EvictCallback] = None,
        on_evict_many: Optional[Callable[[list, list], None]] = None,
        *,
        check_args: bool = True,
    ) -> None:
        if not isinstance(check_args, bool):
            raise ValueError(f"check_args must be a bool, got {check_args!r}")
        num_blocks = as_int(num_blocks, "num_blocks")
        if not 1 <= num_blocks <= MAX_BLOCKS:
            raise ValueError(
                f"num_blocks must be an int in [1, {MAX_BLOCKS}] (block ids are exported as int32), "
                f"got {num_blocks!r}"
            )
        if not all(f is None or callable(f) for f in (on_evict, on_evict_many)):
            raise ValueError("on_evict and on_evict_many must be callables or None")
        self._num_blocks = num_blocks
        # Refcount per block ever handed out; its length is the never-used watermark.
        self._rc: list[int] = []
        self._clean: list[int] = []  # freed clean blocks; top (end) is handed out first
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached-free, least recently freed first
        self._keys: dict[int, Hashable] = {}  # block -> key, for in-use and cached-free blocks
        self._blocks: dict[Hashable, int] = {}  # key -> block: the same pairs, the other way
        self._evicted_keys: list = []  # keys of blocks evicted by the allocation under way
        # Told of evictions: on_evict(block, key) once per block, or, when set instead,
        # on_evict_many(blocks, keys) once per allocation (one admission can evict 50 blocks).
        self.on_evict = on_evict
        self.on_evict_many = on_evict_many
        self.evictions = 0
        self._check_args = check_args

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_clean(self) -> int:
        """Free blocks holding nothing worth keeping (never used, or freed without a key)."""
        return len(self._clean) + self._num_blocks - len(self._rc)

    @property
    def num_cached(self) -> int:
        """Free blocks whose content is still revivable (they carry a key)."""
        return len(self._lru)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: clean plus cached-free (evicted on demand)."""
        return len(self._clean) + self._num_blocks - len(self._rc) + len(self._lru)

    @property
    def num_used(self) -> int:
        return len(self._rc) - len(self._clean) - len(self._lru)

    def usage_fields(self) -> dict:
        """The pool's part of :class:`~pagedkv.types.Usage`, from its own counts: its size, the
        blocks used, clean, cached-free, and the evictions so far."""
        return dict(num_blocks=self._num_blocks, used_blocks=self.num_used, free_blocks=self.num_clean,
                    cached_blocks=self.num_cached, evictions=self.evictions)

    # ---- queries -----------------------------------------------------------------------------

    def refcount(self, block: int) -> int:
        block = self._check_id(block)
        rc = self._rc
        return rc[block] if block < len(rc) else 0

    def refcounts(self) -> list[int]:
        """Every block's refcount, as a new list of ``num_blocks`` ints (for checks and tests)."""
        return self._rc + [0] * (self._num_blocks - len(self._rc))

    def key(self, block: int) -> Optional[Hashable]:
        """The block's key (in use or cached-free), or None."""
        block = self._check_id(block)
        return self._keys.get(block)

    def block_of(self, key: Hashable) -> Optional[int]:
        """The block carrying ``key`` (in use or cached-free), or None."""
        return self._blocks.get(key)

    def freed_by(self, drops: dict[int, int]) -> list[int]:
        """The blocks that dropping ``drops[b]`` references from each block ``b`` would free
        (their refcount is exactly that), in ``drops``' order; changes nothing. A grouped
        manager asks this before a window release, whose freed blocks can serve the same call."""
        rc = self._rc
        return [b for b, k in drops.items() if rc[b] == k]

    def revive_keyed(self, keys: Iterable[Hashable]) -> list[Optional[int]]:
        """For each key, its block revived (refcount 1, out of the LRU) when it is cached-free,
        else None (no block carries the key, or its block is in use): one pass, no per-block
        call. A grouped manager re-ages a finished sequence's released window blocks this way
        before releasing them again with the rest of its prefix."""
        blocks, rc, lru = self._blocks, self._rc, self._lru
        out: list[Optional[int]] = []
        for key in keys:
            b = blocks.get(key)
            if b is not None and b in lru:
                del lru[b]
                rc[b] = 1
                out.append(b)
            else:
                out.append(None)
        return out

    def held_prefix(self, keys: Sequence[Hashable], limit: int) -> list[int]:
        """The blocks carrying ``keys[:k]``, for the largest ``k <= limit`` such that all do: a
        prompt's cached prefix, one dict probe a key, stopping at the first miss (chained hashes
        make a later hit impossible). Example: blocks 4 and 9 carry "a" and "b" -> ``["a", "b",
        "c"]`` gives [4, 9], ``["b", "a"]`` with limit 1 gives [9]."""
        get = self._blocks.get
        out = []
        for k in keys[:limit]:
            b = get(k)
            if b is None:
                break
            out.append(b)
        return out

    def keyed_blocks(self) -> dict[int, Hashable]:
        """A copy of the block -> key map (in-use and cached-free blocks that carry a key)."""
        return dict(self._keys)

    def is_cached(self, block: int) -> bool:
        """True when the block is free but revivable."""
        block = self._check_id(block)
        return block in self._lru

    def count_cached(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` (distinct ids) are cached-free: the hits an admission would
        revive, which then no longer count as free. One C-level pass."""
        return sum(map(self._lru.__contains__, blocks))

    # ---- allocation --------------------------------------------------------------------------

    def allocate(self, n: int = 1, acquire: Sequence[int] = ()) -> list[int]:
        """Take ``n`` blocks, each with refcount 1: clean ones first (most recently freed first,
        then never-used lowest first), then by evicting the least recently freed cached blocks.

        ``acquire`` are blocks to take one more reference to first (an admission's prefix hits,
        in use or cached-free): they are never evicted to make room for the ``n``, and the ones
        revived from the cached-free LRU no longer count as available.

        Atomic: raises :class:`OutOfBlocks` and changes nothing if fewer than ``n`` are free.
        """
        if type(n) is not int:
            n = as_int(n, "n")
        if n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        available = self.num_free
        if acquire:
            if self._check_args:
                self._check_acquirable(acquire)
            available -= sum(map(self._lru.__contains__, acquire))  # revivals leave the free count
        if n > available:
            raise OutOfBlocks(n, available)
        if acquire:
            self._acquire(acquire)
        return self._take(n) if n else []

    def allocate_one(self) -> int:
        """One block with refcount 1, or :class:`OutOfBlocks`: the per-token path."""
        clean = self._clean
        if clean:
            b = clean.pop()
            self._rc[b] = 1
            return b
        rc = self._rc
        b = len(rc)
        if b < self._num_blocks:
            rc.append(1)
            return b
        if self._lru:
            return self._evict_one()
        raise OutOfBlocks(1, 0)

    def allocate_one_avoiding(self, avoid: Collection[int]) -> int:
        """One block that is not in ``avoid``: a copy destination must not be a block that a
        pending copy still reads, even if that block was freed since (see the manager's
        ``take_copies``). Clean blocks first (newest first), then never-used, then the oldest
        cached-free block that is not avoided. OutOfBlocks when every free block is avoided."""
        clean = self._clean
        for i in range(len(clean) - 1, -1, -1):
            b = clean[i]
            if b not in avoid:
                del clean[i]
                self._rc[b] = 1
                return b
        rc = self._rc
        if len(rc) < self._num_blocks:
            rc.append(1)
            return len(rc) - 1
        for b in self._lru:
            if b not in avoid:
                self._lru.move_to_end(b, last=False)  # make it the one _evict_one takes
                return self._evict_one()
        raise OutOfBlocks(1, 0)

    def claim(self, blocks: Sequence[int]) -> None:
        """Take these free blocks, each with refcount 1: a clean one off the clean stack, a
        cached-free one evicted (its key dropped, the owner told, as for any eviction).

        For an owner that knows which free blocks suit a use best: the manager hands a freed
        block that a pending copy still reads to a position this step writes after the copies
        run, keeping the other free blocks for copy destinations. All or nothing: ValueError
        (nothing changed) unless the blocks are distinct, free, and were handed out before.
        """
        rc, lru, clean = self._rc, self._lru, self._clean
        for b in blocks:
            if type(b) is not int or not 0 <= b < len(rc) or rc[b]:
                b = self._check_id(b)
                raise ValueError(f"block {b} is not a freed block (in use, or never handed out)")
        if len(set(blocks)) != len(blocks):
            raise ValueError("a block appears twice among the blocks to claim")
        evicted = []
        for b in blocks:
            if b in lru:
                del lru[b]
                evicted.append(b)
            else:  # freed recently, so near the top of the clean stack: search from there
                for i in range(len(clean) - 1, -1, -1):
                    if clean[i] == b:
                        del clean[i]
                        break
            rc[b] = 1
        if evicted:
            self._evicted_keys = list(map(self._keys.pop, evicted))
            _consume(map(self._blocks.__delitem__, self._evicted_keys))
            self.evictions += len(evicted)
            self._notify(list(blocks), evicted)

    def _take(self, n: int) -> list[int]:
        """Allocation without checks; the caller has made sure ``n <= num_free``."""
        clean, rc = self._clean, self._rc
        k = min(n, len(clean))
        out = clean[len(clean) - k :]
        out.reverse()
        del clean[len(clean) - k :]
        _consume(map(rc.__setitem__, out, repeat(1)))  # rc = 1 each, at C speed
        n -= k
        if n:
            fresh = len(rc)
            m = min(n, self._num_blocks - fresh)
            out.extend(range(fresh, fresh + m))
            rc.extend(repeat(1, m))
            if n > m:
                evicted = self._evict_oldest_n(n - m)
                _consume(map(rc.__setitem__, evicted, repeat(1)))
                out += evicted
                self._notify(out, evicted)
        return out

    def _evict_oldest_n(self, n: int) -> list[int]:
        """Evict the ``n`` least recently freed cached blocks (an admission may need 50).

        Their keys move to ``_evicted_keys`` until :meth:`_notify` tells the owner.
        """
        lru = self._lru
        out = list(islice(lru, n))  # the n oldest, then drop them: two C-level passes
        _consume(map(lru.__delitem__, out))
        self._evicted_keys = keys = list(map(self._keys.pop, out))
        _consume(map(self._blocks.__delitem__, keys))
        self.evictions += n
        return out

    def _evict_one(self) -> int:
        """``allocate_one`` when only a cached block is left: evict the oldest, tell the owner."""
        b, _ = self._lru.popitem(last=False)
        key = self._keys.pop(b)
        del self._blocks[key]
        self.evictions += 1
        self._rc[b] = 1
        try:
            if self.on_evict_many is not None:
                self.on_evict_many((b,), (key,))
            elif self.on_evict is not None:
                self.on_evict(b, key)
        except BaseException:  # as in _notify: undo the allocation, keep the pool consistent
            self._release((b,))
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
            self._release(reversed(taken))
            raise

    # ---- references --------------------------------------------------------------------------

    def incref(self, block: int) -> None:
        """One more holder of an in-use block (a fork, a prefix hit on a live block)."""
        block = self._check_in_use(block)
        self._rc[block] += 1

    def incref_all(self, blocks: Sequence[int]) -> None:
        """One more holder of each in-use block (a fork shares a whole table); all or nothing."""
        if self._check_args and not self._distinct_in_use(blocks):
            blocks = [self._check_in_use(b) for b in blocks]
        rc = self._rc
        for b in blocks:
            rc[b] += 1

    def acquire(self, blocks: Sequence[int]) -> None:
        """One more reference to each block, in use or cached-free (prefix hits): a cached-free
        block is revived in O(1) with refcount 1. All or nothing."""
        if self._check_args:
            self._check_acquirable(blocks)
        self._acquire(blocks)

    def revive(self, block: int) -> None:
        """Bring a cached-free block back into use with refcount 1 (a prefix hit), O(1)."""
        block = self._check_id(block)
        if block not in self._lru:
            raise ValueError(f"block {block} is not cached-free")
        self._acquire((block,))

    def _check_acquirable(self, blocks: Sequence[int]) -> None:
        rc, lru = self._rc, self._lru
        for b in blocks:
            if type(b) is not int or not 0 <= b < len(rc) or not (rc[b] or b in lru):
                b = self._check_id(b)
                raise ValueError(f"block {b} is neither in use nor cached-free")
        if len(blocks) > 1 and len(set(blocks)) != len(blocks):
            raise ValueError("a block appears twice among the blocks to acquire")

    def _acquire(self, blocks: Iterable[int]) -> None:
        rc, lru = self._rc, self._lru
        for b in blocks:
            if rc[b]:
                rc[b] += 1
            else:
                del lru[b]
                rc[b] = 1

    def release(self, block: int) -> None:
        """Drop one reference; at zero the block becomes cached-free (keyed) or clean."""
        block = self._check_in_use(block)
        self._release((block,))

    def release_all(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block, in the given order (which sets the LRU order):
        a sequence's table released tail first keeps its prefix cached longest.

        Validated first, so a bad id or an over-release changes nothing.
        """
        if self._check_args and not self._distinct_in_use(blocks):
            blocks = self._checked_releases(blocks)
        self._release(blocks)

    def _distinct_in_use(self, blocks: Sequence[int]) -> bool:
        """The common case of a batch call, checked in C-level passes: distinct Python-int ids
        of blocks in use. False sends the caller down the per-block checks and their errors."""
        rc = self._rc
        try:
            return (
                set(map(type, blocks)) == _INT_ONLY
                and min(blocks) >= 0
                and 0 not in map(rc.__getitem__, blocks)
                and len(set(blocks)) == len(blocks)
            )
        except (IndexError, TypeError, ValueError):
            return False

    def _checked_releases(self, blocks: Iterable[int]) -> list[int]:
        blocks = [self._check_id(b) for b in blocks]
        need: dict[int, int] = {}
        for b in blocks:
            need[b] = need.get(b, 0) + 1
        for b, k in need.items():
            have = self.refcount(b)
            if have < k:
                raise ValueError(f"block {b} has {have} references, cannot release {k}")
        return blocks

    def _release(self, blocks: Iterable[int]) -> None:
        rc, keys, lru, clean = self._rc, self._keys, self._lru, self._clean
        for b in blocks:
            c = rc[b] - 1
            rc[b] = c
            if not c:
                if b in keys:
                    lru[b] = None
                else:
                    clean.append(b)

    # ---- keys --------------------------------------------------------------------------------

    def set_key(self, block: int, key: Hashable) -> None:
        """Mark an in-use block's content as worth keeping after its last release."""
        self.set_keys((block,), (key,))

    def set_keys(self, blocks: Sequence[int], keys: Sequence[Hashable]) -> None:
        """Key several in-use blocks at once (a prompt's newly published blocks). A key is
        carried by one block: ValueError when a key repeats or another block carries it. A block
        that carried a key carries the new one instead."""
        if self._check_args:
            blocks = self._check_keying(blocks, keys, True)
            for b, k in zip(blocks, keys):
                held = self._blocks.get(k)
                if held is not None and held != b:
                    raise ValueError(f"key {k!r} is carried by block {held} already")
        mine, by = self._keys, self._blocks
        if any(map(mine.__contains__, blocks)):  # re-keyed blocks: their old keys leave the index
            for b in blocks:
                old = mine.get(b)
                if old is not None:
                    del by[old]
        mine.update(zip(blocks, keys))
        by.update(zip(keys, blocks))

    def publish_keys(self, blocks: list[int], keys: Sequence[Hashable]) -> list[int]:
        """For each ``(block, key)`` pair, the block that carries the key afterwards: a key no
        block carries yet is given to its block, a key already carried (by an older block, or by
        an earlier pair) keeps its block, and that pair's block stays unkeyed. So the result
        equals ``blocks`` exactly where the key was new, and *is* ``blocks`` (the same list, so
        that a caller tests ``held is blocks`` in O(1)) when every key was new. One C-level
        ``setdefault`` pass, the prefix cache's publication. Example: block 5 carries "h" -> ``publish_keys([7, 8],
        ["h", "g"])`` returns [5, 8]: 8 carries "g", 7 nothing. The blocks must be in use and
        carry no key."""
        if self._check_args:
            blocks = self._check_keying(blocks, keys, False)
            if any(map(self._keys.__contains__, blocks)):
                raise ValueError("a block to publish carries a key already")
        held = list(map(self._blocks.setdefault, keys, blocks))
        if held == blocks:  # the common case: every key new
            self._keys.update(zip(blocks, keys))
            return blocks
        self._keys.update((b, k) for b, k, h in zip(blocks, keys, held) if b == h)
        return held

    def _check_keying(self, blocks: Sequence[int], keys: Sequence[Hashable], unique_keys: bool) -> Sequence[int]:
        """``blocks`` (as Python ints when they were not), or ValueError: lengths differ, a
        block repeats (it would carry two keys), a key is None, or (``unique_keys``) a key
        repeats (two blocks would carry it)."""
        if len(blocks) != len(keys):
            raise ValueError(f"{len(blocks)} blocks but {len(keys)} keys")
        if not self._distinct_in_use(blocks):
            blocks = [self._check_in_use(b) for b in blocks]
            if len(set(blocks)) != len(blocks):
                raise ValueError("a block appears twice among the blocks to key")
        if None in keys:
            raise ValueError("key must not be None")
        if unique_keys and len(set(keys)) != len(keys):
            raise ValueError("a key appears twice among the keys to set")
        return blocks

    def drop_key(self, block: int) -> None:
        """Forget a block's key; a cached-free block becomes clean (pushed on the clean stack)."""
        self.drop_keys((self._check_id(block),))

    def drop_keys(self, blocks: Iterable[int]) -> list:
        """Forget the blocks' keys (blocks without one are skipped); cached-free blocks become
        clean. Returns the dropped keys, in order."""
        keys, lru, clean, by = self._keys, self._lru, self._clean, self._blocks
        out = []
        for b in blocks:
            k = keys.pop(b, None)
            if k is not None:
                del by[k]
                out.append(k)
                if b in lru:
                    del lru[b]
                    clean.append(b)
        return out

    def clear_cached(self) -> list[tuple[int, Hashable]]:
        """Every cached-free block becomes clean (oldest pushed first); returns (block, key) pairs.

        Keys of in-use blocks are kept. ``on_evict`` is not called: the caller is clearing.
        """
        out = [(b, self._keys.pop(b)) for b in self._lru]
        _consume(map(self._blocks.__delitem__, [k for _, k in out]))
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
        if not self.refcount(block):
            raise ValueError(f"block {block} is free")
        return block

    def check_invariants(self) -> None:
        """Raise AssertionError unless every block is in exactly one consistent state."""
        n, rc = self._num_blocks, self._rc
        fresh = len(rc)
        _require(fresh <= n, f"watermark {fresh} above {n}")
        clean, lru = self._clean, self._lru
        _require(len(set(clean)) == len(clean), "a block is twice on the clean stack")
        _require(not set(clean) & set(lru), "a block is both clean and cached-free")
        for b in clean:
            _require(b < fresh and rc[b] == 0, f"clean block {b} is in use or never used")
            _require(b not in self._keys, f"clean block {b} has a key")
        for b in lru:
            _require(b < fresh and rc[b] == 0, f"cached-free block {b} is in use")
            _require(b in self._keys, f"cached-free block {b} has no key")
        for b in self._keys:
            _require(b < fresh, f"never-used block {b} has a key")
        _require(len(self._blocks) == len(self._keys)
                 and all(self._blocks.get(k) == b for b, k in self._keys.items()),
                 "the key -> block index is not the block -> key map inverted")
        used = sum(1 for c in rc if c > 0)
        _require(not rc or min(rc) >= 0, "negative refcount")
        _require(used == self.num_used, f"{used} blocks referenced, {self.num_used} counted used")
        _require(used + self.num_clean + self.num_cached == n, "free + cached + used != total")


def _consume(iterator) -> None:
    """Run an iterator to its end in C (``deque(maxlen=0)``): a loop with no bytecode per item."""
    deque(iterator, maxlen=0)
