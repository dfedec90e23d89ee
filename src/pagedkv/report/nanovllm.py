"""Report section: a real engine's scheduler on both allocators (nano-vllm's, and pagedkv's drop-in).

nano-vllm's scheduler replays the same Mooncake requests twice: on nano-vllm's own
``BlockManager`` and on :class:`pagedkv.integrations.nanovllm.BlockManager`, which replaces it by
changing one import. Per allocator: steps, preemptions, prefix hit rate, blocks in use (mean and
peak over the steps) and the time spent in the six methods the scheduler calls (the median of a
few runs, alternating which allocator goes first). Whether the two scheduled alike, step for
step, is said in words: they may differ where the two managers legitimately do (which copy of a
block two sequences computed in one step stays findable; which free block is taken once the pool
is full), and the section then counts the steps that differ.

Which engine runs is decided by :func:`pagedkv.sim.nanovllm_files.find_engine`: nano-vllm's own
``scheduler.py``, ``sequence.py`` and ``block_manager.py`` whenever they are available (``pagedkv
report --nanovllm PATH``, ``$PAGEDKV_NANOVLLM``, or an installed ``nanovllm`` package), else an
engine written here with nano-vllm's rules (:mod:`pagedkv.sim.nanovllm_rules`); the section says
which ran, in its heading and its first line. Worked number (the engine written here, 120
requests, 96 blocks of 256 tokens): 5,623 steps and 20 preemptions on both allocators.
"""
from __future__ import annotations

import statistics

from ..sim.nanovllm_files import Engine, find_engine
from ..sim.nanovllm_replay import ALLOCATORS, METHODS, EngineRun, replay
from ..sim.nanovllm_rules import RULES
from ..sim.traces import load_mooncake_jsonl, trace_not_found, trace_path
from .options import ReportOptions
from .tables import Section, Table

__all__ = ["section", "KEY", "workload", "measure", "differing_steps"]

KEY = "nanovllm"
BLOCK_SIZE = 256  # nano-vllm's default; its config requires a multiple of 256
MAX_REQUEST_TOKENS = 8_192  # prompt and output of one request; longer ones are left out
MAX_OUTPUT = 512  # cap on each request's output length (the trace's own, capped)
# (requests, pool blocks, runs per allocator): a pool small enough that sequences are preempted
FULL = (120, 96, 3)
QUICK = (40, 64, 2)


def workload(opts: ReportOptions, n: int) -> list[tuple[list[int], int]] | None:
    """The first ``n`` Mooncake requests that fit ``MAX_REQUEST_TOKENS``, as (prompt, output
    length); None when the trace is not found."""
    path = trace_path("mooncake", opts.data_dir)
    if path is None:
        return None
    out = []
    for r in load_mooncake_jsonl(path, limit=20 * n):
        output = max(1, min(r.output_len, MAX_OUTPUT))
        if r.prompt_len + output <= MAX_REQUEST_TOKENS:
            out.append((r.prompt_tokens(), output))
            if len(out) == n:
                break
    return out


def measure(engine: Engine, requests, num_blocks: int, runs: int) -> dict[str, list[EngineRun]]:
    """``runs`` replays per allocator, alternating which goes first."""
    out: dict[str, list[EngineRun]] = {a: [] for a in ALLOCATORS}
    for r in range(runs):
        for a in (ALLOCATORS if r % 2 == 0 else ALLOCATORS[::-1]):
            out[a].append(replay(engine, a, requests, num_blocks, BLOCK_SIZE))
    return out


def _summary(runs: list[EngineRun]) -> dict:
    first = runs[0]  # every run of one allocator schedules alike: the counts are the first's
    by_method = {m: statistics.median(r.ns[m] for r in runs) / 1e6 for m in METHODS}
    return {"steps": first.steps, "preemptions": first.preemptions, "hit_tokens": first.hit_tokens,
            "admitted_tokens": first.admitted_tokens, "hit_rate": first.hit_rate,
            "blocks_in_use_mean": statistics.fmean(first.blocks_in_use),
            "block_steps": sum(first.blocks_in_use),
            "blocks_in_use_peak": max(first.blocks_in_use),
            "allocator_ms": statistics.median(r.allocator_seconds * 1e3 for r in runs),
            "allocator_ms_runs": [r.allocator_seconds * 1e3 for r in runs], "ms_by_method": by_method}


def _names(engine: Engine) -> dict[str, str]:
    return {"nano-vllm": "nano-vllm" if engine.own else "nano-vllm's rules", "pagedkv": "pagedkv"}


def _tables(data: dict, names: dict[str, str]) -> list[Table]:
    by = data["allocators"]
    main = Table(f"Mooncake conversation, first {data['requests']} requests of at most "
                 f"{MAX_REQUEST_TOKENS:,} tokens; {data['num_blocks']} blocks of {BLOCK_SIZE} tokens",
                 ["allocator", "steps", "preemptions", "prefix hits %", "mean blocks", "peak blocks",
                  "allocator ms"])
    for a in ALLOCATORS:
        d = by[a]
        main.add(names[a], d["steps"], d["preemptions"], 100 * d["hit_rate"], d["blocks_in_use_mean"],
                 d["blocks_in_use_peak"], d["allocator_ms"])
    main.notes.append(
        f"Prefix hits: tokens served from cache at admission over tokens at admission "
        f"({by['pagedkv']['admitted_tokens']:,} on pagedkv; a re-admission after a preemption counts "
        f"again). Mean and peak blocks: blocks in use (distinct blocks in the sequences' tables) "
        f"after each schedule, over the steps. Allocator ms: the six methods' time, median of "
        f"{data['runs']} runs alternating which allocator goes first (measured on this machine).")
    split = Table("Time in each method the scheduler calls (ms, median)",
                  ["method", names["nano-vllm"], names["pagedkv"], "ratio"],
                  plot={"name": "nanovllm_methods", "x": "method", "y": [names["nano-vllm"], names["pagedkv"]],
                        "kind": "bar", "ylabel": "ms in the method (median)"})
    for m in (*METHODS, "total"):
        ms = [by[a]["allocator_ms"] if m == "total" else by[a]["ms_by_method"][m] for a in ALLOCATORS]
        split.add(m, ms[0], ms[1], ms[1] / ms[0] if ms[0] else float("nan"))
    split.notes.append("ratio: pagedkv / nano-vllm (below 1: pagedkv spends less time).")
    return [main, split]


def differing_steps(a: EngineRun, b: EngineRun) -> tuple[int, int | None]:
    """How many steps the two runs scheduled differently (tokens scheduled, or a step only one run
    has), and the first of them (None when the schedules are the same)."""
    x, y = a.scheduled_tokens, b.scheduled_tokens
    diff = [i for i in range(max(len(x), len(y))) if i >= min(len(x), len(y)) or x[i] != y[i]]
    return len(diff), (diff[0] if diff else None)


def _agreement(data: dict) -> str:
    n, p = data["allocators"]["nano-vllm"], data["allocators"]["pagedkv"]
    if data["differing_steps"] == 0:
        same_blocks = "and blocks in use" if n["blocks_in_use_mean"] == p["blocks_in_use_mean"] else (
            f"but not quite the same blocks in use (summed over the steps, {n['block_steps']:,} on nano-vllm, "
            f"{p['block_steps']:,} on pagedkv): when two sequences compute the same block in "
            "one step, nano-vllm's map keeps the last copy and pagedkv's the first, so a later hit on "
            "it can share a held copy on one side and take a freed one on the other")
        return (f"Both allocators gave the same schedule, step for step, with the same prefix-hit "
                f"tokens ({p['hit_tokens']:,}), {same_blocks}.")
    return (f"The schedules differ at {data['differing_steps']:,} of {p['steps']:,} steps (first at step "
            f"{data['first_differing_step']:,}), where the two managers may: when two sequences compute "
            f"the same block in one step, nano-vllm's map keeps the last copy and pagedkv's the first, "
            f"so a later hit can share a copy still held on one side and take a freed one (a free "
            f"block) on the other; and once the pool is full pagedkv hands out clean blocks before "
            f"evicting cached ones, where nano-vllm takes the head of one queue of free blocks.")


def section(opts: ReportOptions) -> Section:
    if not isinstance(opts, ReportOptions):
        raise ValueError(f"opts must be ReportOptions, got {type(opts).__name__}")
    engine = find_engine(opts.nanovllm)
    heading = ("nano-vllm's own scheduler on both allocators" if engine.own
               else "A scheduler with nano-vllm's rules on both allocators")
    sec = Section(KEY, heading, intro=(
        "The same requests, all queued at once, through one engine's scheduler on two allocators: "
        "nano-vllm's BlockManager and pagedkv's drop-in for it (one import changed). The forward "
        "pass is a stand-in whose token is a function of the sequence, so a preempted sequence "
        "recomputes the same tokens; nano-vllm's own limits (512 sequences, 16,384 tokens a step)."))
    sec.text.append(f"Ran: {engine.source}.")
    if not engine.own:
        sec.text.append(RULES)
        sec.text.append("The nano-vllm row's time is the stand-in's, not nano-vllm's own code's (which "
                        "hashes with xxhash where the stand-in uses blake2b).")
    n, num_blocks, runs = QUICK if opts.quick else FULL
    requests = workload(opts, n)
    sec.data["engine"] = {"source": engine.source, "own": engine.own}
    if not requests:
        sec.text.append(f"{trace_not_found('mooncake', opts.data_dir)}: section skipped." if requests is None
                        else f"No request of the Mooncake trace fits {MAX_REQUEST_TOKENS:,} tokens: "
                             "section skipped.")
        sec.data["skipped"] = True
        return sec
    opts.note(f"{KEY}: {len(requests)} requests, {runs} runs per allocator")
    measured = measure(engine, requests, num_blocks, runs)
    by = {a: _summary(measured[a]) for a in ALLOCATORS}
    differ, first = differing_steps(measured["nano-vllm"][0], measured["pagedkv"][0])
    sec.data.update({"trace": "mooncake", "requests": len(requests), "block_size": BLOCK_SIZE,
                     "num_blocks": num_blocks, "runs": runs, "max_output": MAX_OUTPUT,
                     "max_request_tokens": MAX_REQUEST_TOKENS, "allocators": by,
                     "differing_steps": differ, "first_differing_step": first,
                     "time_ratio": by["pagedkv"]["allocator_ms"] / by["nano-vllm"]["allocator_ms"]})
    sec.tables += _tables(sec.data, _names(engine))
    sec.text.append(_agreement(sec.data))
    return sec
