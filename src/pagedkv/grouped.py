"""The grouped manager: one block pool, one table per group of layers (contract v3).

A hybrid model (gpt-oss: sliding window 128 and full attention, alternating; Gemma 3: five
sliding layers of 1,024 per full one; Llama 4: chunked local attention of 8,192) keeps one block
table per group of layers that share an attention type. ``KVCacheManager(..., groups=[...])``
returns a :class:`GroupedKVCacheManager` (unless ``groups`` is exactly ``[FullAttention()]``,
which is the plain manager). What it keeps, and why:

* **One pool for all groups.** Every group draws block ids from one :class:`BlockPool`, so memory
  a sliding group gives back serves the full group's next block. A block id belongs to one
  group's tables at a time.
* **One hash chain per sequence** (computed once), serving every group. The prefix cache's key is
  ``(group, hash)``: group 1's block for a prompt's block 3 and group 0's block for it are two
  blocks (they hold different layers' K/V) under two keys. Events carry the bare hash and name
  the group in ``group_idx``.
* **Release as the window moves.** Let c be a sequence's committed positions (``num_computed``
  minus pending drafts). A sliding-window group (W) no longer reads the blocks wholly below
  position c - W + 1, a chunked group (C) those below floor(c/C)*C. They are released at the
  sequence's next call that schedules positions, *before* that call allocates, so they can
  serve it; not at the end of the call that moved c, because the engine has not yet run the
  step whose queries (up to position c - 1) still read position c - W. Released entries read -1.
  A released full block that is published becomes cached-free, revivable by a later hit.
* **The hit rule.** A hit of h tokens (a multiple of the block size, never the whole prompt)
  needs, per group, the blocks that computing position h reads: full attention every block
  below h, a window of W the blocks covering h-W+1 .. h-1, a chunked group those covering
  floor(h/C)*C .. h-1 (none at a chunk boundary). ``lookup`` and ``add_sequence`` return the
  longest h valid for every group; entries a group does not need read -1.

Worked example (block size 16, ``[FullAttention(), SlidingWindow(128)]``, a 1,000-token prompt
admitted whole, then one decode token): the admission takes 63 blocks per group (the step's
queries read every position); the first append releases the sliding group's blocks 0 .. 53
(position 1,000 reads 873 .. 1,000), so the sequence holds 63 + 9 blocks, not 126.

**Swaps** (``host_blocks > 0``): ``swap_out`` first makes the releases due (the step that read
them has run: a sequence given work since the last ``take_transfers()`` is refused), then moves
every live block of every group that no other sequence holds to a host block, with
``Transfer("to_host", device, host, group=g)``; released entries stay -1, shared ones stay on
the device. ``swap_in`` gives each moved entry a device block again (``Transfer("to_device",
host, device, group=g)``), or revives the device block still cached under its ``(group, hash)``
with no transfer.

**Host prefix cache** (``host_write_policy="write-back"``, prefix caching on): an evicted
published block is offloaded under its ``(group, hash)``; the hit rule runs across tiers (each
group's needed block from the device or the host) and admission loads the host ones
(``Transfer("to_device", host, block, group=g)``). Reachability per group (the plain rule, "a
host block is kept while its parent is on a tier", would drop most window blocks, whose chains
have released holes): a full group's host block needs its parent ``(g, previous hash)``, a
sliding or chunked group's block ``(g, h)`` the first full group's ``(f, h)`` (see
:meth:`_host_anchor`). ``"write-through"`` is refused with a host tier; ``"none"`` keeps the
tier for swaps only. Example in docs/design.md 3.12.1.
``reserve=True`` is refused (reserving a whole prompt's blocks in a sliding group would hold
what the window releases).

Not thread-safe: one engine thread calls it. It pickles to an equal state.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from itertools import chain
from typing import Any, Hashable, Iterable, Sequence

import numpy as np

from .checks import as_int, flag, int_at_least, optional_int_at_least
from .checks import require as _require
from .hashing import MAX_TOKEN_ID, BlockHasher, ExtraKeys
from .kv_specs import AttentionSpec, ChunkedLocalAttention, FullAttention, SlidingWindow, check_groups
from .manager import KVCacheManager
from .pool import MAX_BLOCKS, BlockPool
from .copy_queue import CopyQueue
from .sequences import as_token as _as_token
from .sequences import known as _known
from .sequences import not_ready as _not_ready
from .sequences import le_bytes as _le_bytes
from .sequences import batch_arguments as _batch_arguments
from .sequences import batch_seqs as _batch_seqs
from .sequences import filled_columns as _filled_columns
from .sequences import token_array as _token_array
from .host_tier import WRITE_POLICIES, HostTier
from .pending_events import EventLog
from .prefix_cache import PrefixCache
from .types import TO_HOST, BlockRemoved, BlockStored, OutOfBlocks, PrefixHit, Transfer, Usage

__all__ = ["GroupedKVCacheManager", "next_release"]

WINDOW_EVICTIONS = ("with_prefix", "on_release")
_NEVER = 1 << 62  # a committed count no sequence reaches: "no release is ever due"
MEMO_ENTRIES = 256
MEMO_BLOCKS = 1 << 16


def next_release(spec: AttentionSpec, c: int, block_size: int, limit: int | None = None) -> int:
    """The smallest committed count c' > c at which ``spec.released_below`` grows: until then a
    decode token needs no release check. Example (block size 16, window 128, c = 1,000: blocks
    below 54 released): block 54 (positions 864 .. 879) leaves the window once position 880 is
    the first read, at c' = 880 + 127 = 1,007. Full attention never releases. A spec of
    another type (a subclass) is asked ``released_below`` count by count up to ``limit`` (which
    is returned when nothing is released before it; default: 64 blocks on)."""
    if type(spec) is FullAttention:
        return _NEVER
    if type(spec) not in (SlidingWindow, ChunkedLocalAttention):
        r = spec.released_below(c, block_size)
        stop = c + 64 * block_size if limit is None else limit
        return next((x for x in range(c + 1, stop) if spec.released_below(x, block_size) > r), stop)
    nxt = (spec.released_below(c, block_size) + 1) * block_size  # the first read that must be reached
    window = getattr(spec, "window", None)
    if window is not None:
        return max(c + 1, nxt + window - 1)
    chunk = spec.chunk
    return max(c + 1, -(-nxt // chunk) * chunk)


class _GroupLog(EventLog):
    """The KV event log of a grouped manager: the plain :class:`~pagedkv.pending_events.EventLog`
    (the prefix cache writes to it through the same calls) for cache keys that are
    ``(group, hash)`` pairs. Each event carries the bare hashes and names its group; removals
    fold into one ``BlockRemoved`` per run of one group."""

    __slots__ = ("_removed_group", "_specs")

    def __init__(self, enabled: bool, specs: tuple) -> None:
        super().__init__(enabled)
        self._removed_group = 0
        self._specs = specs

    def removed(self, keys: Iterable[tuple], medium: str) -> None:
        for g, h in keys:
            if self._removed and (g != self._removed_group or medium != self._removed_medium):
                self._flush_removed()
            self._removed_group, self._removed_medium = g, medium
            self._removed.append(h)

    def _removed_event(self, hashes: tuple) -> BlockRemoved:
        return BlockRemoved(hashes, self._removed_medium, self._removed_group)

    def _stored_event(self, e: tuple) -> BlockStored:
        keys, parent = e[0], e[1]
        g = keys[0][0]
        spec = self._specs[g]
        lora, extra = (e[5], e[6]) if len(e) > 5 else (None, None)
        return BlockStored(tuple(h for _, h in keys), parent[1], tuple(e[2]), e[3], e[4], lora, extra,
                           g, spec.kind, spec.sliding_window)


class _GSeq:
    """One sequence: a table per group (-1 where a block was released or never needed), the
    first live entry of each (``low``: the live entries are always a suffix), the tokens and
    the one chain of full-block hashes.

    ``nxt`` is the slot the next token takes when that needs no decision (every group's last
    block partial and private, no release due), -1 otherwise; ``end`` is the slot at which that
    stops (the block's end, or the position at which a release falls due).
    """

    __slots__ = ("tables", "low", "tokens", "hashes", "keys", "nxt", "end", "unscheduled", "drafts",
                 "written", "shared", "host")

    def __init__(self, tables, low, tokens, hashes, keys, unscheduled=0, written=0) -> None:
        self.tables = tables
        self.low = low
        self.tokens = tokens
        self.hashes = hashes
        self.keys = keys
        self.nxt = -1
        self.end = -1
        self.unscheduled = unscheduled
        self.drafts = 0
        self.written = written
        # A fork may have shared the last blocks: the next write checks refcounts (and copies).
        # Only fork shares a partial block; a fresh last block clears it.
        self.shared = False
        # Swapped out: per group, table index -> the host block holding that entry (whose
        # table entry reads -1 meanwhile); None on the device.
        self.host: list[dict[int, int]] | None = None

    @property
    def computed(self) -> int:
        return len(self.tokens) - self.unscheduled

    @property
    def table(self) -> list:
        """Group 0's table: what :func:`~pagedkv.sequences.filled_columns` reads of a sequence."""
        return self.tables[0]


class GroupedKVCacheManager(KVCacheManager):
    """A :class:`~pagedkv.KVCacheManager` for a hybrid model: one table per attention group,
    one pool. Built by ``KVCacheManager(..., groups=[...])``; see the module docstring for the
    semantics and docs/design.md section 3.12. Every public method of the plain manager is
    overridden here (``tests/test_groups.py`` checks it); the per-group exports take
    ``group=0``. Not thread-safe."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
        enable_events: bool = True,
        host_blocks: int = 0,
        host_write_policy: str = "write-back",
        groups: Sequence[AttentionSpec] | None = None,
        window_eviction: str = "with_prefix",
    ) -> None:
        if window_eviction not in WINDOW_EVICTIONS:
            raise ValueError(f"window_eviction must be one of {', '.join(WINDOW_EVICTIONS)}, got "
                             f"{window_eviction!r}")
        specs = check_groups([FullAttention()] if groups is None else groups)
        block_size = int_at_least("block_size", block_size, 1)
        if block_size > 2**31 - 1:
            raise ValueError(f"block_size must be at most {2**31 - 1}, got {block_size}")
        num_blocks = int_at_least("num_blocks", num_blocks, 1)
        if num_blocks > MAX_BLOCKS:
            raise ValueError(f"num_blocks must be at most {MAX_BLOCKS}, got {num_blocks}")
        flag("enable_prefix_caching", enable_prefix_caching)
        flag("enable_events", enable_events)
        host_blocks = int_at_least("host_blocks", host_blocks, 0)
        if host_blocks > MAX_BLOCKS:
            raise ValueError(f"host_blocks must be at most {MAX_BLOCKS}, got {host_blocks}")
        if host_write_policy not in WRITE_POLICIES:
            raise ValueError(f"host_write_policy must be one of {WRITE_POLICIES}, got {host_write_policy!r}")
        if host_blocks and host_write_policy == "write-through":
            raise ValueError("host_write_policy='write-through' does not take groups yet: use 'write-back' "
                             "(offload on eviction) or 'none' (swaps only)")
        self._specs = specs
        self._ng = len(specs)
        self._window_eviction = window_eviction
        # groups that ever release (sliding, chunked): (index, spec)
        self._local = tuple((g, s) for g, s in enumerate(specs) if type(s) is not FullAttention)
        # the same, as (group, window or 0, chunk or 0): the decode slow path's inlined rule
        # (0, 0 for a spec of another type: asked through its methods)
        self._rules = tuple((g, s.window if type(s) is SlidingWindow else 0,
                             s.chunk if type(s) is ChunkedLocalAttention else 0, s) for g, s in self._local)
        self._hasher = BlockHasher(hash_algo)
        self._digest = self._hasher.digest
        self._root = self._hasher.root()
        self._pool = BlockPool(num_blocks, check_args=False)
        self._log = _GroupLog(enable_events and enable_prefix_caching, specs)
        # the host prefix cache: write-back offload of evicted blocks and host hits (keys
        # (group, hash), like the device's); "none" (or no prefix caching) keeps swaps only
        hosted = bool(host_blocks) and enable_prefix_caching and host_write_policy == "write-back"
        self._cache = (PrefixCache(self._pool, self._log, "GPU", keep_content=hosted, track_twins=True)
                       if enable_prefix_caching else None)
        self._full0 = next((g for g, sp in enumerate(specs) if type(sp) is FullAttention), None)
        self._bs = block_size
        self._seqs: dict[Hashable, _GSeq] = {}
        self._unready = 0
        self._cq = CopyQueue(self._pool)  # pending copies and the allocation rule around them
        self._memo: OrderedDict[tuple, list] = OrderedDict()
        self._memo_blocks = 0
        self._cow_copies = 0
        self._forks = 0
        # The host tier (swaps only: see the module docstring), its blocks' groups (set when a
        # swap_out takes a host block; a host block is in one group while held, and only
        # swap_out allocates here), and the sequences given positions or blocks since the last
        # take_transfers() (their K/V is written after that drain: swap_out refuses them).
        # None without a tier: the hot paths pay one test, append_token none.
        if hosted:
            self._tier = HostTier(host_blocks, block_size, self._log, host_write_policy, True,
                                  device=self._cache, root=None, anchor=self._host_anchor, tag=self._tag_host)
            self._cache.forward_evictions(self._tier.offload)
        else:
            self._tier = (HostTier(host_blocks, block_size, None, host_write_policy, caching=False)
                          if host_blocks else None)
        self._hosted = hosted
        self._host_group = array("i", bytes(4 * host_blocks)) if host_blocks else None
        self._busy: set | None = set() if host_blocks else None
        self._swapped = 0
        if host_blocks:
            self.append_token = self._append_token_marking

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_digest"]
        state.pop("append_token", None)  # a bound method of this instance; rebound below
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._digest = self._hasher.digest
        if self._busy is not None:
            self.append_token = self._append_token_marking

    def _host_anchor(self, key: tuple, parent: tuple) -> tuple | None:
        """Reachability of a host block under ``key = (g, h)`` (see docs/design.md 3.12.1): a
        full group's block needs its parent ``(g, previous hash)`` on a tier (none for a first
        block); a sliding or chunked group's block needs the first full group's block of the
        same hash, ``(f, h)``: its own chain has released holes, and a hit past position i needs
        ``(f, h_i)`` anyway. With no full group: none (LRU only). Example ([Full, Sliding(8)]):
        host (1, h3) is dropped when (0, h3) leaves both tiers."""
        g, _ = key
        if type(self._specs[g]) is FullAttention:
            return None if parent[1] == self._root else parent
        f = self._full0
        return None if f is None else (f, key[1])

    def _tag_host(self, host_blocks: list, keys: list) -> None:
        """The host tier stored these keys in these host blocks: tag each with its group."""
        group = self._host_group
        for hb, k in zip(host_blocks, keys):
            group[hb] = k[0]

    def _append_token_marking(self, seq_id: Hashable, token_id: int) -> int:
        """``append_token`` with a host tier: the sequence was given a position this step, so
        ``swap_out`` refuses it until the next ``take_transfers()`` (bound on the instance, so
        a manager without a tier pays nothing per token)."""
        slot = GroupedKVCacheManager.append_token(self, seq_id, token_id)
        self._busy.add(self._seqs[seq_id])
        return slot

    # ---- properties --------------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        """How many attention groups (tables per sequence) the manager keeps."""
        return self._ng

    @property
    def groups(self) -> tuple:
        """The attention specs, one per group, in group order."""
        return self._specs

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host tier (0 without one)."""
        return self._tier.num_blocks if self._tier is not None else 0

    @property
    def num_free_host_blocks(self) -> int:
        """Host blocks a swap can take now (blocks held by swapped-out sequences or by
        undrained transfers are not free)."""
        return self._tier.num_free if self._tier is not None else 0

    def num_swapped_blocks(self, seq_id: Hashable) -> int:
        """Entries of the sequence, over all groups, that live on the host (0 unless it is
        swapped out)."""
        s = self._seq(seq_id)
        return sum(map(len, s.host)) if s.host is not None else 0

    def _group(self, group: Any) -> int:
        g = as_int(group, "group")
        if not 0 <= g < self._ng:
            raise ValueError(f"group must be an int in [0, {self._ng}), got {g}")
        return g

    def block_table(self, seq_id: Hashable, group: int = 0) -> list[int]:
        """Group ``group``'s physical blocks of the scheduled positions, logical order; -1
        where a block left the window (or chunk) and was released, or a hit did not need it."""
        s = self._seq(seq_id)
        return list(s.tables[self._group(group)])

    def reserved_table(self, seq_id: Hashable, group: int = 0) -> list[int]:
        """Every block the sequence holds in the group: its block table (a grouped manager
        reserves nothing beyond the scheduled positions)."""
        return self.block_table(seq_id, group)

    def slots(self, seq_id: Hashable, start: int = 0, stop: int | None = None, group: int = 0) -> np.ndarray:
        """Group ``group``'s physical slots (``np.int64``) of positions ``start..stop`` (``stop``
        defaults to ``num_computed``). A position whose block the group released raises
        ``ValueError``: its K/V is gone from that group."""
        s = self._seq(seq_id)
        g = self._group(group)
        if s.host is not None:
            raise ValueError(_not_ready(seq_id, s, "read the slots of"))
        n = s.computed
        start = as_int(start, "start")
        stop = n if stop is None else as_int(stop, "stop")
        if not 0 <= start <= stop <= n:
            raise ValueError(f"need 0 <= start <= stop <= {n} (scheduled positions), got {start}, {stop}")
        if start < stop and start // self._bs < s.low[g]:
            raise ValueError(f"positions from {start} of {seq_id!r} are released in group {g} "
                             f"(its live blocks start at position {s.low[g] * self._bs})")
        return self._slots(s.tables[g], start, stop)

    def _slots(self, table: list, start: int, stop: int) -> np.ndarray:
        if start == stop:
            return np.empty(0, dtype=np.int64)
        bs = self._bs
        first, last = start // bs, (stop - 1) // bs
        blocks = np.asarray(table[first : last + 1], dtype=np.int64)
        pos = np.arange(start, stop, dtype=np.int64)
        return blocks[pos // bs - first] * bs + pos % bs

    # ---- hashing and the hit rule ------------------------------------------------------------

    def _prompt_hashes(self, keys: ExtraKeys | None, data: bytes, nfull: int, remember: bool) -> list:
        """The prompt's chained block hashes, from a memo a ``lookup`` filled (a scheduler asks
        about a waiting prompt every step; it is hashed once)."""
        memo = self._memo
        if memo or remember:
            key = (keys.ident if keys is not None else None, hashlib.sha256(data).digest())
            hashes = memo.get(key)
            if hashes is not None:
                memo.move_to_end(key)
                return hashes if remember else hashes.copy()
        hashes = self._hasher.chain_keyed(self._root, data, 4 * self._bs, 0, nfull, keys)
        if remember and nfull <= MEMO_BLOCKS:
            memo[key] = hashes
            self._memo_blocks += nfull
            while len(memo) > MEMO_ENTRIES or self._memo_blocks > MEMO_BLOCKS:
                self._memo_blocks -= len(memo.popitem(last=False)[1])
        return hashes

    def _hits(self, hashes: list, limit: int) -> tuple[int, list]:
        """The longest hit (in blocks, at most ``limit``) valid for every group, and per group
        the blocks it takes (those ``hit_blocks`` names, in order). Reads only the cache map."""
        cache, bs = self._cache, self._bs
        get = cache.get
        k = limit
        for g, spec in enumerate(self._specs):
            if type(spec) is FullAttention:
                k = len(cache.longest_prefix([(g, h) for h in hashes[:k]], k))
        present: list[dict] = [{} for _ in self._specs]
        ok = False
        while not ok:
            ok = True
            for g, spec in self._local:
                seen = present[g]
                for i in reversed(spec.hit_blocks(k * bs, bs)):
                    b = seen.get(i)
                    if b is None:
                        b = seen[i] = get((g, hashes[i]))
                    if b is None:
                        k, ok = i, False
                        break
                if not ok:
                    break
        out = []
        for g, spec in enumerate(self._specs):
            r = spec.hit_blocks(k * bs, bs)
            seen = present[g]
            out.append([seen[i] if i in seen else get((g, hashes[i])) for i in r])
        return k, out

    def _hits_tiered(self, hashes: list, limit: int) -> tuple[int, list]:
        """:meth:`_hits` across both tiers (a grouped manager with a host prefix cache): each
        group's needed block may be on the device (preferred) or the host. Returns the hit in
        blocks and per group ``(block, on_host)`` pairs for the blocks the hit takes. Example
        ([Full, Sliding(8)], block size 4, a 13-token prompt whose 3 full blocks were evicted
        to the host): k = 3, group 0 [(h0, True), (h1, True), (h2, True)], group 1 the last two."""
        dget, hget, bs = self._cache.get, self._tier.block_of, self._bs
        memo: list[dict] = [{} for _ in self._specs]

        def get(g: int, i: int):
            seen = memo[g]
            if i in seen:
                return seen[i]
            key = (g, hashes[i])
            b = dget(key)
            if b is not None:
                r = (b, False)
            else:
                hb = hget(key)
                r = None if hb is None else (hb, True)
            seen[i] = r
            return r

        k = limit
        for g, spec in enumerate(self._specs):
            if type(spec) is FullAttention:
                i = 0
                while i < k and get(g, i) is not None:
                    i += 1
                k = i
        ok = False
        while not ok:
            ok = True
            for g, spec in self._local:
                for i in reversed(spec.hit_blocks(k * bs, bs)):
                    if get(g, i) is None:
                        k, ok = i, False
                        break
                if not ok:
                    break
        return k, [[get(g, i) for i in spec.hit_blocks(k * bs, bs)] for g, spec in enumerate(self._specs)]

    def _hit_split(self, k: int, hits: list) -> PrefixHit:
        """The hit of ``k`` blocks as device and host tokens: a position's block counts as host
        when some group loads it. Example (block size 4, k = 3, group 0 loads blocks 1 and 2,
        group 1 loads block 2): PrefixHit(4 device, 8 host)."""
        bs = self._bs
        loaded = set()
        device = []
        for g, spec in enumerate(self._specs):
            for i, (b, on_host) in zip(spec.hit_blocks(k * bs, bs), hits[g]):
                if on_host:
                    loaded.add(i)
                else:
                    device.append(b)
        return PrefixHit((k - len(loaded)) * bs, len(loaded) * bs, self._pool.count_cached(device))

    def lookup(self, prompt_ids: Sequence[int], cache_salt: Any = None, *, lora_name: str | None = None,
               mm_features: Sequence[tuple] | None = None) -> PrefixHit:
        """How many prompt tokens ``add_sequence`` would serve now under the hit rule (the
        longest hit valid for every group); changes nothing. ``revived`` counts the hit blocks,
        over all groups, that are cached-free now."""
        tokens = _token_array(prompt_ids)
        n = len(tokens)
        if n == 0:
            raise ValueError("the prompt must have at least one token")
        keys = None
        if cache_salt is not None or lora_name is not None or mm_features is not None:
            keys = ExtraKeys.make(self._bs, n, lora_name, mm_features, cache_salt)
        if self._cache is None:
            return PrefixHit(0)
        bs = self._bs
        hashes = self._prompt_hashes(keys, _le_bytes(tokens), n // bs, remember=True)
        if self._hosted:
            k, hits = self._hits_tiered(hashes, (n - 1) // bs)
            return self._hit_split(k, hits)
        k, hits = self._hits(hashes, (n - 1) // bs)
        return PrefixHit(k * bs, 0, self._pool.count_cached(list(chain.from_iterable(hits))))

    # ---- releases ----------------------------------------------------------------------------

    def _due(self, s: _GSeq) -> list:
        """``(group, first, stop)`` runs of table entries the sequence's committed positions
        let go (see the module docstring); nothing changes."""
        c = len(s.tokens) - s.unscheduled - s.drafts
        bs = self._bs
        out = []
        low = s.low
        for g, spec in self._local:
            r = spec.released_below(c, bs)
            if r > low[g]:
                out.append((g, low[g], r))
        return out

    def _gain(self, runs: Iterable[tuple[_GSeq, list]]) -> list[int]:
        """Blocks whose last reference these releases drop (they become free)."""
        count: dict[int, int] = {}
        for s, due in runs:
            for g, a, b in due:
                for blk in s.tables[g][a:b]:
                    count[blk] = count.get(blk, 0) + 1
        return self._pool.freed_by(count)

    def _release(self, s: _GSeq, due: list) -> None:
        """Release the runs ``_due`` named: entries read -1, blocks go back (tail first, so that
        within a run the earlier block outlives the later one, as when a sequence is freed)."""
        pool = self._pool
        rc = pool.refcount
        for g, a, b in due:
            table = s.tables[g]
            blocks = table[a:b]
            table[a:b] = [-1] * (b - a)
            s.low[g] = b
            self._let_go(blocks, rc)
            tier = self._tier
            if tier is not None and tier.has_pending():  # a load into a block released before
                unloaded = tier.drop_released_loads(blocks, rc)  # the step ran serves nothing
                if unloaded and self._cache is not None:
                    self._unpublish(unloaded)
            pool.release_all(blocks[::-1])

    def _unpublish(self, blocks: list) -> None:
        """Forget device blocks' keys (their K/V will never be written); with a host prefix
        cache, host blocks anchored on a key now on neither tier go with it."""
        gone = [k for k in map(self._pool.key, blocks) if k is not None] if self._hosted else ()
        self._cache.unpublish(blocks)
        if gone:
            self._tier.drop_orphans(gone)

    def _let_go(self, blocks: list, rc) -> None:
        """Blocks whose last reference is about to go: a pending copy into one has nothing to
        serve (the block is unpublished, its content never arrives), and a twin among them no
        longer holds anything worth its hash."""
        cq = self._cq
        if cq.sources:
            into = [b for b in blocks if cq.is_destination(b) and rc(b) == 1]
            if into:
                cq.drop_into(into)
                if self._cache is not None:
                    self._unpublish(into)
        cache = self._cache
        if cache is not None and cache.has_twins:
            cache.forget_twins([b for b in cache.twins_among(blocks) if rc(b) == 1])

    # ---- admission ---------------------------------------------------------------------------

    def add_sequence(self, seq_id: Hashable, prompt_ids: Sequence[int], cache_salt: Any = None,
                     prefill: int | None = None, reserve: bool = False, *, lora_name: str | None = None,
                     mm_features: Sequence[tuple] | None = None) -> int:
        """Admit a sequence; returns the prompt tokens served from the cache (the hit rule).

        Each group takes the hit blocks it needs (its other entries below the hit read -1) and
        a block for every position of the first chunk (``prefill=k``; None: the whole prompt):
        the chunk's queries read back into the window, so every group holds the chunk. The
        capacity check is per chunk, so a long prompt under a small window prefilled in chunks
        needs only the window and one chunk. Example (block size 4, ``[Full, Sliding(8)]``, 9
        tokens, nothing cached, pool fresh): tables [0, 2, 4] and [1, 3, 5]; returns 0.
        ``reserve=True`` is refused (see the module docstring).
        """
        if _known(self._seqs, seq_id):
            raise ValueError(f"sequence {seq_id!r} already exists")
        tokens = _token_array(prompt_ids)
        n, bs = len(tokens), self._bs
        if n == 0:
            raise ValueError("the prompt must have at least one token")
        prefill = optional_int_at_least("prefill", prefill, 0)
        keys = None
        if cache_salt is not None or lora_name is not None or mm_features is not None:
            keys = ExtraKeys.make(bs, n, lora_name, mm_features, cache_salt)
        if flag("reserve", reserve):
            raise ValueError("reserve=True does not take groups (a sliding group would hold the "
                             "blocks its window releases)")
        cache = self._cache
        ng = self._ng
        hashes: list = []
        k = 0
        hits: list = [[] for _ in range(ng)]
        loads: list = []  # (group, index, host block)
        if cache is not None:
            hashes = self._prompt_hashes(keys, _le_bytes(tokens), n // bs, remember=False)
            if self._hosted:
                k, pairs = self._hits_tiered(hashes, (n - 1) // bs)
                split = self._hit_split(k, pairs)
                hits = []
                for g, spec in enumerate(self._specs):
                    row = []
                    for i, (b, on_host) in zip(spec.hit_blocks(k * bs, bs), pairs[g]):
                        if on_host:
                            loads.append((g, i, b))
                            b = -1  # filled below with the load's device block
                        row.append(b)
                    hits.append(row)
            else:
                k, hits = self._hits(hashes, (n - 1) // bs)
        hit = k * bs
        computed = n if prefill is None else hit + min(prefill, n - hit)
        per = -(-computed // bs) - k  # new blocks per group
        acquire = ((list(chain.from_iterable(hits)) if not loads else [b for b in chain.from_iterable(hits) if b >= 0])
                   if k else [])
        what = f"admitting {seq_id!r}"
        if loads:
            # host hits: the host blocks are pinned before the device allocation (which may
            # offload, and so evict on the host), then loaded into blocks no pending copy reads
            j = len(loads)
            tier = self._tier
            try:
                self._cq.check_room(per * ng, j, what, acquire)
            except OutOfBlocks as e:
                # the j load destinations are the hit's fixed cost: needed and available count
                # the chunk's blocks only, so that a caller sizing the chunk from ``available``
                # (the engine: ``available // groups x block_size`` positions) gets one that fits
                if per * ng == 0:
                    raise
                raise OutOfBlocks(e.needed - j, max(0, e.available - j), what) from None
            tier.pin([hb for _, _, hb in loads])
            dst, new = self._cq.allocate(per * ng, j, acquire)
            tier.load_hits([hb for _, _, hb in loads], dst, split.host)
            for (g, i, _), d in zip(loads, dst):
                hits[g][i - (k - len(hits[g]))] = d
        elif self._cq.sources:
            self._cq.check_room(per * ng, 0, what, acquire)
            new = self._cq.allocate(per * ng, 0, acquire)[1]
        else:
            try:
                new = self._pool.allocate(per * ng, acquire=acquire)
            except OutOfBlocks as e:
                raise OutOfBlocks(e.needed, e.available, what) from None
        tables, low = [], []
        for g in range(ng):
            below = k - len(hits[g])
            tables.append([-1] * below + hits[g] + new[g::ng])
            low.append(below)
        s = _GSeq(tables, low, tokens, hashes, keys, unscheduled=n - computed, written=k)
        if loads:  # loaded blocks are findable on the device (their K/V arrives before the step's reads)
            for (g, i, _), d in zip(loads, dst):
                cache.publish([d], [(g, hashes[i])], (g, hashes[i - 1] if i else self._root),
                              tokens[i * bs : (i + 1) * bs], bs,
                              None if keys is None else keys.block_keys(i, i + 1))
        if cache is not None:
            self._publish_run(s, k, computed // bs)
            cache.record_query(n, hit)
        if s.unscheduled:
            self._unready += 1
        else:
            self._arm(s)
        if self._busy is not None and (computed > hit or loads):  # new positions or loads: nothing written yet
            self._busy.add(s)
        self._seqs[seq_id] = s
        return hit

    def prefill(self, seq_id: Hashable, n: int) -> np.ndarray:
        """Schedule the next ``n`` prompt positions; returns group 0's slots (np.int64).

        First the blocks the windows let go are released (they may serve this chunk), then
        every group takes the chunk's blocks. Atomic: OutOfBlocks changes nothing."""
        s = self._seq(seq_id)
        n = int_at_least("n", n, 0)
        rest = s.unscheduled
        if n > rest:
            raise ValueError(f"prefill of {n} positions, but {rest} of the prompt are unscheduled")
        if not n:
            return np.empty(0, dtype=np.int64)
        bs, ng = self._bs, self._ng
        start = len(s.tokens) - rest
        stop = start + n
        per = -(-stop // bs) - len(s.tables[0])
        due = self._due(s)
        if per > 0 or due:
            gain = self._gain(((s, due),)) if due else ()
            self._cq.check_room(per * ng, 0, f"prefilling {seq_id!r}", (), gain)
            if due:
                self._release(s, due)
            if per > 0:
                new = self._cq.allocate(per * ng, 0)[1]
                for g in range(ng):
                    s.tables[g] += new[g::ng]
        s.unscheduled = rest - n
        if self._busy is not None:
            self._busy.add(s)
        if self._cache is not None:
            self._publish_run(s, start // bs, stop // bs)
        if not s.unscheduled:
            self._unready -= 1
            self._arm(s)
        return self._slots(s.tables[0], start, stop)

    def _publish_run(self, s: _GSeq, first: int, stop: int) -> None:
        """Offer full blocks ``first..stop`` of every group (one event per group)."""
        if stop <= first:
            return
        bs, cache = self._bs, self._cache
        tokens = s.tokens[first * bs : stop * bs]
        bkeys = None if s.keys is None else s.keys.block_keys(first, stop)
        for g in range(self._ng):
            a = max(first, s.low[g])  # (a released entry was published when it filled)
            if a >= stop:
                continue
            cache.publish(s.tables[g][a:stop], [(g, h) for h in s.hashes[a:stop]],
                          (g, s.hashes[a - 1] if a else self._root),
                          tokens[(a - first) * bs :], bs, None if bkeys is None else bkeys[a - first :])

    def _arm(self, s: _GSeq) -> None:
        """Set the decode fast path of a fully scheduled sequence without drafts: the next
        slot, valid while every group's last block is partial and private and no release falls
        due."""
        bs = self._bs
        c = len(s.tokens)
        off = c % bs
        s.nxt = -1
        if not off or self._due(s):
            return
        rc = self._pool.refcount
        for t in s.tables:
            if rc(t[-1]) != 1:
                return
        end_c = c - off + bs
        for g, spec in self._local:
            r = next_release(spec, c, bs, end_c)
            if r < end_c:
                end_c = r
        s.nxt = s.tables[0][-1] * bs + off
        s.end = s.nxt + end_c - c

    # ---- appends -----------------------------------------------------------------------------

    def append_token(self, seq_id: Hashable, token_id: int) -> int:
        """Append one token; returns group 0's slot. Releases what the windows let go first;
        a full last block gets a fresh block in every group; a shared partial one is copied
        (copy-on-write, per group, ``CopyOp(src, dst, group=g)``)."""
        try:
            s = self._seqs[seq_id]
        except TypeError:
            raise ValueError(f"sequence ids must be hashable, got {type(seq_id).__name__}") from None
        if type(token_id) is not int:
            token_id = _as_token(token_id)
        if token_id < 0 or token_id > MAX_TOKEN_ID:
            raise ValueError(f"token id {token_id} outside [0, {MAX_TOKEN_ID}]")
        slot = s.nxt
        if slot < 0:
            if s.unscheduled or s.drafts or s.host is not None:
                raise ValueError(_not_ready(seq_id, s, "append to"))
            due = self._due(s)
            fresh, copies = self._needs((s,))
            if fresh or copies:
                self._cq.check_room(fresh, copies, f"appending to {seq_id!r}", (),
                                 self._gain(((s, due),)) if due else ())
            slot = self._slot_slow(s)  # (makes the releases due first)
        s.tokens.append(token_id)
        slot += 1
        if slot != s.end:
            s.nxt = slot
        else:
            s.nxt = -1
            if not slot % self._bs and self._cache is not None:
                self._publish_filled((s,))
        return slot - 1

    def _needs(self, ss: Sequence[_GSeq]) -> tuple[int, int]:
        """Fresh blocks and copy-on-write copies one token each for ``ss`` takes (the slow
        ones): a full last block needs a block per group; ``k`` members sharing a partial block
        held ``r`` times copy ``min(k, r - 1)`` times."""
        bs, rc, ng = self._bs, self._pool.refcount, self._ng
        fresh = 0
        sharers: dict[int, int] = {}
        for s in ss:
            if s.nxt >= 0:
                continue
            if len(s.tokens) % bs:
                for t in s.tables:
                    b = t[-1]
                    if rc(b) > 1:
                        sharers[b] = sharers.get(b, 0) + 1
            else:
                fresh += ng
        return fresh, sum(min(k, rc(b) - 1) for b, k in sharers.items())

    def _slot_slow(self, s: _GSeq) -> int:
        """The next token's slot (group 0's) when the fast path cannot tell: make the releases
        due (capacity is the caller's to check, counting them), take a block per group or copy
        a shared partial one, and arm the fast path for the tokens after it. The window rules
        are ``released_below`` and :func:`next_release`, inlined (this runs twice a block per
        sequence under a window: at the release point and at the block's end)."""
        bs, ng = self._bs, self._ng
        c = len(s.tokens)
        off = c % bs
        end_c = c - off + bs
        low = s.low
        cache = self._cache
        for g, w, ch, spec in self._rules:
            if w:
                first = c - w + 1
                r = first // bs if first > 0 else 0
                nr = (r + 1) * bs + w - 1
            elif ch:
                r = (c - c % ch) // bs
                nr = -(-((r + 1) * bs) // ch) * ch
            else:
                r = spec.released_below(c, bs)
                nr = next_release(spec, c, bs, end_c)
            lo = low[g]
            if r > lo:
                if (r == lo + 1 and not self._cq.sources and not (cache is not None and cache.has_twins)
                        and (self._tier is None or not self._tier.has_pending())):
                    t = s.tables[g]  # one block leaves the window: the common case, inlined
                    b = t[lo]
                    t[lo] = -1
                    low[g] = r
                    self._pool.release_all((b,))
                else:
                    self._release(s, ((g, lo, r),))
            if nr < end_c:
                end_c = nr if nr > c else c + 1
        if off:
            if s.shared:
                rc = self._pool.refcount
                for g in range(ng):
                    b = s.tables[g][-1]
                    if rc(b) > 1:
                        self._copy_on_write(s, g, b)
                s.shared = False
        else:
            if self._cq.sources:
                for t, b in zip(s.tables, self._cq.allocate(ng, 0)[1]):
                    t.append(b)
            else:
                one = self._pool.allocate_one
                for t in s.tables:
                    t.append(one())
            s.shared = False
        slot = s.tables[0][-1] * bs + off
        s.end = slot + end_c - c
        return slot

    def _copy_on_write(self, s: _GSeq, g: int, old: int) -> None:
        new = self._cq.destination()
        self._pool.release(old)
        s.tables[g][-1] = new
        self._cq.add(old, new, g)
        self._cow_copies += 1

    def append_tokens(self, seq_id: Hashable, token_ids: Sequence[int], speculative: bool = False) -> list[int]:
        """Append several tokens (``speculative=True``: drafts, never published until
        ``accept`` keeps them); returns group 0's slots. All or nothing."""
        s = self._seq(seq_id)
        if not isinstance(speculative, (bool, np.bool_)):
            raise ValueError(f"speculative must be a bool, got {speculative!r}")
        speculative = bool(speculative)
        toks = _token_array(token_ids)
        k = len(toks)
        if s.unscheduled or (s.drafts and not speculative) or s.host is not None:
            raise ValueError(_not_ready(seq_id, s, "append to"))
        if not k:
            return []
        bs, ng = self._bs, self._ng
        n = len(s.tokens)
        due = self._due(s)
        fresh = (-(-(n + k) // bs) - -(-n // bs)) * ng
        rc = self._pool.refcount
        copies = sum(1 for t in s.tables if rc(t[-1]) > 1) if n % bs else 0
        if fresh or copies or due:
            self._cq.check_room(fresh, copies, f"appending to {seq_id!r}", (),
                             self._gain(((s, due),)) if due else ())
        if due:
            self._release(s, due)
        s.nxt = -1
        if speculative and not s.drafts:
            self._unready += 1
        if self._busy is not None:
            self._busy.add(s)
        out = []
        publish = self._cache is not None and not speculative
        for t in toks:
            c = len(s.tokens)
            off = c % bs
            if off:
                if c == n:  # only the first token can meet a shared partial block
                    for g in range(ng):
                        b = s.tables[g][-1]
                        if rc(b) > 1:
                            self._copy_on_write(s, g, b)
            else:
                new = self._cq.allocate(ng, 0)[1] if self._cq.sources else self._pool.allocate(ng)
                for g in range(ng):
                    s.tables[g].append(new[g])
            out.append(s.tables[0][-1] * bs + off)
            s.tokens.append(t)
            if speculative:
                s.drafts += 1
            elif off == bs - 1 and publish:
                self._publish_filled((s,))
        if not speculative:
            self._arm(s)
        return out

    def accept(self, seq_id: Hashable, k: int) -> None:
        """Keep the first ``k`` pending drafts, drop the rest: blocks that held only dropped
        drafts go back clean (per group, tail first); blocks the kept drafts complete are
        published in every group."""
        s = self._seq(seq_id)
        k = int_at_least("k", k, 0)
        d = s.drafts
        if k > d:
            raise ValueError(f"accept({k}) but {d} drafts are pending")
        if not d:
            return
        bs = self._bs
        n = len(s.tokens) - (d - k)
        del s.tokens[n:]
        keep = -(-n // bs)
        dropped = []
        for t in s.tables:
            dropped.append(t[keep:])
            del t[keep:]
        rc = self._pool.refcount
        order = [b for i in range(len(dropped[0]) - 1, -1, -1) for d_ in dropped for b in (d_[i],)]
        if order:
            self._let_go(order, rc)
            self._pool.release_all(order)
        s.drafts = 0
        self._unready -= 1
        if self._cache is not None:
            first = len(s.hashes)
            nfull = n // bs
            if nfull > first:
                parent = s.hashes[-1] if first else self._root
                data = _le_bytes(s.tokens[first * bs : nfull * bs])
                s.hashes += self._hasher.chain_keyed(parent, data, 4 * bs, first, nfull - first, s.keys)
                self._publish_run(s, first, nfull)
        self._arm(s)

    def append_batch(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int]) -> np.ndarray:
        """One decode step for many sequences, atomically; returns group 0's slots
        (``np.int64``). Releases due in the batch are made before any block is taken."""
        seq_ids, toks, vals = _batch_arguments(seq_ids, token_ids)
        n = len(toks)
        if n < 2:
            if not n:
                return np.empty(0, dtype=np.int64)
            return np.array([self.append_token(seq_ids[0], toks[0])], dtype=np.int64)
        ss = _batch_seqs(self._seqs, seq_ids)
        if self._unready:
            for sid, s in zip(seq_ids, ss):
                if s.unscheduled or s.drafts or s.host is not None:
                    raise ValueError(_not_ready(sid, s, "append to"))
        if self._pool.num_free < self._ng * n or self._cq.sources:  # only then can the batch fail
            slow = [s for s in ss if s.nxt < 0]
            dues = [(s, d) for s in slow for d in (self._due(s),) if d]
            fresh, copies = self._needs(slow)
            self._cq.check_room(fresh, copies, "a decode step", (), self._gain(dues) if dues else ())
            for s, d in dues:  # every release before any allocation: they may serve the step
                self._release(s, d)
        if self._busy is not None:
            self._busy.update(ss)
        bs = self._bs
        slot_slow = self._slot_slow
        out = []
        push = out.append
        filled = []
        for s, t in zip(ss, vals):
            slot = s.nxt
            if slot < 0:
                slot = slot_slow(s)
            s.tokens.append(t)
            push(slot)
            slot += 1
            if slot != s.end:
                s.nxt = slot
            else:
                s.nxt = -1
                if not slot % bs:
                    filled.append(s)
        if filled and self._cache is not None:
            self._publish_filled(filled)
        return np.fromiter(out, dtype=np.int64, count=n)

    def _publish_filled(self, filled: Sequence[_GSeq]) -> None:
        """Each sequence's last block just filled: hash it once, publish it in every group."""
        groups = range(self._ng)
        _, hashes, parents, tokens, keys = _filled_columns(filled, self._bs, self._digest, self._root)
        self._cache.publish_blocks(
            [t[-1] for s in filled for t in s.tables],
            [(g, h) for h in hashes for g in groups],
            [(g, p) for p in parents for g in groups],
            [tk for tk in tokens for _ in groups],
            self._bs,
            None if keys is None else [k for k in keys for _ in groups])

    # ---- copies, transfers, swaps ------------------------------------------------------------

    def take_transfers(self) -> list[Transfer]:
        """Drain the swaps' block transfers, each tagged with its group (``Transfer(direction,
        src, dst, group=g)``), every ``to_host`` before every ``to_device``; run them before
        this step's copies and K/V writes. Always empty without a host tier. It marks the step
        boundary for ``swap_out``: the K/V of everything scheduled before it is written after."""
        tier = self._tier
        if tier is None:
            return []
        self._busy.clear()
        group = self._host_group
        return [Transfer(t.direction, t.src, t.dst, group[t.dst if t.direction == TO_HOST else t.src])
                for t in tier.take_transfers(None)]

    def swap_out(self, seq_id: Hashable) -> None:
        """Preempt a sequence: every live entry of every group that no other sequence holds
        moves to a host block.

        First the releases due are made (the windows' blocks the next query no longer reads:
        no host block for them). Then, group by group, entries in table order, each private
        block gets a host block and ``Transfer("to_host", block, host, group=g)``, its entry
        reads -1, and the device block is released (tail first over the groups, as ``free``;
        a published one stays revivable under its ``(group, hash)``). Shared entries stay, the
        sequence keeping its reference. Until ``swap_in`` the sequence cannot be appended to,
        forked or exported. Refused (ValueError) without a host tier, for a sequence already
        swapped out, mid-prefill or holding drafts, or given positions or blocks since the last
        ``take_transfers()`` (its K/V is written only after that drain), or with a pending
        copy into its blocks. Atomic: OutOfBlocks (too few free host blocks) changes nothing.
        Example (block size 4, ``[Full, Sliding(4)]``, 9 tokens then one decode token: tables
        [0, 2, 4] and [-1, 3, 5]): five host blocks, to_host 0->0, 2->1, 4->2 (group 0) and
        3->3, 5->4 (group 1); both tables read [-1, -1, -1].
        """
        s = self._seq(seq_id)
        tier = self._tier
        if tier is None:
            raise ValueError("swap_out needs a host tier (KVCacheManager(..., host_blocks=N))")
        if s.host is not None:
            raise ValueError(f"sequence {seq_id!r} is already swapped out")
        if s.unscheduled or s.drafts:
            raise ValueError(_not_ready(seq_id, s, "swap out"))
        live = [b for g, t in enumerate(s.tables) for b in t[s.low[g]:]]
        if s in self._busy or tier.pending_on(live) or any(map(self._cq.is_destination, live)):
            raise ValueError(f"cannot swap out {seq_id!r}: it was given positions or blocks in this step "
                             f"(or a copy or transfer of its blocks is pending), whose K/V is written only "
                             f"after take_transfers(); swap it out before scheduling it, or after the step")
        due = self._due(s)
        low = list(s.low)
        for g, _a, b in due:
            low[g] = b
        rc = self._pool.refcount
        # private entries from the first one the releases keep (a block sits at one index of
        # one group's table, so a released entry never shares a block with a moved one)
        moved = [[i for i in range(low[g], len(t)) if rc(t[i]) == 1] for g, t in enumerate(s.tables)]
        device = [s.tables[g][i] for g, idx in enumerate(moved) for i in idx]
        host = tier.swap_out(device, [None] * len(device), f"swapping out {seq_id!r}")
        if due:
            self._release(s, due)
        s.host = []
        it = iter(host)
        group = self._host_group
        for g, idx in enumerate(moved):
            table, mine = s.tables[g], {}
            for i in idx:
                hb = mine[i] = next(it)
                group[hb] = g
                table[i] = -1
            s.host.append(mine)
        s.nxt = -1
        self._unready += 1
        self._swapped += 1
        at = {}  # (index, group) -> the device block that entry held
        for (g, i), b in zip(((g, i) for g, idx in enumerate(moved) for i in idx), device):
            at[i, g] = b
        order = [at[k] for k in sorted(at, key=lambda k: (-k[0], k[1]))]
        cache = self._cache
        if cache is not None and cache.has_twins:
            cache.forget_twins(cache.twins_among(order))  # (all private: their last reference goes)
        self._pool.release_all(order)

    def swap_in(self, seq_id: Hashable) -> None:
        """Bring a swapped-out sequence back: each moved entry gets a device block and a
        ``Transfer("to_device", host, block, group=g)``, or, for a full block whose
        ``(group, hash)`` the device still caches, that block (revived, no transfer). Loaded
        full blocks are published again (their K/V is back before the step's reads). Atomic:
        OutOfBlocks changes nothing. Example (the ``swap_out`` example, nothing evicted since,
        prefix caching on): the full blocks 0, 2 (group 0) and 3 (group 1) are revived; the
        partial ones load into fresh blocks: tables [0, 2, 5] and [-1, 3, 4], transfers
        to_device 2->5 (group 0) and 4->4 (group 1)."""
        s = self._seq(seq_id)
        if s.host is None:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        cache, bs = self._cache, self._bs
        nfull = s.computed // bs
        revive: list[tuple[int, int, int]] = []  # (group, index, device block)
        loads: list[tuple[int, int]] = []  # (group, index)
        for g, mine in enumerate(s.host):
            for i in sorted(mine):
                d = cache.get((g, s.hashes[i])) if cache is not None and i < nfull else None
                if d is not None and not self._cq.is_destination(d):
                    revive.append((g, i, d))
                else:
                    loads.append((g, i))
        revived = [d for _, _, d in revive]
        self._cq.check_room(0, len(loads), f"swapping in {seq_id!r}", revived)
        new = self._cq.allocate(0, len(loads), revived)[0]
        for g, i, d in revive:
            s.tables[g][i] = d
        for (g, i), d in zip(loads, new):
            s.tables[g][i] = d
        self._tier.swap_in([s.host[g][i] for g, i in loads], new, [s.host[g][i] for g, i, _ in revive])
        s.host = None
        self._unready -= 1
        self._swapped -= 1
        if cache is not None:  # loaded full blocks are findable again (a hash mapped meanwhile
            for (g, i), d in zip(loads, new):  # makes the block its twin)
                if i < nfull:
                    cache.publish([d], [(g, s.hashes[i])], (g, s.hashes[i - 1] if i else self._root),
                                  s.tokens[i * bs : (i + 1) * bs], bs,
                                  None if s.keys is None else s.keys.block_keys(i, i + 1))
        self._arm(s)

    # ---- fork and free -----------------------------------------------------------------------

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares every live entry of every group: no allocation, no copy. Fork
        after the step's K/V writes."""
        p = self._seq(parent_id)
        if _known(self._seqs, child_id):
            raise ValueError(f"sequence {child_id!r} already exists")
        if p.unscheduled or p.drafts or p.host is not None:
            raise ValueError(_not_ready(parent_id, p, "fork"))
        pool = self._pool
        for g, t in enumerate(p.tables):
            pool.incref_all(t[p.low[g]:])
        p.nxt = -1
        p.shared = True
        child = self._seqs[child_id] = _GSeq([t.copy() for t in p.tables], p.low.copy(), p.tokens[:],
                                             p.hashes.copy(), p.keys, written=p.computed // self._bs)
        child.shared = True
        if self._busy and p in self._busy:  # forked before the step ran (against the rule)
            self._busy.add(child)
        self._forks += 1

    def free(self, seq_id: Hashable, *, cache: bool = True) -> None:
        """Release every live block of every group, tail first (block i of every group before
        block i - 1). ``cache=False``: the blocks after the written prefix that it alone holds
        are unpublished first (their K/V was never computed). A swapped-out sequence lets go of
        its host blocks and of the shared entries it kept on the device. A block it alone holds
        whose ``swap_in`` load is still pending loses that load and its hash (its K/V never
        arrives)."""
        flag("cache", cache)
        s = self._seq(seq_id)
        del self._seqs[seq_id]
        if s.unscheduled or s.drafts or s.host is not None:
            self._unready -= 1
        if self._busy:
            self._busy.discard(s)
        if s.host is not None:
            self._swapped -= 1
            self._tier.release([hb for mine in s.host for _, hb in sorted(mine.items())])
        tables = s.tables
        rc = self._pool.refcount
        if cache and self._window_eviction == "with_prefix" and self._local and self._cache is not None:
            tables = self._with_released(s, rc)
        order = [b for i in range(len(tables[0]) - 1, -1, -1) for t in tables for b in (t[i],) if b >= 0]
        self._let_go(order, rc)
        tier = self._tier
        unloaded = tier.drop_released_loads(order, rc) if tier is not None else []
        if self._cache is not None and (unloaded or not cache):
            mine = unloaded
            if not cache:
                gone = set(unloaded)
                mine = mine + [b for t in tables for b in t[s.written:] if b >= 0 and rc(b) == 1 and b not in gone]
            if mine:
                self._unpublish(mine)
        self._pool.release_all(order)

    def _with_released(self, s: _GSeq, rc) -> list:
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
        hashes, revive_keyed = s.hashes, self._pool.revive_keyed
        tables = [list(t) for t in s.tables]
        for g, _spec in self._local:
            table = tables[g]
            stop = min(s.low[g], len(hashes))
            gone = [i for i in range(stop) if table[i] < 0]
            for i, b in zip(gone, revive_keyed([(g, hashes[i]) for i in gone])):
                if b is not None:
                    table[i] = b
        return tables

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash of every group; refused (False) while any block is in use on
        either tier or a transfer is pending (so while any sequence is live, swapped out or not)."""
        tier = self._tier
        if self._pool.num_used or (tier is not None and (tier.num_used or tier.has_pending())):
            return False
        if self._cache is not None:
            self._cache.clear()
            if self._hosted:
                self._tier.reset()
            if self._log.enabled:
                self._log.cleared()
        return True

    # ---- exports -----------------------------------------------------------------------------

    def _seq_list(self, seq_ids: Iterable[Hashable]) -> list[_GSeq]:
        seqs = self._seqs
        seq_ids = list(seq_ids)
        try:
            out = [seqs[i] for i in seq_ids]
        except TypeError:
            raise ValueError("sequence ids must be hashable") from None
        if self._swapped:
            for sid, s in zip(seq_ids, out):
                if s.host is not None:
                    raise ValueError(_not_ready(sid, s, "export the block table of"))
        return out

    def block_tables(self, seq_ids: Sequence[Hashable], pad: int = -1, group: int = 0) -> np.ndarray:
        """Group ``group``'s tables as one padded ``np.int32[len(seq_ids), max_blocks]``;
        released entries read -1 whatever ``pad`` is."""
        ss = self._seq_list(seq_ids)
        pad = as_int(pad, "pad")
        if not -(2**31) <= pad < 2**31:
            raise ValueError(f"pad must fit in int32, got {pad}")
        g = self._group(group)
        rows = [s.tables[g] for s in ss]
        width = max(map(len, rows), default=0)
        out = np.full((len(ss), width), pad, dtype=np.int32)
        for row, r in zip(out, rows):
            row[: len(r)] = r
        return out

    def flashinfer_layout(self, seq_ids: Sequence[Hashable], group: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """FlashInfer's paged layout of group ``group``: ``(indptr, indices, last_page_len)``.

        A sliding-window (or chunked) group lists only its live pages, a suffix of the
        sequence: the kernel sees a key/value length of ``live pages * page size`` minus the
        last page's empty tail, whose last position is the sequence's last. FlashInfer's
        ``window_left`` counts back from the query's own position within that suffix, so pass
        ``window_left = W - 1`` (the window counts the query itself): every dropped page lies
        wholly below the window, and the offsets within the suffix equal absolute offsets
        (RoPE was applied before the K/V was cached). A chunked group needs the kernel's own
        chunk mask (FlashInfer has none): its live pages start at or below the chunk start.
        Example (page size 4, window 8, 13 tokens: table [-1, 5, 7, 9]): indptr [0, 3],
        indices [5, 7, 9], last_page_len [1].
        """
        ss = self._seq_list(seq_ids)
        g = self._group(group)
        bs = self._bs
        tables = [s.tables[g][s.low[g]:] for s in ss]
        indptr = np.zeros(len(ss) + 1, dtype=np.int32)
        np.cumsum(np.fromiter(map(len, tables), dtype=np.int32, count=len(ss)), out=indptr[1:])
        indices = np.fromiter(chain.from_iterable(tables), dtype=np.int32, count=int(indptr[-1]))
        ntok = np.fromiter((s.computed for s in ss), dtype=np.int32, count=len(ss))
        last_page_len = np.minimum(ntok, (ntok - 1) % bs + 1)
        return indptr, indices, last_page_len

    # ---- accounting --------------------------------------------------------------------------

    def usage(self, group: int | None = None) -> Usage:
        """What the cache holds now. Without ``group``: block counts totalled over groups (the
        pool's used, free and cached blocks), each sequence's tokens counted once in
        ``logical_tokens``, ``stored_tokens`` the token states every group holds (a position
        held by two groups is two states: two sets of layers). ``usage(group=g)``: group g's
        blocks and token states alone (``free_blocks`` stays the pool's: a free block serves
        any group). Example (block size 4, [Full, Sliding(4)], one 10-token sequence after one
        decode append): group 0 holds 3 blocks and 11 states, group 1 2 blocks and 7."""
        bs, pool = self._bs, self._pool
        groups = range(self._ng) if group is None else (self._group(group),)
        logical = 0
        used: set = set()
        stored = 0
        logical_blocks = 0
        partial: dict[int, int] = {}
        for s in self._seqs.values():
            c = s.computed
            logical += c
            for g in groups:
                t = s.tables[g]
                live = t[s.low[g]:]
                if s.host is not None:  # swapped out: only its shared entries are on the device
                    live = [b for b in live if b >= 0]
                used.update(live)
                logical_blocks += len(live)
                if c % bs and t[-1] >= 0:
                    partial[t[-1]] = c % bs
        stored = len(used) * bs - len(partial) * bs + sum(partial.values())
        nused = len(used) if group is not None else pool.num_used
        cache = self._cache
        if group is None:
            cached = pool.num_cached
        elif cache is None:
            cached = 0
        else:
            g = groups[0]
            cached = sum(1 for b, key in pool.keyed_blocks().items() if key[0] == g and pool.is_cached(b))
        allocated = nused * bs
        tier = self._tier
        host = dict(tier.usage_fields(), swapped_sequences=self._swapped) if tier is not None else {}
        return Usage(
            num_blocks=pool.num_blocks,
            block_size=bs,
            num_sequences=len(self._seqs),
            logical_tokens=logical,
            stored_tokens=stored,
            used_blocks=nused,
            free_blocks=pool.num_clean,
            cached_blocks=cached,
            allocated_slots=allocated,
            internal_fragmentation=1 - stored / allocated if allocated else 0.0,
            blocks_saved_by_sharing=logical_blocks - nused,
            prefix_query_tokens=cache.query_tokens if cache is not None else 0,
            prefix_hit_tokens=cache.hit_tokens if cache is not None else 0,
            cow_copies=self._cow_copies,
            forks=self._forks,
            evictions=pool.evictions,
            **host,
        )

    def check_invariants(self) -> None:
        """AssertionError unless the pool, every group's tables and the cache agree: the pool's
        own states; each block's refcount is its table entries over all groups, and a block
        sits in one group's tables only; each table covers the scheduled positions, -1 below
        its first live entry and live from it, which is no later than what the next query reads
        (``released_below`` of the committed positions); a partial block is a last block shared
        at one fill; the stored hashes are the tokens' chain; a full scheduled non-draft live
        block of group g is mapped under (g, its hash) or is a twin of the block that is; no
        other block carries a hash; the pending copies are batch-safe; the fast path's slot is
        the private next slot, and no release is due before its end."""
        pool = self._pool
        pool.check_invariants()
        bs = self._bs
        refs: Counter = Counter()
        owner: dict[int, int] = {}
        unready = swapped = 0
        host_refs: dict[int, int] = {}
        partial_fill: dict[int, int] = {}
        for sid, s in self._seqs.items():
            n, done = len(s.tokens), s.computed
            c = done - s.drafts
            _require(n >= 1 and 0 <= s.unscheduled <= n and 0 <= s.drafts <= done, f"{sid!r}: bad counters")
            _require(not (s.unscheduled and s.drafts), f"{sid!r}: drafts mid-prefill")
            _require(0 <= s.written <= c // bs, f"{sid!r}: bad written prefix")
            unready += bool(s.unscheduled or s.drafts or s.host is not None)
            _require(len(s.tables) == self._ng == len(s.low), f"{sid!r}: a table per group")
            if s.host is not None:
                swapped += 1
                _require(self._tier is not None and len(s.host) == self._ng, f"{sid!r}: swapped out without a tier")
                _require(not s.unscheduled and not s.drafts and s.nxt < 0, f"{sid!r}: swapped out mid-step")
                for g, mine in enumerate(s.host):
                    for i, hb in mine.items():
                        _require(s.low[g] <= i < len(s.tables[g]) and s.tables[g][i] == -1,
                                 f"{sid!r} group {g}: host entry {i} is not a live index reading -1")
                        _require(self._host_group[hb] == g, f"host block {hb} of group {g} tagged otherwise")
                        host_refs[hb] = host_refs.get(hb, 0) + 1
            for g, (spec, t) in enumerate(zip(self._specs, s.tables)):
                lo = s.low[g]
                on_host = s.host[g] if s.host is not None else {}
                _require(len(t) == -(-done // bs), f"{sid!r} group {g}: {len(t)} blocks for {done} positions")
                _require(all(b == -1 for b in t[:lo]) and all(b >= 0 or i in on_host for i, b in enumerate(t[lo:], lo)),
                         f"{sid!r} group {g}: entries below {lo} must read -1, the rest be live or on the host")
                _require(lo <= spec.released_below(c, bs), f"{sid!r} group {g}: released what the next query reads")
                for b in t[lo:]:
                    if b < 0:
                        continue
                    refs[b] += 1
                    _require(owner.setdefault(b, g) == g, f"block {b} is in two groups' tables")
                if done % bs and t and t[-1] >= 0:
                    b = t[-1]
                    _require(partial_fill.setdefault(b, done % bs) == done % bs, f"partial block {b} at two fills")
            if not s.shared and done % bs and not s.unscheduled and s.host is None:
                _require(all(pool.refcount(t[-1]) == 1 for t in s.tables),
                         f"{sid!r}: a shared partial last block not marked shared")
            if s.nxt >= 0:
                ok = (done % bs and not s.unscheduled and not s.drafts and s.nxt == s.tables[0][-1] * bs + done % bs
                      and all(pool.refcount(t[-1]) == 1 for t in s.tables) and not self._due(s)
                      and s.end > s.nxt and s.end <= s.nxt - done % bs + bs)
                _require(bool(ok), f"{sid!r}: fast-path slot {s.nxt} is not its private next slot")
                steps = s.end - s.nxt  # the fast path runs through committed count done + steps - 1
                for g, spec in self._local:
                    _require(spec.released_below(done + steps - 1, bs) == spec.released_below(done, bs),
                             f"{sid!r}: a release falls due before its fast path ends")
        _require(unready == self._unready, f"{unready} sequences unready, {self._unready} counted")
        _require(swapped == self._swapped, f"{swapped} sequences swapped out, {self._swapped} counted")
        if self._tier is not None:
            rehash = self._hasher.rehash
            self._tier.check_invariants(host_refs, (lambda parent, *rest: (parent[0], rehash(parent[1], *rest)))
                                        if self._hosted else None)
            for hb, key in self._tier.cached_keys().items():
                _require(type(key) is tuple and len(key) == 2 and 0 <= key[0] < self._ng
                         and self._host_group[hb] == key[0], f"host block {hb}: key {key!r} or its group tag is wrong")
            live = {id(s) for s in self._seqs.values()}
            _require(all(id(s) in live and s.host is None for s in self._busy),
                     "a sequence given work this step is freed or swapped out")
        else:
            _require(not swapped, "a sequence is swapped out without a host tier")
        for b, k in enumerate(pool.refcounts()):
            _require(refs.get(b, 0) == k, f"block {b}: refcount {k}, referenced {refs.get(b, 0)} times")
        for s in self._seqs.values():
            for t in s.tables:
                for b in t[: s.computed // bs]:
                    _require(b < 0 or b not in partial_fill, f"block {b} full in one table, partial in another")
        self._cq.check_invariants()
        for c in self._cq.pending():
            _require(pool.refcount(c.dst) > 0 and owner.get(c.dst) == c.group,
                     f"copy destination {c.dst} is free or not in group {c.group}")
        self._check_cache(owner)

    def _check_cache(self, owner: dict) -> None:
        cache, keys, bs = self._cache, self._pool.keyed_blocks(), self._bs
        if cache is None:
            _require(not keys, "blocks carry keys with prefix caching off")
            return
        cache.check_invariants()
        twins = cache.twins()
        held = {}
        for b, k in keys.items():
            _require(type(k) is tuple and len(k) == 2 and 0 <= k[0] < self._ng, f"block {b}: bad key {k!r}")
            _require(owner.get(b, k[0]) == k[0], f"block {b} of group {owner.get(b)} keyed in group {k[0]}")
        for sid, s in self._seqs.items():
            nfull = (len(s.tokens) - s.drafts) // bs
            expect = self._hasher.chain_keyed(self._root, _le_bytes(s.tokens[: nfull * bs]), 4 * bs, 0, nfull,
                                              s.keys)
            _require(s.hashes == expect, f"{sid!r}: stored hashes are not its tokens' hashes")
            offered = (s.computed - s.drafts) // bs
            for g, t in enumerate(s.tables):
                for i in range(s.low[g], len(t)):
                    b, k = t[i], keys.get(t[i])
                    if b < 0:  # swapped out: its content is on the host
                        continue
                    if i >= offered:
                        _require(k is None, f"block {b} of {sid!r} is published before it is scheduled")
                    elif k is None:
                        _require(twins.get(b) == (g, expect[i]), f"full block {b} of {sid!r} group {g} is not findable")
                        held[b] = (g, expect[i])
                    else:
                        _require(k == (g, expect[i]), f"block {b} of {sid!r} is mapped under another content")
        _require(held == twins, "a remembered twin is no live full block of that content")


# ---- argument helpers (the plain manager's rules: token ids are uint32, ids hashable) --------
