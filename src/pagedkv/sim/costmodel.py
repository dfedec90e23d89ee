"""How long one serving iteration takes: a memory-bandwidth roofline with a fixed overhead.

Why a bandwidth model: a decode step is memory-bound. Every step reads all the weights once (shared
by the whole batch) and every running sequence's keys and values once (attention), and the GPU's
HBM bandwidth divides those bytes into seconds. That is exactly why batch size is throughput, and
why memory wasted on reservations costs requests per second. Prefill is compute-bound instead:
``2 x parameters`` FLOPs per prompt token over the peak tensor throughput.

    step = overhead + (weight_bytes + kv_tokens_read x kv_bytes_per_token) / bandwidth
                    + prefill_tokens x 2 x (weight_bytes / weight_dtype_bytes) / peak_flops

Defaults are an NVIDIA H100 SXM5: 3.35 TB/s of HBM3 and 989 TFLOP/s dense BF16 (NVIDIA H100 Tensor
Core GPU datasheet, "H100 SXM" column); the 1 ms overhead (scheduling, launches, sampling) is an
assumption, not a measurement. The model's sizes default to Llama-3.1-8B as computed by
:mod:`pagedkv.sim.sizing` from its config fields.

Worked number: Llama-3.1-8B (16.06e9 weight bytes, 131,072 KV bytes per token), 32 running
sequences averaging 500 tokens: (16.06e9 + 16,000 x 131,072) / 3.35e12 = 5.42 ms, + 1 ms overhead
= 6.42 ms per step, 32 tokens per step -> 4,984 tokens/s.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..checks import int_at_least, number_at_least

__all__ = ["CostModel", "H100_HBM_BYTES_PER_S", "H100_BF16_FLOPS", "A100_40GB_HBM_BYTES_PER_S",
           "A100_BF16_FLOPS"]

H100_HBM_BYTES_PER_S = 3.35e12  # H100 SXM5 HBM3 bandwidth, NVIDIA H100 datasheet
H100_BF16_FLOPS = 989e12  # H100 SXM5 dense BF16 tensor throughput, same datasheet
# The vLLM paper's GPU (its Fig. 2 and section 6.2 run OPT-13B on one A100-40GB): 1,555 GB/s of
# HBM2 and 312 TFLOP/s dense BF16, NVIDIA A100 Tensor Core GPU datasheet ("A100 40GB SXM").
A100_40GB_HBM_BYTES_PER_S = 1.555e12
A100_BF16_FLOPS = 312e12
DEFAULT_MODEL = "Llama-3.1-8B"


def _model_bytes(name: str) -> tuple[int, int]:
    """(KV bytes per token, weight bytes) of a built-in model, from the sizing module."""
    from . import sizing

    spec = sizing.get_model(name)
    weights = sizing.estimate_weight_bytes(spec)
    if weights is None:
        raise ValueError(f"cannot estimate the weight bytes of {name}; pass weight_bytes")
    return sizing.kv_bytes_per_token(spec), weights


@dataclass(frozen=True)
class CostModel:
    """Seconds per serving iteration (see the module docstring for the formula and its sources).

    ``kv_bytes_per_token`` and ``weight_bytes`` default (None) to :data:`DEFAULT_MODEL`'s, computed
    by the sizing module; :meth:`for_model` takes any built-in model name.
    """

    kv_bytes_per_token: int | None = None
    weight_bytes: int | None = None
    bandwidth: float = H100_HBM_BYTES_PER_S  # bytes/s
    peak_flops: float = H100_BF16_FLOPS  # FLOP/s for prefill
    overhead_s: float = 1e-3  # per iteration that does any work
    weight_dtype_bytes: int = 2  # to turn weight bytes into parameters (2 x params FLOPs/token)
    model: str = field(default=DEFAULT_MODEL)

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token is None or self.weight_bytes is None:
            kv, w = _model_bytes(self.model)
            if self.kv_bytes_per_token is None:
                object.__setattr__(self, "kv_bytes_per_token", kv)
            if self.weight_bytes is None:
                object.__setattr__(self, "weight_bytes", w)
        for name in ("kv_bytes_per_token", "weight_bytes", "weight_dtype_bytes"):
            lo = int(name != "weight_bytes")  # a model may have no weights to count
            value = int_at_least(name, getattr(self, name), lo, expected="a positive int")
            object.__setattr__(self, name, value)
        number_at_least("bandwidth", self.bandwidth, 0.0, strict=True)
        number_at_least("peak_flops", self.peak_flops, 0.0, strict=True)
        number_at_least("overhead_s", self.overhead_s, 0.0)

    @classmethod
    def for_model(cls, name: str, **kw) -> "CostModel":
        """The cost model of a built-in model (``pagedkv size --list``), other fields as given."""
        kv, w = _model_bytes(name)
        kw.setdefault("kv_bytes_per_token", kv)
        kw.setdefault("weight_bytes", w)
        return cls(model=name, **kw)

    def step_time(self, kv_tokens_read: int, prefill_tokens: int = 0, decoding: bool = True) -> float:
        """Seconds for one iteration that decodes (reading ``kv_tokens_read`` cached token states)
        and prefills ``prefill_tokens`` prompt tokens; 0 when it does neither."""
        if kv_tokens_read < 0 or prefill_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got {kv_tokens_read}, {prefill_tokens}")
        if not decoding and not prefill_tokens:
            return 0.0
        t = self.overhead_s
        if decoding:
            t += (self.weight_bytes + kv_tokens_read * self.kv_bytes_per_token) / self.bandwidth
        if prefill_tokens:
            params = self.weight_bytes / self.weight_dtype_bytes
            t += prefill_tokens * 2.0 * params / self.peak_flops
        return t

    def describe(self) -> str:
        return (f"{self.model}: {self.weight_bytes / 1e9:.2f} GB weights, {self.kv_bytes_per_token:,} "
                f"KV B/token, {self.bandwidth / 1e12:.2f} TB/s, {self.peak_flops / 1e12:.0f} TFLOP/s, "
                f"{self.overhead_s * 1e3:.2g} ms overhead")
