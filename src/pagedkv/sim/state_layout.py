"""Memory layouts for recurrent-state hybrids: where one GPU's KV budget puts K/V pages and states.

A hybrid such as Qwen3-Next keeps K/V per token in its attention layers and one fixed-size state
per sequence in each gated DeltaNet or Mamba layer. Three ways to hold both in the same bytes,
each built as a :class:`~pagedkv.sim.page_layout.Layout` and replayed by
:func:`~pagedkv.sim.page_layout.replay` (modelled, as that function says):

- ``vLLM pages`` (vLLM v1): one page size for every group. The attention block grows until one
  layer's attention page holds one layer's state (:func:`~pagedkv.sim.state_sizing.
  vllm_attention_block_size`), the state is padded to the page, and layers are dealt into groups
  of equal layer count (one block = one page per layer of a group). A request holds
  ceil(tokens / block) blocks per attention group and one block per state group.
- ``separate pools``: a state pool (one slot per running request) and a pool of 16-token
  attention pages, the budget split at a fixed share. The split is chosen either in hindsight
  (the best of a sweep, on the very lengths replayed) or as a server would set it before seeing
  the trace: SGLang's default ``--mamba-full-memory-ratio 0.9`` (state pool : KV pool = 0.9,
  https://docs.sglang.io/docs/advanced_features/hybrid_model_memory), a state share of 0.9 / 1.9.
- ``small pages`` (pagedkv's choice): one pool of 16-token pages (one page holds 16 tokens of
  every attention layer, one attention group); a sequence's states take ceil(state bytes per
  sequence / page bytes) pages of the same pool, so a state is a fixed number of ordinary blocks
  and no page is padded beyond the last one of the state.

Imports :mod:`pagedkv.sim.page_layout` and :mod:`pagedkv.sim.state_sizing`; knows nothing of the
allocator. Prefix hit rate is :mod:`pagedkv.sim.state_hits`' (replays through the allocator).

Worked number (Qwen3-Next-80B-A3B on an H100 80 GiB at tensor parallelism 4, bf16, utilisation
0.9, 81e9 parameters x 2 bytes / 4 = 37.7 GiB of weights per GPU: 34.3 GiB of KV): vLLM's block is
16 x ceil(274,432 / (16 x 1,024)) = 272 tokens, so each running request leaves about 135.5 slots of
12 layers x 1,024 bytes empty (1.6 MiB); 16-token pages leave 7.5 (0.1 MiB).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..checks import int_at_least, number_at_least
from ..kv_specs import FullAttention
from .page_layout import Layout, Pool, ReplayResult, replay
from .sizing import GIB, kv_budget_bytes
from .state_sizing import HybridModel, HybridSizing, get_hybrid, hybrid_sizing

__all__ = [
    "LayoutSetup",
    "DEFAULT_SETUP",
    "SGLANG_STATE_RATIO",
    "vllm_state_layout",
    "separate_state_layout",
    "small_page_layout",
    "LayoutRow",
    "compare_state_layouts",
    "best_split",
]

# SGLang's default --mamba-full-memory-ratio: state pool bytes : KV pool bytes.
SGLANG_STATE_RATIO = 0.9


@dataclass(frozen=True)
class LayoutSetup:
    """One GPU's KV budget for a model: ``gpu_mem_gib x util - weights_gib`` at ``tp``, and the
    most requests the engine runs at once (``max_running``, vLLM's ``max_num_seqs``)."""

    model: str
    gpu: str
    gpu_mem_gib: float
    util: float
    tp: int
    weights_gib: float
    weights_source: str
    max_running: int

    @property
    def budget_bytes(self) -> int:
        return kv_budget_bytes(self.gpu_mem_gib, self.util, self.weights_gib)

    def hybrid(self) -> HybridModel:
        model = get_hybrid(self.model)
        if model is None:
            raise ValueError(f"unknown built-in hybrid {self.model!r}")
        return model


# Qwen3-Next-80B-A3B, 81e9 parameters (Hugging Face's count for the checkpoint) in bf16, split over
# four H100s; max_running 1,024 is vLLM's max_num_seqs default on GPUs of 70 GiB or more other than
# the A100 (EngineArgs.get_batch_defaults in vllm/engine/arg_utils.py).
DEFAULT_SETUP = LayoutSetup("Qwen3-Next-80B-A3B", "H100 80 GiB", 80.0, 0.9, 4, 81e9 * 2 / 4 / GIB,
                            "81e9 parameters x 2 bytes (bf16) / tp 4", 1024)


def _sizing(model: HybridModel, tp: int, block_size: int) -> HybridSizing:
    return hybrid_sizing(model, tp=tp, block_size=block_size)


def vllm_state_layout(model: HybridModel, budget_bytes: int, *, tp: int = 1, block_size: int = 16) -> Layout:
    """vLLM's layout: one pool whose block is a page (``block`` tokens of one layer, or one padded
    state) for each of a group's layers; a request holds ceil(tokens / block) blocks per attention
    group and one block per state group. Qwen3-Next at tp 4: block 272, groups of 12 layers
    (1 attention group, 3 state groups), a pool block of 12 x 278,528 bytes."""
    budget = int_at_least("budget_bytes", budget_bytes, 1)
    s = _sizing(model, tp, block_size)
    g = s.vllm_group_layers
    block_bytes = s.vllm_page_bytes * g
    pool = Pool(f"pages of {s.vllm_block_size} tokens x {g} layers", block_bytes, budget // block_bytes,
                ((FullAttention(), s.vllm_attention_groups),), state_blocks=s.vllm_state_groups)
    return Layout(f"vLLM pages (block {s.vllm_block_size})", model.name, s.vllm_block_size, budget,
                  s.vllm_page_bytes, (pool,), ((FullAttention(), model.attention_layers),))


def separate_state_layout(model: HybridModel, budget_bytes: int, state_share: float, *, tp: int = 1,
                          block_size: int = 16, label: str = "") -> Layout:
    """A state pool holding ``state_share`` of the budget (one slot = one sequence's states, every
    state layer) and a pool of ``block_size``-token attention pages holding the rest."""
    budget = int_at_least("budget_bytes", budget_bytes, 1)
    share = number_at_least("state_share", state_share, 0.0, strict=True)
    if share >= 1:
        raise ValueError(f"state_share must be in (0, 1), got {state_share!r}")
    s = _sizing(model, tp, block_size)
    page = s.small_page_bytes(block_size)
    states = Pool("states", s.state_bytes_per_sequence, int(budget * share) // s.state_bytes_per_sequence, (),
                  state_blocks=1)
    attention = Pool(f"attention pages of {block_size} tokens", page, int(budget * (1 - share)) // page,
                     ((FullAttention(), 1),))
    name = f"separate pools, states {100 * share:.3g}%" + (f" ({label})" if label else "")
    return Layout(name, model.name, block_size, budget, page // model.attention_layers, (states, attention),
                  ((FullAttention(), model.attention_layers),))


def small_page_layout(model: HybridModel, budget_bytes: int, *, tp: int = 1, block_size: int = 16) -> Layout:
    """One pool of ``block_size``-token pages (every attention layer in one page); a sequence's
    states take :meth:`~pagedkv.sim.state_sizing.HybridSizing.state_pages` pages of it.
    Qwen3-Next at tp 4: pages of 16 x 12 x 1,024 = 196,608 bytes, states of 36 x 274,432 bytes in
    ceil(9,879,552 / 196,608) = 51 pages."""
    budget = int_at_least("budget_bytes", budget_bytes, 1)
    s = _sizing(model, tp, block_size)
    page = s.small_page_bytes(block_size)
    pool = Pool(f"pages of {block_size} tokens", page, budget // page, ((FullAttention(), 1),),
                state_blocks=s.state_pages(block_size))
    return Layout(f"small pages ({block_size} tokens), states in {s.state_pages(block_size)} pages",
                  model.name, block_size, budget, page // model.attention_layers, (pool,),
                  ((FullAttention(), model.attention_layers),))


@dataclass(frozen=True)
class LayoutRow:
    """One layout's replay: its name, its state share when it splits pools, and the result."""

    layout: Layout
    state_share: float | None
    result: ReplayResult


def best_split(model: HybridModel, budget_bytes: int, prompts, outputs, *, tp: int = 1, block_size: int = 16,
               max_running: int = 1024, shares: Sequence[float] | None = None) -> LayoutRow:
    """The separate-pool split that ran the most requests at once on these lengths, in hindsight:
    a sweep of state shares 5%, 10%, ..., 95%, then 1% steps around the best."""
    def run(share: float) -> LayoutRow:
        lay = separate_state_layout(model, budget_bytes, share, tp=tp, block_size=block_size, label="best in hindsight")
        return LayoutRow(lay, share, replay(lay, prompts, outputs, max_running=max_running))

    coarse = [run(x) for x in (shares or [i / 20 for i in range(1, 20)])]
    best = max(coarse, key=lambda r: (r.result.mean_running, -r.result.never_fit))
    if shares is None:
        fine = [run(round(best.state_share + d / 100, 2)) for d in range(-4, 5) if d and 0 < best.state_share + d / 100 < 1]
        best = max([best, *fine], key=lambda r: (r.result.mean_running, -r.result.never_fit))
    return best


def compare_state_layouts(model: HybridModel, budget_bytes: int, prompts, outputs, *, tp: int = 1,
                          block_size: int = 16, max_running: int = 1024) -> list[LayoutRow]:
    """Replay the same lengths through vLLM's pages, separate pools (best split in hindsight, and
    SGLang's default split) and one pool of small pages, all holding ``budget_bytes``."""
    p, o = np.asarray(prompts), np.asarray(outputs)
    rows = [LayoutRow(lay, None, replay(lay, p, o, max_running=max_running)) for lay in
            (vllm_state_layout(model, budget_bytes, tp=tp, block_size=block_size),
             small_page_layout(model, budget_bytes, tp=tp, block_size=block_size))]
    typical = SGLANG_STATE_RATIO / (1 + SGLANG_STATE_RATIO)
    lay = separate_state_layout(model, budget_bytes, typical, tp=tp, block_size=block_size,
                                label="SGLang's default ratio 0.9")
    rows.insert(1, LayoutRow(lay, typical, replay(lay, p, o, max_running=max_running)))
    rows.insert(1, best_split(model, budget_bytes, p, o, tp=tp, block_size=block_size, max_running=max_running))
    return rows
