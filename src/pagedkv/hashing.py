"""Chained block hashes: the identity of a full block's content *and everything before it*.

Block i's hash is ``H(hash of block i-1, token ids of block i, extra keys of block i)``, and
block 0 is chained from one fixed root. Chaining is what makes a hash lookup a *prefix* lookup: two
blocks with the same 16 tokens but different histories get different hashes, so a hit on block i
implies that blocks 0..i-1 are identical too.

Extra keys (:class:`ExtraKeys`, vLLM v1's ``generate_block_hash_extra_keys``) cover what token ids
alone do not say about K/V: the LoRA adapter (in every block's key: the same tokens through another
adapter give other K/V), each multimodal item whose placeholder span touches the block (its content
hash and its offset from the block's start: the placeholder tokens are the same for every image),
and the request's ``cache_salt`` (in block 0's key only; chaining carries it to every later block).
A block without any keeps the plain hash, so requests without extra keys pay nothing.

Three algorithms, one interface:

* ``sha256`` (default): stable across processes and machines, collision-resistant; a router in
  another process can index our events. About 0.5 µs per 16-token block here.
* ``xxh3``: xxh3-128, several times faster, stable across processes; needs the ``xxhash`` extra.
* ``builtin``: Python's own ``hash`` of (parent, secret + bytes): fastest, and keyed with a
  secret drawn once per process. CPython's bytes hash is SipHash under the interpreter's hash
  key, and that key is public when ``PYTHONHASHSEED`` is fixed (0 is common in reproducible
  deployments): two different token blocks whose plain ``hash`` collides can then be found
  offline in minutes, and one tenant's prompt would be served another's KV. With 16 unknown
  bytes in front of every block's bytes the hash values cannot be predicted, so collisions
  cannot be searched for; the cost is one 80-byte concatenation a block (see ``pagedkv bench``).
  Hashes are therefore never stable across processes, even with ``PYTHONHASHSEED`` fixed.

Tokens are hashed as little-endian uint32 (``array('I')``), 4 bytes a token: 64 bytes for a
16-token block, plus the 32-byte parent digest for sha256. A block's extra keys are appended to its
token bytes in a self-delimiting form (a tag byte, a length, the bytes; see :class:`BlockKey`), so
a keyed block's input is longer than any plain block's and two different key lists never give the
same bytes.
"""
from __future__ import annotations

import hashlib
import operator
import os
import sys
from array import array
from bisect import bisect_right
from typing import Any, Callable, Hashable, NamedTuple, Sequence

__all__ = ["ALGORITHMS", "BlockHasher", "BlockKey", "ExtraKeys", "HashMemo", "token_bytes", "MAX_TOKEN_ID", "le_bytes",
           "filled_columns"]

ALGORITHMS = ("sha256", "xxh3", "builtin")
MAX_TOKEN_ID = 2**32 - 1  # token ids are stored as uint32 (every engine's vocabulary fits)
_BIG_ENDIAN = sys.byteorder == "big"
# The builtin algorithm's key: drawn once per process, so that a manager unpickled in the same
# process keeps computing the same hashes.
_PROCESS_SECRET = os.urandom(16)

try:  # OpenSSL's constructor itself: skips hashlib's Python-level wrapper, ~70 ns a block
    from _hashlib import openssl_sha256 as _sha256
except ImportError:  # pragma: no cover - CPython without OpenSSL
    _sha256 = hashlib.sha256


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; raises ValueError for a non-integer or an id
    outside ``[0, 2**32)``. The C-level conversion is also our fastest validator."""
    try:
        buf = array("I", tokens)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]: {exc}") from None
    if _BIG_ENDIAN:  # pragma: no cover - no big-endian CI
        buf.byteswap()
    return buf.tobytes()


_ROOT_BYTES = b"pagedkv/no-salt"  # what the root digest is taken of (the name predates salt keys)


def check_salt(salt: Any) -> str | bytes | None:
    """A ``cache_salt`` as it is keyed: None, a str, or bytes (a bytearray becomes its bytes)."""
    if salt is None or isinstance(salt, (str, bytes)):
        return salt
    if isinstance(salt, bytearray):
        return bytes(salt)
    raise ValueError(f"cache_salt must be None, str or bytes, got {type(salt).__name__}")


# ---- extra keys ------------------------------------------------------------------------------

_TAG_LORA, _TAG_MM, _TAG_SALT = b"\x01", b"\x02", b"\x03"


def _field(value: str | bytes) -> bytes:
    """A str or bytes value, self-delimiting: its kind, its length (4 bytes), its bytes."""
    if isinstance(value, str):
        data = value.encode("utf-8")
        return b"s" + len(data).to_bytes(4, "little") + data
    return b"b" + len(value).to_bytes(4, "little") + value


class BlockKey(NamedTuple):
    """Everything a block's hash covers beyond its parent and its tokens, in two forms.

    ``suffix``: the bytes appended to the block's token bytes when it is hashed: for each key, a
    tag byte (1 LoRA, 2 multimodal item, 3 salt), then its fields self-delimited (kind, 4-byte
    length, bytes; a multimodal offset as 8 signed bytes). ``event``: the same keys as vLLM 0.33
    publishes them in ``BlockStored.extra_keys``, untagged and in vLLM's order: the LoRA name, one
    ``(mm_hash, offset)`` pair per item the block touches (the item's start relative to the
    block's, negative when it began in an earlier block), the salt. ``lora_name``: the adapter, for
    the event's own ``lora_name`` field.

    Example (block size 4, LoRA ``"sql"``, an image ``"img"`` at positions 2..9, salt ``"t"``):
    block 0's event keys are ``("sql", ("img", 2), "t")``, block 1's ``("sql", ("img", -2))``,
    block 3's ``("sql",)``.
    """

    suffix: bytes
    lora_name: str | None
    event: tuple


class ExtraKeys:
    """One request's keys beyond its tokens: a LoRA name, multimodal items, a cache salt.

    ``mm_features`` lists ``(mm_hash, offset, length)`` per item: the hash of the item's content
    (str or bytes, as vLLM's ``identifier``), and its placeholder span, ``length`` positions from
    ``offset``. Spans lie within the prompt, sorted, and never overlap (vLLM's ``mm_features``
    are sorted by position and its placeholders disjoint). Every argument is validated here:
    ValueError names what is wrong. ``block_key(i)`` answers for any block, generated ones too
    (they carry the LoRA name); a block with no key gets None, and hashes as a plain block.

    Built by :meth:`make`, which returns None for a request with no extra keys at all: the
    manager's plain path then never looks here.
    """

    __slots__ = ("lora_name", "mm_features", "cache_salt", "ident", "_bs", "_lora", "_mm_ends", "_mm_fields",
                 "_keyed")

    def __init__(self, block_size: int, num_tokens: int, lora_name: str | None = None,
                 mm_features: Any = None, cache_salt: Any = None) -> None:
        if lora_name is not None and (not isinstance(lora_name, str) or not lora_name):
            raise ValueError(f"lora_name must be None or a non-empty str, got {lora_name!r}")
        salt = check_salt(cache_salt)
        self.lora_name = lora_name
        self.cache_salt = salt
        self.mm_features = _check_mm(mm_features, num_tokens)
        self._bs = block_size
        self._lora = BlockKey(_TAG_LORA + _field(lora_name), lora_name, (lora_name,)) if lora_name else None
        self._mm_ends = [off + n for _, off, n in self.mm_features]
        self._mm_fields = [_TAG_MM + _field(h) for h, _, _ in self.mm_features]
        # block index -> its own key, for the blocks an item touches and a salted block 0: built
        # once, then shared by the hashing and the publishing of the block
        self._keyed: dict[int, BlockKey] = {}
        # what the lookup memo keys on: equal idents give equal keys for every block
        self.ident = (lora_name, self.mm_features, None if salt is None else (type(salt), salt))

    @classmethod
    def make(cls, block_size: int, num_tokens: int, lora_name: str | None = None,
             mm_features: Any = None, cache_salt: Any = None) -> "ExtraKeys | None":
        """The request's extra keys, or None when it has none (no LoRA, no items, no salt)."""
        if lora_name is None and cache_salt is None and (mm_features is None or _empty(mm_features)):
            return None
        return cls(block_size, num_tokens, lora_name, mm_features, cache_salt)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExtraKeys) and self.ident == other.ident and self._bs == other._bs

    def __hash__(self) -> int:
        return hash(self.ident)

    def __repr__(self) -> str:
        return (f"ExtraKeys(lora_name={self.lora_name!r}, mm_features={list(self.mm_features)!r}, "
                f"cache_salt={self.cache_salt!r})")

    def block_keys(self, first: int, stop: int) -> list:
        """The keys of blocks ``first .. stop - 1``: the shared LoRA key (or None) everywhere,
        then each block an item touches, and block 0 when salted, computed on its own. A
        1,000-token prompt under an adapter is one list repeat, not 62 calls."""
        out = [self._lora] * (stop - first)
        touched = set()
        bs = self._bs
        for (_, off, n), end in zip(self.mm_features, self._mm_ends):
            lo, hi = max(off // bs, first), min((end - 1) // bs + 1, stop)
            touched.update(range(lo, hi))
        if first == 0 < stop and self.cache_salt is not None:
            touched.add(0)
        for i in touched:
            out[i - first] = self.block_key(i)
        return out

    def block_key(self, i: int) -> BlockKey | None:
        """Block ``i``'s key (None when it has none). Example: with only a LoRA name, every
        block shares one key; with only a salt, block 0 alone has one."""
        start = i * self._bs
        items = None
        ends = self._mm_ends
        if ends and start < ends[-1]:
            stop = start + self._bs
            j = bisect_right(ends, start)  # the first item ending after the block starts
            feats = self.mm_features
            while j < len(feats) and feats[j][1] < stop:
                if items is None:
                    items = []
                items.append(j)
                j += 1
        if items is None and (i or self.cache_salt is None):
            return self._lora
        key = self._keyed.get(i)
        if key is not None:
            return key
        lora = self._lora
        parts = [lora.suffix] if lora else []
        event = [self.lora_name] if lora else []
        for j in items or ():
            h, off, _ = self.mm_features[j]
            parts.append(self._mm_fields[j] + (off - start).to_bytes(8, "little", signed=True))
            event.append((h, off - start))
        if not i and self.cache_salt is not None:
            parts.append(_TAG_SALT + _field(self.cache_salt))
            event.append(self.cache_salt)
        key = self._keyed[i] = BlockKey(b"".join(parts), self.lora_name, tuple(event))
        return key


def _empty(mm_features: Any) -> bool:
    try:
        return len(mm_features) == 0
    except TypeError:
        return False  # not a sized collection: let the validator say what is wrong


def _check_mm(mm_features: Any, num_tokens: int) -> tuple:
    """``mm_features`` as a tuple of ``(hash, offset, length)`` tuples, validated."""
    if mm_features is None:
        return ()
    if isinstance(mm_features, (str, bytes, bytearray, dict)) or not isinstance(mm_features, (list, tuple)):
        raise ValueError(f"mm_features must be a list of (mm_hash, offset, length), got {type(mm_features).__name__}")
    out = []
    end = 0
    for item in mm_features:
        if not isinstance(item, (list, tuple)) or len(item) != 3:
            raise ValueError(f"each mm_features entry must be (mm_hash, offset, length), got {item!r}")
        h, off, n = item
        if isinstance(h, bytearray):
            h = bytes(h)
        if not isinstance(h, (str, bytes)) or not h:
            raise ValueError(f"an mm_hash must be a non-empty str or bytes, got {h!r}")
        off, n = _position(off, "offset"), _position(n, "length")
        if n < 1:
            raise ValueError(f"multimodal item {h!r}: length must be at least 1, got {n}")
        if off < end:
            raise ValueError(f"multimodal item {h!r} at offset {off} overlaps or precedes the one before "
                             f"(which ends at {end}): spans must be sorted and disjoint")
        if off + n > num_tokens:
            raise ValueError(f"multimodal item {h!r} spans positions {off}..{off + n - 1}, "
                             f"past the prompt's {num_tokens} tokens")
        end = off + n
        out.append((h, off, n))
    return tuple(out)


def _position(value: Any, what: str) -> int:
    if isinstance(value, (bool, float)) or not hasattr(value, "__index__"):
        raise ValueError(f"a multimodal {what} must be an int, got {value!r}")
    value = operator.index(value)
    if value < 0:
        raise ValueError(f"a multimodal {what} must be >= 0, got {value}")
    return value


class BlockHasher:
    """Computes the root and chained block hashes with one algorithm.

    ``chain(parent, data, block_bytes, n)`` hashes ``n`` consecutive blocks of ``data`` in one
    call: a loop specialised per algorithm, so a 2,048-token prompt (128 blocks) costs one Python
    call and 128 digests rather than 128 method calls. ``chain_keyed`` does the same for a request
    with extra keys.
    """

    __slots__ = ("name", "digest", "_root")

    def __reduce__(self):  # the digest is a closure: rebuild it from the algorithm's name
        return (type(self), (self.name,))

    def __init__(self, algo: str = "sha256") -> None:
        if algo not in ALGORITHMS:
            raise ValueError(f"hash_algo must be one of {ALGORITHMS}, got {algo!r}")
        self.name = algo
        self.digest = _make_digest(algo)  # digest(parent, data): one chained block hash
        self._root = self.digest(None, _ROOT_BYTES)

    def root(self, salt: Any = None) -> Hashable:
        """The parent hash of every prompt's first block: one per algorithm (and, for
        ``builtin``, per process). A ``cache_salt`` is validated (ValueError unless None, str or
        bytes) but no longer changes the root: it is in block 0's extra keys, as in vLLM, so a
        salted prompt's first block is chained from the same root as any other and goes on the
        wire with a null parent."""
        check_salt(salt)
        return self._root

    def block(self, parent: Hashable, data: bytes) -> Hashable:
        """Hash of one block's token bytes chained from ``parent``."""
        return self.digest(parent, data)

    def rehash(self, parent: Hashable, tokens: Sequence[int], key: "BlockKey | None" = None) -> Hashable:
        """One block's chained hash from its tokens (and extra keys), as every hash is computed
        (little-endian uint32 bytes, then the key's suffix): what a cache's kept ``(parent,
        tokens[, key])`` must give back, for the checks."""
        data = token_bytes(tokens)
        return self.digest(parent, data + key.suffix if key is not None else data)

    def chain(self, parent: Hashable, data: bytes, block_bytes: int, n: int) -> list:
        """Hashes of the first ``n`` blocks of ``data``, each chained from the one before.

        The loop is a comprehension inlined per algorithm (no Python call per block): 68 sha256
        blocks (a 1,100-token prompt) cost about 25 µs here, against 35 µs through a per-block
        function.
        """
        stops = range(0, n * block_bytes, block_bytes)
        p = parent
        if self.name == "sha256":
            sha = _sha256
            return [p := sha(p + data[i : i + block_bytes]).digest() for i in stops]
        if self.name == "xxh3":
            import xxhash

            xxh = xxhash.xxh3_128_digest
            return [p := xxh(p + data[i : i + block_bytes]) for i in stops]
        key = _PROCESS_SECRET
        return [p := hash((p, key + data[i : i + block_bytes])) for i in stops]

    def chain_keyed(self, parent: Hashable, data: bytes, block_bytes: int, first: int, n: int,
                    keys: ExtraKeys | None) -> list:
        """Like :meth:`chain`, for blocks ``first .. first + n - 1`` of a request with extra keys
        ``keys`` (None: a plain request, hashed by :meth:`chain`): ``data`` holds those blocks'
        token bytes, and each block's key suffix (if any) is appended to its bytes before it is
        hashed."""
        if keys is None:
            return self.chain(parent, data, block_bytes, n)
        suffixes = [k.suffix if k is not None else b"" for k in keys.block_keys(first, first + n)]
        rows = zip(range(0, n * block_bytes, block_bytes), suffixes)
        p = parent
        if self.name == "sha256":  # as chain(), one inlined loop per algorithm
            sha = _sha256
            return [p := sha(p + data[i : i + block_bytes] + suffix).digest() for i, suffix in rows]
        if self.name == "xxh3":
            import xxhash

            xxh = xxhash.xxh3_128_digest
            return [p := xxh(p + data[i : i + block_bytes] + suffix) for i, suffix in rows]
        key = _PROCESS_SECRET
        return [p := hash((p, key + data[i : i + block_bytes] + suffix)) for i, suffix in rows]


def _make_digest(algo: str) -> Callable[[Any, bytes], Hashable]:
    if algo == "sha256":
        sha = _sha256

        def digest(parent, data):
            return sha(parent + data).digest() if parent is not None else sha(data).digest()

        return digest
    if algo == "xxh3":
        try:
            import xxhash
        except ImportError:
            raise ImportError(
                'hash_algo="xxh3" needs the xxhash package: pip install "pagedkv[xxhash]"'
            ) from None
        xxh = xxhash.xxh3_128_digest

        def digest(parent, data):
            return xxh(parent + data) if parent is not None else xxh(data)

        return digest

    key = _PROCESS_SECRET

    def digest(parent, data):
        return hash((parent, key + data))

    return digest


class HashMemo:
    """Prompts' chained block hashes, computed by a lookup and kept for the admission of the same
    prompt: a scheduler that looks a waiting request up every step hashes its prompt once, as
    vLLM keeps the hashes on the request. Least recently used first out, bounded by prompts
    (``max_entries``) and by hashes in all (``max_blocks``), whichever binds first: at 256
    prompts and 65,536 hashes (about 5 MiB) a few 100,000-token prompts cannot make it hold
    hundreds of MiB. A prompt of more than ``max_blocks`` full blocks is never kept.

    The key is the caller's; :meth:`chained` (the manager's) uses (extra keys' identity, sha256
    of the prompt's bytes), so equal keys mean equal prompts under equal extra keys whatever the
    algorithm.
    """

    __slots__ = ("_memo", "_held", "max_entries", "max_blocks", "entries")

    def __init__(self, max_entries: int, max_blocks: int) -> None:
        self._memo: dict[Hashable, list] = {}  # insertion order is recency order
        self._held = 0  # hashes held by all entries
        self.max_entries = max_entries
        self.max_blocks = max_blocks
        # Prompts held: an attribute, not __len__, so that an admission asks "is the memo
        # empty?" (and skips hashing its prompt's bytes for a key) without a Python call.
        self.entries = 0

    def get(self, key: Hashable) -> list | None:
        """The hashes kept under ``key`` (now the most recently used), or None."""
        hashes = self._memo.pop(key, None)
        if hashes is not None:
            self._memo[key] = hashes
        return hashes

    def put(self, key: Hashable, hashes: list) -> None:
        """Keep ``hashes`` under ``key``, dropping the least recently used entries over the
        bounds. Example (bounds 3 prompts, 10 hashes): prompts of 3, 3, 3 hashes, then one of 2
        -> the first is dropped (4 prompts), leaving 8 hashes."""
        if len(hashes) > self.max_blocks:
            return
        memo = self._memo
        old = memo.pop(key, None)
        if old is not None:
            self._held -= len(old)
        memo[key] = hashes
        self._held += len(hashes)
        while len(memo) > self.max_entries or self._held > self.max_blocks:
            self._held -= len(memo.pop(next(iter(memo))))
        self.entries = len(memo)

    def chained(self, hasher: BlockHasher, root: Hashable, keys: ExtraKeys | None, data: bytes,
                block_size: int, remember: bool) -> list:
        """The chained hashes (``hasher``, from ``root``) of a prompt's full blocks (``data``:
        its tokens' little-endian uint32 bytes), from the memo if a lookup computed them.
        ``remember`` (a lookup) keeps what it computes; an admission gets a copy (the list
        becomes the sequence's own, and a failed admission, retried next step, still finds the
        entry). The key is the extra keys' identity (None for a plain request) and a sha256 of
        the prompt's bytes. Example (block size 16): a 40-token prompt -> 2 hashes."""
        if self.entries or remember:
            key = (keys.ident if keys is not None else None, hashlib.sha256(data).digest())
            hashes = self.get(key)
            if hashes is not None:
                return hashes if remember else hashes.copy()
        hashes = hasher.chain_keyed(root, data, 4 * block_size, 0, len(data) // (4 * block_size), keys)
        if remember:
            self.put(key, hashes)
        return hashes


def _le_bytes_swapped(tokens: array) -> bytes:  # pragma: no cover - no big-endian CI
    tokens = tokens[:]
    tokens.byteswap()
    return tokens.tobytes()


# The tokens' bytes as little-endian uint32, the form every hash is computed over: on a
# little-endian machine that is the array's own memory, and the C method is called directly.
le_bytes = _le_bytes_swapped if _BIG_ENDIAN else array.tobytes


def filled_columns(filled, bs: int, digest, root: Hashable) -> tuple[list, list, list, list, list | None]:
    """Each sequence's last block just filled: hash it, chained from the sequence's last hash
    (``root`` for its first block) with ``digest(parent, bytes)``, append the hash to the
    sequence's chain, and return the columns ``PrefixCache.publish_blocks`` takes: blocks,
    hashes, parents, tokens, and one :class:`~pagedkv.hashing.BlockKey` (or None) per block once
    a filled sequence has extra keys (None when none has). One call per decode step, not per
    block, and one loop (the decode path's). Any sequence with ``table``, ``tokens``, ``hashes``
    and ``keys`` will do: the grouped manager passes its own, whose ``table`` is group 0's, and
    publishes the one hash in every group. Example (block size 4): a sequence of 8 tokens in
    [3, 5] -> ([5], [h1], [h0], [its last 4 tokens], None), with h1 appended to its hashes."""
    blocks, hashes, parents, tokens = [], [], [], []
    block_keys = None
    for s in filled:
        block_tokens = s.tokens[-bs:]
        chain = s.hashes
        parent = chain[-1] if chain else root
        if s.keys is None:
            h = digest(parent, le_bytes(block_tokens))
        else:
            key = s.keys.block_key(len(chain))
            if block_keys is None:
                block_keys = [None] * len(blocks)
            data = le_bytes(block_tokens)
            h = digest(parent, data + key.suffix if key is not None else data)
        if block_keys is not None:
            block_keys.append(None if s.keys is None else key)
        chain.append(h)
        blocks.append(s.table[-1])
        hashes.append(h)
        parents.append(parent)
        tokens.append(block_tokens)
    return blocks, hashes, parents, tokens, block_keys
