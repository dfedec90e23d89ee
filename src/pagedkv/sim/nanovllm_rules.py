"""An engine written here with nano-vllm's rules: its scheduler, sequence and block manager.

nano-vllm (github.com/GeeeekExplorer/nano-vllm, MIT) is not on PyPI under its own name, its
package imports torch, and its code is not copied into pagedkv. When its files are not at hand
(:mod:`pagedkv.sim.nanovllm_files` finds them when they are), this module stands in for them: the
classes take the same constructor arguments and answer the same methods as nano-vllm's
``Scheduler``, ``Sequence`` and ``BlockManager`` (the engine with chunked prefill, from April 2026
on), so one driver (:mod:`pagedkv.sim.nanovllm_replay`) runs either. It imports nothing of
nano-vllm and must never claim to be it: the report says which one ran.

The rules, as nano-vllm's engine applies them:

* Scheduling. Prefill first: the head of the waiting queue is admitted while fewer than
  ``max_num_seqs`` are scheduled and the step's ``max_num_batched_tokens`` is not spent; only the
  first sequence of a step may be cut into a chunk. A step with any prefill is a prefill step.
  Otherwise every running sequence decodes one token; one that may need a block and finds none
  preempts the newest running sequence (itself when it is the last), which goes back to the head
  of the waiting queue with its blocks released and is recomputed later.
* After the forward pass: the blocks the step's computed positions complete are published, then
  the scheduled tokens count as computed; a sequence whose prompt is done takes its new token,
  and one at its ``max_tokens`` (or at ``eos``) finishes and releases its blocks.
* Blocks. One first-in first-out queue of free block ids, clean or cached alike: a new block is
  the head of the queue (its cached content, if any, is forgotten then), a released one goes to
  the tail, still findable. Hashes chain block by block (a block's hash covers its prefix); the
  block holding the last prompt token is never looked up; a hit on a free block takes it out of
  the queue wherever it is (a search of the queue). ``allocate`` gives a block to every prompt
  position at once; a decode token that starts a block (``len(seq) % block_size == 1``) takes one.
  Two equal blocks published: the map keeps the last.

Worked example (block size 4, 8 blocks; prompt of 9 tokens, then the same prompt again after the
first finished with one output token): the first ``can_allocate`` answers 0 (3 new blocks), the
second 2 (blocks 0 and 1 revived from the free queue; the third block holds the last token and is
always computed).
"""
from __future__ import annotations

import hashlib
from collections import deque
from enum import Enum, auto
from itertools import count

import numpy as np

__all__ = ["Scheduler", "Sequence", "SequenceStatus", "BlockManager", "SOURCE", "RULES"]

SOURCE = "a scheduler, sequence and block manager written here with nano-vllm's rules"
RULES = ("nano-vllm's rules: prefill first, only the step's first sequence cut into a chunk; a decode "
         "that finds no block preempts the newest running sequence, which is recomputed later; one "
         "first-in first-out queue of free blocks, cached or clean; block hashes chained, the block "
         "of the last prompt token never looked up.")


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """A request's tokens and the fields the scheduler and block manager keep on it.

    ``block_size`` is a class attribute, as in nano-vllm (its engine sets it from its config).
    """

    block_size = 256
    ids = count()

    def __init__(self, token_ids: list[int], sampling_params) -> None:
        self.seq_id = next(Sequence.ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.last_token = self.token_ids[-1]
        self.num_tokens = self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = 0  # positions whose KV is computed (or served from cache)
        self.num_scheduled_tokens = 0  # positions this step computes
        self.is_prefill = True
        self.block_table: list[int] = []
        self.max_tokens = sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1


def chain_hash(tokens: list[int], prefix: int | None) -> int:
    """A block's 64-bit hash, covering its tokens and (through ``prefix``) every block before."""
    h = hashlib.blake2b(digest_size=8)
    if prefix is not None:
        h.update(prefix.to_bytes(8, "little"))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    """Blocks by reference count, one FIFO queue of free ids, and a map from hash to block id."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.refs = [0] * num_blocks
        self.hashes: list[int | None] = [None] * num_blocks  # the published hash of each block
        self.contents: list[list[int] | None] = [None] * num_blocks  # its tokens, checked on a hit
        self.by_hash: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    def _cached(self, tokens: list[int], h: int) -> int | None:
        block = self.by_hash.get(h)
        return block if block is not None and self.contents[block] == tokens else None

    def _take_free(self) -> int:
        """The head of the free queue, its cached content forgotten."""
        block = self.free_block_ids.popleft()
        h = self.hashes[block]
        if h is not None and self.by_hash.get(h) == block:
            del self.by_hash[h]
        self.refs[block], self.hashes[block], self.contents[block] = 1, None, None
        return block

    def can_allocate(self, seq: Sequence) -> int:
        """Cached blocks of the prompt (never its last block), or -1 when it does not fit."""
        h, hits, new = None, 0, seq.num_blocks
        for i in range(seq.num_blocks - 1):
            tokens = seq.block(i)
            h = chain_hash(tokens, h)
            block = self._cached(tokens, h)
            if block is None:
                break
            hits += 1
            new -= self.refs[block] > 0  # a hit on a free block still takes a free block
        return hits if len(self.free_block_ids) >= new else -1

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        h = None
        for i in range(num_cached_blocks):
            h = chain_hash(seq.block(i), h)
            block = self.by_hash[h]
            if self.refs[block] == 0:
                self.free_block_ids.remove(block)
            self.refs[block] += 1
            seq.block_table.append(block)
        seq.block_table.extend(self._take_free() for _ in range(num_cached_blocks, seq.num_blocks))
        seq.num_cached_tokens = num_cached_blocks * self.block_size

    def deallocate(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free_block_ids.append(block)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq: Sequence) -> bool:
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: Sequence) -> None:
        if len(seq) % self.block_size == 1:
            seq.block_table.append(self._take_free())

    def hash_blocks(self, seq: Sequence) -> None:
        """Publish the blocks that this step's computed positions complete."""
        bs = self.block_size
        first = seq.num_cached_tokens // bs
        end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // bs
        h = self.hashes[seq.block_table[first - 1]] if first > 0 else None
        for i in range(first, end):
            block, tokens = seq.block_table[i], seq.block(i)
            h = chain_hash(tokens, h)
            self.hashes[block], self.contents[block] = h, tokens
            self.by_hash[h] = block


class Scheduler:
    """Prefill first (chunked for the head of the queue only), then decode with preemption."""

    def __init__(self, config) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos = config.eos
        self.block_size = config.kvcache_block_size
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.kvcache_block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        scheduled = self._prefill()
        if scheduled:
            return scheduled, True
        return self._decode(), False

    def _prefill(self) -> list[Sequence]:
        bm, scheduled, batched = self.block_manager, [], 0
        while self.waiting and len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            budget = self.max_num_batched_tokens - batched
            if budget == 0:
                break
            new_admission = not seq.block_table
            if new_admission:
                cached = bm.can_allocate(seq)
                if cached == -1:
                    break
                todo = seq.num_tokens - cached * self.block_size
            else:
                todo = seq.num_tokens - seq.num_cached_tokens
            if budget < todo and scheduled:  # only the step's first sequence is chunked
                break
            if new_admission:
                bm.allocate(seq, cached)
            seq.num_scheduled_tokens = min(todo, budget)
            batched += seq.num_scheduled_tokens
            if seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                seq.status = SequenceStatus.RUNNING
                self.waiting.popleft()
                self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    def _decode(self) -> list[Sequence]:
        bm, scheduled = self.block_manager, []
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not bm.can_append(seq):
                victim = self.running.pop() if self.running else seq
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                seq.num_scheduled_tokens = 1
                seq.is_prefill = False
                bm.may_append(seq)
                scheduled.append(seq)
        if not scheduled:
            raise RuntimeError("no sequence can decode: the pool holds less than one sequence")
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.is_prefill = True
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], is_prefill: bool) -> None:
        for seq, token in zip(seqs, token_ids):
            self.block_manager.hash_blocks(seq)
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if is_prefill and seq.num_cached_tokens < seq.num_tokens:
                continue  # a prompt chunk: no token yet
            seq.append_token(token)
            if (not seq.ignore_eos and token == self.eos) or seq.num_completion_tokens == seq.max_tokens:
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
