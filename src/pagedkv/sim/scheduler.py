"""A continuous-batching serving scheduler that drives any allocator through a workload.

Why: the waste of an allocator only shows under a scheduler. Reservations cap the batch (a
request waits until its whole reservation fits), paging lets the batch grow until blocks run out
and then preempts. This loop is the one vLLM and Orca run, reduced to what memory sees:

1. requests whose ``arrival`` has passed join the waiting queue (first come, first served);
2. admit from the head of the queue while the allocator accepts and ``max_num_seqs`` allows; the
   head that does not fit blocks everything behind it (no skipping, as FCFS demands);
3. one decode step: one token for every running sequence. When the paged cache raises
   ``OutOfBlocks`` the most recently admitted request is preempted by recompute (freed and put
   back at the front of the queue) and the step is retried; after an iteration that preempted,
   the next one admits nothing (vLLM v1's rule), or the freed request would be readmitted at
   once and preempted again;
4. requests that produced all their output tokens finish and free their memory.

Each iteration's duration comes from :class:`~pagedkv.sim.costmodel.CostModel`, and every
iteration is recorded (:class:`StepLog`): its duration, batch, tokens, and the allocator's
slot breakdown, so that :mod:`pagedkv.sim.metrics` can weight every state by how long it lasted.
Idle gaps (nothing running, next request not yet arrived) are recorded too, as idle steps.

Worked example: three requests arriving at t=0 with 1-token prompts and 2 output tokens, on a
Max allocator with room for two: iteration 1 admits two and decodes both; iteration 2 decodes
both again and they finish; iterations 3 and 4 admit and decode the third: 4 iterations, 6 tokens.

Sequences never exceed ``max_len`` (the model's context): longer requests are clipped before the
run (prompt truncated to ``max_len - 1``, then output to what is left) and counted in
``SimResult.clipped``, so every allocator sees exactly the same workload.
"""
from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, TextIO

import numpy as np

from ..types import OutOfBlocks, Usage
from .baselines import CATEGORIES, KVAllocator
from .costmodel import CostModel
from .request import Request

__all__ = ["StepLog", "SimResult", "simulate", "clip_request", "Progress"]


def clip_request(req: Request, max_len: int) -> Request:
    """The request cut to fit ``max_len`` tokens (the same object when it already fits); the
    workloads module's :func:`~pagedkv.sim.workloads.clamp_request`: the prompt keeps its leading
    segments up to ``max_len - 1`` tokens, the output gets what is left. Example (max_len 2,048):
    prompt 3,000, output 100 -> prompt 2,047, output 1."""
    from .workloads import clamp_request

    return clamp_request(req, max_len)


class Progress:
    """A plain-text progress bar on stderr, redrawn at most every ``interval`` seconds."""

    def __init__(self, total: int, label: str = "", enabled: bool = True, stream: TextIO | None = None,
                 interval: float = 0.2, width: int = 30) -> None:
        self.total = max(total, 1)
        self.label = label
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.width = width
        self._last = 0.0

    def update(self, done: int, extra: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        frac = min(done / self.total, 1.0)
        fill = int(frac * self.width)
        bar = "#" * fill + "." * (self.width - fill)
        self.stream.write(f"\r{self.label} [{bar}] {frac:4.0%} {done}/{self.total} {extra}  ")
        self.stream.flush()

    def close(self, done: int, extra: str = "") -> None:
        if self.enabled:
            self.update(done, extra, force=True)
            self.stream.write("\n")
            self.stream.flush()


class _Recorder:
    """Appends one row per iteration; turned into numpy arrays once at the end."""

    def __init__(self) -> None:
        self.times: list[tuple[float, float]] = []
        self.ints: list[tuple] = []

    def add(self, t, dt, seqs, reqs, tokens, prefill, kv, waiting, blocked, idle, cats, logical, saved):
        self.times.append((t, dt))
        self.ints.append((seqs, reqs, tokens, prefill, kv, waiting, blocked, idle, *cats, logical, saved))

    def log(self) -> "StepLog":
        f = np.array(self.times, dtype=np.float64).reshape(-1, 2)
        a = np.array(self.ints, dtype=np.int64).reshape(-1, 15)
        return StepLog(t=f[:, 0], dt=f[:, 1], batch=a[:, 0], running=a[:, 1], tokens=a[:, 2],
                       prefill=a[:, 3], kv_read=a[:, 4], waiting=a[:, 5] > 0, blocked=a[:, 6] > 0,
                       idle=a[:, 7] > 0, slots=a[:, 8:13].copy(), logical_blocks=a[:, 13],
                       saved_blocks=a[:, 14])


@dataclass
class StepLog:
    """Every iteration of a run, as arrays of equal length (one entry per iteration).

    ``slots[:, j]`` is category ``CATEGORIES[j]`` in token slots during the iteration; ``waiting``
    says an arrived request was left in the queue after admission (the server is saturated);
    ``blocked`` that the head of the queue was refused for lack of memory.
    """

    t: np.ndarray
    dt: np.ndarray
    batch: np.ndarray  # running sequences decoded
    running: np.ndarray  # running requests
    tokens: np.ndarray  # tokens appended by the decode step
    prefill: np.ndarray  # prompt tokens computed at admission (cache hits excluded)
    kv_read: np.ndarray  # token states attention read
    waiting: np.ndarray
    blocked: np.ndarray
    idle: np.ndarray
    slots: np.ndarray  # [steps, 5] int64, rows sum to the capacity
    logical_blocks: np.ndarray
    saved_blocks: np.ndarray

    def __len__(self) -> int:
        return len(self.dt)

    def category(self, name: str) -> np.ndarray:
        return self.slots[:, CATEGORIES.index(name)]


@dataclass
class SimResult:
    """What one run produced: the step log plus run totals (see :mod:`pagedkv.sim.metrics`)."""

    allocator: str
    capacity: int
    block_size: int
    steps: StepLog
    num_requests: int
    finished: int
    dropped: int
    clipped: int
    preemptions: int
    output_tokens: int  # tokens of finished requests (every sample / beam counted)
    prompt_tokens: int  # prompt tokens of finished requests
    makespan: float
    usage: Usage | None = None  # the paged cache's final usage (prefix hits, CoW, forks)
    copies: int = 0
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)


class _Run:
    """The state of one simulation; :func:`simulate` is its only user."""

    def __init__(self, alloc: KVAllocator, cost: CostModel, max_num_seqs: int) -> None:
        self.alloc, self.cost, self.max_num_seqs = alloc, cost, max_num_seqs
        self.waiting: deque = deque()  # [request, generated]
        self.running: dict[str, list] = {}  # req_id -> [request, generated], admission order
        self.running_seqs = 0
        self.rec = _Recorder()
        self.t = 0.0
        self.finished = self.dropped = self.preemptions = 0
        self.output_tokens = self.prompt_tokens = 0
        self.just_preempted = False

    def admit(self) -> tuple[int, Request | None]:
        """Admit FCFS; returns (prompt tokens computed, the head refused for memory or None)."""
        prefill = 0
        alloc = self.alloc
        if self.just_preempted and self.running:
            self.just_preempted = False
            return 0, None
        while self.waiting:
            req, gen = self.waiting[0]
            if self.running_seqs + req.num_seqs > self.max_num_seqs and self.running:
                return prefill, None
            if not alloc.admit(req, gen):
                if self.running:
                    return prefill, req
                self.waiting.popleft()  # cannot fit even in empty memory: drop it
                self.dropped += 1
                continue
            self.waiting.popleft()
            self.running[req.req_id] = [req, gen]
            self.running_seqs += alloc.num_seqs(req.req_id)
            prefill += req.prompt_len + gen - alloc.last_hit_tokens
            if gen >= req.output_len:
                self.finish(req.req_id)
        return prefill, None

    def finish(self, rid: str) -> None:
        req, _ = self.running.pop(rid)
        self.running_seqs -= self.alloc.num_seqs(rid)
        self.alloc.release(rid)
        self.finished += 1
        self.output_tokens += req.output_len * req.num_seqs
        self.prompt_tokens += req.prompt_len

    def preempt(self, rid: str) -> None:
        req, gen = self.running.pop(rid)
        self.running_seqs -= self.alloc.num_seqs(rid)
        self.alloc.release(rid)
        self.preemptions += 1
        self.just_preempted = True
        self.waiting.appendleft([req, gen if req.num_seqs == 1 else 0])

    def decode(self) -> int:
        """One token for every running sequence, preempting the newest request on OutOfBlocks."""
        while self.running:
            ids = list(self.running)
            try:
                return self.alloc.step(ids)
            except OutOfBlocks:
                if len(ids) == 1:  # alone and still out of memory: it can never finish
                    req, _ = self.running.pop(ids[0])
                    self.running_seqs -= self.alloc.num_seqs(ids[0])
                    self.alloc.release(ids[0])
                    self.dropped += 1
                    return 0
                self.preempt(ids[-1])
        return 0

    def iterate(self) -> None:
        prefill, blocked = self.admit()
        tokens = self.decode()
        batch = tokens  # one token per decoded sequence
        bd, logical, saved = self.alloc.observe(blocked)
        kv = self.alloc.kv_tokens
        dt = self.cost.step_time(kv if tokens else 0, prefill, decoding=tokens > 0)
        self.rec.add(self.t, dt, batch, len(self.running), tokens, prefill, kv, bool(self.waiting),
                     blocked is not None, False, bd.as_tuple(), logical, saved)
        self.t += dt
        if tokens:
            done = []
            for rid, st in self.running.items():
                st[1] += 1
                if st[1] >= st[0].output_len:
                    done.append(rid)
            for rid in done:
                self.finish(rid)

    def idle_until(self, t_next: float) -> None:
        bd, logical, saved = self.alloc.observe(None)
        self.rec.add(self.t, t_next - self.t, 0, 0, 0, 0, 0, False, False, True, bd.as_tuple(), logical, saved)
        self.t = t_next


def simulate(requests: Iterable[Request], allocator: KVAllocator, cost: CostModel | None = None, *,
             max_len: int = 2048, max_num_seqs: int = 256, progress: bool = False,
             max_iterations: int | None = None) -> SimResult:
    """Serve ``requests`` with ``allocator`` under continuous batching; see the module docstring.

    ``max_len`` clips every request to the model's context; ``max_num_seqs`` caps the running
    sequences (vLLM's default, 256); ``progress`` draws a bar on stderr; ``max_iterations`` stops
    a runaway run (ValueError) and defaults to a bound no correct run reaches.
    """
    if not isinstance(allocator, KVAllocator):
        raise ValueError(f"allocator must be a KVAllocator, got {type(allocator).__name__}")
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be a positive int, got {max_num_seqs!r}")
    reqs = list(requests)
    if any(not isinstance(r, Request) for r in reqs):
        raise ValueError("requests must be Request objects")
    if len({r.req_id for r in reqs}) != len(reqs):
        raise ValueError("request ids must be unique")
    fitted = [clip_request(r, max_len) for r in reqs]
    clipped = sum(f is not r for f, r in zip(fitted, reqs))
    pending = deque(sorted(fitted, key=lambda r: r.arrival))
    run = _Run(allocator, cost or CostModel(), max_num_seqs)
    bar = Progress(len(reqs), allocator.name, enabled=progress)
    limit = max_iterations or 4 * sum(r.total_len * r.num_seqs for r in fitted) + 2 * len(fitted) + 10
    wall = time.perf_counter()
    for _ in range(limit):
        while pending and pending[0].arrival <= run.t:
            run.waiting.append([pending.popleft(), 0])
        if not run.running and not run.waiting:
            if not pending:
                break
            run.idle_until(pending[0].arrival)
            continue
        run.iterate()
        bar.update(run.finished + run.dropped, f"t={run.t:.1f}s batch={run.running_seqs}")
    else:
        raise ValueError(f"simulation did not finish within {limit} iterations")
    bar.close(run.finished + run.dropped, f"t={run.t:.1f}s")
    return SimResult(
        allocator=allocator.name, capacity=allocator.capacity,
        block_size=getattr(allocator, "block_size", 1), steps=run.rec.log(), num_requests=len(reqs),
        finished=run.finished, dropped=run.dropped, clipped=clipped, preemptions=run.preemptions,
        output_tokens=run.output_tokens, prompt_tokens=run.prompt_tokens, makespan=run.t,
        usage=allocator.usage(), copies=getattr(allocator, "copies", 0),
        wall_s=time.perf_counter() - wall,
    )
