"""The simulator's headline claims and the three report sections built on it.

Stated tolerances and why:

- Max on ShareGPT-like with a 2,048 limit leaves 20.4% +- 5 points for token states (the paper:
  20.4%). On the paper's memory 7 reservations fit, so the share is 0.9115 x (time-weighted live
  length) / 2,048. Our lengths match the paper's *means* (161 + 338) with an assumed log-sd, not
  the real ShareGPT shape, and the live length depends on the shape: constant outputs would give
  161 + 338/2 = 330 tokens (14.7%), an unclipped log-sd-1 lognormal about 620 (27.6%). Across
  seeds at 300 requests we measure 19.3-21.9%. A +-5-point band admits shape differences within
  that plausible range and still rejects broken accounting (counting reservations as token states
  gives ~91%, counting only prompts ~8%).
- Paging keeps internal fragmentation under 4% of allocated memory at block size 16 (the issue's
  bound; expected ~(16-1)/2 slots of ~470-token sequences, about 1.6%).
- Fragmentation grows with block size: strictly, over 4 / 16 / 64 / 256 (each step quadruples the
  expected tail waste, far beyond run-to-run noise).
- Sharing savings grow with n and beam width: strictly, over 2 / 4 / 6.
"""
from __future__ import annotations

import argparse

import pytest

from pagedkv.report import block_size as block_size_section
from pagedkv.report import fig2, sharing
from pagedkv.report.options import ReportOptions
from pagedkv.tables import Section

PAPER_MAX_TOKEN_SHARE = 0.204  # vLLM paper Fig. 2 (a check, never a result)


@pytest.fixture(scope="module")
def sharegpt():
    return fig2.load("sharegpt", 300, seed=0)


def test_paper_memory_is_computed():
    num_blocks, cost = fig2.paper_setup(16)
    assert num_blocks * 16 == 15_728  # vLLM paper Table 1: 15.7K slots for OPT-13B
    assert cost.kv_bytes_per_token == 819_200


def test_max_leaves_about_a_fifth_for_token_states(sharegpt):
    _, m = fig2.run_one(sharegpt, "max")
    assert abs(m.token_share - PAPER_MAX_TOKEN_SHARE) <= 0.05, m.shares
    assert m.shares["external_fragmentation"] == pytest.approx(1_392 / 15_728, abs=1e-9)  # 7 x 2,048 fit
    assert m.shares["internal_fragmentation"] > m.shares["token_states"]


def test_paging_internal_fragmentation_under_4_percent(sharegpt):
    _, m = fig2.run_one(sharegpt, "paged")
    assert m.internal_fragmentation_ratio < 0.04
    assert m.token_share > 0.9
    assert m.shares["reserved"] == 0 and m.shares["external_fragmentation"] == 0


def test_reservation_ordering(sharegpt):
    shares = {a: fig2.run_one(sharegpt, a)[1].token_share for a in ("max", "pow2", "oracle", "paged")}
    assert shares["max"] < shares["pow2"] <= shares["oracle"] < shares["paged"]


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


def _check_section(sec: Section, key: str) -> None:
    assert isinstance(sec, Section) and sec.key == key and sec.tables
    for t in sec.tables:
        assert t.rows and all(len(r) == len(t.columns) for r in t.rows)
        if t.plot:
            for col in [t.plot["x"], *t.plot["y"]]:
                assert col in t.columns
    assert sec.to_text() and sec.to_markdown() and sec.to_dict()


def test_fig2_section_quick():
    sec = fig2.section(ReportOptions(quick=True))
    _check_section(sec, "fig2")
    brk = sec.tables[0]
    runs = brk.column("run")
    assert [r.split(" / ")[1] for r in runs] == ["Max", "Pow2", "Oracle", "paged"] * 2
    for run, paper, why in zip(runs, brk.column("paper token states %"), brk.column("why ours differs / what it is")):
        workload, name = run.split(" / ")
        # The paper's bar sits on the ShareGPT row of the same allocator, and nowhere else.
        assert paper == (fig2.PAPER_TOKEN_SHARE[name] if workload == "ShareGPT-like" else None), run
        assert isinstance(why, str) and why, run
    assert "reservations fit" in brk.rows[0][-1] and "last-block tails" in brk.rows[3][-1]
    for row in brk.rows:  # the five categories cover the memory (rounded to 0.1 each)
        assert sum(row[1:6]) == pytest.approx(100, abs=0.3)
    shares = dict(zip(runs, brk.column("token states %")))
    for wl in ("ShareGPT-like", "Azure conv trace"):  # the paper's ordering holds on each workload
        assert shares[f"{wl} / Max"] < shares[f"{wl} / Pow2"] < shares[f"{wl} / paged"]
        assert shares[f"{wl} / Max"] < shares[f"{wl} / Oracle"] < shares[f"{wl} / paged"]
    cost = sec.tables[1]
    assert cost.column("x Max")[0] == 1 and cost.column("x Max")[3] > 1  # paging batches more


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
    t = sec.tables[0]
    for run, width, paper in zip(t.column("run"), t.column("width"), t.column("paper %")):
        mode = "parallel" if " n=" in run else "beam"
        # Fig. 15 is Alpaca at block size 16: its bar sits on the matching Alpaca row only.
        assert paper == (sharing.PAPER_SAVING[(mode, width)] if run.startswith("Alpaca") else None), run
    saved = dict(zip(t.column("run"), t.column("saved %")))
    for label in ("Alpaca", "ShareGPT"):  # savings grow with the width, beams share more than samples
        for kind in ("n", "beam"):
            row = [saved[f"{label} {kind}={k}"] for k in (2, 4, 6)]
            assert 0 < row[0] < row[1] < row[2], (label, kind, row)
        assert all(saved[f"{label} beam={k}"] > saved[f"{label} n={k}"] for k in (2, 4, 6))



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
    for name in ("Max", "Pow2", "Oracle", "paged", "token states %"):
        assert name in out
    bad = p.parse_args(["sharegpt", "--num-requests", "0"])
    assert simulate.run(bad) == 2
    assert "num-requests" in capsys.readouterr().err
