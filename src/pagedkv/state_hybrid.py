"""The step of a recurrent-state hybrid decoder: attention layers on the K/V store, recurrent
layers (gated DeltaNet, Mamba2) on the state store, and no cache of its own.

This module holds what every such decoder shares: the layer pattern and its two stores
(:class:`HybridDims`, :meth:`PagedStateHybrid.new_stores`), one engine step over a ragged batch
(:meth:`PagedStateHybrid.forward`, with its argument checks), and the parts of the architecture
that Qwen3-Next and Bamba have in common (RMSNorm, partial rotary embeddings, the SwiGLU MLP, the
residual stream). What differs (the token mixers, the attention's details, the weight names) is
a subclass's: :class:`pagedkv.qwen3_next.PagedQwen3Next` and :class:`pagedkv.bamba.PagedBamba`.
numpy only; activations in float64, K/V and states stored in the stores' dtype.

A step: the attention layers write the batch's K/V at the slots of the manager's attention group
and attend through its block tables (as :class:`pagedkv.model.PagedLlama`); each recurrent layer
reads every sequence's initial state from the state block ``state_read[i]``, runs the sequence's
new tokens from it, and writes its final state to ``state_write[i]`` (``state_indices``' ids).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from .kv_specs import FullAttention
from .model import _is_torch, _ranks
from .state_store import StateStore
from .store import KVStore

__all__ = ["HybridDims", "PagedStateHybrid", "LINEAR", "FULL"]

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class HybridDims:
    """The shape numbers a hybrid step needs.

    ``layer_types`` lists ``"linear_attention"`` (a recurrent layer) or ``"full_attention"`` per
    layer; attention has ``num_heads`` heads of ``head_dim`` on ``num_kv_heads`` KV heads with
    rotary embeddings on the first ``rotary_dim`` dims of each head; ``mixer`` is the recurrent
    layer's dims (:class:`pagedkv.deltanet.DeltaNetDims` or :class:`pagedkv.mamba2.Mamba2Dims`),
    which give its state's ``conv_shape`` and ``recurrent_shape``. Example, the Qwen3-Next test
    model: ``(linear, linear, full, linear)``, so ``attention_layers == (2,)`` (the K/V store's
    layer 0 is model layer 2) and ``linear_layers == (0, 1, 3)`` (state store layers 0, 1, 2).
    """

    vocab_size: int
    hidden_size: int
    layer_types: tuple
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    mixer: Any
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        bad = [t for t in self.layer_types if t not in (LINEAR, FULL)]
        if bad or not self.layer_types:
            raise ValueError(f"layer_types must list {LINEAR!r} or {FULL!r} per layer, got {list(self.layer_types)}")
        if FULL not in self.layer_types or LINEAR not in self.layer_types:
            raise ValueError("a hybrid decoder needs both full_attention and linear_attention layers")
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
        """The recurrent layers, in order: state store layer j is model layer ``linear_layers[j]``."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)


def numpy_weight(value: Any) -> np.ndarray:
    """An owned float32 numpy copy of one weight (numpy or torch in)."""
    if _is_torch(value):
        value = value.detach().cpu().float().numpy()
    return np.array(value, dtype=np.float32)


def _float64(x: Any) -> np.ndarray:
    """A state store's array (numpy, or torch on any device) as float64 numpy."""
    if _is_torch(x):
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x << 0: x / inf = -0, correct
        return x / (1.0 + np.exp(-x))


# A recurrent mixer: (weights without the layer prefix, x [tokens, hidden], conv state, recurrent
# state) -> (out [tokens, hidden], final conv state, final recurrent state).
Mixer = Callable[[dict, np.ndarray, np.ndarray, np.ndarray], tuple]


class PagedStateHybrid:
    """One engine step of a recurrent-state hybrid; subclasses give the architecture.

    A subclass sets the weight names (``mixer_prefix``, ``mlp_prefix``, ``post_norm``,
    ``final_norm``), ``norm_offset`` (1.0 where RMSNorm scales by ``1 + weight``), and defines
    ``dims_from_config``, ``_layer_weights`` (the names a layer's token mixer needs),
    ``_attention`` and ``_mix`` (the recurrent layer for one sequence's chunk); a model with
    other MLPs overrides ``_mlp_weights`` and ``_mlp``.
    """

    mixer_prefix = "linear_attn."
    mlp_prefix = "mlp."
    post_norm = "post_attention_layernorm"
    final_norm = "model.norm"
    norm_offset = 0.0
    architecture = "hybrid"

    def __init__(self, state_dict: Mapping[str, Any], config: Any) -> None:
        self.dims = self.dims_from_config(config)
        self.w = self._load(state_dict)
        d = self.dims
        exponent = np.arange(0, d.rotary_dim, 2, dtype=np.float32) / np.float32(d.rotary_dim)
        self._inv_freq = (np.float32(1.0) / (np.float32(d.rope_theta) ** exponent)).astype(np.float32)

    @classmethod
    def dims_from_config(cls, config: Any) -> HybridDims:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def _layer_weights(self, kind: str) -> list[str]:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, Any], config: Any):
        """Weights by transformers' names (numpy arrays or torch tensors) and a config."""
        return cls(state_dict, config)

    @classmethod
    def from_transformers(cls, hf_model: Any):
        """Copy the weights of the transformers model of this architecture."""
        return cls(hf_model.state_dict(), hf_model.config)

    def _load(self, sd: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Every weight by transformers' name, as float32 numpy, biases where the state dict has
        them; the LM head falls back to the embedding (tied) when absent."""
        want = {"model.embed_tokens.weight", self.final_norm + ".weight"}
        for i, kind in enumerate(self.dims.layer_types):
            p = f"model.layers.{i}."
            want |= {p + name for name in self._layer_weights(kind)}
            want |= {p + n + ".weight" for n in ("input_layernorm", self.post_norm)}
            want |= {p + self.mlp_prefix + name for name in self._mlp_weights(i)}
        missing = sorted(want - set(sd))
        if missing:
            raise ValueError(f"state dict lacks {len(missing)} {self.architecture} weights, e.g. {missing[:3]}")
        w = {k: numpy_weight(sd[k]) for k in want}
        for k in sd:  # attention_bias, mlp_bias, conv bias
            if k.endswith(".bias") and k.replace(".bias", ".weight") in want:
                w[k] = numpy_weight(sd[k])
        w["lm_head.weight"] = numpy_weight(sd.get("lm_head.weight", sd["model.embed_tokens.weight"]))
        mixer = self.dims.mixer
        shape = w[f"model.layers.{self.dims.linear_layers[0]}.{self.mixer_prefix}conv1d.weight"].shape
        if shape != (mixer.conv_dim, 1, mixer.conv_kernel):
            raise ValueError(f"conv1d weights are {shape}, the config needs {(mixer.conv_dim, 1, mixer.conv_kernel)}")
        return w

    # ---- the stores this model writes into

    @property
    def kv_groups(self) -> tuple:
        """The attention groups: ``(FullAttention(),)``. The state group comes after them."""
        return (FullAttention(),)

    def new_stores(self, num_blocks: int, block_size: int, *, host_blocks: int = 0,
                   state_group: int = 1) -> tuple[KVStore, StateStore]:
        """A K/V store for the attention layers and a state store for the recurrent layers, both
        indexed by the manager's ``num_blocks`` block ids (one pool: an id serves one group at
        a time), float32 numpy; ``state_group`` is the manager's index of the state group. (A
        torch state store, ``StateStore(..., backend="torch")`` on any device, works as well.)"""
        d = self.dims
        kv = KVStore(len(d.attention_layers), num_blocks, block_size, d.num_kv_heads, d.head_dim,
                     host_blocks=host_blocks)
        states = StateStore(len(d.linear_layers), num_blocks, conv_shape=d.mixer.conv_shape,
                            recurrent_shape=d.mixer.recurrent_shape, host_blocks=host_blocks,
                            group=state_group)
        return kv, states

    def _check_stores(self, kv: KVStore, states: StateStore) -> None:
        d = self.dims
        if not isinstance(kv, KVStore) or not isinstance(states, StateStore):
            raise ValueError("forward takes a KVStore and a StateStore (new_stores makes both)")
        have = (kv.num_layers, kv.num_kv_heads, kv.head_dim)
        need = (len(d.attention_layers), d.num_kv_heads, d.head_dim)
        if have != need:
            raise ValueError(f"K/V store has (layers, kv heads, head dim) {have}, the model needs {need}")
        have = (states.num_layers, states.conv_shape, states.recurrent_shape)
        need = (len(d.linear_layers), d.mixer.conv_shape, d.mixer.recurrent_shape)
        if have != need:
            raise ValueError(f"state store has (layers, conv, recurrent) shapes {have}, the model needs {need}")

    # ---- the entry point

    def forward(self, kv_store: KVStore, state_store: StateStore, token_ids: Any, slots: Any,
                block_tables: Any, seq_lens: Any, query_lens: Any = None, *,
                state_read: Any, state_write: Any, state_snapshots: Any = None) -> np.ndarray:
        """Run a ragged batch of new tokens; return their logits, ``[len(token_ids), vocab]`` float32.

        Tokens, ``slots``, ``block_tables`` ``[batch, blocks]``, ``seq_lens`` and ``query_lens``
        are :meth:`pagedkv.model.PagedLlama.forward`'s, of the attention group: sequence i's
        last ``query_lens[i]`` tokens (default 1) of ``seq_lens[i]``. ``state_read[i]`` is the
        state block sequence i starts from (the state after position ``seq_lens[i] -
        query_lens[i] - 1``; -1 exactly when the step starts at position 0) and
        ``state_write[i]`` the block its state after its last token goes to (distinct per
        sequence; it may equal ``state_read[i]``: an update in place). In every recurrent layer
        the whole batch's initial states are read before any final state is written. A bad step
        raises ``ValueError`` before anything is written. Example (interval 8): a prompt of 20
        in chunks of 8 and 12 passes ``(-1, s0)`` then ``(s0, s1)``; a decode step after it
        ``(s1, s1)``.

        ``state_snapshots`` (optional, for a step that verifies draft tokens) gives, per sequence,
        None or one block per new token: the state after that token is written there too (-1:
        not kept). A verify step of a token and 3 drafts at positions 20 .. 23 with
        ``[-1, b1, b2, -1]`` keeps the states after 21 and 22, so that when one draft is
        accepted the next step reads ``b1`` (the state after 21), not the final one. Every block
        a step writes (``state_write`` and snapshots) is distinct.
        """
        self._check_stores(kv_store, state_store)
        ids, lens, qlens, reads, writes = self._check_step(token_ids, slots, seq_lens, query_lens,
                                                           state_read, state_write, state_store)
        snapshots = self._check_snapshots(state_snapshots, qlens, writes, state_store)
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
                x = x + self._recurrent(d.linear_layers.index(i), p + self.mixer_prefix, h, state_store,
                                        reads, writes, snapshots, starts, qlens)
            x = x + self._mlp(i, p + self.mlp_prefix, self._norm(x, p + self.post_norm))
        x = self._norm(x, self.final_norm)
        return (x @ self.w["lm_head.weight"].T).astype(np.float32)

    __call__ = forward

    # ---- the shared layers

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        """RMSNorm: ``x / sqrt(mean(x^2) + eps) * (norm_offset + weight)``."""
        scale = self.norm_offset + self.w[name + ".weight"]
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.dims.rms_norm_eps) * scale

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

    def _recurrent(self, layer: int, p: str, x: np.ndarray, states: StateStore, reads: np.ndarray,
                   writes: np.ndarray, snapshots: list, starts: np.ndarray, qlens: np.ndarray) -> np.ndarray:
        """One recurrent layer for the batch: every sequence's initial state read first, each
        sequence's chunk run from it (:meth:`_mix`), every final state (and snapshot) written
        last. A sequence with snapshots runs its chunk in pieces that end after each kept token:
        a piece run from the state the previous one left is the same computation."""
        w = {k[len(p):]: v for k, v in self.w.items() if k.startswith(p)}
        conv, rec = (_float64(a) for a in states.read(layer, reads))
        out = np.empty_like(x)
        final, kept = [], []  # (conv, recurrent) per sequence; (block, conv, recurrent) per snapshot
        for s, (start, n) in enumerate(zip(starts.tolist(), qlens.tolist())):
            c, r, lo = conv[s], rec[s], 0
            keep = {} if snapshots[s] is None else {j: b for j, b in enumerate(snapshots[s]) if b >= 0}
            for hi in sorted({j + 1 for j in keep} | {n}):
                out[start + lo:start + hi], c, r = self._mix(w, x[start + lo:start + hi], c, r)
                if hi - 1 in keep:
                    kept.append((keep[hi - 1], c, r))
                lo = hi
            final.append((c, r))
        blocks = writes.tolist() + [b for b, _, _ in kept]
        states.write(layer, blocks, np.stack([c for c, _ in final] + [c for _, c, _ in kept]),
                     np.stack([r for _, r in final] + [r for _, _, r in kept]))
        return out

    def _mlp_weights(self, layer: int) -> list[str]:
        """The names of layer ``layer``'s MLP weights (after the MLP prefix): a dense SwiGLU's."""
        return ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]

    def _mlp(self, layer: int, p: str, x: np.ndarray) -> np.ndarray:
        """The SwiGLU MLP, ``down(silu(gate(x)) * up(x))``."""
        return self._linear(silu(self._linear(x, p + "gate_proj")) * self._linear(x, p + "up_proj"), p + "down_proj")

    # ---- argument checks

    @staticmethod
    def _check_snapshots(snapshots: Any, qlens: np.ndarray, writes: np.ndarray, states: StateStore) -> list:
        """``state_snapshots`` as one entry per sequence (None, or an int list of one block per new
        token), every block written in the step distinct."""
        if snapshots is None:
            return [None] * len(qlens)
        if isinstance(snapshots, (str, bytes)) or len(snapshots) != len(qlens):
            raise ValueError(f"state_snapshots needs one entry per sequence ({len(qlens)})")
        out, kept = [], []
        for i, (entry, n) in enumerate(zip(snapshots, qlens.tolist())):
            if entry is None:
                out.append(None)
                continue
            blocks = np.asarray(entry).reshape(-1)
            if blocks.size and (blocks.dtype.kind not in "iu" or blocks.min() < -1 or blocks.max() >= states.num_blocks):
                raise ValueError(f"state_snapshots[{i}] must hold block ids in [-1, {states.num_blocks}), "
                                 f"got {blocks.tolist()}")
            if blocks.size != n:
                raise ValueError(f"state_snapshots[{i}] needs one block per new token ({n}), got {blocks.size}")
            out.append(blocks.tolist())
            kept += [b for b in blocks.tolist() if b >= 0]
        states.check_writes(np.concatenate([writes, np.asarray(kept, dtype=np.int64)]))
        return out

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
