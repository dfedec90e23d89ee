"""Keys beyond tokens (issue 17, section 4): LoRA adapters, multimodal items and the cache salt.

Equal token ids do not always mean equal K/V: the same prompt through another LoRA adapter, or
image placeholder tokens standing for another image, give other K/V. As in vLLM v1
(``generate_block_hash_extra_keys``), each block's hash covers its extra keys: the LoRA name in
every block, a multimodal item's hash (and its offset from the block's start) in each block its
placeholder span touches, the salt in block 0. These tests pin who shares and who does not,
where the keys go (exact per-block event entries), the lookup memo, generated blocks, drafts,
forks, the host tier, and the validation of the new arguments.
"""
from __future__ import annotations

import pickle

import pytest
from conftest import snapshot, stored_blocks, stored_keys, toks
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import BlockStored, KVCacheManager
from pagedkv.hashing import BlockHasher, ExtraKeys, token_bytes

BS = 4
PROMPT = toks(100, 13)  # 3 full blocks + 1 token


def hashes_of(events):
    return [h for h, _, _ in stored_blocks(events)]


# ---- who shares -------------------------------------------------------------------------------


def test_same_tokens_different_adapter_never_hit(make):
    """The bug: before extra keys, a LoRA request hit K/V another adapter (or the base model)
    computed for the same token ids. Now only the same adapter hits."""
    m = make(32, BS)
    m.add_sequence("sql", PROMPT, lora_name="sql")
    assert m.lookup(PROMPT) == 0 and m.lookup(PROMPT, lora_name="chat") == 0
    assert m.add_sequence("base", PROMPT) == 0
    assert m.add_sequence("chat", PROMPT, lora_name="chat") == 0
    assert m.lookup(PROMPT, lora_name="sql") == 12
    assert m.add_sequence("sql2", PROMPT, lora_name="sql") == 12
    assert m.block_table("sql2")[:3] == m.block_table("sql")[:3]
    tables = [set(m.block_table(s)) for s in ("sql", "base", "chat")]
    assert not (tables[0] & tables[1] or tables[0] & tables[2] or tables[1] & tables[2])
    m.check_invariants()


def test_same_tokens_different_image_never_hit_past_the_span(make):
    """An image's placeholder tokens are the same for every image: with another image's hash the
    blocks its span touches (and, chained, every later one) miss; the blocks before it hit."""
    m = make(32, BS)
    cat = [("cat", 5, 4)]  # positions 5..8: blocks 1 and 2
    m.add_sequence("a", PROMPT, mm_features=cat)
    assert m.add_sequence("b", PROMPT, mm_features=[("dog", 5, 4)]) == 4  # block 0 alone
    assert m.add_sequence("c", PROMPT, mm_features=[("cat", 6, 3)]) == 4  # same image, moved
    assert m.add_sequence("d", PROMPT) == 4  # no image at all
    assert m.lookup(PROMPT, mm_features=cat) == 12
    assert m.add_sequence("e", PROMPT, mm_features=cat) == 12
    m.check_invariants()


def test_an_item_keys_exactly_the_blocks_its_span_touches():
    """Per-block event entries, exactly: an item touching blocks 1..2 (offset 5, length 6:
    positions 5..10) is in their keys with its start relative to each block's (1, then -3);
    blocks 0 and 3 carry none and hash as the plain prompt's do; a second item sharing block 2
    is listed after the first."""
    m = KVCacheManager(32, BS)
    prompt = toks(100, 17)  # 4 full blocks
    m.add_sequence("plain", prompt)
    plain = hashes_of(m.take_events())
    m.free("plain")
    m.reset_prefix_cache()
    m.take_events()
    m.add_sequence("mm", prompt, mm_features=[("img", 5, 6), ("aud", 11, 1)])
    events = m.take_events()
    assert [k for _, _, k in stored_keys(events)] == [None, (("img", 1),), (("img", -3), ("aud", 3)), None]
    keyed = hashes_of(events)
    assert keyed[0] == plain[0]  # untouched, and no earlier block differs
    assert keyed[1] != plain[1] and keyed[2] != plain[2] and keyed[3] != plain[3]  # chained on
    hasher = BlockHasher()
    assert keyed[3] == hasher.block(keyed[2], token_bytes(prompt[12:16]))  # block 3 has no key
    [ev] = events
    assert ev.lora_name is None and ev.parent_block_hash == hasher.root()


def test_salt_keys_the_first_block_only_and_the_chain_carries_it():
    """vLLM's form: the salt is in block 0's key alone; every later block differs from the
    unsalted prompt's only because its parent does."""
    m = KVCacheManager(32, BS)
    m.add_sequence("plain", PROMPT)
    m.add_sequence("salted", PROMPT, cache_salt="t")
    plain, salted = stored_blocks(m.take_events()), None
    plain, salted = plain[:3], plain[3:]
    assert all(p[0] != s[0] for p, s in zip(plain, salted))
    assert plain[0][1] == salted[0][1] == BlockHasher().root()  # one root, salted or not
    hasher = BlockHasher()
    for (h, parent, blk) in salted[1:]:
        assert h == hasher.block(parent, token_bytes(blk))  # no key past block 0
    m.add_sequence("again", PROMPT, cache_salt=b"t")  # a bytes salt is not the str salt
    assert m.num_computed("again") == 13 and m.lookup(PROMPT, cache_salt=bytearray(b"t")) == 12
    keys = [k for _, _, k in stored_keys(m.take_events())]
    assert keys == [(b"t",), None, None]


def test_every_key_together_in_vllms_order():
    """LoRA name first, then the items, then the salt (vLLM's order), each block's own."""
    m = KVCacheManager(32, BS)
    m.add_sequence("r", PROMPT, cache_salt="t", lora_name="sql", mm_features=[("img", 2, 8)])
    [ev] = m.take_events()
    assert ev.lora_name == "sql"
    assert ev.extra_keys == (("sql", ("img", 2), "t"), ("sql", ("img", -2)), ("sql", ("img", -6)))


# ---- generated blocks, drafts, forks, chunks --------------------------------------------------


def test_generated_blocks_carry_the_adapter():
    """A block filled by decoding holds the adapter's K/V too: it is keyed by the LoRA name, and
    only a prompt under the same adapter hits it."""
    m = KVCacheManager(32, BS)
    m.add_sequence("a", PROMPT[:6], lora_name="sql")
    m.take_events()
    m.append_batch(["a"], [7])
    m.append_token("a", 8)  # fills block 1
    [ev] = m.take_events()
    assert (ev.lora_name, ev.extra_keys, ev.token_ids) == ("sql", (("sql",),), tuple(PROMPT[4:6]) + (7, 8))
    full = PROMPT[:6] + [7, 8, 9]
    assert m.lookup(full, lora_name="sql") == 8 and m.lookup(full) == 0
    m.check_invariants()


def test_decode_step_mixing_keyed_and_plain_sequences():
    """One append_batch filling a plain and a keyed sequence's blocks: each event keeps its own
    fields (the plain one none)."""
    m = KVCacheManager(32, BS)
    m.add_sequence("p", toks(0, 3))
    m.add_sequence("k", toks(0, 3), lora_name="sql")
    m.add_sequence("s", toks(0, 3), cache_salt="t")
    m.append_batch(["p", "k", "s"], [9, 9, 9])
    evs = m.take_events()
    assert [(e.lora_name, e.extra_keys) for e in evs] == [(None, None), ("sql", (("sql",),)), (None, (("t",),))]
    assert len(set(hashes_of(evs))) == 3
    m.check_invariants()


def test_accepted_drafts_and_chunks_and_forks_keep_the_keys():
    m = KVCacheManager(64, BS)
    m.add_sequence("a", PROMPT, lora_name="sql", mm_features=[("img", 5, 4)], prefill=3)
    for n in (4, 6):  # chunks publish the blocks they complete, keyed
        m.prefill("a", n)
    m.append_tokens("a", [1, 2, 3, 4, 5], speculative=True)
    m.accept("a", 4)  # completes block 3 and 4 -> blocks 3 published, keyed by the adapter
    m.fork("a", "b")
    m.append_tokens("b", [6, 7, 8])
    keys = [k for _, _, k in stored_keys(m.take_events())]
    assert keys == [("sql",), ("sql", ("img", 1)), ("sql", ("img", -3)), ("sql",), ("sql",)]
    m.check_invariants()
    seq = m.tokens("b")
    assert m.lookup(seq + [0], lora_name="sql", mm_features=[("img", 5, 4)]) == 20
    assert m.lookup(seq + [0], lora_name="sql") == 4


# ---- the lookup memo ----------------------------------------------------------------------------


def test_lookup_memo_keys_on_the_extra_keys():
    """The memo keyed prompts by salt root and bytes alone: a lookup of the plain prompt then
    the admission of the same ids under an adapter must not reuse the plain hashes."""
    m = KVCacheManager(32, BS)
    m.add_sequence("base", PROMPT)
    assert m.lookup(PROMPT) == 12  # memoised: plain hashes
    assert m.lookup(PROMPT, lora_name="sql") == 0
    assert m.add_sequence("sql", PROMPT, lora_name="sql") == 0
    assert m.lookup(PROMPT, mm_features=[("img", 0, 2)]) == 0
    assert m.add_sequence("img", PROMPT, mm_features=[("img", 0, 2)]) == 0
    assert m.lookup(PROMPT, cache_salt="t") == 0
    assert m.add_sequence("salted", PROMPT, cache_salt="t") == 0
    assert m.lookup(PROMPT, lora_name="sql") == 12 and m.lookup(PROMPT) == 12
    m.check_invariants()


# ---- the host tier --------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["write-back", "write-through"])
def test_host_tier_keeps_the_keys(policy):
    """Offloaded keyed blocks keep their keys on the host: the host's events carry them, a host
    hit needs the same adapter, and the checks rehash host blocks with their keys."""
    m = KVCacheManager(6, BS, host_blocks=16, host_write_policy=policy)
    m.add_sequence("a", PROMPT, lora_name="sql", cache_salt="t")
    m.take_transfers()
    m.take_transfers()
    m.free("a")
    m.add_sequence("filler", toks(500, 21))  # evicts every device block
    m.take_transfers()
    m.check_invariants()
    cpu = [e for e in m.take_events() if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [k for _, _, k in stored_keys(cpu)] == [("sql", "t"), ("sql",), ("sql",)]
    assert {e.lora_name for e in cpu} == {"sql"}
    m.free("filler")
    assert m.lookup(PROMPT, lora_name="sql", cache_salt="t").host == 12
    assert m.lookup(PROMPT, lora_name="sql") == 0 and m.lookup(PROMPT, cache_salt="t") == 0
    assert m.add_sequence("b", PROMPT, lora_name="sql", cache_salt="t") == 12
    m.check_invariants()


def test_swap_out_and_in_of_a_keyed_sequence():
    m = KVCacheManager(8, BS, host_blocks=8)
    m.add_sequence("a", PROMPT, lora_name="sql")
    m.take_transfers()
    m.swap_out("a")
    m.take_transfers()
    cpu = [e for e in m.take_events() if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [k for _, _, k in stored_keys(cpu)] == [("sql",)] * 3
    m.check_invariants()
    m.swap_in("a")
    m.take_transfers()
    m.check_invariants()
    assert m.lookup(PROMPT, lora_name="sql") == 12


# ---- validation ------------------------------------------------------------------------------------


BAD = [
    (dict(lora_name=""), "lora_name must be None or a non-empty str"),
    (dict(lora_name=3), "lora_name must be None or a non-empty str"),
    (dict(mm_features="img"), "mm_features must be a list"),
    (dict(mm_features=[("img", 0)]), r"must be \(mm_hash, offset, length\)"),
    (dict(mm_features=[(5, 0, 2)]), "an mm_hash must be a non-empty str or bytes"),
    (dict(mm_features=[("", 0, 2)]), "an mm_hash must be a non-empty str or bytes"),
    (dict(mm_features=[("img", -1, 2)]), "offset must be >= 0"),
    (dict(mm_features=[("img", 1.0, 2)]), "offset must be an int"),
    (dict(mm_features=[("img", True, 2)]), "offset must be an int"),
    (dict(mm_features=[("img", 0, 0)]), "length must be at least 1"),
    (dict(mm_features=[("img", 10, 4)]), "past the prompt's 13 tokens"),
    (dict(mm_features=[("a", 0, 4), ("b", 3, 2)]), "overlaps"),
    (dict(mm_features=[("a", 6, 2), ("b", 0, 2)]), "sorted and disjoint"),
    (dict(cache_salt=1.5), "cache_salt must be None, str or bytes"),
]


@pytest.mark.parametrize("kwargs, match", BAD)
@pytest.mark.parametrize("caching", [True, False])
def test_bad_extra_keys_are_value_errors_that_change_nothing(kwargs, match, caching):
    m = KVCacheManager(16, BS, enable_prefix_caching=caching, host_blocks=4)
    m.add_sequence("a", PROMPT, lora_name="sql")
    m.take_transfers()
    m.take_events()
    before, blob = snapshot(m, ["a"]), pickle.dumps(m)
    with pytest.raises(ValueError, match=match):
        m.add_sequence("b", PROMPT, **kwargs)
    with pytest.raises(ValueError, match=match):
        m.lookup(PROMPT, **kwargs)
    assert snapshot(m, ["a"]) == before and "b" not in m
    assert m.take_events() == [] and m.take_transfers() == []
    assert pickle.dumps(m) == blob
    m.check_invariants()


def test_empty_and_numpy_arguments():
    """No items is no key; numpy ints are ints; an item may end on the prompt's last token."""
    np = pytest.importorskip("numpy")
    m = KVCacheManager(32, BS)
    m.add_sequence("a", PROMPT)
    assert m.add_sequence("b", PROMPT, mm_features=[]) == 12
    assert m.add_sequence("c", PROMPT, mm_features=[("img", np.int64(9), np.int32(4))]) == 8
    assert ExtraKeys.make(BS, 13) is None and ExtraKeys.make(BS, 13, mm_features=()) is None


# ---- random: keys isolate exactly -------------------------------------------------------------------

_LORAS = st.sampled_from([None, "sql", "chat"])
_SALTS = st.sampled_from([None, "t", b"t"])


@st.composite
def _requests(draw):
    n = draw(st.integers(1, 24))
    tokens = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    items, pos = [], 0
    while pos < n and draw(st.booleans()):
        off = draw(st.integers(pos, n - 1))
        length = draw(st.integers(1, n - off))
        items.append((draw(st.sampled_from(["cat", "dog"])), off, length))
        pos = off + length
    return tokens, dict(lora_name=draw(_LORAS), cache_salt=draw(_SALTS), mm_features=items or None)


def _block_identity(tokens, kw, i):
    """What block ``i`` of a request stands for: every token up to its end, the adapter, the
    salt, and each item's hash, start and the last of blocks 0..i it touches (an item's hash names
    its content, and so its length: vLLM's key has no length). Two requests may share block i
    exactly when these are equal."""
    stop = (i + 1) * BS
    items = tuple((h, off, min((off + n - 1) // BS, i)) for h, off, n in (kw["mm_features"] or ()) if off < stop)
    salt = kw["cache_salt"]
    return (tuple(tokens[:stop]), kw["lora_name"], None if salt is None else (type(salt), salt), items)


@settings(max_examples=150, deadline=None)
@given(st.lists(_requests(), min_size=2, max_size=6))
def test_a_hit_means_equal_tokens_adapter_salt_and_items(reqs):
    """Admit random requests (few token values, so ids collide often) and compare every block a
    request got as a hit with the block's identity under the request that published it: a hit
    is served exactly when tokens, adapter, salt and the items seen so far (hash and position)
    are all equal; and an equal identity always hits."""
    m = KVCacheManager(256, BS)
    owner = {}  # block id -> identity of its content
    for j, (tokens, kw) in enumerate(reqs):
        hit = m.add_sequence(j, tokens, **kw)
        table = m.block_table(j)
        nfull = len(tokens) // BS
        expect = 0
        for i in range(min(nfull, (len(tokens) - 1) // BS)):
            if _block_identity(tokens, kw, i) in owner.values():
                expect += 1
            else:
                break
        assert hit == expect * BS
        for i, b in enumerate(table[:nfull]):
            ident = _block_identity(tokens, kw, i)
            assert owner.setdefault(b, ident) == ident, "a block served K/V of another identity"
    m.check_invariants()


# ---- the fleet's precise router ----------------------------------------------------------------------


def test_precise_router_indexes_keyed_events_by_hash():
    """The fleet's precise router decodes the new fields and indexes by hash: a replica holding
    a prompt under an adapter is not a match for the same ids without it (the router hashes
    plain tokens), while the replica holding the plain prompt is."""
    pytest.importorskip("msgspec")
    from pagedkv.events import encode_vllm, hash_to_u64
    from pagedkv.sim.routers import PrefixAwareRouter

    router = PrefixAwareRouter(block_size=BS)
    router.bind(["lora", "plain"])
    prompt = toks(100, 17)
    for j, kw in enumerate([dict(lora_name="sql", mm_features=[("img", 1, 3)], cache_salt="t"), {}]):
        m = KVCacheManager(16, BS)
        m.add_sequence("r", prompt, **kw)
        events = m.take_events()
        router.on_events(j, encode_vllm(events, 1.0))
        assert router.blocks_held(j) == {hash_to_u64(h) for h in hashes_of(events)}
    assert router.match_blocks(prompt) == [0, 4]
    assert router.blocks_held(0).isdisjoint(router.blocks_held(1))


@settings(max_examples=200, deadline=None)
@given(_requests(), st.sampled_from(["sha256", "builtin"]), st.integers(0, 3), st.integers(0, 8))
def test_keyed_chain_is_the_per_block_definition(req, algo, first, extra_blocks):
    """``chain_keyed`` (one inlined loop) and ``block_keys`` (the shared LoRA key, the touched
    blocks on their own) give what the definition gives block by block: each block's hash is its
    parent's chained with its token bytes and its key's suffix."""
    tokens, kw = req
    keys = ExtraKeys.make(BS, len(tokens), **kw)
    if keys is None:
        return
    stop = len(tokens) // BS + extra_blocks
    start = min(first, stop)
    assert keys.block_keys(start, stop) == [keys.block_key(i) for i in range(start, stop)]
    hasher = BlockHasher(algo)
    data = token_bytes(tokens[: (len(tokens) // BS) * BS])
    nfull = len(tokens) // BS
    got = hasher.chain_keyed(hasher.root(), data, 4 * BS, 0, nfull, keys)
    p, want = hasher.root(), []
    for i in range(nfull):
        k = keys.block_key(i)
        p = hasher.block(p, data[i * 4 * BS : (i + 1) * 4 * BS] + (k.suffix if k else b""))
        want.append(p)
    assert got == want
