"""KV cache events on the wire: what a router reads to learn which replica caches which prefix.

Two modules, one per job:

* :mod:`pagedkv.events.codec`, the wire format: vLLM's msgpack ``KVEventBatch`` (its
  ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` structs), :func:`encode_vllm`,
  :func:`decode_vllm` and the hash-to-u64 rule; it owns the msgspec schema.
* :mod:`pagedkv.events.transport`, the sockets: :class:`KVEventPublisher` (vLLM's ZMQ framing,
  with a replay buffer) and :class:`KVEventSubscriber` (gap filling by replay); they own the
  sequence numbers and the buffered payloads.

The events themselves are produced in process by the manager, which queues them in
:mod:`pagedkv.pending_events` until ``take_events`` drains them; this package only turns a drained
list into bytes and back, and carries the bytes. It may import :mod:`pagedkv.types`,
:mod:`pagedkv.hashing` and :mod:`pagedkv.checks`, never the manager or anything above it, and its
optional dependencies (msgspec, pyzmq: the extra ``events``) only when a function needs them, so
``import pagedkv.events`` works without them. Every name below is also importable from here
(``pagedkv.events.encode_vllm``, ``pagedkv.events.KVEventPublisher``...), the documented paths.
"""
from __future__ import annotations

from . import codec
from .codec import (
    MEDIUM_GPU,
    U64_MASK,
    decode_vllm,
    default_roots,
    encode_vllm,
    hash_to_u64,
    root_hashes,
)
from .transport import (
    DEFAULT_ENDPOINT,
    END_SEQ,
    KVEventPublisher,
    KVEventSubscriber,
    ReceivedBatch,
    offset_endpoint,
)

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


def __getattr__(name: str):
    """The decoded event types (``WireBlockStored`` ...), which the codec builds when first asked."""
    if name.startswith("Wire"):
        return getattr(codec, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
