"""Swap against recompute, per preemption: what moving a sequence's KV over PCIe costs, against
computing it again.

When blocks run out, an engine preempts a sequence of ``L`` tokens either by **recompute** (free
its blocks; prefill its ``L`` tokens again later) or by **swap** (copy its blocks to host memory
now and back later). Recompute costs the prefill FLOPs of ``L`` tokens whatever the block size.
Swap moves ``ceil(L / block_size)`` whole blocks each way, and each block is not one copy but
``copies_per_block``: a block's bytes are contiguous only within one layer's K or V tensor (vLLM's
``swap_blocks`` issues one ``cudaMemcpyAsync`` per block per layer's K and per layer's V; this
project's store keeps the same per-layer layout), so a Llama-3.1-8B block is 2 x 32 = 64 copies.
Each copy pays a fixed latency before its bytes flow, so small blocks are all latency and swap
loses; large blocks amortise it and swap wins. The vLLM paper's Fig. 19 measured this trade.

The model, per direction::

    transfers = ceil(L / block_size) x copies_per_block
    bytes     = ceil(L / block_size) x block_size x kv_bytes_per_token   (whole blocks move)
    seconds   = transfers x latency + bytes / bandwidth

and a preemption pays both directions (out now, in later). Recompute is the marginal prefill time
of the cost model (:mod:`pagedkv.sim.costmodel`): ``L x 2 x parameters / peak_flops``; the step's
fixed overhead is left out on both sides, since both happen inside a step that runs anyway.

Link defaults, with their sources:

- bandwidth 64e9 B/s per direction: PCIe 5.0 x16 (32 GT/s per lane x 16 lanes / 8 bits), the
  link of an H100; NVIDIA's H100 datasheet lists "PCIe Gen5: 128GB/s", both directions together.
  This is the link's peak: real copies get less, which makes swap look better here than it is.
- latency 10 us per copy: an **assumption**, not a measurement: the order of a
  ``cudaMemcpyAsync``'s fixed cost (call, DMA setup, completion) for a small pinned copy. Pass
  your own: the crossover block size scales with it (halve it, and the crossover halves too).

Worked number (Llama-3.1-8B: 131,072 KV bytes per token, 32 layers, 8.03e9 parameters; defaults
above, H100 BF16 989 TFLOP/s): a 1,024-token sequence with 16-token blocks moves 64 blocks,
134,217,728 bytes and 4,096 copies each way: 4,096 x 10 us + 134,217,728 / 64e9 = 43.06 ms per
direction, 86.11 ms for the swap, against 1,024 x 2 x 8.03e9 / 989e12 = 16.63 ms to recompute.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..checks import int_at_least, number_at_least
from . import sizing
from .costmodel import CostModel

__all__ = [
    "PCIE5_X16_BYTES_PER_S",
    "DEFAULT_COPY_LATENCY_S",
    "BLOCK_SIZES",
    "Link",
    "SwapCost",
    "copies_per_block",
    "swap_cost",
    "swap_cost_table",
    "crossover_block_size",
]

PCIE5_X16_BYTES_PER_S = 32e9 * 16 / 8  # 64e9: PCIe 5.0, 32 GT/s per lane, 16 lanes, per direction
DEFAULT_COPY_LATENCY_S = 10e-6  # assumption: fixed cost of one host<->device copy (see docstring)
BLOCK_SIZES = tuple(2**i for i in range(9))  # 1, 2, 4, ..., 256: the sizes the paper's Fig. 19 spans


@dataclass(frozen=True)
class Link:
    """The host<->device link: ``bandwidth`` bytes/s per direction and a fixed ``latency_s`` per
    copy (defaults and their sources in the module docstring)."""

    bandwidth: float = PCIE5_X16_BYTES_PER_S
    latency_s: float = DEFAULT_COPY_LATENCY_S

    def __post_init__(self) -> None:
        number_at_least("bandwidth", self.bandwidth, 0.0, strict=True)
        number_at_least("latency_s", self.latency_s, 0.0)

    def seconds(self, copies: int, nbytes: int) -> float:
        """Time for ``copies`` copies moving ``nbytes`` in all, one after another."""
        return copies * self.latency_s + nbytes / self.bandwidth

    def describe(self) -> str:
        return f"{self.bandwidth / 1e9:.0f} GB/s per direction, {self.latency_s * 1e6:.3g} µs per copy"


@dataclass(frozen=True)
class SwapCost:
    """One preemption of a ``tokens``-long sequence at one block size.

    ``blocks``, ``bytes_moved`` and ``copies`` are per direction (swap-out and swap-in move the
    same); ``swap_out_s`` = ``swap_in_s`` is one direction's time, ``swap_s`` both, and
    ``recompute_s`` the marginal prefill time of the tokens under the cost model.
    """

    model: str
    tokens: int
    block_size: int
    blocks: int
    bytes_moved: int
    copies: int
    swap_out_s: float
    swap_in_s: float
    recompute_s: float

    @property
    def swap_s(self) -> float:
        """Out now and in later: the whole cost of swapping instead of recomputing."""
        return self.swap_out_s + self.swap_in_s

    @property
    def swap_over_recompute(self) -> float:
        """How many times longer the swap takes than the recompute (< 1: swap wins)."""
        return self.swap_s / self.recompute_s

    @property
    def swap_wins(self) -> bool:
        """Whether swapping is no slower than recomputing."""
        return self.swap_s <= self.recompute_s


def _spec(model: str | sizing.ModelSpec) -> sizing.ModelSpec:
    return sizing.get_model(model) if isinstance(model, str) else model


def copies_per_block(model: str | sizing.ModelSpec) -> int:
    """Contiguous copies one block needs with per-layer K and V tensors: ``2 x layers`` (one for
    K, one for V per layer; Llama-3.1-8B: 64), or ``layers`` for MLA, whose one latent per layer
    holds both (DeepSeek-V3: 61)."""
    spec = _spec(model)
    return spec.num_layers if spec.is_mla else 2 * spec.num_layers


def swap_cost(tokens: int, block_size: int, model: str | sizing.ModelSpec = "Llama-3.1-8B", *,
              link: Link | None = None, cost_model: CostModel | None = None,
              copies: int | None = None) -> SwapCost:
    """Swap against recompute for one preemption of ``tokens`` tokens at ``block_size``.

    ``model`` is a built-in name (``pagedkv size --list``) or a spec; its KV bytes per token and
    layer count come from :mod:`pagedkv.sim.sizing`. ``cost_model`` (default: the cost model of
    the same built-in model, H100) prices the recompute; ``copies`` overrides
    :func:`copies_per_block` (1 for a store that keeps each block contiguous). See the module
    docstring for the formulas and a worked number.
    """
    tokens = int_at_least("tokens", tokens, 1)
    block_size = int_at_least("block_size", block_size, 1)
    spec = _spec(model)
    if copies is None:
        copies = copies_per_block(spec)
    copies = int_at_least("copies", copies, 1)
    link = Link() if link is None else link
    if cost_model is None:
        cost_model = CostModel.for_model(spec.name)
    kv_per_token = sizing.kv_bytes_per_token(spec)
    blocks = -(-tokens // block_size)
    nbytes = blocks * block_size * kv_per_token
    one_way = link.seconds(blocks * copies, nbytes)
    recompute = cost_model.step_time(0, prefill_tokens=tokens, decoding=False) - cost_model.overhead_s
    return SwapCost(spec.name, tokens, block_size, blocks, nbytes, blocks * copies, one_way, one_way,
                    recompute)


def swap_cost_table(tokens: int, block_sizes: Iterable[int] = BLOCK_SIZES,
                    model: str | sizing.ModelSpec = "Llama-3.1-8B", **kw) -> list[SwapCost]:
    """:func:`swap_cost` at each block size (default 1, 2, 4, ..., 256): the rows of a Fig. 19."""
    return [swap_cost(tokens, bs, model, **kw) for bs in block_sizes]


def crossover_block_size(tokens: int, block_sizes: Iterable[int] = range(1, 257),
                         model: str | sizing.ModelSpec = "Llama-3.1-8B", **kw) -> int | None:
    """The smallest of ``block_sizes`` at which swapping a ``tokens``-long sequence is no slower
    than recomputing it (None if swap never wins there). Swap time falls with the block size
    (fewer copies) except where a bigger last block pads more, so this is where the curves
    first cross. Worked number: Llama-3.1-8B, 1,024 tokens, the default link: block sizes up to
    113 need 10 or more blocks (>= 17.0 ms of swap against 16.6 ms of recompute); 114 needs 9
    (15.7 ms): 114.
    """
    for bs in sorted(block_sizes):
        if swap_cost(tokens, bs, model, **kw).swap_wins:
            return bs
    return None
