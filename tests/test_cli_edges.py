"""The command line at its edges (issue 17, section 5): nothing a user types or the disk does ends
in a traceback.

- ``pagedkv fleet`` (``--router all``, its default) completes without msgspec: the precise
  router then gets the replicas' events in process, and routes exactly as it does from the wire;
- a write that fails after the checks (``/dev/full``, ENOSPC, EIO) is one line on stderr, exit
  status 1, and leaves no partial file (the old one, if any, untouched);
- values accepted silently before: a Mooncake line with fewer ``hash_ids`` than blocks,
  ``simulate --rate 1e-300``, ``fleet --num-requests 10**12``, ``--version extra``;
- ``size --config`` on a binary file or a directory;
- a stranger's bad invocations of every subcommand: one line, exit 2, no traceback.

Every case runs ``pagedkv.cli.main`` in-process with the smallest arguments that reach the code.
"""
from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import pytest

import pagedkv
from pagedkv.cli import main

SRC = Path(pagedkv.__file__).resolve().parents[1]  # the tree under test, for the subprocesses
DEV_FULL = Path("/dev/full")
needs_dev_full = pytest.mark.skipif(not DEV_FULL.exists(), reason="/dev/full is Linux-only")


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors exit through SystemExit
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err: str, rc: int, code: int) -> None:
    assert rc == code, (rc, err)
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err


# ---- fleet without msgspec ---------------------------------------------------------------------

SMALL_FLEET = ["fleet", "--num-requests", "40", "--replicas", "2"]


def test_fleet_router_all_completes_without_msgspec(capsys, monkeypatch):
    """The README installs ".[plot]" only; ``pagedkv fleet`` (every router) must still run."""
    monkeypatch.setitem(sys.modules, "msgspec", None)  # `import msgspec` raises ImportError
    rc, out, err = run(SMALL_FLEET, capsys)
    assert rc == 0, err
    rows = [line.split()[0] for line in out.splitlines() if line and line.split()[0] in
            ("round-robin", "least-loaded", "ring", "ring-bounded", "precise")]
    assert rows[:5] == ["round-robin", "least-loaded", "ring", "ring-bounded", "precise"]
    text = " ".join(out.split())
    assert "KV events delivered in process" in text and 'pip install "pagedkv[events]"' in text
    assert "MB of KV events decoded" not in text


def test_fleet_json_says_how_events_travelled(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "msgspec", None)
    out = tmp_path / "f.json"
    rc, _, err = run(SMALL_FLEET + ["--router", "precise", "--json", str(out)], capsys)
    assert rc == 0, err
    payload = json.loads(out.read_text())
    assert payload["events"] == "in process" and payload["results"][0]["event_bytes"] == 0


def test_precise_router_routes_the_same_from_objects_as_from_the_wire():
    """Same requests, same fleet: every assignment, hit and router count equal both ways."""
    pytest.importorskip("msgspec")
    from pagedkv.sim.fleet import run_fleet
    from pagedkv.sim.routers import PrefixAwareRouter
    from pagedkv.sim.traces import load_trace, trace_path

    reqs = load_trace(trace_path("mooncake"), limit=150)
    kw = dict(replicas=3, num_blocks=2000, block_size=16, max_len=16384)
    wire = run_fleet(reqs, PrefixAwareRouter(16), wire=True, **kw)
    objs = run_fleet(reqs, PrefixAwareRouter(16), wire=False, **kw)
    assert (wire.assignment == objs.assignment).all()
    assert wire.router_stats == objs.router_stats and wire.router_stats.get("affinity", 0) > 0
    assert wire.summary()["hit_rate"] == objs.summary()["hit_rate"] > 0
    assert wire.event_bytes > 0 and objs.event_bytes == 0


def test_run_fleet_wire_true_without_msgspec_is_a_clear_import_error(monkeypatch):
    from pagedkv.sim.fleet import run_fleet
    from pagedkv.sim.routers import PrefixAwareRouter
    from pagedkv.sim.traces import load_trace, trace_path

    monkeypatch.setitem(sys.modules, "msgspec", None)
    reqs = load_trace(trace_path("mooncake"), limit=2)
    with pytest.raises(ImportError, match=r"pagedkv\[events\]"):
        run_fleet(reqs, PrefixAwareRouter(16), replicas=1, num_blocks=9000, wire=True, max_len=131072)
    with pytest.raises(ValueError, match="wire must be"):
        run_fleet(reqs, PrefixAwareRouter(16), replicas=1, num_blocks=9000, wire="yes", max_len=131072)


def test_precise_router_refuses_what_is_not_an_event():
    from pagedkv.sim.routers import PrefixAwareRouter
    from pagedkv.types import AllBlocksCleared, BlockStored

    r = PrefixAwareRouter(4)
    r.bind(["a"])
    r.on_events(0, [BlockStored((b"\x00" * 7 + b"\x05",), None, (1, 2, 3, 4), 4)])
    assert r.blocks_held(0) == frozenset({5})
    r.on_events(0, [BlockStored((7,), None, (1, 2, 3, 4), 4, medium="CPU")])  # host tier: not a GPU hit
    assert r.blocks_held(0) == frozenset({5})
    with pytest.raises(ValueError, match="blocks of 8 tokens"):
        r.on_events(0, [BlockStored((9,), None, tuple(range(8)), 8)])
    with pytest.raises(ValueError, match="not a KV event"):
        r.on_events(0, ["BlockStored"])
    with pytest.raises(ValueError, match="a single AllBlocksCleared"):
        r.on_events(0, AllBlocksCleared())
    r.on_events(0, [AllBlocksCleared()])
    assert r.blocks_held(0) == frozenset()


# ---- writes that fail after the checks ---------------------------------------------------------


@needs_dev_full
def test_bench_json_onto_dev_full_is_one_line(capsys, monkeypatch):
    from pagedkv.commands import bench

    monkeypatch.setattr(bench, "gather", lambda quick: [{"name": "x", "median": 1.0, "unit": "ns"}])
    rc, out, err = run(["bench", "--quick", "--json", str(DEV_FULL)], capsys)
    one_error_line(err, rc, 1)
    assert "pagedkv bench: error: --json /dev/full: cannot write (No space left on device)" in err
    assert "1 rows" in out  # the table was printed before the write failed


@needs_dev_full
@pytest.mark.parametrize("argv", [["size", "Llama-3.1-8B"], ["report", "--quick", "--sections", "cow_case"]])
def test_stdout_onto_dev_full_is_one_line_and_status_1(tmp_path, argv):
    """``pagedkv report > /dev/full``: a subprocess, since the failure is on the real stdout."""
    import subprocess

    with open(DEV_FULL, "w") as full:
        proc = subprocess.run([sys.executable, "-m", "pagedkv", *argv], stdout=full, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if not x.startswith("[pagedkv report]")]
    assert lines == [f"pagedkv {argv[0]}: error: standard output: cannot write (No space left on device)"]
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_json_write_failure_leaves_the_old_file_and_no_temporary(capsys, monkeypatch, tmp_path, code):
    from pagedkv.commands import bench

    monkeypatch.setattr(bench, "gather", lambda quick: [{"name": "x", "median": 1.0, "unit": "ns"}])
    target = tmp_path / "bench.json"
    target.write_text('{"old": true}')
    real_fsync = os.fsync

    def failing_fsync(fd):  # the data went into the page cache; the disk refuses it
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", failing_fsync)
    rc, _, err = run(["bench", "--quick", "--json", str(target)], capsys)
    monkeypatch.setattr(os, "fsync", real_fsync)
    one_error_line(err, rc, 1)
    assert f"--json {target}: cannot write ({os.strerror(code)}); nothing was written" in err
    assert target.read_text() == '{"old": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]


def test_json_is_written_whole_with_the_usual_mode(capsys, monkeypatch, tmp_path):
    from pagedkv.commands import bench

    monkeypatch.setattr(bench, "gather", lambda quick: [{"name": "x", "median": 1.0, "unit": "ns"}])
    target = tmp_path / "b.json"
    rc, _, err = run(["bench", "--quick", "--json", str(target)], capsys)
    assert rc == 0, err
    assert json.loads(target.read_text())["rows"][0]["name"] == "x"
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json"]


def test_json_through_a_symlink_replaces_the_target_not_the_link(capsys, monkeypatch, tmp_path):
    from pagedkv.commands import bench

    monkeypatch.setattr(bench, "gather", lambda quick: [{"name": "x", "median": 1.0, "unit": "ns"}])
    real = tmp_path / "real.json"
    real.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    rc, _, err = run(["bench", "--quick", "--json", str(link)], capsys)
    assert rc == 0, err
    assert link.is_symlink() and json.loads(real.read_text())["rows"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_report_out_write_failure_leaves_nothing_half_written(capsys, monkeypatch, tmp_path, code):
    """A disk that fails while report.json is written: report.md of an earlier run stays as it
    was, no report.json appears, no staging directory is left behind."""
    import pagedkv.report as report_pkg

    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("earlier run")
    real_dumps = json.dumps

    def failing_dumps(*a, **kw):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(report_pkg.json, "dumps", failing_dumps)
    rc, stdout, err = run(["report", "--quick", "--sections", "cow_case", "--out", str(out)], capsys)
    monkeypatch.setattr(report_pkg.json, "dumps", real_dumps)
    lines = [x for x in err.splitlines() if not x.startswith("[pagedkv report]")]
    assert rc == 1 and "Traceback" not in err
    assert lines == [f"pagedkv report: error: --out {out}: cannot write ({os.strerror(code)}); nothing was written"]
    assert sorted(p.name for p in out.iterdir()) == ["report.md"]
    assert (out / "report.md").read_text() == "earlier run"
    assert "Why the first write" in stdout  # the report itself was printed


def test_report_out_writes_every_file_and_no_staging_left(capsys, tmp_path):
    out = tmp_path / "out"
    rc, stdout, err = run(["report", "--quick", "--sections", "cow_case", "--out", str(out)], capsys)
    assert rc == 0, err
    names = sorted(p.name for p in out.iterdir())
    assert {"report.md", "report.json"} <= set(names) and not [n for n in names if n.startswith(".")]
    assert json.loads((out / "report.json").read_text())["sections"]
    assert f"The whole report: {out / 'report.md'} (Markdown)" in " ".join(stdout.split())


# ---- accepted silently before ----------------------------------------------------------------------


def test_mooncake_line_with_fewer_hash_ids_than_blocks_is_refused(capsys, tmp_path):
    """1100 tokens are ceil(1100/512) = 3 blocks; a line with 2 ids left 76 tokens unkeyed."""
    path = tmp_path / "mc.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}\n'
                    '{"timestamp": 1, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1]}\n')
    for argv in (["simulate", str(path), "--allocator", "paged"], ["fleet", str(path), "--router", "round-robin"]):
        rc, out, err = run(argv, capsys)
        one_error_line(err, rc, 2)
        assert f"{path}:2: 2 hash_ids for 1100 tokens" in err and "ceil(1100/512) = 3" in err and out == ""


@pytest.mark.parametrize("rate", ["1e-300", "0.001", "5e-324"])
def test_simulate_rate_too_small_to_measure_is_refused_with_its_range(capsys, rate):
    rc, out, err = run(["simulate", "--rate", rate], capsys)
    one_error_line(err, rc, 2)
    assert "--rate must be 0 (every arrival at t = 0) or at least 0.01 requests/s" in err and out == ""


def test_simulate_rate_at_the_floor_runs(capsys):
    rc, out, err = run(["simulate", "--rate", "0.01", "--num-requests", "2", "--allocator", "paged"], capsys)
    assert rc == 0, err
    assert "Poisson arrivals at 0.01 requests/s" in " ".join(out.split())


def test_fleet_num_requests_past_the_trace_says_so(capsys, tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 40, "output_length": 2, "hash_ids": [i]})
                            + "\n" for i in range(3)))
    rc, out, err = run(["fleet", str(path), "--router", "round-robin", "--replicas", "1",
                        "--num-requests", str(10**12)], capsys)
    assert rc == 0 and "3 requests" in out
    assert err == (f"pagedkv fleet: --num-requests {10**12:,}: the trace has only 3 requests; "
                   "routing all of them\n")


def test_simulate_num_requests_past_a_trace_says_so(capsys, tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [0]}\n')
    rc, out, err = run(["simulate", str(path), "--allocator", "paged", "--num-requests", "7"], capsys)
    assert rc == 0
    assert err == "pagedkv simulate: --num-requests 7: mc.jsonl has only 1 request; serving all of them\n"


@pytest.mark.parametrize("argv", [["--version", "extra"], ["--version", "report"], ["--version", "--version"]])
def test_version_with_anything_after_it_is_an_error(capsys, argv):
    rc, out, err = run(argv, capsys)
    one_error_line(err, rc, 2)
    assert f"--version takes no arguments, got {' '.join(argv[1:])!r}" in err and out == ""


def test_fleet_router_sees_the_clipped_prompt(capsys, tmp_path, monkeypatch):
    """A 5-million-token prompt: the replicas clip it to --max-len and the precise router hashes
    what they serve; before, it materialised every token of the unclipped prompt (at 2 billion
    tokens, 16 GB: a MemoryError or the OOM killer)."""
    from pagedkv.sim import routers

    seen = []
    real = routers.prompt_array

    def spy(request, limit=None):
        out = real(request, limit)
        seen.append(len(out))
        return out

    monkeypatch.setattr(routers, "prompt_array", spy)
    path = tmp_path / "big.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,5000000,4\n")
    rc, out, err = run(["fleet", str(path), "--router", "precise", "--replicas", "1", "--num-requests", "1",
                        "--max-len", "64"], capsys)
    assert rc == 0, err
    assert "1 requests on 1 replicas" in out
    assert seen and max(seen) <= 64


# ---- size --config -------------------------------------------------------------------------------


def test_size_config_binary_file_is_named(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    rc, out, err = run(["size", "--config", str(path)], capsys)
    one_error_line(err, rc, 2)
    assert f"{path}: not a JSON text file" in err


def test_size_config_directory_says_directory(capsys, tmp_path):
    rc, out, err = run(["size", "--config", str(tmp_path)], capsys)
    one_error_line(err, rc, 2)
    assert f"--config {tmp_path} is a directory" in err


# ---- a stranger's bad invocations ----------------------------------------------------------------


@pytest.fixture
def files(tmp_path) -> Path:
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "adir").mkdir()
    (tmp_path / "bin.jsonl").write_bytes(bytes(range(128, 256)) * 2)
    (tmp_path / "nan_ts.jsonl").write_text('{"timestamp": NaN, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n')
    (tmp_path / "inf_out.jsonl").write_text('{"timestamp": 0, "input_length": 5, "output_length": 1e400, "hash_ids": [0]}\n')
    (tmp_path / "huge.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                       "2023-11-16 18:15:46.68,99999999999999999999,4\n")
    (tmp_path / "huge2.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,99999999999,4\n")
    (tmp_path / "nan.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,nan,4\n")
    (tmp_path / "nan.json").write_text('{"num_hidden_layers": NaN, "num_attention_heads": 8, "hidden_size": 64}')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "corrupt.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    return tmp_path


STRANGER = [
    # (argv, needle); "{d}" is the fixture's directory
    (["simulate", "--rate", "nan"], "--rate must be a finite number"),
    (["simulate", "--rate", "inf"], "--rate must be a finite number"),
    (["simulate", "--rate", "-1"], "--rate must be a finite number >= 0"),
    (["simulate", "--num-requests", "0"], "--num-requests must be between 1"),
    (["simulate", "--num-requests", "10000000000000"], "--num-requests must be between 1"),
    (["simulate", "--num-requests", "nan"], "invalid int value"),
    (["simulate", "--n", "0"], "--n must be between 1"),
    (["simulate", "--n", "2", "--beam-width", "2"], "use --n or --beam-width, not both"),
    (["simulate", "--gpu-mem-gib", "nan"], "--gpu-mem-gib must be a finite number"),
    (["simulate", "--util", "inf"], "--util must be a finite number"),
    (["simulate", "--overhead-ms", "-1"], "--overhead-ms must be a finite number >= 0"),
    (["simulate", "--kv-gib", "0"], "--kv-gib must be a finite number > 0"),
    (["simulate", "--max-len", "1"], "--max-len must be between 2"),
    (["simulate", "{d}/empty.jsonl"], "no requests in the trace"),
    (["simulate", "{d}/adir"], "is neither a workload"),
    (["simulate", "{d}/missing.jsonl"], "is neither a workload"),
    (["simulate", "{d}/bin.jsonl"], "not a readable text trace"),
    (["simulate", "{d}/corrupt.jsonl.gz"], "corrupt.jsonl.gz"),
    (["simulate", "{d}/nan_ts.jsonl"], "nan_ts.jsonl:1: timestamp"),
    (["simulate", "{d}/inf_out.jsonl"], "inf_out.jsonl:1: output_length"),
    (["simulate", "{d}/nan.csv"], "nan.csv:2: ContextTokens must be an integer"),
    (["simulate", "{d}/huge.csv"], "huge.csv:2: ContextTokens must be at most 2,147,483,647 tokens"),
    (["simulate", "--data-dir", "{d}/afile"], "--data-dir {d}/afile is not a directory"),
    (["fleet", "--replicas", "0"], "--replicas must be between 1"),
    (["fleet", "--replicas", "100000"], "--replicas must be between 1"),
    (["fleet", "--num-requests", "-5"], "--num-requests must be >= 1"),
    (["fleet", "--num-requests", "1e3"], "expected a number of requests or 'all'"),
    (["fleet", "--eps", "nan"], "--eps must be a finite number"),
    (["fleet", "--cache-threshold", "1"], "--cache-threshold must be a finite number"),
    (["fleet", "--balance-rel", "inf"], "--balance-rel must be a finite number"),
    (["fleet", "--vnodes", "10000000000"], "--vnodes must be between 1"),
    (["fleet", "--key-tokens", "0"], "--key-tokens must be >= 1"),
    (["fleet", "{d}/adir"], "is neither a shipped trace"),
    (["fleet", "{d}/empty.jsonl"], "no requests in the trace"),
    (["fleet", "{d}/bin.jsonl"], "not a readable text trace"),
    (["fleet", "{d}/huge.csv"], "huge.csv:2: ContextTokens must be at most"),
    (["fleet", "{d}/huge2.csv", "--max-len", "64"], "huge2.csv:2: ContextTokens must be at most"),
    (["fleet", "--json", "{d}/adir"], "--json {d}/adir is a directory, not a file"),
    (["fleet", "--json", "{d}/nodir/x.json"], "the directory {d}/nodir does not exist"),
    (["report", "--block-size", "0"], "--block-size must be between 1"),
    (["report", "--block-size", "nan"], "invalid int value"),
    (["report", "--seed", "-1"], "--seed must be >= 0"),
    (["report", "--trace", "{d}/adir"], "--trace {d}/adir: no such file"),
    (["report", "--trace", "{d}/empty.jsonl"], "no requests in the trace"),
    (["report", "--trace", "{d}/bin.jsonl"], "not a readable text trace"),
    (["report", "--out", "{d}/afile"], "exists and is not a directory"),
    (["report", "--data-dir", "{d}/afile"], "is not a directory"),
    (["size", "Llama-3.1-8B", "--tp", "0"], "--tp must be between 1"),
    (["size", "Llama-3.1-8B", "--gpu-mem-gib", "nan"], "--gpu-mem-gib must be a finite number"),
    (["size", "Llama-3.1-8B", "--gpu-mem-gib", "1"], "no memory left for KV"),
    (["size", "Llama-3.1-8B", "--kv-gib", "1e-30"], "not one block"),
    (["size", "Llama-3.1-8B", "--weights-gib", "-1"], "--weights-gib must be a finite number >= 0"),
    (["size", "Llama-3.1-8B", "--dtype", "nope"], "unknown dtype"),
    (["size", "--config", "{d}/nan.json"], "num_hidden_layers must be a positive integer"),
    (["size", "--config", "{d}/list.json"], "expected a JSON object"),
    (["size", "--config", "{d}/empty.jsonl"], "not valid JSON"),
    (["size", "--config", "{d}/missing.json"], "no such file"),
    (["bench", "--json", "{d}/adir"], "--json {d}/adir is a directory, not a file"),
    (["bench", "--json", "{d}/nodir/x.json"], "the directory {d}/nodir does not exist"),
    (["bench", "--json"], "expected one argument"),
]


@pytest.mark.parametrize("argv,needle", STRANGER, ids=[" ".join(a) for a, _ in STRANGER])
def test_a_strangers_bad_invocation_is_one_line_and_status_2(capsys, files, argv, needle):
    argv = [a.format(d=files) for a in argv]
    rc, out, err = run(argv, capsys)
    one_error_line(err, rc, 2)
    assert needle.format(d=files) in err, err
    assert out == ""
