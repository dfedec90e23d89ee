"""Parallel samples as separate requests that share their prompt by fork.

Why: the paged allocator (:class:`~pagedkv.sim.baselines.PagedAllocator`) keeps the ``n``
samples of a request together, as vLLM v0's sequence group did: they are admitted, stepped and
preempted as one, so a victim always frees its blocks. vLLM v1 schedules every sample as its own
request. Then a victim can be a sample whose blocks are all shared with its siblings, and
preempting it frees nothing: the failure mode (c) of :mod:`pagedkv.sim.scheduler`, and the
reason for its ``skip_unfreeing`` guard.

:class:`SampleAllocator` serves both on the real :class:`~pagedkv.KVCacheManager`. A request
admitted while another live request with the same prompt recipe (``segments``, hence the same
tokens) has produced nothing yet forks it: it shares every block, the partial last one included,
and allocates nothing (copy-on-write pays at its first token). Otherwise it is added with its
prompt, and after a preemption with its own generated tokens, finding in the prefix cache
whatever is still there. :func:`split_samples` turns ``n``-sample requests into ``n`` requests;
a request left with ``n`` > 1 runs its samples as one group.

Worked example (block size 16): four samples of a 40-token prompt arrive together, split. The
first is added (3 blocks), the other three fork it (0 blocks; every block has refcount 4). Until
their first step copies the shared partial block, preempting any of them frees 0 blocks
(:meth:`~pagedkv.sim.baselines.ManagerAllocator.freeable_blocks`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Sequence

from ..checks import require
from .baselines import ManagerAllocator, recomputed_prompt, seq_key
from .request import Request

__all__ = ["SampleAllocator", "split_samples"]


def split_samples(requests: Iterable[Request]) -> list[Request]:
    """Each request with ``n`` > 1 as ``n`` one-sample requests ``{id}/{i}`` (same arrival,
    prompt and output length); other requests unchanged. Beam search cannot be split (its beams
    are chosen together): ValueError."""
    out = []
    for r in requests:
        if r.beam_width > 1:
            raise ValueError(f"request {r.req_id}: beams are chosen together and cannot be split")
        if r.n == 1:
            out.append(r)
        else:
            out += [replace(r, req_id=f"{r.req_id}/{i}", n=1) for i in range(r.n)]
    return out


class _Entry:
    __slots__ = ("req", "seqs", "keys", "length")

    def __init__(self, req: Request, seqs: list[str], length: int) -> None:
        self.req, self.seqs, self.length = req, seqs, length
        self.keys = [seq_key(s) for s in seqs]


class SampleAllocator(ManagerAllocator):
    """Requests on a real manager, where an identical prompt forks a live, fresh copy of it.

    A request with ``n`` > 1 samples runs them as one group (forked at admission, stepped,
    preempted and restarted together, as :class:`~pagedkv.sim.baselines.PagedAllocator` does);
    :func:`split_samples` makes them separate requests instead. Beam search is left to
    ``PagedAllocator``. ``watermark`` keeps that share of blocks free at admission (a fork is
    exempt: it takes no block); 0 by default, so that the scheduler's own guard decides.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 hash_algo: str = "sha256", watermark: float = 0.0) -> None:
        super().__init__(num_blocks, block_size, name="paged (samples)", watermark=watermark,
                         enable_prefix_caching=enable_prefix_caching, hash_algo=hash_algo)
        self._reqs: dict[str, _Entry] = {}
        self._fresh: dict[tuple, dict[str, None]] = {}  # prompt recipe -> live requests still at it
        self.forks = 0  # admissions served by forking a fresh identical prompt

    def admit(self, req: Request, generated: int = 0) -> bool:
        if req.beam_width > 1:
            raise ValueError(f"request {req.req_id}: beam search runs on PagedAllocator")
        if req.req_id in self._reqs:
            raise ValueError(f"request {req.req_id} is already admitted")
        if not 0 <= generated <= req.output_len or (generated and req.n > 1):
            raise ValueError(f"generated must be in [0, {req.output_len}] (0 for n > 1)")
        seqs = [f"{req.req_id}.{i}" for i in range(req.n)]
        fresh = self._fresh.get(req.segments) if generated == 0 else None
        if fresh:
            self.m.fork(self._reqs[next(iter(fresh))].seqs[0], seqs[0])
            self.forks += 1
            self.last_hit_tokens = req.prompt_len
        elif not self._add(req, seqs[0], generated):
            return False
        for child in seqs[1:]:
            self.m.fork(seqs[0], child)
        entry = _Entry(req, seqs, req.prompt_len + generated)
        self._reqs[req.req_id] = entry
        if generated == 0:
            self._fresh.setdefault(req.segments, {})[req.req_id] = None
        self._kv_tokens += len(seqs) * entry.length
        return True

    def _add(self, req: Request, seq: str, generated: int) -> bool:
        if not self.room_for(req.prompt_len + generated, bool(self._reqs)):
            return False
        return self.add_tokens(seq, recomputed_prompt(req, seq, generated))

    def _unfresh(self, req_id: str) -> None:
        req = self._reqs[req_id].req
        fresh = self._fresh.get(req.segments)
        if fresh is not None and req_id in fresh:
            del fresh[req_id]
            if not fresh:
                del self._fresh[req.segments]

    def step(self, req_ids: Sequence[str]) -> int:
        entries = [self._reqs[r] for r in req_ids]
        appended = self.append_generated(entries)
        for rid, e in zip(req_ids, entries):
            if e.length == e.req.prompt_len:
                self._unfresh(rid)
            e.length += 1
        return appended

    def release(self, req_id: str) -> None:
        self._unfresh(req_id)
        e = self._reqs.pop(req_id)
        for s in reversed(e.seqs):
            self.m.free(s)
        self._kv_tokens -= len(e.seqs) * e.length

    def num_seqs(self, req_id: str) -> int:
        return len(self._reqs[req_id].seqs)

    def seq_ids(self, req_id: str) -> list[str]:
        """The manager's ids of the request's sequences (for freeable-block counts)."""
        return list(self._reqs[req_id].seqs)

    def check(self) -> None:
        """The manager's checks, and a request counted fresh has produced nothing yet."""
        super().check()
        for fresh in self._fresh.values():
            for rid in fresh:
                e = self._reqs[rid]
                require(e.length == e.req.prompt_len, f"request {rid} is counted fresh after producing tokens")
