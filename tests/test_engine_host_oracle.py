"""The host tier against transformers: a prefix evicted from the device and served back from host
memory gives a cold run's logits; a request swapped out under memory pressure and back in
mid-generation continues with transformers' exact greedy tokens; write-back and write-through
alike; and the negative control that skips the transfers diverges.

The oracle is a seeded random ``LlamaForCausalLM`` (nothing downloaded) running transformers'
own greedy ``generate`` with its own cache; the paged engine runs the same weights on both model
backends (torch: the store's host pool is a CPU tensor; numpy: an array). Tolerance 1e-4 as in
test_engine_v2_oracle.py (float noise is ~2e-6).
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedkv import KVCacheManager  # noqa: E402
from pagedkv.engine import Engine  # noqa: E402
from llama_setup import hf_greedy, prompts_of  # noqa: E402
from engine_checks import host_hit_run  # noqa: E402

pytestmark = pytest.mark.oracle

ATOL = 1e-4
DIVERGED = 1e-2
POLICIES = ["write-back", "write-through"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs with one torch thread (see conftest)."""


def oracle_error(hf, prompt, sample) -> tuple[float, bool]:
    """(largest |logit - transformers|, whether the tokens are transformers' greedy tokens)."""
    tokens, logits = hf_greedy(hf, [prompt], len(sample.tokens))
    return float(np.abs(np.stack(sample.logits) - logits[0]).max()), sample.tokens == tokens[0].tolist()


# ---- a prefix served from the host tier


@pytest.mark.parametrize("policy", POLICIES)
def test_a_prefix_served_from_the_host_tier_equals_a_cold_run(hf, model, policy):
    engine, a, cold, seen, warm = host_hit_run(model, policy)
    assert (seen.device, seen.host) == (0, 32)
    assert warm.hit_tokens == 32 and engine.manager.usage().host_hit_tokens == 32 > 0
    assert engine.stats.transfers_to_device == 2 and engine.stats.transfer_bytes > 0
    err, same = oracle_error(hf, a, warm.samples[0])
    assert same and err < ATOL
    cold_err, cold_same = oracle_error(hf, a, cold.samples[0])
    assert cold_same and cold_err < ATOL
    np.testing.assert_allclose(np.stack(warm.samples[0].logits), np.stack(cold.samples[0].logits),
                               atol=ATOL, rtol=0)
    print(f"\n[{model.backend}, {policy}] host hit {warm.hit_tokens} tokens: max |logit - transformers| "
          f"{err:.2e} (cold run {cold_err:.2e}); {engine.stats.transfers_to_host} to host, "
          f"{engine.stats.transfers_to_device} to device, {engine.stats.transfer_bytes:,} bytes")


def test_control_skipping_the_transfers_diverges_on_a_host_hit(hf, model):
    engine, a, cold, seen, warm = host_hit_run(model, "write-back", run_transfers=False)
    assert warm.hit_tokens == 32 and engine.stats.skipped_transfers >= 2
    err, _ = oracle_error(hf, a, warm.samples[0])
    assert err > DIVERGED
    print(f"\n[{model.backend}] host hit with the transfers skipped: max |logit - transformers| {err:.3f}")


# ---- swap preemption under memory pressure


def pressure_run(model, policy, run_transfers=True):
    """8 blocks of 4, two prompts of 14 growing by 12 tokens each, budget 8: request 1 is swapped
    out for request 0, whose growth then overwrites the device blocks it left; it comes back
    when request 0 is done."""
    prompts = prompts_of([14, 14], seed=11)
    manager = KVCacheManager(8, 4, host_blocks=16, host_write_policy=policy)
    engine = Engine(model, manager, token_budget=8, preemption="swap", run_transfers=run_transfers)
    for p in prompts:
        engine.add_request(p, 12)
    outs = []
    while engine.has_unfinished():
        outs.append(engine.step())
    return engine, prompts, outs, {rid: r for o in outs for rid, r in o.finished.items()}


@pytest.mark.parametrize("policy", POLICIES)
def test_a_request_swapped_mid_generation_continues_with_transformers_tokens(hf, model, policy):
    engine, prompts, outs, results = pressure_run(model, policy)
    out_step = next(o.step for o in outs if o.swapped_out == [1])
    in_step = next(o.step for o in outs if o.swapped_in == [1])
    generated_before = sum(o.decode_tokens for o in outs[:out_step]) // 2  # both decoding till then
    assert 0 < generated_before < 12 and out_step < in_step  # mid-generation, both ways
    st = engine.stats
    assert (st.swapped_out, st.swapped_in, st.preemptions) == (1, 1, 0)
    errs = []
    for rid, p in enumerate(prompts):
        err, same = oracle_error(hf, p, results[rid].samples[0])
        assert same and err < ATOL
        errs.append(err)
    assert engine.manager.num_free_blocks == 8
    engine.manager.check_invariants()
    print(f"\n[{model.backend}, {policy}] swapped out at step {out_step}, back in at {in_step}: "
          f"max |logit - transformers| {max(errs):.2e}; {st.transfers_to_host} to host, "
          f"{st.transfers_to_device} to device, {st.transfer_bytes:,} bytes")


def test_control_skipping_the_transfers_diverges_after_a_swap(hf, model):
    engine, prompts, outs, results = pressure_run(model, "write-back", run_transfers=False)
    assert engine.stats.swapped_in == 1 and engine.stats.skipped_transfers > 0
    err, _ = oracle_error(hf, prompts[1], results[1].samples[0])
    assert err > DIVERGED
    unharmed, same = oracle_error(hf, prompts[0], results[0].samples[0])
    assert same and unharmed < ATOL
    print(f"\n[{model.backend}] swap with the transfers skipped: max |logit - transformers| {err:.3f}")
