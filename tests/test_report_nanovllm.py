"""The nanovllm report section: one engine's scheduler on nano-vllm's allocator and pagedkv's drop-in.

nano-vllm's own files are not in this repository and not on PyPI, so these tests run the engine
written here with its rules, and check the loader on checkouts made in a temporary directory: one
of the wrong shape, one whose file cannot import, and one of the right shape (its three files
import what nano-vllm's do, and take their classes from the engine written here).
"""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from pagedkv.cli import main
from pagedkv.report import SECTIONS, ReportOptions
from pagedkv.report.findings import findings
from pagedkv.report.nanovllm import FULL, QUICK, differing_steps, section, workload
from pagedkv.report.tables import TEXT_WIDTH
from pagedkv.sim.nanovllm_files import ENV, find_engine, load_engine, rules_engine
from pagedkv.sim.nanovllm_replay import ALLOCATORS, METHODS, replay
from pagedkv.sim.nanovllm_rules import SOURCE

# nano-vllm's engine files' own imports, then the class taken from the engine written here
GOOD_FILES = {
    "sequence.py": "from nanovllm.sampling_params import SamplingParams\n"
                   "from pagedkv.sim.nanovllm_rules import Sequence, SequenceStatus\n",
    "block_manager.py": "import numpy as np\nfrom nanovllm.engine.sequence import Sequence\n"
                        "from pagedkv.sim.nanovllm_rules import BlockManager\n",
    "scheduler.py": "from collections import deque\nfrom nanovllm.config import Config\n"
                    "from nanovllm.engine.sequence import Sequence, SequenceStatus\n"
                    "from nanovllm.engine.block_manager import BlockManager\n"
                    "from pagedkv.sim.nanovllm_rules import Scheduler\n",
}


def checkout(root, files: dict[str, str]):
    engine = root / "nanovllm" / "engine"
    engine.mkdir(parents=True)
    for name, text in files.items():
        (engine / name).write_text(text)
    return root


def no_nanovllm_modules() -> bool:
    return not any(name == "nanovllm" or name.startswith("nanovllm.") for name in sys.modules)


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


@pytest.fixture(scope="module")
def quick_section():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(ENV, raising=False)
        return section(ReportOptions(quick=True))


def test_section_json_has_every_field_and_preempts(quick_section):
    sec = quick_section
    assert SECTIONS["nanovllm"] == "nanovllm" and sec.key == "nanovllm"
    assert list(SECTIONS)[-1] == "nanovllm"  # after the sections of pagedkv's own extensions
    d = json.loads(json.dumps(sec.to_dict()))["data"]
    n, num_blocks, runs = QUICK
    assert (d["requests"], d["num_blocks"], d["runs"], d["block_size"], d["trace"]) == (n, num_blocks, runs, 256, "mooncake")
    assert set(d["allocators"]) == set(ALLOCATORS)
    for a in ALLOCATORS:
        x = d["allocators"][a]
        assert set(x) == {"steps", "preemptions", "hit_tokens", "admitted_tokens", "hit_rate", "blocks_in_use_mean",
                          "block_steps", "blocks_in_use_peak", "allocator_ms", "allocator_ms_runs", "ms_by_method"}
        assert set(x["ms_by_method"]) == set(METHODS) and len(x["allocator_ms_runs"]) == runs
        assert x["preemptions"] > 0  # the pool is small enough that sequences are preempted
        assert x["blocks_in_use_peak"] == num_blocks  # and it fills
        assert 0 < x["blocks_in_use_mean"] < num_blocks
        assert 0 < x["hit_tokens"] < x["admitted_tokens"] and x["hit_rate"] == x["hit_tokens"] / x["admitted_tokens"]
        assert x["allocator_ms"] > 0
    assert d["time_ratio"] == d["allocators"]["pagedkv"]["allocator_ms"] / d["allocators"]["nano-vllm"]["allocator_ms"]
    # the section says which engine ran: here, with no nano-vllm installed, the one written here
    if importlib.util.find_spec("nanovllm") is None:
        assert d["engine"]["own"] is False and d["engine"]["source"].startswith(SOURCE)
        assert sec.heading == "A scheduler with nano-vllm's rules on both allocators"
        assert sec.text[0] == f"Ran: {d['engine']['source']}."
        assert sec.tables[0].column("allocator") == ["nano-vllm's rules", "pagedkv"]
    assert all(len(line) <= TEXT_WIDTH for line in sec.to_text().splitlines())
    (finding,) = [f for f in findings([sec]) if f.key == "nanovllm"]
    pre = d["allocators"]["pagedkv"]["preemptions"]
    assert f"on {n} Mooncake requests" in finding.text and f"with {pre} preemptions" in finding.text


def test_tight_pool_totals_agree_and_the_section_counts_differing_steps(quick_section):
    """At the report's pool, the two managers legitimately schedule a few steps differently (a
    block two sequences computed in one step is kept as the last copy by nano-vllm, the first by
    pagedkv): the section counts those steps, and on this trace the totals still agree."""
    d = quick_section.data
    by = d["allocators"]
    for key in ("steps", "preemptions", "hit_tokens", "admitted_tokens", "blocks_in_use_peak"):
        assert by["nano-vllm"][key] == by["pagedkv"][key], key
    assert 0 < d["differing_steps"] < by["pagedkv"]["steps"] and d["first_differing_step"] > 0
    assert quick_section.text[-1].startswith(f"The schedules differ at {d['differing_steps']} of "
                                             f"{by['pagedkv']['steps']:,} steps (first at step "
                                             f"{d['first_differing_step']})")


def test_method_times_plot(quick_section, tmp_path):
    pytest.importorskip("matplotlib")
    from pagedkv.report.plots import plot_table

    table = quick_section.tables[1]
    assert table.column("method") == [*METHODS, "total"]
    assert table.rows[-1][1] == quick_section.data["allocators"]["nano-vllm"]["allocator_ms"]
    path = plot_table(table, tmp_path)
    assert path.name == "nanovllm_methods.png" and path.stat().st_size > 0


def test_large_pool_same_hits_every_step(no_env):
    """A pool that never evicts: the two allocators find the same hits, step for step."""
    requests = workload(ReportOptions(), 20)
    engine = rules_engine("test")
    need = sum(-(-(len(p) + out) // 256) for p, out in requests)
    runs = {a: replay(engine, a, requests, need) for a in ALLOCATORS}
    nano, paged = runs["nano-vllm"], runs["pagedkv"]
    assert paged.hit_tokens == nano.hit_tokens > 0
    assert paged.admitted_tokens == nano.admitted_tokens == sum(len(p) for p, _ in requests)  # no re-admission
    assert paged.preemptions == nano.preemptions == 0
    assert paged.scheduled_tokens == nano.scheduled_tokens  # the same schedule, step for step
    assert differing_steps(nano, paged) == (0, None)


def test_workload_takes_the_first_requests_that_fit():
    requests = workload(ReportOptions(), 30)
    assert len(requests) == 30
    assert all(len(p) + out <= 8192 and 1 <= out <= 512 for p, out in requests)
    assert FULL[0] > QUICK[0] and FULL[2] >= 3  # the full report's time is a median of at least 3 runs


def test_replay_refuses_a_pool_smaller_than_a_request(no_env):
    requests = workload(ReportOptions(), 3)
    longest = max(len(p) + out for p, out in requests)
    with pytest.raises(ValueError, match="num_blocks 1 of 256 tokens cannot hold the longest request"):
        replay(rules_engine("test"), "pagedkv", requests, 1)
    assert longest > 256
    with pytest.raises(ValueError, match="allocator must be one of"):
        replay(rules_engine("test"), "vllm", requests, 1000)


@pytest.mark.parametrize("bad", ["empty directory", "no such path", "two files missing"])
def test_loader_refuses_a_path_without_the_engine(tmp_path, bad):
    path = {"empty directory": tmp_path, "no such path": tmp_path / "elsewhere",
            "two files missing": tmp_path / "nanovllm"}[bad]
    if bad == "two files missing":
        (path / "engine").mkdir(parents=True)
        (path / "engine" / "scheduler.py").write_text("")  # two of the three files missing
    with pytest.raises(ValueError, match=r"^nanovllm '.*': no nano-vllm engine there \(expected nanovllm/engine/"):
        load_engine(path)
    assert no_nanovllm_modules()


def test_loader_refuses_what_is_not_a_path():
    with pytest.raises(ValueError, match="nanovllm must be a path to a nano-vllm checkout, got int"):
        load_engine(3)


def test_loader_refuses_an_engine_of_another_shape(tmp_path):
    """An engine before chunked prefill (a fork on PyPI has one): allocate(seq) only."""
    files = dict(GOOD_FILES, **{"block_manager.py": "class BlockManager:\n"
                                + "".join(f"    def {m}(self, seq): pass\n" for m in METHODS)})
    root = checkout(tmp_path, files)
    with pytest.raises(ValueError, match="not the nano-vllm engine this replay drives: its BlockManager.allocate "
                                         "does not take num_cached_blocks"):
        load_engine(root)
    assert no_nanovllm_modules()


def test_loader_reports_a_file_that_cannot_import(tmp_path):
    root = checkout(tmp_path, dict(GOOD_FILES, **{"sequence.py": "import a_module_nobody_installed\n"}))
    with pytest.raises(ValueError, match=r"cannot load engine/sequence.py \(ModuleNotFoundError"):
        load_engine(root, "--nanovllm")
    assert no_nanovllm_modules()


def test_a_checkout_runs_its_own_files_and_the_section_says_so(tmp_path, no_env):
    root = checkout(tmp_path, GOOD_FILES)
    engine = load_engine(root)
    assert engine.own and engine.source == (f"nano-vllm's own sequence.py, block_manager.py, scheduler.py "
                                            f"from {root / 'nanovllm' / 'engine'}")
    assert no_nanovllm_modules()  # the stubs and the three modules are unregistered after loading
    assert load_engine(root / "nanovllm").source == engine.source  # the package directory works too
    sec = section(ReportOptions(quick=True, nanovllm=root))
    assert sec.heading == "nano-vllm's own scheduler on both allocators"
    assert sec.data["engine"] == {"source": engine.source, "own": True}
    assert sec.text[0] == f"Ran: {engine.source}."
    assert sec.tables[0].column("allocator") == ["nano-vllm", "pagedkv"]


def test_environment_variable_names_the_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(checkout(tmp_path, GOOD_FILES)))
    assert find_engine().own
    monkeypatch.setenv(ENV, str(tmp_path / "elsewhere"))
    with pytest.raises(ValueError, match=r"^\$PAGEDKV_NANOVLLM '.*elsewhere': no nano-vllm engine there"):
        find_engine()


def test_cli_refuses_a_bad_checkout_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    rc = main(["report", "--sections", "nanovllm", "--nanovllm", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"pagedkv report: error: --nanovllm '{tmp_path}': no nano-vllm engine there")
    rc = main(["report", "--sections", "fork_cost", "--nanovllm", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "--nanovllm: the nanovllm section, the only one that runs nano-vllm, is not among" in err
    monkeypatch.setenv(ENV, str(tmp_path))
    rc = main(["report", "--sections", "nanovllm"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "PAGEDKV_NANOVLLM" in err and "unset PAGEDKV_NANOVLLM" in err


def test_an_installed_nanovllm_runs_and_one_of_another_shape_is_passed_over(tmp_path, monkeypatch):
    """An installed ``nanovllm`` package is found without importing it: nano-vllm's own engine
    runs; a package of another shape (a fork from before chunked prefill) is passed over, and
    the engine written here runs with the reason in its source line."""
    monkeypatch.delenv(ENV, raising=False)
    good, fork = tmp_path / "good", tmp_path / "fork"
    checkout(good, dict(GOOD_FILES, **{"../__init__.py": "raise ImportError('never imported')\n"}))
    monkeypatch.syspath_prepend(str(good))
    engine = find_engine()
    assert engine.own and engine.source.endswith(str(good / "nanovllm" / "engine"))
    checkout(fork, dict(GOOD_FILES, **{"../__init__.py": "", "block_manager.py": "class BlockManager:\n    pass\n"}))
    monkeypatch.syspath_prepend(str(fork))
    engine = find_engine()
    assert not engine.own and engine.source.startswith(SOURCE + " (passed over: the installed nanovllm ")
    assert "not the nano-vllm engine this replay drives: its BlockManager has no can_allocate" in engine.source
    assert no_nanovllm_modules()


def test_a_data_dir_without_the_mooncake_trace_skips_the_section(tmp_path, no_env):
    sec = section(ReportOptions(quick=True, data_dir=tmp_path))
    assert sec.data["skipped"] is True and not sec.tables
    assert sec.text[-1].endswith(": section skipped.") and "mooncake" in sec.text[-1].lower()
    assert findings([sec]) == []
