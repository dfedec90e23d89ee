"""The Mamba2 mixer (Bamba's, Nemotron-H's, Granite 4.0-H's) as plain numpy maths, in float64.

Like :mod:`pagedkv.deltanet`, this module holds one layer and nothing else: one sequence's chunk
of positions in, its outputs and its final states out, from the states the caller hands it. A
Mamba2 layer carries a conv state ``[conv_dim, kernel - 1]`` (the convolution's last inputs: x, B
and C side by side) and an SSM state ``[num_heads, head_dim, state_size]``. Worked size, the
test model's layer (8 heads of 8 dims, 2 groups of state 8, kernel 4): conv_dim = 64 + 2 * 2 * 8
= 96, so 96 x 3 + 8 x 8 x 8 = 800 values, 3,200 bytes in float32.

The scan is the step-by-step form (transformers' ``mamba2_selective_state_update``, one position
at a time), exact and simple; transformers' chunked form (``mamba2_chunk_scan``) computes the same
sums in blocks. Only numpy is imported.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .deltanet import causal_conv1d

__all__ = ["Mamba2Dims", "mamba2_mixer", "selective_scan"]


@dataclass(frozen=True)
class Mamba2Dims:
    """The shape numbers of one Mamba2 layer: ``num_heads`` heads of ``head_dim`` (the inner
    size is their product), ``n_groups`` groups of B and C of ``state_size`` each (head ``h``
    reads group ``h // (num_heads // n_groups)``), a convolution of width ``conv_kernel``,
    ``time_step_limit`` the bounds dt is clamped to. Example, the test model: 8 heads of 8 dims,
    2 groups, state 8, kernel 4: conv_dim ``64 + 2 * 2 * 8 = 96``, SSM state ``[8, 8, 8]``.
    """

    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    eps: float = 1e-6
    time_step_limit: tuple = (0.0, float("inf"))

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "n_groups", "state_size", "conv_kernel"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel must be at least 2 (a state of kernel - 1 inputs), got {self.conv_kernel}")
        if self.num_heads % self.n_groups:
            raise ValueError(f"{self.num_heads} heads do not split into {self.n_groups} groups")

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C side by side."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)


def selective_scan(x: np.ndarray, dt: np.ndarray, A: np.ndarray, B: np.ndarray, C: np.ndarray,
                   D: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mamba2's scan one position at a time from ``state``; returns (y, final state).

    ``x`` ``[tokens, heads, head_dim]``, ``dt`` ``[tokens, heads]`` (after softplus), ``A`` and
    ``D`` ``[heads]``, ``B``/``C`` ``[tokens, heads, state_size]`` (groups repeated per head),
    ``state`` ``[heads, head_dim, state_size]``. Per position: ``S = S * exp(dt A) + dt x B``,
    ``y = S C + D x``.
    """
    state = np.array(state, dtype=np.float64)
    y = np.empty_like(x)
    for t in range(x.shape[0]):
        state *= np.exp(dt[t] * A)[:, None, None]
        state += (dt[t][:, None] * x[t])[:, :, None] * B[t][:, None, :]
        y[t] = np.einsum("hpn,hn->hp", state, C[t]) + D[:, None] * x[t]
    return y, state


def mamba2_mixer(d: Mamba2Dims, w: dict, x: np.ndarray, conv_state: np.ndarray,
                 ssm_state: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One Mamba2 layer over a chunk of one sequence: (out, conv state, SSM state).

    ``x`` is the chunk's normed hidden states ``[tokens, hidden]``; ``w`` the layer's weights by
    transformers' names without the prefix (``in_proj.weight``, ``conv1d.weight`` and
    ``conv1d.bias``, ``dt_bias``, ``A_log``, ``D``, ``norm.weight``, ``out_proj.weight``, and
    the projections' biases if present). The maths is ``BambaMixer.forward``: ``in_proj`` into
    the gate, x B C and dt; the causal convolution with SiLU on x B C; ``dt = softplus(dt +
    dt_bias)`` clamped to ``time_step_limit``, ``A = -exp(A_log)``; the scan; the gated norm
    (``y * silu(gate)``, then RMSNorm over each of ``n_groups`` groups, times ``weight``);
    ``out_proj``.
    """
    x = np.asarray(x, dtype=np.float64)
    tokens, inner, groups_n = x.shape[0], d.intermediate_size, d.n_groups * d.state_size
    proj = _linear(x, w, "in_proj")
    gate, xbc, dt = np.split(proj, [inner, inner + d.conv_dim], axis=-1)
    xbc, conv_state = causal_conv1d(xbc, w["conv1d.weight"][:, 0, :], conv_state, w.get("conv1d.bias"))
    hs, B, C = np.split(xbc, [inner, inner + groups_n], axis=-1)
    per_group = d.num_heads // d.n_groups
    B = np.repeat(B.reshape(tokens, d.n_groups, d.state_size), per_group, axis=1)
    C = np.repeat(C.reshape(tokens, d.n_groups, d.state_size), per_group, axis=1)
    dt = np.clip(np.logaddexp(0.0, dt + w["dt_bias"]), *d.time_step_limit)  # softplus, then the limit
    y, ssm_state = selective_scan(hs.reshape(tokens, d.num_heads, d.head_dim), dt, -np.exp(w["A_log"]),
                                  B, C, w["D"].astype(np.float64), ssm_state)
    with np.errstate(over="ignore"):
        y = y.reshape(tokens, inner) * (gate / (1.0 + np.exp(-gate)))
    y = y.reshape(tokens, d.n_groups, -1)
    y = (y / np.sqrt((y * y).mean(-1, keepdims=True) + d.eps)).reshape(tokens, inner) * w["norm.weight"]
    return _linear(y, w, "out_proj"), conv_state, ssm_state


def _linear(x: np.ndarray, w: dict, name: str) -> np.ndarray:
    y = x @ w[name + ".weight"].T
    bias = w.get(name + ".bias")
    return y if bias is None else y + bias
