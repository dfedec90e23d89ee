"""A Bamba decoder: Mamba2 layers on the state store, full attention on the K/V store.

Bamba (IBM's Mamba2 hybrid; Granite 4.0-H has the same layer structure) lists its attention
layers in ``attn_layer_indices``; every other layer is a Mamba2 mixer (:mod:`pagedkv.mamba2`).
The step is :class:`pagedkv.state_hybrid.PagedStateHybrid`'s; this module holds what is Bamba's,
as transformers writes it (``modeling_bamba``): plain RMSNorms (``weight * x / rms``), Llama
attention with rotary embeddings on the first half of each head's dims (``partial_rotary_factor``
0.5), the Mamba2 mixer, a SwiGLU ``feed_forward`` after ``pre_ff_layernorm``, a final
``final_layernorm``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .mamba2 import Mamba2Dims, mamba2_mixer
from .model import _cfg
from .state_hybrid import LINEAR, HybridDims, PagedStateHybrid

__all__ = ["PagedBamba", "bamba_dims"]


def bamba_dims(config: Any) -> HybridDims:
    """The dims of a ``BambaConfig`` (or a dict with its keys).

    Worked example, the test model: 4 layers with attention at index 2, hidden 64, attention 4
    heads of 16 dims on 2 KV heads, rotary on the first 8 dims of each head; Mamba2 8 heads of 8
    dims (``mamba_expand`` 1), 2 groups, state 8, kernel 4.
    """
    if isinstance(config, HybridDims):
        return config
    num_layers = int(_cfg(config, "num_hidden_layers"))
    attn = set(_cfg(config, "attn_layer_indices") or ())
    types = tuple("full_attention" if i in attn else LINEAR for i in range(num_layers))
    if _cfg(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"Bamba's MLP and convolution use silu, config has {_cfg(config, 'hidden_act')!r}")
    rope = _cfg(config, "rope_parameters") or _cfg(config, "rope_scaling") or {}  # transformers 5.x, 4.x
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"only default RoPE is implemented, config asks for {rope.get('rope_type')!r}")
    heads, hidden = int(_cfg(config, "num_attention_heads")), int(_cfg(config, "hidden_size"))
    head_dim = int(_cfg(config, "head_dim", None) or hidden // heads)
    eps = float(_cfg(config, "rms_norm_eps", 1e-5))
    mamba_heads = int(_cfg(config, "mamba_n_heads"))
    mamba_head_dim = _cfg(config, "mamba_d_head")
    if mamba_head_dim in (None, "auto"):
        mamba_head_dim = int(_cfg(config, "mamba_expand", 2)) * hidden // mamba_heads
    limit = _cfg(config, "time_step_limit") or (0.0, float("inf"))
    mixer = Mamba2Dims(mamba_heads, int(mamba_head_dim), int(_cfg(config, "mamba_n_groups", 1)),
                       int(_cfg(config, "mamba_d_state")), int(_cfg(config, "mamba_d_conv", 4)), eps,
                       (float(limit[0]), float(limit[1])))
    return HybridDims(vocab_size=int(_cfg(config, "vocab_size")), hidden_size=hidden, layer_types=types,
                      num_heads=heads, num_kv_heads=int(_cfg(config, "num_key_value_heads") or heads),
                      head_dim=head_dim, rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 0.5)),
                      mixer=mixer, rope_theta=float(rope.get("rope_theta", _cfg(config, "rope_theta", 10_000.0))),
                      rms_norm_eps=eps)


class PagedBamba(PagedStateHybrid):
    """Bamba over a paged K/V store and a state store. ``forward`` is one engine step (see
    :meth:`pagedkv.state_hybrid.PagedStateHybrid.forward`); build it with
    :meth:`from_transformers` (a ``BambaForCausalLM``) or :meth:`from_state_dict`."""

    mixer_prefix = "mamba."
    mlp_prefix = "feed_forward."
    post_norm = "pre_ff_layernorm"
    final_norm = "model.final_layernorm"
    architecture = "Bamba"

    @classmethod
    def dims_from_config(cls, config: Any) -> HybridDims:
        return bamba_dims(config)

    def _layer_weights(self, kind: str) -> list[str]:
        if kind == LINEAR:
            return [f"mamba.{m}.weight" for m in ("in_proj", "conv1d", "norm", "out_proj")] \
                + ["mamba.A_log", "mamba.dt_bias", "mamba.D"]
        return [f"self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj")]

    def _attention(self, p: str, x: np.ndarray, rope, attend) -> np.ndarray:
        """``BambaAttention``: Llama's, with rotary on the first ``rotary_dim`` dims of each head."""
        d = self.dims
        q = self._rotate(self._linear(x, p + "q_proj").reshape(-1, d.num_heads, d.head_dim), rope)
        k = self._rotate(self._linear(x, p + "k_proj").reshape(-1, d.num_kv_heads, d.head_dim), rope)
        v = self._linear(x, p + "v_proj").reshape(-1, d.num_kv_heads, d.head_dim)
        out = np.asarray(attend(q, k, v), dtype=np.float64).reshape(len(x), -1)
        return self._linear(out, p + "o_proj")

    def _mix(self, w: dict, x: np.ndarray, conv: np.ndarray, recurrent: np.ndarray):
        return mamba2_mixer(self.dims.mixer, w, x, conv, recurrent)
