"""The fleet report section without the ``events`` extra: the precise router still runs, its index
fed from the replicas' in-process KV events, and its row is in the routers table.

After ``pip install ".[plot]"`` (no msgspec) the precise router's row must not be left out.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from pagedkv.report import ReportOptions
from pagedkv.sim.fleet import run_fleet
from pagedkv.sim.request import Request
from pagedkv.sim.routers import PrefixAwareRouter


def _workload(n=60, seed=3):
    rng = np.random.default_rng(seed)
    return [Request(f"q{i}", float(rng.uniform(0, 0.5)),
                    ((int(rng.integers(0, 4)), 48), (1000 + i, int(rng.integers(5, 60)))),
                    int(rng.integers(20, 200))) for i in range(n)]


def test_in_process_events_need_no_msgspec(monkeypatch):
    monkeypatch.setitem(sys.modules, "msgspec", None)  # import msgspec now raises ImportError
    res = run_fleet(_workload(), PrefixAwareRouter(16), 4, 40, block_size=16, wire=False)
    assert res.router_stats.get("affinity", 0) > 0  # the index was built: the prefix was followed


def test_in_process_events_refuse_what_is_not_an_event():
    router = PrefixAwareRouter(16)
    router.bind(["a", "b"])
    with pytest.raises(ValueError, match="not a KV event"):
        router.on_events(0, ["stored"])
    with pytest.raises(ValueError, match="replica 2"):
        router.on_events(2, [])


@pytest.fixture(scope="module")
def section_without_msgspec():
    from pagedkv.report.fleet import section

    mp = pytest.MonkeyPatch()
    mp.setitem(sys.modules, "msgspec", None)
    try:
        return section(ReportOptions(quick=True))
    finally:
        mp.undo()


def test_precise_row_without_the_events_extra(section_without_msgspec):
    sec = section_without_msgspec
    assert "precise" in sec.data["routers"]
    assert any("handed over in process" in t for t in sec.text)


def test_the_text_says_where_the_ring_loses(section_without_msgspec):
    sec = section_without_msgspec
    ring, rr = sec.data["routers"]["ring"], sec.data["routers"]["round-robin"]
    text = " ".join(sec.text)
    assert f"The ring hits {100 * ring['hit_rate']:.1f}% of prompt tokens against round-robin's" in text
    if ring["ttft_p90_s"] > rr["ttft_p90_s"]:
        assert f"{1e3 * ring['ttft_p90_s']:.0f} ms against" in text and "loses on TTFT" in text
    if ring["imbalance"] > rr["imbalance"]:
        assert f"imbalance {ring['imbalance']:.2f} against {rr['imbalance']:.2f}" in text
