"""The small value types of the public API: errors, copy requests, usage, cache events.

They live apart from the allocator so that every layer (pool, manager, store, simulator) can
import them without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "OutOfBlocks",
    "CopyOp",
    "Transfer",
    "PrefixHit",
    "TO_HOST",
    "TO_DEVICE",
    "Usage",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVEvent",
]


class OutOfBlocks(RuntimeError):
    """Raised when a call needs more physical blocks than the pool can give.

    Nothing was changed by the failing call. ``needed`` is how many blocks the call had to take,
    ``available`` how many it could have taken (clean free + evictable cached), so the caller can
    decide how many sequences to preempt: it must release at least ``needed - available`` blocks.
    """

    def __init__(self, needed: int, available: int, what: str = "") -> None:
        self.needed = needed
        self.available = available
        self.what = what
        where = f" for {what}" if what else ""
        super().__init__(f"out of KV blocks{where}: needed {needed}, available {available}")

    def __reduce__(self):  # keep the fields when pickled (multiprocessing engines)
        return (type(self), (self.needed, self.available, self.what))


class _Tagged(tuple):
    """A named tuple of its positional fields, tagged with an attention ``group`` kept beside
    the tuple, not in it: ``CopyOp(3, 5)`` is still the pair ``(3, 5)``, so ``src, dst = op``,
    ``np.asarray(copies)`` (an ``[n, 2]`` array) and ``op == (3, 5)`` work whatever the group,
    while ``op.group`` names the group whose layers the block holds.
    Two tagged tuples are equal when their fields and groups are; a plain tuple compares with
    the fields alone. Example: ``CopyOp(3, 5, group=1) != CopyOp(3, 5)``, ``CopyOp(3, 5) ==
    (3, 5)``, ``CopyOp(3, 5, group=1) == (3, 5)``."""

    _fields: tuple = ()
    group = 0  # the class default: a group-0 op carries no instance dict entry

    def __getnewargs__(self):
        return (*self, self.group)

    def __eq__(self, other):
        if isinstance(other, _Tagged) and self.group != other.group:
            return False
        return tuple.__eq__(self, other)

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = tuple.__hash__

    def _asdict(self) -> dict:
        return dict(zip(self._fields, (*self, self.group)))

    def _replace(self, **changes):
        fields = self._asdict()
        unknown = set(changes) - set(fields)
        if unknown:
            raise ValueError(f"got unexpected field names: {sorted(unknown)!r}")
        fields.update(changes)
        return type(self)(**fields)

    def __repr__(self) -> str:  # group 0 left out: a manager without groups prints as it did
        shown = self._asdict() if self.group else dict(zip(self._fields, self))
        inner = ", ".join(f"{k}={v!r}" for k, v in shown.items())
        return f"{type(self).__name__}({inner})"


class CopyOp(_Tagged):
    """One block copy the engine must run before the step's KV writes: ``dst[:] = src[:]``.

    ``src`` and ``dst`` are physical block ids (not slots): copy all ``block_size`` slots of
    every layer's keys and values, of group ``group``'s layers for a manager built with
    ``groups=[...]`` (0 otherwise). Queued by copy-on-write; a pair (the group is kept beside
    it, see ``_Tagged``) so that a list of them converts straight to an ``[n, 2]`` int array for
    one batched copy kernel (the list that ``take_copies`` returns is safe to run that way; a
    grouped manager's copies of one group are one such batch).
    """

    __slots__ = ()
    _fields = ("src", "dst", "group")

    def __new__(cls, src: int, dst: int, group: int = 0) -> "CopyOp":
        op = tuple.__new__(cls, (src, dst))
        if group:
            op.group = group
        return op

    @property
    def src(self) -> int:  # physical block id read
        return self[0]

    @property
    def dst(self) -> int:  # physical block id written
        return self[1]


TO_HOST = "to_host"
TO_DEVICE = "to_device"


class Transfer(_Tagged):
    """One block the engine must move between the device and the host tier, before the step's
    KV writes: ``direction`` is ``"to_host"`` (``src`` a device block id, ``dst`` a host block
    id) or ``"to_device"`` (``src`` a host block, ``dst`` a device block). All layers' keys and
    values of the block move. ``group`` names the attention group whose layers the block holds
    (a grouped manager's swaps tag each block with its group); it is kept beside the triple,
    as ``CopyOp``'s, so a transfer is still ``(direction, src, dst)``.

    ``take_transfers`` lists every ``to_host`` entry before every ``to_device`` entry. Each
    direction is one batch (no block is a destination twice, no destination is another entry's
    source); run the ``to_host`` batch first (a block leaving the device may be the one a
    ``to_device`` entry fills), then the ``to_device`` batch, then the copies of ``take_copies``.
    """

    __slots__ = ()
    _fields = ("direction", "src", "dst", "group")

    def __new__(cls, direction: str, src: int, dst: int, group: int = 0) -> "Transfer":
        t = tuple.__new__(cls, (direction, src, dst))
        if group:
            t.group = group
        return t

    @property
    def direction(self) -> str:  # "to_host" | "to_device"
        return self[0]

    @property
    def src(self) -> int:
        return self[1]

    @property
    def dst(self) -> int:
        return self[2]


class PrefixHit(int):
    """Prompt tokens the cache serves (an int), with where they are: ``device`` tokens are in
    device blocks already; ``host`` tokens are loaded from the host tier by ``to_device``
    transfers. ``revived`` counts the device hit blocks that are cached-free now: admitting the
    prompt takes them out of the free count, as it takes a block for each host-hit block and
    each newly scheduled one. ``lookup`` returns one. Example: 48 tokens, 32 on the device (one
    of its two blocks cached-free, so ``revived`` 1) and 16 on the host."""

    device: int
    host: int
    revived: int

    def __new__(cls, device: int, host: int = 0, revived: int = 0) -> "PrefixHit":
        obj = super().__new__(cls, device + host)
        obj.device = device
        obj.host = host
        obj.revived = revived
        return obj

    def __reduce__(self):
        return (PrefixHit, (self.device, self.host, self.revived))

    def __repr__(self) -> str:
        return f"PrefixHit({int(self)}, device={self.device}, host={self.host}, revived={self.revived})"

    def __str__(self) -> str:  # printed and formatted as the number it is
        return int.__repr__(self)

    __format__ = int.__format__


@dataclass(frozen=True, slots=True)
class Usage:
    """A snapshot of what the cache holds, in the numbers the design is judged by.

    Token counts cover scheduled positions (a prompt mid-prefill counts what is scheduled).

    Fields:
        num_blocks, block_size: the pool's shape.
        num_sequences: live sequences.
        logical_tokens: the sum of every sequence's scheduled positions, shared ones counted
            once per sequence.
        stored_tokens: token states physically held: a block shared by several sequences
            counts once.
        used_blocks: blocks with at least one reference.
        free_blocks: clean free blocks (no content worth keeping).
        cached_blocks: free blocks whose content a prefix hit can still revive.
        allocated_slots: ``used_blocks * block_size``.
        internal_fragmentation: ``1 - stored_tokens / allocated_slots``: the unused tail of
            partial last blocks, the only waste paging accepts.
        blocks_saved_by_sharing: ``sum(ceil(len / block_size)) - used_blocks`` over sequences.
        prefix_query_tokens, prefix_hit_tokens: prompt tokens admitted, and how many the prefix
            cache served (``prefix_hit_rate`` is their ratio).
        cow_copies: copy-on-write copies queued so far; forks: forks so far; evictions:
            cached blocks evicted from the device so far.
        host_blocks, host_used_blocks, host_cached_blocks: the host tier's size, blocks held
            (swapped-out sequences, transfers not drained yet) and revivable cached blocks.
        host_hit_tokens: prompt tokens the host tier served (included in prefix_hit_tokens).
        swapped_sequences: sequences swapped out (their device blocks are not counted in the
            token numbers above, except blocks they share with others, which stay).
        transfers_to_host, transfers_to_device: blocks queued each way so far.

    Worked example (block size 16): one 20-token sequence forked into two that each then
    append one token. Logical tokens 42; the first block (16 tokens) is shared; each child has its
    own partial block of 5 -> ``used_blocks`` 3, ``stored_tokens`` 16 + 5 + 5 = 26,
    ``allocated_slots`` 48, ``internal_fragmentation`` 1 - 26/48 = 0.458,
    ``blocks_saved_by_sharing`` (2 + 2) - 3 = 1.
    """

    num_blocks: int
    block_size: int
    num_sequences: int
    logical_tokens: int
    stored_tokens: int
    used_blocks: int
    free_blocks: int  # clean free blocks only (no cached content)
    cached_blocks: int  # free blocks whose content is still revivable by a prefix hit
    allocated_slots: int
    internal_fragmentation: float
    blocks_saved_by_sharing: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    cow_copies: int
    forks: int
    evictions: int
    host_blocks: int = 0  # blocks of the host tier (0: no tier)
    host_used_blocks: int = 0  # host blocks held by swapped-out sequences or pending transfers
    host_cached_blocks: int = 0  # host blocks whose content a prefix hit can load
    host_hit_tokens: int = 0  # prompt tokens served from the host tier (part of prefix_hit_tokens)
    swapped_sequences: int = 0  # sequences swapped out to the host tier
    transfers_to_host: int = 0  # blocks queued device -> host so far
    transfers_to_device: int = 0  # blocks queued host -> device so far

    @property
    def prefix_hit_rate(self) -> float:
        """Share of queried prompt tokens served from the cache (0.0 when nothing was queried)."""
        q = self.prefix_query_tokens
        return self.prefix_hit_tokens / q if q else 0.0

    @property
    def utilization(self) -> float:
        """Share of all KV memory that holds a token state of a running sequence."""
        total = self.num_blocks * self.block_size
        return self.stored_tokens / total if total else 0.0


# ---- KV cache events: what an external router needs to index which prefixes this cache holds.


class BlockStored(NamedTuple):
    """Full blocks were published to the prefix cache, in chain order.

    ``parent_block_hash`` is the hash the first of ``block_hashes`` was chained from (for a
    prompt's first block, the one root every prompt is chained from, salted or not, which
    ``pagedkv.events`` sends as nil); ``token_ids`` are all the blocks' tokens, concatenated.
    ``lora_name`` and ``extra_keys`` are set for blocks of a request with extra keys, as vLLM 0.33
    sends them: the adapter's name, and one entry per block (None for a block without keys), each
    a tuple of the LoRA name, ``(mm_hash, offset)`` pairs (the item's start relative to the
    block's) and the salt (block 0 only), the keys the block's hash covers beyond its tokens.
    Example: a LoRA ``"sql"`` request salted ``"t"`` publishing blocks 0 and 1 gives
    ``lora_name="sql"`` and ``extra_keys=(("sql", "t"), ("sql",))``. Events are named tuples:
    immutable, and cheap enough to emit on the decode path.
    """

    block_hashes: tuple
    parent_block_hash: Any
    token_ids: tuple
    block_size: int
    medium: str = "GPU"  # where the blocks now live: "GPU" (the device) or "CPU" (the host tier)
    lora_name: str | None = None
    extra_keys: tuple | None = None
    # The attention group the blocks belong to (0 for a uniform model), its spec's kind
    # ("full_attention", "sliding_window", "chunked_local_attention") and its window (None
    # unless sliding), as vLLM tags every stored block. None: an event from no manager.
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(NamedTuple):
    """Cached blocks were evicted from ``medium`` (their content is gone there; the hashes no
    longer hit in that tier).

    Consecutive evictions from one medium (one admission evicting 50 blocks, say) arrive as one
    event.
    """

    block_hashes: tuple
    medium: str = "GPU"
    group_idx: int | None = None  # the group the blocks belonged to (0 for a uniform model)


class AllBlocksCleared(NamedTuple):
    """The whole prefix cache was dropped (``reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
