"""Report section: swap against recompute per preemption, by block size (the vLLM paper's Fig. 19).

A preempted sequence of ``L`` tokens is either recomputed (``L`` tokens of prefill, whatever the
block size) or swapped: ``ceil(L / B)`` blocks copied to host memory and back, each block as
``copies_per_block`` copies that each pay a fixed latency before their bytes flow. Small blocks
are all latency, so swapping loses to recomputing; large blocks amortise it and swapping wins.
Every number here comes from :mod:`pagedkv.sim.swap_cost` (the link model and its stated
parameters) and the cost model of ``opts.model`` on an H100.

The per-copy latency is an assumption, not a measurement, so the section shows the spread it
causes (2, 5, 10 and 20 us, and 0: bandwidth alone) rather than one point, and two layouts: vLLM's
per-layer layout (one copy per layer's K and per layer's V of a block: 64 for Llama-3.1-8B) and a
layout that keeps a block's layers together (one copy per block, vLLM 0.12's contiguous layout).

Worked number (Llama-3.1-8B, 1,024 tokens, block size 16, 10 us per copy, 64 GB/s): 64 blocks,
128 MiB and 4,096 copies each way: 43.06 ms per direction, 86.11 ms for the swap against 16.63 ms
to recompute; swapping first wins at block size 114 (9 blocks: 15.7 ms).
"""
from __future__ import annotations

from ..sim.costmodel import CostModel
from ..sim.swap_cost import (BLOCK_SIZES, PCIE5_X16_BYTES_PER_S, Link, SwapCost, copies_per_block,
                             crossover_block_size, swap_cost)
from ..tables import Section, Table
from .options import ReportOptions

__all__ = ["section", "LATENCIES_US", "TOKENS", "PAPER_FINDING"]

KEY, HEADING = "swap_vs_recompute", "Swap against recompute per preemption (vLLM Fig. 19)"
TOKENS = 1_024  # the preempted sequence of the main table
LATENCIES_US = (2, 5, 10, 20)  # the assumed fixed cost of one host<->device copy: the spread
CROSSOVER_TOKENS = (256, 1_024, 4_096, 16_384)
MIB = 2**20
PAPER_FINDING = (
    "Reference, the vLLM paper (Kwon et al., SOSP'23, arXiv 2309.06180), section 7.3 and Fig. 19 "
    "(OPT-13B, ShareGPT; their measurement, not ours): swapping incurs excessive overhead with "
    "small block sizes, whose many small CPU-GPU transfers limit the effective PCIe bandwidth, while "
    "recomputation costs the same at every block size; recomputation is more efficient when blocks "
    "are small, swapping when they are large, and from 16 to 64 the two perform comparably end to end.")


def _link(latency_us: float) -> Link:
    return Link(PCIE5_X16_BYTES_PER_S, latency_us * 1e-6)


def _costs(tokens: int, bs: int, model: str, cost: CostModel, latency_us: float,
           copies: int | None = None) -> SwapCost:
    return swap_cost(tokens, bs, model, link=_link(latency_us), cost_model=cost, copies=copies)


def _per_block_table(opts: ReportOptions, cost: CostModel) -> tuple[Table, dict]:
    model = opts.model
    cpb = copies_per_block(model)
    lat_cols = [f"swap ms @{u}us" for u in LATENCIES_US]
    t = Table(
        f"One preemption of a {TOKENS:,}-token sequence ({model}): swap (out and back in) against "
        f"recompute, by block size",
        ["block size", "blocks", "MiB each way", "copies each way", *lat_cols,
         "swap ms 1 copy/block @10us", "recompute ms", "swap / recompute @10us"],
        plot={"name": "swap_vs_recompute", "x": "block size", "y": [*lat_cols, "recompute ms"], "kind": "line", "logx": True,
              "logy": True, "ylabel": "ms per preemption (out + in)"},
    )
    rows = {}
    for bs in BLOCK_SIZES:
        by_lat = {u: _costs(TOKENS, bs, model, cost, u) for u in LATENCIES_US}
        ref = by_lat[10]
        one = _costs(TOKENS, bs, model, cost, 10, copies=1)
        t.add(bs, ref.blocks, ref.bytes_moved / MIB, ref.copies, *[1e3 * by_lat[u].swap_s for u in LATENCIES_US],
              1e3 * one.swap_s, 1e3 * ref.recompute_s, ref.swap_over_recompute)
        rows[bs] = {"blocks": ref.blocks, "bytes_each_way": ref.bytes_moved, "copies_each_way": ref.copies,
                    "swap_s": {u: by_lat[u].swap_s for u in LATENCIES_US}, "swap_s_one_copy": one.swap_s,
                    "recompute_s": ref.recompute_s}
    t.notes.append(
        f"Link: {PCIE5_X16_BYTES_PER_S / 1e9:.0f} GB/s per direction (PCIe 5.0 x16 peak), plus the "
        f"assumed latency per copy; a block is {cpb} copies in the per-layer layout (K and V of each "
        f"layer), 1 in a contiguous one. Whole blocks move, so a partial last block pads.")
    t.notes.append(
        f"Recompute: {TOKENS:,} x 2 x parameters / {cost.peak_flops / 1e12:.0f} TFLOP/s "
        f"({cost.model}, H100 BF16), the step's fixed overhead left out on both sides.")
    t.notes.append(
        "vLLM's offloading blog (Ozeri and Harnik, blog.vllm.ai, 29 Dec 2025; their measurement) "
        "reports about 50 GB/s for one direction of an H100's DMA and 32 KB per-layer blocks for "
        "Llama-3.1-8B at block size 16 (2 MB once contiguous): real copies are slower than this "
        "peak, which flatters swapping here.")
    return t, rows


def _crossover_table(opts: ReportOptions, cost: CostModel) -> tuple[Table, dict]:
    model = opts.model
    lengths = CROSSOVER_TOKENS[1:2] if opts.quick else CROSSOVER_TOKENS
    latencies = (0, *LATENCIES_US)
    t = Table(
        f"Smallest block size (1-256) at which swapping is no slower than recomputing ({model}), "
        f"by latency per copy",
        ["layout, sequence", "0 us (bandwidth only)", *[f"{u} us" for u in LATENCIES_US]],
    )
    data: dict = {u: {"per_layer": {}, "one_copy": {}} for u in latencies}
    for layout, copies in (("per_layer", None), ("one_copy", 1)):
        for n in lengths:
            row = [crossover_block_size(n, model=model, link=_link(u), cost_model=cost, copies=copies)
                   for u in latencies]
            for u, bs in zip(latencies, row):
                data[u][layout][n] = bs
            name = "per-layer" if copies is None else "1 copy/block"
            t.add(f"{name}, {n:,} tokens", *row)
    t.notes.append("The crossover scales with the latency per copy: halve it and the crossover "
                   "roughly halves.")
    if any(bs is None for row in t.rows for bs in row[1:]):
        t.notes.append("'-': swapping never wins up to block size 256.")
    return t, data


def _paper_check(rows: dict) -> dict[int, bool]:
    """Per latency: does the model show the paper's pattern (swap loses at block size 1 and wins
    at 256)?"""
    small, large = rows[min(rows)], rows[max(rows)]
    return {u: small["swap_s"][u] > small["recompute_s"] and large["swap_s"][u] <= large["recompute_s"]
            for u in LATENCIES_US}


def section(opts: ReportOptions) -> Section:
    if not isinstance(opts, ReportOptions):
        raise ValueError(f"opts must be ReportOptions, got {type(opts).__name__}")
    cost = CostModel.for_model(opts.model)
    per_block, rows = _per_block_table(opts, cost)
    crossover, cross = _crossover_table(opts, cost)
    pattern = _paper_check(rows)
    at_bs = {u: rows[opts.block_size]["swap_s"][u] / rows[opts.block_size]["recompute_s"]
             for u in LATENCIES_US} if opts.block_size in rows else {}
    text = [PAPER_FINDING]
    held = [f"{u} us" for u in LATENCIES_US if pattern[u]]
    held_text = "every latency shown" if len(held) == len(LATENCIES_US) else (", ".join(held) or "none")
    spread = ", ".join(f"{cross[u]['per_layer'][TOKENS] or '-'} ({u} us per copy)" for u in LATENCIES_US)
    one = ", ".join(str(cross[u]["one_copy"][TOKENS] or "-") for u in LATENCIES_US)
    text.append(
        f"Our model, {TOKENS:,} tokens, per-layer layout: swapping first wins at block size {spread}; "
        f"with one copy per block at {one} for the same latencies. The paper's pattern (swap loses at "
        f"block size 1 and wins at 256) holds at {held_text}.")
    if at_bs:
        text.append(f"At the report's block size {opts.block_size}, swap takes "
                    f"{', '.join(f'{v:.2g}x' for v in at_bs.values())} the recompute time at "
                    f"{', '.join(f'{u} us' for u in at_bs)} per copy (per-layer layout).")
    return Section(
        key=KEY, heading=HEADING,
        intro=(__doc__ or "").split("\n\n")[1].replace("\n", " "),
        tables=[per_block, crossover], text=text,
        data={"tokens": TOKENS, "model": opts.model, "latencies_us": list(LATENCIES_US),
              "crossover": cross, "paper_pattern_holds": pattern, "by_block_size": rows,
              "swap_over_recompute_at_block_size": at_bs},
    )
