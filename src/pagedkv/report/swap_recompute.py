"""Report section: swap against recompute per preemption, by block size (the vLLM paper's Fig. 19).

A preempted sequence of ``L`` tokens is either recomputed (``L`` tokens of prefill, whatever the
block size) or swapped: ``ceil(L / B)`` blocks copied to host memory and back, each block as one
copy per layer's K and per layer's V, and each copy pays a fixed latency before its bytes flow.
Small blocks are all latency, so swapping loses; large blocks amortise it and swapping wins. The
section models the paper's own setup first (OPT-13B on an A100-40GB over PCIe 4.0), then the
report's model on an H100 (PCIe 5.0). Every number here is modelled, none measured.

The latency per copy and the recompute's model FLOP utilisation (MFU: the share of the GPU's
peak FLOP/s a prefill reaches) are assumptions, so the section states where the curves cross as
a range of the block sizes engines use (8 to 256) and shows how it moves with them: 5 to 20 µs
per copy, 30% to 60% MFU. A layout that keeps a block's layers together (one copy per block)
is shown beside the per-layer one.

Worked number (the paper's setup: OPT-13B, 819,200 KV bytes per token, 80 copies per block,
32 GB/s, 10 µs per copy, 45% MFU): a 1,024-token sequence at block size 16 moves 64 blocks and
5,120 copies each way, 77.4 ms per direction, 154.8 ms for the swap, against
1,024 x 2 x 12.85e9 / (0.45 x 312e12) = 187.3 ms to recompute: 0.83x. At block size 8 the swap
takes 257.2 ms (1.37x), so swapping first wins between 8 and 16.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..sim.costmodel import (A100_40GB_HBM_BYTES_PER_S, A100_BF16_FLOPS, H100_BF16_FLOPS,
                             H100_HBM_BYTES_PER_S, CostModel)
from ..sim.swap_cost import BLOCK_SIZES, PCIE5_X16_BYTES_PER_S, Link, copies_per_block, swap_cost
from ..sim.sizing import kv_bytes_per_token
from .options import ReportOptions
from .tables import Section, Table

__all__ = ["section", "LATENCIES_US", "TOKENS", "MFU", "MFU_SPREAD", "ENGINE_BLOCK_SIZES", "Setup",
           "PAPER_SETUP", "report_setup", "crossover", "PAPER_RECOMPUTE_BOUND"]

KEY, HEADING = "swap_vs_recompute", "Swap against recompute per preemption (vLLM Fig. 19)"
TOKENS = 1_024  # the preempted sequence
LATENCIES_US = (5, 10, 20)  # the assumed fixed cost of one host<->device copy: 10 and its spread
LATENCY_US = 10
MFU = 0.45  # the stated MFU of a recompute (prefill), and its spread
MFU_SPREAD = (0.30, 0.45, 0.60)
ENGINE_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)  # the block sizes engines offer (vLLM: 8 to 256)
# The paper (section 7.3): "recomputation's overhead is never higher than 20% of swapping's
# latency", read as recompute time <= 1.2 x swap time at every block size.
PAPER_RECOMPUTE_BOUND = 1.2
PCIE4_X16_BYTES_PER_S = 16e9 * 16 / 8  # 32e9: PCIe 4.0, 16 GT/s per lane, 16 lanes, per direction
MIB = 2**20
PAPER_TEXT = (
    "The paper (Kwon et al., SOSP'23, section 7.3, Fig. 19; OPT-13B on ShareGPT, measured by its "
    "authors): swapping has excessive overhead at small block sizes, whose many small transfers "
    "waste the PCIe bandwidth; recomputation costs the same at every block size; so recomputation "
    "wins at small block sizes and swapping at large ones, 'though recomputation's overhead is "
    "never higher than 20% of swapping's latency'; from 16 to 64 the two perform comparably end "
    "to end.")


@dataclass(frozen=True)
class Setup:
    """A model on a GPU behind a host link: what one preemption is priced on."""

    name: str  # "the paper's setup"
    model: str
    gpu: str
    hbm_bytes_per_s: float
    peak_flops: float
    link_bytes_per_s: float
    link: str  # "PCIe 4.0 x16, 32 GB/s per direction"

    def cost_model(self, mfu: float = MFU) -> CostModel:
        """Prefill at ``mfu`` of the GPU's dense BF16 peak (the A100: 45% -> 140 TFLOP/s)."""
        if not 0 < mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
        return CostModel.for_model(self.model, bandwidth=self.hbm_bytes_per_s, peak_flops=self.peak_flops * mfu)

    def cost(self, block_size: int, latency_us: float = LATENCY_US, mfu: float = MFU,
             copies: int | None = None, link_bytes_per_s: float | None = None):
        link = Link(link_bytes_per_s or self.link_bytes_per_s, latency_us * 1e-6)
        return swap_cost(TOKENS, block_size, self.model, link=link, cost_model=self.cost_model(mfu),
                         copies=copies)

    def describe(self) -> str:
        return f"{self.model} on an {self.gpu}"


PAPER_SETUP = Setup("the paper's setup", "OPT-13B", "A100-40GB", A100_40GB_HBM_BYTES_PER_S, A100_BF16_FLOPS,
                    PCIE4_X16_BYTES_PER_S, "PCIe 4.0 x16, 32 GB/s per direction")


def report_setup(model: str) -> Setup:
    """The report's model on an H100 SXM behind PCIe 5.0 x16 (64 GB/s per direction)."""
    return Setup("the report's model on an H100", model, "H100", H100_HBM_BYTES_PER_S, H100_BF16_FLOPS,
                 PCIE5_X16_BYTES_PER_S, "PCIe 5.0 x16, 64 GB/s per direction")


def crossover(setup: Setup, latency_us: float = LATENCY_US, mfu: float = MFU,
              copies: int | None = None) -> tuple[int | None, int | None]:
    """Where swapping first wins among :data:`ENGINE_BLOCK_SIZES`, as (last size where it loses,
    first where it wins): (8, 16) in the paper's setup at 10 µs and 45% MFU. (None, 8): it wins
    at every size; (256, None): at none."""
    lose = None
    for bs in ENGINE_BLOCK_SIZES:
        if setup.cost(bs, latency_us, mfu, copies).swap_wins:
            return lose, bs
        lose = bs
    return lose, None


def crossover_words(pair) -> str:
    """(8, 16) -> "between 8 and 16"; (None, 8) -> "at 8 or below"; (256, None) -> "above 256"."""
    lo, hi = pair
    if hi is None:
        return "above 256"
    return f"at {hi} or below" if lo is None else f"between {lo} and {hi}"


def _spread(setup: Setup) -> dict:
    """The crossover at every latency and MFU of the spread, and its widest range."""
    by = {(u, m): crossover(setup, u, m) for u in LATENCIES_US for m in MFU_SPREAD}
    his = [hi if hi is not None else 512 for _, hi in by.values()]
    los = [lo if lo is not None else 4 for lo, _ in by.values()]
    return {"by": {f"{u} µs, {round(100 * m)}% MFU": list(v) for (u, m), v in by.items()},
            "lowest": [min(los) if min(los) >= 8 else None, min(his)],
            "highest": [max(los), max(his) if max(his) <= 256 else None]}


def _rows(setup: Setup) -> dict:
    rows = {}
    for bs in BLOCK_SIZES:
        ref = setup.cost(bs)
        rows[bs] = {"blocks": ref.blocks, "bytes_each_way": ref.bytes_moved, "copies_each_way": ref.copies,
                    "swap_s": {u: setup.cost(bs, u).swap_s for u in LATENCIES_US},
                    "swap_s_one_copy": setup.cost(bs, copies=1).swap_s,
                    "recompute_s_by_mfu": {m: setup.cost(bs, mfu=m).recompute_s for m in MFU_SPREAD},
                    "swap_over_recompute": ref.swap_over_recompute}
    return rows


def _table(setup: Setup, rows: dict, plot: bool) -> Table:
    cpb = copies_per_block(setup.model)
    lat_cols = [f"swap ms @{u} µs" for u in LATENCIES_US]
    rec = f"recompute ms @{round(100 * MFU)}% MFU"
    ratio = f"swap / recompute @{LATENCY_US} µs"
    one = f"swap ms, 1 copy/block @{LATENCY_US} µs"
    t = Table(f"One preemption of a {TOKENS:,}-token sequence, {setup.name}: {setup.describe()}, "
              f"{setup.link} (modelled): swap out and back in against recompute, by block size",
              ["block size", "copies each way", *lat_cols, one, rec, ratio])
    for bs, r in rows.items():
        t.add(bs, r["copies_each_way"], *[1e3 * r["swap_s"][u] for u in LATENCIES_US], 1e3 * r["swap_s_one_copy"],
              1e3 * r["recompute_s_by_mfu"][MFU], r["swap_over_recompute"])
    if plot:
        t.plot = {"name": "swap_vs_recompute", "x": "block size", "y": [*lat_cols, one, rec],
                  "kind": "line", "logx": True, "logy": True,
                  "ylabel": "ms per preemption (swap: out + in)", "xlabel": "block size (tokens per block)",
                  "styles": {rec: {"linestyle": "--", "marker": "", "color": "black", "linewidth": 2}},
                  "legend": {**{c: f"swap, {cpb} copies a block, {u} µs a copy"
                                for c, u in zip(lat_cols, LATENCIES_US)},
                             one: f"swap, 1 copy a block, {LATENCY_US} µs",
                             rec: f"recompute at {round(100 * MFU)}% MFU"},
                  "title": f"One preemption of {TOKENS:,} tokens, {setup.describe()} (modelled)"}
    mib = rows[min(rows)]["bytes_each_way"] / MIB
    recs = [1e3 * rows[min(rows)]["recompute_s_by_mfu"][m] for m in MFU_SPREAD]
    t.notes.append(f"{mib:,.0f} MiB move each way at every block size up to {TOKENS:,}; recompute takes "
                   f"{recs[0]:.0f}, {recs[1]:.0f} and {recs[2]:.0f} ms at 30%, 45% and 60% MFU, at every "
                   "block size.")
    return t


def _bound_check(setup: Setup) -> dict:
    """The paper's bound (recompute <= 1.2 x swap) against the model, at the largest block size,
    and what it would take to meet it: no MFU up to 100% does, nor a zero latency; a slower link
    does (the bandwidth solved for)."""
    big = max(BLOCK_SIZES)
    ref = setup.cost(big)
    full = setup.cost(big, mfu=1.0)
    instant = setup.cost(big, latency_us=0)
    # recompute = bound x swap, swap = 2 (copies x latency + bytes / bw): solve for bw
    latency_s = 2 * ref.copies * LATENCY_US * 1e-6
    needed = 2 * ref.bytes_moved / (ref.recompute_s / PAPER_RECOMPUTE_BOUND - latency_s)
    return {"block_size": big, "recompute_over_swap": 1 / ref.swap_over_recompute,
            "at_full_mfu": 1 / full.swap_over_recompute, "at_zero_latency": 1 / instant.swap_over_recompute,
            "bandwidth_needed": needed, "link_bytes_per_s": setup.link_bytes_per_s}


def _text(paper: dict, ours: dict, setups: tuple[Setup, Setup]) -> list[str]:
    ps, rs = setups
    p, o = paper["rows"], ours["rows"]
    b = paper["bound"]
    ratio = lambda rows, bs: rows[bs]["swap_over_recompute"]  # noqa: E731
    lo, hi = paper["spread"]["lowest"][1], paper["spread"]["highest"][1]
    return [
        PAPER_TEXT,
        f"The paper's setup, modelled ({ps.describe()}, {ps.link}, {LATENCY_US} µs per copy, "
        f"{copies_per_block(ps.model)} copies per block, recompute at {round(100 * MFU)}% MFU): a swap "
        f"takes {ratio(p, 1):.1f}x the recompute at block size 1, {ratio(p, 16):.2f}x at 16 and "
        f"{ratio(p, 64):.2f}x at 64; swapping first wins {crossover_words(paper['crossover'])}. With "
        f"5 to 20 µs per copy and 30% to 60% MFU it first wins anywhere from block size "
        f"{'8 or below' if paper['spread']['lowest'][0] is None else lo} to {hi}.",
        f"Where the model and the paper part: the paper's recompute never costs more than "
        f"{PAPER_RECOMPUTE_BOUND:g}x the swap; modelled, at block size {b['block_size']} it costs "
        f"{b['recompute_over_swap']:.1f}x. Neither the GPU nor the latency per copy explains that (at "
        f"100% MFU: {b['at_full_mfu']:.1f}x; with no latency at all: {b['at_zero_latency']:.1f}x); the "
        f"link's bandwidth does: at {b['bandwidth_needed'] / 1e9:.1f} GB/s effective, "
        f"{100 * b['bandwidth_needed'] / b['link_bytes_per_s']:.0f}% of the "
        f"{b['link_bytes_per_s'] / 1e9:.0f} GB/s peak the model assumes, the bound holds. The model "
        f"moves bytes at the link's peak; the paper's measurement implies about a third of it.",
        f"On an H100 ({rs.describe()}, {rs.link}, the same assumptions) a recompute is faster "
        f"({1e3 * o[16]['recompute_s_by_mfu'][MFU]:.0f} ms against "
        f"{1e3 * p[16]['recompute_s_by_mfu'][MFU]:.0f} ms), so swapping wins later: "
        f"{crossover_words(ours['crossover'])} ({ratio(o, 16):.2f}x at 16); with one copy per "
        f"block it wins {crossover_words(ours['crossover_one_copy'])}.",
    ]


def _measure(setup: Setup) -> dict:
    return {"model": setup.model, "gpu": setup.gpu, "link_bytes_per_s": setup.link_bytes_per_s,
            "rows": _rows(setup), "crossover": list(crossover(setup)),
            "crossover_one_copy": list(crossover(setup, copies=1)), "spread": _spread(setup),
            "bound": _bound_check(setup)}


def section(opts: ReportOptions) -> Section:
    if not isinstance(opts, ReportOptions):
        raise ValueError(f"opts must be ReportOptions, got {type(opts).__name__}")
    setups = (PAPER_SETUP, report_setup(opts.model))
    paper, ours = (_measure(s) for s in setups)
    tables = [_table(setups[0], paper["rows"], plot=True), _table(setups[1], ours["rows"], plot=False)]
    tables[0].notes += [
        f"Copies: a block is one copy per layer's K and per layer's V ({copies_per_block(setups[0].model)} "
        f"for OPT-13B, {copies_per_block(setups[1].model)} for {setups[1].model}), or 1 copy when a block "
        "keeps its layers together; whole blocks move, so a partial last block pads. The latency per "
        f"copy is assumed ({LATENCY_US} µs, 5 and 20 µs its spread), and bytes flow at the link's peak.",
        f"Recompute: {TOKENS:,} x 2 x parameters / (MFU x the GPU's dense BF16 peak: 312 TFLOP/s for the "
        f"A100, 989 for the H100), at an assumed {round(100 * MFU)}% MFU (30% and 60% its spread); the "
        "step's fixed overhead is left out on both sides.",
    ]
    return Section(
        key=KEY, heading=HEADING,
        intro=" ".join((__doc__ or "").split("\n\n")[1].split()),
        tables=tables, text=_text(paper, ours, setups),
        setup=f"{setups[0].describe()} (the paper's setup), then {setups[1].describe()}; modelled",
        data={"tokens": TOKENS, "model": f"{setups[0].model}, {setups[1].model}", "latencies_us": list(LATENCIES_US),
              "mfu": MFU, "mfu_spread": list(MFU_SPREAD), "engine_block_sizes": list(ENGINE_BLOCK_SIZES),
              "paper_recompute_bound": PAPER_RECOMPUTE_BOUND, "paper_setup": paper, "report_setup": ours,
              "kv_bytes_per_token": {s.model: kv_bytes_per_token(s.model) for s in setups}},
    )
