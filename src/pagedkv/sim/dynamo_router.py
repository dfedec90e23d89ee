"""Routing a pagedkv fleet through NVIDIA Dynamo's standalone KV indexer.

Why: :class:`~pagedkv.sim.routers.PrefixAwareRouter` proves that pagedkv's KV events carry what a
precise router needs, with an index built in this process. A fleet in production is routed by a
router someone else wrote. Dynamo 1.6.1's standalone indexer (``python -m dynamo.indexer``, from
the ``ai-dynamo-runtime`` wheel: install ``pagedkv[dynamo]``) subscribes to each worker's ZMQ
event stream in vLLM's wire format, keeps a radix tree of their blocks and answers
``POST /query`` with each worker's overlap, in tokens. :class:`DynamoRouter` puts every replica's
events on the wire through its own :class:`~pagedkv.events.KVEventPublisher` (with a replay
socket), registers each with the indexer (``POST /register``: ``instance_id``, ``endpoint``,
``replay_endpoint``, ``model_name``, ``block_size``) and routes each request by the indexer's
answer, under the precise router's load guard and cache threshold, so that the two routers differ
only in who keeps the index.

This module may import the simulator's routers and :mod:`pagedkv.events`; it talks to Dynamo only
over HTTP and ZMQ on loopback, and imports nothing of Dynamo (its package is only started as a
process, and only when no ``indexer_url`` is given).

The rules a fleet must follow (docs/design.md, "Routing with Dynamo"): the indexer's block size
is the managers' (``block_size`` is sent on ``/register``; the first registration of a model sets
it); every replica hashes with the same ``hash_algo``, ``sha256`` or ``xxh3`` (``builtin`` hashes
are per process, and this router refuses them); the indexer runs with ``--threads 1`` (with more,
Dynamo 1.6.1 over-reports a worker's overlap when a removal leaves children: Dynamo issue
#10774); salted requests are not separated (Dynamo reads a salt only from its own ``extra_keys``
convention, which pagedkv's events do not carry).

Knowing when the indexer has read the events: the indexer applies events asynchronously, and a
query must see every event published before the request arrived (the in-process router sees them
at once). Before a query, each replica that published since the last query publishes a
*sentinel*: one block of token ids at and above 2**31 (no tokenizer emits them), chained from no
parent, and the removal of its previous sentinel; the router polls ``/query`` with the sentinel's
tokens until every such replica scores it. Each worker's events are applied in order, so by then
all of its earlier events are too. A sentinel lost to ZMQ's slow joiner is published again, and
the sequence gap makes the indexer replay what it missed from the replay socket.

Where Dynamo's answer differs from ``lookup()``: Dynamo counts the block holding the prompt's
last token; ``lookup()`` never does (the engine must compute that token). So for a prompt whose
length is a multiple of the block size, a replica holding all of it scores one block more.
``stats`` counts, per query, whether Dynamo agreed with the in-process index exactly
(``dynamo_equal``), by that last block only (``dynamo_last_block``), or otherwise
(``dynamo_other``, 0 with ``--threads 1``).
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Sequence

from .request import Request
from .routers import (SGLANG_BALANCE_ABS, SGLANG_BALANCE_REL, SGLANG_CACHE_THRESHOLD, PrefixAwareRouter,
                      _least_loaded, prompt_array)

__all__ = ["DYNAMO_VERSION", "IndexerError", "DynamoIndexer", "DynamoRouter", "dynamo_installed"]

DYNAMO_VERSION = "1.6.1"  # the ai-dynamo-runtime release this was checked against (pagedkv[dynamo])
SENTINEL_BASE = 1 << 31  # sentinel token ids start here: above any tokenizer's vocabulary
_names = itertools.count()


class IndexerError(RuntimeError):
    """The Dynamo indexer could not be started, reached, or did not catch up in time."""


def dynamo_installed() -> bool:
    """Whether ``python -m dynamo.indexer`` can run here (the ``dynamo`` extra)."""
    try:
        return importlib.util.find_spec("dynamo.indexer") is not None
    except ModuleNotFoundError:
        return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DynamoIndexer:
    """A Dynamo standalone KV indexer over HTTP: one at ``url``, or started here.

    Without ``url`` it runs ``python -m dynamo.indexer --port P --threads 1`` as a child process
    (P a free port; the log goes to a temporary file, named in errors) and waits up to
    ``startup_timeout`` seconds for ``GET /workers`` to answer; :meth:`close` stops it. Requests go
    to 127.0.0.1 (Dynamo 1.6.1 listens on every interface and has no option to narrow it).
    """

    def __init__(self, url: str | None = None, *, threads: int = 1, startup_timeout: float = 60.0,
                 timeout: float = 10.0) -> None:
        self.timeout = timeout
        self.process: subprocess.Popen | None = None
        self.log_path: str | None = None
        if url is not None:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"indexer url must be an http:// URL, got {url!r}")
            self.url = url.rstrip("/")
            self._wait_ready(min(startup_timeout, 5.0))  # a running indexer answers at once
            return
        if not dynamo_installed():
            raise IndexerError(f'Dynamo\'s indexer is not installed: pip install "pagedkv[dynamo]" '
                               f"(ai-dynamo-runtime=={DYNAMO_VERSION})")
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        fd, self.log_path = tempfile.mkstemp(prefix="pagedkv-dynamo-indexer-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--threads", str(threads)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, limit: float) -> None:
        deadline = time.monotonic() + limit
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise IndexerError(f"the Dynamo indexer exited with status {self.process.returncode} "
                                   f"(log: {self.log_path})")
            try:
                self._call("GET", "/workers")
                return
            except IndexerError:
                if time.monotonic() > deadline:
                    raise IndexerError(f"no Dynamo indexer answered at {self.url} within {limit:g} s"
                                       + (f" (log: {self.log_path})" if self.log_path else "")) from None
                time.sleep(0.05)

    def _call(self, method: str, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            raise IndexerError(f"{method} {path}: HTTP {e.code}: {e.read().decode(errors='replace')[:300]}") from None
        except (urllib.error.URLError, OSError) as e:
            raise IndexerError(f"{method} {self.url}{path}: {e}") from None
        try:
            return json.loads(text)
        except ValueError:
            return text

    def register(self, instance_id: int, endpoint: str, replay_endpoint: str, model_name: str,
                 block_size: int) -> None:
        """``POST /register``: the indexer subscribes to ``endpoint`` and recovers gaps from
        ``replay_endpoint``."""
        self._call("POST", "/register", {"instance_id": instance_id, "endpoint": endpoint,
                                         "replay_endpoint": replay_endpoint, "model_name": model_name,
                                         "block_size": block_size})

    def unregister(self, instance_id: int, model_name: str) -> None:
        self._call("POST", "/unregister", {"instance_id": instance_id, "model_name": model_name})

    def query(self, token_ids: Sequence[int], model_name: str) -> dict[int, int]:
        """``POST /query``: each worker's overlap with ``token_ids``, in tokens (workers with none
        are absent). Example: a 50-token prompt whose first 48 tokens a worker holds, block size
        16 -> ``{0: 48}``."""
        out = self._call("POST", "/query", {"token_ids": list(token_ids), "model_name": model_name})
        if not isinstance(out, dict) or not isinstance(out.get("scores"), dict):
            if isinstance(out, dict) and "no indexer" in str(out.get("error", "")):
                return {}
            raise IndexerError(f"unexpected /query answer: {str(out)[:300]}")
        return {int(w): max(ranks.values(), default=0) for w, ranks in out["scores"].items()}

    def close(self) -> None:
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> "DynamoIndexer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DynamoRouter(PrefixAwareRouter):
    """The precise router's policy on Dynamo's ``/query`` answers instead of its own index.

    ``indexer_url``: a running indexer (it must run with ``--threads 1``); None starts one per
    :meth:`bind` (stopped by :meth:`close`, or the next ``bind``). ``model_name`` names this
    fleet in the indexer (default: unique per bind, so two runs never share a tree). The
    in-process index is kept too, only to count in ``stats`` how Dynamo's answers compare with it.
    Example (block size 16): a 48-token prompt that replica 2 holds whole scores 48 tokens in
    Dynamo and 32 in the in-process index (``dynamo_last_block``); both route to replica 2.
    """

    name = "dynamo"

    def __init__(self, block_size: int = 16, hash_algo: str = "sha256",
                 balance_abs: int = SGLANG_BALANCE_ABS, balance_rel: float = SGLANG_BALANCE_REL,
                 cache_threshold: float = SGLANG_CACHE_THRESHOLD, *, indexer_url: str | None = None,
                 model_name: str | None = None, sync_timeout: float = 30.0) -> None:
        super().__init__(block_size, hash_algo, balance_abs, balance_rel, cache_threshold)
        if hash_algo == "builtin":
            raise ValueError("the Dynamo router needs hashes that agree across processes: "
                             "hash_algo sha256 or xxh3, not builtin")
        if model_name is not None and (not isinstance(model_name, str) or not model_name):
            raise ValueError(f"model_name must be a non-empty str, got {model_name!r}")
        self.indexer_url, self.model_name, self.sync_timeout = indexer_url, model_name, sync_timeout
        self.indexer: DynamoIndexer | None = None
        self.publishers: list = []
        self._model = ""
        self._dirty: set[int] = set()
        self._sentinel: dict[int, int] = {}  # replica -> the hash of its sentinel in the index
        self._round = 0

    def bind(self, names: Sequence[str]) -> None:
        from ..events import KVEventPublisher

        self.close()
        super().bind(names)
        self.indexer = DynamoIndexer(self.indexer_url)
        self._model = self.model_name or f"pagedkv-fleet-{os.getpid()}-{next(_names)}"
        try:
            for i in range(len(self.names)):
                pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
                self.publishers.append(pub)
                self.indexer.register(i, pub.endpoint, pub.replay_endpoint, self._model, self.block_size)
            self._dirty = set(range(len(self.names)))
            self._sync()  # every subscription is live before the first real event
        except BaseException:
            self.close()
            raise

    def on_events(self, replica: int, payload: bytes) -> None:
        from ..events import decode_vllm

        super().on_events(replica, payload)  # the in-process index, for the comparison stats
        _, events, _ = decode_vllm(payload)
        self.publishers[replica].publish(events)
        self._dirty.add(replica)

    def _sentinel_tokens(self, k: int) -> list[int]:
        return [SENTINEL_BASE + (k % SENTINEL_BASE)] * self.block_size

    def _publish_sentinels(self) -> list[int]:
        from ..types import BlockRemoved, BlockStored

        self._round += 1
        k = self._round
        tokens = self._sentinel_tokens(k)
        h = (1 << 63) | k
        for r in self._dirty:
            # tagged as a uniform replica tags its own events (group 0, full attention)
            evs = [BlockStored((h,), None, tuple(tokens), self.block_size, "GPU", None, None, 0, "full_attention")]
            old = self._sentinel.get(r)
            if old is not None:
                evs.insert(0, BlockRemoved((old,), "GPU", 0))
            self.publishers[r].publish(evs)
            self._sentinel[r] = h
        return tokens

    def _sync(self) -> None:
        """Wait until the indexer has applied every event published so far (the sentinels)."""
        if not self._dirty:
            return
        deadline = time.monotonic() + self.sync_timeout
        while True:
            tokens = self._publish_sentinels()
            republish = time.monotonic() + 0.5
            while time.monotonic() < republish:
                scores = self.indexer.query(tokens, self._model)
                if all(scores.get(r, 0) >= self.block_size for r in self._dirty):
                    self._dirty.clear()
                    return
                time.sleep(0.001)
            if time.monotonic() > deadline:
                raise IndexerError(f"the Dynamo indexer did not apply the events of replicas "
                                   f"{sorted(self._dirty)} within {self.sync_timeout:g} s")
            self._count("sentinel_resent")

    def overlap_tokens(self, token_ids: Sequence[int]) -> list[int]:
        """Per replica, Dynamo's overlap with ``token_ids`` in tokens, once the indexer has read
        every event delivered so far: what ``lookup(token_ids + [any])`` says on that replica
        (Dynamo counts the block holding the last token; ``lookup`` does not)."""
        self._sync()
        scores = self.indexer.query([int(t) for t in token_ids], self._model)
        return [scores.get(i, 0) for i in range(len(self.names))]

    def overlap_blocks(self, request: Request) -> list[int]:
        """Per replica, Dynamo's overlap with the request's prompt, in whole blocks."""
        bs = self.block_size
        return [t // bs for t in self.overlap_tokens(prompt_array(request).tolist())]

    def route(self, request: Request, loads: Sequence[int]) -> int:
        if self.imbalanced(loads):
            self._count("guard")
            return _least_loaded(loads)
        match = self.overlap_blocks(request)
        own = self.match_blocks(request)
        n, bs = request.prompt_len, self.block_size
        if match == own:
            self._count("dynamo_equal")
        elif n % bs == 0 and all(m == o or (m == o + 1 == n // bs) for m, o in zip(match, own)):
            self._count("dynamo_last_block")
        else:
            self._count("dynamo_other")
        best = max(match)
        if best == 0 or best * bs <= self.cache_threshold * n:
            self._count("below_threshold")
            return _least_loaded(loads)
        self._count("affinity")
        return _least_loaded(loads, [i for i, m in enumerate(match) if m == best])

    def close(self) -> None:
        """Close the publishers and stop the indexer this router started."""
        pubs, self.publishers = self.publishers, []
        for pub in pubs:
            pub.close()
        if self.indexer is not None:
            self.indexer.close()
            self.indexer = None

    def describe(self) -> str:
        where = self.indexer_url or "started here, --threads 1"
        return (f"dynamo (Dynamo {DYNAMO_VERSION} KV indexer, {where}; the precise router's policy: "
                f"longest overlap if > {self.cache_threshold:g} of the prompt; load guard: max - min > "
                f"{self.balance_abs} and max > {self.balance_rel:g} x min)")
