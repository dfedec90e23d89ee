"""The step loop: requests over time, chunked prefill, speculative decoding, preemption.

Each :meth:`StepLoop.step` spends at most ``token_budget`` query tokens, first on running
sequences (their last token, plus drafts when speculating), then on the next chunks of prompts
mid-prefill, then on admitting waiting requests, and runs one forward over all of them through
the executor. When blocks run short, the most recently admitted request without work in the step
is preempted: recomputed (freed and queued again) or, with ``preemption="swap"``, swapped out to
the host tier. Worked example (budget 16, block size 16, a 40-token prompt arriving alone): step 0
computes positions 0-16, step 1 16-32, step 2 32-40 and chooses the first token, step 3 decodes.

Owns the requests and their sequences' places: the waiting queue (sorted by arrival), the prompts
mid-prefill, the running and the swapped-out sequences, the step clock and the id counters. May
import numpy, :mod:`pagedkv.checks`, :mod:`pagedkv.types` and the package's executor and
records; it reaches the manager through its public calls only.
"""
from __future__ import annotations

import bisect
import itertools
import sys
from dataclasses import dataclass, field
from typing import Any, Hashable

import numpy as np

from ..checks import int_at_least
from ..types import OutOfBlocks
from .executor import Executor, new_tag, pick_token
from .records import LiveSequence, RequestResult, Sample, StepOutput

__all__ = ["StepLoop"]


@dataclass
class StepRequest:
    """A request of the step loop, from ``add`` until its samples finish."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    arrival: int  # the first step it may be admitted in
    temperature: float
    stream: tuple[int, int]  # sample k draws from default_rng([*stream, k])
    n: int
    cache_salt: Any
    seq: Hashable = None  # the prompt's sequence, once admitted
    hit: int = 0
    done: int = 0  # prompt positions scheduled; after the step's forward, computed
    order: int = -1  # admission serial (the latest admitted is preempted first); -1 waiting
    samples: list = field(default_factory=list)  # finished samples by index, None while running


@dataclass
class StepWork:
    """One sequence's share of a step: its query tokens, their slots, its length after them."""

    seq: Hashable
    feed: list[int]
    slots: np.ndarray
    length: int  # positions attention sees (the sequence's scheduled length after this step)
    req: StepRequest | None = None  # set for a prompt chunk
    drafts: list[int] = field(default_factory=list)
    proposed: bool = False  # the speculator proposed for this sequence this step
    joint: bool = False  # the last token was scheduled with the drafts, as a draft: accept it too


class StepLoop:
    """The engine's scheduler and its requests; see the module docstring and :class:`Engine`'s
    ``add_request`` / ``step`` / ``abort`` / ``preempt``, which call ``add`` / ``step`` /
    ``abort`` / ``preempt`` here after checking their arguments.

    The options are the engine's, checked there: ``token_budget`` and ``chunk_size`` (None: no
    limit), ``speculator`` (None or a drafter), ``publish_at_admission`` (the chunked prefill's
    negative control) and ``preemption`` (``"recompute"`` or ``"swap"``).
    """

    def __init__(self, executor: Executor, *, token_budget: int | None, chunk_size: int | None,
                 speculator: Any, publish_at_admission: bool, preemption: str) -> None:
        self.ex, self.manager = executor, executor.manager
        self.token_budget = token_budget
        self.chunk_size = chunk_size
        self.speculator = speculator
        self.publish_at_admission = publish_at_admission
        self.preemption = preemption
        self._tag = new_tag()
        self._clock = 0
        self._rids = itertools.count()
        self._admissions = itertools.count()
        self._step_serial = itertools.count()
        self._waiting: list[tuple[int, int, StepRequest]] = []  # (arrival, rid, request), sorted
        self._prefilling: list[StepRequest] = []  # admitted, prompt not fully computed; admission order
        self._running: dict[Hashable, LiveSequence] = {}  # decoding sequences
        self._swapped: dict[Hashable, LiveSequence] = {}  # decoding sequences on the host tier, oldest first
        self._requests: dict[int, StepRequest] = {}  # every unfinished request

    def add(self, prompt, max_new_tokens, temperature, n, cache_salt, arrival, stream) -> int:
        """Queue a request whose generation arguments the engine checked; returns its id.

        ``arrival`` None means the next step; sample ``k`` draws from ``default_rng([*stream,
        k])``. The prompt and salt are checked here by the side-effect-free ``lookup``."""
        if self.speculator is not None and temperature:
            raise ValueError("speculative decoding here verifies greedily: use temperature 0")
        if arrival is None:
            arrival = self._clock
        arrival = int_at_least("arrival", arrival, 0)
        self.manager.lookup(prompt, cache_salt)  # validates tokens and salt, changes nothing
        prompt = [int(t) for t in prompt]
        rid = next(self._rids)
        req = StepRequest(rid, prompt, max_new_tokens, arrival, temperature, stream, n, cache_salt)
        self._requests[rid] = req
        bisect.insort(self._waiting, (req.arrival, rid, req), key=lambda e: e[:2])
        return rid

    @property
    def clock(self) -> int:
        """The next step's number."""
        return self._clock

    def has_unfinished(self) -> bool:
        """Any request waiting, prefilling, decoding or swapped out."""
        return bool(self._requests)

    def abort(self, request: int) -> None:
        """Drop a request and free its sequences (``KeyError`` for an unknown or finished id)."""
        req = self._requests.pop(request)  # KeyError: unknown or finished
        self._waiting = [e for e in self._waiting if e[1] != request]
        # between steps every scheduled position was computed, except under the control
        cache = not self.publish_at_admission
        if req in self._prefilling:
            self._prefilling.remove(req)
            self.ex.free(req.seq, cache=cache)
        for seq in self._seqs_of(request):
            self._release(seq)

    def preempt(self, request: int) -> str:
        """See :meth:`Engine.preempt`: ``"swap"`` or ``"recompute"``; ``KeyError`` or ``ValueError``
        (waiting, or swapped out whole) when there is nothing on the device to preempt."""
        req = self._requests[request]  # KeyError: unknown or finished
        if req.seq is None:
            raise ValueError(f"request {request} is waiting: it holds no blocks to preempt")
        if not self._on_device(req):
            raise ValueError(f"request {request} is swapped out already")
        out = StepOutput(self._clock)
        self._preempt(req, out)
        return "swap" if out.swapped_out else "recompute"

    def step(self) -> StepOutput:
        """One step within the token budget, run as one forward; see :meth:`Engine.step` for the
        order, preemption, ``OutOfBlocks`` and the drop-all on a failed forward."""
        out = StepOutput(self._clock)
        work = self._schedule(out)
        if not work:
            if (self._running or self._prefilling or self._swapped
                    or (self._waiting and self._waiting[0][0] <= self._clock)):
                raise OutOfBlocks(1, self.manager.num_free_blocks, f"step {self._clock}: no request fits")
            self._clock += 1
            self.ex.stats.idle_steps += 1
            return out
        try:
            rows = self.ex.forward_rows([w.seq for w in work], [w.feed for w in work],
                                      np.concatenate([w.slots for w in work]), [w.length for w in work])
        except BaseException:
            self._drop_all(cache=False)
            raise
        self._clock += 1
        out.transfers = self.ex.step_transfers
        self._account(out)
        for w, r in zip(work, rows):
            if w.req is not None:
                self._chunk_done(w.req, r, out)
            else:
                self._verify(w, r, out)
        return out

    def _account(self, out: StepOutput) -> None:
        st = self.ex.stats
        st.prefill_tokens += out.prefill_tokens
        st.prefill_chunks += len(out.prefill)
        st.decode_tokens += out.decode_tokens
        st.max_step_tokens = max(st.max_step_tokens, out.tokens)
        st.mixed_steps += bool(out.prefill and out.decode_tokens)

    def _schedule(self, out: StepOutput) -> list[StepWork]:
        budget = sys.maxsize if self.token_budget is None else self.token_budget
        work: list[StepWork] = []
        scheduled: set[int] = set()  # requests with work in this step: never preempted in it
        if self._swapped:
            self._swap_in_ready(scheduled, out)
        budget, short = self._schedule_decodes(work, budget, out, scheduled)
        for req in list(self._prefilling):
            if budget < 1:
                break
            if req not in self._prefilling:  # preempted for an earlier request's chunk
                continue
            w = self._next_chunk(req, budget)
            while w is None and self._preempt_for(req, scheduled, out):
                w = self._next_chunk(req, budget)
            if w is None:
                short = True
                continue
            work.append(w)
            scheduled.add(req.rid)
            out.prefill.append((req.rid, w.length - len(w.feed), w.length))
            budget -= len(w.feed)
        short = short or bool(out.preempted or out.swapped_out)
        # swapped-out requests were admitted first: no new admission while one waits to come back
        while (not short and not self._swapped and budget >= 1 and self._waiting
               and self._waiting[0][0] <= self._clock):
            w = self._admit(self._waiting[0][2], budget, out)
            if w is None:
                break
            self._waiting.pop(0)
            work.append(w)
            budget -= len(w.feed)
        return work

    def _schedule_decodes(self, work: list[StepWork], budget: int, out: StepOutput,
                          scheduled: set[int]) -> tuple[int, bool]:
        """Each running sequence's last token (and drafts), in order, while budget lasts.

        Returns the budget left and whether a sequence had to wait for a block."""
        m, spec = self.manager, self.speculator
        wants: dict[Hashable, int] = {}  # drafts each sequence may verify this step
        left = budget
        for seq, lv in self._running.items():
            if left < 1:
                break
            k = 0
            if spec is not None:
                room = self._requests[lv.req].max_new_tokens - len(lv.sample.tokens) - 1
                k = max(0, min(spec.num_drafts, room, left - 1))
            wants[seq] = k
            left -= 1 + k
        proposals = {}
        if spec is not None and any(wants.values()):
            proposals = spec.propose([(seq, self._context(seq), k) for seq, k in wants.items() if k])
        short = False
        for seq, k in wants.items():  # the allotment fits the budget: 1 + k tokens each at most
            if seq not in self._running:  # its request was preempted for an earlier one
                if seq in proposals:  # swapped out with a proposal pending: drop the drafts
                    spec.settle(seq, 0)
                continue
            lv = self._running[seq]
            drafts = [int(t) for t in proposals.get(seq, ())][:k]
            joint = False
            if drafts and self.ex.releases:
                # one call: a grouped manager releases, at each call, what the committed count
                # lets go; a second call this step would count the last token as run and
                # release the block its query still reads (window W: position p reads p-W+1)
                try:
                    slots = list(m.append_tokens(seq, [lv.sample.tokens[-1]] + drafts, speculative=True))
                    joint = True
                except OutOfBlocks:  # no room for drafts: a plain decode step
                    drafts = []
            if not joint:
                slot = self._append_or_preempt(seq, lv.sample.tokens[-1], lv.req, scheduled, out)
                if slot is None:
                    short = True
                    if seq in proposals:
                        spec.settle(seq, 0)
                    continue
                slots = [slot]
                if drafts:
                    try:
                        slots += m.append_tokens(seq, drafts, speculative=True)
                    except OutOfBlocks:  # no room for drafts: a plain decode step
                        drafts = []
            scheduled.add(lv.req)
            work.append(StepWork(seq, [lv.sample.tokens[-1]] + drafts, np.asarray(slots, dtype=np.int64),
                              m.num_computed(seq), drafts=drafts, proposed=seq in proposals, joint=joint))
            out.decode_tokens += 1 + len(drafts)
            out.draft_tokens += len(drafts)
            budget -= 1 + len(drafts)
        return budget, short

    def _append_or_preempt(self, seq, tok, rid, scheduled, out) -> int | None:
        """``append_token``, preempting later requests while blocks are short; None if it waits."""
        while True:
            try:
                return self.manager.append_token(seq, tok)
            except OutOfBlocks:
                if not self._preempt_for(self._requests[rid], scheduled, out):
                    return None

    def _preempt_for(self, req: StepRequest, scheduled: set[int], out: StepOutput) -> bool:
        """Preempt the most recently admitted request that has no work in this step (not
        ``req``); False if none. Requests with sequences on the device go first; one swapped out
        whole is restarted only when nothing else is left (that frees the device blocks its
        sequences share). See :meth:`_preempt`."""
        victims = [r for r in self._requests.values()
                   if r.seq is not None and r is not req and r.rid not in scheduled]
        if not victims:
            return False
        on_device = [r for r in victims if self._on_device(r)]
        self._preempt(max(on_device or victims, key=lambda r: r.order), out)
        return True

    def _preempt(self, victim: StepRequest, out: StepOutput) -> None:
        """Recompute preemption frees the victim's blocks and queues it again: it restarts from
        its prompt, as vLLM's recompute preemption does. Its blocks stay cached, so the restart
        mostly hits them, and its samples come out the same (greedy, or the same seeded streams).
        Swap preemption (``preemption="swap"``) moves its decoding sequences to the host tier
        instead, falling back to recompute when it cannot (see :meth:`_swap_out`)."""
        if self.preemption == "swap":
            if self._swap_out(victim, out):
                return
            self.ex.stats.swap_fallbacks += 1
        self._restart(victim)
        out.preempted.append(victim.rid)
        self.ex.stats.preemptions += 1

    def _on_device(self, req: StepRequest) -> bool:
        """Whether an admitted request has a sequence that is not swapped out."""
        return req in self._prefilling or any(lv.req == req.rid for lv in self._running.values())

    def _seqs_of(self, rid: int) -> list[Hashable]:
        """A request's decoding sequences, running or swapped out."""
        return ([s for s, lv in self._running.items() if lv.req == rid]
                + [s for s, lv in self._swapped.items() if lv.req == rid])

    def _swap_out(self, victim: StepRequest, out: StepOutput) -> bool:
        """Swap every running sequence of ``victim`` out to the host tier; False (nothing
        changed) when it cannot: a prompt mid-prefill (the manager swaps only fully scheduled
        sequences), nothing running, or more private blocks than the host has free. Blocks a
        sequence shares stay on the device, so only blocks with refcount 1 need host room
        (siblings keep their references when one of them is swapped: the count holds for all).
        A victim has no work in this step, so nothing of it was scheduled since the last
        ``take_transfers()``: the manager's swap rule (its K/V must all be written) holds."""
        if victim in self._prefilling:
            return False
        seqs = [s for s, lv in self._running.items() if lv.req == victim.rid]
        if not seqs:
            return False
        m = self.manager
        # every group's live entries (a window's released ones read -1); an upper bound, since
        # swap_out first releases what a window no longer reads
        private = sum(1 for seq in seqs for g in range(m.num_groups) for b in m.block_table(seq, group=g)
                      if b >= 0 and m.refcount(b) == 1)
        u = m.usage()
        if private > u.host_blocks - u.host_used_blocks:
            return False
        for seq in seqs:
            try:
                m.swap_out(seq)
            except OutOfBlocks:  # not expected after the check; restarting frees what was swapped
                return False
            self._swapped[seq] = self._running.pop(seq)
        self.ex.stats.swapped_out += len(seqs)
        self.ex.stats.swap_preemptions += 1
        out.swapped_out.append(victim.rid)
        return True

    def _swap_in_ready(self, scheduled: set[int], out: StepOutput) -> None:
        """At the start of a step, bring swapped sequences back, first out first in, while the
        device has room for each one's blocks plus a fresh block for every decoding sequence (its
        own included): without that margin the step's own appends would preempt again. With
        nothing else on the device a sequence comes back if it fits at all. A request brought
        back counts as having work in this step: it is never preempted in it (the manager
        refuses to swap out a sequence with a pending load)."""
        m = self.manager
        for seq, lv in list(self._swapped.items()):
            need = m.block_table(seq).count(-1)  # at most this many loads (some may be revived)
            busy = bool(self._running or self._prefilling)
            if busy and need + len(self._running) + 1 > m.num_free_blocks:
                break
            try:
                m.swap_in(seq)
            except OutOfBlocks:
                break
            self._running[seq] = self._swapped.pop(seq)
            scheduled.add(lv.req)
            self.ex.stats.swapped_in += 1
            if lv.req not in out.swapped_in:
                out.swapped_in.append(lv.req)

    def _restart(self, req: StepRequest) -> None:
        """Free every sequence of an admitted request and queue it again, prompt only."""
        cache = not self.publish_at_admission  # between steps every scheduled position was computed
        if req in self._prefilling:
            self._prefilling.remove(req)
            self.ex.free(req.seq, cache=cache)
        for seq in self._seqs_of(req.rid):
            self._release(seq)
        req.seq, req.hit, req.done, req.samples, req.order = None, 0, 0, [], -1
        bisect.insort(self._waiting, (req.arrival, req.rid, req), key=lambda e: e[:2])

    @property
    def _chunk_cap(self) -> int:
        return sys.maxsize if self.chunk_size is None else self.chunk_size

    def _context(self, seq: Hashable) -> list[int]:
        lv = self._running[seq]
        return self._requests[lv.req].prompt + lv.sample.tokens

    def _room(self, seq: Hashable) -> int:
        """Positions a prefill of ``seq`` can schedule now: the rest of its last block plus every
        free block."""
        m = self.manager
        return len(m.block_table(seq)) * m.block_size - m.num_computed(seq) + m.num_free_blocks * m.block_size

    def _tail(self, seq: Hashable) -> int:
        """Positions left in the sequence's last block (every group's table has its length)."""
        m = self.manager
        return len(m.block_table(seq)) * m.block_size - m.num_computed(seq)

    def _fit(self, call, n: int, tail: int):
        """A hybrid model's chunk: ``call(n)``, or on ``OutOfBlocks`` the most positions the
        pool allows, ``call(k)``; ``(result, positions)``, or None when not even one fits.

        A grouped manager takes a chunk's blocks in every group but first releases what the
        windows let go, so the room is not ``free blocks x block size``; the failed call changed
        nothing and its ``available`` (free blocks plus the releases) is exact: ``k = tail +
        (available // groups) x block_size``. Example: block size 4, two groups, 5 available, an
        empty tail: 2 blocks a group, k = 8 positions. Without this, a prompt under a small
        window that only its own releases make room for would never be scheduled (vLLM #39734).
        """
        try:
            return call(n), n
        except OutOfBlocks as e:
            k = min(n - 1, tail + e.available // self.ex.num_groups * self.manager.block_size)
        if k < 1:
            return None
        try:
            return call(k), k
        except OutOfBlocks:
            return None

    def _next_chunk(self, req: StepRequest, budget: int) -> StepWork | None:
        n = min(budget, self._chunk_cap, len(req.prompt) - req.done)
        if self.publish_at_admission:  # the control: every block is already allocated and published
            slots = self.manager.slots(req.seq, req.done, req.done + n)
        elif not self.ex.releases:
            n = min(n, self._room(req.seq))
            if n < 1:
                return None
            slots = self.manager.prefill(req.seq, n)
        else:
            got = self._fit(lambda k: self.manager.prefill(req.seq, k), n, self._tail(req.seq))
            if got is None:
                return None
            slots, n = got
        start, req.done = req.done, req.done + n
        return StepWork(req.seq, req.prompt[start:req.done], slots, req.done, req=req)

    def _admit(self, req: StepRequest, budget: int, out: StepOutput) -> StepWork | None:
        """Admit ``req`` with a first chunk of at most ``budget`` positions; None if it does not fit."""
        m = self.manager
        seq = self._step_seq_id(req.rid)
        try:
            if self.publish_at_admission:
                hit = m.add_sequence(seq, req.prompt, cache_salt=req.cache_salt)
                stop = hit + min(budget, self._chunk_cap, len(req.prompt) - hit)
            else:
                k = min(budget, self._chunk_cap, m.num_free_blocks * m.block_size)
                if k < 1:
                    return None
                if not self.ex.releases:
                    hit = m.add_sequence(seq, req.prompt, cache_salt=req.cache_salt, prefill=k)
                else:  # a hit starts on a block boundary: its chunk's tail is empty
                    got = self._fit(lambda j: m.add_sequence(seq, req.prompt, cache_salt=req.cache_salt,
                                                             prefill=j), k, 0)
                    if got is None:
                        return None
                    hit = got[0]
                stop = m.num_computed(seq)
        except OutOfBlocks:
            return None
        req.seq, req.hit, req.done, req.order = seq, hit, stop, next(self._admissions)
        self._prefilling.append(req)
        self.ex.stats.prompt_tokens += len(req.prompt)
        self.ex.stats.hit_tokens += hit
        out.admitted.append((req.rid, hit))
        out.prefill.append((req.rid, hit, stop))
        return StepWork(seq, req.prompt[hit:stop], m.slots(seq, hit, stop), stop, req=req)

    def _chunk_done(self, req: StepRequest, rows: np.ndarray, out: StepOutput) -> None:
        """After the forward: a prompt whose last chunk ran starts its samples (forking n)."""
        if req.done < len(req.prompt):
            return
        self._prefilling.remove(req)
        logits = rows[-1].copy()
        req.samples = [None] * req.n
        seqs = []
        for k in range(req.n):
            rng = np.random.default_rng([*req.stream, k]) if req.temperature else None
            seq = req.seq if k == 0 else self._step_seq_id(req.rid)
            if k:
                self.ex.fork(req.seq, seq)  # after the step's writes: the prompt's K/V exists
            tok = pick_token(logits, req.temperature, rng)
            self._running[seq] = LiveSequence(req.rid, Sample().extended(tok, logits, 0.0), rng, k)
            seqs.append(seq)
        for seq in seqs:
            self._maybe_finish(seq, out)

    def _verify(self, w: StepWork, rows: np.ndarray, out: StepOutput) -> None:
        """Choose the next tokens from the step's logits; keep the drafts that match (greedy)."""
        lv = self._running[w.seq]
        req = self._requests[lv.req]
        accepted = 0
        for j, row in enumerate(rows):
            tok = pick_token(row, req.temperature, lv.rng)
            lv.sample = lv.sample.extended(tok, row.copy(), 0.0)
            if j < len(w.drafts) and w.drafts[j] == tok:
                accepted += 1
                continue
            break
        if w.drafts:
            m = self.manager
            before = self.ex.held_blocks(w.seq)
            m.accept(w.seq, accepted + w.joint)
            freed = before - self.ex.held_blocks(w.seq)
            st = self.ex.stats
            st.verify_steps += 1
            st.draft_tokens += len(w.drafts)
            st.accepted_tokens += accepted
            st.rollback_blocks += freed
            out.accepted_tokens += accepted
            out.rollback_blocks += freed
        if w.proposed:
            self.speculator.settle(w.seq, accepted)
        self._maybe_finish(w.seq, out)

    def _maybe_finish(self, seq: Hashable, out: StepOutput) -> None:
        lv = self._running[seq]
        req = self._requests[lv.req]
        if len(lv.sample.tokens) < req.max_new_tokens:
            return
        req.samples[lv.index] = lv.sample
        self._release(seq)
        if all(s is not None for s in req.samples):
            del self._requests[req.rid]
            out.finished[req.rid] = RequestResult(req.prompt, req.hit, req.samples)

    def _release(self, seq: Hashable, cache: bool = True) -> None:
        """A decoding sequence is done (or dropped): free it here and in the speculator."""
        if seq in self._running:
            del self._running[seq]
        else:
            del self._swapped[seq]
        self.ex.free(seq, cache=cache)
        if self.speculator is not None:
            self.speculator.release(seq)

    def _drop_all(self, cache: bool) -> None:
        """Forget every request; free their sequences (``cache=False``: nothing they alone hold
        stays findable)."""
        for seq in list(self._running) + list(self._swapped):
            self._release(seq, cache=cache)
        for req in self._prefilling:
            self.ex.free(req.seq, cache=cache)
        self._prefilling, self._waiting, self._requests = [], [], {}

    def _step_seq_id(self, rid: int) -> tuple[int, int, int]:
        return (self._tag, rid, next(self._step_serial))

    def generate(self, prompts, max_new_tokens, temperature, seed, n, beam_width, cache_salt,
                 arrivals) -> list[RequestResult]:
        """``generate`` on the step loop: add every prompt at its arrival step, step to the end."""
        if beam_width > 1:
            raise ValueError("beam search runs only in generate's default path (no token_budget, "
                             "chunk_size, speculator or arrivals)")
        if self.has_unfinished():
            raise ValueError("requests added with add_request are unfinished: step or abort them first")
        int_at_least("seed", seed, 0)
        if arrivals is None:
            arrivals = [0] * len(prompts)
        arrivals = list(arrivals)
        if len(arrivals) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(arrivals)} arrivals")
        arrivals = [int_at_least("arrivals", a, 0) for a in arrivals]
        self.ex.reset()
        base = self._clock
        results: dict[int, RequestResult] = {}
        try:
            rids = [self.add(p, max_new_tokens, temperature, n, cache_salt, base + a, (int(seed), r))
                    for r, (p, a) in enumerate(zip(prompts, arrivals))]
            while self.has_unfinished():
                results.update(self.step().finished)
        finally:
            # every scheduled position was computed unless a step raised (then it dropped all)
            self._drop_all(cache=not self.publish_at_admission)
        return [results[r] for r in rids]
