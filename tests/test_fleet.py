"""The fleet: the scheduler's stepping API, the replica allocator, the fleet runner's invariants,
``pagedkv fleet`` and the ``fleet`` report section."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.cli import main
from pagedkv.report import SECTIONS, ReportOptions
from pagedkv.sim.baselines import PagedAllocator
from pagedkv.sim.fleet import ReplicaAllocator, run_fleet
from pagedkv.sim.request import Request
from pagedkv.sim.routers import ROUTERS, LeastLoaded, RoundRobin, make_router
from pagedkv.sim.scheduler import Livelock, Server, simulate
from pagedkv.types import OutOfBlocks

LOG_FIELDS = ("arrival", "first_token", "finish", "preemptions", "recomputed")


def workload(n=60, seed=1, spread=0.5, stems=4):
    """Requests sharing ``stems`` 40-token prefixes, then 5-60 tokens of their own; bursty."""
    rng = np.random.default_rng(seed)
    return [Request(f"q{i}", float(rng.uniform(0, spread)),
                    ((int(rng.integers(0, stems)), 40), (1000 + i, int(rng.integers(5, 60)))),
                    int(rng.integers(20, 300))) for i in range(n)]


def same_log(a, b) -> bool:
    return all(np.array_equal(getattr(a.requests, f), getattr(b.requests, f), equal_nan=True) for f in LOG_FIELDS)


def serve(reqs, alloc, **kw):
    s = Server(alloc, max_len=4000, **kw)
    for r in sorted(reqs, key=lambda r: r.arrival):
        s.submit(r)
    s.drain()
    return s, s.result(requests=reqs)


def needs_msgspec(router: str) -> None:
    if router == "precise":
        pytest.importorskip("msgspec")


# ---- the stepping API -----------------------------------------------------------------------------


def test_server_drained_equals_simulate():
    reqs = workload()
    ref = simulate(reqs, PagedAllocator(90, 16), max_len=4000)
    _, res = serve(reqs, PagedAllocator(90, 16))
    assert same_log(ref, res) and ref.preemptions == res.preemptions > 0
    assert (ref.makespan, ref.finished, ref.usage) == (res.makespan, res.finished, res.usage)
    assert len(res.steps) == len(ref.steps) and np.array_equal(res.steps.dt, ref.steps.dt)


def test_advance_to_runs_only_turns_that_start_before_t():
    a = Request("a", 0.0, ((1, 100),), 50)
    s = Server(PagedAllocator(100, 16))
    s.submit(a)
    assert (s.clock, s.load) == (0.0, 1)
    s.advance_to(0.0)  # nothing starts before 0
    assert s.iterations == 0
    s.advance_to(1e-9)  # the first iteration starts at 0
    assert s.iterations == 1 and s.clock > 1e-9
    t1 = s.clock
    s.advance_to(t1)  # the next one starts at t1: not before t1
    assert s.iterations == 1
    s.advance_to(math.inf)
    assert s.load == 0 and s.result().finished == 1


def test_an_idle_server_does_not_jump_past_the_target():
    s = Server(PagedAllocator(100, 16))
    s.submit(Request("a", 5.0, ((1, 10),), 3))
    s.advance_to(2.0)
    assert s.clock == 0.0 and s.load == 1  # its request has not arrived: nothing to do before 2
    s.advance_to(6.0)
    assert s.clock >= 5.0 and s.iterations >= 1


def test_submit_refuses_duplicates_out_of_order_and_non_requests():
    s = Server(PagedAllocator(100, 16))
    s.submit(Request("a", 1.0, ((1, 10),), 3))
    with pytest.raises(ValueError, match="already submitted"):
        s.submit(Request("a", 2.0, ((1, 10),), 3))
    with pytest.raises(ValueError, match="arrival order"):
        s.submit(Request("b", 0.5, ((1, 10),), 3))
    with pytest.raises(ValueError, match="Request objects"):
        s.submit("c")
    with pytest.raises(ValueError, match="could never run"):
        s.submit(Request("d", 3.0, ((1, 10_000),), 3))
    assert s.load == 1


def test_coalesce_needs_an_allocator_that_steps_many_and_no_step_log():
    with pytest.raises(ValueError, match="coalesce"):
        Server(PagedAllocator(100, 16), record_steps=False, coalesce=True)
    with pytest.raises(ValueError, match="coalesce"):
        Server(ReplicaAllocator(100, 16), coalesce=True)


def test_drain_raises_livelock_with_the_partial_result():
    from pagedkv.sim.scheduler import Guards

    # 400 tokens (25 blocks) on a 20-block cache with the fit check off: it runs out alone, is
    # preempted, and can never be readmitted
    s = Server(PagedAllocator(20, 16, watermark=0.0), guards=Guards(fit_check=False), stall_limit=50)
    s.submit(Request("big", 0.0, ((1, 100),), 300))
    with pytest.raises(Livelock) as exc:
        s.drain()
    assert exc.value.result.livelock.startswith("livelock") and exc.value.result.finished == 0
    assert exc.value.result.preemptions >= 1


# ---- the replica allocator: the same serving as PagedAllocator, faster ---------------------------------


@pytest.mark.parametrize("blocks", [60, 90, 150, 1000])
def test_replica_allocator_serves_like_the_paged_allocator(blocks):
    reqs = workload()
    ref = simulate(reqs, PagedAllocator(blocks, 16), max_len=4000)
    res = simulate(reqs, ReplicaAllocator(blocks, 16), max_len=4000)
    assert same_log(ref, res)
    assert (ref.preemptions, ref.usage.prefix_hit_tokens, ref.usage.evictions, ref.makespan) == \
           (res.preemptions, res.usage.prefix_hit_tokens, res.usage.evictions, res.makespan)
    if blocks <= 90:
        assert ref.preemptions > 0


@pytest.mark.parametrize("blocks", [60, 150, 1000])
def test_coalesced_stretches_keep_every_time_exact(blocks):
    reqs = workload(seed=2)
    _, plain = serve(reqs, ReplicaAllocator(blocks, 16), record_steps=False)
    s, fast = serve(reqs, ReplicaAllocator(blocks, 16), record_steps=False, coalesce=True)
    assert same_log(plain, fast)  # the same floats, not approximately
    assert (plain.preemptions, plain.makespan, plain.usage.prefix_hit_tokens) == \
           (fast.preemptions, fast.makespan, fast.usage.prefix_hit_tokens)
    assert len(fast.steps) == 0 and s.iterations > 0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 40), st.integers(0, 60), st.floats(0, 2)),
                min_size=1, max_size=12),
       st.integers(8, 60))
def test_coalescing_never_changes_a_time(specs, blocks):
    """Any small workload, any cache (preemptions included): coalesced stretches give the same
    first-token and finish times, to the bit, as iteration by iteration."""
    reqs = [Request(f"h{i}", t, ((stem, 16), (500 + i, own)), out)
            for i, (stem, own, out, t) in enumerate(specs)]
    if max(r.total_len for r in reqs) > blocks * 16:
        blocks = -(-max(r.total_len for r in reqs) // 16)
    _, plain = serve(reqs, ReplicaAllocator(blocks, 16, watermark=0.0), record_steps=False)
    _, fast = serve(reqs, ReplicaAllocator(blocks, 16, watermark=0.0), record_steps=False, coalesce=True)
    assert same_log(plain, fast) and plain.preemptions == fast.preemptions


def test_coalesced_iterations_are_counted_one_by_one():
    reqs = workload(seed=3)
    a, _ = serve(reqs, ReplicaAllocator(150, 16), record_steps=False)
    b, _ = serve(reqs, ReplicaAllocator(150, 16), record_steps=False, coalesce=True)
    assert a.iterations == b.iterations and a.busy_s == pytest.approx(b.busy_s, rel=1e-12)


def test_replica_allocator_step_is_atomic_when_blocks_run_out():
    alloc = ReplicaAllocator(4, 4, watermark=0.0)
    a, b = Request("a", 0, ((1, 8),), 10), Request("b", 0, ((2, 8),), 10)
    assert alloc.admit(a) and alloc.admit(b)  # 4 blocks used, both last blocks full
    before = (alloc.kv_tokens, alloc.m.num_free_blocks, alloc.m.num_tokens("a"))
    with pytest.raises(OutOfBlocks):
        alloc.step(["a", "b"])
    assert (alloc.kv_tokens, alloc.m.num_free_blocks, alloc.m.num_tokens("a")) == before
    assert alloc.max_steps(["a", "b"], 10) == 0
    alloc.release("b")
    assert alloc.max_steps(["a"], 10) == 8  # 2 free blocks: 8 more tokens
    with pytest.raises(OutOfBlocks):
        alloc.step_n(["a"], 9)
    assert alloc.step_n(["a"], 8) == 8 and alloc.m.num_tokens("a") == 16
    alloc.check()


def test_replica_allocator_refuses_samples_and_beams():
    with pytest.raises(ValueError, match="single-sequence"):
        ReplicaAllocator(100, 16).admit(Request("a", 0, ((1, 8),), 4, n=2))


# ---- the fleet ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("router", ROUTERS)
def test_one_replica_fleet_is_simulate(router):
    needs_msgspec(router)
    reqs = workload()
    ref = simulate(reqs, ReplicaAllocator(90, 16), max_len=4000)
    res = run_fleet(reqs, make_router(router, key_tokens=40), 1, 90, max_len=4000)
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)
    got = res.replicas[0].requests
    for f in LOG_FIELDS:
        assert np.array_equal(getattr(got, f), getattr(ref.requests, f)[order], equal_nan=True), f
    assert res.hit_tokens == ref.usage.prefix_hit_tokens and res.preemptions == ref.preemptions > 0


@pytest.mark.parametrize("router", ROUTERS)
def test_fleet_results_do_not_depend_on_the_order_replicas_are_advanced(router):
    needs_msgspec(router)
    reqs = workload(n=80, spread=2.0)
    runs = [run_fleet(reqs, make_router(router, key_tokens=40), 4, 120, max_len=4000, advance_order=order)
            for order in (None, [3, 1, 0, 2])]
    a, b = runs
    assert np.array_equal(a.assignment, b.assignment)
    assert np.array_equal(a.ttft(), b.ttft()) and a.hit_tokens == b.hit_tokens
    assert np.array_equal(a.busy_s, b.busy_s) and a.router_stats == b.router_stats


def test_precise_index_equals_what_every_replica_caches_at_every_decision():
    pytest.importorskip("msgspec")
    from pagedkv.sim.routers import PrefixAwareRouter, prompt_array

    reqs = workload(n=70, spread=1.5, stems=5)
    prompts = {r.req_id: prompt_array(r) for r in reqs}
    order = sorted(reqs, key=lambda r: r.arrival)
    checked = []

    def observe(i, replicas, router):
        seen = [prompts[r.req_id] for r in order[: i + 1]]
        for tokens in seen[-12:]:  # the next request and recent ones: what routing depends on
            match = router.match_blocks(tokens)
            assert [b * 16 for b in match] == [rep.alloc.m.lookup(tokens).device for rep in replicas]
        checked.append(i)

    router = PrefixAwareRouter(block_size=16, cache_threshold=0.0)
    res = run_fleet(reqs, router, 3, 70, max_len=4000, observer=observe)
    assert checked == list(range(71))
    assert sum(r.usage.evictions for r in res.replicas) > 0 and res.event_bytes > 0
    assert res.router_stats["affinity"] > 0


def test_fleet_metrics_are_what_the_replicas_measured():
    reqs = workload(n=80, spread=2.0)
    res = run_fleet(reqs, RoundRobin(), 4, 200, max_len=4000, key_tokens=40)
    assert res.requests_per_replica.tolist() == [20, 20, 20, 20]
    assert res.finished == 80 and res.dropped == 0
    assert res.hit_rate == sum(r.usage.prefix_hit_tokens for r in res.replicas) / sum(
        r.usage.prefix_query_tokens for r in res.replicas)
    assert res.imbalance == res.busy_s.max() / res.busy_s.mean() >= 1
    assert len(res.ttft()) == 80 and res.makespan == max(r.makespan for r in res.replicas)
    # 4 stems: each stem's requests landed on every replica under round-robin
    assert res.replicas_per_prefix().tolist() == [4, 4, 4, 4]


def test_ring_keeps_each_prefix_on_one_replica_and_beats_round_robin_on_hits():
    reqs = workload(n=120, spread=3.0, stems=6)
    ring = run_fleet(reqs, make_router("ring", key_tokens=40), 4, 400, max_len=4000, key_tokens=40)
    rr = run_fleet(reqs, RoundRobin(), 4, 400, max_len=4000, key_tokens=40)
    assert ring.replicas_per_prefix().tolist() == [1] * 6
    assert ring.hit_rate > rr.hit_rate


def test_least_loaded_balances_requests_in_flight():
    reqs = [Request(f"q{i}", 0.0, ((i, 10),), 100) for i in range(12)]
    res = run_fleet(reqs, LeastLoaded(), 3, 200, max_len=4000)
    assert res.requests_per_replica.tolist() == [4, 4, 4]


@pytest.mark.parametrize("kw, match", [({"replicas": 0}, "at least one replica"),
                                       ({"num_blocks": 0}, "num_blocks"),
                                       ({"advance_order": [0, 0]}, "permutation")])
def test_run_fleet_refuses_bad_arguments(kw, match):
    args = {"replicas": 2, "num_blocks": 100, **kw}
    with pytest.raises(ValueError, match=match):
        run_fleet(workload(n=3), RoundRobin(), **args)


# ---- pagedkv fleet -----------------------------------------------------------------------------------


def cli(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv, needle", [
    (["--router", "random"], "invalid choice: 'random'"),
    (["--replicas", "0"], "--replicas must be between 1 and 1,024, got 0"),
    (["--num-requests", "lots"], "expected a number of requests or 'all'"),
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--eps", "-1"], "--eps must be a finite number >= 0"),
    (["--vnodes", "0"], "--vnodes must be between 1"),
    (["--cache-threshold", "1"], "--cache-threshold must be a finite number >= 0"),
    (["--balance-rel", "0.5"], "--balance-rel must be a finite number >= 1"),
    (["nowhere.jsonl"], "'nowhere.jsonl' is neither a shipped trace"),
    (["--kv-gib", "0.01", "--num-requests", "50"], "could never run"),
])
def test_fleet_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    rc, out, err = cli(["fleet", *argv], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err


def test_fleet_json_in_a_missing_directory_fails_before_running(capsys, tmp_path):
    rc, out, err = cli(["fleet", "--json", str(tmp_path / "no" / "x.json")], capsys)
    assert rc == 2 and "--json" in err and out == ""


def test_fleet_runs_a_slice_of_the_mooncake_trace(capsys, tmp_path):
    out_json = tmp_path / "fleet.json"
    rc, out, err = cli(["fleet", "--router", "round-robin", "--replicas", "2", "--num-requests", "30",
                        "--json", str(out_json)], capsys)
    assert rc == 0, err
    assert "round-robin" in out and "30 requests on 2 replicas" in out
    assert all(len(line) <= 100 for line in out.splitlines())
    payload = json.loads(out_json.read_text())
    assert payload["requests"] == 30 and payload["results"][0]["finished"] == 30


def test_fleet_on_an_azure_trace_says_it_is_load_only(capsys):
    rc, out, err = cli(["fleet", "azure-conv-trace", "--router", "least-loaded", "--replicas", "2",
                        "--num-requests", "20"], capsys)
    assert rc == 0, err
    assert "no content hashes" in out


# ---- the report section ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_section():
    pytest.importorskip("msgspec")
    from pagedkv.report.fleet import section

    return section(ReportOptions(quick=True))


def test_section_is_registered_and_answers_the_question(quick_section):
    from pagedkv.sim.routers import ring_rsd_theory

    sec = quick_section
    assert SECTIONS["fleet"] == "fleet" and sec.key == "fleet"
    assert len(sec.tables) == 3
    vnodes = sec.data["vnodes"]
    assert [r["k"] for r in vnodes] == [1, 10, 100, 1000]
    for r in vnodes:
        assert r["theory"] == ring_rsd_theory(16, r["k"])
        assert r["share_rsd_p5"] <= r["share_rsd_rms"] <= r["share_rsd_p95"]
    rms = [r["share_rsd_rms"] for r in vnodes]
    assert rms == sorted(rms, reverse=True) and rms[0] > 10 * rms[-1]
    assert sec.data["distinct_keys_512"] == 1  # every Mooncake prompt starts with one system prompt


def test_section_runs_the_routers_on_the_same_slice(quick_section):
    routers = quick_section.data["routers"]
    assert set(routers) == {"round-robin", "ring", "ring-bounded 0.25", "precise"}
    assert len({r["requests"] for r in routers.values()}) == 1
    assert routers["ring"]["replicas_per_prefix_max"] <= 1  # a key has one owner
    eps = {row["eps"]: row for row in quick_section.data["bounded_loads"]}
    assert eps["unbounded"]["overflow"] == 0


def test_section_text_fits_100_columns(quick_section):
    text = quick_section.to_text()
    assert all(len(line) <= 100 for line in text.splitlines())


def test_section_says_how_many_requests_it_replays(quick_section):
    n = quick_section.data["fleet_requests"]
    assert n == 100 and quick_section.data["routers"]["ring"]["requests"] == n
    assert any(f"replay the first {n:,} requests" in t and "pagedkv fleet --num-requests all" in t
               for t in quick_section.text)
