"""One sequence's state: its block tables, its tokens, the chained hashes of its full blocks, and
the counters that say whether the decode fast path may write its next token without a decision.

The manager owns the dict of sequences; the coordinator of its groups (and nothing else) writes
their tables. This module imports only numpy and :mod:`pagedkv.hashing` (for the type of a
request's extra keys), and knows nothing of pools, caches or tiers.
"""
from __future__ import annotations

from array import array
from typing import Hashable

import numpy as np

from .hashing import ExtraKeys

__all__ = ["Seq"]


class Seq:
    """One sequence's state.

    ``tables``: one block table per group (-1 where a group released the block or a hit did not
    need it); ``table`` is ``tables[0]``, the same list; ``low[g]``: group g's first live entry
    past its kept blocks. ``tokens`` (``array('I')``, 4 bytes a token) holds every token the
    sequence knows; the first ``len(tokens) - unscheduled`` positions are scheduled, the last
    ``drafts`` of them speculative. ``hashes``: the chained hashes of the non-draft tokens' full
    blocks; ``keys``: the request's extra keys (None for a plain request). The decode fast path:
    ``nxt`` is the next token's slot when that needs no decision, -1 otherwise, valid up to the
    slot ``end`` (the block's end, or where a release falls due); ``shared``: a fork may have
    shared the last blocks. ``written``: leading blocks whose K/V was computed before this
    sequence was scheduled (``free(cache=False)`` unpublishes only later ones). ``host``: while
    swapped out, per group, index -> host block. ``mirror``: group 0's table as int32 for the
    kernel exports, built on the first export.
    """

    __slots__ = ("table", "tables", "low", "tokens", "hashes", "keys", "mirror", "nxt", "end",
                 "unscheduled", "drafts", "host", "written", "shared", "state_io", "io_at")

    def __init__(self, tables: list, low: list, tokens: array, hashes: list, keys: ExtraKeys | None,
                 unscheduled: int = 0, written: int = 0, mirror: np.ndarray | None = None) -> None:
        self.tables = tables
        self.table = tables[0]
        self.low = low
        self.tokens = tokens
        self.hashes = hashes
        self.keys = keys
        self.mirror = mirror
        self.nxt = -1
        self.end = -1
        self.unscheduled = unscheduled
        self.drafts = 0
        self.host: list[dict[int, int]] | None = None
        self.written = written
        self.shared = False
        # recurrent-state groups: group -> (read, write) blocks of the last slow scheduling call,
        # and the computed count after it (a later count means decode tokens in place since)
        self.state_io: dict | None = None
        self.io_at = 0

    @property
    def unready(self) -> bool:
        """Off the plain decode loop: mid-prefill, drafts pending, or swapped out. Such a
        sequence cannot be appended to or forked, and the manager counts them so that a step of
        ready sequences skips this test."""
        return bool(self.unscheduled or self.drafts or self.host is not None)

    @property
    def computed(self) -> int:
        """Positions scheduled for compute (hits, prefilled chunks, appended tokens, drafts)."""
        return len(self.tokens) - self.unscheduled

    def why_not_ready(self, seq_id: Hashable, what: str) -> str:
        """Why this sequence cannot be appended to, forked, exported... now: the error message,
        naming the call that fixes it."""
        if self.host is not None:
            return f"cannot {what} {seq_id!r}: it is swapped out (call swap_in first)"
        if self.unscheduled:
            return (f"cannot {what} {seq_id!r}: {self.unscheduled} prompt positions are not "
                    f"scheduled yet (call prefill first)")
        return f"cannot {what} {seq_id!r}: {self.drafts} drafts are pending (call accept first)"

    def add_block(self, b: int) -> None:
        """Append a block to group 0's table and its int32 mirror, if built (grown by doubling)."""
        n = len(self.table)
        self.table.append(b)
        mirror = self.mirror
        if mirror is not None:
            if n == len(mirror):
                self.mirror = mirror = np.concatenate([mirror, np.empty(n, dtype=np.int32)])
            mirror[n] = b

    def add_blocks(self, blocks: list) -> None:
        if self.mirror is None:
            self.table += blocks
        else:
            for b in blocks:
                self.add_block(b)

    def set_last(self, b: int) -> None:
        self.table[-1] = b
        if self.mirror is not None:
            self.mirror[len(self.table) - 1] = b

    def int32_table(self) -> np.ndarray:
        """Group 0's table as int32 (a view of the mirror, built on first use)."""
        n = len(self.table)
        if self.mirror is None:
            self.mirror = np.empty(max(8, 2 * n), dtype=np.int32)
            self.mirror[:n] = self.table
        return self.mirror[:n]

    def drop_mirror(self) -> None:
        """Group 0's table was rewritten in place (a swap): rebuild the mirror at the next export."""
        self.mirror = None
