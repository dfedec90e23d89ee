"""The hybrid decoder against transformers (issue 19 section 5).

The oracle is a tiny seeded ``Qwen2ForCausalLM`` with ``layer_types`` mixing sliding-window
(window 7, transformers' semantics: a query reads itself and the 6 positions before it) and
full-attention layers. Qwen2 is Llama plus q/k/v biases, which the decoder loads as they are, so
the weights map one to one. Every K/V of the paged decoder lives in the store at the allocator's
slots, read through each layer's own group's table, with released entries -1 and released
blocks overwritten with garbage; equal greedy tokens and logits within 1e-4 (the Llama oracle's
tolerance; measured ~3e-6) mean the release, hit and copy rules keep exactly what each layer reads.

Chunked-local layers: no transformers model mixes them with full layers the way Llama 4 does
without also bringing MoE and NoPE layers, so the chunked oracle is the same Qwen2 weights with
its sliding layers given transformers' own chunked mask (``create_chunked_causal_mask``, Llama
4's) through the model's per-layer-type mask mapping.

The allocator is ``hybrid_setup.ToyGroups`` (the contract's rules alone, with hooks that overwrite
released blocks); the last test runs the same greedy check on the grouped
``KVCacheManager(groups=...)``, and tests/test_engine_hybrid_oracle.py runs the engine on it.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedkv import KVCacheManager  # noqa: E402
from pagedkv.kv_specs import ChunkedLocalAttention, FullAttention, SlidingWindow  # noqa: E402
from pagedkv.model import PagedLlama  # noqa: E402
from hybrid_setup import (WINDOW, Runner, ToyGroups, as_numpy, greedy, greedy_from, poison,  # noqa: E402
                          tiny_qwen2)
from llama_setup import hf_greedy, prompts_of  # noqa: E402

pytestmark = pytest.mark.oracle
ATOL = 1e-4
PROMPTS = (5, 16, 23, 40)  # inside one window, across it, and across many blocks
NEW = 24


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs with one torch thread (see conftest)."""


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen2()


@pytest.fixture(scope="module")
def qwen_greedy(qwen):
    """transformers' own batched greedy generate (its sliding-window cache), computed once."""
    return hf_greedy(qwen, prompts_of(PROMPTS), NEW)


def hf_logits(hf, seq, masks=None):
    with torch.no_grad():
        return hf(torch.tensor([seq]), attention_mask=masks).logits[0].numpy()


def runner(model, num_blocks, block_size, **toy):
    store = model.new_store(num_blocks, block_size)
    toy.setdefault("on_release", poison(store, seed=1))  # a released block is reused at once
    alloc = ToyGroups(num_blocks, block_size, model.kv_groups, on_alloc=poison(store), **toy)
    return Runner(model, alloc, store)


def test_config_maps_to_the_layer_pattern(qwen):
    model = PagedLlama.from_transformers(qwen)
    assert model.dims.attention == (SlidingWindow(WINDOW), FullAttention(), SlidingWindow(WINDOW))
    assert model.kv_groups == (SlidingWindow(WINDOW), FullAttention())
    assert "model.layers.0.self_attn.q_proj.bias" in model.w


@pytest.mark.parametrize("block_size, chunk", [(4, None), (4, 6), (16, 5)])
def test_greedy_matches_transformers_generate(qwen, qwen_greedy, block_size, chunk):
    """Chunked prefill (5 or 6 tokens a step) and decode, four prompts batched, sliding blocks
    released as the window moves: the same 24 greedy tokens and logits as transformers."""
    tokens, logits = qwen_greedy
    model = PagedLlama.from_transformers(qwen)
    r = runner(model, 96 if block_size == 4 else 24, block_size)
    got, got_logits, _ = greedy(r, prompts_of(PROMPTS), NEW, chunk=chunk)
    for i in range(len(PROMPTS)):
        assert got[i] == tokens[i].tolist()
        np.testing.assert_allclose(got_logits[i], logits[i], atol=ATOL, rtol=0)
    window = r.alloc.block_tables([f"s{len(PROMPTS) - 1}"], group=0)[0]
    assert (window == -1).sum() >= (40 + NEW - 1 - WINDOW) // block_size - 1  # the window released


def test_fork_matches_transformers(qwen):
    """A fork mid-block: parent and child write different tokens into the shared partial block
    of each group (copy-on-write) and each matches transformers on its own sequence."""
    model = PagedLlama.from_transformers(qwen)
    r = runner(model, 64, 4)
    prompt = prompts_of([22], seed=6)[0]
    r.admit("p", prompt)
    r.step()
    r.fork("p", "c")
    tails = {"p": [11, 12, 13, 14, 15, 16, 17, 18, 19], "c": [21, 22, 23, 24, 25, 26, 27, 28, 29]}
    got = {s: [] for s in tails}
    for j in range(9):
        for s in tails:
            r.append(s, tails[s][j])
        assert j or len(r.alloc.copies) == 2  # the first append copies one block in each group
        out = r.step()
        for s in tails:
            got[s].append(out[s][-1])
    for s, tail in tails.items():
        want = hf_logits(qwen, prompt + tail)[len(prompt):]
        np.testing.assert_allclose(np.stack(got[s]), want, atol=ATOL, rtol=0)


def test_prefix_hit_on_a_released_then_revived_window(qwen):
    """Sequence a's sliding blocks at positions 24 .. 31 leave its window and are released while
    it decodes; b shares a's first 32 tokens: the hit takes the full group's 8 blocks and revives
    those two released window blocks (what position 32 reads: 26 .. 32), the rest reads -1; b
    then decodes as transformers does on b alone."""
    model = PagedLlama.from_transformers(qwen)
    r = runner(model, 64, 4, on_release=None)  # released blocks must survive to be revived
    a = prompts_of([40], seed=7)[0]
    r.admit("a", a)
    r.step()
    held = r.alloc.block_tables(["a"], group=0)[0][6:8].tolist()
    for t in (3, 4, 5):
        r.append("a", t)
        r.step()
    assert (r.alloc.block_tables(["a"], group=0)[0][:8] == -1).all()
    b = a[:32] + prompts_of([9], seed=8)[0]
    assert r.alloc.lookup(b) == 32
    assert r.admit("b", b) == 32
    window = r.alloc.block_tables(["b"], group=0)[0]
    assert (window[:6] == -1).all() and window[6:8].tolist() == held
    toks, logits = greedy_from(r, "b", 12)
    want = hf_logits(qwen, b + toks[:-1])[len(b) - 1:]
    assert toks == np.argmax(want, -1).tolist()
    np.testing.assert_allclose(logits, want, atol=ATOL, rtol=0)


def test_chunked_local_layers_match_transformers_chunked_mask(qwen):
    """Chunk 6 on the sliding layers: transformers runs them with its own chunked mask
    (Llama 4's ``create_chunked_causal_mask``), the decoder with ``ChunkedLocalAttention(6)``."""
    from transformers.masking_utils import create_causal_mask, create_chunked_causal_mask

    chunk = 6
    config = qwen.config.to_dict()
    config["layer_types"] = ["chunked_attention" if t == "sliding_attention" else t for t in config["layer_types"]]
    config["attention_chunk_size"] = chunk
    model = PagedLlama.from_state_dict(qwen.state_dict(), config)
    assert model.kv_groups == (ChunkedLocalAttention(chunk), FullAttention())
    prompts = prompts_of([9, 26], seed=11)
    r = runner(model, 64, 4)
    toks, logits, _ = greedy(r, prompts, 16, chunk=5)
    hf_config = copy.deepcopy(qwen.config)  # the mask functions read the chunk from a config
    hf_config.attention_chunk_size = chunk
    for p, t, lg in zip(prompts, toks, logits):
        seq = p + t[:-1]
        ids = torch.tensor([seq])
        kw = dict(config=hf_config, inputs_embeds=qwen.model.embed_tokens(ids), attention_mask=None,
                  cache=None, position_ids=torch.arange(len(seq))[None])
        masks = {"full_attention": create_causal_mask(**kw),
                 "sliding_attention": create_chunked_causal_mask(**kw, allow_is_causal_skip=False)}
        want = hf_logits(qwen, seq, masks)[len(p) - 1:]
        assert t == np.argmax(want, -1).tolist()
        np.testing.assert_allclose(lg, want, atol=ATOL, rtol=0)
        assert np.abs(want - hf_logits(qwen, seq)[len(p) - 1:]).max() > 0.1  # chunked != sliding here


def test_negative_controls_diverge_from_transformers(qwen, qwen_greedy):
    """Releasing a block one position too early (the table keeping its id, the block reused)
    and a window one position too wide both diverge from transformers; a release that leaves
    -1 where a query reads is refused."""
    tokens, logits = qwen_greedy
    model = PagedLlama.from_transformers(qwen)
    r = runner(model, 96, 4, release_shift=1, stale_tables=True)
    _, early, _ = greedy(r, prompts_of(PROMPTS), NEW, chunk=6)
    assert max(np.abs(e - want).max() for e, want in zip(early, logits)) > 0.1
    with pytest.raises(ValueError, match="released or padding"):
        greedy(runner(model, 96, 4, release_shift=1), prompts_of(PROMPTS), NEW, chunk=6)
    config = qwen.config.to_dict()
    config["sliding_window"] = WINDOW + 1
    wide = PagedLlama.from_state_dict(qwen.state_dict(), config)
    _, wide_logits, _ = greedy(runner(wide, 96, 4), prompts_of(PROMPTS), NEW, chunk=6)
    assert max(np.abs(e - want).max() for e, want in zip(wide_logits, logits)) > 0.1


@pytest.mark.parametrize("block_size, chunk", [(4, 6), (16, 5)])
def test_greedy_on_the_grouped_manager(qwen, qwen_greedy, block_size, chunk):
    """The same check on the real grouped manager: its per-group tables and slots drive the
    decoder, and the result is transformers' (then a prefix hit on a revived window)."""
    tokens, logits = qwen_greedy
    model = PagedLlama.from_transformers(qwen)
    num_blocks = 96 if block_size == 4 else 24
    manager = KVCacheManager(num_blocks, block_size, groups=list(model.kv_groups))
    r = Runner(model, manager, model.new_store(num_blocks, block_size))
    got, got_logits, _ = greedy(r, prompts_of(PROMPTS), NEW, chunk=chunk)
    for i in range(len(PROMPTS)):
        assert got[i] == tokens[i].tolist()
        np.testing.assert_allclose(got_logits[i], logits[i], atol=ATOL, rtol=0)
    manager.check_invariants()
    a = prompts_of(PROMPTS)[-1]
    b = a[:32] + prompts_of([9], seed=8)[0]
    hit = r.admit("b", b)
    assert hit > 0 and hit % block_size == 0
    toks, b_logits = greedy_from(r, "b", 8)
    want = hf_logits(qwen, b + toks[:-1])[len(b) - 1:]
    np.testing.assert_allclose(b_logits, want, atol=ATOL, rtol=0)
