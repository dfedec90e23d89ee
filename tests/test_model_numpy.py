"""The numpy decoder: paged equals dense, dense equals transformers, and the report's CoW proof.

Most tests here need numpy only. The paged decoder (K/V only in the numpy store, read through the
allocator's block tables) is checked against ``PagedLlama.dense_forward``, the same weights run
over each whole sequence with plain causal attention and no paging. Identical greedy tokens and
logits within ``ATOL`` mean the tables, slots, copies and prefix hits are right. The last group
loads a seeded transformers ``LlamaForCausalLM`` into the numpy backend and checks the dense and
the paged logits against transformers' own (``pytest.importorskip``): that is what makes the
numpy maths Llama's, and so the dense reference a fair judge.

Measured: paged vs dense differ by ~2e-6 in float32 (float summation order) and ~1e-14 in float64.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import KVCacheManager, OutOfBlocks
from pagedkv.engine import Engine
from pagedkv.model import LlamaDims, PagedLlama, causal_attention
from pagedkv.store import KVStore, kv_bytes_per_block
from llama_setup import DIMS, prompts_of

ATOL = 1e-4  # float32 logits of std ~0.8: paged and dense differ by ~2e-6 (summation order)


@pytest.fixture(scope="module")
def model():
    return PagedLlama.random(DIMS, seed=0)


def dense_error(model, prompt, sample) -> float:
    """Largest |paged - dense| logit over a sample's steps (row ``len(prompt) - 1 + t`` predicts token t)."""
    ref = model.dense_forward(prompt + sample.tokens[:-1])[len(prompt) - 1:]
    return float(np.abs(np.stack(sample.logits) - ref).max())


def dense_greedy(model, prompt, new_tokens):
    """Greedy decoding with the dense reference alone: a full forward over the sequence per token."""
    seq, tokens, logits = list(prompt), [], []
    for _ in range(new_tokens):
        row = model.dense_forward(seq)[-1]
        tokens.append(int(np.argmax(row)))
        logits.append(row)
        seq.append(tokens[-1])
    return tokens, np.stack(logits)


def paged_tables(prompts, block_size, num_blocks, seed):
    """Block tables from a shuffled pool (padded with -1) and each token's slot, in order."""
    perm = np.random.default_rng(seed).permutation(num_blocks).tolist()
    tables = [[perm.pop() for _ in range(-(-len(p) // block_size))] for p in prompts]
    padded = np.full((len(prompts), max(map(len, tables))), -1)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = t
    slots = [[t[pos // block_size] * block_size + pos % block_size for pos in range(len(p))]
             for t, p in zip(tables, prompts)]
    return padded, slots


# ---- the numpy model needs numpy only


def test_model_and_report_section_import_no_torch():
    """Even with torch installed, nothing on the model or ``cow_proof`` path imports it."""
    code = ("import sys, numpy as np; from pagedkv.model import PagedLlama, LlamaDims; "
            "from pagedkv.report.cow_proof import section; from pagedkv.report.options import ReportOptions; "
            "m = PagedLlama.random(LlamaDims(32, 16, 32, 1, 2, 1, 8)); m.dense_forward([1, 2, 3]); "
            "section(ReportOptions(quick=True)); "
            "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'transformers')); "
            "assert not bad, bad[:5]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_report_cow_proof_runs_with_torch_blocked():
    """``pagedkv report --sections cow_proof`` where torch and transformers cannot be imported."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            "from pagedkv.cli import main; sys.exit(main(['report', '--quick', '--sections', 'cow_proof']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "logit error against the dense reference" in out.stdout
    assert "child writes in place" in out.stdout and "skipped" not in out.stdout.lower()


def test_torch_backend_without_torch_is_a_clear_error():
    code = ("import sys; sys.modules['torch'] = None; from pagedkv.model import PagedLlama, LlamaDims; "
            "PagedLlama.random(LlamaDims(32, 16, 32, 1, 2, 1, 8), backend='torch')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "ImportError: backend='torch' needs torch" in out.stderr


# ---- seeded weights and arguments


def test_random_weights_are_seeded_and_shaped():
    a, b, c = (PagedLlama.random(DIMS, seed=s) for s in (0, 0, 1))
    assert a.backend == "numpy" and a.dtype == "float32"
    assert set(a.w) == set(b.w) == set(c.w)
    for name in a.w:
        np.testing.assert_array_equal(a.w[name], b.w[name])
    assert not np.array_equal(a.w["model.layers.0.self_attn.q_proj.weight"],
                              c.w["model.layers.0.self_attn.q_proj.weight"])
    assert a.w["model.layers.1.mlp.gate_proj.weight"].shape == (128, 64)
    assert a.w["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 64)  # 2 KV heads of 16
    np.testing.assert_array_equal(a.w["model.norm.weight"], np.ones(64, dtype=np.float32))
    assert abs(float(a.w["model.embed_tokens.weight"].std()) - 0.1) < 0.005  # 16,384 draws of N(0, 0.1)
    assert not np.array_equal(a.w["lm_head.weight"], a.w["model.embed_tokens.weight"])
    tied = PagedLlama.random(DIMS, seed=0, tie_word_embeddings=True)
    np.testing.assert_array_equal(tied.w["lm_head.weight"], tied.w["model.embed_tokens.weight"])


def test_bad_arguments_raise_value_errors():
    for kwargs in ({"num_kv_heads": 3}, {"head_dim": 15}, {"num_layers": 0}, {"vocab_size": True},
                   {"rope_theta": 0.0}, {"rms_norm_eps": float("nan")}):
        args = dict(vars(DIMS)) | kwargs
        with pytest.raises(ValueError):
            LlamaDims(**args)
    for kwargs in ({"seed": -1}, {"init_std": 0.0}, {"dtype": "bfloat16"}, {"backend": "jax"},
                   {"dtype": "int8"}):
        with pytest.raises(ValueError):
            PagedLlama.random(DIMS, **kwargs)
    with pytest.raises(ValueError):
        PagedLlama.random({"hidden_size": 64})
    sd = PagedLlama.random(DIMS).w
    with pytest.raises(ValueError, match="lacks"):
        PagedLlama.from_state_dict({k: v for k, v in sd.items() if "up_proj" not in k}, DIMS)
    with pytest.raises(ValueError, match="shapes"):
        PagedLlama.from_state_dict(sd | {"lm_head.weight": np.zeros((255, 64))}, DIMS)


def test_dense_forward_rejects_bad_tokens(model):
    for bad in ([], [256], [-1], [1.5, 2.0], [[1, 2], [3]]):
        with pytest.raises(ValueError):
            model.dense_forward(bad)


def test_bad_step_changes_no_kv(model):
    store = model.new_store(8, 4)
    assert isinstance(store.kv, np.ndarray) and store.dtype == "float32"
    store.write(0, [0], np.ones((1, 2, 16)), np.ones((1, 2, 16)))
    before = store.kv.copy()
    bad_steps = [
        ([1, 2], [0, 40], [[0]], [2], [2]),  # slot 40 is outside 8 blocks of 4
        ([1], [4], [[0]], [5], None),  # 5 tokens need 2 blocks, the table has 1
        ([256], [0], [[0]], [1], None),  # token id outside the vocabulary
        ([1, 2], [0, 0], [[0]], [2], [2]),  # two tokens, one slot
        ([1, 2], [0, 1], [[0]], [2], [1]),  # query_lens do not sum to the tokens
    ]
    for step in bad_steps:
        with pytest.raises(ValueError):
            model.forward(store, *step)
        np.testing.assert_array_equal(store.kv, before)
    with pytest.raises(ValueError):  # a store shaped for another model
        model.forward(KVStore(3, 8, 4, 2, 16), [1], [0], [[0]], [1])


def test_causal_attention_is_textbook():
    """One query head at a time, looping over positions: the reference's reference."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((5, 4, 8)), rng.standard_normal((5, 2, 8)), rng.standard_normal((5, 2, 8))
    got = causal_attention(q, k, v)
    for t in range(5):
        for h in range(4):
            s = k[: t + 1, h // 2] @ q[t, h] / np.sqrt(8)
            w = np.exp(s - s.max())
            np.testing.assert_allclose(got[t, h], (w / w.sum()) @ v[: t + 1, h // 2], rtol=1e-12, atol=1e-12)


# ---- paged equals dense


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_tokens_and_logits_equal_the_dense_reference(model, block_size):
    prompts = prompts_of((3, 16, 23, 40))  # shorter than, equal to, and across 16-token blocks
    engine = Engine(model, KVCacheManager(160, block_size))
    results = engine.generate(prompts, 12)
    for prompt, r in zip(prompts, results):
        tokens, logits = dense_greedy(model, prompt, 12)
        (s,) = r.samples
        assert s.tokens == tokens
        np.testing.assert_allclose(np.stack(s.logits), logits, atol=ATOL, rtol=0)
    assert engine.manager.num_free_blocks == 160
    engine.manager.check_invariants()


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_forks_sampling_and_beams_equal_the_dense_reference(model, block_size):
    """Parallel sampling (n = 4) and beam search (width 4): every fork's every step."""
    prompts = prompts_of((11, 21), seed=1)
    engine = Engine(model, KVCacheManager(200, block_size))
    sampled = engine.generate(prompts, 10, temperature=1.0, seed=3, n=4)
    copies = engine.stats.copied_blocks
    beams = engine.generate(prompts, 10, beam_width=4)
    for prompt, a, b in zip(prompts, sampled, beams):
        assert len(a.samples) == len(b.samples) == 4
        assert len({tuple(s.tokens) for s in a.samples}) > 1  # the forks did diverge
        for s in a.samples + b.samples:
            assert dense_error(model, prompt, s) < ATOL
    # 11 and 21 tokens end inside a block of 4 or 16: 3 of each prompt's 4 samples copy it
    assert copies == (0 if block_size == 1 else 2 * 3)
    assert engine.manager.num_free_blocks == 200


def test_prefix_hits_equal_the_dense_reference(model):
    bs = 4
    prefix = prompts_of([3 * bs], seed=8)[0]
    first, second = prefix + [7, 8, 9], prefix + [200]
    engine = Engine(model, KVCacheManager(32, bs, enable_prefix_caching=True))
    (a,) = engine.generate([first], 6)
    (b,) = engine.generate([second], 6, temperature=0.7, seed=1, n=2)
    assert (a.hit_tokens, b.hit_tokens) == (0, 3 * bs)
    for prompt, r in ((first, a), (second, b)):
        for s in r.samples:
            assert dense_error(model, prompt, s) < ATOL


def test_in_place_control_diverges_from_the_dense_reference(model):
    """Without the copies the forks overwrite each other's K/V: the dense reference notices."""
    prompt = prompts_of([10], seed=2)[0]  # ends inside a block of 4
    engine = Engine(model, KVCacheManager(64, 4), copy_on_write=False)
    (r,) = engine.generate([prompt], 6, temperature=1.0, seed=0, n=4)
    errors = [dense_error(model, prompt, s) for s in r.samples]
    assert max(errors) > 1e-2, errors
    assert min(errors) < ATOL  # the last writer of the shared slots still reads its own K/V


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_ragged_chunked_prefill_through_shuffled_blocks(model, block_size):
    """Three prompts prefilled in two chunks each (several query tokens per sequence per step),
    then one decode step, through blocks drawn from a shuffled pool: every row equals dense."""
    prompts = prompts_of((13, 3, 30), seed=4)
    pool = sum(-(-(len(p) + 1) // block_size) for p in prompts) + 5
    store = model.new_store(pool, block_size)
    seqs = [p + [1 + i] for i, p in enumerate(prompts)]  # the decode token at the end
    tables, slots = paged_tables(seqs, block_size, pool, seed=block_size)
    cuts = [(0, 5, 13, 14), (0, 1, 3, 4), (0, 17, 30, 31)]  # chunk, chunk, one decode token
    got = [[] for _ in seqs]
    for phase in range(3):
        spans = [(c[phase], c[phase + 1]) for c in cuts]
        toks = [t for s, (a, b) in zip(seqs, spans) for t in s[a:b]]
        slot = [x for sl, (a, b) in zip(slots, spans) for x in sl[a:b]]
        out = model.forward(store, toks, slot, tables, [b for _, b in spans], [b - a for a, b in spans])
        row = 0
        for i, (a, b) in enumerate(spans):
            got[i].append(out[row:row + b - a])
            row += b - a
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(np.concatenate(got[i]), model.dense_forward(s), atol=ATOL, rtol=0)


# multi-query attention (4 heads on 1 KV head), another RoPE base, float64
MQA_FLOAT64 = PagedLlama.random(LlamaDims(256, 32, 48, 2, 4, 1, 8, rope_theta=100.0), seed=1, dtype="float64")


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 24), min_size=1, max_size=3),
       block_size=st.sampled_from([1, 4, 16]), data=st.data())
def test_any_chunking_equals_dense_in_float64(lengths, block_size, data):
    """In float64 the paged and dense paths differ only by summation order (~1e-14), so any
    mistake in the tables would stand out at 1e-9."""
    model = MQA_FLOAT64
    prompts = prompts_of(lengths, seed=sum(lengths))
    pool = sum(-(-n // block_size) for n in lengths) + 3
    store = model.new_store(pool, block_size)
    assert store.dtype == "float64"
    tables, slots = paged_tables(prompts, block_size, pool, seed=len(lengths))
    done = [0] * len(prompts)
    rows = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts)):
        active = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        take = {i: data.draw(st.integers(1, len(prompts[i]) - done[i])) for i in active}
        toks = [t for i in active for t in prompts[i][done[i]:done[i] + take[i]]]
        slot = [x for i in active for x in slots[i][done[i]:done[i] + take[i]]]
        lens = [done[i] + take[i] for i in active]
        out = model.forward(store, toks, slot, tables[active], lens, [take[i] for i in active])
        row = 0
        for i in active:
            rows[i].append(out[row:row + take[i]])
            row += take[i]
            done[i] += take[i]
    for p, r in zip(prompts, rows):
        np.testing.assert_allclose(np.concatenate(r), model.dense_forward(p), atol=1e-9, rtol=0)


def test_out_of_blocks_returns_every_block(model):
    manager = KVCacheManager(6, 4)
    with pytest.raises(OutOfBlocks):
        Engine(model, manager).generate([prompts_of([10])[0]], 30, n=2, temperature=1.0)
    assert manager.num_free_blocks == 6 and manager.num_sequences == 0
    manager.check_invariants()


# ---- the report section


@pytest.mark.parametrize("block_size", [4, 16])
def test_cow_proof_section_proves_and_counts(block_size):
    from pagedkv.report.cow_proof import N, prompt_length, section
    from pagedkv.report.options import ReportOptions
    from pagedkv.sim.sizing import kv_bytes_per_token

    sec = section(ReportOptions(quick=True, block_size=block_size))
    d = sec.data
    assert d["max_error_cow"] < ATOL and d["max_error_beam"] < ATOL
    assert d["max_error_in_place"] > 1e-2 and d["diverged_in_place"] >= 1
    # the prompt ends in a partial block: forks 2..N copy it, the last holder writes in place
    prompt_blocks = -(-prompt_length(block_size) // block_size)
    assert d["cow_blocks"] == d["manager_cow_copies"] == N - 1
    assert d["eager_blocks"] == (N - 1) * prompt_blocks
    assert d["beam_cow_blocks"] == d["beam_manager_cow_copies"] > 0
    assert d["cow_bytes"] == (N - 1) * kv_bytes_per_block(2, block_size, 2, 16)
    assert d["cow_bytes_model"] == (N - 1) * block_size * kv_bytes_per_token("Llama-3.1-8B")
    assert len(sec.tables) == 2 and "in place" in sec.to_text()


def test_cow_proof_at_block_size_1_copies_nothing():
    """Every block is full at block size 1: nothing is shared partially, so nothing is copied and
    the in-place control is as right as copy-on-write (the control's error needs a shared write)."""
    from pagedkv.report.cow_proof import section
    from pagedkv.report.options import ReportOptions

    d = section(ReportOptions(quick=True, block_size=1)).data
    assert d["cow_blocks"] == d["manager_cow_copies"] == d["beam_cow_blocks"] == 0
    assert max(d["max_error_cow"], d["max_error_in_place"], d["max_error_beam"]) < ATOL


# ---- the numpy maths is Llama's: weights from transformers, logits against transformers


@pytest.fixture(scope="module")
def hf_torch(one_torch_thread):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    def tiny_llama(seed=0, **overrides):
        torch.manual_seed(seed)
        overrides.setdefault("num_key_value_heads", 2)
        overrides.setdefault("rope_theta", 500.0)
        cfg = transformers.LlamaConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
            intermediate_size=128, max_position_embeddings=512, initializer_range=0.1,
            pad_token_id=0, bos_token_id=None, eos_token_id=None, **overrides)
        return transformers.LlamaForCausalLM(cfg).eval()

    def logits(hf, tokens):
        with torch.no_grad():
            return hf(torch.tensor([tokens]), use_cache=False).logits[0].numpy()

    return tiny_llama, logits


@pytest.mark.oracle
@pytest.mark.parametrize("block_size", [4, 16])
def test_numpy_decoder_from_transformers_matches_transformers(hf_torch, block_size):
    tiny_llama, hf_logits = hf_torch
    hf = tiny_llama()
    model = PagedLlama.from_transformers(hf, backend="numpy")
    assert model.backend == "numpy" and all(isinstance(w, np.ndarray) for w in model.w.values())
    prompts = prompts_of((5, 16, 23, 40))
    engine = Engine(model, KVCacheManager(128, block_size))
    assert isinstance(engine.store.kv, np.ndarray)
    for prompt, r in zip(prompts, engine.generate(prompts, 16)):
        (s,) = r.samples
        seq = prompt + s.tokens[:-1]
        want = hf_logits(hf, seq)
        np.testing.assert_allclose(model.dense_forward(seq), want, atol=ATOL, rtol=0)
        np.testing.assert_allclose(np.stack(s.logits), want[len(prompt) - 1:], atol=ATOL, rtol=0)
        assert s.tokens == np.argmax(want[len(prompt) - 1:], axis=-1).tolist()


@pytest.mark.oracle
@pytest.mark.parametrize("overrides", [{"attention_bias": True, "mlp_bias": True},
                                       {"num_key_value_heads": 4}, {"num_key_value_heads": 1},
                                       {"tie_word_embeddings": True}, {"rope_theta": 10_000.0}])
def test_numpy_llama_variants_match_transformers(hf_torch, overrides):
    """Biases, multi-head and multi-query attention, a tied head, another RoPE base."""
    tiny_llama, hf_logits = hf_torch
    hf = tiny_llama(seed=3, **overrides)
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    if overrides.get("tie_word_embeddings"):
        del sd["lm_head.weight"]
    model = PagedLlama.from_state_dict(sd, hf.config)
    assert model.backend == "numpy"
    prompt = prompts_of([11], seed=5)[0]
    (r,) = Engine(model, KVCacheManager(16, 4)).generate([prompt], 4, temperature=1.0, seed=2, n=2)
    for s in r.samples:
        seq = prompt + s.tokens[:-1]
        want = hf_logits(hf, seq)
        np.testing.assert_allclose(model.dense_forward(seq), want, atol=ATOL, rtol=0)
        np.testing.assert_allclose(np.stack(s.logits), want[len(prompt) - 1:], atol=ATOL, rtol=0)
