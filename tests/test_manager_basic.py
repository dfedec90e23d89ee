"""KVCacheManager: admission, append, fork, copy-on-write, free, atomic failure, exports, usage.

Exact expectations throughout: a fresh manager hands out blocks 0, 1, 2, ... in order; clean free
blocks are a LIFO stack; ``free`` releases the table tail first. Prompts are made of distinct
token ids (``toks``) unless a test is about sharing, so no prefix hit happens by accident.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from pagedkv import CopyOp, KVCacheManager, OutOfBlocks, Usage
from conftest import snapshot, toks

MAX_TOKEN = 2**32 - 1


def mk(num_blocks=8, block_size=4, **kw):
    return KVCacheManager(num_blocks=num_blocks, block_size=block_size, **kw)


def settle(m, seq_ids):
    """Drain pending events/copies, then snapshot: the state a failing call must preserve."""
    m.take_events()
    m.take_copies()
    return snapshot(m, seq_ids)


def assert_failed_cleanly(m, before, seq_ids):
    """After a failed call: same snapshot, no queued copies, no events."""
    assert snapshot(m, seq_ids) == before
    assert m.take_copies() == []
    assert m.take_events() == []
    m.check_invariants()


# ---------------------------------------------------------------- construction and validation


def test_constructor_properties():
    """The constructor's sizes are readable back; a fresh manager is empty and all free."""
    m = mk(num_blocks=12, block_size=16)
    assert (m.num_blocks, m.block_size, m.num_free_blocks, m.num_sequences) == (12, 16, 12, 0)
    assert m.take_copies() == [] and m.take_events() == []
    m.check_invariants()


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_blocks=0, block_size=4),
        dict(num_blocks=-3, block_size=4),
        dict(num_blocks=4, block_size=0),
        dict(num_blocks=4, block_size=-1),
        dict(num_blocks=4, block_size=4, hash_algo="md5"),
        dict(num_blocks=4, block_size=4, hash_algo=""),
    ],
)
def test_bad_constructor_args(kw):
    """num_blocks < 1, block_size < 1 or an unknown hash algorithm is a ValueError."""
    with pytest.raises(ValueError):
        KVCacheManager(**kw)


@pytest.mark.parametrize("algo", ["sha256", "builtin", "xxh3"])
def test_every_hash_algo_constructs(algo):
    """All three documented hash algorithms are accepted."""
    if algo == "xxh3":
        pytest.importorskip("xxhash")
    m = mk(hash_algo=algo)
    assert m.add_sequence("a", toks(0, 5)) == 0


@pytest.mark.parametrize(
    "prompt", [[], [-1], [1, 2, -5], [MAX_TOKEN + 1], [1.5], ["a"], [None], [2**70]]
)
def test_add_sequence_rejects_bad_prompt(prompt):
    """An empty prompt or a token id that is negative, non-integer or > 2**32-1 is a ValueError,
    and nothing is admitted."""
    m = mk()
    m.add_sequence("x", toks(0, 3))
    before = settle(m, ["x"])
    with pytest.raises(ValueError):
        m.add_sequence("bad", prompt)
    assert "bad" not in m
    assert_failed_cleanly(m, before, ["x"])


def test_token_id_range_limits_accepted():
    """0 and 2**32-1 are valid token ids; numpy integer arrays are valid prompts."""
    m = mk()
    m.add_sequence("a", [0, MAX_TOKEN])
    m.append_token("a", MAX_TOKEN)
    m.add_sequence("b", np.array([5, 6, 7], dtype=np.int64))
    m.append_token("b", np.int32(8))
    assert m.tokens("a") == [0, MAX_TOKEN, MAX_TOKEN]
    assert m.tokens("b") == [5, 6, 7, 8]


def test_duplicate_id_is_value_error():
    """Admitting an id that is already live is a ValueError and changes nothing."""
    m = mk()
    m.add_sequence("a", toks(0, 5))
    before = settle(m, ["a"])
    with pytest.raises(ValueError):
        m.add_sequence("a", toks(100, 3))
    assert m.tokens("a") == toks(0, 5)
    assert_failed_cleanly(m, before, ["a"])


def test_unknown_ids_are_key_errors():
    """Every call naming a sequence that does not exist raises KeyError and changes nothing."""
    m = mk()
    m.add_sequence("a", toks(0, 5))
    before = settle(m, ["a"])
    calls = [
        lambda: m.append_token("nope", 1),
        lambda: m.append_tokens("nope", [1, 2]),
        lambda: m.append_batch(["a", "nope"], [1, 2]),
        lambda: m.fork("nope", "child"),
        lambda: m.free("nope"),
        lambda: m.block_table("nope"),
        lambda: m.num_tokens("nope"),
        lambda: m.tokens("nope"),
        lambda: m.block_tables(["a", "nope"]),
        lambda: m.flashinfer_layout(["nope"]),
    ]
    for call in calls:
        with pytest.raises(KeyError):
            call()
        assert_failed_cleanly(m, before, ["a"])
    assert "child" not in m


@pytest.mark.parametrize("bad", [-1, MAX_TOKEN + 1, 2.0, "7", None])
def test_append_rejects_bad_tokens(bad):
    """append_token / append_tokens / append_batch reject a bad token id with ValueError and
    append nothing, not even the valid tokens before it."""
    m = mk()
    m.add_sequence("a", toks(0, 3))
    m.add_sequence("b", toks(100, 4))
    before = settle(m, ["a", "b"])
    with pytest.raises(ValueError):
        m.append_token("a", bad)
    assert_failed_cleanly(m, before, ["a", "b"])
    with pytest.raises(ValueError):
        m.append_tokens("a", [1, 2, bad])
    assert_failed_cleanly(m, before, ["a", "b"])
    with pytest.raises(ValueError):
        m.append_batch(["a", "b"], [1, bad])
    assert_failed_cleanly(m, before, ["a", "b"])


# ---------------------------------------------------------------- admission and append


def test_add_allocates_blocks_in_order():
    """add_sequence allocates ceil(len/bs) blocks, fresh ones in order 0, 1, 2, ..."""
    m = mk()
    assert m.add_sequence("a", toks(0, 10)) == 0
    assert m.add_sequence("b", toks(100, 4)) == 0
    assert m.block_table("a") == [0, 1, 2]
    assert m.block_table("b") == [3]
    assert (m.num_tokens("a"), m.num_tokens("b")) == (10, 4)
    assert m.tokens("a") == toks(0, 10)
    assert [m.refcount(b) for b in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert m.num_free_blocks == 4
    assert m.num_sequences == 2 and "a" in m and "b" in m and "c" not in m
    assert m.take_copies() == []
    m.check_invariants()


def test_integer_sequence_ids():
    """Sequence ids need only be hashable: integers work like strings."""
    m = mk()
    m.add_sequence(7, toks(0, 5))
    m.fork(7, 8)
    m.append_token(8, 1)
    assert 7 in m and 8 in m
    assert m.block_tables([7, 8]).shape == (2, 2)


def test_append_token_slots():
    """append_token returns block_id * block_size + offset and opens a new block when full."""
    m = mk()
    m.add_sequence("a", toks(0, 10))  # [0, 1, 2], 2 tokens in block 2
    assert m.append_token("a", 50) == 2 * 4 + 2
    assert m.append_token("a", 51) == 2 * 4 + 3
    assert m.num_free_blocks == 5
    assert m.append_token("a", 52) == 3 * 4 + 0  # block 2 full: fresh block 3
    assert m.block_table("a") == [0, 1, 2, 3]
    assert m.num_tokens("a") == 13
    assert m.tokens("a") == toks(0, 10) + [50, 51, 52]
    assert m.num_free_blocks == 4
    assert m.take_copies() == []
    m.check_invariants()


def test_append_tokens_slots_cross_blocks():
    """append_tokens returns one slot per token, consecutive across freshly opened blocks."""
    m = mk()
    m.add_sequence("a", toks(0, 3))  # [0]
    slots = m.append_tokens("a", toks(50, 6))
    assert list(slots) == [3, 4, 5, 6, 7, 8]
    assert m.block_table("a") == [0, 1, 2]
    assert m.num_tokens("a") == 9
    assert m.tokens("a") == toks(0, 3) + toks(50, 6)
    m.check_invariants()


def test_block_table_is_a_copy():
    """Mutating the list block_table returns does not corrupt the manager."""
    m = mk()
    m.add_sequence("a", toks(0, 5))
    t = m.block_table("a")
    t.append(99)
    t[0] = 42
    assert m.block_table("a") == [0, 1]
    m.check_invariants()


# ---------------------------------------------------------------- fork and copy-on-write


def test_fork_shares_every_block_without_allocating():
    """fork copies the table, increments each block's refcount, allocates and copies nothing."""
    m = mk()
    m.add_sequence("a", toks(0, 10))
    free = m.num_free_blocks
    m.fork("a", "b")
    assert m.block_table("b") == [0, 1, 2]
    assert m.tokens("b") == toks(0, 10) and m.num_tokens("b") == 10
    assert [m.refcount(b) for b in range(3)] == [2, 2, 2]
    assert m.num_free_blocks == free
    assert m.take_copies() == []
    assert m.usage().forks == 1
    m.check_invariants()


def test_fork_succeeds_with_no_free_block():
    """fork never allocates, so it works even when the pool is exhausted."""
    m = mk(num_blocks=2)
    m.add_sequence("a", toks(0, 8))  # both blocks
    assert m.num_free_blocks == 0
    m.fork("a", "b")
    m.fork("b", "c")
    assert m.block_table("c") == [0, 1]
    assert m.refcount(0) == 3 and m.refcount(1) == 3
    m.check_invariants()


def test_fork_errors():
    """Forking into an existing id (including the parent's own) is a ValueError."""
    m = mk()
    m.add_sequence("a", toks(0, 5))
    m.add_sequence("b", toks(100, 5))
    before = settle(m, ["a", "b"])
    for child in ["b", "a"]:
        with pytest.raises(ValueError):
            m.fork("a", child)
        assert_failed_cleanly(m, before, ["a", "b"])


def test_cow_on_first_write_into_shared_partial_block():
    """The first append into a shared, partially filled block allocates a new block, queues
    CopyOp(old, new), drops one reference to the old one and writes into the new one; the other
    holder, now the last, writes in place."""
    m = mk()
    m.add_sequence("a", toks(0, 10))  # [0, 1, 2]
    m.fork("a", "b")
    assert m.append_token("b", 99) == 3 * 4 + 2
    assert m.block_table("b") == [0, 1, 3]
    assert m.block_table("a") == [0, 1, 2]
    assert m.take_copies() == [CopyOp(src=2, dst=3)]
    assert m.take_copies() == []  # drained
    assert [m.refcount(b) for b in range(4)] == [2, 2, 1, 1]
    # a is now the last holder of block 2: in place, no copy
    assert m.append_token("a", 77) == 2 * 4 + 2
    assert m.block_table("a") == [0, 1, 2]
    assert m.take_copies() == []
    assert m.tokens("a") == toks(0, 10) + [77]
    assert m.tokens("b") == toks(0, 10) + [99]
    assert m.usage().cow_copies == 1
    m.check_invariants()


def test_cow_parent_writes_first():
    """Copy-on-write does not favour the parent: whoever writes first gets the copy."""
    m = mk()
    m.add_sequence("a", toks(0, 6))  # [0, 1]
    m.fork("a", "b")
    assert m.append_token("a", 1) == 2 * 4 + 2
    assert m.block_table("a") == [0, 2]
    assert m.take_copies() == [CopyOp(1, 2)]
    assert m.append_token("b", 2) == 1 * 4 + 2
    assert m.block_table("b") == [0, 1]
    assert m.take_copies() == []


def test_cow_via_append_tokens():
    """append_tokens into a shared partial block copies it once, then fills fresh blocks."""
    m = mk()
    m.add_sequence("a", toks(0, 10))  # [0, 1, 2]
    m.fork("a", "b")
    slots = m.append_tokens("b", toks(50, 5))
    assert list(slots) == [3 * 4 + 2, 3 * 4 + 3, 4 * 4 + 0, 4 * 4 + 1, 4 * 4 + 2]
    assert m.block_table("b") == [0, 1, 3, 4]
    assert m.take_copies() == [CopyOp(2, 3)]
    assert m.refcount(2) == 1
    m.check_invariants()


def test_no_cow_when_shared_last_block_is_full():
    """Appending after a fork whose last block is full opens a fresh block and copies nothing;
    the full shared block is never written again."""
    m = mk()
    m.add_sequence("a", toks(0, 8))  # [0, 1], both full
    m.fork("a", "b")
    assert m.append_token("b", 1) == 2 * 4
    assert m.append_token("a", 2) == 3 * 4
    assert m.take_copies() == []
    assert m.block_table("a") == [0, 1, 3]
    assert m.block_table("b") == [0, 1, 2]
    assert [m.refcount(b) for b in range(4)] == [2, 2, 1, 1]
    assert m.usage().cow_copies == 0
    m.check_invariants()


@pytest.mark.parametrize("order", list(itertools.permutations(["p", "c1", "c2", "c3"])))
def test_many_children_only_last_writer_keeps_original(order):
    """Parent + 3 children share a partial block: each of the first 3 writers (in any order)
    copies it into the next fresh block; the last writer writes in place into the original."""
    m = mk(num_blocks=8)
    m.add_sequence("p", toks(0, 6))  # [0, 1]; block 1 holds 2 tokens
    for c in ["c1", "c2", "c3"]:
        m.fork("p", c)
    assert m.refcount(1) == 4
    for i, sid in enumerate(order[:3]):
        new = 2 + i
        assert m.append_token(sid, 100 + i) == new * 4 + 2
        assert m.take_copies() == [CopyOp(1, new)]
        assert m.block_table(sid) == [0, new]
        assert m.refcount(1) == 3 - i
    last = order[3]
    assert m.append_token(last, 200) == 1 * 4 + 2
    assert m.take_copies() == []
    assert m.block_table(last) == [0, 1]
    assert m.refcount(1) == 1 and m.refcount(0) == 4
    assert m.usage().cow_copies == 3
    m.check_invariants()


# ---------------------------------------------------------------- free


def test_free_releases_tail_first():
    """free releases the table tail first, so the next allocations return the freed blocks in
    table order (caching off: every freed block is clean)."""
    m = mk(enable_prefix_caching=False)
    m.add_sequence("x", toks(0, 4))  # [0]
    m.add_sequence("a", toks(10, 12))  # [1, 2, 3]
    m.free("a")
    assert "a" not in m and m.num_sequences == 1
    assert m.num_free_blocks == 7
    m.add_sequence("b", toks(20, 1))
    m.add_sequence("c", toks(30, 1))
    m.add_sequence("d", toks(40, 1))
    m.add_sequence("e", toks(50, 1))
    assert [m.block_table(s) for s in "bcde"] == [[1], [2], [3], [4]]
    m.check_invariants()


def test_free_unknown_and_double_free():
    """Freeing an unknown or already freed id is a KeyError and changes nothing."""
    m = mk()
    m.add_sequence("a", toks(0, 5))
    m.add_sequence("b", toks(10, 5))
    m.free("a")
    before = settle(m, ["b"])
    with pytest.raises(KeyError):
        m.free("a")
    assert_failed_cleanly(m, before, ["b"])


def test_freed_id_can_be_reused():
    """After free, the same id can be admitted again."""
    m = mk()
    m.add_sequence("a", toks(0, 5))
    m.free("a")
    m.add_sequence("a", toks(10, 5))
    assert m.tokens("a") == toks(10, 5)


@pytest.mark.parametrize("order", list(itertools.permutations(["a", "b", "c"])))
def test_free_in_any_order(order):
    """Parent and children can be freed in any order: refcounts follow the remaining tables and
    a block becomes free exactly when its last holder goes."""
    m = mk(num_blocks=8)
    m.add_sequence("a", toks(0, 10))  # [0, 1, 2]
    m.fork("a", "b")
    m.fork("a", "c")
    m.append_token("b", 1)  # b: [0, 1, 3]
    m.take_copies()
    live = {"a", "b", "c"}
    for sid in order:
        m.free(sid)
        live.remove(sid)
        counts = [0] * 8
        for s in live:
            for blk in m.block_table(s):
                counts[blk] += 1
        assert [m.refcount(blk) for blk in range(8)] == counts
        assert m.num_free_blocks == 8 - sum(1 for c in counts if c)
        m.check_invariants()
    assert m.num_free_blocks == 8 and m.num_sequences == 0
    assert m.usage().used_blocks == 0


# ---------------------------------------------------------------- exhaustion and atomic failure


def test_exhaustion_and_recovery():
    """When the pool is empty, admission fails with OutOfBlocks(needed, available); freeing a
    sequence makes room and its blocks are reused."""
    m = mk(num_blocks=4, enable_prefix_caching=False)
    m.add_sequence("a", toks(0, 8))  # [0, 1]
    m.add_sequence("b", toks(10, 8))  # [2, 3]
    before = settle(m, ["a", "b"])
    with pytest.raises(OutOfBlocks) as ei:
        m.add_sequence("c", toks(20, 1))
    assert (ei.value.needed, ei.value.available) == (1, 0)
    assert "c" not in m
    assert_failed_cleanly(m, before, ["a", "b"])
    m.free("a")
    with pytest.raises(OutOfBlocks) as ei:
        m.add_sequence("c", toks(20, 9))
    assert (ei.value.needed, ei.value.available) == (3, 2)
    m.add_sequence("c", toks(20, 5))
    assert m.block_table("c") == [0, 1]
    assert m.num_free_blocks == 0
    m.check_invariants()


def test_out_of_blocks_is_a_runtime_error_with_fields():
    """OutOfBlocks carries needed/available and survives pickling (multiprocess engines)."""
    import pickle

    e = OutOfBlocks(5, 2)
    assert isinstance(e, RuntimeError)
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.needed, e2.available) == (5, 2)


def test_append_token_out_of_blocks_is_atomic():
    """append_token needing a fresh block when none is free fails and changes nothing."""
    m = mk(num_blocks=2)
    m.add_sequence("a", toks(0, 8))
    before = settle(m, ["a"])
    with pytest.raises(OutOfBlocks) as ei:
        m.append_token("a", 1)
    assert (ei.value.needed, ei.value.available) == (1, 0)
    assert_failed_cleanly(m, before, ["a"])


def test_cow_out_of_blocks_is_atomic():
    """A copy-on-write that cannot get its block fails without touching the shared block's
    refcount, the tables or the copy queue."""
    m = mk(num_blocks=3)
    m.add_sequence("a", toks(0, 6))  # [0, 1]
    m.fork("a", "b")
    m.add_sequence("c", toks(10, 1))  # [2]: pool now full
    before = settle(m, ["a", "b", "c"])
    for call in (lambda: m.append_token("b", 5), lambda: m.append_tokens("b", [5])):
        with pytest.raises(OutOfBlocks) as ei:
            call()
        assert (ei.value.needed, ei.value.available) == (1, 0)
        assert_failed_cleanly(m, before, ["a", "b", "c"])
    assert m.refcount(1) == 2
    m.free("c")
    assert m.append_token("b", 5) == 2 * 4 + 2
    assert m.take_copies() == [CopyOp(1, 2)]


def test_append_tokens_out_of_blocks_is_atomic():
    """append_tokens that would need more blocks than are free appends nothing (no partial
    append, no block published even though the first block would have filled)."""
    m = mk(num_blocks=2)
    m.add_sequence("a", toks(0, 6))  # [0, 1]
    m.take_events()
    before = settle(m, ["a"])
    with pytest.raises(OutOfBlocks) as ei:
        m.append_tokens("a", toks(50, 3))  # fills block 1, needs one more
    assert (ei.value.needed, ei.value.available) == (1, 0)
    assert_failed_cleanly(m, before, ["a"])
    assert list(m.append_tokens("a", toks(50, 2))) == [6, 7]


# ---------------------------------------------------------------- append_batch


def test_append_batch_slots_and_dtype():
    """append_batch appends one token per sequence and returns their slots as np.int64, in the
    order given."""
    m = mk()
    m.add_sequence("a", toks(0, 10))  # [0, 1, 2]
    m.add_sequence("b", toks(100, 4))  # [3]
    m.add_sequence("c", toks(200, 5))  # [4, 5]
    slots = m.append_batch(["c", "a", "b"], [7, 8, 9])
    assert isinstance(slots, np.ndarray) and slots.dtype == np.int64
    assert slots.tolist() == [5 * 4 + 1, 2 * 4 + 2, 6 * 4 + 0]
    assert m.block_table("b") == [3, 6]
    assert m.tokens("a")[-1] == 8 and m.tokens("b")[-1] == 9 and m.tokens("c")[-1] == 7
    assert m.take_copies() == []
    m.check_invariants()


def test_append_batch_accepts_numpy_tokens():
    """Token ids may come as a numpy array (what a sampler produces)."""
    m = mk()
    m.add_sequence("a", toks(0, 3))
    m.add_sequence("b", toks(10, 3))
    slots = m.append_batch(["a", "b"], np.array([5, 6], dtype=np.int64))
    assert slots.tolist() == [3, 7]
    assert m.tokens("a")[-1] == 5 and m.tokens("b")[-1] == 6


def test_append_batch_sequential_cow_needs_one_block():
    """A parent and its child both in one batch, sharing a partial block: the first writer in
    batch order copies, the second is then the last holder and writes in place, so the step
    needs exactly one block."""
    m = mk(num_blocks=4, enable_prefix_caching=False)
    m.add_sequence("p", toks(0, 6))  # [0, 1]
    m.fork("p", "c")
    m.add_sequence("d", toks(10, 4))  # [2]; one block (3) left
    slots = m.append_batch(["p", "c"], [1, 2])
    assert slots.tolist() == [3 * 4 + 2, 1 * 4 + 2]
    assert m.take_copies() == [CopyOp(1, 3)]
    assert m.block_table("p") == [0, 3]
    assert m.block_table("c") == [0, 1]
    assert m.num_free_blocks == 0
    m.check_invariants()


def test_append_batch_that_cannot_fit_is_atomic():
    """A batch needing more blocks than are free raises OutOfBlocks and appends nothing for any
    sequence, queues no copy."""
    m = mk(num_blocks=4, enable_prefix_caching=False)
    m.add_sequence("p", toks(0, 6))  # [0, 1]
    m.fork("p", "c")
    m.add_sequence("d", toks(10, 4))  # [2]; one block (3) left
    ids = ["p", "c", "d"]
    before = settle(m, ids)
    with pytest.raises(OutOfBlocks) as ei:
        m.append_batch(ids, [1, 2, 3])  # p copies (1 block), c in place, d full (1 block)
    assert (ei.value.needed, ei.value.available) == (2, 1)
    assert_failed_cleanly(m, before, ids)


def test_append_batch_out_of_blocks_many_full():
    """Three sequences with full last blocks and two free blocks: needed 3, available 2."""
    m = mk(num_blocks=5, enable_prefix_caching=False)
    for i, s in enumerate("abc"):
        m.add_sequence(s, toks(10 * i, 4))
    before = settle(m, list("abc"))
    with pytest.raises(OutOfBlocks) as ei:
        m.append_batch(list("abc"), [1, 2, 3])
    assert (ei.value.needed, ei.value.available) == (3, 2)
    assert_failed_cleanly(m, before, list("abc"))
    assert m.append_batch(["a", "b"], [1, 2]).tolist() == [3 * 4, 4 * 4]


def test_append_batch_argument_errors_are_atomic():
    """Duplicate ids or mismatched lengths are ValueErrors; an unknown id a KeyError; nothing is
    appended for the valid sequences of the batch."""
    m = mk()
    m.add_sequence("a", toks(0, 3))
    m.add_sequence("b", toks(10, 3))
    before = settle(m, ["a", "b"])
    with pytest.raises(ValueError):
        m.append_batch(["a", "b", "a"], [1, 2, 3])
    assert_failed_cleanly(m, before, ["a", "b"])
    with pytest.raises(ValueError):
        m.append_batch(["a", "b"], [1])
    assert_failed_cleanly(m, before, ["a", "b"])
    with pytest.raises(ValueError):
        m.append_batch(["a"], [1, 2])
    assert_failed_cleanly(m, before, ["a", "b"])
    with pytest.raises(KeyError):
        m.append_batch(["a", "zz"], [1, 2])
    assert_failed_cleanly(m, before, ["a", "b"])


# ---------------------------------------------------------------- exports


def test_flashinfer_documented_example():
    """FlashInfer's documented example: page size 4, lengths 10, 4, 5 ->
    indptr [0,3,4,6], indices = the pages in order, last_page_len [2,4,1], all int32."""
    m = mk(num_blocks=8, block_size=4)
    m.add_sequence("a", toks(0, 10))
    m.add_sequence("b", toks(100, 4))
    m.add_sequence("c", toks(200, 5))
    indptr, indices, last = m.flashinfer_layout(["a", "b", "c"])
    for arr in (indptr, indices, last):
        assert isinstance(arr, np.ndarray) and arr.dtype == np.int32
    assert indptr.tolist() == [0, 3, 4, 6]
    assert indices.tolist() == [0, 1, 2, 3, 4, 5]
    assert last.tolist() == [2, 4, 1]
    indptr, indices, last = m.flashinfer_layout(["c", "a"])
    assert indptr.tolist() == [0, 2, 5]
    assert indices.tolist() == [4, 5, 0, 1, 2]
    assert last.tolist() == [1, 2]


def test_flashinfer_after_fork_and_cow():
    """The layout reflects shared and copied pages."""
    m = mk()
    m.add_sequence("a", toks(0, 6))  # [0, 1]
    m.fork("a", "b")
    m.append_token("b", 1)  # b: [0, 2]
    indptr, indices, last = m.flashinfer_layout(["a", "b"])
    assert indptr.tolist() == [0, 2, 4]
    assert indices.tolist() == [0, 1, 0, 2]
    assert last.tolist() == [2, 3]


def test_block_tables_padding():
    """block_tables is an int32 [n, max_blocks] array in the given order, padded with -1 (or the
    given pad value)."""
    m = mk()
    m.add_sequence("a", toks(0, 10))  # [0, 1, 2]
    m.add_sequence("b", toks(100, 4))  # [3]
    m.add_sequence("c", toks(200, 5))  # [4, 5]
    bt = m.block_tables(["a", "b", "c"])
    assert isinstance(bt, np.ndarray) and bt.dtype == np.int32 and bt.shape == (3, 3)
    assert bt.tolist() == [[0, 1, 2], [3, -1, -1], [4, 5, -1]]
    assert m.block_tables(["c", "b"], pad=0).tolist() == [[4, 5], [3, 0]]
    assert m.block_tables(["b"]).tolist() == [[3]]


# ---------------------------------------------------------------- usage


def test_usage_fresh_manager():
    """An empty manager reports zeros (no division by zero) and all blocks free."""
    u = mk(num_blocks=8, block_size=4).usage()
    assert isinstance(u, Usage)
    assert (u.num_blocks, u.block_size, u.num_sequences) == (8, 4, 0)
    assert (u.logical_tokens, u.stored_tokens, u.used_blocks, u.allocated_slots) == (0, 0, 0, 0)
    assert (u.free_blocks, u.cached_blocks) == (8, 0)
    assert u.internal_fragmentation == 0.0
    assert (u.blocks_saved_by_sharing, u.cow_copies, u.forks, u.evictions) == (0, 0, 0, 0)


def test_usage_docstring_worked_example():
    """Usage's worked example (bs 16): a 20-token sequence forked into two that each append one
    token -> logical 42, stored 26, used 3, allocated 48, fragmentation 1-26/48, saved 1."""
    m = mk(num_blocks=8, block_size=16)
    m.add_sequence("a", toks(0, 20))
    m.fork("a", "b")
    u = m.usage()
    assert (u.logical_tokens, u.stored_tokens, u.used_blocks, u.allocated_slots) == (40, 20, 2, 32)
    assert u.internal_fragmentation == pytest.approx(1 - 20 / 32)
    assert (u.blocks_saved_by_sharing, u.forks, u.cow_copies) == (2, 1, 0)
    m.append_token("a", 1)
    m.append_token("b", 2)
    u = m.usage()
    assert u.num_sequences == 2
    assert u.logical_tokens == 42
    assert u.stored_tokens == 26
    assert u.used_blocks == 3
    assert u.allocated_slots == 48
    assert u.internal_fragmentation == pytest.approx(1 - 26 / 48)
    assert u.blocks_saved_by_sharing == 1
    assert (u.cow_copies, u.forks, u.evictions) == (1, 1, 0)
    assert (u.free_blocks, u.cached_blocks) == (5, 0)
    assert (u.prefix_query_tokens, u.prefix_hit_tokens) == (20, 0)
    assert u.prefix_hit_rate == 0.0
    assert u.utilization == pytest.approx(26 / (8 * 16))


def test_usage_blocks_saved_matches_definition():
    """blocks_saved_by_sharing = sum(ceil(len/bs)) - used_blocks, with several forks."""
    m = mk(num_blocks=16, block_size=4)
    m.add_sequence("a", toks(0, 9))  # 3 blocks
    for c in ["b", "c", "d"]:
        m.fork("a", c)
    m.append_tokens("b", [1, 2, 3, 4])  # CoW of block 2 + a fresh block
    m.take_copies()
    lens = [m.num_tokens(s) for s in "abcd"]
    u = m.usage()
    assert u.logical_tokens == sum(lens) == 9 * 3 + 13
    assert u.used_blocks == 5
    assert u.blocks_saved_by_sharing == sum(math.ceil(n / 4) for n in lens) - 5 == 8
    # shared full blocks 0 and 1; block 2 (1 token, a/c/d); b's copy 3 (full) and block 4 (1)
    assert u.stored_tokens == 4 + 4 + 1 + 4 + 1
    assert u.cow_copies == 1 and u.forks == 3


def test_numpy_integers_accepted_for_ids_and_sizes():
    """Block ids read back from the manager's own numpy exports (block_tables,
    flashinfer_layout) are valid arguments to refcount, and numpy integer sizes are valid
    constructor arguments: engines compute both with numpy."""
    m = mk()
    m.add_sequence("a", toks(0, 5))
    bt = m.block_tables(["a"])
    assert m.refcount(bt[0, 0]) == 1
    _, indices, _ = m.flashinfer_layout(["a"])
    assert m.refcount(indices[1]) == 1
    m2 = KVCacheManager(num_blocks=np.int64(8), block_size=np.int32(4))
    assert (m2.num_blocks, m2.block_size) == (8, 4)


def test_no_copy_after_other_holder_freed():
    """Once the other holders of a shared partial block are freed, the survivor is the last
    holder and writes in place: copy-on-write depends on the refcount now, not on history."""
    m = mk()
    m.add_sequence("a", toks(0, 6))  # [0, 1]
    m.fork("a", "b")
    m.fork("a", "c")
    m.free("a")
    m.free("c")
    assert m.refcount(1) == 1
    assert m.append_token("b", 9) == 1 * 4 + 2
    assert m.take_copies() == []
    assert m.block_table("b") == [0, 1]
    assert m.usage().cow_copies == 0


# ---------------------------------------------------------------- edges found in review


def test_bytearray_salt_is_a_bytes_salt_and_other_salts_are_rejected():
    """A bytearray salt isolates exactly like the equal bytes salt; a list salt is a bad argument
    (ValueError) and admits nothing."""
    m = mk(num_blocks=16)
    m.add_sequence("a", toks(0, 9), cache_salt=b"tenant")
    assert m.add_sequence("b", toks(0, 9), cache_salt=bytearray(b"tenant")) == 8
    with pytest.raises(ValueError):
        m.add_sequence("c", toks(0, 9), cache_salt=["tenant"])
    assert "c" not in m
    m.check_invariants()


def test_unhashable_sequence_id_is_a_bad_argument():
    m = mk(num_blocks=8)
    with pytest.raises(ValueError):
        m.add_sequence(["a"], toks(0, 3))
    m.add_sequence("a", toks(0, 3))
    with pytest.raises(ValueError):
        m.fork("a", ["b"])
    assert m.num_sequences == 1 and m.num_free_blocks == 7
    m.check_invariants()


def test_block_tables_pad_must_fit_int32():
    m = mk(num_blocks=8)
    m.add_sequence("a", toks(0, 3))
    with pytest.raises(ValueError):
        m.block_tables(["a"], pad=2**31)
    assert m.block_tables(["a"], pad=-(2**31)).tolist() == [[0]]


def test_bool_tokens_are_zero_and_one_in_lists_and_arrays():
    """One rule for bools: 0/1 token ids, whether in a list or a numpy array."""
    m = mk(num_blocks=8)
    m.add_sequence("a", [True, False, True])
    m.append_tokens("a", np.array([True, False]))
    assert m.tokens("a") == [1, 0, 1, 1, 0]


def test_out_of_blocks_pickles_with_its_context():
    import pickle

    e = OutOfBlocks(3, 1, "admitting 'x'")
    f = pickle.loads(pickle.dumps(e))
    assert (f.needed, f.available, str(f)) == (3, 1, str(e))


def test_free_drops_pending_copies_into_its_own_blocks():
    """A copy queued for a sequence that is freed before the engine drained the copies would
    write into a block that may already belong to someone else: it is dropped with the sequence."""
    m = mk(num_blocks=8, enable_prefix_caching=False)
    m.add_sequence("p", toks(0, 6))  # [0, 1]
    m.fork("p", "c")
    m.append_token("c", 9)  # CoW: CopyOp(1, 2), c = [0, 2]
    m.free("c")
    assert m.take_copies() == []
    m.check_invariants()
