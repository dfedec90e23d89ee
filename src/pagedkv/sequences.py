"""Per-sequence state and what is computed from it alone: the kernel exports, slots, the
token and id coercions, and the per-sequence half of the manager's checks.

A :class:`Seq` is one sequence's block table (with its int32 mirror for the kernels), its tokens
and the chained hashes of its full blocks, and the counters that say whether the decode fast
path may write its next token without a decision. The manager owns the dict of them and is the
only writer; the functions here read sequences and never touch the pool or the caches, except
:func:`check_tables`, which reads refcounts. Also here: the manager's constructor arguments
(:func:`manager_args`) and the sequence-table half of a swap (:meth:`Seq.private_blocks`,
:meth:`Seq.swapped_out`, :meth:`Seq.swapped_in`); the host tier owns the host half.
"""
from __future__ import annotations

import operator
import sys
from array import array
from collections import Counter
from operator import itemgetter
from collections.abc import Sequence as SequenceABC
from itertools import chain
from typing import Any, Hashable, Iterable, Sequence

import numpy as np

from .checks import as_int
from .checks import require
from .hashing import MAX_TOKEN_ID, ExtraKeys
from .host_tier import WRITE_POLICIES
from .pool import MAX_BLOCKS

__all__ = ["Seq", "token_array", "batch_arguments", "batch_seqs", "id_sequence", "le_bytes", "known", "count", "as_token", "slots_of",
           "not_ready", "block_tables", "flashinfer_layout", "scheduled_tables", "logical_usage",
           "check_tables", "blocks_for_step", "check_hashes", "filled_columns", "manager_args", "on_device",
           "MAX_BLOCK_SIZE"]

_BIG_ENDIAN = sys.byteorder == "big"
MAX_BLOCK_SIZE = 2**31 - 1  # FlashInfer's last_page_len and every slot stay int32/int64-exact


class Seq:
    """One sequence's state: its block table, its tokens, its full blocks' chained hashes.

    Tokens are an ``array('I')``: 4 bytes a token instead of a list's 8-byte pointer to a 28-byte
    int; forking a 2,048-token sequence copies 8 KiB rather than a list of 2,048 pointers; and a
    just-filled block's bytes for hashing are one slice away.

    Positions: ``tokens`` holds every token the sequence knows (the whole prompt from admission
    on, appended tokens, pending drafts). The first ``len(tokens) - unscheduled`` positions are
    scheduled for compute and covered by ``table``; the last ``drafts`` of them are speculative.
    Both counters are 0 for a sequence in the plain decode loop, and the decode path never
    touches them. ``hashes`` holds the chained hashes of every full block of the non-draft
    tokens (for a prompt mid-prefill, also of blocks not yet scheduled: they are published as
    chunks schedule them). ``keys``: the request's extra keys (LoRA name, multimodal items,
    salt; see :class:`~pagedkv.hashing.ExtraKeys`), None for a plain request.

    ``written``: how many leading blocks held K/V computed before this sequence was scheduled
    (its prefix hits, device and host; for a fork, the full blocks it shared with its parent,
    whose step wrote them). ``free(id, cache=False)`` unpublishes only the blocks after them.
    """

    __slots__ = ("table", "tokens", "hashes", "keys", "mirror", "nxt", "unscheduled", "drafts", "host",
                 "written")

    def __init__(self, table: list, tokens: array, hashes: list, keys: ExtraKeys | None, mirror=None,
                 nxt: int = -1, unscheduled: int = 0, written: int = 0) -> None:
        self.table = table
        self.tokens = tokens
        self.hashes = hashes
        self.keys = keys
        # The table as int32 with spare capacity, which the kernel exports slice. Built on the
        # first export (many sequences never need one), then kept.
        self.mirror = mirror
        # The slot the next token takes when that needs no decision: the last block is partial
        # and this sequence is its only holder. -1 sends the append down the slow path (full
        # last block, a fork may have shared it, or the sequence is mid-prefill or holds
        # drafts). Only fork shares a partial block, and fork resets it on both sides, so the
        # fast path never writes into a shared block.
        self.nxt = nxt
        self.unscheduled = unscheduled
        self.drafts = 0
        # Swapped out: logical block index -> host block, for the blocks moved to the host tier
        # (their table entries are -1 meanwhile). None while the sequence is on the device.
        self.host: dict[int, int] | None = None
        self.written = written

    @property
    def unready(self) -> bool:
        """Off the plain decode loop: mid-prefill, drafts pending, or swapped out. Such a
        sequence cannot be appended to or forked, and the manager counts them (``_unready``)
        so that a step of ready sequences skips this test. The one place it is written."""
        return bool(self.unscheduled or self.drafts or self.host is not None)

    @property
    def computed(self) -> int:
        """Positions scheduled for compute (hits, prefilled chunks, appended tokens, drafts)."""
        return len(self.tokens) - self.unscheduled

    def add_block(self, b: int) -> None:
        """Append a block to the table and its int32 mirror, if built (grown by doubling)."""
        n = len(self.table)
        self.table.append(b)
        mirror = self.mirror
        if mirror is not None:
            if n == len(mirror):
                self.mirror = mirror = np.concatenate([mirror, np.empty(n, dtype=np.int32)])
            mirror[n] = b

    def add_blocks(self, blocks: list) -> None:
        if self.mirror is None:
            self.table += blocks
        else:
            for b in blocks:
                self.add_block(b)

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

    def private_blocks(self, refcount, hashed: bool) -> tuple[list[int], list[int], list]:
        """What a swap-out moves: ``(indexes, blocks, hashes)`` of the blocks no other table
        holds (``refcount`` 1), each with its chained hash (None for a block not full, or for
        every block when ``hashed`` is False: prefix caching off). Example (block size 4, 9
        tokens in [3, 8, 5], block 3 shared with a fork) -> ([1, 2], [8, 5], [h1, None])."""
        table = self.table
        private = [i for i, b in enumerate(table) if refcount(b) == 1]
        nh = len(self.hashes) if hashed else 0
        return private, [table[i] for i in private], [self.hashes[i] if i < nh else None for i in private]

    def swapped_out(self, private: list[int], host: list[int]) -> None:
        """The blocks at ``private`` moved to ``host`` blocks: their entries read -1 until
        :meth:`swapped_in`, the mirror is dropped (rebuilt at the next export), no fast path."""
        table = self.table
        for i in private:
            table[i] = -1
        self.mirror = None
        self.host = dict(zip(private, host))
        self.nxt = -1

    def swapped_in(self, revive: dict[int, int], loads: list[int], new: list[int]) -> tuple[list[int], list[int]]:
        """Back on the device: index -> device block for the revived ones, ``new`` blocks for
        the ``loads`` indexes. Returns the host blocks ``(loaded, revived)`` the sequence lets
        go of (the host tier's :meth:`~pagedkv.host_tier.HostTier.swap_in` takes them)."""
        table, host = self.table, self.host
        for i, d in revive.items():
            table[i] = d
        for i, d in zip(loads, new):
            table[i] = d
        self.host = None
        return [host[i] for i in loads], [host[i] for i in revive]



def token_array(token_ids: Any) -> array:
    """Token ids as a fresh ``array('I')``, validated: integers in ``[0, 2**32)``, else ValueError.

    Lists and tuples convert in one C loop; numpy integer arrays by a range check and one cast,
    never element by element. Masked arrays are refused: a masked token has no value.
    """
    if type(token_ids) is list or type(token_ids) is tuple:
        try:
            return array("I", token_ids)
        except OverflowError as exc:
            raise ValueError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]: {exc}") from None
        except TypeError:  # numpy scalars (np.True_ has no __index__) or a bad id: one by one
            return array("I", [as_token(t) for t in token_ids])
    if isinstance(token_ids, np.ndarray):
        if isinstance(token_ids, np.ma.MaskedArray):
            raise ValueError("token ids must not be a masked array (a masked token has no value)")
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
    return token_array([as_token(t) for t in token_ids])


def id_sequence(seq_ids: Any) -> list:
    """``append_batch``'s ids as a list; the pairing with tokens is by position, so unordered
    collections (sets, dicts) are refused rather than paired in whatever order they iterate."""
    if isinstance(seq_ids, np.ndarray):
        if isinstance(seq_ids, np.ma.MaskedArray):
            raise ValueError("sequence ids must not be a masked array")
        if seq_ids.ndim != 1:
            raise ValueError(f"sequence ids must be a 1-D array, got shape {seq_ids.shape}")
        return seq_ids.tolist()
    if isinstance(seq_ids, (str, bytes, bytearray)) or not isinstance(seq_ids, SequenceABC):
        raise ValueError(
            f"sequence ids must be an ordered sequence (list, tuple, 1-D array), got {type(seq_ids).__name__}"
        )
    return list(seq_ids)


def batch_arguments(seq_ids: Any, token_ids: Any) -> tuple[Sequence, array, Sequence]:
    """``append_batch``'s arguments, validated: the ids as a list or tuple, the tokens as an
    ``array('I')``, and the values the decode loop appends. Every token id is checked in one C
    loop; for a list or tuple the loop then appends its own int objects rather than new ones read
    back out of the array."""
    if type(seq_ids) is not list and type(seq_ids) is not tuple:
        seq_ids = id_sequence(seq_ids)
    toks = vals = None
    if type(token_ids) is list or type(token_ids) is tuple:
        try:
            toks = array("I", token_ids)
            vals = token_ids
        except (TypeError, OverflowError):  # numpy scalars or bad ids: the checked path
            pass
    if toks is None:
        toks = vals = token_array(token_ids)
    if len(toks) != len(seq_ids):
        raise ValueError(f"{len(seq_ids)} sequence ids but {len(toks)} tokens")
    return seq_ids, toks, vals


def batch_seqs(seqs: dict, seq_ids: Sequence) -> tuple:
    """The sequences of a batch of two or more ids, in order: KeyError for an unknown id,
    ValueError for an unhashable or repeated one."""
    try:
        ss = itemgetter(*seq_ids)(seqs)
    except TypeError:
        raise ValueError("sequence ids must be hashable") from None
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError("a sequence id appears twice in one append_batch")
    return ss


def _le_bytes_swapped(tokens: array) -> bytes:  # pragma: no cover - no big-endian CI
    tokens = tokens[:]
    tokens.byteswap()
    return tokens.tobytes()


# The tokens' bytes as little-endian uint32, the form every hash is computed over: on a
# little-endian machine that is the array's own memory, and the C method is called directly.
le_bytes = _le_bytes_swapped if _BIG_ENDIAN else array.tobytes


def known(seqs: dict, seq_id: Any) -> bool:
    """Whether a new id is taken; an id that cannot be a dict key is a bad argument."""
    try:
        return seq_id in seqs
    except TypeError:
        raise ValueError(f"sequence ids must be hashable, got {type(seq_id).__name__}") from None


def count(value: Any, what: str) -> int:
    """A non-negative int argument (numpy ints welcome; bools and floats refused)."""
    value = as_int(value, what)
    if value < 0:
        raise ValueError(f"{what} must be a non-negative int, got {value}")
    return value


def manager_args(num_blocks: Any, block_size: Any, enable_prefix_caching: Any, enable_events: Any,
                 host_blocks: Any, host_write_policy: Any) -> tuple[int, int, int]:
    """``KVCacheManager``'s constructor arguments, checked before anything is built: returns
    ``(num_blocks, block_size, host_blocks)`` as Python ints. Block ids and page lengths are
    exported as int32, so both sizes stop at 2**31 - 1. Example: ``(np.int64(64), 16, True,
    True, 0, "write-back")`` -> ``(64, 16, 0)``; ``block_size=0`` raises ValueError."""
    block_size = as_int(block_size, "block_size")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(
            f"block_size must be an int in [1, {MAX_BLOCK_SIZE}] (page lengths are exported "
            f"as int32), got {block_size!r}"
        )
    num_blocks = as_int(num_blocks, "num_blocks")
    if not 1 <= num_blocks <= MAX_BLOCKS:
        raise ValueError(
            f"num_blocks must be an int in [1, {MAX_BLOCKS}] (block ids are exported as "
            f"int32), got {num_blocks!r}"
        )
    if not isinstance(enable_prefix_caching, bool) or not isinstance(enable_events, bool):
        raise ValueError("enable_prefix_caching and enable_events must be bools")
    host_blocks = count(host_blocks, "host_blocks")
    if host_blocks > MAX_BLOCKS:
        raise ValueError(f"host_blocks must be at most {MAX_BLOCKS}, got {host_blocks}")
    if host_write_policy not in WRITE_POLICIES:
        raise ValueError(f"host_write_policy must be one of {WRITE_POLICIES}, got {host_write_policy!r}")
    return num_blocks, block_size, host_blocks


def as_token(token: Any) -> int:
    """Accept numpy integers (and bools, as lists of bools are) as token ids; reject the rest."""
    if isinstance(token, (float, str, bytes)) or isinstance(token, np.floating):
        raise ValueError(f"token id must be an integer, got {token!r}")
    if isinstance(token, np.ma.MaskedArray):  # a masked value would become its hidden data
        raise ValueError("token ids must not be a masked array: fill or drop the masked entries")
    if isinstance(token, np.bool_):
        return int(token)
    try:
        token = operator.index(token)
    except TypeError:
        raise ValueError(f"token id must be an integer, got {type(token).__name__}") from None
    if not 0 <= token <= MAX_TOKEN_ID:
        raise ValueError(f"token id {token} outside [0, {MAX_TOKEN_ID}]")
    return token


def slots_of(s: Seq, start: int, stop: int, bs: int, offsets: np.ndarray | None) -> np.ndarray:
    """Slots of positions ``start..stop`` (validated): whole blocks' slot rows, trimmed.
    ``offsets`` is ``arange(bs)`` (None for absurd block sizes: then one position at a time).
    Example (block size 4, table [7, 2]): positions 3..6 -> [31, 8, 9]."""
    if start == stop:
        return np.empty(0, dtype=np.int64)
    first, last = start // bs, (stop - 1) // bs
    blocks = np.asarray(s.table[first : last + 1], dtype=np.int64)
    if offsets is None:
        pos = np.arange(start, stop, dtype=np.int64)
        return blocks[pos // bs - first] * bs + pos % bs
    rows = (blocks[:, None] * bs + offsets).ravel()
    lo = start - first * bs
    return rows[lo : lo + stop - start]


def on_device(seqs: dict, seq_ids: Iterable[Hashable], swapped: int) -> list[Seq]:
    """The sequences of a kernel export: known (KeyError), hashable and, when any sequence is
    swapped out (``swapped`` > 0), on the device (ValueError)."""
    try:
        out = [seqs[i] for i in seq_ids]
    except TypeError:
        raise ValueError("sequence ids must be hashable") from None
    if swapped:
        for sid, s in zip(seq_ids, out):
            if s.host is not None:
                raise ValueError(not_ready(sid, s, "export the block table of"))
    return out


def not_ready(seq_id: Hashable, s: Seq, what: str) -> str:
    """Why a sequence off the plain decode loop (swapped out, mid-prefill, drafts pending) cannot
    be appended to, forked, exported...: the error message, naming the call that fixes it."""
    if s.host is not None:
        return f"cannot {what} {seq_id!r}: it is swapped out (call swap_in first)"
    if s.unscheduled:
        return (f"cannot {what} {seq_id!r}: {s.unscheduled} prompt positions are not "
                f"scheduled yet (call prefill first)")
    return f"cannot {what} {seq_id!r}: {s.drafts} drafts are pending (call accept first)"


def scheduled_tables(ss: Sequence[Seq], bs: int, unready: bool) -> list[np.ndarray]:
    """Each sequence's int32 table over its scheduled positions (a reserved tail, from
    ``reserve=True``, is not exported). ``unready`` False: no sequence has such a tail."""
    if unready:
        return [s.int32_table()[: -(-s.computed // bs)] if s.unscheduled else s.int32_table() for s in ss]
    return [s.int32_table() for s in ss]


def block_tables(ss: Sequence[Seq], pad: int, bs: int, unready: bool) -> np.ndarray:
    """Padded ``np.int32[len(ss), max_blocks]`` block tables (vLLM's form): one slice copy per
    sequence from its int32 mirror, not one Python int per block."""
    rows = scheduled_tables(ss, bs, unready)
    width = max(map(len, rows), default=0)
    out = np.full((len(ss), width), pad, dtype=np.int32)
    for row, r in zip(out, rows):
        row[: len(r)] = r
    return out


def flashinfer_layout(ss: Sequence[Seq], bs: int, unready: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's ``(indptr, indices, last_page_len)`` over scheduled positions, all int32.
    Example (page size 4, lengths 10, 4, 5; tables [0,1,2], [3], [4,5]): indptr [0, 3, 4, 6],
    indices [0, 1, 2, 3, 4, 5], last_page_len [2, 4, 1]."""
    tables = scheduled_tables(ss, bs, unready)
    nblocks = np.fromiter(map(len, tables), dtype=np.int32, count=len(ss))
    indptr = np.zeros(len(ss) + 1, dtype=np.int32)
    np.cumsum(nblocks, out=indptr[1:])
    indices = np.concatenate(tables) if ss else np.empty(0, dtype=np.int32)
    ntok = np.fromiter((len(s.tokens) for s in ss), dtype=np.int32, count=len(ss))
    if unready:
        ntok -= np.fromiter((s.unscheduled for s in ss), dtype=np.int32, count=len(ss))
    last_page_len = np.minimum(ntok, (ntok - 1) % bs + 1)  # 0 pages -> 0
    return indptr, indices, last_page_len


def logical_usage(seqs: Iterable[Seq], bs: int, used: int) -> tuple[int, int, int]:
    """``(logical tokens, stored tokens, logical blocks)`` over the sequences' scheduled
    positions on the device, given the pool's ``used`` blocks: what ``usage()`` reports.
    Stored tokens count each used block once, less partial last blocks' empty tails and
    reserved blocks (``reserve=True``: held, nothing scheduled in them yet). Example (block
    size 4): one 6-token sequence in [0, 1], 2 blocks used -> (6, 6, 2)."""
    logical = logical_blocks = reserved = 0
    partial: dict[int, int] = {}
    for s in seqs:
        n = len(s.tokens) - s.unscheduled
        if s.host is not None:  # swapped out: only the shared blocks left on the device
            for i, b in enumerate(s.table):
                if b >= 0:
                    logical += min(bs, n - i * bs)
                    logical_blocks += 1
                    if n - i * bs < bs:
                        partial[b] = n % bs
            continue
        logical += n
        logical_blocks += len(s.table)
        if n % bs:
            partial[s.table[n // bs]] = n % bs
        if s.unscheduled:
            reserved += len(s.table) - -(-n // bs)
    stored = (used - reserved) * bs - len(partial) * bs + sum(partial.values())
    return logical, stored, logical_blocks


def check_tables(seqs: dict, pool, bs: int, unready_count: int, swapped_count: int,
                 busy: set | None) -> dict[int, int]:
    """The tables' half of the manager's ``check_invariants``, against ``pool`` (read through
    ``refcounts`` and ``refcount``): each block's refcount is the number of table entries
    pointing at it; counters; each table has ``ceil(num_computed / block_size)`` entries, or,
    for a prompt admitted with ``reserve=True`` and not fully scheduled, ``ceil(num_tokens /
    block_size)`` whose blocks past the scheduled ones are private; mirrors; a partial block is
    only ever a last scheduled block, shared by sequences of equal length within it; fast-path
    slots private; swapped-out positions hold no device block. ``unready_count`` and
    ``swapped_count`` are the manager's counters, ``busy`` its sequences given work this step
    (None without a host tier). Returns host block -> swapped sequences holding it, for the
    host tier's check."""
    refs = Counter(chain.from_iterable(s.table for s in seqs.values()))
    refs.pop(-1, None)  # positions of swapped-out sequences that live on the host
    for b, c in enumerate(pool.refcounts()):
        require(refs.get(b, 0) == c, f"block {b}: refcount {c}, referenced {refs.get(b, 0)} times")
    refcount = pool.refcount
    partial_fill: dict[int, int] = {}
    unready = swapped = 0
    host_refs: dict[int, int] = {}
    for sid, s in seqs.items():
        n, done = len(s.tokens), s.computed
        require(n >= 1, f"sequence {sid!r} is empty")
        require(0 <= s.unscheduled <= n and 0 <= s.drafts <= done, f"sequence {sid!r}: bad counters")
        require(not (s.unscheduled and s.drafts), f"sequence {sid!r}: drafts mid-prefill")
        require(0 <= s.written <= (done - s.drafts) // bs, f"sequence {sid!r}: bad written prefix")
        unready += s.unready
        if s.host is not None:
            swapped += 1
            require(not s.unscheduled and not s.drafts and s.nxt < 0, f"{sid!r}: swapped out mid-step")
            require(sorted(s.host) == [i for i, b in enumerate(s.table) if b < 0],
                    f"sequence {sid!r}: swapped positions and host blocks disagree")
            for hb in s.host.values():
                host_refs[hb] = host_refs.get(hb, 0) + 1
        else:
            require(min(s.table, default=0) >= 0, f"sequence {sid!r}: a position without a block")
        nsched = -(-done // bs)  # blocks of the scheduled positions
        reserved = s.table[nsched:] if s.unscheduled and len(s.table) == -(-n // bs) else []
        require(len(s.table) == nsched + len(reserved),
                f"sequence {sid!r}: {len(s.table)} blocks for {done} positions ({n} reserved?)")
        for b in reserved:
            require(refcount(b) == 1, f"block {b} reserved for {sid!r} is shared")
        if s.mirror is not None:
            require(s.mirror[: len(s.table)].tolist() == s.table, f"sequence {sid!r}: int32 mirror differs")
        if done % bs and s.table[nsched - 1] >= 0:
            b = s.table[nsched - 1]
            require(partial_fill.setdefault(b, done % bs) == done % bs, f"partial block {b} shared at two fills")
        if s.nxt >= 0:
            ok = (done % bs and not s.unscheduled and not s.drafts and s.nxt == s.table[-1] * bs + done % bs
                  and refcount(s.table[-1]) == 1)
            require(bool(ok), f"sequence {sid!r}: fast-path slot {s.nxt} is not its private next slot")
    for sid, s in seqs.items():
        for b in s.table[: s.computed // bs]:
            require(b not in partial_fill, f"block {b} is full in {sid!r} but partial elsewhere")
    require(unready == unready_count, f"{unready} sequences unready, {unready_count} counted")
    if busy is not None:
        live = set(map(id, seqs.values()))
        require(all(id(s) in live and s.host is None for s in busy),
                "a sequence given work this step is freed or swapped out")
    require(swapped == swapped_count, f"{swapped} sequences swapped out, {swapped_count} counted")
    return host_refs


def blocks_for_step(ss: Iterable[Seq], bs: int, refcount) -> tuple[int, int]:
    """Fresh blocks and copies one decode step of ``ss`` takes.

    A full last block needs a fresh block. ``k`` batch members sharing a partial block held
    ``r`` times copy ``min(k, r - 1)`` times: each writer copies while another holder remains,
    the last holder writes in place. Example: 3 forks of one partial block (held 3 times) all
    appending -> (0, 2).
    """
    fresh = 0
    sharers: dict[int, int] = {}
    for s in ss:
        if s.nxt >= 0:  # a fast-path slot: private room in its last block, nothing to take
            continue
        if len(s.tokens) % bs:
            b = s.table[-1]
            if refcount(b) > 1:
                sharers[b] = sharers.get(b, 0) + 1
        else:
            fresh += 1
    return fresh, sum(min(k, refcount(b) - 1) for b, k in sharers.items())


def check_hashes(seqs: dict, keyed: dict, twins: dict | None, hasher, root: Hashable, bs: int) -> None:
    """Every sequence's stored hashes are its non-draft tokens' chained hashes (``hasher``
    recomputes them from ``root``); only fully scheduled, non-draft blocks carry a hash
    (``keyed``: block -> hash, the pool's), each the hash of its own content; a full block
    without one is a remembered twin (``twins``: block -> hash, the prefix cache's), and every
    twin is such a block. ``twins`` None: prefix caching is off, and no block carries a hash."""
    if twins is None:
        require(not keyed, "blocks carry keys with prefix caching off")
        return
    held_twins = {}
    for sid, s in seqs.items():
        nfull = (len(s.tokens) - s.drafts) // bs
        expect = hasher.chain_keyed(root, le_bytes(s.tokens[: nfull * bs]), 4 * bs, 0, nfull, s.keys)
        require(s.hashes == expect, f"sequence {sid!r}: stored hashes are not its tokens' hashes")
        offered = (s.computed - s.drafts) // bs
        for i, b in enumerate(s.table):
            if b < 0:
                continue
            k = keyed.get(b)
            if i >= offered:
                require(k is None, f"block {b} of {sid!r} is published before it is scheduled")
            elif k is None:  # findable all the same: a twin of the block its hash maps
                require(twins.get(b) == expect[i], f"full block {b} of {sid!r} is not findable")
                held_twins[b] = expect[i]
            else:
                require(k == expect[i], f"block {b} of {sid!r} is mapped under another content's hash")
    require(held_twins == twins, "a remembered twin is no live full block of that content")


def filled_columns(filled: Iterable[Seq], bs: int, digest, root: Hashable) -> tuple[list, list, list, list, list | None]:
    """Each sequence's last block just filled: hash it, chained from the sequence's last hash
    (``root`` for its first block) with ``digest(parent, bytes)``, append the hash to the
    sequence's chain, and return the columns ``PrefixCache.publish_blocks`` takes: blocks,
    hashes, parents, tokens, and one :class:`~pagedkv.hashing.BlockKey` (or None) per block once
    a filled sequence has extra keys (None when none has). One call per decode step, not per
    block, and one loop (the decode path's). Any sequence with ``table``, ``tokens``, ``hashes``
    and ``keys`` will do: the grouped manager passes its own, whose ``table`` is group 0's, and
    publishes the one hash in every group. Example (block size 4): a sequence of 8 tokens in
    [3, 5] -> ([5], [h1], [h0], [its last 4 tokens], None), with h1 appended to its hashes."""
    blocks, hashes, parents, tokens = [], [], [], []
    block_keys = None
    for s in filled:
        block_tokens = s.tokens[-bs:]
        chain = s.hashes
        parent = chain[-1] if chain else root
        if s.keys is None:
            h = digest(parent, le_bytes(block_tokens))
        else:
            key = s.keys.block_key(len(chain))
            if block_keys is None:
                block_keys = [None] * len(blocks)
            data = le_bytes(block_tokens)
            h = digest(parent, data + key.suffix if key is not None else data)
        if block_keys is not None:
            block_keys.append(None if s.keys is None else key)
        chain.append(h)
        blocks.append(s.table[-1])
        hashes.append(h)
        parents.append(parent)
        tokens.append(block_tokens)
    return blocks, hashes, parents, tokens, block_keys
