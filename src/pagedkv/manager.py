"""KVCacheManager: the facade of the allocator, for every configuration of attention groups.

The facade validates every argument, keeps the dict of live sequences and the counters, and runs
the per-token hot loops (append, decode step); everything that depends on the model's attention
groups is one call into the coordinator chosen at construction (vLLM v1's shape):

* :class:`~pagedkv.coordinator.UnitaryCoordinator` for one full-attention group (the plain
  model): no loop over groups, keys are bare hashes;
* :class:`~pagedkv.hybrid_coordinator.HybridCoordinator` for anything else: the one loop over
  groups, asking each group's spec (:mod:`pagedkv.kv_specs`) its type's rules.

Both drive the same parts (pool, prefix cache, copy queue, host tier, hash memo), each the owner of
one structure. Nothing imports this module but the package.

The life of a decode step, with block size 16::

    m = KVCacheManager(num_blocks=4096, block_size=16)
    m.add_sequence("r1", prompt)          # 40 tokens -> table [0, 1, 2]; blocks 0, 1 published
    m.fork("r1", "r1.1")                  # child shares [0, 1, 2]; refcounts 2, 2, 2
    m.append_token("r1.1", 7)             # block 2 is partial and shared -> copy-on-write:
    m.take_copies()                       #   [CopyOp(src=2, dst=3)]; child table [0, 1, 3]
    m.append_token("r1", 9)               # parent is block 2's last holder: writes in place

Every public call validates before it changes anything and checks capacity before it allocates,
so a failure leaves the manager exactly as it was.
"""
from __future__ import annotations

from typing import Any, Hashable, Sequence

import numpy as np

from .arguments import (as_token, batch_arguments, batch_seqs, count_within, known, le_bytes,
                        manager_args, token_array)
from .checks import as_int, flag, int_at_least
from .coordinator import UnitaryCoordinator
from .copy_queue import CopyQueue
from .exports import flashinfer_rows, padded_tables, slots_of
from .hashing import MAX_TOKEN_ID, BlockHasher, ExtraKeys, HashMemo
from .hybrid_coordinator import HybridCoordinator
from .invariants import check_sequences
from .kv_specs import FullAttention, check_groups
from .pool import BlockPool
from .sequence import Seq
from .types import CopyOp, PrefixHit, Transfer, Usage

__all__ = ["KVCacheManager"]

# Prompts whose block hashes a lookup computed (the waiting queue a scheduler keeps asking
# about): at most 256 prompts and 65,536 block hashes in all (about 5 MiB), whichever binds
# first, so that a few 100,000-token prompts cannot make the memo hold hundreds of MiB.
HASH_MEMO_ENTRIES = 256
HASH_MEMO_BLOCKS = 1 << 16


class KVCacheManager:
    """The block allocator of a paged KV cache (see the module docstring and docs/design.md).

    Args:
        num_blocks: physical blocks in the KV store (at most 2**31 - 1: block ids are int32).
        block_size: token slots per block (16 is the field's default).
        enable_prefix_caching: share full blocks by content hash and keep freed ones revivable.
        hash_algo: ``"sha256"`` (default, stable across processes), ``"xxh3"`` (fast, stable,
            needs xxhash), ``"builtin"`` (fastest, keyed per process).
        enable_events: record KV cache events for ``take_events()`` (turn off if nothing
            drains them, or they accumulate).
        host_blocks: blocks of a host-memory tier (0: none): it keeps what the device evicts,
            serves prefix hits and holds swapped-out sequences.
        host_write_policy: when a device block is copied to the host: ``"write-back"`` (when
            the device evicts it), ``"write-through"`` (once computed, and again at eviction if
            the host dropped it since) or ``"none"`` (only swaps use the host).
        groups: the attention groups of a hybrid model, one block table per group over the one
            pool (``FullAttention()``, ``SlidingWindow(window=W)``,
            ``ChunkedLocalAttention(chunk=C)``); None is ``[FullAttention()]``.
        window_eviction: how a finished sequence's released window blocks age in the LRU:
            ``"with_prefix"`` (re-aged with the rest of its prefix) or ``"on_release"``.

    An engine admits (``add_sequence``, ``prefill``), decodes (``append_batch``), runs
    ``take_transfers()`` then ``take_copies()`` before each step's K/V writes, and speculates
    (``append_tokens(..., speculative=True)``, ``accept``). **Fork between steps**, after the
    step's K/V writes (a token without K/V would be shared unwritten); swap out likewise. Free
    with ``free(id)``, or ``free(id, cache=False)`` for a sequence dropped before its step ran.
    Every allocating call raises ``OutOfBlocks(needed, available)`` and changes nothing when it
    does not fit; every other bad call raises ``KeyError`` or ``ValueError``, worded the same in
    every configuration. A manager is not thread-safe (one engine thread calls it); it pickles
    to an equal state (``builtin`` hashes: within the process that computed them only).
    """

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
        window_eviction: str = "with_prefix",
    ) -> None:
        num_blocks, block_size, host_blocks = manager_args(
            num_blocks, block_size, enable_prefix_caching, enable_events, host_blocks, host_write_policy,
            window_eviction)
        specs = (FullAttention(),) if groups is None else check_groups(groups)
        self._hasher = BlockHasher(hash_algo)
        self._root = self._hasher.root()  # every prompt's first block is chained from it
        # The parts pass the pool only blocks it handed out, so batch calls skip re-checking
        # ids; the tables' consistency is what check_invariants() proves.
        self._pool = BlockPool(num_blocks, check_args=False)
        self._cq = CopyQueue(self._pool)
        self._bs = block_size
        self._specs = specs
        unitary = len(specs) == 1 and specs[0].reads_whole_prefix
        coordinator = UnitaryCoordinator if unitary else HybridCoordinator
        self._coord = coordinator(self._pool, self._cq, self._hasher, self._root, block_size, specs,
                                  enable_prefix_caching, enable_events, host_blocks, host_write_policy,
                                  window_eviction)
        self._cache = self._coord.cache
        self._tier = self._coord.tier
        # With a host tier: the sequences given positions or blocks since the last
        # take_transfers() (the step's first drain). Their K/V is written only after that
        # drain, so swap_out refuses them. None without a tier: the hot paths pay one test, and
        # the per-token append_token none (a tiered manager's instance uses a marking wrapper).
        self._busy: set | None = set() if host_blocks else None
        # Slot offsets within a block, for turning a run of blocks into slots in one broadcast;
        # not kept for absurd block sizes (a 2**31-slot block would make it 16 GiB).
        self._offsets = np.arange(block_size, dtype=np.int64) if block_size <= 1 << 16 else None
        self._seqs: dict[Hashable, Seq] = {}
        self._unready = 0  # sequences mid-prefill, holding drafts or swapped out
        self._swapped = 0
        self._forks = 0
        # Prompts' hashes computed by lookup, for the admission of the same prompt.
        self._hash_memo = HashMemo(HASH_MEMO_ENTRIES, HASH_MEMO_BLOCKS)
        self._bind()

    def _bind(self) -> None:
        """The coordinator's per-token entry points, bound once (not pickled)."""
        coord = self._coord
        self._slot_slow = coord.slot_slow
        self._publish_filled = coord.publish_filled
        self._arm = coord.arm
        self._releases = coord.releases
        if self._busy is not None:
            self.append_token = self._append_token_marking

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for bound in ("_slot_slow", "_publish_filled", "_arm", "append_token"):
            state.pop(bound, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._bind()

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
        """Attention groups (block tables per sequence)."""
        return len(self._specs)

    @property
    def groups(self) -> tuple:
        """The attention specs, one per group, in group order."""
        return self._specs

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
        """Entries of the sequence, over all groups, that live on the host (0 unless it is
        swapped out): at most what ``swap_in`` takes from the device."""
        s = self._seq(seq_id)
        return sum(map(len, s.host)) if s.host is not None else 0

    @property
    def num_sequences(self) -> int:
        """Live sequences (admitted and not freed)."""
        return len(self._seqs)

    def __contains__(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` is a live sequence; an unhashable id answers False."""
        try:
            return seq_id in self._seqs
        except TypeError:
            return False

    def seq_ids(self) -> list:
        """The live sequence ids, in admission order."""
        return list(self._seqs)

    def _seq(self, seq_id: Hashable) -> Seq:
        try:
            return self._seqs[seq_id]
        except TypeError:
            raise ValueError(f"sequence ids must be hashable, got {type(seq_id).__name__}") from None

    def _group(self, group: Any) -> int:
        g = as_int(group, "group")
        if not 0 <= g < len(self._specs):
            raise ValueError(f"group must be an int in [0, {len(self._specs)}), got {g}")
        return g

    def block_table(self, seq_id: Hashable, group: int = 0) -> list[int]:
        """Physical block ids of the sequence's scheduled positions in group ``group``, logical
        order (a copy); -1 where a block left the group's window and was released, or a hit did
        not need it."""
        s = self._seq(seq_id)
        table = s.tables[self._group(group)]
        if s.unscheduled:  # admitted with reserve=True: the reserved tail is not scheduled
            return table[: -(-s.computed // self._bs)]
        return list(table)

    def reserved_table(self, seq_id: Hashable, group: int = 0) -> list[int]:
        """Every block the sequence holds in the group, logical order: ``block_table(id)`` plus,
        for a prompt admitted with ``reserve=True`` and not fully scheduled yet, the blocks
        reserved for its unscheduled positions. Example (block size 16, a 40-token prompt
        admitted with ``prefill=0, reserve=True``, nothing cached): ``block_table`` is [], this
        is [0, 1, 2]."""
        s = self._seq(seq_id)
        return list(s.tables[self._group(group)])

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
        """Physical slots (``np.int64``) of positions ``start..stop`` in group ``group``, where
        a prefill writes. ``stop`` defaults to ``num_computed(id)``: after ``hit =
        add_sequence(...)`` the engine computes K/V for ``slots(id, hit)``. A position whose
        block the group released raises ``ValueError``: its K/V is gone from that group."""
        s = self._seq(seq_id)
        g = self._group(group)
        if s.host is not None:
            raise ValueError(s.why_not_ready(seq_id, "read the slots of"))
        n = s.computed
        start = as_int(start, "start")
        stop = n if stop is None else as_int(stop, "stop")
        if not 0 <= start <= stop <= n:
            raise ValueError(f"need 0 <= start <= stop <= {n} (scheduled positions), got {start}, {stop}")
        self._coord.check_live(s, g, start, stop, seq_id)
        return slots_of(s.tables[g], start, stop, self._bs, self._offsets)

    # ---- admission ---------------------------------------------------------------------------

    def _extra_keys(self, n: int, cache_salt: Any, lora_name: Any, mm_features: Any) -> ExtraKeys | None:
        """The request's keys beyond its tokens, validated whether caching is on or not."""
        if cache_salt is None and lora_name is None and mm_features is None:
            return None
        return ExtraKeys.make(self._bs, n, lora_name, mm_features, cache_salt)

    def lookup(self, prompt_ids: Sequence[int], cache_salt: Any = None, *, lora_name: str | None = None,
               mm_features: Sequence[tuple] | None = None) -> PrefixHit:
        """How many prompt tokens ``add_sequence`` would serve from the cache now, changing
        nothing (no LRU order, statistics or events). A :class:`~pagedkv.types.PrefixHit`: an
        int, with ``.device``, ``.host`` (tokens a host tier would load) and ``.revived`` (device
        hit blocks now cached-free). Example (block size 16): a 40-token prompt whose first 32
        tokens are cached -> 32. Extra keys as ``add_sequence`` takes them."""
        tokens = token_array(prompt_ids)
        n = len(tokens)
        if n == 0:
            raise ValueError("the prompt must have at least one token")
        keys = self._extra_keys(n, cache_salt, lora_name, mm_features)
        if self._cache is None:
            return PrefixHit(0)
        hashes = self._hash_memo.chained(self._hasher, self._root, keys, le_bytes(tokens), self._bs, True)
        return self._coord.lookup(hashes, (n - 1) // self._bs)

    def add_sequence(self, seq_id: Hashable, prompt_ids: Sequence[int], cache_salt: Any = None,
                     prefill: int | None = None, reserve: bool = False, *, lora_name: str | None = None,
                     mm_features: Sequence[tuple] | None = None) -> int:
        """Admit a sequence with its prompt; returns how many prompt tokens the cache served.

        The longest prefix hit valid for every group is shared (never the whole prompt: the
        last token is always computed). ``prefill=None`` schedules the whole prompt;
        ``prefill=k`` only the first ``k`` uncached positions (0: the hit blocks alone), and
        ``prefill(id, n)`` the next chunks. ``reserve=True`` takes blocks for every prompt
        position now but publishes only what is scheduled (nano-vllm's form); groups that
        release refuse it (a window would hold, from admission, blocks it releases unread).
        Keys beyond tokens, so that equal ids standing for other K/V never share: ``lora_name``
        (every block), ``mm_features`` (``[(mm_hash, offset, length), ...]``: the blocks each
        span touches), ``cache_salt`` (block 0, and through the chain every later one).
        Example (block size 16, a 40-token prompt whose first 32 tokens are cached): returns 32,
        the table is [hit, hit, new]."""
        if known(self._seqs, seq_id):
            raise ValueError(f"sequence {seq_id!r} already exists")
        tokens = token_array(prompt_ids)
        n = len(tokens)
        if n == 0:
            raise ValueError("the prompt must have at least one token")
        if prefill is not None:
            prefill = int_at_least("prefill", prefill, 0)
        keys = None
        if cache_salt is not None or lora_name is not None or mm_features is not None:
            keys = ExtraKeys.make(self._bs, n, lora_name, mm_features, cache_salt)
        if reserve is not False and reserve is not True:
            flag("reserve", reserve)
        hashes: list = []
        if self._cache is not None:
            hashes = self._hash_memo.chained(self._hasher, self._root, keys, le_bytes(tokens), self._bs, False)
        s, hit, took = self._coord.admit(seq_id, tokens, hashes, keys, prefill, reserve)
        if self._busy is not None and took:  # new positions or loads: nothing written yet
            self._busy.add(s)
        if s.unscheduled:
            self._unready += 1
        self._seqs[seq_id] = s
        return hit

    def prefill(self, seq_id: Hashable, n: int) -> np.ndarray:
        """Schedule the next ``n`` prompt positions (a chunk); returns their slots (np.int64,
        group 0's). Releases due are made first (they may serve the chunk); atomic; ``n`` may
        not exceed the unscheduled rest; ``n = 0`` returns an empty array."""
        s = self._seq(seq_id)
        rest = s.unscheduled
        n = count_within("n", n, rest, "prefill of {v} positions, but {limit} of the prompt are unscheduled")
        if not n:
            return np.empty(0, dtype=np.int64)
        start = len(s.tokens) - rest
        stop = start + n
        self._coord.prefill(s, start, stop, seq_id)
        s.unscheduled = rest - n
        if self._busy is not None:
            self._busy.add(s)
        if self._cache is not None:
            self._coord.publish_run(s, start // self._bs, stop // self._bs)
        if not s.unscheduled:
            self._unready -= 1
            self._coord.arm(s)
        return slots_of(s.table, start, stop, self._bs, self._offsets)

    # ---- appends -----------------------------------------------------------------------------

    def append_token(self, seq_id: Hashable, token_id: int) -> int:
        """Append one token; returns its physical slot in group 0 (``block * block_size +
        offset``). Releases what the windows let go first; a full last block gets a fresh block
        in every group; a shared partial one is copied first (copy-on-write, queued for
        ``take_copies``)."""
        try:
            s = self._seqs[seq_id]
        except TypeError:
            raise ValueError(f"sequence ids must be hashable, got {type(seq_id).__name__}") from None
        if type(token_id) is not int:
            token_id = as_token(token_id)
        if token_id < 0 or token_id > MAX_TOKEN_ID:
            raise ValueError(f"token id {token_id} outside [0, {MAX_TOKEN_ID}]")
        slot = s.nxt
        if slot < 0:
            if s.unscheduled or s.drafts or s.host is not None:
                raise ValueError(s.why_not_ready(seq_id, "append to"))
            self._coord.step_room((s,), f"appending to {seq_id!r}")
            slot = self._slot_slow(s)
        s.tokens.append(token_id)
        nxt = slot + 1
        if nxt != s.end:
            s.nxt = nxt
        else:
            s.nxt = -1
            if not nxt % self._bs and self._cache is not None:
                self._publish_filled((s,))
        return slot

    def append_tokens(self, seq_id: Hashable, token_ids: Sequence[int], speculative: bool = False) -> list[int]:
        """Append several tokens; returns their slots (group 0's). All or nothing.

        ``speculative=True`` appends draft tokens: they get slots and blocks (and copy-on-write)
        like any token, but no block they fill is published until ``accept`` keeps them. More
        drafts may follow while drafts are pending.
        """
        s = self._seq(seq_id)
        if not isinstance(speculative, (bool, np.bool_)):
            raise ValueError(f"speculative must be True or False, got {speculative!r}")
        toks = token_array(token_ids)
        if s.unscheduled or (s.drafts and not speculative) or s.host is not None:
            raise ValueError(s.why_not_ready(seq_id, "append to"))
        if speculative and self._releases:
            self._coord.draft_check()
        k = len(toks)
        if not k:
            return []
        slot = s.nxt
        room = slot >= 0 and slot + k <= s.end  # all in the private last block: nothing to take
        if not room:
            self._coord.tokens_room(s, k, f"appending to {seq_id!r}")
        if self._busy is not None:
            self._busy.add(s)
        if speculative:
            if not s.drafts:
                self._unready += 1
            s.drafts += k
            if room:
                s.tokens.extend(toks)
                s.nxt = -1  # drafts pending: the next append goes through the checks
                return list(range(slot, slot + k))
        grow, bs = self._coord.grow, self._bs
        publish = self._cache is not None and not speculative
        out = []
        for t in toks:
            slot = s.nxt
            if slot < 0:
                slot = grow(s)
            s.tokens.append(t)
            out.append(slot)
            slot += 1
            if slot != s.end:
                s.nxt = slot
            else:
                s.nxt = -1
                if publish and not slot % bs:
                    self._publish_filled((s,))
        if speculative:
            s.nxt = -1  # drafts pending: the next append goes through the checks
        else:
            self._arm(s)
        return out

    def accept(self, seq_id: Hashable, k: int) -> None:
        """Keep the first ``k`` pending drafts as ordinary tokens (publishing the blocks they
        complete) and drop the rest: blocks that held only dropped drafts go back clean, tail
        first. Example (block size 4, 6 tokens + 5 drafts in [a, b, c]): ``accept(id, 1)``
        keeps 7 tokens in [a, b]; c goes back clean."""
        s = self._seq(seq_id)
        d = s.drafts
        k = count_within("k", k, d, "accept({v}) but {limit} drafts are pending")
        if not d:
            return
        bs = self._bs
        n = len(s.tokens) - (d - k)
        del s.tokens[n:]
        keep = -(-n // bs)
        if len(s.table) > keep:  # blocks that held only dropped drafts
            self._coord.drop_tail(s, keep)
        s.drafts = 0
        self._unready -= 1
        if self._cache is not None:
            first = len(s.hashes)
            nfull = n // bs
            if nfull > first:
                parent = s.hashes[-1] if first else self._root
                data = le_bytes(s.tokens[first * bs : nfull * bs])
                s.hashes += self._hasher.chain_keyed(parent, data, 4 * bs, first, nfull - first, s.keys)
                self._coord.publish_run(s, first, nfull)
        self._arm(s)

    def append_batch(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int]) -> np.ndarray:
        """One decode step: append ``token_ids[i]`` to ``seq_ids[i]`` for every i, atomically;
        returns group 0's slots as ``np.int64[len(seq_ids)]``. ``seq_ids`` is a sequence (never
        a set or a dict: pairing is by position). Every release the batch makes due is made
        before any block is taken (the released blocks may serve the step)."""
        seq_ids, toks, vals = batch_arguments(seq_ids, token_ids)
        n = len(toks)
        if n < 2:
            if not n:
                return np.empty(0, dtype=np.int64)
            return np.array([self.append_token(seq_ids[0], toks[0])], dtype=np.int64)
        ss = batch_seqs(self._seqs, seq_ids)
        if self._unready:
            for sid, s in zip(seq_ids, ss):
                if s.unscheduled or s.drafts or s.host is not None:
                    raise ValueError(s.why_not_ready(sid, "append to"))
        pool, k = self._pool, len(self._specs) * n
        # the batch can fail only when the free blocks may not cover it; releases go first when
        # an allocation might otherwise evict a cached block they would have spared
        if pool.num_free < k or self._cq.sources or (self._releases and pool.num_clean < k):
            self._coord.step_room(ss, "a decode step")
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
            if slot != s.end:
                s.nxt = slot
            else:
                s.nxt = -1
                if not slot % bs:
                    filled.append(s)
        if filled and self._cache is not None:
            self._publish_filled(filled)
        return np.fromiter(out, dtype=np.int64, count=n)

    def take_copies(self) -> list[CopyOp]:
        """Drain the copies queued by copy-on-write; run them before writing this step's KV.

        The list is safe for one batched kernel: no block is a destination twice, and no
        destination is the source of another copy in the list.
        """
        return self._coord.take_copies()

    def take_transfers(self) -> list[Transfer]:
        """Drain the block transfers between the device and the host tier (offloads, host hits,
        swaps), each tagged with its group; run them before the step's copies and K/V writes,
        every ``to_host`` before every ``to_device``. Always empty without a host tier. It
        marks the step boundary for ``swap_out``."""
        if self._tier is None:
            return []
        self._busy.clear()
        return self._coord.take_transfers()

    def swap_out(self, seq_id: Hashable) -> None:
        """Preempt a sequence: every live block of every group that no other sequence holds moves
        to a host block (``to_host`` transfers; the device block is released, a published one
        stays revivable); shared blocks stay on the device with its reference, and the releases
        due are made first. Atomic (OutOfBlocks changes nothing). Until ``swap_in`` it cannot be
        appended to, forked or exported. Its K/V must exist (the transfers run before the step's
        writes), so a sequence given positions or blocks since the last ``take_transfers()`` is
        refused: swap a victim out before scheduling it, or after the step. Example (block size
        4): ``add_sequence("s", 9 tokens)`` then ``swap_out("s")`` is refused; after
        ``take_transfers()`` and the step's writes it moves 3 blocks."""
        s = self._seq(seq_id)
        if self._tier is None:
            raise ValueError("swap_out needs a host tier (KVCacheManager(..., host_blocks=N))")
        if s.host is not None:
            raise ValueError(f"sequence {seq_id!r} is already swapped out")
        if s.unscheduled or s.drafts:
            raise ValueError(s.why_not_ready(seq_id, "swap out"))
        if s in self._busy or self._coord.pending_on(s):
            raise ValueError(f"cannot swap out {seq_id!r}: it was given positions or blocks in this step "
                             f"(or a copy or transfer of its blocks is pending), whose K/V is written only "
                             f"after take_transfers(); swap it out before scheduling it, or after the step")
        self._coord.swap_out(s, seq_id)
        self._unready += 1
        self._swapped += 1

    def swap_in(self, seq_id: Hashable) -> None:
        """Bring a swapped-out sequence back: each moved entry gets a device block and a
        ``to_device`` transfer, or, for a full block whose content the device still caches,
        that block (revived, no transfer). Atomic: OutOfBlocks changes nothing."""
        s = self._seq(seq_id)
        if s.host is None:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        self._coord.swap_in(s, seq_id)
        self._unready -= 1
        self._swapped -= 1

    # ---- fork and free -----------------------------------------------------------------------

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares every live block of the parent: O(blocks), no allocation, no copy.

        Fork between steps, after the step's K/V writes: a token whose K/V is not written yet
        would be shared unwritten.
        """
        p = self._seq(parent_id)
        if known(self._seqs, child_id):
            raise ValueError(f"sequence {child_id!r} already exists")
        if p.unscheduled or p.drafts or p.host is not None:  # p.unready, inline: a call less per fork
            raise ValueError(p.why_not_ready(parent_id, "fork"))
        child = self._seqs[child_id] = self._coord.fork(p)
        if self._busy and p in self._busy:  # forked before the step ran (against the rule)
            self._busy.add(child)
        self._forks += 1

    def free(self, seq_id: Hashable, *, cache: bool = True) -> None:
        """Release every block of the sequence, tail first (block i of every group before block
        i - 1, so its prefix is evicted last).

        ``cache=False`` is for a sequence whose K/V was never (fully) written (vLLM's abort):
        the blocks after its written prefix (its prefix hits; for a fork, the full blocks it
        shared) that it alone holds are unpublished, so no prompt hits content never computed.
        Example (block size 4): a 17-token prompt whose first 8 tokens hit, dropped unrun ->
        blocks 0 and 1 stay findable, 2 and 3 are unpublished. Either way a block it alone holds
        whose host load is still pending loses the load and its device hash."""
        if cache is not True and cache is not False:
            flag("cache", cache)
        s = self._seq(seq_id)
        del self._seqs[seq_id]
        if self._busy:
            self._busy.discard(s)
        if s.unscheduled or s.drafts or s.host is not None:  # s.unready, inline: a call less per free
            self._unready -= 1
        if s.host is not None:
            self._swapped -= 1
        self._coord.free(s, cache)

    # ---- prefix cache ------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash, the host tier's too; refused (False, nothing changed) while
        any block is in use on either tier or a transfer is pending (so while any sequence is
        live, swapped out or not)."""
        return self._coord.reset()

    def take_events(self) -> list:
        """Drain the KV cache events (BlockStored / BlockRemoved / AllBlocksCleared)."""
        return self._coord.log.take()

    # ---- exports for kernels -----------------------------------------------------------------

    def _on_device(self, seq_ids: Sequence[Hashable]) -> list[Seq]:
        """The sequences of a kernel export: known (KeyError), hashable and on the device."""
        seqs = self._seqs
        try:
            out = [seqs[i] for i in seq_ids]
        except TypeError:
            raise ValueError("sequence ids must be hashable") from None
        if self._swapped:
            for sid, s in zip(seq_ids, out):
                if s.host is not None:
                    raise ValueError(s.why_not_ready(sid, "export the block table of"))
        return out

    def block_tables(self, seq_ids: Sequence[Hashable], pad: int = -1, group: int = 0) -> np.ndarray:
        """Group ``group``'s tables as one padded ``np.int32[len(seq_ids), max_blocks]`` array
        (vLLM's form); released entries read -1 whatever ``pad`` is."""
        ss = self._on_device(seq_ids)
        pad = as_int(pad, "pad")
        if not -(2**31) <= pad < 2**31:
            raise ValueError(f"pad must fit in int32, got {pad}")
        g = self._group(group)
        return padded_tables(self._coord.rows(ss, g, bool(self._unready), live=False), pad)

    def flashinfer_layout(self, seq_ids: Sequence[Hashable], group: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """FlashInfer's paged layout of group ``group``: ``(indptr, indices, last_page_len)``,
        all ``np.int32``, over scheduled positions. Example (page size 4, lengths 10, 4, 5;
        tables [0,1,2], [3], [4,5]): indptr [0, 3, 4, 6], indices [0, 1, 2, 3, 4, 5],
        last_page_len [2, 4, 1]. A group that releases lists only its live pages: pass the
        kernel ``window_left = W - 1`` (the window counts the query itself); every dropped page
        lies wholly below the window. A chunked group needs the kernel's own chunk mask."""
        ss = self._on_device(seq_ids)
        g = self._group(group)
        ntok = np.fromiter((s.computed for s in ss), dtype=np.int32, count=len(ss))
        return flashinfer_rows(self._coord.rows(ss, g, bool(self._unready), live=True), ntok, self._bs)

    def state_indices(self, seq_ids: Sequence[Hashable], group: int) -> tuple[np.ndarray, np.ndarray]:
        """For a recurrent-state group: ``(read, write)``, two ``np.int32`` arrays of block ids,
        the state each sequence's last scheduling call reads (-1: a zero state) and the block it
        writes the state after its last position into ((-1, -1) when that call scheduled
        nothing). ValueError for a group that is not a state group."""
        ss = self._on_device(seq_ids)
        read, write = self._coord.state_indices(ss, self._group(group))
        return np.array(read, dtype=np.int32), np.array(write, dtype=np.int32)

    # ---- accounting --------------------------------------------------------------------------

    def usage(self, group: int | None = None) -> Usage:
        """What the cache holds now, over scheduled positions (:class:`~pagedkv.types.Usage`):
        block counts over every group, each sequence's positions once in ``logical_tokens``, a
        position once per group holding it in ``stored_tokens``; ``usage(group=g)``: group g's
        own figures (``free_blocks`` stays the pool's: a free block serves any group)."""
        g = None if group is None else self._group(group)
        fields = self._coord.usage(self._seqs.values(), g)
        cache, tier = self._cache, self._tier
        return Usage(
            num_sequences=len(self._seqs),
            cow_copies=self._cq.queued,
            forks=self._forks,
            **fields,
            **(cache.usage_fields() if cache is not None else dict(prefix_query_tokens=0, prefix_hit_tokens=0)),
            **(dict(tier.usage_fields(), swapped_sequences=self._swapped) if tier is not None else {}),
        )

    def check_invariants(self) -> None:
        """Raise AssertionError unless the pool, every group's tables and the caches agree: the
        pool's own states; the sequences against the pool and the counters, each group's table
        by its spec (:func:`~pagedkv.invariants.check_sequences`); the pending copies; the
        prefix caches and the host tier (refcounts, kept content rehashed, reachability)."""
        self._pool.check_invariants()
        host_refs = check_sequences(self._seqs, self._coord, self._unready, self._swapped, self._busy)
        self._cq.check_invariants()
        self._coord.check_invariants(host_refs)
