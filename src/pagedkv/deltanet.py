"""The gated DeltaNet layer (Qwen3-Next's linear attention) as plain numpy maths, in float64.

This module holds the layer and nothing else: one sequence's chunk of positions in, its outputs
and its final state out, starting from the state the caller hands it. It knows no store, no block
ids and no batch; :mod:`pagedkv.qwen3_next` reads the states from the state store and writes them
back. Only numpy is imported.

A layer carries two states per sequence from one position to the next (transformers'
``Qwen3NextGatedDeltaNet`` with its cache's ``conv_states`` and ``recurrent_states``):

- the **conv state**, ``[conv_dim, kernel - 1]``: the last ``kernel - 1`` inputs of the causal
  depthwise convolution (the mixed q, k, v channels before the convolution), oldest first;
- the **recurrent state**, ``[num_v_heads, k_head_dim, v_head_dim]``: the delta rule's memory.

Worked size, Qwen3-Next-80B's layer (16 key heads and 32 value heads of 128 dims, kernel 4):
conv_dim = 2 * 16 * 128 + 32 * 128 = 8,192, so a conv state is 8,192 x 3 values and a recurrent
state 32 x 128 x 128 = 524,288 values: in float32 2 MiB + 96 KiB per layer, whatever the length.

The recurrence is the step-by-step form (transformers' ``torch_recurrent_gated_delta_rule``),
exact and simple: transformers' chunked form computes the same thing in blocks of 64 positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["DeltaNetDims", "causal_conv1d", "gated_delta_rule", "gated_deltanet", "l2norm"]


@dataclass(frozen=True)
class DeltaNetDims:
    """The shape numbers of one gated DeltaNet layer.

    ``num_k_heads`` query/key heads of ``k_head_dim``, ``num_v_heads`` value heads of
    ``v_head_dim`` (a multiple of the key heads: key head ``h`` serves value heads ``h * r`` ..
    ``h * r + r - 1``, r = num_v_heads / num_k_heads), a convolution of width ``conv_kernel``.
    Example, the test model: 2 key heads and 4 value heads of 8 dims, kernel 4: conv_dim
    ``2 * 16 + 32 = 64``, conv state ``[64, 3]``, recurrent state ``[4, 8, 8]``.
    """

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim", "conv_kernel"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel must be at least 2 (a state of kernel - 1 inputs), got {self.conv_kernel}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"{self.num_v_heads} value heads do not split over {self.num_k_heads} key heads")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.k_head_dim, self.v_head_dim)


def _silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x << 0: x / inf = -0, correct
        return x / (1.0 + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (the FLA library's, and transformers')."""
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def causal_conv1d(x: np.ndarray, weight: np.ndarray, conv_state: np.ndarray,
                  bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The depthwise causal convolution with SiLU, continued from ``conv_state``.

    ``x`` is ``[tokens, channels]``, ``weight`` ``[channels, kernel]`` and ``conv_state``
    ``[channels, kernel - 1]`` (the inputs before this chunk, oldest first; zeros at position 0).
    Output ``t`` is ``silu(bias + sum_j weight[:, j] * xx[t + j])`` over ``xx = [conv_state,
    x]``, and the new state is the last ``kernel - 1`` columns of ``xx``. Example (kernel 4): a
    decode step reads the 3 inputs before it and its own, and leaves its own and the 2 before it.
    Mamba2's convolution is the same one (with a bias).
    """
    tokens, kernel = x.shape[0], weight.shape[1]
    xx = np.concatenate([conv_state.T, x], axis=0)  # [kernel - 1 + tokens, channels]
    out = np.zeros_like(x) if bias is None else np.broadcast_to(np.asarray(bias, np.float64), x.shape).copy()
    for j in range(kernel):
        out += xx[j:j + tokens] * weight[:, j]
    return _silu(out), np.ascontiguousarray(xx[-(kernel - 1):].T)


def gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                     state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule, one position at a time, from ``state``; returns (out, final state).

    ``q``/``k`` ``[tokens, num_v_heads, k_head_dim]`` (already l2-normalised, ``q`` scaled by
    ``k_head_dim ** -0.5``, key heads repeated per value head), ``v`` ``[tokens, num_v_heads,
    v_head_dim]``, ``g`` and ``beta`` ``[tokens, num_v_heads]``, ``state`` ``[num_v_heads,
    k_head_dim, v_head_dim]``. Per position: decay the state by ``exp(g)``, read what it predicts
    for ``k`` (``k @ S``), write back ``beta`` times the error (``S += k (v - k @ S) beta``), and
    read the output ``q @ S``.
    """
    state = np.array(state, dtype=np.float64)
    out = np.empty_like(v)
    for t in range(q.shape[0]):
        state *= np.exp(g[t])[:, None, None]
        predicted = np.einsum("hk,hkv->hv", k[t], state)
        delta = (v[t] - predicted) * beta[t][:, None]
        state += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hk,hkv->hv", q[t], state)
    return out, state


def _split_projections(d: DeltaNetDims, qkvz: np.ndarray, ba: np.ndarray):
    """q, k ``[T, k_heads, k_dim]``, v, z ``[T, v_heads, v_dim]``, b, a ``[T, v_heads]`` from the
    two input projections, which transformers lays out per key head: ``[q, k, v.., z..]`` and
    ``[b.., a..]`` (``fix_query_key_value_ordering``)."""
    tokens, r = qkvz.shape[0], d.num_v_heads // d.num_k_heads
    qkvz = qkvz.reshape(tokens, d.num_k_heads, -1)
    ba = ba.reshape(tokens, d.num_k_heads, 2 * r)
    cuts = np.cumsum([d.k_head_dim, d.k_head_dim, r * d.v_head_dim])
    q, k, v, z = np.split(qkvz, cuts, axis=-1)
    v, z = (x.reshape(tokens, d.num_v_heads, d.v_head_dim) for x in (v, z))
    b, a = ba[..., :r].reshape(tokens, -1), ba[..., r:].reshape(tokens, -1)
    return q, k, v, z, b, a


def gated_deltanet(d: DeltaNetDims, w: dict, x: np.ndarray, conv_state: np.ndarray,
                   recurrent_state: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One gated DeltaNet layer over a chunk of one sequence: (out, conv state, recurrent state).

    ``x`` is the chunk's normed hidden states ``[tokens, hidden]`` (a prefill chunk, or one
    position for a decode step: the same code), the states those after the position before the
    chunk. ``w`` holds the layer's weights by transformers' names without the prefix
    (``in_proj_qkvz.weight``, ``in_proj_ba.weight``, ``conv1d.weight`` ``[conv_dim, 1, kernel]``,
    ``A_log``, ``dt_bias``, ``norm.weight``, ``out_proj.weight``). The maths is
    ``Qwen3NextGatedDeltaNet.forward``: split the projections, convolve q, k, v with SiLU,
    l2-normalise q and k, ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``,
    the delta rule, the gated RMSNorm ``norm(o) * weight * silu(z)`` per value head, ``out_proj``.
    """
    x = np.asarray(x, dtype=np.float64)
    q, k, v, z, b, a = _split_projections(d, x @ w["in_proj_qkvz.weight"].T, x @ w["in_proj_ba.weight"].T)
    tokens = x.shape[0]
    mixed = np.concatenate([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], -1)
    mixed, conv_state = causal_conv1d(mixed, w["conv1d.weight"][:, 0, :], conv_state)
    q, k, v = np.split(mixed, [d.key_dim, 2 * d.key_dim], axis=-1)
    r = d.num_v_heads // d.num_k_heads
    q = np.repeat(q.reshape(tokens, d.num_k_heads, d.k_head_dim), r, axis=1)
    k = np.repeat(k.reshape(tokens, d.num_k_heads, d.k_head_dim), r, axis=1)
    v = v.reshape(tokens, d.num_v_heads, d.v_head_dim)
    q = l2norm(q) * d.k_head_dim ** -0.5
    k = l2norm(k)
    beta = _sigmoid(b)
    g = -np.exp(w["A_log"]) * np.logaddexp(0.0, a + w["dt_bias"])  # softplus
    out, recurrent_state = gated_delta_rule(q, k, v, g, beta, recurrent_state)
    out = out / np.sqrt((out * out).mean(-1, keepdims=True) + d.eps) * w["norm.weight"] * _silu(z)
    return out.reshape(tokens, -1) @ w["out_proj.weight"].T, conv_state, recurrent_state
