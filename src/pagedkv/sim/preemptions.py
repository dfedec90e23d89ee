"""Why a saturated paged server preempts about once per request: one run's preemptions, recorded.

With every request waiting, the paged cache admits the head of the queue whenever its prompt
fits with the admission watermark (1% of the blocks) left free, so each finish's freed blocks
are handed out again at once. The running batch keeps growing (a sequence takes a new block
every ``block_size`` tokens) and the spare is soon gone: the decode step that runs out preempts
the newest request, which frees only what a young request holds. :func:`anatomy` serves a
workload through :class:`~pagedkv.sim.scheduler.Server` on a recording paged allocator and
measures each step of that chain; :class:`Anatomy` holds the numbers and
:meth:`Anatomy.predicted` turns them into a count to hold against the real one.

Owns the recording allocator (a :class:`~pagedkv.sim.fleet.ReplicaAllocator`, the real manager,
whose preemptions and timings equal :class:`~pagedkv.sim.baselines.PagedAllocator`'s) and the
summary; it knows no report. Worked number (ShareGPT-like, 1,000 requests at t = 0, OPT-13B's
983 blocks of 16): between two finishes the batch grows by about 21 blocks, 12 more than the
9-block watermark, and a preemption frees 12.4 on average: about one preemption per finish.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..types import OutOfBlocks
from .costmodel import CostModel
from .fleet import ReplicaAllocator
from .request import Request
from .scheduler import Server

__all__ = ["Anatomy", "anatomy"]


class _Recording(ReplicaAllocator):
    """The paged allocator, noting free blocks around every decode step, finish, preemption and
    admission. Only the counters change; every decision is the parent's."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.steps = 0  # decode steps that ran
        self.growth: list[int] = []  # blocks each decode step took
        self.freed: list[int] = []  # blocks each preemption returned
        self.taken_after: list[int] = []  # blocks the first admission after a preemption took
        self.finish_steps: list[int] = []  # decode step count at each finish
        self.preempt_steps: list[int] = []
        self.last_first_admission = 0  # step count when the last new request was admitted
        self._seen: set[str] = set()
        self._after_preemption = False

    def admit(self, req: Request, generated: int = 0) -> bool:
        free = self.m.num_free_blocks
        if not super().admit(req, generated):
            return False
        if self._after_preemption:
            self.taken_after.append(free - self.m.num_free_blocks)
            self._after_preemption = False
        if req.req_id not in self._seen:
            self._seen.add(req.req_id)
            self.last_first_admission = self.steps
        return True

    def step(self, req_ids: Sequence[str]) -> int:
        free = self.m.num_free_blocks
        try:
            n = super().step(req_ids)
        except OutOfBlocks:
            self.preempt_steps.append(self.steps)
            raise
        self.steps += 1
        self.growth.append(free - self.m.num_free_blocks)
        return n

    def release(self, req_id: str) -> None:
        tokens, prompt, output = self._seqs[req_id]
        free = self.m.num_free_blocks
        super().release(req_id)
        if tokens < prompt + len(output):  # released before its end: a preemption
            self.freed.append(self.m.num_free_blocks - free)
            self._after_preemption = True
        else:
            self.finish_steps.append(self.steps)


@dataclass(frozen=True)
class Anatomy:
    """One saturated paged run's preemptions, and the chain that causes them.

    The *loaded part* is every decode step until the last request is first admitted: requests
    wait throughout it. ``growth_per_step``: blocks a decode step took there (mean);
    ``steps_per_finish``: decode steps there per finished request; ``freed_mean`` /
    ``freed_median``: blocks a preemption returned; ``taken_after``: blocks the first admission
    after a preemption took (mean). ``preempted`` / ``repeated``: requests preempted at least
    once / more than once; ``most``: the most preemptions of one request.
    """

    requests: int
    preemptions: int
    preempted: int
    repeated: int
    most: int
    num_blocks: int
    watermark_blocks: int
    loaded_steps: int
    loaded_finishes: int
    loaded_preemptions: int
    growth_per_step: float
    steps_per_finish: float
    freed_mean: float
    freed_median: float
    taken_after: float
    mean_batch: float

    @property
    def growth_between_finishes(self) -> float:
        """Blocks the running batch takes between two finishes in the loaded part."""
        return self.growth_per_step * self.steps_per_finish

    @property
    def per_finish(self) -> float:
        """Preemptions per finish the chain predicts: the growth between two finishes beyond the
        watermark, paid for by victims freeing ``freed_mean`` each. (21 - 9) / 12.4 = 0.97."""
        return max(self.growth_between_finishes - self.watermark_blocks, 0.0) / self.freed_mean

    def predicted(self) -> float:
        """Preemptions the chain predicts for the loaded part: ``per_finish`` x its finishes."""
        return self.per_finish * self.loaded_finishes

    def as_dict(self) -> dict:
        out = dict(vars(self))
        out.update(growth_between_finishes=self.growth_between_finishes, per_finish=self.per_finish,
                   predicted=self.predicted())
        return out


def anatomy(requests: Sequence[Request], num_blocks: int, block_size: int, cost: CostModel,
            max_len: int) -> Anatomy:
    """Serve ``requests`` (every arrival at t = 0 for the saturated case) on the paged cache with
    the scheduler's default guards, recording each preemption; the :class:`Anatomy`. ValueError
    when the run preempts nothing (there is no chain to explain)."""
    if not requests:
        raise ValueError("requests must not be empty")
    alloc = _Recording(num_blocks, block_size)
    server = Server(alloc, cost, max_len=max_len, record_steps=False)
    for r in sorted(requests, key=lambda r: r.arrival):
        server.submit(r)
    server.drain()
    res = server.result(requests=list(requests))
    if not alloc.freed:
        raise ValueError("the run preempted nothing: no preemptions to explain")
    per_request = res.requests.preemptions
    loaded = max(alloc.last_first_admission, 1)
    growth = np.array(alloc.growth[:loaded], dtype=np.float64)
    finishes = sum(1 for s in alloc.finish_steps if s <= loaded)
    freed = np.array(alloc.freed, dtype=np.float64)
    return Anatomy(
        requests=len(requests), preemptions=res.preemptions, preempted=int((per_request > 0).sum()),
        repeated=int((per_request > 1).sum()), most=int(per_request.max()), num_blocks=num_blocks,
        watermark_blocks=alloc.watermark_blocks, loaded_steps=loaded, loaded_finishes=finishes,
        loaded_preemptions=sum(1 for s in alloc.preempt_steps if s <= loaded),
        growth_per_step=float(growth.mean()), steps_per_finish=loaded / max(finishes, 1),
        freed_mean=float(freed.mean()), freed_median=float(np.median(freed)),
        taken_after=float(np.mean(alloc.taken_after)) if alloc.taken_after else 0.0,
        mean_batch=res.output_tokens / server.iterations,
    )
