"""A Qwen3-Next decoder: gated DeltaNet layers on the state store, full attention on the K/V store.

Qwen3-Next interleaves two kinds of token mixer, listed per layer in the config's
``layer_types``: ``"linear_attention"`` (a gated DeltaNet, :mod:`pagedkv.deltanet`, which
carries a fixed-size state per sequence) and ``"full_attention"``. The step (no cache of its own,
K/V through the paged store, states through the state store's blocks) is
:class:`pagedkv.state_hybrid.PagedStateHybrid`'s; this module holds what is Qwen3-Next's, as
transformers writes it (``modeling_qwen3_next``): RMSNorms that scale by ``1 + weight``;
attention whose ``q_proj`` yields a query and an output gate per head (the output is multiplied
by ``sigmoid(gate)``), RMSNorms on q and k per head, rotary embeddings on the first
``partial_rotary_factor`` of each head's dims; the DeltaNet mixer; a dense SwiGLU MLP or the
sparse mixture of experts with a shared expert (``num_experts``, ``num_experts_per_tok``,
``mlp_only_layers``, ``decoder_sparse_step``).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .deltanet import DeltaNetDims, gated_deltanet
from .model import _cfg
from .state_hybrid import FULL, LINEAR, HybridDims, PagedStateHybrid, numpy_weight, silu

__all__ = ["PagedQwen3Next", "fused_experts", "moe_layers", "qwen3_next_dims"]


def qwen3_next_dims(config: Any) -> HybridDims:
    """The dims of a ``Qwen3NextConfig`` (or a dict with its keys).

    Worked example, the test model: 4 layers ``(linear, linear, full, linear)``, hidden 64,
    attention 4 heads of 16 dims on 2 KV heads with rotary on the first 4 dims of each head
    (``partial_rotary_factor`` 0.25), DeltaNet 2 key heads and 4 value heads of 8 dims with a
    convolution of width 4, vocab 256.
    """
    if isinstance(config, HybridDims):
        return config
    num_layers = int(_cfg(config, "num_hidden_layers"))
    types = _cfg(config, "layer_types")
    if types is None:  # transformers' default: every fourth layer is full attention
        interval = int(_cfg(config, "full_attention_interval", 4))
        types = [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
    if len(types) != num_layers:
        raise ValueError(f"layer_types must list one type per layer ({num_layers}), got {types!r}")
    if _cfg(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"Qwen3-Next's MLP uses silu, config has {_cfg(config, 'hidden_act')!r}")
    rope = _cfg(config, "rope_parameters") or _cfg(config, "rope_scaling") or {}  # transformers 5.x, 4.x
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"only default RoPE is implemented, config asks for {rope.get('rope_type')!r}")
    heads, hidden = int(_cfg(config, "num_attention_heads")), int(_cfg(config, "hidden_size"))
    head_dim = int(_cfg(config, "head_dim") or hidden // heads)
    factor = rope.get("partial_rotary_factor", _cfg(config, "partial_rotary_factor", 0.25))
    eps = float(_cfg(config, "rms_norm_eps", 1e-6))
    mixer = DeltaNetDims(int(_cfg(config, "linear_num_key_heads")), int(_cfg(config, "linear_num_value_heads")),
                         int(_cfg(config, "linear_key_head_dim")), int(_cfg(config, "linear_value_head_dim")),
                         int(_cfg(config, "linear_conv_kernel_dim")), eps)
    return HybridDims(vocab_size=int(_cfg(config, "vocab_size")), hidden_size=hidden, layer_types=tuple(types),
                      num_heads=heads, num_kv_heads=int(_cfg(config, "num_key_value_heads") or heads),
                      head_dim=head_dim, rotary_dim=int(head_dim * factor), mixer=mixer,
                      rope_theta=float(rope.get("rope_theta", _cfg(config, "rope_theta", 10_000.0))),
                      rms_norm_eps=eps)


def moe_layers(config: Any) -> tuple[int, ...]:
    """The layers whose MLP is Qwen3-Next's sparse mixture of experts (transformers' rule: not in
    ``mlp_only_layers``, ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``).
    Example: 4 experts, ``decoder_sparse_step`` 1, ``mlp_only_layers`` [1]: layers (0, 2, 3)."""
    experts, step = int(_cfg(config, "num_experts", 0) or 0), int(_cfg(config, "decoder_sparse_step", 1) or 1)
    dense = set(_cfg(config, "mlp_only_layers") or ())
    return tuple(i for i in range(int(_cfg(config, "num_hidden_layers")))
                 if experts > 0 and i not in dense and (i + 1) % step == 0)


def fused_experts(state_dict: Any, layers: Any) -> dict:
    """The state dict with each listed layer's experts in transformers 5.x's fused layout.

    transformers 4.x keeps each expert's projections apart (``mlp.experts.{e}.gate_proj.weight``
    ``[I, H]``, ``up_proj``, ``down_proj`` ``[H, I]``); 5.x stacks them as
    ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows first) and ``mlp.experts.down_proj``
    ``[E, H, I]``. A state dict already fused, or without experts, comes back as it was.
    """
    sd = dict(state_dict)
    for i in layers:
        p = f"model.layers.{i}.mlp.experts."
        if p + "gate_up_proj" in sd or p + "0.gate_proj.weight" not in sd:
            continue
        n = sum(1 for k in sd if k.startswith(p) and k.endswith(".gate_proj.weight"))
        part = lambda e, name: numpy_weight(sd.pop(f"{p}{e}.{name}.weight"))  # noqa: E731
        sd[p + "gate_up_proj"] = np.stack([np.concatenate([part(e, "gate_proj"), part(e, "up_proj")]) for e in range(n)])
        sd[p + "down_proj"] = np.stack([part(e, "down_proj") for e in range(n)])
    return sd


class PagedQwen3Next(PagedStateHybrid):
    """Qwen3-Next over a paged K/V store and a state store. ``forward`` is one engine step.

    Build it with :meth:`from_transformers` (a ``Qwen3NextForCausalLM``) or
    :meth:`from_state_dict`; ``new_stores(num_blocks, block_size)`` makes the two stores shaped
    for it (the K/V store holds the attention layers only, the state store the DeltaNet layers).
    With a manager built as ``groups=[FullAttention(), RecurrentState(interval=T)]`` a step passes
    group 0's slots and tables and group 1's ``state_indices``.
    """

    mixer_prefix = "linear_attn."
    norm_offset = 1.0  # Qwen3-Next's RMSNorm scales by 1 + weight (weights initialised to 0)
    architecture = "Qwen3-Next"

    def __init__(self, state_dict: Any, config: Any) -> None:
        self.moe_layers = moe_layers(config)
        self.experts_per_token = int(_cfg(config, "num_experts_per_tok", 1) or 1)
        self.norm_topk_prob = bool(_cfg(config, "norm_topk_prob", True))
        super().__init__(state_dict, config)

    @classmethod
    def dims_from_config(cls, config: Any) -> HybridDims:
        return qwen3_next_dims(config)

    def _load(self, sd: Any) -> dict:
        return super()._load(fused_experts(sd, self.moe_layers))

    def _mlp_weights(self, layer: int) -> list[str]:
        if layer not in self.moe_layers:
            return super()._mlp_weights(layer)
        return ["gate.weight", "experts.gate_up_proj", "experts.down_proj", "shared_expert_gate.weight"] \
            + [f"shared_expert.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]

    def _mlp(self, layer: int, p: str, x: np.ndarray) -> np.ndarray:
        """The dense MLP, or ``Qwen3NextSparseMoeBlock``: a softmax router picks the top
        ``experts_per_token`` experts per token (their weights renormalised to sum to 1 when
        ``norm_topk_prob``), each a SwiGLU of ``gate_up_proj`` and ``down_proj``, plus a shared
        expert scaled by ``sigmoid(shared_expert_gate(x))``."""
        if layer not in self.moe_layers:
            return super()._mlp(layer, p, x)
        logits = x @ self.w[p + "gate.weight"].T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :self.experts_per_token]
        weights = np.take_along_axis(probs, top, -1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdims=True)
        gate_up, down = self.w[p + "experts.gate_up_proj"], self.w[p + "experts.down_proj"]
        out = np.zeros_like(x)
        for e in np.unique(top).tolist():
            rows, rank = np.nonzero(top == e)
            gate, up = np.split(x[rows] @ gate_up[e].T, 2, axis=-1)
            out[rows] += (silu(gate) * up) @ down[e].T * weights[rows, rank][:, None]
        shared = super()._mlp(layer, p + "shared_expert.", x)
        with np.errstate(over="ignore"):
            return out + shared / (1.0 + np.exp(-(x @ self.w[p + "shared_expert_gate.weight"].T)))

    def _layer_weights(self, kind: str) -> list[str]:
        if kind == LINEAR:
            return [f"linear_attn.{m}.weight" for m in ("in_proj_qkvz", "in_proj_ba", "conv1d", "norm", "out_proj")] \
                + ["linear_attn.A_log", "linear_attn.dt_bias"]
        return [f"self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]

    def _attention(self, p: str, x: np.ndarray, rope, attend) -> np.ndarray:
        """``Qwen3NextAttention``: per head a query and an output gate from ``q_proj``, RMSNorm on
        q and k per head, partial rotary, attention, ``out * sigmoid(gate)``, ``o_proj``."""
        d = self.dims
        qg = self._linear(x, p + "q_proj").reshape(-1, d.num_heads, 2 * d.head_dim)
        q, gate = qg[..., :d.head_dim], qg[..., d.head_dim:].reshape(len(x), -1)
        q = self._rotate(self._norm(q, p + "q_norm"), rope)
        k = self._linear(x, p + "k_proj").reshape(-1, d.num_kv_heads, d.head_dim)
        k = self._rotate(self._norm(k, p + "k_norm"), rope)
        v = self._linear(x, p + "v_proj").reshape(-1, d.num_kv_heads, d.head_dim)
        out = np.asarray(attend(q, k, v), dtype=np.float64).reshape(len(x), -1)
        with np.errstate(over="ignore"):
            out = out / (1.0 + np.exp(-gate))
        return self._linear(out, p + "o_proj")

    def _mix(self, w: dict, x: np.ndarray, conv: np.ndarray, recurrent: np.ndarray):
        return gated_deltanet(self.dims.mixer, w, x, conv, recurrent)
