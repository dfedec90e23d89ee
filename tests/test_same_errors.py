"""The same bad argument gets the same message in every configuration of attention groups.

One facade validates every argument for every configuration, so a plain model, a hybrid one, a
model of one window group and a tiered one refuse ``prefill=-1`` (and every other bad argument
below) with the same ``ValueError`` text, and the call changes nothing.
"""
from __future__ import annotations

import pickle

import pytest

from pagedkv import ChunkedLocalAttention, FullAttention, KVCacheManager, SlidingWindow

CONFIGS = {
    "plain": dict(groups=None),
    "full": dict(groups=[FullAttention()]),
    "hybrid": dict(groups=[FullAttention(), SlidingWindow(8)]),
    "window": dict(groups=[SlidingWindow(5)]),
    "chunked": dict(groups=[ChunkedLocalAttention(8), FullAttention()]),
    "tiered hybrid": dict(groups=[FullAttention(), SlidingWindow(8)], host_blocks=8),
}

CONSTRUCTION = {
    "num_blocks=0": dict(num_blocks=0),
    "block_size=0": dict(block_size=0),
    "num_blocks=1.5": dict(num_blocks=1.5),
    "block_size=True": dict(block_size=True),
    "host_blocks=-1": dict(host_blocks=-1),
    "enable_events=1": dict(enable_events=1),
    "enable_prefix_caching='yes'": dict(enable_prefix_caching="yes"),
    "host_write_policy='later'": dict(host_write_policy="later"),
    "window_eviction='never'": dict(window_eviction="never"),
    "hash_algo='md5'": dict(hash_algo="md5"),
}

CALLS = {
    "prefill=-1": lambda m: m.add_sequence("x", [1, 2, 3], prefill=-1),
    "prefill=1.5": lambda m: m.add_sequence("x", [1, 2, 3], prefill=1.5),
    "reserve=1": lambda m: m.add_sequence("x", [1, 2, 3], reserve=1),
    "empty prompt": lambda m: m.add_sequence("x", []),
    "duplicate id": lambda m: m.add_sequence("a", [1]),
    "unhashable id": lambda m: m.add_sequence(["a"], [1]),
    "bad token": lambda m: m.add_sequence("x", [1, -2]),
    "salt=3": lambda m: m.add_sequence("x", [1], cache_salt=3),
    "n=-1": lambda m: m.prefill("a", -1),
    "n past the prompt": lambda m: m.prefill("a", 10**6),
    "cache=1": lambda m: m.free("a", cache=1),
    "k=-1": lambda m: m.accept("a", -1),
    "k past the drafts": lambda m: m.accept("a", 3),
    "speculative=1": lambda m: m.append_tokens("a", [1], speculative=1),
    "token 2**32": lambda m: m.append_token("a", 2**32),
    "token 1.0": lambda m: m.append_token("a", 1.0),
    "batch of a set": lambda m: m.append_batch({"a", "b"}, [1, 2]),
    "batch id twice": lambda m: m.append_batch(["a", "a"], [1, 2]),
    "batch lengths": lambda m: m.append_batch(["a", "b"], [1]),
    "group=9": lambda m: m.block_table("a", group=9),
    "group=-1 in usage": lambda m: m.usage(group=-1),
    "pad=2**40": lambda m: m.block_tables(["a"], pad=2**40),
    "slots past the end": lambda m: m.slots("a", 0, 10**6),
    "fork to an existing id": lambda m: m.fork("a", "b"),
    "block id out of range": lambda m: m.refcount(10**6),
    "swap in what is not out": lambda m: m.swap_in("a"),
}


def populated(config: dict) -> KVCacheManager:
    m = KVCacheManager(num_blocks=64, block_size=4, **config)
    m.add_sequence("a", list(range(10)))
    m.add_sequence("b", list(range(20, 27)))
    m.take_events()
    return m


def message(call) -> tuple[str, str]:
    try:
        call()
    except (ValueError, KeyError) as e:
        return type(e).__name__, str(e)
    raise AssertionError("the call was accepted")


@pytest.mark.parametrize("bad", list(CALLS))
def test_a_bad_call_gets_one_message_in_every_configuration_and_changes_nothing(bad):
    seen = {}
    for name, config in CONFIGS.items():
        m = populated(config)
        before = pickle.dumps(m)
        kind, text = message(lambda: CALLS[bad](m))
        # a group index is checked against this manager's own number of groups
        seen[name] = kind, text.replace(f"[0, {m.num_groups})", "[0, num_groups)")
        assert pickle.dumps(m) == before, (bad, name)
    assert len(set(seen.values())) == 1, seen


@pytest.mark.parametrize("bad", list(CONSTRUCTION))
def test_a_bad_constructor_argument_gets_one_message_in_every_configuration(bad):
    seen = {}
    for name, config in CONFIGS.items():
        args = dict(num_blocks=64, block_size=4, **config)
        args.update(CONSTRUCTION[bad])
        seen[name] = message(lambda: KVCacheManager(**args))
    assert len(set(seen.values())) == 1, seen


def test_the_messages_name_the_argument():
    m = populated(CONFIGS["hybrid"])
    assert message(lambda: m.add_sequence("x", [1], prefill=-1))[1] == "prefill must be an int >= 0, got -1"
    assert message(lambda: m.free("a", cache=1))[1] == "cache must be True or False, got 1"
    assert message(lambda: KVCacheManager(0, 4))[1] == "num_blocks must be an int in [1, 2147483647], got 0"
