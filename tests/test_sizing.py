"""Sizing: KV bytes per token/block from config fields, tensor parallelism, and what fits.

Every expected value below is a published figure (docs/design.md, the vLLM paper's Table 1) used as a
check; the library computes them from architecture fields.
"""
from __future__ import annotations

import argparse
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.commands import size as size_cmd
from pagedkv.sim.sizing import (
    GIB,
    builtin_models,
    dtype_bytes,
    estimate_weight_bytes,
    fit_blocks,
    get_model,
    kv_budget_bytes,
    kv_bytes_per_token,
    kv_size,
    spec_from_config,
)

# The design's "Reference numbers" (docs/design.md): KV bytes per token.
DESIGN_VALUES = {
    "Llama-3.1-8B": 131_072,
    "Llama-3.1-70B": 327_680,
    "Llama-2-7B": 524_288,
    "Qwen2.5-7B": 57_344,
    "OPT-13B": 819_200,
    "DeepSeek-V3": 70_272,  # MLA: 61 x (512 + 64) x 2
}


@pytest.mark.parametrize("model,expected", sorted(DESIGN_VALUES.items()))
def test_design_values(model, expected):
    assert kv_bytes_per_token(model) == expected
    assert kv_size(get_model(model), block_size=16).bytes_per_block == 16 * expected


def test_builtin_table_covers_the_issue_models_and_attention_kinds():
    models = builtin_models()
    hybrid = {"gpt-oss-20b", "gpt-oss-120b", "Gemma-3-4B", "Gemma-3-12B", "Gemma-3-27B", "Llama-4-Scout",
              "Command-R7B"}
    assert set(DESIGN_VALUES) | {"Mistral-7B"} | hybrid == set(models)
    assert {n for n, m in models.items() if m.is_hybrid} == hybrid
    kinds = {m.attention for m in models.values()}
    assert {"MHA", "GQA", "MLA"} <= kinds
    assert models["Mistral-7B"].attention == "GQA"
    assert kv_bytes_per_token("mistral-7b") == 2 * 32 * 8 * 128 * 2  # case-insensitive lookup


def test_vllm_table1_opt13b_needs_gib():
    """vLLM paper Table 1: OPT-13B, 12 GB for KV -> "15.7K" KV slots.

    Tolerance: the paper rounds to 3 significant digits, so the slots must lie in
    [15,650, 15,750). GiB (2**30 bytes) reproduces it (15,728); 10**9-byte GB gives 14,648 and
    does not, so the paper's GB is GiB.
    """
    s = kv_size(get_model("OPT-13B"), block_size=16)
    cap = fit_blocks(s, kv_budget_gib=12)
    assert 15_650 <= cap.token_slots < 15_750
    assert cap.num_blocks == 983 and cap.token_slots == 15_728
    decimal_slots = 12e9 // s.bytes_per_token
    assert not 15_650 <= decimal_slots < 15_750


def test_vllm_table1_opt175b_with_tensor_parallelism():
    """Table 1, OPT-175B on 8 GPUs: 264 GB of KV -> "60.1K" slots (tolerance: the rounding, +-50).

    With tp=8 each GPU holds 96/8 = 12 of the heads and 264/8 GiB of KV: the same slots."""
    cfg = {"model_type": "opt", "num_hidden_layers": 96, "num_attention_heads": 96,
           "hidden_size": 12288, "torch_dtype": "float16"}
    s = kv_size(spec_from_config(cfg), tp=8, block_size=1)
    assert s.bytes_per_token_total == 2 * 96 * 12288 * 2
    slots = fit_blocks(s, kv_budget_gib=264 / 8).token_slots
    assert 60_050 <= slots < 60_150


def test_config_file_and_head_dim_field(tmp_path):
    # A Gemma-like config where head_dim != hidden / heads: head_dim wins.
    cfg = {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
           "hidden_size": 3072, "head_dim": 256, "torch_dtype": "bfloat16"}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    spec = spec_from_config(p)
    assert spec.head_dim == 256 and spec.attention == "MHA"
    assert kv_size(spec).bytes_per_token == 2 * 28 * 16 * 256 * 2


def test_mqa_falcon_style_and_gpt2_names():
    falcon = {"n_layer": 32, "n_head": 71, "hidden_size": 4544, "multi_query": True,
              "torch_dtype": "bfloat16"}
    spec = spec_from_config(falcon)
    assert spec.attention == "MQA" and spec.num_kv_heads == 1
    assert kv_size(spec).bytes_per_token == 2 * 32 * 1 * 64 * 2
    gpt2 = {"n_layer": 12, "n_head": 12, "n_embd": 768, "torch_dtype": "float32"}
    assert kv_bytes_per_token(gpt2) == 2 * 12 * 12 * 64 * 4


def test_mla_ignores_kv_heads_and_tp():
    v3 = get_model("DeepSeek-V3")
    assert v3.is_mla and v3.num_kv_heads == 128
    for tp in (1, 8, 16):
        s = kv_size(v3, tp=tp)
        assert s.bytes_per_token == 61 * (512 + 64) * 2  # the latent is whole on every GPU
        assert s.bytes_per_token_total == tp * s.bytes_per_token


def test_text_config_wrapper():
    wrapped = {"torch_dtype": "bfloat16", "text_config": {
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_size": 4096}}
    assert kv_bytes_per_token(wrapped) == 131_072


def test_tensor_parallel_sharding_and_replication():
    spec = get_model("Llama-3.1-70B")  # 8 KV heads
    assert kv_size(spec, tp=8).bytes_per_token == 327_680 // 8
    s16 = kv_size(spec, tp=16)  # more GPUs than heads: one head each, every head stored twice
    assert s16.kv_heads_per_gpu == 1 and s16.bytes_per_token == 327_680 // 8
    assert s16.bytes_per_token_total == 2 * 327_680
    s3 = kv_size(spec, tp=3)  # ceil(8 / 3) = 3 heads per GPU
    assert s3.kv_heads_per_gpu == 3 and s3.bytes_per_token == 327_680 * 3 // 8


def test_dtype_override_and_names():
    assert kv_bytes_per_token("Llama-3.1-8B", dtype="fp8") == 131_072 // 2
    assert kv_bytes_per_token("Llama-3.1-8B", dtype="float32") == 131_072 * 2
    assert dtype_bytes("torch.bfloat16") == 2 and dtype_bytes("float8_e4m3fn") == 1
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_bytes("float13")


@given(layers=st.integers(1, 128), kv=st.integers(1, 64), group=st.integers(1, 8),
       head_dim=st.sampled_from([32, 64, 80, 96, 128, 256]), tp=st.integers(1, 32),
       dtype=st.sampled_from(["float16", "bfloat16", "float32", "fp8"]))
def test_formula_and_sharding_properties(layers, kv, group, head_dim, tp, dtype):
    heads = kv * group
    cfg = {"num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
           "hidden_size": heads * head_dim, "torch_dtype": dtype}
    full = kv_bytes_per_token(cfg)
    assert full == 2 * layers * kv * head_dim * dtype_bytes(dtype)
    s = kv_size(spec_from_config(cfg), tp=tp)
    assert s.kv_heads_per_gpu == math.ceil(kv / tp)
    assert s.bytes_per_token_total >= full  # sharding never loses heads
    if kv % tp == 0:
        assert s.bytes_per_token_total == full  # exact split, nothing replicated


def test_fit_from_gpu_memory():
    s = kv_size(get_model("Llama-3.1-8B"), block_size=16)  # 2 MiB blocks
    cap = fit_blocks(s, gpu_mem_gib=80, util=0.9, weights_gib=16)  # 56 GiB of KV
    assert cap.kv_budget_bytes == 56 * GIB
    assert cap.num_blocks == 56 * GIB // (2 * 2**20) == 28_672
    assert cap.token_slots == 28_672 * 16


def test_weight_estimates_match_parameter_counts():
    # Published parameter counts (model cards), as checks within 1%.
    for model, params in (("Llama-3.1-8B", 8.03e9), ("Llama-2-7B", 6.74e9), ("Llama-3.1-70B", 70.6e9),
                          ("Mistral-7B", 7.24e9), ("OPT-13B", 12.85e9)):
        spec = get_model(model)
        est = estimate_weight_bytes(spec) / dtype_bytes(spec.dtype)
        assert est == pytest.approx(params, rel=0.01), model
    assert estimate_weight_bytes(get_model("DeepSeek-V3")) is None  # MoE: not estimated


@pytest.mark.parametrize("kwargs,match", [
    (dict(), "give kv_budget_gib"),
    (dict(gpu_mem_gib=80), "needs weights_gib"),
    (dict(gpu_mem_gib=80, weights_gib=100), "no memory left"),
    (dict(gpu_mem_gib=80, weights_gib=1, util=0), "util"),
    (dict(kv_budget_gib=-1), "kv_budget_gib"),
    (dict(kv_budget_gib=1, gpu_mem_gib=80), "not both"),
])
def test_fit_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fit_blocks(kv_size(get_model("OPT-13B")), **kwargs)


def test_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="tp"):
        kv_size(get_model("OPT-13B"), tp=0)
    with pytest.raises(ValueError, match="unknown model"):
        get_model("GPT-5")
    with pytest.raises(ValueError, match="lacks"):
        spec_from_config({"hidden_size": 4096})
    with pytest.raises(ValueError, match="multiple"):
        spec_from_config({"num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 4,
                          "hidden_size": 96})
    with pytest.raises(ValueError, match="does not exist"):
        spec_from_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        spec_from_config(tmp_path / "bad.json")
    with pytest.raises(ValueError):
        kv_budget_bytes(80, 1.5, 10)


def _run(argv, capsys):
    p = argparse.ArgumentParser()
    size_cmd.add_arguments(p)
    rc = size_cmd.run(p.parse_args(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_list_and_table1(capsys):
    rc, out, _ = _run(["--list"], capsys)
    assert rc == 0 and all(name in out for name in DESIGN_VALUES) and "819,200" in out
    rc, out, _ = _run(["OPT-13B", "--kv-gib", "12"], capsys)
    assert rc == 0 and "15,728" in out and "983" in out


def test_cli_gpu_config_and_errors(capsys, tmp_path):
    rc, out, _ = _run(["Llama-3.1-8B", "--gpu-mem-gib", "80", "--weights-gib", "16"], capsys)
    assert rc == 0 and "28,672" in out
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32,
                               "num_key_value_heads": 8, "hidden_size": 4096,
                               "torch_dtype": "bfloat16"}))
    rc, out, _ = _run(["--config", str(cfg), "--dtype", "fp8", "--tp", "2"], capsys)
    assert rc == 0 and "32,768" in out  # 131,072 / 2 (fp8) / 2 (tp)
    rc, _, err = _run(["DeepSeek-V3", "--gpu-mem-gib", "80"], capsys)
    assert rc == 2 and "--weights-gib" in err
    rc, _, err = _run([], capsys)
    assert rc == 2 and "model name" in err


@pytest.mark.parametrize("kwargs", [dict(kv_budget_gib=1e30), dict(kv_budget_gib=float("inf")),
                                    dict(gpu_mem_gib=1e300, weights_gib=10), dict(gpu_mem_gib=80, weights_gib=1e300)])
def test_memory_beyond_a_pebibyte_is_refused(kwargs):
    """1e300 GiB once overflowed a float into a traceback; sizes no device has are typos."""
    with pytest.raises(ValueError, match="1 PiB"):
        fit_blocks(kv_size(get_model("OPT-13B")), **kwargs)
    assert fit_blocks(kv_size(get_model("OPT-13B")), kv_budget_gib=1 << 20).num_blocks == (1 << 50) // (819_200 * 16)


@pytest.mark.parametrize("field,value", [("num_attention_heads", 0), ("num_attention_heads", -4),
                                         ("hidden_size", "4096"), ("num_hidden_layers", 1.5),
                                         ("num_key_value_heads", 0), ("head_dim", 0), ("n_head", True)])
def test_config_fields_must_be_positive_integers(field, value):
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    if field == "n_head":
        del cfg["num_attention_heads"]
    cfg[field] = value
    with pytest.raises(ValueError, match=f"config field {field} must be a positive integer"):
        spec_from_config(cfg)


def test_whole_float_config_fields_are_integers():
    spec = spec_from_config({"num_hidden_layers": 32.0, "num_attention_heads": 32, "num_key_value_heads": 8.0,
                             "hidden_size": 4096, "torch_dtype": "bfloat16"})
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (32, 8, 128)


def test_util_refuses_a_bool():
    """``util=True`` would silently mean 100 % of the GPU: refused, as every number argument
    refuses bools."""
    with pytest.raises(ValueError, match=r"util must be in \(0, 1\], got True"):
        kv_budget_bytes(80, True, 10)
