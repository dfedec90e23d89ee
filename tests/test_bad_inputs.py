"""The library's own bad inputs (issue 7, item 5): each is a clear ValueError that changes nothing.

Unhashable sequence ids in every method that takes an id, sets and dicts of ids in a batch,
numpy masked arrays of tokens, numpy bools as tokens, numpy ints in ``slots()``, sizes too large
for the int32 exports, and the builtin hash: a collision of CPython's bytes hash (found offline,
see ``COLLIDING_BLOCKS``) must never serve one prompt's KV to another.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pagedkv import KVCacheManager
from conftest import snapshot, toks

BS = 4


def mk(num_blocks=16, block_size=BS, **kw):
    return KVCacheManager(num_blocks=num_blocks, block_size=block_size, **kw)


def populated():
    """Two live sequences (one forked from the other: shared blocks), one cached-free block."""
    m = mk()
    m.add_sequence("a", toks(0, 6))
    m.fork("a", "b")
    m.add_sequence("z", toks(100, 5))
    m.free("z")
    m.take_events()
    return m


def assert_unchanged(m, before):
    assert snapshot(m, ["a", "b"]) == before
    assert m.take_events() == [] and m.take_copies() == []
    m.check_invariants()


# ---------------------------------------------------------------- unhashable ids

CALLS = {
    "add_sequence": lambda m, bad: m.add_sequence(bad, toks(0, 3)),
    "append_token": lambda m, bad: m.append_token(bad, 1),
    "append_tokens": lambda m, bad: m.append_tokens(bad, [1, 2]),
    "append_tokens_speculative": lambda m, bad: m.append_tokens(bad, [1], speculative=True),
    "append_batch_alone": lambda m, bad: m.append_batch([bad], [1]),
    "append_batch_second": lambda m, bad: m.append_batch(["a", bad], [1, 2]),
    "fork_parent": lambda m, bad: m.fork(bad, "c"),
    "fork_child": lambda m, bad: m.fork("a", bad),
    "free": lambda m, bad: m.free(bad),
    "free_uncached": lambda m, bad: m.free(bad, cache=False),
    "block_table": lambda m, bad: m.block_table(bad),
    "num_tokens": lambda m, bad: m.num_tokens(bad),
    "tokens": lambda m, bad: m.tokens(bad),
    "slots": lambda m, bad: m.slots(bad),
    "num_computed": lambda m, bad: m.num_computed(bad),
    "prefill": lambda m, bad: m.prefill(bad, 0),
    "accept": lambda m, bad: m.accept(bad, 0),
    "block_tables": lambda m, bad: m.block_tables(["a", bad]),
    "flashinfer_layout": lambda m, bad: m.flashinfer_layout([bad]),
}


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("bad", [["x"], {"x": 1}, {"x"}], ids=["list", "dict", "set"])
def test_unhashable_id_is_a_value_error_everywhere(name, bad):
    m = populated()
    before = snapshot(m, ["a", "b"])
    with pytest.raises(ValueError):
        CALLS[name](m, bad)
    assert "c" not in m
    assert_unchanged(m, before)


def test_unhashable_id_is_not_contained():
    m = populated()
    assert (["a"] in m, {"a": 1} in m, "a" in m) == (False, False, True)


# ---------------------------------------------------------------- append_batch ids


@pytest.mark.parametrize(
    "ids",
    [{"a", "b"}, {"a": 0, "b": 1}, frozenset({"a"}), (s for s in ["a", "b"]), iter(["a", "b"])],
    ids=["set", "dict", "frozenset", "generator", "iterator"],
)
def test_append_batch_refuses_unordered_or_one_shot_ids(ids):
    """The pairing of ids with tokens must not depend on a set's iteration order."""
    m = mk()
    m.add_sequence("a", toks(0, 6))
    m.add_sequence("b", toks(100, 6))
    m.take_events()
    before = snapshot(m, ["a", "b"])
    with pytest.raises(ValueError):
        m.append_batch(ids, [1, 2][: 1 if isinstance(ids, frozenset) else 2])
    assert_unchanged(m, before)


def test_append_batch_takes_a_numpy_array_of_ids():
    m = mk()
    m.add_sequence(1, toks(0, 6))  # [0, 1]
    m.add_sequence(2, toks(100, 6))  # [2, 3]
    slots = m.append_batch(np.array([2, 1]), [7, 8])
    assert slots.tolist() == [3 * BS + 2, 1 * BS + 2]
    assert m.tokens(2)[-1] == 7 and m.tokens(1)[-1] == 8
    m.check_invariants()


# ---------------------------------------------------------------- masked arrays, numpy bools

MASKED = {
    "masked_element": lambda: np.ma.array([1, 2, 3], mask=[False, True, False]),
    "no_mask": lambda: np.ma.array([1, 2, 3]),
}
TOKEN_CALLS = {
    "add_sequence": lambda m, t: m.add_sequence("c", t),
    "lookup": lambda m, t: m.lookup(t),
    "append_tokens": lambda m, t: m.append_tokens("a", t),
    "append_tokens_speculative": lambda m, t: m.append_tokens("a", t, speculative=True),
    "append_batch": lambda m, t: m.append_batch(["a", "b", "a2"], t),
}


@pytest.mark.parametrize("call", sorted(TOKEN_CALLS))
@pytest.mark.parametrize("kind", sorted(MASKED))
def test_masked_token_arrays_are_refused(call, kind):
    """A masked token would silently become the fill value: refused, whatever the mask."""
    m = mk()
    m.add_sequence("a", toks(0, 6))
    m.add_sequence("a2", toks(200, 6))
    m.fork("a", "b")
    m.take_events()
    before = snapshot(m, ["a", "b", "a2"])
    with pytest.raises(ValueError):
        TOKEN_CALLS[call](m, MASKED[kind]())
    assert "c" not in m
    assert snapshot(m, ["a", "b", "a2"]) == before
    assert m.take_events() == [] and m.take_copies() == []


@pytest.mark.parametrize("call", [
    lambda m: m.append_token("a", np.ma.array(5, mask=True)),
    lambda m: m.append_batch(np.ma.array(["a", "a2"], mask=[False, True]), [1, 2]),
], ids=["append_token", "append_batch_ids"])
def test_masked_scalars_and_masked_ids_are_refused(call):
    """A masked scalar token hides a value that would be stored; masked ids name no sequence."""
    m = mk()
    m.add_sequence("a", toks(0, 6))
    m.add_sequence("a2", toks(200, 6))
    before = snapshot(m, ["a", "a2"])
    with pytest.raises(ValueError, match="masked"):
        call(m)
    assert "c" not in m and snapshot(m, ["a", "a2"]) == before


def test_numpy_bools_are_zero_and_one_like_python_bools():
    m = mk()
    m.add_sequence("a", [np.True_, np.False_, True])
    assert m.tokens("a") == [1, 0, 1]
    m.append_token("a", np.True_)
    m.append_token("a", np.False_)
    m.append_tokens("a", [np.True_, np.False_])
    m.add_sequence("b", [5])
    m.append_batch(["a", "b"], [np.False_, np.True_])
    assert m.tokens("a") == [1, 0, 1, 1, 0, 1, 0, 0]
    assert m.tokens("b") == [5, 1]
    m.check_invariants()


def test_slots_takes_numpy_ints():
    m = mk()
    m.add_sequence("a", toks(0, 10))
    want = m.slots("a", 2, 7).tolist()
    assert want == [2, 3, 4, 5, 6]
    assert m.slots("a", np.int64(2), np.int32(7)).tolist() == want
    assert m.slots("a", np.uint8(2)).tolist() == list(range(2, 10))
    with pytest.raises(ValueError):
        m.slots("a", np.float64(2.0), 7)


# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(num_blocks=2**40, block_size=4), "num_blocks"),
        (dict(num_blocks=np.int64(2**40), block_size=4), "num_blocks"),
        (dict(num_blocks=4, block_size=2**31), "block_size"),
        (dict(num_blocks=4, block_size=2**40), "block_size"),
    ],
)
def test_sizes_too_large_for_int32_exports_are_refused(kw, name):
    """Block ids and page lengths are exported as int32: larger sizes are refused up front with
    a message naming the argument (not a MemoryError, not an overflow in a later export)."""
    with pytest.raises(ValueError, match=name):
        KVCacheManager(**kw)


def test_first_num_blocks_past_int32_is_refused_before_allocating():
    """num_blocks = 2**31 would need a 16 GiB refcount list: the refusal must come first. Run in
    a child process capped at 4 GiB of address space, so a regression fails fast (MemoryError)
    instead of exhausting the machine."""
    code = textwrap.dedent(
        """
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        from pagedkv import KVCacheManager
        try:
            KVCacheManager(num_blocks=2**31, block_size=4)
        except ValueError as exc:
            print("ValueError", "num_blocks" in str(exc))
        except MemoryError:
            print("MemoryError")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ValueError", "True"]


def test_largest_block_size_exports_fit_int32():
    m = KVCacheManager(num_blocks=2, block_size=2**31 - 1)
    m.add_sequence("a", [1, 2, 3])
    indptr, indices, last = m.flashinfer_layout(["a"])
    assert last.dtype == np.int32 and last.tolist() == [3]
    assert m.slots("a").tolist() == [0, 1, 2]
    m.check_invariants()


# ---------------------------------------------------------------- builtin hash collisions

# Two different 16-token blocks whose little-endian uint32 bytes (64 bytes each) have the same
# CPython 3.11 ``hash(bytes)`` under PYTHONHASHSEED=0 (SipHash-1-3 with an all-zero key). Found
# with a throwaway C program: Pollard-rho with distinguished points over x -> hash(block(x)),
# block(x)[i] = 1000 + 500 * i + ((x >> 4i) & 15), x a 64-bit value; about 6.7e9 SipHash
# evaluations, four minutes on one core. ``hash((parent, block))`` then collides for every
# parent, so an unkeyed builtin chain hash maps both blocks to one cache entry.
COLLIDING_BLOCKS = (
    [1004, 1508, 2007, 2512, 3002, 3508, 4004, 4510,
     5007, 5510, 6012, 6504, 7004, 7503, 8006, 8507],
    [1006, 1506, 2001, 2506, 3008, 3510, 4015, 4506,
     5000, 5500, 6004, 6506, 7013, 7510, 8004, 8515],
)

_COLLISION_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from array import array
    import numpy as np
    from pagedkv import KVCacheManager

    A, B = json.loads(sys.argv[1])
    ba, bb = array("I", A).tobytes(), array("I", B).tobytes()
    out = {"bytes_differ": ba != bb, "hash_equal": hash(ba) == hash(bb),
           "tuple_hash_equal": hash((1, ba)) == hash((1, bb))}

    def serve(prefix):
        # An engine with a slot store: one token id per physical slot, -1 never written.
        bs = 16
        m = KVCacheManager(num_blocks=16, block_size=bs, hash_algo="builtin")
        store = np.full(16 * bs, -1, dtype=np.int64)
        def admit(sid, prompt):
            hit = m.add_sequence(sid, prompt)
            store[m.slots(sid, hit)] = prompt[hit:]  # compute what was not served
            return hit
        pa, pb = prefix + A + [7], prefix + B + [7]
        admit("a", pa)
        hit = admit("b", pb)
        read = store[m.slots("b")].tolist()
        m.check_invariants()
        return {"hit": hit, "b_reads_b": read == pb}

    out["at_0"] = serve([])
    out["behind_equal_block"] = serve(list(range(300, 316)))
    print(json.dumps(out))
    """
)


def test_builtin_hash_collision_serves_nothing_across_prompts():
    """Under PYTHONHASHSEED=0 the two blocks' bytes hash equal; a builtin-hash manager that cached
    prompt A must still never serve its blocks to prompt B, at block 0 or behind an equal block."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.run(
        [sys.executable, "-c", _COLLISION_SCRIPT, json.dumps(COLLIDING_BLOCKS)],
        env=env, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["bytes_differ"], out["hash_equal"], out["tuple_hash_equal"]) == (True, True, True)
    assert out["at_0"] == {"hit": 0, "b_reads_b": True}
    assert out["behind_equal_block"] == {"hit": 16, "b_reads_b": True}
