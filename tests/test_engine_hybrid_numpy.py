"""The engine drives the hybrid decoder on the grouped manager (issue 19 section 5), numpy only.

The model mixes sliding-window (7), full and chunked-local (6) layers; the manager is
``KVCacheManager(..., groups=list(model.kv_groups))``; the judge is ``dense_forward``, the same
weights over each whole sequence with each layer's own mask and no paging (tests/
test_model_hybrid_oracle.py checks that judge against transformers, and
tests/test_engine_hybrid_oracle.py the engine itself). Every path a serving engine takes is run:
the step loop with chunked prefill, mixed batches and preemption, speculative decoding with
rollback, forks (``n`` samples, beams), a prefix hit that revives a window's released blocks,
and a prompt that only fits chunk by chunk because its window releases blocks (vLLM #39734).
Negative controls: a window that releases one position early, with the model reading the
released block anyway, diverges; with the table's -1, the model refuses the step.
"""
from __future__ import annotations

import numpy as np
import pytest

from pagedkv import KVCacheManager, OutOfBlocks
from pagedkv.engine import Engine
from pagedkv import KVCacheManager as GroupedKVCacheManager
from pagedkv.kv_specs import FullAttention, SlidingWindow
from pagedkv.speculative import DraftModelDrafter, NgramDrafter
from hybrid_setup import SPECS, WINDOW, EarlyWindow, StaleTables, random_hybrid
from llama_setup import DIMS, prompts_of

ATOL = 1e-4
PATTERN = [SPECS["sliding"], SPECS["full"], SPECS["chunked"], SPECS["sliding"]]
PROMPTS = (5, 16, 23, 40)


@pytest.fixture(scope="module")
def model():
    return random_hybrid(PATTERN, seed=1, dtype="float32")


def grouped(model, num_blocks, block_size=4, cls=KVCacheManager, **kw):
    return cls(num_blocks, block_size, groups=list(model.kv_groups), **kw)


def dense_error(model, prompt, sample, greedy=True) -> float:
    """Largest |engine - dense| logit over a sample's steps; with ``greedy`` also asserts each
    token is the dense argmax."""
    ref = model.dense_forward(list(prompt) + sample.tokens[:-1])[len(prompt) - 1:]
    if greedy:
        assert sample.tokens == np.argmax(ref, axis=-1).tolist()
    return float(np.abs(np.stack(sample.logits) - ref).max())


def all_returned(manager) -> None:
    assert manager.num_free_blocks == manager.num_blocks and manager.num_sequences == 0
    manager.check_invariants()


# ---- wiring


def test_the_manager_must_have_the_models_groups(model):
    with pytest.raises(ValueError, match="groups=list"):
        Engine(model, KVCacheManager(64, 4))
    with pytest.raises(ValueError, match="groups=list"):
        Engine(model, KVCacheManager(64, 4, groups=[SlidingWindow(WINDOW), FullAttention()]))
    with pytest.raises(ValueError, match="KV cache groups"):  # a plain model on a grouped manager
        Engine(random_hybrid([FullAttention()] * 2), KVCacheManager(64, 4, groups=list(model.kv_groups)))
    Engine(random_hybrid([FullAttention()] * 2), KVCacheManager(64, 4, groups=[FullAttention()]))
    with pytest.raises(ValueError, match="full attention"):
        DraftModelDrafter(model, grouped(model, 16))


# ---- the step loop


@pytest.mark.parametrize("budget, chunk", [(16, None), (8, 5), (64, 7)])
def test_step_loop_greedy_matches_dense(model, budget, chunk):
    """Chunked prefill mixed with decodes, four prompts arriving at steps 0-3; the windows'
    blocks are released as they leave (entries read -1) and every block returns at the end."""
    m = grouped(model, 96)
    engine = Engine(model, m, token_budget=budget, chunk_size=chunk)
    prompts = prompts_of(PROMPTS, seed=3)
    res = engine.generate(prompts, 20, arrivals=[0, 1, 2, 3])
    assert max(dense_error(model, p, r.samples[0]) for p, r in zip(prompts, res)) < ATOL
    st = engine.stats
    assert st.prefill_tokens == sum(PROMPTS) and st.max_step_tokens <= budget
    if budget < 40:
        assert st.mixed_steps > 0
    all_returned(m)


def test_windows_release_while_the_step_loop_runs(model):
    """Once decoding (one query a step), each group holds exactly what the last query read
    (``blocks_held``); during a prefill chunk it held the window plus the chunk."""
    m = grouped(model, 64)
    engine = Engine(model, m, token_budget=16)
    engine.add_request(prompts_of([30], seed=2)[0], 10)
    checked = 0
    while engine.has_unfinished():
        engine.step()
        if m.num_sequences and m.num_computed(m.seq_ids()[0]) > 30:
            (seq,) = m.seq_ids()
            n = m.num_computed(seq)
            for g, spec in enumerate(model.kv_groups):
                live = [b for b in m.block_table(seq, group=g) if b >= 0]
                assert len(live) == spec.blocks_held(n, 4)
            checked += 1
    assert checked == 8
    all_returned(m)


def test_preemption_under_pressure_keeps_greedy_tokens(model):
    """24 blocks for four prompts of 20-40 tokens decoding 16 each on two tables: requests are
    preempted and recomputed, and every token is still the dense run's."""
    m = grouped(model, 24)
    engine = Engine(model, m, token_budget=32)
    prompts = prompts_of([20, 28, 33, 40], seed=5)
    res = engine.generate(prompts, 16)
    assert engine.stats.preemptions > 0
    assert max(dense_error(model, p, r.samples[0]) for p, r in zip(prompts, res)) < ATOL
    all_returned(m)


def test_a_prompt_that_fits_only_chunk_by_chunk_under_windows(model):
    """vLLM #39734: a 100-token prompt on a model whose layers are all windowed (sliding 7,
    chunked 6) needs 50 blocks at once, and in 8 blocks not even a 16-token chunk fits beside
    what the windows hold: the engine sizes each chunk from what the manager says is available
    after the windows' releases, and completes (before, the step raised ``OutOfBlocks``)."""
    local = random_hybrid([SPECS["sliding"], SPECS["chunked"]], seed=4, dtype="float32")
    m = grouped(local, 8)
    prompt = prompts_of([100], seed=9)[0]
    with pytest.raises(OutOfBlocks):  # admitted whole, the prompt does not fit
        grouped(local, 8).add_sequence("x", prompt)
    engine = Engine(local, m, token_budget=16)
    (res,) = engine.generate([prompt], 8)
    assert dense_error(local, prompt, res.samples[0]) < ATOL
    assert engine.stats.peak_used_blocks <= 8 and engine.stats.prefill_chunks > 100 // 16
    all_returned(m)


class CountingGrouped(GroupedKVCacheManager):
    """Records the blocks every ``accept`` returned to the pool."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gains = []

    def accept(self, seq_id, k):
        free = self.num_free_blocks
        super().accept(seq_id, k)
        self.gains.append(self.num_free_blocks - free)


def test_speculative_decoding_matches_greedy_and_counts_rollbacks(model):
    """n-gram drafts on repetitive prompts: the tokens are greedy decoding's, and the engine's
    ``rollback_blocks`` (over both tables) is what the pool got back."""
    m = grouped(model, 96, cls=CountingGrouped)
    engine = Engine(model, m, speculator=NgramDrafter(num_drafts=4), token_budget=64)
    base = prompts_of([6, 9], seed=7)
    prompts = [b * 4 for b in base]
    res = engine.generate(prompts, 24)
    assert max(dense_error(model, p, r.samples[0]) for p, r in zip(prompts, res)) < ATOL
    st = engine.stats
    assert st.verify_steps == len(m.gains) > 0 and st.draft_tokens > 0
    assert st.rollback_blocks == sum(m.gains)
    all_returned(m)


def test_a_full_attention_draft_model_serves_a_hybrid_target(model):
    draft = random_hybrid([FullAttention()], seed=3, dtype="float32")
    m = grouped(model, 96)
    spec = DraftModelDrafter(draft, KVCacheManager(96, 4), num_drafts=3)
    engine = Engine(model, m, speculator=spec, token_budget=32)
    prompts = prompts_of([12, 21], seed=8)
    res = engine.generate(prompts, 12)
    assert max(dense_error(model, p, r.samples[0]) for p, r in zip(prompts, res)) < ATOL
    assert engine.stats.draft_tokens > 0
    all_returned(m)


# ---- forks


@pytest.mark.parametrize("step_loop", [False, True])
def test_parallel_samples_fork_and_copy_per_group(model, step_loop):
    """n = 3 samples of a 22-token prompt (block size 4: a shared partial block in each table):
    each sample's first append copies it in both groups, and every sample's logits are the dense
    run's over its own tokens."""
    m = grouped(model, 96)
    engine = Engine(model, m, token_budget=16 if step_loop else None)
    prompt = prompts_of([22], seed=6)[0]
    (res,) = engine.generate([prompt], 10, n=3, temperature=0.8, seed=3)
    assert len({tuple(s.tokens) for s in res.samples}) > 1
    assert max(dense_error(model, prompt, s, greedy=False) for s in res.samples) < ATOL
    st = engine.stats
    assert st.forks == 2 and st.copied_blocks == 2 * len(model.kv_groups)
    # each fork shares every live block: 6 a table, less what the windows released when the
    # last chunk (from position 16 in the step loop; 0, the whole prompt, otherwise) was scheduled
    last = 16 if step_loop else 0
    assert st.eager_fork_blocks == 2 * sum(6 - spec.first_read(last) // 4 for spec in model.kv_groups)
    all_returned(m)


def test_beam_search_on_a_hybrid_model(model):
    """Beams are forks and frees: each beam's logits are the dense run's over its tokens."""
    m = grouped(model, 128)
    engine = Engine(model, m)
    prompt = prompts_of([10], seed=5)[0]
    (res,) = engine.generate([prompt], 10, beam_width=3)
    assert len({tuple(s.tokens) for s in res.samples}) == 3
    assert max(dense_error(model, prompt, s, greedy=False) for s in res.samples) < ATOL
    assert engine.stats.forks >= 2
    all_returned(m)


# ---- prefix hits


def test_prefix_hit_revives_a_running_sequences_released_window(model):
    """A (40 tokens) decodes; its window groups release the blocks below its window (-1 in its
    table, the full blocks cached-free). B shares A's first 32 tokens and arrives while A still
    runs: the hit is 32 tokens, reviving the released window blocks position 32 reads, and B's
    logits are the dense run's."""
    m = grouped(model, 96)
    engine = Engine(model, m, token_budget=64)
    a = prompts_of([40], seed=7)[0]
    b = a[:32] + prompts_of([9], seed=8)[0]
    engine.add_request(a, 12)
    for _ in range(4):
        engine.step()
    (seq,) = m.seq_ids()
    assert m.block_table(seq, group=0)[:8] == [-1] * 8  # the sliding group let 0 .. 31 go
    hit = m.lookup(b)
    assert (hit, hit.revived) == (32, 2 + 1)  # blocks 6, 7 of the sliding group, 7 of the chunked
    rb = engine.add_request(b, 12)
    out = engine.step()
    assert (rb, 32) in out.admitted
    res = {}
    while engine.has_unfinished():
        res.update(engine.step().finished)
    assert dense_error(model, b, res[rb].samples[0]) < ATOL
    assert dense_error(model, a, res[0].samples[0]) < ATOL
    all_returned(m)


def test_prefix_hit_across_generate_calls(model):
    m = grouped(model, 96)
    engine = Engine(model, m)
    a = prompts_of([40], seed=7)[0]
    engine.generate([a], 6)
    b = a[:36] + [1, 2, 3]
    (res,) = engine.generate([b], 8)
    assert res.hit_tokens == 36
    assert dense_error(model, b, res.samples[0]) < ATOL
    all_returned(m)


# ---- negative controls


def test_a_window_released_one_position_early_diverges(model):
    groups = [EarlyWindow(WINDOW) if s == SlidingWindow(WINDOW) else s for s in model.kv_groups]
    prompts = prompts_of(PROMPTS, seed=3)
    stale = StaleTables(96, 4, groups=groups)
    engine = Engine(model, stale, token_budget=16)
    stale.store = engine.store
    res = engine.generate(prompts, 12)
    assert max(dense_error(model, p, r.samples[0], greedy=False) for p, r in zip(prompts, res)) > 0.1
    # with the tables as the manager gives them (-1), the model refuses the step
    refused = Engine(model, GroupedKVCacheManager(96, 4, groups=groups), token_budget=16)
    with pytest.raises(ValueError, match="released or padding"):
        refused.generate(prompts, 12)
    all_returned(refused.manager)


def test_copy_on_write_control_on_a_hybrid_model(model):
    """``copy_on_write=False``: forks keep writing into the shared partial block of each table;
    their logits leave the dense run's."""
    m = grouped(model, 96)
    engine = Engine(model, m, copy_on_write=False)
    prompt = prompts_of([22], seed=6)[0]
    (res,) = engine.generate([prompt], 8, n=3, temperature=0.8, seed=3)
    assert max(dense_error(model, prompt, s, greedy=False) for s in res.samples) > 0.1
    all_returned(m)


def test_plain_model_unchanged(model):
    """A full-attention model on the plain manager takes the one-table path (bit for bit)."""
    plain = random_hybrid([FullAttention()] * 2, seed=2, dtype="float32")
    prompts = prompts_of([9, 17], seed=1)
    a = Engine(plain, KVCacheManager(64, 4), token_budget=8).generate(prompts, 6)
    b = Engine(plain, KVCacheManager(64, 4, groups=[FullAttention()]), token_budget=8).generate(prompts, 6)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.stack(x.samples[0].logits), np.stack(y.samples[0].logits))
    assert DIMS.kv_groups == (FullAttention(),)


def test_swap_preemption_on_a_hybrid_model_keeps_greedy_tokens(model):
    """The grouped manager's swaps through the engine: under pressure requests are swapped out
    (every live block of every group to the host, released window entries left -1) and back,
    the store moving whole blocks (every layer) both ways, and every token is still the dense
    run's."""
    m = grouped(model, 24, host_blocks=64)
    engine = Engine(model, m, token_budget=32, preemption="swap")
    prompts = prompts_of([20, 28, 33, 40], seed=5)
    res = engine.generate(prompts, 16)
    assert engine.stats.swap_preemptions > 0 and engine.stats.swapped_out > 0
    assert max(dense_error(model, p, r.samples[0]) for p, r in zip(prompts, res)) < ATOL
    all_returned(m)


def test_swap_without_running_the_transfers_diverges(model):
    """Negative control: the same run with the transfers skipped (``run_transfers=False``) brings
    back blocks whose K/V never arrived, and the logits leave the dense run's."""
    m = grouped(model, 24, host_blocks=64)
    engine = Engine(model, m, token_budget=32, preemption="swap", run_transfers=False)
    prompts = prompts_of([20, 28, 33, 40], seed=5)
    res = engine.generate(prompts, 16)
    assert engine.stats.swap_preemptions > 0
    assert max(dense_error(model, p, r.samples[0], greedy=False) for p, r in zip(prompts, res)) > 0.1
