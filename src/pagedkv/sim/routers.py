"""Routers for a fleet of replicas: where each request goes, decided at its arrival.

Why routing decides the prefix hit rate: each replica's prefix cache serves only the requests
sent to it, so a cache-blind router that spreads a conversation's turns over 16 replicas
recomputes its history on most of them. Five policies, one class each:

* :class:`RoundRobin`: replica ``i mod n`` for the ``i``-th request. Perfect counts, no affinity.
* :class:`LeastLoaded`: the replica with the fewest requests in flight (SGLang's "shortest
  queue"); ties go to the lowest index.
* :class:`HashRing` routed by :class:`RingRouter`: consistent hashing (Karger et al., STOC'97) of
  the prompt's first ``key_tokens`` tokens onto a ring holding ``vnodes`` points ("virtual
  nodes") per replica; a key goes to the first point clockwise. With ``eps`` it bounds loads
  (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads", SODA'18,
  arXiv:1608.01350): with ``m`` requests in flight counting the new one, a replica takes it only
  while it holds fewer than ``ceil((1 + eps) * m / n)``; otherwise the walk goes on clockwise to
  the next replica under the cap.
* :class:`PrefixAwareRouter`: a "precise" router in the manner of llm-d's precise prefix-cache
  scorer, NVIDIA Dynamo's KV router and the SGLang router: an index of which replica holds which
  block, fed *only* by the replicas' KV events as vLLM puts them on the wire
  (:func:`pagedkv.events.decode_vllm`). Its policy is the SGLang router's cache-aware one
  (the rule is documented in sgl-router's src/policies/cache_aware.rs; the thresholds are the
  values SGLang's router documentation, docs/advanced_features/router.md, gives:
  ``--cache-threshold 0.5 --balance-abs-threshold 32 --balance-rel-threshold 1.5``): when
  ``max(load) - min(load) > balance_abs`` and ``max(load) > balance_rel * min(load)`` the load
  guard sends the request to the least-loaded replica; otherwise, when the longest cached run of its leading blocks covers more than
  ``cache_threshold`` of the prompt, to the replica holding it (ties: least loaded), and else
  to the least-loaded replica (SGLang: the one with the smallest tree, then least loaded).
  Without the threshold, a prompt whose only cached part is a system prompt that few replicas
  have seen yet would pile onto those few.

Why virtual nodes: with one point per replica on the ring, a replica's share of the key space is
the gap before its point, and those gaps vary as much as they average. With ``n`` replicas of
``k`` points each, the ``N = n k`` gaps of uniform points are Dirichlet(1, ..., 1) and a
replica's share, the sum of ``k`` of them, is Beta(k, N - k): mean 1/n and relative standard
deviation ``sqrt((n - 1) / (n k + 1))``, about ``1 / sqrt(k)``. With 16 replicas: 0.94 for k = 1,
0.31 for k = 10, 0.097 for k = 100, 0.031 for k = 1,000. Virtual nodes even out the *key space*
only; one hot key still lands on one replica, which is what bounded loads are for.

A router is bound to its replicas' names (:meth:`Router.bind`) before a run and then asked
``route(request, loads)``, ``loads[i]`` being replica ``i``'s requests in flight (submitted and
not finished). Routers are deterministic: the same requests, loads and events give the same
choices.
"""
from __future__ import annotations

import bisect
import hashlib
import math
from typing import Sequence

import numpy as np

from ..checks import int_at_least, number_at_least
from .request import Request, mix_tokens

__all__ = [
    "ROUTERS",
    "DEFAULT_KEY_TOKENS",
    "Router",
    "RoundRobin",
    "LeastLoaded",
    "HashRing",
    "RingRouter",
    "PrefixAwareRouter",
    "prefix_key",
    "prefix_keys",
    "prompt_array",
    "ring_rsd_theory",
    "make_router",
]

ROUTERS = ("round-robin", "least-loaded", "ring", "ring-bounded", "precise")
DEFAULT_KEY_TOKENS = 1024  # the ring's key: the prompt's first 1,024 tokens (64 blocks of 16)
DEFAULT_VNODES = 100
DEFAULT_EPS = 0.25  # bounded loads' slack: HAProxy's and Vimeo's 1.25 load factor
SGLANG_BALANCE_ABS = 32  # SGLang router docs: --balance-abs-threshold 32
SGLANG_BALANCE_REL = 1.5  # SGLang router docs: --balance-rel-threshold 1.5
SGLANG_CACHE_THRESHOLD = 0.5  # SGLang router docs: --cache-threshold 0.5

_U64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64: a fast, well-spread 64-bit hash."""
    with np.errstate(over="ignore"):
        x = x.astype(np.uint64, copy=True)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def _u64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prompt_array(request: Request, limit: int | None = None) -> np.ndarray:
    """The request's first ``limit`` prompt tokens (all when None) as int32: the same tokens as
    ``request.prompt_tokens()``, in one vectorised pass over its segments (a 12,000-token
    Mooncake prompt has two dozen) and without materialising tokens past ``limit``."""
    keys, lengths = [], []
    left = request.prompt_len if limit is None else min(limit, request.prompt_len)
    for key, length in request.segments:
        if left <= 0:
            break
        take = min(length, left)
        keys.append(key & _U64)
        lengths.append(take)
        left -= take
    lens = np.array(lengths, dtype=np.int64)
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    positions = (np.arange(int(lens.sum()), dtype=np.int64) - starts).astype(np.uint64)
    return mix_tokens(np.repeat(np.array(keys, dtype=np.uint64), lens), positions)


def prefix_key(request: Request, key_tokens: int = DEFAULT_KEY_TOKENS) -> int:
    """A 64-bit hash of the prompt's first ``key_tokens`` tokens (the whole prompt when shorter):
    what the ring places, and what "the same prefix" means in the fleet's statistics.

    Example: on the Mooncake conversation trace every prompt starts with one 512-token block, so
    ``key_tokens=512`` gives all 12,031 requests one key, while 1,024 tokens separate 7,373
    conversations.
    """
    return prefix_keys(request, (key_tokens,))[0]


def prefix_keys(request: Request, lengths: Sequence[int]) -> list[int]:
    """:func:`prefix_key` for several key lengths, materialising the tokens once."""
    for n in lengths:
        int_at_least("key_tokens", n, 1, expected="a positive int")
    data = prompt_array(request, max(lengths)).astype("<u4").tobytes()
    return [_u64(data[:4 * n]) for n in lengths]


def ring_rsd_theory(replicas: int, vnodes: int) -> float:
    """``sqrt((n - 1) / (n k + 1))``: the relative standard deviation of a replica's share of a
    ring of ``n`` replicas with ``k`` uniform points each (see the module docstring)."""
    if replicas < 1 or vnodes < 1:
        raise ValueError(f"replicas and vnodes must be >= 1, got {replicas}, {vnodes}")
    return math.sqrt((replicas - 1) / (replicas * vnodes + 1))


def _check_names(names: Sequence[str]) -> list[str]:
    names = list(names)
    if not names:
        raise ValueError("a fleet needs at least one replica")
    if any(not isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise ValueError("replica names must be distinct strings")
    return names


def _least_loaded(loads: Sequence[int], among: Sequence[int] | None = None) -> int:
    """The index with the smallest load (among ``among`` when given); ties: the lowest index."""
    idx = range(len(loads)) if among is None else among
    return min(idx, key=loads.__getitem__)


class Router:
    """Where each request goes. ``bind(names)`` before a run; ``route(request, loads)`` per
    arrival; ``on_events(replica, payload)`` for routers that read KV events (``wants_events``).
    ``stats`` counts what the router did (policy specific)."""

    name = "router"
    wants_events = False

    def __init__(self) -> None:
        self.names: list[str] = []
        self.stats: dict[str, int] = {}

    def bind(self, names: Sequence[str]) -> None:
        """Attach to the replicas called ``names`` (index i is replica i); resets all state."""
        self.names = _check_names(names)
        self.stats = {}

    def route(self, request: Request, loads: Sequence[int]) -> int:
        raise NotImplementedError

    def on_events(self, replica: int, payload) -> None:
        """A batch of KV events from ``replica``: vLLM's msgpack ``KVEventBatch`` (bytes), or the
        replica manager's own event objects when they travel in process (no msgspec)."""

    def describe(self) -> str:
        return self.name

    def _count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1


class RoundRobin(Router):
    """Replica ``i mod n`` for the ``i``-th request."""

    name = "round-robin"

    def bind(self, names: Sequence[str]) -> None:
        super().bind(names)
        self._next = 0

    def route(self, request: Request, loads: Sequence[int]) -> int:
        i = self._next
        self._next = (i + 1) % len(self.names)
        return i


class LeastLoaded(Router):
    """The replica with the fewest requests in flight; ties: the lowest index."""

    name = "least-loaded"

    def route(self, request: Request, loads: Sequence[int]) -> int:
        return _least_loaded(loads)


class HashRing:
    """A consistent-hash ring: ``vnodes`` points per replica, placed by hashing (seed, name, j).

    Point ``j`` (0-based) of the replica called ``name`` sits at ``mix64(base + (j + 1) * G)``
    (mod 2**64), where ``base`` is the 8-byte blake2b digest (big-endian) of
    ``f"pagedkv-ring/{seed}/{name}"``, ``G = 0x9E3779B97F4A7C15`` and ``mix64`` is splitmix64's
    finaliser: independent of every other replica, so placements are reproducible anywhere.
    A point owns the arc from the previous point (exclusive) to itself (inclusive); a key goes
    to the owner of the first point at or after it, wrapping past 2**64 - 1 to the start. A
    replica's points depend only on its name and the seed, so adding a replica moves only the
    keys that now fall on its arcs (about 1/(n+1) of them) and reordering the list moves none.
    """

    def __init__(self, names: Sequence[str], vnodes: int = DEFAULT_VNODES, seed: int = 0) -> None:
        names = _check_names(names)
        vnodes = int_at_least("vnodes", vnodes, 1, expected="a positive int")
        seed = int_at_least("seed", seed, 0)
        self.names, self.vnodes, self.seed = names, vnodes, seed
        bases = np.array([_u64(f"pagedkv-ring/{seed}/{n}".encode()) for n in names], dtype=np.uint64)
        j = np.arange(vnodes, dtype=np.uint64)
        with np.errstate(over="ignore"):
            pts = _mix64(bases[:, None] + (j[None, :] + np.uint64(1)) * _GOLDEN).ravel()
        owners = np.repeat(np.arange(len(names)), vnodes)
        order = np.lexsort((owners, pts))  # ties (never seen in practice) broken by replica index
        self.points = pts[order]
        self.owners = owners[order]
        self._points = self.points.tolist()  # bisect on Python ints: faster than numpy per key
        self._owners = self.owners.tolist()

    def owner(self, key: int) -> int:
        """The replica index that owns ``key`` (a 64-bit int)."""
        i = bisect.bisect_left(self._points, key)
        return self._owners[i if i < len(self._owners) else 0]

    def owners_of(self, keys: np.ndarray) -> np.ndarray:
        """:meth:`owner` of each of ``keys`` (uint64), vectorised."""
        i = np.searchsorted(self.points, np.asarray(keys, dtype=np.uint64), side="left")
        return self.owners[np.where(i < len(self.points), i, 0)]

    def walk(self, key: int):
        """Distinct replicas in clockwise order from ``key``: the owner first."""
        pts, owners = self._points, self._owners
        start = bisect.bisect_left(pts, key)
        seen: set[int] = set()
        n = len(owners)
        for step in range(n):
            r = owners[(start + step) % n]
            if r not in seen:
                seen.add(r)
                yield r
                if len(seen) == len(self.names):
                    return

    def shares(self) -> np.ndarray:
        """Each replica's fraction of the key space (its arcs' total length over 2**64)."""
        p = self.points
        gaps = np.empty(len(p), dtype=np.float64)
        with np.errstate(over="ignore"):
            gaps[1:] = (p[1:] - p[:-1]).astype(np.float64)
            gaps[0] = float(int(p[0]) + (_U64 - int(p[-1])) + 1)
        return np.bincount(self.owners, weights=gaps, minlength=len(self.names)) / 2.0**64


class RingRouter(Router):
    """Consistent hashing of :func:`prefix_key` onto a :class:`HashRing`; with ``eps``, bounded
    loads (cap ``ceil((1 + eps) * m / n)`` requests in flight, ``m`` counting the new one).

    ``stats["overflow"]`` counts requests that did not go to their key's owner.
    Example (2 replicas, eps 0.25, loads [3, 0], a key owned by replica 0): m = 4, cap =
    ceil(1.25 * 4 / 2) = 3; replica 0 holds 3, so the request goes on to replica 1.
    """

    def __init__(self, vnodes: int = DEFAULT_VNODES, eps: float | None = None, seed: int = 0,
                 key_tokens: int = DEFAULT_KEY_TOKENS) -> None:
        super().__init__()
        if eps is not None:
            number_at_least("eps", eps, 0.0, expected="None or a finite number >= 0")
        key_tokens = int_at_least("key_tokens", key_tokens, 1, expected="a positive int")
        self.vnodes, self.eps, self.seed, self.key_tokens = vnodes, eps, seed, key_tokens
        self.name = "ring" if eps is None else "ring-bounded"
        self.ring: HashRing | None = None
        HashRing(["probe"], vnodes, seed)  # validate vnodes and seed now, not at the first request

    def bind(self, names: Sequence[str]) -> None:
        super().bind(names)
        self.ring = HashRing(self.names, self.vnodes, self.seed)

    def cap(self, loads: Sequence[int]) -> int:
        """Most requests in flight a replica may hold after taking the next one."""
        return math.ceil((1 + self.eps) * (sum(loads) + 1) / len(loads))

    def route(self, request: Request, loads: Sequence[int]) -> int:
        key = prefix_key(request, self.key_tokens)
        if self.eps is None:
            return self.ring.owner(key)
        cap = self.cap(loads)
        for k, r in enumerate(self.ring.walk(key)):
            if loads[r] < cap:
                if k:
                    self._count("overflow")
                return r
        raise AssertionError("no replica under the cap")  # sum(loads) < n * cap always

    def describe(self) -> str:
        bound = "" if self.eps is None else f", bounded loads eps {self.eps:g}"
        return f"{self.name} ({self.vnodes:,} vnodes{bound}, key {self.key_tokens:,} tokens)"


class PrefixAwareRouter(Router):
    """Routes to the replica holding the longest run of the prompt's leading blocks, knowing only
    what the replicas' KV events said, with SGLang's load guard and cache threshold (see the
    module docstring). Example (threshold 0.5): a 6,000-token prompt whose first 512 tokens are
    cached everywhere matches 8.5%: least loaded; its next turn, 7,000 tokens of which the first
    6,400 are cached on replica 3, matches 91%: replica 3.

    The index is, per replica, the set of 64-bit block hashes (as on the wire) its GPU cache
    holds: ``BlockStored`` adds, ``BlockRemoved`` removes, ``AllBlocksCleared`` empties. Events about another medium (a
    host tier's ``CPU``) are not GPU hits and are skipped. To look a prompt up the router hashes
    its blocks the way the replicas do (``hash_algo`` and ``block_size`` must be theirs, as
    llm-d requires of vLLM's hash seed) and stops at the first block no replica holds. A block
    counts as a match the way ``KVCacheManager.lookup`` counts it: full blocks from the start,
    never the prompt's last token.

    ``stats``: ``guard`` (the load guard chose), ``affinity`` (the longest match chose),
    ``below_threshold`` (the longest match covered at most ``cache_threshold``: least loaded).

    Every replica tags its events with ``group_idx`` (0 for a uniform one): the index keys on
    (group, hash), so a block a sliding-window group released does not hide the same hash held by
    the full-attention group. ``groups`` (the replicas' attention specs) makes a match the
    manager's hit rule: the longest prefix for which every group holds the blocks its spec needs
    (``hit_blocks``). Without it a match is group 0's leading run (a uniform replica's rule).
    """

    name = "precise"
    wants_events = True

    def __init__(self, block_size: int = 16, hash_algo: str = "sha256",
                 balance_abs: int = SGLANG_BALANCE_ABS, balance_rel: float = SGLANG_BALANCE_REL,
                 cache_threshold: float = SGLANG_CACHE_THRESHOLD, groups=None) -> None:
        super().__init__()
        from ..hashing import BlockHasher
        from ..kv_specs import check_groups

        block_size = int_at_least("block_size", block_size, 1, expected="a positive int")
        balance_abs = int_at_least("balance_abs", balance_abs, 0)
        number_at_least("balance_rel", balance_rel, 1.0)
        fraction = "a fraction in [0, 1)"
        if number_at_least("cache_threshold", cache_threshold, 0.0, expected=fraction) >= 1:
            raise ValueError(f"cache_threshold must be {fraction}, got {cache_threshold!r}")
        self.cache_threshold = cache_threshold
        self.block_size, self.hash_algo = block_size, hash_algo
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self._hasher = BlockHasher(hash_algo)
        self._root = self._hasher.root(None)
        self.held: list[set] = []  # per replica: the block hashes its events say group 0 holds
        self.held_groups: list[dict] = []  # per replica: group >= 1 -> the hashes it holds
        self.groups = None if groups is None else check_groups(groups)

    def bind(self, names: Sequence[str]) -> None:
        super().bind(names)
        self.held = [set() for _ in self.names]
        self.held_groups = [{} for _ in self.names]

    def _group_set(self, replica: int, group) -> set:
        """The index of ``replica``'s group ``group`` (None, a uniform replica's events: 0)."""
        if not group:
            return self.held[replica]
        if isinstance(group, bool) or not isinstance(group, int) or group < 0:
            raise ValueError(f"group_idx must be None or an int >= 0, got {group!r}")
        return self.held_groups[replica].setdefault(group, set())

    # ---- the index, from the wire

    def on_events(self, replica: int, payload) -> None:
        """Index a batch of ``replica``'s KV events: the bytes of one vLLM ``KVEventBatch`` (what
        a ZMQ subscriber receives; decoding needs msgspec, the ``events`` extra), or a list of
        the manager's own ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` as
        ``take_events()`` returns them (in process, no msgspec). Both carry the same facts (which
        hashes were stored or removed, on which medium, at which block size) and the index keys
        on the same 64-bit ids (:func:`pagedkv.events.hash_to_u64`, what the wire carries), so
        both give the same routing (a test runs the fleet both ways and compares every choice).
        """
        if not 0 <= replica < len(self.names):
            raise ValueError(f"replica {replica} is not one of the {len(self.names)} bound")
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            self._index_objects(replica, payload)
            return
        from ..events import MEDIUM_GPU, WireBlockRemoved, WireBlockStored, decode_vllm

        _, events, _ = decode_vllm(payload)
        for ev in events:
            kind = type(ev)
            if kind is not WireBlockStored and kind is not WireBlockRemoved:  # AllBlocksCleared
                self.held[replica].clear()
                self.held_groups[replica].clear()
            elif ev.medium not in (None, MEDIUM_GPU):
                continue
            elif kind is WireBlockStored:
                if ev.block_size != self.block_size:
                    raise ValueError(f"replica {self.names[replica]} stores blocks of {ev.block_size} tokens; "
                                     f"this router hashes blocks of {self.block_size}")
                self._group_set(replica, ev.group_idx).update(ev.block_hashes)
            else:
                self._group_set(replica, ev.group_idx).difference_update(ev.block_hashes)

    def _index_objects(self, replica: int, events) -> None:
        """:meth:`on_events` for the manager's event objects (``pagedkv.types``)."""
        from ..events import MEDIUM_GPU, hash_to_u64
        from ..types import AllBlocksCleared, BlockRemoved, BlockStored

        if isinstance(events, (BlockStored, BlockRemoved, AllBlocksCleared)):
            raise ValueError(f"events must be a list of events, got a single {type(events).__name__}")
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.held[replica].clear()
                self.held_groups[replica].clear()
                continue
            if not isinstance(ev, (BlockStored, BlockRemoved)):
                raise ValueError(f"not a KV event (BlockStored, BlockRemoved, AllBlocksCleared): "
                                 f"{type(ev).__name__}")
            if ev.medium not in (None, MEDIUM_GPU):
                continue
            if isinstance(ev, BlockStored):
                if ev.block_size != self.block_size:
                    raise ValueError(f"replica {self.names[replica]} stores blocks of {ev.block_size} tokens; "
                                     f"this router hashes blocks of {self.block_size}")
                self._group_set(replica, ev.group_idx).update(hash_to_u64(h) for h in ev.block_hashes)
            else:
                self._group_set(replica, ev.group_idx).difference_update(hash_to_u64(h) for h in ev.block_hashes)

    def blocks_held(self, replica: int, group: int = 0) -> frozenset:
        """The 64-bit hashes of the blocks the index says ``replica``'s group ``group`` holds."""
        return frozenset(self.held[replica] if not group else self.held_groups[replica].get(group, ()))

    # ---- lookups

    def match_blocks(self, request: Request | np.ndarray | Sequence[int]) -> list[int]:
        """Per replica, how many leading blocks of the prompt (a request, or its token ids) the
        index says it holds, counted as ``lookup`` counts hits (the last token never)."""
        from ..events import hash_to_u64

        tokens = prompt_array(request) if isinstance(request, Request) else np.asarray(request)
        if self.groups is not None:
            return self._match_hybrid(tokens)
        held = self.held
        match = [0] * len(held)
        bs = self.block_size
        usable = (len(tokens) - 1) // bs
        data = tokens.astype("<u4").tobytes()
        alive, parent, i, chunk = list(range(len(held))), self._root, 0, 32
        while i < usable and alive:
            take = min(chunk, usable - i)
            hashes = self._hasher.chain(parent, data[i * bs * 4:(i + take) * bs * 4], bs * 4, take)
            for h in hashes:
                u = hash_to_u64(h)
                still = [r for r in alive if u in held[r]]
                if len(still) < len(alive):
                    for r in alive:
                        match[r] = i  # the ones that drop out here keep i blocks
                alive = still
                if not alive:
                    break
                i += 1
            parent = hashes[-1]
            chunk *= 2  # a long match costs at most twice its own hashing
        for r in alive:
            match[r] = i
        return match

    def _match_hybrid(self, tokens: np.ndarray) -> list[int]:
        """``match_blocks`` under the hybrid hit rule: per replica the longest k (in
        blocks) such that every group holds, under its index, the blocks ``hit_blocks(k *
        block_size)`` names (a window only its last ones), as the grouped manager's ``lookup``."""
        from ..events import hash_to_u64

        bs = self.block_size
        usable = (len(tokens) - 1) // bs
        data = tokens.astype("<u4").tobytes()
        u = [hash_to_u64(h) for h in self._hasher.chain(self._root, data[: usable * bs * 4], bs * 4, usable)]
        match = []
        for r in range(len(self.held)):
            sets = [self.held[r] if not g else self.held_groups[r].get(g, set()) for g in range(len(self.groups))]
            k = usable
            for g, spec in enumerate(self.groups):
                if spec.reads_whole_prefix:
                    k = next((i for i in range(k) if u[i] not in sets[g]), k)
            ok = False
            while not ok:
                ok = True
                for g, spec in enumerate(self.groups):
                    miss = next((i for i in reversed(spec.hit_blocks(k * bs, bs)) if u[i] not in sets[g]), None)
                    if miss is not None:
                        k, ok = miss, False
                        break
            match.append(k)
        return match

    def imbalanced(self, loads: Sequence[int]) -> bool:
        """SGLang's test: ``max - min > balance_abs`` and ``max > balance_rel * min``."""
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo

    def route(self, request: Request, loads: Sequence[int]) -> int:
        if self.imbalanced(loads):
            self._count("guard")
            return _least_loaded(loads)
        match = self.match_blocks(request)
        best = max(match)
        if best == 0 or best * self.block_size <= self.cache_threshold * request.prompt_len:
            self._count("below_threshold")
            return _least_loaded(loads)
        self._count("affinity")
        return _least_loaded(loads, [i for i, m in enumerate(match) if m == best])

    def describe(self) -> str:
        return (f"precise (KV events; longest cached prefix if > {self.cache_threshold:g} of the prompt; "
                f"load guard: max - min > {self.balance_abs} and max > {self.balance_rel:g} x min)")


def make_router(name: str, *, vnodes: int = DEFAULT_VNODES, eps: float = DEFAULT_EPS, seed: int = 0,
                key_tokens: int = DEFAULT_KEY_TOKENS, block_size: int = 16, hash_algo: str = "sha256",
                balance_abs: int = SGLANG_BALANCE_ABS, balance_rel: float = SGLANG_BALANCE_REL,
                cache_threshold: float = SGLANG_CACHE_THRESHOLD, groups=None) -> Router:
    """A router by its name in :data:`ROUTERS`, configured by the keywords that apply to it
    (``groups``: the replicas' attention specs, for the precise router's hit rule)."""
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "ring":
        return RingRouter(vnodes, None, seed, key_tokens)
    if name == "ring-bounded":
        return RingRouter(vnodes, eps, seed, key_tokens)
    if name == "precise":
        return PrefixAwareRouter(block_size, hash_algo, balance_abs, balance_rel, cache_threshold, groups=groups)
    raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")
