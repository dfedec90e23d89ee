"""Loaders for real LLM-serving traces: the Azure LLM inference CSV and the Mooncake JSONL.

Both turn each line into a :class:`~pagedkv.sim.request.Request` whose prompt is a *recipe* of
content segments (see ``request.py``), so a 12,000-request trace costs kilobytes until replayed.

- **Azure** (``TIMESTAMP,ContextTokens,GeneratedTokens``, Splitwise, ISCA'24) says nothing about
  content, so every prompt is one segment of content unique to that request: no prefix sharing.
- **Mooncake** (FAST'25; ``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``)
  gives one id per 512-token block of the prompt, chained (equal ids mean an equal prefix up to and
  including that block); a line with more or fewer ids than ``ceil(input_length / 512)`` is an
  error naming it. Block ``i`` becomes the segment ``(key(id), 512)``, the last one
  ``input_length - 512 * (len - 1)`` tokens long. Because a segment's tokens are a function of its
  key alone, equal ids give equal tokens, a short last block is a prefix of the full block with
  the same id, and a prefix hit at any block size B happens exactly where the trace says.
  Worked example: ``input_length`` 1100, ``hash_ids`` [0, 7, 9] -> segments
  ((k0, 512), (k7, 512), (k9, 76)).

Files may be plain or gzip-compressed (recognised by their first bytes); the traces shipped with
pagedkv live gzipped in ``pagedkv/data`` (:func:`trace_path` finds them). A file that is empty,
cannot be decoded or has a malformed record raises :class:`TraceFormatError` naming the file (and
the line): replaying it would only print zeros.

Arrival times are seconds from the earliest loaded request (so a slice taken with ``start``
replays from t = 0); requests come back in arrival order.

Content keys (:func:`content_key`) are namespaced so that no two sources collide: the top 8 bits
name the kind (Mooncake block, system prompt, unique per-request content), the next 24 a hash of
the namespace (a trace's file stem, a workload's name and seed), the low 32 bits the index.
"""
from __future__ import annotations

import atexit
import gzip
import hashlib
import json
import math
import os
import shutil
import tempfile
import zlib
from contextlib import contextmanager
from datetime import datetime
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Iterator

from ..checks import int_at_least, optional_int_at_least
from .request import Request

__all__ = [
    "content_key",
    "load_azure_csv",
    "load_mooncake_jsonl",
    "mooncake_segments",
    "mooncake_hash_ids",
    "load_trace",
    "detect_format",
    "default_data_dir",
    "bundled_data_dir",
    "trace_path",
    "trace_stem",
    "TRACE_FILES",
    "MOONCAKE_BLOCK",
    "TraceFormatError",
]

MOONCAKE_BLOCK = 512  # tokens per hash_id in the Mooncake traces

# The public traces this project replays, by short name. They ship gzipped in pagedkv/data (its
# README.md gives sources and fields, NOTICE.md the attribution and licences).
TRACE_FILES = {
    "azure-conv": "azure_llm_2023_conv.csv",
    "azure-code": "azure_llm_2023_code.csv",
    "mooncake": "mooncake_conversation_trace.jsonl",
}

DATA_PACKAGE = "pagedkv.data"
GZIP_MAGIC = b"\x1f\x8b"

_KINDS = {"mooncake": 1, "system": 2, "unique": 3}
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceFormatError(ValueError):
    """A trace file is malformed; the message names the file and line."""


def content_key(kind: str, namespace: str, index: int) -> int:
    """A segment key that cannot collide with another kind's or another index's key.

    ``kind`` is one of ``"mooncake"``, ``"system"``, ``"unique"``; ``namespace`` separates sources
    of one kind (two namespaces of a kind share keys only if their 24-bit hashes collide, 1 in
    16.7M); ``index`` is in [0, 2**32). Example: ``content_key("mooncake", "conv", 7)`` is
    ``(1 << 56) | (h24("conv") << 32) | 7``.
    """
    if kind not in _KINDS:
        raise ValueError(f"unknown content kind {kind!r}; expected one of {sorted(_KINDS)}")
    if not isinstance(namespace, str):
        raise ValueError(f"namespace must be a string, got {namespace!r}")
    span = "an int in [0, 2**32)"
    index = int_at_least("content index", index, 0, expected=span)
    if index >= 1 << 32:
        raise ValueError(f"content index must be {span}, got {index!r}")
    ns = int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=3).digest(), "big")
    return (_KINDS[kind] << 56) | (ns << 32) | index


# ---- data directory -------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def bundled_data_dir() -> Path:
    """The directory of the traces shipped inside the package (``pagedkv/data``, gzip-compressed).

    Found with ``importlib.resources``, so it works from a source tree, an installed wheel or an
    editable install alike. When the package is imported from a zip archive, the files are copied
    once to a temporary directory (removed at exit) so that they can be read as ordinary files.
    """
    root = resources.files(DATA_PACKAGE)
    if isinstance(root, Path):
        return root
    tmp = Path(tempfile.mkdtemp(prefix="pagedkv-data-"))
    atexit.register(shutil.rmtree, tmp, True)
    for entry in root.iterdir():
        if entry.is_file():
            (tmp / entry.name).write_bytes(entry.read_bytes())
    return tmp


def default_data_dir() -> Path | None:
    """Where the public traces are read from: ``$PAGEDKV_DATA`` when set, else the copies shipped
    with the package (:func:`bundled_data_dir`).

    ``PAGEDKV_DATA`` replaces the bundled directory as a whole (a file missing there is missing);
    set to a path that is not a directory it gives ``None``: no traces at all, which is how the
    sections' no-data paths are exercised.
    """
    env = os.environ.get("PAGEDKV_DATA")
    if env is not None:
        p = Path(env).expanduser()
        return p if p.is_dir() else None
    return bundled_data_dir()


def trace_not_found(name: str, data_dir: Path | str | None = None) -> str:
    """Why :func:`trace_path` found no ``name`` trace: the file looked for and where, e.g.
    ``"Mooncake trace not found (mooncake_conversation_trace.jsonl[.gz] is not in DIR)"``."""
    where = data_dir if data_dir is not None else default_data_dir()
    label = "Mooncake" if name == "mooncake" else name
    return (f"{label} trace not found ({TRACE_FILES[name]}[.gz] is not in "
            f"{where if where is not None else 'any data directory'})")


def trace_path(name: str, data_dir: Path | str | None = None) -> Path | None:
    """The file of a public trace by short name (``"mooncake"``, ``"azure-conv"``, ``"azure-code"``)
    in ``data_dir`` (default: :func:`default_data_dir`), plain or gzipped (``<file>.gz``), or
    ``None`` when the directory or the file is absent.

    Example: with no argument and no ``PAGEDKV_DATA``, ``trace_path("mooncake")`` is the bundled
    ``.../pagedkv/data/mooncake_conversation_trace.jsonl.gz``.
    """
    if name not in TRACE_FILES:
        raise ValueError(f"unknown trace {name!r}; known: {', '.join(TRACE_FILES)}")
    d = Path(data_dir) if data_dir is not None else default_data_dir()
    if d is None:
        return None
    for fname in (TRACE_FILES[name], TRACE_FILES[name] + ".gz"):
        if (d / fname).is_file():
            return d / fname
    return None


def trace_stem(path: str | Path) -> str:
    """A trace file's name without its format and compression suffixes: the namespace of its
    content keys and request ids, so that a plain file and its gzipped copy replay identically.
    ``trace_stem("x/mooncake_conversation_trace.jsonl.gz") == "mooncake_conversation_trace"``."""
    p = Path(path)
    return Path(p.stem).stem if p.suffix.lower() == ".gz" else p.stem


# ---- shared helpers -------------------------------------------------------------------------------


def _check_slice(start: int, limit: int | None) -> None:
    int_at_least("start", start, 0)
    optional_int_at_least("limit", limit, 0)


def _open(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"trace file {p} does not exist")
    return p


def _is_gzip(p: Path) -> bool:
    with p.open("rb") as f:
        return f.read(2) == GZIP_MAGIC


@contextmanager
def _text(p: Path) -> Iterator[Iterator[str]]:
    """The lines of a plain or gzipped (by its magic bytes, whatever its name) text file; a file
    that cannot be decoded becomes a :class:`TraceFormatError` naming it."""
    try:
        f = gzip.open(p, "rt", encoding="utf-8") if _is_gzip(p) else p.open(encoding="utf-8")
        with f:
            yield f
    except (UnicodeDecodeError, EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise TraceFormatError(f"{p}: not a readable text trace ({type(e).__name__}: {e})") from None


def _records(p: Path, start: int, limit: int | None, skip_header: bool) -> Iterator[tuple[int, int, str]]:
    """Yield ``(record index, 1-based line number, line)`` of the records in the slice.

    A file with no record at all (empty, blank, or a header alone) is a :class:`TraceFormatError`:
    replaying it would print a report of zeros."""
    if limit == 0:
        return
    with _text(p) as f:
        idx = 0
        for lineno, line in enumerate(f, 1):
            if (skip_header and lineno == 1) or not line.strip():
                continue
            if idx >= start:
                yield idx, lineno, line
                if limit is not None and idx + 1 - start >= limit:
                    return
            idx += 1
    if idx == 0:
        raise TraceFormatError(f"{p}: no requests in the trace (the file is empty)")


# A token count past 2**31 - 1 is no request (positions and slots are int32 everywhere); a
# larger one in a trace is a corrupt line, and would overflow numpy's int64 token arithmetic.
MAX_TRACE_TOKENS = (1 << 31) - 1


def _int_field(value: object, name: str, lo: int, where: str, hi: int | None = MAX_TRACE_TOKENS) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise TraceFormatError(f"{where}: {name} must be an integer, got {value!r}")
    if value < lo:
        raise TraceFormatError(f"{where}: {name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise TraceFormatError(f"{where}: {name} must be at most {hi:,} tokens, got {value:,}")
    return value


def _finish(items: list[tuple[int | float, str, tuple, int]], per_second: int) -> list[Request]:
    """Shift times to start at 0 (exactly, on the file's own units), sort by arrival (stable),
    convert to seconds, build the requests."""
    if not items:
        return []
    t0 = min(t for t, *_ in items)
    items.sort(key=lambda it: it[0])
    return [Request(rid, (t - t0) / per_second, segs, out) for t, rid, segs, out in items]


# ---- Azure ----------------------------------------------------------------------------------------


def _parse_time(text: str, where: str) -> int:
    """``2023-11-16 18:15:46.6805900`` -> integer nanoseconds since 1970 (naive, read as UTC).

    Integers keep the 100 ns digits that a float of POSIX seconds (~1.7e9) would round away."""
    text = text.strip()
    whole, _, frac = text.partition(".")
    try:
        dt = datetime.fromisoformat(whole)
        if frac and not frac.isdigit():
            raise ValueError
    except ValueError:
        raise TraceFormatError(f"{where}: bad TIMESTAMP {text!r} (expected YYYY-MM-DD HH:MM:SS[.fff])") from None
    seconds = (dt.toordinal() - 719163) * 86400 + dt.hour * 3600 + dt.minute * 60 + dt.second
    return seconds * 10**9 + (int(frac.ljust(9, "0")[:9]) if frac else 0)


def load_azure_csv(path: str | Path, *, limit: int | None = None, start: int = 0) -> list[Request]:
    """Requests of an Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    ``start`` skips that many data rows, ``limit`` caps how many are read. Each prompt is one
    segment of unique content (the trace has no content). Example: the row
    ``2023-11-16 18:15:50.9951690,396,109`` four seconds after the first becomes
    ``Request(arrival=4.31..., prompt_len=396, output_len=109)``.
    """
    _check_slice(start, limit)
    p = _open(path)
    with _text(p) as f:
        first = f.readline()
    if not first.strip():
        raise TraceFormatError(f"{p}: no requests in the trace (the file is empty)")
    header = [c.strip() for c in first.strip().lstrip("\ufeff").split(",")]
    if sorted(header) != sorted(_AZURE_COLUMNS):
        got = ",".join(header)
        shown = got if got.isprintable() else repr(got)  # control bytes never reach the terminal raw
        raise TraceFormatError(f"{p}:1: expected the header {','.join(_AZURE_COLUMNS)}, got {shown}")
    col = {name: header.index(name) for name in _AZURE_COLUMNS}
    ns = trace_stem(p)
    items = []
    for idx, lineno, line in _records(p, start, limit, skip_header=True):
        where = f"{p}:{lineno}"
        cells = line.rstrip("\r\n").split(",")
        if len(cells) != 3:
            raise TraceFormatError(f"{where}: expected 3 comma-separated fields, got {len(cells)}")
        t = _parse_time(cells[col["TIMESTAMP"]], where)
        prompt = _int_field(_to_int(cells[col["ContextTokens"]], "ContextTokens", where), "ContextTokens", 1, where)
        out = _int_field(_to_int(cells[col["GeneratedTokens"]], "GeneratedTokens", where), "GeneratedTokens", 0, where)
        segs = ((content_key("unique", ns, idx), prompt),)
        items.append((t, f"{ns}:{idx}", segs, out))
    return _finish(items, 10**9)


def _to_int(text: str, name: str, where: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise TraceFormatError(f"{where}: {name} must be an integer, got {text.strip()!r}") from None


# ---- Mooncake -------------------------------------------------------------------------------------


def mooncake_segments(input_length: int, hash_ids: list[int], namespace: str, index: int,
                      block: int = MOONCAKE_BLOCK) -> tuple[tuple[int, int], ...]:
    """Segments of one Mooncake prompt: one per hash id (``block`` tokens, the last shorter).

    Given fewer ids than ``ceil(input_length / block)`` (a caller building requests itself; the
    file loaders refuse such a line), the tokens past the last id are a segment of content unique
    to this request (``index``), so they never hit.
    Example: 1100 tokens, ids [0, 7, 9] -> ((k0, 512), (k7, 512), (k9, 76)).
    """
    covered = min(input_length, block * len(hash_ids))
    segs = []
    for i, hid in enumerate(hash_ids):
        segs.append((content_key("mooncake", namespace, hid), min(block, covered - i * block)))
    if covered < input_length:
        segs.append((content_key("unique", namespace, index), input_length - covered))
    return tuple(segs)


def _mooncake_record(line: str, where: str, block: int) -> tuple[int | float, int, int, list[int]]:
    """Validate one JSON line: ``(timestamp in ms, input_length, output_length, hash_ids)``."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(rec, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in rec]
    if missing:
        raise TraceFormatError(f"{where}: missing field(s) {', '.join(missing)}")
    ts = rec["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise TraceFormatError(f"{where}: timestamp must be a number of ms >= 0, got {ts!r}")
    n_in = _int_field(rec["input_length"], "input_length", 1, where)
    n_out = _int_field(rec["output_length"], "output_length", 0, where)
    ids = rec["hash_ids"]
    if not isinstance(ids, list):
        raise TraceFormatError(f"{where}: hash_ids must be a list, got {type(ids).__name__}")
    ids = [_int_field(h, "hash_ids[]", 0, where, hi=None) for h in ids]
    if any(h >= 1 << 32 for h in ids):
        raise TraceFormatError(f"{where}: hash_ids must be < 2**32")
    want = -(-n_in // block)
    if len(ids) != want:
        # Fewer would leave the prompt's tail without content ids (a truncated line, a trace of
        # another block size): its tokens could never hit and the hit rate would be understated
        # without a word.
        raise TraceFormatError(f"{where}: {len(ids)} hash_ids for {n_in} tokens; a Mooncake trace gives "
                               f"one per {block}-token block: ceil({n_in}/{block}) = {want}")
    return ts, n_in, n_out, ids


def load_mooncake_jsonl(path: str | Path, *, limit: int | None = None, start: int = 0,
                        namespace: str | None = None, block: int = MOONCAKE_BLOCK) -> list[Request]:
    """Requests of a Mooncake trace (one JSON object a line), hash ids expanded into segments.

    ``namespace`` (default: the file's stem) keeps this trace's ids apart from another trace's
    id 0. ``start``/``limit`` select records (blank lines are not records). Example first line of
    the conversation trace: 6758 tokens, 14 ids -> 13 segments of 512 and one of 102.
    """
    _check_slice(start, limit)
    block = int_at_least("block", block, 1, expected="a positive int")
    p = _open(path)
    ns = namespace if namespace is not None else trace_stem(p)
    items = []
    for idx, lineno, line in _records(p, start, limit, skip_header=False):
        t, n_in, n_out, ids = _mooncake_record(line, f"{p}:{lineno}", block)
        segs = mooncake_segments(n_in, ids, ns, idx, block)
        items.append((t, f"{ns}:{idx}", segs, n_out))
    return _finish(items, 1000)


def mooncake_hash_ids(path: str | Path, *, limit: int | None = None, start: int = 0) -> list[tuple[int, list[int]]]:
    """``(input_length, hash_ids)`` per record, validated: the raw structure for independent checks."""
    _check_slice(start, limit)
    p = _open(path)
    out = []
    for _, lineno, line in _records(p, start, limit, skip_header=False):
        _, n_in, _, ids = _mooncake_record(line, f"{p}:{lineno}", MOONCAKE_BLOCK)
        out.append((n_in, ids))
    return out


def trace_lengths(path: str | Path) -> tuple[list[int], list[int]]:
    """``(prompt lengths, output lengths)`` of every request of an Azure CSV or Mooncake JSONL
    trace, in file order, validated like the loaders but without building requests (no content
    keys, no hash ids): what a length statistic needs, at a fraction of a full load's cost."""
    p = _open(path)
    if detect_format(p) == "azure":
        reqs = load_azure_csv(p)
        return [r.prompt_len for r in reqs], [r.output_len for r in reqs]
    prompts, outputs = [], []
    for _, lineno, line in _records(p, 0, None, skip_header=False):
        where = f"{p}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict) or "input_length" not in rec or "output_length" not in rec:
            raise TraceFormatError(f"{where}: expected a JSON object with input_length and output_length")
        prompts.append(_int_field(rec["input_length"], "input_length", 1, where))
        outputs.append(_int_field(rec["output_length"], "output_length", 0, where))
    return prompts, outputs


# ---- format detection -----------------------------------------------------------------------------


def detect_format(path: str | Path) -> str:
    """``"azure"`` or ``"mooncake"``, from the extension (.csv, .jsonl/.json, each optionally
    followed by .gz) or else the content."""
    p = _open(path)
    ext = Path(p.name.lower().removesuffix(".gz")).suffix
    if ext == ".csv":
        return "azure"
    if ext in (".jsonl", ".json"):
        return "mooncake"
    with _text(p) as f:
        first = next((line for line in f if line.strip()), "")
    if first.lstrip().startswith("{"):
        return "mooncake"
    if "ContextTokens" in first:
        return "azure"
    raise TraceFormatError(f"{p}: cannot tell the trace format (expected an Azure CSV header "
                           f"{','.join(_AZURE_COLUMNS)} or Mooncake JSON lines)")


def load_trace(path: str | Path, *, limit: int | None = None, start: int = 0) -> list[Request]:
    """Load an Azure CSV or a Mooncake JSONL trace, whichever ``path`` is."""
    fmt = detect_format(path)
    if fmt == "azure":
        return load_azure_csv(path, limit=limit, start=start)
    return load_mooncake_jsonl(path, limit=limit, start=start)
