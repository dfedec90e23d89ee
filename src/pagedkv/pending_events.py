"""The in-process KV event log: one ordered list of cache events for every tier of a manager.

This is not the wire: events wait here, as Python objects, until ``take_events`` drains them;
:mod:`pagedkv.events` is what turns a drained list into vLLM's bytes and publishes them. This
module imports only :mod:`pagedkv.types` and :mod:`pagedkv.kv_specs`.

A router mirrors which prefixes a cache holds by replaying its events in order, so the order is
part of the meaning: a hash removed and then stored again is cached; stored and then removed is
not. With a host tier, blocks are stored to and removed from two media (the device, "GPU", and
host memory, "CPU"), each by its own prefix cache; both append here, so the interleaving of the
two is the order in which things happened.

Every event names its attention group, as vLLM 0.33 tags them: ``BlockStored`` carries the group
index, its spec's kind and its sliding window (None unless sliding), ``BlockRemoved`` the group
index. A uniform model's events say group 0, ``"full_attention"``, no window; a hybrid model's say
the group each block belongs to. Host-tier ("CPU") events are tagged the same way, as vLLM's
offloading connector tags the blocks it offloads.

Two costs are kept off the hot paths:

* a ``BlockStored`` is queued raw, as a plain tuple ``(keys, parent, token array slice, block
  size, medium)`` (and, for blocks with extra keys, the LoRA name and the per-block
  ``extra_keys``: seven fields); its tuple of Python ints and its group tags are built when the
  events are taken, not on the admission or decode path that published the block;
* consecutive evictions from one medium (and one group) fold into one ``BlockRemoved`` (an
  admission that evicts 50 blocks is one event, not 50).
"""
from __future__ import annotations

from typing import Any, Hashable, Iterable, Sequence

from .kv_specs import FullAttention
from .types import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["EventLog"]

# Builds an event from its ten fields without the named tuple's Python-level ``__new__`` (which
# only does this): a decode step's take builds one BlockStored per filled block.
_new = tuple.__new__


class EventLog:
    """Pending KV cache events, oldest first, drained by :meth:`take`.

    ``specs`` are the manager's attention groups, in group order. The cache keys the prefix
    caches pass in depend on them: a uniform model (exactly ``[FullAttention()]``, the plain
    manager) keys blocks by their bare hash; any other (the grouped manager, even with one
    sliding group) by ``(group, hash)`` pairs, parents included. Either way the events carry
    bare hashes and their group's tags. Example: ``EventLog(True, (FullAttention(),
    SlidingWindow(8)))`` given ``removed([(1, h)], "GPU")`` takes ``BlockRemoved((h,), "GPU", 1)``.

    ``enabled=False`` records nothing (an engine that never drains events should not pay for
    them or accumulate them).
    """

    __slots__ = ("enabled", "_events", "_removed", "_removed_medium", "_removed_group", "_tags", "_keyed",
                 "_plain")

    def __init__(self, enabled: bool = True, specs: Sequence = (FullAttention(),), keyed: bool | None = None) -> None:
        self.enabled = enabled
        self._events: list = []
        self._removed: list = []  # evicted hashes not yet folded into a BlockRemoved
        self._removed_medium = "GPU"
        self._removed_group = 0
        # per group: what its events carry (group_idx, kv_cache_spec_kind, sliding window)
        self._tags = tuple((g, s.kind, s.sliding_window) for g, s in enumerate(specs))
        # (group, hash) keys unless one full-attention group; the manager says which it uses
        self._keyed = not (len(specs) == 1 and specs[0].reads_whole_prefix) if keyed is None else keyed
        self._plain = (None, None, *self._tags[0])  # a bare-hash event's last five fields

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

    def removed(self, keys: Iterable[Hashable], medium: str) -> None:
        """Cached blocks were evicted or unpublished from ``medium``: bare hashes of a uniform
        model's group 0, ``(group, hash)`` pairs otherwise (a run changes event per group)."""
        if not self._keyed:
            if self._removed and medium != self._removed_medium:
                self._flush_removed()
            self._removed_medium = medium
            self._removed.extend(keys)
            return
        for g, h in keys:
            if self._removed and (g != self._removed_group or medium != self._removed_medium):
                self._flush_removed()
            self._removed_group, self._removed_medium = g, medium
            self._removed.append(h)

    def cleared(self) -> None:
        """Every cache was dropped (``reset_prefix_cache``)."""
        if self._removed:
            self._flush_removed()
        self._events.append(AllBlocksCleared())

    def _flush_removed(self) -> None:
        self._events.append(self._removed_event(tuple(self._removed)))
        self._removed = []

    def _removed_event(self, hashes: tuple) -> BlockRemoved:
        """The event a run of evictions from one medium and one group folds into."""
        return BlockRemoved(hashes, self._removed_medium, self._removed_group)

    def _stored_event(self, e: tuple) -> BlockStored:
        """The event a queued publication becomes: ``(keys, parent, tokens, block_size, medium)``
        and, for blocks with extra keys, ``lora_name`` and ``extra_keys``; tagged with the
        group of its keys (group 0 for bare hashes)."""
        if not self._keyed:
            if len(e) == 5:
                return _new(BlockStored, (e[0], e[1], tuple(e[2]), e[3], e[4], *self._plain))
            return _new(BlockStored, (e[0], e[1], tuple(e[2]), *e[3:], *self._tags[0]))
        keys = e[0]
        lora, extra = (e[5], e[6]) if len(e) > 5 else (None, None)
        return BlockStored(tuple(h for _, h in keys), e[1][1], tuple(e[2]), e[3], e[4], lora, extra,
                           *self._tags[keys[0][0]])

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
