"""The report sections on the host tier: swap against recompute by block size (vLLM Fig. 19) and
host_offload (prefix hits and TTFT against host capacity, Azure load, Azure hits under a stated
sharing model, serving with recompute, offload and swap). Numbers are checked against hand computations, not against the code that
made them."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pagedkv.report import SECTIONS, ReportOptions
from pagedkv.report import host_offload, swap_recompute
from pagedkv.sim.costmodel import CostModel
from pagedkv.sim.swap_cost import Link

KV = 131_072  # Llama-3.1-8B KV bytes per token
PARAMS = CostModel.for_model("Llama-3.1-8B").weight_bytes / 2
RECOMPUTE_1024_S = 1024 * 2 * PARAMS / (0.45 * 989e12)  # at the stated 45% MFU


def _swap_s(tokens: int, bs: int, latency_s: float, copies: int = 64) -> float:
    """Out and back in, by hand: blocks x copies x latency + whole blocks' bytes / 64e9, twice."""
    blocks = -(-tokens // bs)
    return 2 * (blocks * copies * latency_s + blocks * bs * KV / 64e9)


@pytest.fixture(scope="module")
def fig19():
    return swap_recompute.section(ReportOptions(quick=True))


@pytest.fixture(scope="module")
def offload():
    return host_offload.section(ReportOptions(quick=True))


# ---- swap_vs_recompute ------------------------------------------------------------------------


def test_fig19_section_is_registered_with_two_tables(fig19):
    assert SECTIONS["swap_vs_recompute"] == "swap_recompute" and fig19.key == "swap_vs_recompute"
    assert len(fig19.tables) == 2 and fig19.tables[0].plot["logy"] is True
    assert any("section 7.3" in t and "Fig. 19" in t and "measured by its authors" in t for t in fig19.text)


def test_fig19_h100_rows_match_hand_computation(fig19):
    t = fig19.tables[1]  # the report's model on an H100, after the paper's setup
    assert t.column("block size") == [2**i for i in range(9)]
    idx = t.column("block size").index(16)
    assert t.column("copies each way")[idx] == 64 * 64
    assert t.column("swap ms @10 µs")[idx] == pytest.approx(1e3 * _swap_s(1024, 16, 10e-6))  # 86.11
    assert t.column("swap ms @5 µs")[idx] == pytest.approx(1e3 * _swap_s(1024, 16, 5e-6))
    assert t.column("swap ms, 1 copy/block @10 µs")[idx] == pytest.approx(1e3 * _swap_s(1024, 16, 10e-6, 1))
    assert t.column("recompute ms @45% MFU") == pytest.approx([1e3 * RECOMPUTE_1024_S] * 9)
    assert t.column("swap / recompute @10 µs")[idx] == pytest.approx(
        _swap_s(1024, 16, 10e-6) / RECOMPUTE_1024_S)  # 2.33: recompute is not priced at the peak


def test_fig19_h100_crossover_by_hand(fig19):
    # at 45% MFU swap loses at 32 (1.22x) and wins at 64 (0.67x)
    assert _swap_s(1024, 32, 10e-6) > RECOMPUTE_1024_S >= _swap_s(1024, 64, 10e-6)
    assert fig19.data["report_setup"]["crossover"] == [32, 64]
    # a larger latency per copy, or a faster recompute, never moves the crossover down
    by = fig19.data["report_setup"]["spread"]["by"]
    firsts = [by[f"{u} µs, 45% MFU"][1] for u in (5, 10, 20)]
    assert firsts == sorted(firsts)
    firsts = [by[f"10 µs, {m}% MFU"][1] for m in (30, 45, 60)]
    assert firsts == sorted(firsts)


# ---- host_offload: the replay and the TTFT model ----------------------------------------------


def test_replay_tiered_exact_on_a_tiny_cache():
    # 4 device blocks of 4, 8 host blocks, one sequence resident at a time. A (9 tokens) leaves
    # two cached blocks; B (16 tokens) evicts them to the host (2 offloads); A again loads them
    # from the host (8 tokens hit there) and evicts 3 of B's cached blocks (3 offloads).
    a, b = np.arange(9), np.arange(100, 116)
    empty = np.array([], dtype=np.int32)
    rep = host_offload.replay_tiered([a, b, a], [empty] * 3, 4, 8, 4, max_running=1)
    assert (rep.query_tokens, rep.device_hit_tokens, rep.host_hit_tokens) == (34, 0, 8)
    assert rep.computed.tolist() == [9, 16, 1]
    assert rep.loads.tolist() == [0, 0, 2] and rep.offloads.tolist() == [0, 2, 3]
    assert (rep.loaded_blocks, rep.offloaded_blocks) == (2, 5)
    none = host_offload.replay_tiered([a, b, a], [empty] * 3, 4, 0, 4, max_running=1)
    assert (none.device_hit_tokens, none.host_hit_tokens, none.computed.tolist()) == (0, 0, [9, 16, 9])


def test_ttft_model_by_hand():
    rep = host_offload.TierReplay(4, 8, 128, 2, 0, 2048, 0, 0, 2, 3, np.array([1000, 24]),
                                  np.array([0, 2]), np.array([3, 0]))
    cost = CostModel.for_model("Llama-3.1-8B")
    link = Link(64e9, 10e-6)
    block = 128 * KV
    ttft = host_offload.ttft_model(rep, cost, link, 64, block)
    compute = [1e-3 + n * 2 * PARAMS / 989e12 for n in (1000, 24)]
    moved = lambda n: n * 64 * 10e-6 + n * block / 64e9  # noqa: E731
    # the first only offloads (overlapping its 17 ms prefill); the second loads 2 blocks
    assert ttft[0] == pytest.approx(compute[0] + max(0.0, moved(3) - compute[0]))
    assert ttft[1] == pytest.approx(compute[1] + moved(2))


# ---- host_offload: the section ----------------------------------------------------------------


def test_offload_section_is_registered_with_its_tables(offload):
    assert SECTIONS["host_offload"] == "host_offload" and offload.key == "host_offload"
    titles = [t.title for t in offload.tables]
    assert len(titles) == 4
    assert titles[0].startswith("Prefix hits and modelled TTFT against host capacity (Mooncake")
    assert titles[1].startswith("Azure conversation trace")
    assert titles[2].startswith("MODELLED, not measured: prefix hits and TTFT against host capacity on the Azure")
    assert titles[3].startswith("Serving the first")


def test_hits_table_rows(offload):
    t = offload.tables[0]
    assert t.column("host capacity") == ["none", "1x device", "2x device", "4x device"]
    assert t.column("host hits %")[0] == 0 and t.column("GiB loaded")[0] == 0
    assert t.column("GiB offloaded")[0] == 0
    # a host tier never changes what the device serves: loaded blocks are published as computed ones
    assert len(set(t.column("device hits %"))) == 1
    data = offload.data["mooncake"]
    assert data["requests"] == host_offload.HIT_REQUESTS[True] and data["block_size"] == 128
    host_gib = [data["device_blocks"] * m * 128 * KV / 2**30 for m in host_offload.HOST_MULTIPLES]
    assert t.column("host GiB") == pytest.approx(host_gib)
    # TTFT p50 beside p90 and the mean, per layout, as the data has them
    for layout in ("per-layer", "1 copy/block"):
        p50, p90 = t.column(f"TTFT p50 ms {layout}"), t.column(f"TTFT p90 ms {layout}")
        assert all(a <= b for a, b in zip(p50, p90))
        assert p50 == [data["by_host"][m]["ttft_ms"][layout]["p50"] for m in host_offload.HOST_MULTIPLES]
        assert t.column(f"mean TTFT ms {layout}") == [
            data["by_host"][m]["ttft_ms"][layout]["mean"] for m in host_offload.HOST_MULTIPLES]
    assert any("The median" in n for n in t.notes)


def test_percentiles_by_hand():
    # seconds in, milliseconds out: median of 1, 2, 3, 10 ms is 2.5; p90 interpolates 3 -> 10 at 0.7
    assert host_offload._percentiles(np.array([1e-3, 2e-3, 3e-3, 10e-3])) == pytest.approx((2.5, 7.9, 4.0))
    assert all(math.isnan(v) for v in host_offload._percentiles(np.array([])))


def test_azure_reports_no_measured_hit_rate(offload):
    t = offload.tables[1]
    assert not any("hit" in c.lower() for c in t.columns)
    assert any("cannot be measured" in n and "no content hashes" in n and "none is reported as measured" in n
               for n in t.notes)
    data = offload.data["azure_load"]
    rows = data["by_host"]
    assert [rows[m]["tokens"] for m in host_offload.HOST_MULTIPLES] == [
        (1 + m) * rows[0]["tokens"] for m in host_offload.HOST_MULTIPLES]


def test_azure_modelled_hits_are_labelled_with_their_model_and_spread(offload):
    t, data = offload.tables[2], offload.data["azure_modelled"]
    assert data["modelled"] is True and "MODELLED, not measured" in t.title
    notes = " ".join(t.notes)
    assert "Modelled, not a measurement of the trace" in notes and "no content hashes" in notes
    assert f"seed {host_offload.AZURE_SEED}" in notes and "The spread: S swept over 256, 1,024, 4,096" in notes
    n = host_offload.AZURE_HIT_REQUESTS[True]
    assert data["requests"] == n and data["system_prompts"] == n // host_offload.AZURE_SHARING
    labels = [f"S {s:,}, " + ("no host" if not m else f"{m}x device")
              for s in host_offload.AZURE_SHARED_TOKENS for m in host_offload.HOST_MULTIPLES]
    assert t.column("S, host capacity") == labels
    for s, rows in data["by_shared_tokens"].items():
        assert rows[0]["host_hit_rate"] == 0 and rows[0]["loaded_bytes"] == 0
        # a host tier never changes what the device serves
        assert len({row["device_hit_rate"] for row in rows.values()}) == 1, s
    assert any("MODELLED" in line and "Azure" in line for line in offload.text)


def test_shared_prefix_prompts_by_hand():
    from pagedkv.sim.request import Request

    reqs = [Request(f"r{i}", 0.0, ((1000 + i, n),), 0) for i, n in enumerate((300, 500, 200))]
    a = host_offload.shared_prefix_prompts(reqs, 256, 1)
    assert [len(p) for p in a] == [300, 500, 200]  # lengths as recorded
    assert (a[0][:256] == a[1][:256]).all() and (a[2] == a[0][:200]).all()  # one system prompt
    assert (a[0][256:] != a[1][256:300]).any()  # then each its own
    b = host_offload.shared_prefix_prompts(reqs, 1024, 1)
    assert (b[1][:300] == b[0]).all()  # S beyond a prompt: the whole prompt is the shared stream
    # one system prompt, nothing evicted: hits are the shared full blocks, never the last token
    empty = [np.array([], dtype=np.int32)] * 3
    rep = host_offload.replay_tiered(a, empty, 100, 0, 128)
    assert rep.device_hit_tokens == 0 + 256 + 128  # 2 blocks of the second; 1 of the 200-token third
    # the same draw for every S; a bad argument is refused
    many = [Request(f"q{i}", 0.0, ((2000 + i, 64),), 0) for i in range(40)]
    x, y = (host_offload.shared_prefix_prompts(many, s, 5) for s in (16, 32))
    assert [p[:16].tolist() for p in x] == [p[:16].tolist() for p in y]
    assert len({tuple(p[:16]) for p in x}) == 5
    for bad in ((-1, 5), (16, 0), (1.5, 5), (True, 5)):
        with pytest.raises(ValueError):
            host_offload.shared_prefix_prompts(many, *bad)
    for bad_reqs, seed in ((["r0"], 0), ("abc", 0), (many, -1), (many, 1.0)):
        with pytest.raises(ValueError):
            host_offload.shared_prefix_prompts(bad_reqs, 16, 5, seed)


def test_serving_table_modes(offload):
    t = offload.tables[3]
    assert t.column("mode") == ["recompute, no host tier", "offload, per-layer", "offload, 1 copy/block",
                                "swap, per-layer", "swap, 1 copy/block",
                                "swap only (no offload), 1 copy/block"]
    swap_outs = t.column("swap-outs")
    assert swap_outs[:3] == [0, 0, 0]  # only the swap modes swap
    assert t.column("GiB to host")[0] == 0 and t.column("transfer wait s")[0] == 0
    only = offload.data["serving"]["swap only (no offload), 1 copy/block"]
    assert only["bytes_to_host"] <= offload.data["serving"]["swap, 1 copy/block"]["bytes_to_host"]
    for label, row in offload.data["serving"].items():
        assert row["completed"] and row["finished"] == host_offload.SERVE_REQUESTS[True], label
        if label.startswith("swap"):
            assert row["recomputed_tokens"] <= offload.data["serving"]["recompute, no host tier"][
                "recomputed_tokens"]


def test_serving_under_pressure_swaps_instead_of_recomputing():
    # the trace's first 30 requests all at once on 400 blocks: the pool preempts, and swapping
    # recomputes nothing where recompute recomputes
    from dataclasses import replace

    from pagedkv.sim.traces import load_azure_csv, trace_path

    opts = ReportOptions()
    reqs = [replace(r, arrival=0.0) for r in load_azure_csv(trace_path("azure-conv"), limit=30)]
    cost = CostModel.for_model(opts.model)
    rec, _ = host_offload._serve_one(reqs, 400, opts, cost, {})
    swap, alloc = host_offload._serve_one(reqs, 400, opts, cost,
                                          {"host_blocks": 800, "preemption": "swap", "copies_per_block": 1})
    assert rec.preemptions > 0 and rec.recomputed_tokens > 0
    assert alloc.stats.swap_outs == swap.preemptions > 0 and alloc.stats.swap_fallbacks == 0
    assert swap.recomputed_tokens == 0 and swap.finished == rec.finished == len(reqs)


def test_sections_without_traces_say_so(tmp_path):
    sec = host_offload.section(ReportOptions(quick=True, data_dir=tmp_path))
    assert not sec.tables
    assert any("Mooncake trace not found" in t for t in sec.text)
    assert any("Azure conversation trace not found" in t for t in sec.text)


def test_sections_refuse_bad_options():
    for mod in (swap_recompute, host_offload):
        with pytest.raises(ValueError, match="ReportOptions"):
            mod.section({"quick": True})


def test_text_fits_the_terminal(fig19, offload):
    for sec in (fig19, offload):
        assert max(len(line) for line in sec.to_text().splitlines()) <= 100
