"""nano-vllm's own BlockManager against pagedkv's drop-in, on one real trace, in one process.

    PYTHONPATH=src python benchmarks/nanovllm_ab.py --nanovllm PATH/TO/nano-vllm
    PYTHONPATH=src python benchmarks/nanovllm_ab.py --nanovllm PATH --trace azure-conv --requests 400

``PATH`` is a checkout of github.com/GeeeekExplorer/nano-vllm. Only its
``nanovllm/engine/block_manager.py`` is loaded, as a file: its package ``__init__`` imports the
whole engine (torch, transformers, flash-attn), and the manager itself needs only ``xxhash`` and
numpy, plus ``nanovllm.engine.sequence`` for a type annotation, which is stubbed while the file
loads (and removed after). Nothing of nano-vllm is copied here.

What is timed: the six methods the scheduler calls (``can_allocate``, ``allocate``,
``hash_blocks``, ``can_append``, ``may_append``, ``deallocate``), each call between two
``perf_counter_ns`` reads, summed per method, while a scheduler loop of nano-vllm's shape (written
here: prefill first with chunked prefill for the head of the queue only, then decode with
preemption from the tail of the running queue, ``hash_blocks`` after the forward pass) replays
the same requests on each manager. Requests come from a shipped trace (default the Mooncake
conversation trace: long prompts sharing 512-token prefixes), all queued at the start, with the
trace's own output lengths; the "model" emits a token that is a function of the sequence's
content, so a preempted sequence recomputes the same tokens. One timing read costs about 50 ns
and is inside both sides' numbers alike.

For each block size (16 and 256 by default) the two managers run in turn, ``--repeats`` times,
alternating which goes first; the table gives each method's median total, in ms, and the ratio
pagedkv / nano-vllm (below 1: pagedkv spends less time). A fingerprint of each run (steps,
preemptions, prefix-hit tokens) shows the two schedules agree: equal unless the pool is small
enough that the two evict differently (pagedkv hands out clean blocks before evicting cached
ones), which the columns print.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import types
from collections import deque
from pathlib import Path

from pagedkv.integrations.nanovllm import BlockManager as PagedBlockManager
from pagedkv.sim.traces import load_trace, trace_path

METHODS = ("can_allocate", "allocate", "hash_blocks", "can_append", "may_append", "deallocate")
VOCAB = 32_000


def load_nanovllm_block_manager(checkout: str):
    """nano-vllm's BlockManager class, from ``checkout/nanovllm/engine/block_manager.py`` alone."""
    path = Path(checkout) / "nanovllm" / "engine" / "block_manager.py"
    if not path.is_file():
        raise SystemExit(f"no nano-vllm block manager at {path} (give --nanovllm a checkout of "
                         f"github.com/GeeeekExplorer/nano-vllm)")
    stub_names = ("nanovllm", "nanovllm.engine", "nanovllm.engine.sequence")
    saved = {name: sys.modules.get(name) for name in stub_names}
    for name in stub_names:
        sys.modules[name] = types.ModuleType(name)
    sys.modules["nanovllm.engine.sequence"].Sequence = object  # only a type annotation there
    try:
        spec = importlib.util.spec_from_file_location("nanovllm_block_manager", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return module.BlockManager


class Seq:
    """What nano-vllm's block managers read and write of its Sequence."""

    __slots__ = ("seq_id", "token_ids", "last_token", "num_tokens", "num_prompt_tokens",
                 "num_cached_tokens", "num_scheduled_tokens", "block_table", "max_tokens", "block_size")

    def __init__(self, seq_id: int, token_ids: list, max_tokens: int, block_size: int):
        self.seq_id = seq_id
        self.token_ids = list(token_ids)
        self.last_token = self.token_ids[-1]
        self.num_tokens = self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.block_table: list = []
        self.max_tokens = max_tokens
        self.block_size = block_size

    def __len__(self):
        return self.num_tokens

    @property
    def num_blocks(self):
        return (self.num_tokens + self.block_size - 1) // self.block_size

    def block(self, i):
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1


def replay(bm, requests, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> dict:
    """Run every request to completion on ``bm``; returns per-method seconds and a fingerprint."""
    clock = time.perf_counter_ns
    spent = dict.fromkeys(METHODS, 0)
    waiting = deque(Seq(i, p, out, block_size) for i, (p, out) in enumerate(requests))
    running: deque = deque()
    steps = preemptions = hits = 0

    def deallocate(seq):
        t = clock()
        bm.deallocate(seq)
        spent["deallocate"] += clock() - t

    while waiting or running:
        steps += 1
        scheduled, batched = [], 0
        while waiting and len(scheduled) < max_num_seqs:
            seq = waiting[0]
            remaining = max_num_batched_tokens - batched
            if remaining == 0:
                break
            if not seq.block_table:
                t = clock()
                cached = bm.can_allocate(seq)
                spent["can_allocate"] += clock() - t
                if cached == -1:
                    break
                num_tokens = seq.num_tokens - cached * block_size
            else:
                num_tokens = seq.num_tokens - seq.num_cached_tokens
            if remaining < num_tokens and scheduled:
                break
            if not seq.block_table:
                t = clock()
                bm.allocate(seq, cached)
                spent["allocate"] += clock() - t
                hits += seq.num_cached_tokens
            seq.num_scheduled_tokens = min(num_tokens, remaining)
            batched += seq.num_scheduled_tokens
            if seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                waiting.popleft()
                running.append(seq)
            scheduled.append(seq)
        prefill = bool(scheduled)
        if not prefill:
            while running and len(scheduled) < max_num_seqs:
                seq = running.popleft()
                while True:
                    t = clock()
                    ok = bm.can_append(seq)
                    spent["can_append"] += clock() - t
                    if ok:
                        break
                    victim = running.pop() if running else seq
                    preemptions += 1
                    deallocate(victim)
                    waiting.appendleft(victim)
                    if victim is seq:
                        break
                if ok:
                    seq.num_scheduled_tokens = 1
                    t = clock()
                    bm.may_append(seq)
                    spent["may_append"] += clock() - t
                    scheduled.append(seq)
            running.extendleft(reversed(scheduled))
        for seq in scheduled:  # postprocess
            t = clock()
            bm.hash_blocks(seq)
            spent["hash_blocks"] += clock() - t
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if prefill and seq.num_cached_tokens < seq.num_tokens:
                continue
            seq.append_token((seq.token_ids[-1] * 7919 + seq.num_tokens * 31) % VOCAB)
            if seq.num_tokens - seq.num_prompt_tokens >= seq.max_tokens:
                deallocate(seq)
                running.remove(seq)
    return {"seconds": {k: v / 1e9 for k, v in spent.items()},
            "fingerprint": (steps, preemptions, hits)}


def workload(trace: str, n: int, max_output: int):
    reqs = load_trace(trace_path(trace), limit=n)
    return [(r.prompt_tokens(), max(1, min(r.output_len, max_output))) for r in reqs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nanovllm", required=True, help="a checkout of github.com/GeeeekExplorer/nano-vllm")
    ap.add_argument("--trace", default="mooncake", help="a shipped trace: mooncake, azure-conv, azure-code")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-output", type=int, default=512, help="cap on each request's output length")
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--pool-tokens", type=int, default=262_144,
                    help="KV capacity in tokens (num_blocks = this / block size); small enough to preempt")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16_384)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    NanoBlockManager = load_nanovllm_block_manager(args.nanovllm)
    requests = workload(args.trace, args.requests, args.max_output)
    longest = max(len(p) + out for p, out in requests)
    prompt_tokens = sum(len(p) for p, _ in requests)
    output_tokens = sum(out for _, out in requests)
    print(f"{args.trace}: {len(requests)} requests, {prompt_tokens:,} prompt tokens, {output_tokens:,} "
          f"output tokens (outputs capped at {args.max_output}); pool {args.pool_tokens:,} tokens; "
          f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}; "
          f"medians of {args.repeats} runs, ms in the six methods")
    for bs in args.block_sizes:
        num_blocks = args.pool_tokens // bs
        if num_blocks * bs < longest:
            raise SystemExit(f"--pool-tokens {args.pool_tokens} cannot hold the longest request ({longest} tokens)")
        makers = {"nano-vllm": lambda: NanoBlockManager(num_blocks, bs),
                  "pagedkv": lambda: PagedBlockManager(num_blocks, bs)}
        runs = {name: [] for name in makers}
        for r in range(args.repeats):
            order = list(makers) if r % 2 == 0 else list(makers)[::-1]
            for name in order:
                runs[name].append(replay(makers[name](), requests, bs, args.max_num_seqs,
                                         args.max_num_batched_tokens))
        print(f"\nblock size {bs}, {num_blocks:,} blocks")
        print(f"{'method':<14}{'nano-vllm':>12}{'pagedkv':>12}{'ratio':>8}")
        totals = {}
        for method in METHODS + ("total",):
            med = {}
            for name, rs in runs.items():
                vals = [sum(x["seconds"].values()) if method == "total" else x["seconds"][method] for x in rs]
                med[name] = statistics.median(vals) * 1e3
            totals[method] = med
            ratio = med["pagedkv"] / med["nano-vllm"] if med["nano-vllm"] else float("nan")
            print(f"{method:<14}{med['nano-vllm']:>12.1f}{med['pagedkv']:>12.1f}{ratio:>8.3f}")
        for name, rs in runs.items():
            steps, pre, hits = rs[0]["fingerprint"]
            print(f"  {name}: {steps:,} steps, {pre:,} preemptions, {hits:,} prefix-hit tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
