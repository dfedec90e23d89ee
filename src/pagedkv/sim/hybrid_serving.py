"""Serving a hybrid model: one KV budget held uniformly (today's allocator) or by attention group.

Owns: how one GPU's KV budget becomes blocks for a hybrid model, uniform against grouped, and
the two paged allocators that serve it. Imports :mod:`pagedkv.sim.sizing` and
:mod:`pagedkv.sim.baselines`; knows nothing of the scheduler, the command line or the report.

A uniform allocator's block holds every layer's K/V of ``block_size`` tokens; a grouped one's
holds one KV cache group's layers (vLLM's equal pages, :func:`~pagedkv.sim.sizing.equal_page_groups`),
so the same bytes make more blocks, and each sequence keeps one table per group. gpt-oss-20b
(12 sliding-window layers of 128 tokens + 12 full, 8 KV heads of 64, bf16, block size 16): one
layer's block is 2 x 8 x 64 x 2 bytes x 16 tokens = 32 KiB, a uniform block 24 of them = 768 KiB,
a grouped one 12 = 384 KiB, so 1 GiB holds 1,365 uniform blocks or 2,730 grouped ones. A request
at 4,096 tokens holds 256 uniform blocks, and 256 (full) + 9 (sliding: what its last position
read) = 265 grouped ones: 265 x 384 / (256 x 768) = 51.8% of the bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..checks import int_at_least
from ..kv_specs import AttentionSpec
from .baselines import PagedAllocator
from .sizing import ModelSpec, equal_page_groups, kv_size

__all__ = ["HybridMemory", "hybrid_memory", "hybrid_allocators", "UNIFORM_NAME", "GROUPED_NAME"]

UNIFORM_NAME = "paged uniform"  # every layer keeps every block: today's allocator on a hybrid model
GROUPED_NAME = "paged grouped"  # one table per KV cache group, windows released as they move


@dataclass(frozen=True)
class HybridMemory:
    """One KV budget of a model, in blocks held two ways.

    ``uniform_block_bytes``: one block of every layer; ``grouped_block_bytes``: one block of one
    equal-page group (padding layers included); ``groups``: the attention spec of each group, in
    the order the manager's tables take them."""

    model: str
    budget_bytes: int
    block_size: int
    uniform_block_bytes: int
    grouped_block_bytes: int
    groups: tuple[AttentionSpec, ...]

    @property
    def uniform_blocks(self) -> int:
        return self.budget_bytes // self.uniform_block_bytes

    @property
    def grouped_blocks(self) -> int:
        return self.budget_bytes // self.grouped_block_bytes


def hybrid_memory(spec: ModelSpec, budget_bytes: int, *, block_size: int = 16, dtype: str | None = None,
                  tp: int = 1) -> HybridMemory:
    """``budget_bytes`` of ``spec``'s KV as uniform and as grouped blocks (see the module
    docstring: gpt-oss-20b, 1 GiB, block size 16 -> 1,365 uniform and 2,730 grouped blocks,
    groups ``(SlidingWindow(128), FullAttention())``). A uniform model has one group, and the
    same block count both ways."""
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    budget_bytes = int_at_least("budget_bytes", budget_bytes, 1)
    block_size = int_at_least("block_size", block_size, 1)
    size = kv_size(spec, dtype=dtype, tp=tp, block_size=block_size)
    layer_block = size.bytes_per_block // spec.num_layers
    pages = equal_page_groups(spec)
    return HybridMemory(spec.name, budget_bytes, block_size, size.bytes_per_block,
                        layer_block * (pages[0].layers + pages[0].padding),
                        tuple(p.attention for p in pages))


def hybrid_allocators(memory: HybridMemory, **paged_kw) -> tuple[PagedAllocator, PagedAllocator]:
    """The uniform and the grouped paged allocator over ``memory``'s budget (``paged_kw``, such as
    ``enable_prefix_caching`` or ``watermark``, go to both). Either has at least one block."""
    if not isinstance(memory, HybridMemory):
        raise ValueError(f"memory must be a HybridMemory, got {type(memory).__name__}")
    if memory.uniform_blocks < 1:
        raise ValueError(f"{memory.budget_bytes:,} bytes hold no block of {memory.model} "
                         f"({memory.uniform_block_bytes:,} bytes uniform)")
    uniform = PagedAllocator(memory.uniform_blocks, memory.block_size, name=UNIFORM_NAME, **paged_kw)
    grouped = PagedAllocator(memory.grouped_blocks, memory.block_size, name=GROUPED_NAME,
                             groups=list(memory.groups), **paged_kw)
    return uniform, grouped
