"""Engine scenarios and checks that the numpy suites and the transformers oracle suites share:
the same run, compared against a different reference in each."""
from __future__ import annotations

import pytest

from llama_setup import prompts_of
from pagedkv import KVCacheManager
from pagedkv.engine import Engine


class CountingManager(KVCacheManager):
    """A real manager recording what every ``accept`` did: (tokens with drafts, drafts, kept,
    blocks the free count gained)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.accepts = []

    def accept(self, seq_id, k):
        n, d, free = self.num_tokens(seq_id), self.num_drafts(seq_id), self.num_free_blocks
        super().accept(seq_id, k)
        self.accepts.append((n, d, k, self.num_free_blocks - free))


def check_spec_counts(engine, manager: CountingManager) -> None:
    """The engine's speculation stats against the manager's own counts, and a recount by formula;
    the run must have ended with every block free."""
    st, acc, bs = engine.stats, manager.accepts, manager.block_size
    assert st.verify_steps == len(acc) > 0
    assert st.draft_tokens == sum(d for _, d, _, _ in acc)
    assert st.accepted_tokens == sum(k for _, _, k, _ in acc)
    assert st.rollback_tokens == st.draft_tokens - st.accepted_tokens
    assert st.rollback_blocks == sum(f for *_, f in acc)
    # blocks that held only dropped drafts: ceil(n / bs) - ceil((n - dropped) / bs)
    assert st.rollback_blocks == sum(-(-n // bs) - -(-(n - d + k) // bs) for n, d, k, _ in acc)
    assert st.acceptance_rate == pytest.approx(st.accepted_tokens / st.draft_tokens)
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_invariants()


BS, DEVICE, HOST = 16, 8, 24  # host_hit_run's tiers: blocks of 16, an 8-block device, 24 on the host


def host_hit_run(model, policy, run_transfers=True):
    """A (40 tokens) runs and is freed: 2 full blocks cached on the device. B and C (70 each, 5
    blocks) evict them: write-back offloads them then, write-through had copied them out already.
    A again: both blocks are loaded from the host. Returns (engine, A, cold result, lookup before
    the rerun, rerun result)."""
    manager = KVCacheManager(DEVICE, BS, host_blocks=HOST, host_write_policy=policy)
    engine = Engine(model, manager, run_transfers=run_transfers)
    a, b, c = prompts_of([40, 70, 70], seed=1)
    (cold,) = engine.generate([a], 8)
    engine.generate([b], 8)
    engine.generate([c], 8)
    seen = manager.lookup(a)
    (warm,) = engine.generate([a], 8)
    return engine, a, cold, seen, warm
