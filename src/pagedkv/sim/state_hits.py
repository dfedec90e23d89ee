"""Prefix hits of recurrent-state hybrids: trace replays through a manager with a state group, at
several checkpoint intervals, against attention alone.

A hybrid such as Qwen3-Next can start a prompt from a cached prefix only where a checkpoint of its
recurrent state was kept: with ``RecurrentState(interval=T)`` a hit of h tokens needs h to be a
multiple of T and the checkpoint after position h - 1 cached (docs/design.md 3.12.2). A model of
full attention alone hits at any block boundary. This module replays a trace's requests through
the real manager, with ``[FullAttention(), RecurrentState(T)]`` or ``[FullAttention()]``, and the
manager counts the hits.

Modelled, as an engine that wants every interval reusable runs: each prompt is admitted with its
hit alone scheduled, then prefilled in chunks that end on interval ends (one step each: a
``take_copies()`` after every scheduling call, which publishes the checkpoint the call leaves);
the output is appended in one call. Requests are admitted in order with at most
``max_running`` resident, finished oldest first (early when blocks run out), as in
:mod:`pagedkv.sim.hybrid_hits`. A state takes one block of the pool here, whatever its bytes (a
real one takes many pages): the default pool never evicts, so what the replay measures is the
checkpoint rule's cost alone, and what checkpoints cost in memory is counted as state blocks held,
not as hits lost.

Worked number (the first 300 Mooncake requests, block size 16, modelled): attention alone hits
8.10% of the prompt tokens; a state group about as much at T = 256 and 512 (the trace shares
prefixes in whole 512-token blocks) and 4.6% at T = 1,024, 4.3% at 2,048, while the checkpoints
it keeps fall from 15,219 state blocks at T = 256 to 1,861 at 2,048.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

from .. import KVCacheManager
from ..checks import int_at_least
from ..kv_specs import FullAttention, RecurrentState
from ..types import OutOfBlocks
from .cache_replay import HitCounts, append
from .request import Request, segment_tokens

__all__ = ["StateHitRun", "never_evicts_blocks", "replay_state_hits", "state_hit_rates"]

OUTPUT_KEY = 0x7374_6174_6568  # content key of the appended outputs ("stateh"), one stream per request


@dataclass(frozen=True)
class StateHitRun(HitCounts):
    """One replay: the manager's counts, the interval (None: attention alone) and the state
    blocks the pool holds at the end (checkpoints cached and running states: what checkpoints
    cost in memory, one whole state each)."""

    interval: int | None
    state_blocks: int


def never_evicts_blocks(requests: Sequence[Request], interval: int | None, block_size: int = 16) -> int:
    """A pool size at which a replay never evicts: every request's K/V blocks and one state
    block per interval begun (each a checkpoint at most) plus one. Example: a 1,000-token
    request at block size 16 and T = 256: 63 + 4 + 1 = 68 blocks."""
    per_state = (lambda n: -(-n // interval) + 1) if interval else (lambda n: 0)
    return sum(math.ceil(r.total_len / block_size) + per_state(r.total_len) for r in requests)


def _prefill(m: KVCacheManager, running: list, sid: Hashable, n: int) -> bool:
    """Schedule ``n`` more prompt positions of ``sid``, finishing the oldest of ``running`` while
    blocks are short; False when ``sid`` alone does not fit."""
    while True:
        try:
            m.prefill(sid, n)
            return True
        except OutOfBlocks:
            if not running:
                return False
            m.free(running.pop(0))


def _admit(m: KVCacheManager, running: list, sid: Hashable, prompt, interval: int | None) -> bool:
    """Admit ``prompt`` with its hit alone scheduled, then prefill it in chunks ending on
    interval ends (the whole rest at once without a state group), a step after each call.
    False (nothing left admitted) when it does not fit even with nothing resident."""
    while True:
        try:
            m.add_sequence(sid, prompt, prefill=0 if interval else None)
            break
        except OutOfBlocks:
            if not running:
                return False
            m.free(running.pop(0))
    m.take_copies()
    done = m.num_computed(sid) if interval else len(prompt)
    while done < len(prompt):
        n = min(interval - done % interval, len(prompt) - done)
        if not _prefill(m, running, sid, n):
            m.free(sid)  # its scheduled chunks ran: their blocks stay cached
            return False
        m.take_copies()
        done += n
    return True


def replay_state_hits(requests: Sequence[Request], interval: int | None, block_size: int = 16, *,
                      max_running: int = 16, num_blocks: int | None = None,
                      prompts: Iterable | None = None) -> StateHitRun:
    """Replay ``requests`` through a fresh manager of ``[FullAttention(),
    RecurrentState(interval)]`` (``interval`` None: ``[FullAttention()]``) and ``num_blocks``
    blocks (default :func:`never_evicts_blocks`); the manager counts hits. ``prompts`` may pass
    the requests' token arrays already built. Example: two requests sharing 40 tokens, block
    size 4: 40 tokens hit at T = 8, 32 at T = 16."""
    int_at_least("block_size", block_size, 1)
    int_at_least("max_running", max_running, 1)
    groups = [FullAttention()]
    if interval is not None:
        # RecurrentState refuses T < 1, the manager a T that is not a multiple of block_size
        groups.append(RecurrentState(interval))
    if num_blocks is None:
        num_blocks = never_evicts_blocks(requests, interval, block_size)
    m = KVCacheManager(int_at_least("num_blocks", num_blocks, 1), block_size, groups=groups,
                       enable_prefix_caching=True, hash_algo="builtin", enable_events=False)
    running: list[int] = []
    skipped = 0
    prompts = list(prompts) if prompts is not None else [r.prompt_array() for r in requests]
    for i, (r, prompt) in enumerate(zip(requests, prompts)):
        while len(running) >= max_running:
            m.free(running.pop(0))
        if not _admit(m, running, i, prompt, interval):
            skipped += 1
            continue
        if r.output_len:
            append(m, running, i, segment_tokens(OUTPUT_KEY ^ i, r.output_len))
            m.take_copies()
        running.append(i)
    u = m.usage()
    state = m.usage(group=1) if interval is not None else None
    return StateHitRun(len(requests), skipped, u.prefix_query_tokens, u.prefix_hit_tokens, u.evictions,
                       interval, 0 if state is None else state.used_blocks + state.cached_blocks)


def state_hit_rates(requests: Sequence[Request], intervals: Sequence[int] = (256, 512, 1024, 2048),
                    block_size: int = 16, **kwargs) -> list[StateHitRun]:
    """Attention alone, then one replay per interval, over the same prompts (modelled: see the
    module docstring)."""
    prompts = [r.prompt_array() for r in requests]
    return [replay_state_hits(requests, t, block_size, prompts=prompts, **kwargs) for t in (None, *intervals)]
