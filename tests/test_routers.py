"""Routers, exactly: ring placement against its documented formula, consistent hashing's moves,
bounded-load caps, the RSD of shares against theory, and the precise router's decisions and its
index, built only from KV events on vLLM's wire format."""
from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from pagedkv import KVCacheManager
from pagedkv.events import encode_vllm
from pagedkv.sim.request import Request
from pagedkv.types import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.sim.routers import (ROUTERS, HashRing, LeastLoaded, PrefixAwareRouter, RingRouter, RoundRobin,
                                 make_router, prefix_key, prefix_keys, prompt_array, ring_rsd_theory)

U64 = (1 << 64) - 1


def splitmix_final(x: int) -> int:
    """splitmix64's finaliser on Python ints: an independent re-implementation for the tests."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & U64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


def documented_points(names, vnodes, seed):
    """(position, replica index) of every point, from HashRing's docstring formula."""
    out = []
    for i, name in enumerate(names):
        base = int.from_bytes(hashlib.blake2b(f"pagedkv-ring/{seed}/{name}".encode(), digest_size=8).digest(), "big")
        out += [(splitmix_final((base + (j + 1) * 0x9E3779B97F4A7C15) & U64), i) for j in range(vnodes)]
    return sorted(out)


def brute_owner(points, key):
    """The owner of the first point at or after ``key``, wrapping."""
    for pos, owner in points:
        if pos >= key:
            return owner
    return points[0][1]


def req(rid: str, segments, arrival=0.0, output=4) -> Request:
    return Request(rid, arrival, tuple(segments), output)


# ---- simple routers --------------------------------------------------------------------------------


def test_round_robin_cycles_and_rebinding_restarts():
    r = RoundRobin()
    r.bind(["a", "b", "c"])
    assert [r.route(None, [9, 0, 0]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    r.bind(["a", "b"])
    assert [r.route(None, [0, 0]) for _ in range(3)] == [0, 1, 0]


def test_least_loaded_takes_the_lowest_index_among_ties():
    r = LeastLoaded()
    r.bind(["a", "b", "c", "d"])
    assert r.route(None, [2, 0, 0, 1]) == 1
    assert r.route(None, [0, 0, 0, 0]) == 0
    assert r.route(None, [5, 4, 3, 9]) == 2


@pytest.mark.parametrize("names", [[], ["a", "a"], ["a", 3]])
def test_bind_refuses_bad_names(names):
    with pytest.raises(ValueError):
        RoundRobin().bind(names)


def test_make_router_knows_every_name_and_refuses_others():
    for name in ROUTERS:
        assert make_router(name).name == name
    with pytest.raises(ValueError, match="unknown router 'random'"):
        make_router("random")


# ---- the ring ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 7])
def test_ring_points_follow_the_documented_formula(seed):
    names = ["r0", "r1", "r2"]
    ring = HashRing(names, vnodes=5, seed=seed)
    expected = documented_points(names, 5, seed)
    assert ring.points.tolist() == [p for p, _ in expected]
    assert ring.owners.tolist() == [o for _, o in expected]


def test_ring_owner_is_the_first_point_clockwise_wrapping():
    names = ["a", "b", "c", "d"]
    ring = HashRing(names, vnodes=3, seed=1)
    pts = documented_points(names, 3, 1)
    rng = np.random.default_rng(0)
    keys = [int(k) for k in rng.integers(0, 2**63, 300, dtype=np.int64)] + [0, U64, pts[0][0], pts[-1][0] + 1]
    for key in keys:
        assert ring.owner(key) == brute_owner(pts, key), key
    assert ring.owners_of(np.array(keys, dtype=np.uint64)).tolist() == [brute_owner(pts, k) for k in keys]


def test_ring_shares_are_the_arcs_before_each_point():
    names = ["a", "b"]
    ring = HashRing(names, vnodes=3, seed=4)
    pts = documented_points(names, 3, 4)
    arcs = [0, 0]
    for i, (pos, owner) in enumerate(pts):
        prev = pts[i - 1][0] if i else pts[-1][0] - 2**64
        arcs[owner] += pos - prev
    assert sum(arcs) == 2**64
    assert ring.shares() == pytest.approx([a / 2**64 for a in arcs], rel=1e-12)


def test_placement_depends_on_names_not_their_order():
    keys = [int(k) for k in np.random.default_rng(1).integers(0, 2**63, 500, dtype=np.int64)]
    a = HashRing(["x", "y", "z"], 10, seed=3)
    b = HashRing(["z", "x", "y"], 10, seed=3)
    assert [a.names[a.owner(k)] for k in keys] == [b.names[b.owner(k)] for k in keys]


def test_adding_a_replica_moves_keys_only_onto_it_about_one_in_n_plus_one():
    keys = np.random.default_rng(2).integers(0, 2**63, 20_000, dtype=np.int64).astype(np.uint64)
    names = [f"r{i}" for i in range(8)]
    before = HashRing(names, 200, seed=0)
    after = HashRing(names + ["new"], 200, seed=0)
    old, new = before.owners_of(keys), after.owners_of(keys)
    moved = old != new
    assert set(new[moved].tolist()) == {8}  # every moved key went to the new replica
    # its expected share is 1/9 with RSD sqrt(8/1801) = 0.067: 0.111 +- 3 sigma
    assert abs(moved.mean() - 1 / 9) < 3 * 0.067 / 9 + 0.01


def test_ring_rsd_theory_values():
    assert ring_rsd_theory(16, 1) == pytest.approx(math.sqrt(15 / 17))
    assert ring_rsd_theory(16, 1000) == pytest.approx(math.sqrt(15 / 16001))
    assert ring_rsd_theory(1, 10) == 0.0
    with pytest.raises(ValueError):
        ring_rsd_theory(0, 1)


@pytest.mark.parametrize("k", [1, 4, 32])
def test_measured_share_rsd_matches_theory(k):
    # E[RSD^2] over random rings is exactly theory^2; 400 rings estimate it within about 10%
    # (the RSD^2 of one ring has a coefficient of variation near 0.5 for n = 8: 0.5/sqrt(400) = 2.5%).
    from pagedkv.report.fleet import vnode_rsd

    r = vnode_rsd(8, k, 400)
    rms = float(np.sqrt(np.mean(r["share"] ** 2)))
    assert rms == pytest.approx(ring_rsd_theory(8, k), rel=0.1)


def test_ring_router_sends_a_prefix_to_its_owner():
    r = RingRouter(vnodes=10, seed=5, key_tokens=32)
    r.bind(["a", "b", "c"])
    q = req("q", [(11, 40), (12, 30)])
    same_start = req("q2", [(11, 32), (99, 50)])  # the same first 32 tokens
    assert r.route(q, [0, 0, 0]) == r.ring.owner(prefix_key(q, 32)) == r.route(same_start, [9, 9, 9])
    assert prefix_key(q, 32) == prefix_key(same_start, 32) != prefix_key(q, 33)


def test_bounded_loads_cap_and_clockwise_overflow():
    r = RingRouter(vnodes=4, eps=0.25, seed=0, key_tokens=16)
    r.bind(["a", "b", "c", "d"])
    q = req("q", [(3, 20)])
    order = list(r.ring.walk(prefix_key(q, 16)))
    assert sorted(order) == [0, 1, 2, 3]
    owner, second, third = order[:3]
    loads = [0, 0, 0, 0]
    # m = 8 + 1 in flight: cap = ceil(1.25 * 9 / 4) = 3
    loads[owner], loads[second] = 3, 3
    loads[third] = 2
    assert r.cap(loads) == 3
    assert r.route(q, loads) == third
    assert r.stats == {"overflow": 1}
    loads[owner] = 2  # under the cap: the owner keeps it, no overflow counted
    assert r.route(q, loads) == owner and r.stats == {"overflow": 1}


def test_bounded_loads_never_exceed_the_cap():
    rng = np.random.default_rng(3)
    r = RingRouter(vnodes=20, eps=0.1, seed=2, key_tokens=8)
    r.bind([f"r{i}" for i in range(5)])
    for i in range(300):
        loads = rng.integers(0, 6, 5).tolist()
        target = r.route(req(f"q{i}", [(int(rng.integers(0, 40)), 10)]), loads)
        assert loads[target] < math.ceil(1.1 * (sum(loads) + 1) / 5)


@pytest.mark.parametrize("kw", [{"vnodes": 0}, {"eps": -0.1}, {"eps": float("nan")}, {"key_tokens": 0},
                                {"seed": -1}])
def test_ring_router_refuses_bad_settings(kw):
    args = {"vnodes": 10, "eps": None, "seed": 0, "key_tokens": 16, **kw}
    with pytest.raises(ValueError):
        RingRouter(**args)


def test_prompt_array_and_prefix_keys_match_the_request_tokens():
    q = req("q", [(5, 10), (6, 7), (7, 20)])
    tokens = np.array(q.prompt_tokens())
    assert np.array_equal(prompt_array(q), tokens)
    assert np.array_equal(prompt_array(q, 12), tokens[:12])
    assert np.array_equal(prompt_array(q, 1000), tokens)
    assert prefix_keys(q, (12, 5)) == [prefix_key(q, 12), prefix_key(q, 5)]
    assert prefix_key(q, 37) == prefix_key(q, 500)  # the whole prompt either way
    with pytest.raises(ValueError):
        prefix_key(q, 0)


# ---- the precise router --------------------------------------------------------------------------------


@pytest.fixture
def wire():
    """The precise router decodes vLLM's msgpack: it needs the events extra (msgspec)."""
    pytest.importorskip("msgspec")


def fed_router(n=3, bs=4, **kw) -> PrefixAwareRouter:
    r = PrefixAwareRouter(block_size=bs, **kw)
    r.bind([f"r{i}" for i in range(n)])
    return r


def publish(router, replica, manager):
    evs = manager.take_events()
    if evs:
        router.on_events(replica, encode_vllm(evs, 1.0))


@pytest.mark.usefixtures("wire")
def test_index_from_events_answers_like_lookup():
    bs = 4
    router = fed_router(2, bs)
    m = [KVCacheManager(16, bs), KVCacheManager(256, bs)]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50, int(rng.integers(5, 30))).tolist() for _ in range(40)]
    for i, p in enumerate(prompts):  # shared stems so that prefixes really repeat
        prompts[i] = prompts[i % 5][:12] + p
    live = [None, None]
    for i, p in enumerate(prompts):
        j = i % 2
        if live[j] is not None:  # one sequence alive per manager; the freed ones stay cached
            m[j].free(live[j])
        m[j].add_sequence(i, p)
        m[j].append_tokens(i, [7, 8, 9])
        live[j] = i
        for k in range(2):
            publish(router, k, m[k])
        for q in prompts[: i + 1]:  # the index agrees with the managers on every prompt seen so far
            match = router.match_blocks(np.array(q))
            assert [b * bs for b in match] == [mk.lookup(q).device for mk in m], (i, q)
    assert m[0].usage().evictions > 0  # the small cache evicted: BlockRemoved was exercised


@pytest.mark.usefixtures("wire")
def test_index_ignores_other_media_and_clears_on_all_blocks_cleared():
    router = fed_router(2, 4)
    stored = BlockStored((b"\x01" * 32, b"\x02" * 32), None, tuple(range(8)), 4)
    router.on_events(0, encode_vllm([stored], 1.0))
    router.on_events(1, encode_vllm([stored._replace(medium="CPU")], 1.0))
    h1, h2 = int.from_bytes(b"\x01" * 8, "big"), int.from_bytes(b"\x02" * 8, "big")
    assert router.blocks_held(0) == {h1, h2} and router.blocks_held(1) == frozenset()
    router.on_events(0, encode_vllm([BlockRemoved((b"\x02" * 32,))], 2.0))
    assert router.blocks_held(0) == {h1}
    router.on_events(0, encode_vllm([AllBlocksCleared()], 3.0))
    assert router.blocks_held(0) == frozenset()


@pytest.mark.usefixtures("wire")
def test_index_refuses_another_block_size_and_unknown_replicas():
    router = fed_router(2, 4)
    stored = BlockStored((b"\x01" * 32,), None, tuple(range(16)), 16)
    with pytest.raises(ValueError, match="blocks of 16 tokens"):
        router.on_events(0, encode_vllm([stored], 1.0))
    with pytest.raises(ValueError, match="replica 5"):
        router.on_events(5, encode_vllm([], 1.0))


def warm(router, replica, tokens, bs=4):
    m = KVCacheManager(64, bs)
    m.add_sequence("x", tokens)
    publish(router, replica, m)


@pytest.mark.usefixtures("wire")
def test_precise_routes_to_the_longest_match_ties_to_least_loaded():
    q = req("q", [(11, 24), (12, 1)])  # 25 tokens: 6 full blocks of 4, the last token never matches
    tokens = prompt_array(q).tolist()
    router = fed_router(3, 4, cache_threshold=0.0)
    warm(router, 0, tokens[:9])  # 2 full blocks cached on replica 0
    warm(router, 1, tokens)
    warm(router, 2, tokens)
    assert router.match_blocks(q) == [2, 6, 6]
    assert router.route(q, [0, 3, 1]) == 2  # 1 and 2 tie on 6 blocks: the less loaded
    assert router.route(q, [0, 1, 3]) == 1
    assert router.route(q, [0, 2, 2]) == 1  # a tie in load too: the lower index
    assert router.stats == {"affinity": 3}


@pytest.mark.usefixtures("wire")
def test_precise_cache_threshold_sends_small_matches_to_the_least_loaded():
    q = req("q", [(11, 24), (12, 1)])
    tokens = prompt_array(q).tolist()
    router = fed_router(3, 4, cache_threshold=0.5)
    warm(router, 0, tokens[:13])  # 3 blocks = 12 of 25 tokens: 48%, not above 0.5
    assert router.route(q, [1, 0, 0]) == 1
    warm(router, 2, tokens[:17])  # 4 blocks = 16 tokens: 64%
    assert router.route(q, [1, 0, 5]) == 2
    assert router.stats == {"below_threshold": 1, "affinity": 1}


@pytest.mark.usefixtures("wire")
def test_precise_load_guard_is_sglangs_rule():
    q = req("q", [(11, 24), (12, 1)])
    router = fed_router(3, 4, balance_abs=32, balance_rel=1.5)
    warm(router, 0, prompt_array(q).tolist())
    # max - min = 40 > 32 and 40 > 1.5 x 0: imbalanced, the least loaded wins over the match
    assert router.imbalanced([40, 0, 5]) and router.route(q, [40, 0, 5]) == 1
    # a gap of 32 is not more than 32; 60 vs 40 is a gap of 20: balanced, the match wins
    assert not router.imbalanced([32, 0, 5]) and router.route(q, [32, 0, 5]) == 0
    assert not router.imbalanced([60, 40, 45])
    # a gap of 33 with max 99 > 1.5 x 66 = 99 is false: not imbalanced
    assert not router.imbalanced([99, 66, 70]) and router.imbalanced([100, 66, 70])
    assert router.stats == {"guard": 1, "affinity": 1}


@pytest.mark.parametrize("kw", [{"block_size": 0}, {"balance_abs": -1}, {"balance_rel": 0.5},
                                {"cache_threshold": 1.0}, {"cache_threshold": -0.1}, {"hash_algo": "md5"}])
def test_precise_router_refuses_bad_settings(kw):
    with pytest.raises(ValueError):
        PrefixAwareRouter(**kw)
