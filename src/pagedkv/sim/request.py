"""One serving request, as every workload produces it and every allocator consumes it.

A request does not carry its prompt tokens: real traces hold tens of millions of prompt tokens,
and only the running ones need to exist. It carries a *recipe*, ``segments``: a tuple of
``(content_key, length)`` pairs. The prompt is the concatenation of each segment's tokens, and a
segment's tokens are a pure function of its key. Equal keys therefore give equal tokens, and two
requests share a cached prefix exactly as far as their segment lists agree, which is how a shared
system prompt, or Mooncake's ``hash_ids``, become real prefix hits at any block size.

Worked example: ``segments=((7, 512), (90001, 300))`` is a 812-token prompt whose first 512 tokens
equal those of every other request that starts with key 7.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Request", "segment_tokens", "mix_tokens", "VOCAB_SIZE"]

VOCAB_SIZE = 32_000  # token ids are drawn from [0, VOCAB_SIZE), a Llama-2-sized vocabulary

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def mix_tokens(keys, positions) -> np.ndarray:
    """Token ids for ``(key, position)`` pairs, elementwise (broadcasting), as int32.

    A splitmix64 mix: deterministic across processes and platforms, so a trace replays to the
    same tokens (and, with sha256, the same block hashes) everywhere, and a sequence recomputed
    after preemption regenerates the tokens it had.
    """
    with np.errstate(over="ignore"):
        x = np.asarray(positions, dtype=np.uint64) + np.asarray(keys, dtype=np.uint64) * _GOLDEN
        x ^= x >> np.uint64(30)
        x *= _MIX1
        x ^= x >> np.uint64(27)
        x *= _MIX2
        x ^= x >> np.uint64(31)
    return (x % np.uint64(VOCAB_SIZE)).astype(np.int32)


def segment_tokens(key: int, length: int, start: int = 0) -> np.ndarray:
    """Tokens ``start .. start+length`` of the content stream named ``key`` (int32)."""
    if length < 0 or start < 0:
        raise ValueError(f"segment length and start must be >= 0, got {length}, {start}")
    key64 = np.uint64(key & 0xFFFFFFFFFFFFFFFF)
    return mix_tokens(key64, np.arange(start, start + length, dtype=np.uint64))


@dataclass(frozen=True, slots=True)
class Request:
    """A request of a workload: when it arrives, what its prompt is, how long its output is.

    ``n`` > 1 asks for parallel sampling (n sequences forked after the prompt), ``beam_width`` > 1
    for beam search; at most one of them may exceed 1. ``output_len`` is the number of tokens each
    sequence generates (the trace's own count; the engine stops there, as at an EOS token).
    """

    req_id: str
    arrival: float
    segments: tuple[tuple[int, int], ...]
    output_len: int
    n: int = 1
    beam_width: int = 1
    # sum of the segment lengths, computed once: schedulers ask for it every iteration
    _prompt_len: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        if not self.segments or any(length < 0 for _, length in self.segments):
            raise ValueError(f"request {self.req_id}: segments must be non-empty with lengths >= 0")
        object.__setattr__(self, "_prompt_len", sum(length for _, length in self.segments))
        if self.prompt_len < 1:
            raise ValueError(f"request {self.req_id}: the prompt must have at least one token")
        if self.output_len < 0 or self.n < 1 or self.beam_width < 1:
            raise ValueError(f"request {self.req_id}: output_len >= 0, n >= 1, beam_width >= 1")
        if self.n > 1 and self.beam_width > 1:
            raise ValueError(f"request {self.req_id}: use n or beam_width, not both")

    @property
    def prompt_len(self) -> int:
        return self._prompt_len

    @property
    def total_len(self) -> int:
        """Final length of each of the request's sequences (prompt + output)."""
        return self.prompt_len + self.output_len

    @property
    def num_seqs(self) -> int:
        """How many sequences the request runs at its widest (samples or beams)."""
        return max(self.n, self.beam_width)

    def prompt_array(self) -> np.ndarray:
        """The prompt's tokens as one int32 array, mixed in one vectorised call (a 12,000-token
        Mooncake prompt of 24 segments costs one ``mix_tokens`` call, not 24)."""
        lengths = np.array([length for _, length in self.segments], dtype=np.int64)
        keys = np.array([key & 0xFFFFFFFFFFFFFFFF for key, _ in self.segments], dtype=np.uint64)
        starts = np.cumsum(lengths) - lengths
        positions = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)
        return mix_tokens(np.repeat(keys, lengths), positions.astype(np.uint64))

    def prompt_tokens(self) -> list[int]:
        """Materialise the prompt (as Python ints, ready for ``KVCacheManager.add_sequence``)."""
        return self.prompt_array().tolist()
