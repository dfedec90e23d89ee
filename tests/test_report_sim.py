"""The simulator's headline claims and the three report sections built on it (Fig. 2, block size,
Fig. 15), checked against the vLLM paper where our regime matches its regime.

Stated tolerances and why:

- Fig. 2, saturated view (memory always full, the state the paper's shares describe): Max, Pow2
  and Oracle within 4 points of the paper's 20.4 / 26.8 / 38.2%. Our lengths match ShareGPT's
  published *means* with an assumed lognormal shape; over the log-sd range the real traces support
  and over seeds our own Max moves by 4.3 points (19.3-23.6%), so 4 points is what the unknown shape
  alone explains. A wrong definition moves far more: reserving pow2(prompt + output) gave Pow2
  37.8% (+11), counting reservations as token states gives ~91%.
- Paged within 2 points of 96.3% saturated: its only waste is the last block's tail, (16-1)/2 slots
  of ~460-token sequences (1.6%), plus the 1% admission watermark.
- Fig. 15 (Alpaca): the paper's parallel-sampling savings lie inside our band over the supported
  log-sd range, widened by 1 point (seed noise of the report's 100-request run); beam width 2 within 2
  points of 37.56% as a mean over 5 seeds (our seeds span about 4 points). Widths 4 and 6 depend on how beams
  converge, i.e. on our BeamModel, not on the allocator: they are reported with their seed spread,
  not compared.
- Fragmentation grows with block size, savings with n and beam width: strictly (each step is far
  beyond run-to-run noise).
"""
from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import pytest

from pagedkv.report import block_size as block_size_section
from pagedkv.report import fig2, sharing
from pagedkv.report.options import ReportOptions
from pagedkv.sim.costmodel import A100_40GB_HBM_BYTES_PER_S
from pagedkv.sim.request import Request
from pagedkv.sim.workloads import log_sd_range, over_limit_share
from pagedkv.report.tables import Section

PAPER = fig2.PAPER_TOKEN_SHARE  # references, never results


@pytest.fixture(scope="module")
def sharegpt():
    return fig2.load("sharegpt", 300, seed=0)


@pytest.fixture(scope="module")
def saturated_runs(sharegpt):
    return {a: fig2.run_one(sharegpt, a) for a in ("max", "pow2", "oracle", "paged")}


def test_paper_memory_is_computed():
    num_blocks, cost = fig2.paper_setup(16)
    assert num_blocks * 16 == 15_728  # vLLM paper Table 1: 15.7K slots for OPT-13B
    assert cost.kv_bytes_per_token == 819_200
    assert cost.bandwidth == A100_40GB_HBM_BYTES_PER_S and cost.model == "OPT-13B"


def _req(i: int, prompt: int, output: int) -> Request:
    return Request(f"r{i}", 0.0, ((900 + i, prompt),), output)


def test_fit_to_model_refuses_or_stops_and_counts():
    reqs = [_req(0, 3000, 10), _req(1, 2047, 5), _req(2, 2000, 100), _req(3, 100, 100), _req(4, 2048, 1)]
    kept, rejected, stopped = fig2.fit_to_model(reqs, 2048)
    assert (rejected, stopped) == (2, 2)  # prompts of 3,000 and 2,048 leave no room for an output
    assert [(r.req_id, r.prompt_len, r.output_len) for r in kept] == [
        ("r1", 2047, 1), ("r2", 2000, 48), ("r3", 100, 100)]
    assert kept[2] is reqs[3]  # a request that fits is untouched


def test_prepare_synthetic_counts_redraws_and_sets_arrivals():
    sat = fig2.prepare("sharegpt", 200, 0)
    assert sat.read == 200 and len(sat.requests) == 200 and (sat.rejected, sat.stopped) == (0, 0)
    assert sat.redrawn == over_limit_share("sharegpt", 2048) and 0.01 < sat.redrawn < 0.04
    assert all(r.arrival == 0.0 for r in sat.requests) and all(r.total_len <= 2048 for r in sat.requests)
    srv = fig2.prepare("sharegpt", 200, 0, rate=4.0)
    assert [r.total_len for r in srv.requests] == [r.total_len for r in sat.requests]  # same lengths
    times = [r.arrival for r in srv.requests]
    assert times == sorted(times) and times[0] > 0
    assert 200 / 4.0 * 0.75 < times[-1] < 200 / 4.0 * 1.25  # Poisson at 4/s: ~50 s for 200


def test_prepare_trace_leaves_out_what_the_model_refuses():
    from pagedkv.sim.traces import load_azure_csv, trace_path

    path = trace_path("azure-conv")
    raw = load_azure_csv(path, limit=300)
    p = fig2.prepare(path, 300, 0)
    too_long = sum(r.prompt_len >= 2048 for r in raw)
    assert too_long > 0 and p.rejected == too_long  # counted, never silently cut
    assert p.read == 300 and len(p.requests) == 300 - too_long
    assert p.stopped == sum(r.prompt_len < 2048 < r.total_len for r in raw)
    assert all(r.total_len <= 2048 for r in p.requests)


def test_serving_rate_is_the_stated_multiple_of_paged_capacity():
    m = SimpleNamespace(throughput_rps=3.4937)
    assert fig2.paged_capacity(m) == 3.49
    assert fig2.serving_rate(m) == round(fig2.HEADLINE_LOAD * 3.49, 2) == 4.36
    assert fig2.serving_rate(m, 2.0) == 6.98
    with pytest.raises(ValueError):
        fig2.serving_rate(SimpleNamespace(throughput_rps=0.0))


@pytest.mark.parametrize("name,alloc,tol", [("Max", "max", 4), ("Pow2", "pow2", 4), ("Oracle", "oracle", 4),
                                            ("paged", "paged", 2)])
def test_saturated_shares_match_the_paper(saturated_runs, name, alloc, tol):
    m = saturated_runs[alloc][1]
    assert abs(100 * m.token_share - PAPER[name]) <= tol, (name, m.shares)


def test_saturated_accounting(saturated_runs):
    mx = saturated_runs["max"][1]
    assert mx.shares["external_fragmentation"] == pytest.approx(1_392 / 15_728, abs=1e-9)  # 7 x 2,048 fit
    assert mx.shares["internal_fragmentation"] > mx.shares["token_states"]
    pg = saturated_runs["paged"][1]
    assert pg.internal_fragmentation_ratio < 0.04  # last-block tails at block size 16
    assert pg.shares["reserved"] == 0 and pg.shares["external_fragmentation"] == 0
    shares = {a: r[1].token_share for a, r in saturated_runs.items()}
    assert shares["max"] < shares["pow2"] < shares["oracle"] < shares["paged"]


def test_exact_buddy_is_an_artifact_of_placement(sharegpt, saturated_runs):
    """Without the buddy's rounding an Oracle reservation still needs an aligned free block, and the
    misaligned leftovers strand memory: over twice the external fragmentation of classic placement."""
    _, exact = fig2.run_one(sharegpt, "oracle", exact=True)
    classic = saturated_runs["oracle"][1]
    assert exact.shares["internal_fragmentation"] == 0  # it holds exactly the true length
    assert exact.shares["external_fragmentation"] > 2 * classic.shares["external_fragmentation"]


def test_serving_run_loads_paging_and_overloads_the_reservations():
    """The headline regime (1,000 requests, as the report runs it): requests wait through most of
    the paged run, and Max, overloaded, is as full as when saturated."""
    n = fig2.FULL_REQUESTS
    _, sat = fig2.run_one(fig2.load("sharegpt", n, 0), "paged")
    rate = fig2.serving_rate(sat)
    reqs = fig2.prepare("sharegpt", n, 0, rate=rate).requests
    res, paged = fig2.run_one(reqs, "paged", window="run")
    assert paged.window == "run"
    assert fig2._waiting_share(res) > 0.8
    assert 0.85 < paged.token_share < sat.token_share  # ramp-up and drain are in the run's average
    assert sum(paged.shares.values()) == pytest.approx(1.0, abs=1e-9)
    _, mx = fig2.run_one(reqs, "max", window="run")
    assert abs(100 * mx.token_share - PAPER["Max"]) <= 4
    assert mx.throughput_rps < rate / 2


def test_fragmentation_grows_with_block_size():
    reqs = fig2.load("sharegpt", 150, seed=1)
    frag = [fig2.run_one(reqs, "paged", bs)[1].internal_fragmentation_ratio for bs in (4, 16, 64, 256)]
    assert frag == sorted(frag) and len(set(frag)) == 4, frag


@pytest.mark.parametrize("mode", ["n", "beam_width"])
def test_sharing_savings_grow_with_width(mode):
    from dataclasses import replace

    base = fig2.load("alpaca", 150, seed=0)
    savings = []
    for k in (2, 4, 6):
        reqs = [replace(r, **{mode: k}) for r in base]
        _, m = fig2.run_one(reqs, "paged", enable_prefix_caching=False)
        savings.append(m.sharing_saving)
    assert savings[0] > 0 and savings == sorted(savings) and len(set(savings)) == 3, savings


@pytest.mark.parametrize("k", [2, 4, 6])
def test_fig15_parallel_sampling_within_our_length_band(k):
    lo_sd, hi_sd = log_sd_range()
    n = sharing.SIZES[("alpaca", "parallel")]  # as the report runs it
    runs = [100 * sharing._saving("alpaca", n, 0, "parallel", k, 16, sd)[1].sharing_saving
            for sd in (None, lo_sd, hi_sd)]
    paper = sharing.PAPER_SAVING[("parallel", k)]
    assert min(runs) - 1 <= paper <= max(runs) + 1, (k, runs, paper)


def test_fig15_beam_width_2_over_the_seeds():
    n = sharing.SIZES[("alpaca", "beam")]
    seeds = [100 * sharing._saving("alpaca", n, s, "beam", 2, 16)[1].sharing_saving for s in range(sharing.SEEDS)]
    assert abs(sum(seeds) / len(seeds) - sharing.PAPER_SAVING[("beam", 2)]) <= 2, seeds
    assert max(seeds) - min(seeds) > 0  # the seed matters: hence the report's min-max


def _check_section(sec: Section, key: str) -> None:
    assert isinstance(sec, Section) and sec.key == key and sec.tables
    for t in sec.tables:
        assert t.rows and all(len(r) == len(t.columns) for r in t.rows)
        if t.plot:
            cols = [t.plot["x"], *t.plot["y"], *[c for pair in t.plot.get("band", {}).values() for c in pair],
                    *[t.plot[k] for k in ("marker", "annotate") if k in t.plot], *t.plot.get("ref_range", [])]
            for col in cols:
                assert col in t.columns, (t.title, col)
    assert sec.to_text() and sec.to_markdown() and sec.to_dict()


@pytest.fixture(scope="module")
def fig2_quick():
    return fig2.section(ReportOptions(quick=True))


def test_fig2_section_quick_tables(fig2_quick):
    sec = fig2_quick
    _check_section(sec, "fig2")
    srv, sat, cost, load = sec.tables
    assert [t.plot["name"] for t in sec.tables] == ["fig2_breakdown", "fig2_saturated", "fig2_throughput", "fig2_load"]
    for t in (srv, sat):
        assert t.plot["kind"] == "stacked" and t.plot["paper_stack"] == fig2.PAPER_COLUMNS
        for run, paper, why in zip(t.column("run"), t.column("paper token states %"),
                                   t.column("where and why ours differs")):
            workload, name = run.split(" / ")
            # The paper's bar sits on the ShareGPT row of the same allocator, and nowhere else.
            assert paper == (PAPER[name] if workload == "ShareGPT-like" and name in PAPER else None), run
            assert isinstance(why, str) and why, run
        for row in t.rows:  # the paper's four categories sum to 100 (rounded to 0.1 each), and the
            # fourth is the sum of its parts
            assert sum(row[t.columns.index(c)] for c in fig2.SHARE_COLUMNS) == pytest.approx(100, abs=0.3)
            assert row[t.columns.index(fig2.SHARE_COLUMNS[3])] == pytest.approx(
                sum(row[t.columns.index(c)] for c in fig2.DETAIL_COLUMNS), abs=0.2)
    runs = srv.column("run")
    assert [r.split(" / ")[1] for r in runs] == ["Max", "Pow2", "Oracle", "paged", "Pow2" + fig2.EXACT,
                                                "Oracle" + fig2.EXACT, "Max", "Pow2", "Oracle", "paged"]
    for t in (srv, sat):  # both views carry the length-spread band, on the ShareGPT-like rows
        for run, v, lo, hi in zip(t.column("run"), t.column("token states %"), t.column("band lo %"),
                                  t.column("band hi %")):
            if run.startswith("ShareGPT-like") and "exact" not in run:
                assert lo <= v <= hi, run
            else:
                assert lo is None and hi is None, run
    assert "reservations fit" in srv.rows[0][-1] and "last block's unused tail" in srv.rows[3][-1]
    assert srv.column("internal frag %")[2] == 0  # Oracle: no internal fragmentation (the paper's)
    assert cost.column("x Max")[0] == 1 and cost.column("x Max")[3] > 1  # paging batches more
    assert load.column("x capacity") == sorted(load.column("x capacity"))
    assert [x for x in load.column("headline %") if x is not None] == [srv.rows[3][1]]


def test_fig2_section_quick_states_rate_and_limits(fig2_quick):
    sec = fig2_quick
    d = sec.data["workloads"]
    share = d["ShareGPT-like"]
    assert share["rate_rps"] == round(fig2.HEADLINE_LOAD * share["paged_capacity_rps"], 2)
    assert f"{share['rate_rps']:g} req/s" in sec.tables[0].title
    azure = d["Azure conv trace"]
    assert azure["rejected"] + azure["served"] == azure["read"] == fig2.QUICK_REQUESTS
    text = " ".join(sec.text)
    assert f"of the first {azure['read']:,} requests, {azure['rejected']:,} have a prompt" in text
    assert "--quick" in text and "smoke test" in text
    assert f"{100 * share['redrawn_share']:.1f}% of draws" in text
    lo, hi = sec.data["log_sd_range"]
    assert 0.5 < lo < 1.0 < hi < 1.6
    assert set(share["band_token_share"]) == set(share["saturated_band_token_share"]) == {"Max", "Pow2", "Oracle",
                                                                                          "paged"}
    assert math.isclose(sum(share["serving"]["paged"]["shares"].values()), 1.0, abs_tol=1e-9)


def test_block_size_section_quick():
    sec = block_size_section.section(ReportOptions(quick=True))
    _check_section(sec, "block_size")
    t = sec.tables[0]
    assert t.column("block size") == [2**k for k in range(10)]
    frag = t.column("internal frag %")
    assert frag[0] == 0 and frag[-1] > frag[4] > 0  # block size 1 wastes nothing
    assert t.column("table bytes @2048")[4] == 512  # 128 int32 entries at block size 16


def test_sharing_section_quick():
    sec = sharing.section(ReportOptions(quick=True))
    _check_section(sec, "sharing")
    fig15, share = sec.tables
    assert (fig15.plot["name"], share.plot["name"]) == ("fig15_sharing", "sharing_sharegpt")
    for run, width, paper in zip(fig15.column("run"), fig15.column("width"), fig15.column("paper %")):
        mode = "parallel" if " n=" in run else "beam"
        assert paper == sharing.PAPER_SAVING[(mode, width)], run
    for run, lo, hi in zip(share.column("run"), share.column("paper range lo %"), share.column("paper range hi %")):
        mode = "parallel" if " n=" in run else "beam"
        assert (lo, hi) == sharing.PAPER_SHAREGPT_RANGE[mode], run
    assert share.column("width") == [2, 6, 2, 6]
    for t in (fig15, share):
        for row in t.rows:
            r = dict(zip(t.columns, row))
            assert r["low %"] < r["saved %"] < r["high %"], row
    for key, v in sec.data["saving"].items():
        assert len(v["seeds"]) == sharing.SEEDS >= 3, key
        assert v["saved"] == pytest.approx(sum(v["seeds"]) / len(v["seeds"])), key
    saved = dict(zip(fig15.column("run"), fig15.column("saved %")))
    for k in (2, 4, 6):  # beams share more than samples
        assert saved[f"Alpaca beam={k}"] > saved[f"Alpaca n={k}"]


def test_sections_validate_options():
    for mod in (fig2, block_size_section, sharing):
        with pytest.raises(ValueError):
            mod.section({"quick": True})


def test_simulate_command(capsys):
    from pagedkv.commands import simulate

    p = argparse.ArgumentParser()
    simulate.add_arguments(p)
    args = p.parse_args(["sharegpt", "--num-requests", "40", "--model", "OPT-13B", "--kv-gib", "2", "--rate", "0"])
    assert simulate.run(args) == 0
    out = capsys.readouterr().out
    for name in ("Max", "Pow2", "Oracle", "paged", "token states %", "synthetic"):
        assert name in out
    bad = p.parse_args(["sharegpt", "--num-requests", "0"])
    assert simulate.run(bad) == 2
    assert "num-requests" in capsys.readouterr().err


def test_simulate_defaults_show_what_paging_buys(capsys):
    """No arguments: the paper's setup, saturated; paging must batch and serve several times more."""
    from pagedkv.commands import simulate

    p = argparse.ArgumentParser()
    simulate.add_arguments(p)
    args = p.parse_args(["--num-requests", "150"])
    assert args.workload == "sharegpt" and args.model == "OPT-13B"
    assert simulate.run(args) == 0
    out = capsys.readouterr().out
    assert "sharegpt (synthetic: lognormal lengths" in out
    assert "What paging buys:" in out and "every request arrives at t = 0" in out
    rows = {}
    for line in out.splitlines():  # the first grid: allocator, token states %, ...
        if line.split()[:1] in (["Max"], ["paged"]):
            rows.setdefault(line.split()[0], line.split())
    # first grid: allocator, token states %, ...; paged holds several times Max's token share
    assert float(rows["paged"][1]) > 3 * float(rows["Max"][1])


def test_simulate_names_a_real_trace(capsys):
    from pagedkv.commands import simulate

    p = argparse.ArgumentParser()
    simulate.add_arguments(p)
    args = p.parse_args(["azure-conv-trace", "--num-requests", "60", "--allocator", "paged", "--rate", "0"])
    assert simulate.run(args) == 0
    out = capsys.readouterr().out
    assert "(real trace: azure_llm_2023_conv.csv" in out
    assert ("requests, whose prompt is 2,048 tokens or longer: the context limit (OPT-13B's context)"
            in " ".join(out.split()))


def test_fig2_leaves_out_a_trace_nothing_of_which_fits(tmp_path):
    """A --trace whose prompts all exceed the 2,048-token context is reported, not run (and the
    report does not stop)."""
    path = tmp_path / "long.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    + "".join(f"2023-11-16 18:15:{10 + i:02d}.0,{3000 + i},20\n" for i in range(5)))
    sec = fig2.section(ReportOptions(quick=True, trace=path))
    assert "trace long.csv: none of its first 5 requests fits the 2,048-token context (5 prompts" in " ".join(sec.text)
    assert "trace long.csv" not in sec.data["workloads"]
    assert not any("long.csv" in r for r in sec.tables[0].column("run"))


def test_run_window_is_first_arrival_to_last_finish():
    """The serving-run window leaves out only the wait before the first arrival: an idle gap
    between two requests counts (memory all free then), so the run's free share lies between the
    busy-only and the everything share."""
    import numpy as np

    from pagedkv.sim.baselines import make_allocator
    from pagedkv.sim.costmodel import CostModel
    from pagedkv.sim.metrics import compute, window_mask
    from pagedkv.sim.scheduler import simulate

    reqs = [Request("a", 100.0, ((1, 40),), 20), Request("b", 200.0, ((2, 40),), 20)]
    res = simulate(reqs, make_allocator("paged", 64, 16), CostModel(overhead_s=0.01))
    s = res.steps
    run = window_mask(s, "run")
    assert s.idle[0] and not run[0]  # [0, 100): before the first arrival
    gap = np.flatnonzero(s.idle)[1]
    assert run[gap] and run[1:].all()  # the gap between a and b is part of the run
    free = {w: compute(res, w).shares["free"] for w in ("busy", "run", "all")}
    assert free["busy"] < free["run"] < free["all"]


def test_prompt_array_is_the_segments_tokens():
    import numpy as np

    from pagedkv.sim.request import segment_tokens

    r = Request("x", 0.0, ((7, 512), (9, 300), (7, 0), (11, 5)), 3)
    want = np.concatenate([segment_tokens(k, n) for k, n in r.segments])
    got = r.prompt_array()
    assert got.dtype == want.dtype and got.tolist() == want.tolist() == r.prompt_tokens()


def test_run_one_never_cuts_silently():
    with pytest.raises(ValueError, match="1 requests are longer than max_len 2048"):
        fig2.run_one([_req(0, 2000, 100), _req(1, 10, 10)], "paged")
