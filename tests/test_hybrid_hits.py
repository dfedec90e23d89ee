"""The hybrid prefix-hit rule's cost: the reuse cliff, the eviction order that removes it, and the
Mooncake replay that measures both (pagedkv.sim.hybrid_hits, report section "hybrid")."""
import pytest

from pagedkv import FullAttention, KVCacheManager, SlidingWindow
from pagedkv.sim.hybrid_hits import layouts, never_evicts_bytes, replay_hits
from pagedkv.sim.sizing import get_model
from pagedkv.sim.traces import load_mooncake_jsonl, trace_path

GROUPS = [FullAttention(), SlidingWindow(4)]


def _cached_then_pressed(order: str) -> KVCacheManager:
    """Sequence a (24 tokens, 6 blocks of 4) finishes; x (24 fresh tokens, 12 blocks over the
    two groups) then takes the 8 never-used blocks and evicts 4 cached-free ones."""
    m = KVCacheManager(20, 4, groups=GROUPS, window_eviction=order, enable_events=False)
    m.add_sequence("a", list(range(100, 116)))
    for t in range(116, 124):
        m.append_token("a", t)
    # the window (4) of position 24 reads 21 .. 24: the sliding group keeps block 5 only
    assert m.block_table("a", 0) == [0, 2, 4, 6, 8, 10]
    assert m.block_table("a", 1) == [-1, -1, -1, -1, -1, 11]
    m.free("a")
    m.add_sequence("x", list(range(500, 524)))
    m.check_invariants()
    return m


def test_plain_lru_loses_the_whole_prefix_to_four_evictions():
    """on_release: the window blocks released mid-sequence (ids 1, 3, 5, 7) are the least
    recently freed, so they go first; the full group's blocks 0 .. 3 all survive, but no hit
    has its window: the cliff."""
    m = _cached_then_pressed("on_release")
    assert m.lookup(list(range(100, 116)) + [999]) == 0


def test_with_prefix_evicts_the_tail_and_keeps_every_shorter_hit():
    """with_prefix (the default): a's released window blocks are re-aged with its prefix when it
    finishes, so eviction takes blocks 5 and 4 of both groups (ids 10, 11, 8, 9) and the
    16-token prefix still hits whole."""
    m = _cached_then_pressed("with_prefix")
    assert m.lookup(list(range(100, 116)) + [999]) == 16
    assert m.add_sequence("b", list(range(100, 116)) + [999]) == 16
    assert m.block_table("b", 0)[:4] == [0, 2, 4, 6]
    assert m.block_table("b", 1)[:4] == [-1, -1, -1, 7]  # the window of position 16 reads 13 .. 16
    m.check_invariants()


def test_default_is_with_prefix():
    m = KVCacheManager(20, 4, groups=GROUPS, enable_events=False)
    m.add_sequence("a", list(range(100, 116)))
    for t in range(116, 124):
        m.append_token("a", t)
    m.free("a")
    m.add_sequence("x", list(range(500, 524)))
    assert m.lookup(list(range(100, 116)) + [999]) == 16


@pytest.mark.parametrize("bad", ["lru", "", None, 1])
def test_bad_window_eviction_is_refused(bad):
    with pytest.raises(ValueError, match="window_eviction"):
        KVCacheManager(20, 4, groups=GROUPS, window_eviction=bad)


def test_free_without_cache_reages_nothing():
    """An aborted sequence (cache=False) leaves the released blocks where they are."""
    m = KVCacheManager(20, 4, groups=GROUPS, enable_events=False)
    m.add_sequence("a", list(range(100, 116)))
    for t in range(116, 124):
        m.append_token("a", t)
    m.free("a", cache=False)
    m.check_invariants()


def test_layouts_hold_the_same_bytes_in_smaller_pages():
    """gpt-oss-20b: a layer's 16-token block is 16 x 2 x 8 x 64 x 2 = 32,768 bytes; uniform pages
    hold 24 layers, grouped pages 12 (two equal groups), so 1 GiB makes 1,365 and 2,730 blocks."""
    uniform, grouped = layouts(get_model("gpt-oss-20b"), 1 << 30)
    assert (uniform.page_bytes, uniform.num_blocks, uniform.groups) == (786_432, 1_365, None)
    assert (grouped.page_bytes, grouped.num_blocks) == (393_216, 2_730)
    assert grouped.groups == (SlidingWindow(128), FullAttention())
    g_uniform, g_grouped = layouts(get_model("Gemma-3-27B"), 1 << 30)
    assert len(g_grouped.groups) == 7 and g_grouped.page_bytes * 62 == g_uniform.page_bytes * 10


@pytest.fixture(scope="module")
def head_of_mooncake():
    path = trace_path("mooncake", None)
    if path is None:
        pytest.skip("the bundled Mooncake trace is missing")
    requests = load_mooncake_jsonl(path, limit=60)
    return requests, [r.prompt_array() for r in requests]


def test_an_unbounded_cache_pays_nothing_for_the_rule(head_of_mooncake):
    """Nothing is evicted, so every released window block is still cached: the grouped cache
    hits exactly what the uniform one does, under either order."""
    requests, prompts = head_of_mooncake
    spec = get_model("gpt-oss-20b")
    uniform, grouped = layouts(spec, never_evicts_bytes(spec, requests))
    u = replay_hits(requests, uniform, prompts=prompts)
    assert u.evictions == 0 and u.hit_tokens > 0
    for order in ("with_prefix", "on_release"):
        g = replay_hits(requests, grouped, prompts=prompts, window_eviction=order)
        assert (g.hit_tokens, g.query_tokens, g.evictions) == (u.hit_tokens, u.query_tokens, 0)


def test_gpt_oss_with_prefix_matches_uniform_under_pressure(head_of_mooncake):
    """gpt-oss's two groups are equal, so aged together a grouped cache evicts a finished prefix
    as the uniform one does, block for block: the same hits at a bounded budget too."""
    requests, prompts = head_of_mooncake
    spec = get_model("gpt-oss-20b")
    uniform, grouped = layouts(spec, never_evicts_bytes(spec, requests) // 4)
    u = replay_hits(requests, uniform, prompts=prompts)
    g = replay_hits(requests, grouped, prompts=prompts, window_eviction="with_prefix")
    assert u.evictions > 0
    assert g.hit_tokens == u.hit_tokens
