"""nano-vllm's ``BlockManager`` on pagedkv: the same six methods, the same meaning.

nano-vllm (github.com/GeeeekExplorer/nano-vllm) keeps its allocator in
``nanovllm/engine/block_manager.py``; its scheduler calls it through six methods, and its model
runner reads ``seq.block_table``. Replacing one import in ``nanovllm/engine/scheduler.py``::

    from pagedkv.integrations.nanovllm import BlockManager

runs nano-vllm's scheduler and model runner on :class:`~pagedkv.KVCacheManager`. This module
imports nothing of nano-vllm: it reads and writes the attributes of nano-vllm's ``Sequence`` that
nano-vllm's own manager does (``seq_id``, ``token_ids``, ``num_tokens``, ``last_token``,
``num_cached_tokens``, ``num_scheduled_tokens``, ``block_table``), and must never know anything
else of the engine.
"""
from __future__ import annotations

from typing import Any

from ..manager import KVCacheManager
from ..checks import as_int

__all__ = ["BlockManager"]


class BlockManager:
    """A drop-in for nano-vllm's ``BlockManager(num_blocks, block_size)`` on a KVCacheManager.

    What each method does, as nano-vllm's scheduler and model runner expect:

    * ``can_allocate(seq)``: the number of cached blocks of ``seq.token_ids`` (after a preemption
      that includes the generated tokens), or -1 when the prompt does not fit. A hit on a
      cached-free block uses a free block, as in nano-vllm. Never the block holding the last
      token. Changes nothing.
    * ``allocate(seq, num_cached_blocks)``: fills ``seq.block_table`` with a block for every
      position at once (``add_sequence(..., prefill=0, reserve=True)``: reserve now, publish as
      computed) and sets ``seq.num_cached_tokens``. Nothing beyond the hits is findable yet.
    * ``hash_blocks(seq)``: after the step's forward pass, before the scheduler adds the scheduled
      tokens: publishes the blocks wholly inside ``num_cached_tokens + num_scheduled_tokens``. A
      prefill chunk is ``prefill(id, n)`` (it allocates nothing: the blocks were reserved); a
      decode step appends the token computed this step (``seq.last_token``), unless
      ``may_append`` already did.
    * ``can_append(seq)`` / ``may_append(seq)``: a new block exactly when
      ``len(seq) % block_size == 1``, appended to ``seq.block_table`` (the model runner computes
      the decode slot from its last entry), so that ``block_table`` holds ``seq.num_blocks`` ids.
    * ``deallocate(seq)``: releases tail first, keeps computed blocks cached (unscheduled reserved
      blocks go back clean), resets ``num_cached_tokens`` and clears ``block_table`` in place.

    What the user gains: ``manager`` is the KVCacheManager underneath. ``manager.usage()`` gives
    used, cached and free blocks, internal fragmentation, hit tokens and evictions;
    ``enable_events=True`` queues KV events (vLLM's wire format through
    :mod:`pagedkv.events`, for a KV-aware router) to drain with ``manager.take_events()``;
    ``host_blocks=N`` adds a host tier that keeps what the device evicts and serves prefix hits
    from it, whose moves the engine runs with ``manager.take_transfers()`` before each forward
    pass (nano-vllm's model runner has no such call: add one). Revival of a cached block is
    O(1), not nano-vllm's O(n) ``deque.remove``.

    Where it legitimately differs from nano-vllm's own manager (the scheduling decisions, hit
    counts and token positions are otherwise the same step by step):

    * Block ids. pagedkv hands out clean blocks (most recently freed first) before evicting
      cached ones, least recently freed first; nano-vllm takes the head of one FIFO of free ids,
      cached or clean. So tables hold other ids, and once the pool is full pagedkv evicts later,
      which can leave it more hits than nano-vllm.
    * Two equal blocks published (two prompts computing the same new prefix in one step): the
      map keeps the first, and the second goes back clean when freed; nano-vllm's map keeps the
      last published.
    * A decode token that starts a block is appended to the manager in ``may_append`` (the new
      block's id is needed before the forward pass); one that fills a block is appended, and its
      block published, in ``hash_blocks``, as nano-vllm publishes it. With block size 1 every
      token would do both, and nano-vllm's rule ``len(seq) % block_size == 1`` never takes a
      block: block size 1 is refused.
    * Hashes: sha256 chained (``hash_algo`` as in KVCacheManager) instead of xxh64 with a token
      comparison on each hit; a sha256 collision is not a practical concern.
    * ``allocate`` with a ``num_cached_blocks`` other than what the cache serves now (nano-vllm
      trusts it blindly) raises ValueError and changes nothing.

    Example (block size 256, 1,000 blocks, a 600-token prompt then the same prompt again after
    the first finished): ``can_allocate`` answers 0, then 2 (two full cached blocks; the block
    with the last token is always computed); ``seq.block_table`` holds 3 ids each time.
    """

    def __init__(self, num_blocks: int, block_size: int, *, hash_algo: str = "sha256",
                 enable_events: bool = False, host_blocks: int = 0,
                 host_write_policy: str = "write-back") -> None:
        if as_int(block_size, "block_size") < 2:
            raise ValueError(f"block_size must be at least 2 (nano-vllm takes a decode block when "
                             f"len(seq) % block_size == 1), got {block_size!r}")
        self.manager = KVCacheManager(num_blocks, block_size, hash_algo=hash_algo,
                                      enable_events=enable_events, host_blocks=host_blocks,
                                      host_write_policy=host_write_policy)
        self.block_size = self.manager.block_size
        # Sequences whose prompt is reserved and not all computed: hash_blocks schedules chunks
        self._prefilling: set = set()
        # (seq_id, num_tokens, answer) of the last can_allocate, while nothing has changed since:
        # the allocate that follows it need not look the prompt up again to validate its argument
        self._asked: tuple | None = None
        # seq_id -> cached blocks can_allocate found last time: where its next probe starts
        self._last_hits: dict = {}

    def can_allocate(self, seq: Any) -> int:
        """Cached blocks of ``seq``'s tokens, or -1 when its whole prompt does not fit.

        Why it probes prefixes: the scheduler asks about the head of its waiting queue every
        step, and a lookup of the whole prompt converts and fingerprints every token (about
        0.5 ms for a 14,000-token prompt), where nano-vllm hashes blocks only up to the first
        miss. Hits are a prefix property, so ``lookup(tokens[:L])`` that stops short of its own
        limit is the whole prompt's answer. The first probe ends one block past the hits this
        sequence had last time (one block, the first time), and each further probe doubles, so
        a call costs about the length of the cached prefix, not of the prompt. Example (block
        size 16, a 14,000-token prompt with nothing cached): one lookup of 17 tokens.
        """
        m, bs = self.manager, self.block_size
        tokens, n, sid = seq.token_ids, seq.num_tokens, seq.seq_id
        probe = (self._last_hits.get(sid, 0) + 1) * bs + 1
        while True:
            if probe >= n:
                hit = m.lookup(tokens)
                break
            hit = m.lookup(tokens[:probe])
            if hit < (probe - 1) // bs * bs:  # the chain stopped inside the probe
                break
            probe = 2 * probe - 1
        blocks = hit // bs
        self._last_hits[sid] = blocks
        need = -(-n // bs) - hit.device // bs + hit.revived
        answer = blocks if need <= m.num_free_blocks else -1
        self._asked = (sid, n, answer)
        return answer

    def allocate(self, seq: Any, num_cached_blocks: int) -> None:
        """Blocks for every position of ``seq``, the first ``num_cached_blocks`` from the cache."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id!r} already holds blocks")
        m, sid = self.manager, seq.seq_id
        if self._asked != (sid, seq.num_tokens, num_cached_blocks):
            num_cached_blocks = as_int(num_cached_blocks, "num_cached_blocks")
            hit = m.lookup(seq.token_ids)
            if hit != num_cached_blocks * self.block_size:
                raise ValueError(f"allocate({seq.seq_id!r}, {num_cached_blocks}) but the cache serves "
                                 f"{hit // self.block_size} blocks now: call can_allocate first")
        self._asked = None
        hit = m.add_sequence(sid, seq.token_ids, prefill=0, reserve=True)
        self._last_hits.pop(sid, None)
        if hit != num_cached_blocks * self.block_size:  # never, unless can_allocate is wrong
            m.free(sid)
            raise RuntimeError(f"allocate({sid!r}, {num_cached_blocks}): the cache served {hit} tokens")
        seq.block_table.extend(m.reserved_table(sid))
        seq.num_cached_tokens = hit
        self._prefilling.add(sid)

    def deallocate(self, seq: Any) -> None:
        """Release ``seq``'s blocks tail first; computed full blocks stay cached."""
        self._asked = None
        if seq.block_table:
            sid = seq.seq_id
            self.manager.free(sid)
            self._prefilling.discard(sid)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq: Any) -> bool:
        """Whether the decode step of ``seq`` gets the block it may need."""
        return seq.num_tokens % self.block_size != 1 or self.manager.num_free_blocks >= 1

    def may_append(self, seq: Any) -> None:
        """Give ``seq`` a new last block when its newest token starts one."""
        if seq.num_tokens % self.block_size == 1:
            self._asked = None
            slot = self.manager.append_token(seq.seq_id, seq.last_token)
            seq.block_table.append(slot // self.block_size)

    def hash_blocks(self, seq: Any) -> None:
        """After the forward pass: publish the blocks the step's computed positions complete."""
        self._asked = None
        sid = seq.seq_id
        if sid in self._prefilling:
            n = seq.num_scheduled_tokens
            self.manager.prefill(sid, n)
            if seq.num_cached_tokens + n == seq.num_tokens:
                self._prefilling.discard(sid)
        elif seq.num_tokens % self.block_size != 1:
            self.manager.append_token(sid, seq.last_token)
