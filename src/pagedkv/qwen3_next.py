"""A Qwen3-Next decoder: gated DeltaNet layers on the state store, full attention on the K/V store.

Qwen3-Next interleaves two kinds of token mixer, listed per layer in the config's
``layer_types``: ``"linear_attention"`` (a gated DeltaNet, :mod:`pagedkv.deltanet`, which
carries a fixed-size state per sequence) and ``"full_attention"``. This decoder keeps no cache of
its own: the attention layers write and read K/V through the paged :class:`~pagedkv.store.KVStore`
(slots and block tables of the manager's attention group), the DeltaNet layers read each
sequence's initial state from the :class:`~pagedkv.state_store.StateStore` block the caller names
and write the final state to another (``state_indices``' read and write ids of the manager's
state group). A wrong block id, a missed copy or a stale checkpoint shows up as wrong logits.

The rest is Qwen3-Next as transformers writes it (``modeling_qwen3_next``): RMSNorms that scale by
``1 + weight``; attention whose ``q_proj`` yields a query and an output gate per head (the output
is multiplied by ``sigmoid(gate)``), RMSNorms on q and k per head, rotary embeddings on the first
``partial_rotary_factor`` of each head's dims; a dense SwiGLU MLP (configs with ``num_experts`` 0,
or every layer in ``mlp_only_layers``). numpy only; every activation is computed in float64, K/V
and states are stored in the stores' dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .deltanet import DeltaNetDims, gated_deltanet
from .kv_specs import FullAttention
from .model import _cfg, _is_torch, _ranks
from .state_store import StateStore
from .store import KVStore

__all__ = ["Qwen3NextDims", "PagedQwen3Next"]

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class Qwen3NextDims:
    """The shape numbers of a Qwen3-Next model (read from a transformers ``Qwen3NextConfig``).

    Worked example, the test model: 4 layers ``(linear, linear, full, linear)``, hidden 64,
    attention 4 heads of 16 dims on 2 KV heads with rotary on the first 4 dims of each head
    (``partial_rotary_factor`` 0.25), DeltaNet 2 key heads and 4 value heads of 8 dims with a
    convolution of width 4, MLP 128, vocab 256. ``attention_layers == (2,)`` (the K/V store's
    layer 0 is model layer 2) and ``linear_layers == (0, 1, 3)``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    deltanet: DeltaNetDims
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        bad = [t for t in self.layer_types if t not in (LINEAR, FULL)]
        if bad or not self.layer_types:
            raise ValueError(f"layer_types must list {LINEAR!r} or {FULL!r} per layer, got {list(self.layer_types)}")
        if FULL not in self.layer_types or LINEAR not in self.layer_types:
            raise ValueError("a Qwen3-Next decoder needs both full_attention and linear_attention layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads do not split into {self.num_kv_heads} KV groups")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"the rotary dims must be even and in (0, head_dim], got {self.rotary_dim}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The model layers that are full attention, in order: K/V store layer j is model layer
        ``attention_layers[j]``."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The DeltaNet layers, in order: state store layer j is model layer ``linear_layers[j]``."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @classmethod
    def from_config(cls, config: Any) -> "Qwen3NextDims":
        """Read a ``Qwen3NextConfig`` (or a dict with its keys)."""
        if isinstance(config, Qwen3NextDims):
            return config
        num_layers = int(_cfg(config, "num_hidden_layers"))
        types = _cfg(config, "layer_types")
        if types is None:  # transformers' default: every fourth layer is full attention
            interval = int(_cfg(config, "full_attention_interval", 4))
            types = [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
        if len(types) != num_layers:
            raise ValueError(f"layer_types must list one type per layer ({num_layers}), got {types!r}")
        experts, dense = _cfg(config, "num_experts", 0) or 0, set(_cfg(config, "mlp_only_layers") or ())
        if experts and not dense.issuperset(range(num_layers)):
            raise ValueError("only dense MLPs are implemented: use num_experts=0 or list every layer in mlp_only_layers")
        if _cfg(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"Qwen3-Next's MLP uses silu, config has {_cfg(config, 'hidden_act')!r}")
        rope = _cfg(config, "rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"only default RoPE is implemented, config asks for {rope.get('rope_type')!r}")
        heads, hidden = int(_cfg(config, "num_attention_heads")), int(_cfg(config, "hidden_size"))
        head_dim = int(_cfg(config, "head_dim") or hidden // heads)
        factor = rope.get("partial_rotary_factor", _cfg(config, "partial_rotary_factor", 0.25))
        eps = float(_cfg(config, "rms_norm_eps", 1e-6))
        return cls(
            vocab_size=int(_cfg(config, "vocab_size")), hidden_size=hidden,
            intermediate_size=int(_cfg(config, "intermediate_size")), layer_types=tuple(types),
            num_heads=heads, num_kv_heads=int(_cfg(config, "num_key_value_heads") or heads),
            head_dim=head_dim, rotary_dim=int(head_dim * factor),
            deltanet=DeltaNetDims(int(_cfg(config, "linear_num_key_heads")),
                                  int(_cfg(config, "linear_num_value_heads")),
                                  int(_cfg(config, "linear_key_head_dim")),
                                  int(_cfg(config, "linear_value_head_dim")),
                                  int(_cfg(config, "linear_conv_kernel_dim")), eps),
            rope_theta=float(rope.get("rope_theta", _cfg(config, "rope_theta", 10_000.0))),
            rms_norm_eps=eps)


def _numpy_weight(value: Any) -> np.ndarray:
    if _is_torch(value):
        value = value.detach().cpu().float().numpy()
    return np.array(value, dtype=np.float32)


class PagedQwen3Next:
    """Qwen3-Next over a paged K/V store and a state store. ``forward`` is one engine step.

    Build it with :meth:`from_transformers` (a ``Qwen3NextForCausalLM``) or
    :meth:`from_state_dict`; ``new_stores(num_blocks, block_size)`` makes the two stores shaped
    for it (the K/V store holds the attention layers only, the state store the DeltaNet layers).
    With a manager built as ``groups=[FullAttention(), RecurrentState(interval=T)]`` a step passes
    group 0's slots and tables and group 1's ``state_indices``.
    """

    def __init__(self, state_dict: Mapping[str, Any], config: Any) -> None:
        self.dims = Qwen3NextDims.from_config(config)
        self.w = self._load(state_dict)
        d = self.dims
        exponent = np.arange(0, d.rotary_dim, 2, dtype=np.float32) / np.float32(d.rotary_dim)
        self._inv_freq = (np.float32(1.0) / (np.float32(d.rope_theta) ** exponent)).astype(np.float32)

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, Any], config: Any) -> "PagedQwen3Next":
        return cls(state_dict, config)

    @classmethod
    def from_transformers(cls, hf_model: Any) -> "PagedQwen3Next":
        """Copy the weights of a transformers ``Qwen3NextForCausalLM``."""
        return cls(hf_model.state_dict(), hf_model.config)

    def _load(self, sd: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Every weight by transformers' name, as float32 numpy; the LM head falls back to the
        embedding (tied) when absent."""
        want = {"model.embed_tokens.weight", "model.norm.weight"}
        for i, kind in enumerate(self.dims.layer_types):
            p = f"model.layers.{i}."
            mixer = ("linear_attn.", ("in_proj_qkvz", "in_proj_ba", "conv1d", "norm", "out_proj")) if kind == LINEAR \
                else ("self_attn.", ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"))
            want |= {p + mixer[0] + m + ".weight" for m in mixer[1]}
            if kind == LINEAR:
                want |= {p + "linear_attn.A_log", p + "linear_attn.dt_bias"}
            want |= {p + n + ".weight" for n in ("input_layernorm", "post_attention_layernorm",
                                                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
        missing = sorted(want - set(sd))
        if missing:
            raise ValueError(f"state dict lacks {len(missing)} Qwen3-Next weights, e.g. {missing[:3]}")
        w = {k: _numpy_weight(sd[k]) for k in want}
        for k in sd:  # attention_bias configs
            if k.endswith(".bias") and k.replace(".bias", ".weight") in want:
                w[k] = _numpy_weight(sd[k])
        w["lm_head.weight"] = _numpy_weight(sd.get("lm_head.weight", sd["model.embed_tokens.weight"]))
        d = self.dims
        shape = w[f"model.layers.{d.linear_layers[0]}.linear_attn.conv1d.weight"].shape
        if shape != (d.deltanet.conv_dim, 1, d.deltanet.conv_kernel):
            raise ValueError(f"conv1d weights are {shape}, the config needs "
                             f"{(d.deltanet.conv_dim, 1, d.deltanet.conv_kernel)}")
        return w

    # ---- the stores this model writes into

    @property
    def kv_groups(self) -> tuple:
        """The attention groups: ``(FullAttention(),)``. The state group comes after them."""
        return (FullAttention(),)

    def new_stores(self, num_blocks: int, block_size: int, *, host_blocks: int = 0,
                   state_group: int = 1) -> tuple[KVStore, StateStore]:
        """A K/V store for the attention layers and a state store for the DeltaNet layers, both
        indexed by the manager's ``num_blocks`` block ids (one pool: an id serves one group at
        a time), float32; ``state_group`` is the manager's index of the state group."""
        d, dn = self.dims, self.dims.deltanet
        kv = KVStore(len(d.attention_layers), num_blocks, block_size, d.num_kv_heads, d.head_dim,
                     host_blocks=host_blocks)
        states = StateStore(len(d.linear_layers), num_blocks, conv_shape=dn.conv_shape,
                            recurrent_shape=dn.recurrent_shape, host_blocks=host_blocks,
                            group=state_group)
        return kv, states

    def _check_stores(self, kv: KVStore, states: StateStore) -> None:
        d, dn = self.dims, self.dims.deltanet
        if not isinstance(kv, KVStore) or not isinstance(states, StateStore):
            raise ValueError("forward takes a KVStore and a StateStore (new_stores makes both)")
        have = (kv.num_layers, kv.num_kv_heads, kv.head_dim)
        need = (len(d.attention_layers), d.num_kv_heads, d.head_dim)
        if have != need:
            raise ValueError(f"K/V store has (layers, kv heads, head dim) {have}, the model needs {need}")
        need = (len(d.linear_layers), dn.conv_shape, dn.recurrent_shape)
        if (states.num_layers, states.conv_shape, states.recurrent_shape) != need:
            raise ValueError(f"state store has (layers, conv, recurrent) shapes "
                             f"{(states.num_layers, states.conv_shape, states.recurrent_shape)}, "
                             f"the model needs {need}")

    # ---- the entry point

    def forward(self, kv_store: KVStore, state_store: StateStore, token_ids: Any, slots: Any,
                block_tables: Any, seq_lens: Any, query_lens: Any = None, *,
                state_read: Any, state_write: Any) -> np.ndarray:
        """Run a ragged batch of new tokens; return their logits, ``[len(token_ids), vocab]`` float32.

        Tokens, ``slots``, ``block_tables`` ``[batch, blocks]``, ``seq_lens`` and ``query_lens``
        are :meth:`pagedkv.model.PagedLlama.forward`'s, of the attention group: sequence i's
        last ``query_lens[i]`` tokens (default 1) of ``seq_lens[i]``. ``state_read[i]`` is the
        state block sequence i starts from (the state after position ``seq_lens[i] -
        query_lens[i] - 1``; -1 exactly when that is position 0's start) and ``state_write[i]``
        the block its state after its last token goes to (distinct per sequence; it may equal
        ``state_read[i]``: an update in place). In every DeltaNet layer the whole batch's initial
        states are read before any final state is written. A bad step raises ``ValueError``
        before anything is written. Example: a prompt of 20 in chunks of 8 and 12 passes
        ``(-1, s0)`` then ``(s0, s1)``; a decode step after it ``(s1, s1)``.
        """
        self._check_stores(kv_store, state_store)
        ids, lens, qlens, reads, writes = self._check_step(token_ids, slots, seq_lens, query_lens,
                                                           state_read, state_write, state_store)
        kv_store.check_batch(slots, block_tables, lens, qlens)
        positions = np.repeat(lens - qlens, qlens) + _ranks(qlens)
        starts = np.cumsum(qlens) - qlens
        x = self.w["model.embed_tokens.weight"][ids].astype(np.float64)
        rope = self._rope(positions)
        d = self.dims
        for i, kind in enumerate(d.layer_types):
            p = f"model.layers.{i}."
            h = self._norm(x, p + "input_layernorm")
            if kind == FULL:
                layer = d.attention_layers.index(i)

                def paged(q, k, v, layer=layer):
                    kv_store.write(layer, slots, k, v)  # the batch's K/V first, then attention reads
                    return kv_store.paged_attention(layer, q.astype(np.float32), block_tables, lens, qlens)

                x = x + self._attention(p + "self_attn.", h, rope, paged)
            else:
                x = x + self._deltanet(d.linear_layers.index(i), p + "linear_attn.", h, state_store,
                                       reads, writes, starts, qlens)
            x = x + self._mlp(p + "mlp.", self._norm(x, p + "post_attention_layernorm"))
        x = self._norm(x, "model.norm")
        return (x @ self.w["lm_head.weight"].T).astype(np.float32)

    __call__ = forward

    # ---- the layers

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        """Qwen3-Next's RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``."""
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.dims.rms_norm_eps) * (1.0 + self.w[name + ".weight"])

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        y = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return y if bias is None else y + bias

    def _rope(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin per token for the rotary dims, ``[tokens, 1, rotary_dim]``, computed in
        float32 as transformers does."""
        freqs = positions.astype(np.float32)[:, None] * self._inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], -1)
        return np.cos(emb)[:, None].astype(np.float64), np.sin(emb)[:, None].astype(np.float64)

    def _rotate(self, x: np.ndarray, rope: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """Rotate-half on the first ``rotary_dim`` dims of each head; the rest pass through."""
        cos, sin = rope
        rd = self.dims.rotary_dim
        rot, rest = x[..., :rd], x[..., rd:]
        half = rd // 2
        rotated = np.concatenate([-rot[..., half:], rot[..., :half]], -1)
        return np.concatenate([rot * cos + rotated * sin, rest], -1)

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

    def _deltanet(self, layer: int, p: str, x: np.ndarray, states: StateStore, reads: np.ndarray,
                  writes: np.ndarray, starts: np.ndarray, qlens: np.ndarray) -> np.ndarray:
        """One DeltaNet layer for the batch: every sequence's initial state read first, each
        sequence's chunk run from it, every final state written last."""
        w = {k[len(p):]: v for k, v in self.w.items() if k.startswith(p)}
        conv, rec = states.read(layer, reads)
        out = np.empty_like(x)
        new_conv, new_rec = np.empty_like(conv), np.empty_like(rec)
        for s, (start, n) in enumerate(zip(starts.tolist(), qlens.tolist())):
            out[start:start + n], new_conv[s], new_rec[s] = gated_deltanet(
                self.dims.deltanet, w, x[start:start + n], conv[s].astype(np.float64), rec[s])
        states.write(layer, writes, new_conv, new_rec)
        return out

    def _mlp(self, p: str, x: np.ndarray) -> np.ndarray:
        gate = self._linear(x, p + "gate_proj")
        with np.errstate(over="ignore"):
            gate = gate / (1.0 + np.exp(-gate))
        return self._linear(gate * self._linear(x, p + "up_proj"), p + "down_proj")

    # ---- argument checks

    def _check_step(self, token_ids, slots, seq_lens, query_lens, state_read, state_write, states):
        ids = np.asarray(token_ids)
        if ids.size and ids.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64).reshape(-1)
        if ids.size == 0 or ids.min() < 0 or ids.max() >= self.dims.vocab_size:
            raise ValueError(f"token ids must be at least one id in [0, {self.dims.vocab_size})")
        lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        qlens = np.ones_like(lens) if query_lens is None else np.asarray(query_lens, dtype=np.int64).reshape(-1)
        if qlens.shape != lens.shape or int(qlens.sum()) != ids.size:
            raise ValueError(f"{ids.size} tokens but query_lens {qlens.tolist()} for {lens.size} sequences")
        if (qlens < 1).any() or (qlens > lens).any():
            raise ValueError("each sequence needs 1 <= query_len <= seq_len")
        if len(slots) != ids.size:
            raise ValueError(f"{ids.size} tokens need {ids.size} slots, got {len(slots)}")
        reads, writes = states.check_reads(state_read), states.check_writes(state_write)
        if reads.shape != lens.shape or writes.shape != lens.shape:
            raise ValueError(f"state_read and state_write need one block per sequence ({lens.size}), "
                             f"got {reads.size} and {writes.size}")
        first = (lens - qlens) == 0
        if (first != (reads < 0)).any():
            i = int(np.nonzero(first != (reads < 0))[0][0])
            raise ValueError(f"sequence {i} starts at position {int(lens[i] - qlens[i])} but state_read is "
                             f"{int(reads[i])}: -1 (a zero state) exactly when a step starts at position 0")
        return ids, lens, qlens, reads, writes
