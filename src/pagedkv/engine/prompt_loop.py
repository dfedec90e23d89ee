"""The one-prompt loop: ``generate``'s default path, with parallel sampling and beam search.

Every prompt is admitted and computed whole, one prompt per forward; then every sequence decodes
one token per forward, all in one batch, until ``max_new_tokens``. Samples (``n``) and beams
(``beam_width``) are forks of the prompt's sequence. This is the loop of the module docstring's
six duties in their plainest form, and the one the copy-on-write proof (``pagedkv report``'s
``cow_proof``) and its negative control run on.

Why beam search stays here and not in the step loop (:mod:`pagedkv.engine.step_loop`): a beam
step chooses the next beams of a request from all of its beams' logits at once, forking the
beams chosen twice and freeing those chosen never. In the step loop a request's sequences are
scheduled one by one within a token budget and may be preempted separately (recomputed or swapped
out), so a beam step would need all of a request's beams to be scheduled in the same step, and a
restart would have to replay the beams' forks. vLLM makes the same call: ``LLM.beam_search`` runs above
its engine, not in the scheduler. docs/design.md (section 1, the engine package)
has the numbers.

Owns the per-call state: the call's tag and sequence serial, and the live sequences. May import
numpy and the package's executor and records.
"""
from __future__ import annotations

import itertools
from typing import Any, Hashable, Sequence

import numpy as np

from .executor import Executor, new_tag, pick_token
from .records import LiveSequence, RequestResult, Sample

__all__ = ["PromptLoop", "log_softmax"]


def log_softmax(x: np.ndarray) -> np.ndarray:
    """``log(softmax(x))`` along the last axis, in float64 (beam scores add these up)."""
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


class PromptLoop:
    """One ``generate`` call on the default path. ``run`` returns the results in prompt order and
    frees every sequence it made, also on error."""

    def __init__(self, executor: Executor) -> None:
        self.ex, self.manager = executor, executor.manager
        self._tag = new_tag()
        self._serial = itertools.count()
        self._live: dict[Hashable, LiveSequence] = {}

    def run(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float, seed: int,
            n: int, beam_width: int, cache_salt: Any) -> list[RequestResult]:
        live = self._live
        try:
            results, first = self._prefill(prompts, cache_salt)
            self._start(results, first, temperature, seed, n, beam_width)
            for _ in range(max_new_tokens - 1):
                logits = self._decode()
                self._choose(logits, results, temperature, beam_width)
            for lv in live.values():
                results[lv.req].samples.append(lv.sample)
        finally:
            for seq_id in list(live):
                self.ex.free(seq_id)
        if beam_width > 1:
            for r in results:
                r.samples.sort(key=lambda s: -s.logprob)
        return results

    def _new_id(self, req: int) -> tuple[int, int, int]:
        """Sequence ids are ``(call, request, serial)``: unique within the manager's lifetime."""
        return (self._tag, req, next(self._serial))

    def _prefill(self, prompts, cache_salt):
        """Admit each prompt and compute its uncached tail at once, one prompt per forward.

        Why not admit all and prefill them in one batch: ``add_sequence`` publishes a prompt's full
        blocks to the prefix cache on admission, before their K/V exists. If a later admission
        then ran out of blocks, the earlier prompts would be freed uncomputed and leave cached
        blocks of garbage for the next request to hit. Computing each prompt right after its
        admission keeps every published block's K/V real.
        """
        m, st, results, first = self.manager, self.ex.stats, [], {}
        for r, prompt in enumerate(prompts):
            prompt = list(prompt)
            seq_id = self._new_id(r)
            hit = m.add_sequence(seq_id, prompt, cache_salt=cache_salt)
            self._live[seq_id] = LiveSequence(r, Sample(), None)
            results.append(RequestResult(prompt, hit, []))
            st.prompt_tokens += len(prompt)
            st.hit_tokens += hit
            (first[seq_id],) = self.ex.forward_last([seq_id], [prompt[hit:]], m.slots(seq_id, hit, len(prompt)))
        return results, first

    def _start(self, results, first, temperature, seed, n, beam_width) -> None:
        """Fork each prompt into its samples or beams and choose their first tokens."""
        live = self._live
        for seq_id, logits in first.items():
            r = live[seq_id].req
            if beam_width > 1:
                lp = log_softmax(logits)
                top = np.argsort(-lp, kind="stable")[:beam_width]
                picks, rngs = [(int(t), float(lp[t])) for t in top], [None] * beam_width
            else:
                rngs = [np.random.default_rng([seed, r, k]) if temperature else None for k in range(n)]
                picks = [(pick_token(logits, temperature, g), 0.0) for g in rngs]
            for k, (tok, lp_tok) in enumerate(picks):
                child = seq_id if k == 0 else self._new_id(r)
                if k:
                    self.ex.fork(seq_id, child)
                live[child] = LiveSequence(r, Sample().extended(tok, logits, lp_tok), rngs[k])

    def _decode(self) -> dict[Hashable, np.ndarray]:
        """Feed every live sequence its last chosen token; return each one's next logits."""
        live = self._live
        ids = list(live)
        toks = [live[i].sample.tokens[-1] for i in ids]
        slots = self.manager.append_batch(ids, toks)
        return dict(zip(ids, self.ex.forward_last(ids, [[t] for t in toks], slots)))

    def _choose(self, logits, results, temperature, beam_width) -> None:
        live = self._live
        if beam_width == 1:
            for seq_id, lv in live.items():
                tok = pick_token(logits[seq_id], temperature, lv.rng)
                lv.sample = lv.sample.extended(tok, logits[seq_id], 0.0)
            return
        for r in range(len(results)):
            beams = [i for i in live if live[i].req == r]
            self._beam_step(beams, logits, beam_width)

    def _beam_step(self, beams, logits, beam_width) -> None:
        """Keep the ``beam_width`` best (beam, token) extensions: fork beams chosen twice or more,
        free beams chosen never."""
        live = self._live
        lps = np.stack([log_softmax(logits[b]) for b in beams])
        scores = np.asarray([live[b].sample.logprob for b in beams])[:, None] + lps
        flat = np.argsort(-scores.reshape(-1), kind="stable")[:beam_width]
        old = {b: live[b].sample for b in beams}
        used: set = set()
        for f in flat.tolist():
            row, tok = divmod(f, lps.shape[1])
            b = target = beams[row]
            if b in used:
                target = self._new_id(live[b].req)
                self.ex.fork(b, target)
                live[target] = LiveSequence(live[b].req, old[b], None)
            used.add(b)
            live[target].sample = old[b].extended(tok, logits[b], float(lps[row, tok]))
        for b in beams:
            if b not in used:
                self.ex.free(b)
                del live[b]
