"""Kernel exports: block tables and slots in the forms attention kernels take.

Pure functions over rows (one int32 table row per sequence) and counts; the coordinator says
which rows a group exports (live pages only for a group that releases, the scheduled part of a
reserved table). Imports only numpy.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["slots_of", "padded_tables", "flashinfer_rows"]


def slots_of(table: list, start: int, stop: int, bs: int, offsets: np.ndarray | None) -> np.ndarray:
    """Slots (``np.int64``) of positions ``start .. stop - 1`` (validated by the caller): whole
    blocks' slot rows, trimmed. ``offsets`` is ``arange(bs)`` (None for absurd block sizes: then
    one position at a time). Example (block size 4, table [7, 2]): positions 3..6 ->
    [31, 8, 9]."""
    if start == stop:
        return np.empty(0, dtype=np.int64)
    first, last = start // bs, (stop - 1) // bs
    blocks = np.asarray(table[first : last + 1], dtype=np.int64)
    if offsets is None:
        pos = np.arange(start, stop, dtype=np.int64)
        return blocks[pos // bs - first] * bs + pos % bs
    rows = (blocks[:, None] * bs + offsets).ravel()
    lo = start - first * bs
    return rows[lo : lo + stop - start]


def padded_tables(rows: Sequence, pad: int) -> np.ndarray:
    """Rows as one padded ``np.int32[len(rows), max_len]`` array (vLLM's form): one slice copy
    per row, not one Python int per block."""
    width = max(map(len, rows), default=0)
    out = np.full((len(rows), width), pad, dtype=np.int32)
    for row, r in zip(out, rows):
        row[: len(r)] = r
    return out


def flashinfer_rows(rows: Sequence, ntok: np.ndarray, bs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's ``(indptr, indices, last_page_len)``, all int32, from each sequence's pages
    (``rows``) and scheduled positions (``ntok``). Example (page size 4, lengths 10, 4, 5;
    pages [0,1,2], [3], [4,5]): indptr [0, 3, 4, 6], indices [0, 1, 2, 3, 4, 5],
    last_page_len [2, 4, 1]. A sequence with nothing scheduled has no pages and a
    last_page_len of 0."""
    n = len(rows)
    indptr = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, rows), dtype=np.int32, count=n), out=indptr[1:])
    indices = (np.concatenate([np.asarray(r, dtype=np.int32) for r in rows]) if n
               else np.empty(0, dtype=np.int32))
    last_page_len = np.minimum(ntok, (ntok - 1) % bs + 1)
    return indptr, indices, last_page_len
