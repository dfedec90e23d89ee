"""Attention specs: one class per attention type, holding every rule that belongs to that type.

A hybrid model mixes layers that attend to the whole context with layers that attend only to a
window of it; a group of layers that share one spec needs the K/V of exactly the positions its
next query reads. Each spec is a frozen value object with no per-sequence state and the only
place its type's rules live: what a query reads (:meth:`first_read`, :meth:`read_ranges`), what
may be released (:meth:`released_below`, :meth:`kept_blocks`) and when (:meth:`next_release`),
what a prefix hit needs (:meth:`hit_blocks`), what a call adds (:meth:`new_blocks`), what a
group holds (:meth:`blocks_held`, :meth:`peak_blocks`), and its table check. The coordinator,
sizing, the page-layout model and the routers ask the spec and never look at its type: a new
attention type is one new subclass. Imports only :mod:`pagedkv.checks`.

Semantics are transformers' (``masking_utils``): a query at position q reads

- ``FullAttention()``: positions 0 .. q;
- ``SlidingWindow(window=W)``: positions q-W+1 .. q (the window counts the query itself, so
  gpt-oss's W = 128 reads the token and the 127 before it);
- ``ChunkedLocalAttention(chunk=C)``: positions floor(q/C)*C .. q (Llama 4's 8,192-token chunks).

Worked example (block size 16, ``SlidingWindow(128)``, 1,000 positions computed): position 1,000
reads 873 .. 1,000, so blocks 0 .. 53 can be released and 54 .. 62 stay; full attention holds 63.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import numpy as np

from .checks import int_at_least, require

__all__ = [
    "AttentionSpec",
    "FullAttention",
    "SlidingWindow",
    "ChunkedLocalAttention",
    "RecurrentState",
    "check_groups",
    "NEVER",
]

NEVER = 1 << 62  # a committed count no sequence reaches: "no release is ever due"


class AttentionSpec:
    """What every attention type answers. ``kind`` is the name vLLM's KV events carry in
    ``kv_cache_spec_kind``; ``sliding_window`` is what they carry in
    ``kv_cache_spec_sliding_window`` (W, or None). ``reads_whole_prefix`` is True for a type
    whose every query reads position 0 onwards (a prefix hit then needs every block below it,
    and the hit search is one walk along the chain)."""

    kind: ClassVar[str]
    reads_whole_prefix: ClassVar[bool] = False
    holds_state: ClassVar[bool] = False  # a recurrent state per sequence, not K/V per position

    @property
    def sliding_window(self) -> int | None:
        return None

    def first_read(self, q: int) -> int:
        """The lowest position a query at position ``q`` reads (beyond :meth:`kept_blocks`)."""
        raise NotImplementedError

    def first_read_array(self, q: np.ndarray) -> np.ndarray:
        """:meth:`first_read` over an array of positions (numpy speed for the simulator)."""
        return np.fromiter((self.first_read(int(x)) for x in np.ravel(q)), dtype=np.int64,
                           count=np.size(q)).reshape(np.shape(q))

    def read_ranges(self, q: int, block_size: int) -> list[range]:
        """The positions a query at ``q`` reads from the cache, as ranges: the kept blocks'
        positions (up to q) and ``first_read(q) .. q``. Example (block size 16, window 128):
        position 1,000 reads [range(873, 1001)]."""
        first = self.first_read(q)
        kept = min(self.kept_blocks(block_size) * block_size, q + 1)
        if kept >= first:
            return [range(0, q + 1)]
        return [range(first, q + 1)] if not kept else [range(0, kept), range(first, q + 1)]

    def kept_blocks(self, block_size: int) -> int:
        """Leading blocks no query ever stops reading (attention sinks); 0 for the types here."""
        return 0

    def released_below(self, computed: int, block_size: int) -> int:
        """After ``computed`` positions, the first block the next query (position ``computed``)
        still reads past the kept blocks: blocks ``kept_blocks .. released_below - 1`` may be
        released before the next call allocates. Example (block size 16, window 128, 1,000
        computed): the window of position 1,000 starts at 873, in block 54."""
        return max(self.kept_blocks(block_size), self.first_read(computed) // block_size)

    def next_release(self, computed: int, block_size: int, limit: int) -> int:
        """The smallest committed count c' > ``computed`` at which :meth:`released_below` grows,
        or ``limit`` when none does below it: until then a decode token needs no release check.
        This generic form asks count by count; each type gives its closed form."""
        r = self.released_below(computed, block_size)
        return next((x for x in range(computed + 1, limit)
                     if self.released_below(x, block_size) > r), limit)

    def release_step(self, computed: int, block_size: int, limit: int) -> tuple[int, int]:
        """``(released_below(computed), next_release(computed, limit))`` in one call: what the
        decode slow path asks, twice a block per sequence under a window."""
        return self.released_below(computed, block_size), self.next_release(computed, block_size, limit)

    def blocks_held(self, computed: int, block_size: int) -> int:
        """Blocks the group holds between steps once ``computed`` positions are in the cache:
        the kept blocks, then from the first block the last computed position read through the
        last block (the release for the next query happens at the next call). Example above:
        position 999 read 872 .. 999, blocks 54 .. 62: 9 blocks. Llama 4 (chunk 8,192) at
        131,072 positions holds the whole last chunk, 512 blocks, though the next query starts
        a new chunk."""
        if computed <= 0:
            return 0
        kept = min(self.kept_blocks(block_size), -(-computed // block_size))
        return -(-computed // block_size) - self.released_below(computed - 1, block_size) + kept

    def peak_blocks(self, computed: np.ndarray, block_size: int) -> np.ndarray:
        """The most blocks the group holds at any context from 1 to ``computed`` (an array):
        what a request must be able to hold alone to run that far. Generic: the running maximum
        of :meth:`blocks_held`, position by position."""
        c = np.asarray(computed, dtype=np.int64)
        top = int(c.max(initial=0))
        table = np.maximum.accumulate(
            np.array([self.blocks_held(x, block_size) for x in range(top + 1)], dtype=np.int64))
        return table[c]

    def hit_blocks(self, hit: int, block_size: int) -> Sequence[int]:
        """The block indices a prefix hit of ``hit`` tokens (a multiple of ``block_size``) must
        find cached in this group, ascending: those covering what computing position ``hit``
        reads, below ``hit``. Full attention: all of them; a window only its last ones; a
        chunked group none when ``hit`` is a chunk boundary."""
        kept = min(self.kept_blocks(block_size), hit // block_size)
        tail = range(self.released_below(hit, block_size), hit // block_size)
        return tail if not kept else list(range(kept)) + list(tail)

    def shorten_hit(self, k: int, block_size: int, cached) -> int:
        """The longest hit of at most ``k`` blocks this group can serve: the first block
        ``hit_blocks`` names that ``cached(index)`` does not find, from the end, shortens it."""
        for i in reversed(self.hit_blocks(k * block_size, block_size)):
            if cached(i) is None:
                return i
        return k

    def new_blocks(self, start: int, stop: int, block_size: int) -> int:
        """Blocks a call that schedules positions ``start .. stop - 1`` adds to the table: one
        per ``block_size`` positions begun."""
        return -(-stop // block_size) - -(-start // block_size)

    def check_table(self, table: list, low: int, committed: int, block_size: int, what: str) -> None:
        """This type's half of a table's invariant check: entries between the kept blocks and
        ``low`` (the first live one past them) read -1, and nothing the next query reads is
        released (``low`` is at most :meth:`released_below` of the committed positions)."""
        kept = min(self.kept_blocks(block_size), len(table))
        require(all(b == -1 for b in table[kept:low]), f"{what}: entries below {low} must read -1")
        require(low <= max(kept, self.released_below(committed, block_size)),
                f"{what}: released what the next query reads")


@dataclass(frozen=True)
class FullAttention(AttentionSpec):
    """Every position attends to all before it: nothing is ever released."""

    kind: ClassVar[str] = "full_attention"
    reads_whole_prefix: ClassVar[bool] = True

    def first_read(self, q: int) -> int:
        return 0

    def first_read_array(self, q: np.ndarray) -> np.ndarray:
        return np.zeros_like(np.asarray(q, dtype=np.int64))

    def released_below(self, computed: int, block_size: int) -> int:
        return 0

    def next_release(self, computed: int, block_size: int, limit: int) -> int:
        return NEVER

    def peak_blocks(self, computed: np.ndarray, block_size: int) -> np.ndarray:
        c = np.asarray(computed, dtype=np.int64)
        return -(-c // block_size)

    def hit_blocks(self, hit: int, block_size: int) -> range:
        return range(hit // block_size)


class _Local(AttentionSpec):
    """A type whose queries read a suffix that moves forward (a window or a chunk): its peak
    holding is periodic, so a table of one period answers every length."""

    def _period(self, block_size: int) -> int:
        raise NotImplementedError

    def _own_rules(self) -> bool:
        """Whether ``released_below`` is this type's own (a subclass may move it, e.g. a test's
        control that releases early): the closed forms below hold only for the own rule."""
        return type(self).released_below is AttentionSpec.released_below

    def peak_blocks(self, computed: np.ndarray, block_size: int) -> np.ndarray:
        c = np.asarray(computed, dtype=np.int64)
        span = self._period(block_size)
        held = np.arange(span + 1, dtype=np.int64)
        last = np.maximum(held - 1, 0)
        held = np.where(held > 0, -(-held // block_size) - self.first_read_array(last) // block_size, 0)
        return np.maximum.accumulate(held)[np.minimum(c, span)]


@dataclass(frozen=True)
class SlidingWindow(_Local):
    """A query at q reads q-W+1 .. q (gpt-oss: W = 128; Gemma 3: 1,024; Command R7B: 4,096)."""

    window: int
    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        object.__setattr__(self, "window", int_at_least("window", self.window, 1))

    @property
    def sliding_window(self) -> int | None:
        return self.window

    def first_read(self, q: int) -> int:
        return max(0, q - self.window + 1)

    def first_read_array(self, q: np.ndarray) -> np.ndarray:
        return np.maximum(0, np.asarray(q, dtype=np.int64) - self.window + 1)

    def release_step(self, computed: int, block_size: int, limit: int) -> tuple[int, int]:
        if not self._own_rules():
            return AttentionSpec.release_step(self, computed, block_size, limit)
        first = computed - self.window + 1
        r = first // block_size if first > 0 else 0
        return r, max(computed + 1, (r + 1) * block_size + self.window - 1)

    def next_release(self, computed: int, block_size: int, limit: int) -> int:
        """Closed form: block r leaves once position (r + 1) * block_size is the first read.
        Example (block size 16, window 128, c = 1,000: blocks below 54 released): block 54
        (positions 864 .. 879) leaves at c' = 880 + 127 = 1,007."""
        if not self._own_rules():
            return AttentionSpec.next_release(self, computed, block_size, limit)
        nxt = (self.released_below(computed, block_size) + 1) * block_size
        return max(computed + 1, nxt + self.window - 1)

    def _period(self, block_size: int) -> int:
        return self.window + block_size


@dataclass(frozen=True)
class ChunkedLocalAttention(_Local):
    """A query at q reads its own chunk, floor(q/C)*C .. q (Llama 4: C = 8,192)."""

    chunk: int
    kind: ClassVar[str] = "chunked_local_attention"

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunk", int_at_least("chunk", self.chunk, 1))

    def first_read(self, q: int) -> int:
        return q - q % self.chunk

    def first_read_array(self, q: np.ndarray) -> np.ndarray:
        q = np.asarray(q, dtype=np.int64)
        return q - q % self.chunk

    def release_step(self, computed: int, block_size: int, limit: int) -> tuple[int, int]:
        if not self._own_rules():
            return AttentionSpec.release_step(self, computed, block_size, limit)
        chunk = self.chunk
        r = (computed - computed % chunk) // block_size
        return r, max(computed + 1, -(-((r + 1) * block_size) // chunk) * chunk)

    def next_release(self, computed: int, block_size: int, limit: int) -> int:
        """Closed form: the next chunk start at or past the end of the next block to release."""
        if not self._own_rules():
            return AttentionSpec.next_release(self, computed, block_size, limit)
        nxt = (self.released_below(computed, block_size) + 1) * block_size
        return max(computed + 1, -(-nxt // self.chunk) * self.chunk)

    def _period(self, block_size: int) -> int:
        return math.lcm(self.chunk, block_size) + block_size


@dataclass(frozen=True)
class RecurrentState(AttentionSpec):
    """A group of recurrent layers (Mamba, gated DeltaNet): each sequence carries one fixed-size
    state instead of K/V per position; a query at q reads only the state after position q - 1.

    The group's table has one entry per ``interval`` positions (entry j: the state block of
    positions j*T .. (j+1)*T - 1, holding the state after the last of them the sequence has
    scheduled); a state ending exactly at an interval end is a checkpoint a later prompt can
    start from. ``interval`` must be a multiple of the manager's block size (the manager checks).
    Example (T = 256): a 600-token prompt admitted whole writes entry 2; its table is [-1, -1, b].
    """

    interval: int
    kind: ClassVar[str] = "mamba"
    holds_state: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "interval", int_at_least("interval", self.interval, 1))

    def first_read(self, q: int) -> int:
        return q  # no K/V: only the state after q - 1

    def read_ranges(self, q: int, block_size: int) -> list[range]:
        return []

    def released_below(self, computed: int, block_size: int) -> int:
        return max(0, (computed - 1) // self.interval)  # every entry below the running one

    def blocks_held(self, computed: int, block_size: int) -> int:
        return 1 if computed > 0 else 0

    def peak_blocks(self, computed: np.ndarray, block_size: int) -> np.ndarray:
        return (np.asarray(computed, dtype=np.int64) > 0).astype(np.int64)

    def entries(self, computed: int) -> int:
        """Table entries after ``computed`` positions: one per interval begun."""
        return -(-computed // self.interval)

    def next_release(self, computed: int, block_size: int, limit: int) -> int:
        """The next position after ``computed`` a decode step must not take on the fast path:
        an interval's last position (its call leaves a checkpoint), the first of the next
        (a new entry) and the one after (the old entry is released). Example (T = 256, 300
        computed): 511."""
        t = self.interval
        for p in range(computed + 1, computed + 4):
            if p % t in (t - 1, 0, 1 % t):
                return min(p, limit)
        return min(computed + 1 + (t - 1 - (computed + 1) % t), limit)

    def hit_blocks(self, hit: int, block_size: int) -> Sequence[int]:
        """The block whose chain hash keys the checkpoint a hit of ``hit`` tokens starts from
        (none for a hit of 0); only a hit at an interval end can start from one."""
        return [hit // block_size - 1] if hit else []

    def shorten_hit(self, k: int, block_size: int, cached) -> int:
        """The longest hit of at most ``k`` blocks this group can start: an interval end whose
        checkpoint ``cached(block index)`` finds."""
        step = self.interval // block_size
        k -= k % step
        while k > 0 and cached(k - 1) is None:
            k -= step
        return k

    def check_table(self, table: list, low: int, committed: int, block_size: int, what: str) -> None:
        require(len(table) == self.entries(committed), f"{what}: {len(table)} entries for {committed} positions")


def check_groups(groups: Sequence[Any]) -> tuple[AttentionSpec, ...]:
    """A manager's ``groups`` argument: a non-empty sequence of specs, else ``ValueError``."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
        raise ValueError(f"groups must be a list of attention specs, got {type(groups).__name__}")
    if not groups:
        raise ValueError("groups must hold at least one attention spec (FullAttention() for a "
                         "uniform model)")
    for i, g in enumerate(groups):
        if not isinstance(g, AttentionSpec) or type(g) in (AttentionSpec, _Local):
            raise ValueError(f"groups[{i}] is not an attention spec (FullAttention, SlidingWindow, "
                             f"ChunkedLocalAttention, RecurrentState): {g!r}")
    if groups[0].holds_state:
        raise ValueError("groups[0] must be an attention group: the slots append_* and prefill return are "
                         "group 0's, and a recurrent-state group has none")
    return tuple(groups)
