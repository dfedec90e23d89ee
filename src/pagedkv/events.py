"""KV cache events on the wire: vLLM's msgpack format and its ZMQ publisher with replay.

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
  both mean "no block has extra keys" to a consumer, and every such event stays byte for byte
  what the golden cases hold. ``BlockRemoved`` carries ``block_hashes`` and ``medium``;
  ``AllBlocksCleared`` nothing;
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
    235
    >>> ts, [wire], dp = decode_vllm(payload)
    >>> wire.block_hashes == [hash_to_u64(h) for h in ev.block_hashes]
    True
    >>> wire.parent_block_hash is None, len(wire.token_ids), wire.medium   # a prompt's first block
    (True, 32, 'GPU')

Of those 235 bytes, the 32 token ids take 96 (3 bytes each, msgpack's uint16 form), the two
hashes 18, the field names and the ``"GPU"`` string 98 (vLLM's map encoding repeats them in
every event), the float64 timestamp and the headers 23.

On the wire (:class:`KVEventPublisher`, vLLM's ``ZmqEventPublisher`` framing): a PUB socket
(default ``tcp://*:5557``) sends each batch as three frames ``(topic, seq, payload)``, ``seq`` the
batch's sequence number as 8 bytes big-endian, counting from 0. An optional ROUTER socket answers
a replay request (the start sequence number, 8 bytes big-endian) with every buffered batch from
there on, each ``(topic, seq, payload)``, then the end marker ``(b"", -1 as 8 signed big-endian
bytes, b"")``. A subscriber that sees a jump in ``seq`` asks for the missing range;
:class:`KVEventSubscriber` does exactly that.

msgspec and pyzmq are the optional extra ``events`` (``pip install "pagedkv[events]"``); this
module imports them only when a function needs them, and ``import pagedkv`` never does.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from array import array
from collections import deque
from types import SimpleNamespace
from typing import Any, Iterable, NamedTuple

from .hashing import ALGORITHMS, BlockHasher
from .types import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = [
    "DEFAULT_ENDPOINT",
    "END_SEQ",
    "MEDIUM_GPU",
    "KVEventPublisher",
    "KVEventSubscriber",
    "ReceivedBatch",
    "decode_vllm",
    "default_roots",
    "encode_vllm",
    "hash_to_u64",
    "offset_endpoint",
    "root_hashes",
]

logger = logging.getLogger(__name__)

U64_MASK = (1 << 64) - 1
DEFAULT_ENDPOINT = "tcp://*:5557"  # vLLM's default publisher endpoint
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay stream's end marker (its seq frame)
MEDIUM_GPU = "GPU"  # what an event without a ``medium`` field is about
_INSTALL_HINT = 'pip install "pagedkv[events]"'


# ---- optional dependencies ---------------------------------------------------------------------


def _import_zmq():
    try:
        import zmq
    except ImportError:
        raise ImportError(f"KV event sockets need pyzmq (the 'events' extra): {_INSTALL_HINT}") from None
    return zmq


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
        raise ImportError(f"KV events on the wire need msgspec (the 'events' extra): {_INSTALL_HINT}") from None
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
    bs = ev.block_size
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
        raise ValueError(f"block_size must be a positive int, got {bs!r}")
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


def _check_rank(rank: Any) -> None:
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ValueError(f"data_parallel_rank must be None or an int >= 0, got {rank!r}")


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
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or not math.isfinite(timestamp):
        raise ValueError(f"timestamp must be a finite number of seconds, got {timestamp!r}")
    _check_rank(data_parallel_rank)
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


# ---- ZMQ publisher -----------------------------------------------------------------------------


def _check_count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _bind(zmq, sock, endpoint: Any, what: str) -> str:
    if not isinstance(endpoint, str):
        raise ValueError(f"{what} endpoint must be a str such as 'tcp://*:5557', got {type(endpoint).__name__}")
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise ValueError(f"cannot bind the {what} socket to {endpoint!r}: {exc}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def offset_endpoint(endpoint: Any, data_parallel_rank: int | None) -> Any:
    """``endpoint`` for the publisher of data-parallel rank ``data_parallel_rank``, as vLLM's
    ``ZmqEventPublisher.offset_endpoint_port`` computes it, so that every rank of one deployment
    can be configured with the same endpoint and subscribers find rank r at port base + r.

    Rank None or 0: unchanged. ``tcp://host:PORT``: the port plus the rank
    (``tcp://*:5557`` for rank 2 -> ``tcp://*:5559``); a wildcard port (``tcp://127.0.0.1:*``)
    stays as it is, since the OS gives each rank a free port anyway. ``inproc://NAME`` gets
    ``_dp{rank}`` appended, as in vLLM; so does ``ipc://PATH`` (vLLM refuses ipc endpoints with a
    rank above 0; a suffixed path keeps the ranks apart the same way). ValueError for a port that
    would pass 65535. Anything else (a non-str endpoint) is returned for the bind to refuse.
    """
    if not data_parallel_rank or not isinstance(endpoint, str):
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    base, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit():
        new = int(port) + data_parallel_rank
        if new > 65535:
            raise ValueError(f"data-parallel rank {data_parallel_rank} puts {endpoint!r} past port 65535")
        return f"{base}:{new}"
    return endpoint


class KVEventPublisher:
    """Publishes event batches with vLLM's framing; optionally answers replay requests.

    ``publish`` encodes and sends on the caller's thread (a PUB send never blocks: a subscriber
    that falls ``hwm`` messages behind loses messages, and replay is how it recovers them), keeps
    the last ``buffer_steps`` payloads, and returns the batch's sequence number. With a
    ``replay_endpoint``, one background thread answers replay requests from that buffer.
    Endpoints are always bound (vLLM connects to a non-wildcard host; pagedkv binds it), and
    ``endpoint`` / ``replay_endpoint`` read back the bound address, so ``tcp://127.0.0.1:*``
    takes a free port. Defaults are vLLM's: ``tcp://*:5557``, 10,000 buffered batches, high-water
    mark 100,000, topic ``""``. ``publish`` may be called from several threads.

    ``data_parallel_rank`` is stamped on every batch and, as vLLM's publisher does, offsets both
    endpoints (:func:`offset_endpoint`): with the defaults, rank 0 binds port 5557 and rank 3 port
    5560, so one configuration serves every rank of a data-parallel deployment.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        replay_endpoint: str | None = None,
        *,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        topic: str = "",
        data_parallel_rank: int | None = None,
        roots=None,
    ) -> None:
        zmq = _import_zmq()
        _wire()
        _check_count("buffer_steps", buffer_steps, 1)
        _check_count("hwm", hwm, 0)
        _check_rank(data_parallel_rank)
        if not isinstance(topic, str):
            raise ValueError(f"topic must be a str, got {type(topic).__name__}")
        self._zmq = zmq
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._roots = default_roots() if roots is None else frozenset(roots)
        self._buffer: deque = deque(maxlen=buffer_steps)  # (seq, payload), oldest first
        self._lock = threading.Lock()  # one sender at a time; the buffer seen whole by replay
        self._next_seq = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._ctx = zmq.Context()
        self._sockets: list = []
        self.replay_endpoint: str | None = None
        try:
            self._pub = self._socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self.endpoint = _bind(zmq, self._pub, offset_endpoint(endpoint, data_parallel_rank), "KV event PUB")
            if replay_endpoint is not None:
                self._start_replay(offset_endpoint(replay_endpoint, data_parallel_rank), buffer_steps)
        except BaseException:
            self._close_sockets()
            raise

    def _socket(self, kind):
        sock = self._ctx.socket(kind)
        sock.setsockopt(self._zmq.LINGER, 0)
        self._sockets.append(sock)
        return sock

    def _start_replay(self, replay_endpoint: str, buffer_steps: int) -> None:
        zmq = self._zmq
        self._replay = self._socket(zmq.ROUTER)
        # A whole replay plus its end marker must fit in the send queue (vLLM sizes it the same).
        self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
        self.replay_endpoint = _bind(zmq, self._replay, replay_endpoint, "KV event replay")
        self._wake_rx = self._socket(zmq.PAIR)  # close() wakes the replay thread through this pair
        self._wake_rx.bind("inproc://pagedkv-events-wake")
        self._wake_tx = self._socket(zmq.PAIR)
        self._wake_tx.connect("inproc://pagedkv-events-wake")
        self._thread = threading.Thread(target=self._serve_replay, name="pagedkv-kv-replay", daemon=True)
        self._thread.start()

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will get (batches published so far)."""
        return self._next_seq

    def publish(self, events: Iterable, timestamp: float | None = None) -> int:
        """Encode ``events`` as one batch, send it, buffer it for replay; return its sequence number.

        ``timestamp`` defaults to ``time.time()``. Bad events raise ValueError and publish nothing;
        a closed publisher raises RuntimeError.
        """
        ts = time.time() if timestamp is None else timestamp
        payload = encode_vllm(events, ts, self._rank, roots=self._roots)
        with self._lock:
            if self._closed:
                raise RuntimeError("the KV event publisher is closed")
            seq = self._next_seq
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self._next_seq = seq + 1
        return seq

    def _serve_replay(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while not self._closed:
            ready = dict(poller.poll(timeout=1000))  # close() wakes us at once; the timeout is a backstop
            if self._wake_rx in ready:
                return
            if self._replay in ready:
                try:
                    self._answer_replay()
                except Exception:  # a bad request must not stop the service
                    logger.exception("KV event replay failed")

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"":
            logger.warning("ignoring a malformed KV event replay request of %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        with self._lock:
            first = self._buffer[0][0] if self._buffer else 0
            skip = max(0, start_seq - first)
            wanted = [self._buffer[i] for i in range(skip, len(self._buffer))]
        send = self._replay.send_multipart
        for seq, payload in wanted:
            send((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        send((client, b"", b"", END_SEQ, b""))

    def close(self, timeout: float = 1.0) -> None:
        """Stop the replay thread (waiting at most ``timeout`` s) and close every socket.

        Batches not yet sent to a slow subscriber are dropped, as in vLLM. Closing twice is a no-op.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread is not None:
            self._wake_tx.send(b"", self._zmq.NOBLOCK)
            self._thread.join(timeout)
            if self._thread.is_alive():  # never seen; leave its sockets to it rather than race it
                logger.warning("KV event replay thread did not stop within %.1f s", timeout)
                self._pub.close(linger=0)
                return
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets = []
        self._ctx.term()

    def __enter__(self) -> "KVEventPublisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- subscriber --------------------------------------------------------------------------------


class ReceivedBatch(NamedTuple):
    """One batch as a subscriber delivers it: its sequence number and decoded content."""

    seq: int
    timestamp: float
    events: list
    data_parallel_rank: int | None


class KVEventSubscriber:
    """Receives a publisher's batches in sequence order, each once, filling gaps by replay.

    A SUB socket gets live batches. When one arrives whose ``seq`` is past ``next_seq`` (the
    subscriber joined late, or fell ``hwm`` behind), the missing range is asked for on the replay
    socket and delivered first; a batch seen twice is dropped. What the publisher's buffer no
    longer holds is counted in ``lost``; ``replayed`` counts batches that came by replay.
    ``start_seq`` is the first sequence number wanted (``None``: whatever arrives first).
    ``sync()`` fetches whatever the publisher has beyond ``next_seq`` (the tail a SUB socket may
    have missed). Replay waits at most ``replay_timeout`` seconds and raises TimeoutError past it.
    Works with vLLM's own publisher too. One thread uses a subscriber.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        start_seq: int | None = None,
        replay_timeout: float = 2.0,
    ) -> None:
        zmq = _import_zmq()
        _wire()
        if start_seq is not None:
            _check_count("start_seq", start_seq, 0)
        if not isinstance(topic, str):
            raise ValueError(f"topic must be a str, got {type(topic).__name__}")
        bad_timeout = isinstance(replay_timeout, bool) or not isinstance(replay_timeout, (int, float))
        if bad_timeout or not replay_timeout > 0:
            raise ValueError(f"replay_timeout must be a positive number of seconds, got {replay_timeout!r}")
        if replay_endpoint is not None and not isinstance(replay_endpoint, str):
            raise ValueError(f"replay_endpoint must be a str or None, got {type(replay_endpoint).__name__}")
        self._zmq = zmq
        self._replay_endpoint = replay_endpoint
        self._replay_timeout = float(replay_timeout)
        self.next_seq: int | None = start_seq
        self.lost = 0
        self.replayed = 0
        self._pending: deque = deque()  # ReceivedBatch, in order, ready to deliver
        self._ctx = zmq.Context()
        self._dealer = None
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 0)  # the subscriber decides what to drop, not the socket
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        try:
            _connect(zmq, self._sub, endpoint, "KV event SUB")
        except BaseException:
            self.close()
            raise

    def recv(self, timeout: float = 1.0) -> ReceivedBatch | None:
        """The next batch in sequence order, or None if none arrives within ``timeout`` s."""
        if self._pending:
            return self._pending.popleft()
        deadline = time.monotonic() + timeout
        while True:
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sub.poll(wait_ms):
                return None
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                n = len(frames)
                raise ValueError(f"not a KV event message: expected (topic, 8-byte seq, payload), got {n} frames")
            self._accept_live(int.from_bytes(frames[1], "big"), frames[2])
            if self._pending:
                return self._pending.popleft()

    def sync(self) -> int:
        """Fetch by replay every batch the publisher holds from ``next_seq`` on (from its oldest
        when nothing was received yet); return how many were queued for ``recv``."""
        before = len(self._pending)
        self._fill(self.next_seq or 0)
        return len(self._pending) - before

    def replay(self, start_seq: int) -> list[ReceivedBatch]:
        """Every batch the publisher's buffer holds from ``start_seq`` on, as it answers a replay
        request (no de-duplication; changes nothing here)."""
        _check_count("start_seq", start_seq, 0)
        return [self._decode(seq, payload) for seq, payload in self._request(start_seq)]

    def _accept_live(self, seq: int, payload: bytes) -> None:
        nxt = self.next_seq
        if nxt is not None and seq > nxt and self._replay_endpoint is not None:
            self._fill(nxt)
            nxt = self.next_seq
        if nxt is not None and seq < nxt:
            return  # already delivered (by replay, or a duplicate)
        if nxt is not None:
            self.lost += seq - nxt
        self._pending.append(self._decode(seq, payload))
        self.next_seq = seq + 1

    def _fill(self, start: int) -> None:
        for seq, payload in self._request(start):
            nxt = self.next_seq
            if nxt is not None and seq < nxt:
                continue
            if nxt is not None:
                self.lost += seq - nxt  # gone from the publisher's buffer
            self._pending.append(self._decode(seq, payload))
            self.replayed += 1
            self.next_seq = seq + 1

    def _request(self, start: int) -> list[tuple[int, bytes]]:
        if self._replay_endpoint is None:
            raise RuntimeError("this subscriber has no replay endpoint")
        zmq = self._zmq
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            _connect(zmq, self._dealer, self._replay_endpoint, "KV event replay")
        dealer = self._dealer
        deadline = time.monotonic() + self._replay_timeout
        got: list[tuple[int, bytes]] = []
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")), zmq.NOBLOCK)
            while True:
                wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
                if not dealer.poll(wait_ms):
                    raise TimeoutError(
                        f"no end of replay from {self._replay_endpoint} within {self._replay_timeout} s"
                    )
                frames = dealer.recv_multipart()
                if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
                    raise ValueError(f"not a KV event replay message: {len(frames)} frames")
                if frames[2] == END_SEQ:
                    return got
                got.append((int.from_bytes(frames[2], "big"), frames[3]))
        except BaseException:
            # A half-read answer must not leak into the next request: start a fresh socket.
            self._dealer = None
            dealer.close(linger=0)
            raise

    @staticmethod
    def _decode(seq: int, payload: bytes) -> ReceivedBatch:
        ts, events, rank = decode_vllm(payload)
        return ReceivedBatch(seq, ts, events, rank)

    def close(self) -> None:
        """Close the sockets (undelivered batches are dropped). Closing twice is a no-op."""
        for sock in (self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._dealer = None
        if not self._ctx.closed:
            self._ctx.term()

    def __enter__(self) -> "KVEventSubscriber":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _connect(zmq, sock, endpoint: Any, what: str) -> None:
    if not isinstance(endpoint, str):
        got = type(endpoint).__name__
        raise ValueError(f"{what} endpoint must be a str such as 'tcp://127.0.0.1:5557', got {got}")
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        raise ValueError(f"cannot connect the {what} socket to {endpoint!r}: {exc}") from None
