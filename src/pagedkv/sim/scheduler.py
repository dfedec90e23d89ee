"""A continuous-batching serving scheduler that drives any allocator through a workload.

Why: the waste of an allocator only shows under a scheduler. Reservations cap the batch (a
request waits until its whole reservation fits), paging lets the batch grow until blocks run out
and then preempts. This loop is the one vLLM and Orca run, reduced to what memory sees:

1. requests whose ``arrival`` has passed join the waiting queue (first come, first served);
2. admit from the head of the queue while the allocator accepts and ``max_num_seqs`` allows; the
   head that does not fit blocks everything behind it (no skipping, as FCFS demands);
3. one decode step: one token for every running sequence. When the paged cache raises
   ``OutOfBlocks`` a victim is preempted by recompute (freed and put back at the front of the
   queue) and the step is retried;
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

**When memory runs out.** Admit, step and preempt can go wrong in three ways, each shown by a
test and by the ``livelock`` report section:

(a) *recompute thrashing*: a preempted request is readmitted at once, prefilled again, and
    preempted again at the next step, over and over;
(b) *a request that can never fit* (its sequences outgrow the whole cache): alone in memory it
    still runs out, is preempted, readmitted, and blocks the FCFS queue forever;
(c) *futile victims*: a victim whose blocks are all shared (a fork that has not written yet:
    parallel samples, beams) frees nothing, so the step needs another victim, and another (the
    zero-progress cascade vLLM issue #49674 describes for victims whose free is deferred).

:class:`Guards` holds the switches real engines use against them. A run that stops making
progress is not left to loop: when no request finishes, is dropped, is admitted for the first
time or gets further than it ever got for ``stall_limit`` iterations, the run stops and reports
a livelock (:class:`Livelock`, carrying the partial :class:`SimResult`), with counters:
preemptions (per request too), futile preemptions, recomputed and discarded tokens.

**What this module owns**: the loop and its per-run state (``_Run``: the queues, the
per-request records, the counters), :class:`Server` (one replica's loop advanced from
outside), :func:`simulate` (a ``Server`` run to its end) and :class:`Livelock`. It asks every
allocator the same questions through :class:`~pagedkv.sim.baselines.KVAllocator`, whose
defaults fit an allocator without blocks, host tier or sharing, so it imports no manager and
never asks what kind of allocator it holds. The switches are :mod:`pagedkv.sim.guards`', the
result records :mod:`pagedkv.sim.records`', the terminal bar :mod:`pagedkv.sim.progress`' (the
loop only reports to a callback); their names are re-exported here.

Preemption is recompute (vLLM v1's mode) unless the allocator can swap: :meth:`_Run.preempt` is
the one place a victim leaves the device. An allocator with a host tier
(:class:`~pagedkv.sim.tiered.TieredAllocator`) may take the victim with ``swap_out``; it then
waits at the head of the queue and comes back with ``swap_in`` before any new admission, with
every token it had. Such an allocator also prices each iteration's block transfers
(``take_transfer_seconds(compute_s)``: the time the iteration waits for them beyond its compute;
0.0 for every other allocator, so the loop adds it to every iteration).
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable, Iterable

import numpy as np

from ..checks import int_at_least, optional_int_at_least
from ..types import OutOfBlocks
from .baselines import KVAllocator
from .costmodel import CostModel
from .guards import DEFAULT_WATERMARK, GUARD_NAMES, GUARD_PRESETS, Guards
from .progress import Progress
from .records import RequestLog, SimResult, StepLog, StepRecorder
from .request import Request

__all__ = ["StepLog", "SimResult", "RequestLog", "Guards", "GUARD_NAMES", "GUARD_PRESETS", "Livelock", "simulate",
           "clip_request", "check_fits", "freeable_blocks", "Progress", "Server", "DEFAULT_WATERMARK"]

# What a caller's progress callback receives after every turn and once at the end:
# (requests finished or dropped, a status such as "t=12.3s batch=40", True on the last call).
ProgressCallback = Callable[[int, str, bool], None]


class Livelock(ValueError):
    """The run stopped making progress (or hit ``max_iterations``); ``result`` is the partial
    :class:`SimResult`, whose ``livelock`` says why. A ``ValueError``: the configuration (cache,
    workload, guards) is what cannot be served."""

    def __init__(self, message: str, result: "SimResult") -> None:
        super().__init__(message)
        self.result = result


def clip_request(req: Request, max_len: int) -> Request:
    """The request cut to fit ``max_len`` tokens (the same object when it already fits); the
    workloads module's :func:`~pagedkv.sim.workloads.clamp_request`: the prompt keeps its leading
    segments up to ``max_len - 1`` tokens, the output gets what is left. Example (max_len 2,048):
    prompt 3,000, output 100 -> prompt 2,047, output 1."""
    from .workloads import clamp_request

    return clamp_request(req, max_len)


def check_fits(requests: Iterable[Request], allocator: KVAllocator, max_len: int) -> None:
    """Refuse a run in which one sequence of the longest request cannot fit in the whole cache.

    vLLM refuses at start-up a ``max_model_len`` its KV cache cannot hold, because it cannot know
    its requests. A simulator knows them, so it checks the longest one after clipping to
    ``max_len``: a ``max_len`` beyond the cache is harmless while no request is that long.
    Example: a 105-token request on 8 blocks of 4 (32 slots) needs 27 blocks: ValueError.
    """
    reqs = list(requests)
    if not reqs:
        return
    longest = max(reqs, key=lambda r: r.total_len)
    bs = allocator.block_size
    blocks = allocator.prompt_blocks(longest.total_len)  # readmitted whole after a preemption
    if blocks * bs > allocator.capacity:
        raise ValueError(
            f"request {longest.req_id} needs {longest.total_len:,} tokens ({blocks:,} blocks of {bs}) but "
            f"the whole KV cache of {allocator.name} holds {allocator.capacity:,} slots "
            f"({allocator.capacity // bs:,} blocks): it could never run. Give the cache at least "
            f"{blocks:,} blocks or clip requests to max_len <= {allocator.capacity // bs * bs:,} "
            f"(now {max_len:,}); without the check that a request fits, it runs into a livelock")


def freeable_blocks(allocator: KVAllocator, req_id: str) -> int | None:
    """Blocks that preempting ``req_id`` would return to the free pool
    (:meth:`KVAllocator.freeable_blocks <pagedkv.sim.baselines.KVAllocator.freeable_blocks>`):
    a block is freed when every reference to it is the request's own, so a fork that has not
    written yet frees 0. ``None`` for an allocator that frees a request's whole range (a
    reservation)."""
    return allocator.freeable_blocks(req_id)


class _ReqStat:
    """One request's record: what :class:`RequestLog` is built from."""

    __slots__ = ("arrival", "first", "finish", "preemptions", "recomputed", "admissions", "best")

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.first = self.finish = math.nan
        self.preemptions = self.recomputed = self.admissions = 0
        self.best = 0  # most tokens it ever generated: getting past it is progress


class _Run:
    """The state of one simulation; :class:`Server` (and through it :func:`simulate`) is its only user."""

    def __init__(self, alloc: KVAllocator, cost: CostModel, max_num_seqs: int, guards: Guards,
                 reqs: list[Request], record: bool = True) -> None:
        self.alloc, self.cost, self.max_num_seqs, self.guards = alloc, cost, max_num_seqs, guards
        self.waiting: deque = deque()  # [request, generated]
        self.running: dict[str, list] = {}  # req_id -> [request, generated], admission order
        self.running_seqs = 0
        self.rec = StepRecorder()
        self.record = record  # False: no StepLog rows, and no allocator snapshot per iteration
        self.t = 0.0
        self.finished = self.dropped = self.preemptions = 0
        self.futile = self.skipped = self.recomputed = self.discarded = 0
        # prompt tokens looked up at admissions, and the prefix-cache hits among them: at a
        # request's first admission (blocks other requests left) and at a readmission after a
        # preemption (mostly the request's own blocks, still cached)
        self.looked_up = self.first_hits = self.readmit_hits = 0
        self.output_tokens = self.prompt_tokens = 0
        self.dropped_ids: list[str] = []
        self.stats = {r.req_id: _ReqStat(r.arrival) for r in reqs}
        self.just_preempted = False
        self.just_finished: list[str] = []  # finished this iteration, stamped with its end time
        self.progressed = False
        # the watermark guard counts blocks: 0 (off) for an allocator that does not page
        self.watermark_blocks = int(guards.watermark * alloc.num_blocks)
        self.swapped: set[str] = set()  # swapped out; waiting in the queue to be swapped in

    # ---- admission

    def admit(self) -> tuple[int, Request | None]:
        """Admit FCFS; returns (prompt tokens computed, the head refused for memory or None)."""
        prefill = 0
        alloc = self.alloc
        hold = self.just_preempted and self.running and self.guards.no_admit_after_preempt
        self.just_preempted = False
        if hold:
            return 0, None
        while self.waiting:
            req, gen = self.waiting[0]
            if self.running_seqs + req.num_seqs > self.max_num_seqs and self.running:
                return prefill, None
            if self.running and not self.above_watermark(req, gen):
                return prefill, req
            if req.req_id in self.swapped:
                if not self.swap_in(req, gen):
                    return prefill, req
                continue
            if not alloc.admit(req, gen):
                if not self.running and self.swapped:  # swapped requests hold device blocks
                    self.restart_swapped()
                    continue
                if self.running or not self.guards.fit_check:
                    return prefill, req  # without the fit check it stays at the head for ever
                self.waiting.popleft()  # cannot fit even in empty memory: drop it
                self.drop(req.req_id)
                continue
            self.waiting.popleft()
            self.running[req.req_id] = [req, gen]
            self.running_seqs += alloc.num_seqs(req.req_id)
            computed = req.prompt_len + gen - alloc.last_hit_tokens
            prefill += computed
            self.looked_up += req.prompt_len + gen
            st = self.stats[req.req_id]
            if st.admissions:
                st.recomputed += computed
                self.recomputed += computed
                self.readmit_hits += alloc.last_hit_tokens
            else:
                self.first_hits += alloc.last_hit_tokens
                self.progressed = True
            st.admissions += 1
            if gen >= req.output_len:
                self.finish(req.req_id)
        return prefill, None

    def above_watermark(self, req: Request, generated: int) -> bool:
        """The watermark guard: would ``watermark_blocks`` stay free after this admission?
        Counts every block of the prompt (and recomputed tokens), as vLLM v0 did."""
        if not self.watermark_blocks:
            return True
        alloc = self.alloc
        need = alloc.prompt_blocks(req.prompt_len + generated)
        return alloc.num_free_blocks - need >= self.watermark_blocks

    # ---- leaving: finish, drop, preempt

    def finish(self, rid: str) -> None:
        req, _ = self.running.pop(rid)
        self.running_seqs -= self.alloc.num_seqs(rid)
        self.alloc.release(rid)
        self.finished += 1
        self.output_tokens += req.output_len * req.num_seqs
        self.prompt_tokens += req.prompt_len
        self.just_finished.append(rid)
        self.progressed = True

    def drop(self, rid: str) -> None:
        """Give up on a request that cannot fit even alone (the fit guard); reported by id."""
        if rid in self.running:
            self.running.pop(rid)
            self.running_seqs -= self.alloc.num_seqs(rid)
            self.alloc.release(rid)
        self.dropped += 1
        self.dropped_ids.append(rid)
        self.progressed = True

    def preempt(self, rid: str) -> None:
        """Take ``rid`` off the device to make room: the one place a preemption happens.

        Recompute (vLLM v1's mode): free its blocks and put it back at the head of the queue. A
        single sequence keeps the tokens it generated (its readmission prefills them with the
        prompt); a request with several sequences (samples, beams) restarts from its prompt and
        its generated tokens are discarded. An allocator that swaps (``swap_out`` returns True)
        keeps the request's blocks on its host tier instead: it waits at the head of the queue
        for :meth:`swap_in`, with every token it had.
        """
        req, gen = self.running.pop(rid)
        seqs = self.alloc.num_seqs(rid)
        if self.alloc.freeable_blocks(rid) == 0:
            self.futile += 1
        self.running_seqs -= seqs
        if self.alloc.swap_out(rid):  # swapped: it keeps all it generated
            self.swapped.add(rid)
            kept = gen
        else:
            self.alloc.release(rid)
            kept = gen if req.num_seqs == 1 else 0
        self.discarded += (gen - kept) * seqs
        self.preemptions += 1
        self.stats[rid].preemptions += 1
        self.just_preempted = True
        self.waiting.appendleft([req, kept])

    def swap_in(self, req: Request, gen: int) -> bool:
        """Bring the swapped-out head of the queue back (no prefill: its K/V is loaded). When it
        cannot come back with nothing running, the device is held by swapped requests' shared
        blocks: they are restarted by recompute (:meth:`restart_swapped`) and it is retried."""
        rid = req.req_id
        if not self.alloc.swap_in(rid):
            if self.running:
                return False
            self.restart_swapped(keep=rid)
            if not self.alloc.swap_in(rid):
                self.restart_swapped()
                return True  # it is an ordinary waiting request now: admitted on the next pass
        self.swapped.discard(rid)
        self.waiting.popleft()
        self.running[rid] = [req, gen]
        self.running_seqs += self.alloc.num_seqs(rid)
        return True

    def restart_swapped(self, keep: str | None = None) -> None:
        """Turn every swapped-out request but ``keep`` into one to recompute (released, its
        generated tokens kept as a recompute keeps them)."""
        for entry in self.waiting:
            req, gen = entry
            rid = req.req_id
            if rid in self.swapped and rid != keep:
                self.swapped.discard(rid)
                self.alloc.release(rid)
                kept = gen if req.num_seqs == 1 else 0
                self.discarded += (gen - kept) * req.num_seqs
                entry[1] = kept

    def victim(self, ids: list[str]) -> str | None:
        """Whom to preempt when the step ``ids`` (admission order) does not fit; None when one
        request is left. Newest first (the oldest is never a victim) or, without that guard,
        oldest first; ``skip_unfreeing`` passes over victims that would free no block."""
        if len(ids) < 2:
            return None
        order = ids[:0:-1] if self.guards.newest_first else ids
        if self.guards.skip_unfreeing:
            for n, rid in enumerate(order):
                if self.alloc.freeable_blocks(rid) != 0:  # None: frees its whole range
                    self.skipped += n
                    return rid
        return order[0]

    # ---- one iteration

    def decode(self) -> int:
        """One token for every running sequence, preempting a victim on OutOfBlocks."""
        while self.running:
            ids = list(self.running)
            try:
                return self.alloc.step(ids)
            except OutOfBlocks:
                victim = self.victim(ids)
                if victim is not None:
                    self.preempt(victim)
                elif self.swapped:  # not alone: swapped requests hold shared device blocks
                    self.restart_swapped()
                elif self.guards.fit_check:  # alone and still out of memory: it can never finish
                    self.drop(ids[0])
                    return 0
                else:  # it will be readmitted, run out again, be preempted again...
                    self.preempt(ids[0])
                    return 0
        return 0

    def iterate(self) -> None:
        prefill, blocked = self.admit()
        tokens = self.decode()
        batch = tokens  # one token per decoded sequence
        kv = self.alloc.kv_tokens
        dt = self.cost.step_time(kv if tokens else 0, prefill, decoding=tokens > 0)
        dt += self.alloc.take_transfer_seconds(dt)  # what the step waits for its block transfers
        if self.record:
            bd, logical, saved = self.alloc.observe(blocked)
            self.rec.add(self.t, dt, batch, len(self.running), tokens, prefill, kv, bool(self.waiting),
                         blocked is not None, False, bd.as_tuple(), logical, saved)
        self.t = t = self.t + dt
        if tokens:
            done, stats, progressed = [], self.stats, False
            for rid, st in self.running.items():
                g = st[1] = st[1] + 1
                stat = stats[rid]
                if g > stat.best:  # further than ever: progress (the first token is too)
                    if g == 1:
                        stat.first = t
                    stat.best = g
                    progressed = True
                if g >= st[0].output_len:
                    done.append(rid)
            if progressed:
                self.progressed = True
            for rid in done:
                self.finish(rid)
        self.stamp_finished()

    def stamp_finished(self) -> None:
        """Give the requests that finished in the iteration just run its end time."""
        for rid in self.just_finished:
            self.stats[rid].finish = self.t
        self.just_finished.clear()

    def coast(self, horizon: float) -> int:
        """Run the decode-only iterations that start before ``horizon`` and before memory or a
        request's end forces an ordinary iteration, in one allocator call (see :class:`Server`);
        returns how many ran (0: no such stretch, nothing changed). The clock adds the same
        per-iteration durations in the same order as :meth:`iterate` would. Example: two
        single-sequence requests with 5 and 9 tokens to go and room for 7 steps coast 5 (the
        first finishes at the last of them)."""
        if self.waiting or not self.running:
            return 0
        limit = math.inf
        for req, gen in self.running.values():
            if req.num_seqs != 1:
                return 0
            limit = min(limit, req.output_len - gen)
        ids = list(self.running)
        alloc = self.alloc
        n = alloc.max_steps(ids, limit)
        if n < 1:
            return 0  # memory runs out at once: the ordinary iteration preempts
        cost, t, steps = self.cost, self.t, 0
        kv, batch, first = alloc.kv_tokens, len(ids), math.nan
        while steps < n and t < horizon:  # the same durations, added in the same order
            kv += batch
            t += cost.step_time(kv, 0, decoding=True)
            steps += 1
            if steps == 1:
                first = t
        alloc.step_n(ids, steps)
        self.just_preempted = False  # what admit() does when nothing waits
        done = []
        for rid, st in self.running.items():
            st[1] += steps
            stat = self.stats[rid]
            if stat.first != stat.first:  # NaN: its first token
                stat.first = first
            stat.best = max(stat.best, st[1])  # a single sequence progresses at every step
            if st[1] >= st[0].output_len:
                done.append(rid)
        self.t = t
        for rid in done:
            self.finish(rid)
        self.stamp_finished()
        return steps

    def idle_until(self, t_next: float) -> None:
        if self.record:
            bd, logical, saved = self.alloc.observe(None)
            self.rec.add(self.t, t_next - self.t, 0, 0, 0, 0, 0, False, False, True, bd.as_tuple(), logical,
                         saved)
        self.t = t_next

    # ---- reporting

    def request_log(self, reqs: list[Request]) -> RequestLog:
        sts = [self.stats[r.req_id] for r in reqs]
        col = lambda name, dtype: np.array([getattr(s, name) for s in sts], dtype=dtype)  # noqa: E731
        return RequestLog([r.req_id for r in reqs], col("arrival", np.float64), col("first", np.float64),
                          col("finish", np.float64), col("preemptions", np.int64), col("recomputed", np.int64))

    def stall_report(self, stalled: int, iteration: int, pending: int, total: int) -> str:
        worst = max(((rid, st) for rid, st in self.stats.items() if st is not None),  # None: ordered, not submitted
                    key=lambda kv: kv[1].preemptions)
        head = f"; head of the queue {self.waiting[0][0].req_id}" if self.waiting else ""
        return (f"livelock: no request progressed for {stalled:,} iterations (stopped at iteration "
                f"{iteration:,}, t={self.t:.3f} s); {self.finished:,} of {total:,} finished, "
                f"{len(self.running):,} running, {len(self.waiting):,} waiting, {pending:,} not yet "
                f"arrived{head}; {self.preemptions:,} preemptions ({self.futile:,} futile), most "
                f"of {worst[0]} ({worst[1].preemptions:,}); {self.recomputed:,} tokens recomputed")


class Server:
    """One replica's serving loop, advanced from outside: :func:`simulate` runs one to its end, a
    fleet keeps many on one simulated clock.

    A fleet's router decides at each request's arrival from the replicas' state at that moment,
    so every replica must have run exactly the iterations that started before it. A *turn* is one
    pass of the loop in the module docstring: the requests that have arrived by ``clock`` join
    the queue, then one iteration runs (admit, decode, finish) or, with nothing to do, the clock
    jumps to the next arrival.

    - ``submit(request)``: the request joins this replica (clipped to ``max_len``; with the fit
      guard, refused with ``ValueError`` when it could never fit). It is queued by the first
      turn that starts at or after its ``arrival``. Requests are submitted in arrival order.
    - ``step()``: one turn; False when nothing is left to do.
    - ``advance_to(t)``: every turn that starts before ``t``. An idle replica does not jump
      past ``t``, so a request submitted at ``t`` is admitted by the turn at ``t``, exactly as
      :func:`simulate` would admit it.
    - ``drain()``: turns until every submitted request finished or was dropped.
    - ``clock`` (simulated seconds), ``load`` (requests submitted and neither finished nor
      dropped: what a router balances), ``busy_s`` (seconds spent in iterations),
      ``iterations``, ``result()`` (the :class:`SimResult` so far).

    Worked example: an iteration runs from t = 0.99 to 1.01 and a request arrives at t = 1.0:
    ``advance_to(1.0)`` runs that iteration (it started before 1.0), ``clock`` is then 1.01, and
    the new request is admitted by the iteration that starts at 1.01.

    ``advance_to`` and ``drain`` raise :class:`Livelock` when no request progressed for
    ``stall_limit`` iterations (default: twice the longest output submitted, plus 64).
    ``request_order`` (request ids) orders the requests for the livelock message's tie-break
    between equally preempted requests (default: as submitted; :func:`simulate` passes its
    input order).

    ``record_steps=False`` keeps no :class:`StepLog` (``result().steps`` is empty) and skips the
    allocator's memory snapshot each iteration, which a fleet does not read. ``coalesce=True``
    (it needs ``record_steps=False`` and an allocator that ``coalesces``: its
    ``max_steps(req_ids, limit)`` says how many decode steps memory allows and ``step_n(req_ids,
    n)`` runs them, as :class:`~pagedkv.sim.fleet.ReplicaAllocator` does) runs a stretch of decode-only iterations (no
    request waiting, single-sequence requests, none finishing before its last iteration, none
    arriving, enough free blocks) in one call: the clock adds the same per-iteration durations in
    the same order, so first-token and finish times are the same floats as iteration by
    iteration, and each sequence gets its tokens in one append.
    """

    def __init__(self, allocator: KVAllocator, cost: CostModel | None = None, *, max_len: int = 2048,
                 max_num_seqs: int = 256, guards: Guards | None = None, stall_limit: int | None = None,
                 record_steps: bool = True, coalesce: bool = False, request_order: Iterable[str] = ()) -> None:
        guards = _checked_config(allocator, max_num_seqs, guards, stall_limit)
        if coalesce and (record_steps or not allocator.coalesces):
            raise ValueError("coalesce=True needs record_steps=False and an allocator with max_steps and step_n")
        self.allocator, self.max_len, self.guards = allocator, max_len, guards
        self._run = _Run(allocator, cost or CostModel(), max_num_seqs, guards, [], record=record_steps)
        self._run.stats.update(dict.fromkeys(request_order))  # filled in as they are submitted
        self._pending: deque = deque()  # submitted, not yet arrived by the clock
        self._requests: list[Request] = []  # as submitted (clipped)
        self._submitted: set[str] = set()
        self._stall_limit = stall_limit
        self._longest_output = 0
        self._last_arrival = -math.inf
        self._horizon = math.inf  # advance_to's target: a coalesced stretch stops there
        self._coalesce = coalesce
        self.clipped = self.stalled = self.iterations = 0
        self.busy_s = 0.0

    # ---- state a router reads

    @property
    def clock(self) -> float:
        return self._run.t

    @property
    def load(self) -> int:
        run = self._run
        return len(run.running) + len(run.waiting) + len(self._pending)

    @property
    def stall_limit(self) -> int:
        return self._stall_limit or 2 * self._longest_output + 64

    @property
    def num_pending(self) -> int:
        """Requests submitted whose arrival the clock has not reached yet."""
        return len(self._pending)

    @property
    def num_done(self) -> int:
        """Requests that finished or were dropped."""
        return self._run.finished + self._run.dropped

    def status(self) -> str:
        """The clock and the running sequences, for a progress line: ``t=12.3s batch=40``."""
        return f"t={self._run.t:.1f}s batch={self._run.running_seqs}"

    def stall_report(self, iterations: int | None = None, total: int | None = None) -> str:
        """Why the run is stalled, in one line (the :class:`Livelock` message): ``iterations``
        run (default: this server's count) and ``total`` requests (default: those submitted)."""
        run = self._run
        return run.stall_report(self.stalled, self.iterations if iterations is None else iterations,
                                len(self._pending), len(self._requests) if total is None else total)

    def cap_report(self, limit: int, total: int) -> str:
        """Why a run cut at ``limit`` iterations did not finish its ``total`` requests."""
        run = self._run
        return (f"did not finish within {limit:,} iterations (max_iterations); "
                f"{run.finished:,} of {total:,} finished, {run.preemptions:,} preemptions")

    # ---- driving

    def submit(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise ValueError(f"requests must be Request objects, got {type(request).__name__}")
        if request.req_id in self._submitted:
            raise ValueError(f"request {request.req_id} was already submitted (ids must be unique)")
        if request.arrival < self._last_arrival:
            raise ValueError(f"request {request.req_id} arrives at {request.arrival} s, before the last one "
                             f"submitted ({self._last_arrival} s): submit in arrival order")
        fitted = clip_request(request, self.max_len)
        if self.guards.fit_check:
            check_fits([fitted], self.allocator, self.max_len)
        self.clipped += fitted is not request
        self._submitted.add(fitted.req_id)
        self._run.stats[fitted.req_id] = _ReqStat(fitted.arrival)
        self._requests.append(fitted)
        self._pending.append(fitted)
        self._longest_output = max(self._longest_output, fitted.output_len)
        self._last_arrival = fitted.arrival

    def step(self) -> bool:
        """One turn (see the class docstring); False when nothing is left to do."""
        run, pending = self._run, self._pending
        while pending and pending[0].arrival <= run.t:
            run.waiting.append([pending.popleft(), 0])
        if not run.running and not run.waiting:
            if not pending:
                return False
            run.idle_until(pending[0].arrival)
            return True
        t0 = run.t
        if not (self._coalesce and self._coast()):
            run.progressed = False
            run.iterate()
            self.iterations += 1
            self.stalled = 0 if run.progressed else self.stalled + 1
        self.busy_s += run.t - t0
        return True

    def advance_to(self, t: float) -> None:
        """Run every turn that starts before ``t``."""
        run, pending = self._run, self._pending
        self._horizon = t
        try:
            while run.t < t and (run.running or run.waiting or (pending and pending[0].arrival < t)):
                self.step()
                self._check_stall()
        finally:
            self._horizon = math.inf

    def drain(self) -> None:
        """Run until every submitted request finished or was dropped."""
        while self.step():
            self._check_stall()

    def _check_stall(self) -> None:
        if self.stalled >= self.stall_limit:
            msg = self.stall_report()
            raise Livelock(msg, self.result(livelock=msg))

    def _coast(self) -> bool:
        """Run the decode-only iterations before the next event in one go (see the class
        docstring); False when there is no such stretch (an ordinary iteration runs instead)."""
        pending = self._pending
        horizon = min(self._horizon, pending[0].arrival if pending else math.inf)
        steps = self._run.coast(horizon)
        if not steps:
            return False
        self.iterations += steps
        self.stalled = 0
        return True

    def result(self, livelock: str | None = None, wall_s: float = 0.0,
               requests: list[Request] | None = None) -> SimResult:
        """The run so far; ``requests`` orders its :class:`RequestLog` (default: as submitted)."""
        run, alloc = self._run, self.allocator
        reqs = self._requests if requests is None else requests
        return SimResult(
            allocator=alloc.name, capacity=alloc.capacity, block_size=alloc.block_size,
            steps=run.rec.log(), num_requests=len(reqs), finished=run.finished, dropped=run.dropped,
            clipped=self.clipped, preemptions=run.preemptions, output_tokens=run.output_tokens,
            prompt_tokens=run.prompt_tokens, makespan=run.t, usage=alloc.usage(),
            copies=alloc.copies, wall_s=wall_s, guards=self.guards, livelock=livelock,
            futile_preemptions=run.futile, skipped_victims=run.skipped, recomputed_tokens=run.recomputed,
            discarded_tokens=run.discarded, dropped_ids=tuple(run.dropped_ids),
            requests=run.request_log(reqs), looked_up_tokens=run.looked_up,
            first_hit_tokens=run.first_hits, readmit_hit_tokens=run.readmit_hits,
        )


def _checked_config(allocator: KVAllocator, max_num_seqs: int, guards: Guards | None,
                    stall_limit: int | None) -> Guards:
    """The arguments :func:`simulate` and :class:`Server` share, validated; the guards to use."""
    if not isinstance(allocator, KVAllocator):
        raise ValueError(f"allocator must be a KVAllocator, got {type(allocator).__name__}")
    int_at_least("max_num_seqs", max_num_seqs, 1)
    optional_int_at_least("stall_limit", stall_limit, 1)
    guards = Guards() if guards is None else guards
    if not isinstance(guards, Guards):
        raise ValueError(f"guards must be a Guards, got {type(guards).__name__}")
    return guards


def simulate(requests: Iterable[Request], allocator: KVAllocator, cost: CostModel | None = None, *,
             max_len: int = 2048, max_num_seqs: int = 256, progress: bool | ProgressCallback = False,
             max_iterations: int | None = None, guards: Guards | None = None,
             stall_limit: int | None = None, on_livelock: str = "raise") -> SimResult:
    """Serve ``requests`` with ``allocator`` under continuous batching; see the module docstring.

    ``max_len`` clips every request to the model's context; ``max_num_seqs`` caps the running
    sequences (vLLM's default, 256); ``progress``: True draws a bar on stderr
    (:class:`~pagedkv.sim.progress.Progress`), a callable ``progress(done, status, final)`` is
    told after every turn how many requests finished or were dropped, a status such as
    ``t=12.3s batch=40``, and ``final=True`` once at the end (the loop itself draws nothing);
    ``guards`` are the
    switches of :class:`Guards` (default: vLLM v1's). ``stall_limit`` is how many iterations may
    pass without progress before the run is declared a livelock (default: twice the longest
    output plus 64, more than a restarted request needs to regain its tokens);
    ``max_iterations`` caps the whole run (default: a bound no correct run reaches). On either,
    ``on_livelock="raise"`` raises :class:`Livelock` (carrying the partial result) and
    ``"return"`` returns the result with ``livelock`` set.
    """
    guards = _checked_config(allocator, max_num_seqs, guards, stall_limit)
    if on_livelock not in ("raise", "return"):
        raise ValueError(f"on_livelock must be 'raise' or 'return', got {on_livelock!r}")
    if not isinstance(progress, bool) and not callable(progress):
        raise ValueError(f"progress must be True, False or a callable, got {progress!r}")
    reqs = list(requests)
    if any(not isinstance(r, Request) for r in reqs):
        raise ValueError("requests must be Request objects")
    if len({r.req_id for r in reqs}) != len(reqs):
        raise ValueError("request ids must be unique")
    fitted = [clip_request(r, max_len) for r in reqs]
    if guards.fit_check:
        check_fits(fitted, allocator, max_len)
    server = Server(allocator, cost, max_len=max_len, max_num_seqs=max_num_seqs, guards=guards,
                    stall_limit=stall_limit, request_order=[r.req_id for r in fitted])  # livelock tie-break
    for r in sorted(reqs, key=lambda r: r.arrival):
        server.submit(r)
    report = Progress(len(reqs), allocator.name).report if progress is True else progress or None
    limit = max_iterations or 4 * sum(r.total_len * r.num_seqs for r in fitted) + 2 * len(fitted) + 10
    livelock = None
    wall = time.perf_counter()
    for it in range(limit):
        if not server.step():
            break
        if server.stalled >= server.stall_limit:
            livelock = server.stall_report(it + 1, len(reqs))
            break
        if report is not None:
            report(server.num_done, server.status(), False)
    else:
        livelock = server.cap_report(limit, len(reqs))
    if report is not None:
        report(server.num_done, f"t={server.clock:.1f}s", True)
    result = server.result(livelock, time.perf_counter() - wall, fitted)
    if livelock is not None and on_livelock == "raise":
        raise Livelock(livelock, result)
    return result
