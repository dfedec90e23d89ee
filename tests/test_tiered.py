"""The tiered allocator (pagedkv.sim.tiered) and the scheduler's swap path: exact transfers and
their link time on small cases, swap preemption through ``simulate``, and random workloads
through a tiered manager (every request finishes, invariants hold at every iteration)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.sim.request import Request
from pagedkv.sim.scheduler import Guards, simulate
from pagedkv.sim.sizing import kv_bytes_per_token
from pagedkv.sim.swap_cost import Link
from pagedkv.sim.tiered import TieredAllocator

KV = kv_bytes_per_token("Llama-3.1-8B")  # 131,072
SLOW = Link(bandwidth=1e6, latency_s=1e-3)  # round numbers: 1 ms per copy, 1 MB/s


def _req(rid: str, key: int, prompt: int, output: int, arrival: float = 0.0, n: int = 1) -> Request:
    return Request(rid, arrival, ((key, prompt),), output, n=n)


def _alloc(num_blocks: int, host: int, **kw) -> TieredAllocator:
    kw.setdefault("watermark", 0.0)
    kw.setdefault("link", SLOW)
    kw.setdefault("copies_per_block", 2)
    return TieredAllocator(num_blocks, 4, host, **kw)


def _seconds(blocks: int, copies: int = 2, bs: int = 4) -> float:
    """Hand-computed link time of ``blocks`` transfers on SLOW: copies x 1 ms + bytes / 1e6."""
    return blocks * copies * 1e-3 + blocks * bs * KV / 1e6


# ---- arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,msg", [
    ({"preemption": "evict"}, "preemption must be one of"),
    ({"host_blocks": -1}, "host_blocks must be an int >= 0"),
    ({"host_blocks": 1.5}, "host_blocks must be an int >= 0"),
    ({"preemption": "swap"}, "needs a host tier"),
    ({"host_blocks": 4, "copies_per_block": 0}, "copies_per_block"),
    ({"host_blocks": 4, "link": 64e9}, "link must be a Link"),
])
def test_bad_arguments_are_refused(kw, msg):
    host = kw.pop("host_blocks", 0)
    with pytest.raises(ValueError, match=msg):
        TieredAllocator(8, 4, host, **kw)


def test_defaults_take_the_models_layout_and_block_bytes():
    a = TieredAllocator(8, 16, 8)
    assert a.copies_per_block == 64  # K and V of each of 32 layers
    assert a.block_bytes == 16 * KV
    assert a.m.num_host_blocks == 8 and a.preemption == "recompute"
    assert TieredAllocator(8, 16).m.num_host_blocks == 0


# ---- swapping, exactly ------------------------------------------------------------------------


def _two_running(**kw) -> TieredAllocator:
    """A and B admitted (8-token prompts: 2 blocks each) on 8 device and 8 host blocks, drained."""
    a = _alloc(8, 8, preemption="swap", enable_prefix_caching=False, **kw)
    assert a.admit(_req("A", 1, 8, 10)) and a.admit(_req("B", 2, 8, 10))
    assert a.take_transfer_seconds() == 0.0  # nothing moved; the admissions are computed now
    return a


def test_swap_out_and_in_move_the_private_blocks_and_cost_their_link_time():
    a = _two_running()
    assert a.swap_out("B")
    assert a.is_swapped("B") and a.kv_tokens == 8  # attention no longer reads B
    assert a.m.num_free_blocks == 6 and a.m.num_free_host_blocks == 6
    assert a.take_transfer_seconds(compute_s=5.0) == pytest.approx(_seconds(2))  # synchronous
    assert (a.stats.swap_outs, a.stats.swapped_blocks, a.stats.offloaded_blocks) == (1, 2, 0)
    assert a.swap_in("B")
    assert not a.is_swapped("B") and a.kv_tokens == 16 and a.m.num_free_blocks == 4
    assert a.take_transfer_seconds() == pytest.approx(_seconds(2))
    assert (a.stats.swap_ins, a.stats.loaded_blocks) == (1, 2)
    assert a.stats.sync_s == pytest.approx(2 * _seconds(2)) and a.stats.async_s == 0
    a.check()


def test_a_victim_admitted_this_step_is_recomputed_not_swapped():
    a = _two_running()
    assert a.admit(_req("C", 3, 4, 4))
    assert not a.swap_out("C")  # its K/V is computed by the step that admitted it
    assert a.stats.swap_fallbacks == 1 and not a.is_swapped("C")
    a.take_transfer_seconds()
    assert a.swap_out("C")  # one drain later it is computed: it swaps


def test_a_full_host_means_recompute_and_changes_nothing():
    a = _alloc(8, 1, preemption="swap", enable_prefix_caching=False)
    assert a.admit(_req("A", 1, 8, 10)) and a.admit(_req("B", 2, 8, 10))
    a.take_transfer_seconds()
    table = a.m.block_table("B.0")
    assert not a.swap_out("B")  # 2 private blocks, 1 host block
    assert a.stats.swap_fallbacks == 1 and a.m.num_free_host_blocks == 1 and a.kv_tokens == 16
    assert a.m.block_table("B.0") == table and a.m.num_swapped_blocks("B.0") == 0


def test_swap_in_without_room_changes_nothing():
    a = _two_running()
    assert a.swap_out("B")
    a.take_transfer_seconds()
    assert a.admit(_req("C", 3, 24, 4))  # 6 blocks: all the device has left
    a.take_transfer_seconds()
    assert not a.swap_in("B")
    assert a.is_swapped("B") and a.m.num_free_blocks == 0 and a.m.num_swapped_blocks("B.0") == 2
    a.check()


def test_recompute_mode_never_swaps_and_counts_no_fallback():
    a = _alloc(8, 8, enable_prefix_caching=False)
    assert a.admit(_req("A", 1, 8, 10)) and a.admit(_req("B", 2, 8, 10))
    a.take_transfer_seconds()
    assert not a.swap_out("B") and a.stats.swap_fallbacks == 0


def test_bad_swap_calls_are_refused():
    a = _two_running()
    with pytest.raises(KeyError):
        a.swap_out("nope")
    with pytest.raises(ValueError, match="not swapped out"):
        a.swap_in("A")
    assert a.swap_out("B")
    with pytest.raises(ValueError, match="swapped out already"):
        a.swap_out("B")


def test_releasing_a_swapped_request_frees_its_host_blocks():
    a = _two_running()
    assert a.swap_out("B")
    a.release("B")
    assert a.kv_tokens == 8 and not a.is_swapped("B")
    a.take_transfer_seconds()  # the pending copies out held their host blocks until now
    assert a.m.num_free_host_blocks == 8 and a.m.num_free_blocks == 6
    a.check()


def test_offloads_overlap_the_step_and_only_their_excess_waits():
    # A's two full blocks are cached when it finishes; B takes every block, evicting them: two
    # offloads (write-back), which overlap the step's compute.
    for compute, waited in ((0.5, _seconds(2) - 0.5), (5.0, 0.0)):
        a = _alloc(4, 8)
        assert a.admit(_req("A", 1, 8, 4))
        a.take_transfer_seconds()
        a.release("A")
        assert a.admit(_req("B", 2, 16, 4))
        assert a.take_transfer_seconds(compute_s=compute) == pytest.approx(waited)
        assert (a.stats.offloaded_blocks, a.stats.swapped_blocks, a.stats.loaded_blocks) == (2, 0, 0)
        assert a.stats.async_s == pytest.approx(_seconds(2))


def test_a_readmission_loads_its_offloaded_prefix():
    a = _alloc(4, 8)
    assert a.admit(_req("A", 1, 9, 4))  # 2 full blocks published, 1 partial
    a.take_transfer_seconds()
    a.release("A")
    assert a.admit(_req("B", 2, 16, 4))  # evicts A's two cached blocks to the host
    a.take_transfer_seconds()
    a.release("B")
    assert a.admit(_req("A", 1, 9, 4))
    assert a.last_hit_tokens == 8  # served from the host: a load, not a recompute
    a.take_transfer_seconds()
    assert a.stats.loaded_blocks == 2
    assert a.m.usage().host_hit_tokens == 8


# ---- through the scheduler --------------------------------------------------------------------


def _pair() -> list[Request]:
    # Two requests of 1 prompt block and 8 output tokens on 5 blocks of 4: at their 9th token
    # both need a third block with one left, so B (the newest) is preempted.
    return [_req("A", 1, 4, 8), _req("B", 2, 4, 8)]


def test_swap_preemption_through_the_scheduler():
    a = _alloc(5, 10, preemption="swap", link=Link())
    res = simulate(_pair(), a, max_len=12)
    assert res.completed and res.finished == 2
    assert res.preemptions == 1 and res.recomputed_tokens == 0
    assert res.requests.preemptions.tolist() == [0, 1]
    st_ = a.stats
    # B's two full blocks stay cached on the device after the swap-out, and nothing evicts them
    # before it comes back: the swap-in revives them, loading nothing
    assert (st_.swap_outs, st_.swap_ins, st_.swapped_blocks, st_.loaded_blocks) == (1, 1, 2, 0)
    assert st_.sync_s == pytest.approx(a.transfer_seconds(2))
    a.check()
    # B waits while A finishes (A: 8 iterations), then comes back and generates its last 4
    assert res.iterations == 12


def test_recompute_preemption_of_the_same_pair_recomputes():
    a = _alloc(5, 0)
    res = simulate(_pair(), a, max_len=12)
    # B comes back as soon as its 2 blocks fit, cannot take its next step and goes again (the
    # admission counts only the prompt's blocks); each time its first block is still cached (a
    # hit) and the second, with the prompt's last token, is computed again
    assert res.completed and res.preemptions == 2
    assert res.recomputed_tokens == 2 * 4
    assert a.stats.swap_outs == 0


class _Checked(TieredAllocator):
    """Checks every invariant at each iteration's drain."""

    def take_transfer_seconds(self, compute_s: float = 0.0) -> float:
        waited = super().take_transfer_seconds(compute_s)
        self.check()
        return waited


@st.composite
def _workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    reqs = []
    for i in range(draw(st.integers(1, 10))):
        shared = draw(st.integers(0, 2))  # three system prompts: shared prefixes
        segs = ((shared, draw(st.integers(1, 24))), (1000 + i, draw(st.integers(0, 16))))
        n = draw(st.sampled_from([1, 1, 1, 2]))
        reqs.append(Request(f"r{i}", draw(st.floats(0, 0.05)), segs, draw(st.integers(0, 40)), n=n))
    alone = max(r.num_seqs * -(-r.total_len // bs) for r in reqs)
    blocks = alone + 1 + draw(st.integers(0, 12))
    mode = draw(st.sampled_from(["recompute", "swap"]))
    host = draw(st.integers(1 if mode == "swap" else 0, 3 * blocks))
    kw = dict(preemption=mode, write_policy=draw(st.sampled_from(["write-back", "write-through"])),
              copies_per_block=draw(st.sampled_from([None, 1])), hash_algo="builtin",
              watermark=draw(st.sampled_from([0.0, 0.01])))
    guards = draw(st.sampled_from([Guards(), Guards.all_on()]))
    return reqs, bs, blocks, host, kw, guards


@settings(max_examples=60)
@given(_workloads())
def test_random_workloads_finish_on_a_tiered_manager(case):
    reqs, bs, blocks, host, kw, guards = case
    a = _Checked(blocks, bs, host, **kw)
    res = simulate(reqs, a, max_len=max(2, *(r.total_len for r in reqs)), guards=guards,
                   on_livelock="return")
    assert res.livelock is None
    assert res.finished == len(reqs) and res.dropped == 0
    assert a.stats.swap_ins <= a.stats.swap_outs
    if kw["preemption"] == "recompute":
        assert a.stats.swap_outs == 0
    m = a.m
    assert m.num_sequences == 0 and m.usage().used_blocks == 0 and a.kv_tokens == 0
    m.take_transfers()
    assert m.num_free_host_blocks == host
    m.check_invariants()


def test_swapped_requests_holding_shared_blocks_are_restarted_not_the_last_runner_dropped():
    # Found by the random test: r1 (2 samples) ends up the only running request while swapped
    # requests still hold device blocks they share; it is out of blocks, but not because it can
    # never fit. The swapped requests are restarted by recompute and every request finishes.
    def req(i, arrival, segs, out, n):
        return Request(f"r{i}", arrival, segs, out, n=n)

    reqs = [req(0, 0.0, ((0, 2), (1000, 5)), 12, 1), req(1, 0.0, ((0, 8), (1001, 1)), 39, 2),
            req(2, 0.0212, ((2, 6), (1002, 9)), 4, 2), req(3, 0.0331, ((1, 2), (1003, 10)), 27, 2),
            req(4, 0.021, ((1, 1), (1004, 7)), 15, 1), req(5, 0.0072, ((2, 20), (1005, 15)), 40, 1),
            req(6, 0.0482, ((1, 17), (1006, 13)), 34, 1)]
    a = _Checked(105, 1, 208, preemption="swap", write_policy="write-through", hash_algo="builtin",
                 watermark=0.0)
    res = simulate(reqs, a, max_len=max(r.total_len for r in reqs))
    assert res.completed and res.finished == 7 and res.dropped == 0
    assert a.stats.swap_ins < a.stats.swap_outs  # some swapped requests were restarted instead
    assert res.discarded_tokens > 0  # a restarted 2-sample request loses what it generated
