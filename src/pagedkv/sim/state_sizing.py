"""Sizing of recurrent-state hybrids: state bytes per layer and per sequence, read from a config.

Gated DeltaNet (Qwen3-Next, Qwen3.5), Mamba2 (Nemotron-H, Granite 4.0-H, Bamba, Falcon-H1),
Mamba (Jamba) and Kimi Delta Attention (Kimi Linear) layers keep a fixed-size state per sequence
instead of K/V per token. This module reads a Hugging Face config's hybrid fields, computes each
state's shapes exactly as vLLM does, and applies vLLM's rule that forces the attention block size
up to the state's bytes. It imports :mod:`pagedkv.sim.sizing` only; it knows no allocator.

The formulas (per layer, on one of ``tp`` GPUs; every shape as vLLM's
``MambaStateShapeCalculator`` in ``vllm/model_executor/layers/mamba/mamba_utils.py`` builds it,
with the dimensions each model's ``get_mamba_state_shape_from_config`` passes):

- gated DeltaNet (``gated_delta_net_state_shape``; ``qwen3_next.py``, ``qwen3_5.py``):
  conv state ``(kernel - 1) x conv_dim / tp`` with ``conv_dim = 2 x key_dim + value_dim``,
  ``key_dim = linear_num_key_heads x linear_key_head_dim``, ``value_dim = linear_num_value_heads x
  linear_value_head_dim``; recurrent state ``linear_num_value_heads / tp x v_head_dim x k_head_dim``.
  Qwen3-Next-80B-A3B at tp 1 in bf16: conv_dim = 2 x 16 x 128 + 32 x 128 = 8,192;
  (3 x 8,192 + 32 x 128 x 128) x 2 B = 1,097,728 B per layer.
- Mamba2 (``mamba2_state_shape``; ``nemotron_h.py``, ``granitemoehybrid.py``, ``bamba.py``,
  ``falcon_h1.py``): conv state ``(kernel - 1) x (intermediate + 2 x n_groups x state_size) / tp``,
  where ``n_groups`` is first raised to ``tp`` when ``tp`` does not divide it
  (``extra_groups_for_head_shards``, so every GPU holds the groups its heads need); SSM state
  ``heads / tp x head_dim x state_size``. ``intermediate`` is ``mamba_num_heads x mamba_head_dim``
  for Nemotron-H and ``mamba_expand x hidden_size`` for Granite and Bamba (``mamba_d_ssm`` when
  Falcon-H1 gives it).
- Mamba (``mamba1_state_shape``; ``jamba.py``): conv ``(kernel - 1) x intermediate / tp``, SSM
  ``intermediate / tp x state_size``, ``intermediate = mamba_expand x hidden_size``.
- Kimi Delta Attention (``kda_state_shape``; ``kimi_linear.py``): conv ``(kernel - 1) x 3 x heads x
  head_dim / tp`` (q, k and v), recurrent ``heads / tp x head_dim x head_dim``.

Tensor parallelism divides every state dimension above by ``tp`` (vLLM's ``divide`` refuses a
``tp`` that does not divide it; so does :func:`state_shapes`). Attention K/V is split by KV head,
``ceil(kv_heads / tp)`` per GPU (a head is replicated when ``tp`` exceeds the heads); an MLA latent
(Kimi Linear's full-attention layers) is whole on every GPU. vLLM adds ``num_speculative_tokens``
rows to the conv state when speculative decoding is on; this module sizes it off.

State dtypes, as vLLM picks them with ``--mamba-cache-dtype`` and ``--mamba-ssm-cache-dtype`` left
at ``auto`` (``MambaStateDtypeCalculator``, and ``vllm/model_executor/models/config.py``): the conv
state takes the model's dtype; the temporal (SSM or recurrent) state takes the model's dtype too,
except where a model's rule overrides it: Qwen3.5 uses the config's ``mamba_ssm_dtype``
(``Qwen3_5ForConditionalGenerationConfig``, applied here to any gated DeltaNet config that gives
the field), Nemotron-H the config's ``mamba_ssm_cache_dtype`` or else float32
(``NemotronHForCausalLMConfig``), and Kimi Linear always float32 (``kda_state_dtype``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from ..checks import int_at_least
from .sizing import dtype_bytes, uniform_page_group_size

__all__ = [
    "StateSpec",
    "HybridModel",
    "hybrid_from_config",
    "is_hybrid_state_config",
    "builtin_hybrids",
    "get_hybrid",
    "HYBRID_SOURCES",
    "vllm_kernel_alignment",
    "vllm_attention_block_size",
    "HybridSizing",
    "hybrid_sizing",
    "STATE_KINDS",
]

# The state kinds, as vLLM names the shape calculator each one uses.
STATE_KINDS = ("gated_deltanet", "mamba2", "mamba1", "kda")


def _divide(what: str, value: int, tp: int) -> int:
    """``value / tp``, refused as vLLM's ``divide`` refuses it when ``tp`` does not divide it."""
    if value % tp:
        raise ValueError(f"tp {tp} does not divide {what} ({value}): vLLM shards it evenly or not at all")
    return value // tp


@dataclass(frozen=True)
class StateSpec:
    """One recurrent layer's state: its kind, the dimensions vLLM's shape calculator takes, and the
    dtypes of its two tensors (conv state, temporal state). Fields a kind does not use are 0."""

    kind: str
    conv_kernel: int
    conv_dtype: str
    temporal_dtype: str
    num_k_heads: int = 0      # gated DeltaNet: key heads; KDA: heads
    num_v_heads: int = 0      # gated DeltaNet: value heads
    k_head_dim: int = 0       # gated DeltaNet: key head dim; KDA: head dim
    v_head_dim: int = 0       # gated DeltaNet: value head dim
    intermediate: int = 0     # Mamba2 and Mamba: the inner width
    n_groups: int = 0         # Mamba2: B/C groups
    num_heads: int = 0        # Mamba2: SSM heads
    head_dim: int = 0         # Mamba2: SSM head dim
    state_size: int = 0       # Mamba2 and Mamba: SSM state size (d_state)

    def __post_init__(self) -> None:
        if self.kind not in STATE_KINDS:
            raise ValueError(f"state kind must be one of {', '.join(STATE_KINDS)}, got {self.kind!r}")
        int_at_least("conv kernel", self.conv_kernel, 1)
        dtype_bytes(self.conv_dtype)
        dtype_bytes(self.temporal_dtype)

    def shapes(self, tp: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state shape, temporal state shape) on one of ``tp`` GPUs, as vLLM builds them
        (conv in its default (state_len, dim) layout). Qwen3-Next, tp 1: ((3, 8192), (32, 128, 128))."""
        tp = int_at_least("tp", tp, 1)
        rows = self.conv_kernel - 1
        if self.kind == "gated_deltanet":
            conv_dim = 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim
            return ((rows, _divide("the conv dim", conv_dim, tp)),
                    (_divide("the value heads", self.num_v_heads, tp), self.v_head_dim, self.k_head_dim))
        if self.kind == "mamba2":
            groups = self.n_groups if self.n_groups % tp == 0 else tp  # extra_groups_for_head_shards
            conv_dim = self.intermediate + 2 * groups * self.state_size
            return ((rows, _divide("the conv dim", conv_dim, tp)),
                    (_divide("the SSM heads", self.num_heads, tp), self.head_dim, self.state_size))
        if self.kind == "mamba1":
            inner = _divide("the intermediate size", self.intermediate, tp)
            return (rows, inner), (inner, self.state_size)
        conv_dim = 3 * self.num_k_heads * self.k_head_dim  # kda: q, k and v projections
        return ((rows, _divide("the conv dim", conv_dim, tp)),
                (_divide("the heads", self.num_k_heads, tp), self.k_head_dim, self.k_head_dim))

    def conv_bytes(self, tp: int = 1) -> int:
        return math.prod(self.shapes(tp)[0]) * dtype_bytes(self.conv_dtype)

    def temporal_bytes(self, tp: int = 1) -> int:
        return math.prod(self.shapes(tp)[1]) * dtype_bytes(self.temporal_dtype)

    def bytes(self, tp: int = 1) -> int:
        """One layer's state bytes on one GPU: vLLM's ``MambaSpec.page_size_bytes`` before padding.
        Qwen3-Next, tp 1, bf16: 49,152 + 1,048,576 = 1,097,728."""
        return self.conv_bytes(tp) + self.temporal_bytes(tp)


@dataclass(frozen=True)
class HybridModel:
    """A recurrent-state hybrid: how many layers attend and how many keep a state, the attention
    layers' K/V shape (``num_kv_heads`` and ``head_dim``, or an MLA latent), and the state.
    ``source`` names where the dimensions were read (a Hugging Face model id and its fields)."""

    name: str
    attention_layers: int
    state_layers: int
    state: StateSpec
    dtype: str
    num_kv_heads: int = 0
    head_dim: int = 0
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        int_at_least(f"{self.name}: attention layers", self.attention_layers, 1,
                     expected="a positive int (a hybrid needs at least one attention layer)")
        int_at_least(f"{self.name}: state layers", self.state_layers, 1, expected="a positive int")
        dtype_bytes(self.dtype)
        if self.kv_lora_rank is None:
            int_at_least(f"{self.name}: num_kv_heads", self.num_kv_heads, 1, expected="a positive int")
            int_at_least(f"{self.name}: head_dim", self.head_dim, 1, expected="a positive int")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def num_layers(self) -> int:
        """Layers that hold either K/V or a state (a Falcon-H1 layer holds both and counts twice)."""
        return self.attention_layers + self.state_layers

    def kv_heads_per_gpu(self, tp: int = 1) -> int:
        return 0 if self.is_mla else math.ceil(self.num_kv_heads / int_at_least("tp", tp, 1))

    def attention_bytes_per_token_layer(self, tp: int = 1, dtype: str | None = None) -> int:
        """One attention layer's K/V bytes per token on one GPU (vLLM's ``FullAttentionSpec``
        page of one token): 2 x kv heads x head dim x dtype bytes, or an MLA latent
        (kv_lora_rank + qk_rope_head_dim) x dtype bytes. Qwen3-Next: 2 x 2 x 256 x 2 = 2,048."""
        nbytes = dtype_bytes(dtype or self.dtype)
        if self.is_mla:
            int_at_least("tp", tp, 1)
            return (self.kv_lora_rank + self.qk_rope_head_dim) * nbytes
        return 2 * self.kv_heads_per_gpu(tp) * self.head_dim * nbytes


# ---- reading a config ---------------------------------------------------------------------------


def _field(cfg: Mapping[str, Any], key: str, what: str) -> int:
    """A positive-int config field, or a ValueError naming it."""
    if cfg.get(key) is None:
        raise ValueError(f"config lacks {key} ({what})")
    value = cfg[key]
    value = int(value) if isinstance(value, float) and value.is_integer() else value
    return int_at_least(f"config field {key}", value, 1, expected="a positive integer")


def _dtype(cfg: Mapping[str, Any]) -> str:
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    dtype_bytes(str(dtype))
    return str(dtype).removeprefix("torch.")


def _text_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's fields: a multimodal wrapper's ``text_config`` (Qwen3.5), keeping the
    wrapper's dtype when the text config gives none."""
    inner = cfg.get("text_config")
    if cfg.get("num_hidden_layers") is None and isinstance(inner, Mapping):
        outer_dtype = cfg.get("torch_dtype") or cfg.get("dtype")
        return {**({"torch_dtype": outer_dtype} if outer_dtype else {}), **inner}
    return dict(cfg)


def is_hybrid_state_config(config: Mapping[str, Any]) -> bool:
    """Whether a config describes a recurrent-state hybrid this module sizes (by its fields)."""
    if not isinstance(config, Mapping):
        return False
    cfg = _text_config(config)
    if cfg.get("linear_attn_config") is not None or cfg.get("hybrid_override_pattern") is not None:
        return True
    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    if isinstance(types, (list, tuple)) and types:  # the layer list says whether any layer keeps a state
        return any(t in ("linear_attention", "mamba") for t in types)
    return bool(cfg.get("linear_num_value_heads") is not None or cfg.get("mamba_n_heads") is not None
                or str(cfg.get("model_type", "")) in ("jamba", "falcon_h1", "bamba", "granitemoehybrid"))


def _count_types(types: Any, field: str, num_layers: int, attention: str, state: str) -> tuple[int, int]:
    if not isinstance(types, (list, tuple)) or len(types) != num_layers:
        raise ValueError(f"config field {field} must list one type per layer ({num_layers}), got {types!r}")
    unknown = sorted({str(t) for t in types} - {attention, state})
    if unknown:
        raise ValueError(f"config field {field} has layer types {unknown}: this model knows "
                         f"{attention!r} and {state!r}")
    return types.count(attention), types.count(state)


def _gated_deltanet(cfg: Mapping[str, Any], num_layers: int, dtype: str) -> tuple[int, int, StateSpec]:
    if cfg.get("layer_types") is not None:
        attn, state = _count_types(cfg["layer_types"], "layer_types", num_layers, "full_attention",
                                   "linear_attention")
    else:  # transformers' default: layer i is full attention when (i + 1) % interval == 0
        interval = _field(cfg, "full_attention_interval", "which layers are full attention")
        attn = num_layers // interval
        state = num_layers - attn
    spec = StateSpec(
        "gated_deltanet", _field(cfg, "linear_conv_kernel_dim", "the gated DeltaNet conv kernel"),
        conv_dtype=dtype, temporal_dtype=str(cfg.get("mamba_ssm_dtype") or dtype),
        num_k_heads=_field(cfg, "linear_num_key_heads", "gated DeltaNet key heads"),
        num_v_heads=_field(cfg, "linear_num_value_heads", "gated DeltaNet value heads"),
        k_head_dim=_field(cfg, "linear_key_head_dim", "gated DeltaNet key head dim"),
        v_head_dim=_field(cfg, "linear_value_head_dim", "gated DeltaNet value head dim"))
    return attn, state, spec


def _nemotron_h(cfg: Mapping[str, Any], num_layers: int, dtype: str) -> tuple[int, int, StateSpec]:
    pattern = cfg["hybrid_override_pattern"]
    if not isinstance(pattern, str) or len(pattern) != num_layers:
        raise ValueError(f"config field hybrid_override_pattern must have one character per layer "
                         f"({num_layers}), got {pattern!r}")
    heads = _field(cfg, "mamba_num_heads", "Mamba2 heads")
    head_dim = _field(cfg, "mamba_head_dim", "Mamba2 head dim")
    spec = StateSpec(
        "mamba2", _field(cfg, "conv_kernel", "the Mamba2 conv kernel"), conv_dtype=dtype,
        temporal_dtype=str(cfg.get("mamba_ssm_cache_dtype") or "float32"),
        intermediate=heads * head_dim, n_groups=_field(cfg, "n_groups", "Mamba2 groups"),
        num_heads=heads, head_dim=head_dim, state_size=_field(cfg, "ssm_state_size", "the SSM state size"))
    return pattern.count("*"), pattern.count("M"), spec


def _layer_split(cfg: Mapping[str, Any], num_layers: int) -> tuple[int, int]:
    """(attention, state) layer counts of a Mamba hybrid, from whichever field the family uses."""
    for field in ("layer_types", "layers_block_type"):
        if cfg.get(field) is not None:
            return _count_types(cfg[field], field, num_layers, "attention", "mamba")
    if cfg.get("attn_layer_indices") is not None:
        idx = cfg["attn_layer_indices"]
        if not isinstance(idx, (list, tuple)) or any(not isinstance(i, int) or not 0 <= i < num_layers for i in idx):
            raise ValueError(f"config field attn_layer_indices must list layer indices below {num_layers}, got {idx!r}")
        return len(set(idx)), num_layers - len(set(idx))
    if str(cfg.get("model_type", "")) == "falcon_h1":  # attention and Mamba2 run in parallel in every layer
        return num_layers, num_layers
    period = _field(cfg, "attn_layer_period", "which layers attend (or layer_types)")
    if cfg.get("attn_layer_offset") is None:
        raise ValueError("config lacks attn_layer_offset (which layers attend)")
    offset = int_at_least("config field attn_layer_offset", cfg["attn_layer_offset"], 0)
    attn = sum(1 for i in range(num_layers) if i % period == offset)
    return attn, num_layers - attn


def _mamba(cfg: Mapping[str, Any], num_layers: int, dtype: str) -> tuple[int, int, StateSpec]:
    attn, state = _layer_split(cfg, num_layers)
    hidden = _field(cfg, "hidden_size", "the Mamba inner width is mamba_expand x hidden_size")
    kernel = _field(cfg, "mamba_d_conv", "the Mamba conv kernel")
    d_state = _field(cfg, "mamba_d_state", "the SSM state size")
    temporal = str(cfg.get("mamba_ssm_cache_dtype") or dtype)
    if cfg.get("mamba_n_heads") is None and str(cfg.get("model_type", "")) == "jamba":
        inner = _field(cfg, "mamba_expand", "the Mamba expansion") * hidden
        return attn, state, StateSpec("mamba1", kernel, dtype, temporal, intermediate=inner, state_size=d_state)
    inner = (_field(cfg, "mamba_d_ssm", "the Mamba2 inner width") if cfg.get("mamba_d_ssm") is not None
             else _field(cfg, "mamba_expand", "the Mamba2 expansion") * hidden)
    spec = StateSpec("mamba2", kernel, dtype, temporal, intermediate=inner,
                     n_groups=_field(cfg, "mamba_n_groups", "Mamba2 groups"),
                     num_heads=_field(cfg, "mamba_n_heads", "Mamba2 heads"),
                     head_dim=_field(cfg, "mamba_d_head", "Mamba2 head dim"), state_size=d_state)
    return attn, state, spec


def _kda(cfg: Mapping[str, Any], num_layers: int, dtype: str) -> tuple[int, int, StateSpec]:
    lin = cfg["linear_attn_config"]
    if not isinstance(lin, Mapping):
        raise ValueError(f"config field linear_attn_config must be an object, got {lin!r}")
    full = lin.get("full_attn_layers")
    if not isinstance(full, (list, tuple)) or not full:
        raise ValueError("config lacks linear_attn_config.full_attn_layers (which layers are full attention)")
    kda = lin.get("kda_layers")
    state = len(kda) if isinstance(kda, (list, tuple)) else num_layers - len(full)
    spec = StateSpec("kda", _field(lin, "short_conv_kernel_size", "linear_attn_config: the KDA conv kernel"),
                     conv_dtype=dtype, temporal_dtype="float32",
                     num_k_heads=_field(lin, "num_heads", "linear_attn_config: KDA heads"),
                     k_head_dim=_field(lin, "head_dim", "linear_attn_config: KDA head dim"))
    return len(full), state, spec


def hybrid_from_config(config: Mapping[str, Any], name: str | None = None, source: str = "") -> HybridModel:
    """A :class:`HybridModel` from a Hugging Face config's hybrid fields; a ValueError naming the
    first field it lacks. Recognised: ``linear_attn_config`` (Kimi Linear), ``hybrid_override_pattern``
    (Nemotron-H: M Mamba2, * attention, - MLP, E MoE), ``linear_num_value_heads`` with ``layer_types``
    or ``full_attention_interval`` (Qwen3-Next, Qwen3.5), and ``layer_types`` / ``layers_block_type``
    / ``attn_layer_indices`` / ``attn_layer_period`` + ``attn_layer_offset`` with ``mamba_*`` fields
    (Granite 4.0-H, Bamba, Falcon-H1, Jamba). Example: Qwen3-Next-80B-A3B -> 12 attention layers,
    36 gated DeltaNet layers of 1,097,728 bytes each (bf16, tp 1)."""
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a mapping, got {type(config).__name__}")
    cfg = _text_config(config)
    num_layers = _field(cfg, "num_hidden_layers", "the layer count")
    dtype = _dtype(cfg)
    if cfg.get("linear_attn_config") is not None:
        attn, state, spec = _kda(cfg, num_layers, dtype)
    elif cfg.get("hybrid_override_pattern") is not None:
        attn, state, spec = _nemotron_h(cfg, num_layers, dtype)
    elif cfg.get("linear_num_value_heads") is not None or "linear_attention" in (cfg.get("layer_types") or ()):
        attn, state, spec = _gated_deltanet(cfg, num_layers, dtype)
    elif is_hybrid_state_config(cfg):
        attn, state, spec = _mamba(cfg, num_layers, dtype)
    else:
        raise ValueError("config has no recurrent-state layers (no linear_attn_config, "
                         "hybrid_override_pattern, linear_num_value_heads or mamba_* fields)")
    if attn < 1:
        raise ValueError("config has no attention layer: a hybrid needs at least one")
    if state < 1:
        raise ValueError("config has no recurrent-state layer")
    name = name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "config")
    if spec.kind == "kda" or cfg.get("kv_lora_rank") is not None:
        return HybridModel(name, attn, state, spec, dtype,
                           kv_lora_rank=_field(cfg, "kv_lora_rank", "the MLA latent rank"),
                           qk_rope_head_dim=_field(cfg, "qk_rope_head_dim", "the MLA rotary key dim"),
                           source=source)
    heads = _field(cfg, "num_attention_heads", "attention heads")
    kv_heads = _field(cfg, "num_key_value_heads", "attention KV heads")
    head_dim = (_field(cfg, "head_dim", "attention head dim") if cfg.get("head_dim") is not None
                else _field(cfg, "hidden_size", "attention head dim = hidden_size / heads") // heads)
    return HybridModel(name, attn, state, spec, dtype, num_kv_heads=kv_heads, head_dim=head_dim,
                       source=source)


# ---- built-ins: each config's fields as published with the weights ------------------------------

# Where each built-in's fields were read (the Hugging Face model id, and the copy consulted).
HYBRID_SOURCES: dict[str, str] = {
    "Qwen3-Next-80B-A3B": (
        "Qwen/Qwen3-Next-80B-A3B-Instruct config.json (fields as in the model card: 48 layers, "
        "12 x (3 gated DeltaNet + 1 gated attention), 16 Q / 2 KV heads of 256, gated DeltaNet "
        "32 V / 16 QK heads of 128; conv kernel 4 and dtype from configs of the same architecture)"),
    "Qwen3.5-9B": "Qwen/Qwen3.5-9B config.json, text_config (mamba_ssm_dtype float32)",
    "Nemotron-Nano-9B-v2": "nvidia/NVIDIA-Nemotron-Nano-9B-v2 config.json",
    "Granite-4.0-H-Small": (
        "ibm-granite/granite-4.0-h-small config.json (36 mamba + 4 attention layers, counted; the "
        "order listed here is not the checkpoint's and does not change any size; mamba_n_heads "
        "128 and mamba_d_head 64 = 8,192 / 128 read from the checkpoint's GGUF metadata: ssm "
        "time_step_rank 128, inner_size 8,192, group_count 1)"),
    "Jamba-v0.1": "ai21labs/Jamba-v0.1 config.json",
    "Kimi-Linear-48B-A3B": "moonshotai/Kimi-Linear-48B-A3B-Instruct config.json",
}

_QWEN3_NEXT_TYPES = (["linear_attention"] * 3 + ["full_attention"]) * 12

_HYBRID_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3-Next-80B-A3B": dict(
        model_type="qwen3_next", num_hidden_layers=48, hidden_size=2048, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, full_attention_interval=4, layer_types=_QWEN3_NEXT_TYPES,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_value_head_dim=128, torch_dtype="bfloat16"),
    "Qwen3.5-9B": dict(model_type="qwen3_5", torch_dtype="bfloat16", text_config=dict(
        model_type="qwen3_5_text", num_hidden_layers=32, hidden_size=4096, num_attention_heads=16,
        num_key_value_heads=4, head_dim=256, full_attention_interval=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_value_head_dim=128, mamba_ssm_dtype="float32")),
    "Nemotron-Nano-9B-v2": dict(
        model_type="nemotron_h", num_hidden_layers=56, hidden_size=4480, num_attention_heads=40,
        num_key_value_heads=8, head_dim=128,
        hybrid_override_pattern="M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
        mamba_num_heads=128, mamba_head_dim=80, n_groups=8, ssm_state_size=128, conv_kernel=4,
        torch_dtype="bfloat16"),
    "Granite-4.0-H-Small": dict(
        model_type="granitemoehybrid", num_hidden_layers=40, hidden_size=4096, num_attention_heads=32,
        num_key_value_heads=8, layers_block_type=["mamba"] * 36 + ["attention"] * 4,
        mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, mamba_n_groups=1, mamba_n_heads=128,
        mamba_d_head=64, torch_dtype="bfloat16"),
    "Jamba-v0.1": dict(
        model_type="jamba", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
        num_key_value_heads=8, attn_layer_period=8, attn_layer_offset=4, mamba_d_conv=4,
        mamba_d_state=16, mamba_expand=2, torch_dtype="bfloat16"),
    "Kimi-Linear-48B-A3B": dict(
        model_type="kimi_linear", num_hidden_layers=27, hidden_size=2304, num_attention_heads=32,
        num_key_value_heads=32, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, torch_dtype="bfloat16", linear_attn_config=dict(
            full_attn_layers=[4, 8, 12, 16, 20, 24, 27], head_dim=128, num_heads=32,
            short_conv_kernel_size=4,
            kda_layers=[1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26])),
}


def builtin_hybrids() -> dict[str, HybridModel]:
    """The built-in recurrent-state hybrids, each parsed from its config fields."""
    return {n: hybrid_from_config(c, name=n, source=HYBRID_SOURCES[n]) for n, c in _HYBRID_CONFIGS.items()}


def get_hybrid(name: str) -> HybridModel | None:
    """A built-in hybrid by name, case-insensitively, or None when there is none of that name."""
    if not isinstance(name, str):
        raise ValueError(f"model name must be a string, got {name!r}")
    for known, cfg in _HYBRID_CONFIGS.items():
        if known.lower() == name.strip().lower():
            return hybrid_from_config(cfg, name=known, source=HYBRID_SOURCES[known])
    return None


# ---- vLLM's page rule ---------------------------------------------------------------------------


def vllm_kernel_alignment(model: HybridModel) -> int:
    """The attention kernel's block alignment vLLM rounds to: 16 (FlashAttention, FlashInfer) or,
    for MLA, 64 (128 with ``VLLM_ATTENTION_BACKEND=CUTLASS_MLA``); Blackwell with head size 256 and
    FlashInfer needs 32. Current vLLM asks the backend (``get_supported_kernel_block_sizes``); these
    are the values its explicit rule gave, the ones modelled here."""
    return 64 if model.is_mla else 16


def vllm_attention_block_size(state_page_bytes: int, attn_bytes_per_token: int, *, alignment: int = 16,
                              block_size: int = 16, prefix_chunk: int | None = None) -> int:
    """The attention block size vLLM forces on a hybrid so that one attention page (one layer,
    ``block`` tokens) holds at least one state page (one layer's state).

    As written in vLLM (``Platform._align_hybrid_block_size`` in ``vllm/platforms/interface.py``;
    earlier ``HybridAttentionMambaModelConfig.verify_and_update_config`` in
    ``vllm/model_executor/models/config.py``): the alignment is ``max(kernel alignment,
    block_size)``; without Mamba prefix caching the block is ``alignment x ceil(state /
    (alignment x attention bytes per token))``; with it (``mamba_cache_mode == "all"``) the
    alignment becomes ``lcm(chunk, alignment)`` (``chunk``: the user's ``mamba_block_size`` or the
    model's Mamba chunk size) and the block ``chunk' x ceil(ceil(state / per token) / chunk')``.
    vLLM keeps a user's block size when it is already larger. The state page is then padded to the
    attention page (``mamba_page_size_padded``).

    Example (Qwen3-Next-80B-A3B, tp 1, bf16): 16 x ceil(1,097,728 / (16 x 2,048)) = 16 x 34 = 544
    tokens, an attention page of 544 x 2,048 = 1,114,112 bytes; the state is padded by 1.49%.
    The plain formula 16 x ceil(state / (16 x bytes per token)) is vLLM's rule wherever the
    alignment is 16 and Mamba prefix caching is off; they part when the kernel aligns to more
    (MLA: 64), when a larger block size is configured (it becomes the alignment) and in mode
    "all" (the chunk rounding above).
    """
    state = int_at_least("state_page_bytes", state_page_bytes, 1)
    per_token = int_at_least("attn_bytes_per_token", attn_bytes_per_token, 1)
    align = max(int_at_least("alignment", alignment, 1), int_at_least("block_size", block_size, 1))
    if prefix_chunk is None:
        block = align * math.ceil(state / (align * per_token))
    else:
        chunk = math.lcm(int_at_least("prefix_chunk", prefix_chunk, 1), align)
        block = chunk * math.ceil(math.ceil(state / per_token) / chunk)
    return max(block, block_size)


@dataclass(frozen=True)
class HybridSizing:
    """A hybrid's bytes on one GPU, and what vLLM's page rule makes of them.

    ``vllm_group_layers``: the layers per KV cache group vLLM builds (every group's page equal,
    :func:`~pagedkv.sim.sizing.uniform_page_group_size`); ``vllm_attention_groups`` and
    ``vllm_state_groups``: how many groups of each kind (the last of a kind padded with empty
    layer slots, ``vllm_padding_layers`` in all)."""

    model: str
    tp: int
    attention_layers: int
    state_layers: int
    attention_bytes_per_token_layer: int
    state_bytes_per_layer: int
    conv_bytes_per_layer: int
    temporal_bytes_per_layer: int
    vllm_block_size: int
    vllm_group_layers: int
    vllm_attention_groups: int
    vllm_state_groups: int

    @property
    def attention_bytes_per_token(self) -> int:
        return self.attention_bytes_per_token_layer * self.attention_layers

    @property
    def state_bytes_per_sequence(self) -> int:
        return self.state_bytes_per_layer * self.state_layers

    @property
    def vllm_page_bytes(self) -> int:
        """One layer's page under vLLM's rule: block x attention bytes per token (the padded state)."""
        return self.vllm_block_size * self.attention_bytes_per_token_layer

    @property
    def vllm_state_padding(self) -> float:
        """The share by which vLLM pads each state page (Qwen3-Next: 16,384 / 1,097,728 = 1.49%)."""
        return self.vllm_page_bytes / self.state_bytes_per_layer - 1

    @property
    def vllm_padding_layers(self) -> int:
        g = self.vllm_group_layers
        return (self.vllm_attention_groups * g - self.attention_layers) + (self.vllm_state_groups * g - self.state_layers)

    def fragmentation_slots(self, block_size: int) -> float:
        """Empty token slots a sequence's last block holds on average: (block - 1) / 2."""
        return (int_at_least("block_size", block_size, 1) - 1) / 2

    def fragmentation_bytes(self, block_size: int) -> float:
        """Those empty slots in bytes, over every attention layer (Qwen3-Next, block 544: 271.5 x
        12 x 2,048 = 6,672,384 bytes per sequence; block 16: 184,320)."""
        return self.fragmentation_slots(block_size) * self.attention_bytes_per_token

    def vllm_requests_fit(self, budget_bytes: int, context: int) -> int:
        """Requests of ``context`` tokens that fit in ``budget_bytes`` under vLLM's layout: a pool of
        blocks of ``group`` layer pages; each request holds ceil(context / block) blocks per
        attention group and one per state group."""
        budget, context = int_at_least("budget_bytes", budget_bytes, 1), int_at_least("context", context, 1)
        blocks = budget // (self.vllm_page_bytes * self.vllm_group_layers)
        need = self.vllm_attention_groups * math.ceil(context / self.vllm_block_size) + self.vllm_state_groups
        return blocks // need

    def small_page_bytes(self, block_size: int = 16) -> int:
        """A small page: ``block_size`` tokens of every attention layer (one attention group)."""
        return int_at_least("block_size", block_size, 1) * self.attention_bytes_per_token

    def state_pages(self, block_size: int = 16) -> int:
        """Small pages one sequence's states take: ceil(state bytes per sequence / page bytes)."""
        return math.ceil(self.state_bytes_per_sequence / self.small_page_bytes(block_size))

    def small_page_requests_fit(self, budget_bytes: int, context: int, block_size: int = 16) -> int:
        """Requests of ``context`` tokens that fit in one pool of small pages, each request holding
        ceil(context / block) attention pages and :meth:`state_pages` for its states."""
        budget, context = int_at_least("budget_bytes", budget_bytes, 1), int_at_least("context", context, 1)
        pages = budget // self.small_page_bytes(block_size)
        return pages // (math.ceil(context / block_size) + self.state_pages(block_size))


def hybrid_sizing(model: HybridModel, *, tp: int = 1, dtype: str | None = None, block_size: int = 16,
                  alignment: int | None = None) -> HybridSizing:
    """Everything :class:`HybridSizing` holds for ``model`` on one of ``tp`` GPUs. ``dtype``
    overrides the attention K/V dtype only (vLLM's ``--kv-cache-dtype``; states keep theirs);
    ``block_size`` is the block size asked for before vLLM's rule raises it."""
    if not isinstance(model, HybridModel):
        raise ValueError(f"model must be a HybridModel, got {type(model).__name__}")
    tp = int_at_least("tp", tp, 1)
    attn = model.attention_bytes_per_token_layer(tp, dtype)
    state = model.state.bytes(tp)
    align = vllm_kernel_alignment(model) if alignment is None else int_at_least("alignment", alignment, 1)
    block = vllm_attention_block_size(state, attn, alignment=align, block_size=block_size)
    group = uniform_page_group_size([model.attention_layers, model.state_layers])
    return HybridSizing(model.name, tp, model.attention_layers, model.state_layers, attn, state,
                        model.state.conv_bytes(tp), model.state.temporal_bytes(tp), block, group,
                        math.ceil(model.attention_layers / group), math.ceil(model.state_layers / group))
