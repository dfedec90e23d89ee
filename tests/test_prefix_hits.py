"""The prefix-hit report section: the real manager against an independent count from hash_ids."""
from __future__ import annotations

import json
import math

import pytest

from pagedkv.report.options import ReportOptions
from pagedkv.report.prefix_hits import ideal_hits, replay, section
from pagedkv.sim.request import Request
from pagedkv.sim.traces import load_mooncake_jsonl


def test_ideal_hits_worked_example():
    recs = [(1024, [0, 1]), (1024, [0, 2]), (1000, [0, 2])]
    assert ideal_hits(recs) == (512 + 1000, 3048)
    # Manager rules at block size 16: full blocks only, the last prompt token computed.
    assert ideal_hits(recs, 16) == (512 + 992, 3048)
    with pytest.raises(ValueError):
        ideal_hits(recs, 0)


def test_replay_small_cache_evicts_and_skips(tmp_path):
    lines = [{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [0, 1]},
             {"timestamp": 0, "input_length": 4000, "output_length": 8, "hash_ids": list(range(2, 10))},
             {"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [0, 1]}]
    p = tmp_path / "mc.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines))
    reqs = load_mooncake_jsonl(p)
    big = replay(reqs, 1000, 16)
    assert big.hit_tokens == 1008 and big.evictions == 0 and big.skipped == 0
    small = replay(reqs, 100, 16)  # the 4000-token request (250 blocks) cannot fit at all
    assert small.skipped == 1 and small.hit_tokens == 1008
    reqs[1] = Request("mid", 0.0, ((123456789, 1000),), 8)  # other content
    tiny = replay(reqs, 66, 16, max_running=1)
    # Request 0 holds 65 blocks (64 published); when it finishes, "mid" (1008 tokens, 63 blocks)
    # takes the 2 clean blocks and evicts 61 cached ones, tail first, so request 2 finds only the
    # first 3 blocks of request 0's prompt (48 tokens) and evicts 62 more for the rest.
    assert tiny.evictions == 61 + 62 and tiny.hit_tokens == 48 and tiny.skipped == 0
    with pytest.raises(ValueError):
        replay(reqs, 0, 16)


def test_quick_section_matches_the_independent_count(monkeypatch):
    monkeypatch.delenv("PAGEDKV_DATA", raising=False)  # the trace shipped with the package
    seen = []
    sec = section(ReportOptions(quick=True, progress=seen.append))
    d = sec.data
    blocks = [c["blocks"] for c in d["by_capacity"]]  # each replay announced as it starts
    assert seen == [f"prefix_hits, first 200: capacity {k}/2 ({b:,} blocks of 16), 200 requests"
                    for k, b in enumerate(blocks, 1)]
    assert d["requests"] == 200 and d["full_trace_requests"] == 12_031
    assert d["unbounded_hit_rate"] == d["ideal_hit_rate"]  # exact: same rules, no model
    # Data README: ~37% with an unbounded cache over the whole trace (tolerance 1 point).
    assert abs(d["ideal_hit_rate_full_trace"] - 0.37) < 0.01
    rates = [c["hit_rate"] for c in d["by_capacity"]]
    assert rates == sorted(rates) and rates[0] < rates[-1]  # more capacity, more hits
    t = sec.tables[0]
    assert t.plot and all(isinstance(v, (int, float)) for v in t.column(t.plot["x"]))
    assert all(not math.isnan(v) for v in t.column("hit rate (manager) %"))
    json.dumps(sec.to_dict())


def test_section_without_data(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDKV_DATA", str(tmp_path / "nowhere"))
    sec = section(ReportOptions(quick=True))
    assert sec.data["skipped"] and "not found" in sec.to_text()
    with pytest.raises(ValueError):
        section("quick")


def test_replay_reports_progress_by_quarters(tmp_path):
    lines = [{"timestamp": i, "input_length": 100, "output_length": 1, "hash_ids": [i]} for i in range(8)]
    p = tmp_path / "mc.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines))
    seen = []
    res = replay(load_mooncake_jsonl(p), 100, 16, progress=seen.append)
    assert seen == [2, 4, 6] and res.requests == 8

