"""Benchmarks of the physical KV store: what copy-on-write copies and paging cost a kernel here.

``rows(quick)`` returns dicts ``{"name", "median", "unit", "target", "note"}`` like
``bench_core.rows`` (``run.py`` prints both). Nothing here has a target in docs/design.md (``None``).

* **copy throughput**: one ``copy_blocks`` call running a decode step's copy-on-write copies (256
  forked sequences each copying its shared partial block, all layers, K and V) at a Llama-like
  layer shape. GB/s = payload bytes (``copies × bytes_per_block``, 10**9 B per GB) / median time.
  Worked size: 8 layers × 8 KV heads × 128 dims, float16, 16-token blocks = 524,288 B a block,
  so 256 copies move 134 MB of payload (the memory traffic is at least twice that: read + write).
* **paged vs dense attention**, numpy, one decode step for a batch of ragged sequences (GQA 32/8,
  head_dim 128): ``KVStore.paged_attention`` through shuffled block tables against
  ``dense_attention`` on the same K/V already laid out contiguously and padded. The ratio is what
  paging costs this (unfused) kernel: the gather of K/V through the tables. A fused GPU kernel
  reads the blocks in place instead; this measures the reference, not a production kernel.
"""
from __future__ import annotations

import importlib.util

import numpy as np

from ..store import KVStore, dense_attention
from .harness import measure

__all__ = ["rows"]

SEED = 0
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 8, 8, 128, 16
Q_HEADS = 32


def _row(name: str, median: float, unit: str, note: str = "") -> dict:
    return {"name": name, "median": float(median), "unit": unit, "target": None, "note": note}


def _copy_rows(quick: bool, backend: str) -> list[dict]:
    copies = 64 if quick else 256
    layers = 2 if quick else LAYERS
    store = KVStore(layers, 2 * copies + 8, BLOCK, KV_HEADS, HEAD_DIM, dtype="float16", backend=backend)
    store.kv[:] = 1  # touch every page so the timing sees no first-write page faults
    perm = np.random.default_rng(SEED).permutation(store.num_blocks)
    ops = np.stack([perm[:copies], perm[copies:2 * copies]], axis=1)  # distinct src, distinct dst
    t = measure(lambda: store.copy_blocks(ops), repeat=10 if quick else 50, warmup=2, max_time_s=5)
    payload = copies * store.bytes_per_block
    gbps = payload / (t.median_us * 1e-6) / 1e9
    return [
        _row(f"copy_blocks: {copies} CoW copies, {layers} layers ({backend})", gbps, "GB/s",
             f"{payload / 1e6:.1f} MB payload ({store.bytes_per_block:,} B/block, fp16, "
             f"{KV_HEADS}x{HEAD_DIM}, bs {BLOCK}) in {t.median_us:,.0f} µs median; {t.spread()}"),
    ]


def _attention_batch(quick: bool):
    """A decode batch of ragged sequences whose blocks are scattered at random over the store."""
    rng = np.random.default_rng(SEED + 1)
    batch, max_len = (8, 256) if quick else (32, 1024)
    lens = rng.integers(max_len // 8, max_len + 1, size=batch)
    nblocks = -(-lens // BLOCK)
    store = KVStore(1, int(nblocks.sum()) + 16, BLOCK, KV_HEADS, HEAD_DIM)
    store.kv[:] = rng.standard_normal(store.kv.shape, dtype=np.float32)
    perm = rng.permutation(store.num_blocks)
    tables = np.full((batch, int(nblocks.max())), -1, dtype=np.int32)
    start = 0
    for i, nb in enumerate(nblocks):
        tables[i, :nb] = perm[start:start + nb]
        start += nb
    k, v = store.gather_padded(0, tables, lens)
    k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
    q = rng.standard_normal((batch, Q_HEADS, HEAD_DIM), dtype=np.float32)
    return store, tables, lens, q, k, v


def _attention_rows(quick: bool) -> list[dict]:
    store, tables, lens, q, k, v = _attention_batch(quick)
    np.testing.assert_allclose(store.paged_attention(0, q, tables, lens), dense_attention(q, k, v, lens),
                               rtol=1e-5, atol=1e-5)  # same numbers, or the timing means nothing
    rep = 10 if quick else 60
    tp = measure(lambda: store.paged_attention(0, q, tables, lens), repeat=rep, warmup=2, max_time_s=8)
    td = measure(lambda: dense_attention(q, k, v, lens), repeat=rep, warmup=2, max_time_s=8)
    shape = (f"batch {len(lens)}, lengths {lens.min()}..{lens.max()} (mean {lens.mean():.0f}), "
             f"GQA {Q_HEADS}/{KV_HEADS} x {HEAD_DIM}, fp32, bs {BLOCK}")
    return [
        _row("paged_attention decode step (numpy)", tp.median_us, "µs", f"{shape}; {tp.spread()}"),
        _row("dense_attention same batch (numpy)", td.median_us, "µs", f"contiguous padded K/V; {td.spread()}"),
        _row("paged / dense attention (numpy)", tp.median_us / td.median_us, "x",
             "the gather through block tables is the whole difference"),
    ]


def rows(quick: bool = False) -> list[dict]:
    """Store rows: copy throughput (numpy, and torch when installed), paged vs dense attention."""
    out = _copy_rows(quick, "numpy")
    if importlib.util.find_spec("torch") is not None:
        out += _copy_rows(quick, "torch")
    out += _attention_rows(quick)
    return out

