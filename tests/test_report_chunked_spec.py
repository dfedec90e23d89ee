"""The "chunked prefill and speculative decoding" report section, against independent counts."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from pagedkv.report import SECTIONS
from pagedkv.report.chunked_spec import (ACCEPT_RATES, DRAFT_LENGTHS, memory_rows, rollback_run,
                                         section, timeline_shape)
from pagedkv.report.options import ReportOptions
from pagedkv.sim.sizing import kv_bytes_per_token


@pytest.fixture(scope="module", params=[16, 4])
def quick(request):
    return request.param, section(ReportOptions(quick=True, block_size=request.param))


def test_tables_are_present_and_printable(quick):
    bs, sec = quick
    assert "chunked_spec" in SECTIONS and sec.key == "chunked_spec"
    assert len(sec.tables) == 2
    for t in sec.tables:
        assert t.rows and all(len(r) == len(t.columns) for r in t.rows)
        for col in [t.plot["x"], *t.plot["y"]]:
            assert all(isinstance(v, (int, float)) for v in t.column(col))
    assert max(len(line) for line in sec.to_text().splitlines()) < 100
    json.dumps(sec.to_dict())


def test_timeline_matches_the_publishing_rule(quick):
    """Published blocks = full blocks of the scheduled positions; B hits the shared blocks that are
    published, never more; admitted whole, A exposes every shared block from step 0."""
    bs, sec = quick
    n, chunk, shared = timeline_shape(bs)
    rows = sec.tables[0].rows
    cols = list(sec.tables[0].columns)
    get = {c: [r[cols.index(c)] for r in rows] for c in cols}
    prefill_steps = -(-n // chunk)
    expect = [min(chunk * (i + 1), n) for i in range(prefill_steps)]
    expect += list(range(n + 1, -(-n // bs) * bs + 1))  # decode until the partial block is full
    assert get["computed"] == expect == sec.data["timeline_computed"]
    assert get["pub. total"] == [c // bs for c in expect] == get["full blocks"]
    assert get["published"] == [b - a for a, b in zip([0] + get["pub. total"], get["pub. total"])]
    assert get["table"] == [-(-c // bs) for c in expect]
    assert get["B hits"] == [min(c // bs, shared // bs) * bs for c in expect]
    assert get["B hits, whole"] == [shared] * len(expect)
    assert get["B hits"][0] < shared  # mid-prefill, the chunked manager hides uncomputed blocks


def test_memory_rows_match_the_block_count(quick):
    bs, sec = quick
    prompt, chunk = 2048, 256
    computed = [min(chunk * (i + 1), prompt) for i in range(-(-prompt // chunk))]
    ratio = sum(math.ceil(c / bs) for c in computed) / (len(computed) * math.ceil(prompt / bs))
    assert sec.data["mean_held_ratio"] == pytest.approx(ratio)
    assert memory_rows(100, 30, 16) == [(30, 2, 7), (60, 4, 7), (90, 6, 7), (100, 7, 7)]


def test_rollback_counts_match_a_recount(quick):
    bs, sec = quick
    t = sec.tables[1]
    assert [(p, k) for p, k in zip(t.column("p"), t.column("k"))] == \
        [(p, k) for k in DRAFT_LENGTHS for p in ACCEPT_RATES]
    assert t.column("pub. wrong") == [0] * len(t.rows)  # drafts never reached the cache
    for k in DRAFT_LENGTHS:  # more accepted drafts, fewer blocks to give back
        freed = [r["blocks_freed"] for r in sec.data["rollback"] if r["k"] == k]
        assert freed[-1] < freed[0]
    assert t.column("freed") == [r["blocks_freed"] for r in sec.data["rollback"]]


@pytest.mark.parametrize("p,k,bs", [(0.3, 4, 4), (0.9, 8, 16), (0.6, 3, 1)])
def test_rollback_run_recounts_from_its_records(p, k, bs):
    run = rollback_run(p, k, bs, seqs=3, steps=40, seed=1)
    assert len(run.records) == 3 * 40 and run.drafts == 3 * 40 * k
    for n, d, a, freed in run.records:
        assert 0 <= a <= d == k
        assert freed == math.ceil((n + d) / bs) - math.ceil((n + a) / bs)  # blocks of dropped drafts only
    assert run.published_wrong == 0 and run.published_blocks > 0
    if bs == 1:  # every rejected draft fills a block of its own
        assert run.wrong_blocks_without_rollback == run.wrong_tokens_without_rollback == run.drafts - run.accepted
    assert rollback_run(p, k, bs, seqs=3, steps=40, seed=1).records == run.records  # seeded


def test_section_validates_options_and_needs_no_torch():
    with pytest.raises(ValueError):
        section({"quick": True})
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            "from pagedkv.cli import main; sys.exit(main(['report', '--quick', '--sections', 'chunked_spec']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "Chunked prefill and speculative decoding" in out.stdout
