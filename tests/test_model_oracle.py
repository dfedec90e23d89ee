"""The paged decoder against an implementation nobody here wrote: transformers' LlamaForCausalLM.

The model is tiny and randomly initialised (seeded; nothing is downloaded). Its K/V live only in
the paged store at the allocator's slots, so identical logits mean the block tables, slots and
prefill/decode paths are right. ``initializer_range`` 0.1 (not 0.02) spreads the logits (std ~0.8)
so that greedy argmax ties are not a matter of float noise.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedkv import KVCacheManager  # noqa: E402
from pagedkv.engine import Engine  # noqa: E402
from pagedkv.model import LlamaDims, PagedLlama  # noqa: E402
from llama_setup import hf_greedy, prompts_of, tiny_llama  # noqa: E402

pytestmark = pytest.mark.oracle

@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs with one torch thread (see conftest)."""


GREEDY_PROMPTS = (5, 16, 23, 40)  # shorter than, equal to, and across 16-token blocks


@pytest.fixture(scope="module")
def hf_greedy_64(hf):
    """transformers' tokens and logits, computed once for both block sizes."""
    return hf_greedy(hf, prompts_of(GREEDY_PROMPTS), 64)


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_64_tokens_matches_transformers_generate(hf, hf_greedy_64, block_size):
    prompts = prompts_of(GREEDY_PROMPTS)
    tokens, logits = hf_greedy_64
    engine = Engine(PagedLlama.from_transformers(hf), KVCacheManager(128, block_size))
    results = engine.generate(prompts, 64)
    for i, r in enumerate(results):
        (s,) = r.samples
        assert s.tokens == tokens[i].tolist()
        np.testing.assert_allclose(np.stack(s.logits), logits[i], atol=1e-4, rtol=0)
    assert engine.manager.num_free_blocks == 128
    engine.manager.check_invariants()


def test_prefill_through_shuffled_blocks_matches_full_forward(hf):
    model = PagedLlama.from_transformers(hf)
    store = model.new_store(40, 4)
    prompts = prompts_of([13, 3, 30], seed=1)
    perm = np.random.default_rng(0).permutation(40).tolist()
    tables = [[perm.pop() for _ in range(-(-len(p) // 4))] for p in prompts]
    slots = [t[pos // 4] * 4 + pos % 4 for t, p in zip(tables, prompts) for pos in range(len(p))]
    padded = np.full((3, max(map(len, tables))), -1)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = t
    lens = [len(p) for p in prompts]
    got = model.forward(store, sum(prompts, []), slots, padded, lens, lens).numpy()
    with torch.no_grad():
        want = np.concatenate([hf(torch.tensor([p])).logits[0].numpy() for p in prompts])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_rope_theta_comes_from_the_config():
    prompt = prompts_of([30], seed=2)
    a, b = tiny_llama(rope_theta=10_000.0), tiny_llama(rope_theta=50.0)  # same seed, same weights
    assert PagedLlama.from_transformers(b).dims.rope_theta == 50.0
    outs = []
    for hf_model in (a, b):
        engine = Engine(PagedLlama.from_transformers(hf_model), KVCacheManager(16, 4))
        (r,) = engine.generate(prompt, 2)
        with torch.no_grad():
            want = hf_model(torch.tensor(prompt)).logits[0, -1].numpy()
        np.testing.assert_allclose(r.samples[0].logits[0], want, atol=1e-4, rtol=0)
        outs.append(r.samples[0].logits[0])
    assert np.abs(outs[0] - outs[1]).max() > 1e-3  # theta matters, so the check above has teeth


def test_tied_embeddings_and_bad_weights():
    hf_tied = tiny_llama(tie_word_embeddings=True)
    sd = {k: v for k, v in hf_tied.state_dict().items() if k != "lm_head.weight"}
    model = PagedLlama.from_state_dict(sd, hf_tied.config)
    assert torch.equal(model.w["lm_head.weight"], sd["model.embed_tokens.weight"])
    sd.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="lacks"):
        PagedLlama.from_state_dict(sd, hf_tied.config)
    with pytest.raises(ValueError, match="RoPE"):
        LlamaDims.from_config({"hidden_size": 64, "num_attention_heads": 4,
                               "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})


def test_bad_step_changes_no_kv(hf):
    model = PagedLlama.from_transformers(hf)
    store = model.new_store(8, 4)
    before = store.kv.clone()
    with pytest.raises(ValueError):  # slot 40 is outside 8 blocks of 4
        model.forward(store, [1, 2], [0, 40], [[0]], [2], [2])
    with pytest.raises(ValueError):  # the table needs 2 blocks for 5 tokens
        model.forward(store, [1], [4], [[0]], [5])
    with pytest.raises(ValueError):  # token id outside the vocabulary
        model.forward(store, [256], [0], [[0]], [1])
    assert torch.equal(store.kv, before)
    with pytest.raises(ValueError):  # a store shaped for another model
        model.forward(model.new_store(8, 4).__class__(3, 8, 4, 2, 16), [1], [0], [[0]], [1])


@pytest.mark.parametrize("overrides", [{"attention_bias": True, "mlp_bias": True},
                                       {"num_key_value_heads": 4}, {"num_key_value_heads": 1}])
def test_other_llama_variants_load_and_match(overrides):
    """Biases, plain multi-head (4 KV heads) and multi-query (1 KV head) attention."""
    hf_model = tiny_llama(seed=3, **overrides)
    engine = Engine(PagedLlama.from_transformers(hf_model), KVCacheManager(16, 4))
    prompt = prompts_of([11], seed=5)
    (r,) = engine.generate(prompt, 3)
    seq = prompt[0] + r.samples[0].tokens[:-1]
    with torch.no_grad():
        want = hf_model(torch.tensor([seq])).logits[0, len(prompt[0]) - 1:].numpy()
    np.testing.assert_allclose(np.stack(r.samples[0].logits), want, atol=1e-4, rtol=0)
