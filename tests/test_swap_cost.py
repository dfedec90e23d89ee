"""Swap against recompute per preemption: blocks, bytes, copies and modelled times against numbers
worked out by hand from the model's architecture, the link's parameters and the cost model."""
from __future__ import annotations

import pytest

from pagedkv.sim.costmodel import CostModel
from pagedkv.sim.swap_cost import (BLOCK_SIZES, DEFAULT_COPY_LATENCY_S, PCIE5_X16_BYTES_PER_S, Link,
                                   copies_per_block, crossover_block_size, swap_cost, swap_cost_table)

KV_8B = 2 * 32 * 8 * 128 * 2  # Llama-3.1-8B: 131,072 bytes per token
PARAMS_8B = 16_059_990_016 // 2  # its weight bytes in bf16 (sizing's estimate) / 2 bytes


def test_link_defaults_are_pcie5_x16_per_direction_and_10_us():
    assert PCIE5_X16_BYTES_PER_S == 64e9 and DEFAULT_COPY_LATENCY_S == 10e-6
    assert Link().seconds(3, 64_000) == pytest.approx(3 * 10e-6 + 1e-6)
    assert BLOCK_SIZES == (1, 2, 4, 8, 16, 32, 64, 128, 256)


def test_copies_per_block_follow_the_per_layer_layout():
    assert copies_per_block("Llama-3.1-8B") == 2 * 32
    assert copies_per_block("OPT-13B") == 2 * 40
    assert copies_per_block("DeepSeek-V3") == 61  # MLA: one latent per layer holds K and V


def test_llama_8b_1024_tokens_16_token_blocks_by_hand():
    c = swap_cost(1024, 16)
    assert (c.model, c.tokens, c.block_size, c.blocks) == ("Llama-3.1-8B", 1024, 16, 64)
    assert c.bytes_moved == 64 * 16 * KV_8B == 134_217_728
    assert c.copies == 64 * 64 == 4096
    assert c.swap_out_s == c.swap_in_s == pytest.approx(4096 * 10e-6 + 134_217_728 / 64e9)  # 43.06 ms
    assert c.swap_s == pytest.approx(2 * 0.043057152)
    assert c.recompute_s == pytest.approx(1024 * 2 * PARAMS_8B / 989e12)  # 16.63 ms
    assert c.swap_over_recompute == pytest.approx(0.086114304 / 0.0166283, rel=1e-4)
    assert not c.swap_wins


def test_the_last_block_moves_whole():
    c = swap_cost(1000, 256)  # 4 blocks hold 1,024 slots: the padding moves too
    assert c.blocks == 4 and c.bytes_moved == 1024 * KV_8B and c.copies == 4 * 64
    assert c.swap_out_s == pytest.approx(256 * 10e-6 + 1024 * KV_8B / 64e9)
    assert c.recompute_s == pytest.approx(1000 * 2 * PARAMS_8B / 989e12)  # only real tokens recompute


def test_table_over_block_sizes_swap_falls_and_recompute_stays():
    rows = swap_cost_table(1024)
    assert [r.block_size for r in rows] == list(BLOCK_SIZES)
    assert all(r.bytes_moved == 1024 * KV_8B for r in rows)  # 1,024 divides by every power of two
    assert [r.copies for r in rows] == [1024 // bs * 64 for bs in BLOCK_SIZES]
    assert len({r.recompute_s for r in rows}) == 1
    times = [r.swap_s for r in rows]
    assert times == sorted(times, reverse=True)
    # 2 x (1,024 / bs x 64 copies x 10 us + 134,217,728 B / 64e9): bs 1 -> 1,314.9 ms, bs 256 -> 9.31 ms
    assert times[0] == pytest.approx(2 * (65_536 * 10e-6 + 134_217_728 / 64e9))
    assert times[-1] == pytest.approx(2 * (256 * 10e-6 + 134_217_728 / 64e9))
    assert [r.swap_wins for r in rows] == [False] * 7 + [True] * 2  # 128 and 256 win


def test_crossover_by_hand():
    """1,024 tokens: 10 blocks (block sizes 103..113) cost 2 x (640 copies x 10 us + 10 x bs x
    131,072 / 64e9) >= 17.0 ms > 16.63 ms of recompute; 114 needs 9 blocks: 15.7 ms."""
    assert swap_cost(1024, 113).blocks == 10 and not swap_cost(1024, 113).swap_wins
    assert swap_cost(1024, 114).blocks == 9 and swap_cost(1024, 114).swap_wins
    assert crossover_block_size(1024) == 114
    assert crossover_block_size(1024, BLOCK_SIZES) == 128
    # halving the per-copy latency halves the latency term: 1,024 / bs x 64 x 5 us x 2 <= 12.43 ms
    # -> bs >= 52.7; 53 needs 20 blocks (2 x (6.40 + 2.17) ms = 17.1 > 16.6), 54 needs 19
    # (2 x (6.08 + 2.10) ms = 16.4)
    assert crossover_block_size(1024, link=Link(latency_s=5e-6)) == 54
    assert crossover_block_size(16) is None  # 16 tokens: one block at best, 64 copies = 1.28 ms > 0.26 ms


def test_free_copies_make_swap_win_at_every_block_size():
    """With no per-copy latency only the bytes count: 2 x 131,072 / 64e9 = 4.1 us per token
    against 16.2 us to recompute it."""
    assert crossover_block_size(1024, link=Link(latency_s=0)) == 1


def test_other_models_and_cost_models():
    c = swap_cost(512, 32, "OPT-13B")
    assert c.bytes_moved == 512 * 819_200 and c.copies == 16 * 80
    slow_gpu = CostModel.for_model("Llama-3.1-8B", peak_flops=989e12 / 4)
    slow = swap_cost(1024, 16, cost_model=slow_gpu)
    assert slow.recompute_s == pytest.approx(4 * swap_cost(1024, 16).recompute_s)
    assert swap_cost(1024, 16, copies=1).copies == 64  # a block-contiguous layout


@pytest.mark.parametrize("kwargs", [
    {"tokens": 0, "block_size": 16}, {"tokens": 1.5, "block_size": 16}, {"tokens": 8, "block_size": 0},
    {"tokens": 8, "block_size": True}, {"tokens": 8, "block_size": 16, "copies": 0},
    {"tokens": 8, "block_size": 16, "model": "no-such-model"}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        swap_cost(**kwargs)


@pytest.mark.parametrize("kwargs", [{"bandwidth": 0}, {"bandwidth": float("inf")}, {"latency_s": -1e-6}])
def test_bad_links(kwargs):
    with pytest.raises(ValueError):
        Link(**kwargs)
