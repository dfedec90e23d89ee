"""Page layouts of hybrid models (issue 19, item 3): equal pages (vLLM), no-padding pages,
separate pools, and the modelled replay through each."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.kv_specs import ChunkedLocalAttention, FullAttention, SlidingWindow
from pagedkv.sim import page_layout as pl
from pagedkv.sim.sizing import ModelSpec, get_model

MIB = 2**20
specs = st.one_of(st.just(FullAttention()), st.builds(SlidingWindow, st.integers(1, 80)),
                  st.builds(ChunkedLocalAttention, st.integers(1, 80)))


@settings(max_examples=200, deadline=None)
@given(spec=specs, bs=st.integers(1, 20), contexts=st.lists(st.integers(0, 400), min_size=1, max_size=20))
def test_array_rules_are_the_spec_rules(spec, bs, contexts):
    held = pl.blocks_held_array(spec, contexts, bs)
    assert held.tolist() == [spec.blocks_held(c, bs) for c in contexts]
    peak = pl.peak_blocks_array(spec, contexts, bs)
    assert peak.tolist() == [max([spec.blocks_held(x, bs) for x in range(c + 1)]) for c in contexts]


def test_gemma_27b_vllm_pages_pad_eight_layers():
    gemma = get_model("Gemma-3-27B")
    budget = 20 << 30
    vllm = pl.equal_page_layout(gemma, budget)
    assert pl.vllm_group_layers(gemma) == 10
    assert (vllm.num_tables, vllm.padding_layers) == (7, 8)
    [pool] = vllm.pools
    assert pool.page_bytes == 10 * 131_072 and pool.num_blocks == budget // (10 * 131_072)
    # 32,768 tokens: full 2,048 blocks x 10 layers, sliding 64 blocks x 52 layers (+ 8 padding)
    assert vllm.real_bytes(32768) == (2048 * 10 + 64 * 52) * 131_072 == 2976 * MIB
    assert vllm.padding_bytes(32768) == 8 * 64 * 131_072 == 64 * MIB
    exact = pl.equal_page_layout(gemma, budget, group_layers=2)
    assert (exact.num_tables, exact.padding_layers, exact.padding_bytes(32768)) == (31, 0, 0)
    assert exact.bytes_per_request(32768) == 2976 * MIB
    uniform = pl.uniform_layout(gemma, budget)
    assert uniform.bytes_per_request(32768) == 2048 * 62 * 131_072 == 15_872 * MIB
    assert uniform.requests_fit(32768) == budget // (15_872 * MIB) == 1
    assert exact.requests_fit(32768) == (budget // (2 * 131_072)) // (2048 * 5 + 64 * 26) == 6


def test_gpt_oss_pages_are_equal_already():
    oss = get_model("gpt-oss-120b")
    vllm = pl.equal_page_layout(oss, 1 << 34)
    assert (pl.vllm_group_layers(oss), vllm.num_tables, vllm.padding_layers) == (18, 2, 0)


def test_separate_pools_split_the_budget():
    gemma = get_model("Gemma-3-27B")
    lay = pl.separate_pool_layout(gemma, 1 << 30, [0.25, 0.75])
    sliding, full = lay.pools
    assert sliding.page_bytes == 52 * 131_072 and sliding.num_blocks == (1 << 28) // (52 * 131_072)
    assert full.page_bytes == 10 * 131_072 and full.num_blocks == (3 << 28) // (10 * 131_072)
    # the scarcer pool decides: 4,096 tokens need 64 sliding blocks, 256 full
    assert lay.requests_fit(4096) == min(sliding.num_blocks // 64, full.num_blocks // 256)


@pytest.mark.parametrize("shares", [[1.0], [0.5, 0.6], [0.0, 1.0], [True, False], "ab", [-0.5, 1.5]])
def test_bad_shares_are_refused(shares):
    with pytest.raises(ValueError):
        pl.separate_pool_layout(get_model("Gemma-3-27B"), 1 << 30, shares)


def test_bad_arguments_are_refused():
    gemma = get_model("Gemma-3-27B")
    with pytest.raises(ValueError):
        pl.uniform_layout("Gemma-3-27B", 1 << 30)
    with pytest.raises(ValueError):
        pl.uniform_layout(gemma, 0)
    with pytest.raises(ValueError):
        pl.equal_page_layout(gemma, 1 << 30, group_layers=0)
    lay = pl.uniform_layout(gemma, 1 << 30)
    for prompts, outputs in (([], []), ([10], [1, 2]), ([0], [1]), ([10], [-1]), ([1.5], [2])):
        with pytest.raises(ValueError):
            pl.replay(lay, prompts, outputs)
    with pytest.raises(ValueError):
        pl.replay("uniform", [10], [1])


def _tiny(layers=2, budget_blocks=3):
    """A 2-layer model of 1 KV head of 8 (bf16): 2 x 8 x 2 = 32 bytes per token per layer."""
    spec = ModelSpec("tiny", layers, 1, 1, 8, 8)
    return spec, pl.uniform_layout(spec, budget_blocks * 16 * 32 * layers)


def test_replay_worked_example():
    _, lay = _tiny()
    assert lay.pools[0].num_blocks == 3
    r = pl.replay(lay, [16, 16], [17, 17])
    assert (r.steps, r.peak_running, r.preemptions, r.never_fit) == (18, 2, 1, 0)
    assert r.mean_running == pytest.approx(34 / 18)
    assert r.free_while_waiting == pytest.approx(1 / 3)  # 2 of 3 blocks held while the second waits


def test_replay_leaves_out_what_never_fits():
    _, lay = _tiny()
    r = pl.replay(lay, [16, 40], [16, 10])  # 50 tokens need 4 blocks of the 3
    assert (r.never_fit, r.steps, r.peak_running) == (1, 16, 1)


def test_a_chunk_peak_decides_fit_not_the_last_length():
    """Llama 4's chunk holds 512 blocks at 8,192 tokens but 1 at 8,193: a request that ends just
    past a chunk boundary still needed the whole chunk on its way there."""
    spec = ModelSpec("chunky", 1, 1, 1, 8, 8, layer_attention=(ChunkedLocalAttention(64),))
    lay = pl.equal_page_layout(spec, 3 * 16 * 32, group_layers=1)  # 3 blocks
    assert int(lay.pools[0].blocks(65, 16)) == 1 and int(lay.pools[0].peak(65, 16)) == 4
    assert pl.replay(lay, [60], [5]).never_fit == 1


def test_padding_share_over_a_replay():
    gemma = get_model("Gemma-3-27B")
    vllm = pl.equal_page_layout(gemma, 20 << 30)
    r = pl.replay(vllm, [32768], [0])
    assert r.padding_share == pytest.approx(64 / (2976 + 64))
    assert pl.replay(pl.equal_page_layout(gemma, 20 << 30, group_layers=2), [32768], [0]).padding_share == 0


def test_one_pool_sustains_at_least_any_fixed_split():
    """The stranding claim on a mixed workload: a fixed split strands memory in one pool."""
    gemma = get_model("Gemma-3-27B")
    rng = np.random.default_rng(0)
    prompts = rng.integers(200, 30_000, 120)
    outputs = rng.integers(1, 400, 120)
    budget = 20 << 30
    one = pl.replay(pl.equal_page_layout(gemma, budget, group_layers=2), prompts, outputs)
    best = pl.demand_share(gemma, prompts + outputs)
    for s in (best[0] / 2, best[0], min(0.9, 2 * best[0])):
        split = pl.replay(pl.separate_pool_layout(gemma, budget, [s, 1 - s]), prompts, outputs)
        assert split.mean_running < one.mean_running
        assert split.steps > one.steps


def test_demand_share():
    oss = get_model("gpt-oss-120b")
    assert pl.demand_share(oss, [4096]) == pytest.approx([8 / 264, 256 / 264])
    with pytest.raises(ValueError):
        pl.demand_share(oss, [0])


def test_size_shows_requests_fit_under_vllm_pages(capsys):
    from test_sizing import _run as size  # the size command with captured output

    rc, out, _ = size(["Gemma-3-27B", "--kv-gib", "19", "--context", "4096"], capsys)
    assert rc == 0
    budget = 19 * 2**30
    gemma = get_model("Gemma-3-27B")
    grouped = pl.equal_page_layout(gemma, budget, group_layers=2).requests_fit(4096)
    vllm = pl.equal_page_layout(gemma, budget).requests_fit(4096)
    assert (grouped, vllm) == (budget // (736 * MIB), (budget // (10 * 131_072)) // (6 * 64 + 256))
    assert vllm < grouped
    row = next(line for line in out.splitlines() if line.startswith("4,096") and line.rstrip().endswith(str(vllm)))
    assert row.split()[-2:] == [str(grouped), str(vllm)]
    assert "7 block tables per request, 8 padding layer slots" in " ".join(out.split())
