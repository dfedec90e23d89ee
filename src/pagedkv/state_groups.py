"""Recurrent-state groups: the tables of :class:`~pagedkv.kv_specs.RecurrentState` groups.

A Mamba or gated-DeltaNet layer group keeps no K/V per position: each sequence carries one
fixed-size state that every token updates. Its table has one entry per checkpoint interval T
(entry j: the state after the last scheduled position of j*T .. (j+1)*T - 1). This module is
the hybrid coordinator's part for such groups, the per-type rules applied to a sequence's
tables; the K/V groups' loop never touches these tables. Imports the pool's and copy queue's
public methods through the coordinator it serves; never the facade.

The rules (docs/design.md 3.14), for one scheduling call that computes positions a .. b - 1:

* it reads the state in entry (a - 1) // T (a zero state when a = 0) and writes the state after
  b - 1 into entry (b - 1) // T: in place when they are the same entry (copied first when a fork
  shares it: ``CopyOp(src, dst, group=g)``), else into a fresh block (entries skipped between
  read -1);
* before it allocates, every entry other than the running one ((a - 1) // T) is released: a
  published checkpoint becomes cached-free and revivable, any other entry returns clean;
* when b is an interval end the written entry is a checkpoint, published under the chain hash
  of block b / block_size - 1 at the next ``take_copies()`` (the step that computes it runs
  after that; a batched state kernel reads every initial state before it writes any final one,
  so no request of the same step could read it);
* a prefix hit of h tokens (an interval end whose checkpoint is cached) starts from that frozen
  checkpoint: the table holds entry h / T - 1 only, and the next position goes to a new entry.

Worked example (block size 4, T = 8): a 13-token prompt admitted whole reads nothing, writes
entry 1 (a fresh block); a decode token at position 13 writes entry 1 in place; a later prompt
sharing the first 8 tokens hits nothing until some call ends at position 8 exactly.
"""
from __future__ import annotations

from typing import Hashable, Sequence

from .checks import require
from .sequence import Seq

__all__ = ["StateGroups"]


class StateGroups:
    """The state groups of one hybrid coordinator: ``groups`` is ``(index, spec)`` pairs."""

    def __init__(self, coord, groups: tuple) -> None:
        self.coord = coord
        self.groups = groups
        for _, spec in groups:
            if spec.interval % coord.bs:
                raise ValueError(f"interval must be a multiple of block_size ({coord.bs}), got {spec.interval}")
        # checkpoints waiting for the next take_copies(): (sequence, group, entry, block, block index)
        self.pending: list[tuple] = []

    # ---- one scheduling call -------------------------------------------------------------------

    def release(self, s: Seq, committed: int) -> list[int]:
        """Every live entry other than the running one, released (before the call allocates);
        returns the blocks released."""
        out = []
        rc = self.coord.pool.refcount
        for g, spec in self.groups:
            t = s.tables[g]
            run = (committed - 1) // spec.interval if committed else -1
            gone = [j for j, b in enumerate(t) if b >= 0 and j != run]
            for j in gone:
                out.append(t[j])
                t[j] = -1
        if out:
            self.coord._let_go(out, rc)
            self._drop_pending(out)
            self.coord.pool.release_all(out[::-1])
        return out

    def due(self, s: Seq, committed: int) -> list[int]:
        """The blocks :meth:`release` would let go of now (for a capacity check); changes nothing."""
        out = []
        for g, spec in self.groups:
            run = (committed - 1) // spec.interval if committed else -1
            out += [b for j, b in enumerate(s.tables[g]) if b >= 0 and j != run]
        return out

    def needs(self, s: Seq, a: int, b: int) -> tuple[int, int]:
        """(fresh blocks, copy destinations) a call computing ``a .. b - 1`` takes: a new entry
        is a fresh block; writing a shared running entry in place is a copy."""
        fresh = copies = 0
        rc = self.coord.pool.refcount
        for g, spec in self.groups:
            t = spec.interval
            if a == 0 or (a - 1) // t != (b - 1) // t:
                fresh += 1
            elif rc(s.tables[g][(a - 1) // t]) > 1:
                copies += 1
        return fresh, copies

    def schedule(self, s: Seq, a: int, b: int) -> None:
        """Apply a call computing ``a .. b - 1`` (capacity checked, releases made): extend each
        table, take the write block, record ``(read, write)`` for ``state_indices`` and queue
        the checkpoint when ``b`` ends an interval."""
        coord = self.coord
        io = s.state_io if s.state_io is not None else {}
        for g, spec in self.groups:
            t, table = spec.interval, s.tables[g]
            first, last = (a - 1) // t if a else -1, (b - 1) // t
            read = table[first] if a else -1
            if first == last:
                write = read
                if coord.pool.refcount(read) > 1:  # shared by a fork: copy, then write the copy
                    write = coord.cq.destination()
                    coord.pool.release(read)
                    table[first] = write
                    coord.cq.add(read, write, g)
                    read = write
            else:
                write = coord.cq.fresh_one()
                table += [-1] * (last - len(table)) + [write]
            io[g] = (read, write)
            if b % t == 0 and coord.cache is not None:
                self.pending.append((s, g, last, write, b // coord.bs - 1))
        s.state_io = io
        s.io_at = b

    def take_checkpoints(self) -> None:
        """The step that computed the queued checkpoints runs after this drain: publish each
        one its sequence still holds, under ``(group, chain hash of the block that closes it)``."""
        coord, bs = self.coord, self.coord.bs
        for s, g, j, block, i in self.pending:
            if (j < len(s.tables[g]) and s.tables[g][j] == block and coord.pool.refcount(block)
                    and i < len(s.hashes)):
                coord.cache.publish([block], [(g, s.hashes[i])], (g, s.hashes[i - 1] if i else coord.root),
                                    s.tokens[i * bs : (i + 1) * bs], bs,
                                    None if s.keys is None else s.keys.block_keys(i, i + 1))
        self.pending = []

    def forget_pending(self, blocks: Sequence[int]) -> None:
        """These blocks are let go before the step ran: their checkpoints are never published."""
        self._drop_pending(blocks)

    def _drop_pending(self, blocks: Sequence[int]) -> None:
        if self.pending:
            gone = set(blocks)
            self.pending = [p for p in self.pending if p[3] not in gone]

    # ---- admission, fork, free -----------------------------------------------------------------

    def admit(self, tables: list, k: int, hit_rows: list) -> None:
        """A hit of ``k`` blocks: the state group's table holds only the checkpoint entry."""
        bs = self.coord.bs
        for g, spec in self.groups:
            entries = k * bs // spec.interval
            tables[g] = [-1] * (entries - 1) + list(hit_rows[g]) if entries else []

    def unpublish_own(self, s: Seq) -> list[int]:
        """The checkpoints this sequence wrote itself and alone holds (``free(cache=False)``)."""
        rc, out = self.coord.pool.refcount, []
        for g, spec in self.groups:
            first_own = s.written * self.coord.bs // spec.interval  # entries past its hit
            out += [b for j, b in enumerate(s.tables[g]) if j >= first_own and b >= 0 and rc(b) == 1]
        return out

    def fast_path_end(self, c: int) -> int:
        """The first position at or after ``c`` a decode token must take the slow path for."""
        return min(spec.next_release(c - 1, self.coord.bs, 1 << 62) for _, spec in self.groups)

    # ---- exports and checks --------------------------------------------------------------------

    def indices(self, ss: Sequence[Seq], g: int) -> tuple[list, list]:
        """``(read, write)`` block ids of each sequence's last scheduling call in group ``g``."""
        reads, writes = [], []
        for s in ss:
            io = s.state_io
            if io is None:
                r = w = -1
            elif s.io_at == s.computed:
                r, w = io[g]
            else:  # a decode token on the fast path: the running entry, in place
                w = s.tables[g][-1]
                r = w
            reads.append(r)
            writes.append(w)
        return reads, writes

    def check(self, s: Seq, sid: Hashable) -> None:
        for g, spec in self.groups:
            t = s.tables[g]
            c = s.computed
            require(len(t) == spec.entries(c), f"sequence {sid!r} group {g}: {len(t)} entries for {c} positions")
            require(not t or t[-1] >= 0, f"sequence {sid!r} group {g}: no running entry")
