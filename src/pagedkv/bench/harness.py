"""A small timing harness for microbenchmarks of the allocator (standard library + numpy only).

Why our own and not ``timeit`` / pytest-benchmark: most operations we care about *mutate* the
manager (``fork`` creates a sequence, ``free`` destroys one, ``append_token`` eventually needs a
new block), so every repetition needs an untimed *setup* that recreates the state the timed call
expects and often an untimed *teardown* that undoes it. ``timeit`` has no per-repetition setup,
and pytest-benchmark's ``pedantic`` mode does, but drags the test runner into what is a plain
script. This module is ~100 lines and does exactly that.

How a measurement is taken (:func:`measure`):

* ``warmup`` untimed repetitions first (caches, lazy imports, numpy's first-call dispatch,
  the allocator's free-list growth), then ``repeat`` timed samples, or fewer if ``max_time_s``
  runs out (at least ``min_repeat`` are always taken).
* Each sample: ``state = setup()`` (untimed), then ``number`` calls of ``fn`` (``fn(state)`` when
  there is a setup, ``fn()`` otherwise) between two ``time.perf_counter_ns()`` reads, then
  ``teardown(state)`` (untimed). The sample is divided by ``number * ops`` (``ops`` = how many
  operations one call of ``fn`` performs, e.g. 15 ``append_token`` calls in a loop), giving
  nanoseconds per operation. Loop overhead of such an inner loop (~20-40 ns per iteration on
  CPython 3.11) is included, as it is in ``timeit``; it is part of what a caller pays.
* The cyclic garbage collector is disabled only around the timed region: a collection triggered
  by some earlier allocation would otherwise land in a random sample and bill it for other code's
  garbage. Collections still happen, in the untimed setup/teardown.

Why medians (with p10/p90) and not means or minima: timing samples of microsecond operations are
right-skewed. Interrupts, scheduler preemption (2 cores shared with the OS), page faults and
frequency changes add large delays to a few samples; the *mean* moves with them and with how
often they happen to strike during one run, so it is not reproducible. The *minimum* is the
other extreme: the one lucky run with every cache line hot, a cost never sustained in a real
engine loop. The *median* is robust to the tail and is the cost of a typical call; p10 and p90
show the spread, so a reader can see when a median stands on a wide or bimodal distribution
(e.g. one ``append_batch`` step in 16 allocating a block for each sequence).
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = ["Timing", "measure", "time_call_ns"]


@dataclass(frozen=True)
class Timing:
    """The result of :func:`measure`: per-operation times in microseconds."""

    samples_ns: np.ndarray  # per-operation nanoseconds, one per timed sample
    ops_per_sample: int  # number * ops

    @property
    def n(self) -> int:
        return int(self.samples_ns.size)

    def pct_us(self, q: float) -> float:
        return float(np.percentile(self.samples_ns, q)) / 1e3

    @property
    def median_us(self) -> float:
        return float(np.median(self.samples_ns)) / 1e3

    @property
    def p10_us(self) -> float:
        return self.pct_us(10)

    @property
    def p90_us(self) -> float:
        return self.pct_us(90)

    @property
    def min_us(self) -> float:
        return float(self.samples_ns.min()) / 1e3

    def spread(self) -> str:
        """``p10/p90`` in µs with the sample count, for a note column."""
        return f"p10 {_g(self.p10_us)} / p90 {_g(self.p90_us)} µs, n={self.n}"


def _g(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def time_call_ns(fn: Callable[..., Any], *args: Any) -> tuple[int, Any]:
    """Time one call with the cyclic GC off: ``(nanoseconds, result)``. For replay loops."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        out = fn(*args)
        t1 = time.perf_counter_ns()
    finally:
        if enabled:
            gc.enable()
    return t1 - t0, out


def measure(
    fn: Callable[..., Any],
    *,
    setup: Callable[[], Any] | None = None,
    teardown: Callable[[Any], Any] | None = None,
    repeat: int = 200,
    warmup: int = 10,
    number: int = 1,
    ops: int = 1,
    max_time_s: float | None = 5.0,
    min_repeat: int = 5,
) -> Timing:
    """Time ``fn``; see the module docstring for the protocol and why medians.

    ``setup()`` returns the state passed to ``fn`` (and to ``teardown``). With a setup, ``number``
    is usually 1: the state is fresh for exactly one call. Without one, raise ``number`` for calls
    far below 10 µs so that the two clock reads (~50 ns together) are negligible.
    ``max_time_s`` bounds the wall time of the whole measurement, setup included.
    """
    if repeat < 1 or number < 1 or ops < 1:
        raise ValueError("repeat, number and ops must be >= 1")
    clock = time.perf_counter_ns
    gc_was_enabled = gc.isenabled()
    per = number * ops
    rng = range(number)
    samples: list[int] = []
    deadline = None if max_time_s is None else time.perf_counter() + max_time_s
    try:
        for i in range(warmup + repeat):
            state = setup() if setup is not None else None
            gc.disable()
            if setup is not None:
                t0 = clock()
                for _ in rng:
                    fn(state)
                t1 = clock()
            else:
                t0 = clock()
                for _ in rng:
                    fn()
                t1 = clock()
            if gc_was_enabled:
                gc.enable()
            if teardown is not None:
                teardown(state)
            if i >= warmup:
                samples.append(t1 - t0)
                if deadline is not None and len(samples) >= min_repeat and time.perf_counter() > deadline:
                    break
    finally:
        if gc_was_enabled:
            gc.enable()
    return Timing(np.asarray(samples, dtype=np.float64) / per, per)
