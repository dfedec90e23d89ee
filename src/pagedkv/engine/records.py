"""The engine's value objects: what a caller gets back, and the counters of what the allocator did.

Owns no state of the loops: :class:`Sample`, :class:`RequestResult` and :class:`StepOutput` are
results handed to the caller, :class:`EngineStats` the counters the executor and the loops add
to (one object per ``generate`` call), :class:`LiveSequence` a decoding sequence's running
sample, shared by both loops. Imports numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Sample", "RequestResult", "EngineStats", "StepOutput", "LiveSequence"]


@dataclass
class Sample:
    """One generated sequence: its tokens and the logits each one was chosen from.

    ``logits[t]`` are the model's logits after ``prompt + tokens[:t]`` (float32 ``[vocab]``), which
    is what an oracle compares at step ``t``. ``logprob`` is the sum of the chosen tokens' log
    probabilities (the beam score).
    """

    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    logprob: float = 0.0

    def extended(self, token: int, logits: np.ndarray, logprob: float) -> "Sample":
        return Sample(self.tokens + [token], self.logits + [logits], self.logprob + logprob)


@dataclass
class RequestResult:
    """A prompt's outcome: ``hit_tokens`` served by the prefix cache, and its samples or beams
    (beams best first)."""

    prompt: list[int]
    hit_tokens: int
    samples: list[Sample]


@dataclass
class EngineStats:
    """What the allocator did for one ``generate`` call (or, driving ``step`` yourself, since
    the engine was made or the last ``generate``).

    ``eager_fork_blocks`` is how many blocks copying at fork time would have copied (the parent's
    whole table, per fork); ``copied_blocks`` is what copy-on-write copied instead. Worked
    example: a 45-token prompt with 16-token blocks, n = 4: three forks of a 3-block table are 9
    eager copies; copy-on-write copies the partial third block for 3 of the 4 samples: 3.

    Speculation: ``acceptance_rate = accepted_tokens / draft_tokens``; ``rollback_blocks`` counts
    the blocks ``accept`` returned to the pool. Worked example (block size 4): a sequence of 8
    tokens (two full blocks) verifies 4 drafts, which take a fresh third block; keeping 3 of them
    frees nothing, keeping none returns the third block: 1 block.

    Host tier: ``transfers_to_host`` / ``transfers_to_device`` count the block transfers drained
    from the manager, ``transfer_bytes`` what the store moved for them (``transfers x
    bytes_per_block``: with 16-token blocks of the 2-layer test model, 8,192 bytes each), and
    ``skipped_transfers`` the ones the ``run_transfers=False`` control dropped. A swapped request
    counts once in ``swap_preemptions`` and each of its sequences once in ``swapped_out``.
    """

    steps: int = 0
    forks: int = 0
    copied_blocks: int = 0
    copied_bytes: int = 0
    eager_fork_blocks: int = 0
    peak_used_blocks: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    # the step loop (token_budget / speculator / arrivals); 0 in generate's default path
    prefill_tokens: int = 0  # prompt positions computed (the uncached part of every prompt)
    prefill_chunks: int = 0  # prompt chunks computed: one per prompt per step it was in
    decode_tokens: int = 0  # query tokens of decoding sequences: 1 each per step, plus drafts
    max_step_tokens: int = 0  # the most query tokens one forward took
    mixed_steps: int = 0  # forwards holding both a prompt chunk and decode tokens
    idle_steps: int = 0  # steps with nothing to run (every request still to arrive)
    # speculative decoding
    verify_steps: int = 0  # (sequence, step) pairs that verified at least one draft
    draft_tokens: int = 0  # drafts the target verified
    accepted_tokens: int = 0  # drafts it kept
    rollback_blocks: int = 0  # blocks ``accept`` returned: they held only rejected drafts
    preemptions: int = 0  # requests restarted to free blocks for earlier ones
    # the host tier
    swap_preemptions: int = 0  # requests preempted by swapping their sequences out
    swap_fallbacks: int = 0  # preemption="swap" but restarted (a prompt mid-prefill, host full)
    swapped_out: int = 0  # sequences swapped out
    swapped_in: int = 0  # sequences swapped back in
    transfers_to_host: int = 0  # blocks drained device -> host (offloads, swap-outs)
    transfers_to_device: int = 0  # blocks drained host -> device (host prefix hits, swap-ins)
    transfer_bytes: int = 0  # bytes the store moved for them
    skipped_transfers: int = 0  # run_transfers=False: drained and never run

    @property
    def acceptance_rate(self) -> float:
        """Share of verified drafts the target kept (0.0 when nothing was drafted)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def rollback_tokens(self) -> int:
        """Drafts rejected and rolled back."""
        return self.draft_tokens - self.accepted_tokens


@dataclass
class StepOutput:
    """What one :meth:`Engine.step` did.

    ``admitted``: ``(request, prefix-hit tokens)`` for each request admitted this step;
    ``prefill``: ``(request, start, stop)`` for each prompt chunk computed (positions
    ``start..stop``); ``decode_tokens``: query tokens of decoding sequences (1 each plus drafts);
    ``preempted``: requests sent back to the queue to free blocks; ``swapped_out``: requests
    preempted by swapping them to the host tier; ``swapped_in``: requests whose sequences came
    back this step; ``transfers``: block transfers the forward ran (or, under the control,
    dropped); ``finished``: the requests completed this step, by request id. Worked example (budget 16,
    block size 16, a 40-token prompt arriving alone): step 0 ``prefill [(0, 0, 16)]``, step 1
    ``[(0, 16, 32)]``, step 2 ``[(0, 32, 40)]`` and the first token is chosen; step 3 decodes.
    """

    step: int
    admitted: list[tuple[int, int]] = field(default_factory=list)
    prefill: list[tuple[int, int, int]] = field(default_factory=list)
    decode_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rollback_blocks: int = 0
    preempted: list[int] = field(default_factory=list)
    swapped_out: list[int] = field(default_factory=list)
    swapped_in: list[int] = field(default_factory=list)
    transfers: int = 0
    finished: dict[int, RequestResult] = field(default_factory=dict)

    @property
    def prefill_tokens(self) -> int:
        return sum(stop - start for _, start, stop in self.prefill)

    @property
    def tokens(self) -> int:
        """Query tokens in this step's forward (0 for an idle step)."""
        return self.prefill_tokens + self.decode_tokens


@dataclass
class LiveSequence:
    """A decoding sequence: which request it belongs to, its sample so far, its seeded stream.

    ``rng`` is None for greedy decoding and for beams; ``index`` says which of its request's
    ``n`` samples it is (the step loop files a finished sample there)."""

    req: int
    sample: Sample
    rng: np.random.Generator | None
    index: int = 0
