"""The state store on its own: reads (a missing block is zeros), writes, copy-on-write copies and
host transfers of a recurrent-state group's blocks, and refusals that change nothing."""
from __future__ import annotations

import numpy as np
import pytest

from pagedkv.state_store import StateStore
from pagedkv.types import CopyOp, Transfer

SHAPES = dict(conv_shape=(6, 3), recurrent_shape=(2, 4, 5))


def store(num_blocks=8, host_blocks=4, **kw):
    return StateStore(2, num_blocks, **{**SHAPES, **kw}, host_blocks=host_blocks)


def states(n, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6, 3)).astype(np.float32), rng.normal(size=(n, 2, 4, 5)).astype(np.float32)


def test_sizes_are_computed_from_the_shapes():
    s = store()
    assert s.bytes_per_block == 2 * (6 * 3 + 2 * 4 * 5) * 4 == 464
    assert s.nbytes == (8 + 4) * 464
    assert StateStore(3, 64, conv_shape=(64, 3), recurrent_shape=(4, 8, 8)).nbytes == 344_064


def test_write_then_read_and_a_missing_block_reads_zeros():
    s = store()
    conv, rec = states(2, 0)
    s.write(1, [5, 2], conv, rec)
    got_conv, got_rec = s.read(1, [2, -1, 5])
    np.testing.assert_array_equal(got_conv, [conv[1], np.zeros((6, 3)), conv[0]])
    np.testing.assert_array_equal(got_rec, [rec[1], np.zeros((2, 4, 5)), rec[0]])
    assert not s.read(0, [5])[1].any()  # layers are separate
    got_conv[0] = 9.0  # a read is a copy
    assert s.conv[1, 2, 0, 0] == conv[1, 0, 0]


def test_copies_run_this_groups_ops_in_order_and_skip_the_others():
    s = store()
    conv, rec = states(2, 1)
    s.write(0, [1, 2], conv, rec)
    ops = [CopyOp(1, 3, group=1), CopyOp(3, 4, group=1), CopyOp(2, 6), (2, 7)]  # a chain, then group 0's
    assert s.copy_blocks(ops) == 2 * s.bytes_per_block
    for block in (3, 4):
        np.testing.assert_array_equal(s.read(0, [block])[1][0], rec[0])
    assert not s.conv[:, [6, 7]].any()
    assert StateStore(2, 8, **SHAPES, group=2).copy_blocks([CopyOp(1, 3, group=1)]) == 0


def test_transfers_move_blocks_through_the_host_pool():
    s = store()
    conv, rec = states(1, 2)
    s.write(1, [3], conv, rec)
    moved = s.transfer([Transfer("to_host", 3, 0, group=1), Transfer("to_host", 4, 1)])
    assert moved == s.bytes_per_block  # group 0's entry is the K/V store's
    s.write(1, [3], *states(1, 3))  # the device block is reused
    assert s.transfer([Transfer("to_device", 0, 6, group=1)]) == s.bytes_per_block
    np.testing.assert_array_equal(s.read(1, [6])[0][0], conv[0])
    np.testing.assert_array_equal(s.host_recurrent[1, 0], rec[0])


def test_bad_input_raises_and_changes_nothing():
    s = store()
    s.write(0, [1], *states(1, 4))
    before = s.conv.copy(), s.recurrent.copy(), s.host_conv.copy()
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
    assert all(np.array_equal(a, b) for a, b in zip(before, (s.conv, s.recurrent, s.host_conv)))
    for kw in (dict(group=0), dict(dtype="bfloat16"), dict(host_blocks=-1), dict(conv_shape=(6, 0))):
        with pytest.raises(ValueError):
            store(**kw)
