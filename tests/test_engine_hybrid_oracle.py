"""The engine on a hybrid model against transformers (issue 19 section 5).

The oracle is tests/hybrid_setup.py's tiny seeded ``Qwen2ForCausalLM`` whose ``layer_types`` mix
sliding-window (7, the window counting the query itself) and full-attention layers; the engine
runs ``PagedLlama.from_transformers`` of it on ``KVCacheManager(..., groups=list(model.kv_groups))``,
every layer reading its own group's table. The same greedy tokens and logits within 1e-4 (the
Llama oracle's tolerance) through the step loop with chunked prefill, a fork (n = 2 samples), a
prefix hit on a window released by a running sequence and revived, and speculative decoding;
the negative control (a window released one position early, read through stale tables)
diverges.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedkv import KVCacheManager  # noqa: E402
from pagedkv.engine import Engine  # noqa: E402
from pagedkv.kv_specs import SlidingWindow  # noqa: E402
from pagedkv.model import PagedLlama  # noqa: E402
from pagedkv.speculative import NgramDrafter  # noqa: E402
from hybrid_setup import WINDOW, EarlyWindow, StaleTables, tiny_qwen2  # noqa: E402
from llama_setup import hf_greedy, prompts_of  # noqa: E402

pytestmark = pytest.mark.oracle
ATOL = 1e-4
PROMPTS = (5, 16, 23, 40)
NEW = 16


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs with one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen2()


@pytest.fixture(scope="module")
def model(qwen):
    return PagedLlama.from_transformers(qwen)


@pytest.fixture(scope="module")
def qwen_greedy(qwen):
    """transformers' own batched greedy generate (its sliding-window cache), computed once."""
    return hf_greedy(qwen, prompts_of(PROMPTS), NEW)


def hf_logits(hf, seq):
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0].numpy()


def sample_error(hf, prompt, sample) -> float:
    """Largest |engine - transformers| logit over a sample's steps (transformers on the whole
    sequence the sample chose)."""
    want = hf_logits(hf, list(prompt) + sample.tokens[:-1])[len(prompt) - 1:]
    return float(np.abs(np.stack(sample.logits) - want).max())


def grouped(model, num_blocks, block_size=4):
    return KVCacheManager(num_blocks, block_size, groups=list(model.kv_groups))


@pytest.mark.parametrize("block_size, budget, chunk", [(4, 8, 5), (16, 24, None)])
def test_step_loop_greedy_matches_transformers(model, qwen_greedy, block_size, budget, chunk):
    """Four prompts arriving at steps 0-3, prefilled in chunks mixed with decodes, windows
    released as they move: transformers' greedy tokens and logits."""
    tokens, logits = qwen_greedy
    m = grouped(model, 96 if block_size == 4 else 24, block_size)
    engine = Engine(model, m, token_budget=budget, chunk_size=chunk)
    res = engine.generate(prompts_of(PROMPTS), NEW, arrivals=[0, 1, 2, 3])
    for i, r in enumerate(res):
        assert r.samples[0].tokens == tokens[i].tolist()
        np.testing.assert_allclose(np.stack(r.samples[0].logits), logits[i], atol=ATOL, rtol=0)
    assert engine.stats.prefill_chunks > len(PROMPTS) and engine.stats.mixed_steps > 0
    assert m.num_free_blocks == m.num_blocks
    m.check_invariants()


def test_fork_matches_transformers(qwen, model):
    """n = 2 samples of a 22-token prompt: the fork shares the partial block of both tables and
    each sample's first append copies it; each sample matches transformers on its own tokens."""
    m = grouped(model, 64)
    engine = Engine(model, m, token_budget=16)
    prompt = prompts_of([22], seed=6)[0]
    (res,) = engine.generate([prompt], 12, n=2, temperature=1.0, seed=1)
    assert res.samples[0].tokens != res.samples[1].tokens
    assert engine.stats.copied_blocks == 2 and engine.stats.forks == 1
    assert max(sample_error(qwen, prompt, s) for s in res.samples) < ATOL


def test_prefix_hit_on_a_released_then_revived_window(qwen, model):
    """A (40 tokens) decodes and its sliding group releases blocks 0-7; B shares A's first 32
    tokens and arrives while A runs: a 32-token hit that revives blocks 6 and 7 (position 32
    reads 26 .. 32); both match transformers."""
    m = grouped(model, 64)
    engine = Engine(model, m, token_budget=64)
    a = prompts_of([40], seed=7)[0]
    b = a[:32] + prompts_of([9], seed=8)[0]
    engine.add_request(a, 10)
    for _ in range(4):
        engine.step()
    (seq,) = m.seq_ids()
    released = m.block_table(seq, group=0)[:8]
    hit = m.lookup(b)
    assert released == [-1] * 8 and (hit, hit.revived) == (32, 2)
    rb = engine.add_request(b, 10)
    res = {}
    while engine.has_unfinished():
        out = engine.step()
        res.update(out.finished)
    assert res[rb].hit_tokens == 32
    assert sample_error(qwen, b, res[rb].samples[0]) < ATOL
    assert sample_error(qwen, a, res[0].samples[0]) < ATOL


def test_speculative_decoding_matches_transformers(qwen, model, qwen_greedy):
    tokens, logits = qwen_greedy
    m = grouped(model, 96)
    engine = Engine(model, m, token_budget=32, speculator=NgramDrafter(num_drafts=3))
    res = engine.generate(prompts_of(PROMPTS), NEW)
    for i, r in enumerate(res):
        assert r.samples[0].tokens == tokens[i].tolist()
        np.testing.assert_allclose(np.stack(r.samples[0].logits), logits[i], atol=ATOL, rtol=0)
    assert engine.stats.verify_steps > 0


def test_a_window_released_one_position_early_diverges(qwen, model, qwen_greedy):
    """The negative control: the manager's window releases one position early and the model
    reads the released block (stale table, garbage in it): the logits leave transformers'."""
    _, logits = qwen_greedy
    groups = [EarlyWindow(WINDOW) if s == SlidingWindow(WINDOW) else s for s in model.kv_groups]
    stale = StaleTables(96, 4, groups=groups)
    engine = Engine(model, stale, token_budget=8, chunk_size=5)
    stale.store = engine.store
    res = engine.generate(prompts_of(PROMPTS), NEW)
    assert max(np.abs(np.stack(r.samples[0].logits) - want).max() for r, want in zip(res, logits)) > 0.1
