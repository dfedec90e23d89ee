"""The hybrid decoder (issue 19 section 5) on numpy: sliding-window, chunked-local and full layers
in one model, each layer reading K/V through its own group's block table.

The judge here is ``PagedLlama.dense_forward``, the same weights over each whole sequence with a
plain masked attention (``causal_attention`` with the layer's spec), no store and no tables.
tests/test_model_hybrid_oracle.py checks that judge, and the paged path, against transformers.
The allocator is ``hybrid_setup.ToyGroups`` (the contract's release, hit and copy-on-write rules;
the grouped ``KVCacheManager`` replaces it once merged); every block it hands out is first
filled with garbage (``poison``), so a read of a released or stale block shows.

Measured: paged vs dense differ by ~3e-6 in float32 logits (summation order), 0 in float64
(rounded to float32 logits); a window off by one position moves logits by ~1 or more.
"""
from __future__ import annotations

import numpy as np
import pytest

from pagedkv.kv_specs import ChunkedLocalAttention, FullAttention, SlidingWindow
from pagedkv.model import LlamaDims, PagedLlama, causal_attention
from hybrid_setup import (SPECS, WINDOW, Runner, ToyGroups, as_numpy, greedy, greedy_from, poison,
                          random_hybrid)
from llama_setup import DIMS, prompts_of

ATOL = 1e-4
PATTERN = [SPECS["sliding"], SPECS["full"], SPECS["chunked"], SPECS["sliding"]]


@pytest.fixture(scope="module")
def model():
    return random_hybrid(PATTERN, seed=1, dtype="float32")


def run(model, num_blocks=64, block_size=4, reuse_at_once=False, **toy):
    store = model.new_store(num_blocks, block_size)
    if reuse_at_once:
        toy["on_release"] = poison(store, seed=1)
    alloc = ToyGroups(num_blocks, block_size, model.kv_groups, on_alloc=poison(store), **toy)
    return Runner(model, alloc, store)


def dense_error(model, prompt, tokens, logits) -> float:
    ref = as_numpy(model.dense_forward(list(prompt) + tokens[:-1]))[len(prompt) - 1:]
    return float(np.abs(ref - logits).max())


# ---- the layer pattern


def test_default_pattern_is_todays_model():
    assert DIMS.layer_specs == () and DIMS.kv_groups == (FullAttention(),)
    assert DIMS.attention == (FullAttention(),) * 2 and DIMS.layer_groups == (0, 0)
    explicit = LlamaDims(**{**DIMS.__dict__, "layer_specs": (FullAttention(), FullAttention())})
    a, b = PagedLlama.random(DIMS, seed=0), PagedLlama.random(explicit, seed=0)
    seq = prompts_of([30], seed=4)[0]
    np.testing.assert_array_equal(a.dense_forward(seq), b.dense_forward(seq))
    outs = []
    for m in (a, b):
        store = m.new_store(16, 4)
        tables = np.arange(8)[None]
        outs.append(m.forward(store, seq, np.arange(30), tables, [30], [30]))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_kv_groups_in_order_of_first_appearance(model):
    assert model.kv_groups == (SlidingWindow(WINDOW), FullAttention(), ChunkedLocalAttention(6))
    assert model.dims.layer_groups == (0, 1, 2, 0)


@pytest.mark.parametrize("specs, match", [
    ((FullAttention(),), "2 layers"),
    ((FullAttention(), "sliding"), "attention spec"),
    ("full", "tuple"),
])
def test_bad_layer_pattern(specs, match):
    with pytest.raises(ValueError, match=match):
        LlamaDims(**{**DIMS.__dict__, "layer_specs": specs})


def test_layer_pattern_from_a_transformers_config():
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
            "intermediate_size": 128, "num_hidden_layers": 3}
    d = LlamaDims.from_config({**base, "sliding_window": 8, "attention_chunk_size": 32,
                               "layer_types": ["sliding_attention", "full_attention", "chunked_attention"]})
    assert d.attention == (SlidingWindow(8), FullAttention(), ChunkedLocalAttention(32))
    assert LlamaDims.from_config({**base, "sliding_window": 8}).attention == (SlidingWindow(8),) * 3  # Mistral
    assert LlamaDims.from_config({**base, "sliding_window": 8, "use_sliding_window": False}).layer_specs == ()
    assert LlamaDims.from_config({**base, "layer_types": ["full_attention"] * 3}).layer_specs == ()
    for bad, match in ((["full_attention"] * 2, "one type per layer"),
                       (["linear_attention"] * 3, "linear_attention"),
                       (["chunked_attention"] * 3, "attention_chunk_size")):
        with pytest.raises(ValueError, match=match):
            LlamaDims.from_config({**base, "layer_types": bad})


def test_reference_masks_are_textbook():
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(10, 2, 4)), rng.normal(size=(10, 1, 4)), rng.normal(size=(10, 1, 4))
    for spec, lo in ((SlidingWindow(3), lambda t: max(0, t - 2)), (ChunkedLocalAttention(4), lambda t: t - t % 4)):
        got = causal_attention(q, k, v, spec)
        for t in range(10):  # token t alone over the keys it may see, by hand
            s = np.einsum("hd,sd->hs", q[t], k[lo(t): t + 1, 0]) / 2.0
            w = np.exp(s - s.max(-1, keepdims=True))
            np.testing.assert_allclose(got[t], (w / w.sum(-1, keepdims=True)) @ v[lo(t): t + 1, 0], atol=1e-12)


# ---- the paged path against the dense reference


@pytest.mark.parametrize("block_size, chunk", [(4, None), (4, 5), (16, 7)])
def test_hybrid_greedy_matches_dense(model, block_size, chunk):
    """Released blocks are overwritten with garbage the moment they go (``on_release``): the
    logits do not move, so no layer reads a block its group released."""
    prompts = prompts_of([5, 16, 23, 33], seed=3)
    r = run(model, num_blocks=96 if block_size == 4 else 24, block_size=block_size, reuse_at_once=True)
    toks, logits, _ = greedy(r, prompts, 20, chunk=chunk)
    for p, t, lg in zip(prompts, toks, logits):
        assert dense_error(model, p, t, lg) < ATOL
    # the windowed groups hold only what the last query read: -1 below it (the release for
    # the next query happens at the next call)
    for i, p in enumerate(prompts):
        n = len(p) + 19
        for g, spec in enumerate(model.kv_groups):
            row = r.alloc.block_tables([f"s{i}"], group=g)[0]
            below = spec.released_below(n - 1, block_size)
            assert (row[:below] == -1).all() and (row[below: -(-n // block_size)] >= 0).all()


def test_pattern_matters(model):
    """The check above has teeth: the same weights with every layer full give other logits."""
    full = PagedLlama(model.w, LlamaDims(**{**model.dims.__dict__, "layer_specs": ()}))
    seq = prompts_of([40], seed=5)[0]
    assert np.abs(as_numpy(full.dense_forward(seq)) - as_numpy(model.dense_forward(seq)))[10:].max() > 0.1


def test_fork_and_copy_on_write(model):
    """A fork mid-block shares every live block; parent and child then write different tokens
    into the shared partial block (copy-on-write in each group) and both match the dense run."""
    r = run(model)
    prompt = prompts_of([22], seed=6)[0]
    r.admit("p", prompt)
    r.step()
    r.fork("p", "c")
    assert r.alloc.block_tables(["c"], group=1).tolist() == r.alloc.block_tables(["p"], group=1).tolist()
    seqs = {"p": [11, 12, 13, 14, 15, 16, 17], "c": [21, 22, 23, 24, 25, 26, 27]}
    got = {"p": [], "c": []}
    for j in range(7):
        for s in seqs:
            r.append(s, seqs[s][j])
        if j == 0:  # 22 % 4 != 0: the first append copies the shared partial block, per group
            assert sorted(c[2] for c in r.alloc.copies) == [0, 1, 2]
        out = r.step()
        for s in seqs:
            got[s].append(out[s][-1])
    for s, toks in seqs.items():
        ref = as_numpy(model.dense_forward(prompt + toks))[len(prompt):]
        np.testing.assert_allclose(np.stack(got[s]), ref, atol=ATOL, rtol=0)


def test_prefix_hit_revives_a_released_window(model):
    """Sequence a releases its early sliding-window and chunk blocks while it runs; b shares a's
    first 32 tokens: the hit serves the full group whole and revives the released window blocks
    that position 32 reads; b's logits match the dense run of b alone."""
    r = run(model, num_blocks=64)
    a = prompts_of([40], seed=7)[0]
    r.admit("a", a)
    r.step()
    held = r.alloc.block_tables(["a"], group=0)[0][6:8].tolist()  # positions 24 .. 31
    for t in (3, 4, 5, 6):
        r.append("a", t)
        r.step()
    window_blocks = r.alloc.block_tables(["a"], group=0)[0]
    assert window_blocks[6] == -1 and window_blocks[7] == -1  # released (a has 43 computed)
    b = a[:32] + prompts_of([9], seed=8)[0]
    hit = r.admit("b", b)
    assert hit == 32
    rows = [r.alloc.block_tables(["b"], group=g)[0] for g in range(3)]
    assert (rows[0][:6] == -1).all() and rows[0][6:8].tolist() == held  # 32 reads 26 .. 32: revived
    assert (rows[1][:8] >= 0).all()  # full attention: the whole prefix
    assert (rows[2][:7] == -1).all() and rows[2][7] >= 0  # chunk 6: position 32 reads 30 .. 32
    toks, logits = greedy_from(r, "b", 12)
    assert dense_error(model, b, toks, logits) < ATOL


# ---- released entries: never read, never needed; the negative controls


def test_store_runs_a_grouped_managers_copy_ops(model):
    """``CopyOp(src, dst, group)`` rows copy the whole block (every layer lives in every block)."""
    store = model.new_store(8, 4)
    store.kv[:] = np.random.default_rng(0).normal(size=store.kv.shape)
    assert store.copy_blocks([(1, 5, 2), (3, 6, 0)]) == 2 * store.bytes_per_block
    np.testing.assert_array_equal(store.kv[:, :, 5], store.kv[:, :, 1])
    np.testing.assert_array_equal(store.kv[:, :, 6], store.kv[:, :, 3])
    before = store.kv.copy()
    with pytest.raises(ValueError, match="groups"):  # the model has 3 groups: 0 .. 2
        store.copy_blocks([(1, 4, 3)])
    np.testing.assert_array_equal(store.kv, before)


def test_released_entries_are_never_touched(model):
    """A decode step whose tables read -1 below each windowed layer's first block, and one
    whose tables point there at blocks overwritten with garbage, both give the dense logits."""
    seq = prompts_of([29], seed=9)[0]
    store = model.new_store(32, 4)
    tables = np.arange(8)[None]
    logits = model.forward(store, seq, [np.arange(29)] * 3, [tables] * 3, [29], [29])
    nxt = int(np.argmax(logits[-1]))
    want = as_numpy(model.dense_forward(seq + [nxt]))[-1]
    first = [store.first_blocks(spec, [30], [1]) for spec in model.kv_groups]
    assert first[0].tolist() == [5] and first[1] is None and first[2].tolist() == [6]
    released = [tables.copy() for _ in range(3)]
    released[0][0, :5] = -1  # position 29 reads 23 .. 29 (window 7): blocks 5 .. 7
    released[2][0, :6] = -1  # and 24 .. 29 (chunk 6): blocks 6, 7
    garbage = model.new_store(32, 4)
    garbage.kv[:] = store.kv
    for layer, lo in enumerate((5, None, 6, 5)):  # layers 0 and 3 slide, 2 is chunked
        if lo is not None:
            garbage.kv[layer, :, :lo] = np.random.default_rng(layer).normal(0, 50, garbage.kv[layer, :, :lo].shape)
    for st, tb in ((store, released), (garbage, [tables] * 3)):
        out = model.forward(st, [nxt], [[29]] * 3, tb, [30])
        np.testing.assert_allclose(out[0], want, atol=ATOL, rtol=0)


def test_reading_a_released_entry_is_refused(model):
    store = model.new_store(32, 4)
    tables = np.arange(8)[None]
    seq = prompts_of([29], seed=9)[0]
    model.forward(store, seq, [np.arange(29)] * 3, [tables] * 3, [29], [29])
    bad = tables.copy()
    bad[0, 5] = -1  # position 29 reads 23 .. 29 under the window of 7: block 5 is needed
    before = store.kv.copy()
    with pytest.raises(ValueError, match="released or padding"):
        model.forward(store, [1], [[29]] * 3, [bad, tables, tables], [30])
    np.testing.assert_array_equal(store.kv, before)
    with pytest.raises(ValueError, match="3 KV cache groups"):
        model.forward(store, [1], [29], tables, [30])
    with pytest.raises(ValueError, match="in group 1"):
        model.forward(store, [1], [[29], [], [29]], [tables] * 3, [30])
    np.testing.assert_array_equal(store.kv, before)


def test_release_one_position_early_diverges(model):
    """Negative control: the run of test_hybrid_greedy_matches_dense with blocks released one
    position too early. With the table keeping the released id, the block is reused (garbage)
    and the logits diverge; with the table reading -1, the step is refused."""
    prompts = prompts_of([5, 16, 23, 33], seed=3)
    r = run(model, num_blocks=96, reuse_at_once=True, release_shift=1, stale_tables=True)
    toks, logits, _ = greedy(r, prompts, 20, chunk=5)
    errors = [dense_error(model, p, t, lg) for p, t, lg in zip(prompts, toks, logits)]
    assert max(errors) > 0.1, errors  # measured: ~4 in every prompt
    with pytest.raises(ValueError, match="released or padding"):
        greedy(run(model, release_shift=1), prompts, 20, chunk=5)


def test_torch_backend_agrees(model):
    pytest.importorskip("torch")
    tm = PagedLlama(model.w, model.dims, backend="torch")
    prompts = prompts_of([9, 26], seed=10)
    (t1, l1, _), (t2, l2, _) = (greedy(run(m), prompts, 12, chunk=6) for m in (model, tm))
    assert t1 == t2
    for a, b in zip(l1, l2):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)
