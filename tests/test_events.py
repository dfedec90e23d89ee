"""KV events on vLLM's wire format: golden bytes, round trips, a router's index, real sockets.

The golden bytes in ``data/vllm_kv_events_golden.json`` were made with vLLM 0.33.0 itself: the
wheel downloaded without dependencies (``pip download vllm==0.33.0 --no-deps``) and unzipped;
``vllm/distributed/kv_events.py`` loaded with the modules it imports (``vllm.config.kv_events``,
``vllm.logger``, ``vllm.utils.network_utils``, ``vllm.v1.core.kv_cache_utils``) stubbed in
``sys.modules``; each case built from vLLM's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` in a ``KVEventBatch`` and encoded with ``msgspec.msgpack.Encoder`` (msgspec
0.23.0), as vLLM's ``ZmqEventPublisher`` encodes. Digests became u64 through vLLM's own
``maybe_convert_block_hash`` (``vllm/v1/core/kv_cache_utils.py``, int hashes switched on, its
default); Python-int hashes, which vLLM never has, through pagedkv's rule ``h & (2**64 - 1)``.
The inputs are real pagedkv sha256 and xxh3-128 chained digests of tokens 1000..1063 (four
16-token blocks, unsalted). Every stored or removed event of the encoded cases is tagged as
vLLM tags a one-group model's: its ``BlockPool`` sets ``group_idx=0`` on both kinds, and
``KVCacheManager.take_events`` (``vllm/v1/core/kv_cache_manager.py``) adds
``kv_cache_spec_kind="full_attention"`` and ``kv_cache_spec_sliding_window=None`` to each
``BlockStored`` (a default, so left out of the bytes). Two cases (``decode_only``) hold what
vLLM sends and pagedkv never does: ``lora_id``, ``session_id``, and raw-bytes hashes. Only the
bytes and their inputs are committed, never vLLM's code or the script that loaded it.

The two ``keyed_*`` cases hold blocks with extra keys: a LoRA request salted
``"tenant-a"`` with two images (a prompt run and a decode-filled block), and a salted prompt next
to one whose image spans exactly block 1. Their hashes, tokens and LoRA names are a real pagedkv
manager's; each block's ``extra_keys`` entry is what vLLM 0.33's own
``generate_block_hash_extra_keys`` gives for the same request (loaded from the same wheel's
``vllm/v1/core/kv_cache_utils.py``, with a stand-in request carrying ``mm_features``,
``lora_request`` and ``cache_salt``), turned into the published form by its own
``to_event_extra_keys``; the events were built as vLLM's ``BlockPool`` builds them
(``lora_id=None``: pagedkv has no adapter ids) and encoded as above.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

import pagedkv  # noqa: E402
from pagedkv import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheManager  # noqa: E402
from pagedkv.events import (  # noqa: E402
    KVEventPublisher,
    KVEventSubscriber,
    decode_vllm,
    default_roots,
    encode_vllm,
    hash_to_u64,
    offset_endpoint,
    root_hashes,
)
from pagedkv.hashing import BlockHasher, token_bytes  # noqa: E402

GOLDEN = json.loads((Path(__file__).parent / "data" / "vllm_kv_events_golden.json").read_text())
CASES = {c["name"]: c for c in GOLDEN["cases"]}
ENCODED_CASES = [n for n, c in CASES.items() if not c.get("decode_only")]
LOCAL = "tcp://127.0.0.1:*"  # the OS picks a free port; the publisher reads it back
STORED_KEYS = [
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"
]
GROUP_KEYS = ["group_idx", "kv_cache_spec_kind"]  # a one-group model's tags (no window: left out)
TAG_FIELDS = ("group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")


class CPUStored(BlockStored):
    """A BlockStored with a ``medium``, as the manager's events will carry for a host tier."""

    __slots__ = ()
    medium = "CPU"


class CPURemoved(BlockRemoved):
    __slots__ = ()
    medium = "CPU"


class GPURemoved(BlockRemoved):
    __slots__ = ()
    medium = "GPU"


def _hash(j):
    if j is None:
        return None
    return bytes.fromhex(j["bytes"]) if "bytes" in j else j["int"]


def _event(spec):
    """The pagedkv event a golden case's input describes."""
    kind = spec["type"]
    if kind == "BlockStored":
        cls = {None: BlockStored, "CPU": CPUStored}[spec.get("medium")]
        hashes = tuple(_hash(h) for h in spec["block_hashes"])
        ev = cls(hashes, _hash(spec["parent_block_hash"]), tuple(spec["token_ids"]), spec["block_size"])
        if spec.get("extra_keys") is not None:  # JSON lists back to the tuples pagedkv emits
            extra = tuple(None if e is None else tuple(tuple(k) if isinstance(k, list) else k for k in e)
                          for e in spec["extra_keys"])
            ev = ev._replace(lora_name=spec.get("lora_name"), extra_keys=extra)
        return ev._replace(**{k: spec[k] for k in TAG_FIELDS if k in spec})
    if kind == "BlockRemoved":
        cls = {None: BlockRemoved, "CPU": CPURemoved, "GPU": GPURemoved}[spec.get("medium")]
        return cls(tuple(_hash(h) for h in spec["block_hashes"]))._replace(group_idx=spec.get("group_idx"))
    return AllBlocksCleared()


def _golden_events(name):
    return [_event(e) for e in CASES[name]["events"]]


def _golden_bytes(name):
    return bytes.fromhex(CASES[name]["hex"])


# ---------------------------------------------------------------- optional extra, lazily


def _run(code: str) -> subprocess.CompletedProcess:
    src = str(Path(pagedkv.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=src)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_import_pagedkv_loads_neither_msgspec_nor_zmq():
    r = _run(
        "import sys, pagedkv, pagedkv.events\n"
        "print(sorted(m for m in ('msgspec', 'zmq') if m in sys.modules))\n"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_missing_extra_is_a_clear_import_error():
    r = _run(
        "import sys\n"
        "sys.modules['msgspec'] = None; sys.modules['zmq'] = None\n"
        "from pagedkv.events import encode_vllm, KVEventPublisher\n"
        "for call in (lambda: encode_vllm([], 0.0), lambda: KVEventPublisher('tcp://127.0.0.1:*')):\n"
        "    try:\n"
        "        call()\n"
        "    except ImportError as exc:\n"
        "        print(exc)\n"
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2
    assert "msgspec" in lines[0] and "pyzmq" in lines[1]
    assert all('pip install "pagedkv[events]"' in line for line in lines)


# ---------------------------------------------------------------- hashes to u64


@pytest.mark.parametrize("row", GOLDEN["hash_to_u64"], ids=lambda r: f"{r['algo']}-{r['digest'][:8]}")
def test_digest_to_u64_matches_vllms_conversion(row):
    assert hash_to_u64(bytes.fromhex(row["digest"])) == row["u64"]


def test_digest_to_u64_is_the_last_eight_bytes_big_endian():
    digest = hashlib.sha256(b"pagedkv").digest()
    assert hash_to_u64(digest) == int.from_bytes(digest, "big") % 2**64 == int.from_bytes(digest[24:], "big")
    assert hash_to_u64(bytearray(digest)) == hash_to_u64(memoryview(digest)) == hash_to_u64(digest)


@pytest.mark.parametrize(
    "value, expected",
    [(0, 0), (42, 42), (-1, 2**64 - 1), (-(2**63), 2**63), (2**63 - 1, 2**63 - 1), (2**64 + 5, 5)],
)
def test_int_hash_to_u64_is_twos_complement_low_bits(value, expected):
    assert hash_to_u64(value) == expected


def test_int_hash_to_u64_accepts_numpy_ints():
    np = pytest.importorskip("numpy")
    assert hash_to_u64(np.int64(-2)) == 2**64 - 2


@pytest.mark.parametrize("bad", ["abc", 1.5, None, True, (1, 2), [3]])
def test_hash_to_u64_rejects_what_is_not_a_hash(bad):
    with pytest.raises(ValueError, match="block hash must be bytes or an int"):
        hash_to_u64(bad)


# ---------------------------------------------------------------- golden bytes


@pytest.mark.parametrize("name", ENCODED_CASES)
def test_encoder_matches_vllm_byte_for_byte(name):
    case = CASES[name]
    got = encode_vllm(_golden_events(name), case["timestamp"], case["data_parallel_rank"])
    assert got == _golden_bytes(name)


def test_golden_cases_cover_what_the_brief_names():
    kinds = {e["type"] for c in GOLDEN["cases"] for e in c["events"]}
    ranks = {c["data_parallel_rank"] for n, c in CASES.items() if n in ENCODED_CASES}
    stored = [e for c in GOLDEN["cases"] for e in c["events"] if e["type"] == "BlockStored"]
    parents = {e["parent_block_hash"] is None for e in stored}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert {None, 0} <= ranks and parents == {True, False}
    assert max(len(c["events"]) for c in GOLDEN["cases"]) >= 5


def test_batch_and_event_layout_as_vllm_decodes_it():
    """Independent of the golden bytes: a positional batch, maps keyed in vLLM's order, nils kept."""
    raw = msgspec.msgpack.decode(_golden_bytes("mixed_xxh3_dp3"))
    ts, events, rank = raw
    assert (ts, rank) == (CASES["mixed_xxh3_dp3"]["timestamp"], 3)
    assert [list(e) for e in events if e["type"] == "BlockStored"] == [STORED_KEYS + GROUP_KEYS] * 3
    assert [list(e) for e in events if e["type"] == "BlockRemoved"] == [["type", "block_hashes", "medium", "group_idx"]] * 2
    assert {(e["group_idx"], e.get("kv_cache_spec_kind")) for e in events if "block_hashes" in e} == {
        (0, "full_attention"), (0, None)}
    assert [e for e in events if e["type"] == "AllBlocksCleared"] == [{"type": "AllBlocksCleared"}]
    assert msgspec.msgpack.decode(_golden_bytes("empty_batch"))[2] is None


def test_first_block_of_a_prompt_goes_out_with_a_null_parent():
    """pagedkv chains a prompt's first block from the algorithm's root; vLLM sends a null parent
    there, and Dynamo drops a stored event whose parent it never saw. A salt is a key of block 0,
    not a root of its own, so a salted prompt's first block needs no ``roots`` argument either."""
    [ev] = _golden_events("stored_no_parent_sha256")
    case = CASES["stored_no_parent_sha256"]
    golden = _golden_bytes("stored_no_parent_sha256")
    root = BlockHasher("sha256").root(None)
    assert root in default_roots()
    assert encode_vllm([ev._replace(parent_block_hash=root)], case["timestamp"]) == golden
    assert BlockHasher("sha256").root("tenant-a") == root
    assert root_hashes("sha256", ["tenant-a", b"b", None]) == {root}
    stranger = hashlib.sha256(b"a hash no event announced").digest()
    as_child = [ev._replace(parent_block_hash=stranger)]
    assert encode_vllm(as_child, case["timestamp"]) != golden  # an unknown hash is just a parent
    assert encode_vllm(as_child, case["timestamp"], roots=default_roots() | {stranger}) == golden
    assert encode_vllm([ev._replace(parent_block_hash=root)], case["timestamp"], roots=()) != golden
    with pytest.raises(ValueError, match="cache_salt"):
        root_hashes("sha256", [3])


def test_a_salted_prompts_first_block_has_a_nil_parent_on_the_wire():
    """A salted prompt's first BlockStored goes out with a nil parent and the salt in its first
    block's extra keys, as vLLM 0.33 sends it: a salt-derived root would be a parent no event
    ever announced, and a router that drops orphans (Dynamo) would lose the whole prompt."""
    m = KVCacheManager(num_blocks=16, block_size=4)
    m.add_sequence("s", list(range(100, 109)), cache_salt="tenant-a")
    _, [wire], _ = decode_vllm(encode_vllm(m.take_events(), 1.0))
    assert wire.parent_block_hash is None
    assert wire.extra_keys == [("tenant-a",), None] and wire.lora_name is None


@pytest.mark.parametrize("algo", ["xxh3", "builtin"])
def test_default_roots_cover_every_algorithm(algo):
    if algo == "xxh3":
        pytest.importorskip("xxhash")
    assert BlockHasher(algo).root(None) in default_roots()


# ---------------------------------------------------------------- vLLM's own decoder structure
# vLLM 0.33.0's KV event structs (vllm/distributed/kv_events.py of the 0.33.0 wheel), restated
# here field by field: tagged maps with omitted defaults, a positional batch. Decoding pagedkv's
# bytes with these is what a vLLM-based consumer does.

ExternalBlockHash = bytes | int


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


def _vllm_decode(payload):
    return msgspec.msgpack.Decoder(VllmKVEventBatch).decode(payload)


def test_keyed_events_decode_with_vllms_structs_to_what_vllm_sends():
    """A LoRA request with an image and a salt, prefilled, then decoding past a block,
    then a host offload: each BlockStored decodes with vLLM's own structure to the fields vLLM
    0.33 sends for that request: nil parent for the first block, ``lora_name`` on every event,
    one ``extra_keys`` entry per block (the LoRA name; ``[mm_hash, offset]`` for each block the
    image's span 6..25 touches, offset relative to the block's start; the salt in block 0)."""
    m = KVCacheManager(num_blocks=6, block_size=8, host_blocks=8)
    prompt = list(range(100, 132))  # 4 blocks of 8
    m.add_sequence("r", prompt, cache_salt="tenant-a", lora_name="sql", mm_features=[("img-1", 6, 20)])
    for t in range(8):
        m.append_token("r", 500 + t)  # fills block 4: generated, keyed by the adapter alone
    m.free("r")
    m.add_sequence("evict", list(range(900, 945)))  # takes every block: r's 5 go to the host
    m.take_transfers()
    payload = encode_vllm(m.take_events(), 5.0, 2)
    batch = _vllm_decode(payload)
    assert batch.data_parallel_rank == 2
    stored = [e for e in batch.events if isinstance(e, VllmBlockStored) and e.lora_name is not None]
    gpu = [e for e in stored if e.medium == "GPU"]
    cpu = [e for e in stored if e.medium == "CPU"]
    want = [("sql", ["img-1", 6], "tenant-a"), ("sql", ["img-1", -2]), ("sql", ["img-1", -10]),
            ("sql", ["img-1", -18]), ("sql",)]
    assert [len(e.block_hashes) for e in gpu] == [4, 1]
    assert gpu[0].parent_block_hash is None and gpu[1].parent_block_hash == gpu[0].block_hashes[-1]
    assert [k for e in gpu for k in e.extra_keys] == want
    assert {(e.lora_id, e.lora_name, e.block_size, e.group_idx, e.kv_cache_spec_kind) for e in stored} == {
        (None, "sql", 8, 0, "full_attention")}
    assert [e.token_ids for e in gpu] == [prompt, list(range(500, 508))]
    # the host republishes them, parents first, keys and all: one chained run
    assert [h for e in cpu for h in e.block_hashes] == [h for e in gpu for h in e.block_hashes]
    assert [k for e in cpu for k in e.extra_keys] == want and cpu[0].parent_block_hash is None
    # pagedkv's own decoder agrees with vLLM's on every field
    _, ours, _ = decode_vllm(payload)
    assert [msgspec.structs.asdict(e) for e in ours] == [msgspec.structs.asdict(e) for e in batch.events]


def test_plain_events_leave_extra_keys_out_as_the_golden_bytes_do():
    """A request without extra keys: no ``lora_name``, no ``extra_keys`` on the wire (vLLM 0.33
    sends a list of nils there; both read as 'no block has keys')."""
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("p", list(range(9)))
    payload = encode_vllm(m.take_events(), 1.0)
    [ev] = _vllm_decode(payload).events
    assert (ev.lora_name, ev.extra_keys, ev.parent_block_hash) == (None, None, None)
    [raw] = msgspec.msgpack.decode(payload)[1]
    assert list(raw) == STORED_KEYS + GROUP_KEYS


def _wire_hash(h):
    return None if h is None else hash_to_u64(h)


def _vllm_struct(ev, group_idx=None, kind=None, window=None):
    """``ev`` as vLLM 0.33 builds it (``BlockPool``: ``lora_id`` None, pagedkv having no adapter
    ids; a prompt's root parent nil), tagged with the given group, spec kind and window the way
    ``KVCacheManager.take_events`` annotates a ``BlockStored``."""
    if isinstance(ev, AllBlocksCleared):
        return VllmAllBlocksCleared()
    hashes = [hash_to_u64(h) for h in ev.block_hashes]
    if isinstance(ev, BlockRemoved):
        return VllmBlockRemoved(hashes, ev.medium, group_idx=group_idx)
    parent = None if ev.parent_block_hash in default_roots() else _wire_hash(ev.parent_block_hash)
    extra = None if ev.extra_keys is None else list(ev.extra_keys)
    return VllmBlockStored(hashes, parent, list(ev.token_ids), ev.block_size, None, ev.medium, ev.lora_name,
                           extra_keys=extra, group_idx=group_idx, kv_cache_spec_kind=kind,
                           kv_cache_spec_sliding_window=window)


def _vllm_bytes(structs, ts, rank=None):
    return msgspec.msgpack.Encoder().encode(VllmKVEventBatch(ts, structs, rank))


@pytest.mark.parametrize("name", ENCODED_CASES)
def test_vllms_structs_encode_to_the_golden_bytes(name):
    """The structs above, filled from a case's inputs as vLLM fills them for a one-group model
    (group 0, "full_attention", no window), encode to the bytes vLLM's own module gave."""
    case = CASES[name]
    structs = [_vllm_struct(ev, *(() if isinstance(ev, AllBlocksCleared) else (0, "full_attention", None)))
               for ev in _golden_events(name)]
    assert _vllm_bytes(structs, case["timestamp"], case["data_parallel_rank"]) == _golden_bytes(name)


def test_a_plain_managers_events_are_vllms_one_group_events_on_the_wire():
    """A plain manager with a host tier, prefilling, decoding, evicting and offloading: its bytes
    are exactly vLLM's structs tagged group 0, "full_attention", no window, on both media."""
    m = KVCacheManager(num_blocks=6, block_size=4, host_blocks=6)
    m.add_sequence("a", list(range(100, 110)))
    for t in range(4):
        m.append_token("a", 200 + t)  # fills block 2 on the decode path
    m.free("a")
    m.add_sequence("b", list(range(300, 320)))  # evicts a's blocks: they go to the host
    m.take_transfers()
    m.free("b")
    assert m.reset_prefix_cache()
    events = m.take_events()
    tags = (0, "full_attention", None)
    want = _vllm_bytes([_vllm_struct(ev, *(() if isinstance(ev, AllBlocksCleared) else tags)) for ev in events], 7.0, 1)
    payload = encode_vllm(events, 7.0, 1)
    assert payload == want
    decoded = _vllm_decode(payload).events
    media = {(type(e).__name__, e.medium, e.group_idx) for e in decoded if not isinstance(e, VllmAllBlocksCleared)}
    assert media == {("VllmBlockStored", "GPU", 0), ("VllmBlockRemoved", "GPU", 0), ("VllmBlockStored", "CPU", 0)}
    assert {(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in decoded
            if isinstance(e, VllmBlockStored)} == {("full_attention", None)}
    assert isinstance(decoded[-1], VllmAllBlocksCleared)


def test_group_tags_cost_45_bytes_a_stored_event_and_11_a_removal():
    """What docs/design.md section 2.7 states: "group_idx" 0 and "kv_cache_spec_kind"
    "full_attention" on each BlockStored, "group_idx" 0 on each BlockRemoved, nothing else."""
    stored = BlockStored((1, 2), None, tuple(range(8)), 4, "GPU", None, None, 0, "full_attention", None)
    removed = BlockRemoved((1, 2), "GPU", 0)
    size = [len(encode_vllm([ev], 1.0)) for ev in (stored, removed)]
    bare = [len(encode_vllm([ev._replace(**{k: None for k in TAG_FIELDS if k in ev._fields})], 1.0))
            for ev in (stored, removed)]
    assert [a - b for a, b in zip(size, bare)] == [45, 11]

def test_a_hybrid_managers_events_name_each_group_on_the_wire():
    """A grouped manager tags each event with its own group: the sliding group's stored blocks
    carry its window (8), which a one-group model's bytes leave out."""
    from pagedkv import FullAttention, SlidingWindow

    groups = (FullAttention(), SlidingWindow(8))
    m = KVCacheManager(num_blocks=20, block_size=4, groups=list(groups))
    m.add_sequence("a", list(range(100, 117)))
    m.free("a")
    m.add_sequence("b", list(range(300, 333)))  # evicts a's cached blocks
    events = m.take_events()
    structs = []
    for ev in events:
        spec = groups[ev.group_idx]
        structs.append(_vllm_struct(ev, ev.group_idx, spec.kind, spec.sliding_window))
    assert encode_vllm(events, 3.0) == _vllm_bytes(structs, 3.0)
    assert {(type(e).__name__, e.group_idx) for e in events} == {
        ("BlockStored", 0), ("BlockStored", 1), ("BlockRemoved", 0), ("BlockRemoved", 1)}
    stored = [e for e in _vllm_decode(encode_vllm(events, 3.0)).events if isinstance(e, VllmBlockStored)]
    assert {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored} == {
        (0, "full_attention", None), (1, "sliding_window", 8)}


@pytest.mark.parametrize(
    "extra, match",
    [
        ("sql", "extra_keys must be None or one entry per block"),
        ((("sql",),), "1 entries for 2 blocks"),
        ((("sql",), "sql"), "each extra_keys entry must be None or a tuple"),
    ],
)
def test_encode_rejects_malformed_extra_keys(extra, match):
    ev = BlockStored((1, 2), None, tuple(range(8)), 4, "GPU", "sql", extra)
    with pytest.raises(ValueError, match=match):
        encode_vllm([ev], 1.0)
    with pytest.raises(ValueError, match="lora_name must be None or a str"):
        encode_vllm([BlockStored((1,), None, (1, 2, 3, 4), 4, "GPU", 7)], 1.0)


# ---------------------------------------------------------------- decoding


def _expected(spec):
    """What decoding must give for one input event: u64 hashes, medium GPU unless told."""
    out = {"type": spec["type"]}
    if spec["type"] == "AllBlocksCleared":
        return out
    out["block_hashes"] = [hash_to_u64(_hash(h)) for h in spec["block_hashes"]]
    out["medium"] = spec.get("medium", "GPU")
    if spec["type"] == "BlockStored":
        parent = _hash(spec["parent_block_hash"])
        out["parent_block_hash"] = None if parent is None else hash_to_u64(parent)
        out["token_ids"] = spec["token_ids"]
        out["block_size"] = spec["block_size"]
        out["lora_id"] = spec.get("lora_id")
        out["lora_name"] = spec.get("lora_name")
        if "extra_keys" in spec:  # decoded: each entry a tuple, an (mm_hash, offset) pair a list
            extra = spec["extra_keys"]
            out["extra_keys"] = None if extra is None else [None if e is None else tuple(e) for e in extra]
    out.update({k: spec[k] for k in TAG_FIELDS if k in spec})
    return out


def _as_dict(ev, spec):
    d = {"type": type(ev).__name__.removeprefix("Wire")}
    d.update({k: getattr(ev, k) for k in ev.__struct_fields__ if k in STORED_KEYS})
    if "extra_keys" in spec:
        d["extra_keys"] = ev.extra_keys
    d.update({k: getattr(ev, k) for k in TAG_FIELDS if k in spec})
    return d


@pytest.mark.parametrize("name", list(CASES))
def test_decode_gives_back_the_events_with_u64_hashes(name):
    case = CASES[name]
    ts, events, rank = decode_vllm(_golden_bytes(name))
    assert ts == case["timestamp"] and rank == case["data_parallel_rank"]
    assert [_as_dict(e, s) for e, s in zip(events, case["events"], strict=True)] == [_expected(s) for s in case["events"]]


def test_decode_keeps_the_fields_vllm_adds():
    _, [stored, removed], _ = decode_vllm(_golden_bytes("vllm_lora_group_extra"))
    assert (stored.group_idx, stored.session_id, stored.extra_keys) == (0, "s1", [("sql-adapter",), None])
    assert removed.group_idx == 0 and stored.lookahead_token_ids is None


@pytest.mark.parametrize("name", [n for n in CASES if n != "vllm_bytes_hashes"])
def test_decoded_events_reencode_to_the_same_bytes(name):
    """A relay (decode, then publish again) changes nothing, vLLM's own extra fields included."""
    ts, events, rank = decode_vllm(_golden_bytes(name))
    assert encode_vllm(events, ts, rank) == _golden_bytes(name)


_hashes = st.one_of(
    st.binary(min_size=32, max_size=32), st.binary(min_size=16, max_size=16), st.integers(-(2**63), 2**63 - 1)
)


@st.composite
def _events(draw):
    kind = draw(st.sampled_from(["stored", "stored", "removed", "cleared"]))
    if kind == "cleared":
        return AllBlocksCleared()
    hashes = tuple(draw(st.lists(_hashes, min_size=1, max_size=4)))
    if kind == "removed":
        return BlockRemoved(hashes)
    bs = draw(st.integers(1, 8))
    n = bs * len(hashes)
    tokens = tuple(draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n)))
    return BlockStored(hashes, draw(st.one_of(st.none(), _hashes)), tokens, bs)


@given(
    events=st.lists(_events(), max_size=6),
    ts=st.floats(0, 4e9, allow_nan=False),
    rank=st.one_of(st.none(), st.integers(0, 1024)),
)
def test_encode_decode_round_trip(events, ts, rank):
    roots = frozenset()  # every parent is sent as given
    got_ts, decoded, got_rank = decode_vllm(encode_vllm(events, ts, rank, roots=roots))
    assert (got_ts, got_rank) == (ts, rank)
    assert len(decoded) == len(events)
    for ev, wire in zip(events, decoded):
        assert type(wire).__name__ == "Wire" + type(ev).__name__
        if isinstance(ev, AllBlocksCleared):
            continue
        assert wire.block_hashes == [hash_to_u64(h) for h in ev.block_hashes]
        assert all(0 <= h < 2**64 for h in wire.block_hashes)
        assert wire.medium == "GPU"
        if isinstance(ev, BlockStored):
            parent = ev.parent_block_hash
            assert wire.parent_block_hash == (None if parent is None else hash_to_u64(parent))
            assert wire.token_ids == list(ev.token_ids) and wire.block_size == ev.block_size


def test_encode_accepts_numpy_and_array_token_ids():
    np = pytest.importorskip("numpy")
    from array import array

    [ev] = _golden_events("stored_no_parent_sha256")
    golden = _golden_bytes("stored_no_parent_sha256")
    ts = CASES["stored_no_parent_sha256"]["timestamp"]
    for tokens in (np.asarray(ev.token_ids, dtype=np.int64), array("I", ev.token_ids), list(ev.token_ids)):
        assert encode_vllm([ev._replace(token_ids=tokens)], ts) == golden


# ---------------------------------------------------------------- bad input


def _stored():
    return _golden_events("stored_no_parent_sha256")[0]


@pytest.mark.parametrize(
    "events, match",
    [
        (_stored(), "a list of events, got a single BlockStored"),
        (AllBlocksCleared(), "a list of events, got a single AllBlocksCleared"),
        (42, "iterable of events"),
        ([("a", "b")], "not a KV event"),
        ([{"type": "BlockStored"}], "not a KV event"),
        ([_stored()._replace(token_ids=(1, 2, 3))], "needs 32 token ids, got 3"),
        ([_stored()._replace(token_ids=tuple(range(-1, 31)))], "token_ids must be integers"),
        ([_stored()._replace(token_ids=(1.5,) * 32)], "token_ids must be integers"),
        ([_stored()._replace(block_size=0)], "block_size must be a positive int"),
        ([_stored()._replace(block_size=True)], "block_size must be a positive int"),
        ([_stored()._replace(block_hashes=("abc",))], "block hash must be bytes or an int"),
        ([_stored()._replace(block_hashes=5)], "block_hashes must be a sequence"),
        ([BlockRemoved(b"\x01" * 32)], "block_hashes must be a sequence of hashes, got bytes"),
        ([_stored()._replace(token_ids=bytes(128))], "token_ids must be a sequence of ints, got bytes"),
        ([_stored()._replace(parent_block_hash=[1])], "parent_block_hash must be"),
        ([_stored()._replace(parent_block_hash=2.5)], "block hash must be bytes or an int"),
        ([BlockRemoved((None,))], "block hash must be bytes or an int"),
    ],
)
def test_encode_rejects_malformed_events(events, match):
    with pytest.raises(ValueError, match=match):
        encode_vllm(events, 1.0)


def test_encode_rejects_a_bad_medium():
    class Odd(BlockRemoved):
        __slots__ = ()
        medium = 7

    with pytest.raises(ValueError, match="medium must be a str"):
        encode_vllm([Odd((b"x" * 32,))], 1.0)


@pytest.mark.parametrize("ts", [float("nan"), math.inf, "now", None, True])
def test_encode_rejects_a_bad_timestamp(ts):
    with pytest.raises(ValueError, match="timestamp must be a finite number"):
        encode_vllm([], ts)


@pytest.mark.parametrize("rank", [-1, True, 1.0, "0"])
def test_encode_rejects_a_bad_rank(rank):
    with pytest.raises(ValueError, match="data_parallel_rank must be None or an int >= 0"):
        encode_vllm([], 1.0, rank)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never used in msgpack
        msgspec.msgpack.encode({"ts": 1.0}),
        msgspec.msgpack.encode([1.0, [{"type": "BlockGone", "block_hashes": [1]}], None]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [-1], "medium": "GPU"}], None]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}], None]),  # fields missing
        msgspec.msgpack.encode(["yesterday", [], None]),
    ],
)
def test_decode_rejects_what_is_not_a_batch(payload):
    with pytest.raises(ValueError, match="not a vLLM KV event batch"):
        decode_vllm(payload)


def test_decode_rejects_a_non_bytes_payload():
    with pytest.raises(ValueError, match="payload must be bytes"):
        decode_vllm("93cb")


# ---------------------------------------------------------------- from a real manager


def _prompt_u64s(algo, prompt, bs):
    hasher = BlockHasher(algo)
    n = len(prompt) // bs
    return [hash_to_u64(h) for h in hasher.chain(hasher.root(None), token_bytes(prompt), 4 * bs, n)]


class RouterIndex:
    """What a precise prefix router keeps for one replica, fed only by decoded events.

    Like Dynamo's radix tree it refuses a stored event whose parent it does not know; the test
    counts refusals, which must be zero.
    """

    def __init__(self):
        self.cached: set[int] = set()
        self.unknown_parents = 0
        self.unknown_removals = 0

    def apply(self, payload):
        _, events, _ = decode_vllm(payload)
        for ev in events:
            kind = type(ev).__name__
            if kind == "WireBlockStored":
                if ev.parent_block_hash is not None and ev.parent_block_hash not in self.cached:
                    self.unknown_parents += 1
                    continue
                self.cached.update(ev.block_hashes)
            elif kind == "WireBlockRemoved":
                self.unknown_removals += len(set(ev.block_hashes) - self.cached)
                self.cached.difference_update(ev.block_hashes)
            else:
                self.cached.clear()

    def predicted_hit(self, u64s, prompt_len, bs):
        """Tokens the replica will serve from cache: leading cached blocks, never the whole prompt."""
        k = 0
        for h in u64s[: (prompt_len - 1) // bs]:
            if h not in self.cached:
                break
            k += 1
        return k * bs


@pytest.mark.parametrize("algo", ["sha256", "xxh3", "builtin"])
def test_events_from_a_real_manager_index_exactly_what_it_caches(algo):
    if algo == "xxh3":
        pytest.importorskip("xxhash")
    bs = 4
    m = KVCacheManager(num_blocks=24, block_size=bs, hash_algo=algo)
    index = RouterIndex()
    raw_stored = raw_removed = 0
    decode_parents = 0

    def step(ts):
        nonlocal raw_stored, raw_removed, decode_parents
        events = m.take_events()
        payload = encode_vllm(events, ts)
        _, wire, _ = decode_vllm(payload)
        for ev, w in zip(events, wire, strict=True):
            if isinstance(ev, BlockStored):
                raw_stored += len(ev.block_hashes)
                assert w.block_hashes == [hash_to_u64(h) for h in ev.block_hashes]
                assert w.token_ids == list(ev.token_ids) and len(w.token_ids) == bs * len(w.block_hashes)
                if ev.parent_block_hash == BlockHasher(algo).root(None):
                    assert w.parent_block_hash is None
                else:
                    assert w.parent_block_hash == hash_to_u64(ev.parent_block_hash)
                    decode_parents += 1
            elif isinstance(ev, BlockRemoved):
                raw_removed += len(ev.block_hashes)
                assert w.block_hashes == [hash_to_u64(h) for h in ev.block_hashes]
        index.apply(payload)

    system = list(range(500, 510))  # a shared 10-token system prompt: two full blocks
    prompts = [system + [600 + 7 * i + j for j in range(3 + i % 5)] for i in range(12)]
    live = []
    hits = []
    for i, prompt in enumerate(prompts):
        u64s = _prompt_u64s(algo, prompt, bs)
        predicted = index.predicted_hit(u64s, len(prompt), bs)
        assert m.add_sequence(i, prompt) == predicted
        hits.append(predicted)
        live.append(i)
        for t in range(6):  # decode until the tail blocks fill (published on the decode path)
            for s in live:
                m.append_token(s, 900 + 13 * s + t)
            step(float(i) + t / 10)
        if len(live) > 2:  # finish the oldest request: its blocks become cached-free, then evicted
            m.free(live.pop(0))
        step(float(i) + 0.9)
    assert m.usage().evictions > 0 and raw_removed > 0 and decode_parents > 0
    assert index.unknown_parents == 0 and index.unknown_removals == 0
    # Every prompt and its decoded continuation: the router predicts the replica's hits exactly.
    for s in list(live):
        m.free(s)
    step(100.0)
    probes = prompts + [p + [900 + 13 * i + t for t in range(6)] for i, p in enumerate(prompts)]
    for j, prompt in enumerate(probes):
        predicted = index.predicted_hit(_prompt_u64s(algo, prompt, bs), len(prompt), bs)
        assert m.add_sequence(("probe", j), prompt) == predicted
        hits.append(predicted)
        m.free(("probe", j))
        step(200.0 + j)
    assert index.unknown_parents == 0
    assert len(set(hits)) >= 3  # misses, system-prompt hits and longer ones: the index is exercised
    assert m.usage().cached_blocks == len(index.cached) > 0
    assert m.reset_prefix_cache()
    step(300.0)
    assert index.cached == set()


# ---------------------------------------------------------------- on real sockets


def _events_for(i):
    """Batch ``i``'s distinct content: one stored block whose hash and tokens name ``i``."""
    digest = hashlib.sha256(i.to_bytes(4, "big")).digest()
    return [BlockStored((digest,), None, (i, i + 1), 2)]


def _check_batch(batch, i):
    assert batch.seq == i and batch.timestamp == float(i)
    [ev] = batch.events
    assert ev.block_hashes == [hash_to_u64(hashlib.sha256(i.to_bytes(4, "big")).digest())]
    assert ev.token_ids == [i, i + 1]


def _drain(sub, out, timeout=0.0):
    while (batch := sub.recv(timeout=timeout)) is not None:
        out.append(batch)


def _until_live(pub, sub, out, first, limit=2000):
    """Publish batch after batch until the subscriber receives one (its subscription is live)."""
    i = first
    while not out:
        assert i < limit, "the subscriber never received a live batch"
        assert pub.publish(_events_for(i), timestamp=float(i)) == i
        _drain(sub, out, timeout=0.01)
        i += 1
    return i


@pytest.mark.parametrize(
    "endpoint, rank, expected",
    [
        ("tcp://*:5557", None, "tcp://*:5557"),
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 3, "tcp://*:5560"),
        ("tcp://127.0.0.1:6000", 1, "tcp://127.0.0.1:6001"),
        ("tcp://[::1]:6000", 2, "tcp://[::1]:6002"),
        ("tcp://127.0.0.1:*", 4, "tcp://127.0.0.1:*"),  # the OS picks a free port per rank anyway
        ("inproc://kv", 2, "inproc://kv_dp2"),
        ("ipc:///tmp/kv", 1, "ipc:///tmp/kv_dp1"),
    ],
)
def test_offset_endpoint_as_vllms_publisher(endpoint, rank, expected):
    """vLLM's ZmqEventPublisher offsets its endpoints by the data-parallel rank, so one setting
    serves every rank; pagedkv's does the same (and suffixes ipc paths, which vLLM refuses)."""
    assert offset_endpoint(endpoint, rank) == expected


def test_publisher_binds_its_rank_offset_ports(tmp_path):
    """Rank r binds base + r, for the replay socket too, so two ranks configured alike do not
    collide on one port."""
    base = _free_port_pair()
    endpoint, replay = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 2}"
    with KVEventPublisher(endpoint, replay, data_parallel_rank=0) as r0, \
            KVEventPublisher(endpoint, replay, data_parallel_rank=1) as r1:
        assert (r0.endpoint, r0.replay_endpoint) == (endpoint, replay)
        assert (r1.endpoint, r1.replay_endpoint) == (f"tcp://127.0.0.1:{base + 1}", f"tcp://127.0.0.1:{base + 3}")
    path = tmp_path / "kv"
    with KVEventPublisher(f"ipc://{path}", data_parallel_rank=5) as pub:
        assert pub.endpoint == f"ipc://{path}_dp5"
    with pytest.raises(ValueError, match="past port 65535"):
        KVEventPublisher("tcp://127.0.0.1:65535", data_parallel_rank=1)


def _free_port_pair() -> int:
    """A port p such that p .. p + 3 are free now (as far as one can tell without holding them)."""
    import socket

    for _ in range(50):
        with socket.socket() as s0:
            s0.bind(("127.0.0.1", 0))
            base = s0.getsockname()[1]
        if base + 3 > 65535:
            continue
        ok = True
        for k in range(1, 4):
            with socket.socket() as s1:
                try:
                    s1.bind(("127.0.0.1", base + k))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    pytest.skip("no four consecutive free ports")

def test_publish_frames_as_vllm():
    """Three frames (topic, 8-byte big-endian seq, payload), read with a bare SUB socket."""
    with KVEventPublisher(LOCAL, topic="kv@r0") as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":*")
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(pub.endpoint)
        try:
            frames = None
            for i in range(2000):
                seq = pub.publish(_events_for(i), timestamp=float(i))
                assert seq == i
                if sub.poll(10):
                    frames = sub.recv_multipart()
                    break
            assert frames is not None
            topic, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big")
            assert topic == b"kv@r0" and len(seq_bytes) == 8 and seq <= i
            ts, [ev], rank = decode_vllm(payload)
            assert ts == float(seq) and rank is None and ev.token_ids == [seq, seq + 1]
        finally:
            sub.close()
            ctx.term()


def test_replay_protocol_as_vllm():
    """A bare DEALER asks from seq 3 and gets (topic, seq, payload) for 3..9, then the end marker."""
    with KVEventPublisher(LOCAL, LOCAL, topic="t", data_parallel_rank=2) as pub:
        for i in range(10):
            pub.publish(_events_for(i), timestamp=float(i))
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        try:
            dealer.send_multipart([b"", (3).to_bytes(8, "big")])
            replies = []
            while True:
                assert dealer.poll(5000), "no replay answer"
                replies.append(dealer.recv_multipart())
                if replies[-1][2] == b"\xff" * 8:
                    break
        finally:
            dealer.close()
            ctx.term()
    assert replies[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    body = replies[:-1]
    assert [int.from_bytes(r[2], "big") for r in body] == list(range(3, 10))
    assert all(r[0] == b"" and r[1] == b"t" for r in body)
    for r, i in zip(body, range(3, 10)):
        ts, [ev], rank = decode_vllm(r[3])
        assert ts == float(i) and rank == 2 and ev.token_ids == [i, i + 1]


def test_a_dropped_subscriber_misses_nothing_of_1000_batches():
    """Subscriber A takes 0..399 and closes; 400..599 go out to nobody; subscriber B reconnects
    from A's next sequence number, fills the gap by replay, then follows live to 999."""
    with KVEventPublisher(LOCAL, LOCAL, buffer_steps=1000) as pub:
        got_a: list = []
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0) as a:
            i = _until_live(pub, a, got_a, 0)
            while i < 400:
                pub.publish(_events_for(i), timestamp=float(i))
                _drain(a, got_a)
                i += 1
            a.sync()  # whatever is still in flight to A
            _drain(a, got_a)
            resume, lost_a = a.next_seq, a.lost
        assert resume == 400 and lost_a == 0
        for i in range(400, 600):
            pub.publish(_events_for(i), timestamp=float(i))
        got_b: list = []
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=resume) as b:
            i = _until_live(pub, b, got_b, 600)
            while i < 1000:
                pub.publish(_events_for(i), timestamp=float(i))
                _drain(b, got_b)
                i += 1
            b.sync()  # the tail a SUB socket may not have delivered yet
            _drain(b, got_b)
            assert b.lost == 0 and 200 <= b.replayed < 600 and b.next_seq == 1000
    got = got_a + got_b
    assert [batch.seq for batch in got] == list(range(1000))
    for batch in got:
        _check_batch(batch, batch.seq)


def test_a_subscriber_counts_what_the_buffer_no_longer_holds():
    with KVEventPublisher(LOCAL, LOCAL, buffer_steps=10) as pub:
        for i in range(25):
            pub.publish(_events_for(i), timestamp=float(i))
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, start_seq=0) as sub:
            assert sub.sync() == 10
            got: list = []
            _drain(sub, got)
            assert [b.seq for b in got] == list(range(15, 25))
            assert (sub.lost, sub.replayed, sub.next_seq) == (15, 10, 25)
            assert [b.seq for b in sub.replay(20)] == [20, 21, 22, 23, 24]
            assert sub.replay(25) == []
            assert sub.next_seq == 25  # replay() changes nothing


def test_replay_survives_a_malformed_request():
    with KVEventPublisher(LOCAL, LOCAL) as pub:
        pub.publish(_events_for(0), timestamp=0.0)
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        try:
            dealer.send_multipart([b"", b"x", b"y"])  # four frames at the ROUTER: ignored
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            assert dealer.poll(5000)
            assert int.from_bytes(dealer.recv_multipart()[2], "big") == 0
            assert dealer.poll(5000)
            assert dealer.recv_multipart()[2] == b"\xff" * 8
        finally:
            dealer.close()
            ctx.term()


def test_sockets_over_ipc(tmp_path):
    with KVEventPublisher(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay") as pub:
        assert pub.endpoint == f"ipc://{tmp_path}/pub"
        pub.publish(_events_for(0), timestamp=0.0)
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
            assert sub.sync() == 1
            _check_batch(sub.recv(timeout=0), 0)


# ---------------------------------------------------------------- sockets: bad input, shutdown


def test_an_endpoint_in_use_cannot_bind(tmp_path):
    with KVEventPublisher(LOCAL) as first:
        with pytest.raises(ValueError, match="cannot bind the KV event PUB socket to 'tcp://127.0.0.1:"):
            KVEventPublisher(first.endpoint)
    # A failed replay bind releases the PUB endpoint it had already bound.
    ipc = f"ipc://{tmp_path}/kv"
    with pytest.raises(ValueError, match="cannot bind the KV event replay socket to 'bogus'"):
        KVEventPublisher(ipc, "bogus")
    with KVEventPublisher(ipc) as again:
        assert again.endpoint == ipc


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"endpoint": "tcp://nowhere"}, "cannot bind"),
        ({"endpoint": 5557}, "endpoint must be a str"),
        ({"buffer_steps": 0}, "buffer_steps must be an int >= 1"),
        ({"buffer_steps": -5}, "buffer_steps must be an int >= 1"),
        ({"buffer_steps": 2.5}, "buffer_steps must be an int >= 1"),
        ({"buffer_steps": True}, "buffer_steps must be an int >= 1"),
        ({"hwm": -1}, "hwm must be an int >= 0"),
        ({"topic": b"kv"}, "topic must be a str"),
        ({"data_parallel_rank": -1}, "data_parallel_rank must be None or an int >= 0"),
    ],
)
def test_publisher_rejects_bad_settings(kwargs, match):
    kwargs = {"endpoint": LOCAL, **kwargs}
    with pytest.raises(ValueError, match=match):
        KVEventPublisher(**kwargs)


def test_publish_bad_events_changes_nothing_and_a_closed_publisher_refuses():
    pub = KVEventPublisher(LOCAL, LOCAL)
    try:
        assert pub.publish(_events_for(0), timestamp=0.0) == 0
        with pytest.raises(ValueError, match="not a KV event"):
            pub.publish(["nonsense"])
        assert pub.publish(_events_for(1), timestamp=1.0) == 1 and pub.next_seq == 2
    finally:
        pub.close()
    pub.close()  # twice: a no-op
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(_events_for(2))


def test_close_stops_the_replay_thread():
    import threading

    before = {t for t in threading.enumerate() if t.name == "pagedkv-kv-replay"}
    pub = KVEventPublisher(LOCAL, LOCAL)
    assert {t for t in threading.enumerate() if t.name == "pagedkv-kv-replay"} - before
    pub.close(timeout=5.0)
    assert {t for t in threading.enumerate() if t.name == "pagedkv-kv-replay"} <= before


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"endpoint": "nonsense"}, "cannot connect the KV event SUB socket"),
        ({"endpoint": None}, "endpoint must be a str"),
        ({"start_seq": -1}, "start_seq must be an int >= 0"),
        ({"replay_timeout": 0}, "replay_timeout must be a positive number"),
        ({"replay_endpoint": 5558}, "replay_endpoint must be a str or None"),
        ({"topic": None}, "topic must be a str"),
    ],
)
def test_subscriber_rejects_bad_settings(kwargs, match):
    kwargs = {"endpoint": "tcp://127.0.0.1:5557", **kwargs}
    with pytest.raises(ValueError, match=match):
        KVEventSubscriber(**kwargs)


def test_subscriber_without_replay_cannot_sync():
    with KVEventSubscriber("tcp://127.0.0.1:5557") as sub:
        with pytest.raises(RuntimeError, match="no replay endpoint"):
            sub.sync()
        assert sub.recv(timeout=0) is None


def test_replay_from_a_silent_endpoint_times_out():
    """A ROUTER that never answers: the request gives up after ``replay_timeout``, no hang."""
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(LOCAL)
    try:
        endpoint = silent.getsockopt_string(zmq.LAST_ENDPOINT)
        with KVEventSubscriber("tcp://127.0.0.1:5557", endpoint, replay_timeout=0.2) as sub:
            with pytest.raises(TimeoutError, match="no end of replay"):
                sub.sync()
    finally:
        silent.close()
        ctx.term()


def test_numpy_ints_count_as_ints_on_the_wire():
    """A rank or block size read from a numpy array is an int: the bytes are those of the Python
    int (one rule for ints everywhere, pagedkv.checks), not a ValueError or a msgspec TypeError."""
    stored = BlockStored((b"\x01" * 32,), None, tuple(range(4)), 4)
    want = encode_vllm([stored], 1.0, 3)
    assert encode_vllm([stored._replace(block_size=np.int64(4))], 1.0, np.int64(3)) == want
    assert decode_vllm(want)[2] == 3
