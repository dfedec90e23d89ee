"""The physical KV store: the tensors the block tables point into.

One array holds every layer's keys and values, shaped ``[layers, 2, num_blocks, block_size,
kv_heads, head_dim]``. Slicing ``[layer, 0]`` gives that layer's key cache in the layout FlashInfer
calls NHD (``[num_pages, page_size, num_heads, head_dim]``), ``[layer, 1]`` its value cache. Keeping
all layers in one array is what lets :meth:`KVStore.copy_blocks` run a step's copy-on-write copies
for every layer at once: one gather and one scatter along the block axis, not ``2 × layers``
kernels.

The store knows nothing of sequences. It takes what the allocator hands out: slot indices
(``slot = block_id * block_size + offset``), block pairs (:class:`~pagedkv.types.CopyOp`), and
block tables. Worked size: Llama-3.1-8B (32 layers, 8 KV heads, head_dim 128, bf16) with 16-token
blocks stores ``2 * 32 * 16 * 8 * 128 * 2 = 2,097,152`` bytes per block (128 KiB per token).

numpy is the default backend; ``backend="torch"`` keeps the tensors in torch (imported only then),
which the model layer uses to avoid a copy per layer.

**The host pool.** ``KVStore(..., host_blocks=N)`` adds ``host_kv``, ``N`` blocks in host memory
with the same per-block layout (``[layers, 2, N, block_size, kv_heads, head_dim]``: a numpy array,
or a CPU torch tensor, pinned when the device pool is on a GPU). It is where a manager with a
host tier (``KVCacheManager(..., host_blocks=N)``) offloads evicted prefixes and swapped-out
sequences: :meth:`KVStore.transfer` runs the list ``take_transfers()`` returned, every
``to_host`` entry as one gather + scatter and then every ``to_device`` entry as another.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from .checks import int_at_least
from .kv_specs import AttentionSpec
from .types import TO_DEVICE, TO_HOST

__all__ = ["KVStore", "dense_attention", "kv_bytes_per_block"]

_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def _torch():
    """Import torch on first use, so that ``import pagedkv.store`` needs only numpy."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - exercised only where torch is absent
        raise ImportError("backend='torch' needs torch (pip install 'pagedkv[model]')") from e
    return torch


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: str = "float32") -> int:
    """Bytes of K and V that one physical block holds across all layers.

    This is what one copy-on-write copy moves. Worked number: the test model (2 layers, 2 KV
    heads, head_dim 16, float32) with 16-token blocks: ``2 * 2 * 16 * 2 * 16 * 4 = 8,192`` bytes.
    """
    for name, v in (("num_layers", num_layers), ("block_size", block_size),
                    ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        int_at_least(name, v, 1)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return 2 * num_layers * block_size * num_kv_heads * head_dim * _DTYPES[dtype]


# ---- backend shims: the handful of array operations whose spelling differs between numpy and torch.


class _NumpyOps:
    name = "numpy"

    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, dtype=np.dtype(dtype))

    @staticmethod
    def index(idx: np.ndarray):
        return idx

    @staticmethod
    def asarray(x, like):
        if type(x).__module__.startswith("torch"):
            x = x.detach().cpu().numpy()
        return np.asarray(x, dtype=like.dtype)

    @staticmethod
    def permute(x, perm):
        return x.transpose(perm)

    @staticmethod
    def swap_last(x):
        return x.swapaxes(-1, -2)

    @staticmethod
    def amax(x):
        return x.max(axis=-1, keepdims=True)

    @staticmethod
    def sum_last(x):
        return x.sum(axis=-1, keepdims=True)

    exp = staticmethod(np.exp)

    @staticmethod
    def masked_fill(x, keep, value):
        return np.where(keep, x, value)

    @staticmethod
    def compute_dtype(x):
        return x.astype(np.float32) if x.dtype == np.float16 else x


class _TorchOps:
    name = "torch"

    def __init__(self, device: str) -> None:
        self.t = _torch()
        self.device = device

    def zeros(self, shape, dtype):
        return self.t.zeros(shape, dtype=getattr(self.t, dtype), device=self.device)

    def index(self, idx: np.ndarray):
        return self.t.from_numpy(np.ascontiguousarray(idx)).to(self.device)

    def asarray(self, x, like):
        return self.t.as_tensor(x, dtype=like.dtype, device=like.device)

    @staticmethod
    def permute(x, perm):
        return x.permute(perm)

    @staticmethod
    def swap_last(x):
        return x.transpose(-1, -2)

    @staticmethod
    def amax(x):
        return x.amax(dim=-1, keepdim=True)

    @staticmethod
    def sum_last(x):
        return x.sum(dim=-1, keepdim=True)

    def exp(self, x):
        return self.t.exp(x)

    def masked_fill(self, x, keep, value):
        return x.masked_fill(~keep, value)

    def compute_dtype(self, x):
        return x.float() if x.dtype in (self.t.float16, self.t.bfloat16) else x


def _bitwise_view(tensor) -> np.ndarray | None:
    """A numpy view of a CPU torch tensor's memory as same-width ints (so bfloat16 works too),
    or None for a tensor on a GPU.

    Why: torch's CPU advanced-index assignment along a middle axis ran ~3-4x slower than
    numpy's on the benchmark shape (256 copies of 512 KiB blocks: ~80 ms vs ~22 ms).
    """
    if tensor.device.type != "cpu":
        return None
    import torch

    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.view(ints).numpy()


def _ops_for(x) -> Any:
    if type(x).__module__.startswith("torch"):
        return _TorchOps(str(x.device))
    return _NumpyOps()


# ---- index validation, shared by every public method


def _as_index(values: Any, name: str) -> np.ndarray:
    """A 1-D or 2-D int64 numpy array from a list, numpy array or torch tensor."""
    if type(values).__module__.startswith("torch"):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.size == 0:
        return arr.astype(np.int64).reshape(arr.shape)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_range(arr: np.ndarray, hi: int, name: str) -> None:
    if arr.size and (arr.min() < 0 or arr.max() >= hi):
        raise ValueError(f"{name} must lie in [0, {hi}), got range [{arr.min()}, {arr.max()}]")


def _copy_waves(pairs: np.ndarray) -> list[tuple[int, int]]:
    """Split copy ops into runs that one gather + scatter may execute without changing the result.

    The allocator's copies are meant to run in order. A gather-then-scatter of a whole run equals
    running it in order unless a later op reads a block an earlier op of the run wrote (a chain
    ``A->B, B->C``, which must see the new ``B``), or two ops write the same block. Such ops start a
    new run. Worked example: ``[(1,5), (2,6), (5,7)]`` -> runs ``[0, 2)`` and ``[2, 3)``. A normal
    step (distinct fresh destinations) is a single run: one vectorised copy.
    """
    runs, start, written = [], 0, set()
    for i, (src, dst) in enumerate(pairs.tolist()):
        if src in written or dst in written:
            runs.append((start, i))
            start, written = i, set()
        written.add(dst)
    if start < len(pairs):
        runs.append((start, len(pairs)))
    return runs


class KVStore:
    """Physical K/V tensors for ``num_layers`` layers, addressed by slot and by block table.

    ``store.write(layer, slots, k, v)`` puts a step's keys/values at the slots the allocator
    returned; ``store.copy_blocks(manager.take_copies())`` runs the queued copy-on-write copies
    (call it before the step's writes); ``store.paged_attention(layer, q, tables, seq_lens)``
    attends straight through block tables. Example: ``KVStore(2, 64, 16, 2, 16)`` holds 64 blocks of
    16 tokens for 2 layers of 2 KV heads × 16 dims; ``nbytes`` is ``2*2*64*16*2*16*4 = 524,288``.

    ``num_groups`` is how many KV cache groups' tables point into it (a hybrid model's): every
    block id holds every layer, and a layer reads only the blocks of its own group's
    table, so one store serves every group and a ``CopyOp(src, dst, group)`` copies the whole block.

    ``host_blocks=N`` adds a host pool of ``N`` blocks (``host_kv``, same layout) and
    ``store.transfer(manager.take_transfers())`` moves blocks between the two (call it before
    ``copy_blocks``). With ``host_blocks=128`` the example's ``host_nbytes`` is 1,048,576 and
    ``nbytes`` 1,572,864.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, *, dtype: str = "float32", backend: str = "numpy",
                 device: str = "cpu", host_blocks: int = 0, num_groups: int = 1) -> None:
        for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks), ("num_groups", num_groups),
                        ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
            int_at_least(name, v, 1)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if backend not in ("numpy", "torch"):
            raise ValueError(f"backend must be 'numpy' or 'torch', got {backend!r}")
        if backend == "numpy" and dtype == "bfloat16":
            raise ValueError("numpy has no bfloat16; use backend='torch' or another dtype")
        if backend == "numpy" and device != "cpu":
            raise ValueError(f"the numpy backend lives on the cpu, got device={device!r}")
        int_at_least("host_blocks", host_blocks, 0)
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        # KV cache groups whose tables point into this store (a hybrid model's; copy ops name them)
        self.num_groups = int(num_groups)
        self.num_kv_heads, self.head_dim, self.dtype, self.backend = num_kv_heads, head_dim, dtype, backend
        self._ops = _TorchOps(device) if backend == "torch" else _NumpyOps()
        self.kv = self._ops.zeros((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype)
        self._copy_view = self._bitwise_numpy_view()
        self.host_blocks = int(host_blocks)
        # The host pool: ``[layers, 2, host_blocks, block_size, kv_heads, head_dim]`` in host
        # memory, or None without one.
        self.host_kv = self._new_host_pool(self.host_blocks)
        self._host_view = None
        if self.host_kv is not None:
            self._host_view = self.host_kv if backend == "numpy" else _bitwise_view(self.host_kv)

    def _bitwise_numpy_view(self):
        """The array ``copy_blocks`` indexes: the store itself, or for torch on the CPU a numpy view
        of the same memory (see :func:`_bitwise_view`)."""
        return self.kv if self.backend == "numpy" else _bitwise_view(self.kv)

    def _new_host_pool(self, host_blocks: int):
        """``host_blocks`` blocks in host memory, laid out like the device pool (None for 0)."""
        if not host_blocks:
            return None
        shape = (self.num_layers, 2, host_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if self.backend == "numpy":
            return np.zeros(shape, dtype=np.dtype(self.dtype))
        t = self._ops.t
        pin = self.kv.device.type == "cuda"  # page-locked, so host<->device copies can run async
        return t.zeros(shape, dtype=getattr(t, self.dtype), device="cpu", pin_memory=pin)

    # ---- sizes

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block holds across all layers, K and V: what one CoW copy moves."""
        return kv_bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads,
                                  self.head_dim, self.dtype)

    @property
    def device_nbytes(self) -> int:
        """Bytes of the device pool (``num_blocks * bytes_per_block``)."""
        return self.num_blocks * self.bytes_per_block

    @property
    def host_nbytes(self) -> int:
        """Bytes of the host pool (``host_blocks * bytes_per_block``; 0 without one)."""
        return self.host_blocks * self.bytes_per_block

    @property
    def nbytes(self) -> int:
        """Size of the whole store in bytes: ``device_nbytes + host_nbytes`` (the device pool
        alone when there is no host pool)."""
        return self.device_nbytes + self.host_nbytes

    def key_cache(self, layer: int):
        """Layer ``layer``'s key cache, NHD: ``[num_blocks, block_size, kv_heads, head_dim]`` (a view)."""
        self._check_layer(layer)
        return self.kv[layer, 0]

    def value_cache(self, layer: int):
        """Layer ``layer``'s value cache, NHD (a view)."""
        self._check_layer(layer)
        return self.kv[layer, 1]

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")

    # ---- writes and copies

    def write(self, layer: int, slots: Any, k: Any, v: Any) -> None:
        """Store one step's keys and values: token ``i``'s K/V (``[kv_heads, head_dim]``) at ``slots[i]``.

        ``k`` and ``v`` are ``[len(slots), kv_heads, head_dim]`` (numpy or torch; converted to the
        store's backend and dtype). Slots must be distinct: two tokens of one step never share a
        slot, and if they did the result would depend on the scatter order.
        """
        self._check_layer(layer)
        idx = _as_index(slots, "slots")
        if idx.ndim != 1:
            raise ValueError(f"slots must be 1-D, got shape {idx.shape}")
        _check_range(idx, self.num_slots, "slots")
        if np.unique(idx).size != idx.size:
            raise ValueError("slots must be distinct within one write")
        want = (idx.size, self.num_kv_heads, self.head_dim)
        kk, vv = self._ops.asarray(k, self.kv), self._ops.asarray(v, self.kv)
        if tuple(kk.shape) != want or tuple(vv.shape) != want:
            raise ValueError(f"k and v must be {want}, got {tuple(kk.shape)} and {tuple(vv.shape)}")
        flat_shape = (self.num_slots, self.num_kv_heads, self.head_dim)
        where = self._ops.index(idx)
        self.kv[layer, 0].reshape(flat_shape)[where] = kk
        self.kv[layer, 1].reshape(flat_shape)[where] = vv

    def copy_blocks(self, copy_ops: Iterable[Sequence[int]]) -> int:
        """Run copy-on-write copies (``dst[:] = src[:]``) for every layer, K and V; return bytes moved.

        ``copy_ops`` is what ``KVCacheManager.take_copies()`` returned (``CopyOp(src, dst)`` tuples;
        any ``[n, 2]`` int array works; a grouped manager's ``CopyOp(src, dst, group)`` too: this
        store gives every block id every layer, so copying the whole block serves any group). All layers move in one gather + scatter along the block
        axis. Ops run in their given order (chained ops are split into successive vectorised runs,
        see :func:`_copy_waves`). Worked number: 3 copies in the test model with 16-token blocks
        move ``3 * 8,192 = 24,576`` bytes.
        """
        pairs = _as_index(list(copy_ops), "copy_ops")
        if pairs.size == 0:
            return 0
        if pairs.ndim == 2 and pairs.shape[1] == 3:  # CopyOp(src, dst, group) of a grouped manager:
            _check_range(pairs[:, 2], self.num_groups, "copy_ops groups (the store's num_groups)")
            pairs = pairs[:, :2]  # every block holds every layer here, so any group's copy is whole
        if pairs.ndim != 2 or pairs.shape[1] != 2:
            raise ValueError(f"copy_ops must be (src, dst) pairs, got shape {pairs.shape}")
        _check_range(pairs, self.num_blocks, "copy_ops block ids")
        kv, index = (self.kv, self._ops.index) if self._copy_view is None else (self._copy_view, np.asarray)
        for start, end in _copy_waves(pairs):
            src, dst = index(pairs[start:end, 0]), index(pairs[start:end, 1])
            kv[:, :, dst] = kv[:, :, src]
        return len(pairs) * self.bytes_per_block

    def transfer(self, transfers: Iterable[Sequence[Any]]) -> int:
        """Move blocks between the device pool and the host pool; return bytes moved.

        ``transfers`` is what ``KVCacheManager.take_transfers()`` returned: ``Transfer(direction,
        src, dst)`` tuples (any ``(direction, src, dst)`` triples work), every ``"to_host"`` entry
        (device block ``src`` -> host block ``dst``) before every ``"to_device"`` entry (host
        ``src`` -> device ``dst``). Each direction runs as one gather + scatter along the block
        axis, all layers' K and V at once, ``to_host`` first: a device block that leaves for the
        host may be the very block a ``to_device`` entry then fills. Everything is checked
        before anything moves (a bad direction, an id out of range, a destination twice in one
        direction, a ``to_host`` after a ``to_device``, a store without a host pool): ValueError,
        nothing written. Worked number: 3 transfers in the test model with 16-token blocks move
        ``3 * 8,192 = 24,576`` bytes.
        """
        out_pairs, in_pairs = self._check_transfers(transfers)
        if len(out_pairs):
            self._move_blocks(to_host=True, src=out_pairs[:, 0], dst=out_pairs[:, 1])
        if len(in_pairs):
            self._move_blocks(to_host=False, src=in_pairs[:, 0], dst=in_pairs[:, 1])
        return (len(out_pairs) + len(in_pairs)) * self.bytes_per_block

    def _check_transfers(self, transfers: Iterable[Sequence[Any]]) -> tuple[np.ndarray, np.ndarray]:
        """The ``to_host`` and the ``to_device`` entries as ``[n, 2]`` int64 (src, dst) arrays."""
        entries = list(transfers)
        if not entries:
            empty = np.empty((0, 2), dtype=np.int64)
            return empty, empty
        if self.host_kv is None:
            raise ValueError("this store has no host pool: make it with host_blocks=N to run transfers")
        directions = []
        for e in entries:
            if isinstance(e, (str, bytes)) or not hasattr(e, "__len__") or len(e) != 3:
                raise ValueError(f"a transfer is (direction, src, dst), got {e!r}")
            if not isinstance(e[0], str) or e[0] not in (TO_HOST, TO_DEVICE):
                raise ValueError(f"a transfer's direction is {TO_HOST!r} or {TO_DEVICE!r}, got {e[0]!r}")
            if any(isinstance(b, bool) for b in e[1:]):
                raise ValueError(f"transfer block ids must be ints, got {e!r}")
            directions.append(e[0] == TO_HOST)
        outgoing = np.asarray(directions, dtype=bool)
        n_out = int(outgoing.sum())
        if not outgoing[:n_out].all():
            raise ValueError(f"every {TO_HOST!r} transfer must come before every {TO_DEVICE!r} one "
                             "(take_transfers() lists them so)")
        pairs = _as_index([tuple(e[1:]) for e in entries], "transfer block ids")
        out_pairs, in_pairs = pairs[:n_out], pairs[n_out:]
        for what, arr, hi in (("to_host sources (device blocks)", out_pairs[:, 0], self.num_blocks),
                              ("to_host destinations (host blocks)", out_pairs[:, 1], self.host_blocks),
                              ("to_device sources (host blocks)", in_pairs[:, 0], self.host_blocks),
                              ("to_device destinations (device blocks)", in_pairs[:, 1], self.num_blocks)):
            _check_range(arr, hi, what)
        for what, dst in ((TO_HOST, out_pairs[:, 1]), (TO_DEVICE, in_pairs[:, 1])):
            if np.unique(dst).size != dst.size:
                raise ValueError(f"a block is the destination of two {what!r} transfers: one batch "
                                 "would write it in an undefined order")
        return out_pairs, in_pairs

    def _move_blocks(self, to_host: bool, src: np.ndarray, dst: np.ndarray) -> None:
        """One batched gather + scatter of whole blocks between the pools."""
        if self._copy_view is not None:  # numpy, or torch on the CPU: numpy views of both pools
            device, host = self._copy_view, self._host_view
            if to_host:
                host[:, :, dst] = device[:, :, src]
            else:
                device[:, :, dst] = host[:, :, src]
            return
        t = self._ops.t  # torch on a GPU: one gather on the source side, one copy, one scatter
        cpu = lambda idx: t.from_numpy(np.ascontiguousarray(idx))  # noqa: E731
        if to_host:
            rows = self.kv.index_select(2, self._ops.index(src)).to("cpu")
            self.host_kv.index_copy_(2, cpu(dst), rows)
        else:
            rows = self.host_kv.index_select(2, cpu(src)).to(self.kv.device, non_blocking=True)
            self.kv.index_copy_(2, self._ops.index(dst), rows)

    # ---- reads

    def gather(self, layer: int, block_table: Any, num_tokens: int):
        """One sequence's K and V, ``[num_tokens, kv_heads, head_dim]`` each, in logical order.

        Position ``p`` lives in block ``block_table[p // block_size]`` at offset
        ``p % block_size``. Only the first ``ceil(num_tokens / block_size)`` entries are read.
        """
        self._check_layer(layer)
        table = _as_index(block_table, "block_table")
        if table.ndim != 1:
            raise ValueError(f"block_table must be 1-D, got shape {table.shape}")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        need = -(-num_tokens // self.block_size)
        if need > table.size:
            raise ValueError(f"{num_tokens} tokens need {need} blocks, the table has {table.size}")
        _check_range(table[:need], self.num_blocks, "block_table entries")
        where = self._ops.index(table[:need])
        shape = (need * self.block_size, self.num_kv_heads, self.head_dim)
        k = self.kv[layer, 0][where].reshape(shape)[:num_tokens]
        v = self.kv[layer, 1][where].reshape(shape)[:num_tokens]
        return k, v

    def gather_padded(self, layer: int, block_tables: Any, seq_lens: Any, first_blocks: Any = None):
        """K and V of a batch, padded to ``[batch, max(seq_lens), kv_heads, head_dim]``.

        ``block_tables`` is ``[batch, max_blocks]`` (``KVCacheManager.block_tables``, pad ``-1``);
        entries past a sequence's ``ceil(len / block_size)`` blocks are never read (their rows come
        back as block 0's data, which attention masks out).

        ``first_blocks`` (one per sequence, default all 0) skips the blocks below it: row 0 of
        sequence ``i`` is then position ``first_blocks[i] * block_size``, the rows are padded to
        the longest remainder, and the skipped entries are never read, so they may be -1 (a
        sliding-window group's released blocks). Example (block size 4, a table ``[-1, -1, 7,
        9]``, 15 tokens, first block 2): rows 0 .. 6 are positions 8 .. 14, from blocks 7 and 9.
        """
        self._check_layer(layer)
        tables, lens = self._check_tables(block_tables, seq_lens, first_blocks)
        need = -(-lens // self.block_size)
        lo = np.zeros_like(lens) if first_blocks is None else _as_index(first_blocks, "first_blocks")
        width = int((need - lo).max(initial=0))
        col = lo[:, None] + np.arange(width)[None, :]
        inside = col < need[:, None]
        safe = np.where(inside, np.take_along_axis(tables, np.minimum(col, max(tables.shape[1] - 1, 0)), 1), 0)
        where = self._ops.index(safe)
        shape = (len(lens), width * self.block_size, self.num_kv_heads, self.head_dim)
        max_len = int((lens - lo * self.block_size).max(initial=0))
        k = self.kv[layer, 0][where].reshape(shape)[:, :max_len]
        v = self.kv[layer, 1][where].reshape(shape)[:, :max_len]
        return k, v

    def check_batch(self, slots: Any, block_tables: Any, seq_lens: Any, query_lens: Any = None,
                    spec: Any = None) -> None:
        """Raise ValueError unless a step's slots and block tables are valid for this store.

        A model calls this before its first write, so that a bad step fails before any layer's
        K/V was changed (``write`` and ``paged_attention`` check again, per call). With an
        attention ``spec`` (``pagedkv.kv_specs``) only the table entries that the step's queries
        read are checked: those below the first block the earliest query reads may be -1.
        """
        idx = _as_index(slots, "slots")
        if idx.ndim != 1:
            raise ValueError(f"slots must be 1-D, got shape {idx.shape}")
        _check_range(idx, self.num_slots, "slots")
        if np.unique(idx).size != idx.size:
            raise ValueError("slots must be distinct within one step")
        lens = _as_index(seq_lens, "seq_lens")
        first = None if spec is None else self.first_blocks(spec, lens, query_lens)
        self._check_tables(block_tables, seq_lens, first)

    def first_blocks(self, spec: Any, seq_lens: Any, query_lens: Any = None) -> np.ndarray | None:
        """Per sequence, the first block that a step's earliest query reads under ``spec`` (an
        attention spec of ``pagedkv.kv_specs``), or None when every query reads from position 0.

        Sequence ``i``'s earliest query is position ``seq_lens[i] - query_lens[i]``. Example
        (block size 4, ``SlidingWindow(7)``, a decode step at 21 tokens): the query at 20 reads
        14 .. 20, so block 3 (positions 12 .. 15) is the first read and blocks 0 .. 2 may be -1.
        """
        lens = _as_index(seq_lens, "seq_lens").reshape(-1)
        qlens = np.ones_like(lens) if query_lens is None else _as_index(query_lens, "query_lens").reshape(-1)
        if not _windowed(spec):  # full attention: everything from position 0
            return None
        if qlens.shape != lens.shape:
            raise ValueError(f"query_lens must have one entry per sequence, got {qlens.shape} vs {lens.shape}")
        starts = np.maximum(lens - qlens, 0).tolist()
        return np.array([spec.first_read(q) // self.block_size for q in starts], dtype=np.int64)

    def _check_tables(self, block_tables: Any, seq_lens: Any,
                      first_blocks: Any = None) -> tuple[np.ndarray, np.ndarray]:
        tables = _as_index(block_tables, "block_tables")
        lens = _as_index(seq_lens, "seq_lens")
        if tables.ndim != 2 or lens.ndim != 1 or tables.shape[0] != lens.shape[0]:
            raise ValueError(f"block_tables must be [batch, blocks] and seq_lens [batch], got "
                             f"{tables.shape} and {lens.shape}")
        if lens.size and lens.min() < 0:
            raise ValueError("seq_lens must be >= 0")
        need = -(-lens // self.block_size)
        if lens.size and need.max() > tables.shape[1]:
            raise ValueError(f"a sequence of {lens.max()} tokens needs {need.max()} blocks, "
                             f"the tables have {tables.shape[1]} columns")
        cols = np.arange(tables.shape[1])[None, :]
        used = cols < need[:, None]
        if first_blocks is not None:
            lo = _as_index(first_blocks, "first_blocks").reshape(-1)
            if lo.shape != lens.shape or (lo.size and (lo.min() < 0 or (lo > need).any())):
                raise ValueError(f"first_blocks must be one block index per sequence in [0, blocks "
                                 f"needed], got {lo.tolist()}")
            used &= cols >= lo[:, None]
        read = tables[used]
        if read.size and read.min() < 0:
            row, col = (int(a[0]) for a in np.nonzero(used & (tables < 0)))
            raise ValueError(f"block table entry {col} of sequence {row} is {int(tables[row, col])} "
                             f"(released or padding), but this step's attention reads it")
        _check_range(read, self.num_blocks, "block table entries")
        return tables, lens

    def paged_attention(self, layer: int, q: Any, block_tables: Any, seq_lens: Any,
                        query_lens: Any = None, scale: float | None = None, *, spec: Any = None):
        """Causal attention for a batch, reading K/V straight through the block tables.

        ``q`` is ``[sum(query_lens), num_heads, head_dim]``: sequence ``i``'s queries are its last
        ``query_lens[i]`` positions (default 1 each: a decode step), so query ``j`` of sequence ``i``
        sits at position ``seq_lens[i] - query_lens[i] + j`` and sees keys ``0..`` that position.
        That covers decode, prefill, and prefill after a prefix-cache hit (queries only for the
        uncached tail). ``num_heads`` must be a multiple of ``kv_heads`` (grouped-query attention:
        head ``h`` reads KV head ``h // (num_heads // kv_heads)``). Returns ``[sum(query_lens),
        num_heads, head_dim]`` in the store's backend.

        ``spec`` (``pagedkv.kv_specs``; default full attention) narrows what each query reads:
        ``SlidingWindow(W)`` positions q-W+1 .. q, ``ChunkedLocalAttention(C)`` floor(q/C)*C .. q.
        Only the blocks from the earliest query's first read on are gathered (see
        :meth:`first_blocks`), so the entries below may be -1 (released) and a decode step costs
        the window, not the context: ``SlidingWindow(128)``, block size 16, a decode at position 4,096 reads
        9 blocks (3,968 .. 4,111) instead of 257.
        """
        lens = _as_index(seq_lens, "seq_lens")
        first = self.first_blocks(spec, lens, query_lens)
        k, v = self.gather_padded(layer, block_tables, lens, first)
        offsets = None if first is None else first * self.block_size
        return dense_attention(self._ops.asarray(q, self.kv), k, v, lens, query_lens, scale,
                               spec=spec, key_offsets=offsets)


def _windowed(spec: Any) -> bool:
    """Whether an attention ``spec`` reads less than the whole prefix (None: full attention)."""
    if spec is None:
        return False
    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"spec must be an attention spec of pagedkv.kv_specs or None, got {spec!r}")
    return not spec.reads_whole_prefix


def _query_layout(seq_lens: np.ndarray, query_lens: Any, num_q: int):
    """Per query token: its sequence, its row in the padded query block, its absolute position."""
    qlens = np.ones_like(seq_lens) if query_lens is None else _as_index(query_lens, "query_lens")
    if qlens.shape != seq_lens.shape:
        raise ValueError(f"query_lens must have one entry per sequence, got {qlens.shape} vs {seq_lens.shape}")
    if qlens.size and (qlens.min() < 0 or (qlens > seq_lens).any()):
        raise ValueError("query_lens must satisfy 0 <= query_lens <= seq_lens")
    if int(qlens.sum()) != num_q:
        raise ValueError(f"q has {num_q} tokens but query_lens sum to {int(qlens.sum())}")
    seq = np.repeat(np.arange(len(qlens)), qlens)
    row = np.arange(num_q) - np.repeat(np.cumsum(qlens) - qlens, qlens)
    return qlens, seq, row


def dense_attention(q: Any, k: Any, v: Any, seq_lens: Any, query_lens: Any = None,
                    scale: float | None = None, *, spec: Any = None, key_offsets: Any = None):
    """Causal GQA attention over padded, contiguous K/V: the kernel paged attention reduces to.

    ``k``/``v`` are ``[batch, max_len, kv_heads, head_dim]`` (rows past ``seq_lens[i]`` ignored);
    ``q`` and the query convention are as in :meth:`KVStore.paged_attention`. ``scale`` defaults to
    ``head_dim ** -0.5`` (0.25 for head_dim 16). numpy or torch in, the same out; half precision is
    computed in float32. Softmax subtracts the row max, so a fully-visible row of equal scores gives
    exactly uniform weights.

    ``spec`` (an attention spec of ``pagedkv.kv_specs``; None is full attention) masks keys below
    ``spec.first_read(q)`` as well; ``key_offsets[i]`` (default 0) is the position of sequence
    ``i``'s row 0 (a window gathered from its first block: ``seq_lens[i] - key_offsets[i]`` rows).
    """
    ops = _ops_for(k)
    q = ops.asarray(q, k)
    offsets = None if key_offsets is None else _as_index(key_offsets, "key_offsets").reshape(-1)
    lens = _check_attention_shapes(q, k, v, seq_lens, offsets)
    qlens, seq, row = _query_layout(lens, query_lens, int(q.shape[0]))
    if q.shape[0] == 0:
        return q[:0]
    scale = int(k.shape[3]) ** -0.5 if scale is None else float(scale)
    out_dtype = q.dtype
    q, k, v = ops.compute_dtype(q), ops.compute_dtype(k), ops.compute_dtype(v)
    batch, max_len, kv_heads, dim = (int(s) for s in k.shape)
    heads, qmax = int(q.shape[1]), int(qlens.max())
    group = heads // kv_heads
    # queries padded per sequence, grouped under their KV head: [batch, kv_heads, group * qmax, dim]
    qp = ops.zeros((batch, qmax, heads, dim), dtype_name(q.dtype))
    qp[ops.index(seq), ops.index(row)] = q
    qp = ops.permute(qp.reshape(batch, qmax, kv_heads, group, dim), (0, 2, 3, 1, 4))
    qp = qp.reshape(batch, kv_heads, group * qmax, dim)
    kt, vt = ops.permute(k, (0, 2, 1, 3)), ops.permute(v, (0, 2, 1, 3))  # [batch, kv_heads, len, dim]
    scores = ((qp @ ops.swap_last(kt)) * scale).reshape(batch, kv_heads, group, qmax, max_len)
    qpos = (lens - qlens)[:, None] + np.arange(qmax)[None, :]  # [batch, qmax]
    kpos = np.arange(max_len)[None, :] if offsets is None else offsets[:, None] + np.arange(max_len)
    keep = kpos[:, None, :] <= qpos[:, :, None]  # causal; implies key < seq_len
    if _windowed(spec):  # a window or chunk: a lower bound too
        last = np.minimum(qpos, (lens - 1)[:, None])  # padded query rows: keep them finite
        low = np.array([spec.first_read(p) for p in last.ravel().tolist()]).reshape(qpos.shape)
        keep &= kpos[:, None, :] >= low[:, :, None]
    scores = ops.masked_fill(scores, ops.index(keep[:, None, None]), -np.inf)
    weights = ops.exp(scores - ops.amax(scores))
    weights = weights / ops.sum_last(weights)
    out = weights.reshape(batch, kv_heads, group * qmax, max_len) @ vt
    out = ops.permute(out.reshape(batch, kv_heads, group, qmax, dim), (0, 3, 1, 2, 4))
    out = out.reshape(batch, qmax, heads, dim)[ops.index(seq), ops.index(row)]
    return out.astype(out_dtype) if ops.name == "numpy" else out.to(out_dtype)


def _check_attention_shapes(q, k, v, seq_lens, offsets=None) -> np.ndarray:
    """Validate ``q [tokens, heads, dim]`` against padded ``k``/``v``; return ``seq_lens`` as int64."""
    lens = _as_index(seq_lens, "seq_lens")
    if q.ndim != 3 or k.ndim != 4 or tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"q must be [tokens, heads, dim], k/v [batch, len, kv_heads, dim]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, max_len, kv_heads, dim = (int(s) for s in k.shape)
    if int(q.shape[2]) != dim or int(q.shape[1]) % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit k {tuple(k.shape)}: same head_dim, "
                         "and heads a multiple of kv_heads")
    rows = lens if offsets is None or offsets.shape != lens.shape else lens - offsets
    if offsets is not None and (offsets.shape != lens.shape or (offsets.size and offsets.min() < 0)):
        raise ValueError(f"key_offsets must be {batch} positions >= 0, got {offsets.tolist()}")
    if lens.shape != (batch,) or (lens.size and (rows.min() < 0 or rows.max() > max_len)):
        raise ValueError(f"seq_lens must be {batch} lengths in [0, {max_len}] (after key_offsets), "
                         f"got {lens.tolist()}")
    return lens


def dtype_name(dtype: Any) -> str:
    """A dtype's name, whichever library spells it: ``"float32"`` from ``"float32"``,
    ``np.float32``, ``np.dtype("float32")`` or ``torch.float32`` (an array's: ``x.dtype``).
    ValueError for what is not a dtype."""
    if isinstance(dtype, str) or type(dtype).__module__.startswith("torch"):
        return str(dtype).removeprefix("torch.")
    try:
        return np.dtype(dtype).name
    except TypeError as e:
        raise ValueError(f"not a dtype: {dtype!r}") from e
