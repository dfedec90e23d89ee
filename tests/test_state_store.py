"""The state store on its own: reads (a missing block is zeros), writes, copy-on-write copies and
host transfers of a recurrent-state group's blocks, and refusals that change nothing. Every test
runs on the numpy backend and on torch (on the GPU when there is one)."""
from __future__ import annotations

import numpy as np
import pytest

from pagedkv.state_store import StateStore
from pagedkv.types import CopyOp, Transfer

SHAPES = dict(conv_shape=(6, 3), recurrent_shape=(2, 4, 5))


@pytest.fixture(params=["numpy", "torch"])
def backend(request):
    """(backend, device) of the store under test."""
    if request.param == "numpy":
        return {}
    torch = pytest.importorskip("torch")
    return dict(backend="torch", device="cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def store(backend):
    def make(num_blocks=8, host_blocks=4, **kw):
        return StateStore(2, num_blocks, **{**SHAPES, **backend, **kw}, host_blocks=host_blocks)
    return make


def arr(x):
    """A numpy copy of a store's array (numpy or torch)."""
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.array(x)


def states(n, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6, 3)).astype(np.float32), rng.normal(size=(n, 2, 4, 5)).astype(np.float32)


def test_sizes_are_computed_from_the_shapes(store):
    s = store()
    assert s.bytes_per_block == 2 * (6 * 3 + 2 * 4 * 5) * 4 == 464
    assert s.nbytes == (8 + 4) * 464
    assert StateStore(3, 64, conv_shape=(64, 3), recurrent_shape=(4, 8, 8)).nbytes == 344_064
    with pytest.raises(ValueError, match="numpy"):
        StateStore(2, 8, **SHAPES, dtype="bfloat16")


def test_torch_store_holds_tensors_on_its_device():
    torch = pytest.importorskip("torch")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    s = StateStore(2, 8, **SHAPES, backend="torch", device=device, dtype="bfloat16", host_blocks=2)
    assert (s.conv.device.type, s.conv.dtype, s.host_recurrent.device.type) == (device, torch.bfloat16, "cpu")
    assert s.host_conv.is_pinned() == (device == "cuda") and s.bytes_per_block == 2 * (18 + 40) * 2
    s.write(0, [3], torch.ones(1, 6, 3), np.ones((1, 2, 4, 5)))
    assert s.transfer([Transfer("to_host", 3, 1, group=1), Transfer("to_device", 1, 5, group=1)]) == 2 * 232
    assert bool((s.read(0, [5])[1] == 1).all())


def test_write_then_read_and_a_missing_block_reads_zeros(store):
    s = store()
    conv, rec = states(2, 0)
    s.write(1, [5, 2], conv, rec)
    got_conv, got_rec = s.read(1, [2, -1, 5])
    np.testing.assert_array_equal(arr(got_conv), [conv[1], np.zeros((6, 3)), conv[0]])
    np.testing.assert_array_equal(arr(got_rec), [rec[1], np.zeros((2, 4, 5)), rec[0]])
    assert not arr(s.read(0, [5])[1]).any()  # layers are separate
    got_conv[0] = 9.0  # a read is a copy
    assert arr(s.conv)[1, 2, 0, 0] == conv[1, 0, 0]


def test_copies_run_this_groups_ops_in_order_and_skip_the_others(store, backend):
    s = store()
    conv, rec = states(2, 1)
    s.write(0, [1, 2], conv, rec)
    ops = [CopyOp(1, 3, group=1), CopyOp(3, 4, group=1), CopyOp(2, 6), (2, 7)]  # a chain, then group 0's
    assert s.copy_blocks(ops) == 2 * s.bytes_per_block
    for block in (3, 4):
        np.testing.assert_array_equal(arr(s.read(0, [block])[1][0]), rec[0])
    assert not arr(s.conv)[:, [6, 7]].any()
    assert StateStore(2, 8, **SHAPES, **backend, group=2).copy_blocks([CopyOp(1, 3, group=1)]) == 0


def test_transfers_move_blocks_through_the_host_pool(store):
    s = store()
    conv, rec = states(1, 2)
    s.write(1, [3], conv, rec)
    moved = s.transfer([Transfer("to_host", 3, 0, group=1), Transfer("to_host", 4, 1)])
    assert moved == s.bytes_per_block  # group 0's entry is the K/V store's
    s.write(1, [3], *states(1, 3))  # the device block is reused
    assert s.transfer([Transfer("to_device", 0, 6, group=1)]) == s.bytes_per_block
    np.testing.assert_array_equal(arr(s.read(1, [6])[0][0]), conv[0])
    np.testing.assert_array_equal(arr(s.host_recurrent[1, 0]), rec[0])


def test_bad_input_raises_and_changes_nothing(store):
    s = store()
    s.write(0, [1], *states(1, 4))
    before = arr(s.conv), arr(s.recurrent), arr(s.host_conv)
    with pytest.raises(ValueError, match="distinct"):
        s.write(0, [2, 2], *states(2, 5))
    with pytest.raises(ValueError, match="write blocks"):
        s.write(0, [-1], *states(1, 5))
    with pytest.raises(ValueError, match="states must be"):
        s.write(0, [2], *states(2, 5))
    with pytest.raises(ValueError, match="read blocks"):
        s.read(0, [8])
    with pytest.raises(ValueError, match="layer"):
        s.read(2, [1])
    with pytest.raises(ValueError, match="copy_ops block ids"):
        s.copy_blocks([CopyOp(1, 2, group=1), CopyOp(1, 9, group=1)])
    with pytest.raises(ValueError, match="before every"):
        s.transfer([Transfer("to_device", 0, 2, group=1), Transfer("to_host", 1, 1, group=1)])
    with pytest.raises(ValueError, match="to_host destinations"):
        s.transfer([Transfer("to_host", 1, 0, group=1), Transfer("to_host", 2, 4, group=1)])
    with pytest.raises(ValueError, match="two 'to_host'"):
        s.transfer([Transfer("to_host", 1, 0, group=1), Transfer("to_host", 2, 0, group=1)])
    with pytest.raises(ValueError, match="no host pool"):
        store(host_blocks=0).transfer([Transfer("to_host", 1, 0, group=1)])
    assert all(np.array_equal(a, arr(b)) for a, b in zip(before, (s.conv, s.recurrent, s.host_conv)))
    for kw in (dict(group=0), dict(dtype="float8"), dict(host_blocks=-1), dict(conv_shape=(6, 0)),
               dict(backend="jax")):
        with pytest.raises(ValueError):
            store(**kw)
