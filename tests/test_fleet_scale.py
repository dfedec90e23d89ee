"""``benchmarks/fleet_scale.py``: its plan covers what the scale claim needs, its growth fit is
right on known power laws, and what it times is the run ``pagedkv fleet`` makes. Speed itself is
never asserted (machines differ); docs/design.md quotes the measured table."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from pagedkv.sim.fleet import run_fleet
from pagedkv.sim.routers import make_router
from pagedkv.sim.traces import load_mooncake_jsonl, trace_path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "fleet_scale.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("fleet_scale", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def mooncake():
    path = trace_path("mooncake")
    if path is None:
        pytest.skip("the Mooncake trace is not shipped in this checkout")
    return path


def test_growth_exponent_recovers_power_laws(bench):
    x = [1, 2, 4, 8, 16, 32]
    assert bench.growth_exponent(x, [3 * v**1.5 for v in x]) == pytest.approx(1.5)
    assert bench.growth_exponent(x, [7.0] * len(x)) == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(bench.growth_exponent([4], [1.0])) and math.isnan(bench.growth_exponent([4, 4], [1.0, 2.0]))


def test_full_plan_sweeps_replicas_and_lengths_up_to_the_whole_trace_on_16(bench):
    runs = bench.plan_runs(bench.FULL, 12_031)
    assert runs == [(1, 1504), (2, 1504), (4, 1504), (8, 1504), (16, 1504), (32, 1504),
                    (16, 3008), (16, 6016), (16, 12_031)]
    assert bench.FULL["cli_requests"] is None and bench.FULL["cli_replicas"] == 16
    assert bench.ROUTERS == ("round-robin", "ring-bounded", "precise")
    assert bench.cli_command("precise", None, 16) == ["fleet", "--num-requests", "all", "--replicas", "16",
                                                      "--router", "precise"]


def test_a_timed_run_is_the_run_pagedkv_fleet_makes(bench, mooncake):
    r = bench.measure(mooncake, 40, "round-robin", 2)
    direct = run_fleet(load_mooncake_jsonl(mooncake, limit=40), make_router("round-robin"), 2,
                       bench.blocks_per_replica(), max_len=bench.MAX_LEN)
    assert r["requests"] == 40 and r["hit_rate"] == direct.hit_rate
    assert r["iterations"] == int(direct.iterations.sum())
    assert 0 < r["load_s"] <= r["wall_s"] and r["cpu_s"] > 0


def test_the_command_is_timed_in_a_child_process_and_a_failure_is_reported(bench, mooncake):
    r = bench.measure_cli("round-robin", 20, 2)
    assert r["command"] == "pagedkv fleet --num-requests 20 --replicas 2 --router round-robin"
    assert r["wall_s"] > 0 and r["cpu_s"] > 0
    with pytest.raises(RuntimeError, match="exited 2"):
        bench.measure_cli("round-robin", 20, 0)
