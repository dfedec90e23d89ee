"""The paged allocator with a host tier: what offloading and swap preemption cost a server.

Why: a host tier changes two things a serving scheduler sees. Prefixes the device evicted are
**offloaded** to host memory and served back on a later hit (a load instead of a recompute),
and a preempted request can be **swapped** out and back in (two copies instead of recomputing
its prompt and generated tokens). Both move blocks over the host link, and the time they take
is part of the step that drains them.

:class:`TieredAllocator` is :class:`~pagedkv.sim.baselines.PagedAllocator` on a
:class:`~pagedkv.KVCacheManager` with ``host_blocks``. It adds what the scheduler
(:mod:`pagedkv.sim.scheduler`) asks of a tiered allocator:

- ``swap_out(req_id) -> bool``: preempt by swapping every sequence of the request out
  (``preemption="swap"``); False (nothing changed) when the mode is recompute, when the request
  was admitted or swapped in this iteration (its K/V is computed by this very step, so there
  is nothing to copy out yet: it is recomputed, as an engine does with a prompt mid-prefill),
  or when the host has too few free blocks. The scheduler then recomputes it.
- ``swap_in(req_id) -> bool``: bring it back, if the device has room for its host blocks.
- ``take_transfer_seconds(compute_s) -> float``: drain the iteration's transfers once (the
  engine's one drain per step) and return how long the step waits for them beyond its
  ``compute_s`` seconds of compute.

**The timing model** (stated, not measured). A batch of ``n`` block transfers in one direction
takes ``n x copies_per_block`` copies of one fixed latency each plus its bytes over the
bandwidth (:class:`~pagedkv.sim.swap_cost.Link`). Loads (host prefix hits, swap-ins) and
swap-outs are **synchronous**: the step's attention reads the loaded blocks, and a swap-out
frees device blocks this very step reuses, so the step waits for them (vLLM v0 swapped on the
compute stream). Offloads (copies of evicted or computed blocks to the host) are
**asynchronous**: they overlap the step's compute and lengthen it only by what exceeds it, as
vLLM's offloading connector and SGLang HiCache run them (DMA on a separate stream); this
assumes the engine copies a block out before it reuses it, as those engines do. Offloads and
loads go opposite ways over a full-duplex link and do not share bandwidth.

``copies_per_block`` is the layout's: a block is contiguous only within one layer's K or V
tensor in vLLM's per-layer layout (Llama-3.1-8B: 64 copies of 32 KiB for a 16-token block),
while a layout that keeps a block's layers together moves it in one copy (vLLM 0.12's
contiguous layout; SGLang HiCache's "page_first" host layout).

Worked number (Llama-3.1-8B, block size 16, default link 64 GB/s and 10 us per copy): a step
that swaps out a request of 64 private blocks waits 64 x 64 x 10 us + 64 x 2 MiB / 64e9 B/s =
43.06 ms in the per-layer layout, 0.64 + 2.10 = 2.74 ms with one copy per block; a step of
30 ms compute that offloads the same 64 blocks waits 43.06 - 30 = 13.06 ms, or nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..checks import int_at_least, optional_int_at_least, require
from ..types import TO_HOST
from . import sizing
from .baselines import ManagerAllocator, PagedAllocator
from .request import Request
from .swap_cost import Link
from .swap_cost import copies_per_block as layer_copies

__all__ = ["TieredAllocator", "TransferStats", "PREEMPTION_MODES"]

PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class TransferStats:
    """What a tiered run moved and what it cost, counted by the allocator.

    ``swap_outs`` / ``swap_ins``: requests swapped out and back in; ``swap_fallbacks``: victims
    recomputed although ``preemption="swap"`` (admitted this iteration, or the host was full);
    ``swapped_blocks``: device blocks the swap-outs copied to the host (synchronous);
    ``offloaded_blocks``: other blocks copied to the host (offloads, asynchronous);
    ``loaded_blocks``: blocks copied to the device (swap-ins and host prefix hits, synchronous);
    ``sync_s`` / ``async_s``: their link time summed over iterations; ``waited_s``: what the
    iterations waited for transfers in all (synchronous time plus offload time beyond compute).
    """

    swap_outs: int = 0
    swap_ins: int = 0
    swap_fallbacks: int = 0
    swapped_blocks: int = 0
    offloaded_blocks: int = 0
    loaded_blocks: int = 0
    sync_s: float = 0.0
    async_s: float = 0.0
    waited_s: float = 0.0

    @property
    def blocks_to_host(self) -> int:
        return self.swapped_blocks + self.offloaded_blocks


class TieredAllocator(PagedAllocator):
    """A paged allocator whose manager has ``host_blocks`` host blocks (0: none, plain paged).

    ``preemption``: ``"recompute"`` (the victim is freed, its evicted prefix offloaded, and a
    readmission loads from the host what it still holds) or ``"swap"`` (needs a host tier).
    ``write_policy`` is the manager's ``host_write_policy``. ``link`` prices the transfers
    (default :class:`~pagedkv.sim.swap_cost.Link`: PCIe 5.0 x16, 10 us per copy);
    ``model`` gives the bytes of a block, and its layer count the ``copies_per_block`` unless
    given (1 for a layout that keeps a block's layers contiguous). Other arguments are
    :class:`~pagedkv.sim.baselines.PagedAllocator`'s.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, host_blocks: int = 0, *,
                 preemption: str = "recompute", write_policy: str = "write-back",
                 link: Link | None = None, model: str = "Llama-3.1-8B",
                 copies_per_block: int | None = None, enable_prefix_caching: bool = True,
                 hash_algo: str = "sha256", watermark: float = 0.01, beam_seed: int = 0) -> None:
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {preemption!r}")
        host_blocks = int_at_least("host_blocks", host_blocks, 0)
        if preemption == "swap" and not host_blocks:
            raise ValueError("preemption='swap' needs a host tier (host_blocks > 0)")
        copies_per_block = optional_int_at_least("copies_per_block", copies_per_block, 1)
        if link is not None and not isinstance(link, Link):
            raise ValueError(f"link must be a Link, got {type(link).__name__}")
        spec = sizing.get_model(model)
        # PagedAllocator's request state over a manager that has the host tier (one manager,
        # built once: PagedAllocator.__init__ would build one without it)
        ManagerAllocator.__init__(
            self, num_blocks, block_size, watermark=watermark, enable_prefix_caching=enable_prefix_caching,
            hash_algo=hash_algo, host_blocks=host_blocks, host_write_policy=write_policy,
            name=f"paged + host {host_blocks:,} ({preemption})" if host_blocks else "paged")
        self._start_requests(beam_seed)
        self.host_blocks = host_blocks
        self.preemption = preemption
        self.link = Link() if link is None else link
        self.copies_per_block = layer_copies(spec) if copies_per_block is None else copies_per_block
        self.block_bytes = block_size * sizing.kv_bytes_per_token(spec)
        self.stats = TransferStats()
        self._live: set[str] = set()  # admitted and not released, swapped out or not
        self._swapped: dict[str, int] = {}  # req_id -> its tokens, which attention does not read
        self._swapped_tokens = 0
        self._fresh: set[str] = set()  # admitted or swapped in since the last drain
        self._swapping = 0  # blocks swapped out since the last drain (their to_host entries)

    # ---- the allocator interface ---------------------------------------------------------

    def admit(self, req: Request, generated: int = 0) -> bool:
        if not super().admit(req, generated):
            return False
        self._live.add(req.req_id)
        self._fresh.add(req.req_id)
        return True

    def release(self, req_id: str) -> None:
        tokens = self._swapped.pop(req_id, None)
        if tokens is not None:
            self._swapped_tokens -= tokens
        super().release(req_id)
        self._live.discard(req_id)
        self._fresh.discard(req_id)

    @property
    def kv_tokens(self) -> int:
        """Token states attention reads per step: a swapped-out request's are not read."""
        return super().kv_tokens - self._swapped_tokens

    def is_swapped(self, req_id: str) -> bool:
        return req_id in self._swapped

    # ---- swapping ------------------------------------------------------------------------

    def swap_out(self, req_id: str) -> bool:
        """Swap every sequence of the request out to the host; False (nothing changed, counted
        as a fallback when swapping was asked for) when it cannot, see the module docstring."""
        if req_id in self._swapped:
            raise ValueError(f"request {req_id} is swapped out already")
        if req_id not in self._live:
            raise KeyError(req_id)
        if self.preemption != "swap":
            return False
        m = self.m
        seqs = self.seq_ids(req_id)
        need = sum(1 for s in seqs for b in m.block_table(s) if m.refcount(b) == 1)
        if req_id in self._fresh or need > m.num_free_host_blocks:
            self.stats.swap_fallbacks += 1
            return False
        tokens = 0
        for s in seqs:
            tokens += m.num_tokens(s)
            m.swap_out(s)  # the host check above makes every one succeed
        self._swapped[req_id] = tokens
        self._swapped_tokens += tokens
        self.stats.swap_outs += 1
        self._swapping += need
        return True

    def swap_in(self, req_id: str) -> bool:
        """Bring a swapped-out request back; False (nothing changed) when the device lacks room
        for its host blocks plus one block per sequence for its next token (vLLM v0's
        ``can_swap_in`` rule: without it a request swapped in could not take its next step and
        would be preempted again at once), keeping the admission watermark free while others
        run."""
        if req_id not in self._swapped:
            raise ValueError(f"request {req_id} is not swapped out")
        m = self.m
        seqs = self.seq_ids(req_id)
        need = sum(m.num_swapped_blocks(s) for s in seqs) + len(seqs)  # at most what it takes
        others = len(self._live) > len(self._swapped)
        if m.num_free_blocks < need + (self.watermark_blocks if others else 0):
            return False
        for s in seqs:
            m.swap_in(s)
        self._swapped_tokens -= self._swapped.pop(req_id)
        self._fresh.add(req_id)
        self.stats.swap_ins += 1
        return True

    # ---- transfers -----------------------------------------------------------------------

    def take_transfer_seconds(self, compute_s: float = 0.0) -> float:
        """Drain this iteration's transfers; return how long the step waits for them beyond its
        ``compute_s`` of compute: swap-outs and loads in full, offloads beyond ``compute_s``
        (see the module docstring)."""
        transfers = self.m.take_transfers()
        self._fresh.clear()
        swapped, self._swapping = self._swapping, 0
        if not transfers:
            return 0.0
        to_host = sum(1 for t in transfers if t.direction == TO_HOST)
        loads = len(transfers) - to_host
        offloads = to_host - swapped  # every swapped-out block has its own to_host entry
        sync = self.transfer_seconds(swapped) + self.transfer_seconds(loads)
        overlapped = self.transfer_seconds(offloads)
        waited = sync + max(0.0, overlapped - compute_s)
        st = self.stats
        st.swapped_blocks += swapped
        st.offloaded_blocks += offloads
        st.loaded_blocks += loads
        st.sync_s += sync
        st.async_s += overlapped
        st.waited_s += waited
        return waited

    def transfer_seconds(self, blocks: int) -> float:
        """Link time of one batch of ``blocks`` block transfers in one direction."""
        return self.link.seconds(blocks * self.copies_per_block, blocks * self.block_bytes) if blocks else 0.0

    def check(self) -> None:
        """The manager's invariants, and the token count attention reads equals the running
        (not swapped-out) sequences' lengths."""
        m = self.m
        m.check_invariants()
        running = [r for r in self._live if r not in self._swapped]
        read = sum(m.num_tokens(s) for r in running for s in self.seq_ids(r))
        require(self.kv_tokens == read, f"{self.kv_tokens} token states counted as read, running sequences hold {read}")
        require(self._swapped_tokens == sum(self._swapped.values()), "swapped-out token count out of step")
