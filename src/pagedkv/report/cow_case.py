"""Report section: why the first write after a fork must copy, as a worked case on the manager.

Everything printed is read back from a real ``KVCacheManager``: the tables, refcounts, slots and
the copy pair, so the text cannot drift from what the code does.
"""
from __future__ import annotations

from ..manager import KVCacheManager
from .tables import Section
from .options import ReportOptions

BS = 4  # a small block size keeps the worked case readable


def _state(m: KVCacheManager, ids: list[str]) -> list[str]:
    lines = []
    for sid in ids:
        table = m.block_table(sid)
        refs = ", ".join(f"{b}:{m.refcount(b)}" for b in table)
        lines.append(f"  {sid:<7} table {table!s:<10} tokens {m.num_tokens(sid):>2}   refcounts {{{refs}}}")
    return lines


def _partial_case() -> tuple[list[str], dict]:
    m = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    m.add_sequence("parent", [11, 12, 13, 14, 15, 16])
    m.fork("parent", "child")
    lines = ["1. A 6-token prompt, block size 4, forked into a child:"]
    lines += _state(m, ["parent", "child"])
    shared = m.block_table("child")[-1]
    clash = shared * BS + m.num_tokens("child") % BS
    lines.append(
        f"   Both sequences' next token belongs at slot {clash} (block {shared}, offset "
        f"{clash % BS}). Parent and child will generate different tokens there: writing in place "
        "would overwrite the other's future."
    )
    child_slot = m.append_token("child", 90)
    copies = m.take_copies()
    lines.append(f"2. child appends token 90 -> slot {child_slot}; queued copies {copies}:")
    lines += _state(m, ["parent", "child"])
    parent_slot = m.append_token("parent", 70)
    lines.append(
        f"3. parent appends token 70 -> slot {parent_slot}, in place (it is now block "
        f"{shared}'s last holder); queued copies {m.take_copies()}:"
    )
    lines += _state(m, ["parent", "child"])
    m.check_invariants()
    data = {"copy_pair": [copies[0].src, copies[0].dst], "child_slot": child_slot, "parent_slot": parent_slot}
    return lines, data


def _full_case() -> list[str]:
    m = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    m.add_sequence("parent", list(range(1, 9)))
    m.fork("parent", "child")
    slot = m.append_token("child", 90)
    copies = m.take_copies()
    lines = [f"4. Contrast: an 8-token prompt (its last block full), forked; child appends -> slot {slot}, copies {copies}:"]
    lines += _state(m, ["parent", "child"])
    lines.append("   A full block is never written again, so sharing it needs no copy.")
    return lines


def section(opts: ReportOptions) -> Section:
    lines, data = _partial_case()
    lines += _full_case()
    return Section(
        key="cow_case",
        heading="Why the first write after a fork must copy",
        intro=(
            "After a fork, parent and child share every block. A child's first write into a shared, "
            "partially filled block copies that block once (one block, then the child writes its "
            "own copy); writes into blocks it holds alone, and the blocks after it, copy nothing, and "
            "a shared full block is never written, so it is never copied. The case below is run on "
            "the real manager."
        ),
        text=["\n".join(lines)],
        data=data,
    )
