"""Normalized latency against request rate (the vLLM paper's Fig. 12-13) and the preemption anatomy.

The sustained-rate reading is checked on synthetic curves with exact answers; the sweep is
checked on the report section's --quick run (once per module, about three seconds): curves that
rise with the rate, paging ahead of Orca Max and Oracle, ratios that are the curves' own
readings, and the JSON a reader of report.json relies on. Serving a single request must give the
closed-form latency alone, and reservations stepped in stretches must keep every time exact.
"""
from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from pagedkv.report import SECTIONS, latency_rate as section_mod, write_report
from pagedkv.report.findings import findings
from pagedkv.report.options import ReportOptions
from pagedkv.sim.baselines import ReservationAllocator
from pagedkv.sim.costmodel import CostModel
from pagedkv.sim.latency_rate import (SYSTEMS, make_system, normalized_latency, serve_point, sustained_rate, sweep,
                                      unloaded_latency)
from pagedkv.sim.preemptions import anatomy
from pagedkv.sim.request import Request
from pagedkv.sim.scheduler import Server, simulate
from pagedkv.sim.workloads import load_workload

COST = CostModel.for_model("OPT-13B")


# ---- the reading: synthetic curves ---------------------------------------------------------------


def test_crossing_is_interpolated_in_log_latency():
    s = sustained_rate([1, 2, 3], [0.02, 0.03, 0.12], 0.06)
    assert s.bound == "=" and s.exact and s.rate == pytest.approx(2.5, abs=1e-12)


def test_first_crossing_ends_the_curve_later_points_are_not_read():
    # dips back under the threshold at 4: the curve has already exploded at 2
    s = sustained_rate([1, 2, 3, 4], [0.01, 0.04, 0.08, 0.01], 0.02)
    assert s.bound == "=" and 1 < s.rate < 2
    assert s.rate == pytest.approx(1 + math.log(2) / math.log(4))


def test_a_curve_at_the_threshold_is_above_it():
    assert sustained_rate([1, 2], [0.01, 0.02], 0.02).rate == pytest.approx(2.0)


def test_bounds_outside_the_sweep():
    never = sustained_rate([1, 2, 4], [0.01, 0.011, 0.012], 0.05)
    assert (never.rate, never.bound, never.exact) == (4.0, ">=", False)
    always = sustained_rate([1, 2, 4], [0.06, 0.07, 0.08], 0.05)
    assert (always.rate, always.bound, always.exact) == (1.0, "<", False)


def test_a_rate_that_served_nothing_counts_as_exploded():
    assert sustained_rate([1, 2, 3], [0.01, 0.02, math.nan], 0.05) == sustained_rate([1, 2, 3], [0.01, 0.02, 0.05], 0.05)
    assert sustained_rate([1, 2, 3], [0.01, 0.02, math.nan], 0.05).rate == 3.0


@pytest.mark.parametrize("rates,lats,thr,needle", [
    ([1, 2], [0.1], 0.2, "same non-zero length"), ([], [], 0.2, "same non-zero length"),
    ([1, 2], [0.1, 0.2], 0.0, "threshold"), ([1, 2], [0.1, 0.2], -1, "threshold"),
    ([2, 1], [0.1, 0.2], 0.2, "increasing"), ([1, 1], [0.1, 0.2], 0.2, "increasing")])
def test_reading_refuses_bad_input(rates, lats, thr, needle):
    with pytest.raises(ValueError, match=needle):
        sustained_rate(rates, lats, thr)


def test_normalized_latency_is_the_mean_of_per_request_ratios():
    # the docstring's example: 1 s over 10 tokens and 5 s over 100: (0.1 + 0.05) / 2
    got = normalized_latency(np.array([0.0, 2.0]), np.array([1.0, 7.0]), np.array([10.0, 100.0]))
    assert got == pytest.approx(0.075)
    assert normalized_latency(np.array([0.0, 1.0]), np.array([2.0, np.nan]), np.array([4.0, 4.0])) == 0.5
    assert math.isnan(normalized_latency(np.array([0.0]), np.array([np.nan]), np.array([4.0])))


# ---- serving: one request alone, stretches exact -------------------------------------------------


@pytest.mark.parametrize("system", SYSTEMS)
def test_one_request_alone_takes_the_closed_form_latency(system):
    req = Request("a", 0.0, ((7, 161),), 338)
    point = serve_point([req], system, 983, 16, COST, 2048, rate=1.0)
    assert point.normalized_latency == pytest.approx(unloaded_latency([req], COST), rel=1e-9)
    assert (point.mean_batch, point.preemptions, point.finished) == (1.0, 0, 1)


def test_unloaded_latency_by_hand():
    # prompt 3, output 2: iteration 1 prefills 3 and reads 4 token states, iteration 2 reads 5
    req = Request("a", 0.0, ((7, 3),), 2)
    expected = (COST.step_time(4, 3) + COST.step_time(5)) / 2
    assert unloaded_latency([req], COST) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="empty"):
        unloaded_latency([], COST)


@pytest.mark.parametrize("policy", ["max", "pow2", "oracle"])
def test_reservations_coalesced_keep_every_time_exact(policy):
    reqs = load_workload("sharegpt", 40, 3, max_len=2048, rate=1.5)
    ref = simulate(reqs, ReservationAllocator(983 * 16, policy), COST, max_len=2048)
    s = Server(ReservationAllocator(983 * 16, policy), COST, max_len=2048, record_steps=False, coalesce=True)
    for r in reqs:
        s.submit(r)
    s.drain()
    fast = s.result(requests=reqs)
    assert np.array_equal(ref.requests.finish, fast.requests.finish)  # the same floats
    assert np.array_equal(ref.requests.first_token, fast.requests.first_token)
    assert s.iterations == ref.iterations and fast.makespan == ref.makespan


def test_reservation_stretch_stops_at_the_first_final_length():
    alloc = ReservationAllocator(4096, "oracle")
    alloc.admit(Request("a", 0, ((1, 10),), 5))
    alloc.admit(Request("b", 0, ((2, 10),), 9))
    assert alloc.max_steps(["a", "b"], 7) == 5 and alloc.max_steps(["b"], 7) == 7
    before = alloc.kv_tokens
    with pytest.raises(ValueError, match="past its final length"):
        alloc.step_n(["a", "b"], 6)
    assert alloc.kv_tokens == before  # nothing changed
    assert alloc.step_n(["a", "b"], 5) == 10 and alloc.kv_tokens == before + 10
    alloc.check()


def test_make_system_and_sweep_refuse_bad_input():
    with pytest.raises(ValueError, match="system must be one of"):
        make_system("lru", 983, 16, 2048)
    with pytest.raises(ValueError, match="num_blocks"):
        make_system("paged", 0, 16, 2048)
    reqs = lambda rate: load_workload("sharegpt", 5, 0, max_len=2048, rate=rate)  # noqa: E731
    for rates in ([2.0, 1.0], [], [1.0, 1.0]):
        with pytest.raises(ValueError, match="increasing"):
            sweep(reqs, rates, 983, 16, COST, 2048)
    with pytest.raises(ValueError, match="rate"):
        sweep(reqs, [0.0, 1.0], 983, 16, COST, 2048)
    with pytest.raises(ValueError, match="system must be one of"):
        sweep(reqs, [1.0], 983, 16, COST, 2048, systems=("paged", "fifo"))
    with pytest.raises(ValueError, match="requests must not be empty"):
        serve_point([], "paged", 983, 16, COST, 2048)


# ---- the preemption anatomy ----------------------------------------------------------------------


def test_anatomy_counts_the_fig2_runs_preemptions():
    """The anatomy's run is the Fig. 2 section's saturated paged run: the same preemptions."""
    from pagedkv.report.fig2 import paper_setup, run_one

    reqs = load_workload("sharegpt", 150, 0, max_len=2048)
    num_blocks, cost = paper_setup(16)
    res, _ = run_one(reqs, "paged", 16)
    a = anatomy(reqs, num_blocks, 16, cost, 2048)
    assert a.preemptions == res.preemptions > 0
    assert a.watermark_blocks == int(0.01 * num_blocks) == 9
    assert a.requests == 150 and a.preempted >= a.repeated > 0 and a.most >= 2
    assert a.loaded_preemptions <= a.preemptions and a.loaded_finishes <= 150
    assert a.freed_median <= a.freed_mean * 2 and a.growth_per_step > 0
    assert a.predicted() == pytest.approx(a.per_finish * a.loaded_finishes)
    assert a.per_finish == pytest.approx((a.growth_between_finishes - a.watermark_blocks) / a.freed_mean)


def test_anatomy_refuses_a_run_without_preemptions():
    reqs = load_workload("sharegpt", 3, 0, max_len=2048)
    with pytest.raises(ValueError, match="preempted nothing"):
        anatomy(reqs, 983, 16, COST, 2048)
    with pytest.raises(ValueError, match="empty"):
        anatomy([], 983, 16, COST, 2048)


# ---- the report section (--quick) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_section():
    t0 = time.process_time()
    sec = section_mod.section(ReportOptions(quick=True))
    return sec, time.process_time() - t0


def test_section_is_registered_right_after_fig2():
    keys = list(SECTIONS)
    assert keys[keys.index("fig2") + 1] == "latency_rate"


def test_quick_mode_is_fast(quick_section):
    _, cpu = quick_section
    assert cpu < 10  # about 2.5 s of CPU on a 2-core machine; the budget is 3


def test_curves_rise_with_the_rate(quick_section):
    """Latency never falls by more than noise as the rate rises, and every system ends above
    where it starts; the same lengths at every rate make the curves comparable point by point."""
    sec, _ = quick_section
    for label, w in sec.data["workloads"].items():
        for system, pts in w["curves"].items():
            lat = [p["normalized_latency"] for p in pts]
            assert all(b >= 0.98 * max(lat[:i + 1]) for i, b in enumerate(lat[1:])), (label, system, lat)
            assert lat[-1] > lat[0] >= w["unloaded_s_per_token"] * 0.999, (label, system)
            assert all(p["finished"] == w["num_requests"] for p in pts)


def test_paging_sustains_more_than_max_and_oracle(quick_section):
    sec, _ = quick_section
    w = sec.data["workloads"]["ShareGPT-like"]
    head = next(s for s in w["sustained"] if s["multiple"] == sec.data["headline_threshold"])
    rate = head["rate"]
    assert rate["paged"] > rate["oracle"] > rate["max"]
    assert head["bound"]["oracle"] == head["bound"]["max"] == "="
    assert head["paged_over"]["oracle"] > 1 and head["paged_over"]["max"] > head["paged_over"]["oracle"]
    for wl in sec.data["workloads"].values():  # batching: paging holds the most requests under load
        top = wl["batch"][-1]["by_system"]
        assert top["paged"] >= top["oracle"] > top["max"]


def test_ratios_are_read_off_the_curves(quick_section):
    sec, _ = quick_section
    for w in sec.data["workloads"].values():
        for entry in w["sustained"]:
            thr = entry["multiple"] * w["unloaded_s_per_token"]
            assert entry["threshold_s_per_token"] == pytest.approx(thr)
            for system, pts in w["curves"].items():
                got = sustained_rate([p["rate"] for p in pts], [p["normalized_latency"] for p in pts], thr)
                assert (entry["rate"][system], entry["bound"][system]) == (got.rate, got.bound)
            for other in ("oracle", "pow2", "max"):
                ratio = entry["paged_over"][other]
                if entry["bound"]["paged"] == entry["bound"][other] == "=":
                    assert ratio == round(entry["rate"]["paged"] / entry["rate"][other], 2)
                else:
                    assert ratio is None


def test_section_json_has_the_fields(quick_section, tmp_path):
    sec, _ = quick_section
    opts = ReportOptions(quick=True)
    write_report([sec], opts, tmp_path)
    payload = json.loads((tmp_path / "report.json").read_text())
    [d] = [s["data"] for s in payload["sections"] if s["key"] == "latency_rate"]
    assert d["paper_sustained"] == {"oracle": [1.7, 2.7], "max": [2.7, 8.0]}
    assert d["paper_batched"] == {"oracle": 2.2, "max": 4.3}
    assert d["headline_threshold"] == d["thresholds"][0] and len(d["thresholds"]) == 3
    assert set(d["workloads"]) == {"ShareGPT-like", "Alpaca-like"}
    for w in d["workloads"].values():
        assert {"rates", "unloaded_s_per_token", "curves", "sustained", "batch", "num_requests"} <= set(w)
        assert set(w["curves"]) == set(SYSTEMS)
        assert all(len(pts) == len(w["rates"]) for pts in w["curves"].values())
        assert [b["read_at"] for b in w["batch"]] == ["paged_sustained", "highest"]
    assert {"preemptions", "preempted", "repeated", "watermark_blocks", "freed_mean", "predicted"} <= \
        set(d["preemptions"])
    md = (tmp_path / "report.md").read_text()
    assert "modelled" in md and "paper" in md


def test_tables_and_plots_name_systems_plainly(quick_section):
    sec, _ = quick_section
    plots = [t.plot for t in sec.tables if t.plot]
    assert [p["name"] for p in plots] == ["latency_rate_sharegpt", "latency_rate_alpaca"]
    for p in plots:
        assert p["logy"] and "modelled" in p["ylabel"]
        assert list(p["legend"].values()) == ["paged (pagedkv)", "Orca (Oracle)", "Orca (Pow2)", "Orca (Max)"]
    assert all("modelled" in t.title for t in sec.tables)
    text = sec.to_text()
    assert "--quick" in text and max(map(len, text.splitlines())) <= 100


def test_batch_table_says_who_is_past_its_rate(quick_section):
    """The note under the batch table names, from the readings, the systems past the rate they
    sustain at each rate read: at ShareGPT-like's highest rate paging is past its own too."""
    sec, _ = quick_section
    batch = next(t for t in sec.tables if t.title.startswith("Requests batched"))
    d = sec.data["workloads"]["ShareGPT-like"]
    head = d["sustained"][0]
    assert head["bound"]["paged"] == "=" and d["rates"][-1] > head["rate"]["paged"]
    [note] = [n for n in batch.notes if n.startswith("ShareGPT-like, past the rate each sustains")]
    assert note.endswith(f"at {d['rates'][-1]:g} req/s paged (pagedkv), Orca (Oracle), Orca (Pow2), Orca (Max).")


def test_finding_gives_the_ratios_beside_the_papers(quick_section):
    sec, _ = quick_section
    (found,) = [f for f in findings([sec]) if f.key == "latency_rate"]
    d = sec.data["workloads"]["ShareGPT-like"]
    head = d["sustained"][0]["paged_over"]
    assert found.ours == f"{head['oracle']:.2f}x / {head['max']:.2f}x"
    assert found.paper == "1.7-2.7x / 2.7-8x" and "Fig. 13a: 2.2x / 4.3x" in found.gap
    assert found.how == "modelled"


def test_section_refuses_bad_options():
    with pytest.raises(ValueError, match="opts must be ReportOptions"):
        section_mod.section({"quick": True})
