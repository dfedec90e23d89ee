"""Trace loaders: the real Azure and Mooncake files shipped in pagedkv/data, and tiny synthetic ones.

Facts checked against the shipped data README (pagedkv/data/README.md, measured on these files);
tolerances are stated per test.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv import KVCacheManager
from pagedkv.sim.request import segment_tokens
from pagedkv.sim.traces import (
    TraceFormatError,
    bundled_data_dir,
    content_key,
    default_data_dir,
    detect_format,
    load_azure_csv,
    load_mooncake_jsonl,
    load_trace,
    mooncake_hash_ids,
    mooncake_segments,
    trace_path,
    trace_stem,
)


def shipped(name: str):
    """A trace shipped with the package (whatever PAGEDKV_DATA says)."""
    path = trace_path(name, bundled_data_dir())
    assert path is not None and path.name.endswith(".gz"), path
    return path


def tokens(req) -> np.ndarray:
    return np.concatenate([segment_tokens(k, n) for k, n in req.segments])


# ---- real files -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name,count,median_prompt,median_output", [
    ("azure-conv", 19_366, 1020, 129),
    ("azure-code", 8_819, 1469, 13),
])
def test_azure_real(name, count, median_prompt, median_output):
    reqs = load_azure_csv(shipped(name))
    assert len(reqs) == count
    p = np.array([r.prompt_len for r in reqs])
    o = np.array([r.output_len for r in reqs])
    # README medians; tolerance: exact to within 1 token (they are medians of the same file).
    assert abs(np.median(p) - median_prompt) <= 1 and abs(np.median(o) - median_output) <= 1
    t = np.array([r.arrival for r in reqs])
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    assert 3000 < t[-1] < 3700  # "over ~1 hour"
    assert len({r.segments[0][0] for r in reqs}) == count  # no sharing: one unique key each


def test_azure_timestamps_keep_sub_microsecond_digits():
    # Rows 1 and 2 of the conv trace: 18:15:50.9951690 and 18:15:51.2224670 -> 0.227298 s apart.
    a, b = load_azure_csv(shipped("azure-conv"), start=1, limit=2)
    assert a.arrival == 0 and b.arrival == pytest.approx(0.227298, abs=1e-9)


def test_mooncake_real_facts():
    reqs = load_mooncake_jsonl(shipped("mooncake"))
    assert len(reqs) == 12_031
    p = np.array([r.prompt_len for r in reqs])
    o = np.array([r.output_len for r in reqs])
    # README: mean prompt 12,035, mean output 343 (tolerance: the README's rounding, 0.5 token).
    assert abs(p.mean() - 12_035) < 0.5 and abs(o.mean() - 343) < 0.5
    t = np.array([r.arrival for r in reqs])
    assert t[0] == 0 and np.all(np.diff(t) >= 0) and 3000 < t[-1] < 3700


def test_mooncake_real_hit_structure():
    """Equal hash_id prefixes => equal token prefixes; the first differing block differs.

    Pairs from the first 1,000 requests: each request with the latest earlier request holding its
    longest already-seen id prefix; the 40 deepest such pairs and 20 that share one block.
    """
    path = shipped("mooncake")
    reqs = load_mooncake_jsonl(path, limit=1000)
    recs = [ids for _, ids in mooncake_hash_ids(path, limit=1000)]
    holder: dict[int, int] = {}  # id -> the latest request that contained it
    pairs = []
    for j, ids in enumerate(recs):
        k = next((x for x, h in enumerate(ids) if h not in holder), len(ids))
        if k:
            pairs.append((k, holder[ids[k - 1]], j))
        holder.update((h, j) for h in ids)
    deep = sorted((p for p in pairs if p[0] >= 2), reverse=True)[:40]
    shallow = [p for p in pairs if p[0] == 1][:20]
    assert len(deep) == 40 and len(shallow) == 20 and deep[0][0] >= 10
    cache: dict[int, np.ndarray] = {}
    for k, i, j in deep + shallow:
        ti = cache.setdefault(i, tokens(reqs[i]))
        tj = cache.setdefault(j, tokens(reqs[j]))
        shared = min(512 * k, len(ti), len(tj))
        assert np.array_equal(ti[:shared], tj[:shared])
        if k < min(len(recs[i]), len(recs[j])):
            assert not np.array_equal(ti[512 * k : 512 * k + 64], tj[512 * k : 512 * k + 64])


def test_mooncake_real_start_limit_and_detection():
    path = shipped("mooncake")
    assert detect_format(path) == "mooncake" and detect_format(shipped("azure-conv")) == "azure"
    tail = load_trace(path, start=12_029)
    assert len(tail) == 2 and tail[0].arrival == 0
    assert [r.req_id for r in load_trace(path, start=5, limit=3)] == [
        f"mooncake_conversation_trace:{i}" for i in (5, 6, 7)]


# ---- synthetic files ------------------------------------------------------------------------------

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,879,55
"""


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_azure_synthetic(tmp_path):
    p = write(tmp_path, "t.csv", AZURE)
    reqs = load_azure_csv(p)
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(374, 44), (396, 109), (879, 55)]
    assert reqs[0].arrival == 0 and reqs[1].arrival == pytest.approx(4.314579, abs=1e-9)
    assert reqs[2].arrival == pytest.approx(4.541877, abs=1e-9)
    mid = load_azure_csv(p, start=1, limit=1)
    assert len(mid) == 1 and mid[0].prompt_len == 396 and mid[0].arrival == 0
    assert load_azure_csv(p, limit=0) == []
    assert load_trace(p) == reqs


@pytest.mark.parametrize("text,match", [
    ("when,ContextTokens,GeneratedTokens\n", ":1: expected the header"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,12\n", ":2: expected 3"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,1\nyesterday,3,4\n", ":3: bad TIMESTAMP"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,x,1\n", ":2: ContextTokens must be an integer"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,0,1\n", ":2: ContextTokens must be >= 1"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,5,-1\n", ":2: GeneratedTokens must be >= 0"),
])
def test_azure_errors_name_file_and_line(tmp_path, text, match):
    p = write(tmp_path, "bad.csv", text)
    with pytest.raises(TraceFormatError, match=match) as e:
        load_azure_csv(p)
    assert "bad.csv" in str(e.value)


def test_azure_bad_header_is_shown_escaped(tmp_path):
    """A header with control bytes (a binary file, an escape sequence) is echoed as a repr, so
    the error line cannot drive the user's terminal."""
    p = write(tmp_path, "bad.csv", "\x1b[2JTIMESTAMP,ContextTokens,Generated\x07\n1,2,3\n")
    with pytest.raises(TraceFormatError, match="expected the header") as e:
        load_azure_csv(p)
    msg = str(e.value)
    assert "\x1b" not in msg and "\x07" not in msg
    assert "\\x1b[2JTIMESTAMP" in msg


MOONCAKE = [
    {"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 1500, "output_length": 7, "hash_ids": [0, 1, 3]},
    {"timestamp": 2000, "input_length": 600, "output_length": 0, "hash_ids": [0, 4]},
    {"timestamp": 2000, "input_length": 10, "output_length": 1, "hash_ids": [5]},
]


def mooncake_file(tmp_path, records=MOONCAKE, name="mc.jsonl"):
    return write(tmp_path, name, "\n".join(json.dumps(r) for r in records) + "\n")


def test_mooncake_synthetic_segments_and_times(tmp_path):
    reqs = load_mooncake_jsonl(mooncake_file(tmp_path))
    assert [r.arrival for r in reqs] == [0.0, 0.5, 1.0, 1.0]
    assert [[n for _, n in r.segments] for r in reqs] == [[512, 512, 76], [512, 512, 476], [512, 88], [10]]
    assert [r.prompt_len for r in reqs] == [1100, 1500, 600, 10]
    assert reqs[0].segments[:2] == reqs[1].segments[:2]  # ids 0, 1 -> equal keys
    t = [tokens(r) for r in reqs]
    assert np.array_equal(t[0][:1024], t[1][:1024]) and not np.array_equal(t[0][1024:1076], t[1][1024:1076])
    assert np.array_equal(t[0][:512], t[2][:512]) and t[0][512] != t[2][512]


def test_mooncake_hits_in_the_manager(tmp_path):
    """Replayed through the real manager, hits land exactly where the hash ids say."""
    reqs = load_mooncake_jsonl(mooncake_file(tmp_path))
    m = KVCacheManager(num_blocks=1024, block_size=16)
    hits = [m.add_sequence(i, r.prompt_tokens()) for i, r in enumerate(reqs)]
    assert hits == [0, 1024, 512, 0]


def test_mooncake_line_with_fewer_ids_is_an_error_naming_it(tmp_path):
    """ceil(1000 / 512) = 2 ids are due; one would leave 488 tokens that can never hit."""
    recs = [MOONCAKE[0], {"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [0]}]
    with pytest.raises(TraceFormatError, match=r":2: 1 hash_ids for 1000 tokens; .* ceil\(1000/512\) = 2"):
        load_mooncake_jsonl(mooncake_file(tmp_path, recs))
    with pytest.raises(TraceFormatError, match=":2: 1 hash_ids"):
        mooncake_hash_ids(mooncake_file(tmp_path, recs))


def test_mooncake_segments_give_fewer_ids_a_unique_suffix():
    a = mooncake_segments(1000, [0], "t", 0)
    b = mooncake_segments(1000, [0], "t", 1)
    assert [n for _, n in a] == [512, 488]
    assert a[0] == b[0] and a[1][0] != b[1][0]


def test_mooncake_namespaces_and_key_kinds(tmp_path):
    a = load_mooncake_jsonl(mooncake_file(tmp_path, name="one.jsonl"))
    b = load_mooncake_jsonl(mooncake_file(tmp_path, name="two.jsonl"))
    assert a[0].segments[0][0] != b[0].segments[0][0]  # id 0 of another trace is other content
    c = load_mooncake_jsonl(mooncake_file(tmp_path, name="two.jsonl"), namespace="one")
    assert a[0].segments == c[0].segments
    kinds = {content_key(k, "x", 0) >> 56 for k in ("mooncake", "system", "unique")}
    assert len(kinds) == 3
    with pytest.raises(ValueError):
        content_key("mooncake", "x", 1 << 32)
    with pytest.raises(ValueError):
        content_key("other", "x", 0)


@pytest.mark.parametrize("line,match", [
    ("{not json", ":2: not valid JSON"),
    ('[1, 2]', ":2: expected a JSON object"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}', ":2: missing field"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [0]}', ":2: timestamp"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', ":2: input_length must be >= 1"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1.5, "hash_ids": [0]}', ":2: output_length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0, 1]}', ":2: 2 hash_ids for 5"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": 7}', ":2: hash_ids must be a list"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-3]}', ":2: hash_ids"),
])
def test_mooncake_errors_name_file_and_line(tmp_path, line, match):
    p = write(tmp_path, "bad.jsonl", json.dumps(MOONCAKE[0]) + "\n" + line + "\n")
    with pytest.raises(TraceFormatError, match=match):
        load_mooncake_jsonl(p)


def test_detection_and_argument_errors(tmp_path):
    p = write(tmp_path, "trace.txt", json.dumps(MOONCAKE[0]) + "\n")
    assert detect_format(p) == "mooncake"
    q = write(tmp_path, "trace.dat", AZURE)
    assert detect_format(q) == "azure"
    r = write(tmp_path, "trace.bin", "hello\n")
    with pytest.raises(TraceFormatError, match="cannot tell"):
        detect_format(r)
    with pytest.raises(ValueError, match="does not exist"):
        load_trace(tmp_path / "none.csv")
    with pytest.raises(ValueError, match="start"):
        load_trace(p, start=-1)
    with pytest.raises(ValueError, match="limit"):
        load_trace(p, limit=1.5)


def test_default_data_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDKV_DATA", str(tmp_path))
    assert default_data_dir() == tmp_path
    assert trace_path("mooncake") is None  # the directory exists, the file does not
    monkeypatch.setenv("PAGEDKV_DATA", str(tmp_path / "missing"))
    assert default_data_dir() is None and trace_path("azure-conv") is None
    with pytest.raises(ValueError, match="unknown trace"):
        trace_path("sharegpt")


def test_traces_ship_with_the_package(monkeypatch):
    """With no PAGEDKV_DATA the shipped gzipped copies are found, next to their README and NOTICE."""
    monkeypatch.delenv("PAGEDKV_DATA", raising=False)
    d = default_data_dir()
    assert d == bundled_data_dir() and d.name == "data" and d.parent.name == "pagedkv"
    for name in ("azure-conv", "azure-code", "mooncake"):  # full contents: the tests above
        path = trace_path(name)
        assert path is not None and path.parent == d and path.suffix == ".gz"
        assert len(load_trace(path, limit=5)) == 5
    notice = (d / "NOTICE.md").read_text()
    assert "CC-BY-4.0" in notice and "Azure LLM inference trace 2023" in notice and "Apache" in notice
    assert "hash_ids" in (d / "README.md").read_text()
    assert "Apache License" in (d / "LICENSE-Apache-2.0.txt").read_text()


def test_gzipped_and_plain_files_replay_identically(tmp_path):
    import gzip

    plain = mooncake_file(tmp_path, name="mc.jsonl")
    gz = tmp_path / "other" / "mc.jsonl.gz"
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    assert trace_stem(gz) == trace_stem(plain) == "mc"
    assert detect_format(gz) == "mooncake"
    assert load_trace(gz) == load_trace(plain)  # same ids, same content keys, same times
    renamed = tmp_path / "mc.data"  # recognised by its gzip magic bytes, not its name
    renamed.write_bytes(gz.read_bytes())
    assert detect_format(renamed) == "mooncake"
    assert [r.segments for r in load_mooncake_jsonl(renamed, namespace="mc")] == [r.segments for r in load_trace(plain)]
    csv = write(tmp_path, "az.csv", AZURE)
    csv_gz = tmp_path / "other" / "az.csv.gz"
    csv_gz.write_bytes(gzip.compress(csv.read_bytes()))
    assert detect_format(csv_gz) == "azure" and load_trace(csv_gz) == load_trace(csv)


def test_trace_path_finds_plain_or_gzipped_copies(tmp_path):
    import gzip

    (tmp_path / "azure_llm_2023_code.csv.gz").write_bytes(gzip.compress(AZURE.encode()))
    write(tmp_path, "mooncake_conversation_trace.jsonl", "")
    write(tmp_path, "mooncake_conversation_trace.jsonl.gz", "")
    assert trace_path("azure-code", tmp_path).name == "azure_llm_2023_code.csv.gz"
    assert trace_path("mooncake", tmp_path).name == "mooncake_conversation_trace.jsonl"  # plain first
    assert trace_path("azure-conv", tmp_path) is None


@pytest.mark.parametrize("name,content", [
    ("empty.jsonl", b""),
    ("blank.jsonl", b"\n  \n"),
    ("empty.csv", b""),
    ("header.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n"),
    ("empty.jsonl.gz", __import__("gzip").compress(b"")),
])
def test_empty_traces_are_errors_naming_the_file(tmp_path, name, content):
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(TraceFormatError, match=f"{name}: no requests"):
        load_trace(p)
    if name.endswith(".jsonl"):
        with pytest.raises(TraceFormatError, match="no requests"):
            mooncake_hash_ids(p)


@pytest.mark.parametrize("name,content", [
    ("broken.jsonl.gz", b"\x1f\x8b\x08\x00garbage-not-deflate"),
    ("latin1.jsonl", b'{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n\xff\xfe\n'),
])
def test_undecodable_traces_are_errors_naming_the_file(tmp_path, name, content):
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(TraceFormatError, match=f"{name}: not a readable text trace"):
        load_trace(p)


# ---- the hit structure, as a property ---------------------------------------------------------------


@st.composite
def conversation_trees(draw):
    """Requests whose hash ids are root paths in a random prefix tree (as chained ids are).

    Every id has one block length: 512 if it may be extended, else 1..512 (a last, partial block).
    """
    nodes: list[tuple[list[int], int]] = []  # (path from the root, length of the node's block)
    records = []
    for _ in range(draw(st.integers(2, 7))):
        if nodes and draw(st.booleans()):
            path, last = draw(st.sampled_from(nodes))  # a repeat of an existing prefix
        else:
            full = [n for n in nodes if n[1] == 512]
            base = draw(st.sampled_from(full))[0] if full and draw(st.booleans()) else []
            path = list(base)
            for _ in range(draw(st.integers(1, 3))):
                path = path + [len(nodes)]
                last = 512 if draw(st.booleans()) else draw(st.integers(1, 512))
                nodes.append((path, last))
                if last < 512:
                    break
        records.append({"timestamp": 0, "input_length": 512 * (len(path) - 1) + last,
                        "output_length": 1, "hash_ids": path})
    return records


@given(records=conversation_trees(), block_size=st.sampled_from([2, 7, 16, 64, 512]))
def test_manager_hits_equal_the_hash_id_prediction(tmp_path_factory, records, block_size):
    """Prefix hits at any block size B are exactly the hash ids' common prefixes:
    floor(min(tokens of the leading ids already seen, L - 1) / B) * B."""
    path = mooncake_file(tmp_path_factory.mktemp("mc"), records)
    reqs = load_mooncake_jsonl(path)
    m = KVCacheManager(num_blocks=4096, block_size=block_size, hash_algo="builtin")
    seen: set[int] = set()
    for i, (r, rec) in enumerate(zip(reqs, records)):
        ids, n_in = rec["hash_ids"], rec["input_length"]
        k = next((x for x, h in enumerate(ids) if h not in seen), len(ids))
        want = min(512 * k, n_in - 1) // block_size * block_size
        assert m.add_sequence(i, r.prompt_tokens()) == want
        seen.update(ids)


def test_traces_load_from_a_zipped_package(tmp_path):
    """Imported from a zip archive (no files on disk), the shipped traces are still found."""
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src"
    archive = tmp_path / "pagedkv.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for f in (src / "pagedkv").rglob("*"):
            if f.is_file() and "__pycache__" not in f.parts:
                z.write(f, f.relative_to(src).as_posix())
    code = ("from pagedkv.sim.traces import trace_path, load_trace; p = trace_path('mooncake'); "
            "print(p.name, len(load_trace(p, limit=3)), p.is_file())")
    env = {k: v for k, v in __import__("os").environ.items() if k != "PAGEDKV_DATA"}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(archive)},
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["mooncake_conversation_trace.jsonl.gz", "3", "True"]


def test_trace_lengths_match_the_loaders(tmp_path):
    from pagedkv.sim.traces import load_trace, trace_lengths

    for name in ("azure-code", "mooncake"):
        path = trace_path(name)
        reqs = load_trace(path)
        prompts, outputs = trace_lengths(path)
        assert sorted(zip(prompts, outputs)) == sorted((r.prompt_len, r.output_len) for r in reqs)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n{"input_length": 3}\n')
    with pytest.raises(TraceFormatError, match="bad.jsonl:2"):
        trace_lengths(bad)
