"""The physical KV store: writes land at the right slots, copies move whole blocks for every layer,
and paged attention through shuffled block tables equals attention over dense K/V computed by a
naive per-sequence loop written here (not the store's own kernel)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from pagedkv.store import KVStore, dense_attention, kv_bytes_per_block
from pagedkv.types import CopyOp

BACKENDS = ["numpy", pytest.param("torch", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("torch") is None, reason="torch not installed"))]


def to_numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def naive_attention(q, ks, vs, qlens):
    """Reference: one sequence and one head at a time, explicit causal loop, float64."""
    out, t = [], 0
    heads, kv_heads = q.shape[1], ks[0].shape[1]
    for k, v, ql in zip(ks, vs, qlens):
        n = len(k)
        for j in range(ql):
            pos = n - ql + j
            rows = []
            for h in range(heads):
                kh = h // (heads // kv_heads)
                s = k[: pos + 1, kh].astype(np.float64) @ q[t, h].astype(np.float64) / np.sqrt(q.shape[2])
                w = np.exp(s - s.max())
                rows.append((w / w.sum()) @ v[: pos + 1, kh].astype(np.float64))
            out.append(rows)
            t += 1
    return np.asarray(out).reshape(t, heads, q.shape[2])


def fill_shuffled(store, lens, rng):
    """Give each sequence blocks from a random permutation of the pool; write random K/V for each
    layer. Returns block tables (padded with -1) and the dense per-sequence K/V per layer."""
    bs, perm = store.block_size, rng.permutation(store.num_blocks).tolist()
    tables, dense = [], {layer: ([], []) for layer in range(store.num_layers)}
    for n in lens:
        tables.append([perm.pop() for _ in range(-(-n // bs))])
    width = max(len(t) for t in tables)
    padded = np.full((len(lens), width), -1, dtype=np.int32)
    for i, (t, n) in enumerate(zip(tables, lens)):
        padded[i, : len(t)] = t
        pos = np.arange(n)
        slots = np.asarray(t, dtype=np.int64)[pos // bs] * bs + pos % bs
        for layer in range(store.num_layers):
            k = rng.standard_normal((n, store.num_kv_heads, store.head_dim)).astype(np.float32)
            v = rng.standard_normal((n, store.num_kv_heads, store.head_dim)).astype(np.float32)
            store.write(layer, slots, k, v)
            dense[layer][0].append(k)
            dense[layer][1].append(v)
    return padded, dense


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_equals_dense_through_shuffled_blocks(backend, block_size):
    rng = np.random.default_rng(block_size)
    lens = [1, 5, 16, 17, 40, 3]  # ragged: shorter than, equal to, and across block boundaries
    need = sum(-(-n // block_size) for n in lens)
    store = KVStore(2, need + 7, block_size, 2, 8, backend=backend)
    tables, dense = fill_shuffled(store, lens, rng)
    for qlens in ([1] * len(lens), lens, [1, 2, 16, 1, 7, 3]):  # decode, full prefill, prefix-hit tails
        q = rng.standard_normal((sum(qlens), 4, 8)).astype(np.float32)  # 4 query heads on 2 KV heads
        for layer in range(2):
            got = to_numpy(store.paged_attention(layer, q, tables, lens, qlens))
            want = naive_attention(q, *dense[layer], qlens)
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_returns_logical_order_and_padded_matches(backend):
    rng = np.random.default_rng(1)
    store = KVStore(2, 32, 4, 2, 8, backend=backend)
    lens = [9, 2, 13]
    tables, dense = fill_shuffled(store, lens, rng)
    for i, n in enumerate(lens):
        k, v = store.gather(1, tables[i], n)
        np.testing.assert_array_equal(to_numpy(k), dense[1][0][i])
        np.testing.assert_array_equal(to_numpy(v), dense[1][1][i])
    kp, _ = store.gather_padded(0, tables, lens)
    assert tuple(kp.shape) == (3, 13, 2, 8)
    for i, n in enumerate(lens):
        np.testing.assert_array_equal(to_numpy(kp)[i, :n], dense[0][0][i])


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_attention_matches_naive(backend):
    rng = np.random.default_rng(2)
    lens, qlens = [6, 3], [2, 3]
    k = rng.standard_normal((2, 6, 1, 4)).astype(np.float32)  # multi-query: 1 KV head, 3 q heads
    v = rng.standard_normal((2, 6, 1, 4)).astype(np.float32)
    q = rng.standard_normal((5, 3, 4)).astype(np.float32)
    if backend == "torch":
        import torch
        k, v = torch.from_numpy(k), torch.from_numpy(v)
    got = to_numpy(dense_attention(q, k, v, lens, qlens))
    want = naive_attention(q, [to_numpy(k)[0], to_numpy(k)[1, :3]], [to_numpy(v)[0], to_numpy(v)[1, :3]], qlens)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_blocks_moves_every_layer_and_returns_bytes(backend):
    rng = np.random.default_rng(3)
    store = KVStore(3, 8, 4, 2, 4, backend=backend)
    for layer in range(3):
        store.write(layer, np.arange(32), rng.standard_normal((32, 2, 4)), rng.standard_normal((32, 2, 4)))
    before = to_numpy(store.kv).copy()
    moved = store.copy_blocks([CopyOp(1, 6), CopyOp(2, 7)])
    after = to_numpy(store.kv)
    assert moved == 2 * store.bytes_per_block == 2 * (2 * 3 * 4 * 2 * 4 * 4)
    np.testing.assert_array_equal(after[:, :, 6], before[:, :, 1])
    np.testing.assert_array_equal(after[:, :, 7], before[:, :, 2])
    np.testing.assert_array_equal(after[:, :, :6], before[:, :, :6])
    assert store.copy_blocks([]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_blocks_keeps_sequential_order_for_chains(backend):
    store = KVStore(1, 6, 2, 1, 1, backend=backend)
    store.write(0, np.arange(12), np.arange(12.0).reshape(12, 1, 1), -np.arange(12.0).reshape(12, 1, 1))
    before = to_numpy(store.kv).copy()
    store.copy_blocks(np.array([[1, 4], [4, 5], [2, 4]]))  # chain 1->4->5, then 4 overwritten by 2
    after = to_numpy(store.kv)
    np.testing.assert_array_equal(after[:, :, 5], before[:, :, 1])
    np.testing.assert_array_equal(after[:, :, 4], before[:, :, 2])


def test_sizes():
    store = KVStore(2, 64, 16, 2, 16)
    assert store.bytes_per_block == kv_bytes_per_block(2, 16, 2, 16) == 2 * 2 * 16 * 2 * 16 * 4
    assert store.nbytes == 64 * store.bytes_per_block == store.kv.nbytes
    # Llama-3.1-8B, bf16: 128 KiB per token, 2 MiB per 16-token block
    assert kv_bytes_per_block(32, 16, 8, 128, "bfloat16") == 16 * 131_072


def test_bad_arguments_raise_and_change_nothing():
    store = KVStore(1, 4, 2, 1, 2)
    store.write(0, [0, 1], np.ones((2, 1, 2)), np.ones((2, 1, 2)))
    snapshot = store.kv.copy()
    bad_calls = [
        lambda: store.write(0, [0, 8], np.zeros((2, 1, 2)), np.zeros((2, 1, 2))),  # slot out of range
        lambda: store.write(0, [3, 3], np.zeros((2, 1, 2)), np.zeros((2, 1, 2))),  # duplicate slot
        lambda: store.write(0, [2, 3], np.zeros((2, 1, 2)), np.zeros((3, 1, 2))),  # v shape
        lambda: store.write(1, [2], np.zeros((1, 1, 2)), np.zeros((1, 1, 2))),  # no such layer
        lambda: store.write(0, [2.0], np.zeros((1, 1, 2)), np.zeros((1, 1, 2))),  # float slot
        lambda: store.copy_blocks([(0, 4)]),  # dst out of range
        lambda: store.copy_blocks([(0, 1, 2)]),
        lambda: store.gather(0, [0], 3),  # 3 tokens need 2 blocks
        lambda: store.gather(0, [-1], 1),
        lambda: store.paged_attention(0, np.zeros((1, 2, 2)), [[0, -1]], [3]),  # -1 inside the length
        lambda: store.paged_attention(0, np.zeros((2, 2, 2)), [[0]], [1]),  # 2 queries, 1 expected
        lambda: store.paged_attention(0, np.zeros((1, 3, 2)), [[0]], [1]),  # 3 heads on 1 KV head ok...
    ]
    for call in bad_calls[:-1]:
        with pytest.raises(ValueError):
            call()
        np.testing.assert_array_equal(store.kv, snapshot)
    bad_calls[-1]()  # ...is valid GQA (group of 3), a control that the checks are not blanket
    for kwargs in ({"backend": "jax"}, {"dtype": "int8"}, {"dtype": "bfloat16"}):
        with pytest.raises(ValueError):
            KVStore(1, 4, 2, 1, 2, **kwargs)
    with pytest.raises(ValueError):
        KVStore(1, 0, 2, 1, 2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_blocks=0), "num_blocks must be an int >= 1, got 0"),
    (dict(head_dim=True), "head_dim must be an int >= 1, got True"),
    (dict(num_groups=2.0), "num_groups must be an int >= 1, got 2.0"),
    (dict(host_blocks=-1), "host_blocks must be an int >= 0, got -1"),
])
def test_bad_sizes_say_what_every_other_argument_check_says(kwargs, message):
    args = dict(num_layers=1, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=2) | kwargs
    with pytest.raises(ValueError, match=f"^{message}$"):
        KVStore(**args)
    with pytest.raises(ValueError, match="^num_layers must be an int >= 1, got 0$"):
        kv_bytes_per_block(0, 16, 8, 128, "float16")
    assert KVStore(1, np.int64(4), 2, 1, 2).num_blocks == 4  # numpy ints are ints


@pytest.mark.parametrize("dtype", ["float32", np.float32, np.dtype("float32"), np.zeros(1, np.float32).dtype])
def test_dtype_name_reads_every_spelling(dtype):
    from pagedkv.store import dtype_name

    assert dtype_name(dtype) == "float32"
    with pytest.raises(ValueError, match="not a dtype"):
        dtype_name(object())


def test_pad_entries_past_the_length_are_never_read():
    store = KVStore(1, 4, 2, 1, 2)
    q = np.ones((1, 1, 2), dtype=np.float32)
    a = store.paged_attention(0, q, [[1, -1, 99]], [2])
    b = store.paged_attention(0, q, [[1]], [2])
    np.testing.assert_array_equal(a, b)


def test_store_and_engine_import_with_numpy_only():
    code = ("import sys; sys.modules['torch'] = None; import pagedkv.engine, pagedkv.store as s, numpy as np; "
            "st = s.KVStore(1, 2, 2, 1, 2); st.write(0, [1], np.ones((1, 1, 2)), np.ones((1, 1, 2))); "
            "print(float(st.paged_attention(0, np.ones((1, 1, 2)), [[0]], [2]).sum()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(__import__("importlib").util.find_spec("torch") is None, reason="torch not installed")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_torch_copy_blocks_is_bitwise_for_every_dtype(dtype):
    import torch

    store = KVStore(2, 6, 2, 1, 3, dtype=dtype, backend="torch")
    store.kv.copy_(torch.randn(store.kv.shape))
    before = store.kv.clone()
    store.copy_blocks([CopyOp(0, 5), CopyOp(3, 1)])
    assert torch.equal(store.kv[:, :, 5], before[:, :, 0]) and torch.equal(store.kv[:, :, 1], before[:, :, 3])
    assert torch.equal(store.kv[:, :, [0, 2, 3, 4]], before[:, :, [0, 2, 3, 4]])
