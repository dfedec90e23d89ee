"""KVCacheManager: the facade of the allocator; sequences, block tables, fork, copy-on-write,
prefix hits, exports, usage.

This is the only layer that knows what a sequence is: it holds the dict of live sequences and
runs the hot paths (append, fork, free), where a call into another module per token would cost
more than the work. Each structure it drives has one owner, and the manager uses only their
public methods:

* :mod:`~pagedkv.sequences`: one sequence's state (:class:`~pagedkv.sequences.Seq`: table and
  its int32 mirror, tokens, chained hashes, prefill and draft counters, the decode fast-path
  slot), the kernel exports and the per-sequence checks;
* :class:`~pagedkv.pool.BlockPool`: refcounts, free list, eviction, and the hash <-> block
  bijection;
* :class:`~pagedkv.prefix_cache.PrefixCache`: publishing, events, twins, hit statistics;
* :class:`~pagedkv.copy_queue.CopyQueue`: the pending copies, and every allocation they
  constrain;
* :class:`~pagedkv.host_tier.HostTier`: host blocks, transfers, the device side of swaps and
  loads, and its own counters;
* :class:`~pagedkv.hashing.HashMemo`: prompts' hashes a lookup computed, for their admission.

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

import inspect
from typing import Any, Hashable, Sequence

import numpy as np

from .pending_events import EventLog
from .hashing import MAX_TOKEN_ID, BlockHasher, ExtraKeys, HashMemo
from .host_tier import HostTier
from .checks import as_int
from .checks import require as _require
from .copy_queue import CopyQueue
from .pool import BlockPool
from .prefix_cache import PrefixCache
from .kv_specs import FullAttention, check_groups
from .sequences import MAX_BLOCK_SIZE  # noqa: F401 (pagedkv.manager.MAX_BLOCK_SIZE, as before)
from .sequences import Seq as _Seq
from .sequences import as_token as _as_token
from .sequences import (block_tables, blocks_for_step, check_hashes, check_tables, filled_columns, flashinfer_layout,
                        logical_usage, manager_args, not_ready, on_device, slots_of)
from .sequences import count as _count
from .sequences import known as _known
from .sequences import le_bytes as _le_bytes
from .sequences import batch_arguments as _batch_arguments
from .sequences import batch_seqs as _batch_seqs
from .sequences import token_array as _token_array
from .types import CopyOp, PrefixHit, Transfer, Usage

__all__ = ["KVCacheManager"]

# Prompts whose block hashes a lookup computed (the waiting queue a scheduler keeps asking
# about): at most 256 prompts and 65,536 block hashes in all (about 5 MiB), whichever binds
# first, so that a few 100,000-token prompts cannot make the memo hold hundreds of MiB.
HASH_MEMO_ENTRIES = 256
HASH_MEMO_BLOCKS = 1 << 16


class KVCacheManager:
    """The block allocator of a paged KV cache.

    Args:
        num_blocks: physical blocks in the KV store (at most 2**31 - 1: block ids are int32).
        block_size: token slots per block (16 is the field's default).
        enable_prefix_caching: share full blocks by content hash and keep freed ones revivable.
        hash_algo: ``"sha256"`` (default, stable across processes), ``"xxh3"`` (fast, stable,
            needs xxhash), ``"builtin"`` (fastest, keyed per process).
        enable_events: record KV cache events for ``take_events()``. An engine that never
            drains them should turn this off, or they accumulate.
        host_blocks: blocks of a host-memory tier (0: none). It keeps what the device evicts,
            serves prefix hits from host memory and holds swapped-out sequences.
        host_write_policy: when a device block is copied to the host: ``"write-back"`` (when
            the device evicts it), ``"write-through"`` (once it is computed, and again when the
            device evicts it if the host has dropped it since) or ``"none"`` (never: the host
            takes only swapped-out sequences, and the published blocks a swap put there serve
            prefix hits until the host needs the room).

    The engine's loop, and the rules it follows:

    * **Admit** with ``add_sequence(id, prompt)`` (returns the prompt tokens served by the
      prefix cache) and compute K/V for ``slots(id, hit)``; or admit one chunk at a time with
      ``add_sequence(id, prompt, prefill=k)`` and ``prefill(id, n)`` (chunked prefill).
      ``lookup(prompt)`` asks how much would hit, changing nothing.
    * **Decode** with ``append_batch(ids, tokens)`` (one slot per sequence), then
      ``take_copies()`` and run those block copies (all layers, as one batch) **before** the
      step's K/V writes: a copy-on-write destination holds nothing until its source is copied.
    * **Fork between steps**: ``fork`` after the step's K/V writes. Forking a sequence whose
      newest token has no K/V yet shares (and may later copy) slots that were never written.
    * **Speculate** with ``append_tokens(id, drafts, speculative=True)`` and settle with
      ``accept(id, k)``: drafts are never published; rejected ones return their blocks.
    * **Free** with ``free(id)``; ``free(id, cache=False)`` for a sequence dropped after it was
      scheduled but before its K/V was computed (what it computed itself and alone holds stops
      being findable; its prefix hits stay cached).
    * **Out of blocks**: every allocating call raises ``OutOfBlocks(needed, available)`` and
      changes nothing; preempt and call again.

    A block is published (findable by later prompts) only once every one of its positions has
    been scheduled for compute, and never for a draft token: the engine computes everything it
    scheduled in the step it scheduled it, so a hit always reads K/V that exists. Every such
    block of a live sequence stays findable (itself, or an equal block: a twin takes over a
    hash whose block leaves the map).

    Errors: an unknown sequence id is a ``KeyError``; a duplicate id, an empty prompt, an
    unhashable id, a bad token or any other bad argument is a ``ValueError``. A failing call
    changes nothing observable (tables, refcounts, free list and LRU order, cache entries,
    pending copies, statistics, queued events).

    A manager is **not thread-safe**: one engine thread calls it (two threads appending to
    different sequences can hand one block to two tables). It pickles to an equal state
    (``builtin`` hashes stay valid only within the process that computed them).
    """

    def __new__(cls, *args: Any, groups: Sequence | None = None, **kwargs: Any) -> "KVCacheManager":
        """``groups`` other than ``None`` or exactly ``[FullAttention()]`` builds the grouped
        manager (:class:`~pagedkv.grouped.GroupedKVCacheManager`, contract v3); everything else
        is this class, unchanged."""
        if groups is None and len(args) > 7:  # passed positionally, after host_write_policy
            groups = args[7]
        if cls is KVCacheManager and groups is not None and not _one_full(check_groups(groups)):
            from .grouped import GroupedKVCacheManager

            return super().__new__(GroupedKVCacheManager)
        return super().__new__(cls)

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
        enable_events: bool = True,
        host_blocks: int = 0,
        host_write_policy: str = "write-back",
        groups: Sequence | None = None,
    ) -> None:
        num_blocks, block_size, host_blocks = manager_args(
            num_blocks, block_size, enable_prefix_caching, enable_events, host_blocks, host_write_policy)
        if groups is not None and not _one_full(check_groups(groups)):
            raise ValueError("groups other than [FullAttention()] need the grouped manager "
                             "(pagedkv.grouped.GroupedKVCacheManager), which KVCacheManager(..., "
                             "groups=[...]) builds")
        self._hasher = BlockHasher(hash_algo)
        self._digest = self._hasher.digest
        self._root = self._hasher.root()  # every prompt's first block is chained from it
        # The manager passes the pool only blocks it was handed, so batch calls skip re-checking
        # ids; the tables' consistency is what check_invariants() proves.
        self._pool = BlockPool(num_blocks, check_args=False)
        self._log = EventLog(enable_events and enable_prefix_caching)
        tiered = host_blocks > 0
        self._cache = (PrefixCache(self._pool, self._log, "GPU", keep_content=tiered, track_twins=True)
                       if enable_prefix_caching else None)
        # The host tier, when asked for: offloads what the device evicts, serves prefix hits
        # from host memory, holds swapped-out sequences. None costs the hot paths nothing.
        self._tier = (HostTier(host_blocks, block_size, self._log, host_write_policy, enable_prefix_caching,
                               device=self._cache, root=self._root) if tiered else None)
        if self._tier is not None and self._cache is not None:  # every policy: see HostTier.offload
            self._cache.forward_evictions(self._tier.offload)
        self._write_through = tiered and enable_prefix_caching and host_write_policy == "write-through"
        # With a host tier: the sequences given positions or blocks since the last
        # take_transfers() (the step's first drain). Their K/V is written only after that
        # drain, so swap_out refuses them. None without a tier: the hot paths pay one test, and
        # the per-token append_token none (a tiered manager's instance uses a marking wrapper).
        self._busy: set | None = set() if tiered else None
        if tiered:
            self.append_token = self._append_token_marking
        self._swapped = 0
        self._bs = block_size
        # Slot offsets within a block, for turning a run of blocks into slots in one broadcast;
        # not kept for absurd block sizes (a 2**31-slot block would make it 16 GiB).
        self._offsets = np.arange(block_size, dtype=np.int64) if block_size <= 1 << 16 else None
        self._seqs: dict[Hashable, _Seq] = {}
        self._unready = 0  # sequences mid-prefill or holding drafts: only they need checks
        # Pending copy-on-write copies and every allocation made while some are pending.
        self._cq = CopyQueue(self._pool)
        # Prompts' hashes computed by lookup, for the admission of the same prompt (see HashMemo).
        self._hash_memo = HashMemo(HASH_MEMO_ENTRIES, HASH_MEMO_BLOCKS)
        self._cow_copies = 0
        self._forks = 0

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_digest"]  # a closure; rebuilt from the hasher
        state.pop("append_token", None)  # a bound method of this instance; rebound below
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._digest = self._hasher.digest
        if self._busy is not None:
            self.append_token = self._append_token_marking

    def _append_token_marking(self, seq_id: Hashable, token_id: int) -> int:
        """``append_token`` of a manager with a host tier: the sequence was given a position
        this step, so ``swap_out`` refuses it until the next ``take_transfers()``. Bound on the
        instance, so that a manager without a tier pays nothing per token."""
        slot = KVCacheManager.append_token(self, seq_id, token_id)
        self._busy.add(self._seqs[seq_id])
        return slot

    # ---- properties and lookups --------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        """Attention groups (block tables per sequence): 1, a uniform model's one group."""
        return 1

    @property
    def block_size(self) -> int:
        """Token slots per block."""
        return self._bs

    @property
    def num_blocks(self) -> int:
        """Physical blocks in the pool, used or free."""
        return self._pool.num_blocks

    @property
    def hash_algo(self) -> str:
        """The block hash algorithm: ``"sha256"``, ``"xxh3"`` or ``"builtin"``."""
        return self._hasher.name

    @property
    def prefix_caching(self) -> bool:
        """Whether full blocks are shared by content hash and kept revivable when freed."""
        return self._cache is not None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: clean plus cached-free (evictable)."""
        return self._pool.num_free

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host tier (0 without one)."""
        return self._tier.num_blocks if self._tier is not None else 0

    @property
    def num_free_host_blocks(self) -> int:
        """Host blocks a swap or an offload can take now: clean plus cached-free (0 without a
        tier). Blocks held by swapped-out sequences or by undrained transfers are not free."""
        return self._tier.num_free if self._tier is not None else 0

    def num_swapped_blocks(self, seq_id: Hashable) -> int:
        """Blocks of the sequence that live on the host (0 unless it is swapped out): at most
        what ``swap_in`` takes from the device (fewer when some are still cached there)."""
        s = self._seq(seq_id)
        return len(s.host) if s.host is not None else 0

    @property
    def num_sequences(self) -> int:
        """Live sequences (admitted and not freed)."""
        return len(self._seqs)

    def __contains__(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` is a live sequence; an unhashable id answers False."""
        try:
            return seq_id in self._seqs
        except TypeError:  # an unhashable id is never a sequence
            return False

    def seq_ids(self) -> list:
        """The live sequence ids, in admission order."""
        return list(self._seqs)

    def block_table(self, seq_id: Hashable, group: int = 0) -> list[int]:
        """Physical block ids of the sequence's scheduled positions, logical order (``group``:
        0, the one group)."""
        s = self._seq(seq_id)
        _group_zero(group)
        if s.unscheduled:  # admitted with reserve=True: the reserved tail is not scheduled
            return s.table[: -(-s.computed // self._bs)]
        return list(s.table)

    def reserved_table(self, seq_id: Hashable, group: int = 0) -> list[int]:
        """Every block the sequence holds, logical order: ``block_table(id)`` plus, for a prompt
        admitted with ``reserve=True`` and not fully scheduled yet, the blocks reserved for its
        unscheduled positions. Example (block size 16, a 40-token prompt admitted with
        ``prefill=0, reserve=True``, nothing cached): ``block_table`` is [], this is [0, 1, 2]."""
        s = self._seq(seq_id)
        _group_zero(group)
        return list(s.table)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Every token the sequence knows: the whole prompt, appended tokens, pending drafts."""
        return len(self._seq(seq_id).tokens)

    def num_computed(self, seq_id: Hashable) -> int:
        """Positions scheduled for compute so far: prefix hits, prefilled chunks, appended
        tokens and pending drafts. Equals ``num_tokens`` once the prompt is fully scheduled."""
        return self._seq(seq_id).computed

    def num_drafts(self, seq_id: Hashable) -> int:
        """Speculative tokens appended and not yet settled by ``accept``."""
        return self._seq(seq_id).drafts

    def tokens(self, seq_id: Hashable) -> list[int]:
        """The sequence's token ids: the whole prompt, appended tokens, pending drafts."""
        return self._seq(seq_id).tokens.tolist()

    def refcount(self, block_id: int) -> int:
        """How many block tables hold the block (0 when it is free); ValueError out of range."""
        return self._pool.refcount(block_id)

    def slots(self, seq_id: Hashable, start: int = 0, stop: int | None = None, group: int = 0) -> np.ndarray:
        """Physical slots (``np.int64``) of positions ``start..stop``, where a prefill writes.

        ``stop`` defaults to ``num_computed(id)``, the last scheduled position: after
        ``hit = add_sequence(...)`` the engine computes K/V for ``slots(id, hit)``.
        """
        s = self._seq(seq_id)
        _group_zero(group)
        if s.host is not None:
            raise ValueError(not_ready(seq_id, s, "read the slots of"))
        n = s.computed
        start = as_int(start, "start")
        stop = n if stop is None else as_int(stop, "stop")
        if not 0 <= start <= stop <= n:
            raise ValueError(f"need 0 <= start <= stop <= {n} (scheduled positions), got {start}, {stop}")
        return slots_of(s, start, stop, self._bs, self._offsets)

    def _seq(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except TypeError:
            raise ValueError(f"sequence ids must be hashable, got {type(seq_id).__name__}") from None

    # ---- admission ---------------------------------------------------------------------------

    def lookup(self, prompt_ids: Sequence[int], cache_salt: Any = None, *, lora_name: str | None = None,
               mm_features: Sequence[tuple] | None = None) -> PrefixHit:
        """How many prompt tokens ``add_sequence`` would serve from the cache now.

        Side-effect free: no LRU order, statistics or events change. A scheduler asks this to
        budget a step before it admits (vLLM's ``get_computed_blocks``). Returns a
        :class:`~pagedkv.types.PrefixHit`: an int, with ``.device`` and ``.host`` telling how
        many of the tokens are on the device and how many a host tier would load. Example
        (block size 16): a 40-token prompt whose first 32 tokens are cached -> 32.
        ``cache_salt``, ``lora_name`` and ``mm_features`` are the request's extra keys, as
        ``add_sequence`` takes them: only blocks published under the same keys hit.
        """
        tokens = _token_array(prompt_ids)
        n = len(tokens)
        if n == 0:
            raise ValueError("the prompt must have at least one token")
        keys = None  # validated whether caching is on or not
        if cache_salt is not None or lora_name is not None or mm_features is not None:
            keys = ExtraKeys.make(self._bs, n, lora_name, mm_features, cache_salt)
        if self._cache is None:
            return PrefixHit(0)
        bs = self._bs
        hashes = self._hash_memo.chained(self._hasher, self._root, keys, _le_bytes(tokens), bs, True)
        device, host = self._hits(hashes, (n - 1) // bs)
        return PrefixHit(len(device) * bs, len(host) * bs, self._pool.count_cached(device))

    def _hits(self, hashes: list, limit: int) -> tuple[list[int], list[int]]:
        """The longest cached prefix: device blocks, then host blocks continuing it."""
        device = self._cache.longest_prefix(hashes, limit)
        if self._tier is None or len(device) == limit:
            return device, []
        return device, self._tier.longest_prefix(hashes[len(device) :], limit - len(device))

    def add_sequence(self, seq_id: Hashable, prompt_ids: Sequence[int], cache_salt: Any = None,
                     prefill: int | None = None, reserve: bool = False, *, lora_name: str | None = None,
                     mm_features: Sequence[tuple] | None = None) -> int:
        """Admit a sequence with its prompt; returns how many prompt tokens the cache served.

        The longest run of cached full blocks from the start is shared (never the whole prompt:
        the last token is always computed). ``prefill=None`` schedules the whole prompt: blocks
        for every position are taken and its full blocks published at once. ``prefill=k``
        schedules only the first ``k`` uncached positions (clipped to the rest; 0 admits with
        the hit blocks alone); ``prefill(id, n)`` schedules the next chunks. A block is published
        once every one of its positions is scheduled.

        ``reserve=True`` (reserve now, publish as computed) takes blocks for every prompt
        position at admission but schedules, and so publishes, only the first ``k``; later
        ``prefill`` calls allocate nothing and cannot raise OutOfBlocks. That is the form of an
        engine that holds a whole prompt's memory from admission (nano-vllm). With
        ``prefill=None`` everything is scheduled anyway, and ``reserve`` changes nothing.

        Example (block size 16, a 40-token prompt whose first 32 tokens are cached): returns 32;
        the table is [hit, hit, new]. With ``prefill=0`` the table is [hit, hit] and
        ``num_computed`` is 32; with ``prefill=0, reserve=True`` too, and ``reserved_table`` is
        [hit, hit, new].

        Keys beyond tokens (vLLM v1's block-hash extra keys), so that equal token ids standing for
        different K/V never share a block: ``lora_name`` (the adapter; in every block's key,
        generated blocks too), ``mm_features`` (``[(mm_hash, offset, length), ...]``: each
        multimodal item's content hash and placeholder span, sorted and disjoint, within the
        prompt; in the key of each block the span touches), ``cache_salt`` (str or bytes; in
        block 0's key, and through the chain in every later one). Example (block size 16): two
        40-token prompts of equal ids with images ``"cat"`` and ``"dog"`` at positions 20..27
        share block 0 and nothing after it.
        """
        if _known(self._seqs, seq_id):
            raise ValueError(f"sequence {seq_id!r} already exists")
        tokens = _token_array(prompt_ids)
        n, bs = len(tokens), self._bs
        if n == 0:
            raise ValueError("the prompt must have at least one token")
        if prefill is not None:
            prefill = _count(prefill, "prefill")
        keys = None  # validated whether caching is on or not
        if cache_salt is not None or lora_name is not None or mm_features is not None:
            keys = ExtraKeys.make(bs, n, lora_name, mm_features, cache_salt)
        if reserve is not False and reserve is not True:
            raise ValueError(f"reserve must be a bool, got {reserve!r}")
        cache = self._cache
        hashes: list = []
        hits: list[int] = []
        loads: list[int] = []  # host blocks continuing the device hits
        if cache is not None:
            hashes = self._hash_memo.chained(self._hasher, self._root, keys, _le_bytes(tokens), bs, False)
            hits, loads = self._hits(hashes, (n - 1) // bs)
        hit = (len(hits) + len(loads)) * bs
        computed = n if prefill is None else hit + min(prefill, n - hit)
        need = -(-(n if reserve else computed) // bs) - len(hits)
        if loads:
            table = hits + self._admit_with_loads(hits, loads, need, seq_id)
        else:
            table = hits + self._cq.fresh(need, "admitting", seq_id, hits)
        s = _Seq(table, tokens, hashes, keys, unscheduled=n - computed, written=len(hits) + len(loads))
        if self._busy is not None and need:  # new positions (hits are whole blocks) or loads
            self._busy.add(s)  # nothing computed yet: no swap_out before the step runs
        if cache is not None:
            self._publish_run(s, len(hits), computed // bs)
            cache.record_query(n, hit)
        if s.unscheduled:
            self._unready += 1
        elif n % bs:
            s.nxt = table[-1] * bs + n % bs  # the last block is fresh: private
        self._seqs[seq_id] = s
        return hit

    def prefill(self, seq_id: Hashable, n: int) -> np.ndarray:
        """Schedule the next ``n`` prompt positions (a chunk); returns their slots (np.int64).

        Takes the blocks the chunk needs (atomic: OutOfBlocks changes nothing; none for a
        prompt admitted with ``reserve=True``, whose blocks are all taken) and publishes each
        block the chunk completes. ``n`` may not exceed the unscheduled rest of the prompt;
        ``n = 0`` returns an empty array.
        """
        s = self._seq(seq_id)
        n = _count(n, "n")
        rest = s.unscheduled
        if n > rest:
            raise ValueError(f"prefill of {n} positions, but {rest} of the prompt are unscheduled")
        if not n:
            return np.empty(0, dtype=np.int64)
        bs = self._bs
        start = len(s.tokens) - rest
        stop = start + n
        need = -(-stop // bs) - len(s.table)  # < 0 when blocks were reserved at admission
        if need > 0:
            s.add_blocks(self._cq.fresh(need, "prefilling", seq_id))
        s.unscheduled = rest - n
        if self._busy is not None:
            self._busy.add(s)
        if self._cache is not None:
            self._publish_run(s, start // bs, stop // bs)
        if not s.unscheduled:
            self._unready -= 1
            if stop % bs:
                s.nxt = s.table[-1] * bs + stop % bs  # fresh for this sequence: private
        return slots_of(s, start, stop, self._bs, self._offsets)

    def _admit_with_loads(self, hits: list[int], loads: list[int], need: int, seq_id: Hashable) -> list[int]:
        """Device blocks for an admission some of whose hits are on the host: ``len(loads)``
        destinations for ``to_device`` transfers (never a block a pending copy still reads),
        then fresh blocks; atomic. Host blocks are pinned first, so that offloads the device
        allocation causes cannot evict them from the host."""
        j = len(loads)
        self._cq.check_room(need - j, j, f"admitting {seq_id!r}", hits)
        self._tier.pin(loads)
        dst, fresh = self._cq.allocate(need - j, j, hits)
        self._tier.load_hits(loads, dst)
        return dst + fresh

    def _publish_run(self, s: _Seq, first: int, stop: int) -> None:
        """Offer the sequence's full blocks ``first..stop`` (chained) to the prefix cache."""
        if stop > first:
            bs = self._bs
            parent = s.hashes[first - 1] if first else self._root
            keys = s.keys
            self._cache.publish(s.table[first:stop], s.hashes[first:stop], parent,
                                s.tokens[first * bs : stop * bs], bs,
                                None if keys is None else keys.block_keys(first, stop))
            if self._write_through:
                self._tier.published(s.table[first:stop], s.hashes[first:stop])

    # ---- appends -----------------------------------------------------------------------------

    def append_token(self, seq_id: Hashable, token_id: int) -> int:
        """Append one token; returns its physical slot (``block * block_size + offset``).

        A full last block gets a fresh block after it; a partial last block shared with another
        sequence is copied first (copy-on-write, queued for ``take_copies``).
        """
        try:
            s = self._seqs[seq_id]
        except TypeError:
            raise ValueError(f"sequence ids must be hashable, got {type(seq_id).__name__}") from None
        if type(token_id) is not int:
            token_id = _as_token(token_id)
        if token_id < 0 or token_id > MAX_TOKEN_ID:
            raise ValueError(f"token id {token_id} outside [0, {MAX_TOKEN_ID}]")
        slot = s.nxt  # _append, inlined: this is the per-token path
        if slot < 0:
            if s.unready:  # never a fast-path slot
                raise ValueError(not_ready(seq_id, s, "append to"))
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

    def append_tokens(self, seq_id: Hashable, token_ids: Sequence[int], speculative: bool = False) -> list[int]:
        """Append several tokens; returns their slots. All or nothing.

        ``speculative=True`` appends draft tokens: they get slots and blocks (and copy-on-write)
        like any token, but no block they fill is published until ``accept`` keeps them. More
        drafts may follow while drafts are pending.
        """
        s = self._seq(seq_id)
        if not isinstance(speculative, (bool, np.bool_)):
            raise ValueError(f"speculative must be a bool, got {speculative!r}")
        toks = _token_array(token_ids)
        if s.unscheduled or (s.drafts and not speculative) or s.host is not None:
            raise ValueError(not_ready(seq_id, s, "append to"))
        if not toks:
            return []
        bs, n, k = self._bs, len(s.tokens), len(toks)
        slot = s.nxt
        if slot >= 0 and slot % bs + k <= bs:  # all in the private last block: nothing to take
            if self._busy is not None:
                self._busy.add(s)
            if speculative:
                if not s.drafts:
                    self._unready += 1
                s.drafts += k
                s.tokens.extend(toks)
                s.nxt = -1  # drafts pending: the next append goes through the checks
                return list(range(slot, slot + k))
            return [self._append(s, t) for t in toks]
        fresh = -(-(n + k) // bs) - -(-n // bs)
        copies = 1 if n % bs and self._pool.refcount(s.table[-1]) > 1 else 0
        if fresh + copies:
            self._cq.check_room(fresh, copies, f"appending to {seq_id!r}")
        if self._busy is not None:
            self._busy.add(s)
        if speculative:
            if not s.drafts:
                self._unready += 1
            s.drafts += k
            out = [self._append(s, t, publish=False) for t in toks]
            s.nxt = -1  # drafts pending: the next append goes through the checks
            return out
        return [self._append(s, t) for t in toks]

    def accept(self, seq_id: Hashable, k: int) -> None:
        """Settle the pending drafts: keep the first ``k`` as ordinary tokens, drop the rest.

        Blocks the kept drafts complete are published now. Blocks that held only dropped drafts
        return to the free list clean, tail first. Example (block size 4, 6 tokens + 5 drafts in
        blocks [a, b, c]): ``accept(id, 1)`` keeps 7 tokens in [a, b]; c goes back clean.
        """
        s = self._seq(seq_id)
        k = _count(k, "k")
        d = s.drafts
        if k > d:
            raise ValueError(f"accept({k}) but {d} drafts are pending")
        if not d:
            return
        bs = self._bs
        n = len(s.tokens) - (d - k)
        del s.tokens[n:]
        keep = -(-n // bs)
        dropped = s.table[keep:]
        if dropped:
            del s.table[keep:]
            self._pool.release_all(dropped[::-1])  # drafts are never published: they go clean
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
        if n % bs and self._pool.refcount(s.table[-1]) == 1:
            s.nxt = s.table[-1] * bs + n % bs

    def append_batch(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int]) -> np.ndarray:
        """One decode step: append ``token_ids[i]`` to ``seq_ids[i]`` for every i, atomically.

        ``seq_ids`` is a sequence (list, tuple, 1-D array), never a set or a dict: the pairing
        with ``token_ids`` is by position. Returns the step's slot mapping as
        ``np.int64[len(seq_ids)]``. Either every sequence got its token or an error was raised
        and none did.
        """
        seq_ids, toks, vals = _batch_arguments(seq_ids, token_ids)
        n = len(toks)
        if n < 2:
            if not n:
                return np.empty(0, dtype=np.int64)
            return np.array([self.append_token(seq_ids[0], toks[0])], dtype=np.int64)
        ss = _batch_seqs(self._seqs, seq_ids)
        if self._unready:
            for sid, s in zip(seq_ids, ss):
                if s.unready:
                    raise ValueError(not_ready(sid, s, "append to"))
        if self._pool.num_free < n or self._cq.sources:  # only then can the batch fail: count
            fresh, copies = blocks_for_step(ss, self._bs, self._pool.refcount)
            self._cq.check_room(fresh, copies, "a decode step")
        if self._busy is not None:
            self._busy.update(ss)
        bs = self._bs
        slow = self._slot_slow
        out = []
        push = out.append
        filled = []
        for s, t in zip(ss, vals):
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

    def _append(self, s: _Seq, token_id: int, publish: bool = True) -> int:
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
            if publish and self._cache is not None:
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
            if self._pool.refcount(b) > 1:
                b = self._copy_on_write(s, b)
        else:
            b = self._cq.fresh_one()
            s.add_block(b)
        return b * bs + off

    def _copy_on_write(self, s: _Seq, old: int) -> int:
        """Give ``s`` a private copy of its shared partial last block; returns the new block.

        The pending list stays batch-safe: a destination is never a block a pending copy reads
        (``allocate_one_avoiding``), and copying a block that is itself a pending destination
        copies from that copy's source instead (the same bytes, as running them in order).
        """
        new = self._cq.destination()  # raises OutOfBlocks before anything changed
        self._pool.release(old)  # still >= 1: another table holds it
        s.set_last(new)
        self._cq.add(old, new)
        self._cow_copies += 1
        return new

    def _publish_filled(self, filled: Sequence[_Seq]) -> None:
        """Each sequence's last block just filled: hash it (chained), offer it to the cache.

        One call per decode step, not per block. A sequence with extra keys (a LoRA adapter)
        hashes its block's key with its tokens, and the cache is given every block's key.
        """
        bs = self._bs
        blocks, hashes, parents, tokens, keys = filled_columns(filled, bs, self._digest, self._root)
        self._cache.publish_blocks(blocks, hashes, parents, tokens, bs, keys)
        if self._write_through:
            self._tier.published(blocks, hashes)

    def take_copies(self) -> list[CopyOp]:
        """Drain the copies queued by copy-on-write; run them before writing this step's KV.

        The list is safe for one batched kernel: no block is a destination twice, and no
        destination is the source of another copy in the list.
        """
        return self._cq.take()

    def take_transfers(self) -> list[Transfer]:
        """Drain the block transfers between the device and the host tier (offloads, prefix hits
        loaded from the host, swaps); run them before this step's copies and K/V writes, every
        ``to_host`` entry before every ``to_device`` entry (each direction is one batch).
        Always empty without a host tier. It also marks the step boundary for ``swap_out``:
        the K/V of everything scheduled before it is written after it."""
        if self._tier is None:
            return []
        self._busy.clear()  # the step's K/V is written after this drain: see swap_out
        return self._tier.take_transfers(self._cache)

    def swap_out(self, seq_id: Hashable) -> None:
        """Preempt a sequence by moving its private blocks to the host tier.

        Its blocks held by no other sequence get host blocks and ``to_host`` transfers, and the
        device blocks are released (a block with a hash stays revivable on the device, and is
        published on the host too). Blocks shared with other sequences stay on the device, and
        the sequence keeps its reference to them. Atomic: OutOfBlocks (the host has too few
        free blocks) changes nothing. Until ``swap_in``, the sequence cannot be appended to,
        forked or exported.

        Its K/V must all exist, as for ``fork``: the ``to_host`` transfers run before the step's
        writes. So a sequence given positions or blocks since the last ``take_transfers()`` (the
        step's first drain: admitted, prefilled, appended to, copied on write, loaded from the
        host, or forked from one that was) is refused with ValueError. Example (block size 4):
        ``add_sequence("s", 9 tokens)`` then ``swap_out("s")`` is refused (3 blocks, nothing
        computed); after ``take_transfers()`` and the step's writes it moves 3 blocks. Swap out
        a victim before scheduling it in the step, or after the step.
        """
        s = self._seq(seq_id)
        if self._tier is None:
            raise ValueError("swap_out needs a host tier (KVCacheManager(..., host_blocks=N))")
        if s.host is not None:
            raise ValueError(f"sequence {seq_id!r} is already swapped out")
        if s.unscheduled or s.drafts:
            raise ValueError(not_ready(seq_id, s, "swap out"))
        tier, table = self._tier, s.table
        if s in self._busy or tier.pending_on(table) or any(map(self._cq.is_destination, table)):
            raise ValueError(f"cannot swap out {seq_id!r}: it was given positions or blocks in this step "
                             f"(or a copy or transfer of its blocks is pending), whose K/V is written only "
                             f"after take_transfers(); swap it out before scheduling it, or after the step")
        private, released, hashes = s.private_blocks(self._pool.refcount, self._cache is not None)
        s.swapped_out(private, tier.swap_out(released, hashes, f"swapping out {seq_id!r}"))
        self._unready += 1
        self._swapped += 1
        if self._cache is not None and self._cache.has_twins:
            self._cache.forget_twins(released)  # (all private: their last reference goes)
        self._pool.release_all(released[::-1])

    def swap_in(self, seq_id: Hashable) -> None:
        """Bring a swapped-out sequence back: device blocks for its host blocks, with
        ``to_device`` transfers (a block whose hash is still cached on the device is revived
        instead, with no transfer). Atomic: OutOfBlocks changes nothing."""
        s = self._seq(seq_id)
        if s.host is None:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        pool, cache, bs = self._pool, self._cache, self._bs
        nfull = s.computed // bs
        revive, loads = self._tier.plan_swap_in(s.host, s.hashes, nfull)
        revived = list(revive.values())
        self._cq.check_room(0, len(loads), f"swapping in {seq_id!r}", revived)
        new = self._cq.allocate(0, len(loads), revived)[0]
        loaded, revived_host = s.swapped_in(revive, loads, new)
        self._tier.swap_in(loaded, new, revived_host)
        self._unready -= 1
        self._swapped -= 1
        if cache is not None:  # loaded full blocks are findable again, once their K/V is back
            for i in loads:  # (a hash mapped meanwhile makes the block its twin)
                if i < nfull:
                    self._publish_run(s, i, i + 1)
        n = s.computed
        if n % bs and pool.refcount(s.table[-1]) == 1:
            s.nxt = s.table[-1] * bs + n % bs

    # ---- fork and free -----------------------------------------------------------------------

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares every block of the parent: O(blocks), no allocation, no copy.

        Fork between steps, after the step's K/V writes: a token whose K/V is not written yet
        would be shared unwritten.
        """
        p = self._seq(parent_id)
        if _known(self._seqs, child_id):
            raise ValueError(f"sequence {child_id!r} already exists")
        if p.unscheduled or p.drafts or p.host is not None:  # p.unready, inline: a call less per fork
            raise ValueError(not_ready(parent_id, p, "fork"))
        self._pool.incref_all(p.table)
        p.nxt = -1  # the partial last block, if any, is shared now: the next write decides
        mirror = None if p.mirror is None else p.mirror.copy()
        # the parent's step wrote every block it shares: the child's full ones count as written
        child = self._seqs[child_id] = _Seq(p.table.copy(), p.tokens[:], p.hashes.copy(), p.keys, mirror,
                                            written=p.computed // self._bs)
        if self._busy and p in self._busy:  # forked before the step ran (against the rule)
            self._busy.add(child)
        self._forks += 1

    def free(self, seq_id: Hashable, *, cache: bool = True) -> None:
        """Release every block of the sequence, tail first (so its prefix is evicted last).

        ``cache=False`` is for a sequence whose K/V was never (fully) written, such as a request
        dropped after it was scheduled but before its step ran (vLLM's abort). The blocks it was
        scheduled to compute itself lose their hashes and return clean, so no later prompt can
        hit content that was never computed: every block after its **written prefix**, which is
        its prefix hits at admission (device hits and host hits: an earlier request computed
        them) or, for a fork, the full blocks it shared with its parent at the fork (the
        parent's step wrote them). The written prefix keeps its hashes, as do blocks another
        sequence still holds. Example (block size 4): a 17-token prompt whose first 8 tokens
        hit, dropped unrun -> blocks 0 and 1 stay findable (revivable), blocks 2 and 3 are
        unpublished, block 4 (partial) was never published. Either way, a block it alone holds
        whose host-tier load is still pending (a host hit or a ``swap_in`` of this step) loses
        its load and its device hash: its K/V never arrives, and the host copy stays findable
        on the host.
        """
        if not isinstance(cache, bool):
            raise ValueError(f"cache must be a bool, got {cache!r}")
        s = self._seq(seq_id)
        del self._seqs[seq_id]
        if self._busy:
            self._busy.discard(s)
        if s.unscheduled or s.drafts or s.host is not None:  # s.unready, inline: a call less per free
            self._unready -= 1
        table = s.table
        if s.host is not None:  # swapped out: its host blocks go, its shared device blocks stay
            self._swapped -= 1
            self._tier.release([s.host[i] for i in sorted(s.host)])
            table = [b for b in table if b >= 0]
        refcount = self._pool.refcount
        if self._cq.sources:
            self._cq.drop_into([b for b in table if refcount(b) == 1])
        tier = self._tier
        unloaded = tier.drop_released_loads(table, refcount) if tier is not None else []
        prefix = self._cache
        if prefix is not None and prefix.has_twins:  # a twin going back clean is no twin
            prefix.forget_twins([b for b in prefix.twins_among(table) if refcount(b) == 1])
        if prefix is not None and (unloaded or not cache):
            # a dropped load never fills its block: like unwritten K/V, it must not stay findable
            mine = unloaded
            if not cache:  # and the blocks after the written prefix, which it computed itself
                mine = mine + [b for b in s.table[s.written :]
                               if b >= 0 and refcount(b) == 1 and b not in unloaded]
            self._unpublish(mine)
            if self._write_through:
                tier.forget_published(mine)
        self._pool.release_all(table[::-1])

    def _unpublish(self, blocks: list[int]) -> None:
        """Forget device blocks' hashes (their K/V will never be written); with a host tier,
        host blocks chained from a hash that is now on neither tier go with it."""
        tier = self._tier
        gone = [k for k in map(self._pool.key, blocks) if k is not None] if tier is not None else ()
        self._cache.unpublish(blocks)
        if gone:
            tier.drop_orphans(gone)

    # ---- prefix cache ------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash, the host tier's too; refused (False, nothing changed) while
        any block is in use on either tier or a transfer is pending (so while any sequence is
        live, swapped out or not)."""
        tier = self._tier
        if self._pool.num_used or (tier is not None and (tier.num_used or tier.has_pending())):
            return False
        if self._cache is not None:
            self._cache.clear()
            if tier is not None:
                tier.reset()
            if self._log.enabled:
                self._log.cleared()
        return True

    def take_events(self) -> list:
        """Drain the KV cache events (BlockStored / BlockRemoved / AllBlocksCleared)."""
        return self._log.take()

    # ---- exports for kernels -----------------------------------------------------------------

    def block_tables(self, seq_ids: Sequence[Hashable], pad: int = -1, group: int = 0) -> np.ndarray:
        """Block tables as one padded ``np.int32[len(seq_ids), max_blocks]`` array (vLLM's form).

        Rows are copied from each sequence's int32 mirror, so the cost is one slice copy per
        sequence, not one Python int per block.
        """
        ss = on_device(self._seqs, seq_ids, self._swapped)
        _group_zero(group)
        pad = as_int(pad, "pad")
        if not -(2**31) <= pad < 2**31:
            raise ValueError(f"pad must fit in int32, got {pad}")
        return block_tables(ss, pad, self._bs, bool(self._unready))

    def flashinfer_layout(self, seq_ids: Sequence[Hashable], group: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """FlashInfer's paged layout: ``(indptr, indices, last_page_len)``, all ``np.int32``.

        Describes scheduled positions. Example (page size 4, lengths 10, 4, 5; tables [0,1,2],
        [3], [4,5]): indptr [0, 3, 4, 6], indices [0, 1, 2, 3, 4, 5], last_page_len [2, 4, 1].
        A sequence with nothing scheduled has no pages and a last_page_len of 0.
        """
        ss = on_device(self._seqs, seq_ids, self._swapped)
        _group_zero(group)
        return flashinfer_layout(ss, self._bs, bool(self._unready))

    # ---- accounting --------------------------------------------------------------------------

    def usage(self, group: int | None = None) -> Usage:
        """What the cache holds now, over scheduled positions (see :class:`~pagedkv.types.Usage`);
        ``group`` None or 0 (the one group) gives the same figures."""
        if group is not None:
            _group_zero(group)
        bs, pool, cache, tier = self._bs, self._pool, self._cache, self._tier
        used = pool.num_used
        logical, stored, logical_blocks = logical_usage(self._seqs.values(), bs, used)
        allocated = used * bs
        return Usage(
            block_size=bs,
            num_sequences=len(self._seqs),
            logical_tokens=logical,
            stored_tokens=stored,
            allocated_slots=allocated,
            internal_fragmentation=1 - stored / allocated if allocated else 0.0,
            blocks_saved_by_sharing=logical_blocks - used,
            cow_copies=self._cow_copies,
            forks=self._forks,
            **pool.usage_fields(),
            **(cache.usage_fields() if cache is not None else dict(prefix_query_tokens=0, prefix_hit_tokens=0)),
            **(dict(tier.usage_fields(), swapped_sequences=self._swapped) if tier is not None else {}),
        )

    def check_invariants(self) -> None:
        """Raise AssertionError unless the pool, the tables and the cache agree.

        Each part checks its own structure, in this order: the pool (free + cached-free + used
        = total, the hash <-> block bijection); the tables against the pool and the manager's
        counters (:func:`~pagedkv.sequences.check_tables`: refcounts, table lengths, reserved
        tails, partial blocks, the fast-path slots); the host tier (its refcounts against the
        swapped-out sequences and pending transfers, its kept content rehashed); the pending
        copies (batch-safe); the prefix cache (twins, kept content rehashed); and every
        sequence's hashes against its tokens and the pool's keys
        (:func:`~pagedkv.sequences.check_hashes`).
        """
        pool, cache, tier, hasher = self._pool, self._cache, self._tier, self._hasher
        pool.check_invariants()
        host_refs = check_tables(self._seqs, pool, self._bs, self._unready, self._swapped, self._busy)
        if tier is not None:
            tier.check_invariants(host_refs, hasher.rehash)
        else:
            _require(not self._swapped, "a sequence is swapped out without a host tier")
        self._cq.check_invariants()
        if cache is not None:
            cache.check_invariants(hasher.rehash)
        check_hashes(self._seqs, pool.keyed_blocks(), cache.twins() if cache is not None else None, hasher,
                     self._root, self._bs)


# inspect.signature(KVCacheManager) reads __new__ first, whose (*args, groups, **kwargs) only
# dispatches: the constructor's parameters are __init__'s.
KVCacheManager.__signature__ = inspect.signature(KVCacheManager.__init__).replace(
    parameters=list(inspect.signature(KVCacheManager.__init__).parameters.values())[1:])


def _one_full(specs: tuple) -> bool:
    """Whether validated ``groups`` are exactly ``[FullAttention()]``: the plain manager."""
    return len(specs) == 1 and type(specs[0]) is FullAttention


def _group_zero(group: Any) -> None:
    """A plain manager's ``group`` argument: 0, its one group; ValueError otherwise."""
    if as_int(group, "group") != 0:
        raise ValueError(f"group must be 0 (this manager has one group), got {group!r}")
