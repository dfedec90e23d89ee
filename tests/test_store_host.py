"""The store's host pool: batched transfers move whole blocks, every layer's K and V, in the
order the manager's rules need; bad lists change nothing; and a store driven by a real manager
with a host tier (offloads, host prefix hits, swaps, write-back and write-through) holds every
sequence's exact tokens at every step."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pagedkv import KVCacheManager, OutOfBlocks, Transfer
from pagedkv.store import KVStore, kv_bytes_per_block

BACKENDS = ["numpy", pytest.param("torch", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("torch") is None, reason="torch not installed"))]


def to_numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def filled(backend, num_blocks=8, host_blocks=4, seed=0):
    """A 3-layer store (blocks of 4 slots, 2 KV heads of 4) with random K/V in every slot."""
    rng = np.random.default_rng(seed)
    store = KVStore(3, num_blocks, 4, 2, 4, backend=backend, host_blocks=host_blocks)
    for layer in range(3):
        n = num_blocks * 4
        store.write(layer, np.arange(n), rng.standard_normal((n, 2, 4)), rng.standard_normal((n, 2, 4)))
    return store


def test_sizes_report_device_and_host_separately():
    store = KVStore(2, 64, 16, 2, 16, host_blocks=128)
    bpb = kv_bytes_per_block(2, 16, 2, 16)
    assert store.bytes_per_block == bpb == 8_192
    assert store.device_nbytes == 64 * bpb == store.kv.nbytes == 524_288
    assert store.host_nbytes == 128 * bpb == store.host_kv.nbytes == 1_048_576
    assert store.nbytes == store.device_nbytes + store.host_nbytes == 1_572_864
    assert store.host_kv.shape == (2, 2, 128, 16, 2, 16)
    plain = KVStore(2, 64, 16, 2, 16)
    assert plain.host_kv is None and plain.host_nbytes == 0 and plain.nbytes == plain.device_nbytes


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_bad_host_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="host_blocks"):
        KVStore(1, 4, 2, 1, 2, host_blocks=bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_transfer_moves_whole_blocks_of_every_layer_and_returns_bytes(backend):
    store = filled(backend)
    kv = to_numpy(store.kv).copy()
    moved = store.transfer([Transfer("to_host", 5, 0), Transfer("to_host", 2, 3)])
    host = to_numpy(store.host_kv)
    assert moved == 2 * store.bytes_per_block == 2 * (2 * 3 * 4 * 2 * 4 * 4)
    np.testing.assert_array_equal(host[:, :, 0], kv[:, :, 5])
    np.testing.assert_array_equal(host[:, :, 3], kv[:, :, 2])
    np.testing.assert_array_equal(host[:, :, 1:3], 0)  # untouched host blocks stay as they were
    np.testing.assert_array_equal(to_numpy(store.kv), kv)  # the device is only read
    assert store.transfer([("to_device", 3, 7), ("to_device", 0, 6)]) == moved  # plain triples work
    after = to_numpy(store.kv)
    np.testing.assert_array_equal(after[:, :, 7], kv[:, :, 2])
    np.testing.assert_array_equal(after[:, :, 6], kv[:, :, 5])
    np.testing.assert_array_equal(after[:, :, :6], kv[:, :, :6])
    assert store.transfer([]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_block_leaves_for_the_host_before_a_load_fills_it(backend):
    """The manager's order: device block 1 is read out to host 2 and refilled from host 0 in one
    list; host 1 goes to device 4 while device 4 goes to host 3 (a swap of contents)."""
    store = filled(backend)
    store.transfer([Transfer("to_host", 6, 0), Transfer("to_host", 7, 1)])
    kv = to_numpy(store.kv).copy()
    store.transfer([Transfer("to_host", 1, 2), Transfer("to_host", 4, 3),
                    Transfer("to_device", 0, 1), Transfer("to_device", 1, 4)])
    host, after = to_numpy(store.host_kv), to_numpy(store.kv)
    np.testing.assert_array_equal(host[:, :, 2], kv[:, :, 1])
    np.testing.assert_array_equal(host[:, :, 3], kv[:, :, 4])
    np.testing.assert_array_equal(after[:, :, 1], kv[:, :, 6])
    np.testing.assert_array_equal(after[:, :, 4], kv[:, :, 7])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_transfer_lists_raise_and_change_nothing(backend):
    store = filled(backend, host_blocks=2)
    store.transfer([Transfer("to_host", 0, 0), Transfer("to_host", 1, 1)])
    kv, host = to_numpy(store.kv).copy(), to_numpy(store.host_kv).copy()
    good = Transfer("to_host", 2, 0)  # every bad list starts with a valid entry: nothing may run
    bad_lists = {
        "unknown direction": [good, ("sideways", 0, 1)],
        "bytes direction": [good, (b"to_host", 0, 1)],
        "device src out of range": [good, ("to_host", 8, 1)],
        "host dst out of range": [good, ("to_host", 3, 2)],
        "host src out of range": [good, ("to_device", 2, 3)],
        "device dst out of range": [good, ("to_device", 0, 8)],
        "negative": [good, ("to_device", -1, 3)],
        "float id": [good, ("to_device", 1.0, 3)],
        "bool id": [good, ("to_device", True, 3)],
        "two fields": [good, ("to_device", 1)],
        "a string": [good, "to_device"],
        "destination twice": [good, ("to_host", 3, 0)],
        "device destination twice": [good, ("to_device", 0, 5), ("to_device", 1, 5)],
        "order": [("to_device", 0, 5), good],
    }
    for name, transfers in bad_lists.items():
        with pytest.raises(ValueError):
            store.transfer(transfers)
        np.testing.assert_array_equal(to_numpy(store.kv), kv, err_msg=name)
        np.testing.assert_array_equal(to_numpy(store.host_kv), host, err_msg=name)
    with pytest.raises(ValueError, match="no host pool"):
        KVStore(1, 4, 2, 1, 2).transfer([Transfer("to_host", 0, 0)])
    assert KVStore(1, 4, 2, 1, 2).transfer([]) == 0


def test_torch_host_pool_is_a_cpu_tensor_shaped_like_the_device_pool():
    torch = pytest.importorskip("torch")
    store = KVStore(2, 8, 4, 2, 4, backend="torch", dtype="bfloat16", host_blocks=3)
    assert isinstance(store.host_kv, torch.Tensor) and store.host_kv.device.type == "cpu"
    assert store.host_kv.dtype == torch.bfloat16 and tuple(store.host_kv.shape) == (2, 2, 3, 4, 2, 4)
    store.write(1, [4, 5], torch.ones(2, 2, 4), torch.full((2, 2, 4), 2.0))
    store.transfer([Transfer("to_host", 1, 2), Transfer("to_device", 2, 7)])
    assert torch.equal(store.kv[:, :, 7], store.kv[:, :, 1]) and store.kv[1, 1, 7, 1].eq(2).all()


# ---- a real manager with a host tier drives the store: every sequence reads its own tokens


class Engine:
    """The engine's duty, nothing more: each step, manager calls (admissions, appends, swaps,
    frees), then transfers, copies, the step's writes; forks after the writes. K holds the token
    id, V the position, so reading a sequence back through its table checks both."""

    def __init__(self, num_blocks, block_size, host_blocks, policy):
        self.m = KVCacheManager(num_blocks, block_size, host_blocks=host_blocks, host_write_policy=policy)
        self.store = KVStore(1, num_blocks, block_size, 1, 1, dtype="float64", host_blocks=host_blocks)
        self.tokens: dict[str, list[int]] = {}
        self.swapped: set[str] = set()
        self.writes: list[tuple[str, list[int], list[int], list[int]]] = []  # (seq, slots, tokens, positions)
        self.touched: set[str] = set()  # given slots this step: not swapped out until it ran
        self.serial = 0
        self.loaded = self.stored = 0

    def add(self, prompt):
        sid = f"s{self.serial}"
        try:
            hit = self.m.add_sequence(sid, prompt)
        except OutOfBlocks:
            return
        self.serial += 1
        self.tokens[sid] = list(prompt)
        self.writes.append((sid, self.m.slots(sid, hit).tolist(), prompt[hit:], list(range(hit, len(prompt)))))
        self.touched.add(sid)

    def append(self, sid, tok):
        try:
            slot = self.m.append_token(sid, tok)
        except OutOfBlocks:
            return
        self.writes.append((sid, [slot], [tok], [len(self.tokens[sid])]))
        self.tokens[sid].append(tok)
        self.touched.add(sid)

    def swap_out(self, sid):
        try:
            self.m.swap_out(sid)
        except OutOfBlocks:
            return
        self.swapped.add(sid)

    def swap_in(self, sid):
        try:
            self.m.swap_in(sid)
        except OutOfBlocks:
            return
        self.swapped.discard(sid)
        self.touched.add(sid)

    def free(self, sid):
        assert sid not in self.touched  # a sequence finishes after its step ran, never before
        self.m.free(sid)
        self.swapped.discard(sid)
        del self.tokens[sid]

    def run_step(self):
        transfers = self.m.take_transfers()
        self.stored += sum(t.direction == "to_host" for t in transfers)
        self.loaded += sum(t.direction == "to_device" for t in transfers)
        assert self.store.transfer(transfers) == len(transfers) * self.store.bytes_per_block
        self.store.copy_blocks(self.m.take_copies())
        for _, slots, toks, pos in self.writes:
            if slots:
                self.store.write(0, slots, np.asarray(toks, float).reshape(-1, 1, 1),
                                 np.asarray(pos, float).reshape(-1, 1, 1))
        self.writes, self.touched = [], set()
        self.check()

    def fork(self, sid):
        child = f"s{self.serial}"
        self.serial += 1
        self.m.fork(sid, child)
        self.tokens[child] = list(self.tokens[sid])

    def check(self):
        for sid, toks in self.tokens.items():
            if sid in self.swapped:
                continue
            k, v = self.store.gather(0, self.m.block_table(sid), len(toks))
            assert k[:, 0, 0].tolist() == toks, sid
            assert v[:, 0, 0].tolist() == list(range(len(toks))), sid
        self.m.check_invariants()


@settings(max_examples=100, deadline=None)
@given(policy=st.sampled_from(["write-back", "write-through"]), block_size=st.sampled_from([1, 2, 4]),
       num_blocks=st.integers(6, 12), host_blocks=st.integers(1, 24), data=st.data())
def test_a_store_driven_by_a_tiered_manager_holds_every_sequences_tokens(policy, block_size, num_blocks,
                                                                         host_blocks, data):
    e = Engine(num_blocks, block_size, host_blocks, policy)
    prefixes = [[1, 2, 3, 1, 2, 3, 1, 2], [3, 3, 1, 2, 2, 1, 3, 1]]  # shared prefixes: host hits
    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        live = sorted(e.tokens)
        for _ in range(data.draw(st.integers(1, 4), label="calls")):
            live = sorted(e.tokens)
            running = [s for s in live if s not in e.swapped]
            # admissions and frees weigh double: cached blocks, evictions, offloads, host hits
            op = data.draw(st.sampled_from(["add", "add", "append", "swap_out", "swap_in", "free", "free"]))
            if op == "add":
                pre = data.draw(st.sampled_from(prefixes))
                cut = data.draw(st.sampled_from([len(pre), len(pre), 4, 1]))
                tail = data.draw(st.lists(st.integers(1, 3), max_size=6))
                e.add(pre[:cut] + tail)
            elif op == "append" and running:
                e.append(data.draw(st.sampled_from(running)), data.draw(st.integers(1, 3)))
            elif op == "swap_out":
                ready = [s for s in running if s not in e.touched]  # never after appending to it
                if ready:
                    e.swap_out(data.draw(st.sampled_from(ready)))
            elif op == "swap_in" and e.swapped:
                e.swap_in(data.draw(st.sampled_from(sorted(e.swapped))))
            elif op == "free" and [s for s in live if s not in e.touched]:
                e.free(data.draw(st.sampled_from([s for s in live if s not in e.touched])))
        e.run_step()
        running = [s for s in sorted(e.tokens) if s not in e.swapped]
        if running and data.draw(st.booleans(), label="fork"):
            e.fork(data.draw(st.sampled_from(running)))
    event(f"transfers: {'loads' if e.loaded else 'no loads'}, {'stores' if e.stored else 'no stores'}")
    event(f"host hits: {bool(e.m.usage().host_hit_tokens)}")
    for sid in sorted(e.swapped):  # everything comes back intact once there is room
        if sid not in e.tokens:
            continue
        for other in [s for s in sorted(e.tokens) if s not in e.swapped]:
            e.free(other)
        e.swap_in(sid)
        if sid in e.swapped:  # another swapped sequence holds device blocks: one swapped while
            for other in sorted(e.swapped - {sid}):  # all its blocks were shared moved nothing
                e.free(other)
            e.swap_in(sid)
        e.run_step()
        assert sid not in e.swapped
