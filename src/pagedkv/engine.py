"""The reference integration: a generation loop driving the allocator, the KV store and a model.

Read this module to see what an engine owes the allocator, in the order it owes it, every step:

1. ``add_sequence`` a prompt: the first ``hit`` tokens' K/V is already in the store (prefix
   cache); compute only ``prompt[hit:]`` into the slots of its block table.
2. ``fork`` a sequence for each extra sample or beam: no allocation, no copy.
3. ``append_batch`` the step's tokens: one slot per sequence.
4. ``store.copy_blocks(manager.take_copies())`` **before** the step writes any K/V: a fork's child
   that appends into a shared partial block got a fresh block whose first slots must hold the
   parent's tokens before attention reads them.
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
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import numpy as np

__all__ = ["Engine", "Sample", "RequestResult", "EngineStats"]


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
    """What the allocator did for one ``generate`` call.

    ``eager_fork_blocks`` is how many blocks copying at fork time would have copied (the parent's
    whole table, per fork); ``copied_blocks`` is what copy-on-write copied instead. Worked
    example: a 45-token prompt with 16-token blocks, n = 4: three forks of a 3-block table are 9
    eager copies; copy-on-write copies the partial third block for 3 of the 4 samples: 3.
    """

    steps: int = 0
    forks: int = 0
    copied_blocks: int = 0
    copied_bytes: int = 0
    eager_fork_blocks: int = 0
    peak_used_blocks: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0


@dataclass
class _Live:
    """A running sequence: which request it belongs to, its sample so far, its seeded stream."""

    req: int
    sample: Sample
    rng: np.random.Generator | None


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


class Engine:
    """Generation over a :class:`~pagedkv.KVCacheManager` and a :class:`~pagedkv.store.KVStore`.

    ``Engine(model, manager)`` makes a store shaped for the model with the manager's blocks; keep
    the engine (and so the manager) across ``generate`` calls to get prefix hits across requests.
    """

    _ids = itertools.count()

    def __init__(self, model: Any, manager: Any, store: Any = None, *, copy_on_write: bool = True) -> None:
        if not isinstance(copy_on_write, bool):
            raise ValueError(f"copy_on_write must be a bool, got {copy_on_write!r}")
        if store is None:
            store = model.new_store(manager.num_blocks, manager.block_size)
        if (store.num_blocks, store.block_size) != (manager.num_blocks, manager.block_size):
            raise ValueError(f"store has {store.num_blocks} blocks of {store.block_size}, manager "
                             f"{manager.num_blocks} of {manager.block_size}")
        self.model, self.manager, self.store = model, manager, store
        self.copy_on_write = copy_on_write
        self._alias: dict[int, int] = {}  # copy_on_write=False: block a copy went to -> its source
        self.stats = EngineStats()

    # ---- public entry point

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 temperature: float = 0.0, seed: int = 0, n: int = 1, beam_width: int = 1,
                 cache_salt: Any = None) -> list[RequestResult]:
        """Generate ``max_new_tokens`` tokens for every prompt; return results in prompt order.

        ``temperature`` 0 is greedy; above 0, sample ``k`` of prompt ``r`` draws from its own
        stream seeded by ``(seed, r, k)`` (Gumbel-max over ``logits / temperature``), so results
        do not depend on batching. ``n`` > 1 forks ``n`` samples after the prompt; ``beam_width``
        > 1 runs beam search (sum of log-probabilities, no length penalty, no EOS). Every block is
        returned to the pool when the call ends, also on error. ``self.stats`` describes the call.
        """
        self._check_generate(prompts, max_new_tokens, temperature, n, beam_width)
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

    def _free(self, seq_id) -> None:
        table = self.manager.block_table(seq_id)
        self.manager.free(seq_id)
        for b in table:
            if b in self._alias and self.manager.refcount(b) == 0:
                del self._alias[b]

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
        """Steps 4-5 for a batch: copies, then the model; returns each sequence's last logits."""
        self._run_copies()
        m = self.manager
        self.stats.steps += 1
        self.stats.peak_used_blocks = max(self.stats.peak_used_blocks, m.num_blocks - m.num_free_blocks)
        tables = m.block_tables(ids)
        lens = [m.num_tokens(i) for i in ids]
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
        ends = np.cumsum(qlens) - 1
        return [logits[e].copy() for e in ends]

    def _aliased(self, blocks: np.ndarray) -> np.ndarray:
        out = np.array(blocks, copy=True)
        for dst, src in self._alias.items():
            out[out == dst] = src
        return out
