"""The command line ends bad input with one line on stderr and exit status 2, before any work.

Every case runs ``pagedkv.cli.main`` in-process and checks the exit status, that stderr is exactly
one line naming the flag the user typed, that no traceback was printed, and (where work could
have started) that nothing was computed: no report on stdout, no progress line on stderr.
Ctrl-C and the ``python -m pagedkv`` entry point run in a subprocess.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv import __version__
from pagedkv.cli import main

SRC = Path(__file__).resolve().parents[1] / "src"


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors and --version exit through SystemExit
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def fails(argv: list[str], capsys, *needles: str) -> str:
    """Run ``argv``; assert exit 2, one stderr line containing every needle, nothing on stdout."""
    rc, out, err = run(argv, capsys)
    assert rc == 2, (argv, rc, err)
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err and out == "", (out, err)
    for needle in needles:
        assert needle in err, (needle, err)
    return err


@pytest.fixture
def afile(tmp_path) -> Path:
    p = tmp_path / "afile"
    p.write_text("not a directory")
    return p


# ---- the commands of issue 7, item 4 ---------------------------------------------------------------


def test_report_out_that_cannot_be_created_fails_before_any_section(capsys, afile):
    # Like /proc/nope: the parent cannot hold a directory. No section may run first.
    err = fails(["report", "--quick", "--sections", "fork_cost", "--out", str(afile / "sub")], capsys,
                "pagedkv report: error: --out", "cannot create the directory")
    assert "fork_cost" not in err


def test_report_out_that_is_a_file(capsys, afile):
    fails(["report", "--out", str(afile)], capsys, "--out", "exists and is not a directory")
    assert afile.read_text() == "not a directory"


def test_bench_json_in_a_missing_directory_fails_before_timing(capsys, tmp_path):
    fails(["bench", "--quick", "--json", str(tmp_path / "nonexistent" / "x.json")], capsys,
          "pagedkv bench: error: --json", "does not exist")
    fails(["bench", "--quick", "--json", str(tmp_path)], capsys, "is a directory")


@pytest.mark.parametrize("size,needle", [("1e30", "<= 1,048,576 (1 PiB)"), ("1e6", "the simulator holds at most 16,777,216"),
                                         ("inf", "finite"), ("0", "> 0"), ("1e-9", "no room for one block")])
def test_simulate_refuses_kv_sizes_it_cannot_simulate(capsys, size, needle):
    err = fails(["simulate", "sharegpt", "--kv-gib", size], capsys, "pagedkv simulate: error: --kv-gib", needle)
    assert "kv_budget_gib" not in err


def test_simulate_refuses_gpu_memory_it_cannot_simulate(capsys):
    fails(["simulate", "sharegpt", "--gpu-mem-gib", "1e6"], capsys, "--gpu-mem-gib", "holds at most")
    fails(["simulate", "sharegpt", "--gpu-mem-gib", "10"], capsys, "leaves nothing for KV")


def test_size_refuses_absurd_gpu_memory(capsys):
    fails(["size", "Llama-3.1-8B", "--gpu-mem-gib", "1e300"], capsys, "pagedkv size: error: --gpu-mem-gib",
          "1,048,576")


@pytest.mark.parametrize("field,value", [("num_attention_heads", 0), ("num_hidden_layers", -1),
                                         ("hidden_size", "big"), ("num_key_value_heads", 2.5)])
def test_size_config_with_a_bad_field(capsys, tmp_path, field, value):
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    cfg[field] = value
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    fails(["size", "--config", str(path)], capsys, f"config field {field} must be a positive integer")


def test_size_config_missing_file(capsys, tmp_path):
    fails(["size", "--config", str(tmp_path / "c.json")], capsys, "--config", "no such file")


@pytest.mark.parametrize("flag", ["--tflops", "--bandwidth-tbs", "--util", "--gpu-mem-gib"])
def test_simulate_negative_hardware(capsys, flag):
    fails(["simulate", "sharegpt", flag, "-1"], capsys, f"pagedkv simulate: error: {flag} must be")


def test_overhead_may_be_zero_but_not_negative(capsys):
    fails(["simulate", "sharegpt", "--overhead-ms", "-1"], capsys, "--overhead-ms must be a finite number >= 0")


@pytest.mark.parametrize("command", ["report", "simulate"])
def test_data_dir_that_does_not_exist(capsys, tmp_path, command):
    argv = [command] + (["sharegpt"] if command == "simulate" else [])
    fails(argv + ["--data-dir", str(tmp_path / "nonexistent")], capsys, "--data-dir", "is not a directory")


def test_pagedkv_data_that_does_not_exist(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_DATA", str(tmp_path / "nowhere"))
    fails(["report", "--quick"], capsys, "PAGEDKV_DATA=", "is not a directory")


def test_tp_that_does_not_divide_the_kv_heads(capsys):
    fails(["size", "Llama-3.1-8B", "--tp", "3"], capsys, "--tp 3 does not divide Llama-3.1-8B's 8 KV heads",
          "use 1, 2, 4, 8 or a multiple of 8")
    for tp in ("2", "8", "16"):  # divisors and multiples are fine
        rc, out, _ = run(["size", "Llama-3.1-8B", "--tp", tp], capsys)
        assert rc == 0 and f"tp={tp}" in out
    rc, out, _ = run(["size", "--list", "--tp", "3"], capsys)  # the list states the rounding
    assert rc == 0 and "tp=3 does not divide the KV heads of" in out and "ceil(kv_heads / 3)" in out


def test_ctrl_c_is_a_short_message_and_exit_130():
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    # A background job of a shell without job control inherits SIGINT ignored, and Python then
    # keeps ignoring it: give the child the default disposition, as a terminal would.
    proc = subprocess.Popen([sys.executable, "-m", "pagedkv", "report"], env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stderr.readline().startswith("[pagedkv report]")  # the work has started
        proc.send_signal(signal.SIGINT)
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    assert err.endswith("pagedkv: interrupted\n") and "Traceback" not in err


# ---- --sections, --version, argparse ---------------------------------------------------------------


@pytest.mark.parametrize("sections,needle", [("", "--sections is empty"), (" , ", "--sections is empty"),
                                             ("fork_cost,,cow_case", "empty name"),
                                             ("fork_cost,cow_case,fork_cost", "names fork_cost more than once"),
                                             ("fork_cost,nope", "unknown nope")])
def test_sections_empty_repeated_or_unknown(capsys, sections, needle):
    fails(["report", "--quick", "--sections", sections], capsys, "pagedkv report: error: --sections", needle)


def test_sections_run_in_the_order_given(capsys):
    rc, out, _ = run(["report", "--quick", "--sections", "cow_case,fork_cost"], capsys)
    assert rc == 0
    fork, cow = out.index("What forking costs\n=="), out.index("Why the first write")  # headings, not findings
    assert 0 < fork and out.index("Why the first write after a fork must copy\n==") < fork and cow < fork


def test_version(capsys):
    rc, out, err = run(["--version"], capsys)
    assert rc == 0 and out == f"pagedkv {__version__}\n" and err == ""


@pytest.mark.parametrize("argv,needle", [
    (["report", "--block-size", "x"], "argument --block-size: invalid int value: 'x'"),
    (["report", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["nope"], "invalid choice: 'nope'"),
    ([], "the following arguments are required: COMMAND"),
])
def test_argparse_errors_are_one_line_too(capsys, argv, needle):
    fails(argv, capsys, needle, "--help")


@pytest.mark.parametrize("argv,flag", [
    (["report", "--block-size", "0"], "--block-size"),
    (["report", "--block-size", "4096"], "--block-size"),
    (["report", "--seed", "-1"], "--seed"),
    (["report", "--model", "GPT-9"], "--model 'GPT-9' is not a built-in model"),
    (["simulate", "sharegpt", "--model", "GPT-9"], "--model 'GPT-9' is not a built-in model"),
    (["simulate", "sharegpt", "--model", "DeepSeek-V3"], "--model DeepSeek-V3: cannot estimate"),
    (["simulate", "sharegpt", "--num-requests", "0"], "--num-requests"),
    (["simulate", "sharegpt", "--num-requests", "10000000"], "--num-requests"),
    (["simulate", "sharegpt", "--block-size", "0"], "--block-size"),
    (["simulate", "sharegpt", "--max-len", "1"], "--max-len"),
    (["simulate", "sharegpt", "--rate", "nan"], "--rate"),
    (["simulate", "sharegpt", "--n", "2", "--beam-width", "2"], "--n or --beam-width"),
    (["simulate", "sharegpt", "--util", "1.5"], "--util"),
    (["simulate", "nothing"], "neither a workload"),
    (["size", "Llama-3.1-8B", "--block-size", "0"], "--block-size"),
    (["size", "Llama-3.1-8B", "--kv-gib", "-2"], "--kv-gib"),
    (["size", "Llama-3.1-8B", "--kv-gib", "2", "--gpu-mem-gib", "80"], "--kv-gib or --gpu-mem-gib"),
    (["size", "Llama-3.1-8B", "--weights-gib", "-1", "--gpu-mem-gib", "80"], "--weights-gib"),
    (["size", "Llama-3.1-8B", "--dtype", "fp7"], "unknown dtype"),
    (["size"], "give a model name"),
])
def test_messages_name_the_flag_the_user_typed(capsys, argv, flag):
    err = fails(argv, capsys, flag)
    assert "_" not in err.split("error:")[1].split()[0] or flag.startswith("unknown"), err


# ---- traces given on the command line ------------------------------------------------------------


@pytest.mark.parametrize("name,content,needle", [
    ("empty.jsonl", "", "empty.jsonl: no requests in the trace"),
    ("header.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", "header.csv: no requests in the trace"),
    ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,x,4\n",
     "bad.csv:2: ContextTokens must be an integer"),
    ("bad.jsonl", '{"timestamp": 0}\n', "bad.jsonl:1: missing field"),
])
def test_malformed_or_empty_trace_is_one_line_naming_the_file(capsys, tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_text(content)
    fails(["simulate", str(path)], capsys, "pagedkv simulate: error:", needle)
    err = fails(["report", "--quick", "--trace", str(path)], capsys, "pagedkv report: error:", needle)
    assert "fork_cost" not in err  # checked before the first section


def test_missing_trace_file(capsys, tmp_path):
    fails(["report", "--trace", str(tmp_path / "t.jsonl")], capsys, "--trace", "no such file")


def test_a_trace_of_the_wrong_kind_is_named_in_its_section(tmp_path, monkeypatch):
    """prefix_hits needs content hashes: given an Azure trace it says so and replays the shipped
    Mooncake trace (the replay itself is tested in test_prefix_hits.py)."""
    from pagedkv.report.options import ReportOptions
    from pagedkv.report.prefix_hits import _mooncake_file

    monkeypatch.delenv("PAGEDKV_DATA", raising=False)
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n")
    used, why = _mooncake_file(ReportOptions(trace=path))
    assert used.name == "mooncake_conversation_trace.jsonl.gz"
    assert why.startswith("The trace given (azure.csv) is an Azure trace")
    assert why.endswith("replays mooncake_conversation_trace.jsonl.gz instead.")
    mooncake = tmp_path / "mc.jsonl"
    mooncake.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n')
    assert _mooncake_file(ReportOptions(trace=mooncake)) == (mooncake, None)


def test_simulate_replays_a_shipped_trace(capsys):
    argv = ["simulate", "mooncake-trace", "--num-requests", "20", "--allocator", "paged", "--kv-gib", "40",
            "--rate", "0", "--model", "Llama-3.1-8B"]  # 40 GiB hold 327,680 of its tokens
    # The default context limit is the model's own (131,072 tokens): every request is served.
    rc, out, _ = run(argv, capsys)
    assert rc == 0 and "mooncake-trace (real trace: mooncake_conversation_trace.jsonl.gz): 20 requests" in out
    # Under a 2,048-token context most Mooncake prompts do not fit: counted, never cut.
    rc, out, _ = run(argv + ["--max-len", "2048"], capsys)
    text = " ".join(out.split())
    assert rc == 0 and "): 2 requests served, 18 left out" in text
    assert "Left out: 18 of 20 requests, whose prompt is 2,048 tokens or longer" in text


def test_simulate_gzipped_trace_file(capsys, tmp_path):
    import gzip

    path = tmp_path / "t.csv.gz"
    path.write_bytes(gzip.compress(b"TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                   b"2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:47.0,100,5\n"))
    rc, out, _ = run(["simulate", str(path), "--allocator", "max", "--kv-gib", "4"], capsys)
    # The intro names the file and wraps at 100 columns, so where it breaks depends on the path.
    assert rc == 0 and "2 requests" in " ".join(out.split())


def test_module_entry_point_prints_no_traceback(tmp_path):
    """``python -m pagedkv`` goes through the same guard (a file where --out wants a directory)."""
    (tmp_path / "f").write_text("")
    proc = subprocess.run([sys.executable, "-m", "pagedkv", "report", "--out", str(tmp_path / "f")],
                          env={**os.environ, "PYTHONPATH": str(SRC)}, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "exists and is not a directory" in proc.stderr


@pytest.mark.parametrize("command", [[], ["report"], ["simulate"], ["size"], ["bench"]])
def test_help_sends_people_only_where_they_can_go(capsys, command):
    import re

    rc, out, _ = run(command + ["--help"], capsys)
    assert rc == 0 and out
    assert "DESIGN.md" not in out and "../shared" not in out
    assert re.search(r":[a-z]+:`|``", out) is None  # no reStructuredText roles or literals
    if not command:
        assert "docs/design.md" in out


def test_a_malformed_trace_in_the_data_dir_stops_the_report_first(capsys, tmp_path):
    (tmp_path / "mooncake_conversation_trace.jsonl").write_text('{"timestamp": 0, "input_length": 5}\n')
    err = fails(["report", "--quick", "--data-dir", str(tmp_path)], capsys,
                "mooncake_conversation_trace.jsonl:1: missing field")
    assert "fork_cost" not in err


def test_report_trace_with_no_section_that_reads_it_is_an_error(capsys, tmp_path):
    """A --trace that no chosen section would read is refused, not silently ignored."""
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n")
    rc, out, err = run(["report", "--quick", "--sections", "fork_cost", "--trace", str(path)], capsys)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "--trace" in err and "fig2" in err
