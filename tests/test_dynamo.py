"""pagedkv replicas routed by a real NVIDIA Dynamo KV indexer (``python -m dynamo.indexer``).

Each test starts the indexer as a child process on a loopback port (``--threads 1``), publishes
pagedkv's KV events to it over ZMQ and compares its ``/query`` answers with each replica's own
``lookup``. Dynamo counts the block that holds a prompt's last token and ``lookup`` does not, so
the exact expectation for a prompt ``q`` is ``lookup(q + [t])`` for any token ``t``. Everything is
bounded in time (the router's sync timeout, the indexer's start-up wait). The module skips when
the ``dynamo`` extra is not installed (under CI nothing may skip: CI installs it).
"""
from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("msgspec")
pytest.importorskip("zmq")
from pagedkv.sim.dynamo_router import DynamoIndexer, DynamoRouter, dynamo_installed  # noqa: E402

if not dynamo_installed():
    pytest.skip('needs the dynamo extra: pip install "pagedkv[dynamo]"', allow_module_level=True)

from pagedkv import KVCacheManager  # noqa: E402
from pagedkv.cli import main  # noqa: E402
from pagedkv.events import KVEventPublisher, encode_vllm  # noqa: E402
from pagedkv.sim.fleet import run_fleet  # noqa: E402
from pagedkv.sim.request import Request  # noqa: E402
from pagedkv.sim.routers import PrefixAwareRouter  # noqa: E402

BS = 16


def stem(i: int, n: int) -> list[int]:
    return [(1000 * i + j) % 30_000 for j in range(n)]


def deliver(router, managers):
    for i, m in enumerate(managers):
        evs = m.take_events()
        if evs:
            router.on_events(i, encode_vllm(evs, time.time()))


def expected(m: KVCacheManager, q: list[int]) -> int:
    """Dynamo's overlap for ``q`` on a replica: ``lookup`` with the last block counted."""
    return int(m.lookup(q + [0]))


@pytest.fixture
def fleet():
    """Three replicas (small pools, so admissions evict) behind a router on a fresh indexer."""
    router = DynamoRouter(BS, sync_timeout=20.0)
    router.bind(["r0", "r1", "r2"])
    managers = [KVCacheManager(num_blocks=24, block_size=BS) for _ in range(3)]
    yield router, managers
    router.close()


def test_overlap_equals_lookup_through_admissions_evictions_and_reset(fleet):
    router, managers = fleet
    rng = np.random.default_rng(7)
    queries = [stem(i, n) for i in range(6) for n in (15, 16, 17, 48, 50, 64, 100)]
    checked = 0
    for step in range(30):
        r = int(rng.integers(0, 3))
        m = managers[r]
        prompt = stem(int(rng.integers(0, 6)), int(rng.integers(10, 120)))
        sid = f"s{step}"
        try:
            m.add_sequence(sid, prompt)
        except Exception:  # OutOfBlocks: free everything and retry once
            for s in m.seq_ids():
                m.free(s)
            m.add_sequence(sid, prompt)
        if rng.random() < 0.6:
            m.free(sid)
        if step == 20:  # one replica drops its whole cache
            for s in managers[1].seq_ids():
                managers[1].free(s)
            assert managers[1].reset_prefix_cache()
        deliver(router, managers)
        for q in queries[step % 7 :: 5]:
            got = router.overlap_tokens(q)
            assert got == [expected(mm, q) for mm in managers], (step, len(q))
            checked += 1
    assert checked > 100
    assert sum(m.usage().evictions for m in managers) > 0
    assert router.stats.get("sentinel_resent", 0) <= 3


def test_late_joiner_is_replayed_from_the_replay_socket():
    """A replica that published before it registered: the indexer asks its replay socket for
    everything from the start, and then agrees with lookup."""
    m = KVCacheManager(num_blocks=64, block_size=BS)
    q = stem(3, 70)
    with DynamoIndexer() as idx, KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        m.add_sequence("a", q)
        pub.publish(m.take_events())
        m.add_sequence("b", stem(4, 40))
        pub.publish(m.take_events())
        idx.register(5, pub.endpoint, pub.replay_endpoint, "late", BS)
        deadline = time.monotonic() + 20
        want = {5: expected(m, q)}
        while idx.query(q, "late") != want:
            assert time.monotonic() < deadline, idx.query(q, "late")
            m.add_sequence(f"nudge{time.monotonic()}", stem(9, 5))  # a later batch reveals the gap
            pub.publish(m.take_events() or [])
            time.sleep(0.05)
        assert want == {5: 64}


def workload(n=40, seed=3):
    """Requests over 3 shared stems; lengths include multiples of the block size (48, 64)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        s = int(rng.integers(0, 3))
        own = int(rng.choice([0, 8, 16, 30]))
        out.append(Request(f"q{i}", 0.05 * i, ((s, 48), (1000 + i, own)) if own else ((s, 48),),
                           int(rng.integers(4, 40))))
    return out


def test_fleet_routes_as_the_precise_router():
    """Two routers, one trace: the same choices, hit rate and TTFT; every Dynamo answer equals the
    in-process index or exceeds it by the prompt's last block only."""
    reqs = workload()
    dyn = DynamoRouter(BS, sync_timeout=20.0)
    try:
        a = run_fleet(reqs, dyn, replicas=2, num_blocks=40, block_size=BS)
    finally:
        dyn.close()
    b = run_fleet(reqs, PrefixAwareRouter(BS), replicas=2, num_blocks=40, block_size=BS)
    assert a.assignment.tolist() == b.assignment.tolist()
    assert a.hit_rate == b.hit_rate and a.imbalance == b.imbalance
    assert np.array_equal(a.ttft(), b.ttft(), equal_nan=True)
    stats = a.router_stats
    assert stats.get("dynamo_other", 0) == 0
    assert stats.get("dynamo_last_block", 0) > 0  # 48-token prompts held whole
    assert stats.get("dynamo_equal", 0) + stats.get("dynamo_last_block", 0) + stats.get("guard", 0) == len(reqs)


def test_cli_prints_dynamo_beside_precise(capsys):
    assert main(["fleet", "--router", "dynamo", "--replicas", "2", "--num-requests", "40",
                 "--kv-gib", "4", "--max-len", "16384"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("precise ", "dynamo "))]
    assert [r[0] for r in rows[:2]] == ["precise", "dynamo"]
    assert rows[0][1:4] == rows[1][1:4]  # hit %, imbalance, TTFT p50
    assert "dynamo_other" not in out


def test_cli_unreachable_indexer_is_one_line(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["fleet", "--router", "dynamo", "--replicas", "2", "--num-requests", "5",
                 "--indexer-url", f"http://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv fleet: error: --router dynamo: no Dynamo indexer answered")
    assert "Traceback" not in err
    assert main(["fleet", "--router", "precise", "--indexer-url", "http://x"]) == 2
    assert "--indexer-url is for --router dynamo" in capsys.readouterr().err
