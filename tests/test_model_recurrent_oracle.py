"""Hybrid decoders with recurrent layers against transformers' own models: Qwen3-Next (gated
DeltaNet + full attention) and Bamba (Mamba2 + full attention).

Each oracle is a tiny seeded model (4 layers: recurrent, recurrent, full attention, recurrent;
hidden 64; dense MLP), its norm weights, ``dt_bias`` and ``A_log`` (and Mamba2's ``D``) moved off
their initial values so that a wrong ``1 + weight``, a wrong gate or a lost state shows (``A`` in
0.02 .. 0.5: the states decay slowly, so a stale or missing state moves the logits by a lot).
The decoder keeps nothing between steps: K/V live in the paged store at the slots the test's
allocator hands out, and every recurrent state lives in a state-store block named by the
(read, write) ids the contract's ``state_indices`` gives (``recurrent_setup.Runner`` applies
its rule: read entry (a-1)//T, write entry (b-1)//T, a fresh block when they differ). Block ids come from
one shuffled pool shared by both stores' groups, as the manager's. Equal greedy tokens and logits
within 1e-4 (measured under 1e-5) through prefill, chunked prefill, decode, a checkpoint restored
for a second request (also through the host pool) and a fork that copies the running state mean
the states are read and written where the contract says; the negative controls (a checkpoint one
interval early, a fork without the copy, a zero state in chunk 2) move the logits by more than 0.1.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_next")
pytest.importorskip("transformers.models.bamba")

from pagedkv.types import Transfer  # noqa: E402
from llama_setup import prompts_of  # noqa: E402
from recurrent_setup import _one_thread, arch, hf, model  # noqa: E402,F401 (the shared fixtures)
from recurrent_setup import BLOCK, DECODERS, INTERVAL, Runner, hf_generate, hf_logits, tiny_hybrid  # noqa: E402

pytestmark = pytest.mark.oracle
ATOL = 1e-4


def shapes(arch, config):
    """The rotary dims and one layer's state, (conv_dim, recurrent shape), of the test model."""
    if arch == "bamba":  # x of 8 heads of 8 dims, B and C of each group's state of 8
        return 8, 8 * 8 + 2 * config.mamba_n_groups * 8, (8, 8, 8)
    return 4, 2 * 2 * 8 + 4 * 8, (4, 8, 8)  # q, k of 2 key heads, v of 4 value heads, 8 dims each


def test_config_maps_to_the_layer_pattern_and_stores(arch, hf, model):
    rotary, conv_dim, recurrent = shapes(arch, hf.config)
    d = model.dims
    assert (d.attention_layers, d.linear_layers, d.rotary_dim) == ((2,), (0, 1, 3), rotary)
    assert getattr(model, "moe_layers", ()) == ((0, 2, 3) if arch == "qwen3_next_moe" else ())  # not [1]
    kv, states = model.new_stores(64, BLOCK)
    assert (kv.num_layers, states.num_layers, states.group) == (1, 3, 1)
    assert (states.conv_shape, states.recurrent_shape) == ((conv_dim, 3), recurrent)
    assert states.bytes_per_block == 3 * (conv_dim * 3 + int(np.prod(recurrent))) * 4


def test_experts_load_from_either_layout():
    """transformers 4.x's per-expert weights (``experts.{e}.gate_proj`` ...) load to the fused
    arrays 5.x stores, so either library's checkpoint runs."""
    hf = tiny_hybrid("qwen3_next_moe")
    model = DECODERS["qwen3_next_moe"].from_transformers(hf)
    split = {}
    for k, v in hf.state_dict().items():
        if k.endswith("experts.gate_up_proj"):
            gate, up = v.chunk(2, dim=1)
            split |= {f"{k[:-len('gate_up_proj')]}{e}.{n}.weight": w[e] for e in range(len(v))
                      for n, w in (("gate_proj", gate), ("up_proj", up))}
        elif k.endswith("experts.down_proj"):
            split |= {f"{k[:-len('down_proj')]}{e}.down_proj.weight": v[e] for e in range(len(v))}
        else:
            split[k] = v
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in split
    loaded = type(model).from_state_dict(split, hf.config)
    for k in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj"):
        np.testing.assert_array_equal(loaded.w[k], model.w[k])


def test_whole_prompt_prefill_of_a_batch_matches_transformers(hf, model):
    """Three prompts in one forward (blocks from a shuffled pool): every position's logits."""
    r = Runner(model)
    prompts = prompts_of([5, 16, 23], seed=1)
    for i in range(len(prompts)):
        r.admit(i)
    got = r.step(dict(enumerate(prompts)))
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(got[i], hf_logits(hf, p), atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [8, 5, 23])
def test_chunked_prefill_and_decode_match_transformers_generate(hf, model, chunk):
    """Chunks of 8 end on interval ends (a new state block per chunk), chunks of 5 straddle
    them (updates in place and fresh blocks), 23 is the whole prompt; then 12 greedy tokens,
    each decode step reading the state the last one wrote, as transformers' generate (its own
    cache) produces them."""
    prompt = prompts_of([23], seed=2)[0]
    want_tokens, want_logits = hf_generate(hf, prompt, 12)
    r = Runner(model)
    r.admit("a")
    prefill = r.prefill("a", prompt, chunk)
    np.testing.assert_allclose(prefill, hf_logits(hf, prompt), atol=ATOL, rtol=0)
    toks, rows = r.greedy("a", int(np.argmax(prefill[-1])), 12)
    assert toks == want_tokens
    np.testing.assert_allclose(np.stack([prefill[-1]] + rows), want_logits, atol=ATOL, rtol=0)


def restored_run(model, read_entry, via_host=False):
    """Request a runs a 20-token prompt in chunks ending at positions 7 and 15 (checkpoints in
    entries 0 and 1), then 4 more. Request b shares a's first 16 tokens: its table takes a's
    first 4 K/V blocks, its state starts from a's entry ``read_entry`` (1 is the checkpoint after
    position 15), and it computes only its 7 new tokens, then decodes 3."""
    prompts = prompts_of([20, 7], seed=3)
    a, b = prompts[0], prompts[0][:16] + prompts[1]
    r = Runner(model)
    r.admit("a")
    r.prefill("a", a, 8)
    checkpoint = r.entries["a"][read_entry]
    if via_host:  # offload the checkpoint, lose the device copy, load it into another block
        r.states.transfer([Transfer("to_host", checkpoint, 5, group=1), Transfer("to_host", 9, 6)])
        r.states.conv[:, checkpoint] = r.states.recurrent[:, checkpoint] = 7.0
        checkpoint = r.block()
        assert r.states.transfer([Transfer("to_device", 5, checkpoint, group=1)]) == r.states.bytes_per_block
    r.admit("b", table=r.tables["a"][:4], entries={16 // INTERVAL - 1: checkpoint}, cached=b[:16])
    rows = r.step({"b": b[16:]})["b"]
    toks, more = r.greedy("b", int(np.argmax(rows[-1])), 4)
    return b, np.concatenate([rows, np.stack(more)]), toks


def test_second_request_restores_a_checkpoint(hf, model):
    b, got, toks = restored_run(model, read_entry=1)
    want = hf_logits(hf, b + toks[:-1])[16:]
    assert toks == np.argmax(want[len(b) - 17:], -1).tolist()
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    _, host, _ = restored_run(model, read_entry=1, via_host=True)
    np.testing.assert_allclose(host, got, atol=0, rtol=0)


def test_fork_copies_the_running_state(hf, model):
    """Parent and child share a running state entry in mid-interval (12 positions, T = 8); in
    the same step each appends its own token: the child's first write copies the block
    (``CopyOp(src, dst, group=1)``), the parent updates in place; six steps each match
    transformers on the sequence's own tokens."""
    prompt = prompts_of([12], seed=4)[0]
    r = Runner(model)
    r.admit("p")
    r.step({"p": prompt})
    r.fork("p", "c")
    tails = {"p": [11, 12, 13, 14, 15, 16], "c": [21, 22, 23, 24, 25, 26]}
    got = {s: [] for s in tails}
    for j in range(6):
        out = r.step({s: [tails[s][j]] for s in ("c", "p")})
        for s in tails:
            got[s].append(out[s][-1])
    assert r.entries["p"][1] != r.entries["c"][1]  # the child wrote a copy of the shared entry
    for s, tail in tails.items():
        np.testing.assert_allclose(np.stack(got[s]), hf_logits(hf, prompt + tail)[len(prompt):],
                                   atol=ATOL, rtol=0)


def verify_then_continue(hf, model, read_final=False):
    """A 13-token prompt, then a verify step of its next token and three drafts (positions 13 ..
    16: the right token at 14, wrong ones at 15 and 16) that keeps the state after 13, 14 and 15
    in blocks of their own (``state_snapshots``); the draft at 14 is accepted, so the next step
    computes position 15 with the right token from the state after 14 (or, ``read_final``, from
    the verify step's final state, which has seen the rejected drafts)."""
    prompt = prompts_of([13], seed=7)[0]
    t0 = int(np.argmax(hf_logits(hf, prompt)[-1]))
    t1 = int(np.argmax(hf_logits(hf, prompt + [t0])[-1]))
    t2 = int(np.argmax(hf_logits(hf, prompt + [t0, t1])[-1]))
    verify = [t0, t1, (t2 + 1) % 256, (t2 + 2) % 256]
    r = Runner(model)
    r.admit("a")
    r.step({"a": prompt})
    kept = [r.block(), r.block(), r.block(), -1]
    rows = r.step({"a": verify}, snapshots={"a": kept})["a"]
    assert int(np.argmax(rows[1])) == t2 != verify[2]  # the draft at 15 is rejected
    r.rollback("a", len(prompt) + 2, r.entries["a"][16 // INTERVAL] if read_final else kept[1])
    nxt = r.step({"a": [t2]})["a"]
    return prompt, verify, rows, [t0, t1, t2], nxt


def test_a_verify_step_keeps_the_state_of_each_draft(hf, model):
    prompt, verify, rows, accepted, nxt = verify_then_continue(hf, model)
    np.testing.assert_allclose(rows, hf_logits(hf, prompt + verify)[13:], atol=ATOL, rtol=0)
    np.testing.assert_allclose(nxt[-1], hf_logits(hf, prompt + accepted)[-1], atol=ATOL, rtol=0)


def test_negative_controls_diverge_from_transformers(hf, model):
    """A checkpoint one interval early (the state after position 7 for a hit at 16), a fork
    without the state copy (parent and child take turns writing the one shared block), and a
    zero state in chunk 2 (a block never written) all move the logits by more than 0.1."""
    b, early, toks = restored_run(model, read_entry=0)
    assert np.abs(early - hf_logits(hf, b + toks[:-1])[16:]).max() > 0.1

    prompt = prompts_of([12], seed=4)[0]
    r = Runner(model, copy_on_fork=False)
    r.admit("p")
    r.step({"p": prompt})
    r.fork("p", "c")
    r.step({"p": [11]})
    child = r.step({"c": [21]})["c"]
    assert r.entries["p"][1] == r.entries["c"][1]
    assert np.abs(child[-1] - hf_logits(hf, prompt + [21])[-1]).max() > 0.1
    with pytest.raises(ValueError, match="distinct"):  # in one step: two writes of one block
        r.step({"p": [12], "c": [22]})

    prompt, _, _, accepted, stale = verify_then_continue(hf, model, read_final=True)
    assert np.abs(stale[-1] - hf_logits(hf, prompt + accepted)[-1]).max() > 0.1

    seq = prompts_of([20], seed=5)[0]
    r = Runner(model)
    r.admit("z")
    r.step({"z": seq[:10]})
    chunk2 = r.step({"z": seq[10:]}, reads={"z": r.block()})["z"]
    assert np.abs(chunk2 - hf_logits(hf, seq)[10:]).max() > 0.1


def test_a_torch_state_store_gives_the_same_logits(hf, model):
    """The same chunked prefill and decode with the states in a torch store (on the GPU when
    there is one): the decoder reads and writes it through the same calls."""
    prompt = prompts_of([13], seed=6)[0]
    runs = []
    for backend in ({}, dict(backend="torch", device="cuda" if torch.cuda.is_available() else "cpu")):
        r = Runner(model)
        s = r.states
        r.states = type(s)(s.num_layers, s.num_blocks, conv_shape=s.conv_shape, recurrent_shape=s.recurrent_shape,
                           group=s.group, **backend)
        r.admit("a")
        prefill = r.prefill("a", prompt, 5)
        runs.append(np.concatenate([prefill, np.stack(r.greedy("a", int(np.argmax(prefill[-1])), 4)[1])]))
    np.testing.assert_allclose(runs[1], runs[0], atol=1e-6, rtol=0)
    np.testing.assert_allclose(runs[0][:13], hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_bad_state_ids_change_nothing(hf, model):
    """A -1 read after position 0, a block read at position 0, two writes of one block or an
    id outside the pool: ValueError before any K/V or state is written."""
    kv, states = model.new_stores(8, BLOCK)
    model.forward(kv, states, [1, 2, 3], [0, 1, 2], [[0]], [3], [3], state_read=[-1], state_write=[1])
    before = kv.kv.copy(), states.conv.copy(), states.recurrent.copy()
    step = dict(token_ids=[4, 5], slots=[3, 8], block_tables=[[0, 2]], seq_lens=[5], query_lens=[2])
    bad = [dict(state_read=[-1], state_write=[1]), dict(state_read=[8], state_write=[1]),
           dict(state_read=[1], state_write=[-1]), dict(state_read=[1], state_write=[1, 2])]
    for ids in bad:
        with pytest.raises(ValueError, match="state|block"):
            model.forward(kv, states, **step, **ids)
    with pytest.raises(ValueError, match="-1"):
        model.forward(kv, states, [6, 7], [4, 5], [[2, 3]], [2], [2], state_read=[1], state_write=[3])
    with pytest.raises(ValueError, match="distinct"):
        model.forward(kv, states, [6, 7], [4, 5], [[2], [3]], [1, 1], [1, 1], state_read=[-1, -1],
                      state_write=[3, 3])
    for snapshots, match in (([[4, 1]], "distinct"), ([[4]], "one block per new token"),
                             ([[4, 9]], r"state_snapshots\[0\] must hold"), ([None, None], "one entry per")):
        with pytest.raises(ValueError, match=match):
            model.forward(kv, states, **step, state_read=[1], state_write=[1], state_snapshots=snapshots)
    with pytest.raises(ValueError, match="state store has"):  # a store shaped for another model
        other = type(states)(2, 8, conv_shape=states.conv_shape, recurrent_shape=states.recurrent_shape)
        model.forward(kv, other, [6], [4], [[1]], [1], state_read=[-1], state_write=[3])
    after = kv.kv, states.conv, states.recurrent
    assert all(np.array_equal(x, y) for x, y in zip(before, after))
    weights = {k: v for k, v in hf.state_dict().items() if ".3." not in k}
    with pytest.raises(ValueError, match="lacks"):
        type(model).from_state_dict(weights, hf.config)
