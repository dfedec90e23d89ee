"""One replay of requests through a nano-vllm engine, on either allocator, with its allocator timed.

The engine (:class:`~pagedkv.sim.nanovllm_files.Engine`: nano-vllm's own files, or the one
written here with its rules) runs as nano-vllm's ``LLMEngine.step`` runs it: ``schedule()``, a
forward pass, ``postprocess(seqs, token_ids, is_prefill)``. The forward pass is a stand-in whose
next token is a function of the sequence's content, so a preempted sequence recomputes the same
tokens and both allocators see the same requests token for token; it never emits ``eos``, so
each request generates exactly its ``max_tokens``. The scheduler's block manager is replaced
after construction by :class:`TimedBlockManager` around the allocator under test: nano-vllm's
own ``BlockManager`` (``"nano-vllm"``) or :class:`pagedkv.integrations.nanovllm.BlockManager`
(``"pagedkv"``).

What one replay measures (:class:`EngineRun`): steps; preemptions (a release of a sequence that
has not generated all its tokens); prefix-hit tokens and tokens at admission (a re-admission
after a preemption counts again, with its generated tokens); blocks in use after each
``schedule()`` (distinct block ids in the tables of the scheduler's sequences, what the forward
pass holds); the tokens each step schedules (two runs whose lists are equal scheduled alike, to
the step); and nanoseconds in each of the six methods the scheduler calls, each call between
two ``perf_counter_ns`` reads (about 50 ns a call, alike on both sides). Worked example: the
first 120 Mooncake requests of at most 8,192 tokens (outputs capped at 512), on 96 blocks of 256
tokens, take 5,623 steps with 20 preemptions; on 2,000 blocks, 535 steps and none.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from ..checks import int_at_least
from ..integrations.nanovllm import BlockManager as PagedBlockManager
from .nanovllm_files import Engine

__all__ = ["METHODS", "ALLOCATORS", "EngineRun", "TimedBlockManager", "replay", "next_token"]

METHODS = ("can_allocate", "allocate", "hash_blocks", "can_append", "may_append", "deallocate")
ALLOCATORS = ("nano-vllm", "pagedkv")
VOCAB = 32_000  # token ids the stand-in forward pass emits (never nano-vllm's eos, -1 here)


@dataclass
class EngineRun:
    """What one replay measured (see the module docstring)."""

    steps: int = 0
    preemptions: int = 0
    hit_tokens: int = 0
    admitted_tokens: int = 0
    blocks_in_use: list[int] = field(default_factory=list)  # after each schedule()
    scheduled_tokens: list[int] = field(default_factory=list)  # each step's, prefill or decode
    ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(METHODS, 0))

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.admitted_tokens if self.admitted_tokens else 0.0

    @property
    def allocator_seconds(self) -> float:
        return sum(self.ns.values()) / 1e9


class TimedBlockManager:
    """The six methods of ``inner``, each call timed into ``run.ns``; admissions and preemptions
    counted into ``run`` as they pass."""

    def __init__(self, inner: Any, run: EngineRun) -> None:
        self.inner, self.run = inner, run
        self.block_size = inner.block_size

    def can_allocate(self, seq) -> int:
        t = time.perf_counter_ns()
        answer = self.inner.can_allocate(seq)
        self.run.ns["can_allocate"] += time.perf_counter_ns() - t
        return answer

    def allocate(self, seq, num_cached_blocks: int) -> None:
        t = time.perf_counter_ns()
        self.inner.allocate(seq, num_cached_blocks)
        self.run.ns["allocate"] += time.perf_counter_ns() - t
        self.run.hit_tokens += seq.num_cached_tokens
        self.run.admitted_tokens += seq.num_tokens

    def deallocate(self, seq) -> None:
        self.run.preemptions += seq.num_completion_tokens < seq.max_tokens
        t = time.perf_counter_ns()
        self.inner.deallocate(seq)
        self.run.ns["deallocate"] += time.perf_counter_ns() - t

    def can_append(self, seq) -> bool:
        t = time.perf_counter_ns()
        answer = self.inner.can_append(seq)
        self.run.ns["can_append"] += time.perf_counter_ns() - t
        return answer

    def may_append(self, seq) -> None:
        t = time.perf_counter_ns()
        self.inner.may_append(seq)
        self.run.ns["may_append"] += time.perf_counter_ns() - t

    def hash_blocks(self, seq) -> None:
        t = time.perf_counter_ns()
        self.inner.hash_blocks(seq)
        self.run.ns["hash_blocks"] += time.perf_counter_ns() - t


def next_token(seq) -> int:
    """The stand-in forward pass: a token that is a function of the sequence's content."""
    return (seq.token_ids[-1] * 7919 + seq.num_tokens * 31) % VOCAB


def _in_use(sched) -> int:
    tables = [s.block_table for s in sched.running] + [s.block_table for s in sched.waiting if s.block_table]
    return len(set().union(*tables))


def replay(engine: Engine, allocator: str, requests: list[tuple[list[int], int]], num_blocks: int,
           block_size: int = 256, max_num_seqs: int = 512, max_num_batched_tokens: int = 16_384) -> EngineRun:
    """Run every request (prompt tokens, output length) to completion; all are queued at once.

    The defaults are nano-vllm's own (its ``Config``: block size 256, which it requires to be a
    multiple of 256; 512 sequences and 16,384 tokens a step). The pool must hold the longest
    request (a lone sequence must always be able to decode), else ValueError.
    """
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, got {allocator!r}")
    int_at_least("block_size", block_size, 2)
    int_at_least("num_blocks", num_blocks, 1)
    longest = max((len(p) + out for p, out in requests), default=0)
    if -(-longest // block_size) > num_blocks:
        raise ValueError(f"num_blocks {num_blocks} of {block_size} tokens cannot hold the longest "
                         f"request ({longest} tokens)")
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             eos=-1, kvcache_block_size=block_size, num_kvcache_blocks=num_blocks)
    engine.Sequence.block_size = block_size  # as nano-vllm's engine sets it from its config
    sched = engine.Scheduler(config)
    inner = (engine.BlockManager(num_blocks, block_size) if allocator == "nano-vllm"
             else PagedBlockManager(num_blocks, block_size))
    run = EngineRun()
    sched.block_manager = TimedBlockManager(inner, run)
    for prompt, out in requests:
        sched.add(engine.Sequence(prompt, SimpleNamespace(temperature=1.0, max_tokens=out, ignore_eos=True)))
    while not sched.is_finished():
        seqs, is_prefill = sched.schedule()
        run.steps += 1
        run.blocks_in_use.append(_in_use(sched))
        run.scheduled_tokens.append(sum(s.num_scheduled_tokens for s in seqs))
        sched.postprocess(seqs, [next_token(s) for s in seqs], is_prefill)
    return run
