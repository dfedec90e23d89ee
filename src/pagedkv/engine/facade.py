"""The ``Engine`` facade: checks every argument, then hands the work to one of the two loops.

``Engine(model, manager)`` makes the store and the :class:`~pagedkv.engine.executor.Executor`
over it; ``generate`` runs the one-prompt loop (:mod:`pagedkv.engine.prompt_loop`) unless a step
loop option or ``arrivals`` is given, and ``add_request`` / ``step`` / ``abort`` / ``preempt``
drive the step loop (:mod:`pagedkv.engine.step_loop`) directly. The facade keeps no state of its
own beyond the options; the counters live with the executor, the requests with the step loop.

May import numpy, :mod:`pagedkv.checks` and the package's modules.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..checks import flag, int_at_least, optional_int_at_least
from .executor import Executor
from .prompt_loop import PromptLoop
from .records import EngineStats, RequestResult, StepOutput
from .step_loop import StepLoop

__all__ = ["Engine", "PREEMPTION_MODES"]

PREEMPTION_MODES = ("recompute", "swap")


def _option(part: str, name: str) -> property:
    """A read-only option of the engine, kept by the part that uses it (``_executor`` or
    ``_steps``): ``engine.token_budget`` reads ``engine._steps.token_budget``."""
    return property(lambda self: getattr(getattr(self, part), name),
                    doc=f"The engine's ``{name}`` option (read-only; held by its {part.strip('_')}).")


class Engine:
    """Generation over a :class:`~pagedkv.KVCacheManager` and a :class:`~pagedkv.store.KVStore`.

    ``Engine(model, manager)`` makes a store shaped for the model with the manager's blocks; keep
    the engine (and so the manager) across ``generate`` calls to get prefix hits across requests.

    The modern loop's options (all off by default, which keeps ``generate``'s one-prompt-at-a-time
    path): ``token_budget`` (query tokens per step; long prompts are prefilled in chunks, mixed
    with decodes), ``chunk_size`` (the most prompt positions one request computes per step, so
    that one long prompt leaves budget for others: vLLM's ``long_prefill_token_threshold``),
    ``speculator`` (a drafter from :mod:`pagedkv.speculative`; greedy only) and
    ``publish_at_admission`` (a negative control, see the module docstring). ``add_request`` /
    ``step`` / ``abort`` / ``has_unfinished`` drive the loop one step at a time; ``generate``
    drives it to the end when any option or ``arrivals`` is given.

    A manager with a host tier (``KVCacheManager(..., host_blocks=N)``) gets a store with a host
    pool of ``N`` blocks, and its transfers run every step; ``preemption="swap"`` (step loop
    only) swaps preempted requests out instead of recomputing them; ``run_transfers=False`` is
    the host tier's negative control (see the module docstring).

    A hybrid model (``model.kv_groups``: sliding-window, chunked-local and full layers) needs a
    grouped manager with the same groups, ``KVCacheManager(..., groups=list(model.kv_groups))``
    (else ``ValueError``); both loops then hand the model one slot array and one table per
    group. With a host tier (``host_blocks=N``) the grouped manager swaps every group's live blocks,
    so ``preemption="swap"`` works too (the store moves whole blocks, every layer).
    """

    def __init__(self, model: Any, manager: Any, store: Any = None, *, copy_on_write: bool = True,
                 token_budget: int | None = None, chunk_size: int | None = None, speculator: Any = None,
                 publish_at_admission: bool = False, preemption: str = "recompute",
                 run_transfers: bool = True) -> None:
        flag("copy_on_write", copy_on_write)
        token_budget = optional_int_at_least("token_budget", token_budget, 1)
        chunk_size = optional_int_at_least("chunk_size", chunk_size, 1)
        flag("publish_at_admission", publish_at_admission)
        if publish_at_admission and token_budget is None and chunk_size is None:
            raise ValueError("publish_at_admission is a control of chunked prefill: set a token_budget "
                             "or a chunk_size")
        self._check_groups(model, manager)
        host = manager.num_host_blocks
        self._check_host_options(host, preemption, run_transfers)
        if store is None:
            store = (model.new_store(manager.num_blocks, manager.block_size, host_blocks=host) if host
                     else model.new_store(manager.num_blocks, manager.block_size))
        if (store.num_blocks, store.block_size) != (manager.num_blocks, manager.block_size):
            raise ValueError(f"store has {store.num_blocks} blocks of {store.block_size}, manager "
                             f"{manager.num_blocks} of {manager.block_size}")
        if getattr(store, "host_blocks", 0) != host:
            raise ValueError(f"store has {getattr(store, 'host_blocks', 0)} host blocks, the manager's "
                             f"host tier {host}")
        self._check_speculator(model, speculator)
        self.model, self.manager, self.store = model, manager, store
        self._executor = Executor(model, manager, store, copy_on_write=copy_on_write,
                                  run_transfers=run_transfers, tiered=host > 0)
        self._steps = StepLoop(self._executor, token_budget=token_budget, chunk_size=chunk_size,
                               speculator=speculator, publish_at_admission=publish_at_admission,
                               preemption=preemption)

    @staticmethod
    def _check_groups(model: Any, manager: Any) -> None:
        """A hybrid model needs a manager with its KV cache groups, in its order: layer i reads
        group ``dims.layer_groups[i]``'s table, so ``groups=list(model.kv_groups)``. One
        full-attention group, or none said (an older duck-typed model or manager), is the plain
        case on either side."""
        def groups(obj: Any, name: str) -> tuple:
            g = tuple(getattr(obj, name, None) or ())
            return () if len(g) == 1 and getattr(g[0], "kind", None) == "full_attention" else g

        mine, theirs = groups(model, "kv_groups"), groups(manager, "groups")
        if mine != theirs:
            raise ValueError(f"the model's KV cache groups {list(mine) or 'full attention'} are not the "
                             f"manager's {list(theirs) or 'full attention'}: build it as "
                             f"KVCacheManager(..., groups=list(model.kv_groups))")

    @staticmethod
    def _check_host_options(host: int, preemption: Any, run_transfers: Any) -> None:
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {preemption!r}")
        if preemption == "swap" and not host:
            raise ValueError("preemption='swap' needs a manager with a host tier "
                             "(KVCacheManager(..., host_blocks=N))")
        flag("run_transfers", run_transfers)
        if not run_transfers and not host:
            raise ValueError("run_transfers=False is a control of the host tier: the manager has none")

    @staticmethod
    def _check_speculator(model: Any, speculator: Any) -> None:
        if speculator is None:
            return
        for name in ("propose", "settle", "release"):
            if not callable(getattr(speculator, name, None)):
                raise ValueError(f"a speculator needs propose/settle/release methods; "
                                 f"{type(speculator).__name__} lacks {name}")
        int_at_least("speculator.num_drafts", getattr(speculator, "num_drafts", None), 1)
        mine = getattr(getattr(model, "dims", None), "vocab_size", None)
        theirs = getattr(speculator, "vocab_size", None)
        if mine is not None and theirs is not None and mine != theirs:
            raise ValueError(f"the draft model's vocabulary ({theirs}) is not the target's ({mine})")

    # ---- the options, each owned by the part that uses it

    @property
    def stats(self) -> EngineStats:
        """What the allocator did in the last ``generate`` call (or, driving ``step`` yourself,
        since the engine was made or the last ``generate``): see :class:`EngineStats`."""
        return self._executor.stats

    # read-only: changing an option after construction would leave the loops' checks behind
    copy_on_write = _option("_executor", "copy_on_write")
    run_transfers = _option("_executor", "run_transfers")
    token_budget = _option("_steps", "token_budget")
    chunk_size = _option("_steps", "chunk_size")
    speculator = _option("_steps", "speculator")
    publish_at_admission = _option("_steps", "publish_at_admission")
    preemption = _option("_steps", "preemption")

    @property
    def uses_step_loop(self) -> bool:
        """Whether ``generate`` runs the step loop (any of the modern loop's options is set)."""
        return (self.token_budget is not None or self.chunk_size is not None
                or self.speculator is not None or self.publish_at_admission
                or self.preemption == "swap")

    # ---- public entry point

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 temperature: float = 0.0, seed: int = 0, n: int = 1, beam_width: int = 1,
                 cache_salt: Any = None, arrivals: Sequence[int] | None = None) -> list[RequestResult]:
        """Generate ``max_new_tokens`` tokens for every prompt; return results in prompt order.

        ``temperature`` 0 is greedy; above 0, sample ``k`` of prompt ``r`` draws from its own
        stream seeded by ``(seed, r, k)`` (Gumbel-max over ``logits / temperature``), so results
        do not depend on batching. ``n`` > 1 forks ``n`` samples after the prompt; ``beam_width``
        > 1 runs beam search (sum of log-probabilities, no length penalty, no EOS). Every block is
        returned to the pool when the call ends, also on error. ``self.stats`` describes the call.

        ``arrivals[r]`` is the step (counted from this call's first) at which prompt ``r`` arrives;
        with arrivals or any of the modern loop's options the call runs the step loop (see
        :meth:`step`), which has no beam search.
        """
        max_new_tokens, n, beam_width = self._check_generate(prompts, max_new_tokens, temperature, n,
                                                             beam_width)
        if arrivals is not None or self.uses_step_loop:
            return self._steps.generate(prompts, max_new_tokens, temperature, seed, n, beam_width,
                                        cache_salt, arrivals)
        self._executor.reset()
        return PromptLoop(self._executor).run(prompts, max_new_tokens, temperature, seed, n, beam_width,
                                              cache_salt)

    def _check_generate(self, prompts, max_new_tokens, temperature, n, beam_width) -> tuple[int, int, int]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("need at least one prompt, each with at least one token")
        max_new_tokens = int_at_least("max_new_tokens", max_new_tokens, 1)
        n = int_at_least("n", n, 1)
        beam_width = int_at_least("beam_width", beam_width, 1)
        if n > 1 and beam_width > 1:
            raise ValueError("use n or beam_width, not both")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        if beam_width > 1 and temperature:
            raise ValueError("beam search is deterministic: leave temperature at 0")
        vocab = getattr(getattr(self.model, "dims", None), "vocab_size", None)
        if vocab is not None and any(min(p) < 0 or max(p) >= vocab for p in prompts):
            raise ValueError(f"prompt token ids must lie in [0, {vocab}) for this model")
        return max_new_tokens, n, beam_width

    # ---- the step loop, one step at a time

    def add_request(self, prompt: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0,
                    seed: int = 0, n: int = 1, cache_salt: Any = None, arrival: int | None = None) -> int:
        """Queue a request for the step loop; returns its id (0, 1, 2, ... per engine).

        It is admitted at the first step numbered ``arrival`` or later (default: the next step)
        that has token budget and blocks left, after every earlier arrival. Sample ``k`` draws
        from a stream seeded by ``(seed, 0, k)``. Checks the prompt and the salt now (with the
        side-effect-free ``lookup``), so a bad request never reaches a step.
        """
        max_new_tokens, n, _ = self._check_generate([prompt], max_new_tokens, temperature, n, 1)
        seed = int_at_least("seed", seed, 0)
        return self._steps.add(prompt, max_new_tokens, temperature, n, cache_salt, arrival, (seed, 0))

    @property
    def clock(self) -> int:
        """The number of the next step."""
        return self._steps.clock

    def has_unfinished(self) -> bool:
        """Whether any request added is still waiting, prefilling or decoding."""
        return self._steps.has_unfinished()

    def abort(self, request: int) -> None:
        """Drop a request: its blocks go back to the pool (``KeyError`` for an unknown id)."""
        self._steps.abort(request)

    def preempt(self, request: int) -> str:
        """Preempt an admitted request between steps, as the scheduler does when blocks run short;
        returns how: ``"swap"`` (``preemption="swap"`` and a decoding request whose private blocks
        fit in the host's free blocks: its sequences go to the host tier and come back when a
        step has room) or ``"recompute"`` (its blocks are freed and it restarts from its prompt).

        ``KeyError`` for an unknown or finished request; ``ValueError`` for one still waiting or
        already swapped out whole (nothing of it is on the device to preempt).
        """
        return self._steps.preempt(request)

    def step(self) -> StepOutput:
        """Schedule one step within the token budget and run it as one forward.

        Order: running sequences (their last token, plus drafts when speculating), prompts
        mid-prefill (their next chunk), then waiting requests that have arrived (admitted with
        ``add_sequence(..., prefill=k)``, ``k`` the budget left). A sequence that cannot get a
        block preempts the most recently admitted request with no work in this step (it restarts
        from its prompt later), or else waits; no request is admitted in a step that was short
        of blocks. A step in which nothing fits raises ``OutOfBlocks`` (abort a request and step
        again); a step with nothing arrived yet is idle. If the forward raises, every request is
        dropped and its sequences freed with ``cache=False`` (their newest positions were
        scheduled, never computed).
        """
        return self._steps.step()
