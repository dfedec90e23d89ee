"""Recurrent-state hybrids: state bytes from configs, vLLM's forced block size, the page layouts.

Every expected byte count is written out as the arithmetic of the config's fields (vLLM's
``MambaStateShapeCalculator`` formulas), so a wrong field or formula shows which factor moved.
"""
from __future__ import annotations

import argparse
import json
import re

import numpy as np
import pytest

from pagedkv.commands import size as size_cmd
from pagedkv.sim.page_layout import Layout, Pool, replay
from pagedkv.sim.sizing import GIB, uniform_page_group_size
from pagedkv.sim.state_layout import (
    DEFAULT_SETUP,
    SGLANG_STATE_RATIO,
    compare_state_layouts,
    separate_state_layout,
    small_page_layout,
    vllm_state_layout,
)
from pagedkv.sim.state_sizing import (
    HybridModel,
    StateSpec,
    builtin_hybrids,
    get_hybrid,
    hybrid_from_config,
    hybrid_sizing,
    is_hybrid_state_config,
    vllm_attention_block_size,
)
from pagedkv.kv_specs import FullAttention
from pagedkv.sim.traces import trace_lengths, trace_path
from pagedkv.sim.workloads import sample_lengths

BF16, FP32 = 2, 4

# model: (attention layers, state layers, conv bytes, temporal bytes, K/V bytes per token per layer,
#         vLLM block), each at tp 1, written as the config's arithmetic.
BUILTIN_EXPECTED = {
    # conv_dim = 2 x 16 x 128 + 32 x 128 = 8,192; recurrent 32 x 128 x 128; K/V 2 x 2 heads x 256
    "Qwen3-Next-80B-A3B": (12, 36, 3 * (2 * 16 * 128 + 32 * 128) * BF16, 32 * 128 * 128 * BF16,
                           2 * 2 * 256 * BF16, 16 * -(-1_097_728 // (16 * 2_048))),
    # the same gated DeltaNet, its recurrent state in float32 (mamba_ssm_dtype); K/V 2 x 4 x 256
    "Qwen3.5-9B": (8, 24, 3 * (2 * 16 * 128 + 32 * 128) * BF16, 32 * 128 * 128 * FP32,
                   2 * 4 * 256 * BF16, 16 * -(-2_146_304 // (16 * 4_096))),
    # intermediate = 128 heads x 80; conv_dim = 10,240 + 2 x 8 groups x 128; SSM in float32
    "Nemotron-Nano-9B-v2": (4, 27, 3 * (128 * 80 + 2 * 8 * 128) * BF16, 128 * 80 * 128 * FP32,
                            2 * 8 * 128 * BF16, 16 * -(-5_316_608 // (16 * 4_096))),
    # intermediate = 2 x 4,096; conv_dim = 8,192 + 2 x 1 x 128; SSM 128 heads x 64 x 128
    "Granite-4.0-H-Small": (4, 36, 3 * (2 * 4096 + 2 * 1 * 128) * BF16, 128 * 64 * 128 * BF16,
                            2 * 8 * (4096 // 32) * BF16, 16 * -(-2_147_840 // (16 * 4_096))),
    # Mamba: conv 3 x 8,192, SSM 8,192 x 16
    "Jamba-v0.1": (4, 28, 3 * (2 * 4096) * BF16, (2 * 4096) * 16 * BF16,
                   2 * 8 * (4096 // 32) * BF16, 16 * -(-311_296 // (16 * 4_096))),
    # KDA: conv 3 x (3 x 32 x 128); recurrent 32 x 128 x 128 in float32; MLA latent 512 + 64;
    # MLA kernels align to 64 tokens
    "Kimi-Linear-48B-A3B": (7, 20, 3 * (3 * 32 * 128) * BF16, 32 * 128 * 128 * FP32,
                            (512 + 64) * BF16, 64 * -(-2_170_880 // (64 * 1_152))),
}


def test_every_builtin_matches_its_config_arithmetic():
    assert set(builtin_hybrids()) == set(BUILTIN_EXPECTED)
    for name, (attn, state, conv, temporal, kv, block) in BUILTIN_EXPECTED.items():
        model = get_hybrid(name)
        s = hybrid_sizing(model)
        assert (model.attention_layers, model.state_layers) == (attn, state), name
        assert (s.conv_bytes_per_layer, s.temporal_bytes_per_layer) == (conv, temporal), name
        assert s.state_bytes_per_layer == conv + temporal, name
        assert s.state_bytes_per_sequence == state * (conv + temporal), name
        assert s.attention_bytes_per_token_layer == kv, name
        assert s.vllm_block_size == block, name
        assert model.source, f"{name} cites no source"


def test_builtin_numbers_written_out():
    """The same numbers as plain integers, the way docs/design.md quotes them."""
    got = {n: (hybrid_sizing(m).state_bytes_per_layer, hybrid_sizing(m).vllm_block_size)
           for n, m in builtin_hybrids().items()}
    assert got == {"Qwen3-Next-80B-A3B": (1_097_728, 544), "Qwen3.5-9B": (2_146_304, 528),
                   "Nemotron-Nano-9B-v2": (5_316_608, 1_312), "Granite-4.0-H-Small": (2_147_840, 528),
                   "Jamba-v0.1": (311_296, 80), "Kimi-Linear-48B-A3B": (2_170_880, 1_920)}


def test_qwen3_next_worked_example():
    """(3 x 8,192 + 32 x 128 x 128) x 2 B = 1,097,728 B; 16 x ceil(1,097,728 / (16 x 2,048)) = 544."""
    model = get_hybrid("qwen3-next-80b-a3b")  # case-insensitive
    assert model.state.shapes() == ((3, 8192), (32, 128, 128))
    assert (3 * 8_192 + 32 * 128 * 128) * 2 == 1_097_728 == model.state.bytes()
    assert vllm_attention_block_size(1_097_728, 2_048) == 16 * 34 == 544
    s = hybrid_sizing(model)
    assert s.vllm_page_bytes == 544 * 2_048 == 1_114_112
    assert s.vllm_page_bytes - s.state_bytes_per_layer == 16_384  # the state's padding
    assert (s.vllm_group_layers, s.vllm_attention_groups, s.vllm_state_groups) == (12, 1, 3)
    assert s.fragmentation_slots(544) == 271.5
    assert s.fragmentation_bytes(544) == 271.5 * 12 * 2_048
    assert s.fragmentation_bytes(16) == 7.5 * 12 * 2_048


def test_vllm_rule_branches():
    # alignment is max(kernel alignment, block size): a user block of 64 rounds to 64s
    assert vllm_attention_block_size(1_097_728, 2_048, block_size=64) == 64 * -(-1_097_728 // (64 * 2_048)) == 576
    # a user block already large enough is kept
    assert vllm_attention_block_size(1_097_728, 2_048, block_size=1024) == 1024
    # Mamba prefix caching ("all"): lcm(chunk, alignment) x ceil(ceil(state / per token) / that)
    assert vllm_attention_block_size(1_097_728, 2_048, prefix_chunk=256) == 256 * -(-536 // 256) == 768
    # Blackwell + head size 256 + FlashInfer aligns to 32
    assert vllm_attention_block_size(1_097_728, 2_048, alignment=32) == 32 * 17 == 544
    with pytest.raises(ValueError, match="state_page_bytes"):
        vllm_attention_block_size(0, 2_048)
    with pytest.raises(ValueError, match="alignment"):
        vllm_attention_block_size(1, 2_048, alignment=0)


def test_tensor_parallelism_divides_the_state():
    q = get_hybrid("Qwen3-Next-80B-A3B")
    # tp 4: conv 8,192 / 4 = 2,048 columns, 32 / 4 = 8 value heads; one of 2 KV heads per GPU
    assert q.state.shapes(4) == ((3, 2048), (8, 128, 128))
    s = hybrid_sizing(q, tp=4)
    assert s.state_bytes_per_layer == (3 * 2048 + 8 * 128 * 128) * 2 == 274_432
    assert s.attention_bytes_per_token_layer == 2 * 1 * 256 * 2
    assert s.vllm_block_size == 16 * -(-274_432 // (16 * 1_024)) == 272
    # Mamba2: one group does not split over 2 GPUs, so vLLM raises the groups to 2
    g = get_hybrid("Granite-4.0-H-Small")
    assert g.state.shapes(2) == ((3, (8192 + 2 * 2 * 128) // 2), (64, 64, 128))
    # MLA: the latent is whole on every GPU
    k = get_hybrid("Kimi-Linear-48B-A3B")
    assert hybrid_sizing(k, tp=2).attention_bytes_per_token_layer == (512 + 64) * 2
    with pytest.raises(ValueError, match="tp 3 does not divide"):
        q.state.shapes(3)


def test_dtypes_follow_vllms_rules():
    base = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                linear_value_head_dim=8, torch_dtype="bfloat16")
    assert hybrid_from_config(base).state.temporal_dtype == "bfloat16"
    assert hybrid_from_config({**base, "mamba_ssm_dtype": "float32"}).state.temporal_dtype == "float32"
    nemotron = dict(num_hidden_layers=3, hybrid_override_pattern="M*-", num_attention_heads=2,
                    num_key_value_heads=1, head_dim=8, mamba_num_heads=2, mamba_head_dim=4, n_groups=1,
                    ssm_state_size=8, conv_kernel=4, torch_dtype="bfloat16")
    assert hybrid_from_config(nemotron).state.temporal_dtype == "float32"  # vLLM's NemotronH default
    assert hybrid_from_config({**nemotron, "mamba_ssm_cache_dtype": "bfloat16"}).state.temporal_dtype == "bfloat16"
    assert get_hybrid("Kimi-Linear-48B-A3B").state.temporal_dtype == "float32"


def test_layer_layout_fields_of_every_family():
    common = dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=32, mamba_d_conv=4,
                  mamba_d_state=8, mamba_expand=2, torch_dtype="bfloat16")
    mamba2 = dict(common, mamba_n_groups=1, mamba_n_heads=4, mamba_d_head=16)
    # Jamba: layer i attends when i % period == offset
    jamba = hybrid_from_config(dict(common, model_type="jamba", num_hidden_layers=16, attn_layer_period=8,
                                    attn_layer_offset=4))
    assert (jamba.attention_layers, jamba.state_layers, jamba.state.kind) == (2, 14, "mamba1")
    # Bamba: attn_layer_indices
    bamba = hybrid_from_config(dict(mamba2, model_type="bamba", num_hidden_layers=8, attn_layer_indices=[2, 6]))
    assert (bamba.attention_layers, bamba.state_layers, bamba.state.kind) == (2, 6, "mamba2")
    # Granite 4.0-H: layer_types of "mamba" and "attention"
    granite = hybrid_from_config(dict(mamba2, model_type="granitemoehybrid", num_hidden_layers=4,
                                      layer_types=["mamba", "attention", "mamba", "mamba"]))
    assert (granite.attention_layers, granite.state_layers) == (1, 3)
    # Falcon-H1: attention and Mamba2 side by side in every layer; mamba_d_ssm sets the width
    falcon = hybrid_from_config(dict(mamba2, model_type="falcon_h1", num_hidden_layers=4, mamba_d_ssm=48))
    assert (falcon.attention_layers, falcon.state_layers, falcon.state.intermediate) == (4, 4, 48)
    # Qwen3-Next without layer_types: every full_attention_interval-th layer attends
    qwen = dict(num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                full_attention_interval=4, linear_conv_kernel_dim=4, linear_num_key_heads=2,
                linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    assert (hybrid_from_config(qwen).attention_layers, hybrid_from_config(qwen).state_layers) == (2, 6)
    # a multimodal wrapper's text_config is read, its dtype kept
    wrapped = hybrid_from_config({"torch_dtype": "float16", "text_config": qwen})
    assert wrapped.dtype == "float16" and wrapped.state_layers == 6
    # Nemotron-H: M is Mamba2, * attention; - (MLP) and E (MoE) hold no state
    nemo = hybrid_from_config(dict(num_hidden_layers=5, hybrid_override_pattern="M-*EM", num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=8, mamba_num_heads=2, mamba_head_dim=4,
                                   n_groups=1, ssm_state_size=8, conv_kernel=4))
    assert (nemo.attention_layers, nemo.state_layers) == (1, 2)
    assert is_hybrid_state_config(qwen) and not is_hybrid_state_config({"num_hidden_layers": 2})
    # Granite 4.0 Micro: a granitemoehybrid config whose layers all attend keeps no state
    micro = dict(mamba2, model_type="granitemoehybrid", num_hidden_layers=2, layer_types=["attention"] * 2)
    assert not is_hybrid_state_config(micro)


QWEN_NEXT_TINY = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
                      linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                      linear_value_head_dim=8)


@pytest.mark.parametrize("field", ["linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads",
                                   "linear_key_head_dim", "linear_value_head_dim", "num_key_value_heads"])
def test_a_missing_state_dimension_is_refused_by_name(field):
    cfg = {k: v for k, v in QWEN_NEXT_TINY.items() if k != field}
    with pytest.raises(ValueError, match=f"lacks {field}"):
        hybrid_from_config(cfg)


@pytest.mark.parametrize("cfg,match", [
    (dict(QWEN_NEXT_TINY, layer_types=["linear_attention"] * 3), "layer_types must list one type per layer"),
    (dict(QWEN_NEXT_TINY, layer_types=["linear_attention"] * 4), "no attention layer"),
    (dict(QWEN_NEXT_TINY, layer_types=["linear_attention", "sliding_attention", "x", "full_attention"]),
     "layer types"),
    (dict(QWEN_NEXT_TINY, linear_key_head_dim=0), "linear_key_head_dim must be a positive integer"),
    (dict(QWEN_NEXT_TINY, linear_key_head_dim=8.5), "linear_key_head_dim"),
    (dict(num_hidden_layers=3, hybrid_override_pattern="M*", mamba_num_heads=2), "one character per layer"),
    (dict(num_hidden_layers=3, hybrid_override_pattern="M*-", num_attention_heads=2, num_key_value_heads=1,
          head_dim=8, mamba_num_heads=2, mamba_head_dim=4, ssm_state_size=8, conv_kernel=4), "lacks n_groups"),
    (dict(model_type="jamba", num_hidden_layers=8, hidden_size=32, mamba_d_conv=4, mamba_d_state=8,
          mamba_expand=2, attn_layer_period=4), "attn_layer_offset"),
    (dict(num_hidden_layers=4, linear_attn_config={"num_heads": 2}), "full_attn_layers"),
    (dict(num_hidden_layers=2, num_attention_heads=2), "no recurrent-state layers"),
])
def test_bad_configs_are_refused(cfg, match):
    with pytest.raises(ValueError, match=match):
        hybrid_from_config(cfg)


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="state kind"):
        StateSpec("rwkv", 4, "bfloat16", "bfloat16")
    with pytest.raises(ValueError, match="unknown dtype"):
        StateSpec("mamba1", 4, "bfloat16", "float13", intermediate=8, state_size=4)
    spec = StateSpec("mamba1", 4, "bfloat16", "bfloat16", intermediate=8, state_size=4)
    with pytest.raises(ValueError, match="attention layers"):
        HybridModel("m", 0, 1, spec, "bfloat16", num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="model must be a HybridModel"):
        hybrid_sizing("Qwen3-Next-80B-A3B")


def test_uniform_page_group_size_is_vllms_rule():
    assert uniform_page_group_size([52, 10]) == 10       # Gemma 3 27B
    assert uniform_page_group_size([12, 36]) == 12       # Qwen3-Next
    assert uniform_page_group_size([12, 12]) == 12       # gpt-oss
    assert uniform_page_group_size([10, 14]) == 14       # most < 1.5 x fewest: the most
    with pytest.raises(ValueError):
        uniform_page_group_size([])


def test_requests_fit_by_hand():
    """Qwen3-Next at tp 4 in 34 GiB: vLLM's block is 12 x 272 x 1,024 bytes; a 4,096-token request
    holds ceil(4,096 / 272) = 16 attention blocks + 3 state blocks. Small pages: 16 x 12 x 1,024
    bytes, 256 attention pages + ceil(36 x 274,432 / 196,608) = 51 state pages."""
    s = hybrid_sizing(get_hybrid("Qwen3-Next-80B-A3B"), tp=4)
    budget = 34 * GIB
    assert s.vllm_requests_fit(budget, 4096) == budget // (12 * 272 * 1024) // (16 + 3)
    assert s.state_pages(16) == -(-36 * 274_432 // (16 * 12 * 1024)) == 51
    assert s.small_page_requests_fit(budget, 4096) == budget // (16 * 12 * 1024) // (256 + 51)
    assert s.small_page_requests_fit(budget, 4096) > s.vllm_requests_fit(budget, 4096)


def test_pool_state_blocks_and_last_block_waste():
    pool = Pool("p", 100, 1000, ((FullAttention(), 1),), state_blocks=3)
    assert pool.blocks(np.array([0, 1, 17]), 16).tolist() == [0, 1 + 3, 2 + 3]
    assert pool.peak(np.array([0, 33]), 16).tolist() == [0, 3 + 3]
    # one request of 1 prompt token and 15 outputs: it holds 1, 2, ..., 15 tokens over 15 steps in
    # one 16-slot block: 120 of 240 slots used, half wasted
    layout = Layout("one pool", "m", 16, 100_000, 100, (pool,), ((FullAttention(), 1),))
    r = replay(layout, [1], [15])
    assert r.steps == 15 and r.last_block_waste == 1 - (15 * 16 / 2) / (15 * 16)


def _mooncake(n):
    path = trace_path("mooncake")
    if path is None:
        pytest.skip("the Mooncake trace is not available")
    p, o = trace_lengths(path)
    return np.array(p[:n]), np.array(o[:n])


def test_small_pages_beat_vllm_pages_on_the_same_bytes():
    """Qwen3-Next on an H100 at tp 4 (34.28 GiB of KV), the first 300 Mooncake requests: one pool of
    small pages wastes less of its attention slots and runs more requests at once than vLLM's pages."""
    model, budget = DEFAULT_SETUP.hybrid(), DEFAULT_SETUP.budget_bytes
    assert round(budget / GIB, 2) == 34.28
    p, o = _mooncake(300)
    rows = {r.layout.name: r for r in compare_state_layouts(model, budget, p, o, tp=DEFAULT_SETUP.tp,
                                                             max_running=DEFAULT_SETUP.max_running)}
    vllm, small = rows["vLLM pages (block 272)"].result, rows["small pages (16 tokens), states in 51 pages"].result
    typical = next(r for r in rows.values() if r.state_share == SGLANG_STATE_RATIO / (1 + SGLANG_STATE_RATIO))
    assert small.last_block_waste < vllm.last_block_waste / 10
    assert small.mean_running > vllm.mean_running
    assert small.mean_running > typical.result.mean_running
    assert vllm.never_fit == small.never_fit == 0


def test_small_pages_beat_vllm_pages_when_memory_binds():
    """ShareGPT-like lengths (seed 0) in 1 GiB, where memory, not max_running, decides."""
    model = DEFAULT_SETUP.hybrid()
    p, o = sample_lengths("sharegpt", 300, np.random.default_rng(0))
    vllm = replay(vllm_state_layout(model, GIB, tp=4), p, o, max_running=1024)
    small = replay(small_page_layout(model, GIB, tp=4), p, o, max_running=1024)
    split = replay(separate_state_layout(model, GIB, 0.9 / 1.9, tp=4), p, o, max_running=1024)
    assert small.mean_running > vllm.mean_running > split.mean_running
    assert small.last_block_waste < vllm.last_block_waste


def test_layouts_refuse_bad_arguments():
    model = DEFAULT_SETUP.hybrid()
    with pytest.raises(ValueError, match="state_share"):
        separate_state_layout(model, GIB, 1.0)
    with pytest.raises(ValueError, match="budget_bytes"):
        small_page_layout(model, 0)


def _size_args(**kw):
    parser = argparse.ArgumentParser()
    size_cmd.add_arguments(parser)
    argv = [kw.pop("model")] if "model" in kw else []
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return parser.parse_args(argv)


def test_size_prints_a_hybrids_state_and_vllm_block(capsys):
    assert size_cmd.run(_size_args(model="Qwen3-Next-80B-A3B")) == 0
    out = capsys.readouterr().out
    assert "state bytes per layer" in out and "1,097,728" in out
    assert re.search(r"attention block size vLLM forces \(tokens\) +544\n", out)
    assert all(len(line) <= 100 for line in out.splitlines())


def test_size_requests_fit_and_list(capsys):
    assert size_cmd.run(_size_args(model="Qwen3-Next-80B-A3B", tp=4, kv_gib=34, context=4096)) == 0
    out = capsys.readouterr().out
    s = hybrid_sizing(get_hybrid("Qwen3-Next-80B-A3B"), tp=4)
    line = next(x for x in out.splitlines() if x.startswith("4,096"))
    assert line.split()[1:3] == [f"{s.vllm_requests_fit(34 * GIB, 4096):,}", f"{s.small_page_requests_fit(34 * GIB, 4096):,}"]
    assert size_cmd.run(_size_args(list=True)) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in BUILTIN_EXPECTED)


def test_size_reads_a_hybrid_config_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN_NEXT_TINY))
    assert size_cmd.run(_size_args(config=path)) == 0
    assert "state bytes per layer" in capsys.readouterr().out


@pytest.mark.parametrize("kw,match", [
    (dict(model="Qwen3-Next-80B-A3B", tp=3), "--tp 3 does not divide"),
    (dict(model="Qwen3-Next-80B-A3B", replay="sharegpt"), "--replay needs a KV budget"),
    (dict(model="Qwen3-Next-80B-A3B", kv_gib=1, replay="alpaca"), "--replay must name traces"),
    (dict(model="Qwen3-Next-80B-A3B", gpu_mem_gib=80), "needs --weights-gib"),
    (dict(model="Llama-3.1-8B", kv_gib=1, replay="sharegpt"), "no recurrent state"),
    (dict(model="Qwen3-Next-80B-A3B", requests=0), "--requests"),
])
def test_size_bad_input_is_one_line_and_exit_2(kw, match, capsys):
    assert size_cmd.run(_size_args(**kw)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err and "Traceback" not in err


def test_size_config_missing_a_state_field_exits_2(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in QWEN_NEXT_TINY.items() if k != "linear_value_head_dim"}))
    assert size_cmd.run(_size_args(config=path)) == 2
    err = capsys.readouterr().err
    assert "linear_value_head_dim" in err and err.count("\n") == 1
