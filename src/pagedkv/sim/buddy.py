"""A binary buddy allocator over ``num_slots`` token slots: how reservation systems place KV.

Why it exists: a serving system that *reserves* KV memory per request (Orca-style) must put each
reservation in one contiguous range, because its attention kernel reads a sequence's keys and
values as one strided tensor. Contiguity is what creates external fragmentation, and a buddy
allocator is the classic allocator for it (power-of-two orders, split on allocation, merge on
free). Running a real one means external fragmentation is *measured*, not assumed.

Classic placement (the default, and the one the vLLM paper assumes for Orca, §6.1 and §6.5):
``alloc(size)`` holds the whole block of order ``ceil(log2(size))``, so a 132-slot reservation
holds 256 slots and the 124 it rounded up are internal fragmentation of that reservation.

``exact=True`` is an extra placement model, not the paper's: the block's unused tail goes back to
the free lists at once as aligned power-of-two pieces (the ``alloc_pages_exact`` trick of the
Linux kernel), so a 500-slot request holds 500 slots and the other 12 (pieces of 8 and 4) can
serve small requests, merging back when the 500 are freed.

Worked example: ``BuddyAllocator(24)`` starts with free blocks 16@0 and 8@16 (24 is not a power of
two, so the arena is its binary decomposition). ``alloc(5)`` needs order 3 (8 >= 5); the only
order-3 block is 8@16, so it holds slots 16..23. ``unusable_free(32)`` is then 16: no free block
can hold 32 slots. With ``exact=True`` the same ``alloc(5)`` keeps 16..20 and frees the tail
21..23 as 1@21 and 2@22; ``unusable_free(16)`` is then 3 (the 16@0 block can serve 16).
"""
from __future__ import annotations

from ..checks import int_at_least

__all__ = ["BuddyAllocator", "order_for", "aligned_pieces"]


def order_for(size: int) -> int:
    """Smallest order ``k`` with ``2**k >= size`` (``size`` >= 1). ``order_for(500) == 9``."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    return (size - 1).bit_length()


def aligned_pieces(start: int, end: int) -> list[tuple[int, int]]:
    """Split ``[start, end)`` into the fewest aligned power-of-two blocks ``(offset, order)``.

    Every piece starts at a multiple of its own size, which is what lets a buddy allocator take
    it back. ``aligned_pieces(21, 24) == [(21, 0), (22, 1)]``.
    """
    if not 0 <= start <= end:
        raise ValueError(f"need 0 <= start <= end, got {start}, {end}")
    out = []
    x = start
    while x < end:
        k = (x & -x).bit_length() - 1 if x else (end - x).bit_length() - 1
        while (1 << k) > end - x:
            k -= 1
        out.append((x, k))
        x += 1 << k
    return out


class BuddyAllocator:
    """Binary buddy allocator over slots ``0 .. num_slots-1``; see the module docstring.

    ``alloc(size) -> offset | None`` (None: no free block of the needed order; nothing changed),
    ``free(offset)``. Free blocks live in one set per order plus an ``offset -> order`` map, so a
    buddy lookup on free is O(1); the lowest free offset of an order is taken first, which keeps
    placement deterministic and compact.
    """

    def __init__(self, num_slots: int, exact: bool = False) -> None:
        num_slots = int_at_least("num_slots", num_slots, 1, expected="a positive int")
        self.num_slots = num_slots
        self.exact = exact
        self.max_order = num_slots.bit_length() - 1
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._free_at: dict[int, int] = {}  # offset -> order of every free block
        self._alloc: dict[int, int] = {}  # offset -> slots held by that allocation
        self._version = 0  # bumped by every change of the free lists (memo key of unusable_free)
        self._unusable: tuple[int, int, int] = (-1, -1, 0)  # (order, version, result)
        self.free_slots = 0
        for off, k in aligned_pieces(0, num_slots):
            self._push(off, k)

    # ---- free-list primitives

    def _push(self, off: int, k: int) -> None:
        self._free[k].add(off)
        self._free_at[off] = k
        self.free_slots += 1 << k
        self._version += 1

    def _pop(self, off: int, k: int) -> None:
        self._free[k].remove(off)
        del self._free_at[off]
        self.free_slots -= 1 << k
        self._version += 1

    def _release(self, off: int, k: int) -> None:
        """Free one aligned block, merging with its buddy as long as the buddy is free."""
        while k < self.max_order:
            buddy = off ^ (1 << k)
            if self._free_at.get(buddy) != k:
                break
            self._pop(buddy, k)
            off = min(off, buddy)
            k += 1
        self._push(off, k)

    # ---- public API

    @property
    def allocated_slots(self) -> int:
        return self.num_slots - self.free_slots

    @property
    def num_allocations(self) -> int:
        return len(self._alloc)

    def alloc(self, size: int) -> int | None:
        """Reserve ``size`` contiguous slots; the offset, or None when no block of the order is free.

        Classic mode (the default) holds the whole ``2**order_for(size)``; exact mode holds exactly
        ``size`` slots (the tail of the power-of-two block is freed at once).
        """
        size = int_at_least("size", size, 1, expected="a positive int")
        k = order_for(size)
        free = self._free
        for j in range(k, self.max_order + 1):
            if free[j]:
                break
        else:
            return None  # also when k > max_order: the arena has no block that large
        off = min(free[j])
        self._pop(off, j)
        while j > k:  # split: keep the lower half, free the upper
            j -= 1
            self._push(off + (1 << j), j)
        held = size if self.exact else 1 << k
        for piece, pk in aligned_pieces(off + held, off + (1 << k)):
            self._release(piece, pk)
        self._alloc[off] = held
        return off

    def free(self, offset: int) -> None:
        """Return an allocation made by :meth:`alloc`; its pieces merge with free buddies."""
        held = self._alloc.pop(offset, None)
        if held is None:
            raise ValueError(f"no allocation at offset {offset}")
        for piece, k in aligned_pieces(offset, offset + held):
            self._release(piece, k)

    def size_of(self, offset: int) -> int:
        """Slots held by the allocation at ``offset`` (KeyError if none)."""
        return self._alloc[offset]

    def free_blocks(self) -> dict[int, int]:
        """``order -> number of free blocks`` (non-empty orders only)."""
        return {k: len(s) for k, s in enumerate(self._free) if s}

    def largest_free(self) -> int:
        """Size of the largest free block (0 when full): the biggest request that would succeed."""
        k = next((k for k in range(self.max_order, -1, -1) if self._free[k]), None)
        return 0 if k is None else 1 << k

    def can_alloc(self, size: int) -> bool:
        k = order_for(size)
        return k <= self.max_order and any(self._free[j] for j in range(k, self.max_order + 1))

    def unusable_free(self, size: int) -> int:
        """Free slots that cannot serve a request of ``size``: external fragmentation for it.

        They sit in free blocks of an order below ``order_for(size)``, and a buddy allocator never
        joins two blocks that are not buddies, however close they lie. Worked example: free blocks
        4@0 and 4@8 (buddies of allocated blocks) are 8 free slots, all unusable for ``size=8``.
        """
        k = order_for(size)
        order, version, result = self._unusable
        if order == k and version == self._version:  # asked every step while a request waits
            return result
        result = 0
        for j in range(min(k, self.max_order + 1)):
            result += len(self._free[j]) << j
        self._unusable = (k, self._version, result)
        return result

    def check(self) -> None:
        """Raise AssertionError unless allocations and free blocks tile ``[0, num_slots)`` exactly,
        every free block is aligned, and no two free buddies of one order are left unmerged."""
        spans = [(o, 1 << k) for o, k in self._free_at.items()] + list(self._alloc.items())
        spans.sort()
        pos = 0
        for o, n in spans:
            assert o == pos, f"gap or overlap at slot {pos} (next span starts at {o})"
            pos = o + n
        assert pos == self.num_slots, f"spans end at {pos}, arena has {self.num_slots}"
        for o, k in self._free_at.items():
            assert o % (1 << k) == 0, f"free block {o} of order {k} is misaligned"
            assert o in self._free[k]
            assert self._free_at.get(o ^ (1 << k)) != k or k == self.max_order, (
                f"free buddies {o} and {o ^ (1 << k)} of order {k} were not merged")
        assert sum(len(s) for s in self._free) == len(self._free_at)
        assert self.free_slots == sum(1 << k for k in self._free_at.values())
