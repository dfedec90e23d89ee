"""``pagedkv report --quick --out DIR`` end to end, and the report modules no other test runs:
fork_cost, cow_case, plots, and the text rendering every section goes through.

The end-to-end run happens once per module (about ten seconds): every section is present and
not skipped, in report order; report.json and report.md parse and agree with the printed text;
one PNG is written per plottable table; every printed line fits 100 columns and carries no
reStructuredText markup.
"""
from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

from pagedkv.cli import main
from pagedkv.report import SECTIONS, build_report, write_report
from pagedkv.report import cow_case, fork_cost
from pagedkv.report.options import ReportOptions
from pagedkv.sim.sizing import kv_bytes_per_token
from pagedkv.report.tables import TEXT_WIDTH, Section, Table, plain

MIB = 2**20
MARKUP = re.compile(r":[a-z]+:`|(?<!`)``(?!`)")  # a role, or a literal (not a ``` fence)
EXPECTED_PLOTS = ("fork_cost_time", "cow_proof_bytes", "fig2_breakdown", "fig2_saturated",
                  "fig2_throughput", "fig2_load", "block_size_fragmentation", "fig15_sharing", "sharing_sharegpt",
                  "prefix_hits_capacity", "prefix_hits_history", "chunked_prefix_hits",
                  "spec_rollback", "livelock_thrashing", "livelock_guards", "swap_vs_recompute",
                  "host_tier_hits", "host_tier_serving", "fleet_vnodes_rsd", "fleet_bounded_loads",
                  "fleet_routers", "nanovllm_methods")
EXPECTED_PLOTS += ("latency_rate_sharegpt", "latency_rate_alpaca")  # normalized latency against rate


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    pytest.importorskip("matplotlib")  # the PNGs
    out_dir = tmp_path_factory.mktemp("report")
    stdout, stderr = io.StringIO(), io.StringIO()
    import pagedkv.commands.report as command
    from pagedkv.report import render_text

    built = []

    def keep(*args, **kw):  # the sections, to render the terminal view without --out
        built.extend(command_build(*args, **kw))
        return built

    command_build = command.build_report
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(command, "build_report", keep)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = main(["report", "--quick", "--out", str(out_dir)])
    # ``out``: the whole terminal report, as ``pagedkv report`` without --out prints it
    return rc, render_text(built, opts=ReportOptions(quick=True)), stderr.getvalue(), out_dir


def test_quick_report_runs_every_section(quick_report):
    rc, out, err, out_dir = quick_report
    assert rc == 0
    payload = json.loads((out_dir / "report.json").read_text())
    sections = payload["sections"]
    assert [s["key"] for s in sections] == list(SECTIONS)
    for s in sections:
        assert not s["data"].get("skipped"), (s["key"], s["text"])
        assert s["tables"] or s["text"], s["key"]
        assert out.index(s["heading"]) >= 0
    positions = [out.index(s["heading"] + "\n" + "=" * len(s["heading"])) for s in sections]
    assert positions == sorted(positions)  # printed in report order
    assert payload["options"]["quick"] is True and "progress" not in payload["options"]
    for key in SECTIONS:  # progress on stderr, one line as each section starts
        assert f"[pagedkv report] {key} (" in err
    assert "prefix_hits, 1,500 requests: capacity 1/3, " in err
    progress_lines = [line for line in err.splitlines() if line.startswith("[pagedkv report]")]
    assert max(map(len, progress_lines)) <= TEXT_WIDTH  # progress lines fit a terminal too
    assert "fig2, ShareGPT-like: serving runs at" in err
    assert "done in" in err.splitlines()[-1]


def test_quick_report_json_tables_are_whole(quick_report):
    """JSON keeps every column the terminal view may have split or listed under the grid."""
    _, _, _, out_dir = quick_report
    for s in json.loads((out_dir / "report.json").read_text())["sections"]:
        for t in s["tables"]:
            assert t["rows"] and all(len(r) == len(t["columns"]) for r in t["rows"]), t["title"]


def test_quick_report_markdown_and_pngs(quick_report):
    _, _, _, out_dir = quick_report
    md = (out_dir / "report.md").read_text()
    payload = json.loads((out_dir / "report.json").read_text())
    assert md.startswith("# pagedkv report\n")
    flat = " ".join(md.split())  # titles and notes are wrapped at 100 columns
    for s in payload["sections"]:
        assert f"\n## {s['heading']}\n" in md
        for t in s["tables"]:
            assert f"**{' '.join(t['title'].split())}**" in flat
            assert "| " + " | ".join(t["columns"]) + " |" in md
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", md)
    pngs = sorted(p.name for p in out_dir.glob("*.png"))
    assert images and sorted(images) == pngs
    for name in pngs:
        assert (out_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Short, stable names, one per plotted table, chosen by the section (the plot hint's name)
    assert all(re.fullmatch(r"[a-z0-9_]{1,40}\.png", name) for name in pngs), pngs
    assert set(pngs) == {f"{n}.png" for n in EXPECTED_PLOTS}
    named = [t["plot"] for s in payload["sections"] for t in s["tables"] if t["plot"]]
    assert sorted(named) == sorted(EXPECTED_PLOTS)  # each table names its own PNG in report.json
    assert MARKUP.search(md) is None


def test_report_md_prose_wraps_at_100_columns(quick_report):
    """Issue 21: report.md's prose (intro, notes, findings, text blocks, code blocks included)
    wraps at 100 columns; only table rows, which never wrap, and image links may be longer."""
    _, _, _, out_dir = quick_report
    md = (out_dir / "report.md").read_text()
    long = [line for line in md.splitlines()
            if len(line) > TEXT_WIDTH and not line.startswith("|") and not line.startswith("![")]
    assert long == []


def test_report_opens_with_the_findings(quick_report):
    """Issue 21: the findings come first, each a sentence with its number and a link to its
    section (an anchor of a heading that exists)."""
    _, out, _, out_dir = quick_report
    md = (out_dir / "report.md").read_text()
    payload = json.loads((out_dir / "report.json").read_text())
    from pagedkv.report.findings import anchor

    assert md.index("\n## Summary\n") < md.index("\n## " + payload["sections"][0]["heading"])
    assert out.startswith("Run on ") and "\n\n\nSummary\n=======\n" in out
    anchors = {anchor(s["heading"]) for s in payload["sections"]}
    findings = payload["findings"]
    assert len(findings) >= 8
    keys = {s["key"] for s in payload["sections"]}
    for f in findings:
        assert f["section"] in keys and re.search(r"\d", f["text"]), f
    links = re.findall(r"\]\(#([a-z0-9-]+)\)", md[md.index("## Summary"):md.index("\n## ", md.index("## Summary") + 5)])
    assert len(links) == len(findings) and set(links) <= anchors
    assert "96.3%" in findings[0]["text"]  # the paper's number beside ours


def test_report_md_says_units_and_terms_one_way(quick_report):
    """Issue 21: µs everywhere (never "us"), no "n/a" cell, a throughput column of tokens says
    output tokens, no term a reader of the vLLM paper cannot resolve, no table referred to by a
    number it does not carry."""
    _, out, _, out_dir = quick_report
    md = (out_dir / "report.md").read_text()
    payload = json.loads((out_dir / "report.json").read_text())
    for text in (md, out):
        assert re.search(r"\d us\b|\bus per\b|\(us\)", text) is None, re.search(r".{30}\d us\b.{30}", text)
        assert "n/a" not in text
        for term in ("contract v2", "Contract v2", "v2 rule", "no admit rule off", "waiting head",
                     "outputs appended", "at most once per forked", "exactly once per forked"):
            assert term not in text, term
        assert re.search(r"\b[Tt]ables? \d", text) is None, re.search(r".{40}\b[Tt]ables? \d.{40}", text)
    for s in payload["sections"]:
        for t in s["tables"]:
            for c in t["columns"]:
                assert "tokens/s" not in c or c.startswith("output tokens/s"), (t["title"], c)
            assert not re.search(r"\d\.\d{4,} s\b", " ".join(map(str, t["columns"]))), t["title"]
    # a time column in seconds has no value under 0.1 s shown to five digits (12.9 ms, not 0.01286 s)
    for s in payload["sections"]:
        for t in s["tables"]:
            for i, c in enumerate(t["columns"]):
                if c.endswith(" s") and "GiB" not in c:
                    for r in t["rows"]:
                        v = r[i]
                        assert not (isinstance(v, float) and 0 < v < 0.1 and len(repr(v)) > 6), (t["title"], c, v)


def test_every_plot_says_what_it_shows(quick_report):
    """Issue 21: no plot title is a half-sentence such as "right: ..."; fork cost and the CoW
    error on log axes, the error as points with the 1e-3 tolerance drawn; livelocked runs
    coloured apart."""
    _, _, _, out_dir = quick_report
    payload = json.loads((out_dir / "report.json").read_text())
    titles = [t["title"] for s in payload["sections"] for t in s["tables"] if t["plot"]]
    assert len(titles) == len(EXPECTED_PLOTS) and not any("right:" in x for x in titles)
    from pagedkv.report import cow_proof, livelock

    fork = fork_cost.section(ReportOptions(quick=True)).tables[0].plot
    assert fork["logy"] and fork["logx"] and "µs" in fork["ylabel"]
    proof = cow_proof.section(ReportOptions(quick=True))
    assert proof.tables[0].plot is None  # three numbers: the table says them
    assert "right:" not in proof.tables[1].title and "right:" not in proof.tables[1].plot.get("title", "")
    guards = livelock.section(ReportOptions(quick=True)).tables[-1].plot
    assert guards["highlight"]["column"] == "outcome" and guards["highlight"]["prefix"] == "livelock"


def test_sharing_sharegpt_is_also_served(quick_report):
    """Issue 21: the ShareGPT-like sharing is measured as the paper measures section 6.3 too: a
    serving run at a stated Poisson rate, blocks saved time-weighted over the run; the text
    explains the beam-6 gap with a number it computes."""
    _, _, _, out_dir = quick_report
    md = (out_dir / "report.md").read_text()
    payload = json.loads((out_dir / "report.json").read_text())
    sec = next(s for s in payload["sections"] if s["key"] == "sharing")
    for k in ("parallel/2", "parallel/6", "beam/2", "beam/6"):
        served = sec["data"]["saving"][f"sharegpt/{k}"]["serving"]
        assert served["rate"] > 0 and 0 < served["saved"] < 1 and served["requests"] == 20, (k, served)
    share = next(t for t in sec["tables"] if t["plot"] == "sharing_sharegpt")
    assert {"serving run saved %", "serving rate req/s"} <= set(share["columns"])
    beam6 = sec["data"]["saving"]["sharegpt/beam/6"]["serving"]["saved"]
    flat = " ".join(md.split())
    assert f"6 x (1 - {beam6:.3f}) = {6 * (1 - beam6):.2f} beams' worth of distinct blocks" in flat


def test_quick_report_fits_a_terminal(quick_report):
    _, out, _, _ = quick_report
    long = [line for line in out.splitlines() if len(line) > TEXT_WIDTH]
    assert long == []
    assert MARKUP.search(out) is None, MARKUP.search(out)


# ---- fork_cost ------------------------------------------------------------------------------------


def test_fork_cost_section_quick():
    sec = fork_cost.section(ReportOptions(quick=True))
    t = sec.tables[0]
    kv = kv_bytes_per_token("Llama-3.1-8B")
    assert t.column("tokens") == [128, 512, 2048]
    assert t.column("blocks shared") == [8, 32, 128]
    assert t.column("blocks allocated") == [0, 0, 0]  # a fork allocates nothing
    assert t.column("eager copy MiB") == [n * kv / MIB for n in (128, 512, 2048)]
    assert t.column("paged fork MiB") == [0, 0, 0]  # measured: the fork queued no copy
    assert t.column("1st write MiB, last block full") == [0, 0, 0]
    assert t.column("1st write MiB, last block partial") == [16 * kv / MIB] * 3  # one 16-token block: 2 MiB
    # plotted on log axes (the paged fork's zero bytes cannot be; its time can): measured fork µs
    # against the modelled copy of the same KV at the H100's HBM bandwidth, read + write
    assert t.plot["name"] == "fork_cost_time" and t.plot["logy"] and t.plot["logx"]
    assert t.plot["y"] == ["fork µs (median)", "eager copy µs (modelled)"]  # the flat line is not drawn
    assert t.column("eager copy µs (modelled)") == [round(2 * n * kv / 3.35e12 * 1e6, 3) for n in (128, 512, 2048)]
    assert t.column("eager copy µs (modelled)")[-1] == 160.26  # 2 x 256 MiB / 3.35 TB/s
    assert all(v > 0 for v in t.column("fork µs (median)"))
    assert sec.data["blocks_allocated_by_fork"] == 0 and sec.data["longest_tokens"] == 2048
    assert sec.data["longest_eager_copy_mib"] == 256.0 and sec.data["fork_copy_mib"] == 0


def test_fork_cost_follows_block_size_and_model():
    sec = fork_cost.section(ReportOptions(quick=True, block_size=32, model="OPT-13B"))
    t = sec.tables[0]
    assert t.column("blocks shared") == [4, 16, 64]
    assert t.column("1st write MiB, last block partial") == [32 * 819_200 / MIB] * 3  # 25 MiB
    assert "OPT-13B" in t.title


def test_first_write_copies_one_block_only_into_a_partial_block():
    assert fork_cost._first_write_copies(32, 16) == 0
    assert fork_cost._first_write_copies(33, 16) == 1
    assert fork_cost._first_write_copies(1, 16) == 1


# ---- cow_case ---------------------------------------------------------------------------------------


def test_cow_case_is_read_back_from_the_manager():
    """A fresh pool hands out blocks 0, 1 to the 6-token prompt; the child's first write copies
    block 1 into block 2 (the next free one), so its token lands at slot 2 x 4 + 2 = 10 while the
    parent, now block 1's last holder, writes in place at slot 6."""
    sec = cow_case.section(ReportOptions())
    assert sec.data == {"copy_pair": [1, 2], "child_slot": 10, "parent_slot": 6}
    text = sec.text[0]
    assert "queued copies [CopyOp(src=1, dst=2)]" in text
    assert "child   table [0, 2]" in text and "refcounts {0:2, 2:1}" in text
    assert "copies []" in text  # the full last block of the contrast case needs no copy
    assert all(len(line) <= TEXT_WIDTH for line in sec.to_text().splitlines())


# ---- plots ------------------------------------------------------------------------------------------


def test_plot_table_draws_what_the_hint_names(tmp_path):
    pytest.importorskip("matplotlib")
    from pagedkv.report.plots import plot_available, plot_table

    assert plot_available()
    line = Table("A line: x vs y", ["x", "y", "z", "ideal"],
                 plot={"name": "a_line", "x": "x", "y": ["y", "z"], "logx": True, "ymin": 0,
                       "hline": ["ideal", "unbounded"]})
    for i in (1, 2, 4):
        line.add(i, i * 1.5, None, 9.0)  # a missing cell is a gap, not an error
    path = plot_table(line, tmp_path)
    assert path == tmp_path / "a_line.png" and path.read_bytes()[:4] == b"\x89PNG"
    stacked = Table("Stacked", ["run", "a %", "b %", "lo", "hi", "paper"],
                    plot={"name": "stack", "x": "run", "y": ["a %", "b %"], "kind": "stacked",
                          "marker": "paper", "band": {"a %": ["lo", "hi"]}})
    stacked.add("Max", 20.0, 80.0, 18.0, 23.0, 20.4)
    stacked.add("paged", 96.0, 4.0, None, None, None)
    bars = Table("Bars", ["run", "a %", "lo", "hi", "p lo", "p hi", "n"],
                 plot={"name": "bars", "x": "run", "y": ["a %"], "kind": "bar", "annotate": "n",
                       "band": {"a %": ["lo", "hi"]}, "ref_range": ["p lo", "p hi"]})
    bars.add("n=2", 17.0, 16.0, 24.0, 16.2, 30.5, 7)
    assert plot_table(stacked, tmp_path).name == "stack.png"
    assert plot_table(bars, tmp_path).name == "bars.png"
    assert plot_table(Table("no hint", ["x"], rows=[[1]]), tmp_path) is None
    assert plot_table(Table("no rows", ["x", "y"], plot={"name": "empty", "x": "x", "y": ["y"]}), tmp_path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_line.png", "bars.png", "stack.png"]


@pytest.mark.parametrize("name", [None, "Has Caps", "x" * 41, "a-b", ""])
def test_a_plot_needs_a_short_stable_name(name):
    from pagedkv.report.plots import plot_name

    hint = {"x": "x", "y": ["y"]} if name is None else {"name": name, "x": "x", "y": ["y"]}
    with pytest.raises(ValueError, match="short lowercase name"):
        plot_name(Table("t", ["x", "y"], rows=[[1, 2]], plot=hint))


def test_two_plots_of_one_name_are_refused(tmp_path):
    t1 = Table("one", ["x", "y"], rows=[[1, 2]], plot={"name": "same", "x": "x", "y": ["y"]})
    t2 = Table("two", ["x", "y"], rows=[[1, 2]], plot={"name": "same", "x": "x", "y": ["y"]})
    with pytest.raises(ValueError, match="two plots are named same"):
        write_report([Section("a", "A", tables=[t1]), Section("b", "B", tables=[t2])], ReportOptions(), tmp_path)
    assert not (tmp_path / "report.md").exists()  # refused before anything is written


def test_plots_are_optional(tmp_path, monkeypatch, capsys):
    """Without matplotlib the report still writes its Markdown and JSON, and says nothing is drawn."""
    from pagedkv.report import plots

    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    assert plots.plot_available() is False
    sections = build_report(ReportOptions(quick=True), ["cow_case", "fork_cost"])
    written = write_report(sections, ReportOptions(quick=True), tmp_path / "out")
    assert [p.name for p in written] == ["report.md", "report.json"]
    assert "![" not in (tmp_path / "out" / "report.md").read_text()
    assert main(["report", "--quick", "--sections", "cow_case", "--out", str(tmp_path / "cli")]) == 0
    assert "No PNG plots: matplotlib is not installed" in capsys.readouterr().out  # with the summary


# ---- text rendering -----------------------------------------------------------------------------


def test_plain_strips_sphinx_markup():
    assert plain("the real :class:`~pagedkv.KVCacheManager` and :mod:`pagedkv.sim.sizing`") == \
        "the real KVCacheManager and pagedkv.sim.sizing"
    assert plain("``usage()`` and :py:func:`~a.b.f`") == "usage() and f"


def test_wide_table_splits_and_lists_prose_under_the_grid():
    t = Table("t", ["run"] + [f"column number {i}" for i in range(8)] + ["why"])
    t.add("first run", *range(8), "an explanation far longer than thirty characters, " * 3)
    t.add("second", *range(10, 18), "short")
    text = t.to_text(60)
    lines = text.splitlines()
    assert all(len(line) <= 60 for line in lines), text
    grids = [line for line in lines if line.startswith("run ")]
    assert len(grids) >= 3  # the eight numeric columns need several grids, each led by "run"
    for i in range(8):  # every column and every value is still there
        assert f"column number {i}" in text
    assert "  why:" in lines and any(line.startswith("  - first run: an explanation") for line in lines)
    assert text.count("second") == len(grids) + 1


def test_a_table_that_fits_is_one_grid():
    t = Table("small", ["a", "b"], notes=["a note " * 30])
    t.add("x", 1.5)
    lines = t.to_text().splitlines()
    assert lines[:4] == ["small", "a    b", "-  ---", "x  1.5"]
    assert all(len(line) <= TEXT_WIDTH for line in lines) and lines[4].startswith("  a note")


def test_section_text_wraps_paragraphs_and_keeps_worked_examples():
    sec = Section("k", "Heading", intro="word " * 60, text=["para " * 40, "  line one\n  line two"])
    lines = sec.to_text(50).splitlines()
    assert all(len(line) <= 50 for line in lines)
    assert "  line one" in lines and "  line two" in lines
