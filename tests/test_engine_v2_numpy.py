"""The modern engine loop on the numpy decoder: paged against ``dense_forward``, no torch needed.

The same checks as test_engine_v2_oracle.py (chunked prefill at chunk sizes 1/7/16/64, a request
admitted mid-prefill, speculative decoding, the publish-at-admission control) with the dense
reference as the judge (the same weights over each whole sequence, causal attention, no paging:
test_model_numpy.py checks it against transformers), plus the step loop's own contract: the
budget, arrivals, the model's write-before-read within a step, memory pressure, aborts and bad
arguments.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import KVCacheManager, OutOfBlocks
from pagedkv.engine import Engine
from pagedkv.model import LlamaDims, PagedLlama
from pagedkv.speculative import DraftModelDrafter, NgramDrafter, ngram_drafts
from llama_setup import DIMS, prompts_of
from engine_checks import CountingManager, check_spec_counts

ATOL = 1e-4  # float32: paged and dense differ by ~2e-6 (summation order)
PROMPTS = (5, 16, 23, 40, 100)
NEW = 16


@pytest.fixture(scope="module")
def model():
    return PagedLlama.random(DIMS, seed=0)


def greedy_error(model, prompt, sample) -> float:
    """Largest |paged - dense| logit over a sample's steps; asserts each token is the dense
    argmax (so the tokens are greedy decoding's: row ``len(prompt) - 1 + t`` predicts token t)."""
    ref = model.dense_forward(prompt + sample.tokens[:-1])[len(prompt) - 1:]
    assert sample.tokens == np.argmax(ref, axis=-1).tolist()
    return float(np.abs(np.stack(sample.logits) - ref).max())


def max_error(model, prompts, results) -> float:
    """Largest |paged - dense| logit over every result; asserts greedy tokens."""
    return max(greedy_error(model, p, r.samples[0]) for p, r in zip(prompts, results))


def dense_error(model, prompt, sample) -> float:
    ref = model.dense_forward(prompt + sample.tokens[:-1])[len(prompt) - 1:]
    return float(np.abs(np.stack(sample.logits) - ref).max())


def sub_model(model, layers=None, seed=None):
    """A smaller draft: the target's first ``layers`` layers, or a random 1-layer model."""
    if seed is not None:
        return PagedLlama.random(dataclasses.replace(DIMS, num_layers=1), seed=seed)
    w = {k: v for k, v in model.w.items()
         if ".layers." not in k or int(k.split(".")[2]) < layers}
    return PagedLlama.from_state_dict(w, dataclasses.replace(DIMS, num_layers=layers))


# ---- the model: a layer's K/V for the whole step is written before any attention reads


@pytest.mark.parametrize("reader_first", [False, True])
def test_a_block_written_in_the_same_forward_is_read_correctly(model, reader_first):
    """Sequence W computes block 0 (positions 0..15); sequence R hits that block and computes
    positions 16..20 in the same forward call, reading block 0 through its table. Whatever the
    order in the batch, R's logits equal the dense run: each layer writes every new K/V first."""
    prompt = prompts_of([21], seed=3)[0]
    bs, store = 16, model.new_store(4, 16)
    w = ("W", prompt[:16], [0 * bs + i for i in range(16)], [0, -1], 16, 16)
    r = ("R", prompt[16:], [1 * bs + i for i in range(5)], [0, 1], 21, 5)
    batch = [r, w] if reader_first else [w, r]
    tables = np.array([b[3] for b in batch])
    out = model.forward(store, sum((b[1] for b in batch), []), sum((b[2] for b in batch), []),
                        tables, [b[4] for b in batch], [b[5] for b in batch])
    rows = out[:5] if reader_first else out[16:]
    np.testing.assert_allclose(rows, model.dense_forward(prompt)[16:], atol=ATOL, rtol=0)


# ---- chunked prefill


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_prefill_equals_the_dense_reference(model, chunk):
    engine = Engine(model, KVCacheManager(128, 16), token_budget=chunk)
    prompts = prompts_of(PROMPTS)
    assert max_error(model, prompts, engine.generate(prompts, NEW)) < ATOL
    st = engine.stats
    assert st.max_step_tokens == min(chunk, max(PROMPTS))
    assert st.prefill_tokens == st.prompt_tokens == sum(PROMPTS)
    assert st.decode_tokens == len(PROMPTS) * (NEW - 1)
    assert (st.mixed_steps > 0) == (chunk > 1)
    assert engine.manager.num_free_blocks == 128
    engine.manager.check_invariants()


def test_budget_is_never_exceeded_and_chunks_follow_the_rules(model):
    prompts = prompts_of([40, 30, 9], seed=2)
    engine = Engine(model, KVCacheManager(64, 16), token_budget=12, chunk_size=8)
    for p in prompts:
        engine.add_request(p, 4)
    outs = []
    while engine.has_unfinished():
        outs.append(engine.step())
    assert all(o.tokens <= 12 for o in outs)
    assert all(stop - start <= 8 for o in outs for _, start, stop in o.prefill)
    # the first step: request 0 gets a chunk of 8, request 1 is admitted with the last 4 tokens
    assert outs[0].admitted == [(0, 0), (1, 0)] and outs[0].prefill == [(0, 0, 8), (1, 0, 4)]
    for rid, p in enumerate(prompts):  # each prompt's chunks tile it, in order
        spans = [(a, b) for o in outs for r, a, b in o.prefill if r == rid]
        assert spans[0][0] == 0 and spans[-1][1] == len(p)
        assert all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
    assert sum(len(o.finished) for o in outs) == 3
    assert engine.stats.steps == len(outs) and engine.manager.num_free_blocks == 64


def test_default_step_loop_equals_generates_default_path(model):
    """No budget: the step loop admits every arrived prompt whole; tokens equal the old path."""
    prompts = prompts_of([12, 33, 7], seed=4)
    old = Engine(model, KVCacheManager(64, 4)).generate(prompts, 6, temperature=0.9, seed=5, n=3)
    new = Engine(model, KVCacheManager(64, 4)).generate(prompts, 6, temperature=0.9, seed=5, n=3,
                                                        arrivals=[0, 0, 0])
    for a, b in zip(old, new):
        assert [s.tokens for s in a.samples] == [s.tokens for s in b.samples]


def test_sampling_forks_after_a_chunked_prompt(model):
    """n = 3 samples fork when the last chunk has run; seeded streams as in the default path."""
    prompts = prompts_of([45, 21], seed=6)
    old = Engine(model, KVCacheManager(128, 4)).generate(prompts, 8, temperature=1.0, seed=2, n=3)
    engine = Engine(model, KVCacheManager(128, 4), token_budget=10)
    new = engine.generate(prompts, 8, temperature=1.0, seed=2, n=3)
    for p, a, b in zip(prompts, old, new):
        assert [s.tokens for s in a.samples] == [s.tokens for s in b.samples]
        assert all(dense_error(model, p, s) < ATOL for s in b.samples)
    assert engine.stats.forks == 4 and engine.stats.copied_blocks == 2 * 2  # 45, 21: partial blocks


# ---- a request admitted while another is mid-prefill, and the control


def two_requests(model, control):
    a = prompts_of([96], seed=7)[0]
    b = a[:64] + prompts_of([9], seed=8)[0]
    engine = Engine(model, KVCacheManager(64, 16), token_budget=32, chunk_size=16,
                    publish_at_admission=control)
    engine.add_request(a, 8)
    engine.add_request(b, 8, arrival=2)
    outs, results = [], {}
    while engine.has_unfinished():
        outs.append(engine.step())
        results.update(outs[-1].finished)
    return engine, (a, b), outs, results


def test_request_admitted_mid_prefill_hits_only_computed_blocks(model):
    engine, (a, b), outs, results = two_requests(model, control=False)
    assert [o.prefill for o in outs[:4]] == [[(0, 0, 16)], [(0, 16, 32)], [(0, 32, 48), (1, 48, 64)],
                                            [(0, 48, 64), (1, 64, 73)]]
    # B is admitted in step 2, after A's chunk 32..48 published block 2: 3 blocks, not 4
    assert outs[2].admitted == [(1, 48)] and results[1].hit_tokens == 48
    assert engine.manager.usage().prefix_hit_tokens == 48
    for rid, prompt in ((0, a), (1, b)):
        assert greedy_error(model, prompt, results[rid].samples[0]) < ATOL


def test_control_publishing_at_admission_diverges(model):
    engine, (a, b), outs, results = two_requests(model, control=True)
    assert outs[2].admitted == [(1, 64)]  # block 3 (positions 48..63) is only computed in step 3
    assert dense_error(model, b, results[1].samples[0]) > 1e-2
    assert dense_error(model, a, results[0].samples[0]) < ATOL


def test_lookup_during_chunked_prefill_sees_only_scheduled_blocks(model):
    a = prompts_of([70], seed=9)[0]
    engine = Engine(model, KVCacheManager(32, 16), token_budget=20)
    engine.add_request(a, 2)
    seen = []
    while engine.has_unfinished():
        engine.step()
        seen.append(engine.manager.lookup(a + [1]))
    # chunks end at 20, 40, 60, 70: full blocks 1, 2, 3, 4 published; then decodes
    assert seen[:4] == [16, 32, 48, 64]


# ---- speculative decoding


@pytest.mark.parametrize("drafter", ["ngram", "layer skip", "same model", "unrelated model"])
def test_speculative_decoding_equals_greedy(model, drafter):
    draft_manager = CountingManager(128, 16)
    spec = {"ngram": lambda: NgramDrafter(4),
            "layer skip": lambda: DraftModelDrafter(sub_model(model, layers=1), draft_manager, 4),
            "same model": lambda: DraftModelDrafter(model, draft_manager, 4),
            "unrelated model": lambda: DraftModelDrafter(sub_model(model, seed=5), draft_manager, 4)}[drafter]()
    manager = CountingManager(128, 16)
    engine = Engine(model, manager, speculator=spec)
    prompts = prompts_of(PROMPTS)
    assert max_error(model, prompts, engine.generate(prompts, NEW)) < ATOL
    check_spec_counts(engine, manager)
    st = engine.stats
    if drafter == "same model":  # every draft is right: k + 1 tokens per forward, nothing freed
        assert st.acceptance_rate == 1.0 and st.rollback_blocks == 0
        assert st.steps == 1 + -(-(NEW - 1) // 5)
    elif drafter == "unrelated model":
        assert st.accepted_tokens == 0 and st.rollback_blocks > 0
    else:
        assert 0 < st.accepted_tokens < st.draft_tokens
    if drafter != "ngram":
        assert spec.rollback_blocks == sum(f for *_, f in draft_manager.accepts)
        assert draft_manager.num_free_blocks == draft_manager.num_blocks
        draft_manager.check_invariants()


def test_speculation_with_chunked_prefill_arrivals_and_a_small_budget(model):
    """Running sequences come first: 1 + 3 drafts each, the rest of the budget goes to prompts."""
    manager = CountingManager(128, 16)
    spec = DraftModelDrafter(model, KVCacheManager(128, 16), 3)
    engine = Engine(model, manager, token_budget=8, speculator=spec)
    prompts = prompts_of(PROMPTS)
    results = engine.generate(prompts, NEW, arrivals=[0, 2, 2, 7, 30])
    assert max_error(model, prompts, results) < ATOL
    assert engine.stats.max_step_tokens == 8 and engine.stats.mixed_steps > 0
    assert engine.stats.acceptance_rate == 1.0  # the draft model is the target itself
    check_spec_counts(engine, manager)


def test_drafts_respect_max_new_tokens(model):
    engine = Engine(model, CountingManager(64, 4), speculator=DraftModelDrafter(model, KVCacheManager(64, 4), 8))
    (r,) = engine.generate(prompts_of([9]), 3)
    # the prompt's forward chooses token 1; one verify step of token 1 + 1 draft gives 2 and 3
    assert len(r.samples[0].tokens) == 3 and engine.stats.draft_tokens == 1 and engine.stats.steps == 2


def test_ngram_drafts_worked_examples():
    assert ngram_drafts([5, 6, 7, 9, 5, 6], 2) == [7, 9]
    assert ngram_drafts([8, 8, 8, 8, 8], 3) == [8, 8]  # the earliest [8, 8, 8] is followed by two
    assert ngram_drafts([1, 2, 3, 4, 1, 2, 3, 5, 2, 3], 2, max_ngram=2) == [5, 2]  # latest [2, 3]
    assert ngram_drafts([1, 2, 3], 2) == [] and ngram_drafts([4], 2) == []
    assert ngram_drafts([3, 1, 2, 3], 4, max_ngram=3, min_ngram=2) == []  # only a 1-gram repeats
    assert NgramDrafter(2).propose([("a", [7, 1, 7], 5), ("b", [1, 2], 0)]) == {"a": [1, 7]}


# ---- memory pressure, aborts, arguments


def test_small_pool_preempts_the_latest_request_and_it_restarts(model):
    """8 blocks of 4, two prompts of 14 that grow to 25 tokens (7 blocks) each: both are admitted
    while blocks last; when the first needs a 5th block, the second (4 blocks) is preempted: its 3
    full blocks stay cached, its partial one goes back clean. The first then grows to 7 blocks,
    evicting 2 of those 3, tail first, so the restarted second request hits the first block only."""
    prompts = prompts_of([14, 14], seed=11)
    engine = Engine(model, KVCacheManager(8, 4), token_budget=8)
    for p in prompts:
        engine.add_request(p, 12)
    outs = []
    while engine.has_unfinished():
        outs.append(engine.step())
    preempted = [o for o in outs if o.preempted]
    assert [o.preempted for o in preempted] == [[1]] and engine.stats.preemptions == 1
    admissions = [(o.step, a) for o in outs for a in o.admitted]
    assert [a for _, a in admissions] == [(0, 0), (1, 0), (1, 4)]
    first_done = next(o.step for o in outs if 0 in o.finished)
    assert admissions[-1][0] == first_done + 1  # readmitted as soon as request 0 freed its blocks
    results = {rid: r for o in outs for rid, r in o.finished.items()}
    for rid, p in enumerate(prompts):
        assert greedy_error(model, p, results[rid].samples[0]) < ATOL
    assert engine.stats.peak_used_blocks == 8 and engine.manager.num_free_blocks == 8


def test_a_step_where_nothing_fits_raises_and_generate_frees_everything(model):
    manager = KVCacheManager(6, 4)
    engine = Engine(model, manager, token_budget=4)
    with pytest.raises(OutOfBlocks):
        engine.generate(prompts_of([10]), 30, n=2, temperature=1.0)
    assert manager.num_free_blocks == 6 and manager.num_sequences == 0 and not engine.has_unfinished()
    manager.check_invariants()


def test_idle_steps_until_arrival_and_abort(model):
    manager = KVCacheManager(32, 4)
    engine = Engine(model, manager, token_budget=6)
    late = engine.add_request(prompts_of([5])[0], 4, arrival=3)
    assert [engine.step().tokens for _ in range(3)] == [0, 0, 0] and engine.stats.idle_steps == 3
    mid = engine.add_request(prompts_of([20], seed=1)[0], 4)
    out = engine.step()
    assert out.admitted == [(late, 0), (mid, 0)] and out.prefill == [(late, 0, 5), (mid, 0, 1)]
    engine.step()
    engine.abort(mid)  # mid-prefill
    engine.abort(late)  # decoding
    assert not engine.has_unfinished() and manager.num_free_blocks == 32
    with pytest.raises(KeyError):
        engine.abort(late)
    waiting = engine.add_request([1, 2, 3], 2, arrival=99)
    engine.abort(waiting)
    assert engine.step().tokens == 0
    manager.check_invariants()


def test_bad_arguments(model):
    m = KVCacheManager(16, 4)
    for kwargs in ({"token_budget": 0}, {"token_budget": True}, {"chunk_size": 1.5},
                   {"publish_at_admission": 1}, {"publish_at_admission": True},
                   {"speculator": object()}, {"speculator": NgramDrafter.__new__(NgramDrafter)},
                   {"speculator": DraftModelDrafter(PagedLlama.random(dataclasses.replace(DIMS, vocab_size=128)),
                                                    KVCacheManager(8, 4))}):
        with pytest.raises(ValueError):
            Engine(model, m, **kwargs)
    with pytest.raises(ValueError):
        NgramDrafter(0)
    with pytest.raises(ValueError):
        NgramDrafter(2, max_ngram=1, min_ngram=2)
    engine = Engine(model, m, token_budget=4, speculator=NgramDrafter(2))
    for prompts, kwargs in (([[1, 2]], {"temperature": 0.5}), ([[1, 2]], {"beam_width": 2}),
                            ([[1, 2]], {"arrivals": [0, 1]}), ([[1, 2]], {"arrivals": [-1]}),
                            ([[1, 256]], {}), ([[1, 2]], {"cache_salt": 1.5})):
        with pytest.raises(ValueError):
            engine.generate(prompts, 2, **kwargs)
    for kwargs in ({"arrival": -1}, {"seed": -2}, {"cache_salt": [1]}, {"n": 0}):
        with pytest.raises(ValueError):
            engine.add_request([1, 2], 2, **kwargs)
    assert not engine.has_unfinished() and m.num_free_blocks == 16 and m.usage().prefix_query_tokens == 0
    engine.add_request([1, 2], 2)
    with pytest.raises(ValueError):  # generate will not mix with requests already added
        engine.generate([[3]], 1)


MQA64 = PagedLlama.random(LlamaDims(256, 32, 48, 2, 4, 1, 8, rope_theta=100.0), seed=1, dtype="float64")


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3), budget=st.integers(1, 24),
       chunk=st.one_of(st.none(), st.integers(1, 12)), block_size=st.sampled_from([1, 4, 16]),
       speculate=st.booleans(), data=st.data())
def test_any_schedule_equals_dense_in_float64(lengths, budget, chunk, block_size, speculate, data):
    """Any budget, chunk cap, arrivals and block size, with or without n-gram drafts: in float64
    every logit equals the dense run to 1e-9."""
    prompts = [np.random.default_rng(n).integers(1, 4, n).tolist() for n in lengths]  # repetitive
    arrivals = data.draw(st.lists(st.integers(0, 6), min_size=len(prompts), max_size=len(prompts)))
    manager = KVCacheManager(4 + sum(-(-(n + 8) // block_size) for n in lengths) * 2, block_size)
    engine = Engine(MQA64, manager, token_budget=budget, chunk_size=chunk,
                    speculator=NgramDrafter(3) if speculate else None)
    for p, r in zip(prompts, engine.generate(prompts, 6, arrivals=arrivals)):
        s = r.samples[0]
        ref = MQA64.dense_forward(p + s.tokens[:-1])[len(p) - 1:]
        np.testing.assert_allclose(np.stack(s.logits), ref, atol=1e-9, rtol=0)
        assert s.tokens == np.argmax(ref, axis=-1).tolist()
    assert engine.stats.max_step_tokens <= budget
    assert manager.num_free_blocks == manager.num_blocks


def test_a_draft_model_without_blocks_proposes_nothing_and_generation_goes_on(model):
    """The draft manager (2 blocks of 4) cannot hold these prompts: no drafts, same tokens."""
    prompts = prompts_of([9, 30], seed=12)
    spec = DraftModelDrafter(model, KVCacheManager(2, 4), 4)
    engine = Engine(model, KVCacheManager(64, 4), speculator=spec)
    assert max_error(model, prompts, engine.generate(prompts, 6)) < ATOL
    assert engine.stats.draft_tokens == 0 and spec.proposed == 0 and spec.forwards == 0
    assert spec.manager.num_free_blocks == 2


def test_the_engine_reads_back_its_options_and_refuses_to_change_them(model):
    """Each option is held by the part that uses it (the executor or the step loop); the engine
    reads it from there, and an assignment after construction fails loudly instead of leaving the
    loop's checks behind."""
    spec = NgramDrafter(3)
    engine = Engine(model, KVCacheManager(64, 16), token_budget=32, chunk_size=8, speculator=spec)
    assert (engine.token_budget, engine.chunk_size, engine.speculator, engine.copy_on_write,
            engine.run_transfers, engine.publish_at_admission, engine.preemption) == (
        32, 8, spec, True, True, False, "recompute")
    assert engine.uses_step_loop and not Engine(model, KVCacheManager(64, 16)).uses_step_loop
    for name in ("token_budget", "copy_on_write", "preemption"):
        with pytest.raises(AttributeError):
            setattr(engine, name, None)
    assert engine.token_budget == 32
