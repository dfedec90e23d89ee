"""The executor: one model forward over the paged store, after the allocator's queued work.

Both loops hand it a batch of sequences (their query tokens, slots and attended lengths); it runs
steps 4-5 of the engine's duties (see :mod:`pagedkv.engine`) in the order the allocator needs:
the host tier's transfers (``store.transfer(manager.take_transfers())``), then the copy-on-write
copies (``store.copy_blocks(manager.take_copies())``), then the model, which writes the new K/V at
the slots and attends through the block tables. It also forks and frees sequences for the loops,
so that the fork counters and the negative control's alias map stay in step with the manager.

Owns: the store, the per-call counters (:class:`~pagedkv.engine.records.EngineStats`) and the
alias map of the ``copy_on_write=False`` control (a block a copy went to -> the shared block the
child keeps writing instead). A hybrid model (more than one KV cache group, ``model.kv_groups``)
runs on a grouped manager (``KVCacheManager(..., groups=list(model.kv_groups))``): the loops
hand over group 0's slots (what ``prefill`` / ``append_*`` return), and the executor asks the
manager for every other group's slots of the same positions and for one table per group, as
vLLM's per-group slot mappings (a decode step of two sequences on ``[Sliding(7), Full]``: two
slot arrays of 2 entries and two ``[2, blocks]`` tables). Block ids are one pool's, so the
alias map serves every group. Worked example of the control: a fork's child appends into a shared
partial block 7; the manager queues the copy ``(7, 12)`` and gives the child block 12; the
executor drops the copy and rewrites every 12 in the child's slots and table to 7, so parent and
child write the same slots and the last writer wins.

May import: numpy, :mod:`pagedkv.types`, and the package's records. Never knows what a request,
a beam or a step's schedule is.
"""
from __future__ import annotations

import itertools
from typing import Any, Hashable

import numpy as np

from ..types import TO_HOST
from .records import EngineStats

__all__ = ["Executor", "new_tag", "pick_token"]

_tags = itertools.count()  # one process-wide counter: sequence ids of every engine stay distinct


def new_tag() -> int:
    """A fresh first component for sequence ids, ``(tag, request, serial)``: unique in the
    process, so two engines (or two ``generate`` calls) sharing a manager never collide."""
    return next(_tags)


def pick_token(logits: np.ndarray, temperature: float, rng: np.random.Generator | None) -> int:
    """Greedy (``temperature`` 0) or a Gumbel-max draw from ``softmax(logits / temperature)``.

    Gumbel-max needs one uniform per vocabulary entry and no normalisation, so a sample's stream
    gives the same tokens however the sequences are batched."""
    if not temperature:
        return int(np.argmax(logits))
    gumbel = -np.log(-np.log(rng.random(logits.shape[-1])))
    return int(np.argmax(logits.astype(np.float64) / temperature + gumbel))


class Executor:
    """Runs forwards for the loops over one manager, store and model; keeps the counters.

    ``copy_on_write`` and ``run_transfers`` are the engine's options (``False`` only as negative
    controls); ``tiered`` says whether the manager has a host tier whose transfers must be drained
    every forward.
    """

    def __init__(self, model: Any, manager: Any, store: Any, *, copy_on_write: bool,
                 run_transfers: bool, tiered: bool) -> None:
        self.model, self.manager, self.store = model, manager, store
        self.copy_on_write = copy_on_write
        self.run_transfers = run_transfers
        self.tiered = tiered
        self.num_groups = getattr(manager, "num_groups", 1)  # KV cache groups: tables per sequence
        # a grouped manager releases blocks as windows move: room is not free blocks x block size
        self.releases = self.num_groups > 1 or any(
            getattr(g, "kind", None) != "full_attention" for g in getattr(manager, "groups", ()) or ())
        self.stats = EngineStats()
        self.step_transfers = 0  # transfers the last forward drained
        self._alias: dict[int, int] = {}  # copy_on_write=False: block a copy went to -> its source

    def reset(self) -> None:
        """Start a ``generate`` call: fresh counters, no aliases left from an earlier call."""
        self.stats, self._alias = EngineStats(), {}

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """``manager.fork``, counting what an eager copy of the parent's table would have cost."""
        self.stats.eager_fork_blocks += self.live_blocks(parent)
        self.stats.forks += 1
        self.manager.fork(parent, child)

    def free(self, seq_id: Hashable, cache: bool = True) -> None:
        """``manager.free``; under the control, forget the aliases of blocks nobody holds now."""
        if not self._alias:
            self.manager.free(seq_id, cache=cache)
            return
        tables = [self.manager.block_table(seq_id, group=g) for g in range(self.num_groups)]
        self.manager.free(seq_id, cache=cache)
        for table in tables:
            for b in table:
                if b in self._alias and self.manager.refcount(b) == 0:
                    del self._alias[b]

    def held_blocks(self, seq_id: Hashable) -> int:
        """Entries of the sequence's tables, summed over groups (released ones included): the
        change across ``accept`` is what it gave back to the pool."""
        m = self.manager
        if self.num_groups == 1:
            return len(m.block_table(seq_id))
        return sum(len(m.block_table(seq_id, group=g)) for g in range(self.num_groups))

    def live_blocks(self, seq_id: Hashable) -> int:
        """Blocks the sequence holds over every group (released entries, -1, not counted): what
        copying its tables at a fork would copy. Example: ``[Sliding(8), Full]``, block size 4,
        20 positions: 2 + 5 = 7 (the window's group released its first 3)."""
        m = self.manager
        if self.num_groups == 1:
            return len(m.block_table(seq_id))
        return sum(sum(1 for b in m.block_table(seq_id, group=g) if b >= 0) for g in range(self.num_groups))

    def forward_last(self, ids, feeds, slots) -> list[np.ndarray]:
        """:meth:`forward_rows` with ``num_tokens`` as each length; each sequence's last logits."""
        lens = [self.manager.num_tokens(i) for i in ids]
        return [rows[-1].copy() for rows in self.forward_rows(ids, feeds, slots, lens)]

    def forward_rows(self, ids, feeds, slots, lens) -> list[np.ndarray]:
        """Transfers, copies, then one model call; each sequence's logits, one row per query token.

        ``lens[i]`` is the length attention sees: the sequence's scheduled positions after this
        step (``num_tokens`` in the one-prompt loop; the prompt's computed prefix mid-prefill).
        """
        self._run_transfers()
        self._run_copies()
        m = self.manager
        self.stats.steps += 1
        self.stats.peak_used_blocks = max(self.stats.peak_used_blocks, m.num_blocks - m.num_free_blocks)
        qlens = [len(f) for f in feeds]
        if self.num_groups == 1:
            tables = m.block_tables(ids)
        else:
            slots, tables = self._group_inputs(ids, slots, lens, qlens)
        if self.copy_on_write:
            return self._model_step(feeds, slots, tables, lens, qlens)
        if self.num_groups == 1:
            return self._one_at_a_time(feeds, self._aliased_slots(slots), self._aliased(tables), lens, qlens,
                                       lambda t, a, b: t[a:b], lambda t, i: t[i:i + 1])
        slots = [self._aliased_slots(s) for s in slots]
        tables = [self._aliased(t) for t in tables]
        return self._one_at_a_time(feeds, slots, tables, lens, qlens,
                                   lambda t, a, b: [x[a:b] for x in t], lambda t, i: [x[i:i + 1] for x in t])

    def _group_inputs(self, ids, slots, lens, qlens) -> tuple[list, list]:
        """One slot array and one table per group: group 0's slots as the loops gave them, the
        other groups' from ``manager.slots(id, start, stop, group=g)`` for the same positions
        (sequence i's queries are positions ``lens[i] - qlens[i] .. lens[i]``)."""
        m = self.manager
        out = [np.asarray(slots, dtype=np.int64)]
        for g in range(1, self.num_groups):
            out.append(np.concatenate([m.slots(i, n - q, n, group=g) for i, n, q in zip(ids, lens, qlens)]))
        return out, [m.block_tables(ids, group=g) for g in range(self.num_groups)]

    def _one_at_a_time(self, feeds, slots, tables, lens, qlens, cut, row) -> list[np.ndarray]:
        """The control's forwards, one sequence each: colliding writes land in a fixed order."""
        out, start = [], 0
        for i, q in enumerate(qlens):
            out += self._model_step([feeds[i]], cut(slots, start, start + q), row(tables, i), lens[i:i + 1], [q])
            start += q
        return out

    def _aliased_slots(self, slots) -> np.ndarray:
        bs, slots = self.manager.block_size, np.asarray(slots, dtype=np.int64)
        return self._aliased(slots // bs) * bs + slots % bs

    def _run_transfers(self) -> None:
        """Before the copies: the host tier's transfers, ``to_host`` batch then ``to_device``
        batch (``store.transfer``), or under ``run_transfers=False`` nothing at all."""
        self.step_transfers = 0
        if not self.tiered:
            return
        transfers = self.manager.take_transfers()
        if not transfers:
            return
        st = self.stats
        out = sum(1 for t in transfers if t[0] == TO_HOST)
        st.transfers_to_host += out
        st.transfers_to_device += len(transfers) - out
        self.step_transfers = len(transfers)
        if self.run_transfers:
            st.transfer_bytes += self.store.transfer(transfers)
        else:  # negative control: loaded and swapped-in blocks keep what the device block held
            st.skipped_transfers += len(transfers)

    def _run_copies(self) -> None:
        """Step 4: the queued copy-on-write copies, before any of this step's writes."""
        copies = self.manager.take_copies()
        if self.copy_on_write:
            self.stats.copied_bytes += self.store.copy_blocks(copies)
            self.stats.copied_blocks += len(copies)
        else:  # negative control: keep using the shared source block, as if never copied
            for c in copies:  # CopyOp(src, dst, group): block ids are one pool's, whatever the group
                self._alias[c[1]] = self._alias.get(c[0], c[0])

    def _model_step(self, feeds, slots, tables, lens, qlens) -> list[np.ndarray]:
        toks = [t for f in feeds for t in f]
        logits = np.asarray(self.model.forward(self.store, toks, slots, tables, lens, qlens), dtype=np.float32)
        return np.split(logits, np.cumsum(qlens)[:-1])

    def _aliased(self, blocks: np.ndarray) -> np.ndarray:
        out = np.array(blocks, copy=True)
        for dst, src in self._alias.items():
            out[out == dst] = src
        return out
