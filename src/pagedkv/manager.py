"""KVCacheManager: sequences, block tables, fork, copy-on-write, prefix hits, exports, usage.

This is the only layer that knows what a sequence is. Per sequence it keeps the block table
(logical block i -> physical block id, plus an int32 mirror that the kernel exports slice), the
token ids, the chained hashes of its full blocks (when prefix caching is on), and the slot its
next token takes when no decision is needed (the decode fast path). Everything physical (refcounts, free list, eviction)
belongs to :class:`~pagedkv.pool.BlockPool`; everything about hashes to
:class:`~pagedkv.prefix_cache.PrefixCache`.

The life of a decode step, with block size 16::

    m = KVCacheManager(num_blocks=4096, block_size=16)
    m.add_sequence("r1", prompt)          # 40 tokens -> table [0, 1, 2]; blocks 0, 1 published
    m.fork("r1", "r1.1")                  # child shares [0, 1, 2]; refcounts 2, 2, 2
    m.append_token("r1.1", 7)             # block 2 is partial and shared -> copy-on-write:
    m.take_copies()                       #   [CopyOp(src=2, dst=3)]; child table [0, 1, 3]
    m.append_token("r1", 9)               # parent is block 2's last holder: writes in place

Every public call validates its arguments before it changes anything, and every call that
allocates checks capacity first, so a failure (``OutOfBlocks``, ``KeyError``, ``ValueError``)
leaves the manager exactly as it was.
"""
from __future__ import annotations

import operator
import sys
from array import array
from collections import Counter
from itertools import chain
from operator import itemgetter
from typing import Any, Hashable, Iterable, Sequence

import numpy as np

from .hashing import MAX_TOKEN_ID, BlockHasher
from .pool import BlockPool, as_int
from .prefix_cache import PrefixCache
from .types import CopyOp, OutOfBlocks, Usage

__all__ = ["KVCacheManager"]

_BIG_ENDIAN = sys.byteorder == "big"


class _Seq:
    """One sequence's state: its block table, its tokens, its full blocks' chained hashes.

    Tokens are an ``array('I')``: 4 bytes a token instead of a list's 8-byte pointer to a 28-byte
    int; forking a 2,048-token sequence copies 8 KiB in 0.15 µs rather than a list in 2 µs; and
    a just-filled block's bytes for hashing are one slice away.
    """

    __slots__ = ("table", "tokens", "hashes", "root", "mirror", "nxt")

    def __init__(
        self, table: list, tokens: array, hashes: list, root: Hashable, mirror=None, nxt: int = -1
    ) -> None:
        self.table = table
        self.tokens = tokens
        self.hashes = hashes
        self.root = root
        # The table as int32 with spare capacity, which the kernel exports slice. Built on the
        # first export (many sequences never need one: 3 µs saved per admission), then kept.
        self.mirror = mirror
        # The slot the next token takes when that needs no decision: the last block is partial
        # and this sequence is its only holder. -1 sends the append down the slow path (full
        # last block, or a fork may have shared it). Only fork shares a partial block, and fork
        # resets it on both sides, so the fast path never writes into a shared block.
        self.nxt = nxt

    def add_block(self, b: int) -> None:
        """Append a block to the table and its int32 mirror, if built (grown by doubling)."""
        n = len(self.table)
        self.table.append(b)
        mirror = self.mirror
        if mirror is not None:
            if n == len(mirror):
                self.mirror = mirror = np.concatenate([mirror, np.empty(n, dtype=np.int32)])
            mirror[n] = b

    def set_last(self, b: int) -> None:
        self.table[-1] = b
        if self.mirror is not None:
            self.mirror[len(self.table) - 1] = b

    def int32_table(self) -> np.ndarray:
        """The table as int32 (a view of the mirror, built on first use)."""
        n = len(self.table)
        if self.mirror is None:
            self.mirror = np.empty(max(8, 2 * n), dtype=np.int32)
            self.mirror[:n] = self.table
        return self.mirror[:n]


class KVCacheManager:
    """The block allocator of a paged KV cache (see DESIGN.md for the full contract).

    Args:
        num_blocks: physical blocks in the KV store.
        block_size: token slots per block (16 is the field's default).
        enable_prefix_caching: share full blocks by content hash and keep freed ones revivable.
        hash_algo: ``"sha256"`` (default, stable), ``"xxh3"`` (fast, needs xxhash),
            ``"builtin"`` (fastest, per-process).
        enable_events: record KV cache events for ``take_events()``. An engine that never
            drains them should turn this off, or they accumulate.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
        enable_events: bool = True,
    ) -> None:
        block_size = as_int(block_size, "block_size")
        if block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(enable_prefix_caching, bool) or not isinstance(enable_events, bool):
            raise ValueError("enable_prefix_caching and enable_events must be bools")
        self._hasher = BlockHasher(hash_algo)
        self._digest = self._hasher.digest
        self._pool = BlockPool(num_blocks)
        self._cache = PrefixCache(self._pool, enable_events) if enable_prefix_caching else None
        self._bs = block_size
        self._rc = self._pool._rc  # the hot paths read refcounts directly
        self._seqs: dict[Hashable, _Seq] = {}
        self._copies: list[CopyOp] = []
        self._cow_copies = 0
        self._forks = 0

    # ---- properties and lookups --------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self._bs

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def hash_algo(self) -> str:
        return self._hasher.name

    @property
    def prefix_caching(self) -> bool:
        return self._cache is not None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: clean plus cached-free (evictable)."""
        return self._pool.num_free

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list:
        return list(self._seqs)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._seqs[seq_id].table)

    def num_tokens(self, seq_id: Hashable) -> int:
        return len(self._seqs[seq_id].tokens)

    def tokens(self, seq_id: Hashable) -> list[int]:
        return self._seqs[seq_id].tokens.tolist()

    def refcount(self, block_id: int) -> int:
        return self._pool.refcount(block_id)

    def slots(self, seq_id: Hashable, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Physical slots of positions ``start..stop`` (default: all): where a prefill writes.

        After ``hit = add_sequence(...)``, the engine computes KV for ``slots(id, hit)``.
        """
        s = self._seqs[seq_id]
        n = len(s.tokens)
        stop = n if stop is None else stop
        if not (type(start) is int and type(stop) is int and 0 <= start <= stop <= n):
            raise ValueError(f"need 0 <= start <= stop <= {n}, got {start}, {stop}")
        pos = np.arange(start, stop, dtype=np.int64)
        table = np.asarray(s.table, dtype=np.int64)
        return table[pos // self._bs] * self._bs + pos % self._bs

    # ---- admission ---------------------------------------------------------------------------

    def add_sequence(self, seq_id: Hashable, prompt_ids: Sequence[int], cache_salt: Any = None) -> int:
        """Admit a sequence with its prompt; returns how many prompt tokens the cache served.

        Blocks for the whole prompt are taken: the longest run of cached full blocks from the
        start (never the whole prompt: the last token is always computed), then fresh blocks.
        Full prompt blocks are published at once. Example (block size 16, a 40-token prompt
        whose first 32 tokens are cached): returns 32; the table is [hit, hit, new].
        """
        if _known(self._seqs, seq_id):
            raise ValueError(f"sequence {seq_id!r} already exists")
        tokens = _token_array(prompt_ids)
        n, bs = len(tokens), self._bs
        if n == 0:
            raise ValueError("the prompt must have at least one token")
        cache = self._cache
        hashes: list = []
        hits: list[int] = []
        root = None
        if cache is not None:
            root = self._hasher.root(cache_salt)
            hashes = self._hasher.chain(root, _le_bytes(tokens), 4 * bs, n // bs)
            hits = cache.longest_prefix(hashes, (n - 1) // bs)
        elif cache_salt is not None:
            self._hasher.root(cache_salt)  # validates the salt's type all the same
        need = -(-n // bs) - len(hits)
        rc = self._rc
        revivals = 0
        for b in hits:
            if not rc[b]:
                revivals += 1
        available = self._pool.num_free - revivals
        if need > available:
            raise OutOfBlocks(need, available, f"admitting {seq_id!r}")
        self._pool._acquire_all(hits)
        table = hits + self._pool._take(need)
        if cache is not None:
            k, nfull = len(hits), len(hashes)
            if nfull > k:
                parent = hashes[k - 1] if k else root
                cache.publish(table[k:nfull], hashes[k:nfull], parent, tokens[k * bs : nfull * bs], bs)
            cache.query_tokens += n
            cache.hit_tokens += k * bs
        nxt = table[-1] * bs + n % bs if n % bs else -1  # the last block is fresh: private
        self._seqs[seq_id] = _Seq(table, tokens, hashes, root, nxt=nxt)
        return len(hits) * bs

    # ---- appends -----------------------------------------------------------------------------

    def append_token(self, seq_id: Hashable, token_id: int) -> int:
        """Append one token; returns its physical slot (``block * block_size + offset``).

        A full last block gets a fresh block after it; a partial last block shared with another
        sequence is copied first (copy-on-write, queued for ``take_copies``).
        """
        s = self._seqs[seq_id]
        if type(token_id) is not int:
            token_id = _as_token(token_id)
        if token_id < 0 or token_id > MAX_TOKEN_ID:
            raise ValueError(f"token id {token_id} outside [0, {MAX_TOKEN_ID}]")
        return self._append(s, token_id)

    def append_tokens(self, seq_id: Hashable, token_ids: Sequence[int]) -> list[int]:
        """Append several tokens (chunked prefill, speculative tokens); all or nothing."""
        s = self._seqs[seq_id]
        toks = _token_array(token_ids)
        if not toks:
            return []
        bs, n = self._bs, len(s.tokens)
        need = -(-(n + len(toks)) // bs) - -(-n // bs)
        if n % bs and self._rc[s.table[-1]] > 1:
            need += 1
        available = self._pool.num_free
        if need > available:
            raise OutOfBlocks(need, available, f"appending to {seq_id!r}")
        return [self._append(s, t) for t in toks]

    def append_batch(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int]) -> np.ndarray:
        """One decode step: append ``token_ids[i]`` to ``seq_ids[i]`` for every i, atomically.

        Returns the step's slot mapping as ``np.int64[len(seq_ids)]``. Either every sequence
        got its token or ``OutOfBlocks`` was raised and none did.
        """
        toks = _token_array(token_ids)  # validates every id in one C loop
        if len(toks) != len(seq_ids):
            raise ValueError(f"{len(seq_ids)} sequence ids but {len(toks)} tokens")
        n = len(toks)
        if n < 2:
            if not n:
                return np.empty(0, dtype=np.int64)
            return np.array([self.append_token(seq_ids[0], toks[0])], dtype=np.int64)
        ss = itemgetter(*seq_ids)(self._seqs)
        if len(set(seq_ids)) != n:
            raise ValueError("a sequence id appears twice in one append_batch")
        pool = self._pool
        if pool.num_free < n:  # only then can the batch fail: count exactly
            need = self._blocks_for_step(ss)
            if need > pool.num_free:
                raise OutOfBlocks(need, pool.num_free, "a decode step")
        bs = self._bs
        slow = self._slot_slow
        out = []
        push = out.append
        filled = []
        for s, t in zip(ss, toks):
            slot = s.nxt
            if slot < 0:
                slot = slow(s)
            s.tokens.append(t)
            push(slot)
            slot += 1
            if slot % bs:
                s.nxt = slot
            else:
                s.nxt = -1
                filled.append(s)
        if filled and self._cache is not None:
            self._publish_filled(filled)
        return np.fromiter(out, dtype=np.int64, count=n)

    def _append(self, s: _Seq, token_id: int) -> int:
        """Append one validated token; the capacity it needs is the caller's to check."""
        slot = s.nxt
        if slot < 0:
            slot = self._slot_slow(s)
        s.tokens.append(token_id)
        nxt = slot + 1
        if nxt % self._bs:
            s.nxt = nxt
        else:
            s.nxt = -1
            if self._cache is not None:
                self._publish_filled((s,))
        return slot

    def _slot_slow(self, s: _Seq) -> int:
        """Where the next token goes when the fast path cannot tell (``s.nxt`` is -1).

        That is when the last block is full (take a fresh block) or may be shared since a fork
        (copy it if another table still holds it). Raises OutOfBlocks before changing anything.
        """
        bs = self._bs
        off = len(s.tokens) % bs
        if off:
            b = s.table[-1]
            if self._rc[b] > 1:
                b = self._copy_on_write(s, b)
        else:
            b = self._pool._take_one()
            s.add_block(b)
        return b * bs + off

    def _blocks_for_step(self, ss: Sequence[_Seq]) -> int:
        """Blocks one decode step of ``ss`` takes: one per full last block, plus the copies.

        ``k`` batch members sharing a partial block held ``r`` times copy ``min(k, r - 1)``
        times: each writer copies while another holder remains, the last holder writes in place.
        """
        bs, rc = self._bs, self._rc
        need = 0
        sharers: dict[int, int] = {}
        for s in ss:
            if len(s.tokens) % bs:
                b = s.table[-1]
                if rc[b] > 1:
                    sharers[b] = sharers.get(b, 0) + 1
            else:
                need += 1
        return need + sum(min(k, rc[b] - 1) for b, k in sharers.items())

    def _copy_on_write(self, s: _Seq, old: int) -> int:
        """Give ``s`` a private copy of its shared partial last block; returns the new block."""
        new = self._pool._take_one()  # raises OutOfBlocks before anything changed
        self._rc[old] -= 1  # still >= 1: another table holds it
        s.set_last(new)
        self._copies.append(CopyOp(old, new))
        self._cow_copies += 1
        return new

    def _publish_filled(self, filled: Sequence[_Seq]) -> None:
        """Each sequence's last block just filled: hash it (chained), offer it to the cache.

        One call per decode step, not per block, with every lookup hoisted out of the loop.
        """
        bs, digest, cache = self._bs, self._digest, self._cache
        m, keys, events = cache._map, self._pool._keys, cache.events_enabled
        for s in filled:
            block_tokens = s.tokens[-bs:]
            hashes = s.hashes
            parent = hashes[-1] if hashes else s.root
            h = digest(parent, _le_bytes(block_tokens))
            hashes.append(h)
            if h not in m:
                b = s.table[-1]
                m[h] = b
                keys[b] = h
                if events:
                    if cache._removed:
                        cache._flush_removed()
                    cache._events.append(((h,), parent, block_tokens, bs))  # raw: see stored_raw

    def take_copies(self) -> list[CopyOp]:
        """Drain the copies queued by copy-on-write; run them before writing this step's KV."""
        copies, self._copies = self._copies, []
        return copies

    # ---- fork and free -----------------------------------------------------------------------

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares every block of the parent: O(blocks), no allocation, no copy."""
        p = self._seqs[parent_id]
        if _known(self._seqs, child_id):
            raise ValueError(f"sequence {child_id!r} already exists")
        rc = self._rc
        for b in p.table:
            rc[b] += 1
        p.nxt = -1  # the partial last block, if any, is shared now: the next write decides
        mirror = None if p.mirror is None else p.mirror.copy()
        self._seqs[child_id] = _Seq(p.table.copy(), p.tokens[:], p.hashes.copy(), p.root, mirror)
        self._forks += 1

    def free(self, seq_id: Hashable, *, cache: bool = True) -> None:
        """Release every block of the sequence, tail first (so its prefix is evicted last).

        ``cache=False`` is for a sequence whose K/V was never (fully) written, such as a request
        aborted before its prefill ran: the blocks it alone holds are unpublished and return
        clean, so no later prompt can hit content that was never computed. Blocks another
        sequence still holds keep their hashes.
        """
        if not isinstance(cache, bool):
            raise ValueError(f"cache must be a bool, got {cache!r}")
        s = self._seqs.pop(seq_id)
        if self._copies:  # a copy into a block of this sequence has nothing left to serve
            mine = {b for b in s.table if self._rc[b] == 1}
            self._copies = [c for c in self._copies if c.dst not in mine]
        if not cache and self._cache is not None:
            rc, keys = self._rc, self._pool._keys
            self._cache.unpublish([b for b in s.table if rc[b] == 1 and b in keys])
        self._pool._release_all(reversed(s.table))

    # ---- prefix cache ------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; refused (False, nothing changed) while any block is in use."""
        if self._pool.num_used:
            return False
        if self._cache is not None:
            self._cache.clear()
        return True

    def take_events(self) -> list:
        """Drain the KV cache events (BlockStored / BlockRemoved / AllBlocksCleared)."""
        return self._cache.take_events() if self._cache is not None else []

    # ---- exports for kernels -----------------------------------------------------------------

    def block_tables(self, seq_ids: Sequence[Hashable], pad: int = -1) -> np.ndarray:
        """Block tables as one padded ``np.int32[len(seq_ids), max_blocks]`` array (vLLM's form).

        Rows are copied from each sequence's int32 mirror, so the cost is one slice copy per
        sequence (about 0.5 µs), not one Python int per block.
        """
        ss = [self._seqs[i] for i in seq_ids]
        pad = as_int(pad, "pad")
        if not -(2**31) <= pad < 2**31:
            raise ValueError(f"pad must fit in int32, got {pad}")
        width = max((len(s.table) for s in ss), default=0)
        out = np.full((len(ss), width), pad, dtype=np.int32)
        for row, s in zip(out, ss):
            row[: len(s.table)] = s.int32_table()
        return out

    def flashinfer_layout(self, seq_ids: Sequence[Hashable]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """FlashInfer's paged layout: ``(indptr, indices, last_page_len)``, all ``np.int32``.

        Example (page size 4, lengths 10, 4, 5; tables [0,1,2], [3], [4,5]):
        indptr [0, 3, 4, 6], indices [0, 1, 2, 3, 4, 5], last_page_len [2, 4, 1].
        """
        ss = [self._seqs[i] for i in seq_ids]
        nblocks = np.fromiter((len(s.table) for s in ss), dtype=np.int32, count=len(ss))
        indptr = np.zeros(len(ss) + 1, dtype=np.int32)
        np.cumsum(nblocks, out=indptr[1:])
        if ss:
            indices = np.concatenate([s.int32_table() for s in ss])
        else:
            indices = np.empty(0, dtype=np.int32)
        ntok = np.fromiter((len(s.tokens) for s in ss), dtype=np.int32, count=len(ss))
        last_page_len = (ntok - 1) % self._bs + 1
        return indptr, indices, last_page_len.astype(np.int32)

    # ---- accounting --------------------------------------------------------------------------

    def usage(self) -> Usage:
        """What the cache holds now (see :class:`~pagedkv.types.Usage`)."""
        bs, pool = self._bs, self._pool
        used = pool.num_used
        logical = logical_blocks = 0
        partial: dict[int, int] = {}  # distinct partial last blocks -> tokens they hold
        for s in self._seqs.values():
            n = len(s.tokens)
            logical += n
            logical_blocks += len(s.table)
            if n % bs:
                partial[s.table[-1]] = n % bs
        stored = used * bs - sum(bs - k for k in partial.values())
        allocated = used * bs
        cache = self._cache
        return Usage(
            num_blocks=pool.num_blocks,
            block_size=bs,
            num_sequences=len(self._seqs),
            logical_tokens=logical,
            stored_tokens=stored,
            used_blocks=used,
            free_blocks=pool.num_clean,
            cached_blocks=pool.num_cached,
            allocated_slots=allocated,
            internal_fragmentation=1 - stored / allocated if allocated else 0.0,
            blocks_saved_by_sharing=logical_blocks - used,
            prefix_query_tokens=cache.query_tokens if cache is not None else 0,
            prefix_hit_tokens=cache.hit_tokens if cache is not None else 0,
            cow_copies=self._cow_copies,
            forks=self._forks,
            evictions=pool.evictions,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError unless the pool, the tables and the cache agree.

        Checks: the pool's own states (free + cached-free + used = total, nothing both free and
        referenced); each block's refcount equals the number of table entries pointing at it;
        each table has ``ceil(num_tokens / block_size)`` entries; a partial block is only ever a
        last block, shared by sequences of equal length within it; every sequence's stored
        hashes are the chained hashes of its tokens; the hash map and the pool's keys are one
        bijection; and every mapped hash of a live sequence's block is that block's content hash.
        """
        self._pool.check_invariants()
        refs = Counter(chain.from_iterable(s.table for s in self._seqs.values()))
        rc = self._rc
        for b, c in enumerate(rc):
            _require(refs.get(b, 0) == c, f"block {b}: refcount {c}, referenced {refs.get(b, 0)} times")
        bs = self._bs
        partial_fill: dict[int, int] = {}
        for sid, s in self._seqs.items():
            n = len(s.tokens)
            _require(n >= 1, f"sequence {sid!r} is empty")
            _require(len(s.table) == -(-n // bs), f"sequence {sid!r}: {len(s.table)} blocks for {n} tokens")
            if s.mirror is not None:
                _require(s.mirror[: len(s.table)].tolist() == s.table, f"sequence {sid!r}: int32 mirror differs")
            if n % bs:
                b = s.table[-1]
                _require(partial_fill.setdefault(b, n % bs) == n % bs, f"partial block {b} shared at two fills")
            if s.nxt >= 0:
                ok = n % bs and s.nxt == s.table[-1] * bs + n % bs and rc[s.table[-1]] == 1
                _require(bool(ok), f"sequence {sid!r}: fast-path slot {s.nxt} is not its private next slot")
        for sid, s in self._seqs.items():
            for b in s.table[: len(s.tokens) // bs]:
                _require(b not in partial_fill, f"block {b} is full in {sid!r} but partial elsewhere")
        self._check_cache()

    def _check_cache(self) -> None:
        cache, keys, bs = self._cache, self._pool._keys, self._bs
        if cache is None:
            _require(not keys, "blocks carry keys with prefix caching off")
            return
        _require(len(cache) == len(keys), f"{len(cache)} hashes mapped, {len(keys)} blocks keyed")
        for h, b in cache.items():
            _require(keys.get(b) == h, f"hash maps to block {b}, whose key differs")
        for sid, s in self._seqs.items():
            nfull = len(s.tokens) // bs
            data = _le_bytes(s.tokens[: nfull * bs])
            expect = self._hasher.chain(s.root, data, 4 * bs, nfull)
            _require(s.hashes == expect, f"sequence {sid!r}: stored hashes are not its tokens' hashes")
            for b, h in zip(s.table, expect):
                k = keys.get(b)
                _require(k is None or k == h, f"block {b} of {sid!r} is mapped under another content's hash")


def _token_array(token_ids: Any) -> array:
    """Token ids as a fresh ``array('I')``, validated: integers in ``[0, 2**32)``, else ValueError.

    Lists and tuples convert in one C loop (about 7 ns a token); numpy integer arrays by a
    range check and one cast, never element by element.
    """
    if type(token_ids) is list or type(token_ids) is tuple:
        try:
            return array("I", token_ids)
        except (TypeError, OverflowError) as exc:
            raise ValueError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]: {exc}") from None
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iub":  # bools are 0/1, as in lists
            raise ValueError(f"token ids must be a 1-D integer array, got {token_ids.dtype} {token_ids.shape}")
        out = array("I")
        if token_ids.size:
            if int(token_ids.min()) < 0 or int(token_ids.max()) > MAX_TOKEN_ID:
                raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]")
            out.frombytes(token_ids.astype(np.uint32).tobytes())
        return out
    if isinstance(token_ids, (str, bytes, bytearray)) or not isinstance(token_ids, Iterable):
        raise ValueError(f"token ids must be a sequence of ints, got {type(token_ids).__name__}")
    return _token_array(list(token_ids))


def _le_bytes_swapped(tokens: array) -> bytes:  # pragma: no cover - no big-endian CI
    tokens = tokens[:]
    tokens.byteswap()
    return tokens.tobytes()


# The tokens' bytes as little-endian uint32, the form every hash is computed over: on a
# little-endian machine that is the array's own memory, and the C method is called directly.
_le_bytes = _le_bytes_swapped if _BIG_ENDIAN else array.tobytes


def _known(seqs: dict, seq_id: Any) -> bool:
    """Whether a new id is taken; an id that cannot be a dict key is a bad argument."""
    try:
        return seq_id in seqs
    except TypeError:
        raise ValueError(f"sequence ids must be hashable, got {type(seq_id).__name__}") from None


def _as_token(token: Any) -> int:
    """Accept numpy integers as token ids; reject floats, bools' cousins and everything else."""
    if isinstance(token, (float, str, bytes)) or isinstance(token, np.floating):
        raise ValueError(f"token id must be an integer, got {token!r}")
    try:
        return operator.index(token)
    except TypeError:
        raise ValueError(f"token id must be an integer, got {type(token).__name__}") from None


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)
