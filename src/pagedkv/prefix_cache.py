"""The prefix cache: publishing chained block hashes, their events, twins, and hit statistics.

It sits between the pool and the manager (which knows sequences and computes their hashes). The
hash <-> block bijection has one owner, the pool (as in vLLM v1, the hash sits next to its block
and the hash -> block map beside them): a block carries its hash as its key, eviction drops both
directions at once, and this cache reads the map through :meth:`BlockPool.block_of`,
:meth:`BlockPool.held_prefix` and :meth:`BlockPool.publish_keys`. What this module owns is what
publishing means: which blocks become findable, the order of events (one ``BlockStored`` per
chained run), the twins, the kept content another tier republishes, and the hit statistics. The
pool's eviction hook is this cache's :meth:`evicted`, wired here only. Here live:

* ``longest_prefix(hashes, limit)``: how many leading blocks of a prompt are already held, in
  one dict lookup per block, stopping at the first miss (chaining makes later hits impossible).
* ``publish(...)`` (a run of blocks chained one from the next: a prompt, a prefill chunk, accepted
  drafts), ``publish_blocks(...)`` (unrelated single blocks: one decode step) and
  ``publish_chained(...)`` (single blocks in parent-first order, one event per chained run: what
  a host tier receives in one offload batch): a block whose every
  position is scheduled becomes findable by its hash. When an equal block is already mapped the
  new one is not published; both may coexist (block tables are append-only), and the map keeps
  the older one. With ``track_twins`` the new one is remembered as a **twin** of the hash: when
  the mapped block leaves the map (evicted, or unpublished), a live twin takes its place, so a
  full block held by a sequence never becomes unfindable because an equal block went.
  ``forget_twins(blocks)``: the owner's last reference to these blocks is going.
* ``unpublish(blocks)``: forget blocks whose K/V will never be written.
* events (``BlockStored`` / ``BlockRemoved``, tagged with this cache's ``medium``), each carrying
  hashes, written to the manager's :class:`~pagedkv.pending_events.EventLog` so that an external router
  can mirror which prefixes each tier holds; and the hit statistics.

Blocks of a request with extra keys (LoRA, multimodal items, salt) are published with one
:class:`~pagedkv.hashing.BlockKey` (or None) per block: their ``BlockStored`` carries the LoRA name
and the per-block ``extra_keys`` as vLLM 0.33 sends them, and their kept content is
``(parent, tokens, key)`` instead of ``(parent, tokens)``, so that another tier republishes them
with their keys and the checks rehash them with their keys. A call without keys costs what it did.
"""
from __future__ import annotations

from itertools import chain, repeat
from typing import Any, Callable, Hashable, Iterable, Sequence

from .pending_events import EventLog
from .pool import BlockPool

__all__ = ["PrefixCache"]



class PrefixCache:
    """Maps full-block hashes to physical blocks held (in use or cached-free) by ``pool``."""

    __slots__ = ("_pool", "_log", "_content", "medium", "query_tokens", "hit_tokens",
                 "_twins", "_twin_hash", "_forward")

    def __init__(self, pool: BlockPool, log: EventLog | None = None, medium: str = "GPU",
                 keep_content: bool = False, track_twins: bool = False) -> None:
        self._pool = pool
        # Twins (with track_twins): in-use blocks holding a mapped hash's content that were not
        # published because the map held an equal block already. hash -> those blocks, and
        # block -> its hash. Empty in the common case, which then costs one truth test.
        self._twins: dict[Hashable, list[int]] | None = {} if track_twins else None
        self._twin_hash: dict[int, Hashable] = {}
        # block -> (parent hash, its tokens[, its BlockKey]) for every mapped block, kept only when
        # another tier needs to republish a block it receives (a BlockStored names the parent and
        # tokens, and the keys of a keyed block).
        self._content: dict[int, tuple] | None = {} if keep_content else None
        self._log = log if log is not None and log.enabled else None  # None: record nothing
        self.medium = medium
        self.query_tokens = 0
        self.hit_tokens = 0
        self._forward: Callable[[list, list, list | None], Any] | None = None
        pool.on_evict_many = self.evicted  # the pool's eviction hook, wired here only

    def forward_evictions(self, listener: Callable[[list, list, list | None], Any] | None) -> None:
        """After this cache forgets blocks its pool evicted, call ``listener(blocks, hashes,
        contents)`` (contents None unless kept): how a host tier learns what to offload, so that
        the pool's hook stays this cache's. None stops forwarding."""
        if listener is not None and not callable(listener):
            raise ValueError(f"listener must be a callable or None, got {type(listener).__name__}")
        self._forward = listener

    def get(self, block_hash: Hashable) -> int | None:
        """The block mapped under ``block_hash``, or None."""
        return self._pool.block_of(block_hash)

    # ---- lookups -----------------------------------------------------------------------------

    def longest_prefix(self, hashes: Sequence[Hashable], limit: int) -> list[int]:
        """Blocks holding the first ``k <= limit`` hashes, for the largest such ``k``."""
        return self._pool.held_prefix(hashes, limit)

    def record_query(self, prompt_tokens: int, hit_tokens: int) -> None:
        """Count one admission's prompt tokens and how many the cache served."""
        self.query_tokens += prompt_tokens
        self.hit_tokens += hit_tokens

    def usage_fields(self) -> dict:
        """The hit statistics' part of :class:`~pagedkv.types.Usage`: prompt tokens admitted,
        and how many the cache (either tier) served."""
        return dict(prefix_query_tokens=self.query_tokens, prefix_hit_tokens=self.hit_tokens)

    # ---- publishing --------------------------------------------------------------------------

    def publish(
        self,
        blocks: Sequence[int],
        hashes: Sequence[Hashable],
        parent: Hashable,
        tokens: Sequence[int],
        block_size: int,
        keys: Sequence | None = None,
    ) -> None:
        """Make in-use ``blocks`` (a chain: ``hashes[i]`` chained from ``hashes[i-1]``) findable.

        ``parent`` is the hash ``hashes[0]`` was chained from; ``tokens`` the blocks' tokens,
        concatenated; ``keys`` one :class:`~pagedkv.hashing.BlockKey` or None per block (None:
        no block has extra keys). One ``BlockStored`` event per run of newly published blocks.
        """
        if not blocks:
            return
        # One probe a hash, at C speed, in the pool (the map's owner): each new hash is given its
        # block; for a hash already mapped the older block is returned, and the map keeps it.
        held = self._pool.publish_keys(blocks, hashes)
        if held is blocks:  # the common case: all new, one run
            self._stored(hashes, parent, tokens, block_size, 0, len(blocks), keys)
            if self._content is not None:
                self._keep(blocks, hashes, parent, tokens, block_size, range(len(blocks)), keys)
            return
        new = [i for i, (b, k) in enumerate(zip(blocks, held)) if b == k]
        if self._twins is not None:
            self._add_twins(blocks, hashes, held)
        run_start = prev = -2
        for i in new + [-1]:  # one event per run of consecutive new blocks
            if i != prev + 1:
                if run_start >= 0:
                    self._stored(hashes, parent, tokens, block_size, run_start, prev + 1, keys)
                run_start = i
            prev = i
        if self._content is not None:
            self._keep(blocks, hashes, parent, tokens, block_size, new, keys)

    def _add_twins(self, blocks: Sequence[int], hashes: Sequence[Hashable], held: Sequence[int]) -> None:
        """Remember the blocks that were not published because ``held`` (the map's block for
        their hash) is another block."""
        twins, twin_hash = self._twins, self._twin_hash
        for b, h, k in zip(blocks, hashes, held):
            if b != k and b not in twin_hash:
                twins.setdefault(h, []).append(b)
                twin_hash[b] = h

    @property
    def has_twins(self) -> bool:
        """Whether any twin is remembered (see the module docstring)."""
        return bool(self._twin_hash)

    def twins(self) -> dict[int, Hashable]:
        """A copy of the twin -> hash map (for checks and tests)."""
        return dict(self._twin_hash)

    def twins_among(self, blocks: Iterable[int]) -> list[int]:
        """The blocks of ``blocks`` that are twins (one C-level pass: a freed table is long, its
        twins few)."""
        return list(filter(self._twin_hash.__contains__, blocks))

    def forget_twins(self, blocks: Iterable[int]) -> None:
        """Their owner is releasing the last reference to ``blocks``: a twin among them no
        longer holds anything worth a hash (it goes back clean) and must never be promoted."""
        twin_hash, twins = self._twin_hash, self._twins
        for b in blocks:
            h = twin_hash.pop(b, None)
            if h is not None:
                rest = twins[h]
                rest.remove(b)
                if not rest:
                    del twins[h]

    def _promote_twins(self, hashes: Sequence[Hashable], contents: list | None) -> set:
        """Hashes ``hashes`` just left the map (with their blocks' ``contents`` when kept): for
        each one that has a live twin, the twin becomes its block. Returns the
        hashes that stay mapped, for which no ``BlockRemoved`` is due: a router keeps hashes,
        not blocks, and the hash is held all along. Example: block 5 maps [0, 0, 1, 1]'s hash,
        block 9 (live in another table) is its twin; 5 is evicted -> the hash maps 9."""
        twins, twin_hash = self._twins, self._twin_hash
        kept = set()
        for i, h in enumerate(hashes):
            rest = twins.get(h)
            if rest is None:
                continue
            b = rest.pop()
            if not rest:
                del twins[h]
            del twin_hash[b]
            self._pool.set_keys((b,), (h,))
            if contents is not None:
                self._content[b] = contents[i]
            kept.add(h)
        return kept

    def _keep(self, blocks, hashes, parent, tokens, bs, indices, keys) -> None:
        for i in indices:
            content = (hashes[i - 1] if i else parent, tokens[i * bs : (i + 1) * bs])
            if keys is not None and keys[i] is not None:
                content += (keys[i],)
            self._content[blocks[i]] = content

    def content_of(self, block: int) -> tuple:
        """``(parent hash, tokens)`` of a mapped block, ``(parent hash, tokens, BlockKey)`` for a
        block with extra keys (only with ``keep_content``)."""
        return self._content[block]

    def publish_blocks(self, blocks: list, hashes: list, parents: list, tokens: list, block_size: int,
                       keys: list | None = None) -> None:
        """Publish unrelated single blocks given as columns: block ``blocks[i]`` holds
        ``tokens[i]`` and hashes to ``hashes[i]``, chained from ``parents[i]``, with extra keys
        ``keys[i]`` (``keys`` None: none has any). This is what one decode step fills (one block
        in 16 of a batch at block size 16), one event each, in order; a hash already mapped (here
        or earlier in the list) keeps its older block.

        The common case (every hash new, no keys) runs in C-level passes: one ``setdefault``
        probe a hash, one update of the pool's keys, and the events' raw tuples zipped from the
        columns.
        """
        held = self._pool.publish_keys(blocks, hashes)
        if held is not blocks:  # some hashes were mapped already: publish only the new ones
            if self._twins is not None:
                self._add_twins(blocks, hashes, held)
            new = [i for i, (b, k) in enumerate(zip(blocks, held)) if b == k]
            if not new:
                return
            blocks, hashes = [blocks[i] for i in new], [hashes[i] for i in new]
            parents, tokens = [parents[i] for i in new], [tokens[i] for i in new]
            if keys is not None:
                keys = [keys[i] for i in new]
        if keys is None:
            if self._log is not None:
                self._log.stored_many(zip(zip(hashes), parents, tokens, repeat(block_size), repeat(self.medium)))
            if self._content is not None:
                self._content.update(zip(blocks, zip(parents, tokens)))
            return
        if self._log is not None:
            self._log.stored_many([_raw((h,), p, t, block_size, self.medium, (k,))
                                   for h, p, t, k in zip(hashes, parents, tokens, keys)])
        if self._content is not None:
            self._content.update((b, (p, t) if k is None else (p, t, k))
                                 for b, p, t, k in zip(blocks, parents, tokens, keys))

    def publish_chained(self, entries: Sequence[tuple], block_size: int) -> None:
        """Publish single blocks, each ``(block, hash, parent hash, its tokens)`` or, for a block
        with extra keys, ``(block, hash, parent hash, its tokens, its BlockKey)``, in the given
        order (parents first: a router drops a block whose parent it was never told of), one
        ``BlockStored`` per run of consecutive entries that chain one from the next: blocks a
        host tier receives in one batch, as the device publishes a prompt's run in one event.
        An entry whose hash is mapped already is skipped, and ends its run; so does a change of
        LoRA adapter (an event names one)."""
        mapped = self._pool.block_of
        batch: set = set()  # hashes this call publishes (the pool learns them at the end)
        blocks, hashes = [], []
        log, content = self._log, self._content
        raw = [] if log is not None else None
        run_h: list = []
        run_t: list = []
        run_k: list = []
        run_parent = None
        for entry in entries:
            b, h, parent, tokens = entry[:4]
            key = entry[4] if len(entry) > 4 else None
            if h in batch or mapped(h) is not None:
                if run_h:
                    raw.append(_run(run_h, run_parent, run_t, block_size, self.medium, run_k))
                    run_h, run_t, run_k = [], [], []
                continue
            batch.add(h)
            blocks.append(b)
            hashes.append(h)
            if content is not None:
                content[b] = (parent, tokens) if key is None else (parent, tokens, key)
            if raw is not None:
                if run_h and (parent != run_h[-1] or _lora(run_k[-1]) != _lora(key)):
                    raw.append(_run(run_h, run_parent, run_t, block_size, self.medium, run_k))
                    run_h, run_t, run_k = [], [], []
                if not run_h:
                    run_parent = parent
                run_h.append(h)
                run_t.append(tokens)
                run_k.append(key)
        if raw is not None and run_h:
            raw.append(_run(run_h, run_parent, run_t, block_size, self.medium, run_k))
        if blocks:
            self._pool.set_keys(blocks, hashes)
            if raw:
                log.stored_many(raw)

    def _stored(self, hashes, parent, tokens, bs, i, j, keys=None) -> None:
        if self._log is not None:
            if keys is not None:
                self._log.stored_many((_raw(tuple(hashes[i:j]), parent if i == 0 else hashes[i - 1],
                                            tokens[i * bs : j * bs], bs, self.medium, keys[i:j]),))
            elif i == 0 and j == len(hashes):  # the whole run: queue the caller's slice as it is
                self._log.stored(tuple(hashes), parent, tokens, bs, self.medium)
            else:
                self._log.stored(tuple(hashes[i:j]), parent if i == 0 else hashes[i - 1],
                                 tokens[i * bs : j * bs], bs, self.medium)

    def unpublish(self, blocks: Sequence[int]) -> None:
        """Forget the hashes of in-use ``blocks`` (their content cannot be trusted); blocks that
        carry no hash are skipped. One ``BlockRemoved`` event names them. Once released, the
        blocks go back clean. A hash with a live twin (see the module docstring) maps the twin
        instead and is not named: the twin's K/V was computed by its own sequence."""
        content = self._content
        gone = [b for b in blocks if b in content] if content is not None else ()  # (mapped ones)
        self._left_map(gone, self._pool.drop_keys(blocks))

    def evicted(self, blocks: list, keys: list) -> list | None:
        """The pool's eviction hook: it evicted cached ``blocks`` and dropped their ``keys`` (both
        directions). Called once per allocation; forgets their kept content, lets twins take
        over, records one ``BlockRemoved``, then tells the listener (see
        :meth:`forward_evictions`). Returns the blocks' kept ``(parent, tokens)``, or None."""
        contents = self._left_map(blocks, keys)
        if self._forward is not None:
            self._forward(blocks, keys, contents)
        return contents

    def _left_map(self, blocks: Sequence[int], hashes: list) -> list | None:
        """``blocks`` no longer carry ``hashes`` (the pool has dropped them, in the same order):
        their kept content goes, a live twin takes over each hash it can, and one
        ``BlockRemoved`` names the rest. Returns the contents (None unless kept)."""
        contents = None
        if self._content is not None:
            contents = [self._content.pop(b) for b in blocks]
        removed = hashes
        if self._twins:
            kept = self._promote_twins(hashes, contents)
            if kept:
                removed = [h for h in hashes if h not in kept]
        if self._log is not None and removed:
            self._log.removed(removed, self.medium)
        return contents

    def clear(self) -> None:
        """Forget every hash (the pool must hold no block in use: see the manager's reset).
        The caller records the ``AllBlocksCleared`` event (one for every tier)."""
        self._pool.clear_cached()
        if self._twins:  # the caller holds no block in use, so no twin is left; to be safe
            self._twins.clear()
            self._twin_hash.clear()
        if self._content is not None:
            self._content.clear()

    # ---- checks ------------------------------------------------------------------------------

    def check_invariants(self, block_hash: Callable[[Hashable, Any], Hashable] | None = None) -> None:
        """The twins and the kept content agree with the pool's keyed blocks (the pool checks
        its own bijection, in :meth:`BlockPool.check_invariants`); with kept content and
        ``block_hash(parent, tokens[, key])`` (the owner's hash function: this cache never
        computes a hash), every mapped block's kept tokens (and extra keys) chained from its kept
        parent hash to the hash it is mapped under. The content is what another tier republishes and what a router is told
        the block holds, so a block whose content is not what its hash names would serve, and
        advertise, someone else's KV."""
        if block_hash is not None and not callable(block_hash):
            raise ValueError(f"block_hash must be a callable or None, got {type(block_hash).__name__}")
        keys = self._pool.keyed_blocks()  # the pool checks that its two directions agree
        if self._content is not None and set(self._content) != set(keys):
            raise AssertionError("kept content differs from the mapped blocks")
        if self._twins is not None:
            listed = [(b, h) for h, bs in self._twins.items() for b in bs]
            if sorted(listed, key=lambda e: e[0]) != sorted(self._twin_hash.items(), key=lambda e: e[0]):
                raise AssertionError("the twin lists and the twin index differ")
            for b, h in listed:
                if self._pool.block_of(h) is None or b in keys or not self._pool.refcount(b):
                    raise AssertionError(f"twin {b}: free, published, or its hash is not mapped")
        if block_hash is not None and self._content is not None:
            for b, h in keys.items():
                if block_hash(*self._content[b]) != h:
                    raise AssertionError(f"{self.medium} block {b}: its kept tokens, chained from its "
                                         f"kept parent, do not hash to the hash it is mapped under")


def _run(hashes: list, parent: Hashable, tokens: list, block_size: int, medium: str, keys: list) -> tuple:
    """One raw ``BlockStored`` for a chained run: its hashes, the first one's parent, every
    block's tokens concatenated (a lone block's tokens as they are: no copy), and the blocks'
    extra keys when any has some."""
    joined = tokens[0] if len(tokens) == 1 else tuple(chain.from_iterable(tokens))
    return _raw(tuple(hashes), parent, joined, block_size, medium, keys)


def _lora(key) -> str | None:
    return key.lora_name if key is not None else None


def _raw(hashes: tuple, parent: Hashable, tokens, block_size: int, medium: str, keys) -> tuple:
    """A raw ``BlockStored`` (see :class:`~pagedkv.pending_events.EventLog`): five fields, or seven
    when a block has extra keys: then the run's LoRA name and one vLLM ``extra_keys`` entry per
    block (None for a block without keys), as vLLM 0.33 publishes them. A run without any keys
    leaves ``extra_keys`` out, which a consumer reads as every entry None."""
    if not keys or not any(keys):
        return (hashes, parent, tokens, block_size, medium)
    lora = next((k.lora_name for k in keys if k is not None), None)
    return (hashes, parent, tokens, block_size, medium, lora,
            tuple(k.event if k is not None else None for k in keys))
