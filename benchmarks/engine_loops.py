"""The engine's two loops on the same ``generate`` calls: forwards, best wall time, same tokens?

``Engine.generate`` runs the one-prompt loop (:mod:`pagedkv.engine.prompt_loop`: one forward per
prompt, then one per decode step) unless a step-loop option or ``arrivals`` is given; with
``arrivals=[0] * P`` and no token budget the step loop (:mod:`pagedkv.engine.step_loop`) admits
every prompt in its first step and computes them all in one forward. This script measures what
folding the one-prompt loop into the step loop would change for the decoder tests' workloads
(the numpy tiny Llama of ``pagedkv report``'s ``cow_proof``, blocks of 16), which is the question
docs/design.md section 1 ("The engine package") answers. Worked number: 3 prompts and 12 new
tokens are 3 + 11 = 14 forwards in the one-prompt loop and 1 + 11 = 12 in the step loop.

Run: ``PYTHONPATH=src python benchmarks/engine_loops.py [--reps 5]``; prints a markdown table.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from pagedkv import KVCacheManager
from pagedkv.engine import Engine
from pagedkv.report.cow_proof import tiny_llama

CASES = [  # (name, prompt lengths, new tokens, generate's options)
    ("greedy, 3 prompts x 12 tokens", [23, 41, 16], 12, {}),
    ("n=4 at T=1, 2 prompts x 10 tokens", [45, 30], 10, {"n": 4, "temperature": 1.0}),
    ("greedy, 8 prompts x 16 tokens", [20, 33, 47, 12, 64, 9, 28, 40], 16, {}),
]


def run_case(model, lengths, new_tokens, options, step_loop: bool, reps: int):
    """(forwards, best seconds of ``reps``, every sample's tokens) for one loop."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 256, n).tolist() for n in lengths]
    best, tokens, forwards = float("inf"), None, 0
    for _ in range(reps):
        engine = Engine(model, KVCacheManager(256, 16))
        arrivals = [0] * len(prompts) if step_loop else None
        start = time.perf_counter()
        results = engine.generate(prompts, new_tokens, arrivals=arrivals, **options)
        best = min(best, time.perf_counter() - start)
        tokens = [s.tokens for r in results for s in r.samples]
        forwards = engine.stats.steps
    return forwards, best, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="runs per loop and case; the best counts")
    args = parser.parse_args()
    model = tiny_llama(0)
    print("| workload | one-prompt loop: forwards, ms | step loop: forwards, ms | step / one-prompt time | same tokens |")
    print("| --- | --- | --- | --- | --- |")
    for name, lengths, new_tokens, options in CASES:
        f1, t1, tok1 = run_case(model, lengths, new_tokens, options, False, args.reps)
        f2, t2, tok2 = run_case(model, lengths, new_tokens, options, True, args.reps)
        print(f"| {name} | {f1}, {t1 * 1e3:.1f} | {f2}, {t2 * 1e3:.1f} | {t2 / t1:.2f} | "
              f"{'yes' if tok1 == tok2 else 'no'} |")


if __name__ == "__main__":
    main()
