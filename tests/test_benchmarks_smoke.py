"""The benchmark scripts run and produce well-formed rows.

Only shape is checked: every row has a positive median and the documented keys. Speed is never
asserted in tests (machines differ; benchmarks/run.py reports medians against the targets of docs/design.md).
"""
from __future__ import annotations

import math
import pytest

@pytest.fixture(scope="module")
def bench_modules():
    from pagedkv.bench import core, harness

    return core, harness


def test_harness_setup_runs_outside_timing(bench_modules):
    _, harness = bench_modules
    calls = []

    def setup():
        calls.append("setup")
        return len(calls)

    t = harness.measure(lambda s: calls.append(("fn", s)), setup=setup,
                        teardown=lambda s: calls.append(("td", s)), repeat=7, warmup=2, ops=3)
    assert t.n == 7
    assert calls.count("setup") == 9
    assert t.median_us > 0 and t.p10_us <= t.median_us <= t.p90_us


def test_core_rows_quick(bench_modules):
    bench_core, _ = bench_modules
    rows = bench_core.rows(quick=True)
    names = [r["name"] for r in rows]
    assert len(names) == len(set(names))
    for r in rows:
        assert set(r) == {"name", "median", "unit", "target", "note"}, r
        assert isinstance(r["median"], float) and math.isfinite(r["median"]) and r["median"] > 0, r
        assert r["target"] is None or r["target"] > 0
    for key in ("append_batch", "append_token", "fork", "free", "build manager",
                "bookkeeping", "block_tables", "flashinfer_layout",
                "replay sha256: per admission", "replay sha256: per decoded token",
                "replay sha256: per finish", "replay: hit tokens", "replay builtin"):
        assert any(n.startswith(key) for n in names), key


def test_store_rows_quick():
    """The store's benchmark rows (copy throughput, paged vs dense attention) are well formed."""
    pytest.importorskip("torch")
    from pagedkv.bench import store

    rows = store.rows(quick=True)
    assert rows
    for r in rows:
        assert math.isfinite(r["median"]) and r["median"] > 0, r


def test_pagedkv_bench_command_prints_the_table(capsys, monkeypatch):
    """`pagedkv bench --quick` runs end to end and prints the ratio column."""
    from pagedkv import cli
    from pagedkv.bench import core

    monkeypatch.setattr(core, "rows", lambda quick=False: [
        {"name": "x", "median": 2.0, "unit": "µs", "target": 4.0, "note": ""}])
    monkeypatch.setattr("pagedkv.commands.bench._optional_rows", lambda module, quick: [])
    assert cli.main(["bench", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "ratio" in out and "0.50" in out
