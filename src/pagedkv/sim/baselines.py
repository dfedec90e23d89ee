"""The allocators a serving scheduler can drive: three reservation baselines and the paged cache.

Why real allocators: the vLLM paper's Fig. 2 compares how much KV memory holds token states
under Orca-style pre-allocation and under paging. Here each baseline is an allocator over the
*same* slots as the paged cache, so every category is counted from live state rather than assumed.
The baselines are the paper's (§6.1): each request reserves, at admission, one contiguous range per
sequence of

- **Max**: the model's maximum length (2,048 for OPT);
- **Pow2**: the prompt plus the true output length rounded up to a power of two (an output of 25
  reserves 32 positions: only the output is over-reserved, by less than 2x);
- **Oracle**: the prompt plus the true output length (it knows the future);

and the reservation is placed by the buddy algorithm (§6.1, §6.5), which itself rounds every
reservation up to a power of two (:class:`~pagedkv.sim.buddy.BuddyAllocator`, classic mode).
Worked example (prompt 100, output 25): Max reserves 2,048; Pow2 100 + 32 = 132 and holds 256;
Oracle 125 and holds 128. ``exact=True`` places reservations without the buddy rounding: an extra
model, not the paper's, kept for comparison only.

==========================  =================================================================
``token_states``            slots holding a running sequence's KV (paged: shared blocks once)
``reserved``                reserved slots the sequence will fill before it finishes
``internal_fragmentation``  slots the policy reserved beyond the request's true final length
                            (the paper's definition: Oracle has none), or (paged) the unused
                            tail of each last block
``external_fragmentation``  free slots that cannot serve the blocked head-of-queue request
                            (in buddy blocks too small for its reservation)
``free``                    every other free slot
``buddy_rounding``          slots the buddy holds beyond the policy's reservation (its rounding
                            up to a power of two; 0 for ``exact`` placement and for paging)
==========================  =================================================================

The six always sum to the capacity exactly (tests check it). The vLLM paper's Fig. 2 has four
categories: token states, reservation, internal fragmentation, and "external fragmentation &
others", which is the last three here together (:func:`paper_categories`). Worked example (Max,
2,048-slot reservations, 5,000 slots, so the buddy arena is 4,096 + 512 + 256 + 128 + 8): one
sequence at 300 of its final 500 tokens holds 300 token states, 200 reserved and 1,548 internal
fragmentation. A second reservation takes the other half of the 4,096 block; a third must wait,
and the 904 free slots, none in a block that can hold 2,048, are external fragmentation. Pow2
(prompt 100, output 25) reserves 132 and the buddy holds 256: 132 - 125 = 7 slots of internal
fragmentation and 256 - 132 = 124 of buddy rounding; Oracle reserves 125, holds 128: no internal
fragmentation, 3 slots of rounding.

Parallel sampling and beam search: a reservation baseline reserves every sequence separately
(no sharing: each sample or beam holds its own copy of the prompt). The paged adapter forks
through the real :class:`~pagedkv.KVCacheManager` and pays copy-on-write; for beam search it runs
:class:`BeamModel` to decide which beams survive each step.
"""
from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..checks import int_at_least, number_at_least, require
from ..manager import KVCacheManager
from ..types import OutOfBlocks, Usage
from .buddy import BuddyAllocator, order_for
from .request import Request, mix_tokens

__all__ = [
    "CATEGORIES",
    "Breakdown",
    "KVAllocator",
    "ReservationAllocator",
    "ManagerAllocator",
    "PagedAllocator",
    "BeamModel",
    "ALLOCATORS",
    "make_allocator",
    "generated_tokens",
    "pow2_ceil",
    "POLICY_NAMES",
    "PAPER_CATEGORIES",
    "paper_categories",
]

POLICY_NAMES = {"max": "Max", "pow2": "Pow2", "oracle": "Oracle"}
CATEGORIES = ("token_states", "reserved", "internal_fragmentation", "external_fragmentation", "free",
              "buddy_rounding")
# The vLLM paper's Fig. 2 categories; the last is this module's last three together.
PAPER_CATEGORIES = ("token_states", "reserved", "internal_fragmentation", "external_and_others")
ALLOCATORS = ("max", "pow2", "oracle", "paged")


@dataclass(frozen=True, slots=True)
class Breakdown:
    """Every slot of the KV memory in exactly one category (see the module table)."""

    token_states: int
    reserved: int
    internal_fragmentation: int
    external_fragmentation: int
    free: int
    buddy_rounding: int = 0

    @property
    def total(self) -> int:
        return (self.token_states + self.reserved + self.internal_fragmentation
                + self.external_fragmentation + self.free + self.buddy_rounding)

    def as_tuple(self) -> tuple[int, int, int, int, int, int]:
        return (self.token_states, self.reserved, self.internal_fragmentation,
                self.external_fragmentation, self.free, self.buddy_rounding)

    def shares(self) -> dict[str, float]:
        """Each category's share of the memory (sums to 1 up to float rounding)."""
        t = self.total
        return {k: (v / t if t else 0.0) for k, v in zip(CATEGORIES, self.as_tuple())}


def paper_categories(shares: dict[str, float]) -> dict[str, float]:
    """``shares`` (by :data:`CATEGORIES`) in the vLLM paper's four Fig. 2 categories: token states,
    reservation, internal fragmentation, and external fragmentation & others (buddy rounding,
    stranded and free slots together). Example: Oracle at 38 / 25 / 0 / 9 / 2 / 26 % becomes
    38 / 25 / 0 / 37 %."""
    missing = [k for k in CATEGORIES if k not in shares]
    if missing:
        raise KeyError(f"shares lack {missing}")
    return {"token_states": shares["token_states"], "reserved": shares["reserved"],
            "internal_fragmentation": shares["internal_fragmentation"],
            "external_and_others": shares["external_fragmentation"] + shares["free"] + shares["buddy_rounding"]}


def seq_key(seq_id: str) -> int:
    """A stable 64-bit content key for a sequence's generated tokens (same id -> same tokens)."""
    return int.from_bytes(hashlib.blake2b(seq_id.encode(), digest_size=8).digest(), "little")


def generated_tokens(keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Token ids generated at ``positions`` by the sequences keyed ``keys`` (elementwise, int64).

    A splitmix64 mix of ``(key, position)`` like :func:`~pagedkv.sim.request.segment_tokens`:
    deterministic, so a sequence recomputed after preemption produces the same tokens and finds
    its own blocks again in the prefix cache.
    """
    return mix_tokens(keys, positions).astype(np.int64)


class KVAllocator(ABC):
    """What the scheduler drives. ``capacity`` is the KV memory in token slots.

    ``admit(req, generated)`` places a request (its prompt plus ``generated`` tokens already
    produced before a preemption) and returns False with nothing changed when memory does not
    allow; ``step(req_ids)`` appends one token to every sequence of those requests (the paged
    cache may raise ``OutOfBlocks``, atomically); ``release(req_id)`` frees a finished or
    preempted request; ``breakdown(blocked)`` accounts every slot.

    Everything else the serving loop (:mod:`pagedkv.sim.scheduler`) asks has a default here
    that fits an allocator without it, so the loop calls every allocator the same way and never
    asks what kind it holds:

    - ``block_size`` / ``num_blocks`` / ``num_free_blocks``: the paging, for the fit check and
      the scheduler's watermark guard. A reservation places token slots: block size 1, and
      ``num_blocks`` 0, which keeps the watermark guard off (it counts blocks).
    - ``freeable_blocks(req_id)``: blocks preempting the request would free; None (the default)
      when it frees its whole range, as a reservation does.
    - ``swap_out`` / ``swap_in``: preemption by swapping; without a host tier ``swap_out``
      declines (False: the loop recomputes) and nothing is ever swapped out to bring back.
    - ``take_transfer_seconds(compute_s)``: what an iteration waits for its block transfers
      beyond its compute; 0.0 without a host link.
    - ``copies``: copy-on-write block copies so far (0 for an allocator that never shares).
    - ``coalesces``, ``max_steps(req_ids, limit)``, ``step_n(req_ids, n)``: many decode steps in
      one call, for :class:`~pagedkv.sim.scheduler.Server`'s ``coalesce=True``; by default
      memory allows no stretch (``max_steps`` 0) and ``coalesces`` is False.

    Worked example: a Max reservation allocator over 983 x 16 slots reports block size 1,
    ``num_blocks`` 0 and ``freeable_blocks`` None, so ``Guards(watermark=0.05)`` admits as without
    the guard and the ``skip_unfreeing`` guard takes its first victim; a paged one over 983
    blocks of 16 keeps ``int(0.05 x 983) = 49`` blocks free.
    """

    name: str = ""
    capacity: int = 0
    last_hit_tokens: int = 0  # prompt tokens served from a cache by the last admit
    block_size: int = 1  # tokens a block holds; 1 for an allocator that places token slots
    num_blocks: int = 0  # blocks the allocator pages; 0 when it places token slots (a reservation)
    copies: int = 0  # copy-on-write block copies so far
    coalesces: bool = False  # True: max_steps and step_n run many decode steps in one call

    @abstractmethod
    def admit(self, req: Request, generated: int = 0) -> bool: ...

    @abstractmethod
    def step(self, req_ids: Sequence[str]) -> int: ...

    @abstractmethod
    def release(self, req_id: str) -> None: ...

    @abstractmethod
    def num_seqs(self, req_id: str) -> int: ...

    @abstractmethod
    def breakdown(self, blocked: Request | None = None) -> Breakdown: ...

    @property
    @abstractmethod
    def kv_tokens(self) -> int:
        """Token states attention reads per step: the sum of running sequence lengths."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks free now (0 when the allocator does not page)."""
        return 0

    def freeable_blocks(self, req_id: str) -> int | None:
        """Blocks that preempting ``req_id`` would return to the free pool; None when the
        allocator frees a request's whole range (a reservation)."""
        return None

    def swap_out(self, req_id: str) -> bool:
        """Preempt by swapping the request to a host tier; False (nothing changed: the scheduler
        recomputes it instead) when the allocator cannot, as one without a host tier never can."""
        return False

    def swap_in(self, req_id: str) -> bool:
        """Bring a swapped-out request back; False when the device has no room yet. Only a
        request ``swap_out`` took can come back: ValueError for any other."""
        raise ValueError(f"request {req_id} is not swapped out")

    def prompt_blocks(self, num_tokens: int) -> int:
        """Blocks admitting ``num_tokens`` of prompt takes at once: ``ceil(num_tokens /
        block_size)``, or one per token for an allocator that places token slots; an allocator
        with several block tables per sequence takes that many per table (40 tokens in blocks of
        16: 3; with two attention groups, 6)."""
        num_tokens = int_at_least("num_tokens", num_tokens, 0)
        return -(-num_tokens // self.block_size)

    def take_transfer_seconds(self, compute_s: float = 0.0) -> float:
        """Drain this iteration's block transfers; the seconds the iteration waits for them
        beyond its ``compute_s`` of compute (0.0: nothing moves over a host link)."""
        return 0.0

    def max_steps(self, req_ids: Sequence[str], limit: int) -> int:
        """The most decode steps (at most ``limit``) memory allows all of ``req_ids`` to take in
        one :meth:`step_n`; 0 by default (no stretch: the scheduler steps one at a time)."""
        return 0

    def step_n(self, req_ids: Sequence[str], n: int) -> int:
        """``n`` decode steps of ``req_ids`` (the caller checked :meth:`max_steps`); by default
        ``step`` ``n`` times. Returns the tokens appended."""
        n = int_at_least("n", n, 0)
        return sum(self.step(req_ids) for _ in range(n))

    def sharing(self) -> tuple[int, int]:
        """(logical blocks, blocks saved by sharing) now; reservations share nothing."""
        return 0, 0

    def observe(self, blocked: Request | None = None) -> tuple[Breakdown, int, int]:
        """``breakdown(blocked)`` and ``sharing()`` together (one usage snapshot when paged)."""
        return (self.breakdown(blocked), *self.sharing())

    def usage(self) -> Usage | None:
        return None

    def check(self) -> None:
        """Raise AssertionError if internal state is inconsistent (used by tests)."""


# ---- reservation baselines --------------------------------------------------------------------


@dataclass
class _Reservation:
    offsets: list[int]
    size: int  # slots held per sequence (the buddy block: the policy's size rounded to 2**k)
    reserve: int  # slots the policy reserved per sequence (before the buddy's rounding)
    final: int  # true final length
    length: int  # current length


def pow2_ceil(n: int) -> int:
    """Smallest power of two >= ``n``, and 0 for 0: ``pow2_ceil(25) == 32``, ``pow2_ceil(32) == 32``."""
    n = int_at_least("n", n, 0)
    return 0 if n == 0 else 1 << order_for(n)


class ReservationAllocator(KVAllocator):
    """Orca-style pre-allocation: every sequence reserves one contiguous range at admission.

    ``policy`` (vLLM paper §6.1): ``"max"`` reserves ``max_len`` (Orca Max), ``"pow2"`` the prompt
    plus the output length rounded up to a power of two (capped at ``max_len``: the model never
    generates past it), ``"oracle"`` the prompt plus the true output length. The buddy allocator
    then holds the next power of two of that reservation (classic placement, the paper's
    assumption). Example with ``max_len=2048`` and a 161 + 338 = 499-token request: 2,048 /
    161 + 512 = 673 / 499 slots reserved, holding 2,048 / 1,024 / 512; when it finishes, Max has
    wasted 1,549 slots on internal fragmentation (reserved beyond the true length), Pow2 174 (and
    351 of buddy rounding), Oracle none (13 of buddy rounding).

    ``exact=True`` (not the paper's model; an extra for comparison) holds exactly the reservation
    and gives the rest of the power-of-two block back to the free lists at once.

    A reservation never runs out mid-request, so a decode-only stretch needs no memory check:
    ``max_steps`` allows every step up to the first sequence's final length and ``step_n`` adds
    ``n`` tokens to each (``Server(coalesce=True)`` runs such a stretch in one call).
    """

    coalesces = True  # max_steps and step_n below

    def __init__(self, capacity: int, policy: str, max_len: int = 2048, exact: bool = False) -> None:
        if policy not in ("max", "pow2", "oracle"):
            raise ValueError(f"policy must be max, pow2 or oracle, got {policy!r}")
        max_len = int_at_least("max_len", max_len, 1)
        self.buddy = BuddyAllocator(capacity, exact=exact)
        self.capacity = capacity
        self.policy = policy
        self.max_len = max_len
        self.exact = exact
        self.name = POLICY_NAMES[policy] + (" (exact buddy)" if exact else "")
        self._reqs: dict[str, _Reservation] = {}
        self._tokens = self._reserved = self._internal = self._rounding = 0
        self._last_size: tuple[Request | None, int] = (None, 0)

    def reserve_size(self, req: Request) -> int:
        """Slots the policy reserves for each of the request's sequences (before the buddy's
        rounding; :meth:`held_size` is what the buddy then holds). Prompt 100, output 25: Max
        2,048, Pow2 132, Oracle 125."""
        last = self._last_size
        if last[0] is req:  # the waiting head is asked about every step
            return last[1]
        size = self._reserve_size(req)
        self._last_size = (req, size)
        return size

    def _reserve_size(self, req: Request) -> int:
        final = req.total_len
        if final > self.max_len:
            raise ValueError(f"request {req.req_id}: final length {final} > max_len {self.max_len}")
        if self.policy == "max":
            return self.max_len
        if self.policy == "pow2":
            return min(req.prompt_len + pow2_ceil(req.output_len), self.max_len)
        return final

    def held_size(self, req: Request) -> int:
        """Slots each of the request's sequences holds once placed: the reservation rounded up to a
        power of two (classic buddy), or the reservation itself (``exact``). Prompt 100, output 25:
        Max 2,048, Pow2 256, Oracle 128."""
        size = self.reserve_size(req)
        return size if self.exact else 1 << order_for(size)

    def admit(self, req: Request, generated: int = 0) -> bool:
        if req.req_id in self._reqs:
            raise ValueError(f"request {req.req_id} is already admitted")
        if not 0 <= generated <= req.output_len:
            raise ValueError(f"generated must be in [0, {req.output_len}], got {generated}")
        size = self.reserve_size(req)
        offsets = []
        for _ in range(req.num_seqs):
            off = self.buddy.alloc(size)
            if off is None:
                for o in offsets:
                    self.buddy.free(o)
                return False
            offsets.append(off)
        held = self.buddy.size_of(offsets[0])  # == self.held_size(req)
        r = _Reservation(offsets, held, size, req.total_len, req.prompt_len + generated)
        self._reqs[req.req_id] = r
        self._add(r, +1)
        self.last_hit_tokens = 0
        return True

    def _add(self, r: _Reservation, sign: int) -> None:
        n = len(r.offsets)
        self._tokens += sign * n * r.length
        self._reserved += sign * n * (r.final - r.length)
        self._internal += sign * n * (r.reserve - r.final)
        self._rounding += sign * n * (r.size - r.reserve)

    def step(self, req_ids: Sequence[str]) -> int:
        reqs = [self._reqs[i] for i in req_ids]
        for r in reqs:  # checked before anything changes: a failing step changes nothing
            if r.length >= r.final:
                raise ValueError("a request in the step has already reached its final length")
        n = 0
        for r in reqs:
            r.length += 1
            n += len(r.offsets)
        self._tokens += n
        self._reserved -= n
        return n

    def max_steps(self, req_ids: Sequence[str], limit: int) -> int:
        """``limit``, or fewer when a sequence reaches its final length first: the reservation
        holds every slot those steps write. Two requests 5 and 9 tokens from their end, limit 7: 5."""
        return max(0, min([limit] + [self._reqs[i].final - self._reqs[i].length for i in req_ids]))

    def step_n(self, req_ids: Sequence[str], n: int) -> int:
        """``n`` decode steps of ``req_ids`` at once; ValueError, with nothing changed, when one
        would pass its final length. Returns the tokens appended."""
        n = int_at_least("n", n, 0)
        reqs = [self._reqs[i] for i in req_ids]
        if any(r.length + n > r.final for r in reqs):
            raise ValueError(f"{n} steps would take a request past its final length")
        tokens = 0
        for r in reqs:
            r.length += n
            tokens += n * len(r.offsets)
        self._tokens += tokens
        self._reserved -= tokens
        return tokens

    def release(self, req_id: str) -> None:
        r = self._reqs.pop(req_id)
        for off in r.offsets:
            self.buddy.free(off)
        self._add(r, -1)

    def num_seqs(self, req_id: str) -> int:
        return len(self._reqs[req_id].offsets)

    @property
    def kv_tokens(self) -> int:
        return self._tokens

    def breakdown(self, blocked: Request | None = None) -> Breakdown:
        free = self.buddy.free_slots
        ext = self.buddy.unusable_free(self.reserve_size(blocked)) if blocked is not None else 0
        return Breakdown(self._tokens, self._reserved, self._internal, ext, free - ext, self._rounding)

    def check(self) -> None:
        self.buddy.check()
        held = sum(len(r.offsets) * r.size for r in self._reqs.values())
        assert held == self.buddy.allocated_slots, (held, self.buddy.allocated_slots)
        assert self._tokens + self._reserved + self._internal + self._rounding == held


# ---- beam search model ------------------------------------------------------------------------


class BeamModel:
    """Which beams survive a beam-search step: a seeded stand-in for a language model.

    Each live beam's next-token distribution is a draw from a symmetric Dirichlet(``alpha``)
    over ``vocab`` candidates (``alpha`` < 1 makes it peaked, as a trained model's is); each beam
    offers its ``width`` most likely tokens, scored by the beam's cumulative log-probability plus
    the token's; the ``width`` best of all candidates survive (standard beam search, no length
    penalty, no early stop). A beam with no surviving candidate is freed; one with k survivors
    continues and is forked k - 1 times. The first step expands the prompt alone into ``width``
    beams. Example (width 2): beams A (-1.0), B (-1.2) offer A+x (-1.1), A+y (-2.0), B+z (-1.5),
    B+w (-3.0) -> survivors A+x, B+z: no fork. If A's top two were -1.1 and -1.3, both survivors
    descend from A: B is freed and A forked once; that is what makes beams share long prefixes.
    """

    def __init__(self, seed: int = 0, alpha: float = 0.3, vocab: int = 32) -> None:
        number_at_least("alpha", alpha, 0.0, strict=True)
        vocab = int_at_least("vocab", vocab, 2)
        self.rng = np.random.default_rng(seed)
        self.alpha = alpha
        self.vocab = vocab

    def select(self, scores: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """``(parents, new_scores)``: for each of the ``width`` survivors, its parent beam index
        (sorted ascending) and its cumulative score."""
        return self.select_many([scores], [width])[0]

    def select_many(self, scores: list[np.ndarray], widths: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`select` for several requests at once (one vectorised draw for all their beams)."""
        if len(scores) != len(widths) or any(w < 1 for w in widths):
            raise ValueError("need one width >= 1 per score array")
        if not scores:
            return []
        rows = [len(s) for s in scores]
        g = self.rng.standard_gamma(self.alpha, size=(sum(rows), self.vocab))  # Dirichlet draws
        kmax = min(max(widths), self.vocab)
        top = g if kmax == self.vocab else -np.partition(-g, kmax - 1, axis=1)[:, :kmax]
        top = -np.sort(-top, axis=1)  # the kmax largest draws of each row, largest first
        with np.errstate(divide="ignore"):
            logp = np.log(top) - np.log(g.sum(axis=1, keepdims=True))
        out, i = [], 0
        for s, w, r in zip(scores, widths, rows):
            k = min(w, self.vocab)
            cand = (s[:, None] + logp[i : i + r, :k]).ravel()
            best = np.argsort(-cand, kind="stable")[:w]
            best.sort()
            out.append((best // k, cand[best]))
            i += r
        return out


# ---- the paged cache ------------------------------------------------------------------------


class _PagedReq:
    __slots__ = ("req", "seqs", "keys", "length", "scores", "reorg_at", "next_child")

    def __init__(self, req: Request, seqs: list[str], length: int) -> None:
        self.req = req
        self.seqs = seqs
        self.keys = [seq_key(s) for s in seqs]
        self.length = length
        self.scores = np.zeros(1)
        self.reorg_at = -1  # length at which the beams were last reorganised
        self.next_child = 1


class ManagerAllocator(KVAllocator):
    """An allocator over a real :class:`~pagedkv.KVCacheManager` (``self.m``): the paged
    allocators of the simulator (this module's, :mod:`~pagedkv.sim.samples`' and
    :mod:`~pagedkv.sim.fleet`'s). It owns what they share: the manager and its sizes, the
    admission rule (a prompt is admitted when ``watermark_blocks`` stay free after it, or when
    nothing else runs), the count of token states their running sequences hold
    (``_kv_tokens``), copy-on-write copies, the slot breakdown (paged memory has no reservations
    and no external fragmentation: any free block serves any request), sharing, the
    freeable-block count of a victim, and the consistency check.

    A subclass names its requests' sequences (``seq_ids``) and keeps its own per-request state.
    Worked example: ``PagedAllocator(983, 16)`` holds 15,728 slots and keeps
    ``int(0.01 x 983) = 9`` blocks free at admission while something runs.
    """

    m: KVCacheManager
    _kv_tokens: int = 0

    def __init__(self, num_blocks: int, block_size: int, *, name: str, watermark: float,
                 enable_prefix_caching: bool = True, hash_algo: str = "sha256", enable_events: bool = False,
                 host_blocks: int = 0, host_write_policy: str = "write-back", groups=None) -> None:
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        self.m = KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                                hash_algo=hash_algo, enable_events=enable_events, host_blocks=host_blocks,
                                host_write_policy=host_write_policy, groups=groups)
        self.num_groups = self.m.num_groups
        self.name = name
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.capacity = num_blocks * block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self._kv_tokens = 0
        self.copies = 0

    @abstractmethod
    def seq_ids(self, req_id: str) -> list[str]:
        """The manager's ids of the request's live sequences."""

    @property
    def kv_tokens(self) -> int:
        """Token states the running sequences hold (a block shared by two counts twice: attention
        reads it for each)."""
        return self._kv_tokens

    @property
    def num_free_blocks(self) -> int:
        """The manager's free blocks, cached-free prefix blocks included (they are evictable)."""
        return self.m.num_free_blocks

    def usage(self) -> Usage:
        """The manager's usage snapshot (prefix hits, sharing, copy-on-write, forks)."""
        return self.m.usage()

    def prompt_blocks(self, num_tokens: int) -> int:
        """Blocks admitting ``num_tokens`` of prompt takes: a block per ``block_size`` positions in
        every attention group. A grouped manager admits a whole prompt with every position in
        every group (the prompt's queries read back into each window) and releases what a window
        no longer reads at the sequence's next call, so admission needs the whole prompt once per
        group. 40 tokens in blocks of 16: 3 blocks; with gpt-oss's two groups, 6."""
        return super().prompt_blocks(num_tokens) * self.num_groups

    def room_for(self, num_tokens: int, busy: bool) -> bool:
        """The admission rule: ``num_tokens`` of prompt fit (:meth:`prompt_blocks`) with
        ``watermark_blocks`` left free, or nothing else runs (``busy`` False: a lone request is
        always tried, so that a prompt larger than the watermark allows can still run alone).
        40 tokens in blocks of 16 need 3 (6 with two groups)."""
        return not busy or self.m.num_free_blocks >= self.prompt_blocks(num_tokens) + self.watermark_blocks

    def add_tokens(self, seq_id: str, tokens) -> bool:
        """Add a sequence with ``tokens`` (a prompt, plus what it generated before a preemption),
        finding what the prefix cache holds (``last_hit_tokens``); False, with nothing changed,
        when the manager runs out of blocks."""
        try:
            self.last_hit_tokens = self.m.add_sequence(seq_id, tokens)
        except OutOfBlocks:  # nothing changed
            return False
        return True

    def append_generated(self, entries: Sequence) -> int:
        """One decode step: append to every sequence of ``entries`` (each with ``seqs``, their
        generation ``keys`` and the common ``length``) its next generated token, in one
        ``append_batch``, and count the copy-on-write copies it scheduled. Returns the tokens
        appended; ``OutOfBlocks`` (atomic: nothing changed) when the blocks run out, and the
        scheduler preempts and retries. The caller advances each entry's ``length``."""
        ids: list[str] = []
        keys: list[int] = []
        pos: list[int] = []
        for e in entries:
            ids += e.seqs
            keys += e.keys
            pos += [e.length] * len(e.seqs)
        toks = generated_tokens(np.array(keys, dtype=np.uint64), np.array(pos, dtype=np.uint64))
        self.m.append_batch(ids, toks)
        self.copies += len(self.m.take_copies())
        self._kv_tokens += len(ids)
        return len(ids)

    def freeable_blocks(self, req_id: str) -> int:
        """Blocks that preempting ``req_id`` would return to the free pool, read from the manager.

        A block is freed when every reference to it is the request's own: its refcount equals the
        number of the request's block tables that hold it (1 for a single sequence). A fork that
        has not written yet shares all its blocks with its parent: 0. With attention groups every
        group's table counts, less the entries a window released (they read -1).
        """
        m = self.m
        held: Counter = Counter()
        for sid in self.seq_ids(req_id):
            if self.num_groups == 1:
                held.update(m.block_table(sid))
            else:
                for g in range(self.num_groups):
                    held.update(b for b in m.block_table(sid, group=g) if b >= 0)
        return sum(1 for block, refs in held.items() if m.refcount(block) == refs)

    def breakdown(self, blocked: Request | None = None) -> Breakdown:
        return self.observe(blocked)[0]

    def observe(self, blocked: Request | None = None) -> tuple[Breakdown, int, int]:
        """Token states, the unused tails of last blocks (internal fragmentation) and free slots
        (cached-free prefix blocks count as free: they are evictable), from one usage snapshot,
        with the logical blocks and the blocks sharing saves."""
        u = self.m.usage()
        bd = Breakdown(u.stored_tokens, 0, u.allocated_slots - u.stored_tokens, 0,
                       self.capacity - u.allocated_slots)
        return bd, u.used_blocks + u.blocks_saved_by_sharing, u.blocks_saved_by_sharing

    def sharing(self) -> tuple[int, int]:
        return self.observe()[1:]

    def check(self) -> None:
        """The manager's invariants, and the token states counted here are the manager's."""
        self.m.check_invariants()
        require(self._kv_tokens == self.m.usage().logical_tokens,
                f"{self.name}: {self._kv_tokens} token states counted, the manager holds "
                f"{self.m.usage().logical_tokens}")


def recomputed_prompt(req: Request, seq_id: str, generated: int) -> list[int]:
    """What a (re)admission prefills: the prompt, plus the ``generated`` tokens the sequence
    ``seq_id`` produced before a preemption (the same tokens again: they are a function of the
    sequence and position, :func:`generated_tokens`). A 40-token prompt readmitted after 3
    tokens: 43 tokens."""
    prompt = req.prompt_tokens()
    if generated:
        pos = np.arange(req.prompt_len, req.prompt_len + generated)
        prompt += generated_tokens(np.full(generated, seq_key(seq_id), dtype=np.uint64), pos).tolist()
    return prompt


class PagedAllocator(ManagerAllocator):
    """The real :class:`~pagedkv.KVCacheManager` behind the allocator interface.

    Admission allocates the prompt only (``add_sequence``; a preempted single-sequence request
    comes back with its generated tokens appended to the prompt, as vLLM's recompute does, and
    finds them in the prefix cache when they were not evicted). Parallel sampling forks the
    prompt ``n - 1`` times at admission; beam search forks and frees per :class:`BeamModel`.
    ``watermark`` keeps that share of blocks free at admission (vLLM's default is 1%) so a
    freshly admitted batch does not preempt at its first step.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 hash_algo: str = "sha256", watermark: float = 0.01, beam_seed: int = 0, *,
                 groups=None, name: str = "paged") -> None:
        super().__init__(num_blocks, block_size, name=name, watermark=watermark,
                         enable_prefix_caching=enable_prefix_caching, hash_algo=hash_algo, groups=groups)
        self._start_requests(beam_seed)

    def _start_requests(self, beam_seed: int) -> None:
        """The request state on top of the manager (also a tiered subclass's, whose manager
        has a host tier)."""
        self.beams = BeamModel(beam_seed)
        self._reqs: dict[str, _PagedReq] = {}

    def admit(self, req: Request, generated: int = 0) -> bool:
        if req.req_id in self._reqs:
            raise ValueError(f"request {req.req_id} is already admitted")
        if not 0 <= generated <= req.output_len or (generated and req.num_seqs > 1):
            raise ValueError(f"generated must be in [0, {req.output_len}] (0 for n > 1 / beams)")
        m = self.m
        root = f"{req.req_id}.0"
        if not self.room_for(req.prompt_len + generated, bool(self._reqs)):
            return False
        if not self.add_tokens(root, recomputed_prompt(req, root, generated)):
            return False
        seqs = [root] + [f"{req.req_id}.{i}" for i in range(1, req.n)]
        for child in seqs[1:]:
            m.fork(root, child)
        st = _PagedReq(req, seqs, req.prompt_len + generated)
        st.next_child = len(seqs)
        self._reqs[req.req_id] = st
        self._kv_tokens += len(seqs) * st.length
        return True

    def _reorganise_beams(self, st: _PagedReq, parents: np.ndarray, scores: np.ndarray) -> None:
        """One beam-search selection: free losing beams, fork the winners that won twice or more."""
        st.scores = scores
        if len(parents) == len(st.seqs) and (parents == np.arange(len(parents))).all():
            st.reorg_at = st.length  # every beam continues itself: nothing forked or freed
            return
        counts = np.bincount(parents, minlength=len(st.seqs))
        seqs, keys = [], []
        for i, c in enumerate(counts.tolist()):
            if c == 0:
                self.m.free(st.seqs[i])
        for i, c in enumerate(counts.tolist()):
            for j in range(c):
                if j == 0:
                    seqs.append(st.seqs[i])
                    keys.append(st.keys[i])
                else:
                    child = f"{st.req.req_id}.{st.next_child}"
                    st.next_child += 1
                    self.m.fork(st.seqs[i], child)
                    seqs.append(child)
                    keys.append(seq_key(child))
        self._kv_tokens += (len(seqs) - len(st.seqs)) * st.length
        st.seqs, st.keys = seqs, keys
        st.reorg_at = st.length

    def step(self, req_ids: Sequence[str]) -> int:
        sts = [self._reqs[r] for r in req_ids]
        beams = [st for st in sts if st.req.beam_width > 1 and st.reorg_at != st.length]
        if beams:
            picks = self.beams.select_many([st.scores for st in beams], [st.req.beam_width for st in beams])
            for st, (parents, scores) in zip(beams, picks):
                self._reorganise_beams(st, parents, scores)
        appended = self.append_generated(sts)
        for st in sts:
            st.length += 1
        return appended

    def release(self, req_id: str) -> None:
        st = self._reqs.pop(req_id)
        for s in reversed(st.seqs):
            self.m.free(s)
        self._kv_tokens -= len(st.seqs) * st.length

    def num_seqs(self, req_id: str) -> int:
        st = self._reqs[req_id]
        return max(len(st.seqs), st.req.num_seqs)

    def seq_ids(self, req_id: str) -> list[str]:
        """The manager's ids of the request's live sequences (its samples or surviving beams)."""
        return list(self._reqs[req_id].seqs)


def make_allocator(name: str, num_blocks: int, block_size: int = 16, max_len: int = 2048,
                   *, exact: bool = False, **paged_kw) -> KVAllocator:
    """An allocator by name over ``num_blocks x block_size`` slots of KV memory.

    ``make_allocator("max", 983, 16)`` is Orca Max over the vLLM paper's 15,728 OPT-13B slots.
    ``exact=True`` (reservations only) places without the buddy's rounding, an extra that is not
    the paper's model; ``paged_kw`` go to :class:`PagedAllocator`.
    """
    if name not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}, got {name!r}")
    num_blocks = int_at_least("num_blocks", num_blocks, 1)
    block_size = int_at_least("block_size", block_size, 1)
    if name == "paged":
        if exact:
            raise ValueError("exact=True applies to the reservation baselines (max, pow2, oracle), not paged")
        return PagedAllocator(num_blocks, block_size, **paged_kw)
    if paged_kw:
        raise ValueError(f"{', '.join(sorted(paged_kw))} apply to the paged allocator only, not {name}")
    return ReservationAllocator(num_blocks * block_size, name, max_len, exact=exact)
