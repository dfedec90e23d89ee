"""Page layouts for hybrid models: how one GPU's KV memory holds groups whose pages differ in bytes.

Owns: the arithmetic of three ways to hold a hybrid model's attention groups
and a modelled replay of a trace's lengths through each. Imports :mod:`pagedkv.kv_specs` and
:mod:`pagedkv.sim.sizing` only; knows nothing of the manager, the scheduler or the report.

Gemma 3 27B has 52 sliding-window layers and 10 full-attention layers, so a 16-token block of the
sliding group holds 52 layers' K/V (6,815,744 bytes in bf16) and one of the full group 10 layers'
(1,310,720 bytes). A pool of equal blocks cannot hold both as they are. The layouts:

- ``uniform``: today's allocator. One table, every layer keeps every block (no release).
- ``equal pages`` (vLLM v1, ``_get_kv_cache_groups_uniform_page_size``): layers are dealt into
  KV cache groups of ``g`` layers each, the last group of a type padded with layer slots that hold
  nothing; every group's page is ``g`` layers, one pool serves them all. vLLM picks ``g`` = the
  fewest layers of any type (Gemma 3 27B: g = 10, 6 sliding groups + 1 full, the last sliding
  group holds 2 real layers and 8 padding: 8/52 = 15.4% more sliding-layer memory). ``g`` =
  gcd of the types' layer counts pads nothing at the price of more tables (Gemma 3 27B: g = 2,
  26 + 5 = 31 tables per request).
- ``separate pools``: one pool per attention type with its own page bytes, the budget split at a
  fixed ratio. Nothing is padded, but memory free in one pool cannot serve the other: when the
  trace's mix of lengths moves away from the split, requests wait with memory free (stranded).

Worked number (Gemma 3 27B, bf16, block size 16, one request of 32,768 tokens; one layer's block
is 131,072 bytes): the full group holds 2,048 blocks of 10 layers, the sliding group the 64
blocks its last position read, of 52 layers: (2,048 x 10 + 64 x 52) x 131,072 bytes = 2,976 MiB;
vLLM's equal pages add 8 padding layers x 64 blocks = 64 MiB (2.2% more); the uniform allocator
holds 2,048 blocks x 62 layers = 15,872 MiB.

The replay (:func:`replay`) is a model, not a serving run: the trace's requests queue at t = 0
(a saturated server, arrival times ignored), are admitted first come first served while every
pool can hold their prompt, grow one token per decode step, and the newest is preempted (to be
recomputed) when a pool overflows. It reports the concurrency each layout sustains, and how much
memory sat free while a request waited.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..checks import int_at_least, number_at_least, require
from ..kv_specs import AttentionSpec, FullAttention
from .sizing import ModelSpec, attention_groups, equal_page_groups, kv_size

__all__ = [
    "Pool",
    "Layout",
    "ReplayResult",
    "blocks_held_array",
    "peak_blocks_array",
    "uniform_layout",
    "equal_page_layout",
    "separate_pool_layout",
    "vllm_group_layers",
    "demand_share",
    "replay",
]


def blocks_held_array(spec: AttentionSpec, computed, block_size: int) -> np.ndarray:
    """:meth:`AttentionSpec.blocks_held` for an array of context lengths: the blocks a group holds
    between steps once ``computed`` positions are cached. Example: ``SlidingWindow(128)`` at
    [0, 1000, 4096], block size 16 -> [0, 9, 8]."""
    c = np.asarray(computed, dtype=np.int64)
    last = np.maximum(c - 1, 0)
    held = -(-c // block_size) - spec.first_read_array(last) // block_size
    return np.where(c > 0, held, 0)


def peak_blocks_array(spec: AttentionSpec, computed, block_size: int) -> np.ndarray:
    """The most blocks the group holds at any context from 1 to ``computed``: what a request must
    be able to hold alone to run to that length. Full attention grows, so it is ``blocks_held``;
    a window's or chunk's holding is periodic beyond one window or chunk (period ``block_size``
    for a window, lcm(chunk, block_size) for a chunk), so a table of its running maximum over
    that span answers every length. Example: ``ChunkedLocalAttention(8192)``, block size 16, at
    8,193 tokens holds 1 block but peaked at 512 (at 8,192)."""
    return spec.peak_blocks(computed, block_size)


@dataclass(frozen=True)
class Pool:
    """One pool of equal pages: ``page_bytes`` each, ``num_blocks`` of them, and the block tables
    a request keeps in it (``tables``: (attention spec, how many tables of that spec)).
    ``state_blocks``: blocks every request holds whatever its length, once it has a token (the
    recurrent states of a hybrid's linear-attention or Mamba layers: one per state group)."""

    name: str
    page_bytes: int
    num_blocks: int
    tables: tuple[tuple[AttentionSpec, int], ...]
    state_blocks: int = 0

    def _states(self, context) -> np.ndarray:
        return self.state_blocks * (np.asarray(context, dtype=np.int64) > 0)

    def blocks(self, context, block_size: int) -> np.ndarray:
        """Blocks a request of ``context`` tokens holds in this pool (array in, array out)."""
        return sum((n * blocks_held_array(a, context, block_size) for a, n in self.tables),
                   self._states(context))

    def peak(self, context, block_size: int) -> np.ndarray:
        """The most blocks a request holds in this pool on its way to ``context`` tokens."""
        return sum((n * peak_blocks_array(a, context, block_size) for a, n in self.tables),
                   self._states(context))


@dataclass(frozen=True)
class Layout:
    """A way to hold one model's KV in ``budget_bytes`` of one GPU: its pools, and the layer slots
    it reserves for no layer (``padding_layers``, vLLM's padded groups). ``layer_bytes_per_block``
    is one layer's K/V of one block (Gemma 3 27B, bf16, block size 16: 131,072)."""

    name: str
    model: str
    block_size: int
    budget_bytes: int
    layer_bytes_per_block: int
    pools: tuple[Pool, ...]
    layers: tuple[tuple[AttentionSpec, int], ...]  # the model's real layers per attention type
    padding_layers: int = 0

    @property
    def num_tables(self) -> int:
        """Block tables per request (each a table the allocator extends, releases and hashes)."""
        return sum(n for p in self.pools for _, n in p.tables)

    def bytes_per_request(self, context: int) -> int:
        """Bytes a request of ``context`` tokens holds, padding included."""
        return sum(int(p.blocks(context, self.block_size)) * p.page_bytes for p in self.pools)

    def real_bytes(self, context) -> int:
        """Bytes the model's real layers need for requests of ``context`` tokens (no padding)."""
        return self.layer_bytes_per_block * int(sum(
            n * blocks_held_array(a, context, self.block_size).sum() for a, n in self.layers))

    def padding_bytes(self, context: int) -> int:
        """Bytes a request of ``context`` tokens holds in layer slots no layer uses."""
        return self.bytes_per_request(context) - self.real_bytes(context) if self.padding_layers else 0

    def requests_fit(self, context: int) -> int:
        """How many requests of ``context`` tokens fit at once: the scarcest pool decides."""
        fits = [p.num_blocks // need for p in self.pools if (need := int(p.blocks(context, self.block_size)))]
        return min(fits) if fits else 0


def _layer_bytes(spec: ModelSpec, block_size: int, dtype: str | None, tp: int) -> int:
    return kv_size(spec, dtype=dtype, tp=tp, block_size=block_size).bytes_per_token // spec.num_layers * block_size


def _check(spec: ModelSpec, budget_bytes: int, block_size: int) -> tuple[int, int]:
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    return int_at_least("budget_bytes", budget_bytes, 1), int_at_least("block_size", block_size, 1)


def uniform_layout(spec: ModelSpec, budget_bytes: int, *, block_size: int = 16, dtype: str | None = None,
                   tp: int = 1) -> Layout:
    """Every layer keeps every block in one pool: today's allocator on a hybrid model."""
    budget_bytes, block_size = _check(spec, budget_bytes, block_size)
    layer = _layer_bytes(spec, block_size, dtype, tp)
    page = layer * spec.num_layers
    pool = Pool("all layers", page, budget_bytes // page, ((FullAttention(), 1),))
    return Layout("uniform", spec.name, block_size, budget_bytes, layer, (pool,),
                  ((FullAttention(), spec.num_layers),))


def vllm_group_layers(spec: ModelSpec) -> int:
    """The layers per KV cache group vLLM picks (``equal_page_groups``): Gemma 3 27B 10, gpt-oss 12/18."""
    first = equal_page_groups(spec)[0]
    return first.layers + first.padding


def equal_page_layout(spec: ModelSpec, budget_bytes: int, *, group_layers: int | None = None,
                      block_size: int = 16, dtype: str | None = None, tp: int = 1) -> Layout:
    """One pool of pages of ``group_layers`` layers each (default: vLLM's choice); each attention
    type gets ceil(layers / group_layers) tables, the slots beyond its layers padding. Example:
    Gemma 3 27B, g = 10: 6 sliding tables + 1 full, 8 padding layer slots; g = 2: 26 + 5, none."""
    budget_bytes, block_size = _check(spec, budget_bytes, block_size)
    g = vllm_group_layers(spec) if group_layers is None else int_at_least("group_layers", group_layers, 1)
    layer = _layer_bytes(spec, block_size, dtype, tp)
    tables, padding = [], 0
    for attention, n in attention_groups(spec):
        count = -(-n // g)
        tables.append((attention, count))
        padding += count * g - n
    pool = Pool(f"pages of {g} layers", layer * g, budget_bytes // (layer * g), tuple(tables))
    name = f"equal pages, {g} layers/page" + (" (vLLM)" if group_layers is None else "")
    return Layout(name, spec.name, block_size, budget_bytes, layer, (pool,), tuple(attention_groups(spec)),
                  padding)


def separate_pool_layout(spec: ModelSpec, budget_bytes: int, shares: Sequence[float], *,
                         block_size: int = 16, dtype: str | None = None, tp: int = 1) -> Layout:
    """One pool per attention type, pages of that type's layers, holding ``shares[i]`` of the
    budget (one share per type of ``attention_groups``, in its order, summing to 1). Example:
    gpt-oss-120b, shares (0.05, 0.95): the sliding pool gets 5% of the budget."""
    budget_bytes, block_size = _check(spec, budget_bytes, block_size)
    types = attention_groups(spec)
    if isinstance(shares, (str, bytes)) or not isinstance(shares, Sequence) or len(shares) != len(types):
        raise ValueError(f"shares must give one fraction per attention type ({len(types)}), got {shares!r}")
    shares = [number_at_least(f"shares[{i}]", s, 0.0, strict=True) for i, s in enumerate(shares)]
    if abs(sum(shares) - 1) > 1e-9:
        raise ValueError(f"shares must sum to 1, got {sum(shares):g}")
    layer = _layer_bytes(spec, block_size, dtype, tp)
    pools = []
    for (attention, n), share in zip(types, shares):
        page = layer * n
        pools.append(Pool(f"{attention.kind} ({n} layers)", page, int(budget_bytes * share) // page,
                          ((attention, 1),)))
    label = " / ".join(f"{100 * s:.3g}%" for s in shares)
    return Layout(f"separate pools {label}", spec.name, block_size, budget_bytes, layer, tuple(pools),
                  tuple(types))


def demand_share(spec: ModelSpec, contexts, *, block_size: int = 16) -> list[float]:
    """Each attention type's share of the bytes requests of these ``contexts`` hold together (no
    padding): the split a separate-pool layout would be sized at for that mix. Example:
    gpt-oss-120b at 4,096 tokens: sliding 8 blocks, full 256 -> [0.030, 0.970]."""
    c = np.asarray(contexts, dtype=np.int64)
    per_type = [n * float(blocks_held_array(a, c, block_size).sum()) for a, n in attention_groups(spec)]
    total = sum(per_type)
    if total <= 0:
        raise ValueError("contexts hold no blocks")
    return [x / total for x in per_type]


@dataclass(frozen=True)
class ReplayResult:
    """What one layout sustained over a replayed trace (modelled; see :func:`replay`).

    ``never_fit``: requests too long for the layout even alone (left out of the replay).
    ``steps``: decode steps until every other request finished. ``mean_running``: running
    requests averaged over the steps (time-weighted), ``peak_running`` their most.
    ``free_while_waiting``: the share of the budget that sat free, averaged over the steps in which
    the queue's head could not be admitted (stranded memory under separate pools; what a single
    pool's last partial fit leaves otherwise). ``padding_share``: padding bytes over held bytes.
    ``last_block_waste``: the share of a full-attention table's token slots left empty in the
    running requests' last blocks, averaged over every decode step (internal fragmentation:
    about (block - 1) / 2 slots a request).
    """

    layout: str
    requests: int
    never_fit: int
    steps: int
    mean_running: float
    peak_running: int
    preemptions: int
    free_while_waiting: float
    padding_share: float
    last_block_waste: float = 0.0


def replay(layout: Layout, prompts, outputs, *, max_running: int = 256) -> ReplayResult:
    """Replay requests of these ``prompts``/``outputs`` lengths through ``layout`` (modelled).

    All requests wait at t = 0 in order. Each round: the queue's head is admitted (its prompt
    computed at once) while every pool holds its demand and fewer than ``max_running`` (vLLM's
    ``max_num_seqs``, 256) run; every running request then decodes ``k`` tokens (``k`` = the block
    size, or fewer up to the next finish: demand is counted at the block granularity it changes
    at, which keeps the replay fast); finished requests leave; while a pool overflows, the newest
    running request is preempted (recomputed: back to the queue's head with its context). A
    request whose demand alone, at any length up to its last token, exceeds a pool never runs
    (``never_fit``). Example: one pool of 3 blocks of 16 tokens, two requests of 16 prompt + 17
    output tokens: both run 16 steps, at 32 tokens they need 4 blocks and the second is preempted;
    the first finishes a step later, the second is readmitted at 32 tokens and finishes after one
    more: 18 steps, mean running 34/18, 1 preemption.
    """
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a Layout, got {type(layout).__name__}")
    max_running = int_at_least("max_running", max_running, 1)
    p, o = np.asarray(prompts), np.asarray(outputs)
    if not (np.issubdtype(p.dtype, np.integer) and np.issubdtype(o.dtype, np.integer)):
        raise ValueError("prompts and outputs must be integer token counts")
    p, o = p.astype(np.int64), o.astype(np.int64)
    if p.ndim != 1 or p.shape != o.shape or len(p) == 0:
        raise ValueError("prompts and outputs must be equal-length, non-empty sequences of lengths")
    if (p < 1).any() or (o < 0).any():
        raise ValueError("prompts must be >= 1 token and outputs >= 0")
    bs = layout.block_size
    pools = layout.pools
    cap = np.array([pl.num_blocks for pl in pools], dtype=np.int64)
    final = p + o
    peak = np.stack([pl.peak(final, bs) for pl in pools])  # (pools, requests)
    fits = (peak <= cap[:, None]).all(axis=0)
    queue = deque(np.flatnonzero(fits).tolist())
    resume = p.copy()  # context a request is (re)admitted at
    run_ids: list[int] = []
    ctx = np.zeros(0, dtype=np.int64)
    page = np.array([pl.page_bytes for pl in pools], dtype=np.int64)
    steps = preemptions = peak_running = 0
    running_sum = waiting_steps = 0.0
    slots_sum = tokens_sum = 0
    free_sum = held_sum = real_sum = 0.0
    padded = layout.padding_layers > 0

    def demand(c: np.ndarray) -> np.ndarray:
        return np.array([int(pl.blocks(c, bs).sum()) for pl in pools], dtype=np.int64)

    used = np.zeros(len(pools), dtype=np.int64)
    while queue or run_ids:
        waiting = False
        while queue and len(run_ids) < max_running:
            head = queue[0]
            need = demand(np.array([resume[head]]))
            if ((used + need) > cap).any():
                waiting = True
                break
            queue.popleft()
            run_ids.append(head)
            ctx = np.append(ctx, resume[head])
            used = used + need
        require(bool(run_ids), "replay: the queue's head fits alone, so something runs")
        k = max(1, int(min(bs, (final[run_ids] - ctx).min())))
        held = float((used * page).sum())
        steps += k
        running_sum += k * len(run_ids)
        held_sum += k * held
        peak_running = max(peak_running, len(run_ids))
        if padded:
            real_sum += k * layout.real_bytes(ctx)
        held_tokens = ctx[:, None] + np.arange(k)  # each request's tokens at each of the k steps
        slots_sum += int((-(-held_tokens // bs) * bs).sum())
        tokens_sum += int(held_tokens.sum())
        if waiting:
            waiting_steps += k
            free_sum += k * (layout.budget_bytes - held) / layout.budget_bytes
        ctx = ctx + k
        done = ctx >= final[run_ids]
        if done.any():
            run_ids = [r for r, d in zip(run_ids, done) if not d]
            ctx = ctx[~done]
        used = demand(ctx)
        while (used > cap).any():  # the newest makes room, to be recomputed from its context
            victim = run_ids.pop()
            resume[victim] = ctx[-1]
            ctx = ctx[:-1]
            queue.appendleft(victim)
            preemptions += 1
            used = demand(ctx)
    padding_share = 1 - real_sum / held_sum if padded and held_sum else 0.0
    return ReplayResult(layout.name, len(p), int((~fits).sum()), steps,
                        running_sum / steps if steps else 0.0, peak_running, preemptions,
                        free_sum / waiting_steps if waiting_steps else 0.0, padding_share,
                        1 - tokens_sum / slots_sum if slots_sum else 0.0)

