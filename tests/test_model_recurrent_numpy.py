"""The recurrent layers' maths without transformers: a chunk run from the state another chunk left
gives what one run over both gives (the property the state store's blocks carry from step to
step), and bad dims or configs are refused with a ValueError naming what is wrong."""
from __future__ import annotations

import numpy as np
import pytest

from pagedkv.bamba import bamba_dims
from pagedkv.deltanet import DeltaNetDims, causal_conv1d, gated_deltanet
from pagedkv.mamba2 import Mamba2Dims, mamba2_mixer
from pagedkv.qwen3_next import moe_layers, qwen3_next_dims
from pagedkv.state_hybrid import HybridDims

HIDDEN = 16


def deltanet_weights(d: DeltaNetDims, rng) -> dict:
    r = d.num_v_heads // d.num_k_heads
    return {"in_proj_qkvz.weight": rng.normal(0, 0.3, (2 * d.key_dim + 2 * d.value_dim, HIDDEN)),
            "in_proj_ba.weight": rng.normal(0, 0.3, (2 * d.num_k_heads * r, HIDDEN)),
            "conv1d.weight": rng.normal(0, 0.5, (d.conv_dim, 1, d.conv_kernel)),
            "A_log": np.log(rng.uniform(0.05, 0.5, d.num_v_heads)), "dt_bias": rng.normal(0, 0.5, d.num_v_heads),
            "norm.weight": 1 + rng.normal(0, 0.1, d.v_head_dim),
            "out_proj.weight": rng.normal(0, 0.3, (HIDDEN, d.value_dim))}


def mamba2_weights(d: Mamba2Dims, rng) -> dict:
    inner = d.intermediate_size
    return {"in_proj.weight": rng.normal(0, 0.3, (inner + d.conv_dim + d.num_heads, HIDDEN)),
            "conv1d.weight": rng.normal(0, 0.5, (d.conv_dim, 1, d.conv_kernel)),
            "conv1d.bias": rng.normal(0, 0.1, d.conv_dim),
            "A_log": np.log(rng.uniform(0.05, 0.5, d.num_heads)), "dt_bias": rng.normal(0, 0.5, d.num_heads),
            "D": rng.normal(1, 0.2, d.num_heads), "norm.weight": 1 + rng.normal(0, 0.1, inner),
            "out_proj.weight": rng.normal(0, 0.3, (HIDDEN, inner))}


LAYERS = {
    "deltanet": (DeltaNetDims(2, 4, 8, 8, 4), deltanet_weights, gated_deltanet),
    "mamba2": (Mamba2Dims(8, 4, 2, 8, 4), mamba2_weights, mamba2_mixer),
}


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("cut", [1, 2, 7, 11])
def test_a_chunk_from_the_state_of_the_previous_equals_one_run(kind, cut):
    """12 positions in one call, or split at ``cut`` (1 and 2 leave a conv state partly from
    position 0's zeros; 11 is a decode step): the same outputs and final states."""
    d, make, layer = LAYERS[kind]
    rng = np.random.default_rng(0)
    w, x = make(d, rng), rng.normal(size=(12, HIDDEN))
    zeros = np.zeros(d.conv_shape), np.zeros(d.recurrent_shape)
    whole, conv, rec = layer(d, w, x, *zeros)
    first, conv1, rec1 = layer(d, w, x[:cut], *zeros)
    second, conv2, rec2 = layer(d, w, x[cut:], conv1, rec1)
    np.testing.assert_allclose(np.concatenate([first, second]), whole, atol=1e-12, rtol=0)
    np.testing.assert_allclose(conv2, conv, atol=1e-12, rtol=0)
    np.testing.assert_allclose(rec2, rec, atol=1e-12, rtol=0)
    assert conv.shape == d.conv_shape and rec.shape == d.recurrent_shape
    stale, _, _ = layer(d, w, x[cut:], *zeros)  # the state matters: a zero state is another result
    assert np.abs(stale - whole[cut:]).max() > 1e-3


def test_the_conv_state_holds_the_last_inputs():
    """Kernel 3, one channel, weights (1, 10, 100): output t = x[t-2] + 10 x[t-1] + 100 x[t]
    (zeros before position 0) before SiLU; the state keeps the last 2 inputs, oldest first."""
    x = np.array([[1.0], [2.0], [3.0]])
    out, state = causal_conv1d(x, np.array([[1.0, 10.0, 100.0]]), np.zeros((1, 2)))
    pre = np.array([100.0, 210.0, 321.0])
    np.testing.assert_allclose(out[:, 0], pre / (1 + np.exp(-pre)))
    assert state.tolist() == [[2.0, 3.0]]
    out, state = causal_conv1d(np.array([[4.0]]), np.array([[1.0, 10.0, 100.0]]), state, bias=np.array([-432.0]))
    assert out.tolist() == [[0.0]] and state.tolist() == [[3.0, 4.0]]  # 2 + 30 + 400 - 432 = 0


QWEN = dict(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], vocab_size=256,
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, rope_parameters={"rope_theta": 500.0, "partial_rotary_factor": 0.25})


def test_configs_map_to_dims():
    d = qwen3_next_dims(QWEN)
    assert (d.attention_layers, d.linear_layers, d.rotary_dim, d.mixer.conv_shape) == ((3,), (0, 1, 2), 4, (64, 3))
    default = qwen3_next_dims({**QWEN, "num_hidden_layers": 8, "layer_types": None})  # every fourth is full
    assert default.attention_layers == (3, 7)
    assert moe_layers({**QWEN, "num_experts": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}) == (1,)
    b = bamba_dims(dict(num_hidden_layers=3, attn_layer_indices=[1], vocab_size=256, hidden_size=64,
                        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head="auto",
                        mamba_expand=2, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4))
    assert (b.layer_types[1], b.rotary_dim, b.mixer.recurrent_shape) == ("full_attention", 8, (8, 16, 16))


@pytest.mark.parametrize("bad, match", [
    (dict(layer_types=["linear_attention"] * 3), "one type per layer"),
    (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "layer_types must list"),
    (dict(layer_types=["linear_attention"] * 4), "needs both"),
    (dict(hidden_act="gelu"), "silu"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "RoPE"),
    (dict(linear_num_value_heads=3), "do not split"),
    (dict(linear_conv_kernel_dim=1), "conv_kernel"),
    (dict(num_key_value_heads=3), "KV groups"),
])
def test_bad_configs_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        qwen3_next_dims({**QWEN, **bad})


def test_bad_dims_are_refused():
    for make in (lambda: Mamba2Dims(6, 4, 4, 8, 4), lambda: Mamba2Dims(8, 0, 2, 8, 4),
                 lambda: DeltaNetDims(2, 4, 8, True, 4)):
        with pytest.raises(ValueError):
            make()
    with pytest.raises(ValueError, match="rotary"):
        HybridDims(256, 64, ("linear_attention", "full_attention"), 4, 2, 16, 3, DeltaNetDims(2, 4, 8, 8, 4))
