"""What a simulated run produced: the records :func:`~pagedkv.sim.scheduler.simulate` returns.

Owns the result records and nothing that produces them: :class:`StepLog` (every iteration, as
arrays), :class:`RequestLog` (every request's timings and costs, as arrays),
:class:`SimResult` (both plus the run's totals) and :class:`StepRecorder` (the rows a run
appends, turned into a :class:`StepLog` at the end). The serving loop
(:mod:`pagedkv.sim.scheduler`) fills them; :mod:`pagedkv.sim.metrics`, the report and the
commands read them. Imports the allocators' slot categories and the guards, nothing above.

Worked example: a run of 4 iterations on a 32-slot cache has ``len(result.steps) == 4`` and
every row of ``result.steps.slots`` sums to 32.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..types import Usage
from .baselines import CATEGORIES
from .guards import Guards

__all__ = ["StepLog", "RequestLog", "SimResult", "StepRecorder"]


class StepRecorder:
    """Appends one row per iteration; turned into one :class:`StepLog` of numpy arrays once, at
    the end (a run of 40,000 iterations appends 40,000 tuples, not 40,000 array writes)."""

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
    ``looked_up_tokens`` are the tokens admissions asked the prefix cache for (a prompt, plus
    what a preempted request had generated); of them ``first_hit_tokens`` hit at a request's
    first admission (blocks other requests left) and ``readmit_hit_tokens`` at a readmission
    after a preemption (mostly the request's own blocks). A preempted ShareGPT run with no shared
    prompts: ``first_hit_tokens`` 0, ``readmit_hit_tokens`` about 12% of ``looked_up_tokens``.
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
    looked_up_tokens: int = 0
    first_hit_tokens: int = 0
    readmit_hit_tokens: int = 0

    @property
    def completed(self) -> bool:
        """Every request finished or was dropped (no livelock, no iteration cap)."""
        return self.livelock is None

    @property
    def iterations(self) -> int:
        """Iterations that did work (idle gaps excluded)."""
        return int((~self.steps.idle).sum())
