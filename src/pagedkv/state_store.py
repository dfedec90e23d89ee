"""The physical state store: the per-sequence states of a recurrent-state group's layers.

A recurrent layer (gated DeltaNet, Mamba) carries a fixed-size state from one position to the
next instead of every position's K/V. This store holds those states in blocks of their own: one
block holds one sequence's state after one position, for every layer of the group: a conv state
of ``conv_shape`` (gated DeltaNet and Mamba2: ``[conv_dim, kernel - 1]``, the convolution's last
inputs) and a recurrent state of ``recurrent_shape`` (DeltaNet ``[v_heads, k_head_dim,
v_head_dim]``, Mamba2 ``[heads, head_dim, state_size]``) per layer, in two arrays ``conv [layers,
num_blocks, *conv_shape]`` and ``recurrent [layers, num_blocks, *recurrent_shape]``.

The store knows nothing of sequences or intervals. It takes the block ids the allocator hands
out for a state group (``state_indices``' read and write ids, ``CopyOp(src, dst, group=g)``,
``Transfer(..., group=g)``) and ignores the copies and transfers of other groups: those are the
K/V store's. Block ids are the manager's one pool's, so the store has as many blocks as the pool;
an id holds a state only while the state group owns it. Worked size: the test model's 3 DeltaNet
layers (conv state ``[64, 3]``, recurrent ``[4, 8, 8]``) in float32 take ``3 * (192 + 256) * 4 =
5,376`` bytes per block; Qwen3-Next-80B's 36 take 36 x 2.09 MiB = 75.4 MiB.

numpy is the default backend; ``backend="torch"`` keeps the arrays in torch (imported only then)
on ``device``. ``host_blocks=N`` adds a host pool of the same layout (``host_conv``,
``host_recurrent``; numpy, or CPU torch tensors, pinned when the device pool is on a GPU) for the
manager's host tier; :meth:`StateStore.transfer` runs the list ``take_transfers()`` returned.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from .store import _as_index, _check_range, _copy_waves, _torch
from .types import TO_DEVICE, TO_HOST

__all__ = ["StateStore"]

_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _check_positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


class StateStore:
    """Recurrent states of ``num_layers`` layers, one sequence's state per block id.

    ``read(layer, blocks)`` gathers a batch's initial states (block -1 reads zeros: a sequence at
    position 0), ``write(layer, blocks, conv, recurrent)`` scatters its final states,
    ``copy_blocks(manager.take_copies())`` runs the copy-on-write copies of this store's
    ``group`` (call it before the step), ``transfer(manager.take_transfers())`` the host moves.
    Example: ``StateStore(3, 64, conv_shape=(64, 3), recurrent_shape=(4, 8, 8))`` holds 64 blocks
    of ``3 * (64 * 3 + 4 * 8 * 8) * 4 = 5,376`` bytes: ``nbytes`` 344,064.
    """

    def __init__(self, num_layers: int, num_blocks: int, *, conv_shape: Sequence[int],
                 recurrent_shape: Sequence[int], dtype: str = "float32", host_blocks: int = 0,
                 group: int = 1, backend: str = "numpy", device: str = "cpu") -> None:
        for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks)):
            _check_positive_int(name, v)
        for name, shape in (("conv_shape", conv_shape), ("recurrent_shape", recurrent_shape)):
            if isinstance(shape, (str, bytes)) or not isinstance(shape, (tuple, list)) or not shape:
                raise ValueError(f"{name} must be a tuple of positive ints, got {shape!r}")
            for v in shape:
                _check_positive_int(name + " entries", v)
        _check_positive_int("host_blocks", host_blocks, 0)
        _check_positive_int("group", group, 1)  # group 0 is always an attention group
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype!r}")
        if backend not in ("numpy", "torch"):
            raise ValueError(f"backend must be 'numpy' or 'torch', got {backend!r}")
        if backend == "numpy" and (dtype == "bfloat16" or device != "cpu"):
            raise ValueError("the numpy backend lives on the cpu and has no bfloat16; use backend='torch'")
        self.backend, self.device = backend, device
        self._t = _torch() if backend == "torch" else None
        self.num_layers, self.num_blocks, self.group = int(num_layers), int(num_blocks), int(group)
        self.conv_shape = tuple(int(v) for v in conv_shape)
        self.recurrent_shape = tuple(int(v) for v in recurrent_shape)
        self.dtype, self.host_blocks = dtype, int(host_blocks)
        self.conv, self.recurrent = self._pool(self.num_blocks)
        self.host_conv, self.host_recurrent = self._pool(self.host_blocks, host=True) if host_blocks else (None, None)

    def _zeros(self, shape: tuple, host: bool = False):
        if self._t is None:
            return np.zeros(shape, dtype=self.dtype)
        t = self._t
        if not host:
            return t.zeros(shape, dtype=getattr(t, self.dtype), device=self.device)
        pin = t.device(self.device).type == "cuda"  # page-locked, so host<->device copies can run async
        return t.zeros(shape, dtype=getattr(t, self.dtype), device="cpu", pin_memory=pin)

    def _pool(self, blocks: int, host: bool = False) -> tuple[Any, Any]:
        return (self._zeros((self.num_layers, blocks, *self.conv_shape), host),
                self._zeros((self.num_layers, blocks, *self.recurrent_shape), host))

    def _index(self, idx: np.ndarray, host: bool = False):
        """Block ids as the backend indexes with them (a tensor on the pool's device for torch)."""
        if self._t is None:
            return idx
        return self._t.from_numpy(np.ascontiguousarray(idx, dtype=np.int64)).to("cpu" if host else self.device)

    def _like_pool(self, x: Any):
        """``x`` (numpy or torch) in the pool's backend, dtype and device."""
        if self._t is None:
            if type(x).__module__.startswith("torch"):
                x = x.detach().cpu().float().numpy()
            return np.asarray(x, dtype=self.dtype)
        return self._t.as_tensor(np.asarray(x) if isinstance(x, (list, tuple)) else x,
                                 dtype=getattr(self._t, self.dtype), device=self.device)

    # ---- sizes

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block holds across all layers: what one copy or one transfer moves."""
        values = int(np.prod(self.conv_shape)) + int(np.prod(self.recurrent_shape))
        return self.num_layers * values * (2 if self.dtype == "bfloat16" else np.dtype(self.dtype).itemsize)

    @property
    def nbytes(self) -> int:
        """The device pool and the host pool, in bytes."""
        return (self.num_blocks + self.host_blocks) * self.bytes_per_block

    # ---- reads and writes

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")

    def check_reads(self, blocks: Any) -> np.ndarray:
        """``blocks`` as a 1-D int64 array of ids in [-1, num_blocks) (-1: a zero state), else
        ValueError."""
        idx = _as_index(blocks, "read blocks").reshape(-1)
        if idx.size and (idx.min() < -1 or idx.max() >= self.num_blocks):
            raise ValueError(f"read blocks must lie in [-1, {self.num_blocks}), got {idx.tolist()}")
        return idx

    def check_writes(self, blocks: Any) -> np.ndarray:
        """``blocks`` as a 1-D int64 array of distinct ids in [0, num_blocks), else ValueError:
        two sequences of one step never write one block (the result would depend on order)."""
        idx = _as_index(blocks, "write blocks").reshape(-1)
        _check_range(idx, self.num_blocks, "write blocks")
        if np.unique(idx).size != idx.size:
            raise ValueError(f"write blocks must be distinct within one step, got {idx.tolist()}")
        return idx

    def read(self, layer: int, blocks: Any) -> tuple[np.ndarray, np.ndarray]:
        """A batch's states in one layer: conv ``[n, *conv_shape]`` and recurrent
        ``[n, *recurrent_shape]`` (copies), zeros where a block is -1."""
        self._check_layer(layer)
        idx = self.check_reads(blocks)
        rows = self._index(np.nonzero(idx >= 0)[0])
        blocks = self._index(idx[idx >= 0])
        conv, rec = self._zeros((idx.size, *self.conv_shape)), self._zeros((idx.size, *self.recurrent_shape))
        conv[rows], rec[rows] = self.conv[layer, blocks], self.recurrent[layer, blocks]
        return conv, rec

    def write(self, layer: int, blocks: Any, conv: Any, recurrent: Any) -> None:
        """Store a batch's final states in one layer: sequence i's at ``blocks[i]``."""
        self._check_layer(layer)
        idx = self.check_writes(blocks)
        conv, recurrent = self._like_pool(conv), self._like_pool(recurrent)
        want = (idx.size, *self.conv_shape), (idx.size, *self.recurrent_shape)
        if (tuple(conv.shape), tuple(recurrent.shape)) != want:
            raise ValueError(f"states must be {want[0]} and {want[1]}, got {tuple(conv.shape)} and "
                             f"{tuple(recurrent.shape)}")
        where = self._index(idx)
        self.conv[layer, where], self.recurrent[layer, where] = conv, recurrent

    # ---- copies and transfers

    def _mine(self, entries: Iterable[Any]) -> list:
        """The entries (``CopyOp``s, ``Transfer``s) of this store's group; plain tuples carry
        group 0, an attention group's."""
        return [e for e in entries if getattr(e, "group", 0) == self.group]

    def copy_blocks(self, copy_ops: Iterable[Sequence[int]]) -> int:
        """Run this group's copy-on-write copies (``dst[:] = src[:]``, every layer's conv and
        recurrent state), in order; return bytes moved. Copies of other groups are skipped.
        Worked number: one fork's copy in the test model moves 5,376 bytes."""
        pairs = _as_index([tuple(op) for op in self._mine(copy_ops)], "copy_ops")
        if pairs.size == 0:
            return 0
        if pairs.ndim != 2 or pairs.shape[1] != 2:
            raise ValueError(f"copy_ops must be (src, dst) pairs, got shape {pairs.shape}")
        _check_range(pairs, self.num_blocks, "copy_ops block ids")
        for start, end in _copy_waves(pairs):
            src, dst = self._index(pairs[start:end, 0]), self._index(pairs[start:end, 1])
            self.conv[:, dst], self.recurrent[:, dst] = self.conv[:, src], self.recurrent[:, src]
        return len(pairs) * self.bytes_per_block

    def transfer(self, transfers: Iterable[Sequence[Any]]) -> int:
        """Move this group's blocks between the device pool and the host pool; return bytes moved.

        ``transfers`` is ``take_transfers()``' list; entries of other groups are skipped. Every
        ``to_host`` entry (device ``src`` -> host ``dst``) runs before every ``to_device`` entry
        (host ``src`` -> device ``dst``). Everything is checked before anything moves.
        """
        mine = self._mine(transfers)
        if not mine:
            return 0
        if not self.host_blocks:
            raise ValueError("this store has no host pool: make it with host_blocks=N to run transfers")
        for e in mine:
            if len(e) != 3 or e[0] not in (TO_HOST, TO_DEVICE):
                raise ValueError(f"a transfer is ({TO_HOST!r} or {TO_DEVICE!r}, src, dst), got {e!r}")
        out = _as_index([e[1:] for e in mine if e[0] == TO_HOST], "transfer block ids").reshape(-1, 2)
        into = _as_index([e[1:] for e in mine if e[0] == TO_DEVICE], "transfer block ids").reshape(-1, 2)
        if out.size and into.size and [e[0] for e in mine].index(TO_DEVICE) < len(out):
            raise ValueError(f"every {TO_HOST!r} transfer must come before every {TO_DEVICE!r} one")
        for what, arr, hi in (("to_host sources", out[:, 0], self.num_blocks),
                              ("to_host destinations", out[:, 1], self.host_blocks),
                              ("to_device sources", into[:, 0], self.host_blocks),
                              ("to_device destinations", into[:, 1], self.num_blocks)):
            _check_range(arr, hi, what)
        for what, dst in ((TO_HOST, out[:, 1]), (TO_DEVICE, into[:, 1])):
            if np.unique(dst).size != dst.size:
                raise ValueError(f"a block is the destination of two {what!r} transfers")
        to_cpu = (lambda x: x) if self._t is None else (lambda x: x.to("cpu"))
        to_device = (lambda x: x) if self._t is None else (lambda x: x.to(self.device, non_blocking=True))
        device_src, host_dst = self._index(out[:, 0]), self._index(out[:, 1], host=True)
        self.host_conv[:, host_dst] = to_cpu(self.conv[:, device_src])
        self.host_recurrent[:, host_dst] = to_cpu(self.recurrent[:, device_src])
        host_src, device_dst = self._index(into[:, 0], host=True), self._index(into[:, 1])
        self.conv[:, device_dst] = to_device(self.host_conv[:, host_src])
        self.recurrent[:, device_dst] = to_device(self.host_recurrent[:, host_src])
        return (len(out) + len(into)) * self.bytes_per_block
