"""A Llama-architecture decoder whose every key and value lives in the paged :class:`KVStore`.

This is the end-to-end proof that block tables are right: the decoder has no cache of its own.
Each step writes the new tokens' K/V at the slots the allocator returned and attends through the
block tables, so a wrong slot, a missed copy or a stale block shows up as wrong logits.

The architecture is Llama's: RMSNorm before attention and MLP, rotary position embeddings (the
"rotate half" convention, base ``rope_theta``), grouped-query attention, a SwiGLU MLP
(``down(silu(gate(x)) * up(x))``), a final RMSNorm and the LM head (tied to the embedding when the
weights have no ``lm_head.weight``). Weights come from a transformers state dict and config (any
Llama checkpoint with default RoPE runs unchanged) or from :meth:`PagedLlama.random`.

Two backends, one implementation of the maths. The weights are numpy arrays (the default, and all
that ``pagedkv report`` needs) or torch tensors (``backend="torch"``, the default of
:meth:`PagedLlama.from_transformers`, which keeps transformers' tensors as they are). Matmuls,
broadcasting and reshapes are spelled the same in both; the few operations that are not (casts,
``silu``, indexing, conversion) go through a backend object of a dozen lines each. torch is
imported only when a torch model is built.

Two ways to run the same weights:

- :meth:`PagedLlama.forward`: one engine step through a :class:`KVStore` and block tables;
- :meth:`PagedLlama.dense_forward`: the reference, one whole sequence with plain causal attention
  (float64, no store, no block tables, no slots). Every layer but attention is shared, so the
  two agree exactly when paging is right; whether the shared maths is Llama's is checked against
  transformers' ``LlamaForCausalLM`` in the test suite.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

import numpy as np

from .checks import int_at_least, number_at_least
from .kv_specs import AttentionSpec, ChunkedLocalAttention, FullAttention, SlidingWindow, check_groups
from .store import KVStore, dtype_name

__all__ = ["LlamaDims", "PagedLlama", "causal_attention"]


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _check_positive_number(name: str, v: Any) -> None:
    number_at_least(name, v, 0.0, strict=True, expected="a positive finite number")


@dataclass(frozen=True)
class LlamaDims:
    """The shape numbers of a Llama model (build one directly, or read a transformers config).

    Worked example, the test model: hidden 64, 4 heads of 16 dims, 2 KV heads (each KV head
    serves a group of 2 query heads), 2 layers, vocab 256, intermediate 128, rope_theta 500.

    ``layer_specs`` is the layer pattern of a hybrid model: one attention spec per layer
    (``pagedkv.kv_specs``: ``FullAttention()``, ``SlidingWindow(window=W)``,
    ``ChunkedLocalAttention(chunk=C)``). Empty (the default) means every layer is full attention:
    today's model, bit for bit. The distinct specs, in order of first appearance, are the KV cache
    groups (``kv_groups``; a manager built with ``groups=dims.kv_groups`` has one table per group)
    and ``layer_groups[i]`` is layer i's group. Example: ``(SlidingWindow(8), FullAttention(),
    SlidingWindow(8))`` gives ``kv_groups == (SlidingWindow(8), FullAttention())`` and
    ``layer_groups == (0, 1, 0)``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    layer_specs: tuple = ()

    def __post_init__(self) -> None:
        for f in fields(self)[:7]:
            v = getattr(self, f.name)
            int_at_least(f.name, v, 1, expected="a positive int")
        _check_positive_number("rope_theta", self.rope_theta)
        _check_positive_number("rms_norm_eps", self.rms_norm_eps)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads do not split into {self.num_kv_heads} KV groups")
        if self.head_dim % 2:
            raise ValueError(f"RoPE rotates pairs of dimensions: head_dim must be even, got {self.head_dim}")
        specs = self.layer_specs
        if isinstance(specs, (str, bytes)) or not isinstance(specs, (tuple, list)):
            raise ValueError(f"layer_specs must be a tuple of attention specs, got {specs!r}")
        if specs:
            specs = check_groups(list(specs))
            if len(specs) != self.num_layers:
                raise ValueError(f"layer_specs lists {len(specs)} specs for {self.num_layers} layers")
        object.__setattr__(self, "layer_specs", tuple(specs))

    @property
    def attention(self) -> tuple[AttentionSpec, ...]:
        """Layer i's attention spec, for every layer (all ``FullAttention()`` when ``layer_specs``
        is empty)."""
        return self.layer_specs or (FullAttention(),) * self.num_layers

    @property
    def kv_groups(self) -> tuple[AttentionSpec, ...]:
        """The distinct layer specs in order of first appearance: the manager's ``groups``."""
        return tuple(dict.fromkeys(self.attention))

    @property
    def layer_groups(self) -> tuple[int, ...]:
        """Layer i's index into :attr:`kv_groups`."""
        index = {g: i for i, g in enumerate(self.kv_groups)}
        return tuple(index[a] for a in self.attention)

    @classmethod
    def from_config(cls, config: Any) -> "LlamaDims":
        """Read a ``LlamaConfig`` (transformers 4.x ``rope_theta`` or 5.x ``rope_parameters``), a
        dict with its keys, or return a ``LlamaDims`` as it is."""
        if isinstance(config, LlamaDims):
            return config
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
        num_layers = int(_cfg(config, "num_hidden_layers"))
        return cls(
            vocab_size=int(_cfg(config, "vocab_size")),
            hidden_size=int(hidden),
            intermediate_size=int(_cfg(config, "intermediate_size")),
            num_layers=num_layers,
            num_heads=int(heads),
            num_kv_heads=int(_cfg(config, "num_key_value_heads") or heads),
            head_dim=int(_cfg(config, "head_dim") or hidden // heads),
            rope_theta=float(theta),
            rms_norm_eps=float(_cfg(config, "rms_norm_eps", 1e-6)),
            layer_specs=_layer_specs_from_config(config, num_layers),
        )


_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def _layer_specs_from_config(config: Any, num_layers: int) -> tuple:
    """The layer pattern of a transformers config: ``layer_types`` (``"full_attention"``,
    ``"sliding_attention"`` of ``sliding_window``, ``"chunked_attention"`` of
    ``attention_chunk_size``), else a bare ``sliding_window`` on every layer (Mistral), else all
    full (empty). Qwen2 sets ``sliding_window`` to None unless ``use_sliding_window``, and lists
    ``layer_types`` itself. (``pagedkv.sim.sizing`` reads the other spellings, such as
    ``sliding_window_pattern``, for sizing; the decoder runs only the models above.)"""
    types = _cfg(config, "layer_types")
    window, chunk = _cfg(config, "sliding_window"), _cfg(config, "attention_chunk_size")
    if types is None:
        if window is None or not _cfg(config, "use_sliding_window", True):
            return ()
        types = ["sliding_attention"] * num_layers
    if isinstance(types, (str, bytes)) or len(types) != num_layers:
        raise ValueError(f"layer_types must list one type per layer ({num_layers}), got {types!r}")
    specs = []
    for i, t in enumerate(types):
        if t not in _LAYER_TYPES:
            raise ValueError(f"layer_types[{i}] is {t!r}; the decoder runs {', '.join(_LAYER_TYPES)}")
        if t == "sliding_attention" and window is None:
            raise ValueError(f"layer {i} is a sliding_attention layer but the config has no sliding_window")
        if t == "chunked_attention" and chunk is None:
            raise ValueError(f"layer {i} is a chunked_attention layer but the config has no attention_chunk_size")
        specs.append(FullAttention() if t == "full_attention" else SlidingWindow(window)
                     if t == "sliding_attention" else ChunkedLocalAttention(chunk))
    return () if all(a.reads_whole_prefix for a in specs) else tuple(specs)


def _weight_shapes(d: LlamaDims) -> dict[str, tuple[int, ...]]:
    """Every weight the decoder needs (transformers' names), in a fixed order, with its shape.
    The LM head is not listed: it falls back to the embedding when absent (tied)."""
    q_out, kv_out = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    want = {"model.embed_tokens.weight": (d.vocab_size, d.hidden_size)}
    for i in range(d.num_layers):
        p = f"model.layers.{i}."
        want.update({
            p + "input_layernorm.weight": (d.hidden_size,),
            p + "self_attn.q_proj.weight": (q_out, d.hidden_size),
            p + "self_attn.k_proj.weight": (kv_out, d.hidden_size),
            p + "self_attn.v_proj.weight": (kv_out, d.hidden_size),
            p + "self_attn.o_proj.weight": (d.hidden_size, q_out),
            p + "post_attention_layernorm.weight": (d.hidden_size,),
            p + "mlp.gate_proj.weight": (d.intermediate_size, d.hidden_size),
            p + "mlp.up_proj.weight": (d.intermediate_size, d.hidden_size),
            p + "mlp.down_proj.weight": (d.hidden_size, d.intermediate_size),
        })
    want["model.norm.weight"] = (d.hidden_size,)
    return want


# ---- backends: the operations whose spelling differs between numpy and torch, nothing else


class _NumpyBackend:
    name = "numpy"
    dtypes = ("float16", "float32", "float64")

    @staticmethod
    def weight(value: Any, dtype: str) -> np.ndarray:
        """An owned copy of one weight (numpy or torch in)."""
        if _is_torch(value):
            value = value.detach().cpu()
            value = value.float().numpy() if str(value.dtype) == "torch.bfloat16" else value.numpy()
        return np.array(value, dtype=dtype)

    @staticmethod
    def asarray(x: Any, dtype: str) -> np.ndarray:
        if _is_torch(x):
            x = x.detach().cpu().float().numpy()
        return np.asarray(x, dtype=dtype)

    @staticmethod
    def cast(x: np.ndarray, dtype: str) -> np.ndarray:
        return x.astype(dtype, copy=False)

    @staticmethod
    def index(idx: np.ndarray) -> np.ndarray:
        return idx

    @staticmethod
    def silu(x: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x << 0: x / inf = -0, correct
            return x / (1 + np.exp(-x))

    @staticmethod
    def to_numpy(x: np.ndarray) -> np.ndarray:
        return x

    @staticmethod
    def inference() -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class _TorchBackend:
    name = "torch"
    dtypes = ("bfloat16", "float16", "float32", "float64")

    def __init__(self) -> None:
        try:
            import torch
        except ImportError as e:
            raise ImportError("backend='torch' needs torch (pip install 'pagedkv[model]'); "
                              "the numpy backend needs nothing else") from e
        self.torch = torch

    def weight(self, value: Any, dtype: str):
        return self.torch.as_tensor(value).detach().to("cpu", getattr(self.torch, dtype)).clone()

    def asarray(self, x: Any, dtype: str):
        return self.torch.as_tensor(x, dtype=getattr(self.torch, dtype))

    def cast(self, x, dtype: str):
        return x.to(getattr(self.torch, dtype))

    def index(self, idx: np.ndarray):
        return self.torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64))

    def silu(self, x):
        return self.torch.nn.functional.silu(x)

    @staticmethod
    def to_numpy(x) -> np.ndarray:
        return x.detach().cpu().float().numpy()

    def inference(self) -> contextlib.AbstractContextManager:
        return self.torch.inference_mode()


def _backend(name: str):
    if name == "numpy":
        return _NumpyBackend()
    if name == "torch":
        return _TorchBackend()
    raise ValueError(f"backend must be 'numpy' or 'torch', got {name!r}")


# ---- the reference attention, written independently of the store's kernel


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                     spec: AttentionSpec | None = None) -> np.ndarray:
    """Plain causal grouped-query attention over one whole sequence, in float64.

    ``q`` is ``[tokens, heads, head_dim]``, ``k``/``v`` ``[tokens, kv_heads, head_dim]``; token
    ``t`` attends to tokens ``0..t``; query head ``h`` reads KV head ``h // (heads // kv_heads)``
    (4 heads on 2 KV heads: heads 0, 1 read KV head 0). This is the textbook formula with the
    KV heads repeated and a ``[tokens, tokens]`` mask, sharing no code with the paged kernel.
    With a ``spec`` the mask also drops keys below ``spec.first_read(t)``: ``SlidingWindow(3)``
    lets token 5 see tokens 3, 4, 5; ``ChunkedLocalAttention(4)`` lets it see 4, 5.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    tokens, heads, dim = q.shape
    group = heads // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(dim)
    mask = np.tri(tokens, dtype=bool)
    if spec is not None:
        first = np.array([spec.first_read(t) for t in range(tokens)], dtype=np.int64)
        mask &= np.arange(tokens)[None, :] >= first[:, None]
    scores = np.where(mask, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", weights, v)


# A layer's attention: (layer, q [tokens, heads, dim], k, v [tokens, kv_heads, dim]) -> [tokens, heads, dim].
Attend = Callable[[int, Any, Any, Any], Any]


class PagedLlama:
    """Llama decoder over a paged KV store. ``forward`` is one engine step for a ragged batch.

    Build it with :meth:`random` (seeded numpy weights: nothing to download, no torch),
    :meth:`from_transformers` (a ``LlamaForCausalLM``) or :meth:`from_state_dict`. Attributes:
    ``dims`` (:class:`LlamaDims`), ``backend`` (``"numpy"`` or ``"torch"``), ``dtype`` (a name such
    as ``"float32"``), ``w`` (weights by transformers' names, ``lm_head.weight`` always present).
    ``new_store(num_blocks, block_size)`` makes a store shaped for it: the test model with 64
    blocks of 16 tokens takes ``64 * 2*2*16*2*16*4 = 524,288`` bytes.
    """

    def __init__(self, state_dict: Mapping[str, Any], config: Any, dtype: Any = "float32",
                 backend: str | None = None) -> None:
        self.dims = LlamaDims.from_config(config)
        if backend is None:  # keep torch tensors in torch, everything else in numpy
            backend = "torch" if any(_is_torch(v) for v in state_dict.values()) else "numpy"
        self._xp = _backend(backend)
        self.backend = self._xp.name
        self.dtype = dtype_name(dtype)
        if self.dtype not in self._xp.dtypes:
            raise ValueError(f"the {self.backend} backend runs {list(self._xp.dtypes)}, not {self.dtype!r}")
        self.w = self._load(state_dict)
        d = self.dims
        # RoPE frequencies in float32, the same expression as transformers
        exponent = np.arange(0, d.head_dim, 2, dtype=np.float32) / np.float32(d.head_dim)
        self._inv_freq = (np.float32(1.0) / (np.float32(d.rope_theta) ** exponent)).astype(np.float32)
        half = d.head_dim // 2
        self._swap_halves = self._xp.index(np.r_[half:d.head_dim, 0:half])

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, Any], config: Any, dtype: Any = "float32",
                        backend: str | None = None) -> "PagedLlama":
        """Weights by transformers' names (numpy arrays or torch tensors) and a config; the backend
        defaults to torch for torch tensors, numpy otherwise."""
        return cls(state_dict, config, dtype, backend)

    @classmethod
    def from_transformers(cls, hf_model: Any, dtype: Any = "float32", backend: str = "torch") -> "PagedLlama":
        """Copy the weights of a transformers ``LlamaForCausalLM`` (or any model with its names);
        ``backend="numpy"`` runs them without torch from then on."""
        return cls(hf_model.state_dict(), hf_model.config, dtype, backend)

    @classmethod
    def random(cls, dims: LlamaDims, seed: int = 0, *, init_std: float = 0.1,
               tie_word_embeddings: bool = False, dtype: Any = "float32",
               backend: str = "numpy") -> "PagedLlama":
        """A seeded, randomly initialised model: the same ``seed`` gives the same weights everywhere.

        Initialised as transformers initialises an untrained Llama: every matrix ``normal(0,
        init_std)``, every norm weight 1, no biases. ``init_std`` 0.1 (transformers' default is
        0.02) spreads the test model's logits to a standard deviation of about 0.8: over 60 positions
        of a random prompt the top two logits differ by at least 7e-3, far above the ~1e-6 float
        noise between the paged and the dense run, so greedy picks are not decided by noise.
        """
        if not isinstance(dims, LlamaDims):
            raise ValueError(f"dims must be a LlamaDims, got {type(dims).__name__}")
        int_at_least("seed", seed, 0)
        _check_positive_number("init_std", init_std)
        rng = np.random.default_rng(seed)
        shapes = dict(_weight_shapes(dims))
        if not tie_word_embeddings:
            shapes["lm_head.weight"] = (dims.vocab_size, dims.hidden_size)
        weights = {name: np.ones(shape) if name.endswith("norm.weight") else rng.normal(0.0, init_std, shape)
                   for name, shape in shapes.items()}
        return cls(weights, dims, dtype, backend)

    def _load(self, sd: Mapping[str, Any]) -> dict[str, Any]:
        """Pick and shape-check every weight the decoder needs; the LM head falls back to the
        embedding (tied) when absent."""
        want = _weight_shapes(self.dims)
        missing = [k for k in want if k not in sd]
        if missing:
            raise ValueError(f"state dict lacks {len(missing)} Llama weights, e.g. {missing[:3]}")
        want["lm_head.weight"] = want["model.embed_tokens.weight"]
        bad = [k for k, s in want.items() if k in sd and tuple(sd[k].shape) != s]
        if bad:
            raise ValueError(f"weight shapes disagree with the config: {bad[0]} is "
                             f"{tuple(sd[bad[0]].shape)}, expected {want[bad[0]]}")
        w = {k: self._xp.weight(sd[k], self.dtype) for k in want if k in sd}
        # optional biases (attention_bias / mlp_bias configs)
        for k in sd:
            if k.endswith(".bias") and k.replace(".bias", ".weight") in want:
                w[k] = self._xp.weight(sd[k], self.dtype)
        if "lm_head.weight" not in w:
            w["lm_head.weight"] = self._xp.weight(sd["model.embed_tokens.weight"], self.dtype)
        return w

    # ---- the store this model writes into

    def new_store(self, num_blocks: int, block_size: int, backend: str | None = None, *,
                  host_blocks: int = 0) -> KVStore:
        """A KV store with this model's layers, KV heads and head dim, in the model's dtype and
        (unless ``backend`` says otherwise) its backend; ``host_blocks`` sizes its host pool (the
        manager's host tier); ``num_groups`` is the model's number of KV cache groups."""
        d = self.dims
        return KVStore(d.num_layers, num_blocks, block_size, d.num_kv_heads, d.head_dim,
                       dtype=self.dtype, backend=backend or self.backend, host_blocks=host_blocks,
                       num_groups=len(d.kv_groups))

    def _check_store(self, store: KVStore) -> None:
        d = self.dims
        have = (store.num_layers, store.num_kv_heads, store.head_dim)
        need = (d.num_layers, d.num_kv_heads, d.head_dim)
        if have != need:
            raise ValueError(f"store has (layers, kv heads, head dim) {have}, the model needs {need}")

    # ---- the two entry points

    def forward(self, store: KVStore, token_ids: Any, slots: Any, block_tables: Any,
                seq_lens: Any, query_lens: Any = None):
        """Run a ragged batch of new tokens; return their logits, ``[len(token_ids), vocab]`` float32
        (a numpy array, or a torch tensor for a torch model).

        Sequence ``i`` contributes its last ``query_lens[i]`` tokens (default 1: a decode step) out of
        ``seq_lens[i]``, concatenated in ``token_ids``; token ``j`` of sequence ``i`` is at position
        ``seq_lens[i] - query_lens[i] + j`` and its K/V goes to ``slots[t]``. ``block_tables`` is
        ``[batch, max_blocks]`` (``KVCacheManager.block_tables``). Prefill after a prefix hit of
        ``h`` tokens passes the prompt's last ``len - h`` tokens with ``query_lens = len - h``; a
        chunk of a prefill or a run of draft tokens is the same call with more query tokens.
        In every layer the whole batch's K/V is written before any sequence's attention reads, so
        a sequence may read, through its table, a block that another sequence of the same call
        writes (a prefix hit on a block published in this step: chunked prefill relies on it).
        A bad step raises ``ValueError`` before any K/V is written.

        A hybrid model (more than one of :attr:`kv_groups`) takes one entry per group instead:
        ``slots[g]`` and ``block_tables[g]`` are group g's (``manager.slots(id, start, stop,
        group=g)`` and ``manager.block_tables(ids, group=g)``), and each layer writes and reads
        through its own group's (as vLLM's per-group slot mappings and block tables). A sliding or
        chunked layer gathers only the blocks its queries read, from the first block the
        step's earliest query reads (``SlidingWindow(7)``, block size 4, a decode at position 20:
        blocks 3 on); the entries below may be -1 (released) and are never touched. An entry
        that a query does read and that is -1 is a ``ValueError`` before anything is written.
        """
        self._check_store(store)
        groups, layer_groups = self.kv_groups, self.dims.layer_groups
        slots_g, tables_g = self._per_group(slots, block_tables)
        ids, lens, qlens = self._check_step(token_ids, slots_g, seq_lens, query_lens)
        for spec, sl, tables in zip(groups, slots_g, tables_g):  # fail before the first layer writes
            store.check_batch(sl, tables, lens, qlens, spec=spec)
        positions = np.repeat(lens - qlens, qlens) + _ranks(qlens)

        def paged(layer, q, k, v):
            g = layer_groups[layer]
            store.write(layer, slots_g[g], k, v)  # the new tokens' K/V go to the allocator's slots first...
            return store.paged_attention(layer, q, tables_g[g], lens, qlens,  # ...then attention reads
                                         spec=groups[g])

        return self._decode(ids, positions, paged)

    @property
    def kv_groups(self) -> tuple[AttentionSpec, ...]:
        """The model's KV cache groups (``dims.kv_groups``): ``(FullAttention(),)`` for a plain
        Llama; pass them as a manager's ``groups``."""
        return self.dims.kv_groups

    def _per_group(self, slots: Any, block_tables: Any) -> tuple[list, list]:
        """``slots`` and ``block_tables`` as one entry per KV cache group."""
        n = len(self.kv_groups)
        if n == 1:
            return [slots], [block_tables]
        for name, arg in (("slots", slots), ("block_tables", block_tables)):
            if not isinstance(arg, (list, tuple)) or len(arg) != n:
                raise ValueError(f"this model has {n} KV cache groups {list(self.kv_groups)}: {name} "
                                 f"must be a list of {n} per-group entries")
        return list(slots), list(block_tables)

    __call__ = forward

    def dense_forward(self, token_ids: Any):
        """The reference: logits at every position of one sequence, ``[len(token_ids), vocab]``
        float32, computed without paging.

        The same weights and layers as :meth:`forward`, but each layer's attention is
        :func:`causal_attention` over the whole sequence's K/V as computed in this call: no store,
        no block tables, no slots, no copies. Row ``t`` predicts token ``t + 1``; a sample's logits
        at decode step ``s`` after an ``n``-token prompt are row ``n - 1 + s`` of
        ``dense_forward(prompt + tokens[:-1])``.
        """
        ids = self._check_ids(token_ids)
        if ids.size == 0:
            raise ValueError("dense_forward needs at least one token")

        attention = self.dims.attention

        def dense(layer, q, k, v):
            xp = self._xp
            spec = None if attention[layer].reads_whole_prefix else attention[layer]
            return causal_attention(xp.to_numpy(q), xp.to_numpy(k), xp.to_numpy(v), spec)

        return self._decode(ids, np.arange(ids.size), dense)

    # ---- the maths, once for both backends and both entry points

    def _decode(self, ids: np.ndarray, positions: np.ndarray, attend: Attend):
        """Embedding, every layer (attention delegated to ``attend``), final norm, LM head."""
        d, w, xp = self.dims, self.w, self._xp
        with xp.inference():
            rope = self._rope(positions)
            x = w["model.embed_tokens.weight"][xp.index(ids)]
            for i in range(d.num_layers):
                p = f"model.layers.{i}."
                x = x + self._attention(i, self._norm(x, p + "input_layernorm"), rope, attend)
                x = x + self._mlp(i, self._norm(x, p + "post_attention_layernorm"))
            return xp.cast(self._linear(self._norm(x, "model.norm"), "lm_head"), "float32")

    def _norm(self, x, name: str):
        """RMSNorm, ``weight * x / sqrt(mean(x^2) + eps)``; half precision is normalised in float32
        as transformers does."""
        h = self._xp.cast(x, "float32") if self.dtype in ("float16", "bfloat16") else x
        h = h * ((h * h).mean(-1, keepdims=True) + self.dims.rms_norm_eps) ** -0.5
        return self.w[name + ".weight"] * self._xp.cast(h, self.dtype)

    def _linear(self, x, name: str):
        y = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return y if bias is None else y + bias

    def _rope(self, positions: np.ndarray):
        """cos and sin per token, ``[tokens, 1, head_dim]``, computed in float32 as transformers does.

        Rotate-half maps ``(x1, x2)`` to ``(-x2, x1)``; here that is ``x[..., swap] * sign`` with the
        sign folded into ``sin`` (``(-x2) * s == x2 * (-s)`` exactly in floating point).
        """
        freqs = positions.astype(np.float32)[:, None] * self._inv_freq[None, :]
        cos, sin = np.cos(freqs), np.sin(freqs)
        cos, sin = np.concatenate([cos, cos], -1), np.concatenate([-sin, sin], -1)
        return self._xp.asarray(cos[:, None], self.dtype), self._xp.asarray(sin[:, None], self.dtype)

    def _rotate(self, x, rope):
        cos, signed_sin = rope
        return x * cos + x[..., self._swap_halves] * signed_sin

    def _attention(self, i: int, x, rope, attend: Attend):
        d, p = self.dims, f"model.layers.{i}.self_attn."
        q = self._rotate(self._linear(x, p + "q_proj").reshape(-1, d.num_heads, d.head_dim), rope)
        k = self._rotate(self._linear(x, p + "k_proj").reshape(-1, d.num_kv_heads, d.head_dim), rope)
        v = self._linear(x, p + "v_proj").reshape(-1, d.num_kv_heads, d.head_dim)
        out = self._xp.asarray(attend(i, q, k, v), self.dtype)
        return self._linear(out.reshape(-1, d.num_heads * d.head_dim), p + "o_proj")

    def _mlp(self, i: int, x):
        p = f"model.layers.{i}.mlp."
        gated = self._xp.silu(self._linear(x, p + "gate_proj")) * self._linear(x, p + "up_proj")
        return self._linear(gated, p + "down_proj")

    # ---- argument checks

    def _check_ids(self, token_ids: Any) -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.size and ids.dtype.kind not in "iu":
            raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.dims.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.dims.vocab_size})")
        return ids

    def _check_step(self, token_ids, slots_g, seq_lens, query_lens):
        ids = self._check_ids(token_ids)
        lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        if query_lens is None:
            qlens = np.ones_like(lens)
        else:
            qlens = np.asarray(query_lens, dtype=np.int64).reshape(-1)
        if qlens.shape != lens.shape or int(qlens.sum()) != ids.size:
            raise ValueError(f"{ids.size} tokens but query_lens {qlens.tolist()} for {lens.size} sequences")
        if (qlens < 1).any() or (qlens > lens).any():
            raise ValueError("each sequence needs 1 <= query_len <= seq_len")
        for g, slots in enumerate(slots_g):
            if len(slots) != ids.size:
                where = "" if len(slots_g) == 1 else f" in group {g}"
                raise ValueError(f"{ids.size} tokens need {ids.size} slots{where}, got {len(slots)}")
        return ids, lens, qlens


def _ranks(qlens: np.ndarray) -> np.ndarray:
    """``[0..q0-1, 0..q1-1, ...]``: each token's index within its sequence's new tokens."""
    return np.arange(int(qlens.sum())) - np.repeat(np.cumsum(qlens) - qlens, qlens)
