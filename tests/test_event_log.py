"""The KV event log: every event names its attention group, as vLLM 0.33 tags them.

vLLM's ``BlockPool`` builds each ``BlockStored`` / ``BlockRemoved`` with the block's
``group_idx`` (0 for a model with one KV cache group), and ``KVCacheManager.take_events`` adds
the group spec's kind and sliding window to every ``BlockStored``
(``vllm/v1/core/kv_cache_manager.py``, vLLM 0.33.0). Its offloading connector tags the blocks
it offloads to host memory ("CPU") the same way. These tests hold pagedkv's log to that, for a
uniform model (bare hashes) and a hybrid one (``(group, hash)`` keys), with exact events.
"""
from __future__ import annotations

from pagedkv import (AllBlocksCleared, BlockRemoved, BlockStored, ChunkedLocalAttention, FullAttention,
                     KVCacheManager, SlidingWindow)
from pagedkv.pending_events import EventLog

FULL = ("full_attention", None)


def test_a_plain_manager_tags_every_event_group_zero_full_attention():
    """Checked to fail before the log tagged them: a plain manager sent nil in all three."""
    m = KVCacheManager(num_blocks=4, block_size=4)
    m.add_sequence("a", list(range(9)))  # blocks 0..3 and 4..7 published
    m.free("a")
    m.add_sequence("b", list(range(50, 66)))  # needs all 4 blocks: evicts a's two
    stored_a, removed, stored_b = m.take_events()
    assert (stored_a.group_idx, stored_a.kv_cache_spec_kind, stored_a.kv_cache_spec_sliding_window) == (0, *FULL)
    assert (stored_b.group_idx, stored_b.kv_cache_spec_kind, stored_b.kv_cache_spec_sliding_window) == (0, *FULL)
    assert removed == BlockRemoved(tuple(reversed(stored_a.block_hashes)), "GPU", 0)
    assert stored_a.token_ids == tuple(range(8)) and stored_b.token_ids == tuple(range(50, 66))


def test_host_tier_events_carry_the_same_tags():
    """Blocks offloaded to host memory are published there ("CPU") with group 0's tags, as
    vLLM's offloading connector publishes them."""
    m = KVCacheManager(num_blocks=4, block_size=4, host_blocks=4)
    m.add_sequence("a", list(range(9)))
    m.free("a")
    m.add_sequence("b", list(range(50, 66)))
    m.take_transfers()
    events = m.take_events()
    cpu = [e for e in events if e.medium == "CPU"]
    assert [type(e) for e in cpu] == [BlockStored]
    assert (cpu[0].group_idx, cpu[0].kv_cache_spec_kind, cpu[0].token_ids) == (0, "full_attention", tuple(range(8)))
    assert {(type(e), e.group_idx) for e in events} == {(BlockStored, 0), (BlockRemoved, 0)}


def test_a_uniform_log_keys_bare_hashes_and_folds_removals_per_medium():
    log = EventLog(True)
    log.stored((b"h1", b"h2"), b"root", [1, 2, 3, 4], 2, "GPU")
    log.removed([b"h2"], "GPU")
    log.removed([b"h1"], "GPU")
    log.removed([b"h9"], "CPU")
    log.cleared()
    assert log.take() == [
        BlockStored((b"h1", b"h2"), b"root", (1, 2, 3, 4), 2, "GPU", None, None, 0, "full_attention", None),
        BlockRemoved((b"h2", b"h1"), "GPU", 0),
        BlockRemoved((b"h9",), "CPU", 0),
        AllBlocksCleared(),
    ]
    assert log.take() == [] and len(log) == 0


def test_a_grouped_log_strips_the_group_from_keys_and_tags_each_event():
    """``(group, hash)`` keys: the events carry the bare hashes, the parent's bare hash, and
    their group's index, kind and window; a run of removals folds per group and medium."""
    log = EventLog(True, (FullAttention(), SlidingWindow(8), ChunkedLocalAttention(32)))
    log.stored(((1, b"a"), (1, b"b")), (1, b"root"), (5, 6, 7, 8), 2, "GPU")
    log.stored_many([(((2, b"c"),), (2, b"b"), (9, 10), 2, "CPU", "sql", (("sql",),))])
    log.removed([(0, b"x"), (0, b"y"), (1, b"a"), (1, b"b")], "GPU")
    log.removed([(1, b"z")], "CPU")
    assert log.take() == [
        BlockStored((b"a", b"b"), b"root", (5, 6, 7, 8), 2, "GPU", None, None, 1, "sliding_window", 8),
        BlockStored((b"c",), b"b", (9, 10), 2, "CPU", "sql", (("sql",),), 2, "chunked_local_attention", None),
        BlockRemoved((b"x", b"y"), "GPU", 0),
        BlockRemoved((b"a", b"b"), "GPU", 1),
        BlockRemoved((b"z",), "CPU", 1),
    ]


def test_one_sliding_group_is_keyed_like_any_grouped_manager():
    """Only exactly ``[FullAttention()]`` is the plain manager's bare-hash log: a grouped
    manager with one sliding group still passes ``(group, hash)`` keys."""
    log = EventLog(True, (SlidingWindow(4),))
    log.stored(((0, 11),), (0, 10), (1, 2), 2, "GPU")
    log.removed([(0, 11)], "GPU")
    assert log.take() == [BlockStored((11,), 10, (1, 2), 2, "GPU", None, None, 0, "sliding_window", 4),
                          BlockRemoved((11,), "GPU", 0)]
    m = KVCacheManager(num_blocks=8, block_size=4, groups=[SlidingWindow(8)])
    m.add_sequence("a", list(range(9)))
    [ev] = m.take_events()
    assert (ev.group_idx, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window, len(ev.block_hashes)) == (
        0, "sliding_window", 8, 2)
    assert all(isinstance(h, bytes) for h in ev.block_hashes)
