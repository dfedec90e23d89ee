"""What the hybrid prefix-hit rule costs: Mooncake replays, a uniform cache against a grouped one
holding the same bytes.

A hybrid model's prefix hit of h tokens needs, in every sliding-window group, the blocks covering
the window that computing position h reads (docs/design.md 3.12). A sliding group releases those
blocks as its window moves on, and a released block is only cached-free: the first to be evicted,
being the least recently freed. So a cached prefix whose full-attention blocks all survive can
still hit nothing past the last point where a whole window survives too: the "reuse cliff" vLLM
users report (vLLM #48435). Against that, the grouped cache holds far fewer blocks per running
sequence, so the same bytes keep more history.

This module replays a trace's requests through the real manager, twice at each memory budget:

- **uniform**: ``KVCacheManager`` without groups, every layer keeping every block (what a model
  with only full attention does, and a hybrid one served without groups): pages of all layers;
- **grouped**: ``KVCacheManager(groups=...)`` with vLLM's equal-page groups
  (:func:`pagedkv.sim.sizing.equal_page_groups`), pages of one group's layers, so the same bytes
  make more, smaller blocks (gpt-oss-20b: 2x; Gemma 3 27B, 62 layers in groups of 10: 6.2x);
  ``window_eviction`` picks how its released window blocks age (see the manager's docs).

Requests are admitted in order with at most ``max_running`` resident, finished oldest first
(early when blocks run out), as in :mod:`pagedkv.report.prefix_hits`; each output is appended
before its sequence finishes. Hits are the manager's own ``usage()`` counts.

Worked number (gpt-oss-20b, first 300 Mooncake requests, unbounded cache): both hit 8.1% of
prompt tokens; an unbounded cache never evicts, so the rule costs nothing there, and every gap at a
bounded budget is the rule's cost or the smaller pages' gain.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from .. import KVCacheManager
from ..checks import int_at_least
from ..kv_specs import AttentionSpec
from .cache_replay import HitCounts, admit, append
from .request import Request, segment_tokens
from .sizing import ModelSpec, equal_page_groups, kv_size

__all__ = ["HitRun", "Layout", "layouts", "replay_hits", "never_evicts_bytes"]

OUTPUT_KEY = 0x6879_6272_6964  # content key of the appended outputs ("hybrid"), one stream per request


@dataclass(frozen=True)
class Layout:
    """How a memory budget is cut into blocks: the manager's groups (None: uniform) and how many
    blocks of ``page_bytes`` the budget holds."""

    name: str
    groups: tuple[AttentionSpec, ...] | None
    page_bytes: int
    num_blocks: int


@dataclass(frozen=True)
class HitRun(HitCounts):
    """One replay: what the manager counted, under ``layout`` (and, grouped, ``window_eviction``)."""

    layout: Layout
    window_eviction: str | None


def _layer_block_bytes(spec: ModelSpec, block_size: int) -> int:
    """KV bytes of one layer's block (K and V)."""
    per_token = kv_size(spec, block_size=block_size).bytes_per_token
    return per_token * block_size // spec.num_layers


def layouts(spec: ModelSpec, budget_bytes: int, block_size: int = 16) -> tuple[Layout, Layout]:
    """The uniform and the grouped layout of ``budget_bytes`` of ``spec``'s KV.

    Example: gpt-oss-20b, block size 16: a layer's block is 16 x 2 x 8 x 64 x 2 = 32,768 bytes;
    uniform pages hold 24 layers (786,432 bytes), grouped pages 12 (393,216), so 1 GiB makes 1,365
    uniform blocks and 2,730 grouped ones."""
    int_at_least("budget_bytes", budget_bytes, 1)
    layer = _layer_block_bytes(spec, block_size)
    uniform_page = layer * spec.num_layers
    eq = equal_page_groups(spec)
    grouped_page = layer * (eq[0].layers + eq[0].padding)
    return (Layout("uniform", None, uniform_page, budget_bytes // uniform_page),
            Layout("grouped", tuple(g.attention for g in eq), grouped_page, budget_bytes // grouped_page))


def never_evicts_bytes(spec: ModelSpec, requests: Sequence[Request], block_size: int = 16) -> int:
    """Bytes a uniform cache needs to keep every request's prompt and output: the budget at which
    nothing is ever evicted (the grouped layout, holding less per request, evicts nothing either)."""
    layer = _layer_block_bytes(spec, block_size)
    return sum(math.ceil(r.total_len / block_size) for r in requests) * layer * spec.num_layers


def replay_hits(requests: Sequence[Request], layout: Layout, block_size: int = 16, *,
                max_running: int = 16, window_eviction: str | None = None,
                prompts: Iterable | None = None) -> HitRun:
    """Replay ``requests`` through a fresh manager built from ``layout``; the manager counts hits.

    ``prompts`` may pass the requests' token arrays already built (they cost more than the
    replay itself on long traces)."""
    int_at_least("max_running", max_running, 1)
    kwargs = {}
    if layout.groups is not None:
        kwargs["groups"] = list(layout.groups)
        if window_eviction is not None:
            kwargs["window_eviction"] = window_eviction
    m = KVCacheManager(layout.num_blocks, block_size, enable_prefix_caching=True, hash_algo="builtin",
                       enable_events=False, **kwargs)
    running: list[int] = []
    skipped = query = 0
    prompts = list(prompts) if prompts is not None else [r.prompt_array() for r in requests]
    for i, (r, prompt) in enumerate(zip(requests, prompts)):
        while len(running) >= max_running:
            m.free(running.pop(0))
        if not admit(m, running, i, prompt):
            skipped += 1
            continue
        query += len(prompt)
        if r.output_len:
            append(m, running, i, segment_tokens(OUTPUT_KEY ^ i, r.output_len))
        running.append(i)
    u = m.usage()
    return HitRun(len(requests), skipped, u.prefix_query_tokens, u.prefix_hit_tokens, u.evictions, layout,
                  window_eviction if layout.groups is not None else None)
