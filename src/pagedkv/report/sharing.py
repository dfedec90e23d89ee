"""Report section: blocks saved by sharing under parallel sampling and beam search (vLLM Fig. 15).

Paging lets the sequences of one request share blocks: the n samples of parallel sampling share
the prompt (forked once after prefill; the partial last prompt block is copied on the first
write), and the beams of beam search share every block of their common ancestry, which grows as
losing beams are freed and winners forked. The saving is ``blocks_saved_by_sharing`` over the
blocks the sequences would hold without sharing (``sum ceil(len / bs)``), both from the real
manager's ``usage()``, time-weighted over decode steps. Prefix caching is off, so only forks
share. Which beams survive comes from :class:`~pagedkv.sim.baselines.BeamModel` (seeded
Dirichlet next-token distributions, top ``width`` of ``width x width`` candidates), a model, not
a language model: the beam numbers depend on it.

Worked number (parallel sampling, block size 16): a 40-token prompt with n = 2 and 60 output
tokens ends with 2 x ceil(100/16) = 14 logical blocks over 12 physical (the 2 full prompt blocks
are shared): 14% saved at the end, more earlier in the run when outputs are short.
"""
from __future__ import annotations

from dataclasses import replace

from ..tables import Section, Table
from .fig2 import load, run_one
from .options import ReportOptions

__all__ = ["section", "PAPER_SAVING", "WIDTHS"]

# vLLM paper (SOSP'23) Fig. 15, OPT-13B on Alpaca: % of blocks saved by sharing.
PAPER_SAVING = {("parallel", 2): 6.09, ("parallel", 4): 8.53, ("parallel", 6): 9.79,
                ("beam", 2): 37.56, ("beam", 4): 53.13, ("beam", 6): 55.16}
WIDTHS = (2, 4, 6)
WORKLOADS = {"alpaca": "Alpaca", "sharegpt": "ShareGPT"}  # the -like synthetic workloads


def _widen(reqs: list, mode: str, k: int) -> list:
    return [replace(r, n=k) if mode == "parallel" else replace(r, beam_width=k) for r in reqs]


def section(opts: ReportOptions) -> Section:
    """Run parallel sampling and beam search at width 2/4/6 on Alpaca-like and ShareGPT-like."""
    if not isinstance(opts, ReportOptions):
        raise ValueError(f"opts must be ReportOptions, got {type(opts).__name__}")
    sizes = {"alpaca": 100 if opts.quick else 500, "sharegpt": 40 if opts.quick else 150}
    t = Table(
        "Blocks saved by sharing (% of the blocks the sequences would hold without it), "
        "Alpaca-like and ShareGPT-like lengths; n = parallel samples, beam = beam width",
        ["run", "width", "saved %", "paper %", "CoW copies/request", "avg batch", "requests/s", "preemptions"],
        plot={"x": "run", "y": ["saved %", "paper %"], "kind": "bar", "ylabel": "% of blocks saved"},
    )
    data: dict = {}
    for wl, label in WORKLOADS.items():
        base = load(wl, sizes[wl], opts.seed)
        for mode in ("parallel", "beam"):
            for k in WIDTHS:
                res, m = run_one(_widen(base, mode, k), "paged", opts.block_size,
                                 enable_prefix_caching=False, beam_seed=opts.seed)
                ref = PAPER_SAVING[(mode, k)] if wl == "alpaca" and opts.block_size == 16 else None
                name = f"n={k}" if mode == "parallel" else f"beam={k}"
                t.add(f"{label} {name}", k, round(100 * m.sharing_saving, 2), ref,
                      round(res.copies / max(res.finished, 1), 2), round(m.avg_batch, 1),
                      round(m.throughput_rps, 3), m.preemptions)
                data[f"{wl}/{mode}/{k}"] = m.sharing_saving
    t.notes += [
        f"{sizes['alpaca']} Alpaca-like and {sizes['sharegpt']} ShareGPT-like requests at t=0, block size "
        f"{opts.block_size}, on OPT-13B's 12 GiB of KV; paper column: vLLM paper Fig. 15 (Alpaca, OPT-13B).",
        "Beam search here never stops early and has no length penalty; every beam runs the request's "
        "output length. Beam survival follows the seeded BeamModel, so the beam rows measure the "
        "allocator under that model, not a real decoder's ancestry.",
        "A preempted multi-sequence request restarts from its prompt (recompute).",
    ]
    return Section(
        key="sharing",
        heading="Sharing: parallel sampling and beam search (vLLM Fig. 15)",
        intro=(__doc__ or "").split("\n\n")[1].replace("\n", " "),
        tables=[t],
        data={"saving": data, "paper_saving": {f"{m}/{k}": v for (m, k), v in PAPER_SAVING.items()}},
    )
