"""KV cache events on the wire, the transport: vLLM's ZMQ publisher and a subscriber with replay.

On the wire (:class:`KVEventPublisher`, vLLM's ``ZmqEventPublisher`` framing): a PUB socket
(default ``tcp://*:5557``) sends each batch as three frames ``(topic, seq, payload)``, ``seq`` the
batch's sequence number as 8 bytes big-endian, counting from 0. An optional ROUTER socket answers
a replay request (the start sequence number, 8 bytes big-endian) with every buffered batch from
there on, each ``(topic, seq, payload)``, then the end marker ``(b"", -1 as 8 signed big-endian
bytes, b"")``. A subscriber that sees a jump in ``seq`` asks for the missing range;
:class:`KVEventSubscriber` does exactly that.

The bytes of each batch are :mod:`pagedkv.events.codec`'s. pyzmq (and msgspec, for the codec) are
the optional extra ``events`` (``pip install "pagedkv[events]"``); this module imports them only
when a publisher or subscriber is built, and ``import pagedkv`` never does. It imports the codec
and :mod:`pagedkv.checks`, nothing else of pagedkv.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Iterable, NamedTuple

from ..checks import int_at_least, number_at_least, optional_int_at_least
from .codec import INSTALL_HINT, decode_vllm, default_roots, encode_vllm, wire_schema

__all__ = [
    "DEFAULT_ENDPOINT",
    "END_SEQ",
    "KVEventPublisher",
    "KVEventSubscriber",
    "ReceivedBatch",
    "offset_endpoint",
]

logger = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "tcp://*:5557"  # vLLM's default publisher endpoint
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay stream's end marker (its seq frame)


# ---- optional dependencies ---------------------------------------------------------------------


def _import_zmq():
    try:
        import zmq
    except ImportError:
        raise ImportError(f"KV event sockets need pyzmq (the 'events' extra): {INSTALL_HINT}") from None
    return zmq


# ---- ZMQ publisher -----------------------------------------------------------------------------


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
        wire_schema()
        buffer_steps = int_at_least("buffer_steps", buffer_steps, 1)
        hwm = int_at_least("hwm", hwm, 0)
        data_parallel_rank = optional_int_at_least("data_parallel_rank", data_parallel_rank, 0)
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
        wire_schema()
        if start_seq is not None:
            start_seq = int_at_least("start_seq", start_seq, 0)
        if not isinstance(topic, str):
            raise ValueError(f"topic must be a str, got {type(topic).__name__}")
        positive = "a positive number of seconds"
        replay_timeout = number_at_least("replay_timeout", replay_timeout, 0.0, strict=True, expected=positive)
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
        start_seq = int_at_least("start_seq", start_seq, 0)
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
