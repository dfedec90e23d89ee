"""The in-process KV event log: one ordered list of cache events for every tier of a manager.

This is not the wire: events wait here, as Python objects, until ``take_events`` drains them;
:mod:`pagedkv.events` is what turns a drained list into vLLM's bytes and publishes them. This
module imports only :mod:`pagedkv.types`.

A router mirrors which prefixes a cache holds by replaying its events in order, so the order is
part of the meaning: a hash removed and then stored again is cached; stored and then removed is
not. With a host tier, blocks are stored to and removed from two media (the device, "GPU", and
host memory, "CPU"), each by its own prefix cache; both append here, so the interleaving of the
two is the order in which things happened.

Two costs are kept off the hot paths:

* a ``BlockStored`` is queued raw, as a plain tuple ``(hashes, parent, token array slice, block
  size, medium)`` (and, for blocks with extra keys, the LoRA name and the per-block
  ``extra_keys``: seven fields); its tuple of Python ints is built when the events are taken, not
  on the admission or decode path that published the block;
* consecutive evictions from one medium fold into one ``BlockRemoved`` (an admission that evicts
  50 blocks is one event, not 50).
"""
from __future__ import annotations

from typing import Any, Hashable, Iterable

from .types import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["EventLog", "GroupEventLog"]


class EventLog:
    """Pending KV cache events, oldest first, drained by :meth:`take`.

    ``enabled=False`` records nothing (an engine that never drains events should not pay for
    them or accumulate them).
    """

    __slots__ = ("enabled", "_events", "_removed", "_removed_medium")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._events: list = []
        self._removed: list = []  # evicted hashes not yet folded into a BlockRemoved
        self._removed_medium = "GPU"

    def stored(self, hashes: tuple, parent: Hashable, tokens: Any, block_size: int, medium: str) -> None:
        """Blocks ``hashes`` (a chain from ``parent``) were published; ``tokens`` their tokens."""
        if self._removed:
            self._flush_removed()
        self._events.append((hashes, parent, tokens, block_size, medium))

    def stored_many(self, raw: Iterable[tuple]) -> None:
        """Several unrelated publications at once, each ``(hashes, parent, tokens, block_size,
        medium)``: the blocks one decode step filled."""
        if self._removed:
            self._flush_removed()
        self._events += raw

    def removed(self, hashes: Iterable[Hashable], medium: str) -> None:
        """Cached blocks were evicted or unpublished from ``medium``."""
        if self._removed and medium != self._removed_medium:
            self._flush_removed()
        self._removed_medium = medium
        self._removed.extend(hashes)

    def cleared(self) -> None:
        """Every cache was dropped (``reset_prefix_cache``)."""
        if self._removed:
            self._flush_removed()
        self._events.append(AllBlocksCleared())

    def _flush_removed(self) -> None:
        self._events.append(self._removed_event(tuple(self._removed)))
        self._removed = []

    def _removed_event(self, hashes: tuple) -> BlockRemoved:
        """The event a run of evictions folds into (a grouped log names the group too)."""
        return BlockRemoved(hashes, self._removed_medium)

    @staticmethod
    def _stored_event(e: tuple) -> BlockStored:
        """The event a queued publication becomes: ``(hashes, parent, tokens, block_size, medium)``
        and, for blocks with extra keys, ``lora_name`` and ``extra_keys``."""
        return BlockStored(e[0], e[1], tuple(e[2]), e[3], e[4]) if len(e) == 5 else BlockStored(e[0], e[1], tuple(e[2]), *e[3:])

    def __len__(self) -> int:
        """Events pending (evictions not yet folded count as one)."""
        return len(self._events) + bool(self._removed)

    def take(self) -> list:
        """Drain every pending event, oldest first, as event named tuples."""
        if self._removed:
            self._flush_removed()
        events, self._events = self._events, []
        stored = self._stored_event
        return [stored(e) if type(e) is tuple else e for e in events]


class GroupEventLog(EventLog):
    """The event log of a manager with several attention groups, whose cache keys are
    ``(group, hash)`` pairs: each event carries the bare hashes and names its group (and, for a
    ``BlockStored``, the group's spec kind and window, as vLLM 0.33 sends them); removals fold
    into one ``BlockRemoved`` per run of one group."""

    __slots__ = ("_removed_group", "_specs")

    def __init__(self, enabled: bool, specs: tuple) -> None:
        super().__init__(enabled)
        self._removed_group = 0
        self._specs = specs

    def removed(self, keys: Iterable[tuple], medium: str) -> None:
        for g, h in keys:
            if self._removed and (g != self._removed_group or medium != self._removed_medium):
                self._flush_removed()
            self._removed_group, self._removed_medium = g, medium
            self._removed.append(h)

    def _removed_event(self, hashes: tuple) -> BlockRemoved:
        return BlockRemoved(hashes, self._removed_medium, self._removed_group)

    def _stored_event(self, e: tuple) -> BlockStored:
        keys, parent = e[0], e[1]
        g = keys[0][0]
        spec = self._specs[g]
        lora, extra = (e[5], e[6]) if len(e) > 5 else (None, None)
        return BlockStored(tuple(h for _, h in keys), parent[1], tuple(e[2]), e[3], e[4], lora, extra,
                           g, spec.kind, spec.sliding_window)
