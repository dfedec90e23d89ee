"""The sequences' half of ``check_invariants``, for every configuration of attention groups.

One checker: the tables against the pool's refcounts and the manager's counters, each group's
table against its spec's own rule (:meth:`~pagedkv.kv_specs.AttentionSpec.check_table`), the
fast-path slots, and every sequence's stored hashes against its tokens and the pool's keys. It
reads the coordinator's parts (pool, prefix cache, copy queue, specs) through their public
methods and changes nothing.
"""
from __future__ import annotations

from collections import Counter

from .checks import require
from .hashing import le_bytes

__all__ = ["check_sequences"]


def check_sequences(seqs: dict, coord, unready_count: int, swapped_count: int, busy: set | None) -> dict[int, int]:
    """Raise AssertionError unless the sequences agree with the pool and the counters: each
    block's refcount is its table entries over all groups, and a block sits in one group's
    tables only; each table covers the scheduled positions (a prompt admitted with
    ``reserve=True`` also its reserved, private tail); each group's spec accepts its table; a
    partial block is a last block shared at one fill; fast-path slots are private next slots
    with no release due before their end; swapped-out entries hold no device block. Returns
    host block -> swapped sequences holding it, for the host tier's check."""
    pool, bs, specs = coord.pool, coord.bs, coord.specs
    refs = Counter(b for s in seqs.values() for t in s.tables for b in t if b >= 0)
    for b, c in enumerate(pool.refcounts()):
        require(refs.get(b, 0) == c, f"block {b}: refcount {c}, referenced {refs.get(b, 0)} times")
    refcount = pool.refcount
    owner: dict[int, int] = {}
    partial_fill: dict[int, int] = {}
    unready = swapped = 0
    host_refs: dict[int, int] = {}
    for sid, s in seqs.items():
        n, done = len(s.tokens), s.computed
        c = done - s.drafts
        require(n >= 1 and 0 <= s.unscheduled <= n and 0 <= s.drafts <= done, f"sequence {sid!r}: bad counters")
        require(not (s.unscheduled and s.drafts), f"sequence {sid!r}: drafts mid-prefill")
        require(0 <= s.written <= c // bs, f"sequence {sid!r}: bad written prefix")
        require(len(s.tables) == len(specs) == len(s.low) and s.table is s.tables[0], f"{sid!r}: a table per group")
        unready += s.unready
        on_host = s.host if s.host is not None else [{}] * len(specs)
        if s.host is not None:
            swapped += 1
            require(not s.unscheduled and not s.drafts and s.nxt < 0, f"{sid!r}: swapped out mid-step")
            for g, mine in enumerate(s.host):
                for i, hb in mine.items():
                    require(s.tables[g][i] == -1, f"{sid!r} group {g}: host entry {i} holds a device block")
                    host_refs[hb] = host_refs.get(hb, 0) + 1
        nsched = -(-done // bs)
        for g, (spec, t) in enumerate(zip(specs, s.tables)):
            what = f"sequence {sid!r} group {g}"
            if spec.holds_state:  # one entry per interval: the spec checks its own table
                spec.check_table(t, s.low[g], done, bs, what)
                require(not t or t[-1] >= 0 or s.host is not None, f"{what}: no running state entry")
                for b in t:
                    if b >= 0:
                        require(owner.setdefault(b, g) == g, f"block {b} is in two groups' tables")
                continue
            reserved = t[nsched:] if s.unscheduled and len(t) == -(-n // bs) else []
            require(len(t) == nsched + len(reserved), f"{what}: {len(t)} blocks for {done} positions")
            for b in reserved:
                require(refcount(b) == 1, f"block {b} reserved for {sid!r} is shared")
            spec.check_table(t, s.low[g], c, bs, what)
            live = [i for i, b in enumerate(t) if b >= 0]
            require(all(i >= s.low[g] or i < spec.kept_blocks(bs) for i in live),
                    f"{what}: a live entry below its first live one")
            require(all(b >= 0 or i in on_host[g] for i, b in enumerate(t) if i >= s.low[g]),
                    f"{what}: a position without a block")
            for b in t:
                if b >= 0:
                    require(owner.setdefault(b, g) == g, f"block {b} is in two groups' tables")
            if done % bs and nsched and t[nsched - 1] >= 0:
                b = t[nsched - 1]
                require(partial_fill.setdefault(b, done % bs) == done % bs, f"partial block {b} shared at two fills")
        if s.mirror is not None:
            require(s.mirror[: len(s.table)].tolist() == s.table, f"sequence {sid!r}: int32 mirror differs")
        if not s.shared and done % bs and not s.unscheduled and s.host is None:
            require(all(refcount(t[-1]) == 1 for t in s.tables), f"{sid!r}: a shared partial last block not marked shared")
        if s.nxt >= 0:
            _check_fast_path(sid, s, coord)
    for s in seqs.values():
        for t in s.tables:
            for b in t[: s.computed // bs]:
                require(b < 0 or b not in partial_fill, f"block {b} is full in one table, partial in another")
    require(unready == unready_count, f"{unready} sequences unready, {unready_count} counted")
    require(swapped == swapped_count, f"{swapped} sequences swapped out, {swapped_count} counted")
    if busy is not None:
        live = set(map(id, seqs.values()))
        require(all(id(s) in live and s.host is None for s in busy),
                "a sequence given work this step is freed or swapped out")
    for cp in coord.cq.pending():
        require(owner.get(cp.dst) == cp.group, f"copy destination {cp.dst} is not in group {cp.group}")
    _check_hashes(seqs, coord, owner)
    return host_refs


def _check_fast_path(sid, s, coord) -> None:
    """The fast-path slot is the private next slot of group 0, and no group's release falls due
    before it ends."""
    bs, done = coord.bs, s.computed
    off = done % bs
    ok = (off and not s.unscheduled and not s.drafts and s.nxt == s.table[-1] * bs + off
          and all(coord.pool.refcount(t[-1]) == 1 for t in s.tables) and s.nxt < s.end <= s.nxt - off + bs)
    require(bool(ok), f"sequence {sid!r}: fast-path slot {s.nxt} is not its private next slot")
    last = done + s.end - s.nxt - 1  # the fast path runs through this committed count
    for spec in coord.specs:
        if spec.holds_state:  # its running entry is private (above); no entry changes in place
            continue
        require(spec.released_below(last, bs) == spec.released_below(done, bs),
                f"sequence {sid!r}: a release falls due before its fast path ends")


def _check_hashes(seqs: dict, coord, owner: dict) -> None:
    """Every sequence's stored hashes are its non-draft tokens' chained hashes; only fully
    scheduled, non-draft blocks carry a key, each its own content's (``coord.key(g, hash)``);
    a full block without one is a remembered twin, and every twin is such a block."""
    pool, cache, bs = coord.pool, coord.cache, coord.bs
    keyed = pool.keyed_blocks()
    if cache is None:
        require(not keyed, "blocks carry keys with prefix caching off")
        return
    twins = cache.twins()
    for b, k in keyed.items():
        if b in owner:
            require(coord.group_of_key(k) == owner[b], f"block {b} of group {owner[b]} keyed as {k!r}")
    held_twins = {}
    for sid, s in seqs.items():
        nfull = (len(s.tokens) - s.drafts) // bs
        expect = coord.hasher.chain_keyed(coord.root, le_bytes(s.tokens[: nfull * bs]), 4 * bs, 0, nfull, s.keys)
        require(s.hashes == expect, f"sequence {sid!r}: stored hashes are not its tokens' hashes")
        offered = (s.computed - s.drafts) // bs
        for g, t in enumerate(s.tables):
            spec = coord.specs[g]
            for i, b in enumerate(t):
                if b < 0:
                    continue
                k = keyed.get(b)
                if spec.holds_state:  # a checkpoint is keyed by the block that closes its interval
                    close = (i + 1) * spec.interval // bs - 1
                    want = coord.key(g, expect[close]) if close < len(expect) else None
                    require(k is None or k == want, f"state block {b} of {sid!r} is keyed as another checkpoint")
                    if k is None and b in twins:
                        require(twins[b] == want, f"state block {b} of {sid!r} twins another checkpoint")
                        held_twins[b] = twins[b]
                    continue
                if i >= offered:
                    require(k is None, f"block {b} of {sid!r} is published before it is scheduled")
                elif k is None:  # findable all the same: a twin of the block its key maps
                    require(twins.get(b) == coord.key(g, expect[i]), f"full block {b} of {sid!r} is not findable")
                    held_twins[b] = twins[b]
                else:
                    require(k == coord.key(g, expect[i]), f"block {b} of {sid!r} is mapped under another content")
    require(held_twins == twins, "a remembered twin is no live full block of that content")
