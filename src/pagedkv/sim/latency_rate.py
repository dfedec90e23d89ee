"""Normalized latency against request rate: the vLLM paper's headline measure (its Fig. 12-13).

The paper serves Poisson arrivals at a sweep of request rates and plots, for each system, the
*normalized latency*: the mean over requests of end-to-end latency divided by output length
(seconds per token). Each curve is flat while the server keeps up and explodes once the rate
passes what it can serve, because the queue then grows without end. One system is better than
another by how far right its curve explodes: the rate it sustains at equal latency.

This module runs that sweep on the serving scheduler (:class:`~pagedkv.sim.scheduler.Server`)
for paging (the real :class:`~pagedkv.KVCacheManager`) and the three Orca reservations (buddy
allocator), and reads the sustained rates off the curves:

- :func:`sweep` serves the same workload at every rate with every system and records each
  point's normalized latency, the mean number of requests batched per decode iteration and
  the preemptions (:class:`RatePoint`);
- :func:`unloaded_latency` is the normalized latency every request would have alone on the
  GPU, under the same cost model: the unit in which a threshold is stated;
- :func:`sustained_rate` reads where a curve crosses a threshold (see its docstring).

Speed: every run is a :class:`~pagedkv.sim.scheduler.Server` with ``coalesce=True``, so a
decode-only stretch (no request waiting, none arriving, none finishing) is one call. The paged
system is :class:`~pagedkv.sim.fleet.ReplicaAllocator`, the real manager with the same
admission, the same tokens and the same request timings as
:class:`~pagedkv.sim.baselines.PagedAllocator` (a test checks both, to the
bit) that can run such stretches; the reservations run them natively. A light load then
costs a scheduler turn per arrival or finish instead of one per token, with the same clock.

The module knows no report and no paper value; the memory and the cost model come in as
arguments (the report passes the paper's OPT-13B on an A100-40GB, the same setup as its Fig. 2
section). Worked number: ShareGPT-like lengths on that setup average 0.0178 s per output token
alone (one decode step of about 17.6 ms per token, plus the prompt's prefill); below 2 x that,
paging on 500 requests stays up to about 3.2 req/s and Orca (Oracle) up to about 1.6.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..checks import int_at_least, number_at_least
from .baselines import KVAllocator, ReservationAllocator
from .costmodel import CostModel
from .fleet import ReplicaAllocator
from .request import Request
from .scheduler import Server

__all__ = ["SYSTEMS", "SYSTEM_LABELS", "RatePoint", "Curve", "Sustained", "make_system", "serve_point",
           "sweep", "unloaded_latency", "sustained_rate", "normalized_latency"]

# The systems swept, paging first; their keys are the allocator names of the simulator.
SYSTEMS = ("paged", "oracle", "pow2", "max")
SYSTEM_LABELS = {"paged": "paged (pagedkv)", "oracle": "Orca (Oracle)", "pow2": "Orca (Pow2)",
                 "max": "Orca (Max)"}


@dataclass(frozen=True)
class RatePoint:
    """One system served at one request rate.

    ``normalized_latency``: mean over finished requests of (finish - arrival) / output length,
    seconds per token (the paper's measure). ``mean_batch``: requests decoded per iteration
    while the load is offered (tokens decoded / iterations run until the last arrival; the whole
    run when every request arrives at once), so the drain at the end, a few long requests alone,
    does not dilute it. ``preemptions``: victims
    the paged cache recomputed (0 for a reservation, which never runs out mid-request).
    """

    rate: float
    normalized_latency: float
    mean_batch: float
    preemptions: int
    finished: int


@dataclass(frozen=True)
class Curve:
    """One system's points, in increasing rate."""

    system: str
    points: tuple[RatePoint, ...]

    @property
    def rates(self) -> list[float]:
        return [p.rate for p in self.points]

    @property
    def latencies(self) -> list[float]:
        return [p.normalized_latency for p in self.points]


@dataclass(frozen=True)
class Sustained:
    """The highest rate a curve stays below a threshold at, and how it was read.

    ``bound`` is ``"="`` when the curve crosses the threshold inside the sweep (``rate`` is
    interpolated), ``">="`` when it never crosses (``rate`` is the last rate swept: the true
    value is at least that) and ``"<"`` when even the first rate is above (``rate`` is that
    first rate: the true value is below it).
    """

    rate: float
    bound: str

    @property
    def exact(self) -> bool:
        return self.bound == "="


class _Decoded:
    """Counts the tokens an allocator's decode steps appended (``decoded``), one by one or in
    coalesced stretches; mixed into the allocators :func:`make_system` builds."""

    decoded = 0

    def step(self, req_ids: Sequence[str]) -> int:
        n = super().step(req_ids)
        self.decoded += n
        return n

    def step_n(self, req_ids: Sequence[str], n: int) -> int:
        tokens = super().step_n(req_ids, n)
        self.decoded += tokens
        return tokens


class _PagedSystem(_Decoded, ReplicaAllocator):
    """The paged cache, counting decoded tokens."""


class _ReservedSystem(_Decoded, ReservationAllocator):
    """An Orca reservation, counting decoded tokens."""


def make_system(system: str, num_blocks: int, block_size: int, max_len: int) -> KVAllocator:
    """A fresh allocator for ``system`` over ``num_blocks x block_size`` slots: paging through the
    real manager (1% admission watermark, as the simulator's paged allocator), or a reservation
    placed by the buddy allocator (``"oracle"``, ``"pow2"``, ``"max"``). Its ``decoded`` counts
    the tokens its decode steps appended."""
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {', '.join(SYSTEMS)}, got {system!r}")
    num_blocks = int_at_least("num_blocks", num_blocks, 1)
    block_size = int_at_least("block_size", block_size, 1)
    if system == "paged":
        return _PagedSystem(num_blocks, block_size)
    return _ReservedSystem(num_blocks * block_size, system, max_len)


def normalized_latency(arrival: np.ndarray, finish: np.ndarray, output_len: np.ndarray) -> float:
    """Mean of (finish - arrival) / output length over the finished requests (finish not NaN).
    Two requests of 10 and 100 output tokens taking 1 s and 5 s: (0.1 + 0.05) / 2 = 0.075."""
    done = ~np.isnan(finish)
    if not done.any():
        return math.nan
    return float(np.mean((finish[done] - arrival[done]) / output_len[done]))


def serve_point(requests: Sequence[Request], system: str, num_blocks: int, block_size: int,
                cost: CostModel, max_len: int, rate: float = math.nan) -> RatePoint:
    """Serve ``requests`` (their arrivals set) with ``system`` to the end; one :class:`RatePoint`."""
    if not requests:
        raise ValueError("requests must not be empty")
    alloc = make_system(system, num_blocks, block_size, max_len)
    server = Server(alloc, cost, max_len=max_len, record_steps=False, coalesce=True)
    ordered = sorted(requests, key=lambda r: r.arrival)
    for r in ordered:
        server.submit(r)
    server.advance_to(ordered[-1].arrival)  # the offered load: until the last arrival
    window = (alloc.decoded, server.iterations)
    server.drain()
    decoded, iterations = window if window[1] else (alloc.decoded, server.iterations)  # all at t = 0
    batch = decoded / iterations if iterations else 0.0
    res = server.result(requests=list(requests))
    log = res.requests
    out = np.array([r.output_len for r in requests], dtype=np.float64)
    return RatePoint(rate, normalized_latency(log.arrival, log.finish, out), batch, res.preemptions,
                     res.finished)


def sweep(make_requests: Callable[[float], list[Request]], rates: Sequence[float], num_blocks: int,
          block_size: int, cost: CostModel, max_len: int, systems: Sequence[str] = SYSTEMS,
          progress: Callable[[str], None] | None = None) -> dict[str, Curve]:
    """Every system at every rate, on the same requests per rate: ``make_requests(rate)`` gives
    the workload with Poisson arrivals at ``rate`` (the same lengths at every rate, from one
    seed). Returns one :class:`Curve` per system, in ``systems`` order."""
    rates = [number_at_least("rate", r, 0.0, strict=True) for r in rates]
    if not rates or rates != sorted(rates) or len(set(rates)) != len(rates):
        raise ValueError(f"rates must be increasing and not empty, got {rates}")
    for s in systems:
        if s not in SYSTEMS:
            raise ValueError(f"system must be one of {', '.join(SYSTEMS)}, got {s!r}")
    points: dict[str, list[RatePoint]] = {s: [] for s in systems}
    for rate in rates:
        if progress is not None:
            progress(f"{rate:g} req/s")
        reqs = make_requests(rate)
        for s in systems:
            points[s].append(serve_point(reqs, s, num_blocks, block_size, cost, max_len, rate))
    return {s: Curve(s, tuple(p)) for s, p in points.items()}


def unloaded_latency(requests: Sequence[Request], cost: CostModel) -> float:
    """The normalized latency of ``requests`` if each ran alone: the first iteration prefills
    the prompt and decodes one token (reading prompt + 1 token states), iteration k reads
    prompt + k; the mean over requests of that sum over the output length. The decode step is
    linear in the tokens read, so the sum is taken in closed form from two of the cost model's
    step times. Example on OPT-13B / A100-40GB: a 161-token prompt with 338 output tokens takes
    about 6.0 s alone, 0.0177 s per token.
    """
    if not requests:
        raise ValueError("requests must not be empty")
    base = cost.step_time(0)
    slope = cost.step_time(1) - base  # seconds per token state read
    p = np.array([r.prompt_len for r in requests], dtype=np.float64)
    o = np.array([r.output_len for r in requests], dtype=np.float64)
    first = np.array([cost.step_time(r.prompt_len + 1, r.prompt_len) for r in requests])
    # iterations 2 .. o read p + 2 .. p + o token states: (o - 1) steps, their reads summed
    reads = (o - 1) * p + (o * (o + 1) / 2 - 1)
    total = first + (o - 1) * base + slope * reads
    return float(np.mean(total / o))


def sustained_rate(rates: Sequence[float], latencies: Sequence[float], threshold: float) -> Sustained:
    """The highest rate at which the curve stays below ``threshold``, read as the paper reads its
    curves: from the left, the first swept rate whose latency is above the threshold ends the
    curve's sustainable part, and the crossing is interpolated between it and the rate before
    (linear in rate, in the logarithm of latency, since an exploding curve is close to
    exponential there). Later points are not looked at: a curve that explodes has exploded.

    Example: rates 1, 2, 3 with latencies 0.02, 0.03, 0.12 and threshold 0.06: the crossing lies
    between 2 and 3 at log(0.06 / 0.03) / log(0.12 / 0.03) = 0.5 of the way: 2.5.
    """
    threshold = number_at_least("threshold", threshold, 0.0, strict=True)
    if len(rates) != len(latencies) or not rates:
        raise ValueError(f"rates and latencies must have the same non-zero length, got {len(rates)} "
                         f"and {len(latencies)}")
    if any(b <= a for a, b in zip(rates, rates[1:])):
        raise ValueError(f"rates must be increasing, got {list(rates)}")
    above = [i for i, v in enumerate(latencies) if not v < threshold]  # NaN (nothing served) counts
    if not above:
        return Sustained(float(rates[-1]), ">=")
    i = above[0]
    if i == 0:
        return Sustained(float(rates[0]), "<")
    r0, r1 = rates[i - 1], rates[i]
    if math.isnan(latencies[i]):  # nothing finished there: the crossing is taken at that rate
        return Sustained(float(r1), "=")
    l0, l1 = math.log(latencies[i - 1]), math.log(latencies[i])
    frac = (math.log(threshold) - l0) / (l1 - l0) if l1 > l0 else 1.0
    return Sustained(float(r0 + frac * (r1 - r0)), "=")
