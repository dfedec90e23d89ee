"""Serving a hybrid model grouped (issue 19, item 7's serving run): the simulator's paged
allocator with attention groups, the command line, and the report's table."""
from __future__ import annotations

import pytest

from pagedkv import FullAttention, SlidingWindow
from pagedkv.cli import main
from pagedkv.report.options import ReportOptions
from pagedkv.sim.baselines import PagedAllocator
from pagedkv.sim.costmodel import CostModel
from pagedkv.sim.hybrid_serving import GROUPED_NAME, UNIFORM_NAME, hybrid_allocators, hybrid_memory
from pagedkv.sim.metrics import compute
from pagedkv.sim.request import Request
from pagedkv.sim.scheduler import check_fits, simulate
from pagedkv.sim.sizing import get_model

GROUPS = [SlidingWindow(window=8), FullAttention()]


def req(i: int, prompt: int, output: int) -> Request:
    return Request(f"r{i}", 0.0, ((1000 + i, prompt),), output)


def run(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


# ---- sizing a budget both ways ------------------------------------------------------------------


def test_hybrid_memory_gives_gpt_oss_twice_the_blocks_in_one_gib():
    m = hybrid_memory(get_model("gpt-oss-20b"), 1 << 30)
    # one layer's block: 2 (K, V) x 8 heads x 64 x 2 bytes x 16 tokens = 32 KiB
    assert (m.uniform_block_bytes, m.grouped_block_bytes) == (24 << 15, 12 << 15)
    assert (m.uniform_blocks, m.grouped_blocks) == (1365, 2730)
    assert m.groups == (SlidingWindow(window=128), FullAttention())


def test_hybrid_memory_of_a_uniform_model_is_one_group_and_the_same_blocks():
    m = hybrid_memory(get_model("Llama-3.1-8B"), 1 << 30)
    assert m.groups == (FullAttention(),) and m.uniform_blocks == m.grouped_blocks == 512


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_hybrid_memory_refuses_bad_budgets(bad):
    with pytest.raises(ValueError):
        hybrid_memory(get_model("gpt-oss-20b"), bad)


def test_hybrid_allocators_refuse_a_budget_without_one_uniform_block():
    with pytest.raises(ValueError, match="no block"):
        hybrid_allocators(hybrid_memory(get_model("gpt-oss-20b"), 1000))


# ---- the allocator ------------------------------------------------------------------------------


def test_grouped_admission_counts_a_block_per_group():
    a = PagedAllocator(10, 4, groups=GROUPS, watermark=0.0)
    assert a.num_groups == 2 and a.prompt_blocks(9) == 6
    assert a.room_for(9, busy=True)  # 6 of 10
    assert a.admit(req(0, 9, 4))
    assert a.num_free_blocks == 4
    # 4 blocks are free but a 9-token prompt takes 3 in each group: refused, nothing changed
    assert not a.room_for(9, busy=True)
    a.check()


def test_grouped_freeable_blocks_count_every_group_and_skip_released_entries():
    a = PagedAllocator(32, 4, groups=GROUPS, watermark=0.0)
    assert a.admit(req(0, 16, 30))
    assert a.freeable_blocks("r0") == 8  # 4 blocks in each group
    for _ in range(8):
        a.step(["r0"])
    # 24 positions: full holds 6 blocks; the window (8) reads 16 .. 23 at most: the sliding group
    # released its first blocks, which read -1 and are not counted
    held = a.freeable_blocks("r0")
    assert held == a.m.usage().used_blocks < 12
    a.check()


def test_fit_check_counts_the_blocks_of_every_group():
    """A 20-token request fits 6 blocks of 4 held uniformly (5 blocks), not grouped (10 blocks
    for its readmission after a preemption: every position in both groups). Before the check
    counted groups, it passed and the run could livelock."""
    grouped = PagedAllocator(6, 4, groups=GROUPS)
    with pytest.raises(ValueError, match="could never run"):
        check_fits([req(0, 16, 4)], grouped, 64)
    check_fits([req(0, 16, 4)], PagedAllocator(6, 4), 64)


def test_grouped_serves_more_requests_at_once_than_uniform_in_the_same_bytes():
    reqs = [req(i, 200 + 8 * i, 40) for i in range(24)]
    memory = hybrid_memory(get_model("gpt-oss-20b"), 60 * (24 << 15))  # 60 uniform blocks of 16
    cost = CostModel.for_model("Llama-3.1-8B")
    out = {}
    for alloc in hybrid_allocators(memory):
        res = simulate(reqs, alloc, cost, max_len=512)
        alloc.check()
        assert res.finished == len(reqs)
        out[alloc.name] = compute(res)
    assert out[GROUPED_NAME].avg_batch > out[UNIFORM_NAME].avg_batch
    assert out[GROUPED_NAME].max_batch >= out[UNIFORM_NAME].max_batch


# ---- the command line ---------------------------------------------------------------------------


def test_simulate_serves_gpt_oss_grouped(capsys):
    rc, out, err = run(["simulate", "sharegpt", "--model", "gpt-oss-20b", "--weights-gib", "13",
                        "--kv-gib", "0.5", "--num-requests", "40", "--gpu-mem-gib", "80"], capsys)
    assert rc == 0, err
    assert UNIFORM_NAME in out and GROUPED_NAME in out and "hybrid model" in out
    rc, out, _ = run(["simulate", "sharegpt", "--model", "gpt-oss-20b", "--weights-gib", "13",
                      "--kv-gib", "0.5", "--num-requests", "20", "--allocator", "paged"], capsys)
    rows = [line.split("  ")[0] for line in out.splitlines()]
    assert rc == 0 and GROUPED_NAME in rows and UNIFORM_NAME not in rows


@pytest.mark.parametrize("argv, needle", [
    (["simulate", "--model", "gpt-oss-20b"], "give --weights-gib"),
    (["simulate", "--model", "gpt-oss-20b", "--weights-gib", "-1"], "--weights-gib"),
    (["fleet", "--model", "gpt-oss-20b"], "give --weights-gib"),
    (["report", "--model", "Gemma-3-27B", "--sections", "hybrid"], "is a hybrid model"),
])
def test_what_cannot_run_a_hybrid_model_says_so_in_one_line(capsys, argv, needle):
    rc, out, err = run(argv, capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert needle in err


def test_simulate_serves_a_dense_hybrid_model_without_weights(capsys):
    rc, out, err = run(["simulate", "sharegpt", "--model", "Gemma-3-4B", "--kv-gib", "1",
                        "--num-requests", "20", "--allocator", "paged", "--gpu-mem-gib", "80"], capsys)
    assert rc == 0, err
    assert GROUPED_NAME in out


# ---- the report's table -------------------------------------------------------------------------


def test_serving_table_shape_and_grouped_runs_at_least_as_many_at_once():
    from pagedkv.report import hybrid_serving as hs

    tables, data, text = hs.serving_tables(ReportOptions(quick=True))
    assert text == [] and len(tables) == 1
    t = tables[0]
    assert len(t.rows) == 2 * len(hs.QUICK_BUDGET_REQUESTS)
    assert [r[2] for r in t.rows] == [UNIFORM_NAME, GROUPED_NAME] * len(hs.QUICK_BUDGET_REQUESTS)
    assert list(data["runs"]) == list(hs.QUICK_BUDGET_REQUESTS)
    for k, by in data["runs"].items():
        assert set(by) == {UNIFORM_NAME, GROUPED_NAME}
        assert by[GROUPED_NAME]["mean_running"] >= by[UNIFORM_NAME]["mean_running"]
        assert by[GROUPED_NAME]["peak_running"] >= by[UNIFORM_NAME]["peak_running"]
        assert by[GROUPED_NAME]["finished"] == by[UNIFORM_NAME]["finished"] == data["requests"]
        b = data["budgets"][k]
        assert b["bytes"] == k * data["uniform_request_bytes"]
        assert b["grouped_blocks"] == 2 * b["uniform_blocks"]  # gpt-oss: 12 of 24 layers a page
    # the budgets spread: more memory, more requests at once
    means = [by[UNIFORM_NAME]["mean_running"] for by in data["runs"].values()]
    assert means == sorted(means)


def test_serving_table_is_skipped_without_the_trace(tmp_path):
    from pagedkv.report import hybrid_serving as hs

    tables, data, text = hs.serving_tables(ReportOptions(quick=True, data_dir=tmp_path))
    assert tables == [] and "skipped" in data and text
