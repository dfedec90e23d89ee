"""The modern engine loop against transformers: chunked prefill, a request admitted mid-prefill,
speculative decoding, and the negative control that publishes at admission.

The oracle is a seeded random ``LlamaForCausalLM`` (nothing downloaded) running transformers'
own greedy ``generate`` with its own cache. The paged engine runs the same weights on both model
backends with its K/V only in the paged store, so equal tokens and logits within 1e-4 (the
existing tolerance: float noise is ~2e-6) mean every chunk's slots, every prefix hit and every
rolled-back draft were right.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedkv import KVCacheManager  # noqa: E402
from pagedkv.engine import Engine  # noqa: E402
from pagedkv.model import PagedLlama  # noqa: E402
from pagedkv.speculative import DraftModelDrafter, NgramDrafter  # noqa: E402
from llama_setup import hf_greedy, prompts_of  # noqa: E402
from engine_checks import CountingManager, check_spec_counts  # noqa: E402

pytestmark = pytest.mark.oracle

ATOL = 1e-4
PROMPTS = (5, 16, 23, 40, 100)  # inside, on and across 16-token blocks; 100 spans two 64-chunks
NEW = 24


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs with one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def oracle(hf):
    return hf_greedy(hf, prompts_of(PROMPTS), NEW)


def max_error(results, oracle) -> float:
    """Largest |logit difference| against the oracle; asserts the tokens are the oracle's."""
    tokens, logits = oracle
    err = 0.0
    for i, r in enumerate(results):
        (s,) = r.samples
        assert s.tokens == tokens[i].tolist()
        err = max(err, float(np.abs(np.stack(s.logits) - logits[i]).max()))
    return err


# ---- chunked prefill


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_prefill_gives_transformers_greedy(model, oracle, chunk):
    engine = Engine(model, KVCacheManager(128, 16), token_budget=chunk)
    results = engine.generate(prompts_of(PROMPTS), NEW)
    err = max_error(results, oracle)
    assert err < ATOL
    st = engine.stats
    assert st.max_step_tokens == min(chunk, max(PROMPTS))  # the budget is used, never exceeded
    assert st.prefill_tokens == sum(PROMPTS) and st.decode_tokens == len(PROMPTS) * (NEW - 1)
    assert st.prefill_chunks >= sum(-(-n // chunk) for n in PROMPTS)
    if chunk > 1:
        assert st.mixed_steps > 0  # prompt chunks and decodes did share forwards
    assert engine.manager.num_free_blocks == 128
    print(f"\n[{model.backend}] chunk {chunk}: max |logit - transformers| {err:.2e}, "
          f"{st.steps} forwards, {st.mixed_steps} mixed")


# ---- a second request admitted while the first is mid-prefill

BS, SHARED = 16, 64  # the second prompt repeats the first one's first 64 tokens


def two_requests(model, control: bool):
    """A (96 tokens) arrives at step 0, B (A's first 64 + 9 of its own) at step 2; budget 32,
    at most 16 prompt tokens per request per step. Returns (engine, results, B's admission step)."""
    a = prompts_of([96], seed=7)[0]
    b = a[:SHARED] + prompts_of([9], seed=8)[0]
    engine = Engine(model, KVCacheManager(64, BS), token_budget=32, chunk_size=16,
                    publish_at_admission=control)
    engine.add_request(a, 8)
    engine.add_request(b, 8, arrival=2)
    results, admitted = {}, None
    while engine.has_unfinished():
        out = engine.step()
        if out.admitted and out.admitted[0][0] == 1:
            admitted = out
        results.update(out.finished)
    return engine, (a, b), results, admitted


def test_request_admitted_mid_prefill_hits_only_computed_blocks(hf, model):
    engine, (a, b), results, step = two_requests(model, control=False)
    # step 2 schedules A's third chunk first (positions 32..48, publishing block 2), then admits B
    assert step.step == 2 and (0, 32, 48) in step.prefill
    assert step.admitted == [(1, 48)]  # 3 blocks: computed before, or in this very forward
    assert results[1].hit_tokens == 48 < SHARED
    assert engine.manager.usage().prefix_hit_tokens == 48
    for rid, prompt in ((0, a), (1, b)):
        tokens, logits = hf_greedy(hf, [prompt], 8)
        (s,) = results[rid].samples
        assert s.tokens == tokens[0].tolist()
        np.testing.assert_allclose(np.stack(s.logits), logits[0], atol=ATOL, rtol=0)


def test_negative_control_publishing_at_admission_diverges(hf, model):
    engine, (a, b), results, step = two_requests(model, control=True)
    assert step.step == 2 and step.admitted == [(1, SHARED)]  # block 3 was never computed
    tokens, logits = hf_greedy(hf, [b], 8)
    err = float(np.abs(np.stack(results[1].samples[0].logits) - logits[0]).max())
    assert err > 1e-2, err
    ta, la = hf_greedy(hf, [a], 8)  # the first request itself is unharmed
    np.testing.assert_allclose(np.stack(results[0].samples[0].logits), la[0], atol=ATOL, rtol=0)
    print(f"\n[{model.backend}] publish at admission: B hit {results[1].hit_tokens} tokens, "
          f"max |logit - transformers| {err:.3f}")


# ---- speculative decoding


def layer_skip_draft(hf, backend):
    """A smaller draft model: the target's first layer only (its embedding, norm and head)."""
    cfg = copy.deepcopy(hf.config)
    cfg.num_hidden_layers = 1
    sd = {k: v for k, v in hf.state_dict().items() if ".layers.1." not in k}
    return PagedLlama.from_state_dict(sd, cfg, backend=backend)


@pytest.mark.parametrize("drafter", ["ngram", "draft model"])
def test_speculative_decoding_gives_exactly_greedy(hf, model, oracle, drafter):
    if drafter == "ngram":
        spec = NgramDrafter(num_drafts=4)
    else:
        spec = DraftModelDrafter(layer_skip_draft(hf, model.backend), CountingManager(128, 16), 4)
    manager = CountingManager(128, 16)
    engine = Engine(model, manager, speculator=spec)
    err = max_error(engine.generate(prompts_of(PROMPTS), NEW), oracle)
    assert err < ATOL
    check_spec_counts(engine, manager)
    st = engine.stats
    assert 0 < st.accepted_tokens < st.draft_tokens  # drafts were both kept and rolled back
    assert st.steps <= NEW  # one prefill forward, then at most one per remaining token
    if drafter == "draft model":
        dm = spec.manager
        assert spec.rollback_blocks == sum(f for *_, f in dm.accepts)
        assert dm.num_free_blocks == dm.num_blocks
    print(f"\n[{model.backend}] {drafter}: acceptance {st.acceptance_rate:.3f} "
          f"({st.accepted_tokens}/{st.draft_tokens}), {st.rollback_blocks} blocks freed by rollback, "
          f"{st.steps} forwards, max |logit - transformers| {err:.2e}")


def test_speculation_with_chunked_prefill_and_late_arrivals(hf, model, oracle):
    spec = DraftModelDrafter(layer_skip_draft(hf, model.backend), KVCacheManager(128, 16), 3)
    manager = CountingManager(128, 16)
    engine = Engine(model, manager, token_budget=16, speculator=spec)
    results = engine.generate(prompts_of(PROMPTS), NEW, arrivals=[0, 3, 3, 9, 20])
    assert max_error(results, oracle) < ATOL
    assert engine.stats.max_step_tokens <= 16 and engine.stats.mixed_steps > 0
    check_spec_counts(engine, manager)
