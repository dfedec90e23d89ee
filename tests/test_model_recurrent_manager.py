"""The recurrent hybrid decoders driven by the real allocator: a ``KVCacheManager`` with
``groups=[FullAttention(), RecurrentState(8)]`` (block size 4) hands out every K/V slot, block
table, copy and state block, and the logits must equal transformers' own model.

``recurrent_setup.Engine`` is the engine loop: the scheduling calls (``add_sequence`` with a
chunk, ``prefill``, ``append_batch``), then ``take_copies()`` run on both stores (the attention
group's copies on the K/V store, the state group's on the state store), then one forward with
group 0's slots and tables and ``state_indices(ids, group=1)``. Greedy tokens and logits match
within 1e-4 through chunked prefill whose chunks cross interval ends, decode across interval
ends, a second request whose prefix hit starts from a published checkpoint (after the first
request is freed: cached-free blocks revived) and a fork whose two sequences each append their
own tokens (copy-on-write of the shared K/V block and of the shared running state). Negative
controls move the logits by more than 0.1: the step's state copies skipped, and a hit that
starts from the checkpoint one interval early.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_next")
pytest.importorskip("transformers.models.bamba")

from llama_setup import prompts_of  # noqa: E402
from recurrent_setup import _one_thread, arch, hf, model  # noqa: E402,F401 (the shared fixtures)
from recurrent_setup import EarlyCheckpoint, BLOCK, INTERVAL, Engine, hf_generate, hf_logits  # noqa: E402

pytestmark = pytest.mark.oracle
ATOL = 1e-4


def test_groups_follow_the_model_layers(model):
    """Group 0 is the attention layers' (the K/V store holds model layer 2 only), group 1 the
    three recurrent layers' (the state store, tagged group 1, holds layers 0, 1 and 3)."""
    e = Engine(model)
    assert [type(g).__name__ for g in e.m.groups] == ["FullAttention", "RecurrentState"]
    assert e.m.groups[1].interval == INTERVAL and e.m.block_size == BLOCK
    assert (e.kv.num_layers, e.states.num_layers, e.states.group) == (1, 3, 1)
    assert e.kv.num_blocks == e.states.num_blocks == e.m.num_blocks


@pytest.mark.parametrize("chunk", [8, 5, 23])
def test_chunked_prefill_and_decode_match_transformers_generate(hf, model, chunk):
    """A 23-token prompt in chunks of 8 (each ends on an interval end), 5 (chunks 5..10 and
    15..20 cross one) or whole, then 12 greedy tokens (positions 23 .. 34, across the ends at 24
    and 32): transformers' generate, with its own cache, gives the same tokens and logits. The
    manager's (read, write) follow the contract and the decode calls ending at 24 and 32 publish
    checkpoints, so the whole sequence's longest hit is 32."""
    prompt = prompts_of([23], seed=2)[0]
    want_tokens, want_logits = hf_generate(hf, prompt, 12)
    e = Engine(model)
    hit, prefill = e.prompt("a", prompt, chunk)
    assert hit == 0
    np.testing.assert_allclose(prefill, hf_logits(hf, prompt), atol=ATOL, rtol=0)
    toks, rows = e.greedy("a", int(np.argmax(prefill[-1])), 12)
    assert toks == want_tokens
    np.testing.assert_allclose(np.stack([prefill[-1]] + rows), want_logits, atol=ATOL, rtol=0)
    calls = [step["a"] for _, step in e.log]
    ends = [*range(0, 23, chunk), 23]
    assert [c[:2] for c in calls] == list(zip(ends, ends[1:])) + [(p, p + 1) for p in range(23, 34)]
    for (a, b, read, write), (_, _, _, before) in zip(calls[1:], calls):
        assert read == before  # each call starts from the state the previous one wrote
        assert (write == read) == ((a - 1) // INTERVAL == (b - 1) // INTERVAL)  # in place within an interval
    assert calls[0][2] == -1
    e.m.take_copies()
    assert e.m.lookup(prompt + toks) == 32


def restored_run(model, spec=None):
    """Request a: a 20-token prompt in chunks of 8 (checkpoints after positions 7 and 15), then
    freed (its blocks cached-free). Request b shares a's first 16 tokens: it hits 16 tokens,
    computes only its 7 others, then decodes 3. Returns b's prompt, its logits, its greedy
    tokens, the hit, b's first call and the checkpoints a wrote ({end: block})."""
    prompts = prompts_of([20, 7], seed=3)
    a, b = prompts[0], prompts[0][:16] + prompts[1]
    e = Engine(model, state_spec=spec)
    e.prompt("a", a, 8)
    checkpoints = {step["a"][1]: step["a"][3] for _, step in e.log if step["a"][1] % INTERVAL == 0}
    e.m.free("a")
    assert e.m.refcount(checkpoints[16]) == 0  # cached-free: b's hit revives it
    hit = e.admit("b", b)
    rows = e.run()["b"]
    first = e.log[-1][1]["b"]
    toks, more = e.greedy("b", int(np.argmax(rows[-1])), 4)
    return b, np.concatenate([rows, np.stack(more)]), toks, hit, first, checkpoints


def test_second_request_starts_from_a_checkpoint(hf, model):
    b, got, toks, hit, (a0, b0, read, write), checkpoints = restored_run(model)
    assert hit == 16 and (a0, b0) == (16, 23)  # only the 7 tokens past the hit are computed
    assert read == checkpoints[16] != write  # the checkpoint after position 15, left frozen
    want = hf_logits(hf, b + toks[:-1])[16:]
    assert toks == np.argmax(want[len(b) - 17:], -1).tolist()
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def forked_run(model, state_copies=True):
    """A 13-token prompt (the K/V tail block and the running state entry both mid-way), forked;
    then six steps in which parent and child each append their own token in one
    ``append_batch`` (positions 13 .. 18, across the interval end at 16). Returns the prompt,
    the tails, each sequence's logits and the first decode step's copies."""
    prompt = prompts_of([13], seed=4)[0]
    e = Engine(model, state_copies=state_copies)
    e.prompt("p", prompt, 13)
    e.m.fork("p", "c")
    tails = {"c": [21, 22, 23, 24, 25, 26], "p": [11, 12, 13, 14, 15, 16]}
    got = {s: [] for s in tails}
    for j in range(6):
        e.decode({s: tails[s][j] for s in tails})
        out = e.run()
        for s in tails:
            got[s].append(out[s][-1])
    return prompt, tails, {s: np.stack(v) for s, v in got.items()}, e.log[1][0]


def test_fork_copies_the_shared_running_state(hf, model):
    """The child's first token copies the shared partial K/V block (group 0) and the shared
    running state (group 1); the parent then writes both in place. Both match transformers on
    their own tokens for six steps."""
    prompt, tails, got, copies = forked_run(model)
    assert sorted(c.group for c in copies) == [0, 1]
    for s, tail in tails.items():
        np.testing.assert_allclose(got[s], hf_logits(hf, prompt + tail)[len(prompt):], atol=ATOL, rtol=0)


def test_negative_controls_diverge_from_transformers(hf, model):
    """The state copies of ``take_copies()`` skipped (the child reads a block never written), and
    a hit that starts from the checkpoint after position 7 instead of 15: logits off by > 0.1."""
    prompt, tails, got, copies = forked_run(model, state_copies=False)
    assert any(c.group == 1 for c in copies)
    off = max(np.abs(got[s] - hf_logits(hf, prompt + tail)[len(prompt):]).max() for s, tail in tails.items())
    assert off > 0.1

    b, early, toks, hit, (_, _, read, _), checkpoints = restored_run(model, EarlyCheckpoint(INTERVAL))
    assert hit == 16 and read == checkpoints[8]
    assert np.abs(early - hf_logits(hf, b + toks[:-1])[16:]).max() > 0.1
