"""The buddy allocator: tiling, alignment, split/merge, exact tails, fragmentation accounting.

Tolerances: none; every check is exact (slot counts are integers).
"""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.sim.buddy import BuddyAllocator, aligned_pieces, order_for


def test_worked_example_from_docstring():
    """Classic placement (the default, the vLLM paper's assumption for Orca) holds the whole block."""
    b = BuddyAllocator(24)
    assert b.exact is False
    assert b.free_blocks() == {4: 1, 3: 1}
    assert b.alloc(5) == 16
    assert b.size_of(16) == 8  # 5 rounded up to 2**3
    assert b.free_slots == 16 and b.free_blocks() == {4: 1}
    assert b.unusable_free(32) == 16 and b.unusable_free(16) == 0
    b.free(16)
    assert b.free_blocks() == {4: 1, 3: 1} and b.free_slots == 24
    b.check()


def test_worked_example_exact_placement():
    """The extra model (not the paper's): the tail of the block goes back at once."""
    b = BuddyAllocator(24, exact=True)
    assert b.alloc(5) == 16
    assert b.size_of(16) == 5
    assert b.free_slots == 19
    assert b.free_blocks() == {4: 1, 0: 1, 1: 1}  # 1@21 and 2@22
    assert b.unusable_free(16) == 3  # 1@21 and 2@22 cannot hold 16; 16@0 can
    b.check()


def test_classic_reservation_of_the_paper_example():
    """Pow2 for prompt 100 + output 25 reserves 132 slots; a classic buddy holds 256 of them."""
    b = BuddyAllocator(1024)
    off = b.alloc(132)
    assert off == 0 and b.size_of(off) == 256 and b.allocated_slots == 256
    assert b.alloc(125) == 256 and b.size_of(256) == 128  # Oracle's 125 holds 128
    assert b.free_blocks() == {7: 1, 9: 1}  # 128@384 and 512@512 are left
    b.check()


def test_order_and_pieces():
    assert [order_for(s) for s in (1, 2, 3, 4, 5, 500, 512, 513)] == [0, 1, 2, 2, 3, 9, 9, 10]
    assert aligned_pieces(21, 24) == [(21, 0), (22, 1)]
    assert aligned_pieces(0, 24) == [(0, 4), (16, 3)]
    assert aligned_pieces(5, 5) == []
    with pytest.raises(ValueError):
        order_for(0)
    with pytest.raises(ValueError):
        aligned_pieces(4, 3)


@given(st.integers(0, 5000), st.integers(0, 5000))
def test_aligned_pieces_tile_and_align(a, b):
    start, end = min(a, b), max(a, b)
    pos = start
    for off, k in aligned_pieces(start, end):
        assert off == pos and off % (1 << k) == 0
        pos += 1 << k
    assert pos == end


def test_exact_vs_classic():
    exact, classic = BuddyAllocator(1024, exact=True), BuddyAllocator(1024)
    assert exact.alloc(300) == 0 and classic.alloc(300) == 0
    assert exact.allocated_slots == 300 and classic.allocated_slots == 512
    # the exact tail (212 slots) serves small requests; classic has none of it left
    assert exact.alloc(200) is not None and exact.alloc(200) is not None
    assert classic.alloc(200) is not None and classic.alloc(200) is not None
    assert classic.alloc(200) is None


def test_alloc_failure_changes_nothing():
    b = BuddyAllocator(100)
    before = (b.free_blocks(), b.free_slots)
    assert b.alloc(128) is None  # larger than the arena's largest block (64)
    assert b.alloc(65) is None
    assert (b.free_blocks(), b.free_slots) == before
    assert b.largest_free() == 64


def test_max_reservations_leave_external_fragmentation():
    """The vLLM paper's memory (15,728 slots) holds 7 Max reservations; 1,392 slots never fit one."""
    b = BuddyAllocator(15_728)
    offs = [b.alloc(2048) for _ in range(8)]
    assert offs[-1] is None and None not in offs[:7]
    assert b.free_slots == 1_392 == b.unusable_free(2048)
    assert b.unusable_free(16) == 0  # every free block holds 16


def test_bad_arguments():
    with pytest.raises(ValueError):
        BuddyAllocator(0)
    b = BuddyAllocator(64)
    with pytest.raises(ValueError):
        b.alloc(0)
    with pytest.raises(ValueError):
        b.free(3)


def _brute_unusable(b: BuddyAllocator, size: int) -> int:
    k = order_for(size)
    return sum((1 << o) * n for o, n in b.free_blocks().items() if o < k)


class BuddyMachine(RuleBasedStateMachine):
    """Random alloc/free sequences against a model of the live allocations."""

    @initialize(n=st.integers(1, 3000), exact=st.booleans())
    def make(self, n, exact):
        self.b = BuddyAllocator(n, exact=exact)
        self.initial = self.b.free_blocks()
        self.live: dict[int, int] = {}  # offset -> requested size

    @rule(size=st.integers(1, 700))
    def alloc(self, size):
        could = self.b.can_alloc(size)
        off = self.b.alloc(size)
        assert (off is not None) == could
        if off is not None:
            assert off not in self.live
            assert off % (1 << order_for(size)) == 0  # placed at an aligned block of its order
            held = self.b.size_of(off)
            assert held == (size if self.b.exact else 1 << order_for(size))
            self.live[off] = held

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        off = data.draw(st.sampled_from(sorted(self.live)))
        self.b.free(off)
        del self.live[off]

    @rule(size=st.integers(1, 4096))
    def fragmentation(self, size):
        u = self.b.unusable_free(size)
        assert u == _brute_unusable(self.b, size)
        assert 0 <= u <= self.b.free_slots
        if not self.b.can_alloc(size):  # nothing can serve it: every free slot is unusable for it
            assert u == self.b.free_slots

    @invariant()
    def tiles_and_counts(self):
        self.b.check()  # allocations and free blocks tile the arena: no overlap, no gap
        assert self.b.allocated_slots == sum(self.live.values())
        spans = sorted(self.live.items())
        for (o1, n1), (o2, _) in zip(spans, spans[1:]):
            assert o1 + n1 <= o2

    def teardown(self):
        if hasattr(self, "b"):
            for off in list(self.live):
                self.b.free(off)
            assert self.b.free_blocks() == self.initial  # merging restores the initial arena
            assert self.b.free_slots == self.b.num_slots


TestBuddyMachine = BuddyMachine.TestCase


@pytest.mark.parametrize("call, match", [
    (lambda: BuddyAllocator(True), "num_slots must be a positive int"),
    (lambda: BuddyAllocator(64).alloc(True), "size must be a positive int"),
])
def test_bools_are_not_sizes(call, match):
    """``True`` is an int to Python but never a slot count: refused like any non-int."""
    with pytest.raises(ValueError, match=match):
        call()
