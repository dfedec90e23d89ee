"""Time-weighted metrics of a simulated run, in the vLLM paper's categories.

Why time-weighted: a state that lasts 30 ms matters thirty times more than one that lasts 1 ms,
and iterations differ in length (a big batch reads more KV). Every share here is
``sum(value x dt) / sum(capacity x dt)`` over the chosen iterations.

Windows: ``"saturated"`` (default for the memory breakdown) keeps only iterations that left an
arrived request waiting. That is the regime the paper's Fig. 2 describes, where memory, not
demand, limits the batch; the drain at the end of a run (queue empty, memory emptying) says
nothing about an allocator. ``"busy"`` keeps every iteration that did work, ``"all"`` adds the
idle gaps. ``"run"`` is the serving run the vLLM paper averages its Fig. 2 over: every iteration
from the first request's arrival to the last one's finish, idle gaps between requests included
(only the wait before the first arrival is left out).

Worked example: two iterations of 10 ms and 30 ms with 40% and 60% of memory holding token states
average to (0.4 x 10 + 0.6 x 30) / 40 = 55%, not 50%.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .baselines import CATEGORIES, paper_categories
from .scheduler import SimResult, StepLog

__all__ = ["Metrics", "compute", "window_mask", "time_weighted_shares", "tail_latency", "QUANTILES"]

WINDOWS = ("saturated", "busy", "all", "run")
QUANTILES = (50, 90, 99)


def window_mask(steps: StepLog, window: str) -> np.ndarray:
    """Boolean mask of the iterations in ``window`` (``saturated`` falls back to ``busy`` when
    no iteration was saturated, e.g. a light load)."""
    if window not in WINDOWS:
        raise ValueError(f"window must be one of {WINDOWS}, got {window!r}")
    if window == "all":
        return np.ones(len(steps), dtype=bool)
    busy = ~steps.idle
    if window == "run":
        started = np.flatnonzero(busy)
        mask = np.zeros(len(steps), dtype=bool)
        if len(started):
            mask[started[0]:] = True
        return mask
    if window == "busy":
        return busy
    sat = busy & steps.waiting
    return sat if sat.any() and steps.dt[sat].sum() > 0 else busy


def time_weighted_shares(steps: StepLog, capacity: int, mask: np.ndarray) -> dict[str, float]:
    """Each category's time-weighted share of the KV memory over the masked iterations."""
    dt = steps.dt[mask]
    denom = float(dt.sum()) * capacity
    if denom <= 0:
        return {k: 0.0 for k in CATEGORIES}
    vals = steps.slots[mask].T.astype(np.float64) @ dt
    return {k: float(v) / denom for k, v in zip(CATEGORIES, vals)}


@dataclass(frozen=True)
class Metrics:
    """One run's numbers. Shares are fractions (0.204, not 20.4).

    ``internal_fragmentation_ratio`` is internal fragmentation over *allocated* memory (token
    states + reserved + internal + buddy rounding), which for the paged cache is the manager's own
    ``1 - stored_tokens / allocated_slots``, time-weighted. ``sharing_saving`` is blocks saved by
    sharing over the blocks the sequences would need without it (``sum ceil(len / bs)``),
    time-weighted over decode iterations (paged only; 0 for reservations).
    ``prefix_hit_rate`` (the cache's own count) splits into ``shared_hit_rate``, hits at a
    request's first admission (blocks other requests left), and ``readmit_hit_rate``, hits at a
    readmission after a preemption (mostly the request's own blocks): both over the tokens
    admissions looked up.
    """

    allocator: str
    window: str
    shares: dict[str, float]
    internal_fragmentation_ratio: float
    avg_batch: float
    max_batch: int
    throughput_rps: float
    tokens_per_s: float
    makespan_s: float
    iterations: int
    finished: int
    dropped: int
    clipped: int
    preemptions: int
    prefix_hit_rate: float
    sharing_saving: float
    block_table_entries: float  # time-weighted mean over decode iterations (all sequences)
    block_table_bytes_per_seq: float  # int32 entries per running sequence
    shared_hit_rate: float = 0.0
    readmit_hit_rate: float = 0.0

    @property
    def token_share(self) -> float:
        return self.shares["token_states"]

    @property
    def paper_shares(self) -> dict[str, float]:
        """The shares in the vLLM paper's four Fig. 2 categories (see
        :func:`~pagedkv.sim.baselines.paper_categories`)."""
        return paper_categories(self.shares)


def _weighted(values: np.ndarray, dt: np.ndarray) -> float:
    total = float(dt.sum())
    return float(values.astype(np.float64) @ dt) / total if total > 0 else 0.0


def compute(result: SimResult, window: str = "saturated") -> Metrics:
    """The :class:`Metrics` of ``result``; shares over ``window`` (see the module docstring),
    batch, throughput and sharing over every decode iteration."""
    if not isinstance(result, SimResult):
        raise ValueError(f"result must be a SimResult, got {type(result).__name__}")
    s = result.steps
    mask = window_mask(s, window)
    shares = time_weighted_shares(s, result.capacity, mask)
    held = shares["token_states"] + shares["reserved"] + shares["internal_fragmentation"] + shares["buddy_rounding"]
    decode = s.tokens > 0
    dt = s.dt[decode]
    logical = float(s.logical_blocks[decode].astype(np.float64) @ dt)
    saved = float(s.saved_blocks[decode].astype(np.float64) @ dt)
    entries = _weighted(s.logical_blocks[decode], dt)
    batch = _weighted(s.batch[decode], dt)
    u = result.usage
    span = result.makespan
    looked = result.looked_up_tokens
    return Metrics(
        allocator=result.allocator,
        window=window,
        shares=shares,
        internal_fragmentation_ratio=shares["internal_fragmentation"] / held if held else 0.0,
        avg_batch=float(s.batch[decode].mean()) if decode.any() else 0.0,
        max_batch=int(s.batch.max()) if len(s) else 0,
        throughput_rps=result.finished / span if span > 0 else 0.0,
        tokens_per_s=result.output_tokens / span if span > 0 else 0.0,
        makespan_s=span,
        iterations=int((~s.idle).sum()),
        finished=result.finished,
        dropped=result.dropped,
        clipped=result.clipped,
        preemptions=result.preemptions,
        prefix_hit_rate=u.prefix_hit_rate if u is not None else 0.0,
        sharing_saving=saved / logical if logical > 0 else 0.0,
        block_table_entries=entries,
        block_table_bytes_per_seq=4.0 * entries / batch if batch > 0 else 0.0,
        shared_hit_rate=result.first_hit_tokens / looked if looked else 0.0,
        readmit_hit_rate=result.readmit_hit_tokens / looked if looked else 0.0,
    )


def tail_latency(result: SimResult, quantiles: tuple[int, ...] = QUANTILES) -> dict[str, float]:
    """Percentiles of per-request latency (arrival to finish) and time to first token, in
    seconds of the cost model: ``{"latency_p50": ..., "ttft_p99": ...}``.

    Every request counts except those dropped as never fitting (they are reported by id): one
    that never finished (never produced a token), because the run stopped in a livelock, is
    infinitely late, so a percentile it reaches is ``inf``. Nearest-rank percentiles (the
    smallest value with at least q% of requests at or below it), so that an infinite value
    never blends into a finite one. Example: latencies 1, 2, ..., 100 s -> p50 50, p90 90,
    p99 99; with the slowest two never finishing, p99 is inf.
    """
    if not isinstance(result, SimResult) or result.requests is None:
        raise ValueError("tail_latency needs a SimResult with its request log")
    log = result.requests
    dropped = set(result.dropped_ids)
    keep = np.array([rid not in dropped for rid in log.ids], dtype=bool)
    out = {}
    for name, t in (("latency", log.finish), ("ttft", log.first_token)):
        values = np.where(np.isnan(t), np.inf, t - log.arrival)[keep]
        for q in quantiles:
            out[f"{name}_p{q}"] = (float(np.percentile(values, q, method="inverted_cdf"))
                                   if len(values) else float("nan"))
    return out
