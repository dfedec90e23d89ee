"""The engine on a manager with a host tier, on the numpy decoder against ``dense_forward``: a
prefix evicted from the device and served back from host memory, a request swapped out under
memory pressure and back in mid-generation, write-back and write-through, the negative control
that skips the transfers, explicit preemption, and any schedule with swap preemption in float64.
The same scenarios run against transformers in test_engine_host_oracle.py."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pagedkv import KVCacheManager
from pagedkv.engine import Engine
from pagedkv.model import LlamaDims, PagedLlama
from pagedkv.speculative import DraftModelDrafter, NgramDrafter
from llama_setup import DIMS, prompts_of
from engine_checks import BS, DEVICE, HOST, host_hit_run

ATOL = 1e-4  # float32: paged and dense differ by ~2e-6 (summation order)
DIVERGED = 1e-2
POLICIES = ["write-back", "write-through"]


@pytest.fixture(scope="module")
def model():
    return PagedLlama.random(DIMS, seed=0)


def dense_error(model, prompt, sample) -> float:
    ref = model.dense_forward(prompt + sample.tokens[:-1])[len(prompt) - 1:]
    return float(np.abs(np.stack(sample.logits) - ref).max())


def greedy_error(model, prompt, sample) -> float:
    """|paged - dense| over a sample's steps; asserts its tokens are greedy decoding's."""
    ref = model.dense_forward(prompt + sample.tokens[:-1])[len(prompt) - 1:]
    assert sample.tokens == np.argmax(ref, axis=-1).tolist()
    return float(np.abs(np.stack(sample.logits) - ref).max())


# ---- a prefix served from the host tier


@pytest.mark.parametrize("policy", POLICIES)
def test_a_prefix_served_from_the_host_tier_equals_a_cold_run(model, policy):
    engine, a, cold, seen, warm = host_hit_run(model, policy)
    assert (seen, seen.device, seen.host) == (32, 0, 32)  # both of A's full blocks are on the host only
    assert warm.hit_tokens == 32 and engine.manager.usage().host_hit_tokens == 32
    st = engine.stats  # the rerun's generate: the 2 loads, and the offloads its admission caused
    assert st.transfers_to_device == 2 and st.hit_tokens == 32
    assert st.transfer_bytes == (st.transfers_to_host + st.transfers_to_device) * engine.store.bytes_per_block
    assert st.skipped_transfers == 0
    assert greedy_error(model, a, warm.samples[0]) < ATOL
    assert warm.samples[0].tokens == cold.samples[0].tokens
    np.testing.assert_allclose(np.stack(warm.samples[0].logits), np.stack(cold.samples[0].logits),
                               atol=ATOL, rtol=0)
    m = engine.manager
    assert m.num_free_blocks == DEVICE and m.usage().host_used_blocks == 0
    m.check_invariants()


def test_write_through_copies_out_before_eviction_and_write_back_at_it(model):
    """Write-through stores A's 2 full blocks while A runs (the third, partial one never), so the
    evictions B and C cause offload nothing of A's; write-back copies each evicted block out
    then. Either way the host ends up holding A's blocks and serves them."""
    counts = {}
    for policy in POLICIES:
        manager = KVCacheManager(DEVICE, BS, host_blocks=HOST, host_write_policy=policy)
        engine = Engine(model, manager)
        a, b, c = prompts_of([40, 70, 70], seed=1)
        engine.generate([a], 8)
        counts[policy] = [engine.stats.transfers_to_host]
        for p in (b, c):
            engine.generate([p], 8)
            counts[policy].append(engine.stats.transfers_to_host)
    assert counts["write-through"][0] == 2  # A's two full blocks, copied out while A ran
    assert counts["write-back"][0] == 0  # nothing evicted yet
    assert counts["write-back"][2] >= 2  # C's admission evicted (and offloaded) A's blocks


@pytest.mark.parametrize("policy", POLICIES)
def test_control_skipping_the_transfers_diverges_on_a_host_hit(model, policy):
    engine, a, cold, seen, warm = host_hit_run(model, policy, run_transfers=False)
    assert warm.hit_tokens == 32 and engine.stats.transfer_bytes == 0
    assert engine.stats.skipped_transfers >= 2
    assert dense_error(model, a, warm.samples[0]) > DIVERGED
    assert dense_error(model, a, cold.samples[0]) < ATOL  # the cold run never needed the host


# ---- swap preemption under memory pressure


def pressure_run(model, policy="write-back", preemption="swap", run_transfers=True, host=16):
    """8 blocks of 4, two prompts of 14 that grow to 25 tokens (7 blocks) each, budget 8: when
    request 0 needs its 5th block, request 1 (4 blocks) is preempted; request 0 then grows into
    the freed blocks, so request 1's device blocks are overwritten while it is away."""
    prompts = prompts_of([14, 14], seed=11)
    manager = KVCacheManager(8, 4, host_blocks=host, host_write_policy=policy)
    engine = Engine(model, manager, token_budget=8, preemption=preemption, run_transfers=run_transfers)
    for p in prompts:
        engine.add_request(p, 12)
    outs = []
    while engine.has_unfinished():
        outs.append(engine.step())
    results = {rid: r for o in outs for rid, r in o.finished.items()}
    return engine, prompts, outs, results


@pytest.mark.parametrize("policy", POLICIES)
def test_a_request_swapped_out_and_back_in_continues_with_greedy_tokens(model, policy):
    engine, prompts, outs, results = pressure_run(model, policy)
    out_steps = [o.step for o in outs if o.swapped_out]
    in_steps = [o.step for o in outs if o.swapped_in]
    assert [o.swapped_out for o in outs if o.swapped_out] == [[1]]
    assert [o.swapped_in for o in outs if o.swapped_in] == [[1]]
    first_done = next(o.step for o in outs if 0 in o.finished)
    assert out_steps[0] < first_done < in_steps[0] == first_done + 1  # back as soon as 0 left
    st = engine.stats
    assert (st.swap_preemptions, st.swapped_out, st.swapped_in) == (1, 1, 1)
    assert (st.preemptions, st.swap_fallbacks) == (0, 0)
    swap_step = outs[out_steps[0]]
    assert swap_step.transfers >= 4  # request 1's 4 private blocks left in that step's forward
    assert st.transfers_to_device >= 1 and st.skipped_transfers == 0
    assert st.transfer_bytes == (st.transfers_to_host + st.transfers_to_device) * engine.store.bytes_per_block
    for rid, p in enumerate(prompts):
        assert len(results[rid].samples[0].tokens) == 12
        assert greedy_error(model, p, results[rid].samples[0]) < ATOL
    m = engine.manager
    assert m.num_free_blocks == 8 and m.usage().host_used_blocks == 0 and m.usage().swapped_sequences == 0
    m.check_invariants()


def test_swap_and_recompute_give_the_same_tokens(model):
    swap, prompts, _, by_swap = pressure_run(model, preemption="swap")
    recompute, _, _, by_recompute = pressure_run(model, preemption="recompute")
    assert recompute.stats.preemptions == 1 and recompute.stats.swap_preemptions == 0
    for rid in (0, 1):
        assert by_swap[rid].samples[0].tokens == by_recompute[rid].samples[0].tokens
    # recompute prefills request 1 again; swapping never computes a prompt position twice
    assert recompute.stats.prefill_tokens > swap.stats.prefill_tokens == sum(map(len, prompts))


def test_control_skipping_the_transfers_diverges_after_a_swap(model):
    engine, prompts, outs, results = pressure_run(model, run_transfers=False)
    assert engine.stats.swapped_in == 1 and engine.stats.transfer_bytes == 0
    assert dense_error(model, prompts[1], results[1].samples[0]) > DIVERGED
    assert greedy_error(model, prompts[0], results[0].samples[0]) < ATOL  # never swapped: unharmed


def test_a_full_host_falls_back_to_recompute(model):
    """Request 1 holds 4 private blocks; a host of 2 blocks cannot take them: it restarts."""
    engine, prompts, outs, results = pressure_run(model, host=2)
    st = engine.stats
    assert (st.swap_preemptions, st.swap_fallbacks, st.preemptions) == (0, 1, 1)
    assert [o.preempted for o in outs if o.preempted] == [[1]]
    for rid, p in enumerate(prompts):
        assert greedy_error(model, p, results[rid].samples[0]) < ATOL


# ---- explicit preemption


def test_preempt_swaps_a_decoding_request_between_steps(model):
    prompts = prompts_of([21, 9], seed=3)
    manager = KVCacheManager(32, 4, host_blocks=32)
    engine = Engine(model, manager, token_budget=64, preemption="swap")
    for p in prompts:
        engine.add_request(p, 6)
    engine.step()  # both prompts prefilled, first tokens chosen
    before = {sid: manager.block_table(sid) for sid in manager.seq_ids()}
    assert engine.preempt(0) == "swap"
    assert manager.usage().swapped_sequences == 1
    (gone,) = [sid for sid in before if manager.block_table(sid) == [-1] * len(before[sid])]
    assert len(before[gone]) == 6  # request 0: 21 tokens in blocks of 4, all private
    with pytest.raises(ValueError, match="swapped out already"):
        engine.preempt(0)
    out = engine.step()  # room: swapped back in at the start of the step, and decoded in it
    assert out.swapped_in == [0] and out.decode_tokens == 2
    # 6 blocks out (drained in this step's forward); back in, the 5 full ones are revived from
    # the device's cache (still there: nothing reused them) and only the partial one is loaded
    assert out.transfers == 6 + 1
    assert manager.block_table(gone)[:5] == before[gone][:5]
    results = {}
    while engine.has_unfinished():
        results.update(engine.step().finished)
    for rid, p in enumerate(prompts):
        assert greedy_error(model, p, results[rid].samples[0]) < ATOL
    later = engine.add_request(prompts[0], 2, arrival=engine.clock + 5)
    with pytest.raises(ValueError, match="waiting"):
        engine.preempt(later)
    with pytest.raises(KeyError):
        engine.preempt(99)
    engine.abort(later)
    manager.check_invariants()


def test_preempt_recomputes_a_request_mid_prefill_or_without_swap(model):
    prompt = prompts_of([30], seed=4)[0]
    for preemption, host in (("swap", 16), ("recompute", 0)):
        engine = Engine(model, KVCacheManager(16, 4, host_blocks=host), token_budget=8,
                        preemption=preemption)
        engine.add_request(prompt, 3)
        engine.step()  # 8 of 30 prompt tokens: mid-prefill, cannot be swapped
        assert engine.preempt(0) == "recompute"
        assert engine.stats.preemptions == 1 and engine.stats.swap_fallbacks == (preemption == "swap")
        results = {}
        while engine.has_unfinished():
            results.update(engine.step().finished)
        assert greedy_error(model, prompt, results[0].samples[0]) < ATOL


def test_abort_of_a_swapped_request_frees_its_host_blocks(model):
    manager = KVCacheManager(32, 4, host_blocks=32)
    engine = Engine(model, manager, preemption="swap")
    engine.add_request(prompts_of([10])[0], 5)
    engine.step()
    engine.preempt(0)
    engine.abort(0)
    u = manager.usage()
    # its 3 to_host transfers are still pending (they pin their host blocks until drained); the
    # next forward runs them, so its 2 full blocks stay findable on the host
    assert (u.swapped_sequences, u.host_used_blocks, manager.num_free_blocks) == (0, 3, 32)
    engine.add_request([7], 1)
    assert engine.step().transfers == 3
    u = manager.usage()
    assert (u.host_used_blocks, u.host_cached_blocks) == (0, 2)
    manager.check_invariants()


# ---- arguments


def test_bad_host_arguments(model):
    plain, tiered = KVCacheManager(16, 4), KVCacheManager(16, 4, host_blocks=8)
    for manager, kwargs in ((tiered, {"preemption": "evict"}), (plain, {"preemption": "swap"}),
                            (tiered, {"run_transfers": 1}), (plain, {"run_transfers": False}),
                            (tiered, {"store": model.new_store(16, 4)}),
                            (plain, {"store": model.new_store(16, 4, host_blocks=8)})):
        with pytest.raises(ValueError):
            Engine(model, manager, **kwargs)
    with pytest.raises(ValueError, match="draft manager"):
        DraftModelDrafter(model, KVCacheManager(16, 4, host_blocks=4), 2)
    engine = Engine(model, tiered)
    assert engine.store.host_blocks == 8 and engine.store.host_nbytes == 8 * engine.store.bytes_per_block
    assert Engine(model, plain).store.host_kv is None


def test_a_tiered_manager_without_pressure_changes_nothing(model):
    """Same tokens and logits as the plain engine, on every path, with no transfer."""
    prompts = prompts_of([5, 23, 40], seed=5)
    for kwargs in ({}, {"token_budget": 16}, {"token_budget": 16, "speculator": NgramDrafter(3)}):
        plain = Engine(model, KVCacheManager(64, 16), **kwargs).generate(prompts, 6)
        engine = Engine(model, KVCacheManager(64, 16, host_blocks=16), **kwargs)
        tiered = engine.generate(prompts, 6)
        for a, b in zip(plain, tiered):
            assert a.samples[0].tokens == b.samples[0].tokens
            np.testing.assert_array_equal(np.stack(a.samples[0].logits), np.stack(b.samples[0].logits))
        assert engine.stats.transfers_to_host == engine.stats.transfers_to_device == 0


# ---- any schedule with swap preemption, float64

MQA64 = PagedLlama.random(LlamaDims(256, 32, 48, 2, 4, 1, 8, rope_theta=100.0), seed=1, dtype="float64")


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(4, 24), min_size=3, max_size=4), budget=st.integers(2, 16),
       block_size=st.sampled_from([1, 2, 4]), spare=st.integers(0, 2), host=st.sampled_from([0.2, 1, 3]),
       policy=st.sampled_from(POLICIES), speculate=st.booleans(), data=st.data())
def test_any_schedule_with_swap_preemption_equals_dense_in_float64(lengths, budget, block_size, spare,
                                                                   host, policy, speculate, data):
    """A device pool that fits the longest request plus ``spare`` blocks, so requests preempt one
    another; a host a fifth of that (most swaps fall back to recompute) to three times it. Every
    logit equals the dense run to 1e-9 and every block comes home."""
    new = 6
    prompts = [np.random.default_rng(n).integers(1, 4, n).tolist() for n in lengths]  # repetitive
    arrivals = data.draw(st.lists(st.integers(0, 1), min_size=len(prompts), max_size=len(prompts)))
    longest = max(-(-(n + new + 3) // block_size) for n in lengths)  # + room for 3 drafts
    manager = KVCacheManager(longest + spare, block_size, host_blocks=max(1, int(host * longest)),
                             host_write_policy=policy)
    engine = Engine(MQA64, manager, token_budget=budget, preemption="swap",
                    speculator=NgramDrafter(3) if speculate else None)
    for p, r in zip(prompts, engine.generate(prompts, new, arrivals=arrivals)):
        s = r.samples[0]
        ref = MQA64.dense_forward(p + s.tokens[:-1])[len(p) - 1:]
        np.testing.assert_allclose(np.stack(s.logits), ref, atol=1e-9, rtol=0)
        assert s.tokens == np.argmax(ref, axis=-1).tolist()
    st_ = engine.stats
    event(f"swapped: {st_.swapped_out > 0}, fell back: {st_.swap_fallbacks > 0}")
    assert st_.swapped_in <= st_.swapped_out
    moved = st_.transfers_to_host + st_.transfers_to_device
    assert st_.transfer_bytes == moved * engine.store.bytes_per_block
    assert manager.num_free_blocks == manager.num_blocks and manager.usage().swapped_sequences == 0
    manager.check_invariants()
