"""Prefix hits of a recurrent-state hybrid at several checkpoint intervals (pagedkv.sim.state_hits):
a hit needs an interval end whose checkpoint a chunk left, so longer intervals lose hits."""
import pytest

from pagedkv.sim.request import Request
from pagedkv.sim.state_hits import never_evicts_blocks, replay_state_hits, state_hit_rates
from pagedkv.sim.traces import load_mooncake_jsonl, trace_path


def two_turns():
    """Request 1 is 40 tokens of stream 7; request 2 repeats them and adds 9 of stream 8."""
    return [Request("a", 0.0, ((7, 40),), 3), Request("b", 1.0, ((7, 40), (8, 9)), 0)]


@pytest.mark.parametrize("interval, hit, state_blocks", [(None, 40, 0), (4, 40, 14), (8, 40, 8), (16, 32, 5),
                                                         (32, 32, 3), (64, 0, 2)])
def test_a_hit_is_the_last_interval_end_of_the_shared_prefix(interval, hit, state_blocks):
    """Block size 4: attention alone hits all 40 shared tokens; with a state group the hit is the
    last interval end at or below 40 whose checkpoint request 1's chunks left (none at T = 64).
    The pool then holds request 1's 40 // T checkpoints and running state, and one block per
    chunk of request 2 (its chunks run from the hit to 49, ending on interval ends): at T = 4,
    10 + 1 + 3."""
    run = replay_state_hits(two_turns(), interval, 4)
    assert (run.query_tokens, run.hit_tokens, run.evictions, run.skipped) == (89, hit, 0, 0)
    assert run.state_blocks == state_blocks


def test_never_evicts_blocks_counts_kv_and_one_state_per_interval():
    r = [Request("a", 0.0, ((1, 997),), 3)]  # 1,000 tokens
    assert never_evicts_blocks(r, 256, 16) == 63 + 4 + 1
    assert never_evicts_blocks(r, None, 16) == 63


def test_bad_interval_is_refused():
    with pytest.raises(ValueError, match="interval"):
        replay_state_hits(two_turns(), 6, 4)
    with pytest.raises(ValueError, match="interval"):
        replay_state_hits(two_turns(), 0, 4)


def test_mooncake_hits_fall_with_the_interval():
    """The first 100 Mooncake requests, never evicting: every interval hits at most what attention
    alone does, a longer interval never more than a shorter one, and T = 2,048 strictly less;
    the checkpoints held fall as the interval grows."""
    path = trace_path("mooncake", None)
    if path is None:
        pytest.skip("the bundled Mooncake trace is missing")
    runs = state_hit_rates(load_mooncake_jsonl(path, limit=100))
    assert [r.interval for r in runs] == [None, 256, 512, 1024, 2048]
    assert all(r.evictions == 0 and r.skipped == 0 for r in runs)
    assert len({r.query_tokens for r in runs}) == 1
    hits = [r.hit_tokens for r in runs]
    assert hits[0] > 0 and hits == sorted(hits, reverse=True) and hits[-1] < hits[0]
    blocks = [r.state_blocks for r in runs[1:]]
    assert blocks == sorted(blocks, reverse=True) and blocks[-1] < blocks[0]


def test_a_request_larger_than_the_pool_is_skipped():
    """Five blocks of 4 tokens hold neither request: each is admitted (the manager counts its
    query and hit then), runs the chunks that fit and is dropped, its finished chunks cached. So
    b still hits the 8 tokens a's first chunk checkpointed, and both count as skipped."""
    run = replay_state_hits(two_turns(), 8, 4, num_blocks=5)
    assert (run.requests, run.skipped, run.query_tokens, run.hit_tokens) == (2, 2, 89, 8)


def test_a_bounded_pool_evicts_and_keeps_the_newest_prefix():
    """20 blocks: the replay evicts cached blocks (a's older checkpoints), and b still hits 40:
    the checkpoint after position 39 is held by a (its last call read it), so never evicted."""
    run = replay_state_hits(two_turns(), 8, 4, num_blocks=20)
    assert run.skipped == 0 and run.evictions > 0 and run.hit_tokens == 40
