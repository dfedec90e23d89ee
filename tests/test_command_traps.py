"""What the commands the README suggests tell their user: nothing is left out or dropped without a
word, prefix hits say where they come from, the help states the numbers a run prints, a long
run shows progress, the benchmark ends in a verdict, and no internal name reaches the output.

Each test runs the command in-process through ``pagedkv.cli.main`` on a few requests (a few
seconds at most) and reads what it printed; the expectations are computed from the same trace
or the same simulator, never typed in.
"""
from __future__ import annotations

import io
import re
import sys
from dataclasses import replace

import pytest

from pagedkv.cli import main
from pagedkv.sim.traces import load_trace, trace_path


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def flat(text: str) -> str:
    """The output with its line wrapping undone (notes wrap at 100 columns)."""
    return " ".join(text.split())


def notes(out: str) -> list[str]:
    """The table's notes, in order, each on one line (a note starts with two spaces, its
    continuation lines with four)."""
    return [flat(n) for n in re.split(r"\n  (?=\S)", out)[1:]]


def mooncake(n: int) -> list:
    return load_trace(trace_path("mooncake", None), limit=n)


# ---- the context limit: the model's own, and whatever it leaves out is said ---------------------


def test_simulate_defaults_the_context_limit_to_the_models_context(capsys):
    """gpt-oss-20b serves up to 131,072 tokens: no Mooncake request is left out by a default
    2,048-token limit (it used to leave out most of them and print every ratio as 1.00x)."""
    rc, out, _ = run(["simulate", "mooncake-trace", "--model", "gpt-oss-20b", "--weights-gib", "13",
                      "--num-requests", "20", "--allocator", "paged"], capsys)
    text = flat(out)
    assert rc == 0
    assert ": 20 requests on " in text
    assert "context limit 131,072 tokens: gpt-oss-20b's context (--max-len sets it)" in text
    assert "Left out" not in text


def test_simulate_says_first_how_many_requests_the_limit_left_out(capsys):
    raw = mooncake(20)
    left = sum(r.prompt_len >= 2048 for r in raw)
    assert 0 < left < 20
    rc, out, _ = run(["simulate", "mooncake-trace", "--num-requests", "20", "--allocator", "paged",
                      "--max-len", "2048", "--kv-gib", "12"], capsys)
    text = flat(out)
    assert rc == 0
    assert f": {20 - left} requests served, {left} left out (see the first note) on " in text
    first_note = notes(out)[0]
    assert flat(first_note) == (f"Left out: {left} of 20 requests, whose prompt is 2,048 tokens or longer: the "
                                "context limit (--max-len); a larger --max-len serves them.")


def test_simulate_limits_the_default_context_to_what_the_kv_cache_holds(capsys):
    """Llama-3.1-8B's 131,072 tokens do not fit 1 GiB of its KV (512 blocks of 16, 8,192 slots):
    the limit is what the cache holds, and the note says so."""
    rc, out, _ = run(["simulate", "sharegpt", "--model", "Llama-3.1-8B", "--kv-gib", "1", "--num-requests", "5",
                      "--allocator", "paged"], capsys)
    assert rc == 0
    assert ("context limit 8,192 tokens: what the KV cache holds (Llama-3.1-8B's context is 131,072) "
            "(--max-len sets it)") in flat(out)


def test_simulate_says_first_what_an_allocator_dropped(capsys):
    """Max reserves the 1,300-token limit, more than 1 GiB of OPT-13B KV holds (1,296 slots):
    it drops every request, and the first note says so before any ratio."""
    rc, out, _ = run(["simulate", "alpaca", "--kv-gib", "1", "--max-len", "1300", "--num-requests", "20",
                      "--allocator", "max"], capsys)
    assert rc == 0 and "20 requests on 1,296 KV slots" in flat(out)
    assert notes(out)[0] == ("Dropped: Max dropped 20 of 20 requests, which could never fit its KV memory even "
                             "alone; its ratios count only the requests it served.")


def test_a_models_context_comes_from_its_config():
    from pagedkv.sim.sizing import get_model, spec_from_config

    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    assert spec_from_config(cfg).max_context is None
    assert spec_from_config({**cfg, "max_position_embeddings": 4096}).max_context == 4096
    with pytest.raises(ValueError, match="max_position_embeddings"):
        spec_from_config({**cfg, "max_position_embeddings": 0})
    assert get_model("OPT-13B").max_context == 2048  # the vLLM paper's context, simulate's default


def test_fleet_says_how_many_requests_the_context_limit_cut(capsys):
    raw = mooncake(30)
    cut = sum(r.total_len > 4096 for r in raw)
    assert 0 < cut < 30
    rc, out, _ = run(["fleet", "--num-requests", "30", "--router", "round-robin", "--replicas", "2",
                      "--max-len", "4096"], capsys)
    assert rc == 0
    assert (f"{cut} of 30 requests were longer than the context limit of 4,096 tokens (--max-len) and were "
            "cut to fit it") in flat(out)
    rc, out, _ = run(["fleet", "--num-requests", "30", "--router", "round-robin", "--replicas", "2"], capsys)
    assert rc == 0 and "context limit 131,072 tokens: Llama-3.1-8B's context (--max-len sets it)" in flat(out)
    assert "were cut" not in out


# ---- prefix hits: other requests' blocks apart from a preempted request's own --------------------


def test_simulate_names_recompute_hits_apart_from_shared_ones(capsys):
    """Synthetic ShareGPT prompts share nothing: every hit is a preempted request finding its own
    blocks at readmission. The two counts add up to the cache's own hit rate."""
    from pagedkv.sim.baselines import make_allocator
    from pagedkv.sim.metrics import compute
    from pagedkv.sim.scheduler import simulate
    from pagedkv.sim.workloads import load_workload

    rc, out, _ = run(["simulate", "sharegpt", "--num-requests", "100", "--allocator", "paged"], capsys)
    assert rc == 0
    reqs = [replace(r, arrival=0.0) for r in load_workload("sharegpt", 100, 0, max_len=2048)]
    m = compute(simulate(reqs, make_allocator("paged", 989, 16, 2048), max_len=2048))
    assert m.preemptions > 0 and m.shared_hit_rate == 0.0
    assert m.readmit_hit_rate == pytest.approx(m.prefix_hit_rate) and m.prefix_hit_rate > 0
    assert (f"paged 0.0% from other requests, {100 * m.readmit_hit_rate:.1f}% recomputed after preemption"
            in flat(out))
    assert "prefix hit %" not in out


def test_shared_and_recompute_hits_add_up_to_the_caches_count():
    """On Mooncake, whose prompts share content, hits come from other requests too."""
    from pagedkv.sim.baselines import make_allocator
    from pagedkv.sim.metrics import compute
    from pagedkv.sim.scheduler import simulate

    reqs = [replace(r, arrival=0.0) for r in mooncake(40)]
    res = simulate(reqs, make_allocator("paged", 3000, 16, 8192), max_len=8192)
    m = compute(res)
    assert m.shared_hit_rate > 0
    assert res.looked_up_tokens == res.usage.prefix_query_tokens
    assert res.first_hit_tokens + res.readmit_hit_tokens == res.usage.prefix_hit_tokens


# ---- the help states what a run prints ------------------------------------------------------------


def test_simulate_help_gives_the_token_slots_a_run_uses(capsys):
    rc, help_text, _ = run(["simulate", "--help"], capsys)
    assert rc == 0
    slots = re.search(r"([\d,]+) token slots", flat(help_text)).group(1)
    rc, out, _ = run(["simulate", "--num-requests", "5", "--allocator", "paged"], capsys)
    assert rc == 0 and f"on {slots} KV slots (OPT-13B)" in flat(out)


# ---- progress on stderr: when asked, or on a terminal once the run is long ------------------------

FLEET = ["fleet", "--num-requests", "20", "--router", "round-robin", "--replicas", "2"]


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_fleet_draws_progress_when_asked(capsys):
    rc, out, err = run(FLEET + ["--progress"], capsys)
    assert rc == 0 and "round-robin" in out
    assert err.startswith("\rfleet [") and err.endswith("\n")
    assert "100% 20/20 every router done" in err.split("\r")[-1]


def test_fleet_draws_progress_unasked_only_on_a_terminal_after_five_seconds(capsys, monkeypatch):
    from pagedkv import commands

    rc, _, err = run(FLEET, capsys)  # stderr redirected (captured): no bar
    assert rc == 0 and err == ""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert run(FLEET, capsys)[0] == 0
    assert terminal.getvalue() == ""  # a sub-second run on a terminal: nothing
    monkeypatch.setattr(commands, "AUTO_PROGRESS_DELAY_S", 0.0)  # as if it had run 5 s
    assert run(FLEET, capsys)[0] == 0
    assert "100% 20/20 every router done" in terminal.getvalue()


# ---- bench: bookkeeping measured once blocks are used, and a verdict --------------------------------


def test_bench_measures_bookkeeping_of_used_blocks():
    """An empty manager keeps ~0 bytes per block (it sets none up before first use); the row
    measures blocks handed out and freed once: at least the 8-byte refcount slot each keeps."""
    from pagedkv.bench.core import _bench_build

    build, book = _bench_build(quick=True)
    assert build["name"] == "build manager, 1,000,000 blocks"
    assert "construction sets up no block" in build["note"]
    assert book["name"] == "bookkeeping per block, 200,000 blocks used once"
    assert book["unit"] == "B/block" and book["target"] == 32.0
    assert book["median"] >= 8


def test_bench_ends_with_a_verdict(capsys, monkeypatch):
    from pagedkv.commands import bench

    rows = [{"name": "fork", "median": 6.5, "unit": "µs", "target": 20.0, "note": ""},
            {"name": "append_batch, 256 seqs", "median": 125.0, "unit": "µs", "target": 50.0, "note": ""},
            {"name": "calibration", "median": 0.5, "unit": "µs", "target": None, "note": ""}]
    monkeypatch.setattr(bench, "gather", lambda quick: rows)
    rc, out, _ = run(["bench", "--quick"], capsys)
    assert rc == 0
    assert out.splitlines()[-2:] == ["Verdict: 1 of 2 rows with a target meet it; 1 does not:",
                                     "  append_batch, 256 seqs: 2.50x its target"]
    rows[1]["median"] = 40.0
    rc, out, _ = run(["bench", "--quick"], capsys)
    assert out.splitlines()[-1] == "Verdict: 2 of 2 rows with a target meet it."


# ---- no internal name reaches the user ------------------------------------------------------------

# Code names, module paths, issue numbers and code-style arguments: none may appear in what a
# command prints. Snake-case words of three parts or more are code names unless listed below:
# config.json keys a --config user types, vLLM's own flags, the report's --sections values and
# public API names of the library.
DENY = re.compile(
    r"\bissue \d|below_threshold|paged x this|\bpagedkv\.[a-z_]+\.[a-z_]|\bopts\.[a-z]"
    r"|\b[a-z_]+=(?:False|True|None)\b|\b(?:SlidingWindow|FullAttention|ChunkedLocalAttention)\("
    r"|\b[a-z0-9]+(?:_[a-z0-9]+){2,}\b")
ALLOWED = {"kv_lora_rank", "qk_rope_head_dim", "max_position_embeddings", "kv_offloading_backend",
           "kv_offloading_size", "swap_vs_recompute", "host_write_policy", "blocks_saved_by_sharing"}


def internal_names(text: str) -> list[str]:
    """The denied words in ``text``; file names (``wrote DIR/chunked_prefix_hits.png``) are not
    words."""
    text = re.sub(r"\S+\.(?:png|md|json)\b", "", text)
    return sorted({m.group(0) for m in DENY.finditer(text)} - ALLOWED)


def test_the_deny_list_catches_what_it_is_for():
    assert internal_names("issue 19 target <= 2; affinity 1, below_threshold 39; paged x this") == [
        "below_threshold", "issue 1", "paged x this"]
    assert internal_names("from pagedkv.sim.sizing, opts.model, fit_check=False, copies_per_block") == [
        "copies_per_block", "fit_check=False", "opts.m", "pagedkv.sim.s"]
    assert internal_names("hybrid (SlidingWindow(window=128), FullAttention())") == [
        "FullAttention(", "SlidingWindow("]
    assert internal_names("append_batch, 256 seqs; kv_lora_rank; pip install pagedkv[events]; "
                          "vLLM issue #49674; --max-len; token states %") == []


@pytest.mark.parametrize("argv", [
    ["simulate", "--num-requests", "20"],
    ["simulate", "sharegpt", "--model", "gpt-oss-20b", "--weights-gib", "13", "--num-requests", "20"],
    ["fleet", "--num-requests", "30", "--replicas", "2"],
    ["size", "Llama-3.1-8B"],
    ["size", "gpt-oss-20b"],
    ["size", "DeepSeek-V3"],
    ["size", "--list"],
    *[[cmd, "--help"] for cmd in ("simulate", "fleet", "size", "bench", "report")],
])
def test_no_internal_name_in_a_commands_output(argv, capsys):
    rc, out, err = run(argv, capsys)
    assert rc == 0, err
    assert internal_names(out + err) == []


def test_no_internal_name_in_the_report(capsys, tmp_path):
    """The report's fast sections (about a second), printed and written as report.md."""
    rc, out, err = run(["report", "--quick", "--sections", "fork_cost,cow_case,cow_proof,chunked_spec,"
                        "swap_vs_recompute", "--out", str(tmp_path)], capsys)
    assert rc == 0, err
    assert internal_names((out + err).replace(str(tmp_path), "DIR")) == []
    assert internal_names((tmp_path / "report.md").read_text()) == []


def test_no_internal_name_in_the_benchmark(capsys):
    """``bench --quick`` (about ten seconds on two cores)."""
    rc, out, err = run(["bench", "--quick"], capsys)
    assert rc == 0, err
    assert internal_names(out + err) == []


# ---- a hybrid model in fleet: sized and served by attention group -----------------------------------


def test_fleet_serves_a_hybrid_model_by_attention_group(capsys):
    """gpt-oss-20b on 4 GiB per replica: 10,922 blocks of one group's layers (384 KiB), not the
    5,461 uniform blocks of every layer; the precise router matches by the managers' rule."""
    from pagedkv.sim.hybrid_serving import hybrid_memory
    from pagedkv.sim.sizing import GIB, get_model

    memory = hybrid_memory(get_model("gpt-oss-20b"), 4 * GIB)
    assert (memory.grouped_blocks, memory.uniform_blocks) == (10_922, 5_461)
    rc, out, err = run(["fleet", "--model", "gpt-oss-20b", "--weights-gib", "13", "--kv-gib", "4",
                        "--num-requests", "30", "--replicas", "2", "--router", "precise", "--max-len", "65536"],
                       capsys)
    assert rc == 0, err
    text = flat(out)
    assert f"30 requests on 2 replicas of {memory.grouped_blocks:,} blocks of 16 (gpt-oss-20b)" in text
    assert (f"gpt-oss-20b is a hybrid model (attention groups: sliding window 128, full): each replica keeps "
            f"one table per group over {memory.grouped_blocks:,} blocks of 384 KiB") in text


def test_fleet_replicas_of_a_hybrid_model_stay_consistent_under_preemption():
    """Replicas with two attention groups, memory tight enough to preempt: every request
    finishes, and every manager's structures agree at the end (its own full check)."""
    from pagedkv.kv_specs import FullAttention, SlidingWindow
    from pagedkv.sim.fleet import run_fleet
    from pagedkv.sim.routers import make_router
    from pagedkv.sim.scheduler import clip_request

    groups = [SlidingWindow(128), FullAttention()]
    # long outputs, all at t = 0: decoding outgrows what admission left free
    reqs = [replace(clip_request(r, 1000), arrival=0.0, output_len=1500) for r in mooncake(40)]
    checked = []

    def check_at_end(i, replicas, router):
        if i == len(reqs):
            for rep in replicas:
                rep.alloc.m.check_invariants()
                checked.append(rep.name)

    res = run_fleet(reqs, make_router("precise", groups=groups), 2, 600, max_len=4096, groups=groups,
                    observer=check_at_end, wire=False)
    assert len(checked) == 2
    assert sum(r.preemptions for r in res.replicas) > 0
    assert sum(r.finished for r in res.replicas) == len(reqs)
