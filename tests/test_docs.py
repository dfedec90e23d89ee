"""docs/design.md is the design users read: its examples must run, it must name every call of
the public contract, and nothing shipped may send a reader to a file they do not have.

Convention: a Python example that the test suite runs is a ```python block directly after the
HTML comment ``<!-- runnable -->`` (or ``<!-- runnable: requires msgspec -->`` when it needs an
optional package, imported with ``pytest.importorskip``). Every ```python block in the document
carries the marker; other code is fenced as ```text.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import pydoc
import re
from pathlib import Path

import pytest

import pagedkv
from pagedkv import CopyOp, KVCacheManager, OutOfBlocks, Usage
from pagedkv.hashing import ALGORITHMS

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "design.md"

_BLOCK = re.compile(
    r"^<!-- runnable(?::\s*requires\s+(?P<requires>[\w., ]+?))?\s*-->\n```python\n(?P<code>.*?)^```",
    re.S | re.M,
)

# ---- the public contract: the names external code relies on (extend, never rename) ----------

CONTRACT_METHODS = {
    # v1
    "add_sequence": ["seq_id", "prompt_ids", "cache_salt", "prefill"],
    "append_token": ["seq_id", "token_id"],
    "append_tokens": ["seq_id", "token_ids", "speculative"],
    "fork": ["parent_id", "child_id"],
    "take_copies": [],
    "free": ["seq_id", "cache"],
    "block_table": ["seq_id"],
    "num_tokens": ["seq_id"],
    "refcount": ["block_id"],
    "usage": [],
    "check_invariants": [],
    "reset_prefix_cache": [],
    "take_events": [],
    "append_batch": ["seq_ids", "token_ids"],
    "block_tables": ["seq_ids", "pad"],
    "flashinfer_layout": ["seq_ids"],
    # v2
    "lookup": ["prompt_ids", "cache_salt"],
    "prefill": ["seq_id", "n"],
    "num_computed": ["seq_id"],
    "accept": ["seq_id", "k"],
    "slots": ["seq_id", "start", "stop", "group"],
    # v3 (KV cache groups): the exports and usage take a group
    "block_table": ["seq_id", "group"],
    "block_tables": ["seq_ids", "pad", "group"],
    "flashinfer_layout": ["seq_ids", "group"],
    "usage": ["group"],
}
CONTRACT_PROPERTIES = ["num_free_blocks", "num_groups"]
CONSTRUCTOR_ARGS = ["num_blocks", "block_size", "enable_prefix_caching", "hash_algo", "groups"]
HASH_ALGOS = ["sha256", "xxh3", "builtin"]
USAGE_FIELDS = [
    "logical_tokens", "stored_tokens", "used_blocks", "allocated_slots", "internal_fragmentation",
    "blocks_saved_by_sharing", "cached_blocks", "prefix_query_tokens", "prefix_hit_tokens",
    "cow_copies", "forks", "evictions",
]
COPYOP_FIELDS = ("src", "dst", "group")  # group: contract v3, 0 by default
OUTOFBLOCKS_FIELDS = ["needed", "available"]
# Documented extensions: they must exist and be described too.
EXTENSION_METHODS = ["tokens", "num_drafts", "seq_ids"]
EXTENSION_NAMES = ["BlockPool", "BlockStored", "BlockRemoved", "AllBlocksCleared", "pagedkv.events"]


def _doc() -> str:
    return DOC.read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    """The text of the level-2 section whose heading starts with ``heading``."""
    m = re.search(rf"^## {re.escape(heading)}.*?$(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"docs/design.md has no section '## {heading}'"
    return m.group(1)


def _inline_code(text: str) -> str:
    """Every inline code span and fenced block of ``text``, joined: where API names belong."""
    fenced = re.findall(r"```\w*\n(.*?)```", text, re.S)
    rest = re.sub(r"```\w*\n.*?```", "", text, flags=re.S)
    return "\n".join(fenced + re.findall(r"`([^`\n]+)`", rest))


def _runnable_blocks() -> list[tuple[int, str, str]]:
    text = _doc()
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code")) + 1
        out.append((line, (m.group("requires") or "").strip(), m.group("code")))
    return out


# ---- runnable examples ---------------------------------------------------------------------------


def test_every_python_block_is_marked_runnable():
    text = _doc()
    python_blocks = len(re.findall(r"^```python\n", text, re.M))
    runnable = _runnable_blocks()
    assert python_blocks == len(runnable), (
        f"{python_blocks - len(runnable)} ```python blocks lack the <!-- runnable --> marker"
    )
    assert len(runnable) >= 12


@pytest.mark.parametrize("line,requires,code", _runnable_blocks(),
                         ids=[f"design.md:{line}" for line, _, _ in _runnable_blocks()])
def test_runnable_example_runs(line, requires, code):
    for module in filter(None, (r.strip() for r in requires.split(","))):
        pytest.importorskip(module)
    # Leading newlines keep tracebacks pointing at the right line of docs/design.md.
    source = "\n" * (line - 1) + code
    exec(compile(source, str(DOC), "exec"), {"__name__": "design_md_example"})


# ---- the contract: documented and present -------------------------------------------------------


def test_contract_names_exist_in_the_package():
    for name, params in {**CONTRACT_METHODS, **dict.fromkeys(EXTENSION_METHODS, [])}.items():
        method = getattr(KVCacheManager, name, None)
        assert callable(method), f"KVCacheManager.{name} is missing"
        sig = inspect.signature(method).parameters
        missing = [p for p in params if p not in sig]
        assert not missing, f"KVCacheManager.{name} lacks parameters {missing}"
    for name in CONTRACT_PROPERTIES:
        assert isinstance(inspect.getattr_static(KVCacheManager, name), property), name
    ctor = inspect.signature(KVCacheManager).parameters
    assert [p for p in CONSTRUCTOR_ARGS if p not in ctor] == []
    assert {f.name for f in dataclasses.fields(Usage)} >= set(USAGE_FIELDS)
    assert CopyOp._fields == COPYOP_FIELDS and CopyOp(3, 5).dst == 5 and CopyOp(3, 5) == CopyOp(3, 5, group=0)
    err = OutOfBlocks(7, 2)
    assert isinstance(err, RuntimeError) and (err.needed, err.available) == (7, 2)
    assert ALGORITHMS == tuple(HASH_ALGOS)
    for algo in ("sha256", "builtin"):  # xxh3 needs the optional xxhash; the hashing tests cover it
        assert KVCacheManager(4, hash_algo=algo).hash_algo == algo
    for name in EXTENSION_NAMES[:4]:
        assert name in pagedkv.__all__
    events = importlib.import_module("pagedkv.events")  # imports without its optional extra
    assert callable(events.encode_vllm) and callable(events.decode_vllm)


def test_contract_names_appear_in_the_api_section():
    api = _section(_doc(), "2. Public API")
    code = _inline_code(api)
    identifiers = set(re.findall(r"[A-Za-z_][\w.]*", code))
    # Each call has its own row in the API tables: "| `name(args)` | returns | what it does |".
    rows = [m for m in (*CONTRACT_METHODS, *EXTENSION_METHODS) if not re.search(rf"^\| `{m}\(", api, re.M)]
    assert not rows, f"calls without a row in the API tables: {rows}"
    rows = [p for p in CONTRACT_PROPERTIES if not re.search(rf"^\| `{p}`", api, re.M)]
    assert not rows, f"properties without a row in the API tables: {rows}"
    for name, params in CONTRACT_METHODS.items():
        assert set(params) <= identifiers, f"{name}: parameters {set(params) - identifiers} undocumented"
    names = [*CONTRACT_PROPERTIES, *CONSTRUCTOR_ARGS, *USAGE_FIELDS, *COPYOP_FIELDS,
             *OUTOFBLOCKS_FIELDS, *EXTENSION_NAMES, "KVCacheManager", "OutOfBlocks", "CopyOp", "Usage"]
    assert [n for n in names if n not in identifiers] == []
    assert [a for a in HASH_ALGOS if f'"{a}"' not in code] == []


def test_design_states_the_engine_rules_and_the_targets():
    text = _doc()
    rules = _section(text, "4. Rules an engine follows")
    for phrase in ("then copies, then writes", "Fork and swap out between steps",
                   "free(id, cache=False)", "OutOfBlocks", "take_copies()", "take_transfers()",
                   "One thread"):
        assert phrase in rules, phrase
    assert "not thread-safe" in text and "pickles to an equal state" in text
    targets = _section(text, "6. Performance targets")
    for target in ("≤ 50 µs", "≤ 1 µs", "≤ 20 µs", "≤ 30 µs", "≤ 100 ms", "≤ 32 bytes", "≤ 60 µs",
                   "≤ 0.3 µs", "≤ 15 µs", "≤ 5 µs", "≤ 70%", "within 5%"):
        assert target in targets, target
    assert "pagedkv bench" in targets


def test_help_of_the_manager_states_its_rules():
    """What ``help(pagedkv.KVCacheManager)`` prints is the documentation a user always has."""
    text = pydoc.render_doc(KVCacheManager, renderer=pydoc.plaintext)
    assert "not thread-safe" in text
    assert "Fork between steps" in text and "after the step's K/V writes" in text
    assert "free(id, cache=False)" in text and "OutOfBlocks(needed, available)" in text
    undocumented = [n for n, v in vars(KVCacheManager).items()
                    if not n.startswith("_") and not inspect.getdoc(v)]
    assert undocumented == []


# ---- nothing shipped points at files a user does not have --------------------------------------

_FORBIDDEN = re.compile(rb"\.\./shared|DESIGN\.md|\bDESIGN\b")


def _shipped_files() -> list[Path]:
    files = [p for p in (ROOT / "src").rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".gz")
             and not any(part.endswith(".egg-info") for part in p.parts)]  # build output
    return files + [ROOT / "README.md", DOC]


def test_nothing_shipped_refers_to_unshipped_design_files():
    offenders = []
    for path in _shipped_files():
        for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
            if _FORBIDDEN.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}")
    assert offenders == [], "references to ../shared or DESIGN.md: " + ", ".join(offenders)


def test_readme_links_to_the_design():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(docs/design.md)" in readme, "README.md must link to docs/design.md"


def test_every_module_is_named_in_the_design():
    """The design's layer table and module map name every module of the package (by its path
    inside ``pagedkv``, e.g. ``sim.cache_replay``, or, for the allocator's top-level modules and
    the engine package's, by its own name), so the map cannot fall behind the tree."""
    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "design.md").read_text()
    missing = []
    for path in sorted((root / "src" / "pagedkv").rglob("*.py")):
        rel = path.relative_to(root / "src" / "pagedkv").with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        if not parts or parts[0] == "data":
            continue
        dotted = ".".join(parts)
        if f"`{dotted}`" not in text and f"`{parts[-1]}`" not in text:
            missing.append(dotted)
    assert missing == []
