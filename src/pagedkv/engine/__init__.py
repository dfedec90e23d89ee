"""The reference integration: a generation loop driving the allocator, the KV store and a model.

Read this module to see what an engine owes the allocator, in the order it owes it, every step:

1. ``add_sequence`` a prompt: the first ``hit`` tokens' K/V is already in the store (prefix
   cache); compute only ``prompt[hit:]`` into the slots of its block table.
2. ``fork`` a sequence for each extra sample or beam: no allocation, no copy.
3. ``append_batch`` the step's tokens: one slot per sequence.
4. ``store.transfer(manager.take_transfers())`` (with a host tier: blocks offloaded to or loaded
   from host memory), then ``store.copy_blocks(manager.take_copies())``, **before** the step writes
   any K/V: a fork's child that appends into a shared partial block got a fresh block whose first
   slots must hold the parent's tokens before attention reads them.
5. run the model: it writes the new K/V at the slots and attends through ``block_tables``.
6. ``free`` every sequence when done (and every beam that falls out of the beam), so that all
   blocks return to the pool.

``copy_on_write=False`` is a negative control, not a mode to use: the engine then ignores the
queued copies and keeps writing a child's tokens into the *shared* block it was forked from (the
copy's source), which is what an allocator without copy-on-write does. Parent and children then
overwrite each other's K/V at the same slot offsets, and the tests and ``pagedkv report`` measure
how far their logits drift from a dense run of the same model. So that the collision is
deterministic (last writer wins), that mode runs a step's sequences one at a time. It assumes the
samples finish together (the shared block is not freed while a child still reads it).

The model is anything with ``new_store(num_blocks, block_size)`` and ``forward(store, token_ids,
slots, block_tables, seq_lens, query_lens) -> logits`` (:class:`pagedkv.model.PagedLlama`, on its
numpy or its torch backend; logits may be a numpy array or a CPU tensor). ``forward`` already takes
several new tokens per sequence (``query_lens``): a prefill chunk or a run of draft tokens is the
same call as a decode step. This module itself needs only numpy.

**The modern loop**: ``Engine(model, manager, token_budget=64)`` schedules every step
like a serving engine. Requests arrive over time (``add_request`` between ``step`` calls, or
``generate(..., arrivals=[...])``); each ``step()`` spends at most ``token_budget`` query tokens,
first on running sequences (one token each, plus drafts), then on the next chunks of prompts
mid-prefill, then on admitting waiting requests (``add_sequence(..., prefill=k)``), and runs
**one forward over all of them**: prefill chunks and decode tokens in one ragged batch. A long
prompt is computed over several steps, and its blocks are published only as chunks schedule them,
so a request admitted while another is mid-prefill hits only blocks whose K/V exists (or is
written in this very step: the model writes a layer's K/V for the whole batch before any
sequence's attention in that layer reads). When blocks run short, the most recently admitted
request without work in the step is preempted: its blocks are freed (the computed ones stay
cached) and it restarts from its prompt later, as vLLM's recompute preemption does.

``speculator=NgramDrafter()`` or ``DraftModelDrafter(small_model, small_manager)``
(:mod:`pagedkv.speculative`) adds speculative decoding: a running sequence's query is its last
chosen token plus up to ``k`` drafts (``append_tokens(..., speculative=True)``), the target
verifies all of them in the step's forward, keeps the drafts its own greedy choice agrees with
and rolls back the rest with ``accept(id, k)``: the tokens are exactly greedy decoding's.

``publish_at_admission=True`` is the chunked prefill's negative control: it admits the whole
prompt with ``prefill=None`` (every full block published at once) but still computes it in
chunks, so a request arriving mid-prefill hits blocks whose K/V was never written.

**The host tier.** With a manager made with ``host_blocks=N`` the engine's store gets a host pool
of the same size, and every forward first drains ``take_transfers()`` and runs it
(``store.transfer``: every ``to_host`` entry, then every ``to_device`` entry, each one batch), then
the copies, then the step's writes and attention. That is all a prefix hit on the host tier
needs: the manager gives the prompt device blocks and queues the loads. ``preemption="swap"``
preempts a decoding request by ``swap_out`` of its sequences (their private blocks go to host
memory, with their K/V) instead of freeing it to recompute; the swapped sequences come back
(``swap_in``, first out first in) at the start of a step with room for them, before any new
request is admitted, and decode on in that same step. A request mid-prefill (the manager cannot
swap a partly scheduled prompt), or one whose blocks do not fit in the host's free blocks, is
preempted by recomputation instead. ``run_transfers=False`` is the host tier's negative control:
the engine drains the transfers but never runs them, so a block loaded from the host or swapped
back in holds whatever the device block held before, and the logits diverge.

**The package.** It is the decoder proof's loop, apart from the allocator it drives: it may import
numpy, :mod:`pagedkv.checks` and :mod:`pagedkv.types`, and reaches the manager, the store, the
model and a speculator only through the objects it is given (their public calls); nothing below
it imports it. One module per job:

- :mod:`~pagedkv.engine.records`: the value objects (``Sample``, ``RequestResult``,
  ``EngineStats``, ``StepOutput``) and a decoding sequence's live record;
- :mod:`~pagedkv.engine.executor`: one forward (transfers, copies, the model), forks and frees,
  the counters and the ``copy_on_write=False`` alias map;
- :mod:`~pagedkv.engine.prompt_loop`: ``generate``'s default path, one prompt per forward, with
  parallel sampling and beam search;
- :mod:`~pagedkv.engine.step_loop`: the step loop (arrivals, chunked prefill, speculative
  decoding, recompute and swap preemption);
- :mod:`~pagedkv.engine.facade`: ``Engine``, which checks arguments and picks the loop.
"""
from __future__ import annotations

from .facade import PREEMPTION_MODES, Engine
from .records import EngineStats, RequestResult, Sample, StepOutput

__all__ = ["Engine", "Sample", "RequestResult", "EngineStats", "StepOutput", "PREEMPTION_MODES"]
