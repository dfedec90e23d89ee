"""Report section: what forking costs, measured on the real manager.

A fork shares every block of the parent: it touches one refcount per block and copies nothing.
The alternative an engine without paging has, copying the parent's KV eagerly, moves
``tokens x KV bytes per token``: for Llama-3.1-8B (128 KiB a token) a 32,768-token sequence is
4 GiB. The only bytes paging ever copies for a fork are one partial block at the first write
(copy-on-write), 2 MiB at block size 16.
"""
from __future__ import annotations

import gc
import time

from ..manager import KVCacheManager
from .tables import Section, Table
from .options import ReportOptions

LENGTHS = (128, 512, 2048, 8192, 32768)
MIB = 2**20


def _median_fork_us(m: KVCacheManager, reps: int) -> float:
    """Median µs of ``fork`` (the child is freed outside the timed region)."""
    times = []
    gc.disable()
    try:
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            m.fork("parent", "child")
            times.append(time.perf_counter_ns() - t0)
            m.free("child")
    finally:
        gc.enable()
    times.sort()
    return times[len(times) // 2] / 1e3


def _first_write_copies(length: int, block_size: int) -> int:
    """Blocks copied by a child's first append after forking a ``length``-token parent."""
    m = KVCacheManager(num_blocks=length // block_size + 3, block_size=block_size, enable_events=False)
    m.add_sequence("parent", [i % 32000 for i in range(length)])
    m.fork("parent", "child")
    m.append_token("child", 2)
    return len(m.take_copies())


def _fork_row(length: int, block_size: int, kv_bytes: int, reps: int) -> list:
    m = KVCacheManager(num_blocks=length // block_size + 2, block_size=block_size, enable_events=False)
    m.add_sequence("parent", [i % 32000 for i in range(length)])
    free_before = m.num_free_blocks
    fork_us = _median_fork_us(m, reps)
    m.fork("parent", "child")
    allocated = free_before - m.num_free_blocks
    fork_copies = len(m.take_copies())  # what the fork itself queued for the engine to copy
    blocks = len(m.block_table("parent"))
    block_mib = block_size * kv_bytes / MIB
    partial_mib = _first_write_copies(length + 1, block_size) * block_mib
    return [
        length,
        blocks,
        round(fork_us, 2),
        round(fork_us * 1e3 / blocks, 1),
        allocated,
        length * kv_bytes / MIB,
        fork_copies * block_mib,
        _first_write_copies(length, block_size) * block_mib,
        partial_mib,
        round(_copy_us(length * kv_bytes), 3),
        round(_copy_us(partial_mib * MIB), 3),
    ]


def _copy_us(nbytes: float) -> float:
    """Modelled µs to copy ``nbytes`` within device memory: read and write each byte once at the
    H100's HBM bandwidth (3.35 TB/s), the floor of any copy kernel. 256 MiB: 2 x 268,435,456 /
    3.35e12 = 160.26 µs."""
    from ..sim.costmodel import H100_HBM_BYTES_PER_S

    return 2 * nbytes / H100_HBM_BYTES_PER_S * 1e6


def section(opts: ReportOptions) -> Section:
    from ..sim.sizing import kv_bytes_per_token

    kv_bytes = kv_bytes_per_token(opts.model)
    bs = opts.block_size
    lengths = LENGTHS[:3] if opts.quick else LENGTHS
    reps = 50 if opts.quick else 400
    table = Table(
        title=f"fork cost (block size {bs}; KV sizes for {opts.model}, {kv_bytes:,} B/token)",
        columns=[
            "tokens",
            "blocks shared",
            "fork µs (median)",
            "ns per block",
            "blocks allocated",
            "eager copy MiB",
            "paged fork MiB",
            "1st write MiB, last block full",
            "1st write MiB, last block partial",
            "eager copy µs (modelled)",
            "1st write copy µs (modelled)",
        ],
        plot={"name": "fork_cost_time", "x": "tokens",
              "y": ["fork µs (median)", "eager copy µs (modelled)"],
              "kind": "line", "logx": True, "logy": True,
              "legend": {"fork µs (median)": "paged fork: refcounts only, no KV moved (measured, median)",
                         "eager copy µs (modelled)": "eager copy of the whole KV (modelled: H100 HBM, read + write)"},
              "styles": {"eager copy µs (modelled)": {"linestyle": "--"}},
              "ylabel": "µs per fork (log scale)", "xlabel": "tokens in the forked sequence (log scale)",
              "title": f"Forking a sequence: paged (measured) against an eager copy of its {opts.model} KV "
                       f"(modelled)"},
    )
    for length in lengths:
        table.add(*_fork_row(length, bs, kv_bytes, reps))
    table.notes.append(
        "fork = one refcount increment per block; nothing is allocated and no KV moves (paged fork "
        "MiB: the copies the fork queued, measured). "
        "A child's first write copies one block when the shared last block is partial "
        "(the partial column: a parent one token longer), nothing when it is full."
    )
    table.notes.append(
        "µs (modelled): each byte read and written once at the H100's 3.35 TB/s of HBM, the floor "
        "of any copy kernel; the fork µs column is measured wall clock of KVCacheManager.fork."
    )
    last = table.rows[-1]
    return Section(
        key="fork_cost",
        heading="What forking costs",
        intro=(
            "Forking a sequence (parallel sampling, beam search) shares its blocks instead of "
            "copying its KV. Measured on the real manager: time grows with the number of blocks "
            "(refcounts), bytes moved stay at zero."
        ),
        tables=[table],
        data={
            "kv_bytes_per_token": kv_bytes,
            "longest_tokens": last[0],
            "longest_fork_us": last[2],
            "longest_eager_copy_mib": last[5],
            "fork_copy_mib": max(r[6] for r in table.rows),
            "blocks_allocated_by_fork": max(r[4] for r in table.rows),
        },
    )
