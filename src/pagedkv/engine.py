"""The reference integration: a generation loop driving the allocator, the KV store and a model.

Read this module to see what an engine owes the allocator, in the order it owes it, every step:

1. ``add_sequence`` a prompt: the first ``hit`` tokens' K/V is already in the store (prefix
   cache); compute only ``prompt[hit:]`` into the slots of its block table.
2. ``fork`` a sequence for each extra sample or beam: no allocation, no copy.
3. ``append_batch`` the step's tokens: one slot per sequence.
4. ``store.transfer(manager.take_transfers())`` (with a host tier: blocks offloaded to or loaded
   from host memory), then ``store.copy_blocks(manager.take_copies())``, **before** the step writes
   any K/V: a fork's child that appends into a shared partial block got a fresh block whose first
   slots must hold the parent's tokens before attention reads them.
5. run the model: it writes the new K/V at the slots and attends through ``block_tables``.
6. ``free`` every sequence when done (and every beam that falls out of the beam), so that all
   blocks return to the pool.

``copy_on_write=False`` is a negative control, not a mode to use: the engine then ignores the
queued copies and keeps writing a child's tokens into the *shared* block it was forked from (the
copy's source), which is what an allocator without copy-on-write does. Parent and children then
overwrite each other's K/V at the same slot offsets, and the tests and ``pagedkv report`` measure
how far their logits drift from a dense run of the same model. So that the collision is
deterministic (last writer wins), that mode runs a step's sequences one at a time. It assumes the
samples finish together (the shared block is not freed while a child still reads it).

The model is anything with ``new_store(num_blocks, block_size)`` and ``forward(store, token_ids,
slots, block_tables, seq_lens, query_lens) -> logits`` (:class:`pagedkv.model.PagedLlama`, on its
numpy or its torch backend; logits may be a numpy array or a CPU tensor). ``forward`` already takes
several new tokens per sequence (``query_lens``): a prefill chunk or a run of draft tokens is the
same call as a decode step. This module itself needs only numpy.

**The modern loop** (contract v2): ``Engine(model, manager, token_budget=64)`` schedules every step
like a serving engine. Requests arrive over time (``add_request`` between ``step`` calls, or
``generate(..., arrivals=[...])``); each ``step()`` spends at most ``token_budget`` query tokens,
first on running sequences (one token each, plus drafts), then on the next chunks of prompts
mid-prefill, then on admitting waiting requests (``add_sequence(..., prefill=k)``), and runs
**one forward over all of them**: prefill chunks and decode tokens in one ragged batch. A long
prompt is computed over several steps, and its blocks are published only as chunks schedule them,
so a request admitted while another is mid-prefill hits only blocks whose K/V exists (or is
written in this very step: the model writes a layer's K/V for the whole batch before any
sequence's attention in that layer reads). When blocks run short, the most recently admitted
request without work in the step is preempted: its blocks are freed (the computed ones stay
cached) and it restarts from its prompt later, as vLLM's recompute preemption does.

``speculator=NgramDrafter()`` or ``DraftModelDrafter(small_model, small_manager)``
(:mod:`pagedkv.speculative`) adds speculative decoding: a running sequence's query is its last
chosen token plus up to ``k`` drafts (``append_tokens(..., speculative=True)``), the target
verifies all of them in the step's forward, keeps the drafts its own greedy choice agrees with
and rolls back the rest with ``accept(id, k)``: the tokens are exactly greedy decoding's.

``publish_at_admission=True`` is the chunked prefill's negative control: it admits the whole
prompt with ``prefill=None`` (every full block published at once) but still computes it in
chunks, so a request arriving mid-prefill hits blocks whose K/V was never written.

**The host tier.** With a manager made with ``host_blocks=N`` the engine's store gets a host pool
of the same size, and every forward first drains ``take_transfers()`` and runs it
(``store.transfer``: every ``to_host`` entry, then every ``to_device`` entry, each one batch), then
the copies, then the step's writes and attention. That is all a prefix hit on the host tier
needs: the manager gives the prompt device blocks and queues the loads. ``preemption="swap"``
preempts a decoding request by ``swap_out`` of its sequences (their private blocks go to host
memory, with their K/V) instead of freeing it to recompute; the swapped sequences come back
(``swap_in``, first out first in) at the start of a step with room for them, before any new
request is admitted, and decode on in that same step. A request mid-prefill (the manager cannot
swap a partly scheduled prompt), or one whose blocks do not fit in the host's free blocks, is
recomputed as before. ``run_transfers=False`` is the host tier's negative control: the engine
drains the transfers but never runs them, so a block loaded from the host or swapped back in
holds whatever the device block held before, and the logits diverge.
"""
from __future__ import annotations

import bisect
import itertools
import sys
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import numpy as np

from .types import TO_HOST, OutOfBlocks

__all__ = ["Engine", "Sample", "RequestResult", "EngineStats", "StepOutput", "PREEMPTION_MODES"]

PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class Sample:
    """One generated sequence: its tokens and the logits each one was chosen from.

    ``logits[t]`` are the model's logits after ``prompt + tokens[:t]`` (float32 ``[vocab]``), which
    is what an oracle compares at step ``t``. ``logprob`` is the sum of the chosen tokens' log
    probabilities (the beam score).
    """

    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    logprob: float = 0.0

    def extended(self, token: int, logits: np.ndarray, logprob: float) -> "Sample":
        return Sample(self.tokens + [token], self.logits + [logits], self.logprob + logprob)


@dataclass
class RequestResult:
    """A prompt's outcome: ``hit_tokens`` served by the prefix cache, and its samples or beams
    (beams best first)."""

    prompt: list[int]
    hit_tokens: int
    samples: list[Sample]


@dataclass
class EngineStats:
    """What the allocator did for one ``generate`` call (or, driving ``step`` yourself, since
    the engine was made or the last ``generate``).

    ``eager_fork_blocks`` is how many blocks copying at fork time would have copied (the parent's
    whole table, per fork); ``copied_blocks`` is what copy-on-write copied instead. Worked
    example: a 45-token prompt with 16-token blocks, n = 4: three forks of a 3-block table are 9
    eager copies; copy-on-write copies the partial third block for 3 of the 4 samples: 3.

    Speculation: ``acceptance_rate = accepted_tokens / draft_tokens``; ``rollback_blocks`` counts
    the blocks ``accept`` returned to the pool. Worked example (block size 4): a sequence of 8
    tokens (two full blocks) verifies 4 drafts, which take a fresh third block; keeping 3 of them
    frees nothing, keeping none returns the third block: 1 block.

    Host tier: ``transfers_to_host`` / ``transfers_to_device`` count the block transfers drained
    from the manager, ``transfer_bytes`` what the store moved for them (``transfers x
    bytes_per_block``: with 16-token blocks of the 2-layer test model, 8,192 bytes each), and
    ``skipped_transfers`` the ones the ``run_transfers=False`` control dropped. A swapped request
    counts once in ``swap_preemptions`` and each of its sequences once in ``swapped_out``.
    """

    steps: int = 0
    forks: int = 0
    copied_blocks: int = 0
    copied_bytes: int = 0
    eager_fork_blocks: int = 0
    peak_used_blocks: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    # the step loop (token_budget / speculator / arrivals); 0 in generate's default path
    prefill_tokens: int = 0  # prompt positions computed (the uncached part of every prompt)
    prefill_chunks: int = 0  # prompt chunks computed: one per prompt per step it was in
    decode_tokens: int = 0  # query tokens of decoding sequences: 1 each per step, plus drafts
    max_step_tokens: int = 0  # the most query tokens one forward took
    mixed_steps: int = 0  # forwards holding both a prompt chunk and decode tokens
    idle_steps: int = 0  # steps with nothing to run (every request still to arrive)
    # speculative decoding
    verify_steps: int = 0  # (sequence, step) pairs that verified at least one draft
    draft_tokens: int = 0  # drafts the target verified
    accepted_tokens: int = 0  # drafts it kept
    rollback_blocks: int = 0  # blocks ``accept`` returned: they held only rejected drafts
    preemptions: int = 0  # requests restarted to free blocks for earlier ones
    # the host tier
    swap_preemptions: int = 0  # requests preempted by swapping their sequences out
    swap_fallbacks: int = 0  # preemption="swap" but restarted (a prompt mid-prefill, host full)
    swapped_out: int = 0  # sequences swapped out
    swapped_in: int = 0  # sequences swapped back in
    transfers_to_host: int = 0  # blocks drained device -> host (offloads, swap-outs)
    transfers_to_device: int = 0  # blocks drained host -> device (host prefix hits, swap-ins)
    transfer_bytes: int = 0  # bytes the store moved for them
    skipped_transfers: int = 0  # run_transfers=False: drained and never run

    @property
    def acceptance_rate(self) -> float:
        """Share of verified drafts the target kept (0.0 when nothing was drafted)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def rollback_tokens(self) -> int:
        """Drafts rejected and rolled back."""
        return self.draft_tokens - self.accepted_tokens


@dataclass
class StepOutput:
    """What one :meth:`Engine.step` did.

    ``admitted``: ``(request, prefix-hit tokens)`` for each request admitted this step;
    ``prefill``: ``(request, start, stop)`` for each prompt chunk computed (positions
    ``start..stop``); ``decode_tokens``: query tokens of decoding sequences (1 each plus drafts);
    ``preempted``: requests sent back to the queue to free blocks; ``swapped_out``: requests
    preempted by swapping them to the host tier; ``swapped_in``: requests whose sequences came
    back this step; ``transfers``: block transfers the forward ran (or, under the control,
    dropped); ``finished``: the requests completed this step, by request id. Worked example (budget 16,
    block size 16, a 40-token prompt arriving alone): step 0 ``prefill [(0, 0, 16)]``, step 1
    ``[(0, 16, 32)]``, step 2 ``[(0, 32, 40)]`` and the first token is chosen; step 3 decodes.
    """

    step: int
    admitted: list[tuple[int, int]] = field(default_factory=list)
    prefill: list[tuple[int, int, int]] = field(default_factory=list)
    decode_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rollback_blocks: int = 0
    preempted: list[int] = field(default_factory=list)
    swapped_out: list[int] = field(default_factory=list)
    swapped_in: list[int] = field(default_factory=list)
    transfers: int = 0
    finished: dict[int, RequestResult] = field(default_factory=dict)

    @property
    def prefill_tokens(self) -> int:
        return sum(stop - start for _, start, stop in self.prefill)

    @property
    def tokens(self) -> int:
        """Query tokens in this step's forward (0 for an idle step)."""
        return self.prefill_tokens + self.decode_tokens


@dataclass
class _Live:
    """A running sequence: which request it belongs to, its sample so far, its seeded stream."""

    req: int
    sample: Sample
    rng: np.random.Generator | None
    index: int = 0  # which of its request's n samples


@dataclass
class _Request:
    """A request of the step loop, from ``add_request`` until its samples finish."""

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
class _Work:
    """One sequence's share of a step: its query tokens, their slots, its length after them."""

    seq: Hashable
    feed: list[int]
    slots: np.ndarray
    length: int  # positions attention sees (the sequence's scheduled length after this step)
    req: _Request | None = None  # set for a prompt chunk
    drafts: list[int] = field(default_factory=list)
    proposed: bool = False  # the speculator proposed for this sequence this step


def _host_blocks(manager: Any) -> int:
    """The size of a manager's host tier (0 without one, or for a manager that has no such
    notion)."""
    usage = getattr(manager, "usage", None)
    return int(getattr(usage(), "host_blocks", 0)) if callable(usage) else 0


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


class Engine:
    """Generation over a :class:`~pagedkv.KVCacheManager` and a :class:`~pagedkv.store.KVStore`.

    ``Engine(model, manager)`` makes a store shaped for the model with the manager's blocks; keep
    the engine (and so the manager) across ``generate`` calls to get prefix hits across requests.

    The modern loop's options (all off by default, which keeps ``generate``'s one-prompt-at-a-time
    path): ``token_budget`` (query tokens per step; long prompts are prefilled in chunks, mixed
    with decodes), ``chunk_size`` (the most prompt positions one request computes per step, so
    that one long prompt leaves budget for others: vLLM's ``long_prefill_token_threshold``),
    ``speculator`` (a drafter from :mod:`pagedkv.speculative`; greedy only) and
    ``publish_at_admission`` (a negative control, see the module docstring). ``add_request`` /
    ``step`` / ``abort`` / ``has_unfinished`` drive the loop one step at a time; ``generate``
    drives it to the end when any option or ``arrivals`` is given.

    A manager with a host tier (``KVCacheManager(..., host_blocks=N)``) gets a store with a host
    pool of ``N`` blocks, and its transfers run every step; ``preemption="swap"`` (step loop
    only) swaps preempted requests out instead of recomputing them; ``run_transfers=False`` is
    the host tier's negative control (see the module docstring).
    """

    _ids = itertools.count()

    def __init__(self, model: Any, manager: Any, store: Any = None, *, copy_on_write: bool = True,
                 token_budget: int | None = None, chunk_size: int | None = None, speculator: Any = None,
                 publish_at_admission: bool = False, preemption: str = "recompute",
                 run_transfers: bool = True) -> None:
        if not isinstance(copy_on_write, bool):
            raise ValueError(f"copy_on_write must be a bool, got {copy_on_write!r}")
        for name, v in (("token_budget", token_budget), ("chunk_size", chunk_size)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {v!r}")
        if not isinstance(publish_at_admission, bool):
            raise ValueError(f"publish_at_admission must be a bool, got {publish_at_admission!r}")
        if publish_at_admission and token_budget is None and chunk_size is None:
            raise ValueError("publish_at_admission is a control of chunked prefill: set a token_budget "
                             "or a chunk_size")
        host = _host_blocks(manager)
        self._check_host_options(host, preemption, run_transfers)
        if store is None:
            store = (model.new_store(manager.num_blocks, manager.block_size, host_blocks=host) if host
                     else model.new_store(manager.num_blocks, manager.block_size))
        if (store.num_blocks, store.block_size) != (manager.num_blocks, manager.block_size):
            raise ValueError(f"store has {store.num_blocks} blocks of {store.block_size}, manager "
                             f"{manager.num_blocks} of {manager.block_size}")
        if getattr(store, "host_blocks", 0) != host:
            raise ValueError(f"store has {getattr(store, 'host_blocks', 0)} host blocks, the manager's "
                             f"host tier {host}")
        self._check_speculator(model, speculator)
        self.model, self.manager, self.store = model, manager, store
        self.copy_on_write = copy_on_write
        self.token_budget = None if token_budget is None else int(token_budget)
        self.chunk_size = None if chunk_size is None else int(chunk_size)
        self.speculator = speculator
        self.publish_at_admission = publish_at_admission
        self.preemption = preemption
        self.run_transfers = run_transfers
        self._tiered = host > 0
        self._step_transfers = 0  # transfers the last forward drained
        self._alias: dict[int, int] = {}  # copy_on_write=False: block a copy went to -> its source
        self.stats = EngineStats()
        # the step loop's state
        self._tag = next(self._ids)
        self._clock = 0
        self._rids = itertools.count()
        self._admissions = itertools.count()
        self._step_serial = itertools.count()
        self._waiting: list[tuple[int, int, _Request]] = []  # (arrival, rid, request), sorted
        self._prefilling: list[_Request] = []  # admitted, prompt not fully computed; admission order
        self._running: dict[Hashable, _Live] = {}  # decoding sequences
        self._swapped: dict[Hashable, _Live] = {}  # decoding sequences on the host tier, oldest first
        self._requests: dict[int, _Request] = {}  # every unfinished request

    @staticmethod
    def _check_host_options(host: int, preemption: Any, run_transfers: Any) -> None:
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {preemption!r}")
        if preemption == "swap" and not host:
            raise ValueError("preemption='swap' needs a manager with a host tier "
                             "(KVCacheManager(..., host_blocks=N))")
        if not isinstance(run_transfers, bool):
            raise ValueError(f"run_transfers must be a bool, got {run_transfers!r}")
        if not run_transfers and not host:
            raise ValueError("run_transfers=False is a control of the host tier: the manager has none")

    @staticmethod
    def _check_speculator(model: Any, speculator: Any) -> None:
        if speculator is None:
            return
        for name in ("propose", "settle", "release"):
            if not callable(getattr(speculator, name, None)):
                raise ValueError(f"a speculator needs propose/settle/release methods; "
                                 f"{type(speculator).__name__} lacks {name}")
        k = getattr(speculator, "num_drafts", None)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"speculator.num_drafts must be an int >= 1, got {k!r}")
        mine = getattr(getattr(model, "dims", None), "vocab_size", None)
        theirs = getattr(speculator, "vocab_size", None)
        if mine is not None and theirs is not None and mine != theirs:
            raise ValueError(f"the draft model's vocabulary ({theirs}) is not the target's ({mine})")

    @property
    def uses_step_loop(self) -> bool:
        """Whether ``generate`` runs the step loop (any of the modern loop's options is set)."""
        return (self.token_budget is not None or self.chunk_size is not None
                or self.speculator is not None or self.publish_at_admission
                or self.preemption == "swap")

    # ---- public entry point

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 temperature: float = 0.0, seed: int = 0, n: int = 1, beam_width: int = 1,
                 cache_salt: Any = None, arrivals: Sequence[int] | None = None) -> list[RequestResult]:
        """Generate ``max_new_tokens`` tokens for every prompt; return results in prompt order.

        ``temperature`` 0 is greedy; above 0, sample ``k`` of prompt ``r`` draws from its own
        stream seeded by ``(seed, r, k)`` (Gumbel-max over ``logits / temperature``), so results
        do not depend on batching. ``n`` > 1 forks ``n`` samples after the prompt; ``beam_width``
        > 1 runs beam search (sum of log-probabilities, no length penalty, no EOS). Every block is
        returned to the pool when the call ends, also on error. ``self.stats`` describes the call.

        ``arrivals[r]`` is the step (counted from this call's first) at which prompt ``r`` arrives;
        with arrivals or any of the modern loop's options the call runs the step loop (see
        :meth:`step`), which has no beam search.
        """
        self._check_generate(prompts, max_new_tokens, temperature, n, beam_width)
        if arrivals is not None or self.uses_step_loop:
            return self._generate_steps(prompts, max_new_tokens, temperature, seed, n, beam_width,
                                        cache_salt, arrivals)
        self.stats, self._alias, self._serial = EngineStats(), {}, itertools.count()
        tag = next(self._ids)
        live: dict[Hashable, _Live] = {}
        try:
            results, first = self._prefill(prompts, tag, live, cache_salt)
            self._start(results, first, live, tag, temperature, seed, n, beam_width)
            for _ in range(max_new_tokens - 1):
                logits = self._decode(live)
                self._choose(logits, live, results, tag, temperature, beam_width)
            for seq_id, lv in live.items():
                results[lv.req].samples.append(lv.sample)
        finally:
            for seq_id in list(live):
                self._free(seq_id)
        if beam_width > 1:
            for r in results:
                r.samples.sort(key=lambda s: -s.logprob)
        return results

    def _check_generate(self, prompts, max_new_tokens, temperature, n, beam_width) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("need at least one prompt, each with at least one token")
        for name, v in (("max_new_tokens", max_new_tokens), ("n", n), ("beam_width", beam_width)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if n > 1 and beam_width > 1:
            raise ValueError("use n or beam_width, not both")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        if beam_width > 1 and temperature:
            raise ValueError("beam search is deterministic: leave temperature at 0")
        vocab = getattr(getattr(self.model, "dims", None), "vocab_size", None)
        if vocab is not None and any(min(p) < 0 or max(p) >= vocab for p in prompts):
            raise ValueError(f"prompt token ids must lie in [0, {vocab}) for this model")

    # ---- the steps

    def _prefill(self, prompts, tag, live, cache_salt):
        """Admit each prompt and compute its uncached tail at once, one prompt per forward.

        Why not admit all and prefill them in one batch: ``add_sequence`` publishes a prompt's full
        blocks to the prefix cache on admission, before their K/V exists. If a later admission
        then ran out of blocks, the earlier prompts would be freed uncomputed and leave cached
        blocks of garbage for the next request to hit. Computing each prompt right after its
        admission keeps every published block's K/V real.
        """
        m, results, first = self.manager, [], {}
        for r, prompt in enumerate(prompts):
            prompt = list(prompt)
            seq_id = self._new_id(tag, r)
            hit = m.add_sequence(seq_id, prompt, cache_salt=cache_salt)
            live[seq_id] = _Live(r, Sample(), None)
            results.append(RequestResult(prompt, hit, []))
            self.stats.prompt_tokens += len(prompt)
            self.stats.hit_tokens += hit
            (first[seq_id],) = self._forward([seq_id], [prompt[hit:]], m.slots(seq_id, hit, len(prompt)))
        return results, first

    def _start(self, results, first, live, tag, temperature, seed, n, beam_width) -> None:
        """Fork each prompt into its samples or beams and choose their first tokens."""
        for seq_id, logits in first.items():
            r = live[seq_id].req
            if beam_width > 1:
                lp = _log_softmax(logits)
                top = np.argsort(-lp, kind="stable")[:beam_width]
                picks, rngs = [(int(t), float(lp[t])) for t in top], [None] * beam_width
            else:
                rngs = [np.random.default_rng([seed, r, k]) if temperature else None for k in range(n)]
                picks = [(self._pick(logits, temperature, g), 0.0) for g in rngs]
            for k, (tok, lp_tok) in enumerate(picks):
                child = seq_id if k == 0 else self._new_id(tag, r)
                if k:
                    self._fork(seq_id, child)
                live[child] = _Live(r, Sample().extended(tok, logits, lp_tok), rngs[k])

    def _decode(self, live) -> dict[Hashable, np.ndarray]:
        """Feed every live sequence its last chosen token; return each one's next logits."""
        ids = list(live)
        toks = [live[i].sample.tokens[-1] for i in ids]
        slots = self.manager.append_batch(ids, toks)
        return dict(zip(ids, self._forward(ids, [[t] for t in toks], slots)))

    def _choose(self, logits, live, results, tag, temperature, beam_width) -> None:
        if beam_width == 1:
            for seq_id, lv in live.items():
                tok = self._pick(logits[seq_id], temperature, lv.rng)
                lv.sample = lv.sample.extended(tok, logits[seq_id], 0.0)
            return
        for r in range(len(results)):
            beams = [i for i in live if live[i].req == r]
            self._beam_step(beams, logits, live, tag, beam_width)

    def _beam_step(self, beams, logits, live, tag, beam_width) -> None:
        """Keep the ``beam_width`` best (beam, token) extensions: fork beams chosen twice or more,
        free beams chosen never."""
        lps = np.stack([_log_softmax(logits[b]) for b in beams])
        scores = np.asarray([live[b].sample.logprob for b in beams])[:, None] + lps
        flat = np.argsort(-scores.reshape(-1), kind="stable")[:beam_width]
        old = {b: live[b].sample for b in beams}
        used: set = set()
        for f in flat.tolist():
            row, tok = divmod(f, lps.shape[1])
            b = target = beams[row]
            if b in used:
                target = self._new_id(tag, live[b].req)
                self._fork(b, target)
                live[target] = _Live(live[b].req, old[b], None)
            used.add(b)
            live[target].sample = old[b].extended(tok, logits[b], float(lps[row, tok]))
        for b in beams:
            if b not in used:
                self._free(b)
                del live[b]

    # ---- the step loop: requests over time, chunked prefill, speculative decoding

    def add_request(self, prompt: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0,
                    seed: int = 0, n: int = 1, cache_salt: Any = None, arrival: int | None = None) -> int:
        """Queue a request for the step loop; returns its id (0, 1, 2, ... per engine).

        It is admitted at the first step numbered ``arrival`` or later (default: the next step)
        that has token budget and blocks left, after every earlier arrival. Sample ``k`` draws
        from a stream seeded by ``(seed, 0, k)``. Checks the prompt and the salt now (with the
        side-effect-free ``lookup``), so a bad request never reaches a step.
        """
        self._check_generate([prompt], max_new_tokens, temperature, n, 1)
        self._check_seed(seed)
        return self._add(prompt, max_new_tokens, temperature, n, cache_salt, arrival, (int(seed), 0))

    def _add(self, prompt, max_new_tokens, temperature, n, cache_salt, arrival, stream) -> int:
        if self.speculator is not None and temperature:
            raise ValueError("speculative decoding here verifies greedily: use temperature 0")
        if arrival is None:
            arrival = self._clock
        if isinstance(arrival, bool) or not isinstance(arrival, (int, np.integer)) or arrival < 0:
            raise ValueError(f"arrival must be a step number >= 0, got {arrival!r}")
        self.manager.lookup(prompt, cache_salt)  # validates tokens and salt, changes nothing
        prompt = [int(t) for t in prompt]
        rid = next(self._rids)
        req = _Request(rid, prompt, max_new_tokens, int(arrival), temperature, stream, n, cache_salt)
        self._requests[rid] = req
        bisect.insort(self._waiting, (req.arrival, rid, req), key=lambda e: e[:2])
        return rid

    @staticmethod
    def _check_seed(seed) -> None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")

    @property
    def clock(self) -> int:
        """The number of the next step."""
        return self._clock

    def has_unfinished(self) -> bool:
        """Whether any request added is still waiting, prefilling or decoding."""
        return bool(self._requests)

    def abort(self, request: int) -> None:
        """Drop a request: its blocks go back to the pool (``KeyError`` for an unknown id)."""
        req = self._requests.pop(request)  # KeyError: unknown or finished
        self._waiting = [e for e in self._waiting if e[1] != request]
        # between steps every scheduled position was computed, except under the control
        cache = not self.publish_at_admission
        if req in self._prefilling:
            self._prefilling.remove(req)
            self._free(req.seq, cache=cache)
        for seq in self._seqs_of(request):
            self._release(seq)

    def preempt(self, request: int) -> str:
        """Preempt an admitted request between steps, as the scheduler does when blocks run short;
        returns how: ``"swap"`` (``preemption="swap"`` and a decoding request whose private blocks
        fit in the host's free blocks: its sequences go to the host tier and come back when a
        step has room) or ``"recompute"`` (its blocks are freed and it restarts from its prompt).

        ``KeyError`` for an unknown or finished request; ``ValueError`` for one still waiting or
        already swapped out whole (nothing of it is on the device to preempt).
        """
        req = self._requests[request]  # KeyError: unknown or finished
        if req.seq is None:
            raise ValueError(f"request {request} is waiting: it holds no blocks to preempt")
        if not self._on_device(req):
            raise ValueError(f"request {request} is swapped out already")
        out = StepOutput(self._clock)
        self._preempt(req, out)
        return "swap" if out.swapped_out else "recompute"

    def step(self) -> StepOutput:
        """Schedule one step within the token budget and run it as one forward.

        Order: running sequences (their last token, plus drafts when speculating), prompts
        mid-prefill (their next chunk), then waiting requests that have arrived (admitted with
        ``add_sequence(..., prefill=k)``, ``k`` the budget left). A sequence that cannot get a
        block preempts the most recently admitted request with no work in this step (it restarts
        from its prompt later), or else waits; no request is admitted in a step that was short
        of blocks. A step in which nothing fits raises ``OutOfBlocks`` (abort a request and step
        again); a step with nothing arrived yet is idle. If the forward raises, every request is
        dropped and its sequences freed with ``cache=False`` (their newest positions were
        scheduled, never computed).
        """
        out = StepOutput(self._clock)
        work = self._schedule(out)
        if not work:
            if (self._running or self._prefilling or self._swapped
                    or (self._waiting and self._waiting[0][0] <= self._clock)):
                raise OutOfBlocks(1, self.manager.num_free_blocks, f"step {self._clock}: no request fits")
            self._clock += 1
            self.stats.idle_steps += 1
            return out
        try:
            rows = self._forward_rows([w.seq for w in work], [w.feed for w in work],
                                      np.concatenate([w.slots for w in work]), [w.length for w in work])
        except BaseException:
            self._drop_all(cache=False)
            raise
        self._clock += 1
        out.transfers = self._step_transfers
        self._account(out)
        for w, r in zip(work, rows):
            if w.req is not None:
                self._chunk_done(w.req, r, out)
            else:
                self._verify(w, r, out)
        return out

    def _account(self, out: StepOutput) -> None:
        st = self.stats
        st.prefill_tokens += out.prefill_tokens
        st.prefill_chunks += len(out.prefill)
        st.decode_tokens += out.decode_tokens
        st.max_step_tokens = max(st.max_step_tokens, out.tokens)
        st.mixed_steps += bool(out.prefill and out.decode_tokens)

    def _schedule(self, out: StepOutput) -> list[_Work]:
        budget = sys.maxsize if self.token_budget is None else self.token_budget
        work: list[_Work] = []
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

    def _schedule_decodes(self, work: list[_Work], budget: int, out: StepOutput,
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
            slot = self._append_or_preempt(seq, lv.sample.tokens[-1], lv.req, scheduled, out)
            if slot is None:
                short = True
                if seq in proposals:
                    spec.settle(seq, 0)
                continue
            scheduled.add(lv.req)
            drafts = [int(t) for t in proposals.get(seq, ())][:k]
            slots = [slot]
            if drafts:
                try:
                    slots += m.append_tokens(seq, drafts, speculative=True)
                except OutOfBlocks:  # no room for drafts: a plain decode step
                    drafts = []
            work.append(_Work(seq, [lv.sample.tokens[-1]] + drafts, np.asarray(slots, dtype=np.int64),
                              m.num_computed(seq), drafts=drafts, proposed=seq in proposals))
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

    def _preempt_for(self, req: _Request, scheduled: set[int], out: StepOutput) -> bool:
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

    def _preempt(self, victim: _Request, out: StepOutput) -> None:
        """Recompute preemption frees the victim's blocks and queues it again: it restarts from
        its prompt, as vLLM's recompute preemption does. Its blocks stay cached, so the restart
        mostly hits them, and its samples come out the same (greedy, or the same seeded streams).
        Swap preemption (``preemption="swap"``) moves its decoding sequences to the host tier
        instead, falling back to recompute when it cannot (see :meth:`_swap_out`)."""
        if self.preemption == "swap":
            if self._swap_out(victim, out):
                return
            self.stats.swap_fallbacks += 1
        self._restart(victim)
        out.preempted.append(victim.rid)
        self.stats.preemptions += 1

    def _on_device(self, req: _Request) -> bool:
        """Whether an admitted request has a sequence that is not swapped out."""
        return req in self._prefilling or any(lv.req == req.rid for lv in self._running.values())

    def _seqs_of(self, rid: int) -> list[Hashable]:
        """A request's decoding sequences, running or swapped out."""
        return ([s for s, lv in self._running.items() if lv.req == rid]
                + [s for s, lv in self._swapped.items() if lv.req == rid])

    def _swap_out(self, victim: _Request, out: StepOutput) -> bool:
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
        private = sum(1 for seq in seqs for b in m.block_table(seq) if m.refcount(b) == 1)
        u = m.usage()
        if private > u.host_blocks - u.host_used_blocks:
            return False
        for seq in seqs:
            try:
                m.swap_out(seq)
            except OutOfBlocks:  # not expected after the check; restarting frees what was swapped
                return False
            self._swapped[seq] = self._running.pop(seq)
        self.stats.swapped_out += len(seqs)
        self.stats.swap_preemptions += 1
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
            self.stats.swapped_in += 1
            if lv.req not in out.swapped_in:
                out.swapped_in.append(lv.req)

    def _restart(self, req: _Request) -> None:
        """Free every sequence of an admitted request and queue it again, prompt only."""
        cache = not self.publish_at_admission  # between steps every scheduled position was computed
        if req in self._prefilling:
            self._prefilling.remove(req)
            self._free(req.seq, cache=cache)
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

    def _next_chunk(self, req: _Request, budget: int) -> _Work | None:
        n = min(budget, self._chunk_cap, len(req.prompt) - req.done)
        if self.publish_at_admission:  # the control: every block is already allocated and published
            slots = self.manager.slots(req.seq, req.done, req.done + n)
        else:
            n = min(n, self._room(req.seq))
            if n < 1:
                return None
            slots = self.manager.prefill(req.seq, n)
        start, req.done = req.done, req.done + n
        return _Work(req.seq, req.prompt[start:req.done], slots, req.done, req=req)

    def _admit(self, req: _Request, budget: int, out: StepOutput) -> _Work | None:
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
                hit = m.add_sequence(seq, req.prompt, cache_salt=req.cache_salt, prefill=k)
                stop = m.num_computed(seq)
        except OutOfBlocks:
            return None
        req.seq, req.hit, req.done, req.order = seq, hit, stop, next(self._admissions)
        self._prefilling.append(req)
        self.stats.prompt_tokens += len(req.prompt)
        self.stats.hit_tokens += hit
        out.admitted.append((req.rid, hit))
        out.prefill.append((req.rid, hit, stop))
        return _Work(seq, req.prompt[hit:stop], m.slots(seq, hit, stop), stop, req=req)

    def _chunk_done(self, req: _Request, rows: np.ndarray, out: StepOutput) -> None:
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
                self._fork(req.seq, seq)  # after the step's writes: the prompt's K/V exists
            tok = self._pick(logits, req.temperature, rng)
            self._running[seq] = _Live(req.rid, Sample().extended(tok, logits, 0.0), rng, k)
            seqs.append(seq)
        for seq in seqs:
            self._maybe_finish(seq, out)

    def _verify(self, w: _Work, rows: np.ndarray, out: StepOutput) -> None:
        """Choose the next tokens from the step's logits; keep the drafts that match (greedy)."""
        lv = self._running[w.seq]
        req = self._requests[lv.req]
        accepted = 0
        for j, row in enumerate(rows):
            tok = self._pick(row, req.temperature, lv.rng)
            lv.sample = lv.sample.extended(tok, row.copy(), 0.0)
            if j < len(w.drafts) and w.drafts[j] == tok:
                accepted += 1
                continue
            break
        if w.drafts:
            m = self.manager
            before = len(m.block_table(w.seq))
            m.accept(w.seq, accepted)
            freed = before - len(m.block_table(w.seq))
            st = self.stats
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
        self._free(seq, cache=cache)
        if self.speculator is not None:
            self.speculator.release(seq)

    def _drop_all(self, cache: bool) -> None:
        """Forget every request; free their sequences (``cache=False``: nothing they alone hold
        stays findable)."""
        for seq in list(self._running) + list(self._swapped):
            self._release(seq, cache=cache)
        for req in self._prefilling:
            self._free(req.seq, cache=cache)
        self._prefilling, self._waiting, self._requests = [], [], {}

    def _step_seq_id(self, rid: int) -> tuple[int, int, int]:
        return (self._tag, rid, next(self._step_serial))

    def _generate_steps(self, prompts, max_new_tokens, temperature, seed, n, beam_width, cache_salt,
                        arrivals) -> list[RequestResult]:
        """``generate`` on the step loop: add every prompt at its arrival step, step to the end."""
        if beam_width > 1:
            raise ValueError("beam search runs only in generate's default path (no token_budget, "
                             "chunk_size, speculator or arrivals)")
        if self.has_unfinished():
            raise ValueError("requests added with add_request are unfinished: step or abort them first")
        self._check_seed(seed)
        if arrivals is None:
            arrivals = [0] * len(prompts)
        arrivals = list(arrivals)
        if len(arrivals) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(arrivals)} arrivals")
        for a in arrivals:
            if isinstance(a, bool) or not isinstance(a, (int, np.integer)) or a < 0:
                raise ValueError(f"arrivals must be step numbers >= 0, got {a!r}")
        self.stats, self._alias = EngineStats(), {}
        base = self._clock
        results: dict[int, RequestResult] = {}
        try:
            rids = [self._add(p, max_new_tokens, temperature, n, cache_salt, base + int(a), (int(seed), r))
                    for r, (p, a) in enumerate(zip(prompts, arrivals))]
            while self.has_unfinished():
                results.update(self.step().finished)
        finally:
            # every scheduled position was computed unless a step raised (then it dropped all)
            self._drop_all(cache=not self.publish_at_admission)
        return [results[r] for r in rids]

    # ---- plumbing

    @staticmethod
    def _pick(logits: np.ndarray, temperature: float, rng) -> int:
        if not temperature:
            return int(np.argmax(logits))
        gumbel = -np.log(-np.log(rng.random(logits.shape[-1])))
        return int(np.argmax(logits.astype(np.float64) / temperature + gumbel))

    def _new_id(self, tag: int, req: int) -> tuple[int, int, int]:
        """Sequence ids are ``(call, request, serial)``: unique within the manager's lifetime."""
        return (tag, req, next(self._serial))

    def _fork(self, parent, child) -> None:
        self.stats.eager_fork_blocks += len(self.manager.block_table(parent))
        self.stats.forks += 1
        self.manager.fork(parent, child)

    def _free(self, seq_id, cache: bool = True) -> None:
        table = self.manager.block_table(seq_id)
        self.manager.free(seq_id, cache=cache)
        for b in table:
            if b in self._alias and self.manager.refcount(b) == 0:
                del self._alias[b]

    def _run_transfers(self) -> None:
        """Before the copies: the host tier's transfers, ``to_host`` batch then ``to_device``
        batch (``store.transfer``), or under ``run_transfers=False`` nothing at all."""
        self._step_transfers = 0
        if not self._tiered:
            return
        transfers = self.manager.take_transfers()
        if not transfers:
            return
        st = self.stats
        out = sum(1 for t in transfers if t[0] == TO_HOST)
        st.transfers_to_host += out
        st.transfers_to_device += len(transfers) - out
        self._step_transfers = len(transfers)
        if self.run_transfers:
            st.transfer_bytes += self.store.transfer(transfers)
        else:  # negative control: loaded and swapped-in blocks keep what the device block held
            st.skipped_transfers += len(transfers)

    def _run_copies(self) -> None:
        """Step 4: the queued copy-on-write copies, before any of this step's writes."""
        copies = self.manager.take_copies()
        if self.copy_on_write:
            self.stats.copied_bytes += self.store.copy_blocks(copies)
            self.stats.copied_blocks += len(copies)
        else:  # negative control: keep using the shared source block, as if never copied
            for src, dst in copies:
                self._alias[dst] = self._alias.get(src, src)

    def _forward(self, ids, feeds, slots) -> list[np.ndarray]:
        """Steps 4-5 for a batch: transfers and copies, then the model; each sequence's last logits."""
        lens = [self.manager.num_tokens(i) for i in ids]
        return [rows[-1].copy() for rows in self._forward_rows(ids, feeds, slots, lens)]

    def _forward_rows(self, ids, feeds, slots, lens) -> list[np.ndarray]:
        """Transfers, copies, then one model call; each sequence's logits, one row per query token.

        ``lens[i]`` is the length attention sees: the sequence's scheduled positions after this
        step (``num_tokens`` in the default path; the prompt's computed prefix mid-prefill).
        """
        self._run_transfers()
        self._run_copies()
        m = self.manager
        self.stats.steps += 1
        self.stats.peak_used_blocks = max(self.stats.peak_used_blocks, m.num_blocks - m.num_free_blocks)
        tables = m.block_tables(ids)
        qlens = [len(f) for f in feeds]
        if self.copy_on_write:
            return self._model_step(feeds, slots, tables, lens, qlens)
        bs, slots = m.block_size, np.asarray(slots, dtype=np.int64)
        tables, slots = self._aliased(tables), self._aliased(slots // bs) * bs + slots % bs
        out, start = [], 0
        for i, q in enumerate(qlens):  # one at a time: colliding writes land in a fixed order
            out += self._model_step([feeds[i]], slots[start:start + q], tables[i:i + 1], lens[i:i + 1], [q])
            start += q
        return out

    def _model_step(self, feeds, slots, tables, lens, qlens) -> list[np.ndarray]:
        toks = [t for f in feeds for t in f]
        logits = np.asarray(self.model.forward(self.store, toks, slots, tables, lens, qlens), dtype=np.float32)
        return np.split(logits, np.cumsum(qlens)[:-1])

    def _aliased(self, blocks: np.ndarray) -> np.ndarray:
        out = np.array(blocks, copy=True)
        for dst, src in self._alias.items():
            out[out == dst] = src
        return out
