"""KV cache events on the wire, the codec: vLLM's msgpack format, encoded and decoded.

Why: a fleet of replicas only profits from prefix caching when a request that shares a prefix
lands on the replica that holds it. The routers fleets already run decide that from the engines'
KV events: llm-d's KV-cache manager (its precise prefix-cache scorer), NVIDIA Dynamo's KV router
and the SGLang router all subscribe to every engine's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` stream, keep an index of which replica holds which block, and send each
request where the longest prefix of its blocks lives. They speak vLLM's wire format, so speaking
it too makes a pagedkv engine routable by all of them with no adapter; pagedkv's own fleet
simulator reads the same bytes back with :func:`decode_vllm`.

The format (vLLM 0.33, ``vllm/distributed/kv_events.py``), checked byte for byte against vLLM's own
encoder in the tests:

* a batch is a msgpack *array* ``[ts, events, data_parallel_rank]`` (a float64 timestamp, the
  events, and the data-parallel rank or nil);
* each event is a msgpack *map* whose first key ``"type"`` names it. ``BlockStored`` carries
  ``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``,
  ``lora_name`` in that order, nil included (vLLM's decoder requires every one of them), then,
  for blocks of a request with extra keys (LoRA, multimodal items, salt), ``extra_keys``: one
  entry per block, nil for a block without keys, else an array of the LoRA name, one
  ``[mm_hash, offset]`` pair per multimodal item the block touches and the salt (block 0 only),
  untagged, as vLLM 0.33's ``to_event_extra_keys`` publishes them; ``lora_name`` is the adapter
  (``lora_id``, which vLLM keeps only for old consumers, stays nil: pagedkv has no adapter ids).
  A request without extra keys leaves ``extra_keys`` out, where vLLM 0.33 sends an array of nils:
  both mean "no block has extra keys" to a consumer. Last come the event's group tags, as vLLM
  0.33 tags every event: ``group_idx``, ``kv_cache_spec_kind`` and
  ``kv_cache_spec_sliding_window`` (a manager's events say group 0, ``"full_attention"``, no
  window for a uniform model; the window, nil, is left out of the bytes as vLLM leaves out every
  unset optional field). ``BlockRemoved`` carries ``block_hashes``, ``medium`` and
  ``group_idx``; ``AllBlocksCleared`` nothing;
* block hashes are unsigned 64-bit integers.

Hashes to u64 (:func:`hash_to_u64`): a bytes digest (sha256's 32 bytes, xxh3-128's 16) maps the
way vLLM maps its own sha256 block hashes for events (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on
by default): the digest read as a big-endian integer, keeping its low 64 bits, i.e. its *last
eight bytes* read big-endian. A Python-int hash (``hash_algo="builtin"``, a signed 64-bit value)
maps to its low 64 bits in two's complement, ``h & (2**64 - 1)``, so -1 becomes 2**64 - 1.
Builtin hashes differ between processes: a router can index them as opaque ids but cannot
recompute them from tokens. Truncating to 64 bits leaves a collision chance of about
n²/2**65 among n distinct blocks: one in 10**7 for two million cached blocks.

Parents: vLLM sends a null ``parent_block_hash`` for the first block of a prompt; pagedkv chains
that block from one root hash per algorithm (salted or not: the salt is a key of block 0, as in
vLLM), which no ``BlockStored`` ever announces. Dynamo's radix tree drops a stored event whose
parent it does not know, so a root parent goes on the wire as nil. Which hashes are roots is the
``roots`` argument: by default the root of each hash algorithm (:func:`default_roots`). Every other
``BlockStored`` carries its parent's u64 hash and its blocks' token ids (and extra keys), so a
router that rehashes tokens itself (llm-d and Dynamo do) can index it.

Worked example (sha256, block size 16)::

    >>> from pagedkv import KVCacheManager
    >>> from pagedkv.events import encode_vllm, decode_vllm, hash_to_u64
    >>> m = KVCacheManager(num_blocks=64, block_size=16)
    >>> _ = m.add_sequence("r1", list(range(1000, 1040)))  # 2 full blocks published, 8 tokens left
    >>> [ev] = m.take_events()                                # one BlockStored for both blocks
    >>> payload = encode_vllm([ev], timestamp=1700000000.0)
    >>> len(payload)
    280
    >>> ts, [wire], dp = decode_vllm(payload)
    >>> wire.block_hashes == [hash_to_u64(h) for h in ev.block_hashes]
    True
    >>> wire.parent_block_hash is None, len(wire.token_ids), wire.medium   # a prompt's first block
    (True, 32, 'GPU')
    >>> wire.group_idx, wire.kv_cache_spec_kind, wire.kv_cache_spec_sliding_window
    (0, 'full_attention', None)

Of those 280 bytes, the 32 token ids take 96 (3 bytes each, msgpack's uint16 form), the two
hashes 18, the field names and the strings ``"BlockStored"``, ``"GPU"`` and
``"full_attention"`` 142 (vLLM's map encoding repeats them in every event), the group index 1,
the float64 timestamp and the headers 23.


The sockets that carry these bytes are :mod:`pagedkv.events.transport`. msgspec is the optional
extra ``events`` (``pip install "pagedkv[events]"``); this module imports it only when a function
needs it, and ``import pagedkv`` never does. It imports :mod:`pagedkv.hashing` (the roots) and
:mod:`pagedkv.types` (the event records), nothing above them.
"""
from __future__ import annotations

import math
from array import array
from types import SimpleNamespace
from typing import Any, Iterable

from ..checks import int_at_least, number_at_least, optional_int_at_least
from ..hashing import ALGORITHMS, BlockHasher
from ..types import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = [
    "MEDIUM_GPU",
    "decode_vllm",
    "default_roots",
    "encode_vllm",
    "hash_to_u64",
    "root_hashes",
]

U64_MASK = (1 << 64) - 1
MEDIUM_GPU = "GPU"  # what an event without a ``medium`` field is about
INSTALL_HINT = 'pip install "pagedkv[events]"'


# ---- optional dependencies ---------------------------------------------------------------------


_WIRE: SimpleNamespace | None = None


def _wire() -> SimpleNamespace:
    """The msgspec schema of vLLM's events, built on first use (msgspec stays an optional import).

    Field names, order, tags, optionality and defaults follow vLLM 0.33: the fields with a
    default (``extra_keys``, ``group_idx``...) are left out of the bytes while unset, exactly as
    vLLM omits them, and decoded when vLLM sends them.
    """
    global _WIRE
    if _WIRE is not None:
        return _WIRE
    try:
        import msgspec
    except ImportError:
        raise ImportError(f"KV events on the wire need msgspec (the 'events' extra): {INSTALL_HINT}") from None
    from typing import Annotated, Union

    # defstruct rather than class bodies: this module's annotations are strings (PEP 563) that
    # msgspec would resolve in module globals, where these local types do not exist.
    U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints stop at 2**64 - 1 anyway
    WireHash = Union[U64, bytes]  # vLLM sends raw digests when its int-hash switch is off
    event = dict(tag_field="type", omit_defaults=True, gc=False, module=__name__)
    WireBlockStored = msgspec.defstruct(
        "WireBlockStored",
        [
            ("block_hashes", list[WireHash]),
            ("parent_block_hash", Union[WireHash, None]),
            ("token_ids", list[int]),
            ("block_size", int),
            ("lora_id", Union[int, None]),
            ("medium", Union[str, None]),
            ("lora_name", Union[str, None]),
            # vLLM's optional fields: pagedkv sets extra_keys alone (for blocks with extra keys);
            # the others are kept when decoding vLLM's own events. Their count matters to the
            # bytes: with 16 possible entries msgspec writes this map's header as map16
            # (0xde 0x00 0x08), as vLLM does, not as a fixmap (0x88).
            ("extra_keys", Union[list[Union[tuple, None]], None], None),
            ("group_idx", Union[int, None], None),
            ("kv_cache_spec_kind", Union[str, None], None),
            ("kv_cache_spec_sliding_window", Union[int, None], None),
            ("locality", Union[str, None], None),
            ("ownership", Union[str, None], None),
            ("session_id", Union[str, None], None),
            ("lookahead_token_ids", Union[list[list[int]], None], None),
        ],
        tag="BlockStored",
        **event,
    )
    WireBlockRemoved = msgspec.defstruct(
        "WireBlockRemoved",
        [
            ("block_hashes", list[WireHash]),
            ("medium", Union[str, None]),
            ("group_idx", Union[int, None], None),
            ("locality", Union[str, None], None),
            ("ownership", Union[str, None], None),
        ],
        tag="BlockRemoved",
        **event,
    )
    WireAllBlocksCleared = msgspec.defstruct("WireAllBlocksCleared", [], tag="AllBlocksCleared", **event)
    WireEventBatch = msgspec.defstruct(
        "WireEventBatch",
        [
            ("ts", float),
            ("events", list[Union[WireBlockStored, WireBlockRemoved, WireAllBlocksCleared]]),
            ("data_parallel_rank", Union[int, None], None),
        ],
        array_like=True,
        omit_defaults=True,
        gc=False,
        module=__name__,
    )
    WireBlockStored.__doc__ = "Blocks stored in one cache ``medium``, in chain order (vLLM's ``BlockStored``)."
    WireBlockRemoved.__doc__ = "Blocks evicted from one cache ``medium`` (vLLM's ``BlockRemoved``)."
    WireAllBlocksCleared.__doc__ = "The engine dropped its whole prefix cache (vLLM's ``AllBlocksCleared``)."
    WireEventBatch.__doc__ = "One published batch (vLLM's ``KVEventBatch``): a positional msgpack array."

    _WIRE = SimpleNamespace(
        msgspec=msgspec,
        BlockStored=WireBlockStored,
        BlockRemoved=WireBlockRemoved,
        AllBlocksCleared=WireAllBlocksCleared,
        EventBatch=WireEventBatch,
        encoder=msgspec.msgpack.Encoder(),
        decoder=msgspec.msgpack.Decoder(WireEventBatch),
    )
    return _WIRE


_WIRE_NAMES = {
    "WireBlockStored": "BlockStored",
    "WireBlockRemoved": "BlockRemoved",
    "WireAllBlocksCleared": "AllBlocksCleared",
    "WireEventBatch": "EventBatch",
}


def __getattr__(name: str):
    """The decoded event types (``WireBlockStored`` ...), built when first asked for."""
    if name in _WIRE_NAMES:
        return getattr(_wire(), _WIRE_NAMES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def wire_schema() -> SimpleNamespace:
    """The msgspec structs, encoder and decoder of vLLM's events, built on first use.

    The transport asks for it when a publisher or subscriber is built, so a missing msgspec is an
    ImportError naming the extra at construction rather than at the first batch.
    """
    return _wire()


# ---- hashes ------------------------------------------------------------------------------------


_INT_ONLY = {int}


def hash_to_u64(block_hash: Any) -> int:
    """A pagedkv block hash as the unsigned 64-bit id the wire format carries.

    Bytes digests: the low 64 bits of the digest read big-endian (its last eight bytes), as vLLM
    converts its own. Ints: the low 64 bits in two's complement. Example: the sha256 digest
    ``7542ec…f1fb1b9f66a418baf0`` maps to ``0xfb1b9f66a418baf0`` = 18094231191079664368;
    the builtin hash -2 maps to 2**64 - 2.
    """
    if type(block_hash) is bytes:
        return int.from_bytes(block_hash[-8:], "big")
    if isinstance(block_hash, (bytearray, memoryview)):
        return int.from_bytes(bytes(block_hash)[-8:], "big")
    if isinstance(block_hash, bool) or not hasattr(block_hash, "__index__"):
        raise ValueError(f"a block hash must be bytes or an int, got {type(block_hash).__name__}")
    return block_hash.__index__() & U64_MASK


def _u64_list(hashes: Iterable) -> list[int]:
    f = int.from_bytes
    if isinstance(hashes, (bytes, bytearray, memoryview, str)):  # one digest, not a sequence of them
        raise ValueError(f"block_hashes must be a sequence of hashes, got {type(hashes).__name__}")
    try:
        return [f(h[-8:], "big") if type(h) is bytes else hash_to_u64(h) for h in hashes]
    except TypeError:  # not iterable
        raise ValueError(f"block_hashes must be a sequence of hashes, got {type(hashes).__name__}") from None


def root_hashes(hash_algo: str = "sha256", salts: Iterable = (None,)) -> frozenset:
    """The root hashes a prompt's first block is chained from, for requests with ``salts``.

    Since the salt is a key of block 0 (as in vLLM) rather than a root of its own, this is one
    hash per algorithm whatever the salts, already in :func:`default_roots`: a salted prompt's
    first block goes on the wire with a null parent with no ``roots`` argument. Kept for callers
    that pass it; each salt is still validated (ValueError unless None, str or bytes).
    """
    hasher = BlockHasher(hash_algo)
    return frozenset(hasher.root(s) for s in salts)


_DEFAULT_ROOTS: frozenset | None = None


def default_roots() -> frozenset:
    """The unsalted root of every hash algorithm available here (xxh3 only with xxhash).

    The builtin algorithm's root is a per-process value, valid in the process that emitted the
    events; that is where they are encoded.
    """
    global _DEFAULT_ROOTS
    if _DEFAULT_ROOTS is None:
        roots: set = set()
        for algo in ALGORITHMS:
            try:
                roots |= root_hashes(algo)
            except ImportError:  # xxh3 without the xxhash extra: no such roots can occur here
                pass
        _DEFAULT_ROOTS = frozenset(roots)
    return _DEFAULT_ROOTS


# ---- encode / decode ---------------------------------------------------------------------------


def _token_list(token_ids: Any) -> list[int]:
    if isinstance(token_ids, (bytes, bytearray, str)):  # array() would read bytes as raw uint32
        raise ValueError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    try:  # one C loop validates (integers in [0, 2**32)) and converts (numpy, array, tuple)
        return array("I", token_ids).tolist()
    except (TypeError, OverflowError, ValueError) as exc:
        raise ValueError(f"token_ids must be integers in [0, 2**32): {exc}") from None


def _medium(event: Any) -> str:
    medium = getattr(event, "medium", None)
    if medium is None:
        return MEDIUM_GPU
    if not isinstance(medium, str):
        raise ValueError(f"medium must be a str such as 'GPU' or 'CPU', got {type(medium).__name__}")
    return medium


def _extra_keys(extra: Any, n: int) -> list | None:
    """A ``BlockStored``'s ``extra_keys`` for the wire: None, or one entry per block, each None or
    a tuple (of str, bytes, ints and ``(mm_hash, offset)`` pairs); ValueError otherwise."""
    if extra is None:
        return None
    if isinstance(extra, (str, bytes, bytearray)) or not isinstance(extra, (list, tuple)):
        raise ValueError(f"extra_keys must be None or one entry per block, got {type(extra).__name__}")
    if len(extra) != n:
        raise ValueError(f"extra_keys has {len(extra)} entries for {n} blocks")
    out = []
    for entry in extra:
        if entry is not None and not isinstance(entry, (list, tuple)):
            raise ValueError(f"each extra_keys entry must be None or a tuple, got {type(entry).__name__}")
        out.append(None if entry is None else tuple(entry))
    return out


def _stored_to_wire(ev: Any, roots: Any, w: SimpleNamespace, relayed: bool = False):
    hashes = _u64_list(ev.block_hashes)
    parent = ev.parent_block_hash
    try:
        is_root = parent is None or parent in roots
    except TypeError:  # unhashable parent: not a hash at all
        what = type(parent).__name__
        raise ValueError(f"parent_block_hash must be bytes, an int or None, got {what}") from None
    tokens = _token_list(ev.token_ids)
    bs = int_at_least("block_size", ev.block_size, 1, expected="a positive int")
    if len(tokens) != len(hashes) * bs:
        n = len(hashes)
        raise ValueError(f"a BlockStored of {n} blocks of {bs} tokens needs {n * bs} token ids, got {len(tokens)}")
    lora_name = getattr(ev, "lora_name", None)
    if lora_name is not None and not isinstance(lora_name, str):
        raise ValueError(f"lora_name must be None or a str, got {type(lora_name).__name__}")
    return w.BlockStored(
        hashes,
        None if is_root else hash_to_u64(parent),
        tokens,
        bs,
        getattr(ev, "lora_id", None),
        ev.medium if relayed else _medium(ev),
        lora_name,
        extra_keys=_extra_keys(getattr(ev, "extra_keys", None), len(hashes)),
        group_idx=getattr(ev, "group_idx", None),
        kv_cache_spec_kind=getattr(ev, "kv_cache_spec_kind", None),
        kv_cache_spec_sliding_window=getattr(ev, "kv_cache_spec_sliding_window", None),
    )


def _to_wire(ev: Any, roots: Any, w: SimpleNamespace):
    if isinstance(ev, BlockStored):
        return _stored_to_wire(ev, roots, w)
    if isinstance(ev, BlockRemoved):
        return w.BlockRemoved(_u64_list(ev.block_hashes), _medium(ev), getattr(ev, "group_idx", None))
    if isinstance(ev, AllBlocksCleared):
        return w.AllBlocksCleared()
    if isinstance(ev, w.BlockStored):  # a decoded event, relayed unchanged but for u64 hashes
        stored = _stored_to_wire(ev, (), w, relayed=True)
        return w.msgspec.structs.replace(
            ev, block_hashes=stored.block_hashes, parent_block_hash=stored.parent_block_hash
        )
    if isinstance(ev, w.BlockRemoved):
        return w.msgspec.structs.replace(ev, block_hashes=_u64_list(ev.block_hashes))
    if isinstance(ev, w.AllBlocksCleared):
        return ev
    raise ValueError(f"not a KV event (BlockStored, BlockRemoved, AllBlocksCleared): {type(ev).__name__}")


def encode_vllm(
    events: Iterable, timestamp: float, data_parallel_rank: int | None = None, *, roots=None
) -> bytes:
    """One msgpack ``KVEventBatch`` holding ``events``, byte for byte as vLLM 0.33 encodes it.

    ``events`` are pagedkv's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (as
    ``KVCacheManager.take_events()`` returns them) or decoded wire events, in order.
    ``timestamp`` is seconds since the epoch (vLLM sends ``time.time()``). ``roots``: the hashes
    that stand for "no parent" (default :func:`default_roots`); a ``BlockStored`` chained from
    one goes out with a null parent. An event without a ``medium`` is about the GPU cache.
    Raises ValueError, naming what is wrong, for anything that is not a well-formed event.
    """
    w = _wire()
    single = (BlockStored, BlockRemoved, AllBlocksCleared, w.BlockStored, w.BlockRemoved, w.AllBlocksCleared)
    if isinstance(events, single):  # AllBlocksCleared() is an empty tuple: it would encode as no events
        raise ValueError(f"events must be a list of events, got a single {type(events).__name__}")
    timestamp = number_at_least("timestamp", timestamp, -math.inf, expected="a finite number of seconds")
    data_parallel_rank = optional_int_at_least("data_parallel_rank", data_parallel_rank, 0)
    if roots is None:
        roots = default_roots()
    elif not isinstance(roots, (set, frozenset)):
        roots = frozenset(roots)
    try:
        wire_events = [_to_wire(ev, roots, w) for ev in events]
    except TypeError:
        raise ValueError(f"events must be an iterable of events, got {type(events).__name__}") from None
    return w.encoder.encode(w.EventBatch(float(timestamp), wire_events, data_parallel_rank))


def decode_vllm(payload: bytes) -> tuple[float, list, int | None]:
    """``(timestamp, events, data_parallel_rank)`` from one vLLM ``KVEventBatch`` payload.

    Events come back as ``WireBlockStored`` / ``WireBlockRemoved`` / ``WireAllBlocksCleared``
    (attributes named as on the wire), every hash a u64 int: raw digests, which vLLM sends when
    its int-hash switch is off, are converted with :func:`hash_to_u64`. ``lora_name`` and
    ``extra_keys`` (a list of per-block entries, each None or a tuple whose ``(mm_hash, offset)``
    pairs decode as lists, as vLLM's own decoder gives them) come back as sent; other optional
    fields (``group_idx``...) are kept too. Raises ValueError for a payload that is not a
    well-formed batch.
    """
    w = _wire()
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ValueError(f"payload must be bytes, got {type(payload).__name__}")
    try:
        batch = w.decoder.decode(payload)
    except w.msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise ValueError(f"not a vLLM KV event batch: {exc}") from None
    for ev in batch.events:
        if type(ev) is w.AllBlocksCleared:
            continue
        if ev.block_hashes and set(map(type, ev.block_hashes)) != _INT_ONLY:  # raw digests
            ev.block_hashes = [hash_to_u64(h) for h in ev.block_hashes]
        if type(ev) is w.BlockStored and type(ev.parent_block_hash) is bytes:
            ev.parent_block_hash = hash_to_u64(ev.parent_block_hash)
    return batch.ts, batch.events, batch.data_parallel_rank
