"""Argument coercion: what the manager accepts as token ids, sequence ids and constructor
arguments, turned into the forms its hot paths use, or a ``ValueError`` that names the argument.

Every public call validates its arguments before it changes anything, and one rule for each
kind of argument lives here (ints, numbers and flags in :mod:`pagedkv.checks`): so every
configuration of the manager refuses the same bad argument with the same message. Imports
numpy, :mod:`pagedkv.checks`, :mod:`pagedkv.hashing` and the size limits of the pool and the
host tier's policies; knows nothing of sequences' state.
"""
from __future__ import annotations

import operator
import sys
from array import array
from collections.abc import Sequence as SequenceABC
from operator import itemgetter
from typing import Any, Iterable, Sequence

import numpy as np

from .checks import flag, int_at_least
from .hashing import MAX_TOKEN_ID, le_bytes  # noqa: F401 (re-exported)
from .host_tier import WRITE_POLICIES
from .pool import MAX_BLOCKS

__all__ = ["token_array", "count_within", "batch_arguments", "batch_seqs", "id_sequence", "le_bytes", "known", "as_token",
           "manager_args", "MAX_BLOCK_SIZE", "WINDOW_EVICTIONS"]

_BIG_ENDIAN = sys.byteorder == "big"
MAX_BLOCK_SIZE = 2**31 - 1  # FlashInfer's last_page_len and every slot stay int32/int64-exact
# How a hybrid manager orders the cached window blocks of a finished sequence for eviction.
WINDOW_EVICTIONS = ("with_prefix", "on_release")


def token_array(token_ids: Any) -> array:
    """Token ids as a fresh ``array('I')``, validated: integers in ``[0, 2**32)``, else ValueError.

    Lists and tuples convert in one C loop; numpy integer arrays by a range check and one cast,
    never element by element. Masked arrays are refused: a masked token has no value.
    """
    if type(token_ids) is list or type(token_ids) is tuple:
        try:
            return array("I", token_ids)
        except OverflowError as exc:
            raise ValueError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]: {exc}") from None
        except TypeError:  # numpy scalars (np.True_ has no __index__) or a bad id: one by one
            return array("I", [as_token(t) for t in token_ids])
    if isinstance(token_ids, np.ndarray):
        if isinstance(token_ids, np.ma.MaskedArray):
            raise ValueError("token ids must not be a masked array (a masked token has no value)")
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iub":  # bools are 0/1, as in lists
            raise ValueError(f"token ids must be a 1-D integer array, got {token_ids.dtype} {token_ids.shape}")
        out = array("I")
        if token_ids.size:
            if int(token_ids.min()) < 0 or int(token_ids.max()) > MAX_TOKEN_ID:
                raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]")
            out.frombytes(token_ids.astype(np.uint32).tobytes())
        return out
    if isinstance(token_ids, (str, bytes, bytearray)) or not isinstance(token_ids, Iterable):
        raise ValueError(f"token ids must be a sequence of ints, got {type(token_ids).__name__}")
    return token_array([as_token(t) for t in token_ids])


def id_sequence(seq_ids: Any) -> list:
    """``append_batch``'s ids as a list; the pairing with tokens is by position, so unordered
    collections (sets, dicts) are refused rather than paired in whatever order they iterate."""
    if isinstance(seq_ids, np.ndarray):
        if isinstance(seq_ids, np.ma.MaskedArray):
            raise ValueError("sequence ids must not be a masked array")
        if seq_ids.ndim != 1:
            raise ValueError(f"sequence ids must be a 1-D array, got shape {seq_ids.shape}")
        return seq_ids.tolist()
    if isinstance(seq_ids, (str, bytes, bytearray)) or not isinstance(seq_ids, SequenceABC):
        raise ValueError(
            f"sequence ids must be an ordered sequence (list, tuple, 1-D array), got {type(seq_ids).__name__}"
        )
    return list(seq_ids)


def batch_arguments(seq_ids: Any, token_ids: Any) -> tuple[Sequence, array, Sequence]:
    """``append_batch``'s arguments, validated: the ids as a list or tuple, the tokens as an
    ``array('I')``, and the values the decode loop appends. Every token id is checked in one C
    loop; for a list or tuple the loop then appends its own int objects rather than new ones read
    back out of the array."""
    if type(seq_ids) is not list and type(seq_ids) is not tuple:
        seq_ids = id_sequence(seq_ids)
    toks = vals = None
    if type(token_ids) is list or type(token_ids) is tuple:
        try:
            toks = array("I", token_ids)
            vals = token_ids
        except (TypeError, OverflowError):  # numpy scalars or bad ids: the checked path
            pass
    if toks is None:
        toks = vals = token_array(token_ids)
    if len(toks) != len(seq_ids):
        raise ValueError(f"{len(seq_ids)} sequence ids but {len(toks)} tokens")
    return seq_ids, toks, vals


def batch_seqs(seqs: dict, seq_ids: Sequence) -> tuple:
    """The sequences of a batch of two or more ids, in order: KeyError for an unknown id,
    ValueError for an unhashable or repeated one."""
    try:
        ss = itemgetter(*seq_ids)(seqs)
    except TypeError:
        raise ValueError("sequence ids must be hashable") from None
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError("a sequence id appears twice in one append_batch")
    return ss




def count_within(name: str, value: Any, limit: int, why: str) -> int:
    """A count in ``[0, limit]``: ``int_at_least``'s message below 0, ``why`` (formatted with
    ``v`` and ``limit``) above the limit. Example: ``count_within("k", 3, 2, "accept({v}) but
    {limit} drafts are pending")`` raises ``ValueError: accept(3) but 2 drafts are pending``."""
    value = int_at_least(name, value, 0)
    if value > limit:
        raise ValueError(why.format(v=value, limit=limit))
    return value


def known(seqs: dict, seq_id: Any) -> bool:
    """Whether a new id is taken; an id that cannot be a dict key is a bad argument."""
    try:
        return seq_id in seqs
    except TypeError:
        raise ValueError(f"sequence ids must be hashable, got {type(seq_id).__name__}") from None


def as_token(token: Any) -> int:
    """Accept numpy integers (and bools, as lists of bools are) as token ids; reject the rest."""
    if isinstance(token, (float, str, bytes)) or isinstance(token, np.floating):
        raise ValueError(f"token id must be an integer, got {token!r}")
    if isinstance(token, np.ma.MaskedArray):  # a masked value would become its hidden data
        raise ValueError("token ids must not be a masked array: fill or drop the masked entries")
    if isinstance(token, np.bool_):
        return int(token)
    try:
        token = operator.index(token)
    except TypeError:
        raise ValueError(f"token id must be an integer, got {type(token).__name__}") from None
    if not 0 <= token <= MAX_TOKEN_ID:
        raise ValueError(f"token id {token} outside [0, {MAX_TOKEN_ID}]")
    return token


def manager_args(num_blocks: Any, block_size: Any, enable_prefix_caching: Any, enable_events: Any,
                 host_blocks: Any, host_write_policy: Any, window_eviction: Any) -> tuple[int, int, int]:
    """``KVCacheManager``'s constructor arguments, checked before anything is built: returns
    ``(num_blocks, block_size, host_blocks)`` as Python ints. Block ids and page lengths are
    exported as int32, so both sizes stop at 2**31 - 1. Example: ``(np.int64(64), 16, True,
    True, 0, "write-back", "with_prefix")`` -> ``(64, 16, 0)``; ``block_size=0`` raises
    ``ValueError: block_size must be an int in [1, 2147483647], got 0``."""
    sizes = []
    for name, value, top in (("num_blocks", num_blocks, MAX_BLOCKS), ("block_size", block_size, MAX_BLOCK_SIZE),
                             ("host_blocks", host_blocks, MAX_BLOCKS)):
        lo = 0 if name == "host_blocks" else 1
        v = int_at_least(name, value, lo, expected=f"an int in [{lo}, {top}]")
        if v > top:
            raise ValueError(f"{name} must be an int in [{lo}, {top}], got {v}")
        sizes.append(v)
    flag("enable_prefix_caching", enable_prefix_caching)
    flag("enable_events", enable_events)
    if host_write_policy not in WRITE_POLICIES:
        raise ValueError(f"host_write_policy must be one of {WRITE_POLICIES}, got {host_write_policy!r}")
    if window_eviction not in WINDOW_EVICTIONS:
        raise ValueError(f"window_eviction must be one of {', '.join(WINDOW_EVICTIONS)}, got {window_eviction!r}")
    return sizes[0], sizes[1], sizes[2]
