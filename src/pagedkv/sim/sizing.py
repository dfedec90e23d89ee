"""How many bytes one token's keys and values take, and how many tokens fit on a GPU.

Every number here is computed from a model's architecture (the fields of its Hugging Face
``config.json``), never typed in as a byte total. The formulas:

- multi-head / grouped-query / multi-query attention (MHA, GQA, MQA) store a key and a value
  vector per KV head per layer::

      bytes/token = 2 x layers x kv_heads x head_dim x dtype_bytes

  Llama-3.1-8B (32 layers, 8 KV heads of 128, bf16): 2 x 32 x 8 x 128 x 2 = 131,072 (128 KiB).
- multi-head latent attention (MLA, DeepSeek-V2/V3) caches one compressed latent per layer, shared
  by all heads: ``kv_lora_rank`` for the keys and values plus ``qk_rope_head_dim`` for the decoupled
  rotary key::

      bytes/token = layers x (kv_lora_rank + qk_rope_head_dim) x dtype_bytes

  DeepSeek-V3: 61 x (512 + 64) x 2 = 70,272.

Hybrid models keep a spec per layer (``layer_attention``, read from ``layer_types``,
``sliding_window``, ``sliding_window_pattern``, ``attention_chunk_size`` and ``no_rope_layers``):
a sliding-window or chunked-local layer holds only the blocks its next query reads. gpt-oss-20b at
4,096 tokens (block size 16): 12 full layers hold 256 blocks each, 12 sliding layers (W = 128) hold
9, so a grouped allocator stores (12 x 256 + 12 x 9) / (24 x 256) = 51.8% of what a uniform one
does (:func:`request_kv_bytes`).

Tensor parallelism splits KV heads across GPUs: each GPU holds ``ceil(kv_heads / tp)`` heads, so
when ``tp > kv_heads`` every GPU holds one head (the heads are replicated) and the total over all
GPUs exceeds the unsharded size. MLA's latent belongs to no head, so every GPU holds all of it.

A GPU's KV budget is what vLLM reserves: ``gpu_memory x utilisation - weights`` (activations and
the CUDA context come out of the ``1 - utilisation`` margin). Blocks = floor(budget / block bytes).
Worked number (vLLM paper, Table 1): OPT-13B has 819,200 bytes/token; 12 GiB of KV holds
12 x 2**30 / 819,200 = 15,728 token slots, the paper's "15.7K" (with 10**9-byte GB it would be
14,648, so the paper's GB is GiB).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..checks import int_at_least, number_at_least
from ..kv_specs import AttentionSpec, ChunkedLocalAttention, FullAttention, SlidingWindow

__all__ = [
    "ModelSpec",
    "KVSize",
    "Capacity",
    "GIB",
    "MAX_MEMORY_GIB",
    "DTYPE_BYTES",
    "dtype_bytes",
    "spec_from_config",
    "load_config",
    "builtin_models",
    "get_model",
    "kv_size",
    "kv_bytes_per_token",
    "kv_budget_bytes",
    "fit_blocks",
    "estimate_weight_bytes",
    "estimate_mxfp4_moe_weight_bytes",
    "layer_attention_from_config",
    "attention_groups",
    "GroupKV",
    "group_kv",
    "request_kv_bytes",
    "EqualPageGroup",
    "equal_page_groups",
    "uniform_page_group_size",
]

GIB = 1 << 30  # bytes in a GiB; the vLLM paper's "GB" (see the module docstring)
# Memory sizes above 1 PiB are refused: no device has them, so they are typos (1e30, 1e300 GiB
# would otherwise become astronomically many blocks, or overflow a float).
MAX_MEMORY_GIB = float(1 << 20)

# Bytes per element of the KV cache for each dtype name a config or a user may give.
DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "double": 8, "fp64": 8,
    "float32": 4, "float": 4, "fp32": 4,
    "float16": 2, "half": 2, "fp16": 2,
    "bfloat16": 2, "bf16": 2,
    "float8": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "int8": 1, "uint8": 1,
}


def dtype_bytes(name: str) -> int:
    """Bytes per element for a dtype name (``"bfloat16"``, ``"torch.float16"``, ``"fp8"`` ...).

    Example: ``dtype_bytes("torch.bfloat16") == 2``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"dtype must be a non-empty string, got {name!r}")
    key = name.strip().lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[key]


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts that decide KV size (a subset of a ``config.json``).

    ``kv_lora_rank``/``qk_rope_head_dim`` are set only for MLA models. ``max_context`` is the
    longest sequence the model was trained for (``max_position_embeddings``; None when the config
    does not say): a serving command's default context limit. ``vocab_size``,
    ``intermediate_size`` and ``tie_word_embeddings`` are kept only to estimate the weights of dense
    models (``estimate_weight_bytes``); they do not enter the KV size.
    """

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    dtype: str = "bfloat16"
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    vocab_size: int | None = None
    intermediate_size: int | None = None
    tie_word_embeddings: bool = False
    gated_mlp: bool = True
    dense: bool = True
    num_experts: int = 0  # routed experts per MoE layer (0: a dense model)
    # One attention spec per layer (hybrid models); empty means every layer is full attention.
    layer_attention: tuple = ()
    max_context: int | None = None

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "hidden_size"):
            value = getattr(self, field_name)
            int_at_least(f"{self.name}: {field_name}", value, 1, expected="a positive int")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: {self.num_attention_heads} attention heads are not a "
                             f"multiple of {self.num_kv_heads} KV heads")
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError(f"{self.name}: MLA needs both kv_lora_rank and qk_rope_head_dim")
        if self.is_mla and (self.kv_lora_rank < 1 or self.qk_rope_head_dim < 0):
            raise ValueError(f"{self.name}: kv_lora_rank must be >= 1 and qk_rope_head_dim >= 0")
        dtype_bytes(self.dtype)
        if self.max_context is not None:
            int_at_least(f"{self.name}: max_context", self.max_context, 1, expected="a positive int")
        if self.layer_attention:
            if len(self.layer_attention) != self.num_layers:
                raise ValueError(f"{self.name}: {len(self.layer_attention)} layer attention specs for "
                                 f"{self.num_layers} layers")
            if not all(isinstance(a, AttentionSpec) for a in self.layer_attention):
                raise ValueError(f"{self.name}: layer_attention must hold attention specs")

    @property
    def is_hybrid(self) -> bool:
        """Whether some layer attends to less than the whole context."""
        return any(not a.reads_whole_prefix for a in self.layer_attention)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def attention(self) -> str:
        """``"MLA"``, ``"MHA"`` (one KV head per query head), ``"MQA"`` (one KV head) or ``"GQA"``."""
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"


# ---- reading config.json ------------------------------------------------------------------------

_ALIASES = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"),
    "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size"),
}


def _first(cfg: Mapping[str, Any], field_name: str) -> Any:
    for k in _ALIASES[field_name]:
        if cfg.get(k) is not None:
            return cfg[k]
    return None


def _positive_field(cfg: Mapping[str, Any], field_name: str, value: Any) -> int:
    """A config field that must be a positive integer (``32`` or ``32.0``), by its config key."""
    key = next((k for k in _ALIASES.get(field_name, (field_name,)) if cfg.get(k) is not None), field_name)
    number = int(value) if isinstance(value, float) and value.is_integer() else value  # JSON's 32.0
    return int_at_least(f"config field {key}", number, 1, expected="a positive integer")


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a ``config.json`` file (a clear ValueError naming the file when it is missing, a
    directory, unreadable, not UTF-8 text or not a JSON object)."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"config file {p} is a directory, not a file")
    if not p.is_file():
        raise ValueError(f"config file {p} does not exist")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{p}: not a JSON text file (not UTF-8: binary?)") from None
    except OSError as e:
        raise ValueError(f"{p}: cannot read ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


# Per-model defaults transformers applies when a config leaves the pattern out.
_DEFAULT_SLIDING_PATTERN = {"gemma3": 6, "gemma3_text": 6, "cohere2": 4, "gpt_oss": 2, "gemma2": 2}
_LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked"}


def layer_attention_from_config(cfg: Mapping[str, Any], num_layers: int) -> tuple:
    """One attention spec per layer from a Hugging Face config's hybrid fields (empty: all full).

    Read as transformers reads them: ``layer_types`` when present (``"full_attention"``,
    ``"sliding_attention"`` with ``sliding_window``, ``"chunked_attention"`` with
    ``attention_chunk_size``); else ``sliding_window_pattern`` (layer i slides unless
    ``(i + 1) % pattern == 0``; Gemma 3's default 6, Cohere2's 4, gpt-oss's 2); else Llama 4's
    ``no_rope_layers`` / ``no_rope_layer_interval`` (RoPE layers are chunked, every fourth is a
    global NoPE layer) with ``attention_chunk_size``; else a bare ``sliding_window`` (Mistral
    style, every layer; ignored when ``use_sliding_window`` is false, as Qwen2 sets it). Example:
    gpt-oss-20b's 24 layers -> sliding (128), full, sliding, full, ...
    """
    model_type = str(cfg.get("model_type", ""))
    window = cfg.get("sliding_window")
    chunk = cfg.get("attention_chunk_size")
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern", _DEFAULT_SLIDING_PATTERN.get(model_type))
        if model_type.startswith("llama4") and chunk is not None:
            nope = cfg.get("no_rope_layers") or [
                int((i + 1) % int(cfg.get("no_rope_layer_interval", 4)) != 0) for i in range(num_layers)]
            types = ["chunked_attention" if r else "full_attention" for r in nope]
        elif window is not None and pattern is not None:
            pattern = _positive_field(cfg, "sliding_window_pattern", pattern)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        elif window is not None and cfg.get("use_sliding_window", True):
            types = ["sliding_attention"] * num_layers
        else:
            return ()
    if not isinstance(types, (list, tuple)) or len(types) != num_layers:
        raise ValueError(f"config field layer_types must list one type per layer ({num_layers}), got {types!r}")
    specs = []
    for i, t in enumerate(types):
        kind = _LAYER_KINDS.get(t)
        if kind is None:
            raise ValueError(f"layer_types[{i}] = {t!r}: pagedkv knows {', '.join(_LAYER_KINDS)} "
                             "(linear attention and state-space layers are not KV-cache layers)")
        if kind == "full":
            specs.append(FullAttention())
        elif kind == "sliding":
            specs.append(SlidingWindow(_positive_field(cfg, "sliding_window", window)))
        else:
            specs.append(ChunkedLocalAttention(_positive_field(cfg, "attention_chunk_size", chunk)))
    return tuple(specs) if any(not a.reads_whole_prefix for a in specs) else ()


def spec_from_config(config: Mapping[str, Any] | str | Path, name: str | None = None) -> ModelSpec:
    """Build a :class:`ModelSpec` from a Hugging Face config (dict, or path to ``config.json``).

    Handles the field spellings of Llama/Mistral/Qwen (``num_key_value_heads``), GPT-2/Falcon
    (``n_layer``, ``n_head_kv``, ``multi_query``), OPT (``ffn_dim``), DeepSeek (``kv_lora_rank``) and
    multimodal wrappers (``text_config``). ``head_dim`` is used when present, else
    ``hidden_size // num_attention_heads``; no KV-head field means MHA.
    Example: ``{"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_size": 4096, "torch_dtype": "bfloat16"}`` -> 131,072 bytes per token.
    """
    if isinstance(config, (str, Path)):
        name = name or Path(config).parent.name or Path(config).stem
        config = load_config(config)
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a mapping or a path, got {type(config).__name__}")
    cfg = dict(config)
    if _first(cfg, "num_layers") is None and isinstance(cfg.get("text_config"), Mapping):
        outer_dtype = cfg.get("torch_dtype") or cfg.get("dtype")
        cfg = {"torch_dtype": outer_dtype, **cfg["text_config"]}
    missing = [f for f in ("num_layers", "num_attention_heads", "hidden_size") if _first(cfg, f) is None]
    if missing:
        raise ValueError(f"config lacks {', '.join(missing)} (looked for {[_ALIASES[m] for m in missing]})")
    heads = _positive_field(cfg, "num_attention_heads", _first(cfg, "num_attention_heads"))
    hidden = _positive_field(cfg, "hidden_size", _first(cfg, "hidden_size"))
    _positive_field(cfg, "num_layers", _first(cfg, "num_layers"))
    kv_heads = _first(cfg, "num_kv_heads")
    if kv_heads is None:
        kv_heads = 1 if cfg.get("multi_query") else heads
    kv_heads = _positive_field(cfg, "num_kv_heads", kv_heads)
    head_dim = cfg.get("head_dim")
    if head_dim is not None:
        head_dim = _positive_field(cfg, "head_dim", head_dim)
    elif hidden % heads:
        raise ValueError(f"hidden_size {hidden} is not divisible by {heads} heads and no head_dim given")
    else:
        head_dim = hidden // heads
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float16"
    mla = cfg.get("kv_lora_rank") is not None
    model_type = str(cfg.get("model_type", ""))
    num_layers = int(_first(cfg, "num_layers"))
    return ModelSpec(
        name=name or cfg.get("_name_or_path") or model_type or "config",
        num_layers=num_layers,
        num_attention_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        hidden_size=hidden,
        dtype=str(dtype),
        kv_lora_rank=int(cfg["kv_lora_rank"]) if mla else None,
        qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0) if mla else None,
        vocab_size=cfg.get("vocab_size"),
        intermediate_size=_first(cfg, "intermediate_size"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "opt")),
        gated_mlp=model_type not in ("opt", "gpt2", "gptj", "gpt_neox", "falcon", "bloom"),
        dense=not (cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts")),
        num_experts=int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0),
        layer_attention=layer_attention_from_config(cfg, num_layers),
        max_context=(_positive_field(cfg, "max_position_embeddings", cfg["max_position_embeddings"])
                     if cfg.get("max_position_embeddings") is not None else None),
    )


# ---- the built-in table: config.json fields of common models (architecture facts, not bytes) ---

_BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "Llama-3.1-8B": dict(model_type="llama", num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, hidden_size=4096, intermediate_size=14336,
                         vocab_size=128256, max_position_embeddings=131072, torch_dtype="bfloat16"),
    "Llama-3.1-70B": dict(model_type="llama", num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, hidden_size=8192, intermediate_size=28672,
                          vocab_size=128256, max_position_embeddings=131072, torch_dtype="bfloat16"),
    "Llama-2-7B": dict(model_type="llama", num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, hidden_size=4096, intermediate_size=11008,
                       vocab_size=32000, max_position_embeddings=4096, torch_dtype="float16"),
    "Mistral-7B": dict(model_type="mistral", num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, hidden_size=4096, intermediate_size=14336,
                       vocab_size=32000, max_position_embeddings=32768, torch_dtype="bfloat16"),
    "Qwen2.5-7B": dict(model_type="qwen2", num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, hidden_size=3584, intermediate_size=18944,
                       vocab_size=152064, max_position_embeddings=131072, torch_dtype="bfloat16"),
    "DeepSeek-V3": dict(model_type="deepseek_v3", num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, hidden_size=7168, kv_lora_rank=512,
                        q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                        intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
                        vocab_size=129280, max_position_embeddings=163840, torch_dtype="bfloat16"),
    "OPT-13B": dict(model_type="opt", num_hidden_layers=40, num_attention_heads=40,
                    hidden_size=5120, ffn_dim=20480, vocab_size=50272, max_position_embeddings=2048,
                    torch_dtype="float16"),
    # Hybrid models: their configs' attention fields, as published with the weights.
    "gpt-oss-20b": dict(model_type="gpt_oss", num_hidden_layers=24, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=64, hidden_size=2880, intermediate_size=2880,
                        num_local_experts=32, sliding_window=128, vocab_size=201088,
                        max_position_embeddings=131072, torch_dtype="bfloat16"),
    "gpt-oss-120b": dict(model_type="gpt_oss", num_hidden_layers=36, num_attention_heads=64,
                         num_key_value_heads=8, head_dim=64, hidden_size=2880, intermediate_size=2880,
                         num_local_experts=128, sliding_window=128, vocab_size=201088,
                         max_position_embeddings=131072, torch_dtype="bfloat16"),
    "Gemma-3-4B": dict(model_type="gemma3", torch_dtype="bfloat16", text_config=dict(
        model_type="gemma3_text", num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
        head_dim=256, hidden_size=2560, intermediate_size=10240, sliding_window=1024,
        sliding_window_pattern=6, max_position_embeddings=131072, vocab_size=262208)),
    "Gemma-3-12B": dict(model_type="gemma3", torch_dtype="bfloat16", text_config=dict(
        model_type="gemma3_text", num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8,
        head_dim=256, hidden_size=3840, intermediate_size=15360, sliding_window=1024,
        sliding_window_pattern=6, max_position_embeddings=131072, vocab_size=262208)),
    "Gemma-3-27B": dict(model_type="gemma3", torch_dtype="bfloat16", text_config=dict(
        model_type="gemma3_text", num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
        head_dim=128, hidden_size=5376, intermediate_size=21504, sliding_window=1024,
        sliding_window_pattern=6, max_position_embeddings=131072, vocab_size=262208)),
    "Llama-4-Scout": dict(model_type="llama4", torch_dtype="bfloat16", text_config=dict(
        model_type="llama4_text", num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
        head_dim=128, hidden_size=5120, intermediate_size=8192, num_local_experts=16,
        attention_chunk_size=8192, no_rope_layer_interval=4, max_position_embeddings=10485760,
        vocab_size=202048)),
    "Command-R7B": dict(model_type="cohere2", num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, hidden_size=4096, intermediate_size=14336,
                        sliding_window=4096, sliding_window_pattern=4, vocab_size=256000,
                        max_position_embeddings=131072, torch_dtype="bfloat16"),
}


def builtin_models() -> dict[str, ModelSpec]:
    """The built-in models, each parsed from its config fields by :func:`spec_from_config`."""
    return {name: spec_from_config(cfg, name=name) for name, cfg in _BUILTIN_CONFIGS.items()}


def get_model(name: str) -> ModelSpec:
    """A built-in model by name, case-insensitively (``"llama-3.1-8b"`` works)."""
    if not isinstance(name, str):
        raise ValueError(f"model name must be a string, got {name!r}")
    for known, cfg in _BUILTIN_CONFIGS.items():
        if known.lower() == name.strip().lower():
            return spec_from_config(cfg, name=known)
    raise ValueError(f"unknown model {name!r}; built-in: {', '.join(_BUILTIN_CONFIGS)} "
                     "(or pass a config.json)")


# ---- KV size ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVSize:
    """KV bytes of one model under one dtype and tensor-parallel degree.

    ``bytes_per_token`` is what one GPU stores per token (its shard); ``bytes_per_token_total`` sums
    all ``tp`` GPUs (larger than the unsharded size when heads are replicated, or for MLA).
    """

    model: str
    attention: str
    dtype: str
    tp: int
    kv_heads_per_gpu: int  # 0 for MLA (no heads in the cache)
    elems_per_token_layer: int  # cached elements per token per layer per GPU
    bytes_per_token: int
    bytes_per_token_total: int
    block_size: int
    bytes_per_block: int


def kv_size(spec: ModelSpec, *, dtype: str | None = None, tp: int = 1, block_size: int = 16) -> KVSize:
    """Per-token and per-block KV bytes of ``spec`` on one of ``tp`` GPUs.

    ``dtype`` overrides the model's own (e.g. ``"fp8"`` for an fp8 KV cache). Example: Llama-3.1-70B
    at tp=8 keeps 1 of 8 KV heads per GPU: 2 x 80 x 1 x 128 x 2 = 40,960 bytes per token per GPU;
    at tp=16 each head is stored twice and the per-GPU size stays 40,960.
    """
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    tp = int_at_least("tp", tp, 1)
    block_size = int_at_least("block_size", block_size, 1)
    dt = dtype if dtype is not None else spec.dtype
    nbytes = dtype_bytes(dt)
    if spec.is_mla:
        heads_per_gpu = 0
        elems = spec.kv_lora_rank + spec.qk_rope_head_dim
    else:
        heads_per_gpu = math.ceil(spec.num_kv_heads / tp)
        elems = 2 * heads_per_gpu * spec.head_dim
    per_token = spec.num_layers * elems * nbytes
    return KVSize(
        model=spec.name, attention=spec.attention, dtype=dt.removeprefix("torch."), tp=tp,
        kv_heads_per_gpu=heads_per_gpu, elems_per_token_layer=elems,
        bytes_per_token=per_token, bytes_per_token_total=per_token * tp,
        block_size=block_size, bytes_per_block=per_token * block_size,
    )


def kv_bytes_per_token(model: ModelSpec | str | Mapping[str, Any], *, dtype: str | None = None, tp: int = 1) -> int:
    """Shortcut: KV bytes per token on one GPU for a built-in name, a config dict or a spec."""
    if isinstance(model, str):
        spec = get_model(model)
    elif isinstance(model, Mapping):
        spec = spec_from_config(model)
    else:
        spec = model
    return kv_size(spec, dtype=dtype, tp=tp).bytes_per_token


# ---- capacity -----------------------------------------------------------------------------------


def estimate_weight_bytes(spec: ModelSpec, *, dtype: str | None = None, tp: int = 1) -> int | None:
    """Rough weight bytes per GPU of a dense decoder (``None`` for MoE or when fields are missing).

    Counts embeddings (twice unless tied), attention projections (q and o: hidden x heads x head_dim;
    k and v: hidden x kv_heads x head_dim) and the MLP (3 matrices when gated, 2 otherwise); biases
    and norms are ignored (< 0.1%). Llama-3.1-8B: 8.03e9 parameters -> 16.06e9 bytes in bf16.
    """
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    tp = int_at_least("tp", tp, 1)
    if spec.is_mla or not spec.dense or not spec.vocab_size or not spec.intermediate_size:
        return None
    h, d = spec.hidden_size, spec.head_dim
    attn = h * d * (2 * spec.num_attention_heads + 2 * spec.num_kv_heads)
    mlp = (3 if spec.gated_mlp else 2) * h * spec.intermediate_size
    emb = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    params = spec.num_layers * (attn + mlp) + emb
    return math.ceil(params * dtype_bytes(dtype or spec.dtype) / tp)


MXFP4_BITS = 4.25  # a 4-bit weight plus its share of one 8-bit scale per 32 weights


def estimate_mxfp4_moe_weight_bytes(spec: ModelSpec) -> int | None:
    """Weight bytes of a model whose every layer is a mixture of experts stored in MXFP4, the
    rest (attention, router, embeddings) in the model's dtype: gpt-oss, as published. ``None``
    for a dense model or one with missing fields.

    Each expert is a gated MLP of ``intermediate_size``; experts are the bulk. gpt-oss-20b: 24
    layers x 32 experts x 3 x 2,880 x 2,880 = 19.1e9 expert weights at 4.25 bits (10.15e9 bytes),
    plus 0.64e9 attention, 2.2e6 router and 1.16e9 embedding weights in bf16 (3.59e9 bytes):
    13.74e9 bytes, 12.8 GiB (its published checkpoint is 13.8 GB).
    """
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    if spec.is_mla or spec.dense or not spec.num_experts or not spec.vocab_size or not spec.intermediate_size:
        return None
    h, d = spec.hidden_size, spec.head_dim
    attn = h * d * (2 * spec.num_attention_heads + 2 * spec.num_kv_heads)
    experts = spec.num_experts * 3 * h * spec.intermediate_size
    router = h * spec.num_experts
    emb = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    dense_params = spec.num_layers * (attn + router) + emb
    return math.ceil(dense_params * dtype_bytes(spec.dtype) + spec.num_layers * experts * MXFP4_BITS / 8)


@dataclass(frozen=True)
class Capacity:
    """What fits in a KV budget: whole blocks, and the token slots they hold."""

    kv_budget_bytes: int
    bytes_per_block: int
    num_blocks: int
    token_slots: int


def _check_gib(name: str, value: Any, zero_ok: bool) -> None:
    expected = f"a finite number {'>=' if zero_ok else '>'} 0 and at most {MAX_MEMORY_GIB:,.0f} GiB (1 PiB)"
    if number_at_least(name, value, 0.0, strict=not zero_ok, expected=expected) > MAX_MEMORY_GIB:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def kv_budget_bytes(gpu_mem_gib: float, util: float, weights_gib: float) -> int:
    """``gpu_mem x util - weights`` in bytes (GiB inputs). 80 GiB x 0.9 - 16 GiB = 56 GiB.

    Memory sizes above ``MAX_MEMORY_GIB`` (1 PiB) are refused as typos."""
    for name, v in (("gpu_mem_gib", gpu_mem_gib), ("weights_gib", weights_gib)):
        _check_gib(name, v, zero_ok=True)
    if number_at_least("util", util, 0.0, strict=True, expected="in (0, 1]") > 1:
        raise ValueError(f"util must be in (0, 1], got {util!r}")
    budget = gpu_mem_gib * util - weights_gib
    if budget <= 0:
        raise ValueError(f"no memory left for KV: {gpu_mem_gib} GiB x {util} - {weights_gib} GiB "
                         f"weights = {budget:.3g} GiB")
    return int(budget * GIB)


def fit_blocks(size: KVSize, *, kv_budget_gib: float | None = None, gpu_mem_gib: float | None = None,
               util: float = 0.9, weights_gib: float | None = None) -> Capacity:
    """How many blocks and token slots of ``size`` fit, from a KV budget or from a GPU's memory.

    Give either ``kv_budget_gib`` or ``gpu_mem_gib`` and ``weights_gib``. Example: OPT-13B, block
    size 16, 12 GiB of KV -> floor(12 x 2**30 / (819,200 x 16)) = 983 blocks = 15,728 token slots.
    """
    if not isinstance(size, KVSize):
        raise ValueError(f"size must be a KVSize, got {type(size).__name__}")
    if kv_budget_gib is not None:
        if gpu_mem_gib is not None:
            raise ValueError("give kv_budget_gib or gpu_mem_gib, not both")
        _check_gib("kv_budget_gib", kv_budget_gib, zero_ok=False)
        budget = int(kv_budget_gib * GIB)
    elif gpu_mem_gib is not None:
        if weights_gib is None:
            raise ValueError("gpu_mem_gib needs weights_gib (the model's weight memory per GPU)")
        budget = kv_budget_bytes(gpu_mem_gib, util, weights_gib)
    else:
        raise ValueError("give kv_budget_gib, or gpu_mem_gib with weights_gib")
    blocks = budget // size.bytes_per_block
    return Capacity(budget, size.bytes_per_block, blocks, blocks * size.block_size)


# ---- hybrid models: KV per attention group ------------------------------------------------------


def attention_groups(spec: ModelSpec) -> list[tuple[AttentionSpec, int]]:
    """The model's layers grouped by attention spec, in order of first appearance, with how many
    layers each group has. A uniform model is one group: ``[(FullAttention(), num_layers)]``.
    Example: Gemma 3 27B -> [(SlidingWindow(1024), 52), (FullAttention(), 10)]."""
    if not spec.layer_attention:
        return [(FullAttention(), spec.num_layers)]
    counts: dict[AttentionSpec, int] = {}
    for a in spec.layer_attention:
        counts[a] = counts.get(a, 0) + 1
    return list(counts.items())


@dataclass(frozen=True)
class GroupKV:
    """One attention group's KV on one GPU: its layers, bytes per token and per block, and the
    blocks and bytes one request of ``context`` tokens holds in it."""

    attention: AttentionSpec
    layers: int
    bytes_per_token: int
    bytes_per_block: int
    context: int
    blocks_held: int

    @property
    def bytes_held(self) -> int:
        return self.blocks_held * self.bytes_per_block


def group_kv(spec: ModelSpec, context: int, *, dtype: str | None = None, tp: int = 1,
             block_size: int = 16) -> list[GroupKV]:
    """Per attention group: bytes per token and per block, and what a request of ``context``
    tokens holds between steps once they are all computed (the blocks its last position read,
    :meth:`~pagedkv.kv_specs.AttentionSpec.blocks_held`). Example:
    gpt-oss-20b, 4,096 tokens, bf16, block size 16: the sliding group (12 layers x 2 x 8 heads x
    64 x 2 bytes = 24,576 bytes/token) holds 9 blocks, the full group 256."""
    context = int_at_least("context", context, 0)
    per_layer = kv_size(spec, dtype=dtype, tp=tp, block_size=block_size).bytes_per_token // spec.num_layers
    out = []
    for attention, layers in attention_groups(spec):
        per_token = per_layer * layers
        out.append(GroupKV(attention, layers, per_token, per_token * block_size, context,
                           attention.blocks_held(context, block_size)))
    return out


def request_kv_bytes(spec: ModelSpec, context: int, *, grouped: bool = True, dtype: str | None = None,
                     tp: int = 1, block_size: int = 16) -> int:
    """KV bytes one request of ``context`` tokens holds on one GPU: every layer keeps every block
    (``grouped=False``, a uniform allocator), or each group only the blocks it still reads.
    For a uniform model the two are equal."""
    groups = group_kv(spec, context, dtype=dtype, tp=tp, block_size=block_size)
    if grouped:
        return sum(g.bytes_held for g in groups)
    full_blocks = -(-context // block_size)
    return sum(g.bytes_per_block for g in groups) * full_blocks


@dataclass(frozen=True)
class EqualPageGroup:
    """One KV cache group of vLLM's equal-page layout: an attention spec, the real layers in it
    and the padding layers that make its page as large as every other group's."""

    attention: AttentionSpec
    layers: int
    padding: int


def uniform_page_group_size(layer_counts) -> int:
    """The layers per KV cache group vLLM builds when every group's page must have the same bytes
    (``_get_kv_cache_groups_uniform_page_size`` in ``vllm/v1/core/kv_cache_utils.py``): the fewest
    layers of any type, or the most when the most are under 1.5 times the fewest. Example: Gemma 3
    27B (52 sliding, 10 full) -> 10; Qwen3-Next (36 gated DeltaNet, 12 full) -> 12; gpt-oss
    (12, 12) -> 12."""
    counts = [int_at_least("layer count", n, 1) for n in layer_counts]
    if not counts:
        raise ValueError("layer_counts must name at least one layer type")
    fewest, most = min(counts), max(counts)
    return most if most < 1.5 * fewest else fewest


def equal_page_groups(spec: ModelSpec) -> list[EqualPageGroup]:
    """The KV cache groups vLLM v1 builds for a hybrid model so that every group's page has the
    same bytes (``_get_kv_cache_groups_uniform_page_size``): the group size is the fewest layers
    of any attention type (or the most, when the most are under 1.5 times the fewest); each
    type's layers are dealt into ``ceil(n / size)`` groups of that size, the last one padded.

    Example: Gemma 3 27B has 52 sliding and 10 full layers: groups of 10, the sliding layers in 6
    groups, the last holding 2 real layers and 8 padding ones. A block of a padded group reserves
    memory for 10 layers, so the sliding layers' KV takes 60/52 of what they need: 8/52 = 15.4%
    more (vLLM logs "may waste at most 15.38%"). gpt-oss (12 + 12 or 18 + 18) pads nothing.
    """
    types = attention_groups(spec)
    size = uniform_page_group_size([n for _, n in types])
    out = []
    for attention, n in types:
        groups = -(-n // size)
        for i in range(groups):
            real = len(range(i, n, groups))  # layers i, i + groups, ...: vLLM deals them round-robin
            out.append(EqualPageGroup(attention, real, size - real))
    return out
