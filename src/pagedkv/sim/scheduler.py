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

Preemption is recompute (vLLM v1's mode) unless the allocator can swap: :meth:`_Run.preempt` is
the one place a victim leaves the device. An allocator with a host tier
(:class:`~pagedkv.sim.tiered.TieredAllocator`) may take the victim with ``swap_out``; it then
waits at the head of the queue and comes back with ``swap_in`` before any new admission, with
every token it had. Such an allocator also prices each iteration's block transfers
(``take_transfer_seconds(compute_s)``: the time the iteration waits for them beyond its compute).
"""
from __future__ import annotations

import math
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field, fields, replace
from typing import Iterable, TextIO

import numpy as np

from ..manager import KVCacheManager
from ..types import OutOfBlocks, Usage
from .baselines import CATEGORIES, KVAllocator
from .costmodel import CostModel
from .request import Request

__all__ = ["StepLog", "SimResult", "RequestLog", "Guards", "GUARD_NAMES", "GUARD_PRESETS", "Livelock", "simulate",
           "clip_request", "check_fits", "freeable_blocks", "Progress", "Server"]

GUARD_NAMES = ("newest_first", "no_admit_after_preempt", "fit_check", "skip_unfreeing", "watermark")
DEFAULT_WATERMARK = 0.05  # what Guards.all_on() keeps free: the top of vLLM PR #44594's 0.02-0.05


@dataclass(frozen=True)
class Guards:
    """The switches against the ways a scheduler goes wrong when memory runs out.

    Defaults follow vLLM v1, so ``simulate()`` without ``guards`` behaves as before:

    ``newest_first`` (on; vLLM v0 and v1 preempt the most recently admitted request): the oldest
        running request is never a victim, so it always progresses. Off: the oldest is preempted
        first, the request with the most work to lose.
    ``no_admit_after_preempt`` (on; vLLM v1 schedules no waiting request in a step that
        preempted): the iteration after a preemption admits nothing, or the victim would be
        readmitted at once and preempted again (thrashing).
    ``fit_check`` (on; vLLM refuses at start-up a ``max_model_len`` its KV cache cannot hold):
        :func:`check_fits` raises ``ValueError`` before the run when the longest request (after
        clipping to ``max_len``) cannot fit in the whole cache; at run time a request that does
        not fit even alone in memory (several samples or beams outgrowing the cache) is dropped
        and reported in ``SimResult.dropped_ids``. Off: it is preempted and retried forever.
    ``skip_unfreeing`` (off; vLLM skips victims whose free is deferred, PR #49675, but not
        victims whose blocks are shared): pass over victims that would free no block (counted
        by :func:`freeable_blocks`) for the next one that frees some; when none does, the first
        in order goes.
    ``watermark`` (0, off; vLLM v1's default; vLLM v0 kept 0.01): admit a request only when
        ``watermark x num_blocks`` blocks stay free after its prompt, unless nothing runs. vLLM
        PR #44594 measured preemptions falling from 1,065 (off) to 400 (0.02) and 187 (0.05) on
        a saturated long-output benchmark (their measurement, not ours). The paged allocator has
        its own ``watermark`` argument (1% by default), applied inside ``admit``; this one is the
        scheduler's, for any allocator backed by a :class:`~pagedkv.KVCacheManager`.
    """

    newest_first: bool = True
    no_admit_after_preempt: bool = True
    fit_check: bool = True
    skip_unfreeing: bool = False
    watermark: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "watermark":
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1
                if not ok:
                    raise ValueError(f"watermark must be a fraction in [0, 1), got {v!r}")
            elif not isinstance(v, bool):
                raise ValueError(f"guard {f.name} must be True or False, got {v!r}")

    @classmethod
    def all_on(cls, watermark: float = DEFAULT_WATERMARK) -> "Guards":
        """Every guard on, the watermark at ``watermark`` (5% unless given)."""
        return cls(True, True, True, True, watermark)

    @classmethod
    def all_off(cls) -> "Guards":
        return cls(False, False, False, False, 0.0)

    def switched(self, name: str, on: bool, watermark: float = DEFAULT_WATERMARK) -> "Guards":
        """These guards with ``name`` turned on or off (on: ``watermark`` for the watermark)."""
        if name not in GUARD_NAMES:
            raise ValueError(f"unknown guard {name!r}; choose from {', '.join(GUARD_NAMES)}")
        value = (watermark if on else 0.0) if name == "watermark" else on
        return replace(self, **{name: value})

    def is_on(self, name: str) -> bool:
        return bool(getattr(self, name))

    def describe(self) -> str:
        """The guards that are on, e.g. ``newest_first, fit_check, watermark 0.05`` or ``none``."""
        on = [n if n != "watermark" else f"watermark {self.watermark:g}" for n in GUARD_NAMES if self.is_on(n)]
        return ", ".join(on) or "none"


GUARD_PRESETS = {"vllm": Guards(), "all": Guards.all_on(), "none": Guards.all_off()}  # for the CLI


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
    bs = getattr(allocator, "block_size", 1)
    blocks = -(-longest.total_len // bs)
    if blocks * bs > allocator.capacity:
        raise ValueError(
            f"request {longest.req_id} needs {longest.total_len:,} tokens ({blocks:,} blocks of {bs}) but "
            f"the whole KV cache of {allocator.name} holds {allocator.capacity:,} slots "
            f"({allocator.capacity // bs:,} blocks): it could never run. Give the cache at least "
            f"{blocks:,} blocks or clip requests to max_len <= {allocator.capacity // bs * bs:,} "
            f"(now {max_len:,}); without the fit check (fit_check=False) it runs into a livelock")


def freeable_blocks(allocator: KVAllocator, req_id: str) -> int | None:
    """Blocks that preempting ``req_id`` would return to the free pool, read from the manager.

    A block is freed when every reference to it is the request's own: its refcount equals the
    number of the request's block tables that hold it (1 for a single sequence). A fork that has
    not written yet shares all its blocks with its parent: 0. ``None`` when the allocator has no
    :class:`~pagedkv.KVCacheManager` (``m``) or cannot name a request's sequences (``seq_ids``):
    a reservation always frees its whole range.
    """
    m = getattr(allocator, "m", None)
    seq_ids = getattr(allocator, "seq_ids", None)
    if not isinstance(m, KVCacheManager) or seq_ids is None:
        return None
    held: Counter = Counter()
    for sid in seq_ids(req_id):
        held.update(m.block_table(sid))
    return sum(1 for block, refs in held.items() if m.refcount(block) == refs)


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
        k = 8 + len(CATEGORIES)
        a = np.array(self.ints, dtype=np.int64).reshape(-1, k + 2)
        return StepLog(t=f[:, 0], dt=f[:, 1], batch=a[:, 0], running=a[:, 1], tokens=a[:, 2],
                       prefill=a[:, 3], kv_read=a[:, 4], waiting=a[:, 5] > 0, blocked=a[:, 6] > 0,
                       idle=a[:, 7] > 0, slots=a[:, 8:k].copy(), logical_blocks=a[:, k],
                       saved_blocks=a[:, k + 1])


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
    slots: np.ndarray  # [steps, len(CATEGORIES)] int64, rows sum to the capacity
    logical_blocks: np.ndarray
    saved_blocks: np.ndarray

    def __len__(self) -> int:
        return len(self.dt)

    def category(self, name: str) -> np.ndarray:
        return self.slots[:, CATEGORIES.index(name)]


@dataclass
class RequestLog:
    """Per-request timings and costs of a run, arrays in request order (``ids``).

    Times are seconds of simulated time, NaN when the event never happened: ``first_token`` is
    the end of the iteration that produced the request's first token (a restarted request keeps
    its first), ``finish`` the end of the iteration it finished in (NaN: dropped or the run
    stopped). ``recomputed`` counts the prompt and generated tokens its readmissions prefilled
    again (cache hits excluded).
    """

    ids: list[str]
    arrival: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    preemptions: np.ndarray
    recomputed: np.ndarray

    def latency(self) -> np.ndarray:
        """Arrival to finish of every finished request (seconds)."""
        done = ~np.isnan(self.finish)
        return self.finish[done] - self.arrival[done]

    def ttft(self) -> np.ndarray:
        """Arrival to first token of every request that produced one (seconds)."""
        seen = ~np.isnan(self.first_token)
        return self.first_token[seen] - self.arrival[seen]


@dataclass
class SimResult:
    """What one run produced: the step log plus run totals (see :mod:`pagedkv.sim.metrics`).

    ``livelock`` is None when the run completed (every request finished or was dropped), else
    why it stopped. ``futile_preemptions`` counts victims that freed no block,
    ``skipped_victims`` the victims the ``skip_unfreeing`` guard passed over,
    ``recomputed_tokens`` the tokens readmissions prefilled again and ``discarded_tokens`` the
    generated tokens thrown away by restarting a request with several sequences.
    """

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
    guards: Guards = field(default_factory=Guards)
    livelock: str | None = None
    futile_preemptions: int = 0
    skipped_victims: int = 0
    recomputed_tokens: int = 0
    discarded_tokens: int = 0
    dropped_ids: tuple[str, ...] = ()
    requests: RequestLog | None = None

    @property
    def completed(self) -> bool:
        """Every request finished or was dropped (no livelock, no iteration cap)."""
        return self.livelock is None

    @property
    def iterations(self) -> int:
        """Iterations that did work (idle gaps excluded)."""
        return int((~self.steps.idle).sum())


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
        self.rec = _Recorder()
        self.record = record  # False: no StepLog rows, and no allocator snapshot per iteration
        self.t = 0.0
        self.finished = self.dropped = self.preemptions = 0
        self.futile = self.skipped = self.recomputed = self.discarded = 0
        self.output_tokens = self.prompt_tokens = 0
        self.dropped_ids: list[str] = []
        self.stats = {r.req_id: _ReqStat(r.arrival) for r in reqs}
        self.just_preempted = False
        self.just_finished: list[str] = []  # finished this iteration, stamped with its end time
        self.progressed = False
        m = getattr(alloc, "m", None)
        self.manager = m if isinstance(m, KVCacheManager) else None
        self.watermark_blocks = int(guards.watermark * m.num_blocks) if self.manager else 0
        self.swapped: set[str] = set()  # swapped out; waiting in the queue to be swapped in
        self.transfer_s = getattr(alloc, "take_transfer_seconds", None)  # a host tier's link time

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
            st = self.stats[req.req_id]
            if st.admissions:
                st.recomputed += computed
                self.recomputed += computed
            else:
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
        m = self.manager
        need = -(-(req.prompt_len + generated) // m.block_size)
        return m.num_free_blocks - need >= self.watermark_blocks

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
        if freeable_blocks(self.alloc, rid) == 0:
            self.futile += 1
        self.running_seqs -= seqs
        swap_out = getattr(self.alloc, "swap_out", None)
        if swap_out is not None and swap_out(rid):  # swapped: it keeps all it generated
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
                if freeable_blocks(self.alloc, rid) != 0:  # None: frees its whole range
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
        if self.transfer_s is not None:  # what the step waits for its block transfers
            dt += self.transfer_s(dt)
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
        for rid in self.just_finished:
            self.stats[rid].finish = self.t
        self.just_finished.clear()

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
        worst = max(self.stats.items(), key=lambda kv: kv[1].preemptions)
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

    ``record_steps=False`` keeps no :class:`StepLog` (``result().steps`` is empty) and skips the
    allocator's memory snapshot each iteration, which a fleet does not read. ``coalesce=True``
    (it needs ``record_steps=False`` and an allocator with ``max_steps(req_ids, limit)``, the
    decode steps memory allows, and ``step_n(req_ids, n)``, such as
    :class:`~pagedkv.sim.fleet.ReplicaAllocator`) runs a stretch of decode-only iterations (no
    request waiting, single-sequence requests, none finishing before its last iteration, none
    arriving, enough free blocks) in one call: the clock adds the same per-iteration durations in
    the same order, so first-token and finish times are the same floats as iteration by
    iteration, and each sequence gets its tokens in one append.
    """

    def __init__(self, allocator: KVAllocator, cost: CostModel | None = None, *, max_len: int = 2048,
                 max_num_seqs: int = 256, guards: Guards | None = None, stall_limit: int | None = None,
                 record_steps: bool = True, coalesce: bool = False) -> None:
        guards = _checked_config(allocator, max_num_seqs, guards, stall_limit)
        if coalesce and (record_steps or not all(hasattr(allocator, f) for f in ("max_steps", "step_n"))):
            raise ValueError("coalesce=True needs record_steps=False and an allocator with max_steps and step_n")
        self.allocator, self.max_len, self.guards = allocator, max_len, guards
        self._run = _Run(allocator, cost or CostModel(), max_num_seqs, guards, [], record=record_steps)
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
            run = self._run
            msg = run.stall_report(self.stalled, self.iterations, len(self._pending), len(self._requests))
            raise Livelock(msg, self.result(livelock=msg))

    def _coast(self) -> bool:
        """Run the decode-only iterations before the next event in one go (see the class
        docstring); False when there is no such stretch (an ordinary iteration runs instead)."""
        run = self._run
        if run.waiting or not run.running:
            return False
        limit = math.inf
        for req, gen in run.running.values():
            if req.num_seqs != 1:
                return False
            limit = min(limit, req.output_len - gen)
        ids = list(run.running)
        n = self.allocator.max_steps(ids, limit)
        if n < 1:
            return False  # memory runs out at once: the ordinary iteration preempts
        horizon = min(self._horizon, self._pending[0].arrival if self._pending else math.inf)
        alloc, cost, t, steps = self.allocator, run.cost, run.t, 0
        kv, batch, first = alloc.kv_tokens, len(ids), math.nan
        while steps < n and t < horizon:  # the same durations, added in the same order
            kv += batch
            t += cost.step_time(kv, 0, decoding=True)
            steps += 1
            if steps == 1:
                first = t
        alloc.step_n(ids, steps)
        run.just_preempted = False  # what admit() does when nothing waits
        done = []
        for rid, st in run.running.items():
            st[1] += steps
            stat = run.stats[rid]
            if stat.first != stat.first:  # NaN: its first token
                stat.first = first
            stat.best = max(stat.best, st[1])  # a single sequence progresses at every step
            if st[1] >= st[0].output_len:
                done.append(rid)
        run.t = t
        for rid in done:
            run.finish(rid)
        for rid in run.just_finished:
            run.stats[rid].finish = t
        run.just_finished.clear()
        self.iterations += steps
        self.stalled = 0
        return True

    def result(self, livelock: str | None = None, wall_s: float = 0.0,
               requests: list[Request] | None = None) -> SimResult:
        """The run so far; ``requests`` orders its :class:`RequestLog` (default: as submitted)."""
        run, alloc = self._run, self.allocator
        reqs = self._requests if requests is None else requests
        return SimResult(
            allocator=alloc.name, capacity=alloc.capacity, block_size=getattr(alloc, "block_size", 1),
            steps=run.rec.log(), num_requests=len(reqs), finished=run.finished, dropped=run.dropped,
            clipped=self.clipped, preemptions=run.preemptions, output_tokens=run.output_tokens,
            prompt_tokens=run.prompt_tokens, makespan=run.t, usage=alloc.usage(),
            copies=getattr(alloc, "copies", 0), wall_s=wall_s, guards=self.guards, livelock=livelock,
            futile_preemptions=run.futile, skipped_victims=run.skipped, recomputed_tokens=run.recomputed,
            discarded_tokens=run.discarded, dropped_ids=tuple(run.dropped_ids),
            requests=run.request_log(reqs),
        )


def _checked_config(allocator: KVAllocator, max_num_seqs: int, guards: Guards | None,
                    stall_limit: int | None) -> Guards:
    """The arguments :func:`simulate` and :class:`Server` share, validated; the guards to use."""
    if not isinstance(allocator, KVAllocator):
        raise ValueError(f"allocator must be a KVAllocator, got {type(allocator).__name__}")
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be a positive int, got {max_num_seqs!r}")
    guards = Guards() if guards is None else guards
    if not isinstance(guards, Guards):
        raise ValueError(f"guards must be a Guards, got {type(guards).__name__}")
    if stall_limit is not None and (not isinstance(stall_limit, int) or stall_limit < 1):
        raise ValueError(f"stall_limit must be a positive int, got {stall_limit!r}")
    return guards


def simulate(requests: Iterable[Request], allocator: KVAllocator, cost: CostModel | None = None, *,
             max_len: int = 2048, max_num_seqs: int = 256, progress: bool = False,
             max_iterations: int | None = None, guards: Guards | None = None,
             stall_limit: int | None = None, on_livelock: str = "raise") -> SimResult:
    """Serve ``requests`` with ``allocator`` under continuous batching; see the module docstring.

    ``max_len`` clips every request to the model's context; ``max_num_seqs`` caps the running
    sequences (vLLM's default, 256); ``progress`` draws a bar on stderr; ``guards`` are the
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
    reqs = list(requests)
    if any(not isinstance(r, Request) for r in reqs):
        raise ValueError("requests must be Request objects")
    if len({r.req_id for r in reqs}) != len(reqs):
        raise ValueError("request ids must be unique")
    fitted = [clip_request(r, max_len) for r in reqs]
    if guards.fit_check:
        check_fits(fitted, allocator, max_len)
    server = Server(allocator, cost, max_len=max_len, max_num_seqs=max_num_seqs, guards=guards,
                    stall_limit=stall_limit)
    run = server._run
    run.stats.update(dict.fromkeys(r.req_id for r in fitted))  # input order: stall_report's tie-break
    for r in sorted(reqs, key=lambda r: r.arrival):
        server.submit(r)
    bar = Progress(len(reqs), allocator.name, enabled=progress)
    limit = max_iterations or 4 * sum(r.total_len * r.num_seqs for r in fitted) + 2 * len(fitted) + 10
    livelock = None
    wall = time.perf_counter()
    for it in range(limit):
        if not server.step():
            break
        if server.stalled >= server.stall_limit:
            livelock = run.stall_report(server.stalled, it + 1, len(server._pending), len(reqs))
            break
        bar.update(run.finished + run.dropped, f"t={run.t:.1f}s batch={run.running_seqs}")
    else:
        livelock = (f"did not finish within {limit:,} iterations (max_iterations); "
                    f"{run.finished:,} of {len(reqs):,} finished, {run.preemptions:,} preemptions")
    bar.close(run.finished + run.dropped, f"t={run.t:.1f}s")
    result = server.result(livelock, time.perf_counter() - wall, fitted)
    if livelock is not None and on_livelock == "raise":
        raise Livelock(livelock, result)
    return result
