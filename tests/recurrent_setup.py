"""The recurrent hybrids the decoder tests share: tiny seeded transformers models (Qwen3-Next
dense and with experts, Bamba) of one layer pattern, their references, and ``Runner``, a
hand-driven allocator that hands out K/V blocks and state blocks from one pool and applies the
contract's ``state_indices`` rule; and ``Engine``, a small engine loop over a real
``KVCacheManager`` whose groups follow the model's layers.

torch and transformers are imported inside the functions that need them, so a suite that uses
only ``Runner`` imports this module without them.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

import numpy as np

from pagedkv import KVCacheManager, RecurrentState
from pagedkv.bamba import PagedBamba
from pagedkv.qwen3_next import PagedQwen3Next
from pagedkv.types import CopyOp

BLOCK = 4
INTERVAL = 8  # the state group's checkpoint interval T
LAYERS = ("linear_attention", "linear_attention", "full_attention", "linear_attention")


CONFIGS = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=0, layer_types=list(LAYERS),
        rope_theta=500.0, partial_rotary_factor=0.25)),
    "qwen3_next_moe": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, layer_types=list(LAYERS), num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1],
        rope_theta=500.0, partial_rotary_factor=0.25)),
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[LAYERS.index("full_attention")],
        mamba_n_heads=8, mamba_d_head="auto", mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=1, mamba_chunk_size=16, rope_theta=500.0)),
}
DECODERS = {"qwen3_next": PagedQwen3Next, "qwen3_next_moe": PagedQwen3Next, "bamba": PagedBamba}


def tiny_hybrid(arch: str, seed: int = 0):
    """A seeded random transformers hybrid of the layer pattern :data:`LAYERS`, its norms,
    ``dt_bias``, ``A_log`` (and Mamba2's ``D``) moved off their initial values."""
    import torch
    import transformers

    config_cls, model_cls, extra = CONFIGS[arch]
    if arch == "bamba" and int(transformers.__version__.split(".")[0]) < 5:
        # transformers 4.x's Bamba normalises the gated output over all groups at once (5.x and
        # mamba_ssm: per group); with one group the two agree
        extra = {**extra, "mamba_n_groups": 1}
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, initializer_range=0.1,
        max_position_embeddings=512, pad_token_id=0, bos_token_id=None, eos_token_id=None, **extra)
    hf = getattr(transformers, model_cls)(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith("mamba.D"):
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
            elif name.endswith("dt_bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.02, 0.5, generator=g).log())
    return hf


def hf_logits(hf, seq):
    """transformers' logits at every position of one sequence, without a cache."""
    import torch

    with torch.no_grad():
        return hf(torch.tensor([seq]), use_cache=False).logits[0].numpy()


def hf_generate(hf, prompt, new):
    """transformers' own greedy generate, with its own cache (conv and recurrent states)."""
    import torch

    out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                      output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits, 1)[0].numpy()


class Runner:
    """A hand-driven allocator for both groups over one pool of block ids, and the decoder.

    K/V (group 0): a block table per sequence, a fresh block per ``BLOCK`` positions. States
    (group 1): a table of entries per sequence, one per ``INTERVAL`` positions, filled by
    :meth:`state_ids` with the contract's rule. ``shared`` holds the state blocks a fork shares:
    the first write into one copies it (``CopyOp(src, dst, group=1)``) unless ``copy_on_fork`` is
    False (the negative control: both sequences then write the shared block).
    """

    def __init__(self, model, num_blocks=96, seed=0, copy_on_fork=True):
        self.model = model
        self.kv, self.states = model.new_stores(num_blocks, BLOCK, host_blocks=8)
        self.free = np.random.default_rng(seed).permutation(num_blocks).tolist()
        self.tables, self.entries, self.tokens = {}, {}, {}
        self.shared, self.copies, self.copy_on_fork = set(), [], copy_on_fork

    def block(self):
        return self.free.pop()

    def admit(self, seq, table=(), entries=None, cached=()):
        """A new sequence; a prefix hit passes its shared K/V blocks, its state entries and the
        cached tokens."""
        self.tables[seq], self.entries[seq], self.tokens[seq] = list(table), dict(entries or {}), list(cached)

    def state_ids(self, seq, a, b):
        """(read, write) for a call scheduling positions a .. b-1: read entry (a-1)//T (-1 at
        a = 0), write entry (b-1)//T, in place when they are the same entry (copied first when a
        fork shares it), a fresh block when they differ."""
        entries = self.entries[seq]
        read = -1 if a == 0 else entries[(a - 1) // INTERVAL]
        if a and (a - 1) // INTERVAL == (b - 1) // INTERVAL:
            if read in self.shared and self.copy_on_fork:
                write = self.block()
                self.copies.append(CopyOp(read, write, group=1))
                self.shared.discard(read)
                entries[(a - 1) // INTERVAL] = write
                return write, write  # the copy runs before the step: read the private block
            return read, read
        write = self.block()
        entries[(b - 1) // INTERVAL] = write
        return read, write

    def step(self, chunks, reads=None, snapshots=None):
        """One forward for ``{seq: tokens}`` (the sequence's next tokens); ``reads`` overrides a
        sequence's state read (a negative control), ``snapshots`` gives a sequence's
        ``state_snapshots`` entry. Returns ``{seq: logits [n, vocab]}``."""
        ids, slots, lens, qlens, rd, wr = [], [], [], [], [], []
        for seq, toks in chunks.items():
            a = len(self.tokens[seq])
            b = a + len(toks)
            while len(self.tables[seq]) * BLOCK < b:
                self.tables[seq].append(self.block())
            table = self.tables[seq]
            slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(a, b)]
            read, write = self.state_ids(seq, a, b)
            rd.append((reads or {}).get(seq, read))
            wr.append(write)
            ids += toks
            lens.append(b)
            qlens.append(len(toks))
            self.tokens[seq] += toks
        self.states.copy_blocks(self.copies)
        self.copies = []
        width = max(len(self.tables[s]) for s in chunks)
        tables = np.full((len(chunks), width), -1)
        for i, s in enumerate(chunks):
            tables[i, :len(self.tables[s])] = self.tables[s]
        rd, wr = np.asarray(rd, dtype=np.int32), np.asarray(wr, dtype=np.int32)  # as state_indices
        snaps = None if snapshots is None else [snapshots.get(s) for s in chunks]
        logits = self.model.forward(self.kv, self.states, ids, slots, tables, lens, qlens,
                                    state_read=rd, state_write=wr, state_snapshots=snaps)
        out, at = {}, 0
        for s, n in zip(chunks, qlens):
            out[s], at = logits[at:at + n], at + n
        return out

    def rollback(self, seq, keep, entry_block):
        """Keep the sequence's first ``keep`` tokens (rejected drafts dropped: their K/V slots are
        written again later) and make ``entry_block`` the running state entry (the state after
        position ``keep - 1``)."""
        self.tokens[seq] = self.tokens[seq][:keep]
        self.entries[seq] = {(keep - 1) // INTERVAL: entry_block}

    def fork(self, parent, child):
        """The child shares every K/V block and every state entry (the K/V tail here is full)."""
        assert len(self.tokens[parent]) % BLOCK == 0
        self.tables[child], self.tokens[child] = list(self.tables[parent]), list(self.tokens[parent])
        self.entries[child] = dict(self.entries[parent])
        self.shared |= set(self.entries[parent].values())

    def prefill(self, seq, tokens, chunk):
        out = [self.step({seq: tokens[i:i + chunk]})[seq] for i in range(0, len(tokens), chunk)]
        return np.concatenate(out)

    def greedy(self, seq, first, new):
        """Decode ``new`` tokens from ``first`` (the argmax of the last prompt logits); returns
        the tokens and each step's logits row."""
        toks, rows = [first], []
        for _ in range(new - 1):
            rows.append(self.step({seq: [toks[-1]]})[seq][-1])
            toks.append(int(np.argmax(rows[-1])))
        return toks, rows


class Engine:
    """A small engine loop over a real ``KVCacheManager`` and the decoder's two stores.

    The manager's groups follow the model's layers: its attention groups (``model.kv_groups``,
    the full-attention layers: group 0) and then one state group for every recurrent layer
    (``RecurrentState(INTERVAL)``, or ``state_spec``). The scheduling calls (``admit``,
    ``prefill``, ``decode``) record the positions a .. b - 1 each sequence's call scheduled;
    :meth:`run` is the step: ``take_copies()``, the attention groups' copies on the K/V store
    and the state group's on the state store (skipped when ``state_copies`` is False: the
    negative control), then one forward with group 0's slots and tables and the state group's
    ``state_indices``. ``log`` keeps every step's (copies, {sequence: (a, b, read, write)}).
    """

    def __init__(self, model, num_blocks=96, state_spec=None, state_copies=True):
        kv_groups = list(model.kv_groups)
        self.g = len(kv_groups)  # the state group's index
        self.m = KVCacheManager(num_blocks, BLOCK, groups=kv_groups + [state_spec or RecurrentState(INTERVAL)])
        self.kv, self.states = model.new_stores(num_blocks, BLOCK, state_group=self.g)
        self.model, self.state_copies = model, state_copies
        self.pending, self.log = {}, []

    def _scheduled(self, sid, a):
        b = self.m.num_computed(sid)
        if b > a:
            self.pending[sid] = (a, b)

    def admit(self, sid, prompt, chunk=None):
        """``add_sequence`` (the first ``chunk`` positions past the hit, or the whole prompt);
        returns the hit."""
        hit = self.m.add_sequence(sid, prompt, prefill=chunk)
        self._scheduled(sid, hit)
        return hit

    def prefill(self, sid, n):
        a = self.m.num_computed(sid)
        self.m.prefill(sid, n)
        self._scheduled(sid, a)

    def decode(self, tokens):
        """One decode token per sequence, ``{sequence: token}``, in one ``append_batch``."""
        before = {sid: self.m.num_computed(sid) for sid in tokens}
        self.m.append_batch(list(tokens), list(tokens.values()))
        for sid, a in before.items():
            self._scheduled(sid, a)

    def run(self):
        """The step for every sequence scheduled since the last one; ``{sequence: logits}``."""
        m, sids = self.m, list(self.pending)
        copies = m.take_copies()
        self.kv.copy_blocks([c for c in copies if not m.groups[c.group].holds_state])
        if self.state_copies:
            self.states.copy_blocks(copies)
        ids, slots, lens, qlens = [], [], [], []
        for sid in sids:
            a, b = self.pending[sid]
            ids += m.tokens(sid)[a:b]
            slots += m.slots(sid, a, b, group=0).tolist()
            lens.append(b)
            qlens.append(b - a)
        read, write = m.state_indices(sids, group=self.g)
        io = zip(sids, read.tolist(), write.tolist())
        self.log.append((copies, {s: (*self.pending[s], r, w) for s, r, w in io}))
        logits = self.model.forward(self.kv, self.states, ids, slots, m.block_tables(sids, group=0), lens, qlens,
                                    state_read=read, state_write=write)
        self.pending = {}
        out, at = {}, 0
        for sid, n in zip(sids, qlens):
            out[sid], at = logits[at:at + n], at + n
        return out

    def prompt(self, sid, tokens, chunk):
        """Admit a prompt and prefill it in chunks of ``chunk``, a step each; returns the hit and
        the logits of the positions computed (past the hit)."""
        hit = self.admit(sid, tokens, chunk)
        rows = [self.run()[sid]]
        while self.m.num_computed(sid) < len(tokens):
            self.prefill(sid, min(chunk, len(tokens) - self.m.num_computed(sid)))
            rows.append(self.run()[sid])
        return hit, np.concatenate(rows)

    def greedy(self, sid, first, new):
        """Decode ``new`` tokens from ``first`` (the argmax of the last prompt logits); returns
        the tokens and each step's logits row."""
        toks, rows = [first], []
        for _ in range(new - 1):
            self.decode({sid: toks[-1]})
            rows.append(self.run()[sid][-1])
            toks.append(int(np.argmax(rows[-1])))
        return toks, rows


# ---- shared by the oracle tests of the recurrent decoders: one module-scoped model per config


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of a module that imports these runs with one torch thread (see conftest)."""


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def hf(arch):
    return tiny_hybrid(arch)


@pytest.fixture(scope="module")
def model(arch, hf):
    return DECODERS[arch].from_transformers(hf)


@dataclass(frozen=True)
class EarlyCheckpoint(RecurrentState):
    """The control: a hit of h tokens starts from the checkpoint one interval early (the state
    after position h - T - 1), as an off-by-one in the hit rule would."""

    def hit_blocks(self, hit, block_size):
        step = self.interval // block_size
        return [hit // block_size - 1 - step] if hit // block_size > step else []

    def shorten_hit(self, k, block_size, cached):
        step = self.interval // block_size
        k -= k % step
        while k > step and cached(k - 1 - step) is None:
            k -= step
        return k if k > step else 0
