"""The reference engine on the real allocator: sharing by fork, copy-on-write, beams, prefix hits.

Every check compares against transformers' LlamaForCausalLM run over the sample's *full* token
sequence without any cache, so nothing the allocator shares or copies can leak into the oracle.
The engine runs the same weights on both model backends (torch and numpy).
"""
from __future__ import annotations

import numpy as np
import pytest

from pagedkv import KVCacheManager, OutOfBlocks

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedkv.engine import Engine  # noqa: E402
from pagedkv.engine.prompt_loop import log_softmax as _log_softmax  # noqa: E402

pytestmark = pytest.mark.oracle  # every test here runs the transformers model (as oracle or weights)

@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs with one torch thread (see conftest)."""


def prompt_of(n, seed=0):
    return np.random.default_rng(seed).integers(1, 256, n).tolist()


def oracle_error(hf, prompt, sample) -> float:
    """Largest |logit difference| between the engine's per-step logits and a cache-free forward
    of ``prompt + tokens`` (position ``len(prompt) - 1 + t`` predicts token ``t``)."""
    seq = prompt + sample.tokens[:-1]
    with torch.no_grad():
        ref = hf(torch.tensor([seq]), use_cache=False).logits[0, len(prompt) - 1:].numpy()
    return float(np.abs(np.stack(sample.logits) - ref).max())


def blocks_for(tokens, bs):
    return -(-tokens // bs)


# ---- parallel sampling


def run_parallel(model, copy_on_write, prompt_len=21, new=16, bs=4, n=4):
    engine = Engine(model, KVCacheManager(64, bs), copy_on_write=copy_on_write)
    prompt = prompt_of(prompt_len, seed=3)
    (res,) = engine.generate([prompt], new, temperature=1.0, seed=7, n=n)
    return engine, prompt, res


def test_parallel_sampling_n4_matches_uncached_forward_and_shares_blocks(hf, model):
    engine, prompt, res = run_parallel(model, copy_on_write=True)
    assert len(res.samples) == 4 and len({tuple(s.tokens) for s in res.samples}) > 1
    for s in res.samples:
        assert len(s.tokens) == len(s.logits) == 16
        assert oracle_error(hf, prompt, s) < 1e-4
    # each sample holds prompt + 15 fed tokens = 36 tokens = 9 blocks of 4; the 5 full prompt
    # blocks are shared, so the peak is 5 + 4 * (9 - 5) = 21 blocks against 4 * 9 = 36
    bs, stored = 4, 21 + 16 - 1
    independent = 4 * blocks_for(stored, bs)
    shared = len(prompt) // bs
    assert engine.stats.peak_used_blocks == shared + 4 * (blocks_for(stored, bs) - shared) == 21
    assert engine.stats.peak_used_blocks < independent == 36
    # the partial prompt block was copied for 3 samples; the 4th (last holder) wrote in place
    assert engine.stats.copied_blocks == 3 and engine.stats.eager_fork_blocks == 3 * 6
    assert engine.manager.num_free_blocks == 64
    print(f"\nparallel sampling n=4: peak {engine.stats.peak_used_blocks} blocks vs {independent} "
          f"for 4 independent copies; {engine.stats.copied_blocks} CoW copies vs "
          f"{engine.stats.eager_fork_blocks} blocks copied eagerly at fork")


def test_negative_control_in_place_write_diverges(hf, model):
    """Without copy-on-write the samples overwrite each other's K/V in the shared partial block."""
    _, prompt, good = run_parallel(model, copy_on_write=True)
    engine, prompt, bad = run_parallel(model, copy_on_write=False)
    good_err = max(oracle_error(hf, prompt, s) for s in good.samples)
    bad_err = max(oracle_error(hf, prompt, s) for s in bad.samples)
    assert good_err < 1e-4
    assert bad_err > 1e-2, bad_err
    assert engine.stats.copied_blocks == 0 and engine.manager.num_free_blocks == 64


def test_prompt_on_a_block_boundary_needs_no_copy(hf, model):
    engine = Engine(model, KVCacheManager(64, 4))
    prompt = prompt_of(20, seed=4)
    (res,) = engine.generate([prompt], 6, temperature=0.8, seed=1, n=3)
    assert engine.stats.copied_blocks == 0  # the last prompt block is full: appends take fresh blocks
    assert max(oracle_error(hf, prompt, s) for s in res.samples) < 1e-4


# ---- beam search


def test_beam_search_width4_every_beam_matches_and_all_blocks_return(hf, model):
    manager = KVCacheManager(96, 4)
    engine = Engine(model, manager)
    prompts = [prompt_of(10, seed=5), prompt_of(7, seed=6)]
    results = engine.generate(prompts, 12, beam_width=4)
    for prompt, r in zip(prompts, results):
        assert len(r.samples) == 4
        assert len({tuple(s.tokens) for s in r.samples}) == 4  # distinct beams
        scores = [s.logprob for s in r.samples]
        assert scores == sorted(scores, reverse=True)
        for s in r.samples:
            assert oracle_error(hf, prompt, s) < 1e-4
            chosen = [_log_softmax(lg)[t] for lg, t in zip(s.logits, s.tokens)]
            assert s.logprob == pytest.approx(sum(chosen), abs=1e-9)
    assert engine.stats.forks >= 6 and engine.stats.peak_used_blocks > 0
    assert manager.num_free_blocks == 96 and manager.usage().used_blocks == 0
    manager.check_invariants()


# ---- prefix caching


def test_prefix_cache_hit_gives_the_logits_of_a_cold_run(hf, model):
    bs = 16
    prefix = prompt_of(3 * bs, seed=8)
    first, second = prefix + prompt_of(10, seed=9), prefix + prompt_of(7, seed=10)
    warm = Engine(model, KVCacheManager(32, bs))
    (a,) = warm.generate([first], 8)
    (b,) = warm.generate([second], 8)
    cold = Engine(model, KVCacheManager(32, bs))
    (c,) = cold.generate([second], 8)
    assert a.hit_tokens == 0 and c.hit_tokens == 0
    assert b.hit_tokens == 3 * bs  # the three shared full blocks came from the cache
    assert b.samples[0].tokens == c.samples[0].tokens
    np.testing.assert_allclose(np.stack(b.samples[0].logits), np.stack(c.samples[0].logits), atol=1e-5, rtol=0)
    assert oracle_error(hf, second, b.samples[0]) < 1e-4
    assert warm.manager.usage().prefix_hit_tokens == 3 * bs


def test_prefix_shared_inside_one_batch(hf, model):
    """The second prompt of one call hits the blocks the first one's prefill computed."""
    prefix = prompt_of(32, seed=11)
    prompts = [prefix + [5, 6, 7], prefix + [9]]
    engine = Engine(model, KVCacheManager(32, 16))
    results = engine.generate(prompts, 5)
    assert [r.hit_tokens for r in results] == [0, 32]
    for p, r in zip(prompts, results):
        assert oracle_error(hf, p, r.samples[0]) < 1e-4


# ---- failure and arguments


def test_out_of_blocks_returns_every_block(model):
    manager = KVCacheManager(6, 4)
    engine = Engine(model, manager)
    with pytest.raises(OutOfBlocks):
        engine.generate([prompt_of(10)], 30, n=2, temperature=1.0)
    assert manager.num_free_blocks == 6 and manager.num_sequences == 0
    manager.check_invariants()


def test_bad_arguments(model):
    engine = Engine(model, KVCacheManager(8, 4))
    for kwargs in ({"max_new_tokens": 0}, {"max_new_tokens": 2, "n": 2, "beam_width": 2},
                   {"max_new_tokens": 2, "temperature": -1.0}, {"max_new_tokens": 2, "n": 0},
                   {"max_new_tokens": 2, "beam_width": 2, "temperature": 0.5}):
        with pytest.raises(ValueError):
            engine.generate([[1, 2]], **kwargs)
    with pytest.raises(ValueError):
        engine.generate([[]], 2)
    with pytest.raises(ValueError):  # 256 is outside the model's vocabulary
        engine.generate([[1, 256]], 2)
    with pytest.raises(ValueError):
        Engine(model, KVCacheManager(8, 4), store=model.new_store(9, 4))
    assert engine.manager.num_free_blocks == 8


def test_seeded_sampling_is_reproducible_and_batch_independent(model):
    a = Engine(model, KVCacheManager(64, 4)).generate([prompt_of(9)], 6, temperature=1.0, seed=3, n=2)
    # prompt 0's streams are seeded by (seed, 0, k): another prompt in the batch changes nothing
    c = Engine(model, KVCacheManager(64, 4)).generate([prompt_of(9), prompt_of(5, 1)], 6,
                                                      temperature=1.0, seed=3, n=2)
    assert [s.tokens for s in a[0].samples] == [s.tokens for s in c[0].samples]
    assert a[0].samples[0].tokens != a[0].samples[1].tokens
