"""A fleet of serving replicas behind a router, on one simulated clock.

Why a fleet: one replica's prefix cache serves only the requests sent to it, so past one
replica the hit rate is a property of the router. This module runs ``n`` replicas, each a real
:class:`~pagedkv.KVCacheManager` behind the serving scheduler (:class:`~pagedkv.sim.scheduler.Server`)
and the cost model, and a :mod:`router <pagedkv.sim.routers>` in front of them:

1. requests are taken in arrival order; at each arrival every replica first runs the
   iterations that started before it (``Server.advance_to``), so the router sees every
   replica's state at that moment: its load (requests in flight) and, for a router that reads
   KV events, every event the replica emitted so far;
2. events travel as bytes: each replica's manager drains its events
   (``take_events``), encodes them as one vLLM ``KVEventBatch`` (:func:`pagedkv.events.encode_vllm`,
   timestamped with the replica's clock) and the router decodes the payload
   (:func:`pagedkv.events.decode_vllm`); nothing else of the replica is visible to it. In
   process, no sockets: the bytes are those a ZMQ publisher would send. Without msgspec (the
   ``events`` extra) the same events travel as the manager's own objects instead
   (``run_fleet(wire=False)``): the router learns the same hashes and routes the same way, but
   no bytes are encoded or counted;
3. the router picks a replica, the request is submitted there, and when the trace is exhausted
   every replica drains.

Replicas are independent between arrivals, so the order in which they are advanced changes
nothing (a test checks it). Metrics (:class:`FleetResult`): the prefix hit rate (prompt tokens
the managers served from cache over prompt tokens they were asked for, readmissions included),
the imbalance of work (max over mean of each replica's busy seconds), time to first token
(p50/p90 over every request), throughput (finished requests and output tokens over the fleet's
makespan), and how many replicas each prefix landed on (prefix: :func:`~pagedkv.sim.routers.prefix_key`).

Speed: replicas run with ``record_steps=False`` and ``coalesce=True`` (decode-only stretches in
one call, with the same clock as iteration by iteration; see ``Server``) on a
:class:`ReplicaAllocator`, whose decode step appends through ``append_token`` after one
capacity check instead of building a numpy batch. Iteration by iteration, the Mooncake trace's
4.1 million decoded tokens on 16 replicas would cost millions of scheduler turns; coalesced,
the cost is dominated by hashing prompts and, for the precise router, by encoding and decoding
their events (``benchmarks/fleet_scale.py`` measures it against replicas and trace length).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..checks import int_at_least
from ..types import OutOfBlocks
from .baselines import ManagerAllocator, generated_tokens, seq_key
from .costmodel import CostModel
from .request import Request
from .routers import DEFAULT_KEY_TOKENS, Router, prefix_key, prompt_array
from .scheduler import Guards, Server, SimResult

__all__ = ["ReplicaAllocator", "Replica", "FleetResult", "run_fleet", "replica_names", "wire_available"]


def wire_available() -> bool:
    """True when msgspec (the ``events`` extra) is installed, so that events can travel as vLLM's
    wire bytes; without it :func:`run_fleet` hands the router the manager's event objects."""
    try:
        import msgspec  # noqa: F401
    except ImportError:
        return False
    return True


def replica_names(n: int) -> list[str]:
    """``["r0", "r1", ...]``: the names a fleet of ``n`` replicas gets (the ring hashes them)."""
    try:
        n = int_at_least("replicas", n, 1)
    except ValueError:
        raise ValueError(f"a fleet needs at least one replica, got {n!r}") from None
    return [f"r{i}" for i in range(n)]


class ReplicaAllocator(ManagerAllocator):
    """The paged cache of one replica: a real :class:`~pagedkv.KVCacheManager`, single-sequence
    requests only (the traces a fleet replays have no parallel samples or beams).

    Same admission and the same tokens as :class:`~pagedkv.sim.baselines.PagedAllocator` (a
    test checks that ``simulate`` gives both the same request timings): the prompt, plus the
    tokens generated before a preemption; watermark 1% of the blocks; generated tokens a
    function of the request id and position. A decode step checks once that the blocks it
    needs are free (one per sequence whose last block is full: a single sequence's partial last
    block is its own, so no copy-on-write) and then appends token by token, so a step that does
    not fit raises ``OutOfBlocks`` having changed nothing. ``max_steps`` / ``step_n`` run many
    steps at once for :class:`~pagedkv.sim.scheduler.Server`'s coalesced stretches.
    ``enable_events`` turns on the manager's KV events (a precise router needs them).
    ``groups`` (attention specs, a hybrid model's) gives each sequence one table per group; a
    decode step then counts a new block in every group for each sequence at a block boundary
    (a sliding window may free one as it moves, which the count ignores: it can only
    overestimate, so a step that passes the check never runs out halfway).
    """

    coalesces = True  # max_steps and step_n below

    def __init__(self, num_blocks: int, block_size: int = 16, *, hash_algo: str = "sha256",
                 enable_events: bool = False, watermark: float = 0.01, groups=None) -> None:
        super().__init__(num_blocks, block_size, name="paged", watermark=watermark, hash_algo=hash_algo,
                         enable_events=enable_events, groups=groups)
        self._seqs: dict[str, list] = {}  # req_id -> [tokens now, prompt length, output tokens]

    def admit(self, req: Request, generated: int = 0) -> bool:
        rid = req.req_id
        if rid in self._seqs:
            raise ValueError(f"request {rid} is already admitted")
        if req.num_seqs != 1:
            raise ValueError(f"request {rid}: a fleet replica serves single-sequence requests (n = beam width = 1)")
        if not 0 <= generated <= req.output_len:
            raise ValueError(f"generated must be in [0, {req.output_len}], got {generated}")
        plen = req.prompt_len
        if not self.room_for(plen + generated, bool(self._seqs)):
            return False
        out = generated_tokens(np.full(req.output_len, seq_key(f"{rid}.0"), dtype=np.uint64),
                               np.arange(plen, plen + req.output_len, dtype=np.uint64))
        prompt = prompt_array(req)
        if generated:
            prompt = np.concatenate([prompt, out[:generated]])
        if not self.add_tokens(rid, prompt):
            return False
        self._seqs[rid] = [plen + generated, plen, out.tolist()]
        self._kv_tokens += plen + generated
        return True

    def _fresh_blocks(self, req_ids: Sequence[str], n: int) -> int:
        """Blocks that ``n`` more tokens on each of ``req_ids`` take (in every attention group)."""
        bs, seqs = self.block_size, self._seqs
        return self.num_groups * sum(-(-(seqs[r][0] + n) // bs) - -(-seqs[r][0] // bs) for r in req_ids)

    def step(self, req_ids: Sequence[str]) -> int:
        bs, seqs, m = self.block_size, self._seqs, self.m
        need = self.num_groups * sum(1 for r in req_ids if seqs[r][0] % bs == 0)
        free = m.num_free_blocks
        if need > free:
            raise OutOfBlocks(need, free, "a decode step")
        append = m.append_token
        for r in req_ids:
            st = seqs[r]
            append(r, st[2][st[0] - st[1]])
            st[0] += 1
        self._kv_tokens += len(req_ids)
        return len(req_ids)

    def max_steps(self, req_ids: Sequence[str], limit: int) -> int:
        """The most decode steps (at most ``limit``) that the free blocks allow all of
        ``req_ids`` to take together."""
        free = self.m.num_free_blocks
        if self._fresh_blocks(req_ids, limit) <= free:
            return limit
        lo, hi = 0, limit  # fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._fresh_blocks(req_ids, mid) <= free:
                lo = mid
            else:
                hi = mid
        return lo

    def step_n(self, req_ids: Sequence[str], n: int) -> int:
        """``n`` decode steps at once: each sequence's next ``n`` tokens in one append (the caller
        checked ``max_steps``; ``OutOfBlocks`` otherwise, before any change)."""
        need, free = self._fresh_blocks(req_ids, n), self.m.num_free_blocks
        if need > free:
            raise OutOfBlocks(need, free, f"{n} decode steps")
        seqs, append = self._seqs, self.m.append_tokens
        for r in req_ids:
            st = seqs[r]
            g = st[0] - st[1]
            append(r, st[2][g:g + n])
            st[0] += n
        self._kv_tokens += n * len(req_ids)
        return n * len(req_ids)

    def release(self, req_id: str) -> None:
        st = self._seqs.pop(req_id)
        self.m.free(req_id)
        self._kv_tokens -= st[0]

    def num_seqs(self, req_id: str) -> int:
        self._seqs[req_id]  # KeyError for a request not admitted
        return 1

    def seq_ids(self, req_id: str) -> list[str]:
        """The manager's ids of the request's sequences: the request id itself."""
        self._seqs[req_id]
        return [req_id]


class Replica:
    """One replica: a name, a :class:`ReplicaAllocator` and the :class:`Server` driving it.

    ``take_payload()`` is the replica's side of the event plumbing: the manager's events since
    the last call as one vLLM ``KVEventBatch`` (None when there were none), or with
    ``wire=False`` the list of event objects itself.
    """

    def __init__(self, name: str, num_blocks: int, block_size: int, cost: CostModel, *,
                 hash_algo: str = "sha256", events: bool = False, max_len: int = 2048,
                 max_num_seqs: int = 256, guards: Guards | None = None, wire: bool = True,
                 groups=None) -> None:
        self.name = name
        self.wire = wire
        self.alloc = ReplicaAllocator(num_blocks, block_size, hash_algo=hash_algo, enable_events=events,
                                      groups=groups)
        self.server = Server(self.alloc, cost, max_len=max_len, max_num_seqs=max_num_seqs, guards=guards,
                             record_steps=False, coalesce=True)
        self.events = events

    def take_payload(self) -> bytes | list | None:
        from ..events import encode_vllm

        evs = self.alloc.m.take_events()
        if not evs:
            return None
        return encode_vllm(evs, self.server.clock) if self.wire else evs


@dataclass
class FleetResult:
    """What one fleet run measured. ``assignment[i]`` is the replica index that request ``i``
    (in arrival order) went to; ``replicas`` holds each replica's :class:`SimResult`."""

    router: str
    names: list[str]
    replicas: list[SimResult]
    assignment: np.ndarray
    keys: np.ndarray  # prefix_key of each request, arrival order
    busy_s: np.ndarray  # per replica
    iterations: np.ndarray  # per replica
    router_stats: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    event_bytes: int = 0  # payload bytes the router decoded

    @property
    def num_requests(self) -> int:
        return len(self.assignment)

    @property
    def hit_tokens(self) -> int:
        return sum(r.usage.prefix_hit_tokens for r in self.replicas)

    @property
    def query_tokens(self) -> int:
        return sum(r.usage.prefix_query_tokens for r in self.replicas)

    @property
    def hit_rate(self) -> float:
        q = self.query_tokens
        return self.hit_tokens / q if q else 0.0

    @property
    def imbalance(self) -> float:
        """Max over mean of the replicas' busy seconds (1 = perfectly even work)."""
        mean = float(self.busy_s.mean())
        return float(self.busy_s.max()) / mean if mean > 0 else 1.0

    @property
    def requests_per_replica(self) -> np.ndarray:
        return np.bincount(self.assignment, minlength=len(self.names))

    def ttft(self) -> np.ndarray:
        return np.concatenate([r.requests.ttft() for r in self.replicas])

    def ttft_percentile(self, q: float) -> float:
        t = self.ttft()
        return float(np.percentile(t, q)) if len(t) else math.nan

    @property
    def makespan(self) -> float:
        return max((r.makespan for r in self.replicas), default=0.0)

    @property
    def finished(self) -> int:
        return sum(r.finished for r in self.replicas)

    @property
    def dropped(self) -> int:
        return sum(r.dropped for r in self.replicas)

    @property
    def preemptions(self) -> int:
        return sum(r.preemptions for r in self.replicas)

    @property
    def throughput_rps(self) -> float:
        return self.finished / self.makespan if self.makespan > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        out = sum(r.output_tokens for r in self.replicas)
        return out / self.makespan if self.makespan > 0 else 0.0

    def replicas_per_prefix(self) -> np.ndarray:
        """For each prefix key used by at least two requests, how many distinct replicas its
        requests went to."""
        if not len(self.keys):
            return np.empty(0, dtype=np.int64)
        pairs = np.unique(np.stack([self.keys, self.assignment.astype(np.uint64)]), axis=1)
        keys, per_key = np.unique(pairs[0], return_counts=True)
        _, uses = np.unique(self.keys, return_counts=True)  # same sorted key order
        return per_key[uses >= 2]

    def summary(self) -> dict:
        """The headline numbers, JSON-ready."""
        rpp = self.replicas_per_prefix()
        return {
            "router": self.router, "replicas": len(self.names), "requests": self.num_requests,
            "hit_rate": self.hit_rate, "imbalance": self.imbalance,
            "ttft_p50_s": self.ttft_percentile(50), "ttft_p90_s": self.ttft_percentile(90),
            "throughput_rps": self.throughput_rps, "tokens_per_s": self.tokens_per_s,
            "makespan_s": self.makespan, "finished": self.finished, "dropped": self.dropped,
            "preemptions": self.preemptions,
            "replicas_per_prefix_mean": float(rpp.mean()) if len(rpp) else math.nan,
            "replicas_per_prefix_max": int(rpp.max()) if len(rpp) else 0,
            "prefixes_on_one_replica": float((rpp == 1).mean()) if len(rpp) else math.nan,
            "router_stats": dict(self.router_stats), "wall_s": self.wall_s, "event_bytes": self.event_bytes,
        }


def run_fleet(requests: Sequence[Request], router: Router, replicas: int, num_blocks: int, *,
              block_size: int = 16, cost: CostModel | None = None, hash_algo: str = "sha256",
              max_len: int = 2048, max_num_seqs: int = 256, guards: Guards | None = None,
              key_tokens: int = DEFAULT_KEY_TOKENS, advance_order: Sequence[int] | None = None,
              progress: Callable[[int, int], None] | None = None,
              observer: Callable[[int, list[Replica], Router], None] | None = None,
              wire: bool | None = None, groups=None) -> FleetResult:
    """Serve ``requests`` on ``replicas`` replicas of ``num_blocks`` blocks each behind ``router``.

    ``wire``: a router that reads KV events gets them as vLLM wire bytes (True; needs msgspec)
    or as the managers' event objects (False; same routing, no bytes); None, the default, means
    the wire when msgspec is installed. ``FleetResult.event_bytes`` is 0 without the wire.
    ``groups``: the attention specs of a hybrid model; every replica keeps one table per group
    (``num_blocks`` are then blocks of one group's layers), and a precise router should be given
    the same groups so that it matches prefixes by the managers' hit rule.

    ``key_tokens`` defines "the same prefix" for :meth:`FleetResult.replicas_per_prefix`.
    ``advance_order`` is the order in which replicas are advanced and drained at each arrival
    (default 0..n-1; any permutation gives the same result). ``progress(done, total)`` is called
    after each request is routed (a progress bar throttles its own redraws). ``observer(i, replicas, router)`` sees the fleet just before request
    ``i`` (arrival order) is routed, the replicas advanced and their events delivered, and once
    more with ``i = len(requests)`` after the last replica drained (a test's window on both
    sides of the wire). Raises ``ValueError`` for bad arguments and
    :class:`~pagedkv.sim.scheduler.Livelock` when a replica stops making progress.
    """
    names = replica_names(replicas)
    if not isinstance(router, Router):
        raise ValueError(f"router must be a Router, got {type(router).__name__}")
    num_blocks = int_at_least("num_blocks", num_blocks, 1)
    reqs = sorted(requests, key=lambda r: r.arrival)
    if any(not isinstance(r, Request) for r in reqs):
        raise ValueError("requests must be Request objects")
    order = list(range(replicas)) if advance_order is None else list(advance_order)
    if sorted(order) != list(range(replicas)):
        raise ValueError(f"advance_order must be a permutation of 0..{replicas - 1}")
    if wire is None:
        wire = wire_available()
    elif not isinstance(wire, bool):
        raise ValueError(f"wire must be None, True or False, got {wire!r}")
    elif wire and router.wants_events and not wire_available():
        raise ImportError('KV events on the wire need msgspec (the "events" extra): pip install "pagedkv[events]"')
    cost = cost or CostModel()
    fleet = [Replica(name, num_blocks, block_size, cost, hash_algo=hash_algo, events=router.wants_events,
                     max_len=max_len, max_num_seqs=max_num_seqs, guards=guards, wire=wire, groups=groups)
             for name in names]
    router.bind(names)
    servers = [rep.server for rep in fleet]
    assignment = np.empty(len(reqs), dtype=np.int64)
    keys = np.empty(len(reqs), dtype=np.uint64)
    event_bytes = 0
    wall = time.perf_counter()
    def deliver() -> int:
        sent = 0
        for j in order:
            payload = fleet[j].take_payload()
            if payload is not None:
                if wire:
                    sent += len(payload)
                router.on_events(j, payload)
        return sent

    for i, req in enumerate(reqs):
        for j in order:
            servers[j].advance_to(req.arrival)
        if router.wants_events:
            event_bytes += deliver()
        if observer is not None:
            observer(i, fleet, router)
        target = router.route(req, [s.load for s in servers])
        servers[target].submit(req)
        assignment[i] = target
        keys[i] = prefix_key(req, key_tokens)
        if progress is not None:
            progress(i + 1, len(reqs))
    for j in order:
        servers[j].drain()
    if router.wants_events:
        event_bytes += deliver()
    if observer is not None:
        observer(len(reqs), fleet, router)
    return FleetResult(
        router=router.describe(), names=names, replicas=[s.result() for s in servers], assignment=assignment,
        keys=keys, busy_s=np.array([s.busy_s for s in servers]),
        iterations=np.array([s.iterations for s in servers]), router_stats=dict(router.stats),
        wall_s=time.perf_counter() - wall, event_bytes=event_bytes)
