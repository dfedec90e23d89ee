"""Attention specs: which positions a group of layers still reads, and so which blocks it keeps.

A hybrid model (gpt-oss, Gemma 3, Llama 4, Command R7B) mixes layers that attend to the whole
context with layers that attend only to a window of it. A group of layers that share one spec
needs the K/V of exactly the positions its next query reads; every block wholly below them can go
back to the pool. This module is that rule and nothing else: three frozen value objects, with no
state and no imports from the rest of pagedkv but :mod:`pagedkv.checks`, so the allocator, the
sizing tables and the simulator all ask the same questions of them (docs/design.md section 3.12).

Semantics are transformers' (``masking_utils``): a query at position q reads

- ``FullAttention()``: positions 0 .. q;
- ``SlidingWindow(window=W)``: positions q-W+1 .. q (the window counts the query itself, so
  gpt-oss's W = 128 reads the token and the 127 before it);
- ``ChunkedLocalAttention(chunk=C)``: positions floor(q/C)*C .. q (Llama 4's 8,192-token chunks).

Worked example (block size 16, ``SlidingWindow(128)``, 1,000 positions computed): the next query
is position 1,000 and reads 873 .. 1,000, so blocks 0 .. 53 (positions 0 .. 863) are wholly below
the window and can be released; blocks 54 .. 62 (nine blocks, 144 slots) stay. A full-attention
group holds all 63.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from .checks import int_at_least

__all__ = [
    "AttentionSpec",
    "FullAttention",
    "SlidingWindow",
    "ChunkedLocalAttention",
    "check_groups",
]


class AttentionSpec:
    """What every spec answers. ``kind`` is the name vLLM's KV events carry in
    ``kv_cache_spec_kind``; ``sliding_window`` is what they carry in
    ``kv_cache_spec_sliding_window`` (W, or None)."""

    kind: ClassVar[str]

    @property
    def sliding_window(self) -> int | None:
        return None

    def first_read(self, q: int) -> int:
        """The lowest position a query at position ``q`` reads."""
        raise NotImplementedError

    def released_below(self, computed: int, block_size: int) -> int:
        """After ``computed`` positions, the first block the next query (position ``computed``)
        still reads: every block below it may be released before the next call allocates.
        Example (block size 16, window 128, 1,000 computed): the window of position 1,000 starts
        at 873, in block 54."""
        return self.first_read(computed) // block_size

    def blocks_held(self, computed: int, block_size: int) -> int:
        """Blocks the group holds between steps once ``computed`` positions are in the cache:
        from the first block the last computed position read through the last block (the
        release for the next query happens at the next call). Example above: position 999 read
        872 .. 999, blocks 54 .. 62: 9 blocks. Llama 4 (chunk 8,192) at 131,072 positions holds
        the whole last chunk, 512 blocks, though the next query starts a new chunk."""
        if computed <= 0:
            return 0
        return -(-computed // block_size) - self.first_read(computed - 1) // block_size

    def hit_blocks(self, hit: int, block_size: int) -> range:
        """The block indices a prefix hit of ``hit`` tokens (a multiple of ``block_size``) must
        find in the cache for this group: those covering what computing position ``hit`` reads,
        below ``hit``. Full attention: all of them; a window only its last ones; a chunked group
        none when ``hit`` is a chunk boundary."""
        return range(self.first_read(hit) // block_size, hit // block_size)


@dataclass(frozen=True)
class FullAttention(AttentionSpec):
    """Every position attends to all before it: nothing is ever released."""

    kind: ClassVar[str] = "full_attention"

    def first_read(self, q: int) -> int:
        return 0


@dataclass(frozen=True)
class SlidingWindow(AttentionSpec):
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


@dataclass(frozen=True)
class ChunkedLocalAttention(AttentionSpec):
    """A query at q reads its own chunk, floor(q/C)*C .. q (Llama 4: C = 8,192)."""

    chunk: int
    kind: ClassVar[str] = "chunked_local_attention"

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunk", int_at_least("chunk", self.chunk, 1))

    def first_read(self, q: int) -> int:
        return q - q % self.chunk


def check_groups(groups: Sequence[Any]) -> tuple[AttentionSpec, ...]:
    """A manager's ``groups`` argument: a non-empty sequence of specs, else ``ValueError``."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
        raise ValueError(f"groups must be a list of attention specs, got {type(groups).__name__}")
    if not groups:
        raise ValueError("groups must hold at least one attention spec (FullAttention() for a "
                         "uniform model)")
    for i, g in enumerate(groups):
        if not isinstance(g, AttentionSpec) or type(g) is AttentionSpec:
            raise ValueError(f"groups[{i}] is not an attention spec (FullAttention, SlidingWindow, "
                             f"ChunkedLocalAttention): {g!r}")
    return tuple(groups)
