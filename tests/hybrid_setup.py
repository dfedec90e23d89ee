"""The hybrid decoder's test harness: a tiny Qwen2-style model with sliding-window layers, a
stand-in grouped allocator, and a step runner that works with it or with the real grouped
manager.

Why a stand-in: the grouped ``KVCacheManager(groups=[...])`` (contract v3) is being built in
parallel. ``ToyGroups`` follows the contract's rules and nothing more, so that the decoder's
paged path is proven now: one pool of block ids shared by every group; one table per group;
before a call schedules positions, each windowed group releases the blocks wholly below
``spec.released_below(committed, block_size)`` (their entries read -1); a released or freed
full block that was published stays revivable under the key (group, token prefix); a prefix
hit of h tokens is the longest h for which every group finds ``spec.hit_blocks(h, block_size)``
(the entries a group does not need read -1); fork shares every live block; appending into a
shared partial block copies it (copy-on-write, one ``(src, dst)`` pair). Allocation takes a clean
block first, then evicts the least recently released cached one, and calls ``on_alloc(block)``
so that a test can overwrite it with garbage, as reused memory would be; ``on_release(block)``
is called when a block's last reference goes (a test that overwrites it there models a pool
so busy that another request reuses every released block at once).

``EarlyWindow`` and ``StaleTables`` are the engine's negative control on the real grouped manager
(tests/test_engine_hybrid_*.py): a window released one position early, read through stale
tables from blocks overwritten with garbage.

``Runner`` drives either allocator through the same calls (``add_sequence``, ``prefill``,
``append_token``, ``fork``, ``take_copies``, ``block_tables(ids, group=g)``, ``slots(id, start,
stop, group=g)``), so the test that switches to the real manager is the same code.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from pagedkv import OutOfBlocks
from pagedkv import KVCacheManager as GroupedKVCacheManager
from pagedkv.kv_specs import ChunkedLocalAttention, FullAttention, SlidingWindow
from pagedkv.model import LlamaDims, PagedLlama

PAD = 0
WINDOW = 7  # not a multiple of the block size: a window starts mid-block
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def tiny_qwen2(seed: int = 0, window: int = WINDOW, layer_types=LAYER_TYPES, **overrides):
    """A seeded random Qwen2ForCausalLM: Llama plus q/k/v biases, with ``layer_types`` mixing
    sliding-window (``window``) and full-attention layers (hidden 64, 4 heads on 2 KV heads)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        hidden_size=64, num_hidden_layers=len(layer_types), num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, intermediate_size=128, max_position_embeddings=512,
        rope_theta=500.0, initializer_range=0.1, use_sliding_window=True, sliding_window=window,
        max_window_layers=0, layer_types=list(layer_types), pad_token_id=PAD, bos_token_id=None,
        eos_token_id=None, tie_word_embeddings=False, attn_implementation="sdpa", **overrides)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers initialises biases to 0: give them values, so they count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    return model


def random_hybrid(specs, seed: int = 0, dtype: str = "float64") -> PagedLlama:
    """A seeded numpy decoder with this layer pattern (the test model's other dims)."""
    dims = LlamaDims(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=len(specs),
                     num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=500.0,
                     layer_specs=tuple(specs))
    return PagedLlama.random(dims, seed=seed, dtype=dtype)


# ---- the stand-in grouped allocator


class ToyGroups:
    """A minimal grouped allocator with the contract-v3 rules (see the module docstring).

    ``release_shift`` moves the release rule by that many positions (1: a block goes one
    position too early, the negative control); ``stale_tables`` keeps a released block's id in
    the table instead of -1 (a kernel that would then read whatever reused the block).
    """

    def __init__(self, num_blocks, block_size, groups, *, on_alloc=None, on_release=None,
                 release_shift=0, stale_tables=False):
        self.block_size, self.groups = block_size, tuple(groups)
        self.num_groups = len(self.groups)
        self.on_alloc, self.on_release = on_alloc, on_release
        self.release_shift, self.stale_tables = release_shift, stale_tables
        self.clean = list(range(num_blocks - 1, -1, -1))  # LIFO: block 0 first
        self.cached = OrderedDict()  # released full blocks, least recently released first
        self.ref = [0] * num_blocks
        self.key_of = {}  # block -> (group, prefix tuple)
        self.block_of = {}  # (group, prefix tuple) -> block
        self.tables, self.released, self.tokens, self.computed = {}, {}, {}, {}
        self.copies = []

    # -- blocks

    def _alloc(self):
        if self.clean:
            b = self.clean.pop()
        elif self.cached:
            b, _ = self.cached.popitem(last=False)
            del self.block_of[self.key_of.pop(b)]
        else:
            raise OutOfBlocks(1, 0)
        self.ref[b] = 1
        if self.on_alloc is not None:
            self.on_alloc(b)
        return b

    def _drop(self, b):
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if self.on_release is not None:
                self.on_release(b)
            if b in self.key_of:
                self.cached[b] = None
            else:
                self.clean.append(b)

    def _take(self, b):
        if self.ref[b] == 0:
            del self.cached[b]
        self.ref[b] += 1

    def _key(self, g, toks, i):
        return (g, tuple(toks[: (i + 1) * self.block_size]))

    # -- the contract's calls

    def lookup(self, prompt):
        bs = self.block_size
        for h in range((len(prompt) - 1) // bs * bs, 0, -bs):
            if all(self._key(g, prompt, i) in self.block_of
                   for g, spec in enumerate(self.groups) for i in spec.hit_blocks(h, bs)):
                return h
        return 0

    def add_sequence(self, sid, prompt, prefill=None):
        assert sid not in self.tables
        h = self.lookup(prompt)
        self.tokens[sid], self.computed[sid] = list(prompt), h
        self.tables[sid] = []
        self.released[sid] = []
        for g, spec in enumerate(self.groups):
            need = set(spec.hit_blocks(h, self.block_size))
            row = []
            for i in range(h // self.block_size):
                if i in need:
                    b = self.block_of[self._key(g, prompt, i)]
                    self._take(b)
                    row.append(b)
                else:
                    row.append(-1)
            self.tables[sid].append(row)
            self.released[sid].append(spec.first_read(h) // self.block_size)
        rest = len(prompt) - h
        self.prefill(sid, rest if prefill is None else min(prefill, rest))
        return h

    def _release(self, sid):
        c = self.computed[sid]
        for g, spec in enumerate(self.groups):
            below = min(spec.first_read(c) + self.release_shift, c) // self.block_size
            row = self.tables[sid][g]
            for i in range(self.released[sid][g], below):
                if row[i] >= 0:
                    self._drop(row[i])
                    if not self.stale_tables:
                        row[i] = -1
            self.released[sid][g] = max(self.released[sid][g], below)

    def _schedule(self, sid, n):
        self._release(sid)
        c, bs, toks = self.computed[sid], self.block_size, self.tokens[sid]
        for g in range(self.num_groups):
            row = self.tables[sid][g]
            if c % bs and n and self.ref[row[-1]] > 1:  # copy-on-write of a shared partial block
                new = self._alloc()
                self.copies.append((row[-1], new, g))  # CopyOp's fields: src, dst, group
                self._drop(row[-1])
                row[-1] = new
            while len(row) * bs < c + n:
                row.append(self._alloc())
            for i in range(c // bs, (c + n) // bs):  # blocks completed now are published
                key = self._key(g, toks, i)
                if key not in self.block_of and row[i] >= 0:
                    self.block_of[key], self.key_of[row[i]] = row[i], key
        self.computed[sid] = c + n

    def prefill(self, sid, n):
        assert self.computed[sid] + n <= len(self.tokens[sid])
        self._schedule(sid, n)
        return self.slots(sid, self.computed[sid] - n, self.computed[sid])

    def append_token(self, sid, token):
        assert self.computed[sid] == len(self.tokens[sid])
        self.tokens[sid].append(int(token))
        self._schedule(sid, 1)
        return int(self.slots(sid, self.computed[sid] - 1, self.computed[sid])[0])

    def fork(self, parent, child):
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]
        self.released[child] = list(self.released[parent])
        self.tables[child] = [list(r) for r in self.tables[parent]]
        for g, row in enumerate(self.tables[child]):
            for b in row[self.released[child][g]:]:
                if b >= 0:
                    self._take(b)

    def free(self, sid):
        for g, row in enumerate(self.tables.pop(sid)):
            for b in reversed(row[self.released[sid][g]:]):
                if b >= 0:
                    self._drop(b)
        for d in (self.released, self.tokens, self.computed):
            del d[sid]

    def take_copies(self):
        out, self.copies = self.copies, []
        return out

    def num_computed(self, sid):
        return self.computed[sid]

    def block_tables(self, ids, pad=-1, group=0):
        rows = [self.tables[s][group] for s in ids]
        out = np.full((len(rows), max(map(len, rows), default=0)), pad, dtype=np.int32)
        for i, r in enumerate(rows):
            out[i, : len(r)] = r
        return out

    def slots(self, sid, start, stop, group=0):
        row, bs = self.tables[sid][group], self.block_size
        pos = np.arange(start, stop)
        return np.array([row[p // bs] for p in pos], dtype=np.int64) * bs + pos % bs

    def num_free_blocks(self):
        return len(self.clean) + len(self.cached)


# ---- one engine step at a time, through either allocator


def as_numpy(x):
    """A numpy copy of a numpy array or a torch tensor."""
    if hasattr(x, "detach"):
        return x.detach().cpu().float().numpy()
    return np.asarray(x)


class Runner:
    """Schedules with an allocator, then runs the step through the paged decoder.

    ``admit``, ``prefill``, ``append`` and ``fork`` schedule; ``step()`` runs everything
    scheduled since the last step (copies first, then the forward) and returns each sequence's
    logits for the positions it computed.
    """

    def __init__(self, model, alloc, store):
        self.model, self.alloc, self.store = model, alloc, store
        self.tokens, self.work = {}, {}
        self.hybrid = len(model.kv_groups) > 1

    def admit(self, sid, prompt, chunk=None):
        hit = self.alloc.add_sequence(sid, prompt, prefill=chunk)
        self.tokens[sid] = list(prompt)
        self.work[sid] = (hit, self.alloc.num_computed(sid))
        return hit

    def prefill(self, sid, n):
        start = self.alloc.num_computed(sid)
        self.alloc.prefill(sid, n)
        self.work[sid] = (start, start + n)

    def append(self, sid, token):
        start = self.alloc.num_computed(sid)
        self.alloc.append_token(sid, int(token))
        self.tokens[sid].append(int(token))
        self.work[sid] = (start, start + 1)

    def fork(self, parent, child):
        self.alloc.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    def step(self):
        work = {s: w for s, w in self.work.items() if w[1] > w[0]}
        self.work = {}
        self.store.copy_blocks(self.alloc.take_copies())
        if not work:
            return {}
        sids = list(work)
        ids = np.concatenate([self.tokens[s][a:b] for s, (a, b) in work.items()])
        lens = [b for a, b in work.values()]
        qlens = [b - a for a, b in work.values()]
        per_group = []
        for g in range(len(self.model.kv_groups)):
            slots = np.concatenate([self.alloc.slots(s, a, b, group=g) for s, (a, b) in work.items()])
            per_group.append((slots, self.alloc.block_tables(sids, group=g)))
        if self.hybrid:
            slots, tables = [p[0] for p in per_group], [p[1] for p in per_group]
        else:
            slots, tables = per_group[0]
        logits = as_numpy(self.model.forward(self.store, ids, slots, tables, lens, qlens))
        cuts = np.cumsum(qlens)[:-1]
        return dict(zip(sids, np.split(logits, cuts)))


def greedy(runner, prompts, new_tokens, chunk=None):
    """Greedy decoding of every prompt at once, prompts in chunks of ``chunk`` tokens (all at
    once when None); returns per prompt the tokens and the logits that chose them
    ``[new_tokens, vocab]``, and the prefix hits."""
    sids = [f"s{i}" for i in range(len(prompts))]
    hits = [runner.admit(s, p, chunk) for s, p in zip(sids, prompts)]
    toks = {s: [] for s in sids}
    logits = {s: [] for s in sids}
    while any(len(toks[s]) < new_tokens for s in sids):
        out = runner.step()
        for s, p in zip(sids, prompts):
            if s in out and runner.alloc.num_computed(s) >= len(p) and len(toks[s]) < new_tokens:
                row = out[s][-1]
                toks[s].append(int(np.argmax(row)))
                logits[s].append(row)
        for s, p in zip(sids, prompts):
            done = runner.alloc.num_computed(s)
            if done < len(p):
                runner.prefill(s, min(chunk or len(p), len(p) - done))
            elif len(toks[s]) < new_tokens:
                runner.append(s, toks[s][-1])
    return [toks[s] for s in sids], [np.stack(logits[s]) for s in sids], hits


def greedy_from(runner, sid, new_tokens):
    """Continue one admitted sequence greedily (its next step already scheduled): its tokens and
    the logits that chose them."""
    toks, logits = [], []
    for _ in range(new_tokens):
        row = runner.step()[sid][-1]
        toks.append(int(np.argmax(row)))
        logits.append(row)
        runner.append(sid, toks[-1])
    return toks, np.stack(logits)


def poison(store, seed=0):
    """An ``on_alloc`` that fills a newly allocated block with large garbage in every layer, as
    memory another request used would hold: a read of a stale or released block cannot hide."""
    rng = np.random.default_rng(seed)

    def fill(block):
        shape = store.kv[:, :, block].shape
        store.kv[:, :, block] = store.kv.new_tensor(rng.normal(0, 50, shape)) if hasattr(
            store.kv, "new_tensor") else rng.normal(0, 50, shape)
    return fill


SPECS = {"full": FullAttention(), "sliding": SlidingWindow(WINDOW), "chunked": ChunkedLocalAttention(6)}


# ---- the engine's negative control on the real grouped manager


class EarlyWindow(SlidingWindow):
    """A window whose blocks are released one position before its queries stop reading them
    (the control); it compares equal to the model's window, so the engine accepts the manager."""

    def released_below(self, computed, block_size):
        return super().released_below(computed + 1, block_size)

    def __eq__(self, other):
        return isinstance(other, SlidingWindow) and other.window == self.window

    __hash__ = SlidingWindow.__hash__


class StaleTables(GroupedKVCacheManager):
    """The control's manager: its window group releases early (``EarlyWindow``), and its
    ``block_tables`` keep a released block's id where it read one (as a kernel given a stale
    table would); a block nobody holds any more is filled with garbage in ``store``, as reused
    memory would be."""

    store = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = {}  # (seq, group) -> the row with every id it ever held
        self.rng = np.random.default_rng(0)

    def block_tables(self, seq_ids, pad=-1, group=0):
        out = super().block_tables(seq_ids, pad, group)
        for i, seq in enumerate(seq_ids):
            row = self.seen.setdefault((seq, group), [])
            cur = self.block_table(seq, group=group)
            row += [-1] * (len(cur) - len(row))
            for j, b in enumerate(cur):
                if b >= 0:
                    row[j] = b
                elif row[j] >= 0:
                    out[i, j] = row[j]
                    if self.refcount(row[j]) == 0 and self.store is not None:
                        kv = self.store.kv
                        junk = self.rng.normal(0, 50, kv[:, :, row[j]].shape)
                        kv[:, :, row[j]] = kv.new_tensor(junk) if hasattr(kv, "new_tensor") else junk
        return out
