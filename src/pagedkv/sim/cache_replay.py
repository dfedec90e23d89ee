"""Cache replays: requests admitted in order, the oldest resident finished when blocks run out.

The prefix-hit measurements (``pagedkv.report.prefix_hits`` on one manager, and
``pagedkv.sim.hybrid_hits``, uniform against grouped) replay a trace through a real manager with
at most a few sequences resident, finishing them in arrival order. When an admission or an
append finds no blocks, the oldest resident sequence finishes early (its full blocks stay cached,
as a finished request's do) and the call is retried: the replay measures what a cache of that
size keeps, not a scheduler. Both calls are atomic in the manager, so a retry starts clean.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from ..types import OutOfBlocks

__all__ = ["admit", "append", "HitCounts"]


@dataclass(frozen=True)
class HitCounts:
    """What a replay's manager counted (its own ``usage()``): requests replayed, those skipped
    (larger than the whole cache), prompt tokens queried and served from the cache, evictions."""

    requests: int
    skipped: int
    query_tokens: int
    hit_tokens: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        """Share of the queried prompt tokens served from the cache (0 when none were queried)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def admit(m, running: list, seq_id: Hashable, prompt) -> bool:
    """Admit ``prompt`` as ``seq_id``, finishing the oldest of ``running`` while blocks are short;
    False (nothing admitted) when it does not fit even with nothing resident."""
    while True:
        try:
            m.add_sequence(seq_id, prompt)
            return True
        except OutOfBlocks:
            if not running:
                return False
            m.free(running.pop(0))


def append(m, running: list, seq_id: Hashable, tokens) -> None:
    """Append ``tokens`` to ``seq_id``, finishing the oldest of ``running`` while blocks are
    short; a sequence alone and still too big stops where it is (nothing appended)."""
    while True:
        try:
            m.append_tokens(seq_id, tokens)
            return
        except OutOfBlocks:
            if not running:
                return
            m.free(running.pop(0))
