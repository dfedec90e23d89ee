"""A Llama-architecture decoder whose every key and value lives in the paged :class:`KVStore`.

This is the end-to-end proof that block tables are right: the decoder has no cache of its own.
Each step writes the new tokens' K/V at the slots the allocator returned and attends through the
block tables, so a wrong slot, a missed copy or a stale block shows up as wrong logits, which the
oracle tests compare against Hugging Face transformers' ``LlamaForCausalLM``.

The architecture is Llama's: RMSNorm before attention and MLP, rotary position embeddings (the
"rotate half" convention, base ``rope_theta``), grouped-query attention, a SwiGLU MLP
(``down(silu(gate(x)) * up(x))``), a final RMSNorm and the LM head (tied to the embedding when the
state dict has no ``lm_head.weight``). Weights load from a transformers state dict and config, so
any Llama checkpoint with default RoPE runs unchanged.

torch is required here (this is the model layer); ``import pagedkv`` never imports this module.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:  # pragma: no cover - exercised only where torch is absent
    raise ImportError("pagedkv.model needs torch (pip install 'pagedkv[model]')") from e

from .store import KVStore

__all__ = ["LlamaDims", "PagedLlama"]


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


@dataclass(frozen=True)
class LlamaDims:
    """The shape numbers of a Llama model, read from a transformers config (object or dict).

    Worked example, the test model: hidden 64, 4 heads of 16 dims, 2 KV heads (each KV head
    serves a group of 2 query heads), 2 layers, vocab 256, rope_theta 10,000.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float

    @classmethod
    def from_config(cls, config: Any) -> "LlamaDims":
        """Read a ``LlamaConfig`` (transformers 4.x ``rope_theta`` or 5.x ``rope_parameters``)."""
        heads = _cfg(config, "num_attention_heads")
        hidden = _cfg(config, "hidden_size")
        if not heads or not hidden:
            raise ValueError("config needs hidden_size and num_attention_heads")
        rope = _cfg(config, "rope_parameters") or _cfg(config, "rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"only default RoPE is implemented, config asks for {rope_type!r}")
        if _cfg(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"Llama's MLP uses silu, config has {_cfg(config, 'hidden_act')!r}")
        theta = rope.get("rope_theta", _cfg(config, "rope_theta", 10_000.0))
        dims = cls(
            vocab_size=int(_cfg(config, "vocab_size")),
            hidden_size=int(hidden),
            intermediate_size=int(_cfg(config, "intermediate_size")),
            num_layers=int(_cfg(config, "num_hidden_layers")),
            num_heads=int(heads),
            num_kv_heads=int(_cfg(config, "num_key_value_heads") or heads),
            head_dim=int(_cfg(config, "head_dim") or hidden // heads),
            rope_theta=float(theta),
            rms_norm_eps=float(_cfg(config, "rms_norm_eps", 1e-6)),
        )
        if dims.num_heads % dims.num_kv_heads:
            raise ValueError(f"{dims.num_heads} heads do not split into {dims.num_kv_heads} KV groups")
        return dims


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32 as transformers does."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PagedLlama:
    """Llama decoder over a paged KV store. ``forward`` is one engine step for a ragged batch.

    Build it with :meth:`from_transformers` (a ``LlamaForCausalLM``) or :meth:`from_state_dict`.
    ``new_store(num_blocks, block_size)`` makes a store shaped for it: the test model with 64
    blocks of 16 tokens takes ``64 * 2*2*16*2*16*4 = 524,288`` bytes.
    """

    def __init__(self, state_dict: Mapping[str, torch.Tensor], config: Any,
                 dtype: torch.dtype = torch.float32) -> None:
        self.dims = LlamaDims.from_config(config)
        self.dtype = dtype
        self.w = self._load(state_dict)
        d = self.dims
        exponent = torch.arange(0, d.head_dim, 2, dtype=torch.float) / d.head_dim
        self.inv_freq = 1.0 / (d.rope_theta ** exponent)  # same expression as transformers

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor], config: Any,
                        dtype: torch.dtype = torch.float32) -> "PagedLlama":
        return cls(state_dict, config, dtype)

    @classmethod
    def from_transformers(cls, hf_model: Any, dtype: torch.dtype = torch.float32) -> "PagedLlama":
        """Copy the weights of a transformers ``LlamaForCausalLM`` (or any model with its names)."""
        return cls(hf_model.state_dict(), hf_model.config, dtype)

    def _load(self, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Pick and shape-check every weight the decoder needs; the LM head falls back to the tied embedding."""
        d = self.dims
        q_out, kv_out = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        want = {"model.embed_tokens.weight": (d.vocab_size, d.hidden_size),
                "model.norm.weight": (d.hidden_size,)}
        for i in range(d.num_layers):
            p = f"model.layers.{i}."
            want.update({
                p + "self_attn.q_proj.weight": (q_out, d.hidden_size),
                p + "self_attn.k_proj.weight": (kv_out, d.hidden_size),
                p + "self_attn.v_proj.weight": (kv_out, d.hidden_size),
                p + "self_attn.o_proj.weight": (d.hidden_size, q_out),
                p + "mlp.gate_proj.weight": (d.intermediate_size, d.hidden_size),
                p + "mlp.up_proj.weight": (d.intermediate_size, d.hidden_size),
                p + "mlp.down_proj.weight": (d.hidden_size, d.intermediate_size),
                p + "input_layernorm.weight": (d.hidden_size,),
                p + "post_attention_layernorm.weight": (d.hidden_size,),
            })
        missing = [k for k in want if k not in sd]
        if missing:
            raise ValueError(f"state dict lacks {len(missing)} Llama weights, e.g. {missing[:3]}")
        bad = [k for k, s in want.items() if tuple(sd[k].shape) != s]
        if bad:
            raise ValueError(f"weight shapes disagree with the config: {bad[0]} is "
                             f"{tuple(sd[bad[0]].shape)}, expected {want[bad[0]]}")
        w = {k: sd[k].detach().to(self.dtype).clone() for k in want}
        # optional biases (attention_bias / mlp_bias configs)
        for k in sd:
            if k.endswith(".bias") and k.replace(".bias", ".weight") in want:
                w[k] = sd[k].detach().to(self.dtype).clone()
        head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
        w["lm_head.weight"] = head.detach().to(self.dtype).clone()
        return w

    # ---- the store this model writes into

    def new_store(self, num_blocks: int, block_size: int, backend: str = "torch") -> KVStore:
        """A KV store with this model's layers, KV heads and head dim, in the model's dtype."""
        d = self.dims
        return KVStore(d.num_layers, num_blocks, block_size, d.num_kv_heads, d.head_dim,
                       dtype=str(self.dtype).replace("torch.", ""), backend=backend)

    def _check_store(self, store: KVStore) -> None:
        d = self.dims
        if (store.num_layers, store.num_kv_heads, store.head_dim) != (d.num_layers, d.num_kv_heads, d.head_dim):
            raise ValueError(f"store is (layers {store.num_layers}, kv heads {store.num_kv_heads}, dim "
                             f"{store.head_dim}), the model needs ({d.num_layers}, {d.num_kv_heads}, {d.head_dim})")

    # ---- one step

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]

    def _attention(self, i: int, x: torch.Tensor, rope, store: KVStore, slots, tables, seq_lens, qlens):
        d, p = self.dims, f"model.layers.{i}.self_attn."
        cos, sin = rope
        q = self._linear(x, p + "q_proj").view(-1, d.num_heads, d.head_dim)
        k = self._linear(x, p + "k_proj").view(-1, d.num_kv_heads, d.head_dim)
        v = self._linear(x, p + "v_proj").view(-1, d.num_kv_heads, d.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        store.write(i, slots, k, v)  # the new tokens' K/V go to the allocator's slots first...
        out = store.paged_attention(i, q, tables, seq_lens, qlens)  # ...then attention reads it all back
        out = torch.as_tensor(out, dtype=self.dtype).reshape(-1, d.num_heads * d.head_dim)
        return self._linear(out, p + "o_proj")

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.mlp."
        return self._linear(F.silu(self._linear(x, p + "gate_proj")) * self._linear(x, p + "up_proj"), p + "down_proj")

    @torch.inference_mode()
    def forward(self, store: KVStore, token_ids: Any, slots: Any, block_tables: Any,
                seq_lens: Any, query_lens: Any = None) -> torch.Tensor:
        """Run a ragged batch of new tokens; return their logits, ``[len(token_ids), vocab]`` float32.

        Sequence ``i`` contributes its last ``query_lens[i]`` tokens (default 1: a decode step) out of
        ``seq_lens[i]``, concatenated in ``token_ids``; token ``j`` of sequence ``i`` is at position
        ``seq_lens[i] - query_lens[i] + j`` and its K/V goes to ``slots[t]``. ``block_tables`` is
        ``[batch, max_blocks]`` (``KVCacheManager.block_tables``). Prefill after a prefix hit of
        ``h`` tokens passes the prompt's last ``len - h`` tokens with ``query_lens = len - h``.
        """
        self._check_store(store)
        ids, lens, qlens = self._check_step(token_ids, slots, seq_lens, query_lens)
        store.check_batch(slots, block_tables, lens)  # fail before the first layer writes anything
        positions = torch.from_numpy(np.repeat(lens - qlens, qlens) + _ranks(qlens))
        rope = self._rope(positions)
        d, x = self.dims, self.w["model.embed_tokens.weight"][torch.from_numpy(ids)]
        for i in range(d.num_layers):
            p = f"model.layers.{i}."
            h = _rms_norm(x, self.w[p + "input_layernorm.weight"], d.rms_norm_eps)
            x = x + self._attention(i, h, rope, store, slots, block_tables, lens, qlens)
            h = _rms_norm(x, self.w[p + "post_attention_layernorm.weight"], d.rms_norm_eps)
            x = x + self._mlp(i, h)
        x = _rms_norm(x, self.w["model.norm.weight"], d.rms_norm_eps)
        return F.linear(x, self.w["lm_head.weight"]).to(torch.float32)

    __call__ = forward

    def _check_step(self, token_ids, slots, seq_lens, query_lens):
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        qlens = np.ones_like(lens) if query_lens is None else np.asarray(query_lens, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.dims.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.dims.vocab_size})")
        if qlens.shape != lens.shape or int(qlens.sum()) != ids.size:
            raise ValueError(f"{ids.size} tokens but query_lens {qlens.tolist()} for {lens.size} sequences")
        if (qlens < 1).any() or (qlens > lens).any():
            raise ValueError("each sequence needs 1 <= query_len <= seq_len")
        if len(slots) != ids.size:
            raise ValueError(f"{ids.size} tokens need {ids.size} slots, got {len(slots)}")
        return ids, lens, qlens


def _ranks(qlens: np.ndarray) -> np.ndarray:
    """``[0..q0-1, 0..q1-1, ...]``: each token's index within its sequence's new tokens."""
    return np.arange(int(qlens.sum())) - np.repeat(np.cumsum(qlens) - qlens, qlens)
